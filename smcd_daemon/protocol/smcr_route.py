"""SMC-R device, GID and route choice (SMC-Rv1 and SMC-Rv2), pure.

The kernel decides whether an RDMA port can carry an SMC-R link group in
``smc_ib_determine_gid`` (``smc_ib.c``) and, for SMC-Rv2, in ``smc_ib_find_route`` and
``smc_connect_rdma_v2_prepare`` (``af_smc.c``); PROTOCOL.md §5 summarises them. This module
applies the same rules to *facts* - a snapshot of netdevs, addresses, routes, neighbours and
RDMA ports - so the CLC negotiator can choose without touching the kernel, and every refusal
comes with a sentence an operator can act on.

Facts are read through the :class:`RoutingFacts` protocol; :class:`InventoryRouting` adapts the
daemon's ``DeviceInventory`` (structurally: this layer does not import ``core``). The RDMA
ports and GIDs are read through small structural protocols matching ``core.devices`` records.

Rules, as the kernel has them:

* **VLAN match.** A GID entry is considered only if its netdev matches the CLC connection's VLAN:
  no VLAN → a non-VLAN netdev; VLAN *v* → a VLAN netdev with id *v*.
* **v1** takes the first RoCE v1 GID that matches.
* **v2** takes a RoCE v2 GID that is IPv4-mapped, whose netdev owns an IPv4 address whose subnet
  contains the CLC source address (``inet_ifa_match``), and - when a destination is known (the
  server: the peer's RoCEv2 GID from the Proposal) - to which a route exists from the source
  with an IPv4 gateway if any and a neighbour entry (its MAC becomes the next hop).
* A port with no fitting GID is unusable; no usable port → ``SMC_CLC_DECL_NOSMCRDEV``.
* The server offers SMC-Rv2 only on a UEID match (SEIDs do not count for SMC-R) and says
  ``v2_direct = not uses_gateway`` in the Accept.
* The client trusts a direct Accept; for an indirect one it routes to the server's GID itself:
  no route or neighbour → ``SMC_CLC_DECL_NOROUTE``, a route without gateway →
  ``SMC_CLC_DECL_NOINDIRECT``.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeAlias

from smcd_daemon.wire.reasons import DeclineReason

__all__ = [
    "AddressLike",
    "ClientV2Path",
    "Decline",
    "GidChoice",
    "GidLike",
    "InventoryRouting",
    "NeighbourLike",
    "NetDeviceLike",
    "PortLike",
    "RouteLike",
    "RoutingFacts",
    "SmcrChoice",
    "V2Route",
    "check_accept_path",
    "choose_smcr_v1",
    "choose_smcr_v2_client",
    "choose_smcr_v2_server",
    "determine_gid",
    "find_route_v2",
    "gid_ipv4",
    "mac_bytes",
    "match_ueid",
]

IPv4 = ipaddress.IPv4Address
IPAddr: TypeAlias = ipaddress.IPv4Address | ipaddress.IPv6Address

ROCE_V1 = "RoCE v1"  # core.devices.GidType.ROCE_V1.value
ROCE_V2 = "RoCE v2"  # core.devices.GidType.ROCE_V2.value


# ---------------------------------------------------------------------------- fact protocols
class _Valued(Protocol):
    @property
    def value(self) -> object: ...


class GidLike(Protocol):
    """One GID table entry (``core.devices.Gid``)."""

    @property
    def index(self) -> int: ...
    @property
    def gid(self) -> bytes: ...
    @property
    def type(self) -> _Valued: ...
    @property
    def netdev(self) -> str | None: ...


class PortLike(Protocol):
    """One RDMA port (``core.devices.RdmaPort``)."""

    @property
    def device(self) -> str: ...
    @property
    def num(self) -> int: ...
    @property
    def gids(self) -> Sequence[GidLike]: ...


class AddressLike(Protocol):
    @property
    def address(self) -> IPAddr: ...
    @property
    def prefixlen(self) -> int: ...


class NetDeviceLike(Protocol):
    @property
    def ifindex(self) -> int: ...
    @property
    def name(self) -> str: ...
    @property
    def mac(self) -> str | None: ...
    @property
    def addresses(self) -> Sequence[AddressLike]: ...


class RouteLike(Protocol):
    @property
    def oif(self) -> int | None: ...
    @property
    def gateway(self) -> IPAddr | None: ...


class NeighbourLike(Protocol):
    @property
    def lladdr(self) -> str | None: ...
    @property
    def valid(self) -> bool: ...


class RoutingFacts(Protocol):
    """What the rules need to know about the host, answered from a snapshot."""

    def netdev_by_name(self, name: str) -> NetDeviceLike | None: ...
    def netdev(self, ifindex: int) -> NetDeviceLike | None: ...
    def vlan_id(self, netdev: str) -> int | None:
        """The VLAN id of a VLAN netdev (-1 if unknown), None if it is not a VLAN."""
        ...

    def lookup_route(self, saddr: IPv4, daddr: IPv4) -> RouteLike | None: ...
    def neighbour(self, ifindex: int, ip: IPAddr) -> NeighbourLike | None: ...


class _InventoryLike(Protocol):
    """The part of ``core.devices.DeviceInventory`` :class:`InventoryRouting` reads."""

    def netdev_by_name(self, name: str) -> NetDeviceLike | None: ...
    def netdev(self, ifindex: int) -> NetDeviceLike | None: ...
    def route_to(self, dst: IPAddr | str) -> RouteLike | None: ...
    def neighbour(self, ifindex: int, ip: IPAddr | str) -> NeighbourLike | None: ...


class _KindLike(Protocol):
    @property
    def kind(self) -> str | None: ...


class InventoryRouting:
    """:class:`RoutingFacts` over a ``DeviceInventory``.

    The inventory's routing is a longest-prefix match over the main and local tables (no policy
    rules), so ``lookup_route`` ignores ``saddr``; a daemon with policy routing can pass its own
    ``RoutingFacts`` that asks the kernel (``RTM_GETROUTE`` with the source). A VLAN netdev's id
    is its own ``vlan_id`` (rtnetlink's ``IFLA_VLAN_ID``); ``vlan_ids`` (netdev name → id)
    overrides it, and a ``kind == "vlan"`` netdev known to neither is a VLAN of unknown id (it
    matches no VLAN, not even 'none').
    """

    _UNKNOWN_VLAN = -1

    def __init__(self, inventory: _InventoryLike, vlan_ids: Mapping[str, int] | None = None):
        self._inv = inventory
        self._vlans = dict(vlan_ids or {})

    def netdev_by_name(self, name: str) -> NetDeviceLike | None:
        return self._inv.netdev_by_name(name)

    def netdev(self, ifindex: int) -> NetDeviceLike | None:
        return self._inv.netdev(ifindex)

    def vlan_id(self, netdev: str) -> int | None:
        if netdev in self._vlans:
            return self._vlans[netdev]
        dev = self._inv.netdev_by_name(netdev)
        if getattr(dev, "kind", None) != "vlan":
            return None
        vid = getattr(dev, "vlan_id", None)
        return vid if isinstance(vid, int) and vid >= 0 else self._UNKNOWN_VLAN

    def lookup_route(self, saddr: IPv4, daddr: IPv4) -> RouteLike | None:
        return self._inv.route_to(daddr)

    def neighbour(self, ifindex: int, ip: IPAddr) -> NeighbourLike | None:
        return self._inv.neighbour(ifindex, ip)


# ---------------------------------------------------------------------------- results
@dataclass(frozen=True, slots=True)
class Decline:
    """A refusal: the CLC decline code and why, in words an operator can act on."""

    code: DeclineReason
    explanation: str

    def __str__(self) -> str:
        return f"{self.code.name} (0x{int(self.code):08x}): {self.explanation}"


@dataclass(frozen=True, slots=True)
class V2Route:
    """Result of ``smc_ib_find_route``: how RoCEv2 packets reach the peer."""

    uses_gateway: bool
    nexthop_mac: bytes
    nexthop: IPv4  # the gateway, or the destination itself on a direct route
    oif: int | None


@dataclass(frozen=True, slots=True)
class GidChoice:
    """A usable GID of one port; ``route`` is set when a v2 destination was checked."""

    device: str
    port: int
    gid_index: int
    gid: bytes
    netdev: str
    route: V2Route | None = None


@dataclass(frozen=True, slots=True)
class SmcrChoice:
    """The port chosen for an SMC-R link group, with what the CLC messages need."""

    gid: GidChoice
    v2_direct: bool = True  # server: advertised in the Accept FCE (= not uses_gateway)
    nexthop_mac: bytes | None = None  # v2: MAC the GRH/L2 header is sent to
    negotiated_eid: bytes | None = None  # v2 server: the matching UEID


@dataclass(frozen=True, slots=True)
class ClientV2Path:
    """Client side of an SMC-Rv2 Accept: the path to use (``smc_connect_rdma_v2_prepare``)."""

    uses_gateway: bool
    nexthop_mac: bytes


# ---------------------------------------------------------------------------- helpers
def gid_ipv4(gid: bytes) -> IPv4 | None:
    """``smc_ib_gid_to_ipv4``: the IPv4 of an IPv4-mapped (::ffff:a.b.c.d) or -compatible
    (::a.b.c.d) GID, else None."""
    if len(gid) == 16 and gid[:10] == bytes(10) and gid[10:12] in (b"\xff\xff", b"\x00\x00"):
        return IPv4(gid[12:])
    return None


def mac_bytes(mac: str | None) -> bytes | None:
    if mac is None:
        return None
    try:
        raw = bytes(int(part, 16) for part in mac.replace("-", ":").split(":"))
    except ValueError:
        return None
    return raw if len(raw) == 6 else None


def _gid_type(g: GidLike) -> str:
    return str(g.type.value)


def _vlan_text(vlan_id: int) -> str:
    return "no VLAN" if vlan_id == 0 else f"VLAN {vlan_id}"


def _vlan_matches(facts: RoutingFacts, netdev: str, vlan_id: int) -> bool:
    dev_vlan = facts.vlan_id(netdev)
    if vlan_id == 0:
        return dev_vlan is None
    return dev_vlan == vlan_id


def _port_name(port: PortLike) -> str:
    return f"{port.device} port {port.num}"


def _v4_addresses(dev: NetDeviceLike) -> list[ipaddress.IPv4Interface]:
    out = []
    for a in dev.addresses:
        if isinstance(a.address, IPv4):
            out.append(ipaddress.IPv4Interface(f"{a.address}/{a.prefixlen}"))
    return out


def find_route_v2(saddr: IPv4, daddr: IPv4, facts: RoutingFacts) -> V2Route | str:
    """``smc_ib_find_route``: the route from ``saddr`` to ``daddr`` and its next-hop MAC, or
    why there is none (a sentence)."""
    route = facts.lookup_route(saddr, daddr)
    if route is None:
        return f"there is no route from {saddr} to {daddr}"
    gw = route.gateway
    if gw is not None and not isinstance(gw, IPv4):
        return (
            f"the route from {saddr} to {daddr} goes through IPv6 gateway {gw}; "
            "SMC-Rv2 needs an IPv4 gateway"
        )
    nexthop = gw if gw is not None else daddr
    if route.oif is None:
        return f"the route from {saddr} to {daddr} names no output interface"
    dev = facts.netdev(route.oif)
    devname = dev.name if dev is not None else f"ifindex {route.oif}"
    neigh = facts.neighbour(route.oif, nexthop)
    what = "gateway" if gw is not None else "peer"
    if neigh is None or not neigh.valid:
        return (
            f"no neighbour (ARP) entry with a MAC for {what} {nexthop} on {devname}; "
            f"SMC-Rv2 needs the next hop's MAC (ping {nexthop} to resolve it)"
        )
    mac = mac_bytes(neigh.lladdr)
    if mac is None:
        return f"the neighbour entry of {what} {nexthop} on {devname} has no usable MAC"
    return V2Route(uses_gateway=gw is not None, nexthop_mac=mac, nexthop=nexthop, oif=route.oif)


def determine_gid(
    port: PortLike,
    vlan_id: int,
    facts: RoutingFacts,
    *,
    v2: bool = False,
    saddr: IPv4 | None = None,
    daddr: IPv4 | None = None,
) -> GidChoice | str:
    """``smc_ib_determine_gid`` for one port: the GID the link group would use, or a sentence
    saying why this port does not fit. ``v2`` needs ``saddr`` (the CLC source address);
    ``daddr`` (server, add-link) also checks the route."""
    if v2 and saddr is None:
        raise ValueError("SMC-Rv2 GID choice needs the CLC source address")
    reasons: list[str] = []
    seen_netdev = False
    for g in port.gids:
        if g.netdev is None or not _vlan_matches(facts, g.netdev, vlan_id):
            continue
        seen_netdev = True
        gtype = _gid_type(g)
        if not v2:
            if gtype == ROCE_V1:
                return GidChoice(port.device, port.num, g.index, g.gid, g.netdev)
            continue
        if gtype != ROCE_V2 or gid_ipv4(g.gid) is None:
            continue
        assert saddr is not None
        dev = facts.netdev_by_name(g.netdev)
        addrs = _v4_addresses(dev) if dev is not None else []
        if not any(saddr in a.network for a in addrs):
            shown = ", ".join(str(a) for a in addrs) or "no IPv4 address"
            reasons.append(
                f"interface {g.netdev} ({shown}) does not contain the connection's source "
                f"{saddr}; SMC-Rv2 needs the RoCE netdev's subnet to contain it"
            )
            continue
        route: V2Route | None = None
        if daddr is not None:
            found = find_route_v2(saddr, daddr, facts)
            if isinstance(found, str):
                reasons.append(found)
                continue
            route = found
        return GidChoice(port.device, port.num, g.index, g.gid, g.netdev, route)
    name = _port_name(port)
    if reasons:
        # one sentence per GID tried; duplicates (several GIDs on one netdev) said once
        return f"{name}: " + "; ".join(dict.fromkeys(reasons))
    if not seen_netdev:
        return f"{name} has no GID on a netdev with {_vlan_text(vlan_id)}"
    if v2:
        return f"{name} has no IPv4-mapped RoCE v2 GID for {_vlan_text(vlan_id)}"
    return f"{name} has no RoCE v1 GID for {_vlan_text(vlan_id)}"


def _no_device(ports: Sequence[PortLike], why: Iterable[str], what: str) -> Decline:
    if not ports:
        text = f"no active RoCE port belongs to the connection's interface ({what})"
    else:
        text = "no RoCE port fits: " + "; ".join(why)
    return Decline(DeclineReason.NOSMCRDEV, text)


def choose_smcr_v1(
    ports: Sequence[PortLike], vlan_id: int, facts: RoutingFacts
) -> SmcrChoice | Decline:
    """SMC-Rv1 (client and server): the first port with a RoCE v1 GID for the VLAN."""
    why: list[str] = []
    for p in ports:
        got = determine_gid(p, vlan_id, facts)
        if isinstance(got, GidChoice):
            return SmcrChoice(got)
        why.append(got)
    return _no_device(ports, why, "SMC-Rv1")


def choose_smcr_v2_client(
    ports: Sequence[PortLike],
    vlan_id: int,
    saddr: IPv4 | IPAddr,
    facts: RoutingFacts,
    *,
    ueid_count: int,
) -> SmcrChoice | Decline:
    """Client Proposal (``smc_find_proposal_devices``): SMC-Rv2 needs an IPv4 CLC socket, a
    configured UEID, and a port whose RoCEv2 GID's netdev subnet holds the source address."""
    if not isinstance(saddr, IPv4):
        return Decline(
            DeclineReason.NOSMCRDEV,
            f"the connection's source {saddr} is not IPv4; SMC-Rv2 works over IPv4 only",
        )
    if ueid_count <= 0:
        return Decline(
            DeclineReason.NOUEID,
            "no UEID is configured; SMC-Rv2 is offered only with a UEID "
            "(add one with 'smcctl ueid add')",
        )
    why: list[str] = []
    for p in ports:
        got = determine_gid(p, vlan_id, facts, v2=True, saddr=saddr)
        if isinstance(got, GidChoice):
            return SmcrChoice(got)
        why.append(got)
    return _no_device(ports, why, "SMC-Rv2")


def match_ueid(local_ueids: Iterable[bytes], peer_ueids: Sequence[bytes]) -> bytes | None:
    """``smc_clc_match_eid`` without SEIDs (SMC-R): the first of the peer's UEIDs that we
    have too."""
    mine = {bytes(u) for u in local_ueids}
    for u in peer_ueids:
        if bytes(u) in mine:
            return bytes(u)
    return None


def choose_smcr_v2_server(
    ports: Sequence[PortLike],
    vlan_id: int,
    saddr: IPv4 | IPAddr,
    peer_gid: bytes,
    peer_mac: bytes,
    facts: RoutingFacts,
    *,
    local_ueids: Iterable[bytes],
    peer_ueids: Sequence[bytes],
) -> SmcrChoice | Decline:
    """Server (``smc_find_rdma_v2_device_serv``): UEID match, then a port whose RoCEv2 GID
    fits the source address and routes to the client's GID. A direct route uses the
    Proposal's MAC as next hop; ``v2_direct`` tells the client which it is."""
    eid = match_ueid(local_ueids, peer_ueids)
    if eid is None:
        return Decline(
            DeclineReason.NOUEID,
            "the peer's UEIDs and ours have none in common; SMC-Rv2 needs a shared UEID "
            "(SEIDs do not count for SMC-R)",
        )
    if not isinstance(saddr, IPv4):
        return Decline(
            DeclineReason.NOSMCRDEV,
            f"the connection's address {saddr} is not IPv4; SMC-Rv2 works over IPv4 only",
        )
    daddr = gid_ipv4(peer_gid)
    if daddr is None:
        return Decline(
            DeclineReason.NOSMCRDEV,
            f"the peer's RoCEv2 GID {peer_gid.hex()} is not IPv4-mapped",
        )
    why: list[str] = []
    for p in ports:
        got = determine_gid(p, vlan_id, facts, v2=True, saddr=saddr, daddr=daddr)
        if isinstance(got, GidChoice):
            assert got.route is not None
            direct = not got.route.uses_gateway
            nexthop = peer_mac if direct else got.route.nexthop_mac
            return SmcrChoice(got, v2_direct=direct, nexthop_mac=nexthop, negotiated_eid=eid)
        why.append(got)
    return _no_device(ports, why, "SMC-Rv2")


def check_accept_path(
    v2_direct: bool,
    saddr: IPv4,
    server_gid: bytes,
    server_mac: bytes,
    facts: RoutingFacts,
) -> ClientV2Path | Decline:
    """Client, SMC-Rv2 Accept with first contact (``smc_connect_rdma_v2_prepare``).

    A direct Accept is trusted (next hop = the server's MAC). For an indirect one the client
    routes from its CLC source to the server's GID: no route/neighbour → NOROUTE; a direct
    route → NOINDIRECT, because the two hosts disagree about the path and RoCEv2 packets with
    the server's hop limit would not arrive symmetrically.
    """
    if v2_direct:
        return ClientV2Path(uses_gateway=False, nexthop_mac=server_mac)
    daddr = gid_ipv4(server_gid)
    if daddr is None:
        return Decline(
            DeclineReason.NOROUTE,
            f"the server's RoCEv2 GID {server_gid.hex()} is not IPv4-mapped, so there is no "
            "route to it",
        )
    found = find_route_v2(saddr, daddr, facts)
    if isinstance(found, str):
        return Decline(
            DeclineReason.NOROUTE,
            f"the server says its path to us uses a gateway, but {found}",
        )
    if not found.uses_gateway:
        return Decline(
            DeclineReason.NOINDIRECT,
            f"the server says its path to us uses a gateway, but our route from {saddr} to "
            f"{daddr} is direct; SMC-Rv2 needs both directions to agree (fix the asymmetric "
            "routes, e.g. the server's route back to this subnet)",
        )
    return ClientV2Path(uses_gateway=True, nexthop_mac=found.nexthop_mac)
