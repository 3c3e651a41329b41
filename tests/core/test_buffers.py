"""The DMB pool with real memfds: size classes, tokens, refcounts, reuse, zeroing, limits."""

from __future__ import annotations

import errno
import mmap
import os

import pytest

from smc_handoff import layout
from smcd_daemon.config import Config
from smcd_daemon.core.buffers import (
    CTRL_LEN,
    SMC_BUF_MIN,
    DmbLimitError,
    DmbMemoryError,
    DmbPool,
    UnknownTokenError,
    compress_size,
    decompress,
)
from smcd_daemon.wire.reasons import DeclineReason

KIB = 1024


@pytest.mark.parametrize(
    ("size", "comp"),
    [
        (-5, 0),
        (0, 0),
        (1, 0),
        (16 * KIB, 0),
        (16 * KIB + 1, 1),
        (32 * KIB, 1),
        (32 * KIB + 1, 2),
        (64 * KIB, 2),
        (1024 * KIB, 6),
        (1024 * KIB + 1, 6),  # capped at SMCD_DMBE_SIZES
        (64 << 20, 6),
    ],
)
def test_compress_size_matches_the_kernel(size: int, comp: int) -> None:
    assert compress_size(size) == comp
    # the kernel formula: min(ilog2((size - 1) >> 14) + 1, 6) above 16 KiB
    if size > SMC_BUF_MIN:
        assert comp == min(((size - 1) >> 14).bit_length(), 6)


def test_decompress_is_the_inverse_on_classes() -> None:
    for n in range(7):
        assert decompress(n) == 16 * KIB << n
        assert compress_size(decompress(n)) == n
    assert decompress(15) == 512 << 20
    with pytest.raises(ValueError):
        decompress(16)


def _read(fd: int, size: int) -> bytes:
    return os.pread(fd, size, 0)


def test_register_gives_a_sealed_memfd_of_the_class_size() -> None:
    pool = DmbPool()
    dmb = pool.register(1000, 40 * KIB)
    try:
        assert dmb.size == 64 * KIB and dmb.size_comp == 2
        # the DMB and the channel's control trailer, exactly what smc_handoff maps
        assert CTRL_LEN == layout.CTRL_LEN == 128
        assert os.fstat(dmb.fd).st_size == dmb.file_size == 64 * KIB + CTRL_LEN
        assert dmb.ring_size == 64 * KIB - 32
        with pytest.raises(OSError) as info:
            os.ftruncate(dmb.fd, 4096)  # F_SEAL_SHRINK
        assert info.value.errno == errno.EPERM
        with pytest.raises(OSError):
            os.ftruncate(dmb.fd, 128 * KIB)  # F_SEAL_GROW
        # both ends map it read-write, as the channel does (header, ring and trailer)
        with layout.map_dmb(dmb.fd, dmb.size) as m:
            m[:5] = b"hello"
            m[dmb.size + CTRL_LEN - 1] = 0x5A  # the last trailer byte
        assert _read(dmb.fd, 5) == b"hello"
        with mmap.mmap(dmb.fd, dmb.size):
            pass  # a mapping of the DMB proper only is fine too
    finally:
        pool.unregister(dmb.token)
        pool.close()


def test_sizes_are_clamped_to_the_configured_range() -> None:
    pool = DmbPool(min_size=32 * KIB, max_size=256 * KIB)
    small = pool.register(1, 1)
    big = pool.register(1, 4 << 20)
    assert small.size == 32 * KIB
    assert big.size == 256 * KIB
    pool.close()
    with pytest.raises(ValueError):
        DmbPool(min_size=20 * KIB)


def test_tokens_are_unique_nonzero_and_retry_on_collision() -> None:
    drawn = iter([0, 7, 7, 7, 9, 1 << 64 | 11])
    pool = DmbPool(token_source=lambda: next(drawn))
    a = pool.register(1, SMC_BUF_MIN)
    b = pool.register(1, SMC_BUF_MIN)
    c = pool.register(1, SMC_BUF_MIN)
    assert (a.token, b.token, c.token) == (7, 9, 11)  # 0 skipped, collisions redrawn, 64 bits

    pool.close()

    pool = DmbPool(user_max_buffers=0, pool_max_buffers=2000, pool_max_bytes=64 << 20)
    tokens = {pool.register(1, SMC_BUF_MIN).token for _ in range(1000)}
    assert len(tokens) == 1000 and 0 not in tokens
    assert all(0 < t < 1 << 64 for t in tokens)
    pool.close()


def test_close_closes_every_memfd_and_late_releases_are_harmless() -> None:
    before = len(os.listdir("/proc/self/fd"))
    pool = DmbPool(user_max_buffers=0)
    held = [pool.register(1, SMC_BUF_MIN) for _ in range(50)]
    pool.attach(held[0].token, 2)
    freed = pool.register(1, SMC_BUF_MIN)
    pool.unregister(freed.token)  # cached
    assert len(os.listdir("/proc/self/fd")) == before + 51
    pool.close()
    assert len(os.listdir("/proc/self/fd")) == before  # in use or cached: all closed
    stats = pool.stats()
    assert (stats.allocated_buffers, stats.allocated_bytes) == (0, 0)
    pool.detach(held[0].token)  # the daemon's halves let go after the pool closed
    for dmb in held:
        pool.unregister(dmb.token)
    assert pool.in_use_buffers == pool.in_use_bytes == 0
    with pytest.raises(DmbMemoryError):
        pool.register(1, SMC_BUF_MIN)


def test_running_totals_match_the_buffers() -> None:
    pool = DmbPool(user_max_buffers=0, user_max_bytes=0)
    live = []
    for i in range(40):
        live.append(pool.register(i % 3, SMC_BUF_MIN << (i % 4)))
        if i % 5 == 4:
            pool.unregister(live.pop(0).token)
    for dmb in live[::2]:
        pool.attach(dmb.token, 99)
        pool.unregister(dmb.token)
    stats = pool.stats()
    assert stats.in_use_bytes == sum(c.size * c.in_use for c in stats.classes)
    assert stats.in_use_buffers == sum(c.in_use for c in stats.classes)
    assert stats.allocated_bytes == sum(c.size * c.allocated for c in stats.classes)
    assert stats.in_use_buffers == len(live)  # the attached ones are still referenced
    pool.close()


def test_buffer_returns_only_when_owner_and_attacher_let_go() -> None:
    pool = DmbPool()
    dmb = pool.register(1000, SMC_BUF_MIN)
    token = dmb.token
    pool.attach(token, 1000)
    assert dmb.refs == 2
    pool.unregister(token)  # the owner goes first
    assert pool.get(token) is dmb and pool.in_use_buffers == 1
    with pytest.raises(UnknownTokenError):
        pool.attach(token, 1000)  # unregistered: no new attachers
    pool.detach(token)  # the last reference
    with pytest.raises(UnknownTokenError):
        pool.get(token)
    assert pool.in_use_buffers == 0 and pool.stats().classes[0].free == 1

    # the other order: the attacher goes first
    dmb = pool.register(1000, SMC_BUF_MIN)
    pool.attach(dmb.token, 1000)
    pool.detach(dmb.token)
    assert pool.get(dmb.token) is dmb
    with pytest.raises(UnknownTokenError):
        pool.detach(dmb.token)  # only the owner's reference is left
    pool.unregister(dmb.token)
    assert pool.in_use_buffers == 0
    with pytest.raises(UnknownTokenError):
        pool.unregister(dmb.token)
    pool.close()


def test_same_user_reuse_gets_the_same_memfd_zeroed() -> None:
    pool = DmbPool()
    first = pool.register(1000, 64 * KIB)
    inode, fd, token = first.inode, first.fd, first.token
    os.pwrite(fd, b"\xab" * first.file_size, 0)  # data, header and wakeup words
    pool.unregister(token)
    # zeroed as it came back (off the next handshake), its pages given back meanwhile
    assert pool.stats().zeroings == 1 and _read(fd, first.file_size) == bytes(first.file_size)
    again = pool.register(1000, 64 * KIB)
    assert again.inode == inode and again.fd == fd  # reused, not recreated
    assert again.token != token  # a fresh token for the new connection
    assert _read(again.fd, again.file_size) == bytes(again.file_size)  # trailer zeroed too
    stats = pool.stats()
    assert (stats.reuses, stats.zeroings, stats.fresh_memfds) == (1, 1, 1)
    assert pool.last_zero_seconds < 0.05
    pool.close()


def test_another_user_never_sees_a_previous_users_bytes() -> None:
    pool = DmbPool()
    a = pool.register(1000, 64 * KIB)
    a_inode = a.inode
    os.pwrite(a.fd, b"secret of uid 1000" * 100, 0)
    pool.unregister(a.token)
    b = pool.register(2000, 64 * KIB)
    assert _read(b.fd, b.size) == bytes(b.size)
    assert b.inode != a_inode  # uid 2000 gets a fresh memfd; uid 1000's stays cached for uid 1000
    again = pool.register(1000, 64 * KIB)
    assert again.inode == a_inode and _read(again.fd, again.size) == bytes(again.size)
    pool.close()


def test_a_buffer_shared_with_another_uid_is_never_reused() -> None:
    pool = DmbPool()
    dmb = pool.register(1000, SMC_BUF_MIN)
    fd = dmb.fd
    pool.attach(dmb.token, 2000)  # the peer application of another user mapped it
    pool.detach(dmb.token)
    pool.unregister(dmb.token)
    with pytest.raises(OSError):
        os.fstat(fd)  # closed: uid 2000 may still map it, so nobody may get it back
    assert pool.stats().allocated_buffers == 0
    fresh = pool.register(1000, SMC_BUF_MIN)
    assert pool.stats().reuses == 0 and fresh.refs == 1
    pool.close()


def test_user_byte_quota_downgrades_then_refuses_with_max_dmb() -> None:
    pool = DmbPool(user_max_bytes=160 * KIB, user_max_buffers=0)
    pool.register(7, 64 * KIB)
    pool.register(7, 64 * KIB)
    third = pool.register(7, 64 * KIB)  # 32 KiB left: the kernel's downgrade loop
    assert third.size == 32 * KIB
    with pytest.raises(DmbLimitError) as info:
        pool.register(7, 64 * KIB)
    assert info.value.limit == "user-bytes" and info.value.uid == 7
    assert info.value.decline_reason == DeclineReason.MAX_DMB == 0x030D0000
    with pytest.raises(DmbLimitError):
        pool.register(7, 64 * KIB, min_size=64 * KIB)  # no downgrade below min_size
    other = pool.register(8, 64 * KIB)  # quotas are per user
    assert other.size == 64 * KIB
    usage = {u.uid: (u.bytes, u.buffers) for u in pool.stats().users}
    assert usage == {7: (160 * KIB, 3), 8: (64 * KIB, 1)}
    pool.close()


def test_user_connection_quota() -> None:
    pool = DmbPool(user_max_buffers=2)
    tokens = [pool.register(5, SMC_BUF_MIN).token for _ in range(2)]
    with pytest.raises(DmbLimitError) as info:
        pool.register(5, SMC_BUF_MIN)
    assert info.value.limit == "user-connections"
    pool.unregister(tokens[0])
    pool.register(5, SMC_BUF_MIN)  # a released buffer frees the slot
    pool.close()


def test_pool_limits_and_eviction_of_cached_buffers() -> None:
    pool = DmbPool(pool_max_buffers=3, pool_max_bytes=1 << 20, user_max_bytes=0)
    held = [pool.register(u, SMC_BUF_MIN) for u in (1, 2, 3)]
    with pytest.raises(DmbLimitError) as info:
        pool.register(4, SMC_BUF_MIN)
    assert info.value.limit == "pool-buffers"
    for dmb in held:
        pool.unregister(dmb.token)
    assert pool.stats().allocated_buffers == 3  # cached for their users

    # 1 MiB needs every byte: the cached free buffers are evicted to make room
    big = pool.register(9, 1 << 20)
    stats = pool.stats()
    assert big.size == 1 << 20 and stats.allocated_buffers == 1
    assert stats.allocated_bytes == stats.in_use_bytes == 1 << 20
    with pytest.raises(DmbLimitError) as info:
        pool.register(10, SMC_BUF_MIN)
    assert info.value.limit == "pool-bytes"
    pool.close()


def test_stats_per_class() -> None:
    pool = DmbPool(min_size=16 * KIB, max_size=64 * KIB)
    a = pool.register(1, 16 * KIB)
    pool.register(1, 64 * KIB)
    pool.unregister(a.token)
    classes = {c.size: (c.allocated, c.in_use, c.free) for c in pool.stats().classes}
    assert classes == {16 * KIB: (1, 0, 1), 32 * KIB: (0, 0, 0), 64 * KIB: (1, 1, 0)}
    assert pool.trim() == 1
    pool.close()


def test_from_config_uses_buffers_and_quota_sections() -> None:
    cfg = Config.model_validate(
        {
            "buffers": {"max_dmb_size": "256K", "pool_max_buffers": 10},
            "quota": {"buffer_bytes": "1M", "connections": 3},
        }
    )
    pool = DmbPool.from_config(cfg)
    assert (pool.max_comp, pool.pool_max_buffers) == (4, 10)
    assert (pool.user_max_bytes, pool.user_max_buffers) == (1 << 20, 3)
    assert pool.register(1, 1 << 20).size == 256 * KIB
    pool.close()


def test_on_destroy_sees_each_memfd_once_while_it_is_still_open() -> None:
    """The hook an adapter keeps per-memfd state by (the handoff server's header mappings):
    called for a cached buffer that is trimmed and for in-use ones at close, never for a reuse."""
    pool = DmbPool(user_max_buffers=0)
    seen: list[tuple[int, int]] = []
    pool.on_destroy = lambda fd: seen.append((fd, os.fstat(fd).st_size))  # still open here
    a = pool.register(1, SMC_BUF_MIN)
    fd_a = a.fd
    pool.unregister(a.token)  # cached, not destroyed
    again = pool.register(1, SMC_BUF_MIN)
    assert again.fd == fd_a and seen == []  # a reuse keeps the memfd (and its state)
    pool.unregister(again.token)
    assert pool.trim() == 1
    assert [fd for fd, _ in seen] == [fd_a] and seen[0][1] == SMC_BUF_MIN + CTRL_LEN
    fd_b = pool.register(1, SMC_BUF_MIN).fd
    pool.close()
    assert [fd for fd, _ in seen] == [fd_a, fd_b]
    with pytest.raises(OSError):
        os.fstat(fd_b)  # closed right after the hook
