"""Two real ``smcd`` processes speak SMC-R to each other over Soft-RoCE: host A's daemon serves
a client application on 192.0.2.1 (smca0/rxe_a0), host B's a server application on 192.0.2.2
(smcb0/rxe_b0). Both applications use ``smc_handoff`` with their own daemon's handoff socket;
the bytes are checked end to end, both ends must report mode "smcr", and ``smcctl`` on each
daemon must show the SMC-R connection and its link group.

Every wait has a deadline; nothing asserts a duration (TCG makes everything slow).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SMCD = ROOT / ".venv" / "bin" / "smcd"
SMCCTL = ROOT / ".venv" / "bin" / "smcctl"
PY = ROOT / ".venv" / "bin" / "python"
WAIT = 150.0
PORT = 47311
SIZE = 4 << 20
UEID = "SMCD-VM-DAEMONS"

SERVER_APP = r"""
import hashlib, json, struct, sys
import smc_handoff
srv = smc_handoff.listen(("192.0.2.2", int(sys.argv[1])))
print("LISTENING", flush=True)
conn, _ = srv.accept()
head = b""
while len(head) < 8:
    b = conn.recv(8 - len(head))
    if not b:
        raise SystemExit("EOF before the length")
    head += b
n = struct.unpack("!Q", head)[0]
h, got = hashlib.sha256(), 0
while got < n:
    b = conn.recv(min(1 << 16, n - got))
    if not b:
        break
    h.update(b); got += len(b)
conn.sendall(h.digest())
print(json.dumps({"mode": conn.mode, "bytes": got, "sha": h.hexdigest()}), flush=True)
sys.stdin.readline()  # keep the connection open while the test looks at smcctl
conn.close(); srv.close()
"""

CLIENT_APP = r"""
import hashlib, json, os, struct, sys
import smc_handoff
n = int(sys.argv[2])
data = os.urandom(n)
s = smc_handoff.connect(("192.0.2.2", int(sys.argv[1])), 60, source_address=("192.0.2.1", 0))
s.sendall(struct.pack("!Q", n))
for i in range(0, n, 1 << 16):
    s.sendall(data[i:i + (1 << 16)])
echo = b""
while len(echo) < 32:
    b = s.recv(32 - len(echo))
    if not b:
        break
    echo += b
print(json.dumps({"mode": s.mode, "sha": hashlib.sha256(data).hexdigest(),
                  "echo": echo.hex()}), flush=True)
sys.stdin.readline()
s.close()
"""


@dataclass
class Daemon:
    name: str
    proc: subprocess.Popen[bytes]
    run: Path
    handoff: Path
    log: Path

    @property
    def bus(self) -> str:
        return (self.run / "bus.address").read_text().strip()

    def ctl(self, *args: str) -> str:
        r = subprocess.run(
            [str(SMCCTL), "--bus", self.bus, *args],
            capture_output=True,
            text=True,
            timeout=WAIT,
        )
        assert r.returncode == 0, f"smcctl {' '.join(args)} on {self.name}: {r.stderr}"
        return r.stdout


def _start(scratch: Path, name: str) -> Daemon:
    base = scratch / name
    base.mkdir(parents=True, exist_ok=True)
    cfg = base / "smcd.toml"
    cfg.write_text(
        f'peers = ["192.0.2.0/24"]\n[eid]\nueids = ["{UEID}"]\n'
        f"[timeouts]\nclc_wait = 30.0\nproposal_wait = 10.0\nfirst_llc = 30.0\n"
    )
    run = Path(tempfile.mkdtemp(prefix=f"smcd-{name}-"))  # 9p (scratch) holds no sockets
    handoff = run / "handoff.sock"
    log = base / "smcd.log"
    proc = subprocess.Popen(
        [str(SMCD), "--config", str(cfg), "--bus", "private", "--runtime-dir", str(run),
         "--state-dir", str(base / "state"), "--handoff-socket", str(handoff),
         "--log-level", "debug"],
        stdout=subprocess.DEVNULL,
        stderr=log.open("wb"),
        stdin=subprocess.DEVNULL,
    )  # fmt: skip
    return Daemon(name, proc, run, handoff, log)


def _wait_ready(d: Daemon) -> None:
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        if d.proc.poll() is not None:
            pytest.fail(f"smcd {d.name} exited {d.proc.returncode}:\n{d.log.read_text()[-4000:]}")
        if d.handoff.exists() and (d.run / "bus.address").exists():
            with contextlib.suppress(AssertionError, subprocess.TimeoutExpired):
                d.ctl("conns")
                return
        time.sleep(0.5)
    pytest.fail(f"smcd {d.name} not ready within {WAIT:g} s:\n{d.log.read_text()[-4000:]}")


@pytest.fixture
def daemons(scratch: Path) -> Iterator[tuple[Daemon, Daemon]]:
    a, b = _start(scratch, "a"), _start(scratch, "b")
    try:
        _wait_ready(a)
        _wait_ready(b)
        yield a, b
    finally:
        for d in (a, b):
            if d.proc.poll() is None:
                d.proc.terminate()
                try:
                    d.proc.wait(30)
                except subprocess.TimeoutExpired:
                    d.proc.kill()
                    d.proc.wait()


def _app(script: str, d: Daemon, *args: str) -> subprocess.Popen[str]:
    env = dict(os.environ, SMCD_HANDOFF_SOCKET=str(d.handoff), SMCD_HANDOFF_TIMEOUT="60")
    return subprocess.Popen(
        [str(PY), "-c", script, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=str(ROOT),
    )


def _line(
    p: subprocess.Popen[str],
    what: str,
    logs: list[Daemon],
    others: tuple[subprocess.Popen[str] | None, ...] = (),
) -> str:
    assert p.stdout is not None
    line = p.stdout.readline()  # the app has its own deadlines (connect 60 s, daemon waits)
    if not line:
        text = []
        for q, name in ((p, what), *((o, "other app") for o in others if o is not None)):
            if q.poll() is None:
                q.kill()
            text.append(f"--- {name} (exit {q.wait()})\n{q.stderr.read() if q.stderr else ''}")
        tails = "\n".join(f"--- smcd {d.name}\n{d.log.read_text()[-3000:]}" for d in logs)
        pytest.fail(f"{what} printed nothing:\n" + "\n".join(text) + f"\n{tails}")
    return line.strip()


@pytest.mark.timeout(290)
def test_two_daemons_smcr_transfer(daemons: tuple[Daemon, Daemon]) -> None:
    a, b = daemons
    server = _app(SERVER_APP, b, str(PORT))
    client = None
    try:
        assert _line(server, "server app", [a, b]) == "LISTENING"
        client = _app(CLIENT_APP, a, str(PORT), str(SIZE))
        c = json.loads(_line(client, "client app", [a, b], (server,)))
        s = json.loads(_line(server, "server app", [a, b], (client,)))
        tails = "\n".join(f"--- smcd {d.name}\n{d.log.read_text()[-3000:]}" for d in (a, b))
        assert (c["mode"], s["mode"]) == ("smcr", "smcr"), f"{c} {s}\n{tails}"
        assert s["bytes"] == SIZE
        assert s["sha"] == c["sha"] == c["echo"]
        for d, role, dev in ((a, "CLNT", "rxe_a0"), (b, "SERV", "rxe_b0")):
            conns = d.ctl("conns", "-R")
            assert "SMCR" in conns, f"smcctl conns on {d.name}:\n{conns}"
            lgs = d.ctl("linkgroup", "show", "--links")
            words = lgs.split()
            assert {"SMC-R", role, "ACTIVE", dev} <= set(words), (
                f"smcctl linkgroup on {d.name}:\n{lgs}"
            )
            print(f"--- {d.name}\n{conns}\n{lgs}")
    finally:
        for p in (client, server):
            if p is None:
                continue
            with contextlib.suppress(Exception):
                assert p.stdin is not None
                p.stdin.write("\n")
                p.stdin.flush()
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    assert server.returncode == 0, server.stderr.read() if server.stderr else ""
    assert client is not None and client.returncode == 0, (
        client.stderr.read() if client and client.stderr else ""
    )
