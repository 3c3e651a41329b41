"""The device inventory: events, reconciliation, PNETID resolution as smc_pnet, routing helpers."""

from __future__ import annotations

import ipaddress

import pytest

from smcd_daemon.core.devices import (
    LOOPBACK_ISM_CHID,
    NUD_FAILED,
    NUD_REACHABLE,
    NUD_STALE,
    RT_TABLE_LOCAL,
    RTN_LOCAL,
    Address,
    DeviceEvent,
    DeviceInventory,
    EventKind,
    Gid,
    GidType,
    LoopbackIsm,
    Neighbour,
    NetDevice,
    OperState,
    PortState,
    RdmaDevice,
    RdmaPort,
    Route,
)
from smcd_daemon.core.pnet import PnetTable

ip = ipaddress.ip_address
net = ipaddress.ip_network


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def inventory() -> tuple[DeviceInventory, list[DeviceEvent], Clock]:
    clock = Clock()
    inv = DeviceInventory(clock=clock)
    events: list[DeviceEvent] = []
    inv.subscribe(events.append)
    return inv, events, clock


def eth(ifindex: int, name: str, **kw: object) -> NetDevice:
    base: dict[str, object] = dict(
        mac=f"02:00:00:00:00:{ifindex:02x}",
        mtu=1500,
        operstate=OperState.UP,
        carrier=True,
        admin_up=True,
    )
    base.update(kw)
    return NetDevice(ifindex=ifindex, name=name, **base)  # type: ignore[arg-type]


def v4gid(index: int, addr: str, netdev: str, kind: GidType = GidType.ROCE_V2) -> Gid:
    return Gid(index, bytes(10) + b"\xff\xff" + ip(addr).packed, kind, netdev)


def rxe(name: str, netdev: str, state: PortState = PortState.ACTIVE) -> RdmaDevice:
    link_local = bytes.fromhex("fe800000000000000000000000000001")
    port = RdmaPort(
        device=name,
        num=1,
        state=state,
        active_mtu=1024,
        gids=(
            Gid(0, link_local, GidType.ROCE_V1, netdev),
            Gid(1, link_local, GidType.ROCE_V2, netdev),
            v4gid(2, "192.0.2.1", netdev, GidType.ROCE_V1),
            v4gid(3, "192.0.2.1", netdev),
        ),
    )
    return RdmaDevice(name=name, node_guid=0x0250_56FF_FE00_0001, ports=(port,))


# -- events ---------------------------------------------------------------------------------


def test_link_added_changed_removed_with_timestamps() -> None:
    inv, events, clock = inventory()
    inv.apply_link(eth(2, "eth0"))
    assert [(e.kind, e.object.name) for e in events] == [(EventKind.ADDED, "eth0")]  # type: ignore[union-attr]
    assert events[0].timestamp == 100.0

    # Re-applying the same state is silent: replaying events over a dump must not spam D-Bus.
    inv.apply_link(eth(2, "eth0"))
    assert len(events) == 1

    clock.now = 101.5
    inv.apply_link(eth(2, "eth0", carrier=False, operstate=OperState.LOWERLAYERDOWN))
    assert events[-1].kind is EventKind.CHANGED
    assert events[-1].timestamp == 101.5
    dev = inv.netdev(2)
    assert dev is not None and not dev.carrier and not dev.is_up

    inv.remove_link(2)
    assert events[-1].kind is EventKind.REMOVED
    assert inv.netdevs() == ()


def test_address_events_update_the_netdev() -> None:
    inv, events, _ = inventory()
    inv.apply_link(eth(2, "eth0"))
    events.clear()
    a = Address(2, ip("192.0.2.1"), 24)
    inv.apply_address(a)
    assert [(e.kind, type(e.object)) for e in events] == [
        (EventKind.ADDED, Address),
        (EventKind.CHANGED, NetDevice),
    ]
    dev = inv.netdev(2)
    assert dev is not None and dev.addresses == (a,)
    assert str(a) == "192.0.2.1/24" and a.network == net("192.0.2.0/24")

    # A later link update keeps the addresses the inventory knows.
    inv.apply_link(eth(2, "eth0", mtu=9000))
    dev = inv.netdev(2)
    assert dev is not None and dev.mtu == 9000 and dev.addresses == (a,)

    events.clear()
    inv.remove_address(Address(2, ip("192.0.2.1"), 24))
    assert [(e.kind, type(e.object)) for e in events] == [
        (EventKind.REMOVED, Address),
        (EventKind.CHANGED, NetDevice),
    ]
    dev = inv.netdev(2)
    assert dev is not None and dev.addresses == ()
    events.clear()
    inv.remove_address(a)  # unknown now: nothing to say
    assert events == []


def test_removing_a_link_drops_what_hangs_on_it() -> None:
    inv, events, _ = inventory()
    inv.apply_link(eth(2, "eth0"))
    inv.apply_link(eth(3, "eth1"))
    inv.apply_address(Address(2, ip("192.0.2.1"), 24))
    inv.apply_route(Route(net("192.0.2.0/24"), oif=2))
    inv.apply_route(Route(net("198.51.100.0/24"), oif=3))
    inv.apply_neighbour(Neighbour(2, ip("192.0.2.2"), "02:00:00:00:01:02", NUD_REACHABLE))
    events.clear()
    inv.remove_link(2)
    kinds = {(e.kind, type(e.object)) for e in events}
    assert kinds == {
        (EventKind.REMOVED, Address),
        (EventKind.REMOVED, Route),
        (EventKind.REMOVED, Neighbour),
        (EventKind.REMOVED, NetDevice),
    }
    assert [r.oif for r in inv.routes()] == [3]
    assert inv.addresses() == () and inv.neighbours() == ()


def test_replace_network_emits_only_the_difference() -> None:
    inv, events, _ = inventory()
    inv.apply_link(eth(2, "eth0"))
    inv.apply_link(eth(3, "old0"))
    inv.apply_address(Address(2, ip("192.0.2.1"), 24))
    inv.apply_address(Address(2, ip("192.0.2.9"), 24))
    inv.apply_route(Route(net("192.0.2.0/24"), oif=2))
    events.clear()
    inv.replace_network(
        links=[eth(2, "eth0"), eth(4, "new0")],
        addresses=[Address(2, ip("192.0.2.1"), 24), Address(4, ip("198.51.100.1"), 24)],
        routes=[Route(net("192.0.2.0/24"), oif=2), Route(net("198.51.100.0/24"), oif=4)],
        neighbours=[],
    )
    summary = {(e.kind, type(e.object).__name__, _ident(e.object)) for e in events}
    assert (EventKind.REMOVED, "NetDevice", "old0") in summary
    assert (EventKind.ADDED, "NetDevice", "new0") in summary
    assert (EventKind.REMOVED, "Address", "192.0.2.9") in summary
    assert (EventKind.ADDED, "Address", "198.51.100.1") in summary
    assert (EventKind.ADDED, "Route", "198.51.100.0/24") in summary
    assert not any(k is EventKind.ADDED and i == "192.0.2.1" for k, _, i in summary)
    assert [d.name for d in inv.netdevs()] == ["eth0", "new0"]


def _ident(obj: object) -> str:
    if isinstance(obj, NetDevice):
        return obj.name
    if isinstance(obj, Address):
        return str(obj.address)
    if isinstance(obj, Route):
        return str(obj.dst)
    return repr(obj)


def test_broken_subscriber_does_not_stop_others() -> None:
    inv = DeviceInventory()
    seen: list[DeviceEvent] = []

    def broken(ev: DeviceEvent) -> None:
        raise RuntimeError("observer bug")

    inv.subscribe(broken)
    unsubscribe = inv.subscribe(seen.append)
    inv.apply_link(eth(2, "eth0"))
    assert len(seen) == 1
    unsubscribe()
    inv.apply_link(eth(3, "eth1"))
    assert len(seen) == 1


# -- loopback-ism ---------------------------------------------------------------------------


def test_loopback_ism_is_present_with_random_128_bit_gid() -> None:
    a, b = DeviceInventory(), DeviceInventory()
    lo = a.loopback_ism
    assert lo.name == "loopback-ism" and lo.chid == LOOPBACK_ISM_CHID == 0xFFFF
    assert len(lo.gid) == 16 and lo.gid != bytes(16)
    assert lo.gid != b.loopback_ism.gid  # made at start, per daemon
    assert (lo.gid_hi << 64) | lo.gid_ext == int.from_bytes(lo.gid, "big")
    assert lo.enabled
    with pytest.raises(ValueError):
        LoopbackIsm(gid=b"short")

    inv, events, _ = inventory()
    inv.set_loopback_enabled(False)
    assert events[-1].kind is EventKind.CHANGED and not inv.loopback_ism.enabled
    assert inv.smcd_v2_devices(PnetTable()) == []
    assert DeviceInventory(loopback_enabled=False).loopback_ism.enabled is False


def test_smcd_v2_offer_follows_loopback_pnetid() -> None:
    inv, _, _ = inventory()
    inv.apply_link(eth(2, "eth0"))
    table = PnetTable()
    assert inv.smcd_v2_devices(table) == [inv.loopback_ism]  # no PNETID: always offered
    table.add("NETA", ibdev="loopback-ism")
    assert inv.smcd_v2_devices(table) == []  # PNETID of no netdev in this namespace
    table.add("NETA", netdev="eth0")
    assert inv.smcd_v2_devices(table) == [inv.loopback_ism]


# -- PNETID resolution ----------------------------------------------------------------------


def test_pnetid_from_the_netdev_table_entry() -> None:
    inv, _, _ = inventory()
    inv.apply_link(eth(2, "eth0"))
    table = PnetTable()
    assert inv.resolve_pnetid("eth0", table) is None
    table.add("net1", netdev="eth0")
    assert inv.resolve_pnetid("eth0", table) == "NET1"


def test_pnetid_of_the_base_device_wins_over_the_stacked_one() -> None:
    inv, _, _ = inventory()
    inv.apply_link(eth(2, "eth0"))
    inv.apply_link(eth(5, "eth0.10", kind="vlan", link=2))
    table = PnetTable()
    table.add("VLANNET", netdev="eth0.10")
    assert inv.resolve_pnetid("eth0.10", table) == "VLANNET"  # base has none: own entry
    table.add("BASENET", netdev="eth0")
    assert inv.resolve_pnetid("eth0.10", table) == "BASENET"  # base first, as the kernel


def test_base_device_walks_masters_but_not_veth_peers() -> None:
    inv, _, _ = inventory()
    inv.apply_link(eth(2, "eth0", master=4))
    inv.apply_link(eth(3, "eth1", master=4))
    inv.apply_link(eth(4, "bond0", kind="bond"))
    inv.apply_link(eth(6, "bond0.7", kind="vlan", link=4))
    inv.apply_link(eth(7, "veth0", kind="veth", link=8))
    inv.apply_link(eth(8, "veth1", kind="veth", link=7))
    base = inv.base_netdev("bond0.7")
    assert base is not None and base.name == "eth0"  # first lower at each level
    base = inv.base_netdev("veth0")
    assert base is not None and base.name == "veth0"


def test_smcr_ports_by_pnetid_else_by_netdev() -> None:
    inv, _, _ = inventory()
    inv.apply_link(eth(2, "eth0"))
    inv.apply_link(eth(3, "eth1"))
    inv.apply_rdma_device(rxe("rxe0", "eth0"))
    inv.apply_rdma_device(rxe("rxe1", "eth1"))
    table = PnetTable()

    # No PNETID anywhere: the port whose netdev is the socket's netdev (no table needed).
    assert [p.device for p in inv.smcr_ports_for("eth0", table)] == ["rxe0"]
    assert [p.device for p in inv.rdma_ports_for_netdev("eth1")] == ["rxe1"]

    # With a PNETID the table decides, even toward another device's port.
    table.add("FABRIC", netdev="eth0", ibdev="rxe1", ibport=1)
    assert [p.device for p in inv.smcr_ports_for("eth0", table)] == ["rxe1"]

    # A PNETID no port carries means no SMC-R device (kernel: no fallback to the netdev match).
    table.flush()
    table.add("LONELY", netdev="eth0")
    assert inv.smcr_ports_for("eth0", table) == []

    # Inactive ports are never chosen.
    table.flush()
    inv.apply_rdma_device(rxe("rxe0", "eth0", PortState.DOWN))
    assert inv.smcr_ports_for("eth0", table) == []


def test_gid_and_port_details() -> None:
    dev = rxe("rxe0", "eth0")
    port = dev.ports[0]
    assert port.netdev == "eth0" and port.active
    assert dev.port(1) is port and dev.port(2) is None
    assert dev.node_guid_str == "0250:56ff:fe00:0001"
    v2 = port.gids[3]
    assert v2.type is GidType.ROCE_V2 and v2.ipv4 == ip("192.0.2.1")
    assert port.gids[0].ipv4 is None
    assert str(port.gids[0]) == "fe80:0000:0000:0000:0000:0000:0000:0001"
    with pytest.raises(ValueError):
        Gid(0, b"\x00" * 15, GidType.IB)
    assert GidType.parse("IB/RoCE v1") is GidType.ROCE_V1
    assert GidType.parse("RoCE v2") is GidType.ROCE_V2
    assert GidType.parse("RoCEv2") is GidType.ROCE_V2
    with pytest.raises(ValueError):
        GidType.parse("iWARP")


def test_replace_rdma_devices() -> None:
    inv, events, _ = inventory()
    inv.replace_rdma_devices([rxe("rxe0", "eth0"), rxe("rxe1", "eth1")])
    events.clear()
    inv.replace_rdma_devices([rxe("rxe1", "eth1", PortState.DOWN)])
    assert {(e.kind, e.object.name) for e in events} == {  # type: ignore[union-attr]
        (EventKind.REMOVED, "rxe0"),
        (EventKind.CHANGED, "rxe1"),
    }


# -- routes and neighbours ------------------------------------------------------------------


def test_routes_to_longest_prefix_then_metric_local_first() -> None:
    inv, _, _ = inventory()
    inv.apply_route(Route(net("0.0.0.0/0"), oif=2, gateway=ip("192.0.2.254"), priority=100))
    inv.apply_route(Route(net("0.0.0.0/0"), oif=3, gateway=ip("198.51.100.254"), priority=50))
    inv.apply_route(Route(net("192.0.2.0/24"), oif=2))
    inv.apply_route(Route(net("203.0.113.0/24"), oif=3, gateway=ip("198.51.100.1")))
    inv.apply_route(Route(net("192.0.2.1/32"), oif=2, table=RT_TABLE_LOCAL, type=RTN_LOCAL))
    inv.apply_route(Route(net("2001:db8::/32"), oif=2))

    r = inv.route_to("192.0.2.7")
    assert r is not None and r.dst == net("192.0.2.0/24") and r.gateway is None
    r = inv.route_to(ip("203.0.113.9"))
    assert r is not None and r.gateway == ip("198.51.100.1")
    r = inv.route_to("8.8.8.8")
    assert r is not None and r.oif == 3  # lower metric default wins
    assert [x.priority for x in inv.routes_to("8.8.8.8")] == [50, 100]
    r = inv.route_to("192.0.2.1")
    assert r is not None and r.table == RT_TABLE_LOCAL
    assert inv.route_to("2001:db9::1") is None

    inv.remove_route(Route(net("0.0.0.0/0"), oif=3, gateway=ip("198.51.100.254"), priority=50))
    r = inv.route_to("8.8.8.8")
    assert r is not None and r.oif == 2

    # replace_routes (re-dump after a link went down) drops what the kernel flushed silently.
    inv.replace_routes([Route(net("192.0.2.0/24"), oif=2)])
    assert inv.route_to("8.8.8.8") is None


def test_neighbour_lookup_and_validity() -> None:
    inv, _, _ = inventory()
    inv.apply_neighbour(Neighbour(2, ip("192.0.2.2"), "02:00:00:00:01:02", NUD_STALE))
    inv.apply_neighbour(Neighbour(2, ip("192.0.2.3"), None, NUD_FAILED))
    n = inv.neighbour(2, "192.0.2.2")
    assert n is not None and n.valid and n.lladdr == "02:00:00:00:01:02"
    n = inv.neighbour(2, "192.0.2.3")
    assert n is not None and not n.valid
    assert inv.neighbour(3, "192.0.2.2") is None


def test_netdev_with_subnet() -> None:
    inv, _, _ = inventory()
    inv.apply_link(eth(2, "eth0"))
    inv.apply_address(Address(2, ip("192.0.2.1"), 24))
    dev = inv.netdev_with_subnet("192.0.2.200")
    assert dev is not None and dev.name == "eth0"
    assert inv.netdev_with_subnet("198.51.100.1") is None


def test_operstate_parsing() -> None:
    assert OperState.parse("up") is OperState.UP
    assert OperState.parse(6) is OperState.UP
    assert OperState.parse(2) is OperState.DOWN
    assert OperState.parse(99) is OperState.UNKNOWN
    assert OperState.parse(None) is OperState.UNKNOWN
