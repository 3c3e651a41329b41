"""SmcSocket: the same observable behaviour as a TCP socket, over a real shared-memory channel.

Every behavioural test runs three times against a connected pair: ``tcp`` (two plain kernel TCP
sockets: the reference), ``fallback`` (SmcSockets with no daemon: TCP with a reason) and
``smcd`` (SmcSockets whose data moves through a real :class:`smc_handoff.channel.Channel` made
with ``make_pair``). The channel pair is handed over by :class:`MiniDaemon`, a real SEQPACKET
server speaking the handoff protocol (:mod:`smc_handoff.messages`) that pairs the two halves of
a TCP connection by their 4-tuple, without CLC: the daemon side proper (CLC over TCP, DMB pool)
is tested with the daemon.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import os
import random
import selectors
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import smc_handoff
from smc_handoff import channel_base
from smc_handoff import messages as m
from smc_handoff import socket as smc_socket
from smc_handoff.channel import make_pair
from smc_handoff.handoff import Registration
from smc_handoff.socket import SmcSocket

REPO = Path(__file__).resolve().parents[2]


class MiniDaemon:
    """The daemon half of the handoff protocol reduced to pairing (see the module docstring).

    ``behaviour`` chooses the answer to CONNECT/ACCEPT: ``pair`` (CHANNEL once both halves of
    the TCP connection arrived), ``fallback``, ``error``, ``garbage`` or ``silent``.
    """

    def __init__(self, path: Path, behaviour: str = "pair", dmb_size: int = 65536) -> None:
        self.path = path
        self.behaviour = behaviour
        self.dmb_size = dmb_size
        self.requests: list[m.Message] = []
        self.notices: list[m.Message] = []
        self.hangups = 0  # control connections the library closed after its first request
        self.pending: dict[Any, tuple[socket.socket, int]] = {}
        self.conns: list[socket.socket] = []
        self.lock = threading.Lock()
        self.next_id = 1
        self.stopped = False
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.listener.bind(str(path))
        self.listener.listen(64)
        self.listener.settimeout(0.05)
        self.thread = threading.Thread(target=self._accept_loop, daemon=True)
        self.thread.start()

    def _accept_loop(self) -> None:
        while not self.stopped:
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.settimeout(None)
            with self.lock:
                self.conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _ident(self) -> int:
        with self.lock:
            self.next_id += 1
            return self.next_id - 1

    def _serve(self, conn: socket.socket) -> None:
        try:
            msg, fds = m.recv_message(conn, requests=True)
        except m.HandoffProtocolError as e:
            m.send_message(conn, m.Error(e.code, str(e)))
            conn.close()
            return
        except OSError:
            return
        self.requests.append(msg)
        if isinstance(msg, m.Listen):
            m.close_fds(fds)
            m.send_message(conn, m.Ok(self._ident()))
        elif isinstance(msg, m.Connect | m.Accept):
            self._handoff(conn, msg, fds[0])
        elif isinstance(msg, m.Resume):
            m.close_fds(fds)
            m.send_message(conn, m.Ok(self._ident() + 100))
        else:
            m.close_fds(fds)
            m.send_message(conn, m.Error(m.ErrorCode.BAD_STATE, "not a first request"))
        self._notices(conn)
        with self.lock:  # the library hung up: this end goes too (long runs make many)
            if conn in self.conns:
                self.conns.remove(conn)
                conn.close()

    def _handoff(self, conn: socket.socket, msg: m.Connect | m.Accept, fd: int) -> None:
        tcp = socket.socket(fileno=fd)
        here, there = tcp.getsockname(), tcp.getpeername()
        if self.behaviour == "fallback":
            tcp.setblocking(False)  # O_NONBLOCK is shared: the library must restore its mode
        tcp.close()  # before replying: the application's close() must really close TCP
        if self.behaviour == "fallback":
            m.send_message(conn, m.Fallback(0x03010000, "PEERNOSMC", "no SMC peer", 0x7))
        elif self.behaviour == "error":
            m.send_message(conn, m.Error(m.ErrorCode.INTERNAL, "boom"))
        elif self.behaviour == "garbage":
            conn.send(b"SMCH garbage")
        elif self.behaviour == "pair":
            key = (here, there) if isinstance(msg, m.Connect) else (there, here)
            size = msg.dmb_size or self.dmb_size
            with self.lock:
                other = self.pending.pop(key, None)
                if other is None:
                    self.pending[key] = (conn, size)
                    return
            other_conn, other_size = other
            ident = self._ident()
            end_a, end_b = make_pair(other_size, size)
            for c, end in ((other_conn, end_a), (conn, end_b)):
                reply = m.Channel(ident, m.Mode.SMCD, end.rx_size, end.tx_size)
                m.send_message(c, reply, end.fds())
                end.close()
        # "silent": never answer

    def _notices(self, conn: socket.socket) -> None:
        while True:
            try:
                msg, fds = m.recv_message(conn, requests=True)
            except m.HandoffClosedError:
                with self.lock:
                    self.hangups += 1
                return
            except (OSError, m.HandoffError):
                return
            m.close_fds(fds)
            self.notices.append(msg)

    def wait_notice(self, kind: type, timeout: float = 2.0) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for n in self.notices:
                if isinstance(n, kind):
                    return n
            time.sleep(0.01)
        raise AssertionError(f"no {kind.__name__} notice; got {self.notices}")

    def wait_hangups(self, n: int, timeout: float = 2.0) -> None:
        deadline = time.monotonic() + timeout
        while self.hangups < n and time.monotonic() < deadline:
            time.sleep(0.01)
        assert self.hangups == n, f"{self.hangups} control connections hung up, not {n}"

    def stop(self) -> None:
        self.stopped = True
        self.listener.close()
        self.thread.join(2)
        with self.lock:
            for c in self.conns:
                with contextlib.suppress(OSError):
                    c.shutdown(socket.SHUT_RDWR)
                c.close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


@pytest.fixture
def daemon(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[MiniDaemon]:
    d = MiniDaemon(tmp_path / "handoff.sock")
    monkeypatch.setenv("SMCD_HANDOFF_SOCKET", str(d.path))
    yield d
    d.stop()


@pytest.fixture
def no_daemon(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "absent" / "handoff.sock"
    monkeypatch.setenv("SMCD_HANDOFF_SOCKET", str(path))
    return path


def tcp_pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname())
        server, _ = listener.accept()
    return client, server


def wrapped_pair(
    before: Callable[[socket.socket, socket.socket], None] | None = None, **kw: Any
) -> tuple[SmcSocket, SmcSocket]:
    """Both halves handed off concurrently (a real daemon answers each when both arrived);
    ``before(client, server)`` is called on the TCP sockets first."""
    client, server = tcp_pair()
    if before is not None:
        before(client, server)
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["client"] = smc_handoff.wrap(client, **kw)
        except BaseException as e:
            out["error"] = e

    t = threading.Thread(target=run)
    t.start()
    s = smc_handoff.wrap(server, server_side=True, **kw)
    t.join(10)
    if "error" in out:
        raise out["error"]
    return out["client"], s


@pytest.fixture(params=["tcp", "fallback", "smcd"])
def pair(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[Any, Any]]:
    kind = request.param
    d = None
    if kind == "tcp":
        a, b = tcp_pair()
    elif kind == "fallback":
        monkeypatch.setenv("SMCD_HANDOFF_SOCKET", str(tmp_path / "absent.sock"))
        a, b = wrapped_pair()
        assert a.mode == b.mode == "tcp"
    else:
        d = MiniDaemon(tmp_path / "h.sock")
        monkeypatch.setenv("SMCD_HANDOFF_SOCKET", str(d.path))
        a, b = wrapped_pair()
        assert a.mode == b.mode == "smcd", (a.fallback, b.fallback)
    yield a, b
    a.close()
    b.close()
    if d is not None:
        d.stop()


def abort(sock: Any) -> None:
    """Reset the connection: SmcSocket.abort(), or SO_LINGER 0 + close on a plain socket."""
    if isinstance(sock, SmcSocket):
        sock.abort()
    else:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()


def readable(sock: Any, timeout: float) -> bool:
    return bool(selectors_select(sock, timeout))


def selectors_select(sock: Any, timeout: float) -> list[Any]:
    with selectors.DefaultSelector() as sel:
        sel.register(sock, selectors.EVENT_READ)
        return sel.select(timeout)


def recv_exactly(sock: Any, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        assert chunk, "unexpected EOF"
        buf += chunk
    return bytes(buf)


# --- behaviour: identical for tcp, fallback and smcd -------------------------------------------


def test_send_recv_and_names(pair: tuple[Any, Any]) -> None:
    a, b = pair
    assert a.getpeername() == b.getsockname() and b.getpeername() == a.getsockname()
    assert a.send(b"hello") == 5
    assert recv_exactly(b, 5) == b"hello"
    buf = bytearray(10)
    b.sendall(b"world")
    got = 0
    while got < 5:
        got += a.recv_into(memoryview(buf)[got:], 5 - got)
    assert bytes(buf[:5]) == b"world"
    assert a.send(b"") == 0 and a.recv(0) == b""


def test_bulk_both_directions_integrity(pair: tuple[Any, Any]) -> None:
    """1.5 MiB each way in odd-sized writes through a 64 KiB ring (many wraps), concurrently."""
    a, b = pair
    data = os.urandom(1_500_007)
    digests: dict[str, str] = {}

    def reader(sock: Any, name: str) -> None:
        h = hashlib.sha256()
        n = 0
        while n < len(data):
            chunk = sock.recv(70_001)
            assert chunk
            h.update(chunk)
            n += len(chunk)
        digests[name] = h.hexdigest()

    threads = [
        threading.Thread(target=reader, args=(b, "b")),
        threading.Thread(target=reader, args=(a, "a")),
    ]
    for t in threads:
        t.start()
    view = memoryview(data)
    for i in range(0, len(data), 33_333):
        a.sendall(view[i : i + 33_333])
    b.sendall(data)
    for t in threads:
        t.join(20)
    want = hashlib.sha256(data).hexdigest()
    assert digests == {"a": want, "b": want}


def test_eof_after_peer_shutdown_wr(pair: tuple[Any, Any]) -> None:
    a, b = pair
    b.sendall(b"last words")
    b.shutdown(socket.SHUT_WR)
    assert recv_exactly(a, 10) == b"last words"
    assert a.recv(100) == b""
    assert a.recv(100) == b""  # EOF stays EOF
    a.sendall(b"still open the other way")  # half-close: a can still write
    assert recv_exactly(b, 24) == b"still open the other way"


def test_eof_after_peer_close(pair: tuple[Any, Any]) -> None:
    a, b = pair
    b.sendall(b"bye")
    b.close()
    assert recv_exactly(a, 3) == b"bye"
    assert a.recv(10) == b""


def test_close_with_unread_data_resets_peer(pair: tuple[Any, Any]) -> None:
    a, b = pair
    a.sendall(b"unread")
    assert readable(b, 2)
    b.close()  # data still unread: an abort (TCP: RST)
    a.settimeout(2)
    with pytest.raises(ConnectionResetError):
        while a.recv(10):
            pass


def test_abort_resets_peer(pair: tuple[Any, Any]) -> None:
    a, b = pair
    abort(b)
    a.settimeout(2)
    with pytest.raises(ConnectionResetError):
        a.recv(10)


def test_recv_timeout(pair: tuple[Any, Any]) -> None:
    a, b = pair
    a.settimeout(0.2)
    assert a.gettimeout() == 0.2
    t0 = time.monotonic()
    with pytest.raises(socket.timeout):
        a.recv(1)
    assert 0.15 <= time.monotonic() - t0 < 2
    b.sendall(b"z")  # the socket is still usable after a timeout
    assert a.recv(1) == b"z"


def test_send_timeout_when_peer_does_not_read(pair: tuple[Any, Any]) -> None:
    a, _b = pair
    a.settimeout(0.3)
    with pytest.raises(TimeoutError):
        a.sendall(b"x" * (64 << 20))


def test_a_blocking_send_sends_everything(pair: tuple[Any, Any]) -> None:
    """A blocking ``send`` returns once all of it is sent, as Linux TCP's (and the kernel's
    AF_SMC) does: a program that ignores its return value (a bug, but a common one that TCP
    never shows) loses nothing. With a timeout it may return less, as TCP's does."""
    a, b = pair
    data = random.Random(7).randbytes(8 << 20)  # several rings: the reader must free them
    got = bytearray()

    def reader() -> None:
        while len(got) < len(data) and (chunk := b.recv(1 << 20)):
            got.extend(chunk)

    t = threading.Thread(target=reader)
    t.start()
    assert a.send(data) == len(data)
    t.join(30)
    assert bytes(got) == data


def test_a_blocking_send_cut_by_a_reset_returns_what_went(pair: tuple[Any, Any]) -> None:
    """The peer resets while a blocking send waits for room: the send returns the bytes that
    went, and the next call raises, as Linux TCP's send does."""
    a, b = pair  # the peer reads nothing at all
    timer = threading.Timer(0.3, abort, (b,))
    timer.start()
    try:
        n = a.send(bytes(64 << 20))  # far more than the rings and buffers hold
    finally:
        timer.join()
    assert 0 < n < 64 << 20
    with pytest.raises((ConnectionResetError, BrokenPipeError)):
        for _ in range(100):  # TCP may take a send or two to see the reset
            a.send(b"x" * 65536)
            time.sleep(0.01)


def test_non_blocking(pair: tuple[Any, Any]) -> None:
    a, b = pair
    a.setblocking(False)
    assert a.gettimeout() == 0.0
    with pytest.raises(BlockingIOError):
        a.recv(1)
    with pytest.raises(BlockingIOError):
        b.recv(1, socket.MSG_DONTWAIT)
    chunk = b"y" * 65536
    sent = 0
    with pytest.raises(BlockingIOError):
        while sent < (64 << 20):
            sent += a.send(chunk)
    assert sent > 0
    got = 0
    b.settimeout(2)
    while got < sent:
        got += len(b.recv(1 << 20))
    a.setblocking(True)
    a.sendall(b"!")
    assert b.recv(1) == b"!"


def test_msg_peek(pair: tuple[Any, Any]) -> None:
    """MSG_PEEK copies without consuming, as on TCP and the kernel's AF_SMC."""
    a, b = pair
    with pytest.raises(BlockingIOError):
        b.recv(5, socket.MSG_PEEK | socket.MSG_DONTWAIT)  # nothing there yet
    a.sendall(b"hello world")
    assert b.recv(5, socket.MSG_PEEK) == b"hello"
    assert b.recv(5, socket.MSG_PEEK) == b"hello"  # still there
    buf = bytearray(3)
    assert b.recv_into(buf, 0, socket.MSG_PEEK) == 3 and buf == b"hel"
    assert recv_exactly(b, 6) == b"hello "  # then consumed by a plain read
    assert b.recv(100, socket.MSG_PEEK) == b"world"
    assert recv_exactly(b, 5) == b"world"
    a.shutdown(socket.SHUT_WR)
    b.settimeout(2)
    assert b.recv(10, socket.MSG_PEEK) == b""  # EOF, peeked


def test_msg_peek_across_the_ring_end(pair: tuple[Any, Any]) -> None:
    """A peek of bytes that wrap around the end of the ring returns them in order (SMC: the
    ring is 64 KiB here; TCP: any stream)."""
    a, b = pair
    first = bytes(range(256)) * 200  # 51,200 bytes
    a.sendall(first)
    assert recv_exactly(b, len(first)) == first
    second = os.urandom(30_000)  # runs past 64 KiB: the peek copies across the wrap
    a.sendall(second)
    b.settimeout(5)
    deadline = time.monotonic() + 5
    while len(peeked := b.recv(len(second), socket.MSG_PEEK)) < len(second):
        assert time.monotonic() < deadline, len(peeked)
        time.sleep(0.01)
    assert peeked == second
    assert recv_exactly(b, len(second)) == second


def test_msg_waitall(pair: tuple[Any, Any]) -> None:
    """MSG_WAITALL on a blocking socket waits for the whole buffer (or EOF)."""
    a, b = pair

    def trickle() -> None:
        for piece in (b"ab", b"cde", b"fghij"):
            time.sleep(0.05)
            a.sendall(piece)
        time.sleep(0.05)
        a.sendall(b"klm")
        a.shutdown(socket.SHUT_WR)

    t = threading.Thread(target=trickle)
    t.start()
    try:
        assert b.recv(10, socket.MSG_WAITALL) == b"abcdefghij"
        buf = bytearray(10)
        assert b.recv_into(buf, 0, socket.MSG_WAITALL) == 3 and buf[:3] == b"klm"  # EOF
    finally:
        t.join()


def test_msg_peek_waitall(pair: tuple[Any, Any]) -> None:
    a, b = pair
    a.sendall(b"12345")
    timer = threading.Timer(0.1, a.sendall, (b"67890",))
    timer.start()
    try:
        assert b.recv(10, socket.MSG_PEEK | socket.MSG_WAITALL) == b"1234567890"
        assert recv_exactly(b, 10) == b"1234567890"
    finally:
        timer.join()


def test_sendmsg_and_recvmsg(pair: tuple[Any, Any]) -> None:
    """Scatter/gather without ancillary data, as a TCP stream carries it."""
    a, b = pair
    assert a.sendmsg([b"head:", memoryview(b"body"), bytearray(b"!")]) == 10
    got = b""
    while len(got) < 10:
        data, anc, _flags, _addr = b.recvmsg(10 - len(got))
        assert data and anc == []
        got += data
    assert got == b"head:body!"
    b.sendall(b"0123456789")
    assert a.recv(10, socket.MSG_PEEK | socket.MSG_WAITALL) == b"0123456789"  # all there
    x, y = bytearray(4), bytearray(10)
    k, anc, _flags, _addr = a.recvmsg_into([x, y])
    assert (k, anc, bytes(x), bytes(y[:6])) == (10, [], b"0123", b"456789")


def test_flags_and_addresses_tcp_takes(pair: tuple[Any, Any]) -> None:
    """What Linux TCP and the kernel's AF_SMC take on a connected stream: ``MSG_MORE``,
    ``MSG_EOR`` and ``MSG_CONFIRM`` on a send, ``sendto``/``sendmsg`` with an address (ignored),
    ``MSG_CMSG_CLOEXEC`` on a read, and ``MSG_TRUNC`` (the bytes are read, not copied). Each
    raised ``EOPNOTSUPP`` or ``EISCONN`` on SMC."""
    a, b = pair
    peer = a.getpeername()
    assert a.send(b"ab", socket.MSG_MORE) == 2
    assert a.send(b"cd", socket.MSG_EOR | socket.MSG_CONFIRM) == 2
    assert a.sendto(b"ef", peer) == 2
    assert a.sendto(b"gh", socket.MSG_NOSIGNAL, ("192.0.2.1", 9)) == 2
    assert a.sendmsg([b"ij"], [], 0, peer) == 2
    a.sendall(b"kl", socket.MSG_MORE)
    a.send(b"!")  # (TCP: the end of the cork)
    assert recv_exactly(b, 2) == b"ab"
    data, anc, _flags, _addr = b.recvmsg(2, 0, socket.MSG_CMSG_CLOEXEC | socket.MSG_WAITALL)
    assert (data, anc) == (b"cd", [])
    assert len(b.recv(2, socket.MSG_TRUNC | socket.MSG_WAITALL)) == 2  # "ef", dropped
    buf = bytearray(b"..")
    assert b.recv_into(buf, 2, socket.MSG_TRUNC | socket.MSG_WAITALL) == 2  # "gh", dropped
    if isinstance(b, SmcSocket) and b.mode == "smcd":
        assert buf == bytearray(b"..")  # not copied (TCP's too, on Linux)
    assert recv_exactly(b, 5) == b"ijkl!"
    a.sendall(b"mnop")
    buf = bytearray(b"....")
    got = b.recv_into(buf, 2, socket.MSG_TRUNC)  # alone: what is there, up to 2, dropped
    assert got in (1, 2)
    if isinstance(b, SmcSocket) and b.mode == "smcd":
        assert buf == bytearray(b"....")
    assert recv_exactly(b, 4 - got) == b"mnop"[got:]


def test_select_and_selectors(pair: tuple[Any, Any]) -> None:
    import select

    a, b = pair
    assert select.select([a], [], [], 0)[0] == []
    assert selectors_select(a, 0) == []
    b.sendall(b"x")
    assert select.select([a], [], [], 2)[0] == [a]
    assert len(selectors_select(a, 2)) == 1
    assert a.recv(1) == b"x"
    assert select.select([a], [], [], 0.05)[0] == []  # drained: not readable any more
    b.shutdown(socket.SHUT_WR)
    assert select.select([a], [], [], 2)[0] == [a]  # EOF is readable
    assert a.recv(1) == b""
    assert select.select([a], [], [], 0)[0] == [a]  # and stays so


def test_select_wakes_for_abort(pair: tuple[Any, Any]) -> None:
    import select

    a, b = pair
    assert select.select([a], [], [], 0)[0] == []
    abort(b)
    assert select.select([a], [], [], 2)[0] == [a]
    with pytest.raises(ConnectionResetError):
        a.recv(1)


def test_makefile_and_deferred_close(pair: tuple[Any, Any]) -> None:
    a, b = pair
    tw, tr = b.makefile("w", encoding="utf-8"), a.makefile("r", encoding="utf-8")
    tw.write("é\n")
    tw.flush()
    assert tr.readline() == "é\n"
    tw.close()
    tr.close()
    wf = a.makefile("wb")
    rf = b.makefile("rb")
    wf.write(b"line one\nline two\n")
    wf.flush()
    assert rf.readline() == b"line one\n"
    assert rf.readline() == b"line two\n"
    a.close()  # a makefile is still open: the connection stays up (as socket.socket does)
    wf.write(b"after close\n")
    wf.flush()
    assert rf.readline() == b"after close\n"
    wf.close()  # last reference: now really closed
    assert rf.read() == b""


def test_shutdown_wr_then_send_is_broken_pipe(pair: tuple[Any, Any]) -> None:
    a, b = pair
    a.shutdown(socket.SHUT_WR)
    with pytest.raises(BrokenPipeError):
        a.send(b"x")
    assert b.recv(1) == b""


def test_shutdown_rd_reads_eof(pair: tuple[Any, Any]) -> None:
    a, _b = pair
    a.shutdown(socket.SHUT_RD)
    assert a.recv(10) == b""


def test_shutdown_rd_still_returns_what_was_received(pair: tuple[Any, Any]) -> None:
    """After ``SHUT_RD`` reads return what came before and after it, then EOF without waiting,
    and the socket polls readable, as on Linux TCP and the kernel's AF_SMC (``smc_rx_recvmsg``
    copies available data before it looks at ``RCV_SHUTDOWN``). Reads used to return EOF at
    once, and the data left unread made the close a reset."""
    import select

    a, b = pair
    a.sendall(b"before")
    assert readable(b, 5)
    b.shutdown(socket.SHUT_RD)
    assert b.recv(100) == b"before"
    assert select.select([b], [], [], 0)[0] == [b]
    assert b.recv(100) == b""  # nothing there: EOF at once, the peer has not closed
    a.sendall(b"after")
    deadline = time.monotonic() + 5
    got = b""
    while not got and time.monotonic() < deadline:  # (TCP: once it arrived)
        got = b.recv(100)
    assert got == b"after"
    b.sendall(b"back")  # the other direction is untouched
    assert recv_exactly(a, 4) == b"back"


class _Blocked:
    """``call()`` run in a thread of its own, which blocks there: ``settle`` seconds after the
    start it must not have returned (0: not checked). :meth:`result` is its return value or
    exception, failing the test when it has not returned within ``limit``."""

    def __init__(self, call: Callable[[], Any], settle: float = 0.3) -> None:
        self._out: dict[str, Any] = {}
        self._thread = threading.Thread(target=self._run, args=(call,), daemon=True)
        self._thread.start()
        if settle:
            time.sleep(settle)  # past its spin: asleep
            assert self._thread.is_alive() and not self._out, self._out

    def _run(self, call: Callable[[], Any]) -> None:
        try:
            self._out["r"] = call()
        except BaseException as e:
            self._out["r"] = e

    def result(self, limit: float = 30.0, what: str = "the blocked call was not woken") -> Any:
        self._thread.join(limit)
        assert not self._thread.is_alive(), what
        return self._out["r"]


@pytest.mark.parametrize("timeout", [None, 30.0], ids=["blocking", "timeout"])
@pytest.mark.parametrize("how", ["SHUT_RD", "SHUT_RDWR"])
def test_shutdown_in_another_thread_wakes_a_blocked_recv(
    pair: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch, how: str, timeout: float | None
) -> None:
    """A ``recv`` blocked in one thread returns EOF as soon as another thread shuts the socket
    for reading, as on TCP: the usual way to stop a reader thread. A blocked read sleeps on the
    peer link, which only the peer could make readable; it used to return only at its next look
    (up to a second later). The naps are made an hour long here, so a read that is not woken
    hangs instead of returning late."""
    monkeypatch.setattr(channel_base, "_SLEEP_CAP_S", 3600.0)
    a, _b = pair
    a.settimeout(timeout)
    blocked = _Blocked(lambda: a.recv(100))
    a.shutdown(getattr(socket, how))
    assert blocked.result(what="the blocked recv was not woken by shutdown()") == b""


@pytest.mark.parametrize("timeout", [None, 30.0], ids=["blocking", "timeout"])
@pytest.mark.parametrize("how", ["SHUT_WR", "SHUT_RDWR"])
def test_shutdown_in_another_thread_fails_a_blocked_send(
    pair: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch, how: str, timeout: float | None
) -> None:
    """A ``send`` blocked on a full buffer (the peer does not read) fails with ``EPIPE`` as
    soon as another thread shuts the socket for writing, as on TCP; it used to wait for its
    next look (up to a second), and with hour-long naps it hangs."""
    monkeypatch.setattr(channel_base, "_SLEEP_CAP_S", 3600.0)
    a, _b = pair
    a.settimeout(timeout)

    def fill() -> None:
        chunk = b"w" * 65536
        while True:
            a.send(chunk)

    blocked = _Blocked(fill, settle=0.5)  # the buffers fill, the send sleeps
    a.shutdown(getattr(socket, how))
    got = blocked.result(what="the blocked send was not woken by shutdown()")
    assert isinstance(got, BrokenPipeError), got


def _timeval(seconds: float) -> bytes:
    return struct.pack("@ll", int(seconds), int(seconds % 1 * 1e6))


def _in_thread(call: Callable[[], Any], limit: float = 30.0) -> Any:
    """``call()``'s result or exception, from a thread given ``limit`` seconds (a call that
    does not return by then fails the test instead of hanging it)."""
    return _Blocked(call, settle=0).result(limit, "the call never returned")


def test_so_rcvtimeo_bounds_a_blocking_recv(pair: tuple[Any, Any]) -> None:
    """``SO_RCVTIMEO`` (set with ``setsockopt``, the C way to time a blocking socket out) ends a
    blocking read that got nothing with ``EAGAIN``, as the kernel's TCP and AF_SMC
    (``sock_rcvtimeo``) do; a ``MSG_WAITALL`` read that got some returns it. An SMC connection
    ignored the option and waited for good. A socket timeout, where set, is CPython's own and
    the option has no say."""
    a, b = pair
    a.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(0.2))
    assert struct.unpack("@ll", a.getsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, 16)) == (
        0,
        200000,
    )
    got = _in_thread(lambda: a.recv(10))
    assert isinstance(got, BlockingIOError) and got.errno == errno.EAGAIN, got
    got = _in_thread(lambda: a.recv_into(bytearray(10)))
    assert isinstance(got, BlockingIOError) and got.errno == errno.EAGAIN, got
    b.sendall(b"abc")
    assert _in_thread(lambda: a.recv(10, socket.MSG_WAITALL)) == b"abc"
    b.sendall(b"de")
    assert readable(a, 5)
    assert _in_thread(lambda: a.recv(10, socket.MSG_WAITALL | socket.MSG_PEEK)) == b"de"
    assert a.recv(10) == b"de"
    a.settimeout(0.3)  # CPython's timeout: socket.timeout, whatever SO_RCVTIMEO says
    assert isinstance(_in_thread(lambda: a.recv(10)), TimeoutError)
    a.settimeout(None)
    a.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(0))  # 0: no limit again
    b.sendall(b"later")
    assert _in_thread(lambda: recv_exactly(a, 5)) == b"later"


def test_so_sndtimeo_bounds_a_blocking_send(pair: tuple[Any, Any]) -> None:
    """``SO_SNDTIMEO`` ends a blocking send that finds no room for that long: ``send`` returns
    what it queued, or raises ``EAGAIN`` when nothing went; ``sendall`` raises ``EAGAIN``, as
    on TCP. An SMC connection waited for good behind a peer that does not read."""
    a, b = pair
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(0.2))
    chunk = b"s" * 65536

    def fill() -> tuple[int, Any]:
        sent = 0
        try:
            while True:
                sent += a.send(chunk)
        except OSError as e:
            return sent, e

    sent, err = _in_thread(fill)
    assert isinstance(err, BlockingIOError) and err.errno == errno.EAGAIN, err
    assert sent > 0
    got = _in_thread(lambda: a.sendall(chunk))
    assert isinstance(got, BlockingIOError) and got.errno == errno.EAGAIN, got
    # Nothing that was queued is lost: the reader gets the stream, the count's bytes first.
    head = recv_exactly(b, sent)
    assert head == b"s" * sent


def test_so_rcvtimeo_set_before_the_handoff_counts(
    daemon: MiniDaemon,
) -> None:
    """The option set on the TCP socket before it became an SMC connection (or inherited from
    a listener, as accepted sockets inherit it) bounds the SMC connection's reads too."""

    def before(client: socket.socket, server: socket.socket) -> None:
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(0.2))

    a, b = wrapped_pair(before)
    try:
        assert a.mode == b.mode == "smcd"
        got = _in_thread(lambda: a.recv(10))
        assert isinstance(got, BlockingIOError) and got.errno == errno.EAGAIN, got
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("pair", ["smcd"], indirect=True)
def test_a_late_thread_wakeup_is_harmless(
    pair: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A shutdown's wake-up can land just after the sleeper it was meant for returned (its data
    came first); that thread's next sleep then wakes once for nothing and must sleep on, and
    still take its data when it comes."""
    from smc_handoff.wakeup import thread_wake_fd

    monkeypatch.setattr(channel_base, "_SLEEP_CAP_S", 3600.0)
    a, b = pair
    got: dict[str, Any] = {}

    def reader() -> None:
        fd = thread_wake_fd()
        os.eventfd_write(fd, 1)  # as a late wake-up leaves it
        got["r"] = b.recv(100)
        got["left"] = select_readable(fd)

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    time.sleep(0.3)
    assert t.is_alive() and not got, got
    a.sendall(b"late")
    t.join(30)
    assert not t.is_alive()
    assert got["r"] == b"late"
    assert got["left"] is False  # the stale wake-up was taken, not left to spin on


@pytest.mark.parametrize("pair", ["smcd"], indirect=True)
def test_an_idle_wait_naps_longer_and_longer(
    pair: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A wait with nothing coming wakes by itself only as a safety net, and ever less often:
    each nap that ends with nothing new doubles the next, up to a cap. Idle blocking readers
    used to wake every second (500 idle threads: 1.2 % of a CPU); TCP's do not wake at all.
    Data still ends the wait at once."""
    naps: list[int] = []
    real = channel_base._poll

    class Counting:
        def __init__(self) -> None:
            self.poller = real()

        def register(self, *args: Any) -> None:
            self.poller.register(*args)

        def unregister(self, fd: int) -> None:
            self.poller.unregister(fd)

        def poll(self, ms: int) -> list[tuple[int, int]]:
            naps.append(ms)
            return self.poller.poll(ms)

    monkeypatch.setattr(channel_base, "_poll", Counting)
    monkeypatch.setattr(channel_base, "_SLEEP_CAP_S", 0.01)
    monkeypatch.setattr(channel_base, "_SLEEP_CAP_MAX_S", 0.08)
    a, b = pair
    blocked = _Blocked(lambda: a.recv(10), settle=1.0)
    b.sendall(b"wake")
    assert blocked.result() == b"wake"
    long = [ms for ms in naps if ms >= 10]
    assert long[:4] == [10, 20, 40, 80], naps
    assert set(long[4:]) <= {80}, naps


@pytest.mark.parametrize("pair", ["smcd"], indirect=True)
def test_close_in_another_thread_ends_a_blocked_recv(
    pair: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Closing an SMC connection while another thread waits in ``recv`` ends that wait at once
    with EBADF, as every call on a closed socket fails (Linux TCP leaves such a read blocked
    until the peer sends or closes; the wait used to end at its next nap, up to a second)."""
    monkeypatch.setattr(channel_base, "_SLEEP_CAP_S", 3600.0)
    a, _b = pair
    blocked = _Blocked(lambda: a.recv(10))
    a.close()
    got = blocked.result(what="the blocked recv was not woken by close()")
    assert isinstance(got, OSError) and got.errno == errno.EBADF, got


def select_readable(fd: int) -> bool:
    import select

    return bool(select.select([fd], [], [], 0)[0])


def test_use_after_close(pair: tuple[Any, Any]) -> None:
    a, _b = pair
    a.close()
    assert a.fileno() == -1
    for call in (lambda: a.recv(1), lambda: a.send(b"x"), lambda: a.shutdown(socket.SHUT_WR)):
        with pytest.raises(OSError) as info:
            call()
        assert info.value.errno == errno.EBADF
    a.close()  # idempotent


def test_context_manager_closes(pair: tuple[Any, Any]) -> None:
    a, b = pair
    with a:
        a.sendall(b"ctx")
    assert a.fileno() == -1
    assert recv_exactly(b, 3) == b"ctx"
    assert b.recv(1) == b""


# --- SMC specifics ------------------------------------------------------------------------------


def test_smc_mode_and_notices(daemon: MiniDaemon) -> None:
    a, b = wrapped_pair(dmb_size=16384)
    assert (a.mode, b.mode, a.fallback, b.fallback) == ("smcd", "smcd", None, None)
    assert a.conn_id == b.conn_id and a.conn_id is not None
    assert "mode=smcd" in repr(a)
    # a fresh connection looks at its control connection a second later at the earliest
    assert a._smc is not None and a._smc.next_check > time.monotonic() + 0.5
    assert [type(r) for r in daemon.requests] in ([m.Connect, m.Accept], [m.Accept, m.Connect])
    assert all(r.dmb_size == 16384 for r in daemon.requests)  # type: ignore[union-attr]
    with pytest.raises(OSError) as info:
        a.recv(1, socket.MSG_OOB)
    assert info.value.errno == errno.EOPNOTSUPP
    with pytest.raises(OSError) as info:
        a.sendmsg([b"x"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("i", 0))])
    assert info.value.errno == errno.EOPNOTSUPP
    # socket.fromfd(): a copy of fileno() (the channel's eventfd), then the class (smc-run's)
    twin = SmcSocket(socket.AF_INET, socket.SOCK_STREAM, 0, os.dup(a.fileno()))
    assert twin.mode == a.mode and twin.fileno() == a.fileno()  # another socket, one connection
    twin.sendall(b"twin")
    assert recv_exactly(b, 4) == b"twin"
    twin.close()  # the connection goes on with ``a``: no notice, no hang-up
    same = SmcSocket(socket.AF_INET, socket.SOCK_STREAM, 0, a.fileno())  # the number itself
    same.close()
    assert a.fileno() >= 0 and not a._smc.channel.closed  # type: ignore[union-attr]
    stray = os.eventfd(0)  # an eventfd that is no connection's: still not a socket
    try:
        with pytest.raises(OSError) as info:
            SmcSocket(socket.AF_INET, socket.SOCK_STREAM, 0, stray)
    finally:
        os.close(stray)
    assert info.value.errno == errno.ENOTSOCK and "eventfd" in str(info.value)
    a.sendall(b"x" * 100)
    assert recv_exactly(b, 100) == b"x" * 100
    a.shutdown(socket.SHUT_WR)
    assert daemon.wait_notice(m.Shutdown) == m.Shutdown(socket.SHUT_WR)
    assert daemon.hangups == 0
    a.close()  # the hang-up is the notice (the daemon reads the last counters from the DMBs)
    daemon.wait_hangups(1)
    b.close()
    daemon.wait_hangups(2)
    assert not [n for n in daemon.notices if isinstance(n, m.Close)]


def test_tcp_socket_closes_with_the_smc_socket(daemon: MiniDaemon) -> None:
    """The daemon kept no copy: closing the SmcSocket closes the TCP connection too."""
    a, b = wrapped_pair()
    assert a.mode == "smcd"
    peer = socket.socket(fileno=os.dup(socket.socket.fileno(b)))  # the server's TCP descriptor
    a.close()
    peer.settimeout(2)
    assert peer.recv(1) == b""  # FIN arrived: no other copy held the client's TCP socket open
    peer.close()
    b.close()


def test_detach_before_data_continues_on_tcp(daemon: MiniDaemon) -> None:
    """What ssl does at both ends: take the descriptors over before any byte moved."""
    a, b = wrapped_pair()
    fa, fb = a.detach(), b.detach()
    assert a.fallback is not None and a.fallback.code == m.FALLBACK_DETACHED
    assert daemon.wait_notice(m.Close) == m.Close(False, 0, 0)
    with socket.socket(fileno=fa) as ta, socket.socket(fileno=fb) as tb:
        ta.sendall(b"over tcp now")
        assert recv_exactly(tb, 12) == b"over tcp now"
    c, d = wrapped_pair()
    c.sendall(b"x")
    with pytest.raises(OSError) as info:
        c.detach()
    assert info.value.errno == errno.EOPNOTSUPP and c.mode == "smcd"
    c.close()
    d.close()


def _detach_both(a: SmcSocket, b: SmcSocket) -> tuple[int | BaseException, int | BaseException]:
    """Both ends detach at once, each in its own thread (as two processes' wrap_socket)."""
    out: list[int | BaseException] = [0, 0]

    def leave(i: int, s: SmcSocket) -> None:
        try:
            out[i] = s.detach()
        except BaseException as e:  # the test looks at it
            out[i] = e

    threads = [threading.Thread(target=leave, args=(i, s)) for i, s in enumerate((a, b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    return out[0], out[1]


def test_after_data_both_ends_leave_together_and_tcp_goes_on(daemon: MiniDaemon) -> None:
    """STARTTLS: a plaintext exchange over the channel, then ``ssl`` takes both ends over.
    Both ends leave together (nothing unread at either), and the TCP stream goes on from
    there in both directions; the fallback says how much moved over SMC first."""
    a, b = wrapped_pair()
    a.sendall(b"STARTTLS\r\n")
    assert recv_exactly(b, 10) == b"STARTTLS\r\n"
    b.sendall(b"220 go\r\n")
    assert recv_exactly(a, 8) == b"220 go\r\n"
    fa, fb = _detach_both(a, b)
    assert isinstance(fa, int) and isinstance(fb, int), (fa, fb)
    assert a.fallback is not None and a.fallback.code == m.FALLBACK_DETACHED
    assert "after 10 bytes sent and 8 received over SMC" in a.fallback.explanation
    with socket.socket(fileno=fa) as ta, socket.socket(fileno=fb) as tb:
        ta.sendall(b"client hello")
        assert recv_exactly(tb, 12) == b"client hello"
        tb.sendall(b"server hello")
        assert recv_exactly(ta, 12) == b"server hello"


def test_one_end_alone_cannot_leave_after_data(
    daemon: MiniDaemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The peer does not come to leave (it does no TLS): after the wait, EOPNOTSUPP, and the
    connection goes on over SMC as if nothing happened (the peer's data sent meanwhile too).
    With something unread here the refusal comes at once: ``ssl`` would never see it."""
    monkeypatch.setattr(smc_socket, "LEAVE_WAIT_S", 0.3)
    a, b = wrapped_pair()
    a.sendall(b"x")
    assert recv_exactly(b, 1) == b"x"
    t0 = time.monotonic()
    with pytest.raises(OSError) as info:
        a.detach()
    assert info.value.errno == errno.EOPNOTSUPP and "did not leave too" in str(info.value)
    assert 0.25 < time.monotonic() - t0 < 5
    assert a.mode == b.mode == "smcd"
    b.sendall(b"still smc")
    assert recv_exactly(a, 9) == b"still smc"
    a.sendall(b"both ways")
    assert recv_exactly(b, 9) == b"both ways"
    b.sendall(b"unread")
    time.sleep(0.05)
    t0 = time.monotonic()
    with pytest.raises(OSError):
        a.detach()
    assert time.monotonic() - t0 < 0.2  # at once
    assert recv_exactly(a, 6) == b"unread"
    # and a peer that leaves while this end still has its data unread: neither leaves
    b.sendall(b"late")
    time.sleep(0.05)
    fa, fb = _detach_both(a, b)
    assert isinstance(fa, OSError) and isinstance(fb, OSError), (fa, fb)
    assert a.mode == b.mode == "smcd"
    assert recv_exactly(a, 4) == b"late"
    # the attempts that gave up do not spoil one where both come with nothing unread
    fa, fb = _detach_both(a, b)
    assert isinstance(fa, int) and isinstance(fb, int), (fa, fb)
    with socket.socket(fileno=fa) as ta, socket.socket(fileno=fb) as tb:
        tb.sendall(b"on tcp")
        assert recv_exactly(ta, 6) == b"on tcp"


CHILD = r"""
import os, sys, time
sys.path.insert(0, {repo!r})
import smc_handoff
s = smc_handoff.connect(("127.0.0.1", {port}))
s.sendall(s.mode.encode() + b"\n")
if sys.argv[1] == "stream":
    import hashlib
    data = bytes(range(256)) * 32768  # 8 MiB
    for i in range(0, len(data), 9973):
        s.sendall(data[i:i + 9973])
    s.sendall(hashlib.sha256(data).hexdigest().encode())
    s.close()
else:
    time.sleep(60)
"""


def _child_connection(daemon: MiniDaemon, how: str) -> tuple[subprocess.Popen[bytes], SmcSocket]:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        code = CHILD.format(repo=str(REPO), port=listener.getsockname()[1])
        child = subprocess.Popen([sys.executable, "-c", code, how])
        listener.settimeout(10)
        conn, _ = listener.accept()
    s = smc_handoff.wrap(conn, server_side=True)
    assert s.mode == "smcd", s.fallback
    s.settimeout(10)
    assert s.makefile("rb").readline() == b"smcd\n"
    return child, s


def test_cross_process_stream(daemon: MiniDaemon) -> None:
    child, s = _child_connection(daemon, "stream")
    data = bytes(range(256)) * 32768
    got = recv_exactly(s, len(data) + 64)
    assert got[: len(data)] == data
    assert got[len(data) :] == hashlib.sha256(data).hexdigest().encode()
    assert s.recv(1) == b""
    assert child.wait(10) == 0
    s.close()


@pytest.mark.parametrize("unread", [False, True], ids=["all-read", "unread"])
def test_sigkill_of_the_peer_is_seen_within_a_second(daemon: MiniDaemon, unread: bool) -> None:
    """The killed peer's end is closed as the kernel closes a dead process's sockets: EOF when
    it had read everything (TCP's FIN), a reset when bytes we sent were unread (TCP's RST)."""
    child, s = _child_connection(daemon, "sleep")
    import select

    if unread:
        s.sendall(b"the sleeping child never reads this")
    # The child's wakeup for the line we read may land after we read it (its process can be
    # descheduled between publishing and kicking): let it land, then a non-blocking recv, as a
    # select loop does, clears that stale readiness.
    time.sleep(0.2)
    s.setblocking(False)
    with pytest.raises(BlockingIOError):
        s.recv(1)
    assert select.select([s], [], [], 0)[0] == []
    t0 = time.monotonic()
    child.send_signal(signal.SIGKILL)
    child.wait(5)
    assert select.select([s], [], [], 2)[0] == [s]
    if unread:
        with pytest.raises(ConnectionResetError):
            s.recv(1)
    else:
        assert s.recv(1) == b""
    assert time.monotonic() - t0 < 1.0
    s.close()


def test_daemon_restart_keeps_the_channel_and_resumes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "h.sock"
    monkeypatch.setenv("SMCD_HANDOFF_SOCKET", str(path))
    first = MiniDaemon(path)
    a, b = wrapped_pair()
    old_id = a.conn_id
    first.stop()  # the daemon dies: both control connections hang up
    a.sendall(b"still here")  # the channel does not need the daemon
    assert recv_exactly(b, 10) == b"still here"
    second = MiniDaemon(path)
    try:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and (
            len([r for r in second.requests if isinstance(r, m.Resume)]) < 2
            or a.conn_id == old_id
            or b.conn_id == old_id
        ):
            for s in (a, b):  # waiting is when the library looks at its control connection
                s.settimeout(0.05)
                with contextlib.suppress(TimeoutError):
                    s.recv(1)
        resumes = {r.role: r for r in second.requests if isinstance(r, m.Resume)}
        assert resumes[m.Role.CLIENT] == m.Resume(
            old_id, m.Role.CLIENT, m.Mode.SMCD, 65536, 65536, bytes_sent=10
        )
        assert resumes[m.Role.SERVER] == m.Resume(
            old_id, m.Role.SERVER, m.Mode.SMCD, 65536, 65536, bytes_received=10
        )
        assert a.conn_id is not None and a.conn_id > 100 and b.conn_id is not None
        a.shutdown(socket.SHUT_WR)
        assert second.wait_notice(m.Shutdown) == m.Shutdown(socket.SHUT_WR)  # to the new one
        a.close()
        b.close()
        second.wait_hangups(2)
    finally:
        second.stop()


# --- degrading to TCP ---------------------------------------------------------------------------


def _fallback_pair() -> tuple[SmcSocket, SmcSocket]:
    a, b = wrapped_pair()
    assert a.mode == b.mode == "tcp"
    a.sendall(b"tcp works")
    assert recv_exactly(b, 9) == b"tcp works"
    return a, b


def test_no_daemon_is_tcp_with_the_reason_at_both_ends(no_daemon: Path) -> None:
    server = smc_handoff.listen(("127.0.0.1", 0))
    assert not server.registered and server.fallback is not None
    assert server.fallback.code == m.FALLBACK_DAEMON_UNAVAILABLE
    client = smc_handoff.connect(server.getsockname(), timeout=5)
    conn, addr = server.accept()
    assert addr == client.getsockname()
    for s in (client, conn):
        assert s.mode == "tcp" and s.fallback is not None
        assert s.fallback.code == m.FALLBACK_DAEMON_UNAVAILABLE == 0xFF000001
        assert s.fallback.name == "DAEMON_UNAVAILABLE"
        assert "daemon unavailable" in s.fallback.explanation
        assert str(no_daemon) in s.fallback.explanation
    assert client.gettimeout() == 5
    client.sendall(b"ping")
    assert recv_exactly(conn, 4) == b"ping"
    for s in (client, conn, server):
        s.close()


def test_refused_and_stale_socket_is_unavailable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stale = tmp_path / "stale.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.bind(str(stale))
    s.close()  # the path exists, nobody listens: ECONNREFUSED
    monkeypatch.setenv("SMCD_HANDOFF_SOCKET", str(stale))
    a, b = _fallback_pair()
    assert a.fallback is not None and "Connection refused" in a.fallback.explanation
    a.close()
    b.close()


def test_daemon_fallback_reason_passes_through_and_blocking_is_restored(daemon: MiniDaemon) -> None:
    daemon.behaviour = "fallback"
    a, b = _fallback_pair()
    want = m.Fallback(0x03010000, "PEERNOSMC", "no SMC peer", 0x7)
    assert a.fallback == want and b.fallback == want
    assert os.get_blocking(a.fileno()) and a.gettimeout() is None  # daemon set O_NONBLOCK
    a.close()
    b.close()


@pytest.mark.parametrize(
    ("behaviour", "code", "text"),
    [
        ("error", m.FALLBACK_DAEMON_ERROR, "refused: INTERNAL: boom"),
        ("garbage", m.FALLBACK_DAEMON_ERROR, "invalid reply"),
    ],
)
def test_broken_daemon_degrades_to_tcp(
    daemon: MiniDaemon, monkeypatch: pytest.MonkeyPatch, behaviour: str, code: int, text: str
) -> None:
    """A daemon that answers nonsense without touching the stream: TCP as the application
    left it."""
    daemon.behaviour = behaviour
    monkeypatch.setenv("SMCD_HANDOFF_TIMEOUT", "0.3")
    a, b = _fallback_pair()
    assert a.fallback is not None and a.fallback.code == code
    assert text in a.fallback.explanation
    a.close()
    b.close()


def test_silent_daemon_is_an_error_and_resets(
    daemon: MiniDaemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No reply in time: the daemon still holds the socket and could write into it later, so
    the handoff fails with ETIMEDOUT and the connection is reset (a fallback before this rule).
    ``accept`` hands the reset socket out instead of failing."""
    daemon.behaviour = "silent"
    monkeypatch.setenv("SMCD_HANDOFF_TIMEOUT", "0.3")
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname())
        server, _ = listener.accept()
    with pytest.raises(TimeoutError) as info:
        smc_handoff.wrap(client)
    assert info.value.errno == errno.ETIMEDOUT
    assert "no reply to CONNECT within 0.3 s" in str(info.value)
    with pytest.raises(ConnectionResetError):  # the peer sees the reset, not a hang
        server.recv(10)
    server.close()


def test_daemon_of_another_user_is_not_trusted(monkeypatch: pytest.MonkeyPatch) -> None:
    if os.getuid() != 0:
        pytest.fail("this test needs root (to run the impostor as nobody); CI runs as root")
    where = Path(tempfile.mkdtemp(prefix="smc-impostor-"))
    where.chmod(0o777)
    path = where / "handoff.sock"
    code = (
        "import os, socket, sys, time\n"
        "os.setuid(65534)\n"
        "s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)\n"
        f"s.bind({str(path)!r}); s.listen(8)\n"
        "print('ready', flush=True)\n"
        "while True:\n"
        "    c, _ = s.accept()\n"
    )
    impostor = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    try:
        assert impostor.stdout is not None and impostor.stdout.readline() == b"ready\n"
        monkeypatch.setenv("SMCD_HANDOFF_SOCKET", str(path))
        a, b = _fallback_pair()
        assert a.fallback is not None and a.fallback.code == m.FALLBACK_DAEMON_UNAVAILABLE
        assert "uid 65534" in a.fallback.explanation
        a.close()
        b.close()
    finally:
        impostor.kill()
        impostor.wait()
        path.unlink(missing_ok=True)
        where.rmdir()


# --- the listener -------------------------------------------------------------------------------


def _accept_a_client(server: smc_handoff.SmcServer) -> tuple[SmcSocket, Any, SmcSocket]:
    """Accept one connection that a thread makes with ``smc_handoff.connect``: (accepted
    socket, its peer address, the client's socket)."""
    out: dict[str, SmcSocket] = {}
    t = threading.Thread(
        target=lambda: out.setdefault("c", smc_handoff.connect(server.getsockname()))
    )
    t.start()
    conn, addr = server.accept()
    t.join(10)
    return conn, addr, out["c"]


def test_listen_registers_and_accept_hands_off(daemon: MiniDaemon) -> None:
    with smc_handoff.listen(("127.0.0.1", 0)) as server:
        assert server.registered and server.listener_id == 1 and server.fallback is None
        assert "listener 1" in repr(server)
        conn, _, client = _accept_a_client(server)
        assert conn.mode == client.mode == "smcd"
        client.sendall(b"over smc")
        assert recv_exactly(conn, 8) == b"over smc"
        client.close()
        conn.close()
        assert isinstance(daemon.requests[0], m.Listen)
        daemon.stop()  # the daemon goes away: the registration is dropped
        deadline = time.monotonic() + 2
        while server.registered and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not server.registered
        again = MiniDaemon(daemon.path)  # a new daemon: registered again (retried each second)
        try:
            deadline = time.monotonic() + 3
            while not server.registered and time.monotonic() < deadline:
                time.sleep(0.05)
            assert server.registered and isinstance(again.requests[0], m.Listen)
        finally:
            again.stop()


class _CountingListener(socket.socket):
    """A listener class with an accept() of its own, which SmcServer must call."""

    accepted = 0

    def accept(self) -> tuple[socket.socket, Any]:
        type(self).accepted += 1
        return super().accept()


@pytest.mark.parametrize("own_accept", [False, True])
def test_server_accept_as_socket_accept(daemon: MiniDaemon, own_accept: bool) -> None:
    """SmcServer.accept behaves as socket.accept (the listener's timeout is not inherited,
    names are right) whether it makes the SmcSocket itself or the listener class accepts."""
    listener = _CountingListener() if own_accept else socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.settimeout(5)
    _CountingListener.accepted = 0
    with smc_handoff.SmcServer(listener) as server:
        conn, addr, client = _accept_a_client(server)
        assert type(conn) is SmcSocket and conn.mode == client.mode == "smcd"
        assert _CountingListener.accepted == (1 if own_accept else 0)
        assert conn.gettimeout() is None  # as socket.accept with no default timeout
        assert addr == client.getsockname() == conn.getpeername()
        assert conn.getsockname() == server.getsockname()
        client.sendall(b"hello")
        assert recv_exactly(conn, 5) == b"hello"
        conn.sendall(b"back")
        assert recv_exactly(client, 4) == b"back"
        client.close()
        conn.close()


def test_wrap_refuses_non_tcp() -> None:
    a, b = socket.socketpair()
    with pytest.raises(ValueError, match="stream sockets"):
        smc_handoff.wrap(a)
    a.close()
    b.close()
    with socket.socket() as unconnected, pytest.raises(OSError) as info:
        smc_handoff.wrap(unconnected)
    assert info.value.errno == errno.ENOTCONN


def test_a_relay_gives_a_child_process_the_connection(daemon: MiniDaemon) -> None:
    """smc_handoff.child_relay (what smc-run's subprocess patch uses): the child reads and
    writes the connection through a socketpair; the relay owns the connection, so the parent's
    copy raises EBUSY if used and closes quietly; the peer sees the child's close as EOF."""
    from smc_handoff import child_relay

    a, b = wrapped_pair()
    assert child_relay.connection_of(b) is b
    assert child_relay.connection_of(b.fileno()) is b  # the descriptor form finds the socket
    assert child_relay.connection_of(0) is None and child_relay.connection_of("x") is None
    upper = "import os\nwhile d := os.read(0, 4096): os.write(1, d.upper())"
    fd = child_relay.relay_fd(b)
    try:
        child = subprocess.Popen([sys.executable, "-c", upper], stdin=fd, stdout=fd)
    finally:
        os.close(fd)
    with pytest.raises(OSError) as info:
        b.sendall(b"the parent's copy")
    assert info.value.errno == errno.EBUSY
    b.close()  # quiet: the relay goes on
    a.sendall(b"through the relay\n")
    assert recv_exactly(a, 18) == b"THROUGH THE RELAY\n"
    a.shutdown(socket.SHUT_WR)  # the child's stdin ends: it exits, its end closes
    assert child.wait(10) == 0
    a.settimeout(5)
    assert a.recv(10) == b""  # EOF: the relay closed the connection in order
    a.close()


def test_rights_carry_one_relay_held_until_the_senders_close(daemon: MiniDaemon) -> None:
    """child_relay.relay_rights (smc-run's sendmsg): an SMC connection's fileno() in an
    SCM_RIGHTS entry becomes its relay's socket, the same one however often it is sent (a send
    that failed and is tried again); other descriptors and entries stay as they were. The
    connection ends once the receiver and the sender have both closed it, as a TCP socket
    passed on does: not at the receiver's close while the sender still holds its copy."""
    import array

    from smc_handoff import child_relay

    a, b = wrapped_pair()
    rights = (socket.SOL_SOCKET, socket.SCM_RIGHTS)
    other = (socket.SOL_SOCKET, 99, b"kept")
    entry = (*rights, array.array("i", [1, b.fileno()]))
    first = child_relay.relay_rights([other, entry])
    again = child_relay.relay_rights([entry])
    assert first is not None and again is not None
    assert first[0] == other and first[1][2][0] == 1  # untouched: not an SMC connection
    relay = first[1][2][1]
    assert again[0][2][1] == relay != b.fileno()
    assert child_relay.relay_rights([(*rights, array.array("i", [1]))]) is None
    sender, receiver = socket.socketpair()
    socket.send_fds(sender, [b"c"], [relay])
    _, fds, _, _ = socket.recv_fds(receiver, 1, 1)
    passed = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM, fileno=fds[0])
    a.sendall(b"to the receiver")
    assert recv_exactly(passed, 15) == b"to the receiver"
    passed.sendall(b"back")
    assert recv_exactly(a, 4) == b"back"
    passed.close()  # the sender's copy holds the connection on
    a.settimeout(0.3)
    with pytest.raises(TimeoutError):
        a.recv(1)
    b.close()  # the last copy: the relay closes the connection in order
    a.settimeout(5)
    assert a.recv(1) == b""
    a.close()
    sender.close()
    receiver.close()


def test_dup_holds_the_connection_until_the_last_close(daemon: MiniDaemon) -> None:
    """socket.dup() of an SMC socket: another object for the same connection, as dup(2) gives
    another descriptor for one socket; closing one leaves the connection to the other."""
    a, b = wrapped_pair()
    d = a.dup()
    assert (d.mode, d.conn_id, d.gettimeout()) == ("smcd", a.conn_id, a.gettimeout())
    assert d.fileno() == a.fileno()  # the channel's eventfd: one connection
    d.sendall(b"via the dup ")
    a.sendall(b"and the original")
    assert recv_exactly(b, 28) == b"via the dup and the original"
    with pytest.raises(OSError) as info:
        d.leave_channel()
    assert info.value.errno == errno.EOPNOTSUPP
    a.close()  # d still holds it: no close reaches the peer
    b.settimeout(0.2)
    with pytest.raises(TimeoutError):
        b.recv(1)
    b.sendall(b"still open")
    assert recv_exactly(d, 10) == b"still open"
    assert daemon.hangups == 0
    d.close()  # the last one: the peer reads EOF, the daemon sees the hang-up
    b.settimeout(5)
    assert b.recv(1) == b""
    daemon.wait_hangups(1)
    b.close()


def test_a_copy_of_the_fileno_stands_for_the_connection(daemon: MiniDaemon) -> None:
    """``os.dup(sock.fileno())`` is the same eventfd under another number: smc-run's
    ``pass_fds``, ``SCM_RIGHTS``, ``os.dup2`` and child streams give its relay for it too
    (matched by the kernel's eventfd id), while another eventfd is no connection."""
    from smc_handoff import child_relay

    a, b = wrapped_pair()
    copy = os.dup(b.fileno())
    other = os.eventfd(0)
    try:
        assert child_relay.connection_of(b.fileno()) is b
        assert child_relay.connection_of(copy) is b
        assert child_relay.connection_of(other) is None
        assert child_relay.dup2_source(copy) == child_relay.shared_relay(b) != copy
    finally:
        os.close(copy)
        os.close(other)
        a.close()
        b.close()


def test_the_connection_at_a_fileno_follows_dups_and_closes(daemon: MiniDaemon) -> None:
    """``connection_at``: what smc-run's ``os.read``/``os.write``/``fcntl.ioctl`` route a bare
    number by. A ``dup()`` shares the number; the connection stays found until its last close,
    and its number is forgotten then (another file may get it)."""
    from smc_handoff import socket as smc_socket

    a, b = wrapped_pair()
    fd = a.fileno()
    assert smc_socket.connection_at(fd) is a and smc_socket.connection_at(b.fileno()) is b
    twin = a.dup()
    assert twin.fileno() == fd
    a.close()
    assert smc_socket.connection_at(fd) is twin
    twin.close()
    assert smc_socket.connection_at(fd) is None and fd not in smc_socket.by_fileno
    b.close()
    assert smc_socket.connection_at(-1) is None


def test_descriptor_calls_answer_as_on_a_tcp_socket(pair: tuple[Any, Any]) -> None:
    """``fd_read``/``fd_write``/``fd_ioctl`` (what smc-run gives ``os.read``, ``os.write`` and
    ``fcntl.ioctl`` on an SMC connection's number) against read(2), write(2) and ioctl(2) on a
    TCP socket's descriptor: FIONREAD counts what is unread; a socket with a timeout is
    O_NONBLOCK, so a read finds nothing at once; EOF is an empty read."""
    import fcntl
    import termios

    a, b = pair

    def call(sock: Any, what: str, *args: Any) -> Any:
        if isinstance(sock, SmcSocket) and sock.mode == "smcd":
            if what == "ioctl":
                return sock.fd_ioctl(args[0])
            return getattr(sock, f"fd_{what}")(*args)
        fd = sock.fileno()
        if what == "ioctl":
            return struct.unpack("i", fcntl.ioctl(fd, args[0], b"\0" * 4))[0]
        return getattr(os, what)(fd, *args)

    assert call(b, "ioctl", termios.FIONREAD) == 0
    assert call(a, "write", b"x" * 1000) == 1000
    assert readable(b, 5)
    assert call(b, "ioctl", termios.FIONREAD) == 1000
    assert call(b, "read", 10) == b"x" * 10
    assert call(b, "ioctl", termios.FIONREAD) == 990
    assert call(b, "read", 4096) == b"x" * 990
    deadline = time.monotonic() + 2  # TCP's count is of bytes not yet acknowledged
    while call(a, "ioctl", termios.TIOCOUTQ) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert call(a, "ioctl", termios.TIOCOUTQ) == 0  # all of it is at the peer
    b.settimeout(2.0)
    with pytest.raises(BlockingIOError):
        call(b, "read", 10)
    b.settimeout(None)
    a.shutdown(socket.SHUT_WR)
    assert readable(b, 5)
    assert call(b, "read", 10) == b""
    assert call(b, "ioctl", termios.FIONREAD) == 0
    if isinstance(b, SmcSocket) and b.mode == "smcd":
        assert b.fd_ioctl(termios.TIOCGWINSZ) is None  # not a socket's: the eventfd's answer


def test_a_file_on_the_descriptor_answers_as_on_a_tcp_socket(pair: tuple[Any, Any]) -> None:
    """``fd_open`` (what smc-run gives ``open``/``os.fdopen`` of an SMC connection's number)
    against ``io.open`` of a TCP socket's descriptor (``FileIO`` under it): text and binary
    lines, an unbuffered read of a socket with a timeout that finds nothing (``None``:
    O_NONBLOCK's EAGAIN), modes that are not a stream's refused alike, and a file that owns the
    descriptor closing the connection."""
    a, b = pair

    def fopen(sock: Any, *args: Any, **kw: Any) -> Any:
        if isinstance(sock, SmcSocket) and sock.mode == "smcd":
            return sock.fd_open(*args, **kw)
        return open(sock.fileno(), *args, **kw)

    out = fopen(a, "w", 1, closefd=False)
    text = fopen(b, "r", encoding="ascii", closefd=False)
    out.write("one\ntwo\n")
    assert text.readline() == "one\n" and text.readline() == "two\n"
    assert text.mode == "r" and out.mode == "w"
    raw = fopen(b, "rb", 0, closefd=False)
    b.settimeout(2.0)
    assert raw.read(10) is None
    b.settimeout(None)
    for bad in ("rw", "r+", "z"):  # no two of r/w/x/a; "+" wants a seekable stream
        with pytest.raises((ValueError, io.UnsupportedOperation)):
            fopen(b, bad, closefd=False)
    with pytest.raises(ValueError):
        fopen(b, "r", 0, closefd=False)  # unbuffered text
    for f in (out, text, raw):
        f.close()
    owner = fopen(a, "wb")  # closefd: closing the file closes the descriptor
    owner.write(b"last")
    owner.close()
    if not (isinstance(a, SmcSocket) and a.mode == "smcd"):
        a.detach()  # its number is closed: the socket object must not close it again
    assert recv_exactly(b, 4) == b"last"
    assert b.recv(10) == b""  # the connection ended with the file


def test_an_ioctl_answer_takes_the_forms_fcntl_returns() -> None:
    """``fcntl.ioctl``'s argument forms for an int result: bytes or str (the buffer's bytes
    come back with the int in front), a mutable buffer (filled in place, 0 returned, unless
    ``mutate_flag`` is false), an int (a pointer: EFAULT, as the kernel says for address 0)."""
    from smc_handoff.run import _ioctl_answer

    packed = struct.pack("i", 1234)
    assert _ioctl_answer(1234, b"\0" * 4, True) == packed
    assert _ioctl_answer(1234, b"\0" * 6, True) == packed + b"\0\0"
    assert _ioctl_answer(1234, "\0" * 4, True) == packed
    assert _ioctl_answer(1234, b"\0\0", True) == packed[:2]
    buf = bytearray(4)
    assert _ioctl_answer(1234, buf, True) == 0 and bytes(buf) == packed
    buf = bytearray(4)
    assert _ioctl_answer(1234, buf, False) == packed and buf == bytearray(4)
    with pytest.raises(OSError) as e:
        _ioctl_answer(1234, 0, True)
    assert e.value.errno == errno.EFAULT


def _outcome(call: Any) -> Any:
    try:
        return ("returned", call())
    except Exception as e:  # the kind and the words are compared
        return (type(e).__name__, str(e))


REFUSED_CALLS: dict[str, Any] = {
    # Writes from buffers a socket cannot take as they are: a strided view, text, a number.
    "send strided": lambda a, b: a.send(memoryview(bytearray(b"abcdefgh"))[::2]),
    "sendall strided": lambda a, b: a.sendall(memoryview(bytearray(b"abcdefgh"))[::2]),
    "sendmsg strided": lambda a, b: a.sendmsg([b"ok", memoryview(bytearray(b"abcd"))[::2]]),
    "sendto strided": lambda a, b: a.sendto(memoryview(bytearray(b"abcd"))[::2], a.getpeername()),
    "send str": lambda a, b: a.send("text"),
    "sendall str": lambda a, b: a.sendall("text"),
    "sendmsg str": lambda a, b: a.sendmsg([b"ok", "text"]),
    "send int": lambda a, b: a.send(3),
    # Reads into buffers that cannot take bytes: read-only, strided, text.
    "recv_into bytes": lambda a, b: b.recv_into(b"xxxx"),
    "recv_into read-only view": lambda a, b: b.recv_into(memoryview(b"xxxx")),
    "recv_into strided": lambda a, b: b.recv_into(memoryview(bytearray(8))[::2]),
    "recv_into str": lambda a, b: b.recv_into("xxxx"),
    "recvfrom_into bytes": lambda a, b: b.recvfrom_into(b"xxxx"),
    "recvmsg_into bytes": lambda a, b: b.recvmsg_into([bytearray(2), b"xx"]),
    "recvmsg_into strided": lambda a, b: b.recvmsg_into([memoryview(bytearray(8))[::2]]),
    # Sizes and flags that are not integers a C call takes, or out of its range, and the
    # ValueErrors of each call in its own words.
    "recv negative": lambda a, b: b.recv(-1),
    "recv float": lambda a, b: b.recv(1.5),
    "recv too large": lambda a, b: b.recv(2**63),
    "recv str flags": lambda a, b: b.recv(4, "f"),
    "recv float zero flags": lambda a, b: b.recv(4, 0.0),
    "recv flags too large": lambda a, b: b.recv(4, 2**31),
    "recv_into negative": lambda a, b: b.recv_into(bytearray(4), -1),
    "recv_into more than the buffer": lambda a, b: b.recv_into(bytearray(4), 10),
    "recv_into str nbytes": lambda a, b: b.recv_into(bytearray(4), "x"),
    "recv_into huge nbytes": lambda a, b: b.recv_into(bytearray(4), 2**63),
    "recv_into None flags": lambda a, b: b.recv_into(bytearray(4), 0, None),
    "recv_into flags too small": lambda a, b: b.recv_into(bytearray(4), 0, -(2**31) - 1),
    "recvfrom negative": lambda a, b: b.recvfrom(-1),
    "recvfrom_into negative": lambda a, b: b.recvfrom_into(bytearray(4), -1),
    "recvmsg negative": lambda a, b: b.recvmsg(-1),
    "recvmsg negative ancbufsize": lambda a, b: b.recvmsg(4, -1),
    "recvmsg str ancbufsize": lambda a, b: b.recvmsg(4, "x"),
    "recvmsg_into negative ancbufsize": lambda a, b: b.recvmsg_into([bytearray(4)], -1),
    "recvmsg_into not iterable": lambda a, b: b.recvmsg_into(5),
    "send str flags": lambda a, b: a.send(b"x", "f"),
    "send None flags": lambda a, b: a.send(b"x", None),
    "send flags too large": lambda a, b: a.send(b"x", 2**40),
    "sendall float zero flags": lambda a, b: a.sendall(b"x", 0.0),
    "sendmsg ancdata not iterable": lambda a, b: a.sendmsg([b"x"], 5),
    "sendmsg str flags": lambda a, b: a.sendmsg([b"x"], [], "f"),
    "shutdown str": lambda a, b: a.shutdown("x"),
    "shutdown too large": lambda a, b: a.shutdown(2**31),
    "shutdown unknown": lambda a, b: a.shutdown(5),
}


@pytest.mark.parametrize("call", sorted(REFUSED_CALLS))
def test_a_call_tcp_refuses_is_refused_the_same_way(pair: tuple[Any, Any], call: str) -> None:
    """Same exception, same words as on a TCP socket, and nothing moved: a program that
    catches TCP's ``BufferError``/``TypeError``/``ValueError`` (or prints it) cannot tell SMC
    apart, and the stream after the refused call is the stream before it (data waits to be
    read). (``MSG_OOB`` and ``MSG_ERRQUEUE`` are refused as the kernel's AF_SMC refuses them.)"""
    a, b = pair
    oracle_a, oracle_b = tcp_pair()
    try:
        oracle_a.sendall(b"wait")  # something to read both ways: no read call can block
        oracle_b.sendall(b"back")
        expected = _outcome(lambda: REFUSED_CALLS[call](oracle_a, oracle_b))
    finally:
        oracle_a.close()
        oracle_b.close()
    assert expected[0] != "returned"  # the oracle refuses it: else this case tests nothing
    a.sendall(b"wait")
    b.sendall(b"back")
    assert _outcome(lambda: REFUSED_CALLS[call](a, b)) == expected
    # Nothing was consumed and nothing was sent: the stream goes on as it was.
    a.sendall(b"!")
    assert recv_exactly(b, 5) == b"wait!"
    assert recv_exactly(a, 4) == b"back"


def test_a_rebound_registration_renews_with_the_new_socket_object(daemon: MiniDaemon) -> None:
    """``ssl`` wrapping a registered listener moves the descriptor to another socket object
    (the original is detached): the registration is rebound to it, and its renewal after the
    daemon came back passes that object's descriptor, not the detached one's (-1)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    reg = Registration(listener)
    try:
        assert reg.active
        wrapped = socket.socket(fileno=listener.detach())  # what SSLSocket._create does
        reg.rebind(wrapped)
        daemon.stop()
        deadline = time.monotonic() + 2
        while reg.active and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not reg.active
        again = MiniDaemon(daemon.path)
        try:
            deadline = time.monotonic() + 3
            while not reg.active and time.monotonic() < deadline:
                time.sleep(0.05)
            assert reg.active and isinstance(again.requests[0], m.Listen)
        finally:
            again.stop()
    finally:
        reg.close()
        listener.close()
        wrapped.close()
