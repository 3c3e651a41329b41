"""The LLC a Linux kernel peer initiates, as bytes shaped like the kernel's, against one
LinkGroup: SMC-Rv2 ADD LINK (the kernel server offers its second device right after the first
contact), DELETE LINK ALL (the kernel terminates its link groups, e.g. on ``rmmod smc``).

The kernel's behaviour these follow (``net/smc/smc_llc.c``): ``smc_llc_fill_ext_v2`` puts the
sender's own GID of the new link in ``client_target_gid``; a v2 ADD LINK from the peer's known
GID is asymmetric whatever its MAC; a server answers DELETE LINK ALL with its own (orderly, the
peer's reason) before its termination's DELETE LINK ALL, and a client terminates, sending DELETE
LINK ALL with its termination reason.
"""

from __future__ import annotations

from smcd_daemon.protocol.linkgroup import (
    AbortConnections,
    AddLinkResult,
    CreateQp,
    DestroyQp,
    LgrType,
    LinkGroupTerminated,
)
from smcd_daemon.wire import llc
from smcd_daemon.wire.llc import (
    AddLink,
    AddLinkFlag,
    AddLinkRkey,
    AddLinkV2Ext,
    ConfirmLink,
    ConfirmLinkFlag,
    DeleteLink,
    DeleteLinkFlag,
    DeleteLinkReason,
)
from tests.protocol.test_linkgroup import Net, first_contact, port

KERNEL_MAC2 = bytes.fromhex("525400b10001")


def kernel_gid(n: int) -> bytes:
    return bytes(10) + b"\xff\xff" + bytes((198, 51, 100, n))


def test_v2_add_link_ext_names_the_senders_own_new_gid() -> None:
    net = first_contact([port("s0", 10), port("s1", 11)], [port("c0", 20), port("c1", 21)],
                        v2=True)  # fmt: skip
    req = next(m for _, m in net.s.sent if isinstance(m, AddLink))
    resp = next(m for _, m in net.c.sent if isinstance(m, AddLink))
    assert req.ext is not None and resp.ext is not None
    assert req.ext.client_target_gid == req.sender_gid == port("s1", 11).gid
    assert resp.ext.client_target_gid == resp.sender_gid == port("c1", 21).gid
    assert net.s.lg.type == net.c.lg.type == LgrType.SYM


def kernel_add_link(net: Net, gid: bytes, mac: bytes, *, rkeys: bool = True) -> bytes:
    """A kernel server's v2 ADD LINK request for its new link 2 (its RMB 1's rkeys)."""
    rt = (AddLinkRkey(net.s.rkey(1, 1)[0], 0x77000, 0x7700_0000),) if rkeys else ()
    return AddLink(mac, gid, 0x99, 2, 3, 0x4242, ext=AddLinkV2Ext(True, gid, rt),
                   v2=True).encode()  # fmt: skip


def test_v2_add_link_from_the_peers_gid_is_asymmetric_whatever_its_mac() -> None:
    """A single-port client rejects it (no alternate path): the kernel compares GIDs only in
    SMC-Rv2, so a different MAC does not make it symmetric."""
    net = first_contact([port("s0", 10)], [port("c0", 20)], v2=True, max_links=1)
    c = net.c
    c.outputs.clear()
    c.sent.clear()
    net.handle(c, c.lg.receive(1, kernel_add_link(net, port("s0", 10).gid, KERNEL_MAC2),
                               net.now))  # fmt: skip
    (rej,) = [m for _, m in c.sent if isinstance(m, AddLink)]
    assert rej.flags == AddLinkFlag.RESPONSE | AddLinkFlag.REJECT and rej.is_v2
    assert not c.of(CreateQp) and c.lg.type == LgrType.SINGLE


def test_kernel_v2_add_link_with_a_second_device_makes_a_symmetric_group() -> None:
    """The kernel's sequence: ADD LINK request (v2 ext with its rkeys) on link 1, our response
    on link 1, CONFIRM LINK request on the new link, our CONFIRM LINK response there."""
    # our stand-in server adds no link itself; the kernel's request comes instead
    net = first_contact([port("s0", 10)], [port("c0", 20), port("c1", 21)], v2=True,
                        max_links=1)  # fmt: skip
    c = net.c
    c.lg.max_links = 2
    net.wire.clear()
    c.outputs.clear()
    c.sent.clear()
    net.handle(c, c.lg.receive(1, kernel_add_link(net, kernel_gid(2), KERNEL_MAC2), net.now))
    (resp,) = [m for lk, m in c.sent if isinstance(m, AddLink) and lk == 1]
    assert resp.is_response and not resp.flags & AddLinkFlag.REJECT and resp.is_v2
    assert resp.sender_gid == port("c1", 21).gid and resp.link_num == 2
    assert resp.ext is not None and resp.ext.client_target_gid == port("c1", 21).gid
    # our RMB's rkey on the new link, keyed by its rkey on link 1
    assert [(r.rmb_key, r.rmb_key_new) for r in resp.ext.rkeys] == [
        (c.rkey(1, 1)[0], c.rkey(1, 2)[0])
    ]
    assert c.lg.peer_rtoken(1, 2) == (0x77000, 0x7700_0000)
    conf = ConfirmLink(KERNEL_MAC2, kernel_gid(2), 0x99, 2, bytes.fromhex("0000abcd"), 2,
                       flags=ConfirmLinkFlag.NO_RMBE_EYEC, v2=True)  # fmt: skip
    c.sent.clear()
    net.handle(c, c.lg.receive(2, conf.encode(), net.now))
    (answer,) = [(lk, m) for lk, m in c.sent if isinstance(m, ConfirmLink)]
    assert answer[0] == 2 and answer[1].is_response and answer[1].is_v2
    assert c.lg.type == LgrType.SYM and c.lg.active_links() == (1, 2)
    assert c.of(AddLinkResult)[-1].ok
    info = {i.link_id: i for i in c.lg.links()}
    assert info[2].peer_gid == kernel_gid(2) and info[2].peer_qpn == 0x99
    assert info[2].peer_link_uid == bytes.fromhex("0000abcd")


def test_kernel_delete_link_all_to_our_server_is_echoed_orderly_with_its_reason() -> None:
    net = first_contact([port("s0", 10)], [port("c0", 20)], v2=True, max_links=1)
    s = net.s
    net.wire.clear()
    s.sent.clear()
    kill = DeleteLink(0, DeleteLinkReason.OPERATOR_TERMINATION, DeleteLinkFlag.ALL, v2=True)
    net.handle(s, s.lg.receive(1, kill.encode(), net.now))
    # the echo first (smc_llc_process_srv_delete_link), then the termination's own DELETE LINK
    # ALL (smc_lgr_cleanup), as the kernel sends both
    echo, cleanup = [m for _, m in s.sent if isinstance(m, DeleteLink)]
    assert cleanup.flags == DeleteLinkFlag.ALL
    assert echo.flags == DeleteLinkFlag.ALL | DeleteLinkFlag.ORDERLY and not echo.is_response
    assert echo.reason == DeleteLinkReason.OPERATOR_TERMINATION and echo.is_v2
    assert s.lg.terminated and DestroyQp(1) in s.outputs
    assert s.of(AbortConnections) == [AbortConnections((1,))]
    assert s.of(LinkGroupTerminated)[0].reason == DeleteLinkReason.OPERATOR_TERMINATION


def test_kernel_delete_link_all_to_our_client_terminates_it() -> None:
    net = first_contact([port("s0", 10)], [port("c0", 20)], v2=True, max_links=1)
    c = net.c
    net.wire.clear()
    c.sent.clear()
    kill = DeleteLink(0, DeleteLinkReason.OPERATOR_TERMINATION, DeleteLinkFlag.ALL, v2=True)
    net.handle(c, c.lg.receive(1, kill.encode(), net.now))
    (last,) = [m for _, m in c.sent if isinstance(m, DeleteLink)]
    assert last.flags == DeleteLinkFlag.ALL and not last.is_response  # smc_lgr_cleanup's
    assert last.reason == DeleteLinkReason.PROGRAM_TERMINATION
    assert c.lg.terminated and DestroyQp(1) in c.outputs and not c.lg.links()
    assert llc.decode(last.encode()) == last
