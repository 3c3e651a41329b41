"""Peer detection for containers in cgroups of their own (#15): the programs attached at one
cgroup cover every cgroup below it, so one smcd attached at the root of the hierarchy covers the
containers a runtime puts in child cgroups. Here the detector is attached at the test's cgroup and
the client runs in a child of it ("the container's cgroup"), in namespace A (``nsenter``, which
keeps the mounts): its marked socket's SYN carries the SMC option on the wire and the server
learns it; a plain program in a sibling container's cgroup sends no option.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from smcd_daemon.adapters.bpf import Detector
from tests.bpf.conftest import ADDR_B, REPO, Net
from tests.bpf.test_peer_detection import PORT, handshake, listener, smc_option_on

CLIENT = r"""
import json, socket, sys
from smcd_daemon.adapters.bpf import request_option
sys.stdin.readline()  # the test has moved us into the container's cgroup by now
cli = socket.socket()
asked = request_option(cli) if sys.argv[3] == "marked" else False
cli.settimeout(5)
cli.connect((sys.argv[1], int(sys.argv[2])))
cli.sendall(b"ping")
print(json.dumps({"asked": asked, "echo": cli.recv(16).decode()}), flush=True)
cli.close()
"""


@pytest.fixture
def det(bpf_object: Path, cgroup: Path) -> Iterator[Detector]:
    d = Detector.load(cgroup, obj_path=bpf_object)
    try:
        yield d
    finally:
        d.close()


def run_in_container(det: Detector, cgroup: Path, name: str, net: Net, srv: socket.socket,
                     how: str) -> dict[str, object]:  # fmt: skip
    """The client program in cgroup ``cgroup/name`` and namespace A, against ``srv``; what it
    said, and what the server's end learned about the option."""
    container = cgroup / name
    container.mkdir()
    argv = ["nsenter", f"--net=/run/netns/{net.ns_a}", sys.executable, "-c", CLIENT, ADDR_B,
            str(PORT), how]  # fmt: skip
    proc = subprocess.Popen(
        argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": os.fspath(REPO)},
    )  # fmt: skip
    try:
        (container / "cgroup.procs").write_text(str(proc.pid))
        assert (container / "cgroup.procs").read_text().split() == [str(proc.pid)]
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write("go\n")
        proc.stdin.flush()
        conn, _ = srv.accept()
        assert conn.recv(16) == b"ping"
        conn.sendall(b"pong")
        out = proc.stdout.readline()
        assert proc.wait(10) == 0, proc.stderr.read() if proc.stderr else ""
        got: dict[str, object] = json.loads(out)
        got["server_learned"] = det.peer_has_option(conn)
        conn.close()
        return got
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        container.rmdir()


def test_a_container_in_its_own_cgroup_is_covered(det: Detector, cgroup: Path, net: Net) -> None:
    srv = listener(net)
    assert det.mark_listener(srv).armed
    cap = net.capture()
    got = run_in_container(det, cgroup, "container-a", net, srv, "marked")
    assert got == {"asked": True, "echo": "pong", "server_learned": True}, got
    syn, synack, *rest = handshake(cap.packets())
    assert smc_option_on(syn), syn
    assert smc_option_on(synack), synack
    assert not any(smc_option_on(r) for r in rest)
    # a plain program in a sibling container: no option on its SYN, the server learns False
    cap = net.capture()
    got = run_in_container(det, cgroup, "container-b", net, srv, "plain")
    assert got == {"asked": False, "echo": "pong", "server_learned": False}, got
    syn, *_ = handshake(cap.packets())
    assert not smc_option_on(syn), syn
    srv.close()
