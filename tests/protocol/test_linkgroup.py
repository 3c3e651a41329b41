"""A server and a client LinkGroup driven against each other.

Every LLC message one side sends is encoded to bytes with the real wire codec and decoded by
the other side's :meth:`LinkGroup.receive`; the harness plays the transport (it answers
CreateQp with a QP number and the RMBs' rkeys on the new link) and the network (a link can
lose its messages). Time only moves when a test says so.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import pytest

from smcd_daemon.protocol.linkgroup import (
    AbortConnections,
    AddLinkResult,
    CreateQp,
    DestroyQp,
    FirstContactDone,
    FirstContactFailed,
    LgrType,
    LinkGroup,
    LinkGroupError,
    LinkGroupTerminated,
    LinkState,
    LlcIgnored,
    LocalPort,
    MoveConnection,
    Output,
    PeerQp,
    QpToRtr,
    QpToRts,
    RmbConfirmed,
    RmbDeleted,
    Role,
    SendLlc,
)
from smcd_daemon.wire import llc
from smcd_daemon.wire.llc import (
    AddLink,
    AddLinkFlag,
    AddLinkRejectReason,
    ConfirmLink,
    DeleteLink,
    DeleteLinkFlag,
    DeleteLinkReason,
    LlcMessage,
    TestLink,
)
from smcd_daemon.wire.reasons import DeclineReason


def port(name: str, n: int) -> LocalPort:
    return LocalPort(
        name, bytes(10) + b"\xff\xff" + bytes((192, 0, 2, n)), bytes((2, 0, 0, 0, 0, n))
    )


@dataclass
class Host:
    name: str
    tag: int
    lg: LinkGroup
    peer: Host | None = None
    outputs: list[Output] = field(default_factory=list)
    sent: list[tuple[int, LlcMessage]] = field(default_factory=list)
    qpns: dict[int, int] = field(default_factory=dict)
    next_qpn: int = 0x100

    def rkey(self, rmb: int, link: int) -> tuple[int, int]:
        return (self.tag << 16 | rmb << 8 | link, self.tag << 40 | rmb << 20 | link << 12)

    def of(self, kind: type) -> list:  # type: ignore[type-arg]
        return [o for o in self.outputs if isinstance(o, kind)]


class Net:
    """Both hosts and the wire between them."""

    def __init__(self, server: LinkGroup, client: LinkGroup) -> None:
        self.s = Host("server", 0x5, server)
        self.c = Host("client", 0xC, client)
        self.s.peer, self.c.peer = self.c, self.s
        self.now = 0.0
        self.wire: deque[tuple[Host, int, bytes]] = deque()
        self.cut: set[int] = set()  # links whose messages are lost

    def handle(self, h: Host, outs: list[Output]) -> None:
        for o in outs:
            h.outputs.append(o)
            if isinstance(o, SendLlc):
                data = o.message.encode()
                assert llc.decode(data) == o.message  # the codec round-trips what we send
                h.sent.append((o.link_id, o.message))
                assert h.peer is not None
                if o.link_id not in self.cut:
                    self.wire.append((h.peer, o.link_id, data))
            elif isinstance(o, CreateQp):
                h.next_qpn += 1
                h.qpns[o.link_id] = h.next_qpn
                rk = {r: h.rkey(r, o.link_id) for r in o.rmb_ids}
                self.handle(h, h.lg.qp_created(o.link_id, h.next_qpn, 0x1000 + o.link_id,
                                               self.now, rk))  # fmt: skip

    def run(self, limit: int = 1000) -> None:
        n = 0
        while self.wire:
            dst, link, data = self.wire.popleft()
            self.handle(dst, dst.lg.receive(link, data, self.now))
            n += 1
            assert n < limit, "LLC ping-pong does not end"

    def advance(self, seconds: float, step: float = 0.5) -> None:
        end = self.now + seconds
        while self.now < end:
            self.now = min(end, self.now + step)
            for h in (self.s, self.c):
                self.handle(h, h.lg.tick(self.now))
            self.run()


def first_contact(
    server_ports: list[LocalPort],
    client_ports: list[LocalPort],
    *,
    conns: int = 1,
    testlink_time: float = 0.0,
    v2: bool = False,
    max_links: int = 2,
) -> Net:
    s = LinkGroup(Role.SERVER, 0x100, server_ports, testlink_time=testlink_time, v2=v2,
                  max_links=max_links, release_v21=v2)  # fmt: skip
    c = LinkGroup(Role.CLIENT, 0x200, client_ports, testlink_time=testlink_time, v2=v2,
                  max_links=max_links, release_v21=v2)  # fmt: skip
    net = Net(s, c)
    net.handle(net.s, s.start(net.now))
    net.handle(net.c, c.start(net.now))
    # the first contact's RMBs travel in CLC (no CONFIRM RKEY)
    for h in (net.s, net.c):
        for rmb in range(1, conns + 1):
            net.handle(h, h.lg.add_rmb(rmb, {1: h.rkey(rmb, 1)}, net.now, announce=False))
    sp, cp = server_ports[0], client_ports[0]
    # CLC Accept → client learns the server QP; CLC Confirm → the server learns the client's
    net.handle(net.c, c.first_contact_peer(PeerQp(net.s.qpns[1], 0x1001, sp.gid, sp.mac, 3), 0))
    for rmb in range(1, conns + 1):
        c.add_connection(rmb, *net.s.rkey(rmb, 1), net.now, link_id=1)
        s.add_connection(rmb, *net.c.rkey(rmb, 1), net.now)
    net.handle(net.s, s.first_contact_peer(PeerQp(net.c.qpns[1], 0x1001, cp.gid, cp.mac, 3), 0))
    net.run()
    return net


def two_links(conns: int = 1, **kw: object) -> Net:
    return first_contact(
        [port("s0", 10), port("s1", 11)],
        [port("c0", 20), port("c1", 21)],
        conns=conns,
        **kw,  # type: ignore[arg-type]
    )


# ------------------------------------------------------------------ first contact, second link
def test_first_contact_confirm_link_both_ways_then_symmetric_second_link() -> None:
    net = two_links()
    s, c = net.s, net.c
    # CONFIRM LINK: server request, client response, on link 1, flags as Linux
    conf_s = [m for lk, m in s.sent if isinstance(m, ConfirmLink)]
    conf_c = [m for lk, m in c.sent if isinstance(m, ConfirmLink)]
    assert not conf_s[0].is_response and conf_c[0].is_response
    assert conf_s[0].link_num == 1 and conf_s[0].max_links == 2
    assert conf_c[0].link_uid == (0x200 + 1).to_bytes(4, "big")
    assert s.of(FirstContactDone) == [FirstContactDone(1)] == c.of(FirstContactDone)
    # QP transitions: server RTR+RTS before its CONFIRM LINK; client RTS after receiving it
    assert [type(o) for o in s.outputs if isinstance(o, QpToRtr | QpToRts)][:2] == [
        QpToRtr,
        QpToRts,
    ]
    # second link over the second ports, symmetric
    assert s.lg.type == c.lg.type == LgrType.SYM
    assert s.lg.active_links() == c.lg.active_links() == (1, 2)
    info_s = {i.link_id: i for i in s.lg.links()}
    info_c = {i.link_id: i for i in c.lg.links()}
    assert info_s[2].port == "s1" and info_c[2].port == "c1"
    assert info_s[2].peer_qpn == c.qpns[2] and info_c[2].peer_qpn == s.qpns[2]
    assert info_s[2].peer_gid == port("c1", 21).gid
    assert info_s[2].peer_link_uid == info_c[2].link_uid
    # ADD LINK CONT carried the RMB's rkey for the new link both ways
    assert s.lg.peer_rtoken(1, 2) == c.rkey(1, 2)
    assert c.lg.peer_rtoken(1, 2) == s.rkey(1, 2)
    assert s.of(AddLinkResult)[-1].ok and c.of(AddLinkResult)[-1].ok
    assert not s.lg.flow_busy and not c.lg.flow_busy


def test_rkey_exchange_covers_many_rmbs() -> None:
    net = two_links(conns=5)  # 5 RMBs: three ADD LINK CONT rounds (2 + 2 + 1)
    for rmb in range(1, 6):
        assert net.s.lg.peer_rtoken(rmb, 2) == net.c.rkey(rmb, 2)
        assert net.c.lg.peer_rtoken(rmb, 2) == net.s.rkey(rmb, 2)
    conts = [m for _, m in net.s.sent if isinstance(m, llc.AddLinkCont)]
    assert [m.num_rkeys for m in conts] == [5, 3, 1]


def test_single_ports_second_link_rejected_no_alt_path() -> None:
    net = first_contact([port("s0", 10)], [port("c0", 20)])
    rej = [m for _, m in net.c.sent if isinstance(m, AddLink)]
    assert len(rej) == 1
    assert rej[0].flags == AddLinkFlag.RESPONSE | AddLinkFlag.REJECT
    assert rej[0].reject_reason == AddLinkRejectReason.NO_ALT_PATH
    assert net.s.lg.type == net.c.lg.type == LgrType.SINGLE
    assert net.s.lg.active_links() == (1,) == net.c.lg.active_links()
    assert DestroyQp(2) in net.s.outputs  # the server's tentative link 2 is gone
    assert not net.s.of(AddLinkResult)[-1].ok


def test_max_links_one_means_no_add_link() -> None:
    net = first_contact([port("s0", 10), port("s1", 11)], [port("c0", 20), port("c1", 21)],
                        max_links=1)  # fmt: skip
    assert not [m for _, m in net.s.sent if isinstance(m, AddLink)]
    assert net.s.lg.type == LgrType.SINGLE


def test_asymmetric_local_when_server_has_one_port() -> None:
    net = first_contact([port("s0", 10)], [port("c0", 20), port("c1", 21)])
    assert net.s.lg.type == LgrType.ASYML and net.c.lg.type == LgrType.ASYMP
    assert {i.port for i in net.s.lg.links()} == {"s0"}


# ------------------------------------------------------------------ rkeys
def test_confirm_and_delete_rkey_keep_both_links_in_step() -> None:
    net = two_links()
    s, c = net.s, net.c
    net.handle(c, c.lg.add_rmb(7, {1: c.rkey(7, 1), 2: c.rkey(7, 2)}, net.now))
    net.run()
    assert c.of(RmbConfirmed) == [RmbConfirmed(7, True)]
    sent = next(m for _, m in c.sent if isinstance(m, llc.ConfirmRkey))
    assert len(sent.other_links) == 1 and sent.other_links[0].link_id == 2
    # the server knows the new RMB on both links: a connection on either finds it
    s.lg.add_connection(77, *c.rkey(7, 2), net.now, link_id=2)
    assert s.lg.peer_rtoken(77, 1) == c.rkey(7, 1)
    before = s.lg.peer_rkey_count()
    net.handle(c, c.lg.delete_rmb(7, net.now))
    net.run()
    assert c.of(RmbDeleted) == [RmbDeleted(7, True)]
    assert s.lg.peer_rkey_count() == before - 1
    assert s.lg.peer_rtoken(77) is None


def test_delete_unknown_rkey_is_negative() -> None:
    net = two_links()
    net.handle(net.c, net.c.lg.add_rmb(8, {1: (0xDEAD, 0), 2: (0xBEEF, 0)}, net.now,
                                       announce=False))  # fmt: skip
    net.c.lg._rmbs[8].confirmed = True  # we claim the peer knows it; it does not
    net.handle(net.c, net.c.lg.delete_rmb(8, net.now))
    net.run()
    assert net.c.of(RmbDeleted) == [RmbDeleted(8, False)]
    resp = next(m for _, m in net.s.sent if isinstance(m, llc.DeleteRkey))
    assert resp.err_mask == 0x80 and resp.flags & llc.RkeyFlag.NEGATIVE


def test_local_requests_wait_for_the_flow() -> None:
    """Two CONFIRM RKEYs asked for at once run one after the other (one local flow)."""
    net = two_links()
    c = net.c
    net.handle(c, c.lg.add_rmb(7, {1: c.rkey(7, 1), 2: c.rkey(7, 2)}, net.now))
    net.handle(c, c.lg.add_rmb(8, {1: c.rkey(8, 1), 2: c.rkey(8, 2)}, net.now))
    assert len([m for _, m in c.sent if isinstance(m, llc.ConfirmRkey)]) == 1
    net.run()
    assert c.of(RmbConfirmed) == [RmbConfirmed(7, True), RmbConfirmed(8, True)]


# ------------------------------------------------------------------ failover and delete
def test_failover_moves_connections_and_nothing_is_lost() -> None:
    net = two_links()
    s, c = net.s, net.c
    for i in range(2, 5):  # later connections: new RMBs confirmed on both links first
        for h in (s, c):
            net.handle(h, h.lg.add_rmb(i, {1: h.rkey(i, 1), 2: h.rkey(i, 2)}, net.now))
            net.run()
        link = s.lg.pick_link()
        s.lg.add_connection(i, *c.rkey(i, link), net.now, link_id=link)
        # the client follows the server's choice (the Accept's QPN names the link)
        c.lg.add_connection(i, *s.rkey(i, link), net.now, link_id=link)
    on2 = {i for i in s.lg.connections() if s.lg.connection_link(i) == 2}
    assert on2 and len(on2) < 4, "the server balances connections over both links"
    s.lg.connection_closing(max(on2))
    net.cut.add(2)  # the wire of link 2 is gone
    net.handle(s, s.lg.port_state("s1", False, net.now))
    net.run()
    moves = s.of(MoveConnection)
    assert {m.conn_id for m in moves} == on2
    assert all(m.from_link == 2 and m.to_link == 1 for m in moves)
    assert {m.conn_id for m in moves if m.validate} == on2 - {max(on2)}  # closing: no CDC
    for m in moves:  # the new link's rkey of the peer RMB, ready for RDMA WRITE
        assert (m.peer_rkey, m.peer_vaddr) == c.rkey(m.conn_id, 1)
    for m in c.of(MoveConnection):
        assert (m.peer_rkey, m.peer_vaddr) == s.rkey(m.conn_id, 1)
    # DELETE LINK request (orderly, lost path) went over the surviving link; client answered
    dl = [m for lk, m in s.sent if isinstance(m, DeleteLink)]
    assert dl[0].link_num == 2 and dl[0].reason == DeleteLinkReason.LOST_PATH
    assert dl[0].flags & DeleteLinkFlag.ORDERLY
    assert {m.conn_id for m in c.of(MoveConnection)} == on2
    # every connection survives on both sides, and the link group stays usable
    assert set(s.lg.connections()) == set(c.lg.connections()) == {1, 2, 3, 4}
    assert not s.of(AbortConnections) and not c.of(AbortConnections)
    # the server re-adds an asymmetric link over its remaining port
    assert s.lg.type == LgrType.ASYML and c.lg.type == LgrType.ASYMP
    assert all(i.port == "s0" for i in s.lg.links())


def test_client_side_link_down_is_deleted_on_both_sides() -> None:
    net = two_links()
    s, c = net.s, net.c
    for p in ("s1",):  # keep the server from re-adding over a second port
        s.lg._ports[p] = LocalPort(p, port(p, 11).gid, port(p, 11).mac, active=False)
    c.lg._ports["c1"] = LocalPort("c1", port("c1", 21).gid, port("c1", 21).mac, active=False)
    net.handle(c, c.lg.link_down(2, net.now, "carrier lost on c1"))
    net.run()
    req = next(m for _, m in c.sent if isinstance(m, DeleteLink))
    assert req.link_num == 2 and not req.is_response
    # the server echoes the request; the client no longer knows link 2 and says so
    echo = [m for _, m in s.sent if isinstance(m, DeleteLink)]
    assert echo and echo[0].link_num == 2 and not echo[0].is_response
    resp = [m for _, m in c.sent if isinstance(m, DeleteLink) and m.is_response]
    assert resp[0].reason == DeleteLinkReason.UNKNOWN_LINK
    assert s.lg.active_links() == c.lg.active_links() == (1,)
    assert s.lg.type == c.lg.type == LgrType.SINGLE
    assert not s.lg.flow_busy and not c.lg.flow_busy


def test_no_surviving_link_aborts_all_connections() -> None:
    net = first_contact([port("s0", 10)], [port("c0", 20)], conns=3)
    net.cut.add(1)
    net.handle(net.s, net.s.lg.link_down(1, net.now, "port s0 down"))
    assert net.s.of(AbortConnections) == [AbortConnections((1, 2, 3))]
    term = net.s.of(LinkGroupTerminated)[0]
    assert term.reason == DeleteLinkReason.LOST_PATH and "no surviving link" in term.explanation
    assert DestroyQp(1) in net.s.outputs
    assert net.s.lg.terminated and not net.s.lg.links()
    with pytest.raises(LinkGroupError):
        net.s.lg.add_connection(9, 1, 1, net.now)


def test_free_sends_orderly_delete_link_all_and_peer_terminates() -> None:
    net = first_contact([port("s0", 10)], [port("c0", 20)])
    for i in (1,):
        net.s.lg.remove_connection(i)
        net.c.lg.remove_connection(i)
    net.handle(net.s, net.s.lg.free(net.now))
    net.run()
    d = next(m for _, m in net.s.sent if isinstance(m, DeleteLink))
    assert d.flags == DeleteLinkFlag.ALL | DeleteLinkFlag.ORDERLY
    assert d.reason == DeleteLinkReason.PROGRAM_TERMINATION
    assert net.c.lg.terminated and net.s.lg.terminated
    assert net.c.of(LinkGroupTerminated)[0].reason == DeleteLinkReason.PROGRAM_TERMINATION


# ------------------------------------------------------------------ keepalive
def test_test_link_keepalive_and_timeout() -> None:
    net = first_contact([port("s0", 10)], [port("c0", 20)], testlink_time=30.0)
    net.advance(31)
    tl = [m for _, m in net.s.sent if isinstance(m, TestLink)]
    assert tl and not tl[0].is_response
    assert [m for _, m in net.c.sent if isinstance(m, TestLink) and m.is_response]
    assert net.s.lg.active_links() == (1,)
    net.cut.add(1)  # the peer goes silent
    net.advance(40)
    assert net.s.of(LinkGroupTerminated)
    assert "TEST LINK got no response" in net.s.of(LinkGroupTerminated)[0].explanation


def test_first_contact_timeout_declines_timeout_cl() -> None:
    c = LinkGroup(Role.CLIENT, 0x200, [port("c0", 20)], testlink_time=0)
    outs = c.start(0.0)
    cq = next(o for o in outs if isinstance(o, CreateQp))
    c.qp_created(cq.link_id, 0x42, 7, 0.0)
    c.first_contact_peer(PeerQp(0x99, 1, port("s0", 10).gid, port("s0", 10).mac, 3), 0.0)
    assert c.next_deadline() == 5.0
    assert not c.tick(4.9)
    outs = c.tick(5.0)
    failed = [o for o in outs if isinstance(o, FirstContactFailed)]
    assert failed[0].decline == DeclineReason.TIMEOUT_CL
    assert c.terminated


# ------------------------------------------------------------------ hostile / out of order
def test_v2_message_in_v1_link_group_is_a_protocol_violation() -> None:
    net = first_contact([port("s0", 10)], [port("c0", 20)])
    bad = TestLink(v2=True).encode()
    net.handle(net.c, net.c.lg.receive(1, bad, net.now))
    net.run()
    d = [m for _, m in net.c.sent if isinstance(m, DeleteLink)][-1]
    assert d.flags & DeleteLinkFlag.ALL and d.reason == DeleteLinkReason.PROTOCOL_VIOLATION
    assert d.reason == 0x00040000
    assert net.c.lg.terminated and net.s.lg.terminated  # the server followed the DELETE ALL
    assert net.c.of(AbortConnections) and net.s.of(AbortConnections)


def test_garbage_and_unsolicited_messages_are_dropped() -> None:
    net = two_links()
    s = net.s
    before = list(s.sent)
    for data in (b"", b"\xfe" + bytes(43), b"\x01\x10" + bytes(42), b"\x05\x2c" + bytes(42)):
        outs = s.lg.receive(1, data, net.now)
        assert [type(o) for o in outs] == [LlcIgnored]
    # responses nobody asked for, a CONFIRM LINK outside any flow, a stray ADD LINK CONT
    c1 = port("c0", 20)
    for msg in (
        ConfirmLink(c1.mac, c1.gid, 5, 1, bytes(4), 2),
        llc.AddLinkCont(2, 0, ()),
        DeleteLink(1, 0, DeleteLinkFlag.RESPONSE),
        llc.ConfirmRkey(1, 2, flags=llc.RkeyFlag.RESPONSE),
        AddLink(c1.mac, c1.gid, 1, 2, 3, 4, flags=AddLinkFlag.RESPONSE),
    ):
        outs = s.lg.receive(1, msg.encode(), net.now)
        assert [type(o) for o in outs] == [LlcIgnored], msg
    assert s.sent == before
    assert s.lg.type == LgrType.SYM and not s.lg.terminated
    # messages for links we do not have are dropped too
    assert [type(o) for o in s.lg.receive(9, TestLink().encode(), net.now)] == [LlcIgnored]


def test_parallel_delete_link_waits_for_running_rkey_flow() -> None:
    """A DELETE LINK request that arrives during our CONFIRM RKEY flow is delayed until the
    flow ends (smc_llc_flow_parallel), then processed."""
    net = two_links()
    c = net.c
    net.handle(c, c.lg.add_rmb(7, {1: c.rkey(7, 1), 2: c.rkey(7, 2)}, net.now))
    assert c.lg.flow_busy
    req = DeleteLink(2, DeleteLinkReason.LOST_PATH, DeleteLinkFlag.ORDERLY)
    outs = c.lg.receive(1, req.encode(), net.now)
    assert not [o for o in outs if isinstance(o, SendLlc)]  # not answered yet
    net.run()  # the CONFIRM RKEY response ends the flow; the DELETE LINK follows
    assert c.of(RmbConfirmed) == [RmbConfirmed(7, True)]
    resp = [m for _, m in c.sent if isinstance(m, DeleteLink) and m.is_response]
    assert resp and resp[0].reason == DeleteLinkReason.NONE
    assert c.lg.active_links() == (1,)
    assert LinkState.ACTIVE not in {i.state for i in c.lg.links() if i.link_id == 2}


def test_second_parallel_request_is_dropped() -> None:
    net = two_links()
    c = net.c
    net.handle(c, c.lg.add_rmb(7, {1: c.rkey(7, 1), 2: c.rkey(7, 2)}, net.now))
    c.lg.receive(1, DeleteLink(2, 0x10000, DeleteLinkFlag.ORDERLY).encode(), net.now)
    outs = c.lg.receive(1, DeleteLink(1, 0x10000, DeleteLinkFlag.ORDERLY).encode(), net.now)
    assert [o.why for o in outs if isinstance(o, LlcIgnored)] == ["parallel LLC request dropped"]


def test_v2_link_group_adds_link_with_rkeys_in_extension() -> None:
    net = two_links(conns=3, v2=True)
    assert net.s.lg.type == LgrType.SYM
    assert not [m for _, m in net.s.sent if isinstance(m, llc.AddLinkCont)]
    assert all(m.is_v2 for _, m in net.s.sent + net.c.sent)
    for rmb in range(1, 4):
        assert net.s.lg.peer_rtoken(rmb, 2) == net.c.rkey(rmb, 2)
        assert net.c.lg.peer_rtoken(rmb, 2) == net.s.rkey(rmb, 2)
    conf = next(m for _, m in net.s.sent if isinstance(m, ConfirmLink))
    assert conf.max_links == 2 and conf.max_conns == 255  # v2.1 values
