"""LLC codec: golden vectors from the kernel structs, round trips, hostile input."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from smcd_daemon.errors import ProtocolError, TruncatedError, UnknownMessageError
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
    LlcType,
    ReqAddLinkV2,
    RkeyFlag,
    Rtoken,
    TestLink,
)
from tests.wire.st_llc import LENGTH_ORDERS, SAMPLES, llc_messages, llc_v1_messages

MAC = bytes.fromhex("020000aabbcc")
GID = bytes.fromhex("00000000000000000000ffff7f000001")  # ::ffff:127.0.0.1
GID2 = bytes.fromhex("00000000000000000000ffffc0000207")  # ::ffff:192.0.2.7


def hx(*parts: str) -> bytes:
    return bytes.fromhex("".join(parts))


def z(n: int) -> str:
    return "00" * n


# Each vector: (message, {length_order: bytes}); v1 vectors have one encoding for both orders.
# Values of the v1 vectors are those of the PROTOCOL.md Appendix B probe that tshark decoded.
CONFIRM_LINK = hx(
    "01",  # 0 type CONFIRM LINK
    "2c",  # 1 length 44
    "00",  # 2 reserved (add_link_rej_rsn nibble)
    "03",  # 3 flags: SMC_LLC_FLAG_NO_RMBE_EYEC, request
    "020000aabbcc",  # 4 sender_mac
    "00000000000000000000ffff7f000001",  # 10 sender_gid
    "000456",  # 26 sender_qp_num (hton24)
    "01",  # 29 link_num
    "aabbcc01",  # 30 link_uid
    "02",  # 34 max_links
    "00",  # 35 max_conns (v2.1)
    z(8),  # 36 reserved[8]
)
ADD_LINK = hx(
    "02",  # 0 type ADD LINK
    "2c",  # 1 length
    "00",  # 2 add_link_rej_rsn 0
    "00",  # 3 flags: request
    "020000aabbcc",  # 4 sender_mac
    "0000",  # 10 reserved2[2]
    "00000000000000000000ffff7f000001",  # 12 sender_gid
    "000789",  # 28 sender_qp_num
    "02",  # 31 link_num
    "03",  # 32 qp_mtu (low nibble) = IB_MTU_1024
    "000abc",  # 33 initial_psn
    z(8),  # 36 reserved[8]
)
ADD_LINK_REJECT = hx(
    "02",  # 0 type
    "2c",  # 1 length
    "01",  # 2 add_link_rej_rsn = SMC_LLC_REJ_RSN_NO_ALT_PATH
    "c0",  # 3 flags: RESP | ADD_LNK_REJ
    "020000aabbcc",  # 4 sender_mac
    "0000",  # 10 reserved2
    "00000000000000000000ffff7f000001",  # 12 sender_gid
    "000000",  # 28 qpn
    "00",  # 31 link_num
    "00",  # 32 qp_mtu
    "000000",  # 33 psn
    z(8),  # 36
)
ADD_LINK_CONT = hx(
    "03",  # 0 type ADD LINK CONT
    "2c",  # 1 length
    "00",  # 2
    "00",  # 3 flags
    "02",  # 4 link_num
    "03",  # 5 num_rkeys (still to send, these included)
    "0000",  # 6 reserved2[2]
    "00000011",  # 8 rt[0].rmb_key
    "00000022",  # 12 rt[0].rmb_key_new
    "00007f0000100000",  # 16 rt[0].rmb_vaddr_new
    "00000033",  # 24 rt[1].rmb_key
    "00000044",  # 28 rt[1].rmb_key_new
    "0000000000000055",  # 32 rt[1].rmb_vaddr_new
    z(4),  # 40 reserved[4]
)
DELETE_LINK = hx(
    "04",  # 0 type DELETE LINK
    "2c",  # 1 length
    "00",  # 2
    "60",  # 3 flags: DEL_LINK_ALL | DEL_LINK_ORDERLY
    "00",  # 4 link_num (0 with ALL)
    "00020000",  # 5 reason SMC_LLC_DEL_OP_INIT_TERM (be32, packed)
    z(35),  # 9 reserved[35]
)
CONFIRM_RKEY = hx(
    "06",  # 0 type CONFIRM RKEY
    "2c",  # 1 length
    "00",  # 2
    "00",  # 3 flags
    "01",  # 4 rtoken[0].num_rkeys: one other link follows
    "11112222",  # 5 rtoken[0].rmb_key
    "00007f0000100000",  # 9 rtoken[0].rmb_vaddr
    "02",  # 17 rtoken[1].link_id
    "33334444",  # 18 rtoken[1].rmb_key
    "00007f0000200000",  # 22 rtoken[1].rmb_vaddr
    "00",  # 30 rtoken[2].link_id (unused)
    z(12),  # 31 rtoken[2] key + vaddr (unused)
    "00",  # 43 reserved
)
CONFIRM_RKEY_CONT = hx(
    "08",  # 0 type CONFIRM RKEY CONT
    "2c",  # 1 length
    "00",  # 2
    "00",  # 3 flags
    "04",  # 4 num_rkeys (3 here, one more to come)
    "01000000020000000000000003",  # 5 rtoken[0] link_id, rmb_key, rmb_vaddr
    "04000000050000000000000006",  # 18 rtoken[1]
    "07000000080000000000000009",  # 31 rtoken[2]
)
TEST_LINK_RESP = hx(
    "07",  # 0 type TEST LINK
    "2c",  # 1 length
    "00",  # 2
    "80",  # 3 flags: RESP
    "000102030405060708090a0b0c0d0e0f",  # 4 user_data[16] (echoed)
    z(24),  # 20 reserved[24]
)
DELETE_RKEY = hx(
    "09",  # 0 type DELETE RKEY
    "2c",  # 1 length
    "00",  # 2
    "00",  # 3 flags
    "01",  # 4 num_rkeys
    "00",  # 5 err_mask
    "0000",  # 6 reserved[2]
    "11112222",  # 8 rkey[0]
    z(28),  # 12 rkey[1..7]
    z(4),  # 40 reserved2[4]
)


def v2(type_byte: str, length: int, order: str, flags: str, *body: str) -> bytes:
    """A v2 message: type, length_v2 in ``order``, flags, body."""
    return hx(type_byte, length.to_bytes(2, order).hex(), flags, *body)  # type: ignore[arg-type]


def confirm_link_v2(order: str) -> bytes:
    return v2(
        "21",  # 0 type CONFIRM_LINK_V2 (llc_version 2 << 4 | 1)
        44,  # 1 length_v2 (host-order u16)
        order,
        "03",  # 3 flags
        "020000aabbcc",  # 4 sender_mac
        "00000000000000000000ffff7f000001",  # 10 sender_gid
        "000456",  # 26 qpn
        "01",  # 29 link_num
        "aabbcc01",  # 30 link_uid
        "02",  # 34 max_links
        "ff",  # 35 max_conns
        z(8),  # 36 reserved
    )


def add_link_v2(order: str) -> bytes:
    return v2(
        "22",  # 0 type ADD_LINK_V2
        104,  # 1 length_v2 = 44 + 28 + 2 * 16
        order,
        "00",  # 3 flags
        "020000aabbcc",  # 4 sender_mac
        "0000",  # 10 reserved2
        "00000000000000000000ffffc0000207",  # 12 sender_gid
        "000789",  # 28 qpn
        "02",  # 31 link_num
        "03",  # 32 qp_mtu
        "000abc",  # 33 initial_psn
        z(8),  # 36 reserved
        "80",  # 44 ext: v2_direct
        "00",  # 45 ext: reserved2
        "00000000000000000000ffffc0000207",  # 46 ext: client_target_gid
        z(8),  # 62 ext: reserved3[8]
        (2).to_bytes(2, order).hex(),  # type: ignore[arg-type]  # 70 ext: num_rkeys (host u16)
        "00000001000000020000000000000003",  # 72 rt[0]
        "00000004000000050000000000000006",  # 88 rt[1]
    )


def delete_link_v2(order: str) -> bytes:
    return v2("24", 44, order, "40", "00", "00010000", z(35))  # ALL, LOST_PATH


def req_add_link_v2(order: str) -> bytes:
    return v2(
        "25",  # 0 type REQ_ADD_LINK_V2
        60,  # 1 length_v2 = 28 + 2 * 16
        order,
        "00",  # 3 flags
        z(20),  # 4 reserved[20]
        "02",  # 24 gid_cnt
        z(3),  # 25 reserved2[3]
        "00000000000000000000ffff7f000001",  # 28 gid[0]
        "00000000000000000000ffffc0000207",  # 44 gid[1]
    )


def req_add_link_v2_resp(order: str) -> bytes:
    # Linux's answer: the 44-byte message, RESP set, body zeroed.
    return v2("25", 44, order, "80", z(40))


def confirm_rkey_v2(order: str) -> bytes:
    return v2("26", 44, order, "00", "00", "11112222", "00007f0000100000", z(27))


def wire_test_link_v2(order: str) -> bytes:
    return v2("27", 44, order, "00", "000102030405060708090a0b0c0d0e0f", z(24))


def delete_rkey_v2(order: str) -> bytes:
    return v2(
        "29",  # 0 type DELETE_RKEY_V2
        44,  # 1 length_v2 (Linux: one rkey in a 44-byte message)
        order,
        "00",  # 3 flags
        "01",  # 4 num_rkeys
        "00",  # 5 num_inval_rkeys
        "0000",  # 6 reserved
        "11112222",  # 8 rkey[0]
        z(32),  # 12 padding to 44
    )


V1_VECTORS: list[tuple[LlcMessage, bytes]] = [
    (ConfirmLink(MAC, GID, 0x456, 1, bytes.fromhex("aabbcc01"), 2), CONFIRM_LINK),
    (AddLink(MAC, GID, 0x789, 2, 3, 0xABC), ADD_LINK),
    (
        AddLink(
            MAC,
            GID,
            0,
            0,
            0,
            0,
            reject_reason=AddLinkRejectReason.NO_ALT_PATH,
            flags=AddLinkFlag.RESPONSE | AddLinkFlag.REJECT,
        ),
        ADD_LINK_REJECT,
    ),
    (
        AddLinkCont(2, 3, (AddLinkRkey(0x11, 0x22, 0x7F0000100000), AddLinkRkey(0x33, 0x44, 0x55))),
        ADD_LINK_CONT,
    ),
    (
        DeleteLink(
            0, DeleteLinkReason.OPERATOR_TERMINATION, DeleteLinkFlag.ALL | DeleteLinkFlag.ORDERLY
        ),
        DELETE_LINK,
    ),
    (
        ConfirmRkey(0x11112222, 0x7F0000100000, (Rtoken(2, 0x33334444, 0x7F0000200000),)),
        CONFIRM_RKEY,
    ),
    (ConfirmRkeyCont(4, (Rtoken(1, 2, 3), Rtoken(4, 5, 6), Rtoken(7, 8, 9))), CONFIRM_RKEY_CONT),
    (TestLink(bytes(range(16)), LlcFlag.RESPONSE), TEST_LINK_RESP),
    (DeleteRkey((0x11112222,)), DELETE_RKEY),
]

V2_VECTORS: list[tuple[LlcMessage, object]] = [
    (
        ConfirmLink(MAC, GID, 0x456, 1, bytes.fromhex("aabbcc01"), 2, max_conns=255, v2=True),
        confirm_link_v2,
    ),
    (
        AddLink(
            MAC,
            GID2,
            0x789,
            2,
            3,
            0xABC,
            ext=AddLinkV2Ext(True, GID2, (AddLinkRkey(1, 2, 3), AddLinkRkey(4, 5, 6))),
            v2=True,
        ),
        add_link_v2,
    ),
    (DeleteLink(0, DeleteLinkReason.LOST_PATH, DeleteLinkFlag.ALL, v2=True), delete_link_v2),
    (ReqAddLinkV2((GID, GID2)), req_add_link_v2),
    (ReqAddLinkV2((), LlcFlag.RESPONSE), req_add_link_v2_resp),
    (ConfirmRkey(0x11112222, 0x7F0000100000, v2=True), confirm_rkey_v2),
    (TestLink(bytes(range(16)), v2=True), wire_test_link_v2),
    (DeleteRkeyV2((0x11112222,)), delete_rkey_v2),
]


@pytest.mark.parametrize(("msg", "wire"), V1_VECTORS, ids=lambda v: getattr(v, "type", None))
def test_v1_golden(msg: LlcMessage, wire: bytes) -> None:
    assert len(wire) == 44
    assert llc.decode(wire) == msg
    assert type(msg).decode(wire) == msg
    for order in LENGTH_ORDERS:  # length_order does not touch v1 messages
        assert msg.encode(length_order=order) == wire
    assert not msg.is_v2
    assert msg.type == wire[0]


@pytest.mark.parametrize(("msg", "make"), V2_VECTORS, ids=lambda v: getattr(v, "type", None))
@pytest.mark.parametrize("order", LENGTH_ORDERS)
def test_v2_golden(msg: LlcMessage, make: object, order: llc.LengthOrder) -> None:
    wire = make(order)  # type: ignore[operator]
    assert llc.decode(wire) == msg
    assert msg.encode(length_order=order) == wire
    assert msg.is_v2
    assert msg.type == wire[0] and wire[0] >> 4 == 2


def test_default_length_order_is_little_endian_like_x86_linux() -> None:
    msg = TestLink(v2=True)
    assert msg.encode()[:4] == bytes.fromhex("272c0000")
    assert msg.encode(length_order="big")[:4] == bytes.fromhex("27002c00")


def test_kernel_v2_reject_carries_no_reason() -> None:
    # smc_llc_cli_add_link_reject sets add_link_rej_rsn, then smc_llc_init_msg_hdr overwrites
    # bytes 1-2 with length_v2: a v2 reject has no reason on the wire.
    wire = bytes.fromhex("222c00c0") + bytes(40)
    msg = llc.decode(wire)
    assert isinstance(msg, AddLink)
    assert msg.flags == AddLinkFlag.RESPONSE | AddLinkFlag.REJECT
    assert msg.reject_reason == AddLinkRejectReason.NONE and msg.ext is None
    with pytest.raises(ValueError, match="add_link_rej_rsn"):
        AddLink(MAC, GID, 0, 0, 0, 0, reject_reason=AddLinkRejectReason.NO_ALT_PATH, v2=True)
    with pytest.raises(ValueError, match="only in v2"):
        AddLink(MAC, GID, 0, 0, 0, 0, ext=AddLinkV2Ext(False, GID))


def test_enums_and_flags() -> None:
    assert int(LlcType.DELETE_RKEY_V2) == 0x29 and int(LlcType.REQ_ADD_LINK_V2) == 0x25
    assert int(AddLinkRejectReason.NO_ALT_PATH) == 1
    assert [int(r) for r in DeleteLinkReason][1:] == [
        0x00010000,
        0x00020000,
        0x00030000,
        0x00040000,
        0x00050000,
        0x00100000,
        0x00200000,
    ]
    assert int(ConfirmLinkFlag.NO_RMBE_EYEC) == 0x03 and int(DeleteLinkFlag.ORDERLY) == 0x20
    assert int(RkeyFlag.NEGATIVE) == 0x20 and int(RkeyFlag.RETRY) == 0x10
    # unknown reason codes decode as plain ints, known ones as members
    wire = bytearray(DELETE_LINK)
    wire[5:9] = (0x00990000).to_bytes(4, "big")
    msg = llc.decode(bytes(wire))
    assert isinstance(msg, DeleteLink)
    assert msg.reason == 0x00990000 and not isinstance(msg.reason, DeleteLinkReason)
    assert isinstance(llc.decode(DELETE_LINK).reason, DeleteLinkReason)  # type: ignore[union-attr]


def test_response_helpers() -> None:
    req = TestLink(bytes(range(16)))
    assert not req.is_response
    assert req.response().encode() == TEST_LINK_RESP
    assert req.response().is_response
    assert llc.decode(delete_rkey_v2("little")).is_response is False


def test_palindromic_length_is_decoded_in_either_order() -> None:
    # 124 rkeys make 44 + 28 + 124 * 16 = 2056 = 0x0808 bytes: length_v2 reads the same in
    # both orders, so num_rkeys (0x7C00 vs 0x007C) has to decide.
    rkeys = tuple(AddLinkRkey(i, i + 1, i + 2) for i in range(124))
    msg = AddLink(MAC, GID, 1, 2, 3, 4, ext=AddLinkV2Ext(False, GID, rkeys), v2=True)
    for order in LENGTH_ORDERS:
        wire = msg.encode(length_order=order)
        assert len(wire) == 0x0808 and wire[1:3] == b"\x08\x08"
        assert llc.decode(wire) == msg


# ---------------------------------------------------------------------------- round trips
@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(llc_messages(), st.sampled_from(LENGTH_ORDERS))
def test_round_trip(msg: LlcMessage, order: llc.LengthOrder) -> None:
    wire = msg.encode(length_order=order)
    decoded = llc.decode(wire)
    assert decoded == msg
    assert type(decoded) is type(msg)
    assert decoded.encode(length_order=order) == wire
    assert decoded.type == wire[0]
    if msg.is_v2:
        assert int.from_bytes(wire[1:3], order) == len(wire)
        assert 44 <= len(wire) <= 8192
    else:
        assert len(wire) == 44 and wire[1] == 44


@given(llc_v1_messages())
def test_v1_ignores_length_order(msg: LlcMessage) -> None:
    assert msg.encode(length_order="little") == msg.encode(length_order="big")


# ---------------------------------------------------------------------------- hostile input
@pytest.mark.parametrize("sample", SAMPLES, ids=lambda s: f"{s[0]:02x}-{len(s)}")
def test_truncation_at_every_offset(sample: bytes) -> None:
    for cut in range(len(sample)):
        with pytest.raises(ProtocolError) as info:
            llc.decode(sample[:cut])
        err = info.value
        assert err.field and err.offset is not None
        if sample[0] >> 4 == 0 or cut < 3:
            # v1 (or too short for length_v2): the field that is cut off is named
            assert isinstance(err, TruncatedError), (cut, err)
            assert err.offset <= cut
        else:
            assert err.field == "length_v2" and err.offset == 1


@pytest.mark.parametrize("sample", [s for s in SAMPLES if s[0] >> 4 == 0])
def test_wrong_v1_length_byte(sample: bytes) -> None:
    for bad in (0, 43, 45, 48, 0x2C00 & 0xFF, 255):
        wire = bytearray(sample)
        wire[1] = bad
        with pytest.raises(ProtocolError) as info:
            llc.decode(bytes(wire))
        assert info.value.field == "length" and info.value.offset == 1


@pytest.mark.parametrize("sample", [s for s in SAMPLES if s[0] >> 4 == 2])
def test_wrong_length_v2(sample: bytes) -> None:
    # length_v2 off by one in its byte order, and in no order equal to the real length
    for delta in (-1, 1, 100):
        for order in LENGTH_ORDERS:
            wire = bytearray(sample)
            wire[1:3] = (len(sample) + delta).to_bytes(2, order)
            with pytest.raises(ProtocolError, match="length_v2") as info:
                llc.decode(bytes(wire))
            assert info.value.field == "length_v2" and info.value.offset == 1
    # appended bytes make the message longer than length_v2 says
    with pytest.raises(ProtocolError) as info:
        llc.decode(sample + b"\x00")
    assert info.value.field == "length_v2"


def test_v2_length_limits() -> None:
    too_long = bytes.fromhex("29") + (8196).to_bytes(2, "little") + b"\x00" + bytes(8192)
    with pytest.raises(ProtocolError) as info:
        llc.decode(too_long)
    assert info.value.field == "length_v2"
    # the largest counts the u8 fields allow stay well inside SMC_WR_BUF_V2_SIZE
    assert len(DeleteRkeyV2(tuple(range(255))).encode()) == 8 + 4 * 255
    assert len(ReqAddLinkV2((GID,) * 255).encode()) == 28 + 16 * 255


def test_counts_above_max() -> None:
    wire = bytearray(DELETE_RKEY)
    wire[4] = 9  # SMC_LLC_DEL_RKEY_MAX is 8
    with pytest.raises(ProtocolError) as info:
        llc.decode(bytes(wire))
    assert (info.value.field, info.value.offset) == ("num_rkeys", 4)

    wire = bytearray(CONFIRM_RKEY)
    wire[4] = 3  # only two other-link rtokens fit
    with pytest.raises(ProtocolError) as info:
        llc.decode(bytes(wire))
    assert (info.value.field, info.value.offset) == ("num_rkeys", 4)

    for order in LENGTH_ORDERS:
        wire = bytearray(delete_rkey_v2(order))
        wire[4] = 10  # 44 bytes hold 9 rkeys
        with pytest.raises(ProtocolError) as info:
            llc.decode(bytes(wire))
        assert (info.value.field, info.value.offset) == ("num_rkeys", 4)

        wire = bytearray(req_add_link_v2(order))
        wire[24] = 3  # 60 bytes hold 2 GIDs
        with pytest.raises(ProtocolError) as info:
            llc.decode(bytes(wire))
        assert (info.value.field, info.value.offset) == ("gid_cnt", 24)

        wire = bytearray(add_link_v2(order))
        wire[70:72] = (3).to_bytes(2, order)  # 104 bytes hold 2 rkeys
        with pytest.raises(ProtocolError) as info:
            llc.decode(bytes(wire))
        assert (info.value.field, info.value.offset) == ("num_rkeys", 70)

    # more than SMC_LLC_RKEYS_PER_MSG_V2 (255) even though the length would hold them
    length = 44 + 28 + 16 * 256
    ext = bytes(26) + (256).to_bytes(2, "little") + bytes(16 * 256)
    big = bytes.fromhex("22") + length.to_bytes(2, "little") + b"\x00" + bytes(40) + ext
    with pytest.raises(ProtocolError) as info:
        llc.decode(big)
    assert info.value.field == "num_rkeys" and "255" in str(info.value)


def test_add_link_v2_with_truncated_extension() -> None:
    for length in (45, 50, 71):
        wire = bytes.fromhex("22") + length.to_bytes(2, "little") + bytes(length - 3)
        with pytest.raises(TruncatedError) as info:
            llc.decode(wire)
        assert info.value.offset is not None and info.value.offset >= 44


KNOWN = {int(t) for t in LlcType}


@pytest.mark.parametrize("type_byte", [t for t in range(256) if t not in KNOWN])
def test_unknown_types(type_byte: int) -> None:
    # with a length that would be valid for either v1 or v2 headers
    for second in (b"\x2c\x00", b"\x00\x2c"):
        wire = bytes((type_byte,)) + second + bytes(41)
        with pytest.raises(UnknownMessageError) as info:
            llc.decode(wire)
        assert (info.value.field, info.value.offset) == ("type", 0)


def test_req_add_link_0x05_and_conts_have_no_other_version() -> None:
    for type_byte in (0x05, 0x23, 0x28, 0xFE):
        with pytest.raises(UnknownMessageError):
            llc.decode(bytes((type_byte, 0x2C, 0, 0)) + bytes(40))


def test_typed_decode_rejects_other_types() -> None:
    with pytest.raises(ProtocolError) as info:
        ConfirmLink.decode(DELETE_LINK)
    assert info.value.field == "type"
    assert DeleteLink.decode(DELETE_LINK).reason == DeleteLinkReason.OPERATOR_TERMINATION


@settings(max_examples=500)
@given(st.binary(max_size=200))
def test_random_bytes_never_escape_protocol_error(data: bytes) -> None:
    try:
        msg = llc.decode(data)
    except ProtocolError as err:
        assert err.field
    else:
        assert msg.type == data[0]


@settings(max_examples=500)
@given(st.sampled_from(SAMPLES), st.data())
def test_mutated_samples_never_escape_protocol_error(sample: bytes, data: st.DataObject) -> None:
    wire = bytearray(sample)
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(0, len(wire) - 1))
        wire[pos] = data.draw(st.integers(0, 255))
    try:
        msg = llc.decode(bytes(wire))
    except ProtocolError:
        return
    # whatever decodes re-encodes to a message that decodes to the same value
    order: llc.LengthOrder = "big" if wire[0] >> 4 and wire[1] == 0 else "little"
    assert llc.decode(msg.encode(length_order=order)) == msg


def test_encode_validates_fields() -> None:
    with pytest.raises(ValueError, match="sender_mac"):
        ConfirmLink(b"\x00" * 5, GID, 0, 0, bytes(4), 2)
    with pytest.raises(ValueError, match="sender_qpn"):
        ConfirmLink(MAC, GID, 1 << 24, 0, bytes(4), 2)
    with pytest.raises(ValueError, match="rkeys"):
        DeleteRkey(tuple(range(9)))
    with pytest.raises(ValueError, match="other_links"):
        ConfirmRkey(0, 0, (Rtoken(1, 1, 1),) * 3)
    with pytest.raises(ValueError, match="min"):
        AddLinkCont(1, 5, (AddLinkRkey(1, 2, 3),))
    with pytest.raises(ValueError, match="qp_mtu"):
        AddLink(MAC, GID, 0, 0, 16, 0)
    with pytest.raises(ValueError, match="length_order"):
        TestLink().encode(length_order="middle")  # type: ignore[arg-type]


def test_reserved_bits_and_bytes_are_ignored_like_the_kernel() -> None:
    wire = bytearray(ADD_LINK)
    wire[2] = 0xF0  # reserved high nibble next to add_link_rej_rsn
    wire[10:12] = b"\xff\xff"  # reserved2
    wire[32] = 0xF3  # reserved3 high nibble, qp_mtu 3
    wire[36:44] = b"\xee" * 8
    assert llc.decode(bytes(wire)) == llc.decode(ADD_LINK)
    wire = bytearray(CONFIRM_LINK)
    wire[36:44] = b"\xee" * 8
    assert llc.decode(bytes(wire)) == llc.decode(CONFIRM_LINK)
    # bytes past a v1 message's 44 are ignored (the kernel reads only its struct)
    assert llc.decode(CONFIRM_LINK + b"\xff" * 4) == llc.decode(CONFIRM_LINK)
