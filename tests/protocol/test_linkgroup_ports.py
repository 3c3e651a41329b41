"""Port events on a two-link link group, as the SMC-R transport feeds them (a verbs port event
or carrier loss over rtnetlink both become :meth:`LinkGroup.port_state`): the client's first
link's port goes down mid-life, and comes back.

Uses the server/client harness of ``test_linkgroup`` (real LLC codec between two machines)."""

from __future__ import annotations

from smcd_daemon.protocol.linkgroup import (
    AbortConnections,
    AddLinkResult,
    DestroyQp,
    LgrType,
    LinkState,
    MoveConnection,
)
from smcd_daemon.wire.llc import AddLink, DeleteLink, DeleteLinkReason
from tests.protocol.test_linkgroup import two_links


def test_client_port_down_moves_connections_and_both_sides_delete_the_link() -> None:
    net = two_links(conns=1)
    s, c = net.s, net.c
    assert s.lg.type == c.lg.type == LgrType.SYM
    # a second connection on link 2, so both links carry one
    for h in (s, c):
        net.handle(h, h.lg.add_rmb(2, {1: h.rkey(2, 1), 2: h.rkey(2, 2)}, net.now))
        net.run()
    s.lg.add_connection(2, *c.rkey(2, 2), net.now, link_id=2)
    c.lg.add_connection(2, *s.rkey(2, 2), net.now, link_id=2)
    # the wire of link 1 is gone; the asymmetric link the server will try next (id 3, its s0
    # toward the client's c1) crosses two networks that do not meet, as in the VM's topology
    net.cut |= {1, 3}
    c.outputs.clear()
    s.outputs.clear()
    net.handle(c, c.lg.port_state("c0", False, net.now))
    net.run()
    # the client moved connection 1 to link 2 with validation, toward the peer RMB's rkey there
    (move,) = c.of(MoveConnection)
    assert (move.conn_id, move.from_link, move.to_link, move.validate) == (1, 1, 2, True)
    assert (move.peer_rkey, move.peer_vaddr) == s.rkey(1, 2)
    # DELETE LINK went over link 2; the server moved its end of connection 1 too
    dl = [(lk, m) for lk, m in c.sent if isinstance(m, DeleteLink)]
    assert dl and dl[0][0] == 2 and dl[0][1].link_num == 1
    assert dl[0][1].reason == DeleteLinkReason.LOST_PATH
    assert [(m.conn_id, m.to_link) for m in s.of(MoveConnection)] == [(1, 2)]
    assert DestroyQp(1) in c.outputs and DestroyQp(1) in s.outputs
    assert not c.of(AbortConnections) and not s.of(AbortConnections)
    assert c.lg.connection_link(1) == c.lg.connection_link(2) == 2
    assert s.lg.connection_link(1) == s.lg.connection_link(2) == 2
    assert [i.port for i in c.lg.links() if i.state == LinkState.ACTIVE] == ["c1"]
    # the server tried to re-add a link over its other port; the client, with c0 down, could
    # only make it asymmetric on c1 - over the cut wire it never confirms, and is given up
    net.advance(15.0)
    assert [o.ok for o in s.of(AddLinkResult)] == [False]
    assert c.lg.active_links() == s.lg.active_links() == (2,)
    assert s.lg.type == c.lg.type == LgrType.SINGLE
    assert not s.lg.flow_busy and not c.lg.flow_busy
    # the port comes back: the client invites, the server adds a symmetric link again
    net.cut.clear()
    c.sent.clear()
    net.handle(c, c.lg.port_state("c0", True, net.now))
    net.run()
    invite = [m for _, m in c.sent if isinstance(m, AddLink) and not m.is_response]
    assert invite, "the client invites the server to add a link"
    assert s.lg.type == c.lg.type == LgrType.SYM
    assert len(s.lg.active_links()) == len(c.lg.active_links()) == 2
    assert {i.port for i in c.lg.links()} == {"c0", "c1"}


def test_port_event_for_a_port_the_link_group_does_not_use_changes_nothing() -> None:
    net = two_links()
    before = net.c.lg.links()
    net.handle(net.c, net.c.lg.port_state("other:1", False, net.now))
    net.run()
    assert net.c.lg.links() == before and net.c.lg.type == LgrType.SYM
