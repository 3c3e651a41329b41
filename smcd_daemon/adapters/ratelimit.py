"""Rate-limited logging for messages that peers or other users can trigger at will.

A warning per invalid handoff datagram or per refused D-Bus call is a log flood waiting to
happen: whoever sends the input decides how many lines the journal gets (one run of a hostile
test wrote 39,139). :class:`RateLimitedLog` lets each *kind* of message (its key) through at most
``burst`` times per ``period`` seconds and counts the rest; the count is reported, with the key,
as soon as the kind is logged again after its window or when :meth:`RateLimitedLog.flush` is
called (from a periodic timer, and at shutdown), so nothing is dropped silently.

Use one instance per logger and a fixed key per message kind (not per input: the key set is
bounded, and beyond ``max_keys`` the least recently used key is reported and forgotten)::

    warn = RateLimitedLog(log, burst=10, period=60.0)
    ...
    warn.warning("bad-datagram", "uid %d sent an invalid datagram: %s", uid, err)
    ...
    warn.flush()  # e.g. every minute and at shutdown

The journal then shows the first ``burst`` messages of each kind per minute and a line such as
``bad-datagram: 4,211 similar messages suppressed in the last 60 s``.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass

__all__ = ["FALLBACK_LOG_BURST", "RateLimitedLog", "flush_all"]

FALLBACK_LOG_BURST = 100
"""Log lines per fallback reason a minute (each of the two: the handoff's, with the reason in
words, and ``smcd.fallback``'s, with the journal fields); the rest are counted and the count
logged, while ``smcctl stats`` and ``smcctl monitor`` see every one. A peer without SMC, or a
misconfiguration, makes every connection fall back: a line each at thousands a second would
cost journald more than smcd's own work, and past journald's rate limit its suppression would
take smcd's warnings with it."""


@dataclass
class _Window:
    start: float
    level: int
    emitted: int = 0
    suppressed: int = 0


class RateLimitedLog:
    """At most ``burst`` messages per key and ``period`` seconds on ``logger``; the rest are
    counted and reported (see the module docstring). Not thread-safe: one event loop owns it."""

    def __init__(
        self,
        logger: logging.Logger,
        *,
        burst: int = 10,
        period: float = 60.0,
        max_keys: int = 256,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if burst < 1 or period <= 0 or max_keys < 1:
            raise ValueError("burst and max_keys must be ≥ 1 and period > 0")
        self.logger = logger
        self.burst = burst
        self.period = period
        self.max_keys = max_keys
        self._clock = clock
        self._windows: OrderedDict[str, _Window] = OrderedDict()
        _instances.add(self)
        self.suppressed_total = 0
        """Messages suppressed since this object was made (for statistics and tests)."""

    def log(
        self,
        level: int,
        key: str,
        msg: str,
        *args: object,
        extra: Mapping[str, object] | None = None,
    ) -> bool:
        """Log ``msg % args`` at ``level`` unless ``key`` used up its burst in this window;
        True if it was logged. Suppressed messages cost a dict lookup, not a format.
        ``extra``: the record's extra attributes (structured journal fields)."""
        if not self.logger.isEnabledFor(level):
            return False
        now = self._clock()
        window = self._windows.get(key)
        if window is not None and now - window.start >= self.period:
            self._report(key, window, now)
            window = None
        if window is None:
            window = _Window(now, level)
            self._windows[key] = window
            if len(self._windows) > self.max_keys:
                old_key, old = self._windows.popitem(last=False)
                self._report(old_key, old, now)
        else:
            self._windows.move_to_end(key)
        if window.emitted >= self.burst:
            window.suppressed += 1
            window.level = max(window.level, level)
            self.suppressed_total += 1
            return False
        window.emitted += 1
        self.logger.log(level, msg, *args, extra=extra)
        return True

    def debug(self, key: str, msg: str, *args: object) -> bool:
        return self.log(logging.DEBUG, key, msg, *args)

    def info(
        self, key: str, msg: str, *args: object, extra: Mapping[str, object] | None = None
    ) -> bool:
        return self.log(logging.INFO, key, msg, *args, extra=extra)

    def warning(self, key: str, msg: str, *args: object) -> bool:
        return self.log(logging.WARNING, key, msg, *args)

    def error(self, key: str, msg: str, *args: object) -> bool:
        return self.log(logging.ERROR, key, msg, *args)

    def pending(self, key: str | None = None) -> int:
        """Messages suppressed and not yet reported (for ``key``, or all keys)."""
        if key is not None:
            window = self._windows.get(key)
            return 0 if window is None else window.suppressed
        return sum(w.suppressed for w in self._windows.values())

    def flush(self, *, force: bool = False) -> int:
        """Report the suppressed counts of every window that has ended (all of them with
        ``force``, e.g. at shutdown) and forget those windows; returns how many were reported."""
        now = self._clock()
        done = [k for k, w in self._windows.items() if force or now - w.start >= self.period]
        reported = 0
        for key in done:
            window = self._windows.pop(key)
            if window.suppressed:
                reported += window.suppressed
            self._report(key, window, now)
        return reported

    def _report(self, key: str, window: _Window, now: float) -> None:
        if window.suppressed:
            span = max(now - window.start, 0.0)
            self.logger.log(
                window.level,
                "%s: %s similar message%s suppressed in the last %.0f s",
                key,
                f"{window.suppressed:,}",
                "" if window.suppressed == 1 else "s",
                span,
            )


_instances: weakref.WeakSet[RateLimitedLog] = weakref.WeakSet()


def flush_all(*, force: bool = False) -> int:
    """:meth:`RateLimitedLog.flush` on every instance (the daemon's periodic tick and its
    shutdown call this, so that each kind's suppressed count is reported even when that kind
    is never logged again)."""
    return sum(rl.flush(force=force) for rl in list(_instances))
