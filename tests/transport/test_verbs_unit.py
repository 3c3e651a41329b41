"""The verbs transport on a machine without RDMA: it imports, says clearly why it cannot open a
device, and its pure rules (MTU, GRH, QP attributes, ring-write planning, status names) hold.

pyverbs itself imports here (Debian python3-pyverbs, no device needed), so the QP attribute
objects built for ``ibv_modify_qp`` are checked as the real pyverbs types.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

import pytest

from smcd_daemon.errors import SmcError
from smcd_daemon.transport import verbs, verbs_lib, verbs_model
from smcd_daemon.transport.verbs_model import (
    IPV6_DEFAULT_HOPLIMIT,
    SMC_IB_MAX_SEND_SGE,
    SMC_WR_BUF_CNT,
    SMC_WR_BUF_SIZE,
    SMC_WR_RX_CNT,
    SMC_WR_TX_SIZE,
    SMC_WR_TX_WR_MAX,
    LinkParams,
    Sge,
    WritePiece,
    build_grh,
    init_attrs,
    ipv4_mapped_gid,
    mac_from_gid,
    mtu_bytes,
    mtu_enum,
    negotiated_mtu,
    plan_ring_write,
    random_psn,
    rtr_attrs,
    rts_attrs,
    wc_status_name,
)

PEER_GID = ipv4_mapped_gid("192.0.2.2")
PEER = LinkParams(gid=PEER_GID, qpn=0x11, psn=0xABCDE, mtu=3, mac=bytes.fromhex("025c00000002"))


def _no_rdma_here() -> bool:
    return not verbs.SYSFS_INFINIBAND.exists()


# ---------------------------------------------------------------------------- import / errors


def test_module_imports_without_loading_pyverbs() -> None:
    """Importing the transport must not import pyverbs (daemons on machines without RDMA)."""
    code = (
        "import sys; import smcd_daemon.transport.verbs as v; "
        "print(any(m.startswith('pyverbs') for m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == "False"


def test_missing_pyverbs_is_verbs_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(verbs_lib, "_pv", None)
    monkeypatch.setitem(sys.modules, "pyverbs", None)  # import of pyverbs now fails
    monkeypatch.setitem(sys.modules, "pyverbs.device", None)
    with pytest.raises(verbs.VerbsUnavailable, match="python3-pyverbs"):
        verbs.load_pyverbs()
    monkeypatch.undo()
    importlib.import_module("pyverbs.device")  # and it comes back afterwards


def test_error_classes_are_smc_errors() -> None:
    assert issubclass(verbs.VerbsUnavailable, SmcError)
    assert issubclass(verbs.VerbsError, SmcError)
    assert issubclass(verbs.SendSlotsExhausted, verbs.VerbsError)


def test_no_devices_is_an_empty_list_not_an_error() -> None:
    if not _no_rdma_here():
        pytest.fail("this host has RDMA devices; the test expects the CI hosts' kernel without")
    assert verbs.list_devices() == []


def test_opening_a_nonexistent_device_says_why() -> None:
    with pytest.raises(verbs.VerbsUnavailable) as info:
        verbs.VerbsPort("rxe_nonexistent")
    text = str(info.value)
    assert "'rxe_nonexistent' not found" in text
    if _no_rdma_here():
        assert "no RDMA devices" in text and "rdma link add" in text


# ---------------------------------------------------------------------------- sizes


def test_kernel_sizing() -> None:
    assert (SMC_WR_BUF_CNT, SMC_WR_BUF_SIZE, SMC_WR_TX_SIZE) == (16, 48, 44)
    assert SMC_WR_RX_CNT == SMC_WR_TX_WR_MAX == 48
    assert SMC_IB_MAX_SEND_SGE == 2
    assert verbs_model.SMC_WR_BUF_V2_SIZE == 8192


# ---------------------------------------------------------------------------- MTU / PSN / GID


@pytest.mark.parametrize(("nbytes", "enum"), [(256, 1), (512, 2), (1024, 3), (2048, 4), (4096, 5)])
def test_mtu_mapping(nbytes: int, enum: int) -> None:
    assert mtu_enum(nbytes) == enum
    assert mtu_bytes(enum) == nbytes


def test_mtu_mapping_matches_pyverbs_enum() -> None:
    e = verbs.load_pyverbs().e
    for nbytes in (256, 512, 1024, 2048, 4096):
        assert mtu_enum(nbytes) == int(getattr(e, f"IBV_MTU_{nbytes}"))


@pytest.mark.parametrize("bad", [0, 1000, 1500, 8192])
def test_mtu_rejects_non_ib_sizes(bad: int) -> None:
    with pytest.raises(ValueError, match="not an IB path MTU"):
        mtu_enum(bad)


def test_negotiated_mtu_is_the_smaller() -> None:
    assert negotiated_mtu(5, 3) == 3
    assert negotiated_mtu(3, 4) == 3
    with pytest.raises(ValueError):
        negotiated_mtu(6, 3)


def test_random_psn_is_24_bits() -> None:
    psns = {random_psn() for _ in range(200)}
    assert all(0 <= p < 1 << 24 for p in psns)
    assert len(psns) > 150


def test_ipv4_mapped_gid() -> None:
    assert ipv4_mapped_gid("192.0.2.1") == bytes(10) + b"\xff\xff" + bytes([192, 0, 2, 1])
    with pytest.raises(ValueError):
        ipv4_mapped_gid("192.0.2")


def test_mac_from_link_local_gid() -> None:
    gid = bytes.fromhex("fe800000000000000250 56ff fe12 3456".replace(" ", ""))
    # EUI-64 0250:56ff:fe12:3456 → MAC 00:50:56:12:34:56 (U/L bit cleared as the kernel does)
    assert mac_from_gid(gid) == bytes.fromhex("005056123456")


def test_link_params_validate() -> None:
    with pytest.raises(ValueError, match="qpn"):
        LinkParams(gid=PEER_GID, qpn=0, psn=1, mtu=3)
    with pytest.raises(ValueError, match="psn"):
        LinkParams(gid=PEER_GID, qpn=5, psn=1 << 24, mtu=3)
    with pytest.raises(ValueError, match="ibv_mtu"):
        LinkParams(gid=PEER_GID, qpn=5, psn=1, mtu=7)
    with pytest.raises(ValueError, match="gid"):
        LinkParams(gid=b"\0" * 4, qpn=5, psn=1, mtu=3)


# ---------------------------------------------------------------------------- GRH / QP attrs


def test_grh_direct_and_via_gateway() -> None:
    direct = build_grh(PEER_GID, 1)
    assert (direct.dgid, direct.sgid_index, direct.hop_limit) == (PEER_GID, 1, 1)
    routed = build_grh(PEER_GID, 3, uses_gateway=True)
    assert routed.hop_limit == IPV6_DEFAULT_HOPLIMIT == 64
    with pytest.raises(ValueError):
        build_grh(PEER_GID[:8], 1)


def test_init_attrs_as_smc_ib_modify_qp_init() -> None:
    spec = init_attrs(2)
    assert spec.state == "INIT"
    assert spec.attrs == {"pkey_index": 0, "qp_access_flags": 3}  # LOCAL_WRITE | REMOTE_WRITE
    assert set(spec.mask_names()) == {"STATE", "PKEY_INDEX", "ACCESS_FLAGS", "PORT"}


def test_rtr_attrs_as_smc_ib_modify_qp_rtr() -> None:
    spec = rtr_attrs(PEER, local_mtu=5, sgid_index=1, port_num=1)
    assert spec.attrs == {
        "path_mtu": 3,  # min(ours 4096, peer 1024)
        "dest_qp_num": 0x11,
        "rq_psn": 0xABCDE,
        "max_dest_rd_atomic": 1,
        "min_rnr_timer": 5,
    }
    assert spec.grh == build_grh(PEER_GID, 1)
    assert set(spec.mask_names()) == {
        "STATE", "AV", "PATH_MTU", "DEST_QPN", "RQ_PSN", "MAX_DEST_RD_ATOMIC", "MIN_RNR_TIMER",
    }  # fmt: skip


def test_rts_attrs_as_smc_ib_modify_qp_rts() -> None:
    spec = rts_attrs(0x123456)
    assert spec.attrs == {
        "timeout": 15, "retry_cnt": 7, "rnr_retry": 7, "sq_psn": 0x123456, "max_rd_atomic": 1,
    }  # fmt: skip
    assert set(spec.mask_names()) == {
        "STATE", "TIMEOUT", "RETRY_CNT", "RNR_RETRY", "SQ_PSN", "MAX_QP_RD_ATOMIC",
    }  # fmt: skip
    with pytest.raises(ValueError):
        rts_attrs(1 << 24)


def test_build_qp_attr_gives_pyverbs_objects_and_masks() -> None:
    e = verbs.load_pyverbs().e
    attr, mask = verbs.build_qp_attr(rtr_attrs(PEER, local_mtu=3, sgid_index=1, port_num=1))
    assert attr.qp_state == e.IBV_QPS_RTR
    assert (attr.path_mtu, attr.dest_qp_num, attr.rq_psn) == (e.IBV_MTU_1024, 0x11, 0xABCDE)
    assert attr.ah_attr.is_global == 1
    assert attr.ah_attr.dgid == "0000:0000:0000:0000:0000:ffff:c000:0202"
    assert (attr.ah_attr.sgid_index, attr.ah_attr.hop_limit, attr.ah_attr.port_num) == (1, 1, 1)
    want = (
        e.IBV_QP_STATE | e.IBV_QP_AV | e.IBV_QP_PATH_MTU | e.IBV_QP_DEST_QPN | e.IBV_QP_RQ_PSN
        | e.IBV_QP_MAX_DEST_RD_ATOMIC | e.IBV_QP_MIN_RNR_TIMER
    )  # fmt: skip
    assert mask == int(want)

    attr, mask = verbs.build_qp_attr(init_attrs(1))
    assert attr.qp_access_flags == int(e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE)
    assert attr.port_num == 1
    assert mask == int(e.IBV_QP_STATE | e.IBV_QP_PKEY_INDEX | e.IBV_QP_ACCESS_FLAGS | e.IBV_QP_PORT)

    attr, mask = verbs.build_qp_attr(rts_attrs(42))
    assert (attr.qp_state, attr.sq_psn, attr.timeout) == (e.IBV_QPS_RTS, 42, 15)
    assert mask & int(e.IBV_QP_SQ_PSN) and not mask & int(e.IBV_QP_AV)


# ---------------------------------------------------------------------------- ring writes


def test_plan_without_wrap_is_one_write() -> None:
    plan = plan_ring_write(100, src_offset=10, src_size=1000, dst_offset=20, dst_size=1000)
    assert plan == (WritePiece(20, (Sge(10, 100),)),)


def test_plan_splits_at_the_peer_ring_wrap() -> None:
    plan = plan_ring_write(300, src_offset=0, src_size=4096, dst_offset=900, dst_size=1000)
    assert plan == (WritePiece(900, (Sge(0, 100),)), WritePiece(0, (Sge(100, 200),)))


def test_plan_gathers_across_the_local_ring_wrap() -> None:
    plan = plan_ring_write(300, src_offset=950, src_size=1000, dst_offset=0, dst_size=4096)
    assert plan == (WritePiece(0, (Sge(950, 50), Sge(0, 250))),)


def test_plan_with_both_rings_wrapping() -> None:
    plan = plan_ring_write(500, src_offset=800, src_size=1000, dst_offset=700, dst_size=1000)
    assert plan == (
        WritePiece(700, (Sge(800, 200), Sge(0, 100))),
        WritePiece(0, (Sge(100, 200),)),
    )


def test_plan_full_ring() -> None:
    plan = plan_ring_write(1000, src_offset=0, src_size=1000, dst_offset=999, dst_size=1000)
    assert [p.length for p in plan] == [1, 999]


@pytest.mark.parametrize(
    ("length", "src_offset", "src_size", "dst_offset", "dst_size"),
    [(0, 0, 10, 0, 10), (11, 0, 10, 0, 20), (5, 10, 10, 0, 10), (5, 0, 10, -1, 10)],
)
def test_plan_rejects_impossible_writes(
    length: int, src_offset: int, src_size: int, dst_offset: int, dst_size: int
) -> None:
    with pytest.raises(ValueError):
        plan_ring_write(
            length,
            src_offset=src_offset,
            src_size=src_size,
            dst_offset=dst_offset,
            dst_size=dst_size,
        )


def test_plan_exhaustively_covers_every_byte_once() -> None:
    """Every combination on small rings: the pieces are contiguous in both rings, at most two
    writes of at most two gather entries, and together move exactly ``length`` bytes."""
    for src_size in (1, 3, 7):
        for dst_size in (1, 4, 7):
            for length in range(1, min(src_size, dst_size) + 1):
                for so in range(src_size):
                    for do in range(dst_size):
                        plan = plan_ring_write(
                            length,
                            src_offset=so,
                            src_size=src_size,
                            dst_offset=do,
                            dst_size=dst_size,
                        )
                        src_bytes = [
                            (s.offset + k) % src_size
                            for p in plan
                            for s in p.sges
                            for k in range(s.length)
                        ]
                        dst_bytes = [p.remote_offset + k for p in plan for k in range(p.length)]
                        assert src_bytes == [(so + k) % src_size for k in range(length)]
                        assert dst_bytes == [(do + k) % dst_size for k in range(length)]
                        assert all(b < dst_size for b in dst_bytes)
                        assert len(plan) <= 2
                        assert all(1 <= len(p.sges) <= SMC_IB_MAX_SEND_SGE for p in plan)


# ---------------------------------------------------------------------------- status names


def test_wc_status_names_match_pyverbs() -> None:
    e = verbs.load_pyverbs().e
    for member in e.ibv_wc_status:
        assert wc_status_name(int(member)) == member.name.removeprefix("IBV_WC_")
    assert wc_status_name(999) == "STATUS_999"


def test_fd_listing_leaves_out_its_own_directory_fd() -> None:
    """The channel's fd is found as "new since before"; the descriptor ``listdir`` used must not
    count as open before, or the next fd opened (which reuses its number) is never "new"."""
    before = verbs.open_fds()
    r, w = os.pipe()
    try:
        after = verbs.fd_targets()
        assert r not in before and w not in before
        assert after[r].startswith("pipe:") and after[w] == after[r]
    finally:
        os.close(r)
        os.close(w)
