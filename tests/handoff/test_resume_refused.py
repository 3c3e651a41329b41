"""A channel whose RESUME a new daemon refuses (it cannot verify it, #14) stops asking: one
RESUME, one refusal, then silence — not a RESUME every second for the life of the channel."""

from __future__ import annotations

import select
import socket
import threading
import time
from pathlib import Path

import pytest

from smc_handoff import messages as m
from smc_handoff.channel import Channel, make_pair
from smc_handoff.handoff import ChannelState


def _refusing_daemon(
    path: Path, resumes: list[m.Message], stop: threading.Event
) -> tuple[socket.socket, threading.Thread]:
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    srv.bind(str(path))
    srv.listen(8)
    srv.settimeout(0.1)

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except TimeoutError:
                continue
            msg, fds = m.recv_message(conn, requests=True)
            m.close_fds(fds)
            resumes.append(msg)
            m.send_message(conn, m.Error(m.ErrorCode.DENIED, "no such channel"))
            conn.close()  # as smcd does after refusing

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return srv, thread


def test_a_refused_resume_is_not_sent_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "handoff.sock"
    monkeypatch.setenv("SMCD_HANDOFF_SOCKET", str(path))
    resumes: list[m.Message] = []
    stop = threading.Event()
    srv, thread = _refusing_daemon(path, resumes, stop)
    a, b = make_pair(16384, 16384)
    chan = Channel.from_fds(a)
    tcp_a, tcp_b = socket.socketpair()
    try:
        info = m.Channel(5, m.Mode.SMCD, 16384, 16384)
        state = ChannelState(chan, None, info, m.Role.CLIENT, conn_id=5)
        state.check_daemon(tcp_a.fileno())  # no control connection: RESUME to the "new" daemon
        until = time.monotonic() + 5
        while not resumes and time.monotonic() < until:
            time.sleep(0.01)
        assert state.control is not None
        select.select([state.control], [], [], 5)  # the refusal has arrived
        for _ in range(3):
            state.next_check = 0.0  # as if a second had passed each time
            state.check_daemon(tcp_a.fileno())
        time.sleep(0.2)
        assert len(resumes) == 1 and isinstance(resumes[0], m.Resume)
        assert resumes[0].conn_id == 5
        assert state.control is None
    finally:
        stop.set()
        thread.join(5)
        srv.close()
        chan.close()
        b.close()
        tcp_a.close()
        tcp_b.close()
