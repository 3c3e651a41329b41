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


SELECT_SERVER = r"""
import select, socket
ls = socket.socket()
ls.bind(("127.0.0.1", 0))
ls.listen(512)
print("port", ls.getsockname()[1], flush=True)
conns = []
while True:
    r, _, _ = select.select([ls] + conns, [], [])
    for s in r:
        if s is ls:
            conns.append(ls.accept()[0])
        else:
            data = s.recv(4096)  # blocking: select said it would not wait
            if data:
                s.sendall(data)
            else:
                conns.remove(s)
                s.close()
"""

SELECT_CLIENT = r"""
import socket, sys
port, n = int(sys.argv[1]), int(sys.argv[2])
conns = []
for i in range(n):
    c = socket.create_connection(("127.0.0.1", port), timeout=20)
    conns.append(c)
    c.sendall(b"hello %d" % i)
    assert c.recv(100) == b"hello %d" % i, i
for i, c in enumerate(conns):
    c.sendall(b"again %d" % i)
    assert c.recv(100) == b"again %d" % i, i
print("echoed", n, max(c.fileno() for c in conns), flush=True)
"""


def _serve(smcd: Smcd, program: str) -> tuple[dict[str, str], subprocess.Popen[str], int]:
    """``program`` (``-c``) under ``smc-run -v`` against ``smcd``: its environment, the process
    and the port it printed."""
    env = {**REPO_ENV, "SMCD_HANDOFF_SOCKET": os.fspath(smcd.handoff), "PYTHONUNBUFFERED": "1"}
    server = subprocess.Popen(
        [os.fspath(SMC_RUN), "-v", os.fspath(PYTHON), "-c", program],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        return env, server, int(_line(server, r"port (\d+)").group(1))
    except BaseException:
        server.kill()
        server.communicate()
        raise


def test_a_select_loop_serves_hundreds_of_connections(smcd: Smcd) -> None:
    """A plain ``select.select`` server with blocking sockets, 300 connections from one
    client. Each SMC connection holds seven descriptors, so its ``fileno()`` passed 1024 at the
    ~146th and select raised ``filedescriptor out of range`` (TCP serves ~1,000); and a peer's
    late kick could leave a connection polled readable with nothing to read, so that the
    server's blocking ``recv`` waited for data the client would only send once answered."""
    env, server, port = _serve(smcd, SELECT_SERVER)
    try:
        for _ in range(2):
            client = subprocess.run(
                [os.fspath(SMC_RUN), "-v", os.fspath(PYTHON), "-c", SELECT_CLIENT, str(port),
                 "300"],
                capture_output=True, text=True, env=env, timeout=60,
            )  # fmt: skip
            assert client.returncode == 0, client.stderr[-2000:]
            echoed = re.search(r"echoed 300 (\d+)", client.stdout)
            assert echoed and int(echoed.group(1)) > 1024, client.stdout
            modes = re.findall(r"connect .*: (\w+)", client.stderr)
            assert modes == ["smcd"] * 300, client.stderr[-2000:]
    finally:
        server.kill()
        _, err = server.communicate()
    assert len(re.findall(r"accept .*: smcd", err)) == 600, err[-2000:]
    assert "Traceback" not in err, err[-2000:]


ET_SERVER = r"""
import select, socket
ls = socket.socket()
ls.bind(("127.0.0.1", 0))
ls.listen(512)
print("port", ls.getsockname()[1], flush=True)
ep = select.epoll()
ep.register(ls.fileno(), select.EPOLLIN)
conns, queued = {}, {}
while True:
    for fd, ev in ep.poll():
        if fd == ls.fileno():
            c = ls.accept()[0]
            c.setblocking(False)
            conns[c.fileno()], queued[c.fileno()] = c, bytearray()
            ep.register(c.fileno(), select.EPOLLIN | select.EPOLLOUT | select.EPOLLET)
            continue
        c = conns[fd]
        while ev & select.EPOLLIN:  # edge-triggered: until EAGAIN, as epoll(7) asks
            try:
                data = c.recv(65536)
            except BlockingIOError:
                break
            if not data:
                ep.unregister(fd)
                c.close()
                del conns[fd]
                break
            queued[fd] += data
        while fd in conns and queued[fd]:
            try:
                del queued[fd][: c.send(queued[fd])]
            except BlockingIOError:
                break
"""

ET_CLIENT = r"""
import os, socket, sys, threading
from concurrent.futures import ThreadPoolExecutor
port = int(sys.argv[1])
def one(k):
    c = socket.create_connection(("127.0.0.1", port), timeout=15)
    data = os.urandom(3_000_000 + k)
    got = bytearray()
    def read():
        while len(got) < len(data) and (chunk := c.recv(1 << 20)):
            got.extend(chunk)
    reader = threading.Thread(target=read)
    reader.start()
    for i in range(0, len(data), 100_000):
        c.sendall(data[i : i + 100_000])
    reader.join()
    c.close()
    return got == data
with ThreadPoolExecutor(16) as pool:
    print("intact", sum(pool.map(one, range(64))), flush=True)
"""


def test_an_edge_triggered_epoll_echo_server_answers_every_byte(smcd: Smcd) -> None:
    """An epoll server, edge-triggered, non-blocking, reading and writing until EAGAIN; 64
    clients send 3 MB each while reading their echo. When a send met a full ring and the
    client's reads made room before the server's next poll, the EPOLLOUT edge TCP owes then
    never came: 3 of 64 clients waited for the rest of their echo."""
    env, server, port = _serve(smcd, ET_SERVER)
    try:
        client = subprocess.run(
            [os.fspath(SMC_RUN), "-v", os.fspath(PYTHON), "-c", ET_CLIENT, str(port)],
            capture_output=True, text=True, env=env, timeout=90,
        )  # fmt: skip
        assert client.returncode == 0, client.stderr[-2000:]
        assert "intact 64" in client.stdout, (client.stdout, client.stderr[-2000:])
        assert re.findall(r"connect .*: (\w+)", client.stderr) == ["smcd"] * 64
    finally:
        server.kill()
        _, err = server.communicate()
    assert "Traceback" not in err, err[-2000:]
