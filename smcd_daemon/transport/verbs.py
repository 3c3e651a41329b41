"""SMC-R transport over RDMA verbs: a thin adapter over pyverbs (Debian ``python3-pyverbs``).

What it does, and nothing more: per RoCE device port a context, PD, one completion queue with its
completion channel, and an MR cache; per link an RC queue pair sized as the kernel sizes it
(16 send slots of 48 bytes for 44-byte LLC/CDC messages, 48 receive buffers, two RDMA WRITEs per
CDC send; SMC-Rv2 adds one 8 KiB buffer each way), moved INIT → RTR → RTS as
``smc_ib_modify_qp_init/rtr/rts`` do. Work requests go out as the link-group layer asks;
completions and async events come back as the events of
:mod:`~smcd_daemon.transport.verbs_model`. Which link, what to send, what an error means: all
decided above (``smcd_daemon.protocol.linkgroup``).

asyncio: :meth:`VerbsPort.start` watches the completion channel's fd with ``loop.add_reader``
and follows the verbs discipline: read the event, re-arm the CQ, then drain it (a completion that
lands between drain and re-arm still raises an event), acknowledging events in batches (every
event must be acked before the CQ is destroyed). pyverbs 44 does not expose the channel's fd; it
is the one new ``[infinibandevent]`` descriptor that appears while the channel is created. When
that cannot be told for sure, the port polls the CQ on a timer instead. Async events (port
active/down, QP fatal) come through the context's async fd, found the same way around
``ibv_open_device``. (Never by reading the C struct behind ``Context.context``: reading that
attribute crashes the interpreter with pyverbs 44 —
a segfault seen on rxe in the test VM.)

pyverbs is imported lazily, so this module imports on machines without RDMA; using it there
raises :class:`VerbsUnavailable` with what to install or why no device is there.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import fcntl
import itertools
import logging
import os
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from smcd_daemon.errors import SmcError
from smcd_daemon.transport.verbs_model import (
    SMC_IB_MAX_SEND_SGE,
    SMC_WR_BUF_CNT,
    SMC_WR_BUF_SIZE,
    SMC_WR_BUF_V2_SIZE,
    SMC_WR_RX_CNT,
    SMC_WR_TX_SIZE,
    SMC_WR_TX_WR_MAX,
    CompletionFailed,
    LinkError,
    LinkParams,
    MessageReceived,
    PortStateChanged,
    QpAttrSpec,
    RemoteRing,
    SendDone,
    VerbsEvent,
    WriteDone,
    WrKind,
    init_attrs,
    ipv4_mapped_gid,
    mac_from_gid,
    plan_ring_write,
    random_psn,
    rtr_attrs,
    rts_attrs,
    wc_status_name,
)

__all__ = [
    "MemoryRegion",
    "MrCache",
    "SendSlotsExhausted",
    "VerbsError",
    "VerbsLink",
    "VerbsPort",
    "VerbsUnavailable",
    "build_qp_attr",
    "list_devices",
    "load_pyverbs",
]

log = logging.getLogger(__name__)

SYSFS_INFINIBAND = Path("/sys/class/infiniband")
#: CQ entries per port (the kernel uses 32766 per CQ; capped by the device's max_cqe).
DEFAULT_CQE = 4096
#: Completions taken per ibv_poll_cq call.
_POLL_BATCH = 32
#: Ack CQ events in batches (ibv_ack_cq_events takes a mutex).
_ACK_BATCH = 32
_EVENT_FD_TARGET = "anon_inode:[infinibandevent]"


class VerbsUnavailable(SmcError):
    """No usable RDMA here: pyverbs missing, no devices, or the named device/port is absent."""


class VerbsError(SmcError):
    """A verbs call failed (the message names the call, the device and the errno)."""


class SendSlotsExhausted(VerbsError):
    """All send slots (or send queue entries) of the link are in flight: wait for SendDone."""


# --------------------------------------------------------------------------------------------
# pyverbs, lazily
# --------------------------------------------------------------------------------------------

_pv: SimpleNamespace | None = None


def load_pyverbs() -> SimpleNamespace:
    """The pyverbs modules we use, imported on first need; VerbsUnavailable if they are not
    installed (PyPI's pyverbs needs a newer libibverbs than Debian's: use python3-pyverbs in a
    ``--system-site-packages`` venv)."""
    global _pv
    if _pv is not None:
        return _pv
    try:
        import pyverbs.device as device  # type: ignore[import-untyped]
        import pyverbs.enums as enums  # type: ignore[import-untyped]
        from pyverbs import addr, cq, mr, pd, qp, wr  # type: ignore[import-untyped]
        from pyverbs.pyverbs_error import PyverbsError  # type: ignore[import-untyped]
    except ImportError as exc:
        raise VerbsUnavailable(
            f"pyverbs cannot be imported ({exc}): install Debian's python3-pyverbs "
            "(rdma-core) and run from /usr/bin/python3 or a venv made with "
            "--system-site-packages"
        ) from exc
    _pv = SimpleNamespace(
        e=enums, device=device, addr=addr, cq=cq, mr=mr, pd=pd, qp=qp, wr=wr, Error=PyverbsError
    )
    return _pv


def _errno_of(exc: BaseException) -> int | None:
    code = getattr(exc, "error_code", None)
    return code if isinstance(code, int) and code > 0 else None


def _verbs_error(what: str, exc: BaseException) -> VerbsError:
    code = _errno_of(exc)
    why = f"{errno.errorcode.get(code, code)}: {os.strerror(code)}" if code else str(exc)
    return VerbsError(f"{what} failed ({why})")


def list_devices() -> list[str]:
    """Names of the RDMA devices libibverbs sees; [] when there are none (libibverbs reports
    that as an error, which is not one here)."""
    pv = load_pyverbs()
    try:
        devs = pv.device.get_device_list()
    except pv.Error:
        return []
    return sorted(d.name.decode() if isinstance(d.name, bytes) else str(d.name) for d in devs)


def build_qp_attr(spec: QpAttrSpec) -> tuple[Any, int]:
    """A pyverbs ``QPAttr`` and the ``ibv_qp_attr_mask`` for one :class:`QpAttrSpec`."""
    pv = load_pyverbs()
    e = pv.e
    attr = pv.qp.QPAttr(qp_state=getattr(e, f"IBV_QPS_{spec.state}"))
    for name, value in spec.attrs.items():
        setattr(attr, name, value)
    if spec.port_num is not None:
        attr.port_num = spec.port_num
    if spec.grh is not None:
        g = spec.grh
        gr = pv.addr.GlobalRoute(
            dgid=pv.addr.GID(_gid_text(g.dgid)),
            sgid_index=g.sgid_index,
            hop_limit=g.hop_limit,
            traffic_class=g.traffic_class,
            flow_label=g.flow_label,
        )
        attr.ah_attr = pv.addr.AHAttr(port_num=spec.av_port or 1, is_global=1, gr=gr)
    mask = 0
    for name in spec.mask_names():
        mask |= int(getattr(e, f"IBV_QP_{name}"))
    return attr, mask


def _gid_text(gid: bytes) -> str:
    h = gid.hex()
    return ":".join(h[i : i + 4] for i in range(0, 32, 4))


def _gid_bytes(text: str) -> bytes:
    return bytes.fromhex(text.replace(":", ""))


# --------------------------------------------------------------------------------------------
# memory regions
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class MemoryRegion:
    """A registered buffer: the peer writes to ``addr``..``addr+length`` with ``rkey``; our
    writes gather from it with ``lkey``."""

    addr: int
    length: int
    lkey: int
    rkey: int
    _mr: Any
    #: [ctypes view] holding the buffer export while registered: the mapping cannot be closed
    #: under the device (mmap.close() raises BufferError); emptied on release.
    _export: list[Any]

    def read(self, offset: int, length: int) -> bytes:
        return ctypes.string_at(self.addr + offset, length)


def _buffer_address(buf: Any) -> tuple[int, int, Any]:
    """(address, length, export) of a writable buffer (mmap, bytearray, memoryview)."""
    view = memoryview(buf)
    if view.readonly or not view.c_contiguous:
        raise ValueError("an RDMA buffer must be writable and contiguous")
    n = view.nbytes
    if n == 0:
        raise ValueError("cannot register an empty buffer")
    export = (ctypes.c_char * n).from_buffer(view)
    return ctypes.addressof(export), n, export


class MrCache:
    """Memory registrations of one PD, once per buffer: registering pins and maps every page,
    so an RMB reused across connections keeps its registration (and its rkey) until released."""

    def __init__(self, pd: Any, device: str) -> None:
        self._pd = pd
        self._device = device
        self._by_key: dict[tuple[int, int], MemoryRegion] = {}
        self.registrations = 0  # ibv_reg_mr calls made (the cache's cost counter)

    def register(self, buf: Any, *, remote_write: bool = True) -> MemoryRegion:
        """The registration of ``buf`` (an mmap of a memfd RMB, or any writable buffer)."""
        addr, n, export = _buffer_address(buf)
        key = (addr, n)
        region = self._by_key.get(key)
        if region is not None:
            del export
            return region
        pv = load_pyverbs()
        access = int(pv.e.IBV_ACCESS_LOCAL_WRITE)
        if remote_write:
            access |= int(pv.e.IBV_ACCESS_REMOTE_WRITE)
        try:
            mr = pv.mr.MR(self._pd, n, access, address=addr)
        except pv.Error as exc:
            raise _verbs_error(f"ibv_reg_mr of {n} bytes on {self._device}", exc) from exc
        self.registrations += 1
        region = MemoryRegion(addr, n, int(mr.lkey), int(mr.rkey), mr, [export])
        self._by_key[key] = region
        return region

    def lookup(self, buf: Any) -> MemoryRegion | None:
        view = memoryview(buf)
        export = (ctypes.c_char * view.nbytes).from_buffer(view)
        try:
            return self._by_key.get((ctypes.addressof(export), view.nbytes))
        finally:
            del export
            view.release()

    def release(self, region: MemoryRegion) -> None:
        """Deregister (when the buffer leaves the pool for good)."""
        if self._by_key.pop((region.addr, region.length), None) is not None:
            with contextlib.suppress(Exception):
                region._mr.close()
            region._export.clear()

    def __len__(self) -> int:
        return len(self._by_key)

    def close(self) -> None:
        for region in list(self._by_key.values()):
            self.release(region)


# --------------------------------------------------------------------------------------------
# work request bookkeeping
# --------------------------------------------------------------------------------------------


@dataclass
class _Wr:
    link: VerbsLink
    kind: WrKind
    tag: Hashable | None
    signaled: bool
    length: int = 0
    slot: int | None = None  # send slot (SEND) / receive buffer index (RECV)
    v2: bool = False


def new_event_fd(before: set[int]) -> int | None:
    """The one ``[infinibandevent]`` descriptor not in ``before`` (None if not exactly one):
    the async fd of a context just opened, or the fd of a completion channel just created."""
    found = [
        fd
        for fd, target in _fd_targets().items()
        if fd not in before and target == _EVENT_FD_TARGET
    ]
    return found[0] if len(found) == 1 else None


def _fd_targets() -> dict[int, str]:
    """Open descriptors and what they point to. The descriptor ``listdir`` itself used is closed
    by the time we ask, so it is left out (its number is the next one to be reused)."""
    out = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            out[int(name)] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
    return out


def open_fds() -> set[int]:
    return set(_fd_targets())


# --------------------------------------------------------------------------------------------
# the port
# --------------------------------------------------------------------------------------------


class VerbsPort:
    """One RoCE device port: context, PD, CQ (+ completion channel), MR cache, its links."""

    def __init__(
        self,
        device: str,
        port: int = 1,
        *,
        cqe: int = DEFAULT_CQE,
        use_channel: bool = True,
        sysfs_root: Path = SYSFS_INFINIBAND,
    ) -> None:
        pv = load_pyverbs()
        self.device = device
        self.port = port
        self._root = sysfs_root
        before = open_fds()
        try:
            self._ctx = pv.device.Context(name=device)
        except pv.Error as exc:
            present = list_devices()
            if device not in present:
                raise VerbsUnavailable(
                    f"RDMA device {device!r} not found: "
                    + (
                        f"present are {', '.join(present)}"
                        if present
                        else "this machine has no RDMA devices (no RoCE NIC, and no Soft-RoCE: "
                        "`modprobe rdma_rxe; rdma link add rxe0 type rxe netdev <nic>`)"
                    )
                ) from exc
            raise _verbs_error(f"ibv_open_device {device}", exc) from exc
        self._closed = False
        self._links: dict[int, VerbsLink] = {}
        self._pending: dict[int, _Wr] = {}
        self._wr_ids = itertools.count(1)
        self._unacked = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sink: Callable[[VerbsEvent], None] | None = None
        self._poll_handle: asyncio.TimerHandle | None = None
        self._poll_interval = 0.002
        # ibv_open_device opened the context's async event fd: the one new event fd
        self._async_fd_found = new_event_fd(before)
        self._async_fd: int | None = None
        self._channel_fd: int | None = None
        try:
            dev_attr = self._ctx.query_device()
            if not 1 <= port <= int(dev_attr.phys_port_cnt):
                raise VerbsUnavailable(
                    f"RDMA device {device} has no port {port} "
                    f"(ports 1..{int(dev_attr.phys_port_cnt)})"
                )
            self.max_cqe = int(dev_attr.max_cqe)
            self._pd = pv.pd.PD(self._ctx)
            self._channel = None
            if use_channel:
                before = open_fds()
                self._channel = pv.cq.CompChannel(self._ctx)
                self._channel_fd = new_event_fd(before)
                if self._channel_fd is None:
                    log.info("%s: completion channel fd not identified; polling the CQ", device)
                else:
                    flags = fcntl.fcntl(self._channel_fd, fcntl.F_GETFL)
                    fcntl.fcntl(self._channel_fd, fcntl.F_SETFL, flags | os.O_NONBLOCK)
            self.cqe = min(cqe, self.max_cqe)
            self._cq = pv.cq.CQ(self._ctx, self.cqe, None, self._channel, 0)
        except pv.Error as exc:
            self._close_verbs()
            raise _verbs_error(f"setting up PD/CQ on {device}", exc) from exc
        except BaseException:
            self._close_verbs()
            raise
        self.mrs = MrCache(self._pd, device)

    # ---- port facts ------------------------------------------------------------------------

    def query_port(self) -> Any:
        return self._ctx.query_port(self.port)

    @property
    def active(self) -> bool:
        return int(self.query_port().state) == int(load_pyverbs().e.IBV_PORT_ACTIVE)

    @property
    def active_mtu(self) -> int:
        """``enum ibv_mtu`` of the port now (rxe: from the netdev MTU)."""
        return int(self.query_port().active_mtu)

    def gid(self, index: int) -> bytes:
        try:
            return _gid_bytes(self._ctx.query_gid(self.port, index).gid)
        except load_pyverbs().Error as exc:
            raise _verbs_error(f"ibv_query_gid {self.device}:{self.port}[{index}]", exc) from exc

    def gid_index(self, gid: bytes) -> int:
        """Index of ``gid`` in the port's GID table (RoCEv2 wins over v1 for the same value)."""
        pv = load_pyverbs()
        v1: list[int] = []
        for i in range(int(self.query_port().gid_tbl_len)):
            try:
                if _gid_bytes(self._ctx.query_gid(self.port, i).gid) != gid:
                    continue
                # ibv_query_gid_type reports the sysfs enum (IB/RoCE v1 = 0, RoCE v2 = 1)
                gtype = int(self._ctx.query_gid_type(self.port, i))
            except pv.Error:
                continue  # empty slot
            if gtype == int(pv.e.IBV_GID_TYPE_SYSFS_ROCE_V2):
                return i
            v1.append(i)
        if not v1:
            raise VerbsUnavailable(f"{self.device}:{self.port} has no GID {_gid_text(gid)}")
        return v1[0]

    def ipv4_gid_index(self, address: str) -> int:
        """Index of the RoCEv2 GID of an IPv4 address of the port's netdev."""
        return self.gid_index(ipv4_mapped_gid(address))

    def mac(self, gid_index: int) -> bytes:
        """MAC of the netdev behind a GID entry; derived from the GID as the kernel does when
        there is none."""
        ndev = self._root / self.device / "ports" / str(self.port) / "gid_attrs" / "ndevs"
        try:
            name = (ndev / str(gid_index)).read_text().strip()
            text = Path(f"/sys/class/net/{name}/address").read_text().strip()
            return bytes.fromhex(text.replace(":", ""))
        except (OSError, ValueError):
            return mac_from_gid(self.gid(gid_index))

    # ---- links -----------------------------------------------------------------------------

    def create_link(self, gid_index: int, *, v2: bool = False, psn: int | None = None) -> VerbsLink:
        """A new RC QP on this port in RESET, with its buffers; :meth:`VerbsLink.connect` it."""
        self._check_open()
        link = VerbsLink(self, gid_index, v2=v2, psn=random_psn() if psn is None else psn)
        self._links[link.qpn] = link
        return link

    def _forget(self, link: VerbsLink) -> None:
        self._links.pop(link.qpn, None)
        for wr_id in [w for w, p in self._pending.items() if p.link is link]:
            del self._pending[wr_id]

    def _next_wr_id(self) -> int:
        return next(self._wr_ids)

    # ---- completions -----------------------------------------------------------------------

    def poll(self) -> list[VerbsEvent]:
        """Drain the CQ now; the events of what completed (the sans-IO entry point)."""
        self._check_open()
        events: list[VerbsEvent] = []
        while True:
            n, wcs = self._cq.poll(_POLL_BATCH)
            for wc in wcs[:n]:
                self._completion(wc, events)
            if n < _POLL_BATCH:
                return events

    def _completion(self, wc: Any, events: list[VerbsEvent]) -> None:
        wr = self._pending.pop(int(wc.wr_id), None)
        if wr is None:
            return  # a link closed meanwhile
        link = wr.link
        status = int(wc.status)
        if wr.kind is WrKind.RECV:
            link._rx_outstanding -= 1
            if status == 0:
                events.append(MessageReceived(self.device, link.qpn, link._take_rx(wr, wc)))
                link._repost_rx(wr.slot or 0)
            else:
                link._failed(wc_status_name(status), events)
            return
        link._retire_sq(int(wc.wr_id), wr)
        if status == 0:
            if wr.kind is WrKind.SEND:
                events.append(SendDone(self.device, link.qpn, int(wc.wr_id), wr.tag))
            else:
                events.append(WriteDone(self.device, link.qpn, int(wc.wr_id), wr.tag, wr.length))
            return
        name = wc_status_name(status)
        events.append(
            CompletionFailed(
                self.device,
                link.qpn,
                int(wc.wr_id),
                wr.tag,
                wr.kind,
                status,
                name,
                int(wc.vendor_err),
            )
        )
        link._failed(name, events)

    # ---- asyncio ---------------------------------------------------------------------------

    def start(self, sink: Callable[[VerbsEvent], None], *, poll_interval: float = 0.002) -> None:
        """Deliver events to ``sink`` from the running loop (channel fd, or a polling timer)."""
        self._check_open()
        self._loop = asyncio.get_running_loop()
        self._sink = sink
        self._poll_interval = poll_interval
        if self._channel_fd is not None:
            self._cq.req_notify()
            self._loop.add_reader(self._channel_fd, self._on_channel)
            self._deliver(self.poll())  # what completed before arming
        else:
            self._poll_handle = self._loop.call_later(poll_interval, self._on_timer)
        self._async_fd = self._async_fd_found
        if self._async_fd is not None:
            flags = fcntl.fcntl(self._async_fd, fcntl.F_GETFL)
            fcntl.fcntl(self._async_fd, fcntl.F_SETFL, flags | os.O_NONBLOCK)
            self._loop.add_reader(self._async_fd, self._on_async)
        else:
            log.info("%s: no async fd; port and QP events are not reported", self.device)

    @property
    def event_driven(self) -> bool:
        """True when completions wake us through the channel fd (not the polling timer)."""
        return self._channel_fd is not None

    @property
    def watches_async_events(self) -> bool:
        """True when port and QP async events are read (the context's async fd was found)."""
        return self._async_fd_found is not None

    def stop(self) -> None:
        if self._loop is not None:
            for fd in (self._channel_fd, self._async_fd):
                if fd is not None:
                    with contextlib.suppress(Exception):
                        self._loop.remove_reader(fd)
        if self._poll_handle is not None:
            self._poll_handle.cancel()
            self._poll_handle = None
        self._loop = None
        self._sink = None

    def _deliver(self, events: list[VerbsEvent]) -> None:
        sink = self._sink
        if sink is None:
            return
        for ev in events:
            try:
                sink(ev)
            except Exception:
                log.exception("%s: event sink failed on %r", self.device, ev)

    def _on_channel(self) -> None:
        pv = load_pyverbs()
        try:
            self._channel.get_cq_event(self._cq)  # type: ignore[union-attr]
            self._unacked += 1
        except pv.Error:
            pass  # EAGAIN: woken without an event; draining is still right
        try:
            self._cq.req_notify()
        except pv.Error as exc:
            log.warning("%s: re-arming the CQ failed (%s); polling instead", self.device, exc)
            self._switch_to_polling()
        if self._unacked >= _ACK_BATCH:
            self._ack()
        self._deliver(self.poll())

    def _switch_to_polling(self) -> None:
        if self._loop is not None and self._channel_fd is not None:
            with contextlib.suppress(Exception):
                self._loop.remove_reader(self._channel_fd)
            self._channel_fd = None
            self._poll_handle = self._loop.call_later(self._poll_interval, self._on_timer)

    def _on_timer(self) -> None:
        self._poll_handle = None
        if self._closed or self._loop is None:
            return
        self._deliver(self.poll())
        self._poll_handle = self._loop.call_later(self._poll_interval, self._on_timer)

    def _ack(self) -> None:
        if self._unacked:
            with contextlib.suppress(Exception):
                self._cq.ack_events(self._unacked)
            self._unacked = 0

    def _on_async(self) -> None:
        pv = load_pyverbs()
        try:
            ev = self._ctx.get_async_event()
        except pv.Error as exc:
            if _errno_of(exc) in (errno.EAGAIN, errno.EINTR):
                return  # woken without an event
            log.warning("%s: reading an async event failed (%s); ignoring the fd", self.device, exc)
            if self._loop is not None and self._async_fd is not None:
                self._loop.remove_reader(self._async_fd)
            self._async_fd = None
            return
        try:
            etype = int(ev.event_type)
        finally:
            with contextlib.suppress(Exception):
                ev.ack()
        self._deliver(self.async_event(etype))

    def async_event(self, etype: int) -> list[VerbsEvent]:
        """Events for one ``ibv_event_type`` (port events re-read the port; QP events find the
        QPs that went to ERR, since pyverbs 44 does not say which QP it was)."""
        e = load_pyverbs().e
        name = _event_name(etype)
        events: list[VerbsEvent] = []
        port_events = ("PORT_ACTIVE", "PORT_ERR", "GID_CHANGE", "DEVICE_FATAL")
        if etype in {int(getattr(e, f"IBV_EVENT_{n}")) for n in port_events}:
            try:
                active = self.active and etype != int(e.IBV_EVENT_DEVICE_FATAL)
            except Exception:
                active = False
            events.append(PortStateChanged(self.device, self.port, active, name))
            if etype == int(e.IBV_EVENT_DEVICE_FATAL):
                for link in list(self._links.values()):
                    link._failed(name, events)
        elif etype in (
            int(e.IBV_EVENT_QP_FATAL),
            int(e.IBV_EVENT_QP_REQ_ERR),
            int(e.IBV_EVENT_QP_ACCESS_ERR),
        ):
            for link in list(self._links.values()):
                with contextlib.suppress(Exception):
                    if link.state() in ("ERR", "SQE"):
                        link._failed(name, events)
        elif etype == int(e.IBV_EVENT_CQ_ERR):  # overrun: completions are lost for every link
            for link in list(self._links.values()):
                link._failed(name, events)
        return events

    # ---- teardown --------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise VerbsError(f"{self.device}:{self.port} is closed")

    def close(self) -> None:
        if self._closed:
            return
        self.stop()
        for link in list(self._links.values()):
            link.close()
        with contextlib.suppress(AttributeError):
            self.mrs.close()
        self._close_verbs()
        self._closed = True

    def _close_verbs(self) -> None:
        self._ack()
        for name in ("_cq", "_channel", "_pd", "_ctx"):
            obj = getattr(self, name, None)
            if obj is not None:
                with contextlib.suppress(Exception):
                    obj.close()

    def __enter__(self) -> VerbsPort:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _event_name(etype: int) -> str:
    e = load_pyverbs().e
    for name in dir(e):
        if name.startswith("IBV_EVENT_") and int(getattr(e, name)) == etype:
            return name.removeprefix("IBV_EVENT_")
    return f"EVENT_{etype}"


_QP_STATE_NAMES = {0: "RESET", 1: "INIT", 2: "RTR", 3: "RTS", 4: "SQD", 5: "SQE", 6: "ERR"}


# --------------------------------------------------------------------------------------------
# the link
# --------------------------------------------------------------------------------------------


class VerbsLink:
    """One RC QP of an SMC-R link, with its send slots and receive buffers."""

    def __init__(self, port: VerbsPort, gid_index: int, *, v2: bool, psn: int) -> None:
        pv = load_pyverbs()
        e = pv.e
        self.port = port
        self.gid_index = gid_index
        self.v2 = v2
        self.psn = psn
        self.gid = port.gid(gid_index)
        self.mac = port.mac(gid_index)
        self.mtu = port.active_mtu
        self.peer: LinkParams | None = None
        self.error: str | None = None
        self._closed = False
        rx_sges = 2 if v2 else 1
        self._qp: Any = None
        for inline in (SMC_WR_TX_SIZE, 0):
            cap = pv.qp.QPCap(
                max_send_wr=SMC_WR_TX_WR_MAX,
                max_recv_wr=SMC_WR_RX_CNT,
                max_send_sge=SMC_IB_MAX_SEND_SGE,
                max_recv_sge=rx_sges,
                max_inline_data=inline,
            )
            init = pv.qp.QPInitAttr(
                qp_type=e.IBV_QPT_RC, scq=port._cq, rcq=port._cq, cap=cap, sq_sig_all=0
            )
            try:
                self._qp = pv.qp.QP(port._pd, init)
                break
            except pv.Error as exc:
                if inline == 0:
                    raise _verbs_error(f"ibv_create_qp on {port.device}", exc) from exc
        qp = self._qp
        self.qpn = int(qp.qp_num)
        _attr, init_attr = qp.query(e.IBV_QP_CAP)
        self.max_inline = int(init_attr.cap.max_inline_data)
        self.sq_depth = min(SMC_WR_TX_WR_MAX, int(init_attr.cap.max_send_wr))
        # buffers: send slots (used when the device cannot inline), receive buffers, v2 8 KiB
        self._tx_mr = pv.mr.MR(port._pd, SMC_WR_BUF_CNT * SMC_WR_BUF_SIZE, e.IBV_ACCESS_LOCAL_WRITE)
        self._rx_mr = pv.mr.MR(port._pd, SMC_WR_RX_CNT * SMC_WR_BUF_SIZE, e.IBV_ACCESS_LOCAL_WRITE)
        self._v2_tx_mr: Any = None
        self._v2_rx_mr: Any = None
        if v2:
            self._v2_tx_mr = pv.mr.MR(port._pd, SMC_WR_BUF_V2_SIZE, e.IBV_ACCESS_LOCAL_WRITE)
            self._v2_rx_mr = pv.mr.MR(port._pd, SMC_WR_BUF_V2_SIZE, e.IBV_ACCESS_LOCAL_WRITE)
        self._free_slots: deque[int] = deque(range(SMC_WR_BUF_CNT))
        self._v2_busy = False
        self._sq: deque[int] = deque()  # wr_ids posted on the send queue, in order
        self._rx_outstanding = 0

    # ---- parameters and state --------------------------------------------------------------

    @property
    def local(self) -> LinkParams:
        """What the peer needs to connect to this QP."""
        return LinkParams(gid=self.gid, qpn=self.qpn, psn=self.psn, mtu=self.mtu, mac=self.mac)

    def state(self) -> str:
        e = load_pyverbs().e
        attr, _init = self._qp.query(e.IBV_QP_STATE)
        return _QP_STATE_NAMES.get(int(attr.qp_state), str(int(attr.qp_state)))

    @property
    def free_send_slots(self) -> int:
        return len(self._free_slots)

    @property
    def path_mtu(self) -> int | None:
        return None if self.peer is None else min(self.mtu, self.peer.mtu)

    # ---- state transitions -----------------------------------------------------------------

    def _modify(self, spec: QpAttrSpec) -> None:
        attr, mask = build_qp_attr(spec)
        try:
            self._qp.modify(attr, mask)
        except load_pyverbs().Error as exc:
            raise _verbs_error(
                f"ibv_modify_qp to {spec.state} on {self.port.device} QP {self.qpn}", exc
            ) from exc

    def to_init(self) -> None:
        self._modify(init_attrs(self.port.port))
        for i in range(SMC_WR_RX_CNT):
            self._repost_rx(i)

    def to_rtr(self, peer: LinkParams, *, uses_gateway: bool = False) -> None:
        self.peer = peer
        self._modify(
            rtr_attrs(
                peer,
                local_mtu=self.mtu,
                sgid_index=self.gid_index,
                port_num=self.port.port,
                uses_gateway=uses_gateway,
            )
        )

    def to_rts(self) -> None:
        self._modify(rts_attrs(self.psn))

    def to_error(self) -> None:
        """Any state → ERR: outstanding work is flushed (with error completions) and nothing
        more goes out - a dying link quiesces before its QP is destroyed."""
        if not self._closed:
            self._modify(QpAttrSpec("ERR"))

    def connect(self, peer: LinkParams, *, uses_gateway: bool = False) -> None:
        """RESET → INIT (receive buffers posted) → RTR (towards ``peer``) → RTS."""
        self.to_init()
        self.to_rtr(peer, uses_gateway=uses_gateway)
        self.to_rts()

    # ---- posting ---------------------------------------------------------------------------

    def _check_usable(self, wrs: int) -> None:
        if self._closed:
            raise VerbsError(f"link QP {self.qpn} is closed")
        if self.error is not None:
            raise VerbsError(f"link QP {self.qpn} is down ({self.error})")
        if len(self._sq) + wrs > self.sq_depth:
            raise SendSlotsExhausted(
                f"QP {self.qpn}: send queue full ({len(self._sq)} of {self.sq_depth} in flight)"
            )

    def _post(self, wr: Any, rec: _Wr, wr_id: int) -> None:
        pv = load_pyverbs()
        self.port._pending[wr_id] = rec
        self._sq.append(wr_id)
        try:
            self._qp.post_send(wr)
        except pv.Error as exc:
            self.port._pending.pop(wr_id, None)
            self._sq.remove(wr_id)
            raise _verbs_error(f"ibv_post_send on QP {self.qpn}", exc) from exc

    def send(self, msg: bytes, *, tag: Hashable | None = None) -> int:
        """Post one LLC/CDC message (padded to 44 bytes) as a signaled, solicited SEND, inline
        when the QP can; returns the wr_id that SendDone/CompletionFailed will carry."""
        if len(msg) > SMC_WR_TX_SIZE:
            return self.send_v2(msg, tag=tag)
        self._check_usable(1)
        if not self._free_slots:
            raise SendSlotsExhausted(f"QP {self.qpn}: all {SMC_WR_BUF_CNT} send slots in flight")
        pv = load_pyverbs()
        e = pv.e
        data = bytes(msg).ljust(SMC_WR_TX_SIZE, b"\0")
        slot = self._free_slots.popleft()
        off = slot * SMC_WR_BUF_SIZE
        self._tx_mr.write(data, SMC_WR_TX_SIZE, off)
        flags = int(e.IBV_SEND_SIGNALED) | int(e.IBV_SEND_SOLICITED)
        if self.max_inline >= SMC_WR_TX_SIZE:
            flags |= int(e.IBV_SEND_INLINE)
        wr_id = self.port._next_wr_id()
        sge = pv.wr.SGE(self._tx_mr.buf + off, SMC_WR_TX_SIZE, self._tx_mr.lkey)
        wr = pv.wr.SendWR(wr_id=wr_id, opcode=e.IBV_WR_SEND, num_sge=1, sg=[sge], send_flags=flags)
        try:
            self._post(wr, _Wr(self, WrKind.SEND, tag, True, SMC_WR_TX_SIZE, slot), wr_id)
        except VerbsError:
            self._free_slots.appendleft(slot)
            raise
        return wr_id

    def send_v2(self, msg: bytes, *, tag: Hashable | None = None) -> int:
        """Post an SMC-Rv2 LLC message longer than 44 bytes from the link's one 8 KiB buffer
        (one at a time, as the kernel's ``wr_tx_v2_pend``)."""
        if not self.v2:
            raise ValueError(f"{len(msg)}-byte message on a v1 link (max {SMC_WR_TX_SIZE})")
        if len(msg) > SMC_WR_BUF_V2_SIZE:
            raise ValueError(f"LLC message of {len(msg)} bytes exceeds {SMC_WR_BUF_V2_SIZE}")
        self._check_usable(1)
        if self._v2_busy:
            raise SendSlotsExhausted(f"QP {self.qpn}: the v2 send buffer is in flight")
        pv = load_pyverbs()
        e = pv.e
        mr = self._v2_tx_mr
        mr.write(bytes(msg), len(msg), 0)
        wr_id = self.port._next_wr_id()
        sge = pv.wr.SGE(mr.buf, len(msg), mr.lkey)
        flags = int(e.IBV_SEND_SIGNALED) | int(e.IBV_SEND_SOLICITED)
        wr = pv.wr.SendWR(wr_id=wr_id, opcode=e.IBV_WR_SEND, num_sge=1, sg=[sge], send_flags=flags)
        self._v2_busy = True
        try:
            self._post(wr, _Wr(self, WrKind.SEND, tag, True, len(msg), None, v2=True), wr_id)
        except VerbsError:
            self._v2_busy = False
            raise
        return wr_id

    def rdma_write(
        self,
        src: MemoryRegion,
        sges: list[tuple[int, int]],
        remote_addr: int,
        rkey: int,
        *,
        tag: Hashable | None = None,
        signaled: bool = True,
    ) -> int:
        """One RDMA WRITE gathering ``sges`` ((offset, length) into ``src``, at most two) to
        ``remote_addr`` under ``rkey``. Unsignaled writes complete with the next signaled work
        request (RC executes them in order); errors are reported either way."""
        if not 1 <= len(sges) <= SMC_IB_MAX_SEND_SGE:
            raise ValueError(f"an RDMA WRITE gathers 1..{SMC_IB_MAX_SEND_SGE} pieces")
        for off, n in sges:
            if off < 0 or n <= 0 or off + n > src.length:
                raise ValueError(f"piece ({off}, {n}) outside the {src.length}-byte region")
        self._check_usable(1)
        pv = load_pyverbs()
        e = pv.e
        wr_id = self.port._next_wr_id()
        sg = [pv.wr.SGE(src.addr + off, n, src.lkey) for off, n in sges]
        flags = int(e.IBV_SEND_SIGNALED) if signaled else 0
        wr = pv.wr.SendWR(
            wr_id=wr_id, opcode=e.IBV_WR_RDMA_WRITE, num_sge=len(sg), sg=sg, send_flags=flags
        )
        wr.set_wr_rdma(rkey, remote_addr)
        length = sum(n for _off, n in sges)
        self._post(wr, _Wr(self, WrKind.WRITE, tag, signaled, length), wr_id)
        return wr_id

    def write_ring(
        self,
        src: MemoryRegion,
        length: int,
        *,
        src_offset: int,
        dst: RemoteRing,
        dst_offset: int,
        src_size: int | None = None,
        src_base: int = 0,
        notify: bytes | None = None,
        tag: Hashable | None = None,
    ) -> list[int]:
        """Move ``length`` bytes from the local ring (``src_size`` bytes at ``src_base`` in
        ``src``) at ``src_offset`` into the peer's ring at ``dst_offset``: one or two RDMA
        WRITEs (split where the peer's ring wraps), then the CDC message ``notify`` as a SEND on
        the same QP, so the peer sees the data before the cursor that announces it.

        The writes are unsignaled when a notification follows (its SendDone covers them);
        otherwise the last write is signaled. Returns the wr_ids posted."""
        size = src.length - src_base if src_size is None else src_size
        if src_base < 0 or src_base + size > src.length:
            raise ValueError("local ring outside the registered region")
        plan = plan_ring_write(
            length, src_offset=src_offset, src_size=size, dst_offset=dst_offset, dst_size=dst.size
        )
        self._check_usable(len(plan) + (notify is not None))
        if notify is not None and not self._free_slots:
            raise SendSlotsExhausted(f"QP {self.qpn}: all {SMC_WR_BUF_CNT} send slots in flight")
        ids = []
        for i, piece in enumerate(plan):
            last = i == len(plan) - 1
            ids.append(
                self.rdma_write(
                    src,
                    [(src_base + s.offset, s.length) for s in piece.sges],
                    dst.addr + piece.remote_offset,
                    dst.rkey,
                    tag=tag,
                    signaled=last and notify is None,
                )
            )
        if notify is not None:
            ids.append(self.send(notify, tag=tag))
        return ids

    # ---- receive side ----------------------------------------------------------------------

    def _repost_rx(self, index: int) -> None:
        if self._closed or self.error is not None:
            return
        pv = load_pyverbs()
        wr_id = self.port._next_wr_id()
        sg = [
            pv.wr.SGE(self._rx_mr.buf + index * SMC_WR_BUF_SIZE, SMC_WR_TX_SIZE, self._rx_mr.lkey)
        ]
        if self._v2_rx_mr is not None:  # spill-over for v2 LLC messages (shared, as the kernel)
            sg.append(
                pv.wr.SGE(
                    self._v2_rx_mr.buf, SMC_WR_BUF_V2_SIZE - SMC_WR_TX_SIZE, self._v2_rx_mr.lkey
                )
            )
        self.port._pending[wr_id] = _Wr(self, WrKind.RECV, None, True, 0, index)
        try:
            self._qp.post_recv(pv.wr.RecvWR(wr_id=wr_id, num_sge=len(sg), sg=sg))
        except pv.Error as exc:
            self.port._pending.pop(wr_id, None)
            raise _verbs_error(f"ibv_post_recv on QP {self.qpn}", exc) from exc
        self._rx_outstanding += 1

    def _take_rx(self, wr: _Wr, wc: Any) -> bytes:
        n = int(wc.byte_len)
        head = self._rx_mr.read(min(n, SMC_WR_TX_SIZE), (wr.slot or 0) * SMC_WR_BUF_SIZE)
        if n > SMC_WR_TX_SIZE and self._v2_rx_mr is not None:
            head += self._v2_rx_mr.read(n - SMC_WR_TX_SIZE, 0)
        return bytes(head)

    # ---- completion bookkeeping ------------------------------------------------------------

    def _retire_sq(self, wr_id: int, wr: _Wr) -> None:
        """A send-queue WR completed: it and every unsignaled WR before it are done."""
        while self._sq:
            done = self._sq.popleft()
            rec = wr if done == wr_id else self.port._pending.pop(done, None)
            if rec is not None:
                if rec.slot is not None and rec.kind is WrKind.SEND:
                    self._free_slots.append(rec.slot)
                if rec.v2:
                    self._v2_busy = False
            if done == wr_id:
                return

    def _failed(self, reason: str, events: list[VerbsEvent]) -> None:
        if self.error is None:
            self.error = reason
            events.append(LinkError(self.port.device, self.qpn, reason))

    # ---- teardown --------------------------------------------------------------------------

    def close(self) -> None:
        """Destroy the QP and its buffers (outstanding work is dropped without events)."""
        if self._closed:
            return
        self._closed = True
        self.port._forget(self)
        for obj in (self._qp, self._tx_mr, self._rx_mr, self._v2_tx_mr, self._v2_rx_mr):
            if obj is not None:
                with contextlib.suppress(Exception):
                    obj.close()
