"""Sans-IO CLC negotiation: the client and server roles of the SMC handshake, choosing SMC-Dv2 over
loopback-ism or falling back to TCP with the reason code the Linux kernel would use.

No sockets here. A driver feeds received bytes (never more than :attr:`bytes_needed`, so that bytes
after the last CLC message stay in the TCP socket for the application, as the kernel's
``smc_clc_wait_msg`` peeks the header and then reads exactly ``length`` bytes), tells about
timeouts and EOF, and sends what each :class:`Step` says. Resources (link groups, DMBs, the pairing
check) come through the small :class:`SmcdResources` protocol, which
:class:`~smcd_daemon.transport.loopback.LoopbackSession` implements.

The decisions follow ``net/smc/af_smc.c`` and ``smc_clc.c`` (6.12; v2.1 from 6.6, Emulated-ISM from
6.8, loopback-ism 6.10):

Client (``__smc_connect``, ``smc_connect_check_aclc``, ``smc_connect_ism``, ``smc_conn_create``):
  * peer not known to speak SMC → fallback PEERNOSMC, nothing sent (``syn_smc`` unset);
  * no usable device (loopback-ism disabled) → Decline NOSMCDEV instead of a Proposal
    (``smc_find_proposal_devices`` → ``smc_connect_decline_fallback``);
  * Proposal: version 2, typev1 N, typev2 D, our UEIDs (sent even when there are none: the kernel
    client does not check the UEID count for SMC-D), SEID iff enabled, release 1, feature mask
    ``SMC_SPF_EMULATED_ISM_DEV``, loopback-ism as two GID/CHID entries;
  * Accept of a type not offered → MODEUNSUPP; first-contact FCE with a release above ours →
    VERSMISMAT; release ≥ 1 → feature mask = ours ∧ peer's
    (``smc_clc_clnt_v2x_features_validate``); accepted CHID not offered → protocol error;
  * the peer GID must be our own loopback GID and a server half of this daemon must have claimed
    our pairing entry, else Decline NOSMCD2DEV (the kernel needs no such check: both ends are in
    one kernel);
  * server reuses a link group (no first contact) that we do not have → Decline SYNCERR with the
    out-of-sync bit (``smc_conn_create``); DMB registration failing → MAX_DMB (limit) or MEM;
    attaching the peer DMB failing → MEM (mainline: "try to fallback");
  * Confirm echoes the Accept's EID; first contact (a link group new *here*) carries the FCE with
    the Accept's release and the negotiated feature mask.

Server (``smc_listen_work``, ``smc_listen_v2_check``, ``smc_clc_srv_v2x_features_validate``,
``smc_listen_find_device``, ``smc_find_ism_v2_device_serv``, ``smc_check_ism_v2_match``,
``smc_clc_match_eid``, ``smc_clc_v2x_features_confirm_check``), codes exactly as the kernel picks
them:
  * no v2 path offered and no v1 path → PEERNOSMC; SMC-Dv2 offered but loopback-ism disabled here
    → NOISM2SUPP; SMC-Dv2 without UEIDs and without SEID → NOUEID (SMC-Rv2 without UEIDs →
    NOUEID);
  * release = min(peer's, ours); SMC-Rv2 offered with release ≥ 1: max_conns/max_links limits
    (MAXCONNERR/MAXLINKERR), as the kernel checks them before looking for devices;
  * no offered device is our loopback-ism (CHID 0xFFFF and our 128-bit GID) *with a verified
    pairing* → NOSMCD2DEV; device found but no common EID → no code of its own (the kernel stores
    none), so the result is the v1/SMC-R chain's: NOSMCDDEV for an SMC-D-only Proposal;
  * link group per peer GID (first contact iff none exists), DMB registration: MAX_DMB or MEM;
  * Confirm: first contact with a release other than the accepted one → RELEASEERR; release ≥ 1:
    feature mask = the Confirm's; attaching the client DMB failing → MEM.

Both: a received Decline → fallback PEERDECL with the peer's diagnosis (no Decline back), its
out-of-sync bit reported.

Where the kernel has no decline code, because it aborts the connection instead of falling back
(``smc_clc_wait_msg`` returns -EPROTO for a malformed or unexpected message, -EAGAIN → -ETIMEDOUT
for a timeout, -ECONNRESET for EOF; ``smc_connect_decline_fallback``/``smc_listen_decline`` then
fail the socket), we still decline and fall back, so that the application keeps a working TCP
connection, and record the errno the kernel would have failed with in
:attr:`FallbackOutcome.kernel_errno`:
  * malformed or unexpected message → Decline :data:`DECL_PROTOCOL_ERROR` (CNFERR, 0x03000000:
    the two ends' SMC stacks do not agree; the kernel peer only records the code);
  * timeout → Decline :data:`DECL_CLC_TIMEOUT` (0x02000000, the kernel's generic "timeout" code of
    its first SMC release; current kernels have only the LLC-specific 0x0201/0x0202 codes);
  * EOF → no Decline (nobody is listening), reason :data:`DECL_PROTOCOL_ERROR`.
"""

from __future__ import annotations

import contextlib
import errno
import re
from dataclasses import dataclass, field
from enum import Enum
from typing import Literal, Protocol

from smcd_daemon.core.buffers import SMC_BUF_MIN, DmbAllocationError, decompress
from smcd_daemon.core.eid import EidTable
from smcd_daemon.errors import ProtocolError, SmcError
from smcd_daemon.wire.clc import (
    CLC_HEADER_LEN,
    LOOPBACK_ISM_CHID,
    SMCD_EYECATCHER,
    SMCR_EYECATCHER,
    Accept,
    ClcHeader,
    ClcMessage,
    ClcType,
    Confirm,
    Decline,
    FirstContactExt,
    IsmDevice,
    OsType,
    Proposal,
    SmcdInfo,
    SmcdV2Extension,
    SmcType,
    V2Extension,
    decode,
    peek_header,
)
from smcd_daemon.wire.reasons import DeclineReason, LegacyDeclineReason

__all__ = [
    "CLC_WAIT_TIME",
    "DECL_CLC_TIMEOUT",
    "DECL_PROTOCOL_ERROR",
    "SMC_FEATURE_MASK",
    "SMC_RELEASE",
    "SMC_SPF_EMULATED_ISM_DEV",
    "ClientNegotiation",
    "FallbackOutcome",
    "NegotiationError",
    "NegotiationFacts",
    "Outcome",
    "ServerNegotiation",
    "SmcdLoopbackOutcome",
    "SmcdResources",
    "Step",
    "classify_first_bytes",
]

CLC_WAIT_TIME = 6.0
"""Seconds to wait for each CLC message (``CLC_WAIT_TIME``, 2 * HZ * 3)."""
SMC_RELEASE = 1
"""Highest SMC v2 release we speak (``SMC_RELEASE_1``: v2.1)."""
SMC_SPF_EMULATED_ISM_DEV = 0x0001
SMC_FEATURE_MASK = SMC_SPF_EMULATED_ISM_DEV
"""Supplemental features we support (``SMC_FEATURE_MASK``)."""
SMC_CONN_PER_LGR_MIN = 16
SMC_CONN_PER_LGR_MAX = 255
SMC_LINKS_ADD_LNK_MIN = 1
SMC_LINKS_ADD_LNK_MAX = 2

DECL_PROTOCOL_ERROR = int(DeclineReason.CNFERR)
"""Decline code for a malformed/unexpected CLC message (the kernel aborts with EPROTO)."""
DECL_CLC_TIMEOUT = int(LegacyDeclineReason.TIMEOUT)
"""Decline code for a CLC message that did not arrive in time (the kernel aborts: ETIMEDOUT)."""


class NegotiationError(SmcError):
    """The *driver* misused a negotiation (fed it after the end, or more than it asked for).
    Hostile peer bytes never raise: they end in a :class:`FallbackOutcome`."""


class SmcdResources(Protocol):
    """What a negotiation needs from the loopback device for one connection."""

    def pairing_verified(self) -> bool:
        """Server: this daemon holds the client half of this TCP connection."""
        ...

    def pairing_confirmed(self) -> bool:
        """Client: a server half of this daemon claimed our half."""
        ...

    def find_link_group(self, peer_gid: int) -> int | None: ...

    def create_link_group(self, peer_gid: int) -> int: ...

    def discard_link_group(self, link_id: int) -> None: ...

    def register_dmb(self, size: int, min_size: int) -> _Grant:
        """Raises :class:`~smcd_daemon.core.buffers.DmbAllocationError`."""
        ...

    def unregister_dmb(self, token: int) -> None: ...

    def attach_dmb(self, token: int) -> _Grant:
        """Raises :class:`~smcd_daemon.errors.SmcError` for an unknown token."""
        ...

    def detach_dmb(self, token: int) -> None: ...


class _Grant(Protocol):
    @property
    def token(self) -> int: ...

    @property
    def size(self) -> int: ...

    @property
    def size_comp(self) -> int: ...


_HOSTNAME_OK = re.compile(r"[^\x21-\x7e]")


@dataclass(frozen=True)
class NegotiationFacts:
    """What this host offers. ``loopback`` is our loopback-ism device (None when absent or
    disabled); ``dmb_size``/``min_dmb_size`` bound the DMB we register; ``prefix_match`` is the
    server's IP prefix check (``smc_clc_prfx_match``), which only matters for v1 paths."""

    eids: EidTable
    loopback: IsmDevice | None
    smcd_enabled: bool = True
    hostname: str = ""
    dmb_size: int = 64 * 1024
    min_dmb_size: int = SMC_BUF_MIN
    clc_wait: float = CLC_WAIT_TIME
    peer_speaks_smc: bool = True
    prefix_match: bool = True

    @classmethod
    def from_config(
        cls,
        config: object,
        eids: EidTable,
        loopback: IsmDevice | None,
        *,
        hostname: str = "",
        peer_speaks_smc: bool = True,
    ) -> NegotiationFacts:
        """From a :class:`smcd_daemon.config.Config` (``modes``, ``buffers``, ``timeouts``)."""
        buffers = config.buffers  # type: ignore[attr-defined]
        size = min(max(buffers.default_size, buffers.min_dmb_size), buffers.max_dmb_size)
        return cls(
            eids=eids,
            loopback=loopback,
            smcd_enabled=config.modes.smcd_loopback,  # type: ignore[attr-defined]
            hostname=hostname,
            dmb_size=size,
            min_dmb_size=buffers.min_dmb_size,
            clc_wait=config.timeouts.clc_wait,  # type: ignore[attr-defined]
            peer_speaks_smc=peer_speaks_smc,
        )

    @property
    def wire_hostname(self) -> str:
        """The FCE host name: printable ASCII, at most 32 bytes (the kernel copies nodename)."""
        return _HOSTNAME_OK.sub("", self.hostname)[:32]

    @property
    def has_loopback(self) -> bool:
        return self.smcd_enabled and self.loopback is not None


@dataclass(frozen=True)
class SmcdLoopbackOutcome:
    """The handshake chose SMC-Dv2 over loopback-ism. Sizes are in bytes (whole DMB incl. the
    32-byte CDC header). ``first_contact``: this side created the link group ``link_id``;
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
class FallbackOutcome:
    """Stay on TCP. ``reason`` is our decline/fallback code (PEERDECL when the peer declined, then
    ``peer_diagnosis`` is its code); ``local`` tells who decided; ``declined``: we sent a Decline;
    ``out_of_sync``: a received Decline carried the out-of-sync bit (terminate the link group);
    ``kernel_errno``: the kernel would have failed the connection with this errno instead of
    falling back (see the module docstring)."""

    reason: int
    peer_diagnosis: int | None
    local: bool
    detail: str
    declined: bool = False
    out_of_sync: bool = False
    kernel_errno: int | None = None

    mode: Literal["tcp"] = "tcp"


Outcome = SmcdLoopbackOutcome | FallbackOutcome


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


def classify_first_bytes(peeked: bytes) -> Literal["smc", "not-smc", "need-more"]:
    """Server: do the first bytes the client sent (MSG_PEEK, nothing consumed) start a CLC message?

    A CLC message starts with the EBCDIC eyecatcher "SMCR" or "SMCD" (a Proposal or, from a client
    without devices, a Decline). Four bytes decide; fewer that still spell the start of an
    eyecatcher need more (bounded by the caller's wait: a client that waits for the server to speak
    first never completes them); anything else is plain TCP and stays untouched."""
    head = bytes(peeked[:4])
    for eye in (SMCR_EYECATCHER, SMCD_EYECATCHER):
        if eye.startswith(head):
            return "smc" if len(head) == 4 else "need-more"
    return "not-smc"


class _State(Enum):
    INIT = "init"
    WAIT = "wait"
    DONE = "done"


def _decline(code: int, version: int) -> Decline:
    v2 = version >= 2
    return Decline(
        diagnosis=code,
        version=2 if v2 else 1,
        out_of_sync=code == DeclineReason.SYNCERR,
        os_type=OsType.LINUX if v2 else OsType.NONE,
        diagnosis_v2=(0, 0, 0, 0) if v2 else (),
    )


def _name(code: int) -> str:
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
    return f"{detail}: declined with {_name(code)}"


def peer_decline_fallback(msg: Decline, extra: str = "") -> FallbackOutcome:
    """The outcome when the peer sent a Decline: PEERDECL locally, its code as the diagnosis."""
    oos = " (out of sync: terminate the link group)" if msg.out_of_sync else ""
    return FallbackOutcome(
        reason=int(DeclineReason.PEERDECL),
        peer_diagnosis=msg.diagnosis,
        local=False,
        detail=f"the peer declined with {_name(msg.diagnosis)}{oos}{extra}",
        out_of_sync=msg.out_of_sync,
    )


_HEADERS: dict[bytes, ClcHeader] = {}
"""Valid 8-byte CLC headers seen before, parsed (a handful: type, length and version repeat)."""
_DECODED_PROPOSALS: dict[bytes, Proposal] = {}
"""Proposals by their bytes: clients of one host send the same few byte-for-byte (ours are
cached too), and a decoded message is frozen, so the parse is done once per distinct one."""


class ClcFramer:
    """Reads one CLC message at a time from the TCP byte stream, never more than it needs: the
    8-byte header first (what the kernel's ``smc_clc_wait_msg`` MSG_PEEKs), then the length the
    header announces, so bytes after the handshake stay in the application's socket. Shared by
    the SMC-D and SMC-R negotiations. Pure."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._length = 0

    @property
    def bytes_needed(self) -> int:
        if len(self._buf) < CLC_HEADER_LEN:
            return CLC_HEADER_LEN - len(self._buf)
        return self._length - len(self._buf)

    def feed(self, data: bytes, expect: ClcType) -> ClcMessage | str | None:
        """Take at most :attr:`bytes_needed` bytes. Returns the decoded message once it is
        complete, a protocol-violation text (bad header, unexpected type, malformed message),
        or None while more bytes are needed. Only ``expect`` or a Decline is acceptable."""
        self._buf += data
        if len(self._buf) < CLC_HEADER_LEN:
            return None
        if len(self._buf) == CLC_HEADER_LEN and not self._length:
            head = bytes(self._buf)
            hdr = _HEADERS.get(head)
            if hdr is None:
                try:
                    hdr = peek_header(head)
                except ProtocolError as exc:
                    return f"bad CLC header: {exc}"
                if len(_HEADERS) >= 64:
                    _HEADERS.clear()
                _HEADERS[head] = hdr
            if hdr.type not in (expect, ClcType.DECLINE):
                return f"expected {expect.name} or DECLINE, got {hdr.type.name}"
            self._length = hdr.length
        if len(self._buf) < self._length:
            return None
        raw = bytes(self._buf)
        self._buf.clear()
        self._length = 0
        if expect is ClcType.PROPOSAL:
            known = _DECODED_PROPOSALS.get(raw)
            if known is not None:
                return known
        try:
            msg = decode(raw)
        except ProtocolError as exc:
            return f"malformed {expect.name}: {exc}"
        if isinstance(msg, Proposal):
            if len(_DECODED_PROPOSALS) >= 16:
                _DECODED_PROPOSALS.clear()
            _DECODED_PROPOSALS[raw] = msg
        return msg


class _Negotiation:
    """Framing, declines, fallbacks and resource clean-up shared by both roles."""

    _expect: ClcType

    def __init__(self, facts: NegotiationFacts, resources: SmcdResources) -> None:
        self.facts = facts
        self.resources = resources
        self.outcome: Outcome | None = None
        self._state = _State.INIT
        self._framer = ClcFramer()
        self._decline_version = 2
        self._local_token: int | None = None
        self._peer_token: int | None = None
        self._new_link: int | None = None

    # ---- driver interface ---------------------------------------------------------------------

    @property
    def done(self) -> bool:
        return self._state is _State.DONE

    @property
    def bytes_needed(self) -> int:
        """How many bytes to read from the TCP socket next (never read more); 0 when not waiting."""
        if self._state is not _State.WAIT:
            return 0
        return self._framer.bytes_needed

    @property
    def timeout(self) -> float | None:
        """Seconds the current wait may last (restart the timer after each message)."""
        return self.facts.clc_wait if self._state is _State.WAIT else None

    def receive_data(self, data: bytes) -> Step:
        if self._state is not _State.WAIT:
            raise NegotiationError(f"not waiting for data (state {self._state.value})")
        if len(data) > self.bytes_needed:
            raise NegotiationError(f"fed {len(data)} bytes, asked for {self.bytes_needed}")
        got = self._framer.feed(data, self._expect)
        if got is None:
            return Step()
        if isinstance(got, str):
            return self._violation(got)
        if isinstance(got, Decline):
            return self._peer_declined(got)
        return self._handle(got)

    def on_timeout(self) -> Step:
        """The wait of :attr:`timeout` seconds expired."""
        if self._state is not _State.WAIT:
            raise NegotiationError(f"not waiting (state {self._state.value})")
        detail = f"no CLC {self._expect.name} within {self.facts.clc_wait:g} s"
        return self._decline_and_fall_back(DECL_CLC_TIMEOUT, detail, kernel_errno=errno.ETIMEDOUT)

    def on_eof(self) -> Step:
        """The peer closed its sending side during the handshake."""
        if self._state is not _State.WAIT:
            raise NegotiationError(f"not waiting (state {self._state.value})")
        detail = f"the peer closed the TCP connection while we waited for {self._expect.name}"
        return self._fall_back(
            DECL_PROTOCOL_ERROR, detail, declined=False, kernel_errno=errno.ECONNRESET
        )

    def abort(self, detail: str = "aborted by the daemon") -> Step:
        """Give up (e.g. the application went away): release everything, decline if waiting."""
        if self._state is _State.DONE:
            raise NegotiationError("already done")
        if self._state is _State.WAIT:
            return self._decline_and_fall_back(DeclineReason.INTERR, detail)
        return self._fall_back(DeclineReason.INTERR, detail, declined=False)

    # ---- endings ------------------------------------------------------------------------------

    def _handle(self, msg: ClcMessage) -> Step:
        raise NotImplementedError

    def _release(self) -> None:
        """Undo what this negotiation took: the peer DMB reference, our DMB, a new link group."""
        if self._peer_token is not None:
            with contextlib.suppress(SmcError):
                self.resources.detach_dmb(self._peer_token)
            self._peer_token = None
        if self._local_token is not None:
            with contextlib.suppress(SmcError):
                self.resources.unregister_dmb(self._local_token)
            self._local_token = None
        if self._new_link is not None:
            self.resources.discard_link_group(self._new_link)
            self._new_link = None

    def _finish(self, step: Step) -> Step:
        assert step.outcome is not None
        self._state = _State.DONE
        self.outcome = step.outcome
        return step

    def _fall_back(
        self, code: int, detail: str, *, declined: bool, kernel_errno: int | None = None
    ) -> Step:
        self._release()
        outcome = local_fallback(code, detail, declined=declined, kernel_errno=kernel_errno)
        send = (_decline(code, self._decline_version),) if declined else ()
        return self._finish(Step(send, outcome))

    def _decline_and_fall_back(
        self, code: int, detail: str, *, kernel_errno: int | None = None
    ) -> Step:
        return self._fall_back(
            code, declined_detail(code, detail), declined=True, kernel_errno=kernel_errno
        )

    def _violation(self, detail: str) -> Step:
        return self._decline_and_fall_back(
            DECL_PROTOCOL_ERROR, f"protocol error: {detail}", kernel_errno=errno.EPROTO
        )

    def _peer_declined(self, msg: Decline) -> Step:
        self._release()
        return self._finish(Step((), peer_decline_fallback(msg)))

    # ---- shared resource steps ----------------------------------------------------------------

    def _link_group(self, peer_gid: int) -> tuple[int, bool]:
        """(link id, first contact here): one link group per peer GID."""
        found = self.resources.find_link_group(peer_gid)
        if found is not None:
            return found, False
        self._new_link = self.resources.create_link_group(peer_gid)
        return self._new_link, True

    def _register(self) -> _Grant:
        grant = self.resources.register_dmb(self.facts.dmb_size, self.facts.min_dmb_size)
        self._local_token = grant.token
        return grant

    def _attach(self, token: int, advertised_comp: int) -> str | None:
        """Attach the peer's DMB; an error text if it does not exist or is not what the peer
        advertised."""
        try:
            grant = self.resources.attach_dmb(token)
        except SmcError as exc:
            return f"attaching the peer DMB {token:#x} failed: {exc}"
        self._peer_token = grant.token
        if grant.size != decompress(advertised_comp):
            return (
                f"the peer DMB has {grant.size} bytes but the peer advertised "
                f"{decompress(advertised_comp)}"
            )
        return None

    def _our_info(self, grant: _Grant, link_id: int) -> SmcdInfo:
        dev = self.facts.loopback
        assert dev is not None and dev.gid_ext is not None
        return SmcdInfo(
            gid=dev.gid,
            token=grant.token,
            link_id=link_id,
            dmbe_size=grant.size_comp,
            chid=dev.chid,
            gid_ext=dev.gid_ext,
        )

    def _fce(self, release: int, feature_mask: int) -> FirstContactExt:
        """``smc_clc_fill_fce`` for SMC-D: the 36-byte v2.0 form for release 0."""
        v2x = release >= 1
        return FirstContactExt(
            hostname=self.facts.wire_hostname,
            os_type=OsType.LINUX,
            release=release,
            v2x=v2x,
            feature_mask=feature_mask if v2x else 0,
        )

    def _success(
        self,
        *,
        peer_gid: int,
        peer_token: int,
        local: _Grant,
        peer_comp: int,
        link_id: int,
        first_contact: bool,
        peer_first_contact: bool,
        eid: str,
        release: int,
        feature_mask: int,
        send: tuple[ClcMessage, ...] = (),
    ) -> Step:
        self._new_link = None  # the link group is ours to keep now
        self._local_token = None
        self._peer_token = None
        outcome = SmcdLoopbackOutcome(
            peer_gid=peer_gid,
            peer_token=peer_token,
            local_token=local.token,
            local_dmb_size=local.size,
            peer_dmb_size=decompress(peer_comp),
            link_id=link_id,
            first_contact=first_contact,
            peer_first_contact=peer_first_contact,
            negotiated_eid=eid,
            release=release,
            feature_mask=feature_mask,
        )
        return self._finish(Step(send, outcome))


_PROPOSALS: dict[tuple[object, ...], tuple[Proposal, bytes]] = {}
"""A client's Proposal depends only on the EIDs and the device offered: built and encoded once
per combination (frozen messages, so sharing them is safe)."""


class ClientNegotiation(_Negotiation):
    """The connecting side: Proposal → Accept (or Decline) → Confirm."""

    _expect = ClcType.ACCEPT

    def __init__(self, facts: NegotiationFacts, resources: SmcdResources) -> None:
        super().__init__(facts, resources)
        self.proposal: Proposal | None = None

    def start(self) -> Step:
        """The first message to send (a Proposal, or a Decline when we have no device), or an
        immediate fallback without a byte sent when the peer is not known to speak SMC."""
        if self._state is not _State.INIT:
            raise NegotiationError("already started")
        if not self.facts.peer_speaks_smc:
            return self._fall_back(
                DeclineReason.PEERNOSMC,
                "the peer is not known to speak SMC (no registered listener or configured peer)",
                declined=False,
            )
        if not self.facts.has_loopback:
            return self._decline_and_fall_back(
                DeclineReason.NOSMCDEV, "no SMC device: loopback-ism is disabled here"
            )
        eids = self.facts.eids
        seid = eids.seid if eids.seid_enabled and eids.seid else ""
        assert self.facts.loopback is not None
        key = (eids.ueids, seid, eids.seid_enabled, self.facts.loopback)
        cached = _PROPOSALS.get(key)
        if cached is None:
            proposal = Proposal(
                typev1=SmcType.N,
                typev2=SmcType.D,
                version=2,
                v2_ext=V2Extension(
                    eids=eids.ueids,
                    release=SMC_RELEASE,
                    seid_indicator=eids.seid_enabled,
                    feature_mask=SMC_FEATURE_MASK,
                ),
                smcd_v2_ext=SmcdV2Extension(seid=seid, devices=(self.facts.loopback,)),
            )
            if len(_PROPOSALS) >= 16:
                _PROPOSALS.clear()
            cached = _PROPOSALS[key] = (proposal, proposal.encode())
        self.proposal = cached[0]
        self._state = _State.WAIT
        return Step((cached[0],), raw=cached[1])

    def _handle(self, msg: ClcMessage) -> Step:
        if not isinstance(msg, Accept):
            return self._violation(f"expected ACCEPT, got {type(msg).__name__}")
        self._decline_version = 1 if msg.version == 1 else 2
        info = msg.info
        # smc_connect_check_aclc: only SMC-Dv2 was offered
        if not isinstance(info, SmcdInfo) or msg.version == 1:
            kind = "SMC-D" if isinstance(info, SmcdInfo) else "SMC-R"
            return self._decline_and_fall_back(
                DeclineReason.MODEUNSUPP,
                f"the peer accepted {kind} v{msg.version}, but we offered only SMC-Dv2",
            )
        release, feature_mask = 0, 0
        if msg.first_contact:
            assert msg.fce is not None
            if msg.fce.release > SMC_RELEASE:
                return self._decline_and_fall_back(
                    DeclineReason.VERSMISMAT,
                    f"the peer accepted release {msg.fce.release}; we offered {SMC_RELEASE}",
                )
            release = msg.fce.release
            if release >= 1:
                feature_mask = msg.fce.feature_mask & SMC_FEATURE_MASK
        # smc_v2_determine_accepted_chid
        dev = self.facts.loopback
        assert dev is not None and dev.gid_ext is not None
        if info.chid != dev.chid:
            return self._violation(
                f"the peer accepted CHID {info.chid:#06x}, which we never offered"
            )
        peer_gid = info.gid128
        if peer_gid != dev.gid128 or not self.resources.pairing_confirmed():
            return self._decline_and_fall_back(
                DeclineReason.NOSMCD2DEV,
                "the accepting loopback-ism device is not ours, or no server half of this daemon "
                "claimed this connection",
            )
        # smc_conn_create
        link_id, first_contact = self._link_group(peer_gid)
        if first_contact and not msg.first_contact:
            return self._decline_and_fall_back(
                DeclineReason.SYNCERR,
                f"the peer reuses link group {info.link_id:#x}, which we do not have",
            )
        try:
            grant = self._register()
        except DmbAllocationError as exc:
            return self._decline_and_fall_back(exc.decline_reason, f"no DMB: {exc}")
        problem = self._attach(info.token, info.dmbe_size)
        if problem:
            return self._decline_and_fall_back(DeclineReason.MEM, problem)
        confirm = Confirm(
            info=self._our_info(grant, link_id),
            version=2,
            first_contact=first_contact,
            eid=msg.eid,
            fce=self._fce(release, feature_mask) if first_contact else None,
        )
        return self._success(
            peer_gid=peer_gid,
            peer_token=info.token,
            local=grant,
            peer_comp=info.dmbe_size,
            link_id=link_id,
            first_contact=first_contact,
            peer_first_contact=msg.first_contact,
            eid=msg.eid,
            release=release,
            feature_mask=feature_mask,
            send=(confirm,),
        )


class ServerNegotiation(_Negotiation):
    """The accepting side: Proposal (or Decline) → Accept → Confirm (or Decline)."""

    _expect = ClcType.PROPOSAL

    def __init__(self, facts: NegotiationFacts, resources: SmcdResources) -> None:
        super().__init__(facts, resources)
        self._state = _State.WAIT
        self.proposal: Proposal | None = None
        self._accepted: dict[str, int | str | bool] = {}
        self._grant: _Grant | None = None

    def _handle(self, msg: ClcMessage) -> Step:
        if isinstance(msg, Proposal):
            return self._on_proposal(msg)
        if isinstance(msg, Confirm):
            return self._on_confirm(msg)
        return self._violation(f"unexpected {type(msg).__name__}")

    # ---- Proposal -----------------------------------------------------------------------------

    def _on_proposal(self, p: Proposal) -> Step:
        self.proposal = p
        self._decline_version = 2 if p.version > 1 else 1
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
                    if not self.facts.has_loopback:
                        smcd_v2, rc = False, DeclineReason.NOISM2SUPP
                    elif p.smcd_v2_ext is None:
                        smcd_v2, rc = False, DeclineReason.NOV2DEXT
                    elif not v2.eids and not v2.seid_indicator:
                        smcd_v2, rc = False, DeclineReason.NOUEID
                if smcr_v2 and not v2.eids:
                    smcr_v2, rc = False, DeclineReason.NOUEID
                release = min(v2.release, SMC_RELEASE)
        if not (smcd_v1 or smcr_v1 or smcd_v2 or smcr_v2):
            return self._decline_and_fall_back(rc, "no common SMC version/path")
        # smc_clc_srv_v2x_features_validate
        feature_mask = SMC_FEATURE_MASK
        if (smcd_v2 or smcr_v2) and release >= 1:
            assert v2 is not None
            if smcr_v2:
                if min(v2.max_conns, SMC_CONN_PER_LGR_MAX) < SMC_CONN_PER_LGR_MIN:
                    return self._decline_and_fall_back(
                        DeclineReason.MAXCONNERR, f"peer offers max_conns {v2.max_conns}"
                    )
                if min(v2.max_links, SMC_LINKS_ADD_LNK_MAX) < SMC_LINKS_ADD_LNK_MIN:
                    return self._decline_and_fall_back(
                        DeclineReason.MAXLINKERR, f"peer offers max_links {v2.max_links}"
                    )
            feature_mask = v2.feature_mask & SMC_FEATURE_MASK
        # smc_listen_find_device
        store: list[int] = []
        accept = self._find_ism_v2(p, smcd_v2, release, feature_mask, store)
        if accept is not None:
            self._state = _State.WAIT
            self._expect = ClcType.CONFIRM
            return Step((accept,))
        prfx_rc = 0
        if p.typev1 != SmcType.N and not self.facts.prefix_match:
            prfx_rc = DeclineReason.DIFFPREFIX
            store.append(prfx_rc)
        if not prfx_rc and smcd_v1:
            store.append(DeclineReason.NOSMCDDEV)  # no ISMv1 device: loopback-ism is v2 only
        first = store[0] if store else 0
        if not p.typev1.has_r and not p.typev2.has_r:
            return self._decline_and_fall_back(
                first or DeclineReason.NOSMCDDEV, "no usable SMC-D device"
            )
        if smcr_v2 and v2 is not None and self.facts.eids.match_ueid(_wire(v2.eids)):
            store.append(DeclineReason.NOSMCRDEV)  # SMC-R is not implemented: no RoCE device
        if not prfx_rc:
            store.append(DeclineReason.NOSMCDEV)
            return self._decline_and_fall_back(store[0], "no usable SMC device")
        return self._decline_and_fall_back(DeclineReason.NOSMCDEV, "no usable SMC device")

    def _find_ism_v2(
        self, p: Proposal, smcd_v2: bool, release: int, feature_mask: int, store: list[int]
    ) -> Accept | None:
        """``smc_find_ism_v2_device_serv`` for our one device, loopback-ism."""
        if not smcd_v2 or p.smcd_v2_ext is None or p.v2_ext is None:
            return None
        dev = self.facts.loopback
        assert dev is not None and dev.gid_ext is not None
        # smc_check_ism_v2_match: CHID equal and cantalk, which for our loopback-ism is "the GID
        # is ours and this daemon holds the other half of this TCP connection"
        offered = [d for d in p.smcd_v2_ext.devices if d.chid == dev.chid]
        if (
            not any(d.gid128 == dev.gid128 for d in offered)
            or not self.resources.pairing_verified()
        ):
            store.append(DeclineReason.NOSMCD2DEV)
            return None
        eid = self._match_eid(p)
        if eid is None:
            return None  # the kernel stores no code here
        link_id, first_contact = self._link_group(dev.gid128)
        try:
            grant = self._register()
        except DmbAllocationError as exc:
            store.append(exc.decline_reason)
            if self._new_link is not None:
                self.resources.discard_link_group(self._new_link)
                self._new_link = None
            return None
        self._grant = grant
        self._accepted = {
            "link_id": link_id,
            "first_contact": first_contact,
            "eid": eid,
            "release": release,
            "feature_mask": feature_mask,
        }
        return Accept(
            info=self._our_info(grant, link_id),
            version=2,
            first_contact=first_contact,
            eid=eid,
            fce=self._fce(release, feature_mask) if first_contact else None,
        )

    def _match_eid(self, p: Proposal) -> str | None:
        """``smc_clc_match_eid``: the SEID if both offer the same one, else the first of the
        peer's UEIDs that we have."""
        assert p.v2_ext is not None and p.smcd_v2_ext is not None
        eids = self.facts.eids
        if (
            eids.seid_enabled
            and eids.seid
            and p.v2_ext.seid_indicator
            and p.smcd_v2_ext.seid == eids.seid
        ):
            return eids.seid
        key = (p.v2_ext.eids, eids.ueids)
        if key in _UEID_MATCHES:
            return _UEID_MATCHES[key]
        match = eids.match_ueid(_wire(p.v2_ext.eids))
        if len(_UEID_MATCHES) >= 64:
            _UEID_MATCHES.clear()
        _UEID_MATCHES[key] = match
        return match

    # ---- Confirm ------------------------------------------------------------------------------

    def _on_confirm(self, c: Confirm) -> Step:
        acc = self._accepted
        grant = self._grant
        assert grant is not None and self.proposal is not None
        info = c.info
        if not isinstance(info, SmcdInfo) or c.version == 1:
            return self._violation("the Confirm is not SMC-Dv2, which we accepted")
        release = int(acc["release"])
        feature_mask = int(acc["feature_mask"])
        # smc_clc_v2x_features_confirm_check
        if c.first_contact:
            assert c.fce is not None
            if c.fce.release != release:
                return self._decline_and_fall_back(
                    DeclineReason.RELEASEERR,
                    f"the Confirm carries release {c.fce.release}, we accepted {release}",
                )
            if release >= 1:
                feature_mask = c.fce.feature_mask
        dev = self.facts.loopback
        assert dev is not None
        if info.chid != dev.chid or info.gid128 != dev.gid128:
            return self._violation("the Confirm names another device than the one proposed")
        problem = self._attach(info.token, info.dmbe_size)
        if problem:
            return self._decline_and_fall_back(DeclineReason.MEM, problem)
        if not (acc["first_contact"] or c.first_contact):
            release = feature_mask = 0  # a reused link group: no FCE was exchanged
        return self._success(
            peer_gid=info.gid128,
            peer_token=info.token,
            local=grant,
            peer_comp=info.dmbe_size,
            link_id=int(acc["link_id"]),
            first_contact=bool(acc["first_contact"]),
            peer_first_contact=c.first_contact,
            eid=str(acc["eid"]),
            release=release,
            feature_mask=feature_mask,
        )


_UEID_MATCHES: dict[tuple[tuple[str, ...], tuple[str, ...]], str | None] = {}
"""(peer's UEIDs, ours) → ``EidTable.match_ueid``: a pure function of the two lists, asked on
every Proposal with the same ones."""


def _wire(eids: tuple[str, ...]) -> tuple[bytes, ...]:
    """UEIDs of a decoded Proposal back in their 32-byte blank-padded wire form."""
    return tuple(e.encode("latin-1")[:32].ljust(32, b" ") for e in eids)
