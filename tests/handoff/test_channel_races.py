"""Races the channel must win, made deterministic where possible.

* A peer's clean close that lands between ``recv_into`` reading the flags and finding the link
  hung up is EOF (after any last data), never a reset. ``sys.setprofile`` runs the peer's close
  at exactly that point (the profiler fires when ``recv_into`` calls ``_check_link``).
* One reader thread and one writer thread on the same channel (allowed by its docstring): no
  shared poll object, and neither direction's wakeup can be swallowed by the other's drain (a
  swallowed kick costs a one-second nap, which the time bound below catches).
"""

from __future__ import annotations

import hashlib
import os
import select
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

import pytest

from smc_handoff import channel as channel_module
from smc_handoff import layout
from smc_handoff.channel import Channel, make_pair

pytestmark = pytest.mark.timeout(120)


def pair(size: int = 16 << 10) -> tuple[Channel, Channel]:
    fa, fb = make_pair(size, size)
    return Channel.from_fds(fa), Channel.from_fds(fb)


@contextmanager
def when_called(func: Callable[..., Any], action: Callable[[], None]) -> Iterator[list[int]]:
    """Run ``action`` once, on the first call of ``func`` in this thread (before its body)."""
    code = func.__code__
    fired: list[int] = []

    def prof(frame: FrameType, event: str, _arg: object) -> None:
        if event == "call" and frame.f_code is code and not fired:
            fired.append(1)
            action()

    sys.setprofile(prof)
    try:
        yield fired
    finally:
        sys.setprofile(None)


# ------------------------------------------------- clean close racing the link check


def empty_reads_until(fired: list[int], ch: Channel, buf: bytearray) -> int:
    """``recv_into`` on an empty ring until it has looked at the link (it does not on every
    empty read); the result of that read."""
    for _ in range(1000):
        n = ch.recv_into(buf)
        if fired:
            return n
        assert n == 0
    raise AssertionError("recv_into never looked at the peer link")


def test_close_between_flag_read_and_link_check_is_eof() -> None:
    a, b = pair()
    with when_called(Channel._check_link, a.close) as fired:
        n = empty_reads_until(fired, b, bytearray(10))
    assert n == 0 and b.eof and not b.aborted
    assert b.recv_into(bytearray(10)) == 0  # EOF stays EOF
    b.close()


def test_data_and_close_between_flag_read_and_link_check_are_delivered() -> None:
    a, b = pair()

    def last_words_then_close() -> None:
        assert a.send_into(b"last words") == 10
        a.close()

    buf = bytearray(64)
    with when_called(Channel._check_link, last_words_then_close) as fired:
        n = empty_reads_until(fired, b, buf)
    assert bytes(buf[:n]) == b"last words"
    assert b.recv_into(buf) == 0 and b.eof and not b.aborted
    b.close()


def test_abort_between_flag_read_and_link_check_is_a_reset() -> None:
    a, b = pair()
    with (
        when_called(Channel._check_link, a.abort) as fired,
        pytest.raises(ConnectionResetError),
    ):
        empty_reads_until(fired, b, bytearray(10))
    assert fired
    b.close()


# ------------------------------------------------- one reader + one writer thread per end


def _duplex(size: int, total: int, chunk: int) -> float:
    """Both ends send ``total`` bytes to each other, each end with a writer thread and a reader
    thread; returns the elapsed seconds after checking both digests."""
    a, b = pair(size)
    data = os.urandom(total)
    want = hashlib.sha256(data).hexdigest()
    got: dict[str, str] = {}
    errors: list[BaseException] = []

    def writer(ch: Channel) -> None:
        try:
            mv = memoryview(data)
            off = 0
            while off < total:
                n = ch.send_into(mv[off : off + chunk])
                if n:
                    off += n
                elif not ch.wait_writable(10):
                    raise TimeoutError("wait_writable")
        except BaseException as e:
            errors.append(e)

    def reader(ch: Channel, name: str) -> None:
        try:
            h = hashlib.sha256()
            buf = memoryview(bytearray(chunk + 1))
            n_got = 0
            while n_got < total:
                n = ch.recv_into(buf)
                if n:
                    h.update(buf[:n])
                    n_got += n
                elif not ch.wait_readable(10):
                    raise TimeoutError("wait_readable")
            got[name] = h.hexdigest()
        except BaseException as e:
            errors.append(e)

    threads = [
        threading.Thread(target=writer, args=(a,)),
        threading.Thread(target=writer, args=(b,)),
        threading.Thread(target=reader, args=(a, "a")),
        threading.Thread(target=reader, args=(b, "b")),
    ]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    elapsed = time.monotonic() - t0
    a.close()
    b.close()
    assert not errors, errors
    assert got == {"a": want, "b": want}
    return elapsed


@pytest.mark.parametrize("rnd", range(5))
def test_reader_and_writer_threads_share_a_channel(rnd: int) -> None:
    """2 MiB each way through a 16 KiB ring: hundreds of full/empty waits per direction, with
    the other direction's thread sleeping at the same time. Every wakeup lost to a shared poll
    object or a swallowed kick would cost a one-second nap (or raise ``concurrent poll()``)."""
    elapsed = _duplex(16 << 10, 2 << 20, 5_003 + rnd)
    assert elapsed < 8, f"{elapsed:.1f} s: wakeups were lost"


# ------------------------------------------- a request that lands as the publisher looks


def _readable(fd: int) -> bool:
    return bool(select.select([fd], [], [], 0)[0])


DATA_PATHS = {
    "send_fast": lambda a, b: a.send_into(b"x"),
    "long write": lambda a, b: a.send_into(bytes(100_000)),
    "shutdown": lambda a, b: a.shutdown_write(),
}
SPACE_PATHS = {
    "recv_fast": lambda a, b: b.recv_into(bytearray(1000)),
    "large read": lambda a, b: b.recv_into(bytearray(200_000)),
    "recv_bytes": lambda a, b: b.recv_bytes(1000),
}


@pytest.mark.parametrize("path", [*DATA_PATHS, *SPACE_PATHS])
def test_a_request_stored_as_the_publisher_looks_is_kicked(
    path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Dekker race of ``smc_handoff.layout``, publisher side: the peer's "kick me" may land
    after our cursor (or flags) store and before our load of it, and the peer's own look at
    the cursor may miss our store (TSO: it may still sit in our store buffer). Only a barrier
    between our store and our load makes our load see the request then; an event loop's
    transport sleeps in epoll with no safety net, so a miss there waited for good. The peer's
    request is stored here at our barrier, exactly where the race puts it: the kick must come."""
    a, b = pair(256 << 10)
    try:
        space = path in SPACE_PATHS
        if space:  # b has data to free room with, and a will wait for room
            assert a.send_into(bytes(100_000)) == 100_000
            b.drain_kicks(link=False)
            asker, waiter = a, a._ws
        else:
            asker, waiter = b, b._wd
        landed: list[int] = []

        def racing(real: Callable[[], Any]) -> Callable[[], None]:
            def barrier() -> None:
                real()
                if not landed:
                    landed.append(1)
                    asker._arm(waiter, False, fresh=True)  # the peer's store, without its look

            return barrier

        # The barrier is layout.fence, or inline its lock's try and release (fence_end).
        monkeypatch.setattr(channel_module, "fence", racing(layout.fence), raising=False)
        monkeypatch.setattr(channel_module, "fence_end", racing(layout.fence_end), raising=False)
        monkeypatch.setattr(layout, "fence", racing(layout.fence))
        assert not _readable(asker.event_fd())
        (SPACE_PATHS if space else DATA_PATHS)[path](a, b)
        assert landed, "the publisher looked for a request without a barrier before it"
        assert _readable(asker.event_fd()), "the request stored at the barrier got no kick"
    finally:
        a.close()
        b.close()
