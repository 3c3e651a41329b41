"""The library's stdlib CLC Decline (``smc_handoff.peer_option.clc_decline``), written when it
falls back toward a peer that showed the SMC TCP option without the daemon (#11), is the
daemon's wire codec's Decline byte for byte, and the daemon's pre-CLC Decline is too."""

from __future__ import annotations

import pytest

from smc_handoff.message_defs import FALLBACK_DAEMON_UNAVAILABLE
from smc_handoff.peer_option import clc_decline
from smcd_daemon.adapters.handoff.predecline import decline_bytes
from smcd_daemon.wire.clc_base import OsType
from smcd_daemon.wire.clc_decline import Decline
from smcd_daemon.wire.reasons import DeclineReason

CODES = [FALLBACK_DAEMON_UNAVAILABLE, 0xFF000005, int(DeclineReason.MAX_DMB),
         int(DeclineReason.NOSMCDEV), 0, 0xFFFFFFFF]  # fmt: skip


@pytest.mark.parametrize("code", CODES)
def test_v2_matches_the_codec(code: int) -> None:
    raw = clc_decline(code)
    assert raw == Decline(code).encode() == decline_bytes(code)
    assert len(raw) == 44
    back = Decline.decode(raw)
    assert (back.diagnosis, back.version, back.os_type, back.out_of_sync) == (
        code, 2, OsType.LINUX, False)  # fmt: skip


@pytest.mark.parametrize("code", CODES)
def test_v1_matches_the_codec(code: int) -> None:
    raw = clc_decline(code, version=1)
    want = Decline(code, version=1, os_type=OsType.NONE, diagnosis_v2=()).encode()
    assert raw == want == decline_bytes(code, 1)
    assert len(raw) == 28 and Decline.decode(raw).diagnosis == code
