"""Interim demo (``make demo``): an SMC-Dv2 loopback-ism CLC handshake over a real TCP connection.

Until the handoff issue lands, this is what smcd can show end to end: the client proposes
SMC-Dv2 over loopback-ism (a UEID, the system EID and the device's 128-bit GID as the two
GID/CHID 0xFFFF entries), the server accepts with a first contact and a v2.1 First Contact
Extension, the client confirms. Every message is built by the real encoders, sent over a real
loopback TCP connection between two threads, framed the way the kernel frames it (peek the
8-byte header, read ``length`` bytes) and decoded by the real decoders. Exit status 0 only if
every message decoded equal to what was sent.

Run: ``python -m smcd_daemon.demo``.
"""

from __future__ import annotations

import socket
import sys
import threading
from dataclasses import dataclass, field

from smcd_daemon.cli.render import render_text
from smcd_daemon.errors import SmcError
from smcd_daemon.wire import clc

UEID = "SMCD-DEMO-UEID"
SEID = "IBM-SYSZ-ISMSEID00000000"  # the default system EID Linux announces
LOOPBACK_CHID = 0xFFFF
TIMEOUT_S = 10.0

# 128-bit loopback-ism GIDs of the two ends (random in reality; fixed so the output is stable).
CLIENT_GID = 0x1C0FFEE0_00000001_5A5A5A5A_00000001
SERVER_GID = 0x1C0FFEE0_00000002_5A5A5A5A_00000002


def build_proposal() -> clc.Proposal:
    return clc.Proposal(
        typev1=clc.SmcType.N,
        typev2=clc.SmcType.D,
        peer_id=bytes.fromhex("9a3f020000000001"),
        version=2,
        v2_ext=clc.V2Extension(eids=(UEID,), release=1, seid_indicator=True),
        smcd_v2_ext=clc.SmcdV2Extension(
            seid=SEID,
            devices=(clc.IsmDevice.from_gid128(LOOPBACK_CHID, CLIENT_GID),),
        ),
    )


def build_accept() -> clc.Accept:
    return clc.Accept(
        info=clc.SmcdInfo(
            gid=SERVER_GID >> 64,
            gid_ext=SERVER_GID & ((1 << 64) - 1),
            token=0x0000_7F3A_0000_1001,
            link_id=0x00C0_FFEE,
            dmbe_idx=0,
            dmbe_size=2,  # 16 KiB << 2 = 64 KiB
            chid=LOOPBACK_CHID,
        ),
        version=2,
        first_contact=True,
        eid=UEID,
        fce=clc.FirstContactExt(hostname="smcd-demo-server", release=1, v2x=True),
    )


def build_confirm() -> clc.Confirm:
    return clc.Confirm(
        info=clc.SmcdInfo(
            gid=CLIENT_GID >> 64,
            gid_ext=CLIENT_GID & ((1 << 64) - 1),
            token=0x0000_7F3A_0000_2002,
            link_id=0x00C0_FFEE,
            dmbe_idx=0,
            dmbe_size=2,
            chid=LOOPBACK_CHID,
        ),
        version=2,
        first_contact=True,
        eid=UEID,
        fce=clc.FirstContactExt(hostname="smcd-demo-client", release=1, v2x=True),
    )


@dataclass
class Exchange:
    """One message as sent and as it arrived."""

    sender: str
    sent: clc.ClcMessage
    wire: bytes = b""
    received: bytes = b""
    decoded: clc.ClcMessage | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.decoded == self.sent and self.received == self.wire


@dataclass
class Transcript:
    exchanges: list[Exchange] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError(f"peer closed after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


def recv_clc(sock: socket.socket) -> bytes:
    """Frame one CLC message as the kernel does: the 8-byte header says how long it is."""
    first8 = _recv_exact(sock, 8)
    hdr = clc.peek_header(first8)
    return first8 + _recv_exact(sock, hdr.length - 8)


def _send(sock: socket.socket, ex: Exchange) -> None:
    ex.wire = ex.sent.encode()
    sock.sendall(ex.wire)


def _receive(sock: socket.socket, ex: Exchange) -> None:
    ex.received = recv_clc(sock)
    try:
        ex.decoded = clc.decode(ex.received)
    except SmcError as exc:
        ex.error = str(exc)


def run_handshake() -> Transcript:
    proposal = Exchange("client", build_proposal())
    accept = Exchange("server", build_accept())
    confirm = Exchange("client", build_confirm())
    transcript = Transcript([proposal, accept, confirm])

    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(TIMEOUT_S)
    port = listener.getsockname()[1]

    def server() -> None:
        try:
            conn, _ = listener.accept()
            with conn:
                conn.settimeout(TIMEOUT_S)
                _receive(conn, proposal)
                _send(conn, accept)
                _receive(conn, confirm)
        except (OSError, SmcError) as exc:
            transcript.errors.append(f"server: {exc}")

    thread = threading.Thread(target=server, name="clc-server")
    thread.start()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S) as sock:
            _send(sock, proposal)
            _receive(sock, accept)
            _send(sock, confirm)
            sock.shutdown(socket.SHUT_WR)
            sock.recv(1)  # wait for the server to finish reading the Confirm
    except (OSError, SmcError) as exc:
        transcript.errors.append(f"client: {exc}")
    thread.join(TIMEOUT_S * 2)
    listener.close()
    return transcript


def _hex_lines(data: bytes, indent: str = "    ") -> list[str]:
    return [
        f"{indent}{off:04x}  {data[off : off + 16].hex(' ')}" for off in range(0, len(data), 16)
    ]


def main() -> int:
    print("smcd demo: SMC-Dv2 over loopback-ism: CLC handshake on a real loopback TCP connection")
    transcript = run_handshake()
    all_ok = not transcript.errors
    for i, ex in enumerate(transcript.exchanges, 1):
        receiver = "server" if ex.sender == "client" else "client"
        name = type(ex.sent).__name__
        print()
        print(f"[{i}] {ex.sender} -> {receiver}: CLC {name} ({len(ex.wire)} bytes)")
        print("\n".join(_hex_lines(ex.received or ex.wire)))
        if ex.decoded is not None:
            print(f"  decoded by the {receiver}:")
            print(render_text(ex.decoded, indent=4))
        if ex.ok:
            print(f"  OK: {name} decoded equal to what was sent")
        else:
            all_ok = False
            why = ex.error or (
                "nothing arrived" if not ex.received else "differs from what was sent"
            )
            print(f"  FAILED: {name}: {why}")
    for err in transcript.errors:
        print(f"error: {err}")
    print()
    print(
        "Next: the data channel (DMB ring with the 32-byte SMC-D CDC header, shared via memfd) "
        "arrives with the handoff issue."
    )
    print("demo: " + ("all CLC messages round-tripped" if all_ok else "FAILED"))
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
