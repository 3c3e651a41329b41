"""A daemon that dies while it reads a connection's sequence numbers (TCP repair mode, #15's
pairing by proof) must not leave the application a socket that silently sends nothing (#14):
the library takes it out of repair mode when it may, and otherwise resets the connection."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Callable

import pytest

import smc_handoff
from smc_handoff import handoff as h
from smc_handoff import messages as m
from tests.e2e.test_stream_integrity import (  # noqa: F401 (liar is a fixture)
    FakeDaemon,
    fallback,
    liar,
    settle,
    tcp_pair,
)

TCP_REPAIR, TCP_REPAIR_ON = 19, 1


def _dies_in_repair(conn: socket.socket, tcp: socket.socket) -> None:
    tcp.setsockopt(socket.IPPROTO_TCP, TCP_REPAIR, TCP_REPAIR_ON)
    # "nothing happened": true of the stream's bytes, not of the socket's mode
    m.send_message(conn, fallback())


@pytest.mark.parametrize("server_side", [False, True])
def test_a_socket_left_in_repair_mode_is_taken_out_and_the_stream_is_intact(
    liar: Callable[..., FakeDaemon],  # noqa: F811 (the fixture imported above)
    server_side: bool,
) -> None:
    ours, peer = tcp_pair() if not server_side else tcp_pair()[::-1]
    d = liar(_dies_in_repair)
    sock = smc_handoff.wrap(ours, server_side=server_side)
    d.join()
    assert sock.mode == "tcp"
    assert not h.in_repair(sock)  # the library, as root, took it out
    sock.sendall(b"after")  # and what it sends leaves
    settle()
    peer.settimeout(5)
    assert peer.recv(16) == b"after"
    peer.sendall(b"back")
    sock.settimeout(5)
    assert sock.recv(16) == b"back"
    sock.close()
    peer.close()


UNPRIVILEGED = r"""
import os, socket, sys
sys.path.insert(0, sys.argv[1])
from smc_handoff import handoff as h
from smc_handoff import messages as m
sock = socket.socket(fileno=int(sys.argv[2]))
os.setgid(65534)
os.setuid(65534)
print(h.in_repair(sock), h.leave_repair(sock), h.in_repair(sock))
"""


def test_without_the_privilege_repair_mode_is_reported_not_hidden() -> None:
    """An application without CAP_NET_ADMIN cannot leave repair mode: leave_repair says so (and
    the library then resets instead of handing out a mute socket)."""
    ours, peer = tcp_pair()
    ours.setsockopt(socket.IPPROTO_TCP, TCP_REPAIR, TCP_REPAIR_ON)
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run(
        [sys.executable, "-c", UNPRIVILEGED, repo, str(ours.fileno())],
        pass_fds=[ours.fileno()],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout.split()
    assert out == ["True", "False", "True"]
    ours.close()
    peer.close()
