"""The standing chaos test of #14: ``make soak`` (minutes); short in tests/soak/test_soak_short.py.

A private smcd (``PrivateSmcd``) serves echo servers and clients, all separate processes using
``smc_handoff``, in connect / echo / close loops with a SHA-256 on every connection in both
directions (tests/soak/workers.py). The run goes through five phases:

1. ``warmup`` — load only;
2. ``chaos`` — the daemon is SIGKILLed and restarted, and SIGSTOPped and continued, in turn;
3. ``settle`` — load on the last daemon process; then the load pauses and its RSS and
   descriptors are taken as the baseline;
4. ``flood`` — another uid (``nobody``, in a child that drops to it) holds thousands of idle
   handoff connections while root's load goes on;
5. ``post`` — the flooder is gone; load again; then the load pauses and RSS/descriptors are
   measured again.

It prints connections, outcomes by mode and reason, corrupted streams, hung clients, the other
user's impact on root's connections, the daemon's RSS and descriptors, and the verdict on the
required figures (exit status 1 if any fails):

- zero corrupted streams (data not byte-exact, or beginning with a CLC eyecatcher);
- zero hung connections (every wait is bounded; a client still in one connection after
  ``HANG_S`` is killed and counted);
- under the flood, root's connections ≥ 95 % on SMC and none failing;
- RSS and descriptors after the flood back to the baseline, within
  :data:`RSS_TOLERANCE`/:data:`FD_TOLERANCE`.

    python -m tests.soak.soak --minutes 3 [--clients 6] [--servers 3] [--flood 15000] [--json F]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import queue as queue_mod
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from smcd_daemon.demo import PrivateSmcd
from tests.soak import workers
from tests.soak.workers import HANG_S, PHASES

UEID_CONFIG = '[eid]\nueids = ["SMCD-SOAK"]\n'
NOBODY = 65534
RSS_TOLERANCE = (0.10, 8 << 20)
"""RSS after may exceed the baseline by 10 % or 8 MiB, whichever is larger (allocator slack)."""
FD_TOLERANCE = (0.10, 8)
"""Descriptors after may exceed the baseline by 10 % or 8, whichever is larger (pool cache)."""
SMC_SHARE_MIN = 0.95
PHASE_SHARES = {"warmup": 0.10, "chaos": 0.40, "settle": 0.15, "flood": 0.25, "post": 0.10}


def _proc_figures(pid: int) -> dict[str, int]:
    rss = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
    return {"rss": rss, "fds": len(os.listdir(f"/proc/{pid}/fd"))}


def _shape(line: str) -> str:
    """A stderr line with its numbers blanked, so that like lines count together."""
    return re.sub(r"\d+", "N", line.strip())


@dataclass
class Soak:
    seconds: float
    clients: int = 6
    servers: int = 3
    flood: int = 15_000
    seed: int = 14
    out: list[str] = field(default_factory=list)

    def say(self, text: str) -> None:
        print(text, flush=True)
        self.out.append(text)

    # ------------------------------------------------------------------------------ set-up

    def run(self) -> dict[str, Any]:
        self.ctx = multiprocessing.get_context("fork")
        self.daemon = PrivateSmcd(name="soak", log_level="warning", config_text=UEID_CONFIG)
        self.daemon.start()
        os.chmod(self.daemon.workdir, 0o711)  # the other uid reaches the handoff socket (0666)
        os.environ.update(self.daemon.env)
        self.stderr = os.fspath(self.daemon.workdir / "workers.stderr")
        self.queue = self.ctx.Queue()
        self.phase = self.ctx.Value("i", 0, lock=False)
        self.pause = self.ctx.Event()
        self.stop = self.ctx.Event()
        self.server_stop = self.ctx.Event()
        self.ports = self.ctx.Array("i", self.servers, lock=False)
        self.beats = self.ctx.Array("d", self.clients, lock=False)
        self.counts: Counter[str] = Counter()
        self.examples: list[str] = []
        self.hung_clients = 0
        self.kills = self.stops = 0
        self.flooder: subprocess.Popen[str] | None = None
        self.flood_status = ""
        self.logs: list[str] = []
        self.figures: dict[str, Any] = {}
        try:
            self._start_workers()
            self._timeline()
        finally:
            self._teardown()
        return self._report()

    def _start_workers(self) -> None:
        self.server_procs = [
            self.ctx.Process(
                target=workers.server_main,
                args=(i, self.ports, self.phase, self.server_stop, self.queue, self.stderr),
                daemon=True,
            )
            for i in range(self.servers)
        ]
        for p in self.server_procs:
            p.start()
        deadline = time.monotonic() + 30
        while not all(self.ports) and time.monotonic() < deadline:
            time.sleep(0.05)
        self.client_procs: list[Any] = [None] * self.clients
        for slot in range(self.clients):
            self._spawn_client(slot)

    def _spawn_client(self, slot: int) -> None:
        self.beats[slot] = 0.0
        p = self.ctx.Process(
            target=workers.client_main,
            args=(
                slot,
                self.seed * 1000 + slot + 100 * self.hung_clients,
                self.ports,
                self.phase,
                self.pause,
                self.stop,
                self.beats,
                self.queue,
                self.stderr,
            ),
            daemon=True,
        )
        p.start()
        self.client_procs[slot] = p

    # ---------------------------------------------------------------------------- timeline

    def _timeline(self) -> None:
        start = time.monotonic()
        ends = {}
        t = start
        for name in PHASES:
            t += PHASE_SHARES[name] * self.seconds
            ends[name] = t
        self._enter("warmup")
        self._run_until(ends["warmup"])
        self._enter("chaos")
        self._chaos(ends["chaos"])
        self._enter("settle")
        self._run_until(ends["settle"])
        self.figures["baseline"] = self._quiet_figures()
        self._enter("flood")
        self._start_flood()
        self._run_until(ends["flood"])
        self._stop_flood()
        self._enter("post")
        self._run_until(ends["post"])
        self.figures["after"] = self._quiet_figures()

    def _enter(self, name: str) -> None:
        self.phase.value = PHASES.index(name)
        self.say(f"[{time.strftime('%H:%M:%S')}] phase {name}")

    def _pid(self) -> int:
        assert self.daemon.proc is not None
        return self.daemon.proc.pid

    def _chaos(self, until: float) -> None:
        """SIGKILL + restart and SIGSTOP + SIGCONT in turn, one event every few seconds; the
        last event ends in time for the settle phase to run on the last daemon process."""
        rng = random.Random(self.seed)
        span = until - time.monotonic()
        gap = max(5.0, span / 10)
        kill = True
        while time.monotonic() + gap <= until:
            self._run_until(time.monotonic() + rng.uniform(0.5, 1.0) * gap / 2)
            if kill:
                self._kill_restart()
            else:
                frozen = min(12.0, max(3.0, gap / 2))
                self._freeze(frozen)
            kill = not kill
            self._run_until(min(until, time.monotonic() + gap / 2))
        self._run_until(until)

    def _kill_restart(self) -> None:
        proc = self.daemon.proc
        assert proc is not None
        proc.kill()
        proc.wait()
        self.kills += 1
        self.say(f"  SIGKILL smcd (pid {proc.pid}); restarting")
        self._save_log()
        self._run_until(time.monotonic() + 0.3)
        self.daemon.launch()
        self.daemon.wait_ready(30)

    def _freeze(self, seconds: float) -> None:
        pid = self._pid()
        os.kill(pid, signal.SIGSTOP)
        self.stops += 1
        self.say(f"  SIGSTOP smcd for {seconds:.1f} s")
        self._run_until(time.monotonic() + seconds)
        os.kill(pid, signal.SIGCONT)

    def _save_log(self) -> None:
        self.logs.append(self.daemon.log())

    def _run_until(self, deadline: float) -> None:
        """Collect tallies and watch for hung clients until ``deadline``."""
        while True:
            self._drain(0.1)
            self._watch()
            if time.monotonic() >= deadline:
                return

    def _drain(self, wait: float) -> None:
        end = time.monotonic() + wait
        while True:
            left = end - time.monotonic()
            try:
                kind, counts, examples = self.queue.get(timeout=max(left, 0.001))
            except queue_mod.Empty:
                return
            if kind == "tally":
                self.counts.update(counts)
                self.examples += examples[: max(0, 10 - len(self.examples))]
            if left <= 0:
                return

    def _watch(self) -> None:
        now = time.time()
        for slot, p in enumerate(self.client_procs):
            began = self.beats[slot]
            if began and now - began > HANG_S:
                self.hung_clients += 1
                self.counts[f"client|{PHASES[self.phase.value]}|?|-|hung (killed)"] += 1
                self.say(f"  client {slot} hung for {now - began:.0f} s: killed")
                p.kill()
                p.join(5)
                if not self.stop.is_set():
                    self._spawn_client(slot)
            elif not p.is_alive() and not self.stop.is_set():
                self.counts[f"client|{PHASES[self.phase.value]}|?|-|worker died"] += 1
                self._spawn_client(slot)

    def _quiet_figures(self) -> dict[str, int]:
        """Pause the load, wait (bounded) for the clients to finish their connections and the
        daemon to see them go, measure, resume."""
        self.pause.set()
        deadline = time.monotonic() + HANG_S + 5
        while any(self.beats) and time.monotonic() < deadline:
            self._drain(0.1)
            self._watch()
        self._drain(2.0)  # closes reach the daemon; its deferred bookkeeping runs
        figures = _proc_figures(self._pid())
        self.pause.clear()
        self.say(f"  daemon: RSS {figures['rss'] / 2**20:.1f} MiB, {figures['fds']} descriptors")
        return figures

    # ------------------------------------------------------------------------------- flood

    def _start_flood(self) -> None:
        self.flooder = subprocess.Popen(
            ["/usr/bin/python3", "-c", workers.FLOODER, str(self.daemon.handoff_socket),
             str(self.flood)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            user=NOBODY,
            group=NOBODY,
            extra_groups=[],
            cwd="/",
        )  # fmt: skip
        os.set_blocking(self.flooder.stdout.fileno(), False)  # type: ignore[union-attr]
        self.flood_peak_fds = 0

    def _flood_line(self) -> None:
        if self.flooder is None or self.flooder.stdout is None:
            return
        with contextlib.suppress(OSError, TypeError):
            for line in self.flooder.stdout.read().splitlines():
                if line.strip():
                    self.flood_status = line.strip()

    def _stop_flood(self) -> None:
        if self.flooder is None:
            return
        self._flood_line()
        with contextlib.suppress(OSError):
            self.flood_peak_fds = _proc_figures(self._pid())["fds"]
        assert self.flooder.stdin is not None
        self.flooder.stdin.close()
        try:
            self.flooder.wait(20)
        except subprocess.TimeoutExpired:
            self.flooder.kill()
            self.flooder.wait()
        os.set_blocking(self.flooder.stdout.fileno(), True)  # type: ignore[union-attr]
        self._flood_line()
        self.say(f"  flooder (uid {NOBODY}): {self.flood_status or 'no report'}")
        self.say(f"  daemon descriptors at the end of the flood: {self.flood_peak_fds}")
        self.flooder = None

    # ---------------------------------------------------------------------------- teardown

    def _teardown(self) -> None:
        if self.flooder is not None:
            self._stop_flood()
        self.stop.set()
        self.pause.clear()
        deadline = time.monotonic() + HANG_S + 5
        while time.monotonic() < deadline and any(
            p is not None and p.is_alive() for p in self.client_procs
        ):
            self._drain(0.1)
            self._watch()
        for p in self.client_procs:
            if p is not None and p.is_alive():
                p.kill()
                self.hung_clients += 1
                self.counts["client|post|?|-|hung (killed at the end)"] += 1
            if p is not None:
                p.join(5)
        self.server_stop.set()
        deadline = time.monotonic() + 5 * workers.IO_TIMEOUT
        while time.monotonic() < deadline and any(p.is_alive() for p in self.server_procs):
            self._drain(0.2)
        for p in self.server_procs:
            if p.is_alive():
                p.kill()
                self.counts["server|post|?|-|hung (killed at the end)"] += 1
            p.join(5)
        self._drain(1.0)
        self._save_log()
        self.stderr_lines: Counter[str] = Counter()
        with contextlib.suppress(OSError), open(self.stderr, errors="replace") as f:
            self.stderr_lines.update(_shape(line) for line in f if line.strip())
        self.daemon.cleanup()

    # ------------------------------------------------------------------------------ report

    def _report(self) -> dict[str, Any]:
        rows = [(k.split("|"), n) for k, n in self.counts.items()]
        clients = [(r, n) for r, n in rows if r[0] == "client"]
        total = sum(n for _, n in clients)
        corrupted = sum(n for r, n in rows if r[4].startswith("corrupt"))
        hung = sum(n for r, n in rows if r[4].startswith("hung"))

        def share(phase: str, role: str = "client") -> dict[str, Any]:
            sel = [(r, n) for r, n in rows if r[0] == role and r[1] == phase]
            n_all = sum(n for _, n in sel)
            smc = sum(n for r, n in sel if r[2] == "smcd")
            failed = sum(n for r, n in sel if r[4] != "ok")
            corrupt = sum(n for r, n in rows if r[1] == phase and r[4].startswith("corrupt"))
            return {
                "connections": n_all,
                "smc": smc,
                "smc_share": smc / n_all if n_all else 0.0,
                "failed": failed,
                "corrupted": corrupt,
            }

        self.say("")
        self.say(f"connections (client halves): {total:,}; daemon SIGKILLs {self.kills}, "
                 f"SIGSTOPs {self.stops}")  # fmt: skip
        self.say("outcomes by role, mode, fallback reason and result:")
        agg: Counter[tuple[str, str, str, str]] = Counter()
        for r, n in rows:
            agg[(r[0], r[2], r[3], r[4])] += n
        for (role, mode, reason, outcome), n in sorted(agg.items(), key=lambda kv: -kv[1]):
            self.say(f"  {role:6} {mode:5} {reason:28} {outcome:36} {n:>8,}")
        self.say("by phase: client halves, on SMC, failed; corrupted streams (either half)")
        phases = {}
        for ph in PHASES:
            phases[ph] = share(ph)
            s = phases[ph]
            self.say(
                f"  {ph:7} {s['connections']:>8,} {s['smc_share']:>7.1%} {s['failed']:>6,} "
                f"{s['corrupted']:>6,}"
            )
        flood_server = share("flood", "server")
        self.say(f"corrupted streams: {corrupted}")
        for ex in self.examples:
            self.say(f"  e.g. {ex[:140]}")
        self.say(f"hung connections: {hung}")
        fl = phases["flood"]
        self.say(
            f"other user's impact (flood by uid {NOBODY}: {self.flood_status or 'no report'}): "
            f"root's client halves {fl['smc_share']:.1%} on SMC, {fl['failed']} failed, of "
            f"{fl['connections']:,}; server halves {flood_server['smc_share']:.1%} on SMC, "
            f"{flood_server['failed']} failed (settle phase before it: "
            f"{phases['settle']['smc_share']:.1%} on SMC, {phases['settle']['failed']} failed)"
        )
        base = self.figures.get("baseline")
        after = self.figures.get("after")
        resources_ok = False
        if base and after:
            rss_limit = base["rss"] + max(int(base["rss"] * RSS_TOLERANCE[0]), RSS_TOLERANCE[1])
            fd_limit = base["fds"] + max(int(base["fds"] * FD_TOLERANCE[0]), FD_TOLERANCE[1])
            resources_ok = after["rss"] <= rss_limit and after["fds"] <= fd_limit
            self.say(
                f"daemon RSS {base['rss'] / 2**20:.1f} MiB before the flood, "
                f"{after['rss'] / 2**20:.1f} MiB after (limit {rss_limit / 2**20:.1f}); "
                f"descriptors {base['fds']} before, {after['fds']} after (limit {fd_limit})"
            )
        tracebacks = sum(log.count("Traceback") for log in self.logs)
        self.say(f"tracebacks in the daemon's logs: {tracebacks}")
        lines = self.stderr_lines
        self.say(f"the workers' stderr (library warnings): {sum(lines.values()):,} lines")
        for line, n in lines.most_common(5):
            self.say(f"  {n:>6,} x {line[:120]}")
        checks = {
            "zero corrupted streams": corrupted == 0,
            "zero hung connections": hung == 0,
            f"root >= {SMC_SHARE_MIN:.0%} on SMC under the flood": fl["smc_share"] >= SMC_SHARE_MIN
            and flood_server["smc_share"] >= SMC_SHARE_MIN,
            "none of root's connections failing under the flood": fl["failed"] == 0
            and flood_server["failed"] == 0,
            "RSS and descriptors back to the baseline": resources_ok,
            "enough connections to judge (>= 100 in the flood phase)": fl["connections"] >= 100,
        }
        self.say("required figures:")
        for what, ok in checks.items():
            self.say(f"  {'PASS' if ok else 'FAIL'}  {what}")
        verdict = all(checks.values())
        self.say(f"soak: {'PASS' if verdict else 'FAIL'}")
        return {
            "connections": total,
            "outcomes": dict(self.counts),
            "corrupted": corrupted,
            "hung": hung,
            "phases": phases,
            "flood_server": flood_server,
            "flood_status": self.flood_status,
            "baseline": base,
            "after": after,
            "tracebacks": tracebacks,
            "kills": self.kills,
            "stops": self.stops,
            "checks": checks,
            "pass": verdict,
        }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--minutes", type=float, default=None)
    ap.add_argument("--seconds", type=float, default=None)
    ap.add_argument("--clients", type=int, default=6)
    ap.add_argument("--servers", type=int, default=3)
    ap.add_argument("--flood", type=int, default=15_000, help="idle connections of the other uid")
    ap.add_argument("--seed", type=int, default=14)
    ap.add_argument("--json", help="write the figures to this file")
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("soak: runs as root (it starts a flooder as uid 65534)", file=sys.stderr)
        return 2
    seconds = args.seconds if args.seconds else 60.0 * (args.minutes or 3.0)
    soak = Soak(seconds, args.clients, args.servers, args.flood, args.seed)
    result = soak.run()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    shutil.rmtree(soak.daemon.workdir, ignore_errors=True)
    return 0 if result["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
