"""A handed-off stream is never corrupted (#14), the client library's half.

A connection handed to smcd ends as an SMC channel, as TCP exactly as the application left it, or
as an error (ECONNRESET/ETIMEDOUT) — never as TCP whose data starts with CLC bytes. The library
knows whether the stream was touched from the kernel's byte counts (:mod:`smc_handoff.handoff`),
whatever the daemon does (that bookkeeping's unit tests, on real TCP sockets, are in
``tests/handoff/test_stream_mark.py``). Here:

- fake daemons (real SEQPACKET servers, in this process or a child that exits) that lie: write
  or read stream bytes and then hang up, reply FALLBACK, reply garbage or stay silent;
- the real smcd SIGKILLed or SIGSTOPped mid-handshake, on the client half (the server
  application is late, so the daemon waits for the Accept after writing its Proposal) and on the
  server half (a raw client sends half a Proposal, so the daemon waits for the rest after
  reading the header), and SIGKILLed before it touched anything (the stream falls back).

Every application's outcome is checked: SMC, or TCP whose data is byte-exact (SHA-256 both
ways), or an OSError; never data starting with an eyecatcher.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import random
import selectors
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import smc_handoff
from smc_handoff import handoff as h
from smc_handoff import messages as m
from tests.e2e.conftest import PYTHON, REPO, Smcd

EYES = h.CLC_EYECATCHERS
PROPOSAL_HEAD = EYES[0] + bytes([1]) + (120).to_bytes(2, "big") + bytes([0x20])
"""The 8-byte header of a 120-byte SMC-R v2 CLC Proposal (what the daemon reads first)."""


def tcp_pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname())
        server, _ = listener.accept()
    return client, server


def settle() -> None:
    time.sleep(0.05)  # loopback delivers at once; this covers the ACK too


# --- fake daemons that lie ---------------------------------------------------------------------


LIAR = r"""
import os, socket, sys
from smc_handoff import messages as m
path, action = sys.argv[1], sys.argv[2]
lst = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
lst.bind(path)
lst.listen(8)
print("ready", flush=True)
conn, _ = lst.accept()
msg, fds = m.recv_message(conn, requests=True)
if action == "write":
    os.write(fds[0], b"\xe2\xd4\xc3\xd9\x01\x00\x78\x20" + bytes(112))
os._exit(0)  # dies holding everything: the kernel closes it all
"""


class FakeDaemon:
    """A SEQPACKET server in this process answering CONNECT/ACCEPT with ``act(conn, tcp)``,
    where ``tcp`` is its copy of the application's socket (closed after ``act``)."""

    def __init__(self, path: Path, act: Callable[[socket.socket, socket.socket], None]) -> None:
        self.path = path
        self.act = act
        self.errors: list[BaseException] = []
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.listener.bind(os.fspath(path))
        self.listener.listen(8)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        try:
            conn, _ = self.listener.accept()
            with conn:
                _msg, fds = m.recv_message(conn, requests=True)
                with socket.socket(fileno=fds[0]) as tcp:
                    self.act(conn, tcp)
        except BaseException as e:  # reported by join()
            self.errors.append(e)

    def join(self) -> None:
        self.thread.join(10)
        assert not self.thread.is_alive() and not self.errors, self.errors
        self.listener.close()
        self.path.unlink()


@pytest.fixture
def liar(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., FakeDaemon]]:
    made: list[FakeDaemon] = []
    monkeypatch.setenv("SMCD_HANDOFF_SOCKET", os.fspath(tmp_path / "liar.sock"))

    def make(act: Callable[[socket.socket, socket.socket], None]) -> FakeDaemon:
        d = FakeDaemon(tmp_path / "liar.sock", act)
        made.append(d)
        return d

    yield make
    for d in made:
        d.listener.close()


def fallback(after_decline: bool = False) -> m.Fallback:
    return m.Fallback(0x03010000, "PEERNOSMC", "a lie", None, after_decline)


def write_clc(tcp: socket.socket) -> None:
    tcp.sendall(PROPOSAL_HEAD + bytes(112))


def assert_peer_sees_the_reset(peer: socket.socket) -> None:
    """The peer's stream ends in ECONNRESET (after whatever the liar sent), never a clean EOF
    or a hang: it knows the stream is broken."""
    peer.settimeout(5)
    with pytest.raises(ConnectionResetError):
        while peer.recv(65536):
            pass


def assert_exact_tcp(ours: socket.socket, peer: socket.socket) -> None:
    """Both directions byte-exact after the handoff, no eyecatcher anywhere in front."""
    peer.settimeout(5)
    ours.settimeout(5)
    ours.sendall(b"ours " * 1000)
    got = b""
    while len(got) < 5000:
        got += peer.recv(65536)
    assert got == b"ours " * 1000
    peer.sendall(b"theirs")
    assert ours.recv(100) == b"theirs"


@pytest.mark.parametrize("server_side", [False, True])
@pytest.mark.parametrize(
    "lie",
    [
        "write-then-fallback",
        "read-then-fallback",
        "write-then-garbage",
        "write-then-error",
        "write-then-hang-up",
        "hang-up-alive",
    ],
)
def test_a_lying_daemon_that_touched_the_stream_is_an_error(
    liar: Callable[..., FakeDaemon], lie: str, server_side: bool
) -> None:
    def act(conn: socket.socket, tcp: socket.socket) -> None:
        if lie.startswith("write"):
            write_clc(tcp)
        elif lie.startswith("read"):
            assert tcp.recv(4) == b"app "  # the application's data, gone
        if lie.endswith("fallback"):
            m.send_message(conn, fallback())
        elif lie.endswith("garbage"):
            conn.send(b"SMCH\x01\x82 garbage")
        elif lie.endswith("error"):
            m.send_message(conn, m.Error(m.ErrorCode.INTERNAL, "nothing was done (a lie)"))
        # hang-up: the connection closes when act returns, the daemon lives on

    ours, peer = tcp_pair() if not server_side else tcp_pair()[::-1]
    d = liar(act)
    peer.sendall(b"app data")
    settle()
    t0 = time.monotonic()
    with pytest.raises(ConnectionResetError) as info:
        smc_handoff.wrap(ours, server_side=server_side)
    assert info.value.errno == errno.ECONNRESET and "connection reset" in str(info.value)
    assert time.monotonic() - t0 < 2.0
    d.join()
    assert ours.fileno() == -1  # wrap() detached it; the SmcSocket was closed
    assert_peer_sees_the_reset(peer)
    peer.close()


@pytest.mark.parametrize("server_side", [False, True])
def test_a_lying_accept_path_hands_out_a_reset_socket(
    liar: Callable[..., FakeDaemon], server_side: bool
) -> None:
    """SmcServer.accept does not fail: the accepted socket's first call does, as the kernel's
    AF_SMC hands out a failed socket."""

    def act(conn: socket.socket, tcp: socket.socket) -> None:
        m.send_message(conn, m.Ok(1))  # the LISTEN registration
        conn2, _ = d.listener.accept()
        with conn2:
            _msg, fds = m.recv_message(conn2, requests=True)
            with socket.socket(fileno=fds[0]) as tcp2:
                write_clc(tcp2)
            m.send_message(conn2, fallback())
        time.sleep(0.5)  # keep the registration while accept runs

    d = liar(act)
    server = smc_handoff.listen(("127.0.0.1", 0))
    assert server.registered
    peer = socket.create_connection(server.getsockname())
    conn, _ = server.accept()
    assert conn.mode == "tcp" and conn.fallback is not None
    assert "connection reset" in conn.fallback.explanation
    conn.settimeout(5)
    with pytest.raises(OSError) as info:
        conn.recv(100)
    assert info.value.errno in (errno.ECONNRESET, errno.ENOTCONN)
    assert_peer_sees_the_reset(peer)
    d.join()
    for s in (conn, peer):
        s.close()
    server.close()


def test_a_fallback_after_a_decline_exchange_is_trusted(liar: Callable[..., FakeDaemon]) -> None:
    """The daemon wrote a Proposal and read the peer's Decline (both ends processed the
    exchange) and says so: TCP, byte-exact from there on."""
    decline = EYES[0] + b"\x04\x00\x1c\x20" + bytes(20)

    def act(conn: socket.socket, tcp: socket.socket) -> None:
        write_clc(tcp)
        got = b""
        while len(got) < len(decline):
            got += tcp.recv(len(decline) - len(got))
        m.send_message(conn, fallback(after_decline=True))

    ours, peer = tcp_pair()
    d = liar(act)
    results: dict[str, Any] = {}
    t = threading.Thread(target=lambda: results.update(sock=smc_handoff.wrap(ours)))
    t.start()
    peer.settimeout(5)
    got = b""
    while len(got) < 120:  # the peer's SMC stack reads the Proposal and declines
        got += peer.recv(120 - len(got))
    peer.sendall(decline)
    t.join(10)
    d.join()
    sock = results["sock"]
    assert sock.mode == "tcp" and sock.fallback.after_decline
    assert_exact_tcp(sock, peer)
    sock.close()
    peer.close()


def test_clc_behind_a_decline_exchange_is_an_error(liar: Callable[..., FakeDaemon]) -> None:
    """A late CLC message from the peer waits behind the exchange the daemon calls finished:
    the application would read it as data, so it is an error."""

    def act(conn: socket.socket, tcp: socket.socket) -> None:
        write_clc(tcp)
        time.sleep(0.2)  # the peer's late Accept arrives meanwhile
        m.send_message(conn, fallback(after_decline=True))

    ours, peer = tcp_pair()
    d = liar(act)
    peer.sendall(EYES[0] + b"\x02\x00\x44\x20")
    with pytest.raises(ConnectionResetError):
        smc_handoff.wrap(ours)
    d.join()
    assert_peer_sees_the_reset(peer)
    peer.close()


def test_an_untouched_fallback_is_tcp_as_left_but_not_over_a_waiting_proposal(
    liar: Callable[..., FakeDaemon],
) -> None:
    """FALLBACK after only peeking is TCP as the application left it — unless the server half
    finds a client's Proposal at the head (it came after the daemon's proposal wait): then no
    one would ever answer it, and the application would read it."""

    def peek(conn: socket.socket, tcp: socket.socket) -> None:
        tcp.recv(4, socket.MSG_PEEK)
        m.send_message(conn, fallback())

    ours, peer = tcp_pair()
    d = liar(peek)
    peer.sendall(b"ours ")
    sock = smc_handoff.wrap(ours, server_side=True)
    d.join()
    assert sock.mode == "tcp" and sock.fallback == fallback()
    assert sock.recv(5) == b"ours "
    assert_exact_tcp(sock, peer)
    sock.close()
    peer.close()

    ours, peer = tcp_pair()
    d = liar(peek)
    peer.sendall(PROPOSAL_HEAD)
    with pytest.raises(ConnectionResetError, match="CLC bytes waiting"):
        smc_handoff.wrap(ours, server_side=True)
    d.join()
    assert_peer_sees_the_reset(peer)
    peer.close()


def test_a_silent_daemon_times_out_and_its_late_write_goes_nowhere(
    liar: Callable[..., FakeDaemon], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SMCD_HANDOFF_TIMEOUT", "0.5")
    late: list[BaseException] = []

    def act(conn: socket.socket, tcp: socket.socket) -> None:
        time.sleep(1.0)  # frozen past the library's deadline, then wakes up and writes
        try:
            write_clc(tcp)
        except OSError as e:
            late.append(e)

    ours, peer = tcp_pair()
    d = liar(act)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError) as info:
        smc_handoff.wrap(ours)
    assert info.value.errno == errno.ETIMEDOUT and 0.4 < time.monotonic() - t0 < 2.0
    assert_peer_sees_the_reset(peer)
    d.join()
    assert late and isinstance(late[0], ConnectionResetError | BrokenPipeError), late
    peer.close()


def test_a_request_the_daemon_never_read_falls_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A live daemon that closes the connection with the request unread (ECONNRESET): the
    descriptor never reached it, so TCP as left — unlike a hang-up after reading."""
    path = tmp_path / "rude.sock"
    monkeypatch.setenv("SMCD_HANDOFF_SOCKET", os.fspath(path))
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as lst:
        lst.bind(os.fspath(path))
        lst.listen(8)

        def rude() -> None:
            conn, _ = lst.accept()
            while not select_readable(conn):
                pass
            conn.close()  # the CONNECT and its descriptor still queued: reset, fds dropped

        t = threading.Thread(target=rude)
        t.start()
        ours, peer = tcp_pair()
        sock = smc_handoff.wrap(ours)
        t.join(5)
        assert sock.mode == "tcp" and sock.fallback is not None
        assert "Connection reset" in sock.fallback.explanation
        assert_exact_tcp(sock, peer)
        sock.close()
        peer.close()


def select_readable(sock: socket.socket) -> bool:
    with selectors.DefaultSelector() as sel:
        sel.register(sock, selectors.EVENT_READ)
        return bool(sel.select(1.0))


@pytest.mark.parametrize("proposal", [False, True])
def test_a_server_half_waits_out_a_full_handoff_queue(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, proposal: bool
) -> None:
    """The daemon's handoff queue is full (a flood): the client half falls back at once, as
    nothing was sent; the server half retries for ACCEPT_BUSY_WAIT, because its client may be
    queued at the same daemon and propose meanwhile — a Proposal that arrives makes it an
    error, silence TCP as left."""
    path = tmp_path / "full.sock"
    monkeypatch.setenv("SMCD_HANDOFF_SOCKET", os.fspath(path))
    with contextlib.ExitStack() as stack:
        lst = stack.enter_context(socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET))
        lst.bind(os.fspath(path))
        lst.listen(0)
        while True:  # fill the queue; never accept
            filler = stack.enter_context(socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET))
            filler.setblocking(False)
            try:
                filler.connect(os.fspath(path))
            except BlockingIOError:
                break
        client, server = tcp_pair()
        t0 = time.monotonic()
        c = smc_handoff.wrap(client)
        assert c.mode == "tcp" and time.monotonic() - t0 < 0.5
        if proposal:
            threading.Timer(0.3, c.sendall, (PROPOSAL_HEAD,)).start()
            t0 = time.monotonic()
            with pytest.raises(ConnectionResetError, match="CLC bytes waiting"):
                smc_handoff.wrap(server, server_side=True)
            assert_peer_sees_the_reset(c)
        else:
            t0 = time.monotonic()
            s = smc_handoff.wrap(server, server_side=True)
            assert s.mode == "tcp" and s.fallback is not None
            assert "temporarily unavailable" in s.fallback.explanation
            assert_exact_tcp(s, c)
            s.close()
        assert h.ACCEPT_BUSY_WAIT - 0.1 < time.monotonic() - t0 < h.ACCEPT_BUSY_WAIT + 1.0
        c.close()


@pytest.mark.parametrize("action", ["write", "nothing"])
def test_a_daemon_that_dies_mid_handoff(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, action: str
) -> None:
    """A daemon process that exits without a reply (its copies die with it): touched is an
    error, untouched falls back with TCP byte-exact."""
    path = tmp_path / "dying.sock"
    monkeypatch.setenv("SMCD_HANDOFF_SOCKET", os.fspath(path))
    env = {**os.environ, "PYTHONPATH": os.fspath(REPO)}
    proc = subprocess.Popen(
        [os.fspath(PYTHON), "-c", LIAR, os.fspath(path), action],
        stdout=subprocess.PIPE,
        env=env,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
        ours, peer = tcp_pair()
        if action == "write":
            with pytest.raises(ConnectionResetError, match="after 120 bytes written"):
                smc_handoff.wrap(ours)
            assert_peer_sees_the_reset(peer)
        else:
            sock = smc_handoff.wrap(ours)
            assert sock.mode == "tcp" and sock.fallback is not None
            assert sock.fallback.code == m.FALLBACK_DAEMON_UNAVAILABLE
            assert_exact_tcp(sock, peer)
            sock.close()
        peer.close()
    finally:
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


# --- the real daemon, killed and frozen --------------------------------------------------------


APP = r"""
import hashlib, json, os, random, socket, sys, threading, time
import smc_handoff

sock = server = None

def out(**kw):
    sys.stdout.write(json.dumps(kw) + "\n")
    sys.stdout.flush()

def failure(e):
    return {"error": type(e).__name__, "errno": getattr(e, "errno", None), "message": str(e)}

def describe(s):
    f = s.fallback
    return {"mode": s.mode, "fallback": None if f is None else str(f)}

for line in sys.stdin:
    cmd = json.loads(line)
    op = cmd["op"]
    try:
        if op == "listen":
            server = smc_handoff.listen(("127.0.0.1", 0))
            out(port=server.getsockname()[1], registered=server.registered)
        elif op == "accept":
            sock, _ = server.accept()
            out(**describe(sock))
        elif op == "connect":
            sock = smc_handoff.connect(("127.0.0.1", cmd["port"]), timeout=30)
            out(**describe(sock))
        elif op == "talk":
            # send n seeded bytes (in a thread: SMC rings are small) while reading to EOF
            data = random.Random(cmd["seed"]).randbytes(cmd["n"])
            sent = {}
            def send():
                try:
                    sock.sendall(data)
                    sock.shutdown(socket.SHUT_WR)
                except OSError as e:
                    sent.update(failure(e))
            t = threading.Thread(target=send)
            t.start()
            got = bytearray()
            result = {}
            sock.settimeout(15)
            try:
                while True:
                    piece = sock.recv(262144)
                    if not piece:
                        break
                    got += piece
            except OSError as e:
                result = failure(e)
            t.join()
            out(sent_sha=hashlib.sha256(data).hexdigest(), n=len(got),
                sha=hashlib.sha256(got).hexdigest(), head=bytes(got[:8]).hex(),
                send_error=sent or None, **result)
        elif op == "close":
            sock.close()
            out(ok=True)
    except Exception as e:
        out(**failure(e))
"""


class Peer:
    """One application process running :data:`APP` (JSON commands on stdin, answers on
    stdout), with its own handoff settings."""

    def __init__(self, handoff: Path, name: str, timeout: float | None = None) -> None:
        env = {**os.environ, "SMCD_HANDOFF_SOCKET": os.fspath(handoff)}
        env["PYTHONPATH"] = os.fspath(REPO)
        if timeout is not None:
            env["SMCD_HANDOFF_TIMEOUT"] = str(timeout)
        self.name = name
        self.proc = subprocess.Popen(
            [os.fspath(PYTHON), "-c", APP],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            cwd=REPO,
        )
        self._sel = selectors.DefaultSelector()
        assert self.proc.stdout is not None
        self._sel.register(self.proc.stdout, selectors.EVENT_READ)
        self._buf = b""

    def send(self, op: str, **kw: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps({"op": op, **kw}) + "\n").encode())
        self.proc.stdin.flush()

    def reply(self, timeout: float = 30.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        assert self.proc.stdout is not None
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not self._sel.select(left):
                raise AssertionError(f"{self.name}: no answer within {timeout} s (a hang)")
            chunk = os.read(self.proc.stdout.fileno(), 65536)
            assert chunk, f"{self.name} exited ({self.proc.wait()})"
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        result: dict[str, Any] = json.loads(line)
        return result

    def call(self, op: str, timeout: float = 30.0, **kw: Any) -> dict[str, Any]:
        self.send(op, **kw)
        return self.reply(timeout)

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                f.close()
        self._sel.close()


@pytest.fixture
def peers(smcd: Smcd) -> Iterator[Callable[..., Peer]]:
    made: list[Peer] = []

    def make(name: str, timeout: float | None = None) -> Peer:
        p = Peer(smcd.handoff, name, timeout)
        made.append(p)
        return p

    yield make
    for p in made:
        p.close()


@contextlib.contextmanager
def daemon_restored(smcd: Smcd) -> Iterator[None]:
    """Whatever the test does to the daemon, the module's next test gets a running one."""
    try:
        yield
    finally:
        assert smcd.proc is not None
        if smcd.alive():
            smcd.proc.signal(signal.SIGCONT)
        else:
            smcd.proc.proc.wait()
            smcd.start()


def kill(smcd: Smcd) -> None:
    smcd.kill()


def freeze(smcd: Smcd) -> None:
    assert smcd.proc is not None
    smcd.proc.signal(signal.SIGSTOP)


FAILED = (errno.ECONNRESET, errno.ETIMEDOUT, errno.ENOTCONN, errno.EPIPE)


def stream_ok(end: dict[str, Any], other_sent_sha: str | None) -> str:
    """One application's outcome (a ``talk`` answer): ``error``, or ``exact`` (what the peer
    sent, byte for byte; nothing when ``other_sent_sha`` is None: the peer failed). Never CLC
    bytes as data."""
    head = bytes.fromhex(end.get("head", ""))
    assert not (head and any(eye.startswith(head[:4]) for eye in EYES)), f"CLC as data: {end}"
    if end.get("error"):
        assert end["errno"] in FAILED, end
        return "error"
    if other_sent_sha is None:
        assert end["n"] == 0, end
    else:
        assert end["sha"] == other_sent_sha, end
    return "exact"


def talk(a: Peer, b: Peer, n: int = 300_000) -> tuple[str, str]:
    a.send("talk", n=n, seed=1)
    b.send("talk", n=n, seed=2)
    ra, rb = a.reply(), b.reply()
    if "sent_sha" not in ra or "sent_sha" not in rb:  # one end's socket was already failed
        return stream_ok(ra, None), stream_ok(rb, None)
    return stream_ok(ra, rb["sent_sha"]), stream_ok(rb, ra["sent_sha"])


def server_recv_q(port: int, want: Callable[[int], bool], timeout: float = 10.0) -> None:
    """Wait until the Recv-Q of the server side of the connection to ``port`` (accepted or
    not: ``ss`` shows both) satisfies ``want``: bytes from the client waiting, or taken."""
    deadline = time.monotonic() + timeout
    while True:
        out = subprocess.run(
            ["ss", "-Htn", "state", "established", f"( sport = :{port} )"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        if out and want(int(out[0])):
            return
        assert time.monotonic() < deadline, f"Recv-Q never as wanted: {out}"
        time.sleep(0.02)


def raw_client(port: int, first: bytes) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(first)
    return s


def healthy(peers: Callable[..., Peer]) -> None:
    """A fresh pair gets SMC and an exact stream: the daemon recovered."""
    server, client = peers("server-after"), peers("client-after")
    port = server.call("listen")["port"]
    server.send("accept")
    c = client.call("connect", port=port)
    s = server.reply()
    assert c["mode"] == s["mode"] == "smcd", (c, s)
    assert talk(client, server) == ("exact", "exact")


@pytest.mark.parametrize("stop", [kill, freeze], ids=["sigkill", "sigstop"])
def test_client_half_mid_handshake(smcd: Smcd, peers: Callable[..., Peer], stop: Any) -> None:
    """The server application is late. A same-host client half proposes only once its server
    half is in the daemon (#14), so the daemon holds the client's socket without having written
    a byte when it is killed or frozen: killed, the client falls back with its stream as it
    left it (the daemon and its copy are gone); frozen, the client fails (ETIMEDOUT past its
    1.5 s wait: the daemon still holds the socket). Either way the server application,
    accepting late, never reads a CLC byte."""
    with daemon_restored(smcd):
        server, client = peers("server"), peers("client", timeout=1.5)
        listening = server.call("listen")
        assert listening["registered"]
        client.send("connect", port=listening["port"])
        time.sleep(0.3)  # the daemon holds the client half, waiting for the server half
        server_recv_q(listening["port"], lambda n: n == 0)  # and wrote no Proposal
        stop(smcd)
        c = client.reply()
        if stop is kill:
            assert c.get("mode") == "tcp" and "DAEMON_UNAVAILABLE" in c["fallback"], c
        else:
            assert c.get("errno") == errno.ETIMEDOUT, c
            smcd.proc.signal(signal.SIGCONT)  # type: ignore[union-attr]
        s = server.call("accept")
        assert s.get("mode", "tcp") == "tcp", s
        if stop is kill:
            assert talk(client, server) == ("exact", "exact")
        elif "mode" in s:
            assert stream_ok(server.call("talk", n=1000, seed=3), None) == "error"
    if stop is freeze:
        healthy(peers)


@pytest.mark.parametrize("stop", [kill, freeze], ids=["sigkill", "sigstop"])
def test_server_half_mid_handshake(smcd: Smcd, peers: Callable[..., Peer], stop: Any) -> None:
    """A client sends half a Proposal, so the daemon has read its header and waits for the
    rest when it is killed or frozen: the server application's accepted socket fails, and the
    client sees a reset instead of waiting forever."""
    with daemon_restored(smcd):
        server = peers("server", timeout=1.5)
        listening = server.call("listen")
        assert listening["registered"]
        server.send("accept")
        raw = raw_client(listening["port"], PROPOSAL_HEAD + bytes(20))
        server_recv_q(listening["port"], lambda n: n == 0)  # the daemon took the 28 bytes
        time.sleep(0.1)  # and waits for 92 more
        stop(smcd)
        s = server.reply()
        assert s["mode"] == "tcp" and "connection reset" in s["fallback"], s
        assert stream_ok(server.call("talk", n=1000, seed=3), None) == "error"
        raw.settimeout(5)
        with pytest.raises(ConnectionResetError):
            raw.recv(100)
        raw.close()
    if stop is freeze:
        healthy(peers)


def test_daemon_killed_before_touching_anything_falls_back(
    smcd: Smcd, peers: Callable[..., Peer]
) -> None:
    """Frozen before it took the CONNECT off its socket, then killed: the stream is untouched
    and the daemon's copies died with it, so both ends are TCP, byte-exact."""
    with daemon_restored(smcd):
        server, client = peers("server"), peers("client")
        listening = server.call("listen")
        assert listening["registered"]
        freeze(smcd)
        client.send("connect", port=listening["port"])  # queued on the frozen daemon's socket
        time.sleep(0.5)
        kill(smcd)
        c = client.reply()
        assert c["mode"] == "tcp" and "DAEMON_UNAVAILABLE" in c["fallback"], c
        s = server.call("accept")  # the registration is gone: plain TCP
        assert s["mode"] == "tcp", s
        assert talk(client, server) == ("exact", "exact")


def test_many_handshakes_with_the_daemon_killed_among_them(
    smcd: Smcd, peers: Callable[..., Peer]
) -> None:
    """Pairs connect back to back while the daemon is killed: each end is SMC, exact TCP or an
    error; no CLC bytes as data; then a restarted daemon serves again."""
    outcomes: dict[str, int] = {}
    with daemon_restored(smcd):
        server, client = peers("server"), peers("client")
        port = server.call("listen")["port"]
        for i in range(12):
            server.send("accept")
            client.send("connect", port=port)
            if i == 6:  # somewhere in this handshake
                time.sleep(random.uniform(0.0, 0.004))
                kill(smcd)
            c, s = client.reply(), server.reply()
            if "error" in c or "error" in s:
                key = "error"
                for end, app in ((c, client), (s, server)):
                    if "error" in end:
                        assert end["errno"] in FAILED, end
                    else:  # its peer failed: its stream must fail or end empty
                        stream_ok(app.call("talk", n=1000, seed=3), None)
            else:
                key = f"{c['mode']}/{s['mode']}"
                ends = talk(client, server, 20_000)
                assert ends == ("exact", "exact") or key != "smcd/smcd", (c, s, ends)
            outcomes[key] = outcomes.get(key, 0) + 1
            for app in (client, server):
                app.call("close")
    assert outcomes.get("smcd/smcd", 0) >= 5, outcomes
    healthy(peers)
