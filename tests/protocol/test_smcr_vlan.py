"""SMC-R over VLAN netdevs: the VLAN id from rtnetlink (``IFLA_VLAN_ID``) through the inventory to
the VLAN smcd offers for a CLC connection (the kernel's ``smc_vlan_by_tcpsk`` walk down the
netdev stack) and the GID it picks (``smc_ib_determine_gid``: the GID's netdev has that VLAN).

The Soft-RoCE VM test ``tests/vm/guest/test_smcd_daemons_vlan.py`` runs the same over real
8021q devices; the host kernel here has no 8021q module, so the rtnetlink message is built with
pyroute2's own message class (encoded and decoded, as it comes off the socket)."""

from __future__ import annotations

import dataclasses
import ipaddress
from typing import Any

from pyroute2.netlink.rtnl.ifinfmsg import ifinfmsg  # type: ignore[import-untyped]

from smcd_daemon.adapters.netlink import link_from_msg
from smcd_daemon.adapters.netns_view import NamespaceRoute
from smcd_daemon.adapters.smcr_service import SmcrService
from smcd_daemon.core.devices import (
    Address,
    DeviceInventory,
    Gid,
    GidType,
    NetDevice,
    OperState,
    PortState,
    RdmaDevice,
    RdmaPort,
)
from smcd_daemon.core.eid import EidTable
from smcd_daemon.protocol.llc_events import Role
from smcd_daemon.protocol.negotiate.facts import LinkGroupRequest
from smcd_daemon.protocol.smcr_route import (
    GidChoice,
    InventoryRouting,
    SmcrChoice,
    choose_smcr_v1,
    determine_gid,
)
from smcd_daemon.transport.smcr import SmcrTransport

IP = ipaddress.ip_address
UP = dict(operstate=OperState.UP, carrier=True, admin_up=True)


def wire_link(index: int, name: str, kind: str, link: int, data: list[tuple[str, int]]) -> Any:
    """An ``RTM_NEWLINK`` as it comes off the netlink socket: encoded, then decoded."""
    msg = ifinfmsg()
    msg["index"] = index
    info: list[tuple[str, object]] = [("IFLA_INFO_KIND", kind)]
    if data:
        info.append(("IFLA_INFO_DATA", {"attrs": data}))
    msg["attrs"] = [
        ("IFLA_IFNAME", name),
        ("IFLA_LINK", link),
        ("IFLA_LINKINFO", {"attrs": info}),
    ]
    msg.encode()
    out = ifinfmsg(msg.data)
    out.decode()
    return out


def test_link_from_msg_reads_the_vlan_id_of_a_netlink_message() -> None:
    dev = link_from_msg(wire_link(5, "eth1.10", "vlan", 2, [("IFLA_VLAN_ID", 10)]))
    assert (dev.name, dev.kind, dev.link, dev.vlan_id) == ("eth1.10", "vlan", 2, 10)
    # Another kind's IFLA_INFO_DATA is not a VLAN id, whatever it holds.
    mv = link_from_msg(wire_link(6, "mv0", "macvlan", 5, [("IFLA_MACVLAN_MODE", 4)]))
    assert (mv.kind, mv.vlan_id) == ("macvlan", None)
    # A vlan message without IFLA_INFO_DATA (a partial update) keeps the id known before.
    bare = wire_link(5, "eth1.10", "vlan", 2, [])
    assert link_from_msg(bare).vlan_id is None
    assert link_from_msg(bare, known=dev).vlan_id == 10


def test_link_from_msg_reads_the_vlan_id_of_a_plain_mapping() -> None:
    msg = {"index": 5, "ifname": "eth1.10", "linkinfo": {"kind": "vlan", "data": {"vlan_id": 10}}}
    assert link_from_msg(msg).vlan_id == 10
    assert link_from_msg({"index": 2, "ifname": "eth1"}).vlan_id is None
    bad = {"index": 5, "ifname": "x", "linkinfo": {"kind": "vlan", "data": {"vlan_id": 5000}}}
    assert link_from_msg(bad).vlan_id is None


def stacked_host() -> DeviceInventory:
    """eth1 (2) ← eth1.10 (3, VLAN 10) ← mv0 (4, macvlan); eth1.20 (6, VLAN 20) enslaved to br0
    (5); eth1.10.5 (7, VLAN 5 on VLAN 10); eth2 (8) enslaved to br1 (9); ghost (10) a vlan of
    unknown id. rxe0 port 1 has GIDs on eth1, eth1.10 and eth1.20."""
    inv = DeviceInventory(loopback_gid=bytes(16))
    for dev in (
        NetDevice(2, "eth1", mac="02:00:00:00:00:01"),
        NetDevice(3, "eth1.10", mac="02:00:00:00:00:01", kind="vlan", link=2, vlan_id=10),
        NetDevice(4, "mv0", mac="02:00:00:00:00:04", kind="macvlan", link=3),
        NetDevice(5, "br0", mac="02:00:00:00:00:01", kind="bridge"),
        NetDevice(6, "eth1.20", kind="vlan", link=2, master=5, vlan_id=20),
        NetDevice(7, "eth1.10.5", kind="vlan", link=3, vlan_id=5),
        NetDevice(8, "eth2", mac="02:00:00:00:00:08", master=9),
        NetDevice(9, "br1", kind="bridge"),
        NetDevice(10, "ghost", kind="vlan", link=2),
    ):
        inv.apply_link(dataclasses.replace(dev, **UP))  # type: ignore[arg-type]
    inv.apply_address(Address(3, IP("198.51.100.1"), 24))
    inv.apply_address(Address(2, IP("192.0.2.1"), 24))
    gids = (
        Gid(0, b"\xfe\x80" + bytes(13) + b"\x01", GidType.ROCE_V1, "eth1"),
        Gid(1, b"\xfe\x80" + bytes(13) + b"\x0a", GidType.ROCE_V1, "eth1.10"),
        Gid(2, b"\xfe\x80" + bytes(13) + b"\x14", GidType.ROCE_V1, "eth1.20"),
        Gid(3, b"\xfe\x80" + bytes(13) + b"\x99", GidType.ROCE_V1, "ghost"),
    )
    inv.apply_rdma_device(
        RdmaDevice("rxe0", ports=(RdmaPort("rxe0", 1, PortState.ACTIVE, 1024, gids=gids),))
    )
    return inv


def test_inventory_routing_answers_from_the_netdevs_own_vlan_id() -> None:
    inv = stacked_host()
    routing = InventoryRouting(inv)
    assert routing.vlan_id("eth1.10") == 10
    assert routing.vlan_id("eth1") is None and routing.vlan_id("mv0") is None
    assert routing.vlan_id("ghost") == -1  # a vlan of unknown id matches nothing
    assert InventoryRouting(inv, {"eth1.10": 11, "ghost": 7}).vlan_id("eth1.10") == 11
    assert InventoryRouting(inv, {"ghost": 7}).vlan_id("ghost") == 7
    port = inv.rdma_devices()[0].ports[0]
    got = determine_gid(port, 10, routing)
    assert isinstance(got, GidChoice) and got.netdev == "eth1.10"
    untagged = determine_gid(port, 0, routing)
    assert isinstance(untagged, GidChoice) and untagged.netdev == "eth1"


def test_clc_vlan_walks_down_the_stack_as_smc_vlan_by_tcpsk() -> None:
    inv = stacked_host()
    walk = inv.clc_vlan_id
    assert walk("eth1.10") == 10  # the netdev itself
    assert walk("mv0") == 10  # a macvlan on a VLAN
    assert walk("br0") == 20  # a bridge whose port is a VLAN
    assert walk("eth1.10.5") == 5  # the first VLAN met is the top one
    assert walk("eth1") is None and walk("br1") is None  # no VLAN on the way
    assert walk("ghost") == -1
    assert walk("nosuch") is None
    # Per-device answers can come from elsewhere (an explicit VLAN table).
    assert walk("mv0", lambda d: InventoryRouting(inv, {"eth1.10": 11}).vlan_id(d.name)) == 11


def service(inv: DeviceInventory) -> SmcrService:
    return SmcrService(
        SmcrTransport(), inv, EidTable(), hostname="h", routing=InventoryRouting(inv)
    )


def test_facts_offer_the_vlan_and_the_vlan_netdevs_gid() -> None:
    inv = stacked_host()
    svc = service(inv)
    f = svc.facts_for(IP("198.51.100.1"), IP("198.51.100.2"))
    assert f.vlan_id == 10
    got = choose_smcr_v1(f.ports, f.vlan_id, f.routing)
    assert isinstance(got, SmcrChoice) and got.gid.netdev == "eth1.10"
    plain = svc.facts_for(IP("192.0.2.1"), IP("192.0.2.2"))
    assert plain.vlan_id == 0
    # A connection from another namespace: the VLAN found there, not 0.
    other = NetDevice(3, "eth0.10", kind="vlan", link=2, vlan_id=10)
    assert (
        svc.facts_for(
            IP("198.51.100.1"),
            IP("198.51.100.2"),
            where=NamespaceRoute((4026531999, "c1"), other, None),
        ).vlan_id
        == 10
    )
    walked = NamespaceRoute((4026531999, "c1"), NetDevice(4, "mv0"), None, vlan_id=10)
    assert svc.facts_for(IP("198.51.100.1"), IP("198.51.100.2"), where=walked).vlan_id == 10


def test_second_link_takes_a_gid_of_the_link_groups_vlan() -> None:
    inv = stacked_host()
    gids = (
        Gid(0, b"\xfe\x80" + bytes(13) + b"\x21", GidType.ROCE_V1, "eth1"),
        Gid(1, b"\xfe\x80" + bytes(13) + b"\x2a", GidType.ROCE_V1, "eth1.10"),
    )
    inv.apply_rdma_device(
        RdmaDevice("rxe1", ports=(RdmaPort("rxe1", 1, PortState.ACTIVE, 1024, gids=gids),))
    )
    svc = service(inv)
    first = determine_gid(inv.rdma_devices()[0].ports[0], 10, svc.routing)
    assert isinstance(first, GidChoice)
    req = LinkGroupRequest(
        role=Role.CLIENT,
        version=1,
        peer_system_id=bytes(8),
        peer_gid=bytes(16),
        peer_mac=bytes(6),
        vlan_id=10,
        local=first,
        local_mac=bytes(6),
        max_conns=255,
        max_links=2,
        release=0,
        uses_gateway=False,
        nexthop_mac=None,
    )
    (alt,) = svc.alt_ports_for(req)
    assert (alt.device, alt.netdev, alt.gid) == ("rxe1", "eth1.10", gids[1].gid)
