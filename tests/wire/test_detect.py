"""decode_any / kind_of: the kind of a message is told from its first bytes, then decoded."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from smcd_daemon.errors import ProtocolError, TruncatedError, UnknownMessageError
from smcd_daemon.wire import cdc, clc, detect, llc
from smcd_daemon.wire.cursor import Cursor
from tests.wire import st_cdc, st_clc, st_llc


def _samples(module: Any, attr: str = "SAMPLES") -> list[bytes]:
    samples = getattr(module, attr, [])
    values = samples.values() if isinstance(samples, dict) else samples
    return [bytes(v[1] if isinstance(v, tuple) else v) for v in values]


CLC = _samples(st_clc)
LLC = _samples(st_llc)
SMCR_CDC = [s for s in _samples(st_cdc) if len(s) == cdc.CDC_MSG_LEN]
SMCD_CDC = _samples(st_cdc, "SMCD_SAMPLES") + [
    s for s in _samples(st_cdc) if len(s) == cdc.SMCD_CDC_HEADER_LEN
]


def test_there_are_samples_of_every_kind() -> None:
    assert CLC and LLC and SMCR_CDC and SMCD_CDC


@pytest.mark.parametrize("data", CLC, ids=lambda d: d[:8].hex())
def test_clc_samples(data: bytes) -> None:
    assert detect.kind_of(data) == "clc"
    assert detect.decode_any(data) == clc.decode(data)


@pytest.mark.parametrize("data", LLC, ids=lambda d: d[:4].hex())
def test_llc_samples(data: bytes) -> None:
    assert detect.kind_of(data) == "llc"
    assert detect.decode_any(data) == llc.decode(data)


@pytest.mark.parametrize("data", SMCR_CDC, ids=lambda d: d[:4].hex())
def test_smcr_cdc_samples(data: bytes) -> None:
    assert detect.kind_of(data) == "smcr-cdc"
    msg = detect.decode_any(data)
    assert isinstance(msg, cdc.CdcMessage) and msg == cdc.decode(data)


@pytest.mark.parametrize("data", SMCD_CDC, ids=lambda d: d[:4].hex())
def test_smcd_cdc_samples(data: bytes) -> None:
    assert detect.kind_of(data) == "smcd-cdc"
    msg = detect.decode_any(data)
    assert isinstance(msg, cdc.SmcdCdcHeader) and msg == cdc.SmcdCdcHeader.decode(data)


def test_every_message_type_is_told_apart() -> None:
    decline = clc.Decline(diagnosis=0x03030008).encode()
    assert isinstance(detect.decode_any(decline), clc.Decline)
    test_link_v2 = llc.TestLink(user_data=bytes(range(16)), v2=True).encode()
    assert test_link_v2[0] == 0x27
    assert detect.kind_of(test_link_v2) == "llc"
    assert isinstance(detect.decode_any(test_link_v2), llc.TestLink)
    hdr = cdc.SmcdCdcHeader(Cursor(1, 2), Cursor(3, 4)).encode()
    assert detect.decode_any(hdr) == cdc.SmcdCdcHeader(Cursor(1, 2), Cursor(3, 4))


def test_empty_input_is_truncated_at_type() -> None:
    with pytest.raises(TruncatedError) as info:
        detect.decode_any(b"")
    assert info.value.field == "type" and info.value.offset == 0


@pytest.mark.parametrize("data", [b"\xe2", b"\xe2\xd4", b"\xe2\xd4\xc3"])
def test_partial_eyecatcher_is_truncated(data: bytes) -> None:
    with pytest.raises(TruncatedError) as info:
        detect.kind_of(data)
    assert info.value.field == "eyecatcher"


def test_wrong_eyecatcher_names_the_eyecatcher() -> None:
    with pytest.raises(UnknownMessageError) as info:
        detect.decode_any(b"\xe2\xd4\xc3\xc5" + bytes(40))
    assert info.value.field == "eyecatcher" and info.value.offset == 0


@pytest.mark.parametrize("first", [0x00, 0x0A, 0x10, 0x1F, 0x30, 0x45, 0x80, 0xE3, 0xFF])
def test_unknown_first_byte_names_type_at_offset_0(first: int) -> None:
    with pytest.raises(UnknownMessageError) as info:
        detect.decode_any(bytes([first]) + bytes(43))
    assert info.value.field == "type" and info.value.offset == 0
    assert f"0x{first:02x}" in str(info.value)


def test_cdc_of_wrong_size_is_an_smcr_cdc_error() -> None:
    good = cdc.CdcMessage(1, 2, Cursor(), Cursor()).encode()
    with pytest.raises(ProtocolError) as info:
        detect.decode_any(good[:40])
    assert info.value.offset is not None
    bad_len = bytearray(good)
    bad_len[1] = 43
    with pytest.raises(ProtocolError) as info:
        detect.decode_any(bytes(bad_len))
    assert info.value.field == "length" and info.value.offset == 1


def test_llc_with_wrong_length_byte_is_an_llc_error() -> None:
    msg = bytearray(llc.DeleteLink(link_num=1, reason=llc.DeleteLinkReason.LOST_PATH).encode())
    msg[1] = 40
    with pytest.raises(ProtocolError) as info:
        detect.decode_any(bytes(msg))
    assert info.value.field == "length"


def test_accepts_bytearray_and_memoryview() -> None:
    data = CLC[0]
    assert detect.decode_any(bytearray(data)) == detect.decode_any(memoryview(data))


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.binary(max_size=100))
def test_kind_of_agrees_with_decode_any(data: bytes) -> None:
    """kind_of never raises where decode_any succeeds, and names the decoder that succeeded."""
    try:
        msg = detect.decode_any(data)
    except ProtocolError:
        return
    kind = detect.kind_of(data)
    expected = {
        clc.Proposal: "clc",
        clc.Accept: "clc",
        clc.Confirm: "clc",
        clc.Decline: "clc",
        cdc.CdcMessage: "smcr-cdc",
        cdc.SmcdCdcHeader: "smcd-cdc",
    }.get(type(msg), "llc")
    assert kind == expected
