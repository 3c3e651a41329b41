"""The application side of one SMC-D connection: two DMBs in shared memory, no kernel on the
data path (standard library only).

Each end maps both DMBs of the connection read-write (memfds handed over with SCM_RIGHTS):

* its **RX DMB**, into which the peer writes data at the peer's producer cursor and then the
  32-byte SMC-D CDC header (PROTOCOL.md §1.8) carrying the peer's producer cursor (data for us),
  the peer's consumer cursor (how far it has read *our* data from *its* DMB) and the peer's flags;
* its **TX DMB** (the peer's RX DMB), into which it does the same for the peer.

So, as with loopback-ism, a byte is copied exactly twice (application buffer → peer's DMB →
peer's application buffer) and each header word has exactly one writer. The layout, the atomic
cursor words and the memory-ordering argument live in :mod:`smc_handoff.layout`.

Wakeups: a waiter first spins briefly (adaptive budget; pure loads, with a ``sched_yield`` every
few microseconds so that a peer queued on the same CPU runs at once, and no spinning for a while
once a yield shows that another task holds this CPU); only then does it publish "kick me" in its
DMB's control trailer, fence, look once more, and sleep in ``poll`` on the peer link or its RX
eventfd. A publisher kicks only when it sees such a request for a generation it has not kicked
yet, so a busy stream makes no syscalls at all. Data waits and space waits have their own
request words and never sleep on the same descriptor, so one reader thread and one writer
thread can share a channel.

Fast paths: in pure Python the per-message interpreter time *is* the latency (a ping-pong's
round trip is four data calls plus two spin hand-offs), so :meth:`Channel.send_fast` and
:meth:`Channel.recv_fast` do the common case — a message that fits before the ring's end, in
space already known free or data in the current wrap — in a few dozen bytecodes: no memoryview
casts or format checks (an odd buffer makes the copy itself fail, and then the general call
decides), no cursor arithmetic beyond one subtraction, no counters (bytes moved are derived
from position and completed laps). Everything that must stop them (shutdown, close, abort, a
dead peer, level mode) zeroes ``_tx_run`` / clears ``_rx_fast``, and the peer's close/abort
flags are read on every call, so the general calls still see every error first. A blocking
reader that finds nothing spins on the producer word itself (:meth:`Channel.spin_readable`)
before the general wait's set-up.

Close (RFC 7609 §4, Linux ``smc_close.c``): :meth:`Channel.shutdown_write` sets
``peer_done_writing`` after all data is published (the peer reads EOF after draining);
:meth:`Channel.close` sets ``peer_conn_closed``, or aborts (``peer_conn_abort`` → the peer gets
``ConnectionResetError``) when received data is still unread; :meth:`Channel.abort` always aborts.
Liveness needs no daemon: each end holds one end of a ``SOCK_SEQPACKET`` socketpair, the *peer
link*; when a process dies the kernel closes its end and the survivor sees ``POLLHUP``, which is
an abort unless the peer had closed cleanly.
"""

from __future__ import annotations

import contextlib
import errno
import os
import select
import socket
import threading
import time
from _socket import AF_UNIX as _AF_UNIX
from _socket import SOCK_SEQPACKET as _SOCK_SEQPACKET
from _socket import socket as _CSocket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from smc_handoff import layout
from smc_handoff.layout import (
    C_KICK,
    C_KICK_SPACE,
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
    check_dmb_size,
    create_dmb,
    zero_dmb,
)

__all__ = [
    "DMB_SIZES",
    "Channel",
    "ChannelFds",
    "ChannelUnsupportedError",
    "create_dmb",
    "make_pair",
    "zero_dmb",
]

DMB_SIZES = layout.DMB_SIZES

# CDC flag bits (same values as smcd_daemon.wire.cdc.ProducerFlag / ConnStateFlag).
WRITE_BLOCKED = 0x80
PEER_DONE_WRITING = 0x80
PEER_CONN_CLOSED = 0x40
PEER_CONN_ABORT = 0x20
_ANY_CLOSE = PEER_DONE_WRITING | PEER_CONN_CLOSED | PEER_CONN_ABORT

# "Kick me" bits in the WAIT word of the control trailer.
WANT_DATA = 0x1  # data, EOF or abort in my RX DMB (in the WAIT word)
WANT_SPACE = 0x2  # the peer consumed from my TX ring (in the WAIT_SPACE word)
WANT_LINK = 0x4  # kick me through the peer link, not the eventfd (see _kick)

_CURSOR_MASK = 0xFFFF << WRAP_SHIFT | 0xFFFFFFFF << COUNT_SHIFT
_WRAP_FIELD = 0xFFFF << WRAP_SHIFT
# The peer's flags as bits of its consumer word (one AND on the fast paths).
_TX_STOP_WORD = (PEER_CONN_ABORT | PEER_CONN_CLOSED) << CSFLAGS_SHIFT
_ABORT_WORD = PEER_CONN_ABORT << CSFLAGS_SHIFT
_BUF_TYPES = (bytearray, memoryview)

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
#: Copies larger than this are published piece by piece (see send_into/recv_into).
_PIECE = 64 << 10
#: Longest single nap after the first (the peer link and the eventfd wake us before that).
_SLEEP_CAP_S = 1.0


class ChannelUnsupportedError(OSError):
    """This CPU's memory model does not give the ordering the ring needs (see ``layout``);
    the caller should fall back to TCP."""


@dataclass(frozen=True, slots=True)
class ChannelFds:
    """What one end needs to build its :class:`Channel` — the fds the daemon passes with
    SCM_RIGHTS, in the order of the ``Channel`` constructor. Every fd is this end's own."""

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


class Channel:
    """One end of an SMC-D connection over two shared-memory DMBs.

    Non-blocking primitives (:meth:`send_into`, :meth:`recv_into`) plus waits
    (:meth:`wait_readable`, :meth:`wait_writable`) that a socket layer wraps. The channel takes
    ownership of every fd given to it: DMB fds are closed right after mapping, the rest by
    :meth:`close`/:meth:`abort`.

    Errors, as a TCP socket reports them: ``ConnectionResetError`` after an abort (either
    side's, or the peer's death), ``BrokenPipeError`` on sending after :meth:`shutdown_write`,
    ``OSError(EBADF)`` after :meth:`close`. Not thread-safe: one reader and one writer thread at
    most, and not both inside the same method.
    """

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
            check_dmb_size(rx_size)
            check_dmb_size(tx_size)
            rx_mm = layout.map_dmb(rx_dmb_fd, rx_size)
            tx_mm = layout.map_dmb(tx_dmb_fd, tx_size)
            os.set_blocking(rx_eventfd, False)
            # Family and type given: the daemon's (and make_pair's) link is always an AF_UNIX
            # SOCK_SEQPACKET socketpair end, and asking the kernel would cost two getsockopt.
            # A bare C socket: the kicks need nothing of the Python class.
            self._link = _CSocket(_AF_UNIX, _SOCK_SEQPACKET, 0, peer_link_fd)
            owned.remove(peer_link_fd)
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
        # Our flags, published with our consumer cursor in the peer's header (word 2).
        self._pflags = 0
        self._csflags = 0
        self._flag_bits = 0
        self._wr_shut = False

        # Wakeup state: one waiter per direction (our WAIT words), the generations we last
        # kicked at the peer's two WAIT words, which descriptor a sleeping wait holds.
        self._wd = _Waiter(WANT_DATA, C_WAIT, C_KICK)
        self._ws = _Waiter(WANT_SPACE, C_WAIT_SPACE, C_KICK_SPACE)
        self._kicked_d = 0  # written by the sending thread only
        self._kicked_s = 0  # written by the receiving thread only
        self._level = False
        self._sleep_lock = threading.Lock()
        self._link_sleeper = False
        self._efd_sleeper = False

        # Failure state.
        self._link_dead = False
        self._peer_died = False
        self._local_abort = False
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

        self._tx_hdr[W_TYPE] = TYPE_WORD  # we are the only writer of the peer's header
        self._closed = False

    # ------------------------------------------------------------------ construction helpers

    @classmethod
    def from_fds(cls, fds: ChannelFds) -> Channel:
        return cls(
            fds.rx_dmb_fd,
            fds.tx_dmb_fd,
            fds.rx_size,
            fds.tx_size,
            fds.rx_eventfd,
            fds.tx_eventfd,
            fds.peer_link_fd,
        )

    def _stop_fast(self) -> None:
        """Send every later data call the long way (it checks closed/shut/dead and raises)."""
        self._tx_run = 0
        self._rx_fast = False

    @property
    def bytes_sent(self) -> int:
        return self._tx_laps * self._tx_len + self._tx_pos

    @property
    def bytes_received(self) -> int:
        return self._rx_laps * self._rx_len + self._rx_pos

    # ------------------------------------------------------------------------------ sending

    def send_into(self, data: Any) -> int:
        """Copy as much of ``data`` (any bytes-like) as fits into the peer's ring and publish
        it. Returns the bytes accepted: possibly fewer than ``len(data)``, 0 when the ring is
        full. Raises ``BrokenPipeError`` after :meth:`shutdown_write`, ``ConnectionResetError``
        when the connection was aborted or the peer has closed.

        The fast path (a write that fits before the ring's end in space already known free)
        is a handful of bytecodes: per-message interpreter time *is* the latency here."""
        return self.send_fast(data) or self._send_into(data)

    def send_fast(self, data: Any) -> int:
        """All of ``data`` by the fast path, or nothing (0): then :meth:`send_into` decides
        (and raises what it must). For a socket layer's ``send``/``sendall``."""
        try:
            n = len(data)
        except TypeError:  # a buffer without len(), or not a buffer: the long way decides
            return 0
        # The peer's consumer word carries its flags: a reset or close stops us at once
        # (_dead too: a reader thread may have seen the peer die while we copied).
        if (
            0 < n <= self._tx_run
            and n <= _PIECE
            and not self._rx_hdr[W_CONS] & _TX_STOP_WORD
            and not self._dead
        ):
            pos = self._tx_pos
            try:
                self._tx_ring[pos : pos + n] = data
            except (TypeError, ValueError, NotImplementedError):  # not flat bytes: long way
                return 0
            pos += n
            self._tx_hdr[W_PROD] = self._tx_wbits | pos << COUNT_SHIFT
            self._tx_pos = pos
            self._tx_run -= n
            wait = self._tx_ctrl[C_WAIT]  # the peer's "kick me" for data
            if wait & WANT_DATA and wait >> 8 != self._kicked_d:
                self._kick_data(wait)
            return n
        return 0

    def _send_into(self, data: Any) -> int:
        """send_into for every case: full ring, wrap, large writes, odd buffers, errors."""
        if self._wr_shut or self._closed:
            self._raise_closed_or_pipe()
        peer = self._rx_hdr[W_CONS]  # the peer's consumer cursor in our TX ring + its flags
        if peer >> CSFLAGS_SHIFT & (PEER_CONN_ABORT | PEER_CONN_CLOSED) or self._dead:
            self._stop_fast()
            self._raise_reset()
        mv = data if type(data) is memoryview else memoryview(data)
        if mv.ndim != 1 or mv.format != "B":
            mv = mv.cast("B")
        size = len(mv)
        L = self._tx_len
        pos = self._tx_pos
        wrap = self._tx_wrap
        inflight = (
            ((wrap - (peer >> WRAP_SHIFT)) & 0xFFFF) * L + pos - (peer >> COUNT_SHIFT & 0xFFFFFFFF)
        )
        space = L - inflight
        if space <= 0 or size == 0:
            if space < 0 or inflight < 0:
                self._protocol_violation(f"peer consumer cursor is {-space} bytes ahead")
            if size and not self._pflags & WRITE_BLOCKED:
                self._set_pflags(self._pflags | WRITE_BLOCKED)
            self._tx_run = 0
            return 0
        n = size if size < space else space
        ring = self._tx_ring
        hdr = self._tx_hdr
        # Publish piece by piece: the reader copies out the first piece while we copy in the
        # next, instead of waiting for the whole write.
        done = 0
        while done < n:
            k = n - done
            if k > _PIECE:
                k = _PIECE
            if k > L - pos:
                k = L - pos
            ring[pos : pos + k] = mv[done : done + k]
            done += k
            pos += k
            if pos == L:
                pos = 0
                wrap = (wrap + 1) & 0xFFFF
                self._tx_laps += 1
                self._tx_wbits = wrap << WRAP_SHIFT
            hdr[W_PROD] = wrap << WRAP_SHIFT | pos << COUNT_SHIFT
            # After the first piece (wake a sleeping reader early) and after the last (the
            # wakeup rule: look for a request after the final cursor store, see layout).
            if done in (k, n):
                wait = self._tx_ctrl[C_WAIT]
                if wait & WANT_DATA and wait >> 8 != self._kicked_d:
                    self._kick_data(wait)
        self._tx_wrap = wrap
        self._tx_pos = pos
        if self._pflags & WRITE_BLOCKED:
            self._set_pflags(self._pflags & ~WRITE_BLOCKED)
        if not (self._wr_shut or self._dead or self._closed):
            left = space - n
            self._tx_run = left if left < L - pos else L - pos - 1
        return n

    def writable(self) -> bool:
        """True when :meth:`send_into` would accept a byte or raise (no blocking either way)."""
        self._check_open()
        return self._tx_ready() or self._check_link()

    def wait_writable(self, timeout: float | None = None) -> bool:
        """Wait until the peer's ring has room, or an error is pending. False on timeout."""
        return self._wait(self._ws, timeout)

    def shutdown_write(self) -> None:
        """SHUT_WR: after everything sent so far, the peer reads EOF (``peer_done_writing``)."""
        self._check_open()
        if not self._csflags & PEER_DONE_WRITING:
            self._wr_shut = True
            self._tx_run = 0
            self._set_csflags(self._csflags | PEER_DONE_WRITING)

    # ---------------------------------------------------------------------------- receiving

    def recv_into(self, buffer: Any, nbytes: int = 0) -> int:
        """Copy up to ``nbytes`` (default: all of ``buffer``) received bytes into ``buffer``.
        Returns the count; 0 means EOF when :attr:`eof` is set, else nothing yet (would block).
        Raises ``ConnectionResetError`` once the connection is aborted (pending data is
        discarded, as with a TCP RST).

        The fast path: data in this wrap of the ring, a bytearray or memoryview, no nbytes."""
        if nbytes:
            return self._recv_into(buffer, nbytes)
        return self.recv_fast(buffer) or self._recv_into(buffer)

    def recv_fast(self, buffer: Any) -> int:
        """Fill ``buffer`` (a bytearray or memoryview) by the fast path, or return 0: nothing
        there, EOF, an error, a wrap... — then :meth:`recv_into` decides."""
        if self._rx_fast and type(buffer) in _BUF_TYPES:
            hdr = self._rx_hdr
            if not hdr[W_CONS] & _ABORT_WORD:  # read flags *before* the producer cursor
                prod = hdr[W_PROD]
                empty = self._rx_empty_word
                # Data that ends in this wrap, before the ring's end: one copy, no wrap.
                if empty < prod < self._rx_lim and prod & _WRAP_FIELD == self._rx_wbits:
                    avail = (prod - empty) >> COUNT_SHIFT
                    n = len(buffer)
                    if avail < n:
                        n = avail
                    if 0 < n <= _PIECE:  # more: the long way publishes piece by piece
                        pos = self._rx_pos
                        try:
                            buffer[:n] = self._rx_ring[pos : pos + n]
                        except (TypeError, ValueError, NotImplementedError):  # not flat bytes
                            return 0
                        pos += n
                        word = self._rx_wbits | pos << COUNT_SHIFT
                        self._rx_empty_word = word
                        fb = self._flag_bits
                        txh = self._tx_hdr
                        txh[W_CONS] = word | fb  # our consumer cursor → the peer's header
                        if self._flag_bits != fb:  # a writer thread published flags meanwhile
                            txh[W_CONS] = word | self._flag_bits
                        self._rx_pos = pos
                        wait = self._tx_ctrl[C_WAIT_SPACE]  # the peer's "kick me" for space
                        if (
                            wait & WANT_SPACE
                            and wait >> 8 != self._kicked_s
                            and avail - n <= self._rx_wake_fill
                        ):
                            self._kick_space(wait)
                        return n
        return 0

    def _recv_into(self, buffer: Any, nbytes: int = 0) -> int:
        """recv_into for every case: empty ring, EOF, wrap, level mode, odd buffers, errors."""
        if self._closed:
            self._check_open()
        hdr = self._rx_hdr
        flags = hdr[W_CONS] >> CSFLAGS_SHIFT  # read flags *before* the producer cursor
        if flags & PEER_CONN_ABORT or self._dead:
            self._stop_fast()
            self._raise_reset()
        prod = hdr[W_PROD]
        L = self._rx_len
        pos = self._rx_pos
        wrap = self._rx_wrap
        avail = (
            (((prod >> WRAP_SHIFT) - wrap) & 0xFFFF) * L + (prod >> COUNT_SHIFT & 0xFFFFFFFF) - pos
        )
        if avail <= 0:
            if avail < 0:
                self._protocol_violation(f"peer producer cursor is {-avail} bytes behind")
            if flags & (PEER_DONE_WRITING | PEER_CONN_CLOSED):
                return 0  # EOF: the flags were read first, so that cursor was the last one
            # Is the peer gone? A poll syscall: every time in level mode (a select loop relies
            # on it), else every 64th empty read (blocking waits poll the link themselves).
            self._n_empty += 1
            if (self._level or not self._n_empty & 63) and self._check_link():
                if self._dead:  # the peer died without closing
                    self._raise_reset()
                # The peer closed after we read its flags: it stores its final cursor and flags
                # before it closes the link, so looking again sees them (and any last data).
                return self._recv_into(buffer, nbytes)
            if self._level:
                self._level_sync()
            return 0
        if avail > L:
            self._protocol_violation(f"peer claims {avail} bytes in a {L}-byte ring")
        mv = buffer if type(buffer) is memoryview else memoryview(buffer)
        if mv.ndim != 1 or mv.format != "B":
            mv = mv.cast("B")
        n = len(mv)
        if 0 < nbytes < n:
            n = nbytes
        if n > avail:
            n = avail
        ring = self._rx_ring
        txh = self._tx_hdr
        fb = self._flag_bits
        # Publish piece by piece: the writer refills behind us while we copy on.
        done = 0
        word = self._rx_empty_word
        while done < n:
            k = n - done
            if k > _PIECE:
                k = _PIECE
            if k > L - pos:
                k = L - pos
            mv[done : done + k] = ring[pos : pos + k]
            done += k
            pos += k
            if pos == L:
                pos = 0
                wrap = (wrap + 1) & 0xFFFF
                self._rx_new_wrap(wrap)
            word = wrap << WRAP_SHIFT | pos << COUNT_SHIFT
            self._rx_empty_word = word
            txh[W_CONS] = word | fb
        if self._flag_bits != fb:  # a writer thread published flags meanwhile: keep both
            txh[W_CONS] = word | self._flag_bits
        self._rx_pos = pos
        wait = self._tx_ctrl[C_WAIT_SPACE]  # the peer's "kick me" for space
        if wait & WANT_SPACE and wait >> 8 != self._kicked_s and avail - n <= self._rx_wake_fill:
            self._kick_space(wait)  # hysteresis: wake a blocked writer once half the ring is free
        if self._level and n == avail:
            self._level_sync()
        return n

    def _rx_new_wrap(self, wrap: int) -> None:
        self._rx_wrap = wrap
        self._rx_laps += 1
        self._rx_wbits = wbits = wrap << WRAP_SHIFT
        self._rx_lim = wbits | self._rx_len << COUNT_SHIFT

    def recv_bytes(self, bufsize: int) -> bytes:
        """Up to ``bufsize`` received bytes as a new ``bytes`` object, copied once, straight
        out of the ring (what ``socket.recv`` returns, without a zeroed scratch buffer and a
        second copy). ``b""`` and errors as :meth:`recv_into` (stops at the ring's end)."""
        if self._closed:
            self._check_open()
        hdr = self._rx_hdr
        flags = hdr[W_CONS] >> CSFLAGS_SHIFT
        prod = hdr[W_PROD]
        L = self._rx_len
        pos = self._rx_pos
        wrap = self._rx_wrap
        avail = (
            (((prod >> WRAP_SHIFT) - wrap) & 0xFFFF) * L + (prod >> COUNT_SHIFT & 0xFFFFFFFF) - pos
        )
        if avail <= 0 or avail > L or bufsize <= 0 or flags & PEER_CONN_ABORT or self._dead:
            scratch = bytearray(1 if bufsize > 0 else 0)  # every unusual case: recv_into's
            return bytes(scratch[: self._recv_into(scratch)])
        n = min(bufsize, avail, L - pos)
        data = bytes(self._rx_ring[pos : pos + n])
        pos += n
        if pos == L:
            pos = 0
            wrap = (wrap + 1) & 0xFFFF
            self._rx_new_wrap(wrap)
        word = wrap << WRAP_SHIFT | pos << COUNT_SHIFT
        self._rx_empty_word = word
        fb = self._flag_bits
        txh = self._tx_hdr
        txh[W_CONS] = word | fb
        if self._flag_bits != fb:
            txh[W_CONS] = word | self._flag_bits
        self._rx_pos = pos
        wait = self._tx_ctrl[C_WAIT_SPACE]
        if wait & WANT_SPACE and wait >> 8 != self._kicked_s and avail - n <= self._rx_wake_fill:
            self._kick_space(wait)
        if self._level and n == avail:
            self._level_sync()
        return data

    def readable(self) -> bool:
        """True when :meth:`recv_into` would return data or EOF, or raise (no blocking)."""
        self._check_open()
        return self._rx_ready() or self._check_link()

    def spin_readable(self) -> bool:
        """A blocking reader's first resort after :meth:`recv_fast` found nothing: spin on the
        peer's producer word (the adaptive budget of :meth:`wait_readable`'s spin, no sleep,
        no syscall but the spin's yields). True when data, EOF or an error may be there now.
        Costs a few bytecodes to enter, where :meth:`wait_readable`'s set-up costs microseconds
        that a ping-pong's reply would otherwise wait for."""
        if self._rx_fast and _spin(
            self._wd, self._rx_ready, None, self._rx_hdr, W_PROD, self._rx_empty_word
        ):
            self._n_spin_hits += 1
            return True
        return False

    def wait_readable(self, timeout: float | None = None) -> bool:
        """Wait for data, EOF or an abort. False on timeout."""
        return self._wait(self._wd, timeout)

    @property
    def eof(self) -> bool:
        """The peer will send nothing more and everything it sent has been read."""
        if self._closed:
            return False
        hdr = self._rx_hdr
        if not hdr[W_CONS] >> CSFLAGS_SHIFT & (PEER_DONE_WRITING | PEER_CONN_CLOSED):
            return False
        return hdr[W_PROD] & _CURSOR_MASK == self._rx_empty_word

    @property
    def aborted(self) -> bool:
        """The connection was reset: by us, by the peer, or by the peer's death."""
        if self._local_abort or self._peer_died or self._violation is not None:
            return True
        if self._closed:
            return False
        if self._rx_hdr[W_CONS] >> CSFLAGS_SHIFT & PEER_CONN_ABORT:
            return True
        return self._check_link() and self._peer_died

    @property
    def peer_closed(self) -> bool:
        """The peer has closed its end (orderly close, abort, or death)."""
        if self._closed:
            return self._link_dead
        if self._rx_hdr[W_CONS] >> CSFLAGS_SHIFT & (PEER_CONN_CLOSED | PEER_CONN_ABORT):
            return True
        return self._check_link()

    # --------------------------------------------------------------------------- closing

    def close(self) -> None:
        """Close this end: ``peer_conn_closed``, or an abort when received data is unread.
        Idempotent; releases the mappings and fds."""
        if self._closed:
            return
        try:
            if not (self._local_abort or self._peer_died or self._violation):
                flags = self._rx_hdr[W_CONS] >> CSFLAGS_SHIFT
                unread = self._rx_hdr[W_PROD] & _CURSOR_MASK != self._rx_empty_word
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
        try:
            self._local_abort = self._dead = True
            self._stop_fast()
            self._set_csflags(self._csflags | PEER_CONN_ABORT)
        finally:
            self._release()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> Channel:
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
        self._stop_fast()
        if self._level:
            _watcher().remove(self._link_fd)
        self._link.close()  # the peer sees POLLHUP
        for fd in (self._rx_efd, self._tx_efd):
            with contextlib.suppress(OSError):
                os.close(fd)
        for view in self._views:
            view.release()
        self._views.clear()
        for mm in (self._rx_mm, self._tx_mm):
            try:  # noqa: SIM105
                mm.close()
            except BufferError:  # someone still holds a view: the GC unmaps later
                pass

    # ---------------------------------------------------------------------- observability

    def fileno(self) -> int:
        """The RX eventfd, readable (level-triggered) while data, EOF or an abort is pending —
        also a peer's death, which a small per-process thread turns into a kick. Calling this
        switches the channel to *level mode*: it then keeps itself armed whenever nothing is
        pending, so the peer kicks on every empty→non-empty transition. The fd always polls
        writable (an eventfd); check :meth:`writable` after a short send."""
        self._check_open()
        if not self._level:
            self._level = True
            self._rx_fast = False  # level mode keeps the eventfd in step: long way
            _watcher().add(self._link_fd, self._rx_efd)
            self._level_sync()
        return self._rx_efd

    def stats(self) -> dict[str, Any]:
        """Cursors, byte counters and flags, for smcctl/D-Bus and tests."""
        self._check_open()
        hdr = self._rx_hdr
        peer_prod, peer_cons = hdr[W_PROD], hdr[W_CONS]
        _, _, peer_pf, peer_csf = layout.split_word(peer_cons)
        rx_w, rx_c = self._rx_wrap, self._rx_pos
        tx_w, tx_c = self._tx_wrap, self._tx_pos
        pw, pc, _, _ = layout.split_word(peer_prod)
        cw, cc, _, _ = layout.split_word(peer_cons)
        return {
            "rx_size": self._rx_size,
            "tx_size": self._tx_size,
            "rx_prod": (pw, pc),  # peer's producer cursor in our RX ring
            "rx_cons": (rx_w & 0xFFFF, rx_c),  # our consumer cursor
            "tx_prod": (tx_w & 0xFFFF, tx_c),  # our producer cursor in the peer's ring
            "tx_cons": (cw, cc),  # peer's consumer cursor in its ring
            "bytes_received": self.bytes_received,
            "bytes_sent": self.bytes_sent,
            "local_prod_flags": self._pflags,
            "local_conn_state_flags": self._csflags,
            "peer_prod_flags": peer_pf,
            "peer_conn_state_flags": peer_csf,
            "eof": self.eof,
            "aborted": self._local_abort or self._peer_died or bool(peer_csf & PEER_CONN_ABORT),
            "peer_died": self._peer_died,
            "violation": self._violation,
            "kicks_sent": self._n_kicks,
            "sleeps": self._n_sleeps,
            "spin_hits": self._n_spin_hits,
            "missed_wakeups": self._n_missed,
            "spin_budget_ns": self._wd.spin_ns,
            "spin_budget_space_ns": self._ws.spin_ns,
        }

    # ------------------------------------------------------------------------- internals

    def _rx_ready(self) -> bool:
        hdr = self._rx_hdr
        return bool(
            hdr[W_PROD] & _CURSOR_MASK != self._rx_empty_word
            or hdr[W_CONS] >> CSFLAGS_SHIFT & _ANY_CLOSE
            or self._local_abort
            or self._peer_died
        )

    def _tx_ready(self) -> bool:
        peer = self._rx_hdr[W_CONS]
        # The peer's consumer word when our ring is full: exactly one ring behind us.
        full = ((self._tx_wrap - 1) & 0xFFFF) << WRAP_SHIFT | self._tx_pos << COUNT_SHIFT
        return bool(
            peer & _CURSOR_MASK != full
            or peer >> CSFLAGS_SHIFT & (PEER_CONN_ABORT | PEER_CONN_CLOSED)
            or self._wr_shut
            or self._local_abort
            or self._peer_died
        )

    def _wait(self, w: _Waiter, timeout: float | None) -> bool:
        self._check_open()
        ready: Callable[[], bool] = self._rx_ready if w is self._wd else self._tx_ready
        if ready():
            return True
        if timeout is not None and timeout <= 0:
            return self._check_link()
        deadline = None if timeout is None else time.monotonic() + timeout
        # 1. Spin: loads and yields only (see _spin), watching the word the peer will store.
        hdr = self._rx_hdr
        if w is self._wd:
            idx, old = W_PROD, self._rx_empty_word
        else:
            idx, old = W_CONS, hdr[W_CONS]
        if _spin(w, ready, timeout, hdr, idx, old) and ready():
            self._n_spin_hits += 1
            return True
        # 2. Sleep: take a descriptor no other sleeper of this channel holds, ask for a kick
        #    on it, fence, look again, then poll it (and the link for a hang-up).
        self._n_sleeps += 1
        on_link = self._take_fd(w)
        poller = self._poller(on_link)
        try:
            woken = False
            while True:
                fresh = self._arm(w, on_link, woken)
                self._drain(on_link)  # before looking: a kick after the look stays readable
                if ready():
                    return True
                nap = layout.SAFETY_NET_S if fresh else _SLEEP_CAP_S
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
                    continue
                woken = True
                for _fd, ev in events:
                    if ev & (select.POLLHUP | select.POLLERR | select.POLLNVAL):
                        self._check_link()
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
                poller = self._link_poller = select.poll()
                poller.register(self._link_fd, select.POLLIN)
        else:
            poller = self._efd_poller
            if poller is None:
                poller = self._efd_poller = select.poll()
                poller.register(self._rx_efd, select.POLLIN)
                poller.register(self._link_fd, 0)
        return poller

    def _take_fd(self, w: _Waiter) -> bool:
        """Choose what a sleeping wait polls; True for the peer link, False for the eventfd.
        The link is preferred (see :meth:`_kick`); level mode keeps the eventfd for data (it is
        ``fileno()``) and the link for space. Two sleepers (a reader and a writer thread) never
        share one descriptor, so neither can drain the other's kick."""
        with self._sleep_lock:
            on_link = w is self._ws if self._level else not self._link_sleeper
            if on_link:
                self._link_sleeper = True
            else:
                self._efd_sleeper = True
            return on_link

    def _release_fd(self, on_link: bool) -> None:
        with self._sleep_lock:
            if on_link:
                self._link_sleeper = False
            else:
                self._efd_sleeper = False

    def _arm(self, w: _Waiter, on_link: bool, fresh: bool = False) -> bool:
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

    def _disarm(self, w: _Waiter) -> None:
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
                poller = self._level_poller = select.poll()
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
        that had not closed cleanly has died: that is an abort. True when the link is gone."""
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
                    poller = self._hup_poller = select.poll()
                    poller.register(self._link_fd, 0)
                gone = poller.poll(0)
            finally:
                self._hup_lock.release()
        else:
            poller = select.poll()
            poller.register(self._link_fd, 0)
            gone = poller.poll(0)
        if not gone:
            return False
        self._link_dead = True
        flags = self._rx_hdr[W_CONS] >> CSFLAGS_SHIFT  # stored before the peer's close()
        if not flags & (PEER_CONN_CLOSED | PEER_CONN_ABORT):
            self._peer_died = True
            self._dead = True
            self._stop_fast()
        return True

    def _protocol_violation(self, what: str) -> None:
        self._violation = what
        self._dead = True
        self._stop_fast()
        self.abort()
        raise ConnectionResetError(errno.ECONNRESET, f"SMC-D channel: {what}")

    def _raise_reset(self) -> None:
        self._check_open()
        if self._violation:
            raise ConnectionResetError(errno.ECONNRESET, f"SMC-D channel: {self._violation}")
        if self._peer_died:
            raise ConnectionResetError(errno.ECONNRESET, "SMC-D peer died (peer link closed)")
        if self._local_abort:
            raise ConnectionResetError(errno.ECONNRESET, "SMC-D connection aborted locally")
        if self._rx_hdr[W_CONS] >> CSFLAGS_SHIFT & PEER_CONN_ABORT:
            raise ConnectionResetError(errno.ECONNRESET, "SMC-D connection aborted by peer")
        raise ConnectionResetError(errno.ECONNRESET, "SMC-D peer has closed the connection")

    def _raise_closed_or_pipe(self) -> None:
        self._check_open()
        raise BrokenPipeError(errno.EPIPE, "SMC-D channel: shut down for writing")

    def _check_open(self) -> None:
        if self._closed:
            raise OSError(errno.EBADF, "SMC-D channel is closed")


class _Waiter:
    """The wait state of one direction of one end: which WAIT/KICK words of the trailer it
    uses, its request generation and bits, and its adaptive spin budget. One thread at a time
    waits in each direction."""

    __slots__ = ("armed", "gen", "kick_idx", "spin_ns", "wait_idx", "want", "yield_ns")

    def __init__(self, want: int, wait_idx: int, kick_idx: int) -> None:
        self.want = want
        self.wait_idx = wait_idx
        self.kick_idx = kick_idx
        self.gen = 0
        self.armed = 0
        self.spin_ns = SPIN_START_NS
        self.yield_ns = SPIN_YIELD_NS


# Spinning is given up for a while, process-wide, once a yield showed that this CPU is wanted
# by another task: [monotonic ns until which waits sleep at once, current back-off ns].
_contended = [0, SPIN_BACKOFF_MIN_NS]


def _spin(
    w: _Waiter,
    ready: Callable[[], bool],
    timeout: float | None,
    hdr: memoryview,
    idx: int,
    old: int,
) -> bool:
    """Wait for ``ready()`` without sleeping, for at most ``w.spin_ns``. True when it came.
    Between two calls of ``ready()`` (and of the clock) it loads ``hdr[idx]`` eight times and
    compares it with ``old``, the value meaning "nothing yet": the peer's store is seen within
    a fraction of a microsecond, where each ``ready()`` call alone costs several tenths. A
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
    until, backoff = _contended
    if now < until:
        return False
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
            if budget < SPIN_MAX_NS:
                w.spin_ns = min(SPIN_MAX_NS, budget + (budget >> 1) + 1000)
            if switched:  # the peer ran on our CPU while we yielded
                w.yield_ns = 0
            elif every < SPIN_YIELD_NS:
                w.yield_ns = SPIN_YIELD_NS
            if now > until + backoff:  # a calm spell as long as the back-off: forget it
                _contended[1] = SPIN_BACKOFF_MIN_NS
            return True
        now = clock()
        if now >= end:
            break
        if now >= next_yield:
            yield_()
            after = clock()
            if after - now > SPIN_CONTENDED_NS and not ready():
                _contended[0] = after + backoff
                _contended[1] = min(SPIN_BACKOFF_MAX_NS, backoff * 2)
                break
            switched = after - now > SPIN_SWITCHED_NS
            now = after
            next_yield = after + every
    w.spin_ns = max(SPIN_MIN_NS, budget >> 1)
    return False


class _LinkWatcher:
    """One daemon thread per process, started on the first :meth:`Channel.fileno`: it epolls
    the peer links of level-mode channels and kicks the channel's own eventfd when a link
    hangs up, so that ``select`` on ``fileno()`` also wakes for a peer's death."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self._ep = select.epoll()
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


_watcher_instance: _LinkWatcher | None = None
_watcher_lock = threading.Lock()


def _watcher() -> _LinkWatcher:
    global _watcher_instance
    with _watcher_lock:
        if _watcher_instance is None or _watcher_instance.pid != os.getpid():
            _watcher_instance = _LinkWatcher()
        return _watcher_instance
