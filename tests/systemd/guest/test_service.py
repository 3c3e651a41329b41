"""smcd as a system service, inside the systemd VM (systemd is PID 1; see tests/systemd/harness.py).

The tests run in file order and build on each other, as an administrator would work: install
with the README's commands, then socket activation, notify status, D-Bus, the policy, an
unprivileged application, the journal, reload, the watchdog, stop, the security score and the
uninstall. Everything is checked with the real tools (systemctl, busctl, journalctl, smcctl) and,
where the issue says so, as the unprivileged user ``nobody``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[3]
APP = Path(__file__).resolve().parent / "app.py"
OUT = Path(os.environ.get("SMCD_SYSTEMD_VM_OUT", "/tmp"))
CONFIG = Path("/etc/smcd/smcd.toml")
UEID = "SMCD-SITE-1"  # the README's install block puts it in smcd.toml
#: The client waits this long for smcd's answer: the first handoff starts smcd (Python start-up
#: under TCG), which takes far longer than on real hardware.
HANDOFF_TIMEOUT = "180"
AS_NOBODY = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]
AS_DAEMON_USER = ["setpriv", "--reuid=daemon", "--regid=daemon", "--clear-groups"]


def sh(*argv: str, check: bool = True, timeout: float = 180, user: Sequence[str] = ()) -> str:
    env = dict(os.environ, SMCD_HANDOFF_TIMEOUT=HANDOFF_TIMEOUT)
    env.pop("SMCD_VM_REPORT", None)
    r = subprocess.run(
        [*user, *argv], capture_output=True, text=True, timeout=timeout, env=env, cwd="/"
    )
    if check and r.returncode != 0:
        raise AssertionError(f"{' '.join(argv)} exited {r.returncode}:\n{r.stdout}\n{r.stderr}")
    return r.stdout


def run(
    *argv: str, user: Sequence[str] = (), timeout: float = 180
) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, SMCD_HANDOFF_TIMEOUT=HANDOFF_TIMEOUT)
    env.pop("SMCD_VM_REPORT", None)
    return subprocess.run(
        [*user, *argv], capture_output=True, text=True, timeout=timeout, env=env, cwd="/"
    )


def prop(unit: str, name: str) -> str:
    return sh("systemctl", "show", "-P", name, unit).strip()


def wait_for(what: str, check: Any, timeout: float = 120.0, interval: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what} (last: {last!r})")


def journal(*args: str) -> str:
    return sh("journalctl", "--no-pager", "-u", "smcd.service", *args)


class App:
    """tests/systemd/guest/app.py under smc-run as an unprivileged user, driven line by line."""

    def __init__(self, user: Sequence[str] = AS_NOBODY) -> None:
        env = dict(os.environ, SMCD_HANDOFF_TIMEOUT=HANDOFF_TIMEOUT, HOME="/")
        env.pop("SMCD_VM_REPORT", None)
        self.stderr = open(OUT / f"app-{time.monotonic_ns()}.log", "w")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [*user, "smc-run", "-v", "/usr/bin/python3", str(APP)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr, text=True,
            env=env, cwd="/",
        )  # fmt: skip
        self.pid = self.ask_line()["pid"]

    def ask_line(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"app exited: {Path(self.stderr.name).read_text()}")
        return dict(json.loads(line))

    def ask(self, **req: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        reply = self.ask_line()
        if "error" in reply:
            raise AssertionError(f"app: {req} -> {reply['error']}")
        return reply

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.write('{"op": "quit"}\n')
            self.proc.stdin.flush()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.stderr.close()


@pytest.fixture
def app() -> Iterator[App]:
    a = App()
    yield a
    a.close()


def readme_install_commands() -> list[str]:
    """The shell commands of the README's install block (```sh after "### Install")."""
    text = (REPO / "README.md").read_text()
    m = re.search(r"^### Install\b.*?```sh\n(.*?)```", text, re.S | re.M)
    assert m, "README.md has no '### Install' section with a sh block"
    cmds = []
    for line in m.group(1).splitlines():
        line = line.split("  #", 1)[0].strip()
        if line and not line.startswith("#"):
            cmds.append(line)
    return cmds


# -- install -----------------------------------------------------------------------------------


@pytest.mark.timeout(900)
def test_install_as_the_readme_says() -> None:
    """The README's install block, run as it stands (in the checkout, as root)."""
    cmds = readme_install_commands()
    assert any(c.startswith("make install") for c in cmds), cmds
    assert not Path("/usr/bin/smcd").exists()
    for cmd in cmds:
        r = subprocess.run(
            ["sh", "-ec", cmd], cwd=REPO, capture_output=True, text=True, timeout=900
        )
        (OUT / "install.log").open("a").write(f"$ {cmd}\n{r.stdout}{r.stderr}\n")
        assert r.returncode == 0, f"{cmd}: exit {r.returncode}\n{r.stdout}\n{r.stderr}"
    assert os.readlink("/usr/bin/smcd") == "/usr/lib/smcd/bin/smcd"
    for b in ("smcctl", "smc-run"):
        assert sh("sh", "-c", f"command -v {b}").strip() == f"/usr/bin/{b}"
    assert Path("/usr/lib/systemd/system/smcd.service").is_file()
    assert Path("/usr/share/dbus-1/system.d/org.smcd.conf").is_file()
    assert Path("/usr/share/dbus-1/system-services/org.smcd.service").is_file()
    assert UEID in CONFIG.read_text()
    # Enabled and listening; the daemon itself not started yet (socket activation).
    assert prop("smcd.socket", "ActiveState") == "active"
    assert prop("smcd.socket", "UnitFileState") == "enabled"
    assert prop("smcd.service", "ActiveState") == "inactive"
    sock = Path("/run/smcd/handoff.sock")
    assert sock.exists() and (sock.stat().st_mode & 0o777) == 0o666


# -- socket activation, notify ---------------------------------------------------------------


def test_first_handoff_starts_smcd_and_is_served(app: App) -> None:
    """Nothing runs; an unprivileged application's first handoff starts smcd through the
    socket, and that very connection is served in mode smcd."""
    assert prop("smcd.service", "ActiveState") == "inactive"
    port = app.ask(op="listen")["port"]  # the listener registration is the first handoff
    c = app.ask(op="connect", port=port)
    assert c["mode"] == "smcd", c
    app.ask(op="echo", id=c["id"], size=200_000)
    assert app.ask(op="server-modes")["modes"] == ["smcd"]
    # smcd serves handoffs before it is on the bus; READY=1 (active) follows the bus name.
    wait_for("smcd.service active", lambda: prop("smcd.service", "ActiveState") == "active")
    assert "inherited (socket activation)" in journal()


def test_notify_ready_and_status_line() -> None:
    assert prop("smcd.service", "Type") == "notify"
    assert prop("smcd.service", "SubState") == "running"  # only after READY=1
    status = prop("smcd.service", "StatusText")
    assert status.startswith("serving org.smcd on the system bus"), status
    text = sh("systemctl", "status", "--no-pager", "smcd.service", check=False)
    assert "Active: active (running)" in text, text
    assert 'Status: "serving org.smcd on the system bus' in text, text


# -- privileges: peer detection with exactly CAP_BPF and CAP_NET_ADMIN -----------------------------

#: Capability numbers (linux/capability.h) and names, to decode /proc/PID/status masks.
CAP_NAMES = ("CHOWN", "DAC_OVERRIDE", "DAC_READ_SEARCH", "FOWNER", "FSETID", "KILL", "SETGID",
    "SETUID", "SETPCAP", "LINUX_IMMUTABLE", "NET_BIND_SERVICE", "NET_BROADCAST", "NET_ADMIN",
    "NET_RAW", "IPC_LOCK", "IPC_OWNER", "SYS_MODULE", "SYS_RAWIO", "SYS_CHROOT", "SYS_PTRACE",
    "SYS_PACCT", "SYS_ADMIN", "SYS_BOOT", "SYS_NICE", "SYS_RESOURCE", "SYS_TIME",
    "SYS_TTY_CONFIG", "MKNOD", "LEASE", "AUDIT_WRITE", "AUDIT_CONTROL", "SETFCAP",
    "MAC_OVERRIDE", "MAC_ADMIN", "SYSLOG", "WAKE_ALARM", "BLOCK_SUSPEND", "AUDIT_READ",
    "PERFMON", "BPF", "CHECKPOINT_RESTORE")  # fmt: skip
#: What smcd.service grants (CapabilityBoundingSet= and AmbientCapabilities=).
UNIT_CAPS = {"CAP_BPF", "CAP_NET_ADMIN"}
DROP_IN = Path("/run/systemd/system/smcd.service.d/50-no-capabilities.conf")


def capabilities(pid: int | str) -> dict[str, set[str]]:
    """CapInh/CapPrm/CapEff/CapBnd/CapAmb of a process, decoded to capability names."""
    out: dict[str, set[str]] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Cap"):
            key, value = line.split(":")
            mask = int(value, 16)
            out[key] = {
                f"CAP_{CAP_NAMES[b]}" if b < len(CAP_NAMES) else f"cap_{b}"
                for b in range(64)
                if mask >> b & 1
            }
    return out


def detection_line() -> str:
    caps = json.loads(sh("smcctl", "info", "--json"))["Capabilities"]
    lines = [c for c in caps if c.startswith("peer detection: ")]
    assert len(lines) == 1, caps
    return str(lines[0])


def cgroup2_mount() -> str:
    """Where systemd (PID 1) mounted the cgroup v2 hierarchy's root."""
    for line in Path("/proc/1/mountinfo").read_text().splitlines():
        pre, _, post = line.partition(" - ")
        if post.startswith("cgroup2 ") and pre.split()[3] == "/":
            return pre.split()[4]
    raise AssertionError("PID 1 has no cgroup2 mount: " + Path("/proc/1/mountinfo").read_text())


def restart_smcd() -> int:
    old = prop("smcd.service", "MainPID")
    sh("systemctl", "restart", "smcd.service", timeout=240)
    wait_for(
        "smcd.service running again",
        lambda: (
            prop("smcd.service", "SubState") == "running"
            and prop("smcd.service", "MainPID") not in ("0", old)
        ),
        timeout=180,
    )
    return int(prop("smcd.service", "MainPID"))


def test_peer_detection_runs_with_exactly_cap_bpf_and_cap_net_admin() -> None:
    """Under the shipped unit and /etc/smcd/smcd.toml, smcd attaches its programs at the root of
    systemd's cgroup2 mount and holds CAP_BPF and CAP_NET_ADMIN, nothing else, in every set."""
    pid = int(prop("smcd.service", "MainPID"))
    caps = capabilities(pid)
    for key in ("CapPrm", "CapEff", "CapBnd", "CapAmb"):
        assert caps[key] == UNIT_CAPS, (key, caps)
    assert caps["CapInh"] <= UNIT_CAPS, caps  # systemd raises inheritable for ambient ones
    # ... under the unit's system-call filter, which lets bpf(2) through (else: EPERM at load)
    assert "\nSeccomp:\t2\n" in Path(f"/proc/{pid}/status").read_text()
    line = detection_line()
    root = cgroup2_mount()
    m = re.fullmatch(r"peer detection: TCP option via BPF \(programs ([\d, ]+) on (\S+)\)", line)
    assert m, line
    assert m.group(2) == root, (line, root)
    ids = {int(i) for i in m.group(1).split(", ")}
    loaded = json.loads(sh("bpftool", "-j", "prog", "show") or "[]")
    names = {p["id"]: p.get("name") for p in loaded}
    assert {names.get(i) for i in ids} == SMCD_BPF_PROGRAMS, (ids, names)
    attached = json.loads(sh("bpftool", "-j", "cgroup", "show", root) or "[]")
    assert ids <= {a["id"] for a in attached}, attached
    # smcd mounted nothing of its own (no CAP_SYS_ADMIN): the hierarchy is systemd's.
    assert not any(
        " /run/smcd/cgroup2 " in x for x in Path(f"/proc/{pid}/mountinfo").read_text().splitlines()
    )
    text = sh("smcctl", "info")
    assert f"peer detection: TCP option via BPF (programs {m.group(1)} on {root})" in text, text
    logged = sh("journalctl", "--no-pager", f"_PID={pid}")
    assert f"SMC peer detection: BPF programs {m.group(1)} attached to {root}" in logged, logged


def test_without_capabilities_detection_says_unavailable_and_smcd_carries_on(app: App) -> None:
    """A drop-in that takes the two capabilities away: smcd still starts and serves, `smcctl
    info` and the journal say why detection is unavailable; the shipped unit restores it."""
    DROP_IN.parent.mkdir(parents=True, exist_ok=True)
    DROP_IN.write_text("[Service]\nCapabilityBoundingSet=\nAmbientCapabilities=\n")
    try:
        sh("systemctl", "daemon-reload")
        pid = restart_smcd()
        caps = capabilities(pid)
        assert caps["CapEff"] == caps["CapBnd"] == caps["CapAmb"] == set(), caps
        line = detection_line()
        assert line.startswith("peer detection: unavailable: smcd lacks CAP_BPF, CAP_NET_ADMIN"), (
            line
        )
        assert line in sh("smcctl", "info")
        want = "SMC peer detection unavailable: smcd lacks CAP_BPF, CAP_NET_ADMIN"
        logged = sh("journalctl", "--no-pager", f"_PID={pid}", "-o", "json")
        entries = [json.loads(x) for x in logged.splitlines() if want in x]
        assert entries and entries[0]["PRIORITY"] == "4", entries  # a warning
        loaded = json.loads(sh("bpftool", "-j", "prog", "show") or "[]")
        assert not [p for p in loaded if p.get("name") in SMCD_BPF_PROGRAMS], loaded
        # Degraded, not broken: same-host SMC-D goes on.
        c = app.ask(op="connect", port=app.ask(op="listen")["port"])
        assert c["mode"] == "smcd", c
        app.ask(op="echo", id=c["id"], size=50_000)
    finally:
        DROP_IN.unlink(missing_ok=True)
        sh("systemctl", "daemon-reload")
    pid = restart_smcd()
    assert capabilities(pid)["CapEff"] == UNIT_CAPS
    assert detection_line().startswith("peer detection: TCP option via BPF"), detection_line()


def device_show() -> tuple[str, str]:
    """`smcctl device show`: the table, and the lines about namespaces it could not read."""
    r = run("smcctl", "device", "show")
    assert r.returncode == 0, r
    return r.stdout, r.stderr


def test_the_netns_drop_in_lets_smcd_join_a_containers_namespace() -> None:
    """README "Containers on one host": the shipped unit cannot join another namespace and
    `smcctl device show` says why; units/smcd-netns.conf, installed as its header says, adds
    CAP_SYS_ADMIN and network namespaces only, and then the namespace's netdevs are listed."""
    name = "smcd-ctr"
    sh("ip", "netns", "add", name)  # a container's namespace, named after smcd started
    ino = os.stat(f"/run/netns/{name}").st_ino
    drop_in = Path("/etc/systemd/system/smcd.service.d/netns.conf")
    may_not = (
        f"smcctl: network namespace {ino} {name}: cannot join: Operation not permitted "
        "(joining a namespace takes CAP_SYS_ADMIN and a setns() allowed)"
    )
    try:
        # Named after smcd started: the host's mounts propagate into the service's namespace (a
        # slave of the host's shared mounts, as on any host whose systemd is not in a container:
        # boot.sh), so the bind reaches smcd at once, which sees the namespace and may not join.
        _table, problems = wait_for(
            f"{name} in smcctl device show", lambda: (out := device_show())[1] and out, timeout=60
        )
        pid = prop("smcd.service", "MainPID")
        mounts = run("findmnt", "-N", pid, "-no", "PROPAGATION", "/run").stdout
        assert problems.splitlines() == [may_not], (problems, mounts)
        assert "slave" in mounts, mounts
        # Named before smcd started: seen, and the shipped unit may not join it.
        restart_smcd()
        table, problems = device_show()
        assert problems.splitlines() == [may_not], problems
        assert f" {name} " not in table, table
        header = (REPO / "units" / "smcd-netns.conf").read_text()
        install = [ln.strip("# ").split() for ln in header.splitlines() if "install -D" in ln]
        assert install and install[0][-1] == str(drop_in), install
        sh(*install[0][:-2], str(REPO / "units" / "smcd-netns.conf"), str(drop_in))
        sh("systemctl", "daemon-reload")
        pid = restart_smcd()
        caps = capabilities(pid)
        want = UNIT_CAPS | {"CAP_SYS_ADMIN"}
        assert caps["CapEff"] == caps["CapBnd"] == caps["CapAmb"] == want, caps
        assert prop("smcd.service", "RestrictNamespaces") == "net"
        table, problems = device_show()
        assert problems == "", problems
        rows = [ln for ln in table.splitlines() if ln.startswith(f"{ino} {name} ")]
        assert len(rows) == 1 and re.search(r" lo +netdev ", rows[0]), table  # its own lo
    finally:
        drop_in.unlink(missing_ok=True)
        sh("systemctl", "daemon-reload")
        sh("ip", "netns", "del", name, check=False)
    pid = restart_smcd()
    assert capabilities(pid)["CapEff"] == UNIT_CAPS
    assert prop("smcd.service", "RestrictNamespaces") != "net"


# -- D-Bus ----------------------------------------------------------------------------------------


def test_busctl_introspect_and_bus_activation_by_name() -> None:
    out = sh("busctl", "introspect", "org.smcd", "/org/smcd")
    assert "org.smcd.Manager1" in out and ".PnetAdd" in out and ".Fallback" in out, out
    # Stop the daemon (the socket stays); a method call to the name starts it again.
    sh("systemctl", "stop", "smcd.service")
    assert prop("smcd.service", "ActiveState") == "inactive"
    out = sh("busctl", "--timeout=120", "call", "org.smcd", "/org/smcd", "org.smcd.Manager1",
             "GetInfo")  # fmt: skip
    assert "Version" in out, out
    # smcd answers on the bus as soon as it owns the name; systemd shows it "active" once its
    # READY=1, sent right after, is processed ("activating" until then, seen on a busy host).
    wait_for("smcd.service active", lambda: prop("smcd.service", "ActiveState") == "active",
             timeout=60)  # fmt: skip
    dbus_log = sh("journalctl", "--no-pager", "-u", "dbus.service")
    assert "Activating via systemd: service name='org.smcd'" in dbus_log, dbus_log[-2000:]


def test_unprivileged_user_reads_and_is_refused_changes() -> None:
    """smcctl without --bus finds the service on the system bus, as nobody too."""
    for args in (["info"], ["conns", "-a"], ["linkgroup", "show"], ["stats"]):
        r = run("smcctl", *args, user=AS_NOBODY)
        assert r.returncode == 0, f"smcctl {' '.join(args)} as nobody: {r.stderr}"
    assert UEID in run("smcctl", "info", user=AS_NOBODY).stdout
    for args in (["pnet", "add", "NET1", "-I", "lo"], ["ueid", "add", "OTHER"],
                 ["stats", "reset"]):  # fmt: skip
        r = run("smcctl", *args, user=AS_NOBODY)
        assert r.returncode == 1, f"smcctl {' '.join(args)} as nobody: exit {r.returncode}"
        lines = r.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("smcctl: permission denied"), r.stderr
        assert r.stdout == ""
    # root may
    sh("smcctl", "stats", "reset")


def test_unprivileged_smc_run_gets_smcd_and_buffers_stay_private(app: App) -> None:
    port = app.ask(op="listen")["port"]
    c = app.ask(op="connect", port=port)
    assert c["mode"] == "smcd", c
    app.ask(op="echo", id=c["id"], size=100_000)
    fds = app.ask(op="fds")
    assert fds["uid"] == 65534 and fds["memfds"], fds
    # Another unprivileged user cannot reach the application's shared-memory buffers.
    for fd in fds["memfds"][:2]:
        r = run("/usr/bin/python3", "-c", f"open('/proc/{fds['pid']}/fd/{fd}', 'rb')",
                user=AS_DAEMON_USER)  # fmt: skip
        assert r.returncode != 0 and "PermissionError" in r.stderr, r.stderr
    # smcctl conns shows it, with the user's uid
    conns = json.loads(sh("smcctl", "conns", "--json"))
    assert any(x["Uid"] == 65534 and x["Mode"] == "SMCD" for x in conns), conns


# -- journal --------------------------------------------------------------------------------------


def test_journal_start_and_fallbacks_with_reason_fields(app: App) -> None:
    port = app.ask(op="plain-listen")["port"]  # not registered with smcd
    c = app.ask(op="connect", port=port)
    assert c["mode"] == "tcp" and c["fallback"], c
    reason = "SMC_CLC_DECL_PEERNOSMC"

    def entries() -> list[dict[str, Any]]:
        out = sh("journalctl", "--no-pager", "-u", "smcd.service", f"SMC_REASON={reason}",
                 "-o", "json")  # fmt: skip
        return [json.loads(x) for x in out.splitlines() if x.strip()]

    found = wait_for("the fallback in the journal", entries, timeout=30)
    e = found[-1]
    assert e["SMC_UID"] == "65534" and e["SMC_ROLE"] == "CLIENT", e
    assert e["SMC_REASON_CODE"].startswith("0x"), e
    text = journal()
    assert f"fell back to TCP: {reason}" in text
    assert "ready: serving org.smcd on the system bus" in text


# -- reload ---------------------------------------------------------------------------------------


def test_reload_applies_a_change_and_keeps_the_old_on_an_invalid_file() -> None:
    pid = prop("smcd.service", "MainPID")
    good = CONFIG.read_text()
    try:
        CONFIG.write_text(good.replace('log_level = "info"', 'log_level = "debug"'))
        sh("systemctl", "reload", "smcd.service")
        wait_for(
            "the reload's STATUS",
            lambda: "applied log_level" in prop("smcd.service", "StatusText"),
        )
        CONFIG.write_text(good.replace('log_level = "info"', 'log_level = "loud"'))
        sh("systemctl", "reload", "smcd.service")

        def failed_status() -> str:
            text = prop("smcd.service", "StatusText")
            return text if "failed" in text else ""

        status = wait_for("the failed reload's STATUS", failed_status)
        assert "still running with the previous configuration" in status, status
        text = journal()
        assert "reload: applied log_level" in text
        assert "reload: " in text and "loud" in text, text[-3000:]
        assert prop("smcd.service", "MainPID") == pid
        assert prop("smcd.service", "ActiveState") == "active"
    finally:
        CONFIG.write_text(good)
        sh("systemctl", "reload", "smcd.service")


# -- watchdog -------------------------------------------------------------------------------------


def test_systemctl_restart_keeps_channels_moving(app: App) -> None:
    """``systemctl restart smcd`` stops the daemon in order (SIGTERM): a live connection goes
    on through the restart, and the new daemon finds the journal to verify it by. The stop
    used to release every channel half as if its application had hung up, which zeroes the
    DMBs under the rings: the next echo failed on zeroed cursors."""
    c = app.ask(op="connect", port=app.ask(op="listen")["port"])
    assert c["mode"] == "smcd", c
    app.ask(op="echo", id=c["id"], size=300_000)
    pid = restart_smcd()
    app.ask(op="echo", id=c["id"], size=300_000)  # raises on an error or a differing byte
    logged = sh("journalctl", "--no-pager", f"_PID={pid}")
    assert "channel halves of the previous daemon may resume" in logged, logged[-2000:]
    app.ask(op="close", id=c["id"])


def test_watchdog_restarts_a_frozen_daemon_and_channels_keep_moving(app: App) -> None:
    port = app.ask(op="listen")["port"]
    c = app.ask(op="connect", port=port)
    assert c["mode"] == "smcd", c
    pid = int(prop("smcd.service", "MainPID"))
    restarts = int(prop("smcd.service", "NRestarts"))
    assert prop("smcd.service", "WatchdogUSec") in ("20s", "20000000")
    os.kill(pid, 19)  # SIGSTOP
    try:
        app.ask(op="echo", id=c["id"], size=300_000)  # the channel needs no daemon
        wait_for(
            "systemd to restart smcd",
            lambda: (
                prop("smcd.service", "MainPID") not in ("0", str(pid))
                and prop("smcd.service", "SubState") == "running"
            ),
            timeout=150,
        )
    finally:
        if os.path.exists(f"/proc/{pid}"):
            os.kill(pid, 18)  # SIGCONT, should the test fail before the watchdog fired
    assert int(prop("smcd.service", "NRestarts")) == restarts + 1
    assert "Watchdog timeout" in sh("journalctl", "--no-pager", "-u", "smcd.service")
    app.ask(op="echo", id=c["id"], size=300_000)  # still moving after the restart
    c2 = app.ask(op="connect", port=app.ask(op="listen")["port"])
    assert c2["mode"] == "smcd", c2
    app.ask(op="echo", id=c2["id"], size=10_000)


# -- stop, security, uninstall ---------------------------------------------------------------------


def _memfd_holders() -> list[str]:
    """Processes other than systemd itself (which keeps BPF programs of its own) holding a
    memfd or a BPF program."""
    out = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or proc.name == "1":
            continue
        try:
            for fd in (proc / "fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("/memfd:") or target == "anon_inode:bpf-prog":
                    out.append(f"{proc.name}: {target}")
        except OSError:
            continue
    return out


#: smcd's peer-detection programs (smcd_daemon/adapters/bpf/smc_option.bpf.c).
SMCD_BPF_PROGRAMS = {"smc_sockops", "smc_setsockopt", "smc_getsockopt"}


def test_stop_leaves_no_socket_memfd_or_bpf_program() -> None:
    sh("systemctl", "stop", "smcd.socket", "smcd.service")
    assert prop("smcd.service", "ActiveState") in ("inactive", "failed")
    assert not Path("/run/smcd/handoff.sock").exists()
    assert not Path("/run/smcd/bus").exists()
    assert run("pgrep", "-f", "/usr/bin/smcd --config").returncode == 1
    assert _memfd_holders() == []
    loaded = json.loads(sh("bpftool", "-j", "prog", "show") or "[]")
    assert not [p for p in loaded if p.get("name") in SMCD_BPF_PROGRAMS], loaded
    sh("systemctl", "start", "smcd.socket")


def test_security_score_is_the_readmes() -> None:
    text = (REPO / "README.md").read_text()
    m = re.search(r"scored (\d+\.\d) by\s+`systemd-analyze security`", text)
    assert m, "README.md should state the systemd-analyze security score"
    out = sh("systemd-analyze", "security", "--no-pager", "smcd.service")
    score = re.search(r"Overall exposure level for smcd\.service: (\d+\.\d)", out)
    assert score, out[-2000:]
    assert score.group(1) == m.group(1), out[-2000:]


def test_make_uninstall_removes_it() -> None:
    r = subprocess.run(["make", "uninstall"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    for path in ("/usr/bin/smcd", "/usr/bin/smcctl", "/usr/bin/smc-run", "/usr/lib/smcd",
                 "/usr/lib/systemd/system/smcd.service", "/usr/lib/systemd/system/smcd.socket",
                 "/usr/share/dbus-1/system.d/org.smcd.conf",
                 "/usr/share/dbus-1/system-services/org.smcd.service"):  # fmt: skip
        assert not os.path.lexists(path), path
    assert prop("smcd.socket", "LoadState") == "not-found"
    # The configuration was changed (a UEID added): kept, and said so.
    assert CONFIG.exists() and "keeping" in r.stdout
    # Nothing left to activate: smcctl (the checkout's) says where it looked.
    r = run(str(REPO / ".venv" / "bin" / "smcctl"), "info", user=AS_NOBODY)
    assert r.returncode == 1
    err = r.stderr.strip()
    assert err.startswith(
        "smcctl: smcd is not running: looked on the system bus (org.smcd has no owner)"
    ), err
    assert "/run/smcd/bus (no such file" in err, err
