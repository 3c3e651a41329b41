"""Decode a batch of 44-byte SMC-R LLC/CDC messages with tshark, one RoCEv2 frame each."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tests.oracle.pcap import RoceEndpoint, roce_v2_frame, write_pcap
from tests.oracle.tshark import Packet, run_pdml

__all__ = ["CLIENT", "SERVER", "RoceCase", "decode_roce"]

# Documentation addresses only (RFC 5737); locally administered MACs.
CLIENT = RoceEndpoint(mac=bytes.fromhex("020000c00201"), ip="192.0.2.1")
SERVER = RoceEndpoint(mac=bytes.fromhex("0200c6336402"), ip="198.51.100.2")


@dataclass(frozen=True)
class RoceCase:
    """One message to judge: a name for reports, the object we encoded, its wire bytes."""

    name: str
    msg: object
    wire: bytes


def decode_roce(path: Path, cases: Sequence[RoceCase]) -> dict[str, Packet]:
    """Write every case as its own RC SEND frame and return tshark's view of each, by name."""
    frames = [
        roce_v2_frame(
            case.wire,
            src=CLIENT if i % 2 == 0 else SERVER,
            dst=SERVER if i % 2 == 0 else CLIENT,
            dest_qp=0x000123 if i % 2 == 0 else 0x000456,
            psn=i,
            udp_sport=49152 + i,
            ip_id=i,
        )
        for i, case in enumerate(cases)
    ]
    names = [c.name for c in cases]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate case names: {names}")
    write_pcap(path, frames)
    packets = run_pdml(path)
    if len(packets) != len(cases):
        raise AssertionError(f"tshark read {len(packets)} frames from {path}, wrote {len(cases)}")
    return dict(zip(names, packets, strict=True))
