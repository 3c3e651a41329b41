"""LLC messages that exchange the rkeys of RMBs (Linux ``smc_llc.h``, PROTOCOL.md §1.7):
CONFIRM RKEY, CONFIRM RKEY CONT, DELETE RKEY and DELETE RKEY v2. Import them from
``smcd_daemon.wire.llc``."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import ClassVar, Self

from smcd_daemon.wire._fields import ProtocolError, Reader
from smcd_daemon.wire.llc_base import (
    LLC_MSG_LEN,
    MAX_V2_RKEYS,
    RTOKEN_LEN,
    LengthOrder,
    LlcHeader,
    LlcMessageBase,
    RkeyFlag,
    Rtoken,
    check_count,
    check_uint,
    pad,
    read_rtoken,
)

_DELETE_RKEY_FIXED = 8  # sizeof(struct smc_llc_msg_delete_rkey_v2) without rkey[]
_MAX_CONFIRM_RKEY_OTHERS = 2  # SMC_LLC_RKEYS_PER_MSG - 1: rtoken[0] is the receiving link's
_MAX_CONFIRM_RKEY_CONT = 3  # SMC_LLC_RKEYS_PER_MSG
_MAX_DELETE_RKEYS = 8  # SMC_LLC_DEL_RKEY_MAX

_RTOKEN = struct.Struct(">BIQ")

_NO_RKEYFLAG = RkeyFlag(0)


@dataclass(frozen=True, slots=True)
class ConfirmRkey(LlcMessageBase):
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
        check_uint("rmb_key", self.rmb_key, 32)
        check_uint("rmb_vaddr", self.rmb_vaddr, 64)
        check_count("other_links", self.other_links, _MAX_CONFIRM_RKEY_OTHERS)
        check_uint("flags", int(self.flags), 8)

    def _body(self, length_order: LengthOrder) -> bytes:
        first = _RTOKEN.pack(len(self.other_links), self.rmb_key, self.rmb_vaddr)
        others = b"".join(_RTOKEN.pack(t.link_id, t.rmb_key, t.rmb_vaddr) for t in self.other_links)
        return pad(first + others)

    @classmethod
    def decode_body(cls, r: Reader, h: LlcHeader) -> Self:
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
        slots = tuple(read_rtoken(r, 4 + i * RTOKEN_LEN, f"rtoken[{i}]") for i in range(1, 3))
        r.raw(43, 1, "reserved")
        return cls(rmb_key, rmb_vaddr, slots[:num], RkeyFlag(h.flags), h.v2)


@dataclass(frozen=True, slots=True)
class ConfirmRkeyCont(LlcMessageBase):
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
        check_uint("num_rkeys", self.num_rkeys, 8)
        check_count("rtokens", self.rtokens, _MAX_CONFIRM_RKEY_CONT)
        if len(self.rtokens) != min(self.num_rkeys, _MAX_CONFIRM_RKEY_CONT):
            raise ValueError("a CONFIRM RKEY CONT carries min(num_rkeys, 3) rtokens")
        check_uint("flags", int(self.flags), 8)

    def _body(self, length_order: LengthOrder) -> bytes:
        toks = b"".join(_RTOKEN.pack(t.link_id, t.rmb_key, t.rmb_vaddr) for t in self.rtokens)
        return pad(bytes((self.num_rkeys,)) + toks)

    @classmethod
    def decode_body(cls, r: Reader, h: LlcHeader) -> Self:
        num = r.u8(4, "num_rkeys")
        slots = tuple(read_rtoken(r, 5 + i * RTOKEN_LEN, f"rtoken[{i}]") for i in range(3))
        return cls(num, slots[: min(num, _MAX_CONFIRM_RKEY_CONT)], RkeyFlag(h.flags))


@dataclass(frozen=True, slots=True)
class DeleteRkey(LlcMessageBase):
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
        check_count("rkeys", self.rkeys, _MAX_DELETE_RKEYS)
        for i, rkey in enumerate(self.rkeys):
            check_uint(f"rkeys[{i}]", rkey, 32)
        check_uint("err_mask", self.err_mask, 8)
        check_uint("flags", int(self.flags), 8)

    def _body(self, length_order: LengthOrder) -> bytes:
        keys = b"".join(k.to_bytes(4, "big") for k in self.rkeys)
        return pad(bytes((len(self.rkeys), self.err_mask, 0, 0)) + keys)

    @classmethod
    def decode_body(cls, r: Reader, h: LlcHeader) -> Self:
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
class DeleteRkeyV2(LlcMessageBase):
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
        check_count("rkeys", self.rkeys, MAX_V2_RKEYS)
        for i, rkey in enumerate(self.rkeys):
            check_uint(f"rkeys[{i}]", rkey, 32)
        check_uint("num_inval_rkeys", self.num_inval_rkeys, 8)
        check_uint("flags", int(self.flags), 8)

    def _body(self, length_order: LengthOrder) -> bytes:
        body = bytes((len(self.rkeys), self.num_inval_rkeys, 0, 0))
        body += b"".join(k.to_bytes(4, "big") for k in self.rkeys)
        return pad(body, max(len(body), LLC_MSG_LEN - 4))

    @classmethod
    def decode_body(cls, r: Reader, h: LlcHeader) -> Self:
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
