"""The pure half of the SMC-R verbs transport: sizes, MTU and GID rules, the QP attribute sets of
the kernel's ``smc_ib_modify_qp_init/rtr/rts``, the ring-write planner, and the events the
transport emits.

Nothing here touches pyverbs or a device, so the rules are unit-tested on any machine; the
adapter in :mod:`smcd_daemon.transport.verbs` turns them into verbs calls.

Sources: Linux ``net/smc/smc_ib.c`` (QP attributes and timers), ``smc_wr.h/.c`` (buffer counts,
inline sends, max. two RDMA WRITEs per CDC send), ``smc_tx.c`` (``smc_tx_rdma_writes``: a write
splits where the peer's RMBE wraps, each write gathers from at most two pieces of the local ring).
"""

from __future__ import annotations

import enum
import secrets
from collections.abc import Hashable
from dataclasses import dataclass, field

__all__ = [
    "IBV_MTU_BYTES",
    "IPV6_DEFAULT_HOPLIMIT",
    "SMC_IB_MAX_SEND_SGE",
    "SMC_QP_MIN_RNR_TIMER",
    "SMC_QP_RETRY_CNT",
    "SMC_QP_RNR_RETRY",
    "SMC_QP_TIMEOUT",
    "SMC_WR_BUF_CNT",
    "SMC_WR_BUF_SIZE",
    "SMC_WR_BUF_V2_SIZE",
    "SMC_WR_RX_CNT",
    "SMC_WR_TX_SIZE",
    "SMC_WR_TX_WR_MAX",
    "CompletionFailed",
    "GrhSpec",
    "LinkError",
    "LinkParams",
    "MessageReceived",
    "PortStateChanged",
    "QpAttrSpec",
    "RemoteRing",
    "SendDone",
    "Sge",
    "VerbsEvent",
    "WrKind",
    "WriteDone",
    "WritePiece",
    "build_grh",
    "init_attrs",
    "ipv4_mapped_gid",
    "mac_from_gid",
    "mtu_bytes",
    "mtu_enum",
    "negotiated_mtu",
    "plan_ring_write",
    "random_psn",
    "rtr_attrs",
    "rts_attrs",
    "wc_status_name",
]

# --------------------------------------------------------------------------------------------
# sizes (smc_wr.h, smc_ib.h)
# --------------------------------------------------------------------------------------------

#: Send buffers (and so outstanding LLC/CDC sends) per link.
SMC_WR_BUF_CNT = 16
#: Size of one send/receive buffer slot; messages are :data:`SMC_WR_TX_SIZE` of it.
SMC_WR_BUF_SIZE = 48
#: Length of every v1 LLC and CDC message on the wire.
SMC_WR_TX_SIZE = 44
#: The one SMC-Rv2 buffer per link for LLC messages longer than 44 bytes (ADD LINK v2 …).
SMC_WR_BUF_V2_SIZE = 8192
#: Receive buffers per link (the kernel posts three times the send buffers).
SMC_WR_RX_CNT = SMC_WR_BUF_CNT * 3
#: Send queue depth: each CDC send may be preceded by two unsignaled RDMA WRITEs.
SMC_WR_TX_WR_MAX = SMC_WR_BUF_CNT * 3
#: Gather entries per RDMA WRITE (the local ring may wrap inside one write).
SMC_IB_MAX_SEND_SGE = 2

#: smc_ib.c timers and retries.
SMC_QP_MIN_RNR_TIMER = 5
SMC_QP_TIMEOUT = 15  # 4.096 µs * 2**15 ≈ 134 ms local ACK timeout
SMC_QP_RETRY_CNT = 7
SMC_QP_RNR_RETRY = 7  # 7 = infinite
#: Hop limit of the GRH when an SMC-Rv2 link group goes through a gateway (else 1).
IPV6_DEFAULT_HOPLIMIT = 64

# --------------------------------------------------------------------------------------------
# MTU, PSN, GID
# --------------------------------------------------------------------------------------------

#: ``enum ibv_mtu`` → bytes (the CLC's 4-bit ``qp_mtu`` carries the enum value).
IBV_MTU_BYTES: dict[int, int] = {1: 256, 2: 512, 3: 1024, 4: 2048, 5: 4096}
_MTU_ENUM = {v: k for k, v in IBV_MTU_BYTES.items()}


def mtu_enum(nbytes: int) -> int:
    """Bytes → ``enum ibv_mtu`` (256 → 1 … 4096 → 5); anything else is a ValueError."""
    try:
        return _MTU_ENUM[nbytes]
    except KeyError:
        raise ValueError(f"{nbytes} is not an IB path MTU (256, 512, 1024, 2048, 4096)") from None


def mtu_bytes(value: int) -> int:
    """``enum ibv_mtu`` → bytes; ValueError for values outside 1..5."""
    try:
        return IBV_MTU_BYTES[value]
    except KeyError:
        raise ValueError(f"{value} is not an ibv_mtu value (1..5)") from None


def negotiated_mtu(local: int, peer: int) -> int:
    """The path MTU of a link: the smaller of ours and the peer's (``smc_ib_modify_qp_rtr``)."""
    mtu_bytes(local)
    mtu_bytes(peer)
    return min(local, peer)


def random_psn() -> int:
    """A random 24-bit initial packet sequence number, as ``smcr_link_init`` draws one."""
    return secrets.randbits(24)


def ipv4_mapped_gid(address: str) -> bytes:
    """The RoCEv2 GID of an IPv4 address (``::ffff:a.b.c.d``)."""
    octets = bytes(int(o) for o in address.split("."))
    if len(octets) != 4:
        raise ValueError(f"not an IPv4 address: {address!r}")
    return bytes(10) + b"\xff\xff" + octets


def mac_from_gid(gid: bytes) -> bytes:
    """A MAC derived from a link-local GID's EUI-64, as ``smc_ib_fill_gid_and_mac`` does when
    the device has no netdev to ask (bytes 8-10 and 13-15, universal/local bit cleared)."""
    if len(gid) != 16:
        raise ValueError("GID must be 16 bytes")
    mac = bytearray(gid[8:11] + gid[13:16])
    mac[0] &= ~0x02 & 0xFF
    return bytes(mac)


# --------------------------------------------------------------------------------------------
# QP attributes
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LinkParams:
    """What one end of a link tells the other (CLC Accept/Confirm, LLC ADD LINK): enough for the
    peer to move its QP to RTR. ``mtu`` is the ``enum ibv_mtu`` value."""

    gid: bytes
    qpn: int
    psn: int
    mtu: int
    mac: bytes = bytes(6)

    def __post_init__(self) -> None:
        if len(self.gid) != 16:
            raise ValueError("gid must be 16 bytes")
        if not 0 < self.qpn < 1 << 24:
            raise ValueError(f"qpn {self.qpn} is not a 24-bit QP number")
        if not 0 <= self.psn < 1 << 24:
            raise ValueError(f"psn {self.psn} is not a 24-bit PSN")
        mtu_bytes(self.mtu)
        if len(self.mac) != 6:
            raise ValueError("mac must be 6 bytes")


@dataclass(frozen=True, slots=True)
class GrhSpec:
    """The global route header of the address vector. RoCE always routes by GID: the packet
    format (RoCEv1 Ethernet frame or RoCEv2 UDP/IP) follows the type of the source GID at
    ``sgid_index``, so one rule serves both."""

    dgid: bytes
    sgid_index: int
    hop_limit: int
    traffic_class: int = 0
    flow_label: int = 0


def build_grh(peer_gid: bytes, sgid_index: int, *, uses_gateway: bool = False) -> GrhSpec:
    """GRH towards ``peer_gid``: hop limit 1 for a directly attached peer, 64 when an SMC-Rv2
    link group routes through a gateway (``smc_ib_modify_qp_rtr``)."""
    if len(peer_gid) != 16:
        raise ValueError("peer GID must be 16 bytes")
    if not 0 <= sgid_index < 256:
        raise ValueError(f"sgid_index {sgid_index} out of range")
    return GrhSpec(
        dgid=bytes(peer_gid),
        sgid_index=sgid_index,
        hop_limit=IPV6_DEFAULT_HOPLIMIT if uses_gateway else 1,
    )


@dataclass(frozen=True)
class QpAttrSpec:
    """One ``ibv_modify_qp`` call: the target state, the attribute values and, implicitly, the
    mask (``IBV_QP_<NAME>`` for each attribute plus ``IBV_QP_STATE``). ``grh``, when present,
    becomes the address vector (``IBV_QP_AV``)."""

    state: str  # "INIT" | "RTR" | "RTS"
    attrs: dict[str, int] = field(default_factory=dict)
    port_num: int | None = None
    grh: GrhSpec | None = None
    av_port: int | None = None  # the address vector's port (part of AV, not a mask bit)

    def mask_names(self) -> tuple[str, ...]:
        names = ["STATE", *(_MASK_OF[a] for a in self.attrs)]
        if self.port_num is not None:
            names.append("PORT")
        if self.grh is not None:
            names.append("AV")
        return tuple(names)


_MASK_OF = {
    "pkey_index": "PKEY_INDEX",
    "qp_access_flags": "ACCESS_FLAGS",
    "path_mtu": "PATH_MTU",
    "dest_qp_num": "DEST_QPN",
    "rq_psn": "RQ_PSN",
    "max_dest_rd_atomic": "MAX_DEST_RD_ATOMIC",
    "min_rnr_timer": "MIN_RNR_TIMER",
    "timeout": "TIMEOUT",
    "retry_cnt": "RETRY_CNT",
    "rnr_retry": "RNR_RETRY",
    "sq_psn": "SQ_PSN",
    "max_rd_atomic": "MAX_QP_RD_ATOMIC",
}

#: IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE (the peer RDMA-writes into our RMBs).
ACCESS_LOCAL_WRITE = 1
ACCESS_REMOTE_WRITE = 2
SMC_QP_ACCESS = ACCESS_LOCAL_WRITE | ACCESS_REMOTE_WRITE


def init_attrs(port_num: int) -> QpAttrSpec:
    """RESET → INIT: pkey 0, the port, local+remote write access."""
    return QpAttrSpec(
        "INIT",
        {"pkey_index": 0, "qp_access_flags": SMC_QP_ACCESS},
        port_num=port_num,
    )


def rtr_attrs(
    peer: LinkParams,
    *,
    local_mtu: int,
    sgid_index: int,
    port_num: int,
    uses_gateway: bool = False,
) -> QpAttrSpec:
    """INIT → RTR towards ``peer``: its QPN and PSN, the smaller MTU, the GRH to its GID.

    ``port_num`` goes into the address vector (``rdma_ah_set_port_num``), not into the mask."""
    return QpAttrSpec(
        "RTR",
        {
            "path_mtu": negotiated_mtu(local_mtu, peer.mtu),
            "dest_qp_num": peer.qpn,
            "rq_psn": peer.psn,
            "max_dest_rd_atomic": 1,
            "min_rnr_timer": SMC_QP_MIN_RNR_TIMER,
        },
        grh=build_grh(peer.gid, sgid_index, uses_gateway=uses_gateway),
        av_port=port_num,
    )


def rts_attrs(local_psn: int) -> QpAttrSpec:
    """RTR → RTS: our initial send PSN, the kernel's ACK timeout and (infinite) retries."""
    if not 0 <= local_psn < 1 << 24:
        raise ValueError(f"psn {local_psn} is not a 24-bit PSN")
    return QpAttrSpec(
        "RTS",
        {
            "timeout": SMC_QP_TIMEOUT,
            "retry_cnt": SMC_QP_RETRY_CNT,
            "rnr_retry": SMC_QP_RNR_RETRY,
            "sq_psn": local_psn,
            "max_rd_atomic": 1,
        },
    )


# --------------------------------------------------------------------------------------------
# ring writes
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Sge:
    """A gather piece: ``length`` bytes at ``offset`` into the local ring."""

    offset: int
    length: int


@dataclass(frozen=True, slots=True)
class WritePiece:
    """One RDMA WRITE: to ``remote_offset`` into the peer's ring, gathered from ``sges``."""

    remote_offset: int
    sges: tuple[Sge, ...]

    @property
    def length(self) -> int:
        return sum(s.length for s in self.sges)


@dataclass(frozen=True, slots=True)
class RemoteRing:
    """The peer's RMBE as we address it: its virtual address, rkey and ring size."""

    addr: int
    rkey: int
    size: int


def _check_ring(name: str, offset: int, size: int) -> None:
    if size <= 0:
        raise ValueError(f"{name} ring size must be positive")
    if not 0 <= offset < size:
        raise ValueError(f"{name} offset {offset} outside its ring of {size} bytes")


def plan_ring_write(
    length: int, *, src_offset: int, src_size: int, dst_offset: int, dst_size: int
) -> tuple[WritePiece, ...]:
    """Split ``length`` bytes from the local ring (at ``src_offset``) to the peer's ring (at
    ``dst_offset``) into RDMA WRITEs: a new write where the peer's ring wraps (at most two, as
    ``smc_tx_rdma_writes``), each gathering from at most two pieces where the local ring wraps.

    ``length`` may not exceed either ring (the cursors never let it)."""
    _check_ring("source", src_offset, src_size)
    _check_ring("destination", dst_offset, dst_size)
    if length <= 0:
        raise ValueError("nothing to write")
    if length > src_size or length > dst_size:
        raise ValueError(f"{length} bytes do not fit the rings ({src_size}, {dst_size})")
    pieces: list[WritePiece] = []
    src, dst, left = src_offset, dst_offset, length
    while left:
        dst_len = min(left, dst_size - dst)
        sges: list[Sge] = []
        need = dst_len
        while need:
            n = min(need, src_size - src)
            sges.append(Sge(src, n))
            src = (src + n) % src_size
            need -= n
        pieces.append(WritePiece(dst, tuple(sges)))
        dst = (dst + dst_len) % dst_size
        left -= dst_len
    assert len(pieces) <= 2 and all(len(p.sges) <= SMC_IB_MAX_SEND_SGE for p in pieces)
    return tuple(pieces)


# --------------------------------------------------------------------------------------------
# completion status names
# --------------------------------------------------------------------------------------------

_WC_STATUS = (
    "SUCCESS",
    "LOC_LEN_ERR",
    "LOC_QP_OP_ERR",
    "LOC_EEC_OP_ERR",
    "LOC_PROT_ERR",
    "WR_FLUSH_ERR",
    "MW_BIND_ERR",
    "BAD_RESP_ERR",
    "LOC_ACCESS_ERR",
    "REM_INV_REQ_ERR",
    "REM_ACCESS_ERR",
    "REM_OP_ERR",
    "RETRY_EXC_ERR",
    "RNR_RETRY_EXC_ERR",
    "LOC_RDD_VIOL_ERR",
    "REM_INV_RD_REQ_ERR",
    "REM_ABORT_ERR",
    "INV_EECN_ERR",
    "INV_EEC_STATE_ERR",
    "FATAL_ERR",
    "RESP_TIMEOUT_ERR",
    "GENERAL_ERR",
    "TM_ERR",
    "TM_RNDV_INCOMPLETE",
)


def wc_status_name(status: int) -> str:
    """``enum ibv_wc_status`` value → its name without ``IBV_WC_`` (``REM_ACCESS_ERR``)."""
    if 0 <= status < len(_WC_STATUS):
        return _WC_STATUS[status]
    return f"STATUS_{status}"


# --------------------------------------------------------------------------------------------
# events (what the transport tells the link-group layer)
# --------------------------------------------------------------------------------------------


class WrKind(enum.Enum):
    SEND = "send"
    WRITE = "write"
    RECV = "recv"


@dataclass(frozen=True, slots=True)
class SendDone:
    """A SEND (LLC/CDC message) completed: the peer's QP has it. Frees one send slot."""

    device: str
    qpn: int
    wr_id: int
    tag: Hashable | None


@dataclass(frozen=True, slots=True)
class WriteDone:
    """A signaled RDMA WRITE completed: ``length`` bytes are in the peer's memory."""

    device: str
    qpn: int
    wr_id: int
    tag: Hashable | None
    length: int


@dataclass(frozen=True, slots=True)
class MessageReceived:
    """A SEND from the peer arrived: 44 bytes (v1), up to 8 KiB (v2 LLC). The receive buffer is
    already posted again."""

    device: str
    qpn: int
    data: bytes


@dataclass(frozen=True, slots=True)
class CompletionFailed:
    """A send or write work request failed or was flushed (``status_name`` e.g. WR_FLUSH_ERR);
    its ``tag`` lets the link-group layer resend on another link (failover)."""

    device: str
    qpn: int
    wr_id: int
    tag: Hashable | None
    kind: WrKind
    status: int
    status_name: str
    vendor_err: int = 0


@dataclass(frozen=True, slots=True)
class LinkError:
    """The link's QP left service (error completion or a QP async event). Reported once per
    link; the link-group layer decides what follows (failover, DELETE LINK, abort)."""

    device: str
    qpn: int
    reason: str  # a WC status name (REM_ACCESS_ERR …) or an async event (QP_FATAL …)


@dataclass(frozen=True, slots=True)
class PortStateChanged:
    """The device reported a port event; ``active`` is the port state after it."""

    device: str
    port: int
    active: bool
    event: str  # PORT_ACTIVE, PORT_ERR, GID_CHANGE, DEVICE_FATAL …


VerbsEvent = (
    SendDone | WriteDone | MessageReceived | CompletionFailed | LinkError | PortStateChanged
)
