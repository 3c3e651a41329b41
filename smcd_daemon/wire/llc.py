"""LLC - Link Layer Control messages of SMC-R (Linux ``smc_llc.c``/``.h``, PROTOCOL.md §1.7).

LLC messages manage a link group: confirming, adding and deleting links (RC QPs), exchanging
rkeys of RMBs and keeping links alive. They travel as RDMA SENDs on a link's QP.

* v1 messages are always 44 bytes (``SMC_WR_TX_SIZE``): type, length byte 44, a byte holding
  ``add_link_rej_rsn`` in its low nibble, flags, then 40 bytes of body.
* v2 (SMC-Rv2 link groups) puts version 2 in the type's high nibble (0x21, 0x22, …) and a u16
  ``length_v2`` (44..8192, ``SMC_WR_BUF_V2_SIZE``) in bytes 1-2. Most v2 messages keep the v1
  body; ADD LINK appends ``add_link_v2_ext`` (rkeys of every RMB for the new link), REQ ADD LINK
  carries a GID list and DELETE RKEY a variable rkey list.

**length_v2 byte order.** Linux declares ``length_v2`` (and ``add_link_v2_ext.num_rkeys``) as a
plain host-order ``u16``, so x86 Linux sends them little-endian, while Wireshark and a literal
reading of the SMC v2 spec expect big-endian (PROTOCOL.md §1.9 point 4). Decoding accepts either
order, picking the one that equals the message's real length; encoding takes
``length_order`` and defaults to ``"little"`` because the Linux kernel on x86 is the peer we
interoperate with, and it checks ``length_v2`` in its own byte order.

Every field of every message is a frozen dataclass attribute: ints, ``bytes`` for MACs, GIDs and
opaque data, ``IntFlag``/``IntEnum`` for flags and codes (plain ``int`` for codes we do not know),
nested dataclasses in tuples for rkey tables. Reserved bytes are written as zero and ignored on
receipt; bytes after a message's layout are ignored, as the kernel does.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum, IntFlag
from typing import ClassVar, Literal, Self, TypeAlias, TypeVar

from smcd_daemon.errors import UnknownMessageError
from smcd_daemon.wire._fields import ProtocolError, Reader

__all__ = [
    "GID_LEN",
    "LLC_MSG_LEN",
    "LLC_V2_MAX_LEN",
    "MAC_LEN",
    "AddLink",
    "AddLinkCont",
    "AddLinkFlag",
    "AddLinkRejectReason",
    "AddLinkRkey",
    "AddLinkV2Ext",
    "ConfirmLink",
    "ConfirmLinkFlag",
    "ConfirmRkey",
    "ConfirmRkeyCont",
    "DeleteLink",
    "DeleteLinkFlag",
    "DeleteLinkReason",
    "DeleteRkey",
    "DeleteRkeyV2",
    "LengthOrder",
    "LlcFlag",
    "LlcMessage",
    "LlcType",
    "ReqAddLinkV2",
    "RkeyFlag",
    "Rtoken",
    "TestLink",
    "decode",
]

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
_ADD_LINK_EXT_LEN = 28  # sizeof(struct smc_llc_msg_add_link_v2_ext) without rt[]
_RT_LEN = 16  # sizeof(struct smc_llc_msg_add_link_cont_rt)
_RTOKEN_LEN = 13  # sizeof(struct smc_rmb_rtoken), packed
_REQ_ADD_LINK_FIXED = 28  # sizeof(struct smc_llc_msg_req_add_link_v2) without gid[]
_DELETE_RKEY_FIXED = 8  # sizeof(struct smc_llc_msg_delete_rkey_v2) without rkey[]

_MAX_ADD_LINK_CONT_RKEYS = 2  # SMC_LLC_RKEYS_PER_CONT_MSG
_MAX_CONFIRM_RKEY_OTHERS = 2  # SMC_LLC_RKEYS_PER_MSG - 1: rtoken[0] is the receiving link's
_MAX_CONFIRM_RKEY_CONT = 3  # SMC_LLC_RKEYS_PER_MSG
_MAX_DELETE_RKEYS = 8  # SMC_LLC_DEL_RKEY_MAX
_MAX_V2_RKEYS = 255  # SMC_LLC_RKEYS_PER_MSG_V2

_RT = struct.Struct(">IIQ")
_RTOKEN = struct.Struct(">BIQ")


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


_NO_LLCFLAG = LlcFlag(0)
_NO_ADDLINKFLAG = AddLinkFlag(0)
_NO_DELETELINKFLAG = DeleteLinkFlag(0)
_NO_RKEYFLAG = RkeyFlag(0)

_E = TypeVar("_E", bound=IntEnum)


def _enum_or_int(enum: type[_E], value: int) -> _E | int:
    """Known codes become enum members; unknown ones stay plain ints (never an error: the
    kernel does not validate reason codes either)."""
    try:
        return enum(value)
    except ValueError:
        return value


# ---------------------------------------------------------------------------- validation
def _check_uint(name: str, value: int, bits: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < (1 << bits):
        raise ValueError(f"{name}={value!r} is not a {bits}-bit unsigned integer")


def _check_bytes(name: str, value: bytes, size: int) -> None:
    if not isinstance(value, bytes) or len(value) != size:
        raise ValueError(f"{name} must be {size} bytes, not {value!r}")


def _check_count(name: str, items: tuple[object, ...], limit: int) -> None:
    if not isinstance(items, tuple) or len(items) > limit:
        raise ValueError(f"{name} must be a tuple of at most {limit} entries")


# ---------------------------------------------------------------------------- header
@dataclass(frozen=True, slots=True)
class _Header:
    base: int  # llc_type nibble
    v2: bool
    orders: tuple[LengthOrder, ...]  # byte orders in which length_v2 equals the length (v2)
    length: int
    rej_rsn: int
    flags: int


_V1_BASES = frozenset({0x1, 0x2, 0x3, 0x4, 0x6, 0x7, 0x8, 0x9})
_V2_BASES = frozenset({0x1, 0x2, 0x4, 0x5, 0x6, 0x7, 0x9})


def _decode_header(r: Reader) -> _Header:
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
        return _Header(base, False, (), LLC_MSG_LEN, rej_rsn, r.u8(3, "flags"))
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
        return _Header(base, True, orders, actual, 0, r.u8(3, "flags"))
    raise UnknownMessageError(f"no LLC message has type 0x{type_byte:02X}", field="type", offset=0)


def _check_order(length_order: str) -> None:
    if length_order not in ("little", "big"):
        raise ValueError(f"length_order must be 'little' or 'big', not {length_order!r}")


# ---------------------------------------------------------------------------- base
class _LlcMessage:
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
    def _decode_body(cls, r: Reader, h: _Header) -> Self:
        raise NotImplementedError

    @classmethod
    def decode(cls, data: bytes | bytearray | memoryview) -> Self:
        """Decode ``data`` and insist that it is this message type."""
        msg = decode(data)
        if not isinstance(msg, cls):
            raise ProtocolError(
                f"expected {cls.__name__}, got {type(msg).__name__} (type 0x{msg.type:02X})",
                field="type",
                offset=0,
            )
        return msg


def _pad(body: bytes | bytearray, size: int = LLC_MSG_LEN - 4) -> bytes:
    """Zero-fill a body to ``size`` bytes (the reserved tail of fixed-size messages)."""
    assert len(body) <= size
    return bytes(body) + bytes(size - len(body))


def _u24(value: int) -> bytes:
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
        _check_uint("link_id", self.link_id, 8)
        _check_uint("rmb_key", self.rmb_key, 32)
        _check_uint("rmb_vaddr", self.rmb_vaddr, 64)


@dataclass(frozen=True, slots=True)
class AddLinkRkey:
    """``struct smc_llc_msg_add_link_cont_rt`` (16 bytes): an RMB known by its rkey on the
    existing link (``rmb_key``) and its rkey and address on the new link."""

    rmb_key: int
    rmb_key_new: int
    rmb_vaddr_new: int

    def __post_init__(self) -> None:
        _check_uint("rmb_key", self.rmb_key, 32)
        _check_uint("rmb_key_new", self.rmb_key_new, 32)
        _check_uint("rmb_vaddr_new", self.rmb_vaddr_new, 64)

    def _encode(self) -> bytes:
        return _RT.pack(self.rmb_key, self.rmb_key_new, self.rmb_vaddr_new)

    @classmethod
    def _read(cls, r: Reader, off: int, field: str) -> AddLinkRkey:
        return cls(
            r.u32(off, f"{field}.rmb_key"),
            r.u32(off + 4, f"{field}.rmb_key_new"),
            r.u64(off + 8, f"{field}.rmb_vaddr_new"),
        )


def _read_rtoken(r: Reader, off: int, field: str) -> Rtoken:
    return Rtoken(
        r.u8(off, f"{field}.link_id"),
        r.u32(off + 1, f"{field}.rmb_key"),
        r.u64(off + 5, f"{field}.rmb_vaddr"),
    )


# ---------------------------------------------------------------------------- messages
@dataclass(frozen=True, slots=True)
class ConfirmLink(_LlcMessage):
    """CONFIRM LINK, type 0x01 / 0x21 (``struct smc_llc_msg_confirm_link``)::

        4 sender_mac[6]  10 sender_gid[16]  26 sender_qp_num[3]  29 link_num
        30 link_uid[4]   34 max_links       35 max_conns (v2.1)  36 reserved[8]

    Sent on a new link by the server (request) and answered by the client (response).
    """

    sender_mac: bytes
    sender_gid: bytes
    sender_qpn: int
    link_num: int
    link_uid: bytes
    max_links: int
    max_conns: int = 0
    flags: ConfirmLinkFlag = ConfirmLinkFlag.NO_RMBE_EYEC
    v2: bool = False

    _BASE: ClassVar[int] = 0x1

    def __post_init__(self) -> None:
        _check_bytes("sender_mac", self.sender_mac, MAC_LEN)
        _check_bytes("sender_gid", self.sender_gid, GID_LEN)
        _check_uint("sender_qpn", self.sender_qpn, 24)
        _check_uint("link_num", self.link_num, 8)
        _check_bytes("link_uid", self.link_uid, LINK_UID_LEN)
        _check_uint("max_links", self.max_links, 8)
        _check_uint("max_conns", self.max_conns, 8)
        _check_uint("flags", int(self.flags), 8)

    def _body(self, length_order: LengthOrder) -> bytes:
        return _pad(
            self.sender_mac
            + self.sender_gid
            + _u24(self.sender_qpn)
            + bytes((self.link_num,))
            + self.link_uid
            + bytes((self.max_links, self.max_conns))
        )

    @classmethod
    def _decode_body(cls, r: Reader, h: _Header) -> Self:
        msg = cls(
            sender_mac=r.raw(4, MAC_LEN, "sender_mac"),
            sender_gid=r.raw(10, GID_LEN, "sender_gid"),
            sender_qpn=r.u24(26, "sender_qp_num"),
            link_num=r.u8(29, "link_num"),
            link_uid=r.raw(30, LINK_UID_LEN, "link_uid"),
            max_links=r.u8(34, "max_links"),
            max_conns=r.u8(35, "max_conns"),
            flags=ConfirmLinkFlag(h.flags),
            v2=h.v2,
        )
        r.raw(36, 8, "reserved")
        return msg


@dataclass(frozen=True, slots=True)
class AddLinkV2Ext:
    """``struct smc_llc_msg_add_link_v2_ext``, appended to a v2 ADD LINK (offsets from the
    message start)::

        44 0x80 v2_direct  45 reserved  46 client_target_gid[16]  62 reserved[8]
        70 num_rkeys (u16, host order like length_v2)  72 rt[num_rkeys] (16 bytes each)
    """

    v2_direct: bool
    client_target_gid: bytes
    rkeys: tuple[AddLinkRkey, ...] = ()

    def __post_init__(self) -> None:
        _check_bytes("client_target_gid", self.client_target_gid, GID_LEN)
        _check_count("rkeys", self.rkeys, _MAX_V2_RKEYS)

    def _encode(self, length_order: LengthOrder) -> bytes:
        head = (
            bytes((0x80 if self.v2_direct else 0, 0))
            + self.client_target_gid
            + bytes(8)
            + len(self.rkeys).to_bytes(2, length_order)
        )
        return head + b"".join(rt._encode() for rt in self.rkeys)

    @classmethod
    def _read(cls, r: Reader, h: _Header) -> AddLinkV2Ext:
        base = LLC_MSG_LEN
        v2_direct = bool(r.u8(base, "v2_direct") & 0x80)
        gid = r.raw(base + 2, GID_LEN, "client_target_gid")
        r.raw(base + 18, 8, "reserved")
        off = base + 26
        r.need(off, 2, "num_rkeys")
        fits = (h.length - (base + _ADD_LINK_EXT_LEN)) // _RT_LEN
        counts = [r.u16(off, "num_rkeys", little=order == "little") for order in h.orders]
        # length_v2 told us the sender's byte order; only a palindromic length (0x0101 * k)
        # leaves it open, and then the count that fits the message decides.
        usable = [n for n in counts if n <= min(fits, _MAX_V2_RKEYS)]
        if not usable:
            raise ProtocolError(
                f"num_rkeys {counts[0]} exceeds the {min(fits, _MAX_V2_RKEYS)} rkey entries "
                f"the {h.length}-byte message can hold (max {_MAX_V2_RKEYS})",
                field="num_rkeys",
                offset=off,
            )
        n = usable[0]
        rt_off = base + _ADD_LINK_EXT_LEN
        rkeys = tuple(AddLinkRkey._read(r, rt_off + i * _RT_LEN, f"rt[{i}]") for i in range(n))
        return cls(v2_direct, gid, rkeys)


@dataclass(frozen=True, slots=True)
class AddLink(_LlcMessage):
    """ADD LINK, type 0x02 / 0x22 (``struct smc_llc_msg_add_link``)::

        2 add_link_rej_rsn (low nibble, v1 only)
        4 sender_mac[6]  10 reserved[2]  12 sender_gid[16]  28 sender_qp_num[3]  31 link_num
        32 qp_mtu (low nibble)  33 initial_psn[3]  36 reserved[8]  [44 add_link_v2_ext (v2)]

    In v2, bytes 1-2 are ``length_v2``, so a v2 reject carries no reason (Linux's reject path
    overwrites it too); ``ext`` is absent in v2 requests without a new link and in rejects.
    """

    sender_mac: bytes
    sender_gid: bytes
    sender_qpn: int
    link_num: int
    qp_mtu: int
    initial_psn: int
    reject_reason: AddLinkRejectReason | int = AddLinkRejectReason.NONE
    ext: AddLinkV2Ext | None = None
    flags: AddLinkFlag = _NO_ADDLINKFLAG
    v2: bool = False

    _BASE: ClassVar[int] = 0x2

    def __post_init__(self) -> None:
        _check_bytes("sender_mac", self.sender_mac, MAC_LEN)
        _check_bytes("sender_gid", self.sender_gid, GID_LEN)
        _check_uint("sender_qpn", self.sender_qpn, 24)
        _check_uint("link_num", self.link_num, 8)
        _check_uint("qp_mtu", self.qp_mtu, 4)
        _check_uint("initial_psn", self.initial_psn, 24)
        _check_uint("reject_reason", int(self.reject_reason), 4)
        _check_uint("flags", int(self.flags), 8)
        if self.v2 and self.reject_reason:
            raise ValueError("a v2 ADD LINK has no add_link_rej_rsn (bytes 1-2 are length_v2)")
        if self.ext is not None and not self.v2:
            raise ValueError("add_link_v2_ext exists only in v2 ADD LINK")

    def _byte2(self) -> int:
        return int(self.reject_reason)

    def _body(self, length_order: LengthOrder) -> bytes:
        fixed = _pad(
            self.sender_mac
            + bytes(2)
            + self.sender_gid
            + _u24(self.sender_qpn)
            + bytes((self.link_num, self.qp_mtu))
            + _u24(self.initial_psn)
        )
        if self.ext is None:
            return fixed
        return fixed + self.ext._encode(length_order)

    @classmethod
    def _decode_body(cls, r: Reader, h: _Header) -> Self:
        sender_mac = r.raw(4, MAC_LEN, "sender_mac")
        r.raw(10, 2, "reserved")
        sender_gid = r.raw(12, GID_LEN, "sender_gid")
        sender_qpn = r.u24(28, "sender_qp_num")
        link_num = r.u8(31, "link_num")
        qp_mtu = r.u8(32, "qp_mtu") & 0x0F
        initial_psn = r.u24(33, "initial_psn")
        r.raw(36, 8, "reserved")
        ext = AddLinkV2Ext._read(r, h) if h.v2 and h.length > LLC_MSG_LEN else None
        return cls(
            sender_mac=sender_mac,
            sender_gid=sender_gid,
            sender_qpn=sender_qpn,
            link_num=link_num,
            qp_mtu=qp_mtu,
            initial_psn=initial_psn,
            reject_reason=_enum_or_int(AddLinkRejectReason, h.rej_rsn),
            ext=ext,
            flags=AddLinkFlag(h.flags),
            v2=h.v2,
        )


@dataclass(frozen=True, slots=True)
class AddLinkCont(_LlcMessage):
    """ADD LINK CONTINUATION, type 0x03, v1 only (``struct smc_llc_msg_add_link_cont``)::

        4 link_num  5 num_rkeys  6 reserved[2]  8 rt[2] (16 bytes each)  40 reserved[4]

    ``num_rkeys`` counts the rkeys the sender still has to send, these included; the message
    carries ``min(num_rkeys, 2)`` of them.
    """

    link_num: int
    num_rkeys: int
    rkeys: tuple[AddLinkRkey, ...]
    flags: LlcFlag = _NO_LLCFLAG

    _BASE: ClassVar[int] = 0x3
    _ALWAYS_V2: ClassVar[bool | None] = False

    def __post_init__(self) -> None:
        _check_uint("link_num", self.link_num, 8)
        _check_uint("num_rkeys", self.num_rkeys, 8)
        _check_count("rkeys", self.rkeys, _MAX_ADD_LINK_CONT_RKEYS)
        if len(self.rkeys) != min(self.num_rkeys, _MAX_ADD_LINK_CONT_RKEYS):
            raise ValueError("an ADD LINK CONT carries min(num_rkeys, 2) rkeys")
        _check_uint("flags", int(self.flags), 8)

    def _body(self, length_order: LengthOrder) -> bytes:
        rts = b"".join(rt._encode() for rt in self.rkeys)
        return _pad(bytes((self.link_num, self.num_rkeys, 0, 0)) + rts)

    @classmethod
    def _decode_body(cls, r: Reader, h: _Header) -> Self:
        link_num = r.u8(4, "link_num")
        num_rkeys = r.u8(5, "num_rkeys")
        r.raw(6, 2, "reserved")
        slots = tuple(AddLinkRkey._read(r, 8 + i * _RT_LEN, f"rt[{i}]") for i in range(2))
        r.raw(40, 4, "reserved")
        n = min(num_rkeys, _MAX_ADD_LINK_CONT_RKEYS)
        return cls(link_num, num_rkeys, slots[:n], LlcFlag(h.flags))


@dataclass(frozen=True, slots=True)
class DeleteLink(_LlcMessage):
    """DELETE LINK, type 0x04 / 0x24 (``struct smc_llc_msg_del_link``, packed)::

        4 link_num  5 reason (be32)  9 reserved[35]

    With ``DeleteLinkFlag.ALL`` the whole link group goes and ``link_num`` is 0.
    """

    link_num: int
    reason: DeleteLinkReason | int
    flags: DeleteLinkFlag = _NO_DELETELINKFLAG
    v2: bool = False

    _BASE: ClassVar[int] = 0x4

    def __post_init__(self) -> None:
        _check_uint("link_num", self.link_num, 8)
        _check_uint("reason", int(self.reason), 32)
        _check_uint("flags", int(self.flags), 8)

    def _body(self, length_order: LengthOrder) -> bytes:
        return _pad(bytes((self.link_num,)) + int(self.reason).to_bytes(4, "big"))

    @classmethod
    def _decode_body(cls, r: Reader, h: _Header) -> Self:
        link_num = r.u8(4, "link_num")
        reason = r.u32(5, "reason")
        r.raw(9, 35, "reserved")
        return cls(link_num, _enum_or_int(DeleteLinkReason, reason), DeleteLinkFlag(h.flags), h.v2)


@dataclass(frozen=True, slots=True)
class ConfirmRkey(_LlcMessage):
    """CONFIRM RKEY, type 0x06 / 0x26 (``struct smc_llc_msg_confirm_rkey``)::

        4 rtoken[0] {num_rkeys, rmb_key be32, rmb_vaddr be64}   for the receiving link
        17 rtoken[1] {link_id, rmb_key, rmb_vaddr}  30 rtoken[2]  43 reserved

    ``rtoken[0]``'s first byte counts the other links' rtokens that follow (0..2).
    """

    rmb_key: int
    rmb_vaddr: int
    other_links: tuple[Rtoken, ...] = ()
    flags: RkeyFlag = _NO_RKEYFLAG
    v2: bool = False

    _BASE: ClassVar[int] = 0x6

    def __post_init__(self) -> None:
        _check_uint("rmb_key", self.rmb_key, 32)
        _check_uint("rmb_vaddr", self.rmb_vaddr, 64)
        _check_count("other_links", self.other_links, _MAX_CONFIRM_RKEY_OTHERS)
        _check_uint("flags", int(self.flags), 8)

    def _body(self, length_order: LengthOrder) -> bytes:
        first = _RTOKEN.pack(len(self.other_links), self.rmb_key, self.rmb_vaddr)
        others = b"".join(_RTOKEN.pack(t.link_id, t.rmb_key, t.rmb_vaddr) for t in self.other_links)
        return _pad(first + others)

    @classmethod
    def _decode_body(cls, r: Reader, h: _Header) -> Self:
        num = r.u8(4, "num_rkeys")
        if num > _MAX_CONFIRM_RKEY_OTHERS:
            raise ProtocolError(
                f"num_rkeys {num} exceeds the {_MAX_CONFIRM_RKEY_OTHERS} other-link rtokens "
                "a CONFIRM RKEY holds",
                field="num_rkeys",
                offset=4,
            )
        rmb_key = r.u32(5, "rtoken[0].rmb_key")
        rmb_vaddr = r.u64(9, "rtoken[0].rmb_vaddr")
        slots = tuple(_read_rtoken(r, 4 + i * _RTOKEN_LEN, f"rtoken[{i}]") for i in range(1, 3))
        r.raw(43, 1, "reserved")
        return cls(rmb_key, rmb_vaddr, slots[:num], RkeyFlag(h.flags), h.v2)


@dataclass(frozen=True, slots=True)
class ConfirmRkeyCont(_LlcMessage):
    """CONFIRM RKEY CONTINUATION, type 0x08, v1 only (RFC 7609; Linux never sends it — three
    links' rtokens fit one CONFIRM RKEY — and ignores it on receipt)::

        4 num_rkeys  5 rtoken[3] {link_id, rmb_key be32, rmb_vaddr be64} (13 bytes each)

    ``num_rkeys`` counts the rtokens still to come, these included; ``min(num_rkeys, 3)`` are
    present.
    """

    num_rkeys: int
    rtokens: tuple[Rtoken, ...]
    flags: RkeyFlag = _NO_RKEYFLAG

    _BASE: ClassVar[int] = 0x8
    _ALWAYS_V2: ClassVar[bool | None] = False

    def __post_init__(self) -> None:
        _check_uint("num_rkeys", self.num_rkeys, 8)
        _check_count("rtokens", self.rtokens, _MAX_CONFIRM_RKEY_CONT)
        if len(self.rtokens) != min(self.num_rkeys, _MAX_CONFIRM_RKEY_CONT):
            raise ValueError("a CONFIRM RKEY CONT carries min(num_rkeys, 3) rtokens")
        _check_uint("flags", int(self.flags), 8)

    def _body(self, length_order: LengthOrder) -> bytes:
        toks = b"".join(_RTOKEN.pack(t.link_id, t.rmb_key, t.rmb_vaddr) for t in self.rtokens)
        return _pad(bytes((self.num_rkeys,)) + toks)

    @classmethod
    def _decode_body(cls, r: Reader, h: _Header) -> Self:
        num = r.u8(4, "num_rkeys")
        slots = tuple(_read_rtoken(r, 5 + i * _RTOKEN_LEN, f"rtoken[{i}]") for i in range(3))
        return cls(num, slots[: min(num, _MAX_CONFIRM_RKEY_CONT)], RkeyFlag(h.flags))


@dataclass(frozen=True, slots=True)
class TestLink(_LlcMessage):
    """TEST LINK, type 0x07 / 0x27 (``struct smc_llc_msg_test_link``)::

        4 user_data[16]  20 reserved[24]

    The response echoes the request with ``RESPONSE`` set (:meth:`response`).
    """

    __test__: ClassVar[bool] = False  # not a pytest test class despite the name

    user_data: bytes = bytes(16)
    flags: LlcFlag = _NO_LLCFLAG
    v2: bool = False

    _BASE: ClassVar[int] = 0x7

    def __post_init__(self) -> None:
        _check_bytes("user_data", self.user_data, 16)
        _check_uint("flags", int(self.flags), 8)

    def response(self) -> TestLink:
        """The echo Linux sends back (``smc_llc_event_handler``: same message, RESP set)."""
        return TestLink(self.user_data, self.flags | LlcFlag.RESPONSE, self.v2)

    def _body(self, length_order: LengthOrder) -> bytes:
        return _pad(self.user_data)

    @classmethod
    def _decode_body(cls, r: Reader, h: _Header) -> Self:
        data = r.raw(4, 16, "user_data")
        r.raw(20, 24, "reserved")
        return cls(data, LlcFlag(h.flags), h.v2)


@dataclass(frozen=True, slots=True)
class DeleteRkey(_LlcMessage):
    """DELETE RKEY, type 0x09, v1 (``struct smc_llc_msg_delete_rkey``)::

        4 num_rkeys  5 err_mask  6 reserved[2]  8 rkey[8] (be32)  40 reserved[4]

    In a negative response, ``err_mask`` bit ``0x80 >> i`` marks ``rkeys[i]`` as unknown.
    """

    rkeys: tuple[int, ...]
    err_mask: int = 0
    flags: RkeyFlag = _NO_RKEYFLAG

    _BASE: ClassVar[int] = 0x9
    _ALWAYS_V2: ClassVar[bool | None] = False

    def __post_init__(self) -> None:
        _check_count("rkeys", self.rkeys, _MAX_DELETE_RKEYS)
        for i, rkey in enumerate(self.rkeys):
            _check_uint(f"rkeys[{i}]", rkey, 32)
        _check_uint("err_mask", self.err_mask, 8)
        _check_uint("flags", int(self.flags), 8)

    def _body(self, length_order: LengthOrder) -> bytes:
        keys = b"".join(k.to_bytes(4, "big") for k in self.rkeys)
        return _pad(bytes((len(self.rkeys), self.err_mask, 0, 0)) + keys)

    @classmethod
    def _decode_body(cls, r: Reader, h: _Header) -> Self:
        num = r.u8(4, "num_rkeys")
        if num > _MAX_DELETE_RKEYS:
            raise ProtocolError(
                f"num_rkeys {num} exceeds the {_MAX_DELETE_RKEYS} rkeys a DELETE RKEY holds",
                field="num_rkeys",
                offset=4,
            )
        err_mask = r.u8(5, "err_mask")
        r.raw(6, 2, "reserved")
        slots = tuple(r.u32(8 + 4 * i, f"rkey[{i}]") for i in range(_MAX_DELETE_RKEYS))
        r.raw(40, 4, "reserved")
        return cls(slots[:num], err_mask, RkeyFlag(h.flags))


@dataclass(frozen=True, slots=True)
class DeleteRkeyV2(_LlcMessage):
    """DELETE RKEY v2, type 0x29 (``struct smc_llc_msg_delete_rkey_v2``)::

        4 num_rkeys  5 num_inval_rkeys  6 reserved[2]  8 rkey[num_rkeys] (be32)

    At least 44 bytes (zero padded): Linux sends one rkey in a 44-byte message and answers with
    the request's ``num_rkeys``, the rkeys zeroed and ``num_inval_rkeys`` (+ NEGATIVE) set.
    """

    rkeys: tuple[int, ...]
    num_inval_rkeys: int = 0
    flags: RkeyFlag = _NO_RKEYFLAG

    _BASE: ClassVar[int] = 0x9
    _ALWAYS_V2: ClassVar[bool | None] = True

    def __post_init__(self) -> None:
        _check_count("rkeys", self.rkeys, _MAX_V2_RKEYS)
        for i, rkey in enumerate(self.rkeys):
            _check_uint(f"rkeys[{i}]", rkey, 32)
        _check_uint("num_inval_rkeys", self.num_inval_rkeys, 8)
        _check_uint("flags", int(self.flags), 8)

    def _body(self, length_order: LengthOrder) -> bytes:
        body = bytes((len(self.rkeys), self.num_inval_rkeys, 0, 0))
        body += b"".join(k.to_bytes(4, "big") for k in self.rkeys)
        return _pad(body, max(len(body), LLC_MSG_LEN - 4))

    @classmethod
    def _decode_body(cls, r: Reader, h: _Header) -> Self:
        num = r.u8(4, "num_rkeys")
        fits = (h.length - _DELETE_RKEY_FIXED) // 4
        if num > fits:
            raise ProtocolError(
                f"num_rkeys {num} exceeds the {fits} rkeys the {h.length}-byte message holds",
                field="num_rkeys",
                offset=4,
            )
        inval = r.u8(5, "num_inval_rkeys")
        r.raw(6, 2, "reserved")
        keys = tuple(r.u32(_DELETE_RKEY_FIXED + 4 * i, f"rkey[{i}]") for i in range(num))
        return cls(keys, inval, RkeyFlag(h.flags))


@dataclass(frozen=True, slots=True)
class ReqAddLinkV2(_LlcMessage):
    """REQUEST ADD LINK v2, type 0x25 (``struct smc_llc_msg_req_add_link_v2``): the client
    invites the server to add a link and lists its usable GIDs::

        4 reserved[20]  24 gid_cnt  25 reserved[3]  28 gid[gid_cnt][16]

    At least 44 bytes; Linux's response is the 44-byte message with RESPONSE set and the body
    zeroed (no GIDs).
    """

    gids: tuple[bytes, ...] = ()
    flags: LlcFlag = _NO_LLCFLAG

    _BASE: ClassVar[int] = 0x5
    _ALWAYS_V2: ClassVar[bool | None] = True

    def __post_init__(self) -> None:
        _check_count("gids", self.gids, 255)
        for i, gid in enumerate(self.gids):
            _check_bytes(f"gids[{i}]", gid, GID_LEN)
        _check_uint("flags", int(self.flags), 8)

    def _body(self, length_order: LengthOrder) -> bytes:
        body = bytes(20) + bytes((len(self.gids), 0, 0, 0)) + b"".join(self.gids)
        return _pad(body, max(len(body), LLC_MSG_LEN - 4))

    @classmethod
    def _decode_body(cls, r: Reader, h: _Header) -> Self:
        r.raw(4, 20, "reserved")
        num = r.u8(24, "gid_cnt")
        fits = (h.length - _REQ_ADD_LINK_FIXED) // GID_LEN
        if num > fits:
            raise ProtocolError(
                f"gid_cnt {num} exceeds the {fits} GIDs the {h.length}-byte message holds",
                field="gid_cnt",
                offset=24,
            )
        gids = tuple(
            r.raw(_REQ_ADD_LINK_FIXED + GID_LEN * i, GID_LEN, f"gid[{i}]") for i in range(num)
        )
        return cls(gids, LlcFlag(h.flags))


LlcMessage: TypeAlias = (
    ConfirmLink
    | AddLink
    | AddLinkCont
    | DeleteLink
    | ConfirmRkey
    | ConfirmRkeyCont
    | TestLink
    | DeleteRkey
    | DeleteRkeyV2
    | ReqAddLinkV2
)

_V1_CLASSES: dict[int, type[LlcMessage]] = {
    0x1: ConfirmLink,
    0x2: AddLink,
    0x3: AddLinkCont,
    0x4: DeleteLink,
    0x6: ConfirmRkey,
    0x7: TestLink,
    0x8: ConfirmRkeyCont,
    0x9: DeleteRkey,
}
_V2_CLASSES: dict[int, type[LlcMessage]] = {
    0x1: ConfirmLink,
    0x2: AddLink,
    0x4: DeleteLink,
    0x5: ReqAddLinkV2,
    0x6: ConfirmRkey,
    0x7: TestLink,
    0x9: DeleteRkeyV2,
}


def decode(data: bytes | bytearray | memoryview) -> LlcMessage:
    """Decode one LLC message (v1 or v2) of exactly the bytes received.

    Raises :class:`~smcd_daemon.errors.UnknownMessageError` for a type byte that names no LLC
    message (0xFE, CDC, included), :class:`~smcd_daemon.errors.TruncatedError` when a field is
    cut off, and :class:`~smcd_daemon.errors.ProtocolError` for a wrong length byte, a
    ``length_v2`` that matches the message length in neither byte order, or a count that
    exceeds what the message can hold.
    """
    r = Reader(data)
    h = _decode_header(r)
    cls = (_V2_CLASSES if h.v2 else _V1_CLASSES)[h.base]
    return cls._decode_body(r, h)
