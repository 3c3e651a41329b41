"""smcctl against the real smcd process: finding the daemon without --bus, ``monitor`` and
``stats --openmetrics``.

Discovery: smcd started with the same defaults smcctl assumes (no configuration: the session
bus when there is one, else a private bus; or a configuration naming the system bus), each time
with real dbus-daemons standing in for the system and session buses (``DBUS_SYSTEM_BUS_ADDRESS``/
``DBUS_SESSION_BUS_ADDRESS``); smcctl gets the same environment and no --bus.

Observability: one smcd in a network namespace of its own (so a veth netdev can change state
there) on a private bus, with a UEID so loopback connections go SMC-D; the application is
tests/systemd/guest/app.py under smc-run in the same namespace.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.control.daemon_proc import SMCCTL, SMCD, NotifySocket, SmcdProcess, sh, smcd_argv
from tests.control.dbusd import dbus_daemon

pytestmark = pytest.mark.timeout(180)

REPO = Path(__file__).resolve().parents[2]
APP = REPO / "tests" / "systemd" / "guest" / "app.py"
SMC_RUN = REPO / ".venv" / "bin" / "smc-run"
NO_SYSTEM_BUS = "unix:path=/nonexistent/system_bus_socket"


def _env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("DBUS_SESSION_BUS_ADDRESS", "XDG_RUNTIME_DIR", "SMCD_BUS", "SMCD_RUNTIME_DIR")
    }
    env["DBUS_SYSTEM_BUS_ADDRESS"] = NO_SYSTEM_BUS
    env.update(extra)
    return env


def _smcctl(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(SMCCTL), *args], capture_output=True, text=True, timeout=30, env=env)


@pytest.fixture
def work() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="smcd-obs-", dir="/tmp"))
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _start(argv: list[str], work: Path, env: dict[str, str], name: str) -> SmcdProcess:
    notify = NotifySocket(work / f"notify-{name}")
    proc = SmcdProcess(argv, work / f"{name}.log", notify)
    # SmcdProcess takes os.environ plus extras: give it exactly ours.
    saved = dict(os.environ)
    try:
        os.environ.clear()
        os.environ.update(env)
        proc.start()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    proc.wait_ready()
    return proc


# -- discovery ------------------------------------------------------------------------------------


def test_finds_the_private_bus_smcd_chose_and_says_where_it_looked(work: Path) -> None:
    xdg = work / "xdg"
    xdg.mkdir(mode=0o700)
    env = _env(XDG_RUNTIME_DIR=str(xdg))
    proc = _start([str(SMCD)], work, env, "private")  # no config: no session bus -> private
    try:
        record = (xdg / "smcd" / "bus").read_text().splitlines()
        assert record[0] == "private" and record[1].startswith("unix:"), record
        r = _smcctl(["info"], env)
        assert r.returncode == 0, r.stderr
        assert "smcd version" in r.stdout
        # Finding it (by the record, or --bus private) imports neither the daemon nor its
        # configuration model (pydantic, pyroute2): they cost every command ~0.3 s.
        for how in ([], ["--bus", "private"]):
            r = subprocess.run([sys.executable, "-X", "importtime", str(SMCCTL), *how, "info"],
                               capture_output=True, text=True, timeout=30, env=env)  # fmt: skip
            assert r.returncode == 0 and "smcd version" in r.stdout, r.stderr[-2000:]
            loaded = {line.rsplit("|", 1)[-1].strip() for line in r.stderr.splitlines()}
            heavy = {"smcd_daemon.daemon", "smcd_daemon.config", "pydantic", "pyroute2"}
            assert not heavy & loaded, (how, heavy & loaded)
    finally:
        assert proc.stop() == 0
    assert not (xdg / "smcd" / "bus").exists()
    r = _smcctl(["info"], env)
    assert r.returncode == 1
    err = r.stderr.strip()
    assert "\n" not in err
    assert err.startswith("smcctl: smcd is not running: looked on the system bus (cannot connect")
    assert f"{xdg}/smcd/bus (no such file" in err
    assert "/run/smcd/bus" in err
    assert "the session bus (none: DBUS_SESSION_BUS_ADDRESS is not set)" in err


def test_finds_the_session_bus_smcd_chose(work: Path) -> None:
    with dbus_daemon("session") as session:
        env = _env(DBUS_SESSION_BUS_ADDRESS=session.address)
        proc = _start([str(SMCD), "--runtime-dir", str(work / "run")], work, env, "session")
        try:
            assert (work / "run" / "bus").read_text().splitlines()[0] == "session"
            r = _smcctl(["info", "--json"], env)  # runtime dir not given: via the session bus
            assert r.returncode == 0, r.stderr
            assert json.loads(r.stdout)["Pid"] == proc.proc.pid
        finally:
            proc.stop()


def test_finds_the_system_service_first(work: Path) -> None:
    with dbus_daemon("system") as system, dbus_daemon("session") as session:
        config = work / "smcd.toml"
        config.write_text(
            f'runtime_dir = "{work}/run"\nstate_dir = "{work}/state"\n[dbus]\nbus = "system"\n'
        )
        env = _env(DBUS_SYSTEM_BUS_ADDRESS=system.address)
        proc = _start(smcd_argv(config), work, env, "system")
        try:
            assert (work / "run" / "bus").read_text().splitlines() == ["system", system.address]
            # A session bus exists too, without smcd: the system service is found first.
            both = dict(env, DBUS_SESSION_BUS_ADDRESS=session.address)
            r = _smcctl(["info", "--json"], both)
            assert r.returncode == 0, r.stderr
            assert json.loads(r.stdout)["Pid"] == proc.proc.pid
        finally:
            proc.stop()
        r = _smcctl(["info"], env)
        assert r.returncode == 1
        assert "looked on the system bus (org.smcd has no owner)" in r.stderr


# -- monitor and openmetrics --------------------------------------------------------------------


class Observed:
    def __init__(self, work: Path, ns: str, proc: SmcdProcess, address: str) -> None:
        self.work, self.ns, self.proc, self.address = work, ns, proc, address


@pytest.fixture(scope="module")
def observed() -> Iterator[Observed]:
    if shutil.which("ip") is None or os.geteuid() != 0:
        pytest.fail("needs root and iproute2 (network namespaces): tests/host/install-deps.sh")
    work = Path(tempfile.mkdtemp(prefix="smcd-obs-", dir="/tmp"))
    os.chmod(work, 0o755)
    ns = f"smcdobs{os.getpid()}"
    sh("ip", "netns", "add", ns)
    try:
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh("ip", "-n", ns, "link", "add", "smcdum0", "type", "veth", "peer", "name", "smcdum1")
        config = work / "smcd.toml"
        config.write_text(
            f'runtime_dir = "{work}/run"\nstate_dir = "{work}/state"\n'
            '[dbus]\nbus = "private"\n[eid]\nueids = ["SMCD-OBS"]\n'
        )
        proc = _start(smcd_argv(config, netns=ns), work, _env(), "observed")
        address = (work / "run" / "bus.address").read_text().strip()
        yield Observed(work, ns, proc, address)
        proc.stop()
    finally:
        sh("ip", "netns", "del", ns, check=False)
        shutil.rmtree(work, ignore_errors=True)


class App:
    def __init__(self, obs: Observed) -> None:
        env = _env(SMCD_HANDOFF_SOCKET=str(obs.work / "run" / "handoff.sock"))
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", obs.ns, str(SMC_RUN), str(APP)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
        )  # fmt: skip
        self.read()

    def read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        return dict(json.loads(self.proc.stdout.readline()))

    def ask(self, **req: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        reply = self.read()
        assert "error" not in reply, reply
        return reply

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write('{"op": "quit"}\n')
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


class MonitorProc:
    def __init__(self, obs: Observed, *args: str) -> None:
        self.proc = subprocess.Popen(
            [str(SMCCTL), "monitor", "--bus", obs.address, *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert self.proc.stderr is not None
        first = self.proc.stderr.readline()
        assert first.startswith("smcctl: monitoring smcd on"), first
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait(self, what: str, pred: Any, timeout: float = 30.0) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if pred(line):
                    return line
            time.sleep(0.05)
        raise AssertionError(
            f"monitor printed no {what} within {timeout} s:\n" + "\n".join(self.lines)
        )

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)


def test_monitor_json_and_text_show_connections_fallbacks_and_devices(observed: Observed) -> None:
    mon = MonitorProc(observed, "--json")
    text = MonitorProc(observed)
    app = App(observed)
    try:
        port = app.ask(op="listen")["port"]
        c = app.ask(op="connect", port=port)
        assert c["mode"] == "smcd", c
        app.ask(op="echo", id=c["id"], size=50_000)

        def ev(line: str) -> dict[str, Any]:
            return dict(json.loads(line))

        def smcd_conn(line: str) -> bool:
            e = ev(line)
            props = e.get("properties", {})
            return bool(
                e["event"] == "connection-added"
                and props.get("Mode") == "SMCD"
                and props.get("State") != "LISTEN"
            )

        added = ev(mon.wait("an SMC-D connection-added", smcd_conn))
        assert added["path"].startswith("/org/smcd/connection/")
        assert isinstance(added["time"], float)
        app.ask(op="close", id=c["id"])
        plain = app.ask(op="plain-listen")["port"]
        f = app.ask(op="connect", port=plain)
        assert f["mode"] == "tcp", f
        sh("ip", "-n", observed.ns, "link", "set", "smcdum0", "up")
        mon.wait("its removal", lambda s: ev(s)["event"] == "connection-removed"
                 and ev(s)["path"] == added["path"], timeout=90)  # fmt: skip
        fb = ev(mon.wait("a fallback", lambda s: ev(s)["event"] == "fallback"))
        assert fb["reason_name"] == "SMC_CLC_DECL_PEERNOSMC", fb
        assert fb["reason"] == 0x03010000 and fb["path"].startswith("/org/smcd/connection/")
        dev = ev(
            mon.wait(
                "the veth device going up",
                lambda s: ev(s)["event"] == "device-changed" and "smcdum0" in ev(s)["path"],
            )
        )
        assert "OperState" in dev["changes"] or "Up" in dev["changes"], dev
        # The same events as text lines.
        text.wait(
            "a connection line",
            lambda s: (
                re.match(r"\[\d\d:\d\d:\d\d\.\d{3}\] conn \d+ added .*Mode=SMCD", s) is not None
            ),
        )
        text.wait(
            "a fallback line",
            lambda s: (
                re.search(r"\] fallback conn \d+: SMC_CLC_DECL_PEERNOSMC \(0x[0-9a-f]{8}", s)
                is not None
            ),
        )
        text.wait("a device line", lambda s: "device smcdum0 changed:" in s)
    finally:
        app.close()
        mon.stop()
        text.stop()
        sh("ip", "-n", observed.ns, "link", "set", "smcdum0", "down")


def test_monitor_count_exits_and_a_vanished_daemon_ends_it(observed: Observed) -> None:
    app = App(observed)
    try:
        mon = subprocess.Popen(
            [str(SMCCTL), "monitor", "--bus", observed.address, "--json", "-n", "1"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert mon.stderr is not None
        assert mon.stderr.readline().startswith("smcctl: monitoring")
        app.ask(op="connect", port=app.ask(op="plain-listen")["port"])
        out, _ = mon.communicate(timeout=30)
        assert mon.returncode == 0
        assert len(out.splitlines()) == 1 and json.loads(out)["event"]
    finally:
        app.close()


_SAMPLE = re.compile(
    r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\.)*"'
    r'(,[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\.)*")*)\})? (?P<value>-?[0-9.e+]+|NaN|[+-]Inf)$'
)


def check_openmetrics(text: str) -> dict[str, float]:
    """The exposition's structure (OpenMetrics 1.0 text, the parts we use); samples by line."""
    assert text.endswith("# EOF\n"), text[-200:]
    lines = text.splitlines()
    assert lines.count("# EOF") == 1
    families: dict[str, str] = {}
    helped: set[str] = set()
    current = ""
    samples: dict[str, float] = {}
    for line in lines[:-1]:
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            assert name not in families, f"family {name} twice"
            assert kind in ("counter", "gauge", "info"), line
            assert not name.endswith("_total"), f"{name}: the family name has no _total"
            families[name] = kind
            current = name
        elif line.startswith("# HELP "):
            assert line.split(" ", 3)[2] == current, f"HELP for another family: {line}"
            helped.add(current)
        elif line.startswith("# UNIT "):
            unit = line.split(" ", 3)[3]
            assert current.endswith("_" + unit), line
        else:
            m = _SAMPLE.match(line)
            assert m, f"not a sample line: {line!r}"
            want = current + ("_total" if families[current] == "counter" else "")
            assert m.group(1) == want, f"{m.group(1)} under family {current}"
            assert line.rsplit(" ", 1)[0] not in samples, f"duplicate sample {line}"
            samples[line.rsplit(" ", 1)[0]] = float(m.group("value"))
    assert set(families) == helped, "every family needs # HELP"
    return samples


def test_stats_openmetrics(observed: Observed) -> None:
    app = App(observed)
    try:
        c = app.ask(op="connect", port=app.ask(op="listen")["port"])
        assert c["mode"] == "smcd"
        app.ask(op="echo", id=c["id"], size=10_000)
        app.ask(op="connect", port=app.ask(op="plain-listen")["port"])
        r = subprocess.run(
            [str(SMCCTL), "stats", "--openmetrics", "--bus", observed.address],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        assert r.returncode == 0, r.stderr
        s = check_openmetrics(r.stdout)
    finally:
        app.close()
    assert s["smcd_connections_total"] >= 2
    smcd_v2 = sum(v for k, v in s.items() if k.startswith('smcd_smc_connections_total{tech="smcd"')
                  and 'version="2"' in k)  # fmt: skip
    assert smcd_v2 >= 2  # both halves of the SMC-D connection
    assert s['smcd_fallbacks_total{role="client"}'] >= 1
    peernosmc = [k for k in s if k.startswith("smcd_fallback_reasons_total{")
                 and 'reason="SMC_CLC_DECL_PEERNOSMC"' in k and 'role="client"' in k]  # fmt: skip
    assert peernosmc and s[peernosmc[0]] >= 1, s
    assert s['smcd_payload_bytes_total{tech="smcd",direction="tx"}'] >= 0
    assert 'smcd_open_connections{mode="SMCD"}' in s
    assert "smcd_link_groups" in s
