"""The D-Bus objects that mirror model records: Device1, LinkGroup1, Link1, Connection1.

Each interface is a table of read-only, typed properties plus one pure function that computes all
their values from a model record. The service recomputes the values on every model change and
:meth:`RecordInterface.update` emits ``PropertiesChanged`` with exactly the properties whose value
differs, so "PropertiesChanged on every state change" holds by construction, for every property,
without per-field bookkeeping.

Conventions: identifiers that are byte strings (GIDs, system ids, link UIDs) are text, in the
form smc-tools prints them (RoCE GIDs as IPv6 addresses, ISM GIDs and ids as hex); absent strings
are "", absent object paths "/", absent numbers 0.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from dbus_fast.constants import PropertyAccess
from dbus_fast.service import ServiceInterface, dbus_property

from smcd_daemon.core.devices import DeviceInventory, LoopbackIsm, NetDevice, RdmaDevice
from smcd_daemon.core.pnet import PnetTable, PnetView
from smcd_daemon.core.registry import Connection, Link, LinkGroup, SmcType
from smcd_daemon.wire.cursor import Cursor

from .names import (
    CONNECTION_INTERFACE,
    DEVICE_INTERFACE,
    LINK_GROUP_INTERFACE,
    LINK_INTERFACE,
    NO_OBJECT,
    link_group_path,
    link_path,
)

__all__ = [
    "ConnectionObject",
    "DeviceObject",
    "LinkGroupObject",
    "LinkObject",
    "RecordInterface",
    "connection_values",
    "device_values",
    "link_group_values",
    "link_values",
]


class RecordInterface(ServiceInterface):
    """A read-only interface whose properties come from a dict of current values."""

    INTERFACE: ClassVar[str]
    PROPERTIES: ClassVar[Mapping[str, str]]  # D-Bus name -> signature

    def __init__(self, values: Mapping[str, Any]) -> None:
        super().__init__(self.INTERFACE)
        missing = self.PROPERTIES.keys() - values.keys()
        if missing:
            raise ValueError(f"{self.INTERFACE}: no value for {sorted(missing)}")
        self._values: dict[str, Any] = dict(values)

    @property
    def values(self) -> Mapping[str, Any]:
        return dict(self._values)

    def update(self, values: Mapping[str, Any]) -> dict[str, Any]:
        """Take new values; emit and return those that changed."""
        changed = {k: v for k, v in values.items() if self._values.get(k) != v}
        self._values.update(values)
        if changed:
            self.emit_properties_changed(changed)
        return changed


def _read_only(name: str, signature: str) -> Any:
    def getter(self: RecordInterface) -> Any:
        return self._values[name]

    getter.__name__ = getter.__qualname__ = name
    getter.__annotations__ = {"return": signature}
    return dbus_property(access=PropertyAccess.READ, name=name)(getter)


def with_properties(cls: type[RecordInterface]) -> type[RecordInterface]:
    """Turn the PROPERTIES table of an interface class into dbus-fast properties."""
    for name, signature in cls.PROPERTIES.items():
        setattr(cls, name, _read_only(name, signature))
    return cls


# -- formatting --------------------------------------------------------------------------------


def roce_gid_text(gid: bytes) -> str:
    """A 16-byte RoCE GID as an IPv6 address (IPv4-mapped ones read ``::ffff:192.0.2.1``)."""
    if len(gid) != 16:
        return gid.hex()
    addr = ipaddress.IPv6Address(gid)
    return f"::ffff:{addr.ipv4_mapped}" if addr.ipv4_mapped is not None else addr.compressed


def hex_id(raw: bytes) -> str:
    return raw.hex()


def _cursor(c: Cursor) -> tuple[int, int]:
    return (c.wrap, c.count)


# -- link groups, links, connections -----------------------------------------------------------


@with_properties
class LinkGroupObject(RecordInterface):
    INTERFACE = LINK_GROUP_INTERFACE
    PROPERTIES: ClassVar[Mapping[str, str]] = {
        "Id": "u",
        "Role": "s",
        "Type": "s",
        "LgrType": "s",
        "LocalGid": "s",
        "PeerGid": "s",
        "PeerSystemId": "s",
        "Chid": "q",
        "VlanId": "q",
        "PnetId": "s",
        "PnetIdByUser": "b",
        "NetDev": "s",
        "Connections": "u",
        "MaxConns": "u",
        "MaxLinks": "u",
        "SmcVersion": "y",
        "SmcRelease": "y",
        "PeerOs": "y",
        "PeerHostname": "s",
        "NegotiatedEid": "s",
        "Direct": "b",
        "SndbufAlloc": "t",
        "RmbAlloc": "t",
        "Links": "ao",
    }


def link_group_values(lgr: LinkGroup, links: list[Link]) -> dict[str, Any]:
    gid = hex_id if lgr.smc_type is SmcType.SMCD else roce_gid_text
    return {
        "Id": lgr.lgr_id,
        "Role": lgr.role.value,
        "Type": lgr.smc_type.value,
        "LgrType": lgr.lgr_type.value,
        "LocalGid": gid(lgr.local_gid) if lgr.local_gid else "",
        "PeerGid": gid(lgr.peer_gid) if lgr.peer_gid else "",
        "PeerSystemId": hex_id(lgr.peer_system_id),
        "Chid": lgr.chid,
        "VlanId": lgr.vlan_id,
        "PnetId": lgr.pnetid,
        "PnetIdByUser": lgr.pnetid_by_user,
        "NetDev": lgr.netdev,
        "Connections": lgr.conns,
        "MaxConns": lgr.max_conns,
        "MaxLinks": lgr.max_links,
        "SmcVersion": lgr.smc_version,
        "SmcRelease": lgr.smc_release,
        "PeerOs": lgr.peer_os,
        "PeerHostname": lgr.peer_hostname,
        "NegotiatedEid": lgr.negotiated_eid,
        "Direct": lgr.direct,
        "SndbufAlloc": lgr.sndbuf_alloc,
        "RmbAlloc": lgr.rmb_alloc,
        "Links": sorted(
            (link_path(lk.lgr_id, lk.link_id) for lk in links), key=lambda p: int(p.rsplit("/")[-1])
        ),
    }


@with_properties
class LinkObject(RecordInterface):
    INTERFACE = LINK_INTERFACE
    PROPERTIES: ClassVar[Mapping[str, str]] = {
        "LinkGroup": "o",
        "Id": "y",
        "State": "s",
        "LinkUid": "s",
        "PeerLinkUid": "s",
        "IbDev": "s",
        "IbPort": "y",
        "NetDev": "s",
        "Gid": "s",
        "PeerGid": "s",
        "Qpn": "u",
        "PeerQpn": "u",
        "Mtu": "u",
        "Connections": "u",
    }


def link_values(link: Link) -> dict[str, Any]:
    return {
        "LinkGroup": link_group_path(link.lgr_id),
        "Id": link.link_id,
        "State": link.state.value,
        "LinkUid": hex_id(link.link_uid),
        "PeerLinkUid": hex_id(link.peer_link_uid),
        "IbDev": link.ibdev,
        "IbPort": link.ibport,
        "NetDev": link.netdev,
        "Gid": roce_gid_text(link.gid) if link.gid else "",
        "PeerGid": roce_gid_text(link.peer_gid) if link.peer_gid else "",
        "Qpn": link.qpn,
        "PeerQpn": link.peer_qpn,
        "Mtu": link.mtu,
        "Connections": link.conns,
    }


@with_properties
class ConnectionObject(RecordInterface):
    INTERFACE = CONNECTION_INTERFACE
    PROPERTIES: ClassVar[Mapping[str, str]] = {
        "Id": "u",
        "Role": "s",
        "Mode": "s",
        "State": "s",
        "LocalAddress": "s",
        "LocalPort": "q",
        "PeerAddress": "s",
        "PeerPort": "q",
        "NetDev": "s",
        "Uid": "u",
        "Pid": "u",
        "Inode": "t",
        "Token": "u",
        "LinkGroup": "o",
        "Link": "o",
        "SndbufSize": "u",
        "RmbeSize": "u",
        "PeerRmbeSize": "u",
        "RxProducer": "(qu)",
        "RxConsumer": "(qu)",
        "TxProducer": "(qu)",
        "TxConsumer": "(qu)",
        "BytesSent": "t",
        "BytesReceived": "t",
        "FallbackReason": "u",
        "PeerDiagnosis": "u",
        "FallbackName": "s",
        "Netns": "s",
    }


def connection_values(conn: Connection, reason_name: Callable[[int], str]) -> dict[str, Any]:
    lgr = link_group_path(conn.lgr_id) if conn.lgr_id is not None else NO_OBJECT
    link = (
        link_path(conn.lgr_id, conn.link_id)
        if conn.lgr_id is not None and conn.link_id is not None
        else NO_OBJECT
    )
    return {
        "Id": conn.conn_id,
        "Role": conn.role.value,
        "Mode": conn.mode.value,
        "State": conn.state.value,
        "LocalAddress": conn.local_addr,
        "LocalPort": conn.local_port,
        "PeerAddress": conn.peer_addr,
        "PeerPort": conn.peer_port,
        "NetDev": conn.netdev,
        "Uid": conn.uid,
        "Pid": conn.pid,
        "Inode": conn.inode,
        "Token": conn.token,
        "LinkGroup": lgr,
        "Link": link,
        "SndbufSize": conn.sndbuf_size,
        "RmbeSize": conn.rmbe_size,
        "PeerRmbeSize": conn.peer_rmbe_size,
        "RxProducer": _cursor(conn.rx_prod),
        "RxConsumer": _cursor(conn.rx_cons),
        "TxProducer": _cursor(conn.tx_prod),
        "TxConsumer": _cursor(conn.tx_cons),
        "BytesSent": conn.bytes_sent,
        "BytesReceived": conn.bytes_received,
        "FallbackReason": conn.fallback_reason,
        "PeerDiagnosis": conn.peer_diagnosis,
        "FallbackName": reason_name(conn.fallback_reason) if conn.fallback_reason else "",
        "Netns": conn.netns,
    }


# -- devices -----------------------------------------------------------------------------------


@with_properties
class DeviceObject(RecordInterface):
    """One interface for every kind of device, so ``smcctl device show`` reads one shape.

    ``Kind`` says which properties are meaningful: "netdev" (Ifindex..Addresses), "rdma"
    (NodeGuid, Ports, Gids), "ism" (Gid, Chid, Enabled); ``VlanId`` is a VLAN netdev's id, -1
    for every other device. ``Ports`` entries are (port, state,
    active MTU, netdev, PNETID); ``Gids`` entries are (port, index, GID, type, netdev).
    """

    INTERFACE = DEVICE_INTERFACE
    PROPERTIES: ClassVar[Mapping[str, str]] = {
        "Name": "s",
        "Kind": "s",
        "Up": "b",
        "PnetId": "s",
        "Ifindex": "u",
        "Mac": "s",
        "Mtu": "u",
        "OperState": "s",
        "Carrier": "b",
        "AdminUp": "b",
        "LinkKind": "s",
        "VlanId": "i",
        "Addresses": "a(sy)",
        "NodeGuid": "s",
        "Ports": "a(ysuss)",
        "Gids": "a(yysss)",
        "Gid": "s",
        "Chid": "q",
        "Enabled": "b",
    }


DeviceRecord = NetDevice | RdmaDevice | LoopbackIsm

_EMPTY_DEVICE: dict[str, Any] = {
    "Up": False,
    "PnetId": "",
    "Ifindex": 0,
    "Mac": "",
    "Mtu": 0,
    "OperState": "",
    "Carrier": False,
    "AdminUp": False,
    "LinkKind": "",
    "VlanId": -1,
    "Addresses": [],
    "NodeGuid": "",
    "Ports": [],
    "Gids": [],
    "Gid": "",
    "Chid": 0,
    "Enabled": False,
}


def device_kind(dev: DeviceRecord) -> str:
    if isinstance(dev, NetDevice):
        return "netdev"
    if isinstance(dev, RdmaDevice):
        return "rdma"
    return "ism"


def device_values(
    dev: DeviceRecord, inventory: DeviceInventory, pnet: PnetTable | PnetView
) -> dict[str, Any]:
    values = dict(_EMPTY_DEVICE, Name=dev.name, Kind=device_kind(dev))
    if isinstance(dev, NetDevice):
        values.update(
            Up=dev.is_up,
            PnetId=inventory.resolve_pnetid(dev.name, pnet) or "",
            Ifindex=dev.ifindex,
            Mac=dev.mac or "",
            Mtu=dev.mtu,
            OperState=dev.operstate.value,
            Carrier=dev.carrier,
            AdminUp=dev.admin_up,
            LinkKind=dev.kind or "",
            VlanId=-1 if dev.vlan_id is None else dev.vlan_id,
            Addresses=[(str(a.address), a.prefixlen) for a in dev.addresses],
        )
    elif isinstance(dev, RdmaDevice):
        values.update(
            Up=any(p.active for p in dev.ports),
            PnetId=next(
                (
                    pid
                    for p in dev.ports
                    if (pid := pnet.pnetid_of_ibport(dev.name, p.num)) is not None
                ),
                "",
            ),
            NodeGuid=dev.node_guid_str,
            Ports=[
                (
                    p.num,
                    p.state.name,
                    p.active_mtu,
                    p.netdev or "",
                    pnet.pnetid_of_ibport(dev.name, p.num) or "",
                )
                for p in dev.ports
            ],
            Gids=[
                (p.num, g.index, roce_gid_text(g.gid), g.type.value, g.netdev or "")
                for p in dev.ports
                for g in p.gids
            ],
        )
    else:
        values.update(
            Up=dev.enabled,
            PnetId=pnet.pnetid_of_device(dev.name) or "",
            Gid=dev.gid.hex(),
            Chid=dev.chid,
            Enabled=dev.enabled,
        )
    return values
