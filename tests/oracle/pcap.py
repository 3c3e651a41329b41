"""A tiny classic-pcap writer for synthetic RoCEv2 frames carrying SMC-R LLC/CDC messages.

Why synthetic frames: LLC and CDC messages travel as RDMA SENDs on an RC queue pair, which a test
host without RoCE hardware cannot put on a wire that dumpcap sees. Wireshark decodes them from any
pcap that looks like RoCEv2 (Ethernet / IPv4 / UDP dport 4791 / InfiniBand BTH), so we write such a
pcap ourselves and let tshark's ``smcr_infiniband`` heuristic judge the 44-byte payloads.

Only the headers Wireshark needs are filled in; the 4-byte ICRC trailer is a zero placeholder
(tshark does not verify it).
"""

from __future__ import annotations

import ipaddress
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "BTH_OPCODE_RC_SEND_ONLY",
    "LINKTYPE_ETHERNET",
    "ROCEV2_UDP_PORT",
    "RoceEndpoint",
    "ipv4_checksum",
    "roce_v2_frame",
    "write_pcap",
]

LINKTYPE_ETHERNET = 1
ROCEV2_UDP_PORT = 4791
BTH_OPCODE_RC_SEND_ONLY = 0x04
_ETHERTYPE_IPV4 = 0x0800
_IPPROTO_UDP = 17
_DEFAULT_PKEY = 0xFFFF


@dataclass(frozen=True)
class RoceEndpoint:
    """One end of a RoCEv2 path: its Ethernet MAC and IPv4 address (documentation ranges only)."""

    mac: bytes
    ip: str


def ipv4_checksum(header: bytes) -> int:
    """RFC 791 one's-complement sum of 16-bit words (checksum field must be zero on input)."""
    if len(header) % 2:
        header += b"\0"
    total = sum(struct.unpack(f"!{len(header) // 2}H", header))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


def _bth(opcode: int, dest_qp: int, psn: int, pad: int) -> bytes:
    """InfiniBand Base Transport Header, 12 bytes (IBA vol. 1, 9.2)."""
    se_m_pad_tver = (pad & 0x3) << 4  # SE=0, MigReq=0, PadCnt, TVer=0
    return struct.pack(
        "!BBHII",
        opcode,
        se_m_pad_tver,
        _DEFAULT_PKEY,
        dest_qp & 0xFFFFFF,  # byte 4 reserved (0) + 24-bit destination QP
        psn & 0xFFFFFF,  # AckReq=0 + 7 reserved bits + 24-bit PSN
    )


def roce_v2_frame(
    payload: bytes,
    *,
    src: RoceEndpoint,
    dst: RoceEndpoint,
    dest_qp: int,
    psn: int,
    udp_sport: int = 49152,
    ip_id: int = 0,
    opcode: int = BTH_OPCODE_RC_SEND_ONLY,
) -> bytes:
    """Wrap ``payload`` as an RC SEND in Ethernet/IPv4/UDP(4791)/BTH plus a zero ICRC."""
    pad = (-len(payload)) % 4
    ib = _bth(opcode, dest_qp, psn, pad) + payload + b"\0" * pad + b"\0\0\0\0"
    udp_len = 8 + len(ib)
    udp = struct.pack("!HHHH", udp_sport, ROCEV2_UDP_PORT, udp_len, 0) + ib  # 0 = no UDP csum
    total_len = 20 + len(udp)
    ip_hdr = struct.pack(
        "!BBHHHBBH4s4s",
        0x45,
        0,
        total_len,
        ip_id & 0xFFFF,
        0x4000,  # DF, as RoCEv2 senders set it
        64,
        _IPPROTO_UDP,
        0,
        ipaddress.IPv4Address(src.ip).packed,
        ipaddress.IPv4Address(dst.ip).packed,
    )
    ip_hdr = ip_hdr[:10] + struct.pack("!H", ipv4_checksum(ip_hdr)) + ip_hdr[12:]
    eth = dst.mac + src.mac + struct.pack("!H", _ETHERTYPE_IPV4)
    return eth + ip_hdr + udp


def write_pcap(path: Path, frames: Iterable[bytes], *, linktype: int = LINKTYPE_ETHERNET) -> int:
    """Write ``frames`` to a classic microsecond pcap file, one second apart; return the count."""
    count = 0
    with path.open("wb") as f:
        f.write(struct.pack("<IHHiIII", 0xA1B2C3D4, 2, 4, 0, 0, 65535, linktype))
        for frame in frames:
            f.write(struct.pack("<IIII", 1_700_000_000 + count, 0, len(frame), len(frame)))
            f.write(frame)
            count += 1
    return count
