"""The parts every LLC message shares (Linux ``smc_llc.h``): sizes, type byte, flags and
reason codes, the header with its two ``length_v2`` byte orders, field checks, the encode/decode
plumbing of :class:`LlcMessageBase` and the rkey table entries. The messages are in
``llc_link`` and ``llc_rkey``; ``smcd_daemon.wire.llc`` is the public face (see its docstring).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum, IntFlag
from typing import ClassVar, Literal, Self, TypeAlias, TypeVar

from smcd_daemon.errors import UnknownMessageError
from smcd_daemon.wire._fields import ProtocolError, Reader

LengthOrder: TypeAlias = Literal["little", "big"]

#: SMC_WR_TX_SIZE: every v1 LLC message, and the fixed part of every v2 one.
LLC_MSG_LEN = 44
#: SMC_WR_BUF_V2_SIZE: the largest v2 LLC message.
LLC_V2_MAX_LEN = 8192
MAC_LEN = 6
GID_LEN = 16
LINK_UID_LEN = 4  # SMC_LGR_ID_SIZE

_CDC_TYPE = 0xFE
_V2 = 2  # llc_version nibble of SMC-Rv2 messages
ADD_LINK_RKEY_LEN = 16  # sizeof(struct smc_llc_msg_add_link_cont_rt)
RTOKEN_LEN = 13  # sizeof(struct smc_rmb_rtoken), packed

MAX_V2_RKEYS = 255  # SMC_LLC_RKEYS_PER_MSG_V2

_RT = struct.Struct(">IIQ")


class LlcType(IntEnum):
    """The type byte (``enum smc_llc_msg_type``): v2 types have version 2 in the high nibble.

    0x05 (REQ ADD LINK) is only ever sent as v2 (0x25): RFC 7609 and Wireshark know no v1 0x05,
    and Linux sends it only in SMC-Rv2 link groups, so a v1 0x05 is decoded as unknown. ADD LINK
    CONT and CONFIRM RKEY CONT have no v2 form (v2 carries rkeys in ``add_link_v2_ext``).
    """

    CONFIRM_LINK = 0x01
    ADD_LINK = 0x02
    ADD_LINK_CONT = 0x03
    DELETE_LINK = 0x04
    CONFIRM_RKEY = 0x06
    TEST_LINK = 0x07
    CONFIRM_RKEY_CONT = 0x08
    DELETE_RKEY = 0x09
    CONFIRM_LINK_V2 = 0x21
    ADD_LINK_V2 = 0x22
    DELETE_LINK_V2 = 0x24
    REQ_ADD_LINK_V2 = 0x25
    CONFIRM_RKEY_V2 = 0x26
    TEST_LINK_V2 = 0x27
    DELETE_RKEY_V2 = 0x29


class LlcFlag(IntFlag):
    """Header flags common to all LLC types (byte 3)."""

    RESPONSE = 0x80  # SMC_LLC_FLAG_RESP


class ConfirmLinkFlag(IntFlag):
    RESPONSE = 0x80
    #: SMC_LLC_FLAG_NO_RMBE_EYEC: RMBEs carry no eye catcher. Linux always sets it and answers
    #: a CONFIRM LINK without it with ENOTSUPP.
    NO_RMBE_EYEC = 0x03


class AddLinkFlag(IntFlag):
    RESPONSE = 0x80
    REJECT = 0x40  # SMC_LLC_FLAG_ADD_LNK_REJ: reason in add_link_rej_rsn (v1 only)


class DeleteLinkFlag(IntFlag):
    RESPONSE = 0x80
    ALL = 0x40  # SMC_LLC_FLAG_DEL_LINK_ALL: terminate the whole link group
    ORDERLY = 0x20  # SMC_LLC_FLAG_DEL_LINK_ORDERLY


class RkeyFlag(IntFlag):
    """Flags of CONFIRM RKEY (all three) and DELETE RKEY (RESPONSE, NEGATIVE)."""

    RESPONSE = 0x80
    NEGATIVE = 0x20  # SMC_LLC_FLAG_RKEY_NEG
    RETRY = 0x10  # SMC_LLC_FLAG_RKEY_RETRY


class AddLinkRejectReason(IntEnum):
    """``add_link_rej_rsn``, the low nibble of header byte 2 of a v1 ADD LINK response."""

    NONE = 0
    NO_ALT_PATH = 1  # SMC_LLC_REJ_RSN_NO_ALT_PATH


class DeleteLinkReason(IntEnum):
    """DELETE LINK reason codes (``smc_llc.h``, u32). Requests use 0x0001xxxx-0x0005xxxx,
    responses 0x0010xxxx/0x0020xxxx; a successful response carries 0."""

    NONE = 0x00000000
    LOST_PATH = 0x00010000  # SMC_LLC_DEL_LOST_PATH
    OPERATOR_TERMINATION = 0x00020000  # SMC_LLC_DEL_OP_INIT_TERM
    PROGRAM_TERMINATION = 0x00030000  # SMC_LLC_DEL_PROG_INIT_TERM
    PROTOCOL_VIOLATION = 0x00040000  # SMC_LLC_DEL_PROT_VIOL
    NO_ASYMMETRIC_NEEDED = 0x00050000  # SMC_LLC_DEL_NO_ASYM_NEEDED
    UNKNOWN_LINK = 0x00100000  # SMC_LLC_DEL_NOLNK (response)
    UNKNOWN_LINK_GROUP = 0x00200000  # SMC_LLC_DEL_NOLGR (response)


_E = TypeVar("_E", bound=IntEnum)


def enum_or_int(enum: type[_E], value: int) -> _E | int:
    """Known codes become enum members; unknown ones stay plain ints (never an error: the
    kernel does not validate reason codes either)."""
    try:
        return enum(value)
    except ValueError:
        return value


# ---------------------------------------------------------------------------- validation
def check_uint(name: str, value: int, bits: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < (1 << bits):
        raise ValueError(f"{name}={value!r} is not a {bits}-bit unsigned integer")


def check_bytes(name: str, value: bytes, size: int) -> None:
    if not isinstance(value, bytes) or len(value) != size:
        raise ValueError(f"{name} must be {size} bytes, not {value!r}")


def check_count(name: str, items: tuple[object, ...], limit: int) -> None:
    if not isinstance(items, tuple) or len(items) > limit:
        raise ValueError(f"{name} must be a tuple of at most {limit} entries")


# ---------------------------------------------------------------------------- header
@dataclass(frozen=True, slots=True)
class LlcHeader:
    base: int  # llc_type nibble
    v2: bool
    orders: tuple[LengthOrder, ...]  # byte orders in which length_v2 equals the length (v2)
    length: int
    rej_rsn: int
    flags: int


_V1_BASES = frozenset({0x1, 0x2, 0x3, 0x4, 0x6, 0x7, 0x8, 0x9})
_V2_BASES = frozenset({0x1, 0x2, 0x4, 0x5, 0x6, 0x7, 0x9})


def decode_header(r: Reader) -> LlcHeader:
    type_byte = r.u8(0, "type")
    version, base = type_byte >> 4, type_byte & 0x0F
    if type_byte == _CDC_TYPE:
        raise UnknownMessageError(
            "0xFE is a CDC message, not LLC (use wire.cdc)", field="type", offset=0
        )
    if version == 0 and base in _V1_BASES:
        length = r.u8(1, "length")
        if length != LLC_MSG_LEN:
            raise ProtocolError(
                f"v1 LLC length byte is {length}, must be {LLC_MSG_LEN}", field="length", offset=1
            )
        rej_rsn = r.u8(2, "add_link_rej_rsn") & 0x0F
        return LlcHeader(base, False, (), LLC_MSG_LEN, rej_rsn, r.u8(3, "flags"))
    if version == _V2 and base in _V2_BASES:
        little = r.u16(1, "length_v2", little=True)
        big = r.u16(1, "length_v2")
        actual = len(r)
        candidates: tuple[tuple[LengthOrder, int], ...] = (("little", little), ("big", big))
        orders = tuple(order for order, value in candidates if value == actual)
        if not LLC_MSG_LEN <= actual <= LLC_V2_MAX_LEN or not orders:
            raise ProtocolError(
                f"length_v2 reads {little} (little-endian) or {big} (big-endian) but the "
                f"message has {actual} bytes (valid: {LLC_MSG_LEN}..{LLC_V2_MAX_LEN})",
                field="length_v2",
                offset=1,
            )
        return LlcHeader(base, True, orders, actual, 0, r.u8(3, "flags"))
    raise UnknownMessageError(f"no LLC message has type 0x{type_byte:02X}", field="type", offset=0)


def _check_order(length_order: str) -> None:
    if length_order not in ("little", "big"):
        raise ValueError(f"length_order must be 'little' or 'big', not {length_order!r}")


# ---------------------------------------------------------------------------- base
class LlcMessageBase:
    """Shared encode/decode plumbing. Subclasses are frozen dataclasses."""

    __slots__ = ()

    _BASE: ClassVar[int]  # llc_type nibble
    _ALWAYS_V2: ClassVar[bool | None] = None  # True/False: fixed version; None: ``v2`` field

    @property
    def is_v2(self) -> bool:
        fixed = self._ALWAYS_V2
        if fixed is not None:
            return fixed
        return bool(getattr(self, "v2"))  # noqa: B009 - declared by the dual-version subclasses

    @property
    def type(self) -> LlcType:
        return LlcType(self._BASE | (0x20 if self.is_v2 else 0))

    @property
    def is_response(self) -> bool:
        return bool(self._flag_byte() & LlcFlag.RESPONSE)

    def _flag_byte(self) -> int:
        return int(getattr(self, "flags"))  # noqa: B009 - every subclass has ``flags``

    def _byte2(self) -> int:
        return 0

    def _body(self, length_order: LengthOrder) -> bytes:
        raise NotImplementedError

    def encode(self, *, length_order: LengthOrder = "little") -> bytes:
        """The message's bytes. ``length_order`` is the byte order of v2's host-order u16
        fields (``length_v2``, ``num_rkeys`` of ADD LINK v2); v1 messages ignore it. The
        default, little-endian, is what Linux on x86 sends and expects."""
        _check_order(length_order)
        body = self._body(length_order)
        total = 4 + len(body)
        if self.is_v2:
            if total > LLC_V2_MAX_LEN:
                raise ValueError(f"v2 LLC message of {total} bytes exceeds {LLC_V2_MAX_LEN}")
            length = total.to_bytes(2, length_order)
        else:
            assert total == LLC_MSG_LEN
            length = bytes((LLC_MSG_LEN, self._byte2()))
        return bytes((int(self.type),)) + length + bytes((self._flag_byte(),)) + body

    @classmethod
    def decode_body(cls, r: Reader, h: LlcHeader) -> Self:
        raise NotImplementedError

    @classmethod
    def decode(cls, data: bytes | bytearray | memoryview) -> Self:
        """Decode ``data`` and insist that it is this message type."""
        from smcd_daemon.wire.llc import decode  # the dispatcher knows every message

        msg = decode(data)
        if not isinstance(msg, cls):
            raise ProtocolError(
                f"expected {cls.__name__}, got {type(msg).__name__} (type 0x{msg.type:02X})",
                field="type",
                offset=0,
            )
        return msg


def pad(body: bytes | bytearray, size: int = LLC_MSG_LEN - 4) -> bytes:
    """Zero-fill a body to ``size`` bytes (the reserved tail of fixed-size messages)."""
    assert len(body) <= size
    return bytes(body) + bytes(size - len(body))


def u24(value: int) -> bytes:
    return value.to_bytes(3, "big")


# ---------------------------------------------------------------------------- rkey tables
@dataclass(frozen=True, slots=True)
class Rtoken:
    """``struct smc_rmb_rtoken`` (13 bytes): the rkey and virtual address of one RMB as
    registered on link ``link_id``."""

    link_id: int
    rmb_key: int
    rmb_vaddr: int

    def __post_init__(self) -> None:
        check_uint("link_id", self.link_id, 8)
        check_uint("rmb_key", self.rmb_key, 32)
        check_uint("rmb_vaddr", self.rmb_vaddr, 64)


@dataclass(frozen=True, slots=True)
class AddLinkRkey:
    """``struct smc_llc_msg_add_link_cont_rt`` (16 bytes): an RMB known by its rkey on the
    existing link (``rmb_key``) and its rkey and address on the new link."""

    rmb_key: int
    rmb_key_new: int
    rmb_vaddr_new: int

    def __post_init__(self) -> None:
        check_uint("rmb_key", self.rmb_key, 32)
        check_uint("rmb_key_new", self.rmb_key_new, 32)
        check_uint("rmb_vaddr_new", self.rmb_vaddr_new, 64)


def pack_add_link_rkey(rt: AddLinkRkey) -> bytes:
    return _RT.pack(rt.rmb_key, rt.rmb_key_new, rt.rmb_vaddr_new)


def read_add_link_rkey(r: Reader, off: int, field: str) -> AddLinkRkey:
    return AddLinkRkey(
        r.u32(off, f"{field}.rmb_key"),
        r.u32(off + 4, f"{field}.rmb_key_new"),
        r.u64(off + 8, f"{field}.rmb_vaddr_new"),
    )


def read_rtoken(r: Reader, off: int, field: str) -> Rtoken:
    return Rtoken(
        r.u8(off, f"{field}.link_id"),
        r.u32(off + 1, f"{field}.rmb_key"),
        r.u64(off + 5, f"{field}.rmb_vaddr"),
    )
