"""The DMB observer: cursors, states and byte counts of live SMC-D connections, read from the CDC
headers the applications write into each other's DMBs (the daemon is not on the data path).

The daemon keeps one read-only view of each DMB's first page, mapped without a descriptor of its
own, for as long as the pool keeps the memfd (a memfd serves many connections, and mapping and
unmapping per connection was a measurable part of every handoff). The header is read as the
channel writes it (:mod:`smc_handoff.layout`): whole aligned 8-byte words, so a cursor never
tears; an idle connection costs the refresh one comparison of those words.
"""

from __future__ import annotations

import asyncio
import ctypes
import mmap
import os
import sys
from typing import TYPE_CHECKING, Any

from smc_handoff import layout
from smcd_daemon.core.handoff_pairs import Half
from smcd_daemon.core.registry import ConnState, SmcType
from smcd_daemon.wire.cdc import CDC_MSG_TYPE, SMCD_CDC_HEADER_LEN, ConnStateFlag
from smcd_daemon.wire.cursor import Cursor

from .common import log

if TYPE_CHECKING:
    from .server import HandoffServer

__all__ = ["REFRESH_INTERVAL", "DmbObserver", "DmbView", "advance", "read_header"]

REFRESH_INTERVAL = 0.5
"""Cursor/byte refresh period while SMC connections exist (no timer runs otherwise)."""

_HEADER_WORDS = layout.CDC_HEADER_LEN // 8
_ABORT = int(ConnStateFlag.PEER_CONN_ABORT)
_CLOSING = int(ConnStateFlag.PEER_CONN_CLOSED | ConnStateFlag.PEER_DONE_WRITING)

Words = tuple[int, ...]
Header = tuple[tuple[int, int], tuple[int, int], int]
"""(producer (wrap, count), consumer (wrap, count), connection state flags)."""


class _Libc:
    """``mmap(2)``/``munmap(2)`` through ctypes: Python's :class:`mmap.mmap` keeps a duplicate of
    the descriptor for as long as the mapping lives, which would double the daemon's descriptors
    (one more per DMB on top of the pool's memfd)."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self.mmap = libc.mmap
        self.mmap.argtypes = (
            ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
            ctypes.c_long,
        )  # fmt: skip
        self.mmap.restype = ctypes.c_void_p
        self.munmap = libc.munmap
        self.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
        self.munmap.restype = ctypes.c_int


_libc: _Libc | None = None
_MAP_FAILED = ctypes.c_void_p(-1).value


class DmbView:
    """A read-only mapping of a DMB's first page, to read its CDC header without tearing: each
    word is loaded with one 8-byte load (ctypes reads a ``c_uint64`` with one fixed-size
    ``memcpy``, as the channel's memoryview does). The mapping holds no descriptor of its own."""

    def __init__(self, fd: int) -> None:
        global _libc
        if _libc is None:
            _libc = _Libc()
        addr = _libc.mmap(None, mmap.PAGESIZE, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr is None or addr == _MAP_FAILED:
            err = ctypes.get_errno()
            raise OSError(err, f"mapping a DMB header: {os.strerror(err)}")
        self._addr: int | None = addr
        self._words = (ctypes.c_uint64 * _HEADER_WORDS).from_address(addr)

    def words(self) -> Words:
        """The header's words, each loaded whole (cheap to compare with the last read)."""
        if self._addr is None:
            raise ValueError("the DMB view is closed")
        return tuple(self._words)

    def close(self) -> None:
        if self._addr is not None and _libc is not None:
            addr, self._addr = self._addr, None
            _libc.munmap(addr, mmap.PAGESIZE)


def read_header(words: Words) -> Header | None:
    """The cursors and state flags of a header read as :meth:`DmbView.words`, None before the
    peer's first CDC write."""
    if words[layout.W_TYPE].to_bytes(8, sys.byteorder)[0] != CDC_MSG_TYPE:
        return None  # nothing written yet
    pw, pc, _, _ = layout.split_word(words[layout.W_PROD])
    cw, cc, _, csflags = layout.split_word(words[layout.W_CONS])
    return (pw, pc), (cw, cc), csflags


def advance(ring: int, old: tuple[int, int], new: tuple[int, int]) -> int:
    """Bytes from cursor ``old`` (wrap, count) to ``new`` in a ring of ``ring`` bytes, any
    number of wraps apart (the refresh runs often enough that the 16-bit wrap counter cannot
    lap)."""
    delta = ((new[0] - old[0]) & 0xFFFF) * ring + new[1] - old[1]
    return delta if 0 <= delta < 0x8000 * ring else 0


class DmbObserver:
    """Reads the CDC headers of live halves every :data:`REFRESH_INTERVAL` while there are any,
    and once more when a half closes (its last counters)."""

    def __init__(self, server: HandoffServer) -> None:
        self._srv = server
        self._views: dict[int, DmbView] = {}
        self._task: asyncio.Task[None] | None = None

    def view(self, fd: int) -> DmbView:
        """The header view of the pool memfd ``fd``, mapped on first use (the refresh or the
        hang-up reads it; the handshake never does)."""
        view = self._views.get(fd)
        if view is None:
            view = self._views[fd] = DmbView(fd)
        return view

    def forget_view(self, fd: int) -> None:
        """The pool destroys memfd ``fd``: its view goes with it."""
        view = self._views.pop(fd, None)
        if view is not None:
            view.close()

    def start(self) -> None:
        """Refresh while SMC-D halves are live (no timer runs otherwise)."""
        srv = self._srv
        if srv.channels.halves and (self._task is None or self._task.done()):
            assert srv.loop is not None
            self._task = srv.loop.create_task(self._refresh_loop(), name="smcd-cursors")

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _refresh_loop(self) -> None:
        srv = self._srv
        while srv.channels.halves:
            await asyncio.sleep(REFRESH_INTERVAL)
            self.refresh()
        srv.deferred.run()  # the last halves' releases, so the pool's state below is final
        st = srv.pool.stats()
        log.info(
            "handoff: no SMC connection left; DMB pool: %d buffers in use (%d bytes), "
            "%d cached (%d bytes)",
            st.in_use_buffers, st.in_use_bytes,
            st.allocated_buffers - st.in_use_buffers, st.allocated_bytes - st.in_use_bytes,
        )  # fmt: skip

    def refresh(self) -> None:
        """Bring cursors and byte counts of every live SMC connection up to date."""
        for half in list(self._srv.channels.halves.values()):
            try:
                self.refresh_half(half)
            except Exception:
                log.exception("handoff: reading the cursors of connection %d failed", half.conn_id)

    def refresh_half(self, half: Half, *, publish: bool = True) -> None:
        """Read both CDC headers of ``half``: counters always, the record if ``publish``."""
        srv = self._srv
        pair = half.pair
        if pair is None or half.local_token is None or half.peer_token is None:
            return  # released (or a resumed record: no DMBs of ours)
        try:
            mem = srv.channels.memfds(pair)
            words = (self.view(mem[half.local_token]).words(),
                     self.view(mem[half.peer_token]).words())  # fmt: skip
        except (OSError, KeyError) as e:
            log.warning("handoff: connection %d: cannot read its DMB headers: %s", half.conn_id, e)
            return
        if words == half.seen:
            return  # nothing moved since the last refresh (an idle connection costs no more)
        conn = srv.publisher.connection(half.conn_id)
        if conn is None:
            return
        half.seen = words
        rx_hdr = read_header(words[0])  # written by the peer: its producer/consumer cursor
        tx_hdr = read_header(words[1])  # written by this half into the peer's DMB
        changes: dict[str, Any] = {}
        if rx_hdr is not None and publish:
            prod, cons, flags = rx_hdr
            changes["rx_prod"] = Cursor(*prod)
            changes["tx_cons"] = Cursor(*cons)
            if flags & _ABORT and conn.state is not ConnState.PROCESSABORT:
                changes["state"] = ConnState.PEERABORTWAIT
            elif flags & _CLOSING and conn.state is ConnState.ACTIVE:
                changes["state"] = ConnState.APPCLOSEWAIT1
        sent = received = 0
        if tx_hdr is not None:
            prod, cons, _ = tx_hdr
            if publish:
                changes["tx_prod"], changes["rx_cons"] = Cursor(*prod), Cursor(*cons)
            sent = advance(half.tx_size - SMCD_CDC_HEADER_LEN, half.tx_prod, prod)
            received = advance(half.rx_size - SMCD_CDC_HEADER_LEN, half.rx_cons, cons)
            half.tx_prod, half.rx_cons = prod, cons
        if sent:
            changes["bytes_sent"] = conn.bytes_sent + sent
        if received:
            changes["bytes_received"] = conn.bytes_received + received
        if sent or received:
            srv.registry.stats.add_bytes(SmcType.SMCD, tx=sent, rx=received)
        if changes and publish:
            srv.publisher.update(half.conn_id, **changes)
