"""CDC — Connection Data Control messages (Linux ``net/smc/smc_cdc.h``; PROTOCOL.md §1.8).

Two encodings of the same information (cursors and flags of one connection):

* SMC-R: :class:`CdcMessage`, a 44-byte RDMA SEND on the link's RC QP, network byte order,
  type byte 0xFE (``struct smc_cdc_msg``).
* SMC-D: :class:`SmcdCdcHeader`, the 32 bytes the peer writes at offset 0 of our DMB element
  (``struct smcd_cdc_msg``). It never leaves the machine, so Linux writes it in **host byte
  order**, and it carries the flag bytes in the *consumer* cursor's slot.
"""

from __future__ import annotations

import mmap
import struct
import sys
from dataclasses import dataclass
from enum import IntFlag
from typing import ClassVar

from smcd_daemon.errors import UnknownMessageError
from smcd_daemon.wire._fields import ProtocolError, Reader, TruncatedError
from smcd_daemon.wire.cursor import Cursor

__all__ = [
    "CDC_MSG_LEN",
    "CDC_MSG_TYPE",
    "SMCD_CDC_HEADER_LEN",
    "CdcMessage",
    "ConnStateFlag",
    "ProducerFlag",
    "SmcdCdcHeader",
    "decode",
    "seqno_before",
]

#: Buffers the SMC-D header can be read from / written into (shared memory is an ``mmap``).
ReadableBuffer = bytes | bytearray | memoryview | mmap.mmap
WritableBuffer = bytearray | memoryview | mmap.mmap

#: SMC_CDC_MSG_TYPE: first byte of every CDC message (LLC types never use it).
CDC_MSG_TYPE = 0xFE
#: SMC_WR_TX_SIZE: the only length the kernel accepts in the CDC length byte.
CDC_MSG_LEN = 44
#: sizeof(struct smcd_cdc_msg); the DMB data area starts right after it.
SMCD_CDC_HEADER_LEN = 32


class ProducerFlag(IntFlag):
    """``struct smc_cdc_producer_flags`` as on-the-wire bits (byte 24 of the SMC-R message)."""

    WRITE_BLOCKED = 0x80  # the writer has no room left in our RMBE
    URG_DATA_PENDING = 0x40
    URG_DATA_PRESENT = 0x20
    CONS_CURS_UPD_REQ = 0x10  # please send me your consumer cursor
    FAILOVER_VALIDATION = 0x08  # replayed after a link failover: check the sequence number


class ConnStateFlag(IntFlag):
    """``struct smc_cdc_conn_state_flags`` as on-the-wire bits (byte 25 of the SMC-R message)."""

    PEER_DONE_WRITING = 0x80  # shutdown(SHUT_WR)
    PEER_CONN_CLOSED = 0x40  # orderly close
    PEER_CONN_ABORT = 0x20  # abnormal close (ECONNRESET at the peer)


_NO_PROD_FLAGS = ProducerFlag(0)
_NO_CONN_STATE_FLAGS = ConnStateFlag(0)


def seqno_before(seq1: int, seq2: int) -> bool:
    """True when u16 sequence number ``seq1`` precedes ``seq2`` (``smc_cdc_before``).

    The receiver drops an SMC-R CDC whose seqno is before the last one it processed."""
    diff = (seq1 - seq2) & 0xFFFF
    return diff >= 0x8000


def _check_uint(name: str, value: int, bits: int) -> None:
    if not 0 <= value < (1 << bits):
        raise ValueError(f"{name}={value} does not fit in {bits} bits")


@dataclass(frozen=True, slots=True)
class CdcMessage:
    """SMC-R CDC message (``struct smc_cdc_msg``, 44 bytes, big-endian).

    ``prod`` is the sender's producer cursor in *our* RMBE (how far it has written), ``cons``
    its consumer cursor in *its* RMBE (how far it has read what we wrote). The reserved u16 in
    front of each cursor is written as zero and ignored on receipt, as Linux does.
    """

    seqno: int
    token: int
    prod: Cursor
    cons: Cursor
    prod_flags: ProducerFlag = _NO_PROD_FLAGS
    conn_state_flags: ConnStateFlag = _NO_CONN_STATE_FLAGS

    _STRUCT: ClassVar[struct.Struct] = struct.Struct(">BBHI2xHI2xHIBB18x")

    def __post_init__(self) -> None:
        _check_uint("seqno", self.seqno, 16)
        _check_uint("token", self.token, 32)
        _check_uint("prod_flags", int(self.prod_flags), 8)
        _check_uint("conn_state_flags", int(self.conn_state_flags), 8)

    def encode(self) -> bytes:
        return self._STRUCT.pack(
            CDC_MSG_TYPE,
            CDC_MSG_LEN,
            self.seqno,
            self.token,
            self.prod.wrap,
            self.prod.count,
            self.cons.wrap,
            self.cons.count,
            int(self.prod_flags),
            int(self.conn_state_flags),
        )

    @classmethod
    def decode(cls, data: bytes | bytearray | memoryview) -> CdcMessage:
        """Decode one SMC-R CDC message.

        Linux drops a CDC whose length byte is not 44; so do we (``ProtocolError`` on
        ``length``). Linux only needs the first 26 bytes to be present; we require all 44, which
        every sender (Linux included) always transmits. Bytes after the 44th are ignored.
        """
        r = Reader(data)
        msg_type = r.u8(0, "type")
        if msg_type != CDC_MSG_TYPE:
            raise UnknownMessageError(
                f"type 0x{msg_type:02X} is not a CDC message (0xFE)", field="type", offset=0
            )
        length = r.u8(1, "length")
        if length != CDC_MSG_LEN:
            raise ProtocolError(
                f"CDC length byte is {length}, must be {CDC_MSG_LEN}", field="length", offset=1
            )
        seqno = r.u16(2, "seqno")
        token = r.u32(4, "token")
        r.raw(8, 2, "prod.reserved")
        prod = Cursor(r.u16(10, "prod.wrap"), r.u32(12, "prod.count"))
        r.raw(16, 2, "cons.reserved")
        cons = Cursor(r.u16(18, "cons.wrap"), r.u32(20, "cons.count"))
        prod_flags = ProducerFlag(r.u8(24, "prod_flags"))
        conn_state_flags = ConnStateFlag(r.u8(25, "conn_state_flags"))
        r.raw(26, 18, "reserved")
        return cls(seqno, token, prod, cons, prod_flags, conn_state_flags)


def decode(data: bytes | bytearray | memoryview) -> CdcMessage:
    """Decode an SMC-R CDC message (44 bytes, type 0xFE)."""
    return CdcMessage.decode(data)


# Native byte order, standard sizes, no padding: type, res1[7], prod {wrap, count, prod_flags,
# conn_state_flags}, cons {same}, res3[8] = 32 bytes (``struct smcd_cdc_msg`` is __packed inside
# the cursors and 8-aligned overall).
_SMCD = struct.Struct("=B7xHIBBHIBB8x")
assert _SMCD.size == SMCD_CDC_HEADER_LEN


@dataclass(frozen=True, slots=True)
class SmcdCdcHeader:
    """SMC-D CDC header: the first 32 bytes of a DMB element (``struct smcd_cdc_msg``).

    Layout (host byte order, ``sys.byteorder``)::

        0  type 0xFE            1  reserved[7]
        8  prod.wrap u16       10  prod.count u32   14 (prod flag bytes: written 0, ignored)
        16 cons.wrap u16       18  cons.count u32   22 prod_flags   23 conn_state_flags
        24 reserved[8]

    Linux's ``smcd_cdc_msg_send`` stores both flag bytes in the consumer cursor's slot and
    ``smcd_cdc_msg_to_host`` reads them from there, so we do the same. The peer writes this
    header with the signalling flag after the data; current kernels apply no stale-cursor rule
    to it (it is overwritten in place), only bound the producer count by the buffer length.
    """

    prod: Cursor
    cons: Cursor
    prod_flags: ProducerFlag = _NO_PROD_FLAGS
    conn_state_flags: ConnStateFlag = _NO_CONN_STATE_FLAGS

    SIZE: ClassVar[int] = SMCD_CDC_HEADER_LEN
    BYTEORDER: ClassVar[str] = sys.byteorder

    def __post_init__(self) -> None:
        _check_uint("prod_flags", int(self.prod_flags), 8)
        _check_uint("conn_state_flags", int(self.conn_state_flags), 8)

    def _values(self) -> tuple[int, ...]:
        return (
            CDC_MSG_TYPE,
            self.prod.wrap,
            self.prod.count,
            0,
            0,
            self.cons.wrap,
            self.cons.count,
            int(self.prod_flags),
            int(self.conn_state_flags),
        )

    def encode(self) -> bytes:
        return _SMCD.pack(*self._values())

    def encode_into(self, buf: WritableBuffer, offset: int = 0) -> None:
        """Write the 32 bytes into a writable buffer (``bytearray``, ``mmap``, memoryview) at
        ``offset`` without allocating — the data path does this on shared memory."""
        if offset < 0 or len(buf) - offset < SMCD_CDC_HEADER_LEN:
            raise ValueError(
                f"buffer of {len(buf)} bytes has no room for the {SMCD_CDC_HEADER_LEN}-byte "
                f"SMC-D CDC header at offset {offset}"
            )
        _SMCD.pack_into(buf, offset, *self._values())

    @classmethod
    def decode(cls, data: bytes | bytearray | memoryview) -> SmcdCdcHeader:
        return cls.decode_from(data)

    @classmethod
    def decode_from(cls, buf: ReadableBuffer, offset: int = 0) -> SmcdCdcHeader:
        """Read the header at ``offset`` of any buffer (an ``mmap`` included) without copying it.

        Type 0x00 is accepted as well as 0xFE: a DMB element is zeroed before use, so a reader
        may look at the header before the peer's first CDC write (all cursors then read 0).
        """
        if offset < 0 or len(buf) - offset < SMCD_CDC_HEADER_LEN:
            have = max(len(buf) - offset, 0)
            raise TruncatedError(
                f"SMC-D CDC header needs {SMCD_CDC_HEADER_LEN} bytes but {have} are there",
                field="header",
                offset=offset,
            )
        (
            msg_type,
            prod_wrap,
            prod_count,
            _prod_pf,
            _prod_csf,
            cons_wrap,
            cons_count,
            prod_flags,
            conn_state_flags,
        ) = _SMCD.unpack_from(buf, offset)
        if msg_type not in (CDC_MSG_TYPE, 0):
            raise UnknownMessageError(
                f"type 0x{msg_type:02X} is not an SMC-D CDC header (0xFE)",
                field="type",
                offset=0,
            )
        return cls(
            Cursor(prod_wrap, prod_count),
            Cursor(cons_wrap, cons_count),
            ProducerFlag(prod_flags),
            ConnStateFlag(conn_state_flags),
        )
