"""This process's SMC connections by descriptor number, which smc-run's hooks on numbers look up.

smc-run's wrappers of ``os.read``/``os.write``/``fcntl``/``open`` and ``select``/``poll``/``epoll``
(:mod:`smc_handoff.run`, :mod:`smc_handoff.readiness`) are installed before the program's first
line, in every process it starts, but :mod:`smc_handoff.socket` is loaded only when the program
imports :mod:`socket`. The tables they check live here, in a module that imports nothing of the
library (nor ``typing``): while they are empty, no SMC connection exists and every call passes
straight through. :mod:`smc_handoff.socket` and :mod:`smc_handoff.channel_base` fill them and
re-export them.
"""

from __future__ import annotations

import os
import weakref

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import TypeVar

    from smc_handoff.socket import SmcSocket

    _T = TypeVar("_T")

__all__ = [
    "LEVEL_FDS",
    "by_fileno",
    "connection_at",
    "copies",
    "copy_of",
    "eventfd_id",
    "is_eventfd",
    "unpatched",
]


def unpatched(call: _T) -> _T:
    """The call smc-run's wrapper ``call`` stands for (``call`` itself when it is no wrapper of
    ours). smc-run wraps ``os``'s, ``fcntl``'s and ``select``'s calls before the program's first
    line, and the library is loaded later, when the program imports :mod:`socket`: a module of
    the library that needs the real call takes it through this."""
    while (real := getattr(call, "_smc_real", None)) is not None:
        call = real
    return call


LEVEL_FDS: set[int] = set()
"""The eventfds of this process's channels in level mode (``fileno()``): what smc-run's polls
check a readable report of (:meth:`Channel.readable_now`); any other descriptor's report is
passed on at the cost of one set lookup. A stale number (closed, reused) only costs a check."""


def is_eventfd(fd: int) -> bool:
    """Is ``fd`` an eventfd (what an SMC connection's ``fileno()`` is)? One ``readlink``."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:[eventfd]"
    except OSError:
        return False


def eventfd_id(fd: int) -> bytes | None:
    """The kernel's id of the eventfd behind ``fd``, the same for every copy of it (the
    ``eventfd-id`` of ``/proc/self/fdinfo``, Linux 5.19 on; None before, or on error)."""
    try:
        with open(f"/proc/self/fdinfo/{fd}", "rb") as f:
            info = f.read()
    except OSError:
        return None
    for line in info.splitlines():
        if line.startswith(b"eventfd-id:"):
            return line[11:].strip()
    return None


copies: dict[int, weakref.ref[SmcSocket]] = {}
"""Other numbers for SMC connections' eventfds, made by ``os.dup``/``fcntl(F_DUPFD)`` under
smc-run (:mod:`smc_handoff.run`): a read, a write or a file through one acts on the connection,
as through a copy of a TCP socket's descriptor. Each use checks that the number still is a copy
of that eventfd (:func:`copy_of`): one closed behind our back and taken again is not."""


def copy_of(fd: int) -> SmcSocket | None:
    """The live SMC connection whose eventfd ``fd`` (in :data:`copies`) is a copy of, or None
    (and ``fd`` forgotten)."""
    ref = copies.get(fd)
    sock = ref() if ref is not None else None
    smc = sock._smc if sock is not None else None
    if smc is not None and not smc.channel.closed:
        ident = eventfd_id(fd)
        if (ident == eventfd_id(smc.fd)) if ident is not None else is_eventfd(fd):
            return sock
    copies.pop(fd, None)
    return None


by_fileno: dict[int, list[weakref.ref[SmcSocket]]] = {}
"""The SMC connections of this process by their ``fileno()`` (the channel's eventfd number),
for the calls that take a bare number: ``os.read``/``os.write``/``fcntl.ioctl`` (smc-run's
:func:`smc_handoff.run.install`). Kept as the handoff and ``dup()`` make sockets; a closed
socket's entry goes with its close (a collected one's dead reference at the next look)."""


def connection_at(fd: int) -> SmcSocket | None:
    """The SMC connection whose ``fileno()`` is ``fd`` (not a copy of it: ``os.dup``), None
    if there is none."""
    refs = by_fileno.get(fd)
    if refs is None:
        return None
    for ref in refs:
        sock = ref()
        smc = sock._smc if sock is not None else None
        if smc is not None and smc.fd == fd:
            return sock
    return None
