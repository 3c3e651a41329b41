"""Readable-callbacks for the handoff path's short-lived descriptors, through one epoll of our
own that the event loop watches as a single descriptor.

Why not ``loop.add_reader``: every handoff registers and removes four readers (the two halves'
borrowed TCP sockets while they wait for CLC, the two control connections while they hold a
channel). asyncio's selector bookkeeping costs several times the two ``epoll_ctl`` calls
themselves, on the path every connection takes (figures in bench/RESULTS.md). Readiness is
level-triggered, as with ``add_reader``; a
callback must tolerate a spurious call (it reads with ``MSG_DONTWAIT`` and handles EAGAIN).

The rule ``add_reader`` has holds here too: remove a descriptor *before* closing it. epoll keys
a registration by the open file description, and the descriptors watched here are often
duplicates of an application's (SCM_RIGHTS): closing ours alone would leave the registration
alive and firing under a number the kernel may hand out again.
"""

from __future__ import annotations

import asyncio
import logging
import select
import weakref
from collections.abc import Callable

__all__ = ["FdWatch", "fd_watch"]

log = logging.getLogger(__name__)

_BATCH = 64
"""Events taken per wake-up; more stay ready (level-triggered) for the next loop turn."""


class FdWatch:
    """One epoll for many descriptors, dispatched from the loop's own wake-up."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = weakref.ref(loop)  # the per-loop table must not keep its key alive
        self._ep = select.epoll()
        self._cb: dict[int, Callable[[], None]] = {}
        loop.add_reader(self._ep.fileno(), self._dispatch)

    def add(self, fd: int, callback: Callable[[], None]) -> None:
        """Call ``callback()`` on the loop while ``fd`` is readable (or hung up)."""
        if fd in self._cb:
            self._cb[fd] = callback
            return
        self._ep.register(fd, select.EPOLLIN)
        self._cb[fd] = callback

    def remove(self, fd: int) -> None:
        """Stop watching ``fd`` (a no-op when it is not watched). Call it before closing."""
        if self._cb.pop(fd, None) is not None:
            try:  # noqa: SIM105 (the hot path: suppress() costs a context manager per call)
                self._ep.unregister(fd)
            except OSError:  # closed under us: the kernel dropped it with the last reference
                pass

    def __contains__(self, fd: int) -> bool:
        return fd in self._cb

    def _dispatch(self) -> None:
        try:
            events = self._ep.poll(0, _BATCH)
        except InterruptedError:
            return
        cbs = self._cb
        # Look every callback up before running any: one may remove another descriptor, or
        # close it and register a new one under the same number, and neither may then run.
        ready = [(fd, cbs.get(fd)) for fd, _ in events]
        for fd, cb in ready:
            if cb is None or cbs.get(fd) is not cb:
                continue
            try:
                cb()
            except Exception:
                log.exception("fdwatch: callback for fd %d failed", fd)

    def close(self) -> None:
        """Stop dispatching (the descriptors themselves belong to their owners)."""
        self._cb.clear()
        loop = self._loop()
        if loop is not None and not loop.is_closed() and not self._ep.closed:
            loop.remove_reader(self._ep.fileno())
        self._ep.close()


_watches: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, FdWatch] = (
    weakref.WeakKeyDictionary()
)


def fd_watch(loop: asyncio.AbstractEventLoop | None = None) -> FdWatch:
    """The running (or given) loop's watch, made on first use and dropped with the loop."""
    if loop is None:
        loop = asyncio.get_running_loop()
    watch = _watches.get(loop)
    if watch is None:
        watch = _watches[loop] = FdWatch(loop)
        weakref.finalize(loop, watch._ep.close)
    return watch
