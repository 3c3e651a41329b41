"""The DMB pool: memfd-backed shared-memory buffers for SMC-D over loopback-ism.

A connection over loopback-ism has two DMBs (one per receiving side). Each is a memfd of one of the
SMC-D size classes ``16 KiB << n`` (n = 0..6, at most ``buffers.max_dmb_size``) plus the channel's
control trailer (:data:`smc_handoff.layout.CTRL_LEN`, 128 bytes of wakeup words that are not part of
the DMB proper), laid out as ``[32-byte SMC-D CDC header | ring | control trailer]``. The daemon
creates them, hands duplicates of the fd to the two applications, which map exactly these memfds,
and stays out of the data path. So every rule below (reuse, zeroing, quotas) applies to the memory
the applications share. Sizes, quotas and statistics count the DMB proper (``size``); the trailer
is a fixed overhead of the memfd (``file_size``).

Why each rule is what it is:

* **Size classes and downgrade.** Sizes travel compressed in CLC Accept/Confirm (4 bits), so only
  the classes exist. As the kernel's ``__smc_buf_create`` does, a request that cannot be met at the
  wanted class is retried at the next smaller one down to the configured minimum; a limit that
  stops even the smallest is :class:`DmbLimitError` (the kernel's -ENOSPC from ``register_dmb``,
  which it maps to SMC_CLC_DECL_MAX_DMB), a failing ``memfd_create`` is :class:`DmbMemoryError`
  (SMC_CLC_DECL_MEM). Either is a reason to fall back to TCP, never a crash.
* **Sealed size.** Each memfd is sized ``size + CTRL_LEN`` and sealed ``F_SEAL_SHRINK |
  F_SEAL_GROW | F_SEAL_SEAL`` at creation: an application holding the fd cannot truncate it under
  its peer's mapping (which would SIGBUS the peer) nor add a write seal that would stop the peer
  from mapping it writable.
* **Tokens.** 64-bit random, never 0, unique among live DMBs (as loopback-ism's ``register_dmb``
  retries on a collision). A buffer gets a fresh token every time it is handed out, so a stale
  token held by a past peer never reaches a new connection's buffer.
* **Refcount.** The owner's registration holds one reference, every attach (the peer mapping the
  buffer to write into it, loopback-ism's ``attach_dmb``) one more. ``unregister`` makes the token
  unknown to new attachers at once; the buffer returns to the pool only when the count reaches 0,
  i.e. when both ends have let go.
* **Reuse and zeroing.** A returned buffer is kept for reuse by its size class. The daemon cannot
  revoke a mapping an application made (it may keep a dup of the fd forever), so a memfd is only
  ever reused for a new owner whose uid is the *only* uid that ever had access to it (owner and
  every attacher): anything else gets a fresh memfd, which the kernel guarantees to be zero, and
  the old one is closed. A reused memfd is always zeroed completely before it is handed out again
  (the ring header must start with zero cursors, stale ring bytes must not be visible to the next
  connection even of the same user, and the control trailer must hold no stale wakeup words): it
  is zeroed as soon as it comes back to the pool, which keeps that work off the next handshake.
  The daemon returns a buffer to the pool only when both halves' handoff connections have hung
  up, and the library unmaps a channel before it closes that connection, so a reused buffer is
  mapped by nobody from its previous connection (a process that died had its mappings removed by
  the kernel before its descriptors were closed). Zeroing punches a hole over the whole file
  (``fallocate(PUNCH_HOLE|KEEP_SIZE)``): it frees the pages instead of writing them (faster than a
  ``pwrite`` of zeros, and the memory goes back to the system while the buffer waits in the
  pool); the next writer faults fresh zero pages in. ``ftruncate`` to 0 and back would do the
  same but the seals forbid it.
* **Limits.** Per user (``quota.buffer_bytes``, ``quota.connections`` counted as DMBs owned, 0 = no
  limit) and for the whole pool (``buffers.pool_max_bytes`` over all memfds including cached free
  ones, ``buffers.pool_max_buffers`` over DMBs in use, the analogue of loopback-ism's 5000).
  Cached free buffers are evicted (closed) when a new buffer needs their bytes.

Accounting is kept in running totals (allocation is on the handshake path and the pool may hold
thousands of buffers), and :meth:`DmbPool.close` closes every memfd the pool holds, in use or not:
the applications keep their own duplicates and mappings.

Not thread-safe: the daemon's event loop owns it.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from smc_handoff.layout import CTRL_LEN, SMC_BUF_MIN, SMCD_DMBE_SIZES
from smcd_daemon.errors import SmcError
from smcd_daemon.wire.cdc import SMCD_CDC_HEADER_LEN
from smcd_daemon.wire.reasons import DeclineReason

__all__ = [
    "CTRL_LEN",
    "SMCD_DMBE_SIZES",
    "SMC_BUF_MIN",
    "ClassStats",
    "Dmb",
    "DmbAllocationError",
    "DmbLimitError",
    "DmbMemoryError",
    "DmbPool",
    "PoolStats",
    "UnknownTokenError",
    "UserUsage",
    "compress_size",
    "decompress",
]

_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02


def compress_size(size: int, *, max_comp: int = SMCD_DMBE_SIZES) -> int:
    """The compressed size class for a wanted buffer size, as the kernel's
    ``smc_compress_bufsize`` for SMC-D: the smallest n with ``16 KiB << n >= size``, capped at
    ``max_comp``; anything up to 16 KiB (also 0 or negative) is class 0."""
    if size <= SMC_BUF_MIN:
        return 0
    return min(((size - 1) // SMC_BUF_MIN).bit_length(), max_comp)


def decompress(comp: int) -> int:
    """Bytes of compressed size class ``comp`` (``smc_uncompress_bufsize``): 16 KiB << comp."""
    if not 0 <= comp <= 15:
        raise ValueError(f"compressed buffer size {comp} outside 0..15 (4 bits)")
    return SMC_BUF_MIN << comp


class DmbAllocationError(SmcError):
    """No DMB could be had; ``decline_reason`` is the CLC code to fall back with."""

    decline_reason: int = DeclineReason.MEM


class DmbLimitError(DmbAllocationError):
    """A per-user quota or a pool limit stops the allocation (kernel: -ENOSPC → MAX_DMB).

    ``limit`` names which one: ``user-bytes``, ``user-connections``, ``pool-bytes``,
    ``pool-buffers``."""

    decline_reason = DeclineReason.MAX_DMB

    def __init__(self, message: str, *, limit: str, uid: int) -> None:
        super().__init__(message)
        self.limit = limit
        self.uid = uid


class DmbMemoryError(DmbAllocationError):
    """The kernel refused the memory itself (memfd_create/ftruncate failed) → SMC_CLC_DECL_MEM."""

    decline_reason = DeclineReason.MEM


class UnknownTokenError(SmcError):
    """A token that names no live DMB (never issued, unregistered, or already released)."""


@dataclass(eq=False)
class Dmb:
    """One buffer of the pool. ``fd`` stays owned by the pool (dup it to pass it on);
    ``token`` is 0 while the buffer is free."""

    fd: int
    size_comp: int
    owner_uid: int = -1
    token: int = 0
    refs: int = 0
    registered: bool = False
    accessors: set[int] = field(default_factory=set)
    """Every uid that was ever handed this memfd (owner or attacher)."""
    inode: int = 0
    size: int = field(init=False)
    """Bytes of the DMB proper (of ``size_comp``, which never changes: kept, not computed, as
    every registration and release asks for it)."""
    file_size: int = field(init=False)
    """Bytes of the memfd: the DMB and the channel's control trailer after it."""

    def __post_init__(self) -> None:
        self.size = decompress(self.size_comp)
        self.file_size = self.size + CTRL_LEN

    @property
    def ring_size(self) -> int:
        """Bytes of the ring after the 32-byte CDC header (what the peer may fill)."""
        return self.size - SMCD_CDC_HEADER_LEN

    @property
    def in_use(self) -> bool:
        return self.refs > 0


@dataclass(frozen=True)
class ClassStats:
    size: int
    allocated: int
    in_use: int
    free: int


@dataclass(frozen=True)
class UserUsage:
    uid: int
    bytes: int
    buffers: int


@dataclass(frozen=True)
class PoolStats:
    """What D-Bus and ``smcctl`` show about the pool."""

    allocated_bytes: int
    in_use_bytes: int
    allocated_buffers: int
    in_use_buffers: int
    classes: tuple[ClassStats, ...]
    users: tuple[UserUsage, ...]
    zeroings: int
    fresh_memfds: int
    reuses: int


class _Libc:
    """``fallocate(2)`` through ctypes: ``os`` only offers ``posix_fallocate``."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.fallocate
        fn.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
        fn.restype = ctypes.c_int
        self._fallocate = fn

    def punch_hole(self, fd: int, size: int) -> None:
        if self._fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, 0, size) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))


_libc: _Libc | None = None


def _zero(fd: int, size: int) -> None:
    """Make every byte of the memfd read as 0 (see the module docstring for why a hole)."""
    global _libc
    try:
        if _libc is None:
            _libc = _Libc()
        _libc.punch_hole(fd, size)
    except (OSError, AttributeError):
        os.pwrite(fd, bytes(size), 0)


class _RandomTokens:
    """64-bit tokens from the kernel's CSPRNG, drawn 512 at a time: every handoff registers
    two DMBs, and one ``getrandom`` per token was a system call of each."""

    DRAW = 512

    def __init__(self) -> None:
        self._words = memoryview(b"").cast("Q")  # the draw as 64-bit words (native order)
        self._next = self.DRAW

    def __call__(self) -> int:
        i = self._next
        if i >= self.DRAW:
            self._words = memoryview(os.urandom(8 * self.DRAW)).cast("Q")
            i = 0
        self._next = i + 1
        return self._words[i]


class DmbPool:
    """Size-classed, refcounted, quota-bounded pool of memfd DMBs (see the module docstring)."""

    def __init__(
        self,
        *,
        min_size: int = SMC_BUF_MIN,
        max_size: int = SMC_BUF_MIN << SMCD_DMBE_SIZES,
        pool_max_bytes: int = 256 << 20,
        pool_max_buffers: int = 5000,
        user_max_bytes: int = 64 << 20,
        user_max_buffers: int = 1024,
        token_source: Callable[[], int] | None = None,
    ) -> None:
        self.min_comp = compress_size(min_size)
        self.max_comp = compress_size(max_size)
        if decompress(self.min_comp) != min_size or decompress(self.max_comp) != max_size:
            raise ValueError("min_size and max_size must be 16 KiB << n for n = 0..6")
        if self.min_comp > self.max_comp:
            raise ValueError("min_size must not exceed max_size")
        self.pool_max_bytes = pool_max_bytes
        self.pool_max_buffers = pool_max_buffers
        self.user_max_bytes = user_max_bytes
        self.user_max_buffers = user_max_buffers
        self._token_source = token_source or _RandomTokens()
        self._by_token: dict[int, Dmb] = {}  # registered or still attached
        self._free: dict[int, list[Dmb]] = {c: [] for c in range(SMCD_DMBE_SIZES + 1)}
        self._all: set[Dmb] = set()
        self._user_bytes: dict[int, int] = {}
        self._user_buffers: dict[int, int] = {}
        self._allocated_bytes = 0  # every memfd the pool holds (DMB sizes)
        self._in_use_bytes = 0
        self._in_use_buffers = 0
        self._zeroings = 0
        self._fresh = 0
        self._reuses = 0
        self.last_zero_seconds = 0.0
        self._closed = False
        self.on_destroy: Callable[[int], None] | None = None
        """Called with a memfd just before the pool closes it for good (an adapter that keeps
        something per memfd, e.g. a mapping, lets go of it then)."""

    @classmethod
    def from_config(cls, config: object) -> DmbPool:
        """Build the pool from a :class:`smcd_daemon.config.Config` (``buffers``, ``quota``)."""
        buffers = config.buffers  # type: ignore[attr-defined]
        quota = config.quota  # type: ignore[attr-defined]
        return cls(
            min_size=buffers.min_dmb_size,
            max_size=buffers.max_dmb_size,
            pool_max_bytes=buffers.pool_max_bytes,
            pool_max_buffers=buffers.pool_max_buffers,
            user_max_bytes=quota.buffer_bytes,
            user_max_buffers=quota.connections,
        )

    # ---- allocation ---------------------------------------------------------------------------

    def register(self, uid: int, size: int, *, min_size: int | None = None) -> Dmb:
        """A DMB for ``uid`` of the class of ``size`` (capped at the pool's maximum), or the next
        smaller class that the limits allow, down to ``min_size`` (default: the pool minimum).
        The owner holds the one reference. Raises :class:`DmbLimitError` or
        :class:`DmbMemoryError`."""
        if self._closed:
            raise DmbMemoryError("the DMB pool is closed")
        if type(uid) is not int and (isinstance(uid, bool) or not isinstance(uid, int)):
            raise ValueError(f"uid must be a non-negative int, got {uid!r}")
        if uid < 0:
            raise ValueError(f"uid must be a non-negative int, got {uid!r}")
        # compress_size() of both sizes, inline (two calls each, twice per connection)
        min_comp = self.min_comp
        want = ((size - 1) // SMC_BUF_MIN).bit_length() if size > SMC_BUF_MIN else 0
        if want < min_comp:
            want = min_comp
        elif want > self.max_comp:
            want = self.max_comp
        floor = min_comp
        if min_size is not None and min_size > SMC_BUF_MIN:
            floor = max(min_comp, ((min_size - 1) // SMC_BUF_MIN).bit_length())
        if floor > want:
            floor = want
        last: DmbAllocationError | None = None
        for comp in range(want, floor - 1, -1):
            try:
                self._check_limits(uid, comp)
                dmb = self._take(uid, comp)
            except DmbAllocationError as exc:
                last = exc
                if isinstance(exc, DmbLimitError) and exc.limit in (
                    "user-connections",
                    "pool-buffers",
                ):
                    break  # a smaller class does not help against a count limit
                continue
            dmb.owner_uid = uid
            dmb.token = self._new_token()
            dmb.refs = 1
            dmb.registered = True
            dmb.accessors.add(uid)
            self._by_token[dmb.token] = dmb
            size = dmb.size
            self._in_use_bytes += size
            self._in_use_buffers += 1
            self._user_bytes[uid] = self._user_bytes.get(uid, 0) + size
            self._user_buffers[uid] = self._user_buffers.get(uid, 0) + 1
            return dmb
        assert last is not None
        raise last

    def _check_limits(self, uid: int, comp: int) -> None:
        size = SMC_BUF_MIN << comp  # decompress(comp): comp is one of the pool's classes
        if self.user_max_buffers and self._user_buffers.get(uid, 0) >= self.user_max_buffers:
            raise DmbLimitError(
                f"uid {uid} already owns {self.user_max_buffers} DMBs (quota.connections)",
                limit="user-connections",
                uid=uid,
            )
        if self.user_max_bytes and self._user_bytes.get(uid, 0) + size > self.user_max_bytes:
            raise DmbLimitError(
                f"uid {uid} would own more than {self.user_max_bytes} bytes of DMBs "
                "(quota.buffer_bytes)",
                limit="user-bytes",
                uid=uid,
            )
        if self._in_use_buffers >= self.pool_max_buffers:
            raise DmbLimitError(
                f"the pool already has {self.pool_max_buffers} DMBs in use "
                "(buffers.pool_max_buffers)",
                limit="pool-buffers",
                uid=uid,
            )
        if self._in_use_bytes + size > self.pool_max_bytes:
            raise DmbLimitError(
                f"DMBs in use would exceed {self.pool_max_bytes} bytes (buffers.pool_max_bytes)",
                limit="pool-bytes",
                uid=uid,
            )

    def _take(self, uid: int, comp: int) -> Dmb:
        free = self._free[comp]
        for i in range(len(free) - 1, -1, -1):
            dmb = free[i]
            if dmb.accessors <= {uid}:
                del free[i]  # zeroed when it came back (see _put)
                self._reuses += 1
                return dmb
        # Need a fresh memfd: make room among cached free buffers first.
        size = decompress(comp)
        self._evict_until(self.pool_max_bytes - size)
        dmb = self._create(comp)
        self._fresh += 1
        return dmb

    def _evict_until(self, budget: int) -> None:
        """Close cached free buffers (largest first) until all memfds fit in ``budget`` bytes."""
        if self.allocated_bytes <= budget:
            return
        for comp in range(SMCD_DMBE_SIZES, -1, -1):
            free = self._free[comp]
            while free and self.allocated_bytes > budget:
                self._destroy(free.pop(0))

    def _create(self, comp: int) -> Dmb:
        size = decompress(comp)
        try:
            fd = os.memfd_create(f"smcd-dmb-{size >> 10}k", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        except OSError as exc:
            raise DmbMemoryError(f"memfd_create failed: {exc}") from exc
        try:
            os.ftruncate(fd, size + CTRL_LEN)
            fcntl.fcntl(
                fd,
                fcntl.F_ADD_SEALS,
                fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL,
            )
            inode = os.fstat(fd).st_ino
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.ENOMEM, errno.ENOSPC, errno.EFBIG):
                raise DmbMemoryError(f"sizing the memfd to {size} bytes failed: {exc}") from exc
            raise
        dmb = Dmb(fd=fd, size_comp=comp, inode=inode)
        self._all.add(dmb)
        self._allocated_bytes += size
        return dmb

    def _destroy(self, dmb: Dmb) -> None:
        if dmb not in self._all:
            return  # closed already (the pool was closed while it was in use)
        self._all.discard(dmb)
        self._allocated_bytes -= dmb.size
        if self.on_destroy is not None:
            self.on_destroy(dmb.fd)
        os.close(dmb.fd)
        dmb.fd = -1

    def _new_token(self) -> int:
        for _ in range(64):
            token = self._token_source() & 0xFFFFFFFFFFFFFFFF
            if token and token not in self._by_token:
                return token
        raise DmbMemoryError("could not draw a unique DMB token")  # a broken token source

    # ---- references ---------------------------------------------------------------------------

    def get(self, token: int) -> Dmb:
        """The live DMB for ``token`` (registered or still attached by someone)."""
        try:
            return self._by_token[token]
        except (KeyError, TypeError):
            raise UnknownTokenError(f"no DMB with token {token!r}") from None

    def attach(self, token: int, uid: int) -> Dmb:
        """Take a reference on a *registered* DMB for a peer of uid ``uid`` (loopback-ism's
        ``attach_dmb``): the peer may now map it and write into it."""
        dmb = self.get(token)
        if not dmb.registered:
            raise UnknownTokenError(f"DMB {token:#x} was unregistered by its owner")
        dmb.refs += 1
        dmb.accessors.add(uid)
        return dmb

    def detach(self, token: int) -> None:
        """Drop an attacher's reference."""
        dmb = self.get(token)
        if dmb.refs <= (1 if dmb.registered else 0):
            raise UnknownTokenError(f"DMB {token:#x} has no attacher to detach")
        self._put(dmb)

    def unregister(self, token: int) -> None:
        """The owner lets go: the token no longer attaches; the buffer returns to the pool once
        every attacher has detached too."""
        dmb = self.get(token)
        if not dmb.registered:
            raise UnknownTokenError(f"DMB {token:#x} is already unregistered")
        dmb.registered = False
        self._put(dmb)

    def _put(self, dmb: Dmb) -> None:
        dmb.refs -= 1
        if dmb.refs > 0:
            return
        del self._by_token[dmb.token]
        self._in_use_bytes -= dmb.size
        self._in_use_buffers -= 1
        uid = dmb.owner_uid
        self._user_bytes[uid] -= dmb.size
        self._user_buffers[uid] -= 1
        if not self._user_buffers[uid]:
            del self._user_bytes[uid], self._user_buffers[uid]
        dmb.token = 0
        dmb.owner_uid = -1
        if self._closed or len(dmb.accessors) > 1:
            # Shared with another uid: no owner can ever safely get it back (module docstring).
            self._destroy(dmb)
            return
        # Zeroed now, when both ends have let go, rather than when it is handed out again: the
        # work stays off the next handshake and the pages go back to the system meanwhile.
        t0 = time.perf_counter()
        try:
            _zero(dmb.fd, dmb.file_size)
        except OSError:
            self._destroy(dmb)  # cannot be made clean: never hand it out again
            return
        self.last_zero_seconds = time.perf_counter() - t0
        self._zeroings += 1
        self._free[dmb.size_comp].append(dmb)

    # ---- buffers held elsewhere --------------------------------------------------------------

    def charge(self, uid: int, size: int) -> None:
        """Count a DMB of ``uid`` that the pool does not hold against ``uid``'s quota: a channel
        a previous daemon made, resumed after a restart, whose memory the applications map.
        Raises :class:`DmbLimitError` past a per-user limit (the pool's own limits do not
        apply: the memory is not the pool's)."""
        if self.user_max_buffers and self._user_buffers.get(uid, 0) >= self.user_max_buffers:
            raise DmbLimitError(
                f"uid {uid} already owns {self.user_max_buffers} DMBs (quota.connections)",
                limit="user-connections",
                uid=uid,
            )
        if self.user_max_bytes and self._user_bytes.get(uid, 0) + size > self.user_max_bytes:
            raise DmbLimitError(
                f"uid {uid} would own more than {self.user_max_bytes} bytes of DMBs "
                "(quota.buffer_bytes)",
                limit="user-bytes",
                uid=uid,
            )
        self._user_bytes[uid] = self._user_bytes.get(uid, 0) + size
        self._user_buffers[uid] = self._user_buffers.get(uid, 0) + 1

    def discharge(self, uid: int, size: int) -> None:
        """A buffer charged to ``uid`` (:meth:`charge`) is gone."""
        left = self._user_buffers.get(uid, 0) - 1
        if left > 0:
            self._user_buffers[uid] = left
            self._user_bytes[uid] = max(0, self._user_bytes.get(uid, 0) - size)
        else:
            self._user_buffers.pop(uid, None)
            self._user_bytes.pop(uid, None)

    # ---- accounting ---------------------------------------------------------------------------

    @property
    def allocated_bytes(self) -> int:
        """DMB bytes of every memfd the pool holds (in use or cached)."""
        return self._allocated_bytes

    @property
    def in_use_bytes(self) -> int:
        return self._in_use_bytes

    @property
    def in_use_buffers(self) -> int:
        return self._in_use_buffers

    def user_usage(self, uid: int) -> UserUsage:
        return UserUsage(uid, self._user_bytes.get(uid, 0), self._user_buffers.get(uid, 0))

    def stats(self) -> PoolStats:
        classes = []
        for comp in range(self.min_comp, self.max_comp + 1):
            members = [d for d in self._all if d.size_comp == comp]
            used = sum(1 for d in members if d.in_use)
            classes.append(ClassStats(decompress(comp), len(members), used, len(members) - used))
        users = tuple(self.user_usage(uid) for uid in sorted(self._user_buffers))
        return PoolStats(
            allocated_bytes=self.allocated_bytes,
            in_use_bytes=self.in_use_bytes,
            allocated_buffers=len(self._all),
            in_use_buffers=self.in_use_buffers,
            classes=tuple(classes),
            users=users,
            zeroings=self._zeroings,
            fresh_memfds=self._fresh,
            reuses=self._reuses,
        )

    def trim(self) -> int:
        """Close every cached free buffer; return how many."""
        n = 0
        for free in self._free.values():
            while free:
                self._destroy(free.pop())
                n += 1
        return n

    def close(self) -> None:
        """Close every memfd the pool holds, cached or in use (the daemon is going away: the
        applications keep their own duplicates and mappings, so their channels go on). No
        buffer can be registered afterwards; releasing one that was in use stays harmless."""
        self._closed = True
        self.trim()
        for dmb in list(self._all):
            self._destroy(dmb)

    def _check_open(self) -> None:
        if self._closed:
            raise DmbMemoryError("the DMB pool is closed")
