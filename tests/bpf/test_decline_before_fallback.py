"""A client half that falls back before its Proposal toward a peer that showed the SMC TCP
option declines first, as the kernel's ``smc_connect_decline_fallback`` does (#11, #14).

Two smcd "hosts" with peer detection and no ``peers`` (as ``test_daemon_detection``); the
client host A refuses its own application's handoff before any CLC message, the detecting
server host B waits for CLC because the SYN carried the option. Without the Decline B's server
application would read the client's data as CLC (or B would decline into it). Each test checks
that the server application reads exactly the client's bytes (the echo is compared), both
fallback reasons (client: the local code; server: PEERDECL with the client's code), and that the
Decline crossed the veth as the client's first payload (tshark).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.bpf import test_daemon_detection as dd
from tests.bpf.conftest import ADDR_B, Net, _need
from tests.bpf.test_daemon_detection import PYTHON, Host, modes, options, run_pair, start_host

pytestmark = pytest.mark.timeout(300)
cg_seen = dd.cg_seen  # the fixture: the test cgroup as a daemon in a namespace sees it

MAX_DMB = 0x030D0000
NOSMCDEV = 0x03030000


def two_hosts(
    net: Net, cg: Path, extra_a: str = "", extra_b: str = ""
) -> Iterator[tuple[Host, Host]]:
    started: list[Host] = []
    try:
        started.append(start_host(net, net.ns_a, "a", cg, extra_a))
        started.append(start_host(net, net.ns_b, "b", cg, extra_b))
        yield started[0], started[1]
    finally:
        for h in started:
            if h.proc.alive():
                h.proc.stop()


@pytest.fixture
def hosts_plain(bpf_object: Path, cg_seen: Path, net: Net) -> Iterator[tuple[Host, Host]]:
    yield from two_hosts(net, cg_seen)


@pytest.fixture
def limited(bpf_object: Path, cg_seen: Path, net: Net) -> Iterator[tuple[Host, Host]]:
    """A: one handoff connection per user (a held one fills it); B as usual."""
    yield from two_hosts(
        net, cg_seen, "[limits]\nconnections_per_user = 1\nfirst_request_wait = 120\n"
    )


@pytest.fixture
def one_handshake(bpf_object: Path, cg_seen: Path, net: Net) -> Iterator[tuple[Host, Host]]:
    """A: one handshake in flight per user; B as usual."""
    yield from two_hosts(net, cg_seen, "[limits]\nhandshakes_per_user = 1\n")


@pytest.fixture
def smc_off(bpf_object: Path, cg_seen: Path, net: Net) -> Iterator[tuple[Host, Host]]:
    """A: every SMC mode switched off; B as usual."""
    modes_off = "[modes]\nsmcd_loopback = false\nsmcr_v1 = false\nsmcr_v2 = false\n"
    yield from two_hosts(net, cg_seen, modes_off)


@pytest.fixture
def server_limited(bpf_object: Path, cg_seen: Path, net: Net) -> Iterator[tuple[Host, Host]]:
    """B: one handoff connection per user (its application's LISTEN fills it); A as usual."""
    yield from two_hosts(net, cg_seen, "", "[limits]\nconnections_per_user = 1\n")


def hold_handoff_connection(host: Host) -> subprocess.Popen[str]:
    """A process of the same uid in A's namespace holding one idle handoff connection."""
    code = (
        "import socket, sys, time\n"
        "s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)\n"
        "s.connect(sys.argv[1])\n"
        "print('HELD', flush=True)\n"
        "time.sleep(300)\n"
    )
    argv = ["ip", "netns", "exec", host.ns, os.fspath(PYTHON), "-c", code,
            os.fspath(host.run / "handoff.sock")]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=host.env)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "HELD"
    time.sleep(0.3)  # the daemon accepted it
    return proc


def first_client_payload(cap_pcap: Path, client_port: int) -> bytes:
    """The first TCP payload the client (source port ``client_port``) sent, from the capture."""
    argv = [_need("tshark"), "-r", os.fspath(cap_pcap), "-T", "fields", "-e", "tcp.srcport",
            "-e", "tcp.payload", "-Y", f"tcp.srcport == {client_port} && tcp.len > 0"]  # fmt: skip
    out = subprocess.run(argv, check=True, capture_output=True, text=True, timeout=60).stdout
    rows = [ln.split("\t") for ln in out.splitlines() if ln.strip()]
    assert rows, "the client sent no payload"
    return bytes.fromhex(rows[0][1].replace(":", ""))


def client_port(cap_rows: list[dict[str, str]]) -> int:
    syn = next(
        r
        for r in cap_rows
        if r["tcp.flags.syn"] in ("1", "True") and r["tcp.flags.ack"] in ("0", "False")
    )
    return int(syn["tcp.srcport"])


def check_declined(net: Net, a: Host, b: Host, code: int, name: str, *, local_words: str) -> None:
    cap = net.capture()
    out, cerr, serr = run_pair(net, a, b, smc_client=True, smc_server=True, banner=False)
    assert "RR OK" in out, (out, cerr)  # every echo equal: B's application read only data
    rows = cap.packets()
    assert options(cap) == (True, True)
    payload = first_client_payload(cap.pcap, client_port(rows))
    # the client's first bytes on the wire: a v2 CLC Decline (44 bytes) carrying its reason
    assert payload[:4] == bytes.fromhex("e2d4c3d9") and payload[4] == 4, payload[:8].hex()
    assert int.from_bytes(payload[5:7], "big") == 44 and payload[7] >> 4 == 2, payload[:8].hex()
    assert int.from_bytes(payload[16:20], "big") == code, payload[16:20].hex()
    ((_, cmode, creason),), ((_, smode, sreason),) = modes(cerr), modes(serr)
    assert (cmode, smode) == ("tcp", "tcp"), (cerr, serr)
    assert name in creason.split()[0], creason
    assert local_words in creason, creason
    assert sreason.startswith("SMC_CLC_DECL_PEERDECL"), sreason
    assert f"0x{code:08x}" in sreason.lower() or name in sreason, sreason
    assert "PEERDECL" in b.proc.log() and f"peer 0x{code:08x}" in b.proc.log()


def test_client_at_its_cap_declines_before_falling_back(
    limited: tuple[Host, Host], net: Net
) -> None:
    a, b = limited
    holder = hold_handoff_connection(a)
    try:
        check_declined(net, a, b, MAX_DMB, "SMC_CLC_DECL_MAX_DMB",
                       local_words="limits.connections_per_user")  # fmt: skip
    finally:
        holder.kill()
        holder.wait()


def test_client_with_smc_off_declines_before_falling_back(
    smc_off: tuple[Host, Host], net: Net
) -> None:
    a, b = smc_off
    check_declined(net, a, b, NOSMCDEV, "SMC_CLC_DECL_NOSMCDEV", local_words="no SMC device")


def test_decline_encoding_matches_the_wire_codec() -> None:
    """The daemon's pre-CLC Decline is the wire codec's, byte for byte, v1 and v2."""
    from smcd_daemon.adapters.handoff.predecline import decline_bytes
    from smcd_daemon.wire.clc_decline import Decline

    v2 = decline_bytes(MAX_DMB)
    assert Decline.decode(v2) == Decline(MAX_DMB)
    assert len(v2) == 44 and len(decline_bytes(MAX_DMB, 1)) == 28
    assert Decline.decode(decline_bytes(MAX_DMB, 1)).diagnosis == MAX_DMB


HOLD_LISTENER = r"""
import sys, time, smc_handoff
srv = smc_handoff.listen((sys.argv[1], 0))
print("PORT", srv.getsockname()[1], flush=True)
time.sleep(300)  # never accepts: a client's handshake toward it stays in flight
"""

HOLD_CLIENT = r"""
import sys, smc_handoff
print("CONNECTING", flush=True)
s = smc_handoff.connect((sys.argv[1], int(sys.argv[2])), timeout=60)
"""


def test_client_at_its_handshake_cap_declines_before_falling_back(
    one_handshake: tuple[Host, Host], net: Net
) -> None:
    """A handshake refused by admission (the handshake module's path, not the gate's)."""
    a, b = one_handshake
    lst = subprocess.Popen(["ip", "netns", "exec", b.ns, os.fspath(PYTHON), "-c", HOLD_LISTENER,
                            ADDR_B], stdout=subprocess.PIPE, text=True, env=b.env)  # fmt: skip
    held: subprocess.Popen[str] | None = None
    try:
        assert lst.stdout is not None
        port = int(lst.stdout.readline().split()[1])
        held = subprocess.Popen(["ip", "netns", "exec", a.ns, os.fspath(PYTHON), "-c",
                                 HOLD_CLIENT, ADDR_B, str(port)], stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True, env=a.env)  # fmt: skip
        assert held.stdout is not None and held.stdout.readline().strip() == "CONNECTING"
        deadline = time.monotonic() + 10
        while "trying SMC toward" not in a.proc.log():  # its Proposal is out: in flight
            assert time.monotonic() < deadline, a.proc.log()[-2000:]
            time.sleep(0.05)
        check_declined(net, a, b, MAX_DMB, "SMC_CLC_DECL_MAX_DMB",
                       local_words="limits.handshakes_per_user")  # fmt: skip
    finally:
        for p in (held, lst):
            if p is not None:
                p.kill()
                p.wait()


def test_refused_server_half_declines_the_proposal(
    server_limited: tuple[Host, Host], net: Net
) -> None:
    """B's ACCEPT is refused at its gate while A's Proposal is on the way: B takes the Proposal
    off the stream and declines it (as the kernel's smc_listen_work), so B's application reads
    only data and A falls back with PEERDECL carrying B's code."""
    a, b = server_limited
    cap = net.capture()
    out, cerr, serr = run_pair(net, a, b, smc_client=True, smc_server=True, banner=False)
    assert "RR OK" in out, (out, cerr)
    cap.packets()
    ((_, cmode, creason),), ((_, smode, sreason),) = modes(cerr), modes(serr)
    assert (cmode, smode) == ("tcp", "tcp"), (cerr, serr)
    assert creason.startswith("SMC_CLC_DECL_PEERDECL"), creason
    assert "peer 0x030d0000" in a.proc.log(), a.proc.log()[-3000:]
    assert sreason.startswith("SMC_CLC_DECL_MAX_DMB"), sreason
    assert "limits.connections_per_user" in sreason, sreason


DAEMON_UNAVAILABLE = 0xFF000001


def test_library_without_its_daemon_declines_before_falling_back(
    hosts_plain: tuple[Host, Host], net: Net
) -> None:
    """The client application cannot reach smcd (its handoff socket is elsewhere, as in a
    container without the bind mount) while the host's detector marks its SYN: the library
    asks the detector (getsockopt SOL_SMCD) whether the SYN-ACK carried the option and, as it
    did, writes the Decline itself before it hands the application TCP."""
    a, b = hosts_plain
    lost = dataclasses.replace(a, env={**a.env, "SMCD_HANDOFF_SOCKET": "/nonexistent/h.sock"})
    check_declined(net, lost, b, DAEMON_UNAVAILABLE, "DAEMON_UNAVAILABLE",
                   local_words="declined before TCP")  # fmt: skip
