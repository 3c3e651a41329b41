"""A pyverbs RC QP pair, one QP on each host's rxe device, over each virtio wire: connected to
RTS, a verified 64 KiB RDMA WRITE, a SEND/RECV exchange both ways, and the RoCEv2 packets of the
write seen on the receiving NIC (so the traffic really crossed the wire, not the loopback)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import pyverbs.enums as e  # type: ignore[import-untyped]

from tests.vm.guest.roce_capture import RC_ACK, RC_RDMA_WRITE, capture_roce
from tests.vm.guest.verbs_pair import RcEnd, connected_pair
from tests.vm.topology import Port, ports_of

SIZE = 64 * 1024
WIRES = [0, 1]


@pytest.fixture(params=WIRES, ids=lambda w: f"wire{w}")
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[RcEnd, RcEnd]]:
    a: Port = ports_of("a")[request.param]
    b: Port = ports_of("b")[request.param]
    end_a, end_b = connected_pair(a, b, SIZE)
    yield end_a, end_b
    end_a.close()
    end_b.close()


def test_qps_reach_rts(pair: tuple[RcEnd, RcEnd]) -> None:
    a, b = pair
    assert a.qp_state() == e.IBV_QPS_RTS
    assert b.qp_state() == e.IBV_QPS_RTS
    assert a.port.rxe != b.port.rxe


def test_rdma_write_64k_verified(pair: tuple[RcEnd, RcEnd]) -> None:
    a, b = pair
    payload = os.urandom(SIZE)
    a.mr.write(payload, SIZE)
    b.mr.write(b"\0" * SIZE, SIZE)
    a.rdma_write(b, SIZE, wr_id=7)
    wc = a.poll()
    assert (wc.opcode, wc.wr_id) == (e.IBV_WC_RDMA_WRITE, 7)
    assert b.mr.read(SIZE, 0) == payload


def test_send_recv_both_ways(pair: tuple[RcEnd, RcEnd]) -> None:
    a, b = pair
    ping, pong = b"ping from A " * 50, b"pong from B " * 70
    a.mr.write(ping, len(ping))
    b.mr.write(pong, len(pong))
    # receive buffers in the upper half, so a message cannot be mistaken for its own source
    half = SIZE // 2
    b.post_recv(half, half, wr_id=21)
    a.post_recv(half, half, wr_id=11)
    a.send(0, len(ping), wr_id=12)
    assert a.poll().wr_id == 12
    got_b = b.poll()
    assert (got_b.opcode, got_b.wr_id, got_b.byte_len) == (e.IBV_WC_RECV, 21, len(ping))
    assert b.mr.read(len(ping), half) == ping
    b.send(0, len(pong), wr_id=22)
    assert b.poll().wr_id == 22
    got_a = a.poll()
    assert (got_a.opcode, got_a.wr_id, got_a.byte_len) == (e.IBV_WC_RECV, 11, len(pong))
    assert a.mr.read(len(pong), half) == pong


def _tx_packets(ifname: str) -> int:
    return int(Path(f"/sys/class/net/{ifname}/statistics/tx_packets").read_text())


def test_rdma_write_crosses_the_virtio_wire(pair: tuple[RcEnd, RcEnd], scratch: Path) -> None:
    a, b = pair
    payload = os.urandom(SIZE)
    a.mr.write(payload, SIZE)
    tx_before = _tx_packets(a.port.ifname)
    with capture_roce(b.port.ifname, scratch / "write.pcap") as cap:
        a.rdma_write(b, SIZE, wr_id=3)
        a.poll()
    assert b.mr.read(SIZE, 0) == payload
    assert cap.dropped == 0, f"tcpdump lost packets, the capture proves nothing: {cap.log}"
    pkts = cap.packets()
    writes = [p for p in pkts if p.opcode in RC_RDMA_WRITE and p.dest_qp == b.qp.qp_num]
    assert writes, f"no RDMA WRITE to QP {b.qp.qp_num} captured on {b.port.ifname}: {pkts[:5]}"
    assert {(p.src, p.dst) for p in writes} == {(a.port.address, b.port.address)}
    assert sum(p.payload_len for p in writes) == SIZE
    first = writes[0]
    assert first.reth == (b.mr.buf, b.mr.rkey, SIZE)
    assert first.psn == 0x1234  # A's initial send PSN
    acks = [p for p in pkts if p.opcode == RC_ACK and p.dest_qp == a.qp.qp_num]
    assert acks, "no RC ACK from B to A captured"
    # every write packet left through A's NIC: the kernel's loopback shortcut was not taken
    assert _tx_packets(a.port.ifname) - tx_before >= len(writes)
