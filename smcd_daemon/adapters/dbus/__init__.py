"""smcd's D-Bus API (dbus-fast, asyncio): bus name ``org.smcd``, objects below ``/org/smcd``.

Start it with::

    bus = await connect(config.dbus.bus)          # "system", "session" or an address
    service = DbusService(bus, registry, inventory, pnet, eids, info=ServiceInfo(...))
    await service.start()

See :mod:`.names` for every name, :mod:`.objects` for the object properties and :mod:`.manager`
for the ``Manager1`` methods and signals.
"""

from __future__ import annotations

from .bus import BusError, SmcdMessageBus, caller_unix_user, connect, current_caller
from .manager import Manager, ServiceInfo
from .names import (
    BUS_NAME,
    CONNECTION_INTERFACE,
    DEVICE_INTERFACE,
    ERROR_ACCESS_DENIED,
    ERROR_FAILED,
    ERROR_INVALID,
    LINK_GROUP_INTERFACE,
    LINK_INTERFACE,
    MANAGER_INTERFACE,
    ROOT_PATH,
    connection_path,
    device_path,
    link_group_path,
    link_path,
)
from .service import DbusService, reason_name

__all__ = [
    "BUS_NAME",
    "CONNECTION_INTERFACE",
    "DEVICE_INTERFACE",
    "ERROR_ACCESS_DENIED",
    "ERROR_FAILED",
    "ERROR_INVALID",
    "LINK_GROUP_INTERFACE",
    "LINK_INTERFACE",
    "MANAGER_INTERFACE",
    "ROOT_PATH",
    "BusError",
    "DbusService",
    "Manager",
    "ServiceInfo",
    "SmcdMessageBus",
    "caller_unix_user",
    "connect",
    "connection_path",
    "current_caller",
    "device_path",
    "link_group_path",
    "link_path",
    "reason_name",
]
