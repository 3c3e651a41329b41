"""``Manager1.NamespaceDevices`` (#15) through the shipped system-bus policy in a real
dbus-daemon: an unprivileged caller may read it, as every read method, and gets smcd's own
devices (namespace "host") and the netdevs of a real named namespace, each under its inode."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.control.dbusd import DbusDaemon, Harness, as_nobody, gdbus_call, run, smcd_on_bus

NS = f"smcdh3ns{os.getpid() % 10000}"


@pytest.fixture
def named_ns() -> Iterator[str]:
    subprocess.run(["ip", "netns", "add", NS], check=True, capture_output=True)
    try:
        for argv in (
            ["ip", "-n", NS, "link", "add", "h3x", "type", "veth", "peer", "name", "h3y"],
            ["ip", "-n", NS, "addr", "add", "198.51.100.9/24", "dev", "h3x"],
        ):
            subprocess.run(argv, check=True, capture_output=True)
        yield NS
    finally:
        subprocess.run(["ip", "netns", "del", NS], capture_output=True)


def test_namespace_devices_is_open_to_read(system_bus: DbusDaemon, named_ns: str) -> None:
    ino = os.stat(f"/run/netns/{named_ns}").st_ino
    own = os.stat("/proc/self/ns/net").st_ino

    async def body(h: Harness) -> None:
        out = await run(as_nobody(gdbus_call(h.address, "org.smcd.Manager1.NamespaceDevices")))
        assert out.returncode == 0, out
        assert f"uint64 {own}, 'host', true" in out.stdout, out.stdout
        assert f"{ino}, '{named_ns}', false" in out.stdout, out.stdout
        # the typed answer: Device1's shape per device, smcd's own first
        reply = await h.manager("NamespaceDevices")
        assert reply.signature == "a(tsbaa{sv}s)", reply.signature
        (rows,) = reply.body
        assert list(rows[0][:3]) == [own, "host", True]
        assert {d["Name"].value for d in rows[0][3]} >= {"lo", "veth-a", "loopback-ism"}
        (theirs,) = [r for r in rows if r[0] == ino]
        devs = {d["Name"].value: d for d in theirs[3]}
        assert set(devs) == {"lo", "h3x", "h3y"} and theirs[4] == "", theirs
        assert ("198.51.100.9", 24) in [tuple(a) for a in devs["h3x"]["Addresses"].value]
        assert devs["h3x"]["Kind"].value == "netdev" and devs["h3x"]["PnetId"].value == ""
        # callers that ask at once (they share one scan) each get an answer
        many = await asyncio.gather(*(h.manager("NamespaceDevices") for _ in range(5)))
        assert all(any(r[0] == ino for r in m.body[0]) for m in many), many

    async def main() -> None:
        async with smcd_on_bus(system_bus.address) as h:
            await asyncio.wait_for(body(h), 40)

    asyncio.run(main())


def test_a_namespace_smcd_may_not_join_says_why(named_ns: str) -> None:
    """Without CAP_SYS_ADMIN (an smcd under a hardened unit) each namespace it cannot read is
    listed with the reason, not silently left out."""
    probe = (
        "import asyncio\n"
        "from smcd_daemon.adapters.netns_view import namespace_devices\n"
        "for n in asyncio.run(namespace_devices()):\n"
        "    print(n.inode, n.name, len(n.netdevs), n.problem, sep='|')\n"
    )
    repo = os.fspath(Path(__file__).resolve().parents[2])
    out = subprocess.run(
        as_nobody([sys.executable, "-c", probe]),
        capture_output=True, text=True, timeout=60, cwd=repo,
        env={**os.environ, "PYTHONPATH": repo},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    ino = os.stat(f"/run/netns/{named_ns}").st_ino
    (mine,) = [line.split("|") for line in out.stdout.splitlines() if line.startswith(f"{ino}|")]
    assert mine[1:3] == [named_ns, "0"], mine
    assert mine[3].startswith("cannot join: Operation not permitted (joining a namespace takes "
                              "CAP_SYS_ADMIN"), mine  # fmt: skip
