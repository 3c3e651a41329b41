"""What the daemon needs to know about the host's other network namespaces (#15).

One smcd serves every namespace of the host: applications reach its handoff socket by path (a bind
mount) and hand over sockets of their own namespace. Two questions then need the view from inside
another namespace:

* Is ``ip`` an address of the namespace a wildcard listener lives in? :func:`local_in` reads it
  from ``/proc/<pid>/net`` of the process that registered the listener, which shows that
  process's namespace (no ``setns``).
* Where does a published (DNAT'ed) port really lead? :func:`dnat_target` looks the client's
  4-tuple up in the connection tracking tables (``nf_conntrack``) of the client's namespace, the
  daemon's, and every namespace ``ip netns`` names (the router that publishes the port, such as a
  container host's bridge namespace). The reply direction's source is the real listener.
  Namespaces without a process of ours are read from a short-lived thread that joins them
  (``setns``, as root) and dies with them, so no thread of the daemon changes namespace.
* Which network devices does each namespace have (``smcctl device show``)?
  :func:`namespace_devices` lists the netdevs of every namespace the daemon knows of (those
  ``ip netns`` names, and those of the processes whose connections and listeners it holds) with
  an rtnetlink dump taken from such a thread; smcd's own namespace is its device inventory.
* Which PNETID does a connection handed over from another namespace have (SMC-R device choice)?
  :func:`route_pnet` asks that namespace's kernel for the route's output netdev, follows it to
  its base device there, and looks it up in that namespace's PNET entries
  (:meth:`~smcd_daemon.core.pnet.PnetTable.view` with :func:`pnet_keys`). :func:`pnet_netns`
  checks and spells the namespace an operator gives a PNET entry.

:func:`netns_label` is how records show a namespace other than smcd's ("inode name").
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import ctypes.util
import dataclasses
import errno
import ipaddress
import os
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

from smcd_daemon.adapters.tcp_identity import NOT_MOUNTED_HERE, NetnsId, named_netns, netns_name
from smcd_daemon.core.devices import DeviceInventory, NetDevice
from smcd_daemon.core.pnet import PnetError, PnetTable, validate_netns

__all__ = [
    "NamespaceDevices",
    "NamespaceRoute",
    "dnat_target",
    "local_in",
    "namespace_devices",
    "netns_label",
    "own_netns",
    "pnet_keys",
    "pnet_netns",
    "route_pnet",
]

_CLONE_NEWNET = 0x40000000
_RUN_NETNS = "/run/netns"
Target = tuple[str, int]
_T = TypeVar("_T")
MAX_NAMESPACES = 256
"""At most this many namespaces are read per call (a host with more is listed in part)."""


def own_netns() -> int:
    """Inode of smcd's own network namespace."""
    return _ns_inode("self")


def netns_label(ns: NetnsId | None) -> str:
    """How connection and listener records show the namespace ``ns``: "inode name" (or the inode
    alone when ``ip netns`` has no name for it); "" for smcd's own namespace or an unknown one."""
    if ns is None or not ns[0] or ns[0] == own_netns():
        return ""
    return f"{ns[0]} {ns[1]}" if ns[1] else str(ns[0])


def local_in(pid: int, ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """Is ``ip`` an address of the network namespace of process ``pid``?"""
    try:
        if ip.version == 4:
            with open(f"/proc/{pid}/net/fib_trie") as f:
                text = f.read()
            want = f"|-- {ip}\n"
            at = text.find(want)
            while at >= 0:
                nxt = text[at + len(want) :].split("\n", 1)[0]
                if "/32 host LOCAL" in nxt:
                    return True
                at = text.find(want, at + 1)
            return False
        with open(f"/proc/{pid}/net/if_inet6") as f:
            hexip = ip.exploded.replace(":", "")
            return any(line.split()[0] == hexip for line in f if line.strip())
    except OSError:
        return False


def _parse(text: str, local: Target, peer: Target) -> Target | None:
    """The reply source of the entry whose original direction is ``local`` → ``peer``, when
    it differs from ``peer`` (a DNAT)."""
    want = (f"src={local[0]}", f"dst={peer[0]}", f"sport={local[1]}", f"dport={peer[1]}")
    for line in text.splitlines():
        if " tcp " not in line or want[3] not in line:
            continue
        fields = [f for f in line.split() if "=" in f]
        orig = [f for f in fields if f.split("=", 1)[0] in ("src", "dst", "sport", "dport")]
        if len(orig) < 8 or tuple(orig[:4]) != want:
            continue
        reply = {k: v for k, v in (f.split("=", 1) for f in orig[4:8])}
        target = (reply["src"], int(reply["sport"]))
        if target != (peer[0], peer[1]):
            return target
    return None


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def _scan_named(local: Target, peer: Target, skip: set[int]) -> Target | None:
    """In a thread of its own: join each namespace of ``/run/netns`` in turn and look."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    try:
        names = sorted(os.listdir(_RUN_NETNS))
    except OSError:
        return None
    for name in names:
        path = os.path.join(_RUN_NETNS, name)
        try:
            ino = named_netns(path)
            if ino is None or ino in skip:
                continue
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            if libc.setns(fd, _CLONE_NEWNET) != 0:
                continue
        finally:
            os.close(fd)
        found = _parse(_read("/proc/thread-self/net/nf_conntrack"), local, peer)
        if found is not None:
            return found
    return None


def _ns_inode(pid: int | str) -> int:
    try:
        return os.stat(f"/proc/{pid}/ns/net").st_ino
    except OSError:
        return 0


async def dnat_target(local: Any, peer: Any, pid: int) -> Target | None:
    """Where the connection ``local`` → ``peer`` of process ``pid`` really goes, if a DNAT
    (a published port) rewrote its destination; None if no table says so."""
    loc: Target = (str(local[0]), int(local[1]))
    dst: Target = (str(peer[0]), int(peer[1]))
    seen: set[int] = set()
    for who in ([pid] if pid else []) + ["self"]:
        ino = _ns_inode(who)
        if ino in seen:
            continue
        seen.add(ino)
        found = _parse(_read(f"/proc/{who}/net/nf_conntrack"), loc, dst)
        if found is not None:
            return found
    return await _in_own_thread(lambda: _scan_named(loc, dst, seen), None)


async def _in_own_thread(fn: Callable[[], _T], failed: _T) -> _T:
    """``fn()`` in a new thread (``failed`` if it raises): such a thread may leave the daemon's
    namespace, and ends there."""
    fut: concurrent.futures.Future[_T] = concurrent.futures.Future()

    def run() -> None:
        with contextlib.suppress(BaseException):
            fut.set_result(fn())
        if not fut.done():
            fut.set_result(failed)

    threading.Thread(target=run, name="smcd-netns-scan", daemon=True).start()
    return await asyncio.wrap_future(fut)


# -- devices per namespace -----------------------------------------------------------------------


@dataclass(frozen=True)
class NamespaceDevices:
    """The netdevs of one network namespace, as an rtnetlink dump taken inside it shows them."""

    inode: int
    name: str
    """The ``ip netns`` name ("" if none: a container runtime's namespace, known by a pid)."""
    netdevs: tuple[NetDevice, ...] = ()
    problem: str = ""
    """Why the namespace could not be read ("" if it was)."""


def _known(
    pids: Iterable[int], skip: int, unseen: list[str] | None = None
) -> dict[int, tuple[str, str]]:
    """inode -> (``ip netns`` name, a path that opens the namespace), without ``skip``; the
    names whose namespace is not mounted in ours go to ``unseen``."""
    found: dict[int, tuple[str, str]] = {}
    try:
        names = sorted(os.listdir(_RUN_NETNS))
    except OSError:
        names = []
    for name in names:
        path = os.path.join(_RUN_NETNS, name)
        with contextlib.suppress(OSError):
            ino = named_netns(path)
            if ino is None:
                if unseen is not None:
                    unseen.append(name)
            elif ino != skip and ino not in found:
                found[ino] = (name, path)
    for pid in sorted(set(pids)):
        if pid <= 0:
            continue
        path = f"/proc/{pid}/ns/net"
        with contextlib.suppress(OSError):
            ino = os.stat(path).st_ino
            if ino != skip and ino not in found:
                found[ino] = (netns_name(ino), path)
        if len(found) >= MAX_NAMESPACES:
            break
    return dict(list(found.items())[:MAX_NAMESPACES])


def _dump_here() -> tuple[NetDevice, ...]:
    """The netdevs of the calling thread's namespace, with their addresses (rtnetlink dump)."""
    from pyroute2 import IPRoute  # type: ignore[import-untyped]

    from smcd_daemon.adapters.netlink import MessageError, address_from_msg, link_from_msg

    with IPRoute() as ipr:  # a netlink socket opened now belongs to this thread's namespace
        links, addrs = list(ipr.get_links()), list(ipr.get_addr())
    by_index: dict[int, list[Any]] = {}
    for msg in addrs:
        with contextlib.suppress(MessageError, ValueError):
            a = address_from_msg(msg)
            by_index.setdefault(a.ifindex, []).append(a)
    out: list[NetDevice] = []
    for msg in links:
        with contextlib.suppress(MessageError, ValueError):
            nd = link_from_msg(msg)
            out.append(dataclasses.replace(nd, addresses=tuple(by_index.get(nd.ifindex, ()))))
    return tuple(sorted(out, key=lambda d: d.ifindex))


def _read_all(known: dict[int, tuple[str, str]]) -> list[NamespaceDevices]:
    """In a thread of its own: join each namespace in turn and dump its links."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    out: list[NamespaceDevices] = []
    for ino, (name, path) in known.items():
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:
            out.append(NamespaceDevices(ino, name, problem=f"cannot open {path}: {e.strerror}"))
            continue
        try:
            if libc.setns(fd, _CLONE_NEWNET) != 0:
                err = ctypes.get_errno()
                why = f"cannot join: {os.strerror(err)}"
                if err == errno.EPERM:
                    why += " (joining a namespace takes CAP_SYS_ADMIN and a setns() allowed)"
                out.append(NamespaceDevices(ino, name, problem=why))
                continue
        finally:
            os.close(fd)
        if _ns_inode("thread-self") != ino:  # the path now names another namespace
            out.append(NamespaceDevices(ino, name, problem="gone while being read"))
            continue
        try:
            out.append(NamespaceDevices(ino, name, _dump_here()))
        except Exception as e:  # one namespace's failure is shown, not raised
            out.append(NamespaceDevices(ino, name, problem=f"rtnetlink dump failed: {e}"))
    return out


async def namespace_devices(pids: Iterable[int] = ()) -> list[NamespaceDevices]:
    """The netdevs of every network namespace of the host the daemon knows of, smcd's own
    excepted: the ones ``ip netns`` names and those of processes ``pids`` (the applications
    whose connections and listeners smcd holds, in namespaces a container runtime made and did
    not name). Joining a namespace needs CAP_SYS_ADMIN; one that cannot be read says why."""
    unseen: list[str] = []
    known = _known(pids, own_netns(), unseen)
    none: list[NamespaceDevices] = []
    found = await _in_own_thread(lambda: _read_all(known), none) if known else []
    found += [NamespaceDevices(0, name, problem=NOT_MOUNTED_HERE) for name in unseen]
    return sorted(found, key=lambda n: (n.name == "", n.name, n.inode))


# -- PNET entries per namespace --------------------------------------------------------------


def pnet_keys(ns: NetnsId | None) -> frozenset[str]:
    """The keys PNET entries may name namespace ``ns`` by: its inode in decimal and its
    ``ip netns`` name; {""} for smcd's own (or an unknown one, as the kernel's caller netns)."""
    if ns is None or not ns[0] or ns[0] == own_netns():
        return frozenset({""})
    return frozenset(k for k in (str(ns[0]), ns[1]) if k)


def _inode_alive(inode: int) -> bool:
    """Does a process of this host live in network namespace ``inode``?"""
    with contextlib.suppress(OSError):
        for pid in os.listdir("/proc"):
            if pid.isdigit() and _ns_inode(pid) == inode:
                return True
    return False


def pnet_netns(spec: str) -> str:
    """How a PNET entry names the namespace ``spec`` (an ``ip netns`` name or an inode): ""
    for smcd's own, else its ``ip netns`` name if it has one, else its inode. Raises
    :class:`PnetError` for a namespace that does not exist, so an entry never waits for a
    misspelt one."""
    key = validate_netns(spec)
    if not key:
        return ""
    own = own_netns()
    if key.isdigit():
        ino = int(key)
        if ino == own:
            return ""
        name = netns_name(ino)
        if name:
            return name
        if not _inode_alive(ino):
            raise PnetError(
                f"Network namespace {spec!r} is unknown: no process lives in a network namespace "
                f"with inode {ino} and `ip netns` names none (see `smcctl device show`).",
                value=spec,
            )
        return key
    try:
        named = named_netns(os.path.join(_RUN_NETNS, key))
    except OSError:
        if key == "host":  # as namespaces.groups spells smcd's own
            return ""
        raise PnetError(
            f"Network namespace {spec!r} is unknown: `ip netns` names no such namespace (no "
            f"{_RUN_NETNS}/{key}); give an `ip netns` name or an inode.",
            value=spec,
        ) from None
    if named is None:
        raise PnetError(f"Network namespace {spec!r} is not usable: {NOT_MOUNTED_HERE}.",
                        value=spec)  # fmt: skip
    return "" if named == own else key


@dataclass(frozen=True)
class NamespaceRoute:
    """Where a connection of namespace ``netns`` leaves: the route's output netdev there and
    the PNETID that namespace's entries give it (through its base device, as the kernel does)."""

    netns: NetnsId
    netdev: NetDevice | None = None
    pnetid: str | None = None
    problem: str = ""
    """Why the namespace could not be asked ("" if it was)."""
    vlan_id: int | None = None
    """The connection's VLAN: the first VLAN device down ``netdev``'s stack there
    (``smc_vlan_by_tcpsk``); None if none, -1 if one of unknown id."""


def _ns_path(ns: NetnsId, pid: int) -> str | None:
    """A path that opens namespace ``ns``: the process's own link first, else its name."""
    candidates = ([f"/proc/{pid}/ns/net"] if pid > 0 else []) + (
        [os.path.join(_RUN_NETNS, ns[1])] if ns[1] else []
    )
    for path in candidates:
        with contextlib.suppress(OSError):
            if os.stat(path).st_ino == ns[0]:
                return path
    return None


def _route_in(
    ns: NetnsId, path: str, local: str, peer: str, keys: frozenset[str], pnet: PnetTable
) -> NamespaceRoute:
    """In a thread of its own: join the namespace, read its links and the route, resolve."""
    from pyroute2 import IPRoute

    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            return NamespaceRoute(ns, problem=f"cannot join: {os.strerror(ctypes.get_errno())}")
    finally:
        os.close(fd)
    if _ns_inode("thread-self") != ns[0]:
        return NamespaceRoute(ns, problem="gone while being read")
    links = {d.ifindex: d for d in _dump_here()}
    inv = DeviceInventory(loopback_enabled=False)
    for link in links.values():
        inv.apply_link(link)
    oif: int | None = None
    with IPRoute() as ipr, contextlib.suppress(Exception):  # no route: by the address below
        msgs = ipr.route("get", dst=peer, src=local)
        if msgs and msgs[0]["type"] in (1, 2):  # RTN_UNICAST, RTN_LOCAL
            oif = msgs[0].get_attr("RTA_OIF")
    dev = links.get(oif) if oif is not None else None
    if dev is None or dev.name == "lo":
        dev = next(
            (d for d in links.values() if any(str(a.address) == local for a in d.addresses)),
            None,
        )
    if dev is None:
        return NamespaceRoute(ns, problem=f"no netdev holds {local} or routes to {peer}")
    pnetid = inv.resolve_pnetid(dev.name, pnet.view(keys))
    return NamespaceRoute(ns, dev, pnetid, vlan_id=inv.clc_vlan_id(dev.name))


async def route_pnet(
    ns: NetnsId, pid: int, local: object, peer: object, pnet: PnetTable
) -> NamespaceRoute:
    """The output netdev and PNETID of the connection ``local`` → ``peer`` of process ``pid``
    in namespace ``ns`` (``smc_pnet_find_roce_resource`` in the socket's own namespace)."""
    path = _ns_path(ns, pid)
    if path is None:
        return NamespaceRoute(ns, problem="no path opens the namespace (process gone, no name)")
    keys = pnet_keys(ns)
    failed = NamespaceRoute(ns, problem="reading the namespace failed")
    return await _in_own_thread(
        lambda: _route_in(ns, path, str(local), str(peer), keys, pnet), failed
    )
