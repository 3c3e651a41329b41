"""The handoff server's gate: per-user caps, fair shares and overload, carried out
(:mod:`smcd_daemon.core.admission` decides), plus the rate-limited log every per-input warning
of the server goes through.

Where a request is refused, and how
    At accept: a user with :attr:`~smcd_daemon.config.LimitsConfig.pending_per_user` connections
    that sent no request yet, or at their cap of handoff connections, or past their share of a
    full daemon, gets a FALLBACK at once and the connection closed. The library reads it as the
    answer to the request it sends (or finds the connection closed before it could send: then
    it never handed anything over); either way the TCP socket is untouched. Before a handshake:
    a user at their cap of handshakes in flight, past their share of a full handshake capacity,
    or any user while the event loop runs late, gets a FALLBACK before any CLC byte. Quota
    refusals are MAX_DMB, a busy daemon DAEMON_BUSY (0xFF000005); the explanation names the
    limit, what the user held and the key to change.
Overload
    A timer ticks every :data:`TICK` seconds; its lateness is the event loop's lag, fed to the
    :class:`~smcd_daemon.core.admission.OverloadMeter` when the loop was busy meanwhile (its
    thread used at least :data:`BUSY_SHARE` of the time on the CPU): a daemon woken from
    SIGSTOP, or one that simply waited for the CPU, is late without being overloaded, and
    refusing the requests that queued meanwhile would only make their connections TCP. The same
    tick closes connections that sent no request within ``limits.first_request_wait`` and
    reports suppressed log lines.
Logging
    Whatever a peer or another user can cause as often as they like is logged through
    :data:`warn` (10 lines per kind per minute, then a count), never with a traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from typing import TYPE_CHECKING

from smc_handoff import messages as m
from smcd_daemon.adapters.ratelimit import RateLimitedLog
from smcd_daemon.core.admission import Admission, Denied, Limits
from smcd_daemon.wire.reasons import DeclineReason, LocalReason

from .common import fallback_message, log

if TYPE_CHECKING:
    from .common import Client, PeerCred
    from .server import HandoffServer

__all__ = ["TICK", "Gate", "fallback_for", "warn"]

TICK = 0.25
"""Seconds between the gate's ticks (lag sample, overdue connections, log report)."""
_FLUSH_EVERY = 20  # ticks between reports of suppressed log lines
BUSY_SHARE = 0.5
"""Share of a late tick's interval the loop's thread must have run for the lag to count."""

warn = RateLimitedLog(log, burst=10, period=60.0)
"""The handoff server's per-input warnings (see the module docstring)."""


def fallback_for(denied: Denied) -> m.Fallback:
    """The FALLBACK that answers a refusal: MAX_DMB for a quota, DAEMON_BUSY otherwise."""
    code = DeclineReason.MAX_DMB if denied.quota else LocalReason.DAEMON_BUSY
    return fallback_message(int(code), denied.detail)


class Gate:
    """Admission carried out for one :class:`~.server.HandoffServer` (module docstring)."""

    def __init__(self, server: HandoffServer) -> None:
        self._srv = server
        self.admission = Admission(Limits.from_config(server.cfg))
        self.pending: dict[Client, float] = {}
        """Connections without a request yet, oldest first, with their accept time."""
        self._timer: asyncio.TimerHandle | None = None
        self._due = 0.0
        self._last = (0.0, 0.0)  # (loop time, thread CPU time) of the last tick
        self._ticks = 0

    def configure(self) -> None:
        self.admission.configure(Limits.from_config(self._srv.cfg))

    # -- the tick ---------------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._due = loop.time() + TICK
        self._last = (loop.time(), time.thread_time())
        self._timer = loop.call_at(self._due, self._tick)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        warn.flush(force=True)

    def _tick(self) -> None:
        loop = self._srv.loop
        if loop is None:
            return
        now, cpu = loop.time(), time.thread_time()
        wall = now - self._last[0]
        busy = wall > 0 and (cpu - self._last[1]) >= BUSY_SHARE * wall
        self._last = (now, cpu)
        self.admission.meter.sample(now, max(0.0, now - self._due) if busy else 0.0)
        try:
            self._expire_pending(now)
            self._ticks += 1
            if self._ticks % _FLUSH_EVERY == 0:
                warn.flush()
                self._srv.journal.compact()
        finally:
            self._due = now + TICK
            self._timer = loop.call_at(self._due, self._tick)

    def _expire_pending(self, now: float) -> None:
        for client, accepted in list(self.pending.items()):
            if not self.admission.overdue(accepted, now):
                break  # oldest first: the rest are younger
            wait = self.admission.limits.first_request_wait
            warn.info(
                "no-request",
                "handoff: %s sent no request within %g s (limits.first_request_wait); closed",
                client.label,
                wait,
            )
            self._srv.stats.refused_connections += 1
            self._srv.expire(client)

    # -- handoff connections ----------------------------------------------------------------

    def admit(self, conn: socket.socket, cred: PeerCred | None) -> bool:
        """A connection was accepted: True if it may be served; otherwise it was answered
        with a FALLBACK and closed."""
        uid = cred.uid if cred is not None else 65534
        denied = self.admission.connect(uid)
        if denied is None:
            return True
        self.refuse(conn, cred, denied)
        return False

    def refuse(self, conn: socket.socket, cred: PeerCred | None, denied: Denied) -> None:
        self._srv.stats.refused_connections += 1
        with contextlib.suppress(OSError):
            conn.setblocking(False)
            m.send_message(conn, fallback_for(denied))
        conn.close()
        who = str(cred) if cred is not None else "unknown peer"
        warn.warning(f"refused-{denied.refusal.name.lower()}", "handoff: %s refused: %s", who,
                     denied.detail)  # fmt: skip

    def served(self, client: Client, loop_time: float) -> None:
        """``client`` (admitted) waits for its first request from ``loop_time`` on."""
        self.pending[client] = loop_time

    def first_request(self, client: Client) -> None:
        if self.pending.pop(client, None) is not None:
            self.admission.first_request(client.uid)

    def release(self, client: Client) -> None:
        """``client``'s connection ended (exactly once per admitted connection)."""
        pending = self.pending.pop(client, None) is not None
        self.admission.disconnect(client.uid, pending=pending)
