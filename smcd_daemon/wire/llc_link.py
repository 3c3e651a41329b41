"""LLC messages that manage links (Linux ``smc_llc.h``, PROTOCOL.md §1.7): CONFIRM LINK,
ADD LINK (with its v2 rkey extension), ADD LINK CONT, DELETE LINK, TEST LINK and REQUEST ADD
LINK v2. Import them from ``smcd_daemon.wire.llc``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Self

from smcd_daemon.wire._fields import ProtocolError, Reader
from smcd_daemon.wire.llc_base import (
    ADD_LINK_RKEY_LEN,
    GID_LEN,
    LINK_UID_LEN,
    LLC_MSG_LEN,
    MAC_LEN,
    MAX_V2_RKEYS,
    AddLinkFlag,
    AddLinkRejectReason,
    AddLinkRkey,
    ConfirmLinkFlag,
    DeleteLinkFlag,
    DeleteLinkReason,
    LengthOrder,
    LlcFlag,
    LlcHeader,
    LlcMessageBase,
    check_bytes,
    check_count,
    check_uint,
    enum_or_int,
    pack_add_link_rkey,
    pad,
    read_add_link_rkey,
    u24,
)

_ADD_LINK_EXT_LEN = 28  # sizeof(struct smc_llc_msg_add_link_v2_ext) without rt[]
_REQ_ADD_LINK_FIXED = 28  # sizeof(struct smc_llc_msg_req_add_link_v2) without gid[]
_MAX_ADD_LINK_CONT_RKEYS = 2  # SMC_LLC_RKEYS_PER_CONT_MSG

_NO_LLCFLAG = LlcFlag(0)
_NO_ADDLINKFLAG = AddLinkFlag(0)
_NO_DELETELINKFLAG = DeleteLinkFlag(0)


@dataclass(frozen=True, slots=True)
class ConfirmLink(LlcMessageBase):
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
        check_bytes("sender_mac", self.sender_mac, MAC_LEN)
        check_bytes("sender_gid", self.sender_gid, GID_LEN)
        check_uint("sender_qpn", self.sender_qpn, 24)
        check_uint("link_num", self.link_num, 8)
        check_bytes("link_uid", self.link_uid, LINK_UID_LEN)
        check_uint("max_links", self.max_links, 8)
        check_uint("max_conns", self.max_conns, 8)
        check_uint("flags", int(self.flags), 8)

    def _body(self, length_order: LengthOrder) -> bytes:
        return pad(
            self.sender_mac
            + self.sender_gid
            + u24(self.sender_qpn)
            + bytes((self.link_num,))
            + self.link_uid
            + bytes((self.max_links, self.max_conns))
        )

    @classmethod
    def decode_body(cls, r: Reader, h: LlcHeader) -> Self:
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
        check_bytes("client_target_gid", self.client_target_gid, GID_LEN)
        check_count("rkeys", self.rkeys, MAX_V2_RKEYS)

    def _encode(self, length_order: LengthOrder) -> bytes:
        head = (
            bytes((0x80 if self.v2_direct else 0, 0))
            + self.client_target_gid
            + bytes(8)
            + len(self.rkeys).to_bytes(2, length_order)
        )
        return head + b"".join(pack_add_link_rkey(rt) for rt in self.rkeys)

    @classmethod
    def _read(cls, r: Reader, h: LlcHeader) -> AddLinkV2Ext:
        base = LLC_MSG_LEN
        v2_direct = bool(r.u8(base, "v2_direct") & 0x80)
        gid = r.raw(base + 2, GID_LEN, "client_target_gid")
        r.raw(base + 18, 8, "reserved")
        off = base + 26
        r.need(off, 2, "num_rkeys")
        fits = (h.length - (base + _ADD_LINK_EXT_LEN)) // ADD_LINK_RKEY_LEN
        counts = [r.u16(off, "num_rkeys", little=order == "little") for order in h.orders]
        # length_v2 told us the sender's byte order; only a palindromic length (0x0101 * k)
        # leaves it open, and then the count that fits the message decides.
        usable = [n for n in counts if n <= min(fits, MAX_V2_RKEYS)]
        if not usable:
            raise ProtocolError(
                f"num_rkeys {counts[0]} exceeds the {min(fits, MAX_V2_RKEYS)} rkey entries "
                f"the {h.length}-byte message can hold (max {MAX_V2_RKEYS})",
                field="num_rkeys",
                offset=off,
            )
        n = usable[0]
        rt_off = base + _ADD_LINK_EXT_LEN
        rkeys = tuple(
            read_add_link_rkey(r, rt_off + i * ADD_LINK_RKEY_LEN, f"rt[{i}]") for i in range(n)
        )
        return cls(v2_direct, gid, rkeys)


@dataclass(frozen=True, slots=True)
class AddLink(LlcMessageBase):
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
        check_bytes("sender_mac", self.sender_mac, MAC_LEN)
        check_bytes("sender_gid", self.sender_gid, GID_LEN)
        check_uint("sender_qpn", self.sender_qpn, 24)
        check_uint("link_num", self.link_num, 8)
        check_uint("qp_mtu", self.qp_mtu, 4)
        check_uint("initial_psn", self.initial_psn, 24)
        check_uint("reject_reason", int(self.reject_reason), 4)
        check_uint("flags", int(self.flags), 8)
        if self.v2 and self.reject_reason:
            raise ValueError("a v2 ADD LINK has no add_link_rej_rsn (bytes 1-2 are length_v2)")
        if self.ext is not None and not self.v2:
            raise ValueError("add_link_v2_ext exists only in v2 ADD LINK")

    def _byte2(self) -> int:
        return int(self.reject_reason)

    def _body(self, length_order: LengthOrder) -> bytes:
        fixed = pad(
            self.sender_mac
            + bytes(2)
            + self.sender_gid
            + u24(self.sender_qpn)
            + bytes((self.link_num, self.qp_mtu))
            + u24(self.initial_psn)
        )
        if self.ext is None:
            return fixed
        return fixed + self.ext._encode(length_order)

    @classmethod
    def decode_body(cls, r: Reader, h: LlcHeader) -> Self:
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
            reject_reason=enum_or_int(AddLinkRejectReason, h.rej_rsn),
            ext=ext,
            flags=AddLinkFlag(h.flags),
            v2=h.v2,
        )


@dataclass(frozen=True, slots=True)
class AddLinkCont(LlcMessageBase):
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
        check_uint("link_num", self.link_num, 8)
        check_uint("num_rkeys", self.num_rkeys, 8)
        check_count("rkeys", self.rkeys, _MAX_ADD_LINK_CONT_RKEYS)
        if len(self.rkeys) != min(self.num_rkeys, _MAX_ADD_LINK_CONT_RKEYS):
            raise ValueError("an ADD LINK CONT carries min(num_rkeys, 2) rkeys")
        check_uint("flags", int(self.flags), 8)

    def _body(self, length_order: LengthOrder) -> bytes:
        rts = b"".join(pack_add_link_rkey(rt) for rt in self.rkeys)
        return pad(bytes((self.link_num, self.num_rkeys, 0, 0)) + rts)

    @classmethod
    def decode_body(cls, r: Reader, h: LlcHeader) -> Self:
        link_num = r.u8(4, "link_num")
        num_rkeys = r.u8(5, "num_rkeys")
        r.raw(6, 2, "reserved")
        slots = tuple(
            read_add_link_rkey(r, 8 + i * ADD_LINK_RKEY_LEN, f"rt[{i}]") for i in range(2)
        )
        r.raw(40, 4, "reserved")
        n = min(num_rkeys, _MAX_ADD_LINK_CONT_RKEYS)
        return cls(link_num, num_rkeys, slots[:n], LlcFlag(h.flags))


@dataclass(frozen=True, slots=True)
class DeleteLink(LlcMessageBase):
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
        check_uint("link_num", self.link_num, 8)
        check_uint("reason", int(self.reason), 32)
        check_uint("flags", int(self.flags), 8)

    def _body(self, length_order: LengthOrder) -> bytes:
        return pad(bytes((self.link_num,)) + int(self.reason).to_bytes(4, "big"))

    @classmethod
    def decode_body(cls, r: Reader, h: LlcHeader) -> Self:
        link_num = r.u8(4, "link_num")
        reason = r.u32(5, "reason")
        r.raw(9, 35, "reserved")
        return cls(link_num, enum_or_int(DeleteLinkReason, reason), DeleteLinkFlag(h.flags), h.v2)


@dataclass(frozen=True, slots=True)
class TestLink(LlcMessageBase):
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
        check_bytes("user_data", self.user_data, 16)
        check_uint("flags", int(self.flags), 8)

    def response(self) -> TestLink:
        """The echo Linux sends back (``smc_llc_event_handler``: same message, RESP set)."""
        return TestLink(self.user_data, self.flags | LlcFlag.RESPONSE, self.v2)

    def _body(self, length_order: LengthOrder) -> bytes:
        return pad(self.user_data)

    @classmethod
    def decode_body(cls, r: Reader, h: LlcHeader) -> Self:
        data = r.raw(4, 16, "user_data")
        r.raw(20, 24, "reserved")
        return cls(data, LlcFlag(h.flags), h.v2)


@dataclass(frozen=True, slots=True)
class ReqAddLinkV2(LlcMessageBase):
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
        check_count("gids", self.gids, 255)
        for i, gid in enumerate(self.gids):
            check_bytes(f"gids[{i}]", gid, GID_LEN)
        check_uint("flags", int(self.flags), 8)

    def _body(self, length_order: LengthOrder) -> bytes:
        body = bytes(20) + bytes((len(self.gids), 0, 0, 0)) + b"".join(self.gids)
        return pad(body, max(len(body), LLC_MSG_LEN - 4))

    @classmethod
    def decode_body(cls, r: Reader, h: LlcHeader) -> Self:
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
