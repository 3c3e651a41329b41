"""The handshake's shortcuts for SMC-D Accept/Confirm (a template per message shape, the DMB
token spliced in; a decoded message reused with the token read anew) must give exactly what the
full codec gives, byte for byte and field for field."""

from __future__ import annotations

import random

import pytest

from smcd_daemon.protocol.negotiate import ism
from smcd_daemon.protocol.negotiate.framer import ClcFramer
from smcd_daemon.protocol.negotiate.v2x import smcd_fce
from smcd_daemon.wire.clc import Accept, ClcType, Confirm, SmcdInfo, decode

_RNG = random.Random(7)
TOKENS = [0, 1, 0xFFFF_FFFF, 1 << 63, (1 << 64) - 1, *(_RNG.getrandbits(64) for _ in range(20))]


def message(
    kind: type[Accept | Confirm], token: int, *, first: bool, link: int
) -> Accept | Confirm:
    info = SmcdInfo(gid=0x1122334455667788, token=token, link_id=link, dmbe_size=4, chid=0xFFFF,
                    gid_ext=0x99AABBCCDDEEFF00)  # fmt: skip
    fce = smcd_fce("testhost", 1, 1) if first else None
    return kind(info=info, version=2, first_contact=first, eid="SMCD-TEST", fce=fce)


@pytest.mark.parametrize("kind", [Accept, Confirm])
@pytest.mark.parametrize("first", [False, True])
def test_template_encoding_is_the_full_encoding(kind: type[Accept | Confirm], first: bool) -> None:
    for link in (0x100, 0x200):
        for token in TOKENS:
            msg = message(kind, token, first=first, link=link)
            assert ism.encode_smcd(msg) == msg.encode()


def test_a_token_out_of_range_is_refused_as_by_the_full_encoder() -> None:
    msg = message(Accept, 1 << 64, first=False, link=0x100)
    with pytest.raises(Exception) as full:
        msg.encode()
    with pytest.raises(type(full.value)):
        ism.encode_smcd(msg)


@pytest.mark.parametrize("kind", [Accept, Confirm])
@pytest.mark.parametrize("first", [False, True])
def test_framer_decodes_repeated_answers_as_the_full_decoder(
    kind: type[Accept | Confirm], first: bool
) -> None:
    expect = ClcType.ACCEPT if kind is Accept else ClcType.CONFIRM
    for token in TOKENS:
        raw = message(kind, token, first=first, link=0x300).encode()
        framer = ClcFramer()
        assert framer.feed(raw[:8], expect) is None
        got = framer.feed(raw[8:], expect)
        assert got == decode(raw)
        assert isinstance(got, kind) and isinstance(got.info, SmcdInfo)
        assert got.info.token == token
