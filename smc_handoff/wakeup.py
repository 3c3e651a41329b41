"""Wakeup primitives of the shared-memory channel (standard library only): the "kick me" bits
of the control trailer, one direction's wait state, the adaptive spin, and the per-process thread
that turns a peer link's hang-up into a kick for level-mode channels.

The protocol that uses them (arm, fence, look again, sleep; kick only a new generation) is
described in :mod:`smc_handoff.channel` and its memory-ordering argument in
:mod:`smc_handoff.layout`.
"""

from __future__ import annotations

import contextlib
import os
import select
import threading
import time
from collections.abc import Callable

from smc_handoff.fdmap import unpatched

_epoll = unpatched(select.epoll)  # the real one: smc-run's readiness wrappers come first

__all__ = [
    "SPIN_BACKOFF_MAX_NS",
    "SPIN_BACKOFF_MIN_NS",
    "SPIN_CONTENDED_NS",
    "SPIN_MAX_NS",
    "SPIN_MIN_NS",
    "SPIN_START_NS",
    "SPIN_SWITCHED_NS",
    "SPIN_YIELD_NS",
    "WANT_DATA",
    "WANT_LINK",
    "WANT_SPACE",
    "LinkWatcher",
    "Waiter",
    "learn",
    "link_watcher",
    "spin",
    "spin_backoff",
    "take_thread_wake",
    "thread_wake_fd",
]

# "Kick me" bits in the WAIT word of the control trailer.
WANT_DATA = 0x1  # data, EOF or abort in my RX DMB (in the WAIT word)
WANT_SPACE = 0x2  # the peer consumed from my TX ring (in the WAIT_SPACE word)
WANT_LINK = 0x4  # kick me through the peer link, not the eventfd (see ChannelBase._kick)

#: Adaptive spin budget (nanoseconds): grows while spinning pays off, halves when it did not.
SPIN_MAX_NS = 200_000
SPIN_MIN_NS = 2_000
SPIN_START_NS = 50_000
#: While spinning, yield the CPU this often: a peer queued on our CPU then runs at once.
SPIN_YIELD_NS = 3_000
#: A yield that kept us off the CPU this long ran another task here; when the data came with it,
#: the peer shares our CPU (a loaded machine): yield at once from then on, as spinning there
#: only delays the peer, until a wait succeeds without such a yield.
SPIN_SWITCHED_NS = 2_000
#: A yield that kept us off the CPU this long means another task competes for it: then waits
#: sleep at once (a sleeper's wakeup preempts a CPU hog; a spinner's yield may hand it a whole
#: time slice) for a back-off that doubles while the contention lasts.
SPIN_CONTENDED_NS = 60_000
SPIN_BACKOFF_MIN_NS = 20_000_000
SPIN_BACKOFF_MAX_NS = 1_000_000_000


class Waiter:
    """The wait state of one direction of one end: which WAIT/KICK words of the trailer it
    uses, its request generation and bits, and its adaptive spin budget. One thread at a time
    waits in each direction. ``since``: when the wait under way began, if a spin of it has
    given up (0: none), for :func:`learn`."""

    __slots__ = ("armed", "gen", "kick_idx", "since", "spin_ns", "wait_idx", "want", "yield_ns")

    def __init__(self, want: int, wait_idx: int, kick_idx: int) -> None:
        self.want = want
        self.wait_idx = wait_idx
        self.kick_idx = kick_idx
        self.gen = 0
        self.armed = 0
        self.spin_ns = SPIN_START_NS
        self.yield_ns = SPIN_YIELD_NS
        self.since = 0


# Spinning is given up for a while, process-wide, once a yield showed that this CPU is wanted
# by another task: [monotonic ns until which waits sleep at once, current back-off ns].
spin_backoff = [0, SPIN_BACKOFF_MIN_NS]


def spin(
    w: Waiter,
    ready: Callable[[], bool],
    timeout: float | None,
    hdr: memoryview,
    idx: int,
    old: int,
) -> bool:
    """Wait for ``ready()`` without sleeping, for at most ``w.spin_ns``. True when it came.
    Between two calls of ``ready()`` (and of the clock) it loads ``hdr[idx]`` eight times and
    compares it with ``old``, the value meaning "nothing yet": the peer's store is seen within
    a fraction of a microsecond, where each ``ready()`` call alone costs far more. A
    change of that word returns True at once, unconfirmed: the caller's next data call looks.

    Why a spin at all: a ping-pong between two processes on two CPUs turns around in a few
    microseconds, far less than a sleep and a wakeup cost. Why it cannot starve anyone: every
    :data:`SPIN_YIELD_NS` it calls ``sched_yield``, so a peer (or anything else) queued on
    this CPU runs at once instead of after our time slice. And when a yield kept us off the CPU
    for longer than :data:`SPIN_CONTENDED_NS` with nothing to show for it, a third task wants
    this CPU: a spinner would then keep handing it whole time slices, where a sleeper's wakeup
    preempts it, so all waits sleep at once for a back-off (doubling while the contention
    lasts, up to a second) — with a CPU hog around, the channel then behaves as the sleeping
    design it falls back to. The budget adapts as busy-poll does: it grows while spinning
    pays off and halves when it did not. And when the peer shares our CPU (the data came
    right after a yield that ran another task, see :data:`SPIN_SWITCHED_NS`), later spins
    yield at once: the round trip then costs two context switches, not two yield periods."""
    clock = time.perf_counter_ns
    now = clock()
    until, backoff = spin_backoff
    if now < until:
        return False
    if not w.yield_ns:
        # The peer shares our CPU (see SPIN_SWITCHED_NS): it cannot store anything before we
        # give the CPU up, so yield first, before the set-up of a spin: each of our turns of a
        # ping-pong then costs one yield and the peer's turn, nothing more.
        os.sched_yield()
        after = clock()
        if hdr[idx] != old:
            if after - now < SPIN_SWITCHED_NS:  # no switch: the peer has a CPU of its own
                w.yield_ns = SPIN_YIELD_NS
            return True
        if after - now > SPIN_CONTENDED_NS and not ready():  # a third task: as below
            spin_backoff[0] = after + backoff
            spin_backoff[1] = min(SPIN_BACKOFF_MAX_NS, backoff * 2)
            w.spin_ns = max(SPIN_MIN_NS, w.spin_ns >> 1)
            return False
        now = after
    start = now
    budget = w.spin_ns
    end = now + budget
    if timeout is not None:
        end = min(end, now + int(timeout * 1e9))
    every = w.yield_ns
    next_yield = now + every
    yield_ = os.sched_yield
    switched = False
    # Nothing to adapt when the data comes: the common case returns at once, because every
    # bytecode between the peer's store and our reply is round-trip time.
    steady = budget >= SPIN_MAX_NS and every >= SPIN_YIELD_NS and backoff == SPIN_BACKOFF_MIN_NS
    while True:
        if (
            hdr[idx] != old
            or hdr[idx] != old
            or hdr[idx] != old
            or hdr[idx] != old
            or hdr[idx] != old
            or hdr[idx] != old
            or hdr[idx] != old
            or hdr[idx] != old
            or ready()
        ):
            if steady and not switched:
                return True
            w.since = 0
            if budget < SPIN_MAX_NS:
                w.spin_ns = min(SPIN_MAX_NS, budget + (budget >> 1) + 1000)
            if switched:  # the peer ran on our CPU while we yielded
                w.yield_ns = 0
            elif every < SPIN_YIELD_NS:
                w.yield_ns = SPIN_YIELD_NS
            if now > until + backoff:  # a calm spell as long as the back-off: forget it
                spin_backoff[1] = SPIN_BACKOFF_MIN_NS
            return True
        now = clock()
        if now >= end:
            break
        if now >= next_yield:
            yield_()
            after = clock()
            if after - now > SPIN_CONTENDED_NS and not ready():
                spin_backoff[0] = after + backoff
                spin_backoff[1] = min(SPIN_BACKOFF_MAX_NS, backoff * 2)
                w.spin_ns = max(SPIN_MIN_NS, budget >> 1)
                return False
            switched = after - now > SPIN_SWITCHED_NS
            now = after
            next_yield = after + every
    w.spin_ns = max(SPIN_MIN_NS, budget >> 1)
    if not w.since or start - w.since > _SINCE_STALE_NS:
        w.since = start  # the budget ran out: learn() tells whether a longer one would have paid
    return False


class _ThreadWake:
    """The eventfd of one thread (see :func:`thread_wake_fd`), closed with the thread."""

    __slots__ = ("fd",)

    def __init__(self) -> None:
        self.fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)

    def __del__(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)


_thread_wake = threading.local()


def thread_wake_fd() -> int:
    """The calling thread's own wake-up descriptor (an eventfd, made on first use, closed when
    the thread ends), which a sleep on a peer link polls too.

    Why: a sleeper on the link (the kicks' preferred path) polls a descriptor only the peer can
    make readable, but TCP's ``shutdown()`` from another thread wakes a blocked ``recv`` or
    ``send`` at once, and programs stop their reader threads that way. The channel's own eventfd
    cannot serve (the other direction's sleeper holds it, and would take the wake-up), one per
    channel would cost a descriptor per connection, and one per process would wake every
    sleeper of every connection; one per thread wakes exactly the thread that sleeps."""
    try:
        return _thread_wake.wake.fd  # type: ignore[no-any-return]
    except AttributeError:
        wake = _thread_wake.wake = _ThreadWake()
        return wake.fd


def take_thread_wake(fd: int) -> None:
    """Clear a thread's wake-up descriptor after a poll found it readable."""
    with contextlib.suppress(OSError):
        os.eventfd_read(fd)


#: A ``since`` older than this belongs to an earlier wait (one wait spins at most twice: a
#: socket layer's first resort, then the general wait's own spin, each within the budget).
_SINCE_STALE_NS = 4 * SPIN_MAX_NS


def learn(w: Waiter, now: int) -> None:
    """A wait whose spin gave up has ended at ``now`` (``perf_counter_ns``) without a timeout:
    when it lasted no longer than the largest budget, a spin that long would have caught it
    without a sleep and the peer's wakeup, so the budget grows to twice what it took.

    Why: the budget otherwise learns only from spins, so a budget that once fell below the
    usual wait (a few slow waits: a cold ring's page faults, a descheduled peer) never sees a
    spin succeed again, halves on every wait and stays at its floor. Waits that take longer than
    a spin's reach are left to sleep and teach nothing, as with busy-poll and halt-poll.
    """
    since = w.since
    if since:
        w.since = 0
        waited = now - since
        if 0 <= waited <= SPIN_MAX_NS and w.spin_ns < 2 * waited:
            w.spin_ns = min(SPIN_MAX_NS, 2 * waited)


class LinkWatcher:
    """One daemon thread per process, started on the first :meth:`Channel.fileno`: it epolls
    the peer links of level-mode channels and kicks the channel's own eventfd when a link
    hangs up, so that ``select`` on ``fileno()`` also wakes for a peer's death."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self._ep = _epoll()
        self._lock = threading.Lock()
        self._links: dict[int, int] = {}
        thread = threading.Thread(target=self._run, name="smc-channel-links", daemon=True)
        thread.start()

    def add(self, link_fd: int, efd: int) -> None:
        with self._lock:
            self._links[link_fd] = efd
            # Hang-ups only (EPOLLHUP is implied): kick bytes on the link must not count.
            self._ep.register(link_fd, select.EPOLLRDHUP | select.EPOLLONESHOT)

    def remove(self, link_fd: int) -> None:
        with self._lock:
            if self._links.pop(link_fd, None) is not None:
                with contextlib.suppress(OSError):
                    self._ep.unregister(link_fd)

    def _run(self) -> None:
        while True:
            try:
                events = self._ep.poll()
            except InterruptedError:
                continue
            for fd, _ev in events:
                with self._lock:  # close() removes under this lock before closing fds
                    efd = self._links.pop(fd, None)
                    if efd is None:
                        continue
                    try:
                        self._ep.unregister(fd)
                        os.eventfd_write(efd, 1)
                    except OSError:
                        pass


_watcher_instance: LinkWatcher | None = None
_watcher_lock = threading.Lock()


def _new_watcher_lock() -> None:
    """In a forked child: a thread of the parent may have held the lock at the fork (the
    parent's watcher stays behind: its pid is not ours)."""
    global _watcher_lock
    _watcher_lock = threading.Lock()


os.register_at_fork(after_in_child=_new_watcher_lock)


def link_watcher() -> LinkWatcher:
    global _watcher_instance
    with _watcher_lock:
        if _watcher_instance is None or _watcher_instance.pid != os.getpid():
            _watcher_instance = LinkWatcher()
        return _watcher_instance


def forget_link(link_fd: int) -> None:
    """Stop watching ``link_fd`` in this process's watcher, if this process has one (none is
    started for it, unlike :func:`link_watcher`)."""
    with _watcher_lock:
        watcher = _watcher_instance
    if watcher is not None and watcher.pid == os.getpid():
        watcher.remove(link_fd)
