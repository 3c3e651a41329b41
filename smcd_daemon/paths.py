"""Where a running smcd leaves what smcctl needs to find it (stdlib only).

Kept apart from :mod:`smcd_daemon.config` and :mod:`smcd_daemon.daemon` so that smcctl can
find the daemon without importing them: they pull in pydantic, pyroute2 and the whole daemon,
which cost every ``smcctl`` command ~0.3 s before its first D-Bus call.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from pathlib import Path

__all__ = ["BUS_RECORD_FILE", "PRIVATE_BUS_ADDRESS_FILE", "default_runtime_dir"]

PRIVATE_BUS_ADDRESS_FILE = "bus.address"
"""With ``dbus.bus = "private"`` smcd starts its own dbus-daemon and writes its address to this
file in the runtime dir (``smcctl --bus private`` reads it)."""

BUS_RECORD_FILE = "bus"
"""smcd writes the bus it serves ``org.smcd`` on to this file in the runtime dir (two lines: what
``dbus.bus`` said, then the address it connected to) and removes it on stop, so that smcctl run
with the same defaults finds it (see smcd_daemon.cli.discover)."""


def default_runtime_dir(env: Mapping[str, str] | None = None) -> Path:
    """``$XDG_RUNTIME_DIR/smcd``, else ``<tmp>/smcd-<uid>`` (unprivileged, per user)."""
    env = os.environ if env is None else env
    xdg = env.get("XDG_RUNTIME_DIR", "")
    if xdg.startswith("/"):
        return Path(xdg) / "smcd"
    return Path(tempfile.gettempdir()) / f"smcd-{os.getuid()}"
