"""The pair/half life cycle of handed-off SMC-D connections, in-process (no sockets, no loop):
pairing, both halves served, one half gone, drops and mismatches, DMBs released only when both
halves let go; the listener table; and the DMB observer's reading of
the header the channel writes (a real memfd, the shared layout)."""

from __future__ import annotations

import ipaddress
import os

import pytest

from smc_handoff import layout
from smcd_daemon.adapters.handoff.observer import DmbView, advance, read_header
from smcd_daemon.core.handoff_pairs import (
    CloseLink,
    CloseShared,
    DmbOp,
    DmbRelease,
    Effect,
    Half,
    IpAddress,
    ListenerTable,
    PairKey,
    PairMismatchError,
    PairTable,
    ReleaseDmbs,
)
from smcd_daemon.core.registry import ConnRole
from smcd_daemon.wire.cdc import ConnStateFlag, ProducerFlag, SmcdCdcHeader
from smcd_daemon.wire.cursor import Cursor

CLIENT, SERVER = ConnRole.CLIENT, ConnRole.SERVER
IP_A = ipaddress.ip_address("192.0.2.1")
IP_B = ipaddress.ip_address("192.0.2.2")
KEY: PairKey = ((IP_A, 40000, 0), (IP_B, 80, 0))
OTHER_KEY: PairKey = ((IP_A, 40001, 0), (IP_B, 80, 0))
C_TOKEN, S_TOKEN = 0x1111, 0x2222
TOKENS = (C_TOKEN, S_TOKEN)


def half(role: ConnRole, conn_id: int | None = None) -> Half:
    """A half as the handshake leaves it: its own DMB and the peer's."""
    local, peer = (C_TOKEN, S_TOKEN) if role is CLIENT else (S_TOKEN, C_TOKEN)
    cid = conn_id if conn_id is not None else (1 if role is CLIENT else 2)
    return Half(cid, role, 1000, local, peer, 65536, 65536)


def released(effects: list[Effect]) -> list[DmbRelease]:
    return [r for e in effects if isinstance(e, ReleaseDmbs) for r in e.releases]


def unreg(token: int) -> DmbRelease:
    return DmbRelease(DmbOp.UNREGISTER, token)


def detach(token: int) -> DmbRelease:
    return DmbRelease(DmbOp.DETACH, token)


def serve(table: PairTable, h: Half, key: PairKey = KEY) -> list[Effect]:
    """What the adapter does for one half: claim or open its pair, join it, hand out."""
    pair = table.claim(key, TOKENS, h.role)
    if pair is None:
        pair = table.open(key, TOKENS, res=f"fds of {key[0][1]}")
    table.join(h, pair)
    return table.hand_out(pair, h.role)


def test_first_half_opens_the_pair_and_second_half_completes_it() -> None:
    table = PairTable()
    c, s = half(CLIENT), half(SERVER)
    assert table.claim(KEY, TOKENS, CLIENT) is None
    pair = table.open(KEY, TOKENS, res="fds")
    table.join(c, pair)
    assert c.pair is pair and pair.res == "fds"
    # the client half has its own link end: the daemon's copy of it goes, nothing else yet
    assert table.hand_out(pair, CLIENT) == [CloseLink(pair, CLIENT)]
    assert not pair.complete and table.get(KEY) is pair
    # the server half joins the same pair
    assert table.claim(KEY, TOKENS, SERVER) is pair
    table.join(s, pair)
    assert table.hand_out(pair, SERVER) == [CloseLink(pair, SERVER), CloseShared(pair)]
    assert pair.complete and pair.taken == {CLIENT, SERVER}
    assert table.is_current(pair) and len(table) == 1


def test_buffers_go_back_only_when_both_halves_let_go() -> None:
    table = PairTable()
    c, s = half(CLIENT), half(SERVER)
    serve(table, c)
    serve(table, s)
    pair = c.pair
    assert pair is not None
    # one half hangs up: its releases wait in the pair (the peer still maps both DMBs)
    assert table.release(c) == []
    assert c.pair is None and c.local_token is None and c.peer_token is None
    assert pair.pending == [unreg(C_TOKEN), detach(S_TOKEN)]
    assert table.is_current(pair)
    # the other half hangs up: the pair is done, every reference goes back, in order
    effects = table.release(s)
    assert effects == [
        CloseShared(pair),
        ReleaseDmbs((unreg(C_TOKEN), detach(S_TOKEN), unreg(S_TOKEN), detach(C_TOKEN))),
    ]
    assert pair.pending == [] and table.get(KEY) is None and len(table) == 0


def test_releasing_twice_releases_nothing_more() -> None:
    table = PairTable()
    c, s = half(CLIENT), half(SERVER)
    serve(table, c)
    serve(table, s)
    table.release(c)
    assert released(table.release(s)) != []
    assert table.release(c) == [] and table.release(s) == []


def test_client_that_closes_before_the_server_arrives() -> None:
    """A client may hang up before the server half has even attached its DMB."""
    table = PairTable()
    c, s = half(CLIENT), half(SERVER)
    serve(table, c)
    pair = c.pair
    assert pair is not None
    assert table.release(c) == []  # the server half may still come: nothing is released
    assert table.claim(KEY, TOKENS, SERVER) is pair
    table.join(s, pair)
    assert table.hand_out(pair, SERVER) == [CloseLink(pair, SERVER), CloseShared(pair)]
    effects = table.release(s)
    assert released(effects) == [unreg(C_TOKEN), detach(S_TOKEN), unreg(S_TOKEN), detach(C_TOKEN)]
    assert table.get(KEY) is None


def test_drop_of_a_pair_whose_second_half_never_comes() -> None:
    table = PairTable()
    c = half(CLIENT)
    serve(table, c)
    pair = c.pair
    assert pair is not None
    # the server half fell back: the shared descriptors close (the client sees its link hang
    # up), but the client's DMBs stay until the client lets go
    assert table.drop(KEY) == [CloseShared(pair)]
    assert table.get(KEY) is None and not table.is_current(pair)
    assert table.drop(KEY) is None  # nothing left to drop
    assert table.release(c) == [
        CloseShared(pair),
        ReleaseDmbs((unreg(C_TOKEN), detach(S_TOKEN))),
    ]


def test_drop_after_the_only_half_let_go_releases_at_once() -> None:
    table = PairTable()
    c = half(CLIENT)
    serve(table, c)
    pair = c.pair
    assert table.release(c) == []
    assert table.drop(KEY) == [CloseShared(pair), ReleaseDmbs((unreg(C_TOKEN), detach(S_TOKEN)))]


def test_a_complete_pair_is_never_dropped() -> None:
    table = PairTable()
    serve(table, half(CLIENT))
    serve(table, half(SERVER))
    assert table.drop(KEY) is None
    assert table.get(KEY) is not None


def test_mismatched_tokens_or_a_second_half_of_one_role_are_refused() -> None:
    table = PairTable()
    serve(table, half(CLIENT))
    with pytest.raises(PairMismatchError, match="does not match"):
        table.claim(KEY, (C_TOKEN, 0x9999), SERVER)
    with pytest.raises(PairMismatchError, match="does not match"):
        table.claim(KEY, TOKENS, CLIENT)  # the client half is already served
    with pytest.raises(PairMismatchError, match="already open"):
        table.open(KEY, TOKENS)
    assert table.get(KEY) is not None  # the refused half changed nothing


def test_a_half_that_never_joined_releases_at_once() -> None:
    """A half whose channel could not be built gives its DMBs back immediately."""
    table = PairTable()
    lonely = half(SERVER)
    assert table.release(lonely) == [ReleaseDmbs((unreg(S_TOKEN), detach(C_TOKEN)))]
    resumed = Half(7, CLIENT, 1000, None, None, 65536, 65536)  # RESUME: no DMB of ours
    assert table.release(resumed) == []


def test_a_new_connection_on_a_draining_4_tuple_gets_its_own_pair() -> None:
    table = PairTable()
    old_c, old_s = half(CLIENT, 1), half(SERVER, 2)
    serve(table, old_c)
    serve(table, old_s)
    old = old_c.pair
    assert old is not None
    # the 4-tuple is reused while the old connection still drains: the old pair leaves the table
    assert table.claim(KEY, TOKENS, CLIENT) is None
    assert not table.is_current(old)
    new_c = half(CLIENT, 3)
    new = table.open(KEY, TOKENS)
    table.join(new_c, new)
    assert new is not old and table.get(KEY) is new
    # the old pair is finished by its halves alone, without touching the new one
    assert table.release(old_c) == []
    assert released(table.release(old_s)) == [
        unreg(C_TOKEN), detach(S_TOKEN), unreg(S_TOKEN), detach(C_TOKEN),
    ]  # fmt: skip
    assert table.get(KEY) is new


def test_a_half_that_joined_but_was_never_served_still_gets_its_dmbs_back() -> None:
    """The adapter failed after joining (no reply sent): the half lets go, the pair is dropped."""
    table = PairTable()
    c = half(CLIENT)
    pair = table.open(KEY, TOKENS)
    table.join(c, pair)
    assert table.release(c) == []  # a current pair with no half served may still be used
    assert table.drop(KEY) == [CloseShared(pair), ReleaseDmbs((unreg(C_TOKEN), detach(S_TOKEN)))]


def test_clear_forgets_every_open_pair() -> None:
    table = PairTable()
    serve(table, half(CLIENT))
    serve(table, half(CLIENT, 5), key=OTHER_KEY)
    pairs = table.clear()
    assert {p.key for p in pairs} == {KEY, OTHER_KEY}
    assert len(table) == 0 and list(table) == []


# -- listeners --------------------------------------------------------------------------------


def test_listener_matching_exact_wildcard_and_gone() -> None:
    table = ListenerTable()
    asked: list[IpAddress] = []

    def local(ip: IpAddress) -> bool:
        asked.append(ip)
        return ip == IP_A

    exact = table.add(IP_B, 80, 1000, conn_id=10)
    wild = table.add(ipaddress.ip_address("0.0.0.0"), 443, 1000, conn_id=11)
    assert (exact.ident, wild.ident) == (1, 2) and len(table) == 2
    assert table.why_smc(IP_B, 80, local) == "registered listener 1"
    assert table.why_smc(IP_B, 81, local) is None  # another port
    assert asked == []  # an exact match needs no address lookup
    assert table.why_smc(IP_A, 443, local) == "registered listener 2 (wildcard)"
    assert table.why_smc(IP_B, 443, local) is None  # not an address of this host
    assert asked == [IP_A, IP_B]
    assert table.remove(wild) and not table.remove(wild)
    assert table.why_smc(IP_A, 443, local) is None
    assert [lst.ident for lst in table] == [1]
    assert table.add(IP_A, 22, 0, conn_id=12).ident == 3  # identifiers are never reused


def test_listeners_sharing_a_port_match_in_registration_order() -> None:
    table = ListenerTable()
    wild = table.add(ipaddress.ip_address("0.0.0.0"), 8080, 1000, conn_id=20)
    exact = table.add(IP_A, 8080, 1000, conn_id=21)
    other = table.add(IP_A, 9090, 1000, conn_id=22)
    everywhere = lambda ip: True  # noqa: E731
    assert table.why_smc(IP_A, 8080, everywhere) == f"registered listener {wild.ident} (wildcard)"
    assert table.remove(wild)
    assert table.why_smc(IP_A, 8080, everywhere) == f"registered listener {exact.ident}"
    assert table.remove(exact) and table.why_smc(IP_A, 8080, everywhere) is None
    assert table.why_smc(IP_A, 9090, everywhere) == f"registered listener {other.ident}"
    assert [lst.ident for lst in table] == [other.ident]


def test_listeners_of_other_namespaces_are_counted() -> None:
    table = ListenerTable()
    assert not table.in_other_netns(7)
    here = table.add(IP_A, 80, 0, conn_id=1, netns=7)
    unknown = table.add(IP_A, 81, 0, conn_id=2)  # netns 0: taken as the daemon's
    assert not table.in_other_netns(7)
    there = [table.add(IP_A, 82, 0, conn_id=3, netns=9), table.add(IP_A, 83, 0, conn_id=4, netns=9)]
    assert table.in_other_netns(7) and table.in_other_netns(9)  # each sees the other
    assert table.remove(there[0]) and table.in_other_netns(7)
    assert table.remove(there[1]) and not table.in_other_netns(7)
    assert table.remove(here) and table.remove(unknown) and not table.in_other_netns(7)
    assert not table.remove(here) and not table.in_other_netns(7)


# -- the DMB observer -------------------------------------------------------------------------


def test_observer_reads_the_header_the_channel_and_the_wire_codec_write() -> None:
    size = layout.DMB_SIZES[0]
    fd = layout.create_dmb(size)
    try:
        view = DmbView(fd)
        try:
            assert read_header(view.words()) is None  # zeroed: nothing written yet
            with layout.map_dmb(fd, size) as buf:
                # as the channel writes it (whole words, the shared layout)
                buf[: layout.CDC_HEADER_LEN] = layout.encode_header(
                    (3, 70000), (2, 12345), 0, int(ConnStateFlag.PEER_DONE_WRITING)
                )
                assert read_header(view.words()) == (
                    (3, 70000), (2, 12345), int(ConnStateFlag.PEER_DONE_WRITING),
                )  # fmt: skip
                # as the wire codec encodes struct smcd_cdc_msg: the same fields come back
                hdr = SmcdCdcHeader(
                    Cursor(0xFFFF, size - layout.CDC_HEADER_LEN - 1),
                    Cursor(1, 0),
                    ProducerFlag.WRITE_BLOCKED,
                    ConnStateFlag.PEER_CONN_ABORT | ConnStateFlag.PEER_CONN_CLOSED,
                )
                hdr.encode_into(buf)
                prod, cons, flags = read_header(view.words()) or ((0, 0), (0, 0), 0)
                assert prod == (0xFFFF, size - layout.CDC_HEADER_LEN - 1) and cons == (1, 0)
                assert flags == int(hdr.conn_state_flags)
        finally:
            view.close()
        with pytest.raises(ValueError, match="closed"):
            view.words()
    finally:
        os.close(fd)


def test_observer_counts_bytes_across_wraps() -> None:
    ring = layout.DMB_SIZES[0] - layout.CDC_HEADER_LEN
    assert advance(ring, (0, 0), (0, 100)) == 100
    assert advance(ring, (0, ring - 10), (1, 5)) == 15  # across one wrap
    assert advance(ring, (0xFFFF, ring - 1), (0, 1)) == 2  # the 16-bit wrap counter rolls over
    assert advance(ring, (0, 0), (3, 0)) == 3 * ring  # several wraps between two refreshes
    assert advance(ring, (5, 10), (5, 10)) == 0
    assert advance(ring, (5, 10), (5, 9)) == 0  # a cursor that went back is not counted
