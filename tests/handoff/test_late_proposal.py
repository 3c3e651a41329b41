"""A server half that stayed on TCP (no daemon, or the daemon refused it) while the client's
daemon proposed anyway (a configured peer; the SMC-R chaos test's finding, #14): the Proposal
arrives after the handoff, and the application's first read must not return it. The library
reads it and answers with a Decline, as a kernel server without SMC does; the client then sees a
clean fallback and both applications exchange only their own bytes."""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path

import pytest

import smc_handoff
from smc_handoff import handoff as h
from smcd_daemon.wire.clc import Decline, Proposal, SmcType, V2Extension, decode
from smcd_daemon.wire.reasons import DeclineReason


def _proposal() -> bytes:
    return Proposal(
        typev1=SmcType.N, typev2=SmcType.R, version=2, peer_id=bytes(8), gid=bytes(16),
        mac=bytes(6), v2_ext=V2Extension(eids=("SMC-EID-TEST",), release=1, roce_gid=bytes(16)),
    ).encode()  # fmt: skip


@pytest.fixture
def no_daemon(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SMCD_HANDOFF_SOCKET", os.fspath(tmp_path / "absent.sock"))


def _pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname())
        server, _ = listener.accept()
    return client, server


@pytest.mark.usefixtures("no_daemon")
@pytest.mark.parametrize("timeout", [None, 5.0])
def test_a_late_proposal_is_declined_and_never_read_as_data(timeout: float | None) -> None:
    client, tcp = _pair()
    tcp.settimeout(timeout)
    server = smc_handoff.wrap(tcp, server_side=True)
    assert server.mode == "tcp"
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(server.recv(100)))
    reader.start()  # the application is already waiting when the Proposal comes
    proposal = _proposal()
    client.sendall(proposal[:3])  # the head in pieces: the library waits for all of it
    client.sendall(proposal[3:])
    client.settimeout(5)
    answer = client.recv(100)
    msg = decode(answer)
    assert isinstance(msg, Decline) and msg.diagnosis == DeclineReason.NOSMCDEV
    assert msg.version == 2
    client.sendall(b"the client's own bytes")
    reader.join(5)
    assert got == [b"the client's own bytes"]
    server.sendall(b"and the server's")
    assert client.recv(100) == b"and the server's"
    client.close()
    server.close()


@pytest.mark.usefixtures("no_daemon")
def test_ordinary_first_bytes_pass_and_are_checked_once() -> None:
    client, tcp = _pair()
    server = smc_handoff.wrap(tcp, server_side=True)
    client.sendall(b"GET / HTTP/1.1\r\n")
    assert server.recv(4) == b"GET "
    client.sendall(b"\xe2\xd4\xc3\xd9 later bytes are data, whatever they look like")
    buf = bytearray(200)
    n = 0
    while n < 12 + 49:
        n += server.recv_into(memoryview(buf)[n:])
    assert bytes(buf[:n]).startswith(b"/ HTTP/1.1\r\n\xe2\xd4\xc3\xd9")
    client.close()
    server.close()


@pytest.mark.usefixtures("no_daemon")
def test_a_non_blocking_first_read_with_nothing_there_is_eagain_and_still_guarded() -> None:
    client, tcp = _pair()
    server = smc_handoff.wrap(tcp, server_side=True)
    server.setblocking(False)
    with pytest.raises(BlockingIOError):
        server.recv(10)
    client.sendall(_proposal())
    client.settimeout(5)
    server.setblocking(True)
    server.settimeout(5)
    reader = threading.Thread(target=server.recv, args=(10,))
    reader.start()
    assert isinstance(decode(client.recv(100)), Decline)
    client.sendall(b"x")
    reader.join(5)
    client.close()
    server.close()


@pytest.mark.usefixtures("no_daemon")
@pytest.mark.parametrize("read", ["recv", "recv_into", "recvfrom", "recvmsg"])
def test_a_proposal_arriving_just_after_the_look_is_not_read_as_data(
    read: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The race behind a 1-in-40 CI failure: a non-blocking first read looked, found nothing,
    and the Proposal's head arrived before the read itself, which then handed it to the
    application. The window is held open here by sending the head inside it (the real look,
    the real sockets); the read must say EAGAIN and leave the bytes for the next look."""
    import _socket

    import smc_handoff.socket as smc_socket

    client, tcp = _pair()
    server = smc_handoff.wrap(tcp, server_side=True)
    server.setblocking(False)
    real = smc_socket.answer_late_proposal
    proposal = _proposal()

    def look_then_the_head_arrives(sock: socket.socket, flags: int = 0) -> bool:
        decided = real(sock, flags)
        if not decided:
            client.sendall(proposal)
            deadline = time.monotonic() + 5
            peek = socket.MSG_PEEK | socket.MSG_DONTWAIT
            while len(_socket.socket.recv(sock, len(proposal), peek)) < len(proposal):
                assert time.monotonic() < deadline, "the Proposal never arrived"
                time.sleep(0.001)
        return decided

    monkeypatch.setattr(smc_socket, "answer_late_proposal", look_then_the_head_arrives)
    reads = {
        "recv": lambda: server.recv(100),
        "recv_into": lambda: server.recv_into(bytearray(100)),
        "recvfrom": lambda: server.recvfrom(100),
        "recvmsg": lambda: server.recvmsg(100),
    }
    with pytest.raises(BlockingIOError):
        reads[read]()
    monkeypatch.setattr(smc_socket, "answer_late_proposal", real)
    client.settimeout(5)
    with pytest.raises(BlockingIOError):
        server.recv(100)  # the next look answers the whole Proposal; no data yet
    assert isinstance(decode(client.recv(100)), Decline)
    client.sendall(b"data")
    server.settimeout(5)
    assert server.recv(100) == b"data"
    client.close()
    server.close()


@pytest.mark.usefixtures("no_daemon")
def test_a_cut_off_clc_header_resets_instead_of_reaching_the_application(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(h, "_LATE_CLC_WAIT", 0.3)
    client, tcp = _pair()
    server = smc_handoff.wrap(tcp, server_side=True)
    client.sendall(b"\xe2\xd4\xc3")  # and nothing more
    server.settimeout(5)
    with pytest.raises(ConnectionResetError):
        server.recv(10)
    client.settimeout(5)
    with pytest.raises(ConnectionResetError):
        client.recv(10)
    client.close()
    server.close()
