"""TLS over SMC: ``ssl`` wrapping a connection on SMC keeps it there (smc_handoff.tls).

Unmodified programs under ``smc-run`` against a private smcd with no configuration, each also
run on plain TCP (the oracle: the same output). The server reports its TCP socket's byte
counters (``TCP_INFO``): over SMC the TCP stream carries the CLC handshake only, so a TLS
handshake (a certificate: well over 500 bytes) that went on TCP would show there.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from smcd_daemon.demo import PrivateSmcd
from tests.e2e.test_fast_default import (
    PYTHON,
    STARTTLS_CLIENT,
    _env,
    _modes,
    _serve_then_run,
    _smc_run,
    _started,
    _test_cert,
)

pytestmark = pytest.mark.timeout(180)

COUNTERS = r"""
import socket, struct
def tcp_bytes(sock):
    info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 136)
    acked, received = struct.unpack_from("QQ", info, 120)  # tcpi_bytes_acked, _received
    return acked + received
"""

TLS_SERVER = (
    COUNTERS
    + r"""
import ssl, sys
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
ctx.load_cert_chain(sys.argv[1], sys.argv[2])
lsock = socket.create_server(("127.0.0.1", 0))
print("PORT", lsock.getsockname()[1], flush=True)
for _ in range(2):
    conn, _ = lsock.accept()
    with ctx.wrap_socket(conn, server_side=True) as tls:
        f = tls.makefile("rb")
        line = f.readline()
        tls.sendall(line.upper() + b"x" * 200000 + b"\n")
        assert f.readline() == b"BYE\n"
        assert f.read() == b""  # the client closes first (its close_notify, if any, then EOF)
        f.close()
        print(tls.version(), tls.cipher()[1], tcp_bytes(tls), flush=True)
"""
)

TLS_CLIENT = r"""
import socket, ssl, sys
ctx = ssl.create_default_context(cafile=sys.argv[2])
ctx.check_hostname = False
for i in range(2):
    with socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=20) as raw:
        with ctx.wrap_socket(raw) as tls:
            tls.sendall(b"hello %d\n" % i)
            f = tls.makefile("rb")
            first = f.readline()
            rest = f.readline()
            f.close()
            tls.sendall(b"BYE\n")
            print(first.decode().strip(), len(rest), tls.version(), flush=True)
"""


@pytest.fixture(scope="module")
def nocfg() -> Iterator[PrivateSmcd]:
    with _started("", "tlsover") as daemon:
        yield daemon


def _tcp(daemon: PrivateSmcd, server: str, client: str, *args: object) -> tuple[str, str]:
    """The pair on plain TCP: client and server stdout."""
    env = _env(daemon)
    plain = [os.fspath(PYTHON), "-c"]
    proc = subprocess.Popen([*plain, server, *map(str, args)], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    try:
        assert proc.stdout is not None
        port = proc.stdout.readline().split()[1]
        done = subprocess.run([*plain, client, port, *map(str, args[:1])], env=env, text=True,
                              capture_output=True, timeout=60)  # fmt: skip
        sout, serr = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert done.returncode == 0 and proc.returncode == 0, (done.stderr, serr)
    return done.stdout, sout


def _ops(stderr: str) -> list[str]:
    """smc-run -v's lines after the prefix, the listener's left out."""
    ops = [ln.split(": ", 1)[1] for ln in stderr.splitlines() if ln.startswith("smc-run[")]
    return [op for op in ops if not op.startswith("listen ")]


def test_tls_runs_over_the_channel(nocfg: PrivateSmcd, tmp_path: Path) -> None:
    """A TLS server that wraps what it accepts and a client that wraps what it connects (as
    ``http.client``, ``smtplib``, ``urllib3`` do): the handshake and ~200 KB of records go over
    the channel, the TCP stream carries CLC only, ``smc-run -v`` says ``ssl ...: smcd`` for the
    connection it reported at connect and accept, and the programs print what they print on
    TCP."""
    cert, key = _test_cert(tmp_path)
    tcp_client, tcp_server = _tcp(nocfg, TLS_SERVER, TLS_CLIENT, cert, key)
    tcp_counts = [int(line.split()[2]) for line in tcp_server.splitlines()]
    assert all(n > 2000 for n in tcp_counts), tcp_server  # the oracle: TLS on TCP shows
    server = _smc_run(_env(nocfg), TLS_SERVER, cert, key)
    client, _, sout, serr = _serve_then_run(nocfg, server, TLS_CLIENT, cert)
    assert client.returncode == 0, client.stderr[-3000:]
    assert client.stdout == tcp_client, (client.stdout, tcp_client)
    assert client.stdout == "HELLO 0 200001 TLSv1.3\nHELLO 1 200001 TLSv1.3\n"
    assert [line.split()[:2] for line in sout.splitlines()] == [
        line.split()[:2] for line in tcp_server.splitlines()
    ], sout
    smc_counts = [int(line.split()[2]) for line in sout.splitlines()]
    assert all(n < 500 for n in smc_counts), sout  # CLC only: no TLS byte on TCP
    for side, err in (("connect", client.stderr), ("accept", serr)):
        ops = _ops(err)
        assert [op.split(" ", 1)[0] for op in ops] == [side, "ssl"] * 2, err
        for opened, tls in zip(ops[0::2], ops[1::2], strict=True):
            conn = opened.split(": ", 1)[1]
            assert conn.startswith("smcd conn ") and tls.split(": ", 1)[1] == conn, err


def test_starttls_runs_over_the_channel(nocfg: PrivateSmcd, tmp_path: Path) -> None:
    """STARTTLS (SMTP, IMAP, POP3, LDAP): a plaintext exchange, then ``wrap_socket`` at both
    ends; TLS goes on over the same channel from that point (it used to need both ends to
    leave the channel together, with nothing unread, and then ran on TCP)."""
    from tests.e2e.test_fast_default import STARTTLS_SERVER

    cert, key = _test_cert(tmp_path)
    server = _smc_run(_env(nocfg), STARTTLS_SERVER, cert, key)
    client, _, _, serr = _serve_then_run(nocfg, server, STARTTLS_CLIENT, cert)
    assert client.returncode == 0, client.stderr[-3000:]
    assert client.stdout.split("\n")[:3] == ["100001 TLSv1.3"] * 3, client.stdout
    for side, err in (("connect", client.stderr), ("accept", serr)):
        ops = _ops(err)
        assert [op.split(" ", 1)[0] for op in ops] == [side, "ssl"] * 3, err
        assert all(": smcd conn " in op for op in ops), err


ASYNC_STARTTLS_SERVER = r"""
import asyncio, ssl, sys
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
ctx.load_cert_chain(sys.argv[1], sys.argv[2])
done = 0
async def serve(reader, writer):
    global done
    writer.write(b"220 ready\r\n")
    assert await reader.readline() == b"EHLO me\r\n"
    writer.write(b"250-hello\r\n250 STARTTLS\r\n")
    assert await reader.readline() == b"STARTTLS\r\n"
    writer.write(b"220 go ahead\r\n")
    await writer.drain()
    await writer.start_tls(ctx)
    data = await reader.readline()
    version = writer.get_extra_info("ssl_object").version()
    writer.write(b"%d %s\n" % (len(data), version.encode()))
    await writer.drain()
    writer.close()
    done += 1
async def main():
    server = await asyncio.start_server(serve, "127.0.0.1", 0, limit=1 << 20)
    print("PORT", server.sockets[0].getsockname()[1], flush=True)
    while done < 3:
        await asyncio.sleep(0.01)
asyncio.run(main())
"""


def test_starttls_between_a_blocking_client_and_an_asyncio_server(
    nocfg: PrivateSmcd, tmp_path: Path
) -> None:
    """asyncio's ``start_tls`` runs TLS over an SMC transport's channel; a blocking peer's
    ``wrap_socket`` now does too, so the two meet (before, the blocking end waited 2 s for its
    peer to leave the channel with it and failed with EOPNOTSUPP)."""
    cert, key = _test_cert(tmp_path)
    server = _smc_run(_env(nocfg), ASYNC_STARTTLS_SERVER, cert, key)
    client, _, _, serr = _serve_then_run(nocfg, server, STARTTLS_CLIENT, cert)
    assert client.returncode == 0, client.stderr[-3000:]
    assert client.stdout.split("\n")[:3] == ["100001 TLSv1.3"] * 3, client.stdout
    ops = _ops(client.stderr)
    assert [op.split(" ", 1)[0] for op in ops] == ["connect", "ssl"] * 3, client.stderr
    assert all(": smcd conn " in op for op in ops), client.stderr
    assert [m[:2] for m in _modes(serr)] == [("accept", "smcd")] * 3, serr


ACCEPT_ONE = (
    COUNTERS
    + r"""
import select, ssl, sys, time
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
ctx.load_cert_chain(sys.argv[1], sys.argv[2])
lsock = socket.create_server(("127.0.0.1", 0))
print("PORT", lsock.getsockname()[1], flush=True)
conn, _ = lsock.accept()
"""
)
"""The prologue of a TLS server of one connection (``conn``, accepted; ``ctx`` to wrap it)."""

NONBLOCKING_SERVER = (
    ACCEPT_ONE
    + r"""
tls = ctx.wrap_socket(conn, server_side=True, do_handshake_on_connect=False)
tls.setblocking(False)
def retry(op, *args):
    while True:
        try:
            return op(*args)
        except ssl.SSLWantReadError:
            select.select([tls], [], [], 10)
        except ssl.SSLWantWriteError:
            select.select([], [tls], [], 10)
wants = 0
retry(tls.do_handshake)
got = b""
while not got.endswith(b"\n"):
    try:
        got += tls.recv(65536)
    except ssl.SSLWantReadError:
        wants += 1
        select.select([tls], [], [], 10)
retry(tls.sendall, b"%d\n" % len(got))
plain = retry(tls.unwrap)  # close_notify both ways: the socket goes on in plaintext
plain.setblocking(True)
assert plain.recv(100) == b"plain again\n"
plain.sendall(b"ok\n")
print(len(got), wants > 0, tcp_bytes(plain), flush=True)
plain.close()
"""
)

NONBLOCKING_CLIENT = r"""
import socket, ssl, sys, time
ctx = ssl.create_default_context(cafile=sys.argv[2])
ctx.check_hostname = False
raw = socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=20)
tls = ctx.wrap_socket(raw)
tls.settimeout(0.2)  # the server's non-blocking recv finds nothing first; nor do we
try:
    tls.recv(10)
except TimeoutError as e:
    print("timed out", type(e).__name__, flush=True)
tls.settimeout(20)
tls.sendall(b"y" * 300000 + b"\n")
print(tls.recv(100).decode().strip(), flush=True)
plain = tls.unwrap()
plain.sendall(b"plain again\n")
print(plain.recv(100).decode().strip(), flush=True)
plain.close()
"""


def test_non_blocking_tls_and_unwrap_over_the_channel(nocfg: PrivateSmcd, tmp_path: Path) -> None:
    """A non-blocking ``SSLSocket`` on SMC behaves as on TCP (``SSLWantReadError`` while the
    peer's records are not there, ``select`` on it until they are), and ``unwrap()`` (both
    close_notify) leaves a plaintext connection going on over the same channel; a timeout on
    a read raises ``TimeoutError`` as on TCP."""
    cert, key = _test_cert(tmp_path)
    tcp_client, tcp_server = _tcp(nocfg, NONBLOCKING_SERVER, NONBLOCKING_CLIENT, cert, key)
    server = _smc_run(_env(nocfg), NONBLOCKING_SERVER, cert, key)
    client, _, sout, serr = _serve_then_run(nocfg, server, NONBLOCKING_CLIENT, cert)
    assert client.returncode == 0, client.stderr[-3000:]
    expected = "timed out TimeoutError\n300001\nok\n"
    assert client.stdout == tcp_client == expected, (client.stdout, tcp_client)
    assert sout.split()[:2] == tcp_server.split()[:2] == ["300001", "True"], (sout, tcp_server)
    assert int(sout.split()[2]) < 500 < int(tcp_server.split()[2]), (sout, tcp_server)
    assert [m[:2] for m in _modes(serr)] == [("accept", "smcd")], serr


ASYNC_TLS_CLIENT = r"""
import asyncio, ssl, sys
async def main():
    ctx = ssl.create_default_context(cafile=sys.argv[2])
    ctx.check_hostname = False
    for i in range(2):
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", int(sys.argv[1]), ssl=ctx, limit=1 << 20)
        writer.write(b"hello %d\n" % i)
        first = await reader.readline()
        rest = await reader.readline()
        writer.write(b"BYE\n")
        await writer.drain()
        version = writer.get_extra_info("ssl_object").version()
        print(first.decode().strip(), len(rest), version, flush=True)
        writer.close()
        await writer.wait_closed()
asyncio.run(main())
"""

ASYNC_TLS_SERVER = r"""
import asyncio, ssl, sys
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
ctx.load_cert_chain(sys.argv[1], sys.argv[2])
done = 0
async def serve(reader, writer):
    global done
    line = await reader.readline()
    writer.write(line.upper() + b"x" * 200000 + b"\n")
    assert await reader.readline() == b"BYE\n"
    smc = writer.get_extra_info("smc_socket")
    print(writer.get_extra_info("ssl_object").version(), smc.mode, flush=True)
    writer.close()
    done += 1
async def main():
    server = await asyncio.start_server(serve, "127.0.0.1", 0, ssl=ctx)
    print("PORT", server.sockets[0].getsockname()[1], flush=True)
    while done < 2:
        await asyncio.sleep(0.01)
asyncio.run(main())
"""


def test_asyncio_ssl_and_blocking_tls_meet_over_the_channel(
    nocfg: PrivateSmcd, tmp_path: Path
) -> None:
    """asyncio's ``ssl=`` is handed off as any connection and runs its TLS protocol over the
    channel, so an asyncio TLS client and a blocking TLS server (and the other way round) meet
    there, each end as it would over TCP."""
    cert, key = _test_cert(tmp_path)
    expected = "HELLO 0 200001 TLSv1.3\nHELLO 1 200001 TLSv1.3\n"
    server = _smc_run(_env(nocfg), TLS_SERVER, cert, key)
    client, _, sout, serr = _serve_then_run(nocfg, server, ASYNC_TLS_CLIENT, cert)
    assert client.returncode == 0, client.stderr[-3000:]
    assert client.stdout == expected, client.stdout
    assert all(int(line.split()[2]) < 500 for line in sout.splitlines()), sout
    assert [m[:2] for m in _modes(client.stderr)] == [("connect", "smcd")] * 2, client.stderr
    assert [m[:2] for m in _modes(serr)] == [("accept", "smcd")] * 2, serr
    server = _smc_run(_env(nocfg), ASYNC_TLS_SERVER, cert, key)
    client, _, sout, serr = _serve_then_run(nocfg, server, TLS_CLIENT, cert)
    assert client.returncode == 0, client.stderr[-3000:]
    assert client.stdout == expected, client.stdout
    assert sout == "TLSv1.3 smcd\n" * 2, sout
    assert [m[:2] for m in _modes(serr)] == [("accept", "smcd")] * 2, serr


EARLY_CLIENT = r"""
import socket, ssl, sys
from smc_handoff.socket import SmcSocket
print("early", not issubclass(ssl.SSLSocket, SmcSocket), flush=True)
""" + TLS_CLIENT.split("\n", 2)[2]


def test_ssl_imported_before_smc_run_runs_tls_over_the_channel_too(
    nocfg: PrivateSmcd, tmp_path: Path
) -> None:
    """A ``.pth`` file that imports ``ssl`` (``pip-system-certs`` and the like do) runs before
    smc-run installs itself, so ``ssl.SSLSocket`` derives from the plain socket class: the
    ``SSLSocket`` made for a connection on SMC is then of a class that derives from both, and
    TLS runs over the channel as in a process that imported ``ssl`` later (an end that left
    the channel while its peer stayed would break the connection)."""
    cert, key = _test_cert(tmp_path)
    site = tmp_path / "userbase" / "lib" / "python3.11" / "site-packages"
    site.mkdir(parents=True)
    (site / "early_ssl.pth").write_text("import ssl\n")
    server = _smc_run(_env(nocfg), TLS_SERVER, cert, key)
    userbase = f"PYTHONUSERBASE={tmp_path / 'userbase'}"
    client, _, sout, _ = _serve_then_run(
        nocfg, server, EARLY_CLIENT, cert, prefix=("env", userbase)
    )
    assert client.returncode == 0, client.stderr[-3000:]
    assert client.stdout == "early True\nHELLO 0 200001 TLSv1.3\nHELLO 1 200001 TLSv1.3\n"
    assert all(int(line.split()[2]) < 500 for line in sout.splitlines()), sout
    ops = _ops(client.stderr)
    assert [op.split(" ", 1)[0] for op in ops] == ["connect", "ssl"] * 2, client.stderr
    assert all(": smcd conn " in op for op in ops), client.stderr


HTTPS_SERVER = r"""
import http.server, ssl, sys
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
ctx.load_cert_chain(sys.argv[1], sys.argv[2])
class Hello(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_GET(self):
        body = b"hello over %s\n" % self.connection.version().encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
httpd = http.server.HTTPServer(("127.0.0.1", 0), Hello)
httpd.socket = ctx.wrap_socket(httpd.socket, server_side=True)  # the docs' recipe
print("PORT", httpd.server_address[1], flush=True)
for _ in range(3):
    httpd.handle_request()
"""

HTTPS_CLIENT = r"""
import http.client, socket, ssl, sys, urllib.request
port = int(sys.argv[1])
ctx = ssl.create_default_context(cafile=sys.argv[2])
ctx.check_hostname = False
with urllib.request.urlopen(f"https://127.0.0.1:{port}/", context=ctx) as r:
    print(r.status, r.read().decode().strip(), flush=True)
conn = http.client.HTTPSConnection("127.0.0.1", port, context=ctx)
conn.request("GET", "/")
print(conn.getresponse().read().decode().strip(), flush=True)
conn.close()
early = ctx.wrap_socket(socket.socket())  # wrapped before connect(), as old code does
early.connect(("127.0.0.1", port))
early.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
data = b""
while chunk := early.recv(4096):
    data += chunk
print(data.split(b"\r\n\r\n", 1)[1].decode().strip(), early.mode, flush=True)
early.close()
"""


def test_an_https_server_of_the_docs_recipe_and_its_clients_run_tls_over_smc(
    nocfg: PrivateSmcd, tmp_path: Path
) -> None:
    """``http.server`` with its listening socket wrapped by ``ssl`` (the documented recipe):
    the wrapped listener stays registered, so each connection its ``accept()`` takes is handed
    off and wrapped, TLS over its channel; ``urllib``, ``http.client`` and a socket wrapped
    before ``connect()`` are its clients."""
    cert, key = _test_cert(tmp_path)
    server = _smc_run(_env(nocfg), HTTPS_SERVER, cert, key)
    client, _, _, serr = _serve_then_run(nocfg, server, HTTPS_CLIENT, cert)
    assert client.returncode == 0, client.stderr[-3000:]
    assert client.stdout == (
        "200 hello over TLSv1.3\nhello over TLSv1.3\nhello over TLSv1.3 smcd\n"
    ), client.stdout
    assert [m[:2] for m in _modes(client.stderr)] == [("connect", "smcd")] * 3, client.stderr
    assert [m[:2] for m in _modes(serr)] == [("accept", "smcd")] * 3, serr
    assert "registered as listener" in serr, serr


REFUSING_SERVER = r"""
import socket, ssl, sys
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
ctx.load_cert_chain(sys.argv[1], sys.argv[2])
lsock = socket.create_server(("127.0.0.1", 0))
print("PORT", lsock.getsockname()[1], flush=True)
conn, _ = lsock.accept()
try:
    ctx.wrap_socket(conn, server_side=True)
except ssl.SSLError as e:
    print("server", type(e).__name__, e.reason, flush=True)
"""

REFUSING_CLIENT = r"""
import socket, ssl, sys
ctx = ssl.create_default_context()  # the system's CAs: the test certificate is not among them
raw = socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=20)
try:
    ctx.wrap_socket(raw, server_hostname="localhost")
except ssl.SSLError as e:
    print("client", type(e).__name__, e.reason, flush=True)
"""


def test_a_refused_certificate_reaches_the_peer_as_its_alert(
    nocfg: PrivateSmcd, tmp_path: Path
) -> None:
    """A client that refuses the server's certificate sends a TLS alert before it closes: over
    the channel as over TCP, the server's handshake fails with that alert's reason, not with
    an EOF."""
    cert, key = _test_cert(tmp_path)
    tcp_client, tcp_server = _tcp(nocfg, REFUSING_SERVER, REFUSING_CLIENT, cert, key)
    assert "CERTIFICATE_VERIFY_FAILED" in tcp_client and "ALERT" in tcp_server, tcp_server
    server = _smc_run(_env(nocfg), REFUSING_SERVER, cert, key)
    client, _, sout, serr = _serve_then_run(nocfg, server, REFUSING_CLIENT, cert)
    assert client.returncode == 0, client.stderr[-3000:]
    assert (client.stdout, sout) == (tcp_client, tcp_server), (client.stdout, sout)
    assert [m[:2] for m in _modes(serr)] == [("accept", "smcd")], serr


BULK_SERVER = r"""
import socket, ssl, sys
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
ctx.load_cert_chain(sys.argv[1], sys.argv[2])
lsock = socket.create_server(("127.0.0.1", 0))
print("PORT", lsock.getsockname()[1], flush=True)
conn, _ = lsock.accept()
with ctx.wrap_socket(conn, server_side=True) as tls:
    buf = memoryview(bytearray(1 << 20))
    total = check = 0
    while total < 64 << 20 and (n := tls.recv_into(buf)):
        total += n
        check = (check + sum(buf[:n:4096])) % 65521
    tls.sendall(b"ok")
    print(total, check, flush=True)
"""

BULK_CLIENT = r"""
import resource, socket, ssl, sys
ctx = ssl.create_default_context(cafile=sys.argv[2])
ctx.check_hostname = False
data = bytes(range(256)) * (64 << 12)  # 64 MiB
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
with ctx.wrap_socket(socket.create_connection(("127.0.0.1", int(sys.argv[1])))) as tls:
    tls.sendall(data)
    assert tls.recv(2) == b"ok"
grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
print("grew under 32 MiB:", grew < 32 << 10, flush=True)
"""


def test_a_large_sendall_streams_instead_of_buffering(nocfg: PrivateSmcd, tmp_path: Path) -> None:
    """One ``sendall`` of 64 MiB: encrypted and sent a slice at a time as over TCP, not all
    encrypted into memory first (the process grows by less than half the payload), and every
    byte arrives."""
    cert, key = _test_cert(tmp_path)
    tcp_client, tcp_server = _tcp(nocfg, BULK_SERVER, BULK_CLIENT, cert, key)
    server = _smc_run(_env(nocfg), BULK_SERVER, cert, key)
    client, _, sout, serr = _serve_then_run(nocfg, server, BULK_CLIENT, cert)
    assert client.returncode == 0, client.stderr[-3000:]
    assert client.stdout == tcp_client == "grew under 32 MiB: True\n", (client.stdout, tcp_client)
    assert sout == tcp_server and sout.split()[0] == str(64 << 20), (sout, tcp_server)
    assert [m[:2] for m in _modes(serr)] == [("accept", "smcd")], serr


LIBRARY_TLS_CLIENT = r"""
import socket, ssl, sys
import smc_handoff
ctx = ssl.create_default_context(cafile=sys.argv[2])
ctx.check_hostname = False
for i in range(2):
    raw = smc_handoff.connect(("127.0.0.1", int(sys.argv[1])))  # the library, no smc-run
    with ctx.wrap_socket(raw) as tls:
        tls.sendall(b"hello %d\n" % i)
        f = tls.makefile("rb")
        first, rest = f.readline(), f.readline()
        f.close()
        tls.sendall(b"BYE\n")
        print(first.decode().strip(), len(rest), tls.version(), tls.mode, flush=True)
"""


def test_a_program_using_the_library_runs_tls_over_the_channel_too(
    nocfg: PrivateSmcd, tmp_path: Path
) -> None:
    """A program that hands its connection over with ``smc_handoff.connect`` (no smc-run) and
    wraps it with ``ssl``: its first SMC connection installs the same TLS-over-the-channel, so
    it meets an smc-run TLS server there (an end that left the channel for TCP while its peer
    stayed would break the connection)."""
    cert, key = _test_cert(tmp_path)
    server = _smc_run(_env(nocfg), TLS_SERVER, cert, key)
    env = _env(nocfg)
    proc = subprocess.Popen(server, env=env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)  # fmt: skip
    try:
        assert proc.stdout is not None
        port = proc.stdout.readline().split()[1]
        client = subprocess.run([os.fspath(PYTHON), "-c", LIBRARY_TLS_CLIENT, port, cert],
                                env=env, capture_output=True, text=True, timeout=60)  # fmt: skip
        sout, serr = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert client.returncode == 0, client.stderr[-3000:]
    assert client.stdout == "HELLO 0 200001 TLSv1.3 smcd\nHELLO 1 200001 TLSv1.3 smcd\n"
    assert all(int(line.split()[2]) < 500 for line in sout.splitlines()), sout
    assert [m[:2] for m in _modes(serr)] == [("accept", "smcd")] * 2, serr


CLOSING_SERVER = r"""
import socket, ssl, sys
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
ctx.load_cert_chain(sys.argv[1], sys.argv[2])
lsock = socket.create_server(("127.0.0.1", 0))
print("PORT", lsock.getsockname()[1], flush=True)
for _ in range(2):
    conn, _ = lsock.accept()
    with ctx.wrap_socket(conn, server_side=True) as tls:
        f = tls.makefile("rb")
        tls.sendall(f.readline().upper())
        assert f.readline() == b"BYE\n"
        f.close()  # and closes at once, as the client closes
"""

LATE_CLOSING_CLIENT = r"""
import asyncio, ssl, sys, time
async def main():
    ctx = ssl.create_default_context(cafile=sys.argv[2])
    ctx.check_hostname = False
    for _ in range(2):
        reader, writer = await asyncio.open_connection("127.0.0.1", int(sys.argv[1]), ssl=ctx)
        writer.write(b"hello\n")
        print((await reader.readline()).decode().strip(), flush=True)
        writer.write(b"BYE\n")
        await writer.drain()
        time.sleep(0.2)  # the server closes meanwhile (the loop has not seen it: blocked)
        writer.close()  # asyncio's TLS writes its close_notify
        try:
            await writer.wait_closed()
            print("closed cleanly", flush=True)
        except OSError as e:
            print("closed with", type(e).__name__, flush=True)
asyncio.run(main())
"""


def test_an_asyncio_tls_client_closing_after_its_server_closes_cleanly(
    nocfg: PrivateSmcd, tmp_path: Path
) -> None:
    """asyncio's TLS writes a close_notify when the client closes; when the server closed
    first, TCP takes that write (the server's RST answers it) and ``wait_closed()`` returns;
    the channel refused it at once (``ECONNRESET``, as AF_SMC) and ``wait_closed()`` raised.
    The SMC transport now drops the first write the peer's close refuses, as TCP does."""
    cert, key = _test_cert(tmp_path)
    tcp_client, _ = _tcp(nocfg, CLOSING_SERVER, LATE_CLOSING_CLIENT, cert, key)
    assert tcp_client == "HELLO\nclosed cleanly\n" * 2, tcp_client
    server = _smc_run(_env(nocfg), CLOSING_SERVER, cert, key)
    client, _, _, serr = _serve_then_run(nocfg, server, LATE_CLOSING_CLIENT, cert)
    assert client.returncode == 0, client.stderr[-3000:]
    assert client.stdout == tcp_client, client.stdout
    assert [m[:2] for m in _modes(client.stderr)] == [("connect", "smcd")] * 2, client.stderr
    assert [m[:2] for m in _modes(serr)] == [("accept", "smcd")] * 2, serr


UNWRAP_AT_ONCE = r"""
import socket, ssl, sys, threading
sctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
sctx.load_cert_chain(sys.argv[1], sys.argv[2])
cctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
cctx.check_hostname, cctx.verify_mode = False, ssl.CERT_NONE
lsock = socket.create_server(("127.0.0.1", 0))
raw_a = socket.create_connection(lsock.getsockname())
raw_b, _ = lsock.accept()
out = {}
def end_a():  # an ordinary TLS client: it reads until the peer's close_notify, then unwraps
    try:
        a = cctx.wrap_socket(raw_a)
        a.sendall(b"x" * 100000)
        out["eof"] = a.recv(1 << 20)  # a big read: the records there go in one batch
        plain = a.unwrap()
        out["plain"] = plain.recv(100)
        plain.close()
    except Exception as e:
        out["error"] = f"{type(e).__name__}: {e}"
thread = threading.Thread(target=end_a)
thread.start()
# B is TLS by hand (memory buffers), so that its close_notify and the plaintext after it
# reach the channel in one write (a one-way shutdown, as RFC 8446 allows): A finds them
# together in its read, whenever it looks.
inc, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
b = sctx.wrap_bio(inc, outgoing, server_side=True)
def pump(op):
    while True:
        try:
            result = op()
        except ssl.SSLWantReadError:
            if outgoing.pending:
                raw_b.sendall(outgoing.read())
            data = raw_b.recv(1 << 20)
            inc.write(data) if data else inc.write_eof()
            continue
        if outgoing.pending:
            raw_b.sendall(outgoing.read())
        return result
pump(b.do_handshake)
got = 0
while got < 100000:
    got += len(pump(lambda: b.read(1 << 20)))
try:
    b.unwrap()
except ssl.SSLWantReadError:
    pass  # ours is written; A's is to come
raw_b.sendall(outgoing.read() + b"PLAIN AFTER TLS\n")
try:
    pump(b.unwrap)  # A's close_notify
    after = raw_b.recv(100)
except OSError as e:
    after = type(e).__name__
thread.join(30)
print(got, out, after, raw_b.mode, flush=True)
"""


def test_plaintext_right_after_a_close_notify_stays_in_the_stream(
    nocfg: PrivateSmcd, tmp_path: Path
) -> None:
    """A TLS read takes the peer's records in batches (one read out of the ring for many
    records), but never past a close_notify: a peer that shuts TLS down one way and writes
    plaintext in the same breath (both in the ring at once, deterministically: that peer's
    TLS is done by hand) leaves the plaintext to the socket ``unwrap()`` returns. A
    close_notify padded past what a batch may end on (OpenSSL's ``RecordPadding``) cannot
    be told from data: then ``unwrap()`` fails and the connection is reset, so nothing
    reads a stream with a hole in it."""
    cert, key = _test_cert(tmp_path)
    env = _env(nocfg)
    done = subprocess.run(_smc_run(env, UNWRAP_AT_ONCE, cert, key), capture_output=True,
                          text=True, env=env, timeout=90)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    expected = "100000 {'eof': b'', 'plain': b'PLAIN AFTER TLS\\n'} b'' smcd\n"
    assert done.stdout == expected, done.stdout
    padded = tmp_path / "padded.cnf"
    padded.write_text(
        "openssl_conf = conf\n[conf]\nssl_conf = ssl\n[ssl]\nsystem_default = dflt\n"
        "[dflt]\nRecordPadding = 2048\n"
    )
    env = {**env, "OPENSSL_CONF": os.fspath(padded)}
    done = subprocess.run(_smc_run(env, UNWRAP_AT_ONCE, cert, key), capture_output=True,
                          text=True, env=env, timeout=90)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    got, rest = done.stdout.split(" ", 1)
    assert got == "100000" and "SSLError" in rest and "padded past 1024 bytes" in rest, rest
    assert rest.endswith(" ConnectionResetError smcd\n"), rest


SELECT_EACH_READ_SERVER = (
    ACCEPT_ONE
    + r"""
tls = ctx.wrap_socket(conn, server_side=True)
time.sleep(0.3)  # the client's records are all there before the first read
got, reads = 0, 0
while got < 100000:
    ready, _, _ = select.select([tls], [], [], 10)  # before every read, no draining
    if not ready:
        print("stuck at", got, flush=True)
        sys.exit(1)
    got += len(tls.recv(16384))  # a record's worth
    reads += 1
tls.sendall(b"%d\n" % got)
print(got, reads >= 7, tcp_bytes(tls) < 500, flush=True)
tls.close()
"""
)

SEND_RECORDS_CLIENT = r"""
import socket, ssl, sys
ctx = ssl.create_default_context(cafile=sys.argv[2])
ctx.check_hostname = False
with ctx.wrap_socket(socket.create_connection(("127.0.0.1", int(sys.argv[1])))) as tls:
    tls.sendall(b"r" * 100000)  # 7 records in one go, then wait for the answer
    print(tls.recv(100).decode().strip(), flush=True)
"""


def test_a_select_before_every_read_sees_every_record(nocfg: PrivateSmcd, tmp_path: Path) -> None:
    """A program that waits for readiness before each ``recv`` of a record's worth
    (without draining first, as the ssl docs advise) gets every record as over TCP: a read
    takes out of the ring only the records its own length holds, since a record left in
    OpenSSL's memory buffer is invisible to ``select`` (taking all 7 records that were there
    into the first read's batch left the program waiting for good)."""
    cert, key = _test_cert(tmp_path)
    tcp_client, tcp_server = _tcp(nocfg, SELECT_EACH_READ_SERVER, SEND_RECORDS_CLIENT, cert, key)
    assert tcp_client == "100000\n" and tcp_server == "100000 True False\n", tcp_server
    server = _smc_run(_env(nocfg), SELECT_EACH_READ_SERVER, cert, key)
    client, _, sout, serr = _serve_then_run(nocfg, server, SEND_RECORDS_CLIENT, cert)
    assert client.returncode == 0 and client.stdout == tcp_client, (client.stdout, sout, serr)
    assert sout == "100000 True True\n", (sout, serr[-3000:])
    assert [m[:2] for m in _modes(serr)] == [("accept", "smcd")], serr
