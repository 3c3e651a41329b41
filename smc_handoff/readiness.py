"""Write readiness of SMC connections for ``select``, ``poll`` and ``epoll`` (smc-run).

An SMC connection's ``fileno()`` is its channel's eventfd, which the library keeps readable
exactly while data, EOF or an abort waits to be read. For writing it cannot say anything: an
eventfd always polls writable. A non-blocking program that waits for ``EVENT_WRITE`` after a
send met a full ring (``EAGAIN``) was therefore woken at once, over and over, burning a CPU until
the peer read: the busy wait that the kernel's AF_SMC avoids by polling writable only with room
in the send buffer (``smc_poll``), as TCP does.

smc-run replaces ``select.select``, ``select.poll`` and ``select.epoll`` (and so every
``selectors`` selector) by the wrappers here. Where a poll asks for writing on an SMC connection's
``fileno()`` and the peer's ring has no room, the wrapper polls that connection's peer link for
reading in its place, after asking the peer's reader to kick the link once it has freed half of
its ring (:meth:`SmcSocket.poll_room`: the request a blocking send sleeps on). The poll then
sleeps until that kick, the peer's death (the link hangs up) or another descriptor's event, and
reports the connection writable when a send would not wait. With room, or an error a send would
raise, it is reported writable at once. Reading is untouched (the eventfd's level mode), and so is
every descriptor that is not an SMC connection's ``fileno()``: a poll that asks nothing of one
for writing costs one dictionary look more.

``POLLRDHUP``/``EPOLLRDHUP`` (an eventfd has no such state) is added to a connection's readable
event when its registration asks for it with ``POLLIN``, once the peer shut writing, closed or
reset, or this end shut reading, as TCP's poll reports it.

An edge-triggered ``epoll`` registration (``EPOLLET``) gets ``EPOLLOUT`` as TCP's edges come:
once when it is registered or modified with room, then once each time room comes back after a
send found too little of it or a poll found none (TCP's ``SOCK_NOSPACE`` and write-space
wake-up: the edge is owed even when the room came back before the next poll); and each of its
events carries all of its readiness, as a TCP socket's edge does. Without this, an
edge-triggered writer that met a full ring waited for an edge of the eventfd, which only the
peer's *sending* makes: a writer whose peer only reads hung.

A one-shot registration (``EPOLLONESHOT``) reports one event, room included, then nothing until
the program modifies it: the wrapper disarms the real registration when it reports room itself,
and stops looking for room once the real one reported reading.

A link that wakes the poll without room to report (a spare kick: the peer kicked twice, and one
was taken before) does not end it: the wrapper polls on for what is left of the timeout, as the
real poll would have slept on. An empty answer before the timeout, which programs read as the
timeout, came from such a kick once a writer filled the ring again between two of the peer's
kicks.

A readable report of an SMC connection is checked before it is passed on: when a peer's publish
races this end's request for a kick, both the peer's kick and this end's own level sync write
the eventfd, and the kick may land after the data it announced was read. Such a stale report is
dropped and the eventfd cleared (:meth:`SmcSocket.poll_readable`), and the poll sleeps on, so a
blocking ``recv`` after ``select`` never waits, as on TCP. A one-shot ``epoll`` registration
keeps it (the kernel disarmed it with that event; a program that uses one reads until
``EAGAIN``).

``select.select`` also takes descriptors numbered ``FD_SETSIZE`` (1024) and above: it polls
them (the kernel's ``poll``, with ``select``'s meaning of readable, writable and exceptional)
where the real call raises ``ValueError``. Each SMC connection holds seven descriptors where a TCP
socket is one, so a program that calls ``select`` on ~150 connections would otherwise fail under
smc-run where it serves ~1,000 on TCP.

Not translated: ``POLLRDHUP`` asked without ``POLLIN`` is never reported; and an edge-triggered
``EPOLLIN`` comes when data arrives at an empty ring (the eventfd's kick), not at each arrival as
TCP's does, which a reader that reads until ``EAGAIN`` (as epoll(7) asks) does not see.
"""

from __future__ import annotations

import contextlib
import errno
import os
import select as _select
import sys
import time

from smc_handoff.fdmap import LEVEL_FDS, by_fileno, connection_at

TYPE_CHECKING = False
if TYPE_CHECKING:  # smc-run installs this module before the program's first line: light
    from collections.abc import Iterable, Sequence
    from typing import Any

    from smc_handoff.socket import SmcSocket

__all__ = ["SmcEpoll", "SmcPoll", "install", "smc_select"]

_IN = _select.POLLIN
_OUT = _select.POLLOUT
_RDHUP = _select.POLLRDHUP
_ET = _select.EPOLLET
_ONESHOT = _select.EPOLLONESHOT
_real_select = _select.select
_real_poll = _select.poll
_real_epoll = _select.epoll
_POLL_DEFAULT = _select.POLLIN | _select.POLLPRI | _select.POLLOUT
_EPOLL_DEFAULT = _select.EPOLLIN | _select.EPOLLPRI | _select.EPOLLOUT
_SELECT_SETS = (
    _select.POLLIN | _select.POLLRDNORM | _select.POLLRDBAND | _select.POLLHUP | _select.POLLERR,
    _select.POLLOUT | _select.POLLWRNORM | _select.POLLWRBAND | _select.POLLERR,
    _select.POLLPRI,
)
"""What the kernel's select counts as readable, writable and exceptional of a descriptor's
poll mask (``POLLIN_SET``, ``POLLOUT_SET``, ``POLLEX_SET`` in fs/select.c)."""


def _select_any(
    rlist: Iterable[Any], wlist: Iterable[Any], xlist: Iterable[Any], timeout: Any
) -> tuple[list[Any], list[Any], list[Any]]:
    """The real ``select``; past ``FD_SETSIZE`` (its ``ValueError``), the same through poll."""
    rlist, wlist, xlist = list(rlist), list(wlist), list(xlist)
    try:
        return _real_select(rlist, wlist, xlist, timeout)
    except ValueError as e:
        if "out of range" not in str(e):
            raise
    return _select_by_poll(rlist, wlist, xlist, timeout)


def _select_by_poll(
    rlist: list[Any], wlist: list[Any], xlist: list[Any], timeout: Any
) -> tuple[list[Any], list[Any], list[Any]]:
    """``select`` without its descriptor limit: one poll of every descriptor, the answer
    mapped back to the objects given, in their order, as ``select`` returns them."""
    ms = None if timeout is None else _select_ms(timeout)
    lists = (rlist, wlist, xlist)
    fds = [[_fd(obj) for obj in objs] for objs in lists]
    masks: dict[int, int] = {}
    for row, bits in zip(fds, (_IN, _OUT, _select.POLLPRI), strict=True):
        for fd in row:
            if fd < 0:
                raise ValueError(f"file descriptor cannot be a negative integer ({fd})")
            masks[fd] = masks.get(fd, 0) | bits
    p = _real_poll()
    for fd, mask in masks.items():
        p.register(fd, mask)
    got = dict(p.poll(ms))
    if any(ev & _select.POLLNVAL for ev in got.values()):
        raise OSError(errno.EBADF, os.strerror(errno.EBADF))
    r, w, x = (
        [obj for obj, fd in zip(objs, row, strict=True) if got.get(fd, 0) & want]
        for objs, row, want in zip(lists, fds, _SELECT_SETS, strict=True)
    )
    return r, w, x


def _select_ms(timeout: Any) -> int | None:
    """``select``'s timeout (seconds) as poll's (milliseconds, rounded up; None: forever),
    refused as ``select`` refuses it."""
    try:
        if isinstance(timeout, (str, bytes, bytearray)):
            raise TypeError
        secs = float(timeout)
    except (TypeError, ValueError):
        raise TypeError("timeout must be a float or None") from None
    if secs != secs:
        raise ValueError("Invalid value NaN (not a number)")
    if secs < 0:
        raise ValueError("timeout must be non-negative")
    ms = secs * 1000
    return None if ms >= 2**31 - 1 else int(ms) + (ms > int(ms))


def _deadline(timeout: Any, scale: float = 1.0) -> float | None:
    """When a poll of ``timeout`` seconds (times ``scale``) ends. None: never, or a timeout
    that is not a number, which the real call refuses in its own words first (a negative one
    is the real call's to judge too, and waits forever for poll and epoll)."""
    try:
        return None if timeout is None or timeout < 0 else time.monotonic() + timeout * scale
    except TypeError:
        return None


def _left(deadline: float | None) -> float | None:
    """Seconds of the poll left (None: no end), for the next real poll after a spare kick."""
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def _readable(fd: int) -> bool:
    """Does a readable report for ``fd`` hold? Always for what is not an SMC connection's
    ``fileno()`` in level mode (an event loop's transport drains its own eventfd); for one, see
    :meth:`SmcSocket.poll_readable` (stale reports are cleared)."""
    if fd not in LEVEL_FDS:
        return True
    sock = connection_at(fd)
    return sock is None or sock.poll_readable()


def _fd(obj: Any) -> int:
    """The descriptor number of what a poll was given (a number or an object's ``fileno()``);
    -1 when it has none (the real call then raises what it raises)."""
    if isinstance(obj, int):
        return obj
    try:
        fd = obj.fileno()
    except Exception:
        return -1
    return fd if isinstance(fd, int) else -1


class _Rooms:
    """The SMC connections one poll asked for writing: those with room now, and those whose
    link it polls in their place until the peer frees room."""

    def __init__(self) -> None:
        self.ready: list[int] = []
        self.waiting: list[tuple[int, SmcSocket, int]] = []  # (fd, connection, link)

    def ask(self, fd: int, sock: SmcSocket, report_room: bool = True) -> bool:
        """Room now (``ready``, unless not ``report_room``: an edge already reported), or the
        link to poll in ``fd``'s place (``links``). True when it has no room now."""
        link = sock.poll_room()
        if link is None:
            if report_room:
                self.ready.append(fd)
            return False
        self.waiting.append((fd, sock, link))
        return True

    def done(self) -> set[int]:
        """After the poll: every asked descriptor with room (or an error) now."""
        room = set(self.ready)
        for fd, sock, _ in self.waiting:
            if sock.poll_room_done():
                room.add(fd)
        return room

    @property
    def links(self) -> list[int]:
        return [link for _, _, link in self.waiting]


class _Select:
    """``select.select``: an SMC connection in ``wlist`` is returned writable only with room.

    An object, not a function: :mod:`selectors` keeps ``select.select`` as a class attribute
    (``SelectSelector._select``), where a function would be bound as a method."""

    def __call__(
        self,
        rlist: Iterable[Any],
        wlist: Iterable[Any],
        xlist: Iterable[Any],
        timeout: float | None = None,
    ) -> tuple[list[Any], list[Any], list[Any]]:
        if not by_fileno:
            return _select_any(rlist, wlist, xlist, timeout)
        # lists: polled again after a spare kick or a stale report
        rlist, wlist, xlist = list(rlist), list(wlist), list(xlist)
        smc = [
            (obj, fd, sock) for obj in wlist if (sock := connection_at(fd := _fd(obj))) is not None
        ]
        ours = {id(obj) for obj, _, _ in smc}
        rest = [obj for obj in wlist if id(obj) not in ours] if smc else wlist
        deadline, wait = _deadline(timeout), timeout
        while True:
            if not smc:  # nothing of ours asked for writing: no rooms, no links
                r, w, x = _select_any(rlist, rest, xlist, wait)
                room: set[int] = set()
                links: list[int] = []
            else:
                rooms = _Rooms()
                for _obj, fd, sock in smc:
                    rooms.ask(fd, sock)
                links = rooms.links
                try:
                    r, w, x = _select_any([*rlist, *links], rest, xlist, 0 if rooms.ready else wait)
                finally:
                    room = rooms.done()
            woke = bool(r)
            if links:
                hidden = set(links)
                r = [obj for obj in r if not (isinstance(obj, int) and obj in hidden)]
            if r:
                r = [obj for obj in r if _readable(_fd(obj))]
            w.extend(obj for obj, fd, _ in smc if fd in room)
            if r or w or x or not woke or (wait := _left(deadline)) == 0:
                return r, w, x
            # a spare kick on a link, no room, or a stale report: nothing to report, sleep on
            # as select would


smc_select = _Select()
_Select._smc_real = _real_select  # type: ignore[attr-defined]  # (fdmap.unpatched)


class _Translated:
    """What the poll and epoll wrappers share: the registrations that ask for writing, and
    the real registration of an SMC connection's ``fileno()`` without ``POLLOUT``."""

    _DEFAULT_MASK = 0

    def __init__(self, real: Any) -> None:
        self._p = real  # the poll or epoll object wrapped
        self._out: dict[int, int] = {}  # fd → the program's mask, for masks with POLLOUT
        self._real: dict[int, int] = {}  # fd → the mask registered, where it is not the program's
        self._rdhup: set[int] = set()  # fds whose mask asks POLLRDHUP with POLLIN
        self._owed: dict[int, bool] = {}  # edge-triggered fd → is an EPOLLOUT edge owed?
        self._shot: dict[int, bool] = {}  # one-shot fd → still armed?
        self._oneshot: set[int] = set()  # every one-shot fd (_shot: those asking POLLOUT)

    def register(self, fd: Any, eventmask: int | None = None) -> None:
        mask = self._DEFAULT_MASK if eventmask is None else eventmask
        self._p.register(fd, mask)
        self._note(_fd(fd), mask)

    def modify(self, fd: Any, eventmask: int) -> None:
        self._p.modify(fd, eventmask)
        self._note(_fd(fd), eventmask)

    def unregister(self, fd: Any) -> None:
        self._p.unregister(fd)
        self._forget(_fd(fd))

    def _note(self, fd: int, mask: int) -> None:
        self._real.pop(fd, None)
        if mask & _RDHUP and mask & _IN:
            self._rdhup.add(fd)
        else:
            self._rdhup.discard(fd)
        if mask & _OUT:
            self._out[fd] = mask
        else:
            self._out.pop(fd, None)
        if mask & _ET and fd in self._out:
            self._owed[fd] = True  # as EPOLL_CTL_ADD/MOD report a descriptor ready now
        else:
            self._owed.pop(fd, None)
        if mask & _ONESHOT and fd in self._out:
            self._shot[fd] = True
        else:
            self._shot.pop(fd, None)
        if mask & _ONESHOT:
            self._oneshot.add(fd)
        else:
            self._oneshot.discard(fd)

    def _forget(self, fd: int) -> None:
        self._out.pop(fd, None)
        self._real.pop(fd, None)
        self._rdhup.discard(fd)
        self._owed.pop(fd, None)
        self._shot.pop(fd, None)
        self._oneshot.discard(fd)

    def _hup(self, events: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """``POLLRDHUP`` added to the readable events of connections that asked for it and
        will receive nothing more."""
        rdhup = self._rdhup
        out = []
        for fd, ev in events:
            if (
                ev & _IN
                and fd in rdhup
                and (sock := connection_at(fd)) is not None
                and sock.poll_rdhup()
            ):
                ev |= _RDHUP
            out.append((fd, ev))
        return out

    def _fresh(self, events: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """``events`` without the stale readable reports of SMC connections (see
        :meth:`SmcSocket.poll_readable`). A one-shot registration keeps its report: the kernel
        disarmed it with this event, and a report dropped would leave it disarmed for good."""
        out = events
        for i, (fd, ev) in enumerate(events):
            if ev & _IN and fd not in self._oneshot and not _readable(fd):
                if out is events:
                    out = events[:i]
                if ev & ~_IN:
                    out.append((fd, ev & ~_IN))
            elif out is not events:
                out.append((fd, ev))
        return out

    def _set(self, fd: int, mask: int) -> None:
        """Register ``mask`` for ``fd`` in the real poll (a subclass's)."""
        raise NotImplementedError

    def _rooms(self) -> _Rooms | None:
        """Before the real poll: the SMC connections asked for writing, each registered for
        reading only (its room comes by its link, which the caller registers for reading).
        None when no registration asks an SMC connection for writing."""
        rooms: _Rooms | None = None
        for fd, mask in list(self._out.items()):  # another thread may register meanwhile
            sock = connection_at(fd)
            if sock is None:
                if fd in self._real:  # no longer a connection's fileno(): as registered
                    del self._real[fd]
                    with contextlib.suppress(OSError):  # closed: the kernel dropped it
                        self._set(fd, mask)
                continue
            if self._shot.get(fd) is False:
                continue  # a one-shot registration that reported: nothing until a modify
            if self._real.get(fd, mask) != mask & ~_OUT:
                try:
                    self._set(fd, mask & ~_OUT)
                except OSError:
                    # Not registered (any more): the descriptor registered for writing was
                    # closed without unregistering (trio closes a socket whose connect was
                    # cancelled so), the kernel dropped it, and its number is an SMC
                    # connection's now, which nobody registered.
                    self._forget(fd)
                    continue
                self._real[fd] = mask & ~_OUT
            rooms = rooms or _Rooms()
            owed = self._owed.get(fd)
            if owed is False and sock.poll_nospace():
                # A send met a full ring since the last edge: the next room is one, even when
                # it came back before this poll (TCP's SOCK_NOSPACE and write-space wake-up).
                owed = self._owed[fd] = True
            if rooms.ask(fd, sock, owed is not False) and owed is not None:
                self._owed[fd] = True  # full: the next room is an edge
        return rooms

    def _edges(self, events: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """``events`` as the program gets them. An event of an edge-triggered or one-shot
        connection carries all of its readiness (``POLLOUT`` with room, ``POLLIN`` if asked and
        a read would not wait), as a TCP socket's does; each ``POLLOUT`` reported pays the edge
        owed, and a one-shot registration that reported is disarmed, the real one too."""
        owed, shot = self._owed, self._shot
        if not owed and not shot:
            return events
        out = []
        for fd, ev in events:
            if (fd in owed or shot.get(fd)) and (sock := connection_at(fd)) is not None:
                readable, writable = sock.poll_now()
                if writable:
                    ev |= _OUT
                    if readable and self._out.get(fd, 0) & _IN:
                        ev |= _IN
                if ev & _OUT and fd in owed:
                    owed[fd] = False
                if fd in shot:
                    shot[fd] = False
                    with contextlib.suppress(OSError):  # as the kernel disarms its own
                        self._set(fd, 0)
            out.append((fd, ev))
        return out

    @staticmethod
    def _merge(
        events: Sequence[tuple[int, int]], room: set[int], hidden: set[int]
    ) -> list[tuple[int, int]]:
        """The real poll's events without our links', with ``POLLOUT`` for each connection with
        room (an event of its own for one that had none)."""
        out: list[tuple[int, int]] = []
        for fd, ev in events:
            if fd in hidden:
                continue
            if fd in room:
                ev |= _OUT
                room.discard(fd)
            out.append((fd, ev))
        out.extend((fd, _OUT) for fd in room)
        return out


class SmcPoll(_Translated):
    """``select.poll()``: an SMC connection registered for ``POLLOUT`` polls writable only
    with room."""

    _DEFAULT_MASK = _POLL_DEFAULT

    def __init__(self) -> None:
        super().__init__(_real_poll())

    def _set(self, fd: int, mask: int) -> None:
        self._p.register(fd, mask)

    def poll(self, timeout: float | None = None) -> list[tuple[int, int]]:
        deadline = _deadline(timeout, 0.001)  # milliseconds
        wait = timeout
        while True:
            asked = self._rooms() if self._out and by_fileno else None
            if asked is None:
                passed: list[tuple[int, int]] = self._p.poll(wait)
                if not (passed and by_fileno):
                    return passed
                kept, left = self._fresh(passed), _left(deadline)
                if kept or left == 0:
                    return self._hup(kept) if self._rdhup else kept
                wait = None if left is None else left * 1000  # stale reports only: sleep on
                continue
            rooms, links = asked, asked.links
            for link in links:
                self._p.register(link, _IN)
            try:
                events = self._p.poll(0 if rooms.ready else wait)
            finally:
                for link in links:
                    with contextlib.suppress(KeyError):
                        self._p.unregister(link)
                room = rooms.done()  # also when the poll raised: no request is left armed
            out = self._hup(self._fresh(self._merge(events, room, set(links))))
            left = _left(deadline)
            if out or not events or left == 0:
                return out
            wait = None if left is None else left * 1000  # a spare kick or stale: sleep on


class SmcEpoll(_Translated):
    """``select.epoll``: an SMC connection registered for ``EPOLLOUT`` polls writable only
    with room (level-triggered), or once each time room comes (edge-triggered), or once until
    modified (one-shot)."""

    _DEFAULT_MASK = _EPOLL_DEFAULT

    def __init__(self, sizehint: int = -1, flags: int = 0, *, _ep: Any = None) -> None:
        super().__init__(_real_epoll(sizehint, flags) if _ep is None else _ep)

    @classmethod
    def fromfd(cls, fd: int) -> SmcEpoll:
        return cls(_ep=_real_epoll.fromfd(fd))

    @property
    def closed(self) -> bool:
        return bool(self._p.closed)

    def fileno(self) -> int:
        return int(self._p.fileno())

    def close(self) -> None:
        self._p.close()
        self._out.clear()
        self._real.clear()
        self._rdhup.clear()
        self._owed.clear()
        self._shot.clear()
        self._oneshot.clear()

    def __enter__(self) -> SmcEpoll:
        self._p.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _set(self, fd: int, mask: int) -> None:
        self._p.modify(fd, mask)

    def poll(self, timeout: float | None = -1, maxevents: int = -1) -> list[tuple[int, int]]:
        deadline, wait = _deadline(timeout), timeout
        while True:
            asked = self._rooms() if self._out and by_fileno else None
            if asked is None:
                passed: list[tuple[int, int]] = self._p.poll(wait, maxevents)
                if not (passed and by_fileno):
                    return passed
                kept, left = self._fresh(passed), _left(deadline)
                if kept or left == 0:
                    return self._hup(kept) if self._rdhup else kept
                wait = -1 if left is None else left  # stale reports only: sleep on
                continue
            rooms, links = asked, asked.links
            hidden: set[int] = set()
            try:
                for link in links:
                    try:
                        self._p.register(link, _IN)
                    except OSError:  # registered by the program itself: not ours to poll
                        continue
                    hidden.add(link)
                # no more than maxevents: an edge or one-shot event cut off below would be lost
                events = self._p.poll(0 if rooms.ready else wait, maxevents)
            finally:
                for link in hidden:
                    with contextlib.suppress(OSError):
                        self._p.unregister(link)
                room = rooms.done()  # also when the poll raised: no request is left armed
            out = self._hup(self._fresh(self._merge(events, room, hidden)))
            left = _left(deadline)
            if out or not events or left == 0:
                return self._edges(out if maxevents <= 0 else out[:maxevents])
            wait = -1 if left is None else left  # a spare kick or stale: sleep on


# The calls the wrappers stand for (smc_handoff.fdmap.unpatched): smc-run installs them before
# the library's modules, which want the real ones, are loaded.
SmcPoll._smc_real = _real_poll  # type: ignore[attr-defined]
SmcEpoll._smc_real = _real_epoll  # type: ignore[attr-defined]


def install(select: Any = _select, selectors: Any | None = None) -> None:
    """Replace ``select``'s three calls by the wrappers (idempotent), and the selectors'
    classes' when :mod:`selectors` was imported before (it binds them at import; default:
    the one in ``sys.modules``, if any). smc-run does this at start; a program that uses
    :mod:`smc_handoff` itself calls it to get the same."""
    if selectors is None:
        selectors = sys.modules.get("selectors")
    if select.select is smc_select:
        return
    select.select, select.poll, select.epoll = smc_select, SmcPoll, SmcEpoll
    if selectors is not None:
        if getattr(selectors.SelectSelector, "_select", None) is _real_select:
            selectors.SelectSelector._select = smc_select
        selectors.PollSelector._selector_cls = SmcPoll
        if hasattr(selectors, "EpollSelector"):
            selectors.EpollSelector._selector_cls = SmcEpoll
