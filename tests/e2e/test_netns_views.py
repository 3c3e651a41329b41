"""What one smcd for the host's namespaces shows and carries, beyond :mod:`test_netns` (#15).

- ``smcctl device show`` lists devices per network namespace (real namespaces, real smcd, real
  dbus-daemon): smcd's own as ``host`` (loopback-ism among them), a named namespace's netdevs
  with their addresses under that namespace, and the netdevs of a namespace nobody named that
  smcd learns of because a process in it registered a listener (``unshare --net``, as a
  container runtime makes them). There is no RDMA device on this host: RDMA devices are shown
  for smcd's namespace only (the README says so).
- A listener's record shows its namespace as a connection's does (``smcctl conns -l``).
- Both directions over the bridge and over a plain veth pair get SMC-D, checksummed.
"""

from __future__ import annotations

import os
import subprocess

from tests.e2e.conftest import PYTHON, REPO, Smcd
from tests.e2e.test_netns import (  # noqa: F401 (the fixtures are used by name)
    CLIENT,
    PREFIX,
    SERVER,
    add_ns,
    host,
    in_ns,
    line,
    namespaces,
    sh,
    veth_pair,
)


def _inode(name: str) -> int:
    return os.stat(f"/run/netns/{name}").st_ino


def _transfer(smcd: Smcd, srv_ns: str, listen: tuple[str, int], cli_ns: str,
              target: tuple[str, int], tag: str, conns: int = 2) -> None:  # fmt: skip
    """``conns`` checksummed connections from ``cli_ns`` to a wildcard listener in ``srv_ns``:
    every one SMC-D at both ends, every byte at its own server."""
    size = 500_000
    srv = in_ns(srv_ns, SERVER, *listen, conns, tag, handoff=smcd.handoff)
    assert line(srv) == {"registered": True}
    cli = in_ns(cli_ns, CLIENT, *target, conns, size, 11, handoff=smcd.handoff)
    assert line(cli) == "ready"
    assert cli.stdin is not None
    cli.stdin.write("go\n")
    cli.stdin.flush()
    got = line(cli)
    accepted = line(srv)["accepted"]
    for r in got:
        assert r["mode"] == "smcd", (r, smcd.log()[-2000:])
        assert r["reply"] == {"server": tag, "n": size, "sha": r["sha"]}, r
    assert [r["mode"] for r in accepted] == ["smcd"] * conns, accepted
    for p in (srv, cli):
        assert p.wait(10) == 0


def test_bridge_both_directions(smcd: Smcd, host: dict[str, str]) -> None:  # noqa: F811
    """a → b and b → a through the router's bridge, each a wildcard listener."""
    _transfer(smcd, host["b"], ("0.0.0.0", 5000), host["a"], ("198.51.100.3", 5000), "b")
    _transfer(smcd, host["a"], ("0.0.0.0", 5001), host["b"], ("198.51.100.2", 5001), "a")


def test_veth_pair_both_directions(smcd: Smcd, namespaces: list[str]) -> None:  # noqa: F811
    """Two namespaces joined by one veth pair, no bridge or router: both directions."""
    a, b = f"{PREFIX}va", f"{PREFIX}vb"
    veth_pair(namespaces, a, b, "192.0.2.2", "192.0.2.3")
    _transfer(smcd, b, ("192.0.2.3", 5100), a, ("192.0.2.3", 5100), "b")
    _transfer(smcd, a, ("0.0.0.0", 5101), b, ("192.0.2.2", 5101), "a")


def test_listener_records_show_their_namespace(smcd: Smcd, host: dict[str, str]) -> None:  # noqa: F811
    """``smcctl conns -l``: a listener registered from a named namespace shows "inode name"."""
    srv = in_ns(host["b"], SERVER, "0.0.0.0", 5200, 1, "b", handoff=smcd.handoff)
    try:
        assert line(srv) == {"registered": True}
        want = f"{_inode(host['b'])} {host['b']}"
        (lst,) = [r for r in smcd.smcctl_json("conns", "-l") if r["LocalPort"] == 5200]
        assert lst["State"] == "LISTEN" and lst["Netns"] == want and lst["Pid"] > 0, lst
        table = smcd.smcctl("conns", "-l")
        assert table.returncode == 0, table.stderr
        head, *body = table.stdout.splitlines()
        assert head.split()[-1] == "Netns", head
        (row,) = [r for r in body if ":5200" in r]
        assert row.endswith(want), row
    finally:
        srv.kill()
        srv.wait(10)


UNNAMED_LISTENER = r"""
import json, sys
import smc_handoff
srv = smc_handoff.listen(("0.0.0.0", 5300))
print(json.dumps({"registered": srv.registered}), flush=True)
sys.stdin.readline()
"""


def test_device_show_lists_devices_per_namespace(smcd: Smcd, namespaces: list[str]) -> None:  # noqa: F811
    """smcd's own devices under ``host``; a named namespace's veth (with its address) under
    that namespace; an unnamed namespace, known to smcd by a listener registered from it, with
    its own devices; ``--netns`` picks one namespace; ``--json`` carries the same."""
    a, b = f"{PREFIX}da", f"{PREFIX}db"
    add_ns(namespaces, a)
    add_ns(namespaces, b)
    sh("ip", "link", "add", "h3nsdev", "netns", a, "type", "veth", "peer", "name", "h3peer",
       "netns", b)  # fmt: skip
    sh("ip", "-n", a, "addr", "add", "203.0.113.7/24", "dev", "h3nsdev")
    sh("ip", "-n", a, "link", "set", "h3nsdev", "up")
    env = {
        **os.environ,
        "PYTHONPATH": os.fspath(REPO),
        "SMCD_HANDOFF_SOCKET": os.fspath(smcd.handoff),
    }
    unnamed = subprocess.Popen(
        ["unshare", "--net", os.fspath(PYTHON), "-c", UNNAMED_LISTENER],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        assert line(unnamed) == {"registered": True}
        hidden = os.stat(f"/proc/{unnamed.pid}/ns/net").st_ino
        own = os.stat("/proc/self/ns/net").st_ino  # smcd runs in the test's namespace

        devices = smcd.smcctl_json("device", "show")
        by_ns: dict[int, dict[str, dict[str, object]]] = {}
        for d in devices:
            by_ns.setdefault(d["NetnsInode"], {})[d["Name"]] = d
        assert by_ns[own]["loopback-ism"]["Netns"] == f"{own} host", by_ns[own]
        assert by_ns[own]["loopback-ism"]["Kind"] == "ism"
        assert "h3nsdev" not in by_ns[own] and "h3peer" not in by_ns[own]
        dev = by_ns[_inode(a)]["h3nsdev"]
        assert dev["Netns"] == f"{_inode(a)} {a}" and dev["Kind"] == "netdev", dev
        assert dev["LinkKind"] == "veth" and ["203.0.113.7", 24] in dev["Addresses"], dev
        assert dev["PnetId"] == "", dev  # no PNET entry names this namespace
        assert set(by_ns[_inode(b)]) == {"lo", "h3peer"}, by_ns[_inode(b)]
        # the namespace nobody named: known by the listener's process, shown by its inode
        assert set(by_ns[hidden]) == {"lo"} and by_ns[hidden]["lo"]["Netns"] == str(hidden)
        # the table: one row per device, its namespace first
        table = smcd.smcctl("device", "show")
        assert table.returncode == 0, table.stderr
        head, *rows = table.stdout.splitlines()
        assert head.split() == ["Netns", "Name", "Kind", "State", "PNET-ID", "Details"]
        (row,) = [r for r in rows if r.split()[:3] == [str(_inode(a)), a, "h3nsdev"]]
        assert "netdev" in row and "veth" in row and "203.0.113.7/24" in row, row
        assert rows[0].split()[:2] == [str(own), "host"], rows[0]  # smcd's namespace first
        # one namespace, by name or by inode; and one device in it
        picked = smcd.smcctl_json("device", "show", "--netns", a)
        assert {d["Name"] for d in picked} == {"lo", "h3nsdev"}, picked
        assert smcd.smcctl_json("device", "show", "-n", str(hidden)) == [by_ns[hidden]["lo"]]
        assert {d["Name"] for d in smcd.smcctl_json("device", "show", "-n", "host")} >= {
            "lo", "loopback-ism"
        }  # fmt: skip
        (lo_b,) = smcd.smcctl_json("device", "show", "lo", "--netns", b)
        assert lo_b["NetnsInode"] == _inode(b)
        missing = smcd.smcctl("device", "show", "h3nsdev", "--netns", b)
        assert missing.returncode == 1 and f"in network namespace {b}" in missing.stderr
    finally:
        unnamed.kill()
        unnamed.wait(10)


def test_a_netns_name_without_its_mount_is_reported_not_used(smcd: Smcd) -> None:
    """``ip netns add`` creates an empty file and binds the namespace onto it; a service with a
    mount namespace of its own may see the file without the bind (it did not propagate there:
    seen in the systemd VM for a namespace named after smcd started). Such a name is shown with
    why, and a PNET entry naming it is refused with why, not taken for a namespace."""
    name = f"{PREFIX}unmounted"
    path = f"/run/netns/{name}"
    os.makedirs("/run/netns", exist_ok=True)
    fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_EXCL, 0)  # as ip netns, before its bind
    os.close(fd)
    try:
        shown = smcd.smcctl("device", "show")
        assert shown.returncode == 0, shown.stderr
        why = "its `ip netns` mount is not in smcd's mount namespace"
        assert f"smcctl: network namespace {name}: {why}" in shown.stderr, shown.stderr
        assert name not in shown.stdout, shown.stdout
        refused = smcd.smcctl("pnet", "add", "NETU", "-I", "eth1", "--netns", name)
        assert refused.returncode != 0 and why in refused.stderr, refused
        assert "NETU" not in smcd.smcctl("pnet", "show").stdout
    finally:
        os.unlink(path)
