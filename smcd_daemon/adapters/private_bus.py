"""The private dbus-daemon of an smcd run with ``--bus private`` (demos, tests, the bench), found
again from its runtime directory.

smcd starts that bus as its child and ends it when it stops; a killed smcd (SIGKILL, a crash, no
systemd cgroup around it) leaves it running. Two places end such a bus: the next smcd on the
same runtime directory, before it starts its own, and the demo's ``PrivateSmcd.cleanup``, before
it removes the directory (the bus would otherwise outlive everything that could find it)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

__all__ = [
    "bus_config",
    "bus_dir",
    "end_bus",
    "end_stale_bus",
    "gone",
    "pid_file",
    "stale_bus_pid",
]


def bus_dir(runtime_dir: Path) -> Path:
    return runtime_dir / "dbus"


def bus_config(runtime_dir: Path) -> Path:
    return bus_dir(runtime_dir) / "bus.conf"


def pid_file(runtime_dir: Path) -> Path:
    return bus_dir(runtime_dir) / "bus.pid"


def stale_bus_pid(runtime_dir: Path) -> int | None:
    """The pid in the bus's pid file if that process is a dbus-daemon running this runtime
    directory's configuration (a pid file can outlive its process, and the pid be reused)."""
    try:
        pid = int(pid_file(runtime_dir).read_text())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except (OSError, ValueError):
        return None
    if f"--config-file={bus_config(runtime_dir)}".encode() not in cmdline:
        return None
    return pid


def gone(pid: int) -> bool:
    """Has ``pid`` exited (a zombie counts: its parent has not reaped it yet)?"""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state == "Z"


def end_bus(pid: int, wait: float = 2.0) -> bool:
    """SIGTERM the bus ``pid`` found by :func:`stale_bus_pid` and wait up to ``wait`` seconds
    for it to exit (it is not the caller's child: no ``wait()``); False if it was gone."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return False
    deadline = time.monotonic() + wait
    while not gone(pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    return True


def end_stale_bus(runtime_dir: Path, wait: float = 2.0) -> int | None:
    """End the stale bus of ``runtime_dir`` (:func:`stale_bus_pid`, :func:`end_bus`); its pid,
    or None when there was none."""
    pid = stale_bus_pid(runtime_dir)
    return pid if pid is not None and end_bus(pid, wait) else None
