"""The control plane's "done when": the real smcd process, checked from the outside.

Setup (module-wide, built once): two network namespaces joined by a veth pair (``smcva`` in A
with 192.0.2.1/24, ``smcvb`` in B with 192.0.2.2/24), a private real ``dbus-daemon`` configured
like a system bus with our policy file, and ``.venv/bin/smcd`` running *inside* namespace A
(``ip netns exec``), as one smcd per network namespace would. The test talks to it only as an
operator or an application would: ``smcctl``, ``busctl``, a D-Bus client, the handoff socket,
signals, and a real ``NOTIFY_SOCKET``.

The daemon is started four times in all: the main instance, a socket-activated restart (state
restored), a start over a corrupt state file, and a start with a bad configuration.
"""

from __future__ import annotations

import array
import asyncio
import json
import os
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from dbus_fast import Message, MessageType
from dbus_fast.aio import MessageBus

from smc_handoff import messages
from tests.control.daemon_proc import (
    SMCD,
    NotifySocket,
    SmcdProcess,
    sh,
    smcctl,
    smcd_argv,
)
from tests.control.dbusd import DbusDaemon, dbus_daemon

pytestmark = pytest.mark.timeout(120)

DEADLINE = 1.0  # a link event must reach D-Bus within this (the bound)
DEVICE_PATH = "/org/smcd/device/smcva"


@dataclass
class Env:
    work: Path
    ns_a: str
    ns_b: str
    bus: DbusDaemon
    config: Path
    notify: NotifySocket

    @property
    def address(self) -> str:
        return f"unix:path={self.bus.socket_path}"

    @property
    def handoff(self) -> Path:
        return self.work / "run" / "handoff.sock"

    @property
    def state_file(self) -> Path:
        return self.work / "state" / "state.json"

    def config_text(self, extra: str = "") -> str:
        return (
            f'runtime_dir = "{self.work}/run"\n'
            f'state_dir = "{self.work}/state"\n'
            'log_level = "info"\n'
            f"{extra}"
            f'[dbus]\nbus = "{self.address}"\n'
        )

    def process(self, name: str, **kw: object) -> SmcdProcess:
        argv = smcd_argv(self.config, netns=self.ns_a, **kw)  # type: ignore[arg-type]
        return SmcdProcess(argv, self.work / f"{name}.log", self.notify)


def _require_tools() -> None:
    for tool in ("ip", "dbus-daemon", "busctl", "setpriv", "systemd-socket-activate"):
        if shutil.which(tool) is None:
            pytest.fail(f"{tool} is missing: install it with tests/host/install-deps.sh")
    if os.geteuid() != 0:
        pytest.fail("the daemon end-to-end test needs root (network namespaces); CI runs as root")


@pytest.fixture(scope="module")
def env() -> Iterator[Env]:
    _require_tools()
    work = Path(tempfile.mkdtemp(prefix="smcd-e2e-", dir="/tmp"))
    os.chmod(work, 0o755)
    tag = f"smcde2e{os.getpid()}"
    ns_a, ns_b = f"{tag}a", f"{tag}b"
    try:
        sh("ip", "netns", "add", ns_a)
        sh("ip", "netns", "add", ns_b)
        sh("ip", "-n", ns_a, "link", "add", "smcva", "type", "veth", "peer", "name", "smcvb",
           "netns", ns_b)  # fmt: skip
        sh("ip", "-n", ns_a, "addr", "add", "192.0.2.1/24", "dev", "smcva")
        sh("ip", "-n", ns_b, "addr", "add", "192.0.2.2/24", "dev", "smcvb")
        for ns, dev in ((ns_a, "smcva"), (ns_b, "smcvb"), (ns_a, "lo")):
            sh("ip", "-n", ns, "link", "set", dev, "up")
        with dbus_daemon("system") as bus:
            e = Env(work, ns_a, ns_b, bus, work / "smcd.toml", NotifySocket(work / "notify"))
            e.config.write_text(e.config_text())
            yield e
            e.notify.close()
    finally:
        for ns in (ns_a, ns_b):
            sh("ip", "netns", "del", ns, check=False)
        shutil.rmtree(work, ignore_errors=True)


@pytest.fixture(scope="module")
def smcd(env: Env) -> Iterator[SmcdProcess]:
    proc = env.process("smcd-main").start()
    try:
        proc.wait_ready()
        yield proc
    finally:
        if proc.alive():
            proc.stop()


def busctl(env: Env, *args: str) -> tuple[int, str, str]:
    r = sh("busctl", f"--address={env.address}", *args, check=False)
    return r.returncode, r.stdout, r.stderr


def one_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1, f"expected one line, got: {text!r}"
    return lines[0]


# -- start-up, introspection -------------------------------------------------------------------


def test_ready_status_and_introspection(env: Env, smcd: SmcdProcess) -> None:
    ready = env.notify.wait_for("READY", "1")
    assert "serving org.smcd" in ready.get("STATUS", ""), ready
    rc, out, err = busctl(env, "introspect", "org.smcd", "/org/smcd")
    assert rc == 0, err
    for member in (
        "org.smcd.Manager1",
        ".PnetAdd",
        ".GetInfo",
        "org.freedesktop.DBus.ObjectManager",
    ):
        assert member in out
    rc, out, err = busctl(env, "tree", "org.smcd")
    assert rc == 0, err
    assert DEVICE_PATH in out and "/org/smcd/device/loopback_2dism" in out
    # The daemon sees its own namespace only: the peer's veth end is not there.
    assert "smcvb" not in out
    r = smcctl(["device", "show", "smcva", "--json"], bus=env.address)
    assert r.returncode == 0, r.stderr
    (dev,) = json.loads(r.stdout)
    assert ["192.0.2.1", 24] in dev["Addresses"] and dev["Up"] is True


# -- pnet round trip, policy -------------------------------------------------------------------


def test_pnet_round_trip_is_persisted(env: Env, smcd: SmcdProcess) -> None:
    r = smcctl(["pnet", "add", "net1", "-I", "smcva"], bus=env.address)
    assert r.returncode == 0, r.stderr
    r = smcctl(["pnet", "-a", "NET1", "-D", "mlx5_0", "-P", "2"], bus=env.address)
    assert r.returncode == 0, r.stderr
    r = smcctl(["pnet", "show"], bus=env.address)
    assert r.returncode == 0, r.stderr
    lines = [line.split() for line in r.stdout.splitlines()]
    assert lines == [
        ["PNETID", "Net-Dev", "IB-Dev", "IB-Port"],
        ["NET1", "smcva", "n/a", "255"],
        ["NET1", "n/a", "mlx5_0", "2"],
    ]
    rc, out, err = busctl(env, "call", "org.smcd", "/org/smcd", "org.smcd.Manager1", "PnetList")
    assert rc == 0 and out.strip() == 'a(sssy) 2 "NET1" "smcva" "" 0 "NET1" "" "mlx5_0" 2', (
        out,
        err,
    )
    rc, out, _ = busctl(env, "get-property", "org.smcd", DEVICE_PATH, "org.smcd.Device1", "PnetId")
    assert out.strip() == 's "NET1"'
    # A device carries one PNETID: a clear refusal, one line, exit 1.
    r = smcctl(["pnet", "add", "NET2", "-I", "smcva"], bus=env.address)
    assert r.returncode == 1
    assert "already has PNETID NET1" in one_line(r.stderr)
    saved = json.loads(env.state_file.read_text())
    assert {e["pnetid"] for e in saved["pnet"]["entries"]} == {"NET1"}
    assert len(saved["pnet"]["entries"]) == 2


def test_policy_denies_unprivileged_changes(env: Env, smcd: SmcdProcess) -> None:
    r = smcctl(["pnet", "add", "NET7", "-I", "lo"], bus=env.address, as_nobody=True)
    assert r.returncode == 1
    line = one_line(r.stderr)
    assert line.startswith("smcctl: permission denied:"), line
    assert "PnetAdd" in line
    r = smcctl(["stats", "reset"], bus=env.address, as_nobody=True)
    assert r.returncode == 1 and "permission denied" in one_line(r.stderr)
    # Reading stays open to everybody.
    r = smcctl(["pnet", "show", "--json"], bus=env.address, as_nobody=True)
    assert r.returncode == 0, r.stderr
    assert "NET7" not in r.stdout and "NET1" in r.stdout


# -- live device events ------------------------------------------------------------------------


async def _time_carrier_change(env: Env, down: bool) -> float:
    bus = await MessageBus(bus_address=env.address).connect()
    try:
        rule = (
            "type='signal',sender='org.smcd',interface='org.freedesktop.DBus.Properties',"
            f"member='PropertiesChanged',path='{DEVICE_PATH}'"
        )
        reply = await bus.call(
            Message(
                destination="org.freedesktop.DBus",
                path="/org/freedesktop/DBus",
                interface="org.freedesktop.DBus",
                member="AddMatch",
                signature="s",
                body=[rule],
            )
        )
        assert reply is not None and reply.message_type is MessageType.METHOD_RETURN
        got: asyncio.Future[float] = asyncio.get_running_loop().create_future()

        def on_message(msg: Message) -> None:
            if msg.message_type is not MessageType.SIGNAL or msg.path != DEVICE_PATH:
                return
            _iface, changed, _ = msg.body
            carrier = changed.get("Carrier")
            if carrier is not None and carrier.value is (not down) and not got.done():
                got.set_result(time.monotonic())

        bus.add_message_handler(on_message)
        t0 = time.monotonic()
        sh("ip", "-n", env.ns_b, "link", "set", "smcvb", "down" if down else "up")
        return await asyncio.wait_for(got, 5.0) - t0
    finally:
        bus.disconnect()


def test_veth_down_reaches_dbus_within_a_second(env: Env, smcd: SmcdProcess) -> None:
    # Taking the peer end down is a cable pull for smcva: carrier lost, operstate LOWERLAYERDOWN.
    elapsed = asyncio.run(_time_carrier_change(env, down=True))
    assert elapsed < DEADLINE, f"PropertiesChanged after {elapsed:.3f} s"
    _rc, out, _ = busctl(env, "get-property", "org.smcd", DEVICE_PATH, "org.smcd.Device1", "Up")
    assert out.strip() == "b false"
    elapsed = asyncio.run(_time_carrier_change(env, down=False))
    assert elapsed < DEADLINE, f"PropertiesChanged after {elapsed:.3f} s"


# -- garbage on every input --------------------------------------------------------------------


def _handoff_exchange(path: Path, payload: bytes, fds: list[int] | None = None) -> messages.Error:
    """Send one raw datagram on the handoff socket; the reply must be an ERROR (the protocol of
    smc_handoff.messages), after which the daemon closes the connection."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.settimeout(5)
        s.connect(os.fspath(path))
        if fds:
            rights = array.array("i", fds).tobytes()
            s.sendmsg([payload], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, rights)])
        else:
            s.send(payload)
        reply = messages.decode_reply(s.recv(65536))
        assert s.recv(100) == b"", "the daemon closes the connection after an ERROR"
    assert isinstance(reply, messages.Error), reply
    return reply


# A well-formed header of a protocol version the daemon does not speak (an empty CONNECT body).
FUTURE_VERSION = messages.HEADER.pack(messages.MAGIC, 99, messages.MessageType.CONNECT, 0, 0)


def _fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_handoff_socket_survives_garbage(env: Env, smcd: SmcdProcess) -> None:
    assert (env.handoff.stat().st_mode & 0o777) == 0o666
    r = _handoff_exchange(env.handoff, b"\xff\xfe\x00garbage")
    assert r.code is messages.ErrorCode.MALFORMED
    r = _handoff_exchange(env.handoff, b"[1, 2, 3]")
    assert r.code is messages.ErrorCode.MALFORMED
    r = _handoff_exchange(env.handoff, b"x" * 150_000)  # > MAX_MESSAGE, < the socket buffer
    assert r.code is messages.ErrorCode.OVERSIZED
    r = _handoff_exchange(env.handoff, FUTURE_VERSION)
    assert r.code is messages.ErrorCode.UNSUPPORTED_VERSION and "99" in r.message
    # Descriptors sent along with a request are closed, not collected.
    pid = smcd.proc.pid
    before = _fd_count(pid)
    with open("/dev/null") as f:
        for _ in range(20):
            r = _handoff_exchange(env.handoff, b"{}", fds=[f.fileno(), f.fileno()])
            assert r.code is messages.ErrorCode.MALFORMED
    assert _fd_count(pid) <= before + 1
    # Connections that vanish mid-way, several at once, and an empty datagram.
    for _ in range(50):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.connect(os.fspath(env.handoff))
        s.send(b"\x00" * 100)
        s.close()
    # An empty SEQPACKET datagram reads like end-of-file (recv returns 0): the server closes.
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.settimeout(5)
        s.connect(os.fspath(env.handoff))
        s.send(b"")
        assert s.recv(100) == b""
    assert smcd.alive()
    r2 = smcctl(["info", "--json"], bus=env.address)
    assert r2.returncode == 0 and json.loads(r2.stdout)["Pid"] > 0


def test_bad_dbus_arguments_are_refused_and_survived(env: Env, smcd: SmcdProcess) -> None:
    m = ("call", "org.smcd", "/org/smcd", "org.smcd.Manager1")
    bad = [
        ((*m, "PnetAdd", "s", "NET9"), ""),  # wrong signature
        ((*m, "PnetAdd", "sssy", "bad pnet!", "smcva", "", "0"), "PNETID"),
        ((*m, "PnetAdd", "sssy", "NET9", "", "", "0"), "names no device"),
        ((*m, "PnetAdd", "sssy", "NET9", "", "ib0", "7"), "port"),
        ((*m, "PnetAdd", "sssy", "NET9", "x" * 200, "", "0"), "bytes"),
        ((*m, "UeidAdd", "s", "bad ueid!"), "UEID"),
        ((*m, "PnetRemove", "s", "NOPE"), "not in the PNET table"),
        ((*m, "Frobnicate"), ""),
        (("set-property", "org.smcd", "/org/smcd", "org.smcd.Manager1", "Hostname", "s", "x"), ""),
        (("call", "org.smcd", "/org/smcd/nothing/here", "org.smcd.Manager1", "GetInfo"), ""),
    ]
    for args, expected in bad:
        rc, out, err = busctl(env, *args)
        assert rc != 0, (args, out)
        assert expected in err, (args, err)
    assert smcd.alive()
    r = smcctl(["pnet", "show", "--json"], bus=env.address)
    assert {e["pnetid"] for e in json.loads(r.stdout)} == {"NET1"}


def test_info_says_whether_smcr_can_be_used_now(env: Env, smcd: SmcdProcess) -> None:
    """``smcctl info`` lists SMC-R among the capabilities when its modes are on (as the
    kernel lists the versions it supports) and says on a line of its own whether an RDMA port
    is ACTIVE: on this host there is no RDMA device, so SMC-R cannot be used (the VM's SMC-R
    tests see their rxe ports ACTIVE there)."""
    text = smcctl(["info"], bus=env.address).stdout
    lines = dict(line.split(" : ", 1) for line in text.splitlines() if " : " in line)
    lines = {k.strip(): v for k, v in lines.items()}
    assert "SMC-Rv2" in lines["Capabilities"], text
    want = "none: no RDMA device here, SMC-R cannot be used (smcctl device)"
    assert lines["SMC-R ports"] == want, text


def test_sighup_reload(env: Env, smcd: SmcdProcess) -> None:
    good = env.config.read_text()
    try:
        # A file that turned invalid: the daemon keeps the configuration it runs with, says so.
        env.config.write_text(env.config_text('peers = ["192.0.2.7/24"]\n'))
        env.notify.clear()
        smcd.signal(signal.SIGHUP)
        env.notify.wait_for("RELOADING", "1")
        status = env.notify.wait_for("READY", "1")["STATUS"]
        assert "failed" in status and "previous configuration" in status, status
        log = smcd.wait_log("reload: ")
        assert 'peers[0] = "192.0.2.7/24"' in log and "host bits" in log
        assert smcd.alive()
        # A valid file: reloadable keys apply, the others are reported as needing a restart.
        before = json.loads(smcctl(["info", "--json"], bus=env.address).stdout)
        env.config.write_text(
            env.config_text(
                '[eid]\nueids = ["CFG.UEID"]\n[buffers]\nmin_dmb_size = "32K"\n'
                "[modes]\nsmcr_v1 = false\n"
            )
        )
        env.notify.clear()
        smcd.signal(signal.SIGHUP)
        status = env.notify.wait_for("READY", "1")["STATUS"]
        assert "applied eid.ueids" in status, status
        assert "needs restart for buffers.min_dmb_size" in status, status
        r = smcctl(["ueid", "show"], bus=env.address)
        assert r.stdout.split() == ["CFG.UEID"]
        # Capabilities on D-Bus follow the modes a reload switched.
        after = json.loads(smcctl(["info", "--json"], bus=env.address).stdout)
        assert "SMC-Rv1" in json.dumps(before) and "SMC-Rv1" not in json.dumps(after), after
    finally:
        env.config.write_text(good)


# -- stop, restart, socket activation, corrupt state -------------------------------------------


def test_sigterm_stops_cleanly(env: Env, smcd: SmcdProcess) -> None:
    r = smcctl(["pnet", "add", "NET1", "-I", "smcva"], bus=env.address)  # idempotent for -k runs
    assert r.returncode == 0 or "already" in r.stderr
    env.notify.clear()
    assert smcd.stop() == 0, smcd.log()
    assert env.notify.wait_for("STOPPING", "1", timeout=1)
    assert not env.handoff.exists(), "the socket smcd bound must be removed on exit"
    r = smcctl(["info"], bus=env.address)
    assert r.returncode == 1
    assert one_line(r.stderr) == (
        f"smcctl: smcd is not running on the bus {env.address} (org.smcd has no owner)"
    )


def test_socket_activation_and_restored_state(env: Env, smcd: SmcdProcess) -> None:
    if smcd.alive():
        smcd.stop()
    proc = env.process("smcd-activated", activate_socket=env.handoff).start()
    try:
        deadline = time.monotonic() + 10
        while not env.handoff.exists():
            assert time.monotonic() < deadline, "systemd-socket-activate did not listen"
            time.sleep(0.05)
        # The first client connects before smcd exists; the daemon serves the queued request.
        r = _handoff_exchange(env.handoff, FUTURE_VERSION)
        assert r.code is messages.ErrorCode.UNSUPPORTED_VERSION
        proc.wait_ready()
        assert "inherited (socket activation)" in proc.log()
        r2 = smcctl(["pnet", "show", "--json"], bus=env.address)
        rows = json.loads(r2.stdout)
        assert {"pnetid": "NET1", "netdev": "smcva", "ibdev": None, "ibport": None} in rows
        assert proc.stop() == 0
        assert env.handoff.exists(), "an inherited socket belongs to the socket unit: kept"
    finally:
        if proc.alive():
            proc.stop()


def test_corrupt_state_file_is_moved_aside(env: Env) -> None:
    env.state_file.parent.mkdir(parents=True, exist_ok=True)
    env.state_file.write_bytes(b'{"format": 1, "pnet": {"entries": [\x00\xff')
    proc = env.process("smcd-corrupt").start()
    try:
        proc.wait_ready()
        assert "is corrupt" in proc.log()
        moved = list(env.state_file.parent.glob("state.json.corrupt-*"))
        assert len(moved) == 1 and moved[0].read_bytes().startswith(b'{"format": 1')
        r = smcctl(["pnet", "show", "--json"], bus=env.address)
        assert r.returncode == 0 and json.loads(r.stdout) == []
        r = smcctl(["pnet", "add", "NET3", "-I", "lo"], bus=env.address)
        assert r.returncode == 0, r.stderr
        assert json.loads(env.state_file.read_text())["pnet"]["entries"][0]["pnetid"] == "NET3"
    finally:
        assert proc.stop() == 0


# -- configuration errors ----------------------------------------------------------------------


def test_config_errors_name_key_value_and_rule(env: Env) -> None:
    bad = env.work / "bad.toml"
    bad.write_text(env.config_text('[buffers]\nmax_dmb_size = "3M"\n'))
    r = sh(os.fspath(SMCD), "--check-config", os.fspath(bad), check=False)
    assert r.returncode == 1
    assert 'buffers.max_dmb_size = "3M"' in r.stderr and "16K << n" in r.stderr, r.stderr
    r = sh(os.fspath(SMCD), "--check-config", os.fspath(env.config), check=False)
    assert r.returncode == 0 and r.stdout.strip() == f"{env.config}: OK"
    # The daemon itself refuses to start on it, with the same message, before touching anything.
    t0 = time.monotonic()
    r = sh(os.fspath(SMCD), "--config", os.fspath(bad), check=False)
    assert r.returncode == 1
    line = one_line(r.stderr)
    assert line.startswith("smcd: configuration error: ") and 'buffers.max_dmb_size = "3M"' in line
    assert time.monotonic() - t0 < 10
    _rc, out, _ = busctl(env, "call", "org.freedesktop.DBus", "/org/freedesktop/DBus",
                        "org.freedesktop.DBus", "NameHasOwner", "s", "org.smcd")  # fmt: skip
    assert out.strip() == "b false"
