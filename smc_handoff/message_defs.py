"""The handoff protocol's vocabulary and messages (standard library only): constants, the error
hierarchy, the enumerations, and one frozen dataclass per message type that checks its fields
and encodes and parses its body. The protocol itself (transport, framing, every rule) is
specified in :mod:`smc_handoff.messages`, which frames these bodies and sends and receives them;
import the names from there.
"""

from __future__ import annotations

import enum
import re
import socket
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from smc_handoff import layout

__all__ = [
    "FALLBACK_CHANNEL_UNSUPPORTED",
    "FALLBACK_CLOSED_UNANSWERED",
    "FALLBACK_DAEMON_BUSY",
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
    "MESSAGE_CLASSES",
    "SYSTEM_HANDOFF_SOCKET",
    "VERSION",
    "Accept",
    "BodyReader",
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
    "daemon_error",
    "daemon_unavailable",
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
HANDOFF_TIMEOUT = 20.0
"""Seconds a client waits for the reply to CONNECT/ACCEPT/LISTEN/RESUME; past it a handoff fails
(ETIMEDOUT), so it outlasts the daemon's default handshake timers (proposal_wait 1 s, clc_wait 6 s
per CLC message, SMC-R's first LLC 5 s and LLC 2 s waits)."""
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
FALLBACK_DAEMON_BUSY = 0xFF000005
"""Local fallback code: the daemon was too busy to start a handshake (at its handshake capacity,
past this user's fair share, or its event loop running late) and said so before any CLC byte."""
FALLBACK_CLOSED_UNANSWERED = 0xFF000006
"""Local fallback code: the application closed a connecting socket before smcd answered its
handoff (smc-run's ``connect()`` returns first), so the library gave the handoff up; never in a
reply, only in ``.fallback`` and ``smc-run -v``."""

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


_MODES: dict[int, Mode] = {int(m): m for m in Mode}


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


_DMB_SIZES = frozenset(layout.DMB_SIZES)
_CHANNEL_SIZES = frozenset(layout.CHANNEL_SIZES)


def valid_dmb_size(size: int) -> bool:
    """True for the SMC-D DMB sizes: 16 KiB << n, n = 0..6 (``layout.DMB_SIZES``)."""
    return size in _DMB_SIZES


# --- field helpers ----------------------------------------------------------------------------


def _check_uint(name: str, value: int, bits: int) -> None:
    if type(value) is int and 0 <= value < (1 << bits):  # the common case, first
        return
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < (1 << bits):
        raise ValueError(f"{name} must be an integer 0..{(1 << bits) - 1}, not {value!r}")


def _check_size(name: str, value: int, *, zero_ok: bool) -> None:
    _check_uint(name, value, 32)
    if not (valid_dmb_size(value) or (zero_ok and value == 0)):
        raise ValueError(f"{name} must be 16 KiB << n (n = 0..6){' or 0' if zero_ok else ''}")


def _check_channel_size(name: str, value: int) -> None:
    """A channel's buffer: an SMC-D DMB size, or an SMC-R RMBE size + 32 (``layout``)."""
    if type(value) is int and value in _CHANNEL_SIZES:  # the common case, first
        return
    _check_uint(name, value, 32)
    if value not in layout.CHANNEL_SIZES:
        raise ValueError(f"{name} must be 16 KiB << n (n = 0..6), or that + 32 (SMC-R)")


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


class BodyReader:
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
    def parse(cls, r: BodyReader) -> Connect:
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
    def parse(cls, r: BodyReader) -> Accept:
        (size,) = r.take("I")
        return cls(size)


@dataclass(frozen=True)
class Listen:
    """LISTEN: register an SMC-enabled listening socket (fds: listener)."""

    TYPE: ClassVar[MessageType] = MessageType.LISTEN

    def body(self) -> bytes:
        return b""

    @classmethod
    def parse(cls, r: BodyReader) -> Listen:
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
        _check_channel_size("rx_size", self.rx_size)
        _check_channel_size("tx_size", self.tx_size)
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
    def parse(cls, r: BodyReader) -> Resume:
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
    def parse(cls, r: BodyReader) -> Shutdown:
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
    def parse(cls, r: BodyReader) -> Close:
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
        if type(self.mode) is not Mode:  # the daemon passes the member; a parse, a number
            object.__setattr__(self, "mode", Mode(self.mode))
        _check_channel_size("rx_size", self.rx_size)
        _check_channel_size("tx_size", self.tx_size)

    def body(self) -> bytes:
        return struct.pack("!QBII", self.conn_id, self.mode, self.rx_size, self.tx_size)

    @classmethod
    def parse(cls, r: BodyReader) -> Channel:
        conn_id, mode, rx, tx = r.take("QBII")
        # the member by a dict look (an enum call costs three Python calls); an unknown value
        # stays a number, which __post_init__ refuses as Mode() does
        return cls(conn_id, _MODES.get(mode, mode), rx, tx)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Fallback:
    """FALLBACK reply, and the ``.fallback`` of a socket that stayed on TCP.

    ``code`` is the CLC decline / fallback reason (kernel numbering, or the local class 0xFF
    codes), ``name`` its symbolic name, ``explanation`` a sentence for humans, and
    ``peer_diagnosis`` the code the peer put in its CLC Decline (None when the peer sent none).
    ``after_decline``: the TCP stream carried a CLC exchange that ended in a Decline both ends
    processed (False: no byte was read or written); the library trusts a touched stream only so.
    """

    code: int
    name: str
    explanation: str
    peer_diagnosis: int | None = None
    after_decline: bool = False
    TYPE: ClassVar[MessageType] = MessageType.FALLBACK

    def __post_init__(self) -> None:
        _check_uint("code", self.code, 32)
        _check_text("name", self.name, is_name=True)
        _check_text("explanation", self.explanation)
        if self.peer_diagnosis is not None:
            _check_uint("peer_diagnosis", self.peer_diagnosis, 32)

    def body(self) -> bytes:
        flags = int(self.peer_diagnosis is not None) | int(self.after_decline) << 1
        return (
            struct.pack("!IBI", self.code, flags, self.peer_diagnosis or 0)
            + _str16(self.name)
            + _str16(self.explanation)
        )

    @classmethod
    def parse(cls, r: BodyReader) -> Fallback:
        code, flags, diag = r.take("IBI")
        if flags & ~3:
            raise HandoffProtocolError("FALLBACK: unknown flag bits")
        if not flags & 1 and diag:
            raise HandoffProtocolError("FALLBACK: peer_diagnosis set without its flag")
        name = r.text("name", is_name=True)
        explanation = r.text("explanation")
        return cls(code, name, explanation, diag if flags & 1 else None, bool(flags & 2))

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
    def parse(cls, r: BodyReader) -> Error:
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
    def parse(cls, r: BodyReader) -> Ok:
        (ident,) = r.take("Q")
        return cls(ident)


Request = Connect | Accept | Listen | Resume | Shutdown | Close
Reply = Channel | Fallback | Error | Ok
Message = Request | Reply

MESSAGE_CLASSES: tuple[type[Message], ...] = (
    Connect,
    Accept,
    Listen,
    Resume,
    Shutdown,
    Close,
    Channel,
    Fallback,
    Error,
    Ok,
)
"""Every message class, one per :class:`MessageType`."""


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
