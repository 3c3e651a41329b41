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
before the general wait's set-up. In a stream through a small ring (a 256 KiB DMB)
the space known free runs out after every write or two while the reader frees more behind
it, so a write that does not fit the known run looks at the consumer cursor once more before
giving up the fast path; and a read larger than a piece stays on the fast path too, copied
and published piece by piece (the writer refills behind it).

Close (RFC 7609 §4, Linux ``smc_close.c``): :meth:`Channel.shutdown_write` sets
``peer_done_writing`` after all data is published (the peer reads EOF after draining);
:meth:`Channel.close` sets ``peer_conn_closed``, or aborts (``peer_conn_abort`` → the peer gets
``ConnectionResetError``) when received data is still unread; :meth:`Channel.abort` always aborts.
Liveness needs no daemon: each end holds one end of a ``SOCK_SEQPACKET`` socketpair, the *peer
link*; when a process dies the kernel closes its end and the survivor sees ``POLLHUP``. A peer
that had not closed gets the close its kernel would have made for it (``smc_close_final``):
``peer_conn_closed`` when it had read everything, else an abort (TCP's FIN or RST).

Modules: this one holds :class:`Channel`'s data path; its state, flags, kicks, waits, liveness
and close are in :mod:`smc_handoff.channel_base` (the base class), the wakeup primitives in
:mod:`smc_handoff.wakeup`, the layout in :mod:`smc_handoff.layout`. Every public name is
importable from here.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

from smc_handoff import layout
from smc_handoff.channel_base import (
    ABORT_WORD,
    CURSOR_MASK,
    PEER_CONN_ABORT,
    PEER_CONN_CLOSED,
    PEER_DONE_WRITING,
    PIECE,
    TX_STOP_WORD,
    WRAP_FIELD,
    WRITE_BLOCKED,
    ChannelBase,
    ChannelFds,
    ChannelUnsupportedError,
    make_pair,
)
from smc_handoff.layout import (
    C_LEAVE,
    C_WAIT,
    C_WAIT_SPACE,
    COUNT_SHIFT,
    CSFLAGS_SHIFT,
    W_CONS,
    W_PROD,
    WRAP_SHIFT,
    create_dmb,
    fence,
    fence_end,
    fence_try,
    zero_dmb,
)
from smc_handoff.wakeup import WANT_DATA, WANT_LINK, WANT_SPACE, spin

__all__ = [
    "DMB_SIZES",
    "WANT_DATA",
    "WANT_LINK",
    "WANT_SPACE",
    "Channel",
    "ChannelFds",
    "ChannelUnsupportedError",
    "create_dmb",
    "make_pair",
    "zero_dmb",
]

DMB_SIZES = layout.DMB_SIZES
ONE_WRAP = 1 << WRAP_SHIFT
"""A producer word's wrap field one lap ahead of ours, minus ours (masked to the field)."""
_DONTWAIT = int(socket.MSG_DONTWAIT)
_RING_AT = layout.CDC_HEADER_LEN
"""Where the ring starts in a DMB's mapping (after the CDC header)."""


LEAVE_LEAVING, LEAVE_READY, LEAVE_GAVE_UP = 1, 2, 3
"""States of :meth:`Channel.leave_together` in the ``C_LEAVE`` trailer word (0: not leaving)."""
_LEAVE_POLL_S = 0.0005


class Channel(ChannelBase):
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
            and n <= PIECE
            and not self._rx_hdr[W_CONS] & TX_STOP_WORD
            and not self._dead
        ):
            pos = self._tx_pos
            at = pos + _RING_AT
            try:
                # Through the mapping, not the ring's memoryview: faster, and it takes only a
                # C-contiguous buffer, as a TCP socket's send does (a view's store would copy
                # a strided one).
                self._tx_mm[at : at + n] = data
            except (TypeError, ValueError, IndexError, BufferError, NotImplementedError):
                return 0  # not flat bytes (or a multi-byte format): the long way decides
            pos += n
            self._tx_hdr[W_PROD] = self._tx_wbits | pos << COUNT_SHIFT
            self._tx_pos = pos
            self._tx_run -= n
            # Our cursor is visible before we look for a request (layout.fence, inline).
            if fence_try(False):
                fence_end()
            else:
                fence()
            wait = self._tx_ctrl[C_WAIT]  # the peer's "kick me" for data
            if wait & WANT_DATA and wait >> 8 != self._kicked_d:
                self._kick_data(wait)
            return n
        if 0 < n <= PIECE:
            return self._send_more(data, n)
        return 0

    def _send_more(self, data: Any, n: int) -> int:
        """send_fast's second look, for a write the known free run does not hold: the consumer
        cursor again, and the write at the ring's end. All of ``data`` or 0 (then the long way
        decides: errors, a full ring, odd buffers).

        Why: the run is what the last long call saw free, and a reader that keeps pace frees
        more behind it all the time; and a stream's writes reach the ring's end once a lap (a
        DMB's ring is 32 bytes short of its size, so 64 KiB writes do not tile it). Without
        this look, most 64 KiB writes of a stream into a 256 KiB DMB went the long
        way, and a socket layer's long way around it, although they fitted."""
        if self._wr_shut or self._dead or self._fence or self._pflags & WRITE_BLOCKED:
            return 0
        peer = self._rx_hdr[W_CONS]
        if peer & TX_STOP_WORD:
            return 0
        L = self._tx_len
        pos = self._tx_pos
        inflight = (
            ((self._tx_wrap - (peer >> WRAP_SHIFT)) & 0xFFFF) * L
            + pos
            - (peer >> COUNT_SHIFT & 0xFFFFFFFF)
        )
        if not 0 <= inflight <= L:
            return 0  # a violation: the long way reports it
        left = L - inflight
        end = L - pos
        self._tx_run = left if left < end else end - 1
        if n > left:
            return 0  # no room for all of it: the long way writes what fits
        if n < end:
            return self.send_fast(data)
        # To the ring's end and on from its start: two copies, one cursor store.
        try:
            mv = data if type(data) is memoryview else memoryview(data)
            if mv.ndim != 1 or mv.itemsize != 1 or not mv.c_contiguous:
                return 0
            ring = self._tx_ring
            ring[pos:L] = mv[:end]
            rest = n - end
            if rest:
                ring[:rest] = mv[end:]
        except (TypeError, ValueError, NotImplementedError):  # not flat bytes: the long way
            return 0
        wrap = (self._tx_wrap + 1) & 0xFFFF
        self._tx_wrap = wrap
        self._tx_laps += 1
        self._tx_wbits = wbits = wrap << WRAP_SHIFT
        self._tx_hdr[W_PROD] = wbits | rest << COUNT_SHIFT
        self._tx_pos = rest
        left -= n
        self._tx_run = left if left < L - rest else L - rest - 1
        fence()
        wait = self._tx_ctrl[C_WAIT]
        if wait & WANT_DATA and wait >> 8 != self._kicked_d:
            self._kick_data(wait)
        return n

    def _send_into(self, data: Any) -> int:
        """send_into for every case: full ring, wrap, large writes, odd buffers, errors."""
        if self._fence:
            self._pass_fence()
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
            if size:
                self.tx_nospace = True
            return 0
        n = size if size < space else space
        if n < size:
            self.tx_nospace = True
        ring = self._tx_ring
        hdr = self._tx_hdr
        # Publish piece by piece: the reader copies out the first piece while we copy in the
        # next, instead of waiting for the whole write.
        done = 0
        while done < n:
            k = n - done
            if k > PIECE:
                k = PIECE
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
                fence()
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
        if self._fence:
            self._pass_fence()
        if not self._csflags & PEER_DONE_WRITING:
            self._wr_shut = True
            self._tx_run = 0
            self._set_csflags(self._csflags | PEER_DONE_WRITING)
            self._wake_sleepers()  # a send blocked in another thread fails at once (EPIPE)

    def shutdown_read(self) -> None:
        """SHUT_RD: nothing changes for the peer (the kernel's AF_SMC sends nothing either), but
        a read no longer waits: it returns what is there, else EOF. So the end polls readable
        from now on, as a TCP socket shut for reading does. A read blocked in another thread
        returns too, at once, as TCP's shutdown wakes it: whether it sleeps on the eventfd or
        on the peer link (see :meth:`_wake_sleepers`)."""
        self._rd_shut = True
        if self._level:
            self._level_sync()
        self._wake_sleepers()

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
        kind = type(buffer)
        # A strided view goes the long way (a TCP socket's recv_into refuses it).
        if self._rx_fast and (kind is bytearray or (kind is memoryview and buffer.c_contiguous)):
            hdr = self._rx_hdr
            if not hdr[W_CONS] & ABORT_WORD:  # read flags *before* the producer cursor
                prod = hdr[W_PROD]
                empty = self._rx_empty_word
                # Data that ends in this wrap, before the ring's end: one copy, no wrap.
                if empty < prod < self._rx_lim and prod & WRAP_FIELD == self._rx_wbits:
                    avail = (prod - empty) >> COUNT_SHIFT
                    n = len(buffer)
                    if avail < n:
                        n = avail
                # The writer is a lap ahead (a full ring: the usual state behind a slow reader,
                # and a writer that filled the ring to its end is in the next wrap). Our data
                # runs to the ring's end: a read that stops short of it needs no wrap either.
                elif (prod & WRAP_FIELD) - self._rx_wbits & WRAP_FIELD == ONE_WRAP:
                    n = len(buffer)
                    left = self._rx_len - self._rx_pos
                    avail = left + (prod >> COUNT_SHIFT & 0xFFFFFFFF)
                    if n >= left:  # reaching the end: to it, the wrap, on from the start
                        return self._recv_across(buffer, n if n < avail else avail, left, avail)
                else:
                    return 0
                if 0 < n <= PIECE:
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
                    if fence_try(False):  # layout.fence, inline
                        fence_end()
                    else:
                        fence()
                    wait = self._tx_ctrl[C_WAIT_SPACE]  # the peer's "kick me" for space
                    if (
                        wait & WANT_SPACE
                        and wait >> 8 != self._kicked_s
                        and avail - n <= self._rx_wake_fill
                    ):
                        self._kick_space(wait)
                    return n
                if n > PIECE:
                    return self._recv_pieces(buffer, n, avail)
        return 0

    def _recv_pieces(self, buffer: Any, n: int, avail: int) -> int:
        """recv_fast's large read (``n`` bytes, all before the ring's end). A socket layer that
        offers a large buffer (a bulk receiver's) would otherwise go the long way around on
        every read that finds more than a piece."""
        if not self._copy_out(buffer, 0, n):
            return 0
        self._kick_space_maybe(avail - n)
        return n

    def _recv_across(self, buffer: Any, n: int, left: int, avail: int) -> int:
        """recv_fast's read that reaches the ring's end (the writer is a lap ahead): ``left``
        bytes to the end, the wrap, then the rest of ``n`` from the ring's start. A stream's
        reads reach the end once a lap, and the long way (with a socket layer's way around it)
        cost several times a fast read."""
        if avail > self._rx_len or not self._copy_out(buffer, 0, left):
            return 0  # a peer claiming more than the ring holds: the long way reports it
        if n > left:
            self._copy_out(buffer, left, n - left)
        self._kick_space_maybe(avail - n)
        return n

    def _copy_out(self, buffer: Any, off: int, k: int) -> int:
        """Copy ``k`` bytes at our consumer cursor into ``buffer[off:]`` and publish the cursor
        after each piece, so that the writer refills behind us while we copy on; at most up
        to the ring's end (then the cursor wraps). 0 when ``buffer`` takes no bytes (nothing
        was consumed: the long way decides); else ``k``."""
        ring = self._rx_ring
        txh = self._tx_hdr
        L = self._rx_len
        pos = self._rx_pos
        done = 0
        while done < k:
            j = k - done if k - done < PIECE else PIECE
            if done:
                buffer[off + done : off + done + j] = ring[pos : pos + j]
            else:
                try:
                    buffer[off : off + j] = ring[pos : pos + j]
                except (TypeError, ValueError, NotImplementedError):  # not flat bytes
                    return 0
            done += j
            pos += j
            if pos == L:
                pos = 0
                self._rx_new_wrap((self._rx_wrap + 1) & 0xFFFF)
            word = self._rx_wbits | pos << COUNT_SHIFT
            self._rx_empty_word = word
            self._rx_pos = pos
            fb = self._flag_bits
            txh[W_CONS] = word | fb  # our consumer cursor → the peer's header
            if self._flag_bits != fb:  # a writer thread published flags meanwhile
                txh[W_CONS] = word | self._flag_bits
        return k

    def _kick_space_maybe(self, unread: int) -> None:
        """Wake a writer sleeping for space once at most ``_rx_wake_fill`` is left unread."""
        fence()
        wait = self._tx_ctrl[C_WAIT_SPACE]  # the peer's "kick me" for space
        if wait & WANT_SPACE and wait >> 8 != self._kicked_s and unread <= self._rx_wake_fill:
            self._kick_space(wait)

    def _rx_look(self) -> tuple[int, int]:
        """The slow paths' first look at the RX ring: claim a fenced end, raise on an abort,
        then the peer's flags and the bytes there (flags read *before* the producer cursor)."""
        if self._fence:
            self._pass_fence()
        hdr = self._rx_hdr
        flags = hdr[W_CONS] >> CSFLAGS_SHIFT
        if flags & PEER_CONN_ABORT or self._dead:
            self._stop_fast()
            self._raise_reset()
        prod = hdr[W_PROD]
        avail = (
            (((prod >> WRAP_SHIFT) - self._rx_wrap) & 0xFFFF) * self._rx_len
            + (prod >> COUNT_SHIFT & 0xFFFFFFFF)
            - self._rx_pos
        )
        return flags, avail

    def _recv_into(self, buffer: Any, nbytes: int = 0) -> int:
        """recv_into for every case: empty ring, EOF, wrap, level mode, odd buffers, errors."""
        flags, avail = self._rx_look()
        L = self._rx_len
        pos = self._rx_pos
        if avail <= 0:
            if avail < 0:
                self._protocol_violation(f"peer producer cursor is {-avail} bytes behind")
            if flags & (PEER_DONE_WRITING | PEER_CONN_CLOSED):
                return 0  # EOF: the flags were read first, so that cursor was the last one
            # Is the peer gone? A poll syscall: every time in level mode (a select loop relies
            # on it), else every 64th empty read (blocking waits poll the link themselves).
            self._n_empty += 1
            if (self._level or not self._n_empty & 63) and self._check_link():
                if self._dead:  # the peer ended without closing, with data unread
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
        # Publish piece by piece (the writer refills behind us while we copy on): to the
        # ring's end, then on from its start.
        first = n if n < L - pos else L - pos
        if first and not self._copy_out(mv, 0, first):
            raise TypeError("cannot modify read-only memory")  # as the copy itself raised
        if n > first:
            self._copy_out(mv, first, n - first)
        self._kick_space_maybe(avail - n)
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
        second copy). ``b""`` and errors as :meth:`recv_into`.

        Everything there, up to ``bufsize``, in one call, as TCP's ``recv`` returns it: across
        the ring's end too, and when the data arrives while the call finds the ring empty.
        Programs that take a small message for one ``recv`` (wrong, but common, and what TCP
        loopback always gives them) would otherwise see one split once a lap, or by a race."""
        if self._fence:
            self._pass_fence()
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
            if not self._recv_into(scratch):
                return b""
            if bufsize == 1:
                return bytes(scratch)
            # Data came between our look and recv_into's: the rest of it in this call too
            # (an error after that byte is the next call's, as TCP reports a reset).
            try:
                return bytes(scratch) + self.recv_bytes(bufsize - 1)
            except OSError:
                return bytes(scratch)
        n = bufsize if bufsize < avail else avail
        end = L - pos
        if n < end:
            data = bytes(self._rx_ring[pos : pos + n])
            pos += n
        else:  # to the ring's end and on from its start: once a lap
            ring = self._rx_ring
            data = bytes(ring[pos:L]) if n == end else b"".join((ring[pos:L], ring[: n - end]))
            pos = n - end
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
        fence()
        wait = self._tx_ctrl[C_WAIT_SPACE]
        if wait & WANT_SPACE and wait >> 8 != self._kicked_s and avail - n <= self._rx_wake_fill:
            self._kick_space(wait)
        if self._level and n == avail:
            self._level_sync()
        return data

    def peek_into(self, buffer: Any) -> tuple[int, bool]:
        """``MSG_PEEK``: copy up to ``len(buffer)`` received bytes without consuming them (the
        consumer cursor stays; the next read returns them again), as the kernel's
        ``smc_rx_recvmsg`` does. Returns the count and whether the peer is done writing (the
        bytes there are all that will come). An empty ring and errors as :meth:`recv_into`."""
        flags, avail = self._rx_look()
        done = bool(flags & (PEER_DONE_WRITING | PEER_CONN_CLOSED))
        L = self._rx_len
        pos = self._rx_pos
        if avail <= 0 or avail > L:  # nothing (EOF, a dead peer, level mode) or a violation
            return self._recv_into(memoryview(bytearray(0))), done
        mv = buffer if type(buffer) is memoryview else memoryview(buffer)
        if mv.ndim != 1 or mv.format != "B":
            mv = mv.cast("B")
        n = min(len(mv), avail)
        first = min(n, L - pos)
        ring = self._rx_ring
        mv[:first] = ring[pos : pos + first]
        if n > first:
            mv[first:n] = ring[: n - first]
        return n, done

    def discard(self, buffer: Any) -> int:
        """``MSG_TRUNC``: consume up to ``len(buffer)`` received bytes without copying them
        (the buffer only says how many; TCP drops them so too). An empty ring, EOF and errors
        as :meth:`recv_into`."""
        _, avail = self._rx_look()
        L = self._rx_len
        if avail <= 0 or avail > L:  # nothing (EOF, a dead peer, level mode) or a violation
            return self._recv_into(memoryview(bytearray(0)))
        size = buffer.nbytes if type(buffer) is memoryview else len(buffer)
        n = size if size < avail else avail
        pos = self._rx_pos + n
        if pos >= L:  # across the ring's end: once a lap
            pos -= L
            self._rx_new_wrap((self._rx_wrap + 1) & 0xFFFF)
        # The publication _copy_out makes after each piece, once (written out there and in
        # recv_fast rather than called: those are the bulk and ping-pong paths).
        word = self._rx_wbits | pos << COUNT_SHIFT
        self._rx_empty_word = word
        self._rx_pos = pos
        fb = self._flag_bits
        txh = self._tx_hdr
        txh[W_CONS] = word | fb  # our consumer cursor → the peer's header
        if self._flag_bits != fb:  # a writer thread published flags meanwhile
            txh[W_CONS] = word | self._flag_bits
        self._kick_space_maybe(avail - n)
        if self._level and n == avail:
            self._level_sync()
        return n

    def unread(self) -> int:
        """The bytes received and not yet read (``SIOCINQ``); none once the connection was
        reset, as a reset TCP socket has none."""
        try:
            _, avail = self._rx_look()
        except ConnectionResetError:
            return 0
        return avail if 0 < avail <= self._rx_len else 0

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
        if self._rx_fast and spin(
            self._wd, self._rx_ready, None, self._rx_hdr, W_PROD, self._rx_empty_word
        ):
            self._n_spin_hits += 1
            return True
        return False

    def rx_word(self) -> tuple[memoryview, int, int]:
        """``(words, index, empty)``: the peer's producer cursor is ``words[index]``, and equal
        to ``empty`` while nothing new is there — what :func:`smc_handoff.wakeup.spin` watches,
        for a spin with its own budget over this channel (an event loop's busy poll,
        :mod:`smc_handoff.aio_poll`). Valid until the next read."""
        return self._rx_hdr, W_PROD, self._rx_empty_word

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
        return hdr[W_PROD] & CURSOR_MASK == self._rx_empty_word

    @property
    def aborted(self) -> bool:
        """The connection was reset: by us, by the peer, or by the end of the peer's process
        while data it was sent was unread (or, over SMC-R, by the daemon's death)."""
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

    # ------------------------------------------------------------------------ event loops

    def kick_fd(self) -> int:
        """What an event loop watches instead of waiting: the peer link, readable when the peer
        kicks a request made with :meth:`arm_readable` or :meth:`arm_space` (a Unix-socket
        send, which wakes the loop as a sync wakeup, where an eventfd write would leave it
        queued behind whatever runs on its CPU), and when the peer hangs up. When it is
        readable: :meth:`drain_kicks` first, then read/write, then arm again what is still
        wanted. For one non-blocking user (an event loop's transport), which must not also
        wait in :meth:`wait_readable`/:meth:`wait_writable`."""
        self._check_open()
        return self._link_fd

    def event_fd(self) -> int:
        """The RX eventfd, for a loop that asks with ``arm_readable(link=False)`` /
        ``arm_space(link=False)``: the peer then kicks it with an eventfd write, which with its
        drain costs far less than a link send and its drain (the README's asyncio rows). It
        says nothing of a hang-up: the loop also watches :meth:`kick_fd`, which no kick
        reaches then. Not with :meth:`fileno` (level mode owns this eventfd)."""
        self._check_open()
        return self._rx_efd

    def drain_kicks(self, link: bool = True) -> None:
        """Take one kick off :meth:`kick_fd` before looking (a kick after this keeps it
        readable; so does a second one queued, which costs one spurious wakeup, not a syscall
        on every wakeup); a hang-up seen here is recorded, so the next arm says "look now".
        ``link=False``: empty :meth:`event_fd` instead."""
        if not link:
            if self._closed:
                return
            try:  # noqa: SIM105 (per wakeup: contextlib.suppress costs more than the read)
                os.eventfd_read(self._rx_efd)
            except BlockingIOError:
                pass
            return
        if self._closed or self._link_dead:
            return
        try:
            if not self._link.recv(64, _DONTWAIT):
                self._check_link()  # b"": the peer's end is closed
        except BlockingIOError:  # nothing queued
            pass
        except OSError:  # an error on the link: is the peer gone?
            self._check_link()

    def arm_readable(self, link: bool = True) -> bool:
        """Ask the peer to kick :meth:`kick_fd` (``link=False``: :meth:`event_fd`) when data,
        EOF or an abort arrives. False when that is there already or the peer is gone: nothing
        is armed, read now."""
        self._check_open()
        if self._rx_ready() or self._link_dead:
            return False
        self._arm(self._wd, link, fresh=True)
        if self._rx_ready():  # published before the peer could see the request
            self._disarm(self._wd)
            return False
        return True

    def arm_space(self, link: bool = True) -> bool:
        """Ask the peer to kick :meth:`kick_fd` (``link=False``: :meth:`event_fd`) when its
        reader frees room in its ring (it kicks once half of it is free, as for a blocking
        :meth:`wait_writable`). False when there is room already, or an error to raise, or the
        peer is gone: nothing is armed, write now."""
        self._check_open()
        if self._tx_ready() or self._link_dead:
            return False
        self._arm(self._ws, link, fresh=True)
        if self._tx_ready():
            self._disarm(self._ws)
            return False
        return True

    @property
    def rx_pending(self) -> bool:
        """Data, EOF or an abort waits to be read (or the peer is gone): a load or two, no
        system call (for a loop that woke up and wants to know which way to look)."""
        return self._rx_ready() or self._link_dead

    def readable_now(self) -> bool:
        """For a poll that found ``fileno()`` readable (smc-run's ``select``, ``poll`` and
        ``epoll``): would a read return now (data, EOF, an abort, the peer gone)? When not,
        the eventfd's count was stale: when a peer's publish races our arm, its kick and our
        own level sync both write the eventfd, and the kick may land after the data it
        announced was read. Level mode then drains and re-arms, as an empty read does; the
        caller drops the report (a blocking read after it would have waited for the next
        data, which a select loop's peer may be waiting on itself). Outside level mode the
        report stands: the eventfd is then a kick channel of the library's own (an event
        loop's transport drains it and asks for space on it), not "data pending"."""
        self._check_open()
        if not self._level or self._rx_ready() or self._check_link():
            return True
        self._level_sync()
        return False

    def leave_together(self, timeout: float) -> bool:
        """Leave the channel for TCP together with the peer, after data moved (what ``ssl``
        needs for STARTTLS: both ends call it, each from its ``wrap_socket``). True once both
        ends have committed: neither sends over the channel again, and neither has anything
        unread in it, so the TCP stream goes on from this point in both directions. False,
        with nothing changed, when this end has something unread, or the peer does not come
        to leave within ``timeout`` seconds, or gives up, or is gone.

        Each end writes its state into its own receive DMB's trailer (``C_LEAVE``) and reads
        the peer's: LEAVING (nothing unread here, nothing more sent), then READY once the peer
        is LEAVING too and still nothing arrived; an end commits when both are READY, and
        gives up (GAVE_UP) otherwise. An end that is READY never gives up on its own (the peer
        decides in a few steps from there: READY, or GAVE_UP), so one end cannot commit while
        the other gives up; a GAVE_UP left by an earlier attempt does not spoil a later one.
        Buffers come to a connection zeroed, trailer included. The caller keeps the process's
        other threads off the channel (both locks)."""
        self._check_open()
        if self._fence or self._rx_ready():
            return False  # not this process's to leave, or data, EOF or an error pending
        own, peer = self._rx_ctrl, self._tx_ctrl
        own[C_LEAVE] = LEAVE_LEAVING
        fence()
        deadline = time.monotonic() + timeout
        # (a GAVE_UP seen here is an earlier attempt's: wait for this one's LEAVING)
        while peer[C_LEAVE] not in (LEAVE_LEAVING, LEAVE_READY):
            if time.monotonic() > deadline or self._check_link():
                own[C_LEAVE] = LEAVE_GAVE_UP
                return False
            time.sleep(_LEAVE_POLL_S)
        if self._rx_ready():  # sent before the peer came to leave: it stays readable here
            own[C_LEAVE] = LEAVE_GAVE_UP
            return False
        own[C_LEAVE] = LEAVE_READY
        fence()
        while (state := peer[C_LEAVE]) != LEAVE_READY:
            if state != LEAVE_LEAVING:  # it gave up
                own[C_LEAVE] = LEAVE_GAVE_UP
                return False
            if self._check_link():
                # gone, or committed and closed its end since the look above: READY tells
                if peer[C_LEAVE] == LEAVE_READY:
                    return True
                own[C_LEAVE] = LEAVE_GAVE_UP
                return False
            time.sleep(_LEAVE_POLL_S)
        return True

    @property
    def tx_room(self) -> bool:
        """A send would accept a byte or raise (as :meth:`writable`, without a system call)."""
        return self._tx_ready() or self._link_dead

    def disarm(self) -> None:
        """Withdraw both requests (a loop that stops watching)."""
        if not self._closed:
            self._disarm(self._wd)
            self._disarm(self._ws)

    @property
    def rx_shut(self) -> bool:
        """Nothing more will arrive: the peer shut writing, closed or reset (or died), or this
        end shut reading; what a TCP socket's poll reports as ``POLLRDHUP``."""
        if self._rd_shut or self._local_abort or self._peer_died or self._link_dead:
            return True
        if self._closed:
            return False
        flags = self._rx_hdr[W_CONS] >> CSFLAGS_SHIFT
        return bool(flags & (PEER_DONE_WRITING | PEER_CONN_CLOSED | PEER_CONN_ABORT))

    @property
    def claimed_elsewhere(self) -> bool:
        """A copy after a fork that another process has claimed: its view of the rings is
        stale, and a request it armed would take the owner's kicks."""
        return self._fence and self._claimed_elsewhere()

    def disarm_space(self) -> None:
        """Withdraw the request of :meth:`arm_space` only (a poll for writing that is over,
        on an end whose data request level mode keeps)."""
        if not self._closed:
            self._disarm(self._ws)

    # ---------------------------------------------------------------------- observability

    def fileno(self) -> int:
        """The RX eventfd, readable (level-triggered) while data, EOF or an abort is pending —
        also a peer's death, which a small per-process thread turns into a kick. Calling this
        switches the channel to *level mode*: it then keeps itself armed whenever nothing is
        pending, so the peer kicks on every empty→non-empty transition. The fd always polls
        writable (an eventfd); check :meth:`writable` after a short send (smc-run's
        ``select``/``poll``/``epoll`` do: :mod:`smc_handoff.readiness`). A copy after a fork
        that another process has claimed keeps no readiness (its view of the ring is stale: a
        CGI server's parent polls its copy while the script's relay owns the connection);
        should this process claim it later, level mode starts then. Unclaimed since the fork,
        the copy's view is current and it keeps readiness as any end (a forking server's child
        may poll before its first read)."""
        self._check_open()
        if not self._level:
            if self._fence and self._claimed_elsewhere():
                self._level_wanted = True
            else:
                self._enter_level()
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
