"""Hypothesis strategies for CLC messages, and SAMPLES: valid encoded messages of every kind.

Imported by the CLC tests, the fuzz helpers and the tshark oracle tests. Every strategy only
produces messages the encoder accepts, so ``decode(m.encode()) == m`` must hold for all of them.
"""

from __future__ import annotations

from ipaddress import IPv4Network, IPv6Network

from hypothesis import strategies as st

from smcd_daemon.wire.clc import (
    LOOPBACK_ISM_CHID,
    MAX_GID_LIST,
    MAX_ISM_GID_ENTRIES,
    MAX_UEIDS,
    MAX_V6_PREFIXES,
    Accept,
    ClcMessage,
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

__all__ = [
    "SAMPLES",
    "SAMPLE_MESSAGES",
    "accepts",
    "clc_messages",
    "confirms",
    "declines",
    "proposals",
]

u4 = st.integers(0, 0xF)
u8 = st.integers(0, 0xFF)
u16 = st.integers(0, 0xFFFF)
u24 = st.integers(0, 0xFFFFFF)
u32 = st.integers(0, 0xFFFFFFFF)
u64 = st.integers(0, (1 << 64) - 1)
versions_v2 = st.integers(2, 15)


def _blob(n: int) -> st.SearchStrategy[bytes]:
    return st.binary(min_size=n, max_size=n)


# 32-byte blank-padded text: latin-1, no trailing blank/NUL (that is the padding)
text32 = st.text(alphabet=st.characters(min_codepoint=0, max_codepoint=255), max_size=32).map(
    lambda s: s.rstrip(" \x00")
) | st.sampled_from(["SMC-EID-TEST", "SEID-SYSTEM-EID", "host-a", "A.B-C", ""])

ipv4_nets = st.builds(
    lambda a, n: IPv4Network((a, n), strict=False), st.integers(0, 2**32 - 1), st.integers(0, 32)
)
ipv6_nets = st.builds(
    lambda a, n: IPv6Network((a, n), strict=False), st.integers(0, 2**128 - 1), st.integers(0, 128)
)
prefix_areas = st.builds(
    IpPrefixes, ipv4_nets, st.lists(ipv6_nets, max_size=MAX_V6_PREFIXES).map(tuple)
)

native_devices = st.builds(IsmDevice, st.integers(0, 0xFEFF), u64)
emulated_devices = st.builds(IsmDevice, st.integers(0xFF00, 0xFFFF), u64, u64)


@st.composite
def ism_device_lists(draw: st.DrawFn) -> tuple[IsmDevice, ...]:
    devices: list[IsmDevice] = []
    entries = 0
    for dev in draw(st.lists(native_devices | emulated_devices, max_size=MAX_ISM_GID_ENTRIES)):
        need = 2 if dev.emulated else 1
        if entries + need <= MAX_ISM_GID_ENTRIES:
            devices.append(dev)
            entries += need
    return tuple(devices)


v2_extensions = st.builds(
    V2Extension,
    eids=st.lists(text32, max_size=MAX_UEIDS).map(tuple),
    release=u4,
    seid_indicator=st.booleans(),
    roce_gid=_blob(16),
    max_conns=u8,
    max_links=u8,
    feature_mask=u16,
)
smcd_v2_extensions = st.builds(SmcdV2Extension, seid=text32, devices=ism_device_lists())
smc_types = st.sampled_from(SmcType)


@st.composite
def proposals(draw: st.DrawFn) -> Proposal:
    peer_id, gid, mac = draw(_blob(8)), draw(_blob(16)), draw(_blob(6))
    ism_gid, ism_chid = draw(u64), draw(u16)
    if draw(st.booleans()):  # v1
        t1 = draw(st.sampled_from([SmcType.R, SmcType.D, SmcType.B]))
        has_area = True if t1.has_d else draw(st.booleans())
        return Proposal(
            typev1=t1,
            typev2=draw(smc_types),
            peer_id=peer_id,
            gid=gid,
            mac=mac,
            version=1,
            ism_gid=ism_gid if has_area else 0,
            ism_chid=ism_chid if has_area else 0,
            ip_prefixes=draw(prefix_areas),
            has_smcd_area=has_area,
        )
    t1, t2 = draw(smc_types), draw(smc_types)
    if t1 == SmcType.N:  # the kernel reads byte 47 as ipv6_prefixes_cnt then
        ism_gid = (ism_gid & ~0xFF) | draw(st.integers(0, MAX_V6_PREFIXES))
    return Proposal(
        typev1=t1,
        typev2=t2,
        peer_id=peer_id,
        gid=gid,
        mac=mac,
        version=draw(versions_v2),
        ism_gid=ism_gid,
        ism_chid=ism_chid,
        ip_prefixes=draw(prefix_areas) if t1 != SmcType.N else None,
        v2_ext=draw(v2_extensions) if t2 != SmcType.N else None,
        smcd_v2_ext=draw(smcd_v2_extensions) if t2.has_d else None,
    )


smcr_infos = st.builds(
    SmcrInfo,
    peer_id=_blob(8),
    gid=_blob(16),
    mac=_blob(6),
    qpn=u24,
    rmb_rkey=u32,
    rmbe_alert_token=u32,
    rmb_dma_addr=u64,
    psn=u24,
    rmbe_idx=u8,
    rmbe_size=u4,
    qp_mtu=u4,
)


def smcd_infos(v2: bool) -> st.SearchStrategy[SmcdInfo]:
    return st.builds(
        SmcdInfo,
        gid=u64,
        token=u64,
        link_id=u32,
        dmbe_idx=u8,
        dmbe_size=u4,
        chid=u16 if v2 else st.just(0),
        gid_ext=u64 if v2 else st.just(0),
    )


@st.composite
def first_contact_exts(draw: st.DrawFn) -> FirstContactExt:
    release = draw(u4)
    v2x = True if release >= 1 else draw(st.booleans())
    extra = {}
    if v2x:
        extra = {
            "max_conns": draw(u8),
            "max_links": draw(u8),
            "feature_mask": draw(u16),
            "vendor_exp_options": draw(u32),
        }
    return FirstContactExt(
        hostname=draw(text32),
        os_type=draw(st.sampled_from([*OsType, 4, 15])),
        release=release,
        v2_direct=draw(st.booleans()),
        v2x=v2x,
        **extra,
    )


def _accept_confirm(cls: type[Accept] | type[Confirm]) -> st.SearchStrategy[Accept | Confirm]:
    @st.composite
    def build(draw: st.DrawFn) -> Accept | Confirm:
        first_contact = draw(st.booleans())
        if draw(st.booleans()):  # v1
            info: SmcrInfo | SmcdInfo = draw(smcr_infos | smcd_infos(False))
            return cls(info=info, version=1, first_contact=first_contact)
        info = draw(smcr_infos | smcd_infos(True))
        fce = draw(first_contact_exts()) if first_contact else None
        gids: tuple[bytes, ...] = ()
        if cls is Confirm and first_contact and isinstance(info, SmcrInfo):
            gids = tuple(draw(st.lists(_blob(16), max_size=MAX_GID_LIST)))
            assert fce is not None
            if fce.v2x and fce.release == 0 and fce.max_conns == len(gids) + 1:
                # ambiguous with a 36-byte FCE; the encoder refuses it (Linux sends 0 here)
                fce = FirstContactExt(
                    hostname=fce.hostname,
                    os_type=fce.os_type,
                    release=0,
                    v2_direct=fce.v2_direct,
                    max_links=fce.max_links,
                    feature_mask=fce.feature_mask,
                    vendor_exp_options=fce.vendor_exp_options,
                )
        return cls(
            info=info,
            version=draw(versions_v2),
            first_contact=first_contact,
            eid=draw(text32),
            fce=fce,
            gid_list=gids,
        )

    return build()


def accepts() -> st.SearchStrategy[Accept | Confirm]:
    return _accept_confirm(Accept)


def confirms() -> st.SearchStrategy[Accept | Confirm]:
    return _accept_confirm(Confirm)


@st.composite
def declines(draw: st.DrawFn) -> Decline:
    version = draw(st.integers(1, 15))
    return Decline(
        diagnosis=draw(u32 | st.sampled_from([0x03030000, 0x030F0000, 0x04000000])),
        peer_id=draw(_blob(8)),
        version=version,
        out_of_sync=draw(st.booleans()),
        os_type=draw(st.sampled_from([*OsType, 7])),
        diagnosis_v2=() if version == 1 else tuple(draw(st.lists(u32, min_size=4, max_size=4))),
    )


def clc_messages() -> st.SearchStrategy[ClcMessage]:
    return st.one_of(proposals(), accepts(), confirms(), declines())


# ---- SAMPLES: one valid message of every kind and shape ----------------------------------------

_PEER = bytes.fromhex("1234020000aabbcc")
_GID_V1 = bytes.fromhex("fe80000000000000020000fffeaabbcc")
_GID_V2 = bytes.fromhex("00000000000000000000ffffc0000201")  # ::ffff:192.0.2.1
_MAC = bytes.fromhex("020000aabbcc")
_LO = IsmDevice(LOOPBACK_ISM_CHID, 0x1122334455667788, 0x99AABBCCDDEEFF00)
_SMCR = SmcrInfo(
    peer_id=_PEER,
    gid=_GID_V2,
    mac=_MAC,
    qpn=0x123,
    rmb_rkey=0xDEADBEEF,
    rmbe_alert_token=0x42,
    rmb_dma_addr=0x7F0000001000,
    psn=0x777,
    rmbe_size=2,
    qp_mtu=3,
)
_SMCD_V1 = SmcdInfo(gid=0x1122334455667788, token=0x0102030405060708, link_id=0x0A0B0C0D)
_SMCD_V2 = SmcdInfo(
    gid=_LO.gid,
    token=0x0102030405060708,
    link_id=0x0A0B0C0D,
    dmbe_size=1,
    chid=LOOPBACK_ISM_CHID,
    gid_ext=_LO.gid_ext or 0,
)
_FCE_R = FirstContactExt("host-a", OsType.LINUX, 1, True, True, 255, 2, 1)
_FCE_D0 = FirstContactExt("host-a", OsType.LINUX, 0, v2x=False)
_FCE_D1 = FirstContactExt("host-a", OsType.LINUX, 1, feature_mask=1)
_V4 = IpPrefixes(IPv4Network("192.0.2.0/24"))

SAMPLE_MESSAGES: list[ClcMessage] = [
    # Proposals
    Proposal(SmcType.R, SmcType.R, _PEER, _GID_V1, _MAC, 1, ip_prefixes=_V4, has_smcd_area=False),
    Proposal(SmcType.B, SmcType.N, _PEER, _GID_V1, _MAC, 1, 0x1122334455667788, 0x1234, _V4),
    Proposal(
        SmcType.R,
        SmcType.B,
        _PEER,
        _GID_V1,
        _MAC,
        ip_prefixes=_V4,
        v2_ext=V2Extension(("SMC-EID-TEST",), 1, True, _GID_V2, 255, 2, 1),
        smcd_v2_ext=SmcdV2Extension("SEID-SYSTEM-EID", (_LO, IsmDevice(0x0123, 0xABCDEF))),
    ),
    Proposal(
        SmcType.N,
        SmcType.D,
        v2_ext=V2Extension(("SMC-EID-TEST", "SECOND-EID")),
        smcd_v2_ext=SmcdV2Extension("", (_LO,)),
    ),
    Proposal(
        SmcType.R,
        SmcType.N,
        _PEER,
        _GID_V1,
        _MAC,
        ip_prefixes=IpPrefixes(
            IPv4Network("0.0.0.0/0"),
            (IPv6Network("2001:db8:1::/64"), IPv6Network("2001:db8:2::/48")),
        ),
    ),
    # Accepts
    Accept(SmcrInfo(_PEER, _GID_V1, _MAC, 0x123, 1, 0x42, 0x1000, 7, 1, 2, 3), 1, True),
    Accept(_SMCR, 2, True, "SMC-EID-TEST", _FCE_R),
    Accept(_SMCR, 2, False, "SMC-EID-TEST"),
    Accept(_SMCD_V1, 1, True),
    Accept(_SMCD_V2, 2, True, "SMC-EID-TEST", _FCE_D1),
    Accept(_SMCD_V2, 2, True, "SMC-EID-TEST", _FCE_D0),
    # Confirms
    Confirm(_SMCR, 2, True, "SMC-EID-TEST", _FCE_R, (_GID_V2, bytes(range(16)))),
    Confirm(_SMCR, 2, True, "SMC-EID-TEST", _FCE_R, ()),
    Confirm(_SMCR, 2, False, "SMC-EID-TEST"),
    Confirm(SmcrInfo(_PEER, _GID_V1, _MAC, 0x456, 2, 0x43, 0x2000, 9, 1, 1, 3), 1, False),
    Confirm(_SMCD_V1, 1, False),
    Confirm(_SMCD_V2, 2, True, "SMC-EID-TEST", _FCE_D1),
    # Declines
    Decline(0x03030000, _PEER, 1, os_type=OsType.NONE, diagnosis_v2=()),
    Decline(0x030F0000, _PEER, 2, diagnosis_v2=(0x030E0000, 0, 0, 0)),
    Decline(0x04000000, bytes(8), 2, out_of_sync=True),
]

SAMPLES: list[bytes] = [m.encode() for m in SAMPLE_MESSAGES]
