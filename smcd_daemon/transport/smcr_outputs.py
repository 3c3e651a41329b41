"""Carrying out a link group machine's outputs (:mod:`smcd_daemon.protocol.llc_events`) on
verbs, the registry and the connections: one handler per output type, looked up in a table.
:class:`LlcOutputs` is a mixin of :class:`~smcd_daemon.transport.smcr.SmcrTransport`; it
declares what it uses of the transport at the top.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from smcd_daemon.core import registry as reg
from smcd_daemon.core.rmb import RmbPool
from smcd_daemon.errors import SmcError
from smcd_daemon.protocol.linkgroup import (
    AbortConnections,
    AddLinkResult,
    CreateQp,
    DestroyQp,
    FirstContactDone,
    FirstContactFailed,
    LgrTypeChanged,
    LinkGroupTerminated,
    LinkState,
    LinkStateChanged,
    LlcIgnored,
    MoveConnection,
    Output,
    QpToRtr,
    QpToRts,
    RmbConfirmed,
    RmbDeleted,
    SendLlc,
)
from smcd_daemon.transport.smcr_conn import SmcrConnection
from smcd_daemon.transport.smcr_lgr import SmcrLgr, port_name
from smcd_daemon.transport.verbs import VerbsLink, VerbsPort
from smcd_daemon.transport.verbs_model import LinkParams, mtu_bytes

__all__ = ["DESTROY_DELAY", "LlcOutputs"]

log = logging.getLogger("smcd_daemon.transport.smcr")  # the transport's logger

#: A QP is destroyed this long after the link group let it go (its last sends drain).
DESTROY_DELAY = 0.5

_Handler = Callable[[Any, SmcrLgr, Any], None]


class LlcOutputs:
    """The LLC output handlers of the SMC-R transport."""

    # what the transport provides
    pool: RmbPool
    registry: reg.Registry
    _by_qp: dict[tuple[str, int], tuple[SmcrLgr, int]]
    _loop: asyncio.AbstractEventLoop | None
    _closed: bool

    def _now(self) -> float:
        raise NotImplementedError

    def port(self, device: str, num: int) -> VerbsPort:
        raise NotImplementedError

    def _want_send(self, conn: SmcrConnection) -> None:
        raise NotImplementedError

    def _send_llc(self, g: SmcrLgr, link_id: int, data: bytes) -> None:
        raise NotImplementedError

    def _teardown(self, g: SmcrLgr) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------------ dispatch
    def _apply(self, g: SmcrLgr, outputs: list[Output]) -> None:
        for o in outputs:
            try:
                self._apply_one(g, o)
            except SmcError as e:
                log.warning("SMC-R link group %#x: %s failed: %s", g.lgr_id, type(o).__name__, e)
                if isinstance(o, CreateQp):
                    self._apply(g, g.fsm.link_down(o.link_id, self._now(), str(e)))
        self._schedule_tick(g)

    def _apply_one(self, g: SmcrLgr, o: Output) -> None:
        handler = self._HANDLERS.get(type(o))
        if handler is not None:
            handler(self, g, o)

    # ------------------------------------------------------------------ transport actions
    def _on_send_llc(self, g: SmcrLgr, o: SendLlc) -> None:
        self._send_llc(g, o.link_id, o.message.encode())

    def _on_create_qp(self, g: SmcrLgr, o: CreateQp) -> None:
        now = self._now()
        vp = g.ports.get(o.port.name)
        if vp is None:
            dev, _, num = o.port.name.rpartition(":")
            vp = g.ports[o.port.name] = self.port(dev, int(num))
        gid_index = g.gid_index.get(o.port.name)
        if gid_index is None:
            gid_index = g.gid_index[o.port.name] = vp.gid_index(o.port.gid)
        vl = vp.create_link(gid_index, v2=g.fsm.v2)
        vl.to_init()
        g.links[o.link_id] = vl
        self._by_qp[(vp.device, vl.qpn)] = (g, o.link_id)
        rkeys = {}
        for rmb_id in o.rmb_ids:
            region = self.pool.register(g.rmbs[rmb_id], o.port.name, vp.mrs)
            rkeys[rmb_id] = (region.rkey, region.addr)
        self.registry.add_link(
            reg.Link(
                lgr_id=g.lgr_id,
                link_id=o.link_id,
                state=reg.LinkState.ACTIVATING,
                ibdev=vp.device,
                ibport=vp.port,
                netdev=g.netdevs.get(o.port.name) or self._lgr_netdev(g),
                gid=vl.gid,
                qpn=vl.qpn,
                mtu=mtu_bytes(vl.mtu),
            )
        )
        self._apply(g, g.fsm.qp_created(o.link_id, vl.qpn, vl.psn, now, rkeys))

    def _on_qp_to_rtr(self, g: SmcrLgr, o: QpToRtr) -> None:
        vl = g.links[o.link_id]
        p = o.peer
        g.peer_macs[o.link_id] = p.mac
        vl.to_rtr(LinkParams(p.gid, p.qpn, p.psn, o.mtu, p.mac), uses_gateway=g.uses_gateway)
        self._reg_link(g, o.link_id, peer_gid=p.gid, peer_qpn=p.qpn, mtu=mtu_bytes(o.mtu))

    def _on_qp_to_rts(self, g: SmcrLgr, o: QpToRts) -> None:
        g.links[o.link_id].to_rts()

    def _on_destroy_qp(self, g: SmcrLgr, o: DestroyQp) -> None:
        vl = g.links.pop(o.link_id, None)
        if vl is not None:
            self._destroy_later(vl)
        g.llc_q.pop(o.link_id, None)
        for queued in g.send_q.pop(o.link_id, ()):
            queued.queued = False
            if not queued.done and queued.link_id != o.link_id:
                self._want_send(queued)
        with contextlib.suppress(SmcError):
            self.registry.remove_link(g.lgr_id, o.link_id)

    # ------------------------------------------------------------------ failover
    def _on_move_connection(self, g: SmcrLgr, o: MoveConnection) -> None:
        conn = g.conns.get(o.conn_id)
        if conn is None:
            return
        log.info("SMC-R connection %d: failover link %d -> %d", o.conn_id, o.from_link, o.to_link)
        if o.peer_rkey is None:  # the peer never named its RMB on that link: writes will fail
            log.warning("SMC-R connection %d: no rkey of the peer's RMB on link %d",
                        o.conn_id, o.to_link)  # fmt: skip
        conn.queued = False
        to = g.links.get(o.to_link)
        if to is not None:  # the send buffer must be registered with the new PD
            conn.snd_region = self.pool.register(conn.sndbuf, port_name(to), to.port.mrs)
        conn.move(o.to_link, o.peer_rkey, o.peer_vaddr, o.validate)
        with contextlib.suppress(SmcError):
            self.registry.update_connection(o.conn_id, link_id=o.to_link)

    def _on_abort_connections(self, g: SmcrLgr, o: AbortConnections) -> None:
        for conn_id in o.conn_ids:
            conn = g.conns.get(conn_id)
            if conn is not None:
                conn.lost("the link group ended (no link left)")

    # ------------------------------------------------------------------ notifications
    def _on_link_state(self, g: SmcrLgr, o: LinkStateChanged) -> None:
        if o.new != LinkState.UNUSED:
            self._sync_link(g, o.link_id)
        log.info("SMC-R link group %#x link %d: %s -> %s", g.lgr_id, o.link_id,
                 o.old.value, o.new.value)  # fmt: skip

    def _on_lgr_type(self, g: SmcrLgr, o: LgrTypeChanged) -> None:
        log.info("SMC-R link group %#x: type %s -> %s", g.lgr_id, o.old.value, o.new.value)
        with contextlib.suppress(SmcError):
            self.registry.update_link_group(g.lgr_id, lgr_type=reg.LgrType(o.new.value))

    def _on_first_contact_done(self, g: SmcrLgr, o: FirstContactDone) -> None:
        self._first_done(g, o.link_id, None)

    def _on_first_contact_failed(self, g: SmcrLgr, o: FirstContactFailed) -> None:
        self._first_done(g, None, o.explanation)

    def _on_terminated(self, g: SmcrLgr, o: LinkGroupTerminated) -> None:
        log.info("SMC-R link group %#x terminated: %s", g.lgr_id, o.explanation)
        self._first_done(g, None, o.explanation)
        self._teardown(g)

    def _on_llc_ignored(self, g: SmcrLgr, o: LlcIgnored) -> None:
        log.debug("SMC-R link group %#x: LLC ignored: %s", g.lgr_id, o.why)

    def _on_add_link_result(self, g: SmcrLgr, o: AddLinkResult) -> None:
        log.info("SMC-R link group %#x: ADD LINK %s: %s", g.lgr_id,
                 "done" if o.ok else "failed", o.explanation)  # fmt: skip

    def _on_rmb_result(self, g: SmcrLgr, o: RmbConfirmed | RmbDeleted) -> None:
        log.debug("SMC-R link group %#x: %s", g.lgr_id, o)

    _HANDLERS: ClassVar[Mapping[type, _Handler]] = {
        SendLlc: _on_send_llc,
        CreateQp: _on_create_qp,
        QpToRtr: _on_qp_to_rtr,
        QpToRts: _on_qp_to_rts,
        DestroyQp: _on_destroy_qp,
        MoveConnection: _on_move_connection,
        AbortConnections: _on_abort_connections,
        LinkStateChanged: _on_link_state,
        LgrTypeChanged: _on_lgr_type,
        FirstContactDone: _on_first_contact_done,
        FirstContactFailed: _on_first_contact_failed,
        LinkGroupTerminated: _on_terminated,
        LlcIgnored: _on_llc_ignored,
        AddLinkResult: _on_add_link_result,
        RmbConfirmed: _on_rmb_result,
        RmbDeleted: _on_rmb_result,
    }

    # ------------------------------------------------------------------ helpers
    def _lgr_netdev(self, g: SmcrLgr) -> str:
        rec = self.registry.link_group(g.lgr_id)
        return rec.netdev if rec is not None else ""

    def _sync_link(self, g: SmcrLgr, link_id: int) -> None:
        """The registry's record of a link from the link group machine: state, uids, peer."""
        info = next((i for i in g.fsm.links() if i.link_id == link_id), None)
        if info is None:
            return
        changes: dict[str, Any] = {"state": reg.LinkState(info.state.value),
                                   "link_uid": info.link_uid}  # fmt: skip
        if info.peer_link_uid is not None:
            changes["peer_link_uid"] = info.peer_link_uid
        if info.peer_gid is not None:
            changes["peer_gid"] = info.peer_gid
        if info.peer_qpn is not None:
            changes["peer_qpn"] = info.peer_qpn
        if info.mtu is not None:
            changes["mtu"] = mtu_bytes(info.mtu)
        self._reg_link(g, link_id, **changes)

    def _reg_link(self, g: SmcrLgr, link_id: int, **changes: Any) -> None:
        with contextlib.suppress(SmcError):
            self.registry.update_link(g.lgr_id, link_id, **changes)

    def _first_done(self, g: SmcrLgr, link_id: int | None, why: str | None) -> None:
        if link_id is not None and link_id not in g.links and len(g.links) == 1:
            # the server numbered the first link differently (smc_llc_eval_conf_link)
            (old,) = g.links
            vl = g.links.pop(old)
            g.links[link_id] = vl
            self._by_qp[(vl.port.device, vl.qpn)] = (g, link_id)
            if old in g.peer_macs:
                g.peer_macs[link_id] = g.peer_macs.pop(old)
            with contextlib.suppress(SmcError):
                rec = self.registry.remove_link(g.lgr_id, old)
                self.registry.add_link(dataclasses.replace(rec, link_id=link_id))
        if link_id is not None:
            self._sync_link(g, link_id)
        if why is None:
            g.confirmed = True
        fut = g.first
        if fut is not None and not fut.done():
            fut.set_result(why)
        g.first = None

    def _destroy_later(self, vl: VerbsLink) -> None:
        def destroy() -> None:
            self._by_qp.pop((vl.port.device, vl.qpn), None)
            vl.close()

        def quiesce() -> None:
            with contextlib.suppress(SmcError):
                vl.to_error()

        if self._loop is not None and not self._closed:
            # the last sends (DELETE LINK) drain, then the QP goes to ERR (as smcr_link_clear
            # does) and is destroyed once the flushed work has completed
            self._loop.call_later(DESTROY_DELAY, quiesce)
            self._loop.call_later(2 * DESTROY_DELAY, destroy)
        else:
            destroy()

    # ------------------------------------------------------------------ time
    def _schedule_tick(self, g: SmcrLgr) -> None:
        if g.timer is not None:
            g.timer.cancel()
            g.timer = None
        if g.gone or self._loop is None:
            return
        deadline = g.fsm.next_deadline()
        if deadline is not None:
            delay = max(0.0, deadline - self._now())
            g.timer = self._loop.call_later(delay, self._on_tick, g)

    def _on_tick(self, g: SmcrLgr) -> None:
        g.timer = None
        if not g.gone:
            self._apply(g, g.fsm.tick(self._now()))
