"""Same-host pairs in the daemon's event loop: a client half proposes only once the server half
is in the daemon (marking the pair proposed, so the server waits for that Proposal), falls back
without proposing when the server half fell back first or never comes, and forgets what it
waited for; a late client half reads how the server half ended."""

from __future__ import annotations

import asyncio
import ipaddress

import pytest

from smcd_daemon.adapters.handoff.arrivals import Arrivals
from smcd_daemon.core.handoff_pairs import PairKey

A = ipaddress.ip_address("127.0.0.1")
KEY: PairKey = ((A, 40000, 0), (A, 8080, 0))


def test_client_waits_for_the_server_half_then_marks_the_pair_proposed() -> None:
    async def run() -> None:
        arr = Arrivals()
        waiting = asyncio.create_task(arr.wait_server(KEY, 5.0))
        await asyncio.sleep(0.05)
        assert not waiting.done() and not arr.proposed(KEY)
        arr.server_in(KEY)
        assert await waiting is None
        assert arr.proposed(KEY)  # the server's peek must now wait for the Proposal
        arr.server_gone(KEY, fell_back=False)
        assert not arr.proposed(KEY) and len(arr) == 0  # forgotten: the 4-tuple may come again
        # a later connection on the same 4-tuple waits for its own server half
        later = asyncio.create_task(arr.wait_server(KEY, 5.0))
        await asyncio.sleep(0.05)
        assert not later.done()
        arr.server_in(KEY)
        assert await later is None

    asyncio.run(run())


def test_server_here_first_and_a_server_that_fell_back() -> None:
    async def run() -> None:
        arr = Arrivals()
        arr.server_in(KEY)
        assert await arr.wait_server(KEY, 0.1) is None
        other: PairKey = ((A, 40001, 0), (A, 8080, 0))
        arr.server_in(other)
        arr.server_gone(other, fell_back=True, why="no CLC Proposal within 1 s")
        why = await arr.wait_server(other, 5.0)
        assert why is not None and "fell back" in why and "no CLC Proposal" in why
        # a waiting client learns it at once
        third: PairKey = ((A, 40002, 0), (A, 8080, 0))
        waiting = asyncio.create_task(arr.wait_server(third, 5.0))
        await asyncio.sleep(0.05)
        arr.server_gone(third, fell_back=True, why="DAEMON_BUSY")
        why = await asyncio.wait_for(waiting, 1.0)
        assert why is not None and "DAEMON_BUSY" in why

    asyncio.run(run())


def test_a_server_half_that_never_comes_is_not_waited_for_forever_nor_remembered() -> None:
    async def run() -> None:
        arr = Arrivals()
        why = await arr.wait_server(KEY, 0.2)
        assert why is not None and "within 0.2 s (timeouts.clc_wait)" in why
        assert len(arr) == 0
        task = asyncio.create_task(arr.wait_server(KEY, 5.0))
        await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert len(arr) == 0

    asyncio.run(run())


def test_fell_back_entries_expire_oldest_first_and_the_table_stays_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from smcd_daemon.adapters.handoff import arrivals

    monkeypatch.setattr(arrivals, "MAX_ENTRIES", 8)
    arr = Arrivals()
    keys = [(i, i + 1) for i in range(20)]
    for key in keys:
        arr.server_gone(key, fell_back=True, why="plain TCP")
    assert len(arr) == 8  # the oldest went first
    assert [k for k in keys if arr.proposed(k)] == []
    monkeypatch.setattr(arrivals.time, "monotonic", lambda: 1e12)  # KEEP passed for all
    arr.server_in((99, 100))  # expiry runs: every fallen-back entry goes, the new one stays
    assert len(arr) == 1


def test_server_gone_says_whether_it_told_a_waiting_client_half() -> None:
    """A refused server half skips its wait for a Proposal exactly when our own client half
    was parked for it (told now, it sends no CLC byte); a client half not here yet, or one
    past waiting, may still have something on the wire."""

    async def run() -> None:
        arr = Arrivals()
        waiting = asyncio.create_task(arr.wait_server(KEY, 5.0))
        await asyncio.sleep(0.05)
        assert arr.server_gone(KEY, fell_back=True, why="DAEMON_BUSY") is True
        why = await asyncio.wait_for(waiting, 1.0)
        assert why is not None and "fell back" in why
        # nobody parked: a client half arriving later reads FELL_BACK, but nothing was told now
        other: PairKey = ((A, 40003, 0), (A, 8080, 0))
        assert arr.server_gone(other, fell_back=True, why="DAEMON_BUSY") is False
        assert "fell back" in (await arr.wait_server(other, 0.1) or "")
        # a server half that ends otherwise tells no one (nothing parked either)
        third: PairKey = ((A, 40004, 0), (A, 8080, 0))
        arr.server_in(third)
        assert arr.server_gone(third, fell_back=False) is False

    asyncio.run(run())


def test_a_client_half_reading_the_fall_back_ends_its_refused_server_halfs_wait() -> None:
    """The server half fell back before its client half came (no one was told): the refused
    server half's wait for CLC ends when a client half of ours reads that, not before."""

    async def run() -> None:
        arr = Arrivals()
        assert arr.heard(KEY) is None  # nothing fell back: nothing to hear
        assert arr.server_gone(KEY, fell_back=True, why="a cap") is False
        heard = arr.heard(KEY)
        assert heard is not None
        await asyncio.sleep(0.05)
        assert not heard.done()
        why = await arr.wait_server(KEY, 5.0)
        assert why is not None and "fell back" in why and "a cap" in why
        assert heard.done() and not heard.cancelled()
        # a server half whose client is not ours hears nothing until its own wait ends
        other: PairKey = ((A, 40001, 0), (A, 8080, 0))
        arr.server_gone(other, fell_back=True)
        lonely = arr.heard(other)
        assert lonely is not None
        await asyncio.sleep(0.05)
        assert not lonely.done()
        lonely.cancel()  # as decline_proposal does when its look ends first

    asyncio.run(run())


def test_a_client_half_that_will_not_propose_after_all_unmarks_the_pair() -> None:
    """Paired, then its application hung up: the server half must not wait for its Proposal
    (``timeouts.clc_wait``), only for the silence of a local client."""

    async def run() -> None:
        arr = Arrivals()
        waiting = asyncio.create_task(arr.wait_server(KEY, 5.0))
        await asyncio.sleep(0)
        arr.server_in(KEY)
        assert await waiting is None and arr.proposed(KEY)
        arr.unpropose(KEY)
        assert not arr.proposed(KEY)
        arr.unpropose(KEY)  # (nothing to undo: no change)
        assert not arr.proposed(KEY)
        arr.server_gone(KEY, fell_back=True, why="no Proposal")
        arr.unpropose(KEY)  # a fallen-back pair stays fallen back for a late client half
        assert await arr.wait_server(KEY, 1.0) is not None

    asyncio.run(run())


def test_a_stopping_daemon_sends_its_waiting_client_halves_back_at_once() -> None:
    """No server half will be served once the daemon stops: a client half waiting for one falls
    back now, before any CLC byte, instead of holding the stop up for ``clc_wait``."""

    async def run() -> None:
        arr = Arrivals()
        waiting = asyncio.create_task(arr.wait_server(KEY, 30.0))
        other: PairKey = ((A, 40001, 0), (A, 8080, 0))
        arr.server_in(other)  # a server half peeking: not a waiting client half
        await asyncio.sleep(0.05)
        assert arr.stopping("smcd is stopping") == 1
        why = await asyncio.wait_for(waiting, 1.0)
        assert why is not None and "fell back" in why and "smcd is stopping" in why
        assert await arr.wait_server(other, 0.1) is None  # the peeking one still pairs
        assert arr.stopping("again") == 0

    asyncio.run(run())
