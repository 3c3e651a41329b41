"""A refused server half whose client is in the configuration's ``peers`` (#14): the client's
daemon proposes whether or not peer detection runs, so the refusal (the gate's cap, admission's
handshake cap) must read that Proposal off the stream and decline it with the refusal's code,
never hand the application a stream whose first bytes are CLC.

Two network namespaces joined by a veth pair: smcd and an echo-less server application
(``smc_handoff``) in B, with ``peers`` naming A's network and no peer detection; the client in
A is this test, speaking as A's daemon would: a CLC Proposal after the TCP handshake (late, so
that B's handoff is already under way), then, once declined, the application's own bytes. The
Decline must carry the daemon's code (MAX_DMB, with the limit in the server's explanation), not
the library's NOSMCDEV (``answer_late_proposal``, which only backs up a daemon that did not
wait), and the server application must read exactly the client's bytes.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from smcd_daemon.wire.clc import Decline, Proposal, SmcType, V2Extension, decode
from smcd_daemon.wire.reasons import DeclineReason
from tests.bpf.conftest import ADDR_B, Net, two_hosts
from tests.control.daemon_proc import SMCD, NotifySocket, SmcdProcess

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[2]
PYTHON = REPO / ".venv" / "bin" / "python"
PROPOSAL_WAIT = 4.0
DATA = b"only the client's own bytes\x00\xe2\xd4\xc3\xd9 (CLC-looking bytes later are data)"

SERVER_APP = r"""
import json, sys, threading, smc_handoff
srv = smc_handoff.listen((sys.argv[1], 0))
print("PORT", srv.getsockname()[1], flush=True)
want = int(sys.argv[2])

def one():
    c, _ = srv.accept()
    c.settimeout(30)
    fb = c.fallback
    data = b""
    while chunk := c.recv(65536):
        data += chunk
    print("CONN " + json.dumps({
        "mode": c.mode, "port": c.getpeername()[1], "data": data.hex(),
        "name": fb.name if fb else None, "why": fb.explanation if fb else None,
    }), flush=True)
    c.close()

threads = [threading.Thread(target=one) for _ in range(want)]
for t in threads:
    t.start()
for t in threads:
    t.join(60)
"""


def _proposal() -> bytes:
    """A v2 SMC-R Proposal as a peer's smcd sends one (its contents do not matter here)."""
    return Proposal(
        typev1=SmcType.N, typev2=SmcType.R, version=2, peer_id=bytes(8), gid=bytes(16),
        mac=bytes(6), v2_ext=V2Extension(eids=("SMCD-PEERS-TEST",), release=1, roce_gid=bytes(16)),
    ).encode()  # fmt: skip


@pytest.fixture
def net() -> Iterator[Net]:
    work = Path(f"/tmp/smcd-peers-{os.getpid()}")
    work.mkdir(exist_ok=True)
    with two_hosts(f"smcpr{os.getpid()}", work) as n:
        yield n


class HostB:
    def __init__(self, net: Net, limits: str) -> None:
        self.net, self.run = net, net.work / "b"
        self.run.mkdir()
        (self.run / "smcd.toml").write_text(
            'peers = ["198.51.100.0/24"]\npeer_detection = false\n'
            f'[limits]\n{limits}\n[eid]\nueids = ["SMCD-PEERS-TEST"]\n'
            f"[timeouts]\nproposal_wait = {PROPOSAL_WAIT}\n"
        )
        argv = [
            "ip", "netns", "exec", net.ns_b, os.fspath(SMCD), "--config",
            os.fspath(self.run / "smcd.toml"), "--runtime-dir", os.fspath(self.run),
            "--state-dir", os.fspath(self.run / "state"), "--handoff-socket",
            os.fspath(self.run / "handoff.sock"), "--bus", "private", "--log-level", "debug",
        ]  # fmt: skip
        self.proc = SmcdProcess(argv, net.work / "b.log", NotifySocket(net.work / "b.ntf"))
        self.proc.start()
        self.proc.wait_ready()
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SMCD_", "SMC_RUN"))}
        self.env = env | {"SMCD_HANDOFF_SOCKET": os.fspath(self.run / "handoff.sock"),
                          "PYTHONPATH": os.fspath(REPO)}  # fmt: skip

    def server_app(self, conns: int) -> tuple[subprocess.Popen[str], int]:
        argv = ["ip", "netns", "exec", self.net.ns_b, os.fspath(PYTHON), "-c", SERVER_APP,
                ADDR_B, str(conns)]  # fmt: skip
        app = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=self.env)  # fmt: skip
        assert app.stdout is not None
        first = app.stdout.readline()
        assert first.startswith("PORT "), (first, app.communicate(timeout=10))
        return app, int(first.split()[1])


@pytest.fixture
def gate_capped(net: Net) -> Iterator[HostB]:
    """B: one handoff connection per user, which the application's LISTEN fills."""
    b = HostB(net, "connections_per_user = 1")
    yield b
    b.proc.stop()


@pytest.fixture
def handshake_capped(net: Net) -> Iterator[HostB]:
    """B: one handshake in flight per user."""
    b = HostB(net, "handshakes_per_user = 1")
    yield b
    b.proc.stop()


def _connect(net: Net, port: int) -> socket.socket:
    s = net.socket(net.ns_a)
    s.settimeout(20)
    s.connect((ADDR_B, port))
    return s


def _propose_then_send(s: socket.socket) -> Decline:
    """Speak as A's daemon: the Proposal a little late, then read the answer, then (declined:
    the stream is the application's again) the application's bytes, and close."""
    time.sleep(0.5)  # B's application has accepted and handed the socket to its daemon
    s.sendall(_proposal())
    answer = s.recv(200)
    msg = decode(answer)
    assert isinstance(msg, Decline), answer.hex()
    assert len(answer) == len(msg.encode()), "bytes after the Decline"
    s.sendall(DATA)
    s.shutdown(socket.SHUT_WR)
    assert s.recv(100) == b""  # the server application closes after EOF: nothing else for us
    s.close()
    return msg


def _reports(app: subprocess.Popen[str]) -> dict[int, dict[str, Any]]:
    out, err = app.communicate(timeout=60)
    assert app.returncode == 0, err
    rows = [json.loads(ln[5:]) for ln in out.splitlines() if ln.startswith("CONN ")]
    return {r["port"]: r for r in rows}


def test_refused_at_the_gate_declines_a_configured_peers_proposal(
    gate_capped: HostB, net: Net
) -> None:
    b = gate_capped
    app, port = b.server_app(1)
    try:
        s = _connect(net, port)
        mine = s.getsockname()[1]
        decline = _propose_then_send(s)
        got = _reports(app)[mine]
    finally:
        if app.poll() is None:
            app.kill()
    assert decline.diagnosis == DeclineReason.MAX_DMB, (hex(decline.diagnosis), b.proc.log())
    assert bytes.fromhex(got["data"]) == DATA, got
    assert got["mode"] == "tcp" and got["name"] == "SMC_CLC_DECL_MAX_DMB", got
    assert "limits.connections_per_user" in got["why"], got
    assert "declined the Proposal" in got["why"], got


def test_refused_by_admission_declines_a_configured_peers_proposal(
    handshake_capped: HostB, net: Net
) -> None:
    """The first connection stays silent, so its handshake holds the one slot for
    ``proposal_wait``; the second is refused by admission while its Proposal is on the way."""
    b = handshake_capped
    app, port = b.server_app(2)
    holder: socket.socket | None = None
    try:
        holder = _connect(net, port)
        time.sleep(0.8)  # accepted and handed to the daemon, which waits for its Proposal
        s = _connect(net, port)
        mine = s.getsockname()[1]
        decline = _propose_then_send(s)
        holder.sendall(b"the silent one speaks")  # after its handoff: plain data
        holder.shutdown(socket.SHUT_WR)
        got = _reports(app)
    finally:
        if holder is not None:
            holder.close()
        if app.poll() is None:
            app.kill()
    assert decline.diagnosis == DeclineReason.MAX_DMB, (hex(decline.diagnosis), b.proc.log())
    refused = got[mine]
    assert bytes.fromhex(refused["data"]) == DATA, refused
    assert refused["name"] == "SMC_CLC_DECL_MAX_DMB", refused
    assert "limits.handshakes_per_user" in refused["why"], refused
    assert "declined the Proposal" in refused["why"], refused
    (silent,) = (r for p, r in got.items() if p != mine)
    assert bytes.fromhex(silent["data"]) == b"the silent one speaks", silent
    assert silent["name"] == "SMC_CLC_DECL_PEERNOSMC", silent
