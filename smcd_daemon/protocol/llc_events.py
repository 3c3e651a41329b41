"""What a :class:`~smcd_daemon.protocol.linkgroup.LinkGroup` takes and gives: the facts about
ports and peer QPs it is told, the outputs every call returns (transport actions, LLC messages
to send, failover decisions, notifications) and the link snapshot it hands out. Values only:
the link group's logic is in ``linkgroup.py`` and the ``llc_*`` flow modules."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import TypeAlias

from smcd_daemon.errors import SmcError
from smcd_daemon.wire.llc import DeleteLinkReason, LlcMessage
from smcd_daemon.wire.reasons import DeclineReason

__all__ = [
    "AbortConnections",
    "AddLinkResult",
    "CreateQp",
    "DestroyQp",
    "FirstContactDone",
    "FirstContactFailed",
    "LgrType",
    "LgrTypeChanged",
    "LinkGroupError",
    "LinkGroupTerminated",
    "LinkInfo",
    "LinkState",
    "LinkStateChanged",
    "LlcIgnored",
    "LocalPort",
    "MoveConnection",
    "Output",
    "PeerQp",
    "QpToRtr",
    "QpToRts",
    "RmbConfirmed",
    "RmbDeleted",
    "Role",
    "SendLlc",
]


class LinkGroupError(SmcError):
    """A local request that contradicts the link group's state (a caller bug)."""


class Role(StrEnum):
    SERVER = "SERV"
    CLIENT = "CLNT"


class LinkState(StrEnum):
    """``enum smc_link_state``, spelled as smc-tools prints it."""

    UNUSED = "LINK_UNUSED"
    INACTIVE = "INACTIVE"
    ACTIVATING = "ACTIVATING"
    ACTIVE = "ACTIVE"


class LgrType(StrEnum):
    """``enum smc_lgr_type`` (smc-tools "LG-Type")."""

    NONE = "NONE"
    SINGLE = "SINGLE"
    SYM = "SYM"
    ASYMP = "ASYMP"  # the peer has one device for two links
    ASYML = "ASYML"  # we have one device for two links


# ---------------------------------------------------------------------------- facts
@dataclass(frozen=True, slots=True)
class LocalPort:
    """A local RoCE port a link can use: its name (e.g. ``"rxe0:1"``), the GID and MAC the
    link announces, and the active MTU as the IB enum (1=256 … 5=4096)."""

    name: str
    gid: bytes
    mac: bytes
    mtu: int = 3
    active: bool = True


@dataclass(frozen=True, slots=True)
class PeerQp:
    """What the peer told us about its end of a link (CLC Accept/Confirm or ADD LINK)."""

    qpn: int
    psn: int
    gid: bytes
    mac: bytes
    mtu: int


# ---------------------------------------------------------------------------- outputs
@dataclass(frozen=True, slots=True)
class SendLlc:
    """Send ``message`` as an RDMA SEND on link ``link_id``."""

    link_id: int
    message: LlcMessage


@dataclass(frozen=True, slots=True)
class CreateQp:
    """Create the RC QP of a new link on ``port`` and register the RMBs ``rmb_ids`` with it;
    answer with :meth:`LinkGroup.qp_created`."""

    link_id: int
    port: LocalPort
    rmb_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class QpToRtr:
    """Move the link's QP INIT → RTR toward the peer's QP with the path MTU ``mtu``."""

    link_id: int
    peer: PeerQp
    mtu: int


@dataclass(frozen=True, slots=True)
class QpToRts:
    link_id: int


@dataclass(frozen=True, slots=True)
class DestroyQp:
    """Move the QP to ERR, destroy it and deregister the link's MRs (``smcr_link_clear``)."""

    link_id: int


@dataclass(frozen=True, slots=True)
class MoveConnection:
    """Failover (``smc_switch_conns``): connection ``conn_id`` now uses ``to_link``. With
    ``validate`` the transport rewinds the producer cursor to the last confirmed one and sends
    the CDC failover validation on the new link before resuming writes; connections already
    closing just switch."""

    conn_id: int
    from_link: int
    to_link: int
    validate: bool
    peer_rkey: int | None
    peer_vaddr: int | None


@dataclass(frozen=True, slots=True)
class AbortConnections:
    """The link group is gone: abort these connections (ECONNRESET to the application)."""

    conn_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class LinkStateChanged:
    link_id: int
    old: LinkState
    new: LinkState


@dataclass(frozen=True, slots=True)
class LgrTypeChanged:
    old: LgrType
    new: LgrType


@dataclass(frozen=True, slots=True)
class FirstContactDone:
    link_id: int


@dataclass(frozen=True, slots=True)
class FirstContactFailed:
    """The first link did not come up; the CLC side declines with ``decline``."""

    decline: DeclineReason
    explanation: str


@dataclass(frozen=True, slots=True)
class AddLinkResult:
    ok: bool
    link_id: int | None
    explanation: str


@dataclass(frozen=True, slots=True)
class RmbConfirmed:
    rmb_id: int
    ok: bool


@dataclass(frozen=True, slots=True)
class RmbDeleted:
    rmb_id: int
    ok: bool


@dataclass(frozen=True, slots=True)
class LinkGroupTerminated:
    reason: DeleteLinkReason | int
    explanation: str


@dataclass(frozen=True, slots=True)
class LlcIgnored:
    """A received LLC message (or bytes) that was dropped, and why - for logs and tests."""

    link_id: int
    message: LlcMessage | None
    why: str


Output: TypeAlias = (
    SendLlc
    | CreateQp
    | QpToRtr
    | QpToRts
    | DestroyQp
    | MoveConnection
    | AbortConnections
    | LinkStateChanged
    | LgrTypeChanged
    | FirstContactDone
    | FirstContactFailed
    | AddLinkResult
    | RmbConfirmed
    | RmbDeleted
    | LinkGroupTerminated
    | LlcIgnored
)


@dataclass(frozen=True, slots=True)
class LinkInfo:
    """A snapshot of one link for the registry / D-Bus / ``smcctl linkgroup show --links``."""

    link_id: int
    state: LinkState
    port: str
    gid: bytes
    qpn: int | None
    psn: int | None
    peer_gid: bytes | None
    peer_qpn: int | None
    mtu: int | None
    link_uid: bytes
    peer_link_uid: bytes | None
    conns: int
