"""Memory registrations of a verbs port: :class:`MrCache` registers each buffer once per
PD (registering pins and maps every page) and keeps it, with its rkey, until released."""

from __future__ import annotations

import contextlib
import ctypes
from dataclasses import dataclass
from typing import Any

from smcd_daemon.transport.verbs_lib import load_pyverbs, verbs_error

__all__ = ["MemoryRegion", "MrCache"]


# --------------------------------------------------------------------------------------------
# memory regions
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class MemoryRegion:
    """A registered buffer: the peer writes to ``addr``..``addr+length`` with ``rkey``; our
    writes gather from it with ``lkey``."""

    addr: int
    length: int
    lkey: int
    rkey: int
    _mr: Any
    #: [ctypes view] holding the buffer export while registered: the mapping cannot be closed
    #: under the device (mmap.close() raises BufferError); emptied on release.
    _export: list[Any]

    def read(self, offset: int, length: int) -> bytes:
        return ctypes.string_at(self.addr + offset, length)


def _buffer_address(buf: Any) -> tuple[int, int, Any]:
    """(address, length, export) of a writable buffer (mmap, bytearray, memoryview)."""
    view = memoryview(buf)
    if view.readonly or not view.c_contiguous:
        raise ValueError("an RDMA buffer must be writable and contiguous")
    n = view.nbytes
    if n == 0:
        raise ValueError("cannot register an empty buffer")
    export = (ctypes.c_char * n).from_buffer(view)
    return ctypes.addressof(export), n, export


class MrCache:
    """Memory registrations of one PD, once per buffer: registering pins and maps every page,
    so an RMB reused across connections keeps its registration (and its rkey) until released."""

    def __init__(self, pd: Any, device: str) -> None:
        self._pd = pd
        self._device = device
        self._by_key: dict[tuple[int, int], MemoryRegion] = {}
        self.registrations = 0  # ibv_reg_mr calls made (the cache's cost counter)

    def register(self, buf: Any, *, remote_write: bool = True) -> MemoryRegion:
        """The registration of ``buf`` (an mmap of a memfd RMB, or any writable buffer)."""
        addr, n, export = _buffer_address(buf)
        key = (addr, n)
        region = self._by_key.get(key)
        if region is not None:
            del export
            return region
        pv = load_pyverbs()
        access = int(pv.e.IBV_ACCESS_LOCAL_WRITE)
        if remote_write:
            access |= int(pv.e.IBV_ACCESS_REMOTE_WRITE)
        try:
            mr = pv.mr.MR(self._pd, n, access, address=addr)
        except pv.Error as exc:
            raise verbs_error(f"ibv_reg_mr of {n} bytes on {self._device}", exc) from exc
        self.registrations += 1
        region = MemoryRegion(addr, n, int(mr.lkey), int(mr.rkey), mr, [export])
        self._by_key[key] = region
        return region

    def lookup(self, buf: Any) -> MemoryRegion | None:
        view = memoryview(buf)
        export = (ctypes.c_char * view.nbytes).from_buffer(view)
        try:
            return self._by_key.get((ctypes.addressof(export), view.nbytes))
        finally:
            del export
            view.release()

    def release(self, region: MemoryRegion) -> None:
        """Deregister (when the buffer leaves the pool for good)."""
        if self._by_key.pop((region.addr, region.length), None) is not None:
            with contextlib.suppress(Exception):
                region._mr.close()
            region._export.clear()

    def __len__(self) -> int:
        return len(self._by_key)

    def close(self) -> None:
        for region in list(self._by_key.values()):
            self.release(region)
