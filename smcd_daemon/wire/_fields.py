"""Bounds-checked field access shared by the codecs.

Decoders read every field through :class:`Reader` so that a short or lying message always
becomes a :class:`TruncatedError` naming the field, never an ``IndexError`` or ``struct.error``.
"""

from __future__ import annotations

import struct

from smcd_daemon.errors import ProtocolError, TruncatedError

__all__ = ["ProtocolError", "Reader", "TruncatedError", "u16be", "u24be", "u32be", "u64be"]

_U16 = struct.Struct(">H")
_U16LE = struct.Struct("<H")
_U32 = struct.Struct(">I")
_U32LE = struct.Struct("<I")
_U64 = struct.Struct(">Q")


class Reader:
    """Reads big-endian (or explicitly little-endian) fields at absolute offsets of one message."""

    __slots__ = ("buf",)

    def __init__(self, buf: bytes | bytearray | memoryview) -> None:
        self.buf = bytes(buf)

    def __len__(self) -> int:
        return len(self.buf)

    def need(self, off: int, size: int, field: str) -> None:
        if off < 0 or off + size > len(self.buf):
            raise TruncatedError(
                f"needs {size} byte(s) but the message has {max(len(self.buf) - off, 0)} left "
                f"(length {len(self.buf)})",
                field=field,
                offset=off,
            )

    def raw(self, off: int, size: int, field: str) -> bytes:
        self.need(off, size, field)
        return self.buf[off : off + size]

    def u8(self, off: int, field: str) -> int:
        self.need(off, 1, field)
        return self.buf[off]

    def u16(self, off: int, field: str, *, little: bool = False) -> int:
        self.need(off, 2, field)
        return int((_U16LE if little else _U16).unpack_from(self.buf, off)[0])

    def u24(self, off: int, field: str) -> int:
        self.need(off, 3, field)
        return int.from_bytes(self.buf[off : off + 3], "big")

    def u32(self, off: int, field: str, *, little: bool = False) -> int:
        self.need(off, 4, field)
        return int((_U32LE if little else _U32).unpack_from(self.buf, off)[0])

    def u64(self, off: int, field: str) -> int:
        self.need(off, 8, field)
        return int(_U64.unpack_from(self.buf, off)[0])


def u16be(value: int) -> bytes:
    return _U16.pack(value)


def u24be(value: int) -> bytes:
    return value.to_bytes(3, "big")


def u32be(value: int) -> bytes:
    return _U32.pack(value)


def u64be(value: int) -> bytes:
    return _U64.pack(value)
