"""CLC decoding of hostile input: every failure is a ProtocolError naming the field at fault.

Covers truncation at every offset, lying length fields, offsets pointing outside, counts above
the maxima, bad eyecatchers (head and trailer), unknown types, version 0, and random bytes.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from smcd_daemon.errors import ProtocolError, TruncatedError, UnknownMessageError
from smcd_daemon.wire import clc
from smcd_daemon.wire.clc import Accept, Confirm, Decline, Proposal
from tests.wire import st_clc
from tests.wire.test_clc import (
    ACCEPT_D_V1,
    ACCEPT_R_V1,
    ACCEPT_R_V2,
    CONFIRM_D_V2_REL0,
    CONFIRM_R_V2,
    DECLINE_V1,
    DECLINE_V2,
    GOLDEN,
    PROPOSAL_V1_OLD,
    PROPOSAL_V2_D,
    PROPOSAL_V2_IPV6,
    PROPOSAL_V2_RB,
)

ALL = sorted(GOLDEN)


def patch(raw: bytes, offset: int, value: bytes) -> bytes:
    return raw[:offset] + value + raw[offset + len(value) :]


def with_length(raw: bytes, length: int | None = None) -> bytes:
    n = len(raw) if length is None else length
    return patch(raw, 5, n.to_bytes(2, "big"))


def fails(raw: bytes, field: str | None = None, offset: int | None = None) -> ProtocolError:
    with pytest.raises(ProtocolError) as exc:
        clc.decode(raw)
    err = exc.value
    assert err.field, "every ProtocolError names a field"
    if field is not None:
        assert err.field == field, str(err)
    if offset is not None:
        assert err.offset == offset, str(err)
    return err


# ---- truncation and lengths ------------------------------------------------------------------


@pytest.mark.parametrize("name", ALL)
def test_truncation_at_every_offset(name: str) -> None:
    raw = GOLDEN[name][0]
    for cut in range(len(raw)):
        err = fails(raw[:cut])
        if cut < clc.CLC_HEADER_LEN:
            assert isinstance(err, TruncatedError) and err.field == "header"
        else:
            assert err.field == "length" and err.offset == 5


@pytest.mark.parametrize("name", ALL)
def test_truncation_with_a_matching_length_field(name: str) -> None:
    """A peer that lies consistently: truncated bytes, length field patched to match."""
    raw = GOLDEN[name][0]
    for cut in range(clc.CLC_HEADER_LEN, len(raw)):
        fails(with_length(raw[:cut]))


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("delta", [-1, 1, 4, 100])
def test_wrong_length_field(name: str, delta: int) -> None:
    raw = GOLDEN[name][0]
    fails(with_length(raw, len(raw) + delta), "length", 5)


@pytest.mark.parametrize("name", ALL)
def test_extra_bytes_before_the_trailer(name: str) -> None:
    raw = GOLDEN[name][0]
    msg = GOLDEN[name][1]
    # 5 bytes: no FCE (36/52) or GID list (16 per GID) layout can absorb them
    longer = raw[:-4] + bytes(5) + raw[-4:]
    err = fails(with_length(longer))
    # first-contact v2 messages end in variable-size extensions: the size check names them
    variable = not isinstance(msg, Proposal | Decline) and msg.fce is not None
    assert err.field in (("fce", "gid_cnt") if variable else ("length",))


def test_trailing_bytes_after_message() -> None:
    fails(ACCEPT_R_V1 + b"\x00", "length", 5)


def test_decline_length_must_match_version() -> None:
    fails(patch(DECLINE_V1, 7, b"\x20"), "length", 5)  # version 2 with 28 bytes
    fails(patch(DECLINE_V2, 7, b"\x10"), "length", 5)  # version 1 with 44 bytes


def test_accept_confirm_lengths() -> None:
    fails(with_length(ACCEPT_R_V1 + bytes(40)), "length", 5)  # v1 must be exactly 68
    fails(patch(ACCEPT_D_V1, 7, b"\x18"), "length", 5)  # typev1 R with SMC-D's 48 bytes
    # v2 without first contact has nothing after the base
    fails(patch(ACCEPT_R_V2, 7, b"\x20"), "length", 5)
    # v2 SMC-D shorter than 78
    short = ACCEPT_D_V1[:-4] + bytes(20) + ACCEPT_D_V1[-4:]
    fails(patch(with_length(short), 7, b"\x21"), "length", 5)


# ---- header fields ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ALL)
def test_bad_head_eyecatcher(name: str) -> None:
    raw = GOLDEN[name][0]
    for eye in (b"SMCR", b"\xe2\xd4\xc3\xd8", bytes(4)):
        err = fails(eye + raw[4:], "eyecatcher", 0)
        assert isinstance(err, UnknownMessageError)


@pytest.mark.parametrize("name", [n for n in ALL if not n.startswith("decline")])
def test_bad_trailer_eyecatcher(name: str) -> None:
    raw = GOLDEN[name][0]
    fails(raw[:-4] + b"SMCD", "trailer", len(raw) - 4)
    fails(raw[:-1] + b"\x00", "trailer", len(raw) - 4)


def test_decline_trailer_is_not_checked_like_the_kernel() -> None:
    for raw, msg in (GOLDEN["decline_v1_28"], GOLDEN["decline_v2_44"]):
        assert clc.decode(raw[:-4] + bytes(4)) == msg


@pytest.mark.parametrize("ctype", [0, 5, 0x42, 0xFF])
def test_unknown_type(ctype: int) -> None:
    err = fails(patch(ACCEPT_R_V1, 4, bytes([ctype])), "type", 4)
    assert isinstance(err, UnknownMessageError)
    with pytest.raises(UnknownMessageError) as exc:
        clc.peek_header(patch(ACCEPT_R_V1, 4, bytes([ctype]))[:8])
    assert exc.value.field == "type"


@pytest.mark.parametrize(
    ("cls", "raw"),
    [
        (Accept, CONFIRM_R_V2),
        (Confirm, ACCEPT_R_V2),
        (Proposal, DECLINE_V1),
        (Decline, ACCEPT_R_V1),
    ],
)
def test_class_decoders_check_the_type(cls: type[clc.ClcMessage], raw: bytes) -> None:
    with pytest.raises(ProtocolError) as exc:
        cls.decode(raw)
    assert exc.value.field == "type" and exc.value.offset == 4


@pytest.mark.parametrize("name", ALL)
def test_version_zero(name: str) -> None:
    raw = GOLDEN[name][0]
    bad = patch(raw, 7, bytes([raw[7] & 0x0F]))
    fails(bad, "version", 7)
    with pytest.raises(ProtocolError) as exc:
        clc.peek_header(bad[:8])
    assert exc.value.field == "version"


def test_peek_header_bad_eyecatcher() -> None:
    with pytest.raises(UnknownMessageError) as exc:
        clc.peek_header(b"GET / HTTP/1.1\r\n"[:8])
    assert exc.value.field == "eyecatcher"


@pytest.mark.parametrize("flags", [0x1A, 0x1B, 0x2A, 0x2B])  # typev1 N or B
def test_accept_confirm_typev1_must_be_r_or_d(flags: int) -> None:
    fails(patch(ACCEPT_R_V1, 7, bytes([flags])), "typev1", 7)
    fails(patch(CONFIRM_R_V2, 7, bytes([flags])), "typev1", 7)


def test_v1_proposal_must_offer_a_path() -> None:
    fails(patch(PROPOSAL_V1_OLD, 7, b"\x12"), "typev1", 7)


# ---- proposal offsets and counts -------------------------------------------------------------


def test_iparea_offset_outside() -> None:
    fails(patch(PROPOSAL_V2_RB, 38, b"\x00\x29"), "iparea_offset", 38)  # 41 > 40
    fails(patch(PROPOSAL_V2_RB, 38, b"\xff\xff"), "iparea_offset", 38)
    fails(patch(PROPOSAL_V2_RB, 38, b"\x00\x00"), "iparea_offset", 38)  # v2 R needs 40
    fails(patch(PROPOSAL_V2_D, 38, b"\x00\x28"), "iparea_offset", 38)  # v2 N: Linux sends 0
    # v1 SMC-D without the SMC-D area
    fails(patch(PROPOSAL_V1_OLD, 7, b"\x11"), "iparea_offset", 38)
    fails(patch(PROPOSAL_V1_OLD, 38, b"\x00\x14"), "iparea_offset", 38)  # v1: only 0 or 40


@pytest.mark.parametrize("value", [0, 37, 173, 0xFFFF])
def test_v2_ext_offset_outside_or_misplaced(value: int) -> None:
    fails(patch(PROPOSAL_V2_RB, 50, value.to_bytes(2, "big")), "v2_ext_offset", 50)


@pytest.mark.parametrize("value", [0, 65, 289, 0xFFFF])
def test_smcd_v2_ext_offset_outside_or_misplaced(value: int) -> None:
    fails(patch(PROPOSAL_V2_RB, 94, value.to_bytes(2, "big")), "smcd_v2_ext_offset", 94)


def test_counts_above_maximum() -> None:
    fails(patch(PROPOSAL_V2_RB, 88, b"\x09"), "eid_cnt", 88)
    fails(patch(PROPOSAL_V2_RB, 88, b"\xff"), "eid_cnt", 88)
    fails(patch(PROPOSAL_V2_RB, 89, b"\x09"), "ism_gid_cnt", 89)
    fails(patch(PROPOSAL_V2_RB, 87, b"\x09"), "ipv6_prefixes_cnt", 87)
    fails(patch(PROPOSAL_V2_IPV6, 87, b"\xff"), "ipv6_prefixes_cnt", 87)
    fails(patch(PROPOSAL_V1_OLD, 47, b"\x09"), "ipv6_prefixes_cnt", 47)
    fails(patch(CONFIRM_R_V2, 156, b"\x09"), "gid_cnt")


def test_counts_that_disagree_with_the_length() -> None:
    fails(patch(PROPOSAL_V2_RB, 88, b"\x02"), "length", 5)  # 2 UEIDs announced, 1 present
    fails(patch(PROPOSAL_V2_RB, 89, b"\x03"), "length", 5)
    fails(patch(PROPOSAL_V2_IPV6, 87, b"\x01"), "length", 5)
    fails(patch(CONFIRM_R_V2, 156, b"\x01"), "gid_cnt")


def test_kernel_reads_ipv6_count_even_without_v1_path() -> None:
    """typev1 N: smc_clc_msg_prop_valid still checks the byte at 40 + iparea_offset + 7."""
    fails(patch(PROPOSAL_V2_D, 47, b"\x09"), "ipv6_prefixes_cnt", 47)
    assert clc.decode(patch(PROPOSAL_V2_D, 47, b"\x08"))


def test_prefix_lengths_beyond_the_address() -> None:
    fails(patch(PROPOSAL_V2_RB, 84, b"\x21"), "prefix_len", 84)
    fails(patch(PROPOSAL_V2_IPV6, 104, b"\x81"), "ipv6_prefix_len", 104)


def test_emulated_ism_needs_its_second_entry() -> None:
    fails(patch(PROPOSAL_V2_RB, 226, b"\x12\x34"), "gidchid", 218)
    # only one entry announced: drop the second entry, fix counts and length
    one = PROPOSAL_V2_RB[:218] + PROPOSAL_V2_RB[228:]
    fails(patch(with_length(one), 89, b"\x01"), "gidchid", 218)


# ---- first contact extension ---------------------------------------------------------------


def test_first_contact_extension_size() -> None:
    longer = ACCEPT_R_V2[:-4] + bytes(16) + ACCEPT_R_V2[-4:]
    fails(with_length(longer), "fce", 104)
    fails(patch(CONFIRM_D_V2_REL0, 75, b"\x21"), "fce", 74)  # release 1 needs 52 bytes
    missing = ACCEPT_R_V2[:104] + ACCEPT_R_V2[-4:]  # first contact without FCE
    fails(with_length(missing), "fce", 104)


# ---- random input -------------------------------------------------------------------------------


def _check_total(raw: bytes) -> None:
    """Only ProtocolError may escape; anything that decodes must re-encode to itself."""
    try:
        msg = clc.decode(raw)
    except ProtocolError as err:
        assert err.field
        return
    again = msg.encode()
    assert clc.decode(again) == msg


_FUZZ = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@_FUZZ
@given(st.binary(max_size=700))
@example(b"")
@example(clc.SMCR_EYECATCHER)
def test_random_bytes(raw: bytes) -> None:
    _check_total(raw)


@_FUZZ
@given(
    st.sampled_from([clc.SMCR_EYECATCHER, clc.SMCD_EYECATCHER]),
    st.integers(0, 6),
    st.integers(0, 0xFF),
    st.binary(max_size=700),
)
def test_random_bodies_with_plausible_headers(
    eye: bytes, ctype: int, flags: int, body: bytes
) -> None:
    n = 8 + len(body)
    _check_total(eye + bytes([ctype]) + n.to_bytes(2, "big") + bytes([flags]) + body)


@_FUZZ
@given(st.sampled_from(st_clc.SAMPLES), st.data())
def test_mutated_samples(raw: bytes, data: st.DataObject) -> None:
    buf = bytearray(raw)
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(0, len(buf) - 1))
        buf[pos] = data.draw(st.integers(0, 0xFF))
    _check_total(bytes(buf))


@pytest.mark.parametrize("raw", st_clc.SAMPLES)
def test_every_single_byte_mutation_of_samples(raw: bytes) -> None:
    """Exhaustive over positions, a few values each: decodes or fails with a field."""
    for pos in range(len(raw)):
        for value in (0x00, 0x01, 0x09, 0x80, 0xFF, raw[pos] ^ 0x08):
            _check_total(patch(raw, pos, bytes([value])))
