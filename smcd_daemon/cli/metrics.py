"""``smcctl stats --openmetrics``: smcd's counters in the OpenMetrics text format.

For node-exporter's textfile collector (``smcctl stats --openmetrics > dir/smcd.prom.$$ && mv
dir/smcd.prom.$$ dir/smcd.prom`` from a timer) or any scraper: every family has ``# TYPE``,
``# HELP`` (and ``# UNIT`` for bytes), counters end in ``_total``, the text ends with ``# EOF``.
Fallbacks carry the reason's name as a label, so fallback rates can be graphed and alerted on
per reason (``rate(smcd_fallback_reasons_total{reason="SMC_CLC_DECL_NOUEID"}[5m])``). Gauges
come from the live objects: open connections by mode, link groups, links by state.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from smcd_daemon.adapters.dbus.names import (
    CONNECTION_INTERFACE,
    LINK_GROUP_INTERFACE,
    LINK_INTERFACE,
)

__all__ = ["openmetrics"]

_TECHS = ("smcd", "smcr")
_ROLES = ("server", "client")


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(labels: Mapping[str, object]) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels.items()) + "}"


class _Writer:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def family(
        self,
        name: str,
        kind: str,
        help_text: str,
        samples: Iterable[tuple[Mapping[str, object], int | float]],
        *,
        unit: str = "",
    ) -> None:
        self.lines.append(f"# TYPE {name} {kind}")
        if unit:
            self.lines.append(f"# UNIT {name} {unit}")
        self.lines.append(f"# HELP {name} {_escape(help_text)}")
        suffix = "_total" if kind == "counter" else ""
        for labels, value in samples:
            self.lines.append(f"{name}{suffix}{_labels(labels)} {value}")

    def text(self) -> str:
        return "\n".join([*self.lines, "# EOF"]) + "\n"


def openmetrics(
    counters: Mapping[str, int],
    fallbacks: Sequence[Sequence[int]],
    objects: Mapping[str, Mapping[str, Mapping[str, Any]]] | None = None,
) -> str:
    """The exposition for ``StatsGet``'s (counters, fallbacks) and, for the gauges,
    ``GetManagedObjects``'s objects."""
    from smcd_daemon.wire.reasons import explain

    w = _Writer()
    w.family(
        "smcd_connections",
        "counter",
        "Connections smcd handled to the end of their handshake (SMC or TCP fallback).",
        [({}, counters.get("connections.total", 0))],
    )
    w.family(
        "smcd_smc_connections",
        "counter",
        "Connections established over SMC, by technology, handshake role and SMC version.",
        [
            ({"tech": t, "role": r, "version": v}, counters.get(f"{t}.{r}.v{v}", 0))
            for t in _TECHS
            for r in _ROLES
            for v in (1, 2)
        ],
    )
    w.family(
        "smcd_handshake_errors",
        "counter",
        "CLC/LLC handshakes that failed after the technology was chosen.",
        [
            ({"tech": t, "role": r}, counters.get(f"{t}.{r}.handshake_errors", 0))
            for t in _TECHS
            for r in _ROLES
        ],
    )
    w.family(
        "smcd_payload_bytes",
        "counter",
        "Payload bytes moved over SMC, by technology and direction.",
        [
            ({"tech": t, "direction": d}, counters.get(f"{t}.{d}_bytes", 0))
            for t in _TECHS
            for d in ("tx", "rx")
        ],
        unit="bytes",
    )
    w.family(
        "smcd_payload_requests",
        "counter",
        "Send and receive requests that moved payload over SMC.",
        [
            ({"tech": t, "direction": d}, counters.get(f"{t}.{d}_calls", 0))
            for t in _TECHS
            for d in ("tx", "rx")
        ],
    )
    w.family(
        "smcd_fallbacks",
        "counter",
        "Connections that stayed on (or went back to) TCP, by handshake role.",
        [({"role": r}, counters.get(f"fallback.{r}", 0)) for r in _ROLES],
    )
    fb_samples: list[tuple[Mapping[str, object], int]] = []
    for code, as_server, as_client in fallbacks:
        name = explain(code).name or f"0x{code:08x}"
        for role, n in (("server", as_server), ("client", as_client)):
            fb_samples.append(({"role": role, "reason": name, "code": f"0x{code:08x}"}, n))
    w.family(
        "smcd_fallback_reasons",
        "counter",
        "Fallbacks to TCP by role and reason (the SMC_CLC_DECL_* name and its code).",
        fb_samples,
    )
    if objects is not None:
        modes: Counter[str] = Counter()
        link_states: Counter[str] = Counter()
        groups = 0
        for ifaces in objects.values():
            if CONNECTION_INTERFACE in ifaces:
                modes[str(_value(ifaces[CONNECTION_INTERFACE].get("Mode", "")))] += 1
            if LINK_INTERFACE in ifaces:
                link_states[str(_value(ifaces[LINK_INTERFACE].get("State", "")))] += 1
            if LINK_GROUP_INTERFACE in ifaces:
                groups += 1
        w.family(
            "smcd_open_connections",
            "gauge",
            "Connections smcd tracks now, by mode (SMCD, SMCR, TCP).",
            [({"mode": m}, modes.get(m, 0)) for m in sorted({"SMCD", "SMCR", "TCP", *modes})],
        )
        w.family("smcd_link_groups", "gauge", "SMC link groups now.", [({}, groups)])
        w.family(
            "smcd_links",
            "gauge",
            "SMC-R links now, by state.",
            [({"state": s}, n) for s, n in sorted(link_states.items())],
        )
    return w.text()


def _value(v: Any) -> Any:
    return getattr(v, "value", v)
