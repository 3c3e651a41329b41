"""Names of the smcd D-Bus API: bus name, object paths, interfaces and error names.

One module so that the service, ``smcctl`` and the tests spell every name the same way. Interfaces
carry a version suffix (``Manager1``): an incompatible change gets a new interface next to the old
one, as BlueZ and systemd do, instead of breaking scripts written against the old one.
"""

from __future__ import annotations

BUS_NAME = "org.smcd"
ROOT_PATH = "/org/smcd"
"""Carries ``org.smcd.Manager1`` and ``org.freedesktop.DBus.ObjectManager`` for everything
below it."""

MANAGER_INTERFACE = "org.smcd.Manager1"
DEVICE_INTERFACE = "org.smcd.Device1"
LINK_GROUP_INTERFACE = "org.smcd.LinkGroup1"
LINK_INTERFACE = "org.smcd.Link1"
CONNECTION_INTERFACE = "org.smcd.Connection1"

OBJECT_MANAGER_INTERFACE = "org.freedesktop.DBus.ObjectManager"
PROPERTIES_INTERFACE = "org.freedesktop.DBus.Properties"

ERROR_INVALID = "org.smcd.Error.Invalid"
"""The request broke a rule (bad PNETID, duplicate UEID, ...); the message says which and why."""
ERROR_FAILED = "org.smcd.Error.Failed"
"""The request was valid but smcd could not carry it out; the message says why."""
ERROR_ACCESS_DENIED = "org.freedesktop.DBus.Error.AccessDenied"

DEVICE_ROOT = f"{ROOT_PATH}/device"
LINK_GROUP_ROOT = f"{ROOT_PATH}/linkgroup"
CONNECTION_ROOT = f"{ROOT_PATH}/connection"

NO_OBJECT = "/"
"""Object-path properties that point nowhere (a connection without link group) hold "/"."""

_PLAIN = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789")


def escape_path_element(name: str) -> str:
    """Encode any text as one object-path element, reversibly, as ``sd_bus_path_encode`` does:
    letters and digits stay, every other byte of the UTF-8 form becomes ``_`` plus two lower-case
    hex digits (so ``veth-a`` is ``veth_2da``); the empty string is ``_``."""
    if not name:
        return "_"
    out: list[str] = []
    for ch in name:
        if ch in _PLAIN:
            out.append(ch)
        else:
            out.extend(f"_{b:02x}" for b in ch.encode("utf-8", "surrogateescape"))
    return "".join(out)


def unescape_path_element(element: str) -> str:
    """Inverse of :func:`escape_path_element`."""
    if element == "_":
        return ""
    raw = bytearray()
    i = 0
    while i < len(element):
        if element[i] == "_":
            raw.append(int(element[i + 1 : i + 3], 16))
            i += 3
        else:
            raw.extend(element[i].encode("ascii"))
            i += 1
    return raw.decode("utf-8", "surrogateescape")


def device_path(name: str) -> str:
    return f"{DEVICE_ROOT}/{escape_path_element(name)}"


def link_group_path(lgr_id: int) -> str:
    """Link group ids appear as 8 hex digits, as smc-tools prints LG-ID."""
    return f"{LINK_GROUP_ROOT}/{lgr_id:08x}"


def link_path(lgr_id: int, link_id: int) -> str:
    return f"{link_group_path(lgr_id)}/link/{link_id}"


def connection_path(conn_id: int) -> str:
    return f"{CONNECTION_ROOT}/{conn_id}"
