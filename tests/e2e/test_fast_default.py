"""Fast by default (#10): what an unmodified program gets from an smcd with no configuration.

- one host, no configuration, ``smc-run``: both ends on SMC-D loopback-ism (the host-local
  system EID makes same-host SMC-Dv2 need no UEID);
- two hosts (two network namespaces joined by a veth pair, one smcd each, no configuration):
  both ends fall back to TCP with the decline the kernel would send, and the data is intact
  (cross-host SMC stays opt-in through a common UEID);
- ``SO_RCVBUF`` set by a program sizes its DMB as the kernel's ``__smc_buf_create`` would
  (``smcctl conns --json``); ``SO_SNDBUF`` sizes nothing (loopback-ism's send buffer *is* the
  peer's DMB, as the kernel's ``smcd_buf_attach``);
- a 64 KiB request/response and a slow reader move every byte intact.

The programs are plain stdlib ``socket`` code run under ``smc-run -v``, whose stderr says which
transport each connection end got.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import smc_handoff
from smc_handoff import peer_option
from smcd_daemon.demo import PrivateSmcd
from tests.control.daemon_proc import SMCD, NotifySocket, SmcdProcess, sh

pytestmark = pytest.mark.timeout(180)

REPO = Path(__file__).resolve().parents[2]
SMC_RUN = REPO / ".venv" / "bin" / "smc-run"
PYTHON = REPO / ".venv" / "bin" / "python"
DEFAULT_DMB = 1 << 20
"""buffers.default_dmb_size: the DMB an unconfigured smcd gives a program that sets no SO_RCVBUF."""

SERVER = r"""
import hashlib, socket, sys, time
addr, rcvbuf, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
if rcvbuf:
    lsock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
lsock.bind((addr, 0))
lsock.listen(8)
print("PORT", lsock.getsockname()[1], flush=True)
conn, _ = lsock.accept()
buf = bytearray(1 << 20)
view = memoryview(buf)
if mode == "echo":
    while n := conn.recv_into(view):
        conn.sendall(view[:n])
elif mode == "slow":  # a slow reader: small reads, a pause every MiB, a hash of everything
    h = hashlib.sha256()
    total = 0
    while n := conn.recv_into(view[:4096]):
        h.update(view[:n])
        if (total + n) >> 20 != total >> 20:
            time.sleep(0.002)
        total += n
    conn.sendall(f"{total} {h.hexdigest()}\n".encode())
conn.close()
"""

CLIENT = r"""
import hashlib, os, socket, sys
addr, mode = sys.argv[1], sys.argv[5]
port, rcvbuf, sndbuf = (int(a) for a in sys.argv[2:5])
sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
if rcvbuf:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
if sndbuf:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
sock.connect((addr, port))

def exactly(n):
    out = bytearray(n)
    view, got = memoryview(out), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if not k:
            raise SystemExit(f"EOF after {got} of {n}")
        got += k
    return bytes(out)

if mode == "hold":  # one echo, report the local port, wait for the test
    sock.sendall(b"x")
    assert exactly(1) == b"x"
    print("UP", sock.getsockname()[1], flush=True)
    sys.stdin.readline()
elif mode == "rr":  # 64 KiB requests, each different, each echo compared
    for i in range(200):
        msg = os.urandom(65536)
        sock.sendall(msg)
        if exactly(65536) != msg:
            raise SystemExit(f"round {i}: the echo differs")
    print("RR OK", flush=True)
elif mode == "bulk":  # 32 MiB in 64 KiB writes to a slow reader, which hashes what it got
    h = hashlib.sha256()
    data = os.urandom(1 << 20)
    for i in range(32):
        for off in range(0, 1 << 20, 65536):
            piece = data[off : off + 65536]
            sock.sendall(piece)
            h.update(piece)
    sock.shutdown(socket.SHUT_WR)
    line = b""
    while not line.endswith(b"\n"):
        k = sock.recv(100)
        if not k:
            break
        line += k
    print("SENT", 32 << 20, h.hexdigest(), "GOT", line.decode().strip(), flush=True)
sock.close()
"""

VERBOSE = re.compile(
    r"smc-run\[\d+\]: (connect|accept) \(.*?\): (\w+)(?: conn \d+)?(?: \((.*)\))?$"
)


def _smc_run(env: dict[str, str], code: str, *args: object, netns: str | None = None) -> list[str]:
    argv = [os.fspath(SMC_RUN), "-v", os.fspath(PYTHON), "-c", code, *map(str, args)]
    return ["ip", "netns", "exec", netns, *argv] if netns else argv


def _modes(stderr: str) -> list[tuple[str, str, str | None]]:
    """(connect|accept, transport, fallback reason) of every connection end smc-run reported."""
    return [(m[1], m[2], m[3]) for line in stderr.splitlines() if (m := VERBOSE.search(line))]


class Pair:
    """A server and a client program, each under ``smc-run -v``."""

    def __init__(
        self,
        env: dict[str, str],
        *,
        addr: str = "127.0.0.1",
        server_rcvbuf: int = 0,
        server_mode: str = "echo",
        client_rcvbuf: int = 0,
        client_sndbuf: int = 0,
        client_mode: str = "hold",
        server_env: dict[str, str] | None = None,
        server_netns: str | None = None,
        client_netns: str | None = None,
    ) -> None:
        self.server = subprocess.Popen(
            _smc_run(server_env or env, SERVER, addr, server_rcvbuf, server_mode,
                     netns=server_netns),
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, env=server_env or env,
        )  # fmt: skip
        assert self.server.stdout is not None
        first = self.server.stdout.readline()
        if not first.startswith("PORT "):
            self.server.kill()
            raise AssertionError(f"server said {first!r}: {self.server.communicate()[1]}")
        self.port = int(first.split()[1])
        self.client = subprocess.Popen(
            _smc_run(env, CLIENT, addr, self.port, client_rcvbuf, client_sndbuf, client_mode,
                     netns=client_netns),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, env=env,
        )  # fmt: skip

    def line(self) -> str:
        assert self.client.stdout is not None
        text = self.client.stdout.readline()
        if not text:
            self.kill()
            raise AssertionError(f"client said nothing: {self.client.communicate()[1]}")
        return text.strip()

    def finish(self) -> tuple[str, str]:
        """Both programs' stderr once both exited (the client first)."""
        _, cerr = self.client.communicate(timeout=120)
        _, serr = self.server.communicate(timeout=60)
        assert self.client.returncode == 0, cerr
        assert self.server.returncode == 0, serr
        return cerr, serr

    def kill(self) -> None:
        for p in (self.client, self.server):
            if p.poll() is None:
                p.kill()
                p.wait()


@contextlib.contextmanager
def _started(config_text: str, name: str) -> Iterator[PrivateSmcd]:
    """A private smcd with ``config_text`` ("": none), stopped and removed afterwards."""
    daemon = PrivateSmcd(config_text=config_text, name=name)
    try:
        daemon.start()
        yield daemon
    finally:
        daemon.cleanup()


@pytest.fixture(scope="module")
def nocfg() -> Iterator[PrivateSmcd]:
    """A private smcd started with no configuration file: its embedded defaults."""
    with _started("", "fastdefault") as daemon:
        yield daemon


def _env(daemon: PrivateSmcd) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SMCD_", "SMC_RUN"))}
    return {**env, **daemon.env, "PYTHONPATH": os.fspath(REPO)}


def test_no_configuration_same_host_gets_smcd(nocfg: PrivateSmcd) -> None:
    pair = Pair(_env(nocfg))
    try:
        assert pair.line().startswith("UP ")
        assert pair.client.stdin is not None
        pair.client.stdin.write("\n")
        pair.client.stdin.flush()
        cerr, serr = pair.finish()
    finally:
        pair.kill()
    assert _modes(cerr) == [("connect", "smcd", None)], cerr
    assert _modes(serr) == [("accept", "smcd", None)], serr


def _conn_sizes(daemon: PrivateSmcd, port: int) -> dict[str, dict[str, int]]:
    """The two halves of the connection on ``port`` (the server's), as ``smcctl conns`` shows
    them: role → RmbeSize (our DMB), PeerRmbeSize and SndbufSize (the peer's DMB we write to)."""
    proc = daemon.smcctl("conns", "--json")
    assert proc.returncode == 0, proc.stderr
    out = {}
    for c in json.loads(proc.stdout):
        if c.get("Mode") != "SMCD":
            continue
        role = "server" if c.get("LocalPort") == port else "client"
        if port not in (c.get("LocalPort"), c.get("PeerPort")):
            continue
        out[role] = {k: int(c[k]) for k in ("RmbeSize", "PeerRmbeSize", "SndbufSize")}
    assert set(out) == {"server", "client"}, proc.stdout
    return out


@pytest.mark.parametrize(
    ("server_rcvbuf", "client_rcvbuf", "client_sndbuf", "server_dmb", "client_dmb"),
    [
        (0, 0, 0, DEFAULT_DMB, DEFAULT_DMB),  # nothing set: the measured default
        (256 << 10, 0, 0, 256 << 10, DEFAULT_DMB),  # the listener's SO_RCVBUF, inherited by accept
        (0, 100_000, 0, DEFAULT_DMB, 128 << 10),  # rounded up to 16 KiB << n, as the kernel
        (0, 16 << 10, 0, DEFAULT_DMB, 16 << 10),  # the smallest class
        (0, 0, 1 << 20, DEFAULT_DMB, DEFAULT_DMB),  # SO_SNDBUF sizes nothing on loopback-ism
    ],
)
def test_so_rcvbuf_sizes_the_dmb(
    nocfg: PrivateSmcd,
    server_rcvbuf: int,
    client_rcvbuf: int,
    client_sndbuf: int,
    server_dmb: int,
    client_dmb: int,
) -> None:
    pair = Pair(
        _env(nocfg),
        server_rcvbuf=server_rcvbuf,
        client_rcvbuf=client_rcvbuf,
        client_sndbuf=client_sndbuf,
    )
    try:
        assert pair.line().startswith("UP ")
        sizes = _conn_sizes(nocfg, pair.port)
        assert pair.client.stdin is not None
        pair.client.stdin.write("\n")
        pair.client.stdin.flush()
        cerr, serr = pair.finish()
    finally:
        pair.kill()
    assert _modes(cerr)[0][1] == "smcd" and _modes(serr)[0][1] == "smcd", (cerr, serr)
    assert sizes["server"]["RmbeSize"] == server_dmb, sizes
    assert sizes["client"]["RmbeSize"] == client_dmb, sizes
    # each end writes straight into the other's DMB: its send buffer is the peer's DMB
    for me, peer in (("server", "client"), ("client", "server")):
        assert sizes[me]["PeerRmbeSize"] == sizes[peer]["RmbeSize"], sizes
        assert sizes[me]["SndbufSize"] == sizes[peer]["RmbeSize"], sizes


def test_64k_request_response_is_intact(nocfg: PrivateSmcd) -> None:
    pair = Pair(_env(nocfg), client_mode="rr")
    try:
        assert pair.line() == "RR OK"
        cerr, serr = pair.finish()
    finally:
        pair.kill()
    assert _modes(cerr) == [("connect", "smcd", None)], cerr
    assert _modes(serr) == [("accept", "smcd", None)], serr


def test_slow_reader_gets_every_byte(nocfg: PrivateSmcd) -> None:
    pair = Pair(_env(nocfg), server_mode="slow", client_mode="bulk")
    try:
        line = pair.line()
        cerr, serr = pair.finish()
    finally:
        pair.kill()
    _, sent, digest, _, got, got_digest = line.split()
    assert (got, got_digest) == (sent, digest), line
    assert _modes(cerr) == [("connect", "smcd", None)], cerr
    assert _modes(serr) == [("accept", "smcd", None)], serr


ONE_THREAD = r"""
import os, socket
lsock = socket.socket()
lsock.bind(("127.0.0.1", 0))
lsock.listen(8)
pairs = []
for _ in range(3):  # connect, then accept, in this one thread (as test suites do)
    c = socket.create_connection(lsock.getsockname())
    s, _ = lsock.accept()
    pairs.append((c, s))
for c, s in pairs:
    out, back = os.urandom(200_000), os.urandom(70_000)
    c.sendall(out)
    got = bytearray()
    while len(got) < len(out):
        got += s.recv(1 << 20)
    s.sendall(back)
    echo = bytearray()
    while len(echo) < len(back):
        echo += c.recv(1 << 20)
    assert (bytes(got), bytes(echo)) == (out, back)
    c.close()
    assert s.recv(10) == b""
    s.close()
print("ONE THREAD OK", flush=True)
"""


@pytest.mark.parametrize("debug", [False, True])
def test_one_thread_connects_then_accepts_on_smcd(nocfg: PrivateSmcd, debug: bool) -> None:
    """The kernel runs the server's side of CLC before the application accepts; smcd's server
    half starts at the ACCEPT. smc-run's connect() therefore returns once its request is with
    smcd, and the first use of the socket reads the reply: a program that connects and then
    accepts in one thread gets SMC at once (it waited for ``timeouts.clc_wait`` and fell
    back, both ends on TCP, before). With ``-d`` the settle's debug line runs too."""
    argv = _smc_run(_env(nocfg), ONE_THREAD)
    if debug:
        argv.insert(2, "-d")
    proc = subprocess.run(argv, capture_output=True, text=True, env=_env(nocfg), timeout=60)
    assert proc.returncode == 0 and proc.stdout == "ONE THREAD OK\n", proc.stderr
    modes = _modes(proc.stderr)
    assert sorted(modes) == [("accept", "smcd", None)] * 3 + [("connect", "smcd", None)] * 3, modes


FIRST_REQUEST = r"""
import socket, sys
import smc_handoff.messages as messages

loaded_at_send = []  # was the channel code loaded when a request to smcd left?
real_send = messages.send_message

def spy(ctl, msg, fds=()):
    loaded_at_send.append((type(msg).__name__, "smc_handoff.channel" in sys.modules))
    return real_send(ctl, msg, fds)

messages.send_message = spy
lsock = socket.create_server(("127.0.0.1", 0))
c = socket.create_connection(lsock.getsockname())
s, _ = lsock.accept()
c.sendall(b"ping")
assert s.recv(4) == b"ping"
print(c.mode, s.mode, loaded_at_send, "smc_handoff.channel" in sys.modules, flush=True)
"""


@pytest.mark.parametrize("daemon", [True, False])
def test_the_first_request_leaves_before_the_channel_code_loads(
    nocfg: PrivateSmcd, daemon: bool
) -> None:
    """A process's first handoff imports the channel modules (milliseconds) after its request
    left, while smcd negotiates: between ``connect()`` and the request they delayed every
    program's first connection and could outlast a server half's wait for its client
    (``timeouts.local_client_wait``) on a busy machine. Without a daemon they never load."""
    env = _env(nocfg)
    if not daemon:
        env["SMCD_HANDOFF_SOCKET"] = os.fspath(nocfg.handoff_socket.parent / "none")
    proc = subprocess.run(_smc_run(env, FIRST_REQUEST), capture_output=True, text=True, env=env,
                          timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    if daemon:  # the listener's LISTEN, the CONNECT (before the import), the ACCEPT (after)
        sends = "[('Listen', False), ('Connect', False), ('Accept', True)]"
        assert proc.stdout == f"smcd smcd {sends} True\n", proc.stderr
    else:
        assert proc.stdout == "tcp tcp [] False\n", proc.stderr


POOL = 150
"""Connections a pool opens before using any: more than twice ``limits.handshakes_per_user``."""

WARM_POOL_SERVER = r"""
import socket
lsock = socket.create_server(("127.0.0.1", 0), backlog=256)
print("PORT", lsock.getsockname()[1], flush=True)
conns = [lsock.accept()[0] for _ in range(@POOL@)]
for c in conns:
    c.sendall(c.recv(16).upper())
for c in conns:
    assert c.recv(16) == b""
print("SERVED", len(conns), flush=True)
""".replace("@POOL@", str(POOL))

WARM_POOL_CLIENT = r"""
import socket, sys
pool = [socket.create_connection(("127.0.0.1", int(sys.argv[1]))) for _ in range(@POOL@)]
for i, c in enumerate(pool):  # only now does the pool use them
    c.sendall(b"conn %d" % i)
    assert c.recv(16) == b"CONN %d" % i
for c in pool:
    c.close()
print("POOL OK", flush=True)
""".replace("@POOL@", str(POOL))


@pytest.mark.parametrize("soft_limit", [0, 1024], ids=["own-limits", "nofile-1024"])
def test_a_pool_opened_before_use_gets_smcd_on_every_connection(
    nocfg: PrivateSmcd, soft_limit: int
) -> None:
    """A client half waits for its server application's ``accept()`` before CLC begins (the
    kernel's listener runs CLC before the accept); parked so, it is not a handshake in flight.
    A pool that opened its connections before using any counted every wait against
    ``limits.handshakes_per_user`` (64), and all past it fell back to TCP.

    Under the usual soft descriptor limit of 1,024 (systemd's for services and sessions) both
    programs ran out of descriptors at ~145 connections (an SMC connection holds seven), where
    TCP serves 1,000: a process that hands a connection off raises its soft limit to the hard
    one, as Go programs do."""
    prefix = ("prlimit", f"--nofile={soft_limit}:", "--") if soft_limit else ()
    server = [*prefix, *_smc_run(_env(nocfg), WARM_POOL_SERVER)]
    client, _, sout, serr = _serve_then_run(nocfg, server, WARM_POOL_CLIENT, prefix=prefix)
    assert client.returncode == 0 and client.stdout == "POOL OK\n", client.stderr[-3000:]
    assert sout == f"SERVED {POOL}\n", serr[-3000:]
    assert _modes(client.stderr) == [("connect", "smcd", None)] * POOL, client.stderr[-3000:]
    assert _modes(serr) == [("accept", "smcd", None)] * POOL, serr[-3000:]


DEFER_SERVER = r"""
import socket
lsock = socket.create_server(("127.0.0.1", 0), backlog=64)
print("PORT", lsock.getsockname()[1], flush=True)
conns = [lsock.accept()[0] for _ in range(20)]
print(" ".join("pending" if "mode=pending" in repr(c) else "settled" for c in conns), flush=True)
for c in conns:
    c.sendall(c.recv(16).upper())
for c in conns:
    assert c.recv(16) == b""
print("SERVED", len(conns), flush=True)
"""

DEFER_CLIENT = WARM_POOL_CLIENT.replace(str(POOL), "20")


def test_accept_leaves_the_handshake_to_the_connections_first_use(nocfg: PrivateSmcd) -> None:
    """``accept()`` under smc-run returns once smcd has the connection, and its first use
    (here the ``recv``) awaits the handshake, as a client's ``connect()`` does: an accept loop
    drains its listen backlog at TCP's pace, where each accept used to wait a handshake out
    (a burst of clients overflowed ``socketserver``'s backlog of 5, and the kernel dropped
    their SYNs: seconds of retransmission). At most 16 accepted connections wait so at once;
    the 17th accept awaits its handshake, so a server that accepts a pool before using any
    puts no more in flight than that. Every connection is on smcd, every echo intact."""
    client, sout, serr = _talk(nocfg, DEFER_SERVER, DEFER_CLIENT)
    assert client.returncode == 0 and client.stdout == "POOL OK\n", (client.stderr, serr)
    first, served = sout.splitlines()
    assert first.split() == ["pending"] * 16 + ["settled"] * 4, (sout, serr)
    assert served == "SERVED 20", (sout, serr)
    assert _modes(client.stderr) == [("connect", "smcd", None)] * 20, client.stderr
    assert _modes(serr) == [("accept", "smcd", None)] * 20, serr


RESTART_SERVER = r"""
import socket, sys
lsock = socket.create_server(("127.0.0.1", int(sys.argv[1])))  # SO_REUSEADDR, as servers do
print("PORT", lsock.getsockname()[1], flush=True)
conn, _ = lsock.accept()
conn.sendall(conn.recv(16).upper())
conn.close()  # the server closes first: its end of the connection waits in TIME_WAIT
print("SERVED", flush=True)
"""

RESTART_CLIENT = r"""
import socket, sys
sock = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
sock.sendall(b"again")
print(sock.recv(16).decode(), sock.recv(16) == b"", flush=True)
"""


def test_a_server_restarted_on_its_port_binds_it_at_once(nocfg: PrivateSmcd) -> None:
    """A server under smc-run that served a connection and closed it first, then exits, can be
    started again on the same port at once, as on TCP. smcd reads a connection's identity in
    ``TCP_REPAIR`` mode, and leaving it cleared the accepted socket's ``SO_REUSEADDR``, so its
    TIME_WAIT kept the port: the restarted server failed with EADDRINUSE for a minute."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = _env(nocfg)
    for run in range(3):
        server = subprocess.Popen(_smc_run(env, RESTART_SERVER, port), env=env, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
        try:
            assert server.stdout is not None
            first = server.stdout.readline()
            if not first.startswith("PORT"):
                server.kill()
                raise AssertionError((run, first, server.communicate(timeout=10)))
            client = subprocess.run(_smc_run(env, RESTART_CLIENT, port), env=env,
                                    capture_output=True, text=True, timeout=60)  # fmt: skip
            sout, serr = server.communicate(timeout=30)
        finally:
            server.kill()
        assert client.stdout == "AGAIN True\n", (run, client.stderr, serr)
        assert sout == "SERVED\n", (run, sout, serr)
        assert _modes(client.stderr) == [("connect", "smcd", None)], client.stderr
        assert _modes(serr) == [("accept", "smcd", None)], serr


def test_a_burst_queued_while_smcd_was_busy_is_no_idle_flood(nocfg: PrivateSmcd) -> None:
    """Connections whose requests wait in the listen queue are not "connections that sent no
    request yet": the daemon just has not read them. smcd stopped (as a busy or descheduled
    daemon is) while a pool opens 150 connections, and one handoff connection of the same user
    that really sent nothing: at its next turn smcd accepts the burst at once, and with the
    idle one pending the 64th of the burst reached ``limits.pending_per_user`` (64) before any
    request was read; that one and all 87 after it fell back to TCP (MAX_DMB), as in a CI run
    on a busy machine."""
    env = _env(nocfg)
    assert nocfg.proc is not None
    server = subprocess.Popen(_smc_run(env, WARM_POOL_SERVER), env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              start_new_session=True)  # fmt: skip
    idle = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        assert server.stdout is not None
        port = server.stdout.readline().split()[1]
        idle.connect(os.fspath(nocfg.workdir / "handoff.sock"))
        time.sleep(0.2)  # accepted: pending
        os.kill(nocfg.proc.pid, signal.SIGSTOP)
        try:
            client = subprocess.Popen(_smc_run(env, WARM_POOL_CLIENT, port), env=env,
                                      text=True, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE)  # fmt: skip
            deadline = time.monotonic() + 30
            while _queued(nocfg) < POOL and time.monotonic() < deadline:
                time.sleep(0.05)
            assert _queued(nocfg) >= POOL
        finally:
            os.kill(nocfg.proc.pid, signal.SIGCONT)
        out, err = client.communicate(timeout=90)
        sout, serr = server.communicate(timeout=30)
    finally:
        idle.close()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGKILL)
        server.wait()
    assert client.returncode == 0 and out == "POOL OK\n", err[-3000:]
    assert sout == f"SERVED {POOL}\n", serr[-3000:]
    assert _modes(err) == [("connect", "smcd", None)] * POOL, err[-3000:]
    assert _modes(serr) == [("accept", "smcd", None)] * POOL, serr[-3000:]


def _queued(daemon: PrivateSmcd) -> int:
    """Connections waiting in ``daemon``'s handoff listen queue (``ss``'s Recv-Q)."""
    path = os.fspath(daemon.workdir / "handoff.sock")
    out = subprocess.run(["ss", "-xlH", "src", path], capture_output=True, text=True).stdout
    return int(out.split()[2]) if out.split() else 0


LATE_ACCEPT_SERVER = r"""
import socket, time
lsock = socket.create_server(("127.0.0.1", 0))
print("PORT", lsock.getsockname()[1], flush=True)
time.sleep(4)  # the clients have connected and closed (or dropped) their sockets by now
for _ in range(2):
    c, _ = lsock.accept()
    c.settimeout(10)
    print("EOF" if c.recv(16) == b"" else "DATA", flush=True)
"""

QUICK_CLOSE_CLIENT = r"""
import gc, socket, sys, threading, time
addr = ("127.0.0.1", int(sys.argv[1]))
c = socket.create_connection(addr)  # its handoff waits for an accept() 4 s away
text = repr(c)
assert "mode=pending" in text and c._pending is not None, text  # repr settles nothing
t0 = time.monotonic()
c.close()  # as on TCP: at once
print("close", "quick" if time.monotonic() - t0 < 2 else "waited", flush=True)
d = socket.create_connection(addr)
t0 = time.monotonic()
del d  # dropped without close(): its finalizer does not wait either
gc.collect()
print("drop", "quick" if time.monotonic() - t0 < 2 else "waited", flush=True)
a, b = socket.socketpair()  # (no TCP: never handed off)
print("threads", sorted(t.name for t in threading.enumerate()), flush=True)
"""


def test_closing_a_socket_whose_handoff_is_unanswered_does_not_wait(nocfg: PrivateSmcd) -> None:
    """smc-run's ``connect()`` returns once its request is with smcd; the answer waits for the
    server application's ``accept()``. ``close()`` (and a dropped socket's finalizer) waited for
    it too, seconds where TCP's ``close()`` never waits, and the finalizer's repr settled the
    handoff and started a thread. Now both give the handoff up at once, and the server reads
    EOF as from TCP."""
    client, _, sout, serr = _serve_then_run(
        nocfg, _smc_run(_env(nocfg), LATE_ACCEPT_SERVER), QUICK_CLOSE_CLIENT
    )
    assert client.returncode == 0, client.stderr[-3000:]
    assert client.stdout == "close quick\ndrop quick\nthreads ['MainThread']\n", client.stderr
    assert sout == "EOF\nEOF\n", serr[-3000:]
    # smcd saw the hang-ups: no SMC connection set up for nobody, the server on TCP at once
    gone = "the application closed the connection before its server half came"
    assert [m[1] for m in _modes(serr)] == ["tcp", "tcp"], serr
    assert all("the client closed the connection" in (m[2] or "") for m in _modes(serr)), serr
    assert gone in nocfg.log(), nocfg.log()[-3000:]
    # and smc-run -v has a line for each given-up connect, saying so
    given_up = [m for m in _modes(client.stderr) if m[0] == "connect"]
    assert [(m[1], (m[2] or "").split(" ")[0]) for m in given_up] == [
        ("tcp", "CLOSED_UNANSWERED"),
        ("tcp", "CLOSED_UNANSWERED"),
    ], client.stderr


REPR_PROGRAM = r"""
import socket, threading
lsock = socket.create_server(("127.0.0.1", 0))
c = socket.create_connection(lsock.getsockname())
s, _ = lsock.accept()
c.sendall(b"x")
assert s.recv(1) == b"x"
for sock in (c, s):
    text = repr(sock)
    assert "mode=smcd" in text and f"fd={sock.channel.event_fd()}," in text, text
    assert "raddr=('127.0.0.1', " in text and "family=%s," % socket.AF_INET in text, text
print(sorted(t.name for t in threading.enumerate()), flush=True)
c.fileno()  # a program that polls: the link watcher starts
print(sorted(t.name for t in threading.enumerate()), flush=True)
"""


def test_the_repr_of_an_smc_socket_changes_nothing(nocfg: PrivateSmcd) -> None:
    """``repr()`` named the descriptor through ``fileno()``, which puts the channel in level mode
    (the slower path a poller needs) and starts the link watcher thread: a socket in a log
    line slowed down for good."""
    proc = subprocess.run(_smc_run(_env(nocfg), REPR_PROGRAM), capture_output=True, text=True,
                          env=_env(nocfg), timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "['MainThread']\n['MainThread', 'smc-channel-links']\n", proc.stderr


INHERITED_LISTENER_SERVER = r"""
import _socket, os, socket, sys
if sys.argv[1] == "activated":  # as systemd passes it: listen() was called elsewhere
    raw = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM)
    raw.bind(("127.0.0.1", 0))
    raw.listen(8)
    lsock = socket.socket(fileno=raw.detach())
    lsock.settimeout(0.05)
    try:
        lsock.accept()  # a first accept() that finds nobody (registers it now)
    except TimeoutError:
        pass
    lsock.settimeout(None)
else:  # a copy of a registered listener (socket.fromfd, as a worker gets it)
    parent = socket.create_server(("127.0.0.1", 0))
    lsock = socket.socket(fileno=os.dup(parent.fileno()))
print("PORT", lsock.getsockname()[1], flush=True)
for _ in range(2):
    c, _ = lsock.accept()
    c.sendall(c.recv(16).upper())
    c.close()
"""

INHERITED_LISTENER_CLIENT = r"""
import socket, sys, time
for _ in range(2):
    c = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
    c.sendall(b"hello")
    assert c.recv(16) == b"HELLO"
    c.close()
print("OK", flush=True)
"""


@pytest.mark.parametrize("how", ["activated", "fromfd"])
def test_a_listener_inherited_by_descriptor_serves_over_smcd(nocfg: PrivateSmcd, how: str) -> None:
    """A listening socket this process never called ``listen()`` on (systemd's socket
    activation; ``socket.fromfd`` in a worker) is registered at its first ``accept()``. Before,
    its connections stayed on TCP, and each client of a copy of a listener another object had
    registered waited ``timeouts.clc_wait`` (6 s) for a server half that never came."""
    server = _smc_run(_env(nocfg), INHERITED_LISTENER_SERVER)
    server.append(how)
    client, _, sout, serr = _serve_then_run(nocfg, server, INHERITED_LISTENER_CLIENT)
    assert client.returncode == 0 and client.stdout == "OK\n", client.stderr[-3000:]
    assert _modes(client.stderr) == [("connect", "smcd", None)] * 2, client.stderr
    assert _modes(serr) == [("accept", "smcd", None)] * 2, serr
    assert sout == "", serr


FORKING_SERVER = r"""
import select, socketserver, time

class Echo(socketserver.BaseRequestHandler):
    def handle(self):
        time.sleep(0.05)  # the parent has closed its copy of the connection by now
        while True:  # a select() before each read: the first before anything claimed the copy
            if not select.select([self.request], [], [], 10)[0]:
                raise TimeoutError("select never saw the request")
            data = self.request.recv(1 << 16)
            if not data:
                break
            self.request.sendall(data)

with socketserver.ForkingTCPServer(("127.0.0.1", 0), Echo) as server:
    print("PORT", server.server_address[1], flush=True)
    server.serve_forever()
"""

ECHO_CLIENT = r"""
import os, socket, sys
for i in range(3):
    sock = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
    msg = os.urandom(300_000)
    sock.sendall(msg)
    got = bytearray()
    while len(got) < len(msg):
        k = sock.recv(1 << 20)
        assert k, f"EOF after {len(got)}"
        got += k
    assert bytes(got) == msg
    sock.close()
print("ECHO OK", flush=True)
"""


def _serve_then_run(
    daemon: PrivateSmcd,
    server: list[str],
    client_code: str,
    *client_args: object,
    forever: bool = False,
    prefix: tuple[str, ...] = (),
) -> tuple[subprocess.CompletedProcess[str], subprocess.Popen[str], str, str]:
    """Start ``server`` (a program under smc-run that prints "PORT n"), run ``client_code`` under
    smc-run against it: the client's result, the server process and its stdout and stderr once
    it ended (``forever``: it serves until stopped, so it is stopped; ``prefix``: a command
    the client runs under, as ``prlimit``). The server runs in a
    session of its own, killed at the end with whatever is left in it (a failed test's pool
    workers or forked children; relays leave it by themselves)."""
    env = _env(daemon)
    proc = subprocess.Popen(server, env=env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)  # fmt: skip
    try:
        assert proc.stdout is not None
        port = proc.stdout.readline().split()[1]
        client = subprocess.run([*prefix, *_smc_run(env, client_code, port, *client_args)],
                                capture_output=True, text=True, env=env, timeout=90)  # fmt: skip
        if forever:
            proc.terminate()
        sout, serr = proc.communicate(timeout=30)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.wait()
    return client, proc, sout, serr


def _talk(
    daemon: PrivateSmcd, server_code: str, client_code: str, *client_args: object
) -> tuple[subprocess.CompletedProcess[str], str, str]:
    """:func:`_serve_then_run` for a server given as code that ends by itself: the client's
    result and the server's stdout and stderr."""
    server = _smc_run(_env(daemon), server_code)
    client, _, sout, serr = _serve_then_run(daemon, server, client_code, *client_args)
    return client, sout, serr


def _talk_tcp(
    daemon: PrivateSmcd, server_code: str, client_code: str, timeout: float = 60
) -> tuple[subprocess.CompletedProcess[str], str, str]:
    """:func:`_talk` without smc-run: the same programs on plain TCP, the oracle."""
    plain = [os.fspath(PYTHON), "-c"]
    env = _env(daemon)
    server = subprocess.Popen([*plain, server_code], env=env, text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE)  # fmt: skip
    try:
        assert server.stdout is not None
        port = server.stdout.readline().split()[1]
        client = subprocess.run([*plain, client_code, port], capture_output=True, text=True,
                                env=env, timeout=timeout)  # fmt: skip
        sout, serr = server.communicate(timeout=timeout / 2)
    finally:
        server.kill()
    return client, sout, serr


def test_a_forking_server_serves_over_smcd(nocfg: PrivateSmcd) -> None:
    """socketserver.ForkingTCPServer: the parent closes its copy of each accepted connection
    right after fork() while the child serves it. The parent's close only lets go of its copy
    (it used to close the channel, and the child's connection was reset). The child polls its
    copy before its first read: unclaimed since the fork, the copy keeps readiness."""
    server = _smc_run(_env(nocfg), FORKING_SERVER)
    client, _, _, serr = _serve_then_run(nocfg, server, ECHO_CLIENT, forever=True)
    assert client.returncode == 0 and client.stdout == "ECHO OK\n", (client.stderr, serr)
    assert _modes(client.stderr) == [("connect", "smcd", None)] * 3, client.stderr
    assert _modes(serr) == [("accept", "smcd", None)] * 3, serr
    assert "Traceback" not in serr, serr


FORKING_CLIENT = r"""
import errno, os, socket, sys
sock = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
sock.sendall(b"before the fork")
assert sock.recv(100) == b"before the fork"
pid = os.fork()
if pid == 0:  # the child goes on with the connection, as a daemon's child does
    sock.sendall(b"from the child")
    got = sock.recv(100)
    if got != b"from the child":
        print("CHILD GOT", got, file=sys.stderr, flush=True)
    sock.close()
    os._exit(0 if got == b"from the child" else 1)
assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
try:  # the parent's copy is stale: the child moved the stream on
    sock.sendall(b"from the parent")
except OSError as e:
    assert e.errno == errno.EBUSY, e
    print("PARENT REFUSED:", e, flush=True)
sock.close()
"""


def test_after_fork_one_process_owns_a_connection(nocfg: PrivateSmcd) -> None:
    """A client that used its connection, forked, and let the child go on: the child's calls
    work (the first use after a fork claims the channel); the parent's copy, whose cursors the
    child has moved past, raises EBUSY instead of reading or writing at stale positions."""
    server_argv = _smc_run(_env(nocfg), SERVER, "127.0.0.1", 0, "echo")
    client, server, _, serr = _serve_then_run(nocfg, server_argv, FORKING_CLIENT)
    assert client.returncode == 0, client.stderr
    assert client.stdout.startswith("PARENT REFUSED: [Errno 16]"), client.stdout
    assert "belongs to process" in client.stdout, client.stdout
    assert _modes(client.stderr) == [("connect", "smcd", None)], client.stderr
    assert server.returncode == 0 and _modes(serr) == [("accept", "smcd", None)], serr


SINK_SERVER = r"""
import hashlib, socket
lsock = socket.create_server(("127.0.0.1", 0))
print("PORT", lsock.getsockname()[1], flush=True)
conn, _ = lsock.accept()
h, n = hashlib.sha256(), 0
try:
    while data := conn.recv(65536):
        h.update(data)
        n += len(data)
    print("EOF", n, h.hexdigest(), flush=True)
except OSError as e:
    print("ERROR", n, type(e).__name__, e, flush=True)
"""

EXITING_CLIENT = r"""
import hashlib, os, signal, socket, sys
sock = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
data = os.urandom(300_001)
sock.sendall(data)
print(len(data), hashlib.sha256(data).hexdigest(), flush=True)
how = sys.argv[2]
if how == "exit":
    os._exit(0)  # no close(), no finalizers
if how == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
pid = os.fork()  # "fork": the child writes the last bytes and exits without closing
if pid == 0:
    sock.sendall(b"!")
    os._exit(0)
os.waitpid(pid, 0)
sock.close()  # the parent's unused copy lets go quietly: the child's exit ends the connection
"""


@pytest.mark.parametrize("how", ["exit", "kill", "fork"])
def test_a_process_that_ends_without_closing_closes_as_on_tcp(nocfg: PrivateSmcd, how: str) -> None:
    """A client that exits without close() (``os._exit``, SIGKILL, a forked child that
    ``os._exit``s): the kernel closes a dead process's sockets, so on TCP the server reads
    everything, then EOF. On SMC the same, by the close the kernel's ``smc_close_final`` makes
    when nothing received is unread; it used to be ECONNRESET ("peer died")."""
    client, sout, serr = _talk(nocfg, SINK_SERVER, EXITING_CLIENT, how)
    n, sha = client.stdout.split()
    if how == "fork":  # the child's last byte is part of the stream
        n = str(int(n) + 1)
        sha = None
    words = sout.split()
    assert words[:2] == ["EOF", n], (sout, serr, client.stderr)
    if sha is not None:
        assert words[2] == sha, sout
    assert _modes(client.stderr) == [("connect", "smcd", None)], client.stderr
    assert _modes(serr) == [("accept", "smcd", None)], serr


SNIFFING_SERVER = r"""
import socket, struct
lsock = socket.create_server(("127.0.0.1", 0))
print("PORT", lsock.getsockname()[1], flush=True)
conn, _ = lsock.accept()
kind = conn.recv(1, socket.MSG_PEEK)  # sniff the protocol without consuming, as TLS/plain
(size,) = struct.unpack("!I", conn.recv(4, socket.MSG_WAITALL))  # a length prefix...
body = conn.recv(size, socket.MSG_WAITALL)  # ...then exactly that many bytes
conn.sendmsg([b"kind=", kind, b" size=%d " % len(body), body[:3]])
again = socket.fromfd(conn.fileno(), socket.AF_INET, socket.SOCK_STREAM)
conn.close()  # the copy goes on with the connection, as a dup of a TCP socket does
again.sendall(b" again")
print("fromfd:", again.family.name, again.type.name, flush=True)
again.close()
"""

SNIFFING_CLIENT = r"""
import socket, struct, sys, time
sock = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
body = b"B" * 300_000  # more than one ring's worth arrives in pieces
sock.sendall(struct.pack("!I", len(body))[:2])
time.sleep(0.05)  # the length prefix itself arrives in two pieces
sock.sendall(struct.pack("!I", len(body))[2:] + body[:1000])
time.sleep(0.05)
sock.sendall(body[1000:])
reply = b""
while data := sock.recv(1000):
    reply += data
print(reply.decode(), flush=True)
"""


def test_recv_flags_and_sendmsg_work_as_on_tcp(nocfg: PrivateSmcd) -> None:
    """A server that sniffs with MSG_PEEK, reads a length prefix and its body with MSG_WAITALL
    and answers with sendmsg() (the kernel's AF_SMC supports all three; they used to raise
    EOPNOTSUPP on smcd), over SMC-D; socket.fromfd() of an SMC connection's fileno() gives
    another socket for the connection, as for TCP (it raised ENOTSOCK: the number is the
    channel's eventfd)."""
    client, sout, serr = _talk(nocfg, SNIFFING_SERVER, SNIFFING_CLIENT)
    assert client.stdout == "kind=\x00 size=300000 BBB again\n", (client.stdout, client.stderr,
                                                                    serr)  # fmt: skip
    assert sout == "fromfd: AF_INET SOCK_STREAM\n", (sout, serr)
    assert _modes(client.stderr) == [("connect", "smcd", None)], client.stderr
    assert _modes(serr) == [("accept", "smcd", None)], serr


INETD_SERVER = r"""
import socket, subprocess, sys  # inetd-style-server-marker
CHILD = ("import hashlib, sys; d = sys.stdin.buffer.read(); "
         "print(len(d), hashlib.sha256(d).hexdigest())")
ECHO = "import os\nwhile d := os.read(0, 65536):\n    os.write(1, d)"
lsock = socket.create_server(("127.0.0.1", 0))
print("PORT", lsock.getsockname()[1], flush=True)
children = []
for i in range(3):  # as inetd: the connection is the child's stdin and stdout, closed here at once
    conn, _ = lsock.accept()
    children.append(subprocess.Popen([sys.executable, "-c", CHILD], stdin=conn, stdout=conn))
    conn.close()
conn, _ = lsock.accept()  # the descriptor form, and a parent that waits
subprocess.run([sys.executable, "-c", ECHO], stdin=conn.fileno(), stdout=conn.fileno(), check=True)
conn.close()
print("RC", [c.wait() for c in children], flush=True)
"""

INETD_CLIENT = r"""
import hashlib, os, socket, sys, threading
port = int(sys.argv[1])
for i in range(3):
    sock = socket.create_connection(("127.0.0.1", port))
    data = os.urandom(300_000 + i)
    sock.sendall(data)
    sock.shutdown(socket.SHUT_WR)
    reply = b""
    while chunk := sock.recv(65536):
        reply += chunk
    assert reply.decode().split() == [str(len(data)), hashlib.sha256(data).hexdigest()], reply
    sock.close()
sock = socket.create_connection(("127.0.0.1", port))
data = os.urandom(3_000_000)  # streamed both ways at once: more than every buffer on the way
def send():
    sock.sendall(data)
    sock.shutdown(socket.SHUT_WR)
threading.Thread(target=send).start()
back = bytearray()
while chunk := sock.recv(1 << 20):
    back += chunk
assert back == data, (len(back), len(data))
print("INETD OK", flush=True)
"""


def test_an_inetd_style_server_gives_the_connection_to_its_child(nocfg: PrivateSmcd) -> None:
    """``subprocess.Popen(cmd, stdin=conn, stdout=conn)`` on an SMC connection, the parent
    closing its copy at once, and ``stdin=conn.fileno()``: the child reads and writes the
    connection (through a relay process that smc-run forks; the connection's fileno() is an
    eventfd, from which the child used to read nothing while its output vanished). The relays
    end with their connections."""
    client, sout, serr = _talk(nocfg, INETD_SERVER, INETD_CLIENT)
    assert client.returncode == 0 and client.stdout == "INETD OK\n", (client.stderr, serr)
    assert sout == "RC [0, 0, 0]\n", (sout, serr)
    assert _modes(client.stderr) == [("connect", "smcd", None)] * 4, client.stderr
    assert _modes(serr) == [("accept", "smcd", None)] * 4, serr
    _relays_end("inetd-style-server-marker")


EXEC_SERVER = r"""
import os, socket, sys  # exec-inherit-marker
ECHO = ("import os, sys\nfd = int(sys.argv[1])\n"
        "while d := os.read(fd, 65536):\n    os.write(fd, d.upper())")
lsock = socket.create_server(("127.0.0.1", 0))
print("PORT", lsock.getsockname()[1], flush=True)
conn, _ = lsock.accept()
fd = conn.fileno()
os.set_inheritable(fd, True)  # the number is named to the program that comes
try:
    os.execv("/nonexistent/program", ["program"])
except OSError as e:
    print("EXEC FAILED", e.errno, flush=True)
conn.sendall(b"parent still here\n")  # a failed exec leaves the connection as it was
pid = os.fork()
if pid == 0:  # python -S: no smc-run in it, as any other program that is not Python
    os.execv(sys.executable, [sys.executable, "-S", "-c", ECHO, str(fd)])
conn.close()
_, status = os.waitpid(pid, 0)
print("CHILD", os.waitstatus_to_exitcode(status), flush=True)
"""

EXEC_CLIENT = r"""
import socket, sys, threading
sock = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
data = b"exec me " * 300_000
def send():
    sock.sendall(data)
    sock.shutdown(socket.SHUT_WR)
threading.Thread(target=send).start()
got = bytearray()
while chunk := sock.recv(1 << 20):
    got += chunk
head = b"parent still here\n"
assert got[: len(head)] == head, got[:40]
assert got[len(head):] == data.upper(), (len(got), len(data))
print("EXEC OK", flush=True)
"""


def test_a_program_execed_with_the_inherited_descriptor_talks_over_it(
    nocfg: PrivateSmcd,
) -> None:
    """A server makes the connection's ``fileno()`` inheritable and ``exec``s a program that
    is given the number (here ``python -S``, which runs nothing of smc-run, as any program
    that is not Python): the program reads and writes the connection through a relay's socket
    at that number (it found the channel's eventfd there and failed with EINVAL). An exec that
    fails leaves the connection as it was. The relay ends with the connection."""
    client, sout, serr = _talk(nocfg, EXEC_SERVER, EXEC_CLIENT)
    assert client.returncode == 0 and client.stdout == "EXEC OK\n", (client.stderr, serr)
    assert sout == "EXEC FAILED 2\nCHILD 0\n", (sout, serr)
    assert _modes(client.stderr) == [("connect", "smcd", None)], client.stderr
    assert _modes(serr) == [("accept", "smcd", None)], serr
    _relays_end("exec-inherit-marker")


CGI_SCRIPT = """#!/usr/bin/python3
import os, sys
body = sys.stdin.buffer.read(int(os.environ.get("CONTENT_LENGTH") or 0))
sys.stdout.write("Content-Type: text/plain\\r\\n\\r\\n")
sys.stdout.write("%d %s\\n" % (len(body), body[:12].decode()))
"""

CGI_CLIENT = r"""
import sys, urllib.request
for i in range(3):
    body = b"posted body %d " % i * 5000
    r = urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/cgi-bin/echo.py", data=body)
    print(r.status, r.read().decode().strip(), flush=True)
"""


def test_the_cgi_server_of_http_server_runs_its_scripts_over_smcd(nocfg: PrivateSmcd) -> None:
    """``python -m http.server --cgi``: for each request the handler forks, ``os.dup2``s the
    connection's ``fileno()`` onto the script's stdin and stdout and ``exec``s it; the parent
    then drains the request's leftovers with ``select`` and reads. Under smc-run the script gets
    a relay's socket, and the parent's copy, which the relay owns, polls not readable (as the
    TCP socket's would); no request fails."""
    root = Path(tempfile.mkdtemp(prefix="smcd-cgi-", dir="/tmp"))
    try:
        (root / "cgi-bin").mkdir()
        script = root / "cgi-bin" / "echo.py"
        script.write_text(CGI_SCRIPT)
        for path, mode in ((root, 0o755), (root / "cgi-bin", 0o755), (script, 0o755)):
            path.chmod(mode)  # the handler runs scripts as nobody
        env = _env(nocfg)
        argv = [os.fspath(SMC_RUN), "-v", os.fspath(PYTHON), "-m", "http.server", "--cgi",
                "--bind", "127.0.0.1", "--directory", os.fspath(root), "0"]  # fmt: skip
        server = subprocess.Popen(argv, env={**env, "PYTHONUNBUFFERED": "1"}, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
        try:
            assert server.stdout is not None
            port = re.search(r"port (\d+)", server.stdout.readline())
            assert port, "http.server did not say its port"
            client = subprocess.run(_smc_run(env, CGI_CLIENT, port[1]), capture_output=True,
                                    text=True, env=env, timeout=60)  # fmt: skip
        finally:
            server.terminate()
            _, serr = server.communicate(timeout=30)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    expected = ["200 70000 posted body"] * 3  # 5000 x "posted body N ", its first 12 bytes
    assert client.stdout.splitlines() == expected, (client.stdout, client.stderr, serr)
    assert _modes(client.stderr) == [("connect", "smcd", None)] * 3, client.stderr
    assert [m for m in _modes(serr) if m[0] == "accept"] == [("accept", "smcd", None)] * 3, serr
    assert "Traceback" not in serr and "Exception" not in serr, serr


PASSING_SERVER = r"""
import multiprocessing, os, socket, subprocess, sys  # passing-server-marker
from multiprocessing import reduction
def is_eventfd(fd):
    return os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:[eventfd]"
ECHO = ("import socket, sys\n"
        "s = socket.socket(fileno=int(sys.argv[1]))\n"
        "while d := s.recv(65536):\n"
        "    s.sendall(d)\n"
        "s.close()\n")
def serve(c):  # a worker: echo until EOF
    while d := c.recv(65536):
        c.sendall(d)
    c.close()
unix_parent, unix_worker = socket.socketpair()
pipe_parent, pipe_worker = multiprocessing.Pipe()
if os.fork() == 0:  # a worker forked before any connection: it gets each one passed to it
    unix_parent.close()
    _, fds, _, _ = socket.recv_fds(unix_worker, 1, 1)
    serve(socket.socket(fileno=fds[0]))
    serve(socket.socket(fileno=reduction.recv_handle(pipe_worker)))
    os._exit(0)
lsock = socket.create_server(("127.0.0.1", 0))
print("PORT", lsock.getsockname()[1], flush=True)
conn, _ = lsock.accept()  # 1: SCM_RIGHTS through socket.send_fds
assert is_eventfd(conn.fileno())
socket.send_fds(unix_parent, [b"c"], [conn.fileno()])
conn.close()
conn, _ = lsock.accept()  # 2: multiprocessing's handle passing
reduction.send_handle(pipe_parent, conn.fileno(), os.getpid())
conn.close()
conn, _ = lsock.accept()  # 3: a child with the descriptor in pass_fds (and as its stderr)
fd = conn.fileno()
child = subprocess.Popen([sys.executable, "-c", ECHO, str(fd)], pass_fds=[fd], stderr=conn)
print("AFTER POPEN", fd == conn.fileno() and is_eventfd(fd), flush=True)
rc = child.wait()  # our copy holds the connection on meanwhile, as a TCP socket's would
conn.close()
conn, _ = lsock.accept()  # 4: a child that inherits the descriptor (close_fds=False)
fd = conn.fileno()
os.set_inheritable(fd, True)
child = subprocess.Popen([sys.executable, "-c", ECHO, str(fd)], close_fds=False)
print("INHERITED", os.get_inheritable(fd) and is_eventfd(fd), flush=True)
rc4 = child.wait()
conn.close()
print("RC", rc, rc4, os.waitstatus_to_exitcode(os.wait()[1]), flush=True)
"""

PASSING_CLIENT = r"""
import hashlib, os, socket, sys, threading
port = int(sys.argv[1])
for i in range(int(sys.argv[2])):
    sock = socket.create_connection(("127.0.0.1", port))
    data = os.urandom(1_000_000 + i)
    def send():
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
    t = threading.Thread(target=send)
    t.start()
    back = bytearray()
    while chunk := sock.recv(1 << 20):
        back += chunk
    t.join()
    assert back == data, (i, len(back), len(data))
    sock.close()
print("PASSING OK", flush=True)
"""


def test_a_connection_passed_to_another_process_works_there(nocfg: PrivateSmcd) -> None:
    """An accepted SMC connection passed on as TCP sockets are: with SCM_RIGHTS
    (``socket.send_fds``), with ``multiprocessing``'s handle passing, and in a child's
    ``pass_fds`` (and as its stderr: one relay serves both), and inherited by a child started
    with ``close_fds=False`` once made inheritable. The receiver used to get the
    channel's eventfd, useless as a socket; under smc-run it gets a relay's socket (the pass_fds
    child at the very number it was given, which is the parent's eventfd again once Popen
    returns), and 1 MB echoes intact both ways."""
    client, sout, serr = _talk(nocfg, PASSING_SERVER, PASSING_CLIENT, 4)
    assert client.returncode == 0 and client.stdout == "PASSING OK\n", (client.stderr, serr)
    assert sout == "AFTER POPEN True\nINHERITED True\nRC 0 0 0\n", (sout, serr)
    assert _modes(client.stderr) == [("connect", "smcd", None)] * 4, client.stderr
    assert _modes(serr) == [("accept", "smcd", None)] * 4, serr
    _relays_end("passing-server-marker")


FD_SERVER = r"""
import fcntl, os, select, socket, struct, termios
lsock = socket.create_server(("127.0.0.1", 0))
print("PORT", lsock.getsockname()[1], flush=True)
conn, _ = lsock.accept()
fd = conn.fileno()
total, seen = 0, []
while True:
    select.select([fd], [], [])
    avail = bytearray(4)  # FIONREAD both ways: into a mutable buffer, and as bytes back
    assert fcntl.ioctl(fd, termios.FIONREAD, avail) == 0
    (avail,) = struct.unpack("i", avail)
    (again,) = struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0" * 4))
    data = os.read(fd, 1 << 20)
    if not data:
        assert avail == again == 0, (avail, again)
        break
    assert avail >= 1 and again >= avail, (avail, again)
    seen.append(avail)
    total += len(data)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
(outq,) = struct.unpack("i", fcntl.ioctl(fd, termios.TIOCOUTQ, b"\0" * 4))
conn.close()
print("TOTAL", total, "FIONREAD", bool(seen), "OUTQ", outq >= 0, flush=True)
"""

FD_CLIENT = r"""
import hashlib, os, socket, sys, threading
sock = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
fd = sock.fileno()
sock.settimeout(5)  # O_NONBLOCK on a TCP socket: read(2) does not wait
try:
    os.read(fd, 10)
except BlockingIOError:
    print("EAGAIN", flush=True)
sock.settimeout(None)
data = os.urandom(3_000_000)
def send():
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view[:100_000]):]
    sock.shutdown(socket.SHUT_WR)
t = threading.Thread(target=send)
t.start()
back = bytearray()
while chunk := os.read(fd, 65536):
    back += chunk
t.join()
assert len(back) == len(data) and back == data, (len(back), len(data))
sock.close()
print("FD OK", flush=True)
"""


def test_os_read_write_and_fionread_on_the_descriptor_act_on_the_connection(
    nocfg: PrivateSmcd,
) -> None:
    """``os.read``/``os.write``/``fcntl.ioctl(FIONREAD)`` on a connection's ``fileno()``, as
    programs use them on a TCP socket's descriptor, run first on plain TCP (the oracle) and then
    under smc-run. An SMC connection's number is the channel's eventfd: ``os.read`` returned its
    8-byte counter as if it were data, ``os.write`` of 8 bytes vanished into the counter, and
    FIONREAD failed with ENOTTY. Now 3 MB echo intact both ways."""
    client, tout, terr = _talk_tcp(nocfg, FD_SERVER, FD_CLIENT)
    assert client.stdout == "EAGAIN\nFD OK\n", ("tcp", client.stderr, terr)
    assert tout == "TOTAL 3000000 FIONREAD True OUTQ True\n", ("tcp", tout, terr)
    client, sout, serr = _talk(nocfg, FD_SERVER, FD_CLIENT)
    assert client.returncode == 0 and client.stdout == "EAGAIN\nFD OK\n", (client.stderr, serr)
    assert sout == "TOTAL 3000000 FIONREAD True OUTQ True\n", (sout, serr)
    assert _modes(client.stderr) == [("connect", "smcd", None)], client.stderr
    assert _modes(serr) == [("accept", "smcd", None)], serr


FDOPEN_SERVER = r"""
import os, socket
lsock = socket.create_server(("127.0.0.1", 0))
print("PORT", lsock.getsockname()[1], flush=True)
conn, _ = lsock.accept()
# the inetd/C idiom: files made of the socket's descriptor, text in, binary out
rfile = os.fdopen(conn.fileno(), "r", encoding="utf-8", closefd=False)
wfile = open(conn.fileno(), "wb", buffering=0, closefd=False)
lines = 0
for line in rfile:
    if line == "END\n":
        break
    wfile.write(line.upper().encode())
    lines += 1
wfile.write(b"%d lines\n" % lines)
rfile.close()
wfile.close()
raw = open(conn.fileno(), "wb")  # closefd: closing it closes the connection
raw.write(b"last\n")
raw.flush()
print("SERVED", lines, raw.name == conn.fileno(), raw.raw.mode, flush=True)
raw.close()
"""

FDOPEN_CLIENT = r"""
import io, os, socket, sys
sock = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
out = open(sock.fileno(), "w", buffering=1, closefd=False)  # line-buffered text
back = os.fdopen(sock.fileno(), "rb", closefd=False)
for i in range(3000):
    out.write(f"line {i} of some text\n")
out.write("END\n")
got = [back.readline() for _ in range(3001)]
bad = [g for i, g in enumerate(got[:3000]) if g != f"LINE {i} OF SOME TEXT\n".encode()]
assert not bad, bad[:3]
assert got[3000] == b"3000 lines\n", got[3000]
assert back.readline() == b"last\n"
assert back.read() == b""  # the server's file closed the connection
sock.settimeout(5)  # O_NONBLOCK: a file's read of nothing gives None, as FileIO's
out.close()
back.close()
sock.close()
print("FDOPEN OK", flush=True)
"""


def test_files_opened_on_the_descriptor_read_and_write_the_connection(
    nocfg: PrivateSmcd,
) -> None:
    """``os.fdopen(sock.fileno())`` and ``open(sock.fileno())`` (text and binary, buffered,
    line-buffered and unbuffered, ``closefd`` either way), run first on plain TCP (the
    oracle), then under smc-run: unpatched, such a file read the channel eventfd's 8-byte
    counter as data and then EOF, and what it wrote was lost. Now 3,000 lines go and come back
    intact, and a file that owns the descriptor closes the connection with it."""
    client, tout, terr = _talk_tcp(nocfg, FDOPEN_SERVER, FDOPEN_CLIENT)
    assert client.stdout == "FDOPEN OK\n", ("tcp", client.stderr, terr)
    assert tout == "SERVED 3000 True wb\n", ("tcp", tout, terr)
    client, sout, serr = _talk(nocfg, FDOPEN_SERVER, FDOPEN_CLIENT)
    assert client.returncode == 0 and client.stdout == "FDOPEN OK\n", (client.stderr, serr)
    assert sout == "SERVED 3000 True wb\n", (sout, serr)
    assert _modes(client.stderr) == [("connect", "smcd", None)], client.stderr
    assert _modes(serr) == [("accept", "smcd", None)], serr


DUP_SERVER = r"""
import fcntl, os, socket, stat
lsock = socket.create_server(("127.0.0.1", 0))
print("PORT", lsock.getsockname()[1], flush=True)
conn, _ = lsock.accept()
d = os.dup(conn.fileno())  # another number for the descriptor: reads the same stream
socky = all(stat.S_ISSOCK(os.fstat(n).st_mode) for n in (conn.fileno(), d))
first = os.read(d, 5)
f = os.fdopen(os.dup(conn.fileno()), "rb")  # a file that owns only its copy
line = f.readline()
f.close()  # closes that copy: the connection goes on
e = fcntl.fcntl(conn.fileno(), fcntl.F_DUPFD_CLOEXEC, 200)
conn.sendall(b"still open\n")
more = os.read(e, 4)
os.close(e)
os.close(d)
r, w = os.pipe()  # (takes the numbers just closed)
os.write(w, b"pipe")
piped = os.read(r, 4)  # the pipe's, not the connection's: the copy was forgotten
print(first, line, e >= 200, more, piped, r in (d, e) or w in (d, e), socky, flush=True)
conn.close()
"""

DUP_CLIENT = r"""
import socket, sys
sock = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
sock.sendall(b"hello")
sock.sendall(b"line two\n")
got = b""
while not got.endswith(b"\n"):
    got += sock.recv(100)
sock.sendall(b"tail")
assert sock.recv(10) == b""
print(got.decode().strip(), flush=True)
"""


def test_copies_of_the_descriptor_read_and_write_the_connection(nocfg: PrivateSmcd) -> None:
    """``os.dup``/``fcntl(F_DUPFD_CLOEXEC)`` of a connection's ``fileno()`` and
    ``os.fdopen(os.dup(...))``, first on plain TCP (the oracle), then under smc-run: a read
    through a copy reads the stream (it read the channel eventfd's 8-byte counter as data, and
    a file of a copy failed with EINVAL), closing a copy leaves the connection open, a number
    that was a copy and now is a pipe reads the pipe, and ``os.fstat`` of the number or a copy
    says socket (it said the eventfd's anonymous inode)."""
    client, tout, terr = _talk_tcp(nocfg, DUP_SERVER, DUP_CLIENT)
    expected = "b'hello' b'line two\\n' True b'tail' b'pipe' True True\n"
    assert client.stdout == "still open\n" and tout == expected, ("tcp", tout, terr)
    client, sout, serr = _talk(nocfg, DUP_SERVER, DUP_CLIENT)
    assert client.returncode == 0 and client.stdout == "still open\n", (client.stderr, serr)
    assert sout == expected, (sout, serr)
    assert _modes(client.stderr) == [("connect", "smcd", None)], client.stderr
    assert _modes(serr) == [("accept", "smcd", None)], serr


FCNTL_SERVER = r"""
import socket
lsock = socket.create_server(("127.0.0.1", 0))
print("PORT", lsock.getsockname()[1], flush=True)
conn, _ = lsock.accept()
while data := conn.recv(100):
    conn.sendall(data)
conn.close()
"""

FCNTL_CLIENT = r"""
import fcntl, os, socket, sys
sock = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
fd = sock.fileno()

def state():
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    return os.get_blocking(fd), bool(flags & os.O_NONBLOCK), flags & os.O_ACCMODE == os.O_RDWR

def tries():
    try:
        return repr(sock.recv(10))
    except BlockingIOError:
        return "EAGAIN"

def echo(b):
    sock.sendall(b)
    got = b""
    while len(got) < len(b):
        got += sock.recv(len(b) - len(got))
    return got.decode()

print("fresh", state(), sock.gettimeout())
os.set_blocking(fd, False)
print("set_blocking(False)", state(), sock.gettimeout(), tries())
os.set_blocking(fd, True)
print("set_blocking(True)", state(), echo(b"a"))
saved = fcntl.fcntl(fd, fcntl.F_GETFL)
fcntl.fcntl(sock, fcntl.F_SETFL, saved | os.O_NONBLOCK)
print("F_SETFL O_NONBLOCK", state(), tries())
try:
    os.read(fd, 5)
    print("os.read read")
except BlockingIOError:
    print("os.read EAGAIN")
fcntl.fcntl(fd, fcntl.F_SETFL, saved)
print("F_SETFL restored", state(), echo(b"bc"))
os.set_blocking(fd, False)
sock.settimeout(None)
print("settimeout(None) after", state(), echo(b"d"))
sock.settimeout(5)
print("settimeout(5)", state())
sock.setblocking(True)
print("setblocking(True)", state(), echo(b"e"))
print("writev", os.writev(fd, [b"hel", memoryview(b"lo"), bytearray(b"!")]))
first, rest = bytearray(2), bytearray(10)
n = os.readv(fd, [first, rest])
print("readv", n, bytes(first), bytes(rest[: n - 2]))
sock.close()
print("DONE")
"""


def test_fcntl_and_os_set_blocking_on_the_descriptor_act_on_the_connection(
    nocfg: PrivateSmcd,
) -> None:
    """``os.set_blocking``/``os.get_blocking``, ``fcntl.fcntl(F_GETFL/F_SETFL)`` and
    ``os.readv``/``os.writev`` on a connection's ``fileno()``, as generic descriptor code uses
    them on a TCP socket's (and as C programs make a socket non-blocking), first on plain TCP
    (the oracle), then under smc-run, which must print the same. The number is the channel's
    eventfd, always non-blocking: a blocking socket said ``O_NONBLOCK``, and setting it
    changed nothing, so a read that TCP fails with EAGAIN waited for good; ``writev`` failed
    with EINVAL (8 bytes in all would have vanished into the counter) and ``readv`` read the
    counter."""
    tcp, _, _ = _talk_tcp(nocfg, FCNTL_SERVER, FCNTL_CLIENT)
    assert tcp.returncode == 0 and tcp.stdout.endswith("DONE\n"), tcp.stderr
    assert "EAGAIN" in tcp.stdout and "os.read EAGAIN" in tcp.stdout, tcp.stdout
    client, _sout, serr = _talk(nocfg, FCNTL_SERVER, FCNTL_CLIENT)
    assert client.returncode == 0, (client.stderr, serr)
    assert client.stdout == tcp.stdout, (client.stdout, tcp.stdout)
    assert _modes(client.stderr) == [("connect", "smcd", None)], client.stderr
    assert _modes(serr) == [("accept", "smcd", None)], serr


SENDFILE_SERVER = r"""
import hashlib, os, socket, sys, tempfile
data = os.urandom(3_000_000)
with tempfile.TemporaryFile() as f:
    f.write(data)
    f.flush()
    lsock = socket.create_server(("127.0.0.1", 0))
    print("PORT", lsock.getsockname()[1], flush=True)
    conn, _ = lsock.accept()
    fd = conn.fileno()
    # 1. explicit offsets, as servers of files do it (the file's position stays put)
    f.seek(123)
    off = 0
    while off < len(data):
        off += os.sendfile(fd, f.fileno(), off, len(data) - off)
    assert f.tell() == 123, f.tell()
    # 2. offset None: from the file's position, which moves by what was sent
    f.seek(1_000_000)
    while n := os.sendfile(fd, f.fileno(), None, 1 << 30):
        pass
    assert f.tell() == len(data), f.tell()
    # 3. a pipe as the source: EINVAL toward a TCP socket (nothing read from the pipe)
    r, w = os.pipe()
    os.write(w, b"p" * 100)
    try:
        os.sendfile(fd, r, None, 65536)
        print("PIPE sent", flush=True)
    except OSError as e:
        print("PIPE", e.errno, len(os.read(r, 1000)), flush=True)
    os.close(r)
    os.close(w)
    conn.shutdown(socket.SHUT_WR)
    print("SENT", hashlib.sha256(data + data[1_000_000:]).hexdigest(), flush=True)
    conn.recv(1)
    conn.close()
"""

SENDFILE_CLIENT = r"""
import hashlib, socket, sys
sock = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
got = bytearray()
while chunk := sock.recv(1 << 20):
    got += chunk
sock.close()
print("GOT", len(got), hashlib.sha256(got).hexdigest(), flush=True)
"""


def test_os_sendfile_into_the_descriptor_sends_over_the_connection(nocfg: PrivateSmcd) -> None:
    """``os.sendfile(sock.fileno(), file, ...)``, as file servers call it themselves (with an
    offset, with the file's position; a pipe is refused), first on plain TCP (the oracle),
    then under smc-run. The descriptor of an SMC connection is an eventfd, which sendfile(2)
    refuses: the server failed with EINVAL and the client got nothing. Now every byte arrives,
    in order."""
    tcp, tout, terr = _talk_tcp(nocfg, SENDFILE_SERVER, SENDFILE_CLIENT)
    want = 3_000_000 + 2_000_000
    assert tout.startswith("PIPE 22 100\nSENT "), (tout, terr)
    digest = tout.split()[-1]
    assert tcp.stdout == f"GOT {want} {digest}\n", (tcp.stdout, tout, terr)
    client, sout, serr = _talk(nocfg, SENDFILE_SERVER, SENDFILE_CLIENT)
    assert client.returncode == 0, (client.stderr, serr)
    assert sout.startswith("PIPE 22 100\nSENT "), (sout, serr)
    digest = sout.split()[-1]
    assert client.stdout == f"GOT {want} {digest}\n", (client.stdout, sout, serr)
    assert _modes(client.stderr) == [("connect", "smcd", None)], client.stderr
    assert _modes(serr) == [("accept", "smcd", None)], serr


NONBLOCKING_CLIENT = r"""
import errno, selectors, socket, sys
sel = selectors.DefaultSelector()
sock = socket.socket()
sock.setblocking(False)
assert sock.connect_ex(("127.0.0.1", int(sys.argv[1]))) in (0, errno.EINPROGRESS)
sel.register(sock, selectors.EVENT_WRITE)
assert sel.select(10)
sel.unregister(sock)
assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0
sock.setblocking(True)
sock.sendall(b"ping")
sock.shutdown(socket.SHUT_WR)
got = b""
while chunk := sock.recv(100):
    got += chunk
print(got.decode(), flush=True)
"""


def test_a_non_blocking_connect_says_why_it_stays_on_tcp(nocfg: PrivateSmcd) -> None:
    """A program's own event loop connects without blocking: smc-run leaves that connection on
    TCP (the program watches the TCP descriptor) and ``-v`` says so, where it said nothing;
    the server falls back as soon as the client's first bytes are not a Proposal."""
    client, _sout, serr = _talk(nocfg, FCNTL_SERVER, NONBLOCKING_CLIENT)
    assert client.returncode == 0 and client.stdout == "ping\n", (client.stderr, serr)
    modes = _modes(client.stderr)
    assert len(modes) == 1 and modes[0][:2] == ("connect", "tcp"), client.stderr
    assert "non-blocking connect" in (modes[0][2] or ""), client.stderr
    assert [m[:2] for m in _modes(serr)] == [("accept", "tcp")], serr


NONBLOCKING_LISTENER = r"""
import selectors, socket
lsock = socket.socket()
lsock.setblocking(False)  # before listen(): a select loop of the program's own
lsock.bind(("127.0.0.1", 0))
lsock.listen()
print("PORT", lsock.getsockname()[1], flush=True)
sel = selectors.DefaultSelector()
sel.register(lsock, selectors.EVENT_READ)
assert sel.select(10)
conn, _ = lsock.accept()
conn.setblocking(True)
while data := conn.recv(100):
    conn.sendall(data)
conn.close()
"""

PING_CLIENT = r"""
import socket, sys
sock = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
sock.sendall(b"ping")
sock.shutdown(socket.SHUT_WR)
got = b""
while chunk := sock.recv(100):
    got += chunk
print(got.decode(), flush=True)
"""


def test_a_listener_non_blocking_before_listen_says_why_it_stays_on_tcp(
    nocfg: PrivateSmcd,
) -> None:
    """A select loop's listener made non-blocking before ``listen()`` is not registered (a
    handoff would wait on the program's loop): its connections stay on TCP, and ``-v`` says
    so for each accepted one, where it said nothing; its client falls back at once, before
    any CLC byte (no listener registered at that port)."""
    client, _sout, serr = _talk(nocfg, NONBLOCKING_LISTENER, PING_CLIENT)
    assert client.returncode == 0 and client.stdout == "ping\n", (client.stderr, serr)
    modes = _modes(serr)
    assert len(modes) == 1 and modes[0][:2] == ("accept", "tcp"), serr
    assert "a listener already non-blocking when it began listening" in (modes[0][2] or ""), serr
    (connect,) = _modes(client.stderr)
    assert connect[:2] == ("connect", "tcp") and "PEERNOSMC" in (connect[2] or ""), client.stderr


SLOW_READER = r"""
import hashlib, socket, time
lsock = socket.create_server(("127.0.0.1", 0))
print("PORT", lsock.getsockname()[1], flush=True)
conn, _ = lsock.accept()
digest, total = hashlib.sha256(), 0
while data := conn.recv(65536):
    digest.update(data)
    total += len(data)
    time.sleep(0.0005)  # a reader slower than its writer
conn.close()
print("READ", total, digest.hexdigest(), flush=True)
"""

SELECTORS_WRITER = r"""
import hashlib, os, select, selectors, socket, sys
sock = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
sock.setblocking(False)
data = os.urandom(1 << 20) * 24
view, waits, idle = memoryview(data), 0, 0
for sel in (selectors.DefaultSelector(), selectors.SelectSelector()):
    sel.register(sock, selectors.EVENT_WRITE)
    end = len(view) // 2 if waits == 0 else 0
    while len(view) > end:
        try:
            view = view[sock.send(view[:65536]):]
        except BlockingIOError:
            assert sel.select(30), "no room within 30 s"
            waits += 1
            try:
                view = view[sock.send(view[:65536]):]
            except BlockingIOError:
                idle += 1  # woken without room: a spin
    sel.close()
sock.setblocking(True)
sock.close()
digest = hashlib.sha256(data).hexdigest()
print("WROTE", len(data), digest, "WAITS", waits, "IDLE", idle, flush=True)
"""


def _to_slow_reader(daemon: PrivateSmcd, writer: str) -> list[tuple[str, list[str]]]:
    """``writer`` (given the port) to :data:`SLOW_READER`, first on plain TCP (the oracle),
    then both under smc-run: for each, what the writer printed (``WROTE n sha256 ...``), once
    every byte arrived intact and each end was on the transport it should be."""
    out = []
    for kind in ("tcp", "smcd"):
        if kind == "tcp":
            client, sout, serr = _talk_tcp(daemon, SLOW_READER, writer, timeout=120)
        else:
            client, sout, serr = _talk(daemon, SLOW_READER, writer)
            assert _modes(client.stderr) == [("connect", "smcd", None)], client.stderr
            assert _modes(serr) == [("accept", "smcd", None)], serr
        assert client.returncode == 0, (kind, client.stderr, serr)
        wrote = client.stdout.split()
        assert wrote[0] == "WROTE", (kind, wrote)
        assert sout.split() == ["READ", wrote[1], wrote[2]], (kind, wrote, sout)
        out.append((kind, wrote))
    return out


def test_a_non_blocking_writer_waits_for_room_instead_of_spinning(nocfg: PrivateSmcd) -> None:
    """A stdlib program that writes non-blocking and waits in ``selectors`` for ``EVENT_WRITE``
    (epoll, then select) when a send meets a full buffer, to a reader slower than it: on TCP
    (the oracle) and under smc-run, every byte arrives, the writer waits, and a wait ends only
    with room. Before smc-run's readiness wrappers, an SMC connection's ``fileno()`` (an
    eventfd) polled writable at once: every wait found no room, ~300,000 of them for these
    24 MiB, a CPU burnt until the reader caught up."""
    results = [(kind, int(w[4]), int(w[6])) for kind, w in _to_slow_reader(nocfg, SELECTORS_WRITER)]
    for _kind, waits, idle in results:
        assert waits >= 1, results  # the reader was the slower side: the writer waited
        assert idle <= 2 + waits // 50, results  # each wait ended with room


EPOLL_WRITER = r"""
import hashlib, os, select, socket, sys
sock = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
sock.setblocking(False)
data = os.urandom(1 << 20) * 8
view, waits = memoryview(data), 0
ep = select.epoll()
for how in (select.EPOLLET, select.EPOLLONESHOT):
    ep.register(sock.fileno(), select.EPOLLOUT | how)
    end = len(view) // 2 if how == select.EPOLLET else 0
    while len(view) > end:
        try:
            while len(view) > end:
                view = view[sock.send(view[:65536]):]
        except BlockingIOError:
            assert ep.poll(30), "no EPOLLOUT within 30 s of a full send buffer"
            waits += 1
            if how == select.EPOLLONESHOT:
                ep.modify(sock.fileno(), select.EPOLLOUT | how)
    ep.unregister(sock.fileno())
sock.setblocking(True)
sock.close()
print("WROTE", len(data), hashlib.sha256(data).hexdigest(), "WAITS", waits, flush=True)
"""


def test_an_edge_triggered_or_one_shot_epoll_writer_is_woken_by_room(nocfg: PrivateSmcd) -> None:
    """A stdlib program that writes non-blocking and, at ``EAGAIN``, waits in a raw
    ``select.epoll`` registered ``EPOLLET`` (then ``EPOLLONESHOT``) for ``EPOLLOUT``, to a reader
    that only reads: on TCP (the oracle) and under smc-run every byte arrives. Before, the
    eventfd's edge came only when the peer sent something: the edge-triggered writer waited for
    an edge that never came."""
    for kind, wrote in _to_slow_reader(nocfg, EPOLL_WRITER):
        assert int(wrote[4]) >= 2, (kind, wrote)  # it waited, both ways


PICKLING_SERVER = r"""
import multiprocessing, os, socket, sys, tempfile  # pickling-server-marker
def serve(c):  # in a worker: echo until EOF
    while d := c.recv(65536):
        c.sendall(d)
    c.close()
    return c.family.name
def from_queue(q):
    return serve(q.get())
if __name__ == "__main__":
    # a spawned child imports its target: a module of its own (a -c program's are not)
    home = tempfile.mkdtemp()
    with open(os.path.join(home, "spawned_echo.py"), "w") as f:
        f.write("def serve(c):\n    while d := c.recv(65536):\n        c.sendall(d)\n")
    sys.path.insert(0, home)
    import spawned_echo
    pool = multiprocessing.Pool(1)  # workers forked before any connection
    queue = multiprocessing.Queue()
    worker = multiprocessing.Process(target=from_queue, args=(queue,))
    worker.start()
    lsock = socket.create_server(("127.0.0.1", 0))
    print("PORT", lsock.getsockname()[1], flush=True)
    conn, _ = lsock.accept()  # 1: a Pool task's argument
    print("POOL", pool.apply(serve, (conn,)), flush=True)
    conn.close()
    conn, _ = lsock.accept()  # 2: through a Queue
    queue.put(conn)
    worker.join()
    conn.close()
    print("QUEUE", worker.exitcode, flush=True)
    pool.close()
    pool.join()
    conn, _ = lsock.accept()  # 3: a spawned Process's argument (passed when it starts)
    spawned = multiprocessing.get_context("spawn").Process(target=spawned_echo.serve,
                                                           args=(conn,))
    spawned.start()
    conn.close()
    spawned.join()
    print("SPAWN", spawned.exitcode, flush=True)
    import shutil
    shutil.rmtree(home)  # (the module it made for the spawned child)
"""


def test_multiprocessing_pickles_a_connection_for_its_workers(nocfg: PrivateSmcd) -> None:
    """``multiprocessing`` pickles a socket as its descriptor (a Pool task's argument, a
    Queue, a spawned Process's arguments): an SMC connection reaches the worker as a relay's
    socket, not the eventfd (which pickled to ENOTSOCK in the worker, and an accepted SmcSocket
    not at all), and echoes 1 MB intact both ways. The server's copy keeps the connection open
    until it closes it, as a TCP socket's would."""
    client, sout, serr = _talk(nocfg, PICKLING_SERVER, PASSING_CLIENT, 3)
    assert client.returncode == 0 and client.stdout == "PASSING OK\n", (client.stderr, serr)
    assert sout == "POOL AF_UNIX\nQUEUE 0\nSPAWN 0\n", (sout, serr)
    assert _modes(client.stderr) == [("connect", "smcd", None)] * 3, client.stderr
    assert _modes(serr) == [("accept", "smcd", None)] * 3, serr
    _relays_end("pickling-server-marker")


POOL_CLIENT = r"""
import multiprocessing, os, socket, sys  # pool-client-marker
def talk(sock):  # in a worker: 1 MB there and back, then EOF
    data = os.urandom(1_000_000)
    sock.sendall(data)
    sock.shutdown(socket.SHUT_WR)
    back = bytearray()
    while chunk := sock.recv(1 << 20):
        back += chunk
    sock.close()
    return back == data, sock.family.name
if __name__ == "__main__":
    pool = multiprocessing.Pool(1)
    sock = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
    print(pool.apply(talk, (sock,)), flush=True)  # before any use: the handoff is pending
    sock.close()
    pool.close()
    pool.join()
"""


def test_a_client_pickles_its_connection_before_using_it(nocfg: PrivateSmcd) -> None:
    """A client that connects and gives the socket to a Pool worker at once: smc-run's connect()
    has not read smcd's answer yet, and pickling settles it first, so the worker gets the
    relay's socket (it used to get the eventfd: ENOTSOCK) and 1 MB echoes intact."""
    server_argv = _smc_run(_env(nocfg), SERVER, "127.0.0.1", 0, "echo")
    client, server, _, serr = _serve_then_run(nocfg, server_argv, POOL_CLIENT)
    assert client.returncode == 0 and client.stdout == "(True, 'AF_UNIX')\n", client.stderr
    assert _modes(client.stderr) == [("connect", "smcd", None)], client.stderr
    assert server.returncode == 0 and _modes(serr) == [("accept", "smcd", None)], serr
    _relays_end("pool-client-marker")


def _relays_end(marker: str) -> None:
    """The relay processes (forks of the server whose code holds ``marker``) end within 5 s."""
    deadline = time.monotonic() + 5
    while relays := _processes_with(marker):
        assert time.monotonic() < deadline, f"relay processes left: {relays}"
        time.sleep(0.05)


def _processes_with(marker: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if marker.encode() in cmdline and int(pid) != os.getpid():
            found.append(int(pid))
    return found


# --- two hosts ------------------------------------------------------------------------------


def _daemon_in(
    ns: str, work: Path, name: str, config: str = ""
) -> tuple[SmcdProcess, dict[str, str]]:
    """An smcd inside network namespace ``ns`` with no configuration file (or ``config``), its
    own runtime dir, handoff socket and private bus, as ``PrivateSmcd``."""
    run = work / name
    run.mkdir()
    argv = [
        "ip", "netns", "exec", ns, os.fspath(SMCD),
        "--runtime-dir", os.fspath(run), "--state-dir", os.fspath(run / "state"),
        "--handoff-socket", os.fspath(run / "handoff.sock"), "--bus", "private",
        "--log-level", "info",
    ]  # fmt: skip
    if config:
        (run / "smcd.toml").write_text(config)
        argv += ["--config", os.fspath(run / "smcd.toml")]
    proc = SmcdProcess(argv, work / f"{name}.log", NotifySocket(work / f"{name}.notify"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SMCD_", "SMC_RUN"))}
    env |= {"SMCD_HANDOFF_SOCKET": os.fspath(run / "handoff.sock"), "PYTHONPATH": os.fspath(REPO)}
    return proc, env


@pytest.mark.parametrize(
    ("client_config", "client_code", "server_code"),
    [
        # Nothing configured: nothing told the client's smcd that the remote peer speaks SMC
        # (the kernel learns it from the SMC option of the SYN-ACK), so it falls back before
        # proposing, as the kernel does without that option; the server sees plain TCP.
        ("", "SMC_CLC_DECL_PEERNOSMC", "SMC_CLC_DECL_PEERNOSMC"),
        # The peer declared SMC-capable but no common UEID: the client proposes (with its
        # host-local system EID, which is not the other host's), the server declines.
        ('peers = ["198.51.100.0/24"]\n', "SMC_CLC_DECL_PEERDECL", None),
    ],
)
def test_no_configuration_two_hosts_fall_back(
    client_config: str, client_code: str, server_code: str | None
) -> None:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.fail("two hosts need root and ip(8) for network namespaces: run as root with "
                    "iproute2 installed (tests/host/install-deps.sh)")  # fmt: skip
    work = Path(tempfile.mkdtemp(prefix="smcd-twohosts-", dir="/tmp"))
    tag = f"smcfd{os.getpid()}"
    ns_a, ns_b = f"{tag}a", f"{tag}b"
    daemons: list[SmcdProcess] = []
    try:
        sh("ip", "netns", "add", ns_a)
        sh("ip", "netns", "add", ns_b)
        sh("ip", "-n", ns_a, "link", "add", "fda", "type", "veth", "peer", "name", "fdb",
           "netns", ns_b)  # fmt: skip
        sh("ip", "-n", ns_a, "addr", "add", "198.51.100.1/24", "dev", "fda")
        sh("ip", "-n", ns_b, "addr", "add", "198.51.100.2/24", "dev", "fdb")
        for ns, dev in ((ns_a, "fda"), (ns_b, "fdb"), (ns_a, "lo"), (ns_b, "lo")):
            sh("ip", "-n", ns, "link", "set", dev, "up")
        (da, env_a) = _daemon_in(ns_a, work, "a", client_config)
        (db, env_b) = _daemon_in(ns_b, work, "b")
        for d in (da, db):
            daemons.append(d.start())
        for d in (da, db):
            d.wait_ready()
        pair = Pair(
            env_a,
            addr="198.51.100.2",
            server_env=env_b,
            server_netns=ns_b,
            client_netns=ns_a,
            client_mode="rr",
        )
        try:
            assert pair.line() == "RR OK"  # the data is intact on the fallback too
            cerr, serr = pair.finish()
        finally:
            pair.kill()
    finally:
        for d in daemons:
            if d.alive():
                d.stop()
        for ns in (ns_a, ns_b):
            sh("ip", "netns", "del", ns, check=False)
        shutil.rmtree(work, ignore_errors=True)
    (client,), (server,) = _modes(cerr), _modes(serr)
    print(f"two hosts: server {server[2]}; client {client[2]}", file=sys.stderr)
    assert client[:2] == ("connect", "tcp") and server[:2] == ("accept", "tcp"), (cerr, serr)
    declined = re.match(r"(SMC_CLC_DECL_\w+) \((0x[0-9a-f]{8})\)", server[2] or "")
    assert declined, server
    assert (client[2] or "").startswith(client_code), client
    if server_code is not None:
        assert declined[1] == server_code, server
    else:  # the server's decline reached the client as the peer's diagnosis
        assert declined[1] in ("SMC_CLC_DECL_NOUEID", "SMC_CLC_DECL_NOSMCD2DEV"), server
        assert f"peer diagnosis {declined[2]}" in (client[2] or ""), (client, server)


WRAPPING_CLIENT = r"""
import socket, sys
import smc_handoff
sock = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
wrapped = smc_handoff.wrap(sock)  # smc-run already offered it: its answer is pending
assert wrapped is sock and sock.mode == "smcd", (wrapped, sock.mode)
sock.sendall(b"wrapped once")
assert sock.recv(100) == b"wrapped once"
sock.close()
print("WRAP OK", flush=True)
"""


def test_wrapping_a_connection_smc_run_offered_hands_it_off_once(nocfg: PrivateSmcd) -> None:
    """``smc_handoff.wrap`` on a socket whose handoff smc-run started waits for that handoff's
    answer and returns the socket; it does not leave the channel to hand the socket off again."""
    server_argv = _smc_run(_env(nocfg), SERVER, "127.0.0.1", 0, "echo")
    client, server, _, serr = _serve_then_run(nocfg, server_argv, WRAPPING_CLIENT)
    assert client.returncode == 0 and client.stdout == "WRAP OK\n", client.stderr
    assert _modes(client.stderr) == [("connect", "smcd", None)], client.stderr
    assert server.returncode == 0 and _modes(serr) == [("accept", "smcd", None)], serr


BANNER_SERVER = r"""
import socket
lsock = socket.create_server(("127.0.0.1", 0))
print("PORT", lsock.getsockname()[1], flush=True)
for _ in range(2):
    conn, _ = lsock.accept()
    conn.sendall(b"220 ready\r\n")  # the server speaks first (SMTP, FTP, POP3...)
    assert conn.recv(100) == b"QUIT\r\n"
    conn.close()
"""


@pytest.fixture(scope="module")
def long_proposal_wait() -> Iterator[PrivateSmcd]:
    """No configuration but a proposal_wait far past any test's patience."""
    with _started("[timeouts]\nproposal_wait = 60.0\n", "localwait") as daemon:
        yield daemon


def test_a_plain_local_client_of_a_server_that_speaks_first_is_told_apart_by_its_mark(
    long_proposal_wait: PrivateSmcd, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client on this host that does not use smcd (``nc``, another language, a program
    without smc-run) and waits for the server's banner: with no Proposal after a short grace
    the server half asks the kernel (``sock_diag``) whether the client's socket carries the
    handoff mark our library sets before its CONNECT; it does not, so the server half falls back
    then, neither after ``timeouts.local_client_wait`` (0.2 s: every banner used to wait it out)
    nor after ``proposal_wait`` (here 60 s). A client that carries the mark but hands its socket
    over only after ``local_client_wait`` is waited for that long: both ends then fall back
    before any CLC byte, and the banner is intact. A client of smc-run gets SMC."""
    env = _env(long_proposal_wait)
    for key, value in long_proposal_wait.env.items():  # this process's smc_handoff.wrap too
        monkeypatch.setenv(key, value)
    script = BANNER_SERVER.replace("range(2)", "range(3)")
    server = subprocess.Popen(_smc_run(env, script), env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline().split()[1])
        plain = socket.create_connection(("127.0.0.1", port), timeout=20)
        assert plain.recv(100) == b"220 ready\r\n"
        plain.sendall(b"QUIT\r\n")
        plain.close()
        late = socket.socket()
        late.setsockopt(*peer_option.HANDOFF_MARK, 1)  # as smc-run marks before connect()
        late.settimeout(20)
        late.connect(("127.0.0.1", port))
        time.sleep(0.6)  # past local_client_wait (0.2 s): the server half fell back
        late = smc_handoff.wrap(late)
        assert late.mode == "tcp" and late.fallback is not None, late
        assert late.fallback.code == 0x03010000, late.fallback  # PEERNOSMC, before any CLC
        assert late.recv(100) == b"220 ready\r\n"
        late.sendall(b"QUIT\r\n")
        late.close()
        ours = subprocess.run(_smc_run(env, BANNER_CLIENT, str(port)), env=env, text=True,
                              capture_output=True, timeout=60)  # fmt: skip
        assert ours.returncode == 0 and ours.stdout == "BANNER OK\n", ours.stderr
        assert _modes(ours.stderr) == [("connect", "smcd", None)], ours.stderr
        _, serr = server.communicate(timeout=30)
    finally:
        server.kill()
    assert server.returncode == 0, serr
    modes = _modes(serr)
    assert [m[:2] for m in modes] == [("accept", "tcp")] * 2 + [("accept", "smcd")], serr
    lines = [line for line in serr.splitlines() if "accept" in line]
    assert "carries no handoff mark" in lines[0], serr
    assert "timeouts.local_client_wait" in lines[1], serr


BANNER_CLIENT = r"""
import socket, sys
sock = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
assert sock.recv(100) == b"220 ready\r\n"
sock.sendall(b"QUIT\r\n")
sock.close()
print("BANNER OK")
"""


def test_a_local_client_in_peers_gets_the_whole_proposal_wait() -> None:
    """A configured peer on this host may be another SMC stack (hosts simulated in one
    namespace, as the Soft-RoCE VM tests run two daemons), whose Proposal comes when that stack
    sends it: its server half waits all of ``proposal_wait``, not ``local_client_wait``."""
    with _started('peers = ["127.0.0.0/8"]\n[timeouts]\nproposal_wait = 0.5\n', "localpeer") as d:
        env = _env(d)
        server = subprocess.Popen(_smc_run(env, BANNER_SERVER), env=env, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
        try:
            assert server.stdout is not None
            port = int(server.stdout.readline().split()[1])
            for _ in range(2):
                plain = socket.create_connection(("127.0.0.1", port), timeout=20)
                assert plain.recv(100) == b"220 ready\r\n"
                plain.sendall(b"QUIT\r\n")
                plain.close()
            _, serr = server.communicate(timeout=30)
        finally:
            server.kill()
    assert [m[:2] for m in _modes(serr)] == [("accept", "tcp")] * 2, serr
    assert "within 0.5 s (timeouts.proposal_wait)" in serr, serr
    assert "local_client_wait" not in serr, serr


def _test_cert(tmp_path: Path) -> tuple[Path, Path]:
    """A self-signed certificate for localhost and its key (openssl)."""
    openssl = shutil.which("openssl")
    assert openssl, "openssl is needed to make a test certificate (apt-get install openssl)"
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run([openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key,
                    "-out", cert, "-days", "1", "-subj", "/CN=localhost"],
                   check=True, capture_output=True, timeout=60)  # fmt: skip
    return cert, key


STARTTLS_SERVER = r"""
import socket, ssl, sys
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
ctx.load_cert_chain(sys.argv[1], sys.argv[2])
lsock = socket.create_server(("127.0.0.1", 0))
print("PORT", lsock.getsockname()[1], flush=True)
for _ in range(3):
    conn, _ = lsock.accept()
    f = conn.makefile("rb")
    conn.sendall(b"220 ready\r\n")
    assert f.readline() == b"EHLO me\r\n"
    conn.sendall(b"250-hello\r\n250 STARTTLS\r\n")
    assert f.readline() == b"STARTTLS\r\n"
    conn.sendall(b"220 go ahead\r\n")
    f.close()
    with ctx.wrap_socket(conn, server_side=True) as tls:
        data = b""
        while not data.endswith(b"\n"):
            data += tls.recv(65536)
        tls.sendall(b"%d %s\n" % (len(data), tls.version().encode()))
"""

STARTTLS_CLIENT = r"""
import socket, ssl, sys
ctx = ssl.create_default_context(cafile=sys.argv[2])
ctx.check_hostname = False
for i in range(3):
    with socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=20) as raw:
        f = raw.makefile("rb")
        assert f.readline() == b"220 ready\r\n"
        raw.sendall(b"EHLO me\r\n")
        assert f.readline() == b"250-hello\r\n" and f.readline() == b"250 STARTTLS\r\n"
        raw.sendall(b"STARTTLS\r\n")
        assert f.readline() == b"220 go ahead\r\n"
        f.close()
        with ctx.wrap_socket(raw) as tls:
            tls.sendall(b"x" * 100000 + b"\n")
            print(tls.recv(100).decode().strip(), flush=True)
"""


LINK_LOCAL = r"""
import socket
lsock = socket.create_server(("::", 0), family=socket.AF_INET6)
port = lsock.getsockname()[1]
c = socket.create_connection(("fe80::1%d0", port), timeout=10)
s, _ = lsock.accept()
c.sendall(b"hi")
assert s.recv(2) == b"hi"
print(c.mode, s.mode, flush=True)
"""


def test_an_ipv6_link_local_connection_on_one_host_gets_smcd() -> None:
    """A connection to one of this host's IPv6 link-local addresses (``fe80::1%d0``): smcd
    asked "is the peer's address ours?" by binding to it without the interface's scope,
    which a link-local address refuses, so the client half took the wildcard listener for
    someone else's (PEERNOSMC) and the server half waited ``proposal_wait`` (1 s) for nothing.
    smcd runs in a namespace of its own where a veth pair's ``d0`` holds that address."""
    ns = f"smcdll{os.getpid() % 10000}"
    subprocess.run(["ip", "netns", "add", ns], check=True, capture_output=True)
    try:
        for cmd in (["link", "set", "lo", "up"],
                    ["link", "add", "d0", "type", "veth", "peer", "name", "d1"],
                    ["link", "set", "d0", "up"], ["link", "set", "d1", "up"],
                    ["-6", "addr", "add", "fe80::1/64", "dev", "d0", "nodad"]):  # fmt: skip
            subprocess.run(["ip", "-n", ns, *cmd], check=True, capture_output=True)
        in_ns = ("ip", "netns", "exec", ns, os.fspath(REPO / ".venv" / "bin" / "smcd"))
        smcd = PrivateSmcd(config_text="", name="linklocal", command=in_ns)
        try:
            smcd.start()
            env = _env(smcd)
            proc = subprocess.run(_smc_run(env, LINK_LOCAL, netns=ns), capture_output=True,
                                  text=True, env=env, timeout=60)  # fmt: skip
        finally:
            smcd.cleanup()
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout == "smcd smcd\n", proc.stderr[-3000:]


TYPED_SERVER = r"""
import socket
lsock = socket.create_server(("127.0.0.1", 0))
print("PORT", lsock.getsockname()[1], flush=True)
for _ in range(2):
    conn, _ = lsock.accept()
    conn.sendall(conn.recv(100))
    print(type(conn) is socket.socket, isinstance(conn, socket.socket), flush=True)
    conn.close()
"""

TYPED_CLIENT = r"""
import socket, sys
for _ in range(2):
    sock = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
    sock.sendall(b"typed")
    assert sock.recv(100) == b"typed"
    print(type(sock) is socket.socket, flush=True)
    sock.close()
"""


def test_an_accepted_connection_is_of_the_type_socket_socket(nocfg: PrivateSmcd) -> None:
    """``accept()`` under smc-run gives a connection whose type is ``socket.socket`` (smc-run's,
    as the stdlib's accept makes its connections of the module's class), on SMC as on TCP: a
    program may check ``type(conn) is socket.socket`` (trio does, and refused every accepted
    connection while it was another class)."""
    client, sout, serr = _talk(nocfg, TYPED_SERVER, TYPED_CLIENT)
    assert client.returncode == 0 and client.stdout == "True\nTrue\n", (client.stderr, serr)
    assert sout == "True True\nTrue True\n", (sout, serr)
    assert _modes(serr) == [("accept", "smcd", None)] * 2, serr
    assert _modes(client.stderr) == [("connect", "smcd", None)] * 2, client.stderr
