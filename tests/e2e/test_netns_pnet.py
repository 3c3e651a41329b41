"""PNET entries per network namespace and SMC-R device selection from them (#15).

Real namespaces (``ip netns``) with an equal-named netdev in each (a veth pair whose two ends
are both ``eth1``), a bridge over a second pair in one of them, the real smcd and dbus-daemon:

- entries naming the namespace of their netdev (by ``ip netns`` name or inode) keep the two
  ``eth1`` apart in the table, in ``smcctl pnet show`` and in ``smcctl device show``;
- :func:`~smcd_daemon.adapters.netns_view.route_pnet`, what the SMC-R service asks for a
  connection handed over from another namespace, finds the route's netdev in that namespace and
  its PNETID from that namespace's entries (through the base device of a bridge, as the kernel
  does), and the RDMA ports with that PNETID are the ones offered;
- an unknown namespace and a device named twice in one namespace are refused with the reason;
  an unprivileged caller cannot change the table.

This host has no RDMA device: the ports are inventory records, and no SMC-R data runs here.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import os
import subprocess
from collections.abc import Iterator

import pytest

from smcd_daemon.adapters.dbus import ERROR_ACCESS_DENIED
from smcd_daemon.adapters.netns_view import pnet_keys, pnet_netns, route_pnet
from smcd_daemon.core.devices import DeviceInventory, PortState, RdmaDevice, RdmaPort
from smcd_daemon.core.pnet import PnetError, PnetTable
from tests.control.dbusd import as_nobody, gdbus_call
from tests.e2e.conftest import Smcd
from tests.e2e.test_netns import PREFIX, add_ns, namespaces, sh  # noqa: F401 (fixture)

X, Y = f"{PREFIX}px", f"{PREFIX}py"
MANAGER = "org.smcd.Manager1"


def _inode(name: str) -> int:
    return os.stat(f"/run/netns/{name}").st_ino


@pytest.fixture
def twins(namespaces: list[str]) -> Iterator[dict[str, int]]:  # noqa: F811
    """X and Y joined by a veth pair whose ends are both called eth1 (192.0.2.1 in X, .2 in
    Y), and by a second pair eth2, whose end in X is a port of bridge br7 (203.0.113.1; Y's
    eth2 has 203.0.113.2). This kernel has no VLAN module: a bridge is the stacked device."""
    add_ns(namespaces, X)
    add_ns(namespaces, Y)
    for dev in ("eth1", "eth2"):
        sh("ip", "link", "add", dev, "netns", X, "type", "veth", "peer", "name", dev,
           "netns", Y)  # fmt: skip
    for ns, last in ((X, 1), (Y, 2)):
        sh("ip", "-n", ns, "addr", "add", f"192.0.2.{last}/24", "dev", "eth1")
        sh("ip", "-n", ns, "link", "set", "eth1", "up")
        sh("ip", "-n", ns, "link", "set", "eth2", "up")
    sh("ip", "-n", X, "link", "add", "br7", "type", "bridge")
    sh("ip", "-n", X, "link", "set", "eth2", "master", "br7")
    sh("ip", "-n", X, "addr", "add", "203.0.113.1/24", "dev", "br7")
    sh("ip", "-n", X, "link", "set", "br7", "up")
    sh("ip", "-n", Y, "addr", "add", "203.0.113.2/24", "dev", "eth2")
    yield {X: _inode(X), Y: _inode(Y)}


@pytest.fixture
def clean(smcd: Smcd) -> Iterator[Smcd]:
    assert smcd.smcctl("pnet", "flush").returncode == 0
    yield smcd
    smcd.smcctl("pnet", "flush")


def _ok(smcd: Smcd, *args: str) -> str:
    r = smcd.smcctl(*args)
    assert r.returncode == 0, (args, r.stderr)
    return r.stdout


def test_equal_ifnames_in_two_namespaces_stay_apart(clean: Smcd, twins: dict[str, int]) -> None:
    smcd = clean
    _ok(smcd, "pnet", "add", "NETX", "-I", "eth1", "--netns", X)
    _ok(smcd, "pnet", "add", "NETY", "-I", "eth1", "--netns", str(twins[Y]))  # by inode
    _ok(smcd, "pnet", "add", "NETH", "-I", "eth1")  # smcd's own namespace has its own eth1 slot
    rows = smcd.smcctl_json("pnet", "show")
    assert rows == [
        {"pnetid": "NETX", "netdev": "eth1", "ibdev": None, "ibport": None, "netns": X},
        {"pnetid": "NETY", "netdev": "eth1", "ibdev": None, "ibport": None, "netns": Y},
        {"pnetid": "NETH", "netdev": "eth1", "ibdev": None, "ibport": None},
    ], rows  # an inode is stored as the name `ip netns` knows it by
    table = [line.split() for line in _ok(smcd, "pnet", "show").splitlines()]
    assert table == [
        ["PNETID", "Net-Dev", "IB-Dev", "IB-Port", "Netns"],
        ["NETX", "eth1", "n/a", "255", X],
        ["NETY", "eth1", "n/a", "255", Y],
        ["NETH", "eth1", "n/a", "255", "host"],
    ], table
    assert smcd.smcctl_json("pnet", "show", "--netns", Y) == [rows[1]]

    # device show: each namespace's eth1 carries that namespace's PNETID, and X's bridge that
    # of its port eth2 (its base device) once X's eth2 has an entry
    _ok(smcd, "pnet", "add", "NETX", "-I", "eth2", "--netns", X)
    devices = smcd.smcctl_json("device", "show")
    got = {(d["NetnsInode"], d["Name"]): d["PnetId"] for d in devices if "Netns" in d}
    assert got[(twins[X], "eth1")] == "NETX" and got[(twins[X], "br7")] == "NETX", got
    assert got[(twins[Y], "eth1")] == "NETY" and got[(twins[Y], "eth2")] == "", got

    # removing in one namespace leaves the other's entry with the same device name
    _ok(smcd, "pnet", "del", "NETX", "--netns", X)
    r = smcd.smcctl("pnet", "del", "NETY", "--netns", X)
    assert r.returncode == 1 and f"not in the PNET table of network namespace '{X}'" in r.stderr
    assert [r["pnetid"] for r in smcd.smcctl_json("pnet", "show")] == ["NETY", "NETH"]
    r = smcd.smcctl("pnet", "flush", "--netns", X)
    assert r.returncode == 1 and "takes no --netns" in r.stderr, r.stderr


def test_bad_entries_are_refused_with_the_reason(clean: Smcd, twins: dict[str, int]) -> None:
    smcd = clean
    _ok(smcd, "pnet", "add", "NETX", "-I", "eth1", "--netns", X)
    cases = [
        (("--netns", f"{PREFIX}nosuch"), "is unknown: `ip netns` names no such namespace"),
        (("--netns", "999999999"), "is unknown: no process lives in a network namespace"),
        (("--netns", X), f"Network device 'eth1' in network namespace '{X}' already has PNETID"),
        (("--netns", str(twins[X])), "already has PNETID NETX"),  # same namespace by inode
        (("--netns", "a/b"), "is not an `ip netns` name"),
    ]
    for extra, why in cases:
        r = smcd.smcctl("pnet", "add", "NETZ", "-I", "eth1", *extra)
        assert r.returncode == 1 and why in r.stderr, (extra, r.stderr)
    r = smcd.smcctl("pnet", "add", "NETZ", "-D", "mlx5_0", "--netns", X)
    assert r.returncode == 1 and "--netns names the namespace of -I ETH" in r.stderr, r.stderr
    assert [r["pnetid"] for r in smcd.smcctl_json("pnet", "show")] == ["NETX"]


def test_unprivileged_caller_cannot_change_entries(clean: Smcd, twins: dict[str, int]) -> None:
    """smcd re-checks the caller of a mutation (on a bus without a policy file as well)."""
    smcd = clean
    add = gdbus_call(smcd.address, f"{MANAGER}.PnetAddNs", "'NETX'", "'eth1'", "''", "0", f"'{X}'")
    out = subprocess.run(as_nobody(add), capture_output=True, text=True, timeout=20)
    assert out.returncode != 0 and ERROR_ACCESS_DENIED in out.stderr, out
    rm = gdbus_call(smcd.address, f"{MANAGER}.PnetRemoveNs", "'NETX'", f"'{X}'")
    out = subprocess.run(as_nobody(rm), capture_output=True, text=True, timeout=20)
    assert out.returncode != 0 and ERROR_ACCESS_DENIED in out.stderr, out
    read = gdbus_call(smcd.address, f"{MANAGER}.PnetListNs")
    out = subprocess.run(as_nobody(read), capture_output=True, text=True, timeout=20)
    assert out.returncode == 0 and out.stdout.strip() == "(@a(sssys) [],)", out
    assert smcd.smcctl_json("pnet", "show") == []


def _rdma(name: str) -> RdmaDevice:
    return RdmaDevice(name, 1, (RdmaPort(name, 1, PortState.ACTIVE),))


def test_selection_uses_the_connections_namespace(twins: dict[str, int]) -> None:
    """What the SMC-R service does for a connection handed over from X or Y: the route's netdev
    in that namespace → its PNETID from that namespace's entries → the RDMA ports with it."""
    table = PnetTable()
    table.add("NETX", netdev="eth1", netns=pnet_netns(X))
    table.add("NETY", netdev="eth1", netns=pnet_netns(str(twins[Y])))
    table.add("NETX", netdev="eth2", netns=pnet_netns(X))  # X's bridge port
    table.add("NETX", ibdev="rxe_x")
    table.add("NETY", ibdev="rxe_y")
    inv = DeviceInventory()
    for name in ("rxe_x", "rxe_y"):
        inv.apply_rdma_device(_rdma(name))
    ip = ipaddress.ip_address

    async def pick(ns: str, local: str, peer: str) -> tuple[str | None, str | None, list[str]]:
        where = await route_pnet((twins[ns], ns), 0, ip(local), ip(peer), table)
        assert where.problem == "", where
        assert where.netdev is not None
        ports = inv.rdma_ports_by_pnetid(where.pnetid, table) if where.pnetid else []
        return where.netdev.name, where.pnetid, [p.device for p in ports]

    async def main() -> None:
        assert await pick(X, "192.0.2.1", "192.0.2.2") == ("eth1", "NETX", ["rxe_x"])
        assert await pick(Y, "192.0.2.2", "192.0.2.1") == ("eth1", "NETY", ["rxe_y"])
        # a bridge's PNETID is its base device's (first port), in its own namespace; Y's eth2
        # has no entry of Y's (X's eth2 entry is another device)
        assert await pick(X, "203.0.113.1", "203.0.113.2") == ("br7", "NETX", ["rxe_x"])
        assert await pick(Y, "203.0.113.2", "203.0.113.1") == ("eth2", None, [])
        # no entry for this namespace's eth1: no PNETID, so no port (smcd's own is not used)
        table.remove("NETY", Y)
        assert await pick(Y, "192.0.2.2", "192.0.2.1") == ("eth1", None, [])
        table.add("NETH", netdev="eth1")  # smcd's own eth1 slot: not Y's
        assert await pick(Y, "192.0.2.2", "192.0.2.1") == ("eth1", None, [])

    asyncio.run(main())
    assert pnet_keys((twins[X], X)) == {str(twins[X]), X}
    assert pnet_keys((os.stat("/proc/self/ns/net").st_ino, "host")) == {""}
    with pytest.raises(PnetError, match="is unknown"):
        pnet_netns(f"{PREFIX}gone")
    assert pnet_netns(str(os.stat("/proc/self/ns/net").st_ino)) == ""  # smcd's own


def test_config_entries_added_at_start_in_their_namespace(
    clean: Smcd, twins: dict[str, int]
) -> None:
    """``[[pnet]]`` entries of the configuration: added at start with their namespace (an
    unknown one logged with the reason, the others kept), and not saved to the state file
    (they belong to the file), while an entry added with smcctl is."""
    smcd = clean
    smcd.stop()
    smcd.write_config(
        f'[[pnet]]\npnetid = "NETC"\nnetdev = "eth1"\nnetns = "{X}"\n'
        f'[[pnet]]\npnetid = "NETU"\nnetdev = "eth1"\nnetns = "{PREFIX}nosuch"\n'
    )
    try:
        smcd.start()
        rows = smcd.smcctl_json("pnet", "show")
        assert rows == [
            {"pnetid": "NETC", "netdev": "eth1", "ibdev": None, "ibport": None, "netns": X}
        ], rows
        assert "PNET entry NETU from the configuration not added" in smcd.log()
        assert "is unknown" in smcd.log()
        _ok(smcd, "pnet", "add", "NETY", "-I", "eth1", "--netns", Y)
        saved = json.loads((smcd.work / "state" / "state.json").read_text())
        assert [e["pnetid"] for e in saved["pnet"]["entries"]] == ["NETY"], saved
    finally:
        smcd.stop()
        smcd.write_config()
        smcd.start()
