"""The one table ``bench/run.py`` prints: smcd next to TCP loopback and Unix stream sockets,
with ratios and the issue's targets, each marked met or not met."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

Results = dict[str, dict[str, float | None]]
"""kind ("tcp", "unix", "smcd") → metric key → value (None: not measured)."""


@dataclass(frozen=True)
class Target:
    text: str
    met: Callable[[Results], bool]


@dataclass(frozen=True)
class Row:
    label: str
    key: str
    unit: str
    scale: float = 1.0
    """Divide by this for display (bytes/s → GB/s)."""
    baselines: bool = True
    """False for smcd-only figures (a TCP connection has no handoff)."""
    target: Target | None = None


def _v(res: Results, kind: str, key: str) -> float | None:
    return res.get(kind, {}).get(key)


def _ratio_at_least(key: str, base: str, factor: float) -> Callable[[Results], bool]:
    def met(res: Results) -> bool:
        s, b = _v(res, "smcd", key), _v(res, base, key)
        return s is not None and b is not None and s >= factor * b

    return met


def _ratio_at_most(key: str, base: str, factor: float) -> Callable[[Results], bool]:
    def met(res: Results) -> bool:
        s, b = _v(res, "smcd", key), _v(res, base, key)
        return s is not None and b is not None and s <= factor * b

    return met


def _at_most(key: str, limit: float) -> Callable[[Results], bool]:
    return lambda res: (v := _v(res, "smcd", key)) is not None and v <= limit


def _at_least(key: str, limit: float) -> Callable[[Results], bool]:
    return lambda res: (v := _v(res, "smcd", key)) is not None and v >= limit


def _both(*checks: Callable[[Results], bool]) -> Callable[[Results], bool]:
    return lambda res: all(c(res) for c in checks)


GB = 1e9
CONCURRENCY = 4
"""Client (and server) processes of the concurrent connection-rate figure."""

ROWS: tuple[Row, ...] = (
    Row(
        "throughput, 64 KiB writes",
        "tput_64k",
        "GB/s",
        GB,
        target=Target(
            ">= 4x tcp, >= 1.5x unix",
            _both(_ratio_at_least("tput_64k", "tcp", 4), _ratio_at_least("tput_64k", "unix", 1.5)),
        ),
    ),
    Row("throughput, 1 MiB writes", "tput_1m", "GB/s", GB),
    Row(
        "ping-pong RTT 1 B, p50",
        "rtt_1b_p50",
        "us",
        target=Target("<= 0.3x tcp", _ratio_at_most("rtt_1b_p50", "tcp", 0.3)),
    ),
    Row("ping-pong RTT 1 B, p99", "rtt_1b_p99", "us"),
    Row(
        "ping-pong RTT 1 KiB, p50",
        "rtt_1k_p50",
        "us",
        target=Target("<= 0.3x tcp", _ratio_at_most("rtt_1k_p50", "tcp", 0.3)),
    ),
    Row("ping-pong RTT 1 KiB, p99", "rtt_1k_p99", "us"),
    Row("connect (+handoff), p50", "connect_p50", "us"),
    Row("connect (+handoff), p99", "connect_p99", "us"),
    Row(
        "handoff+handshake, p50",
        "handoff_p50",
        "us",
        baselines=False,
        target=Target("<= 2000 us", _at_most("handoff_p50", 2000)),
    ),
    Row("handoff+handshake, p99", "handoff_p99", "us", baselines=False),
    Row(
        "connections/s, one at a time",
        "rate_1",
        "1/s",
        target=Target(">= 1000/s", _at_least("rate_1", 1000)),
    ),
    Row(f"connections/s, {CONCURRENCY} at a time", "rate_n", "1/s"),
)

HEADER = ("metric", "unit", "tcp", "unix", "smcd", "smcd/tcp", "smcd/unix", "target", "met")
NA = "n/a"
DASH = "-"


def _num(value: float | None, scale: float) -> str:
    if value is None:
        return NA
    v = value / scale
    if v >= 1000:
        return f"{v:,.0f}"
    if v >= 100:
        return f"{v:.0f}"
    if v >= 10:
        return f"{v:.1f}"
    return f"{v:.2f}"


def _ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None or b == 0:
        return NA
    return f"{a / b:.2f}x"


def cells(res: Results) -> list[tuple[str, ...]]:
    """The table as strings, header first (what the smoke test parses)."""
    out: list[tuple[str, ...]] = [HEADER]
    for row in ROWS:
        s = _v(res, "smcd", row.key)
        if row.baselines:
            t, u = _v(res, "tcp", row.key), _v(res, "unix", row.key)
            base = (_num(t, row.scale), _num(u, row.scale))
            ratios = (_ratio(s, t), _ratio(s, u))
        else:
            base = ratios = (DASH, DASH)
        if row.target is None:
            target, met = "", ""
        else:
            target = row.target.text
            met = "met" if row.target.met(res) else "NOT met"
        out.append((row.label, row.unit, *base, _num(s, row.scale), *ratios, target, met))
    return out


def render(res: Results) -> str:
    rows = cells(res)
    widths = [max(len(r[i]) for r in rows) for i in range(len(HEADER))]
    lines = []
    for n, r in enumerate(rows):
        parts = [r[0].ljust(widths[0]), r[1].ljust(widths[1])]
        parts += [c.rjust(w) for c, w in zip(r[2:7], widths[2:7], strict=True)]
        parts += [r[7].ljust(widths[7]), r[8]]
        lines.append("  ".join(parts).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)
