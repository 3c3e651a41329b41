"""``smc-run`` upgrades unmodified programs: ``python -m http.server`` and a stdlib
``http.client`` fetch over SMC-D, visible as two SMCD connections in ``smcctl conns`` during the
fetch."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import PYTHON, REPO_ENV, SMC_RUN, Smcd

pytestmark = pytest.mark.timeout(120)

CLIENT = r"""
import hashlib, http.client, sys
port = int(sys.argv[1])
conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
conn.request("GET", "/big.bin")
mode = conn.sock.mode
resp = conn.getresponse()
h = hashlib.sha256()
first = resp.read(65536)
h.update(first)
print("started", mode, resp.status, flush=True)
sys.stdin.readline()
rest = resp.read()
h.update(rest)
print("done", len(first) + len(rest), h.hexdigest(), flush=True)
"""


def _line(proc: subprocess.Popen[str], pattern: str, timeout: float = 20.0) -> re.Match[str]:
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        found = re.search(pattern, line)
        if found:
            return found
    err = proc.stderr.read() if proc.stderr and proc.poll() is not None else ""
    raise AssertionError(f"no line matching {pattern!r}; stderr: {err}")


def test_http_server_and_client_over_smc(smcd: Smcd, tmp_path: Path) -> None:
    payload = os.urandom(8 * 1024 * 1024 + 5)
    (tmp_path / "big.bin").write_bytes(payload)
    env = {**REPO_ENV, "SMCD_HANDOFF_SOCKET": os.fspath(smcd.handoff), "PYTHONUNBUFFERED": "1"}
    server = subprocess.Popen(
        [os.fspath(SMC_RUN), "-v", os.fspath(PYTHON), "-m", "http.server", "0",
         "--bind", "127.0.0.1", "--directory", os.fspath(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    client: subprocess.Popen[str] | None = None
    try:
        port = int(_line(server, r"port (\d+)").group(1))
        client = subprocess.Popen(
            [os.fspath(SMC_RUN), os.fspath(PYTHON), "-c", CLIENT, str(port)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=env,
        )  # fmt: skip
        started = _line(client, r"started (\w+) (\d+)")
        assert started.groups() == ("smcd", "200"), started.group(0)

        def both(rows: list[dict[str, Any]]) -> bool:
            ours = [r for r in rows if port in (r["LocalPort"], r["PeerPort"])]
            return sorted(r["Role"] for r in ours if r["Mode"] == "SMCD") == ["CLIENT", "SERVER"]

        smcd.wait_conns(both)
        assert client.stdin is not None
        client.stdin.write("go\n")
        client.stdin.flush()
        done = _line(client, r"done (\d+) (\w+)")
        assert int(done.group(1)) == len(payload)
        assert done.group(2) == hashlib.sha256(payload).hexdigest()
        assert client.wait(10) == 0
    finally:
        for proc in (client, server):
            if proc is not None:
                proc.kill()
        if client is not None:
            client.communicate()
        _, err = server.communicate()
    assert re.search(r"accept .*: smcd", err), err  # smc-run -v: the server side was upgraded
