"""The DMB observer: cursors, states and byte counts of live SMC-D connections, read from the CDC
headers the applications write into each other's DMBs (the daemon is not on the data path).

The daemon keeps one read-only view of each DMB's first page, mapped without a descriptor of its
own, for as long as the pool keeps the memfd (a memfd serves many connections, and mapping and
unmapping per connection was a measurable part of every handoff). The header is read as the
channel writes it (:mod:`smc_handoff.layout`): whole aligned 8-byte words, so a cursor never
tears; an idle connection costs the refresh one comparison of those words.

Cursors that cannot be (:mod:`smcd_daemon.core.ring_check`: a consumer ahead of its producer, a
producer more than a ring ahead, a count outside the ring) mean an application broke the
stream; the observer aborts the connection with that reason: it sets the abort flag
(``PEER_CONN_ABORT``) in both headers' connection-state byte, through a writable mapping of the
pool's memfds, so both applications fail with ECONNRESET at their next call or nap (at most a
second), and records the connection as aborted. The flag shares its word with a cursor the
application writes; should that application store over it, the observer sets it again at its
next refresh.
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
from smcd_daemon.core.ring_check import Fault, check_reads
from smcd_daemon.wire.cdc import CDC_MSG_TYPE, SMCD_CDC_HEADER_LEN, ConnStateFlag
from smcd_daemon.wire.cursor import Cursor

from .common import log
from .gate import warn

if TYPE_CHECKING:
    from .server import HandoffServer

__all__ = ["REFRESH_INTERVAL", "DmbObserver", "DmbView", "advance", "read_header"]

REFRESH_INTERVAL = 0.5
"""Cursor/byte refresh period while SMC connections exist (no timer runs otherwise)."""

_HEADER_WORDS = layout.CDC_HEADER_LEN // 8
_ABORT = int(ConnStateFlag.PEER_CONN_ABORT)
_CLOSING = int(ConnStateFlag.PEER_CONN_CLOSED | ConnStateFlag.PEER_DONE_WRITING)
_ABORT_BIT = _ABORT << layout.CSFLAGS_SHIFT
_TYPE_SHIFT = 0 if sys.byteorder == "little" else 56  # the type byte, first in memory
_WRAP_SHIFT, _COUNT_SHIFT = layout.WRAP_SHIFT, layout.COUNT_SHIFT

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

    def cursors(self) -> tuple[tuple[int, int], tuple[int, int]] | None:
        """(producer, consumer) cursors of this header as (wrap, count), each word loaded
        whole; None before its writer's first CDC write. What :func:`read_header` gives of
        :meth:`words`, in one call (a half's last counters read one header this way)."""
        if self._addr is None:
            raise ValueError("the DMB view is closed")
        w = self._words
        if w[layout.W_TYPE] >> _TYPE_SHIFT & 0xFF != CDC_MSG_TYPE:
            return None  # nothing written yet
        prod, cons = w[layout.W_PROD], w[layout.W_CONS]
        return (
            (prod >> _WRAP_SHIFT & 0xFFFF, prod >> _COUNT_SHIFT & 0xFFFFFFFF),
            (cons >> _WRAP_SHIFT & 0xFFFF, cons >> _COUNT_SHIFT & 0xFFFFFFFF),
        )

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


def cursor_fault(rx_size: int, tx_size: int, rx: Header, tx: Header, again: Header) -> Fault | None:
    """Check both directions of a half from its receive header (``rx``), its send header
    (``tx``) and the receive header read again after that (``again``), each check with the
    readings in the order that cannot give a false alarm (:mod:`smcd_daemon.core.ring_check`)."""
    hdr = SMCD_CDC_HEADER_LEN
    receive = check_reads("receive", (tx[1], again[0]), (rx[0], tx[1]), rx_size - hdr)
    if receive is not None:
        return receive
    return check_reads("send", (rx[1], tx[0]), (tx[0], again[1]), tx_size - hdr)


def store_abort(fd: int) -> None:
    """Set ``PEER_CONN_ABORT`` in the header of the DMB memfd ``fd`` (one 8-byte store of the
    consumer-cursor word with the flag added, through a writable mapping made for it)."""
    global _libc
    if _libc is None:
        _libc = _Libc()
    prot = mmap.PROT_READ | mmap.PROT_WRITE
    addr = _libc.mmap(None, mmap.PAGESIZE, prot, mmap.MAP_SHARED, fd, 0)
    if addr is None or addr == _MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, f"mapping a DMB header for writing: {os.strerror(err)}")
    try:
        word = ctypes.c_uint64.from_address(addr + 8 * layout.W_CONS)
        word.value = word.value | _ABORT_BIT
    finally:
        _libc.munmap(addr, mmap.PAGESIZE)


def advance(ring: int, old: tuple[int, int], new: tuple[int, int]) -> int:
    """Bytes from cursor ``old`` (wrap, count) to ``new`` in a ring of ``ring`` bytes, any
    number of wraps apart (the refresh runs often enough that the 16-bit wrap counter cannot
    lap)."""
    delta = ((new[0] - old[0]) & 0xFFFF) * ring + new[1] - old[1]
    return delta if 0 <= delta < 0x8000 * ring else 0


class DmbObserver:
    """Reads the CDC headers of live halves every :data:`REFRESH_INTERVAL` while there are any,
    and a half's own header once more when it closes (its last counters)."""

    def __init__(self, server: HandoffServer) -> None:
        self._srv = server
        self._views: dict[int, DmbView] = {}
        self._task: asyncio.Task[None] | None = None
        self.aborted: set[int] = set()
        """Connection ids aborted for impossible cursors (while their halves live)."""

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
        halves = self._srv.channels.halves
        for half in list(halves.values()):
            try:
                self.refresh_half(half)
            except Exception as e:
                warn.error("cursors", "handoff: reading the cursors of connection %d failed: "
                           "%s: %s", half.conn_id, type(e).__name__, e)  # fmt: skip
        if self.aborted:
            self.aborted.intersection_update(halves)

    def refresh_half(self, half: Half) -> None:
        """Read both CDC headers of ``half``: its record and the counters."""
        srv = self._srv
        pair = half.pair
        if pair is None or half.local_token is None or half.peer_token is None:
            return  # released (or a resumed record: no DMBs of ours)
        try:
            mem = srv.channels.memfds(pair)
            rx_fd, tx_fd = mem[half.local_token], mem[half.peer_token]
            rx_view = self.view(rx_fd)
            words = (rx_view.words(), self.view(tx_fd).words())
        except (OSError, KeyError) as e:
            warn.warning("dmb-headers", "handoff: connection %d: cannot read its DMB headers: %s",
                         half.conn_id, e)  # fmt: skip
            return
        if words == half.seen:
            return  # nothing moved since the last refresh (an idle connection costs no more)
        conn = srv.publisher.connection(half.conn_id)
        if conn is None:
            return
        half.seen = words
        rx_hdr = read_header(words[0])  # written by the peer: its producer/consumer cursor
        tx_hdr = read_header(words[1])  # written by this half into the peer's DMB
        if rx_hdr is not None and tx_hdr is not None:
            again = read_header(rx_view.words())
            fault = None
            if again is not None:
                fault = cursor_fault(half.rx_size, half.tx_size, rx_hdr, tx_hdr, again)
            if fault is not None or half.conn_id in self.aborted:
                self._abort(half, (rx_fd, tx_fd), fault)
                return
        changes: dict[str, Any] = {}
        if rx_hdr is not None:
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
        if changes:
            srv.publisher.update(half.conn_id, **changes)

    def last_counts(self, half: Half) -> None:
        """Count what ``half`` moved since the last refresh, once it is gone (its CLOSE, or its
        hang-up whose record goes right after): the byte counters only. The bytes it sent and
        received are both cursors of the one header it writes (its producer and consumer
        cursors in the peer's DMB), so that header alone is read. No record is updated (it is
        removed) and no cursor check runs: a half that is gone reads nothing more, and a live
        peer's refresh checks the same two headers, both directions, while it lives."""
        pair = half.pair
        if pair is None or half.peer_token is None or half.local_token is None:
            return  # released (or a resumed record: no DMBs of ours)
        try:
            # the peer's DMB: this half's header in it
            cursors = self.view(pair.res.mem[half.peer_token]).cursors()
        except (OSError, KeyError) as e:
            warn.warning("dmb-headers", "handoff: connection %d: cannot read its DMB headers: %s",
                         half.conn_id, e)  # fmt: skip
            return
        if cursors is None:
            return  # it never wrote
        prod, cons = cursors
        sent = advance(half.tx_size - SMCD_CDC_HEADER_LEN, half.tx_prod, prod)
        received = advance(half.rx_size - SMCD_CDC_HEADER_LEN, half.rx_cons, cons)
        half.tx_prod, half.rx_cons = prod, cons
        if sent or received:
            self._srv.registry.stats.add_bytes(SmcType.SMCD, tx=sent, rx=received)

    def _abort(self, half: Half, fds: tuple[int, int], fault: Fault | None) -> None:
        """Abort ``half``'s connection for impossible cursors (again, when an application
        stored over the flag: ``fault`` is then None)."""
        for fd in fds:
            try:
                store_abort(fd)
            except OSError as e:
                warn.warning("abort-failed", "handoff: connection %d: cannot set the abort "
                             "flag: %s", half.conn_id, e)  # fmt: skip
        half.seen = None  # look again at the next refresh: the flag must stay set
        if half.conn_id in self.aborted:
            return
        self.aborted.add(half.conn_id)
        warn.warning("cursor-fault", "handoff: connection %d aborted: %s", half.conn_id, fault)
        self._srv.publisher.update(half.conn_id, state=ConnState.PROCESSABORT)
