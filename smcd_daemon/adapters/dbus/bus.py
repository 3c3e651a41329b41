"""The bus connection smcd serves on, and who is calling.

Two things dbus-fast does not do the way smcd needs:

- It sends ``InterfacesAdded``/``InterfacesRemoved`` from the path of the object that came or went.
  The D-Bus specification (and every ObjectManager client: GDBusObjectManagerClient, sd-bus,
  BlueZ tools) expects them from the object manager's own path, so :class:`SmcdMessageBus` sends
  them from ``/org/smcd`` for every object below it.
- Its writer takes a full send buffer (``EAGAIN`` from ``send``) for a dead bus and disconnects.
  A burst of signals (hundreds of connections coming and going) fills the socket buffer while
  the bus daemon is busy, and smcd would vanish from the bus. :class:`_PatientSocket` turns that
  into "nothing sent yet": the writer keeps its place and waits for the socket to drain.
- It logs the error of a method call flagged NO_REPLY_EXPECTED as "unexpected exception in
  future" at ERROR with a traceback, also when the error is the method's answer (another uid's
  mutation refused). Anybody on the bus could fill the log that way; :class:`SmcdMessageBus`
  logs such an answer as one line, rate-limited, and keeps the traceback for real failures.
- Method handlers are not told who called. smcd must re-check the caller of every mutating method
  (a session or private bus has no policy file to do it), so a message filter records the sender
  of each method call in a :class:`contextvars.ContextVar`; dbus-fast starts the handler task
  from within that same dispatch, so the task inherits the value (:func:`current_caller`).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import socket
from collections.abc import Callable
from typing import Any, cast

from dbus_fast import BusType, DBusError, Message, MessageType
from dbus_fast.aio import MessageBus
from dbus_fast.service import ServiceInterface

from smcd_daemon.adapters.ratelimit import RateLimitedLog
from smcd_daemon.errors import SmcError

from .names import OBJECT_MANAGER_INTERFACE, ROOT_PATH

__all__ = [
    "BusError",
    "SmcdMessageBus",
    "caller_unix_user",
    "connect",
    "current_caller",
    "track_callers",
]

log = logging.getLogger(__name__)
_unanswered = RateLimitedLog(log, burst=10, period=60.0)
"""Errors of calls that expected no reply: whoever sends them decides how many there are."""

_caller: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "smcd_dbus_caller", default=None
)


class BusError(SmcError):
    """The bus itself failed us: cannot connect, cannot own the name, cannot identify a caller."""


class _PatientSocket:
    """The bus socket as dbus-fast's writer sees it: ``send`` reports a full buffer as 0 bytes
    sent, so the writer waits for writability instead of tearing the connection down.

    ``sendmsg`` (file-descriptor passing, which smcd never does on the bus) is left alone: the
    writer forgets the descriptors after any return, so only an exception is safe there."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock

    def send(self, data: Any) -> int:
        try:
            return self._sock.send(data)
        except (BlockingIOError, InterruptedError):
            return 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


class SmcdMessageBus(MessageBus):
    """An asyncio bus connection whose ObjectManager signals come from :data:`ROOT_PATH`."""

    object_manager_path = ROOT_PATH

    async def connect(self) -> SmcdMessageBus:
        await super().connect()
        writer = self._writer
        sock = writer.sock if writer is not None else None
        if writer is not None and isinstance(sock, socket.socket):
            writer.sock = cast(socket.socket, _PatientSocket(sock))
        return self

    def _future_exception_no_reply(self, fut: asyncio.Future[Any]) -> None:
        """A no-reply call's method finished: an error it raised as its answer (DBusError:
        refused, invalid) is one rate-limited line; anything else goes to dbus-fast, which
        logs it with its traceback (a bug of ours)."""
        error = None if fut.cancelled() else fut.exception()
        if not isinstance(error, DBusError):
            super()._future_exception_no_reply(fut)
            return
        self._pending_futures.discard(fut)
        _unanswered.info(
            f"no-reply {error.type}",
            "a method call that expected no reply failed: %s: %s",
            error.type,
            error.text,
        )

    def _manager_for(self, path: str) -> str | None:
        root = self.object_manager_path
        return root if path.startswith(root + "/") else None

    def _emit_interface_added(self, path: str, interface: ServiceInterface) -> None:
        manager = self._manager_for(path)
        if manager is None:
            super()._emit_interface_added(path, interface)
            return
        if self._disconnected:
            return

        def send(iface: ServiceInterface, values: Any, _user: Any, err: Exception | None) -> None:
            if err is not None or self._disconnected:
                return
            self.send(
                Message.new_signal(
                    path=manager,
                    interface=OBJECT_MANAGER_INTERFACE,
                    member="InterfacesAdded",
                    signature="oa{sa{sv}}",
                    body=[path, {iface.name: values}],
                )
            )

        ServiceInterface._get_all_property_values(interface, send)

    def _emit_interface_removed(self, path: str, removed_interfaces: list[str]) -> None:
        manager = self._manager_for(path)
        if manager is None:
            super()._emit_interface_removed(path, removed_interfaces)
            return
        if self._disconnected:
            return
        self.send(
            Message.new_signal(
                path=manager,
                interface=OBJECT_MANAGER_INTERFACE,
                member="InterfacesRemoved",
                signature="oas",
                body=[path, removed_interfaces],
            )
        )


async def connect(bus: str = "system") -> SmcdMessageBus:
    """Connect to ``"system"``, ``"session"`` or a D-Bus address (``unix:path=...``)."""
    try:
        if bus == "system":
            conn = SmcdMessageBus(bus_type=BusType.SYSTEM)
        elif bus == "session":
            conn = SmcdMessageBus(bus_type=BusType.SESSION)
        else:
            conn = SmcdMessageBus(bus_address=bus)
        await conn.connect()
    except Exception as e:  # dbus-fast raises OSError, AuthError, InvalidAddressError, ...
        raise BusError(f"cannot connect to the D-Bus {bus!r} bus: {e}") from e
    return conn


def track_callers(bus: MessageBus) -> Callable[[], None]:
    """Record the sender of every incoming method call for :func:`current_caller`; returns a
    function that stops recording."""

    def remember(msg: Message) -> None:
        if msg.message_type is MessageType.METHOD_CALL:
            _caller.set(msg.sender)

    bus.add_message_handler(remember)
    return lambda: bus.remove_message_handler(remember)


def current_caller() -> str | None:
    """Unique bus name of the client whose method call is being handled (None if unknown)."""
    return _caller.get()


async def caller_unix_user(bus: MessageBus, sender: str) -> int:
    """The Unix uid behind a unique bus name, as the bus daemon vouches for it."""
    reply = await bus.call(
        Message(
            destination="org.freedesktop.DBus",
            path="/org/freedesktop/DBus",
            interface="org.freedesktop.DBus",
            member="GetConnectionUnixUser",
            signature="s",
            body=[sender],
        )
    )
    if reply is None or reply.message_type is not MessageType.METHOD_RETURN:
        detail = reply.body if reply is not None else "no reply"
        raise BusError(f"the bus could not tell the uid of {sender}: {detail}")
    uid = reply.body[0]
    assert isinstance(uid, int)
    return uid
