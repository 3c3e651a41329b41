"""The handoff server's gate: per-user caps, fair shares and overload, carried out
(:mod:`smcd_daemon.core.admission` decides), plus the rate-limited log every per-input warning
of the server goes through.

Where a request is refused, and how
    At accept: a connection of a user with ``limits.pending_per_user`` connections that sent no
    request yet (unless its own request already waits in it: a burst queued while the loop was
    busy is accepted in one turn, before any of its requests is read), or at their cap of
    handoff connections, or past their share of a full daemon,
    is *parked*: the daemon keeps only its descriptor, watched for readability, and does no
    work for it until its client speaks or hangs up; then it answers FALLBACK (the library reads
    it as the answer to its request: its TCP socket is untouched) and closes it. Why not close
    at once: a flood reconnects as fast as it is refused, and that churn (tens of thousands of
    accepts a second) is what took the daemon and the listen queue from every other user; a
    parked connection costs one descriptor and no CPU, so the flood's connections sit idle.
    Parking is bounded: :data:`PARK_RESERVE` descriptors are always left for real work, and a
    user parks at most their fair share of the rest; beyond that a connection is answered and
    closed at once. Before a handshake:
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
import ctypes
import gc
import resource
import select
import socket
import time
from typing import TYPE_CHECKING

from smc_handoff import messages as m
from smcd_daemon.adapters.ratelimit import RateLimitedLog, flush_all
from smcd_daemon.core.admission import Admission, Denied, Limits
from smcd_daemon.wire.reasons import DeclineReason, LocalReason

from .common import fallback_message, log
from .predecline import refused_accept, refused_connect

if TYPE_CHECKING:
    from .common import Client, PeerCred
    from .server import HandoffServer

__all__ = ["PARK_RESERVE", "TICK", "Gate", "fallback_for", "warn"]

TICK = 0.25
"""Seconds between the gate's ticks (lag sample, overdue connections, log report)."""
_FLUSH_EVERY = 20  # ticks between reports of suppressed log lines
PARK_RESERVE = 4096
"""Descriptors parking never takes (served connections, handshakes, DMBs, the journal)."""
_TRIM_AFTER = 1024  # parked connections at once after which their end returns memory
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
        self.parked: dict[int, int] = {}
        """Refused connections kept as bare descriptors until their client speaks or hangs up
        (descriptor → uid), watched by an epoll of their own (no object per connection)."""
        self._parked_by: dict[int, int] = {}
        self._why: dict[int, Denied] = {}  # uid → its latest refusal, for the answers
        self._park_ep: select.epoll | None = None
        self._park_peak = 0
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        limit = soft if soft != resource.RLIM_INFINITY else 1 << 20
        self.park_budget = max(0, limit - PARK_RESERVE)
        self._timer: asyncio.TimerHandle | None = None
        self._due = 0.0
        self._last = (0.0, 0.0)  # (loop time, thread CPU time) of the last tick
        self._ticks = 0

    def configure(self) -> None:
        self.admission.configure(Limits.from_config(self._srv.cfg))

    # -- the tick ---------------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._park_ep = select.epoll()
        loop.add_reader(self._park_ep.fileno(), self._park_events)
        self._due = loop.time() + TICK
        self._last = (loop.time(), time.thread_time())
        self._timer = loop.call_at(self._due, self._tick)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for fd in list(self.parked):
            self._unpark(fd, answer=False)
        if self._park_ep is not None:
            loop = self._srv.loop
            if loop is not None:
                loop.remove_reader(self._park_ep.fileno())
            self._park_ep.close()
            self._park_ep = None
        flush_all(force=True)

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
            self._srv.channels.expire(now)
            self._srv.publisher.sweep_lgrs(now)
            self._srv.journal.flush()  # hang-ups' lines no channel's line took along
            self._ticks += 1
            if self._ticks % _FLUSH_EVERY == 0:
                flush_all()
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

    def admit(self, conn: socket.socket, cred: PeerCred | None) -> bool | None:
        """A connection was accepted: True if it may be served and waits for its first
        request, None if it may be served and that request is already in it (then it is not
        pending: :meth:`served` is not called); False if it was answered with a FALLBACK and
        closed.

        Whether a request waits is asked only at the pending cap (one ``recv`` peek): a burst
        of connections that all spoke, queued while the loop was busy, is accepted whole in
        one turn, and the first served of them have not had their requests read yet."""
        uid = cred.uid if cred is not None else 65534
        spoke = self.admission.at_pending_cap(uid) and _spoke(conn)
        denied = self.admission.connect(uid, spoke=spoke)
        if denied is None:
            return None if spoke else True
        self.refuse(conn, cred, denied)
        return False

    def refuse(self, conn: socket.socket, cred: PeerCred | None, denied: Denied) -> None:
        """Park ``conn`` (module docstring), or answer and close it when its user has parked
        their share."""
        self._srv.stats.refused_connections += 1
        who = str(cred) if cred is not None else "unknown peer"
        warn.warning(f"refused-{denied.refusal.name.lower()}", "handoff: %s refused: %s", who,
                     denied.detail)  # fmt: skip
        uid = denied.uid
        mine = self._parked_by.get(uid, 0)
        users = len(self._parked_by) + (uid not in self._parked_by)
        ep = self._park_ep
        if ep is not None and mine < self.park_budget // users:
            fd = conn.fileno()
            try:
                ep.register(fd, select.EPOLLIN)
            except OSError:
                _answer(conn, denied, self._srv)
                return
            conn.detach()
            self.parked[fd] = uid
            self._why[uid] = denied
            self._parked_by[uid] = mine + 1
            self._park_peak = max(self._park_peak, len(self.parked))
            return
        _answer(conn, denied, self._srv)

    def _park_events(self) -> None:
        ep = self._park_ep
        if ep is None:
            return
        for fd, _ev in ep.poll(0, 256):
            self._unpark(fd)

    def _unpark(self, fd: int, *, answer: bool = True) -> None:
        """A parked connection spoke or hung up (or the server stops): answer it and close it."""
        uid = self.parked.pop(fd, None)
        if uid is None:
            return
        denied = self._why[uid]
        left = self._parked_by.get(uid, 1) - 1
        if left > 0:
            self._parked_by[uid] = left
        else:
            self._parked_by.pop(uid, None)
            self._why.pop(uid, None)
        if self._park_ep is not None:
            try:  # noqa: SIM105 (before the close: epoll keys on the open file)
                self._park_ep.unregister(fd)
            except OSError:
                pass
        conn = socket.socket(fileno=fd)
        if answer:
            _answer(conn, denied, self._srv)
        else:
            conn.close()
        if not self.parked and self._park_peak >= _TRIM_AFTER:
            self._after_flood()

    def _after_flood(self) -> None:
        """The last parked connection of a flood is gone: give its memory back (the tables
        keep their peak size, and the allocator its heap, unless told)."""
        self._park_peak = 0
        self.parked = {}
        gc.collect()
        _malloc_trim()

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


def _answer(conn: socket.socket, denied: Denied, srv: HandoffServer | None = None) -> None:
    """Answer a refused connection with its FALLBACK and close it. What the client sent is read
    first (and its descriptors closed): closing a socket with unread data makes the peer's next
    read fail with ECONNRESET before it could read the answer. Toward a peer that showed the
    SMC option a CONNECT is declined first, an ACCEPT answered once its client's Proposal is
    declined (:mod:`.predecline`)."""
    later = False
    try:
        conn.setblocking(False)
        reply = fallback_for(denied)
        for _ in range(8):
            try:
                msg, fds = m.recv_message(conn, requests=True)
            except m.HandoffProtocolError:
                continue  # read, and its descriptors closed: nothing else to do with it
            except BlockingIOError:
                break  # all read
            if srv is not None and fds and isinstance(msg, m.Connect):
                if refused_connect(srv.detection, fds[0], reply.code):
                    reply = fallback_message(reply.code, denied.detail, after_decline=True)
            elif srv is not None and fds and isinstance(msg, m.Accept):
                # our own client half, if parked for this server half, falls back without a
                # byte once told: then no Proposal is coming and the answer goes out at once
                told, key = srv.handshakes.server_refused(fds[0], denied.detail)
                later = not told and refused_accept(srv, conn, fds[0], reply, key)
                if later:
                    fds = fds[1:]  # handed over with ``conn``
            m.close_fds(fds)
        if not later:
            m.send_message(conn, reply)
    except (OSError, m.HandoffClosedError):
        pass  # the client is gone
    finally:
        if not later:
            conn.close()


def _spoke(conn: socket.socket) -> bool:
    """Does a datagram (or the hang-up) wait in ``conn``? A peek without room for descriptors:
    the kernel installs none (it drops its copies again)."""
    try:
        conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except OSError:  # EAGAIN: nothing yet; anything else: its task will find out
        return False
    return True


def _malloc_trim() -> None:
    """glibc's ``malloc_trim(0)``: return free heap pages to the system (no-op elsewhere)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).malloc_trim(0)
