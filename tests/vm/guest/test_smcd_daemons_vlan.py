"""SMC-R over VLAN netdevs between two real ``smcd`` daemons over Soft-RoCE.

VLAN 10 on host A's and host B's wire-0 NICs (``smca0.10``, ``smcb0.10``) with addresses of
their own; rxe adds IPv4-mapped GIDs for the addresses of a VLAN upper device, in the GID table
of the rxe on the real device, with the VLAN netdev as the GID's netdev. The applications
connect over the VLAN addresses, so each daemon must offer VLAN 10 (the kernel's
``smc_vlan_by_tcpsk``: the route's output netdev is the VLAN) and pick the GID whose netdev has
that VLAN (``smc_ib_determine_gid``) - before smcd learned VLAN ids from rtnetlink it offered
VLAN 0, found no GID on a non-VLAN netdev with the connection's address, and stayed on TCP.

The connection must be SMC-R at both ends with a link group whose VLAN id is 10, whose local
and peer GIDs are the VLAN addresses' and whose netdev is the VLAN netdev; a second link also
goes over a VLAN 10 GID (rxe_a1/rxe_b1 have none), and the bytes arrive intact both ways.
The VLAN devices (and with them their addresses and routes) are removed in a ``finally``:
other guest tests run after this one in the same VM.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.vm.guest import daemons as dm
from tests.vm.topology import POLICY_TABLE, ipv4_mapped_gid_text

VLAN = 10
VA, VB = "smca0.10", "smcb0.10"
ADDR_A, ADDR_B = "198.51.100.11", "198.51.100.12"  # wire 1 holds .1 and .2 of this subnet
PEERS = ("192.0.2.0/24", "198.51.100.0/24", "203.0.113.0/24")
CFG = dm.config_text(peers=PEERS, ueids=["SMCD-VM-VLAN"])
PORT = 47401
SIZE = 256 * 1024

APP = r"""
import hashlib, json, sys
import smc_handoff

role, host, port, size = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])

def exactly(sock, n):
    got = bytearray()
    while len(got) < n:
        b = sock.recv(min(65536, n - len(got)))
        if not b:
            break
        got += b
    return bytes(got)

def report(sock, **more):
    fb = sock.fallback
    return dict(more, mode=sock.mode, local=list(sock.getsockname()[:2]),
                peer=list(sock.getpeername()[:2]),
                fallback=None if fb is None else {"code": fb.code, "name": fb.name,
                                                  "explanation": fb.explanation})

if role == "server":
    srv = smc_handoff.listen((host, port))
    srv.settimeout(120)
    print(json.dumps({"registered": srv.registered}), flush=True)
    sock, _ = srv.accept()
    sock.settimeout(120)
    data = exactly(sock, size)
    sock.sendall(data[::-1])
    out = report(sock, sha=hashlib.sha256(data).hexdigest(), n=len(data))
else:
    sock = smc_handoff.connect((host, port), 60, source_address=(sys.argv[5], 0))
    sock.settimeout(120)
    data = bytes((i * 7 + i // 251) & 0xFF for i in range(size))
    sock.sendall(data)
    back = exactly(sock, size)
    out = report(sock, sha=hashlib.sha256(data).hexdigest(), echo_ok=back == data[::-1],
                 n=len(back))
print(json.dumps(out), flush=True)
sys.stdin.readline()  # the connection stays open while the test looks at the link group
sock.close()
"""


def _vlan_gid(rxe: str, netdev: str, address: str) -> int | None:
    """The index of ``address``'s IPv4-mapped GID in port 1 of ``rxe`` whose netdev is
    ``netdev``, None while there is none."""
    port = Path("/sys/class/infiniband") / rxe / "ports" / "1"
    want = ipv4_mapped_gid_text(address)
    for gid in (port / "gids").iterdir():
        with contextlib.suppress(OSError):
            if gid.read_text().strip() != want:
                continue
            if (port / "gid_attrs" / "ndevs" / gid.name).read_text().strip() == netdev:
                return int(gid.name)
    return None


def _gid_table(rxe: str) -> str:
    port = Path("/sys/class/infiniband") / rxe / "ports" / "1"
    rows = []
    for gid in sorted((port / "gids").iterdir(), key=lambda p: int(p.name)):
        with contextlib.suppress(OSError):
            ndev = (port / "gid_attrs" / "ndevs" / gid.name).read_text().strip()
            rows.append(f"{gid.name}: {gid.read_text().strip()} {ndev}")
    return f"{rxe}:\n" + "\n".join(rows)


@contextlib.contextmanager
def vlans() -> Iterator[None]:
    """VLAN 10 on smca0 and smcb0, each with its /32 and the policy route that makes traffic
    to the other cross the wire (tagged), as ``topology.configure`` does for the NICs."""
    r = subprocess.run(["modprobe", "8021q"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, f"modprobe 8021q: {r.stderr}"
    setup = []
    for real, dev, mine, peer in (("smca0", VA, ADDR_A, ADDR_B), ("smcb0", VB, ADDR_B, ADDR_A)):
        setup += [
            f"link add link {real} name {dev} type vlan id {VLAN}",
            f"addr add {mine}/32 dev {dev}",
            f"link set dev {dev} up",
            f"route add {peer}/32 dev {dev} src {mine} table {POLICY_TABLE}",
        ]
    try:
        dm.ip_batch(setup)
        deadline = time.monotonic() + 60
        while _vlan_gid("rxe_a0", VA, ADDR_A) is None or _vlan_gid("rxe_b0", VB, ADDR_B) is None:
            if time.monotonic() > deadline:
                pytest.fail(
                    "rxe added no GID for the VLAN addresses within 60 s:\n"
                    + "\n".join(_gid_table(x) for x in ("rxe_a0", "rxe_b0"))
                )
            time.sleep(0.2)
        yield
    finally:
        dm.ip_batch([f"link del {VA}", f"link del {VB}"], force=True)


def _json_line(p: subprocess.Popen[str], what: str, daemons: tuple[dm.Daemon, ...]) -> Any:
    got = json.loads(dm.line(p, what, daemons))
    assert isinstance(got, dict)
    return got


@pytest.mark.timeout(300)
def test_smcr_over_vlan_uses_the_vlan_and_its_gids(out_dir: Path) -> None:
    base = out_dir / "scratch" / "smcd_daemons_vlan"
    with vlans():
        a = dm.start(base, "a", CFG)
        b = dm.start(base, "b", CFG)
        apps: list[subprocess.Popen[str]] = []
        try:
            dm.wait_ready(a)
            dm.wait_ready(b)
            ds = (a, b)
            server = dm.app(APP, b, "server", ADDR_B, str(PORT), str(SIZE))
            apps.append(server)
            reg = _json_line(server, "the server app's LISTEN", ds)
            assert reg == {"registered": True}, reg
            client = dm.app(APP, a, "client", ADDR_B, str(PORT), str(SIZE), ADDR_A)
            apps.append(client)
            c = _json_line(client, "the client app", ds)
            s = _json_line(server, "the server app", ds)
            tails = "\n".join(d.tail(3000) for d in ds)
            assert (c["mode"], s["mode"]) == ("smcr", "smcr"), f"{c}\n{s}\n{tails}"
            assert c["fallback"] is None and s["fallback"] is None, (c, s)
            assert (c["local"][0], s["local"][0]) == (ADDR_A, ADDR_B), (c, s)
            # every byte arrived in order both ways
            assert c["echo_ok"] and c["n"] == s["n"] == SIZE and c["sha"] == s["sha"], (c, s)

            for d, dev, rxe, mine, peer in ((a, VA, "rxe_a0", ADDR_A, ADDR_B),
                                            (b, VB, "rxe_b0", ADDR_B, ADDR_A)):  # fmt: skip
                lgs = [
                    g
                    for g in d.ctl_json("linkgroup", "show", "--links")
                    if g.get("Type") == "SMC-R"
                ]
                assert len(lgs) == 1, f"smcd {d.name}: {lgs}"
                lg = lgs[0]
                got = (lg["VlanId"], lg["NetDev"], lg["LocalGid"], lg["PeerGid"])
                want = (VLAN, dev, f"::ffff:{mine}", f"::ffff:{peer}")
                assert got == want, f"smcd {d.name}'s link group: {lg}"
                # Every link, the second too (its port chosen by the link group's VLAN as
                # ``smc_pnet_find_alt_roce`` does), is on a VLAN 10 netdev: never rxe_a1/rxe_b1,
                # whose GIDs are on untagged netdevs. (Both "hosts" share the VM's rxe devices,
                # so the second link, when made by now, uses the other host's VLAN GID.)
                links = sorted(lg["LinkObjects"], key=lambda lk: lk["Id"])
                assert 1 <= len(links) <= 2, f"smcd {d.name}: {links}"
                first = links[0]
                assert (first["State"], first["IbDev"], first["NetDev"]) == ("ACTIVE", rxe, dev)
                assert (first["Gid"], first["PeerGid"]) == (f"::ffff:{mine}", f"::ffff:{peer}")
                vlan_gids = {f"::ffff:{ADDR_A}", f"::ffff:{ADDR_B}"}
                for lk in links:
                    assert lk["NetDev"] in (VA, VB), lk
                    assert {lk["Gid"], lk["PeerGid"]} == vlan_gids, lk
        finally:
            ended = [dm.finish(p) for p in apps]
            dm.stop((a, b))
    for rc, err in ended:
        assert rc == 0, f"app exit {rc}: {err[-3000:]}"
