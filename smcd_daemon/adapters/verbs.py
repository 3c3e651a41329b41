"""RDMA device discovery and port events through pyverbs (rdma-core's Python binding).

No RDMA stack on the host is an ordinary state (most machines): :func:`discover_rdma` returns
``[]`` and says "no RDMA devices" once at info level.  The GID table comes from
``ibv_query_gid_table`` (type and netdev per entry); where that is unavailable, from sysfs
``/sys/class/infiniband/<dev>/ports/<n>/gid_attrs/{types,ndevs}/<idx>``, which every kernel with
RoCE support has.

Port events: pyverbs' ``Context.get_async_event`` blocks while holding the GIL, so it may only be
called once the context's ``async_fd`` is readable.  pyverbs 44 does not expose that fd, and
reading the C ``struct ibv_context`` behind ``Context.context`` crashes the interpreter; but
``ibv_open_device`` opens exactly one new ``anon_inode:[infinibandevent]`` descriptor, so the fd
that appears while the context is opened is the async fd
(:func:`~smcd_daemon.transport.verbs.new_event_fd`).  When that is not exactly one, the device's
ports are re-read periodically instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import socket
import struct
import time
from pathlib import Path
from typing import Any

from smcd_daemon.core.devices import (
    DeviceInventory,
    Gid,
    GidType,
    PortState,
    RdmaDevice,
    RdmaPort,
)
from smcd_daemon.transport.verbs import new_event_fd, open_fds

log = logging.getLogger(__name__)

SYSFS_INFINIBAND = Path("/sys/class/infiniband")

#: ``enum ibv_mtu`` → bytes.
IBV_MTU_BYTES = {1: 256, 2: 512, 3: 1024, 4: 2048, 5: 4096}
#: ``enum ibv_link_layer``.
LINK_LAYERS = {0: "Unspecified", 1: "InfiniBand", 2: "Ethernet"}
#: ``enum ibv_gid_type`` (as ``ibv_query_gid_table`` reports it).
IBV_GID_TYPES = {0: GidType.IB, 1: GidType.ROCE_V1, 2: GidType.ROCE_V2}

_reported_none = False


def _report_no_rdma(reason: str) -> None:
    """Say "no RDMA devices" once per process: it is a state, not an error to repeat."""
    global _reported_none
    if not _reported_none:
        _reported_none = True
        log.info("no RDMA devices (%s); SMC-R unavailable, SMC-D loopback-ism still works", reason)


# --------------------------------------------------------------------------------------------
# sysfs (works everywhere, also the parser the tests check against a fake tree)
# --------------------------------------------------------------------------------------------


def _read(path: Path) -> str | None:
    """File content stripped, or None when the attribute is absent or unreadable (sysfs returns
    EINVAL for GID attributes of empty table entries)."""
    try:
        return path.read_text().strip()
    except OSError:
        return None


def parse_gid_text(text: str) -> bytes:
    """``fe80:0000:0000:0000:5054:00ff:fe12:3456`` (sysfs) → 16 bytes."""
    parts = text.strip().split(":")
    if len(parts) != 8 or any(len(p) != 4 for p in parts):
        raise ValueError(f"malformed GID {text!r}")
    return bytes.fromhex("".join(parts))


def read_sysfs_gids(port_dir: Path) -> tuple[Gid, ...]:
    """The non-empty GID entries of one port, with type and netdev from ``gid_attrs``."""
    gids_dir = port_dir / "gids"
    if not gids_dir.is_dir():
        return ()
    out: list[Gid] = []
    for entry in sorted(gids_dir.iterdir(), key=lambda p: int(p.name) if p.name.isdigit() else -1):
        if not entry.name.isdigit():
            continue
        text = _read(entry)
        if text is None:
            continue
        try:
            raw = parse_gid_text(text)
        except ValueError:
            log.warning("ignoring malformed GID %r in %s", text, entry)
            continue
        if raw == bytes(16):
            continue  # empty slot
        type_text = _read(port_dir / "gid_attrs" / "types" / entry.name)
        if type_text is None:
            continue  # empty or being changed
        try:
            gid_type = GidType.parse(type_text)
        except ValueError:
            log.warning("ignoring GID %s of unknown type %r in %s", entry.name, type_text, port_dir)
            continue
        ndev = _read(port_dir / "gid_attrs" / "ndevs" / entry.name)
        out.append(Gid(index=int(entry.name), gid=raw, type=gid_type, netdev=ndev or None))
    return tuple(out)


def _parse_port_state(text: str | None) -> PortState:
    """sysfs ``state`` reads "4: ACTIVE"."""
    if not text:
        return PortState.DOWN
    head = text.split(":", 1)[0].strip()
    try:
        return PortState(int(head))
    except ValueError:
        return PortState.DOWN


def read_sysfs_port(dev_dir: Path, num: int) -> RdmaPort:
    port_dir = dev_dir / "ports" / str(num)
    return RdmaPort(
        device=dev_dir.name,
        num=num,
        state=_parse_port_state(_read(port_dir / "state")),
        active_mtu=0,  # not in sysfs; verbs fills it in
        link_layer=_read(port_dir / "link_layer") or "Unspecified",
        gids=read_sysfs_gids(port_dir),
    )


def _parse_guid(text: str | None) -> int:
    if not text:
        return 0
    try:
        return int(text.replace(":", ""), 16)
    except ValueError:
        return 0


def read_sysfs_device(dev_dir: Path) -> RdmaDevice:
    ports_dir = dev_dir / "ports"
    nums = (
        sorted(int(p.name) for p in ports_dir.iterdir() if p.name.isdigit())
        if ports_dir.is_dir()
        else []
    )
    return RdmaDevice(
        name=dev_dir.name,
        node_guid=_parse_guid(_read(dev_dir / "node_guid")),
        ports=tuple(read_sysfs_port(dev_dir, n) for n in nums),
    )


def sysfs_device_names(root: Path = SYSFS_INFINIBAND) -> list[str]:
    try:
        return sorted(p.name for p in root.iterdir())
    except OSError:
        return []


def discover_sysfs(root: Path = SYSFS_INFINIBAND) -> list[RdmaDevice]:
    """All RDMA devices from sysfs alone (no MTU); [] when the class directory is absent."""
    return [read_sysfs_device(root / name) for name in sysfs_device_names(root)]


# --------------------------------------------------------------------------------------------
# pyverbs
# --------------------------------------------------------------------------------------------


def _pyverbs() -> Any | None:
    try:
        import pyverbs.device as pvd  # type: ignore[import-untyped]
    except ImportError:
        return None
    return pvd


def _ifname(ifindex: int) -> str | None:
    if ifindex <= 0:
        return None
    try:
        return socket.if_indextoname(ifindex)
    except OSError:
        return None  # netdev in another namespace, or gone


def _gid_bytes(subnet_prefix: int, interface_id: int) -> bytes:
    """pyverbs hands the two halves as the raw (network-order) 64-bit words."""
    return struct.pack("=QQ", subnet_prefix & (2**64 - 1), interface_id & (2**64 - 1))


def query_device(ctx: Any, name: str, root: Path = SYSFS_INFINIBAND) -> RdmaDevice:
    """Read one opened device: ports via ``ibv_query_port``, GIDs via ``ibv_query_gid_table``
    (sysfs when that fails, e.g. on kernels without the GID table ioctl)."""
    attr = ctx.query_device()
    nports = int(attr.phys_port_cnt)
    port_attrs = {n: ctx.query_port(n) for n in range(1, nports + 1)}
    gids_by_port: dict[int, list[Gid]] = {n: [] for n in port_attrs}
    try:
        total = sum(int(pa.gid_tbl_len) for pa in port_attrs.values()) or 1
        for e in ctx.query_gid_table(total):
            gid_type = IBV_GID_TYPES.get(int(e.gid_type))
            if gid_type is None or int(e.port_num) not in gids_by_port:
                continue
            raw = _gid_bytes(int(e.gid_subnet_prefix), int(e.gid_interface_id))
            if raw == bytes(16):
                continue
            gids_by_port[int(e.port_num)].append(
                Gid(int(e.gid_index), raw, gid_type, _ifname(int(e.ndev_ifindex)))
            )
        gid_source = "verbs"
    except Exception as exc:  # PyverbsRDMAError and friends; the fallback is complete anyway
        log.debug("ibv_query_gid_table on %s failed (%s); reading sysfs", name, exc)
        gid_source = "sysfs"
    ports = []
    for n, pa in port_attrs.items():
        if gid_source == "verbs":
            gids = tuple(sorted(gids_by_port[n], key=lambda g: g.index))
        else:
            gids = read_sysfs_gids(root / name / "ports" / str(n))
        try:
            state = PortState(int(pa.state))
        except ValueError:
            state = PortState.DOWN
        ports.append(
            RdmaPort(
                device=name,
                num=n,
                state=state,
                active_mtu=IBV_MTU_BYTES.get(int(pa.active_mtu), 0),
                link_layer=LINK_LAYERS.get(int(pa.link_layer), "Unspecified"),
                gids=gids,
            )
        )
    guid = _parse_guid(_read(root / name / "node_guid")) or int(attr.node_guid)
    return RdmaDevice(name=name, node_guid=guid, ports=tuple(ports))


def _verbs_device_names(pvd: Any) -> list[str]:
    try:
        devs = pvd.get_device_list()
    except Exception:
        # libibverbs returns NULL (ENOSYS) when /sys/class/infiniband does not exist.
        return []
    names = []
    for d in devs:
        n = d.name
        names.append(n.decode() if isinstance(n, bytes) else str(n))
    return sorted(names)


def discover_rdma(root: Path = SYSFS_INFINIBAND) -> list[RdmaDevice]:
    """Every RDMA device with ports, state, MTU and GID table; [] when there are none."""
    pvd = _pyverbs()
    if pvd is None:
        devices = discover_sysfs(root)
        if not devices:
            _report_no_rdma("pyverbs not installed and no devices in sysfs")
        return devices
    names = _verbs_device_names(pvd)
    if not names:
        _report_no_rdma("libibverbs lists none")
        return []
    out = []
    for name in names:
        try:
            ctx = pvd.Context(name=name)
        except Exception as exc:
            log.warning("cannot open RDMA device %s: %s; using sysfs", name, exc)
            if (root / name).is_dir():
                out.append(read_sysfs_device(root / name))
            continue
        try:
            out.append(query_device(ctx, name, root))
        except Exception as exc:
            log.warning("cannot query RDMA device %s: %s", name, exc)
        finally:
            with contextlib.suppress(Exception):
                ctx.close()
    return out


# --------------------------------------------------------------------------------------------
# Port events
# --------------------------------------------------------------------------------------------


class _OpenDevice:
    def __init__(self, name: str, ctx: Any, async_fd: int | None) -> None:
        self.name = name
        self.ctx = ctx
        self.async_fd = async_fd


class RdmaWatcher:
    """Keeps the inventory's RDMA part current: initial discovery, async port events
    (PORT_ACTIVE/PORT_ERR/GID_CHANGE… → re-query that device), and a periodic check that notices
    devices appearing or vanishing (``rdma link add`` of an rxe device) and serves devices whose
    async fd could not be obtained.

    The periodic check lists sysfs names only; a full rediscovery (which opens every device) runs
    when that list changed, when some device has no async fd, and otherwise once per
    ``full_rescan_interval`` as a safety net: opening every device every few seconds is costly
    (most of all under emulation) and tells nothing the events did not already say."""

    def __init__(
        self,
        inventory: DeviceInventory,
        *,
        rescan_interval: float = 5.0,
        full_rescan_interval: float = 60.0,
        sysfs_root: Path = SYSFS_INFINIBAND,
    ) -> None:
        self._inv = inventory
        self._interval = rescan_interval
        self._full_interval = full_rescan_interval
        self._last_full = 0.0
        self._root = sysfs_root
        self._open: dict[str, _OpenDevice] = {}
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        await self.rescan()
        self._task = asyncio.create_task(self._rescan_loop(), name="smcd-rdma-rescan")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for name in list(self._open):
            self._close(name)

    async def rescan(self) -> None:
        """Re-discover all devices and open/close contexts for those that came and went."""
        self._last_full = time.monotonic()
        devices = await asyncio.to_thread(discover_rdma, self._root)
        self._inv.replace_rdma_devices(devices)
        names = {d.name for d in devices}
        for gone in [n for n in self._open if n not in names]:
            self._close(gone)
        for name in names - set(self._open):
            self._watch(name)

    async def _rescan_loop(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            try:
                if self._needs_rescan():
                    await self.rescan()
            except Exception:
                log.exception("RDMA rescan failed; will retry")

    def _needs_rescan(self) -> bool:
        if time.monotonic() - self._last_full >= self._full_interval:
            return True
        if any(dev.async_fd is None for dev in self._open.values()):
            return True
        return set(sysfs_device_names(self._root)) != set(self._open)

    def _watch(self, name: str) -> None:
        pvd = _pyverbs()
        if pvd is None or self._loop is None:
            return
        # pyverbs 44 exposes no async fd, and reading the C struct behind Context.context crashes
        # the interpreter; ibv_open_device opens exactly one new [infinibandevent] fd: that one.
        before = open_fds()
        try:
            ctx = pvd.Context(name=name)
        except Exception as exc:
            log.warning("cannot open RDMA device %s for events: %s", name, exc)
            return
        fd = new_event_fd(before)
        dev = _OpenDevice(name, ctx, fd)
        self._open[name] = dev
        if fd is None:
            log.info("RDMA device %s: no async fd; port state follows the periodic rescan", name)
            return
        self._loop.add_reader(fd, self._on_async_event, dev)

    def _close(self, name: str) -> None:
        dev = self._open.pop(name, None)
        if dev is None:
            return
        if dev.async_fd is not None and self._loop is not None:
            with contextlib.suppress(Exception):
                self._loop.remove_reader(dev.async_fd)
        with contextlib.suppress(Exception):
            dev.ctx.close()

    def _on_async_event(self, dev: _OpenDevice) -> None:
        try:
            ev = dev.ctx.get_async_event()  # readable, so this does not block
        except Exception as exc:
            log.warning("RDMA device %s: reading async event failed (%s); closing", dev.name, exc)
            self._close(dev.name)
            return
        try:
            etype = int(ev.event_type)
        finally:
            with contextlib.suppress(Exception):
                ev.ack()
        log.info("RDMA device %s: async event %d", dev.name, etype)
        try:
            self._inv.apply_rdma_device(query_device(dev.ctx, dev.name, self._root))
        except Exception as exc:
            # DEVICE_FATAL or removal: the device is going away; the rescan settles it.
            log.warning("RDMA device %s: re-query after event failed: %s", dev.name, exc)
            if getattr(exc, "error_code", None) in (errno.ENODEV, errno.EIO):
                self._close(dev.name)
