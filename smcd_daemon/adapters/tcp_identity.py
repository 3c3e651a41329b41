"""Who is at the other end of a borrowed TCP socket, without trusting addresses.

Network namespaces reuse addresses (two pairs of containers can have identical 4-tuples) and a
published port is DNAT'ed (the client sees another 4-tuple than its server), so the daemon does
not meet the two halves of one connection by their addresses.

:func:`connection_identity` names a TCP connection by the initial sequence numbers of both
directions, ``(client ISN, server ISN)``: the same pair on both ends of one connection, whatever
namespace, NAT (which leaves sequence numbers alone) or address each end sees, and two random
32-bit values per connection. It is the *rendezvous* of the two halves (which server half a
client half waits for); what proves that they belong together is the loopback device's token
check (:mod:`smcd_daemon.transport.loopback`), not this.

How: with ``TCP_REPAIR`` (CAP_NET_ADMIN in the socket's namespace; the daemon holds a copy of
the socket while the application waits) the kernel reports ``write_seq`` and ``rcv_nxt``; the
bytes counted in ``tcp_info`` (``tcpi_bytes_acked``, ``tcpi_bytes_received``) and ``SIOCOUTQ``
take them back to the ISNs. Repair mode is left with ``TCP_REPAIR_OFF_NO_WP`` (no window probe)
and only the queues' sequence numbers are read, nothing is changed. An active opener's
``tcpi_bytes_acked`` counts its SYN, a passive opener's does not. Without the capability (a
per-user daemon) the answer is None and the caller keys by addresses.

:func:`netns_of` names a process's network namespace (inode of ``/proc/<pid>/ns/net`` and the
name ``ip netns`` gives it, from ``/run/netns``).
"""

from __future__ import annotations

import fcntl
import os
import socket
import struct
import termios

__all__ = ["NetnsId", "SocketNetns", "connection_identity", "netns_name", "netns_of"]

_TCP_REPAIR = 19
_TCP_REPAIR_QUEUE = 20
_TCP_QUEUE_SEQ = 21
_TCP_RECV_QUEUE = 1
_TCP_SEND_QUEUE = 2
_TCP_REPAIR_ON = 1
_TCP_REPAIR_OFF_NO_WP = -1
_BYTES_ACKED_AT = 120  # struct tcp_info: tcpi_bytes_acked, tcpi_bytes_received (u64 each)
_BYTES = struct.Struct("=QQ")
_INFO_LEN = _BYTES_ACKED_AT + _BYTES.size  # the part of tcp_info read (no more is copied)
_INT = struct.Struct("i")
_INT0 = bytes(_INT.size)
_TCP = socket.IPPROTO_TCP
_SOL_SOCKET = socket.SOL_SOCKET
_SO_REUSEADDR = socket.SO_REUSEADDR
_TCP_INFO = socket.TCP_INFO
_U32 = 0xFFFFFFFF
RUN_NETNS = "/run/netns"


def connection_identity(sock: socket.socket, *, active: bool) -> tuple[int, int] | None:
    """``(client ISN, server ISN)`` of the connection ``sock`` is one end of (``active``: the
    end that connected), or None when the kernel does not tell (no capability, no TCP).

    ``SO_REUSEADDR`` is kept: leaving repair mode clears it (``sk_reuse = SK_NO_REUSE`` in
    ``do_tcp_setsockopt``), and an accepted connection that lost it blocked its server's port
    for TIME_WAIT's minute once closed: a server restarted on its port got ``EADDRINUSE``
    although it set ``SO_REUSEADDR``, as every server does."""
    setopt, getopt = sock.setsockopt, sock.getsockopt
    try:
        reuse = getopt(_SOL_SOCKET, _SO_REUSEADDR)
        setopt(_TCP, _TCP_REPAIR, _TCP_REPAIR_ON)
    except OSError:
        return None
    try:
        setopt(_TCP, _TCP_REPAIR_QUEUE, _TCP_SEND_QUEUE)
        write_seq = getopt(_TCP, _TCP_QUEUE_SEQ) & _U32
        setopt(_TCP, _TCP_REPAIR_QUEUE, _TCP_RECV_QUEUE)
        rcv_nxt = getopt(_TCP, _TCP_QUEUE_SEQ) & _U32
    except OSError:
        return None
    finally:
        try:
            setopt(_TCP, _TCP_REPAIR, _TCP_REPAIR_OFF_NO_WP)
            if reuse:
                setopt(_SOL_SOCKET, _SO_REUSEADDR, reuse)
        except OSError:
            pass
    try:
        info = getopt(_TCP, _TCP_INFO, _INFO_LEN)
        (outq,) = _INT.unpack(fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, _INT0))
    except OSError:
        return None
    if len(info) < _INFO_LEN:
        return None
    acked, received = _BYTES.unpack_from(info, _BYTES_ACKED_AT)
    own = (write_seq - outq - acked - (0 if active else 1)) & _U32
    peer = (rcv_nxt - received - 1) & _U32
    return (own, peer) if active else (peer, own)


NetnsId = tuple[int, str]
"""(inode of the namespace, its ``ip netns`` name or "")."""


_nsfs_dev: int | None = None


def named_netns(path: str) -> int | None:
    """The inode of the network namespace ``path`` (an ``ip netns`` file) is bound to in our
    mount namespace; None when it is not one here. ``ip netns add`` creates an empty file and
    binds the namespace onto it; a service with a mount namespace of its own (smcd.service:
    ``PrivateMounts=``, ``ProtectSystem=``) may see the file without that mount, when the bind
    did not propagate to it: the file's own inode is then no namespace's. Raises OSError when
    ``path`` cannot be looked at."""
    global _nsfs_dev
    st = os.stat(path)
    if _nsfs_dev is None:
        _nsfs_dev = os.stat("/proc/self/ns/net").st_dev  # nsfs: one superblock for all
    return st.st_ino if st.st_dev == _nsfs_dev else None


NOT_MOUNTED_HERE = (
    "its `ip netns` mount is not in smcd's mount namespace (named after smcd started, on a "
    "host whose mounts do not propagate into the service: restart smcd to see it)"
)
"""Why a name of ``/run/netns`` that :func:`named_netns` does not resolve is not used."""


def netns_name(inode: int) -> str:
    """The name ``ip netns`` knows the namespace ``inode`` by ("" if none)."""
    try:
        names = sorted(os.listdir(RUN_NETNS))
    except OSError:
        return ""
    for name in names:
        try:
            if named_netns(os.path.join(RUN_NETNS, name)) == inode:
                return name
        except OSError:
            continue
    return ""


_SO_NETNS_COOKIE = 71  # Linux 5.14
_SIOCGSKNS = 0x894C  # Linux 4.9: an fd of the socket's network namespace


class SocketNetns:
    """The inode of the network namespace a socket lives in (the process's that made it).

    Its cookie (``SO_NETNS_COOKIE``, one call, never reused within a boot) names the namespace,
    and the inode behind a cookie is looked up once (``SIOCGSKNS``): a ``stat`` of
    ``/proc/PID/ns/net`` per handoff cost ~6 to 14 µs of procfs walking, twice a connection."""

    def __init__(self, limit: int = 1024) -> None:
        self._inodes: dict[bytes, int] = {}
        self._limit = limit

    def inode(self, sock: socket.socket) -> int | None:
        """None when the kernel says neither (before 5.14: the caller reads the process's)."""
        try:
            cookie = sock.getsockopt(_SOL_SOCKET, _SO_NETNS_COOKIE, 8)
        except OSError:
            return None
        inode = self._inodes.get(cookie)
        if inode is not None:
            return inode
        try:
            ns_fd = fcntl.ioctl(sock.fileno(), _SIOCGSKNS)
        except OSError:
            return None
        try:
            inode = os.fstat(ns_fd).st_ino
        finally:
            os.close(ns_fd)
        if len(self._inodes) >= self._limit:
            self._inodes.clear()
        self._inodes[cookie] = inode
        return inode


def netns_of(pid: int) -> NetnsId | None:
    """The network namespace of process ``pid`` (None if it is gone or hidden from us)."""
    try:
        inode = os.stat(f"/proc/{pid}/ns/net").st_ino
    except OSError:
        return None
    return inode, netns_name(inode)
