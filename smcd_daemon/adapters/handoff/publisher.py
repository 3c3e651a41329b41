"""Off the hot path: registry records published late and in batches, bookkeeping deferred behind
the next handshake, fallen-back records that linger, link groups freed when idle.

A handoff costs the daemon a few event-loop turns; what no reply waits for stays off them.
Exporting a D-Bus object costs more than the whole handshake, so records reach the registry
only once they have lived :data:`PUBLISH_DELAY` (short request/response connections are
counted, never exported); a channel's record and counters, notices and a hung-up half's release
are deferred by :data:`DEFER_DELAY` (in order, in batches) and run then, or, when a handshake
is in flight, right after its reply (the gap while applications map their channels), at the
latest :data:`DEFER_LATEST` later.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from smcd_daemon.core.registry import Connection, ConnMode, RegistryError

from .common import log
from .gate import warn

if TYPE_CHECKING:
    import asyncio

    from .server import HandoffServer

__all__ = [
    "DEFER_DELAY",
    "DEFER_LATEST",
    "DEFER_MAX",
    "FALLBACK_KEEP",
    "FALLBACK_LINGER",
    "LGR_FREE_DELAY",
    "PUBLISH_DELAY",
    "PUBLISH_MAX",
    "PUBLISH_PACE",
    "Deferred",
    "Publisher",
]


FALLBACK_LINGER = 30.0
"""Seconds a fallen-back connection stays in the registry: the daemon gave back its copy of the
socket, so it cannot see when the application closes it."""
FALLBACK_KEEP = 256
"""At most this many fallen-back connections are kept visible (the oldest go first)."""
LGR_FREE_DELAY = 10.0
"""A link group without connections is freed after this delay (the kernel waits 10 minutes;
loopback link groups cost nothing to recreate)."""
PUBLISH_DELAY = 0.05
"""New connections reach the registry (and D-Bus) once they have lived this long, in batches:
exporting a D-Bus object costs more than the whole handshake, so it stays off that path, and a
connection that is gone again before then (a short request/response connection) is only
counted, never exported."""
PUBLISH_MAX = 128
"""Records published per timer run; more wait :data:`PUBLISH_PACE` (a steady flow of D-Bus
signals instead of bursts of thousands when many connections open at once)."""
PUBLISH_PACE = 0.005
DEFER_DELAY = 0.002
"""Bookkeeping that no reply waits for — a channel's registry record and counters, notices,
a hung-up half's release — runs this much later, in batches, and not in the middle of a
handshake (a delay that ends during one runs after its reply, or :data:`DEFER_LATEST` later
when handshakes overlap without a gap): the handshakes that arrive meanwhile (the next
connection of a client that just closed one) go first. A handshake short of DMB quota runs the
pending releases at once (``LoopbackIsm.reclaim``), so limits see released buffers exactly as
before."""
DEFER_LATEST = 0.008
"""Seconds deferred bookkeeping waits past its delay for the handshakes in flight to reply,
at most."""
DEFER_MAX = 256
"""Deferred calls that are run at once, whatever the delay (bounded memory under load)."""


class Deferred:
    """Calls that run soon, after what is waiting now, in the order they were deferred."""

    def __init__(self, server: HandoffServer) -> None:
        self._srv = server
        self._later: list[tuple[Callable[..., None], tuple[Any, ...]]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._due = False  # the delay ended during a handshake: run after its reply

    def __bool__(self) -> bool:
        return bool(self._later)

    def defer(self, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn(*args)`` soon (see :data:`DEFER_DELAY`)."""
        self._later.append((fn, args))
        if len(self._later) >= DEFER_MAX:
            self.run()
        elif self._timer is None and not self._due and self._srv.loop is not None:
            self._timer = self._srv.loop.call_later(DEFER_DELAY, self._fire)

    def _fire(self) -> None:
        """The delay is over: run now, or, with a handshake in flight, right after its reply
        (:meth:`idle_soon`), and at the latest :data:`DEFER_LATEST` later (handshakes that
        overlap without a gap must not hold the releases back)."""
        self._timer = None
        loop = self._srv.loop
        if not self._due and loop is not None and self._busy():
            self._due = True
            self._timer = loop.call_later(DEFER_LATEST, self._fire)
            return
        self.run()

    def _busy(self) -> bool:
        """Is a handshake in flight, or about to be: a handoff connection accepted whose
        request its task has not read yet, or one still in the listen queue? (A batch run
        between the accept of the two halves of the next connection and the reading of their
        requests held that connection back by the whole batch: the gap it was meant for comes
        right after the replies, while the applications map their channels.)"""
        srv = self._srv
        return bool(srv.admission.inflight or srv.gate.pending) or srv.backlogged()

    def run(self) -> bool:
        """Run every deferred call now; True if there was one."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._due = False
        ran = False
        while self._later:
            work, self._later = self._later, []
            ran = True
            for fn, args in work:
                try:
                    fn(*args)
                except Exception as e:
                    self._srv.stats.errors += 1
                    name = getattr(fn, "__name__", fn)
                    warn.error("deferred", "handoff: deferred %s failed: %s: %s", name,
                               type(e).__name__, e)  # fmt: skip
                    log.debug("handoff: the deferred error", exc_info=e)
        return ran

    def idle_soon(self) -> None:
        """The last handshake in flight has replied: bookkeeping whose delay ended during it
        runs now (on the next loop turn), in the gap while the applications map their
        channels. Bookkeeping still within its delay waits for it: running each connection's
        at once cost a loop turn and a timer cancelled per connection, and put smcd on a CPU
        just when both applications want theirs."""
        loop = self._srv.loop
        if self._due and not self._srv.admission.inflight and loop is not None:
            loop.call_soon(self._run_if_idle)

    def _run_if_idle(self) -> None:
        if self._due and not self._busy():
            self.run()


class Publisher:
    """The handoff server's view of the registry: records published once they have lived a
    while, fallen-back records that linger, link groups freed once idle."""

    def __init__(self, server: HandoffServer) -> None:
        self._srv = server
        self._unpublished: dict[int, Connection] = {}
        self._due: dict[int, float] = {}  # conn_id → when it is published (insertion = due order)
        self._timer: asyncio.TimerHandle | None = None
        self._fallbacks: OrderedDict[int, float] = OrderedDict()
        self._idle_lgrs: dict[int, float] = {}
        """Link groups without connections → the loop time they became idle (oldest first):
        freed by :meth:`sweep_lgrs` once idle for :data:`LGR_FREE_DELAY`, without a timer
        per connection (each connection's close made one, the next connection cancelled it,
        and the cancelled handles piled up in the loop's timer heap)."""

    # -- records, batched -----------------------------------------------------------------------

    def add(self, conn: Connection) -> None:
        """Add ``conn`` to the registry once it has lived :data:`PUBLISH_DELAY` seconds."""
        self._unpublished[conn.conn_id] = conn
        self._due[conn.conn_id] = time.monotonic() + PUBLISH_DELAY
        loop = self._srv.loop
        if self._timer is None and loop is not None:
            self._timer = loop.call_later(PUBLISH_DELAY, self._publish_due)

    def _publish_due(self) -> None:
        """The timer: publish the connections that are due (at most :data:`PUBLISH_MAX` at a
        time: each is a D-Bus signal, and a burst of thousands overruns the bus socket), then
        wait for the next one."""
        self._timer = None
        now = time.monotonic()
        due: list[int] = []
        for conn_id, when in self._due.items():
            if when > now or len(due) >= PUBLISH_MAX:
                break
            due.append(conn_id)
        self._publish(due)
        loop = self._srv.loop
        if self._due and loop is not None:
            wait = max(next(iter(self._due.values())) - now, PUBLISH_PACE)
            self._timer = loop.call_later(wait, self._publish_due)

    def publish(self) -> None:
        """Add every pending connection to the registry now."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._publish(list(self._due))

    def _publish(self, conn_ids: list[int]) -> None:
        registry = self._srv.registry
        for conn_id in conn_ids:
            del self._due[conn_id]
            conn = self._unpublished.pop(conn_id)
            if conn.lgr_id is not None and registry.link_group(conn.lgr_id) is None:
                conn = dataclasses.replace(conn, lgr_id=None)
            try:
                registry.add_connection(conn)
            except RegistryError as e:
                warn.warning("registry", "handoff: registry: %s", e)

    def connection(self, conn_id: int) -> Connection | None:
        conn = self._unpublished.get(conn_id)
        return conn if conn is not None else self._srv.registry.connection(conn_id)

    def update(self, conn_id: int, **changes: Any) -> None:
        conn = self._unpublished.get(conn_id)
        if conn is not None:
            self._unpublished[conn_id] = dataclasses.replace(conn, **changes)
            return
        with contextlib.suppress(RegistryError):
            self._srv.registry.update_connection(conn_id, **changes)

    def remove(self, conn_id: int) -> Connection | None:
        """Take a connection out (published or not); a fallback never published still counts."""
        conn = self._unpublished.pop(conn_id, None)
        if conn is not None:
            del self._due[conn_id]
            if conn.mode is ConnMode.TCP and conn.fallback_reason:
                self._srv.registry.stats.count_fallback(conn.fallback_reason, conn.role)
            return conn
        try:
            return self._srv.registry.remove_connection(conn_id)
        except RegistryError:
            return None

    # -- fallen-back records --------------------------------------------------------------------

    def linger(self, conn_id: int) -> None:
        """Keep a fallen-back connection visible for a while, bounded in number."""
        self._fallbacks[conn_id] = time.monotonic() + FALLBACK_LINGER
        while len(self._fallbacks) > FALLBACK_KEEP:
            old, _ = self._fallbacks.popitem(last=False)
            self.remove(old)
        assert self._srv.loop is not None
        self._srv.loop.call_later(FALLBACK_LINGER, self._expire_fallbacks)

    def _expire_fallbacks(self) -> None:
        now = time.monotonic()
        while self._fallbacks:
            conn_id, until = next(iter(self._fallbacks.items()))
            if until > now:
                return
            del self._fallbacks[conn_id]
            self.remove(conn_id)

    # -- link groups ----------------------------------------------------------------------------

    def keep_lgr(self, lgr_id: int) -> None:
        """A connection uses ``lgr_id`` again: it is not to be freed."""
        self._idle_lgrs.pop(lgr_id, None)

    def maybe_free_lgr(self, lgr_id: int) -> None:
        """Free ``lgr_id`` after :data:`LGR_FREE_DELAY` if it has no connection by then."""
        if lgr_id in self._idle_lgrs:
            return
        lgr = self._srv.registry.link_group(lgr_id)
        loop = self._srv.loop
        if lgr is None or lgr.conns or loop is None:
            return
        self._idle_lgrs[lgr_id] = loop.time()

    def sweep_lgrs(self, now: float) -> None:
        """Free the link groups idle for :data:`LGR_FREE_DELAY` by loop time ``now`` (the
        gate's tick: at most a tick late)."""
        due = now - LGR_FREE_DELAY
        idle = self._idle_lgrs
        while idle:
            lgr_id, since = next(iter(idle.items()))
            if since > due:
                return
            del idle[lgr_id]
            self._free_lgr(lgr_id)

    def _free_lgr(self, lgr_id: int) -> None:
        srv = self._srv
        srv.deferred.run()  # a deferred record may still name this link group
        lgr = srv.registry.link_group(lgr_id)
        waiting = any(c.lgr_id == lgr_id for c in self._unpublished.values())
        if lgr is None or lgr.conns or srv.admission.inflight or waiting:
            if lgr is not None and not lgr.conns:
                self.maybe_free_lgr(lgr_id)  # a handshake may be about to use it: later
            return
        srv.loopback.link_groups.discard(lgr_id)
        srv.registry.remove_link_group(lgr_id)
        log.info("handoff: link group %#x freed", lgr_id)

    def close(self) -> None:
        """The server stops: no timer of ours fires any more."""
        self._idle_lgrs.clear()
        if self._timer is not None:
            self._timer.cancel()
