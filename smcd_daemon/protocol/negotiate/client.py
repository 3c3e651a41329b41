"""The connecting side, one flow for SMC-D and SMC-R as ``__smc_connect``: Proposal (or a
Decline when there is no device) → Accept (or Decline) → Confirm."""

from __future__ import annotations

import functools

from smcd_daemon.protocol.negotiate import ism, rdma
from smcd_daemon.protocol.negotiate.base import Ledger, Negotiation, State
from smcd_daemon.protocol.negotiate.facts import (
    SMC_FEATURE_MASK,
    SMC_RELEASE,
    NegotiationFacts,
    Offer,
    SmcdResources,
    SmcrFacts,
    SmcrResources,
)
from smcd_daemon.protocol.negotiate.outcome import (
    Refusal,
    Step,
    violation,
)
from smcd_daemon.protocol.smcr_route import SmcrChoice
from smcd_daemon.wire.clc import (
    Accept,
    ClcMessage,
    ClcType,
    IpPrefixes,
    IsmDevice,
    Proposal,
    SmcdInfo,
    SmcdV2Extension,
    SmcType,
    V2Extension,
)
from smcd_daemon.wire.reasons import DeclineReason

__all__ = ["Client", "ClientNegotiation", "ClientSmcrNegotiation", "joined"]


def joined(why: list[str]) -> str:
    """The reasons paths were not taken, once each, for a decline's detail."""
    return "; ".join(dict.fromkeys(w for w in why if w)) or "no usable SMC device"


@functools.lru_cache(maxsize=16)
def _proposal(
    typev1: SmcType,
    typev2: SmcType,
    peer_id: bytes,
    gid: bytes,
    mac: bytes,
    ip_prefixes: IpPrefixes | None,
    ueids: tuple[str, ...],
    seid: str,
    seid_indicator: bool,
    roce_gid: bytes,
    max_conns: int,
    max_links: int,
    device: IsmDevice | None,
) -> tuple[Proposal, bytes]:
    """A Proposal and its bytes, built once per combination: the connections of one host
    offer the same few (messages are frozen, so sharing them is safe)."""
    v2_ext = None
    if typev2 != SmcType.N:
        v2_ext = V2Extension(
            eids=ueids,
            release=SMC_RELEASE,
            seid_indicator=seid_indicator,
            roce_gid=roce_gid,
            max_conns=max_conns,
            max_links=max_links,
            feature_mask=SMC_FEATURE_MASK,
        )
    smcd_ext = None if device is None else SmcdV2Extension(seid=seid, devices=(device,))
    proposal = Proposal(
        typev1=typev1,
        typev2=typev2,
        peer_id=peer_id,
        gid=gid,
        mac=mac,
        version=2,
        ip_prefixes=ip_prefixes,
        v2_ext=v2_ext,
        smcd_v2_ext=smcd_ext,
    )
    return proposal, proposal.encode()


class Client(Negotiation):
    """Offers what :attr:`offer` allows (SMC-Rv1, SMC-Dv2 over loopback-ism, SMC-Rv2) and
    follows whichever the server accepts."""

    def __init__(self, offer: Offer, ledger: Ledger) -> None:
        super().__init__(offer, ledger, expect=ClcType.ACCEPT, state=State.INIT)
        self.choice_v1: SmcrChoice | None = None
        self.choice_v2: SmcrChoice | None = None

    def start(self) -> Step:
        """The first message to send (a Proposal, or a Decline when we have no device), or an
        immediate fallback without a byte sent when the peer is not known to speak SMC."""
        self._begin()
        o = self.offer
        # __smc_connect: the first Decline's version depends on ISMv2 capability
        self._decline_as(v2=o.ism_v2_capable)
        if not o.peer_speaks_smc:
            return self._fall_back(
                DeclineReason.PEERNOSMC,
                "the peer is not known to speak SMC (no registered listener or configured peer)",
                declined=False,
            )
        if o.rdma is not None:
            self.choice_v1, self.choice_v2 = rdma.proposal_devices(o.rdma, self.why_not)
        use_d = o.has_loopback
        if o.ism is not None and not use_d:
            self.why_not.append("SMC-Dv2: loopback-ism is disabled here")
        v1, v2 = self.choice_v1, self.choice_v2
        if v1 is None and v2 is None and not use_d:
            return self._decline_and_fall_back(
                DeclineReason.NOSMCDEV, f"no SMC device: {joined(self.why_not)}"
            )
        typev1 = SmcType.R if v1 is not None else SmcType.N
        r2 = v2 is not None
        typev2 = (
            SmcType.B if (r2 and use_d) else SmcType.R if r2 else SmcType.D if use_d else SmcType.N
        )
        eids = o.eids
        r_choice = v1 if v1 is not None else v2
        has_r = o.rdma is not None and r_choice is not None
        device = o.ism.loopback if use_d and o.ism is not None else None
        proposal, raw = _proposal(
            typev1,
            typev2,
            o.system_id if has_r else bytes(8),
            v1.gid.gid if v1 is not None else bytes(16),
            rdma.local_mac(o.rdma, r_choice)
            if o.rdma is not None and r_choice is not None
            else bytes(6),
            o.rdma.ip_prefixes if o.rdma is not None and typev1 != SmcType.N else None,
            eids.ueids,
            (eids.seid or "") if eids.seid_enabled else "",
            use_d and eids.seid_enabled,
            v2.gid.gid if v2 is not None else bytes(16),
            o.rdma.max_conns if o.rdma is not None and r2 else 0,
            o.rdma.max_links if o.rdma is not None and r2 else 0,
            device,
        )
        self.proposal = proposal
        self._wait(ClcType.ACCEPT)
        return Step((proposal,), raw=raw)

    def _handle(self, msg: ClcMessage) -> Step:
        if not isinstance(msg, Accept) or self.proposal is None:
            raise violation(f"expected ACCEPT, got {type(msg).__name__}")
        self._decline_as(v2=msg.version != 1)
        p = self.proposal
        # smc_connect_check_aclc
        offered = p.typev2 if msg.version >= 2 else p.typev1
        is_d = isinstance(msg.info, SmcdInfo)
        if not (offered.has_d if is_d else offered.has_r):
            kind = "SMC-D" if is_d else "SMC-R"
            raise Refusal(
                DeclineReason.MODEUNSUPP,
                f"the peer accepted {kind} v{msg.version}, which we did not offer "
                f"(typev1 {p.typev1.name}, typev2 {p.typev2.name})",
            )
        if is_d:
            confirm, outcome = ism.connect_ism(self.offer, self.ledger, msg)
            return self._succeed(outcome, (confirm,), raw=ism.encode_smcd(confirm))
        choice = self.choice_v1 if msg.version == 1 else self.choice_v2
        assert choice is not None
        confirm_r, outcome_r = rdma.connect_rdma(self.offer, self.ledger, msg, choice)
        return self._succeed(outcome_r, (confirm_r,))


class ClientNegotiation(Client):
    """SMC-Dv2 over loopback-ism alone (the handoff server's client half)."""

    def __init__(self, facts: NegotiationFacts, resources: SmcdResources) -> None:
        super().__init__(facts.offer, Ledger(ism=resources))


class ClientSmcrNegotiation(Client):
    """SMC-R, with SMC-Dv2 too when ``facts.smcd`` is given."""

    def __init__(self, facts: SmcrFacts, resources: SmcrResources) -> None:
        ism_res = facts.smcd.resources if facts.smcd is not None else None
        super().__init__(facts.offer, Ledger(ism=ism_res, rdma=resources))
