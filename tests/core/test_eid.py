"""UEIDs follow smc_clc_ueid_add/_remove and smc-tools' ueid.c; SEID follows smc_nl_*_seid."""

from __future__ import annotations

import errno
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from smcd_daemon.core.eid import (
    SEID_PREFIX,
    SMC_CLC_MAX_UEID,
    EidError,
    EidTable,
    eid_from_wire,
    normalize_ueid,
    system_eid,
    ueid_to_wire,
)


def assert_one_sentence(exc: BaseException, *needles: str) -> None:
    msg = str(exc)
    assert "\n" not in msg
    assert msg.endswith(".")
    assert msg[0].isupper()
    for n in needles:
        assert n in msg, (n, msg)


# -- UEID syntax -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "canonical"),
    [
        ("SMC-EID.1", "SMC-EID.1"),
        ("smc-eid.1", "SMC-EID.1"),
        ("  Abc  ", "ABC"),
        ("A", "A"),
        ("9-.-", "9-.-"),
        ("X" * 32, "X" * 32),
        (" " + "x" * 32 + "  ", "X" * 32),
    ],
)
def test_ueid_normalised(raw: str, canonical: str) -> None:
    assert normalize_ueid(raw) == canonical


@pytest.mark.parametrize(
    ("raw", "rule"),
    [
        ("", "empty"),
        ("   ", "empty"),
        ("X" * 33, "at most 32"),
        ("-ABC", "first character"),
        (".ABC", "first character"),
        ("A_B", "only contain A-Z, 0-9, '.' and '-'"),
        ("A B", "only contain"),
        ("ÄB", "only contain"),
        ("\u0131D", "only contain"),  # dotless i would fold to ASCII 'I'
        ("A..B", "consecutive dots"),
    ],
)
def test_ueid_rejected(raw: str, rule: str) -> None:
    with pytest.raises(EidError) as ei:
        normalize_ueid(raw)
    assert ei.value.errno == errno.EINVAL
    assert ei.value.value == raw
    assert_one_sentence(ei.value, repr(raw), rule)


def test_ueid_not_a_string() -> None:
    with pytest.raises(EidError) as ei:
        normalize_ueid(None)
    assert_one_sentence(ei.value, "None", "1 to 32")


@given(st.text(max_size=40))
def test_ueid_any_text_is_canonical_or_refused(s: str) -> None:
    try:
        u = normalize_ueid(s)
    except EidError:
        return
    assert 1 <= len(u) <= 32
    assert set(u) <= set("ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.-")
    assert u[0].isalnum() and ".." not in u
    assert normalize_ueid(u) == u


def test_wire_form_is_blank_padded_to_32() -> None:
    w = ueid_to_wire("smc.a")
    assert w == b"SMC.A" + b" " * 27
    assert len(w) == 32
    assert ueid_to_wire("X" * 32) == b"X" * 32
    assert eid_from_wire(w) == "SMC.A"
    assert eid_from_wire(b"ABC" + b"\0" * 29) == "ABC"


# -- the table ---------------------------------------------------------------------------------


def test_add_remove_flush() -> None:
    t = EidTable()
    assert t.add_ueid("one") == "ONE"
    assert t.add_ueid("TWO.2") == "TWO.2"
    assert t.ueids == ("ONE", "TWO.2")
    assert t.has_ueid(" one ")
    assert not t.has_ueid("bad id")
    assert t.remove_ueid("one ") == "ONE"
    assert t.ueids == ("TWO.2",)
    assert t.flush_ueids() == 1
    assert t.ueids == ()
    assert t.flush_ueids() == 0


def test_duplicate_is_eexist() -> None:
    t = EidTable(["SMC-A"])
    with pytest.raises(EidError) as ei:
        t.add_ueid("smc-a")
    assert ei.value.errno == errno.EEXIST
    assert_one_sentence(ei.value, "SMC-A", "already defined")
    assert t.ueids == ("SMC-A",)


def test_at_most_eight() -> None:
    t = EidTable([f"U{i}" for i in range(SMC_CLC_MAX_UEID)])
    assert len(t.ueids) == 8
    with pytest.raises(EidError) as ei:
        t.add_ueid("U8")
    assert ei.value.errno == errno.ERANGE
    assert_one_sentence(ei.value, "U8", "maximum of 8")
    # a duplicate of a present UEID is reported as a duplicate even when full
    with pytest.raises(EidError) as ei2:
        t.add_ueid("u0")
    assert ei2.value.errno == errno.EEXIST
    t.remove_ueid("U3")
    t.add_ueid("U8")
    assert t.ueids[-1] == "U8"


def test_remove_unknown_is_enoent() -> None:
    t = EidTable(["A"])
    with pytest.raises(EidError) as ei:
        t.remove_ueid("B")
    assert ei.value.errno == errno.ENOENT
    assert_one_sentence(ei.value, "UEID B", "not defined")
    with pytest.raises(EidError) as ei2:
        t.remove_ueid("B_")
    assert ei2.value.errno == errno.EINVAL


def test_match_ueid_compares_wire_bytes_in_peer_order() -> None:
    t = EidTable(["SMC-A", "SMC-B"])
    assert t.ueids_wire() == (ueid_to_wire("SMC-A"), ueid_to_wire("SMC-B"))
    peer = [ueid_to_wire("OTHER"), ueid_to_wire("SMC-B"), ueid_to_wire("SMC-A")]
    assert t.match_ueid(peer) == "SMC-B"
    assert t.match_ueid([ueid_to_wire("OTHER")]) is None
    assert t.match_ueid([b"smc-a" + b" " * 27]) is None  # the kernel does not fold peer EIDs
    assert t.match_ueid([b"SMC-A" + b"\0" * 27]) is None  # NUL padding is not blank padding
    assert EidTable().match_ueid(peer) is None


# -- SEID --------------------------------------------------------------------------------------


def test_seid_disabled_off_ibm_z() -> None:
    t = EidTable()
    assert t.seid is None
    assert not t.seid_available
    assert not t.seid_enabled
    assert t.seid_status.startswith("disabled (")
    assert "IBM Z" in t.seid_status and "UEID" in t.seid_status
    for op in (t.enable_seid, t.disable_seid):
        with pytest.raises(EidError) as ei:
            op()
        assert ei.value.errno == errno.EOPNOTSUPP
        assert_one_sentence(ei.value, "not supported", "IBM Z")
    t.add_ueid("A")
    t.remove_ueid("A")
    assert not t.seid_enabled


def test_system_eid_format() -> None:
    seid = system_eid(0x12345678, 0x8561)
    assert seid == "IBM-SYSZ-ISMSEID0000000056788561"
    assert seid.startswith(SEID_PREFIX)
    assert len(seid) == 32
    assert normalize_ueid(seid) == seid  # an EID like any other on the wire
    with pytest.raises(EidError, match="16-bit"):
        system_eid(0, 0x10000)


def test_seid_semantics_on_ibm_z() -> None:
    seid = system_eid(0xABCD, 0x3931)
    t = EidTable(seid=seid)
    assert t.seid == seid and t.seid_enabled and t.seid_status == "enabled"
    # disabling needs a UEID (kernel: -ENOENT)
    with pytest.raises(EidError) as ei:
        t.disable_seid()
    assert ei.value.errno == errno.ENOENT
    assert_one_sentence(ei.value, "no UEID")
    t.add_ueid("A")
    t.add_ueid("B")
    t.disable_seid()
    assert not t.seid_enabled and "operator" in t.seid_status
    t.remove_ueid("A")
    assert not t.seid_enabled  # a UEID remains
    t.remove_ueid("B")
    assert t.seid_enabled  # the last UEID went: the SEID is back (kernel's -EAGAIN info)
    t.add_ueid("C")
    t.disable_seid()
    t.flush_ueids()
    assert t.seid_enabled
    t.enable_seid()
    assert t.seid_enabled


def test_malformed_seid_refused() -> None:
    with pytest.raises(EidError, match="exactly 32"):
        EidTable(seid="IBM-SYSZ")


# -- persistence -------------------------------------------------------------------------------


def test_round_trip() -> None:
    t = EidTable(["SMC-A", "smc.b"])
    d = json.loads(json.dumps(t.to_dict()))
    assert d["ueids"] == ["SMC-A", "SMC.B"]  # stored trimmed, not padded
    back = EidTable.from_dict(d)
    assert back == t
    assert EidTable.from_dict({}) == EidTable()


def test_round_trip_keeps_seid_choice_only_where_there_is_a_seid() -> None:
    seid = system_eid(1, 0x8562)
    t = EidTable(["A"], seid=seid)
    t.disable_seid()
    d = t.to_dict()
    assert "IBM-SYSZ" not in json.dumps(d)  # the SEID comes from the machine, not the file
    assert EidTable.from_dict(d, seid=seid) == t
    off_z = EidTable.from_dict(d)
    assert off_z.ueids == ("A",) and not off_z.seid_enabled and off_z.seid is None
    # a stored "disabled" without UEIDs would break the kernel's invariant: SEID stays enabled
    assert EidTable.from_dict({"ueids": [], "seid_enabled": False}, seid=seid).seid_enabled


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        ("x", "not an object"),
        ({"format": 9}, "format 9"),
        ({"ueids": "A"}, "not a list"),
        ({"ueids": ["A", "a"]}, "already defined"),
        ({"ueids": ["A_"]}, "'A_'"),
        ({"ueids": [f"U{i}" for i in range(9)]}, "maximum of 8"),
        ({"ueids": [], "seid_enabled": "yes"}, "not a boolean"),
    ],
)
def test_from_dict_rechecks_every_rule(data: object, needle: str) -> None:
    with pytest.raises(EidError) as ei:
        EidTable.from_dict(data)  # type: ignore[arg-type]
    assert_one_sentence(ei.value, needle)
