"""Capture RoCEv2 (UDP 4791) on a virtio NIC with tcpdump and decode the InfiniBand headers.

The decoding is ours and minimal (classic pcap, Ethernet / IPv4 / UDP / BTH [/ RETH]): enough
to count the RDMA WRITE packets to one QP and add up their payload.
"""

from __future__ import annotations

import re
import shutil
import signal
import struct
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

ROCEV2_PORT = 4791
#: RC opcodes (IBA vol. 1, table 38) that carry an RDMA WRITE; FIRST and ONLY carry a RETH.
RC_RDMA_WRITE = {6: "FIRST", 7: "MIDDLE", 8: "LAST", 9: "LAST_IMM", 10: "ONLY", 11: "ONLY_IMM"}
RC_RDMA_WRITE_WITH_RETH = {6, 10, 11}
RC_SEND = {0: "FIRST", 1: "MIDDLE", 2: "LAST", 3: "LAST_IMM", 4: "ONLY", 5: "ONLY_IMM"}
RC_ACK = 17
_BTH_LEN, _RETH_LEN, _ICRC_LEN = 12, 16, 4


@dataclass(frozen=True)
class RocePacket:
    src: str
    dst: str
    opcode: int
    dest_qp: int
    psn: int
    payload_len: int
    reth: tuple[int, int, int] | None  # (virtual address, rkey, DMA length)


def _ip(raw: bytes) -> str:
    return ".".join(str(b) for b in raw)


def read_pcap(path: Path) -> list[bytes]:
    """Frames of a classic (tcpdump -w) pcap file."""
    data = path.read_bytes()
    if len(data) < 24:
        raise AssertionError(f"{path}: {len(data)} bytes, not a pcap file")
    magic = data[:4]
    if magic in (b"\xd4\xc3\xb2\xa1", b"\x4d\x3c\xb2\xa1"):
        order = "<"
    elif magic in (b"\xa1\xb2\xc3\xd4", b"\xa1\xb2\x3c\x4d"):
        order = ">"
    else:
        raise AssertionError(f"{path}: unknown pcap magic {magic.hex()}")
    (linktype,) = struct.unpack_from(order + "I", data, 20)
    if linktype != 1:
        raise AssertionError(f"{path}: link type {linktype}, expected Ethernet")
    frames, off = [], 24
    while off + 16 <= len(data):
        _sec, _frac, incl, _orig = struct.unpack_from(order + "IIII", data, off)
        frames.append(data[off + 16 : off + 16 + incl])
        off += 16 + incl
    return frames


def decode_roce(frame: bytes) -> RocePacket | None:
    """The RoCEv2 headers of an Ethernet frame, or None for anything else."""
    if len(frame) < 14 or frame[12:14] != b"\x08\x00":
        return None
    ip = frame[14:]
    ihl = (ip[0] & 0x0F) * 4
    if ip[9] != 17:
        return None
    udp = ip[ihl:]
    dport, ulen = struct.unpack_from("!2xHH", udp)
    if dport != ROCEV2_PORT:
        return None
    bth = udp[8:]
    opcode, flags = bth[0], bth[1]
    pad = (flags >> 4) & 0x3
    dest_qp = int.from_bytes(bth[5:8], "big")
    psn = int.from_bytes(bth[9:12], "big")
    hdr = _BTH_LEN
    reth = None
    if opcode in RC_RDMA_WRITE_WITH_RETH:
        reth = struct.unpack_from("!QII", bth, _BTH_LEN)
        hdr += _RETH_LEN
    if opcode == RC_ACK:
        hdr += 4  # AETH
    payload = ulen - 8 - hdr - _ICRC_LEN - pad
    return RocePacket(_ip(ip[12:16]), _ip(ip[16:20]), opcode, dest_qp, psn, payload, reth)


@dataclass
class Capture:
    path: Path
    dropped: int | None = None  # tcpdump's "packets dropped by kernel", known once it stopped
    log: str = ""

    def packets(self) -> list[RocePacket]:
        return [p for p in map(decode_roce, read_pcap(self.path)) if p is not None]


@contextmanager
def capture_roce(ifname: str, keep: Path, *, ready_timeout: float = 60.0) -> Iterator[Capture]:
    """tcpdump on ``ifname`` for UDP 4791 while the block runs.

    tcpdump writes to guest-local /tmp (the shared dir is a synchronous 9p mount: writing each
    packet there is slow enough to make the kernel drop packets); the pcap is then moved to
    ``keep`` for the host to inspect.
    """
    tcpdump = shutil.which("tcpdump")
    if tcpdump is None:
        raise AssertionError(
            "tcpdump not found in the guest (host root): run tests/host/vm-deps.sh"
        )
    work = Path(tempfile.mkdtemp(prefix="roce-capture-"))
    pcap, log = work / "capture.pcap", work / "tcpdump.log"
    cap = Capture(keep)
    with open(log, "w") as err:
        proc = subprocess.Popen(
            [tcpdump, "-i", ifname, "-n", "-U", "--immediate-mode", "-B", "16384",
             "-w", str(pcap), "udp", "port", str(ROCEV2_PORT)],
            stdout=subprocess.DEVNULL, stderr=err,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + ready_timeout
        while "listening on" not in log.read_text():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"tcpdump did not start on {ifname}: {log.read_text()}")
            time.sleep(0.1)
        yield cap
        time.sleep(0.5)  # let the last ACKs arrive
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        cap.log = log.read_text()
        m = re.search(r"(\d+) packets? dropped by kernel", cap.log)
        cap.dropped = int(m.group(1)) if m else None
        if pcap.exists():
            shutil.copyfile(pcap, keep)
        shutil.rmtree(work, ignore_errors=True)
