"""The daemon's RDMA watcher (``smcd_daemon.adapters.verbs.RdmaWatcher``) on real rxe devices.

It must find each device's async event fd without reading pyverbs' ``Context.context`` (which
segfaults pyverbs 44), and turn a real port event into an inventory change — well before its
periodic rescan could have noticed (the rescan interval is set far beyond the test's wait).
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import time

from smcd_daemon.adapters.verbs import RdmaWatcher
from smcd_daemon.core.devices import DeviceEvent, DeviceInventory, PortState, RdmaDevice
from tests.vm.topology import POLICY_TABLE, Port, ports_of

WAIT = 120.0  # seconds for any single event under TCG (never a timing assertion)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, timeout=60, capture_output=True)


def _port_state(inv: DeviceInventory, rxe: str) -> PortState | None:
    dev = inv.rdma_device(rxe)
    return None if dev is None else dev.ports[0].state


def test_watcher_turns_a_port_event_into_an_inventory_change(ports: tuple[Port, ...]) -> None:
    nic = ports_of("b")[1]
    inv = DeviceInventory(loopback_enabled=False)
    events: list[DeviceEvent] = []
    inv.subscribe(events.append)
    watcher = RdmaWatcher(inv, rescan_interval=3600.0)

    async def until(state_ok: object, what: str) -> None:
        deadline = time.monotonic() + WAIT
        while not state_ok():  # type: ignore[operator]
            if time.monotonic() > deadline:
                raise AssertionError(f"inventory never showed {what}; events: {events[-5:]}")
            await asyncio.sleep(0.1)

    async def body() -> None:
        await watcher.start()
        try:
            assert sorted(d.name for d in inv.rdma_devices()) == sorted(p.rxe for p in ports)
            opened = watcher._open  # the watcher's open contexts, one per device
            assert all(dev.async_fd is not None for dev in opened.values()), {
                name: dev.async_fd for name, dev in opened.items()
            }
            assert _port_state(inv, nic.rxe) == PortState.ACTIVE
            events.clear()

            _ip("link", "set", "dev", nic.ifname, "down")
            await until(lambda: _port_state(inv, nic.rxe) != PortState.ACTIVE, "port down")
            changed = [e.object for e in events if isinstance(e.object, RdmaDevice)]
            assert any(d.name == nic.rxe for d in changed)

            _ip("link", "set", "dev", nic.ifname, "up")
            await until(lambda: _port_state(inv, nic.rxe) == PortState.ACTIVE, "port active")
        finally:
            await watcher.stop()

    try:
        asyncio.run(body())
    finally:
        _ip("link", "set", "dev", nic.ifname, "up")
        with contextlib.suppress(subprocess.CalledProcessError):
            _ip(
                "route", "replace", f"{nic.peer_address}/32", "dev", nic.ifname,
                "src", nic.address, "table", str(POLICY_TABLE),
            )  # fmt: skip
