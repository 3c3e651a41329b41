"""The smcd D-Bus service: the model (registry, device inventory, tables) as D-Bus objects.

:class:`DbusService` exports ``/org/smcd`` (``Manager1``) and one object per device, link group,
link and connection, then follows the model through its observer callbacks: a record that
appears is exported (``InterfacesAdded``), one that changes has its properties recomputed
(``PropertiesChanged`` with what differs), one that goes is unexported (``InterfacesRemoved``).
Link state transitions and fallbacks are also announced as ``Manager1`` signals, so a monitor
needs one subscription to see every link flap and every fallback on the host.

Everything runs on the asyncio loop that owns the bus; model writers call the registry from that
same loop, so observer callbacks may send on the bus directly.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from typing import Any

from dbus_fast import DBusError, NameFlag, RequestNameReply
from dbus_fast.aio import MessageBus

from smcd_daemon.adapters.netns_view import namespace_devices, own_netns, pnet_keys
from smcd_daemon.core.devices import (
    DeviceEvent,
    DeviceInventory,
    LoopbackIsm,
    NetDevice,
    RdmaDevice,
)
from smcd_daemon.core.eid import EidTable
from smcd_daemon.core.pnet import PnetTable
from smcd_daemon.core.registry import (
    ChangeKind,
    Connection,
    ConnMode,
    Link,
    LinkGroup,
    Registry,
    RegistryEvent,
    Stats,
)
from smcd_daemon.wire.reasons import explain

from .bus import BusError, SmcdMessageBus, track_callers
from .manager import Manager, NamespaceRow, ServiceInfo
from .names import (
    BUS_NAME,
    ROOT_PATH,
    connection_path,
    device_path,
    link_group_path,
    link_path,
)
from .objects import (
    ConnectionObject,
    DeviceObject,
    LinkGroupObject,
    LinkObject,
    RecordInterface,
    connection_values,
    device_kind,
    device_values,
    link_group_values,
    link_values,
)

__all__ = ["DbusService", "reason_name"]

_log = logging.getLogger(__name__)

DeviceKey = tuple[str, object]


def reason_name(code: int) -> str:
    """``SMC_CLC_DECL_...`` for a known code, else its hex form."""
    exp = explain(code)
    return exp.name or exp.code_hex


class DbusService:
    """Exports the model on ``bus`` and keeps it current.

    ``on_change(kind)`` runs after every successful mutation through D-Bus ("pnet", "ueid",
    "seid", "stats"), so the daemon can persist its state; an :class:`SmcError` it raises is
    returned to the caller as ``org.smcd.Error.Failed``. Mutating methods are allowed to the uids
    in ``allowed_uids`` (default: root and the uid smcd runs as, which is root on the system bus).
    """

    def __init__(
        self,
        bus: MessageBus,
        registry: Registry,
        inventory: DeviceInventory,
        pnet: PnetTable,
        eids: EidTable,
        stats: Stats | None = None,
        *,
        info: ServiceInfo | None = None,
        on_change: Callable[[str], None] | None = None,
        allowed_uids: frozenset[int] | None = None,
    ) -> None:
        if not isinstance(bus, SmcdMessageBus):
            _log.warning(
                "D-Bus: %s sends InterfacesAdded/Removed from each object's own path; "
                "use smcd_daemon.adapters.dbus.connect() for spec-conforming ObjectManager signals",
                type(bus).__name__,
            )
        self.bus = bus
        self.registry = registry
        self.inventory = inventory
        self.pnet = pnet
        self.eids = eids
        self.stats = stats if stats is not None else registry.stats
        self._on_change = on_change
        self.manager = Manager(
            bus,
            pnet,
            eids,
            self.stats,
            info if info is not None else ServiceInfo(),
            self._tables_changed,
            allowed_uids if allowed_uids is not None else frozenset({0, os.geteuid()}),
            self._namespace_devices,
        )
        self._objects: dict[str, RecordInterface] = {}
        self._device_paths: dict[DeviceKey, str] = {}
        self._cleanup: list[Callable[[], None]] = []
        self._owns_name = False
        self._ns_scan: asyncio.Future[list[NamespaceRow]] | None = None

    # -- life cycle --------------------------------------------------------------------------

    async def start(self, *, request_name: bool = True) -> None:
        """Export everything, follow the model, then take the bus name (so a client that sees
        the name appear finds a complete tree). Raises :class:`BusError` if the name is taken or
        the bus policy refuses it."""
        self._cleanup.append(track_callers(self.bus))
        self.bus.export(ROOT_PATH, self.manager)
        self._sync_devices()
        for lgr in self.registry.link_groups():
            self._on_registry(RegistryEvent(ChangeKind.ADDED, None, lgr))
        for link in self.registry.links():
            self._on_registry(RegistryEvent(ChangeKind.ADDED, None, link))
        for conn in self.registry.connections():
            self._export(connection_path(conn.conn_id), ConnectionObject, self._conn_values(conn))
        self._cleanup.append(self.registry.subscribe(self._on_registry))
        self._cleanup.append(self.inventory.subscribe(self._on_device_event))
        if request_name:
            try:
                reply = await self.bus.request_name(BUS_NAME, NameFlag.DO_NOT_QUEUE)
            except DBusError as e:
                await self.stop()
                raise BusError(f"cannot own the D-Bus name {BUS_NAME}: {e.text}") from e
            if reply not in (RequestNameReply.PRIMARY_OWNER, RequestNameReply.ALREADY_OWNER):
                await self.stop()
                raise BusError(
                    f"cannot own the D-Bus name {BUS_NAME}: another process has it "
                    f"(is another smcd running?) [{reply.name}]"
                )
            self._owns_name = True

    async def stop(self) -> None:
        """Stop following the model, give up the name and unexport everything."""
        while self._cleanup:
            self._cleanup.pop()()
        if self._owns_name and self.bus.connected:
            self._owns_name = False
            try:
                await self.bus.release_name(BUS_NAME)
            except DBusError as e:
                _log.warning("D-Bus: releasing %s failed: %s", BUS_NAME, e)
        for path in list(self._objects):
            self._unexport(path)
        self._device_paths.clear()
        self.bus.unexport(ROOT_PATH, self.manager)

    def set_info(self, info: ServiceInfo) -> None:
        """Replace what GetInfo and the Manager1 properties report (e.g. capabilities after a
        reload that switched SMC modes); changed properties are signalled."""
        self.manager.set_info(info)
        self.manager.update(self.manager.current_values())

    def refresh(self) -> None:
        """Re-read the tables (after the daemon changed them itself, e.g. on reload) and emit
        what changed."""
        self.manager.update(self.manager.current_values())
        self._sync_devices()

    def object_paths(self) -> tuple[str, ...]:
        """Paths of every exported object below ``/org/smcd``."""
        return tuple(self._objects)

    # -- export helpers ----------------------------------------------------------------------

    def _export(self, path: str, cls: type[RecordInterface], values: dict[str, Any]) -> None:
        obj = cls(values)
        self._objects[path] = obj
        self.bus.export(path, obj)

    def _unexport(self, path: str) -> None:
        obj = self._objects.pop(path, None)
        if obj is not None:
            self.bus.unexport(path, obj)

    def _update(self, path: str, values: dict[str, Any]) -> dict[str, Any]:
        obj = self._objects.get(path)
        return obj.update(values) if obj is not None else {}

    def _tables_changed(self, kind: str) -> None:
        self.manager.update(self.manager.current_values())
        if kind == "pnet":
            self._sync_devices()  # device PNETIDs follow the table
        if self._on_change is not None:
            self._on_change(kind)

    # -- registry ----------------------------------------------------------------------------

    def _conn_values(self, conn: Connection) -> dict[str, Any]:
        return connection_values(conn, reason_name)

    def _lgr_values(self, lgr: LinkGroup) -> dict[str, Any]:
        return link_group_values(lgr, list(self.registry.links(lgr.lgr_id)))

    def _refresh_lgr(self, lgr_id: int) -> None:
        lgr = self.registry.link_group(lgr_id)
        if lgr is not None:
            self._update(link_group_path(lgr_id), self._lgr_values(lgr))

    def _on_registry(self, ev: RegistryEvent) -> None:
        rec = ev.record
        if isinstance(rec, LinkGroup):
            path = link_group_path(rec.lgr_id)
            if ev.kind is ChangeKind.ADDED:
                self._export(path, LinkGroupObject, self._lgr_values(rec))
            elif ev.kind is ChangeKind.CHANGED:
                self._update(path, self._lgr_values(rec))
            else:
                self._unexport(path)
        elif isinstance(rec, Link):
            self._on_link(ev, rec)
        else:
            self._on_connection(ev, rec)

    def _on_link(self, ev: RegistryEvent, link: Link) -> None:
        path = link_path(link.lgr_id, link.link_id)
        if ev.kind is ChangeKind.ADDED:
            self._export(path, LinkObject, link_values(link))
            self._refresh_lgr(link.lgr_id)
        elif ev.kind is ChangeKind.CHANGED:
            self._update(path, link_values(link))
            old = ev.old
            assert isinstance(old, Link)
            if old.state is not link.state:
                self.manager.link_state_changed(path, old.state.value, link.state.value)
        else:
            self._unexport(path)
            self._refresh_lgr(link.lgr_id)

    def _on_connection(self, ev: RegistryEvent, conn: Connection) -> None:
        path = connection_path(conn.conn_id)
        if ev.kind is ChangeKind.REMOVED:
            self._unexport(path)
            return
        if ev.kind is ChangeKind.ADDED:
            self._export(path, ConnectionObject, self._conn_values(conn))
        else:
            self._update(path, self._conn_values(conn))
        old = ev.old
        assert old is None or isinstance(old, Connection)
        fell_back = conn.mode is ConnMode.TCP and conn.fallback_reason != 0
        was_fallen_back = (
            old is not None
            and old.mode is ConnMode.TCP
            and old.fallback_reason == conn.fallback_reason
        )
        if fell_back and not was_fallen_back:
            self.manager.fallback(
                path, conn.fallback_reason, conn.peer_diagnosis, reason_name(conn.fallback_reason)
            )

    # -- devices -----------------------------------------------------------------------------

    def _on_device_event(self, ev: DeviceEvent) -> None:
        # Address changes arrive as a CHANGED NetDevice too; routes and neighbours have no
        # D-Bus objects.
        if isinstance(ev.object, NetDevice | RdmaDevice | LoopbackIsm):
            self._sync_devices()

    async def _namespace_devices(self) -> list[NamespaceRow]:
        """Manager1.NamespaceDevices: smcd's own devices, then those of every other namespace it
        knows of (named, or a namespace of a process whose connection or listener it holds).
        Callers that ask while a scan runs share its answer: a flood of calls (reading is open
        to everybody) costs one scan at a time."""
        if self._ns_scan is None or self._ns_scan.done():
            self._ns_scan = asyncio.ensure_future(self._scan_namespaces())
        return await asyncio.shield(self._ns_scan)

    async def _scan_namespaces(self) -> list[NamespaceRow]:
        mine = [dict(self._objects[p].values) for p in self._device_paths.values()]
        rows: list[NamespaceRow] = [(own_netns(), "host", True, mine, "")]
        pids = {c.pid for c in self.registry.connections() if c.pid}
        for ns in await namespace_devices(pids):
            # that namespace's netdevs, base devices and PNET entries (#15), not smcd's
            inv = DeviceInventory(loopback_enabled=False)
            for nd in ns.netdevs:
                inv.apply_link(nd)
            view = self.pnet.view(pnet_keys((ns.inode, ns.name)))
            devices = [device_values(nd, inv, view) for nd in ns.netdevs]
            rows.append((ns.inode, ns.name, False, devices, ns.problem))
        return rows

    def _wanted_devices(self) -> dict[DeviceKey, NetDevice | RdmaDevice | LoopbackIsm]:
        wanted: dict[DeviceKey, NetDevice | RdmaDevice | LoopbackIsm] = {}
        for nd in self.inventory.netdevs():
            wanted[("netdev", nd.ifindex)] = nd
        for rd in self.inventory.rdma_devices():
            wanted[("rdma", rd.name)] = rd
        lo = self.inventory.loopback_ism
        if lo.enabled:
            wanted[("ism", lo.name)] = lo
        return wanted

    def _sync_devices(self) -> None:
        """Make the Device1 objects match the inventory. Paths are
        ``/org/smcd/device/<escaped name>``; if two devices of different kinds share a name,
        the later one gets ``_<kind>`` appended (escaping never produces ``_`` followed by a
        non-hex letter, so that cannot collide with another name)."""
        wanted = self._wanted_devices()
        for key, old_path in list(self._device_paths.items()):
            gone = wanted.get(key)
            if gone is None or self._objects[old_path].values["Name"] != gone.name:
                self._unexport(old_path)
                del self._device_paths[key]
        for key, dev in wanted.items():
            values = device_values(dev, self.inventory, self.pnet)
            known = self._device_paths.get(key)
            if known is not None:
                self._update(known, values)
                continue
            path = device_path(dev.name)
            if path in self._objects:
                path = f"{path}_{device_kind(dev)}"
            self._device_paths[key] = path
            self._export(path, DeviceObject, values)
