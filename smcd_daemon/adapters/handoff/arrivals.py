"""Same-host pairs: the client half proposes only once the server half is in this daemon.

Why: the kernel runs the server's side of CLC in its own workqueue, before the application
accepts; smcd can only take the server's side when the application hands its accepted socket
over (ACCEPT). A client half that proposed before that would put a CLC Proposal into a stream
whose server application may never hand it over — because it falls back (no daemon reachable,
a limit, a refusal) or is slow — and read it as data: the corruption of #14. So, toward a
listener registered here (the server half will be served by this very daemon), the client
half waits until the server half has arrived (:meth:`Arrivals.wait_server`) and proposes
only then, having marked the pair *proposed*; when the server half fell back first, or does not
arrive within ``timeouts.clc_wait``, the client falls back itself before any CLC byte.

The server half, in turn, never gives up on a Proposal that is known to be coming: when its
peek finds none after ``timeouts.proposal_wait`` and the pair is *proposed*, it waits on
(:meth:`Arrivals.proposed`); otherwise it marks the pair *fell back* first
(:meth:`Arrivals.server_gone`), so a client arriving later does not propose. A server half
refused before its client half arrived waits for that client's CLC (it cannot know the client
is ours) until a client half of ours reads the fall-back (:meth:`Arrivals.heard`). Both sides run
on one event loop, so "mark, then write" on one side and "check, then decide" on the other
cannot interleave: there is no window in which a Proposal lands in a stream handed back.

Entries are keyed by the connection's :data:`~smcd_daemon.core.handoff_pairs.PairKey`. A server
half that fell back is remembered for :data:`KEEP` seconds (a late client half reads it); one
whose handshake ended otherwise is forgotten at once: its client half is past proposing, and a
later connection may reuse the 4-tuple (ports come round quickly under load). At most
:data:`MAX_ENTRIES` entries.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from smcd_daemon.core.handoff_pairs import PairKey

__all__ = ["KEEP", "MAX_ENTRIES", "Arrivals", "ServerHalf"]

KEEP = 10.0
MAX_ENTRIES = 16384


class ServerHalf(enum.Enum):
    ABSENT = "absent"  # not handed over yet (a client half waits for it)
    WAITING = "waiting"  # handed over; peeking for the Proposal
    PROPOSED = "proposed"  # the client half is writing (or wrote) its Proposal
    FELL_BACK = "fell back"  # handed back to its application without CLC
    DONE = "done"  # its handshake ended otherwise (SMC, or a fallback after CLC)


@dataclass
class _Entry:
    state: ServerHalf
    why: str = ""
    expires: float = 0.0  # 0: not before its server half's handshake ends
    waiters: list[asyncio.Future[None]] = field(default_factory=list)
    heard: list[asyncio.Future[None]] = field(default_factory=list)  # see Arrivals.heard


class Arrivals:
    """Server halves of same-host pairs as the client halves see them (module docstring)."""

    def __init__(self) -> None:
        self._entries: OrderedDict[PairKey, _Entry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def _expire(self) -> None:
        """Forget ended entries past :data:`KEEP` (oldest first), and the oldest idle ones
        beyond :data:`MAX_ENTRIES`."""
        now = time.monotonic()
        entries = self._entries
        doomed: list[PairKey] = []
        size = len(entries)
        for key, entry in entries.items():  # stops at the first one to keep: no copy of all
            over = size - len(doomed) > MAX_ENTRIES
            if not over and not (entry.expires and entry.expires <= now):
                break
            if entry.waiters:
                continue
            doomed.append(key)
        for key in doomed:
            del entries[key]

    @staticmethod
    def _wake(entry: _Entry) -> None:
        for fut in entry.waiters:
            if not fut.done():
                fut.set_result(None)

    # -- the server half --------------------------------------------------------------------

    def server_in(self, key: PairKey) -> bool:
        """The server half of ``key`` was handed over and is about to peek. True if a client
        half was waiting for it: that one proposes on its next step, on this loop turn."""
        self._expire()
        entry = self._entries.pop(key, None)
        if entry is None:
            entry = _Entry(ServerHalf.WAITING)
        else:  # a client half waits already (or a reused 4-tuple)
            entry.state, entry.why, entry.expires = ServerHalf.WAITING, "", 0.0
        self._entries[key] = entry
        woken = any(not fut.done() for fut in entry.waiters)
        self._wake(entry)
        return woken

    def proposed(self, key: PairKey) -> bool:
        """Server half, its peek found no Proposal: is one coming (the client marked it)?"""
        entry = self._entries.get(key)
        return entry is not None and entry.state is ServerHalf.PROPOSED

    def unpropose(self, key: PairKey) -> None:
        """The client half that marked the pair proposed will not propose after all (its
        application hung up meanwhile): its server half waits for no Proposal from it."""
        entry = self._entries.get(key)
        if entry is not None and entry.state is ServerHalf.PROPOSED:
            entry.state = ServerHalf.WAITING

    def server_gone(self, key: PairKey, *, fell_back: bool, why: str = "") -> bool:
        """The server half's handshake ended: handed back without CLC (``fell_back``) or
        otherwise. Kept :data:`KEEP` seconds for a late client half. True when a client half
        of ours was waiting for it: told now, it falls back without a CLC byte, so a refused
        server half need not wait for a Proposal from it."""
        entry = self._entries.pop(key, None)
        if not fell_back and (entry is None or not entry.waiters):
            return False  # nothing to tell a client half; the 4-tuple is free for the next one
        if entry is None:
            entry = _Entry(ServerHalf.DONE)
        entry.state = ServerHalf.FELL_BACK if fell_back else ServerHalf.DONE
        entry.why = why
        entry.expires = time.monotonic() + KEEP
        self._entries[key] = entry  # the newest at the end: expiry goes oldest first
        told = any(not fut.done() for fut in entry.waiters)
        self._wake(entry)
        self._expire()
        return told

    def heard(self, key: PairKey) -> asyncio.Future[None] | None:
        """A refused server half that fell back before its same-host client half arrived, and
        now waits for that client's CLC: a future done once a client half of ours has read the
        fall-back (:meth:`wait_server`) and so sends no CLC byte, which ends the wait at once
        instead of after ``proposal_wait``. None when ``key`` fell back for no one to read."""
        entry = self._entries.get(key)
        if entry is None or entry.state is not ServerHalf.FELL_BACK:
            return None
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry.heard = [f for f in entry.heard if not f.done()]
        entry.heard.append(fut)
        return fut

    def stopping(self, why: str) -> int:
        """The daemon stops: every client half waiting for its server half falls back now,
        before any CLC byte (the server half would never be served). How many were told."""
        told = 0
        for entry in self._entries.values():
            if entry.state is ServerHalf.ABSENT and entry.waiters:
                entry.state, entry.why = ServerHalf.FELL_BACK, why
                told += sum(not fut.done() for fut in entry.waiters)
                self._wake(entry)
        return told

    # -- the client half --------------------------------------------------------------------

    async def wait_server(self, key: PairKey, timeout: float) -> str | None:
        """Client half: wait until the server half of ``key`` is here, then mark the pair
        proposed and return None (the caller proposes without awaiting anything in between);
        or return why not to propose (it fell back, ended, or did not come in ``timeout``)."""
        deadline = time.monotonic() + timeout
        self._expire()
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = _Entry(ServerHalf.ABSENT)
        try:
            while True:
                if entry.state is ServerHalf.WAITING:
                    entry.state = ServerHalf.PROPOSED
                    return None
                if entry.state is ServerHalf.FELL_BACK:
                    for told in entry.heard:  # this client sends no CLC: its server half
                        if not told.done():  # need not wait for any
                            told.set_result(None)
                    return f"the server half fell back before this client proposed: {entry.why}"
                if entry.state is not ServerHalf.ABSENT:
                    return f"the server half already ended its handshake ({entry.state.value})"
                left = deadline - time.monotonic()
                if left <= 0:
                    return (
                        "the server application did not hand its connection to smcd within "
                        f"{timeout:g} s (timeouts.clc_wait)"
                    )
                loop = asyncio.get_running_loop()
                fut: asyncio.Future[None] = loop.create_future()
                entry.waiters.append(fut)
                handle = loop.call_later(left, _settle, fut)
                try:
                    await fut
                finally:
                    handle.cancel()
                    entry.waiters.remove(fut)
        finally:
            # nobody waits for a server half that never came (timeout, cancel): forget it
            gone = entry.state is ServerHalf.ABSENT and not entry.waiters
            if gone and self._entries.get(key) is entry:
                del self._entries[key]


def _settle(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)
