"""How a negotiation ends (SMC-D, SMC-R or TCP) and what each of its steps tells the driver."""

from __future__ import annotations

import errno
from dataclasses import dataclass, field
from typing import Literal

from smcd_daemon.errors import SmcError
from smcd_daemon.protocol.linkgroup import PeerQp, Role
from smcd_daemon.protocol.smcr_route import SmcrChoice
from smcd_daemon.wire.clc import LOOPBACK_ISM_CHID, ClcMessage, Decline, OsType
from smcd_daemon.wire.reasons import DeclineReason, LegacyDeclineReason

__all__ = [
    "DECL_CLC_TIMEOUT",
    "DECL_PROTOCOL_ERROR",
    "FallbackOutcome",
    "NegotiationError",
    "Outcome",
    "Refusal",
    "SmcdLoopbackOutcome",
    "SmcrNegotiationOutcome",
    "SmcrOutcome",
    "SmcrStep",
    "Step",
    "decline_message",
    "decline_name",
    "declined_detail",
    "local_fallback",
    "peer_decline_fallback",
    "violation",
]

DECL_PROTOCOL_ERROR = int(DeclineReason.CNFERR)
"""Decline code for a malformed/unexpected CLC message (the kernel aborts with EPROTO)."""
DECL_CLC_TIMEOUT = int(LegacyDeclineReason.TIMEOUT)
"""Decline code for a CLC message that did not arrive in time (the kernel aborts: ETIMEDOUT)."""


class NegotiationError(SmcError):
    """The *driver* misused a negotiation (fed it after the end, or more than it asked for).
    Hostile peer bytes never raise: they end in a :class:`FallbackOutcome`."""


class Refusal(Exception):
    """A decision to decline with ``code``: raised by the device steps, turned into a Decline
    and a fallback by the negotiation (never escapes this package)."""

    def __init__(self, code: int, detail: str, *, kernel_errno: int | None = None) -> None:
        super().__init__(detail)
        self.code = int(code)
        self.detail = detail
        self.kernel_errno = kernel_errno


def violation(detail: str) -> Refusal:
    """A malformed or unexpected message: the kernel fails the socket with EPROTO; we decline
    with CNFERR (the two ends' SMC stacks do not agree) and keep the TCP connection."""
    return Refusal(DECL_PROTOCOL_ERROR, f"protocol error: {detail}", kernel_errno=errno.EPROTO)


@dataclass(frozen=True)
class SmcdLoopbackOutcome:
    """The handshake chose SMC-Dv2 over loopback-ism. Sizes are in bytes (whole DMB incl. the
    CDC header). ``first_contact``: this side created the link group ``link_id``;
    ``release`` and ``feature_mask`` are what the First Contact Extensions negotiated (both 0 when
    the link group was reused and neither Accept nor Confirm carried an FCE)."""

    peer_gid: int
    peer_token: int
    local_token: int
    local_dmb_size: int
    peer_dmb_size: int
    link_id: int
    first_contact: bool
    peer_first_contact: bool
    negotiated_eid: str
    release: int
    feature_mask: int
    version: int = 2
    chid: int = LOOPBACK_ISM_CHID

    mode: Literal["smcd"] = "smcd"


@dataclass(frozen=True)
class SmcrOutcome:
    """The handshake chose SMC-R. ``first_contact``: this side created link group ``lgr_id``
    (its first link ``link_id`` must be confirmed by LLC CONFIRM LINK: :attr:`confirm_link`);
    otherwise the connection uses the existing link ``link_id``. ``peer_*`` are the peer's QP,
    GID/MAC and RMB (size in bytes) from the Accept/Confirm; ``local`` is our port/GID choice
    and ``local_rkey``/``local_vaddr``/``local_rmbe_size``/``alert_token`` our RMB as
    announced. ``qp_mtu`` is the path MTU (min of both ends' enum). v2: ``v2_direct`` and
    ``nexthop_mac`` (where RoCEv2 packets go), ``negotiated_eid``; v2.1: ``release``,
    ``max_conns``, ``max_links``, ``feature_mask`` (for v1 and v2.0: our own limits)."""

    role: Role
    version: int
    lgr_id: int
    link_id: int
    first_contact: bool
    peer_first_contact: bool
    peer_system_id: bytes
    peer_gid: bytes
    peer_mac: bytes
    peer_qpn: int
    peer_psn: int
    peer_mtu: int
    peer_rmb_rkey: int
    peer_rmb_vaddr: int
    peer_rmbe_size: int
    peer_alert_token: int
    local: SmcrChoice
    local_mac: bytes
    local_rkey: int
    local_vaddr: int
    local_rmbe_size: int
    alert_token: int
    qp_mtu: int
    vlan_id: int
    v2_direct: bool
    nexthop_mac: bytes | None
    negotiated_eid: str
    release: int
    max_conns: int
    max_links: int
    feature_mask: int
    peer_gid_list: tuple[bytes, ...] = ()
    peer_hostname: str = ""

    mode: Literal["smcr"] = "smcr"

    @property
    def confirm_link(self) -> bool:
        """The link layer must run LLC CONFIRM LINK on the new link before data flows."""
        return self.first_contact

    @property
    def peer_qp(self) -> PeerQp:
        """For ``LinkGroup.first_contact_peer``."""
        return PeerQp(self.peer_qpn, self.peer_psn, self.peer_gid, self.peer_mac, self.peer_mtu)


@dataclass(frozen=True)
class FallbackOutcome:
    """Stay on TCP. ``reason`` is our decline/fallback code (PEERDECL when the peer declined, then
    ``peer_diagnosis`` is its code); ``local`` tells who decided; ``declined``: we sent a Decline;
    ``out_of_sync``: a received Decline carried the out-of-sync bit (terminate the link group);
    ``kernel_errno``: the kernel would have failed the connection with this errno instead of
    falling back (see the package docstring)."""

    reason: int
    peer_diagnosis: int | None
    local: bool
    detail: str
    declined: bool = False
    out_of_sync: bool = False
    kernel_errno: int | None = None

    mode: Literal["tcp"] = "tcp"


Outcome = SmcdLoopbackOutcome | SmcrOutcome | FallbackOutcome
SmcrNegotiationOutcome = Outcome


@dataclass(frozen=True)
class Step:
    """What the driver does next: send ``send`` (in order), and if ``outcome`` is set, stop."""

    send: tuple[ClcMessage, ...] = ()
    outcome: Outcome | None = None
    raw: bytes | None = field(default=None, compare=False, repr=False)
    """``send`` already encoded (set when it came from a cache), else None."""

    @property
    def data(self) -> bytes:
        if self.raw is not None:
            return self.raw
        return b"".join(m.encode() for m in self.send)


SmcrStep = Step


def decline_message(code: int, version: int, system_id: bytes) -> Decline:
    """Our Decline: v1 or v2 as the conversation so far (``smc_clc_send_decline``), carrying
    our system id and the out-of-sync bit for SYNCERR."""
    v2 = version >= 2
    return Decline(
        diagnosis=int(code),
        peer_id=system_id,
        version=2 if v2 else 1,
        out_of_sync=code == DeclineReason.SYNCERR,
        os_type=OsType.LINUX if v2 else OsType.NONE,
        diagnosis_v2=(0, 0, 0, 0) if v2 else (),
    )


def decline_name(code: int) -> str:
    for enum in (DeclineReason, LegacyDeclineReason):
        try:
            return f"{enum(code).name} ({code:#010x})"
        except ValueError:
            continue
    return f"{code:#010x}"


def local_fallback(
    code: int, detail: str, *, declined: bool, kernel_errno: int | None = None
) -> FallbackOutcome:
    """The outcome when this side gives up on SMC (with or without sending a Decline)."""
    return FallbackOutcome(
        reason=int(code),
        peer_diagnosis=None,
        local=True,
        detail=detail,
        declined=declined,
        kernel_errno=kernel_errno,
    )


def declined_detail(code: int, detail: str) -> str:
    return f"{detail}: declined with {decline_name(code)}"


def peer_decline_fallback(msg: Decline, extra: str = "") -> FallbackOutcome:
    """The outcome when the peer sent a Decline: PEERDECL locally, its code as the diagnosis."""
    oos = " (out of sync: terminate the link group)" if msg.out_of_sync else ""
    return FallbackOutcome(
        reason=int(DeclineReason.PEERDECL),
        peer_diagnosis=msg.diagnosis,
        local=False,
        detail=f"the peer declined with {decline_name(msg.diagnosis)}{oos}{extra}",
        out_of_sync=msg.out_of_sync,
    )
