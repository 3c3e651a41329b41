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

pyverbs is imported lazily (``verbs_lib``), so this module imports on machines without RDMA;
using it there raises :class:`VerbsUnavailable` with what to install or why no device is there.

This module holds :class:`VerbsPort`; the queue pair is :class:`~.verbs_link.VerbsLink`, the
MR cache is in ``verbs_mr`` and the pyverbs boundary in ``verbs_lib``. Their public names are
all importable from here.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import itertools
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from smcd_daemon.transport.verbs_lib import (
    SYSFS_INFINIBAND,
    SendSlotsExhausted,
    VerbsError,
    VerbsUnavailable,
    build_qp_attr,
    errno_of,
    fd_targets,
    gid_bytes,
    gid_text,
    list_devices,
    load_pyverbs,
    new_event_fd,
    open_fds,
    verbs_error,
)
from smcd_daemon.transport.verbs_link import VerbsLink, WorkRequest
from smcd_daemon.transport.verbs_model import (
    CompletionFailed,
    MessageReceived,
    PortStateChanged,
    SendDone,
    VerbsEvent,
    WriteDone,
    WrKind,
    ipv4_mapped_gid,
    mac_from_gid,
    random_psn,
    wc_status_name,
)
from smcd_daemon.transport.verbs_mr import MemoryRegion, MrCache

__all__ = [
    "SYSFS_INFINIBAND",
    "MemoryRegion",
    "MrCache",
    "SendSlotsExhausted",
    "VerbsError",
    "VerbsLink",
    "VerbsPort",
    "VerbsUnavailable",
    "build_qp_attr",
    "fd_targets",
    "list_devices",
    "load_pyverbs",
    "new_event_fd",
    "open_fds",
]

log = logging.getLogger(__name__)

#: CQ entries per port (the kernel uses 32766 per CQ; capped by the device's max_cqe).
DEFAULT_CQE = 4096
#: Completions taken per ibv_poll_cq call.
_POLL_BATCH = 32
#: Ack CQ events in batches (ibv_ack_cq_events takes a mutex).
_ACK_BATCH = 32


# --------------------------------------------------------------------------------------------
# work request bookkeeping
# --------------------------------------------------------------------------------------------


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
            raise verbs_error(f"ibv_open_device {device}", exc) from exc
        self._closed = False
        self._links: dict[int, VerbsLink] = {}
        self.pending: dict[int, WorkRequest] = {}
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
            self.pd = pv.pd.PD(self._ctx)
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
            self.cq = pv.cq.CQ(self._ctx, self.cqe, None, self._channel, 0)
        except pv.Error as exc:
            self._close_verbs()
            raise verbs_error(f"setting up PD/CQ on {device}", exc) from exc
        except BaseException:
            self._close_verbs()
            raise
        self.mrs = MrCache(self.pd, device)

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
            return gid_bytes(self._ctx.query_gid(self.port, index).gid)
        except load_pyverbs().Error as exc:
            raise verbs_error(f"ibv_query_gid {self.device}:{self.port}[{index}]", exc) from exc

    def gid_index(self, gid: bytes) -> int:
        """Index of ``gid`` in the port's GID table (RoCEv2 wins over v1 for the same value)."""
        pv = load_pyverbs()
        v1: list[int] = []
        for i in range(int(self.query_port().gid_tbl_len)):
            try:
                if gid_bytes(self._ctx.query_gid(self.port, i).gid) != gid:
                    continue
                # ibv_query_gid_type reports the sysfs enum (IB/RoCE v1 = 0, RoCE v2 = 1)
                gtype = int(self._ctx.query_gid_type(self.port, i))
            except pv.Error:
                continue  # empty slot
            if gtype == int(pv.e.IBV_GID_TYPE_SYSFS_ROCE_V2):
                return i
            v1.append(i)
        if not v1:
            raise VerbsUnavailable(f"{self.device}:{self.port} has no GID {gid_text(gid)}")
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

    def forget(self, link: VerbsLink) -> None:
        self._links.pop(link.qpn, None)
        for wr_id in [w for w, p in self.pending.items() if p.link is link]:
            del self.pending[wr_id]

    def next_wr_id(self) -> int:
        return next(self._wr_ids)

    # ---- completions -----------------------------------------------------------------------

    def poll(self) -> list[VerbsEvent]:
        """Drain the CQ now; the events of what completed (the sans-IO entry point)."""
        self._check_open()
        events: list[VerbsEvent] = []
        while True:
            n, wcs = self.cq.poll(_POLL_BATCH)
            for wc in wcs[:n]:
                self._completion(wc, events)
            if n < _POLL_BATCH:
                return events

    def _completion(self, wc: Any, events: list[VerbsEvent]) -> None:
        wr = self.pending.pop(int(wc.wr_id), None)
        if wr is None:
            return  # a link closed meanwhile
        link = wr.link
        status = int(wc.status)
        if wr.kind is WrKind.RECV:
            link.rx_outstanding -= 1
            if status == 0:
                events.append(MessageReceived(self.device, link.qpn, link.take_rx(wr, wc)))
                link.repost_rx(wr.slot or 0)
            else:
                link.fail(wc_status_name(status), events)
            return
        link.retire_sq(int(wc.wr_id), wr)
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
        link.fail(name, events)

    # ---- asyncio ---------------------------------------------------------------------------

    def start(self, sink: Callable[[VerbsEvent], None], *, poll_interval: float = 0.002) -> None:
        """Deliver events to ``sink`` from the running loop (channel fd, or a polling timer)."""
        self._check_open()
        self._loop = asyncio.get_running_loop()
        self._sink = sink
        self._poll_interval = poll_interval
        if self._channel_fd is not None:
            self.cq.req_notify()
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
            self._channel.get_cq_event(self.cq)  # type: ignore[union-attr]
            self._unacked += 1
        except pv.Error:
            pass  # EAGAIN: woken without an event; draining is still right
        try:
            self.cq.req_notify()
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
                self.cq.ack_events(self._unacked)
            self._unacked = 0

    def _on_async(self) -> None:
        pv = load_pyverbs()
        try:
            ev = self._ctx.get_async_event()
        except pv.Error as exc:
            if errno_of(exc) in (errno.EAGAIN, errno.EINTR):
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
                    link.fail(name, events)
        elif etype in (
            int(e.IBV_EVENT_QP_FATAL),
            int(e.IBV_EVENT_QP_REQ_ERR),
            int(e.IBV_EVENT_QP_ACCESS_ERR),
        ):
            for link in list(self._links.values()):
                with contextlib.suppress(Exception):
                    if link.state() in ("ERR", "SQE"):
                        link.fail(name, events)
        elif etype == int(e.IBV_EVENT_CQ_ERR):  # overrun: completions are lost for every link
            for link in list(self._links.values()):
                link.fail(name, events)
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
