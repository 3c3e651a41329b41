"""Harness for the handoff end-to-end tests: the real ``.venv/bin/smcd`` and applications that are
separate Python processes using ``smc_handoff``.

- :class:`Smcd` runs the daemon with a configuration in a private temp dir (runtime dir, state,
  handoff socket), on a private real ``dbus-daemon`` (session type) that outlives daemon
  restarts, and waits for its ``READY=1`` on a real ``NOTIFY_SOCKET``.
- :class:`App` is one application process running :data:`APP` (a small scriptable peer): the test
  sends it JSON commands on stdin (listen, accept, connect, send, recv_all, shutdown, close...)
  and reads one JSON answer per command on stdout. Data is a seeded pseudo-random stream sent in
  odd-sized writes, checked end to end with SHA-256.
"""

from __future__ import annotations

import json
import os
import re
import selectors
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.control.daemon_proc import REPO, SMCCTL, NotifySocket, SmcdProcess, smcd_argv
from tests.control.dbusd import DbusDaemon, dbus_daemon

PYTHON = REPO / ".venv" / "bin" / "python"
SMC_RUN = REPO / ".venv" / "bin" / "smc-run"
REPO_ENV = {**os.environ, "PYTHONPATH": os.fspath(REPO)}
"""Environment for child processes: this checkout importable whatever the cwd."""
PROPOSAL_WAIT = 0.3
"""timeouts.proposal_wait of the test daemon: how long a server half waits for a Proposal."""
LOCAL_CLIENT_WAIT = 0.25
"""timeouts.local_client_wait of the test daemon: the same, for a client on this host."""

APP = r"""
import hashlib, json, random, socket, sys, time
import smc_handoff

sock = server = None

def out(**kw):
    sys.stdout.write(json.dumps(kw) + "\n")
    sys.stdout.flush()

def describe(s):
    f = s.fallback
    fb = None if f is None else {"code": f.code, "name": f.name, "explanation": f.explanation,
                                 "peer_diagnosis": f.peer_diagnosis}
    return {"mode": s.mode, "fallback": fb, "conn_id": getattr(s, "conn_id", None)}

def stream(n, seed, chunk):
    rng = random.Random(seed)
    while n > 0:
        k = min(n, chunk)
        yield rng.randbytes(k)
        n -= k

for line in sys.stdin:
    cmd = json.loads(line)
    op = cmd["op"]
    t0 = time.monotonic()
    try:
        if op == "listen":
            server = smc_handoff.listen(("127.0.0.1", cmd.get("port", 0)))
            out(port=server.getsockname()[1], registered=server.registered,
                fallback=None if server.fallback is None else server.fallback.code)
        elif op == "accept":
            sock, _ = server.accept()
            out(elapsed=time.monotonic() - t0, **describe(sock))
        elif op == "connect":
            sock = smc_handoff.connect(("127.0.0.1", cmd["port"]), timeout=cmd.get("timeout"))
            out(**describe(sock))
        elif op == "send":
            h = hashlib.sha256()
            sent = 0
            for piece in stream(cmd["n"], cmd.get("seed", 1), cmd.get("chunk", 65521)):
                sock.sendall(piece)
                h.update(piece)
                sent += len(piece)
                if cmd.get("pace"):
                    time.sleep(cmd["pace"])
            out(sent=sent, sha=h.hexdigest())
        elif op == "sendbytes":
            sock.sendall(cmd["data"].encode("latin-1"))
            out(ok=True)
        elif op == "recv":
            buf = b""
            while len(buf) < cmd["n"]:
                piece = sock.recv(cmd["n"] - len(buf))
                if not piece:
                    break
                buf += piece
            out(data=buf.decode("latin-1"))
        elif op == "recv_all":
            h = hashlib.sha256()
            n = 0
            try:
                while True:
                    piece = sock.recv(262144)
                    if not piece:
                        break
                    h.update(piece)
                    n += len(piece)
                out(n=n, sha=h.hexdigest(), eof=True, elapsed=time.monotonic() - t0)
            except OSError as e:
                out(n=n, error=type(e).__name__, elapsed=time.monotonic() - t0)
        elif op == "shutdown":
            sock.shutdown(getattr(socket, cmd.get("how", "SHUT_WR")))
            out(ok=True)
        elif op == "close":
            sock.close()
            out(ok=True)
        elif op in ("bg_recv", "bg_send"):
            # A second thread blocked in recv() or in sendall() of n bytes (the peer does not
            # read), for a close() from this one: "bg_result" says how that call ended.
            import threading
            def _bg(call):
                try:
                    got = call()
                    bg_out.update(ok=True, n=len(got) if isinstance(got, bytes) else None)
                except Exception as e:
                    bg_out.update(error=type(e).__name__, errno=getattr(e, "errno", None))
            bg_out = {}
            work = (lambda: sock.recv(100)) if op == "bg_recv" else (
                lambda: sock.sendall(bytes(cmd["n"])))
            bg = threading.Thread(target=_bg, args=(work,), daemon=True)
            bg.start()
            time.sleep(cmd.get("settle", 0.3))  # it is blocked by now
            out(ok=True)
        elif op == "bg_result":
            bg.join(cmd.get("timeout", 5))
            out(alive=bg.is_alive(), **bg_out)
        elif op == "fileno":  # what a poller does first: the channel goes to level mode
            out(fd=sock.fileno())
        elif op == "tcp_state":
            # The TCP socket under the channel, as TCP_INFO's tcpi_state (1 ESTABLISHED, 4/5
            # FIN_WAIT1/2, 8 CLOSE_WAIT), asked of the descriptor itself, not of fileno().
            import _socket
            info = _socket.socket.getsockopt(sock, socket.IPPROTO_TCP, socket.TCP_INFO, 8)
            out(state=info[0])
        elif op == "dmbs":
            # The DMBs this process maps (the channel maps both of its connection): inode and
            # how many bytes of the ring (after the 32-byte CDC header) are not zero, read
            # straight from the mapping.
            import ctypes
            dmbs = []
            for ln in open("/proc/self/maps"):
                if "/memfd:smcd-dmb" not in ln:
                    continue
                span, _, _, _, inode = ln.split()[:5]
                lo, hi = (int(x, 16) for x in span.split("-"))
                size = max(s for s in (16384 << k for k in range(7)) if s + 128 <= hi - lo)
                ring = ctypes.string_at(lo + 32, size - 32)
                dmbs.append({"inode": int(inode), "size": size,
                             "nonzero": len(ring) - ring.count(0)})
            out(dmbs=dmbs)
        elif op == "exit":
            out(ok=True)
            break
        else:
            out(error="unknown op " + op)
    except Exception as e:
        out(error=type(e).__name__, message=str(e), elapsed=time.monotonic() - t0)
"""


class App:
    """One application process speaking the JSON command protocol of :data:`APP`."""

    def __init__(self, handoff: Path | str, name: str = "app", user: int | None = None) -> None:
        env = dict(os.environ)
        env["SMCD_HANDOFF_SOCKET"] = os.fspath(handoff)
        env["PYTHONPATH"] = os.fspath(REPO)
        self.name = name
        self.proc = subprocess.Popen(
            [os.fspath(PYTHON), "-c", APP],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            cwd=REPO,
            user=user,
            group=user,
            extra_groups=[] if user is not None else None,
        )
        self._sel = selectors.DefaultSelector()
        assert self.proc.stdout is not None
        self._sel.register(self.proc.stdout, selectors.EVENT_READ)
        self._buf = b""

    def send(self, op: str, **kw: Any) -> None:
        """Send a command without waiting for its answer (e.g. a blocking ``accept``)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps({"op": op, **kw}) + "\n").encode())
        self.proc.stdin.flush()

    def reply(self, timeout: float = 20.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not self._sel.select(left):
                raise AssertionError(f"{self.name}: no answer within {timeout} s")
            chunk = os.read(fd, 65536)
            if not chunk:
                err = self.proc.stderr.read().decode() if self.proc.stderr else ""
                raise AssertionError(f"{self.name} exited ({self.proc.wait()}): {err}")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        result: dict[str, Any] = json.loads(line)
        return result

    def call(self, op: str, timeout: float = 20.0, **kw: Any) -> dict[str, Any]:
        self.send(op, **kw)
        return self.reply(timeout)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if f is not None:
                f.close()
        self._sel.close()


class Smcd:
    """The real smcd with a private runtime dir; ``config_extra`` is appended to its TOML."""

    def __init__(self, work: Path, bus: DbusDaemon, notify: NotifySocket) -> None:
        self.work = work
        self.bus = bus
        self.notify = notify
        self.config = work / "smcd.toml"
        self.proc: SmcdProcess | None = None
        self.starts = 0
        self.write_config()

    @property
    def address(self) -> str:
        return f"unix:path={self.bus.socket_path}"

    @property
    def handoff(self) -> Path:
        return self.work / "run" / "handoff.sock"

    def write_config(
        self,
        extra: str = "",
        *,
        proposal_wait: float = PROPOSAL_WAIT,
        local_client_wait: float = LOCAL_CLIENT_WAIT,
    ) -> None:
        """``extra`` goes on in ``[timeouts]``."""
        self.config.write_text(
            f'runtime_dir = "{self.work}/run"\n'
            f'state_dir = "{self.work}/state"\n'
            'log_level = "info"\n'
            f'[dbus]\nbus = "{self.address}"\n'
            '[eid]\nueids = ["SMCD-E2E"]\n'
            f"[timeouts]\nproposal_wait = {proposal_wait}\n"
            f"local_client_wait = {local_client_wait}\n"
            f"{extra}"
        )

    def start(self) -> Smcd:
        self.starts += 1
        argv = smcd_argv(self.config)
        self.proc = SmcdProcess(argv, self.work / f"smcd-{self.starts}.log", self.notify)
        self.proc.start()
        self.proc.wait_ready()
        return self

    def reload(self, extra: str = "") -> None:
        """Rewrite the configuration and SIGHUP the daemon; returns once it is READY again."""
        import signal

        assert self.proc is not None
        self.write_config(extra)
        self.notify.clear()
        self.proc.signal(signal.SIGHUP)
        self.notify.wait_for("READY", "1")

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.proc.kill()
        self.proc.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.alive():
            self.proc.stop()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.alive()

    def log(self) -> str:
        return "" if self.proc is None else self.proc.log()

    def wait_log(self, *texts: str, since: int = 0, timeout: float = 10.0) -> str:
        """The log from ``since`` once it holds one of ``texts``: the daemon logs an outcome
        after it answered, so an application can see it before the line is written."""
        deadline = time.monotonic() + timeout
        while True:
            log = self.log()[since:]
            if any(text in log for text in texts) or time.monotonic() > deadline:
                return log
            time.sleep(0.05)

    def fds(self) -> dict[str, int]:
        """What the daemon holds, by kind: ``memfd`` (DMBs), ``eventfd``, ``socket``, ``all``;
        ``inodes`` is not a count but the set of its DMB memfd inodes."""
        assert self.proc is not None
        pid = self.proc.proc.pid
        kinds: dict[str, Any] = {"memfd": 0, "eventfd": 0, "socket": 0, "all": 0, "inodes": set()}
        for name in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{name}")
                if target.startswith("/memfd:smcd-dmb"):
                    kinds["inodes"].add(os.stat(f"/proc/{pid}/fd/{name}").st_ino)
            except FileNotFoundError:
                continue
            kinds["all"] += 1
            if target.startswith("/memfd:smcd-dmb"):
                kinds["memfd"] += 1
            elif target == "anon_inode:[eventfd]":
                kinds["eventfd"] += 1
            elif target.startswith("socket:"):
                kinds["socket"] += 1
        return kinds

    _POOL_LINE = re.compile(
        r"no SMC connection left; DMB pool: (\d+) buffers in use \((\d+) bytes\), (\d+) cached"
    )

    def pool_report(self, since: int, timeout: float = 20.0) -> tuple[int, int, int]:
        """(buffers in use, bytes in use, buffers cached) as the daemon reports its DMB pool
        once its last SMC connection is gone, from what it logged after ``since`` characters."""
        deadline = time.monotonic() + timeout
        while True:
            found = self._POOL_LINE.findall(self.log()[since:])
            if found:
                in_use, in_use_bytes, cached = map(int, found[-1])
                return in_use, in_use_bytes, cached
            if time.monotonic() > deadline:
                raise AssertionError("the daemon never reported its pool after the last close")
            time.sleep(0.1)

    def smcctl(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [os.fspath(SMCCTL), *args, "--bus", self.address],
            capture_output=True,
            text=True,
            timeout=20,
        )

    def smcctl_json(self, *args: str) -> Any:
        r = self.smcctl(*args, "--json")
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)

    def wait_conns(self, pred: Any, timeout: float = 5.0) -> list[dict[str, Any]]:
        """Poll ``smcctl conns --json`` until ``pred(rows)`` holds; return those rows."""
        deadline = time.monotonic() + timeout
        while True:
            rows = self.smcctl_json("conns")
            if pred(rows):
                return list(rows)
            if time.monotonic() > deadline:
                raise AssertionError(f"smcctl conns never matched; last: {rows}")
            time.sleep(0.1)


@pytest.fixture(scope="session")
def e2e_bus() -> Iterator[DbusDaemon]:
    if os.geteuid() != 0:
        pytest.fail("the handoff end-to-end tests run as root here and in CI")
    if shutil.which("dbus-daemon") is None:
        pytest.fail("dbus-daemon is missing: install it with tests/host/install-deps.sh")
    with dbus_daemon("session") as bus:
        yield bus


@pytest.fixture(scope="module")
def work() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="smcd-e2e-handoff-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def smcd(work: Path, e2e_bus: DbusDaemon) -> Iterator[Smcd]:
    notify = NotifySocket(work / "notify")
    daemon = Smcd(work, e2e_bus, notify)
    daemon.start()
    try:
        yield daemon
    finally:
        daemon.stop()
        notify.close()


@pytest.fixture
def apps(smcd: Smcd) -> Iterator[Any]:
    """A factory of :class:`App` processes talking to the module's daemon; all are killed at the
    end of the test."""
    made: list[App] = []

    def make(name: str = "app", handoff: Path | str | None = None, user: int | None = None) -> App:
        app = App(handoff if handoff is not None else smcd.handoff, name, user)
        made.append(app)
        return app

    yield make
    for app in made:
        app.close()


def pair(make: Any) -> tuple[App, App, int]:
    """A server app listening (registered with smcd) and a client app, connected over SMC-D."""
    server, client = make("server"), make("client")
    listening = server.call("listen")
    assert listening["registered"], listening
    server.send("accept")
    c = client.call("connect", port=listening["port"])
    s = server.reply()
    assert c["mode"] == "smcd" and c["fallback"] is None, c
    assert s["mode"] == "smcd" and s["fallback"] is None, s
    return server, client, listening["port"]


__all__ = ["APP", "PROPOSAL_WAIT", "PYTHON", "REPO_ENV", "SMC_RUN", "App", "Smcd", "pair"]
