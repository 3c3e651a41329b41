"""The one table ``bench/run.py`` prints: smcd next to TCP loopback and Unix stream sockets,
with ratios and the issue's targets, each marked met or not met, and the machine's own ceiling
for the 64 KiB throughput (``bench/ceiling.c``) measured in the same run."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

Results = dict[str, dict[str, float | None]]
"""kind ("tcp", "unix", "smcd", "ceiling") → metric key → value (None: not measured)."""

CEILING = "ceiling"
"""The kind of the C program's figures: ``bench/ceiling.c``, no smcd, no Python."""


@dataclass(frozen=True)
class Target:
    text: str
    met: Callable[[Results], bool]
    remark: Callable[[Results], str | None] | None = None
    """Added to the met column when it says something (e.g. that the target is above what
    this machine can do at all)."""


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
    kind: str = "smcd"
    """Whose figure the value column shows: smcd's, or for the ceiling row the C program's
    (then the tcp and unix columns are those of the row above, and the ratios are to them)."""

    @property
    def kinds(self) -> tuple[str, ...]:
        """The kinds that must have measured this row for the table to be complete."""
        if self.kind != "smcd":
            return (self.kind,)
        return ("tcp", "unix", "smcd") if self.baselines else ("smcd",)


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


def _above_ceiling(
    key: str, factors: tuple[tuple[str, float], ...]
) -> Callable[[Results], str | None]:
    """Which of "``factor``x ``base``" exceed the measured ceiling of ``key`` (computed from
    this run's figures; None when none does or something was not measured)."""

    def remark(res: Results) -> str | None:
        ceiling = _v(res, CEILING, key)
        if ceiling is None:
            return None
        above = [
            f"{factor:g}x {base}"
            for base, factor in factors
            if (b := _v(res, base, key)) is not None and factor * b > ceiling
        ]
        return f"{', '.join(above)} > ceiling" if above else None

    return remark


GB = 1e9
CONCURRENCY = 4
"""Client (and server) processes of the concurrent connection-rate figure."""
HANDOFFS_PER_CONNECTION = 2
"""An smcd connection between two local applications: the client's handoff and the server's."""

ROWS: tuple[Row, ...] = (
    Row(
        "throughput, 64 KiB writes",
        "tput_64k",
        "GB/s",
        GB,
        target=Target(
            ">= 4x tcp, >= 1.5x unix",
            _both(_ratio_at_least("tput_64k", "tcp", 4), _ratio_at_least("tput_64k", "unix", 1.5)),
            _above_ceiling("tput_64k", (("tcp", 4), ("unix", 1.5))),
        ),
    ),
    Row("ceiling: C shared-memory copy, 64 KiB", "tput_64k", "GB/s", GB, kind=CEILING),
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
    # "≥ 1,000 handoffs/s" read both ways, side by side: a handoff is one application handing
    # one socket to the daemon (a connection between two local applications is two: the
    # client's and the server's), or a whole connection.
    Row(
        "handoffs/s, one connection at a time",
        "handoffs_1",
        "1/s",
        baselines=False,
        target=Target(">= 1000/s (each end's)", _at_least("handoffs_1", 1000)),
    ),
    Row(f"handoffs/s, {CONCURRENCY} connections at a time", "handoffs_n", "1/s", baselines=False),
    Row(
        "connections/s, one at a time",
        "rate_1",
        "1/s",
        target=Target(">= 1000/s (per connection)", _at_least("rate_1", 1000)),
    ),
    Row(f"connections/s, {CONCURRENCY} at a time", "rate_n", "1/s"),
)

HEADER = ("metric", "unit", "tcp", "unix", "smcd", "smcd/tcp", "smcd/unix", "target", "met")
NA = "n/a"
DASH = "-"


def format_number(value: float | None, scale: float) -> str:
    """A figure for a table cell: three significant digits or so, n/a when not measured (the
    SMC-R VM bench's table uses it too)."""
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


def format_cell(value: float | None, unit: str) -> str:
    """A figure of the asyncio and two-namespace tables: GB/s with two decimals, other units
    with one below 100 and none above."""
    if value is None:
        return NA
    if unit == "GB/s":
        return f"{value:.2f}"
    return f"{value:,.0f}" if value >= 100 else f"{value:.1f}"


def _ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None or b == 0:
        return NA
    return f"{a / b:.2f}x"


def empty_results(kinds: tuple[str, ...]) -> Results:
    """Every figure of the table, none measured yet: each of ``kinds`` gets every key of the
    smcd rows, the ceiling only its own."""
    res: Results = {k: {row.key: None for row in ROWS if row.kind == "smcd"} for k in kinds}
    res[CEILING] = {row.key: None for row in ROWS if row.kind == CEILING}
    return res


def cells(res: Results) -> list[tuple[str, ...]]:
    """The table as strings, header first (what the smoke test parses)."""
    out: list[tuple[str, ...]] = [HEADER]
    for row in ROWS:
        s = _v(res, row.kind, row.key)
        if row.baselines:
            t, u = _v(res, "tcp", row.key), _v(res, "unix", row.key)
            # the ceiling row's baselines are those of the row above: shown there only
            own = row.kind == "smcd"
            fmt = format_number
            base = (fmt(t, row.scale), fmt(u, row.scale)) if own else (DASH, DASH)
            ratios = (_ratio(s, t), _ratio(s, u))
        else:
            base = ratios = (DASH, DASH)
        if row.target is None:
            target, met = "", ""
        else:
            target = row.target.text
            met = "met" if row.target.met(res) else "NOT met"
            if row.target.remark is not None and (remark := row.target.remark(res)):
                met += f" ({remark})"
        out.append((row.label, row.unit, *base, format_number(s, row.scale), *ratios, target, met))
    return out


def ceiling_share(res: Results, key: str = "tput_64k") -> float | None:
    """smcd's figure as a fraction of the measured ceiling (None: either is missing)."""
    s, c = _v(res, "smcd", key), _v(res, CEILING, key)
    return None if s is None or not c else s / c


def ceiling_summary(res: Results, key: str = "tput_64k") -> str:
    """The lines under the table that say what the ceiling row means for smcd's figure."""
    c = _v(res, CEILING, key)
    how = (
        "  (bench/ceiling.c: two C processes over shared memory, smcd's 64 KiB writes, 1 MiB "
        "ring, 1 MiB read buffer; its figure in the smcd column, its ratios in the smcd/ columns)"
    )
    if c is None:
        return f"ceiling: not measured (see the notes)\n{how}"
    share = ceiling_share(res, key)
    smcd = "smcd n/a" if share is None else f"smcd reaches {share:.0%} of it"
    t = _v(res, "tcp", key)
    if t is not None:
        where = "above" if 4 * t > c else "within"
        smcd += f"; 4x tcp ({4 * t / GB:.1f} GB/s) is {where} it"
    return (
        f"ceiling: {c / GB:.2f} GB/s, this machine's shared-memory ceiling at 64 KiB; {smcd}\n{how}"
    )


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
