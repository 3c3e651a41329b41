"""A listener older than the detector: its accepted sockets are decided as without detection.

A listening socket created before smcd attached its programs never turned on the header-option
callbacks, so its SYN-ACKs carry no SMC option, and the BPF record of each accepted child says
"no option" although the client's SYN may have carried one. That is the normal case for the
listener whose LISTEN starts a socket-activated smcd, and for every listener re-registered after
smcd restarts. The daemon must not read that record as "a plain TCP client" (PEERNOSMC at once):
it knows the listener is unarmed and decides its children as without detection. Here the server
application listens before smcd runs, registers once smcd is up, and a same-host client through
smcd gets SMC-D on both halves with the data intact.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.bpf import test_daemon_detection as dd
from tests.bpf.conftest import ADDR_B, Net
from tests.bpf.test_daemon_detection import PYTHON, REPO, Host, start_host

pytestmark = pytest.mark.timeout(300)
cg_seen = dd.cg_seen  # the fixture: the test cgroup as a daemon in a namespace sees it

SERVER_APP = r"""
import hashlib, json, sys, time, smc_handoff
srv = smc_handoff.listen((sys.argv[1], 0))  # smcd is not running yet: not registered
print("PORT", srv.getsockname()[1], srv.registered, flush=True)
sys.stdin.readline()  # smcd is up now
deadline = time.monotonic() + 30
while not srv.registered and time.monotonic() < deadline:
    time.sleep(0.2)
print("REGISTERED", srv.registered, flush=True)
c, _ = srv.accept()
c.settimeout(30)
data = b""
while chunk := c.recv(65536):
    data += chunk
c.sendall(hashlib.sha256(data).digest())
fb = c.fallback
print("CONN " + json.dumps({"mode": c.mode, "n": len(data), "why": fb.explanation if fb else None}),
      flush=True)
c.close()
"""

CLIENT_APP = r"""
import hashlib, json, os, sys, smc_handoff
s = smc_handoff.connect((sys.argv[1], int(sys.argv[2])), timeout=30)
blob = os.urandom(1 << 20)
s.sendall(blob)
s.shutdown(1)
got = b""
while chunk := s.recv(65536):
    got += chunk
fb = s.fallback
print("CLIENT " + json.dumps({"mode": s.mode, "intact": got == hashlib.sha256(blob).digest(),
                              "why": fb.explanation if fb else None}), flush=True)
s.close()
"""


def app_env(net: Net, name: str) -> dict[str, str]:
    """What :func:`start_host` gives applications, known before the daemon starts."""
    run = net.work / name
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SMCD_", "SMC_RUN"))}
    return env | {
        "SMCD_HANDOFF_SOCKET": os.fspath(run / "handoff.sock"),
        "SMCD_BUS": "private",
        "SMCD_RUNTIME_DIR": os.fspath(run),
        "PYTHONPATH": os.fspath(REPO),
    }


@pytest.fixture
def early_server(bpf_object: Path, cg_seen: Path, net: Net) -> Iterator[subprocess.Popen[str]]:
    """The server application, started in the test's cgroup before any smcd runs."""
    argv = ["ip", "netns", "exec", net.ns_b, os.fspath(PYTHON), "-c", SERVER_APP, ADDR_B]
    app = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, env=app_env(net, "b"))  # fmt: skip
    try:
        yield app
    finally:
        if app.poll() is None:
            app.kill()
        app.wait()


def test_listener_older_than_the_detector_still_gets_smc(
    early_server: subprocess.Popen[str], cg_seen: Path, net: Net
) -> None:
    app = early_server
    assert app.stdout is not None and app.stdin is not None
    first = app.stdout.readline().split()
    assert first[0] == "PORT" and first[2] == "False", (first, app.stderr)
    port = int(first[1])
    host: Host = start_host(net, net.ns_b, "b", cg_seen)
    try:
        app.stdin.write("go\n")
        app.stdin.flush()
        assert app.stdout.readline().split() == ["REGISTERED", "True"]
        log = host.proc.log()
        assert "was created before the BPF program was attached" in log, log[-3000:]
        argv = ["ip", "netns", "exec", net.ns_b, os.fspath(PYTHON), "-c", CLIENT_APP, ADDR_B,
                str(port)]  # fmt: skip
        cli = subprocess.run(argv, capture_output=True, text=True, env=host.env, timeout=120)
        assert cli.returncode == 0, cli.stderr
        (line,) = [ln for ln in cli.stdout.splitlines() if ln.startswith("CLIENT ")]
        client = json.loads(line[len("CLIENT ") :])
        out, err = app.communicate(timeout=60)
        (row,) = [ln for ln in out.splitlines() if ln.startswith("CONN ")]
        server = json.loads(row[len("CONN ") :])
    finally:
        if host.proc.alive():
            host.proc.stop()
    assert client["intact"], client
    assert client["mode"] == "smcd", (client, host.proc.log()[-3000:])
    assert server["mode"] == "smcd" and server["n"] == 1 << 20, (server, err)
