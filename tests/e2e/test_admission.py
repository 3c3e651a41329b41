"""No user degrades another's connections, and a refusal never touches a stream (#14), against
the real smcd with small limits:

- another uid's flood of idle handoff connections is capped (``limits.pending_per_user``): the
  excess is answered with FALLBACK MAX_DMB naming the limit and closed, the idle ones are closed
  after ``limits.first_request_wait``, root's connections go on over SMC meanwhile, and the
  daemon's descriptors come back to where they were;
- a user at their cap of handshakes in flight (``limits.handshakes_per_user``: here server halves
  waiting for a Proposal) is answered with FALLBACK before any CLC byte (its peer received
  nothing), while root's connections are SMC;
- invalid datagrams from another uid are logged at most 10 times a minute, with the count of
  the rest at shutdown, and never with a traceback.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.control.daemon_proc import NotifySocket
from tests.control.dbusd import DbusDaemon
from tests.e2e.conftest import PYTHON, REPO_ENV, Smcd, pair

pytestmark = pytest.mark.timeout(120)

NOBODY = 65534
PENDING = 8
LIMITS = (
    "clc_wait = 2.0\n"
    "[limits]\n"
    f"pending_per_user = {PENDING}\n"
    "handshakes_per_user = 2\n"
    "first_request_wait = 1.0\n"
)

FLOOD = r"""
import json, os, select, socket, sys, time
from smc_handoff import messages as m
path, n = sys.argv[1], int(sys.argv[2])
conns = []
for _ in range(n):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.connect(path)
    s.setblocking(False)
    conns.append(s)
time.sleep(1.6)  # past limits.first_request_wait
closed, silent = 0, []
for s in conns:
    try:
        closed += not s.recv(4096)
    except BlockingIOError:
        silent.append(s)
print(json.dumps({"closed": closed, "silent": len(silent)}), flush=True)
codes, texts = set(), set()
for s in silent:  # the refused ones speak: each gets its FALLBACK
    s.send(b"x")
    s.setblocking(True)
    s.settimeout(5)
    msg, fds = m.recv_message(s, requests=False)
    m.close_fds(fds)
    codes.add(msg.code)
    texts.add(msg.explanation)
print(json.dumps({"codes": sorted(codes), "texts": sorted(texts)}), flush=True)
"""

HANDSHAKES = r"""
import json, os, socket, sys, time
from smc_handoff import messages as m
path = sys.argv[1]
lst = socket.create_server(("127.0.0.1", 0))
reg = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
reg.connect(path)
m.send_message(reg, m.Listen(), [lst.fileno()])
ok, _ = m.recv_message(reg, requests=False)
assert isinstance(ok, m.Ok), ok
halves = []
for i in range(3):
    peer = socket.socket()  # a client that never proposes, marked as ours are (a plain one's
    peer.setsockopt(socket.IPPROTO_IP, 24, 1)  # half falls back after 20 ms: no handoff mark)
    peer.connect(lst.getsockname())
    tcp, _ = lst.accept()
    ctl = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    ctl.connect(path)
    m.send_message(ctl, m.Accept(0), [tcp.fileno()])  # a server half, waiting for a Proposal
    halves.append((tcp, peer, ctl, time.monotonic()))
out = []
for tcp, peer, ctl, t0 in reversed(halves):  # the third first: it must be answered at once
    ctl.settimeout(10)
    reply, fds = m.recv_message(ctl, requests=False)
    m.close_fds(fds)
    peer.setblocking(False)
    try:
        got = peer.recv(4096)
    except BlockingIOError:
        got = b""
    out.append({"type": reply.TYPE.name, "code": getattr(reply, "code", None),
                "text": getattr(reply, "explanation", ""), "after": time.monotonic() - t0,
                "peer_got": got.hex()})
print(json.dumps(out), flush=True)
"""
PROPOSAL_WAIT = 2.0
"""How long this module's server halves wait for a Proposal: the handshakes in flight."""


def _open_for_others(smcd: Smcd) -> None:
    for d in (smcd.work, smcd.handoff.parent):
        os.chmod(d, os.stat(d).st_mode | stat.S_IXOTH | stat.S_IROTH)


def _as_nobody(script: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [os.fspath(PYTHON), "-c", script, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=REPO_ENV,
        user=NOBODY,
        group=NOBODY,
        extra_groups=[],
        cwd="/",
    )


def _line(proc: subprocess.Popen[str]) -> Any:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, proc.stderr.read() if proc.stderr else "no output"
    return json.loads(line)


@pytest.fixture(scope="module")
def smcd(work: Path, e2e_bus: DbusDaemon) -> Iterator[Smcd]:
    notify = NotifySocket(work / "notify")
    daemon = Smcd(work, e2e_bus, notify)
    daemon.write_config(LIMITS, proposal_wait=PROPOSAL_WAIT, local_client_wait=PROPOSAL_WAIT)
    daemon.start()
    _open_for_others(daemon)
    try:
        yield daemon
    finally:
        daemon.stop()
        notify.close()


def test_idle_flood_of_another_user_is_capped_and_root_stays_on_smc(smcd: Smcd, apps: Any) -> None:
    server, client, _ = pair(apps)  # warm: the pool and the link group exist
    server.kill()
    client.kill()
    time.sleep(0.5)
    before = smcd.fds()["all"]
    flood = _as_nobody(FLOOD, os.fspath(smcd.handoff), "200")
    try:
        time.sleep(0.3)
        # root meanwhile: unaffected
        for _ in range(3):
            s, c, _ = pair(apps)
            s.kill()  # with its listener registration
            c.kill()
        # the served ones (held to the cap) are closed after limits.first_request_wait; the
        # refused ones are parked, silent, at no cost, until they speak
        assert _line(flood) == {"closed": PENDING, "silent": 200 - PENDING}
        answered = _line(flood)
        assert answered["codes"] == [0x030D0000], answered  # MAX_DMB: a quota
        (text,) = answered["texts"]
        assert f"uid {NOBODY} holds {PENDING} handoff connections that sent no request" in text
        assert f"limits.pending_per_user allows {PENDING}" in text
    finally:
        flood.wait(10)
    time.sleep(0.5)
    assert smcd.fds()["all"] <= before + 2, (before, smcd.fds())
    assert "Traceback" not in smcd.log()


def test_a_user_at_its_handshake_cap_is_refused_before_any_clc_byte(smcd: Smcd, apps: Any) -> None:
    proc = _as_nobody(HANDSHAKES, os.fspath(smcd.handoff))
    time.sleep(0.2)
    s, c, _ = pair(apps)  # root, while the other user's two handshakes are in flight
    try:
        third, second, first = _line(proc)
    finally:
        proc.wait(10)
        s.call("close")
        c.call("close")
    assert third["type"] == "FALLBACK" and third["code"] == 0x030D0000, third
    assert third["after"] < 1.0, third  # answered at once, not after a handshake
    assert "holds 2 handshakes in flight; limits.handshakes_per_user allows 2" in third["text"]
    for half in (first, second):  # in flight until no Proposal came
        assert half["type"] == "FALLBACK" and half["after"] >= PROPOSAL_WAIT, half
        assert f"no CLC Proposal within {PROPOSAL_WAIT:g} s" in half["text"], half
    assert [h["peer_got"] for h in (first, second, third)] == ["", "", ""]


def test_invalid_datagrams_are_logged_rate_limited_without_traceback(smcd: Smcd) -> None:
    script = r"""
import socket, sys
for _ in range(300):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.connect(sys.argv[1])
    s.send(b"SMCH\x01\x01\x00\x00\x00\x00\x00\x09garbage!!")
    s.recv(4096)
    s.close()
"""
    mark = len(smcd.log())
    proc = _as_nobody(script, os.fspath(smcd.handoff))
    assert proc.wait(60) == 0, proc.stderr.read() if proc.stderr else ""
    log = smcd.log()[mark:]
    assert 1 <= log.count("invalid request") <= 10, log[-3000:]
    assert "Traceback" not in log
    smcd.stop()
    tail = smcd.log()[mark:]
    assert "similar messages suppressed" in tail, tail[-2000:]
    smcd.start()
    _open_for_others(smcd)
