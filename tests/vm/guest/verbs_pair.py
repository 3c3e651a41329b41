"""Two reliable-connected queue pairs on two rxe devices, connected to RTS with pyverbs.

Deliberately raw pyverbs (not smcd's adapters): these tests prove the VM gives real verbs, so
that a later smcd failure is smcd's, not the harness's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import pyverbs.enums as e  # type: ignore[import-untyped]
from pyverbs.addr import AHAttr, GlobalRoute  # type: ignore[import-untyped]
from pyverbs.cq import CQ  # type: ignore[import-untyped]
from pyverbs.device import Context  # type: ignore[import-untyped]
from pyverbs.mr import MR  # type: ignore[import-untyped]
from pyverbs.pd import PD  # type: ignore[import-untyped]
from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr  # type: ignore[import-untyped]
from pyverbs.wr import SGE, RecvWR, SendWR  # type: ignore[import-untyped]

from tests.vm.topology import Port, ipv4_mapped_gid_text

ACCESS = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE | e.IBV_ACCESS_REMOTE_READ
PATH_MTU = e.IBV_MTU_1024


def ipv4_gid_index(port: Port) -> int:
    """Index of the port's IPv4-mapped RoCEv2 GID, found in sysfs."""
    gids = f"/sys/class/infiniband/{port.rxe}/ports/1/gids"
    want = ipv4_mapped_gid_text(port.address)
    for i in range(256):
        try:
            with open(f"{gids}/{i}") as f:
                if f.read().strip() == want:
                    return i
        except FileNotFoundError:
            break
        except OSError:
            continue  # EINVAL for empty slots
    raise AssertionError(f"{port.rxe}: no GID {want} in sysfs")


@dataclass
class Completion:
    opcode: int
    byte_len: int
    wr_id: int


class RcEnd:
    """PD, one MR of ``size`` bytes, one CQ and one RC QP on ``port``'s rxe device."""

    def __init__(self, port: Port, size: int) -> None:
        self.port = port
        self.size = size
        self.ctx = Context(name=port.rxe)
        self.gid_index = ipv4_gid_index(port)
        self.gid = self.ctx.query_gid(1, self.gid_index)
        self.pd = PD(self.ctx)
        self.mr = MR(self.pd, size, ACCESS)
        self.cq = CQ(self.ctx, 64)
        cap = QPCap(max_send_wr=16, max_recv_wr=16, max_send_sge=1, max_recv_sge=1)
        self.qp = QP(self.pd, QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap))

    def connect(self, peer: RcEnd, *, sq_psn: int, rq_psn: int) -> None:
        """RESET → INIT → RTR → RTS towards ``peer``'s QP, addressed by its RoCEv2 GID."""
        gr = GlobalRoute(dgid=peer.gid, sgid_index=self.gid_index, hop_limit=64)
        attr = QPAttr(qp_state=e.IBV_QPS_INIT, cur_qp_state=e.IBV_QPS_RESET)
        attr.port_num = 1
        attr.pkey_index = 0
        attr.qp_access_flags = ACCESS
        attr.path_mtu = PATH_MTU
        attr.dest_qp_num = peer.qp.qp_num
        attr.rq_psn = rq_psn
        attr.sq_psn = sq_psn
        attr.max_dest_rd_atomic = 1
        attr.max_rd_atomic = 1
        attr.min_rnr_timer = 12
        attr.timeout = 14
        attr.retry_cnt = 7
        attr.rnr_retry = 7
        attr.ah_attr = AHAttr(port_num=1, is_global=1, gr=gr)
        self.qp.to_rts(attr)

    def qp_state(self) -> int:
        attr, _init = self.qp.query(e.IBV_QP_STATE)
        return int(attr.qp_state)

    def rdma_write(self, peer: RcEnd, length: int, *, wr_id: int = 1) -> None:
        sge = SGE(self.mr.buf, length, self.mr.lkey)
        wr = SendWR(
            wr_id=wr_id, opcode=e.IBV_WR_RDMA_WRITE, num_sge=1, sg=[sge],
            send_flags=e.IBV_SEND_SIGNALED,
        )  # fmt: skip
        wr.set_wr_rdma(peer.mr.rkey, peer.mr.buf)
        self.qp.post_send(wr)

    def send(self, offset: int, length: int, *, wr_id: int) -> None:
        sge = SGE(self.mr.buf + offset, length, self.mr.lkey)
        self.qp.post_send(
            SendWR(
                wr_id=wr_id,
                opcode=e.IBV_WR_SEND,
                num_sge=1,
                sg=[sge],
                send_flags=e.IBV_SEND_SIGNALED,
            )
        )

    def post_recv(self, offset: int, length: int, *, wr_id: int) -> None:
        sge = SGE(self.mr.buf + offset, length, self.mr.lkey)
        self.qp.post_recv(RecvWR(wr_id=wr_id, num_sge=1, sg=[sge]))

    def poll(self, timeout: float = 30.0) -> Completion:
        """The next completion, which must be successful (TCG makes rxe slow: be patient)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            n, wcs = self.cq.poll()
            if n:
                wc = wcs[0]
                assert wc.status == e.IBV_WC_SUCCESS, (
                    f"{self.port.rxe}: completion wr_id {wc.wr_id} status {wc.status} "
                    f"({e.ibv_wc_status(wc.status).name if hasattr(e, 'ibv_wc_status') else ''})"
                )
                return Completion(int(wc.opcode), int(wc.byte_len), int(wc.wr_id))
            time.sleep(0.001)
        raise AssertionError(f"{self.port.rxe}: no completion within {timeout} s")

    def close(self) -> None:
        for obj in (self.qp, self.cq, self.mr, self.pd, self.ctx):
            obj.close()


def connected_pair(a: Port, b: Port, size: int) -> tuple[RcEnd, RcEnd]:
    """RC QPs on ``a`` and ``b`` in RTS towards each other (distinct PSNs per direction)."""
    end_a, end_b = RcEnd(a, size), RcEnd(b, size)
    end_a.connect(end_b, sq_psn=0x1234, rq_psn=0x4321)
    end_b.connect(end_a, sq_psn=0x4321, rq_psn=0x1234)
    return end_a, end_b
