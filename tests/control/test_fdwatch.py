"""The handoff path's epoll watch (``smcd_daemon.adapters.fdwatch``): real sockets, a real loop."""

from __future__ import annotations

import asyncio
import socket

import pytest

from smcd_daemon.adapters.fdwatch import FdWatch, fd_watch


def test_readable_callbacks_level_triggered_until_removed() -> None:
    async def main() -> None:
        watch = fd_watch()
        assert fd_watch() is watch  # one per loop
        a, b = socket.socketpair()
        calls: list[bytes] = []
        got = asyncio.Event()

        def on_readable() -> None:
            calls.append(b.recv(1, socket.MSG_DONTWAIT))  # one byte per call: level-triggered
            if len(calls) == 3:
                got.set()

        watch.add(b.fileno(), on_readable)
        assert b.fileno() in watch
        a.send(b"xyz")
        await asyncio.wait_for(got.wait(), 5)
        assert calls == [b"x", b"y", b"z"]
        watch.remove(b.fileno())
        watch.remove(b.fileno())  # twice: a no-op
        a.send(b"!")
        await asyncio.sleep(0.05)
        assert calls == [b"x", b"y", b"z"]  # not watched any more
        a.close()
        b.close()

    asyncio.run(main())


def test_a_callback_removed_or_replaced_in_the_same_batch_does_not_run() -> None:
    async def main() -> None:
        watch = FdWatch(asyncio.get_running_loop())
        pairs = [socket.socketpair() for _ in range(2)]
        (a1, b1), (a2, b2) = pairs
        ran: list[str] = []
        done = asyncio.Event()

        def first() -> None:
            ran.append("first")
            b1.recv(16)
            # whichever runs first takes the other one out: it must not run in this batch
            watch.remove(b2.fileno())
            watch.add(b2.fileno(), replacement)
            loop.call_later(0.05, done.set)

        def second() -> None:
            ran.append("second")
            b2.recv(16)
            watch.remove(b1.fileno())
            loop.call_later(0.05, done.set)

        def replacement() -> None:
            ran.append("replacement")
            b2.recv(16)

        loop = asyncio.get_running_loop()
        watch.add(b1.fileno(), first)
        watch.add(b2.fileno(), second)
        a1.send(b"1")
        a2.send(b"2")
        await asyncio.wait_for(done.wait(), 5)
        # one of them ran, and never the one it took out in the same batch
        assert ran in (["first", "replacement"], ["second"]), ran
        watch.remove(b1.fileno())
        watch.remove(b2.fileno())
        watch.close()
        for s in (a1, b1, a2, b2):
            s.close()

    asyncio.run(main())


def test_a_failing_callback_is_logged_and_the_watch_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def main() -> None:
        watch = fd_watch()
        a, b = socket.socketpair()
        seen = asyncio.Event()

        def broken() -> None:
            b.recv(16)
            raise RuntimeError("boom")

        def fine() -> None:
            b.recv(16)
            seen.set()

        watch.add(b.fileno(), broken)
        a.send(b"1")
        await asyncio.sleep(0.05)
        watch.add(b.fileno(), fine)  # re-adding replaces the callback
        a.send(b"2")
        await asyncio.wait_for(seen.wait(), 5)
        watch.remove(b.fileno())
        a.close()
        b.close()

    asyncio.run(main())
    assert "callback for fd" in caplog.text
