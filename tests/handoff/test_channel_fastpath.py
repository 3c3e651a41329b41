"""The channel's fast paths (``send_fast``/``recv_fast``, what ``SmcSocket`` calls first) agree
with the general calls: same bytes, same counters, and every condition that must stop them —
shutdown, the peer's close or abort, our close, odd buffers — sends the call the long way,
which then answers (or raises) as a TCP socket would."""

from __future__ import annotations

import array
import random
import time

import pytest

from smc_handoff import wakeup
from smc_handoff.channel import Channel, make_pair

pytestmark = pytest.mark.timeout(60)

RING = (16 << 10) - 32


def pair(size: int = 16 << 10) -> tuple[Channel, Channel]:
    fa, fb = make_pair(size, size)
    return Channel.from_fds(fa), Channel.from_fds(fb)


def test_small_messages_over_many_laps_take_the_fast_path_and_keep_every_byte() -> None:
    a, b = pair()
    rng = random.Random(11)
    fast_sends = fast_recvs = 0
    sent = bytearray()
    got = bytearray()
    buf = bytearray(3000)
    for _ in range(4000):  # ~35 laps of the ring: every wrap goes the long way
        msg = rng.randbytes(rng.randint(1, 300))
        n = a.send_fast(msg)
        if n:
            assert n == len(msg)  # all or nothing
            fast_sends += 1
        else:
            n = a.send_into(msg)
        sent += msg[:n]
        k = b.recv_fast(buf)
        if k:
            fast_recvs += 1
        else:
            k = b.recv_into(buf)
        got += buf[:k]
        while k := b.recv_into(buf):  # what the wrap left behind
            got += buf[:k]
    assert got == sent
    assert fast_sends > 3500 and fast_recvs > 3500  # the fast paths did carry the stream
    sa, sb = a.stats(), b.stats()
    assert sa["bytes_sent"] == sb["bytes_received"] == len(sent)
    assert sa["tx_prod"] == sb["rx_prod"] == sb["rx_cons"]
    assert sa["tx_prod"][0] == len(sent) // RING  # the wrap count of the producer cursor
    a.close()
    b.close()


def test_odd_buffers_fall_back_and_wrong_types_raise() -> None:
    a, b = pair()
    ints = array.array("i", range(8))  # format 'i': len() counts items, not bytes
    assert a.send_fast(ints) == 0
    assert a.send_into(ints) == 32
    # Any flat buffer of one-byte items is bytes to a stream: the fast path takes it.
    assert a.send_fast(memoryview(b"xyz").cast("c")) == 3
    strided = memoryview(bytearray(b"s-t-r-"))[::2]
    assert a.send_fast(strided) == 0  # a TCP socket refuses it: the long way decides
    out = array.array("i", [0] * 8)
    assert b.recv_fast(out) == 0  # not a bytearray/memoryview
    assert b.recv_into(out) == 32 and out.tolist() == list(range(8))
    readonly = memoryview(bytes(3))
    assert b.recv_fast(readonly) == 0
    with pytest.raises(TypeError):
        b.recv_into(readonly)
    with pytest.raises(TypeError):
        b.recv_into([0, 0, 0])  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        a.send_into("text")
    cbuf = memoryview(bytearray(3)).cast("c")
    assert b.recv_into(cbuf) == 3 and cbuf.tobytes() == b"xyz"
    two_d = memoryview(bytearray(b"abcdefgh")).cast("B", (2, 4))
    assert a.send_fast(two_d) == 0
    assert a.send_into(two_d) == 8
    assert b.recv_fast(memoryview(bytearray(16))[::2]) == 0  # strided: the long way decides
    into_2d = memoryview(bytearray(8)).cast("B", (2, 4))
    assert b.recv_fast(into_2d) == 0
    assert b.recv_into(into_2d) == 8 and into_2d.tobytes() == b"abcdefgh"
    assert a.send_fast(b"") == 0 and a.send_into(b"") == 0
    a.close()
    b.close()


def test_shutdown_stops_the_fast_send() -> None:
    a, b = pair()
    assert a.send_into(b"one") == 3
    assert a.send_fast(b"two") == 3  # space known free: the fast path is armed
    a.shutdown_write()
    assert a.send_fast(b"x") == 0
    with pytest.raises(BrokenPipeError):
        a.send_into(b"x")
    buf = bytearray(10)
    assert b.recv_into(buf) == 6 and buf[:6] == b"onetwo"
    assert b.recv_fast(buf) == 0 and b.recv_into(buf) == 0 and b.eof
    a.close()
    b.close()


def test_peer_close_and_abort_stop_the_fast_paths() -> None:
    a, b = pair()
    assert a.send_into(b"hello") == 5
    assert b.send_into(b"pending") == 7
    b.close()  # "hello" unread: an abort
    assert a.send_fast(b"x") == 0
    with pytest.raises(ConnectionResetError):
        a.send_into(b"x")
    buf = bytearray(10)
    assert a.recv_fast(buf) == 0  # "pending" is discarded, as after a TCP RST
    with pytest.raises(ConnectionResetError):
        a.recv_into(buf)
    a.close()

    c, d = pair()
    assert c.send_into(b"armed") == 5 and d.recv_into(bytearray(5)) == 5
    d.close()  # orderly
    assert c.send_fast(b"x") == 0
    with pytest.raises(ConnectionResetError):
        c.send_into(b"x")
    c.close()


def test_own_close_stops_the_fast_paths() -> None:
    a, b = pair()
    assert a.send_into(b"abc") == 3
    a.close()
    for op in (lambda: a.send_fast(b"x"), lambda: a.recv_fast(bytearray(3))):
        assert op() == 0
    with pytest.raises(OSError):
        a.send_into(b"x")
    with pytest.raises(OSError):
        a.recv_into(bytearray(3))
    b.close()


def test_level_mode_reads_the_long_way_and_keeps_the_eventfd_in_step() -> None:
    import select

    a, b = pair()
    fd = b.fileno()
    assert a.send_into(b"data") == 4
    assert select.select([fd], [], [], 1.0)[0] == [fd]
    buf = bytearray(10)
    assert b.recv_fast(buf) == 0  # level mode: the long way keeps the eventfd right
    assert b.recv_into(buf) == 4
    assert select.select([fd], [], [], 0)[0] == []
    a.close()
    b.close()


def test_spin_readable_sees_data_and_eof_and_gives_up_in_bounded_time() -> None:
    a, b = pair()
    t0 = time.monotonic()
    assert not b.spin_readable()  # nothing comes: the spin budget (≤ 0.2 ms) runs out
    assert time.monotonic() - t0 < 0.5
    a.send_into(b"x")
    # A loaded machine may have switched spinning off for a while (the contention back-off,
    # process-wide): this test is about what the spin sees, so forget that.
    wakeup.spin_backoff[0] = 0
    assert b.spin_readable() and b.recv_fast(bytearray(1)) == 1
    a.shutdown_write()
    wakeup.spin_backoff[0] = 0
    assert b.spin_readable() and b.recv_into(bytearray(1)) == 0 and b.eof
    a.close()
    b.close()
