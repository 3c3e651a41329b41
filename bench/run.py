"""``make bench``: smcd loopback vs TCP loopback vs Unix stream sockets, between two Python
processes, in one table from one run.

    .venv/bin/python bench/run.py [--quick] [--json FILE]

A private smcd is started for the run (``smcd_daemon.demo.PrivateSmcd``: temporary runtime
dir, own handoff socket, private bus) and stopped at the end. For every metric the three kinds
run back to back (tcp, unix, smcd), so slow drift of the machine hits all of them alike. Sizes
and counts are fixed; every measurement warms up first; nothing here asserts a number: the exit
status is 0 when every figure was measured, 1 when something could not be (the table says
``n/a`` and a note says why). ``--quick`` shrinks every volume for the test suite's smoke run.

Right after the 64 KiB throughput of the three kinds, ``bench/ceiling.c`` (compiled now, see
``_ceiling``) measures the same transfer between two C processes over shared memory: the
ceiling row, what no receiver that reads its data can beat on this machine.

Then the user view (``userview``): unmodified stdlib programs on TCP and under ``smc-run``
against a second private smcd started with no configuration at all, in a table of its own with
issue 10's targets. ``--sections user`` runs only that part (``classic`` only the first).
Then the asyncio rows (``asyncio_rows``) and the two-namespace rows (``netns_bridge``, #15: two
container namespaces on a bridge, smcd vs TCP through the bridge; they need root, and without
it ``all`` says they were not measured while ``--sections netns`` fails).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, os.fspath(HERE))
sys.path.insert(1, os.fspath(HERE.parent))

import _ceiling  # noqa: E402
import _measure  # noqa: E402
import _usertable  # noqa: E402
from _pairs import KINDS, NotOnSmc  # noqa: E402
from _table import (  # noqa: E402
    CEILING,
    CONCURRENCY,
    HANDOFFS_PER_CONNECTION,
    ROWS,
    Results,
    ceiling_share,
    ceiling_summary,
    empty_results,
    render,
)
from asyncio_rows import (  # noqa: E402
    ASYNCIO_FULL,
    ASYNCIO_QUICK,
    print_asyncio_rows,
    run_asyncio_rows,
)
from netns_bridge import (  # noqa: E402
    NETNS_FULL,
    NETNS_QUICK,
    exit_on_sigterm,
    print_netns_rows,
    run_netns_rows,
)
from userview import CPUS, PLANS, USER_FULL, USER_QUICK, UserPlan, UserView  # noqa: E402

from smcd_daemon.demo import DaemonStartError, PrivateSmcd  # noqa: E402


@dataclass(frozen=True)
class Plan:
    """Every size and count of a run."""

    tput_64k_bytes: int
    tput_1m_bytes: int
    tput_warmup: int
    tput_repeats: int
    rtt_rounds: int
    rtt_warmup: int
    rtt_repeats: int
    setup_count: int
    setup_warmup: int
    setup_repeats: int


FULL = Plan(
    tput_64k_bytes=512 << 20,
    tput_1m_bytes=512 << 20,
    tput_warmup=64 << 20,
    tput_repeats=3,
    rtt_rounds=5_000,
    rtt_warmup=500,
    rtt_repeats=3,
    setup_count=500,
    setup_warmup=50,
    setup_repeats=3,
)
QUICK = Plan(
    tput_64k_bytes=64 << 20,
    tput_1m_bytes=64 << 20,
    tput_warmup=8 << 20,
    tput_repeats=1,
    rtt_rounds=1_000,
    rtt_warmup=100,
    rtt_repeats=1,
    setup_count=100,
    setup_warmup=10,
    setup_repeats=1,
)


CEILING_RING = _measure.BULK_DMB
CEILING_RBUF = _measure.RECV_BUF

DEFAULT_CONFIG = '[eid]\nueids = ["SMCD-BENCH"]\n'
"""Off IBM Z, SMC-Dv2 needs a UEID both ends share (``smcd_daemon.core.eid``); else defaults."""


def machine() -> str:
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return (
        f"{os.cpu_count()} CPUs ({cpu}), Linux {platform.release()}, "
        f"Python {platform.python_version()} ({platform.python_implementation()}), "
        f"load average {load}"
    )


class Bench:
    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.res: Results = empty_results(KINDS)
        self.notes: list[str] = []
        self.smcd_broken: str | None = None
        self.smcd_failed = False

    def each(self, keys: tuple[str, ...], fn: Callable[[str], tuple[float | None, ...]]) -> None:
        """Run ``fn(kind)`` for tcp, unix, smcd; store its values under ``keys``."""
        for kind in KINDS:
            if kind == "smcd" and self.smcd_broken:
                continue
            try:
                values = fn(kind)
            except NotOnSmc as e:
                self.smcd_failed = True
                if not any(v is not None for v in self.res["smcd"].values()):
                    self.smcd_broken = str(e)  # never worked: skip the rest
                    self.notes.append(f"smcd: no SMC channel, so no smcd figures: {e}")
                else:
                    self.notes.append(f"smcd {'/'.join(keys)}: a connection stayed on TCP: {e}")
                continue
            except (OSError, RuntimeError) as e:
                self.notes.append(f"{kind} {'/'.join(keys)}: {type(e).__name__}: {e}")
                continue
            for key, value in zip(keys, values, strict=True):
                self.res[kind][key] = value

    def run(self, progress: Callable[[str], None]) -> None:
        p = self.plan

        def tput(size: int, total: int) -> Callable[[str], tuple[float]]:
            def fn(kind: str) -> tuple[float]:
                runs = [
                    _measure.throughput(kind, size, total, p.tput_warmup)
                    for _ in range(p.tput_repeats)
                ]
                return (statistics.median(runs),)

            return fn

        progress("throughput, 64 KiB writes")
        self.each(("tput_64k",), tput(64 << 10, p.tput_64k_bytes))
        progress("ceiling: C shared-memory copy, 64 KiB writes")
        self.ceiling()
        progress("throughput, 1 MiB writes")
        self.each(("tput_1m",), tput(1 << 20, p.tput_1m_bytes))

        def rtt(size: int) -> Callable[[str], tuple[float, float]]:
            def fn(kind: str) -> tuple[float, float]:
                # each run on a fresh pair of processes (a new CPU placement): the median of
                # their percentiles, as throughput takes the median of its runs
                runs = [
                    _measure.pingpong(kind, size, p.rtt_rounds, p.rtt_warmup)
                    for _ in range(p.rtt_repeats)
                ]
                return (
                    statistics.median(r[0] for r in runs),
                    statistics.median(r[1] for r in runs),
                )

            return fn

        for size, name in ((1, "1b"), (1024, "1k")):
            progress(f"ping-pong, {name}")
            self.each((f"rtt_{name}_p50", f"rtt_{name}_p99"), rtt(size))
        progress("connection setup, one at a time")

        def setup1(kind: str) -> tuple[float | None, ...]:
            # each run a fresh pair of processes, as for the ping-pong: the median of each figure
            runs = [
                _measure.setup(kind, p.setup_count, p.setup_warmup) for _ in range(p.setup_repeats)
            ]
            med = statistics.median
            rate = med(r.rate for r in runs)
            handoff = (
                (med(r.handoff_p50_us for r in runs), med(r.handoff_p99_us for r in runs))
                if kind == "smcd"
                else (None, None)
            )
            # every smcd connection is two handoffs: the client's wrap and the server's
            handoffs = HANDOFFS_PER_CONNECTION * rate if kind == "smcd" else None
            connect = (med(r.connect_p50_us for r in runs), med(r.connect_p99_us for r in runs))
            return (*connect, *handoff, rate, handoffs)

        self.each(
            ("connect_p50", "connect_p99", "handoff_p50", "handoff_p99", "rate_1", "handoffs_1"),
            setup1,
        )
        progress(f"connection setup, {CONCURRENCY} at a time")

        def setup_n(kind: str) -> tuple[float | None, ...]:
            rate = statistics.median(
                _measure.setup_rate(kind, p.setup_count, p.setup_warmup, CONCURRENCY)
                for _ in range(p.setup_repeats)
            )
            return (rate, HANDOFFS_PER_CONNECTION * rate if kind == "smcd" else None)

        self.each(("rate_n", "handoffs_n"), setup_n)

    def ceiling(self) -> None:
        """The 64 KiB figure's transfer between two C processes: same writes, same ring
        (``BULK_DMB``), same read buffer (``RECV_BUF``), same volumes and repeats."""
        p = self.plan
        try:
            self.res[CEILING]["tput_64k"] = _ceiling.measure(
                ring=CEILING_RING,
                chunk=64 << 10,
                rbuf=CEILING_RBUF,
                volume=p.tput_64k_bytes,
                warmup=p.tput_warmup,
                repeats=p.tput_repeats,
            )
        except (_ceiling.CeilingError, OSError) as e:
            self.notes.append(f"ceiling: {e}")

    @property
    def complete(self) -> bool:
        return all(self.res[kind][row.key] is not None for row in ROWS for kind in row.kinds)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small volumes (the smoke test)")
    ap.add_argument("--json", metavar="FILE", help="also write the raw figures as JSON")
    ap.add_argument(
        "--smcd-config",
        metavar="FILE",
        help="configuration for the private smcd (TOML; default: a UEID, nothing else)",
    )
    ap.add_argument(
        "--sections",
        choices=("all", "classic", "user", "asyncio", "netns"),
        default="all",
        help="the classic table (explicit 1 MiB DMBs, a UEID), the user view, or both",
    )
    ap.add_argument(
        "--user-plan", choices=sorted(PLANS), help="the user view's sizes (default: by --quick)"
    )
    ap.add_argument(
        "--user-config",
        metavar="FILE",
        help="configuration for the user view's smcd (default: none, which is the point; for "
        "comparing settings by hand)",
    )
    args = ap.parse_args(argv)
    plan = QUICK if args.quick else FULL
    user_plan = PLANS[args.user_plan] if args.user_plan else USER_QUICK if args.quick else USER_FULL
    user_config = Path(args.user_config).read_text() if args.user_config else ""
    started = time.monotonic()
    host = machine()  # before we load the machine ourselves

    def progress(what: str) -> None:
        print(f"  [{time.monotonic() - started:5.1f} s] {what}", file=sys.stderr, flush=True)

    bench = Bench(plan)
    config = Path(args.smcd_config).read_text() if args.smcd_config else DEFAULT_CONFIG
    classic = args.sections in ("all", "classic")
    if classic:
        run_classic(bench, config, progress)
    user = None
    if args.sections in ("all", "user"):
        user = run_user_view(user_plan, bench.res[CEILING]["tput_64k"], progress, user_config)
    aio = None
    if args.sections in ("all", "asyncio"):
        aio = run_asyncio_rows(ASYNCIO_QUICK if args.quick else ASYNCIO_FULL, progress)
    netns = None
    if args.sections in ("all", "netns"):
        netns = run_netns_rows(NETNS_QUICK if args.quick else NETNS_FULL, progress)
    took = time.monotonic() - started

    print(f"smcd benchmark{' (--quick)' if args.quick else ''}: two Python processes per figure")
    print(f"machine: {host}")
    if classic:
        print_classic(bench, plan)
    if user is not None:
        print_user_view(user)
    if aio is not None:
        print_asyncio_rows(aio)
    if netns is not None:
        print_netns_rows(netns)
    print(f"run time {took:.0f} s")
    if args.json:
        write_json(Path(args.json), bench, plan, user)
    done = (not classic or bench.complete) and (user is None or user_complete(user))
    done = done and (aio is None or aio.complete)
    # without root, "all" says the two-namespace rows were not measured; asked for, they fail
    netns_ok = netns is None or netns.complete or (netns.skipped and args.sections == "all")
    done = done and bool(netns_ok)
    return 0 if done else 1


def run_classic(bench: Bench, config: str, progress: Callable[[str], None]) -> None:
    """The classic table against a private smcd with ``config`` (a UEID by default)."""
    daemon = PrivateSmcd(log_level="warning", config_text=config)
    try:
        try:
            daemon.start()
            os.environ.update(daemon.env)  # inherited by the forked processes: our daemon only
        except DaemonStartError as e:
            bench.smcd_broken = str(e)
            bench.notes.append(f"smcd: the private daemon did not start: {e}")
        bench.run(progress)
        status = daemon.stop()
        if status not in (0, None):
            bench.notes.append(f"smcd exited with status {status} on SIGTERM")
        if bench.smcd_failed or status not in (0, None):
            tail = [line for line in daemon.log().splitlines() if "TIMING" not in line][-20:]
            bench.notes.append("the private smcd's log ends with:\n    " + "\n    ".join(tail))
    finally:
        daemon.cleanup()


def run_user_view(
    plan: UserPlan, ceiling: float | None, progress: Callable[[str], None], config: str = ""
) -> UserView:
    """The user view against a private smcd with no configuration file (its own daemon, started
    after the classic one stopped, so the two never share the machine). ``config``: TOML for
    comparing settings by hand; the table then says so."""
    daemon = PrivateSmcd(log_level="warning", config_text=config, name="bench-user")
    view = UserView(plan, daemon.env, None)
    if config:
        view.notes.append(f"user view: smcd configured with {config.strip()!r}, not the defaults")
    try:
        try:
            daemon.start()
        except DaemonStartError as e:
            view.notes.append(f"user view: the private smcd did not start: {e}")
            return view
        assert daemon.proc is not None
        view.smcd_pid = daemon.proc.pid
        if ceiling is None:  # the classic section did not run: the bulk rows need the bound
            try:
                ceiling = _ceiling.measure(
                    ring=CEILING_RING,
                    chunk=plan.write,
                    rbuf=CEILING_RBUF,
                    volume=plan.bulk_bytes,
                    warmup=plan.bulk_warmup,
                    repeats=plan.repeats,
                )
            except (_ceiling.CeilingError, OSError) as e:
                view.notes.append(f"ceiling: {e}")
        view.run(progress, ceiling)
        status = daemon.stop()
        if status not in (0, None):
            view.notes.append(f"user view: smcd exited with status {status} on SIGTERM")
    finally:
        daemon.cleanup()
    return view


def user_rows(plan: UserPlan) -> tuple[_usertable.URow, ...]:
    return _usertable.rows(plan.idle, plan.concurrency, plan.stride, CPUS)


def user_complete(view: UserView) -> bool:
    for row in user_rows(view.plan):
        kinds = ("bound",) if row.bound else ("tcp", "smc")
        if any(view.res[k].get(row.key) is None for k in kinds):
            return False
    return True


def print_user_view(view: UserView) -> None:
    p = view.plan
    print()
    print(
        "user view: the same stdlib program (bench/user_app.py, plain socket) on TCP loopback "
        "and under smc-run, smcd with NO configuration (embedded defaults)"
    )
    print(
        f"sizes: bulk {p.bulk_bytes >> 20} MiB in {p.write >> 10} KiB sendall()s, recv_into "
        f"{p.recv >> 10} KiB; round trips {p.rr_rounds:,} after {p.rr_warmup:,}; "
        f"{p.conns:,} connections after {p.conns_warmup:,}; medians of {p.repeats} runs, "
        "fresh processes each"
    )
    print()
    print(_usertable.render(user_rows(p), view.res, view.modes))
    print()
    if view.memory_detail:
        parts = [
            f"{who} {pss / 2**20:.1f}/{rss / 2**20:.1f}"
            for who, (pss, rss) in sorted(view.memory_detail.items())
        ]
        print("memory PSS/RSS MiB of the last run: " + ", ".join(parts))
    print(
        "mode = the transport smc-run -v reported for every connection of the row; a row not on "
        "smcd is NOT met whatever its figures"
    )
    for line in view.mode_notes():
        print(line)
    for note in view.notes:
        print(f"note: {note}")


def print_classic(bench: Bench, plan: Plan) -> None:
    print(
        f"sizes: throughput {plan.tput_64k_bytes >> 20} MiB per run (median of "
        f"{plan.tput_repeats}), ping-pong {plan.rtt_rounds:,} rounds per run (median of "
        f"{plan.rtt_repeats}), "
        f"{plan.setup_count:,} connections per run (median of {plan.setup_repeats}); all after "
        "warm-up"
    )
    print()
    print(render(bench.res))
    print()
    print(ceiling_summary(bench.res))
    print(
        "ratios are smcd/baseline (throughput, connections/s: higher is better; times: lower "
        "is better); connect (+handoff) = TCP connect, Unix connect, or TCP connect + "
        "smc_handoff.wrap; a connection = connect, 1-byte echo, close"
    )
    for note in bench.notes:
        print(f"note: {note}")


def write_json(path: Path, bench: Bench, plan: Plan, user: UserView | None) -> None:
    data: dict[str, object] = {
        "machine": machine(),
        "plan": plan.__dict__,
        "results": bench.res,
        "ceiling": {
            "source": "bench/ceiling.c",
            "ring": CEILING_RING,
            "write": 64 << 10,
            "read_buffer": CEILING_RBUF,
            "smcd_share_64k": ceiling_share(bench.res),
        },
    }
    if user is not None:
        data["user_view"] = {
            "plan": user.plan.__dict__,
            "results": user.res,
            "modes": user.modes,
            "memory_pss_rss": user.memory_detail,
            "met": {
                row.key: _usertable.met(row, user.res, user.modes)
                for row in user_rows(user.plan)
                if row.check is not None
            },
        }
    path.write_text(json.dumps(data, indent=2) + "\n")


if __name__ == "__main__":
    exit_on_sigterm()
    sys.exit(main())
