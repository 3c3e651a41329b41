"""The accepting side, one flow for SMC-D and SMC-R as ``smc_listen_work``: Proposal (or
Decline) → Accept → Confirm (or Decline)."""

from __future__ import annotations

from smcd_daemon.protocol.negotiate import ism, rdma
from smcd_daemon.protocol.negotiate.base import Ledger, Negotiation, State
from smcd_daemon.protocol.negotiate.client import joined
from smcd_daemon.protocol.negotiate.facts import (
    SMC_CONN_PER_LGR_MAX,
    SMC_FEATURE_MASK,
    SMC_LINKS_ADD_LNK_MAX,
    SMC_RELEASE,
    NegotiationFacts,
    Offer,
    SmcdResources,
    SmcrFacts,
    SmcrResources,
)
from smcd_daemon.protocol.negotiate.outcome import Refusal, Step, violation
from smcd_daemon.protocol.negotiate.v2x import Agreed, srv_v2x_features_validate
from smcd_daemon.wire.clc import Accept, ClcMessage, ClcType, Confirm, Proposal, SmcType
from smcd_daemon.wire.reasons import DeclineReason

__all__ = ["Server", "ServerNegotiation", "ServerSmcrNegotiation"]


class Server(Negotiation):
    """Accepts the first device the kernel's order finds: ISMv2 (loopback-ism), RDMA v2, ISMv1
    (never: loopback-ism is v2 only), RDMA v1. Codes are "first stored wins", as ``ini->rc``."""

    def __init__(self, offer: Offer, ledger: Ledger) -> None:
        super().__init__(offer, ledger, expect=ClcType.PROPOSAL, state=State.WAIT)
        self._accepted: ism.IsmAccepted | rdma.RdmaAccepted | None = None

    def _handle(self, msg: ClcMessage) -> Step:
        if isinstance(msg, Proposal) and self.proposal is None:
            return self._on_proposal(msg)
        if isinstance(msg, Confirm) and self._accepted is not None:
            return self._on_confirm(msg)
        raise violation(f"unexpected {type(msg).__name__}")

    def _on_proposal(self, p: Proposal) -> Step:
        self.proposal = p
        self._decline_as(v2=p.version > 1)
        o = self.offer
        why_not = self.why_not
        # smc_listen_v2_check
        smcd_v1, smcr_v1 = p.typev1.has_d, p.typev1.has_r
        smcd_v2 = p.version > 1 and p.typev2.has_d
        smcr_v2 = p.version > 1 and p.typev2.has_r
        rc: int = DeclineReason.PEERNOSMC
        release = 0
        v2 = p.v2_ext
        if smcd_v2 or smcr_v2:
            if v2 is None:
                smcd_v2 = smcr_v2 = False
                rc = DeclineReason.NOV2EXT
            else:
                if smcd_v2:
                    if not o.has_loopback:
                        smcd_v2, rc = False, DeclineReason.NOISM2SUPP
                        why_not.append("SMC-Dv2: loopback-ism is disabled here")
                    elif p.smcd_v2_ext is None:
                        smcd_v2, rc = False, DeclineReason.NOV2DEXT
                    elif not v2.eids and not v2.seid_indicator:
                        smcd_v2, rc = False, DeclineReason.NOUEID
                        why_not.append("SMC-Dv2: the peer offers no EID")
                if smcr_v2 and not v2.eids:
                    smcr_v2, rc = False, DeclineReason.NOUEID
                    why_not.append("SMC-Rv2: the peer offers no UEID")
                release = min(v2.release, SMC_RELEASE)
        if not (smcd_v1 or smcr_v1 or smcd_v2 or smcr_v2):
            raise Refusal(rc, f"no common SMC version/path: {joined(why_not)}")
        ours_conns = o.rdma.max_conns if o.rdma is not None else SMC_CONN_PER_LGR_MAX
        ours_links = o.rdma.max_links if o.rdma is not None else SMC_LINKS_ADD_LNK_MAX
        agreed = Agreed(release, SMC_FEATURE_MASK, ours_conns, ours_links)
        if v2 is not None and (smcd_v2 or smcr_v2):
            agreed = srv_v2x_features_validate(
                v2, release=release, smcr_v2=smcr_v2, max_conns=ours_conns, max_links=ours_links
            )
        # smc_listen_find_device
        store: list[int] = []
        if smcd_v2:
            found_d = ism.find_ism_v2_device_serv(o, self.ledger, p, agreed, store, why_not)
            if found_d is not None:
                return self._wait_confirm(*found_d)
        prfx_rc = 0
        if p.typev1 != SmcType.N and not o.prefix_match:
            prfx_rc = DeclineReason.DIFFPREFIX
            store.append(prfx_rc)
            why_not.append("SMC v1: the peer's IP subnet is not ours")
        if not prfx_rc and smcd_v1:
            store.append(DeclineReason.NOSMCDDEV)  # no ISMv1 device: loopback-ism is v2 only
        if not p.typev1.has_r and not p.typev2.has_r:
            raise Refusal(
                store[0] if store else DeclineReason.NOSMCDDEV,
                f"no usable SMC-D device: {joined(why_not)}",
            )
        if smcr_v2:
            found = rdma.find_rdma_v2_device_serv(o, self.ledger, p, agreed, store, why_not)
            if found is not None:
                return self._wait_confirm(*found)
        if prfx_rc:
            raise Refusal(DeclineReason.NOSMCDEV, f"no usable SMC device: {joined(why_not)}")
        found = rdma.find_rdma_v1_device_serv(o, self.ledger, p, smcr_v1, store, why_not)
        if found is not None:
            return self._wait_confirm(*found)
        code = store[0] if store else DeclineReason.NOSMCDEV
        raise Refusal(code, f"no usable SMC device: {joined(why_not)}")

    def _wait_confirm(self, accept: Accept, accepted: ism.IsmAccepted | rdma.RdmaAccepted) -> Step:
        self._accepted = accepted
        self._wait(ClcType.CONFIRM)
        if isinstance(accepted, ism.IsmAccepted):
            return Step((accept,), raw=ism.encode_smcd(accept))
        return Step((accept,))

    def _on_confirm(self, c: Confirm) -> Step:
        acc = self._accepted
        if isinstance(acc, ism.IsmAccepted):
            return self._succeed(ism.confirm_ism(self.offer, self.ledger, acc, c))
        assert acc is not None
        return self._succeed(rdma.confirm_rdma(self.offer, acc, c))


class ServerNegotiation(Server):
    """SMC-Dv2 over loopback-ism alone (the handoff server's server half)."""

    def __init__(self, facts: NegotiationFacts, resources: SmcdResources) -> None:
        super().__init__(facts.offer, Ledger(ism=resources))


class ServerSmcrNegotiation(Server):
    """SMC-R, with SMC-Dv2 too when ``facts.smcd`` is given."""

    def __init__(self, facts: SmcrFacts, resources: SmcrResources) -> None:
        ism_res = facts.smcd.resources if facts.smcd is not None else None
        super().__init__(facts.offer, Ledger(ism=ism_res, rdma=resources))
