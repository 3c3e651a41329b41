"""RDMA discovery: the host's real state through pyverbs, and the sysfs GID parser on a fake tree.

The real-device path (rxe ports, GID types from verbs, async port events) is exercised by the
SMC-R tests in the VM; here the host has no RDMA stack, which must be a quiet, normal state.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
from pathlib import Path

import pytest

from smcd_daemon.adapters import verbs
from smcd_daemon.adapters.verbs import (
    RdmaWatcher,
    discover_rdma,
    discover_sysfs,
    parse_gid_text,
    read_sysfs_gids,
)
from smcd_daemon.core.devices import DeviceInventory, GidType, PortState

pytestmark = pytest.mark.timeout(60)

SYSFS = Path("/sys/class/infiniband")


def host_rdma_names() -> list[str]:
    try:
        return sorted(p.name for p in SYSFS.iterdir())
    except OSError:
        return []


def test_pyverbs_is_importable() -> None:
    # Comes from Debian's python3-pyverbs; the venv sees system site-packages.
    import pyverbs.device  # type: ignore[import-untyped]  # noqa: F401


def test_discovery_matches_the_host_and_no_rdma_is_said_once(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(verbs, "_reported_none", False)
    with caplog.at_level(logging.INFO, logger="smcd_daemon.adapters.verbs"):
        first = discover_rdma()
        second = discover_rdma()
    names = host_rdma_names()
    no_rdma = [r for r in caplog.records if "no RDMA devices" in r.getMessage()]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    if not names:
        # This host (and the plain CI runner): a normal state, said once at info level.
        assert first == [] and second == []
        assert len(no_rdma) == 1 and no_rdma[0].levelno == logging.INFO
    else:
        # A host with RDMA (the SMC-R VM): every sysfs device is found, with its ports.
        assert [d.name for d in first] == names
        assert all(d.ports for d in first)
        assert no_rdma == []


def test_watcher_starts_and_stops_cleanly_on_this_host() -> None:
    async def main() -> None:
        inv = DeviceInventory()
        watcher = RdmaWatcher(inv, rescan_interval=0.05)
        await watcher.start()
        await asyncio.sleep(0.2)  # a few rescans
        assert [d.name for d in inv.rdma_devices()] == host_rdma_names()
        await watcher.stop()
        await watcher.stop()
        assert [t for t in asyncio.all_tasks() if t is not asyncio.current_task()] == []

    asyncio.run(main())


def test_watcher_finds_no_event_fd_where_none_was_opened() -> None:
    """The watcher identifies a context's async fd as the one new [infinibandevent] fd; opening
    something else (here a pipe) must not be mistaken for it."""
    from smcd_daemon.transport.verbs import new_event_fd, open_fds

    before = open_fds()
    r, w = os.pipe()
    try:
        assert new_event_fd(before) is None
    finally:
        os.close(r)
        os.close(w)


# -- sysfs parser against a fake tree -------------------------------------------------------


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


ZERO = "0000:0000:0000:0000:0000:0000:0000:0000"


def fake_rxe(root: Path, name: str, netdev: str, ipv4: str, state: str = "4: ACTIVE") -> None:
    """A device laid out as rdma_rxe does in /sys/class/infiniband."""
    dev = root / name
    write(dev / "node_guid", "5054:00ff:fe12:3456")
    port = dev / "ports" / "1"
    write(port / "state", state)
    write(port / "link_layer", "Ethernet")
    v4 = ipaddress.IPv4Address(ipv4).packed.hex()
    mapped = f"0000:0000:0000:0000:0000:ffff:{v4[:4]}:{v4[4:]}"
    table = {
        0: ("fe80:0000:0000:0000:5054:00ff:fe12:3456", "IB/RoCE v1", netdev),
        1: ("fe80:0000:0000:0000:5054:00ff:fe12:3456", "RoCE v2", netdev),
        2: (mapped, "IB/RoCE v1", netdev),
        3: (mapped, "RoCE v2", netdev),
    }
    for idx, (gid, kind, nd) in table.items():
        write(port / "gids" / str(idx), gid)
        write(port / "gid_attrs" / "types" / str(idx), kind)
        write(port / "gid_attrs" / "ndevs" / str(idx), nd)
    # Empty slots: zero GID, and type/ndev attributes that cannot be read (EINVAL in sysfs).
    for idx in range(4, 8):
        write(port / "gids" / str(idx), ZERO)


def test_sysfs_gid_table_with_types_and_netdevs(tmp_path: Path) -> None:
    fake_rxe(tmp_path, "rxe0", "eth7", "192.0.2.1")
    (devs,) = [discover_sysfs(tmp_path)]
    assert [d.name for d in devs] == ["rxe0"]
    dev = devs[0]
    assert dev.node_guid == 0x505400FFFE123456 and dev.node_guid_str == "5054:00ff:fe12:3456"
    (port,) = dev.ports
    assert port.device == "rxe0" and port.num == 1
    assert port.state is PortState.ACTIVE and port.active
    assert port.link_layer == "Ethernet"
    assert [(g.index, g.type) for g in port.gids] == [
        (0, GidType.ROCE_V1),
        (1, GidType.ROCE_V2),
        (2, GidType.ROCE_V1),
        (3, GidType.ROCE_V2),
    ]
    assert {g.netdev for g in port.gids} == {"eth7"} and port.netdev == "eth7"
    assert port.gids[3].ipv4 == ipaddress.IPv4Address("192.0.2.1")
    assert port.gids[1].ipv4 is None
    assert port.gids[0].gid == bytes.fromhex("fe80000000000000505400fffe123456")

    # The inventory finds the port from its netdev, as smc_pnet_find_rdma_dev does.
    inv = DeviceInventory()
    inv.replace_rdma_devices(devs)
    assert [(p.device, p.num) for p in inv.rdma_ports_for_netdev("eth7")] == [("rxe0", 1)]
    assert inv.rdma_ports_for_netdev("eth8") == []


def test_sysfs_skips_what_it_cannot_read(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    fake_rxe(tmp_path, "rxe0", "eth7", "192.0.2.1", state="1: DOWN")
    port = tmp_path / "rxe0" / "ports" / "1"
    write(port / "gids" / "8", "not-a-gid")  # malformed
    write(port / "gids" / "9", "fe80:0000:0000:0000:0000:0000:0000:0009")
    write(port / "gid_attrs" / "types" / "9", "iWARP?")  # unknown type
    write(port / "gids" / "10", "fe80:0000:0000:0000:0000:0000:0000:000a")  # no type: skipped
    write(port / "gids" / "11", "fe80:0000:0000:0000:0000:0000:0000:000b")
    write(port / "gid_attrs" / "types" / "11", "RoCE v2")  # no ndev: fine, netdev None
    (port / "gids" / "junk").write_text("x")  # not an index
    with caplog.at_level(logging.WARNING):
        gids = read_sysfs_gids(port)
    assert [g.index for g in gids] == [0, 1, 2, 3, 11]
    assert gids[-1].netdev is None and gids[-1].type is GidType.ROCE_V2
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert "malformed GID" in messages and "unknown type" in messages

    (dev,) = discover_sysfs(tmp_path)
    assert dev.ports[0].state is PortState.DOWN and not dev.ports[0].active


def test_sysfs_multiple_devices_and_missing_root(tmp_path: Path) -> None:
    fake_rxe(tmp_path, "rxe1", "eth1", "198.51.100.1")
    fake_rxe(tmp_path, "rxe0", "eth0", "192.0.2.1")
    write(tmp_path / "rxe0" / "ports" / "1" / "state", "garbage")
    devs = discover_sysfs(tmp_path)
    assert [d.name for d in devs] == ["rxe0", "rxe1"]
    assert devs[0].ports[0].state is PortState.DOWN  # unparsable state is not ACTIVE
    assert discover_sysfs(tmp_path / "absent") == []


@pytest.mark.parametrize(
    "text",
    [
        "",
        "fe80::1",
        "fe80:0000:0000:0000:0000:0000:0000",
        "zzzz:0000:0000:0000:0000:0000:0000:0000",
    ],
)
def test_parse_gid_text_rejects_malformed(text: str) -> None:
    with pytest.raises(ValueError):
        parse_gid_text(text)


class CountingWatcher(RdmaWatcher):
    """Counts full rediscoveries (the expensive part: every device opened)."""

    full_scans = 0

    async def rescan(self) -> None:
        self.full_scans += 1
        await super().rescan()


def test_periodic_check_rediscovers_only_when_the_device_list_changes(tmp_path: Path) -> None:
    async def main() -> None:
        watcher = CountingWatcher(
            DeviceInventory(),
            rescan_interval=0.02,
            full_rescan_interval=3600.0,
            sysfs_root=tmp_path,
        )
        await watcher.start()
        try:
            await asyncio.sleep(0.3)  # ~15 ticks, nothing changed
            assert watcher.full_scans == 1
            (tmp_path / "rxe_new").mkdir()  # a device appears (rdma link add)
            for _ in range(100):
                if watcher.full_scans > 1:
                    break
                await asyncio.sleep(0.02)
            assert watcher.full_scans > 1
        finally:
            await watcher.stop()

        safety = CountingWatcher(
            DeviceInventory(), rescan_interval=0.02, full_rescan_interval=0.05, sysfs_root=tmp_path
        )
        (tmp_path / "rxe_new").rmdir()
        await safety.start()
        try:
            await asyncio.sleep(0.4)
            assert safety.full_scans >= 3  # the safety net still runs
        finally:
            await safety.stop()

    asyncio.run(main())
