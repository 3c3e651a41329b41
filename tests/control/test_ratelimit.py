"""RateLimitedLog: a burst per key and window, every suppressed message counted and reported."""

from __future__ import annotations

import logging

import pytest

from smcd_daemon.adapters.ratelimit import RateLimitedLog


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


def _lines(caplog: pytest.LogCaptureFixture) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "test.ratelimit"]


def test_burst_then_suppressed_then_reported_in_the_next_window(
    caplog: pytest.LogCaptureFixture, clock: Clock
) -> None:
    log = logging.getLogger("test.ratelimit")
    rl = RateLimitedLog(log, burst=3, period=10.0, clock=clock)
    caplog.set_level(logging.DEBUG, "test.ratelimit")
    shown = [rl.warning("bad", "bad datagram %d", i) for i in range(10_000)]
    assert shown[:3] == [True] * 3 and not any(shown[3:])
    assert _lines(caplog) == [(logging.WARNING, f"bad datagram {i}") for i in range(3)]
    assert rl.pending("bad") == 9_997 and rl.suppressed_total == 9_997
    clock.now += 10.0
    assert rl.warning("bad", "bad datagram %d", 10_000)
    assert _lines(caplog)[3:] == [
        (logging.WARNING, "bad: 9,997 similar messages suppressed in the last 10 s"),
        (logging.WARNING, "bad datagram 10000"),
    ]
    assert rl.pending() == 0


def test_keys_are_independent(caplog: pytest.LogCaptureFixture, clock: Clock) -> None:
    rl = RateLimitedLog(logging.getLogger("test.ratelimit"), burst=1, period=5.0, clock=clock)
    caplog.set_level(logging.DEBUG, "test.ratelimit")
    assert rl.warning("a", "first a")
    assert not rl.warning("a", "second a")
    assert rl.info("b", "first b")
    assert [m for _, m in _lines(caplog)] == ["first a", "first b"]
    assert rl.pending("a") == 1 and rl.pending("b") == 0


def test_flush_reports_ended_windows_and_force_reports_all(
    caplog: pytest.LogCaptureFixture, clock: Clock
) -> None:
    rl = RateLimitedLog(logging.getLogger("test.ratelimit"), burst=1, period=5.0, clock=clock)
    caplog.set_level(logging.DEBUG, "test.ratelimit")
    for _ in range(4):
        rl.warning("old", "old")
    clock.now += 3.0
    for _ in range(3):
        rl.error("new", "new")
    assert rl.flush() == 0  # no window has ended yet
    clock.now += 2.5
    assert rl.flush() == 3  # "old" ended: 3 suppressed
    assert _lines(caplog)[-1] == (
        logging.WARNING,
        "old: 3 similar messages suppressed in the last 6 s",
    )
    assert rl.flush(force=True) == 2
    assert _lines(caplog)[-1] == (
        logging.ERROR,
        "new: 2 similar messages suppressed in the last 2 s",
    )
    assert rl.pending() == 0 and rl.flush(force=True) == 0


def test_the_key_set_is_bounded_and_an_evicted_key_is_reported(
    caplog: pytest.LogCaptureFixture, clock: Clock
) -> None:
    rl = RateLimitedLog(
        logging.getLogger("test.ratelimit"), burst=1, period=60.0, max_keys=2, clock=clock
    )
    caplog.set_level(logging.DEBUG, "test.ratelimit")
    rl.warning("k1", "k1")
    rl.warning("k1", "k1")  # suppressed
    rl.warning("k2", "k2")
    rl.warning("k3", "k3")  # evicts k1, the least recently used
    assert "k1: 1 similar message suppressed in the last 0 s" in [m for _, m in _lines(caplog)]
    assert rl.pending() == 0
    assert rl.warning("k1", "k1 again")  # forgotten: a fresh window


def test_a_disabled_level_costs_nothing_and_counts_nothing(
    caplog: pytest.LogCaptureFixture, clock: Clock
) -> None:
    log = logging.getLogger("test.ratelimit")
    rl = RateLimitedLog(log, burst=1, period=60.0, clock=clock)
    caplog.set_level(logging.WARNING, "test.ratelimit")
    for _ in range(5):
        assert not rl.debug("quiet", "never shown")
    assert rl.pending() == 0 and _lines(caplog) == []


def test_bad_arguments_are_refused() -> None:
    log = logging.getLogger("test.ratelimit")
    for kw in ({"burst": 0}, {"period": 0.0}, {"max_keys": 0}):
        with pytest.raises(ValueError):
            RateLimitedLog(log, **kw)  # type: ignore[arg-type]


def test_fallback_lines_are_limited_per_reason_and_role_and_the_rest_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A peer without SMC makes every connection fall back: one journal line each would flood
    journald (and its rate limit would then drop smcd's warnings too). Each reason and role
    gets FALLBACK_LOG_BURST lines a minute with their fields; the rest are counted."""
    from smcd_daemon.adapters.ratelimit import FALLBACK_LOG_BURST, flush_all
    from smcd_daemon.adapters.systemd import log_fallbacks
    from smcd_daemon.core.registry import Connection, ConnMode, ConnRole, Registry
    from smcd_daemon.wire.reasons import DeclineReason

    registry = Registry()
    unsubscribe = log_fallbacks(registry)
    caplog.set_level(logging.INFO, "smcd.fallback")
    peernosmc, nodev = int(DeclineReason.PEERNOSMC), int(DeclineReason.NOSMCDEV)
    n = FALLBACK_LOG_BURST + 50
    try:
        for i in range(1, n + 1):
            registry.add_connection(Connection(i, ConnRole.CLIENT, ConnMode.TCP,
                                               fallback_reason=peernosmc))  # fmt: skip
        registry.add_connection(Connection(n + 1, ConnRole.SERVER, ConnMode.TCP,
                                           fallback_reason=peernosmc))  # fmt: skip
        registry.add_connection(Connection(n + 2, ConnRole.CLIENT, ConnMode.TCP,
                                           fallback_reason=nodev))  # fmt: skip
        flush_all(force=True)
    finally:
        unsubscribe()
    records = [r for r in caplog.records if r.name == "smcd.fallback"]
    lines = [r for r in records if "fell back to TCP" in r.getMessage()]
    assert len(lines) == FALLBACK_LOG_BURST + 2  # the server's and NOSMCDEV's have their own
    assert all(getattr(r, "SMC_REASON", "").startswith("SMC_CLC_DECL_") for r in lines)
    assert [r.getMessage() for r in records if "suppressed" in r.getMessage()] == [
        "fallbacks SMC_CLC_DECL_PEERNOSMC as client: 50 similar messages suppressed in the "
        "last 0 s"
    ]
