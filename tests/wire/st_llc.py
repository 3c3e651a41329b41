"""Hypothesis strategies and sample encodings for LLC messages (v1 and v2).

Imported by the LLC tests, the fuzz tests and the tshark cross-check. ``SAMPLES`` holds one or
more valid encodings of every LLC type; v2 ones appear in both ``length_v2`` byte orders.
"""

from __future__ import annotations

from typing import TypeVar

from hypothesis import strategies as st

from smcd_daemon.wire import llc
from smcd_daemon.wire.llc import (
    AddLink,
    AddLinkCont,
    AddLinkFlag,
    AddLinkRejectReason,
    AddLinkRkey,
    AddLinkV2Ext,
    ConfirmLink,
    ConfirmLinkFlag,
    ConfirmRkey,
    ConfirmRkeyCont,
    DeleteLink,
    DeleteLinkFlag,
    DeleteLinkReason,
    DeleteRkey,
    DeleteRkeyV2,
    LlcFlag,
    LlcMessage,
    ReqAddLinkV2,
    RkeyFlag,
    Rtoken,
    TestLink,
)

__all__ = ["LENGTH_ORDERS", "SAMPLES", "llc_messages", "llc_v1_messages", "llc_v2_messages"]

LENGTH_ORDERS: tuple[llc.LengthOrder, ...] = ("little", "big")

_F = TypeVar("_F", bound=int)

u8 = st.integers(0, 0xFF)
u24 = st.integers(0, 0xFFFFFF)
u32 = st.integers(0, 0xFFFFFFFF)
u64 = st.integers(0, (1 << 64) - 1)
macs = st.binary(min_size=6, max_size=6)
gids = st.binary(min_size=16, max_size=16)


def _flags(cls: type[_F]) -> st.SearchStrategy[_F]:
    return u8.map(cls)


def _reason() -> st.SearchStrategy[DeleteLinkReason | int]:
    def known_or_int(value: int) -> DeleteLinkReason | int:
        try:
            return DeleteLinkReason(value)
        except ValueError:
            return value

    return st.one_of(st.sampled_from(DeleteLinkReason), u32.map(known_or_int))


_add_link_rkeys = st.builds(AddLinkRkey, u32, u32, u64)
_rtokens = st.builds(Rtoken, u8, u32, u64)


def _confirm_link(v2: bool) -> st.SearchStrategy[ConfirmLink]:
    return st.builds(
        ConfirmLink,
        sender_mac=macs,
        sender_gid=gids,
        sender_qpn=u24,
        link_num=u8,
        link_uid=st.binary(min_size=4, max_size=4),
        max_links=u8,
        max_conns=u8,
        flags=_flags(ConfirmLinkFlag),
        v2=st.just(v2),
    )


def _add_link(v2: bool) -> st.SearchStrategy[AddLink]:
    ext = st.none()
    reason = st.integers(0, 15).map(
        lambda v: AddLinkRejectReason(v) if v in AddLinkRejectReason._value2member_map_ else v
    )
    if v2:
        ext = st.one_of(
            st.none(),
            st.builds(
                AddLinkV2Ext,
                v2_direct=st.booleans(),
                client_target_gid=gids,
                rkeys=st.lists(_add_link_rkeys, max_size=6).map(tuple),
            ),
        )
        reason = st.just(AddLinkRejectReason.NONE)
    return st.builds(
        AddLink,
        sender_mac=macs,
        sender_gid=gids,
        sender_qpn=u24,
        link_num=u8,
        qp_mtu=st.integers(0, 15),
        initial_psn=u24,
        reject_reason=reason,
        ext=ext,
        flags=_flags(AddLinkFlag),
        v2=st.just(v2),
    )


def _add_link_cont() -> st.SearchStrategy[AddLinkCont]:
    def build(link_num: int, num: int, pool: list[AddLinkRkey], flags: int) -> AddLinkCont:
        return AddLinkCont(link_num, num, tuple(pool[: min(num, 2)]), LlcFlag(flags))

    return st.builds(build, u8, u8, st.lists(_add_link_rkeys, min_size=2, max_size=2), u8)


def _confirm_rkey_cont() -> st.SearchStrategy[ConfirmRkeyCont]:
    def build(num: int, pool: list[Rtoken], flags: int) -> ConfirmRkeyCont:
        return ConfirmRkeyCont(num, tuple(pool[: min(num, 3)]), RkeyFlag(flags))

    return st.builds(build, u8, st.lists(_rtokens, min_size=3, max_size=3), u8)


def _delete_link(v2: bool) -> st.SearchStrategy[DeleteLink]:
    return st.builds(DeleteLink, u8, _reason(), _flags(DeleteLinkFlag), st.just(v2))


def _confirm_rkey(v2: bool) -> st.SearchStrategy[ConfirmRkey]:
    return st.builds(
        ConfirmRkey,
        u32,
        u64,
        st.lists(_rtokens, max_size=2).map(tuple),
        _flags(RkeyFlag),
        st.just(v2),
    )


def _test_link(v2: bool) -> st.SearchStrategy[TestLink]:
    return st.builds(TestLink, st.binary(min_size=16, max_size=16), _flags(LlcFlag), st.just(v2))


def llc_v1_messages() -> st.SearchStrategy[LlcMessage]:
    return st.one_of(
        _confirm_link(False),
        _add_link(False),
        _add_link_cont(),
        _delete_link(False),
        _confirm_rkey(False),
        _confirm_rkey_cont(),
        _test_link(False),
        st.builds(DeleteRkey, st.lists(u32, max_size=8).map(tuple), u8, _flags(RkeyFlag)),
    )


def llc_v2_messages() -> st.SearchStrategy[LlcMessage]:
    return st.one_of(
        _confirm_link(True),
        _add_link(True),
        _delete_link(True),
        _confirm_rkey(True),
        _test_link(True),
        st.builds(DeleteRkeyV2, st.lists(u32, max_size=40).map(tuple), u8, _flags(RkeyFlag)),
        st.builds(ReqAddLinkV2, st.lists(gids, max_size=12).map(tuple), _flags(LlcFlag)),
    )


def llc_messages() -> st.SearchStrategy[LlcMessage]:
    """Any LLC message of any type, v1 or v2."""
    return st.one_of(llc_v1_messages(), llc_v2_messages())


# ---------------------------------------------------------------------------- samples
_MAC = bytes.fromhex("020000aabbcc")
_GID = bytes(10) + b"\xff\xff" + bytes((127, 0, 0, 1))  # ::ffff:127.0.0.1
_GID2 = bytes(10) + b"\xff\xff" + bytes((192, 0, 2, 7))  # ::ffff:192.0.2.7

_V1: list[LlcMessage] = [
    ConfirmLink(_MAC, _GID, 0x000456, 1, bytes.fromhex("aabbcc01"), 2),
    ConfirmLink(_MAC, _GID, 0x000456, 1, bytes.fromhex("aabbcc01"), 2, flags=ConfirmLinkFlag(0x83)),
    AddLink(_MAC, _GID, 0x000789, 2, 3, 0x000ABC),
    AddLink(
        _MAC,
        _GID,
        0,
        0,
        0,
        0,
        reject_reason=AddLinkRejectReason.NO_ALT_PATH,
        flags=AddLinkFlag.RESPONSE | AddLinkFlag.REJECT,
    ),
    AddLinkCont(2, 3, (AddLinkRkey(0x11, 0x22, 0x7F0000100000), AddLinkRkey(0x33, 0x44, 0x55))),
    AddLinkCont(2, 1, (AddLinkRkey(0x66, 0x77, 0x88),), LlcFlag.RESPONSE),
    DeleteLink(
        0, DeleteLinkReason.OPERATOR_TERMINATION, DeleteLinkFlag.ALL | DeleteLinkFlag.ORDERLY
    ),
    DeleteLink(3, DeleteLinkReason.UNKNOWN_LINK, DeleteLinkFlag.RESPONSE),
    ConfirmRkey(0x11112222, 0x7F0000100000, (Rtoken(2, 0x33334444, 0x7F0000200000),)),
    ConfirmRkey(1, 2, (), RkeyFlag.RESPONSE | RkeyFlag.NEGATIVE | RkeyFlag.RETRY),
    ConfirmRkeyCont(4, (Rtoken(1, 2, 3), Rtoken(4, 5, 6), Rtoken(7, 8, 9))),
    TestLink(bytes(range(16))),
    TestLink(bytes(16), LlcFlag.RESPONSE),
    DeleteRkey((0x11112222,)),
    DeleteRkey(tuple(range(1, 9)), 0xA0, RkeyFlag.RESPONSE | RkeyFlag.NEGATIVE),
]

_V2: list[LlcMessage] = [
    ConfirmLink(_MAC, _GID, 0x000456, 1, bytes.fromhex("aabbcc01"), 2, max_conns=255, v2=True),
    AddLink(_MAC, _GID, 0x000789, 2, 3, 0x000ABC, v2=True),
    AddLink(
        _MAC,
        _GID2,
        0x000789,
        2,
        3,
        0x000ABC,
        ext=AddLinkV2Ext(True, _GID2, (AddLinkRkey(1, 2, 3), AddLinkRkey(4, 5, 6))),
        v2=True,
    ),
    AddLink(_MAC, _GID, 0, 0, 0, 0, flags=AddLinkFlag.RESPONSE | AddLinkFlag.REJECT, v2=True),
    DeleteLink(0, DeleteLinkReason.LOST_PATH, DeleteLinkFlag.ALL, v2=True),
    ReqAddLinkV2((_GID, _GID2)),
    ReqAddLinkV2((), LlcFlag.RESPONSE),
    ConfirmRkey(0x11112222, 0x7F0000100000, v2=True),
    TestLink(bytes(range(16)), v2=True),
    DeleteRkeyV2((0x11112222,)),
    DeleteRkeyV2(tuple(range(1, 20)), 3, RkeyFlag.RESPONSE | RkeyFlag.NEGATIVE),
]

SAMPLES: list[bytes] = [m.encode() for m in _V1] + [
    m.encode(length_order=order) for m in _V2 for order in LENGTH_ORDERS
]
