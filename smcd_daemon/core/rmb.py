"""RMBs and send buffers of SMC-R connections: memfds shared with the application, registered
with the RDMA device once and reused across connections.

Registering memory (``ibv_reg_mr``) pins and maps every page; it costs far more than the
connection it serves, so a buffer keeps its registrations (one per RoCE port/PD it was used on)
for as long as it stays in the pool, like the kernel's per-link-group RMB lists
(``smcr_new_buf_create`` / ``smc_buf_get_slot``) and the verbs MR cache.

Layout: the SMC-R channel layout of :mod:`smc_handoff.layout`, because the application's
:class:`smc_handoff.channel.Channel` maps these buffers unchanged; ``size`` is the RMBE size and
the ring is exactly that long, as the kernel's RMBE is (a kernel peer writes at offsets
0 .. size - 1 of what it was given), with the channel's header in front of it::

    0            32                          32 + size    32 + size + 128
    | CDC header | ring (size bytes)         | ctrl trailer |

* An **RMB** is the application's receive buffer. The peer RDMA-WRITEs into its *ring*; only the
  ring is registered (``IBV_ACCESS_REMOTE_WRITE``) and advertised, so a peer that writes past
  it gets a remote access error instead of overwriting the header or the wakeup words. The
  daemon writes the header from the CDC messages it receives.
* A **send buffer** is the application's transmit buffer: the application writes its bytes into
  the ring and the daemon gathers RDMA WRITEs from it; registered for local access only.

Buffers are zeroed before another connection gets them (a plain store of zeros: truncating the
memfd would swap the pages under a live registration, so the device would keep writing into the
old ones). Sizes are the SMC-D/channel sizes 16 KiB << n, n = 0..6.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

from smc_handoff.layout import CDC_HEADER_LEN, CTRL_LEN, DMB_SIZES, map_dmb, smcr_channel_size
from smcd_daemon.errors import SmcError
from smcd_daemon.wire.reasons import DeclineReason

__all__ = [
    "BufferKind",
    "Region",
    "Registrar",
    "RmbPool",
    "RmbPoolError",
    "SmcrBuffer",
    "buffer_size_for",
]


class RmbPoolError(SmcError):
    """A buffer could not be created (memfd, mapping) or the pool's byte limit is reached.
    ``decline_reason`` lets the CLC negotiator decline with SMC_CLC_DECL_MEM."""

    decline_reason = int(DeclineReason.MEM)


class BufferKind(StrEnum):
    RMB = "rmb"
    SNDBUF = "sndbuf"


class Region(Protocol):
    """A registration (``transport.verbs.MemoryRegion``)."""

    @property
    def addr(self) -> int: ...
    @property
    def length(self) -> int: ...
    @property
    def lkey(self) -> int: ...
    @property
    def rkey(self) -> int: ...


class Registrar(Protocol):
    """Registers buffers with one protection domain (``transport.verbs.MrCache``)."""

    def register(self, buf: Any, *, remote_write: bool = True) -> Any: ...
    def release(self, region: Any) -> None: ...


def buffer_size_for(wanted: int) -> int:
    """The smallest RMBE size (16 KiB << n) holding ``wanted`` bytes of ring, capped at the
    largest (1 MiB)."""
    for size in DMB_SIZES:
        if size >= wanted:
            return size
    return DMB_SIZES[-1]


@dataclass(eq=False)
class SmcrBuffer:
    """One memfd buffer, mapped by the daemon. ``size`` is the RMBE size (the ring's length);
    ``regions`` holds its registrations by registrar name (a RoCE device:port);
    ``generation`` counts the connections that used it."""

    kind: BufferKind
    size: int
    fd: int
    mm: mmap.mmap
    ring: memoryview
    header: memoryview  # 4 x u64 (the CDC header words)
    ctrl: memoryview  # 16 x u64 (WAIT at 0, KICK at 8)
    regions: dict[str, Any] = field(default_factory=dict)
    registrars: dict[str, Registrar] = field(default_factory=dict)
    generation: int = 0

    @property
    def ring_len(self) -> int:
        return self.size

    @property
    def channel_size(self) -> int:
        """The size the application's channel maps it as (``layout.SMCR_CHANNEL_SIZES``)."""
        return smcr_channel_size(self.size)

    def region(self, name: str) -> Any:
        return self.regions[name]

    def zero(self) -> None:
        """Zero header, ring and trailer in place (registrations stay valid)."""
        self.mm.seek(0)
        self.mm.write(_zeros(self.channel_size + CTRL_LEN))
        self.mm.seek(0)

    def dup_fd(self) -> int:
        """A new descriptor of the memfd for the application (close-on-exec)."""
        return os.dup(self.fd)


_ZEROS: dict[int, bytes] = {}


def _zeros(n: int) -> bytes:
    z = _ZEROS.get(n)
    if z is None:
        z = _ZEROS[n] = bytes(n)
    return z


class RmbPool:
    """Buffers by kind and size, reused with their registrations.

    ``max_idle`` buffers per (kind, size) are kept when connections end (more are deregistered
    and unmapped); ``max_bytes`` (0 = none) bounds the memory of all buffers, idle or in use.
    """

    def __init__(self, *, max_idle: int = 64, max_bytes: int = 0) -> None:
        self.max_idle = max_idle
        self.max_bytes = max_bytes
        self._idle: dict[tuple[BufferKind, int], list[SmcrBuffer]] = {}
        self._busy: set[SmcrBuffer] = set()
        self.bytes = 0
        #: counters: buffers created, reused, registrations made
        self.created = 0
        self.reused = 0
        self.registrations = 0

    # ---- buffers ---------------------------------------------------------------------------

    def acquire(self, kind: BufferKind, size: int) -> SmcrBuffer:
        """A zeroed buffer of exactly ``size`` bytes (one of the channel sizes)."""
        if size not in DMB_SIZES:
            raise ValueError(f"buffer size {size} is not 16 KiB << n (n = 0..6)")
        idle = self._idle.get((kind, size))
        if idle:
            buf = idle.pop()
            buf.zero()
            self.reused += 1
        else:
            buf = self._create(kind, size)
        buf.generation += 1
        self._busy.add(buf)
        return buf

    def _create(self, kind: BufferKind, size: int) -> SmcrBuffer:
        total = smcr_channel_size(size) + CTRL_LEN
        if self.max_bytes and self.bytes + total > self.max_bytes:
            self._trim(self.bytes + total - self.max_bytes)
            if self.bytes + total > self.max_bytes:
                raise RmbPoolError(
                    f"SMC-R buffer memory limit reached ({self.bytes} of {self.max_bytes} bytes "
                    f"in use; a {size >> 10} KiB {kind} does not fit)"
                )
        try:
            fd = os.memfd_create(f"smcr-{kind}-{size >> 10}k", os.MFD_CLOEXEC)
        except OSError as e:
            raise RmbPoolError(f"memfd_create for a {size >> 10} KiB {kind}: {e}") from e
        try:
            os.ftruncate(fd, total)
            mm = map_dmb(fd, smcr_channel_size(size))
        except OSError as e:
            os.close(fd)
            raise RmbPoolError(f"mapping a {size >> 10} KiB {kind}: {e}") from e
        mv = memoryview(mm)
        buf = SmcrBuffer(
            kind,
            size,
            fd,
            mm,
            ring=mv[CDC_HEADER_LEN : CDC_HEADER_LEN + size],
            header=mv[:CDC_HEADER_LEN].cast("Q"),
            ctrl=mv[CDC_HEADER_LEN + size : total].cast("Q"),
        )
        mv.release()
        self.bytes += total
        self.created += 1
        return buf

    def register(self, buf: SmcrBuffer, name: str, registrar: Registrar) -> Any:
        """The registration of ``buf``'s ring with ``registrar`` (named ``name``, e.g.
        ``"rxe0:1"``), made once: RMBs allow remote writes, send buffers do not."""
        region = buf.regions.get(name)
        if region is None:
            region = registrar.register(buf.ring, remote_write=buf.kind is BufferKind.RMB)
            buf.regions[name] = region
            buf.registrars[name] = registrar
            self.registrations += 1
        return region

    def release(self, buf: SmcrBuffer) -> None:
        """A connection is done with ``buf``: keep it (registered) for the next, or destroy."""
        if buf not in self._busy:
            return
        self._busy.discard(buf)
        idle = self._idle.setdefault((buf.kind, buf.size), [])
        if len(idle) < self.max_idle:
            idle.append(buf)
        else:
            self._destroy(buf)

    def forget_registrar(self, name: str) -> None:
        """The PD behind ``name`` is going away (port closed): drop its registrations."""
        for buf in self._all():
            region = buf.regions.pop(name, None)
            registrar = buf.registrars.pop(name, None)
            if region is not None and registrar is not None:
                with contextlib.suppress(Exception):
                    registrar.release(region)

    def _trim(self, need: int) -> None:
        freed = 0
        for idle in self._idle.values():
            while idle and freed < need:
                buf = idle.pop()
                freed += buf.channel_size + CTRL_LEN
                self._destroy(buf)

    def _destroy(self, buf: SmcrBuffer) -> None:
        for name, region in list(buf.regions.items()):
            registrar = buf.registrars.get(name)
            if registrar is not None:
                with contextlib.suppress(Exception):
                    registrar.release(region)
        buf.regions.clear()
        buf.registrars.clear()
        for view in (buf.ring, buf.header, buf.ctrl):
            view.release()
        with contextlib.suppress(BufferError):
            buf.mm.close()
        with contextlib.suppress(OSError):
            os.close(buf.fd)
        self.bytes -= buf.channel_size + CTRL_LEN

    def _all(self) -> Iterator[SmcrBuffer]:
        yield from self._busy
        for idle in self._idle.values():
            yield from idle

    @property
    def idle(self) -> int:
        return sum(len(v) for v in self._idle.values())

    @property
    def busy(self) -> int:
        return len(self._busy)

    def close(self) -> None:
        """Destroy every buffer (the daemon is stopping; applications keep their mappings)."""
        for buf in list(self._all()):
            self._destroy(buf)
        self._busy.clear()
        self._idle.clear()
