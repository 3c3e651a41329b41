"""A refused server half whose client is on the same host and showed the SMC TCP option.

One smcd "host" (namespace B) with peer detection, whose server application's LISTEN fills its
one handoff connection (``limits.connections_per_user = 1``), so every ACCEPT is refused at the
gate. A client on the same host whose SYN carried the option sends CLC, as the kernel's
``smc_listen_work`` expects whatever the address (a kernel AF_SMC client on this host, or in the
Soft-RoCE VM where both "hosts" share init_net):

- a kernel-like client (a raw socket marked by ``smc_handoff.peer_option`` that proposes right
  after its TCP handshake) gets a Decline carrying the refusal's code (MAX_DMB), not a reset or
  the library's NOSMCDEV, and the server application reads exactly the client's bytes;
- smcd's own client half, refused too (same user, same cap), declines first: the refused
  server half takes that Decline off the stream (PEERDECL) at once — a server that speaks first
  is not held back by any CLC timer — and both applications see only each other's bytes.
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

from smc_handoff import peer_option
from smcd_daemon.wire.clc import Decline, Proposal, SmcType, V2Extension, decode
from smcd_daemon.wire.reasons import DeclineReason
from tests.bpf import test_daemon_detection as dd
from tests.bpf.conftest import ADDR_B, Net
from tests.bpf.test_daemon_detection import PROPOSAL_WAIT, PYTHON, Host, start_host

pytestmark = pytest.mark.timeout(300)
cg_seen = dd.cg_seen  # the fixture: the test cgroup as a daemon in a namespace sees it

DATA = b"only the client's own bytes\x00\xe2\xd4\xc3\xd9 (CLC-looking bytes later are data)"
BANNER = b"220 hello\n"

SERVER_APP = r"""
import json, sys, time, smc_handoff
srv = smc_handoff.listen((sys.argv[1], 0))
print("PORT", srv.getsockname()[1], flush=True)
time.sleep(float(sys.argv[3]))  # a late accept: the client's handoff is in smcd first
c, _ = srv.accept()
t0 = time.monotonic()
c.settimeout(30)
c.sendall(sys.argv[2].encode())  # a server that speaks first
data = b""
while chunk := c.recv(65536):
    data += chunk
fb = c.fallback
print("CONN " + json.dumps({
    "mode": c.mode, "data": data.hex(), "name": fb.name if fb else None,
    "why": fb.explanation if fb else None, "after_decline": fb.after_decline if fb else None,
}), flush=True)
c.close()
"""

CLIENT_APP = r"""
import json, socket, sys, time, smc_handoff
from smc_handoff import peer_option
t0 = time.monotonic()
late = float(sys.argv[5]) if len(sys.argv) > 5 else 0.0
if late:  # connected at once, handed to smcd late: its server half is refused first
    raw = socket.socket()
    raw.settimeout(30)
    if not peer_option.request_option(raw):
        raise SystemExit("the detector did not take the mark")
    raw.connect((sys.argv[1], int(sys.argv[2])))
    time.sleep(late)
    s = smc_handoff.wrap(raw)
else:
    s = smc_handoff.connect((sys.argv[1], int(sys.argv[2])), timeout=30)
want = sys.argv[3].encode()
got = b""
while len(got) < len(want):
    chunk = s.recv(100)
    if not chunk:
        break
    got += chunk
banner_s = time.monotonic() - t0
s.sendall(bytes.fromhex(sys.argv[4]))
s.shutdown(1)
tail = s.recv(100)
fb = s.fallback
print("CLIENT " + json.dumps({
    "banner": got.hex(), "banner_s": banner_s, "tail": tail.hex(), "mode": s.mode,
    "name": fb.name if fb else None, "why": fb.explanation if fb else None,
    "after_decline": fb.after_decline if fb else None,
}), flush=True)
s.close()
"""


@pytest.fixture
def capped(bpf_object: Path, cg_seen: Path, net: Net) -> Iterator[Host]:
    """B alone: detection on, one handoff connection per user (the LISTEN holds it)."""
    host = start_host(net, net.ns_b, "b", cg_seen, "[limits]\nconnections_per_user = 1\n")
    try:
        yield host
    finally:
        if host.proc.alive():
            host.proc.stop()


def server_app(host: Host, accept_after: float = 0.0) -> tuple[subprocess.Popen[str], int]:
    argv = ["ip", "netns", "exec", host.ns, os.fspath(PYTHON), "-c", SERVER_APP, ADDR_B,
            BANNER.decode(), str(accept_after)]  # fmt: skip
    app = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env=host.env)  # fmt: skip
    assert app.stdout is not None
    first = app.stdout.readline()
    assert first.startswith("PORT "), (first, app.communicate(timeout=10))
    return app, int(first.split()[1])


def run_client(host: Host, port: int, *prefix: str, late: float = 0.0) -> dict[str, Any]:
    """CLIENT_APP in ``host``'s namespace (``prefix``: a command it runs under, e.g. setpriv),
    to its end; what it printed. ``late``: seconds between its connect and its handoff."""
    argv = ["ip", "netns", "exec", host.ns, *prefix, os.fspath(PYTHON), "-c", CLIENT_APP,
            ADDR_B, str(port), BANNER.decode(), DATA.hex(), str(late)]  # fmt: skip
    cli = subprocess.run(argv, capture_output=True, text=True, env=host.env, timeout=120)
    assert cli.returncode == 0, cli.stderr
    (line,) = [ln for ln in cli.stdout.splitlines() if ln.startswith("CLIENT ")]
    return json.loads(line[len("CLIENT ") :])  # type: ignore[no-any-return]


def report(app: subprocess.Popen[str], tag: str) -> dict[str, Any]:
    out, err = app.communicate(timeout=60)
    assert app.returncode == 0, err
    (row,) = [json.loads(ln[len(tag) + 1 :]) for ln in out.splitlines() if ln.startswith(tag)]
    return row  # type: ignore[no-any-return]


def _proposal() -> bytes:
    """A v2 SMC-D/SMC-R Proposal as a kernel client sends one (its contents do not matter)."""
    return Proposal(
        typev1=SmcType.N, typev2=SmcType.R, version=2, peer_id=bytes(8), gid=bytes(16),
        mac=bytes(6), v2_ext=V2Extension(eids=("SMCD-BPF-E2E",), release=1, roce_gid=bytes(16)),
    ).encode()  # fmt: skip


def test_same_host_client_with_the_option_gets_a_decline(capped: Host, net: Net) -> None:
    app, port = server_app(capped)
    try:
        s = net.socket(net.ns_b)  # same host as the server
        s.settimeout(20)
        # the detector took the mark (an earlier "no detector" in this process is remembered
        # for NO_DETECTOR_TTL: ask again past it)
        until = time.monotonic() + peer_option.NO_DETECTOR_TTL + 1
        while not peer_option.request_option(s):
            assert time.monotonic() < until, "the detector did not take the mark"
            time.sleep(0.1)
        t0 = time.monotonic()
        s.connect((ADDR_B, port))
        s.sendall(_proposal())  # as the kernel's smc_connect_work: right after the handshake
        answer = b""
        while len(answer) < 8 or len(answer) < int.from_bytes(answer[5:7], "big"):
            chunk = s.recv(200)
            assert chunk, f"EOF after {answer.hex()}: {capped.proc.log()[-3000:]}"
            answer += chunk
        declined_s = time.monotonic() - t0
        length = int.from_bytes(answer[5:7], "big")
        msg = decode(answer[:length])
        assert isinstance(msg, Decline), answer.hex()
        assert msg.diagnosis == DeclineReason.MAX_DMB, (hex(msg.diagnosis), capped.proc.log())
        rest = answer[length:]
        while len(rest) < len(BANNER):  # then the server application's own first bytes
            chunk = s.recv(100)
            assert chunk, rest
            rest += chunk
        assert rest == BANNER, rest
        s.sendall(DATA)
        s.shutdown(socket.SHUT_WR)
        assert s.recv(100) == b""
        s.close()
        got = report(app, "CONN")
    finally:
        if app.poll() is None:
            app.kill()
            app.wait()
    assert declined_s < PROPOSAL_WAIT, declined_s  # answered, not timed out
    assert bytes.fromhex(got["data"]) == DATA, got
    assert got["mode"] == "tcp" and got["name"] == "SMC_CLC_DECL_MAX_DMB", got
    assert "declined the Proposal" in got["why"] and got["after_decline"], got
    assert "limits.connections_per_user" in got["why"], got


def test_own_client_half_refused_too_declines_and_the_server_half_takes_it(
    capped: Host, net: Net
) -> None:
    app, port = server_app(capped)
    try:
        client = run_client(capped, port)
        got = report(app, "CONN")
    finally:
        if app.poll() is None:
            app.kill()
            app.wait()
    log = capped.proc.log()
    # the client half was refused at the gate toward a listener that showed the option:
    # it declined first and handed its application the stream after that Decline
    assert client["name"] == "SMC_CLC_DECL_MAX_DMB" and client["after_decline"], client
    assert bytes.fromhex(client["banner"]) == BANNER and client["tail"] == "", client
    # the refused server half read that Decline (not a Proposal) and ended at once
    assert got["name"] == "SMC_CLC_DECL_PEERDECL", (got, log[-3000:])
    assert got["after_decline"], got
    assert bytes.fromhex(got["data"]) == DATA, got
    assert client["banner_s"] < PROPOSAL_WAIT / 2, (client, log[-3000:])


NOBODY = 65534
ACCEPT_AFTER = 1.0


def nobody_client_to_capped_server(
    capped: Host, net: Net, *, accept_after: float = 0.0, late: float = 0.0
) -> tuple[dict[str, Any], dict[str, Any], str]:
    """The server application (capped: its ACCEPT is refused at the gate) and a client of
    another user (not refused), to their ends: what each printed, and the daemon's log. Checks
    what both orders share: the client half fell back because its server half did, before any
    CLC byte, and both applications read exactly each other's bytes."""
    for d in (net.work, capped.run):  # the work dirs are private to root
        os.chmod(d, os.stat(d).st_mode | 0o005)
    app, port = server_app(capped, accept_after=accept_after)
    try:
        setpriv = ("setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups")
        client = run_client(capped, port, *setpriv, late=late)
        got = report(app, "CONN")
    finally:
        if app.poll() is None:
            app.kill()
            app.wait()
    log = capped.proc.log()
    assert client["mode"] == "tcp" and not client["after_decline"], (client, log[-3000:])
    assert "server half fell back" in client["why"], client
    assert bytes.fromhex(client["banner"]) == BANNER and client["tail"] == "", client
    # the server half: its own refusal, no CLC crossed, the client's bytes exactly
    assert got["name"] == "SMC_CLC_DECL_MAX_DMB" and not got["after_decline"], (got, log[-3000:])
    assert "limits.connections_per_user" in got["why"], got
    assert bytes.fromhex(got["data"]) == DATA, got
    return client, got, log


def test_own_client_half_not_refused_falls_back_at_once_with_its_refused_server_half(
    capped: Host, net: Net
) -> None:
    """The server half is refused at the gate (its user's cap); the client half belongs to
    another user, is not refused, and is smcd's own, parked for its server half. Told at once
    that the server half fell back, it sends no CLC byte, so the refused server half waits
    for no Proposal either: both applications get the plain stream without any CLC timer
    (before, the server half waited ``proposal_wait`` for a Proposal that could not come)."""
    # The server accepts late, so the client half is parked in smcd when the refusal comes
    # (the other order is the next test).
    client, _got, log = nobody_client_to_capped_server(capped, net, accept_after=ACCEPT_AFTER)
    # and nobody waited for a CLC timer: the banner came within half a proposal_wait of the
    # accept (a wait would add all of it: PROPOSAL_WAIT, or clc_wait for the client)
    assert client["banner_s"] < ACCEPT_AFTER + PROPOSAL_WAIT / 2, (client, log[-3000:])


HANDOFF_AFTER = 1.0


def test_own_client_half_arriving_after_its_refused_server_half_ends_its_wait(
    capped: Host, net: Net
) -> None:
    """The other order: the server half is refused before its client half reaches smcd (the
    client connects, the server accepts and hands over at once, the client hands over 1 s
    later). The refused server half must wait for a Proposal, since its client showed the
    option and could be a kernel AF_SMC one; when the client half that arrives is smcd's own,
    it reads the fall-back, sends no CLC byte, and that ends the server half's wait at once
    (before, it waited all of ``proposal_wait``)."""
    client, _got, log = nobody_client_to_capped_server(capped, net, late=HANDOFF_AFTER)
    # the banner left once the client half had read the fall-back, not after proposal_wait
    assert client["banner_s"] < HANDOFF_AFTER + PROPOSAL_WAIT / 2, (client, log[-3000:])
