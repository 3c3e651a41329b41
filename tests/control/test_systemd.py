"""systemd integration: the unit files, sd_notify/watchdog, socket activation, logging.

Everything runs against the real thing: systemd-analyze on the shipped units, a real
NOTIFY_SOCKET datagram socket, systemd-socket-activate, a real dbus-daemon reading the bus
activation file, and the real journal protocol on a journal socket in a private mount namespace.
"""

from __future__ import annotations

import configparser
import contextlib
import itertools
import json
import logging
import os
import re
import shutil
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from smcd_daemon.adapters import systemd as sd
from smcd_daemon.config import SYSTEM_PATHS, load_config

ROOT = Path(__file__).resolve().parents[2]
UNITS = ROOT / "units"
DBUS_ACTIVATION = ROOT / "config" / "dbus-1" / "system-services" / "org.smcd.service"
PY = sys.executable


def _need(tool: str) -> str:
    path = shutil.which(tool)
    assert path, f"{tool} is missing: run tests/host/install-deps.sh (Debian package 'systemd')"
    return path


def _child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NOTIFY_", "LISTEN_"))}
    env.pop("JOURNAL_STREAM", None)
    env.pop("WATCHDOG_USEC", None)
    env.pop("WATCHDOG_PID", None)
    env["PYTHONPATH"] = str(ROOT)
    env.update(extra)
    return env


def _unit(name: str) -> configparser.RawConfigParser:
    p = configparser.RawConfigParser(strict=False, interpolation=None)
    p.optionxform = str  # type: ignore[assignment,method-assign]
    p.read(UNITS / name if "/" not in name else ROOT / name)
    return p


# ----------------------------------------------------------------------------- unit files


def _verify_with_smcd_installed(tmp_path: Path, *units: Path) -> subprocess.CompletedProcess[str]:
    """Run ``systemd-analyze verify`` on the real unit files with /usr/bin/smcd present.

    verify checks that ExecStart's binary exists; smcd is not installed on the test host, so a
    private mount namespace lays an overlay over /usr/bin that adds a real executable smcd
    (a wrapper running this checkout's daemon). The unit files themselves are untouched.
    """
    extra = tmp_path / "bin"
    extra.mkdir()
    wrapper = extra / "smcd"
    wrapper.write_text(f'#!/bin/sh\nPYTHONPATH={ROOT} exec {PY} -m smcd_daemon.daemon "$@"\n')
    wrapper.chmod(0o755)
    script = (
        f"mount -t overlay overlay -o lowerdir={extra}:/usr/bin /usr/bin && "
        "test -x /usr/bin/smcd && "
        "exec systemd-analyze verify --man=no " + " ".join(str(u) for u in units)
    )
    return subprocess.run(
        [_need("unshare"), "--mount", "sh", "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_units_verify_without_warnings(tmp_path: Path) -> None:
    _need("systemd-analyze")
    r = _verify_with_smcd_installed(tmp_path, UNITS / "smcd.service", UNITS / "smcd.socket")
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""
    assert r.stdout == ""


def test_verify_check_would_see_a_bad_directive(tmp_path: Path) -> None:
    """Control for the test above: verify exits 0 on warnings, only stderr shows them."""
    bad = tmp_path / "units" / "smcd.service"
    bad.parent.mkdir()
    bad.write_text(
        (UNITS / "smcd.service").read_text().replace("ProtectHome=yes", "ProtectHome=maybe")
    )
    r = _verify_with_smcd_installed(tmp_path, bad)
    assert "protect home value, ignoring: maybe" in r.stderr
    assert r.returncode == 0  # which is why the real test asserts an empty stderr


def test_service_hardening_and_exposure() -> None:
    svc = _unit("smcd.service")["Service"]
    expect = {
        "Type": "notify",
        "NotifyAccess": "main",
        "BusName": "org.smcd",
        "Restart": "on-failure",
        "ExecStart": "/usr/bin/smcd --config /etc/smcd/smcd.toml",
        "ExecReload": "kill -HUP $MAINPID",
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "ProtectHome": "yes",
        "PrivateTmp": "yes",
        "RuntimeDirectory": "smcd",
        "StateDirectory": "smcd",
        "ConfigurationDirectory": "smcd",
        "RestrictAddressFamilies": "AF_UNIX AF_NETLINK AF_INET AF_INET6",
        "CapabilityBoundingSet": "CAP_BPF CAP_NET_ADMIN",  # peer detection, nothing more
        "AmbientCapabilities": "CAP_BPF CAP_NET_ADMIN",
        "LimitMEMLOCK": "infinity",
        "MemoryDenyWriteExecute": "yes",
        "SystemCallArchitectures": "native",
    }
    assert {k: svc.get(k) for k in expect} == expect
    assert re.fullmatch(r"\d+s", svc["WatchdogSec"])
    # The paths in the units are the ones the shipped configuration names.
    shipped = load_config(ROOT / "config" / "smcd.toml")
    assert Path("/run") / svc["RuntimeDirectory"] == shipped.runtime_dir
    assert Path("/var/lib") / svc["StateDirectory"] == shipped.state_dir
    sock = _unit("smcd.socket")["Socket"]
    assert Path(sock["ListenSequentialPacket"]) == shipped.handoff_socket
    assert shipped.handoff_socket == SYSTEM_PATHS["handoff_socket"]
    assert (sock["SocketMode"], sock["Service"]) == ("0666", "smcd.service")
    # systemd's own exposure score for the hardening (0 = locked down, 10 = none).
    r = subprocess.run(
        [_need("systemd-analyze"), "security", "--offline=yes", str(UNITS / "smcd.service")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    m = re.search(r"Overall exposure level for smcd.service: ([\d.]+)", r.stdout)
    assert m, r.stdout + r.stderr
    assert float(m.group(1)) <= 2.5


def test_capabilities_and_families_are_justified_in_comments() -> None:
    text = (UNITS / "smcd.service").read_text()
    for word in ("CAP_NET_ADMIN", "CAP_IPC_LOCK", "CAP_NET_RAW", "CAP_SYS_ADMIN"):
        assert re.search(rf"^#.*{word}", text, re.M), f"{word}: say why it is not needed"
    for fam in ("AF_UNIX", "AF_NETLINK", "AF_INET"):
        assert re.search(rf"^#\s+{fam}", text, re.M), f"{fam}: say why it is needed"


@pytest.fixture
def dbus_daemon(tmp_path: Path) -> Iterator[str]:
    """A session-type dbus-daemon whose service directory holds our D-Bus activation file."""
    services = tmp_path / "services"
    services.mkdir()
    shutil.copy(DBUS_ACTIVATION, services / "org.smcd.service")
    sock = tmp_path / "bus"
    conf = tmp_path / "bus.conf"
    conf.write_text(
        textwrap.dedent(
            f"""\
            <!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-Bus Bus Configuration 1.0//EN"
             "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">
            <busconfig>
              <type>session</type>
              <listen>unix:path={sock}</listen>
              <auth>EXTERNAL</auth>
              <servicedir>{services}</servicedir>
              <policy context="default">
                <allow send_destination="*" eavesdrop="true"/>
                <allow eavesdrop="true"/>
                <allow own="*"/>
              </policy>
            </busconfig>
            """
        )
    )
    proc = subprocess.Popen(
        [_need("dbus-daemon"), f"--config-file={conf}", "--nofork", "--print-address"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        address = proc.stdout.readline().strip()
        assert address.startswith("unix:"), address
        yield address
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_dbus_activation_file_is_read_by_dbus_daemon(dbus_daemon: str) -> None:
    r = subprocess.run(
        [
            _need("busctl"),
            f"--address={dbus_daemon}",
            "--json=short",
            "call",
            "org.freedesktop.DBus",
            "/org/freedesktop/DBus",
            "org.freedesktop.DBus",
            "ListActivatableNames",
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 0, r.stderr
    assert "org.smcd" in json.loads(r.stdout)["data"][0]
    act = _unit("config/dbus-1/system-services/org.smcd.service")["D-BUS Service"]
    # dbus-daemon asks systemd for SystemdService=, which smcd.service provides as an alias.
    install = _unit("smcd.service")["Install"]
    assert act["SystemdService"] in install["Alias"].split()
    assert act["User"] == "root"


# ----------------------------------------------------------------------------- sd_notify

NOTIFY_CHILD = textwrap.dedent(
    """\
    import asyncio, time
    from smcd_daemon.adapters import systemd as sd

    async def main():
        assert sd.notify(READY=1, STATUS="serving")
        stop = asyncio.Event()
        wd = asyncio.create_task(sd.run_watchdog(stop))
        await asyncio.sleep(0.85)
        assert sd.notify(STOPPING=True, STATUS="bye\\nnow")
        stop.set()
        await wd

    asyncio.run(main())
    """
)


def _receive_all(sock: socket.socket, proc: subprocess.Popen[bytes]) -> list[tuple[float, str]]:
    got: list[tuple[float, str]] = []
    sock.settimeout(0.2)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            data = sock.recv(4096)
        except TimeoutError:
            if proc.poll() is not None:
                break
            continue
        got.append((time.monotonic(), data.decode()))
    return got


@pytest.mark.parametrize("kind", ["path", "abstract"])
def test_notify_and_watchdog(tmp_path: Path, kind: str) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as listener:
        if kind == "path":
            address: str | bytes = str(tmp_path / "notify")
            env_value = str(address)
        else:
            name = f"smcd-test-notify-{os.getpid()}-{time.monotonic_ns()}"
            address = b"\0" + name.encode()
            env_value = "@" + name
        listener.bind(address)
        proc = subprocess.Popen(
            [PY, "-c", NOTIFY_CHILD],
            env=_child_env(NOTIFY_SOCKET=env_value, WATCHDOG_USEC="200000"),
            stderr=subprocess.PIPE,
        )
        got = _receive_all(listener, proc)
        _, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err.decode()
    messages = [m for _, m in got]
    assert messages[0] == "READY=1\nSTATUS=serving"
    assert messages[-1] == "STOPPING=1\nSTATUS=bye now"  # a newline cannot forge a field
    pings = [t for t, m in got if m == "WATCHDOG=1"]
    # 0.85 s of pings every 0.1 s (half of WATCHDOG_USEC=0.2 s): about 9.
    assert 5 <= len(pings) <= 11, messages
    gaps = [b - a for a, b in itertools.pairwise(pings)]
    mean = sum(gaps) / len(gaps)
    assert 0.08 <= mean <= 0.15, gaps  # half of 0.2 s, clearly not 0.2 s


def test_notify_is_a_noop_without_notify_socket(tmp_path: Path) -> None:
    assert sd.notify(env={}, READY=1) is False
    assert sd.notify(env={"NOTIFY_SOCKET": "vsock:2:1234"}, READY=1) is False
    # A socket that nobody listens on is not fatal either.
    assert sd.notify(env={"NOTIFY_SOCKET": str(tmp_path / "gone")}, READY=1) is False


def test_watchdog_interval_rules() -> None:
    me = str(os.getpid())
    assert sd.watchdog_interval({}) is None
    assert sd.watchdog_interval({"WATCHDOG_USEC": "20000000"}) == 10.0
    assert sd.watchdog_interval({"WATCHDOG_USEC": "20000000", "WATCHDOG_PID": me}) == 10.0
    assert sd.watchdog_interval({"WATCHDOG_USEC": "20000000", "WATCHDOG_PID": "1"}) is None
    assert sd.watchdog_interval({"WATCHDOG_USEC": "0"}) is None
    assert sd.watchdog_interval({"WATCHDOG_USEC": "junk"}) is None


def test_run_watchdog_returns_at_once_without_watchdog() -> None:
    import asyncio

    async def go() -> float:
        t = time.monotonic()
        await asyncio.wait_for(sd.run_watchdog(asyncio.Event(), env={}), 1)
        return time.monotonic() - t

    assert asyncio.run(go()) < 0.5


# ----------------------------------------------------------------------------- LISTEN_FDS

LISTEN_CHILD = textwrap.dedent(
    """\
    import json, os, socket
    from smcd_daemon.adapters import systemd as sd
    named = sd.listen_fds_named()
    info = [
        {"name": n, "fd": s.fileno(), "family": int(s.family), "type": int(s.type),
         "addr": s.getsockname(), "inheritable": s.get_inheritable()}
        for n, s in named
    ]
    env_left = [k for k in ("LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES") if k in os.environ]
    chosen = sd.select_listener([s for _, s in named], os.environ["WANT"])
    if chosen is not None:
        conn, _ = chosen.accept()
        conn.send(b"hello from " + str(chosen.fileno()).encode())
        conn.close()
    print(json.dumps({"socks": info, "env_left": env_left, "chosen": chosen is not None}))
    """
)


def test_socket_activation_with_systemd_socket_activate(tmp_path: Path) -> None:
    path = str(tmp_path / "handoff.sock")
    proc = subprocess.Popen(
        [
            _need("systemd-socket-activate"),
            "--seqpacket",
            "-l",
            path,
            "--fdname=handoff",
            "-E",
            f"WANT={path}",
            "-E",
            f"PYTHONPATH={ROOT}",
            PY,
            "-c",
            LISTEN_CHILD,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=_child_env(),
    )
    try:
        deadline = time.monotonic() + 10
        while not os.path.exists(path):
            assert time.monotonic() < deadline, "systemd-socket-activate did not listen"
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.02)
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as c:
            c.settimeout(10)
            c.connect(path)  # the first connection makes it spawn the child
            assert c.recv(100) == b"hello from 3"
        out, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err.decode()
    result = json.loads(out)
    assert result["socks"] == [
        {
            "name": "handoff",
            "fd": 3,
            "family": socket.AF_UNIX,
            "type": socket.SOCK_SEQPACKET,
            "addr": path,
            "inheritable": False,
        }
    ]
    assert result["env_left"] == []
    assert result["chosen"] is True


def _inherit(tmp_path: Path, listen_pid: str) -> dict[str, object]:
    """Start the child with a bound socket at fd 3 the way systemd does (LISTEN_PID = its pid)."""
    path = str(tmp_path / "inherited.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.bind(path)
        s.listen()
        fd = s.fileno()
        # A launcher moves the socket to fd 3, sets LISTEN_* and execs the child: exec keeps the
        # pid, so LISTEN_PID names the child itself, as systemd arranges it.
        launcher = (
            "import os, sys\n"
            "fd = int(sys.argv[1])\n"
            "if fd != 3:\n    os.dup2(fd, 3); os.close(fd)\n"
            "pid = str(os.getpid()) if sys.argv[2] == 'self' else sys.argv[2]\n"
            "os.environ.update(LISTEN_PID=pid, LISTEN_FDS='1')\n"
            "os.execv(sys.executable, [sys.executable, '-c', os.environ['CHILD']])\n"
        )
        proc = subprocess.Popen(
            [PY, "-c", launcher, str(fd), listen_pid],
            env=_child_env(CHILD=LISTEN_CHILD, WANT="/nowhere"),
            pass_fds=(fd,),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        out, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err.decode()
    return json.loads(out)  # type: ignore[no-any-return]


def test_inherited_fd_with_listen_pid(tmp_path: Path) -> None:
    result = _inherit(tmp_path, "self")
    assert result["env_left"] == []
    socks = result["socks"]
    assert isinstance(socks, list) and len(socks) == 1
    assert socks[0]["fd"] == 3 and socks[0]["name"] == "unknown"
    assert socks[0]["addr"] == str(tmp_path / "inherited.sock")
    assert socks[0]["type"] == socket.SOCK_SEQPACKET
    assert result["chosen"] is False  # bound to another path than the one we want


def test_inherited_fd_for_another_pid_is_ignored(tmp_path: Path) -> None:
    result = _inherit(tmp_path, "1")
    assert result["socks"] == []
    assert result["env_left"] == []  # still removed, so our children do not take them either


# ----------------------------------------------------------------------------- logging


def test_logs_to_stderr_outside_systemd() -> None:
    code = (
        "import logging; from smcd_daemon.adapters import systemd as sd\n"
        "h = sd.setup_logging('info')\n"
        "logging.getLogger('smcd.test').info('hello %s', 'stderr')\n"
        "logging.getLogger('smcd.test').debug('not shown')\n"
        "print(type(h).__name__)\n"
    )
    r = subprocess.run(
        [PY, "-c", code], env=_child_env(INVOCATION_ID="x"), capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "StreamHandler"
    assert re.search(r"INFO smcd.test: hello stderr$", r.stderr, re.M), r.stderr
    assert "not shown" not in r.stderr


def test_journal_handler_chosen_when_stderr_is_the_journal_stream() -> None:
    st = os.fstat(2)
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    try:
        h = sd.setup_logging("debug", env={"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"})
        from systemd.journal import JournalHandler  # type: ignore[import-untyped]

        assert isinstance(h, JournalHandler)
        assert h in root.handlers and root.level == logging.DEBUG
        # A JOURNAL_STREAM that is not our stderr (redirected since) means stderr.
        h2 = sd.setup_logging("warning", env={"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino + 1}"})
        assert type(h2) is logging.StreamHandler
        assert h not in root.handlers  # replaced, not doubled
        assert sd.under_journal({"INVOCATION_ID": "abc"}) is False
    finally:
        for h in list(root.handlers):
            if h not in saved[0]:
                root.removeHandler(h)
        root.setLevel(saved[1])


JOURNAL_CHILD = textwrap.dedent(
    """\
    import json, logging, os, socket, subprocess
    subprocess.run(["mount", "-t", "tmpfs", "tmpfs", "/run/systemd"], check=True)
    os.makedirs("/run/systemd/journal")
    j = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    j.bind("/run/systemd/journal/socket")
    st = os.fstat(2)
    os.environ["JOURNAL_STREAM"] = f"{st.st_dev}:{st.st_ino}"
    from smcd_daemon.adapters import systemd as sd
    h = sd.setup_logging("info")
    logging.getLogger("smcd.test").warning("to the journal")
    j.settimeout(5)
    raw = j.recv(65536)
    fields = dict(line.split("=", 1) for line in raw.decode().splitlines() if "=" in line)
    print(json.dumps({"handler": type(h).__name__, "fields": fields}))
    """
)


def test_journal_protocol_for_real_in_a_private_mount_namespace() -> None:
    """The records reach a journal socket as native journal fields (priority, identifier)."""
    Path("/run/systemd").mkdir(exist_ok=True)  # mount point; normally exists on a systemd host
    r = subprocess.run(
        [_need("unshare"), "--mount", PY, "-c", JOURNAL_CHILD],
        env=_child_env(),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["handler"] == "JournalHandler"
    f = out["fields"]
    assert f["MESSAGE"] == "smcd.test: to the journal"
    assert f["PRIORITY"] == "4"
    assert f["SYSLOG_IDENTIFIER"] == "smcd"
    assert f["LOGGER"] == "smcd.test"


def test_only_smcd_speaks_on_notify_socket_with_a_private_bus(tmp_path: Path) -> None:
    """smcd's private dbus-daemon must not inherit NOTIFY_SOCKET: it would tell systemd READY=1
    before smcd's own service is on that bus (and, with NotifyAccess=all, be believed)."""
    path = tmp_path / "notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(os.fspath(path))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        sock.settimeout(0.2)
        proc = subprocess.Popen(
            [PY, "-c", "import sys; from smcd_daemon.daemon import main; sys.exit(main())",
             "--bus", "private",
             "--runtime-dir", os.fspath(tmp_path / "run"),
             "--state-dir", os.fspath(tmp_path / "state"),
             "--handoff-socket", os.fspath(tmp_path / "handoff.sock")],
            env=_child_env(NOTIFY_SOCKET=os.fspath(path)),
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )  # fmt: skip
        senders: list[tuple[int, str]] = []
        try:
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and (proc.pid, "READY=1") not in senders:
                try:
                    data, anc, _, _ = sock.recvmsg(4096, socket.CMSG_SPACE(12))
                except TimeoutError:
                    assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
                    continue
                pid = next(
                    int.from_bytes(d[:4], sys.byteorder)
                    for level, kind, d in anc
                    if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS
                )
                senders += [(pid, line) for line in data.decode().splitlines()]
            time.sleep(0.5)  # anything a child would still send
            with contextlib.suppress(TimeoutError):
                while True:
                    data, anc, _, _ = sock.recvmsg(4096, socket.CMSG_SPACE(12))
                    senders.append((-1, data.decode()))
        finally:
            proc.terminate()
            proc.wait(20)
            if proc.stderr:
                proc.stderr.close()
    assert (proc.pid, "READY=1") in senders, senders
    assert {pid for pid, _ in senders if pid != -1} == {proc.pid}, senders
