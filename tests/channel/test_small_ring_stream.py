"""A stream through the default 256 KiB DMB (#10): the writer refills behind a reader that keeps
pace without leaving the fast path, a reader offered a large buffer takes everything there in
one fast call that frees the ring piece by piece, and every byte arrives once, in order."""

from __future__ import annotations

import mmap
import random

import pytest

from smc_handoff import layout
from smc_handoff.channel import Channel, make_pair

SIZE = 256 << 10
RING = SIZE - 32
K64 = 64 << 10


def _pair() -> tuple[Channel, Channel]:
    a, b = make_pair(SIZE, SIZE)
    return Channel.from_fds(a), Channel.from_fds(b)


def test_the_writer_refills_a_full_ring_by_the_fast_path() -> None:
    """The fast path's run is what the last long call saw free; a reader that took a piece
    since has freed more: the next 64 KiB write goes in without the long way."""
    writer, reader = _pair()
    try:
        rng = random.Random(1)
        first = rng.randbytes(RING)
        assert writer.send_into(first) == RING  # a full ring, seen by a long call
        chunk = rng.randbytes(K64)
        assert writer.send_fast(chunk) == 0
        buf = bytearray(K64)
        for i in range(2):  # the reader takes two pieces, the writer is not told
            assert reader.recv_fast(buf) == K64
            assert bytes(buf) == first[i * K64 : (i + 1) * K64]
        assert writer.send_fast(chunk) == K64  # in the room freed meanwhile, no long way
        assert writer.send_fast(chunk) == K64
        assert writer.send_fast(chunk) == 0  # full again: the long way decides
        assert writer.send_into(chunk) == 0
        rest = bytearray(RING)
        assert reader.recv_into(rest) == RING  # across the ring's end
        assert bytes(rest) == first[2 * K64 :] + chunk * 2
    finally:
        writer.close()
        reader.close()


def test_a_large_read_is_one_fast_call_that_frees_the_ring_as_it_goes() -> None:
    writer, reader = _pair()
    try:
        data = random.Random(2).randbytes(3 * K64 + 1000)
        assert writer.send_into(data) == len(data)
        big = bytearray(1 << 20)  # a bulk receiver's buffer: more than the ring holds
        assert reader.recv_fast(big) == len(data)
        assert bytes(big[: len(data)]) == data
        st = reader.stats()
        assert st["rx_cons"] == st["rx_prod"] == (0, len(data))
        assert writer.stats()["tx_cons"] == (0, len(data))  # the writer sees it all freed
        assert writer.send_fast(b"x" * 1000) == 1000
        assert reader.recv_fast(big) == 1000
    finally:
        writer.close()
        reader.close()


def test_a_large_read_into_an_odd_buffer_goes_the_long_way() -> None:
    writer, reader = _pair()
    try:
        data = random.Random(3).randbytes(2 * K64)
        assert writer.send_into(data) == len(data)
        words = memoryview(bytearray(4 * K64)).cast("Q")  # not bytes: the fast path declines
        assert reader.recv_fast(words) == 0
        assert reader.stats()["rx_cons"] == (0, 0)  # nothing consumed
        assert reader.recv_into(words) == len(data)
        assert words.cast("B")[: len(data)] == data
    finally:
        writer.close()
        reader.close()


def test_stream_intact_with_64k_writes_and_large_reads() -> None:
    """Writes of 64 KiB into the 256 KiB ring (the ring's end falls inside a write once a lap)
    and reads of every size up to a buffer larger than the ring: each byte once, in order."""
    writer, reader = _pair()
    rng = random.Random(4)
    stream = rng.randbytes(40 * RING + 777)
    sent = 0
    got = bytearray()
    try:
        while len(got) < len(stream):
            for _ in range(rng.choice((1, 2, 5))):
                if sent < len(stream):
                    part = stream[sent : sent + K64]
                    sent += writer.send_fast(part) or writer.send_into(part)
            buf = bytearray(rng.choice((100, K64, K64 + 1, 3 * K64, 1 << 20)))
            n = reader.recv_fast(buf) or reader.recv_into(buf)
            got += buf[:n]
        assert bytes(got) == stream
        assert reader.bytes_received == writer.bytes_sent == len(stream)
    finally:
        writer.close()
        reader.close()


def test_a_write_across_the_rings_end_stays_on_the_fast_path() -> None:
    """The ring is 32 bytes short of 256 KiB, so 64 KiB writes reach its end once a lap: the
    fast path copies to the end and on from the start, and publishes once."""
    writer, reader = _pair()
    try:
        rng = random.Random(5)
        chunks = [rng.randbytes(K64) for _ in range(4)]
        for c in chunks[:3]:
            assert writer.send_fast(c) == K64
        big = bytearray(1 << 20)
        assert reader.recv_fast(big) == 3 * K64  # room again for the fourth
        assert writer.send_fast(chunks[3]) == K64  # 65,504 to the end, 32 from the start
        st = writer.stats()
        assert st["tx_prod"] == (1, 32)
        assert reader.recv_fast(big) == K64  # to the end, the wrap, on from the start
        assert bytes(big[:K64]) == chunks[3]
        assert reader.stats()["rx_cons"] == (1, 32)
        assert writer.send_fast(b"after") == 5
        assert reader.recv_fast(big) == 5 and bytes(big[:5]) == b"after"
    finally:
        writer.close()
        reader.close()


def test_a_read_that_ends_at_the_rings_end_wraps_the_cursor() -> None:
    writer, reader = _pair()
    try:
        data = random.Random(6).randbytes(RING)
        assert writer.send_into(data) == RING  # the writer's cursor is in the next wrap
        buf = bytearray(RING)
        assert reader.recv_fast(buf) == RING and bytes(buf) == data
        assert reader.stats()["rx_cons"] == (1, 0)  # the kernel's form: never count == ring
        assert writer.send_fast(b"z" * 100) == 100
        assert reader.recv_fast(buf) == 100
    finally:
        writer.close()
        reader.close()


def test_a_peer_claiming_more_than_the_ring_is_caught_on_the_fast_path() -> None:
    fa, fb = make_pair(SIZE, SIZE)
    raw = mmap.mmap(fb.rx_dmb_fd, SIZE + layout.CTRL_LEN)  # the reader's DMB, as its peer sees it
    writer, reader = Channel.from_fds(fa), Channel.from_fds(fb)
    words = memoryview(raw)[: layout.CDC_HEADER_LEN].cast("Q")
    try:
        words[layout.W_PROD] = layout.prod_word(1, 10)  # a lap and 10 bytes: more than a ring
        big = bytearray(1 << 20)
        assert reader.recv_fast(big) == 0
        assert reader.stats()["rx_cons"] == (0, 0)
        with pytest.raises(ConnectionResetError, match="bytes in a"):
            reader.recv_into(big)
    finally:
        words.release()
        raw.close()
        writer.close()
        reader.close()
