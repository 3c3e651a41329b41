"""Drive the Linux kernel's own SMC (AF_SMC) inside the test VM and take its wire traffic apart.

Stdlib only, written for this project (smc-tools is not packaged in Debian):

* AF_SMC sockets: Python's ``socket`` cannot parse AF_SMC addresses, so ``bind``/``connect`` go
  through ctypes with a ``struct sockaddr_in`` (``SMCPROTO_SMC`` takes IPv4 addresses); the rest
  is a normal socket object.
* generic netlink (``include/uapi/linux/smc.h``): pnet table entries (``SMC_PNETID``) and user
  EIDs (``SMC_GEN_NETLINK``). rxe has no ``get_netdev``, so SMC-R finds an RDMA device for a
  netdev only through a pnet entry; SMC-Rv2 (the only SMC-R rxe can do: it has RoCEv2 GIDs only)
  needs a UEID common to both sides.
* sock_diag for AF_SMC (``smc_diag.h``): a connection's mode. Falling back to TCP is silent for
  the application, so every kernel connection's mode must be checked there.
* pcap decoding of what tcpdump saw: the TCP byte streams (CLC messages) and the RoCEv2 RC SEND
  payloads (LLC and CDC messages), plus the RDMA WRITE byte counts (the data itself).
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from smcd_daemon.wire import clc
from tests.vm.guest.roce_capture import ROCEV2_PORT, read_pcap

__all__ = [
    "AF_SMC",
    "CapturedSend",
    "DiagSocket",
    "KernelSmcError",
    "PcapTraffic",
    "capture",
    "modprobe",
    "pnet_add",
    "pnet_del",
    "rmmod",
    "smc_connect",
    "smc_diag",
    "smc_listen",
    "split_clc",
    "ueid_add",
    "ueid_del",
]

AF_SMC = 43
SMCPROTO_SMC = 0  # IPv4 addresses (SMCPROTO_SMC6 = 1 for IPv6)

_libc = ctypes.CDLL(None, use_errno=True)


class KernelSmcError(RuntimeError):
    """The kernel's SMC could not be driven as asked (the message names the step)."""


def dmesg_lines() -> list[str]:
    """The kernel log, a line each (what the rxe and SMC modules said)."""
    done = subprocess.run(["dmesg"], check=True, capture_output=True, text=True, timeout=60)
    return done.stdout.splitlines()


def modprobe(*modules: str) -> None:
    done = subprocess.run(
        ["modprobe", "-a", *modules], capture_output=True, text=True, timeout=120, check=False
    )
    if done.returncode != 0:
        raise KernelSmcError(f"modprobe -a {' '.join(modules)}: {done.stderr.strip()}")


def rmmod(*modules: str, timeout: float = 120.0) -> None:
    """Unload ``modules`` in order, retrying while one is still in use (a closed AF_SMC socket
    holds the module until the kernel frees it); each one not loaded is skipped."""
    for mod in modules:
        deadline = time.monotonic() + timeout
        while Path(f"/sys/module/{mod}").exists():
            done = subprocess.run(["rmmod", mod], capture_output=True, text=True, timeout=120)
            if done.returncode == 0:
                break
            if time.monotonic() > deadline:
                lsmod = subprocess.run(["lsmod"], capture_output=True, text=True, timeout=30)
                raise KernelSmcError(f"rmmod {mod}: {done.stderr.strip()}\n{lsmod.stdout}")
            time.sleep(1.0)


# ------------------------------------------------------------------------------------ sockets
def _sockaddr_in(ip: str, port: int) -> ctypes.Array[ctypes.c_char]:
    raw = struct.pack("=H", socket.AF_INET) + struct.pack("!H", port) + socket.inet_aton(ip)
    return ctypes.create_string_buffer(raw + bytes(8), 16)


def _check(rc: int, what: str) -> None:
    if rc < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _smc_socket() -> socket.socket:
    """A new AF_SMC stream socket. Made with libc and wrapped by file descriptor: Python then
    takes its family from getsockname, which SMC answers for its TCP socket (AF_INET), so
    ``accept`` can parse peer addresses (a socket object made with family 43 cannot)."""
    fd = _libc.socket(AF_SMC, socket.SOCK_STREAM, SMCPROTO_SMC)
    _check(fd, "socket(AF_SMC)")
    return socket.socket(fileno=fd)


def smc_listen(ip: str, port: int, *, timeout: float) -> socket.socket:
    """A listening AF_SMC socket; ``accept`` on it times out after ``timeout`` seconds."""
    s = _smc_socket()
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        _check(_libc.bind(s.fileno(), _sockaddr_in(ip, port), 16), f"bind AF_SMC {ip}:{port}")
        s.listen(4)
        s.settimeout(timeout)
    except BaseException:
        s.close()
        raise
    return s


def smc_connect(ip: str, port: int, *, timeout: float) -> socket.socket:
    """An AF_SMC client socket connected to ``ip:port`` (CLC handshake included).

    The blocking ``connect`` runs in a thread so that a wedged handshake costs ``timeout``, not
    the test; the socket then has ``timeout`` for every send/recv.
    """
    s = _smc_socket()
    result: list[BaseException | None] = []

    def run() -> None:
        try:
            _check(_libc.connect(s.fileno(), _sockaddr_in(ip, port), 16), f"connect {ip}:{port}")
            result.append(None)
        except BaseException as exc:  # handed to the caller
            result.append(exc)

    t = threading.Thread(target=run, name=f"smc-connect-{port}", daemon=True)
    t.start()
    t.join(timeout)
    if not result:
        raise KernelSmcError(f"AF_SMC connect to {ip}:{port} did not finish within {timeout} s")
    if result[0] is not None:
        s.close()
        raise result[0]
    s.settimeout(timeout)
    return s


def recv_exact(s: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise KernelSmcError(f"peer closed after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


# ------------------------------------------------------------------------------------ netlink
NETLINK_GENERIC = 16
NETLINK_SOCK_DIAG = 4
_NLM_F_REQUEST, _NLM_F_ACK, _NLM_F_DUMP = 0x1, 0x4, 0x300
_NLMSG_ERROR, _NLMSG_DONE = 2, 3
_GENL_ID_CTRL, _CTRL_CMD_GETFAMILY = 0x10, 3
_CTRL_ATTR_FAMILY_ID, _CTRL_ATTR_FAMILY_NAME = 1, 2
_SOCK_DIAG_BY_FAMILY = 20

# include/uapi/linux/smc.h
_SMC_PNETID_FAMILY = "SMC_PNETID"
_SMC_PNETID_ADD, _SMC_PNETID_DEL = 2, 3
_SMC_PNETID_NAME, _SMC_PNETID_ETHNAME, _SMC_PNETID_IBNAME, _SMC_PNETID_IBPORT = 1, 2, 3, 4
_SMC_GEN_FAMILY = "SMC_GEN_NETLINK"
_SMC_NETLINK_ADD_UEID, _SMC_NETLINK_REMOVE_UEID = 10, 11
_SMC_NLA_EID_TABLE_ENTRY = 1
_EID_LEN = 32

# include/uapi/linux/smc_diag.h
_SMC_DIAG_CONNINFO, _SMC_DIAG_FALLBACK = 1, 5
DIAG_MODES = {0: "SMCR", 1: "TCP", 2: "SMCD"}


def _nla(atype: int, payload: bytes) -> bytes:
    length = 4 + len(payload)
    return struct.pack("=HH", length, atype) + payload + bytes(-length % 4)


def _attrs(buf: bytes) -> dict[int, bytes]:
    out: dict[int, bytes] = {}
    off = 0
    while off + 4 <= len(buf):
        length, atype = struct.unpack_from("=HH", buf, off)
        if length < 4:
            break
        out[atype & 0x3FFF] = buf[off + 4 : off + length]
        off += (length + 3) & ~3
    return out


class _Netlink:
    def __init__(self, proto: int, timeout: float = 10.0) -> None:
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, proto)
        self.sock.settimeout(timeout)
        self.sock.bind((0, 0))
        self.seq = 0

    def close(self) -> None:
        self.sock.close()

    def request(self, mtype: int, flags: int, payload: bytes) -> list[bytes]:
        """Send one request; return the bodies of the answers (an error raises OSError)."""
        self.seq += 1
        hdr = struct.pack("=IHHII", 16 + len(payload), mtype, flags | _NLM_F_REQUEST, self.seq, 0)
        self.sock.send(hdr + payload)
        bodies: list[bytes] = []
        while True:
            data = self.sock.recv(1 << 16)
            off = 0
            while off + 16 <= len(data):
                length, t, _fl, seq, _pid = struct.unpack_from("=IHHII", data, off)
                body = data[off + 16 : off + length]
                off += (length + 3) & ~3
                if seq != self.seq:
                    continue
                if t == _NLMSG_ERROR:
                    (err,) = struct.unpack_from("=i", body)
                    if err:
                        raise OSError(-err, os.strerror(-err))
                    return bodies
                if t == _NLMSG_DONE:
                    return bodies
                bodies.append(body)
                if not flags & (_NLM_F_DUMP | _NLM_F_ACK):
                    return bodies


def _genl(name: str, cmd: int, attrs: bytes) -> None:
    nl = _Netlink(NETLINK_GENERIC)
    try:
        ask = struct.pack("=BBH", _CTRL_CMD_GETFAMILY, 1, 0) + _nla(
            _CTRL_ATTR_FAMILY_NAME, name.encode() + b"\0"
        )
        try:
            reply = nl.request(_GENL_ID_CTRL, 0, ask)
        except OSError as exc:
            raise KernelSmcError(f"no generic netlink family {name} ({exc}): smc loaded?") from exc
        (family,) = struct.unpack_from("=H", _attrs(reply[0][4:])[_CTRL_ATTR_FAMILY_ID])
        nl.request(family, _NLM_F_ACK, struct.pack("=BBH", cmd, 1, 0) + attrs)
    finally:
        nl.close()


def pnet_add(pnetid: str, ethname: str, ibname: str, ibport: int = 1) -> None:
    """Map ``ethname`` and ``ibname``/``ibport`` to one pnetid (``smc_pnet add`` of smc-tools)."""
    _genl(
        _SMC_PNETID_FAMILY,
        _SMC_PNETID_ADD,
        _nla(_SMC_PNETID_NAME, pnetid.encode() + b"\0")
        + _nla(_SMC_PNETID_ETHNAME, ethname.encode() + b"\0")
        + _nla(_SMC_PNETID_IBNAME, ibname.encode() + b"\0")
        + _nla(_SMC_PNETID_IBPORT, bytes([ibport])),
    )


def pnet_del(pnetid: str) -> None:
    """Remove a pnet table entry (``smc_pnet del``)."""
    _genl(_SMC_PNETID_FAMILY, _SMC_PNETID_DEL, _nla(_SMC_PNETID_NAME, pnetid.encode() + b"\0"))


def ueid_del(eid: str) -> None:
    """Remove a user EID."""
    raw = eid.encode("ascii")
    entry = _nla(_SMC_NLA_EID_TABLE_ENTRY, raw.ljust(_EID_LEN) + b"\0")
    _genl(_SMC_GEN_FAMILY, _SMC_NETLINK_REMOVE_UEID, entry)


def ueid_add(eid: str) -> None:
    """Add a user EID (upper case, digits, '.', '-'): 32 blank-padded bytes + NUL."""
    raw = eid.encode("ascii")
    if len(raw) > _EID_LEN:
        raise ValueError(f"an EID has at most {_EID_LEN} characters")
    entry = _nla(_SMC_NLA_EID_TABLE_ENTRY, raw.ljust(_EID_LEN) + b"\0")
    _genl(_SMC_GEN_FAMILY, _SMC_NETLINK_ADD_UEID, entry)


@dataclass(frozen=True)
class DiagSocket:
    """One AF_SMC socket as smc_diag reports it (addresses are the CLC TCP socket's)."""

    state: int
    mode: str  # SMCR, TCP (fallback) or SMCD
    src: str
    sport: int
    dst: str
    dport: int
    fallback_reason: int | None = None
    peer_diagnosis: int | None = None
    token: int | None = None  # alert token of the connection (what the peer's CDCs carry)
    rmbe_size: int | None = None
    peer_rmbe_size: int | None = None


def smc_diag() -> list[DiagSocket]:
    """Every AF_SMC socket of the kernel, with connection info and fallback reasons."""
    nl = _Netlink(NETLINK_SOCK_DIAG)
    try:
        req = struct.pack("=BBBB", AF_SMC, 0, 0, 0xFF) + bytes(48)
        bodies = nl.request(_SOCK_DIAG_BY_FAMILY, _NLM_F_DUMP, req)
    finally:
        nl.close()
    out = []
    for body in bodies:
        _fam, state, mode, _shut = struct.unpack_from("=BBBB", body)
        sport, dport = struct.unpack_from("!HH", body, 4)
        attrs = _attrs(body[64:])
        extra: dict[str, int] = {}
        if _SMC_DIAG_FALLBACK in attrs:
            rsn, peer = struct.unpack_from("=II", attrs[_SMC_DIAG_FALLBACK])
            extra.update(fallback_reason=rsn, peer_diagnosis=peer)
        if _SMC_DIAG_CONNINFO in attrs:
            token, _snd, rmbe, peer_rmbe = struct.unpack_from("=IIII", attrs[_SMC_DIAG_CONNINFO])
            extra.update(token=token, rmbe_size=rmbe, peer_rmbe_size=peer_rmbe)
        out.append(
            DiagSocket(
                state=state,
                mode=DIAG_MODES.get(mode, str(mode)),
                src=socket.inet_ntoa(body[8:12]),
                sport=sport,
                dst=socket.inet_ntoa(body[24:28]),
                dport=dport,
                **extra,
            )
        )
    return out


# ------------------------------------------------------------------------------------ capture
@contextmanager
def capture(
    ifname: str, bpf: list[str], keep: Path, *, ready_timeout: float = 60.0
) -> Iterator[Path]:
    """tcpdump on ``ifname`` with filter ``bpf`` while the block runs; the pcap ends up at
    ``keep`` (written to guest-local /tmp first: the shared 9p dir is too slow per packet).

    The ring is 64 MiB: in immediate mode each slot holds the largest packet the NIC may
    hand up (~64 KiB with its offloads), so 16 MiB held only ~256 packets, and a 300 KB echo
    over SMC-R is ~600 RoCE packets that a tcpdump slowed by TCG drained too late (44 of 690
    dropped once in CI)."""
    tcpdump = shutil.which("tcpdump")
    if tcpdump is None:
        raise KernelSmcError("tcpdump not found (host root): run tests/host/vm-deps.sh")
    work = Path(tempfile.mkdtemp(prefix="smc-capture-"))
    pcap, log = work / "capture.pcap", work / "tcpdump.log"
    with open(log, "w") as err:
        proc = subprocess.Popen(
            [tcpdump, "-i", ifname, "-n", "-U", "--immediate-mode", "-B", "65536", "-s", "0",
             "-w", str(pcap), *bpf],
            stdout=subprocess.DEVNULL, stderr=err,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + ready_timeout
        while "listening on" not in log.read_text():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise KernelSmcError(f"tcpdump did not start on {ifname}: {log.read_text()}")
            time.sleep(0.1)
        yield keep
        time.sleep(0.5)  # the last ACKs
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        text = log.read_text()
        m = re.search(r"(\d+) packets? dropped by kernel", text)
        if pcap.exists():
            shutil.copyfile(pcap, keep)
        shutil.rmtree(work, ignore_errors=True)
        if m and int(m.group(1)):
            raise KernelSmcError(f"tcpdump on {ifname} dropped packets: {text}")


# ------------------------------------------------------------------------------------ pcap
# RC opcodes (IBA vol. 1 table 38)
_SEND_FIRST, _SEND_MIDDLE, _SEND_LAST, _SEND_LAST_IMM, _SEND_ONLY, _SEND_ONLY_IMM = range(6)
_WRITE_OPS = {6, 7, 8, 9, 10, 11}
_WRITE_WITH_RETH = {6, 10, 11}
_WITH_IMM = {_SEND_LAST_IMM, _SEND_ONLY_IMM, 9, 11}
_BTH, _RETH, _IMM, _ICRC = 12, 16, 4, 4
SMC_TCP_OPTION = b"\xfe\x06\xe2\xd4\xc3\xd9"  # experimental option 254, magic "SMCR" (EBCDIC)


@dataclass(frozen=True)
class CapturedSend:
    """One whole RDMA SEND (possibly several packets) as it crossed the wire."""

    src: str
    dst: str
    dest_qp: int
    psn: int  # of its first packet
    payload: bytes


@dataclass
class PcapTraffic:
    """What a capture holds, decoded down to SMC messages' bytes."""

    tcp_streams: dict[tuple[str, int, str, int], bytes] = field(default_factory=dict)
    syn_options: dict[tuple[str, int, str, int], bytes] = field(default_factory=dict)
    sends: list[CapturedSend] = field(default_factory=list)
    write_bytes: dict[tuple[str, str], int] = field(default_factory=dict)
    roce_packets: int = 0

    @classmethod
    def from_pcap(cls, path: Path) -> PcapTraffic:
        out = cls()
        segs: dict[tuple[str, int, str, int], dict[int, bytes]] = {}
        isn: dict[tuple[str, int, str, int], int] = {}
        seen_psn: set[tuple[str, str, int, int]] = set()
        partial: dict[tuple[str, str, int], tuple[int, bytearray]] = {}
        for frame in read_pcap(path):
            if len(frame) < 34 or frame[12:14] != b"\x08\x00":
                continue
            ip = frame[14:]
            ihl = (ip[0] & 0x0F) * 4
            (total,) = struct.unpack_from("!H", ip, 2)
            ip = ip[:total]
            src, dst = socket.inet_ntoa(ip[12:16]), socket.inet_ntoa(ip[16:20])
            l4 = ip[ihl:]
            if ip[9] == 6:
                sport, dport, seq = struct.unpack_from("!HHI", l4)
                doff = (l4[12] >> 4) * 4
                flags = l4[13]
                key = (src, sport, dst, dport)
                if flags & 0x02:  # SYN
                    isn[key] = seq
                    out.syn_options[key] = l4[20:doff]
                data = l4[doff:]
                if data:
                    segs.setdefault(key, {})[seq] = data
            elif ip[9] == 17 and struct.unpack_from("!H", l4, 2)[0] == ROCEV2_PORT:
                out.roce_packets += 1
                out._roce(src, dst, l4[8:], seen_psn, partial)
        for key, by_seq in segs.items():
            if key not in isn:
                raise KernelSmcError(f"TCP {key}: data without a captured SYN")
            out.tcp_streams[key] = _reassemble(key, isn[key] + 1, by_seq)
        if partial:
            raise KernelSmcError(f"RDMA SENDs cut off at the end of the capture: {list(partial)}")
        return out

    def _roce(
        self,
        src: str,
        dst: str,
        bth: bytes,
        seen: set[tuple[str, str, int, int]],
        partial: dict[tuple[str, str, int], tuple[int, bytearray]],
    ) -> None:
        opcode, flags = bth[0], bth[1]
        pad = (flags >> 4) & 0x3
        qp = int.from_bytes(bth[5:8], "big")
        psn = int.from_bytes(bth[9:12], "big")
        if opcode > 11:
            return  # ACKs, reads, atomics: no SMC message
        key = (src, dst, qp, psn)
        if key in seen:
            return  # a retransmission
        seen.add(key)
        hdr = _BTH + (_RETH if opcode in _WRITE_WITH_RETH else 0)
        hdr += _IMM if opcode in _WITH_IMM else 0
        payload = bth[hdr : len(bth) - _ICRC - pad]
        if opcode in _WRITE_OPS:
            self.write_bytes[(src, dst)] = self.write_bytes.get((src, dst), 0) + len(payload)
            return
        qkey = (src, dst, qp)
        if opcode in (_SEND_ONLY, _SEND_ONLY_IMM):
            self.sends.append(CapturedSend(src, dst, qp, psn, bytes(payload)))
        elif opcode == _SEND_FIRST:
            partial[qkey] = (psn, bytearray(payload))
        else:
            if qkey not in partial:
                raise KernelSmcError(f"SEND opcode {opcode} to QP {qp} without its FIRST")
            partial[qkey][1].extend(payload)
            if opcode in (_SEND_LAST, _SEND_LAST_IMM):
                first, buf = partial.pop(qkey)
                self.sends.append(CapturedSend(src, dst, qp, first, bytes(buf)))


def _reassemble(key: tuple[str, int, str, int], start: int, by_seq: dict[int, bytes]) -> bytes:
    out = bytearray()
    pos = start
    for seq in sorted(by_seq, key=lambda s: (s - start) & 0xFFFFFFFF):
        data = by_seq[seq]
        rel = (seq - pos) & 0xFFFFFFFF
        if rel > 0x7FFFFFFF:  # overlaps what we have (a retransmission)
            skip = (pos - seq) & 0xFFFFFFFF
            data = data[skip:]
            rel = 0
        if rel:
            raise KernelSmcError(f"TCP {key}: {rel} bytes missing at sequence {pos}")
        out += data
        pos = (pos + len(data)) & 0xFFFFFFFF
    return bytes(out)


def split_clc(stream: bytes) -> list[bytes]:
    """Cut a TCP byte stream into whole CLC messages (header length field); what follows the
    handshake must be nothing (SMC mode) — leftover bytes are returned as a last element that
    does not start with an eyecatcher, for the caller to judge."""
    out = []
    off = 0
    while off < len(stream):
        if stream[off : off + 4] not in (clc.SMCR_EYECATCHER, clc.SMCD_EYECATCHER):
            out.append(stream[off:])
            break
        hdr = clc.peek_header(stream[off : off + clc.CLC_HEADER_LEN])
        out.append(stream[off : off + hdr.length])
        off += hdr.length
    return out
