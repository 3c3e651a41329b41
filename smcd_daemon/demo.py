"""``make demo``: smcd end to end, unprivileged or as root, in under 20 seconds.

1. **The handshake bytes.** An SMC-Dv2 loopback-ism CLC exchange (Proposal, Accept, Confirm) built
   by the real encoders, sent over a real loopback TCP connection between two threads, framed as
   the kernel frames it (peek the 8-byte header, read ``length`` bytes), decoded and printed.
2. **A private smcd.** The real daemon (``smcd``) in a temporary runtime directory with its own
   handoff socket and its own private D-Bus bus: nothing system-wide is touched. Readiness is
   its ``READY=1`` on a ``NOTIFY_SOCKET`` of ours, exactly as systemd would see it.
3. **Two applications through smcd.** A server process (``smc_handoff.listen``) and a client
   process (``smc_handoff.connect``) connect over TCP and hand their sockets to the daemon, which
   runs the CLC handshake between them and gives each a shared-memory channel. The client sends
   a few MiB in odd-sized writes (crossing the ring's wrap) and the server's SHA-256 of what
   arrived must equal the client's; both print their mode, which must be ``smcd``.
4. **What the daemon sees.** ``smcctl linkgroup show`` and ``smcctl conns`` against that daemon
   while the connection is open.
5. **One line of throughput.** The same two processes move a fixed volume in 64 KiB writes over
   the channel, and again over plain TCP loopback (plain ``socket``, no smcd).
6. The daemon is stopped with SIGTERM and must exit 0.

Exit status 0 only if every check passed; each failed check prints a ``FAILED:`` line.
``PrivateSmcd`` is also what ``bench/run.py``, ``bench/smcr_vm.py`` and the VM tests' daemon helpers
(``tests/vm/guest/daemons.py``) use to get daemons of their own.

Run: ``python -m smcd_daemon.demo`` (``--role`` is internal: the demo's two application
processes are this module run again).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from smcd_daemon.adapters import private_bus
from smcd_daemon.cli.render import render_text
from smcd_daemon.errors import SmcError
from smcd_daemon.wire import clc

UEID = "SMCD-DEMO-UEID"
SEID = "IBM-SYSZ-ISMSEID00000000"  # the default system EID Linux announces
LOOPBACK_CHID = 0xFFFF
TIMEOUT_S = 10.0

# 128-bit loopback-ism GIDs of the two ends (random in reality; fixed so the output is stable).
CLIENT_GID = 0x1C0FFEE0_00000001_5A5A5A5A_00000001
SERVER_GID = 0x1C0FFEE0_00000002_5A5A5A5A_00000002


def build_proposal() -> clc.Proposal:
    return clc.Proposal(
        typev1=clc.SmcType.N,
        typev2=clc.SmcType.D,
        peer_id=bytes.fromhex("9a3f020000000001"),
        version=2,
        v2_ext=clc.V2Extension(eids=(UEID,), release=1, seid_indicator=True),
        smcd_v2_ext=clc.SmcdV2Extension(
            seid=SEID,
            devices=(clc.IsmDevice.from_gid128(LOOPBACK_CHID, CLIENT_GID),),
        ),
    )


def build_accept() -> clc.Accept:
    return clc.Accept(
        info=clc.SmcdInfo(
            gid=SERVER_GID >> 64,
            gid_ext=SERVER_GID & ((1 << 64) - 1),
            token=0x0000_7F3A_0000_1001,
            link_id=0x00C0_FFEE,
            dmbe_idx=0,
            dmbe_size=2,  # 16 KiB << 2 = 64 KiB
            chid=LOOPBACK_CHID,
        ),
        version=2,
        first_contact=True,
        eid=UEID,
        fce=clc.FirstContactExt(hostname="smcd-demo-server", release=1, v2x=True),
    )


def build_confirm() -> clc.Confirm:
    return clc.Confirm(
        info=clc.SmcdInfo(
            gid=CLIENT_GID >> 64,
            gid_ext=CLIENT_GID & ((1 << 64) - 1),
            token=0x0000_7F3A_0000_2002,
            link_id=0x00C0_FFEE,
            dmbe_idx=0,
            dmbe_size=2,
            chid=LOOPBACK_CHID,
        ),
        version=2,
        first_contact=True,
        eid=UEID,
        fce=clc.FirstContactExt(hostname="smcd-demo-client", release=1, v2x=True),
    )


@dataclass
class Exchange:
    """One message as sent and as it arrived."""

    sender: str
    sent: clc.ClcMessage
    wire: bytes = b""
    received: bytes = b""
    decoded: clc.ClcMessage | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.decoded == self.sent and self.received == self.wire


@dataclass
class Transcript:
    exchanges: list[Exchange] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError(f"peer closed after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


def recv_clc(sock: socket.socket) -> bytes:
    """Frame one CLC message as the kernel does: the 8-byte header says how long it is."""
    first8 = _recv_exact(sock, 8)
    hdr = clc.peek_header(first8)
    return first8 + _recv_exact(sock, hdr.length - 8)


def _send(sock: socket.socket, ex: Exchange) -> None:
    ex.wire = ex.sent.encode()
    sock.sendall(ex.wire)


def _receive(sock: socket.socket, ex: Exchange) -> None:
    ex.received = recv_clc(sock)
    try:
        ex.decoded = clc.decode(ex.received)
    except SmcError as exc:
        ex.error = str(exc)


def run_handshake() -> Transcript:
    proposal = Exchange("client", build_proposal())
    accept = Exchange("server", build_accept())
    confirm = Exchange("client", build_confirm())
    transcript = Transcript([proposal, accept, confirm])

    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(TIMEOUT_S)
    port = listener.getsockname()[1]

    def server() -> None:
        try:
            conn, _ = listener.accept()
            with conn:
                conn.settimeout(TIMEOUT_S)
                _receive(conn, proposal)
                _send(conn, accept)
                _receive(conn, confirm)
        except (OSError, SmcError) as exc:
            transcript.errors.append(f"server: {exc}")

    thread = threading.Thread(target=server, name="clc-server")
    thread.start()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S) as sock:
            _send(sock, proposal)
            _receive(sock, accept)
            _send(sock, confirm)
            sock.shutdown(socket.SHUT_WR)
            sock.recv(1)  # wait for the server to finish reading the Confirm
    except (OSError, SmcError) as exc:
        transcript.errors.append(f"client: {exc}")
    thread.join(TIMEOUT_S * 2)
    listener.close()
    return transcript


def _hex_lines(data: bytes, indent: str = "    ") -> list[str]:
    return [
        f"{indent}{off:04x}  {data[off : off + 16].hex(' ')}" for off in range(0, len(data), 16)
    ]


def show_handshake() -> bool:
    """Section 1: print the CLC exchange; True when every message round-tripped."""
    transcript = run_handshake()
    all_ok = not transcript.errors
    for i, ex in enumerate(transcript.exchanges, 1):
        receiver = "server" if ex.sender == "client" else "client"
        name = type(ex.sent).__name__
        print()
        print(f"[{i}] {ex.sender} -> {receiver}: CLC {name} ({len(ex.wire)} bytes)")
        print("\n".join(_hex_lines(ex.received or ex.wire)))
        if ex.decoded is not None:
            print(f"  decoded by the {receiver}:")
            print(render_text(ex.decoded, indent=4))
        if ex.ok:
            print(f"  OK: {name} decoded equal to what was sent")
        else:
            all_ok = False
            why = ex.error or (
                "nothing arrived" if not ex.received else "differs from what was sent"
            )
            print(f"  FAILED: {name}: {why}")
    for err in transcript.errors:
        print(f"FAILED: {err}")
    return all_ok


# --- a private daemon ---------------------------------------------------------------------------


class DaemonStartError(SmcError):
    """The private smcd did not come up; the message carries its log."""


def _tool(name: str, module: str, func: str) -> list[str]:
    """argv for one of our console scripts: the venv's script next to this interpreter, or the
    same entry point through ``python -c`` when the scripts are not installed."""
    script = Path(sys.executable).parent / name
    if script.exists():
        return [os.fspath(script)]
    return [sys.executable, "-c", f"import sys; from {module} import {func}; sys.exit({func}())"]


def _notified_ready(notify: socket.socket, pid: int) -> bool:
    """Read one datagram from a ``SO_PASSCRED`` notify socket: is it ``READY=1`` from ``pid``
    (as systemd's ``NotifyAccess=main`` sees it)?"""
    creds = struct.calcsize("iII")
    data, ancdata, _flags, _addr = notify.recvmsg(4096, socket.CMSG_SPACE(creds))
    sender = None
    for level, kind, value in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS and len(value) >= creds:
            sender = struct.unpack("iII", value[:creds])[0]
    return sender == pid and b"READY=1" in data.split(b"\n")


@dataclass
class PrivateSmcd:
    """A real ``smcd`` of our own: runtime dir, state dir, handoff socket and a private D-Bus bus
    all under a fresh temporary directory, so it can run next to a system smcd, as root or not.

    ``env`` is what a process needs to use it: ``SMCD_HANDOFF_SOCKET`` for ``smc_handoff`` and
    ``SMCD_BUS``/``SMCD_RUNTIME_DIR`` for ``smcctl``. :meth:`start` is :meth:`launch` then
    :meth:`wait_ready`; the two halves let a caller start several daemons that come up at the
    same time (the VM tests and ``bench/smcr_vm.py``, where each start-up costs tens of seconds),
    and :func:`stop_all` ends several at once.
    """

    log_level: str = "info"
    config_text: str = ""
    """TOML for ``--config`` (empty: smcd's embedded defaults, as an unconfigured user has)."""
    home: Path | None = None
    """Where the configuration, the log and the state dir go, kept after :meth:`cleanup` (a
    test's or a bench's output dir); None: the temporary runtime dir. The sockets always stay in
    the runtime dir, which is local (a shared 9p dir holds no sockets)."""
    name: str = "demo"
    """Names the temporary runtime dir (``smcd-NAME-…``)."""
    command: tuple[str, ...] = ()
    """What runs smcd, its options appended (empty: the installed ``smcd``); a wrapper that
    calls ``smcd_daemon.daemon.main`` in the same process, so that its ``READY=1`` is smcd's
    own (``bench/profile_connections.py`` runs smcd under a profiler)."""
    workdir: Path = field(init=False)
    proc: subprocess.Popen[bytes] | None = field(init=False, default=None)
    _notify: socket.socket | None = field(init=False, default=None, repr=False)

    def __post_init__(self) -> None:
        self.workdir = Path(tempfile.mkdtemp(prefix=f"smcd-{self.name}-"))

    @property
    def files(self) -> Path:
        """The directory of the configuration, log and state (``home`` or the runtime dir)."""
        return self.home if self.home is not None else self.workdir

    @property
    def handoff_socket(self) -> Path:
        return self.workdir / "handoff.sock"

    @property
    def config_path(self) -> Path:
        return self.files / "smcd.toml"

    @property
    def log_path(self) -> Path:
        return self.files / "smcd.log"

    @property
    def bus_address_path(self) -> Path:
        """Where smcd writes the address of its private bus (in the runtime dir)."""
        return self.workdir / "bus.address"

    @property
    def env(self) -> dict[str, str]:
        return {
            "SMCD_HANDOFF_SOCKET": os.fspath(self.handoff_socket),
            "SMCD_BUS": "private",
            "SMCD_RUNTIME_DIR": os.fspath(self.workdir),
        }

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def start(self, timeout: float = 15.0) -> PrivateSmcd:
        """Start smcd and wait for its ``READY=1`` (raises :class:`DaemonStartError`)."""
        self.launch()
        self.wait_ready(timeout)
        return self

    def launch(self) -> None:
        """Start the smcd process (with the configuration written, if any); does not wait."""
        self.files.mkdir(parents=True, exist_ok=True)
        notify_path = self.workdir / "notify.sock"
        notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        notify.bind(os.fspath(notify_path))
        # the sender's credentials: only smcd's own READY=1 counts, as with systemd's default
        # NotifyAccess=main (a child that said READY=1 early once fooled this wait)
        notify.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self._notify = notify
        argv = [
            *(self.command or _tool("smcd", "smcd_daemon.daemon", "main")),
            "--runtime-dir", os.fspath(self.workdir),
            "--state-dir", os.fspath(self.files / "state"),
            "--handoff-socket", os.fspath(self.handoff_socket),
            "--bus", "private",
            "--log-level", self.log_level,
        ]  # fmt: skip
        if self.config_text:
            self.config_path.write_text(self.config_text)
            argv += ["--config", os.fspath(self.config_path)]
        env = {k: v for k, v in os.environ.items() if k not in ("LISTEN_FDS", "LISTEN_PID")}
        env["NOTIFY_SOCKET"] = os.fspath(notify_path)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env
            )

    def wait_ready(self, timeout: float = 15.0) -> None:
        """Wait for the ``READY=1`` of a :meth:`launch`: smcd sends it once its handoff socket
        and its D-Bus service are up. Raises :class:`DaemonStartError` (the daemon stopped, if
        it was still starting) with the log."""
        notify, self._notify = self._notify, None
        if notify is None or self.proc is None:
            raise DaemonStartError("smcd was not launched")
        try:
            deadline = time.monotonic() + timeout
            while True:
                if self.proc.poll() is not None:
                    raise DaemonStartError(
                        f"smcd exited with status {self.proc.returncode} during start-up:\n"
                        + self.log()
                    )
                left = deadline - time.monotonic()
                if left <= 0:
                    self.stop()
                    raise DaemonStartError(f"smcd not ready within {timeout:g} s:\n{self.log()}")
                ready, _, _ = select.select([notify], [], [], min(left, 0.2))
                if ready and _notified_ready(notify, self.proc.pid):
                    return
        finally:
            notify.close()
            with contextlib.suppress(OSError):
                (self.workdir / "notify.sock").unlink()

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM and wait: the exit status (None if it had to be killed or never ran)."""
        return stop_all([self], timeout)[0]

    def cleanup(self) -> None:
        """Stop smcd and remove its runtime dir, ending first the private bus of an smcd that
        died without stopping it (it would outlive the only directory that names it)."""
        if self.proc is not None:
            self.stop()
        if self._notify is not None:
            self._notify.close()
            self._notify = None
        private_bus.end_stale_bus(self.workdir)
        shutil.rmtree(self.workdir, ignore_errors=True)

    def smcctl(self, *args: str, timeout: float = 20.0) -> subprocess.CompletedProcess[str]:
        return self.smcctl_many([list(args)], timeout)[0]

    def smcctl_many(
        self, commands: list[list[str]], timeout: float = 20.0
    ) -> list[subprocess.CompletedProcess[str]]:
        """Run several ``smcctl`` commands against this daemon at once (each is a Python start-up;
        in parallel they cost one)."""
        procs = [
            subprocess.Popen(
                [*_tool("smcctl", "smcd_daemon.cli", "main"), *args],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                stdin=subprocess.DEVNULL,
                text=True,
                env={**os.environ, **self.env},
            )
            for args in commands
        ]
        results = []
        for args, proc in zip(commands, procs, strict=True):
            try:
                out, err = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, err = proc.communicate()
                err += f"\nsmcctl {' '.join(args)}: no answer within {timeout:g} s"
            results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
        return results

    def __enter__(self) -> PrivateSmcd:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.cleanup()


def stop_all(daemons: Iterable[PrivateSmcd], timeout: float = 10.0) -> list[int | None]:
    """SIGTERM every daemon first, then wait for each (they shut down at the same time): the
    exit statuses, as :meth:`PrivateSmcd.stop` gives them."""
    procs = []
    for d in daemons:
        proc, d.proc = d.proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        procs.append(proc)
    statuses: list[int | None] = []
    for proc in procs:
        if proc is None:
            statuses.append(None)
            continue
        try:
            statuses.append(proc.wait(timeout))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            statuses.append(None)
    return statuses


# --- the two application processes -----------------------------------------------------------

DEMO_CONFIG = ""
"""The private daemon's configuration: none, the embedded defaults a new user gets (same-host
SMC-Dv2 needs no UEID: smcd's host-local system EID, ``smcd_daemon.core.eid``)."""

CHECKED_BYTES = 8 * 1024 * 1024 + 12_345
"""Sent with a SHA-256: a few MiB, not a multiple of any ring size, so the writes wrap the ring."""
WRITE_SIZES = (1, 4093, 65_537, 333_333, 7)
"""Odd write sizes the client cycles through for the checked transfer."""
TIMED_BYTES = 128 * 1024 * 1024
TIMED_WRITE = 64 * 1024
DMB_SIZE = 0
"""No size asked for: the daemon's default DMB, what a program that sets no SO_RCVBUF gets."""
ROLE_TIMEOUT = 30.0


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if not k:
            raise ConnectionError(f"early EOF after {got} of {n} bytes")
        got += k
    return bytes(buf)


def _drain(sock: socket.socket, n: int, hasher: Any = None) -> None:
    """Receive exactly ``n`` bytes (into one reused buffer), hashing them when asked."""
    buf = memoryview(bytearray(1 << 20))
    left = n
    while left:
        k = sock.recv_into(buf[: min(left, len(buf))])
        if not k:
            raise ConnectionError(f"early EOF with {left} of {n} bytes missing")
        if hasher is not None:
            hasher.update(buf[:k])
        left -= k


def _describe(sock: socket.socket) -> dict[str, Any]:
    fb = getattr(sock, "fallback", None)
    return {
        "mode": getattr(sock, "mode", "tcp"),
        "conn_id": getattr(sock, "conn_id", None),
        "fallback": None if fb is None else f"{fb.name} 0x{fb.code:08x}: {fb.explanation}",
    }


def _emit(obj: dict[str, Any]) -> None:
    print(json.dumps(obj), flush=True)


def role_server(plain: bool) -> int:
    """Accept one connection, hash the checked transfer, drain the timed one, wait for EOF."""
    if plain:
        lsock: Any = socket.create_server(("127.0.0.1", 0))
        registered: Any = None
    else:
        import smc_handoff

        lsock = smc_handoff.listen(("127.0.0.1", 0), dmb_size=DMB_SIZE)
        registered = lsock.registered
    lsock.settimeout(ROLE_TIMEOUT)
    _emit({"port": lsock.getsockname()[1], "registered": registered})
    conn, _ = lsock.accept()
    with conn:
        conn.settimeout(ROLE_TIMEOUT)
        (length,) = struct.unpack("!Q", _recv_exactly(conn, 8))
        digest = hashlib.sha256()
        _drain(conn, length, digest)
        conn.sendall(digest.digest())
        (timed,) = struct.unpack("!Q", _recv_exactly(conn, 8))
        _drain(conn, timed)
        conn.sendall(b"k")
        _emit({**_describe(conn), "received": length + timed, "sha256": digest.hexdigest()})
        if conn.recv(1):  # the client closes when the demo says so: EOF
            raise ConnectionError("unexpected data instead of EOF")
    lsock.close()
    return 0


def role_client(port: int, plain: bool) -> int:
    """Send the checked transfer and the timed one, report, then wait for "close" on stdin."""
    address = ("127.0.0.1", port)
    if plain:
        sock: Any = socket.create_connection(address, ROLE_TIMEOUT)
    else:
        import smc_handoff

        sock = smc_handoff.connect(address, ROLE_TIMEOUT, dmb_size=DMB_SIZE)
    with sock:
        payload = memoryview(os.urandom(CHECKED_BYTES))
        sock.sendall(struct.pack("!Q", CHECKED_BYTES))
        off = i = 0
        while off < CHECKED_BYTES:
            n = WRITE_SIZES[i % len(WRITE_SIZES)]
            sock.sendall(payload[off : off + n])
            off += n
            i += 1
        mine = hashlib.sha256(payload).hexdigest()
        theirs = _recv_exactly(sock, 32).hex()
        chunk = memoryview(bytes(TIMED_WRITE))
        sock.sendall(struct.pack("!Q", TIMED_BYTES))
        t0 = time.perf_counter()
        for _ in range(TIMED_BYTES // TIMED_WRITE):
            sock.sendall(chunk)
        _recv_exactly(sock, 1)
        seconds = time.perf_counter() - t0
        _emit(
            {
                **_describe(sock),
                "sent": CHECKED_BYTES + TIMED_BYTES,
                "sha256": mine,
                "digest_match": mine == theirs,
                "throughput": TIMED_BYTES / seconds,
            }
        )
        sys.stdin.readline()  # the demo inspects the daemon while we hold the connection open
    return 0


# --- the orchestration ------------------------------------------------------------------------


class _Role:
    """One application process (this module with ``--role``), read line by line with a deadline."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        self.name = " ".join(args)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "smcd_daemon.demo", "--role", *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={**os.environ, **env},
            text=True,
        )

    def read(self, timeout: float = ROLE_TIMEOUT) -> dict[str, Any]:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            raise ConnectionError(f"no report from the {self.name} process: {self.finish(5)}")
        result: dict[str, Any] = json.loads(line)
        return result

    def say(self, text: str) -> None:
        assert self.proc.stdin is not None
        with contextlib.suppress(BrokenPipeError):
            self.proc.stdin.write(text + "\n")
            self.proc.stdin.flush()

    def finish(self, timeout: float = ROLE_TIMEOUT) -> str:
        """Wait for the exit; '' when it exited 0, else what went wrong (with its stderr)."""
        try:
            _, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, err = self.proc.communicate()
            return f"did not exit within {timeout:g} s; stderr: {err.strip()}"
        if self.proc.returncode:
            return f"exit status {self.proc.returncode}; stderr: {err.strip()}"
        return ""

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate()


@contextlib.contextmanager
def _pair(env: dict[str, str], plain: bool) -> Iterator[tuple[_Role, _Role, dict[str, Any]]]:
    flag = ["--plain"] if plain else []
    server = _Role(["server", *flag], env)
    client: _Role | None = None
    try:
        hello = server.read()
        client = _Role(["client", "--port", str(hello["port"]), *flag], env)
        yield server, client, hello
    finally:
        for role in (client, server):
            if role is not None:
                role.kill()


@dataclass
class Checks:
    failures: list[str] = field(default_factory=list)

    def check(self, ok: bool, what: str) -> bool:
        print(f"  {'ok' if ok else 'FAILED'}: {what}")
        if not ok:
            self.failures.append(what)
        return ok


def _gbps(rate: float) -> str:
    return f"{rate / 1e9:.2f} GB/s"


def run_smcd_section(daemon: PrivateSmcd, checks: Checks) -> float | None:
    """Sections 3 and 4: the two applications through smcd; the smcd throughput (or None)."""
    with _pair(daemon.env, plain=False) as (server, client, hello):
        checks.check(
            hello.get("registered") is True,
            f"server listening on 127.0.0.1:{hello['port']}, registered with smcd",
        )
        c = client.read()
        s = server.read()
        print(f"  client: mode {c['mode']}, connection {c['conn_id']}, fallback {c['fallback']}")
        print(f"  server: mode {s['mode']}, connection {s['conn_id']}, fallback {s['fallback']}")
        checks.check(c["mode"] == "smcd" and s["mode"] == "smcd", "both ends are on smcd")
        checks.check(
            c["digest_match"] and c["sha256"] == s["sha256"] and s["received"] == c["sent"],
            f"{CHECKED_BYTES:,} bytes in odd-sized writes arrived intact "
            f"(sha256 {s['sha256'][:16]}…), then {TIMED_BYTES >> 20} MiB more",
        )
        print()
        print("== 4. what smcd sees while the connection is open")
        lg, cs = daemon.smcctl_many([["linkgroup", "show"], ["conns"]])
        print("$ smcctl linkgroup show")
        print((lg.stdout + lg.stderr).rstrip())
        print("$ smcctl conns")
        print((cs.stdout + cs.stderr).rstrip())
        checks.check(
            lg.returncode == 0 and "no link groups" not in lg.stdout,
            "smcctl linkgroup show lists the loopback-ism link group",
        )
        port = f":{hello['port']}"
        rows = [line for line in cs.stdout.splitlines() if port in line]
        checks.check(
            cs.returncode == 0 and len(rows) >= 1 and all("SMCD" in r.upper() for r in rows),
            f"smcctl conns shows the connection to port {hello['port']} on SMCD",
        )
        client.say("close")
        checks.check(not client.finish(), "client closed cleanly")
        checks.check(not server.finish(), "server read EOF and closed cleanly")
        return float(c["throughput"]) if c["mode"] == "smcd" else None


def run_tcp_section() -> float | None:
    """Section 5's baseline: the same processes over plain TCP loopback."""
    with _pair({}, plain=True) as (server, client, _hello):
        c = client.read()
        server.read()
        client.say("close")
        if client.finish() or server.finish() or not c["digest_match"]:
            return None
        return float(c["throughput"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m smcd_daemon.demo", description=__doc__)
    ap.add_argument("--role", choices=["server", "client"], help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--plain", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.role == "server":
        return role_server(args.plain)
    if args.role == "client":
        return role_client(args.port, args.plain)
    return run_demo()


def run_demo() -> int:
    started = time.monotonic()
    checks = Checks()
    who = "root" if os.geteuid() == 0 else f"uid {os.geteuid()}"
    print("== 1. SMC-Dv2 over loopback-ism: the CLC handshake on a real loopback TCP connection")
    checks.check(show_handshake(), "Proposal, Accept and Confirm round-tripped byte for byte")

    print()
    print(f"== 2. a private smcd (as {who}; nothing system-wide is touched)")
    daemon = PrivateSmcd(config_text=DEMO_CONFIG)
    smcd_rate = tcp_rate = None
    try:
        try:
            daemon.start()
        except DaemonStartError as e:
            checks.check(False, f"smcd started: {e}")
            return _verdict(checks, started)
        print(f"  runtime dir {daemon.workdir}, handoff socket {daemon.handoff_socket}")
        print(
            "  no configuration: same-host SMC-Dv2 through smcd's host-local system EID (no "
            "UEID), default buffer sizes"
        )
        checks.check(True, f"smcd ready (pid {daemon.proc.pid if daemon.proc else '?'})")

        print()
        print("== 3. a server and a client process connected through smcd (smc_handoff)")
        try:
            smcd_rate = run_smcd_section(daemon, checks)
        except (OSError, ValueError, KeyError) as e:
            checks.check(False, f"the smcd connection: {e}")

        print()
        print("== 5. throughput, 64 KiB writes between two Python processes")
        try:
            tcp_rate = run_tcp_section()
        except (OSError, ValueError, KeyError) as e:
            print(f"  TCP run failed: {e}")
        for name, rate in (("smcd", smcd_rate), ("TCP loopback", tcp_rate)):
            print(f"  {name}: {_gbps(rate) if rate is not None else 'no figure'}")
        if smcd_rate is not None and tcp_rate is not None:
            print(
                f"  smcd {_gbps(smcd_rate)} vs TCP loopback {_gbps(tcp_rate)}: "
                f"{smcd_rate / tcp_rate:.1f}x ({TIMED_BYTES >> 20} MiB each)"
            )
        checks.check(smcd_rate is not None and tcp_rate is not None, "throughput compared")

        print()
        print("== 6. stopping smcd")
        status = daemon.stop()
        checks.check(status == 0, f"smcd stopped on SIGTERM with status {status}")
        if checks.failures:
            print("--- smcd log ---")
            print(daemon.log().rstrip())
    finally:
        daemon.cleanup()
    return _verdict(checks, started)


def _verdict(checks: Checks, started: float) -> int:
    took = time.monotonic() - started
    print()
    if checks.failures:
        print(f"demo: FAILED ({len(checks.failures)} checks) in {took:.1f} s")
        return 1
    print(f"demo: all checks passed in {took:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
