"""Peer detection in the daemon: two smcd "hosts" (network namespaces joined by a veth pair),
each loading the BPF detector (``peer_detection = true``, attached to a test cgroup that holds
only this test's processes), with **no** ``peers`` configured.

- smcd client -> smcd server: both SYN and SYN-ACK carry the option and the client proposes
  without ``peers`` (the CLC exchange happens: on this machine there is no RDMA device and
  loopback-ism is per host, so the server declines and both ends keep the same intact TCP
  stream: the detected peer that declines);
- smcd client -> plain server: our SYN carries the option, the SYN-ACK does not, and the client
  falls back with PEERNOSMC before any CLC byte;
- plain client -> smcd server: no option anywhere, and the server hands the socket back at
  once (a banner arrives without waiting ``timeouts.proposal_wait``);
- plain client -> plain server: no option on the wire while the programs are attached;
- ``smcctl info`` names the programs, which are gone once smcd stops; a daemon that cannot
  load them says why.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.bpf.conftest import ADDR_B, Capture, Net
from tests.bpf.test_peer_detection import handshake, smc_option_on
from tests.control.daemon_proc import SMCD, NotifySocket, SmcdProcess

pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).resolve().parents[2]
PYTHON = REPO / ".venv" / "bin" / "python"
SMC_RUN = REPO / ".venv" / "bin" / "smc-run"
SMCCTL = REPO / ".venv" / "bin" / "smcctl"
PROPOSAL_WAIT = 4.0  # long, so that a server that waited for a Proposal shows it

SERVER = r"""
import socket, sys
addr, banner = sys.argv[1], sys.argv[2] == "banner"
lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
lsock.bind((addr, 0))
lsock.listen(8)
print("PORT", lsock.getsockname()[1], flush=True)
conn, _ = lsock.accept()
if banner:
    conn.sendall(b"220 hello\n")
buf = bytearray(1 << 16)
while n := conn.recv_into(buf):
    conn.sendall(memoryview(buf)[:n])
conn.close()
"""

CLIENT = r"""
import os, socket, sys, time
addr, port, banner = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "banner"
t0 = time.monotonic()
sock = socket.create_connection((addr, port), timeout=30)
if banner:
    line = b""
    while not line.endswith(b"\n"):
        line += sock.recv(100)
    assert line == b"220 hello\n", line
    print("BANNER", round(time.monotonic() - t0, 3), flush=True)
for i in range(50):
    msg = os.urandom(65536)
    sock.sendall(msg)
    got = bytearray()
    while len(got) < len(msg):
        k = sock.recv(65536)
        if not k:
            raise SystemExit(f"EOF in round {i}")
        got += k
    if got != msg:
        raise SystemExit(f"round {i}: the echo differs")
print("RR OK", flush=True)
sock.close()
"""

VERBOSE = re.compile(
    r"smc-run\[\d+\]: (connect|accept) \(.*?\): (\w+)(?: conn \d+)?(?: \((.*)\))?$"
)


def modes(stderr: str) -> list[tuple[str, str, str]]:
    return [(m[1], m[2], m[3] or "") for ln in stderr.splitlines() if (m := VERBOSE.search(ln))]


@dataclass
class Host:
    ns: str
    run: Path
    proc: SmcdProcess
    env: dict[str, str]

    def smcctl(self, *args: str, check_rc: bool = True) -> str:
        argv = ["ip", "netns", "exec", self.ns, os.fspath(SMCCTL), *args]
        r = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=self.env)
        assert r.returncode == 0 or not check_rc, r.stderr
        return r.stdout


def start_host(net: Net, ns: str, name: str, cgroup: Path, extra: str = "", **env: str) -> Host:
    run = net.work / name
    run.mkdir()
    (run / "smcd.toml").write_text(
        f'peer_detection = true\n{extra}[eid]\nueids = ["SMCD-BPF-E2E"]\n'
        f"[timeouts]\nproposal_wait = {PROPOSAL_WAIT}\n"
    )
    argv = [
        "ip", "netns", "exec", ns, os.fspath(SMCD), "--config", os.fspath(run / "smcd.toml"),
        "--runtime-dir", os.fspath(run), "--state-dir", os.fspath(run / "state"),
        "--handoff-socket", os.fspath(run / "handoff.sock"), "--bus", "private",
        "--log-level", "debug",
    ]  # fmt: skip
    proc = SmcdProcess(argv, net.work / f"{name}.log", NotifySocket(net.work / f"{name}.ntf"))
    proc.start(env_extra={"SMCD_BPF_CGROUP": os.fspath(cgroup), **env})
    proc.wait_ready()
    app_env = {k: v for k, v in os.environ.items() if not k.startswith(("SMCD_", "SMC_RUN"))}
    app_env |= {
        "SMCD_HANDOFF_SOCKET": os.fspath(run / "handoff.sock"),
        "SMCD_BUS": "private",
        "SMCD_RUNTIME_DIR": os.fspath(run),
        "PYTHONPATH": os.fspath(REPO),
    }
    return Host(ns, run, proc, app_env)


@pytest.fixture
def cg_seen(cgroup: Path, net: Net) -> Iterator[Path]:
    """The test cgroup as a daemon under ``ip netns exec`` sees it: that command remounts
    /sys, so the cgroup2 hierarchy is mounted once more under the test's work directory."""
    where = net.work / "cgroup2"
    where.mkdir()
    subprocess.run(["mount", "-t", "cgroup2", "none", os.fspath(where)], check=True, timeout=30)
    try:
        yield where / cgroup.name
    finally:
        subprocess.run(["umount", "-l", os.fspath(where)], check=False, timeout=30)


@pytest.fixture
def hosts(bpf_object: Path, cg_seen: Path, net: Net) -> Iterator[tuple[Host, Host]]:
    started: list[Host] = []
    try:
        started.append(start_host(net, net.ns_a, "a", cg_seen))
        started.append(start_host(net, net.ns_b, "b", cg_seen))
        yield started[0], started[1]
    finally:
        for h in started:
            if h.proc.alive():
                h.proc.stop()


def run_pair(
    net: Net, client: Host, server: Host, *, smc_client: bool, smc_server: bool, banner: bool
) -> tuple[str, str, str]:
    """Server in B, client in A, each under ``smc-run -v`` or plain; returns (client stdout,
    client stderr, server stderr)."""
    mode = "banner" if banner else "echo"

    def argv(smc: bool, ns: str, code: str, *args: object) -> list[str]:
        prog = [os.fspath(PYTHON), "-c", code, *map(str, args)]
        return ["ip", "netns", "exec", ns, *([os.fspath(SMC_RUN), "-v"] if smc else []), *prog]

    srv = subprocess.Popen(argv(smc_server, server.ns, SERVER, ADDR_B, mode),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env=server.env)  # fmt: skip
    try:
        assert srv.stdout is not None
        first = srv.stdout.readline()
        assert first.startswith("PORT "), (first, srv.communicate(timeout=10))
        port = int(first.split()[1])
        cli = subprocess.run(argv(smc_client, client.ns, CLIENT, ADDR_B, port, mode),
                             capture_output=True, text=True, env=client.env,
                             timeout=120)  # fmt: skip
        assert cli.returncode == 0, cli.stderr
        _, serr = srv.communicate(timeout=60)
        assert srv.returncode == 0, serr
        return cli.stdout, cli.stderr, serr
    finally:
        if srv.poll() is None:
            srv.kill()
            srv.wait()


def options(cap: Capture) -> tuple[bool, bool]:
    """(SYN carried the option, SYN-ACK carried it) of the one connection captured."""
    rows = [r for r in cap.packets() if r["tcp.srcport"] != "" and r["tcp.dstport"] != ""]
    port = next(r["tcp.dstport"] for r in rows if r["tcp.flags.syn"] in ("1", "True"))
    syn, synack, *rest = handshake(rows, int(port))
    assert not any(smc_option_on(r) for r in rest), "the option on a non-SYN segment"
    return smc_option_on(syn), smc_option_on(synack)


def test_smcd_hosts_reach_clc_without_peers(hosts: tuple[Host, Host], net: Net) -> None:
    a, b = hosts
    cap = net.capture()
    out, cerr, serr = run_pair(net, a, b, smc_client=True, smc_server=True, banner=False)
    assert options(cap) == (True, True), (cerr, serr, a.proc.log()[-3000:])
    assert "RR OK" in out
    ((_, cmode, creason),), ((_, smode, sreason),) = modes(cerr), modes(serr)
    assert (cmode, smode) == ("tcp", "tcp"), (cerr, serr)
    # the client proposed (no peers configured): the server's decline came back as PEERDECL
    assert creason.startswith("SMC_CLC_DECL_PEERDECL"), creason
    assert re.match(r"SMC_CLC_DECL_(NOSMCD2DEV|NOUEID|NOSMCDEV|NOSMCRDEV)", sreason), sreason
    assert "the peer's SYN-ACK carried the SMC TCP option" in a.proc.log()


def test_smcd_client_to_plain_server_falls_back_before_clc(
    hosts: tuple[Host, Host], net: Net
) -> None:
    a, b = hosts
    cap = net.capture()
    out, cerr, _ = run_pair(net, a, b, smc_client=True, smc_server=False, banner=True)
    assert options(cap) == (True, False)
    assert "RR OK" in out and "BANNER" in out  # the banner is the stream's first byte: no CLC
    ((_, cmode, creason),) = modes(cerr)
    assert cmode == "tcp" and creason.startswith("SMC_CLC_DECL_PEERNOSMC"), creason
    assert "SYN-ACK carried no SMC TCP option" in creason


def test_plain_client_to_smcd_server_is_handed_back_at_once(
    hosts: tuple[Host, Host], net: Net
) -> None:
    a, b = hosts
    cap = net.capture()
    out, _, serr = run_pair(net, a, b, smc_client=False, smc_server=True, banner=True)
    assert options(cap) == (False, False)
    ((_, smode, sreason),) = modes(serr)
    assert smode == "tcp" and "SYN carried no SMC TCP option" in sreason, sreason
    waited = float(re.search(r"BANNER ([0-9.]+)", out)[1])  # type: ignore[index]
    assert waited < PROPOSAL_WAIT / 2, f"the banner waited {waited} s (proposal_wait)"


def test_plain_programs_show_no_option(hosts: tuple[Host, Host], net: Net) -> None:
    a, b = hosts
    cap = net.capture()
    out, _, _ = run_pair(net, a, b, smc_client=False, smc_server=False, banner=False)
    assert "RR OK" in out
    assert options(cap) == (False, False)


def test_info_names_the_programs_and_stop_detaches(hosts: tuple[Host, Host]) -> None:
    a, _ = hosts
    info = a.smcctl("info")
    found = re.search(r"peer detection: TCP option via BPF \(programs (\d+), (\d+)", info)
    assert found, info
    ids = [found[1], found[2]]
    for i in ids:
        show = subprocess.run(["bpftool", "prog", "show", "id", i], capture_output=True,
                              text=True, timeout=30)  # fmt: skip
        assert show.returncode == 0, show.stderr
    assert a.proc.stop() == 0
    deadline = time.monotonic() + 10
    while True:
        shows = [
            subprocess.run(["bpftool", "prog", "show", "id", i], capture_output=True, timeout=30)
            for i in ids
        ]
        if all(r.returncode != 0 for r in shows):
            break
        assert time.monotonic() < deadline, f"programs {ids} still loaded after smcd stopped"
        time.sleep(0.2)
    assert "BPF programs detached" in a.proc.log()


def test_unavailable_detection_is_reported(bpf_object: Path, cg_seen: Path, net: Net) -> None:
    h = start_host(net, net.ns_a, "nodet", cg_seen, SMCD_BPF_OBJECT="/nonexistent/smc.bpf.o")
    try:
        info = h.smcctl("info")
        assert "peer detection: unavailable: /nonexistent/smc.bpf.o is not built" in info, info
        assert "SMC peer detection unavailable" in h.proc.log()
    finally:
        h.proc.stop()


def test_smcctl_check_reports_detection(hosts: tuple[Host, Host], net: Net) -> None:
    """``smcctl check`` from A to ``smcctl check --serve`` on B: our SYN asked for the option,
    the server's SYN-ACK answered (a Proposal went out without peers) and B declined."""
    a, b = hosts
    serve = ["ip", "netns", "exec", b.ns, os.fspath(SMCCTL), "check", "--serve", "47010",
             "--bind", ADDR_B, "--once"]  # fmt: skip
    srv = subprocess.Popen(serve, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env=b.env)  # fmt: skip
    try:
        assert srv.stdout is not None
        assert "registered with smcd" in srv.stdout.readline()
        out = json.loads(a.smcctl("check", ADDR_B, "47010", "--json", check_rc=False))
        assert out["option_requested"] is True, out
        assert out["mode"] == "tcp" and out["server"]["mode"] == "tcp", out
        assert out["fallback"]["name"] == "SMC_CLC_DECL_PEERDECL", out
        assert "peer_diagnosis" in out["fallback"] and out["echo"] == "65536 bytes intact", out
    finally:
        if srv.poll() is None:
            srv.kill()
        srv.wait()
