"""The shared-memory channel, both ends in this process: layout, cursor arithmetic, close
semantics, waits, level-triggered fileno(). Cross-process behaviour: test_channel_procs.py."""

from __future__ import annotations

import mmap
import os
import random
import select
import signal
import socket
import sys
import time

import pytest

from smc_handoff import layout
from smc_handoff.channel import Channel, make_pair, zero_dmb
from smcd_daemon.core.buffers import decompress
from smcd_daemon.wire import cdc
from smcd_daemon.wire.cdc import ConnStateFlag, ProducerFlag, SmcdCdcHeader
from smcd_daemon.wire.cursor import Cursor

pytestmark = pytest.mark.timeout(60)


def pair(size_a: int = 16 << 10, size_b: int = 16 << 10) -> tuple[Channel, Channel]:
    fa, fb = make_pair(size_a, size_b)
    return Channel.from_fds(fa), Channel.from_fds(fb)


def pair_with_dmbs(size: int = 16 << 10) -> tuple[Channel, Channel, mmap.mmap, mmap.mmap]:
    """A pair plus our own mappings of A's and B's RX DMBs, to look at the raw bytes."""
    fa, fb = make_pair(size, size)
    dmb_a = mmap.mmap(fa.rx_dmb_fd, size + layout.CTRL_LEN)
    dmb_b = mmap.mmap(fb.rx_dmb_fd, size + layout.CTRL_LEN)
    return Channel.from_fds(fa), Channel.from_fds(fb), dmb_a, dmb_b


def drain(ch: Channel, limit: int = 1 << 24) -> bytes:
    out = bytearray()
    buf = bytearray(70_000)
    while len(out) < limit:
        n = ch.recv_into(buf)
        if not n:
            break
        out += buf[:n]
    return bytes(out)


# ----------------------------------------------------------------------------- layout


def test_layout_constants_match_the_wire_codec() -> None:
    """smc_handoff keeps its own copy of the header's size and type (it imports nothing from the
    daemon); they must be the wire module's, and the size classes the daemon's pool sizes."""
    assert layout.CDC_HEADER_LEN == cdc.SMCD_CDC_HEADER_LEN == SmcdCdcHeader.SIZE == 32
    assert layout.CDC_MSG_TYPE == cdc.CDC_MSG_TYPE
    assert (
        layout.TYPE_WORD.to_bytes(8, sys.byteorder)
        == SmcdCdcHeader(Cursor(0, 0), Cursor(0, 0)).encode()[:8]
    )
    assert (
        layout.encode_header((0, 0), (0, 0)) == SmcdCdcHeader(Cursor(0, 0), Cursor(0, 0)).encode()
    )
    assert tuple(decompress(c) for c in range(layout.SMCD_DMBE_SIZES + 1)) == layout.DMB_SIZES
    assert layout.DMB_SIZES[0] == layout.SMC_BUF_MIN and layout.DMB_SIZES[-1] == 1 << 20


def test_header_encoding_matches_the_wire_codec() -> None:
    """Our 8-byte cursor words produce exactly the bytes of smcd_daemon's SmcdCdcHeader, and
    each side decodes the other's bytes."""
    rng = random.Random(4)
    for _ in range(2000):
        prod = (rng.randrange(1 << 16), rng.randrange(1 << 32))
        cons = (rng.randrange(1 << 16), rng.randrange(1 << 32))
        pf, csf = rng.randrange(256), rng.randrange(256)
        ours = layout.encode_header(prod, cons, pf, csf)
        theirs = SmcdCdcHeader(
            Cursor(*prod), Cursor(*cons), ProducerFlag(pf), ConnStateFlag(csf)
        ).encode()
        assert ours == theirs
        back = layout.decode_header(ours)
        assert (back["prod_wrap"], back["prod_count"]) == prod
        assert (back["cons_wrap"], back["cons_count"]) == cons
        assert (back["prod_flags"], back["conn_state_flags"]) == (pf, csf)
        assert back["type"] == cdc.CDC_MSG_TYPE
        wire = SmcdCdcHeader.decode(ours)
        assert (wire.prod, wire.cons) == (Cursor(*prod), Cursor(*cons))
        assert (int(wire.prod_flags), int(wire.conn_state_flags)) == (pf, csf)


def test_live_dmb_header_decodes_with_the_wire_codec() -> None:
    """After real traffic, the header the peer wrote at offset 0 of each DMB is a valid SMC-D
    CDC header (type 0xFE) whose cursors and flags are the channel's own."""
    a, b, dmb_a, dmb_b = pair_with_dmbs()
    ring = (16 << 10) - 32
    a.send_into(b"x" * 10_000)
    assert len(drain(b)) == 10_000
    a.send_into(b"y" * 10_000)  # wraps: 20,000 > 16,352
    assert len(drain(b, 3000)) >= 3000
    b.send_into(b"z" * 123)
    a.shutdown_write()
    hb = SmcdCdcHeader.decode_from(dmb_b)  # written by A into B's DMB
    ha = SmcdCdcHeader.decode_from(dmb_a)  # written by B into A's DMB
    assert dmb_b[0] == dmb_a[0] == 0xFE
    assert hb.prod == Cursor(1, 20_000 - ring)  # A's producer cursor, one wrap
    assert tuple(b.stats()["rx_prod"]) == (hb.prod.wrap, hb.prod.count)
    assert hb.cons == Cursor(0, 0)  # A has read nothing of B's
    assert hb.conn_state_flags == ConnStateFlag.PEER_DONE_WRITING
    assert ha.prod == Cursor(0, 123)
    assert tuple(a.stats()["tx_cons"]) == (ha.cons.wrap, ha.cons.count)
    assert ha.conn_state_flags == ConnStateFlag(0)
    a.close()
    b.close()


def test_write_blocked_flag_is_published() -> None:
    a, b, _dmb_a, dmb_b = pair_with_dmbs()
    while a.send_into(b"w" * 5000):
        pass
    assert SmcdCdcHeader.decode_from(dmb_b).prod_flags & ProducerFlag.WRITE_BLOCKED
    drain(b)
    assert a.send_into(b"w") == 1
    assert not SmcdCdcHeader.decode_from(dmb_b).prod_flags & ProducerFlag.WRITE_BLOCKED
    a.close()
    b.close()


def test_dmb_sizes_are_smcd_sizes() -> None:
    for bad in (0, 1000, 16383, 3 << 14, 2 << 20):
        with pytest.raises(ValueError):
            layout.create_dmb(bad)
    fd = layout.create_dmb(16 << 10)
    try:
        assert os.fstat(fd).st_size == (16 << 10) + layout.CTRL_LEN
        os.pwrite(fd, b"dirty", 100)
        zero_dmb(fd, 16 << 10)
        assert os.pread(fd, 200, 0) == bytes(200)
        assert os.fstat(fd).st_size == (16 << 10) + layout.CTRL_LEN
    finally:
        os.close(fd)


def test_make_pair_sets_share_no_fd_and_channel_owns_them() -> None:
    before = len(os.listdir("/proc/self/fd"))
    fa, fb = make_pair(16 << 10, 32 << 10)
    assert not set(fa.fds()) & set(fb.fds())
    sizes = (fa.rx_size, fa.tx_size, fb.rx_size, fb.tx_size)
    assert sizes == (16 << 10, 32 << 10, 32 << 10, 16 << 10)
    a, b = Channel.from_fds(fa), Channel.from_fds(fb)
    a.close()
    b.close()
    assert len(os.listdir("/proc/self/fd")) == before  # every fd given was closed


# --------------------------------------------------------------------------- data path


@pytest.mark.parametrize("sizes", [(16 << 10, 16 << 10), (16 << 10, 64 << 10)])
def test_odd_sizes_cross_the_wrap_in_both_directions(sizes: tuple[int, int]) -> None:
    a, b = pair(*sizes)
    rng = random.Random(9)
    for _ in range(300):
        for src, dst in ((a, b), (b, a)):
            data = rng.randbytes(rng.randint(1, 40_000))
            got = bytearray()
            mv = memoryview(data)
            while mv or len(got) < len(data):
                mv = mv[src.send_into(mv) :]
                got += drain(dst, rng.randint(1, 30_000))
            assert bytes(got) == data
    assert a.stats()["bytes_sent"] == b.stats()["bytes_received"]
    assert b.stats()["bytes_sent"] == a.stats()["bytes_received"]
    a.close()
    b.close()


def test_full_ring_exactly() -> None:
    a, b = pair()
    ring = (16 << 10) - 32
    assert a.send_into(bytes(ring + 100)) == ring
    assert a.send_into(b"more") == 0
    assert not a.writable()
    assert b.recv_into(bytearray(1)) == 1
    assert a.writable()
    assert a.send_into(b"ab") == 1
    assert len(drain(b)) == ring
    a.close()
    b.close()


def test_recv_into_nbytes_and_other_buffer_types() -> None:
    a, b = pair()
    a.send_into(memoryview(b"0123456789").cast("c"))
    a.send_into(bytearray(b"AB"))
    buf = bytearray(100)
    assert b.recv_into(buf, 4) == 4 and buf[:4] == b"0123"
    arr = memoryview(bytearray(8)).cast("b")
    assert b.recv_into(arr) == 8 and arr.tobytes() == b"456789AB"
    assert b.recv_into(buf) == 0 and not b.eof
    assert b.send_into(b"") == 0
    a.close()
    b.close()


# -------------------------------------------------------------------------- close paths


def test_shutdown_write_gives_eof_after_data() -> None:
    a, b = pair()
    a.send_into(b"last words")
    a.shutdown_write()
    with pytest.raises(BrokenPipeError):
        a.send_into(b"x")
    assert b.readable() and not b.eof
    assert drain(b) == b"last words"
    assert b.eof and b.readable() and b.recv_into(bytearray(5)) == 0
    assert not b.aborted and not b.peer_closed
    b.send_into(b"reply")  # the other direction still works
    assert drain(a) == b"reply"
    b.close()
    assert a.peer_closed and a.eof and not a.aborted
    a.close()


def test_close_with_unread_data_is_an_abort() -> None:
    a, b = pair()
    a.send_into(b"unread")
    b.send_into(b"read me")
    b.close()  # "unread" was never read → abort
    assert a.aborted and a.peer_closed
    with pytest.raises(ConnectionResetError):
        a.recv_into(bytearray(10))  # discarded, as after a TCP RST
    with pytest.raises(ConnectionResetError):
        a.send_into(b"x")
    a.close()


def test_orderly_close_then_writing_resets() -> None:
    a, b = pair()
    a.close()
    assert b.eof and b.peer_closed and not b.aborted
    with pytest.raises(ConnectionResetError):
        b.send_into(b"x")
    b.close()


def test_abort_and_use_after_close() -> None:
    a, b = pair()
    a.abort()
    assert a.closed and a.aborted
    assert b.aborted
    for op in (lambda: a.send_into(b"x"), lambda: a.recv_into(bytearray(1)), a.fileno):
        with pytest.raises(OSError):
            op()
    a.close()  # idempotent
    b.close()


def test_hostile_producer_cursor_is_a_reset() -> None:
    """A peer claiming more data than the ring holds is treated as an abort, not trusted."""
    a, b, _dmb_a, dmb_b = pair_with_dmbs()
    bogus = layout.encode_header((0, 20_000), (0, 0))  # count beyond the 16,352-byte ring
    dmb_b[8:16] = bogus[8:16]
    with pytest.raises(ConnectionResetError, match="bytes"):
        b.recv_into(bytearray(100))
    assert b.aborted and b.closed
    assert a.aborted
    a.close()


# --------------------------------------------------------------------------------- waits


def test_waits_time_out_and_wake() -> None:
    a, b = pair()
    t0 = time.monotonic()
    assert not b.wait_readable(0.2)
    assert 0.18 <= time.monotonic() - t0 < 1.5
    assert not b.wait_readable(0)
    while a.send_into(bytes(4096)):
        pass
    t0 = time.monotonic()
    assert not a.wait_writable(0.1)
    assert time.monotonic() - t0 >= 0.09
    assert b.wait_readable(0) and a.wait_readable(0) is False
    drain(b)
    assert a.wait_writable(0)
    a.shutdown_write()
    assert b.wait_readable(1)  # EOF counts
    a.close()
    b.close()


def test_fileno_is_level_triggered() -> None:
    a, b = pair()
    fd = b.fileno()
    assert fd == b.fileno()

    def readable() -> bool:
        return bool(select.select([fd], [], [], 0)[0])

    assert not readable()
    a.send_into(b"12345")
    assert readable()
    buf = bytearray(2)
    assert b.recv_into(buf) == 2
    assert readable()  # still 3 bytes pending
    assert b.recv_into(bytearray(10)) == 3
    assert not readable()  # nothing pending: not readable any more
    assert b.recv_into(bytearray(10)) == 0
    assert not readable()
    for _ in range(3):  # re-armed every time
        a.send_into(b"x")
        assert readable()
        drain(b)
        assert not readable()
    a.shutdown_write()
    assert readable()
    assert b.recv_into(bytearray(1)) == 0 and b.eof
    assert readable()  # EOF stays pending
    a.close()
    b.close()


def test_fileno_readable_on_abort() -> None:
    a, b = pair()
    fd = b.fileno()
    a.send_into(b"x")
    drain(b)
    assert not select.select([fd], [], [], 0)[0]
    a.abort()
    assert select.select([fd], [], [], 1)[0]
    with pytest.raises(ConnectionResetError):
        b.recv_into(bytearray(1))
    b.close()


def test_stats_shape() -> None:
    a, b = pair()
    a.send_into(b"abc")
    s = b.stats()
    for key in ("rx_prod", "rx_cons", "tx_prod", "tx_cons", "bytes_received", "bytes_sent"):
        assert key in s
    assert s["rx_prod"] == (0, 3) and s["rx_cons"] == (0, 0)
    assert a.stats()["tx_prod"] == (0, 3) and a.stats()["bytes_sent"] == 3
    assert s["peer_conn_state_flags"] == 0 and not s["eof"] and not s["aborted"]
    a.close()
    b.close()


def test_recv_bytes_crosses_the_wrap_and_keeps_semantics() -> None:
    """``recv_bytes`` (SmcSocket.recv's one-copy path) returns what ``recv_into`` would, in
    pieces that may cross the ring's end, then ``b""`` for nothing yet and for EOF."""
    a, b = pair()
    ring = (16 << 10) - 32
    rng = random.Random(5)
    sent = bytearray()
    got = bytearray()
    for _ in range(40):  # ~10 laps of the ring
        chunk = rng.randbytes(rng.randint(1, 9000))
        view = memoryview(chunk)
        while view:
            n = a.send_into(view)
            sent += view[:n]
            view = view[n:]
            while piece := b.recv_bytes(rng.randint(1, 12000)):
                assert len(piece) <= ring
                got += piece
    assert got == sent and b.stats()["rx_cons"][0] > 5
    assert b.recv_bytes(10) == b"" and not b.eof
    a.send_into(b"bye")
    a.close()
    assert b.recv_bytes(10) == b"bye"
    assert b.recv_bytes(10) == b"" and b.eof
    b.close()


def test_recv_bytes_returns_a_message_that_straddles_the_rings_end_whole() -> None:
    """A small message written across the ring's end comes out of one ``recv`` whole, as TCP
    gives it (it used to come in two pieces, once a lap)."""
    a, b = pair()
    ring = (16 << 10) - 32
    msg = b"from the child"
    total = 0
    for k in (5, 1, 13):  # the ring's end falls inside, right after the first byte, at the end
        fill = bytes((ring - k) - b.stats()["rx_cons"][1])
        assert a.send_into(fill) == len(fill)
        assert b.recv_bytes(len(fill)) == fill
        assert a.send_into(msg) == len(msg)
        assert b.recv_bytes(100) == msg
        total += len(fill) + len(msg)
    assert b.stats()["rx_cons"][0] == 3  # three laps, each ended inside a message's read
    a.send_into(b"after")
    assert b.recv_bytes(100) == b"after" and b.stats()["bytes_received"] == total + 5
    a.close()
    b.close()


def test_recv_bytes_takes_what_arrives_while_it_finds_the_ring_empty() -> None:
    """A message published between ``recv_bytes``'s look (empty) and its long way's read comes
    out whole: the long way's one-byte read used to return just its first byte (seen as
    ``b'f'`` for ``b'from the child'`` under load)."""
    a, b = pair()
    long_way = b._recv_into
    published = []

    def racing(buffer: bytearray, nbytes: int = 0) -> int:
        if not published:
            published.append(a.send_into(b"from the child"))
        return long_way(buffer, nbytes)

    b._recv_into = racing  # type: ignore[method-assign]
    assert b.recv_bytes(100) == b"from the child" and published == [14]
    assert b.recv_bytes(100) == b""  # nothing more: not a byte twice
    a.send_into(b"x")
    assert b.recv_bytes(1) == b"x"
    a.close()
    assert b.recv_bytes(100) == b"" and b.eof
    b.close()


def test_poll_objects_are_built_only_when_a_wait_sleeps() -> None:
    """A short connection never sleeps: its channel builds no poll object; the first sleep,
    a hang-up check and level mode build theirs, and they work."""
    a, b = pair()
    try:
        pollers = ("_link_poller", "_efd_poller", "_hup_poller", "_level_poller")
        assert [getattr(a, p) for p in pollers] == [None] * 4
        assert a._link.family == socket.AF_UNIX and a._link.type == socket.SOCK_SEQPACKET
        b.send_into(b"x")
        assert a.recv_bytes(10) == b"x"  # data there: no wait
        assert [getattr(a, p) for p in pollers] == [None] * 4
        assert not a.wait_readable(0.05)  # sleeps (timeout): on the link
        assert a._link_poller is not None and not a.peer_closed
        assert a._hup_poller is not None
        fd = a.fileno()  # level mode (its poll object is built once data is pending)
        assert not select.select([fd], [], [], 0)[0]
        b.send_into(b"y")
        assert select.select([fd], [], [], 5)[0]
        assert a.recv_bytes(10) == b"y"
        b.close()
        assert select.select([fd], [], [], 5)[0] and a.recv_bytes(10) == b""
    finally:
        a.close()
        b.close()


def test_an_exception_from_a_signal_handler_never_leaves_a_fence_held() -> None:
    """The interpreter runs signal handlers right after a C call returns, so Ctrl-C lands
    inside ``layout.fence()`` as often as anywhere: between the shared lock's acquire and its
    release about half the time, which leaves the lock held. A fence that then waited for it
    (a ``close()`` in a ``finally``, every send since both sides fence) blocked for good; it
    must take its other barrier instead."""

    class Interrupted(Exception):
        pass

    class Stuck(Exception):
        pass

    def interrupt(_sig: int, _frame: object) -> None:
        raise Interrupted

    def stuck(_sig: int, _frame: object) -> None:
        raise Stuck

    old = signal.signal(signal.SIGALRM, interrupt)
    try:
        interrupted = 0
        for _ in range(100):
            signal.setitimer(signal.ITIMER_REAL, 0.0002)
            try:
                for _ in range(200_000):
                    layout.fence()
            except Interrupted:
                interrupted += 1
            signal.setitimer(signal.ITIMER_REAL, 0)
        assert interrupted >= 90
        # About half of those left the shared lock held; make sure it is, as they leave it.
        layout._fence_lock.acquire(False)
        assert layout._fence_lock.locked()
        signal.signal(signal.SIGALRM, stuck)
        signal.alarm(3)  # a fence that waits for the held lock blocks here; the alarm ends it
        try:
            layout.fence()
        except Stuck:
            pytest.fail("a fence waited for a lock a signal handler's exception left held")
        finally:
            signal.alarm(0)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        if layout._fence_lock.locked():  # (no other thread here: the next tests get it free)
            layout._fence_lock.release()


def test_leave_together_commits_when_the_peer_committed_and_closed_between_two_looks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Phase two of ``leave_together`` (this end READY) reads the peer's state, then looks at
    the link. A peer that became READY and committed (closing its end) between those two looks
    left the link dead: taken for a peer gone, this end gave up while the peer had left for
    TCP. The interleaving is made here by running the peer's commit inside the link look."""
    a, b = pair()
    a.send_into(b"data moved")  # a STARTTLS-like exchange before
    assert drain(b) == b"data moved"
    b_ctrl = b._rx_ctrl  # b writes its state here; a reads it as its _tx_ctrl
    b_ctrl[layout.C_LEAVE] = 1  # b is LEAVING
    real_check = Channel._check_link
    done = []

    def peer_commits_then_look(self: Channel) -> bool:
        if self is a and not done:
            done.append(True)
            b_ctrl[layout.C_LEAVE] = 2  # b READY (it saw a READY) ...
            b.close()  # ... committed, closed its end
        return bool(real_check(self))

    monkeypatch.setattr(Channel, "_check_link", peer_commits_then_look)
    assert a.leave_together(1.0) is True
    assert done
    a.close()


def test_leave_together_refuses_with_data_unread_or_a_peer_that_does_not_come() -> None:
    """Nothing changes on a refusal: unread data stays readable, and the channel goes on."""
    a, b = pair()
    b.send_into(b"unread")
    assert a.leave_together(0.05) is False  # at once: this end has something unread
    assert drain(a) == b"unread"
    t0 = time.monotonic()
    assert a.leave_together(0.1) is False  # b never comes to leave
    assert time.monotonic() - t0 >= 0.1
    assert a._rx_ctrl[layout.C_LEAVE] == 3  # GAVE_UP, for a peer that came in between
    b.send_into(b"still")
    assert drain(a) == b"still"
    a.close()
    b.close()


def test_discard_consumes_without_copying_across_the_rings_end() -> None:
    """``discard`` (``MSG_TRUNC``; TLS takes its peeked records so) consumes what
    ``recv_into`` would, across the ring's end too, leaves the buffer alone and counts the
    bytes as received; then ``0`` for nothing yet and for EOF."""
    a, b = pair()
    rng = random.Random(7)
    sent = bytearray()
    got = bytearray()
    for _ in range(40):  # ~10 laps
        chunk = rng.randbytes(rng.randint(1, 9000))
        assert a.send_into(chunk) == len(chunk)  # (the ring is drained after each)
        sent += chunk
        while True:
            peek = bytearray(rng.randint(1, 12000))
            n, _ = b.peek_into(peek)
            if not n:
                break
            keep = bytes(peek[:n])
            untouched = bytearray(b"-" * n)
            assert b.discard(memoryview(untouched)) == n
            assert untouched == b"-" * n
            got += keep
    assert got == sent and b.stats()["rx_cons"][0] > 5
    assert b.stats()["bytes_received"] == len(sent)
    assert b.discard(bytearray(10)) == 0 and not b.eof
    a.send_into(b"bye")
    a.close()
    assert b.discard(bytearray(2)) == 2 and b.recv_bytes(10) == b"e"
    assert b.discard(bytearray(10)) == 0 and b.eof
    b.close()
