"""CLC Accept (type 2) and Confirm (type 3): v1 and v2/v2.1, SMC-R and SMC-D.

Both share ``struct smc_clc_msg_accept_confirm`` (PROTOCOL.md §1.4)::

    SMC-R: 0 hdr  8 id_for_peer(8) 16 gid(16) 32 mac(6) 38 qpn(3) 41 rmb_rkey(4) 45 rmbe_idx
           46 rmbe_alert_token(4) 50 rmbe_size<<4|qp_mtu 51 rsvd 52 rmb_dma_addr(8) 60 rsvd
           61 psn(3) | v1: 64 trailer (68) | v2: 64 eid(32) 96 rsvd(8) 104 ... (base 108)
    SMC-D: 0 hdr  8 gid(8) 16 token(8) 24 dmbe_idx 25 dmbe_size<<4 26 rsvd(2) 28 linkid(4)
           | v1: 32 rsvd(12) 44 trailer (48) | v2: 32 chid(2) 34 eid(32) 66 gid_ext(8) 74 ...
           (base 78)

v2 with first contact appends the First Contact Extension (36 bytes v2.0, 52 bytes v2.1), and an
SMC-R v2 first-contact Confirm then the GID list extension (gid_cnt, 3 reserved, 16 per GID).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Self

from smcd_daemon.wire._fields import Reader, u16be, u24be, u32be, u64be
from smcd_daemon.wire.clc_base import (
    CLC_TRAILER_LEN,
    EID_LEN,
    FIRST_CONTACT_MASK,
    GID_LEN,
    HOSTNAME_LEN,
    MAX_GID_LIST,
    SMCD_EYECATCHER,
    SMCR_EYECATCHER,
    Buffer,
    ClcType,
    OsType,
    SmcType,
    check_bytes,
    check_trailer,
    check_uint,
    check_version,
    decode_header,
    decode_text,
    encode_header,
    encode_text,
    fail,
    os_type,
)

__all__ = ["Accept", "AcceptConfirm", "Confirm", "FirstContactExt", "SmcdInfo", "SmcrInfo"]

SMCR_LEN_V1 = 68  # SMCR_CLC_ACCEPT_CONFIRM_LEN
SMCD_LEN_V1 = 48  # SMCD_CLC_ACCEPT_CONFIRM_LEN
SMCR_LEN_V2 = 108  # SMCR_CLC_ACCEPT_CONFIRM_LEN_V2
SMCD_LEN_V2 = 78  # SMCD_CLC_ACCEPT_CONFIRM_LEN_V2
FCE_LEN = 36  # struct smc_clc_first_contact_ext
FCE_V2X_LEN = 52  # struct smc_clc_first_contact_ext_v2x
_GLE_HDR_LEN = 4  # struct smc_clc_fce_gid_ext without the GIDs


@dataclass(frozen=True)
class SmcrInfo:
    """SMC-R part of Accept/Confirm (``struct smcr_clc_msg_accept_confirm``). ``rmbe_size`` is the
    compressed size (16 KiB << n), ``qp_mtu`` the IB MTU enum (1=256 ... 5=4096)."""

    peer_id: bytes
    gid: bytes
    mac: bytes
    qpn: int
    rmb_rkey: int
    rmbe_alert_token: int
    rmb_dma_addr: int
    psn: int
    rmbe_idx: int = 1
    rmbe_size: int = 0
    qp_mtu: int = 0

    SMC_TYPE: ClassVar[SmcType] = SmcType.R

    def encode(self) -> bytes:
        out = bytearray(check_bytes(self.peer_id, 8, "id_for_peer"))
        out += check_bytes(self.gid, GID_LEN, "gid") + check_bytes(self.mac, 6, "mac")
        out += u24be(check_uint(self.qpn, 24, "qpn"))
        out += u32be(check_uint(self.rmb_rkey, 32, "rmb_rkey"))
        out.append(check_uint(self.rmbe_idx, 8, "rmbe_idx"))
        out += u32be(check_uint(self.rmbe_alert_token, 32, "rmbe_alert_token"))
        size = check_uint(self.rmbe_size, 4, "rmbe_size")
        out += bytes([(size << 4) | check_uint(self.qp_mtu, 4, "qp_mtu"), 0])
        out += u64be(check_uint(self.rmb_dma_addr, 64, "rmb_dma_addr"))
        out += b"\x00" + u24be(check_uint(self.psn, 24, "psn"))
        return bytes(out)  # 56 bytes: offsets 8..63

    @classmethod
    def decode_from(cls, r: Reader) -> Self:
        size_mtu = r.u8(50, "rmbe_size")
        return cls(
            peer_id=r.raw(8, 8, "id_for_peer"),
            gid=r.raw(16, GID_LEN, "gid"),
            mac=r.raw(32, 6, "mac"),
            qpn=r.u24(38, "qpn"),
            rmb_rkey=r.u32(41, "rmb_rkey"),
            rmbe_idx=r.u8(45, "rmbe_idx"),
            rmbe_alert_token=r.u32(46, "rmbe_alert_token"),
            rmbe_size=size_mtu >> 4,
            qp_mtu=size_mtu & 0x0F,
            rmb_dma_addr=r.u64(52, "rmb_dma_addr"),
            psn=r.u24(61, "psn"),
        )


@dataclass(frozen=True)
class SmcdInfo:
    """SMC-D part of Accept/Confirm. ``chid`` and ``gid_ext`` exist only in v2 (``gid_ext`` is
    the low 64 bits of an Emulated-ISM device's 128-bit GID, v2.1); ``dmbe_size`` is compressed
    (0 = 16 KiB ... 6 = 1 MiB)."""

    gid: int
    token: int
    link_id: int
    dmbe_idx: int = 0
    dmbe_size: int = 0
    chid: int = 0
    gid_ext: int = 0

    SMC_TYPE: ClassVar[SmcType] = SmcType.D

    @property
    def gid128(self) -> int:
        return (self.gid << 64) | self.gid_ext

    def encode(self, version: int) -> bytes:
        out = bytearray(u64be(check_uint(self.gid, 64, "gid")))
        out += u64be(check_uint(self.token, 64, "token"))
        out.append(check_uint(self.dmbe_idx, 8, "dmbe_idx"))
        out.append(check_uint(self.dmbe_size, 4, "dmbe_size") << 4)
        out += bytes(2) + u32be(check_uint(self.link_id, 32, "linkid"))
        check_uint(self.chid, 16, "chid")
        check_uint(self.gid_ext, 64, "gid_ext")
        if version == 1 and (self.chid or self.gid_ext):
            raise fail("v1 SMC-D accept/confirm has no CHID or gid_ext", "chid")
        return bytes(out)  # 24 bytes: offsets 8..31

    @classmethod
    def decode_from(cls, r: Reader, version: int) -> Self:
        v2 = version >= 2
        return cls(
            gid=r.u64(8, "gid"),
            token=r.u64(16, "token"),
            dmbe_idx=r.u8(24, "dmbe_idx"),
            dmbe_size=r.u8(25, "dmbe_size") >> 4,
            link_id=r.u32(28, "linkid"),
            chid=r.u16(32, "chid") if v2 else 0,
            gid_ext=r.u64(66, "gid_ext") if v2 else 0,
        )


@dataclass(frozen=True)
class FirstContactExt:
    """First Contact Extension of a v2 first-contact Accept/Confirm. ``v2x`` selects the 52-byte
    v2.1 form (``smc_clc_first_contact_ext_v2x``) carrying max_conns/max_links (SMC-R),
    feature_mask and vendor options; the 36-byte v2.0 form has none of them. Linux sends the
    36-byte form only for SMC-D with release 0."""

    hostname: str = ""
    os_type: OsType | int = OsType.LINUX
    release: int = 1
    v2_direct: bool = False
    v2x: bool = True
    max_conns: int = 0
    max_links: int = 0
    feature_mask: int = 0
    vendor_exp_options: int = 0

    @property
    def size(self) -> int:
        return FCE_V2X_LEN if self.v2x else FCE_LEN

    def encode(self) -> bytes:
        check_uint(self.os_type, 4, "os_type")
        check_uint(self.release, 4, "release")
        out = bytearray([0x80 if self.v2_direct else 0, (self.os_type << 4) | self.release, 0, 0])
        out += encode_text(self.hostname, "hostname", size=HOSTNAME_LEN)
        extra = (self.max_conns, self.max_links, self.feature_mask, self.vendor_exp_options)
        if not self.v2x:
            if self.release >= 1:
                raise fail("release >= 1 needs the 52-byte v2.1 form", "fce")
            if any(extra):
                raise fail("the 36-byte v2.0 form has no v2.1 fields", "fce")
            return bytes(out)
        out.append(check_uint(self.max_conns, 8, "max_conns"))
        out.append(check_uint(self.max_links, 8, "max_links"))
        out += u16be(check_uint(self.feature_mask, 16, "feature_mask"))
        out += u32be(check_uint(self.vendor_exp_options, 32, "vendor_exp_options")) + bytes(8)
        return bytes(out)

    @classmethod
    def decode_at(cls, r: Reader, off: int, v2x: bool) -> Self:
        b1 = r.u8(off + 1, "fce.os_type")
        fce = cls(
            hostname=decode_text(r.raw(off + 4, HOSTNAME_LEN, "fce.hostname")),
            os_type=os_type(b1 >> 4),
            release=b1 & 0x0F,
            v2_direct=bool(r.u8(off, "fce.v2_direct") & 0x80),
            v2x=v2x,
        )
        if not v2x:
            return fce
        return cls(
            hostname=fce.hostname,
            os_type=fce.os_type,
            release=fce.release,
            v2_direct=fce.v2_direct,
            v2x=True,
            max_conns=r.u8(off + 36, "fce.max_conns"),
            max_links=r.u8(off + 37, "fce.max_links"),
            feature_mask=r.u16(off + 38, "fce.feature_mask"),
            vendor_exp_options=r.u32(off + 40, "fce.vendor_exp_options"),
        )


@dataclass(frozen=True)
class AcceptConfirm:
    """Common shape of Accept and Confirm. ``info`` is :class:`SmcrInfo` or :class:`SmcdInfo`
    (typev1 R or D). v2 only: ``eid`` (negotiated EID), ``fce`` (iff first_contact) and, for an
    SMC-R first-contact Confirm, ``gid_list`` (the client's RoCEv2 GIDs; may be empty)."""

    info: SmcrInfo | SmcdInfo
    version: int = 2
    first_contact: bool = False
    eid: str = ""
    fce: FirstContactExt | None = None
    gid_list: tuple[bytes, ...] = ()

    TYPE: ClassVar[ClcType]

    @property
    def smc_type(self) -> SmcType:
        return self.info.SMC_TYPE

    def _has_gle(self) -> bool:
        return (
            self.TYPE == ClcType.CONFIRM
            and isinstance(self.info, SmcrInfo)
            and self.version >= 2
            and self.first_contact
        )

    def encode(self) -> bytes:
        version = check_version(self.version)
        if not isinstance(self.info, SmcrInfo | SmcdInfo):
            raise fail("must be SmcrInfo or SmcdInfo", "typev1")
        is_d = isinstance(self.info, SmcdInfo)
        body = self.info.encode(version) if isinstance(self.info, SmcdInfo) else self.info.encode()
        if not isinstance(self.gid_list, tuple):
            raise fail("must be a tuple of 16-byte GIDs", "gid_cnt")
        if self.gid_list and not self._has_gle():
            raise fail("only an SMC-R v2 first-contact Confirm has a GID list", "gid_cnt")
        if version == 1:
            if self.eid or self.fce is not None:
                raise fail("v1 has no EID and no first contact extension", "eid")
            if is_d:
                body += bytes(12)
        else:
            if self.first_contact != isinstance(self.fce, FirstContactExt):
                raise fail("v2 carries a first contact extension iff first contact", "fce")
            eid = encode_text(self.eid, "eid", size=EID_LEN, empty_is_zero=True)
            if isinstance(self.info, SmcdInfo):
                body += u16be(self.info.chid) + eid + u64be(self.info.gid_ext)
            else:
                body += eid + bytes(8)
            if self.fce is not None:
                body += self.fce.encode()
            if self._has_gle():
                body += self._encode_gle()
        typev2 = FIRST_CONTACT_MASK if self.first_contact else 0
        eye = SMCD_EYECATCHER if is_d else SMCR_EYECATCHER
        length = 8 + len(body) + CLC_TRAILER_LEN
        hdr = encode_header(eye, self.TYPE, length, version, self.smc_type, typev2)
        return hdr + body + eye

    def _encode_gle(self) -> bytes:
        assert self.fce is not None
        n = len(self.gid_list)
        if n > MAX_GID_LIST:
            raise fail(f"{n} GIDs > {MAX_GID_LIST}", "gid_cnt")
        fce = self.fce
        if fce.v2x and fce.release == 0 and fce.max_conns == n + 1 and n + 1 <= MAX_GID_LIST:
            # A release-0 receiver cannot tell this 52-byte FCE from a 36-byte one followed by
            # n+1 GIDs (max_conns would sit where gid_cnt is); Linux zeroes max_conns here.
            raise fail("ambiguous with a 36-byte FCE; use 0 with release 0", "max_conns")
        out = bytearray([n, 0, 0, 0])
        for g in self.gid_list:
            out += check_bytes(g, GID_LEN, "gid_list")
        return bytes(out)

    @classmethod
    def decode(cls, data: Buffer) -> Self:
        r = Reader(data)
        hdr = decode_header(r, cls.TYPE)
        # smc_clc_msg_acc_conf_valid
        if hdr.typev1 not in (SmcType.R, SmcType.D):
            raise fail(f"typev1 {hdr.typev1} is neither SMC-R nor SMC-D", "typev1", 7)
        is_d = hdr.typev1 == SmcType.D
        first_contact = bool(hdr.typev2 & FIRST_CONTACT_MASK)
        if hdr.version == 1:
            want = SMCD_LEN_V1 if is_d else SMCR_LEN_V1
            if hdr.length != want:
                raise fail(
                    f"{hdr.length}, v1 {'SMC-D' if is_d else 'SMC-R'} is {want}", "length", 5
                )
            check_trailer(r)
            info1 = SmcdInfo.decode_from(r, 1) if is_d else SmcrInfo.decode_from(r)
            return cls(info=info1, version=1, first_contact=first_contact)
        base = SMCD_LEN_V2 if is_d else SMCR_LEN_V2
        if hdr.length < base:
            raise fail(f"{hdr.length} < {base}", "length", 5)
        check_trailer(r)
        info = SmcdInfo.decode_from(r, hdr.version) if is_d else SmcrInfo.decode_from(r)
        eid = decode_text(r.raw(34 if is_d else 64, EID_LEN, "eid"))
        fce_off = base - CLC_TRAILER_LEN
        rest = hdr.length - base
        fce = None
        gids: tuple[bytes, ...] = ()
        if not first_contact:
            if rest:
                raise fail(f"{rest} bytes after a non-first-contact v2 message", "length", 5)
        else:
            release = r.u8(fce_off + 1, "fce.release") & 0x0F
            if cls.TYPE == ClcType.CONFIRM and not is_d:
                v2x, gids = cls._decode_gle(r, fce_off, rest, release)
            else:
                if rest not in (FCE_LEN, FCE_V2X_LEN):
                    raise fail(
                        f"{rest} bytes for the first contact extension (36 or 52)", "fce", fce_off
                    )
                v2x = rest == FCE_V2X_LEN
                if release >= 1 and not v2x:
                    raise fail("release >= 1 needs the 52-byte form", "fce", fce_off)
            fce = FirstContactExt.decode_at(r, fce_off, v2x)
        return cls(
            info=info,
            version=hdr.version,
            first_contact=first_contact,
            eid=eid,
            fce=fce,
            gid_list=gids,
        )

    @staticmethod
    def _decode_gle(
        r: Reader, fce_off: int, rest: int, release: int
    ) -> tuple[bool, tuple[bytes, ...]]:
        """Find FCE size and GID list in an SMC-R first-contact Confirm: release >= 1 means the
        52-byte FCE; with release 0 the 36-byte form is tried first (Linux >= 6.6 sends 52 bytes
        with max_conns 0, which never reads as a consistent 36-byte layout)."""
        forms = (FCE_V2X_LEN,) if release >= 1 else (FCE_LEN, FCE_V2X_LEN)
        for size in forms:
            gle = fce_off + size
            remaining = rest - size - _GLE_HDR_LEN
            if remaining < 0 or remaining % GID_LEN:
                continue
            cnt = r.u8(gle, "gid_cnt")
            if cnt != remaining // GID_LEN or cnt > MAX_GID_LIST:
                continue
            gids = tuple(
                r.raw(gle + _GLE_HDR_LEN + i * GID_LEN, GID_LEN, "gid_list") for i in range(cnt)
            )
            return size == FCE_V2X_LEN, gids
        raise fail(
            f"{rest} bytes after the base fit no FCE + GID list (gid_cnt <= {MAX_GID_LIST})",
            "gid_cnt",
            fce_off + forms[0],
        )


@dataclass(frozen=True)
class Accept(AcceptConfirm):
    """CLC Accept (server to client)."""

    TYPE: ClassVar[ClcType] = ClcType.ACCEPT


@dataclass(frozen=True)
class Confirm(AcceptConfirm):
    """CLC Confirm (client to server)."""

    TYPE: ClassVar[ClcType] = ClcType.CONFIRM
