"""CLC Proposal (type 1): v1 (incl. the pre-5.10 52-byte form) and v2/v2.1, SMC-R and SMC-D.

Layout (``struct smc_clc_msg_proposal_area``; PROTOCOL.md §1.3)::

    0  header (8)              8  id_for_peer (8)        16 gid (16)          32 mac (6)
    38 iparea_offset (2)       -- from offset 40 --
    40 ISM gid (8)  48 ISM chid (2)  50 v2_ext_offset (2)  52 vendor oui/opts (8)  60 reserved (20)
    80 prefix area: outgoing_subnet (4) prefix_len (1) reserved (2) ipv6_prefixes_cnt (1)
       then 17 bytes per IPv6 prefix                     [iff typev1 != N]
    v2 extension (40 + 32 per UEID)                      [iff typev2 != N]
    SMC-Dv2 extension (48 + 10 per GID/CHID entry)       [iff typev2 is D or B]
    trailer (4)

A v1 proposal from Linux before 5.10 has ``iparea_offset`` 0: no SMC-D area, the prefix area sits
right at offset 40 (52 bytes in all with no IPv6 prefixes).
"""

from __future__ import annotations

from dataclasses import dataclass
from ipaddress import IPv4Network, IPv6Network
from typing import ClassVar, Self

from smcd_daemon.wire._fields import Reader, u16be, u64be
from smcd_daemon.wire.clc_base import (
    CLC_TRAILER_LEN,
    EID_LEN,
    EMULATED_ISM_CHID_MIN,
    GID_LEN,
    MAX_ISM_GID_ENTRIES,
    MAX_UEIDS,
    MAX_V6_PREFIXES,
    SMCR_EYECATCHER,
    Buffer,
    ClcType,
    SmcType,
    check_bytes,
    check_smc_type,
    check_trailer,
    check_uint,
    check_version,
    decode_header,
    decode_text,
    encode_header,
    encode_text,
    fail,
)

__all__ = ["IpPrefixes", "IsmDevice", "Proposal", "SmcdV2Extension", "V2Extension"]

_BASE_LEN = 40  # struct smc_clc_msg_proposal (hdr, lcl, iparea_offset), 4-byte aligned
_SMCD_AREA_LEN = 40  # struct smc_clc_msg_smcd
_PREFIX_LEN = 8  # struct smc_clc_msg_proposal_prefix
_V6_PREFIX_LEN = 17  # struct smc_clc_ipv6_prefix (packed)
_V2_EXT_LEN = 40  # struct smc_clc_v2_extension_fixed
_SMCD_V2_EXT_LEN = 48  # struct smc_clc_smcd_v2_extension_fixed
_GIDCHID_LEN = 10  # struct smc_clc_smcd_gid_chid (packed)
_V2_EXT_OFFSET_BASE = 52  # v2_ext_offset counts from the end of that field
# Kernel bounds (smc_get_clc_v2_ext / smc_get_clc_smcd_v2_ext): the offsets may not point
# beyond where the extension sits in the largest proposal area.
_V2_EXT_OFFSET_MAX = _BASE_LEN + _SMCD_AREA_LEN + _PREFIX_LEN + MAX_V6_PREFIXES * _V6_PREFIX_LEN
_V2_EXT_OFFSET_MAX -= _BASE_LEN + 12  # = 172
_SMCD_V2_EXT_OFFSET_MAX = _V2_EXT_LEN + MAX_UEIDS * EID_LEN - 8  # = 288

_ANY_V4 = IPv4Network("0.0.0.0/0")


def _is_emulated(chid: int) -> bool:
    return chid >= EMULATED_ISM_CHID_MIN


@dataclass(frozen=True)
class IpPrefixes:
    """The IP prefix area: the CLC socket's IPv4 subnet, or (IPv6 sockets) 0.0.0.0/0 plus the
    interface's non-link-local IPv6 prefixes. Host bits are irrelevant to the kernel's matching
    (``smc_clc_prfx_match``), so networks are kept in their masked form."""

    ipv4: IPv4Network = _ANY_V4
    ipv6: tuple[IPv6Network, ...] = ()

    def size(self) -> int:
        return _PREFIX_LEN + _V6_PREFIX_LEN * len(self.ipv6)

    def encode(self) -> bytes:
        if not isinstance(self.ipv4, IPv4Network):
            raise fail("must be an IPv4Network", "outgoing_subnet")
        if not isinstance(self.ipv6, tuple) or len(self.ipv6) > MAX_V6_PREFIXES:
            raise fail(f"must be a tuple of at most {MAX_V6_PREFIXES}", "ipv6_prefixes_cnt")
        out = bytearray(self.ipv4.network_address.packed)
        out += bytes([self.ipv4.prefixlen, 0, 0, len(self.ipv6)])
        for net in self.ipv6:
            if not isinstance(net, IPv6Network):
                raise fail("must be IPv6Network objects", "ipv6_prefix")
            out += net.network_address.packed + bytes([net.prefixlen])
        return bytes(out)

    @classmethod
    def decode_at(cls, r: Reader, off: int) -> Self:
        plen = r.u8(off + 4, "prefix_len")
        if plen > 32:
            raise fail(f"IPv4 prefix length {plen} > 32", "prefix_len", off + 4)
        ipv4 = IPv4Network((r.raw(off, 4, "outgoing_subnet"), plen), strict=False)
        cnt = r.u8(off + 7, "ipv6_prefixes_cnt")
        if cnt > MAX_V6_PREFIXES:
            raise fail(f"{cnt} IPv6 prefixes > {MAX_V6_PREFIXES}", "ipv6_prefixes_cnt", off + 7)
        nets = []
        for i in range(cnt):
            p = off + _PREFIX_LEN + i * _V6_PREFIX_LEN
            addr = r.raw(p, 16, "ipv6_prefix")
            bits = r.u8(p + 16, "ipv6_prefix_len")
            if bits > 128:
                raise fail(f"IPv6 prefix length {bits} > 128", "ipv6_prefix_len", p + 16)
            nets.append(IPv6Network((addr, bits), strict=False))
        return cls(ipv4, tuple(nets))


@dataclass(frozen=True)
class IsmDevice:
    """One SMC-Dv2 device offered in the proposal. An Emulated-ISM device (CHID 0xFF00-0xFFFF,
    e.g. loopback-ism 0xFFFF) has a 128-bit GID and takes two GID/CHID entries on the wire:
    (gid, chid), (gid_ext, chid). A native ISM device has ``gid_ext`` None and takes one."""

    chid: int
    gid: int
    gid_ext: int | None = None

    @property
    def emulated(self) -> bool:
        return _is_emulated(self.chid)

    @property
    def gid128(self) -> int:
        """The full 128-bit GID (gid in the upper, gid_ext in the lower 64 bits)."""
        return (self.gid << 64) | (self.gid_ext or 0)

    @classmethod
    def from_gid128(cls, chid: int, gid128: int) -> Self:
        return cls(chid, gid128 >> 64, gid128 & ((1 << 64) - 1))

    def entries(self) -> list[tuple[int, int]]:
        check_uint(self.chid, 16, "gidchid.chid")
        check_uint(self.gid, 64, "gidchid.gid")
        if self.emulated:
            if self.gid_ext is None:
                raise fail("an Emulated-ISM device (CHID >= 0xFF00) needs gid_ext", "gid_ext")
            check_uint(self.gid_ext, 64, "gid_ext")
            return [(self.gid, self.chid), (self.gid_ext, self.chid)]
        if self.gid_ext is not None:
            raise fail("only Emulated-ISM devices (CHID >= 0xFF00) have gid_ext", "gid_ext")
        return [(self.gid, self.chid)]


@dataclass(frozen=True)
class V2Extension:
    """``struct smc_clc_v2_extension``: UEIDs, SEID indicator, release, RoCEv2 GID and the v2.1
    link-group limits Linux fills from sysctl (max_conns 16..255, max_links 1..2)."""

    eids: tuple[str, ...] = ()
    release: int = 1
    seid_indicator: bool = False
    roce_gid: bytes = bytes(GID_LEN)
    max_conns: int = 0
    max_links: int = 0
    feature_mask: int = 0

    def encode(self, smcd_v2_ext_offset: int, ism_gid_cnt: int) -> bytes:
        if not isinstance(self.eids, tuple) or len(self.eids) > MAX_UEIDS:
            raise fail(f"must be a tuple of at most {MAX_UEIDS} UEIDs", "eid_cnt")
        check_uint(self.release, 4, "release")
        check_bytes(self.roce_gid, GID_LEN, "roce")
        out = bytearray([len(self.eids), ism_gid_cnt, 0])
        out.append((self.release << 4) | (1 if self.seid_indicator else 0))
        out += bytes(2) + u16be(smcd_v2_ext_offset) + self.roce_gid
        out.append(check_uint(self.max_conns, 8, "max_conns"))
        out.append(check_uint(self.max_links, 8, "max_links"))
        out += u16be(check_uint(self.feature_mask, 16, "feature_mask")) + bytes(12)
        for eid in self.eids:
            out += encode_text(eid, "user_eids", empty_is_zero=True)
        return bytes(out)


@dataclass(frozen=True)
class SmcdV2Extension:
    """``struct smc_clc_smcd_v2_extension``: the system EID and the offered SMC-Dv2 devices."""

    seid: str = ""
    devices: tuple[IsmDevice, ...] = ()

    def entries(self) -> list[tuple[int, int]]:
        if not isinstance(self.devices, tuple):
            raise fail("must be a tuple of IsmDevice", "gidchid")
        out: list[tuple[int, int]] = []
        for dev in self.devices:
            if not isinstance(dev, IsmDevice):
                raise fail("must be IsmDevice objects", "gidchid")
            out += dev.entries()
        if len(out) > MAX_ISM_GID_ENTRIES:
            raise fail(
                f"{len(out)} GID/CHID entries > {MAX_ISM_GID_ENTRIES} (Emulated-ISM takes 2)",
                "ism_gid_cnt",
            )
        return out


@dataclass(frozen=True)
class Proposal:
    """CLC Proposal. ``typev2`` is only meaningful for version >= 2 (v1 senders leave whatever the
    old flag bits held; it is kept so encoding reproduces them). ``ism_gid``/``ism_chid`` are the
    native (v1) ISM device. ``has_smcd_area`` is False only for the pre-5.10 v1 layout with
    iparea_offset 0."""

    typev1: SmcType
    typev2: SmcType
    peer_id: bytes = bytes(8)
    gid: bytes = bytes(GID_LEN)
    mac: bytes = bytes(6)
    version: int = 2
    ism_gid: int = 0
    ism_chid: int = 0
    ip_prefixes: IpPrefixes | None = None
    v2_ext: V2Extension | None = None
    smcd_v2_ext: SmcdV2Extension | None = None
    has_smcd_area: bool = True

    TYPE: ClassVar[ClcType] = ClcType.PROPOSAL

    # ---- encoding ---------------------------------------------------------------------------

    def _validate(self) -> tuple[SmcType, SmcType]:
        version = check_version(self.version)
        t1 = check_smc_type(self.typev1, "typev1")
        t2 = check_smc_type(self.typev2, "typev2")
        check_bytes(self.peer_id, 8, "id_for_peer")
        check_bytes(self.gid, GID_LEN, "gid")
        check_bytes(self.mac, 6, "mac")
        check_uint(self.ism_gid, 64, "ism_gid")
        check_uint(self.ism_chid, 16, "ism_chid")
        if self.ip_prefixes is not None and not isinstance(self.ip_prefixes, IpPrefixes):
            raise fail("must be IpPrefixes or None", "ip_prefixes")
        if version == 1:
            if t1 == SmcType.N:
                raise fail("a v1 proposal must offer SMC-R or SMC-D", "typev1")
            if self.ip_prefixes is None:
                raise fail("a v1 proposal always carries the prefix area", "ip_prefixes")
            if self.v2_ext is not None or self.smcd_v2_ext is not None:
                raise fail("v1 proposals have no v2 extensions", "v2_ext_offset")
            if not self.has_smcd_area and (t1.has_d or self.ism_gid or self.ism_chid):
                raise fail("the SMC-D area is needed for SMC-D and ISM fields", "iparea_offset")
            return t1, t2
        if not self.has_smcd_area:
            raise fail("v2 proposals always carry the SMC-D area", "iparea_offset")
        if (t1 != SmcType.N) != (self.ip_prefixes is not None):
            raise fail("prefix area present iff typev1 != N", "ip_prefixes")
        if t1 == SmcType.N and (self.ism_gid & 0xFF) > MAX_V6_PREFIXES:
            # With typev1 N the kernel still reads ipv6_prefixes_cnt at 40 + 0 + 7, i.e. the
            # last byte of the ISM GID, and rejects the proposal if it exceeds 8.
            raise fail("with typev1 N the kernel reads byte 47 as ipv6_prefixes_cnt", "ism_gid")
        if (t2 != SmcType.N) != isinstance(self.v2_ext, V2Extension):
            raise fail("v2 extension present iff typev2 != N", "v2_ext")
        if t2.has_d != isinstance(self.smcd_v2_ext, SmcdV2Extension):
            raise fail("SMC-Dv2 extension present iff typev2 is D or B", "smcd_v2_ext")
        return t1, t2

    def encode(self) -> bytes:
        t1, t2 = self._validate()
        prefix = self.ip_prefixes.encode() if self.ip_prefixes is not None else b""
        body = bytearray(self.peer_id + self.gid + self.mac)
        if self.version == 1:
            body += u16be(_SMCD_AREA_LEN if self.has_smcd_area else 0)
            if self.has_smcd_area:
                body += u64be(self.ism_gid) + u16be(self.ism_chid) + bytes(30)
            body += prefix
        else:
            body += u16be(_SMCD_AREA_LEN if t1 != SmcType.N else 0)
            v2 = b""
            v2_ext_offset = 0
            if self.v2_ext is not None:
                v2_ext_offset = _SMCD_AREA_LEN - 12 + len(prefix)
                entries: list[tuple[int, int]] = []
                smcd_off = 0
                smcd = b""
                if self.smcd_v2_ext is not None:
                    entries = self.smcd_v2_ext.entries()
                    smcd_off = _V2_EXT_LEN - 8 + EID_LEN * len(self.v2_ext.eids)
                    smcd = encode_text(self.smcd_v2_ext.seid, "system_eid", empty_is_zero=True)
                    smcd += bytes(16)
                    smcd += b"".join(u64be(g) + u16be(c) for g, c in entries)
                v2 = self.v2_ext.encode(smcd_off, len(entries)) + smcd
            body += u64be(self.ism_gid) + u16be(self.ism_chid) + u16be(v2_ext_offset)
            body += bytes(28) + prefix + v2
        length = 8 + len(body) + CLC_TRAILER_LEN
        hdr = encode_header(SMCR_EYECATCHER, ClcType.PROPOSAL, length, self.version, t1, t2)
        return hdr + bytes(body) + SMCR_EYECATCHER

    # ---- decoding ---------------------------------------------------------------------------

    @classmethod
    def decode(cls, data: Buffer) -> Self:
        r = Reader(data)
        hdr = decode_header(r, ClcType.PROPOSAL)
        t1, t2 = SmcType(hdr.typev1), SmcType(hdr.typev2)
        peer_id = r.raw(8, 8, "id_for_peer")
        gid = r.raw(16, GID_LEN, "gid")
        mac = r.raw(32, 6, "mac")
        ip_off = r.u16(38, "iparea_offset")
        # smc_clc_proposal_get_prefix: the prefix area may not start past the SMC-D area ...
        if ip_off > _SMCD_AREA_LEN:
            raise fail(f"{ip_off} > {_SMCD_AREA_LEN}", "iparea_offset", 38)
        if hdr.version >= 2:  # our own rules, checked first so the error names the culprit
            if t1 != SmcType.N and ip_off != _SMCD_AREA_LEN:
                # the kernel's length rule assumes the prefix right after the SMC-D area
                raise fail(f"must be {_SMCD_AREA_LEN} in v2 with typev1 != N", "iparea_offset", 38)
            if t1 == SmcType.N and ip_off != 0:
                raise fail(
                    "must be 0 in v2 without a v1 path (as Linux sends)", "iparea_offset", 38
                )
        elif ip_off not in (0, _SMCD_AREA_LEN):
            # v1: Linux sends 40 (>= 5.10) or 0 (older); anything else leaves opaque bytes
            raise fail(f"{ip_off}, expected 0 or {_SMCD_AREA_LEN}", "iparea_offset", 38)
        # ... and smc_clc_msg_prop_valid checks its ipv6_prefixes_cnt, whatever typev1 says.
        cnt_off = _BASE_LEN + ip_off + 7
        v6_cnt = r.u8(cnt_off, "ipv6_prefixes_cnt")
        if v6_cnt > MAX_V6_PREFIXES:
            raise fail(f"{v6_cnt} > {MAX_V6_PREFIXES}", "ipv6_prefixes_cnt", cnt_off)
        prefix_size = _PREFIX_LEN + v6_cnt * _V6_PREFIX_LEN
        if hdr.version == 1:
            return cls._decode_v1(r, hdr.version, t1, t2, peer_id, gid, mac, ip_off, prefix_size)

        # v2 (any version >= 2, as the kernel treats everything but V1)
        expected = _BASE_LEN + _SMCD_AREA_LEN + CLC_TRAILER_LEN
        if t1 != SmcType.N:
            expected += prefix_size
        v2_base = 0
        eid_cnt = gid_cnt = 0
        if t2 != SmcType.N:
            v2_off = r.u16(50, "v2_ext_offset")
            if not 0 < v2_off <= _V2_EXT_OFFSET_MAX:
                raise fail(f"{v2_off} outside 1..{_V2_EXT_OFFSET_MAX}", "v2_ext_offset", 50)
            want = _SMCD_AREA_LEN - 12 + (prefix_size if t1 != SmcType.N else 0)
            if v2_off != want:
                raise fail(f"{v2_off}, the v2 extension is at {want}", "v2_ext_offset", 50)
            v2_base = _V2_EXT_OFFSET_BASE + v2_off
            eid_cnt = r.u8(v2_base, "eid_cnt")
            if eid_cnt > MAX_UEIDS:
                raise fail(f"{eid_cnt} > {MAX_UEIDS}", "eid_cnt", v2_base)
            expected += _V2_EXT_LEN + eid_cnt * EID_LEN
            if t2.has_d:
                gid_cnt = r.u8(v2_base + 1, "ism_gid_cnt")
                if gid_cnt > MAX_ISM_GID_ENTRIES:
                    raise fail(f"{gid_cnt} > {MAX_ISM_GID_ENTRIES}", "ism_gid_cnt", v2_base + 1)
                expected += _SMCD_V2_EXT_LEN + gid_cnt * _GIDCHID_LEN
        if hdr.length != expected:
            raise fail(f"{hdr.length}, the fields announce {expected}", "length", 5)
        check_trailer(r)

        prefixes = IpPrefixes.decode_at(r, _BASE_LEN + ip_off) if t1 != SmcType.N else None
        v2_ext = smcd_v2_ext = None
        if t2 != SmcType.N:
            flag = r.u8(v2_base + 3, "flag")
            eids = tuple(
                decode_text(r.raw(v2_base + _V2_EXT_LEN + i * EID_LEN, EID_LEN, "user_eids"))
                for i in range(eid_cnt)
            )
            v2_ext = V2Extension(
                eids=eids,
                release=flag >> 4,
                seid_indicator=bool(flag & 0x01),
                roce_gid=r.raw(v2_base + 8, GID_LEN, "roce"),
                max_conns=r.u8(v2_base + 24, "max_conns"),
                max_links=r.u8(v2_base + 25, "max_links"),
                feature_mask=r.u16(v2_base + 26, "feature_mask"),
            )
            if t2.has_d:
                smcd_v2_ext = cls._decode_smcd_v2(r, v2_base, eid_cnt, gid_cnt)
        return cls(
            typev1=t1,
            typev2=t2,
            peer_id=peer_id,
            gid=gid,
            mac=mac,
            version=hdr.version,
            ism_gid=r.u64(40, "ism_gid"),
            ism_chid=r.u16(48, "ism_chid"),
            ip_prefixes=prefixes,
            v2_ext=v2_ext,
            smcd_v2_ext=smcd_v2_ext,
        )

    @classmethod
    def _decode_v1(
        cls,
        r: Reader,
        version: int,
        t1: SmcType,
        t2: SmcType,
        peer_id: bytes,
        gid: bytes,
        mac: bytes,
        ip_off: int,
        prefix_size: int,
    ) -> Self:
        if t1 == SmcType.N:
            raise fail("a v1 proposal must offer SMC-R or SMC-D", "typev1", 7)
        if t1.has_d and ip_off != _SMCD_AREA_LEN:
            # smc_get_clc_msg_smcd: SMC-D needs the SMC-D area
            raise fail("SMC-D offered without the SMC-D area", "iparea_offset", 38)
        expected = _BASE_LEN + ip_off + prefix_size + CLC_TRAILER_LEN
        if len(r) != expected:
            raise fail(f"{len(r)}, the fields announce {expected}", "length", 5)
        check_trailer(r)
        has_smcd = ip_off == _SMCD_AREA_LEN
        return cls(
            typev1=t1,
            typev2=t2,
            peer_id=peer_id,
            gid=gid,
            mac=mac,
            version=version,
            ism_gid=r.u64(40, "ism_gid") if has_smcd else 0,
            ism_chid=r.u16(48, "ism_chid") if has_smcd else 0,
            ip_prefixes=IpPrefixes.decode_at(r, _BASE_LEN + ip_off),
            has_smcd_area=has_smcd,
        )

    @staticmethod
    def _decode_smcd_v2(r: Reader, v2_base: int, eid_cnt: int, gid_cnt: int) -> SmcdV2Extension:
        off_field = v2_base + 6
        smcd_off = r.u16(off_field, "smcd_v2_ext_offset")
        if not 0 < smcd_off <= _SMCD_V2_EXT_OFFSET_MAX:
            raise fail(
                f"{smcd_off} outside 1..{_SMCD_V2_EXT_OFFSET_MAX}", "smcd_v2_ext_offset", off_field
            )
        want = _V2_EXT_LEN - 8 + eid_cnt * EID_LEN
        if smcd_off != want:
            raise fail(f"{smcd_off}, the extension is at {want}", "smcd_v2_ext_offset", off_field)
        base = off_field + 2 + smcd_off
        seid = decode_text(r.raw(base, EID_LEN, "system_eid"))
        raw = [
            (
                r.u64(base + 48 + i * _GIDCHID_LEN, "gidchid.gid"),
                r.u16(base + 56 + i * _GIDCHID_LEN, "gidchid.chid"),
            )
            for i in range(gid_cnt)
        ]
        devices = []
        i = 0
        while i < gid_cnt:
            g, chid = raw[i]
            if _is_emulated(chid):
                at = base + 48 + (i + 1) * _GIDCHID_LEN
                if i + 1 >= gid_cnt:
                    raise fail("Emulated-ISM device without its gid_ext entry", "gidchid", at)
                g_ext, chid2 = raw[i + 1]
                if chid2 != chid:
                    raise fail(f"gid_ext entry has CHID {chid2:#x}, not {chid:#x}", "gidchid", at)
                devices.append(IsmDevice(chid, g, g_ext))
                i += 2
            else:
                devices.append(IsmDevice(chid, g))
                i += 1
        return SmcdV2Extension(seid, tuple(devices))
