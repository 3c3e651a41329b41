"""Wireshark judges the LLC and CDC messages smcd really put on the wire: tcpdump captures
RoCEv2 (UDP 4791) on host B's virtio NIC while two smcd SMC-R services (as in
``test_smcr_service.py``) run one short first-contact connection — CONFIRM LINK both ways, a
little data each way, shutdown and close — and tshark (``smcr_infiniband`` heuristic, via
``tests.oracle.tshark``) decodes the capture.

What tshark shows is compared with what we meant to send: the connection tokens and link values
from the registries, the transfer sizes, and the close sequence; field by field with our own
decoding of the same captured bytes.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import struct
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from smc_handoff.channel import Channel
from smcd_daemon.core import registry as reg
from smcd_daemon.wire.cdc import CDC_MSG_TYPE, CdcMessage, ConnStateFlag
from smcd_daemon.wire.llc import ConfirmLink, ConfirmLinkFlag
from tests.oracle.roce import RoceCase, decode_roce
from tests.oracle.tshark import Packet, SmcPdu, run_pdml
from tests.vm.guest import kernel_smc as ks
from tests.vm.guest.roce_capture import ROCEV2_PORT, read_pcap
from tests.vm.guest.test_smcr_service import (  # the same two services, the same helpers
    handoff,
    recv_exactly,
    released,
    run_async,
    sendall,
    two_hosts,
    wait_for,
)
from tests.vm.topology import ports_of

A_TO_B = (1000, 3000)  # two separate writes, each received before the next
B_TO_A = 500
_SEND_ONLY = (4, 5)  # RC SEND ONLY [with immediate]: every 44-byte LLC/CDC message


@dataclass(frozen=True)
class WireSend:
    frame: int  # 1-based, as tshark numbers frames
    src: str
    dst: str
    payload: bytes


def roce_sends(path: Path) -> list[WireSend]:
    """Every single-packet RC SEND of the capture with its frame number (retransmissions —
    the same source, QP and PSN again — are left out)."""
    out: list[WireSend] = []
    seen: set[tuple[str, int, int]] = set()
    for number, frame in enumerate(read_pcap(path), start=1):
        if len(frame) < 34 or frame[12:14] != b"\x08\x00":
            continue
        ip = frame[14:]
        ihl = (ip[0] & 0x0F) * 4
        (total,) = struct.unpack_from("!H", ip, 2)
        ip = ip[:total]
        udp = ip[ihl:]
        if ip[9] != 17 or struct.unpack_from("!H", udp, 2)[0] != ROCEV2_PORT:
            continue
        bth = udp[8:]
        if bth[0] not in _SEND_ONLY:
            continue
        src = socket.inet_ntoa(ip[12:16])
        key = (src, int.from_bytes(bth[5:8], "big"), int.from_bytes(bth[9:12], "big"))
        if key in seen:
            continue
        seen.add(key)
        pad = (bth[1] >> 4) & 0x3
        hdr = 12 + (4 if bth[0] == 5 else 0)
        payload = bytes(bth[hdr : len(bth) - 4 - pad])
        out.append(WireSend(number, src, socket.inet_ntoa(ip[16:20]), payload))
    return out


def _only_pdu(packet: Packet) -> SmcPdu:
    assert not packet.malformed, f"frame {packet.number}: malformed: {packet.experts}"
    assert [e for e in packet.experts if e.is_problem] == [], packet.experts
    assert len(packet.pdus) == 1, f"frame {packet.number}: {packet.protocols}"
    return packet.pdus[0]


def _check_cdc(pdu: SmcPdu, m: CdcMessage) -> None:
    """tshark's fields at the kernel's offsets equal our decoding of the same bytes (the
    consumer cursor reuses the producer's field names in Wireshark 4.0: told apart by offset)."""
    assert pdu.num("smc.llc_msg", 0) == CDC_MSG_TYPE
    assert pdu.num("smc.length", 1) == 44
    assert pdu.num("smc.rmbe.ctrl.seqno", 2) == m.seqno
    assert pdu.num("smc.rmbe.ctrl.alert.token", 4) == m.token
    assert pdu.num("smc.rmbe.ctrl.prod.wrap.seq", 10) == m.prod.wrap
    assert pdu.num("smc.rmbe.ctrl.peer.prod.curs", 12) == m.prod.count
    assert pdu.num("smc.rmbe.ctrl.prod.wrap.seq", 18) == m.cons.wrap
    assert pdu.num("smc.rmbe.ctrl.peer.prod.curs", 20) == m.cons.count
    assert pdu.num("smc.rmbe.ctrl.conn.rw.status.flags", 24) == int(m.prod_flags)
    assert pdu.num("smc.rmbe.ctrl.peer.conn.state.flags", 25) == int(m.conn_state_flags)
    assert pdu.num("smc.rmbe.ctrl.peer.sending.done", 25) == int(
        ConnStateFlag.PEER_DONE_WRITING in m.conn_state_flags
    )
    assert pdu.num("smc.rmbe.ctrl.peer.closed.conn", 25) == int(
        ConnStateFlag.PEER_CONN_CLOSED in m.conn_state_flags
    )
    assert pdu.num("smc.rmbe.ctrl.peer.abnormal.close", 25) == 0


def _check_confirm_link(pdu: SmcPdu, m: ConfirmLink, link: reg.Link, mac: str) -> None:
    assert pdu.num("smc.llc_msg", 0) == 0x01 | (0x20 if m.v2 else 0)
    assert pdu.num("smc.confirm.link.response", 3) == int(ConfirmLinkFlag.RESPONSE in m.flags)
    assert pdu.mac("smc.confirm.link.sender.mac", 4) == bytes.fromhex(mac.replace(":", ""))
    assert pdu.ip("smc.sender.gid", 10) == ipaddress.IPv6Address(link.gid)
    assert pdu.num("smc.confirm.link.sender.qp.number", 26) == link.qpn
    assert pdu.num("smc.confirm.link.number", 29) == link.link_id
    # the registry does not keep link_uid (Link.link_uid stays empty): compare with our bytes
    assert pdu.num("smc.confirm.link.sender.link.userid", 30) == int.from_bytes(m.link_uid, "big")
    assert pdu.num("smc.confirm.link.max.links", 34) == m.max_links


@dataclass
class Seen:
    tokens: dict[str, int]  # host address -> its connection's local alert token
    links: dict[str, reg.Link]
    lgr_version: int


@pytest.mark.timeout(420)
def test_tshark_decodes_our_llc_and_cdc_on_the_wire(scratch: Path) -> None:
    """One first-contact connection on host B's NIC: tshark decodes every CDC (no malformed
    frame), with the receiver's token, consecutive seqnos, cursors reaching the bytes sent and
    the shutdown/close flags; and our CONFIRM LINK pair with the links' real values."""
    pcap = scratch / "smcr.pcap"
    seen: list[Seen] = []

    async def body() -> None:
        async with two_hosts() as h:
            with ks.capture(h.pb.ifname, ["udp", "port", str(ROCEV2_PORT)], pcap):
                ra, rb, cli, srv = await handoff(h)
                assert ra.first_contact and rb.first_contact
                ((conn_a,), (conn_b,)) = h.a.registry.connections(), h.b.registry.connections()
                ((link_a,), (link_b,)) = h.a.registry.links(), h.b.registry.links()
                (lgr_a,) = h.a.registry.link_groups()
                seen.append(
                    Seen(
                        {h.pa.address: conn_a.token, h.pb.address: conn_b.token},
                        {h.pa.address: link_a, h.pb.address: link_b},
                        lgr_a.smc_version,
                    )
                )
                ca, cb = Channel.from_fds(ra.fds), Channel.from_fds(rb.fds)
                deadline = time.monotonic() + 200
                for n in A_TO_B:
                    await asyncio.to_thread(sendall, ca, memoryview(b"a" * n), deadline)
                    got = bytearray()
                    await asyncio.to_thread(recv_exactly, cb, n, deadline, got.extend)
                    assert bytes(got) == b"a" * n
                await asyncio.to_thread(sendall, cb, memoryview(b"b" * B_TO_A), deadline)
                got = bytearray()
                await asyncio.to_thread(recv_exactly, ca, B_TO_A, deadline, got.extend)
                assert bytes(got) == b"b" * B_TO_A
                ca.shutdown_write()
                n = await asyncio.to_thread(recv_exactly, cb, 1, deadline, got.extend)
                assert n == 0 and cb.eof
                ca.close()
                cb.close()
                await wait_for(released(h), "both connections released")
                cli.close()
                srv.close()

    run_async(body)
    (s,) = seen
    pa, pb = ports_of("a")[0], ports_of("b")[0]
    a, b = pa.address, pb.address
    macs = {a: pa.mac, b: pb.mac}

    sends = roce_sends(pcap)
    packets = run_pdml(pcap)
    assert len(packets) >= max((w.frame for w in sends), default=0)
    traffic = ks.PcapTraffic.from_pcap(pcap)
    # the data went by RDMA WRITE: exactly the bytes the applications wrote, each way
    assert traffic.write_bytes.get((a, b)) == sum(A_TO_B), traffic.write_bytes
    assert traffic.write_bytes.get((b, a)) == B_TO_A, traffic.write_bytes

    # ---- CDC: v1 format (44 bytes, type 0xFE) in SMC-Rv1 and v2 link groups alike
    cdc: dict[str, list[CdcMessage]] = {a: [], b: []}
    for w in sends:
        if w.payload[:1] != bytes([CDC_MSG_TYPE]):
            continue
        assert len(w.payload) == 44, w
        msg = CdcMessage.decode(w.payload)
        _check_cdc(_only_pdu(packets[w.frame - 1]), msg)
        cdc[w.src].append(msg)
    total = {a: sum(A_TO_B), b: B_TO_A}
    for src, dst in ((a, b), (b, a)):
        msgs = cdc[src]
        assert msgs, f"no CDC message from {src}"
        # the token is the receiver's alert token (it finds the connection with it)
        assert {m.token for m in msgs} == {s.tokens[dst]}, (src, msgs)
        seqs = [m.seqno for m in msgs]
        assert seqs == [(seqs[0] + i) & 0xFFFF for i in range(len(seqs))], seqs
        prods = [m.prod for m in msgs]
        assert all(p.wrap == 0 for p in prods), prods  # far below the 1 MiB RMB
        counts = [p.count for p in prods]
        assert counts == sorted(counts) and counts[-1] == total[src], (src, counts)
        conses = [m.cons.count for m in msgs]
        assert conses == sorted(conses) and conses[-1] == total[dst], (src, conses)
        assert not any(m.conn_state_flags & ConnStateFlag.PEER_CONN_ABORT for m in msgs)
        # an orderly close: the last CDC, and only it, says "closed"
        closed = [ConnStateFlag.PEER_CONN_CLOSED in m.conn_state_flags for m in msgs]
        assert closed == [False] * (len(msgs) - 1) + [True], (src, msgs)
    # A shut down writing after its 4000 bytes: from then on every A→B CDC says so
    done = [ConnStateFlag.PEER_DONE_WRITING in m.conn_state_flags for m in cdc[a]]
    first = done.index(True)
    assert all(done[first:]), cdc[a]
    assert cdc[a][first].prod.count == sum(A_TO_B)

    # ---- LLC CONFIRM LINK: server (B) request, client (A) response
    confirms = [w for w in sends if w.payload[:1] in (b"\x01", b"\x21")]
    assert [(w.src, w.dst) for w in confirms] == [(b, a), (a, b)], confirms
    v2 = confirms[0].payload[0] == 0x21
    assert v2 == (s.lgr_version >= 2), (s.lgr_version, confirms)
    if not v2:
        for w in confirms:
            m = ConfirmLink.decode(w.payload)
            _check_confirm_link(_only_pdu(packets[w.frame - 1]), m, s.links[w.src], macs[w.src])
        return
    # SMC-Rv2 (rxe has RoCEv2 GIDs only): our length_v2 is little-endian like x86 Linux's, and
    # Wireshark 4.0's heuristic reads it big-endian, so tshark does not claim these frames
    # (tests/oracle shows the same with synthetic frames). Judge the very bytes we sent with
    # only length_v2 turned big-endian instead.
    cases = []
    for i, w in enumerate(confirms):
        assert w.payload[1:3] == struct.pack("<H", len(w.payload)), w.payload[:4].hex()
        assert packets[w.frame - 1].pdus == [] or packets[w.frame - 1].pdus[0].num(
            "smc.length", 1
        ) == len(w.payload)
        swapped = w.payload[:1] + struct.pack(">H", len(w.payload)) + w.payload[3:]
        cases.append(RoceCase(f"confirm-{i}", ConfirmLink.decode(w.payload), swapped))
    judged = decode_roce(scratch / "confirm_link_be.pcap", cases)
    for case, w in zip(cases, confirms, strict=True):
        assert isinstance(case.msg, ConfirmLink)
        assert case.msg.is_response == (w.src == a)
        pdu = _only_pdu(judged[case.name])
        assert pdu.size == len(w.payload)
        _check_confirm_link(pdu, case.msg, s.links[w.src], macs[w.src])
