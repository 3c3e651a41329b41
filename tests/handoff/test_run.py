"""smc-run: unmodified stdlib programs (http.server, http.client) with upgraded sockets."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from smc_handoff import launch
from tests.handoff.test_socket import MiniDaemon

REPO = Path(__file__).resolve().parents[2]
SMC_RUN = [sys.executable, "-m", "smc_handoff.run"]

CLIENT = """
import http.client, sys
c = http.client.HTTPConnection("127.0.0.1", int(sys.argv[1]), timeout=10)
c.request("GET", "/hello.txt")
r = c.getresponse()
body = r.read()
print(r.status, body.decode(), flush=True)
"""


def _env(handoff: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["SMCD_HANDOFF_SOCKET"] = str(handoff)
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("PYTHONPATH", None)
    return env


@pytest.fixture
def web(tmp_path: Path) -> Path:
    root = tmp_path / "www"
    root.mkdir()
    (root / "hello.txt").write_text("hello over smc-run\n" * 1000)
    return root


def _serve_and_fetch(handoff: Path, root: Path) -> tuple[str, str, str]:
    """smc-run -v python -m http.server, then smc-run -v an http.client fetch against it."""
    env = _env(handoff)
    server = subprocess.Popen(
        [*SMC_RUN, "-v", "-m", "http.server", "0", "--bind", "127.0.0.1", "--directory", str(root)],
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None and server.stderr is not None
        line = server.stdout.readline()
        port = re.search(r"port (\d+)", line)
        assert port, f"http.server said {line!r}; stderr {server.stderr.read()}"
        client = subprocess.run(
            [*SMC_RUN, "-v", sys.executable, "-c", CLIENT, port.group(1)],
            env=env,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert client.returncode == 0, client.stderr
    finally:
        server.terminate()
        _, server_err = server.communicate(timeout=10)
    return client.stdout, client.stderr, server_err


def test_http_server_and_client_without_daemon(tmp_path: Path, web: Path) -> None:
    out, client_err, server_err = _serve_and_fetch(tmp_path / "absent.sock", web)
    assert out == "200 " + "hello over smc-run\n" * 1000 + "\n"
    assert re.search(r"connect \('127.0.0.1', \d+\): tcp \(DAEMON_UNAVAILABLE", client_err)
    assert re.search(r"listen \('127.0.0.1', \d+\): tcp \(DAEMON_UNAVAILABLE", server_err)
    assert '"GET /hello.txt HTTP/1.1" 200' in server_err


def test_http_server_and_client_on_a_channel(tmp_path: Path, web: Path) -> None:
    """With a daemon handing over channels, both sides of the same programs move to smcd."""
    daemon = MiniDaemon(tmp_path / "h.sock")
    try:
        out, client_err, server_err = _serve_and_fetch(daemon.path, web)
    finally:
        daemon.stop()
    assert out == "200 " + "hello over smc-run\n" * 1000 + "\n"
    assert re.search(r"connect \('127.0.0.1', \d+\): smcd conn \d+$", client_err, re.M)
    assert re.search(r"listen \('127.0.0.1', \d+\): registered as listener \d+", server_err)
    assert re.search(r"accept \('127.0.0.1', \d+\): smcd conn \d+", server_err)
    assert '"GET /hello.txt HTTP/1.1" 200' in server_err


def test_help_and_usage_errors() -> None:
    done = subprocess.run([*SMC_RUN, "--help"], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0
    for text in (
        "usage: smc-run",
        "-m MODULE",
        "-c COMMAND",
        "-d, --debug",
        "-v, --verbose",
        "SMCD_HANDOFF_SOCKET",
    ):
        assert text in done.stdout
    for argv, message in (
        ([], "no program given"),
        (["-x", "prog"], "unknown option -x"),
        (["-m"], "-m needs an argument"),
        (["no-such-program-anywhere"], "command not found"),
    ):
        done = subprocess.run([*SMC_RUN, *argv], cwd=REPO, capture_output=True, text=True)
        assert done.returncode == 2 and message in done.stderr and "usage:" in done.stderr


def test_command_line_parsing(tmp_path: Path) -> None:
    script = tmp_path / "prog.py"
    script.write_text("print('hi')\n")
    assert launch.command_line(["-vd", str(script), "a"]) == (
        [sys.executable, str(script), "a"],
        True,
        True,
    )
    assert launch.command_line(["-mhttp.server", "8000"]) == (
        [sys.executable, "-m", "http.server", "8000"],
        False,
        False,
    )
    assert launch.command_line(["--", "python3", "-V"]) == (["python3", "-V"], False, False)


def test_debug_and_plain_socket_behaviour(tmp_path: Path) -> None:
    """Under smc-run, socket.socket is the upgrading class, non-TCP sockets are untouched and
    the program's own sitecustomize still runs (chained)."""
    own = tmp_path / "own"
    own.mkdir()
    (own / "sitecustomize.py").write_text("import builtins; builtins.OWN_SITE = True\n")
    code = (
        "import builtins, socket\n"
        "from smc_handoff.run import AutoSocket\n"
        "assert socket.socket is AutoSocket\n"
        "a, b = socket.socketpair()\n"
        "a.sendall(b'x'); assert b.recv(1) == b'x'\n"
        "print('own site', getattr(builtins, 'OWN_SITE', False))\n"
    )
    env = _env(tmp_path / "absent.sock")
    env["PYTHONPATH"] = str(own)
    done = subprocess.run(
        [*SMC_RUN, "-d", "-c", code], env=env, cwd=REPO, capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "own site True\n"
    assert "handoff socket:" in done.stderr


TLS_SERVER = """
import socket, ssl, sys
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
ctx.load_cert_chain(sys.argv[1], sys.argv[2])
listener = socket.create_server(("127.0.0.1", 0))
print(listener.getsockname()[1], flush=True)
conn, _ = listener.accept()
print("server", conn.mode, flush=True)
tls = ctx.wrap_socket(conn, server_side=True)
tls.sendall(tls.recv(100).upper())
tls.close()
"""

TLS_CLIENT = """
import socket, ssl, sys
ctx = ssl.create_default_context(cafile=sys.argv[1])
ctx.check_hostname = False
s = socket.create_connection(("127.0.0.1", int(sys.argv[2])))
print("client", s.mode, flush=True)
tls = ctx.wrap_socket(s)
tls.sendall(b"hello tls")
print(tls.recv(100).decode(), tls.mode, tls.version(), flush=True)
"""


def test_tls_programs_keep_the_channel_and_work(tmp_path: Path) -> None:
    """ssl takes upgraded sockets over and TLS runs over their channel (smc_handoff.tls): the
    SSLSocket is on smcd, as the connection was."""
    openssl = shutil.which("openssl")
    assert openssl, "openssl is needed to make a test certificate (apt-get install openssl)"
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        [
            openssl,
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
        ],
        check=True,
        capture_output=True,
    )
    daemon = MiniDaemon(tmp_path / "h.sock")
    env = _env(daemon.path)
    try:
        server = subprocess.Popen(
            [*SMC_RUN, sys.executable, "-c", TLS_SERVER, str(cert), str(key)],
            env=env,
            cwd=REPO,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert server.stdout is not None
        port = server.stdout.readline().strip()
        client = subprocess.run(
            [*SMC_RUN, "-v", sys.executable, "-c", TLS_CLIENT, str(cert), port],
            env=env,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=30,
        )
        out, _ = server.communicate(timeout=10)
    finally:
        daemon.stop()
    assert client.stdout == "client smcd\nHELLO TLS smcd TLSv1.3\n", client.stderr
    assert out == "server smcd\n"
    # -v said smcd at connect; it says so again for TLS
    lines = [ln.split(": ", 1)[1] for ln in client.stderr.splitlines() if ln.startswith("smc-run[")]
    assert [ln.split(")", 1)[0] for ln in lines] == [
        f"connect ('127.0.0.1', {port}",
        f"ssl ('127.0.0.1', {port}",
    ], client.stderr
    assert lines[0].endswith(": smcd") or ": smcd conn " in lines[0], client.stderr
    assert lines[1].split(": ", 1)[1] == lines[0].split(": ", 1)[1], client.stderr
