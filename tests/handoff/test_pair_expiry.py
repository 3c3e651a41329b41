"""A pair whose second half never comes is dropped by the handoff server's tick (no timer per
connection): its shared descriptors are closed, and a pair that completed is never dropped."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from smcd_daemon.adapters.handoff import HandoffServer
from smcd_daemon.core.registry import ConnRole

KEY_LATE = (1111, 2222)
KEY_DONE = (3333, 4444)


def fd_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def test_a_pair_without_its_second_half_is_dropped_when_due(tmp_path: Path) -> None:
    async def main() -> None:
        srv = HandoffServer.bind(tmp_path / "handoff.sock")
        srv.start()
        try:
            ch = srv.channels
            late = [srv.pool.register(1000, 65536).token for _ in range(2)]
            done = [srv.pool.register(1000, 65536).token for _ in range(2)]
            pair = ch._make_pair(KEY_LATE, (late[0], late[1]))
            fds = pair.res
            shared = [*fds.ev.values(), *fds.link.values()]  # type: ignore[attr-defined]
            other = ch._make_pair(KEY_DONE, (done[0], done[1]))
            ch.pairs.hand_out(other, ConnRole.CLIENT)
            ch.pairs.hand_out(other, ConnRole.SERVER)  # both halves served: complete
            assert all(fd_open(fd) for fd in shared)
            now = asyncio.get_running_loop().time()
            ch.expire(now)  # not due yet
            assert ch.pairs.get(KEY_LATE) is pair and all(fd_open(fd) for fd in shared)
            ch.expire(now + srv.cfg.timeouts.clc_wait * 2 + 2.0)
            assert ch.pairs.get(KEY_LATE) is None
            assert not any(fd_open(fd) for fd in shared)
            assert ch.pairs.get(KEY_DONE) is other  # complete: left alone
            assert not ch._waiting
        finally:
            await srv.stop()

    asyncio.run(main())
