"""Who may use the handoff server, and how much of it: per-user caps, a fair share of the
daemon's handshake capacity, and overload detection — decided before any CLC byte.

Why here and why so early: a connection handed to smcd ends as an SMC channel, as TCP exactly as
the application left it, or as an error. Only a refusal made before the first CLC byte leaves
TCP as it was, so every limit is checked at the two points where that is still true: when a
handoff connection is accepted (:meth:`Admission.connect`) and when a CONNECT/ACCEPT is about to
start its handshake (:meth:`Admission.begin_handshake`). Past them a handshake runs to its end.
The kernel does the same for AF_SMC listeners: ``smc_hs_congested`` (net/smc/af_smc.c) answers a
SYN without the SMC option while its handshake workqueue is congested, so the client never
proposes, and ``smc_tcp_syn_recv_sock`` counts handshakes in progress against the accept
backlog; it never starts a handshake it may not be able to finish.

What is limited (:class:`Limits`, from ``[limits]`` and ``[quota]`` in the configuration):

Pending handoff connections, per user
    Accepted, no request read yet. The library sends its request right after ``connect``, so a
    legitimate user has few at any time; idle ones are what a flood is made of (one user
    holding 15,000 of them made every other user's handoffs fail). Past the cap the daemon
    answers the new connection at once with a FALLBACK and closes it: the application keeps its
    TCP socket as it left it. Pending connections that send nothing within
    ``first_request_wait`` are closed (the adapter's timer; :meth:`Admission.overdue`).
Handoff connections, per user and in total
    Everything a user holds: pending ones, handshakes, channel halves, listeners, resumed
    records. Per user the cap follows the DMB quota (two connection halves per DMB the user may
    hold, plus room for listeners and handshakes) unless ``limits.connections_per_user`` says
    otherwise. In total the daemon serves :data:`MAX_CONNECTIONS`; above half of it the
    connections are shared fairly (below).
Handshakes in flight, per user and in total
    ``limits.handshakes_per_user`` per user; ``limits.handshakes`` is the daemon's capacity. A
    client half parked for its server half on this host is not one while it waits
    (:meth:`Admission.park_handshake`).
Fair share
    While a pool (connections or handshakes) is at or above its capacity, a user may add to it
    only while they hold less than ``capacity / users`` (users = those holding some, plus the
    one asking). A user with less than their share is always admitted, so one user's load never
    locks another out; the total above the capacity is bounded by the capacity again (each user
    can be admitted over it only up to its share), which is what :attr:`FairPool.ceiling` is.
Overload
    An event loop that runs late (``limits.overload_lag`` seconds behind its timers, measured by
    the adapter and fed to :class:`OverloadMeter`) cannot keep CLC's timers; while it is late,
    every new handshake falls back at once, cleanly, instead of timing out half-way.

Everything here is counts and decisions; the adapter (``adapters/handoff``) carries them out
and maps a :class:`Denied` to its FALLBACK (code and detail, see :attr:`Denied.quota`).
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass
from typing import Any

__all__ = [
    "MAX_CONNECTIONS",
    "Admission",
    "Denied",
    "FairPool",
    "Limits",
    "Over",
    "OverloadMeter",
    "Refusal",
    "session_limit",
]

MAX_CONNECTIONS = 16384
"""Handoff connections the daemon serves at once, all users together (each SMC connection holds
one per half; the daemon raises its descriptor limit to match)."""


def session_limit(quota_connections: int) -> int:
    """Handoff connections a uid may hold by its DMB quota (0 = no limit): two per allowed DMB
    (both halves of a same-user connection) plus a few listeners and handshakes in flight."""
    return 2 * quota_connections + 64 if quota_connections else 0


class Refusal(enum.Enum):
    """Why a request is refused before any CLC byte (the value names the config key)."""

    PENDING = "limits.pending_per_user"
    CONNECTIONS = "limits.connections_per_user"
    HANDSHAKES = "limits.handshakes_per_user"
    FAIR_SHARE = "limits.handshakes"
    FULL = "the daemon's connection limit"
    OVERLOADED = "limits.overload_lag"


_WHAT = {
    Refusal.PENDING: "handoff connections that sent no request yet",
    Refusal.CONNECTIONS: "handoff connections",
    Refusal.HANDSHAKES: "handshakes in flight",
}


@dataclass(frozen=True)
class Denied:
    """A refusal, with what the operator needs to understand it."""

    refusal: Refusal
    uid: int
    held: int
    """What ``uid`` held of the limited thing when it asked (the request not counted)."""
    limit: int
    """The limit it met: a cap, a fair share, or (OVERLOADED) the lag in milliseconds."""
    users: int = 1
    """Users sharing the pool (FAIR_SHARE)."""

    @property
    def quota(self) -> bool:
        """A per-user cap (a quota: FALLBACK MAX_DMB), rather than the daemon being busy."""
        return self.refusal in (Refusal.PENDING, Refusal.CONNECTIONS, Refusal.HANDSHAKES)

    @property
    def detail(self) -> str:
        """The FALLBACK's explanation, in an operator's words, naming the key to change."""
        r = self.refusal
        if r in _WHAT:
            return f"uid {self.uid} holds {self.held} {_WHAT[r]}; {r.value} allows {self.limit}"
        if r is Refusal.FAIR_SHARE:
            return (
                f"smcd is at its handshake capacity ({r.value}); uid {self.uid} has "
                f"{self.held} in flight, its fair share among {self.users} users is {self.limit}"
            )
        if r is Refusal.FULL:
            return (
                f"smcd serves its most handoff connections ({MAX_CONNECTIONS}); uid {self.uid} "
                f"holds {self.held}, its fair share among {self.users} users is {self.limit}"
            )
        return (
            f"smcd is overloaded: its event loop runs {self.limit} ms late ({r.value}); "
            "no handshake was started"
        )


@dataclass(frozen=True)
class Limits:
    """The limits in force (0 = no limit for the per-user caps)."""

    pending_per_user: int = 64
    connections_per_user: int = session_limit(2048)
    handshakes_per_user: int = 64
    handshakes: int = 256
    first_request_wait: float = 5.0
    overload_lag: float = 1.0
    connections: int = MAX_CONNECTIONS

    @classmethod
    def from_config(cls, config: Any) -> Limits:
        """From a :class:`smcd_daemon.config.Config` (read by attribute: core does not import
        the configuration). ``limits.connections_per_user`` 0 follows ``quota.connections``."""
        lim = config.limits
        per_user = lim.connections_per_user or session_limit(config.quota.connections)
        return cls(
            pending_per_user=lim.pending_per_user,
            connections_per_user=per_user,
            handshakes_per_user=lim.handshakes_per_user,
            handshakes=lim.handshakes,
            first_request_wait=lim.first_request_wait,
            overload_lag=lim.overload_lag,
        )


@dataclass(frozen=True)
class Over:
    """What :meth:`FairPool.check` ran into: the per-user cap, or (``shared``) the fair share
    of a full pool."""

    shared: bool
    held: int
    limit: int
    users: int


class FairPool:
    """Counts per user of one shared thing, and the fair-share rule (module docstring).

    ``capacity`` is where sharing starts; the pool never holds more than :attr:`ceiling`."""

    def __init__(self, capacity: int, per_user: int = 0) -> None:
        if capacity < 1 or per_user < 0:
            raise ValueError("capacity must be ≥ 1 and per_user ≥ 0")
        self.capacity = capacity
        self.per_user = per_user
        self.total = 0
        self._held: dict[int, int] = {}

    @property
    def ceiling(self) -> int:
        """The most the pool ever holds: the capacity, plus at most the capacity again of users
        admitted below their share while it was full."""
        return 2 * self.capacity

    def held(self, uid: int) -> int:
        return self._held.get(uid, 0)

    @property
    def users(self) -> int:
        """Users holding something."""
        return len(self._held)

    def check(self, uid: int) -> Over | None:
        """None if ``uid`` may add one more; else what it ran into."""
        mine = self._held.get(uid, 0)
        users = len(self._held) + (uid not in self._held)
        if self.per_user and mine >= self.per_user:
            return Over(False, mine, self.per_user, users)
        if self.total >= self.capacity:
            share = max(1, self.capacity // users)
            if mine >= share or self.total >= self.ceiling:
                return Over(True, mine, share, users)
        return None

    def add(self, uid: int) -> None:
        self._held[uid] = self._held.get(uid, 0) + 1
        self.total += 1

    def remove(self, uid: int) -> None:
        """One of ``uid``'s is gone (an unknown uid is ignored: releases run exactly once by
        construction, but a count must never go negative)."""
        mine = self._held.get(uid, 0)
        if mine <= 0:
            return
        if mine == 1:
            del self._held[uid]
        else:
            self._held[uid] = mine - 1
        self.total -= 1


class OverloadMeter:
    """Is the event loop keeping its timers? Fed the lateness of a periodic timer
    (:meth:`sample`); overloaded while any sample of the last ``window`` seconds reached
    ``threshold``. A single late tick (a SIGSTOP, a swap-in) marks one window, no more."""

    def __init__(self, threshold: float, window: float = 1.0) -> None:
        self.threshold = threshold
        self.window = window
        self._late: deque[tuple[float, float]] = deque()  # (when, lag) of samples ≥ threshold
        self.worst = 0.0
        """The largest lag seen (seconds), for statistics."""

    def sample(self, now: float, lag: float) -> None:
        self.worst = max(self.worst, lag)
        if self.threshold > 0 and lag >= self.threshold:
            self._late.append((now, lag))
        self._expire(now)

    def _expire(self, now: float) -> None:
        while self._late and now - self._late[0][0] > self.window:
            self._late.popleft()

    def lag(self, now: float) -> float | None:
        """The worst recent lag if the loop counts as overloaded at ``now``, else None."""
        self._expire(now)
        if not self._late:
            return None
        return max(lag for _, lag in self._late)


class Admission:
    """The handoff server's counts and decisions (see the module docstring).

    A handoff connection goes :meth:`connect` → (:meth:`first_request`) → :meth:`disconnect`;
    a handshake :meth:`begin_handshake` → :meth:`end_handshake`. Each release is called once
    for each admission that succeeded (the adapter's ``end_client`` and ``finally`` blocks)."""

    def __init__(self, limits: Limits | None = None) -> None:
        self.limits = limits or Limits()
        self.conns = FairPool(max(1, self.limits.connections // 2), 0)
        self.hands = FairPool(max(1, self.limits.handshakes), 0)
        self.meter = OverloadMeter(self.limits.overload_lag)
        self._pending: dict[int, int] = {}
        self.refused: dict[Refusal, int] = dict.fromkeys(Refusal, 0)
        """Refusals by kind, for statistics and tests."""
        self.configure(self.limits)

    def configure(self, limits: Limits) -> None:
        """New limits (a reload): they apply to what is admitted from now on."""
        self.limits = limits
        self.conns.capacity = max(1, min(limits.connections, MAX_CONNECTIONS) // 2)
        self.conns.per_user = limits.connections_per_user
        self.hands.capacity = max(1, limits.handshakes)
        self.hands.per_user = limits.handshakes_per_user
        self.meter.threshold = limits.overload_lag

    # -- handoff connections --------------------------------------------------------------------

    @property
    def connections(self) -> int:
        return self.conns.total

    def held(self, uid: int) -> int:
        """Handoff connections ``uid`` holds."""
        return self.conns.held(uid)

    def pending(self, uid: int) -> int:
        """Handoff connections of ``uid`` that have sent no request yet."""
        return self._pending.get(uid, 0)

    def at_pending_cap(self, uid: int) -> bool:
        """Would :meth:`connect` refuse ``uid``'s next connection that sent nothing yet?"""
        cap = self.limits.pending_per_user
        return bool(cap) and self._pending.get(uid, 0) >= cap

    def _deny(self, refusal: Refusal, uid: int, held: int, limit: int, users: int = 1) -> Denied:
        self.refused[refusal] += 1
        return Denied(refusal, uid, held, limit, users)

    def connect(self, uid: int, *, spoke: bool = False) -> Denied | None:
        """A handoff connection of ``uid`` was accepted: admitted (counted as held and, unless
        its request already waits in it (``spoke``), as pending) or denied (then nothing is
        counted: answer and close it). The pending cap is for connections that *sent* nothing:
        a burst whose requests wait in the listen queue, unread only because the daemon has
        not got to them, is no idle flood."""
        pending = self._pending.get(uid, 0)
        cap = self.limits.pending_per_user
        if cap and pending >= cap and not spoke:
            return self._deny(Refusal.PENDING, uid, pending, cap)
        over = self.conns.check(uid)
        if over is not None:
            kind = Refusal.FULL if over.shared else Refusal.CONNECTIONS
            return self._deny(kind, uid, over.held, over.limit, over.users)
        self.conns.add(uid)
        if not spoke:
            self._pending[uid] = pending + 1
        return None

    def first_request(self, uid: int) -> None:
        """The connection's first request arrived: no longer pending (still held)."""
        left = self._pending.get(uid, 0) - 1
        if left > 0:
            self._pending[uid] = left
        else:
            self._pending.pop(uid, None)

    def disconnect(self, uid: int, *, pending: bool) -> None:
        """An admitted connection ended (``pending``: before its first request)."""
        if pending:
            self.first_request(uid)
        self.conns.remove(uid)

    def overdue(self, accepted: float, now: float) -> bool:
        """Has a connection accepted at ``accepted`` waited too long for its first request?"""
        wait = self.limits.first_request_wait
        return wait > 0 and now - accepted >= wait

    # -- handshakes --------------------------------------------------------------------------

    @property
    def inflight(self) -> int:
        """Handshakes between their request and their reply (deferred work waits for 0)."""
        return self.hands.total

    def begin_handshake(self, uid: int, now: float) -> Denied | None:
        """May ``uid`` start a CLC handshake now (before any CLC byte)? Admitted: counted until
        :meth:`end_handshake`."""
        lag = self.meter.lag(now)
        if lag is not None:
            return self._deny(Refusal.OVERLOADED, uid, self.hands.held(uid), round(lag * 1000))
        over = self.hands.check(uid)
        if over is not None:
            kind = Refusal.FAIR_SHARE if over.shared else Refusal.HANDSHAKES
            return self._deny(kind, uid, over.held, over.limit, over.users)
        self.hands.add(uid)
        return None

    def end_handshake(self, uid: int) -> None:
        self.hands.remove(uid)

    def park_handshake(self, uid: int) -> None:
        """An admitted client half parks until its server half (on this host) is handed to
        the daemon: not counted meanwhile. Its CLC has not begun, and it waits for the server
        application's ``accept()``, which the kernel's AF_SMC never waits for (its listener
        runs CLC before the application accepts, bounded by the accept backlog): a program
        that opens many connections before using them (a pool) would otherwise fill the
        user's handshakes with waits and fall back past ``limits.handshakes_per_user``. A
        parked half still counts as a handoff connection (``limits.connections_per_user``)."""
        self.hands.remove(uid)

    def unpark_handshake(self, uid: int) -> None:
        """A parked client half goes on (paired, or not): counted again until
        :meth:`end_handshake`, without a check. Its server half was admitted, so pairs under
        way stay bounded by the server halves the limits let in (at most twice them)."""
        self.hands.add(uid)

    def snapshot(self) -> dict[str, int]:
        """Counts for statistics."""
        return {
            "connections": self.conns.total,
            "pending": sum(self._pending.values()),
            "handshakes": self.hands.total,
            "users": self.conns.users,
            **{f"refused_{r.name.lower()}": n for r, n in self.refused.items()},
        }
