"""The spin budget learns from sleeps (#10): a budget that fell below the usual wait (a cold
ring's page faults, a descheduled peer) used to halve on every wait and stay at its floor, so a
64 KiB request/response slept, and paid the peer's wakeup, on every turn. A wait whose spin gave
up but which ended within the largest budget now raises the budget to twice what it took; a
wait longer than any spin teaches nothing."""

from __future__ import annotations

import json
import os
import random
import time
from collections.abc import Iterator

import pytest

from smc_handoff import wakeup
from smc_handoff.channel import WANT_DATA, Channel, make_pair
from smc_handoff.layout import C_KICK, C_WAIT


@pytest.fixture(autouse=True)
def _no_backoff() -> Iterator[None]:
    """No spin back-off left over from another test (it is process-wide)."""
    wakeup.spin_backoff[0] = 0
    yield
    wakeup.spin_backoff[0] = 0


def _failed_spin(w: wakeup.Waiter) -> None:
    """A spin that runs out of budget: the word it watches never changes. Its yields give the
    CPU to nobody (``sched_yield`` is a no-op meanwhile): on a loaded machine another task
    would otherwise take the CPU at every yield and cut every spin short (the back-off, which
    these tests are not about). A spin cut short all the same (preempted exactly across a
    yield) is tried again."""
    words = memoryview(bytearray(8)).cast("Q")
    budget = w.spin_ns
    real_yield = os.sched_yield
    os.sched_yield = lambda: None
    try:
        for _ in range(50):
            assert not wakeup.spin(w, lambda: False, None, words, 0, 0)
            if not wakeup.spin_backoff[0]:
                return
            wakeup.spin_backoff[0] = 0
            w.spin_ns = budget
    finally:
        os.sched_yield = real_yield
    pytest.fail("every spin was cut short by another task on this CPU")


def _waiter(budget: int) -> wakeup.Waiter:
    w = wakeup.Waiter(WANT_DATA, C_WAIT, C_KICK)
    w.spin_ns = budget
    return w


def test_a_budget_at_its_floor_grows_after_a_short_sleep() -> None:
    w = _waiter(wakeup.SPIN_MIN_NS)
    _failed_spin(w)
    assert w.spin_ns == wakeup.SPIN_MIN_NS  # halved, at its floor
    assert w.since  # the wait began with that spin
    wakeup.learn(w, w.since + 30_000)  # the peer's data came 30 us later, after a sleep
    assert w.spin_ns == 60_000
    assert w.since == 0
    wakeup.learn(w, time.perf_counter_ns())  # nothing more to learn from the same wait
    assert w.spin_ns == 60_000


def test_the_budget_never_exceeds_its_maximum() -> None:
    w = _waiter(wakeup.SPIN_MIN_NS)
    _failed_spin(w)
    wakeup.learn(w, w.since + wakeup.SPIN_MAX_NS)
    assert w.spin_ns == wakeup.SPIN_MAX_NS


def test_a_wait_longer_than_any_spin_teaches_nothing() -> None:
    w = _waiter(wakeup.SPIN_MIN_NS)
    _failed_spin(w)
    wakeup.learn(w, w.since + wakeup.SPIN_MAX_NS + 1)  # an idle peer: sleeping was right
    assert w.spin_ns == wakeup.SPIN_MIN_NS


def test_a_budget_is_never_lowered_by_learning() -> None:
    w = _waiter(wakeup.SPIN_MAX_NS)
    _failed_spin(w)
    assert w.spin_ns == wakeup.SPIN_MAX_NS // 2
    wakeup.learn(w, w.since + 10_000)  # twice 10 us is below the halved budget: keep it
    assert w.spin_ns == wakeup.SPIN_MAX_NS // 2


def test_the_first_failed_spin_of_a_wait_dates_it() -> None:
    """A socket layer spins once (spin_readable) before the general wait spins again: the wait
    began with the first; a failure left over from an earlier wait is not taken for it."""
    w = _waiter(wakeup.SPIN_MIN_NS)
    _failed_spin(w)
    first = w.since
    _failed_spin(w)
    assert w.since == first
    w.since -= 10 * wakeup.SPIN_MAX_NS  # as if that failure belonged to a wait long gone
    _failed_spin(w)
    assert w.since > first


def test_a_successful_spin_ends_the_wait() -> None:
    w = _waiter(wakeup.SPIN_MIN_NS)
    _failed_spin(w)
    words = memoryview(bytearray(8)).cast("Q")
    words[0] = 1
    assert wakeup.spin(w, lambda: True, None, words, 0, 0)
    assert w.since == 0
    assert w.spin_ns > wakeup.SPIN_MIN_NS


def test_channel_wait_learns_from_data_that_came_after_the_spin() -> None:
    """The channel's own wait: its spin gave up, the data was there when it looked again (as
    after a socket layer's spin_readable): the budget grows instead of staying halved."""
    a, b = make_pair(256 << 10, 256 << 10)
    writer, reader = Channel.from_fds(a), Channel.from_fds(b)
    try:
        for _ in range(50):
            reader.spin_readable()  # nothing comes: the spin gives up, the budget halves
            if not wakeup.spin_backoff[0]:
                break
            wakeup.spin_backoff[0] = 0  # cut short by another task: again
        halved = reader.stats()["spin_budget_ns"]
        assert halved < wakeup.SPIN_START_NS
        assert writer.send_into(b"x" * 1000) == 1000
        assert reader.wait_readable(1)
        assert reader.stats()["spin_budget_ns"] > halved
        buf = bytearray(1000)
        assert reader.recv_into(buf) == 1000 and bytes(buf) == b"x" * 1000
    finally:
        writer.close()
        reader.close()


def _exactly(ch: Channel, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = ch.recv_fast(view[got:]) or ch.recv_into(view[got:])
        if n:
            got += n
        elif ch.eof:
            raise ConnectionError("early EOF")
        else:
            assert ch.wait_readable(10), "no data within 10 s"


def _sendall(ch: Channel, view: memoryview) -> None:
    while view:
        n = ch.send_into(view)
        if n:
            view = view[n:]
        else:
            assert ch.wait_writable(10), "no room within 10 s"


def test_64k_request_response_is_intact_with_bounded_wakeups() -> None:
    """64 KiB messages both ways through the default 256 KiB DMBs (a message straddles the
    ring's end every fourth turn): every byte comes back, and neither side is kicked more than
    twice per round trip (once per message, once more when a message arrives in two pieces)."""
    size, msg, rounds = 256 << 10, 64 << 10, 400
    fa, fb = make_pair(size, size)
    rd, wr = os.pipe()
    pid = os.fork()
    if pid == 0:  # the echo server
        code = 1
        try:
            os.close(rd)
            fa.close()
            ch = Channel.from_fds(fb)
            buf = memoryview(bytearray(msg))
            for _ in range(rounds):
                _exactly(ch, buf)
                _sendall(ch, buf)
            os.write(wr, json.dumps(ch.stats()["kicks_sent"]).encode())
            ch.close()
            code = 0
        finally:
            os._exit(code)
    os.close(wr)
    fb.close()
    ch = Channel.from_fds(fa)
    rng = random.Random(64)
    try:
        buf = memoryview(bytearray(msg))
        for _ in range(rounds):
            out = rng.randbytes(msg)
            _sendall(ch, memoryview(out))
            _exactly(ch, buf)
            assert buf == out
        kicks_client = ch.stats()["kicks_sent"]
        with os.fdopen(rd, "rb") as f:
            kicks_server = json.loads(f.read())
        _, status = os.waitpid(pid, 0)
        assert status == 0
        assert kicks_client <= 2 * rounds + 2  # + the close
        assert kicks_server <= 2 * rounds + 2
    finally:
        ch.close()
