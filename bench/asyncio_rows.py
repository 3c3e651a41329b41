"""``make bench``'s asyncio rows: unmodified asyncio programs on TCP and under ``smc-run``.

The programs are ``bench/asyncio_app.py`` (asyncio streams, aiohttp) and uvicorn serving its ASGI
app (``--loop asyncio``: with uvloop installed uvicorn would pick uvloop, whose transports
smc-run does not reach): nothing of smcd in them. Each figure runs them as fresh processes, on
TCP loopback and under ``smc-run -v`` against a private smcd with a UEID, back to back in the
same run (the median of ``repeats`` runs). ``smc-run -v`` prints the transport of every
connection; each row shows what its connections got, and a row whose connections are not all on
``smcd`` is never met.

The trio rows (no target) run ``bench/trio_app.py``'s bulk transfer and 1 KiB round trip the
same way: trio's own event loop, which smc-run upgrades too (``smc_handoff/trio_loop.py``).

Rows (issue 16): asyncio streams bulk (64 KiB writes, a receiver that ``read()``s), asyncio
request/response p50 at 1 KiB, and under it what bounds that round trip: the same round trip
with both ends in one process (each transport's work without a wakeup across processes) and
asyncio's own work over a transport without I/O (``bound:``, the floor of any transport under
these programs); and uvicorn answering an aiohttp keep-alive client with 64 KiB
responses (requests/s, p50). The last row says how the HTTP p50 divides: the transport's part is
the asyncio streams round trip carrying the same bytes (a 100-byte request, a 64 KiB answer) on
the same transport; the rest is outside it (HTTP parsing, ASGI, aiohttp, the event loops).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from _table import format_cell

HERE = Path(__file__).resolve().parent
APP = HERE / "asyncio_app.py"
TRIO_APP = HERE / "trio_app.py"
KINDS = ("tcp", "smc")
TIMEOUT = 300.0
"""Seconds one program of a full run may take; ``--quick`` gives each :data:`QUICK_TIMEOUT`."""
QUICK_TIMEOUT = 60.0
"""Far above a quick program's few seconds and well inside the 300 s its test allows the whole
run: a program that hangs becomes a note with both programs' stacks (see :meth:`_Proc.dump`),
not a test timeout that says nothing."""
CONFIG = '[eid]\nueids = ["SMCD-BENCH"]\n'
"""Same-host SMC-D needs a UEID both ends share (no-configuration acceleration is issue 10)."""


@dataclass(frozen=True)
class AsyncioPlan:
    """Every size and count of the asyncio rows."""

    bulk_bytes: int
    bulk_warmup: int
    rr_rounds: int
    rr_warmup: int
    http_requests: int
    http_warmup: int
    repeats: int
    rr_size: int = 1 << 10
    http_size: int = 64 << 10
    timeout: float = TIMEOUT


ASYNCIO_FULL = AsyncioPlan(
    bulk_bytes=512 << 20,
    bulk_warmup=32 << 20,
    rr_rounds=5_000,
    rr_warmup=500,
    http_requests=2_000,
    http_warmup=100,
    repeats=3,
)
ASYNCIO_QUICK = AsyncioPlan(
    bulk_bytes=8 << 20,
    bulk_warmup=1 << 20,
    rr_rounds=100,
    rr_warmup=10,
    http_requests=40,
    http_warmup=5,
    repeats=1,
    timeout=QUICK_TIMEOUT,
)


@dataclass(frozen=True)
class Row:
    key: str
    label: str
    unit: str
    target: str
    better: str  # "higher" or "lower"
    limit: float | None  # smc/tcp must be >= (higher) or <= (lower) this; None: no target
    bound: bool = False  # one figure (in the smc-run column), not a comparison


ROWS = (
    Row("bulk", "asyncio streams bulk, 64 KiB writes", "GB/s", ">= 2x tcp", "higher", 2.0),
    Row("rr", "asyncio round trip 1 KiB, p50", "us", "<= 0.5x tcp", "lower", 0.5),
    Row("rr_self", "  the same, both ends in one process", "us", "", "lower", None),
    Row("rr_mem", "  bound: asyncio alone, no I/O", "us", "", "lower", None, bound=True),
    Row("http_rps", "uvicorn+aiohttp keep-alive 64 KiB", "req/s", ">= 1x tcp", "higher", 1.0),
    Row("http_p50", "uvicorn+aiohttp keep-alive 64 KiB, p50", "us", "<= 1x tcp", "lower", 1.0),
    Row("rr64", "asyncio round trip 100 B -> 64 KiB, p50", "us", "", "lower", None),
    Row("trio_bulk", "trio bulk, 64 KiB send_all", "GB/s", "", "higher", None),
    Row("trio_rr", "trio round trip 1 KiB, p50", "us", "", "lower", None),
)

_VERBOSE = re.compile(
    r"^smc-run\[\d+\]: (?:connect|accept) .*?: (\w+)(?: conn \d+)?(?: \((.*)\))?$"
)


def _smc_run() -> list[str]:
    script = Path(sys.executable).parent / "smc-run"
    return [os.fspath(script)] if script.exists() else [sys.executable, "-m", "smc_handoff.run"]


class _Proc:
    """One program run: stdout line by line, stderr in a file (smc-run -v's lines)."""

    def __init__(
        self, kind: str, env: dict[str, str], argv: list[str], timeout: float = TIMEOUT
    ) -> None:
        cmd = [*_smc_run(), "-v", *argv] if kind == "smc" else argv
        self.timeout = timeout
        env = {**env, "PYTHONFAULTHANDLER": "1"}  # SIGABRT prints every thread's stack
        self.err = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (closed in stop)
        self.what = " ".join(argv[-6:])
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=self.err,
            env=env,
            text=True,
            cwd=HERE,
            start_new_session=True,
        )

    def stderr(self) -> str:
        self.err.seek(0)
        return self.err.read()

    def line(self, timeout: float = 30.0) -> str:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        text = self.proc.stdout.readline() if ready else ""
        if not text:
            raise RuntimeError(f"{self.what}: no output ({self.stderr()[-600:]})")
        return text.strip()

    def wait_stderr(self, pattern: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not re.search(pattern, self.stderr()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{self.what}: never said {pattern!r} ({self.stderr()[-600:]})")
            time.sleep(0.05)

    def result(self) -> dict[str, float]:
        try:
            out, _ = self.proc.communicate(timeout=self.timeout)
        except subprocess.TimeoutExpired:
            raise _Hung(f"{self.what}: no result within {self.timeout:.0f} s") from None
        if self.proc.returncode != 0:
            raise RuntimeError(f"{self.what}: exit {self.proc.returncode}: {self.stderr()[-600:]}")
        return dict(json.loads(out.strip().splitlines()[-1]))

    def dump(self) -> None:
        """A hung program: SIGABRT, so faulthandler writes its threads' stacks to stderr."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGABRT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=5)

    def stop(self) -> str:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        err = self.stderr()
        self.err.close()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        return err


class _Hung(RuntimeError):
    """A program gave no result in time (its stacks are added to the note)."""


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class AsyncioRows:
    """Runs the rows; ``res[kind][key]`` the medians, ``modes[key]`` the transports seen."""

    plan: AsyncioPlan
    env: dict[str, str]
    res: dict[str, dict[str, float | None]] = field(default_factory=lambda: {k: {} for k in KINDS})
    modes: dict[str, set[str]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def _note_modes(self, key: str, kind: str, *stderrs: str) -> None:
        if kind != "smc":
            return
        seen = self.modes.setdefault(key, set())
        for err in stderrs:
            for line in err.splitlines():
                found = _VERBOSE.match(line)
                if found:
                    mode, reason = found.groups()
                    seen.add(mode if reason is None else f"{mode} ({reason})")

    def _pair(
        self, key: str, kind: str, server: list[str], client: list[str], uvicorn: bool = False
    ) -> dict[str, float]:
        srv = _Proc(kind, self.env, server, self.plan.timeout)
        cli = None
        hung: _Hung | None = None
        try:
            if uvicorn:
                srv.wait_stderr(r"Application startup complete|Uvicorn running")
                port = server[server.index("--port") + 1]
            else:
                first = srv.line()
                if not first.startswith("PORT "):
                    raise RuntimeError(f"{srv.what}: said {first!r}, not PORT n")
                port = first.split()[1]
            cli = _Proc(
                kind, self.env, [*client[:2], client[2], port, *client[3:]], self.plan.timeout
            )
            out = cli.result()
        except _Hung as e:
            hung = e
            for proc in (cli, srv):
                if proc is not None:
                    proc.dump()
            raise
        finally:
            cli_err = cli.stop() if cli is not None else ""
            srv_err = srv.stop()
            if hung is not None:
                hung.args = (f"{hung.args[0]}; client stderr: {cli_err[-3000:]!r}; "
                             f"server stderr: {srv_err[-3000:]!r}",)  # fmt: skip
        self._note_modes(key, kind, srv_err, cli_err)
        return out

    def _single(self, key: str, kind: str, argv: list[str]) -> dict[str, float]:
        """One program that is both ends (``rr-self``, ``rr-mem``)."""
        proc = _Proc(kind, self.env, argv, self.plan.timeout)
        hung: _Hung | None = None
        try:
            out = proc.result()
        except _Hung as e:
            hung = e
            proc.dump()
            raise
        finally:
            err = proc.stop()
            if hung is not None:
                hung.args = (f"{hung.args[0]}; stderr: {err[-3000:]!r}",)
        self._note_modes(key, kind, err)
        return out

    def _measure(
        self,
        key: str,
        fn: Callable[[str], dict[str, float]],
        what: str,
        kinds: tuple[str, ...] = KINDS,
    ) -> None:
        runs: dict[str, list[float]] = {k: [] for k in kinds}
        for _ in range(self.plan.repeats):
            for kind in kinds:  # back to back: drift hits both alike
                try:
                    runs[kind].append(fn(kind)[what])
                except (RuntimeError, OSError, ValueError, KeyError) as e:
                    self.notes.append(f"{key} on {kind}: {e}")
        for kind in kinds:
            self.res[kind][key] = statistics.median(runs[kind]) if runs[kind] else None

    def _bulk(self, key: str, app: str) -> None:
        """The bulk row ``key`` of ``app`` (``bench/asyncio_app.py`` or ``bench/trio_app.py``:
        the same roles and arguments)."""
        p, py = self.plan, sys.executable
        self._measure(
            key,
            lambda kind: self._pair(
                key, kind, [py, app, "bulk-server"],
                [py, app, "bulk-client", str(p.bulk_bytes), str(p.bulk_warmup)],
            ),
            "gbps",
        )  # fmt: skip

    def run(self, progress: Callable[[str], None]) -> None:
        p, py, app = self.plan, sys.executable, os.fspath(APP)
        progress("asyncio: streams bulk")
        self._bulk("bulk", app)
        for key, req, resp in (("rr", p.rr_size, p.rr_size), ("rr64", 100, p.http_size)):
            progress(f"asyncio: round trips {req} -> {resp} B")
            self._measure(
                key,
                lambda kind, key=key, req=req, resp=resp: self._pair(  # type: ignore[misc]
                    key, kind, [py, app, "rr-server", str(req), str(resp)],
                    [py, app, "rr-client", str(p.rr_rounds), str(p.rr_warmup), str(req),
                     str(resp)],
                ),
                "p50_us",
            )  # fmt: skip
        rr = [str(p.rr_rounds), str(p.rr_warmup), str(p.rr_size), str(p.rr_size)]
        progress("asyncio: round trips, both ends in one process")
        self._measure(
            "rr_self", lambda kind: self._single("rr_self", kind, [py, app, "rr-self", *rr]),
            "p50_us",
        )  # fmt: skip
        progress("asyncio: round trips without I/O")
        self._measure(
            "rr_mem", lambda kind: self._single("rr_mem", kind, [py, app, "rr-mem", *rr]),
            "p50_us", kinds=("smc",),
        )  # fmt: skip
        progress("asyncio: uvicorn + aiohttp keep-alive")
        http: dict[str, list[dict[str, float]]] = {k: [] for k in KINDS}

        def one(kind: str) -> dict[str, float]:
            port = str(_free_port())
            out = self._pair(
                "http", kind,
                [py, "-m", "uvicorn", "asyncio_app:app", "--port", port, "--app-dir",
                 os.fspath(HERE), "--no-access-log", "--log-level", "info", "--loop", "asyncio"],
                [py, app, "http-client", str(p.http_requests), str(p.http_warmup),
                 str(p.http_size)],
                uvicorn=True,
            )  # fmt: skip
            http[kind].append(out)
            return out

        self._measure("http_rps", one, "rps")
        for kind in KINDS:
            lat = [r["p50_us"] for r in http[kind]]
            self.res[kind]["http_p50"] = statistics.median(lat) if lat else None
        self.modes["http_rps"] = self.modes["http_p50"] = self.modes.pop("http", set())
        trio = os.fspath(TRIO_APP)
        progress("trio: bulk")
        self._bulk("trio_bulk", trio)
        progress("trio: round trips")
        size = str(p.rr_size)
        self._measure(
            "trio_rr",
            lambda kind: self._pair(
                "trio_rr", kind, [py, trio, "rr-server", size, size],
                [py, trio, "rr-client", str(p.rr_rounds), str(p.rr_warmup), size, size],
            ),
            "p50_us",
        )  # fmt: skip

    def outside_share(self, kind: str) -> float | None:
        """The share of the HTTP p50 outside the transport (see the module docstring)."""
        rr64, http = self.res[kind].get("rr64"), self.res[kind].get("http_p50")
        if rr64 is None or http is None or http <= 0:
            return None
        return max(0.0, 1.0 - rr64 / http)

    def met(self, row: Row) -> bool | None:
        tcp, smc = self.res["tcp"].get(row.key), self.res["smc"].get(row.key)
        if row.bound or row.limit is None or tcp is None or smc is None or tcp <= 0:
            return None
        if self.modes.get(row.key) != {"smcd"}:
            return False
        ratio = smc / tcp
        return ratio >= row.limit if row.better == "higher" else ratio <= row.limit

    @property
    def complete(self) -> bool:
        return all(
            self.res[k].get(r.key) is not None
            for r in ROWS
            for k in (("smc",) if r.bound else KINDS)
        )


def render(rows: AsyncioRows) -> str:
    head = ("metric", "unit", "tcp", "smc-run", "smc/tcp", "target", "met", "mode")
    table = [head]
    for row in ROWS:
        tcp, smc = rows.res["tcp"].get(row.key), rows.res["smc"].get(row.key)
        if row.bound:  # asyncio's own figure: no transport, no comparison, no mode
            table.append((row.label, row.unit, "-", format_cell(smc, row.unit), "-", "-", "-", "-"))
            continue
        ratio = f"{smc / tcp:.2f}x" if tcp and smc is not None else "n/a"
        met = rows.met(row)
        mark = (
            "-" if met is None and row.limit is None else {True: "yes", False: "NO"}.get(met, "n/a")
        )  # type: ignore[call-overload]
        mode = ", ".join(sorted(rows.modes.get(row.key, set()))) or "n/a"
        cells = (format_cell(tcp, row.unit), format_cell(smc, row.unit))
        table.append((row.label, row.unit, *cells, ratio, row.target or "-", mark, mode))
    shares = [rows.outside_share(k) for k in KINDS]
    table.append(
        ("HTTP p50 outside the transport", "%",
         *(f"{s * 100:.0f}" if s is not None else "n/a" for s in shares), "-", "-", "-", "-")
    )  # fmt: skip
    widths = [max(len(str(r[i])) for r in table) for i in range(len(head))]
    lines = []
    for i, r in enumerate(table):
        lines.append("  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def run_asyncio_rows(
    plan: AsyncioPlan, progress: Callable[[str], None], config: str = CONFIG
) -> AsyncioRows:
    """The rows against a private smcd of their own (started and stopped here)."""
    from smcd_daemon.demo import DaemonStartError, PrivateSmcd

    daemon = PrivateSmcd(log_level="warning", config_text=config, name="bench-asyncio")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SMCD_")}
    rows = AsyncioRows(plan, env)
    try:
        try:
            daemon.start()
        except DaemonStartError as e:
            rows.notes.append(f"asyncio rows: the private smcd did not start: {e}")
            return rows
        env.update(daemon.env)
        rows.run(progress)
        status = daemon.stop()
        if status not in (0, None):
            rows.notes.append(f"asyncio rows: smcd exited with status {status} on SIGTERM")
    finally:
        daemon.cleanup()
    return rows


def print_asyncio_rows(rows: AsyncioRows) -> None:
    p = rows.plan
    print()
    print(
        "asyncio: unmodified asyncio programs (bench/asyncio_app.py, uvicorn, aiohttp) and trio "
        "programs (bench/trio_app.py) on TCP loopback and under smc-run, smcd with a UEID"
    )
    print(
        f"sizes: bulk {p.bulk_bytes >> 20} MiB in 64 KiB writes; round trips {p.rr_rounds:,} "
        f"after {p.rr_warmup:,}; HTTP {p.http_requests:,} keep-alive GETs of {p.http_size >> 10} "
        f"KiB after {p.http_warmup:,}; medians of {p.repeats} runs, fresh processes each"
    )
    print()
    print(render(rows))
    print()
    print(
        "outside the transport = 1 - (asyncio round trip carrying the same bytes / HTTP p50), "
        "per transport; mode = what smc-run -v reported for every connection of the row; "
        "bound: asyncio's own work for both ends of the round trip (no transport, no I/O)"
    )
    for note in rows.notes:
        print(f"note: {note}")


def main(argv: list[str] | None = None) -> int:
    """``bench/asyncio_rows.py [--quick]``: these rows alone (``bench/run.py`` runs them too)."""
    quick = "--quick" in (sys.argv[1:] if argv is None else argv)
    started = time.monotonic()

    def progress(what: str) -> None:
        print(f"  [{time.monotonic() - started:5.1f} s] {what}", file=sys.stderr, flush=True)

    rows = run_asyncio_rows(ASYNCIO_QUICK if quick else ASYNCIO_FULL, progress)
    print_asyncio_rows(rows)
    return 0 if rows.complete else 1


if __name__ == "__main__":
    sys.path.insert(0, os.fspath(HERE.parent))
    raise SystemExit(main())
