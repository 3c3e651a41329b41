"""Buffers held outside the pool (a resumed channel's DMBs) count against the user's quota."""

from __future__ import annotations

import pytest

from smcd_daemon.core.buffers import DmbLimitError, DmbPool


def test_charged_buffers_count_against_the_quota_and_are_given_back() -> None:
    pool = DmbPool(user_max_buffers=2, user_max_bytes=1 << 20)
    pool.charge(1000, 65536)
    pool.charge(1000, 65536)
    assert pool.user_usage(1000).buffers == 2 and pool.user_usage(1000).bytes == 131072
    with pytest.raises(DmbLimitError, match=r"quota\.connections"):
        pool.charge(1000, 65536)
    with pytest.raises(DmbLimitError, match=r"quota\.connections"):
        pool.register(1000, 65536)  # the pool's own DMBs see the charge too
    pool.charge(0, 16384)  # another user is not affected
    pool.discharge(1000, 65536)
    dmb = pool.register(1000, 65536)
    assert pool.user_usage(1000).buffers == 2
    pool.unregister(dmb.token)
    pool.discharge(1000, 65536)
    assert pool.user_usage(1000).buffers == 0 and pool.user_usage(1000).bytes == 0
    with pytest.raises(DmbLimitError, match=r"quota\.buffer_bytes"):
        DmbPool(user_max_bytes=100_000).charge(5, 131072)
    pool.close()
