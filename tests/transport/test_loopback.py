"""loopback-ism in userspace: GID, DMB register/attach by token, the pairing table."""

from __future__ import annotations

import ipaddress
import os

import pytest

from smcd_daemon.core.buffers import DmbPool, UnknownTokenError
from smcd_daemon.transport.loopback import (
    LOOPBACK_ISM_CHID,
    LinkGroupTable,
    LoopbackIsm,
    PairingError,
    PairingTable,
    PairingTableFull,
    endpoint,
)

CLIENT = ("127.0.0.1", 40000)
SERVER = ("127.0.0.1", 5000)


class Clock:
    """A settable monotonic clock, so expiry is tested without sleeping."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_gid_is_random_128_bit_split_into_gid_and_gid_ext() -> None:
    pool = DmbPool()
    a, b = LoopbackIsm(pool), LoopbackIsm(pool)
    assert a.gid128 != b.gid128
    assert a.gid == a.gid128 >> 64 and a.gid_ext == a.gid128 & (1 << 64) - 1
    assert a.gid and a.gid_ext
    dev = a.ism_device()
    assert (dev.chid, dev.gid, dev.gid_ext) == (LOOPBACK_ISM_CHID, a.gid, a.gid_ext)
    assert dev.emulated and len(dev.entries()) == 2  # two GID/CHID entries in a Proposal
    assert a.chid == 0xFFFF
    assert a.query_remote_gid(a.gid128) and not a.query_remote_gid(b.gid128)
    fixed = LoopbackIsm(pool, gid128=0x0123456789ABCDEF_FEDCBA9876543210)
    assert (fixed.gid, fixed.gid_ext) == (0x0123456789ABCDEF, 0xFEDCBA9876543210)


def test_register_attach_unregister_by_token() -> None:
    pool = DmbPool()
    dev = LoopbackIsm(pool)
    srv = dev.register_dmb(1001, 64 * 1024)
    # the client attaches the server's DMB and writes into it (no-copy)
    peer = dev.attach_dmb(srv.token, 1000)
    assert peer is srv and srv.refs == 2
    os.pwrite(peer.fd, b"data for the server", 32)
    assert os.pread(srv.fd, 19, 32) == b"data for the server"
    dev.unregister_dmb(srv.token)
    assert pool.get(srv.token) is srv  # still attached
    dev.detach_dmb(srv.token)
    with pytest.raises(UnknownTokenError):
        dev.attach_dmb(srv.token, 1000)
    with pytest.raises(UnknownTokenError):
        dev.attach_dmb(0xDEAD, 1000)
    pool.close()


def test_endpoint_normalises_both_spellings_of_an_address() -> None:
    v4 = endpoint(("127.0.0.1", 80))
    assert v4 == (ipaddress.IPv4Address("127.0.0.1"), 80, 0)
    assert endpoint(("::ffff:127.0.0.1", 80, 0, 0)) == v4  # a v6 client of a v4 listener
    assert endpoint(("fe80::1%2", 80, 7, 2)) == (ipaddress.IPv6Address("fe80::1"), 80, 2)
    assert endpoint(v4) == v4
    # the addresses hash once, and stay interchangeable with ipaddress's as keys and in networks
    for ep, plain in (
        (v4, ipaddress.IPv4Address("127.0.0.1")),
        (endpoint(("::1", 1)), ipaddress.IPv6Address("::1")),
    ):
        ip = ep[0]
        assert isinstance(ip, type(plain)) and repr(ip) == repr(plain)
        assert ip == plain and hash(ip) == hash(plain) and {plain: 1}[ip] == 1
        assert ip in ipaddress.ip_network(f"{plain}/{plain.max_prefixlen}")
    for bad in ("127.0.0.1", ("nohost", 1), ("127.0.0.1", 70000), ("127.0.0.1",)):
        with pytest.raises(PairingError):
            endpoint(bad)


def test_pairing_matches_the_mirrored_four_tuple_once() -> None:
    table = PairingTable()
    table.register_client(CLIENT, SERVER)
    assert not table.claimed(CLIENT, SERVER)
    # a server half of another connection does not match
    assert not table.claim_server(SERVER, ("127.0.0.1", 40001))
    assert not table.claim_server(("127.0.0.2", 5000), CLIENT)
    # the server half sees (local=SERVER, peer=CLIENT); IPv4-mapped spelling pairs too
    assert table.claim_server(("::ffff:127.0.0.1", 5000, 0, 0), CLIENT)
    assert table.claimed(CLIENT, SERVER)
    assert not table.claim_server(SERVER, CLIENT)  # one client half pairs one server half
    assert table.withdraw(CLIENT, SERVER)
    assert not table.withdraw(CLIENT, SERVER)
    assert not table.claim_server(SERVER, CLIENT)


def test_pairing_entries_expire() -> None:
    clock = Clock()
    table = PairingTable(ttl=5.0, clock=clock)
    table.register_client(CLIENT, SERVER)
    clock.now += 4.9
    assert len(table) == 1
    clock.now += 0.2
    assert len(table) == 0
    assert not table.claim_server(SERVER, CLIENT)


def test_pairing_table_is_bounded() -> None:
    clock = Clock()
    table = PairingTable(max_entries=3, ttl=10.0, clock=clock)
    for port in (1, 2, 3):
        table.register_client(("127.0.0.1", port), SERVER)
    with pytest.raises(PairingTableFull):
        table.register_client(("127.0.0.1", 4), SERVER)
    table.register_client(("127.0.0.1", 2), SERVER)  # re-registering a 4-tuple takes no slot
    clock.now += 10.0
    table.register_client(("127.0.0.1", 4), SERVER)  # expired entries make room
    assert len(table) == 1


def test_sessions_bind_uid_and_addresses() -> None:
    pool = DmbPool()
    dev = LoopbackIsm(pool)
    dev.pairing.register_client(CLIENT, SERVER)
    client = dev.session(1000, CLIENT, SERVER, server=False)
    server = dev.session(1001, SERVER, CLIENT, server=True)
    stranger = dev.session(1002, SERVER, ("127.0.0.1", 40002), server=True)
    assert not stranger.pairing_verified()
    assert not client.pairing_confirmed()
    assert server.pairing_verified() and server.pairing_verified()  # remembered, not re-claimed
    assert client.pairing_confirmed()
    grant = server.register_dmb(64 * 1024, 16 * 1024)
    assert pool.get(grant.token).owner_uid == 1001
    attached = client.attach_dmb(grant.token)
    assert attached == grant and 1000 in pool.get(grant.token).accessors
    client.detach_dmb(grant.token)
    server.unregister_dmb(grant.token)
    assert pool.in_use_buffers == 0
    pool.close()


def test_link_group_table_one_per_peer_gid() -> None:
    table = LinkGroupTable()
    assert table.find(7) is None
    lgr = table.create(7)
    assert lgr == 256 and table.find(7) == lgr
    assert table.create(8) == 512
    with pytest.raises(Exception, match="exists already"):
        table.create(7)
    table.discard(lgr)
    assert table.find(7) is None and table.find(8) == 512


def test_halves_pair_only_by_the_tokens_they_read_back() -> None:
    """The proof: a client half attaches only a token an unclaimed server half of this daemon
    wrote (of the same connection key), a server half only the token of the client half that read
    its own; a guessed, replayed or crossed token is refused and changes nothing."""
    pool = DmbPool()
    dev = LoopbackIsm(pool)
    key1, key2 = (111, 222), (333, 444)  # two connections with identical addresses
    s1 = dev.session(1001, SERVER, CLIENT, server=True, key=key1)
    s2 = dev.session(1001, SERVER, CLIENT, server=True, key=key2)
    c1 = dev.session(1000, CLIENT, SERVER, server=False, key=key1)
    c2 = dev.session(1000, CLIENT, SERVER, server=False, key=key2)
    t_s1, t_s2 = (s.register_dmb(16384, 16384).token for s in (s1, s2))
    t_c1, t_c2 = (c.register_dmb(16384, 16384).token for c in (c1, c2))
    raw = pool.register(1000, 16384)  # a DMB no handshake wrote
    with pytest.raises(PairingError, match="not written by a server half"):
        c1.attach_dmb(raw.token)
    with pytest.raises(PairingError, match="not written by a server half"):
        c1.attach_dmb(t_c2)  # a client half's token is no Accept's
    with pytest.raises(PairingError, match="another TCP connection"):
        c1.attach_dmb(t_s2)  # the other pair's server, same addresses
    with pytest.raises(PairingError, match="did not read this server half's token"):
        s1.attach_dmb(t_c1)  # c1 has not read s1's token yet
    c1.attach_dmb(t_s1)
    assert c1.partner is s1 and s1.partner is c1
    with pytest.raises(PairingError):
        c2.attach_dmb(t_s1)  # replayed: s1 is taken
    with pytest.raises(PairingError, match="did not read this server half's token"):
        s2.attach_dmb(t_c1)  # crossed
    s1.attach_dmb(t_c1)
    c2.attach_dmb(t_s2)
    s2.attach_dmb(t_c2)
    assert (c2.partner, s2.partner) == (s2, c2)


def test_a_policy_refuses_a_proven_pair_with_its_reason() -> None:
    dev = LoopbackIsm(DmbPool())
    dev.policy = lambda client, server: f"{client.owner} may not reach {server.owner}"
    s = dev.session(1001, SERVER, CLIENT, server=True, owner="ns-b")
    c = dev.session(1000, CLIENT, SERVER, server=False, owner="ns-a")
    token = s.register_dmb(16384, 16384).token
    c.register_dmb(16384, 16384)
    with pytest.raises(PairingError, match="refused by policy: ns-a may not reach ns-b"):
        c.attach_dmb(token)
    assert c.partner is None and s.partner is None
