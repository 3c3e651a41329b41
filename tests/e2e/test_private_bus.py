"""smcd's private D-Bus bus (``--bus private``, demos and tests) after smcd was SIGKILLed: the
killed daemon's dbus-daemon outlives it (no systemd cgroup ends it here), and the restarted smcd
ends it before starting its own, so restarts do not pile up buses (the soak's chaos phase left
one per kill); ``PrivateSmcd.cleanup`` ends it when no smcd is restarted."""

from __future__ import annotations

import os
import time

from smcd_daemon.adapters import private_bus
from smcd_daemon.demo import PrivateSmcd


def _bus_pid(daemon: PrivateSmcd) -> int:
    return int(private_bus.pid_file(daemon.workdir).read_text())


def _alive(pid: int) -> bool:
    return not private_bus.gone(pid)


def test_a_restarted_smcd_ends_the_killed_ones_bus() -> None:
    daemon = PrivateSmcd(name="privbus").start()
    try:
        first = _bus_pid(daemon)
        assert _alive(first)
        assert daemon.proc is not None
        daemon.proc.kill()
        daemon.proc.wait()
        time.sleep(0.2)
        assert _alive(first), "the killed smcd's bus is expected to outlive it"
        daemon.launch()
        daemon.wait_ready(30)
        second = _bus_pid(daemon)
        assert second != first and _alive(second)
        assert not _alive(first), f"the killed smcd's dbus-daemon {first} is still running"
        assert "ended the private dbus-daemon" in daemon.log()
        assert daemon.smcctl("info").returncode == 0  # the new bus serves
    finally:
        daemon.cleanup()
    assert not _alive(second), "a stopped smcd's bus is ended with it"
    assert not os.path.exists(daemon.workdir)


def test_cleanup_ends_the_bus_of_a_killed_smcd() -> None:
    daemon = PrivateSmcd(name="privbus").start()
    try:
        first = _bus_pid(daemon)
        assert daemon.proc is not None
        daemon.proc.kill()
        daemon.proc.wait()
        time.sleep(0.2)
        assert _alive(first), "the killed smcd's bus is expected to outlive it"
    finally:
        daemon.cleanup()
    assert not _alive(first), f"the killed smcd's dbus-daemon {first} outlived the cleanup"
    assert not os.path.exists(daemon.workdir)
