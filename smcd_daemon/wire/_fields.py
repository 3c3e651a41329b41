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
            self._short(off, size, field)

    def _short(self, off: int, size: int, field: str) -> None:
        raise TruncatedError(
            f"needs {size} byte(s) but the message has {max(len(self.buf) - off, 0)} left "
            f"(length {len(self.buf)})",
            field=field,
            offset=off,
        )

    # Each accessor checks its bounds inline (no call to need): a handshake decodes a few
    # dozen fields, and the call was the larger part of each read.

    def raw(self, off: int, size: int, field: str) -> bytes:
        buf = self.buf
        if off < 0 or off + size > len(buf):
            self._short(off, size, field)
        return buf[off : off + size]

    def u8(self, off: int, field: str) -> int:
        buf = self.buf
        if off < 0 or off >= len(buf):
            self._short(off, 1, field)
        return buf[off]

    def u16(self, off: int, field: str, *, little: bool = False) -> int:
        buf = self.buf
        if off < 0 or off + 2 > len(buf):
            self._short(off, 2, field)
        value: int = (_U16LE if little else _U16).unpack_from(buf, off)[0]
        return value

    def u24(self, off: int, field: str) -> int:
        buf = self.buf
        if off < 0 or off + 3 > len(buf):
            self._short(off, 3, field)
        return int.from_bytes(buf[off : off + 3], "big")

    def u32(self, off: int, field: str, *, little: bool = False) -> int:
        buf = self.buf
        if off < 0 or off + 4 > len(buf):
            self._short(off, 4, field)
        value: int = (_U32LE if little else _U32).unpack_from(buf, off)[0]
        return value

    def u64(self, off: int, field: str) -> int:
        buf = self.buf
        if off < 0 or off + 8 > len(buf):
            self._short(off, 8, field)
        value: int = _U64.unpack_from(buf, off)[0]
        return value


def u16be(value: int) -> bytes:
    return _U16.pack(value)


def u24be(value: int) -> bytes:
    return value.to_bytes(3, "big")


def u32be(value: int) -> bytes:
    return _U32.pack(value)


def u64be(value: int) -> bytes:
    return _U64.pack(value)
