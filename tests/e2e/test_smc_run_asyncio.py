"""``smc-run`` upgrades unmodified asyncio programs: an asyncio streams pair, a program's own
``asyncio.Protocol`` with flow control, and uvicorn serving an ASGI app to an aiohttp keep-alive
client (both from PyPI, as real programs the project did not write), all on mode ``smcd`` (seen
in ``smcctl conns`` and ``smc-run -v``) with every byte checked; a peer's abort and close as on
TCP; backpressure waits for the peer's signal, not a timer."""

from __future__ import annotations

import hashlib
import os
import random
import re
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.asyncio_programs import (
    AIOHTTP_CLIENT,
    ASGI_APP,
    SOCK_METHODS,
    STARTTLS,
    STREAMS,
    TLS_PAIR,
    TRIO,
    UVLOOP,
)
from tests.e2e.conftest import PYTHON, REPO_ENV, SMC_RUN, Smcd

pytestmark = pytest.mark.timeout(120)


def _line(proc: subprocess.Popen[str], pattern: str, timeout: float = 30.0) -> re.Match[str]:
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        found = re.search(pattern, line)
        if found:
            return found
    err = proc.stderr.read() if proc.stderr and proc.poll() is not None else ""
    raise AssertionError(f"no line matching {pattern!r}; stderr: {err}")


class Programs:
    """Starts programs under ``smc-run -v`` (or plainly: ``tcp``) and cleans up after them."""

    def __init__(self, smcd: Smcd, tmp_path: Path) -> None:
        self.smcd = smcd
        self.env = {
            **REPO_ENV,
            "SMCD_HANDOFF_SOCKET": os.fspath(smcd.handoff),
            "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": f"{tmp_path}:{REPO_ENV['PYTHONPATH']}",
        }
        self.procs: list[subprocess.Popen[str]] = []

    def start(self, argv: list[str], smc: bool = True) -> subprocess.Popen[str]:
        prefix = [os.fspath(SMC_RUN), "-v"] if smc else []
        proc = subprocess.Popen(
            [*prefix, *argv],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=self.env,
        )  # fmt: skip
        self.procs.append(proc)
        return proc

    def streams(self, role: str, mode: str, *args: Any, smc: bool = True) -> subprocess.Popen[str]:
        return self.start([os.fspath(PYTHON), "-c", STREAMS, role, mode, *map(str, args)], smc)

    def stop(self) -> list[str]:
        errs = []
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            _, err = proc.communicate()
            errs.append(err)
        return errs


@pytest.fixture
def programs(smcd: Smcd, tmp_path: Path) -> Any:
    p = Programs(smcd, tmp_path)
    yield p
    p.stop()


def _go(proc: subprocess.Popen[str]) -> None:
    assert proc.stdin is not None
    proc.stdin.write("go\n")
    proc.stdin.flush()


def _both_smcd(port: int) -> Any:
    def check(rows: list[dict[str, Any]]) -> bool:
        ours = [r for r in rows if port in (r["LocalPort"], r["PeerPort"])]
        return sorted(r["Role"] for r in ours if r["Mode"] == "SMCD") == ["CLIENT", "SERVER"]

    return check


def _expected(n: int) -> str:
    rng = random.Random(7)
    h = hashlib.sha256()
    sent = 0
    while sent < n:
        chunk = rng.randbytes(min(65536, n - sent))
        h.update(chunk)
        sent += len(chunk)
    return h.hexdigest()


@pytest.mark.parametrize("mode", ["bulk", "stall"])
def test_protocol_and_streams_pair_on_smcd(programs: Programs, smcd: Smcd, mode: str) -> None:
    """A program's own asyncio.Protocol client (loop.create_connection) against an asyncio
    streams server (start_server), 8 MiB: on SMC-D both sides, intact, flow control as
    asyncio's. ``stall``: the server reads nothing for 1.5 s; meanwhile the client's transport
    waits for the peer's space signal without a single timed retry."""
    n = 8 << 20
    server = programs.streams("server", mode)
    port = int(_line(server, r"port (\d+)").group(1))
    client = programs.streams("client", mode, port, n)
    connected = _line(client, r"connected (\w+) nodelay (\d+)")
    # TCP_NODELAY as asyncio sets it on a TCP connection's socket
    assert connected.groups() == ("SmcTransport", "1"), connected.group(0)
    smcd.wait_conns(_both_smcd(port))
    _go(client)
    if mode == "stall":
        stall = _line(client, r"stall \((-?\d+), (-?\d+)\) \((-?\d+), (-?\d+)\) (\d+)")
        waits0, wakes0, waits1, wakes1, buffered = map(int, stall.groups())
        assert waits0 >= 1 and (waits1, wakes1) == (waits0, wakes0), stall.group(0)
        assert buffered > 0, stall.group(0)
    sent = _line(client, r"sent (\d+) (\w+) paused (\d+) resumed (\d+) wakeups (\d+)")
    assert int(sent.group(1)) == n and sent.group(2) == _expected(n), sent.group(0)
    paused, resumed = int(sent.group(3)), int(sent.group(4))
    if mode == "stall":
        assert paused >= 1 and resumed == paused, sent.group(0)
    reply = _line(client, r"reply (\d+) (\w+)")
    assert reply.groups() == (str(n), _expected(n)), reply.group(0)
    assert client.wait(20) == 0
    server_err, client_err = programs.stop()
    assert re.search(r"listen .*: registered as listener", server_err), server_err
    assert re.search(r"accept .*: smcd conn \d+", server_err), server_err
    assert re.search(rf"connect .*{port}.*: smcd conn \d+", client_err), client_err


@pytest.mark.parametrize("smc", [True, False], ids=["smcd", "tcp"])
@pytest.mark.parametrize("mode", ["abort", "close"])
def test_peer_abort_and_close_as_on_tcp(programs: Programs, mode: str, smc: bool) -> None:
    """The server reads one line and aborts with data unread (the client's read raises
    ConnectionResetError) or closes cleanly (the client reads the rest, then EOF): the same
    outcome on SMC-D as on TCP."""
    server = programs.streams("server", mode, smc=smc)
    port = int(_line(server, r"port (\d+)").group(1))
    client = programs.streams("client", mode, port, 0, smc=smc)
    _line(client, "connected")
    want = "partial" if mode == "abort" else "bye"
    assert _line(client, r"got (\w+)").group(1) == want
    end = _line(client, r"(eof \d+|error \w+)").group(1)
    assert end == ("error ConnectionResetError" if mode == "abort" else "eof 0"), end
    assert client.wait(20) == 0
    server_err, client_err = programs.stop()
    if smc:
        assert re.search(r"accept .*: smcd", server_err), server_err
        assert re.search(r"connect .*: smcd", client_err), client_err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("http", ["h11", "httptools"])
def test_uvicorn_and_aiohttp_keep_alive_on_smcd(
    programs: Programs, smcd: Smcd, tmp_path: Path, http: str
) -> None:
    """uvicorn serving an ASGI app (with each of its HTTP protocols), an aiohttp client making
    300 keep-alive requests of 64 KiB on one connection: both unmodified under smc-run, on
    SMC-D, every body intact. ``--loop asyncio``: with uvloop installed, uvicorn's default
    loop is uvloop's, which stays on TCP (test_uvloop_runs_on_tcp_and_says_why)."""
    (tmp_path / "asgi_app.py").write_text(ASGI_APP)
    port = _free_port()
    server = programs.start(
        [os.fspath(PYTHON), "-m", "uvicorn", "asgi_app:app", "--port", str(port),
         "--app-dir", os.fspath(tmp_path), "--no-access-log", "--http", http,
         "--loop", "asyncio"]
    )  # fmt: skip
    deadline = time.monotonic() + 30
    while True:  # uvicorn logs readiness on stderr; its port answering is enough here
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            break
        except OSError:
            assert server.poll() is None and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.1)
    client = programs.start(
        [os.fspath(PYTHON), "-c", AIOHTTP_CLIENT, str(port), "300", "65536", "wait"]
    )
    assert _line(client, r"started (\d+)").group(1) == "200"
    smcd.wait_conns(_both_smcd(port))
    _go(client)
    done = _line(client, r"done (\d+) bad (\d+)")
    assert done.groups() == ("300", "0"), done.group(0)
    assert client.wait(20) == 0
    server_err, client_err = programs.stop()
    assert re.search(rf"listen .*{port}.*: registered as listener", server_err), server_err
    assert re.search(r"accept .*: smcd conn \d+", server_err), server_err
    assert re.search(rf"connect .*{port}.*: smcd conn \d+", client_err), client_err


def test_loop_sock_methods_on_smcd(programs: Programs) -> None:
    """A program's own non-blocking sockets through loop.sock_accept/sock_connect/sock_sendall/
    sock_recv(_into): upgraded both sides, 8 MiB intact both ways through the ring."""
    n = 8 << 20
    server = programs.start([os.fspath(PYTHON), "-c", SOCK_METHODS, "server"])
    port = int(_line(server, r"port (\d+)").group(1))
    client = programs.start([os.fspath(PYTHON), "-c", SOCK_METHODS, "client", str(port), str(n)])
    sent = _line(client, r"sent (\d+) (\w+)")
    reply = _line(client, r"reply (\d+) (\w+)")
    assert reply.groups() == sent.groups(), (sent.group(0), reply.group(0))
    assert client.wait(20) == 0
    server_err, client_err = programs.stop()
    assert re.search(r"accept .*: smcd conn \d+", server_err), server_err
    assert re.search(rf"connect .*{port}.*: smcd conn \d+", client_err), client_err


BURST = 100
"""Connections one loop opens at once to its own server: past the handoff threads (32)."""

SELF_BURST = r"""
import asyncio, sys

async def main(n):
    async def echo(reader, writer):
        writer.write((await reader.readexactly(5)).upper())
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(echo, "127.0.0.1", 0, backlog=1024)
    port = server.sockets[0].getsockname()[1]

    async def one(i):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"hi%03d" % i)
        assert await reader.readexactly(5) == b"HI%03d" % i
        writer.close()

    await asyncio.gather(*(one(i) for i in range(n)))
    print("burst ok", flush=True)

asyncio.run(main(int(sys.argv[1])))
"""


def test_a_burst_of_connections_to_a_server_of_the_same_loop_is_on_smcd(
    programs: Programs,
) -> None:
    """A client half's handoff waits for its server half, a server half's for its client's
    Proposal. In one pool of handoff threads, a burst of connections past its size to a
    server of the same process filled every thread with halves waiting for halves queued
    behind them, until the server halves gave up (``timeouts.local_client_wait``): of 100
    connections, most fell back to TCP. Each side now has its own threads."""
    proc = programs.start([os.fspath(PYTHON), "-c", SELF_BURST, str(BURST)])
    assert proc.wait(60) == 0
    (err,) = programs.stop()
    ends = re.findall(r"smc-run\[\d+\]: (connect|accept) .*?: (\w+)", err)
    assert len(ends) == 2 * BURST, err[-3000:]
    assert {mode for _, mode in ends} == {"smcd"}, err[-3000:]


def _test_cert(tmp_path: Path) -> tuple[Path, Path]:
    """A self-signed certificate for localhost (with that name as its SAN) and its key."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost",
         "-keyout", os.fspath(key), "-out", os.fspath(cert)],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    return cert, key


def test_tls_runs_over_the_channel(programs: Programs, tmp_path: Path) -> None:
    """asyncio's ssl= (server and client) is handed off as any connection: the listener is
    registered, the connection is on smcd and asyncio's TLS protocol runs over the channel
    (it stayed on TCP, not handed off, before TLS could run over SMC); a plain server in the
    same program is upgraded as before."""
    cert, key = _test_cert(tmp_path)
    proc = programs.start([os.fspath(PYTHON), "-c", TLS_PAIR, os.fspath(cert), os.fspath(key)])
    tls_port, plain_port = map(int, _line(proc, r"ports (\d+) (\d+)").groups())
    assert _line(proc, r"echo (.*)").group(1) == f"over {tls_port} smcd TLSv1.3"
    assert _line(proc, r"echo (.*)").group(1) == f"over {plain_port} smcd plain"
    assert proc.wait(20) == 0
    (err,) = programs.stop()
    for port in (tls_port, plain_port):
        assert re.search(rf"listen .*{port}.*: registered as listener", err), err
        assert re.search(rf"connect .*{port}.*: smcd conn \d+", err), err


def test_starttls_runs_tls_over_the_channel(programs: Programs, tmp_path: Path) -> None:
    """asyncio's start_tls() (STARTTLS after a plaintext exchange) layers its TLS protocol over
    the transport; on an SMC connection it raised TypeError (the transport was not marked
    start_tls-compatible) where TCP works. Now TLS runs over the channel itself: the
    connection beneath the TLS transport is still on smcd, and every byte arrives."""
    cert, key = _test_cert(tmp_path)
    proc = programs.start([os.fspath(PYTHON), "-c", STARTTLS, os.fspath(cert), os.fspath(key)])
    for _ in range(3):
        assert _line(proc, r"got \d+ .*").group(0) == "got 30001 TLSv1.3 smcd"
    assert proc.wait(20) == 0
    (err,) = programs.stop()
    assert len(re.findall(r"connect .*: smcd conn \d+", err)) == 3, err
    assert "DETACHED" not in err, err


def test_uvloop_runs_on_tcp_and_says_why(programs: Programs) -> None:
    """A program that runs uvloop (its transports are libuv's, beyond smc-run's reach) keeps
    working under smc-run with a daemon running: its connections stay on TCP, and -v names
    uvloop as the reason for the listener and the connection."""
    proc = programs.start([os.fspath(PYTHON), "-c", UVLOOP])
    echo = _line(proc, r"echo over (\d+) (\w+)")
    assert echo.group(2) == "uvloop", echo.group(0)
    assert proc.wait(20) == 0
    (err,) = programs.stop()
    port = echo.group(1)
    reason = r"tcp \(uvloop: its transports are libuv's own"
    assert re.search(rf"listen .*{port}.*: {reason}", err), err
    assert re.search(rf"connect .*{port}.*: {reason}", err), err
    assert not re.search(r": smcd", err), err


BLOCKING_CLIENT = r"""
import socket, sys, threading
port, n = int(sys.argv[1]), int(sys.argv[2])
intact = 0
for i in range(n):
    sock = socket.create_connection(("127.0.0.1", port))
    data = bytes((j * 3 + i) % 256 for j in range(200_000 * (i + 1)))
    sender = threading.Thread(target=lambda: (sock.sendall(data), sock.shutdown(socket.SHUT_WR)))
    sender.start()
    got = bytearray()
    while chunk := sock.recv(65536):
        got += chunk
    sender.join()
    sock.close()
    intact += bytes(got) == data
print("intact", intact, "of", n, flush=True)
"""

BLOCKING_SERVER = r"""
import socket, threading
lsock = socket.create_server(("127.0.0.1", 0))
print("port", lsock.getsockname()[1], flush=True)
def serve(conn):
    while data := conn.recv(65536):
        conn.sendall(data)
    conn.close()
while True:
    threading.Thread(target=serve, args=(lsock.accept()[0],)).start()
"""


def _ends(err: str, op: str) -> list[str]:
    """The mode smc-run -v gave each ``op`` (connect/accept) end: smcd, or tcp."""
    return re.findall(rf"{op} .*: (smcd|tcp)", err)


def test_trio_runs_over_smcd(programs: Programs) -> None:
    """trio (PyPI; its own epoll loop over non-blocking stdlib sockets) under smc-run: its
    listener is registered when it listens, each accepted connection and each connect is
    handed off while the loop goes on (the task waits for smcd's answer), and the data then
    moves through trio's own send/recv on the channel: a server and 4 clients that write
    while they read (up to 1 MB each way) all on smcd, every byte intact. Before, trio's
    listener stayed unregistered and its non-blocking connects on TCP (and its accept failed
    on every connection while smc-run's accept made another class than socket.socket)."""
    proc = programs.start([os.fspath(PYTHON), "-c", TRIO, "both", "4"])
    done = _line(proc, r"port (\d+) intact (\d+) of (\d+)", timeout=60)
    assert done.group(2) == done.group(3) == "4", done.group(0)
    assert proc.wait(20) == 0
    (err,) = programs.stop()
    assert re.search(rf"listen .*{done.group(1)}\): registered as listener", err), err
    assert _ends(err, "accept") == ["smcd"] * 4 and _ends(err, "connect") == ["smcd"] * 4, err


def test_a_trio_program_connecting_to_itself_in_a_burst_gets_smcd(programs: Programs) -> None:
    """100 connects at once to a server of the same trio program: every end on smcd. A client
    half waits in smcd for its server half; when the handoffs waited in trio's worker threads
    (40 at most), the client halves took them all, the server halves could not start, and
    most connections fell back after ``timeouts.clc_wait`` (6 s)."""
    proc = programs.start([os.fspath(PYTHON), "-c", TRIO, "burst", "100"])
    done = _line(proc, r"port (\d+) intact (\d+) of (\d+)", timeout=60)
    assert done.group(2) == done.group(3) == "100", done.group(0)
    assert proc.wait(20) == 0
    (err,) = programs.stop()
    assert _ends(err, "accept") == ["smcd"] * 100, err[-3000:]
    assert _ends(err, "connect") == ["smcd"] * 100, err[-3000:]


def test_trio_connects_cancelled_midway_leave_the_loop_working(programs: Programs) -> None:
    """trio connects cancelled at any point (during the TCP connect, trio closes the socket
    still registered in its epoll for writing; during the handoff, waiting for smcd):
    the program goes on and its next connection works. The descriptor number of a closed
    socket that was registered for writing came back as an SMC connection's ``fileno()``,
    and smc-run's epoll, still counting the old registration, failed trio's loop with
    ``FileNotFoundError`` (epoll_ctl MOD of a descriptor the kernel had dropped) in about one
    run of this test in three; ``tests/handoff/test_readiness.py`` has that case every time.
    (150 connects: ``-v``'s lines stay well within the stderr pipe the harness reads at the end.)"""
    proc = programs.start([os.fspath(PYTHON), "-c", TRIO, "cancel", "150"])
    done = _line(proc, r"cancelled (\d+) of 150 then (\w+)", timeout=90)
    assert done.group(2) == "ok" and int(done.group(1)) > 0, done.group(0)
    assert proc.wait(20) == 0
    (err,) = programs.stop()
    assert "Traceback" not in err, err[-3000:]


def test_trio_and_blocking_programs_meet_on_smcd(programs: Programs) -> None:
    """A trio server and a blocking stdlib client, then a trio client and a blocking
    threaded server, each in its own process under smc-run: every connection on smcd, every
    byte of the echoes intact (a writer and a reader at once on each side)."""
    server = programs.start([os.fspath(PYTHON), "-c", TRIO, "server"])
    port = _line(server, r"port (\d+)").group(1)
    client = programs.start([os.fspath(PYTHON), "-c", BLOCKING_CLIENT, port, "3"])
    assert _line(client, r"intact (\d+) of 3", timeout=60).group(1) == "3"
    assert client.wait(20) == 0
    threaded = programs.start([os.fspath(PYTHON), "-c", BLOCKING_SERVER])
    port2 = _line(threaded, r"port (\d+)").group(1)
    trio_client = programs.start([os.fspath(PYTHON), "-c", TRIO, "client", port2, "3"])
    assert _line(trio_client, r"intact (\d+) of (\d+)", timeout=60).groups() == ("3", "3")
    assert trio_client.wait(20) == 0
    trio_err, client_err, threaded_err, trio_client_err = programs.stop()
    assert _ends(trio_err, "accept") == ["smcd"] * 3, trio_err
    assert _ends(client_err, "connect") == ["smcd"] * 3, client_err
    assert _ends(threaded_err, "accept") == ["smcd"] * 3, threaded_err
    assert _ends(trio_client_err, "connect") == ["smcd"] * 3, trio_client_err


def test_no_daemon_tcp_with_the_reason(programs: Programs, tmp_path: Path) -> None:
    """Without a daemon the asyncio programs run on TCP as they are, and smc-run -v says so for
    the listener and each connection, with the fallback reason, as for blocking sockets."""
    programs.env["SMCD_HANDOFF_SOCKET"] = os.fspath(tmp_path / "absent.sock")
    server = programs.streams("server", "close")
    port = int(_line(server, r"port (\d+)").group(1))
    client = programs.streams("client", "close", port, 0)
    assert _line(client, r"got (\w+)").group(1) == "bye"
    assert _line(client, r"(eof \d+|error \w+)").group(1) == "eof 0"
    assert client.wait(20) == 0
    server_err, client_err = programs.stop()
    reason = r"tcp \(DAEMON_UNAVAILABLE .*absent\.sock"
    assert re.search(rf"listen .*{port}.*: {reason}", server_err), server_err
    assert re.search(rf"accept .*: {reason}", server_err), server_err
    assert re.search(rf"connect .*{port}.*: {reason}", client_err), client_err
