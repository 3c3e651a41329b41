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

**Modules.** This module holds :class:`LinkGroup` and its inputs; the values it takes and
returns are in ``llc_events``, its state and flow machinery in ``llc_core``, and the flows in
``llc_add_link`` (first contact, ADD LINK), ``llc_delete_link`` and ``llc_rkey``.

Simplifications (documented, not hidden): at most two links (``max_links`` ≤ 2; the kernel's
third, transitional asymmetric link slot is not used), no REQUEST ADD LINK (v2) flow of our own
(a peer's is treated as an ADD LINK suggestion by the server and ignored by the client).
"""

from __future__ import annotations

from collections.abc import Mapping

from smcd_daemon.errors import ProtocolError
from smcd_daemon.protocol.llc_add_link import AddLinkFlows
from smcd_daemon.protocol.llc_core import (
    ADD_LINK,
    ADD_LINK_CONT,
    CONFIRM_LINK,
    CONFIRM_RKEY,
    DELETE_LINK,
    DELETE_RKEY,
    LINKS_PER_LGR_MAX,
    LLC_WAIT_FIRST_TIME,
    LLC_WAIT_TIME,
    RMBS_PER_LGR_MAX,
    TEST_LINK,
    Conn,
    FlowType,
    Link,
    QpReady,
    Rmb,
    WaitMsg,
    WaitQp,
    base_type,
)
from smcd_daemon.protocol.llc_delete_link import DeleteLinkFlows
from smcd_daemon.protocol.llc_events import (
    AbortConnections,
    AddLinkResult,
    CreateQp,
    DestroyQp,
    FirstContactDone,
    FirstContactFailed,
    LgrType,
    LgrTypeChanged,
    LinkGroupError,
    LinkGroupTerminated,
    LinkInfo,
    LinkState,
    LinkStateChanged,
    LlcIgnored,
    LocalPort,
    MoveConnection,
    Output,
    PeerQp,
    QpToRtr,
    QpToRts,
    RmbConfirmed,
    RmbDeleted,
    Role,
    SendLlc,
)
from smcd_daemon.protocol.llc_rkey import RkeyFlows
from smcd_daemon.wire import llc
from smcd_daemon.wire.llc import (
    AddLink,
    AddLinkCont,
    ConfirmLink,
    ConfirmRkey,
    ConfirmRkeyCont,
    DeleteLink,
    DeleteLinkReason,
    DeleteRkey,
    DeleteRkeyV2,
    LlcMessage,
    ReqAddLinkV2,
    TestLink,
)

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


class LinkGroup(AddLinkFlows, DeleteLinkFlows, RkeyFlows):
    """LLC control of one SMC-R link group (see the module docstring).

    ``lgr_id`` is the local link group id (the kernel's 4-byte id; link uids are derived from
    it). ``ports`` are the local RoCE ports usable for this link group (same PNETID), the first
    link's port first; :meth:`port_state` updates their availability. ``max_links`` and
    ``max_conns`` are the negotiated v2.1 values (``release_v21``: the peer speaks v2.1, so
    CONFIRM LINK carries them); ``v2`` makes this an SMC-Rv2 link group (LLC v2 messages, rkeys
    in ADD LINK's v2 extension instead of ADD LINK CONT).
    """

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

    def connection_link(self, conn_id: int) -> int:
        return self._conns[conn_id].link_id

    def connections(self) -> tuple[int, ...]:
        return tuple(self._conns)

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
        if flow is not None and isinstance(flow.wait, WaitQp) and flow.wait.link_id == link_id:
            self._resume(QpReady(qpn, psn))
        return self._drain()

    def first_contact_peer(self, peer: PeerQp, now: float,
                           peer_rmb: tuple[int, int] | None = None) -> list[Output]:  # fmt: skip
        """The CLC handshake told us the peer's QP of the first link: server after the
        Confirm, client after the Accept. Runs CONFIRM LINK, then tries a second link.

        ``peer_rmb`` (rkey, vaddr): the peer's RMB the same CLC message named. Its rtoken is
        added now, before any LLC (``smc_rmb_rtoken_handling`` precedes the first link's
        confirmation): the second link's rkeys for it (ADD LINK v2 extension, ADD LINK CONT)
        may arrive before the connection is attached, and are kept only for a known RMB."""
        self._now = now
        lk = self._links.get(self._first_link or -1)
        if lk is None or lk.qpn is None or lk.peer is not None:
            raise LinkGroupError("first_contact_peer needs the first link's QP, once")
        lk.peer = peer
        lk.mtu = min(lk.port.mtu, peer.mtu)
        if peer_rmb is not None:
            self._rtoken_add(lk.link_id, *peer_rmb)
        gen = self._srv_first_contact(lk) if self.role == Role.SERVER else self._cli_first(lk)
        self._local(lambda: self._start_flow(FlowType.ADD_LINK, gen))
        return self._drain()

    # ------------------------------------------------------------------ ADD LINK
    def add_link(self, now: float) -> list[Output]:
        """Try to add a link (a port came up; ``smcr_port_add``/``smc_llc_add_link_local``)."""
        self._now = now
        if self.terminated:
            return self._drain()
        self._local(self._add_link_local)
        return self._drain()

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
                FlowType.DEL_LINK, self._srv_delete_link(to.link_id, req)))  # fmt: skip
        else:

            def client_delete() -> None:
                target = self._links.get(to.link_id)
                if target is not None and target.state == LinkState.ACTIVE:
                    self._send(target.link_id, self._delete_link_msg(
                        del_id, DeleteLinkReason.LOST_PATH, orderly=True))  # fmt: skip
                self._clear_link(lk)

            self._local(client_delete)
        return self._drain()

    def _link_failed_activating(self, lk: Link, why: str) -> None:
        self._set_state(lk, LinkState.INACTIVE)
        if lk.link_id == self._first_link and self.type == LgrType.NONE:
            self._wake_flow_on_link(lk.link_id)
            if not self.terminated:
                self._first_failed(lk, why)
            return
        self._wake_flow_on_link(lk.link_id)

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

    # ------------------------------------------------------------------ rkeys (ours)
    def add_rmb(self, rmb_id: int, rkeys: Mapping[int, tuple[int, int]], now: float,
                *, announce: bool = True) -> list[Output]:  # fmt: skip
        """A new RMB, registered on every active link (``rkeys``: link id → (rkey, vaddr)).
        With ``announce`` the peer learns it by CONFIRM RKEY (not for the first contact's
        RMB, which the CLC messages carry); :class:`RmbConfirmed` reports the outcome."""
        self._now = now
        if rmb_id in self._rmbs:
            raise LinkGroupError(f"RMB {rmb_id} exists already")
        self._rmbs[rmb_id] = Rmb(dict(rkeys), confirmed=not announce)
        if announce and not self.terminated:
            self._local(lambda: self._start_flow(FlowType.RKEY, self._confirm_rkey(rmb_id)))
        return self._drain()

    def delete_rmb(self, rmb_id: int, now: float) -> list[Output]:
        """An RMB leaves the link group (``smcr_buf_unuse``): DELETE RKEY if the peer knew it."""
        self._now = now
        rmb = self._rmbs.pop(rmb_id, None)
        if rmb is None:
            raise LinkGroupError(f"no RMB {rmb_id}")
        if rmb.confirmed and not self.terminated:
            self._local(lambda: self._start_flow(FlowType.RKEY, self._delete_rkey(rmb_id, rmb)))
        return self._drain()

    def peer_rkey_count(self) -> int:
        return sum(1 for s in self._rtokens if s is not None)

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
        self._conns[conn_id] = Conn(link_id, rt)
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

    def _rx_response(self, lk: Link, msg: LlcMessage) -> None:
        """``smc_llc_rx_response``: responses go to the local flow that asked, or are dropped."""
        base = base_type(msg)
        if base == TEST_LINK:
            if lk.state == LinkState.ACTIVE:
                lk.test_sent = None
            return
        wanted = {
            ADD_LINK: FlowType.ADD_LINK,
            ADD_LINK_CONT: FlowType.ADD_LINK,
            CONFIRM_LINK: FlowType.ADD_LINK,
            DELETE_LINK: FlowType.DEL_LINK,
            CONFIRM_RKEY: FlowType.RKEY,
            DELETE_RKEY: FlowType.RKEY,
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

    def _rx_request(self, lk: Link, msg: LlcMessage) -> None:
        """``smc_llc_event_handler``."""
        flow = self._flow
        waiting = flow is not None and isinstance(flow.wait, WaitMsg)
        if isinstance(msg, TestLink):
            self._send(lk.link_id, msg.response())
        elif isinstance(msg, AddLink | ReqAddLinkV2):
            if self.role == Role.CLIENT:
                if isinstance(msg, ReqAddLinkV2):
                    self._emit(LlcIgnored(lk.link_id, msg, "REQ ADD LINK to a client ignored"))
                elif flow is not None and flow.type == FlowType.ADD_LINK and waiting:
                    self._deliver(lk, msg)
                elif flow is not None:
                    self._delay(lk, msg)
                else:
                    self._start_flow(FlowType.ADD_LINK, self._cli_add_link(lk, msg))
            elif flow is not None:
                self._delay(lk, msg)
            else:  # server: take the client's suggestion as a reason to add a link
                self._start_flow(FlowType.ADD_LINK, self._srv_add_link(lk))
        elif isinstance(msg, ConfirmLink | AddLinkCont):
            if flow is None or not self._deliver(lk, msg):
                self._emit(LlcIgnored(lk.link_id, msg, "no flow waits for it, dropped"))
        elif isinstance(msg, DeleteLink):
            if flow is not None and flow.type == FlowType.ADD_LINK and waiting:
                self._deliver(lk, msg)
            elif flow is not None:
                self._delay(lk, msg)
            elif self.role == Role.SERVER:
                self._start_flow(FlowType.DEL_LINK, self._srv_delete_link(lk.link_id, msg))
            else:
                self._start_flow(FlowType.DEL_LINK, self._cli_delete_link(lk, msg))
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
