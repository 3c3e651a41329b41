"""Busy polling for the event loop: what ``net.core.busy_poll`` / ``SO_BUSY_POLL`` do for epoll,
for the SMC transports of an asyncio selector loop.

An :class:`~smc_handoff.aio_transport.SmcTransport` that finds its ring empty would ask the peer
for a kick and sleep in ``epoll`` on the channel's eventfd: every request/response round trip
then pays two wakeups across processes, as TCP does (the README's asyncio rows). A blocking
reader instead spins briefly on the peer's producer word first (:func:`smc_handoff.wakeup.spin`)
and turns around in microseconds. This module gives the event loop the same first resort:

* a transport whose read found nothing does not arm its kick at once; it joins its loop's
  *waiting* set (:meth:`BusyPollSelector.wait`);
* when the loop is about to block in ``select`` (a timeout that is not 0: no callback is ready)
  and transports are waiting, the selector looks at their channels (a load or two each), and
  when nothing came, spins on them for an adaptive budget (each transport's own, bounded as
  the blocking path's), never past the loop's own timeout (a timer due), with the blocking
  path's rules against starving anyone (:func:`smc_handoff.wakeup.spin`: a ``sched_yield``
  every few microseconds, yield first when the peer shares our CPU, no spinning for a while,
  process-wide, once a yield shows another task wants this CPU). Data there: the transports it
  came for get their read scheduled and ``select`` returns at once. The budget spent: each
  transport arms its kick as before (arm, look again, sleep: no wakeup is ever lost) and the
  real ``select`` runs with what is left of the timeout;
* a ``select`` with timeout 0 (callbacks ready) never spins (nor looks, but for transports that
  waited :data:`ZERO_LOOKS` turns, which it arms): only transports that found their ring empty
  in the last few turns of the loop are polled, once; never the idle keep-alive connections of
  a server, which wait on their kick;
* a transport whose peer shares its CPU (its spin yields first) or that waits during the spin
  back-off arms its kick at once, as without busy polling (:meth:`BusyPollSelector.bypass`).

While it spins, the loop sees no other descriptor's events (``call_soon_threadsafe`` included):
they wait for one budget at most (:data:`~smc_handoff.wakeup.SPIN_MAX_NS`), as with
``SO_BUSY_POLL``; events already there when the loop would block are taken first, without a
spin. Only the transports wait here; nothing else of the loop changes. The loop's selector is
wrapped (:class:`BusyPollSelector`, which delegates everything else to asyncio's own) the first
time an SMC transport is made on it (:func:`poller`): so loops made before or after
:func:`smc_handoff.aio_loop.install`, by ``asyncio.run`` or by uvicorn (``--loop asyncio``), and
loops of :mod:`smc_handoff.aio`'s own streams, all get it; loops without an SMC connection (and
uvloop, whose connections stay on TCP) are left untouched.

``$SMC_RUN_BUSY_POLL=0`` turns it off (read when each transport is made, as
``$SMC_RUN_DMB_SIZE``): the transports then arm their kick whenever their ring is empty.
"""

from __future__ import annotations

import os
import selectors
import time
from asyncio import selector_events
from typing import Any, Protocol

from smc_handoff.channel import Channel
from smc_handoff.wakeup import SPIN_MAX_NS, Waiter, spin, spin_backoff

__all__ = [
    "BUSY_POLL",
    "PROBE_EVERY",
    "ZERO_LOOKS",
    "BusyPollSelector",
    "Pollable",
    "busy_poll_enabled",
    "learn",
    "poller",
]

BUSY_POLL = True
"""Busy polling is on unless ``$SMC_RUN_BUSY_POLL`` is ``0`` (or ``off``/``no``/``false``)."""

ZERO_LOOKS = 16
"""Turns of the loop (``select`` calls) a transport may wait in the poll before it is armed
anyway: between a read and the next wait a program takes several turns (the protocol's
callback, the task it wakes, ``wait_for``'s own task...), and a loop that never blocks must not
keep its connections unarmed."""


PROBE_EVERY = 16
"""While a transport's peer shares its CPU (its spin yields first), one wait in this many spins;
the others arm the kick at once (see :meth:`BusyPollSelector.bypass`)."""


def _budget(t: Pollable) -> int:
    return t.poll_waiter.spin_ns


def busy_poll_enabled() -> bool:
    """:data:`BUSY_POLL`, unless ``$SMC_RUN_BUSY_POLL`` says ``0``/``off``/``no``/``false``."""
    value = os.environ.get("SMC_RUN_BUSY_POLL")
    if value is None:
        return BUSY_POLL
    return value.strip().lower() not in ("0", "off", "no", "false")


class Pollable(Protocol):
    """What the selector asks of a waiting transport (:class:`SmcTransport` is one)."""

    poll_waiter: Waiter
    """Its spin budget and yield state (see :func:`smc_handoff.wakeup.spin`)."""
    poll_missed: int
    """When (``perf_counter_ns``) a spin for it began that gave up: see :func:`learn`."""

    def poll_channel(self) -> Channel | None:
        """The channel to spin on, or None when the transport no longer waits (it read,
        paused, closed): it is then dropped."""

    def poll_pending(self) -> bool:
        """Data, EOF or an error is there (loads only: the spin's ``ready``)."""

    def poll_look(self) -> int:
        """Look: 1 when something is there (the read is scheduled, ``call_soon``), 0 when
        nothing is, -1 when the transport no longer waits (it is then dropped)."""

    def poll_arm(self) -> bool:
        """Stop waiting here: arm the kick (arm, look again). True when a read was scheduled
        instead, because something came meanwhile."""


def learn(w: Waiter, missed_ns: int) -> None:
    """The data a spin begun at ``missed_ns`` gave up on came with the kick: when a spin
    within the budget's bound would have caught it, the next one is that long. A spin's own
    rule only halves a budget that missed, and grows one that hit: an event loop's turn
    (tens of microseconds) is far above a blocking reader's, so a budget that fell below the
    peer's turn would never hit again, however close the peer is."""
    late = time.perf_counter_ns() - missed_ns
    if w.spin_ns < late < SPIN_MAX_NS:
        w.spin_ns = min(SPIN_MAX_NS, late + (late >> 2))


class BusyPollSelector(selectors.BaseSelector):
    """asyncio's own selector, with the busy poll of the module docstring before it blocks.

    ``spins``/``hits``/``looks``/``arms``/``events_first``/``skips`` count what it did (for
    tests and the bench): spins before a blocking select, transports whose data came during a
    spin or a look, looks (one per select while transports wait), transports it armed, the
    times the loop would have blocked but events were there already (no spin then), and the
    waits that armed at once, without a spin, by the rules against starving anyone (the
    back-off, a peer on our CPU: :meth:`bypass`)."""

    def __init__(self, selector: selectors.BaseSelector) -> None:
        self.selector = selector
        self._waiting: dict[Pollable, int] = {}  # transport -> the turn it began to wait
        self._turn = 0  # selects while transports waited
        self.spins = 0
        self.hits = 0
        self.looks = 0
        self.arms = 0
        self.events_first = 0
        self.skips = 0
        self._probe = 0
        self._direct()

    def _direct(self) -> None:
        """While no transport waits, the loop calls asyncio's own ``select`` straight (an
        instance attribute hides :meth:`select`): busy polling then costs the loop nothing."""
        vars(self)["select"] = self.selector.select

    def wait(self, transport: Pollable) -> None:
        """``transport`` found its ring empty: poll it before the loop blocks."""
        if not self._waiting:
            vars(self).pop("select", None)  # the loop's next select is ours
        self._waiting.setdefault(transport, self._turn)

    def bypass(self, w: Waiter) -> bool:
        """True when a transport with budget ``w`` should arm its kick at once instead of
        waiting here: during the spin back-off (another task wants this CPU), and while its
        peer shares our CPU (``w.yield_ns`` is 0: a spin would only yield to the peer, which
        the loop's sleep does as well, without taking turns against every other task on this
        CPU, and the transport then costs no more than without busy polling) except one wait
        in :data:`PROBE_EVERY`, which spins to see the peer move to a CPU of its own."""
        if w.yield_ns:
            skip = time.perf_counter_ns() < spin_backoff[0]
        else:
            self._probe += 1
            skip = bool(self._probe % PROBE_EVERY)
        self.skips += skip
        return skip

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    # -- the loop's select -------------------------------------------------------------------

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        try:
            return self._select(timeout)
        finally:
            if not self._waiting:
                self._direct()

    def _select(self, timeout: float | None) -> list[tuple[selectors.SelectorKey, int]]:
        waiting = self._waiting
        if not waiting:
            return self.selector.select(timeout)
        self._turn += 1
        if timeout is not None and timeout <= 0:
            # Callbacks are ready: no spin, and no look either while the transports are
            # young (what came for them is read when the loop would block, a few turns on);
            # the oldest is the first in the dict.
            if self._turn - next(iter(waiting.values())) >= ZERO_LOOKS:
                self._look()
            return self.selector.select(0)
        # Data there already (in one process, our own write to the other end) is read at once.
        if self._look():
            return self.selector.select(0)
        if not self._waiting:  # all armed (ZERO_LOOKS) or gone
            return self.selector.select(timeout)
        return self._block(timeout)

    def _look(self) -> bool:
        """Look at the waiting channels (a load or two each): read what came, arm who waited
        :data:`ZERO_LOOKS` turns of the loop. True when a read was scheduled."""
        self.looks += 1
        return self._take(self._turn - ZERO_LOOKS)

    def _take(self, stale: int | None) -> bool:
        """Every waiting transport whose channel has something (data, EOF, an error) stops
        waiting, its read scheduled; with ``stale``, one waiting since that turn or earlier
        arms its kick. True when a read was scheduled."""
        scheduled = False
        waiting = self._waiting
        for t, since in list(waiting.items()):
            there = t.poll_look()
            if there:
                del waiting[t]
                if there > 0:
                    self.hits += 1
                    scheduled = True
            elif stale is not None and since <= stale:
                del waiting[t]
                self.arms += 1
                scheduled = t.poll_arm() or scheduled
        return scheduled

    def _block(self, timeout: float | None) -> list[tuple[selectors.SelectorKey, int]]:
        """The loop would block and transports wait: spin on their channels, then arm those
        that got nothing and block for what is left of the timeout."""
        start = time.perf_counter_ns()
        waiting = self._waiting
        if len(waiting) == 1:  # the request/response case: no list, no closure
            (lead,) = waiting
            ready = lead.poll_pending
        else:
            # The budget of the transport that waits longest for its peer (each has its own,
            # adaptive as a blocking reader's: see learn()), spent watching that one's
            # producer word; the others are looked at between two looks at that word.
            lead = max(waiting, key=_budget)
            polled = list(waiting)

            def ready() -> bool:
                return any(t.poll_pending() for t in polled)

        w = lead.poll_waiter
        ch = lead.poll_channel()
        if ch is None:  # it stopped waiting: the others get their turn at the next select
            del waiting[lead]
            return self.selector.select(0 if waiting else timeout)
        if start < spin_backoff[0]:
            # Another task wants this CPU (see wakeup.spin): sleep at once, as a blocking
            # reader does during the back-off.
            self.skips += 1
            return self._arm(start, timeout, missed=False)
        # Events already there (a kick for a transport that armed, another socket's data; in
        # one process, the peer's kick) come first: no spin (the look counted this turn).
        events = self.selector.select(0)
        if events:
            self.events_first += 1
            return events
        self.spins += 1
        words, index, empty = ch.rx_word()
        if spin(w, ready, timeout, words, index, empty) and self._take(None):
            # The others keep their turn (their looks are counted). Other events were looked
            # at just before the spin: what came since is taken at the next turn (one syscall
            # less per message).
            return []
        return self._arm(start, timeout, missed=True)  # the budget is spent

    def _arm(
        self, start: int, timeout: float | None, missed: bool
    ) -> list[tuple[selectors.SelectorKey, int]]:
        """The kick's turn for every waiting transport (arm, look again: no wakeup is lost),
        then the real select with the time left."""
        polled = list(self._waiting)
        self._waiting.clear()
        scheduled = False
        for t in polled:
            self.arms += 1
            if missed:
                t.poll_missed = start
            scheduled = t.poll_arm() or scheduled
        if scheduled:
            return self.selector.select(0)
        if timeout is not None:
            timeout = max(0.0, timeout - (time.perf_counter_ns() - start) / 1e9)
        return self.selector.select(timeout)

    # -- everything else is asyncio's own selector -------------------------------------------

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self.selector.register(fileobj, events, data)

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        return self.selector.unregister(fileobj)

    def modify(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self.selector.modify(fileobj, events, data)

    def get_key(self, fileobj: Any) -> selectors.SelectorKey:
        return self.selector.get_key(fileobj)

    def get_map(self) -> Any:
        return self.selector.get_map()

    def close(self) -> None:
        self._waiting.clear()
        self.selector.close()

    def __getattr__(self, name: str) -> Any:  # e.g. an EpollSelector's fileno()
        return getattr(self.selector, name)


def poller(loop: Any) -> BusyPollSelector | None:
    """The busy poller of ``loop``, its selector wrapped on first use; None when busy polling
    is off (``$SMC_RUN_BUSY_POLL``) or the loop is not asyncio's selector loop."""
    if not busy_poll_enabled() or not isinstance(loop, selector_events.BaseSelectorEventLoop):
        return None
    sel = getattr(loop, "_selector", None)  # asyncio's documented-by-code selector attribute
    if isinstance(sel, BusyPollSelector):
        return sel
    if not isinstance(sel, selectors.BaseSelector):
        return None  # a closed loop
    wrapped = BusyPollSelector(sel)
    setattr(loop, "_selector", wrapped)  # noqa: B010 (asyncio's attribute, not typed)
    return wrapped
