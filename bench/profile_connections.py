"""Where a connection's setup goes, per process: the countable view of issue 10's rate.

    .venv/bin/python bench/profile_connections.py [--connections N] [--warmup W] [--top K]

The connection-rate rows of ``make bench`` vary ±15 % between identical runs on this machine,
which hides any single step of a few per cent. This tool adds what does not vary: the Python
calls each process makes per connection. It runs the user view's connection loop
(``bench/user_app.py``: connect, 1-byte echo, close, one at a time, under ``smc-run`` against a
private smcd with no configuration) twice:

1. as it is: the rate, the setup p50 and each process's CPU time per connection (smcd and the
   echo server from ``schedstat``; the client from its ``rusage``, start-up included);
2. under ``cProfile`` (``bench/_profiled.py``), counting only the N connections after the
   warm-up in all three processes: calls per connection, and the top K functions of each by
   calls and by own CPU time (the thread's CPU clock, so a blocking call counts the CPU it
   used, not its wait; the profiler roughly doubles the time of Python code).

Cut the calls, then confirm with ``make bench``'s rows.
"""

from __future__ import annotations

import argparse
import json
import os
import pstats
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, os.fspath(HERE))
sys.path.insert(1, os.fspath(HERE.parent))

from userview import APP, cpu_ns, port_of, smc_run, user_env  # noqa: E402

from smcd_daemon.demo import PrivateSmcd  # noqa: E402

PROFILED = HERE / "_profiled.py"
ROLES = ("smcd", "client", "server")


def _server(cmd: list[str], env: dict[str, str]) -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, env=env, text=True, start_new_session=True)
    assert proc.stdout is not None
    first = proc.stdout.readline()
    port = port_of(first)
    if port is None:
        proc.kill()
        raise RuntimeError(f"the echo server said {first!r}, not PORT n")
    return proc, port


def _stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def plain(n: int, warmup: int) -> dict[str, float]:
    """The loop as ``make bench`` runs it: rate, setup p50, CPU per connection."""
    daemon = PrivateSmcd(log_level="warning", name="prof-plain").start()
    try:
        env = user_env(daemon.env)
        assert daemon.proc is not None
        server, port = _server([*smc_run(), os.fspath(APP), "echo", "1"], env)
        try:
            smcd0, server0 = cpu_ns(daemon.proc.pid), cpu_ns(server.pid)
            client = subprocess.Popen(
                [*smc_run(), os.fspath(APP), "conns", str(port), str(n), str(warmup), "1"],
                stdout=subprocess.PIPE, env=env, text=True,
            )  # fmt: skip
            assert client.stdout is not None
            out = client.stdout.read()
            _, status, usage = os.wait4(client.pid, 0)
            client.returncode = os.waitstatus_to_exitcode(status)
            if client.returncode:
                raise RuntimeError(f"the client failed (status {client.returncode})")
            total = n + warmup
            smcd_us = (cpu_ns(daemon.proc.pid) - smcd0) / total / 1e3
            server_us = (cpu_ns(server.pid) - server0) / total / 1e3
        finally:
            _stop(server)
    finally:
        daemon.cleanup()
    res = json.loads(out.strip().splitlines()[-1])
    return {
        "rate": res["rate"],
        "p50_us": res["connect_p50_us"],
        "smcd": smcd_us,
        "server": server_us,
        "client": (usage.ru_utime + usage.ru_stime) / total * 1e6,
    }


def profiled(n: int, warmup: int, outdir: Path) -> dict[str, pstats.Stats]:
    """The same loop with every process under cProfile for the N connections after the
    warm-up: the statistics of each."""
    py = sys.executable
    outs = {role: outdir / f"{role}.prof" for role in ROLES}
    daemon = PrivateSmcd(
        log_level="warning",
        name="prof",
        command=(py, os.fspath(PROFILED), os.fspath(outs["smcd"]), "--entry",
                 "smcd_daemon.daemon:main"),
    )  # fmt: skip
    daemon.start()
    try:
        env = user_env(daemon.env)
        assert daemon.proc is not None
        server, port = _server(
            [*smc_run(), os.fspath(PROFILED), os.fspath(outs["server"]), "--script",
             os.fspath(APP), "echo", "1"],
            env,
        )  # fmt: skip
        try:
            # The client warms up unprofiled, then waits while the others start counting.
            client = subprocess.Popen(
                [*smc_run(), os.fspath(PROFILED), os.fspath(outs["client"]), "--conns",
                 str(port), str(n), str(warmup)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True,
            )  # fmt: skip
            assert client.stdin is not None and client.stdout is not None
            if client.stdout.readline().strip() != "WARM":
                raise RuntimeError("the profiled client did not finish its warm-up")
            for pid in (daemon.proc.pid, server.pid):
                os.kill(pid, signal.SIGUSR1)
            time.sleep(0.2)  # the signals are handled (an idle loop wakes up for them)
            client.stdin.write("go\n")
            client.stdin.flush()
            if client.wait(timeout=600):
                raise RuntimeError(f"the profiled client failed (status {client.returncode})")
            for pid in (daemon.proc.pid, server.pid):
                os.kill(pid, signal.SIGUSR2)
            deadline = time.monotonic() + 30
            while not all(p.exists() for p in outs.values()) and time.monotonic() < deadline:
                time.sleep(0.1)
        finally:
            _stop(server)
    finally:
        daemon.cleanup()
    return {role: pstats.Stats(os.fspath(path)) for role, path in outs.items()}


def _calls(stats: pstats.Stats) -> int:
    return sum(v[1] for v in stats.stats.values())  # type: ignore[attr-defined]


def _label(func: tuple[str, int, str]) -> str:
    path, line, name = func
    for root in (os.fspath(HERE.parent) + "/", os.path.dirname(os.__file__) + "/"):
        path = path.removeprefix(root)
    return f"{name} ({path}:{line})" if path != "~" else name


def top(stats: pstats.Stats, n: int, k: int, key: int) -> list[tuple[float, float, str]]:
    """The K functions with the most calls (``key`` 1) or own CPU time (``key`` 2) per
    connection."""
    rows = [
        (v[1] / n, v[2] / n * 1e6, _label(func))
        for func, v in stats.stats.items()  # type: ignore[attr-defined]
    ]
    rows.sort(key=lambda r: -r[key - 1])
    return rows[:k]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--connections", type=int, default=1500, help="profiled connections")
    ap.add_argument("--warmup", type=int, default=50, help="connections before counting")
    ap.add_argument("--top", type=int, default=12, help="functions listed per process")
    ap.add_argument("--keep", metavar="DIR", help="keep the profiles there (ROLE.prof)")
    args = ap.parse_args(argv)
    n, warmup = args.connections, args.warmup
    print(f"{n} connections after {warmup} (connect, 1-byte echo, close; one at a time; "
          "smc-run, smcd with no configuration)", flush=True)  # fmt: skip
    base = plain(n, warmup)
    print(f"as it is: {base['rate']:,.0f} connections/s, setup p50 {base['p50_us']:,.0f} us")
    if args.keep:
        Path(args.keep).mkdir(parents=True, exist_ok=True)
        stats = profiled(n, warmup, Path(args.keep))
    else:
        with tempfile.TemporaryDirectory(prefix="smcd-prof-") as tmp:
            stats = profiled(n, warmup, Path(tmp))
    print()
    print(f"{'per connection':<26}" + "".join(f"{r:>10}" for r in ROLES))
    print(f"{'CPU, as it is (us)':<26}" + "".join(f"{base[r]:>10,.0f}" for r in ROLES))
    print(f"{'Python calls, profiled':<26}" + "".join(f"{_calls(stats[r]) / n:>10,.0f}"
                                                   for r in ROLES))  # fmt: skip
    print(
        "(the client's CPU includes its interpreter's start-up; the calls are those of the "
        "N connections after the warm-up)"
    )
    for role in ROLES:
        for key, what in ((1, "calls"), (2, "own CPU time")):
            print(f"\n{role}: top {args.top} by {what} per connection")
            print(f"{'calls':>8} {'CPU us':>8}  function")
            for calls, own, label in top(stats[role], n, args.top, key):
                print(f"{calls:>8.1f} {own:>8.1f}  {label}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
