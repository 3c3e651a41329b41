"""``make bench``'s user view: what an unmodified program gets from smcd with no configuration.

The programs are ``bench/user_app.py`` (stdlib ``socket``, nothing of smcd). Every figure runs
them twice in the same run, back to back: as they are (plain TCP loopback) and under ``smc-run
-v`` against a private smcd started with no configuration file (its embedded defaults: no UEID,
default buffer sizes), each time as fresh processes, the median of several runs. ``smc-run -v``
prints the transport of every connection on stderr; each row reports what its connections got
(``smcd``, or ``tcp`` with the fallback reason), so a fallback is shown as one and never passes
for acceleration.

The figures (issue 10): bulk 64 KiB ``sendall``s to a receiver that only reads, and to one that
checks a sample of every read (with that receiver's own bound: the same loop reading memory);
request/response round trips at 1 B, 1 KiB and 64 KiB; connections per second (connect,
1-byte echo, close) one at a time and several at a time, with the setup p50 (``connect()`` and
the first ``sendall()``: under smc-run the reply to the handoff is read by the first send); and the
resident memory (PSS, so shared pages count once) of smcd and both applications holding idle
connections.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import select
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

import _ceiling
import _conn_floor
import _rtt_ceiling
from _usertable import RR_SIZES, Modes, UserResults

from smc_handoff.layout import CDC_HEADER_LEN
from smcd_daemon.config import BuffersConfig

RR_KEYS = {size: key for size, _, key, _ in RR_SIZES}

HERE = Path(__file__).resolve().parent
APP = HERE / "user_app.py"
TIMEOUT = 300.0
KINDS = ("tcp", "smc")
CPUS = len(os.sched_getaffinity(0))
"""The CPUs this run may use: what a connection's CPU time is shared out over."""


DEFAULT_RING = BuffersConfig().default_dmb_size - CDC_HEADER_LEN
"""The ring of a DMB of the daemon's default size (its first 32 bytes are the cursors)."""


@dataclass(frozen=True)
class UserPlan:
    """Every size and count of the user view."""

    bulk_bytes: int
    bulk_warmup: int
    repeats: int
    rr_rounds: int
    rr_warmup: int
    conns: int
    conns_warmup: int
    idle: int
    write: int = 64 << 10
    recv: int = 1 << 20
    """The receiver's read buffer (``recv_into``), the one of the C ceiling."""
    stride: int = 65
    """The checking receiver compares every ``stride``-th byte (one per cache line or so)."""
    concurrency: int = 4


USER_FULL = UserPlan(
    bulk_bytes=1 << 30,
    bulk_warmup=64 << 20,
    repeats=3,
    rr_rounds=5_000,
    rr_warmup=500,
    conns=1_000,
    conns_warmup=50,
    idle=1_000,
)
USER_QUICK = UserPlan(
    bulk_bytes=16 << 20,
    bulk_warmup=2 << 20,
    repeats=1,
    rr_rounds=200,
    rr_warmup=20,
    conns=40,
    conns_warmup=4,
    idle=20,
)

USER_MEDIUM = UserPlan(
    bulk_bytes=256 << 20,
    bulk_warmup=32 << 20,
    repeats=3,
    rr_rounds=2_000,
    rr_warmup=200,
    conns=300,
    conns_warmup=20,
    idle=200,
)
"""For comparing configurations by hand (``bench/run.py --sections user --user-plan medium``)."""
PLANS = {"quick": USER_QUICK, "medium": USER_MEDIUM, "full": USER_FULL}

_VERBOSE = re.compile(
    r"^smc-run\[\d+\]: (?:connect|accept) \(.*?\): (\w+)(?: conn \d+)?(?: \((.*)\))?$"
)


def smc_run() -> list[str]:
    """The ``smc-run`` a user has: the console script next to this Python, else the module."""
    script = Path(sys.executable).parent / "smc-run"
    return [os.fspath(script)] if script.exists() else [sys.executable, "-m", "smc_handoff.run"]


def port_of(line: str) -> int | None:
    """The port of a ``user_app.py`` server's first line (``PORT n``), None if it is not one."""
    words = line.split()
    return int(words[1]) if len(words) == 2 and words[0] == "PORT" and words[1].isdigit() else None


def user_env(smc_env: dict[str, str] | None) -> dict[str, str]:
    """A user's environment: ours without any smcd or smc-run settings, plus ``smc_env`` (a
    private smcd's handoff socket) for a program that is to use it."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SMCD_", "SMC_RUN"))}
    return {**base, **smc_env} if smc_env is not None else base


class App:
    """One run of ``user_app.py``: stdout read line by line, stderr kept in a file."""

    def __init__(self, kind: str, env: dict[str, str], args: list[object]) -> None:
        argv = [os.fspath(APP), *map(str, args)]
        cmd = [*smc_run(), "-v", *argv] if kind == "smc" else [sys.executable, *argv]
        self.err = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (closed by the harness)
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.err,
            env=env,
            text=True,
            start_new_session=True,  # the echo server's forks go with it
        )
        self.what = " ".join(cmd[-len(args) - 1 :])

    @property
    def pid(self) -> int:
        return self.proc.pid

    def line(self, timeout: float = 30.0) -> str:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        text = self.proc.stdout.readline() if ready else ""
        if not text:
            self.kill()
            raise RuntimeError(f"{self.what}: no output ({self.stderr()[-800:]})")
        return text.strip()

    def port(self) -> int:
        first = self.line()
        port = port_of(first)
        if port is None:
            self.kill()
            raise RuntimeError(f"{self.what}: said {first!r}, not PORT n")
        return port

    def result(self) -> dict[str, float]:
        try:
            out, _ = self.proc.communicate(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            self.kill()
            raise RuntimeError(f"{self.what}: no result within {TIMEOUT:.0f} s") from None
        if self.proc.returncode != 0:
            raise RuntimeError(f"{self.what}: exit {self.proc.returncode}: {self.stderr()[-800:]}")
        return dict(json.loads(out.strip().splitlines()[-1]))

    def finish(self) -> None:
        """Wait for a server that ends by itself (its client is done)."""
        try:
            self.proc.communicate(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            self.kill()
            raise RuntimeError(f"{self.what}: did not end") from None
        if self.proc.returncode != 0:
            raise RuntimeError(f"{self.what}: exit {self.proc.returncode}: {self.stderr()[-800:]}")

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def stderr(self) -> str:
        self.err.seek(0)
        return self.err.read()

    def modes(self) -> Counter[str]:
        """Each connection end's transport as ``smc-run -v`` reported it, with its reason."""
        found: Counter[str] = Counter()
        for line in self.stderr().splitlines():
            if m := _VERBOSE.match(line):
                found[m[1] if m[1] != "tcp" else f"tcp ({m[2] or 'no reason given'})"] += 1
        return found


def mode_text(modes: Counter[str]) -> str:
    """``smcd``; ``tcp (CODE, CODE)`` with the fallback codes of the two ends; or ``mixed: …``."""
    if not modes:
        return "no connection reported"
    transports = Counter(m.split(" ", 1)[0] for m in modes.elements())
    if len(transports) > 1:
        return "mixed: " + ", ".join(f"{n} {t}" for t, n in transports.most_common())
    only = next(iter(transports))
    if only != "tcp":
        return only
    codes = sorted({_CODE.search(m)[0] if _CODE.search(m) else m[5:-1] for m in modes})
    return f"tcp ({', '.join(codes)})"


_CODE = re.compile(r"SMC_CLC_DECL_\w+|SMC_\w+")


def cpu_ns(pid: int) -> int:
    """CPU time of every thread of ``pid`` so far, in ns (``schedstat``: exact, not ticks)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError, ValueError, IndexError):
            total += int((task / "schedstat").read_text().split()[0])
    return total


def memory_of(pid: int) -> tuple[int, int]:
    """(PSS, RSS) in bytes: PSS splits shared pages (the DMBs smcd and both ends map) among
    their mappers, so a sum over processes counts each page once."""
    pss = rss = 0
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name == "Pss":
            pss = int(rest.split()[0]) << 10
        elif name == "Rss":
            rss = int(rest.split()[0]) << 10
    return pss, rss


def _tls_files() -> tuple[str, str]:
    """A self-signed certificate for the TLS rows and its key, in a directory that lives as
    long as the process (openssl, as the tests make theirs)."""
    where = tempfile.mkdtemp(prefix="smcd-bench-tls-")
    atexit.register(shutil.rmtree, where, True)
    cert, key = os.path.join(where, "cert.pem"), os.path.join(where, "key.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key,
                    "-out", cert, "-days", "1", "-subj", "/CN=localhost"],
                   check=True, capture_output=True, timeout=60)  # fmt: skip
    return cert, key


@dataclass
class UserView:
    plan: UserPlan
    smc_env: dict[str, str]
    """The environment of a user of the private smcd (its handoff socket)."""
    smcd_pid: int | None
    res: UserResults = field(default_factory=lambda: {"tcp": {}, "smc": {}, "bound": {}})
    modes: Modes = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    memory_detail: dict[str, tuple[int, int]] = field(default_factory=dict)
    reasons: set[str] = field(default_factory=set)
    smcd_cpu: list[float] = field(default_factory=list)
    """smcd's CPU time per connection (µs) of each one-at-a-time connections run."""

    tls_files: tuple[str, str] | None = None
    """The TLS rows' certificate and key (made by openssl for the run)."""

    def env(self, kind: str) -> dict[str, str]:
        env = user_env(self.smc_env if kind == "smc" else None)
        if self.tls_files is not None:
            env["USER_APP_TLS_CERT"], env["USER_APP_TLS_KEY"] = self.tls_files
        return env

    def measure(self, keys: tuple[str, ...], once: Callable[[str], tuple[float, ...]]) -> None:
        """``once(kind)`` ``repeats`` times per kind, tcp then smc; the median of each figure."""
        for kind in KINDS:
            seen: Counter[str] = Counter()
            runs = []
            try:
                for _ in range(self.plan.repeats):
                    figures, modes = self._once(once, kind)
                    runs.append(figures)
                    seen += modes
                    self.reasons.update(m[5:-1] for m in modes if m.startswith("tcp ("))
            except (OSError, RuntimeError, ValueError) as e:
                self.notes.append(f"user view {kind} {'/'.join(keys)}: {e}")
                continue
            for i, key in enumerate(keys):
                self.res[kind][key] = statistics.median(r[i] for r in runs)
                if kind == "smc":
                    self.modes[key] = mode_text(seen)

    def _once(
        self, once: Callable[[str], tuple[float, ...]], kind: str
    ) -> tuple[tuple[float, ...], Counter[str]]:
        self._apps: list[App] = []
        try:
            figures = once(kind)
            modes: Counter[str] = Counter()
            for app in self._apps:
                modes += app.modes()
            return figures, modes
        finally:
            for app in self._apps:
                if app.proc.poll() is None:
                    app.kill()
                app.err.close()

    def app(self, kind: str, *args: object) -> App:
        a = App(kind, self.env(kind), list(args))
        self._apps.append(a)
        return a

    # the figures, one run each -------------------------------------------------------------

    def bulk(self, stride: int, tls: bool = False) -> Callable[[str], tuple[float]]:
        """Bulk into a sink that checks every ``stride``-th byte (0: none); ``tls``: both
        ends in ``ssl`` (no check)."""
        p = self.plan
        reader, writer = ("tlssink", "tlssend") if tls else ("sink", "send")
        tail = () if tls else (stride,)

        def once(kind: str) -> tuple[float]:
            sink = self.app(kind, reader, p.bulk_warmup, p.bulk_bytes, p.recv, *tail)
            port = sink.port()
            sender = self.app(kind, writer, port, p.bulk_warmup, p.bulk_bytes, p.write)
            rate = sender.result()["bytes_per_s"]
            sink.finish()
            return (rate,)

        return once

    def rr(self, size: int) -> Callable[[str], tuple[float, float]]:
        p = self.plan

        def once(kind: str) -> tuple[float, float]:
            port = self.app(kind, "echo", 1).port()
            r = self.app(kind, "rr", port, size, p.rr_rounds, p.rr_warmup).result()
            return r["p50_us"], r["p99_us"]

        return once

    def tls_rr(self, size: int) -> Callable[[str], tuple[float, float]]:
        p = self.plan

        def once(kind: str) -> tuple[float, float]:
            port = self.app(kind, "tlsecho").port()
            r = self.app(kind, "tlsrr", port, size, p.rr_rounds, p.rr_warmup).result()
            return r["p50_us"], r["p99_us"]

        return once

    def conns(self, procs: int) -> Callable[[str], tuple[float, ...]]:
        """Connections/s and the setup p50; one at a time (``procs`` 1) also the CPU per
        connection of the client and of the echo server (and of smcd, :attr:`smcd_cpu`)."""
        p = self.plan

        def once(kind: str) -> tuple[float, ...]:
            server = self.app(kind, "echo", procs)
            port = server.port()
            watch = kind == "smc" and procs == 1 and self.smcd_pid is not None
            before = cpu_ns(self.smcd_pid) if watch and self.smcd_pid else 0
            served = cpu_ns(server.pid)
            r = self.app(kind, "conns", port, p.conns, p.conns_warmup, procs).result()
            served = cpu_ns(server.pid) - served
            if watch and self.smcd_pid:
                spent = cpu_ns(self.smcd_pid) - before
                self.smcd_cpu.append(spent / (p.conns + p.conns_warmup) / 1e3)
            if procs != 1:
                return r["rate"], r["connect_p50_us"]
            # the server's CPU counts the warm-up's connections too, the client's does not
            per_server = served / (p.conns + p.conns_warmup) / 1e3
            return r["rate"], r["connect_p50_us"], r["cpu_us"], per_server

        return once

    def memory(self, kind: str) -> tuple[float]:
        n = self.plan.idle
        server = self.app(kind, "hold", n)
        port = server.port()
        client = self.app(kind, "open", port, n)
        if client.line(timeout=TIMEOUT) != "OPEN":
            raise RuntimeError("the client did not open its connections")
        # The client's connect() returns before smcd answered (the first send waits for it),
        # and the server accepts one connection per handshake: measured before the server has
        # accepted them all, the rest are not there yet, and closed at the end before they
        # were, they fell back (CLOSED_UNANSWERED) and turned the row "mixed".
        if server.line(timeout=TIMEOUT) != "HELD":
            raise RuntimeError("the server did not accept all the connections")
        time.sleep(0.3)  # the daemon's deferred bookkeeping
        pids = {"server": server.pid, "client": client.pid}
        if kind == "smc" and self.smcd_pid is not None:
            pids["smcd"] = self.smcd_pid
        detail = {f"{kind} {who}": memory_of(pid) for who, pid in pids.items()}
        self.memory_detail.update(detail)
        client.result()  # its stdin closes: the client closes everything, the server follows
        server.finish()
        return (float(sum(pss for pss, _ in detail.values())),)

    def bound(self) -> None:
        """The checking receiver's loop reading from memory (plain Python, no socket)."""
        p = self.plan
        runs = []
        for _ in range(p.repeats):
            a = App("tcp", self.env("tcp"), ["bound", p.bulk_bytes, p.recv, p.stride])
            try:
                runs.append(a.result()["bytes_per_s"])
            finally:
                a.err.close()
        self.res["bound"]["work"] = statistics.median(runs)

    def run(self, progress: Callable[[str], None], ceiling: float | None) -> None:
        p = self.plan
        self.res["bound"]["ceiling"] = ceiling
        progress("user view: bulk, receiver only reads")
        self.measure(("bulk",), self.bulk(0))
        progress("user view: bulk, receiver checks a sample")
        self.measure(("bulk_work",), self.bulk(p.stride))
        progress("user view: bulk bound through the default DMB's ring (C)")
        try:
            self.res["bound"]["ceiling_default"] = _ceiling.measure(
                ring=DEFAULT_RING,
                chunk=p.write,
                rbuf=p.recv,
                volume=p.bulk_bytes,
                warmup=p.bulk_warmup,
                repeats=p.repeats,
            )
        except (_ceiling.CeilingError, OSError) as e:
            self.notes.append(f"user view default-ring bound: {e}")
        progress("user view: that receiver reading memory")
        try:
            self.bound()
        except (OSError, RuntimeError, ValueError) as e:
            self.notes.append(f"user view bound: {e}")
        for size, name, key, _ in RR_SIZES:
            progress(f"user view: round trips, {name}")
            self.measure((f"rr_{key}_p50", f"rr_{key}_p99"), self.rr(size))
        progress("user view: round trips over TLS, 1 KiB")
        try:
            self.tls_files = _tls_files()
            self.measure(("tls_rr_1k_p50", "tls_rr_1k_p99"), self.tls_rr(1024))
            progress("user view: bulk over TLS")
            self.measure(("tls_bulk",), self.bulk(0, tls=True))
        except (OSError, subprocess.SubprocessError) as e:
            self.notes.append(f"user view TLS rows: {e}")
        progress("user view: round-trip bound (C, shared memory)")
        try:
            bounds = _rtt_ceiling.measure([s for s, *_ in RR_SIZES], p.rr_rounds, p.rr_warmup)
            for size, _, key, _ in RR_SIZES:
                self.res["bound"][f"rr_{key}_p50"] = bounds[size]
            py = _rtt_ceiling.measure_python([s for s, *_ in RR_SIZES], p.rr_rounds, p.rr_warmup)
            for (size, where), p50 in py.items():
                suffix = "py2" if where == "two CPUs" else "py1"
                self.res["bound"][f"rr_{RR_KEYS[size]}_p50_{suffix}"] = p50
        except (_ceiling.CeilingError, OSError) as e:
            self.notes.append(f"user view round-trip bound: {e}")
        progress("user view: connections, one at a time")
        self.measure(("conns_1", "connect_p50", "cpu_client", "cpu_server"), self.conns(1))
        if self.smcd_cpu:
            self.res["bound"]["smcd_cpu"] = statistics.median(self.smcd_cpu)
        self._cpu_rate()
        progress("user view: connections bound (a minimal Python handoff chain)")
        try:
            self.res["bound"].update(_conn_floor.measure(p.conns, p.conns_warmup, p.repeats))
        except _conn_floor.FloorError as e:
            self.notes.append(f"user view connection bound: {e}")
        progress(f"user view: connections, {p.concurrency} at a time")
        self.measure(("conns_n", "_connect_p50_n"), self.conns(p.concurrency))
        progress(f"user view: memory, {p.idle:,} idle connections")
        self.measure(("memory",), self.memory)

    def _cpu_rate(self) -> None:
        """The most connections/s the CPUs allow for that CPU per connection (smcd's and both
        programs'), were the three processes to overlap perfectly: a connection one at a time
        is a chain, so the rate stays below it."""
        smc, smcd = self.res["smc"], self.res["bound"].get("smcd_cpu")
        client, server = smc.get("cpu_client"), smc.get("cpu_server")
        if smcd is None or client is None or server is None:
            return
        self.res["bound"]["chain_cpu"] = smcd + client + server
        self.res["bound"]["cpu_rate"] = CPUS * 1e6 / (smcd + client + server)

    def complete(self, keys: list[str]) -> bool:
        return all(self.res[k].get(key) is not None for key in keys for k in KINDS)

    def mode_notes(self) -> list[str]:
        """Every distinct fallback reason in full (the table's mode column has codes only)."""
        return [f"fallback: {reason}" for reason in sorted(self.reasons)]
