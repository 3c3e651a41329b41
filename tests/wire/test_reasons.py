"""Reason codes: values as the kernel defines them, and an explanation for every one."""

from __future__ import annotations

import pytest

from smcd_daemon.errors import SmcError
from smcd_daemon.wire import llc, reasons
from smcd_daemon.wire.reasons import (
    DELETE_LINK_KERNEL_NAMES,
    DeclineReason,
    DeleteLinkReason,
    LegacyDeclineReason,
    ReasonCodeError,
    explain,
    parse_code,
)

# Transcribed from torvalds/linux net/smc/smc_clc.h (6.12; unchanged in newer trees), independent
# of reasons.py so a typo there cannot hide.
KERNEL_DECL = {
    "MEM": 0x01010000,
    "TIMEOUT_CL": 0x02010000,
    "TIMEOUT_AL": 0x02020000,
    "CNFERR": 0x03000000,
    "PEERNOSMC": 0x03010000,
    "IPSEC": 0x03020000,
    "NOSMCDEV": 0x03030000,
    "NOSMCDDEV": 0x03030001,
    "NOSMCRDEV": 0x03030002,
    "NOISM2SUPP": 0x03030003,
    "NOV2EXT": 0x03030004,
    "NOV2DEXT": 0x03030005,
    "NOSEID": 0x03030006,
    "NOSMCD2DEV": 0x03030007,
    "NOUEID": 0x03030008,
    "RELEASEERR": 0x03030009,
    "MAXCONNERR": 0x0303000A,
    "MAXLINKERR": 0x0303000B,
    "MODEUNSUPP": 0x03040000,
    "RMBE_EC": 0x03050000,
    "OPTUNSUPP": 0x03060000,
    "DIFFPREFIX": 0x03070000,
    "GETVLANERR": 0x03080000,
    "ISMVLANERR": 0x03090000,
    "NOACTLINK": 0x030A0000,
    "NOSRVLINK": 0x030B0000,
    "VERSMISMAT": 0x030C0000,
    "MAX_DMB": 0x030D0000,
    "NOROUTE": 0x030E0000,
    "NOINDIRECT": 0x030F0000,
    "SYNCERR": 0x04000000,
    "PEERDECL": 0x05000000,
    "INTERR": 0x09990000,
    "ERR_RTOK": 0x09990001,
    "ERR_RDYLNK": 0x09990002,
    "ERR_REGBUF": 0x09990003,
}

# net/smc/smc_llc.h
KERNEL_DEL = {
    "LOST_PATH": 0x00010000,
    "OP_INIT_TERM": 0x00020000,
    "PROG_INIT_TERM": 0x00030000,
    "PROT_VIOL": 0x00040000,
    "NO_ASYM_NEEDED": 0x00050000,
    "NOLNK": 0x00100000,
    "NOLGR": 0x00200000,
}


def test_decline_enum_is_exactly_the_kernel_table() -> None:
    assert {m.name: m.value for m in DeclineReason} == KERNEL_DECL


def test_delete_link_kernel_names_cover_the_kernel_table() -> None:
    names = {v.removeprefix("SMC_LLC_DEL_"): int(k) for k, v in DELETE_LINK_KERNEL_NAMES.items()}
    assert names == KERNEL_DEL
    assert {int(m) for m in DeleteLinkReason} == set(KERNEL_DEL.values()) | {0}
    assert reasons.DeleteLinkReason is llc.DeleteLinkReason  # one definition, in the codec


def test_legacy_codes_do_not_collide_with_current_ones() -> None:
    assert not {int(m) for m in LegacyDeclineReason} & {int(m) for m in DeclineReason}
    assert LegacyDeclineReason.REPLY == 0x06000000
    assert LegacyDeclineReason.INTERR_OLD == 0x99990000


@pytest.mark.parametrize("member", list(DeclineReason), ids=lambda m: m.name)
def test_every_decline_code_is_explained(member: DeclineReason) -> None:
    exp = explain(int(member))
    assert exp.known
    assert exp.name == f"SMC_CLC_DECL_{member.name}"
    assert exp.kind == "CLC decline"
    assert exp.code == member.value
    assert exp.class_byte == member.value >> 24
    assert exp.class_description in reasons.CLASS_DESCRIPTIONS.values()
    assert len(exp.meaning) > 10
    assert len(exp.advice) > 20
    assert exp.advice != exp.meaning
    assert "\n" not in exp.meaning + exp.advice


@pytest.mark.parametrize("member", list(LegacyDeclineReason), ids=lambda m: m.name)
def test_every_legacy_code_is_explained_as_older_linux(member: LegacyDeclineReason) -> None:
    exp = explain(int(member))
    assert exp.known and exp.kind == "CLC decline (older Linux)"
    assert exp.name is not None and exp.name.startswith("SMC_CLC_DECL_")
    assert not exp.name.endswith("_OLD")
    assert exp.advice


@pytest.mark.parametrize("member", list(DELETE_LINK_KERNEL_NAMES), ids=lambda m: m.name)
def test_every_delete_link_reason_is_explained(member: DeleteLinkReason) -> None:
    for exp in (explain(int(member)), reasons.explain_delete_link(int(member))):
        assert exp.name == DELETE_LINK_KERNEL_NAMES[member]
        assert exp.kind == "LLC DELETE LINK"
        assert exp.meaning and exp.advice


def test_delete_link_zero_and_unknown() -> None:
    assert "successful" in reasons.explain_delete_link(0).meaning
    exp = reasons.explain_delete_link(0x00300000)
    assert exp.name is None and "unknown" in exp.meaning


def test_advice_points_at_the_right_knob() -> None:
    assert "SMC TCP option" in explain(DeclineReason.PEERNOSMC).meaning
    assert "listener" in explain(DeclineReason.PEERNOSMC).advice
    for code in (DeclineReason.NOUEID, DeclineReason.NOSMCD2DEV, DeclineReason.NOSEID):
        assert "smcctl ueid add" in explain(code).advice
    for code in (DeclineReason.NOROUTE, DeclineReason.NOINDIRECT):
        assert "RoCE netdevs" in explain(code).advice
    assert "smcr_max_conns_per_lgr" in explain(DeclineReason.MAXCONNERR).advice
    assert "IPsec" in explain(DeclineReason.NOSMCDEV).advice  # the pre-2018 meaning


def test_every_class_byte_in_use_has_a_description() -> None:
    used = {m.value >> 24 for m in DeclineReason} | {m.value >> 24 for m in LegacyDeclineReason}
    assert used <= set(reasons.CLASS_DESCRIPTIONS)


@pytest.mark.parametrize(
    ("code", "top", "word"),
    [
        (0x0303FFFF, 0x03, "configuration"),
        (0x01020000, 0x01, "resources"),
        (0x02990000, 0x02, "timeout"),
        (0x09990077, 0x09, "internal"),
        (0x05000001, 0x05, "peer decline"),
        (0x0001869F, 0x00, "no decline class"),
    ],
)
def test_unknown_code_is_interpreted_by_its_class(code: int, top: int, word: str) -> None:
    exp = explain(code)
    assert not exp.known and exp.name is None and exp.kind == "unknown"
    assert exp.class_byte == top
    assert exp.class_description.startswith(word)
    assert "unknown" in exp.meaning and f"0x{top:02x}" in exp.meaning
    assert exp.meaning.endswith(f"({word})")  # the class's name, not a cut-off sentence
    assert exp.advice


def test_unassigned_class_says_so() -> None:
    exp = explain(0x7F000001)
    assert exp.name is None
    assert "unassigned class 0x7f" in exp.class_description


def test_zero_means_no_reason() -> None:
    exp = explain(0)
    assert exp.name is None and exp.kind == "none" and "no reason" in exp.meaning


def test_add_link_reject_reason() -> None:
    exp = reasons.explain_add_link_reject(1)
    assert exp.name == "SMC_LLC_REJ_RSN_NO_ALT_PATH" and "alternate path" in exp.meaning
    assert reasons.explain_add_link_reject(7).name is None
    assert "not rejected" in reasons.explain_add_link_reject(0).meaning
    with pytest.raises(ReasonCodeError):
        reasons.explain_add_link_reject(16)


@pytest.mark.parametrize("bad", [-1, 1 << 32, True])
def test_out_of_range_codes_are_refused(bad: int) -> None:
    with pytest.raises(ReasonCodeError) as info:
        explain(bad)
    assert isinstance(info.value, SmcError) and isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("0x030f0000", 0x030F0000),
        ("0X030F0000", 0x030F0000),
        (" 0x3030008 ", 0x03030008),
        ("50528264", 0x03030008),
        ("030e0000", 0x030E0000),  # smcss prints 8 hex digits; a hex letter makes it unambiguous
        ("03030008", 0x03030008),  # 8 digits with a leading zero: a code without its 0x
        ("0x0303_000a", 0x0303000A),
        ("0", 0),
    ],
)
def test_parse_code_accepts_operator_spellings(text: str, value: int) -> None:
    assert parse_code(text) == value


@pytest.mark.parametrize("text", ["", "0x", "zz", "-5", "0x1ffffffff", "4294967296", "3.5", "0xg"])
def test_parse_code_rejects_garbage(text: str) -> None:
    with pytest.raises(ReasonCodeError):
        parse_code(text)


def test_local_fallback_codes_match_the_client_library() -> None:
    """smc_handoff defines the local codes; the explanations here must name the same values."""
    from smc_handoff import messages
    from smcd_daemon.wire.reasons import LocalReason

    for reason in LocalReason:
        assert getattr(messages, f"FALLBACK_{reason.name}") == reason.value
        exp = explain(reason.value)
        assert exp.known and exp.name == f"SMCD_FALLBACK_{reason.name}"
        assert exp.class_byte == 0xFF and "smcd local" in exp.class_description
