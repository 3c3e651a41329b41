"""Ask for SMC's TCP option (RFC 7609) on a client socket's SYN, before ``connect()``.

When smcd runs its peer detection (BPF, see the daemon's ``adapters/bpf``), a private
``setsockopt(SOL_SMCD, SMCD_OPT_WANT, 1)`` on an unconnected TCP socket makes its SYN carry the
option kind 254 with magic 0xE2D4C3D9, as the kernel's AF_SMC does, and lets the daemon read
whether the peer's SYN-ACK answered with it. Only sockets that will be handed to smcd ask: a
kernel SMC server that sees the option waits for a CLC Proposal. Without a detector the kernel
answers ENOPROTOOPT and nothing changes (the daemon then uses its ``peers``).

A peer that answered with the option waits for CLC (a kernel AF_SMC server reads the first
bytes as a Proposal). When the library falls back without the daemon having touched the stream
(no daemon, a full handoff queue, a daemon lost before it read the request) it asks the
detector with ``getsockopt(SOL_SMCD, SMCD_OPT_STATE)`` (:func:`peer_waits_for_clc`) and then
writes a CLC Decline itself (:func:`clc_decline`), as the kernel's client declines before it
falls back: the peer consumes it and falls back too, and the stream stays clean.
"""

from __future__ import annotations

import _socket as _csocket
import errno
import os
import socket as _socket
import struct
import time
from typing import Any

__all__ = [
    "HANDOFF_MARK",
    "SMCD_OPT_STATE",
    "SMCD_OPT_WANT",
    "SOL_SMCD",
    "clc_decline",
    "create_connection",
    "peer_waits_for_clc",
    "request_option",
    "request_or_mark",
    "send_decline",
]

SOL_SMCD = 0x534D43  # the daemon's cgroup setsockopt program answers this level
SMCD_OPT_WANT = 1
SMCD_OPT_STATE = 2  # getsockopt: the socket's flags as the BPF program recorded them
_F_PEER, _F_DONE = 0x04, 0x08  # the peer's SYN-ACK carried the option; the handshake is done
_EYECATCHER = b"\xe2\xd4\xc3\xd9"  # "SMC-R" in EBCDIC: what the kernel writes in a Decline
_DECLINE = 4  # CLC message type
_OS_LINUX = 2  # SMC_CLC_OS_LINUX


# The C socket's plain ints (as smc_handoff.run): ``socket.socket.family``/``.type`` build enum
# members on every call, and this check runs on every connect.
_family_of = _csocket.socket.family.__get__
_type_of = _csocket.socket.type.__get__
_IP_FAMILIES = (int(_socket.AF_INET), int(_socket.AF_INET6))
_SOCK_STREAM = int(_socket.SOCK_STREAM)
_setsockopt = _csocket.socket.setsockopt

NO_DETECTOR_TTL = 1.0
"""Seconds a process skips the request after the kernel said ENOPROTOOPT (no detector loaded):
a failing setsockopt and its exception on every connect cost more than the connect's own
bookkeeping. Short, as smcd may load its detector at any time (a restart); a socket left
unmarked meanwhile is one whose SYN went out before the detector anyway: the daemon treats it
as it treats every connection without detection (its ``peers``)."""
_no_detector_until = 0.0

HANDOFF_MARK = (int(_socket.IPPROTO_IP), 24)  # IP_BIND_ADDRESS_NO_PORT
"""Without a detector, a socket that will be handed to smcd carries this instead: a same-host
server half that sees no Proposal asks the kernel (``sock_diag``) whether its client's socket
has it, and falls back at once for a plain client (the daemon's ``adapters/handoff_mark``).
Set before ``connect()`` here, and before the CONNECT on a socket that does not carry it yet
(``smc_handoff.wrap`` of a socket connected elsewhere): on a socket that is connected, or
bound already, it changes nothing; before a later ``bind`` to port 0 it only defers the
port's choice to ``connect()``."""


def request_option(sock: _socket.socket) -> bool:
    """Mark ``sock`` (TCP, not yet connected); True if a detector took the request. Never
    raises: ENOPROTOOPT (no detector, remembered for :data:`NO_DETECTOR_TTL`), EPERM (not an
    unconnected TCP socket) or anything else leave the socket as it was."""
    return _request(sock) is _TOOK


def request_or_mark(sock: _socket.socket) -> bool:
    """:func:`request_option`; True when ``sock`` carries :data:`HANDOFF_MARK` now (no detector
    took the request), so that the handoff need not set it again."""
    return _request(sock) is _MARKED


_TOOK, _MARKED, _NEITHER = "took", "marked", "neither"


def _request(sock: _socket.socket) -> str:
    global _no_detector_until
    if _family_of(sock) not in _IP_FAMILIES or _type_of(sock) != _SOCK_STREAM:
        return _NEITHER
    if _no_detector_until and time.monotonic() < _no_detector_until:
        return _marked(sock)
    try:
        _setsockopt(sock, SOL_SMCD, SMCD_OPT_WANT, 1)
    except OSError as e:
        if e.errno == errno.ENOPROTOOPT:
            _no_detector_until = time.monotonic() + NO_DETECTOR_TTL
        return _marked(sock)
    _no_detector_until = 0.0
    return _TOOK


def _marked(sock: _socket.socket) -> str:
    """No detector took the request: put :data:`HANDOFF_MARK` on the socket instead."""
    try:  # (every connect: contextlib.suppress would cost three calls more)
        _setsockopt(sock, *HANDOFF_MARK, 1)
    except OSError:
        return _NEITHER
    return _MARKED


def create_connection(
    address: tuple[str, int],
    timeout: float | None = None,
    source_address: tuple[str, int] | None = None,
) -> _socket.socket:
    """``socket.create_connection`` whose sockets ask for the SMC option before connecting."""
    host, port = address
    err: OSError | None = None
    for family, type_, proto, _, sa in _socket.getaddrinfo(host, port, 0, _socket.SOCK_STREAM):
        sock: Any = None
        try:
            sock = _socket.socket(family, type_, proto)
            if timeout is not None:
                sock.settimeout(timeout)
            if source_address:
                sock.bind(source_address)
            request_option(sock)
            sock.connect(sa)
            err = None
            return sock  # type: ignore[no-any-return]
        except OSError as e:
            err = e
            if sock is not None:
                sock.close()
    if err is not None:
        raise err
    raise OSError(f"getaddrinfo returned nothing for {host!r}")


def peer_waits_for_clc(sock: _socket.socket) -> bool:
    """Did the SYN-ACK of this (marked, connected) client socket carry the SMC option? False
    when no detector answers (ENOPROTOOPT) or nothing was recorded."""
    try:
        raw = _socket.socket.getsockopt(sock, SOL_SMCD, SMCD_OPT_STATE, 4)
    except OSError:
        return False
    if len(raw) != 4:
        return False
    flags = int.from_bytes(raw, "little")
    return flags & (_F_PEER | _F_DONE) == _F_PEER | _F_DONE


def clc_decline(code: int, version: int = 2) -> bytes:
    """A CLC Decline (``struct smc_clc_msg_decline``): v1 28 bytes, v2 44 (four zero
    diagnosis words, OS type Linux); id_for_peer zero, not out of sync; ``code`` the reason."""
    v2 = version >= 2
    length = 44 if v2 else 28
    head = _EYECATCHER + struct.pack(">BHB", _DECLINE, length, (2 if v2 else 1) << 4)
    body = bytes(8) + struct.pack(">IB3x", code, _OS_LINUX << 4 if v2 else 0)
    return head + body + (bytes(16) if v2 else b"") + _EYECATCHER


def send_decline(sock: _socket.socket, code: int) -> bool:
    """Write :func:`clc_decline` on the connected ``sock`` at once, without blocking (a fresh
    connection's send buffer takes it whole); False if it did not go out whole (the caller
    resets the connection: part of a Decline would corrupt the stream)."""
    data = clc_decline(code)
    try:
        with _socket.socket(fileno=os.dup(_socket.socket.fileno(sock))) as dup:
            sent = dup.send(data, _socket.MSG_DONTWAIT | _socket.MSG_NOSIGNAL)
    except OSError:
        return False
    return sent == len(data)
