"""The SMC v2.1 rules both devices share: the First Contact Extension each side fills in and the
checks of the peer's (``smc_clc_*_v2x_features_*``), each in one place."""

from __future__ import annotations

from typing import NamedTuple

from smcd_daemon.protocol.negotiate.facts import (
    SMC_CONN_PER_LGR_MIN,
    SMC_FEATURE_MASK,
    SMC_LINKS_ADD_LNK_MAX,
    SMC_LINKS_ADD_LNK_MIN,
    SMC_RELEASE,
)
from smcd_daemon.protocol.negotiate.outcome import Refusal
from smcd_daemon.wire.clc import Confirm, FirstContactExt, OsType, V2Extension
from smcd_daemon.wire.reasons import DeclineReason

__all__ = [
    "Agreed",
    "clnt_v2x_features_validate",
    "smcd_fce",
    "smcr_fce",
    "srv_v2x_features_validate",
    "v2x_features_confirm_check",
]


class Agreed(NamedTuple):
    """What v2.1 settled: the release, the feature mask and (SMC-R) the link group limits."""

    release: int
    feature_mask: int
    max_conns: int
    max_links: int


def srv_v2x_features_validate(
    v2: V2Extension, *, release: int, smcr_v2: bool, max_conns: int, max_links: int
) -> Agreed:
    """``smc_clc_srv_v2x_features_validate``: from release 1 on, the smaller of the peer's and
    our SMC-R limits, which must reach the minimum (checked before any device search), and the
    common features. ``max_conns``/``max_links`` are ours."""
    feature_mask = SMC_FEATURE_MASK
    if release >= 1:
        if smcr_v2:
            max_conns = min(v2.max_conns, max_conns)
            if max_conns < SMC_CONN_PER_LGR_MIN:
                raise Refusal(
                    DeclineReason.MAXCONNERR,
                    f"the peer offers max_conns {v2.max_conns}; a link group needs at "
                    f"least {SMC_CONN_PER_LGR_MIN}",
                )
            max_links = min(v2.max_links, max_links)
            if max_links < SMC_LINKS_ADD_LNK_MIN:
                raise Refusal(
                    DeclineReason.MAXLINKERR,
                    f"the peer offers max_links {v2.max_links}; at least "
                    f"{SMC_LINKS_ADD_LNK_MIN} is needed",
                )
        feature_mask = v2.feature_mask & SMC_FEATURE_MASK
    return Agreed(release, feature_mask, max_conns, max_links)


def clnt_v2x_features_validate(
    fce: FirstContactExt, *, smcr: bool, max_conns: int, max_links: int
) -> Agreed:
    """``smc_clc_clnt_v2x_features_validate`` on a first-contact Accept: a release above ours
    is VERSMISMAT; from release 1 on, SMC-R limits the peer chose must be valid, and the
    feature mask is what both support. ``max_conns``/``max_links`` are ours (kept below 2.1)."""
    if fce.release > SMC_RELEASE:
        raise Refusal(
            DeclineReason.VERSMISMAT,
            f"the peer accepted release {fce.release}; we offered {SMC_RELEASE}",
        )
    if fce.release < 1:
        return Agreed(fce.release, 0, max_conns, max_links)
    if smcr:
        if fce.max_conns < SMC_CONN_PER_LGR_MIN:
            raise Refusal(
                DeclineReason.MAXCONNERR,
                f"the peer accepted max_conns {fce.max_conns}; a link group needs at "
                f"least {SMC_CONN_PER_LGR_MIN}",
            )
        if not SMC_LINKS_ADD_LNK_MIN <= fce.max_links <= SMC_LINKS_ADD_LNK_MAX:
            raise Refusal(
                DeclineReason.MAXLINKERR,
                f"the peer accepted max_links {fce.max_links}; it must be "
                f"{SMC_LINKS_ADD_LNK_MIN}..{SMC_LINKS_ADD_LNK_MAX}",
            )
        max_conns, max_links = fce.max_conns, fce.max_links
    return Agreed(fce.release, fce.feature_mask & SMC_FEATURE_MASK, max_conns, max_links)


def v2x_features_confirm_check(c: Confirm, accepted: Agreed, *, smcr: bool) -> int:
    """``smc_clc_v2x_features_confirm_check``: a first-contact v2 Confirm echoes the release
    (RELEASEERR) and, SMC-R from release 1 on, the limits we accepted (MAXCONNERR/MAXLINKERR).
    Returns the feature mask now in force (the Confirm's, never more than ours)."""
    if not c.first_contact or c.version == 1:
        return accepted.feature_mask
    fce = c.fce
    assert fce is not None
    if fce.release != accepted.release:
        raise Refusal(
            DeclineReason.RELEASEERR,
            f"the Confirm carries release {fce.release}, we accepted {accepted.release}",
        )
    if fce.release < 1:
        return accepted.feature_mask
    if smcr:
        if fce.max_conns != accepted.max_conns:
            raise Refusal(
                DeclineReason.MAXCONNERR,
                f"the Confirm carries max_conns {fce.max_conns}, we accepted {accepted.max_conns}",
            )
        if fce.max_links != accepted.max_links:
            raise Refusal(
                DeclineReason.MAXLINKERR,
                f"the Confirm carries max_links {fce.max_links}, we accepted {accepted.max_links}",
            )
    return fce.feature_mask & SMC_FEATURE_MASK


def smcd_fce(hostname: str, release: int, feature_mask: int) -> FirstContactExt:
    """``smc_clc_fill_fce`` for SMC-D: the 36-byte v2.0 form for release 0."""
    v2x = release >= 1
    return FirstContactExt(
        hostname=hostname,
        os_type=OsType.LINUX,
        release=release,
        v2x=v2x,
        feature_mask=feature_mask if v2x else 0,
    )


def smcr_fce(hostname: str, agreed: Agreed, v2_direct: bool) -> FirstContactExt:
    """``smc_clc_fill_fce`` for SMC-R: always the 52-byte form; the v2.1 fields only for
    release ≥ 1."""
    v21 = agreed.release >= 1
    return FirstContactExt(
        hostname=hostname,
        os_type=OsType.LINUX,
        release=agreed.release,
        v2_direct=v2_direct,
        v2x=True,
        max_conns=agreed.max_conns if v21 else 0,
        max_links=agreed.max_links if v21 else 0,
        feature_mask=agreed.feature_mask if v21 else 0,
    )
