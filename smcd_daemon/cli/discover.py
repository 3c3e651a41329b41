"""Where is smcd? smcctl's answer when no ``--bus`` (or ``$SMCD_BUS``) is given.

smcd picks its bus from its configuration (``dbus.bus``): the installed service says "system";
run by hand without ``--config`` it takes the session bus when the user has one, else a private
bus of its own. Every smcd records what it chose in ``<runtime_dir>/bus`` (the spec and the
address it connected to; see smcd_daemon.paths.BUS_RECORD_FILE). smcctl looks, in this order:

1. the system bus, if ``org.smcd`` has an owner there (the service runs);
2. the record in the runtime dir smcd would use with the same defaults (``$SMCD_RUNTIME_DIR``,
   else ``$XDG_RUNTIME_DIR/smcd`` or ``/tmp/smcd-UID``), then in ``/run/smcd`` (a root smcd
   whose configuration names another bus), if ``org.smcd`` has an owner on the bus it names;
3. the session bus, if ``org.smcd`` has an owner there;
4. the system bus again if ``org.smcd`` is activatable there (installed: the first call starts
   the service through D-Bus activation).

When all fail, the error names every place and why it did not count.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

from dbus_fast import BusType, Message, MessageType
from dbus_fast.aio import MessageBus

from smcd_daemon.adapters.dbus.names import BUS_NAME

__all__ = ["ENV_RUNTIME_DIR", "SYSTEM_RUNTIME_DIR", "NotFound", "find_daemon", "record_dirs"]

ENV_RUNTIME_DIR = "SMCD_RUNTIME_DIR"
SYSTEM_RUNTIME_DIR = Path("/run/smcd")
PROBE_TIMEOUT = 5.0


class NotFound(Exception):
    """No smcd anywhere; ``str()`` lists where smcctl looked."""


def record_dirs() -> list[Path]:
    """Runtime dirs whose ``bus`` record smcctl reads, in order (no duplicates)."""
    from smcd_daemon.paths import default_runtime_dir

    env_dir = os.environ.get(ENV_RUNTIME_DIR)
    dirs = [Path(env_dir) if env_dir else default_runtime_dir(), SYSTEM_RUNTIME_DIR]
    return list(dict.fromkeys(dirs))


async def _call_dbus(
    bus: MessageBus, member: str, signature: str = "", body: list[str] | None = None
) -> Any:
    reply = await asyncio.wait_for(
        bus.call(
            Message(
                destination="org.freedesktop.DBus",
                path="/org/freedesktop/DBus",
                interface="org.freedesktop.DBus",
                member=member,
                signature=signature,
                body=body or [],
            )
        ),
        PROBE_TIMEOUT,
    )
    if reply is None or reply.message_type is MessageType.ERROR:
        raise OSError(f"{member} failed: {reply.body if reply else 'no reply'}")
    return reply.body[0]


async def _connect(bus_type: BusType | None = None, address: str | None = None) -> MessageBus:
    bus = MessageBus(bus_type=bus_type) if bus_type is not None else MessageBus(bus_address=address)
    return await asyncio.wait_for(bus.connect(), PROBE_TIMEOUT)


async def _owned(bus: MessageBus) -> bool:
    return bool(await _call_dbus(bus, "NameHasOwner", "s", [BUS_NAME]))


def _session_available() -> bool:
    if os.environ.get("DBUS_SESSION_BUS_ADDRESS"):
        return True
    xdg = os.environ.get("XDG_RUNTIME_DIR", "")
    return xdg.startswith("/") and (Path(xdg) / "bus").exists()


async def find_daemon() -> tuple[MessageBus, str]:
    """A connection to the bus where smcd is, and its label for messages; :class:`NotFound`."""
    looked: list[str] = []
    system: MessageBus | None = None
    activatable = False

    # 1. the system service
    try:
        system = await _connect(BusType.SYSTEM)
        if await _owned(system):
            return system, "the system bus"
        activatable = BUS_NAME in await _call_dbus(system, "ListActivatableNames")
        looked.append(
            "the system bus (org.smcd has no owner"
            + (", but is activatable)" if activatable else ")")
        )
    except Exception as e:
        looked.append(f"the system bus (cannot connect: {e or type(e).__name__})")

    try:
        # 2. what an smcd with the same defaults recorded
        for rdir in record_dirs():
            record = rdir / "bus"
            try:
                spec, address = record.read_text().split("\n")[:2]
            except FileNotFoundError:
                looked.append(f"{record} (no such file: no smcd recorded a bus there)")
                continue
            except (OSError, ValueError) as e:
                looked.append(f"{record} (unreadable: {e})")
                continue
            try:
                bus = await _connect(address=address)
            except Exception as e:
                looked.append(f"{record} -> {address} (cannot connect: {e or type(e).__name__})")
                continue
            if await _owned(bus):
                if system is not None:
                    system.disconnect()
                return bus, f"the {spec} bus recorded in {record} ({address})"
            bus.disconnect()
            looked.append(f"{record} -> {address} (org.smcd has no owner: stale record)")

        # 3. the session bus
        if _session_available():
            try:
                session = await _connect(BusType.SESSION)
                if await _owned(session):
                    if system is not None:
                        system.disconnect()
                    return session, "the session bus"
                session.disconnect()
                looked.append("the session bus (org.smcd has no owner)")
            except Exception as e:
                looked.append(f"the session bus (cannot connect: {e or type(e).__name__})")
        else:
            looked.append("the session bus (none: DBUS_SESSION_BUS_ADDRESS is not set)")
    except BaseException:
        if system is not None:
            system.disconnect()
        raise

    # 4. installed but not started: D-Bus activation starts it on the first call
    if system is not None and activatable:
        return system, "the system bus"
    if system is not None:
        system.disconnect()
    raise NotFound("smcd is not running: looked on " + "; ".join(looked))
