"""Sans-IO CLC negotiation for SMC-R (v1 and v2/v2.1), alone or offered together with SMC-Dv2
over loopback-ism, in the shape of :mod:`smcd_daemon.protocol.negotiate`.

The driver contract is the same as there (``start()``, ``receive_data()`` never fed more than
:attr:`bytes_needed`, :attr:`timeout`, ``on_timeout()``, ``on_eof()``, ``abort()``, a
:class:`SmcrStep` with messages to send and, at the end, an outcome), so the asyncio driver of
``adapters/clc_io.py`` runs either. One addition: a first contact ends in an :class:`SmcrOutcome`
whose :attr:`~SmcrOutcome.confirm_link` is set; the link layer then runs LLC CONFIRM LINK over
the new QP, and if that fails the driver calls :meth:`link_failed`, after which the negotiation
waits a short time (``CLC_WAIT_TIME_SHORT``) for a Decline of the peer and otherwise declines
itself with the link layer's code (``SMC_CLC_DECL_TIMEOUT_CL``), as ``smcr_serv_conf_first_link``
and ``smcr_clnt_conf_first_link`` do.

Facts come in :class:`SmcrFacts` (modes, UEIDs, v2.1 limits, RoCE ports and routing snapshot,
the CLC socket's address, VLAN and IP prefix); device and path choice is
:mod:`smcd_daemon.protocol.smcr_route`'s, whose explanations go into every decline's detail.
Link groups and RMBs come through :class:`SmcrResources`.

Decisions follow ``net/smc/af_smc.c``, ``smc_clc.c`` and ``smc_core.c`` (6.12):

Client (``__smc_connect``, ``smc_find_proposal_devices``, ``smc_connect_check_aclc``,
``smc_connect_rdma``, ``smc_connect_rdma_v2_prepare``, ``smc_clc_clnt_v2x_features_validate``,
``smc_conn_create``):
  * offers SMC-Rv1 (first RoCE v1 GID for the VLAN), SMC-Dv2 (loopback-ism, if an SMC-D half is
    given) and SMC-Rv2 (IPv4 socket, a UEID, a RoCE v2 GID whose netdev subnet holds the
    source); none → Decline NOSMCDEV instead of a Proposal (the explanations of every path);
  * Proposal: version 2, typev1 R or N (no IP prefix known → no v1 path), typev2 R/D/B; the v2
    extension carries our UEIDs, release 1, the RoCEv2 GID and max_conns/max_links; we put our
    system id and MAC in the Proposal whenever SMC-R is offered (Linux only for SMC-Rv1,
    leaving a v2-only server without the MAC it uses as a direct next hop);
  * Accept of a type/version not offered → MODEUNSUPP; an SMC-D Accept goes to the SMC-D half;
  * SMC-Rv2 first contact: the FCE's v2_direct is trusted, an indirect one is checked by routing
    (NOROUTE / NOINDIRECT, explained); release above ours → VERSMISMAT; release ≥ 1:
    max_conns < 16 → MAXCONNERR, max_links outside 1..2 → MAXLINKERR;
  * the server reuses a link group we cannot find (same peer system id, role, version, VLAN and
    an active link to the Accept's QPN/GID, plus MAC for v1) → Decline SYNCERR with the
    out-of-sync bit; link group / QP creation failing → MEM or INTERR (the resource's code),
    RMB allocation failing → MEM, an invalid peer MTU on first contact → ERR_RDYLNK;
  * Confirm with our QP, RMB, the Accept's EID and, first contact v2, the FCE (release,
    v2_direct, max_conns/max_links, feature mask) and our RoCEv2 GID list.

Server (``smc_listen_work``, ``smc_listen_v2_check``, ``smc_clc_srv_v2x_features_validate``,
``smc_listen_find_device`` with ``smc_find_ism_v2_device_serv``,
``smc_find_rdma_v2_device_serv``, ``smc_find_rdma_v1_device_serv``, ``smc_listen_rdma_finish``,
``smc_clc_v2x_features_confirm_check``):
  * v2 checks as in :mod:`negotiate` (NOV2EXT, NOISM2SUPP, NOV2DEXT, NOUEID), release =
    min(peer's, ours); release ≥ 1 with SMC-Rv2 offered: max_conns = min(peer's, ours) < 16 →
    MAXCONNERR, max_links = min(peer's, ours) < 1 → MAXLINKERR (before any device search);
  * device order: ISMv2 (loopback-ism, decided by the SMC-D half), then RDMA v2, then ISM v1
    (never: loopback-ism is v2 only), then RDMA v1; codes are "first stored wins" as the
    kernel's ``ini->rc``: RDMA v2 without a usable port stores NOSMCRDEV, a UEID mismatch
    stores nothing (but its explanation is kept), RDMA v1 without a port stores NOSMCDEV; an IP
    prefix mismatch stores DIFFPREFIX and skips the v1 paths (decline NOSMCDEV);
  * link group: reuse one with the same peer system id, role, version, VLAN, an active link to
    the peer's GID (plus MAC for v1), not terminating and below max_conns, else first contact;
  * Confirm: first contact with a release other than the accepted one → RELEASEERR; release ≥ 1
    with max_conns/max_links other than accepted → MAXCONNERR / MAXLINKERR.

Both: a received Decline → fallback PEERDECL (no Decline back). Timeouts, EOF and malformed or
unexpected messages end as in :mod:`negotiate` (decline 0x02000000 / no decline / CNFERR, with
the errno the kernel would have failed with). Our Declines carry our system id (the kernel's
``local_systemid``), as the kernel does for SMC-R.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from smcd_daemon.core.eid import EidTable
from smcd_daemon.errors import SmcError
from smcd_daemon.protocol.linkgroup import PeerQp, Role
from smcd_daemon.protocol.negotiate import (
    _HOSTNAME_OK,
    CLC_WAIT_TIME,
    DECL_CLC_TIMEOUT,
    DECL_PROTOCOL_ERROR,
    SMC_CONN_PER_LGR_MAX,
    SMC_CONN_PER_LGR_MIN,
    SMC_FEATURE_MASK,
    SMC_LINKS_ADD_LNK_MAX,
    SMC_LINKS_ADD_LNK_MIN,
    SMC_RELEASE,
    ClcFramer,
    ClientNegotiation,
    FallbackOutcome,
    NegotiationError,
    NegotiationFacts,
    ServerNegotiation,
    SmcdLoopbackOutcome,
    SmcdResources,
    Step,
    _State,
    _wire,
    declined_detail,
    local_fallback,
    peer_decline_fallback,
)
from smcd_daemon.protocol.smcr_route import Decline as RouteDecline
from smcd_daemon.protocol.smcr_route import (
    GidChoice,
    PortLike,
    RoutingFacts,
    SmcrChoice,
    _mac_bytes,
    check_accept_path,
    choose_smcr_v1,
    choose_smcr_v2_client,
    choose_smcr_v2_server,
    determine_gid,
)
from smcd_daemon.wire.clc import (
    MAX_GID_LIST,
    Accept,
    ClcMessage,
    ClcType,
    Confirm,
    Decline,
    FirstContactExt,
    IpPrefixes,
    OsType,
    Proposal,
    SmcdInfo,
    SmcdV2Extension,
    SmcrInfo,
    SmcType,
    V2Extension,
)
from smcd_daemon.wire.reasons import DeclineReason

__all__ = [
    "CLC_WAIT_TIME_SHORT",
    "IB_MTU_MAX",
    "IB_MTU_MIN",
    "ClientSmcrNegotiation",
    "FirstLink",
    "LinkGroupRequest",
    "LinkGroupView",
    "LinkView",
    "RmbGrant",
    "ServerSmcrNegotiation",
    "SmcdHalf",
    "SmcrFacts",
    "SmcrNegotiationOutcome",
    "SmcrOutcome",
    "SmcrResources",
    "SmcrStep",
    "find_link_group",
]

CLC_WAIT_TIME_SHORT = 1.0
"""Seconds to wait for a peer's Decline after the first link failed (``CLC_WAIT_TIME_SHORT``)."""
IB_MTU_MIN = 1  # IB_MTU_256
IB_MTU_MAX = 5  # IB_MTU_4096
_RMBE_IDX = 1  # "for now: 1 RMB = 1 RMBE" (smc_clc_send_confirm_accept)

IPAddr = ipaddress.IPv4Address | ipaddress.IPv6Address


# ---------------------------------------------------------------------------- facts
@dataclass(frozen=True)
class SmcdHalf:
    """The SMC-D (loopback-ism) half of a combined R+D offer: the facts and resources the
    :mod:`negotiate` roles use. Its decisions (pairing, DMBs, link groups) stay theirs."""

    facts: NegotiationFacts
    resources: SmcdResources


@dataclass(frozen=True)
class SmcrFacts:
    """What this host offers for one connection.

    ``ports`` are the active RoCE ports of the CLC socket's netdev (PNETID or netdev match,
    ``DeviceInventory.smcr_ports_for``); ``routing`` answers addresses, routes and neighbours;
    ``local_addr`` is the CLC socket's own address (the SMC-Rv2 ``saddr``), ``vlan_id`` its
    VLAN (0 = none), ``ip_prefixes`` its subnet for the v1 prefix area (None: unknown, so no v1
    path is offered). ``smcr_v1``/``smcr_v2`` are the configured modes; ``max_conns`` /
    ``max_links`` the v2.1 limits (sysctls ``smcr_max_conns_per_lgr`` 16..255 and
    ``smcr_max_links_per_lgr`` 1..2); ``system_id`` the 8-byte ``local_systemid``;
    ``rmb_size`` the RMB size wanted. ``prefix_match`` is the server's IP prefix check
    (``smc_clc_prfx_match``) for v1 paths. ``smcd`` adds SMC-Dv2 over loopback-ism."""

    eids: EidTable
    system_id: bytes
    ports: tuple[PortLike, ...]
    routing: RoutingFacts
    local_addr: IPAddr
    vlan_id: int = 0
    ip_prefixes: IpPrefixes | None = None
    smcr_v1: bool = True
    smcr_v2: bool = True
    max_conns: int = SMC_CONN_PER_LGR_MAX
    max_links: int = SMC_LINKS_ADD_LNK_MAX
    hostname: str = ""
    rmb_size: int = 64 * 1024
    clc_wait: float = CLC_WAIT_TIME
    peer_speaks_smc: bool = True
    prefix_match: bool = True
    smcd: SmcdHalf | None = None

    def __post_init__(self) -> None:
        if not SMC_CONN_PER_LGR_MIN <= self.max_conns <= SMC_CONN_PER_LGR_MAX:
            raise NegotiationError(
                f"max_conns {self.max_conns} outside {SMC_CONN_PER_LGR_MIN}..{SMC_CONN_PER_LGR_MAX}"
            )
        if not SMC_LINKS_ADD_LNK_MIN <= self.max_links <= SMC_LINKS_ADD_LNK_MAX:
            raise NegotiationError(
                f"max_links {self.max_links} outside "
                f"{SMC_LINKS_ADD_LNK_MIN}..{SMC_LINKS_ADD_LNK_MAX}"
            )
        if not isinstance(self.system_id, bytes) or len(self.system_id) != 8:
            raise NegotiationError("system_id must be 8 bytes (2 random + a RoCE port's MAC)")

    @property
    def wire_hostname(self) -> str:
        """The FCE host name: printable ASCII, at most 32 bytes."""
        return _HOSTNAME_OK.sub("", self.hostname)[:32]

    @property
    def has_loopback(self) -> bool:
        return self.smcd is not None and self.smcd.facts.has_loopback


# ---------------------------------------------------------------------------- link groups
@dataclass(frozen=True)
class LinkView:
    """One link of an existing link group, as the link group layer sees it: our QP's facts
    (``qpn``, ``psn``, ``mtu`` = the link's path MTU enum, ``gid``/``mac`` of our port) and the
    peer's end (``peer_qpn``, ``peer_gid``, ``peer_mac``). ``active``: ``smc_link_active``."""

    link_id: int
    qpn: int
    psn: int
    mtu: int
    gid: bytes
    mac: bytes
    peer_qpn: int
    peer_gid: bytes
    peer_mac: bytes
    active: bool = True


@dataclass(frozen=True)
class LinkGroupView:
    """An existing SMC-R link group, for the reuse decision of ``smc_conn_create``.
    ``sync_err``: terminating after an out-of-sync Decline; ``rtokens_full``: no rtoken slot
    left (``SMC_RMBS_PER_LGR_MAX``)."""

    lgr_id: int
    role: Role
    version: int
    peer_system_id: bytes
    vlan_id: int
    conns: int
    max_conns: int
    links: tuple[LinkView, ...]
    sync_err: bool = False
    rtokens_full: bool = False


@dataclass(frozen=True)
class LinkGroupRequest:
    """Create a link group and its first link's RC QP (INIT state) on ``local`` - what
    ``smc_lgr_create``/``smcr_link_init`` get from ``smc_init_info``."""

    role: Role
    version: int
    peer_system_id: bytes
    peer_gid: bytes
    peer_mac: bytes
    vlan_id: int
    local: GidChoice
    local_mac: bytes
    max_conns: int
    max_links: int
    release: int
    uses_gateway: bool
    nexthop_mac: bytes | None


@dataclass(frozen=True)
class FirstLink:
    """The created link group: its id and the first link's id and QP facts (``mtu`` = the IB
    MTU enum of the port, 1=256 ... 5=4096)."""

    lgr_id: int
    link_id: int
    qpn: int
    psn: int
    mtu: int


class RmbGrant(Protocol):
    """An RMB registered on the link the connection uses: its rkey and address there, size in
    bytes and compressed (16 KiB << n), and the connection's RMBE alert token (unique)."""

    @property
    def rkey(self) -> int: ...
    @property
    def vaddr(self) -> int: ...
    @property
    def size(self) -> int: ...
    @property
    def size_comp(self) -> int: ...
    @property
    def alert_token(self) -> int: ...


class SmcrResources(Protocol):
    """What an SMC-R negotiation needs from the link group layer and the RMB pool. Failures
    raise :class:`~smcd_daemon.errors.SmcError`; a ``decline_reason`` attribute on it names the
    decline code (else MEM for RMBs, INTERR for link groups, NOACTLINK for ``pick_link``)."""

    def link_groups(self) -> Iterable[LinkGroupView]: ...

    def pick_link(self, lgr_id: int) -> int:
        """Server: the link a new connection of this link group uses (``LinkGroup.pick_link``)."""
        ...

    def create_link_group(self, request: LinkGroupRequest) -> FirstLink: ...

    def discard_link_group(self, lgr_id: int) -> None: ...

    def allocate_rmb(self, lgr_id: int, link_id: int, size: int) -> RmbGrant: ...

    def release_rmb(self, grant: RmbGrant) -> None:
        """Give back an RMB :meth:`allocate_rmb` granted (the grant itself, as it was returned:
        the resource layer may need more of it than the alert token)."""
        ...


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


# ---------------------------------------------------------------------------- outcome
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


SmcrNegotiationOutcome = SmcrOutcome | SmcdLoopbackOutcome | FallbackOutcome


@dataclass(frozen=True)
class SmcrStep:
    """As :class:`negotiate.Step`: send ``send`` in order; if ``outcome`` is set, stop."""

    send: tuple[ClcMessage, ...] = ()
    outcome: SmcrNegotiationOutcome | None = None

    @property
    def data(self) -> bytes:
        return b"".join(m.encode() for m in self.send)

    @classmethod
    def of(cls, step: Step) -> SmcrStep:
        return cls(step.send, step.outcome)


class _Failed(Exception):
    """Internal: a decision to decline with ``code`` (never escapes this module)."""

    def __init__(self, code: int, detail: str) -> None:
        super().__init__(detail)
        self.code = code
        self.detail = detail


def _reason_of(exc: SmcError, default: DeclineReason) -> int:
    code = getattr(exc, "decline_reason", None)
    return int(code) if isinstance(code, int) else int(default)


def _joined(why: Sequence[str]) -> str:
    return "; ".join(dict.fromkeys(w for w in why if w)) or "no usable SMC device"


# ---------------------------------------------------------------------------- shared base
class _SmcrNegotiation:
    """Framing, declines, fallbacks, resource clean-up and the SMC-D delegate of both roles."""

    _expect: ClcType
    role: Role

    def __init__(self, facts: SmcrFacts, resources: SmcrResources) -> None:
        self.facts = facts
        self.resources = resources
        self.smcd = facts.smcd
        self._outcome: SmcrNegotiationOutcome | None = None
        self._state = _State.INIT
        self._framer = ClcFramer()
        self._decline_version = 2
        self._new_lgr: int | None = None
        self._rmb: RmbGrant | None = None
        self._delegate: ClientNegotiation | ServerNegotiation | None = None
        self._link_failure: tuple[int, str] | None = None

    # ---- driver interface ---------------------------------------------------------------------

    @property
    def outcome(self) -> SmcrNegotiationOutcome | None:
        """The end result (None while negotiating)."""
        if self._delegate is not None:
            return self._delegate.outcome
        return self._outcome

    @property
    def done(self) -> bool:
        if self._delegate is not None:
            return self._delegate.done
        return self._state is _State.DONE

    @property
    def bytes_needed(self) -> int:
        """How many bytes to read next (never more); 0 when not waiting."""
        if self._delegate is not None:
            return self._delegate.bytes_needed
        if self._state is not _State.WAIT:
            return 0
        return self._framer.bytes_needed

    @property
    def timeout(self) -> float | None:
        if self._delegate is not None:
            return self._delegate.timeout
        if self._state is not _State.WAIT:
            return None
        return CLC_WAIT_TIME_SHORT if self._link_failure else self.facts.clc_wait

    def receive_data(self, data: bytes) -> SmcrStep:
        if self._delegate is not None:
            return SmcrStep.of(self._delegate.receive_data(data))
        if self._state is not _State.WAIT:
            raise NegotiationError(f"not waiting for data (state {self._state.value})")
        if len(data) > self.bytes_needed:
            raise NegotiationError(f"fed {len(data)} bytes, asked for {self.bytes_needed}")
        got = self._framer.feed(data, self._expect)
        if got is None:
            return SmcrStep()
        if isinstance(got, str):
            return self._violation(got)
        if isinstance(got, Decline):
            return self._peer_declined(got)
        msg = got
        try:
            return self._handle(msg)
        except _Failed as f:
            return self._decline_and_fall_back(f.code, f.detail)

    def on_timeout(self) -> SmcrStep:
        if self._delegate is not None:
            return SmcrStep.of(self._delegate.on_timeout())
        if self._state is not _State.WAIT:
            raise NegotiationError(f"not waiting (state {self._state.value})")
        if self._link_failure is not None:
            code, detail = self._link_failure
            return self._decline_and_fall_back(code, detail)
        detail = f"no CLC {self._expect.name} within {self.facts.clc_wait:g} s"
        return self._decline_and_fall_back(DECL_CLC_TIMEOUT, detail, kernel_errno=errno.ETIMEDOUT)

    def on_eof(self) -> SmcrStep:
        if self._delegate is not None:
            return SmcrStep.of(self._delegate.on_eof())
        if self._state is not _State.WAIT:
            raise NegotiationError(f"not waiting (state {self._state.value})")
        if self._link_failure is not None:
            code, detail = self._link_failure
            return self._fall_back(code, f"{detail}; the peer closed the TCP connection",
                                   declined=False)  # fmt: skip
        detail = f"the peer closed the TCP connection while we waited for {self._expect.name}"
        return self._fall_back(
            DECL_PROTOCOL_ERROR, detail, declined=False, kernel_errno=errno.ECONNRESET
        )

    def abort(self, detail: str = "aborted by the daemon") -> SmcrStep:
        if self._delegate is not None:
            return SmcrStep.of(self._delegate.abort(detail))
        if self._state is _State.DONE:
            raise NegotiationError("already done")
        if self._state is _State.WAIT:
            return self._decline_and_fall_back(DeclineReason.INTERR, detail)
        return self._fall_back(DeclineReason.INTERR, detail, declined=False)

    def link_failed(self, explanation: str, reason: int = DeclineReason.TIMEOUT_CL) -> SmcrStep:
        """The first link of our new link group did not come up (LLC CONFIRM LINK failed, as
        the link layer's ``FirstContactFailed`` says). Wait briefly for the peer's Decline
        (:attr:`timeout` is ``CLC_WAIT_TIME_SHORT``), then decline with ``reason``."""
        out = self.outcome
        if not (isinstance(out, SmcrOutcome) and out.first_contact) or self._link_failure:
            raise NegotiationError("link_failed needs a first-contact SMC-R outcome, once")
        self._link_failure = (int(reason), f"the first link did not come up: {explanation}")
        self._outcome = None
        self._state = _State.WAIT
        self._expect = ClcType.DECLINE
        return SmcrStep()

    # ---- endings ------------------------------------------------------------------------------

    def _handle(self, msg: ClcMessage) -> SmcrStep:
        raise NotImplementedError

    def _release(self) -> None:
        """Undo what this negotiation took: our RMB and a link group we created."""
        if self._rmb is not None:
            with contextlib.suppress(SmcError):
                self.resources.release_rmb(self._rmb)
            self._rmb = None
        if self._new_lgr is not None:
            with contextlib.suppress(SmcError):
                self.resources.discard_link_group(self._new_lgr)
            self._new_lgr = None

    def _finish(self, step: SmcrStep) -> SmcrStep:
        assert step.outcome is not None
        self._state = _State.DONE
        self._outcome = step.outcome
        return step

    def _decline_msg(self, code: int) -> Decline:
        v2 = self._decline_version >= 2
        return Decline(
            diagnosis=int(code),
            peer_id=self.facts.system_id,
            version=2 if v2 else 1,
            out_of_sync=code == DeclineReason.SYNCERR,
            os_type=OsType.LINUX if v2 else OsType.NONE,
            diagnosis_v2=(0, 0, 0, 0) if v2 else (),
        )

    def _fall_back(
        self, code: int, detail: str, *, declined: bool, kernel_errno: int | None = None
    ) -> SmcrStep:
        self._release()
        outcome = local_fallback(code, detail, declined=declined, kernel_errno=kernel_errno)
        send = (self._decline_msg(code),) if declined else ()
        return self._finish(SmcrStep(send, outcome))

    def _decline_and_fall_back(
        self, code: int, detail: str, *, kernel_errno: int | None = None
    ) -> SmcrStep:
        return self._fall_back(
            code, declined_detail(code, detail), declined=True, kernel_errno=kernel_errno
        )

    def _violation(self, detail: str) -> SmcrStep:
        return self._decline_and_fall_back(
            DECL_PROTOCOL_ERROR, f"protocol error: {detail}", kernel_errno=errno.EPROTO
        )

    def _peer_declined(self, msg: Decline) -> SmcrStep:
        self._release()
        why = f"; {self._link_failure[1]}" if self._link_failure else ""
        return self._finish(SmcrStep((), peer_decline_fallback(msg, why)))

    # ---- shared resource steps ----------------------------------------------------------------

    def _local_mac(self, choice: SmcrChoice) -> bytes:
        dev = self.facts.routing.netdev_by_name(choice.gid.netdev)
        mac = _mac_bytes(dev.mac) if dev is not None else None
        return mac if mac is not None else bytes(6)

    def _create(self, request: LinkGroupRequest) -> FirstLink:
        try:
            first = self.resources.create_link_group(request)
        except SmcError as exc:
            code = _reason_of(exc, DeclineReason.INTERR)
            raise _Failed(code, f"creating the link group failed: {exc}") from exc
        self._new_lgr = first.lgr_id
        return first

    def _allocate(self, lgr_id: int, link_id: int) -> RmbGrant:
        try:
            grant = self.resources.allocate_rmb(lgr_id, link_id, self.facts.rmb_size)
        except SmcError as exc:
            code = _reason_of(exc, DeclineReason.MEM)
            raise _Failed(code, f"no RMB: {exc}") from exc
        self._rmb = grant
        return grant

    def _info(
        self, choice: SmcrChoice, mac: bytes, qpn: int, psn: int, mtu: int, grant: RmbGrant
    ) -> SmcrInfo:
        return SmcrInfo(
            peer_id=self.facts.system_id,
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

    def _fce(
        self, release: int, v2_direct: bool, max_conns: int, max_links: int, feature_mask: int
    ) -> FirstContactExt:
        """``smc_clc_fill_fce`` for SMC-R: always the 52-byte form; the v2.1 fields only for
        release ≥ 1."""
        v21 = release >= 1
        return FirstContactExt(
            hostname=self.facts.wire_hostname,
            os_type=OsType.LINUX,
            release=release,
            v2_direct=v2_direct,
            v2x=True,
            max_conns=max_conns if v21 else 0,
            max_links=max_links if v21 else 0,
            feature_mask=feature_mask if v21 else 0,
        )

    def _success(self, outcome: SmcrOutcome, send: tuple[ClcMessage, ...] = ()) -> SmcrStep:
        # resources stay referenced: link_failed() may still have to give them back
        return self._finish(SmcrStep(send, outcome))


def _check_mtu(mtu: int, who: str) -> None:
    if not IB_MTU_MIN <= mtu <= IB_MTU_MAX:
        raise _Failed(
            DeclineReason.ERR_RDYLNK,
            f"{who} QP MTU enum {mtu} is not 1..5 (256..4096 bytes); the QP cannot be readied",
        )


# ---------------------------------------------------------------------------- client
class ClientSmcrNegotiation(_SmcrNegotiation):
    """The connecting side: Proposal → Accept (or Decline) → Confirm."""

    _expect = ClcType.ACCEPT
    role = Role.CLIENT

    def __init__(self, facts: SmcrFacts, resources: SmcrResources) -> None:
        super().__init__(facts, resources)
        self.proposal: Proposal | None = None
        self.choice_v1: SmcrChoice | None = None
        self.choice_v2: SmcrChoice | None = None
        self.why_not: list[str] = []

    def _offers(self) -> None:
        """``smc_find_proposal_devices`` for SMC-R: which paths we can offer, and why not."""
        f = self.facts
        if not f.smcr_v1:
            self.why_not.append("SMC-Rv1 is disabled here (modes.smcr_v1)")
        else:
            # the kernel looks for the device first and sets the Proposal's prefix afterwards
            got = choose_smcr_v1(f.ports, f.vlan_id, f.routing)
            if isinstance(got, RouteDecline):
                self.why_not.append(f"SMC-Rv1: {got.explanation}")
            elif f.ip_prefixes is None:
                self.why_not.append(
                    f"SMC-Rv1: no address of the connection's interface has a subnet containing "
                    f"its source {f.local_addr}, so the Proposal can carry no IP prefix"
                )
            else:
                self.choice_v1 = got
        if not f.smcr_v2:
            self.why_not.append("SMC-Rv2 is disabled here (modes.smcr_v2)")
        else:
            got = choose_smcr_v2_client(
                f.ports, f.vlan_id, f.local_addr, f.routing, ueid_count=len(f.eids.ueids)
            )
            if isinstance(got, RouteDecline):
                self.why_not.append(f"SMC-Rv2: {got.explanation}")
            else:
                self.choice_v2 = got

    def start(self) -> SmcrStep:
        """The first message to send (a Proposal, or a Decline when we have no device), or an
        immediate fallback without a byte sent when the peer is not known to speak SMC."""
        if self._state is not _State.INIT:
            raise NegotiationError("already started")
        f = self.facts
        # __smc_connect: the first Decline's version depends on ISMv2 capability
        self._decline_version = 2 if f.has_loopback else 1
        if not f.peer_speaks_smc:
            return self._fall_back(
                DeclineReason.PEERNOSMC,
                "the peer is not known to speak SMC (no registered listener or configured peer)",
                declined=False,
            )
        self._offers()
        use_d = f.has_loopback
        if self.smcd is not None and not use_d:
            self.why_not.append("SMC-Dv2: loopback-ism is disabled here")
        v1, v2 = self.choice_v1, self.choice_v2
        if v1 is None and v2 is None and not use_d:
            return self._decline_and_fall_back(
                DeclineReason.NOSMCDEV, f"no SMC device: {_joined(self.why_not)}"
            )
        typev1 = SmcType.R if v1 is not None else SmcType.N
        r2, d2 = v2 is not None, use_d
        typev2 = SmcType.B if (r2 and d2) else SmcType.R if r2 else SmcType.D if d2 else SmcType.N
        eids = f.eids
        smcd_ext: SmcdV2Extension | None = None
        if d2:
            assert self.smcd is not None and self.smcd.facts.loopback is not None
            seid = eids.seid if eids.seid_enabled and eids.seid else ""
            smcd_ext = SmcdV2Extension(seid=seid, devices=(self.smcd.facts.loopback,))
        v2_ext = None
        if typev2 != SmcType.N:
            v2_ext = V2Extension(
                eids=eids.ueids,
                release=SMC_RELEASE,
                seid_indicator=d2 and eids.seid_enabled,
                roce_gid=v2.gid.gid if v2 is not None else bytes(16),
                max_conns=f.max_conns if r2 else 0,
                max_links=f.max_links if r2 else 0,
                feature_mask=SMC_FEATURE_MASK,
            )
        r_choice = v1 if v1 is not None else v2
        self.proposal = Proposal(
            typev1=typev1,
            typev2=typev2,
            peer_id=f.system_id if r_choice is not None else bytes(8),
            gid=v1.gid.gid if v1 is not None else bytes(16),
            mac=self._local_mac(r_choice) if r_choice is not None else bytes(6),
            version=2,
            ip_prefixes=f.ip_prefixes if typev1 != SmcType.N else None,
            v2_ext=v2_ext,
            smcd_v2_ext=smcd_ext,
        )
        self._state = _State.WAIT
        return SmcrStep((self.proposal,))

    def _handle(self, msg: ClcMessage) -> SmcrStep:
        if not isinstance(msg, Accept):
            return self._violation(f"expected ACCEPT, got {type(msg).__name__}")
        self._decline_version = 1 if msg.version == 1 else 2
        p = self.proposal
        assert p is not None
        # smc_connect_check_aclc
        offered = p.typev2 if msg.version >= 2 else p.typev1
        is_d = isinstance(msg.info, SmcdInfo)
        if not (offered.has_d if is_d else offered.has_r):
            kind = "SMC-D" if is_d else "SMC-R"
            return self._decline_and_fall_back(
                DeclineReason.MODEUNSUPP,
                f"the peer accepted {kind} v{msg.version}, which we did not offer "
                f"(typev1 {p.typev1.name}, typev2 {p.typev2.name})",
            )
        if is_d:
            return self._to_smcd(msg)
        return self._accept_r(msg)

    def _to_smcd(self, msg: Accept) -> SmcrStep:
        """The server chose SMC-Dv2: the SMC-D client role decides the rest."""
        assert self.smcd is not None and self.proposal is not None
        d = ClientNegotiation(self.smcd.facts, self.smcd.resources)
        d.proposal = self.proposal
        d._state = _State.WAIT
        step = d._handle(msg)
        return self._finish(SmcrStep.of(step))

    def _accept_r(self, msg: Accept) -> SmcrStep:
        f = self.facts
        info = msg.info
        assert isinstance(info, SmcrInfo)
        version = 1 if msg.version == 1 else 2
        choice = self.choice_v1 if version == 1 else self.choice_v2
        assert choice is not None
        release, feature_mask = 0, 0
        max_conns, max_links = f.max_conns, f.max_links
        v2_direct, nexthop = False, None
        if version == 2 and msg.first_contact:
            fce = msg.fce
            assert fce is not None
            saddr = f.local_addr
            assert isinstance(saddr, ipaddress.IPv4Address)  # v2 is offered over IPv4 only
            path = check_accept_path(fce.v2_direct, saddr, info.gid, info.mac, f.routing)
            if isinstance(path, RouteDecline):
                raise _Failed(path.code, path.explanation)
            v2_direct, nexthop = not path.uses_gateway, path.nexthop_mac
            if fce.release > SMC_RELEASE:
                raise _Failed(
                    DeclineReason.VERSMISMAT,
                    f"the peer accepted release {fce.release}; we offered {SMC_RELEASE}",
                )
            release = fce.release
            if release >= 1:  # smc_clc_clnt_v2x_features_validate
                if fce.max_conns < SMC_CONN_PER_LGR_MIN:
                    raise _Failed(
                        DeclineReason.MAXCONNERR,
                        f"the peer accepted max_conns {fce.max_conns}; a link group needs at "
                        f"least {SMC_CONN_PER_LGR_MIN}",
                    )
                if not SMC_LINKS_ADD_LNK_MIN <= fce.max_links <= SMC_LINKS_ADD_LNK_MAX:
                    raise _Failed(
                        DeclineReason.MAXLINKERR,
                        f"the peer accepted max_links {fce.max_links}; it must be "
                        f"{SMC_LINKS_ADD_LNK_MIN}..{SMC_LINKS_ADD_LNK_MAX}",
                    )
                max_conns, max_links = fce.max_conns, fce.max_links
                feature_mask = fce.feature_mask & SMC_FEATURE_MASK
        local_mac = self._local_mac(choice)
        # smc_conn_create (client): a new link group iff the server says first contact
        if msg.first_contact:
            _check_mtu(info.qp_mtu, "the server's")
            first = self._create(
                LinkGroupRequest(
                    role=Role.CLIENT,
                    version=version,
                    peer_system_id=info.peer_id,
                    peer_gid=info.gid,
                    peer_mac=info.mac,
                    vlan_id=f.vlan_id,
                    local=choice.gid,
                    local_mac=local_mac,
                    max_conns=max_conns,
                    max_links=max_links,
                    release=release,
                    uses_gateway=version == 2 and not v2_direct,
                    nexthop_mac=nexthop,
                )
            )
            lgr_id, link_id, qpn, psn = first.lgr_id, first.link_id, first.qpn, first.psn
            mtu = min(first.mtu, info.qp_mtu)
            gid, mac = choice.gid.gid, local_mac
        else:
            found = find_link_group(
                self.resources.link_groups(),
                role=Role.CLIENT,
                version=version,
                peer_system_id=info.peer_id,
                peer_gid=info.gid,
                peer_mac=info.mac,
                vlan_id=f.vlan_id,
                clc_qpn=info.qpn,
            )
            if found is None:
                raise _Failed(
                    DeclineReason.SYNCERR,
                    f"the peer reuses a link group (its QP {info.qpn:#x}) that we do not have",
                )
            group, link = found
            lgr_id, link_id, qpn, psn, mtu = (
                group.lgr_id, link.link_id, link.qpn, link.psn, link.mtu
            )  # fmt: skip
            gid, mac = link.gid, link.mac
        grant = self._allocate(lgr_id, link_id)
        local_choice = choice if msg.first_contact else _reused(choice, gid)
        conf_info = self._info(local_choice, mac, qpn, psn, mtu, grant)
        fce_out = None
        gids: tuple[bytes, ...] = ()
        if version == 2 and msg.first_contact:
            fce_out = self._fce(release, v2_direct, max_conns, max_links, feature_mask)
            gids = self._gid_list(choice)
        confirm = Confirm(
            info=conf_info,
            version=version,
            first_contact=msg.first_contact,
            eid=msg.eid if version == 2 else "",
            fce=fce_out,
            gid_list=gids,
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
            peer_rmbe_size=16 * 1024 << info.rmbe_size,
            peer_alert_token=info.rmbe_alert_token,
            local=local_choice,
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
            release=release,
            max_conns=max_conns,
            max_links=max_links,
            feature_mask=feature_mask,
            peer_hostname=msg.fce.hostname if msg.fce is not None else "",
        )
        return self._success(outcome, (confirm,))

    def _gid_list(self, choice: SmcrChoice) -> tuple[bytes, ...]:
        """``smc_fill_gid_list``: our link's RoCEv2 GID and one of another port that fits."""
        f = self.facts
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


# ---------------------------------------------------------------------------- server
@dataclass(frozen=True)
class _Accepted:
    version: int
    lgr_id: int
    link_id: int
    first_contact: bool
    choice: SmcrChoice
    mac: bytes
    mtu: int
    grant: RmbGrant
    release: int
    max_conns: int
    max_links: int
    feature_mask: int
    eid: str
    peer_system_id: bytes
    v2_direct: bool
    nexthop_mac: bytes | None


class ServerSmcrNegotiation(_SmcrNegotiation):
    """The accepting side: Proposal (or Decline) → Accept → Confirm (or Decline)."""

    _expect = ClcType.PROPOSAL
    role = Role.SERVER

    def __init__(self, facts: SmcrFacts, resources: SmcrResources) -> None:
        super().__init__(facts, resources)
        self._state = _State.WAIT
        self.proposal: Proposal | None = None
        self.why_not: list[str] = []
        self._accepted: _Accepted | None = None

    def _handle(self, msg: ClcMessage) -> SmcrStep:
        if isinstance(msg, Proposal) and self.proposal is None:
            return self._on_proposal(msg)
        if isinstance(msg, Confirm) and self._accepted is not None:
            return self._on_confirm(msg)
        return self._violation(f"unexpected {type(msg).__name__}")

    # ---- Proposal -----------------------------------------------------------------------------

    def _on_proposal(self, p: Proposal) -> SmcrStep:
        self.proposal = p
        self._decline_version = 2 if p.version > 1 else 1
        f = self.facts
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
                    if not f.has_loopback:
                        smcd_v2, rc = False, DeclineReason.NOISM2SUPP
                    elif p.smcd_v2_ext is None:
                        smcd_v2, rc = False, DeclineReason.NOV2DEXT
                    elif not v2.eids and not v2.seid_indicator:
                        smcd_v2, rc = False, DeclineReason.NOUEID
                if smcr_v2 and not v2.eids:
                    smcr_v2, rc = False, DeclineReason.NOUEID
                    self.why_not.append("SMC-Rv2: the peer offers no UEID")
                release = min(v2.release, SMC_RELEASE)
        if not (smcd_v1 or smcr_v1 or smcd_v2 or smcr_v2):
            return self._decline_and_fall_back(
                rc, f"no common SMC version/path: {_joined(self.why_not)}"
            )
        # smc_clc_srv_v2x_features_validate
        feature_mask = SMC_FEATURE_MASK
        max_conns, max_links = f.max_conns, f.max_links
        if (smcd_v2 or smcr_v2) and release >= 1:
            assert v2 is not None
            if smcr_v2:
                max_conns = min(v2.max_conns, f.max_conns)
                if max_conns < SMC_CONN_PER_LGR_MIN:
                    return self._decline_and_fall_back(
                        DeclineReason.MAXCONNERR,
                        f"the peer offers max_conns {v2.max_conns}; a link group needs at "
                        f"least {SMC_CONN_PER_LGR_MIN}",
                    )
                max_links = min(v2.max_links, f.max_links)
                if max_links < SMC_LINKS_ADD_LNK_MIN:
                    return self._decline_and_fall_back(
                        DeclineReason.MAXLINKERR,
                        f"the peer offers max_links {v2.max_links}; at least "
                        f"{SMC_LINKS_ADD_LNK_MIN} is needed",
                    )
            feature_mask = v2.feature_mask & SMC_FEATURE_MASK
        # smc_listen_find_device
        store: list[int] = []
        if smcd_v2 and self.smcd is not None:
            d = ServerNegotiation(self.smcd.facts, self.smcd.resources)
            accept_d = d._find_ism_v2(p, smcd_v2, release, feature_mask, store)
            if accept_d is not None:
                d.proposal = p
                d._decline_version = 2
                d._expect = ClcType.CONFIRM
                self._delegate = d
                return SmcrStep((accept_d,))
            if store and store[-1] == DeclineReason.NOSMCD2DEV:
                self.why_not.append(
                    "SMC-Dv2: the peer's loopback-ism is not ours or the pairing is not verified"
                )
        prfx_rc = 0
        if p.typev1 != SmcType.N and not f.prefix_match:
            prfx_rc = DeclineReason.DIFFPREFIX
            store.append(prfx_rc)
            self.why_not.append("SMC v1: the peer's IP subnet is not ours")
        if not prfx_rc and smcd_v1:
            store.append(DeclineReason.NOSMCDDEV)  # no ISMv1 device: loopback-ism is v2 only
        if not p.typev1.has_r and not p.typev2.has_r:
            return self._decline_and_fall_back(
                store[0] if store else DeclineReason.NOSMCDDEV,
                f"no usable SMC-D device: {_joined(self.why_not)}",
            )
        if smcr_v2:
            accept = self._rdma_v2(p, release, max_conns, max_links, feature_mask, store)
            if accept is not None:
                return self._wait_confirm(accept)
        if prfx_rc:
            return self._decline_and_fall_back(
                DeclineReason.NOSMCDEV, f"no usable SMC device: {_joined(self.why_not)}"
            )
        accept = self._rdma_v1(p, smcr_v1, store)
        if accept is not None:
            return self._wait_confirm(accept)
        code = store[0] if store else DeclineReason.NOSMCDEV
        return self._decline_and_fall_back(code, f"no usable SMC device: {_joined(self.why_not)}")

    def _wait_confirm(self, accept: Accept) -> SmcrStep:
        self._state = _State.WAIT
        self._expect = ClcType.CONFIRM
        return SmcrStep((accept,))

    def _rdma_v2(
        self,
        p: Proposal,
        release: int,
        max_conns: int,
        max_links: int,
        feature_mask: int,
        store: list[int],
    ) -> Accept | None:
        """``smc_find_rdma_v2_device_serv``."""
        f = self.facts
        v2 = p.v2_ext
        assert v2 is not None
        if not f.smcr_v2:
            store.append(DeclineReason.NOSMCRDEV)
            self.why_not.append("SMC-Rv2 is disabled here (modes.smcr_v2)")
            return None
        got = choose_smcr_v2_server(
            f.ports,
            f.vlan_id,
            f.local_addr,
            v2.roce_gid,
            p.mac,
            f.routing,
            local_ueids=f.eids.ueids_wire(),
            peer_ueids=_wire(v2.eids),
        )
        if isinstance(got, RouteDecline):
            if got.code != DeclineReason.NOUEID:  # the kernel stores no code for a mismatch
                store.append(got.code)
            self.why_not.append(f"SMC-Rv2: {got.explanation}")
            return None
        eid = (got.negotiated_eid or b"").rstrip(b" \0").decode("ascii", "replace")
        return self._rdma_init(
            p, 2, got, v2.roce_gid, release, max_conns, max_links, feature_mask, eid, store
        )

    def _rdma_v1(self, p: Proposal, smcr_v1: bool, store: list[int]) -> Accept | None:
        """``smc_find_rdma_v1_device_serv``: NOSMCDEV whenever there is no v1 path."""
        f = self.facts
        if not smcr_v1:
            store.append(DeclineReason.NOSMCDEV)
            self.why_not.append("SMC-Rv1: the peer does not offer it")
            return None
        if not f.smcr_v1:
            store.append(DeclineReason.NOSMCDEV)
            self.why_not.append("SMC-Rv1 is disabled here (modes.smcr_v1)")
            return None
        got = choose_smcr_v1(f.ports, f.vlan_id, f.routing)
        if isinstance(got, RouteDecline):
            store.append(DeclineReason.NOSMCDEV)
            self.why_not.append(f"SMC-Rv1: {got.explanation}")
            return None
        return self._rdma_init(p, 1, got, p.gid, 0, f.max_conns, f.max_links, 0, "", store)

    def _rdma_init(
        self,
        p: Proposal,
        version: int,
        choice: SmcrChoice,
        peer_gid: bytes,
        release: int,
        max_conns: int,
        max_links: int,
        feature_mask: int,
        eid: str,
        store: list[int],
    ) -> Accept | None:
        """``smc_listen_rdma_init`` + ``smc_listen_rdma_reg``: link group (reuse or first
        contact) and RMB; a failure stores its code and leaves nothing behind."""
        f = self.facts
        local_mac = self._local_mac(choice)
        uses_gateway = version == 2 and not choice.v2_direct
        try:
            found = find_link_group(
                self.resources.link_groups(),
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
                    link_id = self.resources.pick_link(group.lgr_id)
                except SmcError as exc:
                    code = _reason_of(exc, DeclineReason.NOACTLINK)
                    raise _Failed(code, f"no active link in link group {group.lgr_id}") from exc
                link = next((lk for lk in group.links if lk.link_id == link_id), None)
                if link is None:
                    raise _Failed(
                        DeclineReason.NOACTLINK, f"link {link_id} of {group.lgr_id} is gone"
                    )
                lgr_id, first_contact = group.lgr_id, False
                qpn, psn, mtu, mac = link.qpn, link.psn, link.mtu, link.mac
                choice = _reused(choice, link.gid)
            else:
                first = self._create(
                    LinkGroupRequest(
                        role=Role.SERVER,
                        version=version,
                        peer_system_id=p.peer_id,
                        peer_gid=peer_gid,
                        peer_mac=p.mac,
                        vlan_id=f.vlan_id,
                        local=choice.gid,
                        local_mac=local_mac,
                        max_conns=max_conns,
                        max_links=max_links,
                        release=release,
                        uses_gateway=uses_gateway,
                        nexthop_mac=choice.nexthop_mac,
                    )
                )
                lgr_id, link_id, first_contact = first.lgr_id, first.link_id, True
                qpn, psn, mtu, mac = first.qpn, first.psn, first.mtu, local_mac
            grant = self._allocate(lgr_id, link_id)
        except _Failed as fail:
            self._release()
            store.append(fail.code)
            self.why_not.append(f"SMC-Rv{version}: {fail.detail}")
            return None
        self._accepted = _Accepted(
            version=version,
            lgr_id=lgr_id,
            link_id=link_id,
            first_contact=first_contact,
            choice=choice,
            mac=mac,
            mtu=mtu,
            grant=grant,
            release=release,
            max_conns=max_conns,
            max_links=max_links,
            feature_mask=feature_mask,
            eid=eid,
            peer_system_id=p.peer_id,
            v2_direct=choice.v2_direct if version == 2 else False,
            nexthop_mac=choice.nexthop_mac if version == 2 else None,
        )
        fce = None
        if version == 2 and first_contact:
            fce = self._fce(release, choice.v2_direct, max_conns, max_links, feature_mask)
        return Accept(
            info=self._info(choice, mac, qpn, psn, mtu, grant),
            version=version,
            first_contact=first_contact,
            eid=eid,
            fce=fce,
        )

    # ---- Confirm ------------------------------------------------------------------------------

    def _on_confirm(self, c: Confirm) -> SmcrStep:
        acc = self._accepted
        assert acc is not None
        info = c.info
        if not isinstance(info, SmcrInfo) or (1 if c.version == 1 else 2) != acc.version:
            return self._violation(f"the Confirm is not the SMC-Rv{acc.version} we accepted")
        feature_mask = acc.feature_mask
        # smc_clc_v2x_features_confirm_check
        if acc.version == 2 and c.first_contact:
            fce = c.fce
            assert fce is not None
            if fce.release != acc.release:
                raise _Failed(
                    DeclineReason.RELEASEERR,
                    f"the Confirm carries release {fce.release}, we accepted {acc.release}",
                )
            if fce.release >= 1:
                if fce.max_conns != acc.max_conns:
                    raise _Failed(
                        DeclineReason.MAXCONNERR,
                        f"the Confirm carries max_conns {fce.max_conns}, we accepted "
                        f"{acc.max_conns}",
                    )
                if fce.max_links != acc.max_links:
                    raise _Failed(
                        DeclineReason.MAXLINKERR,
                        f"the Confirm carries max_links {fce.max_links}, we accepted "
                        f"{acc.max_links}",
                    )
                feature_mask = fce.feature_mask & SMC_FEATURE_MASK
        if acc.first_contact:
            _check_mtu(info.qp_mtu, "the client's")
        release = acc.release if acc.first_contact else 0
        grant = acc.grant
        outcome = SmcrOutcome(
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
            peer_rmbe_size=16 * 1024 << info.rmbe_size,
            peer_alert_token=info.rmbe_alert_token,
            local=acc.choice,
            local_mac=acc.mac,
            local_rkey=grant.rkey,
            local_vaddr=grant.vaddr,
            local_rmbe_size=grant.size,
            alert_token=grant.alert_token,
            qp_mtu=min(acc.mtu, info.qp_mtu) if acc.first_contact else acc.mtu,
            vlan_id=self.facts.vlan_id,
            v2_direct=acc.v2_direct,
            nexthop_mac=acc.nexthop_mac,
            negotiated_eid=acc.eid,
            release=release,
            max_conns=acc.max_conns,
            max_links=acc.max_links,
            feature_mask=feature_mask if acc.version == 2 else 0,
            peer_gid_list=c.gid_list,
            peer_hostname=c.fce.hostname if c.fce is not None else "",
        )
        return self._success(outcome)
