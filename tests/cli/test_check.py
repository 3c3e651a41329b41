"""``smcctl check``: a real smcd (no configuration), the check server and the client as
separate processes; same-host, so the connection runs on SMC-D loopback-ism."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from smcd_daemon.demo import PrivateSmcd

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[2]
SMCCTL = REPO / ".venv" / "bin" / "smcctl"


@pytest.fixture(scope="module")
def daemon() -> Iterator[PrivateSmcd]:
    d = PrivateSmcd(config_text="", name="check")
    try:
        d.start()
        yield d
    finally:
        d.cleanup()


def env_of(d: PrivateSmcd) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SMCD_", "SMC_RUN"))}
    return {**env, **d.env, "PYTHONPATH": os.fspath(REPO)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_check_against_the_check_server(daemon: PrivateSmcd) -> None:
    port = free_port()
    srv = subprocess.Popen(
        [os.fspath(SMCCTL), "check", "--serve", str(port), "--bind", "127.0.0.1", "--once"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env_of(daemon),
    )  # fmt: skip
    try:
        assert srv.stdout is not None
        first = srv.stdout.readline()
        assert "registered with smcd" in first, (first, srv.stderr)
        argv = [os.fspath(SMCCTL), "check", "127.0.0.1", str(port), "--json"]
        r = subprocess.run(argv, capture_output=True, text=True, env=env_of(daemon), timeout=60)
        assert r.returncode == 0, r.stderr + r.stdout
        out = json.loads(r.stdout)
        assert out["mode"] == "smcd" and out["server"]["mode"] == "smcd", out
        assert out["echo"] == "65536 bytes intact"
        assert out["option_requested"] is False  # no detector on this daemon
        srv.wait(30)
        assert "127.0.0.1 port" in (srv.stdout.read() or "")
    finally:
        if srv.poll() is None:
            srv.kill()
            srv.wait()


def test_check_plain_server_reports_the_fallback(daemon: PrivateSmcd) -> None:
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(1)
    port = lsock.getsockname()[1]

    def plain() -> None:
        conn, _ = lsock.accept()
        conn.recv(1)  # until the client closes
        conn.close()

    t = threading.Thread(target=plain, daemon=True)
    t.start()
    r = subprocess.run([os.fspath(SMCCTL), "check", "127.0.0.1", str(port)],
                       capture_output=True, text=True, env=env_of(daemon), timeout=60)  # fmt: skip
    t.join(10)
    lsock.close()
    assert r.returncode == 2, r.stdout + r.stderr
    assert "transport:   TCP" in r.stdout
    assert "SMC_CLC_DECL_PEERNOSMC (0x03010000)" in r.stdout
    assert "not an smcctl check server" in r.stdout
