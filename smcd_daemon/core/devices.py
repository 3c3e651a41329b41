"""The device inventory: what the daemon knows about the host's network and RDMA devices.

Pure and synchronous on purpose: the netlink and verbs adapters translate kernel messages into the
dataclasses below and call ``apply_*``/``remove_*``; everything else (CLC device choice, the D-Bus
``Device1`` objects, ``smcctl device show``) reads the inventory and subscribes to its
:class:`DeviceEvent` stream.  Keeping I/O out makes the PNETID rules testable without a kernel.

Every ``apply_*`` is idempotent (re-applying an identical object emits nothing), so an adapter may
replay events that raced a full dump and still converge on the kernel's state.
"""

from __future__ import annotations

import enum
import ipaddress
import logging
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Protocol, TypeAlias

log = logging.getLogger(__name__)

IPAddress: TypeAlias = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork: TypeAlias = ipaddress.IPv4Network | ipaddress.IPv6Network

AF_INET = 2
AF_INET6 = 10

#: CHID the kernel reserves for loopback-ism (``SMC_LO_RESERVED_CHID``).
LOOPBACK_ISM_CHID = 0xFFFF
LOOPBACK_ISM_NAME = "loopback-ism"

# rtnetlink constants we interpret (linux/rtnetlink.h, linux/neighbour.h, linux/if.h).
RT_TABLE_MAIN = 254
RT_TABLE_LOCAL = 255
RTN_UNICAST = 1
RTN_LOCAL = 2
IFF_UP = 0x1
NUD_INCOMPLETE = 0x01
NUD_REACHABLE = 0x02
NUD_STALE = 0x04
NUD_DELAY = 0x08
NUD_PROBE = 0x10
NUD_FAILED = 0x20
NUD_NOARP = 0x40
NUD_PERMANENT = 0x80
#: ``NUD_VALID`` of the kernel: a neighbour whose link-layer address may be used.
NUD_VALID = NUD_PERMANENT | NUD_NOARP | NUD_REACHABLE | NUD_PROBE | NUD_STALE | NUD_DELAY

#: Link kinds whose ``IFLA_LINK`` names a *lower* device in the kernel's adjacency sense (the
#: device they are stacked on).  veth's ``IFLA_LINK`` is its peer, not a lower device.
STACKED_KINDS = frozenset({"vlan", "macvlan", "macvtap", "ipvlan", "ipvtap"})


class PnetLookup(Protocol):
    """What device resolution needs from the pnet table (``smcd_daemon.core.pnet.PnetTable``)."""

    def pnetid_of_netdev(self, name: str) -> str | None: ...

    def pnetid_of_ibport(self, dev: str, port: int) -> str | None: ...


# --------------------------------------------------------------------------------------------
# Network devices
# --------------------------------------------------------------------------------------------


class OperState(enum.Enum):
    """RFC 2863 operational state as rtnetlink reports it (``IFLA_OPERSTATE``)."""

    UNKNOWN = "UNKNOWN"
    NOTPRESENT = "NOTPRESENT"
    DOWN = "DOWN"
    LOWERLAYERDOWN = "LOWERLAYERDOWN"
    TESTING = "TESTING"
    DORMANT = "DORMANT"
    UP = "UP"

    @classmethod
    def parse(cls, value: object) -> OperState:
        """Accept the name (pyroute2 decodes it) or the raw number; anything else is UNKNOWN."""
        if isinstance(value, str):
            try:
                return cls(value.upper())
            except ValueError:
                return cls.UNKNOWN
        if isinstance(value, int):
            order = list(cls)
            return order[value] if 0 <= value < len(order) else cls.UNKNOWN
        return cls.UNKNOWN


@dataclass(frozen=True, slots=True)
class Address:
    """One IP address on a netdev (``RTM_NEWADDR``)."""

    ifindex: int
    address: IPAddress
    prefixlen: int

    @property
    def family(self) -> int:
        return AF_INET if self.address.version == 4 else AF_INET6

    @property
    def interface(self) -> ipaddress.IPv4Interface | ipaddress.IPv6Interface:
        return ipaddress.ip_interface(f"{self.address}/{self.prefixlen}")

    @property
    def network(self) -> IPNetwork:
        return self.interface.network

    def __str__(self) -> str:
        return f"{self.address}/{self.prefixlen}"


@dataclass(frozen=True, slots=True)
class NetDevice:
    """A network interface as rtnetlink describes it (``RTM_NEWLINK``)."""

    ifindex: int
    name: str
    mac: str | None = None
    mtu: int = 0
    operstate: OperState = OperState.UNKNOWN
    carrier: bool = False
    admin_up: bool = False
    kind: str | None = None
    #: ``IFLA_MASTER``: the bond/bridge/team this device is enslaved to.
    master: int | None = None
    #: ``IFLA_LINK``: for stacked kinds (vlan, macvlan…) the lower device; for veth the peer.
    link: int | None = None
    addresses: tuple[Address, ...] = ()
    #: ``IFLA_VLAN_ID`` of a ``vlan`` netdev (from ``IFLA_LINKINFO``/``IFLA_INFO_DATA``); None
    #: for other kinds, or a vlan whose message did not carry it.
    vlan_id: int | None = None

    @property
    def is_up(self) -> bool:
        """Usable for traffic: administratively up, carrier present, operationally up."""
        return (
            self.admin_up and self.carrier and self.operstate in (OperState.UP, OperState.UNKNOWN)
        )


@dataclass(frozen=True, slots=True)
class Route:
    """One route (``RTM_NEWROUTE``); only what device choice and SMC-Rv2 routing need."""

    dst: IPNetwork
    oif: int | None = None
    gateway: IPAddress | None = None
    table: int = RT_TABLE_MAIN
    priority: int = 0
    type: int = RTN_UNICAST
    prefsrc: IPAddress | None = None

    @property
    def family(self) -> int:
        return AF_INET if self.dst.version == 4 else AF_INET6

    @property
    def key(self) -> tuple[object, ...]:
        """Identity of the route: as the kernel distinguishes them (table, prefix, metric) plus
        the output device, so per-device IPv6 link-local routes stay apart."""
        return (self.family, self.table, self.dst, self.priority, self.oif, self.type)


@dataclass(frozen=True, slots=True)
class Neighbour:
    """A neighbour (ARP/NDP) entry (``RTM_NEWNEIGH``)."""

    ifindex: int
    dst: IPAddress
    lladdr: str | None = None
    state: int = 0

    @property
    def valid(self) -> bool:
        """``NUD_VALID``: the kernel would use this MAC (``smc_ib_find_route`` requires it)."""
        return bool(self.state & NUD_VALID) and self.lladdr is not None

    @property
    def key(self) -> tuple[int, IPAddress]:
        return (self.ifindex, self.dst)


# --------------------------------------------------------------------------------------------
# RDMA devices
# --------------------------------------------------------------------------------------------


class GidType(enum.Enum):
    """GID type as ``gid_attrs/types/<idx>`` spells it, modelled on ``ib_gid_type``."""

    IB = "IB"
    ROCE_V1 = "RoCE v1"
    ROCE_V2 = "RoCE v2"

    @classmethod
    def parse(cls, text: str) -> GidType:
        """Parse sysfs text ("IB/RoCE v1", "RoCE v2") or pyverbs' names ("RoCEv1", "RoCEv2")."""
        t = text.strip().replace(" ", "").lower()
        if t in ("rocev2",):
            return cls.ROCE_V2
        if t in ("rocev1", "ib/rocev1"):
            return cls.ROCE_V1
        if t == "ib":
            return cls.IB
        raise ValueError(f"unknown GID type {text!r}")


class PortState(enum.IntEnum):
    """``enum ibv_port_state``."""

    NOP = 0
    DOWN = 1
    INIT = 2
    ARMED = 3
    ACTIVE = 4
    ACTIVE_DEFER = 5


@dataclass(frozen=True, slots=True)
class Gid:
    """One entry of a port's GID table."""

    index: int
    gid: bytes
    type: GidType
    netdev: str | None = None

    def __post_init__(self) -> None:
        if len(self.gid) != 16:
            raise ValueError(f"GID must be 16 bytes, got {len(self.gid)}")

    @property
    def ipv4(self) -> ipaddress.IPv4Address | None:
        """The IPv4 address of an IPv4-mapped (or -compatible) GID, as ``smc_ib_gid_to_ipv4``."""
        if self.gid[:10] == bytes(10) and self.gid[10:12] in (b"\xff\xff", b"\x00\x00"):
            return ipaddress.IPv4Address(self.gid[12:])
        return None

    def __str__(self) -> str:
        h = self.gid.hex()
        return ":".join(h[i : i + 4] for i in range(0, 32, 4))


@dataclass(frozen=True, slots=True)
class RdmaPort:
    """One port of an RDMA device."""

    device: str
    num: int
    state: PortState = PortState.DOWN
    active_mtu: int = 0
    link_layer: str = "Ethernet"
    gids: tuple[Gid, ...] = ()

    @property
    def active(self) -> bool:
        return self.state == PortState.ACTIVE

    @property
    def netdev(self) -> str | None:
        """The netdev this port belongs to (``ib_device_get_netdev``): that of the first GID
        carrying one; on RoCE every GID of a port names the port's netdev or a VLAN on it."""
        for g in self.gids:
            if g.netdev is not None:
                return g.netdev
        return None

    def netdevs(self) -> frozenset[str]:
        return frozenset(g.netdev for g in self.gids if g.netdev is not None)


@dataclass(frozen=True, slots=True)
class RdmaDevice:
    """An RDMA device (``ibv_device``) with its ports."""

    name: str
    node_guid: int = 0
    ports: tuple[RdmaPort, ...] = ()

    @property
    def node_guid_str(self) -> str:
        h = f"{self.node_guid:016x}"
        return ":".join(h[i : i + 4] for i in range(0, 16, 4))

    def port(self, num: int) -> RdmaPort | None:
        for p in self.ports:
            if p.num == num:
                return p
        return None


# --------------------------------------------------------------------------------------------
# loopback-ism
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LoopbackIsm:
    """The virtual SMC-D device of the kernel's ``smc_loopback.c``: CHID 0xFFFF and a random
    128-bit GID chosen at start, so it only ever matches itself (same daemon = same host)."""

    gid: bytes
    enabled: bool = True
    chid: int = LOOPBACK_ISM_CHID
    name: str = LOOPBACK_ISM_NAME

    def __post_init__(self) -> None:
        if len(self.gid) != 16:
            raise ValueError(f"loopback-ism GID must be 16 bytes, got {len(self.gid)}")

    @classmethod
    def create(cls, *, enabled: bool = True) -> LoopbackIsm:
        """A fresh device with a random GID (``uuid_gen`` in the kernel)."""
        return cls(gid=uuid.uuid4().bytes, enabled=enabled)

    @property
    def gid_hi(self) -> int:
        """First 8 bytes: the GID that goes in the 64-bit GID fields of CLC messages."""
        return int.from_bytes(self.gid[:8], "big")

    @property
    def gid_ext(self) -> int:
        """Last 8 bytes: the extended GID (``gid_ext``) of SMC-Dv2.1 Accept/Confirm."""
        return int.from_bytes(self.gid[8:], "big")


# --------------------------------------------------------------------------------------------
# Events and the inventory
# --------------------------------------------------------------------------------------------


class EventKind(enum.Enum):
    ADDED = "added"
    CHANGED = "changed"
    REMOVED = "removed"


DeviceObject: TypeAlias = NetDevice | Address | Route | Neighbour | RdmaDevice | LoopbackIsm


@dataclass(frozen=True, slots=True)
class DeviceEvent:
    """One change in the inventory. ``object`` is the new state (the old one for REMOVED);
    ``timestamp`` is the inventory clock (``time.monotonic`` by default) when it was applied."""

    kind: EventKind
    object: DeviceObject
    timestamp: float = field(default=0.0, compare=False)


Subscriber: TypeAlias = Callable[[DeviceEvent], None]


class DeviceInventory:
    """Netdevs, addresses, routes, neighbours, RDMA devices and loopback-ism, with change events.

    An address change emits two events: one for the :class:`Address` itself and a CHANGED for the
    :class:`NetDevice` carrying the new ``addresses`` tuple, so a consumer that mirrors devices
    (D-Bus ``Device1``) needs to watch only netdevs.
    """

    def __init__(
        self,
        *,
        loopback_enabled: bool = True,
        loopback_gid: bytes | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._clock = clock
        self._links: dict[int, NetDevice] = {}
        self._addrs: dict[int, dict[IPAddress, Address]] = {}
        self._routes: dict[tuple[object, ...], Route] = {}
        self._neighs: dict[tuple[int, IPAddress], Neighbour] = {}
        self._rdma: dict[str, RdmaDevice] = {}
        self._loopback = (
            LoopbackIsm(gid=loopback_gid, enabled=loopback_enabled)
            if loopback_gid is not None
            else LoopbackIsm.create(enabled=loopback_enabled)
        )
        self._subscribers: list[Subscriber] = []

    # -- subscriptions ---------------------------------------------------------------------

    def subscribe(self, callback: Subscriber) -> Callable[[], None]:
        """Call ``callback`` on every change; returns a function that unsubscribes."""
        self._subscribers.append(callback)

        def unsubscribe() -> None:
            if callback in self._subscribers:
                self._subscribers.remove(callback)

        return unsubscribe

    def _emit(self, kind: EventKind, obj: DeviceObject) -> DeviceEvent:
        ev = DeviceEvent(kind, obj, self._clock())
        for cb in tuple(self._subscribers):
            try:
                cb(ev)
            except Exception:
                # One broken observer must not stop the inventory from following the kernel.
                log.exception("device event subscriber %r failed on %s", cb, ev)
        return ev

    # -- reading ---------------------------------------------------------------------------

    def netdevs(self) -> tuple[NetDevice, ...]:
        return tuple(sorted(self._links.values(), key=lambda d: d.ifindex))

    def netdev(self, ifindex: int) -> NetDevice | None:
        return self._links.get(ifindex)

    def netdev_by_name(self, name: str) -> NetDevice | None:
        for d in self._links.values():
            if d.name == name:
                return d
        return None

    def addresses(self, ifindex: int | None = None) -> tuple[Address, ...]:
        if ifindex is not None:
            return tuple(self._addrs.get(ifindex, {}).values())
        return tuple(a for per in self._addrs.values() for a in per.values())

    def routes(self) -> tuple[Route, ...]:
        return tuple(self._routes.values())

    def neighbours(self) -> tuple[Neighbour, ...]:
        return tuple(self._neighs.values())

    def rdma_devices(self) -> tuple[RdmaDevice, ...]:
        return tuple(sorted(self._rdma.values(), key=lambda d: d.name))

    def rdma_device(self, name: str) -> RdmaDevice | None:
        return self._rdma.get(name)

    @property
    def loopback_ism(self) -> LoopbackIsm:
        return self._loopback

    # -- links and addresses ---------------------------------------------------------------

    def apply_link(self, dev: NetDevice) -> list[DeviceEvent]:
        """Add or update a netdev. Its ``addresses`` field is ignored: addresses come from
        :meth:`apply_address` and are filled in by the inventory."""
        dev = replace(dev, addresses=self._addr_tuple(dev.ifindex))
        old = self._links.get(dev.ifindex)
        if old == dev:
            return []
        self._links[dev.ifindex] = dev
        return [self._emit(EventKind.ADDED if old is None else EventKind.CHANGED, dev)]

    def remove_link(self, ifindex: int) -> list[DeviceEvent]:
        """Forget a netdev and everything bound to it (the kernel does not always notify the
        removal of IPv4 routes and neighbours of a vanished device)."""
        events: list[DeviceEvent] = []
        for a in self._addrs.pop(ifindex, {}).values():
            events.append(self._emit(EventKind.REMOVED, a))
        for key, r in list(self._routes.items()):
            if r.oif == ifindex:
                del self._routes[key]
                events.append(self._emit(EventKind.REMOVED, r))
        for nkey, n in list(self._neighs.items()):
            if n.ifindex == ifindex:
                del self._neighs[nkey]
                events.append(self._emit(EventKind.REMOVED, n))
        dev = self._links.pop(ifindex, None)
        if dev is not None:
            events.append(self._emit(EventKind.REMOVED, dev))
        return events

    def _addr_tuple(self, ifindex: int) -> tuple[Address, ...]:
        per = self._addrs.get(ifindex, {})
        return tuple(sorted(per.values(), key=lambda a: (a.address.version, a.address)))

    def _refresh_link_addrs(self, ifindex: int) -> list[DeviceEvent]:
        dev = self._links.get(ifindex)
        if dev is None:
            return []
        new = replace(dev, addresses=self._addr_tuple(ifindex))
        if new == dev:
            return []
        self._links[ifindex] = new
        return [self._emit(EventKind.CHANGED, new)]

    def apply_address(self, addr: Address) -> list[DeviceEvent]:
        per = self._addrs.setdefault(addr.ifindex, {})
        old = per.get(addr.address)
        if old == addr:
            return []
        per[addr.address] = addr
        events = [self._emit(EventKind.ADDED if old is None else EventKind.CHANGED, addr)]
        return events + self._refresh_link_addrs(addr.ifindex)

    def remove_address(self, addr: Address) -> list[DeviceEvent]:
        per = self._addrs.get(addr.ifindex, {})
        old = per.pop(addr.address, None)
        if old is None:
            return []
        if not per:
            self._addrs.pop(addr.ifindex, None)
        return [self._emit(EventKind.REMOVED, old), *self._refresh_link_addrs(addr.ifindex)]

    # -- routes and neighbours -------------------------------------------------------------

    def apply_route(self, route: Route) -> list[DeviceEvent]:
        old = self._routes.get(route.key)
        if old == route:
            return []
        self._routes[route.key] = route
        return [self._emit(EventKind.ADDED if old is None else EventKind.CHANGED, route)]

    def remove_route(self, route: Route) -> list[DeviceEvent]:
        old = self._routes.pop(route.key, None)
        return [] if old is None else [self._emit(EventKind.REMOVED, old)]

    def replace_routes(self, routes: Iterable[Route]) -> list[DeviceEvent]:
        """Make the route table exactly ``routes`` (after a re-dump), emitting the difference."""
        new = {r.key: r for r in routes}
        events: list[DeviceEvent] = []
        for key, old in list(self._routes.items()):
            if key not in new:
                del self._routes[key]
                events.append(self._emit(EventKind.REMOVED, old))
        for r in new.values():
            events += self.apply_route(r)
        return events

    def apply_neighbour(self, neigh: Neighbour) -> list[DeviceEvent]:
        old = self._neighs.get(neigh.key)
        if old == neigh:
            return []
        self._neighs[neigh.key] = neigh
        return [self._emit(EventKind.ADDED if old is None else EventKind.CHANGED, neigh)]

    def remove_neighbour(self, neigh: Neighbour) -> list[DeviceEvent]:
        old = self._neighs.pop(neigh.key, None)
        return [] if old is None else [self._emit(EventKind.REMOVED, old)]

    def replace_network(
        self,
        links: Iterable[NetDevice],
        addresses: Iterable[Address],
        routes: Iterable[Route],
        neighbours: Iterable[Neighbour],
    ) -> list[DeviceEvent]:
        """Make the network part equal to a full dump (start-up or resync after the netlink
        socket overflowed), emitting only the differences."""
        links = list(links)
        addresses = list(addresses)
        neighbours = list(neighbours)
        events: list[DeviceEvent] = []
        keep = {d.ifindex for d in links}
        for ifindex in [i for i in self._links if i not in keep]:
            events += self.remove_link(ifindex)
        for d in links:
            events += self.apply_link(d)
        want_addrs = {(a.ifindex, a.address) for a in addresses}
        for a in self.addresses():
            if (a.ifindex, a.address) not in want_addrs:
                events += self.remove_address(a)
        for a in addresses:
            events += self.apply_address(a)
        events += self.replace_routes(routes)
        want_neighs = {n.key for n in neighbours}
        for n in list(self._neighs.values()):
            if n.key not in want_neighs:
                events += self.remove_neighbour(n)
        for n in neighbours:
            events += self.apply_neighbour(n)
        return events

    # -- RDMA ------------------------------------------------------------------------------

    def apply_rdma_device(self, dev: RdmaDevice) -> list[DeviceEvent]:
        old = self._rdma.get(dev.name)
        if old == dev:
            return []
        self._rdma[dev.name] = dev
        return [self._emit(EventKind.ADDED if old is None else EventKind.CHANGED, dev)]

    def remove_rdma_device(self, name: str) -> list[DeviceEvent]:
        old = self._rdma.pop(name, None)
        return [] if old is None else [self._emit(EventKind.REMOVED, old)]

    def replace_rdma_devices(self, devices: Iterable[RdmaDevice]) -> list[DeviceEvent]:
        devices = list(devices)
        names = {d.name for d in devices}
        events: list[DeviceEvent] = []
        for name in [n for n in self._rdma if n not in names]:
            events += self.remove_rdma_device(name)
        for d in devices:
            events += self.apply_rdma_device(d)
        return events

    def set_loopback_enabled(self, enabled: bool) -> list[DeviceEvent]:
        if self._loopback.enabled == enabled:
            return []
        self._loopback = replace(self._loopback, enabled=enabled)
        return [self._emit(EventKind.CHANGED, self._loopback)]

    # -- PNETID resolution (kernel smc_pnet.c) ---------------------------------------------

    def _slaves(self) -> dict[int, list[NetDevice]]:
        """Slaves by their master's ifindex, each list in ifindex order (one pass)."""
        slaves: dict[int, list[NetDevice]] = {}
        for d in sorted(self._links.values(), key=lambda d: d.ifindex):
            if d.master is not None:
                slaves.setdefault(d.master, []).append(d)
        return slaves

    def _lower_netdevs(self, dev: NetDevice, slaves: dict[int, list[NetDevice]]) -> list[NetDevice]:
        """The kernel's adjacency list below ``dev``: its slaves (bond/bridge/team), then the
        device a vlan/macvlan/ipvlan is stacked on."""
        out = list(slaves.get(dev.ifindex, ()))
        if dev.kind in STACKED_KINDS and dev.link is not None and dev.link != dev.ifindex:
            below = self._links.get(dev.link)
            if below is not None and below not in out:
                out.append(below)
        return out

    def lower_netdev(self, dev: NetDevice) -> NetDevice | None:
        """The first lower device in the kernel's adjacency list (:meth:`_lower_netdevs`)."""
        lower = self._lower_netdevs(dev, self._slaves())
        return lower[0] if lower else None

    def clc_vlan_id(
        self, name: str, vlan_of: Callable[[NetDevice], int | None] | None = None
    ) -> int | None:
        """The VLAN a socket leaving through netdev ``name`` is on (``smc_vlan_by_tcpsk``): the
        netdev's own if it is a VLAN, else the first VLAN met walking its lower devices depth
        first (a macvlan or bridge on ``eth0.10`` is on VLAN 10). None: no VLAN on the way;
        -1: the first VLAN met has no known id. ``vlan_of`` answers per device (default: its
        ``vlan_id``, -1 for a vlan without one), so explicit VLAN tables can take part."""

        def own(d: NetDevice) -> int | None:
            if d.kind != "vlan":
                return None
            return d.vlan_id if d.vlan_id is not None else -1

        answer = vlan_of or own
        start = self.netdev_by_name(name)
        if start is None:
            return None
        vlan = answer(start)
        if vlan is not None:  # the socket's own netdev is the VLAN: no walk
            return vlan
        slaves = self._slaves()  # once per walk: a bridge's ports are one pass, not one each
        stack = self._lower_netdevs(start, slaves)[::-1]
        seen = {start.ifindex}
        while stack:
            dev = stack.pop()
            if dev.ifindex in seen:
                continue
            seen.add(dev.ifindex)
            vlan = answer(dev)
            if vlan is not None:
                return vlan
            stack.extend(reversed(self._lower_netdevs(dev, slaves)))
        return None

    def base_netdev(self, name: str) -> NetDevice | None:
        """``pnet_find_base_ndev``: follow first lower devices down to the bottom."""
        dev = self.netdev_by_name(name)
        seen: set[int] = set()
        while dev is not None and dev.ifindex not in seen:
            seen.add(dev.ifindex)
            lower = self.lower_netdev(dev)
            if lower is None:
                break
            dev = lower
        return dev

    def resolve_pnetid(self, netdev: str, pnet: PnetLookup) -> str | None:
        """The PNETID of a socket's netdev as ``smc_pnet_find_roce_by_pnetid`` determines it:
        the base device's PNETID (hardware PNETIDs do not exist here, so the user table), else
        the netdev's own table entry; None if neither has one."""
        base = self.base_netdev(netdev)
        if base is not None:
            pnetid = pnet.pnetid_of_netdev(base.name)
            if pnetid is not None:
                return pnetid
        return pnet.pnetid_of_netdev(netdev)

    def rdma_ports_for_netdev(self, netdev: str) -> list[RdmaPort]:
        """RDMA ports whose GID table belongs to ``netdev`` (``ib_device_get_netdev`` match)."""
        return [p for d in self.rdma_devices() for p in d.ports if netdev in p.netdevs()]

    def rdma_ports_by_pnetid(self, pnetid: str, pnet: PnetLookup) -> list[RdmaPort]:
        return [
            p
            for d in self.rdma_devices()
            for p in d.ports
            if pnet.pnetid_of_ibport(d.name, p.num) == pnetid
        ]

    def smcr_ports_for(self, netdev: str, pnet: PnetLookup) -> list[RdmaPort]:
        """Active RoCE ports usable for a CLC socket on ``netdev``, in the kernel's order:
        by PNETID if the netdev has one, else the ports of the base netdev itself
        (``smc_pnet_find_rdma_dev``) so that no table is needed on plain RoCE hosts.  The GID
        checks (VLAN, RoCE v1/v2, subnet, route) are the caller's (SMC-R device choice)."""
        pnetid = self.resolve_pnetid(netdev, pnet)
        if pnetid is not None:
            ports = self.rdma_ports_by_pnetid(pnetid, pnet)
        else:
            base = self.base_netdev(netdev)
            ports = self.rdma_ports_for_netdev(base.name if base is not None else netdev)
        return [p for p in ports if p.active]

    def smcd_v2_devices(self, pnet: PnetLookup) -> list[LoopbackIsm]:
        """SMC-Dv2 devices a client may offer (``smc_find_ism_v2_device_clnt``): enabled
        (emulated-)ISM devices whose PNETID is unset or equals that of any netdev here."""
        lo = self._loopback
        if not lo.enabled:
            return []
        pnetid = pnet.pnetid_of_ibport(lo.name, 1)
        if pnetid is None:
            return [lo]
        if any(pnet.pnetid_of_netdev(d.name) == pnetid for d in self._links.values()):
            return [lo]
        return []

    # -- routing helpers (SMC-Rv2) ---------------------------------------------------------

    def routes_to(self, dst: IPAddress | str) -> list[Route]:
        """Routes covering ``dst``, best first: local table before main (as the default policy
        rules), longest prefix, lowest metric. Not a full FIB (no rules, no multipath)."""
        ip = ipaddress.ip_address(dst) if isinstance(dst, str) else dst
        table_rank = {RT_TABLE_LOCAL: 0, RT_TABLE_MAIN: 1}
        candidates = [
            r
            for r in self._routes.values()
            if r.dst.version == ip.version
            and ip in r.dst
            and r.type in (RTN_UNICAST, RTN_LOCAL)
            and r.table in table_rank
        ]
        candidates.sort(key=lambda r: (table_rank[r.table], -r.dst.prefixlen, r.priority))
        return candidates

    def route_to(self, dst: IPAddress | str) -> Route | None:
        found = self.routes_to(dst)
        return found[0] if found else None

    def neighbour(self, ifindex: int, ip: IPAddress | str) -> Neighbour | None:
        addr = ipaddress.ip_address(ip) if isinstance(ip, str) else ip
        return self._neighs.get((ifindex, addr))

    def netdev_with_subnet(self, ip: IPAddress | str) -> NetDevice | None:
        """The netdev owning an address whose subnet contains ``ip`` (``inet_ifa_match``)."""
        addr = ipaddress.ip_address(ip) if isinstance(ip, str) else ip
        for a in self.addresses():
            if a.address.version == addr.version and addr in a.network:
                return self._links.get(a.ifindex)
        return None
