"""Ask for SMC's TCP option (RFC 7609) on a client socket's SYN, before ``connect()``.

When smcd runs its peer detection (BPF, see the daemon's ``adapters/bpf``), a private
``setsockopt(SOL_SMCD, SMCD_OPT_WANT, 1)`` on an unconnected TCP socket makes its SYN carry the
option kind 254 with magic 0xE2D4C3D9, as the kernel's AF_SMC does, and lets the daemon read
whether the peer's SYN-ACK answered with it. Only sockets that will be handed to smcd ask: a
kernel SMC server that sees the option waits for a CLC Proposal. Without a detector the kernel
answers ENOPROTOOPT and nothing changes (the daemon then uses its ``peers``).
"""

from __future__ import annotations

import socket as _socket
from typing import Any

__all__ = ["SMCD_OPT_WANT", "SOL_SMCD", "create_connection", "request_option"]

SOL_SMCD = 0x534D43  # the daemon's cgroup setsockopt program answers this level
SMCD_OPT_WANT = 1


def request_option(sock: _socket.socket) -> bool:
    """Mark ``sock`` (TCP, not yet connected); True if a detector took the request. Never
    raises: ENOPROTOOPT (no detector), EPERM (not an unconnected TCP socket) or anything else
    leave the socket as it was."""
    if sock.family not in (_socket.AF_INET, _socket.AF_INET6) or sock.type != _socket.SOCK_STREAM:
        return False
    try:
        sock.setsockopt(SOL_SMCD, SMCD_OPT_WANT, 1)
    except OSError:
        return False
    return True


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
