"""Run tshark on a capture and hand back every SMC PDU it decoded, field by field.

We read tshark's PDML (``-T pdml``) rather than ``-T fields`` because PDML keeps each field's byte
position and size: Wireshark 4.0 reuses some field names for different bytes (the CDC consumer
cursor is shown as ``smc.rmbe.ctrl.prod.wrap.seq`` / ``peer.prod.curs``, an SMC-D Confirm's FCE
flags as ``smc.accept.fce.flags``), so a field is only identified by (name, offset in the message).
Offsets here are relative to the start of the SMC message, so they match PROTOCOL.md's tables.
"""

from __future__ import annotations

import ipaddress
import os
import re
import shutil
import subprocess
import tempfile
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

__all__ = [
    "INSTALL_HINT",
    "DField",
    "Expert",
    "Packet",
    "SmcPdu",
    "require_tool",
    "run_pdml",
]

INSTALL_HINT = (
    "tshark/dumpcap (Wireshark 4.0) are needed by the oracle tests: run `make deps` "
    "(tests/host/install-deps.sh) or `apt-get install tshark`"
)


def require_tool(name: str) -> str:
    """Path of ``name``; fail loudly (never skip) when Wireshark's tools are missing."""
    path = shutil.which(name)
    if path is None:
        raise RuntimeError(f"{name} not found on PATH. {INSTALL_HINT}")
    return path


@dataclass(frozen=True)
class DField:
    """One decoded field: PDML name, offset from the SMC message start, size, shown value, hex."""

    name: str
    off: int
    size: int
    show: str
    value: str

    def as_int(self) -> int:
        """The field's number; booleans and bit fields come out as ints too."""
        return int(self.show, 0)

    def raw(self) -> bytes:
        return bytes.fromhex(self.value)


@dataclass
class SmcPdu:
    """One ``smc`` protocol layer of one frame (a frame may carry several CLC messages)."""

    frame: int
    pos: int
    size: int
    fields: list[DField] = field(default_factory=list)
    experts: list[Expert] = field(default_factory=list)

    def all(self, name: str) -> list[DField]:
        return [f for f in self.fields if f.name == name]

    def get(self, name: str, off: int | None = None) -> DField:
        """The single field ``name`` (at message offset ``off`` when given); error if 0 or > 1."""
        hits = [f for f in self.all(name) if off is None or f.off == off]
        if len(hits) != 1:
            where = "" if off is None else f" at offset {off}"
            raise AssertionError(
                f"expected exactly one {name}{where} in frame {self.frame}, found {len(hits)}; "
                f"decoded: {self.describe()}"
            )
        return hits[0]

    def num(self, name: str, off: int | None = None) -> int:
        return self.get(name, off).as_int()

    def text(self, name: str, off: int | None = None) -> str:
        return self.get(name, off).show

    def ip(self, name: str, off: int | None = None) -> IPAddress:
        return ipaddress.ip_address(self.get(name, off).show)

    def mac(self, name: str, off: int | None = None) -> bytes:
        return bytes.fromhex(self.get(name, off).show.replace(":", ""))

    def names(self) -> set[str]:
        return {f.name for f in self.fields}

    def describe(self) -> str:
        return "; ".join(f"{f.name}@{f.off}={f.show!r}" for f in self.fields)


@dataclass
class Packet:
    """One frame: its SMC layers plus the markers of trouble tshark attached to it."""

    number: int
    pdus: list[SmcPdu]
    protocols: list[str]
    malformed: bool
    experts: list[Expert]
    tcp_stream: int | None
    tcp_srcport: int | None


def _walk_fields(elem: ET.Element, base: int, out: list[DField]) -> None:
    for child in elem:
        if child.tag != "field":
            continue
        name = child.get("name", "")
        if name:
            out.append(
                DField(
                    name=name,
                    off=int(child.get("pos", "0")) - base,
                    size=int(child.get("size", "0")),
                    show=child.get("show", ""),
                    value=child.get("value", ""),
                )
            )
        _walk_fields(child, base, out)


_EXPERT_RE = re.compile(r"Expert Info \((\w+)/(\w+)\): (.*)")


@dataclass(frozen=True)
class Expert:
    """One expert-info item: severity (Chat, Note, Warning, Error), group, message."""

    severity: str
    group: str
    message: str

    @property
    def is_problem(self) -> bool:
        return self.severity in ("Warning", "Error")


def _experts(elem: ET.Element) -> list[Expert]:
    out: list[Expert] = []
    for f in elem.iter("field"):
        if f.get("name") != "_ws.expert":
            continue
        m = _EXPERT_RE.match(f.get("showname", ""))
        out.append(Expert(*m.groups()) if m else Expert("?", "?", f.get("showname", "")))
    return out


def run_pdml(capture: Path, extra_args: Sequence[str] = ()) -> list[Packet]:
    """Decode ``capture`` with tshark and return every frame (with its SMC layers, if any).

    tshark runs with a private, empty configuration directory so a developer's Wireshark profile
    (a disabled heuristic, a changed preference) cannot change the verdict; both SMC heuristics are
    switched on explicitly even though 4.0 enables them by default.
    """
    tshark = require_tool("tshark")
    with tempfile.TemporaryDirectory(prefix="smcd-tshark-home-") as home:
        env = dict(os.environ, HOME=home, XDG_CONFIG_HOME=home, WIRESHARK_CONFIG_DIR=home)
        proc = subprocess.run(
            [
                tshark,
                "-r",
                str(capture),
                "-n",
                "--enable-heuristic",
                "smc_tcp",
                "--enable-heuristic",
                "smcr_infiniband",
                *extra_args,
                "-T",
                "pdml",
            ],
            capture_output=True,
            env=env,
            timeout=120,
            check=False,
        )
    if proc.returncode != 0:
        err = proc.stderr.decode(errors="replace")
        raise RuntimeError(f"tshark failed ({proc.returncode}) on {capture}: {err}")
    root = ET.fromstring(proc.stdout)
    packets: list[Packet] = []
    for number, pkt in enumerate(root.iter("packet"), start=1):
        protos = pkt.findall("proto")
        pdus: list[SmcPdu] = []
        stream: int | None = None
        srcport: int | None = None
        for proto in protos:
            name = proto.get("name", "")
            if name == "tcp":
                for f in proto.iter("field"):
                    if f.get("name") == "tcp.stream":
                        stream = int(f.get("show", "0"))
                    elif f.get("name") == "tcp.srcport":
                        srcport = int(f.get("show", "0"))
            if name == "smc":
                base = int(proto.get("pos", "0"))
                pdu = SmcPdu(frame=number, pos=base, size=int(proto.get("size", "0")))
                _walk_fields(proto, base, pdu.fields)
                pdu.experts = _experts(proto)
                pdus.append(pdu)
        packets.append(
            Packet(
                number=number,
                pdus=pdus,
                protocols=[p.get("name", "") for p in protos],
                malformed=any(p.get("name") == "_ws.malformed" for p in pkt.iter("proto"))
                or any(f.get("name") == "_ws.malformed" for f in pkt.iter("field")),
                experts=_experts(pkt),
                tcp_stream=stream,
                tcp_srcport=srcport,
            )
        )
    return packets
