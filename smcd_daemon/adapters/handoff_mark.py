"""Is the client of a same-host connection one that hands its socket to smcd?

Without peer detection (no BPF: the daemon started without a configuration) a server half
cannot see SMC's TCP option on the client's SYN, so a silent client is either an smcd client
whose CONNECT is still on its way or a plain TCP client waiting for the server to speak first
(SMTP, FTP and SSH banners). Waiting ``timeouts.local_client_wait`` for every such plain client
cost 0.2 s per connection.

The client library marks a socket it will hand over with ``IP_BIND_ADDRESS_NO_PORT``
(:data:`smc_handoff.peer_option.HANDOFF_MARK`): before ``connect()`` under smc-run, and again
just before its CONNECT (``smc_handoff.wrap``). On a connected socket the option changes
nothing (before a later ``bind`` to port 0 it only defers the port's choice to ``connect``),
and the kernel shows it to any process of the namespace in ``sock_diag``'s
``INET_DIAG_SOCKOPT`` (Linux 5.10+; no privilege needed). So when the client's socket is on
this host, in this daemon's namespace, and carries no mark after a short grace, its program is
not handing it over: the server half falls back at once. A socket that carries the mark, one
this daemon cannot see (another namespace, an older kernel) or a lookup that fails leave the
wait as it was; a plain program that sets the option itself only waits as before.

The codec (:func:`encode_request`, :func:`decode_mark`) is pure; :class:`HandoffMarks` is the
netlink socket around it.
"""

from __future__ import annotations

import ipaddress
import socket
import struct

__all__ = ["HandoffMarks", "decode_mark", "encode_request"]

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST = 1
INET_DIAG_SOCKOPT = 22
"""``struct inet_diag_sockopt``: two bytes of bit fields; ``bind_address_no_port`` is the first
bit of the second."""
_NO_COOKIE = 0xFFFFFFFF
_ALL_STATES = 0xFFF
_SO_NETNS_COOKIE = 71
_NLMSG = struct.Struct("=IHHII")
_REQ = struct.Struct("=BBBBI")
_PORTS = struct.Struct("!HH")
_TAIL = struct.Struct("=III")
_ATTR = struct.Struct("=HH")
_DIAG_MSG_LEN = 72
"""``struct inet_diag_msg``, after which the attributes start."""
_U64 = struct.Struct("=Q")

Address = tuple[str, int]


def encode_request(src: Address, dst: Address, seq: int = 1) -> bytes:
    """A ``SOCK_DIAG_BY_FAMILY`` request for the one TCP socket whose local end is ``src`` and
    whose peer is ``dst`` (an exact lookup, not a dump)."""
    family = socket.AF_INET6 if ipaddress.ip_address(src[0]).version == 6 else socket.AF_INET
    body = b"".join(
        (
            _REQ.pack(family, socket.IPPROTO_TCP, 0, 0, _ALL_STATES),
            _PORTS.pack(src[1], dst[1]),
            socket.inet_pton(family, src[0]).ljust(16, b"\0"),
            socket.inet_pton(family, dst[0]).ljust(16, b"\0"),
            _TAIL.pack(0, _NO_COOKIE, _NO_COOKIE),
        )
    )
    return _NLMSG.pack(_NLMSG.size + len(body), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST, seq, 0) + body


def decode_mark(reply: bytes) -> bool | None:
    """From the kernel's answer to :func:`encode_request`: does the socket carry the mark?
    None when the answer is an error (no such socket here) or says nothing about it."""
    if len(reply) < _NLMSG.size:
        return None
    length, kind, _flags, _seq, _pid = _NLMSG.unpack_from(reply)
    if kind != SOCK_DIAG_BY_FAMILY or length > len(reply):
        return None
    off = _NLMSG.size + _DIAG_MSG_LEN
    while off + _ATTR.size <= length:
        alen, atype = _ATTR.unpack_from(reply, off)
        if alen < _ATTR.size or off + alen > length:
            return None
        if atype == INET_DIAG_SOCKOPT:
            if alen < _ATTR.size + 2:
                return None
            return bool(reply[off + _ATTR.size + 1] & 1)
        off += (alen + 3) & ~3
    return None


def _netns_cookie(sock: socket.socket) -> int | None:
    try:
        return int(_U64.unpack(sock.getsockopt(socket.SOL_SOCKET, _SO_NETNS_COOKIE, 8))[0])
    except (OSError, struct.error):
        return None


class HandoffMarks:
    """The daemon's ``sock_diag`` socket, opened on first use."""

    def __init__(self) -> None:
        self._sock: socket.socket | None = None
        self._own_ns: int | None = None
        self._seq = 0

    def client_marked(self, server: socket.socket, client: Address, local: Address) -> bool | None:
        """Does the client end (``client`` → ``local``) of ``server``'s connection carry the
        handoff mark? Asked only of a connection in this daemon's namespace (another's
        4-tuples may repeat here); None when that is not so or the kernel does not say."""
        try:
            if self._sock is None:
                self._sock = socket.socket(
                    socket.AF_NETLINK, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC, NETLINK_SOCK_DIAG
                )
                self._sock.settimeout(1.0)
                self._own_ns = _netns_cookie(self._sock)
            ns = _netns_cookie(server)
            if ns is None or ns != self._own_ns:
                return None
            self._seq = (self._seq + 1) & 0x7FFFFFFF
            self._sock.send(encode_request(client, local, self._seq))
            return decode_mark(self._sock.recv(8192))
        except (OSError, ValueError):
            return None

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
