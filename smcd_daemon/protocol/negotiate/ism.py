"""SMC-Dv2 over loopback-ism, our one ISM device: the server's device finder and Confirm check,
the client's handling of an SMC-D Accept (``smc_find_ism_v2_device_serv``,
``smc_check_ism_v2_match``, ``smc_clc_match_eid``, ``smc_connect_ism``, ``smc_conn_create``).

Unlike the kernel, the two ends are two daemons' halves of one host: "the device can talk to the
peer" means the peer's GID is our own loopback GID *and* this daemon holds the other half of this
TCP connection (the pairing check of the resources)."""

from __future__ import annotations

from dataclasses import dataclass

from smcd_daemon.protocol.negotiate.base import Ledger
from smcd_daemon.protocol.negotiate.facts import (
    DmbGrant,
    NegotiationFacts,
    Offer,
    common_ueid,
    uncompress_bufsize,
)
from smcd_daemon.protocol.negotiate.outcome import Refusal, SmcdLoopbackOutcome, violation
from smcd_daemon.protocol.negotiate.v2x import (
    Agreed,
    clnt_v2x_features_validate,
    smcd_fce,
    v2x_features_confirm_check,
)
from smcd_daemon.wire.clc import Accept, Confirm, IsmDevice, Proposal, SmcdInfo
from smcd_daemon.wire.reasons import DeclineReason

__all__ = [
    "IsmAccepted",
    "confirm_ism",
    "connect_ism",
    "encode_smcd",
    "find_ism_v2_device_serv",
    "match_eid",
]

_TOKEN_AT = 16
"""Offset of the DMB token in an SMC-D Accept/Confirm (header 8, GID 8)."""
_TEMPLATES: dict[tuple[object, ...], bytes] = {}


def encode_smcd(msg: Accept | Confirm) -> bytes:
    """``msg.encode()`` of an SMC-D Accept or Confirm, from a template of every field but the DMB
    token: a host's handshakes differ only in the token (and the link group), and the full
    encoder's checks cost more than the rest of the message. The template itself comes from
    the full encoder (a message it refuses is never cached)."""
    info = msg.info
    assert isinstance(info, SmcdInfo)
    token = info.token
    if not 0 <= token < 1 << 64:
        return msg.encode()  # the full encoder says why not
    key = (
        type(msg), msg.version, msg.first_contact, msg.eid, msg.fce, msg.gid_list,
        info.gid, info.link_id, info.dmbe_idx, info.dmbe_size, info.chid, info.gid_ext,
    )  # fmt: skip
    raw = token.to_bytes(8, "big")
    tmpl = _TEMPLATES.get(key)
    if tmpl is not None:
        return tmpl[:_TOKEN_AT] + raw + tmpl[_TOKEN_AT + 8 :]
    full = msg.encode()
    if full[_TOKEN_AT : _TOKEN_AT + 8] == raw:  # the layout this relies on
        if len(_TEMPLATES) >= 256:
            _TEMPLATES.clear()
        _TEMPLATES[key] = full
    return full


@dataclass(frozen=True)
class IsmAccepted:
    """What a server's SMC-D Accept promised, for the Confirm."""

    grant: DmbGrant
    link_id: int
    first_contact: bool
    eid: str
    agreed: Agreed


def _device(offer: Offer) -> tuple[NegotiationFacts, IsmDevice]:
    ism = offer.ism
    assert ism is not None and ism.loopback is not None and ism.loopback.gid_ext is not None
    return ism, ism.loopback


def _info(dev: IsmDevice, grant: DmbGrant, link_id: int) -> SmcdInfo:
    assert dev.gid_ext is not None
    return SmcdInfo(
        gid=dev.gid,
        token=grant.token,
        link_id=link_id,
        dmbe_size=grant.size_comp,
        chid=dev.chid,
        gid_ext=dev.gid_ext,
    )


def match_eid(offer: Offer, p: Proposal) -> str | None:
    """``smc_clc_match_eid``: the SEID if both offer the same one, else the first of the peer's
    UEIDs that we have."""
    assert p.v2_ext is not None and p.smcd_v2_ext is not None
    eids = offer.eids
    seid = eids.seid if eids.seid_enabled else None
    if seid and p.v2_ext.seid_indicator and p.smcd_v2_ext.seid == seid:
        return seid
    return common_ueid(p.v2_ext.eids, eids.ueids)


def find_ism_v2_device_serv(
    offer: Offer,
    ledger: Ledger,
    p: Proposal,
    agreed: Agreed,
    store: list[int],
    why_not: list[str],
) -> tuple[Accept, IsmAccepted] | None:
    """``smc_find_ism_v2_device_serv`` for loopback-ism: an Accept, or None with the reason
    stored (the kernel's ``ini->rc``, first stored wins) and nothing held."""
    ism, dev = _device(offer)
    if p.smcd_v2_ext is None or p.v2_ext is None:
        return None
    assert ledger.ism is not None
    offered = [d for d in p.smcd_v2_ext.devices if d.chid == dev.chid]
    if not any(d.gid128 == dev.gid128 for d in offered) or not ledger.ism.pairing_verified():
        store.append(DeclineReason.NOSMCD2DEV)
        why_not.append(
            "SMC-Dv2: the peer's loopback-ism is not ours or the pairing is not verified"
        )
        return None
    eid = match_eid(offer, p)
    if eid is None:  # the kernel stores no code here
        why_not.append("SMC-Dv2: the peer's EIDs and ours have none in common")
        return None
    link_id, first_contact = ledger.ism_link_group(dev.gid128)
    try:
        grant = ledger.register_dmb(ism.dmb_size, ism.min_dmb_size)
    except Refusal as r:
        ledger.release()
        store.append(r.code)
        why_not.append(f"SMC-Dv2: {r.detail}")
        return None
    accept = Accept(
        info=_info(dev, grant, link_id),
        version=2,
        first_contact=first_contact,
        eid=eid,
        fce=smcd_fce(offer.hostname, agreed.release, agreed.feature_mask)
        if first_contact
        else None,
    )
    return accept, IsmAccepted(grant, link_id, first_contact, eid, agreed)


def confirm_ism(offer: Offer, ledger: Ledger, acc: IsmAccepted, c: Confirm) -> SmcdLoopbackOutcome:
    """The server's last step: the client's Confirm names its DMB on our device."""
    info = c.info
    if not isinstance(info, SmcdInfo) or c.version == 1:
        raise violation("the Confirm is not SMC-Dv2, which we accepted")
    feature_mask = v2x_features_confirm_check(c, acc.agreed, smcr=False)
    release = acc.agreed.release
    _, dev = _device(offer)
    if info.chid != dev.chid or info.gid128 != dev.gid128:
        raise violation("the Confirm names another device than the one proposed")
    ledger.attach_dmb(info.token, info.dmbe_size)
    if not (acc.first_contact or c.first_contact):
        release = feature_mask = 0  # a reused link group: no FCE was exchanged
    return SmcdLoopbackOutcome(
        peer_gid=info.gid128,
        peer_token=info.token,
        local_token=acc.grant.token,
        local_dmb_size=acc.grant.size,
        peer_dmb_size=uncompress_bufsize(info.dmbe_size),
        link_id=acc.link_id,
        first_contact=acc.first_contact,
        peer_first_contact=c.first_contact,
        negotiated_eid=acc.eid,
        release=release,
        feature_mask=feature_mask,
    )


def connect_ism(offer: Offer, ledger: Ledger, msg: Accept) -> tuple[Confirm, SmcdLoopbackOutcome]:
    """``smc_connect_ism``: the client's answer to an SMC-Dv2 Accept."""
    info = msg.info
    assert isinstance(info, SmcdInfo)
    release, feature_mask = 0, 0
    if msg.first_contact:
        assert msg.fce is not None
        agreed = clnt_v2x_features_validate(msg.fce, smcr=False, max_conns=0, max_links=0)
        release, feature_mask = agreed.release, agreed.feature_mask
    ism, dev = _device(offer)
    # smc_v2_determine_accepted_chid
    if info.chid != dev.chid:
        raise violation(f"the peer accepted CHID {info.chid:#06x}, which we never offered")
    peer_gid = info.gid128
    assert ledger.ism is not None
    if peer_gid != dev.gid128 or not ledger.ism.pairing_confirmed():
        raise Refusal(
            DeclineReason.NOSMCD2DEV,
            "the accepting loopback-ism device is not ours, or no server half of this daemon "
            "claimed this connection",
        )
    # smc_conn_create
    link_id, first_contact = ledger.ism_link_group(peer_gid)
    if first_contact and not msg.first_contact:
        raise Refusal(
            DeclineReason.SYNCERR,
            f"the peer reuses link group {info.link_id:#x}, which we do not have",
        )
    grant = ledger.register_dmb(ism.dmb_size, ism.min_dmb_size)
    ledger.attach_dmb(info.token, info.dmbe_size)
    confirm = Confirm(
        info=_info(dev, grant, link_id),
        version=2,
        first_contact=first_contact,
        eid=msg.eid,
        fce=smcd_fce(offer.hostname, release, feature_mask) if first_contact else None,
    )
    return confirm, SmcdLoopbackOutcome(
        peer_gid=peer_gid,
        peer_token=info.token,
        local_token=grant.token,
        local_dmb_size=grant.size,
        peer_dmb_size=uncompress_bufsize(info.dmbe_size),
        link_id=link_id,
        first_contact=first_contact,
        peer_first_contact=msg.first_contact,
        negotiated_eid=msg.eid,
        release=release,
        feature_mask=feature_mask,
    )
