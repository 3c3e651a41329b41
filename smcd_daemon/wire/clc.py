"""CLC codec: Proposal, Accept, Confirm and Decline, v1/v2/v2.1, SMC-R and SMC-D.

Byte-exact with the Linux kernel (``net/smc/smc_clc.h`` / ``smc_clc.c``) and PROTOCOL.md
§1.2-1.5. Decoding enforces every length/offset/count rule the kernel's validators enforce
(``smc_clc_msg_hdr_valid``, ``..._prop_valid``, ``..._acc_conf_valid``, ``..._decl_valid`` and the
offset helpers) plus our own sanity rules (offsets must point where the lengths say, counts within
the protocol maxima, no trailing bytes). Every failure is a :class:`ProtocolError` naming the
field and its offset; encoders check their arguments the same way.

Stream framing: read 8 bytes, :func:`peek_header` them to learn the length, read the rest, then
:func:`decode` the whole message.

The implementation lives in ``clc_base`` (header, enums), ``clc_proposal``, ``clc_accept`` and
``clc_decline``; this module is the public face.
"""

from __future__ import annotations

from smcd_daemon.errors import ProtocolError, UnknownMessageError
from smcd_daemon.wire._fields import Reader
from smcd_daemon.wire.clc_accept import (
    FCE_LEN,
    FCE_V2X_LEN,
    SMCD_LEN_V1,
    SMCD_LEN_V2,
    SMCR_LEN_V1,
    SMCR_LEN_V2,
    Accept,
    AcceptConfirm,
    Confirm,
    FirstContactExt,
    SmcdInfo,
    SmcrInfo,
)
from smcd_daemon.wire.clc_base import (
    CLC_HEADER_LEN,
    CLC_MAX_LEN,
    CLC_TRAILER_LEN,
    EID_LEN,
    EMULATED_ISM_CHID_MIN,
    HOSTNAME_LEN,
    LOOPBACK_ISM_CHID,
    MAX_GID_LIST,
    MAX_ISM_GID_ENTRIES,
    MAX_LEN_BY_TYPE,
    MAX_UEIDS,
    MAX_V6_PREFIXES,
    MIN_LEN_BY_TYPE,
    SMCD_EYECATCHER,
    SMCR_EYECATCHER,
    Buffer,
    ClcHeader,
    ClcType,
    OsType,
    SmcType,
    decode_header,
    peek_header,
)
from smcd_daemon.wire.clc_decline import DECLINE_LEN_V1, DECLINE_LEN_V2, Decline
from smcd_daemon.wire.clc_proposal import (
    IpPrefixes,
    IsmDevice,
    Proposal,
    SmcdV2Extension,
    V2Extension,
)

__all__ = [
    "CLC_HEADER_LEN",
    "CLC_MAX_LEN",
    "CLC_TRAILER_LEN",
    "DECLINE_LEN_V1",
    "DECLINE_LEN_V2",
    "EID_LEN",
    "EMULATED_ISM_CHID_MIN",
    "FCE_LEN",
    "FCE_V2X_LEN",
    "HOSTNAME_LEN",
    "LOOPBACK_ISM_CHID",
    "MAX_GID_LIST",
    "MAX_ISM_GID_ENTRIES",
    "MAX_LEN_BY_TYPE",
    "MAX_UEIDS",
    "MAX_V6_PREFIXES",
    "MIN_LEN_BY_TYPE",
    "SMCD_EYECATCHER",
    "SMCD_LEN_V1",
    "SMCD_LEN_V2",
    "SMCR_EYECATCHER",
    "SMCR_LEN_V1",
    "SMCR_LEN_V2",
    "Accept",
    "AcceptConfirm",
    "ClcHeader",
    "ClcMessage",
    "ClcType",
    "Confirm",
    "Decline",
    "FirstContactExt",
    "IpPrefixes",
    "IsmDevice",
    "OsType",
    "Proposal",
    "ProtocolError",
    "SmcType",
    "SmcdInfo",
    "SmcdV2Extension",
    "SmcrInfo",
    "V2Extension",
    "decode",
    "peek_header",
]

ClcMessage = Proposal | Accept | Confirm | Decline

_BY_TYPE: dict[ClcType, type[Proposal] | type[Accept] | type[Confirm] | type[Decline]] = {
    ClcType.PROPOSAL: Proposal,
    ClcType.ACCEPT: Accept,
    ClcType.CONFIRM: Confirm,
    ClcType.DECLINE: Decline,
}


def decode(data: Buffer) -> ClcMessage:
    """Decode exactly one whole CLC message (its length field must equal ``len(data)``)."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise ProtocolError(f"needs bytes, got {type(data).__name__}", field="message")
    data = bytes(data)
    r = Reader(data)
    r.need(0, CLC_HEADER_LEN, "header")
    raw_type = data[4]
    if raw_type not in _BY_TYPE:
        # the shared header parser names the precise fault (eyecatcher or type)
        decode_header(r, ClcType.PROPOSAL)
        raise UnknownMessageError(f"unknown CLC message type {raw_type}", field="type", offset=4)
    return _BY_TYPE[ClcType(raw_type)].decode(data)
