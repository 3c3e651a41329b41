"""Tell what kind of SMC message some bytes are, and decode them with the right codec.

Captures and logs hand an operator bytes without saying whether they came from the CLC handshake
(TCP), an LLC or CDC SEND (RDMA), or a DMB header (SMC-D). The first bytes decide, and the
spaces do not overlap:

* CLC: the EBCDIC eyecatcher ``SMCR``/``SMCD`` (first byte 0xE2);
* LLC v1: type 0x01..0x09 (length byte 44, checked by the LLC codec);
* LLC v2: type 0x2X (``llc_version`` 2 in the high nibble);
* SMC-D CDC header: type 0xFE and exactly 32 bytes (``struct smcd_cdc_msg``);
* SMC-R CDC: type 0xFE otherwise (length byte 44 and 44 bytes, checked by the CDC codec).

Anything else is an :class:`UnknownMessageError` naming the first byte.
"""

from __future__ import annotations

from typing import TypeAlias

from smcd_daemon.errors import TruncatedError, UnknownMessageError
from smcd_daemon.wire import cdc, clc, llc

__all__ = ["KINDS", "KIND_TITLES", "WireMessage", "decode_any", "kind_of"]

WireMessage: TypeAlias = clc.ClcMessage | llc.LlcMessage | cdc.CdcMessage | cdc.SmcdCdcHeader

KIND_TITLES: dict[str, str] = {
    "clc": "CLC",
    "llc": "LLC",
    "smcr-cdc": "SMC-R CDC",
    "smcd-cdc": "SMC-D CDC header",
}
KINDS = tuple(KIND_TITLES)

_CLC_FIRST = clc.SMCR_EYECATCHER[0]


def kind_of(data: bytes | bytearray | memoryview) -> str:
    """One of :data:`KINDS` for the message in ``data``, judged from its first bytes only."""
    buf = bytes(data[:4])
    if not buf:
        raise TruncatedError("no bytes: cannot tell the message kind", field="type", offset=0)
    first = buf[0]
    if first == _CLC_FIRST:
        if len(buf) < 4 and (
            clc.SMCR_EYECATCHER.startswith(buf) or clc.SMCD_EYECATCHER.startswith(buf)
        ):
            raise TruncatedError(
                f"{len(buf)} byte(s) of a CLC eyecatcher; it needs 4", field="eyecatcher", offset=0
            )
        if buf in (clc.SMCR_EYECATCHER, clc.SMCD_EYECATCHER):
            return "clc"
        raise UnknownMessageError(
            f"{buf.hex()} is neither the SMCR nor the SMCD eyecatcher",
            field="eyecatcher",
            offset=0,
        )
    if 0x01 <= first <= 0x09 or first & 0xF0 == 0x20:
        return "llc"
    if first == cdc.CDC_MSG_TYPE:
        return "smcd-cdc" if len(data) == cdc.SMCD_CDC_HEADER_LEN else "smcr-cdc"
    raise UnknownMessageError(
        f"first byte 0x{first:02x} starts no SMC message (CLC eyecatcher 0xE2, LLC 0x01-0x09 "
        "or 0x2X, CDC 0xFE)",
        field="type",
        offset=0,
    )


def decode_any(data: bytes | bytearray | memoryview) -> WireMessage:
    """Decode one whole message of any kind; only :class:`ProtocolError` escapes on bad bytes."""
    kind = kind_of(data)
    if kind == "clc":
        return clc.decode(data)
    if kind == "llc":
        return llc.decode(data)
    if kind == "smcd-cdc":
        return cdc.SmcdCdcHeader.decode(data)
    return cdc.decode(data)
