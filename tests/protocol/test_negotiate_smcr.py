"""SMC-R CLC negotiation, client against server through the real wire codec's bytes.

Each host is a real ``DeviceInventory`` snapshot (netdev, addresses, routes, neighbours, an rxe
port with a RoCE v1 and an IPv4-mapped RoCE v2 GID) read through ``InventoryRouting``, and its
link groups are real :class:`~smcd_daemon.protocol.linkgroup.LinkGroup` state machines: the
harness plays the transport (QP numbers, RMB rkeys) and, after a first contact, runs LLC
CONFIRM LINK between the two link groups with the QP facts the negotiation produced. The SMC-D
half of combined offers runs on a real loopback-ism device with memfd DMBs.
"""

from __future__ import annotations

import dataclasses
import errno
import ipaddress
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from smcd_daemon.core.buffers import DmbPool, compress_size
from smcd_daemon.core.devices import (
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
from smcd_daemon.core.eid import EidTable
from smcd_daemon.errors import SmcError
from smcd_daemon.protocol.linkgroup import (
    CreateQp,
    FirstContactDone,
    LinkGroup,
    LinkState,
    LocalPort,
    Output,
    Role,
    SendLlc,
)
from smcd_daemon.protocol.negotiate import (
    CLC_WAIT_TIME_SHORT,
    DECL_CLC_TIMEOUT,
    ClientSmcrNegotiation,
    FallbackOutcome,
    FirstLink,
    LinkGroupRequest,
    LinkGroupView,
    LinkView,
    NegotiationError,
    NegotiationFacts,
    ServerSmcrNegotiation,
    SmcdHalf,
    SmcdLoopbackOutcome,
    SmcrFacts,
    SmcrOutcome,
    SmcrStep,
    find_link_group,
)
from smcd_daemon.protocol.smcr_route import InventoryRouting
from smcd_daemon.transport.loopback import LoopbackIsm, LoopbackSession
from smcd_daemon.wire import clc
from smcd_daemon.wire.clc_base import SmcType
from smcd_daemon.wire.reasons import DeclineReason as R

IP = ipaddress.ip_address
NET = ipaddress.ip_network
KIB = 1024
UEID = "SMCR-TEST"

Negotiation = ClientSmcrNegotiation | ServerSmcrNegotiation


def v4gid(ip: str) -> bytes:
    return bytes(10) + b"\xff\xff" + IP(ip).packed


def v1gid(n: int) -> bytes:
    return bytes.fromhex("fe80000000000000020000fffe000000")[:15] + bytes((n,))


def mac_of(n: int) -> bytes:
    return bytes((2, 0, 0, 0, 0, n))


@dataclass(frozen=True)
class Rmb:
    rkey: int
    vaddr: int
    size: int
    size_comp: int
    alert_token: int


@dataclass
class Lgr:
    lg: LinkGroup
    version: int
    peer_system_id: bytes
    vlan_id: int
    local: dict[int, tuple[int, int, int, bytes, bytes]]  # link → qpn, psn, mtu, gid, mac
    peer: dict[int, tuple[int, bytes, bytes]] = field(default_factory=dict)  # qpn, gid, mac


class Host:
    """One smcd: its inventory, EIDs and the link group layer (SmcrResources)."""

    def __init__(
        self,
        n: int,
        addr: str,
        prefix: int = 24,
        *,
        routes: list[Route] | None = None,
        neighbours: list[Neighbour] | None = None,
        ueids: tuple[str, ...] = (UEID,),
    ) -> None:
        self.n = n
        self.addr = IP(addr)
        self.prefix = prefix
        self.mac = mac_of(n)
        inv = DeviceInventory(loopback_gid=bytes(16))
        up = dict(operstate=OperState.UP, carrier=True, admin_up=True)
        mac_text = ":".join(f"{b:02x}" for b in self.mac)
        inv.apply_link(NetDevice(2, "eth1", mac=mac_text, **up))  # type: ignore[arg-type]
        inv.apply_address(Address(2, self.addr, prefix))
        for r in routes or []:
            inv.apply_route(r)
        for nb in neighbours or []:
            inv.apply_neighbour(nb)
        gids = (
            Gid(0, v1gid(n), GidType.ROCE_V1, "eth1"),
            Gid(1, v4gid(addr), GidType.ROCE_V2, "eth1"),
        )
        self.port = RdmaPort("rxe0", 1, PortState.ACTIVE, 1024, gids=gids)
        inv.apply_rdma_device(RdmaDevice("rxe0", ports=(self.port,)))
        self.inv = inv
        self.routing = InventoryRouting(inv)
        self.eids = EidTable(ueids)
        self.system_id = bytes((0xAB, n)) + self.mac
        self.groups: dict[int, Lgr] = {}
        self.qps_created = 0
        self.clc_qps = 0  # QPs created for a CLC first contact (create_link_group)
        self.next_lgr = 0x100 * n
        self.next_token = 0x1000 * n
        self.rmbs: dict[int, Rmb] = {}
        self.outputs: list[Output] = []
        self.now = 0.0
        self.fail_create: SmcError | None = None
        self.conn_ids = 0

    def facts(self, **kw: object) -> SmcrFacts:
        base: dict[str, object] = dict(
            eids=self.eids,
            system_id=self.system_id,
            ports=(self.port,),
            routing=self.routing,
            local_addr=self.addr,
            ip_prefixes=clc.IpPrefixes(NET(f"{self.addr}/{self.prefix}", strict=False)),
            hostname=f"host{self.n}",
        )
        base.update(kw)
        return SmcrFacts(**base)  # type: ignore[arg-type]

    # ---- SmcrResources ----------------------------------------------------------------------
    def link_groups(self) -> list[LinkGroupView]:
        out = []
        for lgr_id, g in self.groups.items():
            links = []
            for info in g.lg.links():
                qpn, psn, mtu, gid, mac = g.local[info.link_id]
                pq, pg, pm = g.peer.get(info.link_id, (0, bytes(16), bytes(6)))
                links.append(
                    LinkView(
                        info.link_id,
                        qpn,
                        psn,
                        mtu,
                        gid,
                        mac,
                        pq,
                        pg,
                        pm,
                        active=info.state == LinkState.ACTIVE,
                    )
                )
            out.append(
                LinkGroupView(
                    lgr_id,
                    g.lg.role,
                    g.version,
                    g.peer_system_id,
                    g.vlan_id,
                    len(g.lg.connections()),
                    g.lg.max_conns,
                    tuple(links),
                )
            )
        return out

    def pick_link(self, lgr_id: int) -> int:
        return self.groups[lgr_id].lg.pick_link()

    def create_link_group(self, req: LinkGroupRequest) -> FirstLink:
        if self.fail_create is not None:
            raise self.fail_create
        self.next_lgr += 1
        port = LocalPort("rxe0:1", req.local.gid, req.local_mac, mtu=3)
        lg = LinkGroup(
            req.role,
            self.next_lgr,
            [port],
            v2=req.version == 2,
            release_v21=req.release >= 1,
            max_links=req.max_links,
            max_conns=req.max_conns,
        )
        outs = lg.start(self.now)
        (cq,) = [o for o in outs if isinstance(o, CreateQp)]
        self.qps_created += 1
        self.clc_qps += 1
        qpn, psn = 0x10000 * self.n + self.qps_created, 0x400 + self.qps_created
        lg.qp_created(cq.link_id, qpn, psn, self.now)
        g = Lgr(
            lg,
            req.version,
            req.peer_system_id,
            req.vlan_id,
            {cq.link_id: (qpn, psn, 3, req.local.gid, req.local_mac)},
        )
        self.groups[self.next_lgr] = g
        return FirstLink(self.next_lgr, cq.link_id, qpn, psn, 3)

    def discard_link_group(self, lgr_id: int) -> None:
        del self.groups[lgr_id]

    def allocate_rmb(self, lgr_id: int, link_id: int, size: int) -> Rmb:
        self.next_token += 1
        t = self.next_token
        rmb = Rmb(
            0xC0DE0000 | t, 0x7F0000000000 | t << 16, size, compress_size(size, max_comp=15), t
        )
        self.rmbs[t] = rmb
        return rmb

    def release_rmb(self, grant: Rmb) -> None:
        del self.rmbs[grant.alert_token]

    # ---- what the link group layer does with an outcome --------------------------------------
    def commit(self, o: SmcrOutcome) -> list[Output]:
        g = self.groups[o.lgr_id]
        outs: list[Output] = []
        if o.first_contact:
            g.peer[o.link_id] = (o.peer_qpn, o.peer_gid, o.peer_mac)
            outs = g.lg.first_contact_peer(o.peer_qp, self.now)
        self.conn_ids += 1
        g.lg.add_connection(
            self.conn_ids, o.peer_rmb_rkey, o.peer_rmb_vaddr, self.now, link_id=o.link_id
        )
        return outs


def confirm_links(c: Host, co: SmcrOutcome, s: Host, so: SmcrOutcome) -> None:
    """Hand the outcomes to the link groups and run LLC CONFIRM LINK between them."""
    wire: deque[tuple[Host, int, bytes]] = deque()

    def handle(h: Host, outs: list[Output]) -> None:
        for o in outs:
            h.outputs.append(o)
            if isinstance(o, SendLlc):
                wire.append((h, o.link_id, o.message.encode()))
            elif isinstance(o, CreateQp):  # a second link (ADD LINK): the transport's QP
                g = h.groups[co.lgr_id if h is c else so.lgr_id]
                h.qps_created += 1
                qpn, psn = 0x10000 * h.n + h.qps_created, 0x400 + h.qps_created
                g.local[o.link_id] = (qpn, psn, 3, o.port.gid, o.port.mac)
                handle(h, g.lg.qp_created(o.link_id, qpn, psn, h.now))

    handle(c, c.commit(co))
    handle(s, s.commit(so))
    n = 0
    while wire:
        src, link, data = wire.popleft()
        dst, lgr = (s, so.lgr_id) if src is c else (c, co.lgr_id)
        handle(dst, dst.groups[lgr].lg.receive(link, data, dst.now))
        n += 1
        assert n < 100


def feed(neg: Negotiation, data: bytes, *, chunk: int = 0) -> list[SmcrStep]:
    steps = []
    while data and not neg.done:
        want = neg.bytes_needed
        if want <= 0:
            break
        k = want if not chunk else min(chunk, want)
        steps.append(neg.receive_data(data[:k]))
        data = data[k:]
    return steps


def sent(steps: list[SmcrStep]) -> bytes:
    return b"".join(s.data for s in steps)


def handshake(
    c: ClientSmcrNegotiation, s: ServerSmcrNegotiation, *, chunk: int = 0
) -> tuple[bytes, bytes, bytes]:
    first = c.start().data
    accept = sent(feed(s, first, chunk=chunk))
    confirm = sent(feed(c, accept, chunk=chunk)) if not c.done else b""
    if confirm and not s.done:
        sent_back = sent(feed(s, confirm, chunk=chunk))
        if sent_back and not c.done:  # a Decline from the server after the Confirm
            feed(c, sent_back, chunk=chunk)
    return first, accept, confirm


def decline_of(data: bytes) -> clc.Decline:
    msg = clc.decode(data)
    assert isinstance(msg, clc.Decline)
    return msg


def pair(**kw: object) -> tuple[Host, Host]:
    """Client 192.0.2.3 and server 192.0.2.7 on one subnet, ARP resolved both ways."""
    c = Host(
        3,
        "192.0.2.3",
        routes=[Route(NET("192.0.2.0/24"), oif=2)],
        neighbours=[Neighbour(2, IP("192.0.2.7"), "02:00:00:00:00:07", NUD_REACHABLE)],
        **kw,
    )  # type: ignore[arg-type]
    s = Host(
        7,
        "192.0.2.7",
        routes=[Route(NET("192.0.2.0/24"), oif=2)],
        neighbours=[Neighbour(2, IP("192.0.2.3"), "02:00:00:00:00:03", NUD_REACHABLE)],
        **kw,
    )  # type: ignore[arg-type]
    return c, s


def run(
    c: Host,
    s: Host,
    *,
    cfacts: dict[str, object] | None = None,
    sfacts: dict[str, object] | None = None,
    chunk: int = 0,
) -> tuple[ClientSmcrNegotiation, ServerSmcrNegotiation, tuple[bytes, bytes, bytes]]:
    cn = ClientSmcrNegotiation(c.facts(**(cfacts or {})), c)
    sn = ServerSmcrNegotiation(s.facts(**(sfacts or {})), s)
    return cn, sn, handshake(cn, sn, chunk=chunk)


def outcomes(cn: Negotiation, sn: Negotiation) -> tuple[SmcrOutcome, SmcrOutcome]:
    co, so = cn.outcome, sn.outcome
    assert isinstance(co, SmcrOutcome), co
    assert isinstance(so, SmcrOutcome), so
    return co, so


def assert_crosswise(co: SmcrOutcome, so: SmcrOutcome, c: Host, s: Host) -> None:
    assert co.role == Role.CLIENT and so.role == Role.SERVER
    assert co.peer_qpn == s.groups[so.lgr_id].local[so.link_id][0]
    assert so.peer_qpn == c.groups[co.lgr_id].local[co.link_id][0]
    assert (co.peer_psn, so.peer_psn) == (
        s.groups[so.lgr_id].local[so.link_id][1],
        c.groups[co.lgr_id].local[co.link_id][1],
    )
    assert (co.peer_rmb_rkey, co.peer_rmb_vaddr) == (so.local_rkey, so.local_vaddr)
    assert (so.peer_rmb_rkey, so.peer_rmb_vaddr) == (co.local_rkey, co.local_vaddr)
    assert co.peer_alert_token == so.alert_token and so.peer_alert_token == co.alert_token
    assert co.peer_rmbe_size == so.local_rmbe_size == 64 * KIB
    assert so.peer_rmbe_size == co.local_rmbe_size
    assert co.peer_system_id == s.system_id and so.peer_system_id == c.system_id
    assert co.peer_mac == s.mac and so.peer_mac == c.mac
    assert co.peer_gid == so.local.gid.gid and so.peer_gid == co.local.gid.gid


# ---- first contact and reuse ----------


@pytest.mark.parametrize("chunk", [0, 1])
def test_v1_first_contact_llc_confirm_then_reuse_without_new_qp(chunk: int) -> None:
    c, s = pair()
    cn, sn, (first, accept, confirm) = run(
        c, s, cfacts=dict(smcr_v2=False), sfacts=dict(smcr_v2=False), chunk=chunk
    )
    prop = clc.decode(first)
    assert isinstance(prop, clc.Proposal)
    assert (prop.version, prop.typev1, prop.typev2) == (2, SmcType.R, SmcType.N)
    assert (prop.peer_id, prop.gid, prop.mac) == (c.system_id, v1gid(3), c.mac)
    assert prop.ip_prefixes == clc.IpPrefixes(NET("192.0.2.0/24"))
    assert len(accept) == len(confirm) == clc.SMCR_LEN_V1 == 68
    acc, conf = clc.decode(accept), clc.decode(confirm)
    assert isinstance(acc, clc.Accept) and acc.version == 1 and acc.first_contact
    assert isinstance(conf, clc.Confirm) and conf.first_contact
    co, so = outcomes(cn, sn)
    assert co.version == so.version == 1 and co.first_contact and so.first_contact
    assert co.confirm_link and so.confirm_link
    assert co.peer_gid == v1gid(7) and so.peer_gid == v1gid(3)
    assert co.qp_mtu == so.qp_mtu == 3
    assert co.negotiated_eid == "" and co.release == 0
    assert_crosswise(co, so, c, s)
    assert c.clc_qps == s.clc_qps == 1

    confirm_links(c, co, s, so)
    for h, o in ((c, co), (s, so)):
        assert any(isinstance(x, FirstContactDone) for x in h.outputs)
        assert h.groups[o.lgr_id].lg.links()[0].state == LinkState.ACTIVE

    # a second connection to the same peer reuses the link group: no QP anywhere
    cn2, sn2, (_, accept2, confirm2) = run(
        c, s, cfacts=dict(smcr_v2=False), sfacts=dict(smcr_v2=False), chunk=chunk
    )
    co2, so2 = outcomes(cn2, sn2)
    acc2 = clc.decode(accept2)
    assert isinstance(acc2, clc.Accept) and not acc2.first_contact
    assert isinstance(acc2.info, clc.SmcrInfo) and acc2.info.qpn == co.peer_qpn
    assert not (co2.first_contact or so2.first_contact or co2.confirm_link)
    assert (co2.lgr_id, so2.lgr_id) == (co.lgr_id, so.lgr_id)
    assert (co2.link_id, so2.link_id) == (co.link_id, so.link_id)
    assert co2.peer_alert_token != co.peer_alert_token  # a new RMB, a new token
    assert c.clc_qps == s.clc_qps == 1
    assert isinstance(clc.decode(confirm2), clc.Confirm)


@pytest.mark.parametrize("chunk", [0, 1])
def test_v2_first_contact_direct_v21_llc_confirm_then_reuse(chunk: int) -> None:
    c, s = pair()
    cn, sn, (first, accept, confirm) = run(
        c, s, cfacts=dict(smcr_v1=False, max_conns=40, max_links=1), chunk=chunk
    )
    prop = clc.decode(first)
    assert isinstance(prop, clc.Proposal) and prop.v2_ext is not None
    assert (prop.typev1, prop.typev2) == (SmcType.N, SmcType.R)
    assert prop.v2_ext.roce_gid == v4gid("192.0.2.3") and prop.v2_ext.eids == (UEID,)
    assert (prop.v2_ext.max_conns, prop.v2_ext.max_links, prop.v2_ext.release) == (40, 1, 1)
    assert prop.mac == c.mac and prop.peer_id == c.system_id
    acc = clc.decode(accept)
    assert isinstance(acc, clc.Accept) and acc.version == 2 and acc.fce is not None
    assert acc.fce.v2_direct and acc.fce.release == 1 and acc.fce.hostname == "host7"
    assert (acc.fce.max_conns, acc.fce.max_links) == (40, 1)  # min of both sides
    assert acc.eid == UEID
    conf = clc.decode(confirm)
    assert isinstance(conf, clc.Confirm) and conf.fce is not None
    assert (conf.fce.max_conns, conf.fce.max_links, conf.fce.release) == (40, 1, 1)
    assert conf.gid_list == (v4gid("192.0.2.3"),)
    co, so = outcomes(cn, sn)
    for o in (co, so):
        assert (o.version, o.release, o.max_conns, o.max_links) == (2, 1, 40, 1)
        assert o.v2_direct and o.negotiated_eid == UEID and o.first_contact
    assert co.nexthop_mac == s.mac and so.nexthop_mac == c.mac
    assert so.peer_gid_list == (v4gid("192.0.2.3"),)
    assert co.peer_hostname == "host7" and so.peer_hostname == "host3"
    assert co.peer_gid == v4gid("192.0.2.7") and so.peer_gid == v4gid("192.0.2.3")
    assert_crosswise(co, so, c, s)
    confirm_links(c, co, s, so)
    assert all(any(isinstance(x, FirstContactDone) for x in h.outputs) for h in (c, s))
    assert s.groups[so.lgr_id].lg.v2 and s.groups[so.lgr_id].lg.max_conns == 40

    cn2, sn2, (_, accept2, _) = run(c, s, cfacts=dict(smcr_v1=False), chunk=chunk)
    co2, so2 = outcomes(cn2, sn2)
    acc2 = clc.decode(accept2)
    assert isinstance(acc2, clc.Accept) and not acc2.first_contact and acc2.fce is None
    assert (co2.lgr_id, so2.lgr_id, co2.first_contact) == (co.lgr_id, so.lgr_id, False)
    assert c.clc_qps == s.clc_qps == 1


def test_max_conns_exhausted_makes_a_new_link_group() -> None:
    c, s = pair()
    first_pair: tuple[SmcrOutcome, SmcrOutcome] | None = None
    for i in range(16):
        cn, sn, _ = run(c, s, sfacts=dict(max_conns=16))
        co, so = outcomes(cn, sn)
        assert so.max_conns == 16 and so.first_contact == (i == 0)
        if i == 0:
            first_pair = (co, so)
            confirm_links(c, co, s, so)
        else:
            c.commit(co)
            s.commit(so)
    assert first_pair is not None
    assert len(s.groups[first_pair[1].lgr_id].lg.connections()) == 16
    cn, sn, (_, accept, _) = run(c, s, sfacts=dict(max_conns=16))
    co, so = outcomes(cn, sn)
    acc = clc.decode(accept)
    assert isinstance(acc, clc.Accept) and acc.first_contact
    assert co.first_contact and so.first_contact
    assert so.lgr_id != first_pair[1].lgr_id and co.lgr_id != first_pair[0].lgr_id
    assert c.clc_qps == s.clc_qps == 2 and len(s.groups) == 2


def test_find_link_group_rules() -> None:
    link = LinkView(1, 0x11, 1, 3, v1gid(1), mac_of(1), 0x22, v1gid(2), mac_of(2))
    g = LinkGroupView(5, Role.SERVER, 1, b"P" * 8, 0, 3, 255, (link,))
    kw: dict[str, object] = dict(
        role=Role.SERVER,
        version=1,
        peer_system_id=b"P" * 8,
        peer_gid=v1gid(2),
        peer_mac=mac_of(2),
        vlan_id=0,
    )
    assert find_link_group([g], **kw) == (g, link)  # type: ignore[arg-type]
    for change, group in [
        ("peer_system_id", dataclasses.replace(g, peer_system_id=b"Q" * 8)),
        ("role", dataclasses.replace(g, role=Role.CLIENT)),
        ("version", dataclasses.replace(g, version=2)),
        ("vlan", dataclasses.replace(g, vlan_id=100)),
        ("full", dataclasses.replace(g, conns=255)),
        ("rtokens", dataclasses.replace(g, rtokens_full=True)),
        ("sync_err", dataclasses.replace(g, sync_err=True)),
        ("inactive", dataclasses.replace(g, links=(dataclasses.replace(link, active=False),))),
        ("mac v1", dataclasses.replace(g, links=(dataclasses.replace(link, peer_mac=bytes(6)),))),
    ]:
        assert find_link_group([group], **kw) is None, change  # type: ignore[arg-type]
    v2 = dataclasses.replace(g, version=2, links=(dataclasses.replace(link, peer_mac=bytes(6)),))
    assert find_link_group([v2], **{**kw, "version": 2}) is not None  # type: ignore[arg-type]
    cl = dataclasses.replace(g, role=Role.CLIENT)
    ckw = {**kw, "role": Role.CLIENT}
    assert find_link_group([cl], **ckw, clc_qpn=0x22) is not None  # type: ignore[arg-type]
    assert find_link_group([cl], **ckw, clc_qpn=0x23) is None  # type: ignore[arg-type]
    full_client = dataclasses.replace(cl, conns=255)  # the client does not count
    assert find_link_group([full_client], **ckw, clc_qpn=0x22) is not None  # type: ignore[arg-type]


# ---- v2.1 limits ----------


def proposal_with(c: Host, **v2: int) -> bytes:
    cn = ClientSmcrNegotiation(c.facts(smcr_v1=False), c)
    prop = cn.start().send[0]
    assert isinstance(prop, clc.Proposal) and prop.v2_ext is not None
    return dataclasses.replace(prop, v2_ext=dataclasses.replace(prop.v2_ext, **v2)).encode()


@pytest.mark.parametrize(
    ("change", "code"),
    [(dict(max_conns=15), R.MAXCONNERR), (dict(max_links=0), R.MAXLINKERR)],
)
def test_server_declines_v21_limits_below_minimum(change: dict[str, int], code: R) -> None:
    c, s = pair()
    sn = ServerSmcrNegotiation(s.facts(), s)
    d = decline_of(sent(feed(sn, proposal_with(c, **change))))
    assert d.diagnosis == code and d.peer_id == s.system_id and d.version == 2
    assert isinstance(sn.outcome, FallbackOutcome) and sn.outcome.reason == code
    assert not s.groups and not s.rmbs


def test_server_takes_the_minimum_and_release_0_has_no_limits() -> None:
    c, s = pair()
    sn = ServerSmcrNegotiation(s.facts(max_conns=100, max_links=2), s)
    acc = clc.decode(sent(feed(sn, proposal_with(c, max_conns=200, max_links=1))))
    assert isinstance(acc, clc.Accept) and acc.fce is not None
    assert (acc.fce.max_conns, acc.fce.max_links) == (100, 1)
    c2, s2 = pair()
    sn2 = ServerSmcrNegotiation(s2.facts(), s2)
    acc0 = clc.decode(sent(feed(sn2, proposal_with(c2, release=0, max_conns=3))))
    assert isinstance(acc0, clc.Accept) and acc0.fce is not None  # v2.0: no limits checked
    assert (acc0.fce.release, acc0.fce.max_conns, acc0.fce.max_links) == (0, 0, 0)


def accept_for(c: Host, s: Host, **fce: object) -> tuple[ClientSmcrNegotiation, bytes]:
    cn = ClientSmcrNegotiation(c.facts(smcr_v1=False), c)
    sn = ServerSmcrNegotiation(s.facts(), s)
    acc = clc.decode(sent(feed(sn, cn.start().data)))
    assert isinstance(acc, clc.Accept) and acc.fce is not None
    return cn, dataclasses.replace(acc, fce=dataclasses.replace(acc.fce, **fce)).encode()


@pytest.mark.parametrize(
    ("change", "code"),
    [
        (dict(max_conns=15), R.MAXCONNERR),
        (dict(max_links=0), R.MAXLINKERR),
        (dict(max_links=3), R.MAXLINKERR),
        (dict(release=2), R.VERSMISMAT),
    ],
)
def test_client_checks_the_accepted_v21_values(change: dict[str, object], code: R) -> None:
    c, s = pair()
    cn, accept = accept_for(c, s, **change)
    d = decline_of(sent(feed(cn, accept)))
    assert d.diagnosis == code
    assert isinstance(cn.outcome, FallbackOutcome) and cn.outcome.reason == code
    assert not c.groups and not c.rmbs  # nothing created before the checks


@pytest.mark.parametrize(
    ("change", "code"),
    [
        (dict(release=0), R.RELEASEERR),
        (dict(max_conns=200), R.MAXCONNERR),
        (dict(max_links=1), R.MAXLINKERR),
    ],
)
def test_server_checks_the_confirm_echoes_what_it_accepted(
    change: dict[str, object], code: R
) -> None:
    c, s = pair()
    cn = ClientSmcrNegotiation(c.facts(smcr_v1=False), c)
    sn = ServerSmcrNegotiation(s.facts(), s)
    accept = sent(feed(sn, cn.start().data))
    conf = clc.decode(sent(feed(cn, accept)))
    assert isinstance(conf, clc.Confirm) and conf.fce is not None
    bad = dataclasses.replace(conf, fce=dataclasses.replace(conf.fce, **change))
    d = decline_of(sent(feed(sn, bad.encode())))
    assert d.diagnosis == code
    assert isinstance(sn.outcome, FallbackOutcome) and sn.outcome.reason == code
    assert not s.groups and not s.rmbs  # the new link group and the RMB are given back


# ---- the mailing-list routing cases  ----------

SLASH32 = (
    "interface eth1 (192.0.2.9/32) does not contain the connection's source 192.0.2.7; "
    "SMC-Rv2 needs the RoCE netdev's subnet to contain it"
)


def test_mailing_list_a_server_slash32_netdev_declines_nosmcrdev_on_the_proposal() -> None:
    """The server's RoCE netdev has 192.0.2.9/32 while its CLC socket's address is 192.0.2.7
    (on another interface): no RoCE port fits, SMC_CLC_DECL_NOSMCRDEV, explained."""
    c, _ = pair()
    s = Host(
        7,
        "192.0.2.9",
        32,
        routes=[Route(NET("192.0.2.0/24"), oif=2)],
        neighbours=[Neighbour(2, IP("192.0.2.3"), "02:00:00:00:00:03", NUD_REACHABLE)],
    )
    cn, sn, (_, reply, confirm) = run(
        c, s, cfacts=dict(smcr_v1=False), sfacts=dict(local_addr=IP("192.0.2.7"))
    )
    d = decline_of(reply)
    assert d.diagnosis == R.NOSMCRDEV == 0x03030002 and not confirm
    so, co = sn.outcome, cn.outcome
    assert isinstance(so, FallbackOutcome) and so.declined and so.reason == R.NOSMCRDEV
    assert SLASH32 in so.detail
    assert isinstance(co, FallbackOutcome)
    assert (co.reason, co.peer_diagnosis, co.local) == (R.PEERDECL, R.NOSMCRDEV, False)
    assert not s.groups and not c.groups


def test_mailing_list_a_client_slash32_netdev_offers_no_smcrv2() -> None:
    c = Host(3, "192.0.2.9", 32)
    cn = ClientSmcrNegotiation(c.facts(smcr_v1=False, local_addr=IP("192.0.2.3")), c)
    step = cn.start()
    d = decline_of(step.data)
    assert d.diagnosis == R.NOSMCDEV and d.version == 1  # no ISMv2 here: a v1 Decline
    assert isinstance(step.outcome, FallbackOutcome)
    assert SLASH32.replace("192.0.2.7", "192.0.2.3") in step.outcome.detail


NOINDIRECT = (
    "the server says its path to us uses a gateway, but our route from 192.0.2.3 to "
    "203.0.113.7 is direct; SMC-Rv2 needs both directions to agree (fix the asymmetric "
    "routes, e.g. the server's route back to this subnet)"
)


def test_mailing_list_b_asymmetric_routes_client_declines_noindirect_after_accept() -> None:
    """The server reaches us through gateway 203.0.113.1 and says 'indirect' in its Accept;
    our route to the server's GID is direct: SMC_CLC_DECL_NOINDIRECT from the client."""
    c = Host(
        3,
        "192.0.2.3",
        routes=[Route(NET("203.0.113.0/24"), oif=2)],
        neighbours=[Neighbour(2, IP("203.0.113.7"), "02:00:00:00:00:07", NUD_REACHABLE)],
    )
    s = Host(
        7,
        "203.0.113.7",
        routes=[
            Route(NET("203.0.113.0/24"), oif=2),
            Route(NET("192.0.2.0/24"), 2, IP("203.0.113.1")),
        ],
        neighbours=[Neighbour(2, IP("203.0.113.1"), "02:00:00:00:00:fe", NUD_REACHABLE)],
    )
    cn, sn, (_, accept, reply) = run(c, s, cfacts=dict(smcr_v1=False))
    acc = clc.decode(accept)
    assert isinstance(acc, clc.Accept) and acc.fce is not None and not acc.fce.v2_direct
    d = decline_of(reply)
    assert d.diagnosis == R.NOINDIRECT == 0x030F0000 and d.peer_id == c.system_id
    co, so = cn.outcome, sn.outcome
    assert isinstance(co, FallbackOutcome) and co.reason == R.NOINDIRECT
    assert NOINDIRECT in co.detail
    assert isinstance(so, FallbackOutcome) and so.peer_diagnosis == R.NOINDIRECT
    assert not s.groups and not s.rmbs and not c.groups  # the server gave its QP back


def test_noroute_when_the_client_has_no_route_to_an_indirect_server() -> None:
    c = Host(3, "192.0.2.3")
    s = Host(
        7,
        "203.0.113.7",
        routes=[Route(NET("192.0.2.0/24"), 2, IP("203.0.113.1"))],
        neighbours=[Neighbour(2, IP("203.0.113.1"), "02:00:00:00:00:fe", NUD_REACHABLE)],
    )
    cn, _, (_, _, reply) = run(c, s, cfacts=dict(smcr_v1=False))
    assert decline_of(reply).diagnosis == R.NOROUTE
    assert isinstance(cn.outcome, FallbackOutcome)
    assert "there is no route from 192.0.2.3 to 203.0.113.7" in cn.outcome.detail


def test_ueid_mismatch_stores_no_code_but_explains() -> None:
    c, s = pair()
    s.eids = EidTable(("OTHER-UEID",))
    _cn, sn, (_, reply, _) = run(c, s, cfacts=dict(smcr_v1=False))
    assert decline_of(reply).diagnosis == R.NOSMCDEV  # as the kernel: the v1 chain's code
    assert isinstance(sn.outcome, FallbackOutcome)
    assert "the peer's UEIDs and ours have none in common" in sn.outcome.detail
    c2, _s2 = pair()
    c2.eids = EidTable()
    cn2 = ClientSmcrNegotiation(c2.facts(smcr_v1=False), c2)
    out = cn2.start().outcome
    assert isinstance(out, FallbackOutcome) and out.reason == R.NOSMCDEV
    assert "no UEID is configured" in out.detail


def test_v2_falls_back_to_v1_when_the_v2_port_does_not_fit() -> None:
    c, s = pair()
    s.eids = EidTable(("OTHER-UEID",))
    cn, sn, (first, accept, _) = run(c, s)
    prop = clc.decode(first)
    assert isinstance(prop, clc.Proposal) and (prop.typev1, prop.typev2) == (SmcType.R, SmcType.R)
    acc = clc.decode(accept)
    assert isinstance(acc, clc.Accept) and acc.version == 1  # the v1 path, 68 bytes
    co, so = outcomes(cn, sn)
    assert co.version == so.version == 1
    c3, s3 = pair()
    _cn3, sn3, (_, reply, _) = run(c3, s3, sfacts=dict(smcr_v1=False, smcr_v2=False))
    assert decline_of(reply).diagnosis == R.NOSMCRDEV  # v2 stored first, then v1's NOSMCDEV
    assert isinstance(sn3.outcome, FallbackOutcome)
    assert "SMC-Rv2 is disabled here (modes.smcr_v2)" in sn3.outcome.detail
    assert "SMC-Rv1 is disabled here (modes.smcr_v1)" in sn3.outcome.detail


def test_prefix_mismatch_skips_v1() -> None:
    c, s = pair()
    _cn, sn, (_, reply, _) = run(c, s, cfacts=dict(smcr_v2=False), sfacts=dict(prefix_match=False))
    assert decline_of(reply).diagnosis == R.NOSMCDEV
    assert isinstance(sn.outcome, FallbackOutcome) and "IP subnet" in sn.outcome.detail


# ---- SYNCERR, resources, link failure ----------


def test_client_without_the_reused_link_group_declines_syncerr_out_of_sync() -> None:
    c, s = pair()
    cn, sn, _ = run(c, s)
    co, so = outcomes(cn, sn)
    confirm_links(c, co, s, so)
    c.groups.clear()  # the client lost its link group (e.g. a restart)
    cn2, sn2, (_, _, reply) = run(c, s)
    d = decline_of(reply)
    assert d.diagnosis == R.SYNCERR and d.out_of_sync
    assert isinstance(sn2.outcome, FallbackOutcome) and sn2.outcome.out_of_sync
    assert isinstance(cn2.outcome, FallbackOutcome) and cn2.outcome.reason == R.SYNCERR
    # the server terminates the link group the client no longer has (the kernel's
    # smc_lgr_terminate_sched), so the next connection is a first contact, not SYNCERR again
    assert not s.groups
    cn3, sn3, _ = run(c, s)
    co3, so3 = outcomes(cn3, sn3)
    assert so3.first_contact and co3.first_contact


def test_link_group_creation_failure_is_interr_or_the_resources_code() -> None:
    c, s = pair()
    s.fail_create = SmcError("no QP")
    _, sn, (_, reply, _) = run(c, s)
    assert decline_of(reply).diagnosis == R.INTERR
    assert isinstance(sn.outcome, FallbackOutcome) and "no QP" in sn.outcome.detail

    class NoMem(SmcError):
        decline_reason = R.MEM

    c2, s2 = pair()
    c2.fail_create = NoMem("out of memory")
    _cn2, sn2, (_, _, reply2) = run(c2, s2)
    assert decline_of(reply2).diagnosis == R.MEM
    assert not s2.groups and not s2.rmbs and isinstance(sn2.outcome, FallbackOutcome)


@pytest.mark.parametrize("peer_declines", [False, True])
def test_first_link_failure_declines_timeout_cl(peer_declines: bool) -> None:
    c, s = pair()
    cn, sn, _ = run(c, s)
    _co, _so = outcomes(cn, sn)
    with pytest.raises(NegotiationError):
        cn.abort()
    assert sn.link_failed("no CONFIRM LINK response from the client within 2 s") == SmcrStep()
    assert sn.timeout == CLC_WAIT_TIME_SHORT and sn.bytes_needed == 8 and not sn.done
    if peer_declines:
        assert cn.link_failed("no CONFIRM LINK request from the server within 5 s").send == ()
        step = cn.on_timeout()
        d = decline_of(step.data)
        assert d.diagnosis == R.TIMEOUT_CL
        out = sent(feed(sn, step.data))
        assert out == b""
        assert isinstance(sn.outcome, FallbackOutcome)
        assert (sn.outcome.reason, sn.outcome.peer_diagnosis) == (R.PEERDECL, R.TIMEOUT_CL)
    else:
        step = sn.on_timeout()
        assert decline_of(step.data).diagnosis == R.TIMEOUT_CL
        assert isinstance(step.outcome, FallbackOutcome)
        assert "the first link did not come up" in step.outcome.detail
    assert not s.groups and not s.rmbs
    with pytest.raises(NegotiationError):
        sn.link_failed("again")


def test_reuse_outcome_cannot_report_a_link_failure() -> None:
    c, s = pair()
    cn, sn, _ = run(c, s)
    co, so = outcomes(cn, sn)
    confirm_links(c, co, s, so)
    cn2, _, _ = run(c, s)
    with pytest.raises(NegotiationError):
        cn2.link_failed("x")


# ---- combined R + D offers ----------

CLIENT_EP = ("127.0.0.1", 41000)
SERVER_EP = ("127.0.0.1", 5000)


def smcd_half(dev: LoopbackIsm, eids: EidTable, *, server: bool, enabled: bool = True) -> SmcdHalf:
    facts = NegotiationFacts(
        eids=eids, loopback=dev.ism_device(), smcd_enabled=enabled, hostname="lo"
    )
    if server:
        return SmcdHalf(facts, LoopbackSession(dev, 1001, SERVER_EP, CLIENT_EP, server=True))
    dev.pairing.register_client(CLIENT_EP, SERVER_EP)
    return SmcdHalf(facts, dev.session(1000, CLIENT_EP, SERVER_EP, server=False))


def test_r_plus_d_chooses_loopback_when_it_fits() -> None:
    c, s = pair()
    dev = LoopbackIsm(DmbPool())
    cn, sn, (first, accept, confirm) = run(
        c,
        s,
        cfacts=dict(smcd=smcd_half(dev, c.eids, server=False)),
        sfacts=dict(smcd=smcd_half(dev, s.eids, server=True)),
    )
    prop = clc.decode(first)
    assert isinstance(prop, clc.Proposal)
    assert (prop.typev1, prop.typev2) == (SmcType.R, SmcType.B)
    assert prop.smcd_v2_ext is not None and prop.smcd_v2_ext.devices == (dev.ism_device(),)
    assert prop.v2_ext is not None and prop.v2_ext.roce_gid == v4gid("192.0.2.3")
    acc = clc.decode(accept)
    assert isinstance(acc, clc.Accept) and isinstance(acc.info, clc.SmcdInfo)
    assert isinstance(clc.decode(confirm), clc.Confirm)
    co, so = cn.outcome, sn.outcome
    assert isinstance(co, SmcdLoopbackOutcome) and isinstance(so, SmcdLoopbackOutcome)
    assert co.peer_token == so.local_token and so.peer_token == co.local_token
    assert sn.done and cn.done
    assert not c.groups and not s.groups and c.clc_qps == s.clc_qps == 0


@pytest.mark.parametrize("server_d", ["none", "disabled", "other-device"])
def test_r_plus_d_chooses_rdma_when_loopback_does_not_fit(server_d: str) -> None:
    c, s = pair()
    dev = LoopbackIsm(DmbPool())
    sfacts: dict[str, object] = {}
    if server_d == "disabled":
        sfacts["smcd"] = smcd_half(dev, s.eids, server=True, enabled=False)
    elif server_d == "other-device":  # another daemon's loopback-ism: no pairing, no match
        sfacts["smcd"] = smcd_half(LoopbackIsm(DmbPool()), s.eids, server=True)
    cn, sn, (_, accept, _) = run(
        c, s, cfacts=dict(smcd=smcd_half(dev, c.eids, server=False)), sfacts=sfacts
    )
    acc = clc.decode(accept)
    assert isinstance(acc, clc.Accept) and isinstance(acc.info, clc.SmcrInfo)
    co, so = outcomes(cn, sn)
    assert co.version == so.version == 2  # RDMA v2 comes before RDMA v1
    assert dev.pool.in_use_buffers == 0


def test_client_declines_modeunsupp_for_an_accept_it_did_not_offer() -> None:
    c, s = pair()
    cn = ClientSmcrNegotiation(c.facts(smcr_v1=False), c)
    sn = ServerSmcrNegotiation(s.facts(), s)
    acc = clc.decode(sent(feed(sn, cn.start().data)))
    assert isinstance(acc, clc.Accept)
    as_v1 = dataclasses.replace(acc, version=1, eid="", fce=None)
    assert decline_of(sent(feed(cn, as_v1.encode()))).diagnosis == R.MODEUNSUPP


# ---- driver contract, timeouts, EOF ----------


def test_driver_contract_errors_timeout_and_eof() -> None:
    c, s = pair()
    cn = ClientSmcrNegotiation(c.facts(), c)
    assert cn.bytes_needed == 0 and cn.timeout is None
    with pytest.raises(NegotiationError):
        cn.receive_data(b"x")
    cn.start()
    with pytest.raises(NegotiationError):
        cn.start()
    with pytest.raises(NegotiationError):
        cn.receive_data(bytes(9))
    step = cn.on_timeout()
    assert step.send == ()  # as the kernel: ETIMEDOUT fails the connection, no Decline
    assert isinstance(step.outcome, FallbackOutcome)
    assert step.outcome.reason == DECL_CLC_TIMEOUT and step.outcome.kernel_errno == errno.ETIMEDOUT
    with pytest.raises(NegotiationError):
        cn.on_eof()
    sn = ServerSmcrNegotiation(s.facts(), s)
    eof = sn.on_eof()
    assert eof.send == () and isinstance(eof.outcome, FallbackOutcome)
    assert eof.outcome.kernel_errno == errno.ECONNRESET
    sn2 = ServerSmcrNegotiation(s.facts(), s)
    ab = sn2.abort("the application went away")
    assert decline_of(ab.data).diagnosis == R.INTERR
    nope = ClientSmcrNegotiation(c.facts(peer_speaks_smc=False), c).start()
    assert nope.send == () and isinstance(nope.outcome, FallbackOutcome)
    assert nope.outcome.reason == R.PEERNOSMC
    with pytest.raises(NegotiationError):
        c.facts(max_conns=15)
    with pytest.raises(NegotiationError):
        c.facts(max_links=3)


# ---- hostile bytes ----------


def _state(*hosts: Host) -> list[tuple[set[int], set[int]]]:
    return [(set(h.groups), set(h.rmbs)) for h in hosts]


def _drive_to_end(
    neg: Negotiation, data: bytes, before: list[tuple[set[int], set[int]]], *hosts: Host
) -> None:
    """Feed hostile bytes (then EOF if it still waits): it must decide, and a fallback must
    give back every link group and RMB it took (``before``: the hosts' state before it)."""
    feed(neg, data)
    if not neg.done:
        neg.on_eof()
    assert neg.done
    out = neg.outcome
    assert isinstance(out, FallbackOutcome | SmcrOutcome)
    if isinstance(out, FallbackOutcome):
        assert _state(*hosts) == before
    else:  # the mutation still was a valid message: undo what the success took
        owner = next(h for h in hosts if out.alert_token in h.rmbs)
        owner.release_rmb(owner.rmbs[out.alert_token])
        if out.first_contact:
            owner.discard_link_group(out.lgr_id)
        assert _state(*hosts) == before


def _mutants(good: bytes, rng: random.Random, n: int) -> list[bytes]:
    out = [good[:k] for k in range(0, len(good), 5)]
    out += [bytes(rng.randrange(256) for _ in range(rng.randrange(1, 80))) for _ in range(20)]
    for _ in range(n):
        b = bytearray(good)
        for _ in range(rng.randrange(1, 4)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        out.append(bytes(b))
    return out


@pytest.mark.parametrize("version", [1, 2])
def test_hostile_bytes_at_every_step_end_in_a_decision(version: int) -> None:
    rng = random.Random(version)
    c, s = pair()
    only = dict(smcr_v2=False) if version == 1 else dict(smcr_v1=False)
    cn0 = ClientSmcrNegotiation(c.facts(**only), c)
    sn0 = ServerSmcrNegotiation(s.facts(), s)
    good_prop = cn0.start().data
    good_acc = sent(feed(sn0, good_prop))
    good_conf = sent(feed(cn0, good_acc))
    feed(sn0, good_conf)
    co, so = outcomes(cn0, sn0)
    confirm_links(c, co, s, so)  # an existing link group makes reuse paths reachable too

    def fresh_server() -> ServerSmcrNegotiation:
        return ServerSmcrNegotiation(s.facts(), s)

    def client_waiting() -> ClientSmcrNegotiation:
        cn = ClientSmcrNegotiation(c.facts(**only), c)
        cn.start()
        return cn

    def server_waiting_confirm() -> ServerSmcrNegotiation:
        sn = fresh_server()
        feed(sn, good_prop)
        return sn

    cases: list[tuple[Callable[[], Negotiation], bytes]] = [
        (fresh_server, good_prop),
        (client_waiting, good_acc),
        (server_waiting_confirm, good_conf),
    ]
    outcomes_seen: set[str] = set()
    for make, good in cases:
        for bad in _mutants(good, rng, 250):
            before = _state(c, s)
            neg = make()
            _drive_to_end(neg, bad, before, c, s)
            outcomes_seen.add(type(neg.outcome).__name__)
    assert outcomes_seen == {"FallbackOutcome", "SmcrOutcome"}


def test_hostile_bytes_one_at_a_time() -> None:
    rng = random.Random(3)
    c, s = pair()
    prop = ClientSmcrNegotiation(c.facts(), c).start().data
    for bad in _mutants(prop, rng, 40):
        sn = ServerSmcrNegotiation(s.facts(), s)
        before = _state(s)
        feed(sn, bad, chunk=1)
        if not sn.done:
            sn.on_eof()
        assert isinstance(sn.outcome, FallbackOutcome | SmcrOutcome)
        assert _state(s) == before or isinstance(sn.outcome, SmcrOutcome)
