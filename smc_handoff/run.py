"""smc-run: run an unmodified Python program with its TCP stream sockets upgraded to SMC.

smc-tools' ``smc_run`` preloads a library that turns the program's AF_INET sockets into AF_SMC
ones. ``smc-run`` does the same for Python programs: it puts a bootstrap ``sitecustomize`` on
``PYTHONPATH`` and execs the program; the bootstrap replaces ``socket.socket`` by
:class:`AutoSocket`, a :class:`~smc_handoff.socket.SmcSocket` that offers itself to smcd after a
blocking ``connect()`` (client half) and registers ``listen()``-ing sockets (or, inherited by
descriptor, at their first ``accept()``) so that ``accept()`` hands each connection off (server
half). Everything the stdlib builds on ``socket.socket``
follows: ``socket.create_connection`` (``http.client``, ``urllib``, ``smtplib``...),
``socketserver`` (``http.server``, ``xmlrpc.server``...), and direct ``socket()`` users. The
upgraded object is still a ``socket.socket`` (``makefile``, ``sendall``, timeouts, ``select``,
``getpeername``... behave as before; ``select``, ``poll`` and ``epoll`` see a connection writable
only with room: :mod:`smc_handoff.readiness`). Child Python processes inherit the upgrade.

asyncio's connections are upgraded too, when the program imports :mod:`asyncio`
(:mod:`smc_handoff.aio_loop`: ``create_connection``/``create_server`` with any protocol, streams,
the ``sock_*`` methods), the handoff running off the event loop.

TLS runs over the channel: ``ssl`` wrapping a connection on SMC keeps it there
(:mod:`smc_handoff.tls`), a listener that ``ssl`` wraps stays registered and a socket wrapped
before ``connect()`` is handed off by it.

trio's connections are handed off by :mod:`smc_handoff.trio_loop` (installed when the
program imports trio), their tasks waiting for smcd's answer in trio's loop.

Not upgraded, and staying on plain TCP: other non-blocking connects and listeners that are
non-blocking when ``listen()`` is called (a select loop of the program's own: ``-v`` says so for
each connection), event loops other than asyncio's selector loop and trio's (uvloop: ``-v`` says
so), and every socket when no daemon runs: the program never breaks because smcd is absent.
"""

from __future__ import annotations

import builtins
import errno
import fcntl
import functools
import io
import os
import sys
import weakref

from smc_handoff import fdmap, readiness
from smc_handoff.import_hook import patch_on_import as _patch_on_import
from smc_handoff.launch import (  # main: `python -m smc_handoff.run` is smc-run too
    ENV_ACTIVE,
    ENV_DEBUG,
    ENV_VERBOSE,
    main,
)

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

    from smc_handoff.autosocket import AutoSocket, patch_ssl, report, report_tcp, take_deferred
    from smc_handoff.socket import SmcSocket

__all__ = [
    "AutoSocket",
    "install",
    "install_from_env",
    "main",
    "patch_ssl",
    "report",
    "report_tcp",
    "take_deferred",
]

_verbose = False
_loaded = False
"""Is the library loaded (:func:`_load`, when the program imported :mod:`socket`)?"""
_when_loaded: list[tuple[str, Callable[[], None]]] = []
"""Patches of modules imported before :mod:`socket` (``subprocess``), run by :func:`_load`."""

_FROM_AUTOSOCKET = frozenset({"AutoSocket", "patch_ssl", "report", "report_tcp", "take_deferred"})


def __getattr__(name: str) -> Any:
    """:mod:`smc_handoff.autosocket`'s names, where they were before it was split off (loaded
    on first use: smc-run loads it only once the program imports :mod:`socket`)."""
    if name not in _FROM_AUTOSOCKET:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from smc_handoff import autosocket

    return getattr(autosocket, name)


def _smc_socket_class() -> type[SmcSocket]:
    from smc_handoff.socket import SmcSocket

    return SmcSocket


def _load(socket: Any) -> None:
    """The program imported :mod:`socket`: load the library, make ``socket.socket``
    :class:`~smc_handoff.autosocket.AutoSocket` (before the importer sees the module), then
    patch what was imported before. A failure leaves every socket on TCP, as smc-run without
    a library that loads."""
    global _loaded
    try:
        from smc_handoff import autosocket

        autosocket.load(verbose=_verbose)
    except Exception as e:  # never break the program: it runs on TCP
        print(f"smc-run: not upgrading sockets: {e!r}", file=sys.stderr)
        return
    _loaded = True
    pending = list(_when_loaded)
    _when_loaded.clear()
    for name, patch in pending:
        try:
            patch()
        except Exception as e:  # as import_hook.PatchOnImport reports it
            print(f"smc-run: not upgrading {name}: {e!r}", file=sys.stderr)


def _once_loaded(patch: Callable[[Any], None]) -> Callable[[Any], None]:
    """``patch`` for :func:`_patch_on_import`: run at the module's import when the library is
    loaded (``ssl``, ``asyncio``, ``trio``, ``multiprocessing.reduction`` import :mod:`socket`
    first: always), else by :func:`_load` (``subprocess``: its patch works on ``Popen`` in
    place, for every use to come; none can involve an SMC connection before there is one)."""

    def when_loaded(module: Any) -> None:
        if _loaded:
            patch(module)
        else:
            _when_loaded.append((module.__name__, functools.partial(patch, module)))

    return when_loaded


def _patch_ssl(ssl: Any) -> None:
    from smc_handoff import autosocket

    autosocket.patch_ssl(ssl)


def _patch_asyncio(asyncio: Any) -> None:
    from smc_handoff import aio_loop

    aio_loop.install()


def _patch_subprocess(subprocess: Any) -> None:
    from smc_handoff import child_relay

    child_relay.install(subprocess)


def _patch_mp_reduction(reduction: Any) -> None:
    from smc_handoff import child_relay

    child_relay.install_pickling(reduction)


def _patch_dup2() -> None:
    """``os.dup2`` of an SMC connection's ``fileno()`` copies a relay's socket instead
    (:func:`smc_handoff.child_relay.dup2_source`); anything but an eventfd passes straight
    through, and the relay module is imported only when one comes."""
    dup2 = os.dup2
    if getattr(dup2, "_smc_relay", False):
        return

    @functools.wraps(dup2)
    def smc_dup2(fd: int, fd2: int, inheritable: bool = True) -> int:
        if fd != fd2 and fdmap.is_eventfd(fd):
            from smc_handoff import child_relay

            fd = child_relay.dup2_source(fd)
        result: int = dup2(fd, fd2, inheritable)
        return result

    smc_dup2._smc_relay = True  # type: ignore[attr-defined]
    smc_dup2._smc_real = dup2  # type: ignore[attr-defined]
    os.dup2 = smc_dup2


def _runnable(path: Any) -> bool:
    """Can ``exec`` of ``path`` succeed (a file we may execute; a descriptor, ``fexecve``, is
    taken as one)? A relay owns the connection it serves: made for an exec that then fails
    (``os.execvp`` tries each ``PATH`` entry in turn), it would leave the process's copy
    unusable (``EBUSY``), where a TCP socket is as it was."""
    if isinstance(path, int):
        return True
    try:
        return os.path.isfile(path) and os.access(path, os.X_OK)
    except (TypeError, ValueError):
        return False


def _patch_exec() -> None:
    """``os.execv``/``os.execve`` (every ``os.exec*`` ends in one) give the new program a
    relay's socket at the number of each SMC connection made inheritable
    (:func:`smc_handoff.child_relay.relay_inherited`); with none open, one dictionary look."""
    if getattr(os.execv, "_smc_relay", False):
        return
    by_fd = fdmap.by_fileno

    def wrap(real: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(real)
        def smc_exec(*args: Any) -> Any:
            if not by_fd or not _runnable(args[0] if args else None):
                return real(*args)  # (one that cannot run fails as it fails, nothing moved)
            from smc_handoff import child_relay

            moved = child_relay.relay_inherited()
            try:
                return real(*args)
            finally:  # only when the exec failed after all: the numbers are the eventfds again
                child_relay.restore_inherited(moved)

        smc_exec._smc_relay = True  # type: ignore[attr-defined]
        smc_exec._smc_real = real  # type: ignore[attr-defined]
        return smc_exec

    os.execv = wrap(os.execv)
    os.execve = wrap(os.execve)


def _patch_fd_calls(fcntl: Any) -> None:
    """``open``/``os.fdopen``, ``os.read``, ``os.write``, ``os.readv``, ``os.writev``,
    ``os.sendfile``, ``fcntl.ioctl``, ``fcntl.fcntl``'s ``F_GETFL``/``F_SETFL`` and
    ``os.get_blocking``/``os.set_blocking`` on an SMC connection's ``fileno()`` act on the
    connection, as they act on a TCP socket's descriptor. That number is the channel's
    eventfd: unpatched, ``os.read`` returned its 8-byte counter as if it were data, and
    ``os.write`` of 8 bytes added them to the counter and said they were sent. Any other
    number costs one dictionary look (an empty one while no SMC connection is open)."""
    if getattr(os.read, "_smc_fd", False):
        return
    by_fd, copies = fdmap.by_fileno, fdmap.copies
    connection_at, copy_of = fdmap.connection_at, fdmap.copy_of

    def connection(fd: int) -> SmcSocket | None:
        if fd in by_fd:
            return connection_at(fd)
        return copy_of(fd) if fd in copies else None

    def on_connection(real: Callable[..., Any], act_name: str) -> Any:
        """``real(fd, *args)``, or ``SmcSocket.<act_name>(connection, *args)`` for an SMC
        connection's number (the class looked up then: a connection means it is loaded)."""
        act: Callable[..., Any] | None = None

        @functools.wraps(real)
        def call(*args: Any, **kwargs: Any) -> Any:  # (keywords: os.sendfile's own names)
            nonlocal act
            if by_fd and args and not kwargs and (sock := connection(args[0])) is not None:
                if act is None:
                    act = getattr(_smc_socket_class(), act_name)
                return act(sock, *args[1:])
            return real(*args, **kwargs)

        call._smc_fd = True  # type: ignore[attr-defined]
        call._smc_real = real  # type: ignore[attr-defined]
        return call

    def object_or_number(fd: Any) -> SmcSocket | None:
        """``fcntl``'s first argument: a number or an object with ``fileno()`` (asked only
        while an SMC connection exists: the library is loaded)."""
        if isinstance(fd, _smc_socket_class()):
            return fd
        return connection(fd) if isinstance(fd, int) else None

    ioctl, fcntl_call = fcntl.ioctl, fcntl.fcntl

    @functools.wraps(ioctl)
    def smc_ioctl(fd: Any, request: int, arg: Any = 0, mutate_flag: bool = True, /) -> Any:
        if by_fd and (sock := object_or_number(fd)) is not None:
            value = sock.fd_ioctl(request)
            if value is not None:
                return _ioctl_answer(value, arg, mutate_flag)
        return ioctl(fd, request, arg, mutate_flag)

    @functools.wraps(fcntl_call)
    def smc_fcntl(fd: Any, cmd: int, arg: Any = 0, /) -> Any:
        if by_fd and type(arg) is int and (sock := object_or_number(fd)) is not None:
            value = sock.fd_fcntl(cmd, arg)
            if value is not None:
                return value
            if cmd in _DUPFD:
                return note_copy(fcntl_call(fd, cmd, arg), sock)
        return fcntl_call(fd, cmd, arg)

    def note_copy(new: int, sock: SmcSocket) -> int:
        copies[new] = weakref.ref(sock)
        return new

    real_dup, real_close = os.dup, os.close

    @functools.wraps(real_dup)
    def smc_dup(fd: int, /) -> int:
        if by_fd and (sock := connection(fd)) is not None:
            return note_copy(real_dup(fd), sock)
        return real_dup(fd)

    @functools.wraps(real_close)
    def smc_close(fd: int, /) -> None:
        if copies:
            copies.pop(fd, None)
        real_close(fd)

    real_open = io.open

    @functools.wraps(real_open)
    def smc_open(
        file: Any,
        mode: str = "r",
        buffering: int = -1,
        encoding: str | None = None,
        errors: str | None = None,
        newline: str | None = None,
        closefd: bool = True,
        opener: Any = None,
    ) -> Any:
        if by_fd and type(file) is int and opener is None and (sock := connection(file)):
            copy = None if file in by_fd else file
            return sock.fd_open(mode, buffering, encoding, errors, newline, closefd, copy)
        return real_open(file, mode, buffering, encoding, errors, newline, closefd, opener)

    # open(fd) and os.fdopen(fd) (which calls io.open): unpatched, their reads returned the
    # eventfd's counter as data, then EOF, and their writes were lost
    io.open = builtins.open = smc_open
    # os.dup/fcntl(F_DUPFD) of the number: a copy that reads, writes and opens as the number
    os.dup = smc_dup
    os.close = smc_close  # type: ignore[assignment]  # (typeshed: os.close's name is "fd")
    os.read = on_connection(os.read, "fd_read")
    os.write = on_connection(os.write, "fd_write")
    os.readv = on_connection(os.readv, "fd_readv")
    os.writev = on_connection(os.writev, "fd_writev")
    os.sendfile = on_connection(os.sendfile, "fd_sendfile")
    os.get_blocking = on_connection(os.get_blocking, "fd_get_blocking")
    os.fstat = on_connection(os.fstat, "fd_fstat")
    os.set_blocking = on_connection(os.set_blocking, "fd_set_blocking")
    wrappers: tuple[tuple[Any, Any], ...] = (
        (smc_ioctl, ioctl), (smc_fcntl, fcntl_call), (smc_dup, real_dup), (smc_close, real_close),
        (smc_open, real_open),
    )  # fmt: skip
    for wrapper, real in wrappers:
        wrapper._smc_real = real
    fcntl.ioctl, fcntl.fcntl = smc_ioctl, smc_fcntl


_DUPFD = (fcntl.F_DUPFD, fcntl.F_DUPFD_CLOEXEC)
"""``fcntl`` commands that copy a descriptor (``os.dup``'s way)."""


def _ioctl_answer(value: int, arg: Any, mutate_flag: bool) -> Any:
    """What ``fcntl.ioctl`` returns for an ioctl that stores the C int ``value`` at its
    argument: the argument's bytes with ``value`` in front (an immutable buffer, or
    ``mutate_flag`` false), or 0 with ``value`` stored in the mutable buffer itself."""
    if isinstance(arg, int):  # a pointer the kernel would write to: not one a program has
        raise OSError(errno.EFAULT, os.strerror(errno.EFAULT))
    if isinstance(arg, str):
        arg = arg.encode()
    import struct

    packed = struct.pack("i", value)
    view = memoryview(arg).cast("B")
    if view.readonly or not mutate_flag:
        return (packed + bytes(view[4:]))[: len(view)]
    k = min(4, len(view))
    view[:k] = packed[:k]
    return 0


def _patch_uvloop(uvloop: Any) -> None:
    from smc_handoff import aio_loop

    aio_loop.install_uvloop_report(uvloop)


def _patch_trio(trio_socket: Any) -> None:
    from smc_handoff import trio_loop

    trio_loop.install(trio_socket)


def install(*, verbose: bool = False, debug: bool = False) -> None:
    """Upgrade this interpreter (idempotent): ``socket.socket`` becomes
    :class:`~smc_handoff.autosocket.AutoSocket` when :mod:`socket` is imported (now, if it
    is), and the calls on bare descriptors, ``select``/``poll``/``epoll`` and the import hooks
    of ``ssl``, ``asyncio``, ``trio``, ``subprocess`` and ``multiprocessing`` are in place at
    once. Only :mod:`socket`'s import loads the library (~30 ms): a program that never makes
    a socket starts as under plain ``python``."""
    global _verbose
    _verbose = verbose or debug
    if debug:
        import logging

        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(f"smc-run[{os.getpid()}] %(name)s: %(message)s"))
        root = logging.getLogger("smc_handoff")
        root.addHandler(handler)
        root.setLevel(logging.DEBUG)
    _patch_on_import("ssl", _once_loaded(_patch_ssl))
    _patch_on_import("asyncio", _once_loaded(_patch_asyncio))
    _patch_on_import("trio._socket", _once_loaded(_patch_trio))
    _patch_on_import("subprocess", _once_loaded(_patch_subprocess))
    _patch_on_import("multiprocessing.reduction", _once_loaded(_patch_mp_reduction))
    _patch_dup2()
    _patch_exec()
    _patch_fd_calls(fcntl)
    readiness.install()
    if _verbose:
        _patch_on_import("uvloop", _once_loaded(_patch_uvloop))
    _patch_on_import("socket", _load)


def install_from_env() -> None:
    """What the bootstrap calls: install when smc-run set ``SMC_RUN=1``."""
    if os.environ.get(ENV_ACTIVE) == "1":
        install(verbose=os.environ.get(ENV_VERBOSE) == "1", debug=os.environ.get(ENV_DEBUG) == "1")


if __name__ == "__main__":
    raise SystemExit(main())
