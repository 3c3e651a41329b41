"""The link group's state and the machinery its LLC flows run on (Linux ``smc_core.c`` and the
flow control of ``smc_llc.c``): links, our RMBs' rkeys and the peer's rtokens, the output list,
the one local flow with its delayed event and request queue, failover and termination.

:class:`LinkGroupBase` holds it; the flows are methods of mixins that extend it
(``llc_add_link``, ``llc_delete_link``, ``llc_rkey``) and :class:`~smcd_daemon.protocol.
linkgroup.LinkGroup` joins them and adds the inputs. The records below are this package's
internals: only the ``linkgroup``/``llc_*`` modules use them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass
from enum import Enum
from typing import TypeAlias

from smcd_daemon.protocol.llc_events import (
    AbortConnections,
    CreateQp,
    DestroyQp,
    FirstContactFailed,
    LgrType,
    LgrTypeChanged,
    LinkGroupTerminated,
    LinkState,
    LinkStateChanged,
    LlcIgnored,
    LocalPort,
    MoveConnection,
    Output,
    PeerQp,
    Role,
    SendLlc,
)
from smcd_daemon.wire.llc import (
    AddLink,
    AddLinkFlag,
    AddLinkRkey,
    AddLinkV2Ext,
    ConfirmLink,
    ConfirmLinkFlag,
    DeleteLink,
    DeleteLinkFlag,
    DeleteLinkReason,
    LlcMessage,
)
from smcd_daemon.wire.reasons import DeclineReason

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


class FlowType(Enum):
    ADD_LINK = "ADD_LINK"
    DEL_LINK = "DEL_LINK"
    RKEY = "RKEY"


# ---------------------------------------------------------------------------- internal state
@dataclass(slots=True)
class Link:
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
class Conn:
    link_id: int
    rtoken: int | None
    closing: bool = False


@dataclass(slots=True)
class Rmb:
    rkeys: dict[int, tuple[int, int]]  # link_id -> (rkey, vaddr)
    confirmed: bool = False


@dataclass(frozen=True, slots=True)
class WaitMsg:
    expect: int | None  # LLC base type (low nibble) or None for any
    timeout: float
    link_id: int | None  # wake up early when this link goes down


@dataclass(frozen=True, slots=True)
class WaitQp:
    link_id: int


@dataclass(frozen=True, slots=True)
class QpReady:
    qpn: int
    psn: int


Wait: TypeAlias = WaitMsg | WaitQp
Resume: TypeAlias = LlcMessage | QpReady | None
FlowGen: TypeAlias = Generator[Wait, Resume, None]


@dataclass(slots=True)
class Flow:
    type: FlowType
    gen: FlowGen
    wait: Wait | None = None
    deadline: float | None = None
    got_link: int | None = None  # link the delivered message came on


@dataclass(frozen=True, slots=True)
class Delivered:
    """A message handed to a waiting flow, with the link it arrived on."""

    link_id: int
    msg: LlcMessage


def base_type(msg: LlcMessage) -> int:
    return int(msg.type) & 0x0F


CONFIRM_LINK, ADD_LINK, ADD_LINK_CONT, DELETE_LINK = 0x1, 0x2, 0x3, 0x4
REQ_ADD_LINK, CONFIRM_RKEY, TEST_LINK, CONFIRM_RKEY_CONT, DELETE_RKEY = 0x5, 0x6, 0x7, 0x8, 0x9


# ---------------------------------------------------------------------------- the base
class LinkGroupBase:
    """State and flow machinery of one link group; see :class:`~smcd_daemon.protocol.
    linkgroup.LinkGroup` for the parameters."""

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
        self._links: dict[int, Link] = {}
        self._next_link_id = 0
        self._conns: dict[int, Conn] = {}
        self._rmbs: dict[int, Rmb] = {}
        self._rtokens: list[dict[int, tuple[int, int]] | None] = []
        self._flow: Flow | None = None
        self._running: Flow | None = None  # the flow whose generator is executing
        self._delayed: Delivered | None = None
        self._local_q: deque[Callable[[], None]] = deque()
        self._out: list[Output] = []
        self._now = 0.0
        self._first_link: int | None = None
        self._termination_rsn: int = 0

    def active_links(self) -> tuple[int, ...]:
        return tuple(i for i, lk in sorted(self._links.items()) if lk.state == LinkState.ACTIVE)

    def peer_rtoken(self, conn_id: int, link_id: int | None = None) -> tuple[int, int] | None:
        """(rkey, vaddr) of the peer's RMB of ``conn_id`` on ``link_id`` (default: the
        connection's link) - what an RDMA WRITE needs."""
        conn = self._conns[conn_id]
        slot = self._rtokens[conn.rtoken] if conn.rtoken is not None else None
        if slot is None:
            return None
        return slot.get(conn.link_id if link_id is None else link_id)

    # ------------------------------------------------------------------ output plumbing
    def _drain(self) -> list[Output]:
        out, self._out = self._out, []
        return out

    def _emit(self, *items: Output) -> None:
        self._out.extend(items)

    def _send(self, link_id: int, msg: LlcMessage) -> None:
        self._emit(SendLlc(link_id, msg))

    def _set_state(self, lk: Link, new: LinkState) -> None:
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

    def _create_link(self, link_id: int, port: LocalPort) -> Link:
        lk = Link(link_id, port, uid=self._uid(link_id), last_rx=self._now)
        self._links[link_id] = lk
        self._emit(
            LinkStateChanged(link_id, LinkState.UNUSED, LinkState.ACTIVATING),
            CreateQp(link_id, port, tuple(sorted(self._rmbs))),
        )
        return lk

    def _clear_link(self, lk: Link) -> None:
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

    def _activate(self, lk: Link) -> None:
        lk.last_rx = self._now
        lk.test_sent = None
        self._set_state(lk, LinkState.ACTIVE)

    def _alt_port(self, current: LocalPort) -> LocalPort | None:
        """``smc_pnet_find_alt_roce``: another active port than the one in use."""
        for p in self._ports.values():
            if p.active and p.name != current.name:
                return p
        return None

    def _any_link(self) -> Link | None:
        for lk in sorted(self._links.values(), key=lambda x: x.link_id):
            if lk.state == LinkState.ACTIVE:
                return lk
        return None

    # ------------------------------------------------------------------ message builders
    def _confirm_link(self, lk: Link, response: bool) -> ConfirmLink:
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

    def _add_link_msg(self, new: Link, response: bool, mtu: int) -> AddLink:
        assert new.qpn is not None and new.psn is not None
        ext = None
        if self.v2:
            # the kernel (smc_llc_fill_ext_v2) puts the sender's own GID of the new link in
            # client_target_gid, in the request and in the response alike
            ext = AddLinkV2Ext(
                v2_direct=True,
                client_target_gid=new.port.gid,
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

    def _new_link_rkeys(self, new: Link) -> tuple[AddLinkRkey, ...]:
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

    def _same_peer(self, lk: Link, gid: bytes, mac: bytes) -> bool:
        """Does an ADD LINK's sender port equal ``lk``'s peer (an asymmetric offer)? SMC-Rv2
        compares the GID alone, as the kernel does (a RoCEv2 GID names the port)."""
        assert lk.peer is not None
        return gid == lk.peer.gid and (self.v2 or mac == lk.peer.mac)

    def _primary_for(self, new: Link) -> Link | None:
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
    def _start_flow(self, ftype: FlowType, gen: FlowGen) -> None:
        assert self._flow is None
        self._flow = Flow(ftype, gen)
        self._resume(None, first=True)

    def _resume(self, value: Resume, *, first: bool = False) -> None:
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
        if isinstance(wait, WaitMsg):
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

    def _deliver(self, lk: Link, msg: LlcMessage) -> bool:
        """Hand ``msg`` to the waiting flow if it waits for a message (``smc_llc_wait``)."""
        flow = self._flow
        if flow is None or not isinstance(flow.wait, WaitMsg):
            return False
        want = flow.wait.expect
        got = base_type(msg)
        if want is not None and got != want:
            if want == ADD_LINK and got == DELETE_LINK and not msg.is_response:
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

    def _delay(self, lk: Link, msg: LlcMessage) -> None:
        """``smc_llc_flow_parallel``: keep one ADD/DELETE LINK request, drop the rest."""
        if base_type(msg) in (ADD_LINK, DELETE_LINK) and self._delayed is None:
            self._delayed = Delivered(lk.link_id, msg)
        else:
            self._emit(LlcIgnored(lk.link_id, msg, "parallel LLC request dropped"))

    def _first_failed(self, lk: Link, why: str) -> None:
        self._emit(FirstContactFailed(DeclineReason.TIMEOUT_CL, why))
        self._terminate(DeleteLinkReason.LOST_PATH, f"first contact failed: {why}")

    def _wake_flow_on_link(self, link_id: int) -> None:
        flow = self._flow
        if flow is None or flow.wait is None:
            return
        if (isinstance(flow.wait, WaitMsg) and flow.wait.link_id == link_id) or (
            isinstance(flow.wait, WaitQp) and flow.wait.link_id == link_id
        ):
            self._resume(None)

    def _switch_conns(self, frm: Link, *, dev_err: bool) -> Link | None:
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

    def _after_delete(self, lnk: Link | None) -> None:
        active = len(self.active_links())
        if active == 1:
            self._set_type(LgrType.SINGLE)
        elif active == 0:
            self._set_type(LgrType.NONE)
            self._terminate(DeleteLinkReason.LOST_PATH, "the last link was deleted")

    def _send_delete_all(self, *, orderly: bool, reason: int) -> None:
        """``smc_llc_send_link_delete_all``: DELETE LINK ALL on the first link that can send."""
        lk = self._any_link()
        if lk is not None:
            self._send(lk.link_id, self._delete_link_msg(0, reason, orderly=orderly))

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

    def _protocol_violation(self, lk: Link, msg: LlcMessage, why: str) -> None:
        """``smc_llc_protocol_violation``."""
        self._emit(LlcIgnored(lk.link_id, msg, f"protocol violation: {why}"))
        if not self._termination_rsn:
            self._termination_rsn = DeleteLinkReason.PROTOCOL_VIOLATION
        self._terminate(DeleteLinkReason.PROTOCOL_VIOLATION, f"LLC protocol violation: {why}")

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

    # ------------------------------------------------------------------ hooks
    def _rx_request(self, lk: Link, msg: LlcMessage) -> None:
        """``smc_llc_event_handler`` (in ``LinkGroup``): runs the delayed event."""
        raise NotImplementedError

    def _add_link_local(self) -> None:
        """``smc_llc_add_link_local`` (in ``AddLinkFlows``): after a DELETE LINK."""
        raise NotImplementedError


def reason_name(reason: int) -> str:
    try:
        return DeleteLinkReason(reason).name
    except ValueError:
        return f"0x{reason:08x}"
