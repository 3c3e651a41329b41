"""One RC queue pair of an SMC-R link (:class:`VerbsLink`): its send slots and receive
buffers, the INIT → RTR → RTS moves, SENDs and RDMA WRITEs, and the bookkeeping of its work
requests. Its :class:`~smcd_daemon.transport.verbs.VerbsPort` owns the CQ they complete on: the
port hands each completion to the link (``take_rx``/``repost_rx``/``retire_sq``/``fail``), and
the link registers its work requests in the port's ``pending`` table under ``next_wr_id()``.
"""

from __future__ import annotations

import contextlib
import logging
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from smcd_daemon.transport.verbs_lib import (
    SendSlotsExhausted,
    VerbsError,
    build_qp_attr,
    load_pyverbs,
    verbs_error,
)
from smcd_daemon.transport.verbs_model import (
    SMC_IB_MAX_SEND_SGE,
    SMC_WR_BUF_CNT,
    SMC_WR_BUF_SIZE,
    SMC_WR_BUF_V2_SIZE,
    SMC_WR_RX_CNT,
    SMC_WR_TX_SIZE,
    SMC_WR_TX_WR_MAX,
    LinkError,
    LinkParams,
    QpAttrSpec,
    RemoteRing,
    VerbsEvent,
    WrKind,
    init_attrs,
    plan_ring_write,
    rtr_attrs,
    rts_attrs,
)
from smcd_daemon.transport.verbs_mr import MemoryRegion

if TYPE_CHECKING:
    from smcd_daemon.transport.verbs import VerbsPort

__all__ = ["QP_STATE_NAMES", "VerbsLink", "WorkRequest"]

log = logging.getLogger("smcd_daemon.transport.verbs")  # the transport's logger


@dataclass
class WorkRequest:
    link: VerbsLink
    kind: WrKind
    tag: Hashable | None
    signaled: bool
    length: int = 0
    slot: int | None = None  # send slot (SEND) / receive buffer index (RECV)
    v2: bool = False


QP_STATE_NAMES = {0: "RESET", 1: "INIT", 2: "RTR", 3: "RTS", 4: "SQD", 5: "SQE", 6: "ERR"}


# --------------------------------------------------------------------------------------------
# the link
# --------------------------------------------------------------------------------------------


class VerbsLink:
    """One RC QP of an SMC-R link, with its send slots and receive buffers."""

    def __init__(self, port: VerbsPort, gid_index: int, *, v2: bool, psn: int) -> None:
        pv = load_pyverbs()
        e = pv.e
        self.port = port
        self.gid_index = gid_index
        self.v2 = v2
        self.psn = psn
        self.gid = port.gid(gid_index)
        self.mac = port.mac(gid_index)
        self.mtu = port.active_mtu
        self.peer: LinkParams | None = None
        self.error: str | None = None
        self._closed = False
        rx_sges = 2 if v2 else 1
        self._qp: Any = None
        for inline in (SMC_WR_TX_SIZE, 0):
            cap = pv.qp.QPCap(
                max_send_wr=SMC_WR_TX_WR_MAX,
                max_recv_wr=SMC_WR_RX_CNT,
                max_send_sge=SMC_IB_MAX_SEND_SGE,
                max_recv_sge=rx_sges,
                max_inline_data=inline,
            )
            init = pv.qp.QPInitAttr(
                qp_type=e.IBV_QPT_RC, scq=port.cq, rcq=port.cq, cap=cap, sq_sig_all=0
            )
            try:
                self._qp = pv.qp.QP(port.pd, init)
                break
            except pv.Error as exc:
                if inline == 0:
                    raise verbs_error(f"ibv_create_qp on {port.device}", exc) from exc
        qp = self._qp
        self.qpn = int(qp.qp_num)
        _attr, init_attr = qp.query(e.IBV_QP_CAP)
        self.max_inline = int(init_attr.cap.max_inline_data)
        self.sq_depth = min(SMC_WR_TX_WR_MAX, int(init_attr.cap.max_send_wr))
        # buffers: send slots (used when the device cannot inline), receive buffers, v2 8 KiB
        self._tx_mr = pv.mr.MR(port.pd, SMC_WR_BUF_CNT * SMC_WR_BUF_SIZE, e.IBV_ACCESS_LOCAL_WRITE)
        self._rx_mr = pv.mr.MR(port.pd, SMC_WR_RX_CNT * SMC_WR_BUF_SIZE, e.IBV_ACCESS_LOCAL_WRITE)
        self._v2_tx_mr: Any = None
        self._v2_rx_mr: Any = None
        if v2:
            self._v2_tx_mr = pv.mr.MR(port.pd, SMC_WR_BUF_V2_SIZE, e.IBV_ACCESS_LOCAL_WRITE)
            self._v2_rx_mr = pv.mr.MR(port.pd, SMC_WR_BUF_V2_SIZE, e.IBV_ACCESS_LOCAL_WRITE)
        self._free_slots: deque[int] = deque(range(SMC_WR_BUF_CNT))
        self._v2_busy = False
        self._sq: deque[int] = deque()  # wr_ids posted on the send queue, in order
        self.rx_outstanding = 0

    # ---- parameters and state --------------------------------------------------------------

    @property
    def local(self) -> LinkParams:
        """What the peer needs to connect to this QP."""
        return LinkParams(gid=self.gid, qpn=self.qpn, psn=self.psn, mtu=self.mtu, mac=self.mac)

    def state(self) -> str:
        e = load_pyverbs().e
        attr, _init = self._qp.query(e.IBV_QP_STATE)
        return QP_STATE_NAMES.get(int(attr.qp_state), str(int(attr.qp_state)))

    @property
    def free_send_slots(self) -> int:
        return len(self._free_slots)

    @property
    def path_mtu(self) -> int | None:
        return None if self.peer is None else min(self.mtu, self.peer.mtu)

    # ---- state transitions -----------------------------------------------------------------

    def _modify(self, spec: QpAttrSpec) -> None:
        attr, mask = build_qp_attr(spec)
        try:
            self._qp.modify(attr, mask)
        except load_pyverbs().Error as exc:
            raise verbs_error(
                f"ibv_modify_qp to {spec.state} on {self.port.device} QP {self.qpn}", exc
            ) from exc

    def to_init(self) -> None:
        self._modify(init_attrs(self.port.port))
        for i in range(SMC_WR_RX_CNT):
            self.repost_rx(i)

    def to_rtr(self, peer: LinkParams, *, uses_gateway: bool = False) -> None:
        self.peer = peer
        self._modify(
            rtr_attrs(
                peer,
                local_mtu=self.mtu,
                sgid_index=self.gid_index,
                port_num=self.port.port,
                uses_gateway=uses_gateway,
            )
        )

    def to_rts(self) -> None:
        self._modify(rts_attrs(self.psn))

    def to_error(self) -> None:
        """Any state → ERR: outstanding work is flushed (with error completions) and nothing
        more goes out - a dying link quiesces before its QP is destroyed."""
        if not self._closed:
            self._modify(QpAttrSpec("ERR"))

    def connect(self, peer: LinkParams, *, uses_gateway: bool = False) -> None:
        """RESET → INIT (receive buffers posted) → RTR (towards ``peer``) → RTS."""
        self.to_init()
        self.to_rtr(peer, uses_gateway=uses_gateway)
        self.to_rts()

    # ---- posting ---------------------------------------------------------------------------

    def _check_usable(self, wrs: int) -> None:
        if self._closed:
            raise VerbsError(f"link QP {self.qpn} is closed")
        if self.error is not None:
            raise VerbsError(f"link QP {self.qpn} is down ({self.error})")
        if len(self._sq) + wrs > self.sq_depth:
            raise SendSlotsExhausted(
                f"QP {self.qpn}: send queue full ({len(self._sq)} of {self.sq_depth} in flight)"
            )

    def _post(self, wr: Any, rec: WorkRequest, wr_id: int) -> None:
        pv = load_pyverbs()
        self.port.pending[wr_id] = rec
        self._sq.append(wr_id)
        try:
            self._qp.post_send(wr)
        except pv.Error as exc:
            self.port.pending.pop(wr_id, None)
            self._sq.remove(wr_id)
            raise verbs_error(f"ibv_post_send on QP {self.qpn}", exc) from exc

    def send(self, msg: bytes, *, tag: Hashable | None = None) -> int:
        """Post one LLC/CDC message (padded to 44 bytes) as a signaled, solicited SEND, inline
        when the QP can; returns the wr_id that SendDone/CompletionFailed will carry."""
        if len(msg) > SMC_WR_TX_SIZE:
            return self.send_v2(msg, tag=tag)
        self._check_usable(1)
        if not self._free_slots:
            raise SendSlotsExhausted(f"QP {self.qpn}: all {SMC_WR_BUF_CNT} send slots in flight")
        pv = load_pyverbs()
        e = pv.e
        data = bytes(msg).ljust(SMC_WR_TX_SIZE, b"\0")
        slot = self._free_slots.popleft()
        off = slot * SMC_WR_BUF_SIZE
        self._tx_mr.write(data, SMC_WR_TX_SIZE, off)
        flags = int(e.IBV_SEND_SIGNALED) | int(e.IBV_SEND_SOLICITED)
        if self.max_inline >= SMC_WR_TX_SIZE:
            flags |= int(e.IBV_SEND_INLINE)
        wr_id = self.port.next_wr_id()
        sge = pv.wr.SGE(self._tx_mr.buf + off, SMC_WR_TX_SIZE, self._tx_mr.lkey)
        wr = pv.wr.SendWR(wr_id=wr_id, opcode=e.IBV_WR_SEND, num_sge=1, sg=[sge], send_flags=flags)
        try:
            self._post(wr, WorkRequest(self, WrKind.SEND, tag, True, SMC_WR_TX_SIZE, slot), wr_id)
        except VerbsError:
            self._free_slots.appendleft(slot)
            raise
        return wr_id

    def send_v2(self, msg: bytes, *, tag: Hashable | None = None) -> int:
        """Post an SMC-Rv2 LLC message longer than 44 bytes from the link's one 8 KiB buffer
        (one at a time, as the kernel's ``wr_tx_v2_pend``)."""
        if not self.v2:
            raise ValueError(f"{len(msg)}-byte message on a v1 link (max {SMC_WR_TX_SIZE})")
        if len(msg) > SMC_WR_BUF_V2_SIZE:
            raise ValueError(f"LLC message of {len(msg)} bytes exceeds {SMC_WR_BUF_V2_SIZE}")
        self._check_usable(1)
        if self._v2_busy:
            raise SendSlotsExhausted(f"QP {self.qpn}: the v2 send buffer is in flight")
        pv = load_pyverbs()
        e = pv.e
        mr = self._v2_tx_mr
        mr.write(bytes(msg), len(msg), 0)
        wr_id = self.port.next_wr_id()
        sge = pv.wr.SGE(mr.buf, len(msg), mr.lkey)
        flags = int(e.IBV_SEND_SIGNALED) | int(e.IBV_SEND_SOLICITED)
        wr = pv.wr.SendWR(wr_id=wr_id, opcode=e.IBV_WR_SEND, num_sge=1, sg=[sge], send_flags=flags)
        self._v2_busy = True
        try:
            self._post(
                wr, WorkRequest(self, WrKind.SEND, tag, True, len(msg), None, v2=True), wr_id
            )
        except VerbsError:
            self._v2_busy = False
            raise
        return wr_id

    def rdma_write(
        self,
        src: MemoryRegion,
        sges: list[tuple[int, int]],
        remote_addr: int,
        rkey: int,
        *,
        tag: Hashable | None = None,
        signaled: bool = True,
    ) -> int:
        """One RDMA WRITE gathering ``sges`` ((offset, length) into ``src``, at most two) to
        ``remote_addr`` under ``rkey``. Unsignaled writes complete with the next signaled work
        request (RC executes them in order); errors are reported either way."""
        if not 1 <= len(sges) <= SMC_IB_MAX_SEND_SGE:
            raise ValueError(f"an RDMA WRITE gathers 1..{SMC_IB_MAX_SEND_SGE} pieces")
        for off, n in sges:
            if off < 0 or n <= 0 or off + n > src.length:
                raise ValueError(f"piece ({off}, {n}) outside the {src.length}-byte region")
        self._check_usable(1)
        pv = load_pyverbs()
        e = pv.e
        wr_id = self.port.next_wr_id()
        sg = [pv.wr.SGE(src.addr + off, n, src.lkey) for off, n in sges]
        flags = int(e.IBV_SEND_SIGNALED) if signaled else 0
        wr = pv.wr.SendWR(
            wr_id=wr_id, opcode=e.IBV_WR_RDMA_WRITE, num_sge=len(sg), sg=sg, send_flags=flags
        )
        wr.set_wr_rdma(rkey, remote_addr)
        length = sum(n for _off, n in sges)
        self._post(wr, WorkRequest(self, WrKind.WRITE, tag, signaled, length), wr_id)
        return wr_id

    def write_ring(
        self,
        src: MemoryRegion,
        length: int,
        *,
        src_offset: int,
        dst: RemoteRing,
        dst_offset: int,
        src_size: int | None = None,
        src_base: int = 0,
        notify: bytes | None = None,
        tag: Hashable | None = None,
    ) -> list[int]:
        """Move ``length`` bytes from the local ring (``src_size`` bytes at ``src_base`` in
        ``src``) at ``src_offset`` into the peer's ring at ``dst_offset``: one or two RDMA
        WRITEs (split where the peer's ring wraps), then the CDC message ``notify`` as a SEND on
        the same QP, so the peer sees the data before the cursor that announces it.

        The writes are unsignaled when a notification follows (its SendDone covers them);
        otherwise the last write is signaled. Returns the wr_ids posted."""
        size = src.length - src_base if src_size is None else src_size
        if src_base < 0 or src_base + size > src.length:
            raise ValueError("local ring outside the registered region")
        plan = plan_ring_write(
            length, src_offset=src_offset, src_size=size, dst_offset=dst_offset, dst_size=dst.size
        )
        self._check_usable(len(plan) + (notify is not None))
        if notify is not None and not self._free_slots:
            raise SendSlotsExhausted(f"QP {self.qpn}: all {SMC_WR_BUF_CNT} send slots in flight")
        ids = []
        for i, piece in enumerate(plan):
            last = i == len(plan) - 1
            ids.append(
                self.rdma_write(
                    src,
                    [(src_base + s.offset, s.length) for s in piece.sges],
                    dst.addr + piece.remote_offset,
                    dst.rkey,
                    tag=tag,
                    signaled=last and notify is None,
                )
            )
        if notify is not None:
            ids.append(self.send(notify, tag=tag))
        return ids

    # ---- receive side ----------------------------------------------------------------------

    def repost_rx(self, index: int) -> None:
        if self._closed or self.error is not None:
            return
        pv = load_pyverbs()
        wr_id = self.port.next_wr_id()
        sg = [
            pv.wr.SGE(self._rx_mr.buf + index * SMC_WR_BUF_SIZE, SMC_WR_TX_SIZE, self._rx_mr.lkey)
        ]
        if self._v2_rx_mr is not None:  # spill-over for v2 LLC messages (shared, as the kernel)
            sg.append(
                pv.wr.SGE(
                    self._v2_rx_mr.buf, SMC_WR_BUF_V2_SIZE - SMC_WR_TX_SIZE, self._v2_rx_mr.lkey
                )
            )
        self.port.pending[wr_id] = WorkRequest(self, WrKind.RECV, None, True, 0, index)
        try:
            self._qp.post_recv(pv.wr.RecvWR(wr_id=wr_id, num_sge=len(sg), sg=sg))
        except pv.Error as exc:
            self.port.pending.pop(wr_id, None)
            raise verbs_error(f"ibv_post_recv on QP {self.qpn}", exc) from exc
        self.rx_outstanding += 1

    def take_rx(self, wr: WorkRequest, wc: Any) -> bytes:
        n = int(wc.byte_len)
        head = self._rx_mr.read(min(n, SMC_WR_TX_SIZE), (wr.slot or 0) * SMC_WR_BUF_SIZE)
        if n > SMC_WR_TX_SIZE and self._v2_rx_mr is not None:
            head += self._v2_rx_mr.read(n - SMC_WR_TX_SIZE, 0)
        return bytes(head)

    # ---- completion bookkeeping ------------------------------------------------------------

    def retire_sq(self, wr_id: int, wr: WorkRequest) -> None:
        """A send-queue WR completed: it and every unsignaled WR before it are done."""
        while self._sq:
            done = self._sq.popleft()
            rec = wr if done == wr_id else self.port.pending.pop(done, None)
            if rec is not None:
                if rec.slot is not None and rec.kind is WrKind.SEND:
                    self._free_slots.append(rec.slot)
                if rec.v2:
                    self._v2_busy = False
            if done == wr_id:
                return

    def fail(self, reason: str, events: list[VerbsEvent]) -> None:
        if self.error is None:
            self.error = reason
            events.append(LinkError(self.port.device, self.qpn, reason))

    # ---- teardown --------------------------------------------------------------------------

    def close(self) -> None:
        """Destroy the QP and its buffers (outstanding work is dropped without events)."""
        if self._closed:
            return
        self._closed = True
        self.port.forget(self)
        for obj in (self._qp, self._tx_mr, self._rx_mr, self._v2_tx_mr, self._v2_rx_mr):
            if obj is not None:
                with contextlib.suppress(Exception):
                    obj.close()
