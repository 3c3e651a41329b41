"""CLC Decline (type 4): v1 (28 bytes) and v2 (44 bytes, four more diagnosis words).

Layout (``struct smc_clc_msg_decline[_v2]``, PROTOCOL.md §1.5)::

    0 hdr (0x08 in byte 7 = out of sync)  8 id_for_peer(8)  16 peer_diagnosis(4)
    20 os_type<<4  21 reserved(3)  | v1: 24 trailer | v2: 24 peer_diagnosis_v2[4]  40 trailer

The kernel accepts exactly these two lengths (``smc_clc_msg_decl_valid``: version 1 needs 28,
anything else 44) and does not look at a Decline's trailer, so neither do we.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Self

from smcd_daemon.wire._fields import Reader, u32be
from smcd_daemon.wire.clc_base import (
    FIRST_CONTACT_MASK,
    SMCR_EYECATCHER,
    Buffer,
    ClcType,
    OsType,
    check_bytes,
    check_uint,
    check_version,
    decode_header,
    encode_header,
    fail,
    os_type,
)

__all__ = ["DECLINE_LEN_V1", "DECLINE_LEN_V2", "Decline"]

DECLINE_LEN_V1 = 28
DECLINE_LEN_V2 = 44
DIAG_COUNT_V2 = 4  # SMC_DECL_DIAG_COUNT_V2


@dataclass(frozen=True)
class Decline:
    """CLC Decline. ``diagnosis`` is the decline reason code (see ``reasons.py``);
    ``diagnosis_v2`` holds the four additional codes of a v2 Decline (Linux sends zeros) and is
    empty for v1. ``out_of_sync`` (Linux: diagnosis SYNCERR) tells the receiver to terminate the
    link group. ``peer_id`` is zero for SMC-D link groups."""

    diagnosis: int
    peer_id: bytes = bytes(8)
    version: int = 2
    out_of_sync: bool = False
    os_type: OsType | int = OsType.LINUX
    diagnosis_v2: tuple[int, ...] = (0, 0, 0, 0)

    TYPE: ClassVar[ClcType] = ClcType.DECLINE

    def encode(self) -> bytes:
        version = check_version(self.version)
        check_bytes(self.peer_id, 8, "id_for_peer")
        check_uint(self.diagnosis, 32, "peer_diagnosis")
        check_uint(self.os_type, 4, "os_type")
        want = 0 if version == 1 else DIAG_COUNT_V2
        if not isinstance(self.diagnosis_v2, tuple) or len(self.diagnosis_v2) != want:
            raise fail(
                f"must be a tuple of {want} codes for version {version}", "peer_diagnosis_v2"
            )
        length = DECLINE_LEN_V1 if version == 1 else DECLINE_LEN_V2
        typev2 = FIRST_CONTACT_MASK if self.out_of_sync else 0
        out = bytearray(encode_header(SMCR_EYECATCHER, ClcType.DECLINE, length, version, 0, typev2))
        out += self.peer_id + u32be(self.diagnosis) + bytes([self.os_type << 4, 0, 0, 0])
        for code in self.diagnosis_v2:
            out += u32be(check_uint(code, 32, "peer_diagnosis_v2"))
        return bytes(out + SMCR_EYECATCHER)

    @classmethod
    def decode(cls, data: Buffer) -> Self:
        r = Reader(data)
        hdr = decode_header(r, ClcType.DECLINE)
        want = DECLINE_LEN_V1 if hdr.version == 1 else DECLINE_LEN_V2
        if hdr.length != want:
            raise fail(f"{hdr.length}, a version {hdr.version} Decline is {want}", "length", 5)
        count = 0 if hdr.version == 1 else DIAG_COUNT_V2
        extra = tuple(r.u32(24 + 4 * i, "peer_diagnosis_v2") for i in range(count))
        return cls(
            diagnosis=r.u32(16, "peer_diagnosis"),
            peer_id=r.raw(8, 8, "id_for_peer"),
            version=hdr.version,
            out_of_sync=hdr.first_contact,
            os_type=os_type(r.u8(20, "os_type") >> 4),
            diagnosis_v2=extra,
        )
