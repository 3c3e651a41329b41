"""State and control of one end of the shared-memory channel (standard library only): what
:class:`smc_handoff.channel.Channel` is built on, apart from its data path. Here: the fds of an
end and how a pair is made, the mapping and per-end state, our flags in the peer's header, kicks,
the sleeping wait, the peer link's liveness, the errors a data call raises, and close/abort.
The data path (send and receive, the fast paths, the spin before a read) lives in
:mod:`smc_handoff.channel`, which subclasses :class:`ChannelBase`: methods are inherited, so
the hot paths call them with no extra layer.
"""

from __future__ import annotations

import contextlib
import errno
import os
import select
import socket
import threading
import time
import weakref
from _socket import AF_UNIX as _AF_UNIX
from _socket import SOCK_SEQPACKET as _SOCK_SEQPACKET
from _socket import socket as _CSocket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Self

from smc_handoff import layout
from smc_handoff.fdmap import LEVEL_FDS, unpatched
from smc_handoff.layout import (
    C_KICK,
    C_KICK_SPACE,
    C_OWNER,
    C_WAIT,
    C_WAIT_SPACE,
    CDC_HEADER_LEN,
    COUNT_SHIFT,
    CSFLAGS_SHIFT,
    CTRL_LEN,
    PFLAGS_SHIFT,
    TYPE_WORD,
    W_CONS,
    W_PROD,
    W_TYPE,
    WRAP_SHIFT,
    create_dmb,
)
from smc_handoff.wakeup import (
    WANT_DATA,
    WANT_LINK,
    WANT_SPACE,
    Waiter,
    forget_link,
    learn,
    link_watcher,
    spin,
    take_thread_wake,
    thread_wake_fd,
)

# The real calls: smc-run wraps os's and select's before this module is loaded (run.py)
_set_blocking = unpatched(os.set_blocking)
_poll = unpatched(select.poll)

__all__ = [
    "ABORT_WORD",
    "ANY_CLOSE",
    "BUF_TYPES",
    "CURSOR_MASK",
    "PEER_CONN_ABORT",
    "PEER_CONN_CLOSED",
    "PEER_DONE_WRITING",
    "PIECE",
    "TX_STOP_WORD",
    "WRAP_FIELD",
    "WRITE_BLOCKED",
    "ChannelBase",
    "ChannelFds",
    "ChannelUnsupportedError",
    "make_pair",
]

# CDC flag bits (same values as smcd_daemon.wire.cdc.ProducerFlag / ConnStateFlag).
WRITE_BLOCKED = 0x80
PEER_DONE_WRITING = 0x80
PEER_CONN_CLOSED = 0x40
PEER_CONN_ABORT = 0x20
ANY_CLOSE = PEER_DONE_WRITING | PEER_CONN_CLOSED | PEER_CONN_ABORT

CURSOR_MASK = 0xFFFF << WRAP_SHIFT | 0xFFFFFFFF << COUNT_SHIFT
WRAP_FIELD = 0xFFFF << WRAP_SHIFT
# The peer's flags as bits of its consumer word (one AND on the fast paths).
TX_STOP_WORD = (PEER_CONN_ABORT | PEER_CONN_CLOSED) << CSFLAGS_SHIFT
ABORT_WORD = PEER_CONN_ABORT << CSFLAGS_SHIFT
BUF_TYPES = (bytearray, memoryview)
#: Copies larger than this are published piece by piece (see send_into/recv_into).
PIECE = 64 << 10
#: The nap after the first (the peer link and the eventfd wake us before that): it doubles with
#: each nap that ends with nothing new, up to :data:`_SLEEP_CAP_MAX_S`.
_SLEEP_CAP_S = 1.0
#: Why naps end at all: a safety net, which the wake-up protocol never needs (see ``layout``).
#: Why they grow: every idle blocking reader used to wake once a second (500 idle threads of a
#: ThreadingTCPServer: 1.2 % of a CPU), where TCP's sleep until something happens.
_SLEEP_CAP_MAX_S = 30.0


class ChannelUnsupportedError(OSError):
    """This CPU's memory model does not give the ordering the ring needs (see ``layout``);
    the caller should fall back to TCP."""


@dataclass(frozen=True, slots=True)
class ChannelFds:
    """What one end needs to build its channel — the fds the daemon passes with
    SCM_RIGHTS, in the order of the constructor. Every fd is this end's own."""

    rx_dmb_fd: int
    tx_dmb_fd: int
    rx_size: int
    tx_size: int
    rx_eventfd: int
    tx_eventfd: int
    peer_link_fd: int

    def fds(self) -> list[int]:
        """The file descriptors (for ``pass_fds`` / SCM_RIGHTS)."""
        return [
            self.rx_dmb_fd,
            self.tx_dmb_fd,
            self.rx_eventfd,
            self.tx_eventfd,
            self.peer_link_fd,
        ]

    def close(self) -> None:
        """Close this process's copies (after handing them to another process)."""
        for fd in self.fds():
            with contextlib.suppress(OSError):
                os.close(fd)


def make_pair(size_a: int, size_b: int) -> tuple[ChannelFds, ChannelFds]:
    """Create everything a connected pair of channels needs and return the fd sets of end A
    (receiving into a DMB of ``size_a``) and end B (receiving into ``size_b``).

    The two sets share no fd numbers (shared objects are ``dup``-ed), so both ends may live in
    this process or each set may be passed to another process and closed here. Used by tests
    and by the daemon, which then keeps only what it needs (e.g. the DMB memfds for its pool).
    """
    fds: list[int] = []
    try:
        dmb_a = create_dmb(size_a, "smc-dmb-a")
        fds.append(dmb_a)
        dmb_b = create_dmb(size_b, "smc-dmb-b")
        fds.append(dmb_b)
        efd_flags = os.EFD_CLOEXEC | os.EFD_NONBLOCK
        efd_a = os.eventfd(0, efd_flags)
        fds.append(efd_a)
        efd_b = os.eventfd(0, efd_flags)
        fds.append(efd_b)
        link_a, link_b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        fds.extend((link_a.detach(), link_b.detach()))
        a_link, b_link = fds[4], fds[5]
        dups = [os.dup(fd) for fd in (dmb_a, dmb_b, efd_a, efd_b)]
        fds.extend(dups)
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    end_a = ChannelFds(dmb_a, dmb_b, size_a, size_b, efd_a, efd_b, a_link)
    end_b = ChannelFds(dups[1], dups[0], size_b, size_a, dups[3], dups[2], b_link)
    return end_a, end_b


_FORKED = 1 << 31
"""In the owner word (:data:`~smc_handoff.layout.C_OWNER`): unclaimed since the fork of its
epoch (the other bits: the epoch << 32, and the pid of the claimer once claimed)."""
_live: weakref.WeakSet[ChannelBase] = weakref.WeakSet()
_first_before_fork: list[Callable[[], None]] = []


def run_before_fork(fn: Callable[[], None]) -> None:
    """Have ``fn`` run before ``fork()`` ahead of the channels' own preparation (the socket
    layer reads pending handoff answers there, which may make channels), once."""
    if fn not in _first_before_fork:
        _first_before_fork.append(fn)


def _before_fork() -> None:
    for fn in _first_before_fork:
        fn()
    for ch in list(_live):
        ch._fork_prepare()


def _after_fork() -> None:
    for ch in list(_live):
        ch._fork_done()


def _after_fork_in_child() -> None:
    # Only the forking thread lives on here: a lock another thread held at the fork would stay
    # held for good (a relay forked from a program with threads, a multiprocessing Pool's).
    for ch in list(_live):
        ch._new_locks()
    _after_fork()


os.register_at_fork(
    before=_before_fork, after_in_parent=_after_fork, after_in_child=_after_fork_in_child
)


class ChannelBase:
    """An end's state and control plane; see :class:`smc_handoff.channel.Channel` for the
    public API and its error semantics. The constructor takes ownership of every fd given to
    it: DMB fds are closed right after mapping, the rest by :meth:`close`/:meth:`abort`.

    Fork: an end's cursors live in the process (only what the peer must see is published), so
    after ``fork()`` only one process may go on using it, as only one goes on using a socket in
    the usual patterns (a forking server's child; a daemon that forks and lets its parent
    exit). The first data call after a fork, in either process, claims the end (the owner word
    of its receive DMB's trailer, with the epoch of the fork that made the copies); a copy whose
    state is not the latest, or that another process claimed, raises ``OSError(EBUSY)`` instead
    of reading or writing with stale cursors. ``close()`` of a copy that is not the owner only
    lets go of it (the parent of a forking server closes its copy at once): the connection ends
    with the owner's close, or the hang-up once every copy is gone."""

    def __init__(
        self,
        rx_dmb_fd: int,
        tx_dmb_fd: int,
        rx_size: int,
        tx_size: int,
        rx_eventfd: int,
        tx_eventfd: int,
        peer_link_fd: int,
    ) -> None:
        self._closed = True  # until fully built, so __del__/close stay quiet
        owned = [rx_dmb_fd, tx_dmb_fd, rx_eventfd, tx_eventfd, peer_link_fd]
        try:
            if not layout.ORDERING_OK:
                raise ChannelUnsupportedError(
                    errno.EOPNOTSUPP, "shared-memory channel needs a TSO CPU (x86-64, s390x)"
                )
            rx_mm = layout.map_dmb(rx_dmb_fd, rx_size)  # (each checks its size first)
            tx_mm = layout.map_dmb(tx_dmb_fd, tx_size)
            _set_blocking(rx_eventfd, False)
            # Family and type given: the daemon's (and make_pair's) link is always an AF_UNIX
            # SOCK_SEQPACKET socketpair end, and asking the kernel would cost two getsockopt.
            # A bare C socket: the kicks need nothing of the Python class.
            self._link = _CSocket(_AF_UNIX, _SOCK_SEQPACKET, 0, peer_link_fd)
            owned.remove(peer_link_fd)
            # Every send and receive on the link says MSG_DONTWAIT, so the descriptor's own mode
            # does not matter (an ioctl saved per channel), but a socket with a timeout (from
            # socket.setdefaulttimeout) would make CPython poll before each of them.
            if self._link.gettimeout() is not None:
                self._link.setblocking(False)
        except BaseException:
            for fd in owned:
                with contextlib.suppress(OSError):
                    os.close(fd)
            raise
        os.close(rx_dmb_fd)
        os.close(tx_dmb_fd)
        self._rx_mm, self._tx_mm = rx_mm, tx_mm
        self._rx_size, self._tx_size = rx_size, tx_size
        self._rx_efd, self._tx_efd = rx_eventfd, tx_eventfd
        self._link_fd = peer_link_fd

        rx_mv, tx_mv = memoryview(rx_mm), memoryview(tx_mm)
        self._rx_len = rx_size - CDC_HEADER_LEN
        self._tx_len = tx_size - CDC_HEADER_LEN
        self._rx_ring = rx_mv[CDC_HEADER_LEN:rx_size]
        self._tx_ring = tx_mv[CDC_HEADER_LEN:tx_size]
        # u64 views: header words (written by the peer in rx, by us in tx) and trailers.
        self._rx_hdr = rx_mv[:CDC_HEADER_LEN].cast("Q")
        self._tx_hdr = tx_mv[:CDC_HEADER_LEN].cast("Q")
        self._rx_ctrl = rx_mv[rx_size : rx_size + CTRL_LEN].cast("Q")
        self._tx_ctrl = tx_mv[tx_size : tx_size + CTRL_LEN].cast("Q")
        self._views = [
            self._rx_ring,
            self._tx_ring,
            self._rx_hdr,
            self._tx_hdr,
            self._rx_ctrl,
            self._tx_ctrl,
            rx_mv,
            tx_mv,
        ]

        # Receive side: position and wrap in our ring, the prod word that means "nothing new",
        # completed passes (bytes received = laps * ring + pos), and for the fast path the wrap
        # bits and the prod word of "the ring's end in this wrap". _rx_fast is cleared for
        # good by close/abort/death and by level mode, which sends every call the long way.
        self._rx_pos = 0
        self._rx_wrap = 0
        self._rx_empty_word = 0
        self._rx_laps = 0
        self._rx_wbits = 0
        self._rx_lim = self._rx_len << COUNT_SHIFT
        self._rx_fast = True
        self._n_empty = 0
        # A writer sleeping for space is kicked only once at most this much is left unread
        # (as TCP wakes writers only when a third of the buffer is free): one wakeup per half
        # ring instead of one per read.
        self._rx_wake_fill = self._rx_len // 2
        # Send side: position and wrap in the peer's ring, completed passes, the wrap bits of
        # our producer word, and _tx_run: bytes the fast path may copy at _tx_pos without
        # looking at anything else — known free (the peer only ever frees more) and short of
        # the ring's end. 0 sends every call the long way: set so by shutdown/close/abort/death.
        self._tx_pos = 0
        self._tx_wrap = 0
        self._tx_laps = 0
        self._tx_wbits = 0
        self._tx_run = 0
        self.tx_nospace = False
        """A send found too little room for all of it (TCP's ``SOCK_NOSPACE``): the room that
        comes back after it is an ``EPOLLOUT`` edge (smc-run's epoll clears it when it looks)."""
        # Our flags, published with our consumer cursor in the peer's header (word 2).
        self._pflags = 0
        self._csflags = 0
        self._flag_bits = 0
        self._wr_shut = False

        # Wakeup state: one waiter per direction (our WAIT words), the generations we last
        # kicked at the peer's two WAIT words, which descriptor a sleeping wait holds.
        self._wd = Waiter(WANT_DATA, C_WAIT, C_KICK)
        self._ws = Waiter(WANT_SPACE, C_WAIT_SPACE, C_KICK_SPACE)
        self._kicked_d = 0  # written by the sending thread only
        self._kicked_s = 0  # written by the receiving thread only
        self._level = False
        self._level_wanted = False  # fileno() of a fenced copy: level mode once claimed
        self._sleep_lock = threading.Lock()
        self._link_sleeper = False
        self._efd_sleeper = False
        self._sleeper_wake = -1  # the link sleeper's thread wake-up fd (see _wake_sleepers)
        self._link_wake = -1  # the thread wake-up fd registered in _link_poller
        # One sender and one receiver at a time: the ring's cursors and our waiter words are
        # one thread's each, so threads sharing a socket (TCP allows it: each send is atomic)
        # take these in the socket layer (smc_handoff.socket), never inside the channel.
        self.tx_lock = threading.Lock()
        self.rx_lock = threading.Lock()

        # Failure state.
        self._link_dead = False
        self._peer_died = False
        self._local_abort = False
        self._rd_shut = False  # SHUT_RD: reads never wait, so the end counts as readable
        self._violation: str | None = None
        self._dead = False  # any of the three above: every data operation resets

        # One poll object per descriptor a sleeper can hold (a poll object must not be used by
        # two threads at once): the link for kicks (and hang-up), or the eventfd plus the link
        # for hang-ups only (event mask 0: kick bytes for the other sleeper do not wake us).
        # Each is built when first needed (most short connections never sleep): see _poller.
        self._link_poller: Any = None
        self._efd_poller: Any = None
        self._hup_poller: Any = None  # _check_link, under _hup_lock
        self._hup_lock = threading.Lock()
        self._level_poller: Any = None  # _level_sync, under _level_lock
        self._level_lock = threading.Lock()

        self._n_kicks = 0
        self._n_sleeps = 0
        self._n_spin_hits = 0
        self._n_missed = 0

        # Fork (see the class docstring): a copy made by fork() is fenced until it is claimed.
        self._fence = False  # data calls take the long way and check: closed, or unclaimed
        self._forked = False
        self._owner = False
        self._epoch = 0
        self._rx_ctrl[C_OWNER] = 0  # a reused DMB's trailer may hold an earlier connection's

        self._tx_hdr[W_TYPE] = TYPE_WORD  # we are the only writer of the peer's header
        self._closed = False
        _live.add(self)

    def _stop_fast(self) -> None:
        """Send every later data call the long way (it checks closed/shut/dead and raises)."""
        self._tx_run = 0
        self._rx_fast = False

    # ---------------------------------------------------------------------------- fork

    @property
    def _usable(self) -> bool:
        """May this process use the end without a claim (never shared by fork, or claimed)?"""
        return not self._closed and (not self._forked or self._owner)

    def _fork_prepare(self) -> None:
        """Before ``fork()``: an end we may use opens a new epoch, unclaimed, which the two
        copies about to exist share; a copy we may not use stays as it is (so do its
        children's)."""
        if self._usable:
            self._epoch += 1
            self._rx_ctrl[C_OWNER] = self._epoch << 32 | _FORKED

    def _new_locks(self) -> None:
        """In a forked child: fresh locks, and no sleeper (the parent's threads are gone)."""
        self._sleep_lock = threading.Lock()
        self._hup_lock = threading.Lock()
        self._level_lock = threading.Lock()
        self.tx_lock = threading.Lock()
        self.rx_lock = threading.Lock()
        self._link_sleeper = self._efd_sleeper = False
        self._sleeper_wake = self._link_wake = -1
        self._link_poller = None  # it polls wake-up fds of the parent's threads

    def _fork_done(self) -> None:
        """After ``fork()``, in both processes: fenced until claimed."""
        if not self._closed:
            self._forked = True
            self._owner = False
            self._fence = True
            self._stop_fast()

    def _pass_fence(self) -> None:
        """Before a data call of a fenced end: EBADF when closed, else claim it (see the class
        docstring) and give the fast paths back."""
        self._check_open()
        word = self._rx_ctrl[C_OWNER]
        if word != self._epoch << 32 | _FORKED:
            owner = word & (_FORKED - 1)
            who = f"process {owner}" if not word & _FORKED else "a later fork"
            raise OSError(
                errno.EBUSY,
                f"{self.mode_name} connection: since a fork() it belongs to {who}; "
                "only one process may use an SMC connection after a fork",
            )
        self._rx_ctrl[C_OWNER] = self._epoch << 32 | os.getpid()
        self._owner = True
        self._fence = False
        if self._level_wanted and not self._level:
            self._enter_level()
        if not (self._level or self._dead):
            self._rx_fast = True

    def _claimed_elsewhere(self) -> bool:
        """Has a process claimed this end since the fork that made our copy (or a later one)?"""
        return bool(self._rx_ctrl[C_OWNER] != self._epoch << 32 | _FORKED)

    def _enter_level(self) -> None:
        """Level mode (see ``Channel.fileno``)."""
        self._level = True
        self._level_wanted = False
        self._rx_fast = False  # level mode keeps the eventfd in step: long way
        LEVEL_FDS.add(self._rx_efd)
        link_watcher().add(self._link_fd, self._rx_efd)
        self._level_sync()

    def claim(self) -> None:
        """Claim the end now, as the first data call after a fork would (``OSError(EBUSY)``
        when another process has); nothing to do when this process may use it already."""
        if self._fence:
            self._pass_fence()

    def leave_level_mode(self) -> None:
        """Stop keeping the eventfd readable while something is pending (what ``fileno()``
        started), disarmed and drained: for a process that only makes blocking calls on an
        end whose eventfd another process's copy may still poll (a relay after a fork, whose
        parent's select must not see the relay's readiness)."""
        if not self._level or self._closed:
            return
        self._level = False
        LEVEL_FDS.discard(self._rx_efd)
        forget_link(self._link_fd)
        self._disarm(self._wd)
        self._drain(False)
        if not (self._dead or self._fence):
            self._rx_fast = True

    def descriptors(self) -> tuple[int, ...]:
        """The descriptors this end holds (its eventfds and the peer link): what a process
        that goes on with the end alone must keep open."""
        self._check_open()
        return self._rx_efd, self._tx_efd, self._link_fd

    # --------------------------------------------------------------------------- closing

    def close(self) -> None:
        """Close this end: ``peer_conn_closed``, or an abort when received data is unread.
        Idempotent; releases the mappings and fds."""
        if self._closed:
            return
        if not self._usable:  # a copy another process may be using: only let go of ours
            self._release()
            return
        try:
            if not (self._local_abort or self._peer_died or self._violation):
                flags = self._rx_hdr[W_CONS] >> CSFLAGS_SHIFT
                unread = self._rx_hdr[W_PROD] & CURSOR_MASK != self._rx_empty_word
                if unread and not flags & PEER_CONN_ABORT:
                    self._local_abort = self._dead = True
                    self._stop_fast()
                    self._set_csflags(self._csflags | PEER_CONN_ABORT)
                else:
                    self._wr_shut = True
                    self._tx_run = 0
                    self._set_csflags(self._csflags | PEER_DONE_WRITING | PEER_CONN_CLOSED)
        finally:
            self._release()

    def abort(self) -> None:
        """Reset the connection (``peer_conn_abort``; the peer gets ``ConnectionResetError``)
        and release everything."""
        if self._closed:
            return
        if not self._usable:  # not ours to reset (see close)
            self._release()
            return
        try:
            self._local_abort = self._dead = True
            self._stop_fast()
            self._set_csflags(self._csflags | PEER_CONN_ABORT)
        finally:
            self._release()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:  # noqa: SIM105 (no contextlib at interpreter shutdown)
            self.close()
        except Exception:  # interpreter shutdown: modules may be gone
            pass

    def _release(self) -> None:
        self._closed = True
        self._fence = True
        self._stop_fast()
        self._wake_sleepers()  # a call waiting in another thread fails now (EBADF), not later
        _live.discard(self)
        if self._level:
            link_watcher().remove(self._link_fd)
            LEVEL_FDS.discard(self._rx_efd)
        self._link.close()  # the peer sees POLLHUP
        try:  # noqa: SIM105 (every connection's close: contextlib.suppress costs three calls)
            os.close(self._rx_efd)
        except OSError:
            pass
        try:  # noqa: SIM105
            os.close(self._tx_efd)
        except OSError:
            pass
        for view in self._views:
            view.release()
        self._views.clear()
        for mm in (self._rx_mm, self._tx_mm):
            try:  # noqa: SIM105
                mm.close()
            except BufferError:  # someone still holds a view: the GC unmaps later
                pass

    # ------------------------------------------------------------------------- internals

    def _rx_ready(self) -> bool:
        hdr = self._rx_hdr
        return bool(
            hdr[W_PROD] & CURSOR_MASK != self._rx_empty_word
            or hdr[W_CONS] >> CSFLAGS_SHIFT & ANY_CLOSE
            or self._local_abort
            or self._peer_died
            or self._rd_shut
        )

    def _tx_ready(self) -> bool:
        peer = self._rx_hdr[W_CONS]
        # The peer's consumer word when our ring is full: exactly one ring behind us.
        full = ((self._tx_wrap - 1) & 0xFFFF) << WRAP_SHIFT | self._tx_pos << COUNT_SHIFT
        return bool(
            peer & CURSOR_MASK != full
            or peer >> CSFLAGS_SHIFT & (PEER_CONN_ABORT | PEER_CONN_CLOSED)
            or self._wr_shut
            or self._local_abort
            or self._peer_died
        )

    def _wait(self, w: Waiter, timeout: float | None) -> bool:
        self._check_open()
        ready: Callable[[], bool] = self._rx_ready if w is self._wd else self._tx_ready
        if ready():
            if w.since:  # came just after a socket layer's spin gave up (spin_readable)
                learn(w, time.perf_counter_ns())
            return True
        if timeout is not None and timeout <= 0:
            return self._check_link()
        try:
            slept = self._spin_sleep(w, ready, timeout)
        except ValueError:
            # Another thread closed this end while this one waited (a program's shutdown
            # path): the released views raise ValueError. Give the waiter what a closed
            # socket's calls give, EBADF, not an exception type no socket user expects.
            self._check_open()
            raise
        if slept:
            if w.since:  # a longer spin would have caught it: learn from the sleep
                learn(w, time.perf_counter_ns())
            return True
        return False

    def _spin_sleep(self, w: Waiter, ready: Callable[[], bool], timeout: float | None) -> bool:
        """The rest of :meth:`_wait`: spin, then arm, fence, look again, sleep."""
        deadline = None if timeout is None else time.monotonic() + timeout
        # 1. Spin: loads and yields only (see wakeup.spin), watching the word the peer will store.
        hdr = self._rx_hdr
        if w is self._wd:
            idx, old = W_PROD, self._rx_empty_word
        else:
            idx, old = W_CONS, hdr[W_CONS]
        if spin(w, ready, timeout, hdr, idx, old) and ready():
            self._n_spin_hits += 1
            return True
        # 2. Sleep: take a descriptor no other sleeper of this channel holds, ask for a kick
        #    on it, fence, look again, then poll it (and the link for a hang-up).
        self._n_sleeps += 1
        on_link = self._take_fd(w)
        poller = self._poller(on_link)
        try:
            woken = False
            cap = _SLEEP_CAP_S
            while True:
                fresh = self._arm(w, on_link, woken)
                if not on_link:  # before looking: a kick after the look stays readable
                    self._drain(False)
                # The link is not drained here: a kick left over from an earlier request only
                # makes the poll return at once, and is taken below like the one that wakes us
                # (draining first cost a failing recv, and its exception, on every sleep).
                if ready():
                    return True
                nap = layout.SAFETY_NET_S if fresh else cap
                if deadline is not None:
                    nap = min(nap, deadline - time.monotonic())
                    if nap <= 0:
                        return False
                events = poller.poll(max(1, int(nap * 1000 + 0.999)))
                if not events:
                    if ready():
                        # Published just as the nap ended, or a lost wakeup? A publisher kicks
                        # right after publishing, so a kick that never comes means lost.
                        if not self._closed and not poller.poll(20):
                            self._n_missed += 1  # the safety net caught a lost wakeup
                        return True
                    if not fresh:
                        cap = min(cap * 2, _SLEEP_CAP_MAX_S)
                    continue
                woken = True
                for fd, ev in events:
                    if ev & (select.POLLHUP | select.POLLERR | select.POLLNVAL):
                        self._check_link()
                    elif on_link and fd != self._link_fd:  # our thread's wake-up
                        take_thread_wake(fd)
                if on_link:
                    self._take_kick()
                if ready():
                    return True
        finally:
            self._disarm(w)
            self._release_fd(on_link)
            if self._level and w is self._wd and not self._closed:
                self._level_sync()

    def _poller(self, on_link: bool) -> Any:
        """The poll object of a sleeper holding the link (``on_link``) or the eventfd, built
        on first use. Only the holder of that descriptor (see :meth:`_take_fd`) calls this."""
        if on_link:
            poller = self._link_poller
            if poller is None:
                poller = self._link_poller = _poll()
                poller.register(self._link_fd, select.POLLIN)
            wake = self._sleeper_wake
            if self._link_wake != wake:  # another thread sleeps here now: its wake-up fd
                if self._link_wake >= 0:
                    poller.unregister(self._link_wake)
                if wake >= 0:
                    poller.register(wake, select.POLLIN)
                self._link_wake = wake
        else:
            poller = self._efd_poller
            if poller is None:
                poller = self._efd_poller = _poll()
                poller.register(self._rx_efd, select.POLLIN)
                poller.register(self._link_fd, 0)
        return poller

    def _take_fd(self, w: Waiter) -> bool:
        """Choose what a sleeping wait polls; True for the peer link, False for the eventfd.
        The link is preferred (see :meth:`_kick`); level mode keeps the eventfd for data (it is
        ``fileno()``) and the link for space. Two sleepers (a reader and a writer thread) never
        share one descriptor, so neither can drain the other's kick."""
        with self._sleep_lock:
            on_link = w is self._ws if self._level else not self._link_sleeper
            if on_link:
                try:
                    wake = thread_wake_fd()
                except OSError:  # no descriptor left (EMFILE): only the naps look again
                    wake = -1
                self._link_sleeper = True
                self._sleeper_wake = wake
            else:
                self._efd_sleeper = True
            return on_link

    def _release_fd(self, on_link: bool) -> None:
        with self._sleep_lock:
            if on_link:
                self._link_sleeper = False
            else:
                self._efd_sleeper = False

    def _wake_sleepers(self) -> None:
        """Wake this end's sleeping waits so that they look again: another thread shut the
        socket down, and TCP's ``shutdown()`` wakes every waiter (a blocked ``recv`` returns
        EOF, a blocked ``send`` fails with ``EPIPE``). A sleeper with nothing new only looks
        and sleeps again."""
        with self._sleep_lock:
            wake = self._sleeper_wake if self._link_sleeper else -1
            efd = self._efd_sleeper
        if wake < 0 and not efd:  # (every close: nobody sleeps)
            return
        with contextlib.suppress(OSError):
            if wake >= 0:
                os.eventfd_write(wake, 1)
            if efd:
                os.eventfd_write(self._rx_efd, 1)

    def _arm(self, w: Waiter, on_link: bool, fresh: bool = False) -> bool:
        """Publish "kick me for ``w``'s condition on this descriptor" and fence (see ``layout``:
        the Dekker race). True when a new request was published (the first nap is short)."""
        bits = w.want | WANT_LINK if on_link else w.want
        # Reuse the current generation only when no kick can have been seen for it: KICK is
        # stored after the kick itself, so after any wakeup it may still read "not kicked".
        if not fresh and w.armed == bits and self._rx_ctrl[w.kick_idx] != w.gen:
            return False
        w.gen += 1
        w.armed = bits
        self._rx_ctrl[w.wait_idx] = w.gen << 8 | bits
        layout.fence()
        return True

    def _disarm(self, w: Waiter) -> None:
        keep = WANT_DATA if self._level and w is self._wd else 0
        if w.armed != keep and not self._closed:
            w.armed = keep
            self._rx_ctrl[w.wait_idx] = w.gen << 8 | keep

    def _drain(self, on_link: bool) -> None:
        """Empty the descriptor this sleeper holds (kicks are level: a stale one only costs a
        spurious wakeup, and each sleep pays a poll anyway)."""
        if on_link:
            if not self._link_dead:
                try:
                    while self._link.recv(64, socket.MSG_DONTWAIT):
                        pass
                except OSError:  # drained (EAGAIN), or the peer is gone: _check_link decides
                    pass
        else:
            with contextlib.suppress(BlockingIOError):
                os.eventfd_read(self._rx_efd)

    def _take_kick(self) -> None:
        """Take one kick off the link after a poll said it is readable (one message, one recv:
        a second kick queued behind it costs a spurious wakeup, which the wait's loop absorbs,
        not a failing recv on every sleep)."""
        if not self._link_dead:
            try:  # noqa: SIM105 (a plain try: this is every sleep's path)
                self._link.recv(64, socket.MSG_DONTWAIT)
            except OSError:  # nothing queued after all (EAGAIN), or the peer is gone
                pass

    def _level_sync(self) -> None:
        """Make the eventfd's readability match "data, EOF or abort pending" (level mode)."""
        with self._level_lock:
            if not self._rx_ready():
                self._arm(self._wd, False, fresh=True)
                self._drain(False)
                if not self._rx_ready():
                    return
            poller = self._level_poller
            if poller is None:
                poller = self._level_poller = _poll()
                poller.register(self._rx_efd, select.POLLIN)
            if not poller.poll(0):  # look, do not infer: a drain may race a kick
                os.eventfd_write(self._rx_efd, 1)

    def _kick(self, wait: int, kick_idx: int) -> bool:
        """Wake the peer. A sleeping wait asks for the kick on the link: a Unix-socket send
        wakes the sleeper as a *sync* wakeup (the scheduler may run it on our CPU right away),
        where an eventfd write leaves it queued behind whatever runs on its own CPU — which
        costs milliseconds next to a CPU hog. Level mode (``fileno()``) needs the eventfd."""
        try:
            if wait & WANT_LINK:
                self._link.send(b"k", socket.MSG_DONTWAIT)
            else:
                os.eventfd_write(self._tx_efd, 1)
        except BlockingIOError:
            pass  # the peer's link queue is full of kicks it has not drained yet
        except OSError:
            return False
        self._tx_ctrl[kick_idx] = wait >> 8  # after the write: the peer drains what it saw
        self._n_kicks += 1
        return True

    def _kick_data(self, wait: int) -> None:
        if self._kick(wait, C_KICK):
            self._kicked_d = wait >> 8

    def _kick_space(self, wait: int) -> None:
        if self._kick(wait, C_KICK_SPACE):
            self._kicked_s = wait >> 8

    def _kick_if_waiting(self) -> None:
        layout.fence()  # what we stored (flags, cursors) is visible before we look for requests
        ctrl = self._tx_ctrl
        wait = ctrl[C_WAIT]
        if wait & WANT_DATA and wait >> 8 != self._kicked_d:
            self._kick_data(wait)
        wait = ctrl[C_WAIT_SPACE]
        if wait & WANT_SPACE and wait >> 8 != self._kicked_s:
            self._kick_space(wait)

    def _set_pflags(self, pflags: int) -> None:
        self._pflags = pflags
        self._publish_flags()

    def _set_csflags(self, csflags: int) -> None:
        self._csflags = csflags
        self._publish_flags()
        self._kick_if_waiting()

    def _publish_flags(self) -> None:
        """Store our flags with our consumer cursor (one word). A reader thread may store the
        cursor at the same time: it re-stores when the flags changed under it, and we re-store
        until the word holds the newest cursor, so neither update is lost."""
        self._flag_bits = self._pflags << PFLAGS_SHIFT | self._csflags << CSFLAGS_SHIFT
        hdr = self._tx_hdr
        while True:
            word = self._rx_empty_word | self._flag_bits
            hdr[W_CONS] = word
            if self._rx_empty_word | self._flag_bits == word:
                return

    def _check_link(self) -> bool:
        """Look (without blocking) whether the peer's end of the link is gone. A gone peer
        that had not closed ended with its process: a close or an abort as the kernel would
        have sent for it (:meth:`_exit_closes`). True when the link is gone."""
        if self._link_dead:
            return True
        if self._closed:
            return False
        # Hang-up or error only (event mask 0): the kick bytes queued on the link belong to a
        # sleeper and must not be read here. The poll object is not shared between threads.
        if self._hup_lock.acquire(blocking=False):
            try:
                poller = self._hup_poller
                if poller is None:
                    poller = self._hup_poller = _poll()
                    poller.register(self._link_fd, 0)
                gone = poller.poll(0)
            finally:
                self._hup_lock.release()
        else:
            poller = _poll()
            poller.register(self._link_fd, 0)
            gone = poller.poll(0)
        if not gone:
            return False
        self._link_dead = True
        hdr = self._rx_hdr
        word = hdr[W_CONS]  # the flags are stored before the peer's close() closes the link
        if not word >> CSFLAGS_SHIFT & (PEER_CONN_CLOSED | PEER_CONN_ABORT):
            if self._exit_closes(word):
                # No process holds the peer's end any more, so nobody else writes this word.
                hdr[W_CONS] = word | (PEER_DONE_WRITING | PEER_CONN_CLOSED) << CSFLAGS_SHIFT
            else:
                self._peer_died = True
                self._dead = True
                self._stop_fast()
        return True

    def _exit_closes(self, peer_cons_word: int) -> bool:
        """The peer's processes all ended without closing (``os._exit``, a signal, the last
        copy after a fork): was that a close or an abort? The kernel closes an exiting
        process's sockets, and ``smc_release`` → ``smc_close_final`` sends ``peer_conn_closed``
        unless received data is unread (then ``peer_conn_abort``), as TCP sends a FIN or an RST.
        The peer published its consumer cursor with every read, so what it left unread is what
        we published beyond it. SMC-D only: an SMC-R channel's peer is the daemon's relay,
        whose hang-up is the daemon's death, not the remote application's."""
        if self._rx_size in layout.SMCR_CHANNEL_SIZES:
            return False
        return peer_cons_word & CURSOR_MASK == self._tx_hdr[W_PROD] & CURSOR_MASK

    @property
    def mode_name(self) -> str:
        """``"SMC-R"`` or ``"SMC-D"``, for error messages: an SMC-R channel maps RMBE + 32 bytes,
        never a DMB size (:data:`layout.SMCR_CHANNEL_SIZES`), so the size tells the mode."""
        return "SMC-R" if self._rx_size in layout.SMCR_CHANNEL_SIZES else "SMC-D"

    def _protocol_violation(self, what: str) -> None:
        self._violation = what
        self._dead = True
        self._stop_fast()
        self.abort()
        raise ConnectionResetError(errno.ECONNRESET, f"{self.mode_name} channel: {what}")

    def _raise_reset(self) -> None:
        self._check_open()
        mode = self.mode_name
        if self._violation:
            raise ConnectionResetError(errno.ECONNRESET, f"{mode} channel: {self._violation}")
        if self._peer_died:
            why = (
                "smcd, which relays it, is gone"
                if self._rx_size in layout.SMCR_CHANNEL_SIZES
                else "the peer ended without closing and left data unread"
            )
            raise ConnectionResetError(errno.ECONNRESET, f"{mode} channel: {why} (link closed)")
        if self._local_abort:
            raise ConnectionResetError(errno.ECONNRESET, f"{mode} connection aborted locally")
        if self._rx_hdr[W_CONS] >> CSFLAGS_SHIFT & PEER_CONN_ABORT:
            raise ConnectionResetError(errno.ECONNRESET, f"{mode} connection aborted by peer")
        raise ConnectionResetError(errno.ECONNRESET, f"{mode} peer has closed the connection")

    def _raise_closed_or_pipe(self) -> None:
        self._check_open()
        raise BrokenPipeError(errno.EPIPE, f"{self.mode_name} channel: shut down for writing")

    def _check_open(self) -> None:
        if self._closed:
            raise OSError(errno.EBADF, f"{self.mode_name} channel is closed")
