"""SMC cursors and the kernel's cursor arithmetic (Linux ``net/smc/smc_cdc.h``).

A cursor names a byte position in a ring buffer (RMBE or DMBE) as ``(wrap, count)``: ``count`` is
the offset inside the buffer, ``wrap`` counts how often the writer went round. ``wrap`` is a u16 on
the wire and in Linux's ``union smc_host_cursor``, so it silently wraps at 2**16; ``count`` is a
u32. The functions here reproduce the kernel's inline helpers exactly — including their limits
(``cursor_diff`` trusts that the two cursors are at most one buffer apart) — because both peers
must agree byte for byte on how much space and data there is.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "WRAP_MODULUS",
    "Cursor",
    "cursor_cmp",
    "cursor_diff",
    "cursor_diff_large",
    "cursor_update",
    "is_stale",
]

#: ``wrap`` is a u16: after 0xFFFF comes 0.
WRAP_MODULUS = 1 << 16
_COUNT_LIMIT = 1 << 32


@dataclass(frozen=True, slots=True)
class Cursor:
    """One SMC cursor: ``wrap`` (u16) and ``count`` (u32, byte offset inside the buffer)."""

    wrap: int = 0
    count: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.wrap < WRAP_MODULUS:
            raise ValueError(f"cursor wrap {self.wrap} is not a u16")
        if not 0 <= self.count < _COUNT_LIMIT:
            raise ValueError(f"cursor count {self.count} is not a u32")

    def add(self, size: int, n: int) -> Cursor:
        """The cursor ``n`` bytes further on in a buffer of ``size`` bytes (``smc_curs_add``).

        As in the kernel, the count is reduced by ``size`` at most once and ``wrap`` goes up by
        one (modulo 2**16) when it does; callers never advance by more than a buffer, so ``n``
        must lie in ``0..size``.
        """
        if size <= 0:
            raise ValueError(f"buffer size must be positive, not {size}")
        if not 0 <= n <= size:
            raise ValueError(f"cannot advance a cursor by {n} bytes in a {size}-byte buffer")
        count = self.count + n
        wrap = self.wrap
        if count >= size:
            wrap = (wrap + 1) % WRAP_MODULUS
            count -= size
        return Cursor(wrap, count)

    def is_before(self, other: Cursor) -> bool:
        """True when ``self`` is strictly older than ``other`` by (wrap, count), ignoring
        wrap-around of the wrap counter (the ordering ``smc_curs_comp`` uses)."""
        return self.wrap < other.wrap or (self.wrap == other.wrap and self.count < other.count)


def cursor_diff(size: int, old: Cursor, new: Cursor) -> int:
    """Bytes from ``old`` to ``new`` in a buffer of ``size`` bytes (``smc_curs_diff``).

    Assumes ``old <= new`` and that they are at most ``size`` bytes apart: any differing wrap is
    taken to mean "one wrap ahead". Returns 0 instead of a negative number when ``old`` is ahead
    within the same wrap (a stale update must not shrink anything).
    """
    if old.wrap != new.wrap:
        return max(0, (size - old.count) + new.count)
    return max(0, new.count - old.count)


def cursor_cmp(size: int, old: Cursor, new: Cursor) -> int:
    """Signed distance from ``old`` to ``new`` (``smc_curs_comp``).

    Negative (``-cursor_diff(size, new, old)``) when ``old`` is newer by (wrap, count) — note the
    kernel compares wraps numerically here, so wrap 0xFFFF counts as newer than wrap 0.
    """
    if new.is_before(old):
        return -cursor_diff(size, new, old)
    return cursor_diff(size, old, new)


def cursor_diff_large(size: int, old: Cursor, new: Cursor) -> int:
    """Bytes from ``old`` to ``new`` when they may be several wraps apart, capped at ``size``
    (``smc_curs_diff_large``, used for the consumer-cursor update decision).

    A smaller ``new.wrap`` is read as the wrap counter having passed 0xFFFF → 0.
    """
    if old.wrap < new.wrap:
        return min((size - old.count) + new.count + (new.wrap - old.wrap - 1) * size, size)
    if old.wrap > new.wrap:
        return min((size - old.count) + new.count + (new.wrap + 0xFFFF - old.wrap) * size, size)
    return max(0, new.count - old.count)


def is_stale(current: Cursor, received: Cursor) -> bool:
    """True when a cursor received from the peer is older than the one we hold and must be
    ignored (the early returns of ``smc_cdc_cursor_to_host``).

    Older means a lower wrap — unless the received wrap is 0, which the kernel lets through as
    the wrap counter having wrapped round — or the same wrap with a lower count. An equal cursor
    is not stale.
    """
    if current.wrap > received.wrap and received.wrap != 0:
        return True
    return current.wrap == received.wrap and current.count > received.count


def cursor_update(current: Cursor, received: Cursor, max_count: int = 0) -> Cursor:
    """The cursor to keep after receiving ``received`` (``smc_cdc_cursor_to_host``).

    Stale cursors are ignored (``current`` is returned). A positive ``max_count`` bounds the
    received count — the kernel does this for the peer's producer cursor, which indexes our own
    buffer, so a hostile peer cannot point past its end; 0 leaves the count unbounded.
    """
    if is_stale(current, received):
        return current
    if max_count and received.count > max_count:
        return Cursor(received.wrap, max_count)
    return received
