"""One connection's steps across smcd, the client and the server, from their system calls.

    .venv/bin/python bench/timeline_connections.py [--connections N] [--seconds S] [--dump K]

The connection-rate rows of ``make bench`` say how many connections a second the chain of three
processes completes; ``bench/profile_connections.py`` says how much work each process does.
Neither says where in the chain a connection waits. This tool runs the user view's connection
loop (``bench/user_app.py``: connect, 1-byte echo, close, one at a time, under ``smc-run``
against a private smcd with no configuration), records the three processes' system calls with
``perf record -e raw_syscalls:sys_enter/sys_exit`` (filtered to the socket, accept, send,
receive, close, map and poll calls) for S seconds, and prints, per connection (from the client's
TCP ``socket()``), the median time of each step: the TCP connect, each request sent and read,
the Proposal, both replies sent and read, each application's close. ``--dump K`` prints the
K-th connection's calls in order, one column per process.

Tracing costs a few µs per call, so a connection's wall grows by some hundred µs; the order of
the steps and the gaps in smcd are what it is for. Needs ``perf`` (Debian: ``linux-perf``) and
root.
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, os.fspath(HERE))
sys.path.insert(1, os.fspath(HERE.parent))

from userview import APP, port_of, smc_run, user_env  # noqa: E402

SYSCALLS = {
    41: "socket", 42: "connect", 288: "accept4", 46: "sendmsg", 47: "recvmsg", 44: "sendto",
    45: "recvfrom", 3: "close", 1: "write", 0: "read", 232: "epoll_wait", 7: "poll",
    11: "munmap", 9: "mmap",
}  # fmt: skip
"""x86-64 system call numbers traced, and their names."""
_LINE = re.compile(r"^\s*(\d+)\s+([\d.]+):\s+raw_syscalls:sys_(enter|exit):\s+NR (\d+) (.*)")
_AF_INET = "(2,"

Event = tuple[float, str, str, str, str]
"""(µs, role C/S/D, "enter"/"exit", call name, arguments or "= result")."""


def parse(text: str, roles: dict[int, str]) -> list[Event]:
    """``perf script -F tid,time,event,trace`` output → the events of the processes in
    ``roles`` (tid → C, S or D), in time order."""
    events = []
    for line in text.splitlines():
        m = _LINE.match(line)
        if m is None or int(m[1]) not in roles:
            continue
        name = SYSCALLS.get(int(m[4]), m[4])
        events.append((float(m[2]) * 1e6, roles[int(m[1])], m[3], name, m[5]))
    events.sort()
    return events


def connections(events: list[Event]) -> list[list[Event]]:
    """The events cut at each client ``socket(AF_INET, …)``, times from that call."""
    starts = [
        i
        for i, (_t, role, kind, name, rest) in enumerate(events)
        if role == "C" and kind == "enter" and name == "socket" and rest.startswith(_AF_INET)
    ]
    out = []
    for a, b in itertools.pairwise(starts):
        t0 = events[a][0]
        out.append([(t - t0, r, k, n, rest) for t, r, k, n, rest in events[a : b + 1]])
    return out


def _first(seg: list[Event], role: str, kind: str, name: str, after: float = 0.0,
           ok: bool = False) -> float | None:  # fmt: skip
    for t, r, k, n, rest in seg:
        if r == role and k == kind and n == name and t >= after:
            if ok and (rest.startswith("= -") or rest.strip() == "= 0"):
                continue  # a failed call, or a hang-up's empty read
            return t
    return None


def steps(seg: list[Event]) -> dict[str, float] | None:
    """The chain's steps in one connection (µs from its start), None when one is missing."""
    s: dict[str, float | None] = {}
    s["client: TCP connected"] = _first(seg, "C", "exit", "connect")
    s["client: CONNECT sent"] = _first(seg, "C", "enter", "sendmsg")
    s["server: accept() returned"] = _first(seg, "S", "exit", "accept4", ok=True)
    s["server: ACCEPT sent"] = _first(seg, "S", "enter", "sendmsg")
    first = s["smcd: first request read"] = _first(seg, "D", "exit", "recvmsg", ok=True)
    s["smcd: second request read"] = _first(seg, "D", "exit", "recvmsg", (first or 0) + 0.5, True)
    s["smcd: CLC Proposal sent"] = _first(seg, "D", "enter", "sendto")
    reply = s["smcd: first reply sent"] = _first(seg, "D", "enter", "sendmsg")
    s["smcd: second reply sent"] = _first(seg, "D", "enter", "sendmsg", (reply or 0) + 0.5)
    s_read = s["server: reply read"] = _first(seg, "S", "exit", "recvmsg")
    c_read = s["client: reply read"] = _first(seg, "C", "exit", "recvmsg")
    s["client: close() began"] = _first(seg, "C", "enter", "close", (c_read or 0) + 30)
    s["server: close() began"] = _first(seg, "S", "enter", "close", (s_read or 0) + 30)
    s["next connection"] = seg[-1][0]
    if any(v is None for v in s.values()):
        return None
    return {k: v for k, v in s.items() if v is not None}


def medians(segs: Iterable[list[Event]]) -> tuple[int, list[tuple[float, str]]]:
    """How many connections had every step, and each step's median, in time order."""
    got: dict[str, list[float]] = {}
    n = 0
    for seg in segs:
        one = steps(seg)
        if one is None:
            continue
        n += 1
        for k, v in one.items():
            got.setdefault(k, []).append(v)
    return n, sorted((statistics.median(v), k) for k, v in got.items())


def record(connections_n: int, seconds: float, data: Path) -> tuple[dict[int, str], str]:
    """Run the loop and ``perf record`` its three processes; (roles by tid, the client's
    JSON line)."""
    from smcd_daemon.demo import PrivateSmcd

    flt = " || ".join(f"id == {i}" for i in SYSCALLS)
    daemon = PrivateSmcd(log_level="warning", name="timeline")
    daemon.start()
    try:
        env = user_env(daemon.env)
        server = subprocess.Popen([*smc_run(), os.fspath(APP), "echo", "1"],
                                  stdout=subprocess.PIPE, env=env, text=True,
                                  start_new_session=True)  # fmt: skip
        try:
            assert server.stdout is not None
            port = port_of(server.stdout.readline())
            if port is None:
                raise RuntimeError("the echo server did not say its port")
            client = subprocess.Popen(
                [*smc_run(), os.fspath(APP), "conns", str(port), str(connections_n), "100", "1"],
                stdout=subprocess.PIPE, env=env, text=True,
            )  # fmt: skip
            time.sleep(1.0)  # past the warm-up; the loop runs in the client's one worker
            kids = Path(f"/proc/{client.pid}/task/{client.pid}/children").read_text().split()
            assert daemon.proc is not None
            roles = {
                daemon.proc.pid: "D",
                server.pid: "S",
                int(kids[0]) if kids else client.pid: "C",
            }
            subprocess.run(
                ["perf", "record", "-q", "-e", "raw_syscalls:sys_enter", "--filter", flt,
                 "-e", "raw_syscalls:sys_exit", "--filter", flt,
                 "-p", ",".join(map(str, roles)), "-o", os.fspath(data), "--",
                 "sleep", str(seconds)],
                check=True, stderr=subprocess.DEVNULL,
            )  # fmt: skip
            line = client.communicate()[0].strip().splitlines()[-1:]
        finally:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
    finally:
        daemon.cleanup()
    return roles, line[0] if line else ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--connections", type=int, default=4000, help="the loop's length (default 4000)"
    )
    ap.add_argument(
        "--seconds", type=float, default=0.4, help="how long perf records (default 0.4)"
    )
    ap.add_argument("--dump", type=int, metavar="K", help="print the K-th connection's calls")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="smcd-timeline-") as tmp:
        data = Path(tmp) / "perf.data"
        roles, figures = record(args.connections, args.seconds, data)
        text = subprocess.run(["perf", "script", "-i", os.fspath(data), "-F",
                               "tid,time,event,trace"], capture_output=True, text=True,
                              check=True).stdout  # fmt: skip
    segs = connections(parse(text, roles))
    n, rows = medians(segs)
    print(f"the loop under tracing: {figures}")
    print(
        f"{n} of {len(segs)} connections had every step; medians in us from the client's socket()"
    )
    for t, k in rows:
        print(f"{t:8.1f}  {k}")
    if args.dump is not None and 0 <= args.dump < len(segs):
        print()
        for t, r, kind, name, rest in segs[args.dump]:
            print(f"{t:8.1f} {'    ' * 'CDS'.index(r)}{r} {name} {kind} {rest[:40]}")


if __name__ == "__main__":
    main()
