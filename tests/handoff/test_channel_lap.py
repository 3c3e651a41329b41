"""A reader behind a full ring (#10): when the writer is a lap ahead — its producer cursor in
the next wrap, the usual state behind a slow reader — reads that stop short of the ring's end
still take the fast path, and the stream stays intact across laps."""

from __future__ import annotations

import random

from smc_handoff.channel import Channel, make_pair

SIZE = 16 << 10
RING = SIZE - 32


def _pair() -> tuple[Channel, Channel]:
    a, b = make_pair(SIZE, SIZE)
    return Channel.from_fds(a), Channel.from_fds(b)


def test_fast_path_reads_on_while_the_writer_is_a_lap_ahead() -> None:
    writer, reader = _pair()
    try:
        data = random.Random(10).randbytes(RING)
        assert writer.send_into(data) == RING  # to the ring's end: the cursor is in wrap 1
        buf = bytearray(1000)
        assert reader.recv_fast(buf) == 1000  # short of the end: no wrap needed
        assert bytes(buf) == data[:1000]
        assert writer.send_into(b"n" * 500) == 500  # into the freed start of the ring
        assert reader.recv_fast(buf) == 1000
        assert bytes(buf) == data[1000:2000]
        rest = bytearray(RING - 2000)
        assert reader.recv_fast(rest) == RING - 2000  # up to the end, and the wrap
        assert bytes(rest) == data[2000:]
        assert reader.recv_fast(buf) == 500 and bytes(buf[:500]) == b"n" * 500
    finally:
        writer.close()
        reader.close()


def test_stream_is_intact_across_laps_with_a_slow_reader() -> None:
    """The writer keeps the ring full (a lap ahead whenever it reached the end), the reader
    takes odd-sized bites: every byte arrives once, in order."""
    writer, reader = _pair()
    rng = random.Random(11)
    stream = rng.randbytes(20 * RING + 12_345)
    sent = 0
    got = bytearray()
    fast = 0
    try:
        while len(got) < len(stream):
            if sent < len(stream):
                sent += writer.send_into(stream[sent : sent + rng.choice((7, 4093, RING))])
            buf = bytearray(rng.choice((1, 333, 4096, 9000)))
            n = reader.recv_fast(buf)
            fast += n > 0
            if not n:
                n = reader.recv_into(buf)
            got += buf[:n]
        assert bytes(got) == stream
        assert fast > 0
    finally:
        writer.close()
        reader.close()
