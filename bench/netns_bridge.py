"""``make bench``'s two-namespace rows (#15): two containers of one host, joined by a bridge, smcd
(one daemon for every namespace) vs the same programs on TCP through the bridge.

    sudo .venv/bin/python bench/netns_bridge.py [--repeats N] [--quick]
    sudo .venv/bin/python bench/run.py --sections netns      (the same rows, from make bench)

Namespaces: a router ``r`` holding a Linux bridge (198.51.100.1/24) and two "containers" ``a``
(198.51.100.2) and ``b`` (198.51.100.3) on veth ports of it. ``bench/user_app.py`` (stdlib only)
serves in ``b`` on the wildcard address and its client runs in ``a``, as they are (TCP through the
bridge) and under ``smc-run -v`` against a private smcd in the host's namespace (embedded
defaults; its handoff socket reached by path, as a bind mount gives a container), and for
comparison as they are on TCP loopback in the host's namespace (the issue expects the ratio to
TCP to be larger through a bridge than on loopback). Each figure is
the median of ``repeats`` fresh process pairs, the three back to back; each row says what its
connections got. Making namespaces needs root: without it the rows are not measured and say so.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, os.fspath(Path(__file__).resolve().parent))
sys.path.insert(1, os.fspath(Path(__file__).resolve().parents[1]))

from _table import format_cell
from userview import APP, App, mode_text, smc_run

PREFIX = f"smcdbench{os.getpid() % 1000}"
KINDS = ("lo", "tcp", "smc")
"""TCP loopback in the host's namespace (the baseline the bridge is compared with), TCP through
the bridge, smcd between the two namespaces."""


@dataclass(frozen=True)
class NetnsPlan:
    """Every size and count of the two-namespace rows."""

    bulk_bytes: int
    bulk_warmup: int
    rr1_rounds: int
    rr1_warmup: int
    rr64_rounds: int
    rr64_warmup: int
    repeats: int


NETNS_FULL = NetnsPlan(256 << 20, 16 << 20, 20_000, 2_000, 3_000, 300, 3)
NETNS_QUICK = NetnsPlan(8 << 20, 1 << 20, 200, 20, 100, 10, 1)


@dataclass(frozen=True)
class Row:
    key: str
    label: str
    unit: str
    better: str  # "higher" or "lower"


ROWS = (
    Row("bulk", "bulk, 64 KiB writes", "GB/s", "higher"),
    Row("rr_1b_p50", "round trip 1 B, p50", "us", "lower"),
    Row("rr_64k_p50", "round trip 64 KiB, p50", "us", "lower"),
)


def exit_on_sigterm() -> None:
    """SIGTERM (a CI job stopped, ``timeout``) ends the run as an exception does: the
    ``finally`` blocks remove the namespaces and stop the private smcd, which the default
    action (death on the spot) left behind."""
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))


def sh(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, timeout=20)


def build() -> dict[str, str]:
    ns = {k: f"{PREFIX}{k}" for k in "rab"}
    try:
        for name in ns.values():
            sh("ip", "netns", "add", name)
            sh("ip", "-n", name, "link", "set", "lo", "up")
        r = ns["r"]
        sh("ip", "-n", r, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", r, "addr", "add", "198.51.100.1/24", "dev", "br0")
        sh("ip", "-n", r, "link", "set", "br0", "up")
        for k, addr in (("a", "198.51.100.2"), ("b", "198.51.100.3")):
            sh("ip", "link", "add", f"br{k}", "netns", r, "type", "veth", "peer", "name", "eth0",
               "netns", ns[k])  # fmt: skip
            sh("ip", "-n", r, "link", "set", f"br{k}", "master", "br0", "up")
            sh("ip", "-n", ns[k], "addr", "add", f"{addr}/24", "dev", "eth0")
            sh("ip", "-n", ns[k], "link", "set", "eth0", "up")
    except BaseException:
        teardown(ns)
        raise
    return ns


def teardown(ns: dict[str, str]) -> None:
    for name in ns.values():
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


class NsApp(App):
    """A ``user_app.py`` run inside a namespace (``ip netns exec`` in front of the command)."""

    def __init__(self, ns: str, kind: str, env: dict[str, str], args: list[object]) -> None:
        run = [*smc_run(), "-v"] if kind == "smc" else [sys.executable]
        cmd = ["ip", "netns", "exec", ns, *run, os.fspath(APP), *map(str, args)]
        self.err = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (closed by the harness)
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err, env=env,
            text=True, start_new_session=True,
        )  # fmt: skip
        self.what = " ".join(cmd[-len(args) - 1 :])


def run_pair(ns: dict[str, str], kind: str, env: dict[str, str], server: list[object],
             client: list[object]) -> tuple[dict[str, float], Counter[str]]:  # fmt: skip
    """One server in ``b`` and its client in ``a`` (``lo``: both on loopback in the host's
    namespace, plain TCP)."""
    srv: App
    if kind == "lo":
        srv = App("tcp", env, server)
    else:
        srv = NsApp(ns["b"], kind, {**env, "USER_APP_BIND": "0.0.0.0"}, server)
    try:
        port = srv.port()
        args: list[object] = [*client[:1], port, *client[1:]]
        if kind == "lo":
            cli: App = App("tcp", env, args)
        else:
            cli = NsApp(ns["a"], kind, {**env, "USER_APP_PEER": "198.51.100.3"}, args)
        result = cli.result()
        modes = cli.modes() + srv.modes()
    finally:
        srv.kill()
    return result, modes


@dataclass
class NetnsRows:
    """The figures of one run: per row and kind, one value per repeat; what each row's smcd
    connections got; why something was not measured."""

    plan: NetnsPlan
    figures: dict[tuple[str, str], list[float]] = field(default_factory=dict)
    modes: dict[str, Counter[str]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    skipped: str = ""

    def value(self, key: str, kind: str) -> float | None:
        got = self.figures.get((key, kind))
        return statistics.median(got) if got else None

    @property
    def complete(self) -> bool:
        return all(self.value(r.key, k) is not None for r in ROWS for k in KINDS)

    def tests(self) -> list[tuple[str, list[object], list[object], str, float]]:
        p = self.plan
        return [
            ("bulk", ["sink", p.bulk_warmup, p.bulk_bytes, 1 << 20],
             ["send", p.bulk_warmup, p.bulk_bytes, 64 << 10], "bytes_per_s", 1e-9),
            ("rr_1b_p50", ["echo", 1], ["rr", 1, p.rr1_rounds, p.rr1_warmup], "p50_us", 1.0),
            ("rr_64k_p50", ["echo", 1], ["rr", 65536, p.rr64_rounds, p.rr64_warmup],
             "p50_us", 1.0),
        ]  # fmt: skip


def why_not() -> str:
    """Why this machine cannot make the namespaces ("" if it can)."""
    if os.geteuid() != 0:
        return "making network namespaces, veth pairs and a bridge needs root"
    if shutil.which("ip") is None:
        return "iproute2 (ip) is missing: install it with tests/host/install-deps.sh"
    return ""


def run_netns_rows(plan: NetnsPlan, progress: Callable[[str], None]) -> NetnsRows:
    """The rows against a private smcd of their own (started and stopped here)."""
    from smcd_daemon.demo import DaemonStartError, PrivateSmcd

    rows = NetnsRows(plan)
    rows.skipped = why_not()
    if rows.skipped:
        return rows
    base = {k: v for k, v in os.environ.items() if not k.startswith("SMCD_")}
    base["PYTHONPATH"] = os.fspath(Path(__file__).resolve().parents[1])
    daemon = PrivateSmcd(log_level="warning", name="bench-netns")
    ns: dict[str, str] | None = None
    try:
        try:
            daemon.start()
            ns = build()
        except (DaemonStartError, subprocess.CalledProcessError, OSError) as e:
            rows.notes.append(f"two-namespace rows: set-up failed: {e}")
            return rows
        envs = {"lo": base, "tcp": base, "smc": {**base, **daemon.env}}
        for i in range(plan.repeats):
            for key, server, client, field_, scale in rows.tests():
                for kind in KINDS:
                    progress(f"netns {key} {kind} ({i + 1}/{plan.repeats})")
                    try:
                        res, got = run_pair(ns, kind, envs[kind], server, client)
                    except RuntimeError as e:
                        rows.notes.append(f"two-namespace rows: {key} on {kind}: {e}")
                        continue
                    rows.figures.setdefault((key, kind), []).append(res[field_] * scale)
                    if kind == "smc":
                        rows.modes.setdefault(key, Counter()).update(got)
        status = daemon.stop()
        if status not in (0, None):
            rows.notes.append(f"two-namespace rows: smcd exited with status {status} on SIGTERM")
    finally:
        if ns is not None:
            teardown(ns)
        daemon.cleanup()
    return rows


def render(rows: NetnsRows) -> str:
    head = ("metric", "unit", "tcp-lo", "tcp-bridge", "smc-run", "smc/bridge", "smc/lo",
            "better", "mode")  # fmt: skip
    table: list[tuple[str, ...]] = [head]
    for row in ROWS:
        lo, tcp, smc = (rows.value(row.key, k) for k in KINDS)
        ratios = [f"{smc / b:.2f}x" if b and smc is not None else "n/a" for b in (tcp, lo)]
        modes = rows.modes.get(row.key)
        table.append((row.label, row.unit, *(format_cell(v, row.unit) for v in (lo, tcp, smc)),
                      *ratios, row.better, mode_text(modes) if modes else "n/a"))  # fmt: skip
    widths = [max(len(r[i]) for r in table) for i in range(len(head))]
    lines = []
    for i, r in enumerate(table):
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def print_netns_rows(rows: NetnsRows) -> None:
    p = rows.plan
    print()
    print(
        "two namespaces on a bridge (#15): the stdlib program (bench/user_app.py) in container "
        "namespaces a and b, TCP through the bridge vs smc-run against one smcd in the host's "
        "namespace (no configuration), and TCP loopback for comparison"
    )
    if rows.skipped:
        print(f"not measured: {rows.skipped}")
        return
    print(
        f"sizes: bulk {p.bulk_bytes >> 20} MiB in 64 KiB sendall()s after {p.bulk_warmup >> 20} "
        f"MiB; round trips {p.rr1_rounds:,} at 1 B and {p.rr64_rounds:,} at 64 KiB after "
        f"{p.rr1_warmup:,}/{p.rr64_warmup:,}; medians of {p.repeats} runs, fresh processes each"
    )
    print()
    print(render(rows))
    print()
    print(
        "tcp-lo: the same programs on TCP loopback in the host's namespace; smc/bridge, smc/lo: "
        "smcd's figure over TCP's (better: which way is better); mode = what smc-run -v "
        "reported for every smcd connection of the row"
    )
    for note in rows.notes:
        print(f"note: {note}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=None, help="runs per figure (default: 3)")
    ap.add_argument("--quick", action="store_true", help="small volumes, one run")
    args = ap.parse_args(argv)
    plan = NETNS_QUICK if args.quick else NETNS_FULL
    if args.repeats is not None:
        plan = NetnsPlan(**{**plan.__dict__, "repeats": args.repeats})
    started = time.monotonic()

    def progress(what: str) -> None:
        print(f"  [{time.monotonic() - started:5.1f} s] {what}", file=sys.stderr, flush=True)

    rows = run_netns_rows(plan, progress)
    print_netns_rows(rows)
    return 0 if rows.complete else 1


if __name__ == "__main__":
    exit_on_sigterm()
    sys.exit(main())
