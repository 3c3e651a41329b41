"""CDC codec: SMC-R messages and the SMC-D DMB header."""

from __future__ import annotations

import mmap
import os
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from smcd_daemon.errors import ProtocolError, TruncatedError, UnknownMessageError
from smcd_daemon.wire import cdc
from smcd_daemon.wire.cdc import (
    CdcMessage,
    ConnStateFlag,
    ProducerFlag,
    SmcdCdcHeader,
    seqno_before,
)
from smcd_daemon.wire.cursor import Cursor
from tests.wire.st_cdc import SAMPLES, SMCD_SAMPLES, cdc_messages, smcd_cdc_headers

# PROTOCOL.md Appendix B: tshark decoded exactly these values from this message.
PROBE = bytes.fromhex(
    "fe"  # 0 type SMC_CDC_MSG_TYPE
    "2c"  # 1 len 44
    "0007"  # 2 seqno
    "00000042"  # 4 token (RMBE alert token)
    "0000"  # 8 prod.reserved
    "0001"  # 10 prod.wrap
    "00001000"  # 12 prod.count
    "0000"  # 16 cons.reserved
    "0000"  # 18 cons.wrap
    "00000800"  # 20 cons.count
    "90"  # 24 prod_flags: write_blocked | cons_curs_upd_req
    "80" + "00" * 18  # 25 conn_state_flags: peer_done_writing  # 26 reserved[18]
)
PROBE_MSG = CdcMessage(
    seqno=7,
    token=0x42,
    prod=Cursor(1, 0x1000),
    cons=Cursor(0, 0x800),
    prod_flags=ProducerFlag.WRITE_BLOCKED | ProducerFlag.CONS_CURS_UPD_REQ,
    conn_state_flags=ConnStateFlag.PEER_DONE_WRITING,
)


def test_smcr_golden() -> None:
    assert len(PROBE) == cdc.CDC_MSG_LEN == 44
    assert cdc.decode(PROBE) == PROBE_MSG
    assert CdcMessage.decode(PROBE) == PROBE_MSG
    assert PROBE_MSG.encode() == PROBE
    assert SAMPLES[0] == PROBE


def test_flag_bits_match_the_kernel_bitfields() -> None:
    # __BIG_ENDIAN_BITFIELD order: first declared field is the MSB
    assert [int(f) for f in ProducerFlag] == [0x80, 0x40, 0x20, 0x10, 0x08]
    assert [int(f) for f in ConnStateFlag] == [0x80, 0x40, 0x20]
    wire = bytearray(PROBE)
    wire[24], wire[25] = 0x08, 0x60
    msg = cdc.decode(bytes(wire))
    assert msg.prod_flags == ProducerFlag.FAILOVER_VALIDATION
    assert msg.conn_state_flags == ConnStateFlag.PEER_CONN_CLOSED | ConnStateFlag.PEER_CONN_ABORT


def test_reserved_cursor_halves_are_ignored() -> None:
    wire = bytearray(PROBE)
    wire[8:10] = b"\xff\xff"
    wire[16:18] = b"\xff\xff"
    wire[30] = 0xAA
    assert cdc.decode(bytes(wire)) == PROBE_MSG


@given(cdc_messages())
def test_smcr_round_trip(msg: CdcMessage) -> None:
    wire = msg.encode()
    assert len(wire) == 44 and wire[0] == 0xFE and wire[1] == 44
    assert cdc.decode(wire) == msg


@pytest.mark.parametrize("sample", SAMPLES)
def test_smcr_truncation_at_every_offset(sample: bytes) -> None:
    for cut in range(len(sample)):
        with pytest.raises(TruncatedError) as info:
            cdc.decode(sample[:cut])
        assert info.value.field and info.value.offset is not None and info.value.offset <= cut


def test_smcr_wrong_length_byte_is_dropped_like_the_kernel() -> None:
    for bad in (0, 43, 45, 48):
        wire = bytearray(PROBE)
        wire[1] = bad
        with pytest.raises(ProtocolError) as info:
            cdc.decode(bytes(wire))
        assert (info.value.field, info.value.offset) == ("length", 1)


@pytest.mark.parametrize("type_byte", [0x00, 0x01, 0x07, 0x21, 0xFD, 0xFF])
def test_smcr_wrong_type(type_byte: int) -> None:
    with pytest.raises(UnknownMessageError) as info:
        cdc.decode(bytes((type_byte,)) + PROBE[1:])
    assert (info.value.field, info.value.offset) == ("type", 0)


@settings(max_examples=300)
@given(st.binary(max_size=60))
def test_smcr_random_bytes(data: bytes) -> None:
    try:
        cdc.decode(data)
    except ProtocolError as err:
        assert err.field


def test_seqno_before_wraps_like_smc_cdc_before() -> None:
    assert seqno_before(1, 2)
    assert not seqno_before(2, 1)
    assert not seqno_before(5, 5)
    assert seqno_before(0xFFFF, 0)  # 0 came after 0xFFFF
    assert not seqno_before(0, 0xFFFF)
    assert seqno_before(0, 0x7FFF) and not seqno_before(0, 0x8001)


# ---------------------------------------------------------------------------- SMC-D
def host(value: int, size: int) -> str:
    return value.to_bytes(size, sys.byteorder).hex()


def test_smcd_golden_host_order_flags_in_consumer_slot() -> None:
    header = SmcdCdcHeader(
        prod=Cursor(0x0102, 0x03040506),
        cons=Cursor(0x0708, 0x090A0B0C),
        prod_flags=ProducerFlag.WRITE_BLOCKED | ProducerFlag.URG_DATA_PRESENT,
        conn_state_flags=ConnStateFlag.PEER_CONN_CLOSED,
    )
    wire = bytes.fromhex(
        "fe"  # 0 common.type
        + "00" * 7  # 1 res1[7]
        + host(0x0102, 2)  # 8 prod.wrap (host order)
        + host(0x03040506, 4)  # 10 prod.count
        + "0000"  # 14 prod's flag bytes: unused by Linux
        + host(0x0708, 2)  # 16 cons.wrap
        + host(0x090A0B0C, 4)  # 18 cons.count
        + "a0"  # 22 prod_flags (in the consumer cursor, as smcd_cdc_msg_send)
        + "40"  # 23 conn_state_flags
        + "00" * 8  # 24 res3[8]
    )
    assert len(wire) == cdc.SMCD_CDC_HEADER_LEN == SmcdCdcHeader.SIZE == 32
    assert header.encode() == wire
    assert SmcdCdcHeader.decode(wire) == header
    if sys.byteorder == "little":  # x86: what Linux writes there
        assert wire[8:14] == bytes.fromhex("020106050403")


def test_smcd_prod_slot_flags_are_ignored() -> None:
    wire = bytearray(SMCD_SAMPLES[0])
    wire[14], wire[15] = 0xFF, 0xFF
    assert SmcdCdcHeader.decode(bytes(wire)) == SmcdCdcHeader.decode(SMCD_SAMPLES[0])


def test_smcd_fresh_zeroed_dmb_reads_as_empty_header() -> None:
    assert SmcdCdcHeader.decode(bytes(32)) == SmcdCdcHeader(Cursor(), Cursor())


@pytest.mark.parametrize("type_byte", [0x01, 0x2C, 0xFF])
def test_smcd_garbage_type(type_byte: int) -> None:
    with pytest.raises(UnknownMessageError) as info:
        SmcdCdcHeader.decode(bytes((type_byte,)) + SMCD_SAMPLES[0][1:])
    assert info.value.field == "type"


def test_smcd_short_buffers() -> None:
    for cut in range(32):
        with pytest.raises(TruncatedError) as info:
            SmcdCdcHeader.decode(SMCD_SAMPLES[0][:cut])
        assert info.value.field == "header"
    buf = bytearray(40)
    with pytest.raises(TruncatedError):
        SmcdCdcHeader.decode_from(buf, 9)
    with pytest.raises(TruncatedError):
        SmcdCdcHeader.decode_from(buf, -1)
    with pytest.raises(ValueError, match="no room"):
        SmcdCdcHeader(Cursor(), Cursor()).encode_into(buf, 9)
    with pytest.raises(ValueError, match="no room"):
        SmcdCdcHeader(Cursor(), Cursor()).encode_into(buf, -1)


@given(smcd_cdc_headers())
def test_smcd_round_trip(header: SmcdCdcHeader) -> None:
    wire = header.encode()
    assert len(wire) == 32 and wire[0] == 0xFE
    assert SmcdCdcHeader.decode(wire) == header


@settings(max_examples=50)
@given(smcd_cdc_headers(), st.integers(0, 4096 - 32))
def test_smcd_in_place_on_a_shared_memfd_mapping(header: SmcdCdcHeader, offset: int) -> None:
    """encode_into/decode_from work on real shared memory: one mapping writes, another (a
    second mmap of the same memfd, as the peer process would have) reads."""
    fd = os.memfd_create("smcd-cdc-test")
    try:
        os.ftruncate(fd, 4096)
        with mmap.mmap(fd, 4096) as writer, mmap.mmap(fd, 4096) as reader:
            header.encode_into(writer, offset)
            assert reader[offset : offset + 32] == header.encode()
            assert SmcdCdcHeader.decode_from(reader, offset) == header
            # the bytes around the header are untouched
            assert reader[:offset] == bytes(offset)
            assert reader[offset + 32 :] == bytes(4096 - offset - 32)
            view = memoryview(reader)
            try:
                assert SmcdCdcHeader.decode_from(view, offset) == header
            finally:
                view.release()
    finally:
        os.close(fd)
