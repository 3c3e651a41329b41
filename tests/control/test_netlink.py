"""NetlinkWatcher against real network namespaces and veth pairs.

Namespace A holds ``sva`` (watched), namespace B its veth peer ``svb``; switching ``svb`` down takes
the carrier away from ``sva`` as unplugging a cable would.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import shutil
import socket
import struct
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from smcd_daemon.adapters.netlink import NetlinkWatcher, check_datagram
from smcd_daemon.core.devices import (
    Address,
    DeviceEvent,
    DeviceInventory,
    EventKind,
    NetDevice,
    OperState,
    Route,
)

pytestmark = pytest.mark.timeout(60)

ip = ipaddress.ip_address
#: The issue's bound for a link/address change to reach the model.
DEADLINE = 1.0


def sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, text=True)


@dataclass
class Pair:
    ns_a: str
    ns_b: str


@pytest.fixture
def pair() -> Iterator[Pair]:
    if shutil.which("ip") is None:
        pytest.fail("iproute2's `ip` is missing: install it with tests/host/install-deps.sh")
    if os.geteuid() != 0:
        pytest.fail("network namespace tests need root (CI runs as root)")
    tag = f"smcdnl{os.getpid()}x{time.monotonic_ns() % 100000}"
    p = Pair(f"{tag}a", f"{tag}b")
    try:
        sh("ip", "netns", "add", p.ns_a)
        sh("ip", "netns", "add", p.ns_b)
        # Distinct ifindexes on the two ends: the kernel's linkwatch treats a carrier change of a
        # device whose ifindex differs from its iflink as urgent and reports it at once; with
        # equal indexes (both "first device" of fresh namespaces) it may hold it for up to 1 s
        # after the previous link event anywhere on the host (linkwatch_urgent_event()).
        sh("ip", "-n", p.ns_a, "link", "add", "sva", "index", "10", "type", "veth", "peer",
           "name", "svb", "index", "20", "netns", p.ns_b)  # fmt: skip
        sh("ip", "-n", p.ns_a, "addr", "add", "192.0.2.1/24", "dev", "sva")
        sh("ip", "-n", p.ns_b, "addr", "add", "192.0.2.2/24", "dev", "svb")
        sh("ip", "-n", p.ns_a, "link", "set", "sva", "up")
        sh("ip", "-n", p.ns_b, "link", "set", "svb", "up")
        sh("ip", "-n", p.ns_a, "link", "set", "lo", "up")
        yield p
    finally:
        for ns in (p.ns_a, p.ns_b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


class Recorder:
    """Subscriber that keeps events and lets a test await one matching a predicate."""

    def __init__(self, inv: DeviceInventory) -> None:
        self.events: list[DeviceEvent] = []
        self._cond = asyncio.Condition()
        inv.subscribe(self._on_event)

    def _on_event(self, ev: DeviceEvent) -> None:
        self.events.append(ev)
        asyncio.get_running_loop().create_task(self._notify())

    async def _notify(self) -> None:
        async with self._cond:
            self._cond.notify_all()

    async def wait(
        self, pred: Callable[[DeviceEvent], bool], since: int = 0, timeout: float = 3.0
    ) -> DeviceEvent:
        async def find() -> DeviceEvent:
            async with self._cond:
                while True:
                    for ev in self.events[since:]:
                        if pred(ev):
                            return ev
                    await self._cond.wait()

        return await asyncio.wait_for(find(), timeout)


def run(coro: Coroutine[Any, Any, None]) -> None:
    asyncio.run(coro)


async def ip_cmd(*args: str) -> float:
    """Run ``ip …`` and return the monotonic time just before it started."""
    t0 = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        "ip", *args, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    _, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()
    return t0


def is_dev(name: str, pred: Callable[[NetDevice], bool]) -> Callable[[DeviceEvent], bool]:
    return lambda ev: (
        isinstance(ev.object, NetDevice) and ev.object.name == name and pred(ev.object)
    )


def is_event(
    cls: type, kind: EventKind | None = None, **attrs: object
) -> Callable[[DeviceEvent], bool]:
    """An event about a ``cls`` object (of ``kind``, if given) whose attributes equal ``attrs``."""
    return lambda ev: (
        isinstance(ev.object, cls)
        and (kind is None or ev.kind is kind)
        and all(getattr(ev.object, k) == v for k, v in attrs.items())
    )


@dataclass
class Watch:
    inv: DeviceInventory
    rec: Recorder
    watcher: NetlinkWatcher


@contextlib.asynccontextmanager
async def watching(pair: Pair) -> AsyncIterator[Watch]:
    """A started NetlinkWatcher on namespace A feeding a fresh inventory, stopped on exit."""
    inv = DeviceInventory()
    w = Watch(inv, Recorder(inv), NetlinkWatcher(inv, netns=pair.ns_a))
    await w.watcher.start()
    try:
        yield w
    finally:
        await w.watcher.stop()


# -------------------------------------------------------------------------------------------


def test_dump_shows_the_veth_with_addresses_routes_and_neighbours(pair: Pair) -> None:
    sh("ip", "-n", pair.ns_a, "neigh", "add", "192.0.2.2", "lladdr", "02:00:00:00:00:02",
       "dev", "sva", "nud", "permanent")  # fmt: skip

    async def main() -> None:
        async with watching(pair) as w:
            dev = w.inv.netdev_by_name("sva")
            assert dev is not None, [d.name for d in w.inv.netdevs()]
            assert dev.kind == "veth" and dev.mtu == 1500 and dev.admin_up and dev.carrier
            assert dev.operstate is OperState.UP and dev.is_up
            assert dev.mac is not None and len(dev.mac.split(":")) == 6
            assert Address(dev.ifindex, ip("192.0.2.1"), 24) in dev.addresses
            # svb lives in the other namespace: not ours to see.
            assert w.inv.netdev_by_name("svb") is None
            assert {d.name for d in w.inv.netdevs()} == {"lo", "sva"}
            lo = w.inv.netdev_by_name("lo")
            assert lo is not None and ip("127.0.0.1") in {a.address for a in lo.addresses}

            route = w.inv.route_to("192.0.2.77")
            assert route is not None and route.oif == dev.ifindex and route.gateway is None
            n = w.inv.neighbour(dev.ifindex, "192.0.2.2")
            assert n is not None and n.valid and n.lladdr == "02:00:00:00:00:02"
            assert w.watcher.skipped == 0

    run(main())


def test_peer_down_and_up_changes_carrier_within_a_second(pair: Pair) -> None:
    async def main() -> None:
        async with watching(pair) as w:
            n = len(w.rec.events)
            t0 = await ip_cmd("-n", pair.ns_b, "link", "set", "svb", "down")
            ev = await w.rec.wait(is_dev("sva", lambda d: not d.carrier), since=n)
            assert ev.kind is EventKind.CHANGED
            assert ev.timestamp - t0 < DEADLINE, f"carrier loss seen after {ev.timestamp - t0}s"
            dev = w.inv.netdev_by_name("sva")
            assert dev is not None and not dev.carrier and not dev.is_up
            assert dev.admin_up  # only the peer went down
            assert dev.operstate in (OperState.DOWN, OperState.LOWERLAYERDOWN)

            n = len(w.rec.events)
            t0 = await ip_cmd("-n", pair.ns_b, "link", "set", "svb", "up")
            ev = await w.rec.wait(is_dev("sva", lambda d: d.carrier and d.is_up), since=n)
            assert ev.timestamp - t0 < DEADLINE, f"carrier back seen after {ev.timestamp - t0}s"

    run(main())


def test_address_add_and_remove_within_a_second(pair: Pair) -> None:
    async def main() -> None:
        async with watching(pair) as w:
            new = ip("198.51.100.7")
            n = len(w.rec.events)
            t0 = await ip_cmd("-n", pair.ns_a, "addr", "add", "198.51.100.7/24", "dev", "sva")
            ev = await w.rec.wait(
                is_event(Address, EventKind.ADDED, address=new),
                since=n,
            )
            assert ev.timestamp - t0 < DEADLINE
            assert isinstance(ev.object, Address) and ev.object.prefixlen == 24
            dev_ev = await w.rec.wait(
                is_dev("sva", lambda d: new in {a.address for a in d.addresses}), since=n
            )
            assert dev_ev.timestamp - t0 < DEADLINE
            # The kernel adds the prefix route along with the address.
            await w.rec.wait(
                is_event(Route, dst=ipaddress.ip_network("198.51.100.0/24")),
                since=n,
            )

            n = len(w.rec.events)
            t0 = await ip_cmd("-n", pair.ns_a, "addr", "del", "198.51.100.7/24", "dev", "sva")
            ev = await w.rec.wait(
                is_event(Address, EventKind.REMOVED, address=new),
                since=n,
            )
            assert ev.timestamp - t0 < DEADLINE
            dev = w.inv.netdev_by_name("sva")
            assert dev is not None and new not in {a.address for a in dev.addresses}
            assert ip("192.0.2.1") in {a.address for a in dev.addresses}

    run(main())


def test_admin_down_drops_routes_the_kernel_flushes_silently(pair: Pair) -> None:
    async def main() -> None:
        async with watching(pair) as w:
            assert w.inv.route_to("192.0.2.9") is not None
            n = len(w.rec.events)
            t0 = await ip_cmd("-n", pair.ns_a, "link", "set", "sva", "down")
            ev = await w.rec.wait(is_dev("sva", lambda d: not d.admin_up), since=n)
            assert ev.timestamp - t0 < DEADLINE
            await w.rec.wait(
                is_event(Route, EventKind.REMOVED, dst=ipaddress.ip_network("192.0.2.0/24")),
                since=n,
            )
            assert w.inv.route_to("192.0.2.9") is None

    run(main())


def test_link_deletion_removes_the_device_and_what_hangs_on_it(pair: Pair) -> None:
    async def main() -> None:
        async with watching(pair) as w:
            dev = w.inv.netdev_by_name("sva")
            assert dev is not None
            n = len(w.rec.events)
            t0 = await ip_cmd("-n", pair.ns_a, "link", "del", "sva")
            ev = await w.rec.wait(
                is_event(NetDevice, EventKind.REMOVED, name="sva"),
                since=n,
            )
            assert ev.timestamp - t0 < DEADLINE
            assert w.inv.netdev_by_name("sva") is None
            assert w.inv.addresses(dev.ifindex) == ()
            assert all(r.oif != dev.ifindex for r in w.inv.routes())
            assert all(nb.ifindex != dev.ifindex for nb in w.inv.neighbours())
            assert [d.name for d in w.inv.netdevs()] == ["lo"]

    run(main())


def test_new_link_appears(pair: Pair) -> None:
    async def main() -> None:
        async with watching(pair) as w:
            n = len(w.rec.events)
            t0 = await ip_cmd(
                "-n", pair.ns_a, "link", "add", "sx", "type", "veth", "peer", "name", "sy"
            )
            ev = await w.rec.wait(
                is_event(NetDevice, EventKind.ADDED, name="sx"),
                since=n,
            )
            assert ev.timestamp - t0 < DEADLINE
            assert isinstance(ev.object, NetDevice) and ev.object.kind == "veth"
            assert not ev.object.admin_up
            await w.rec.wait(lambda e: isinstance(e.object, NetDevice) and e.object.name == "sy")

    run(main())


GARBAGE_SENDER = r"""
import socket, struct, sys
portid = int(sys.argv[1])
s = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE)
s.bind((0, 0))
def hdr(length, mtype, flags=0, seq=0):
    return struct.pack("=IHHII", length, mtype, flags, seq, 0)
def nla(kind, payload):
    n = 4 + len(payload)
    return struct.pack("=HH", n, kind) + payload + b"\0" * ((4 - n % 4) % 4)
# A well-formed RTM_NEWLINK announcing a device that does not exist: spoofing, not garbage.
body = struct.pack("=BxHiII", 0, 1, 4242, 0x1 | 0x40 | 0x10000, 0) + nla(3, b"evil0\0")
payloads = [
    b"\xff" * 7,
    hdr(16, 16),
    hdr(1000, 16) + b"\0" * 20,
    hdr(20, 0x7FFF) + b"\0" * 4,
    hdr(16 + len(body), 16) + body,
]
for p in payloads:
    s.sendto(p, (portid, 0))
print(len(payloads))
"""


JUNK: list[object] = [
    None,
    42,
    "x",
    {},
    {"header": {}},
    {"header": {"type": 16}},
    {"header": {"type": 20}, "family": 2, "index": 1, "address": "bad"},
    {"header": {"type": 24}, "family": 2, "dst_len": 99, "dst": "192.0.2.0"},
    {"header": {"type": 28}, "family": 2, "ifindex": "one", "dst": "192.0.2.2"},
]


def _hdr(length: int, mtype: int) -> bytes:
    return struct.pack("=IHHII", length, mtype, 0, 0, 0)


@pytest.mark.parametrize(
    ("data", "addr", "problem"),
    [
        (_hdr(32, 16) + bytes(16), (0, 1), None),
        (_hdr(32, 16) + bytes(16) + _hdr(24, 20) + bytes(8), (0, 1), None),
        (_hdr(32, 16) + bytes(16), (4711, 0), "not the kernel"),
        (b"\xff" * 7, (0, 1), "shorter than a netlink header"),
        (_hdr(16, 16), (0, 1), "0-byte body"),
        (_hdr(20, 24) + bytes(4), (0, 1), "4-byte body"),
        (_hdr(1000, 16) + bytes(20), (0, 1), "claims 1000 bytes"),
        (_hdr(8, 16) + bytes(8), (0, 1), "claims 8 bytes"),
        (_hdr(32, 16) + bytes(16) + b"\0" * 5, (0, 1), "trailing bytes"),
        (_hdr(20, 0x7FFF) + bytes(4), (0, 1), None),  # unknown types reach the dispatcher
    ],
)
def test_datagram_checks(data: bytes, addr: tuple[int, int], problem: str | None) -> None:
    got = check_datagram(data, addr)
    if problem is None:
        assert got is None
    else:
        assert got is not None and problem in got


def test_garbage_and_spoofing_on_the_netlink_socket_are_survived(
    pair: Pair, caplog: pytest.LogCaptureFixture
) -> None:
    async def main() -> None:
        async with watching(pair) as w:
            # Junk through the message handler: logged and skipped.
            for junk in JUNK:
                w.watcher.handle_message(junk)
            assert w.watcher.skipped == len(JUNK)

            # Junk and a forged link from another process straight onto the event socket (root
            # may unicast to any netlink port of its namespace).
            portid = w.watcher.event_portid
            assert portid is not None and portid > 0
            proc = await asyncio.create_subprocess_exec(
                "ip", "netns", "exec", pair.ns_a, sys.executable, "-c", GARBAGE_SENDER,
                str(portid), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            )  # fmt: skip
            out, err = await proc.communicate()
            assert proc.returncode == 0, err.decode()
            sent = int(out)
            for _ in range(50):
                if w.watcher.rejected >= sent:
                    break
                await asyncio.sleep(0.02)
            assert w.watcher.rejected == sent
            assert w.inv.netdev_by_name("evil0") is None and w.inv.netdev(4242) is None
            assert w.watcher.resyncs == 0

            # Still following the kernel.
            n = len(w.rec.events)
            await ip_cmd("-n", pair.ns_a, "addr", "add", "203.0.113.5/24", "dev", "sva")
            await w.rec.wait(
                lambda e: isinstance(e.object, Address) and e.object.address == ip("203.0.113.5"),
                since=n,
            )

    with caplog.at_level(logging.WARNING):
        run(main())
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == [], [r.getMessage() for r in errors]
    assert any("not the kernel" in r.getMessage() for r in caplog.records)


def test_stop_is_clean_and_idempotent(pair: Pair) -> None:
    async def main() -> None:
        inv = DeviceInventory()
        watcher = NetlinkWatcher(inv, netns=pair.ns_a)
        await watcher.start()
        await watcher.stop()
        await watcher.stop()
        # No more updates after stop.
        before = inv.netdevs()
        await ip_cmd("-n", pair.ns_a, "link", "add", "sx", "type", "veth", "peer", "name", "sy")
        await asyncio.sleep(0.2)
        assert inv.netdevs() == before
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        assert others == []

    run(main())


def test_unknown_namespace_fails_loudly_and_is_not_created() -> None:
    name = f"smcdnl-missing-{os.getpid()}"

    async def main() -> None:
        watcher = NetlinkWatcher(DeviceInventory(), netns=name)
        with pytest.raises(FileNotFoundError):
            await watcher.start()
        await watcher.stop()

    try:
        run(main())
        assert not os.path.exists(f"/run/netns/{name}")
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


def test_own_namespace_without_netns_argument() -> None:
    async def main() -> None:
        inv = DeviceInventory()
        watcher = NetlinkWatcher(inv)
        await watcher.start()
        try:
            names = {d.name for d in inv.netdevs()}
            assert "lo" in names
            assert {socket.if_indextoname(d.ifindex) for d in inv.netdevs()} == names
        finally:
            await watcher.stop()

    run(main())
