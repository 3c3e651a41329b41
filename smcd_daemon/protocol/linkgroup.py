"""The SMC-R link group's LLC control, sans-IO (Linux ``smc_llc.c`` / ``smc_core.c``).

One :class:`LinkGroup` per link group and role. It owns the links (ids, uids, states, peer QP
data), the rkey tables (our RMBs' rkeys per link; the peer's rtokens per link), the connection →
link assignment, the LLC flow control and the keepalive. It performs no I/O and reads no clock:

* inputs are method calls - facts from the transport (:meth:`qp_created`, :meth:`link_down`,
  :meth:`receive` of LLC bytes, :meth:`note_rx` of any completion), local requests
  (:meth:`start`, :meth:`add_rmb`, :meth:`delete_rmb`, :meth:`add_link`, :meth:`free`,
  :meth:`terminate`, connection bookkeeping) and :meth:`tick` with the current time;
* every call returns the outputs it produced, in order: :class:`SendLlc` (messages for a link),
  transport actions (:class:`CreateQp`, :class:`QpToRtr`, :class:`QpToRts`, :class:`DestroyQp`),
  failover decisions (:class:`MoveConnection`, :class:`AbortConnections`) and notifications.

**Flows.** Like the kernel, at most one *local* LLC flow runs at a time (``llc_flow_lcl``):
ADD LINK (first contact and later links), DELETE LINK, or RKEY (our CONFIRM/DELETE RKEY). A
flow is written as a generator that yields what it waits for - an LLC message of a given type
(or any), or the transport's "QP created" - so the code reads in the kernel's order
(``smc_llc_srv_add_link``, ``smc_llc_cli_add_link``…). A peer's ADD/DELETE LINK request that
arrives while another flow runs is kept as the one *delayed event* and processed when the flow
ends; a second one is dropped (``smc_llc_flow_parallel``). The peer's CONFIRM/DELETE RKEY
requests form the *remote* flow and are answered at once, even during a local RKEY flow. Our
own requests wait in a queue until the local flow is free (the kernel sleeps in
``smc_llc_flow_initiate``). Responses nobody waits for are dropped.

**Version.** A message whose LLC version differs from the link group's is a protocol
violation: a v1-only kernel reaches ``smc_llc_protocol_violation`` for the v2 type bytes, which
terminates the link group with DELETE LINK ALL reason 0x00040000. Bytes that do not decode
(unknown type, wrong length) are dropped, as the kernel's receive demultiplexer drops them.

Simplifications (documented, not hidden): at most two links (``max_links`` ≤ 2; the kernel's
third, transitional asymmetric link slot is not used), no REQUEST ADD LINK (v2) flow of our own
(a peer's is treated as an ADD LINK suggestion by the server and ignored by the client).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Generator, Iterable, Mapping
from dataclasses import dataclass
from enum import Enum, StrEnum
from typing import TypeAlias

from smcd_daemon.errors import ProtocolError, SmcError
from smcd_daemon.wire import llc
from smcd_daemon.wire.llc import (
    AddLink,
    AddLinkCont,
    AddLinkFlag,
    AddLinkRejectReason,
    AddLinkRkey,
    AddLinkV2Ext,
    ConfirmLink,
    ConfirmLinkFlag,
    ConfirmRkey,
    ConfirmRkeyCont,
    DeleteLink,
    DeleteLinkFlag,
    DeleteLinkReason,
    DeleteRkey,
    DeleteRkeyV2,
    LlcFlag,
    LlcMessage,
    ReqAddLinkV2,
    RkeyFlag,
    Rtoken,
    TestLink,
)
from smcd_daemon.wire.reasons import DeclineReason

__all__ = [
    "LINKS_PER_LGR_MAX",
    "LLC_WAIT_FIRST_TIME",
    "LLC_WAIT_TIME",
    "RMBS_PER_LGR_MAX",
    "AbortConnections",
    "AddLinkResult",
    "CreateQp",
    "DestroyQp",
    "FirstContactDone",
    "FirstContactFailed",
    "LgrType",
    "LgrTypeChanged",
    "LinkGroup",
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

#: SMC_LLC_WAIT_FIRST_TIME / SMC_LLC_WAIT_TIME (seconds).
LLC_WAIT_FIRST_TIME = 5.0
LLC_WAIT_TIME = 2.0
#: How long the transport may take to create a QP before the flow gives up.
QP_CREATE_TIME = 10.0
#: Links we run at once (SMC_LINKS_ADD_LNK_MAX; the kernel has a third transitional slot).
LINKS_PER_LGR_MAX = 2
#: SMC_RMBS_PER_LGR_MAX: rtokens of the peer per link group.
RMBS_PER_LGR_MAX = 255
#: smcr_testlink_time default (seconds).
TESTLINK_TIME = 30.0
_MAX_LINK_ID = 255


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


class _FlowType(Enum):
    ADD_LINK = "ADD_LINK"
    DEL_LINK = "DEL_LINK"
    RKEY = "RKEY"


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


# ---------------------------------------------------------------------------- internal state
@dataclass(slots=True)
class _Link:
    link_id: int
    port: LocalPort
    state: LinkState = LinkState.ACTIVATING
    uid: bytes = bytes(4)
    qpn: int | None = None
    psn: int | None = None
    peer: PeerQp | None = None
    peer_uid: bytes | None = None
    mtu: int | None = None
    last_rx: float = 0.0
    test_sent: float | None = None
    asym: bool = False


@dataclass(slots=True)
class _Conn:
    link_id: int
    rtoken: int | None
    closing: bool = False


@dataclass(slots=True)
class _Rmb:
    rkeys: dict[int, tuple[int, int]]  # link_id -> (rkey, vaddr)
    confirmed: bool = False


@dataclass(frozen=True, slots=True)
class _WaitMsg:
    expect: int | None  # LLC base type (low nibble) or None for any
    timeout: float
    link_id: int | None  # wake up early when this link goes down


@dataclass(frozen=True, slots=True)
class _WaitQp:
    link_id: int


@dataclass(frozen=True, slots=True)
class _QpReady:
    qpn: int
    psn: int


_Wait: TypeAlias = _WaitMsg | _WaitQp
_Resume: TypeAlias = LlcMessage | _QpReady | None
_FlowGen: TypeAlias = Generator[_Wait, _Resume, None]


@dataclass(slots=True)
class _Flow:
    type: _FlowType
    gen: _FlowGen
    wait: _Wait | None = None
    deadline: float | None = None
    got_link: int | None = None  # link the delivered message came on


@dataclass(frozen=True, slots=True)
class _Delivered:
    """A message handed to a waiting flow, with the link it arrived on."""

    link_id: int
    msg: LlcMessage


def _base(msg: LlcMessage) -> int:
    return int(msg.type) & 0x0F


_CONFIRM_LINK, _ADD_LINK, _ADD_LINK_CONT, _DELETE_LINK = 0x1, 0x2, 0x3, 0x4
_REQ_ADD_LINK, _CONFIRM_RKEY, _TEST_LINK, _CONFIRM_RKEY_CONT, _DELETE_RKEY = 0x5, 0x6, 0x7, 0x8, 0x9


# ---------------------------------------------------------------------------- the link group
class LinkGroup:
    """LLC control of one SMC-R link group (see the module docstring).

    ``lgr_id`` is the local link group id (the kernel's 4-byte id; link uids are derived from
    it). ``ports`` are the local RoCE ports usable for this link group (same PNETID), the first
    link's port first; :meth:`port_state` updates their availability. ``max_links`` and
    ``max_conns`` are the negotiated v2.1 values (``release_v21``: the peer speaks v2.1, so
    CONFIRM LINK carries them); ``v2`` makes this an SMC-Rv2 link group (LLC v2 messages, rkeys
    in ADD LINK's v2 extension instead of ADD LINK CONT).
    """

    def __init__(
        self,
        role: Role,
        lgr_id: int,
        ports: Iterable[LocalPort],
        *,
        v2: bool = False,
        release_v21: bool = False,
        max_links: int = LINKS_PER_LGR_MAX,
        max_conns: int = 255,
        testlink_time: float = TESTLINK_TIME,
    ) -> None:
        if not 1 <= max_links <= LINKS_PER_LGR_MAX:
            raise ValueError(f"max_links must be 1..{LINKS_PER_LGR_MAX}, not {max_links}")
        self.role = role
        self.lgr_id = lgr_id
        self.v2 = v2
        self.release_v21 = release_v21
        self.max_links = max_links
        self.max_conns = max_conns
        self.testlink_time = testlink_time
        self._ports: dict[str, LocalPort] = {p.name: p for p in ports}
        if not self._ports:
            raise ValueError("a link group needs at least one local port")
        self.type = LgrType.NONE
        self.terminated = False
        self._links: dict[int, _Link] = {}
        self._next_link_id = 0
        self._conns: dict[int, _Conn] = {}
        self._rmbs: dict[int, _Rmb] = {}
        self._rtokens: list[dict[int, tuple[int, int]] | None] = []
        self._flow: _Flow | None = None
        self._running: _Flow | None = None  # the flow whose generator is executing
        self._delayed: _Delivered | None = None
        self._local_q: deque[Callable[[], None]] = deque()
        self._out: list[Output] = []
        self._now = 0.0
        self._first_link: int | None = None
        self._termination_rsn: int = 0

    # ------------------------------------------------------------------ queries
    def links(self) -> tuple[LinkInfo, ...]:
        counts: dict[int, int] = {}
        for c in self._conns.values():
            counts[c.link_id] = counts.get(c.link_id, 0) + 1
        return tuple(
            LinkInfo(
                link_id=lk.link_id,
                state=lk.state,
                port=lk.port.name,
                gid=lk.port.gid,
                qpn=lk.qpn,
                psn=lk.psn,
                peer_gid=lk.peer.gid if lk.peer else None,
                peer_qpn=lk.peer.qpn if lk.peer else None,
                mtu=lk.mtu,
                link_uid=lk.uid,
                peer_link_uid=lk.peer_uid,
                conns=counts.get(lk.link_id, 0),
            )
            for lk in sorted(self._links.values(), key=lambda x: x.link_id)
        )

    def active_links(self) -> tuple[int, ...]:
        return tuple(i for i, lk in sorted(self._links.items()) if lk.state == LinkState.ACTIVE)

    def connection_link(self, conn_id: int) -> int:
        return self._conns[conn_id].link_id

    def connections(self) -> tuple[int, ...]:
        return tuple(self._conns)

    def peer_rtoken(self, conn_id: int, link_id: int | None = None) -> tuple[int, int] | None:
        """(rkey, vaddr) of the peer's RMB of ``conn_id`` on ``link_id`` (default: the
        connection's link) - what an RDMA WRITE needs."""
        conn = self._conns[conn_id]
        slot = self._rtokens[conn.rtoken] if conn.rtoken is not None else None
        if slot is None:
            return None
        return slot.get(conn.link_id if link_id is None else link_id)

    def rmb_rkeys(self, rmb_id: int) -> Mapping[int, tuple[int, int]]:
        return dict(self._rmbs[rmb_id].rkeys)

    def link_by_peer_qpn(self, qpn: int) -> int | None:
        """Client: the link an Accept's QPN names (``smc_connect_rdma`` reuse path)."""
        for lk in self._links.values():
            if lk.peer is not None and lk.peer.qpn == qpn and lk.state == LinkState.ACTIVE:
                return lk.link_id
        return None

    @property
    def flow_busy(self) -> bool:
        return self._flow is not None

    def next_deadline(self) -> float | None:
        """When :meth:`tick` next has something to do (None: nothing pending)."""
        times: list[float] = []
        if self._flow is not None and self._flow.deadline is not None:
            times.append(self._flow.deadline)
        if self.testlink_time > 0 and not self.terminated:
            for lk in self._links.values():
                if lk.state != LinkState.ACTIVE:
                    continue
                if lk.test_sent is not None:
                    times.append(lk.test_sent + LLC_WAIT_TIME)
                else:
                    times.append(lk.last_rx + self.testlink_time)
        return min(times) if times else None

    # ------------------------------------------------------------------ output plumbing
    def _drain(self) -> list[Output]:
        out, self._out = self._out, []
        return out

    def _emit(self, *items: Output) -> None:
        self._out.extend(items)

    def _send(self, link_id: int, msg: LlcMessage) -> None:
        self._emit(SendLlc(link_id, msg))

    def _set_state(self, lk: _Link, new: LinkState) -> None:
        if lk.state != new:
            old, lk.state = lk.state, new
            self._emit(LinkStateChanged(lk.link_id, old, new))

    def _set_type(self, new: LgrType) -> None:
        for lk in self._links.values():
            lk.asym = False
        if self.type != new:
            old, self.type = self.type, new
            self._emit(LgrTypeChanged(old, new))

    # ------------------------------------------------------------------ links
    def _new_link_id(self) -> int:
        """``smcr_next_link_id``: the next id, skipping 0 and ids in use."""
        while True:
            self._next_link_id = (self._next_link_id + 1) % (_MAX_LINK_ID + 1)
            if self._next_link_id and self._next_link_id not in self._links:
                return self._next_link_id

    def _uid(self, link_id: int) -> bytes:
        return ((self.lgr_id + link_id) & 0xFFFFFFFF).to_bytes(4, "big")

    def _create_link(self, link_id: int, port: LocalPort) -> _Link:
        lk = _Link(link_id, port, uid=self._uid(link_id), last_rx=self._now)
        self._links[link_id] = lk
        self._emit(
            LinkStateChanged(link_id, LinkState.UNUSED, LinkState.ACTIVATING),
            CreateQp(link_id, port, tuple(sorted(self._rmbs))),
        )
        return lk

    def _clear_link(self, lk: _Link) -> None:
        """``smcr_link_clear``: the QP goes, the link's rkeys and rtokens with it."""
        if self._links.get(lk.link_id) is not lk:
            return
        del self._links[lk.link_id]
        for rmb in self._rmbs.values():
            rmb.rkeys.pop(lk.link_id, None)
        for slot in self._rtokens:
            if slot is not None:
                slot.pop(lk.link_id, None)
        self._emit(DestroyQp(lk.link_id))
        self._emit(LinkStateChanged(lk.link_id, lk.state, LinkState.UNUSED))

    def _activate(self, lk: _Link) -> None:
        lk.last_rx = self._now
        lk.test_sent = None
        self._set_state(lk, LinkState.ACTIVE)

    def _alt_port(self, current: LocalPort) -> LocalPort | None:
        """``smc_pnet_find_alt_roce``: another active port than the one in use."""
        for p in self._ports.values():
            if p.active and p.name != current.name:
                return p
        return None

    def _any_link(self) -> _Link | None:
        for lk in sorted(self._links.values(), key=lambda x: x.link_id):
            if lk.state == LinkState.ACTIVE:
                return lk
        return None

    # ------------------------------------------------------------------ message builders
    def _confirm_link(self, lk: _Link, response: bool) -> ConfirmLink:
        assert lk.qpn is not None
        flags = ConfirmLinkFlag.NO_RMBE_EYEC
        if response:
            flags |= ConfirmLinkFlag.RESPONSE
        v21 = self.v2 and self.release_v21
        return ConfirmLink(
            sender_mac=lk.port.mac,
            sender_gid=lk.port.gid,
            sender_qpn=lk.qpn,
            link_num=lk.link_id,
            link_uid=lk.uid,
            max_links=self.max_links if v21 else LINKS_PER_LGR_MAX,
            max_conns=self.max_conns if v21 else 0,
            flags=flags,
            v2=self.v2,
        )

    def _add_link_msg(self, new: _Link, response: bool, mtu: int) -> AddLink:
        assert new.qpn is not None and new.psn is not None
        ext = None
        if self.v2:
            ext = AddLinkV2Ext(
                v2_direct=True,
                client_target_gid=new.peer.gid if new.peer else bytes(16),
                rkeys=self._new_link_rkeys(new),
            )
        return AddLink(
            sender_mac=new.port.mac,
            sender_gid=new.port.gid,
            sender_qpn=new.qpn,
            link_num=new.link_id,
            qp_mtu=mtu,
            initial_psn=new.psn,
            ext=ext,
            flags=AddLinkFlag.RESPONSE if response else AddLinkFlag(0),
            v2=self.v2,
        )

    def _new_link_rkeys(self, new: _Link) -> tuple[AddLinkRkey, ...]:
        """Our confirmed RMBs as (rkey on an existing link, rkey/vaddr on ``new``)."""
        prim = self._primary_for(new)
        out = []
        for rmb_id in sorted(self._rmbs):
            rmb = self._rmbs[rmb_id]
            if prim is None or prim.link_id not in rmb.rkeys or new.link_id not in rmb.rkeys:
                continue
            key_new, vaddr_new = rmb.rkeys[new.link_id]
            out.append(AddLinkRkey(rmb.rkeys[prim.link_id][0], key_new, vaddr_new))
        return tuple(out)

    def _primary_for(self, new: _Link) -> _Link | None:
        for lk in sorted(self._links.values(), key=lambda x: x.link_id):
            if lk is not new and lk.state == LinkState.ACTIVE:
                return lk
        return None

    def _delete_link_msg(
        self, link_id: int, reason: int, *, orderly: bool, response: bool = False
    ) -> DeleteLink:
        flags = DeleteLinkFlag(0)
        if response:
            flags |= DeleteLinkFlag.RESPONSE
        if orderly:
            flags |= DeleteLinkFlag.ORDERLY
        if link_id == 0:
            flags |= DeleteLinkFlag.ALL
        return DeleteLink(link_id, reason, flags, self.v2)

    # ------------------------------------------------------------------ flows
    def _start_flow(self, ftype: _FlowType, gen: _FlowGen) -> None:
        assert self._flow is None
        self._flow = _Flow(ftype, gen)
        self._resume(None, first=True)

    def _resume(self, value: _Resume, *, first: bool = False) -> None:
        flow = self._flow
        assert flow is not None
        flow.wait = None
        flow.deadline = None
        self._running = flow
        try:
            wait = next(flow.gen) if first else flow.gen.send(value)
        except StopIteration:
            self._running = None
            if self._flow is flow:
                self._flow_stop()
            return
        self._running = None
        if self._flow is not flow:  # the link group ended while the flow ran
            flow.gen.close()
            return
        flow.wait = wait
        if isinstance(wait, _WaitMsg):
            flow.deadline = self._now + wait.timeout
        else:
            flow.deadline = self._now + QP_CREATE_TIME

    def _flow_stop(self) -> None:
        """``smc_llc_flow_stop``: run the delayed event, then queued local requests."""
        self._flow = None
        if self.terminated:
            return
        if self._delayed is not None:
            d, self._delayed = self._delayed, None
            lk = self._links.get(d.link_id)
            if lk is not None and lk.state in (LinkState.ACTIVATING, LinkState.ACTIVE):
                self._rx_request(lk, d.msg)
        while self._flow is None and self._local_q and not self.terminated:
            self._local_q.popleft()()

    def _local(self, action: Callable[[], None]) -> None:
        """Run a local request now, or when the local flow is free (``smc_llc_flow_initiate``)."""
        if self._flow is None:
            action()
        else:
            self._local_q.append(action)

    def _deliver(self, lk: _Link, msg: LlcMessage) -> bool:
        """Hand ``msg`` to the waiting flow if it waits for a message (``smc_llc_wait``)."""
        flow = self._flow
        if flow is None or not isinstance(flow.wait, _WaitMsg):
            return False
        want = flow.wait.expect
        got = _base(msg)
        if want is not None and got != want:
            if want == _ADD_LINK and got == _DELETE_LINK and not msg.is_response:
                # the DELETE LINK waits for the flow's end; the ADD LINK attempt is over
                self._delay(lk, msg)
                flow.got_link = lk.link_id
                self._resume(None)
                return True
            self._emit(LlcIgnored(lk.link_id, msg, f"flow waits for type {want}, dropped"))
            return True
        flow.got_link = lk.link_id
        self._resume(msg)
        return True

    def _delay(self, lk: _Link, msg: LlcMessage) -> None:
        """``smc_llc_flow_parallel``: keep one ADD/DELETE LINK request, drop the rest."""
        if _base(msg) in (_ADD_LINK, _DELETE_LINK) and self._delayed is None:
            self._delayed = _Delivered(lk.link_id, msg)
        else:
            self._emit(LlcIgnored(lk.link_id, msg, "parallel LLC request dropped"))

    # ------------------------------------------------------------------ first contact
    def start(self, now: float, port: str | None = None) -> list[Output]:
        """Create the first link (its QP goes into the CLC Accept/Confirm)."""
        self._now = now
        if self._links or self.terminated:
            raise LinkGroupError("the first link exists already")
        p = self._ports[port] if port is not None else next(iter(self._ports.values()))
        lk = self._create_link(self._new_link_id(), p)
        self._first_link = lk.link_id
        return self._drain()

    def qp_created(self, link_id: int, qpn: int, psn: int, now: float,
                   rkeys: Mapping[int, tuple[int, int]] | None = None) -> list[Output]:  # fmt: skip
        """The transport created the link's QP (and registered the RMBs it was asked to:
        ``rkeys`` maps rmb id → (rkey, vaddr) on this link)."""
        self._now = now
        lk = self._links.get(link_id)
        if lk is None or self.terminated:
            return self._drain()
        lk.qpn, lk.psn = qpn, psn
        for rmb_id, rk in (rkeys or {}).items():
            if rmb_id in self._rmbs:
                self._rmbs[rmb_id].rkeys[link_id] = rk
        flow = self._flow
        if flow is not None and isinstance(flow.wait, _WaitQp) and flow.wait.link_id == link_id:
            self._resume(_QpReady(qpn, psn))
        return self._drain()

    def first_contact_peer(self, peer: PeerQp, now: float) -> list[Output]:
        """The CLC handshake told us the peer's QP of the first link: server after the
        Confirm, client after the Accept. Runs CONFIRM LINK, then tries a second link."""
        self._now = now
        lk = self._links.get(self._first_link or -1)
        if lk is None or lk.qpn is None or lk.peer is not None:
            raise LinkGroupError("first_contact_peer needs the first link's QP, once")
        lk.peer = peer
        lk.mtu = min(lk.port.mtu, peer.mtu)
        gen = self._srv_first_contact(lk) if self.role == Role.SERVER else self._cli_first(lk)
        self._local(lambda: self._start_flow(_FlowType.ADD_LINK, gen))
        return self._drain()

    def _first_failed(self, lk: _Link, why: str) -> None:
        self._emit(FirstContactFailed(DeclineReason.TIMEOUT_CL, why))
        self._terminate(DeleteLinkReason.LOST_PATH, f"first contact failed: {why}")

    def _srv_first_contact(self, lk: _Link) -> _FlowGen:
        """``smcr_serv_conf_first_link``."""
        assert lk.peer is not None and lk.mtu is not None
        self._emit(QpToRtr(lk.link_id, lk.peer, lk.mtu), QpToRts(lk.link_id))
        self._send(lk.link_id, self._confirm_link(lk, response=False))
        msg = yield _WaitMsg(_CONFIRM_LINK, LLC_WAIT_TIME, lk.link_id)
        if not isinstance(msg, ConfirmLink) or not msg.is_response:
            self._first_failed(lk, "no CONFIRM LINK response from the client within 2 s")
            return
        if not msg.flags & ConfirmLinkFlag.NO_RMBE_EYEC:
            self._first_failed(lk, "the client's RMBEs use eye catchers (unsupported)")
            return
        lk.peer_uid = msg.link_uid
        self._activate(lk)
        self._set_type(LgrType.SINGLE)
        self._emit(FirstContactDone(lk.link_id))
        if self.max_links > 1:
            yield from self._srv_add_link(lk)

    def _cli_first(self, lk: _Link) -> _FlowGen:
        """``smcr_clnt_conf_first_link``."""
        assert lk.peer is not None and lk.mtu is not None
        self._emit(QpToRtr(lk.link_id, lk.peer, lk.mtu))
        msg = yield _WaitMsg(_CONFIRM_LINK, LLC_WAIT_FIRST_TIME, lk.link_id)
        if not isinstance(msg, ConfirmLink) or msg.is_response:
            self._first_failed(lk, "no CONFIRM LINK request from the server within 5 s")
            return
        if not msg.flags & ConfirmLinkFlag.NO_RMBE_EYEC:
            self._first_failed(lk, "the server's RMBEs use eye catchers (unsupported)")
            return
        # the server assigns the link id (smc_llc_eval_conf_link)
        if msg.link_num != lk.link_id:
            del self._links[lk.link_id]
            self._links[msg.link_num] = lk
            old_id, lk.link_id = lk.link_id, msg.link_num
            self._first_link = lk.link_id
            for c in self._conns.values():
                if c.link_id == old_id:
                    c.link_id = lk.link_id
            for table in [r.rkeys for r in self._rmbs.values()] + [
                t for t in self._rtokens if t is not None
            ]:
                if old_id in table:
                    table[lk.link_id] = table.pop(old_id)
        lk.uid = self._uid(lk.link_id)
        lk.peer_uid = msg.link_uid
        self._emit(QpToRts(lk.link_id))
        self._send(lk.link_id, self._confirm_link(lk, response=True))
        self._activate(lk)
        self._set_type(LgrType.SINGLE)
        self._emit(FirstContactDone(lk.link_id))
        if self.max_links > 1:
            add = yield _WaitMsg(_ADD_LINK, LLC_WAIT_TIME, None)
            if isinstance(add, AddLink) and not add.is_response:
                yield from self._cli_add_link(lk, add)

    # ------------------------------------------------------------------ ADD LINK
    def add_link(self, now: float) -> list[Output]:
        """Try to add a link (a port came up; ``smcr_port_add``/``smc_llc_add_link_local``)."""
        self._now = now
        if self.terminated:
            return self._drain()
        self._local(self._add_link_local)
        return self._drain()

    def _add_link_local(self) -> None:
        lk = self._any_link()
        if lk is None or self.type in (LgrType.SYM, LgrType.ASYMP):
            return
        if self.role == Role.SERVER:
            self._start_flow(_FlowType.ADD_LINK, self._srv_add_link(lk))
            return
        # client: invite the server (smc_llc_cli_add_link_invite)
        alt = self._alt_port(lk.port)
        if alt is None:
            return
        self._send(
            lk.link_id,
            AddLink(alt.mac, alt.gid, 0, 0, 0, 0, v2=self.v2),
        )

    def _links_in_use(self) -> int:
        return sum(1 for x in self._links.values() if x.state != LinkState.UNUSED)

    def _may_alloc(self, new_type: LgrType) -> bool:
        """``smc_llc_alloc_alt_link``."""
        if self._links_in_use() >= self.max_links:
            return False
        if self.type == LgrType.SYM:
            return False
        asym = new_type in (LgrType.ASYML, LgrType.ASYMP)
        return not (self.type != LgrType.SINGLE and asym)

    def _set_type_for(self, new: _Link, new_type: LgrType) -> None:
        self._set_type(new_type)
        if new_type in (LgrType.ASYML, LgrType.ASYMP):
            new.asym = True

    def _srv_add_link(self, lk: _Link) -> _FlowGen:
        """``smc_llc_srv_add_link``."""
        new_type = LgrType.SYM
        port = self._alt_port(lk.port)
        if port is None:
            new_type, port = LgrType.ASYML, lk.port
        if not self._may_alloc(new_type):
            return
        new = self._create_link(self._new_link_id(), port)
        ready = yield _WaitQp(new.link_id)
        if not isinstance(ready, _QpReady):
            self._add_failed(new, "the transport did not create the QP")
            return
        self._send(lk.link_id, self._add_link_msg(new, False, port.mtu))
        resp = yield _WaitMsg(_ADD_LINK, LLC_WAIT_TIME, lk.link_id)
        if not isinstance(resp, AddLink) or not resp.is_response:
            self._add_failed(new, "no ADD LINK response from the client within 2 s")
            return
        if resp.flags & AddLinkFlag.REJECT:
            self._add_failed(new, "the client rejected the new link (no alternate path)")
            return
        assert lk.peer is not None
        if (
            self.type == LgrType.SINGLE
            and resp.sender_gid == lk.peer.gid
            and resp.sender_mac == lk.peer.mac
        ):
            new_type = LgrType.ASYMP
        self._save_add_link_info(new, resp)
        assert new.peer is not None and new.mtu is not None
        self._emit(QpToRtr(new.link_id, new.peer, new.mtu), QpToRts(new.link_id))
        if self.v2:
            self._save_add_link_rkeys(lk, new, resp)
        else:
            ok = yield from self._srv_rkey_exchange(lk, new)
            if not ok:
                self._add_failed(new, "ADD LINK CONT exchange timed out")
                return
        # smc_llc_srv_conf_link
        self._send(new.link_id, self._confirm_link(new, response=False))
        conf = yield _WaitMsg(None, LLC_WAIT_FIRST_TIME, lk.link_id)
        if not isinstance(conf, ConfirmLink):
            self._send(
                lk.link_id,
                self._delete_link_msg(new.link_id, DeleteLinkReason.LOST_PATH, orderly=False),
            )
            self._add_failed(new, "no CONFIRM LINK response on the new link")
            return
        new.peer_uid = conf.link_uid
        self._activate(new)
        self._set_type_for(new, new_type)
        self._emit(AddLinkResult(True, new.link_id, f"link {new.link_id} added ({new_type})"))

    def _add_failed(self, new: _Link, why: str) -> None:
        if new.state != LinkState.UNUSED:
            self._set_state(new, LinkState.INACTIVE)
        self._clear_link(new)
        self._emit(AddLinkResult(False, None, why))

    def _save_add_link_info(self, new: _Link, msg: AddLink) -> None:
        new.peer = PeerQp(msg.sender_qpn, msg.initial_psn, msg.sender_gid, msg.sender_mac,
                          msg.qp_mtu)  # fmt: skip
        new.mtu = min(new.port.mtu, msg.qp_mtu) if msg.qp_mtu else new.port.mtu

    def _save_add_link_rkeys(self, lk: _Link, new: _Link, msg: AddLink) -> None:
        if msg.ext is not None:
            for rt in msg.ext.rkeys:
                self._rtoken_set(lk.link_id, new.link_id, rt.rmb_key, rt.rmb_vaddr_new,
                                 rt.rmb_key_new)  # fmt: skip

    def _cont_msgs(self, lk: _Link, new: _Link) -> list[AddLinkCont]:
        """Our ADD LINK CONT messages: two rkeys each, ``num_rkeys`` counting what is left."""
        rts = list(self._new_link_rkeys(new))
        flags = LlcFlag.RESPONSE if self.role == Role.CLIENT else LlcFlag(0)
        msgs = []
        while True:
            chunk, rts_left = rts[:2], rts[2:]
            msgs.append(AddLinkCont(new.link_id, len(rts), tuple(chunk), flags))
            rts = rts_left
            if not rts:
                return msgs

    def _take_cont(self, lk: _Link, new: _Link, msg: AddLinkCont) -> int:
        for rt in msg.rkeys:
            self._rtoken_set(lk.link_id, new.link_id, rt.rmb_key, rt.rmb_vaddr_new,
                             rt.rmb_key_new)  # fmt: skip
        return msg.num_rkeys - len(msg.rkeys)

    def _srv_rkey_exchange(self, lk: _Link, new: _Link) -> Generator[_Wait, _Resume, bool]:
        """``smc_llc_srv_rkey_exchange``: send a CONT, wait for one, until both are done."""
        mine = deque(self._cont_msgs(lk, new))
        while True:
            out = mine.popleft() if mine else AddLinkCont(new.link_id, 0, ())
            self._send(lk.link_id, out)
            send_left = out.num_rkeys - len(out.rkeys)
            msg = yield _WaitMsg(_ADD_LINK_CONT, LLC_WAIT_TIME, lk.link_id)
            if not isinstance(msg, AddLinkCont):
                return False
            recv_left = self._take_cont(lk, new, msg)
            if not send_left and not recv_left:
                return True

    def _cli_rkey_exchange(self, lk: _Link, new: _Link) -> Generator[_Wait, _Resume, bool]:
        """``smc_llc_cli_rkey_exchange``: wait for a CONT, answer with one, until done."""
        mine = deque(self._cont_msgs(lk, new))
        while True:
            msg = yield _WaitMsg(_ADD_LINK_CONT, LLC_WAIT_TIME, None)
            if not isinstance(msg, AddLinkCont):
                return False
            recv_left = self._take_cont(lk, new, msg)
            out = mine.popleft() if mine else AddLinkCont(new.link_id, 0, (), LlcFlag.RESPONSE)
            self._send(lk.link_id, out)
            send_left = out.num_rkeys - len(out.rkeys)
            if not send_left and not recv_left:
                return True

    def _reject_add_link(self, lk: _Link, req: AddLink) -> None:
        """``smc_llc_cli_add_link_reject``: echo the request as a rejecting response."""
        self._send(
            lk.link_id,
            AddLink(
                req.sender_mac, req.sender_gid, req.sender_qpn, req.link_num, req.qp_mtu,
                req.initial_psn,
                reject_reason=AddLinkRejectReason.NONE if self.v2
                else AddLinkRejectReason.NO_ALT_PATH,
                flags=AddLinkFlag.RESPONSE | AddLinkFlag.REJECT,
                v2=self.v2,
            ),
        )  # fmt: skip

    def _cli_add_link(self, lk: _Link, req: AddLink) -> _FlowGen:
        """``smc_llc_cli_add_link``."""
        new_type = LgrType.SYM
        alt = self._alt_port(lk.port)
        assert lk.peer is not None
        if not req.qp_mtu:
            self._reject_add_link(lk, req)
            return
        if req.sender_gid == lk.peer.gid and req.sender_mac == lk.peer.mac:
            if alt is None:
                self._reject_add_link(lk, req)
                self._emit(AddLinkResult(False, None, "server offered an asymmetric link and "
                                         "we have no alternate port"))  # fmt: skip
                return
            new_type = LgrType.ASYMP
        port = alt
        if port is None:
            new_type, port = LgrType.ASYML, lk.port
        if not self._may_alloc(new_type) or req.link_num in self._links or not req.link_num:
            self._reject_add_link(lk, req)
            return
        new = self._create_link(req.link_num, port)
        self._save_add_link_info(new, req)
        ready = yield _WaitQp(new.link_id)
        if not isinstance(ready, _QpReady):
            self._cli_add_failed(lk, new, req, "the transport did not create the QP")
            return
        assert new.peer is not None and new.mtu is not None
        self._emit(QpToRtr(new.link_id, new.peer, new.mtu))
        self._send(lk.link_id, self._add_link_msg(new, True, new.mtu))
        if self.v2:
            self._save_add_link_rkeys(lk, new, req)
        else:
            ok = yield from self._cli_rkey_exchange(lk, new)
            if not ok:
                self._cli_add_failed(lk, new, req, "ADD LINK CONT exchange timed out")
                return
        # smc_llc_cli_conf_link
        conf = yield _WaitMsg(None, LLC_WAIT_FIRST_TIME, None)
        if conf is None or isinstance(conf, _QpReady):
            self._send(lk.link_id, self._delete_link_msg(
                new.link_id, DeleteLinkReason.LOST_PATH, orderly=False))  # fmt: skip
            self._cli_add_failed(lk, new, req, "no CONFIRM LINK on the new link")
            return
        if not isinstance(conf, ConfirmLink):
            if isinstance(conf, DeleteLink) and not conf.is_response:
                self._send(
                    lk.link_id,
                    DeleteLink(
                        conf.link_num, conf.reason, conf.flags | DeleteLinkFlag.RESPONSE, conf.v2
                    ),
                )
            self._cli_add_failed(lk, new, req, f"got {conf.type.name} instead of CONFIRM LINK")
            return
        new.peer_uid = conf.link_uid
        self._emit(QpToRts(new.link_id))
        self._send(new.link_id, self._confirm_link(new, response=True))
        self._activate(new)
        self._set_type_for(new, new_type)
        self._emit(AddLinkResult(True, new.link_id, f"link {new.link_id} added ({new_type})"))

    def _cli_add_failed(self, lk: _Link, new: _Link, req: AddLink, why: str) -> None:
        self._add_failed(new, why)
        self._reject_add_link(lk, req)

    # ------------------------------------------------------------------ DELETE LINK
    def link_down(self, link_id: int, now: float, why: str = "link down") -> list[Output]:
        """The link's port went down, carrier was lost or the QP failed (``smcr_link_down``):
        its connections move to a surviving link or, with none left, the link group ends."""
        self._now = now
        lk = self._links.get(link_id)
        if lk is None or self.terminated:
            return self._drain()
        if lk.state == LinkState.ACTIVATING:
            self._link_failed_activating(lk, why)
            return self._drain()
        if lk.state != LinkState.ACTIVE:
            return self._drain()
        self._set_state(lk, LinkState.INACTIVE)
        self._wake_flow_on_link(lk.link_id)
        to = self._switch_conns(lk, dev_err=True)
        if to is None:
            self._clear_link(lk)
            self._terminate(DeleteLinkReason.LOST_PATH, f"{why}; no surviving link")
            return self._drain()
        self._set_type(LgrType.SINGLE)
        del_id = lk.link_id
        if self.role == Role.SERVER:
            req = self._delete_link_msg(del_id, DeleteLinkReason.LOST_PATH, orderly=True)
            self._local(lambda: self._start_flow(
                _FlowType.DEL_LINK, self._srv_delete_link(to.link_id, req)))  # fmt: skip
        else:

            def client_delete() -> None:
                target = self._links.get(to.link_id)
                if target is not None and target.state == LinkState.ACTIVE:
                    self._send(target.link_id, self._delete_link_msg(
                        del_id, DeleteLinkReason.LOST_PATH, orderly=True))  # fmt: skip
                self._clear_link(lk)

            self._local(client_delete)
        return self._drain()

    def _link_failed_activating(self, lk: _Link, why: str) -> None:
        self._set_state(lk, LinkState.INACTIVE)
        if lk.link_id == self._first_link and self.type == LgrType.NONE:
            self._wake_flow_on_link(lk.link_id)
            if not self.terminated:
                self._first_failed(lk, why)
            return
        self._wake_flow_on_link(lk.link_id)

    def _wake_flow_on_link(self, link_id: int) -> None:
        flow = self._flow
        if flow is None or flow.wait is None:
            return
        if (isinstance(flow.wait, _WaitMsg) and flow.wait.link_id == link_id) or (
            isinstance(flow.wait, _WaitQp) and flow.wait.link_id == link_id
        ):
            self._resume(None)

    def _switch_conns(self, frm: _Link, *, dev_err: bool) -> _Link | None:
        """``smc_switch_conns``: pick the surviving link and move ``frm``'s connections."""
        to = None
        for lk in sorted(self._links.values(), key=lambda x: x.link_id):
            if lk is frm or lk.state != LinkState.ACTIVE:
                continue
            if dev_err and lk.port.name == frm.port.name:
                continue
            to = lk
            break
        if to is None:
            return None
        for conn_id, conn in sorted(self._conns.items()):
            if conn.link_id != frm.link_id:
                continue
            conn.link_id = to.link_id
            rt = self.peer_rtoken(conn_id)
            self._emit(MoveConnection(conn_id, frm.link_id, to.link_id, not conn.closing,
                                      rt[0] if rt else None, rt[1] if rt else None))  # fmt: skip
        return to

    def _after_delete(self, lnk: _Link | None) -> None:
        active = len(self.active_links())
        if active == 1:
            self._set_type(LgrType.SINGLE)
        elif active == 0:
            self._set_type(LgrType.NONE)
            self._terminate(DeleteLinkReason.LOST_PATH, "the last link was deleted")

    def _srv_delete_link(self, via: int, req: DeleteLink) -> _FlowGen:
        """``smc_llc_process_srv_delete_link`` for one link: send (or echo) the request on the
        link it came on, wait for the response, then clear the link."""
        if req.flags & DeleteLinkFlag.ALL:
            self._send_delete_all(orderly=True, reason=int(req.reason))
            self._terminate(req.reason, f"peer deleted the link group ({_reason(req.reason)})")
            return
        lnk_del = self._links.get(req.link_num)
        if lnk_del is None:
            return  # asymmetric link already deleted
        if lnk_del.state == LinkState.ACTIVE:
            self._set_state(lnk_del, LinkState.INACTIVE)
            self._switch_conns(lnk_del, dev_err=False)
        lk = self._links.get(via)
        if lk is not None and lk.state == LinkState.ACTIVE:
            self._send(via, DeleteLink(req.link_num, req.reason, req.flags, self.v2))
            yield _WaitMsg(_DELETE_LINK, LLC_WAIT_TIME, via)
        self._clear_link(lnk_del)
        self._after_delete(lnk_del)
        if self.type == LgrType.SINGLE and not self.terminated:
            self._local_q.append(self._add_link_local)  # smc_llc_add_link_local

    def _cli_delete_link(self, lk: _Link, req: DeleteLink) -> _FlowGen:
        """``smc_llc_process_cli_delete_link``."""
        if req.flags & DeleteLinkFlag.ALL:
            self._terminate(req.reason, f"peer deleted the link group ({_reason(req.reason)})")
            return
        lnk_del = self._links.get(req.link_num)
        flags = req.flags | DeleteLinkFlag.RESPONSE
        if lnk_del is None:
            self._send(lk.link_id, DeleteLink(req.link_num, DeleteLinkReason.UNKNOWN_LINK,
                                              flags, self.v2))  # fmt: skip
            return
        self._send(lk.link_id, DeleteLink(req.link_num, DeleteLinkReason.NONE, flags, self.v2))
        if lnk_del.state == LinkState.ACTIVE:
            self._set_state(lnk_del, LinkState.INACTIVE)
            self._switch_conns(lnk_del, dev_err=False)
        self._clear_link(lnk_del)
        self._after_delete(lnk_del)
        return
        yield  # a generator that never waits

    def _send_delete_all(self, *, orderly: bool, reason: int) -> None:
        """``smc_llc_send_link_delete_all``: DELETE LINK ALL on the first link that can send."""
        lk = self._any_link()
        if lk is not None:
            self._send(lk.link_id, self._delete_link_msg(0, reason, orderly=orderly))

    # ------------------------------------------------------------------ termination
    def terminate(self, now: float, reason: int = DeleteLinkReason.PROGRAM_TERMINATION,
                  explanation: str = "terminated locally") -> list[Output]:  # fmt: skip
        """Abort the link group (``smc_lgr_terminate``): DELETE LINK ALL, not orderly."""
        self._now = now
        if not self._termination_rsn:
            self._termination_rsn = reason
        self._terminate(reason, explanation)
        return self._drain()

    def free(self, now: float) -> list[Output]:
        """Free an idle link group (``smc_lgr_free_work``): DELETE LINK ALL, orderly."""
        self._now = now
        if self._conns:
            raise LinkGroupError("free() with connections; terminate() aborts them")
        if not self.terminated:
            self._send_delete_all(orderly=True, reason=DeleteLinkReason.PROGRAM_TERMINATION)
            self._shutdown(DeleteLinkReason.PROGRAM_TERMINATION, "idle link group freed")
        return self._drain()

    def _terminate(self, reason: int, explanation: str) -> None:
        if self.terminated:
            return
        conns = tuple(sorted(self._conns))
        if conns:
            self._emit(AbortConnections(conns))
        self._conns.clear()
        rsn = self._termination_rsn or DeleteLinkReason.PROGRAM_TERMINATION
        self._send_delete_all(orderly=False, reason=rsn)
        self._shutdown(reason, explanation)

    def _shutdown(self, reason: int, explanation: str) -> None:
        self.terminated = True
        for lk in sorted(self._links.values(), key=lambda x: x.link_id):
            if lk.state == LinkState.ACTIVE:
                self._set_state(lk, LinkState.INACTIVE)
            self._clear_link(lk)
        self._set_type(LgrType.NONE)
        flow, self._flow = self._flow, None
        if flow is not None and flow is not self._running:
            flow.gen.close()
        self._local_q.clear()
        self._delayed = None
        known: DeleteLinkReason | int
        try:
            known = DeleteLinkReason(reason)
        except ValueError:
            known = reason
        self._emit(LinkGroupTerminated(known, explanation))

    def _protocol_violation(self, lk: _Link, msg: LlcMessage, why: str) -> None:
        """``smc_llc_protocol_violation``."""
        self._emit(LlcIgnored(lk.link_id, msg, f"protocol violation: {why}"))
        if not self._termination_rsn:
            self._termination_rsn = DeleteLinkReason.PROTOCOL_VIOLATION
        self._terminate(DeleteLinkReason.PROTOCOL_VIOLATION, f"LLC protocol violation: {why}")

    # ------------------------------------------------------------------ rkeys (ours)
    def add_rmb(self, rmb_id: int, rkeys: Mapping[int, tuple[int, int]], now: float,
                *, announce: bool = True) -> list[Output]:  # fmt: skip
        """A new RMB, registered on every active link (``rkeys``: link id → (rkey, vaddr)).
        With ``announce`` the peer learns it by CONFIRM RKEY (not for the first contact's
        RMB, which the CLC messages carry); :class:`RmbConfirmed` reports the outcome."""
        self._now = now
        if rmb_id in self._rmbs:
            raise LinkGroupError(f"RMB {rmb_id} exists already")
        self._rmbs[rmb_id] = _Rmb(dict(rkeys), confirmed=not announce)
        if announce and not self.terminated:
            self._local(lambda: self._start_flow(_FlowType.RKEY, self._confirm_rkey(rmb_id)))
        return self._drain()

    def _confirm_rkey(self, rmb_id: int) -> _FlowGen:
        """``smc_llc_do_confirm_rkey``: rtoken[0] for the sending link, the others after."""
        rmb = self._rmbs.get(rmb_id)
        lk = self._any_link()
        if rmb is None or lk is None:
            self._emit(RmbConfirmed(rmb_id, False))
            return
        missing = [i for i in self.active_links() if i not in rmb.rkeys]
        if missing:
            raise LinkGroupError(f"RMB {rmb_id} is not registered on link(s) {missing}")
        others = tuple(Rtoken(i, *rmb.rkeys[i]) for i in self.active_links() if i != lk.link_id)
        rkey, vaddr = rmb.rkeys[lk.link_id]
        self._send(lk.link_id, ConfirmRkey(rkey, vaddr, others, v2=self.v2))
        resp = yield _WaitMsg(_CONFIRM_RKEY, LLC_WAIT_TIME, lk.link_id)
        ok = isinstance(resp, ConfirmRkey) and not resp.flags & RkeyFlag.NEGATIVE
        if rmb_id in self._rmbs:
            self._rmbs[rmb_id].confirmed = ok
        self._emit(RmbConfirmed(rmb_id, ok))

    def delete_rmb(self, rmb_id: int, now: float) -> list[Output]:
        """An RMB leaves the link group (``smcr_buf_unuse``): DELETE RKEY if the peer knew it."""
        self._now = now
        rmb = self._rmbs.pop(rmb_id, None)
        if rmb is None:
            raise LinkGroupError(f"no RMB {rmb_id}")
        if rmb.confirmed and not self.terminated:
            self._local(lambda: self._start_flow(_FlowType.RKEY, self._delete_rkey(rmb_id, rmb)))
        return self._drain()

    def _delete_rkey(self, rmb_id: int, rmb: _Rmb) -> _FlowGen:
        lk = self._any_link()
        if lk is None or lk.link_id not in rmb.rkeys:
            self._emit(RmbDeleted(rmb_id, False))
            return
        rkey = rmb.rkeys[lk.link_id][0]
        msg: LlcMessage = DeleteRkeyV2((rkey,)) if self.v2 else DeleteRkey((rkey,))
        self._send(lk.link_id, msg)
        resp = yield _WaitMsg(_DELETE_RKEY, LLC_WAIT_TIME, lk.link_id)
        ok = isinstance(resp, DeleteRkey | DeleteRkeyV2) and not resp.flags & RkeyFlag.NEGATIVE
        self._emit(RmbDeleted(rmb_id, ok))

    # ------------------------------------------------------------------ rtokens (peer's)
    def _rtoken_add(self, link_id: int, rkey: int, vaddr: int) -> int | None:
        """``smc_rtoken_add``: the slot of this rkey on this link, new if unknown."""
        free = None
        for i, slot in enumerate(self._rtokens):
            if slot is None:
                free = i if free is None else free
            elif slot.get(link_id) == (rkey, vaddr):
                return i
        if free is None:
            if len(self._rtokens) >= RMBS_PER_LGR_MAX:
                return None
            self._rtokens.append(None)
            free = len(self._rtokens) - 1
        self._rtokens[free] = {link_id: (rkey, vaddr)}
        return free

    def _rtoken_set(self, link_id: int, new_id: int, rkey: int, vaddr_new: int,
                    rkey_new: int) -> None:  # fmt: skip
        """``smc_rtoken_set``: the RMB known by ``rkey`` on ``link_id`` is also on ``new_id``."""
        for slot in self._rtokens:
            if slot is not None and link_id in slot and slot[link_id][0] == rkey:
                slot[new_id] = (rkey_new, vaddr_new)

    def _rtoken_delete(self, link_id: int, rkey: int) -> bool:
        for i, slot in enumerate(self._rtokens):
            if slot is not None and link_id in slot and slot[link_id][0] == rkey:
                self._rtokens[i] = None
                for c in self._conns.values():
                    if c.rtoken == i:
                        c.rtoken = None
                return True
        return False

    def peer_rkey_count(self) -> int:
        return sum(1 for s in self._rtokens if s is not None)

    def _rmt_confirm_rkey(self, lk: _Link, msg: ConfirmRkey) -> None:
        """``smc_llc_rmt_conf_rkey``."""
        flags = msg.flags | RkeyFlag.RESPONSE
        idx = self._rtoken_add(lk.link_id, msg.rmb_key, msg.rmb_vaddr)
        if idx is None:
            flags |= RkeyFlag.NEGATIVE | RkeyFlag.RETRY
        else:
            slot = self._rtokens[idx]
            assert slot is not None
            for rt in msg.other_links:
                if rt.link_id in self._links:
                    slot[rt.link_id] = (rt.rmb_key, rt.rmb_vaddr)
        self._send(lk.link_id, ConfirmRkey(msg.rmb_key, msg.rmb_vaddr, msg.other_links, flags,
                                           msg.v2))  # fmt: skip

    def _rmt_delete_rkey(self, lk: _Link, msg: DeleteRkey | DeleteRkeyV2) -> None:
        """``smc_llc_rmt_delete_rkey``: a bit per rkey we did not know."""
        if isinstance(msg, DeleteRkey):
            mask = 0
            for i, rkey in enumerate(msg.rkeys):
                if not self._rtoken_delete(lk.link_id, rkey):
                    mask |= 0x80 >> i
            flags = msg.flags | RkeyFlag.RESPONSE | (RkeyFlag.NEGATIVE if mask else RkeyFlag(0))
            self._send(lk.link_id, DeleteRkey(msg.rkeys, mask, flags))
            return
        bad = sum(1 for rkey in msg.rkeys if not self._rtoken_delete(lk.link_id, rkey))
        flags = msg.flags | RkeyFlag.RESPONSE | (RkeyFlag.NEGATIVE if bad else RkeyFlag(0))
        self._send(lk.link_id, DeleteRkeyV2(tuple(0 for _ in msg.rkeys), bad, flags))

    # ------------------------------------------------------------------ connections
    def add_connection(self, conn_id: int, peer_rkey: int, peer_vaddr: int, now: float,
                       link_id: int | None = None) -> int:  # fmt: skip
        """Register a connection (``smc_lgr_register_conn``) with the peer RMB the CLC message
        named; returns its link. The server balances new connections over the links; the
        client passes the link the Accept's QPN names (:meth:`link_by_peer_qpn`)."""
        self._now = now
        if self.terminated:
            raise LinkGroupError("the link group is terminated")
        if conn_id in self._conns:
            raise LinkGroupError(f"connection {conn_id} exists already")
        if len(self._conns) >= self.max_conns:
            raise LinkGroupError(f"link group is full ({self.max_conns} connections)")
        if link_id is None:
            link_id = self.pick_link()
        lk = self._links.get(link_id)
        if lk is None or lk.state not in (LinkState.ACTIVE, LinkState.ACTIVATING):
            raise LinkGroupError(f"no usable link {link_id} (SMC_CLC_DECL_NOACTLINK)")
        rt = self._rtoken_add(link_id, peer_rkey, peer_vaddr)
        self._conns[conn_id] = _Conn(link_id, rt)
        return link_id

    def pick_link(self) -> int:
        """``smcr_lgr_conn_assign_link``: the link a new connection should use - the server
        alternates between symmetric links (its Accept names the link by its QPN)."""
        want = LinkState.ACTIVATING if self.type == LgrType.NONE else LinkState.ACTIVE
        cands = [lk.link_id for lk in sorted(self._links.values(), key=lambda x: x.link_id)
                 if lk.state == want and not lk.asym]  # fmt: skip
        if not cands:
            raise LinkGroupError("no active link (SMC_CLC_DECL_NOACTLINK)")
        if self.role == Role.SERVER and len(self._conns) % 2 and len(cands) > 1:
            return cands[1]
        return cands[0]

    def connection_closing(self, conn_id: int) -> None:
        """The connection entered a closing state: a failover moves it without validation."""
        if conn_id in self._conns:
            self._conns[conn_id].closing = True

    def remove_connection(self, conn_id: int) -> None:
        self._conns.pop(conn_id, None)

    # ------------------------------------------------------------------ ports
    def port_state(self, name: str, active: bool, now: float) -> list[Output]:
        """A local port changed state: down → its links go down; up → try to add a link."""
        self._now = now
        port = self._ports.get(name)
        if port is None:
            return self._drain()
        self._ports[name] = LocalPort(port.name, port.gid, port.mac, port.mtu, active)
        if active:
            return self.add_link(now)
        for lk in sorted(self._links.values(), key=lambda x: x.link_id):
            if lk.port.name == name:
                done = self.link_down(lk.link_id, now, f"port {name} down")
                self._out.extend(done)  # link_down drained self._out into ``done``
        return self._drain()

    # ------------------------------------------------------------------ receive
    def note_rx(self, link_id: int, now: float) -> None:
        """Any completion on the link (CDC too) proves it alive (``wr_rx_tstamp``)."""
        lk = self._links.get(link_id)
        if lk is not None:
            lk.last_rx = now

    def receive(self, link_id: int, data: bytes, now: float) -> list[Output]:
        """An LLC message arrived on ``link_id``."""
        self._now = now
        lk = self._links.get(link_id)
        if self.terminated or lk is None:
            self._emit(LlcIgnored(link_id, None, "no such link (or link group terminated)"))
            return self._drain()
        try:
            msg = llc.decode(data)
        except ProtocolError as exc:
            self._emit(LlcIgnored(link_id, None, f"undecodable LLC message dropped: {exc}"))
            return self._drain()
        if lk.state not in (LinkState.ACTIVATING, LinkState.ACTIVE):
            self._emit(LlcIgnored(link_id, msg, f"link {link_id} is {lk.state}"))
            return self._drain()
        lk.last_rx = now
        if msg.is_v2 != self.v2:
            want = "v2" if self.v2 else "v1"
            self._protocol_violation(lk, msg, f"{msg.type.name} in a {want} link group")
        elif msg.is_response:
            self._rx_response(lk, msg)
        else:
            self._rx_request(lk, msg)
        return self._drain()

    def _rx_response(self, lk: _Link, msg: LlcMessage) -> None:
        """``smc_llc_rx_response``: responses go to the local flow that asked, or are dropped."""
        base = _base(msg)
        if base == _TEST_LINK:
            if lk.state == LinkState.ACTIVE:
                lk.test_sent = None
            return
        wanted = {
            _ADD_LINK: _FlowType.ADD_LINK,
            _ADD_LINK_CONT: _FlowType.ADD_LINK,
            _CONFIRM_LINK: _FlowType.ADD_LINK,
            _DELETE_LINK: _FlowType.DEL_LINK,
            _CONFIRM_RKEY: _FlowType.RKEY,
            _DELETE_RKEY: _FlowType.RKEY,
        }.get(base)
        flow = self._flow
        if (
            wanted is not None
            and flow is not None
            and flow.type == wanted
            and self._deliver(lk, msg)
        ):
            return
        self._emit(LlcIgnored(lk.link_id, msg, "response outside a flow dropped"))

    def _rx_request(self, lk: _Link, msg: LlcMessage) -> None:
        """``smc_llc_event_handler``."""
        flow = self._flow
        waiting = flow is not None and isinstance(flow.wait, _WaitMsg)
        if isinstance(msg, TestLink):
            self._send(lk.link_id, msg.response())
        elif isinstance(msg, AddLink | ReqAddLinkV2):
            if self.role == Role.CLIENT:
                if isinstance(msg, ReqAddLinkV2):
                    self._emit(LlcIgnored(lk.link_id, msg, "REQ ADD LINK to a client ignored"))
                elif flow is not None and flow.type == _FlowType.ADD_LINK and waiting:
                    self._deliver(lk, msg)
                elif flow is not None:
                    self._delay(lk, msg)
                else:
                    self._start_flow(_FlowType.ADD_LINK, self._cli_add_link(lk, msg))
            elif flow is not None:
                self._delay(lk, msg)
            else:  # server: take the client's suggestion as a reason to add a link
                self._start_flow(_FlowType.ADD_LINK, self._srv_add_link(lk))
        elif isinstance(msg, ConfirmLink | AddLinkCont):
            if flow is None or not self._deliver(lk, msg):
                self._emit(LlcIgnored(lk.link_id, msg, "no flow waits for it, dropped"))
        elif isinstance(msg, DeleteLink):
            if flow is not None and flow.type == _FlowType.ADD_LINK and waiting:
                self._deliver(lk, msg)
            elif flow is not None:
                self._delay(lk, msg)
            elif self.role == Role.SERVER:
                self._start_flow(_FlowType.DEL_LINK, self._srv_delete_link(lk.link_id, msg))
            else:
                self._start_flow(_FlowType.DEL_LINK, self._cli_delete_link(lk, msg))
        elif isinstance(msg, ConfirmRkey):
            self._rmt_confirm_rkey(lk, msg)
        elif isinstance(msg, DeleteRkey | DeleteRkeyV2):
            self._rmt_delete_rkey(lk, msg)
        elif isinstance(msg, ConfirmRkeyCont):
            self._emit(LlcIgnored(lk.link_id, msg, "CONFIRM RKEY CONT is not used, ignored"))

    # ------------------------------------------------------------------ time
    def tick(self, now: float) -> list[Output]:
        """Time passed: flow timeouts and the TEST LINK keepalive (``smc_llc_testlink_work``)."""
        self._now = now
        if self.terminated:
            return self._drain()
        flow = self._flow
        if flow is not None and flow.deadline is not None and now >= flow.deadline:
            self._resume(None)
        if self.testlink_time > 0:
            for lk in sorted(self._links.values(), key=lambda x: x.link_id):
                if self.terminated or lk.state != LinkState.ACTIVE:
                    continue
                if lk.test_sent is not None:
                    if now >= lk.test_sent + LLC_WAIT_TIME:
                        lk.test_sent = None
                        done = self.link_down(lk.link_id, now, "TEST LINK got no response")
                        self._out.extend(done)  # link_down drained self._out into ``done``
                elif now >= lk.last_rx + self.testlink_time:
                    lk.test_sent = now
                    self._send(lk.link_id, TestLink(v2=self.v2))
        return self._drain()


def _reason(reason: int) -> str:
    try:
        return DeleteLinkReason(reason).name
    except ValueError:
        return f"0x{reason:08x}"
