"""One smcd for the host's network namespaces (#15): applications in real namespaces (``ip netns``,
veth) reach the daemon's handoff socket by its path (the namespaces share the mount namespace, as
a bind mount gives a container) and their connections get SMC-D loopback-ism.

The identical-address case: two namespace pairs with the same addresses, the same listening port
and, by construction, identical 4-tuples, run at once. The halves meet by the connection's
identity (its ISNs) and are proven by the DMB tokens each read back, so every connection is
paired with its own peer: each server names its namespace in its reply and checksums what it got.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import PYTHON, REPO, Smcd

SERVER = r"""
import hashlib, json, socket, sys, threading
import smc_handoff
addr, port, n, me = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
srv = smc_handoff.listen((addr, port))
print(json.dumps({"registered": srv.registered}), flush=True)
results = []
def serve(sock):
    h, got = hashlib.sha256(), 0
    while True:
        piece = sock.recv(262144)
        if not piece:
            break
        h.update(piece)
        got += len(piece)
    sock.sendall(json.dumps({"server": me, "n": got, "sha": h.hexdigest()}).encode())
    sock.close()
threads = []
for _ in range(n):
    sock, _ = srv.accept()
    fb = sock.fallback
    results.append({"mode": sock.mode, "fallback": None if fb is None else fb.explanation})
    t = threading.Thread(target=serve, args=(sock,))
    t.start()
    threads.append(t)
for t in threads:
    t.join()
print(json.dumps({"accepted": results}), flush=True)
"""

CLIENT = r"""
import hashlib, json, random, socket, sys, threading
import smc_handoff
addr, port = sys.argv[1], int(sys.argv[2])
n, size, seed = int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
base = int(sys.argv[6]) if len(sys.argv) > 6 else 0
out = [None] * n
def run(i):
    data = random.Random(seed * 1000 + i).randbytes(size)
    # base: the same source ports in every namespace, identical 4-tuples
    src = ("", base + i) if base else None
    sock = smc_handoff.connect((addr, port), timeout=30, source_address=src)
    fb, mode = sock.fallback, sock.mode
    sock.sendall(data)
    sock.shutdown(socket.SHUT_WR)
    reply = b""
    while True:
        piece = sock.recv(65536)
        if not piece:
            break
        reply += piece
    sock.close()
    out[i] = {"mode": mode, "fallback": None if fb is None else fb.explanation,
              "sha": hashlib.sha256(data).hexdigest(), "n": size, "reply": json.loads(reply)}
def guarded(i):
    try:
        run(i)
    except Exception as e:
        out[i] = {"mode": "error", "error": repr(e)}
threads = [threading.Thread(target=guarded, args=(i,)) for i in range(n)]
print(json.dumps("ready"), flush=True)
sys.stdin.readline()  # all clients start at once
for t in threads:
    t.start()
for t in threads:
    t.join()
print(json.dumps(out), flush=True)
"""

PREFIX = f"smcdns{os.getpid() % 10000}"


def sh(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, timeout=20)


def in_ns(ns: str, program: str, *args: object, handoff: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": os.fspath(REPO), "SMCD_HANDOFF_SOCKET": os.fspath(handoff)}
    argv = ["ip", "netns", "exec", ns, os.fspath(PYTHON), "-c", program, *map(str, args)]
    return subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)  # fmt: skip


def line(proc: subprocess.Popen[str], timeout: float = 60.0) -> Any:
    assert proc.stdout is not None
    import selectors

    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            proc.kill()
            raise AssertionError(f"no output within {timeout} s: {proc.args}")
    text = proc.stdout.readline()
    if not text:
        err = proc.stderr.read() if proc.stderr else ""
        raise AssertionError(f"{proc.args[3]} exited ({proc.wait()}): {err}")
    return json.loads(text)


@pytest.fixture
def namespaces() -> Iterator[list[str]]:
    """The namespaces a test makes (:func:`add_ns`), deleted afterwards."""
    made: list[str] = []
    try:
        yield made
    finally:
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def add_ns(made: list[str], name: str) -> str:
    sh("ip", "netns", "add", name)
    made.append(name)
    sh("ip", "-n", name, "link", "set", "lo", "up")
    return name


def veth_pair(made: list[str], a: str, b: str, addr_a: str, addr_b: str) -> None:
    """Namespaces ``a`` and ``b`` joined by one veth pair, with the given /24 addresses."""
    add_ns(made, a)
    add_ns(made, b)
    sh("ip", "link", "add", f"{a}v", "netns", a, "type", "veth", "peer", "name", f"{b}v",
       "netns", b)  # fmt: skip
    for ns, dev, addr in ((a, f"{a}v", addr_a), (b, f"{b}v", addr_b)):
        sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
        sh("ip", "-n", ns, "link", "set", dev, "up")


def test_identical_addresses_in_two_namespace_pairs_pair_by_proof(
    smcd: Smcd, namespaces: list[str]
) -> None:
    """Two pairs (client ns, server ns), both 198.51.100.2 → 198.51.100.3 port 5000, run at
    once through one smcd: every connection is SMC-D and ends at its own server, checksummed."""
    conns, size = 6, 300_000
    pairs = [(f"{PREFIX}a{k}", f"{PREFIX}b{k}") for k in (1, 2)]
    for a, b in pairs:
        veth_pair(namespaces, a, b, "198.51.100.2", "198.51.100.3")
    servers = [
        in_ns(b, SERVER, "198.51.100.3", 5000, conns, b, handoff=smcd.handoff) for _, b in pairs
    ]
    for s in servers:
        assert line(s) == {"registered": True}
    clients = [
        in_ns(a, CLIENT, "198.51.100.3", 5000, conns, size, k, 41000, handoff=smcd.handoff)
        for k, (a, _) in enumerate(pairs, 1)
    ]
    for c in clients:
        assert line(c) == "ready"
    for c in clients:
        assert c.stdin is not None
        c.stdin.write("go\n")
        c.stdin.flush()
    results = [line(c) for c in clients]
    accepted = [line(s)["accepted"] for s in servers]
    for (a, b), got in zip(pairs, results, strict=True):
        for r in got:
            assert r["mode"] == "smcd", (a, r, smcd.log()[-3000:])
            # its own server got exactly its bytes: a crossed pair names the other namespace
            assert r["reply"] == {"server": b, "n": size, "sha": r["sha"]}, (a, r)
        assert len({r["sha"] for r in got}) == conns
    for b_accepted in accepted:
        assert [r["mode"] for r in b_accepted] == ["smcd"] * conns, b_accepted
    for p in [*servers, *clients]:
        assert p.wait(10) == 0


def link(made: list[str], a: str, b: str, addr_a: str | None, addr_b: str | None) -> None:
    """A veth pair between namespaces ``a`` and ``b`` (an address is /24; None: none)."""
    sh("ip", "link", "add", f"{a}x{b[-1]}", "netns", a, "type", "veth", "peer", "name",
       f"{b}x{a[-1]}", "netns", b)  # fmt: skip
    for ns, dev, addr in ((a, f"{a}x{b[-1]}", addr_a), (b, f"{b}x{a[-1]}", addr_b)):
        if addr is not None:
            sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
        sh("ip", "-n", ns, "link", "set", dev, "up")


@pytest.fixture
def host(namespaces: list[str]) -> dict[str, str]:
    """A container host in namespaces: a router ``r`` with a bridge (198.51.100.1/24) joining
    containers ``a`` (.2) and ``b`` (.3), a routed link to ``c`` (203.0.113.2, r is .1), and a
    published port: r DNATs 203.0.113.1 port 8080 to b's 198.51.100.3 port 5000 (nftables)."""
    ns = {k: add_ns(namespaces, f"{PREFIX}{k}") for k in "rabc"}
    r = ns["r"]
    sh("ip", "-n", r, "link", "add", "br0", "type", "bridge")
    sh("ip", "-n", r, "addr", "add", "198.51.100.1/24", "dev", "br0")
    sh("ip", "-n", r, "link", "set", "br0", "up")
    for k, addr in (("a", "198.51.100.2"), ("b", "198.51.100.3")):
        link(namespaces, r, ns[k], None, addr)
        sh("ip", "-n", r, "link", "set", f"{r}x{k}", "master", "br0")
        sh("ip", "-n", ns[k], "route", "add", "default", "via", "198.51.100.1")
    link(namespaces, r, ns["c"], "203.0.113.1", "203.0.113.2")
    sh("ip", "-n", ns["c"], "route", "add", "default", "via", "203.0.113.1")
    sh("ip", "netns", "exec", r, "sysctl", "-qw", "net.ipv4.ip_forward=1")
    nft = ("ip", "netns", "exec", r, "nft")
    sh(*nft, "add table ip smcdtest")
    sh(*nft, "add chain ip smcdtest pre { type nat hook prerouting priority dstnat ; }")
    sh(*nft, "add rule ip smcdtest pre ip daddr 203.0.113.1 tcp dport 8080 "
       "dnat to 198.51.100.3:5000")  # fmt: skip
    return ns


@pytest.mark.parametrize(
    ("client", "server", "listen", "target"),
    [
        ("a", "b", ("0.0.0.0", 5000), ("198.51.100.3", 5000)),  # through the bridge
        ("c", "b", ("0.0.0.0", 5000), ("198.51.100.3", 5000)),  # routed
        ("b", "c", ("0.0.0.0", 6000), ("203.0.113.2", 6000)),  # routed, the other way
        ("c", "b", ("0.0.0.0", 5000), ("203.0.113.1", 8080)),  # a published (DNAT'ed) port
    ],
    ids=["bridge", "routed", "routed-reverse", "dnat"],
)
def test_containers_of_one_host_get_loopback_ism(
    smcd: Smcd,
    host: dict[str, str],
    client: str,
    server: str,
    listen: tuple[str, int],
    target: tuple[str, int],
) -> None:
    """Wildcard listeners registered from one namespace, clients in another: SMC-D through one
    smcd in the host's namespace, whatever carries the TCP connection, checksummed."""
    conns, size = 3, 1_000_000
    srv = in_ns(host[server], SERVER, *listen, conns, server, handoff=smcd.handoff)
    assert line(srv) == {"registered": True}
    cli = in_ns(host[client], CLIENT, *target, conns, size, 7, handoff=smcd.handoff)
    assert line(cli) == "ready"
    assert cli.stdin is not None
    cli.stdin.write("go\n")
    cli.stdin.flush()
    got = line(cli)
    accepted = line(srv)["accepted"]
    for r in got:
        assert r["mode"] == "smcd", (r, smcd.log()[-2000:])
        assert r["reply"] == {"server": server, "n": size, "sha": r["sha"]}
    assert [r["mode"] for r in accepted] == ["smcd"] * conns, accepted
    for p in (srv, cli):
        assert p.wait(10) == 0


HOLD = r"""
import json, sys
import smc_handoff
sock = smc_handoff.connect((sys.argv[1], int(sys.argv[2])), timeout=30)
fb = sock.fallback
print(json.dumps({"mode": sock.mode, "fallback": None if fb is None else fb.explanation}),
      flush=True)
sys.stdin.readline()
sock.sendall(b"held")
sock.close()
"""


def test_conns_show_each_halfs_namespace(smcd: Smcd, host: dict[str, str]) -> None:
    """``smcctl conns`` names the namespace of each half (inode and ``ip netns`` name)."""
    srv = in_ns(host["b"], SERVER, "0.0.0.0", 5000, 1, "b", handoff=smcd.handoff)
    assert line(srv) == {"registered": True}
    cli = in_ns(host["a"], HOLD, "198.51.100.3", 5000, handoff=smcd.handoff)
    assert line(cli)["mode"] == "smcd"
    want = {
        f"{os.stat(f'/run/netns/{host[k]}').st_ino} {host[k]}": role
        for k, role in (("a", "CLIENT"), ("b", "SERVER"))
    }
    rows = smcd.wait_conns(
        lambda rows: {r.get("Netns"): r["Role"] for r in rows if r["Mode"] == "SMCD"} == want
    )
    assert all(r["Uid"] == 0 and r["Pid"] > 0 for r in rows if r["Mode"] == "SMCD")
    table = smcd.smcctl("conns")
    assert table.returncode == 0 and "Netns" in table.stdout.splitlines()[0], table.stdout
    assert all(name in table.stdout for name in want), table.stdout
    assert cli.stdin is not None
    cli.stdin.write("go\n")
    cli.stdin.flush()
    assert cli.wait(10) == 0
    assert line(srv)["accepted"][0]["mode"] == "smcd"


def test_a_policy_refuses_namespaces_outside_a_common_group(
    smcd: Smcd, host: dict[str, str]
) -> None:
    """``namespaces.groups``: a and c may pair, b with neither; a refused pair stays on TCP
    (both halves processed the Decline, so the stream is intact) and says why."""
    smcd.reload(f'[namespaces]\ngroups = [["{host["a"]}", "{host["c"]}"]]\n')
    try:
        srv = in_ns(host["b"], SERVER, "0.0.0.0", 5000, 1, "b", handoff=smcd.handoff)
        assert line(srv) == {"registered": True}
        cli = in_ns(host["a"], CLIENT, "198.51.100.3", 5000, 1, 100_000, 3, handoff=smcd.handoff)
        assert line(cli) == "ready"
        assert cli.stdin is not None
        cli.stdin.write("go\n")
        cli.stdin.flush()
        (got,) = line(cli)
        assert got["mode"] == "tcp", got
        assert "namespaces.groups puts the client's namespace" in got["fallback"], got
        assert host["a"] in got["fallback"] and host["b"] in got["fallback"], got
        assert got["reply"] == {"server": "b", "n": 100_000, "sha": got["sha"]}
        assert line(srv)["accepted"][0]["mode"] == "tcp"
        # a and c share a group: c listens, a connects (routed through r)
        srv = in_ns(host["c"], SERVER, "0.0.0.0", 6000, 1, "c", handoff=smcd.handoff)
        assert line(srv) == {"registered": True}
        cli = in_ns(host["a"], CLIENT, "203.0.113.2", 6000, 1, 100_000, 4, handoff=smcd.handoff)
        assert line(cli) == "ready"
        cli.stdin.write("go\n")  # type: ignore[union-attr]
        cli.stdin.flush()  # type: ignore[union-attr]
        (got,) = line(cli)
        assert got["mode"] == "smcd", got
        assert got["reply"] == {"server": "c", "n": 100_000, "sha": got["sha"]}
    finally:
        smcd.reload()
