"""``make fuzz`` itself, at a small count: every part runs, counts add up, and a decoder that
raises anything but its protocol error is reported as a failure (the oracle works)."""

from __future__ import annotations

import pytest

from smc_handoff import messages as m
from tests.fuzz import fuzz

pytestmark = pytest.mark.timeout(120)


def test_make_fuzz_at_a_small_count(capsys: pytest.CaptureFixture[str]) -> None:
    assert fuzz.main(["--count", "3000", "--socket-count", "1000", "--jobs", "2"]) == 0
    out = capsys.readouterr().out
    assert "wire decoders (CLC, LLC, CDC): 3,000 inputs" in out
    assert "handoff message decoders: 3,000 inputs" in out
    assert "handoff socket of a live smcd: 1,000 datagrams" in out
    assert "tracebacks in its log: 0; real handoff afterwards: OK" in out
    assert out.rstrip().splitlines()[-1].startswith("fuzz: PASS")


def test_an_unexpected_exception_is_a_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    def sloppy(data: bytes) -> m.Message:
        if len(data) > 20:
            raise IndexError("a decoder bug")
        return m.decode(data)

    monkeypatch.setattr(fuzz, "HANDOFF_DECODERS", (("sloppy", sloppy),))
    n, stats, failures = fuzz.handoff_chunk(1, 500)
    assert n == 500 and sum(stats["sloppy"]) < 500
    assert failures and "sloppy raised IndexError: a decoder bug" in failures[0]
