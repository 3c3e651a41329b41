"""A real, private ``dbus-daemon`` for tests: session-like or system-like.

- ``session``: everybody may own names and send anything (like the session bus), but any uid may
  connect, so a test can also call in as an unprivileged user and hit smcd's own uid check.
- ``system``: the default-deny rules of the distribution's ``system.conf`` (no name ownership, no
  method calls unless a policy file punches a hole) plus ``<include>`` of our policy file
  ``config/dbus-1/system.d/org.smcd.conf`` — the very file a package installs.

The socket lives in a fresh directory under /tmp with mode 0755 (pytest's tmp_path is 0700), so
a client running as ``nobody`` can reach it. The daemon is killed and the directory removed on
exit. ``dbus-daemon`` comes with the ``dbus`` package (tests/host/install-deps.sh installs it).

Also here, for the D-Bus tests: :func:`smcd_on_bus` runs the real smcd D-Bus service on such a bus
next to a real client connection that records every signal from ``org.smcd``, and :func:`run`
starts external tools (busctl, gdbus) without blocking the event loop that serves the bus.
"""

from __future__ import annotations

import asyncio
import os
import select
import shutil
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from dbus_fast import Message, MessageType
from dbus_fast.aio import MessageBus

from smcd_daemon.adapters.dbus import BUS_NAME, DbusService, connect
from smcd_daemon.core.devices import DeviceInventory, NetDevice, OperState
from smcd_daemon.core.eid import EidTable
from smcd_daemon.core.pnet import PnetTable
from smcd_daemon.core.registry import Registry

REPO = Path(__file__).resolve().parents[2]
POLICY_FILE = REPO / "config" / "dbus-1" / "system.d" / "org.smcd.conf"

NOBODY_UID = 65534
NOBODY_GID = 65534

_HEADER = """<!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-Bus Bus Configuration 1.0//EN"
 "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">
"""

SESSION_CONFIG = (
    _HEADER
    + """<busconfig>
  <type>session</type>
  <listen>unix:path={socket}</listen>
  <auth>EXTERNAL</auth>
  <policy context="default">
    <allow user="*"/>
    <allow send_destination="*" eavesdrop="true"/>
    <allow eavesdrop="true"/>
    <allow own="*"/>
  </policy>
</busconfig>
"""
)

# The default policy of dbus 1.14's system.conf, verbatim in effect; only <user>, <fork>, the
# pid file, syslog, service activation and the standard include dirs are left out.
SYSTEM_CONFIG = (
    _HEADER
    + """<busconfig>
  <type>system</type>
  <listen>unix:path={socket}</listen>
  <auth>EXTERNAL</auth>
  <policy context="default">
    <allow user="*"/>
    <deny own="*"/>
    <deny send_type="method_call"/>
    <allow send_type="signal"/>
    <allow send_requested_reply="true" send_type="method_return"/>
    <allow send_requested_reply="true" send_type="error"/>
    <allow receive_type="method_call"/>
    <allow receive_type="method_return"/>
    <allow receive_type="error"/>
    <allow receive_type="signal"/>
    <allow send_destination="org.freedesktop.DBus"
           send_interface="org.freedesktop.DBus" />
    <allow send_destination="org.freedesktop.DBus"
           send_interface="org.freedesktop.DBus.Introspectable"/>
    <allow send_destination="org.freedesktop.DBus"
           send_interface="org.freedesktop.DBus.Properties"/>
    <deny send_destination="org.freedesktop.DBus"
          send_interface="org.freedesktop.DBus"
          send_member="UpdateActivationEnvironment"/>
    <deny send_destination="org.freedesktop.DBus"
          send_interface="org.freedesktop.DBus.Debug.Stats"/>
  </policy>
  <policy user="root">
    <allow send_destination="org.freedesktop.DBus"
           send_interface="org.freedesktop.DBus.Monitoring"/>
  </policy>
  <include>{policy}</include>
</busconfig>
"""
)


@dataclass
class DbusDaemon:
    kind: str
    address: str
    socket_path: Path
    config_path: Path
    process: subprocess.Popen[bytes]


def _need(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        raise RuntimeError(
            f"{tool} is not installed: run tests/host/install-deps.sh (package dbus / "
            "dbus-daemon, systemd for busctl, libglib2.0-bin for gdbus)"
        )
    return path


@contextmanager
def dbus_daemon(
    kind: Literal["session", "system"], *, policy: Path = POLICY_FILE
) -> Iterator[DbusDaemon]:
    """Run a private dbus-daemon; yield its address; kill it afterwards."""
    binary = _need("dbus-daemon")
    workdir = Path(tempfile.mkdtemp(prefix=f"smcd-dbus-{kind}-", dir="/tmp"))
    os.chmod(workdir, 0o755)
    sock = workdir / "bus.sock"
    conf = workdir / f"{kind}.conf"
    template = SESSION_CONFIG if kind == "session" else SYSTEM_CONFIG
    conf.write_text(template.format(socket=sock, policy=policy))
    proc = subprocess.Popen(
        [binary, f"--config-file={conf}", "--print-address=1", "--nofork", "--nosyslog"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 10.0)
        line = proc.stdout.readline().decode().strip() if ready else ""
        if not line:
            proc.kill()
            _, err = proc.communicate(timeout=5)
            raise RuntimeError(
                f"dbus-daemon ({kind}) did not start: {err.decode(errors='replace')}"
            )
        os.chmod(sock, 0o777)  # dbus-daemon leaves it to the umask; the system bus socket is 0666
        yield DbusDaemon(kind, line, sock, conf, proc)
    finally:
        proc.kill()
        proc.wait(timeout=10)
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
        shutil.rmtree(workdir, ignore_errors=True)


def as_nobody(argv: list[str]) -> list[str]:
    """Prefix a command so that it runs as uid/gid 65534 with no supplementary groups."""
    return [
        _need("setpriv"),
        f"--reuid={NOBODY_UID}",
        f"--regid={NOBODY_GID}",
        "--clear-groups",
        "--",
        *argv,
    ]


# -- the smcd D-Bus service and a client, for tests ------------------------------------------------

SIGNAL_TIMEOUT = 1.0
"""The issue's bound: a change shows up on D-Bus within a second."""


def lo_device() -> NetDevice:
    return NetDevice(
        1, "lo", mtu=65536, operstate=OperState.UNKNOWN, admin_up=True, carrier=True, kind=None
    )


def veth_device(*, up: bool = True, name: str = "veth-a") -> NetDevice:
    return NetDevice(
        7,
        name,
        mac="02:00:00:00:00:0a",
        mtu=1500,
        operstate=OperState.UP if up else OperState.DOWN,
        admin_up=up,
        carrier=up,
        kind="veth",
    )


@dataclass
class Harness:
    address: str
    registry: Registry
    inventory: DeviceInventory
    pnet: PnetTable
    eids: EidTable
    service: DbusService
    client: MessageBus
    signals: list[Message] = field(default_factory=list)
    changes: list[str] = field(default_factory=list)
    _arrived: asyncio.Event = field(default_factory=asyncio.Event)

    def _on_message(self, msg: Message) -> None:
        if msg.message_type is MessageType.SIGNAL and msg.path and msg.path.startswith("/org/smcd"):
            self.signals.append(msg)
            self._arrived.set()

    async def call(
        self, path: str, interface: str, member: str, signature: str = "", body: Sequence[Any] = ()
    ) -> Message:
        reply = await self.client.call(
            Message(
                destination=BUS_NAME,
                path=path,
                interface=interface,
                member=member,
                signature=signature,
                body=list(body),
            )
        )
        assert reply is not None
        return reply

    async def ok(
        self, path: str, interface: str, member: str, signature: str = "", body: Sequence[Any] = ()
    ) -> list[Any]:
        reply = await self.call(path, interface, member, signature, body)
        assert reply.message_type is MessageType.METHOD_RETURN, (reply.error_name, reply.body)
        return list(reply.body)

    async def manager(self, member: str, signature: str = "", body: Sequence[Any] = ()) -> Message:
        return await self.call("/org/smcd", "org.smcd.Manager1", member, signature, body)

    async def managed_objects(self) -> dict[str, dict[str, dict[str, Any]]]:
        (objects,) = await self.ok(
            "/org/smcd", "org.freedesktop.DBus.ObjectManager", "GetManagedObjects"
        )
        return {
            path: {iface: {k: v.value for k, v in props.items()} for iface, props in ifaces.items()}
            for path, ifaces in objects.items()
        }

    async def wait_signal(
        self, predicate: Callable[[Message], bool], timeout: float = SIGNAL_TIMEOUT
    ) -> tuple[Message, float]:
        """The first recorded signal matching ``predicate`` (already arrived or arriving within
        ``timeout``), and how long we waited for it."""
        start = time.monotonic()
        deadline = start + timeout
        seen = 0
        while True:
            for msg in self.signals[seen:]:
                if predicate(msg):
                    return msg, time.monotonic() - start
            seen = len(self.signals)
            self._arrived.clear()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                got = [(m.path, m.interface, m.member, m.body) for m in self.signals]
                raise AssertionError(f"no matching signal within {timeout} s; got {got}")
            with suppress(TimeoutError):
                await asyncio.wait_for(self._arrived.wait(), remaining)


def is_signal(member: str, path: str | None = None, arg0: Any = None) -> Callable[[Message], bool]:
    def match(msg: Message) -> bool:
        return (
            msg.member == member
            and (path is None or msg.path == path)
            and (arg0 is None or bool(msg.body and msg.body[0] == arg0))
        )

    return match


def props_changed(path: str, interface: str) -> Callable[[Message], bool]:
    return lambda m: m.member == "PropertiesChanged" and m.path == path and m.body[0] == interface


def changed_values(msg: Message) -> dict[str, Any]:
    return {k: v.value for k, v in msg.body[1].items()}


@asynccontextmanager
async def smcd_on_bus(address: str, *, request_name: bool = True) -> AsyncIterator[Harness]:
    """The D-Bus service over a fresh model (lo, veth-a and loopback-ism as devices), plus a
    client connection subscribed to every signal from org.smcd."""
    registry = Registry()
    inventory = DeviceInventory()
    inventory.apply_link(lo_device())
    inventory.apply_link(veth_device())
    pnet = PnetTable()
    eids = EidTable()
    bus = await connect(address)
    changes: list[str] = []
    service = DbusService(bus, registry, inventory, pnet, eids, on_change=changes.append)
    await service.start(request_name=request_name)
    client = await MessageBus(bus_address=address).connect()
    h = Harness(address, registry, inventory, pnet, eids, service, client, changes=changes)
    client.add_message_handler(h._on_message)
    await _add_match(client)
    try:
        yield h
    finally:
        client.disconnect()
        await service.stop()
        bus.disconnect()


async def _add_match(client: MessageBus) -> None:
    reply = await client.call(
        Message(
            destination="org.freedesktop.DBus",
            path="/org/freedesktop/DBus",
            interface="org.freedesktop.DBus",
            member="AddMatch",
            signature="s",
            body=[f"type='signal',sender='{BUS_NAME}'"],
        )
    )
    assert reply is not None and reply.message_type is MessageType.METHOD_RETURN


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str


async def run(argv: Sequence[str], timeout: float = 20.0) -> Run:
    """Run a tool without blocking the loop that serves the bus."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": "/tmp", "LC_ALL": "C.UTF-8"}
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
    )
    out, err = await asyncio.wait_for(proc.communicate(), timeout)
    assert proc.returncode is not None
    return Run(proc.returncode, out.decode(errors="replace"), err.decode(errors="replace"))


def gdbus_call(address: str, method: str, *args: str, path: str = "/org/smcd") -> list[str]:
    """argv for ``gdbus call`` (arguments in GVariant text; types come from introspection)."""
    return [
        "gdbus",
        "call",
        "--address",
        address,
        "--dest",
        BUS_NAME,
        "--object-path",
        path,
        "--method",
        method,
        *args,
    ]


def busctl(address: str, *args: str) -> list[str]:
    return ["busctl", f"--address={address}", "--no-pager", *args]
