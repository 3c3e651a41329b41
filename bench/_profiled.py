"""A process of ``bench/profile_connections.py`` under ``cProfile``, profiling only the
connections it is told to (not its start-up, imports or warm-up).

    python bench/_profiled.py OUT --entry MODULE:FUNC ARGS...   smcd (``smcd_daemon.daemon:main``)
    python bench/_profiled.py OUT --script PATH ARGS...         a program (under smc-run)
    python bench/_profiled.py OUT --conns PORT N WARMUP         the connecting client

``--entry`` and ``--script`` run the target in this process (smcd's ``READY=1`` is then its
own) and profile between SIGUSR1 and SIGUSR2; SIGUSR2 writes the statistics to OUT. ``--conns``
makes WARMUP connections, prints ``WARM`` and waits for a line on stdin (the harness starts the
others' profilers meanwhile), makes N profiled ones, each as ``bench/user_app.py conns`` makes
them (connect, 1-byte echo, close), writes OUT and exits.
"""

from __future__ import annotations

import cProfile
import importlib
import os
import runpy
import signal
import sys
import time
from types import FrameType

HERE = os.path.dirname(os.path.abspath(__file__))


def _profile() -> cProfile.Profile:
    """Own time in CPU time of this thread: a wait in a system call costs what it costs the
    CPU, not the time the process slept in it."""
    return cProfile.Profile(time.thread_time)


def _signalled(out: str) -> None:
    prof = _profile()

    def start(_sig: int, _frame: FrameType | None) -> None:
        prof.enable()

    def stop(_sig: int, _frame: FrameType | None) -> None:
        prof.disable()
        prof.dump_stats(out)

    signal.signal(signal.SIGUSR1, start)
    signal.signal(signal.SIGUSR2, stop)


def _conns(out: str, port: int, n: int, warmup: int) -> None:
    sys.path.insert(0, HERE)
    from user_app import _one

    times: list[int] = []
    for _ in range(warmup):
        _one(port, times)
    print("WARM", flush=True)
    sys.stdin.readline()
    prof = _profile()
    prof.enable()
    for _ in range(n):
        _one(port, times)
    prof.disable()
    prof.dump_stats(out)


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        sys.exit(__doc__)
    out, how, what, rest = argv[0], argv[1], argv[2], argv[3:]
    if how == "--conns":
        _conns(out, int(what), int(rest[0]), int(rest[1]))
        return 0
    _signalled(out)
    if how == "--entry":
        module, _, func = what.partition(":")
        sys.argv = [module, *rest]
        return int(getattr(importlib.import_module(module), func)(rest) or 0)
    if how == "--script":
        sys.argv = [what, *rest]
        sys.path.insert(0, os.path.dirname(os.path.abspath(what)))
        runpy.run_path(what, run_name="__main__")
        return 0
    sys.exit(f"_profiled.py: unknown mode {how!r}\n{__doc__}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
