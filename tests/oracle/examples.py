"""Draw a fixed batch of examples from a hypothesis strategy, for one batched tshark run.

Property tests call the code under test once per example; here the judge (tshark) costs ~1 s
per run, so we draw the examples up front, deterministically (``derandomize``), and decode them
all in one capture.
"""

from __future__ import annotations

from typing import TypeVar

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

T = TypeVar("T")

__all__ = ["draw_examples"]


def draw_examples(strategy: st.SearchStrategy[T], n: int) -> list[T]:
    """``n`` examples (fewer only if the strategy has fewer distinct values), same on every run."""
    out: list[T] = []

    @settings(
        max_examples=n,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy)
    def collect(value: T) -> None:
        out.append(value)

    collect()
    return out[:n]
