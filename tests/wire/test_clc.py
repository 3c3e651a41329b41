"""CLC codec: golden vectors, round trips, stream framing and encoder argument checks.

The golden vectors are written out by hand from the kernel struct layouts (net/smc/smc_clc.h) with
every field's offset in a comment, next to the messages they must decode to. test_clc_hostile.py
reuses them. PROTOCOL.md Appendix A holds the same shapes as tshark 4.0.17 decoded them.
"""

from __future__ import annotations

import dataclasses
from ipaddress import IPv4Network, IPv6Network

import pytest
from hypothesis import HealthCheck, given, settings

from smcd_daemon.errors import ProtocolError, TruncatedError
from smcd_daemon.wire import clc
from smcd_daemon.wire.clc import (
    Accept,
    ClcMessage,
    ClcType,
    Confirm,
    Decline,
    FirstContactExt,
    IpPrefixes,
    IsmDevice,
    OsType,
    Proposal,
    SmcdInfo,
    SmcdV2Extension,
    SmcrInfo,
    SmcType,
    V2Extension,
)
from tests.wire import st_clc


# fmt: off
def hx(*parts: str) -> bytes:
    return bytes.fromhex("".join(parts).replace(" ", ""))


def text32(s: str) -> str:
    """Hex of a 32-byte blank-padded ASCII field."""
    return s.encode().ljust(32, b" ").hex()


ZERO = "00"
PEER = "1234020000aabbcc"
GID_V1 = "fe80000000000000020000fffeaabbcc"  # RoCE v1 GID
GID_V2 = "00000000000000000000ffffc0000201"  # RoCEv2 GID ::ffff:192.0.2.1
GID_V2B = "00000000000000000000ffffc6336401"  # ::ffff:198.51.100.1
MAC = "020000aabbcc"
SMCR = "e2d4c3d9"
SMCD = "e2d4c3c4"

# Linux-style v2 Proposal, typev1 R, typev2 B, one UEID, loopback-ism (two GID/CHID entries).
PROPOSAL_V2_RB = hx(
    SMCR, "01", "00e8", "2c",  # 0 eyecatcher, 4 type 1, 5 length 232, 7 v2 | typev2 B | typev1 R
    PEER,  # 8 id_for_peer
    GID_V1,  # 16 gid
    MAC,  # 32 mac
    "0028",  # 38 iparea_offset 40
    "0000000000000000",  # 40 ISM gid (no native ISM)
    "0000",  # 48 ISM chid
    "0024",  # 50 v2_ext_offset 36 = 28 + 8-byte prefix area
    ZERO * 28,  # 52 vendor oui (3), exp options (5), reserved (20)
    "c0000200", "18", "0000", "00",  # 80 192.0.2.0/24, reserved, 0 IPv6 prefixes
    "01", "02", "00", "11",  # 88 eid_cnt 1, ism_gid_cnt 2, rsvd, release 1 | SEID indicator
    "0000", "0040",  # 92 reserved, 94 smcd_v2_ext_offset 64 = 32 + 32*1
    GID_V2,  # 96 RoCEv2 GID
    "ff", "02", "0001",  # 112 max_conns 255, max_links 2, feature_mask EMULATED_ISM_DEV
    ZERO * 12,  # 116 reserved
    text32("SMC-EID-TEST"),  # 128 UEID
    text32("SEID-SYSTEM-EID"),  # 160 SMC-Dv2 ext: system EID
    ZERO * 16,  # 192 reserved
    "1122334455667788", "ffff",  # 208 entry 1: gid, CHID 0xFFFF (loopback-ism)
    "99aabbccddeeff00", "ffff",  # 218 entry 2: gid_ext, same CHID
    SMCR,  # 228 trailer
)
LOOPBACK = IsmDevice(0xFFFF, 0x1122334455667788, 0x99AABBCCDDEEFF00)
PROPOSAL_V2_RB_MSG = Proposal(
    typev1=SmcType.R,
    typev2=SmcType.B,
    peer_id=hx(PEER),
    gid=hx(GID_V1),
    mac=hx(MAC),
    ip_prefixes=IpPrefixes(IPv4Network("192.0.2.0/24")),
    v2_ext=V2Extension(("SMC-EID-TEST",), 1, True, hx(GID_V2), 255, 2, 1),
    smcd_v2_ext=SmcdV2Extension("SEID-SYSTEM-EID", (LOOPBACK,)),
)

# Pre-5.10 v1 Proposal: iparea_offset 0, the prefix area right at offset 40.
PROPOSAL_V1_OLD = hx(
    SMCR, "01", "0034", "10",  # 0 header: Proposal, length 52, version 1, typev1 R
    PEER,  # 8 id_for_peer
    GID_V1,  # 16 gid
    MAC,  # 32 mac
    "0000",  # 38 iparea_offset 0
    "c0000200", "18", "0000", "00",  # 40 192.0.2.0/24, 0 IPv6 prefixes
    SMCR,  # 48 trailer
)
PROPOSAL_V1_OLD_MSG = Proposal(
    SmcType.R,
    SmcType.R,
    hx(PEER),
    hx(GID_V1),
    hx(MAC),
    version=1,
    ip_prefixes=IpPrefixes(IPv4Network("192.0.2.0/24")),
    has_smcd_area=False,
)

# v2 Proposal from an IPv6 socket, SMC-R v1 only: two IPv6 prefixes, no v2 extension.
PROPOSAL_V2_IPV6 = hx(
    SMCR, "01", "007e", "28",  # 0 header: length 126, v2 | typev2 N | typev1 R
    PEER, GID_V1, MAC,  # 8, 16, 32
    "0028",  # 38 iparea_offset 40
    ZERO * 10,  # 40 ISM gid + chid
    "0000",  # 50 v2_ext_offset 0 (typev2 N)
    ZERO * 28,  # 52
    "00000000", "00", "0000", "02",  # 80 no IPv4 subnet, 2 IPv6 prefixes
    "20010db8000100000000000000000000", "40",  # 88 2001:db8:1::/64
    "20010db8000200000000000000000000", "30",  # 105 2001:db8:2::/48
    SMCR,  # 122 trailer
)
PROPOSAL_V2_IPV6_MSG = Proposal(
    SmcType.R,
    SmcType.N,
    hx(PEER),
    hx(GID_V1),
    hx(MAC),
    ip_prefixes=IpPrefixes(
        IPv4Network("0.0.0.0/0"),
        (IPv6Network("2001:db8:1::/64"), IPv6Network("2001:db8:2::/48")),
    ),
)

# v2 Proposal, SMC-Dv2 only (typev1 N): no prefix area, iparea_offset 0.
PROPOSAL_V2_D = hx(
    SMCR, "01", "00e0", "26",  # 0 header: length 224, v2 | typev2 D | typev1 N
    ZERO * 30,  # 8 id_for_peer, gid, mac: zero without SMC-R
    "0000",  # 38 iparea_offset 0
    ZERO * 10,  # 40 ISM gid + chid
    "001c",  # 50 v2_ext_offset 28 (no prefix area)
    ZERO * 28,  # 52
    "01", "02", "00", "10",  # 80 eid_cnt 1, ism_gid_cnt 2, rsvd, release 1, no SEID
    "0000", "0040",  # 84 reserved, 86 smcd_v2_ext_offset 64
    ZERO * 16,  # 88 RoCEv2 GID (no SMC-Rv2)
    "00", "00", "0001",  # 104 max_conns, max_links (SMC-R only), feature_mask
    ZERO * 12,  # 108 reserved
    text32("SMC-EID-TEST"),  # 120 UEID
    ZERO * 32,  # 152 system EID (SEID disabled off s390)
    ZERO * 16,  # 184 reserved
    "1122334455667788", "ffff",  # 200 loopback-ism gid
    "99aabbccddeeff00", "ffff",  # 210 loopback-ism gid_ext
    SMCR,  # 220 trailer
)
PROPOSAL_V2_D_MSG = Proposal(
    SmcType.N,
    SmcType.D,
    v2_ext=V2Extension(("SMC-EID-TEST",), 1, False, bytes(16), 0, 0, 1),
    smcd_v2_ext=SmcdV2Extension("", (LOOPBACK,)),
)

_R_BODY_V1 = (
    "000123",  # 38 qpn
    "deadbeef",  # 41 rmb_rkey
    "01",  # 45 rmbe_idx
    "00000042",  # 46 rmbe_alert_token
    "23",  # 50 rmbe_size 2 (64 KiB) | qp_mtu 3 (1024)
    "00",  # 51 reserved
    "00007f0000001000",  # 52 rmb_dma_addr
    "00",  # 60 reserved
    "000777",  # 61 psn
)
SMCR_INFO_V1 = SmcrInfo(hx(PEER), hx(GID_V1), hx(MAC), 0x123, 0xDEADBEEF, 0x42, 0x7F0000001000,
                        0x777, 1, 2, 3)
SMCR_INFO_V2 = SmcrInfo(hx(PEER), hx(GID_V2), hx(MAC), 0x123, 0xDEADBEEF, 0x42, 0x7F0000001000,
                        0x777, 1, 2, 3)

# SMC-R v1 Accept, first contact: 68 bytes.
ACCEPT_R_V1 = hx(
    SMCR, "02", "0044", "18",  # 0 Accept, length 68, version 1 | first contact | typev1 R
    PEER, GID_V1, MAC,  # 8 id_for_peer, 16 gid, 32 mac
    *_R_BODY_V1,  # 38 .. 63
    SMCR,  # 64 trailer
)
ACCEPT_R_V1_MSG = Accept(SMCR_INFO_V1, version=1, first_contact=True)

_FCE_R = (
    "80",  # +0 v2_direct
    "21",  # +1 os_type Linux | release 1
    "0000",  # +2 reserved
    text32("host-a"),  # +4 host name
    "ff", "02", "0001",  # +36 max_conns 255, max_links 2, feature_mask 1
    "00000000",  # +40 vendor_exp_options
    ZERO * 8,  # +44 reserved
)
FCE_R = FirstContactExt("host-a", OsType.LINUX, 1, True, True, 255, 2, 1)

# SMC-R v2 Accept, first contact, 52-byte v2.1 FCE: 108 + 52 = 160 bytes.
ACCEPT_R_V2 = hx(
    SMCR, "02", "00a0", "28",  # 0 Accept, length 160, v2 | first contact | R
    PEER, GID_V2, MAC,  # 8, 16 (RoCEv2 GID), 32
    *_R_BODY_V1,  # 38 .. 63
    text32("SMC-EID-TEST"),  # 64 negotiated EID
    ZERO * 8,  # 96 reserved
    *_FCE_R,  # 104 first contact extension (52)
    SMCR,  # 156 trailer
)
ACCEPT_R_V2_MSG = Accept(SMCR_INFO_V2, 2, True, "SMC-EID-TEST", FCE_R)

# SMC-R v2 first-contact Confirm with the GID list extension: 108 + 52 + 4 + 2*16 = 196 bytes.
CONFIRM_R_V2 = hx(
    SMCR, "03", "00c4", "28",  # 0 Confirm, length 196, v2 | first contact | R
    PEER, GID_V2, MAC,  # 8, 16, 32
    *_R_BODY_V1,  # 38 .. 63
    text32("SMC-EID-TEST"),  # 64 EID
    ZERO * 8,  # 96 reserved
    *_FCE_R,  # 104 FCE
    "02", "000000",  # 156 gid_cnt 2, reserved
    GID_V2,  # 160 GID 1
    GID_V2B,  # 176 GID 2
    SMCR,  # 192 trailer
)
CONFIRM_R_V2_MSG = Confirm(SMCR_INFO_V2, 2, True, "SMC-EID-TEST", FCE_R, (hx(GID_V2), hx(GID_V2B)))

# SMC-D v1 Accept: 48 bytes, "SMCD" eyecatchers.
ACCEPT_D_V1 = hx(
    SMCD, "02", "0030", "19",  # 0 Accept, length 48, version 1 | first contact | typev1 D
    "1122334455667788",  # 8 gid
    "0102030405060708",  # 16 DMB token
    "00",  # 24 dmbe_idx
    "10",  # 25 dmbe_size 1 (32 KiB)
    "0000",  # 26 reserved
    "0a0b0c0d",  # 28 linkid
    ZERO * 12,  # 32 reserved
    SMCD,  # 44 trailer
)
ACCEPT_D_V1_MSG = Accept(
    SmcdInfo(0x1122334455667788, 0x0102030405060708, 0x0A0B0C0D, 0, 1), 1, True
)

SMCD_INFO_V2 = SmcdInfo(LOOPBACK.gid, 0x0102030405060708, 0x0A0B0C0D, 0, 1, 0xFFFF,
                        0x99AABBCCDDEEFF00)
_D_BODY_V2 = (
    "1122334455667788",  # 8 gid (upper half of loopback-ism's 128-bit GID)
    "0102030405060708",  # 16 token
    "00", "10", "0000",  # 24 dmbe_idx, 25 dmbe_size 1, 26 reserved
    "0a0b0c0d",  # 28 linkid
    "ffff",  # 32 chid: loopback-ism
    text32("SMC-EID-TEST"),  # 34 EID
    "99aabbccddeeff00",  # 66 gid_ext
)

# SMC-Dv2 Accept (loopback-ism), first contact, 52-byte FCE: 78 + 52 = 130 bytes.
ACCEPT_D_V2 = hx(
    SMCD, "02", "0082", "29",  # 0 Accept, length 130, v2 | first contact | D
    *_D_BODY_V2,  # 8 .. 73
    "00", "21", "0000", text32("host-a"),  # 74 FCE: no v2_direct, Linux release 1, host name
    "00", "00", "0001",  # 110 max_conns/max_links reserved for SMC-D, feature_mask 1
    "00000000", ZERO * 8,  # 114 vendor options, reserved
    SMCD,  # 126 trailer
)
ACCEPT_D_V2_MSG = Accept(
    SMCD_INFO_V2, 2, True, "SMC-EID-TEST",
    FirstContactExt("host-a", OsType.LINUX, 1, feature_mask=1),
)

# SMC-Dv2 Confirm, first contact, release 0: the 36-byte v2.0 FCE: 78 + 36 = 114 bytes.
CONFIRM_D_V2_REL0 = hx(
    SMCD, "03", "0072", "29",  # 0 Confirm, length 114, v2 | first contact | D
    *_D_BODY_V2,  # 8 .. 73
    "00", "20", "0000", text32("host-a"),  # 74 FCE v2.0: Linux, release 0, host name
    SMCD,  # 110 trailer
)
CONFIRM_D_V2_REL0_MSG = Confirm(
    SMCD_INFO_V2, 2, True, "SMC-EID-TEST", FirstContactExt("host-a", OsType.LINUX, 0, v2x=False)
)

DECLINE_V1 = hx(
    SMCR, "04", "001c", "10",  # 0 Decline, length 28, version 1
    PEER,  # 8 id_for_peer
    "03030000",  # 16 peer_diagnosis NOSMCDEV
    "00", "000000",  # 20 os_type 0 (v1), reserved
    SMCR,  # 24 trailer
)
DECLINE_V1_MSG = Decline(0x03030000, hx(PEER), 1, False, OsType.NONE, ())

DECLINE_V2 = hx(
    SMCR, "04", "002c", "20",  # 0 Decline, length 44, version 2
    PEER,  # 8 id_for_peer
    "030f0000",  # 16 NOINDIRECT
    "20", "000000",  # 20 os_type Linux
    "030e0000", "00000000", "00000000", "00000000",  # 24 peer_diagnosis_v2[4]
    SMCR,  # 40 trailer
)
DECLINE_V2_MSG = Decline(0x030F0000, hx(PEER), 2, False, OsType.LINUX, (0x030E0000, 0, 0, 0))

DECLINE_V2_SYNC = hx(
    SMCR, "04", "002c", "28",  # 0 Decline, length 44, version 2 | out of sync (0x08)
    ZERO * 8,  # 8 id_for_peer zero (SMC-D link group)
    "04000000",  # 16 SYNCERR
    "20", "000000",  # 20 Linux
    ZERO * 16,  # 24
    SMCR,  # 40
)
DECLINE_V2_SYNC_MSG = Decline(0x04000000, bytes(8), 2, True)

# fmt: on

GOLDEN: dict[str, tuple[bytes, ClcMessage]] = {
    "proposal_v2_rb_232": (PROPOSAL_V2_RB, PROPOSAL_V2_RB_MSG),
    "proposal_v1_old_52": (PROPOSAL_V1_OLD, PROPOSAL_V1_OLD_MSG),
    "proposal_v2_ipv6": (PROPOSAL_V2_IPV6, PROPOSAL_V2_IPV6_MSG),
    "proposal_v2_d_only": (PROPOSAL_V2_D, PROPOSAL_V2_D_MSG),
    "accept_r_v1_68": (ACCEPT_R_V1, ACCEPT_R_V1_MSG),
    "accept_r_v2_fce52": (ACCEPT_R_V2, ACCEPT_R_V2_MSG),
    "confirm_r_v2_gidlist": (CONFIRM_R_V2, CONFIRM_R_V2_MSG),
    "accept_d_v1_48": (ACCEPT_D_V1, ACCEPT_D_V1_MSG),
    "accept_d_v2_fce52": (ACCEPT_D_V2, ACCEPT_D_V2_MSG),
    "confirm_d_v2_fce36": (CONFIRM_D_V2_REL0, CONFIRM_D_V2_REL0_MSG),
    "decline_v1_28": (DECLINE_V1, DECLINE_V1_MSG),
    "decline_v2_44": (DECLINE_V2, DECLINE_V2_MSG),
    "decline_v2_sync": (DECLINE_V2_SYNC, DECLINE_V2_SYNC_MSG),
}

# PROTOCOL.md Appendix A probe hex (what tshark 4.0.17 decoded); its host name is NUL padded,
# so only decoding is compared for that one.
APPENDIX_A = {
    "proposal_v1_smcr": "e2d4c3d9010034101234020000aabbccfe80000000000000020000fffeaabbcc020000"
    "aabbcc00007f00000008000000e2d4c3d9",
    "proposal_v2_linux": "e2d4c3d90100e82c1234020000aabbccfe80000000000000020000fffeaabbcc02"
    "0000aabbcc0028000000000000000000000024000000000000000000000000000000000000000000000000000000"
    "007f00000008000000010200110000004000000000000000000000ffff7f000001ff020001000000000000000000"
    "000000534d432d4549442d544553542020202020202020202020202020202020202020534549442d53595354454d"
    "2d4549442020202020202020202020202020202020000000000000000000000000000000001122334455667788ff"
    "ff99aabbccddeeff00ffffe2d4c3d9",
    "accept_smcr_v1": "e2d4c3d9020044181234020000aabbccfe80000000000000020000fffeaabbcc020000aa"
    "bbcc000123deadbeef0100000042230000007f000000100000000777e2d4c3d9",
    "accept_smcd_v2_fce": "e2d4c3c40200822911223344556677880102030405060708001000000a0b0c0dff"
    "ff534d432d4549442d544553542020202020202020202020202020202020202020a1a2a3a4a5a6a7a80021000070"
    "726f62652d686f73740000000000000000000000000000000000000000000000000001000000000000000000000000"
    "e2d4c3c4",
    "decline_v1": "e2d4c3d904001c101234020000aabbcc0303000000000000e2d4c3d9",
    "decline_v2": "e2d4c3d904002c201234020000aabbcc030f000020000000030e000000000000000000000000"
    "0000e2d4c3d9",
}


# ---- golden vectors -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_golden_decodes_to_expected_message(name: str) -> None:
    raw, msg = GOLDEN[name]
    assert clc.decode(raw) == msg
    assert type(msg).decode(raw) == msg


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_golden_encodes_byte_exact(name: str) -> None:
    raw, msg = GOLDEN[name]
    assert msg.encode() == raw


def test_golden_lengths_are_the_kernel_ones() -> None:
    sizes = {name: len(raw) for name, (raw, _) in GOLDEN.items()}
    assert sizes["proposal_v2_rb_232"] == 232
    assert sizes["proposal_v1_old_52"] == 52
    assert sizes["accept_r_v1_68"] == clc.SMCR_LEN_V1 == 68
    assert sizes["accept_d_v1_48"] == clc.SMCD_LEN_V1 == 48
    assert sizes["accept_r_v2_fce52"] == clc.SMCR_LEN_V2 + clc.FCE_V2X_LEN == 160
    assert sizes["accept_d_v2_fce52"] == clc.SMCD_LEN_V2 + clc.FCE_V2X_LEN == 130
    assert sizes["confirm_d_v2_fce36"] == clc.SMCD_LEN_V2 + clc.FCE_LEN == 114
    assert sizes["confirm_r_v2_gidlist"] == 108 + 52 + 4 + 2 * 16
    assert sizes["decline_v1_28"] == clc.DECLINE_LEN_V1
    assert sizes["decline_v2_44"] == clc.DECLINE_LEN_V2


def test_linux_proposal_offsets() -> None:
    """Linux's offset conventions: iparea_offset 40, v2_ext_offset = 28 + prefix area,
    smcd_v2_ext_offset = 32 + 32 * eid_cnt, header version 2."""
    raw = PROPOSAL_V2_RB
    assert raw[7] >> 4 == 2
    assert int.from_bytes(raw[38:40], "big") == 40
    assert int.from_bytes(raw[50:52], "big") == 28 + 8
    assert int.from_bytes(raw[94:96], "big") == 32 + 32 * 1
    ipv6 = PROPOSAL_V2_IPV6_MSG
    assert ipv6.ip_prefixes is not None
    with_v2 = dataclasses.replace(
        ipv6, typev2=SmcType.R, v2_ext=V2Extension(("A", "B", "C"), roce_gid=hx(GID_V2))
    )
    enc = with_v2.encode()
    assert int.from_bytes(enc[50:52], "big") == 28 + 8 + 2 * 17
    assert clc.decode(enc) == with_v2


def test_loopback_ism_is_exposed_as_one_device() -> None:
    ext = PROPOSAL_V2_RB_MSG.smcd_v2_ext
    assert ext is not None
    (dev,) = ext.devices
    assert dev.chid == clc.LOOPBACK_ISM_CHID and dev.emulated
    assert dev.gid128 == 0x1122334455667788_99AABBCCDDEEFF00
    assert clc.IsmDevice.from_gid128(0xFFFF, dev.gid128) == dev
    assert SMCD_INFO_V2.gid128 == dev.gid128


def test_eyecatchers_as_linux_sends_them() -> None:
    assert ACCEPT_D_V2[:4] == ACCEPT_D_V2[-4:] == clc.SMCD_EYECATCHER
    assert ACCEPT_R_V2[:4] == ACCEPT_R_V2[-4:] == clc.SMCR_EYECATCHER
    for msg in (PROPOSAL_V2_D_MSG, DECLINE_V2_SYNC_MSG):
        enc = msg.encode()
        assert enc[:4] == enc[-4:] == clc.SMCR_EYECATCHER


def test_either_eyecatcher_is_accepted_at_both_ends() -> None:
    """smc_clc_msg_hdr_valid accepts SMCR or SMCD independently at head and trailer."""
    for raw, msg in (GOLDEN["accept_r_v2_fce52"], GOLDEN["proposal_v2_rb_232"]):
        swapped = clc.SMCD_EYECATCHER + raw[4:-4] + clc.SMCD_EYECATCHER
        assert clc.decode(swapped) == msg
    raw, msg = GOLDEN["accept_d_v1_48"]
    assert clc.decode(clc.SMCR_EYECATCHER + raw[4:]) == msg


def test_appendix_a_probe_vectors_decode() -> None:
    msgs = {k: clc.decode(bytes.fromhex(v)) for k, v in APPENDIX_A.items()}
    assert msgs["proposal_v1_smcr"] == dataclasses.replace(
        PROPOSAL_V1_OLD_MSG, ip_prefixes=IpPrefixes(IPv4Network("127.0.0.0/8"))
    )
    v2 = msgs["proposal_v2_linux"]
    assert isinstance(v2, Proposal) and v2.v2_ext is not None
    assert v2.v2_ext.roce_gid[-4:] == bytes([127, 0, 0, 1])
    assert v2.smcd_v2_ext == PROPOSAL_V2_RB_MSG.smcd_v2_ext
    acc = msgs["accept_smcd_v2_fce"]
    assert isinstance(acc, Accept) and isinstance(acc.info, SmcdInfo) and acc.fce is not None
    assert acc.fce.hostname == "probe-host"  # NUL padding stripped like blank padding
    assert acc.info.gid_ext == 0xA1A2A3A4A5A6A7A8 and acc.fce.feature_mask == 1
    assert msgs["decline_v1"] == DECLINE_V1_MSG
    assert msgs["decline_v2"] == DECLINE_V2_MSG
    for name in ("proposal_v1_smcr", "proposal_v2_linux", "accept_smcr_v1", "decline_v2"):
        assert msgs[name].encode().hex() == APPENDIX_A[name]


def test_smcr_confirm_release0_fce_forms_are_told_apart() -> None:
    """Release 0: Linux >= 6.6 sends the 52-byte FCE (v2.1 fields zero), older Linux 36 bytes."""
    fce52 = FirstContactExt("h", OsType.LINUX, 0, v2x=True)
    fce36 = FirstContactExt("h", OsType.LINUX, 0, v2x=False)
    for fce in (fce52, fce36):
        for gids in ((), (hx(GID_V2),), (hx(GID_V2), hx(GID_V2B))):
            msg = Confirm(SMCR_INFO_V2, 2, True, "E", fce, gids)
            assert clc.decode(msg.encode()) == msg
    ambiguous = Confirm(
        SMCR_INFO_V2, 2, True, "E", dataclasses.replace(fce52, max_conns=2), (b"x" * 16,)
    )
    with pytest.raises(ProtocolError) as exc:
        ambiguous.encode()
    assert exc.value.field == "max_conns"


# ---- round trips ------------------------------------------------------------------------------

_SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@_SETTINGS
@given(st_clc.proposals())
def test_proposal_round_trip(msg: Proposal) -> None:
    raw = msg.encode()
    assert Proposal.decode(raw) == msg
    assert clc.decode(raw) == msg
    assert clc.peek_header(raw[:8]).length == len(raw)


@_SETTINGS
@given(st_clc.accepts())
def test_accept_round_trip(msg: Accept) -> None:
    raw = msg.encode()
    assert clc.decode(raw) == msg
    assert clc.peek_header(raw[:8]).length == len(raw)


@_SETTINGS
@given(st_clc.confirms())
def test_confirm_round_trip(msg: Confirm) -> None:
    raw = msg.encode()
    assert clc.decode(raw) == msg
    assert clc.peek_header(raw[:8]).length == len(raw)


@_SETTINGS
@given(st_clc.declines())
def test_decline_round_trip(msg: Decline) -> None:
    raw = msg.encode()
    assert clc.decode(raw) == msg
    assert clc.peek_header(raw[:8]).length == len(raw)


@settings(max_examples=100, deadline=None)
@given(st_clc.clc_messages())
def test_reencoding_decoded_bytes_is_stable(msg: clc.ClcMessage) -> None:
    raw = msg.encode()
    assert clc.decode(raw).encode() == raw


def test_samples_cover_every_kind_and_decode() -> None:
    kinds = {(type(m).__name__, m.version >= 2) for m in map(clc.decode, st_clc.SAMPLES)}
    for name in ("Proposal", "Accept", "Confirm", "Decline"):
        assert (name, False) in kinds and (name, True) in kinds
    for raw, msg in zip(st_clc.SAMPLES, st_clc.SAMPLE_MESSAGES, strict=True):
        assert clc.decode(raw) == msg


# ---- stream framing -----------------------------------------------------------------------------


def test_peek_header_frames_a_stream() -> None:
    stream = b"".join(raw for raw, _ in GOLDEN.values())
    out = []
    while stream:
        hdr = clc.peek_header(stream[: clc.CLC_HEADER_LEN])
        out.append(clc.decode(stream[: hdr.length]))
        stream = stream[hdr.length :]
    assert out == [msg for _, msg in GOLDEN.values()]


def test_peek_header_fields() -> None:
    hdr = clc.peek_header(ACCEPT_D_V2[:8])
    assert hdr == clc.ClcHeader(clc.SMCD_EYECATCHER, ClcType.ACCEPT, 130, 2, 1, 2)
    assert hdr.first_contact
    assert clc.peek_header(DECLINE_V2_SYNC).first_contact  # extra bytes beyond 8 are ignored


@pytest.mark.parametrize(
    ("ctype", "length"),
    [
        (1, 51),
        (1, clc.CLC_MAX_LEN + 1),
        (2, 47),
        (2, 161),
        (3, 47),
        (3, 293),
        (4, 27),
        (4, 45),
        (4, 0),
        (1, 0xFFFF),
    ],
)
def test_peek_header_rejects_lengths_out_of_range(ctype: int, length: int) -> None:
    first8 = clc.SMCR_EYECATCHER + bytes([ctype]) + length.to_bytes(2, "big") + b"\x20"
    with pytest.raises(ProtocolError) as exc:
        clc.peek_header(first8)
    assert exc.value.field == "length" and exc.value.offset == 5


def test_peek_header_limits_match_the_largest_messages() -> None:
    biggest = Proposal(
        SmcType.B,
        SmcType.B,
        ip_prefixes=IpPrefixes(ipv6=tuple(IPv6Network(f"2001:db8:{i}::/64") for i in range(8))),
        v2_ext=V2Extension(tuple(f"EID{i}" for i in range(8))),
        smcd_v2_ext=SmcdV2Extension("S", (LOOPBACK,) * 4),
    ).encode()
    assert len(biggest) == clc.CLC_MAX_LEN == 652
    assert clc.peek_header(biggest[:8]).length == 652
    gids = tuple(bytes([i]) * 16 for i in range(clc.MAX_GID_LIST))
    confirm = Confirm(SMCR_INFO_V2, 2, True, "E", FCE_R, gids).encode()
    assert len(confirm) == clc.MAX_LEN_BY_TYPE[ClcType.CONFIRM]
    assert len(ACCEPT_R_V2) == clc.MAX_LEN_BY_TYPE[ClcType.ACCEPT]
    assert len(PROPOSAL_V1_OLD) == clc.MIN_LEN_BY_TYPE[ClcType.PROPOSAL]


def test_peek_header_needs_8_bytes() -> None:
    with pytest.raises(TruncatedError) as exc:
        clc.peek_header(ACCEPT_R_V1[:7])
    assert exc.value.field == "header"


# ---- encoder argument checks --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("msg", "field"),
    [
        (dataclasses.replace(DECLINE_V1_MSG, version=0), "version"),
        (dataclasses.replace(DECLINE_V1_MSG, version=16), "version"),
        (dataclasses.replace(DECLINE_V1_MSG, diagnosis=1 << 32), "peer_diagnosis"),
        (dataclasses.replace(DECLINE_V1_MSG, diagnosis_v2=(0, 0, 0, 0)), "peer_diagnosis_v2"),
        (dataclasses.replace(DECLINE_V2_MSG, diagnosis_v2=()), "peer_diagnosis_v2"),
        (dataclasses.replace(DECLINE_V2_MSG, peer_id=b"short"), "id_for_peer"),
        (dataclasses.replace(ACCEPT_R_V1_MSG, eid="X"), "eid"),
        (dataclasses.replace(ACCEPT_R_V2_MSG, fce=None), "fce"),
        (dataclasses.replace(ACCEPT_R_V2_MSG, eid="x" * 33), "eid"),
        (dataclasses.replace(ACCEPT_R_V2_MSG, eid="trailing "), "eid"),
        (dataclasses.replace(ACCEPT_R_V2_MSG, eid="€"), "eid"),
        (dataclasses.replace(ACCEPT_R_V2_MSG, gid_list=(bytes(16),)), "gid_cnt"),
        (dataclasses.replace(CONFIRM_R_V2_MSG, gid_list=(bytes(16),) * 9), "gid_cnt"),
        (dataclasses.replace(CONFIRM_R_V2_MSG, gid_list=(bytes(15),)), "gid_list"),
        (
            dataclasses.replace(
                ACCEPT_R_V1_MSG, info=dataclasses.replace(SMCR_INFO_V1, qpn=1 << 24)
            ),
            "qpn",
        ),
        (dataclasses.replace(ACCEPT_D_V1_MSG, info=SMCD_INFO_V2), "chid"),
        (dataclasses.replace(ACCEPT_D_V2_MSG, fce=FirstContactExt(release=1, v2x=False)), "fce"),
        (
            dataclasses.replace(
                ACCEPT_D_V2_MSG, fce=FirstContactExt(release=0, v2x=False, max_links=1)
            ),
            "fce",
        ),
        (dataclasses.replace(ACCEPT_D_V2_MSG, fce=FirstContactExt(os_type=16)), "os_type"),
        (dataclasses.replace(PROPOSAL_V2_RB_MSG, v2_ext=None), "v2_ext"),
        (dataclasses.replace(PROPOSAL_V2_RB_MSG, smcd_v2_ext=None), "smcd_v2_ext"),
        (dataclasses.replace(PROPOSAL_V2_RB_MSG, ip_prefixes=None), "ip_prefixes"),
        (dataclasses.replace(PROPOSAL_V2_RB_MSG, has_smcd_area=False), "iparea_offset"),
        (dataclasses.replace(PROPOSAL_V2_RB_MSG, mac=b"\x00" * 5), "mac"),
        (dataclasses.replace(PROPOSAL_V2_RB_MSG, typev1=7), "typev1"),  # type: ignore[arg-type]
        (dataclasses.replace(PROPOSAL_V2_D_MSG, ism_gid=9), "ism_gid"),
        (dataclasses.replace(PROPOSAL_V1_OLD_MSG, typev1=SmcType.N), "typev1"),
        (dataclasses.replace(PROPOSAL_V1_OLD_MSG, typev1=SmcType.D), "iparea_offset"),
        (dataclasses.replace(PROPOSAL_V1_OLD_MSG, v2_ext=V2Extension()), "v2_ext_offset"),
        (
            dataclasses.replace(PROPOSAL_V2_RB_MSG, v2_ext=V2Extension(("E",) * 9)),
            "eid_cnt",
        ),
        (
            dataclasses.replace(
                PROPOSAL_V2_RB_MSG, smcd_v2_ext=SmcdV2Extension("", (LOOPBACK,) * 5)
            ),
            "ism_gid_cnt",
        ),
        (
            dataclasses.replace(
                PROPOSAL_V2_RB_MSG, smcd_v2_ext=SmcdV2Extension("", (IsmDevice(0xFFFF, 1),))
            ),
            "gid_ext",
        ),
        (
            dataclasses.replace(
                PROPOSAL_V2_RB_MSG, smcd_v2_ext=SmcdV2Extension("", (IsmDevice(0x1234, 1, 2),))
            ),
            "gid_ext",
        ),
        (
            dataclasses.replace(
                PROPOSAL_V2_IPV6_MSG,
                ip_prefixes=IpPrefixes(ipv6=(IPv6Network("2001:db8::/32"),) * 9),
            ),
            "ipv6_prefixes_cnt",
        ),
    ],
)
def test_encoder_rejects_bad_arguments_with_protocol_error(msg: clc.ClcMessage, field: str) -> None:
    with pytest.raises(ProtocolError) as exc:
        msg.encode()
    assert exc.value.field == field
