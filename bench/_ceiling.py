"""The machine's own ceiling for the 64 KiB throughput figure: ``bench/ceiling.c``, compiled at
run time, moves the same bytes the same way smcd's figure does (64 KiB writes into a 1 MiB
shared ring, copied out into a 1 MiB read buffer by another process) with nothing but C between
the two processes.

Why this is the bound and not, say, memcpy speed: the reader's core has to pull every cache line
the writer's core just wrote. On the 2-vCPU machine this was built on, a reader that touches one
byte per line gets as far as one that copies, and only a reader that never looks at the data
goes twice as fast (``bench/RESULTS.md``). So no receiver that reads its data, in any language,
beats this figure here, and a target above it cannot be met on this machine.

Nothing binary is committed: the source is compiled into a temporary directory for every run,
with ``$CC`` or the first of cc, gcc, clang found on ``PATH``.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCE = Path(__file__).resolve().parent / "ceiling.c"
COMPILERS = ("cc", "gcc", "clang")
INSTALL_HINT = "install gcc (apt-get install gcc)"
TIMEOUT = 360.0
"""Longer than the program's own alarm (300 s), which ends a hang with its consumer."""
_RESULT = re.compile(r"^RESULT bytes_per_s=(\S+) runs=(\S+) verified=(\d+)$", re.M)


class CeilingError(RuntimeError):
    """The ceiling could not be measured (no compiler, a build error, wrong data, ...)."""


def compiler() -> list[str]:
    """The C compiler command: ``$CC`` (may carry flags), else cc, gcc or clang on ``PATH``."""
    cc = os.environ.get("CC", "").strip()
    if cc:
        cmd = shlex.split(cc)
        if shutil.which(cmd[0]) is None:
            raise CeilingError(f"$CC={cc!r} is not on PATH: {INSTALL_HINT}, or fix $CC")
        return cmd
    for name in COMPILERS:
        if shutil.which(name):
            return [name]
    raise CeilingError(f"no C compiler ({', '.join(COMPILERS)}) found: {INSTALL_HINT}")


def build(workdir: Path) -> Path:
    """Compile ``ceiling.c`` into ``workdir``; the executable's path."""
    exe = workdir / "ceiling"
    cmd = [*compiler(), "-O2", "-std=c11", "-o", os.fspath(exe), os.fspath(SOURCE)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    if proc.returncode != 0:
        raise CeilingError(f"{shlex.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return exe


def measure(
    ring: int,
    chunk: int,
    rbuf: int,
    volume: int,
    warmup: int,
    repeats: int,
    mode: str = "copy",
) -> float:
    """Bytes per second, the median of ``repeats`` runs of ``volume`` bytes after ``warmup``
    bytes, in ``chunk``-byte writes through a ``ring``-byte ring into an ``rbuf``-byte read
    buffer (``mode``: ``copy``, or the ``touch``/``none`` readers of the evidence). Volumes are
    rounded down to whole writes. Raises :class:`CeilingError` when it cannot say."""
    volume -= volume % chunk
    warmup -= warmup % chunk
    with tempfile.TemporaryDirectory(prefix="smcd-ceiling-") as tmp:
        exe = build(Path(tmp))
        args = [os.fspath(exe), *map(str, (ring, chunk, rbuf, volume, warmup, repeats)), mode]
        try:
            proc = subprocess.run(
                args, capture_output=True, text=True, timeout=TIMEOUT, check=False
            )
        except subprocess.TimeoutExpired as e:
            raise CeilingError(f"ceiling did not finish within {TIMEOUT:.0f} s") from e
    found = _RESULT.search(proc.stdout)
    if proc.returncode != 0 or found is None:
        why = proc.stderr.strip() or proc.stdout.strip() or "no output"
        raise CeilingError(f"ceiling failed ({proc.returncode}): {why}")
    if mode != "none" and int(found[3]) == 0:
        raise CeilingError("ceiling verified no data")
    return float(found[1])
