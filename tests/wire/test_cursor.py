"""Cursor arithmetic mirrors Linux's smc_cdc.h helpers."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from smcd_daemon.wire.cursor import (
    WRAP_MODULUS,
    Cursor,
    cursor_cmp,
    cursor_diff,
    cursor_diff_large,
    cursor_update,
    is_stale,
)

SIZE = 16384


def test_add_within_buffer() -> None:
    assert Cursor(3, 100).add(SIZE, 50) == Cursor(3, 150)
    assert Cursor(3, 100).add(SIZE, 0) == Cursor(3, 100)


def test_add_wraps_at_buffer_end() -> None:
    assert Cursor(0, SIZE - 10).add(SIZE, 10) == Cursor(1, 0)  # exactly at the end
    assert Cursor(0, SIZE - 10).add(SIZE, 11) == Cursor(1, 1)
    assert Cursor(0, 0).add(SIZE, SIZE) == Cursor(1, 0)  # a whole buffer


def test_wrap_counter_wraps_at_2_16() -> None:
    assert Cursor(0xFFFF, SIZE - 1).add(SIZE, 1) == Cursor(0, 0)
    assert Cursor(0xFFFF, 5).add(SIZE, SIZE) == Cursor(0, 5)


def test_add_rejects_what_the_kernel_never_does() -> None:
    with pytest.raises(ValueError):
        Cursor().add(SIZE, SIZE + 1)
    with pytest.raises(ValueError):
        Cursor().add(SIZE, -1)
    with pytest.raises(ValueError):
        Cursor().add(0, 0)
    with pytest.raises(ValueError):
        Cursor(WRAP_MODULUS, 0)
    with pytest.raises(ValueError):
        Cursor(0, 1 << 32)


def test_diff() -> None:
    assert cursor_diff(SIZE, Cursor(2, 100), Cursor(2, 300)) == 200
    assert cursor_diff(SIZE, Cursor(2, 300), Cursor(2, 300)) == 0
    # across a wrap
    assert cursor_diff(SIZE, Cursor(2, SIZE - 100), Cursor(3, 50)) == 150
    # across the 2**16 wrap-count wrap
    assert cursor_diff(SIZE, Cursor(0xFFFF, SIZE - 1), Cursor(0, 1)) == 2
    # "old" newer within the same wrap: 0, never negative
    assert cursor_diff(SIZE, Cursor(2, 300), Cursor(2, 100)) == 0


def test_cmp_is_signed() -> None:
    assert cursor_cmp(SIZE, Cursor(2, 100), Cursor(2, 300)) == 200
    assert cursor_cmp(SIZE, Cursor(2, 300), Cursor(2, 100)) == -200
    assert cursor_cmp(SIZE, Cursor(3, 50), Cursor(2, SIZE - 100)) == -150
    assert cursor_cmp(SIZE, Cursor(2, SIZE - 100), Cursor(3, 50)) == 150
    # smc_curs_comp compares wraps numerically: 0xFFFF counts as newer than 0
    assert cursor_cmp(SIZE, Cursor(0xFFFF, 10), Cursor(0, 10)) == -SIZE


def test_diff_large() -> None:
    assert cursor_diff_large(SIZE, Cursor(1, 0), Cursor(1, 10)) == 10
    assert cursor_diff_large(SIZE, Cursor(1, 100), Cursor(2, 50)) == SIZE - 50
    assert cursor_diff_large(SIZE, Cursor(1, 100), Cursor(5, 50)) == SIZE  # capped
    assert cursor_diff_large(SIZE, Cursor(0xFFFF, SIZE - 4), Cursor(0, 4)) == 8
    assert cursor_diff_large(SIZE, Cursor(0xFFFE, 0), Cursor(1, 0)) == SIZE
    assert cursor_diff_large(SIZE, Cursor(1, 10), Cursor(1, 5)) == 0


def test_stale_cursor_rule() -> None:
    current = Cursor(5, 1000)
    assert is_stale(current, Cursor(4, 5000))  # older wrap
    assert is_stale(current, Cursor(5, 999))  # same wrap, lower count
    assert not is_stale(current, Cursor(5, 1000))  # equal: accepted
    assert not is_stale(current, Cursor(5, 1001))
    assert not is_stale(current, Cursor(6, 0))
    # wrap 0 passes: the wrap counter has gone 0xFFFF -> 0
    assert not is_stale(Cursor(0xFFFF, 10), Cursor(0, 5))
    assert is_stale(Cursor(0, 10), Cursor(0, 5))


def test_cursor_update() -> None:
    current = Cursor(5, 1000)
    assert cursor_update(current, Cursor(4, 0)) is current
    assert cursor_update(current, Cursor(5, 2000)) == Cursor(5, 2000)
    # max_count bounds a hostile producer cursor to our buffer
    assert cursor_update(current, Cursor(5, 1 << 30), max_count=SIZE) == Cursor(5, SIZE)
    assert cursor_update(current, Cursor(5, 1 << 30)) == Cursor(5, 1 << 30)


# ---------------------------------------------------------------------------- model test
def model(size: int, pos: int) -> Cursor:
    """An absolute byte position as a cursor: the obvious model smc_curs_* must agree with."""
    return Cursor((pos // size) % WRAP_MODULUS, pos % size)


@settings(max_examples=300)
@given(
    size=st.sampled_from([1, 7, 16384, 65536, 1 << 20]),
    start_wrap=st.one_of(st.integers(0, 0xFFFF), st.integers(0xFFF0, 0xFFFF)),
    start_frac=st.floats(0, 1, exclude_max=True),
    steps=st.lists(st.floats(0, 1), min_size=1, max_size=40),
)
def test_matches_absolute_offset_model(
    size: int, start_wrap: int, start_frac: float, steps: list[float]
) -> None:
    pos = start_wrap * size + int(start_frac * size)
    start_pos = pos
    curs = model(size, pos)
    start = curs
    for frac in steps:
        n = round(frac * size)
        old = curs
        curs = curs.add(size, n)
        pos += n
        assert curs == model(size, pos)
        # one step is at most one buffer: the small diff is exact, across any wrap
        assert cursor_diff(size, old, curs) == n
        assert cursor_diff_large(size, old, curs) == n
        if old.wrap <= curs.wrap:  # cmp orders wraps numerically (no 2**16 wrap)
            assert cursor_cmp(size, old, curs) == n
            assert cursor_cmp(size, curs, old) == -n
        # the newer cursor is always accepted; the older one is stale unless the kernel's
        # wrap-0 exception (or the 2**16 wrap) applies
        assert not is_stale(old, curs)
        if n > 0 and old.wrap != 0 and curs.wrap >= old.wrap:
            assert is_stale(curs, old)
    total = pos - start_pos
    if total < (WRAP_MODULUS - 1) * size:
        assert cursor_diff_large(size, start, curs) == min(total, size)
