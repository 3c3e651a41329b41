"""The user-view table of ``make bench`` (``bench/userview.py``): the same stdlib program on plain
TCP and under ``smc-run`` against an smcd with no configuration, each figure next to the target
of issue 10 and whether this run met it, the transport each row's connections really got, and
the measured bound of a figure where a target may lie beyond what the machine allows."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from _table import format_number

UserResults = dict[str, dict[str, float | None]]
""""tcp" / "smc" → key → figure; "bound" → key → a bound's figure (the C ceiling, the
receiver's own work)."""
Modes = dict[str, str]
"""key → what the smc-run connections of that figure got: ``smcd``, ``tcp (reason)``, ``mixed``."""

GB = 1e9
MIB = float(1 << 20)
SMCD = "smcd"
HEADER = ("metric", "unit", "tcp", "smc-run", "smc/tcp", "target", "met", "mode")


@dataclass(frozen=True)
class Check:
    text: str
    ok: Callable[[UserResults], bool]
    limit: Callable[[UserResults], str | None] | None = None
    """What stops the target on this machine, computed from this run (e.g. "2x tcp > ceiling")."""


@dataclass(frozen=True)
class URow:
    label: str
    key: str
    unit: str
    scale: float = 1.0
    check: Check | None = None
    bound: bool = False
    """A bound, not a comparison: its figure in the smc-run column, no tcp, no mode."""


def _get(res: UserResults, kind: str, key: str) -> float | None:
    return res.get(kind, {}).get(key)


def ratio_at_least(key: str, factor: float) -> Callable[[UserResults], bool]:
    def ok(res: UserResults) -> bool:
        s, t = _get(res, "smc", key), _get(res, "tcp", key)
        return s is not None and t is not None and s >= factor * t

    return ok


def ratio_at_most(key: str, factor: float) -> Callable[[UserResults], bool]:
    def ok(res: UserResults) -> bool:
        s, t = _get(res, "smc", key), _get(res, "tcp", key)
        return s is not None and t is not None and s <= factor * t

    return ok


def at_least(key: str, limit: float) -> Callable[[UserResults], bool]:
    return lambda res: (v := _get(res, "smc", key)) is not None and v >= limit


def at_most(key: str, limit: float) -> Callable[[UserResults], bool]:
    return lambda res: (v := _get(res, "smc", key)) is not None and v <= limit


def share_of_bound(key: str, bound: str, share: float) -> Callable[[UserResults], bool]:
    def ok(res: UserResults) -> bool:
        s, b = _get(res, "smc", key), _get(res, "bound", bound)
        return s is not None and b is not None and s >= share * b

    return ok


def above_bound(
    key: str, factor: float, bound: str, name: str
) -> Callable[[UserResults], str | None]:
    """ "``factor``x tcp > ``name``" when this run's TCP figure times ``factor`` exceeds the
    measured bound: the target is beyond this machine (or this receiver)."""

    def limit(res: UserResults) -> str | None:
        t, b = _get(res, "tcp", key), _get(res, "bound", bound)
        if t is None or b is None or factor * t <= b:
            return None
        return f"{factor:g}x tcp > {name}"

    return limit


def below_bound(
    key: str, factor: float, bound: str, name: str
) -> Callable[[UserResults], str | None]:
    """ "``factor``x tcp < ``name``" when the target time is below the measured bound."""

    def limit(res: UserResults) -> str | None:
        t, b = _get(res, "tcp", key), _get(res, "bound", bound)
        if t is None or b is None or factor * t >= b:
            return None
        return f"{factor:g}x tcp < {name}"

    return limit


def _each(
    *limits: Callable[[UserResults], str | None],
) -> Callable[[UserResults], str | None]:
    """Every limit's text that applies, joined (None when none does)."""

    def text(res: UserResults) -> str | None:
        found = [t for limit in limits if (t := limit(res))]
        return "; ".join(found) if found else None

    return text


def below_bounds(
    key: str, factor: float, bounds: tuple[tuple[str, str], ...]
) -> Callable[[UserResults], str | None]:
    """:func:`below_bound` for several bounds (key, name): each one the target time is below."""
    return _each(*(below_bound(key, factor, bound, name) for bound, name in bounds))


def cpu_above(bound: str, limit_us: float) -> Callable[[UserResults], str | None]:
    """ "smcd CPU > N us" when the daemon alone spends more per connection than the target
    allows (one connection at a time, its handshake is on the critical path)."""

    def limit(res: UserResults) -> str | None:
        b = _get(res, "bound", bound)
        return None if b is None or b <= limit_us else f"smcd CPU > {limit_us:.0f} us"

    return limit


def rate_below(bound: str, limit: float) -> Callable[[UserResults], str | None]:
    """ "CPU allows N/s" when the CPU the chain's processes spend per connection, shared out
    over this machine's CPUs without a gap, allows fewer than ``limit`` connections/s."""

    def text(res: UserResults) -> str | None:
        b = _get(res, "bound", bound)
        return None if b is None or b >= limit else f"CPU allows {b:.0f}/s"

    return text


def _all(*oks: Callable[[UserResults], bool]) -> Callable[[UserResults], bool]:
    return lambda res: all(ok(res) for ok in oks)


RR_SIZES = ((1, "1 B", "1b", 0.3), (1024, "1 KiB", "1k", 0.3), (65536, "64 KiB", "64k", 0.5))
"""Request/response sizes: bytes, label, key suffix, the p50 target as a fraction of TCP's."""
PY_BOUNDS = (("py2", "two CPUs"), ("py1", "one CPU"))
"""The Python echo's bounds of a round trip (bench/_rtt_ceiling.py): key suffix, placement."""


def rows(idle: int, concurrency: int, stride: int, cpus: int = 2) -> tuple[URow, ...]:
    out = [
        URow(
            "bulk, 64 KiB sendall, receiver only reads",
            "bulk",
            "GB/s",
            GB,
            Check(
                ">= 2.0x tcp, >= 80% of ceiling",
                _all(ratio_at_least("bulk", 2.0), share_of_bound("bulk", "ceiling", 0.8)),
                above_bound("bulk", 2.0, "ceiling", "ceiling"),
            ),
        ),
        URow("  bound: ceiling (C, shared memory)", "ceiling", "GB/s", GB, bound=True),
        URow(
            "  bound: C through the default DMB's ring",
            "ceiling_default",
            "GB/s",
            GB,
            bound=True,
        ),
        URow(
            f"bulk, receiver checks every {stride}th byte",
            "bulk_work",
            "GB/s",
            GB,
            Check(
                ">= 1.4x tcp",
                ratio_at_least("bulk_work", 1.4),
                above_bound("bulk_work", 1.4, "work", "bound"),
            ),
        ),
        URow("  bound: that receiver reading memory", "work", "GB/s", GB, bound=True),
    ]
    for _size, name, key, factor in RR_SIZES:
        p50 = f"rr_{key}_p50"
        out.append(
            URow(
                f"round trip {name}, p50",
                p50,
                "us",
                check=Check(
                    f"<= {factor:g}x tcp",
                    ratio_at_most(p50, factor),
                    below_bounds(
                        p50,
                        factor,
                        (
                            (p50, "bound"),
                            *((f"{p50}_{k}", f"Python echo, {n}") for k, n in PY_BOUNDS),
                        ),
                    ),
                ),
            )
        )
        out.append(URow("  bound: C shared-memory echo, p50", p50, "us", bound=True))
        for suffix, placement in PY_BOUNDS:
            label = f"  bound: Python shared-memory echo, {placement}, p50"
            out.append(URow(label, f"{p50}_{suffix}", "us", bound=True))
        out.append(URow(f"round trip {name}, p99", f"rr_{key}_p99", "us"))
    out.append(URow("TLS round trip 1 KiB (ssl), p50", "tls_rr_1k_p50", "us"))
    out.append(URow("TLS round trip 1 KiB (ssl), p99", "tls_rr_1k_p99", "us"))
    out.append(URow("TLS bulk, 64 KiB sendall (ssl)", "tls_bulk", "GB/s", GB))
    out += [
        URow(
            "connections/s, one at a time",
            "conns_1",
            "1/s",
            check=Check(
                ">= 1500/s",
                at_least("conns_1", 1500),
                _each(cpu_above("smcd_cpu", 1e6 / 1500), rate_below("cpu_rate", 1500)),
            ),
        ),
        URow(
            "setup p50 (connect + first send), one at a time",
            "connect_p50",
            "us",
            check=Check("<= 500 us", at_most("connect_p50", 500), cpu_above("smcd_cpu", 500)),
        ),
        URow("  client's CPU per connection", "cpu_client", "us"),
        URow("  echo server's CPU per connection", "cpu_server", "us"),
        URow("  bound: smcd CPU per connection", "smcd_cpu", "us", bound=True),
        URow("  bound: CPU per connection, smcd + client + server", "chain_cpu", "us", bound=True),
        URow(
            f"  bound: connections/s that CPU allows on {cpus} CPUs", "cpu_rate", "1/s", bound=True
        ),
        URow("  bound: minimal Python handoff chain", "conns_floor", "1/s", bound=True),
        URow("  bound: minimal Python handoff chain, p50", "connect_floor", "us", bound=True),
        URow("  bound: its broker's CPU per connection", "floor_cpu", "us", bound=True),
        URow(
            "  bound: its client's + server's CPU per connection",
            "floor_apps_cpu",
            "us",
            bound=True,
        ),
        URow(f"connections/s, {concurrency} at a time", "conns_n", "1/s"),
        URow(
            f"memory, {idle:,} idle connections",
            "memory",
            "MiB",
            MIB,
            Check("<= 300 MiB, smcd + apps", at_most("memory", 300 * MIB)),
        ),
    ]
    return tuple(out)


def met(row: URow, res: UserResults, modes: Modes) -> str:
    """ "met" / "NOT met" from this run's figures; a row whose connections did not all get
    smcd is not met, whatever its figures (a fallback is TCP measured twice)."""
    if row.check is None:
        return ""
    mode = modes.get(row.key)
    ok = row.check.ok(res) and mode == SMCD
    text = "met" if ok else "NOT met"
    why = []
    if mode != SMCD:
        why.append("not on smcd")
    if row.check.limit is not None and (limit := row.check.limit(res)):
        why.append(limit)
    return f"{text} ({'; '.join(why)})" if why else text


def _ratio(s: float | None, t: float | None) -> str:
    return "n/a" if s is None or t is None or t == 0 else f"{s / t:.2f}x"


def short_mode(mode: str | None, width: int = 72) -> str:
    if mode is None:
        return "n/a"
    return mode if len(mode) <= width else mode[: width - 1] + "…"


def cells(table: tuple[URow, ...], res: UserResults, modes: Modes) -> list[tuple[str, ...]]:
    out: list[tuple[str, ...]] = [HEADER]
    for row in table:
        if row.bound:
            b = _get(res, "bound", row.key)
            out.append((row.label, row.unit, "-", format_number(b, row.scale), "-", "", "", ""))
            continue
        t, s = _get(res, "tcp", row.key), _get(res, "smc", row.key)
        target = row.check.text if row.check else ""
        out.append(
            (
                row.label,
                row.unit,
                format_number(t, row.scale),
                format_number(s, row.scale),
                _ratio(s, t),
                target,
                met(row, res, modes),
                short_mode(modes.get(row.key)),
            )
        )
    return out


def render(table: tuple[URow, ...], res: UserResults, modes: Modes) -> str:
    rows_ = cells(table, res, modes)
    widths = [max(len(r[i]) for r in rows_) for i in range(len(HEADER))]
    lines = []
    for n, r in enumerate(rows_):
        parts = [r[0].ljust(widths[0]), r[1].ljust(widths[1])]
        parts += [c.rjust(w) for c, w in zip(r[2:5], widths[2:5], strict=True)]
        parts += [r[5].ljust(widths[5]), r[6].ljust(widths[6]), r[7]]
        lines.append("  ".join(parts).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)
