"""SMC-R device/GID/route choice over a real DeviceInventory snapshot (no kernel needed).

The two routing cases of the SMC-Rv2 mailing-list thread are reproduced as pure cases:
(a) a /32 address on the RoCE netdev that does not contain the CLC source, (b) asymmetric
direct/indirect routes. Addresses are from the documentation ranges.
"""

from __future__ import annotations

import ipaddress

import pytest

from smcd_daemon.core.devices import (
    NUD_FAILED,
    NUD_REACHABLE,
    Address,
    DeviceInventory,
    Gid,
    GidType,
    Neighbour,
    NetDevice,
    OperState,
    PortState,
    RdmaDevice,
    RdmaPort,
    Route,
)
from smcd_daemon.protocol.smcr_route import (
    ClientV2Path,
    Decline,
    GidChoice,
    InventoryRouting,
    SmcrChoice,
    check_accept_path,
    choose_smcr_v1,
    choose_smcr_v2_client,
    choose_smcr_v2_server,
    determine_gid,
    gid_ipv4,
)
from smcd_daemon.wire.reasons import DeclineReason

IP = ipaddress.ip_address
NET = ipaddress.ip_network
UEID = b"SMCD-TEST-UEID".ljust(32, b" ")


def v4gid(ip: str) -> bytes:
    return bytes(10) + b"\xff\xff" + IP(ip).packed


def v1gid(n: int) -> bytes:
    return bytes.fromhex("fe800000000000000000000000000000")[:15] + bytes((n,))


def host(
    addr: str,
    prefix: int,
    *,
    routes: list[Route] | None = None,
    neighbours: list[Neighbour] | None = None,
    vlan: bool = False,
) -> tuple[DeviceInventory, RdmaPort]:
    """A host with eth1 (ifindex 2) carrying ``addr/prefix`` and rxe0 port 1 on it, with a
    RoCE v1 GID and an IPv4-mapped RoCE v2 GID (plus, with ``vlan``, eth1.100 and its GIDs)."""
    inv = DeviceInventory(loopback_gid=bytes(16))
    up = dict(operstate=OperState.UP, carrier=True, admin_up=True)
    inv.apply_link(NetDevice(2, "eth1", mac="02:00:00:00:00:01", **up))  # type: ignore[arg-type]
    inv.apply_address(Address(2, IP(addr), prefix))
    gids = [
        Gid(0, v1gid(1), GidType.ROCE_V1, "eth1"),
        Gid(1, v4gid(addr), GidType.ROCE_V2, "eth1"),
    ]
    if vlan:
        inv.apply_link(NetDevice(3, "eth1.100", kind="vlan", link=2, **up))  # type: ignore[arg-type]
        inv.apply_address(Address(3, IP("198.51.100.1"), 24))
        gids += [
            Gid(2, v1gid(2), GidType.ROCE_V1, "eth1.100"),
            Gid(3, v4gid("198.51.100.1"), GidType.ROCE_V2, "eth1.100"),
        ]
    for r in routes or []:
        inv.apply_route(r)
    for n in neighbours or []:
        inv.apply_neighbour(n)
    port = RdmaPort("rxe0", 1, PortState.ACTIVE, 1024, gids=tuple(gids))
    inv.apply_rdma_device(RdmaDevice("rxe0", ports=(port,)))
    return inv, port


def facts(inv: DeviceInventory, vlans: dict[str, int] | None = None) -> InventoryRouting:
    return InventoryRouting(inv, vlans)


def test_gid_ipv4_mapped_and_not() -> None:
    assert gid_ipv4(v4gid("192.0.2.1")) == IP("192.0.2.1")
    assert gid_ipv4(v1gid(1)) is None


# ------------------------------------------------------------------ v1
def test_v1_takes_first_roce_v1_gid_of_the_non_vlan_netdev() -> None:
    inv, _ = host("192.0.2.1", 24, vlan=True)
    got = choose_smcr_v1(inv.smcr_ports_for("eth1", _NoPnet()), 0, facts(inv, {"eth1.100": 100}))
    assert isinstance(got, SmcrChoice)
    assert (got.gid.gid, got.gid.gid_index, got.gid.netdev) == (v1gid(1), 0, "eth1")


def test_v1_vlan_match_picks_the_vlan_netdevs_gid() -> None:
    inv, port = host("192.0.2.1", 24, vlan=True)
    got = determine_gid(port, 100, facts(inv, {"eth1.100": 100}))
    assert isinstance(got, GidChoice)
    assert (got.gid_index, got.netdev) == (2, "eth1.100")
    other = determine_gid(port, 200, facts(inv, {"eth1.100": 100}))
    assert isinstance(other, str) and "VLAN 200" in other


def test_v1_no_port_is_nosmcrdev_with_reason() -> None:
    inv, port = host("192.0.2.1", 24)
    only_v2 = RdmaPort("rxe0", 1, PortState.ACTIVE, gids=(port.gids[1],))
    got = choose_smcr_v1([only_v2], 0, facts(inv))
    assert isinstance(got, Decline)
    assert got.code == DeclineReason.NOSMCRDEV
    assert "rxe0 port 1 has no RoCE v1 GID for no VLAN" in got.explanation
    none = choose_smcr_v1([], 0, facts(inv))
    assert isinstance(none, Decline) and "no active RoCE port" in none.explanation


# ------------------------------------------------------------------ v2 subnet rule
def test_mailing_list_case_a_slash32_does_not_contain_source() -> None:
    """(a) The RoCE netdev has 192.0.2.3/32; the CLC connection's source is 192.0.2.4 (another
    address, e.g. on a second interface): the port is unusable → NOSMCRDEV, explained."""
    inv, port = host("192.0.2.3", 32)
    got = choose_smcr_v2_client([port], 0, IP("192.0.2.4"), facts(inv), ueid_count=1)
    assert isinstance(got, Decline)
    assert got.code == DeclineReason.NOSMCRDEV == 0x03030002
    assert (
        "interface eth1 (192.0.2.3/32) does not contain the connection's source 192.0.2.4; "
        "SMC-Rv2 needs the RoCE netdev's subnet to contain it"
    ) in got.explanation
    # the server applies the same rule, before any route lookup
    srv = choose_smcr_v2_server(
        [port], 0, IP("192.0.2.4"), v4gid("192.0.2.9"), bytes(6), facts(inv),
        local_ueids=[UEID], peer_ueids=[UEID],
    )  # fmt: skip
    assert isinstance(srv, Decline) and srv.code == DeclineReason.NOSMCRDEV
    assert "does not contain the connection's source 192.0.2.4" in srv.explanation


def test_v2_client_subnet_match_offers_the_v2_gid() -> None:
    inv, port = host("192.0.2.3", 24)
    got = choose_smcr_v2_client([port], 0, IP("192.0.2.3"), facts(inv), ueid_count=1)
    assert isinstance(got, SmcrChoice)
    assert got.gid.gid == v4gid("192.0.2.3") and got.gid.route is None


def test_v2_client_needs_a_ueid_and_ipv4() -> None:
    inv, port = host("192.0.2.3", 24)
    no_ueid = choose_smcr_v2_client([port], 0, IP("192.0.2.3"), facts(inv), ueid_count=0)
    assert isinstance(no_ueid, Decline) and no_ueid.code == DeclineReason.NOUEID
    v6 = choose_smcr_v2_client([port], 0, IP("2001:db8::1"), facts(inv), ueid_count=1)
    assert isinstance(v6, Decline) and "not IPv4" in v6.explanation


# ------------------------------------------------------------------ v2 server routing
PEER = "192.0.2.20"
PEER_MAC = bytes.fromhex("020000000014")


def test_v2_server_direct_route_uses_proposal_mac_and_says_direct() -> None:
    inv, port = host(
        "192.0.2.3", 24,
        routes=[Route(NET("192.0.2.0/24"), oif=2)],
        neighbours=[Neighbour(2, IP(PEER), "02:00:00:00:00:14", NUD_REACHABLE)],
    )  # fmt: skip
    got = choose_smcr_v2_server(
        [port], 0, IP("192.0.2.3"), v4gid(PEER), PEER_MAC, facts(inv),
        local_ueids=[UEID], peer_ueids=[b"OTHER".ljust(32, b" "), UEID],
    )  # fmt: skip
    assert isinstance(got, SmcrChoice)
    assert got.v2_direct is True
    assert got.nexthop_mac == PEER_MAC
    assert got.negotiated_eid == UEID
    assert got.gid.route is not None and got.gid.route.uses_gateway is False


def test_v2_server_gateway_route_is_indirect_with_gateway_mac() -> None:
    inv, port = host(
        "192.0.2.3", 24,
        routes=[
            Route(NET("192.0.2.0/24"), oif=2),
            Route(NET("203.0.113.0/24"), 2, IP("192.0.2.1")),
        ],
        neighbours=[Neighbour(2, IP("192.0.2.1"), "02:00:00:00:00:fe", NUD_REACHABLE)],
    )  # fmt: skip
    got = choose_smcr_v2_server(
        [port], 0, IP("192.0.2.3"), v4gid("203.0.113.5"), PEER_MAC, facts(inv),
        local_ueids=[UEID], peer_ueids=[UEID],
    )  # fmt: skip
    assert isinstance(got, SmcrChoice)
    assert got.v2_direct is False
    assert got.nexthop_mac == bytes.fromhex("0200000000fe")
    assert got.gid.route is not None and got.gid.route.nexthop == IP("192.0.2.1")


def test_v2_server_no_neighbour_makes_port_unusable() -> None:
    inv, port = host(
        "192.0.2.3", 24,
        routes=[Route(NET("192.0.2.0/24"), oif=2)],
        neighbours=[Neighbour(2, IP(PEER), None, NUD_FAILED)],
    )  # fmt: skip
    got = choose_smcr_v2_server(
        [port], 0, IP("192.0.2.3"), v4gid(PEER), PEER_MAC, facts(inv),
        local_ueids=[UEID], peer_ueids=[UEID],
    )  # fmt: skip
    assert isinstance(got, Decline) and got.code == DeclineReason.NOSMCRDEV
    assert f"no neighbour (ARP) entry with a MAC for peer {PEER} on eth1" in got.explanation


def test_v2_server_ueid_only_match() -> None:
    inv, port = host("192.0.2.3", 24)
    got = choose_smcr_v2_server(
        [port], 0, IP("192.0.2.3"), v4gid(PEER), PEER_MAC, facts(inv),
        local_ueids=[UEID], peer_ueids=[b"ELSEWHERE".ljust(32, b" ")],
    )  # fmt: skip
    assert isinstance(got, Decline) and got.code == DeclineReason.NOUEID
    assert "SEIDs do not count" in got.explanation


# ------------------------------------------------------------------ client Accept checks
SERVER = "203.0.113.7"
SERVER_MAC = bytes.fromhex("0200000000aa")


def test_client_trusts_direct_accept() -> None:
    inv, _ = host("192.0.2.3", 24)  # no route at all: not consulted
    got = check_accept_path(True, IP("192.0.2.3"), v4gid(SERVER), SERVER_MAC, facts(inv))
    assert got == ClientV2Path(uses_gateway=False, nexthop_mac=SERVER_MAC)


def test_client_indirect_accept_with_gateway_route_is_accepted() -> None:
    inv, _ = host(
        "192.0.2.3", 24,
        routes=[Route(NET("203.0.113.0/24"), 2, IP("192.0.2.1"))],
        neighbours=[Neighbour(2, IP("192.0.2.1"), "02:00:00:00:00:fe", NUD_REACHABLE)],
    )  # fmt: skip
    got = check_accept_path(False, IP("192.0.2.3"), v4gid(SERVER), SERVER_MAC, facts(inv))
    assert got == ClientV2Path(uses_gateway=True, nexthop_mac=bytes.fromhex("0200000000fe"))


def test_mailing_list_case_b_asymmetric_routes_noindirect() -> None:
    """(b) The server routes back to us through a gateway and says 'indirect', but our route
    to the server's GID is direct: SMC_CLC_DECL_NOINDIRECT."""
    inv, _ = host(
        "192.0.2.3", 24,
        routes=[Route(NET("203.0.113.0/24"), oif=2)],
        neighbours=[Neighbour(2, IP(SERVER), "02:00:00:00:00:aa", NUD_REACHABLE)],
    )  # fmt: skip
    got = check_accept_path(False, IP("192.0.2.3"), v4gid(SERVER), SERVER_MAC, facts(inv))
    assert isinstance(got, Decline)
    assert got.code == DeclineReason.NOINDIRECT == 0x030F0000
    assert "is direct" in got.explanation and SERVER in got.explanation


def test_client_indirect_accept_without_route_or_neighbour_is_noroute() -> None:
    inv, _ = host("192.0.2.3", 24)
    got = check_accept_path(False, IP("192.0.2.3"), v4gid(SERVER), SERVER_MAC, facts(inv))
    assert isinstance(got, Decline) and got.code == DeclineReason.NOROUTE == 0x030E0000
    assert f"no route from 192.0.2.3 to {SERVER}" in got.explanation
    inv2, _ = host("192.0.2.3", 24, routes=[Route(NET("203.0.113.0/24"), 2, IP("192.0.2.1"))])
    got2 = check_accept_path(False, IP("192.0.2.3"), v4gid(SERVER), SERVER_MAC, facts(inv2))
    assert isinstance(got2, Decline) and got2.code == DeclineReason.NOROUTE
    assert "gateway 192.0.2.1" in got2.explanation


def test_v2_requires_source_address() -> None:
    inv, port = host("192.0.2.3", 24)
    with pytest.raises(ValueError):
        determine_gid(port, 0, facts(inv), v2=True)


class _NoPnet:
    def pnetid_of_netdev(self, name: str) -> str | None:
        return None

    def pnetid_of_ibport(self, dev: str, port: int) -> str | None:
        return None
