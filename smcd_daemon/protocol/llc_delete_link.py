"""The DELETE LINK flows of an SMC-R link group (Linux ``smc_llc_process_srv_delete_link``
and ``smc_llc_process_cli_delete_link``), generators run by
:class:`~smcd_daemon.protocol.llc_core.LinkGroupBase`."""

from __future__ import annotations

from smcd_daemon.protocol.llc_core import (
    DELETE_LINK,
    LLC_WAIT_TIME,
    FlowGen,
    Link,
    LinkGroupBase,
    WaitMsg,
    reason_name,
)
from smcd_daemon.protocol.llc_events import (
    LgrType,
    LinkState,
)
from smcd_daemon.wire.llc import (
    DeleteLink,
    DeleteLinkFlag,
    DeleteLinkReason,
)


class DeleteLinkFlows(LinkGroupBase):
    """DELETE LINK requested by the peer (or by our server side on link loss)."""

    def _srv_delete_link(self, via: int, req: DeleteLink) -> FlowGen:
        """``smc_llc_process_srv_delete_link`` for one link: send (or echo) the request on the
        link it came on, wait for the response, then clear the link."""
        if req.flags & DeleteLinkFlag.ALL:
            self._send_delete_all(orderly=True, reason=int(req.reason))
            self._terminate(req.reason, f"peer deleted the link group ({reason_name(req.reason)})")
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
            yield WaitMsg(DELETE_LINK, LLC_WAIT_TIME, via)
        self._clear_link(lnk_del)
        self._after_delete(lnk_del)
        if self.type == LgrType.SINGLE and not self.terminated:
            self._local_q.append(self._add_link_local)  # smc_llc_add_link_local

    def _cli_delete_link(self, lk: Link, req: DeleteLink) -> FlowGen:
        """``smc_llc_process_cli_delete_link``."""
        if req.flags & DeleteLinkFlag.ALL:
            self._terminate(req.reason, f"peer deleted the link group ({reason_name(req.reason)})")
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
