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
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import ctypes.util
import ipaddress
import os
import threading
from typing import Any

__all__ = ["dnat_target", "local_in"]

_CLONE_NEWNET = 0x40000000
_RUN_NETNS = "/run/netns"
Target = tuple[str, int]


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
            if os.stat(path).st_ino in skip:
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
    import asyncio

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
    fut: concurrent.futures.Future[Target | None] = concurrent.futures.Future()

    def run() -> None:
        with contextlib.suppress(BaseException):
            fut.set_result(_scan_named(loc, dst, seen))
        if not fut.done():
            fut.set_result(None)

    # a new thread each time: it leaves the daemon's namespace and ends there
    threading.Thread(target=run, name="smcd-netns-scan", daemon=True).start()
    return await asyncio.wrap_future(fut)
