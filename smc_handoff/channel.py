"""The application side of one SMC-D connection: two DMBs in shared memory, no kernel on the
data path (standard library only).

Each end maps both DMBs of the connection read-write (memfds handed over with SCM_RIGHTS):

* its **RX DMB**, into which the peer writes data at the peer's producer cursor and then the
  32-byte SMC-D CDC header (PROTOCOL.md §1.8) carrying the peer's producer cursor (data for us),
  the peer's consumer cursor (how far it has read *our* data from *its* DMB) and the peer's flags;
* its **TX DMB** (the peer's RX DMB), into which it does the same for the peer.

So, as with loopback-ism, a byte is copied exactly twice (application buffer → peer's DMB →
peer's application buffer) and each header word has exactly one writer. The layout, the atomic
cursor words and the memory-ordering argument live in :mod:`smc_handoff._ring`.

Wakeups: a waiter first spins (adaptive budget, no syscalls); only then does it publish "kick
me" in its DMB's control trailer, fence, look once more, and sleep in ``poll`` on its RX eventfd
and the peer link. A publisher kicks the peer's eventfd only when it sees such a request for a
generation it has not kicked yet, so a busy stream makes no syscalls at all.

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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from smc_handoff import _ring
from smc_handoff._ring import (
    C_KICK,
    C_WAIT,
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

DMB_SIZES = _ring.DMB_SIZES

# CDC flag bits (same values as smcd_daemon.wire.cdc.ProducerFlag / ConnStateFlag).
WRITE_BLOCKED = 0x80
PEER_DONE_WRITING = 0x80
PEER_CONN_CLOSED = 0x40
PEER_CONN_ABORT = 0x20
_ANY_CLOSE = PEER_DONE_WRITING | PEER_CONN_CLOSED | PEER_CONN_ABORT

# "Kick me" bits in the WAIT word of the control trailer.
WANT_DATA = 0x1  # data, EOF or abort in my RX DMB
WANT_SPACE = 0x2  # the peer consumed from my TX ring
WANT_LINK = 0x4  # kick me through the peer link, not the eventfd (see _kick)
_WANT_ANY = WANT_DATA | WANT_SPACE

_CURSOR_MASK = 0xFFFF << WRAP_SHIFT | 0xFFFFFFFF << COUNT_SHIFT

#: Adaptive spin budget (nanoseconds): grows while spinning pays off, halves when it did not.
SPIN_MAX_NS = 200_000
SPIN_MIN_NS = 2_000
SPIN_START_NS = 50_000
#: Longest single nap after the first (the peer link and the eventfd wake us before that).
_SLEEP_CAP_S = 1.0


class ChannelUnsupportedError(OSError):
    """This CPU's memory model does not give the ordering the ring needs (see ``_ring``);
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
            if not _ring.ORDERING_OK:
                raise ChannelUnsupportedError(
                    errno.EOPNOTSUPP, "shared-memory channel needs a TSO CPU (x86-64, s390x)"
                )
            check_dmb_size(rx_size)
            check_dmb_size(tx_size)
            rx_mm = _ring.map_dmb(rx_dmb_fd, rx_size)
            tx_mm = _ring.map_dmb(tx_dmb_fd, tx_size)
            os.set_blocking(rx_eventfd, False)
            self._link = socket.socket(fileno=peer_link_fd)
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

        # Receive side: total bytes consumed, and the prod word that means "nothing new".
        self._rx_cons = 0
        self._rx_empty_word = 0
        # A writer sleeping for space is kicked only once at most this much is left unread
        # (as TCP wakes writers only when a third of the buffer is free): one wakeup per half
        # ring instead of one per read.
        self._rx_wake_fill = self._rx_len // 2
        # Send side: total bytes produced, and the peer cons word that means "ring full".
        self._tx_prod = 0
        self._tx_full_word = self._full_word(0)
        # Our flags, published with our consumer cursor in the peer's header (word 2).
        self._pflags = 0
        self._csflags = 0
        self._flag_bits = 0
        self._wr_shut = False

        # Wakeup state: our WAIT generation/bits, what we drained, what we kicked at the peer.
        self._gen = 0
        self._armed = 0
        self._drained_upto = 0
        self._self_kicked = False
        self._kicked = 0
        self._level = False
        self._spin_ns = SPIN_START_NS

        # Failure state.
        self._link_dead = False
        self._peer_died = False
        self._local_abort = False
        self._violation: str | None = None
        self._dead = False  # any of the three above: every data operation resets

        self._poller = select.poll()
        self._poller.register(rx_eventfd, select.POLLIN)
        self._poller.register(peer_link_fd, select.POLLIN)
        self._efd_poller = select.poll()
        self._efd_poller.register(rx_eventfd, select.POLLIN)
        self._link_poller = select.poll()
        self._link_poller.register(peer_link_fd, select.POLLIN)

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

    def _full_word(self, prod: int) -> int:
        """The peer consumer-cursor bits that mean "ring full" when we have produced ``prod``:
        the peer is exactly one ring behind (floor division makes wrap -1 → 0xFFFF at start)."""
        wrap, count = divmod(prod - self._tx_len, self._tx_len)
        return (wrap & 0xFFFF) << WRAP_SHIFT | count << COUNT_SHIFT

    # ------------------------------------------------------------------------------ sending

    def send_into(self, data: Any) -> int:
        """Copy as much of ``data`` (any bytes-like) as fits into the peer's ring and publish
        it. Returns the bytes accepted: possibly fewer than ``len(data)``, 0 when the ring is
        full. Raises ``BrokenPipeError`` after :meth:`shutdown_write`, ``ConnectionResetError``
        when the connection was aborted or the peer has closed."""
        if self._wr_shut or self._closed:
            self._raise_closed_or_pipe()
        peer = self._rx_hdr[W_CONS]  # the peer's consumer cursor in our TX ring + its flags
        if peer >> CSFLAGS_SHIFT & (PEER_CONN_ABORT | PEER_CONN_CLOSED) or self._dead:
            self._raise_reset()
        mv = data if type(data) is memoryview else memoryview(data)
        if mv.format != "B" or mv.ndim != 1:
            mv = mv.cast("B")
        size = len(mv)
        L = self._tx_len
        prod = self._tx_prod
        pwrap, pcount = divmod(prod, L)
        inflight = (
            ((pwrap - (peer >> WRAP_SHIFT)) & 0xFFFF) * L
            + pcount
            - (peer >> COUNT_SHIFT & 0xFFFFFFFF)
        )
        space = L - inflight
        if space <= 0 or size == 0:
            if space < 0 or inflight < 0:
                self._protocol_violation(f"peer consumer cursor is {-space} bytes ahead")
            if size and not self._pflags & WRITE_BLOCKED:
                self._set_pflags(self._pflags | WRITE_BLOCKED)
            return 0
        n = size if size < space else space
        end = pcount + n
        ring = self._tx_ring
        if end <= L:
            ring[pcount:end] = mv[:n]
        else:
            first = L - pcount
            ring[pcount:L] = mv[:first]
            ring[: n - first] = mv[first:n]
        prod += n
        self._tx_prod = prod
        pwrap, pcount = divmod(prod, L)
        self._tx_hdr[W_PROD] = (pwrap & 0xFFFF) << WRAP_SHIFT | pcount << COUNT_SHIFT
        self._tx_full_word = ((pwrap - 1) & 0xFFFF) << WRAP_SHIFT | pcount << COUNT_SHIFT
        wait = self._tx_ctrl[C_WAIT]  # the peer's "kick me"
        if wait & WANT_DATA and wait >> 8 != self._kicked:
            self._kick(wait >> 8, wait)
        if self._pflags & WRITE_BLOCKED:
            self._set_pflags(self._pflags & ~WRITE_BLOCKED)
        return n

    def writable(self) -> bool:
        """True when :meth:`send_into` would accept a byte or raise (no blocking either way)."""
        self._check_open()
        return self._tx_ready() or self._check_link()

    def wait_writable(self, timeout: float | None = None) -> bool:
        """Wait until the peer's ring has room, or an error is pending. False on timeout."""
        return self._wait(WANT_SPACE, timeout)

    def shutdown_write(self) -> None:
        """SHUT_WR: after everything sent so far, the peer reads EOF (``peer_done_writing``)."""
        self._check_open()
        if not self._csflags & PEER_DONE_WRITING:
            self._wr_shut = True
            self._set_csflags(self._csflags | PEER_DONE_WRITING)

    # ---------------------------------------------------------------------------- receiving

    def recv_into(self, buffer: Any, nbytes: int = 0) -> int:
        """Copy up to ``nbytes`` (default: all of ``buffer``) received bytes into ``buffer``.
        Returns the count; 0 means EOF when :attr:`eof` is set, else nothing yet (would block).
        Raises ``ConnectionResetError`` once the connection is aborted (pending data is
        discarded, as with a TCP RST)."""
        if self._closed:
            self._check_open()
        hdr = self._rx_hdr
        flags = hdr[W_CONS] >> CSFLAGS_SHIFT  # read flags *before* the producer cursor
        if flags & PEER_CONN_ABORT or self._dead:
            self._raise_reset()
        prod = hdr[W_PROD]
        L = self._rx_len
        cons = self._rx_cons
        cwrap, ccount = divmod(cons, L)
        avail = (
            (((prod >> WRAP_SHIFT) - cwrap) & 0xFFFF) * L
            + (prod >> COUNT_SHIFT & 0xFFFFFFFF)
            - ccount
        )
        if avail <= 0:
            if avail < 0:
                self._protocol_violation(f"peer producer cursor is {-avail} bytes behind")
            if flags & (PEER_DONE_WRITING | PEER_CONN_CLOSED):
                return 0  # EOF: the flags were read first, so that cursor was the last one
            if self._check_link():
                self._raise_reset()
            if self._level:
                self._level_sync()
            return 0
        if avail > L:
            self._protocol_violation(f"peer claims {avail} bytes in a {L}-byte ring")
        mv = buffer if type(buffer) is memoryview else memoryview(buffer)
        if mv.format != "B" or mv.ndim != 1:
            mv = mv.cast("B")
        n = len(mv)
        if 0 < nbytes < n:
            n = nbytes
        if n > avail:
            n = avail
        end = ccount + n
        ring = self._rx_ring
        if end <= L:
            mv[:n] = ring[ccount:end]
        else:
            first = L - ccount
            mv[:first] = ring[ccount:L]
            mv[first:n] = ring[: n - first]
        cons += n
        self._rx_cons = cons
        cwrap, ccount = divmod(cons, L)
        word = (cwrap & 0xFFFF) << WRAP_SHIFT | ccount << COUNT_SHIFT
        self._rx_empty_word = word
        self._tx_hdr[W_CONS] = word | self._flag_bits  # our consumer cursor → peer's header
        wait = self._tx_ctrl[C_WAIT]
        if wait & WANT_SPACE and wait >> 8 != self._kicked and avail - n <= self._rx_wake_fill:
            self._kick(
                wait >> 8, wait
            )  # hysteresis: wake a blocked writer once half the ring is free
        if self._level and n == avail:
            self._level_sync()
        return n

    def readable(self) -> bool:
        """True when :meth:`recv_into` would return data or EOF, or raise (no blocking)."""
        self._check_open()
        return self._rx_ready() or self._check_link()

    def wait_readable(self, timeout: float | None = None) -> bool:
        """Wait for data, EOF or an abort. False on timeout."""
        return self._wait(WANT_DATA, timeout)

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
                    self._set_csflags(self._csflags | PEER_CONN_ABORT)
                else:
                    self._wr_shut = True
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
            _watcher().add(self._link_fd, self._rx_efd)
            self._level_sync()
        return self._rx_efd

    def stats(self) -> dict[str, Any]:
        """Cursors, byte counters and flags, for smcctl/D-Bus and tests."""
        self._check_open()
        hdr = self._rx_hdr
        peer_prod, peer_cons = hdr[W_PROD], hdr[W_CONS]
        _, _, peer_pf, peer_csf = _ring.split_word(peer_cons)
        rx_w, rx_c = divmod(self._rx_cons, self._rx_len)
        tx_w, tx_c = divmod(self._tx_prod, self._tx_len)
        pw, pc, _, _ = _ring.split_word(peer_prod)
        cw, cc, _, _ = _ring.split_word(peer_cons)
        return {
            "rx_size": self._rx_size,
            "tx_size": self._tx_size,
            "rx_prod": (pw, pc),  # peer's producer cursor in our RX ring
            "rx_cons": (rx_w & 0xFFFF, rx_c),  # our consumer cursor
            "tx_prod": (tx_w & 0xFFFF, tx_c),  # our producer cursor in the peer's ring
            "tx_cons": (cw, cc),  # peer's consumer cursor in its ring
            "bytes_received": self._rx_cons,
            "bytes_sent": self._tx_prod,
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
            "spin_budget_ns": self._spin_ns,
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
        return bool(
            peer & _CURSOR_MASK != self._tx_full_word
            or peer >> CSFLAGS_SHIFT & (PEER_CONN_ABORT | PEER_CONN_CLOSED)
            or self._wr_shut
            or self._local_abort
            or self._peer_died
        )

    def _wait(self, want: int, timeout: float | None) -> bool:
        self._check_open()
        ready: Callable[[], bool] = self._rx_ready if want == WANT_DATA else self._tx_ready
        if ready():
            return True
        if timeout is not None and timeout <= 0:
            return self._check_link()
        deadline = None if timeout is None else time.monotonic() + timeout
        # 1. Spin: pure loads, no syscalls; the budget adapts to how often this pays off, and
        #    there is no spinning at all while the CPUs are oversubscribed (the peer may be
        #    waiting for the very CPU we would burn).
        clock = time.perf_counter_ns
        now = clock()
        if _spin_allowed(now):
            budget = self._spin_ns
            end = now + budget
            if timeout is not None:
                end = min(end, now + int(timeout * 1e9))
            while True:
                if ready() or ready() or ready() or ready():
                    self._n_spin_hits += 1
                    self._spin_ns = min(SPIN_MAX_NS, budget + (budget >> 1) + 1000)
                    return True
                if clock() >= end:
                    break
            self._spin_ns = max(SPIN_MIN_NS, budget >> 1)
        # 2. Sleep: ask for a kick, fence, look again, then poll the eventfd and the link.
        self._n_sleeps += 1
        try:
            woken = False
            while True:
                fresh = self._arm(want, woken)
                self._drain()  # before looking: a kick after the look stays in the eventfd
                if ready():
                    return True
                nap = _ring.SAFETY_NET_S if fresh else _SLEEP_CAP_S
                if deadline is not None:
                    nap = min(nap, deadline - time.monotonic())
                    if nap <= 0:
                        return False
                events = self._poller.poll(max(1, int(nap * 1000 + 0.999)))
                if not events:
                    if ready():
                        # Published just as the nap ended, or a lost wakeup? A publisher kicks
                        # right after publishing, so a kick that never comes means lost.
                        if not self._efd_poller.poll(20):
                            self._n_missed += 1  # the safety net caught a lost wakeup
                        return True
                    continue
                woken = True
                for fd, _ev in events:
                    if fd == self._link_fd:
                        self._check_link()
                if ready():
                    return True
        finally:
            self._disarm()
            if self._level and not self._closed:
                self._level_sync()

    def _arm(self, bits: int, fresh: bool = False) -> bool:
        """Publish "kick me for ``bits``" and fence (see ``_ring``: the Dekker race). True when
        a new WAIT was published (so the first nap must be short)."""
        if not self._level:
            bits |= WANT_LINK  # a sleeping wait polls the link too: take the faster kick
        # Reuse the current generation only when no kick can have been seen for it: KICK is
        # stored after the kick itself, so after any wakeup it may still read "not kicked".
        if not fresh and self._armed & bits == bits and self._rx_ctrl[C_KICK] != self._gen:
            return False
        self._gen += 1
        self._armed = self._armed & ~WANT_LINK | bits
        self._rx_ctrl[C_WAIT] = self._gen << 8 | self._armed
        _ring.fence()
        return True

    def _disarm(self) -> None:
        keep = WANT_DATA if self._level else 0
        if self._armed != keep and not self._closed:
            self._armed = keep
            self._rx_ctrl[C_WAIT] = self._gen << 8 | keep

    def _drain(self) -> None:
        """Empty our eventfd if anything may have been written to it since the last drain."""
        kicked = self._rx_ctrl[C_KICK]  # read before the eventfd: the peer writes it after
        # Level mode always looks: a kick whose KICK store is still on its way must not leave
        # the fd readable with nothing pending.
        if self._self_kicked or kicked > self._drained_upto or self._level:
            if self._level or self._self_kicked:  # otherwise the peer kicks via the link
                with contextlib.suppress(BlockingIOError):
                    os.eventfd_read(self._rx_efd)
            if not self._link_dead:
                try:
                    while self._link.recv(64, socket.MSG_DONTWAIT):
                        pass
                except OSError:  # drained (EAGAIN), or the peer is gone: _check_link decides
                    pass
            self._drained_upto = kicked
            self._self_kicked = False

    def _level_sync(self) -> None:
        """Make the eventfd's readability match "data, EOF or abort pending" (level mode)."""
        if not self._rx_ready():
            self._arm(WANT_DATA, fresh=True)
            self._drain()
            if not self._rx_ready():
                return
        if not self._efd_poller.poll(0):  # look, do not infer: a drain may have raced a kick
            os.eventfd_write(self._rx_efd, 1)
            self._self_kicked = True

    def _kick(self, gen: int, wait: int) -> None:
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
            return
        self._tx_ctrl[C_KICK] = gen  # after the write: the peer drains only what it saw
        self._kicked = gen
        self._n_kicks += 1

    def _kick_if_waiting(self) -> None:
        wait = self._tx_ctrl[C_WAIT]
        if wait & _WANT_ANY and wait >> 8 != self._kicked:
            self._kick(wait >> 8, wait)

    def _set_pflags(self, pflags: int) -> None:
        self._pflags = pflags
        self._publish_flags()

    def _set_csflags(self, csflags: int) -> None:
        self._csflags = csflags
        self._publish_flags()
        self._kick_if_waiting()

    def _publish_flags(self) -> None:
        self._flag_bits = self._pflags << PFLAGS_SHIFT | self._csflags << CSFLAGS_SHIFT
        self._tx_hdr[W_CONS] = self._rx_empty_word | self._flag_bits

    def _check_link(self) -> bool:
        """Look (without blocking) whether the peer's end of the link is gone. A gone peer
        that had not closed cleanly has died: that is an abort. True when the link is gone."""
        if self._link_dead:
            return True
        if self._closed or not self._link_poller.poll(0):
            return False
        try:
            if self._link.recv(64):
                return False  # peers send nothing on the link; ignore stray bytes
        except BlockingIOError:
            return False
        except OSError:
            pass
        self._link_dead = True
        self._poller.unregister(self._link_fd)
        flags = self._rx_hdr[W_CONS] >> CSFLAGS_SHIFT  # stored before the peer's close()
        if not flags & (PEER_CONN_CLOSED | PEER_CONN_ABORT):
            self._peer_died = True
            self._dead = True
        return True

    def _protocol_violation(self, what: str) -> None:
        self._violation = what
        self._dead = True
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


_NCPU = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
_LOAD_SAMPLE_NS = 2_000_000
_load_fd = -1
_load_when = -_LOAD_SAMPLE_NS
_load_ok = _NCPU > 1


def _spin_allowed(now: int) -> bool:
    """Spinning only pays when the peer has a CPU of its own: never on one CPU, and not while
    more tasks are runnable than there are CPUs (``/proc/loadavg`` field 4, sampled at most
    every 2 ms, ~3 µs a sample). With a CPU hog around, waiters then sleep at once and the
    peer's kick wakes them with the scheduler's wakeup preemption."""
    global _load_fd, _load_when, _load_ok
    if _NCPU < 2:
        return False
    if now - _load_when < _LOAD_SAMPLE_NS:
        return _load_ok
    _load_when = now
    try:
        if _load_fd < 0:
            _load_fd = os.open("/proc/loadavg", os.O_RDONLY | os.O_CLOEXEC)
        running = int(os.pread(_load_fd, 128, 0).split()[3].split(b"/")[0])
    except (OSError, ValueError, IndexError):
        return True
    _load_ok = running <= _NCPU
    return _load_ok


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
