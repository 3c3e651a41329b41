"""SMC-R in the daemon: link groups over RDMA verbs, their RMBs, and the connections on them.

:class:`SmcrTransport` joins three pieces that know nothing of each other:

* the **LLC link-group machine** (:mod:`smcd_daemon.protocol.linkgroup`, sans-IO): one per link
  group; its outputs (``CreateQp``, ``QpToRtr``, ``SendLlc``, ``MoveConnection``,
  ``AbortConnections``...) are carried out here, and what the verbs layer reports goes back in
  (LLC messages, link errors, port events, time);
* the **verbs transport** (:mod:`smcd_daemon.transport.verbs`): one :class:`VerbsPort` per RoCE
  port (context, PD, CQ, MR cache), one :class:`VerbsLink` (RC QP) per link;
* the **buffers** (:mod:`smcd_daemon.core.rmb`) and the **connections**
  (:mod:`.smcr_conn`), which relay between the application's channel and CDC messages.

It is also the :class:`~smcd_daemon.protocol.negotiate.SmcrResources` of the CLC
negotiator: link groups are found for reuse (``link_groups``), created for a first contact (the
first link's QP exists before the Accept/Confirm names it), and RMBs are handed out registered on
every link of their link group, with a unique RMBE alert token. A new RMB in an existing link
group is announced to the peer with CONFIRM RKEY; an RMB freed by a connection stays with its
link group (registered and confirmed, zeroed before reuse) until the link group goes, as the
kernel keeps ``lgr->rmbs``.

Sending: each link has 16 send slots (``SMC_WR_BUF_CNT``) shared by its LLC messages and the
CDC messages of all its connections. Connections with something due queue up per link and are
served as slots come back (``SendDone``), LLC first.

Two links: a link group gets every alternate port ``alt_ports`` names for it (other RoCE
devices of the same PNETID, see ``SmcrService.alt_ports_for``); with one, the server adds the
second link after the first contact (ADD LINK, ADD LINK CONT or the v2 rkey extension, CONFIRM
LINK on the new QP) and the link group is symmetric. A link fails on a verbs port event, carrier
loss seen over rtnetlink (:meth:`SmcrTransport.netdev_state`), a QP error or an unanswered TEST
LINK: its connections move to the surviving link (the send buffer is registered with the new
port, the producer cursor rewinds to the last completed CDC, the CDC failover validation goes
first), DELETE LINK tells the peer, and the QP is quiesced (ERR) and destroyed. With no link
left the connections abort. When the port comes back, a link is added again.

Link groups without connections are freed after ``linger`` seconds (DELETE LINK ALL, orderly).
A first contact's link group stays out of reuse until LLC CONFIRM LINK completed.

The link group machine's outputs are carried out by the handlers in :mod:`.smcr_outputs` (a
mixin of :class:`SmcrTransport`); the records they share are in :mod:`.smcr_lgr`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import secrets
import time
from collections import deque
from collections.abc import Callable, Collection, Iterable
from typing import Any

from smcd_daemon.core import registry as reg
from smcd_daemon.core.buffers import compress_size
from smcd_daemon.core.rmb import BufferKind, RmbPool, buffer_size_for
from smcd_daemon.errors import SmcError
from smcd_daemon.protocol.linkgroup import (
    LinkGroup,
    LinkGroupError,
    LinkState,
    LocalPort,
    Role,
)
from smcd_daemon.protocol.negotiate import (
    FirstLink,
    LinkGroupRequest,
    LinkGroupView,
    LinkView,
    SmcrOutcome,
)
from smcd_daemon.transport.smcr_conn import SmcrConnection
from smcd_daemon.transport.smcr_lgr import (
    AltPort,
    AltPortFinder,
    SmcrGrant,
    SmcrLgr,
    SmcrTransportError,
    port_name,
)
from smcd_daemon.transport.smcr_outputs import LlcOutputs
from smcd_daemon.transport.verbs import VerbsError, VerbsPort
from smcd_daemon.transport.verbs_model import (
    CompletionFailed,
    LinkError,
    MessageReceived,
    PortStateChanged,
    RemoteRing,
    SendDone,
    VerbsEvent,
    WriteDone,
)
from smcd_daemon.wire import cdc as wire_cdc
from smcd_daemon.wire.reasons import DeclineReason

__all__ = [
    "LGR_LINGER",
    "AltPort",
    "SmcrGrant",
    "SmcrTransport",
    "SmcrTransportError",
]

log = logging.getLogger(__name__)

#: Seconds an idle link group lives on (the kernel waits 10 minutes; tests configure less).
LGR_LINGER = 10.0
#: Slow safety sweep over every connection (lost kicks, see smcr_conn).
SWEEP_INTERVAL = 0.5


class SmcrTransport(LlcOutputs):
    """Link groups, RMBs and connections of SMC-R (see the module docstring).

    ``devices`` limits the RoCE devices used (None: any the negotiator chooses); ``registry``
    receives link group, link and connection records (a private one if None)."""

    def __init__(
        self,
        *,
        pool: RmbPool | None = None,
        registry: reg.Registry | None = None,
        devices: Collection[str] | None = None,
        linger: float = LGR_LINGER,
        testlink_time: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        alt_ports: AltPortFinder | None = None,
    ) -> None:
        #: second-link candidates per link group; None: every link group has one link
        self.alt_ports = alt_ports
        self.pool = pool if pool is not None else RmbPool()
        self.registry = registry if registry is not None else reg.Registry()
        self.devices = None if devices is None else frozenset(devices)
        self.linger = linger
        self.testlink_time = testlink_time
        self._clock = clock
        self._ports: dict[str, VerbsPort] = {}
        self._lgrs: dict[int, SmcrLgr] = {}
        self._by_qp: dict[tuple[str, int], tuple[SmcrLgr, int]] = {}
        self._by_token: dict[int, SmcrConnection] = {}
        self._tokens: set[int] = set()
        self._grants: dict[int, SmcrGrant] = {}
        #: CDCs that arrived for a granted token before its connection was attached
        self._early: dict[int, list[wire_cdc.CdcMessage]] = {}
        self._token_seq = itertools.count(secrets.randbits(20) + 1)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sweep: asyncio.TimerHandle | None = None
        self._closed = False

    # ------------------------------------------------------------------ ports
    def _now(self) -> float:
        return self._clock()

    def _loop_now(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            self._sweep = self._loop.call_later(SWEEP_INTERVAL, self._on_sweep)
        return self._loop

    def port(self, device: str, num: int) -> VerbsPort:
        """The open verbs port ``device:num`` (opened and started on first use)."""
        name = f"{device}:{num}"
        vp = self._ports.get(name)
        if vp is None:
            if self.devices is not None and device not in self.devices:
                raise SmcrTransportError(
                    f"RDMA device {device} is not one this smcd uses ({', '.join(self.devices)})",
                    DeclineReason.NOSMCRDEV,
                )
            vp = VerbsPort(device, num)
            vp.start(self._on_event)
            self._ports[name] = vp
            self._loop_now()
        return vp

    def verbs_ports(self) -> tuple[VerbsPort, ...]:
        return tuple(self._ports.values())

    # ------------------------------------------------------------------ SmcrResources
    def link_groups(self) -> Iterable[LinkGroupView]:
        out = []
        for g in self._lgrs.values():
            if g.gone or g.fsm.terminated or not g.confirmed:
                continue
            links = []
            for info in g.fsm.links():
                vl = g.links.get(info.link_id)
                if vl is None or info.peer_qpn is None:
                    continue
                links.append(
                    LinkView(
                        link_id=info.link_id,
                        qpn=vl.qpn,
                        psn=vl.psn,
                        mtu=info.mtu or vl.mtu,
                        gid=info.gid,
                        mac=vl.mac,
                        peer_qpn=info.peer_qpn,
                        peer_gid=info.peer_gid or bytes(16),
                        peer_mac=g.peer_macs.get(info.link_id, bytes(6)),
                        active=info.state == LinkState.ACTIVE,
                    )
                )
            out.append(
                LinkGroupView(
                    lgr_id=g.lgr_id,
                    role=g.role,
                    version=g.version,
                    peer_system_id=g.peer_system_id,
                    vlan_id=g.vlan_id,
                    conns=len(g.fsm.connections()),
                    max_conns=g.fsm.max_conns,
                    links=tuple(links),
                    rtokens_full=g.fsm.peer_rkey_count() >= 255,
                )
            )
        return out

    def pick_link(self, lgr_id: int) -> int:
        return self._lgr(lgr_id).fsm.pick_link()

    def create_link_group(self, request: LinkGroupRequest) -> FirstLink:
        """First contact: a link group and its first link's QP (in INIT, receives posted)."""
        loop = self._loop_now()
        local = request.local
        try:
            vp = self.port(local.device, local.port)
            mtu = vp.active_mtu
        except SmcrTransportError:
            raise
        except SmcError as e:
            raise SmcrTransportError(f"RoCE port {local.device}:{local.port}: {e}") from e
        name = f"{local.device}:{local.port}"
        ports = {name: vp}
        gid_index = {name: local.gid_index}
        local_ports = [LocalPort(name, local.gid, request.local_mac, mtu=mtu)]
        netdevs = {name: local.netdev}
        for lp, avp, ap in self._alternates(request, name):
            ports[lp.name] = avp
            gid_index[lp.name] = ap.gid_index
            netdevs[lp.name] = ap.netdev
            local_ports.append(lp)
        lgr_id = self.registry.allocate_lgr_id()
        # A second link needs a second local port (symmetric link group): a second link on the
        # same port would be an asymmetric one, costing a QP that a single-port peer rejects.
        max_links = 2 if len(local_ports) > 1 and request.max_links >= 2 else 1
        fsm = LinkGroup(
            request.role,
            lgr_id,
            local_ports,
            v2=request.version == 2,
            release_v21=request.release >= 1,
            max_links=max_links,
            max_conns=request.max_conns,
            testlink_time=self.testlink_time,
        )
        g = SmcrLgr(
            fsm=fsm,
            lgr_id=lgr_id,
            version=request.version,
            role=request.role,
            peer_system_id=request.peer_system_id,
            vlan_id=request.vlan_id,
            uses_gateway=request.uses_gateway,
            ports=ports,
            gid_index=gid_index,
            netdevs=netdevs,
            first=loop.create_future(),
        )
        self._lgrs[lgr_id] = g
        self.registry.add_link_group(
            reg.LinkGroup(
                lgr_id=lgr_id,
                role=reg.LgrRole.SERV if request.role == Role.SERVER else reg.LgrRole.CLNT,
                smc_type=reg.SmcType.SMCR,
                local_gid=local.gid,
                peer_gid=request.peer_gid,
                peer_system_id=request.peer_system_id,
                vlan_id=request.vlan_id,
                netdev=local.netdev,
                max_conns=request.max_conns,
                max_links=max_links,
                smc_version=request.version,
                smc_release=request.release,
                direct=not request.uses_gateway,
            )
        )
        self._apply(g, fsm.start(self._now(), name))
        infos = fsm.links()
        if len(infos) != 1 or infos[0].link_id not in g.links:
            self.discard_link_group(lgr_id)
            raise SmcrTransportError("the first link's QP could not be created")
        vl = g.links[infos[0].link_id]
        return FirstLink(lgr_id, infos[0].link_id, vl.qpn, vl.psn, vl.mtu)

    def _alternates(
        self, request: LinkGroupRequest, first: str
    ) -> list[tuple[LocalPort, VerbsPort, AltPort]]:
        """The other local ports a second link may use, opened (as ``LocalPort``s)."""
        if self.alt_ports is None or request.max_links < 2:
            return []
        out: list[tuple[LocalPort, VerbsPort, AltPort]] = []
        for ap in self.alt_ports(request):
            name = f"{ap.device}:{ap.port}"
            if name == first or any(lp.name == name for lp, _, _ in out):
                continue
            try:
                avp = self.port(ap.device, ap.port)
                lp = LocalPort(name, ap.gid, avp.mac(ap.gid_index), mtu=avp.active_mtu,
                               active=avp.active)  # fmt: skip
            except SmcError as e:
                log.info("SMC-R: alternate port %s not usable: %s", name, e)
                continue
            out.append((lp, avp, ap))
        return out

    def discard_link_group(self, lgr_id: int) -> None:
        g = self._lgrs.get(lgr_id)
        if g is None:
            return
        if not g.fsm.terminated:
            self._apply(g, g.fsm.terminate(self._now(), explanation="CLC handshake failed"))
        self._teardown(g)

    def allocate_rmb(self, lgr_id: int, link_id: int, size: int) -> SmcrGrant:
        g = self._lgr(lgr_id)
        bufsize = buffer_size_for(max(size, 1))
        rmb_id = next((i for i in g.free_rmbs if g.rmbs[i].size == bufsize), None)
        if rmb_id is not None:
            g.free_rmbs.remove(rmb_id)
            buf = g.rmbs[rmb_id]
            buf.zero()
            buf.generation += 1
        else:
            buf = self.pool.acquire(BufferKind.RMB, bufsize)
            g.next_rmb += 1
            rmb_id = g.next_rmb
            g.rmbs[rmb_id] = buf
            rkeys: dict[int, tuple[int, int]] = {}
            try:
                for lid, vl in g.links.items():
                    pname = port_name(vl)
                    region = self.pool.register(buf, pname, vl.port.mrs)
                    rkeys[lid] = (region.rkey, region.addr)
            except SmcError as e:
                del g.rmbs[rmb_id]
                self.pool.release(buf)
                raise SmcrTransportError(f"registering an RMB: {e}", DeclineReason.MEM) from e
            announce = g.confirmed
            self._apply(g, g.fsm.add_rmb(rmb_id, rkeys, self._now(), announce=announce))
        link = g.links.get(link_id)
        if link is None:
            raise SmcrTransportError(f"link {link_id} of link group {lgr_id:#x} is gone",
                                     DeclineReason.NOACTLINK)  # fmt: skip
        region = buf.region(port_name(link))
        token = self._new_token()
        self.registry.update_link_group(lgr_id, rmb_alloc=sum(b.size for b in g.rmbs.values()))
        grant = SmcrGrant(
            rkey=region.rkey,
            vaddr=region.addr,
            size=bufsize,
            size_comp=compress_size(bufsize, max_comp=15),
            alert_token=token,
            lgr_id=lgr_id,
            rmb_id=rmb_id,
        )
        self._grants[token] = grant
        return grant

    def release_rmb(self, grant: Any) -> None:
        self._tokens.discard(grant.alert_token)
        self._grants.pop(grant.alert_token, None)
        self._early.pop(grant.alert_token, None)
        g = self._lgrs.get(grant.lgr_id)
        usable = g is not None and not g.gone and grant.rmb_id in g.rmbs
        if usable and g is not None and grant.rmb_id not in g.free_rmbs:
            g.free_rmbs.append(grant.rmb_id)

    def release_token(self, token: int) -> None:
        """Give back the RMB granted under alert token ``token`` (a handshake that succeeded
        but could not become a connection)."""
        grant = self._grants.get(token)
        if grant is not None:
            self.release_rmb(grant)

    def _new_token(self) -> int:
        while True:
            t = next(self._token_seq) & 0xFFFFFFFF
            if t and t not in self._tokens:
                self._tokens.add(t)
                return t

    # ------------------------------------------------------------------ after the handshake
    def begin_first_link(self, outcome: SmcrOutcome) -> None:
        """A first contact's CLC outcome: the peer's QP is known. The client's QP goes to RTR
        now (before its Confirm leaves, as ``smc_connect_rdma`` readies the link first); the
        server's goes to RTS and sends LLC CONFIRM LINK. The peer's RMB is known from here on:
        a second link's rkeys for it may come before :meth:`attach`."""
        g = self._lgr(outcome.lgr_id)
        g.peer_macs[outcome.link_id] = outcome.peer_mac
        peer_rmb = (outcome.peer_rmb_rkey, outcome.peer_rmb_vaddr)
        self._apply(g, g.fsm.first_contact_peer(outcome.peer_qp, self._now(), peer_rmb))

    async def wait_first_link(self, outcome: SmcrOutcome, timeout: float = 15.0) -> str | None:
        """Wait for LLC CONFIRM LINK of a first contact. None when the link is up, else the
        reason (for ``link_failed`` on the negotiation)."""
        g = self._lgrs.get(outcome.lgr_id)
        if g is None:
            return "the link group ended"
        if g.first is None:
            return None if g.confirmed else "the link group ended"
        try:
            return await asyncio.wait_for(asyncio.shield(g.first), timeout)
        except TimeoutError:
            return f"LLC CONFIRM LINK did not complete within {timeout:g} s"

    def attach(self, outcome: SmcrOutcome, conn_id: int) -> SmcrConnection:
        """Create the connection of a successful handshake (link up) and start relaying."""
        loop = self._loop_now()
        g = self._lgr(outcome.lgr_id)
        grant = self._grants.get(outcome.alert_token)
        if grant is None or grant.lgr_id != g.lgr_id:
            raise SmcrTransportError("the RMB of this handshake is gone")
        if g.fsm.terminated or g.gone:
            raise SmcrTransportError("the link group ended", DeclineReason.NOACTLINK)
        try:
            link_id = g.fsm.add_connection(
                conn_id, outcome.peer_rmb_rkey, outcome.peer_rmb_vaddr, self._now(),
                link_id=outcome.link_id,
            )  # fmt: skip
        except LinkGroupError as e:
            raise SmcrTransportError(str(e), DeclineReason.NOACTLINK) from e
        if g.free_timer is not None:
            g.free_timer.cancel()
            g.free_timer = None
        vl = g.links[link_id]
        rmb = g.rmbs[grant.rmb_id]
        peer_ring_len = outcome.peer_rmbe_size  # the whole RMBE is ring (the kernel's layout)
        snd_size = buffer_size_for(peer_ring_len)
        if snd_size != peer_ring_len:
            g.fsm.remove_connection(conn_id)
            raise SmcrTransportError(
                f"the peer's RMB of {outcome.peer_rmbe_size} bytes is not a size smcd can "
                "mirror as a send buffer (16 KiB << n, n <= 6)",
                DeclineReason.INTERR,
            )
        sndbuf = self.pool.acquire(BufferKind.SNDBUF, snd_size)
        region = self.pool.register(sndbuf, port_name(vl), vl.port.mrs)
        conn = SmcrConnection(
            conn_id=conn_id,
            lgr_id=g.lgr_id,
            link_id=link_id,
            token=grant.alert_token,
            peer_token=outcome.peer_alert_token,
            rmb=rmb,
            rmb_id=grant.rmb_id,
            sndbuf=sndbuf,
            snd_region=region,
            peer_ring=RemoteRing(outcome.peer_rmb_vaddr, outcome.peer_rmb_rkey, peer_ring_len),
            want_send=self._want_send,
            finished=self._finished,
        )
        g.conns[conn_id] = conn
        self._by_token[grant.alert_token] = conn
        self.registry.update_link_group(
            g.lgr_id, sndbuf_alloc=sum(c.sndbuf.size for c in g.conns.values())
        )
        conn.start(loop)
        for msg in self._early.pop(grant.alert_token, []):
            conn.on_cdc(msg)
        return conn

    def connection(self, conn_id: int) -> SmcrConnection | None:
        for g in self._lgrs.values():
            c = g.conns.get(conn_id)
            if c is not None:
                return c
        return None

    # ------------------------------------------------------------------ sending
    def _want_send(self, conn: SmcrConnection) -> None:
        g = self._lgrs.get(conn.lgr_id)
        if g is None or conn.done:
            return
        if not conn.queued:
            conn.queued = True
            g.send_q.setdefault(conn.link_id, deque()).append(conn)
        self._pump(g, conn.link_id)

    def _send_llc(self, g: SmcrLgr, link_id: int, data: bytes) -> None:
        g.llc_q.setdefault(link_id, deque()).append(data)
        self._pump(g, link_id)

    def _pump(self, g: SmcrLgr, link_id: int) -> None:
        vl = g.links.get(link_id)
        if vl is None or vl.error is not None:
            return
        llc_q = g.llc_q.get(link_id)
        send_q = g.send_q.get(link_id)
        try:
            while llc_q and vl.free_send_slots:
                vl.send(llc_q[0], tag=("llc", g.lgr_id))
                llc_q.popleft()
            while send_q and vl.free_send_slots:
                conn = send_q[0]
                if conn.done or conn.link_id != link_id:
                    send_q.popleft()
                    conn.queued = False
                    if not conn.done:
                        self._want_send(conn)
                    continue
                if not conn.transmit(vl):
                    send_q.popleft()
                    conn.queued = False
        except VerbsError as e:
            log.warning("SMC-R link group %#x link %d: posting failed: %s", g.lgr_id, link_id, e)

    def netdev_state(self, netdev: str, up: bool) -> None:
        """The netdev under RoCE ports went down or up (carrier or admin state, seen over
        rtnetlink): the same as a verbs port event for the link groups' ports on it - some
        devices report the port late, or not at all. Up counts only once the port is active."""
        for g in list(self._lgrs.values()):
            if g.gone or g.fsm.terminated:
                continue
            for name, nd in list(g.netdevs.items()):
                vp = g.ports.get(name)
                if nd != netdev or vp is None:
                    continue
                active = up
                if up:
                    try:
                        active = vp.active
                    except Exception:  # a closed or vanished device
                        active = False
                    if not active:
                        continue
                log.info("SMC-R link group %#x: %s (%s) %s", g.lgr_id, netdev, name,
                         "up" if active else "down")  # fmt: skip
                self._apply(g, g.fsm.port_state(name, active, self._now()))

    # ------------------------------------------------------------------ verbs events
    def _on_event(self, ev: VerbsEvent) -> None:
        if isinstance(ev, PortStateChanged):
            name = f"{ev.device}:{ev.port}"
            for g in list(self._lgrs.values()):
                if name in g.ports and not g.gone:
                    self._apply(g, g.fsm.port_state(name, ev.active, self._now()))
            return
        found = self._by_qp.get((ev.device, ev.qpn))
        if found is None:
            return
        g, link_id = found
        now = self._now()
        if isinstance(ev, MessageReceived):
            g.fsm.note_rx(link_id, now)
            if ev.data[:1] == b"\xfe":
                self._on_cdc(g, ev.data)
            else:
                self._apply(g, g.fsm.receive(link_id, ev.data, now))
        elif isinstance(ev, SendDone):
            tag = ev.tag
            if isinstance(tag, tuple) and tag and tag[0] == "cdc":
                conn = g.conns.get(tag[1])
                # a late completion of the link a connection failed over from says nothing
                # about what the new link delivered
                if conn is not None and conn.link_id == link_id:
                    conn.send_done(tag[2])
            self._pump(g, link_id)
            for other in list(g.send_q):
                if other != link_id:
                    self._pump(g, other)
        elif isinstance(ev, LinkError):
            vl = g.links.get(link_id)
            if vl is None or (vl.port.device, vl.qpn) != (ev.device, ev.qpn):  # cleared already
                log.debug("SMC-R link group %#x: old QP %d: %s", g.lgr_id, ev.qpn, ev.reason)
                return
            log.warning("SMC-R link group %#x link %d down: %s", g.lgr_id, link_id, ev.reason)
            self._apply(g, g.fsm.link_down(link_id, now, ev.reason))
        elif isinstance(ev, CompletionFailed | WriteDone):
            pass  # LinkError follows a failure; writes are covered by the CDC after them

    def _on_cdc(self, g: SmcrLgr, data: bytes) -> None:
        try:
            msg = wire_cdc.decode(data)
        except SmcError as e:
            log.info("SMC-R link group %#x: undecodable CDC dropped: %s", g.lgr_id, e)
            return
        conn = self._by_token.get(msg.token)
        grant = self._grants.get(msg.token)
        if conn is None and grant is not None and grant.lgr_id == g.lgr_id:
            # the peer's side finished its handshake first and already sends: keep it
            early = self._early.setdefault(msg.token, [])
            if len(early) < 64:
                early.append(msg)
            return
        if conn is None or conn.lgr_id != g.lgr_id:
            log.debug("SMC-R link group %#x: CDC for unknown token %#x", g.lgr_id, msg.token)
            return
        conn.on_cdc(msg)

    # ------------------------------------------------------------------ time

    def _on_sweep(self) -> None:
        self._sweep = None
        if self._closed or self._loop is None:
            return
        for g in list(self._lgrs.values()):
            for conn in list(g.conns.values()):
                conn.scan()
        self._sweep = self._loop.call_later(SWEEP_INTERVAL, self._on_sweep)

    # ------------------------------------------------------------------ connection end
    def _finished(self, conn: SmcrConnection) -> None:
        self._by_token.pop(conn.token, None)
        self._grants.pop(conn.token, None)
        self._early.pop(conn.token, None)
        self._tokens.discard(conn.token)
        self.pool.release(conn.sndbuf)
        with contextlib.suppress(SmcError):
            self.registry.remove_connection(conn.conn_id)
        g = self._lgrs.get(conn.lgr_id)
        if g is None:
            self.pool.release(conn.rmb)
            return
        g.conns.pop(conn.conn_id, None)
        g.fsm.remove_connection(conn.conn_id)
        if not g.gone and conn.rmb_id in g.rmbs:
            g.free_rmbs.append(conn.rmb_id)
        else:
            self.pool.release(conn.rmb)
        if not g.conns and not g.gone and self._loop is not None:
            if g.free_timer is not None:
                g.free_timer.cancel()
            g.free_timer = self._loop.call_later(self.linger, self._free_idle, g)

    def _free_idle(self, g: SmcrLgr) -> None:
        g.free_timer = None
        if g.conns or g.gone:
            return
        if g.fsm.connections():
            return
        log.info("SMC-R link group %#x idle for %g s: freeing", g.lgr_id, self.linger)
        self._apply(g, g.fsm.free(self._now()))
        self._teardown(g)

    def _teardown(self, g: SmcrLgr) -> None:
        if g.gone:
            return
        g.gone = True
        if g.timer is not None:
            g.timer.cancel()
        if g.free_timer is not None:
            g.free_timer.cancel()
        for conn in list(g.conns.values()):
            conn.lost("the link group ended")
        for lid in list(g.links):
            self._destroy_later(g.links.pop(lid))
        for rmb_id, buf in g.rmbs.items():
            if rmb_id in g.free_rmbs or not any(c.rmb is buf for c in g.conns.values()):
                self.pool.release(buf)
        self._first_done(g, None, "the link group ended")
        self._lgrs.pop(g.lgr_id, None)
        with contextlib.suppress(SmcError):
            self.registry.remove_link_group(g.lgr_id)

    # ------------------------------------------------------------------ helpers
    def _lgr(self, lgr_id: int) -> SmcrLgr:
        g = self._lgrs.get(lgr_id)
        if g is None:
            raise SmcrTransportError(f"no link group {lgr_id:#x}", DeclineReason.NOACTLINK)
        return g

    def lgr_stats(self) -> list[dict[str, Any]]:
        """A snapshot per link group (tests and tools): QPs, connections, RMB reuse."""
        return [
            {
                "lgr_id": g.lgr_id,
                "role": g.role.value,
                "type": g.fsm.type.value,
                "links": {lid: vl.qpn for lid, vl in g.links.items()},
                "conns": len(g.conns),
                "rmbs": len(g.rmbs),
                "free_rmbs": len(g.free_rmbs),
            }
            for g in self._lgrs.values()
        ]

    def close(self) -> None:
        """Tear everything down (daemon stop): connections abort, QPs and ports close."""
        if self._closed:
            return
        conns = [c for g in self._lgrs.values() for c in g.conns.values()]
        for g in list(self._lgrs.values()):
            if not g.fsm.terminated:
                with contextlib.suppress(Exception):
                    self._apply(g, g.fsm.terminate(self._now()))
            self._teardown(g)
        for conn in conns:  # as a dying daemon: the applications' peer links hang up
            conn.close()
        self._closed = True
        if self._sweep is not None:
            self._sweep.cancel()
        for name, vp in self._ports.items():
            self.pool.forget_registrar(name)
            vp.close()
        self._ports.clear()
        self.pool.close()
