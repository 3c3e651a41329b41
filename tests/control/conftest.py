"""Fixtures for the control-plane tests.

D-Bus: ``session_bus`` and ``system_bus`` each start a private, real dbus-daemon (see dbusd.py)
for one test and yield a :class:`tests.control.dbusd.DbusDaemon` (``.address`` to connect).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.control.dbusd import DbusDaemon, dbus_daemon


@pytest.fixture
def session_bus() -> Iterator[DbusDaemon]:
    with dbus_daemon("session") as bus:
        yield bus


@pytest.fixture
def system_bus() -> Iterator[DbusDaemon]:
    with dbus_daemon("system") as bus:
        yield bus
