"""The rkey flows of an SMC-R link group (Linux ``smc_llc.c``): our CONFIRM RKEY / DELETE
RKEY as the local RKEY flow, and the answers to the peer's, which are given at once."""

from __future__ import annotations

from smcd_daemon.protocol.llc_core import (
    CONFIRM_RKEY,
    DELETE_RKEY,
    LLC_WAIT_TIME,
    FlowGen,
    Link,
    LinkGroupBase,
    Rmb,
    WaitMsg,
)
from smcd_daemon.protocol.llc_events import (
    LinkGroupError,
    RmbConfirmed,
    RmbDeleted,
)
from smcd_daemon.wire.llc import (
    ConfirmRkey,
    DeleteRkey,
    DeleteRkeyV2,
    LlcMessage,
    RkeyFlag,
    Rtoken,
)


class RkeyFlows(LinkGroupBase):
    """CONFIRM RKEY and DELETE RKEY, ours and the peer's."""

    def _confirm_rkey(self, rmb_id: int) -> FlowGen:
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
        resp = yield WaitMsg(CONFIRM_RKEY, LLC_WAIT_TIME, lk.link_id)
        ok = isinstance(resp, ConfirmRkey) and not resp.flags & RkeyFlag.NEGATIVE
        if rmb_id in self._rmbs:
            self._rmbs[rmb_id].confirmed = ok
        self._emit(RmbConfirmed(rmb_id, ok))

    def _delete_rkey(self, rmb_id: int, rmb: Rmb) -> FlowGen:
        lk = self._any_link()
        if lk is None or lk.link_id not in rmb.rkeys:
            self._emit(RmbDeleted(rmb_id, False))
            return
        rkey = rmb.rkeys[lk.link_id][0]
        msg: LlcMessage = DeleteRkeyV2((rkey,)) if self.v2 else DeleteRkey((rkey,))
        self._send(lk.link_id, msg)
        resp = yield WaitMsg(DELETE_RKEY, LLC_WAIT_TIME, lk.link_id)
        ok = isinstance(resp, DeleteRkey | DeleteRkeyV2) and not resp.flags & RkeyFlag.NEGATIVE
        self._emit(RmbDeleted(rmb_id, ok))

    def _rmt_confirm_rkey(self, lk: Link, msg: ConfirmRkey) -> None:
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

    def _rmt_delete_rkey(self, lk: Link, msg: DeleteRkey | DeleteRkeyV2) -> None:
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
