"""A late CLC Proposal on an asyncio server half that stayed on TCP (#14): the library answers it
with a Decline on the first read, as it does for blocking sockets, without blocking the event
loop. Real processes: an unmodified asyncio echo server under ``smc-run`` with no daemon (its
listener falls back, so every accepted connection is a guarded TCP server half), reading with
streams, a ``BufferedProtocol`` or ``loop.sock_recv``, or one using ``smc_handoff.aio``'s
``start_server`` itself; the client is a plain socket here that
writes what a proposing daemon would. The server's loop measures its own worst lag: a check that
waited on the loop for the rest of a Proposal would show it."""

from __future__ import annotations

import os
import random
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from smcd_daemon.wire.clc import Decline, decode
from smcd_daemon.wire.reasons import DeclineReason
from tests.handoff.test_late_proposal import _proposal

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[2]

SERVER = r'''
"""An asyncio echo server: prints what each connection read, how it ended, the loop's worst lag."""
import asyncio, os, socket, sys, time

mode = sys.argv[1]
if os.environ.get("LATE_CLC_WAIT"):  # a shorter bound than the library's, for the test's sake
    from smc_handoff import handoff
    handoff._LATE_CLC_WAIT = float(os.environ["LATE_CLC_WAIT"])
lag = 0.0

async def monitor():
    global lag
    while True:
        t = time.monotonic()
        await asyncio.sleep(0.005)
        lag = max(lag, time.monotonic() - t - 0.005)

def report(got, end):  # a moment later: the lag of a loop that was blocked until now counts
    data = bytes(got).hex() or "-"
    asyncio.get_running_loop().call_later(0.05, lambda: print(
        "read", data, "end", end, "lag_ms", round(lag * 1e3), flush=True))

async def handle(reader, writer):
    got, end = bytearray(), "eof"
    try:
        while data := await reader.read(65536):
            got += data
            writer.write(data)
            await writer.drain()
    except OSError as e:
        end = type(e).__name__
    report(got, end)
    writer.close()

class Echo(asyncio.BufferedProtocol):
    def __init__(self):
        self.got, self.buf = bytearray(), bytearray(65536)
    def connection_made(self, transport):
        self.transport = transport
    def get_buffer(self, hint):
        return self.buf
    def buffer_updated(self, n):
        self.got += self.buf[:n]
        self.transport.write(bytes(self.buf[:n]))
    def eof_received(self):
        return False
    def connection_lost(self, exc):
        report(self.got, "eof" if exc is None else type(exc).__name__)

async def sock_echo(conn):
    loop = asyncio.get_running_loop()
    got, end = bytearray(), "eof"
    try:
        while data := await loop.sock_recv(conn, 65536):
            got += data
            await loop.sock_sendall(conn, data)
    except OSError as e:
        end = type(e).__name__
    report(got, end)
    conn.close()

async def sock_server(lsock):
    loop = asyncio.get_running_loop()
    while True:
        conn, _ = await loop.sock_accept(lsock)
        conn.setblocking(False)
        asyncio.create_task(sock_echo(conn))

async def main():
    asyncio.create_task(monitor())
    loop = asyncio.get_running_loop()
    if mode == "streams":
        srv = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = srv.sockets[0].getsockname()[1]
    elif mode == "buffered":
        srv = await loop.create_server(Echo, "127.0.0.1", 0)
        port = srv.sockets[0].getsockname()[1]
    elif mode == "aio":  # the library's own asyncio API, without smc-run: it reports like -v
        from smc_handoff import aio

        async def handle_aio(reader, writer):
            sock = aio.smc_socket(writer)
            print(f"accept {writer.get_extra_info('peername')}: {sock.mode} ({sock.fallback})",
                  file=sys.stderr, flush=True)
            await handle(reader, writer)

        srv = await aio.start_server(handle_aio, "127.0.0.1", 0)
        port = srv.sockets[0].getsockname()[1]
        print(f"listen {port}: tcp ({srv.fallback})", file=sys.stderr, flush=True)
    else:
        lsock = socket.socket()
        lsock.bind(("127.0.0.1", 0))
        lsock.listen()
        lsock.setblocking(False)
        port = lsock.getsockname()[1]
        asyncio.create_task(sock_server(lsock))
    print("port", port, flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
'''

MODES = ["streams", "buffered", "sock", "aio"]


class Server:
    def __init__(self, proc: subprocess.Popen[str], port: int) -> None:
        self.proc, self.port = proc, port

    def connect(self) -> socket.socket:
        """A connection the server has accepted (handed off, or rather not: ``smc-run -v``
        says so): what arrives now is late. Bytes queued before the accept are another case,
        reset at once (:func:`smc_handoff.socket.accepted`)."""
        c = socket.create_connection(("127.0.0.1", self.port), timeout=10)
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # each write its own segment
        assert self.proc.stderr is not None
        line = self.proc.stderr.readline()
        assert re.search(r"accept .*: tcp \(DAEMON_UNAVAILABLE", line), line
        return c

    def outcome(self) -> tuple[bytes, str, int]:
        """What the application read on the next connection to end, how it ended, its lag."""
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        found = re.fullmatch(r"read (\S+) end (\w+) lag_ms (\d+)\n", line)
        assert found, (line, self.proc.poll())
        data = b"" if found.group(1) == "-" else bytes.fromhex(found.group(1))
        return data, found.group(2), int(found.group(3))


@pytest.fixture(params=MODES)
def server(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Server]:
    env = {
        **os.environ,
        "SMCD_HANDOFF_SOCKET": os.fspath(tmp_path / "absent.sock"),  # the listener falls back
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.fspath(REPO),
        "LATE_CLC_WAIT": "1.0",
    }
    smc_run = [] if request.param == "aio" else ["-m", "smc_handoff.run", "-v"]
    proc = subprocess.Popen(
        [sys.executable, *smc_run, "-c", SERVER, request.param],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO,
    )  # fmt: skip
    assert proc.stdout is not None
    found = re.search(r"port (\d+)", proc.stdout.readline())
    assert found, proc.stderr.read() if proc.stderr else ""
    assert proc.stderr is not None
    listen = proc.stderr.readline()  # the listener fell back: its connections are guarded
    assert re.search(r"listen .*: tcp \(DAEMON_UNAVAILABLE", listen), listen
    yield Server(proc, int(found.group(1)))
    proc.kill()
    _, err = proc.communicate()
    assert "Traceback" not in err, err


def _echo(c: socket.socket, data: bytes) -> float:
    """Send ``data``, read its echo whole; the seconds it took."""
    t = time.monotonic()
    c.sendall(data)
    got = bytearray()
    while len(got) < len(data):
        chunk = c.recv(1 << 16)
        assert chunk, "EOF before the echo"
        got += chunk
    assert got == data
    return time.monotonic() - t


def test_a_late_proposal_in_pieces_is_declined_and_the_loop_never_waits(server: Server) -> None:
    c = server.connect()
    proposal = _proposal()
    c.sendall(proposal[:3])  # part of the eyecatcher
    time.sleep(0.3)
    c.sendall(proposal[3:10])  # the header, part of the body
    time.sleep(0.3)
    c.sendall(proposal[10:])
    answer = decode(c.recv(100))
    assert isinstance(answer, Decline) and answer.diagnosis == DeclineReason.NOSMCDEV
    _echo(c, b"the client's own bytes")
    c.close()
    data, end, lag_ms = server.outcome()
    assert (data, end) == (b"the client's own bytes", "eof")
    assert lag_ms < 150, f"the loop stalled {lag_ms} ms"


def test_plain_data_passes_byte_exact_at_once(server: Server) -> None:
    """A plain client: its first bytes (no eyecatcher, or an eyecatcher's first two bytes and
    then others) reach the application at once and intact, and so does all that follows,
    eyecatchers included."""
    rng = random.Random(5)
    sent = bytearray()
    for first in (b"GET / HTTP/1.1\r\n", b"\xe2\xd4not clc"):
        c = server.connect()
        first_rtt = _echo(c, first)
        rest = rng.randbytes(300_000) + b"\xe2\xd4\xc3\xd9\x01\x00\x2c\x20" + rng.randbytes(999)
        _echo(c, rest)
        c.close()
        data, end, lag_ms = server.outcome()
        assert data == first + rest and end == "eof"
        assert first_rtt < 0.25, f"the first read waited {first_rtt * 1e3:.0f} ms"
        assert lag_ms < 150, f"the loop stalled {lag_ms} ms"
        sent += first


def _reset_seen(c: socket.socket) -> bool:
    try:
        return c.recv(100) == b"" and False
    except ConnectionResetError:
        return True


def test_a_cut_off_clc_header_resets_after_the_bound(server: Server) -> None:
    """The head of a CLC message and then silence: the connection is reset when the bound
    (1 s here) runs out, by a timer on the loop, the application's read gets
    ConnectionResetError (never the bytes) and the loop never waited."""
    c = server.connect()
    t = time.monotonic()
    c.sendall(b"\xe2\xd4\xc3")
    assert _reset_seen(c)
    waited = time.monotonic() - t
    data, end, lag_ms = server.outcome()
    assert (data, end) == (b"", "ConnectionResetError")
    assert 0.9 < waited < 5, waited
    assert lag_ms < 150, f"the loop stalled {lag_ms} ms"
    c.close()


def test_a_clc_header_cut_off_by_the_peers_fin_resets_at_once(server: Server) -> None:
    c = server.connect()
    proposal = _proposal()
    c.sendall(proposal[:12])
    time.sleep(0.1)
    t = time.monotonic()
    c.shutdown(socket.SHUT_WR)
    assert _reset_seen(c)
    assert time.monotonic() - t < 0.5
    data, end, _lag = server.outcome()
    assert (data, end) == (b"", "ConnectionResetError")
    c.close()
