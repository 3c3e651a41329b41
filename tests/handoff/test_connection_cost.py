"""What a connection's handoff costs the library, and that the cheaper ways keep their rules
(#10): the handoff connection is non-blocking and waits for its reply itself (a full listen
queue still waits in the kernel, a silent daemon still times out); the handoff mark set before
``connect()`` is not set again; the stream mark reads the kernel four times when nothing moves,
and still sees what moved; a channel's peer link never waits, even under a default timeout."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from smc_handoff import handoff as h
from smc_handoff import messages as m
from smc_handoff import peer_option
from smc_handoff.channel import Channel
from smc_handoff.channel_base import make_pair


@pytest.fixture
def daemon_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "handoff.sock"
    monkeypatch.setenv("SMCD_HANDOFF_SOCKET", os.fspath(path))
    return path


@pytest.fixture
def listener(daemon_path: Path) -> Iterator[socket.socket]:
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    srv.bind(os.fspath(daemon_path))
    srv.listen(0)
    yield srv
    srv.close()


def test_the_handoff_connection_is_non_blocking_and_its_peer_checked(
    listener: socket.socket,
) -> None:
    ctl, pid = h.connect_daemon()
    with ctl:
        assert ctl.gettimeout() == 0.0
        assert pid == os.getpid()
        conn, _ = listener.accept()
        with conn:
            m.send_message(conn, m.Ok(7))
            reply, fds = h.recv_reply(ctl, 5.0)
            assert reply == m.Ok(7) and fds == []


def test_a_silent_daemon_times_out_as_a_socket_timeout_says(listener: socket.socket) -> None:
    ctl, _pid = h.connect_daemon()
    with ctl:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            h.recv_reply(ctl, 0.2)
        assert 0.15 < time.monotonic() - t0 < 2.0


def test_a_hang_up_is_read_as_before(listener: socket.socket) -> None:
    ctl, _pid = h.connect_daemon()
    with ctl:
        conn, _ = listener.accept()
        conn.close()
        with pytest.raises(m.HandoffClosedError):
            h.recv_reply(ctl, 5.0)


def _fill(path: Path) -> list[socket.socket]:
    """Connections that fill a listen queue nobody accepts from."""
    held = []
    while True:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_NONBLOCK)
        try:
            s.connect(os.fspath(path))
        except BlockingIOError:
            s.close()
            return held
        held.append(s)


def test_a_full_listen_queue_is_still_waited_for(
    listener: socket.socket, daemon_path: Path
) -> None:
    held = _fill(daemon_path)
    try:
        t0 = time.monotonic()
        with pytest.raises(h.NoDaemon, match="Resource temporarily unavailable"):
            h.connect_daemon(0.3)
        assert time.monotonic() - t0 >= 0.25  # waited in the kernel, not failed at once

        # a slot freed within the wait is taken
        def free() -> None:
            time.sleep(0.1)
            listener.accept()[0].close()

        thread = threading.Thread(target=free)
        thread.start()
        ctl, _pid = h.connect_daemon(2.0)
        thread.join()
        with ctl:
            assert ctl.gettimeout() == 0.0  # non-blocking, as the quick way makes it
    finally:
        for s in held:
            s.close()


def test_the_mark_set_before_connect_is_not_set_again(
    listener: socket.socket, monkeypatch: pytest.MonkeyPatch
) -> None:
    sock = socket.socket()
    with sock:
        marked = peer_option.request_or_mark(sock)
        took = peer_option.request_option(sock)
        # without a detector the mark is on the socket; with one the request was taken
        assert marked != took
        if marked:
            assert sock.getsockopt(*peer_option.HANDOFF_MARK) == 1
    calls: list[Any] = []
    real = socket.socket.setsockopt

    class Spy(socket.socket):
        def setsockopt(self, *args: Any) -> None:
            calls.append(args)
            real(self, *args)

    monkeypatch.setattr(h, "_BaseSocket", Spy)
    with socket.create_server(("127.0.0.1", 0)) as srv:
        client = socket.create_connection(srv.getsockname())
        with client:
            for marked in (True, False):
                calls.clear()
                sent = h.offer(client, m.Connect(), marked=marked)
                assert isinstance(sent, h.Offer)
                sent.ctl.close()
                listener.accept()[0].close()
                assert calls == ([] if marked else [(*peer_option.HANDOFF_MARK, 1)])


def test_the_stream_mark_reads_four_times_when_nothing_moves(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with socket.create_server(("127.0.0.1", 0)) as srv:
        a = socket.create_connection(srv.getsockname())
        b, _ = srv.accept()
        with a, b:
            a.sendall(b"x" * 100)
            b.recv(10)
            time.sleep(0.05)
            counted: list[str] = []
            real_ioctl = h._ioctl

            def ioctl(*args: Any) -> Any:
                counted.append("ioctl")
                return real_ioctl(*args)

            class Counting(socket.socket):
                def getsockopt(self, *args: Any) -> Any:
                    counted.append("getsockopt")
                    return super().getsockopt(*args)

            monkeypatch.setattr(h, "_ioctl", ioctl)
            spy = Counting(fileno=os.dup(b.fileno()))
            with spy:
                mark = h.StreamMark.take(spy)
            assert counted == ["getsockopt", "ioctl", "ioctl", "getsockopt"]
            assert (mark.written, mark.consumed) == (0, 10)


def test_a_channel_link_never_waits_under_a_default_timeout() -> None:
    """The link's sends and receives say MSG_DONTWAIT, so its descriptor's mode is left as it
    came, but a socket with a timeout would make CPython wait for readiness first."""
    old = socket.getdefaulttimeout()
    socket.setdefaulttimeout(5.0)
    try:
        end_a, end_b = make_pair(16384, 16384)
        a, b = Channel.from_fds(end_a), Channel.from_fds(end_b)
    finally:
        socket.setdefaulttimeout(old)
    with a, b:
        t0 = time.monotonic()
        b.drain_kicks()  # nothing queued: at once, not after the timeout
        got: list[bool] = []
        reader = threading.Thread(target=lambda: got.append(b.wait_readable(3.0)))
        reader.start()
        time.sleep(0.1)  # asleep on the link: the send kicks it there
        assert a.send_into(b"hi") == 2
        reader.join()
        assert got == [True]
        buf = bytearray(2)
        assert b.recv_into(buf) == 2 and buf == b"hi"
        b.drain_kicks()
        assert time.monotonic() - t0 < 2.0


def test_a_channel_link_is_left_in_its_mode() -> None:
    end_a, end_b = make_pair(16384, 16384)
    a, b = Channel.from_fds(end_a), Channel.from_fds(end_b)
    with a, b:
        link = a.kick_fd()
        assert os.get_blocking(link)  # (make_pair's socketpair is blocking)
        a.send_into(b"x")
        buf = bytearray(1)
        assert b.recv_into(buf) == 1
