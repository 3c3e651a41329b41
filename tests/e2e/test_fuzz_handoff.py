"""A fuzzed handoff socket: thousands of random and malformed datagrams, wrong and surplus
descriptors, truncated and oversized messages. smcd answers ERROR (or hangs up), leaks no
descriptor, stays up, and the next real handoff still works."""

from __future__ import annotations

import array
import os
import random
import socket
from collections.abc import Callable
from typing import Any

import pytest

from smc_handoff import messages as m
from tests.e2e.conftest import Smcd, pair

pytestmark = pytest.mark.timeout(120)

ROUNDS = 3000


def _exchange(path: str, data: bytes, fds: list[int]) -> m.Message | None:
    """One datagram on a fresh connection; the decoded reply, or None if the daemon hung up."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.settimeout(10)
        s.connect(path)
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())]
        s.sendmsg([data], anc if fds else [])
        reply = s.recv(m.MAX_MESSAGE + 1)
    return m.decode_reply(reply) if reply else None


def _datagram(rng: random.Random) -> bytes:
    kind = rng.randrange(6)
    if kind == 0:  # pure noise
        return rng.randbytes(rng.randrange(0, 300))
    mtype = rng.choice([*m.MessageType, rng.randrange(256)])
    body = rng.randbytes(rng.choice([0, 1, 4, 8, 17, 20, rng.randrange(200)]))
    length = len(body) if kind != 1 else rng.randrange(1 << 32)  # 1: lying length field
    version = m.VERSION if kind != 2 else rng.randrange(256)  # 2: any version
    flags = 0 if kind != 3 else rng.randrange(1, 1 << 16)  # 3: reserved flags
    data = m.HEADER.pack(m.MAGIC, version, int(mtype), flags, length) + body
    if kind == 4:  # truncated
        data = data[: rng.randrange(len(data) + 1)]
    if kind == 5 and rng.random() < 0.3:  # oversized
        data = data + rng.randbytes(m.MAX_MESSAGE + 1 - len(data) + rng.randrange(100))
    return data


def test_fuzzed_handoff_socket(smcd: Smcd, apps: Any) -> None:
    assert smcd.proc is not None
    pid = smcd.proc.proc.pid
    path = os.fspath(smcd.handoff)
    rng = random.Random(20240414)
    fd_count = len(os.listdir(f"/proc/{pid}/fd"))

    # Descriptors of every wrong kind.
    r, w = os.pipe()
    devnull = os.open(os.devnull, os.O_RDONLY)
    efd = os.eventfd(0)
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    listening = socket.create_server(("127.0.0.1", 0))
    unconnected = socket.socket()
    wrong = [r, w, devnull, efd, udp.fileno(), listening.fileno(), unconnected.fileno()]
    errors = hangups = accepted = 0
    try:
        for i in range(ROUNDS):
            fds = rng.sample(wrong, rng.choice([0, 0, 1, 1, 2, 3])) if i % 3 else []
            reply = _exchange(path, _datagram(rng), fds)
            if reply is None:
                hangups += 1
            elif isinstance(reply, m.Ok):  # a valid LISTEN that drew the listening socket
                accepted += 1
            else:
                assert isinstance(reply, m.Error), reply
                errors += 1
        # Well-formed requests with the wrong descriptors: refused with BAD_FDS, never a crash.
        bad_requests: list[tuple[m.Request, Callable[[], list[int]]]] = [
            (m.Connect(), lambda: [r]),
            (m.Connect(), lambda: [udp.fileno()]),
            (m.Connect(), lambda: [listening.fileno()]),
            (m.Connect(), lambda: [unconnected.fileno()]),
            (m.Accept(), lambda: [efd]),
            (m.Listen(), lambda: [unconnected.fileno()]),
            (m.Listen(), lambda: [devnull]),
            (m.Resume(1, m.Role.CLIENT, m.Mode.SMCD, 16384, 16384), lambda: [r, w, efd]),
        ]
        for request, fds_of in bad_requests:
            reply = _exchange(path, m.encode(request), fds_of())
            assert isinstance(reply, m.Error) and reply.code is m.ErrorCode.BAD_FDS, reply
        # Too many descriptors (ancillary data truncated), and a request with none.
        reply = _exchange(path, m.encode(m.Connect()), [devnull] * 12)
        assert isinstance(reply, m.Error) and reply.code is m.ErrorCode.BAD_FDS
        reply = _exchange(path, m.encode(m.Connect()), [])
        assert isinstance(reply, m.Error) and reply.code is m.ErrorCode.BAD_FDS
        # A notice cannot open a connection.
        reply = _exchange(path, m.encode(m.Close(False, 1, 2)), [])
        assert isinstance(reply, m.Error) and reply.code is m.ErrorCode.BAD_STATE
    finally:
        for fd in (r, w, devnull, efd):
            os.close(fd)
        for s in (udp, listening, unconnected):
            s.close()
    assert errors > ROUNDS // 2 and errors + hangups + accepted == ROUNDS
    assert smcd.alive(), smcd.log()
    assert len(os.listdir(f"/proc/{pid}/fd")) <= fd_count + 2, "descriptors leaked"
    # The next real handoff works.
    server, client, _ = pair(apps)
    server.send("recv_all")
    sent = client.call("send", n=65_537, seed=1, chunk=4093)
    client.call("close")
    got = server.reply()
    assert (got["n"], got["sha"]) == (sent["sent"], sent["sha"])
    assert smcd.smcctl("info").returncode == 0
