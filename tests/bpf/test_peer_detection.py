"""SMC peer detection on the wire: the RFC 7609 option appears exactly where it must.

Each test loads the real programs into a test cgroup, connects across a veth pair between two
network namespaces, reads the packets back with tshark (which decodes kind 254 as an RFC 6994
experimental option: ExID 0xE2D4, data C3D9 = the SMC magic 0xE2D4C3D9) and asks the detector
what each end learned.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from smcd_daemon.adapters.bpf import (
    DetectionUnavailable,
    Detector,
    Flag,
    request_option,
)
from tests.bpf.conftest import ADDR_B, REPO, Net

PORT = 20611


@pytest.fixture
def det(bpf_object: Path, cgroup: Path) -> Iterator[Detector]:
    d = Detector.load(cgroup, obj_path=bpf_object)
    try:
        yield d
    finally:
        d.close()


def listener(net: Net, port: int = PORT) -> socket.socket:
    srv = net.socket(net.ns_b)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((ADDR_B, port))
    srv.listen(8)
    srv.settimeout(5)
    return srv


def exchange(cli: socket.socket, srv: socket.socket, port: int = PORT) -> socket.socket:
    """Connect, accept, move a few bytes both ways (data segments must stay unmarked)."""
    cli.settimeout(5)
    cli.connect((ADDR_B, port))
    conn, _ = srv.accept()
    cli.sendall(b"ping" * 100)
    assert conn.recv(4096)
    conn.sendall(b"pong")
    assert cli.recv(16) == b"pong"
    return conn


def smc_option_on(row: dict[str, str]) -> bool:
    """True if tshark decoded the SMC option (kind 254, ExID 0xe2d4, data c3d9) on the packet."""
    kinds = row["tcp.option_kind"].split(",")
    if "254" not in kinds:
        return False
    exid = int(row["tcp.options.experimental.exid"], 0)
    data = row["tcp.options.experimental.data"].replace(":", "").lower()
    assert (exid, data) == (0xE2D4, "c3d9"), f"kind 254 without the SMC magic: {row}"
    return True


def handshake(rows: list[dict[str, str]], port: int = PORT) -> tuple[dict[str, str], ...]:
    syn = [r for r in rows if r["tcp.flags.syn"] in ("1", "True") and r["tcp.flags.ack"] in (
        "0", "False")]  # fmt: skip
    synack = [r for r in rows if r["tcp.flags.syn"] in ("1", "True") and r not in syn]
    rest = [r for r in rows if r not in syn and r not in synack]
    assert syn and synack and rest, rows
    assert syn[0]["tcp.dstport"] == str(port)
    return syn[0], synack[0], *rest


def test_marked_client_to_registered_listener(det: Detector, net: Net) -> None:
    srv = listener(net)
    mark = det.mark_listener(srv)
    assert mark.armed and mark.port == PORT
    cli = net.socket(net.ns_a)
    assert request_option(cli) is True
    cap = net.capture()
    conn = exchange(cli, srv)
    syn, synack, *rest = handshake(cap.packets())
    assert smc_option_on(syn), syn
    assert smc_option_on(synack), synack
    assert not any(smc_option_on(r) for r in rest), "option on a non-SYN segment"
    # Wireshark names the experiment: it recognizes the SMC magic, not just "some kind 254"
    assert cap.dissection().count("Shared Memory communications over") >= 2
    assert det.peer_has_option(cli) is True
    assert det.peer_has_option(conn) is True
    assert det.state(cli) is not None and det.state(cli).flags == (  # type: ignore[union-attr]
        Flag.WANT | Flag.SENT | Flag.PEER | Flag.DONE
    )
    assert det.peer_has_option(srv) is None  # a listener has no peer
    for s in (cli, conn, srv):
        s.close()


def test_plain_programs_never_carry_the_option(det: Detector, net: Net) -> None:
    srv = listener(net)  # not registered with smcd
    cli = net.socket(net.ns_a)  # never asked for SMC
    cap = net.capture()
    conn = exchange(cli, srv)
    rows = cap.packets()
    handshake(rows)
    assert not any(smc_option_on(r) for r in rows)
    assert det.peer_has_option(cli) is None and det.peer_has_option(conn) is None
    for s in (cli, conn, srv):
        s.close()


def test_plain_client_to_registered_listener(det: Detector, net: Net) -> None:
    """The server learns at once that the client is no SMC peer: hand it back, no wait."""
    srv = listener(net)
    det.mark_listener(srv)
    cli = net.socket(net.ns_a)
    cap = net.capture()
    conn = exchange(cli, srv)
    rows = cap.packets()
    handshake(rows)
    assert not any(smc_option_on(r) for r in rows)
    assert det.peer_has_option(conn) is False
    assert det.peer_has_option(cli) is None
    for s in (cli, conn, srv):
        s.close()


def test_marked_client_to_unregistered_listener(det: Detector, net: Net) -> None:
    srv = listener(net)
    cli = net.socket(net.ns_a)
    det.mark_client(cli)  # the daemon-side way of asking
    cap = net.capture()
    conn = exchange(cli, srv)
    syn, synack, *_ = handshake(cap.packets())
    assert smc_option_on(syn)
    assert not smc_option_on(synack)
    assert det.peer_has_option(cli) is False  # -> PEERNOSMC without a CLC byte
    assert det.state(cli).flags & Flag.SENT  # type: ignore[union-attr]
    assert det.peer_has_option(conn) is None
    for s in (cli, conn, srv):
        s.close()


def test_unregistered_listener_stops_answering(det: Detector, net: Net) -> None:
    srv = listener(net)
    mark = det.mark_listener(srv)
    det.unmark_listener(mark)
    det.unmark_listener(mark)  # twice: no error
    cli = net.socket(net.ns_a)
    request_option(cli)
    conn = exchange(cli, srv)
    assert det.peer_has_option(cli) is False
    for s in (cli, conn, srv):
        s.close()


def test_listener_in_another_namespace_is_not_registered(det: Detector, net: Net) -> None:
    """Registration is per (network namespace, port): the same port in A stays plain."""
    srv_b = listener(net)
    det.mark_listener(srv_b)
    srv_a = net.socket(net.ns_a)
    srv_a.bind(("127.0.0.1", PORT))
    srv_a.listen(1)
    cli = net.socket(net.ns_a)
    request_option(cli)
    cli.settimeout(5)
    cli.connect(("127.0.0.1", PORT))
    conn, _ = srv_a.accept()
    assert det.peer_has_option(cli) is False
    assert det.peer_has_option(conn) is None
    for s in (cli, conn, srv_a, srv_b):
        s.close()


def test_ipv6(det: Detector, net: Net) -> None:
    """The SYN-ACK record is keyed by the full 128-bit addresses (here ::1 inside B)."""
    srv = net.socket(net.ns_b, socket.AF_INET6)
    srv.bind(("::1", PORT))
    srv.listen(1)
    srv.settimeout(5)
    det.mark_listener(srv)
    cli = net.socket(net.ns_b, socket.AF_INET6)
    plain = net.socket(net.ns_b, socket.AF_INET6)
    assert request_option(cli)
    cli.settimeout(5)
    plain.settimeout(5)
    cli.connect(("::1", PORT))
    conn, _ = srv.accept()
    plain.connect(("::1", PORT))
    conn_plain, _ = srv.accept()
    assert det.peer_has_option(cli) is True and det.peer_has_option(conn) is True
    assert det.peer_has_option(plain) is None and det.peer_has_option(conn_plain) is False
    for s in (cli, conn, plain, conn_plain, srv):
        s.close()


def test_request_option_rules(det: Detector, net: Net) -> None:
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    with pytest.raises(PermissionError):  # only TCP sockets
        request_option(udp)
    udp.close()
    srv = listener(net)
    cli = net.socket(net.ns_a)
    conn = exchange(cli, srv)
    with pytest.raises(PermissionError):  # too late: the SYN is gone
        request_option(cli)
    for s in (cli, conn, srv):
        s.close()


def test_close_detaches(bpf_object: Path, cgroup: Path, net: Net) -> None:
    d = Detector.load(cgroup, obj_path=bpf_object)
    ids = d.program_ids()
    shown = subprocess.run(["bpftool", "cgroup", "show", str(cgroup)], capture_output=True,
                           text=True, check=True).stdout  # fmt: skip
    for pid in ids:
        assert str(pid) in shown, shown
    assert "sock_ops" in shown and "setsockopt" in shown, shown
    d.close()
    d.close()  # idempotent
    shown = subprocess.run(["bpftool", "cgroup", "show", str(cgroup)], capture_output=True,
                           text=True, check=True).stdout  # fmt: skip
    assert shown.strip() == "", shown
    for pid in ids:  # the programs are gone from the kernel, not only detached
        r = subprocess.run(["bpftool", "prog", "show", "id", str(pid)], capture_output=True)
        assert r.returncode != 0
    # and the wire is plain again: the private option is unknown to the kernel
    srv = listener(net)
    cli = net.socket(net.ns_a)
    assert request_option(cli) is False
    cap = net.capture()
    conn = exchange(cli, srv)
    assert not any(smc_option_on(r) for r in cap.packets())
    for s in (cli, conn, srv):
        s.close()


def test_unprivileged_load_is_a_typed_error(bpf_object: Path) -> None:
    """Without CAP_BPF/CAP_NET_ADMIN: DetectionUnavailable naming them, never a silent no-op."""
    code = (
        "from smcd_daemon.adapters.bpf import Detector, DetectionUnavailable\n"
        "try:\n    Detector.load()\nexcept DetectionUnavailable as e:\n    print(e.reason)\n"
        "else:\n    print('LOADED')\n"
    )
    python = REPO / ".venv" / "bin" / "python"
    drop = "-bpf,-net_admin,-sys_admin,-perfmon"  # setpriv: util-linux, in install-deps.sh
    argv = ["setpriv", "--bounding-set", drop, os.fspath(python), "-c", code]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert "CAP_BPF" in r.stdout and "CAP_NET_ADMIN" in r.stdout, r.stdout
    assert issubclass(DetectionUnavailable, Exception)


#: Exactly what smcd.service grants (CapabilityBoundingSet= and AmbientCapabilities=).
SERVICE_CAPS = ["--inh-caps=-all,+bpf,+net_admin", "--ambient-caps=-all,+bpf,+net_admin",
                "--bounding-set=-all,+bpf,+net_admin"]  # fmt: skip
LOAD = (
    "import sys\nfrom smcd_daemon.adapters.bpf import Detector, DetectionUnavailable\n"
    "try:\n    d = Detector.load(sys.argv[1] if len(sys.argv) > 1 else None)\n"
    "except DetectionUnavailable as e:\n    print(e.reason)\n"
    "else:\n    print('LOADED', d.program_ids())\n    d.close()\n"
)


def test_the_services_capabilities_suffice(bpf_object: Path, cgroup: Path) -> None:
    """CAP_BPF and CAP_NET_ADMIN alone (no CAP_SYS_ADMIN, no CAP_PERFMON, not even uid 0) load
    and attach the programs: what smcd.service grants is enough on an existing cgroup2."""
    python = REPO / ".venv" / "bin" / "python"
    argv = ["setpriv", *SERVICE_CAPS, "--reuid=nobody", "--regid=nogroup", "--clear-groups",
            os.fspath(python), "-c", LOAD, os.fspath(cgroup)]  # fmt: skip
    r = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("LOADED ["), r.stdout + r.stderr


def test_no_narrow_register_stores_on_the_stack(bpf_object: Path) -> None:
    """Linux 6.1's verifier, without CAP_PERFMON (which smcd.service does not grant), refuses a
    second store of less than 8 bytes into a stack slot holding a narrower register spill
    ("attempt to corrupt spilled pointer on stack"); this host's newer kernel accepts it, so the
    test above cannot see it. The programs therefore store registers to the stack only as whole
    words (smc_option.bpf.c, word())."""
    objdump = shutil.which("llvm-objdump") or shutil.which("llvm-objdump-14")
    assert objdump, "llvm-objdump is missing (package llvm-14, a dependency of clang)"
    r = subprocess.run([objdump, "-d", "--no-show-raw-insn", os.fspath(bpf_object)],
                       capture_output=True, text=True, timeout=60, check=True)  # fmt: skip
    assert "smc_sockops" in r.stdout, r.stdout[:2000]
    narrow = re.findall(r"^\s*\d+:\s*\*\(u(?:8|16|32) \*\)\(r10 - \d+\) = r\d+$", r.stdout, re.M)
    assert narrow == [], narrow


def test_no_cgroup2_and_no_sys_admin_says_where_the_hierarchy_must_come_from(
    bpf_object: Path,
) -> None:
    """With the service's capabilities but no cgroup2 mount (a pure v1 host), smcd may not mount
    one (no CAP_SYS_ADMIN): the reason names the layout to boot with, not a capability the unit
    would never grant."""
    python = REPO / ".venv" / "bin" / "python"
    inner = (
        "umount -a -t cgroup2; ! grep -q ' - cgroup2 ' /proc/self/mountinfo && "
        f'exec setpriv {" ".join(SERVICE_CAPS)} {python} -c "$0"'
    )
    argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c", inner, LOAD]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=REPO)
    assert r.returncode == 0, r.stderr
    reason = r.stdout.strip()
    assert reason.startswith("no cgroup v2 hierarchy is mounted and smcd lacks CAP_SYS_ADMIN"), (
        reason
    )
    assert "/sys/fs/cgroup/unified" in reason, reason


def test_half_open_records_are_purged(det: Detector, net: Net) -> None:
    """A SYN-ACK that carried the option leaves a record until the handshake completes;
    completed handshakes consume theirs, so nothing is left to purge afterwards."""
    srv = listener(net)
    det.mark_listener(srv)
    cli = net.socket(net.ns_a)
    request_option(cli)
    conn = exchange(cli, srv)
    assert det.purge_half_open(older_than=0) == 0
    for s in (cli, conn, srv):
        s.close()
