"""The handoff protocol: how an application hands a TCP socket to smcd and gets a channel back.

This module is the protocol's definition. The client library (``smc_handoff.socket``) and the
daemon (``smcd_daemon.adapters.handoff``) both encode and decode with it, so there is one source
of truth; everything below is normative.

Transport
=========
An ``AF_UNIX`` ``SOCK_SEQPACKET`` socket (so message boundaries and ``SCM_RIGHTS`` descriptors
arrive intact, and a process death is seen as a hang-up). Where the client looks
(:func:`handoff_socket_candidates`):

1. ``$SMCD_HANDOFF_SOCKET`` if set (then only that path);
2. otherwise the per-user default ``$XDG_RUNTIME_DIR/smcd/handoff.sock`` (``<tmp>/smcd-<uid>/
   handoff.sock`` without ``XDG_RUNTIME_DIR``, as ``smcd_daemon.config`` computes it), then the
   system-wide ``/run/smcd/handoff.sock``.

The first path that accepts a connection is used. The client checks ``SO_PEERCRED``: the daemon
must run as root or as the client's own uid, otherwise the connection is dropped (another user
squatting a predictable path must never receive our sockets). The daemon checks ``SO_PEERCRED``
on every request and applies the per-user limits.

Connections
===========
One SEQPACKET connection per SMC connection (plus one per registered listener). It stays open for
the life of what it registered: the daemon learns about closes and process deaths through it (a
hang-up means the process let go of everything registered on that connection), and rebuilds its
registry from it after a restart (RESUME). Exactly one request opens a connection: CONNECT,
ACCEPT, LISTEN or RESUME. After a CHANNEL reply the client may only send SHUTDOWN and CLOSE
notices on it; after OK to LISTEN nothing; after FALLBACK or ERROR the client closes it.

Framing
=======
Every datagram is one message: a 12-byte header, then the body. All integers are unsigned,
big-endian (network order). A datagram is at most :data:`MAX_MESSAGE` (4096) bytes::

    offset size field
    0      4    magic     b"SMCH"
    4      1    version   1 (:data:`VERSION`)
    5      1    type      MessageType
    6      2    flags     0 (reserved in version 1; non-zero is rejected)
    8      4    length    body length in bytes; must equal datagram length - 12

Strings (``str16``) are a u16 byte length followed by that many bytes of UTF-8 (strict; no NUL),
at most :data:`MAX_TEXT` (1024) bytes. Reason names (``name16``) are ``str16`` restricted to
``[A-Za-z0-9_]{1,64}``. Sizes (``dmb_size``, ``rx_size``, ``tx_size``) are the whole DMB in bytes
(32-byte CDC header included): ``16 KiB << n`` with ``n`` in 0..6 (16 KiB .. 1 MiB, the SMC-D
DMB sizes, Linux ``SMCD_DMBE_SIZES``); ``dmb_size`` 0 means "the daemon's choice". A DMB memfd is
``size + 128`` bytes long: smcd's control trailer (wakeup words, ``smc_handoff.layout``) follows
the DMB proper. Bodies have exactly the length their fields add up to; trailing bytes are an
error. Enumerations: ``Mode`` 1 = smcd (SMC-D, loopback-ism), 2 = smcr (SMC-R); ``Role``
1 = client, 2 = server; ``ErrorCode`` 1 MALFORMED, 2 OVERSIZED, 3 UNSUPPORTED_VERSION,
4 UNSUPPORTED_TYPE, 5 BAD_FDS, 6 BAD_STATE (valid but not allowed now, e.g. a second CONNECT),
7 DENIED (policy for this caller), 8 INTERNAL (the daemon failed; TCP untouched).

Messages
========
Requests (client → daemon; types below 0x80) and replies (daemon → client; 0x80 and above). The
descriptor column is the exact ``SCM_RIGHTS`` list, in order; any other count is an error.

``CONNECT`` 0x01 — the client half of a connected TCP socket. fds: ``[tcp]``.
    body: ``dmb_size u32`` (the receive buffer the client would like; a hint the daemon bounds
    by its config). The daemon tries SMC only toward peers known to speak it (a same-host
    listener registered with LISTEN, or a network of the config's ``peers``); otherwise it
    replies FALLBACK ``PEERNOSMC`` (0x03010000) before writing a byte. Loopback pairs a CONNECT
    with the ACCEPT whose TCP 4-tuple mirrors it (both halves held by this daemon), never by
    GID alone. Replies: CHANNEL, FALLBACK, ERROR.
``ACCEPT`` 0x02 — the server half of an accepted TCP socket. fds: ``[tcp]``.
    body: ``dmb_size u32``. The daemon ``MSG_PEEK``\\ s for a CLC Proposal eyecatcher with a
    bounded wait (config ``timeouts.proposal_wait``); a plain TCP client (including one that
    sends nothing first) is handed back untouched with FALLBACK. Replies: CHANNEL, FALLBACK,
    ERROR.
``LISTEN`` 0x03 — register an SMC-enabled listener for same-host clients. fds: ``[listener]``
    (the listening TCP socket itself, so the daemon reads its address with ``getsockname`` and
    checks ``SO_ACCEPTCONN`` instead of trusting a claimed address; it keeps no copy).
    body: empty. The registration lives as long as this SEQPACKET connection.
    Replies: OK (``ident`` = listener id), FALLBACK (not registered; the listener works on TCP),
    ERROR.
``RESUME`` 0x04 — after a daemon restart, re-register a live channel so the registry (smcctl
    conns, quotas) is rebuilt; best effort: the channel itself never depended on the daemon.
    fds: ``[tcp]``. body: ``conn_id u64`` (the id of the old CHANNEL reply), ``role u8``
    (Role: 1 client, 2 server), ``mode u8`` (Mode), ``reserved u16`` (0), ``rx_size u32``,
    ``tx_size u32``, ``bytes_sent u64``, ``bytes_received u64`` (36 bytes). The daemon pairs
    the two halves again by the TCP 4-tuple. The restarted daemon holds no copy of those DMBs:
    their memory is freed when both applications have unmapped them, and it only counts their
    sizes against the quota. The library sends RESUME without waiting: it
    notices the old daemon's hang-up on its control connection when it is about to wait for
    the channel (at most once a second) and reads the reply later. Replies: OK (``ident`` =
    the new connection id), ERROR.
``SHUTDOWN`` 0x05 — notice: the application called ``shutdown(how)``. No fds, no reply.
    body: ``how u8`` (0 SHUT_RD, 1 SHUT_WR, 2 SHUT_RDWR).
``CLOSE`` 0x06 — notice: the application closed the channel (then closes this connection).
    Optional: the hang-up alone tells the daemon the same (it reads the final counters from the
    DMBs), so the library's ``close()`` just hangs up, saving a message per connection; it
    sends CLOSE only when a socket leaves its channel before any data (``detach``). No fds, no
    reply.
    body: ``aborted u8`` (0 clean close, 1 abort: unread data or reset),
    ``bytes_sent u64``, ``bytes_received u64`` (17 bytes), for the registry and stats.

``CHANNEL`` 0x81 — SMC is established. fds: ``[rx_dmb, tx_dmb, rx_eventfd, tx_eventfd,
    peer_link]`` (this end's receive DMB memfd, the peer's DMB this end writes into, the eventfd
    this end sleeps on, the eventfd that wakes the peer, this end of the peer-link
    ``SOCK_SEQPACKET`` socketpair). body: ``conn_id u64`` (non-zero), ``mode u8`` (Mode),
    ``rx_size u32``, ``tx_size u32`` (17 bytes). The daemon keeps no copy of the peer link.
``FALLBACK`` 0x82 — SMC is not used; the TCP socket is the application's again, unchanged (no
    byte was consumed or written on it that the application would see). No fds. ``name`` is
    the kernel's symbolic name without ``SMC_CLC_DECL_`` (e.g. ``PEERNOSMC``).
    body: ``code u32`` (a CLC decline / fallback reason code, e.g. 0x03010000 PEERNOSMC,
    0x030D0000 MAX_DMB when past the per-user quota), ``flags u8`` (bit 0: a peer diagnosis is
    present; other bits 0), ``peer_diagnosis u32`` (the code of the peer's CLC Decline, 0 when
    absent), ``name name16``, ``explanation str16``.
``ERROR`` 0x83 — the request was refused; nothing was done with its descriptors (the daemon
    closed its copies) and the TCP connection is untouched. No fds. body: ``code u16``
    (ErrorCode), ``message str16``. The ERROR layout is frozen for all versions, so that any
    client can read the answer to a version it does not speak. After an ERROR reply to a
    malformed request the daemon closes the connection.
``OK`` 0x84 — success of LISTEN or RESUME. No fds. body: ``ident u64``.

Rules for both ends
===================
- Bounded: receivers read with a buffer of ``MAX_MESSAGE + 1`` bytes and room for
  :data:`MAX_FDS` descriptors; a truncated datagram (``MSG_TRUNC``) is OVERSIZED, truncated
  ancillary data (``MSG_CTRUNC``) is BAD_FDS. Descriptors are received close-on-exec.
- Strict: wrong magic, an unknown type, non-zero reserved bits, a length mismatch, a value out of
  range, invalid UTF-8 or a wrong descriptor count make the message invalid
  (:class:`HandoffProtocolError`, whose ``code`` is the ERROR code to answer with). Every
  descriptor that came with an invalid message is closed at once.
- A version the receiver does not speak is :class:`HandoffVersionError`; the daemon answers ERROR
  UNSUPPORTED_VERSION with its own version in the header.
- The daemon never lets an invalid request end the daemon or touch other connections: it answers
  ERROR, logs, closes that connection and carries on.
- Before replying to CONNECT/ACCEPT the daemon closes every copy of the TCP descriptor it
  borrowed (so the application's ``close()`` really closes the TCP connection) and leaves the
  descriptor's file status flags as it found them (``O_NONBLOCK`` is shared by all copies); the
  library re-applies its own blocking mode after every reply anyway.
- The daemon answers CONNECT/ACCEPT within its CLC timeouts; the client waits
  :data:`HANDOFF_TIMEOUT` seconds (``$SMCD_HANDOFF_TIMEOUT`` overrides). No daemon at the path,
  a refused connection, an untrusted daemon, a timeout, an ERROR or an invalid reply all degrade
  to TCP: the library reports the fallback with the local codes
  :data:`FALLBACK_DAEMON_UNAVAILABLE` (0xFF000001) / :data:`FALLBACK_DAEMON_ERROR` (0xFF000002)
  (class 0xFF, never used by the kernel), so an application never breaks because smcd is absent
  or broken. On a CPU that cannot run the channel the library does not even ask
  (:data:`FALLBACK_CHANNEL_UNSUPPORTED`, 0xFF000003); a socket the application detaches before
  any data moved (``ssl`` does) continues on TCP (:data:`FALLBACK_DETACHED`, 0xFF000004).
- A CHANNEL reply commits both ends: the TCP stream has carried CLC, so there is no way back
  to TCP; descriptors the library cannot use make the socket fail with ECONNRESET.
"""

from __future__ import annotations

import array
import contextlib
import enum
import os
import re
import socket
import struct
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

__all__ = [
    "FALLBACK_CHANNEL_UNSUPPORTED",
    "FALLBACK_DAEMON_ERROR",
    "FALLBACK_DAEMON_UNAVAILABLE",
    "FALLBACK_DETACHED",
    "FD_NAMES",
    "HANDOFF_TIMEOUT",
    "HEADER",
    "MAGIC",
    "MAX_FDS",
    "MAX_MESSAGE",
    "MAX_TEXT",
    "SYSTEM_HANDOFF_SOCKET",
    "VERSION",
    "Accept",
    "Channel",
    "Close",
    "Connect",
    "Error",
    "ErrorCode",
    "Fallback",
    "HandoffClosedError",
    "HandoffError",
    "HandoffProtocolError",
    "HandoffVersionError",
    "Listen",
    "Message",
    "MessageType",
    "Mode",
    "Ok",
    "Reply",
    "Request",
    "Resume",
    "Role",
    "Shutdown",
    "close_fds",
    "daemon_error",
    "daemon_unavailable",
    "decode",
    "decode_reply",
    "decode_request",
    "encode",
    "handoff_socket_candidates",
    "handoff_timeout",
    "recv_message",
    "send_message",
    "valid_dmb_size",
]

MAGIC = b"SMCH"
VERSION = 1
HEADER = struct.Struct("!4sBBHI")
"""magic, version, type, flags, body length (12 bytes)."""
MAX_MESSAGE = 4096
"""Largest datagram (header + body), both directions."""
MAX_TEXT = 1024
"""Largest string field, in UTF-8 bytes."""
MAX_FDS = 8
"""Descriptors a receiver makes room for (the largest message carries 5)."""
HANDOFF_TIMEOUT = 10.0
"""Seconds a client waits for the reply to CONNECT/ACCEPT/LISTEN/RESUME (daemon CLC timeouts are
6 s + the 1 s proposal wait by default)."""
SYSTEM_HANDOFF_SOCKET = Path("/run/smcd/handoff.sock")

FALLBACK_DAEMON_UNAVAILABLE = 0xFF000001
"""Local fallback code (not a kernel code; class 0xFF = smc_handoff): no daemon answered."""
FALLBACK_DAEMON_ERROR = 0xFF000002
"""Local fallback code: a daemon answered but refused the request or answered nonsense."""
FALLBACK_CHANNEL_UNSUPPORTED = 0xFF000003
"""Local fallback code: this CPU cannot run the shared-memory channel (not asked of the daemon)."""
FALLBACK_DETACHED = 0xFF000004
"""Local fallback code: the application detached the TCP socket (e.g. for ``ssl``) before any
data moved over the channel, which was then closed."""

_SMCD_MIN_DMB = 16 * 1024
_NAME_RE = re.compile(r"[A-Za-z0-9_]{1,64}")


class HandoffError(Exception):
    """Root of the smc_handoff errors (the library is stdlib-only: not an ``SmcError``)."""


class ErrorCode(enum.IntEnum):
    """ERROR reply codes; also the ``code`` of a :class:`HandoffProtocolError`."""

    MALFORMED = 1
    """The datagram is not a valid message (framing, field values, direction)."""
    OVERSIZED = 2
    """Longer than :data:`MAX_MESSAGE`."""
    UNSUPPORTED_VERSION = 3
    UNSUPPORTED_TYPE = 4
    BAD_FDS = 5
    """Wrong descriptor count or kind, or truncated ancillary data."""
    BAD_STATE = 6
    """A valid message that is not allowed now (e.g. a second CONNECT on one connection)."""
    DENIED = 7
    """Refused by policy for this caller (SO_PEERCRED)."""
    INTERNAL = 8
    """The daemon failed; the TCP connection was not touched."""


class HandoffProtocolError(HandoffError):
    """A message that breaks the protocol; ``code`` is the ERROR code to answer it with."""

    def __init__(self, message: str, code: ErrorCode = ErrorCode.MALFORMED) -> None:
        super().__init__(message)
        self.code = code


class HandoffVersionError(HandoffProtocolError):
    """A version this end does not speak (``version`` is the one received)."""

    def __init__(self, version: int) -> None:
        super().__init__(
            f"unsupported handoff protocol version {version} (this end speaks {VERSION})",
            ErrorCode.UNSUPPORTED_VERSION,
        )
        self.version = version


class HandoffClosedError(HandoffError, ConnectionError):
    """The other end closed the handoff connection (EOF where a message was expected)."""


class MessageType(enum.IntEnum):
    CONNECT = 0x01
    ACCEPT = 0x02
    LISTEN = 0x03
    RESUME = 0x04
    SHUTDOWN = 0x05
    CLOSE = 0x06
    CHANNEL = 0x81
    FALLBACK = 0x82
    ERROR = 0x83
    OK = 0x84

    @property
    def is_request(self) -> bool:
        return self < 0x80


class Mode(enum.IntEnum):
    """What carries the data of a channel (the ``.mode`` string is the lower-case name)."""

    SMCD = 1
    SMCR = 2


class Role(enum.IntEnum):
    CLIENT = 1
    SERVER = 2


FD_NAMES: Mapping[MessageType, tuple[str, ...]] = {
    MessageType.CONNECT: ("tcp",),
    MessageType.ACCEPT: ("tcp",),
    MessageType.LISTEN: ("listener",),
    MessageType.RESUME: ("tcp",),
    MessageType.SHUTDOWN: (),
    MessageType.CLOSE: (),
    MessageType.CHANNEL: ("rx_dmb", "tx_dmb", "rx_eventfd", "tx_eventfd", "peer_link"),
    MessageType.FALLBACK: (),
    MessageType.ERROR: (),
    MessageType.OK: (),
}
"""The exact descriptor list of each message type, in ``SCM_RIGHTS`` order."""


_DMB_SIZES = frozenset(_SMCD_MIN_DMB << n for n in range(7))


def valid_dmb_size(size: int) -> bool:
    """True for the SMC-D DMB sizes: 16 KiB << n, n = 0..6 (as ``layout.DMB_SIZES``)."""
    return size in _DMB_SIZES


# --- field helpers ----------------------------------------------------------------------------


def _check_uint(name: str, value: int, bits: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < (1 << bits):
        raise ValueError(f"{name} must be an integer 0..{(1 << bits) - 1}, not {value!r}")


def _check_size(name: str, value: int, *, zero_ok: bool) -> None:
    _check_uint(name, value, 32)
    if not (valid_dmb_size(value) or (zero_ok and value == 0)):
        raise ValueError(f"{name} must be 16 KiB << n (n = 0..6){' or 0' if zero_ok else ''}")


def _check_text(name: str, value: str, *, is_name: bool = False) -> None:
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a str")
    if len(value.encode("utf-8")) > MAX_TEXT:
        raise ValueError(f"{name} is longer than {MAX_TEXT} UTF-8 bytes")
    if "\x00" in value:
        raise ValueError(f"{name} must not contain NUL")
    if is_name and not _NAME_RE.fullmatch(value):
        raise ValueError(f"{name} must match [A-Za-z0-9_]{{1,64}}, not {value!r}")


def _str16(value: str) -> bytes:
    raw = value.encode("utf-8")
    return struct.pack("!H", len(raw)) + raw


_STRUCTS: dict[str, struct.Struct] = {}
"""Compiled body layouts, by format (a handful; every handoff parses a few)."""


class _Reader:
    """Strict cursor over a body: every read is bounds-checked, leftovers are an error."""

    def __init__(self, data: bytes, what: str) -> None:
        self.data = data
        self.pos = 0
        self.what = what

    def take(self, fmt: str) -> tuple[int, ...]:
        st = _STRUCTS.get(fmt)
        if st is None:
            st = _STRUCTS[fmt] = struct.Struct("!" + fmt)
        if self.pos + st.size > len(self.data):
            raise HandoffProtocolError(
                f"{self.what}: body truncated at byte {self.pos} (need {st.size} more)"
            )
        values = st.unpack_from(self.data, self.pos)
        self.pos += st.size
        return values

    def text(self, field: str, *, is_name: bool = False) -> str:
        (n,) = self.take("H")
        if n > MAX_TEXT:
            raise HandoffProtocolError(f"{self.what}: {field} is {n} bytes (limit {MAX_TEXT})")
        if self.pos + n > len(self.data):
            raise HandoffProtocolError(f"{self.what}: {field} truncated")
        raw = self.data[self.pos : self.pos + n]
        self.pos += n
        try:
            value = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise HandoffProtocolError(
                f"{self.what}: {field} is not UTF-8 ({e.reason} at byte {e.start})"
            ) from None
        if "\x00" in value:
            raise HandoffProtocolError(f"{self.what}: {field} contains NUL")
        if is_name and not _NAME_RE.fullmatch(value):
            raise HandoffProtocolError(f"{self.what}: {field} {value!r} is not a reason name")
        return value

    def end(self) -> None:
        if self.pos != len(self.data):
            raise HandoffProtocolError(
                f"{self.what}: {len(self.data) - self.pos} unexpected trailing bytes"
            )


def _field_error(what: str, e: ValueError) -> HandoffProtocolError:
    return HandoffProtocolError(f"{what}: {e}")


# --- messages ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Connect:
    """CONNECT: hand over the client half of a TCP connection (fds: tcp)."""

    dmb_size: int = 0
    TYPE: ClassVar[MessageType] = MessageType.CONNECT

    def __post_init__(self) -> None:
        _check_size("dmb_size", self.dmb_size, zero_ok=True)

    def body(self) -> bytes:
        return struct.pack("!I", self.dmb_size)

    @classmethod
    def parse(cls, r: _Reader) -> Connect:
        (size,) = r.take("I")
        return cls(size)


@dataclass(frozen=True)
class Accept:
    """ACCEPT: hand over the server half of a TCP connection (fds: tcp)."""

    dmb_size: int = 0
    TYPE: ClassVar[MessageType] = MessageType.ACCEPT

    def __post_init__(self) -> None:
        _check_size("dmb_size", self.dmb_size, zero_ok=True)

    def body(self) -> bytes:
        return struct.pack("!I", self.dmb_size)

    @classmethod
    def parse(cls, r: _Reader) -> Accept:
        (size,) = r.take("I")
        return cls(size)


@dataclass(frozen=True)
class Listen:
    """LISTEN: register an SMC-enabled listening socket (fds: listener)."""

    TYPE: ClassVar[MessageType] = MessageType.LISTEN

    def body(self) -> bytes:
        return b""

    @classmethod
    def parse(cls, r: _Reader) -> Listen:
        return cls()


@dataclass(frozen=True)
class Resume:
    """RESUME: re-register a live channel after a daemon restart (fds: tcp)."""

    conn_id: int
    role: Role
    mode: Mode
    rx_size: int
    tx_size: int
    bytes_sent: int = 0
    bytes_received: int = 0
    TYPE: ClassVar[MessageType] = MessageType.RESUME

    def __post_init__(self) -> None:
        _check_uint("conn_id", self.conn_id, 64)
        object.__setattr__(self, "role", Role(self.role))
        object.__setattr__(self, "mode", Mode(self.mode))
        _check_size("rx_size", self.rx_size, zero_ok=False)
        _check_size("tx_size", self.tx_size, zero_ok=False)
        _check_uint("bytes_sent", self.bytes_sent, 64)
        _check_uint("bytes_received", self.bytes_received, 64)

    def body(self) -> bytes:
        return struct.pack(
            "!QBBHIIQQ",
            self.conn_id,
            self.role,
            self.mode,
            0,
            self.rx_size,
            self.tx_size,
            self.bytes_sent,
            self.bytes_received,
        )

    @classmethod
    def parse(cls, r: _Reader) -> Resume:
        conn_id, role, mode, reserved, rx, tx, sent, received = r.take("QBBHIIQQ")
        if reserved:
            raise HandoffProtocolError("RESUME: reserved bytes must be 0")
        return cls(conn_id, role, mode, rx, tx, sent, received)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Shutdown:
    """SHUTDOWN notice: the application shut down reading/writing (``socket.SHUT_*``)."""

    how: int
    TYPE: ClassVar[MessageType] = MessageType.SHUTDOWN

    def __post_init__(self) -> None:
        _check_uint("how", self.how, 8)
        if self.how not in (socket.SHUT_RD, socket.SHUT_WR, socket.SHUT_RDWR):
            raise ValueError(f"how must be SHUT_RD, SHUT_WR or SHUT_RDWR, not {self.how}")

    def body(self) -> bytes:
        return struct.pack("!B", self.how)

    @classmethod
    def parse(cls, r: _Reader) -> Shutdown:
        (how,) = r.take("B")
        return cls(how)


@dataclass(frozen=True)
class Close:
    """CLOSE notice: the application closed (or aborted) the channel."""

    aborted: bool = False
    bytes_sent: int = 0
    bytes_received: int = 0
    TYPE: ClassVar[MessageType] = MessageType.CLOSE

    def __post_init__(self) -> None:
        if not isinstance(self.aborted, bool):
            raise ValueError("aborted must be a bool")
        _check_uint("bytes_sent", self.bytes_sent, 64)
        _check_uint("bytes_received", self.bytes_received, 64)

    def body(self) -> bytes:
        return struct.pack("!BQQ", int(self.aborted), self.bytes_sent, self.bytes_received)

    @classmethod
    def parse(cls, r: _Reader) -> Close:
        aborted, sent, received = r.take("BQQ")
        if aborted > 1:
            raise HandoffProtocolError("CLOSE: aborted must be 0 or 1")
        return cls(bool(aborted), sent, received)


@dataclass(frozen=True)
class Channel:
    """CHANNEL reply (fds: rx_dmb, tx_dmb, rx_eventfd, tx_eventfd, peer_link)."""

    conn_id: int
    mode: Mode
    rx_size: int
    tx_size: int
    TYPE: ClassVar[MessageType] = MessageType.CHANNEL

    def __post_init__(self) -> None:
        _check_uint("conn_id", self.conn_id, 64)
        if self.conn_id == 0:
            raise ValueError("conn_id must not be 0")
        object.__setattr__(self, "mode", Mode(self.mode))
        _check_size("rx_size", self.rx_size, zero_ok=False)
        _check_size("tx_size", self.tx_size, zero_ok=False)

    def body(self) -> bytes:
        return struct.pack("!QBII", self.conn_id, self.mode, self.rx_size, self.tx_size)

    @classmethod
    def parse(cls, r: _Reader) -> Channel:
        conn_id, mode, rx, tx = r.take("QBII")
        return cls(conn_id, mode, rx, tx)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Fallback:
    """FALLBACK reply, and the ``.fallback`` of a socket that stayed on TCP.

    ``code`` is the CLC decline / fallback reason (kernel numbering, or the local class 0xFF
    codes), ``name`` its symbolic name, ``explanation`` a sentence for humans, and
    ``peer_diagnosis`` the code the peer put in its CLC Decline (None when the peer sent none).
    """

    code: int
    name: str
    explanation: str
    peer_diagnosis: int | None = None
    TYPE: ClassVar[MessageType] = MessageType.FALLBACK

    def __post_init__(self) -> None:
        _check_uint("code", self.code, 32)
        _check_text("name", self.name, is_name=True)
        _check_text("explanation", self.explanation)
        if self.peer_diagnosis is not None:
            _check_uint("peer_diagnosis", self.peer_diagnosis, 32)

    def body(self) -> bytes:
        has = self.peer_diagnosis is not None
        return (
            struct.pack("!IBI", self.code, int(has), self.peer_diagnosis or 0)
            + _str16(self.name)
            + _str16(self.explanation)
        )

    @classmethod
    def parse(cls, r: _Reader) -> Fallback:
        code, flags, diag = r.take("IBI")
        if flags & ~1:
            raise HandoffProtocolError("FALLBACK: unknown flag bits")
        if not flags & 1 and diag:
            raise HandoffProtocolError("FALLBACK: peer_diagnosis set without its flag")
        name = r.text("name", is_name=True)
        explanation = r.text("explanation")
        return cls(code, name, explanation, diag if flags & 1 else None)

    def __str__(self) -> str:
        peer = (
            "" if self.peer_diagnosis is None else f", peer diagnosis 0x{self.peer_diagnosis:08x}"
        )
        return f"{self.name} (0x{self.code:08x}{peer}): {self.explanation}"


@dataclass(frozen=True)
class Error:
    """ERROR reply (layout frozen across versions)."""

    code: ErrorCode
    message: str
    TYPE: ClassVar[MessageType] = MessageType.ERROR

    def __post_init__(self) -> None:
        object.__setattr__(self, "code", ErrorCode(self.code))
        _check_text("message", self.message)

    def body(self) -> bytes:
        return struct.pack("!H", self.code) + _str16(self.message)

    @classmethod
    def parse(cls, r: _Reader) -> Error:
        (code,) = r.take("H")
        if code not in ErrorCode._value2member_map_:
            raise HandoffProtocolError(f"ERROR: unknown error code {code}")
        return cls(ErrorCode(code), r.text("message"))


@dataclass(frozen=True)
class Ok:
    """OK reply to LISTEN (listener id) or RESUME (new connection id)."""

    ident: int = 0
    TYPE: ClassVar[MessageType] = MessageType.OK

    def __post_init__(self) -> None:
        _check_uint("ident", self.ident, 64)

    def body(self) -> bytes:
        return struct.pack("!Q", self.ident)

    @classmethod
    def parse(cls, r: _Reader) -> Ok:
        (ident,) = r.take("Q")
        return cls(ident)


Request = Connect | Accept | Listen | Resume | Shutdown | Close
Reply = Channel | Fallback | Error | Ok
Message = Request | Reply

_CLASSES: dict[MessageType, type[Message]] = {
    cls.TYPE: cls
    for cls in (Connect, Accept, Listen, Resume, Shutdown, Close, Channel, Fallback, Error, Ok)
}


_CLASSES_BY_VALUE: dict[int, type[Message]] = {int(t): c for t, c in _CLASSES.items()}
# Per class, what every message sent or received needs: its type's name (an enum ``.name`` is a
# Python-level descriptor) and its exact descriptor count.
_NAMES: dict[type[Message], str] = {c: t.name for t, c in _CLASSES.items()}
_FD_COUNTS: dict[type[Message], int] = {c: len(FD_NAMES[t]) for t, c in _CLASSES.items()}


def daemon_unavailable(detail: str) -> Fallback:
    """The fallback reported when no (trustworthy) daemon answered."""
    return Fallback(
        FALLBACK_DAEMON_UNAVAILABLE,
        "DAEMON_UNAVAILABLE",
        _clip(f"daemon unavailable: {detail}"),
    )


def daemon_error(detail: str) -> Fallback:
    """The fallback reported when the daemon refused the request or answered nonsense."""
    return Fallback(FALLBACK_DAEMON_ERROR, "DAEMON_ERROR", _clip(f"daemon error: {detail}"))


def _clip(text: str) -> str:
    """``text`` without NULs, cut to at most :data:`MAX_TEXT` UTF-8 bytes."""
    raw = text.replace("\x00", "?").encode("utf-8", "replace")[:MAX_TEXT]
    return raw.decode("utf-8", "ignore")


# --- codec ------------------------------------------------------------------------------------


def encode(msg: Message, *, version: int = VERSION) -> bytes:
    """The datagram for ``msg`` (header + body)."""
    body = msg.body()
    data = HEADER.pack(MAGIC, version, msg.TYPE, 0, len(body)) + body
    if len(data) > MAX_MESSAGE:
        raise ValueError(f"{msg.TYPE.name} encodes to {len(data)} bytes (> {MAX_MESSAGE})")
    return data


def decode(data: bytes) -> Message:
    """Parse one datagram strictly; any defect raises :class:`HandoffProtocolError`."""
    if len(data) > MAX_MESSAGE:
        raise HandoffProtocolError(
            f"message of {len(data)} bytes (limit {MAX_MESSAGE})", ErrorCode.OVERSIZED
        )
    if len(data) < HEADER.size:
        raise HandoffProtocolError(f"message of {len(data)} bytes is shorter than the header")
    magic, version, mtype, flags, length = HEADER.unpack_from(data)
    if magic != MAGIC:
        raise HandoffProtocolError(f"bad magic {magic!r} (expected {MAGIC!r})")
    if version != VERSION:
        raise HandoffVersionError(version)
    cls = _CLASSES_BY_VALUE.get(mtype)
    if cls is None:
        raise HandoffProtocolError(
            f"unknown message type 0x{mtype:02x}", ErrorCode.UNSUPPORTED_TYPE
        )
    what = _NAMES[cls]
    if flags:
        raise HandoffProtocolError(f"{what}: reserved header flags 0x{flags:04x} must be 0")
    if length != len(data) - HEADER.size:
        raise HandoffProtocolError(
            f"{what}: header says {length} body bytes, datagram has {len(data) - HEADER.size}"
        )
    r = _Reader(bytes(data[HEADER.size :]), what)
    try:
        msg = cls.parse(r)
    except ValueError as e:  # a field out of range, reported by the dataclass checks
        raise _field_error(what, e) from None
    r.end()
    return msg


def decode_request(data: bytes) -> Request:
    """:func:`decode`, refusing replies (what the daemon reads)."""
    msg = decode(data)
    if not msg.TYPE.is_request:
        raise HandoffProtocolError(f"{msg.TYPE.name} is a reply, not a request")
    return msg  # type: ignore[return-value]


def decode_reply(data: bytes) -> Reply:
    """:func:`decode`, refusing requests (what the client reads)."""
    msg = decode(data)
    if msg.TYPE.is_request:
        raise HandoffProtocolError(f"{msg.TYPE.name} is a request, not a reply")
    return msg  # type: ignore[return-value]


# --- socket helpers ---------------------------------------------------------------------------


def close_fds(fds: Iterable[int]) -> None:
    """Close every descriptor, ignoring ones already gone (used on every error path)."""
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def send_message(sock: socket.socket, msg: Message, fds: Sequence[int] = ()) -> None:
    """Send ``msg`` with exactly the descriptors its type carries (they stay the caller's)."""
    expected = _FD_COUNTS.get(type(msg))
    if expected is None:  # a subclass of a message class
        expected = len(FD_NAMES[msg.TYPE])
    if len(fds) != expected:
        raise ValueError(f"{msg.TYPE.name} carries {expected} descriptors, got {len(fds)}")
    data = encode(msg)
    ancillary = (
        [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())] if fds else []
    )
    sent = sock.sendmsg([data], ancillary)
    if sent != len(data):  # cannot happen on SEQPACKET; guard the invariant anyway
        raise HandoffProtocolError(f"short send of {msg.TYPE.name}: {sent}/{len(data)} bytes")


_INT_SIZE = array.array("i").itemsize
_ANCILLARY = socket.CMSG_SPACE(MAX_FDS * _INT_SIZE)
# Plain ints: the socket module's MSG_* are IntFlag members, and enum arithmetic on the flags
# of every received message would cost microseconds.
_MSG_CTRUNC = int(socket.MSG_CTRUNC)
_MSG_TRUNC = int(socket.MSG_TRUNC)
_MSG_CMSG_CLOEXEC = int(socket.MSG_CMSG_CLOEXEC)


def _fds_from(ancillary: list[tuple[int, int, bytes]]) -> tuple[list[int], bool]:
    """Every descriptor in the ancillary data, and whether something else/partial came too."""
    fds: list[int] = []
    odd = False
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            whole = len(payload) - len(payload) % _INT_SIZE
            fds.extend(array.array("i", payload[:whole]))
            odd = odd or whole != len(payload)
        else:
            odd = True
    return fds, odd


def recv_message(sock: socket.socket, *, requests: bool) -> tuple[Message, list[int]]:
    """Receive one message and its descriptors (now owned by the caller).

    ``requests`` chooses the direction accepted (True on the daemon). On any defect every
    received descriptor is closed before :class:`HandoffProtocolError` is raised; EOF raises
    :class:`HandoffClosedError`. Socket errors (timeouts included) propagate unchanged.
    """
    data, ancillary, flags, _ = sock.recvmsg(MAX_MESSAGE + 1, _ANCILLARY, _MSG_CMSG_CLOEXEC)
    fds, odd = _fds_from(ancillary)
    try:
        if not data and not ancillary:
            raise HandoffClosedError("the handoff connection was closed")
        if flags & _MSG_CTRUNC or odd:
            raise HandoffProtocolError(
                f"more than {MAX_FDS} descriptors or unexpected ancillary data", ErrorCode.BAD_FDS
            )
        if flags & _MSG_TRUNC or len(data) > MAX_MESSAGE:
            raise HandoffProtocolError(
                f"message longer than {MAX_MESSAGE} bytes", ErrorCode.OVERSIZED
            )
        msg = decode_request(data) if requests else decode_reply(data)
        expected = _FD_COUNTS[type(msg)]
        if len(fds) != expected:
            raise HandoffProtocolError(
                f"{msg.TYPE.name} carries {expected} descriptors, got {len(fds)}",
                ErrorCode.BAD_FDS,
            )
    except BaseException:
        close_fds(fds)
        raise
    return msg, fds


# --- where the daemon listens -----------------------------------------------------------------


def handoff_socket_candidates(env: Mapping[str, str] | None = None) -> list[Path]:
    """Paths to try, in order (see the module docstring). Every handoff asks, so the answer is
    remembered per (environment values, uid)."""
    env = os.environ if env is None else env
    override = env.get("SMCD_HANDOFF_SOCKET", "")
    xdg = env.get("XDG_RUNTIME_DIR", "")
    key = (override, xdg, os.getuid())
    known = _CANDIDATES.get(key)
    if known is None:
        known = _candidates(override, xdg)
        if len(_CANDIDATES) >= 16:
            _CANDIDATES.clear()
        _CANDIDATES[key] = known
    return list(known)


_CANDIDATES: dict[tuple[str, str, int], tuple[Path, ...]] = {}


def _candidates(override: str, xdg: str) -> tuple[Path, ...]:
    if override:
        return (Path(override),)
    if xdg.startswith("/"):
        user = Path(xdg) / "smcd" / "handoff.sock"
    else:
        user = Path(tempfile.gettempdir()) / f"smcd-{os.getuid()}" / "handoff.sock"
    return (user,) if user == SYSTEM_HANDOFF_SOCKET else (user, SYSTEM_HANDOFF_SOCKET)


def handoff_timeout(env: Mapping[str, str] | None = None) -> float:
    """:data:`HANDOFF_TIMEOUT`, or ``$SMCD_HANDOFF_TIMEOUT`` when it is a positive number."""
    env = os.environ if env is None else env
    raw = env.get("SMCD_HANDOFF_TIMEOUT", "")
    if not raw:
        return HANDOFF_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        return HANDOFF_TIMEOUT
    return value if 0 < value < 3600 else HANDOFF_TIMEOUT
