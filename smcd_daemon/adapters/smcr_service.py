"""SMC-R for handed-off TCP connections: the CLC handshake over the borrowed socket, LLC
CONFIRM LINK for a first contact, then a channel for the application.

:class:`SmcrService` is what the handoff server calls for SMC-R (``connect`` for a client half,
``accept`` for a server half); the result is either an :class:`SmcrChannel` - the application's
:class:`~smc_handoff.channel.ChannelFds` (mode ``"smcr"``: the same channel as loopback, the
daemon being the peer) - or the negotiator's :class:`FallbackOutcome` with its reason.

Order of a first contact, as the kernel does it:

* client: the Accept names the server's QP → our QP goes to RTR (``begin_first_link``) → the
  Confirm leaves → we wait for the server's LLC CONFIRM LINK and answer it;
* server: the Confirm names the client's QP → RTR, RTS, LLC CONFIRM LINK → wait for the answer.

If the link does not come up, the negotiation is told (``link_failed``): it waits briefly for
the peer's Decline, else declines with SMC_CLC_DECL_TIMEOUT_CL, and everything it took (RMB,
link group) is given back. Handshakes are serialized per role, from the peer's first message on
(the kernel's ``smc_client_lgr_pending``/``smc_server_lgr_pending``: a client's Proposal and
the Accept it waits for pass unlocked), so a second connection to the same peer finds the first
one's link group and reuses it (no new QP), and two hosts dialing each other at once do not wait
on each other.

Facts for the negotiator come from the device inventory (netdevs, addresses, RDMA ports and
GIDs) and, for routes and neighbours, from the kernel itself (``RTM_GETROUTE`` with the source
address, so policy routing is honoured as ``ip_route_output_flow`` honours it; the inventory's
route table knows only the main and local tables).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ipaddress
import logging
import os
import secrets
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from smc_handoff.channel import ChannelFds
from smcd_daemon.adapters.clc_io import BorrowedTcp, drive, peek_proposal
from smcd_daemon.adapters.netns_view import NamespaceRoute, own_netns, route_pnet
from smcd_daemon.adapters.tcp_identity import NetnsId
from smcd_daemon.core import registry as reg
from smcd_daemon.core.devices import (
    DeviceEvent,
    DeviceInventory,
    EventKind,
    GidType,
    NetDevice,
    RdmaPort,
)
from smcd_daemon.core.eid import EidTable
from smcd_daemon.core.pnet import PnetTable
from smcd_daemon.errors import SmcError
from smcd_daemon.protocol.negotiate import (
    ClientSmcrNegotiation,
    FallbackOutcome,
    LinkGroupRequest,
    Negotiation,
    Outcome,
    ServerSmcrNegotiation,
    SmcrFacts,
    SmcrOutcome,
    Step,
)
from smcd_daemon.protocol.smcr_route import InventoryRouting, NetDeviceLike, RouteLike
from smcd_daemon.transport.smcr import AltPort, SmcrTransport
from smcd_daemon.wire.clc import IpPrefixes
from smcd_daemon.wire.reasons import DeclineReason

__all__ = [
    "KernelRouting",
    "SmcrChannel",
    "SmcrResult",
    "SmcrService",
]

log = logging.getLogger(__name__)

IPAddr = ipaddress.IPv4Address | ipaddress.IPv6Address
_NUD_VALID = 0x02 | 0x04 | 0x08 | 0x10 | 0x40 | 0x80  # REACHABLE STALE DELAY PROBE NOARP PERM


@dataclass(frozen=True)
class SmcrChannel:
    """SMC-R is up: the application's descriptors (send them, then close these copies)."""

    conn_id: int
    fds: ChannelFds
    lgr_id: int
    link_id: int
    first_contact: bool
    mode: str = "smcr"


SmcrResult = SmcrChannel | FallbackOutcome


@dataclass(frozen=True)
class _Route:
    oif: int | None
    gateway: IPAddr | None


@dataclass(frozen=True)
class _Neigh:
    lladdr: str | None
    valid: bool


class _NoPnet:
    def pnetid_of_netdev(self, name: str) -> str | None:
        return None

    def pnetid_of_ibport(self, dev: str, port: int) -> str | None:
        return None


class KernelRouting:
    """``RoutingFacts`` from the inventory (netdevs, VLANs, neighbours it has seen) with routes
    and missing neighbours asked of the kernel directly.

    The negotiator's facts are synchronous, and pyroute2's synchronous ``IPRoute`` refuses to
    run inside a running event loop, so the queries run on one worker thread with its own
    ``IPRoute`` and the caller waits for the answer."""

    def __init__(self, inventory: DeviceInventory, *, timeout: float = 2.0) -> None:
        self._inv = InventoryRouting(inventory)
        self._ipr: Any = None
        self._timeout = timeout
        self._worker = concurrent.futures.ThreadPoolExecutor(1, "smcd-rtnl")

    def _ask(self, fn: Callable[[Any], Any]) -> Any:
        def call() -> Any:
            if self._ipr is None:
                from pyroute2 import IPRoute  # type: ignore[import-untyped]

                self._ipr = IPRoute()
            return fn(self._ipr)

        return self._worker.submit(call).result(self._timeout)

    def netdev_by_name(self, name: str) -> NetDeviceLike | None:
        return self._inv.netdev_by_name(name)

    def netdev(self, ifindex: int) -> NetDeviceLike | None:
        return self._inv.netdev(ifindex)

    def vlan_id(self, netdev: str) -> int | None:
        return self._inv.vlan_id(netdev)

    def lookup_route(
        self, saddr: ipaddress.IPv4Address, daddr: ipaddress.IPv4Address
    ) -> RouteLike | None:
        try:
            msgs = self._ask(lambda ipr: ipr.route("get", dst=str(daddr), src=str(saddr)))
        except Exception as e:  # NetlinkError: no route (ENETUNREACH, EINVAL for a bad src)
            log.debug("route %s -> %s: %s", saddr, daddr, e)
            return None
        if not msgs or msgs[0]["type"] not in (1, 2):  # RTN_UNICAST, RTN_LOCAL
            return None
        gw = msgs[0].get_attr("RTA_GATEWAY")
        return _Route(msgs[0].get_attr("RTA_OIF"), ipaddress.ip_address(gw) if gw else None)

    def neighbour(self, ifindex: int, ip: IPAddr) -> Any:
        nb = self._inv.neighbour(ifindex, ip)
        if nb is not None and nb.valid:
            return nb
        try:
            msgs = self._ask(lambda ipr: ipr.get_neighbours(dst=str(ip), ifindex=ifindex))
        except Exception as e:
            log.debug("neighbour %s on %d: %s", ip, ifindex, e)
            return nb
        for m in msgs:
            return _Neigh(m.get_attr("NDA_LLADDR"), bool(m["state"] & _NUD_VALID))
        return nb

    def close(self) -> None:
        def shut(ipr: Any) -> None:
            if ipr is not None:
                ipr.close()

        with contextlib.suppress(Exception):
            self._worker.submit(shut, self._ipr).result(self._timeout)
        self._ipr = None
        self._worker.shutdown(wait=False)


class _Pending:
    """One handshake's hold on its role's link-group lock: taken once, when the peer's first
    message is about to be acted on, released by the handshake's owner at its end."""

    def __init__(self, lock: asyncio.Lock) -> None:
        self._lock = lock
        self._held = False

    async def acquire(self) -> None:
        if not self._held:
            await self._lock.acquire()
            self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._lock.release()


class SmcrService:
    """SMC-R handshakes and connections for one smcd (see the module docstring).

    ``inventory`` must be live (netlink watcher and RDMA discovery feeding it); ``eids`` needs a
    UEID for SMC-Rv2. ``system_id`` is the 8-byte CLC peer id (2 random bytes + a MAC; made up
    if None). ``registry`` defaults to the transport's."""

    def __init__(
        self,
        transport: SmcrTransport,
        inventory: DeviceInventory,
        eids: EidTable,
        *,
        system_id: bytes | None = None,
        pnet: Any = None,
        rmb_size: int = 64 * 1024,
        max_conns: int = 255,
        max_links: int = 2,
        smcr_v1: bool = True,
        smcr_v2: bool = True,
        clc_wait: float = 2.0,
        proposal_wait: float = 2.0,
        confirm_link_wait: float = 15.0,
        hostname: str | None = None,
        routing: Any = None,
        uid_of: Callable[[], int] | None = None,
    ) -> None:
        self.transport = transport
        self.registry = transport.registry
        self.inventory = inventory
        self.eids = eids
        self.system_id = system_id or secrets.token_bytes(2) + _first_mac(inventory)
        self.pnet = pnet if pnet is not None else _NoPnet()
        self.rmb_size = rmb_size
        self.max_conns = max_conns
        self.max_links = max_links
        self.smcr_v1 = smcr_v1
        self.smcr_v2 = smcr_v2
        self.clc_wait = clc_wait
        self.proposal_wait = proposal_wait
        self.confirm_link_wait = confirm_link_wait
        self.hostname = hostname if hostname is not None else socket.gethostname()
        self.routing = routing if routing is not None else KernelRouting(inventory)
        # The kernel's smc_client_lgr_pending and smc_server_lgr_pending: one handshake per role
        # at a time decides about link groups (so the next finds the link group the first made),
        # but a client handshake never waits for a server one. With one lock for both, two
        # daemons dialing each other at once each held theirs while waiting for the other's
        # Accept, which the other's server half could not send until a timer fired.
        self._client_lock = asyncio.Lock()
        self._server_lock = asyncio.Lock()
        if transport.alt_ports is None:
            transport.alt_ports = self.alt_ports_for
        self._netdev_up = {d.name: d.is_up for d in inventory.netdevs()}
        self._unsubscribe = inventory.subscribe(self._on_device)

    # ------------------------------------------------------------------ facts
    def facts_for(
        self,
        local: IPAddr,
        peer: IPAddr,
        *,
        rmb_size: int = 0,
        where: NamespaceRoute | None = None,
    ) -> SmcrFacts:
        """What we offer for a connection from ``local`` to ``peer``; ``where`` is the route
        and PNETID of a connection from another namespace (#15): its ports are the shared RDMA
        ports with that PNETID, none without one (that namespace's netdevs are not ours)."""
        netdev = self._netdev_for(local, peer) if where is None else where.netdev
        ports: tuple[Any, ...] = ()
        prefixes = None
        vlan = 0
        if netdev is not None:
            if where is None:
                found = self.inventory.smcr_ports_for(netdev.name, self.pnet)
                vlan = self._clc_vlan(netdev.name)
            else:
                # The VLAN as the walk found it in that namespace (its netdevs are not ours).
                walked = where.vlan_id
                if walked is None and where.netdev is not None:
                    walked = where.netdev.vlan_id
                vlan = max(walked or 0, 0)
                found = []
                if where.pnetid is not None:
                    found = self.inventory.rdma_ports_by_pnetid(where.pnetid, self.pnet)
                    found = [p for p in found if p.active]
            if self.transport.devices is not None:
                found = [p for p in found if p.device in self.transport.devices]
            ports = tuple(found)
            for a in netdev.addresses:
                if a.address == local and isinstance(local, ipaddress.IPv4Address):
                    prefixes = IpPrefixes(
                        ipaddress.IPv4Network(f"{a.address}/{a.prefixlen}", strict=False)
                    )
        return SmcrFacts(
            eids=self.eids,
            system_id=self.system_id,
            ports=ports,
            routing=self.routing,
            local_addr=local,
            vlan_id=vlan,
            ip_prefixes=prefixes,
            smcr_v1=self.smcr_v1,
            smcr_v2=self.smcr_v2,
            max_conns=self.max_conns,
            max_links=self.max_links,
            hostname=self.hostname,
            rmb_size=rmb_size or self.rmb_size,
            clc_wait=self.clc_wait,
        )

    def alt_ports_for(self, request: LinkGroupRequest) -> list[AltPort]:
        """Ports for a link group's second link (``smc_pnet_find_alt_roce``): active ports of
        *other* RoCE devices with the PNETID of the first link's netdev - with no PNETID on
        either side, any other device's port (an empty PNETID matches an empty one, as
        ``smc_pnet_match`` compares them) - that have a GID of the link group's kind (RoCE v1;
        for SMC-Rv2 an IPv4-mapped RoCE v2 GID) on a netdev with the link group's VLAN.

        Unlike the kernel, an SMC-Rv2 alternate GID need not share a subnet with the CLC
        source address: each link is addressed by its own GID (the peer learns it from ADD
        LINK), so two RoCE NICs on two different subnets make a symmetric link group."""
        if self.max_links < 2:
            return []
        first = request.local
        want = self.inventory.resolve_pnetid(first.netdev, self.pnet)
        v2 = request.version == 2
        out: list[AltPort] = []
        for dev in self.inventory.rdma_devices():
            if dev.name == first.device:
                continue  # the kernel skips the first link's device altogether
            if self.transport.devices is not None and dev.name not in self.transport.devices:
                continue
            for port in dev.ports:
                if not port.active or self._port_pnetid(port) != want:
                    continue
                found = self._alt_gid(port, request.vlan_id, v2)
                if found is not None:
                    out.append(found)
        return out

    def _port_pnetid(self, port: RdmaPort) -> str | None:
        pnetid = self.pnet.pnetid_of_ibport(port.device, port.num)
        if pnetid is None and port.netdev is not None:
            pnetid = self.inventory.resolve_pnetid(port.netdev, self.pnet)
        return pnetid

    def _alt_gid(self, port: RdmaPort, vlan_id: int, v2: bool) -> AltPort | None:
        for g in port.gids:
            if g.netdev is None:
                continue
            dev_vlan = self.routing.vlan_id(g.netdev)
            if (dev_vlan is not None) if vlan_id == 0 else dev_vlan != vlan_id:
                continue
            if v2 and (g.type != GidType.ROCE_V2 or g.ipv4 is None):
                continue
            if not v2 and g.type != GidType.ROCE_V1:
                continue
            return AltPort(port.device, port.num, g.gid, g.index, g.netdev)
        return None

    def _clc_vlan(self, netdev: str) -> int:
        """The VLAN id we offer for a CLC socket leaving through ``netdev``: the first VLAN
        device on the way down its stack (``smc_vlan_by_tcpsk``), each device's id as the
        routing facts know it; 0 for none (or a VLAN of unknown id, which matches nothing)."""
        vlan = self.inventory.clc_vlan_id(netdev, lambda d: self.routing.vlan_id(d.name))
        return max(vlan or 0, 0)

    def _netdev_for(self, local: IPAddr, peer: IPAddr) -> NetDeviceLike | None:
        """The CLC socket's netdev: the route's output device (as ``sk_dst_get(sk)->dev``),
        else the one holding the local address."""
        if isinstance(local, ipaddress.IPv4Address) and isinstance(peer, ipaddress.IPv4Address):
            route = self.routing.lookup_route(local, peer)
            if route is not None and route.oif is not None:
                dev = self.routing.netdev(route.oif)
                if dev is not None and dev.name != "lo":
                    return dev
        for dev in self.inventory.netdevs():
            if any(a.address == local for a in dev.addresses):
                return dev
        return None

    # ------------------------------------------------------------------ handshakes
    async def _where(
        self, netns: NetnsId | None, pid: int, local: IPAddr, peer: IPAddr
    ) -> NamespaceRoute | None:
        """The route of a connection handed over from another namespace than smcd's, asked in
        that namespace and matched against its own PNET entries; None for smcd's own."""
        if netns is None or not netns[0] or netns[0] == own_netns():
            return None
        table = self.pnet if isinstance(self.pnet, PnetTable) else PnetTable()
        where = await route_pnet(netns, pid, local, peer, table)
        if where.problem:
            log.info("SMC-R: namespace %s: %s", netns[1] or netns[0], where.problem)
        return where

    async def connect(
        self,
        tcp_fd: int,
        *,
        rmb_size: int = 0,
        uid: int = 0,
        pid: int = 0,
        netns: NetnsId | None = None,
    ) -> SmcrResult:
        """Client half: ``tcp_fd`` is our own copy of the application's connected socket (it is
        closed before returning). The caller decided that the peer speaks SMC. ``netns`` is
        the application's network namespace (its netdev and PNET entries are that one's)."""
        tcp = BorrowedTcp(tcp_fd)
        pending = _Pending(self._client_lock)
        try:
            local, peer = _ip(tcp.local), _ip(tcp.peer)
            where = await self._where(netns, pid, local, peer)
            neg = ClientSmcrNegotiation(self.facts_for(local, peer, rmb_size=rmb_size,
                                                       where=where),
                                        self.transport)  # fmt: skip
            # as smc_connect_rdma: the Proposal goes out and the Accept comes in unlocked
            outcome = await self._drive(neg, tcp, pending, neg.start())
            return self._finish(outcome, tcp, reg.ConnRole.CLIENT, uid, pid)
        finally:
            pending.release()
            tcp.close()

    async def accept(
        self,
        tcp_fd: int,
        *,
        rmb_size: int = 0,
        uid: int = 0,
        pid: int = 0,
        netns: NetnsId | None = None,
    ) -> SmcrResult:
        """Server half: a plain TCP client (no CLC Proposal within ``proposal_wait``) is handed
        back untouched with PEERNOSMC."""
        tcp = BorrowedTcp(tcp_fd)
        try:
            seen = await peek_proposal(tcp, self.proposal_wait)
            if seen.kind != "smc":
                return FallbackOutcome(
                    int(DeclineReason.PEERNOSMC), None, True,
                    f"no CLC Proposal from the client ({seen.kind})",
                )  # fmt: skip
            pending = _Pending(self._server_lock)
            try:
                local, peer = _ip(tcp.local), _ip(tcp.peer)
                where = await self._where(netns, pid, local, peer)
                neg = ServerSmcrNegotiation(self.facts_for(local, peer, rmb_size=rmb_size,
                                                           where=where),
                                            self.transport)  # fmt: skip
                outcome = await self._drive(neg, tcp, pending)
                return self._finish(outcome, tcp, reg.ConnRole.SERVER, uid, pid)
            finally:
                pending.release()
        finally:
            tcp.close()

    async def _drive(
        self, neg: Negotiation, tcp: BorrowedTcp, pending: _Pending, first: Step | None = None
    ) -> Outcome:
        """:func:`~.clc_io.drive` with the link layer (CONFIRM LINK for a first contact) and
        the role's link-group lock, taken before the peer's first message is acted on (the
        Proposal for a server, the Accept for a client) and held by the caller to the end."""
        return await drive(
            neg,
            tcp,
            first,
            link=self.transport,
            link_wait=self.confirm_link_wait,
            gate=pending.acquire,
        )

    def _finish(
        self,
        outcome: Outcome,
        tcp: BorrowedTcp,
        role: reg.ConnRole,
        uid: int,
        pid: int,
    ) -> SmcrResult:
        if isinstance(outcome, FallbackOutcome):
            return outcome
        if not isinstance(outcome, SmcrOutcome):
            return FallbackOutcome(int(DeclineReason.INTERR), None, True,
                                   f"unexpected outcome {type(outcome).__name__}")  # fmt: skip
        conn_id = self.registry.allocate_conn_id()
        local, peer = tcp.local, tcp.peer
        try:
            conn = self.transport.attach(outcome, conn_id)
        except SmcError as e:
            log.warning("SMC-R connection %s -> %s: %s", local, peer, e)
            self.transport.release_token(outcome.alert_token)
            return FallbackOutcome(int(getattr(e, "decline_reason", DeclineReason.INTERR)),
                                   None, True, f"daemon: {e}")  # fmt: skip
        with contextlib.suppress(SmcError):
            self.registry.add_connection(
                reg.Connection(
                    conn_id=conn_id,
                    role=role,
                    mode=reg.ConnMode.SMCR,
                    state=reg.ConnState.ACTIVE,
                    local_addr=str(local[0]),
                    local_port=int(local[1]),
                    peer_addr=str(peer[0]),
                    peer_port=int(peer[1]),
                    uid=uid,
                    pid=pid,
                    token=outcome.alert_token,
                    lgr_id=outcome.lgr_id,
                    link_id=conn.link_id,
                    sndbuf_size=conn.sndbuf.size,
                    rmbe_size=conn.rmb.size,
                    peer_rmbe_size=outcome.peer_rmbe_size,
                )
            )
        self.registry.stats.count_connection(reg.SmcType.SMCR, role, outcome.version)
        return SmcrChannel(conn_id, conn.take_app_fds(), outcome.lgr_id, conn.link_id,
                           outcome.first_contact)  # fmt: skip

    def _on_device(self, ev: DeviceEvent) -> None:
        """Carrier loss (or regain) of a netdev, seen over rtnetlink: its RoCE links fail
        over without waiting for the verbs port event or a QP error."""
        dev = ev.object
        if not isinstance(dev, NetDevice):
            return
        up = dev.is_up and ev.kind is not EventKind.REMOVED
        was = self._netdev_up.get(dev.name)
        self._netdev_up[dev.name] = up
        if was is not None and was != up:
            self.transport.netdev_state(dev.name, up)

    def close(self) -> None:
        self._unsubscribe()
        close = getattr(self.routing, "close", None)
        if callable(close):
            close()


def _ip(addr: Any) -> IPAddr:
    return ipaddress.ip_address(addr[0])


def _first_mac(inventory: DeviceInventory) -> bytes:
    for dev in inventory.netdevs():
        if dev.mac and dev.name != "lo":
            with contextlib.suppress(ValueError):
                mac = bytes.fromhex(dev.mac.replace(":", ""))
                if len(mac) == 6 and any(mac):
                    return mac
    return os.urandom(6)
