"""``Manager1.NamespaceDevices`` (#15) through the shipped system-bus policy in a real
dbus-daemon: an unprivileged caller may read it, as every read method, and gets smcd's own
devices (namespace "host") and the netdevs of a real named namespace, each under its inode."""

from __future__ import annotations

import asyncio
import os
import subprocess
from collections.abc import Iterator

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
