"""Shared pieces of the CLC codec: enums, constants, the 8-byte header and field helpers.

Layouts and rules follow the Linux kernel (``net/smc/smc_clc.h`` / ``smc_clc.c``, 6.12 and newer)
and PROTOCOL.md §1.2-1.5. Offsets are bytes from the start of the message; integers big-endian.
Every failure is a :class:`ProtocolError` naming the field (kernel struct member names) and offset.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

from smcd_daemon.errors import ProtocolError, UnknownMessageError
from smcd_daemon.wire._fields import Reader, u16be

__all__ = [
    "CLC_HEADER_LEN",
    "CLC_MAX_LEN",
    "CLC_TRAILER_LEN",
    "EID_LEN",
    "EMULATED_ISM_CHID_MIN",
    "FIRST_CONTACT_MASK",
    "GID_LEN",
    "HOSTNAME_LEN",
    "LOOPBACK_ISM_CHID",
    "MAX_GID_LIST",
    "MAX_ISM_GID_ENTRIES",
    "MAX_LEN_BY_TYPE",
    "MAX_UEIDS",
    "MAX_V6_PREFIXES",
    "MIN_LEN_BY_TYPE",
    "SMCD_EYECATCHER",
    "SMCR_EYECATCHER",
    "Buffer",
    "ClcHeader",
    "ClcType",
    "OsType",
    "SmcType",
    "peek_header",
]

Buffer = bytes | bytearray | memoryview
"""What decoders accept (copied to bytes once)."""

SMCR_EYECATCHER = b"\xe2\xd4\xc3\xd9"
""""SMCR" in EBCDIC: Linux sends it on Proposal, Decline and SMC-R Accept/Confirm."""
SMCD_EYECATCHER = b"\xe2\xd4\xc3\xc4"
""""SMCD" in EBCDIC: Linux sends it (head and trailer) on SMC-D Accept/Confirm."""
EYECATCHERS = (SMCR_EYECATCHER, SMCD_EYECATCHER)

CLC_HEADER_LEN = 8
CLC_TRAILER_LEN = 4

LOOPBACK_ISM_CHID = 0xFFFF
"""CHID of the loopback-ism device (SMC_LO_RESERVED_CHID)."""
EMULATED_ISM_CHID_MIN = 0xFF00
"""CHIDs 0xFF00-0xFFFF mark Emulated-ISM devices with 128-bit GIDs (``__smc_ism_is_emulated``)."""

GID_LEN = 16
EID_LEN = 32  # SMC_MAX_EID_LEN
HOSTNAME_LEN = 32  # SMC_MAX_HOSTNAME_LEN
MAX_V6_PREFIXES = 8  # SMC_CLC_MAX_V6_PREFIX
MAX_UEIDS = 8  # SMC_CLC_MAX_UEID
MAX_ISM_GID_ENTRIES = 8  # SMCD_CLC_MAX_V2_GID_ENTRIES (an Emulated-ISM device takes two)
MAX_GID_LIST = 8
"""Our cap on the GID list extension of a v2 Confirm. Linux sends at most 2 (GID_LIST_SIZE) and the
kernel server never reads the list; 8 leaves room for other stacks and keeps messages small."""

FIRST_CONTACT_MASK = 0b10  # SMC_FIRST_CONTACT_MASK, within typev2 (0x08 on the wire)

# Largest message a valid peer can send, per type. Proposal: sizeof(struct
# smc_clc_msg_proposal_area) = 40 + 40 + 8 + 8*17 + 40 + 8*32 + 48 + 8*10 + 4 = 652, which is also
# the receive buffer the kernel server uses. Accept: 104 + 52-byte FCE + 4 = 160
# (SMC_CLC_MAX_ACCEPT_LEN, the kernel client's buffer). Confirm: 160 + GID list 4 + 16*8.
# Decline: 44 (struct smc_clc_msg_decline_v2).
_PROPOSAL_MAX = 40 + 40 + 8 + MAX_V6_PREFIXES * 17 + 40 + MAX_UEIDS * EID_LEN + 48
_PROPOSAL_MAX += MAX_ISM_GID_ENTRIES * 10 + CLC_TRAILER_LEN
_ACCEPT_MAX = 104 + 52 + CLC_TRAILER_LEN
_CONFIRM_MAX = _ACCEPT_MAX + 4 + MAX_GID_LIST * GID_LEN
CLC_MAX_LEN = _PROPOSAL_MAX
"""652: no valid CLC message is longer (see ``MAX_LEN_BY_TYPE``)."""


class ClcType(IntEnum):
    """CLC message type (header byte 4)."""

    PROPOSAL = 1
    ACCEPT = 2
    CONFIRM = 3
    DECLINE = 4


class SmcType(IntEnum):
    """SMC path type of the header's typev1/typev2 fields (SMC_TYPE_*)."""

    R = 0
    D = 1
    N = 2
    B = 3

    @property
    def has_r(self) -> bool:
        """``smcr_indicated``."""
        return self in (SmcType.R, SmcType.B)

    @property
    def has_d(self) -> bool:
        """``smcd_indicated``."""
        return self in (SmcType.D, SmcType.B)


class OsType(IntEnum):
    """Operating system of the sender (SMC_CLC_OS_*); 0 in v1 Declines."""

    NONE = 0
    ZOS = 1
    LINUX = 2
    AIX = 3


MIN_LEN_BY_TYPE: dict[ClcType, int] = {
    # 52-byte pre-5.10 v1 proposal: 40 + prefix 8 + trailer 4
    ClcType.PROPOSAL: 52,
    # SMC-D v1 accept/confirm (SMCD_CLC_ACCEPT_CONFIRM_LEN)
    ClcType.ACCEPT: 48,
    ClcType.CONFIRM: 48,
    # struct smc_clc_msg_decline
    ClcType.DECLINE: 28,
}
MAX_LEN_BY_TYPE: dict[ClcType, int] = {
    ClcType.PROPOSAL: _PROPOSAL_MAX,
    ClcType.ACCEPT: _ACCEPT_MAX,
    ClcType.CONFIRM: _CONFIRM_MAX,
    ClcType.DECLINE: 44,
}


def os_type(value: int) -> OsType | int:
    """Known OS types become :class:`OsType`; others stay plain ints (peers may send any)."""
    try:
        return OsType(value)
    except ValueError:
        return value


@dataclass(frozen=True)
class ClcHeader:
    """The 8-byte header common to all CLC messages (``struct smc_clc_msg_hdr``)."""

    eyecatcher: bytes
    type: ClcType
    length: int
    version: int
    typev1: int
    typev2: int

    @property
    def first_contact(self) -> bool:
        """Accept/Confirm: first contact; Decline: out-of-sync (same bit, 0x08)."""
        return bool(self.typev2 & FIRST_CONTACT_MASK)


def _parse_header(r: Reader) -> ClcHeader:
    eye = r.raw(0, 4, "eyecatcher")
    if eye not in EYECATCHERS:
        raise UnknownMessageError(
            f"{eye.hex()} is neither SMCR nor SMCD eyecatcher", field="eyecatcher", offset=0
        )
    raw_type = r.u8(4, "type")
    try:
        ctype = ClcType(raw_type)
    except ValueError:
        raise UnknownMessageError(
            f"unknown CLC message type {raw_type}", field="type", offset=4
        ) from None
    length = r.u16(5, "length")
    flags = r.u8(7, "version")
    version = flags >> 4
    if version < 1:
        raise ProtocolError("version 0 is not SMC", field="version", offset=7)
    return ClcHeader(eye, ctype, length, version, flags & 0x03, (flags >> 2) & 0x03)


def peek_header(first8: Buffer) -> ClcHeader:
    """Parse the 8-byte header the way the kernel MSG_PEEKs it, to frame a message in a stream.

    Checks eyecatcher, type, version >= 1 and that the length lies within what the type allows,
    so a reader knows how many bytes to read before calling ``decode``.
    """
    r = Reader(bytes(first8[:CLC_HEADER_LEN]))
    r.need(0, CLC_HEADER_LEN, "header")
    hdr = _parse_header(r)
    lo, hi = MIN_LEN_BY_TYPE[hdr.type], MAX_LEN_BY_TYPE[hdr.type]
    if not lo <= hdr.length <= hi:
        raise ProtocolError(
            f"{hdr.type.name} length {hdr.length} outside {lo}..{hi}", field="length", offset=5
        )
    return hdr


def decode_header(r: Reader, expected: ClcType) -> ClcHeader:
    """Validate the header of a whole message: known eyecatcher and type, version >= 1, type as
    expected, and the length field equal to the number of bytes given."""
    r.need(0, CLC_HEADER_LEN, "header")
    hdr = _parse_header(r)
    if hdr.type != expected:
        raise ProtocolError(
            f"expected {expected.name}, got {hdr.type.name}", field="type", offset=4
        )
    if hdr.length != len(r):
        raise ProtocolError(
            f"length field says {hdr.length} but the message has {len(r)} bytes",
            field="length",
            offset=5,
        )
    return hdr


def check_trailer(r: Reader) -> None:
    """The trailing eyecatcher: either one, as ``smc_clc_msg_hdr_valid`` accepts."""
    off = len(r) - CLC_TRAILER_LEN
    trl = r.raw(off, CLC_TRAILER_LEN, "trailer")
    if trl not in EYECATCHERS:
        raise ProtocolError(
            f"trailer {trl.hex()} is neither SMCR nor SMCD eyecatcher", field="trailer", offset=off
        )


def encode_header(
    eyecatcher: bytes, ctype: ClcType, length: int, version: int, typev1: int, typev2: int
) -> bytes:
    return (
        eyecatcher
        + bytes([ctype])
        + u16be(length)
        + bytes([(version << 4) | ((typev2 & 3) << 2) | (typev1 & 3)])
    )


def fail(message: str, field: str, offset: int | None = None) -> ProtocolError:
    return ProtocolError(message, field=field, offset=offset)


# ---- text fields (EIDs, host names): 32 bytes, blank padded -------------------------------------


def decode_text(raw: bytes) -> str:
    """Strip the blank (or NUL) padding; latin-1 maps every byte, so nothing is lost."""
    return raw.rstrip(b" \x00").decode("latin-1")


def encode_text(value: str, field: str, *, size: int = 32, empty_is_zero: bool = False) -> bytes:
    """Blank-pad ``value`` to ``size`` bytes. ``empty_is_zero``: an empty EID is all zeros, as
    Linux leaves an unset EID (memset 0)."""
    if not isinstance(value, str):
        raise fail(f"must be str, got {type(value).__name__}", field)
    try:
        raw = value.encode("latin-1")
    except UnicodeEncodeError:
        raise fail("must be latin-1 (single-byte) text", field) from None
    if len(raw) > size:
        raise fail(f"{len(raw)} bytes, at most {size}", field)
    if raw != raw.rstrip(b" \x00"):
        raise fail("must not end with blanks or NULs (they are the padding)", field)
    if not raw and empty_is_zero:
        return bytes(size)
    return raw.ljust(size, b" ")


# ---- argument checks for encoders -----------------------------------------------------------


def check_uint(value: object, bits: int, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < (1 << bits):
        raise fail(f"must be an int in 0..{(1 << bits) - 1}, got {value!r}", field)
    return value


def check_bytes(value: object, size: int, field: str) -> bytes:
    if not isinstance(value, bytes) or len(value) != size:
        raise fail(f"must be {size} bytes, got {value!r}", field)
    return value


def check_version(value: object) -> int:
    version = check_uint(value, 4, "version")
    if version == 0:
        raise fail("version 0 is not SMC", "version")
    return version


def check_smc_type(value: object, field: str) -> SmcType:
    if isinstance(value, bool) or not isinstance(value, int):
        raise fail(f"must be an SmcType, got {value!r}", field)
    try:
        return SmcType(value)
    except ValueError:
        raise fail(f"must be an SmcType, got {value!r}", field) from None
