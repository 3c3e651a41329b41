"""The round-trip bound of the user view's request/response rows: ``bench/rtt_ceiling.c``,
compiled at run time like ``bench/ceiling.c`` (``_ceiling``), echoes SIZE-byte messages between
two C processes over shared memory (each on a CPU of its own), publishing piece by piece so that
the two sides' copies overlap: no channel, in any language, turns a SIZE-byte request around
faster on this machine. :func:`measure_python` is the same echo between two Python processes,
on two CPUs and on one: no Python channel can beat those, wherever the scheduler puts the pair."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from _ceiling import CeilingError, compiler

SOURCE = Path(__file__).resolve().parent / "rtt_ceiling.c"
PIECE = 4096
"""Publish every 4 KiB: the copies overlap (a whole-message publication is slower here)."""
TIMEOUT = 180.0
_RESULT = re.compile(r"^RESULT p50_ns=(\d+) p99_ns=(\d+) rounds=(\d+)$", re.M)


def measure(sizes: list[int], rounds: int, warmup: int) -> dict[int, float]:
    """size → round-trip p50 in microseconds. Raises :class:`CeilingError`."""
    out: dict[int, float] = {}
    with tempfile.TemporaryDirectory(prefix="smcd-rtt-ceiling-") as tmp:
        exe = Path(tmp) / "rtt_ceiling"
        cmd = [*compiler(), "-O2", "-std=c11", "-o", os.fspath(exe), os.fspath(SOURCE)]
        built = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
        if built.returncode != 0:
            raise CeilingError(f"{' '.join(cmd)} failed: {built.stderr.strip()}")
        for size in sizes:
            args = [os.fspath(exe), str(size), str(min(PIECE, size)), str(rounds), str(warmup)]
            try:
                proc = subprocess.run(
                    args, capture_output=True, text=True, timeout=TIMEOUT, check=False
                )
            except subprocess.TimeoutExpired as e:
                raise CeilingError(f"rtt_ceiling {size} did not finish") from e
            found = _RESULT.search(proc.stdout)
            if proc.returncode != 0 or found is None:
                why = proc.stderr.strip() or proc.stdout.strip() or "no output"
                raise CeilingError(f"rtt_ceiling failed ({proc.returncode}): {why}")
            out[size] = int(found[1]) / 1e3
    return out


# --- the same echo in Python ------------------------------------------------------------------

PY_PLACEMENTS = ("two CPUs", "one CPU")
"""Where the two Python processes of :func:`measure_python` run (pinned, so each figure is one
placement: an unpinned pair gets either, at the scheduler's choice)."""


def _py_echo(size: int, rounds: int, warmup: int, cpus: list[int]) -> None:
    """Two Python processes echo ``size``-byte messages over shared memory: one message area
    and one cursor word (a cache line of its own) per direction, a copy in and a copy out on
    each side, the waiter loading the peer's word (and, on one CPU, yielding to the peer at
    every miss: it cannot store anything until then; on two, spinning). The fewest lines of
    Python a round trip can cost: no socket layer, no channel, no flags, no wakeups."""
    import mmap
    import time

    line = 64
    area = (size + line - 1) // line * line
    mm = mmap.mmap(-1, 2 * line + 2 * area)
    words = memoryview(mm)[: 2 * line].cast("Q")
    req = memoryview(mm)[2 * line : 2 * line + size]
    resp = memoryview(mm)[2 * line + area : 2 * line + area + size]
    one_cpu = len(cpus) == 1
    total = warmup + rounds
    pid = os.fork()
    if pid == 0:  # the server: copy the request out, the reply in
        os.sched_setaffinity(0, {cpus[-1]})
        buf = memoryview(bytearray(size))
        yield_ = os.sched_yield
        for i in range(1, total + 1):
            if one_cpu:
                while words[0] != i:
                    yield_()
            else:
                while words[0] != i:
                    pass
            buf[:] = req
            resp[:] = buf
            words[8] = i
        os._exit(0)
    os.sched_setaffinity(0, {cpus[0]})
    msg = memoryview(bytes(range(256)) * (size // 256 + 1))[:size]
    got = memoryview(bytearray(size))
    yield_ = os.sched_yield
    clock = time.perf_counter_ns
    rtts = [0] * rounds
    for i in range(1, total + 1):
        t0 = clock()
        req[:] = msg
        words[0] = i
        if one_cpu:
            while words[8] != i:
                yield_()
        else:
            while words[8] != i:
                pass
        got[:] = resp
        if i > warmup:
            rtts[i - warmup - 1] = clock() - t0
    _, status = os.waitpid(pid, 0)
    if got != msg or status != 0:
        raise SystemExit("the Python echo differs from the message")
    rtts.sort()
    p50 = rtts[max(0, -(-50 * rounds // 100) - 1)]
    p99 = rtts[max(0, -(-99 * rounds // 100) - 1)]
    print(f"RESULT p50_ns={p50} p99_ns={p99} rounds={rounds}", flush=True)


def measure_python(sizes: list[int], rounds: int, warmup: int) -> dict[tuple[int, str], float]:
    """(size, placement) → the Python echo's round-trip p50 in microseconds, both processes on
    two CPUs and on one (:data:`PY_PLACEMENTS`; "two CPUs" only where there are two).
    Raises :class:`CeilingError`."""
    cpus = sorted(os.sched_getaffinity(0))
    out: dict[tuple[int, str], float] = {}
    for size in sizes:
        for placement in PY_PLACEMENTS:
            pinned = cpus[:2] if placement == "two CPUs" else cpus[:1]
            if len(pinned) < 2 and placement == "two CPUs":
                continue
            cmd = [sys.executable, __file__, "python", str(size), str(rounds), str(warmup)]
            cmd.append(",".join(map(str, pinned)))
            try:
                proc = subprocess.run(
                    cmd, capture_output=True, text=True, timeout=TIMEOUT, check=False
                )
            except subprocess.TimeoutExpired as e:
                raise CeilingError(f"the Python echo {size} did not finish") from e
            found = _RESULT.search(proc.stdout)
            if proc.returncode != 0 or found is None:
                why = proc.stderr.strip() or proc.stdout.strip() or "no output"
                raise CeilingError(f"the Python echo failed ({proc.returncode}): {why}")
            out[size, placement] = int(found[1]) / 1e3
    return out


if __name__ == "__main__" and len(sys.argv) == 6 and sys.argv[1] == "python":
    _py_echo(*map(int, sys.argv[2:5]), [int(c) for c in sys.argv[5].split(",")])
