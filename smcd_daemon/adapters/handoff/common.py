"""What every part of the handoff server shares: the socket's set-up and peers, the per-connection
record, the counters, and the FALLBACK reply."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import socket
import stat
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from smc_handoff import messages as m
from smcd_daemon.core.handoff_pairs import Half, Listener
from smcd_daemon.errors import SmcError
from smcd_daemon.wire.reasons import explain

__all__ = [
    "Client",
    "HandoffError",
    "HandoffStats",
    "LocalAddresses",
    "PeerCred",
    "Refused",
    "bind_seqpacket",
    "clip",
    "configured_peer",
    "fallback_message",
    "log",
    "peer_cred",
    "reason_name",
]

IpAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IpNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

log = logging.getLogger(__package__ or __name__)
"""One logger for the whole server (``smcd_daemon.adapters.handoff``)."""


class HandoffError(SmcError):
    """The handoff socket cannot be set up (path in use, not a socket, permissions...)."""


@dataclass(frozen=True)
class PeerCred:
    """Who is on the other end of a connection, as the kernel vouches for it (SO_PEERCRED)."""

    pid: int
    uid: int
    gid: int

    def __str__(self) -> str:
        return f"pid {self.pid} uid {self.uid} gid {self.gid}"


@dataclass
class HandoffStats:
    """Counters of the handoff socket, for logs and tests."""

    connections: int = 0
    refused_connections: int = 0
    requests: int = 0
    invalid: int = 0
    channels: int = 0
    fallbacks: int = 0
    listeners: int = 0
    resumes: int = 0
    fds_closed: int = 0
    errors: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


_UCRED = struct.Struct("3i")


def peer_cred(sock: socket.socket) -> PeerCred | None:
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    except OSError:
        return None
    pid, uid, gid = _UCRED.unpack(raw)
    return PeerCred(pid, uid, gid)


def bind_seqpacket(path: Path, *, mode: int = 0o666, backlog: int = 4096) -> socket.socket:
    """Bind and listen on ``path``. A stale socket file (nobody listening) is replaced; a live
    one, or a path that is not a socket, is an error rather than something to destroy."""
    path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    if st is not None:
        if not stat.S_ISSOCK(st.st_mode):
            raise HandoffError(
                f"handoff socket {path} exists and is not a socket; remove it or set "
                "handoff_socket to another path"
            )
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            probe.connect(os.fspath(path))
        except (ConnectionRefusedError, FileNotFoundError):
            os.unlink(path)  # stale: left by a daemon that died
        except OSError as e:
            raise HandoffError(f"handoff socket {path} cannot be checked: {e}") from e
        else:
            raise HandoffError(f"handoff socket {path} is in use: another smcd is serving it")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    try:
        sock.bind(os.fspath(path))
        os.chmod(path, mode)
        sock.listen(backlog)
    except OSError as e:
        sock.close()
        raise HandoffError(f"cannot listen on handoff socket {path}: {e.strerror or e}") from e
    return sock


@dataclass(eq=False)
class Client:
    """One handoff connection and what it holds: a channel half, a listener, or an SMC-R
    connection's id (the SMC-R service tracks the rest)."""

    sock: socket.socket
    cred: PeerCred | None
    uid: int = 65534
    task: asyncio.Task[None] | None = None  # serving its first request
    half: Half | None = None
    listener: Listener | None = None
    smcr_conn: int | None = None
    watched_done: bool = False  # released and closed (see ``HandoffServer.end_client``)
    netns: tuple[int, str] | None = None
    """The caller's network namespace (inode, name), once looked up (``netns_read``)."""
    netns_read: bool = False

    def __post_init__(self) -> None:
        if self.cred is not None:
            self.uid = self.cred.uid

    @property
    def label(self) -> str:
        """Who this is, for log messages (built only when a message is logged)."""
        return str(self.cred) if self.cred is not None else "unknown peer"


class Refused(Exception):
    """End this client's connection after replying ``reply``."""

    def __init__(self, reply: m.Error) -> None:
        super().__init__(reply.message)
        self.reply = reply


def reason_name(code: int) -> str:
    """The FALLBACK ``name``: ``SMC_CLC_DECL_...`` or our local names, else the hex code."""
    if code == m.FALLBACK_DAEMON_UNAVAILABLE:
        return "DAEMON_UNAVAILABLE"
    if code == m.FALLBACK_DAEMON_ERROR:
        return "DAEMON_ERROR"
    if code == m.FALLBACK_DAEMON_BUSY:
        return "DAEMON_BUSY"
    return explain(code).name or f"CODE_{code:08X}"


def clip(text: str, limit: int = m.MAX_TEXT) -> str:
    raw = text.replace("\x00", "?").encode("utf-8", "replace")[:limit]
    return raw.decode("utf-8", "ignore")


def fallback_message(
    code: int, detail: str, peer_diagnosis: int | None = None, *, after_decline: bool = False
) -> m.Fallback:
    """``after_decline``: CLC crossed the stream and ended in a Decline (sent or received); the
    library trusts a FALLBACK over a stream it sees touched only with it."""
    return m.Fallback(code, reason_name(code), clip(detail), peer_diagnosis, after_decline)


LOCAL_ADDRESS_TTL = 2.0
"""Seconds an answer of :meth:`LocalAddresses.is_local` is reused (addresses come and go rarely;
a wildcard listener's clients would otherwise cost a socket and a bind each)."""


def _binds(ip: IpAddress, scope: int) -> bool:
    """Can a socket of this namespace bind to ``ip`` (on interface ``scope``, for IPv6)?"""
    v6 = ip.version == 6
    with socket.socket(socket.AF_INET6 if v6 else socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.bind((str(ip), 0, 0, scope) if v6 else (str(ip), 0))
        except OSError:
            return False
    return True


class LocalAddresses:
    """Is an address one of this network namespace's? (Binding to it succeeds only then.)"""

    MAX = 1024

    def __init__(self) -> None:
        self._known: dict[IpAddress, tuple[bool, float]] = {}

    def is_local(self, ip: IpAddress) -> bool:
        if ip.is_loopback:
            return True
        now = time.monotonic()
        known = self._known.get(ip)
        if known is not None and known[1] > now:
            return known[0]
        local = _binds(ip, 0)
        if not local and ip.version == 6 and ip.is_link_local:
            # A link-local address binds only with its interface's scope, which the callers do
            # not pass: it is ours when some interface of this namespace holds it.
            local = any(_binds(ip, index) for index, _ in socket.if_nameindex())
        if len(self._known) >= self.MAX:
            self._known.clear()
        self._known[ip] = (local, now + LOCAL_ADDRESS_TTL)
        return local


def configured_peer(peers: Sequence[IpNetwork], ip: IpAddress) -> IpNetwork | None:
    """The network of the configuration's ``peers`` holding ``ip`` (a daemon there proposes SMC
    whether or not peer detection runs), or None."""
    for net in peers:
        if ip.version == net.version and ip in net:
            return net
    return None
