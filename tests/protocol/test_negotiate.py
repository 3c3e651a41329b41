"""CLC negotiation, client against server through bytes, on a real loopback-ism device whose DMBs
are real memfds. Every failure path must end in a Decline (when the kernel sends one) and a
fallback with the kernel's code; hostile bytes must never raise."""

from __future__ import annotations

import dataclasses
import errno
from collections.abc import Callable

import pytest

from smcd_daemon.core.buffers import DmbPool
from smcd_daemon.core.eid import EidTable
from smcd_daemon.protocol.negotiate import (
    DECL_CLC_TIMEOUT,
    DECL_PROTOCOL_ERROR,
    SMC_FEATURE_MASK,
    ClientNegotiation,
    FallbackOutcome,
    NegotiationError,
    NegotiationFacts,
    ServerNegotiation,
    SmcdLoopbackOutcome,
    Step,
    classify_first_bytes,
)
from smcd_daemon.transport.loopback import LinkGroupTable, LoopbackIsm, LoopbackSession
from smcd_daemon.wire import clc
from smcd_daemon.wire.reasons import DeclineReason as R

CLIENT = ("127.0.0.1", 41000)
SERVER = ("127.0.0.1", 5000)
KIB = 1024


class World:
    """One daemon's loopback-ism device and pool, and the facts both halves use."""

    def __init__(self, ueids: tuple[str, ...] = ("SMCD-TEST",), **pool_kw: int) -> None:
        self.pool = DmbPool(**pool_kw)
        self.dev = LoopbackIsm(self.pool)
        self.eids = EidTable(ueids)
        self.facts = NegotiationFacts(
            eids=self.eids, loopback=self.dev.ism_device(), hostname="testhost"
        )

    def client(
        self, facts: NegotiationFacts | None = None, *, register: bool = True, uid: int = 1000
    ) -> ClientNegotiation:
        if register:
            self.dev.pairing.register_client(CLIENT, SERVER)
        session = self.dev.session(uid, CLIENT, SERVER, server=False)
        return ClientNegotiation(facts or self.facts, session)

    def server(
        self,
        facts: NegotiationFacts | None = None,
        *,
        uid: int = 1001,
        dev: LoopbackIsm | None = None,
    ) -> ServerNegotiation:
        session = LoopbackSession(dev or self.dev, uid, SERVER, CLIENT, server=True)
        return ServerNegotiation(facts or self.facts, session)


def feed(neg: ClientNegotiation | ServerNegotiation, data: bytes, *, chunk: int = 0) -> list[Step]:
    """Feed ``data`` as a driver would: never more than ``bytes_needed`` (``chunk`` caps reads)."""
    steps = []
    while data and not neg.done:
        n = neg.bytes_needed if not chunk else min(chunk, neg.bytes_needed)
        steps.append(neg.receive_data(data[:n]))
        data = data[n:]
    return steps


def sent(steps: list[Step]) -> bytes:
    return b"".join(s.data for s in steps)


def handshake(
    client: ClientNegotiation, server: ServerNegotiation, *, chunk: int = 0
) -> tuple[bytes, bytes, bytes]:
    """Run both ends to completion through bytes; return (client→server 1, s→c, c→s 2)."""
    first = client.start().data
    accept = sent(feed(server, first, chunk=chunk))
    confirm = sent(feed(client, accept, chunk=chunk))
    if confirm and not server.done:
        feed(server, confirm, chunk=chunk)
    return first, accept, confirm


def only_decline(data: bytes) -> clc.Decline:
    msg = clc.decode(data)
    assert isinstance(msg, clc.Decline)
    return msg


# ---- happy paths ---------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [0, 1, 7])
def test_first_contact_then_reuse(chunk: int) -> None:
    w = World()
    c, s = w.client(), w.server()
    first, accept, confirm = handshake(c, s, chunk=chunk)
    co, so = c.outcome, s.outcome
    assert isinstance(co, SmcdLoopbackOutcome) and isinstance(so, SmcdLoopbackOutcome)

    prop = clc.decode(first)
    assert isinstance(prop, clc.Proposal)
    assert (prop.version, prop.typev1, prop.typev2) == (2, clc.SmcType.N, clc.SmcType.D)
    assert prop.v2_ext is not None and prop.v2_ext.eids == ("SMCD-TEST",)
    assert prop.v2_ext.release == 1 and prop.v2_ext.feature_mask == SMC_FEATURE_MASK
    assert prop.smcd_v2_ext is not None
    assert prop.smcd_v2_ext.devices == (w.dev.ism_device(),)
    acc = clc.decode(accept)
    assert isinstance(acc, clc.Accept) and acc.first_contact and acc.fce is not None
    assert acc.fce.release == 1 and acc.fce.hostname == "testhost" and acc.fce.v2x
    assert isinstance(clc.decode(confirm), clc.Confirm)

    # both halves agree, crosswise
    assert co.peer_token == so.local_token and so.peer_token == co.local_token
    assert co.peer_gid == so.peer_gid == w.dev.gid128
    assert co.link_id == so.link_id == w.dev.link_groups.find(w.dev.gid128)
    assert so.first_contact and not co.first_contact  # one link group per GID, shared
    assert co.peer_first_contact and not so.peer_first_contact
    assert co.negotiated_eid == so.negotiated_eid == "SMCD-TEST"
    assert (co.release, co.feature_mask) == (so.release, so.feature_mask) == (1, 1)
    assert co.local_dmb_size == so.peer_dmb_size == 64 * KIB
    # each DMB is held by its owner and attached by the peer
    assert w.pool.get(co.local_token).refs == 2 and w.pool.get(so.local_token).refs == 2
    assert w.pool.get(co.local_token).owner_uid == 1000

    # second connection: the link group exists, no FCE anywhere
    w.dev.pairing.withdraw(CLIENT, SERVER)
    c2, s2 = w.client(), w.server()
    _, accept2, confirm2 = handshake(c2, s2, chunk=chunk)
    co2, so2 = c2.outcome, s2.outcome
    assert isinstance(co2, SmcdLoopbackOutcome) and isinstance(so2, SmcdLoopbackOutcome)
    acc2 = clc.decode(accept2)
    conf2 = clc.decode(confirm2)
    assert isinstance(acc2, clc.Accept) and not acc2.first_contact and acc2.fce is None
    assert isinstance(conf2, clc.Confirm) and not conf2.first_contact
    assert co2.link_id == so2.link_id == co.link_id
    assert not (co2.first_contact or so2.first_contact)
    assert (co2.release, co2.feature_mask) == (so2.release, so2.feature_mask) == (0, 0)
    assert w.pool.in_use_buffers == 4


def test_outcomes_from_config_sizes() -> None:
    from smcd_daemon.config import Config

    w = World()
    cfg = Config.model_validate({"buffers": {"default_dmb_size": "128K"}})
    facts = NegotiationFacts.from_config(cfg, w.eids, w.dev.ism_device(), hostname="h" * 40)
    assert facts.wire_hostname == "h" * 32
    c, s = w.client(facts), w.server(facts)
    handshake(c, s)
    assert isinstance(c.outcome, SmcdLoopbackOutcome)
    assert c.outcome.local_dmb_size == c.outcome.peer_dmb_size == 128 * KIB


# ---- declines and fallbacks ----------------------------------------------------------------


def assert_fallback(
    neg: ClientNegotiation | ServerNegotiation,
    reason: int,
    *,
    local: bool = True,
    peer_diagnosis: int | None = None,
) -> FallbackOutcome:
    out = neg.outcome
    assert isinstance(out, FallbackOutcome), out
    assert out.reason == reason, (hex(out.reason), out.detail)
    assert out.local is local and out.peer_diagnosis == peer_diagnosis
    return out


def test_peer_not_known_to_speak_smc_sends_nothing() -> None:
    w = World()
    c = w.client(dataclasses.replace(w.facts, peer_speaks_smc=False))
    step = c.start()
    assert step.data == b"" and c.done
    assert assert_fallback(c, R.PEERNOSMC).declined is False


def test_client_without_device_declines_before_proposing() -> None:
    w = World()
    c = w.client(dataclasses.replace(w.facts, smcd_enabled=False))
    s = w.server()
    first = c.start().data
    assert only_decline(first).diagnosis == R.NOSMCDEV
    assert assert_fallback(c, R.NOSMCDEV).declined
    assert classify_first_bytes(first) == "smc"
    assert feed(s, first)[-1].data == b""  # no Decline answers a Decline
    assert_fallback(s, R.PEERDECL, local=False, peer_diagnosis=R.NOSMCDEV)


def run_declined_by_server(
    w: World, c: ClientNegotiation, s: ServerNegotiation, code: int, *, in_use: int = 0
) -> None:
    _, answer, _ = handshake(c, s)
    decl = only_decline(answer)
    assert decl.diagnosis == code and decl.version == 2 and not decl.out_of_sync
    assert assert_fallback(s, code).declined
    assert_fallback(c, R.PEERDECL, local=False, peer_diagnosis=code)
    assert w.pool.in_use_buffers == in_use


def test_server_without_loopback_noism2supp() -> None:
    w = World()
    run_declined_by_server(
        w, w.client(), w.server(dataclasses.replace(w.facts, smcd_enabled=False)), R.NOISM2SUPP
    )


def test_client_without_ueid_noueid() -> None:
    w = World()
    client_facts = dataclasses.replace(w.facts, eids=EidTable())
    run_declined_by_server(w, w.client(client_facts), w.server(), R.NOUEID)


def test_no_common_ueid_nosmcddev_as_the_kernel() -> None:
    # the kernel stores no code when the EIDs do not match; an SMC-D-only Proposal then ends
    # in smc_listen_find_device's default, NOSMCDDEV
    w = World()
    client_facts = dataclasses.replace(w.facts, eids=EidTable(["OTHER"]))
    run_declined_by_server(w, w.client(client_facts), w.server(), R.NOSMCDDEV)


def test_foreign_gid_nosmcd2dev() -> None:
    w = World()
    other = LoopbackIsm(w.pool)
    client_facts = dataclasses.replace(w.facts, loopback=other.ism_device())
    run_declined_by_server(w, w.client(client_facts), w.server(), R.NOSMCD2DEV)


def test_gid_collision_without_pairing_is_refused() -> None:
    # a stranger whose daemon drew our GID: its client half is not in our pairing table
    w = World()
    c = w.client(register=False)
    run_declined_by_server(w, c, w.server(), R.NOSMCD2DEV)
    assert len(w.dev.pairing) == 0


def test_server_dmb_quota_max_dmb() -> None:
    w = World(user_max_buffers=1)
    hog = w.pool.register(1001, 16 * KIB)  # the server's user already owns its one DMB
    run_declined_by_server(w, w.client(), w.server(), R.MAX_DMB, in_use=1)
    assert w.dev.link_groups.find(w.dev.gid128) is None  # the new link group was dropped
    w.pool.unregister(hog.token)


def test_client_dmb_quota_max_dmb_releases_the_server_dmb() -> None:
    w = World(user_max_bytes=64 * KIB)
    hog = w.pool.register(1000, 64 * KIB)  # the client's user has no bytes left
    c, s = w.client(), w.server()
    _, accept, confirm = handshake(c, s)
    assert isinstance(clc.decode(accept), clc.Accept)
    assert only_decline(confirm).diagnosis == R.MAX_DMB
    assert assert_fallback(c, R.MAX_DMB).declined
    assert_fallback(s, R.PEERDECL, local=False, peer_diagnosis=R.MAX_DMB)
    assert w.pool.in_use_buffers == 1  # only the hog: the server's DMB went back
    w.pool.unregister(hog.token)


def test_syncerr_when_the_server_reuses_a_link_group_we_lack() -> None:
    pool = DmbPool()
    srv_dev = LoopbackIsm(pool, link_groups=LinkGroupTable())
    cli_dev = LoopbackIsm(
        pool, gid128=srv_dev.gid128, pairing=srv_dev.pairing, link_groups=LinkGroupTable()
    )
    srv_dev.link_groups.create(srv_dev.gid128)  # the server believes a link group exists
    eids = EidTable(["SMCD-TEST"])
    facts = NegotiationFacts(eids=eids, loopback=srv_dev.ism_device())
    srv_dev.pairing.register_client(CLIENT, SERVER)
    c = ClientNegotiation(facts, cli_dev.session(1000, CLIENT, SERVER, server=False))
    s = ServerNegotiation(facts, srv_dev.session(1001, SERVER, CLIENT, server=True))
    _, accept, confirm = handshake(c, s)
    assert not clc.decode(accept).first_contact  # type: ignore[union-attr]
    decl = only_decline(confirm)
    assert decl.diagnosis == R.SYNCERR and decl.out_of_sync
    assert_fallback(c, R.SYNCERR)
    out = assert_fallback(s, R.PEERDECL, local=False, peer_diagnosis=R.SYNCERR)
    assert out.out_of_sync
    assert pool.in_use_buffers == 0


def accept_for(w: World, c: ClientNegotiation, **change: object) -> bytes:
    """A real Accept for ``c``'s Proposal, with fields changed."""
    s = w.server()
    first = c.start().data
    acc = clc.decode(sent(feed(s, first)))
    assert isinstance(acc, clc.Accept)
    info_change = {k[5:]: v for k, v in change.items() if k.startswith("info_")}
    fce_change = {k[4:]: v for k, v in change.items() if k.startswith("fce_")}
    rest = {k: v for k, v in change.items() if not k.startswith(("info_", "fce_"))}
    info = dataclasses.replace(acc.info, **info_change)  # type: ignore[arg-type]
    fce = dataclasses.replace(acc.fce, **fce_change) if acc.fce and fce_change else acc.fce
    return dataclasses.replace(acc, info=info, fce=fce, **rest).encode()  # type: ignore[arg-type]


def test_accept_of_smcr_is_modeunsupp() -> None:
    w = World()
    c = w.client()
    c.start()
    smcr = clc.Accept(
        info=clc.SmcrInfo(
            peer_id=bytes(8),
            gid=bytes(16),
            mac=bytes(6),
            qpn=1,
            rmb_rkey=1,
            rmbe_alert_token=1,
            rmb_dma_addr=0,
            psn=0,
        ),
        version=2,
    )
    step = feed(c, smcr.encode())[-1]
    assert only_decline(step.data).diagnosis == R.MODEUNSUPP
    assert_fallback(c, R.MODEUNSUPP)


def test_accept_with_a_higher_release_is_versmismat() -> None:
    w = World()
    c = w.client()
    step = feed(c, accept_for(w, c, fce_release=2))[-1]
    assert only_decline(step.data).diagnosis == R.VERSMISMAT
    assert w.pool.in_use_buffers == 1  # the helper server's DMB only; the client took none


def test_accept_with_a_chid_never_offered_is_a_protocol_error() -> None:
    w = World()
    c = w.client()
    step = feed(c, accept_for(w, c, info_chid=0x1234))[-1]
    assert step.data == b""  # as the kernel: -EPROTO fails the connection, no Decline
    out = assert_fallback(c, DECL_PROTOCOL_ERROR)
    assert out.kernel_errno == errno.EPROTO and not out.declined


def test_accept_naming_an_unknown_dmb_is_mem() -> None:
    w = World()
    c = w.client()
    step = feed(c, accept_for(w, c, info_token=0x1234))[-1]
    assert only_decline(step.data).diagnosis == R.MEM
    assert assert_fallback(c, R.MEM).declined
    assert w.pool.in_use_buffers == 1  # our own DMB was returned


def test_confirm_with_another_release_is_releaseerr() -> None:
    w = World()
    c, s = w.client(), w.server()
    accept = clc.decode(sent(feed(s, c.start().data)))
    assert isinstance(accept, clc.Accept) and accept.fce is not None and accept.fce.release == 1
    client_dmb = w.pool.register(1000, 64 * KIB)

    def confirm(fce: clc.FirstContactExt, dmb: object = client_dmb) -> bytes:
        info = clc.SmcdInfo(
            gid=w.dev.gid,
            token=dmb.token,  # type: ignore[attr-defined]
            link_id=256,
            dmbe_size=dmb.size_comp,  # type: ignore[attr-defined]
            chid=0xFFFF,
            gid_ext=w.dev.gid_ext,
        )
        return clc.Confirm(info=info, first_contact=True, eid="SMCD-TEST", fce=fce).encode()

    # a Confirm carrying an FCE with release 0 although release 1 was accepted
    step = feed(s, confirm(clc.FirstContactExt(release=0, v2x=False)))[-1]
    assert only_decline(step.data).diagnosis == R.RELEASEERR
    assert_fallback(s, R.RELEASEERR)
    assert w.pool.in_use_buffers == 1  # only the client DMB we made for the test

    # the echoed release passes, and the Confirm's feature mask is taken
    w.dev.pairing.withdraw(CLIENT, SERVER)
    c, s = w.client(), w.server()
    accept = clc.decode(sent(feed(s, c.start().data)))
    assert isinstance(accept, clc.Accept) and isinstance(accept.info, clc.SmcdInfo)
    # the server half attaches only the DMB of a client half of this daemon that read its token
    half = w.dev.session(1000, CLIENT, SERVER, server=False)
    proven = half.register_dmb(64 * KIB, 16 * KIB)
    half.attach_dmb(accept.info.token)
    feed(s, confirm(clc.FirstContactExt(release=1, feature_mask=0), proven))
    out = s.outcome
    assert isinstance(out, SmcdLoopbackOutcome)
    assert (out.release, out.feature_mask, out.peer_token) == (1, 0, proven.token)


def proposal(w: World, **change: object) -> bytes:
    c = w.client()
    prop = clc.decode(c.start().data)
    return dataclasses.replace(prop, **change).encode()  # type: ignore[arg-type]


def test_smcr_v2_with_too_few_connections_is_maxconnerr() -> None:
    w = World()
    base = clc.decode(proposal(w))
    assert isinstance(base, clc.Proposal) and base.v2_ext is not None
    data = dataclasses.replace(
        base,
        typev2=clc.SmcType.B,
        v2_ext=dataclasses.replace(base.v2_ext, max_conns=10, max_links=2),
    ).encode()
    s = w.server()
    assert only_decline(feed(s, data)[-1].data).diagnosis == R.MAXCONNERR
    s = w.server()
    data = dataclasses.replace(
        base,
        typev2=clc.SmcType.B,
        v2_ext=dataclasses.replace(base.v2_ext, max_conns=255, max_links=0),
    ).encode()
    assert only_decline(feed(s, data)[-1].data).diagnosis == R.MAXLINKERR


def test_proposal_without_any_path_is_peernosmc() -> None:
    w = World()
    data = proposal(w, typev2=clc.SmcType.N, v2_ext=None, smcd_v2_ext=None)
    s = w.server()
    assert only_decline(feed(s, data)[-1].data).diagnosis == R.PEERNOSMC


def test_v1_proposals_find_no_v1_device() -> None:
    from ipaddress import IPv4Network

    w = World()
    prefixes = clc.IpPrefixes(IPv4Network("127.0.0.0/8"))
    v1d = clc.Proposal(typev1=clc.SmcType.D, typev2=clc.SmcType.N, version=1, ip_prefixes=prefixes)
    s = w.server()
    decl = only_decline(feed(s, v1d.encode())[-1].data)
    assert (decl.diagnosis, decl.version) == (R.NOSMCDDEV, 1)
    v1r = dataclasses.replace(v1d, typev1=clc.SmcType.R)
    s = w.server()
    assert only_decline(feed(s, v1r.encode())[-1].data).diagnosis == R.NOSMCDEV
    s = w.server(dataclasses.replace(w.facts, prefix_match=False))
    assert only_decline(feed(s, v1d.encode())[-1].data).diagnosis == R.DIFFPREFIX


def test_declines_from_the_peer_at_every_step() -> None:
    w = World()
    decline = clc.Decline(diagnosis=0x09990000, version=2, out_of_sync=True).encode()
    c = w.client()
    c.start()
    feed(c, decline)
    out = assert_fallback(c, R.PEERDECL, local=False, peer_diagnosis=0x09990000)
    assert out.out_of_sync and not out.declined
    # server after its Accept: its DMB and the new link group go back
    w.dev.pairing.withdraw(CLIENT, SERVER)
    c, s = w.client(), w.server()
    feed(s, c.start().data)
    assert w.pool.in_use_buffers == 1
    feed(s, clc.Decline(diagnosis=R.MAX_DMB, version=1, diagnosis_v2=()).encode())
    assert_fallback(s, R.PEERDECL, local=False, peer_diagnosis=R.MAX_DMB)
    assert w.pool.in_use_buffers == 0 and w.dev.link_groups.find(w.dev.gid128) is None


# ---- hostile and broken peers --------------------------------------------------------------


def check_never_raises(
    make: Callable[[], ClientNegotiation | ServerNegotiation], good: bytes, w: World
) -> int:
    """Flip every byte of ``good`` (to two values), truncate it at every length, and feed each
    variant: no exception; a fallback declines (except after a peer Decline); resources return."""
    baseline = w.pool.in_use_buffers
    fallbacks = 0
    variants = [good[:i] for i in range(len(good))]
    for i in range(len(good)):
        for x in (0xFF, 0x01):
            variants.append(good[:i] + bytes([good[i] ^ x]) + good[i + 1 :])
    for data in variants:
        neg = make()
        steps = feed(neg, data)
        if not neg.done:
            step = neg.on_eof() if len(data) % 2 else neg.on_timeout()
            steps.append(step)
        out = neg.outcome
        assert out is not None
        if isinstance(out, FallbackOutcome):
            fallbacks += 1
            if out.reason == R.PEERDECL or out.kernel_errno is not None:
                # the kernel's errors (EPROTO, ETIMEDOUT, ECONNRESET) send no Decline
                assert not out.declined and steps[-1].data == b"", out
            else:
                assert out.declined
                decl = only_decline(steps[-1].data)
                assert decl.diagnosis == out.reason
            if out.kernel_errno == errno.ETIMEDOUT:
                assert out.reason == DECL_CLC_TIMEOUT
        else:
            release_smcd(w, neg)
        assert w.pool.in_use_buffers == baseline, data.hex()
    return fallbacks


def release_smcd(w: World, neg: ClientNegotiation | ServerNegotiation) -> None:
    out = neg.outcome
    assert isinstance(out, SmcdLoopbackOutcome)
    w.pool.detach(out.peer_token)
    w.pool.unregister(out.local_token)


def test_client_survives_every_mangled_accept() -> None:
    w = World()
    c0, s0 = w.client(), w.server()
    first = c0.start().data
    good = sent(feed(s0, first))
    w.dev.link_groups = LinkGroupTable()  # the client will create its own link group

    def make() -> ClientNegotiation:
        c = w.client()
        c.start()
        return c

    assert check_never_raises(make, good, w) > len(good)


def test_server_survives_every_mangled_proposal() -> None:
    w = World()
    good = w.client().start().data

    def make() -> ServerNegotiation:
        w.dev.link_groups = LinkGroupTable()
        w.dev.pairing.register_client(CLIENT, SERVER)
        return w.server()

    assert check_never_raises(make, good, w) > len(good)


def test_server_survives_every_mangled_confirm() -> None:
    w = World()
    w.dev.pairing.register_client(CLIENT, SERVER)
    c0 = w.client()
    s0 = w.server()
    first = c0.start().data
    accept = sent(feed(s0, first))
    good = sent(feed(c0, accept))
    assert isinstance(c0.outcome, SmcdLoopbackOutcome)
    # keep the client's DMB alive so a good Confirm can attach it; count it in the baseline

    def make() -> ServerNegotiation:
        w.dev.pairing.register_client(CLIENT, SERVER)
        s = w.server()
        assert isinstance(clc.decode(sent(feed(s, first))), clc.Accept)
        return s

    base = w.pool.in_use_buffers
    for data in [good[:i] for i in range(len(good))] + [
        good[:i] + bytes([good[i] ^ 0xFF]) + good[i + 1 :] for i in range(len(good))
    ]:
        s = make()
        steps = feed(s, data)
        if not s.done:
            steps.append(s.on_timeout())
        out = s.outcome
        if isinstance(out, SmcdLoopbackOutcome):
            w.pool.detach(out.peer_token)
            w.pool.unregister(out.local_token)
        else:
            assert isinstance(out, FallbackOutcome)
            if out.kernel_errno is not None:
                assert steps[-1].data == b"" and not out.declined, out
            elif out.reason != R.PEERDECL:
                assert only_decline(steps[-1].data).diagnosis == out.reason
        assert w.pool.in_use_buffers == base


def test_wrong_message_type_is_a_protocol_error_after_eight_bytes() -> None:
    w = World()
    s = w.server()
    confirm_hdr = clc.Confirm(
        info=clc.SmcdInfo(gid=1, token=1, link_id=1, chid=0xFFFF, gid_ext=1)
    ).encode()
    steps = feed(s, confirm_hdr)
    assert len(steps) == 1  # decided on the header, nothing more consumed
    assert steps[0].data == b""  # no Decline: the kernel fails the connection with EPROTO
    assert assert_fallback(s, DECL_PROTOCOL_ERROR).kernel_errno == errno.EPROTO


def test_timeout_and_eof() -> None:
    w = World()
    c = w.client()
    c.start()
    assert c.timeout == 6.0 and c.bytes_needed == 8
    step = c.on_timeout()
    assert step.data == b""  # no Decline: the kernel fails the connection with ETIMEDOUT
    assert DECL_CLC_TIMEOUT == 0x02000000
    assert assert_fallback(c, DECL_CLC_TIMEOUT).kernel_errno == errno.ETIMEDOUT
    s = w.server()
    feed(s, b"\xe2\xd4\xc3")
    step = s.on_eof()
    assert step.data == b""
    assert assert_fallback(s, DECL_PROTOCOL_ERROR).kernel_errno == errno.ECONNRESET
    assert s.timeout is None and s.bytes_needed == 0


def test_driver_misuse_is_a_negotiation_error() -> None:
    w = World()
    c = w.client()
    with pytest.raises(NegotiationError):
        c.receive_data(b"x")
    c.start()
    with pytest.raises(NegotiationError):
        c.start()
    with pytest.raises(NegotiationError):
        c.receive_data(bytes(9))  # more than bytes_needed
    step = c.abort("application gone")
    assert only_decline(step.data).diagnosis == R.INTERR
    with pytest.raises(NegotiationError):
        c.on_timeout()
    with pytest.raises(NegotiationError):
        c.abort()


@pytest.mark.parametrize(
    ("peeked", "verdict"),
    [
        (b"", "need-more"),
        (b"\xe2", "need-more"),
        (b"\xe2\xd4\xc3", "need-more"),
        (b"\xe2\xd4\xc3\xd9", "smc"),
        (b"\xe2\xd4\xc3\xc4\x04", "smc"),
        (b"\xe2\xd4\xc3\xd9\x01\x00\x58\x20rest", "smc"),
        (b"GET / HTTP/1.1\r\n", "not-smc"),
        (b"\xe2\xd5", "not-smc"),
        (b"\xe2\xd4\xc3\xd8", "not-smc"),
        (b"\x00", "not-smc"),
    ],
)
def test_classify_first_bytes(peeked: bytes, verdict: str) -> None:
    assert classify_first_bytes(peeked) == verdict
