"""The handoff mark a same-host server half reads through ``sock_diag`` (real kernel sockets)."""

from __future__ import annotations

import os
import random
import socket
import struct
import subprocess
import sys
from collections.abc import Iterator

import pytest

from smc_handoff import peer_option
from smcd_daemon.adapters.handoff_mark import (
    INET_DIAG_SOCKOPT,
    SOCK_DIAG_BY_FAMILY,
    HandoffMarks,
    decode_mark,
    encode_request,
)


@pytest.fixture
def marks() -> Iterator[HandoffMarks]:
    m = HandoffMarks()
    yield m
    m.close()


def _pair(host: str, *, marked: bool, family: int = socket.AF_INET) -> tuple[socket.socket, ...]:
    lsock = socket.socket(family)
    lsock.bind((host, 0))
    lsock.listen()
    client = socket.socket(family)
    if marked:
        client.setsockopt(*peer_option.HANDOFF_MARK, 1)
    client.connect(lsock.getsockname()[:2])
    server, _ = lsock.accept()
    lsock.close()
    return client, server


@pytest.mark.parametrize("marked", [True, False])
@pytest.mark.parametrize("host,family", [("127.0.0.1", socket.AF_INET), ("::1", socket.AF_INET6)])
def test_the_server_half_reads_its_clients_mark(
    marks: HandoffMarks, marked: bool, host: str, family: int
) -> None:
    client, server = _pair(host, marked=marked, family=family)
    with client, server:
        peer, local = server.getpeername()[:2], server.getsockname()[:2]
        assert marks.client_marked(server, peer, local) is marked
        # the question is about the client's end: the server's own socket is never marked
        assert marks.client_marked(server, local, peer) is False


def test_a_mark_set_after_connect_is_seen(marks: HandoffMarks) -> None:
    """``smc_handoff.wrap`` of a socket connected elsewhere marks it just before its CONNECT."""
    client, server = _pair("127.0.0.1", marked=False)
    with client, server:
        peer, local = server.getpeername(), server.getsockname()
        assert marks.client_marked(server, peer, local) is False
        client.setsockopt(*peer_option.HANDOFF_MARK, 1)
        assert marks.client_marked(server, peer, local) is True


def test_no_such_socket_says_nothing(marks: HandoffMarks) -> None:
    client, server = _pair("127.0.0.1", marked=False)
    with client, server:
        local = server.getsockname()
        gone = ("127.0.0.1", 9)  # nobody's port 9 talks to our server
        assert marks.client_marked(server, gone, local) is None


def test_request_option_without_a_detector_marks_the_socket() -> None:
    """smc-run's ``connect()``: when no BPF detector takes SOL_SMCD (none runs unless a peer
    detection test loaded one), the socket gets the handoff mark instead, before the SYN."""
    sock = socket.socket()
    with sock:
        took = peer_option.request_option(sock)
        assert took or sock.getsockopt(*peer_option.HANDOFF_MARK) == 1


def _reply(attrs: bytes, kind: int = SOCK_DIAG_BY_FAMILY) -> bytes:
    body = bytes(72) + attrs
    return struct.pack("=IHHII", 16 + len(body), kind, 0, 1, 0) + body


def _attr(atype: int, value: bytes) -> bytes:
    raw = struct.pack("=HH", 4 + len(value), atype) + value
    return raw + bytes(-len(raw) % 4)


def test_decode_finds_the_bit_among_other_attributes() -> None:
    other = _attr(8, b"\x00") + _attr(21, bytes(8))
    assert decode_mark(_reply(other + _attr(INET_DIAG_SOCKOPT, b"\x52\x01"))) is True
    assert decode_mark(_reply(other + _attr(INET_DIAG_SOCKOPT, b"\x52\x00"))) is False
    assert decode_mark(_reply(other)) is None  # a kernel before 5.10: no answer, no verdict


def test_decode_rejects_what_is_not_an_answer() -> None:
    error = struct.pack("=IHHII", 36, 2, 0, 1, 0) + struct.pack("=i", -2) + bytes(16)
    assert decode_mark(error) is None
    assert decode_mark(b"") is None
    assert decode_mark(_reply(_attr(INET_DIAG_SOCKOPT, b"\x01"))) is None  # too short
    bad_len = _reply(struct.pack("=HH", 2, INET_DIAG_SOCKOPT))
    assert decode_mark(bad_len) is None
    overrun = _reply(struct.pack("=HH", 200, INET_DIAG_SOCKOPT) + b"\x00\x01")
    assert decode_mark(overrun) is None


def test_decode_never_raises_on_noise() -> None:
    rng = random.Random(7)
    good = _reply(_attr(8, b"\x00") + _attr(INET_DIAG_SOCKOPT, b"\x52\x01"))
    for _ in range(3000):
        data = bytearray(good[: rng.randrange(len(good) + 1)])
        for _ in range(rng.randrange(4)):
            if data:
                data[rng.randrange(len(data))] = rng.randrange(256)
        assert decode_mark(bytes(data)) in (True, False, None)


def test_encode_asks_for_one_socket_by_its_four_tuple() -> None:
    req = encode_request(("192.0.2.1", 40000), ("192.0.2.2", 25), seq=9)
    length, kind, flags, seq, _ = struct.unpack_from("=IHHII", req)
    assert (length, kind, flags, seq) == (len(req), SOCK_DIAG_BY_FAMILY, 1, 9)  # no dump flag
    family, proto = req[16], req[17]
    assert (family, proto) == (socket.AF_INET, socket.IPPROTO_TCP)
    assert struct.unpack_from("!HH", req, 24) == (40000, 25)
    assert req[28:32] == socket.inet_aton("192.0.2.1") and req[44:48] == socket.inet_aton(
        "192.0.2.2"
    )
    v6 = encode_request(("2001:db8::1", 1), ("2001:db8::2", 2))
    assert v6[16] == socket.AF_INET6 and v6[28:44] == socket.inet_pton(
        socket.AF_INET6, "2001:db8::1"
    )


FIRST_WRAP = r"""
import importlib.abc, socket, sys
import smc_handoff
lsock = socket.create_server(("127.0.0.1", 0))
sock = socket.create_connection(lsock.getsockname())
seen = []
class Spy(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "smc_handoff.socket":
            seen.append(sock.getsockopt(socket.IPPROTO_IP, 24))
        return None
sys.meta_path.insert(0, Spy())
assert "smc_handoff.socket" not in sys.modules
smc = smc_handoff.wrap(sock)  # no daemon: TCP, with its reason
print(seen, smc.mode, flush=True)
"""


def test_the_first_wrap_marks_the_socket_before_the_library_loads() -> None:
    """A program's first ``smc_handoff.wrap`` loads the library (~15 ms): the socket carries
    the handoff mark before that, or a same-host server half that came first would find it
    unmarked after its 20 ms grace and take a client of ours for a plain one (the classic
    bench's ``wrap`` fell back so under CI load)."""
    env = {**os.environ, "SMCD_HANDOFF_SOCKET": "/nonexistent/handoff.sock"}
    done = subprocess.run([sys.executable, "-c", FIRST_WRAP], env=env, capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout == "[1] tcp\n", done.stdout
