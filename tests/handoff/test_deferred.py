"""Deferred bookkeeping runs in batches once its delay is over, and not in the middle of a
handshake: a delay that ends while one is in flight runs right after its reply, or at the
latest ``DEFER_LATEST`` later when handshakes keep overlapping."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest

from smcd_daemon.adapters.handoff import HandoffServer, publisher
from smcd_daemon.adapters.handoff.publisher import DEFER_DELAY


async def _turns(until: Callable[[], bool], limit: float = 5.0) -> None:
    """Let the loop run until ``until()`` holds (at most ``limit`` seconds)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit
    while not until():
        assert loop.time() < deadline
        await asyncio.sleep(DEFER_DELAY / 4)


def test_deferred_work_waits_for_the_handshake_in_flight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def main() -> None:
        srv = HandoffServer.bind(tmp_path / "handoff.sock")
        srv.start()
        ran: list[str] = []
        try:
            loop = asyncio.get_running_loop()
            # no handshake in flight: the batch runs once its delay is over
            srv.deferred.defer(ran.append, "a")
            srv.deferred.defer(ran.append, "b")
            assert ran == []
            await _turns(lambda: ran == ["a", "b"])
            # a handshake in flight when the delay ends: nothing runs until it replied
            monkeypatch.setattr(publisher, "DEFER_LATEST", 3600.0)
            assert srv.admission.begin_handshake(1000, loop.time()) is None
            srv.deferred.defer(ran.append, "c")
            await asyncio.sleep(DEFER_DELAY * 5)
            assert ran == ["a", "b"] and srv.deferred
            srv.admission.end_handshake(1000)
            srv.deferred.idle_soon()  # the handshake replied
            await _turns(lambda: ran == ["a", "b", "c"])
            # handshakes that keep overlapping hold it back DEFER_LATEST at most
            monkeypatch.setattr(publisher, "DEFER_LATEST", 0.0)
            assert srv.admission.begin_handshake(1000, loop.time()) is None
            srv.deferred.defer(ran.append, "d")
            await _turns(lambda: ran == ["a", "b", "c", "d"])
            assert srv.admission.inflight
            srv.admission.end_handshake(1000)
        finally:
            await srv.stop()

    asyncio.run(main())
