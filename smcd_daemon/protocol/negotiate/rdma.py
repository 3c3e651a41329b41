"""SMC-R v1 and v2 over RoCE: the client's devices for a Proposal and its handling of an SMC-R
Accept, the server's RDMA v2 and v1 device finders and its Confirm check, and the link group
reuse rule (``smc_find_proposal_devices``, ``smc_connect_rdma``,
``smc_find_rdma_v2_device_serv``, ``smc_find_rdma_v1_device_serv``, ``smc_listen_rdma_init``,
``smc_conn_create`` with ``smcr_lgr_match``).

Device and path choice is :mod:`smcd_daemon.protocol.smcr_route`'s; its explanations go into
the negotiation's ``why_not`` and from there into every decline's detail."""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass

from smcd_daemon.errors import SmcError
from smcd_daemon.protocol.linkgroup import Role
from smcd_daemon.protocol.negotiate.base import Ledger, reason_of
from smcd_daemon.protocol.negotiate.facts import (
    IB_MTU_MAX,
    IB_MTU_MIN,
    LinkGroupRequest,
    LinkGroupView,
    LinkView,
    Offer,
    RmbGrant,
    SmcrFacts,
    common_ueid,
    eid_field,
    uncompress_bufsize,
)
from smcd_daemon.protocol.negotiate.outcome import Refusal, SmcrOutcome, violation
from smcd_daemon.protocol.negotiate.v2x import (
    Agreed,
    clnt_v2x_features_validate,
    smcr_fce,
    v2x_features_confirm_check,
)
from smcd_daemon.protocol.smcr_route import Decline as RouteDecline
from smcd_daemon.protocol.smcr_route import (
    GidChoice,
    SmcrChoice,
    check_accept_path,
    choose_smcr_v1,
    choose_smcr_v2_client,
    choose_smcr_v2_server,
    determine_gid,
    mac_bytes,
)
from smcd_daemon.wire.clc import MAX_GID_LIST, Accept, Confirm, Proposal, SmcrInfo
from smcd_daemon.wire.reasons import DeclineReason

__all__ = [
    "RdmaAccepted",
    "confirm_rdma",
    "connect_rdma",
    "find_link_group",
    "find_rdma_v1_device_serv",
    "find_rdma_v2_device_serv",
    "local_mac",
    "proposal_devices",
]

_RMBE_IDX = 1  # "for now: 1 RMB = 1 RMBE" (smc_clc_send_confirm_accept)


def find_link_group(
    groups: Iterable[LinkGroupView],
    *,
    role: Role,
    version: int,
    peer_system_id: bytes,
    peer_gid: bytes,
    peer_mac: bytes,
    vlan_id: int,
    clc_qpn: int | None = None,
) -> tuple[LinkGroupView, LinkView] | None:
    """``smc_conn_create``'s search with ``smcr_lgr_match``: same peer system id, role and
    version, an active link to the peer's GID (and MAC for v1; the client also needs the link's
    peer QPN to be the Accept's), same VLAN, not terminating; the server also needs room
    (below max_conns, an rtoken slot free). Returns the group and the matching link."""
    for g in groups:
        if g.role != role or g.version != version or g.peer_system_id != peer_system_id:
            continue
        if g.sync_err or g.vlan_id != vlan_id:
            continue
        if role == Role.SERVER and (g.conns >= g.max_conns or g.rtokens_full):
            continue
        for lk in g.links:
            if not lk.active or lk.peer_gid != peer_gid:
                continue
            if role == Role.CLIENT and lk.peer_qpn != clc_qpn:
                continue
            if version == 1 and lk.peer_mac != peer_mac:
                continue
            return g, lk
    return None


def local_mac(f: SmcrFacts, choice: SmcrChoice) -> bytes:
    """The MAC of the netdev behind the chosen GID (zeros when unknown)."""
    dev = f.routing.netdev_by_name(choice.gid.netdev)
    mac = mac_bytes(dev.mac) if dev is not None else None
    return mac if mac is not None else bytes(6)


def _info(
    offer: Offer, choice: SmcrChoice, mac: bytes, qpn: int, psn: int, mtu: int, grant: RmbGrant
) -> SmcrInfo:
    return SmcrInfo(
        peer_id=offer.system_id,
        gid=choice.gid.gid,
        mac=mac,
        qpn=qpn,
        rmb_rkey=grant.rkey,
        rmbe_alert_token=grant.alert_token,
        rmb_dma_addr=grant.vaddr,
        psn=psn,
        rmbe_idx=_RMBE_IDX,
        rmbe_size=grant.size_comp,
        qp_mtu=mtu,
    )


def _check_mtu(mtu: int, who: str) -> None:
    if not IB_MTU_MIN <= mtu <= IB_MTU_MAX:
        raise Refusal(
            DeclineReason.ERR_RDYLNK,
            f"{who} QP MTU enum {mtu} is not 1..5 (256..4096 bytes); the QP cannot be readied",
        )


def _reused(choice: SmcrChoice, gid: bytes) -> SmcrChoice:
    """The choice as the reused link has it (its GID may be another port's)."""
    if choice.gid.gid == gid:
        return choice
    g = choice.gid
    return SmcrChoice(
        GidChoice(g.device, g.port, g.gid_index, gid, g.netdev, g.route),
        choice.v2_direct,
        choice.nexthop_mac,
        choice.negotiated_eid,
    )


def _rdma(offer: Offer) -> SmcrFacts:
    assert offer.rdma is not None
    return offer.rdma


# ---------------------------------------------------------------------------- client
def proposal_devices(
    f: SmcrFacts, why_not: list[str]
) -> tuple[SmcrChoice | None, SmcrChoice | None]:
    """``smc_find_proposal_devices`` for SMC-R: the v1 and v2 ports we can offer, and why not."""
    v1 = v2 = None
    if not f.smcr_v1:
        why_not.append("SMC-Rv1 is disabled here (modes.smcr_v1)")
    else:
        # the kernel looks for the device first and sets the Proposal's prefix afterwards
        got = choose_smcr_v1(f.ports, f.vlan_id, f.routing)
        if isinstance(got, RouteDecline):
            why_not.append(f"SMC-Rv1: {got.explanation}")
        elif f.ip_prefixes is None:
            why_not.append(
                f"SMC-Rv1: no address of the connection's interface has a subnet containing "
                f"its source {f.local_addr}, so the Proposal can carry no IP prefix"
            )
        else:
            v1 = got
    if not f.smcr_v2:
        why_not.append("SMC-Rv2 is disabled here (modes.smcr_v2)")
    else:
        got = choose_smcr_v2_client(
            f.ports, f.vlan_id, f.local_addr, f.routing, ueid_count=len(f.eids.ueids)
        )
        if isinstance(got, RouteDecline):
            why_not.append(f"SMC-Rv2: {got.explanation}")
        else:
            v2 = got
    return v1, v2


def _gid_list(f: SmcrFacts, choice: SmcrChoice) -> tuple[bytes, ...]:
    """``smc_fill_gid_list``: our link's RoCEv2 GID and one of another port that fits."""
    out = [choice.gid.gid]
    saddr = f.local_addr
    if isinstance(saddr, ipaddress.IPv4Address):
        for port in f.ports:
            if (port.device, port.num) == (choice.gid.device, choice.gid.port):
                continue
            got = determine_gid(port, f.vlan_id, f.routing, v2=True, saddr=saddr)
            if isinstance(got, GidChoice) and got.gid not in out:
                out.append(got.gid)
                break
    return tuple(out[:MAX_GID_LIST])


def connect_rdma(
    offer: Offer, ledger: Ledger, msg: Accept, choice: SmcrChoice
) -> tuple[Confirm, SmcrOutcome]:
    """``smc_connect_rdma``: the client's answer to an SMC-R Accept (``choice`` is the port we
    offered for its version)."""
    f = _rdma(offer)
    info = msg.info
    assert isinstance(info, SmcrInfo) and ledger.rdma is not None
    version = 1 if msg.version == 1 else 2
    agreed = Agreed(0, 0, f.max_conns, f.max_links)
    v2_direct, nexthop = False, None
    if version == 2 and msg.first_contact:
        fce = msg.fce
        assert fce is not None
        saddr = f.local_addr
        assert isinstance(saddr, ipaddress.IPv4Address)  # v2 is offered over IPv4 only
        path = check_accept_path(fce.v2_direct, saddr, info.gid, info.mac, f.routing)
        if isinstance(path, RouteDecline):
            raise Refusal(path.code, path.explanation)
        v2_direct, nexthop = not path.uses_gateway, path.nexthop_mac
        agreed = clnt_v2x_features_validate(
            fce, smcr=True, max_conns=f.max_conns, max_links=f.max_links
        )
    mac = local_mac(f, choice)
    # smc_conn_create (client): a new link group iff the server says first contact
    if msg.first_contact:
        _check_mtu(info.qp_mtu, "the server's")
        first = ledger.create_link_group(
            LinkGroupRequest(
                role=Role.CLIENT,
                version=version,
                peer_system_id=info.peer_id,
                peer_gid=info.gid,
                peer_mac=info.mac,
                vlan_id=f.vlan_id,
                local=choice.gid,
                local_mac=mac,
                max_conns=agreed.max_conns,
                max_links=agreed.max_links,
                release=agreed.release,
                uses_gateway=version == 2 and not v2_direct,
                nexthop_mac=nexthop,
            )
        )
        lgr_id, link_id, qpn, psn = first.lgr_id, first.link_id, first.qpn, first.psn
        mtu = min(first.mtu, info.qp_mtu)
        local = choice
    else:
        found = find_link_group(
            ledger.rdma.link_groups(),
            role=Role.CLIENT,
            version=version,
            peer_system_id=info.peer_id,
            peer_gid=info.gid,
            peer_mac=info.mac,
            vlan_id=f.vlan_id,
            clc_qpn=info.qpn,
        )
        if found is None:
            raise Refusal(
                DeclineReason.SYNCERR,
                f"the peer reuses a link group (its QP {info.qpn:#x}) that we do not have",
            )
        group, link = found
        lgr_id, link_id, qpn, psn, mtu = group.lgr_id, link.link_id, link.qpn, link.psn, link.mtu
        ledger.reuse_link_group(lgr_id)
        local, mac = _reused(choice, link.gid), link.mac
    grant = ledger.allocate_rmb(lgr_id, link_id, f.rmb_size)
    first_v2 = version == 2 and msg.first_contact
    confirm = Confirm(
        info=_info(offer, local, mac, qpn, psn, mtu, grant),
        version=version,
        first_contact=msg.first_contact,
        eid=msg.eid if version == 2 else "",
        fce=smcr_fce(offer.hostname, agreed, v2_direct) if first_v2 else None,
        gid_list=_gid_list(f, choice) if first_v2 else (),
    )
    outcome = SmcrOutcome(
        role=Role.CLIENT,
        version=version,
        lgr_id=lgr_id,
        link_id=link_id,
        first_contact=msg.first_contact,
        peer_first_contact=msg.first_contact,
        peer_system_id=info.peer_id,
        peer_gid=info.gid,
        peer_mac=info.mac,
        peer_qpn=info.qpn,
        peer_psn=info.psn,
        peer_mtu=info.qp_mtu,
        peer_rmb_rkey=info.rmb_rkey,
        peer_rmb_vaddr=info.rmb_dma_addr,
        peer_rmbe_size=uncompress_bufsize(info.rmbe_size),
        peer_alert_token=info.rmbe_alert_token,
        local=local,
        local_mac=mac,
        local_rkey=grant.rkey,
        local_vaddr=grant.vaddr,
        local_rmbe_size=grant.size,
        alert_token=grant.alert_token,
        qp_mtu=mtu,
        vlan_id=f.vlan_id,
        v2_direct=v2_direct,
        nexthop_mac=nexthop,
        negotiated_eid=msg.eid if version == 2 else "",
        release=agreed.release,
        max_conns=agreed.max_conns,
        max_links=agreed.max_links,
        feature_mask=agreed.feature_mask,
        peer_hostname=msg.fce.hostname if msg.fce is not None else "",
    )
    return confirm, outcome


# ---------------------------------------------------------------------------- server
@dataclass(frozen=True)
class RdmaAccepted:
    """What a server's SMC-R Accept promised, for the Confirm."""

    version: int
    lgr_id: int
    link_id: int
    first_contact: bool
    choice: SmcrChoice
    mac: bytes
    mtu: int
    grant: RmbGrant
    agreed: Agreed
    eid: str
    peer_system_id: bytes


def find_rdma_v2_device_serv(
    offer: Offer,
    ledger: Ledger,
    p: Proposal,
    agreed: Agreed,
    store: list[int],
    why_not: list[str],
) -> tuple[Accept, RdmaAccepted] | None:
    """``smc_find_rdma_v2_device_serv``: a UEID in common (no code stored when there is none),
    then a RoCE v2 port with a path to the peer (NOSMCRDEV), then link group and RMB."""
    v2 = p.v2_ext
    assert v2 is not None
    f = offer.rdma
    if f is None:  # no RoCE here at all
        if common_ueid(v2.eids, offer.eids.ueids) is not None:
            store.append(DeclineReason.NOSMCRDEV)
            why_not.append("SMC-Rv2: no RoCE device here")
        return None
    if not f.smcr_v2:
        store.append(DeclineReason.NOSMCRDEV)
        why_not.append("SMC-Rv2 is disabled here (modes.smcr_v2)")
        return None
    got = choose_smcr_v2_server(
        f.ports,
        f.vlan_id,
        f.local_addr,
        v2.roce_gid,
        p.mac,
        f.routing,
        local_ueids=f.eids.ueids_wire(),
        peer_ueids=tuple(eid_field(e) for e in v2.eids),
    )
    if isinstance(got, RouteDecline):
        if got.code != DeclineReason.NOUEID:  # the kernel stores no code for a mismatch
            store.append(got.code)
        why_not.append(f"SMC-Rv2: {got.explanation}")
        return None
    eid = (got.negotiated_eid or b"").rstrip(b" \0").decode("ascii", "replace")
    return _listen_rdma_init(offer, ledger, p, 2, got, v2.roce_gid, agreed, eid, store, why_not)


def find_rdma_v1_device_serv(
    offer: Offer,
    ledger: Ledger,
    p: Proposal,
    smcr_v1: bool,
    store: list[int],
    why_not: list[str],
) -> tuple[Accept, RdmaAccepted] | None:
    """``smc_find_rdma_v1_device_serv``: NOSMCDEV whenever there is no v1 path."""
    f = offer.rdma
    if f is None:
        store.append(DeclineReason.NOSMCDEV)
        if smcr_v1:
            why_not.append("SMC-Rv1: no RoCE device here")
        return None
    if not smcr_v1:
        store.append(DeclineReason.NOSMCDEV)
        why_not.append("SMC-Rv1: the peer does not offer it")
        return None
    if not f.smcr_v1:
        store.append(DeclineReason.NOSMCDEV)
        why_not.append("SMC-Rv1 is disabled here (modes.smcr_v1)")
        return None
    got = choose_smcr_v1(f.ports, f.vlan_id, f.routing)
    if isinstance(got, RouteDecline):
        store.append(DeclineReason.NOSMCDEV)
        why_not.append(f"SMC-Rv1: {got.explanation}")
        return None
    agreed = Agreed(0, 0, f.max_conns, f.max_links)
    return _listen_rdma_init(offer, ledger, p, 1, got, p.gid, agreed, "", store, why_not)


def _listen_rdma_init(
    offer: Offer,
    ledger: Ledger,
    p: Proposal,
    version: int,
    choice: SmcrChoice,
    peer_gid: bytes,
    agreed: Agreed,
    eid: str,
    store: list[int],
    why_not: list[str],
) -> tuple[Accept, RdmaAccepted] | None:
    """``smc_listen_rdma_init`` + ``smc_listen_rdma_reg``: link group (reuse or first
    contact) and RMB; a failure stores its code and leaves nothing behind."""
    f = _rdma(offer)
    assert ledger.rdma is not None
    mac = local_mac(f, choice)
    try:
        found = find_link_group(
            ledger.rdma.link_groups(),
            role=Role.SERVER,
            version=version,
            peer_system_id=p.peer_id,
            peer_gid=peer_gid,
            peer_mac=p.mac,
            vlan_id=f.vlan_id,
        )
        if found is not None:
            group = found[0]
            try:
                link_id = ledger.rdma.pick_link(group.lgr_id)
            except SmcError as exc:
                code = reason_of(exc, DeclineReason.NOACTLINK)
                raise Refusal(code, f"no active link in link group {group.lgr_id}") from exc
            link = next((lk for lk in group.links if lk.link_id == link_id), None)
            if link is None:
                raise Refusal(DeclineReason.NOACTLINK, f"link {link_id} of {group.lgr_id} is gone")
            lgr_id, first_contact = group.lgr_id, False
            ledger.reuse_link_group(lgr_id)
            qpn, psn, mtu, mac = link.qpn, link.psn, link.mtu, link.mac
            choice = _reused(choice, link.gid)
        else:
            first = ledger.create_link_group(
                LinkGroupRequest(
                    role=Role.SERVER,
                    version=version,
                    peer_system_id=p.peer_id,
                    peer_gid=peer_gid,
                    peer_mac=p.mac,
                    vlan_id=f.vlan_id,
                    local=choice.gid,
                    local_mac=mac,
                    max_conns=agreed.max_conns,
                    max_links=agreed.max_links,
                    release=agreed.release,
                    uses_gateway=version == 2 and not choice.v2_direct,
                    nexthop_mac=choice.nexthop_mac,
                )
            )
            lgr_id, link_id, first_contact = first.lgr_id, first.link_id, True
            qpn, psn, mtu = first.qpn, first.psn, first.mtu
        grant = ledger.allocate_rmb(lgr_id, link_id, f.rmb_size)
    except Refusal as r:
        ledger.release()
        store.append(r.code)
        why_not.append(f"SMC-Rv{version}: {r.detail}")
        return None
    fce = None
    if version == 2 and first_contact:
        fce = smcr_fce(offer.hostname, agreed, choice.v2_direct)
    accept = Accept(
        info=_info(offer, choice, mac, qpn, psn, mtu, grant),
        version=version,
        first_contact=first_contact,
        eid=eid,
        fce=fce,
    )
    accepted = RdmaAccepted(
        version, lgr_id, link_id, first_contact, choice, mac, mtu, grant, agreed, eid, p.peer_id
    )
    return accept, accepted


def confirm_rdma(offer: Offer, acc: RdmaAccepted, c: Confirm) -> SmcrOutcome:
    """``smc_listen_rdma_finish``'s checks: the client's Confirm of what we accepted."""
    info = c.info
    if not isinstance(info, SmcrInfo) or (1 if c.version == 1 else 2) != acc.version:
        raise violation(f"the Confirm is not the SMC-Rv{acc.version} we accepted")
    feature_mask = v2x_features_confirm_check(c, acc.agreed, smcr=True)
    if acc.first_contact:
        _check_mtu(info.qp_mtu, "the client's")
    v2 = acc.version == 2
    return SmcrOutcome(
        role=Role.SERVER,
        version=acc.version,
        lgr_id=acc.lgr_id,
        link_id=acc.link_id,
        first_contact=acc.first_contact,
        peer_first_contact=c.first_contact,
        peer_system_id=acc.peer_system_id,
        peer_gid=info.gid,
        peer_mac=info.mac,
        peer_qpn=info.qpn,
        peer_psn=info.psn,
        peer_mtu=info.qp_mtu,
        peer_rmb_rkey=info.rmb_rkey,
        peer_rmb_vaddr=info.rmb_dma_addr,
        peer_rmbe_size=uncompress_bufsize(info.rmbe_size),
        peer_alert_token=info.rmbe_alert_token,
        local=acc.choice,
        local_mac=acc.mac,
        local_rkey=acc.grant.rkey,
        local_vaddr=acc.grant.vaddr,
        local_rmbe_size=acc.grant.size,
        alert_token=acc.grant.alert_token,
        qp_mtu=min(acc.mtu, info.qp_mtu) if acc.first_contact else acc.mtu,
        vlan_id=_rdma(offer).vlan_id,
        v2_direct=acc.choice.v2_direct if v2 else False,
        nexthop_mac=acc.choice.nexthop_mac if v2 else None,
        negotiated_eid=acc.eid,
        release=acc.agreed.release if acc.first_contact else 0,
        max_conns=acc.agreed.max_conns,
        max_links=acc.agreed.max_links,
        feature_mask=feature_mask if v2 else 0,
        peer_gid_list=c.gid_list,
        peer_hostname=c.fce.hostname if c.fce is not None else "",
    )
