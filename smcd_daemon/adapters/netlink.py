"""rtnetlink watcher: keeps the device inventory equal to the kernel's view of one netns.

Order matters to miss nothing: the event socket joins the multicast groups *before* the full dump
(taken on a second socket); events that arrive meanwhile wait in the event socket's queue and are
applied afterwards.  Every rtnetlink message carries the object's full state and the inventory's
``apply_*`` calls are idempotent, so replaying them over the dump converges on the truth.

Things the kernel does not announce are re-read instead of guessed: IPv4 routes through a device
that goes administratively down vanish without ``RTM_DELROUTE``, so a link going down triggers a
(debounced) route re-dump.  A socket error such as ENOBUFS (we fell behind) means events were lost:
the watcher opens a fresh event socket and re-dumps everything.

A message we cannot interpret is logged and skipped; it never stops the watcher.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import struct
from collections.abc import Callable, Mapping
from typing import Any

from pyroute2 import AsyncIPRoute  # type: ignore[import-untyped]
from pyroute2.netlink.rtnl import (  # type: ignore[import-untyped]
    RTMGRP_IPV4_IFADDR,
    RTMGRP_IPV4_ROUTE,
    RTMGRP_IPV6_IFADDR,
    RTMGRP_IPV6_ROUTE,
    RTMGRP_LINK,
    RTMGRP_NEIGH,
)

from smcd_daemon.core.devices import (
    AF_INET,
    AF_INET6,
    IFF_UP,
    RT_TABLE_MAIN,
    Address,
    DeviceInventory,
    Neighbour,
    NetDevice,
    OperState,
    Route,
)

log = logging.getLogger(__name__)

GROUPS = (
    RTMGRP_LINK
    | RTMGRP_IPV4_IFADDR
    | RTMGRP_IPV6_IFADDR
    | RTMGRP_IPV4_ROUTE
    | RTMGRP_IPV6_ROUTE
    | RTMGRP_NEIGH
)

# Message types (linux/rtnetlink.h).
RTM_NEWLINK = 16
RTM_DELLINK = 17
RTM_NEWADDR = 20
RTM_DELADDR = 21
RTM_NEWROUTE = 24
RTM_DELROUTE = 25
RTM_NEWNEIGH = 28
RTM_DELNEIGH = 29
AF_UNSPEC = 0

#: How long to coalesce route re-dumps after links go down.
ROUTE_RESYNC_DELAY = 0.05

NLMSG_HDRLEN = 16
#: Fixed part after the netlink header (ifinfomsg 16, ifaddrmsg 8, rtmsg 12, ndmsg 12 bytes).
MIN_BODY = {
    RTM_NEWLINK: 16,
    RTM_DELLINK: 16,
    RTM_NEWADDR: 8,
    RTM_DELADDR: 8,
    RTM_NEWROUTE: 12,
    RTM_DELROUTE: 12,
    RTM_NEWNEIGH: 12,
    RTM_DELNEIGH: 12,
}


class MessageError(ValueError):
    """An rtnetlink message lacks what we need to model it."""


def _get(msg: Any, key: str) -> Any:
    """Field or attribute of a pyroute2 message (or a plain mapping, for tests)."""
    getter = getattr(msg, "get", None)
    if getter is None:
        raise MessageError(f"not a message: {type(msg).__name__}")
    return getter(key)


def _int(msg: Any, key: str, default: int | None = None) -> int:
    v = _get(msg, key)
    if v is None:
        if default is None:
            raise MessageError(f"missing {key}")
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise MessageError(f"{key} is {type(v).__name__}, not an integer")
    return v


def message_type(msg: Any) -> int:
    try:
        t = msg["header"]["type"]
    except (KeyError, TypeError, IndexError) as exc:
        raise MessageError("no netlink header") from exc
    if not isinstance(t, int):
        raise MessageError("no message type")
    return t


def link_from_msg(msg: Any, known: NetDevice | None = None) -> NetDevice:
    ifindex = _int(msg, "index")
    name = _get(msg, "ifname") or (known.name if known else None)
    if not isinstance(name, str) or not name:
        raise MessageError("link without a name")
    mac = _get(msg, "address")
    mtu = _get(msg, "mtu")
    carrier = _get(msg, "carrier")
    kind_name = msg.get(("linkinfo", "kind")) if hasattr(msg, "get_nested") else None
    if kind_name is None and isinstance(msg, Mapping) and isinstance(msg.get("linkinfo"), Mapping):
        kind_name = msg["linkinfo"].get("kind")  # plain mappings (tests)
    flags = _int(msg, "flags", 0)
    master = _get(msg, "master")
    link = _get(msg, "link")
    vlan_id = _vlan_id(msg) if kind_name == "vlan" else None
    if vlan_id is None and kind_name == "vlan" and known is not None:
        vlan_id = known.vlan_id
    return NetDevice(
        ifindex=ifindex,
        name=name,
        mac=mac if isinstance(mac, str) else None,
        mtu=mtu if isinstance(mtu, int) else (known.mtu if known else 0),
        operstate=OperState.parse(_get(msg, "operstate")),
        carrier=bool(carrier) if carrier is not None else bool(flags & 0x10000),  # IFF_LOWER_UP
        admin_up=bool(flags & IFF_UP),
        kind=kind_name if isinstance(kind_name, str) else None,
        master=master if isinstance(master, int) and master > 0 else None,
        link=link if isinstance(link, int) and link > 0 else None,
        vlan_id=vlan_id,
    )


def _vlan_id(msg: Any) -> int | None:
    """``IFLA_LINKINFO`` → ``IFLA_INFO_DATA`` → ``IFLA_VLAN_ID`` of a vlan netdev's message
    (plain mappings, for tests: ``{"linkinfo": {"data": {"vlan_id": 10}}}``)."""
    if hasattr(msg, "get_nested"):
        vid = msg.get_nested("IFLA_LINKINFO", "IFLA_INFO_DATA", "IFLA_VLAN_ID")
    elif isinstance(msg, Mapping) and isinstance(msg.get("linkinfo"), Mapping):
        data = msg["linkinfo"].get("data")
        vid = data.get("vlan_id") if isinstance(data, Mapping) else None
    else:
        vid = None
    if isinstance(vid, bool) or not isinstance(vid, int) or not 0 <= vid < 4096:
        return None
    return vid


def address_from_msg(msg: Any) -> Address:
    family = _int(msg, "family")
    # IFA_LOCAL is the interface's own address; IFA_ADDRESS the peer on point-to-point links.
    text = (_get(msg, "local") if family == AF_INET else None) or _get(msg, "address")
    if not isinstance(text, str):
        raise MessageError("address message without an address")
    ip = ipaddress.ip_address(text)
    prefixlen = _int(msg, "prefixlen")
    if prefixlen > ip.max_prefixlen:
        raise MessageError(f"prefixlen {prefixlen} too long for {ip}")
    return Address(ifindex=_int(msg, "index"), address=ip, prefixlen=prefixlen)


def route_from_msg(msg: Any) -> Route:
    family = _int(msg, "family")
    if family not in (AF_INET, AF_INET6):
        raise MessageError(f"route family {family}")
    dst_len = _int(msg, "dst_len")
    dst = _get(msg, "dst") or ("0.0.0.0" if family == AF_INET else "::")
    oif = _get(msg, "oif")
    gateway = _get(msg, "gateway")
    multipath = _get(msg, "multipath")
    if oif is None and multipath:
        # Multipath: model the first hop; SMC-Rv2 routing needs one usable next hop.
        first = multipath[0]
        oif = first.get("oif")
        gateway = gateway or first.get("gateway")
    prefsrc = _get(msg, "prefsrc")
    priority = _get(msg, "priority")
    return Route(
        dst=ipaddress.ip_network(f"{dst}/{dst_len}", strict=False),
        oif=oif if isinstance(oif, int) else None,
        gateway=ipaddress.ip_address(gateway) if isinstance(gateway, str) else None,
        table=_int(msg, "table", RT_TABLE_MAIN),
        priority=priority if isinstance(priority, int) else 0,
        type=_int(msg, "type", 1),
        prefsrc=ipaddress.ip_address(prefsrc) if isinstance(prefsrc, str) else None,
    )


def neighbour_from_msg(msg: Any) -> Neighbour:
    family = _int(msg, "family")
    if family not in (AF_INET, AF_INET6):
        raise MessageError(f"neighbour family {family}")  # AF_BRIDGE = FDB entries
    dst = _get(msg, "dst")
    if not isinstance(dst, str):
        raise MessageError("neighbour without destination")
    lladdr = _get(msg, "lladdr")
    return Neighbour(
        ifindex=_int(msg, "ifindex"),
        dst=ipaddress.ip_address(dst),
        lladdr=lladdr if isinstance(lladdr, str) else None,
        state=_int(msg, "state", 0),
    )


def check_datagram(data: bytes, addr: object) -> str | None:
    """Why a received datagram must not reach the rtnetlink parser, or None if it may.

    Only the kernel (netlink port 0) speaks for the kernel: a privileged process can unicast to
    our socket, and what it says about links must not become our model.  Then the framing: every
    message needs a whole header, a length within the datagram, and the fixed body of its type.
    """
    if isinstance(addr, tuple) and addr and addr[0] != 0:
        return f"sent by netlink port {addr[0]}, not the kernel"
    off = 0
    n = len(data)
    if n < NLMSG_HDRLEN:
        return f"{n} bytes, shorter than a netlink header"
    while off < n:
        if n - off < NLMSG_HDRLEN:
            return f"{n - off} trailing bytes at offset {off}"
        length, mtype = struct.unpack_from("=IH", data, off)
        if length < NLMSG_HDRLEN or length > n - off:
            return f"message at offset {off} claims {length} bytes, {n - off} present"
        need = MIN_BODY.get(mtype, 0)
        if length - NLMSG_HDRLEN < need:
            return f"message type {mtype} at offset {off} has a {length - NLMSG_HDRLEN}-byte body"
        off += (length + 3) & ~3
    return None


class _KernelOnlyIPRoute(AsyncIPRoute):  # type: ignore[misc]
    """AsyncIPRoute that drops datagrams :func:`check_datagram` refuses before pyroute2 parses
    them (its parser raises on short input inside an asyncio callback)."""

    def __init__(self, on_reject: Callable[[str], None], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._smcd_on_reject = on_reject

    def enqueue(self, data: bytes, addr: Any) -> Any:
        if addr is not None:  # None: pyroute2's own synthetic error messages
            problem = check_datagram(data, addr)
            if problem is not None:
                self._smcd_on_reject(problem)
                return None
        return super().enqueue(data, addr)


class NetlinkWatcher:
    """Follows links, addresses, routes and neighbours of one network namespace (``netns`` is a
    name under /var/run/netns or a path; None = the daemon's own) into ``inventory``."""

    def __init__(self, inventory: DeviceInventory, netns: str | None = None) -> None:
        self._inv = inventory
        self._netns = netns
        self._events: AsyncIPRoute | None = None
        self._requests: AsyncIPRoute | None = None
        self._task: asyncio.Task[None] | None = None
        self._route_resync: asyncio.Task[None] | None = None
        self._started = False
        #: Messages skipped because they could not be interpreted (visible to tests and stats).
        self.skipped = 0
        #: Datagrams dropped unparsed (not from the kernel, or broken framing).
        self.rejected = 0
        #: Full resyncs done after the event stream broke.
        self.resyncs = 0

    @property
    def netns(self) -> str | None:
        return self._netns

    @property
    def event_portid(self) -> int | None:
        """Netlink port id of the event socket (diagnostics; tests send it hostile bytes)."""
        if self._events is None:
            return None
        try:
            portid = self._events.getsockname()[0]
        except Exception:
            return None
        return portid if isinstance(portid, int) else None

    async def start(self) -> None:
        """Subscribe, dump, and follow events in a background task. Raises if the namespace
        cannot be entered or rtnetlink is unavailable: the daemon cannot work without it."""
        if self._started:
            return
        try:
            await self._open_events()
            self._requests = self._socket()
            await self._full_dump()
        except BaseException:
            await self.stop()
            raise
        self._started = True
        self._task = asyncio.create_task(self._run(), name=f"smcd-netlink[{self._netns or ''}]")

    async def stop(self) -> None:
        self._started = False
        for task in (self._route_resync, self._task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        self._route_resync = None
        self._task = None
        for sock in (self._events, self._requests):
            if sock is not None:
                with contextlib.suppress(Exception):
                    sock.close()
        self._events = None
        self._requests = None

    async def _open_events(self) -> None:
        if self._events is not None:
            with contextlib.suppress(Exception):
                self._events.close()
        self._events = self._socket()
        await self._events.bind(groups=GROUPS)

    def _socket(self) -> AsyncIPRoute:
        # flags=0: enter an existing namespace, never create one (pyroute2's default O_CREAT
        # would silently make an empty namespace for a mistyped name).
        return _KernelOnlyIPRoute(self._reject, netns=self._netns, flags=0)

    def _reject(self, problem: str) -> None:
        self.rejected += 1
        log.warning("dropping rtnetlink datagram: %s", problem)

    # -- dumps ------------------------------------------------------------------------------

    async def _collect(self, kind: str) -> list[Any]:
        assert self._requests is not None
        method = getattr(self._requests, kind)
        return [m async for m in await method("dump")]

    async def _full_dump(self) -> None:
        links = self._convert_all(await self._collect("link"), self._link_or_none)
        addrs = self._convert_all(await self._collect("addr"), address_from_msg)
        routes = self._convert_all(await self._collect("route"), route_from_msg)
        neighs = self._convert_all(await self._collect("neigh"), neighbour_from_msg)
        self._inv.replace_network((x for x in links if x is not None), addrs, routes, neighs)

    async def _resync_routes(self) -> None:
        await asyncio.sleep(ROUTE_RESYNC_DELAY)
        try:
            routes = self._convert_all(await self._collect("route"), route_from_msg)
        except Exception as exc:
            log.warning("route re-dump failed: %s", exc)
            return
        self._inv.replace_routes(routes)

    def _schedule_route_resync(self) -> None:
        if self._route_resync is None or self._route_resync.done():
            self._route_resync = asyncio.create_task(self._resync_routes())

    def _convert_all(self, msgs: list[Any], convert: Any) -> list[Any]:
        out = []
        for m in msgs:
            try:
                out.append(convert(m))
            except Exception as exc:
                self._skip(m, exc)
        return out

    def _link_or_none(self, msg: Any) -> NetDevice | None:
        if _int(msg, "family", AF_UNSPEC) != AF_UNSPEC:
            return None
        return link_from_msg(msg)

    def _skip(self, msg: Any, exc: BaseException) -> None:
        self.skipped += 1
        log.warning("skipping rtnetlink message we cannot interpret (%s): %.200r", exc, msg)

    # -- events -----------------------------------------------------------------------------

    async def _run(self) -> None:
        backoff = 0.1
        while True:
            try:
                assert self._events is not None
                async for msg in self._events.get():
                    self.handle_message(msg)
                    backoff = 0.1
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                # ENOBUFS (we fell behind), a parser failure on hostile bytes, a dead socket:
                # events may be lost, so start over from a fresh subscription and a full dump.
                log.warning("rtnetlink event stream broke (%s); resynchronising", exc)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
                try:
                    await self._open_events()
                    await self._full_dump()
                    self.resyncs += 1
                except asyncio.CancelledError:
                    raise
                except Exception as exc2:
                    log.warning("rtnetlink resync failed (%s); retrying", exc2)

    def handle_message(self, msg: Any) -> None:
        """Apply one rtnetlink message to the inventory; uninterpretable ones are skipped."""
        try:
            self._dispatch(msg)
        except Exception as exc:
            self._skip(msg, exc)

    def _dispatch(self, msg: Any) -> None:
        t = message_type(msg)
        if t == RTM_NEWLINK:
            if _int(msg, "family", AF_UNSPEC) != AF_UNSPEC:
                return  # AF_BRIDGE port notifications, not the device itself
            old = self._inv.netdev(_int(msg, "index"))
            dev = link_from_msg(msg, old)
            self._inv.apply_link(dev)
            if old is not None and old.admin_up and not dev.admin_up:
                self._schedule_route_resync()
        elif t == RTM_DELLINK:
            if _int(msg, "family", AF_UNSPEC) != AF_UNSPEC:
                return
            self._inv.remove_link(_int(msg, "index"))
        elif t == RTM_NEWADDR:
            self._inv.apply_address(address_from_msg(msg))
        elif t == RTM_DELADDR:
            self._inv.remove_address(address_from_msg(msg))
        elif t == RTM_NEWROUTE:
            self._inv.apply_route(route_from_msg(msg))
        elif t == RTM_DELROUTE:
            self._inv.remove_route(route_from_msg(msg))
        elif t == RTM_NEWNEIGH:
            self._inv.apply_neighbour(neighbour_from_msg(msg))
        elif t == RTM_DELNEIGH:
            self._inv.remove_neighbour(neighbour_from_msg(msg))
        else:
            log.debug("ignoring rtnetlink message type %d", t)
