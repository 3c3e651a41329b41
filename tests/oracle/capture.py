"""Send CLC messages over a real loopback TCP connection while dumpcap records it.

The CLC oracle must see our bytes the way a peer would: as a TCP byte stream, split into
segments by the kernel and reassembled by Wireshark's ``tcp_dissect_pdus`` using the CLC length
field. So we really listen on 127.0.0.1, really connect, and capture with dumpcap on ``lo``.

dumpcap hands packets to its file in batches (its libpcap read timeout is a few hundred ms) and
drops what is still in the kernel ring when it is interrupted, and its "Capturing on" line comes
before the filter is live. So both ends of a capture are fenced with a *sentinel* connection from a
known client port: the capture has started once the sentinel's SYN is in the file, and everything
sent earlier is in the file once a later sentinel's SYN is.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from tests.oracle.tshark import require_tool

__all__ = [
    "LoopbackCapture",
    "loopback_capture",
    "make_listener",
    "make_listener_pair",
    "pcapng_tcp_ports",
    "send_streams",
]

_TIMEOUT = 20.0
_LINKTYPE_ETHERNET = 1


def pcapng_tcp_ports(path: Path) -> list[tuple[int, int]]:
    """(source port, destination port) of each IPv4/TCP packet dumpcap has flushed to ``path``.

    A minimal pcapng walk (SHB byte order, IDB link type, EPB data); a half-written trailing block
    is ignored, since dumpcap may be writing it right now.
    """
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    if len(data) < 12 or data[:4] != b"\x0a\x0d\x0d\x0a":
        return []
    order = "<" if data[8:12] == b"\x4d\x3c\x2b\x1a" else ">"
    ports: list[tuple[int, int]] = []
    off = 0
    while off + 12 <= len(data):
        btype, blen = struct.unpack_from(order + "II", data, off)
        if blen < 12 or off + blen > len(data):
            break
        if btype == 1:  # Interface Description Block
            (linktype,) = struct.unpack_from(order + "H", data, off + 8)
            if linktype != _LINKTYPE_ETHERNET:
                raise RuntimeError(f"unexpected link type {linktype} on lo in {path}")
        elif btype == 6:  # Enhanced Packet Block
            (caplen,) = struct.unpack_from(order + "I", data, off + 20)
            pkt = data[off + 28 : off + 28 + caplen]
            if len(pkt) >= 14 + 20 and pkt[12:14] == b"\x08\x00" and pkt[14 + 9] == 6:
                ihl = (pkt[14] & 0x0F) * 4
                if len(pkt) >= 14 + ihl + 4:
                    ports.append(struct.unpack_from("!HH", pkt, 14 + ihl))
        off += blen
    return ports


def make_listener(port: int = 0, *, ipv6: bool = False) -> socket.socket:
    """A listening TCP socket on 127.0.0.1 (or ::1) with a kernel-chosen (ephemeral) port."""
    sock = socket.socket(socket.AF_INET6 if ipv6 else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("::1" if ipv6 else "127.0.0.1", port))
        sock.listen(16)
    except OSError:
        sock.close()
        raise
    return sock


def make_listener_pair() -> tuple[socket.socket, socket.socket]:
    """Listeners on 127.0.0.1 and ::1 with the *same* port, so one capture filter
    ``tcp port N`` sees both address families."""
    for _ in range(20):
        v4 = make_listener()
        try:
            return v4, make_listener(v4.getsockname()[1], ipv6=True)
        except OSError:
            v4.close()
    raise RuntimeError("found no port free on both 127.0.0.1 and ::1")


class LoopbackCapture:
    """A running ``dumpcap -i lo -f 'tcp port N'`` writing ``path``; N = the listener's port."""

    def __init__(self, path: Path, listener: socket.socket, proc: subprocess.Popen[bytes]) -> None:
        self.path = path
        self.listener = listener
        self.port: int = listener.getsockname()[1]
        self.proc = proc
        self.sentinel_ports: list[int] = []

    def sync(self, deadline: float) -> None:
        """Connect from a fresh client port until that connection is in the file on disk."""
        while True:
            client = socket.create_connection(("127.0.0.1", self.port), timeout=5)
            sport = client.getsockname()[1]
            self.sentinel_ports.append(sport)
            conn, _ = self.listener.accept()
            client.close()
            conn.close()
            poll_until = min(deadline, time.monotonic() + 1.0)
            while time.monotonic() < poll_until:
                if any(p[0] == sport for p in pcapng_tcp_ports(self.path)):
                    return
                if self.proc.poll() is not None:
                    raise RuntimeError(f"dumpcap exited early with {self.proc.returncode}")
                time.sleep(0.05)
            if time.monotonic() >= deadline:
                raise RuntimeError(f"dumpcap never recorded sentinel port {sport} in {self.path}")


@contextlib.contextmanager
def loopback_capture(path: Path, listener: socket.socket) -> Iterator[LoopbackCapture]:
    """Capture all TCP traffic to/from ``listener``'s port on ``lo`` while the block runs.

    Stopped with SIGINT (so dumpcap finishes the pcapng cleanly) only after a sentinel proves every
    packet of the block reached the file.
    """
    dumpcap = require_tool("dumpcap")
    port = listener.getsockname()[1]
    proc = subprocess.Popen(
        [dumpcap, "-q", "-i", "lo", "-f", f"tcp port {port}", "-w", str(path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    stderr_lines: list[bytes] = []
    started = threading.Event()

    def pump() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            stderr_lines.append(line)
            if b"Capturing on" in line:
                started.set()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    cap = LoopbackCapture(path, listener, proc)
    try:
        deadline = time.monotonic() + _TIMEOUT
        while not started.wait(0.05):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    "dumpcap did not start capturing on lo: "
                    + b"".join(stderr_lines).decode(errors="replace")
                )
        cap.sync(deadline)
        yield cap
        cap.sync(time.monotonic() + _TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        reader.join(timeout=5)
    if proc.returncode not in (0, -signal.SIGINT):
        raise RuntimeError(
            f"dumpcap exited with {proc.returncode}: "
            + b"".join(stderr_lines).decode(errors="replace")
        )


def send_streams(
    listener: socket.socket,
    streams: Sequence[Sequence[bytes]],
    listeners: Sequence[socket.socket] | None = None,
) -> list[int]:
    """Open one TCP connection per stream, send its messages (one ``send`` each) in order.

    ``listeners`` (one per stream) overrides ``listener``, e.g. to send some streams over IPv6.

    Returns the client port of each connection so the decode can be matched to the stream. The
    server side reads everything and checks it got exactly the bytes sent: a short read would
    otherwise look like a dissector problem.
    """
    ports: list[int] = []
    for i, messages in enumerate(streams):
        lsock = listeners[i] if listeners is not None else listener
        client = socket.create_connection(lsock.getsockname()[:2], timeout=10)
        client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        ports.append(client.getsockname()[1])
        server, _ = lsock.accept()
        server.settimeout(10)
        try:
            expected = b"".join(messages)
            got = bytearray()
            for msg in messages:
                # one message in flight at a time: each leaves in its own segment, however busy
                # the machine (autocorking would otherwise merge them, and a PDU cut across two
                # segments is where the 4.0 dissector goes astray)
                client.sendall(msg)
                want = len(got) + len(msg)
                while len(got) < want and (chunk := server.recv(want - len(got))):
                    got += chunk
            client.shutdown(socket.SHUT_WR)
            while chunk := server.recv(65536):
                got += chunk
            if bytes(got) != expected:
                raise RuntimeError(f"loopback delivered {len(got)} of {len(expected)} bytes")
        finally:
            client.close()
            server.close()
    return ports
