"""The library's own view of a TCP stream during a handoff (#14), on real sockets: the kernel's
byte counts (:class:`smc_handoff.handoff.StreamMark`) see writes, reads, a FIN sent through another
descriptor (a daemon's copy) and nothing else — not a peek, the peer's data or its FIN; CLC bytes at
the head are peeked, never consumed; the reset reaches the peer while another copy is open; a
daemon's exit is seen through a pidfd; FALLBACK's ``after_decline`` flag travels. The handoffs
themselves (lying fake daemons, the real smcd killed and frozen) are in
``tests/e2e/test_stream_integrity.py``."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from smc_handoff import handoff as h
from smc_handoff import messages as m

EYES = h.CLC_EYECATCHERS


def tcp_pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname())
        server, _ = listener.accept()
    return client, server


def settle() -> None:
    time.sleep(0.05)  # loopback delivers at once; this covers the ACK too


def test_mark_is_equal_while_idle_and_while_the_peers_data_arrives() -> None:
    a, b = tcp_pair()
    with a, b:
        before = h.StreamMark.take(a)
        assert h.StreamMark.take(a) == before
        b.sendall(b"x" * 100_000)  # arrives, unread: nothing consumed
        settle()
        assert h.StreamMark.take(a).untouched_since(before)
        a.sendall(b"y" * 1000)  # any write counts, sent or still queued
        after = h.StreamMark.take(a)
        assert after.written == before.written + 1000 and after.consumed == before.consumed
        assert not after.untouched_since(before)


def test_mark_sees_a_write_through_another_descriptor() -> None:
    a, b = tcp_pair()
    with a, b:
        before = h.StreamMark.take(a)
        os.write(os.dup(a.fileno()), EYES[0])  # a daemon's copy of the descriptor
        settle()
        after = h.StreamMark.take(a)
        assert not after.untouched_since(before)
        assert after.written - before.written == 4
        assert "4 bytes written and 0 read" in after.describe_since(before)


def test_mark_sees_a_read_through_another_descriptor_but_not_a_peek() -> None:
    a, b = tcp_pair()
    with a, b:
        b.sendall(b"hello world")
        settle()
        before = h.StreamMark.take(a)
        other = socket.socket(fileno=os.dup(a.fileno()))
        assert other.recv(5, socket.MSG_PEEK) == b"hello"
        assert h.StreamMark.take(a).untouched_since(before)
        assert other.recv(5) == b"hello"
        after = h.StreamMark.take(a)
        assert not after.untouched_since(before) and after.consumed - before.consumed == 5
        other.close()
        assert a.recv(100) == b" world"  # ours goes on where the other reader stopped


def test_mark_ignores_the_peers_fin_and_reading_eof() -> None:
    a, b = tcp_pair()
    with a, b:
        b.sendall(b"data")
        settle()
        before = h.StreamMark.take(a)
        b.shutdown(socket.SHUT_WR)
        settle()
        assert h.StreamMark.take(a).untouched_since(before)  # the kernel counts the FIN
        other = socket.socket(fileno=os.dup(a.fileno()))
        assert other.recv(10) == b"data"
        read = h.StreamMark.take(a)
        assert read.consumed == before.consumed + 4
        assert other.recv(10) == b""  # EOF: no byte of data
        assert h.StreamMark.take(a).untouched_since(read)
        other.close()


def test_mark_sees_a_shutdown_by_another_descriptor() -> None:
    a, b = tcp_pair()
    with a, b:
        before = h.StreamMark.take(a)
        other = socket.socket(fileno=os.dup(a.fileno()))
        other.shutdown(socket.SHUT_WR)  # a FIN is a byte of the stream too
        settle()
        assert not h.StreamMark.take(a).untouched_since(before)
        other.close()


def test_a_closed_connection_is_never_untouched() -> None:
    a, b = tcp_pair()
    with a, b:
        before = h.StreamMark.take(a)
        h.reset(a)
        after = h.StreamMark.take(a)
        assert not after.untouched_since(before)
        assert "closed" in after.describe_since(before)


def test_without_the_kernels_counts_nothing_is_untouched() -> None:
    """A kernel whose TCP_INFO lacks the byte counts (before 4.2) gives marks that never
    compare equal: every failed handoff is then an error, never a blind fallback."""
    a, b = tcp_pair()
    with a, b:
        real = h.StreamMark.take(a)
        blind = h.StreamMark(0, 0, -1)
        assert not blind.untouched_since(blind) and not real.untouched_since(blind)
        assert "does not count" in real.describe_since(blind)


@pytest.mark.parametrize(
    ("data", "clc"),
    [
        (EYES[0] + b"\x01\x00\x78\x20", True),
        (EYES[1] + b"\x04\x00\x1c\x20", True),
        (EYES[0][:1], True),  # the start of an eyecatcher: may be one
        (EYES[1][:3], True),
        (b"GET / HTTP/1.1\r\n", False),
        (b"\xe2\x82\xac", False),  # a euro sign in UTF-8 starts like one, then differs
        (b"", False),
    ],
)
@pytest.mark.parametrize("timeout", [None, 0.0, 5.0])
def test_clc_at_head_peeks(data: bytes, clc: bool, timeout: float | None) -> None:
    a, b = tcp_pair()
    with a, b:
        a.settimeout(timeout)
        if data:
            b.sendall(data)
            settle()
        t0 = time.monotonic()
        assert h.clc_at_head(a) is clc
        assert time.monotonic() - t0 < 1.0  # never waits for data
        assert a.gettimeout() == timeout
        if data:
            assert a.recv(100) == data  # peeked, not consumed


def test_reset_reaches_the_peer_while_another_descriptor_is_open() -> None:
    a, b = tcp_pair()
    with a, b:
        copy = os.dup(a.fileno())  # what a frozen daemon still holds
        b.sendall(b"unread")
        settle()
        h.reset(a)
        b.settimeout(5)
        with pytest.raises(ConnectionResetError):
            b.recv(10)
        for _ in range(2):  # the daemon's late writes go nowhere
            with pytest.raises((ConnectionResetError, BrokenPipeError)):
                os.write(copy, EYES[1])
        try:
            left = os.read(copy, 10)
        except OSError:
            left = b""
        assert left == b""  # and what was queued is dropped
        os.close(copy)


def test_daemon_exited() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert not h.daemon_exited(child.pid, 0.05)
        child.kill()
        assert h.daemon_exited(child.pid)  # a zombie has exited: its descriptors are closed
        child.wait()
        assert h.daemon_exited(child.pid)  # reaped
    finally:
        child.kill()
        child.wait()
    assert not h.daemon_exited(0)  # a daemon in another pid namespace: cannot know


def test_fallback_after_decline_flag_round_trips() -> None:
    for flag in (False, True):
        fb = m.Fallback(0x030D0000, "MAX_DMB", "quota", None, flag)
        assert m.decode(m.encode(fb)) == fb
        fb = m.Fallback(0x03030000, "PEERDECL", "declined", 0x030D0000, flag)
        assert m.decode(m.encode(fb)) == fb
    assert m.encode(m.Fallback(1, "X", "y", None, True))[16] == 2  # flags byte, bit 1
