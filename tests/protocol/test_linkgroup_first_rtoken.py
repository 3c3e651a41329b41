"""The peer's first RMB is known from the CLC handshake on, before its connection is attached.

A first contact's second link can be complete before the daemon attaches the connection: the
ADD LINK flow starts right after CONFIRM LINK, while the handshake is still finishing. The
second link's rkeys for the peer's RMBs (the v2 ADD LINK extension, ADD LINK CONT) are kept
only for RMBs the link group knows, so the first RMB must be known from ``first_contact_peer``
on (as the kernel's ``smc_rmb_rtoken_handling`` comes before the first link is confirmed).
Without it, a failover moved the connection without the peer's rkey on the surviving link and
its RDMA WRITE failed that link with REM_ACCESS_ERR (seen in the Soft-RoCE VM against the
kernel's ADD LINK).
"""

from __future__ import annotations

import pytest

from smcd_daemon.protocol.linkgroup import (
    AbortConnections,
    LgrType,
    LinkGroup,
    LocalPort,
    MoveConnection,
    PeerQp,
    Role,
)
from smcd_daemon.wire.llc import (
    AddLink,
    AddLinkRkey,
    AddLinkV2Ext,
    ConfirmLink,
    ConfirmLinkFlag,
    DeleteLink,
    DeleteLinkFlag,
    DeleteLinkReason,
)
from tests.protocol.test_linkgroup import Net, port

KERNEL_MAC2 = bytes.fromhex("525400b10001")
KERNEL_GID2 = bytes(10) + b"\xff\xff" + bytes((198, 51, 100, 2))
KERNEL_RKEY2 = (0x77000, 0x7700_0000)  # the kernel's RMB 1 on its new link 2


def confirmed_first_link(
    server_ports: list[LocalPort], client_ports: list[LocalPort], *, v2: bool, max_links: int
) -> Net:
    """Both sides' first link confirmed, each told the peer's RMB with the peer's QP, and no
    connection attached on either side yet (the daemon attaches after CONFIRM LINK)."""
    s = LinkGroup(Role.SERVER, 0x100, server_ports, v2=v2, release_v21=v2, max_links=max_links,
                  testlink_time=0.0)  # fmt: skip
    c = LinkGroup(Role.CLIENT, 0x200, client_ports, v2=v2, release_v21=v2, max_links=max_links,
                  testlink_time=0.0)  # fmt: skip
    net = Net(s, c)
    net.handle(net.s, s.start(net.now))
    net.handle(net.c, c.start(net.now))
    for h in (net.s, net.c):
        net.handle(h, h.lg.add_rmb(1, {1: h.rkey(1, 1)}, net.now, announce=False))
    sp, cp = server_ports[0], client_ports[0]
    net.handle(net.c, c.first_contact_peer(PeerQp(net.s.qpns[1], 0x1001, sp.gid, sp.mac, 3),
                                           net.now, net.s.rkey(1, 1)))  # fmt: skip
    net.handle(net.s, s.first_contact_peer(PeerQp(net.c.qpns[1], 0x1001, cp.gid, cp.mac, 3),
                                           net.now, net.c.rkey(1, 1)))  # fmt: skip
    return net


@pytest.mark.parametrize("v2", [False, True], ids=["v1-add-link-cont", "v2-extension"])
def test_server_keeps_the_rkeys_of_a_second_link_completed_before_attach(v2: bool) -> None:
    net = confirmed_first_link([port("s0", 10), port("s1", 11)],
                               [port("c0", 20), port("c1", 21)], v2=v2, max_links=2)  # fmt: skip
    net.run()  # CONFIRM LINK, then the server's ADD LINK with the rkey exchange
    s, c = net.s, net.c
    assert s.lg.type == c.lg.type == LgrType.SYM
    # now the daemon attaches the connections, naming the peer's RMB by its link 1 rkey
    assert s.lg.add_connection(1, *c.rkey(1, 1), net.now) == 1
    assert c.lg.add_connection(1, *s.rkey(1, 1), net.now, link_id=1) == 1
    assert s.lg.peer_rtoken(1, 2) == c.rkey(1, 2)
    assert c.lg.peer_rtoken(1, 2) == s.rkey(1, 2)
    assert s.lg.peer_rkey_count() == c.lg.peer_rkey_count() == 1  # the same slot, not a second


def test_client_keeps_the_kernels_add_link_rkeys_and_fails_over_with_them() -> None:
    """The kernel server's v2 ADD LINK (its RMB's rkey on the new link in the extension) comes
    right after CONFIRM LINK, before our client attached its connection; then the kernel's
    first NIC goes down and it deletes link 1: the connection moves with the new rkey."""
    net = confirmed_first_link([port("s0", 10)], [port("c0", 20), port("c1", 21)], v2=True,
                               max_links=1)  # fmt: skip
    c = net.c
    c.lg.max_links = 2  # the stand-in server adds no link; the kernel's request comes instead
    net.run()
    net.wire.clear()
    offer = AddLink(KERNEL_MAC2, KERNEL_GID2, 0x99, 2, 3, 0x4242,
                    ext=AddLinkV2Ext(True, KERNEL_GID2,
                                     (AddLinkRkey(net.s.rkey(1, 1)[0], *KERNEL_RKEY2),)),
                    v2=True)  # fmt: skip
    net.handle(c, c.lg.receive(1, offer.encode(), net.now))
    conf = ConfirmLink(KERNEL_MAC2, KERNEL_GID2, 0x99, 2, bytes.fromhex("0000abcd"), 2,
                       flags=ConfirmLinkFlag.NO_RMBE_EYEC, v2=True)  # fmt: skip
    net.handle(c, c.lg.receive(2, conf.encode(), net.now))
    assert c.lg.type == LgrType.SYM and c.lg.active_links() == (1, 2)
    assert c.lg.add_connection(1, *net.s.rkey(1, 1), net.now, link_id=1) == 1
    assert c.lg.peer_rtoken(1, 2) == KERNEL_RKEY2
    c.outputs.clear()
    gone = DeleteLink(1, DeleteLinkReason.LOST_PATH, DeleteLinkFlag(0), v2=True)
    net.handle(c, c.lg.receive(2, gone.encode(), net.now))
    assert c.of(MoveConnection) == [MoveConnection(1, 1, 2, True, *KERNEL_RKEY2)]
    assert not c.of(AbortConnections) and c.lg.active_links() == (2,)
