"""The observer's cursor check, in-process: possible cursors pass (empty, full, across wraps and
the u16 wrap-around, a consumer that caught up between the reads); a consumer ahead of the
producer, a producer more than a ring ahead and a count outside the ring are named faults."""

from __future__ import annotations

from smcd_daemon.core.ring_check import CursorFault, check_direction, ring_distance

RING = 65536 - 32


def test_distance_across_wraps() -> None:
    assert ring_distance((0, 100), (0, 40), RING) == 60
    assert ring_distance((1, 10), (0, RING - 10), RING) == 20
    assert ring_distance((0, 5), (0xFFFF, RING - 5), RING) == 10  # the u16 wrap-around
    assert ring_distance((0, 40), (0, 100), RING) == -60


def test_possible_cursors_pass() -> None:
    assert check_direction("receive", (0, 0), (0, 0), (0, 0), RING) is None  # empty
    assert check_direction("receive", (1, 0), (0, 0), (1, 0), RING) is None  # exactly full
    # the producer moved on between the reads; the consumer caught up with the later producer
    assert check_direction("send", (3, 100), (3, 500), (3, 900), RING) is None
    assert check_direction("send", (0xFFFF, RING - 1), (0xFFFF, 7), (0, 3), RING) is None


def test_consumer_ahead_of_the_producer_is_a_fault() -> None:
    fault = check_direction("receive", (0, 100), (0, 200), (0, 150), RING)
    assert fault is not None and fault.fault is CursorFault.CONSUMER_AHEAD
    assert "receive direction: the consumer cursor is ahead of the producer" in str(fault)
    assert "producer 0:150, consumer 0:200" in str(fault)
    ahead_a_wrap = check_direction("send", (2, 0), (3, 0), (2, 10), RING)
    assert ahead_a_wrap is not None and ahead_a_wrap.fault is CursorFault.CONSUMER_AHEAD


def test_producer_more_than_a_ring_ahead_is_a_fault() -> None:
    fault = check_direction("send", (1, 1), (0, 0), (1, 1), RING)
    assert fault is not None and fault.fault is CursorFault.OVERRUN
    assert str(fault).startswith("send direction: the producer cursor is more than the ring")


def test_a_count_outside_the_ring_is_a_fault() -> None:
    fault = check_direction("receive", (0, RING), (0, 0), (0, RING), RING)
    assert fault is not None and fault.fault is CursorFault.OUT_OF_RING


def test_check_reads_uses_each_reading_in_its_safe_order() -> None:
    from smcd_daemon.core.ring_check import check_reads

    # send direction: the consumer read first (0:10), the producer later (0:50): fine; the
    # producer read first (0:50) and the consumer later (0:60, it caught up meanwhile): fine
    assert check_reads("send", ((0, 10), (0, 50)), ((0, 50), (0, 60)), RING) is None
    ahead = check_reads("send", ((0, 60), (0, 50)), ((0, 50), (0, 60)), RING)
    assert ahead is not None and ahead.fault is CursorFault.CONSUMER_AHEAD
