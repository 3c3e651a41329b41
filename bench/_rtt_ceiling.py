"""The round-trip bound of the user view's request/response rows: ``bench/rtt_ceiling.c``,
compiled at run time like ``bench/ceiling.c`` (``_ceiling``), echoes SIZE-byte messages between
two C processes over shared memory, publishing piece by piece so that the two sides' copies
overlap: no channel, in any language, turns a SIZE-byte request around faster on this machine."""

from __future__ import annotations

import os
import re
import subprocess
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
