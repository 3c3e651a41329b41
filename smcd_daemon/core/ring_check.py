"""Are the two cursors of one direction of an SMC-D channel possible? Read by the DMB observer.

Each direction of a channel has a producer cursor (how far the sender has written into the
receiver's ring, in the receiver's DMB header) and a consumer cursor (how far the receiver has
read, in the sender's DMB header). Between them lies the data in flight, so always
``0 ≤ producer - consumer ≤ ring``. The applications write these words themselves (the daemon is
not on the data path), so a buggy or hostile one can move them anywhere: a consumer ahead of
the producer makes its peer think the receiver read data that was never written (and overwrite
what it has not read); a producer more than a ring ahead has overwritten unread data. Either way
the stream is already broken, and only an abort (both ends see ECONNRESET) keeps anybody from
reading it as data — as the kernel resets a connection whose CDC cursors make no sense.

The two words are not read at the same instant, and both only move forward, so each check uses
the reading order that cannot give a false alarm: "consumer ahead" compares a consumer read
*before* the producer (the producer can only have moved further), "overrun" a producer read
*before* the consumer (the consumer can only have caught up). The observer reads the receive
header, the send header, then the receive header again, which gives both orders for both
directions (:func:`check_reads`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["CursorFault", "Fault", "check_direction", "check_reads", "ring_distance"]

Pos = tuple[int, int]
"""(wrap, count) of a cursor as read from a header word."""


class CursorFault(enum.Enum):
    """What is wrong (the value is the named reason the connection is aborted with)."""

    CONSUMER_AHEAD = "the consumer cursor is ahead of the producer"
    OVERRUN = "the producer cursor is more than the ring ahead of the consumer"
    OUT_OF_RING = "a cursor points outside the ring"


@dataclass(frozen=True)
class Fault:
    fault: CursorFault
    direction: str  # "receive" | "send" (seen from the half the observer reads for)
    producer: Pos
    consumer: Pos
    ring: int

    def __str__(self) -> str:
        return (
            f"{self.direction} direction: {self.fault.value} (producer {self.producer[0]}:"
            f"{self.producer[1]}, consumer {self.consumer[0]}:{self.consumer[1]}, "
            f"ring {self.ring} bytes)"
        )


def ring_distance(prod: Pos, cons: Pos, ring: int) -> int:
    """Bytes from ``cons`` to ``prod`` in a ring of ``ring`` bytes, negative when the consumer
    is ahead; the wraps (u16) are compared as the nearer of the two ways round."""
    dw = ((prod[0] - cons[0] + 0x8000) & 0xFFFF) - 0x8000
    return dw * ring + prod[1] - cons[1]


def check_reads(
    direction: str, cons_then_prod: tuple[Pos, Pos], prod_then_cons: tuple[Pos, Pos], ring: int
) -> Fault | None:
    """Check one direction from two readings of its cursors: a consumer read before a producer
    (``cons_then_prod``) and a producer read before a consumer (``prod_then_cons``); see the
    module docstring. None when the cursors are possible."""
    cons, prod = cons_then_prod
    prod_first, cons_later = prod_then_cons
    for pos in (cons, prod, prod_first, cons_later):
        if not 0 <= pos[1] < ring:
            return Fault(CursorFault.OUT_OF_RING, direction, prod, cons, ring)
    if ring_distance(prod, cons, ring) < 0:
        return Fault(CursorFault.CONSUMER_AHEAD, direction, prod, cons, ring)
    if ring_distance(prod_first, cons_later, ring) > ring:
        return Fault(CursorFault.OVERRUN, direction, prod_first, cons_later, ring)
    return None


def check_direction(
    direction: str, prod_before: Pos, cons: Pos, prod_after: Pos, ring: int
) -> Fault | None:
    """:func:`check_reads` for one consumer reading between two producer readings
    (``prod_before`` read before ``cons``, ``prod_after`` after it)."""
    return check_reads(direction, (cons, prod_after), (prod_before, cons), ring)
