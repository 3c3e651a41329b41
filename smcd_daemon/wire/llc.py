"""LLC - Link Layer Control messages of SMC-R (Linux ``smc_llc.c``/``.h``, PROTOCOL.md §1.7).

LLC messages manage a link group: confirming, adding and deleting links (RC QPs), exchanging
rkeys of RMBs and keeping links alive. They travel as RDMA SENDs on a link's QP.

* v1 messages are always 44 bytes (``SMC_WR_TX_SIZE``): type, length byte 44, a byte holding
  ``add_link_rej_rsn`` in its low nibble, flags, then 40 bytes of body.
* v2 (SMC-Rv2 link groups) puts version 2 in the type's high nibble (0x21, 0x22, …) and a u16
  ``length_v2`` (44..8192, ``SMC_WR_BUF_V2_SIZE``) in bytes 1-2. Most v2 messages keep the v1
  body; ADD LINK appends ``add_link_v2_ext`` (rkeys of every RMB for the new link), REQ ADD LINK
  carries a GID list and DELETE RKEY a variable rkey list.

**length_v2 byte order.** Linux declares ``length_v2`` (and ``add_link_v2_ext.num_rkeys``) as a
plain host-order ``u16``, so x86 Linux sends them little-endian, while Wireshark and a literal
reading of the SMC v2 spec expect big-endian (PROTOCOL.md §1.9 point 4). Decoding accepts either
order, picking the one that equals the message's real length; encoding takes
``length_order`` and defaults to ``"little"`` because the Linux kernel on x86 is the peer we
interoperate with, and it checks ``length_v2`` in its own byte order.

Every field of every message is a frozen dataclass attribute: ints, ``bytes`` for MACs, GIDs and
opaque data, ``IntFlag``/``IntEnum`` for flags and codes (plain ``int`` for codes we do not know),
nested dataclasses in tuples for rkey tables. Reserved bytes are written as zero and ignored on
receipt; bytes after a message's layout are ignored, as the kernel does.

This module is the public face and the decoder: the messages live in ``llc_link`` (links) and
``llc_rkey`` (rkeys), what they share in ``llc_base``.
"""

from __future__ import annotations

from typing import TypeAlias

from smcd_daemon.wire._fields import Reader
from smcd_daemon.wire.llc_base import (
    GID_LEN,
    LLC_MSG_LEN,
    LLC_V2_MAX_LEN,
    MAC_LEN,
    AddLinkFlag,
    AddLinkRejectReason,
    AddLinkRkey,
    ConfirmLinkFlag,
    DeleteLinkFlag,
    DeleteLinkReason,
    LengthOrder,
    LlcFlag,
    LlcType,
    RkeyFlag,
    Rtoken,
    decode_header,
)
from smcd_daemon.wire.llc_link import (
    AddLink,
    AddLinkCont,
    AddLinkV2Ext,
    ConfirmLink,
    DeleteLink,
    ReqAddLinkV2,
    TestLink,
)
from smcd_daemon.wire.llc_rkey import ConfirmRkey, ConfirmRkeyCont, DeleteRkey, DeleteRkeyV2

__all__ = [
    "GID_LEN",
    "LLC_MSG_LEN",
    "LLC_V2_MAX_LEN",
    "MAC_LEN",
    "AddLink",
    "AddLinkCont",
    "AddLinkFlag",
    "AddLinkRejectReason",
    "AddLinkRkey",
    "AddLinkV2Ext",
    "ConfirmLink",
    "ConfirmLinkFlag",
    "ConfirmRkey",
    "ConfirmRkeyCont",
    "DeleteLink",
    "DeleteLinkFlag",
    "DeleteLinkReason",
    "DeleteRkey",
    "DeleteRkeyV2",
    "LengthOrder",
    "LlcFlag",
    "LlcMessage",
    "LlcType",
    "ReqAddLinkV2",
    "RkeyFlag",
    "Rtoken",
    "TestLink",
    "decode",
]

LlcMessage: TypeAlias = (
    ConfirmLink
    | AddLink
    | AddLinkCont
    | DeleteLink
    | ConfirmRkey
    | ConfirmRkeyCont
    | TestLink
    | DeleteRkey
    | DeleteRkeyV2
    | ReqAddLinkV2
)

_V1_CLASSES: dict[int, type[LlcMessage]] = {
    0x1: ConfirmLink,
    0x2: AddLink,
    0x3: AddLinkCont,
    0x4: DeleteLink,
    0x6: ConfirmRkey,
    0x7: TestLink,
    0x8: ConfirmRkeyCont,
    0x9: DeleteRkey,
}
_V2_CLASSES: dict[int, type[LlcMessage]] = {
    0x1: ConfirmLink,
    0x2: AddLink,
    0x4: DeleteLink,
    0x5: ReqAddLinkV2,
    0x6: ConfirmRkey,
    0x7: TestLink,
    0x9: DeleteRkeyV2,
}


def decode(data: bytes | bytearray | memoryview) -> LlcMessage:
    """Decode one LLC message (v1 or v2) of exactly the bytes received.

    Raises :class:`~smcd_daemon.errors.UnknownMessageError` for a type byte that names no LLC
    message (0xFE, CDC, included), :class:`~smcd_daemon.errors.TruncatedError` when a field is
    cut off, and :class:`~smcd_daemon.errors.ProtocolError` for a wrong length byte, a
    ``length_v2`` that matches the message length in neither byte order, or a count that
    exceeds what the message can hold.
    """
    r = Reader(data)
    h = decode_header(r)
    cls = (_V2_CLASSES if h.v2 else _V1_CLASSES)[h.base]
    return cls.decode_body(r, h)
