"""The first contact and ADD LINK flows of an SMC-R link group (Linux ``smc_llc.c``):
CONFIRM LINK on the first link, then a second link with its rkey exchange (ADD LINK CONT
for v1, the ADD LINK v2 extension for v2). Each flow is a generator named after the kernel
function it follows; :class:`~smcd_daemon.protocol.llc_core.LinkGroupBase` runs it."""

from __future__ import annotations

from collections import deque
from collections.abc import Generator

from smcd_daemon.protocol.llc_core import (
    ADD_LINK,
    ADD_LINK_CONT,
    CONFIRM_LINK,
    LLC_WAIT_FIRST_TIME,
    LLC_WAIT_TIME,
    FlowGen,
    FlowType,
    Link,
    LinkGroupBase,
    QpReady,
    Resume,
    Wait,
    WaitMsg,
    WaitQp,
)
from smcd_daemon.protocol.llc_events import (
    AddLinkResult,
    FirstContactDone,
    LgrType,
    LinkState,
    PeerQp,
    QpToRtr,
    QpToRts,
    Role,
)
from smcd_daemon.wire.llc import (
    AddLink,
    AddLinkCont,
    AddLinkFlag,
    AddLinkRejectReason,
    ConfirmLink,
    ConfirmLinkFlag,
    DeleteLink,
    DeleteLinkFlag,
    DeleteLinkReason,
    LlcFlag,
)


class AddLinkFlows(LinkGroupBase):
    """First contact and ADD LINK, server and client side."""

    def _srv_first_contact(self, lk: Link) -> FlowGen:
        """``smcr_serv_conf_first_link``."""
        assert lk.peer is not None and lk.mtu is not None
        self._emit(QpToRtr(lk.link_id, lk.peer, lk.mtu), QpToRts(lk.link_id))
        self._send(lk.link_id, self._confirm_link(lk, response=False))
        msg = yield WaitMsg(CONFIRM_LINK, LLC_WAIT_TIME, lk.link_id)
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

    def _cli_first(self, lk: Link) -> FlowGen:
        """``smcr_clnt_conf_first_link``."""
        assert lk.peer is not None and lk.mtu is not None
        self._emit(QpToRtr(lk.link_id, lk.peer, lk.mtu))
        msg = yield WaitMsg(CONFIRM_LINK, LLC_WAIT_FIRST_TIME, lk.link_id)
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
            add = yield WaitMsg(ADD_LINK, LLC_WAIT_TIME, None)
            if isinstance(add, AddLink) and not add.is_response:
                yield from self._cli_add_link(lk, add)

    def _add_link_local(self) -> None:
        lk = self._any_link()
        if lk is None or self.type in (LgrType.SYM, LgrType.ASYMP):
            return
        if self.role == Role.SERVER:
            self._start_flow(FlowType.ADD_LINK, self._srv_add_link(lk))
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

    def _set_type_for(self, new: Link, new_type: LgrType) -> None:
        self._set_type(new_type)
        if new_type in (LgrType.ASYML, LgrType.ASYMP):
            new.asym = True

    def _srv_add_link(self, lk: Link) -> FlowGen:
        """``smc_llc_srv_add_link``."""
        new_type = LgrType.SYM
        port = self._alt_port(lk.port)
        if port is None:
            new_type, port = LgrType.ASYML, lk.port
        if not self._may_alloc(new_type):
            return
        new = self._create_link(self._new_link_id(), port)
        ready = yield WaitQp(new.link_id)
        if not isinstance(ready, QpReady):
            self._add_failed(new, "the transport did not create the QP")
            return
        self._send(lk.link_id, self._add_link_msg(new, False, port.mtu))
        resp = yield WaitMsg(ADD_LINK, LLC_WAIT_TIME, lk.link_id)
        if not isinstance(resp, AddLink) or not resp.is_response:
            self._add_failed(new, "no ADD LINK response from the client within 2 s")
            return
        if resp.flags & AddLinkFlag.REJECT:
            self._add_failed(new, "the client rejected the new link (no alternate path)")
            return
        assert lk.peer is not None
        if self.type == LgrType.SINGLE and self._same_peer(lk, resp.sender_gid, resp.sender_mac):
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
        conf = yield WaitMsg(None, LLC_WAIT_FIRST_TIME, lk.link_id)
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

    def _add_failed(self, new: Link, why: str) -> None:
        if new.state != LinkState.UNUSED:
            self._set_state(new, LinkState.INACTIVE)
        self._clear_link(new)
        self._emit(AddLinkResult(False, None, why))

    def _save_add_link_info(self, new: Link, msg: AddLink) -> None:
        new.peer = PeerQp(msg.sender_qpn, msg.initial_psn, msg.sender_gid, msg.sender_mac,
                          msg.qp_mtu)  # fmt: skip
        new.mtu = min(new.port.mtu, msg.qp_mtu) if msg.qp_mtu else new.port.mtu

    def _save_add_link_rkeys(self, lk: Link, new: Link, msg: AddLink) -> None:
        if msg.ext is not None:
            for rt in msg.ext.rkeys:
                self._rtoken_set(lk.link_id, new.link_id, rt.rmb_key, rt.rmb_vaddr_new,
                                 rt.rmb_key_new)  # fmt: skip

    def _cont_msgs(self, lk: Link, new: Link) -> list[AddLinkCont]:
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

    def _take_cont(self, lk: Link, new: Link, msg: AddLinkCont) -> int:
        for rt in msg.rkeys:
            self._rtoken_set(lk.link_id, new.link_id, rt.rmb_key, rt.rmb_vaddr_new,
                             rt.rmb_key_new)  # fmt: skip
        return msg.num_rkeys - len(msg.rkeys)

    def _srv_rkey_exchange(self, lk: Link, new: Link) -> Generator[Wait, Resume, bool]:
        """``smc_llc_srv_rkey_exchange``: send a CONT, wait for one, until both are done."""
        mine = deque(self._cont_msgs(lk, new))
        while True:
            out = mine.popleft() if mine else AddLinkCont(new.link_id, 0, ())
            self._send(lk.link_id, out)
            send_left = out.num_rkeys - len(out.rkeys)
            msg = yield WaitMsg(ADD_LINK_CONT, LLC_WAIT_TIME, lk.link_id)
            if not isinstance(msg, AddLinkCont):
                return False
            recv_left = self._take_cont(lk, new, msg)
            if not send_left and not recv_left:
                return True

    def _cli_rkey_exchange(self, lk: Link, new: Link) -> Generator[Wait, Resume, bool]:
        """``smc_llc_cli_rkey_exchange``: wait for a CONT, answer with one, until done."""
        mine = deque(self._cont_msgs(lk, new))
        while True:
            msg = yield WaitMsg(ADD_LINK_CONT, LLC_WAIT_TIME, None)
            if not isinstance(msg, AddLinkCont):
                return False
            recv_left = self._take_cont(lk, new, msg)
            out = mine.popleft() if mine else AddLinkCont(new.link_id, 0, (), LlcFlag.RESPONSE)
            self._send(lk.link_id, out)
            send_left = out.num_rkeys - len(out.rkeys)
            if not send_left and not recv_left:
                return True

    def _reject_add_link(self, lk: Link, req: AddLink) -> None:
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

    def _cli_add_link(self, lk: Link, req: AddLink) -> FlowGen:
        """``smc_llc_cli_add_link``."""
        new_type = LgrType.SYM
        alt = self._alt_port(lk.port)
        assert lk.peer is not None
        if not req.qp_mtu:
            self._reject_add_link(lk, req)
            return
        if self._same_peer(lk, req.sender_gid, req.sender_mac):
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
        ready = yield WaitQp(new.link_id)
        if not isinstance(ready, QpReady):
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
        conf = yield WaitMsg(None, LLC_WAIT_FIRST_TIME, None)
        if conf is None or isinstance(conf, QpReady):
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

    def _cli_add_failed(self, lk: Link, new: Link, req: AddLink, why: str) -> None:
        self._add_failed(new, why)
        self._reject_add_link(lk, req)
