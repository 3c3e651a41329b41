"""Send a batch of CLC messages over real loopback TCP under dumpcap and decode them with tshark."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tests.oracle.capture import loopback_capture, make_listener_pair, send_streams
from tests.oracle.tshark import Packet, SmcPdu, run_pdml

__all__ = ["ClcCase", "ClcDecode", "decode_clc_streams"]


@dataclass(frozen=True)
class ClcCase:
    """One message to judge: a name for reports, the object we encoded, its wire bytes."""

    name: str
    msg: object
    wire: bytes


@dataclass
class ClcDecode:
    """tshark's view of each case (by name), plus every frame of the capture."""

    pdus: dict[str, SmcPdu]
    frames_of: dict[str, list[Packet]]
    packets: list[Packet]
    streams: list[list[str]]
    ipv6: set[str]
    """Names of the cases sent over ::1 (Wireshark decodes the proposal's RoCEv2 GID by the
    address family of the TCP connection)."""


def decode_clc_streams(
    path: Path, streams: Sequence[Sequence[ClcCase]], ipv6_streams: Sequence[int] = ()
) -> ClcDecode:
    """One TCP connection per stream (all messages client to server), one capture, one tshark.

    Streams whose index is in ``ipv6_streams`` go over ::1, the others over 127.0.0.1.

    The SMC PDUs tshark finds in a connection's client-to-server frames are matched to that
    stream's cases in order; a count mismatch fails loudly (a message tshark did not see as SMC,
    or split/merged wrongly, is itself a finding).
    """
    names = [c.name for s in streams for c in s]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate case names: {names}")
    v4, v6 = make_listener_pair()
    try:
        with loopback_capture(path, v4):
            ports = send_streams(
                v4,
                [[c.wire for c in s] for s in streams],
                [v6 if i in ipv6_streams else v4 for i in range(len(streams))],
            )
    finally:
        v4.close()
        v6.close()
    packets = run_pdml(path)
    pdus: dict[str, SmcPdu] = {}
    frames_of: dict[str, list[Packet]] = {}
    for i, (port, stream) in enumerate(zip(ports, streams, strict=True)):
        # IPv4 and IPv6 clients may get the same port number: match the family too.
        family = "ipv6" if i in ipv6_streams else "ip"
        mine = [p for p in packets if p.tcp_srcport == port and family in p.protocols and p.pdus]
        found = [(p, pdu) for p in mine for pdu in p.pdus]
        if len(found) != len(stream):
            raise AssertionError(
                f"client port {port}: tshark found {len(found)} SMC PDUs, sent {len(stream)} "
                f"({[c.name for c in stream]})"
            )
        for case, (packet, pdu) in zip(stream, found, strict=True):
            pdus[case.name] = pdu
            frames_of.setdefault(case.name, []).append(packet)
    ipv6 = {c.name for i in ipv6_streams for c in streams[i]}
    return ClcDecode(pdus, frames_of, packets, [[c.name for c in s] for s in streams], ipv6)
