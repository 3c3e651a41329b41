"""``SmcSocket``: a TCP socket whose data moves over an SMC channel once smcd has taken it over.

An :class:`SmcSocket` *is* a :class:`socket.socket` (a subclass owning the TCP descriptor, as
:class:`ssl.SSLSocket` owns its socket): ``getpeername``, ``getsockname``, ``setsockopt``,
``settimeout`` and friends act on the TCP socket, which the application keeps for the life of the
connection (the kernel keeps its clcsock the same way). Once the daemon answered CHANNEL, the data
calls (``send``/``sendall``/``recv``/``recv_into``/``makefile``/``shutdown``/``close``) go to the
shared-memory channel (``shutdown`` shuts the TCP socket down too, as the kernel's AF_SMC
does) and ``fileno()`` is the channel's receive eventfd, readable when data, EOF
or an abort is pending, so ``select``/``selectors`` work. Otherwise (``mode == "tcp"``) every call
is the plain socket's own, and ``.fallback`` says why.

The semantics are a TCP socket's: ``b""`` after the peer's ``shutdown(SHUT_WR)`` or ``close()``
once the data is drained, :class:`ConnectionResetError` after an abort, :class:`TimeoutError`
(``socket.timeout``) when a timeout expires, :class:`BlockingIOError` when non-blocking and there
is nothing to do, :class:`BrokenPipeError` when writing after our own ``shutdown(SHUT_WR)``, and
``EBADF`` after ``close()``. The differences, all in SMC mode:

- ``fileno()`` is not the TCP descriptor, and ``select`` for *writability* is always true (an
  eventfd): a non-blocking ``send`` may still raise :class:`BlockingIOError` when the peer's
  ring is full;
- ``dup`` gives another socket object for the connection, which ends with the last close;
  ``ssl``'s ``wrap_socket`` keeps the connection on its channel, TLS over it
  (:mod:`smc_handoff.tls`), while ``detach`` by anyone else first leaves the channel, while no
  ``dup`` holds it: before any byte moved at once, after data only together with the peer
  (:meth:`SmcSocket.leave_channel`: the connection then goes on over TCP);
- ``MSG_PEEK`` and ``MSG_WAITALL`` work as on the kernel's AF_SMC; ``sendmsg``/``recvmsg``
  carry data but no ancillary data, and ``MSG_OOB`` is not available (``EOPNOTSUPP``);
- ``socket(fileno=...)``/``socket.fromfd()`` cannot rebuild an SMC socket from its
  ``fileno()`` (``ENOTSOCK``, saying so);
- as with the kernel's AF_SMC, ``send`` after the peer closed raises
  :class:`ConnectionResetError` at once, where TCP accepts one more write before the RST;
- a select loop may see a rare spurious readiness right after data was consumed (a late
  wakeup); a non-blocking ``recv`` then raises :class:`BlockingIOError` and clears it;
- after ``fork()`` one process owns the connection: the first data call claims it, the other
  process's copy raises ``OSError(EBUSY)`` (its positions are stale) and closes quietly
  (:class:`smc_handoff.channel_base.ChannelBase`).

Under smc-run a client's ``connect()`` returns once its request is with smcd; the first call
that needs the connection reads smcd's answer (see :meth:`SmcSocket._handoff`, ``defer``).

When no daemon answers (no socket at the handoff path, connection refused, an untrusted owner)
or the daemon refuses, every call degrades to plain TCP with the local reason
:data:`~smc_handoff.messages.FALLBACK_DAEMON_UNAVAILABLE` or
:data:`~smc_handoff.messages.FALLBACK_DAEMON_ERROR`: an application never breaks because smcd
is absent. When the daemon fails after the stream carried CLC, or does not answer in time, the
connection is reset and the handoff fails instead (:mod:`smc_handoff.handoff` says why): never
TCP with protocol bytes in the data.
"""

from __future__ import annotations

import _socket as _csocket
import contextlib
import contextvars
import errno
import fcntl
import functools
import io as _io
import operator
import os
import select as _select
import socket as _socket
import struct
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from fcntl import F_GETFL as _F_GETFL
from fcntl import F_SETFL as _F_SETFL
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self, TypeVar

from smc_handoff import layout, messages, peer_option
from smc_handoff.fdmap import (  # (here too: the names smc_handoff.socket always had)
    by_fileno,
    connection_at,  # noqa: F401
    copies,  # noqa: F401
    copy_of,  # noqa: F401
    eventfd_id,  # noqa: F401
    is_eventfd,
    unpatched,
)
from smc_handoff.handoff import (
    ChannelState,
    Handed,
    Offer,
    Registration,
    answer,
    answer_late_proposal,
    clc_at_head,
    offer,
    raise_nofile_limit,
    reset,
)
from smc_handoff.lazylog import DEBUG, LazyLogger
from smc_handoff.messages import Fallback

if TYPE_CHECKING:  # imported when a channel is made: smc-run loads this module in every process
    from smc_handoff.channel import Channel as _Channel

_fcntl = unpatched(fcntl.fcntl)  # the real one: smc-run wraps fcntl's first (run.py)

__all__ = ["SmcServer", "SmcSocket", "accepted", "connect", "in_place", "listen", "wrap"]

log = LazyLogger("smc_handoff")  # (logging: imported when something is logged)

# The real socket class, captured before smc-run may replace ``socket.socket`` by a subclass.
_BaseSocket = _socket.socket
_STREAM_FAMILIES = (int(_socket.AF_INET), int(_socket.AF_INET6))
# Plain ints: the socket module's constants are IntFlag members, and enum arithmetic would
# cost microseconds on every call of the data path.
_MSG_DONTWAIT = int(_socket.MSG_DONTWAIT)
_MSG_PEEK = int(_socket.MSG_PEEK)
_MSG_WAITALL = int(_socket.MSG_WAITALL)
_MSG_TRUNC = int(_socket.MSG_TRUNC)
_MSG_NOSIGNAL = int(getattr(_socket, "MSG_NOSIGNAL", 0))
# What the kernel's AF_SMC takes as TCP does: hints that change nothing here (MSG_MORE: our
# writes are not segmented; MSG_EOR, MSG_CONFIRM: TCP's own), and what a read acts on.
_SEND_FLAGS = (
    _MSG_DONTWAIT | _MSG_PEEK | _MSG_WAITALL | _MSG_NOSIGNAL
    | int(getattr(_socket, "MSG_MORE", 0)) | int(_socket.MSG_EOR)
    | int(getattr(_socket, "MSG_CONFIRM", 0))
)  # fmt: skip
_RECV_FLAGS = (
    _MSG_DONTWAIT | _MSG_PEEK | _MSG_WAITALL | _MSG_NOSIGNAL | _MSG_TRUNC
    | int(getattr(_socket, "MSG_CMSG_CLOEXEC", 0))
)  # fmt: skip
#: How long a ``MSG_PEEK | MSG_WAITALL`` read naps while fewer bytes than asked are there (a
#: wait for readability returns at once then: what is there is unread).
_PEEK_NAP = 0.0005
_SENDFILE_MAX = 1 << 20
_TIMEVAL = struct.Struct("@ll")  # SO_RCVTIMEO/SO_SNDTIMEO: struct timeval
_UNSET = -1.0
"""A blocking call's ``until`` (see ``SmcSocket._blocking_until``) before it first waits."""
_SOCK_STREAM = int(_socket.SOCK_STREAM)
# The C socket's plain-int attributes: ``socket.socket.family``/``.type`` convert to enum
# members, which costs microseconds per handoff for a check.
_family_of = _csocket.socket.family.__get__
_type_of = _csocket.socket.type.__get__
_proto_of = _csocket.socket.proto.__get__
_MODE_NAMES = {mode: mode.name.lower() for mode in messages.Mode}
_SIOCINQ = 0x541B  # FIONREAD
_IOCTLS = frozenset((_SIOCINQ, 0x5411, 0x894B))  # SIOCINQ, SIOCOUTQ (TIOCOUTQ), SIOCOUTQNSD
Buffer = Any  # collections.abc.Buffer arrives with Python 3.12
_Smc = ChannelState
_ZERO = 0
"""``flags is _ZERO``: the fast paths' test for "no flags", which (unlike ``not flags``) lets
``None``, ``0.0`` or ``""`` through to the long way, where they are refused as TCP refuses them."""
_INT_MAX = 0x7FFFFFFF
_SSIZE_MAX = sys.maxsize


LEAVE_WAIT_S = 2.0
"""How long a socket that carried data waits for its peer to leave the channel too (see
:meth:`SmcSocket.leave_channel`): in STARTTLS the second end comes within a round trip."""


_tls_installed = False


def _install_tls() -> None:
    """The first connection on SMC (smc-run or not): ``ssl`` wrapping one keeps its TLS on the
    channel from now on (:mod:`smc_handoff.tls`), as smc-run's peers do."""
    global _tls_installed
    _tls_installed = True
    from smc_handoff.import_hook import patch_on_import

    patch_on_import("ssl", _patch_ssl)


def _patch_ssl(ssl: Any) -> None:
    """What :func:`_install_tls` asks for once ``ssl`` is there: smc-run's patch (loaded only
    then, ~11 ms that a program without ``ssl`` never pays on its first connection)."""
    from smc_handoff import autosocket  # (imports this module)

    autosocket.patch_ssl(ssl)


_tls_takeover: contextvars.ContextVar[SmcSocket | None] = contextvars.ContextVar(
    "smc_tls_takeover", default=None
)


@contextlib.contextmanager
def handing_to_tls(sock: SmcSocket) -> Iterator[None]:
    """While ``ssl.SSLContext.wrap_socket`` makes an ``SSLSocket`` of ``sock`` (on SMC) that
    keeps its channel (:mod:`smc_handoff.tls`): ``sock.detach()`` then lets go without leaving
    the channel."""
    token = _tls_takeover.set(sock)
    try:
        yield
    finally:
        _tls_takeover.reset(token)


def _index(sock: SmcSocket, smc: _Smc) -> None:
    smc.fd = smc.channel.event_fd()
    by_fileno.setdefault(smc.fd, []).append(weakref.ref(sock))


def _unindex(fd: int) -> None:
    """Drop the references to ``fd`` of sockets that are gone or no longer on its channel."""
    refs = by_fileno.get(fd)
    if refs is None:
        return
    keep = [r for r in refs if (o := r()) is not None and o._smc is not None]
    if keep:
        by_fileno[fd] = keep
    else:
        del by_fileno[fd]


def _send_view(data: Buffer) -> memoryview:
    """``data`` as flat bytes, or the error a TCP socket's send raises for it (the ``y*``
    argument of CPython's socket calls: any C-contiguous buffer, shape and format aside)."""
    try:
        view = data if type(data) is memoryview else memoryview(data)
    except TypeError:
        raise TypeError(f"a bytes-like object is required, not '{type(data).__name__}'") from None
    if not view.c_contiguous:
        raise BufferError("memoryview: underlying buffer is not C-contiguous")
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _recv_view(buffer: Buffer, call: str) -> memoryview:
    """``buffer`` as flat writable bytes, or the ``TypeError`` a TCP socket's ``call`` raises
    for it (CPython's ``w*``: a writable C-contiguous buffer)."""
    try:
        view = buffer if type(buffer) is memoryview else memoryview(buffer)
    except TypeError:
        view = None
    if view is None or view.readonly or not view.c_contiguous:
        raise TypeError(
            f"{call}() argument 1 must be read-write bytes-like object, not {type(buffer).__name__}"
        )
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _integer(value: Any) -> int:
    """``value`` as CPython's socket calls take an integer argument (an int, or anything with
    ``__index__``), or their ``TypeError``."""
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(
            f"'{type(value).__name__}' object cannot be interpreted as an integer"
        ) from None


def _c_int(value: Any) -> int:
    """A flags argument (CPython's ``i``): an integer within a C int, or its error."""
    n = value if type(value) is int else _integer(value)
    if n > _INT_MAX:
        raise OverflowError("signed integer is greater than maximum")
    if n < -_INT_MAX - 1:
        raise OverflowError("signed integer is less than minimum")
    return n


def _size(value: Any, negative: str) -> int:
    """A size argument (CPython's ``n``: a ``ssize_t``), non-negative: else the error a TCP
    socket's call raises (``negative``: its ``ValueError``'s words, which differ by call)."""
    n = value if type(value) is int else _integer(value)
    if not -_SSIZE_MAX - 1 <= n <= _SSIZE_MAX:
        raise OverflowError("Python int too large to convert to C ssize_t")
    if n < 0:
        raise ValueError(negative)
    return n


def _ebadf() -> OSError:
    return OSError(errno.EBADF, os.strerror(errno.EBADF))


def _eagain() -> BlockingIOError:
    return BlockingIOError(errno.EAGAIN, os.strerror(errno.EAGAIN))


def _timeout() -> TimeoutError:
    return TimeoutError("timed out")  # the message CPython's socket module uses


_T = TypeVar("_T")


# --- making the channel -------------------------------------------------------------------


class _Keep:
    """Type of :data:`_KEEP`: "leave the socket timeout as it is" (None means blocking)."""


_KEEP = _Keep()


_UNSUPPORTED = Fallback(
    messages.FALLBACK_CHANNEL_UNSUPPORTED,
    "CHANNEL_UNSUPPORTED",
    "this CPU's memory model cannot carry the shared-memory channel (needs x86-64 or s390x)",
)


def _channel_refused() -> Fallback | None:
    """Checked before asking the daemon (once it answered CHANNEL there is no way back to TCP),
    and only when there is one."""
    return None if layout.ORDERING_OK else _UNSUPPORTED


_CLOSED_UNANSWERED = Fallback(
    messages.FALLBACK_CLOSED_UNANSWERED,
    "CLOSED_UNANSWERED",
    "closed before smcd answered the handoff, which was given up (no data moved)",
)


_channel_class: type[_Channel] | None = None


def _load_channel() -> type[_Channel]:
    """Import the channel modules once (an import statement in the handoff would look them up
    again on every connection). Deferred handoff answers are read before a fork, ahead of the
    channels' own preparation for it (a read may make a channel).

    A process loads them only once it has asked smcd (a process without smcd never does), and
    after its request left: the import (milliseconds, the first connection only) then runs
    while the daemon negotiates, not between ``connect()`` and the request, where it delayed
    the request and, on a busy machine, could outlast a server half's wait for this client
    (``timeouts.local_client_wait``)."""
    global _channel_class
    from smc_handoff.channel import Channel
    from smc_handoff.channel_base import run_before_fork

    run_before_fork(_settle_all)
    raise_nofile_limit()  # a process with SMC connections needs many descriptors
    _channel_class = Channel
    return Channel


@dataclass
class _Pending:
    """A handoff whose reply is still in the control connection (see
    :meth:`SmcSocket._handoff`'s ``defer``)."""

    sent: Offer
    done: Callable[[SmcSocket], None]  # called once settled (smc-run -v's line)
    server_side: bool = False
    fail: bool = True  # False: a failure leaves the socket reset or on TCP (see _handoff)
    lock: threading.Lock = field(default_factory=threading.Lock)


_unsettled: weakref.WeakSet[SmcSocket] = weakref.WeakSet()
_unsettled_accepts: weakref.WeakSet[SmcSocket] = weakref.WeakSet()
"""The server halves among them: see :func:`may_defer_accept`."""
MAX_DEFERRED_ACCEPTS = 16
"""Accepted connections whose handshake a process lets run on unawaited at once; past it,
``accept()`` awaits the handshake as it did. A burst of clients then still drains a small
listen backlog at once, and a server that accepts a pool of connections before using any puts
no more handshakes in flight than that (smcd admits ``limits.handshakes_per_user``, 64, per
user at once: the rest fall back to TCP)."""


def may_defer_accept() -> bool:
    """May the next ``accept()`` leave its handshake to the connection's first use?"""
    return len(_unsettled_accepts) < MAX_DEFERRED_ACCEPTS


def _settle_all() -> None:
    """Before ``fork()``: settle every deferred handoff of this process, so that parent and
    child never both wait for the one reply (both then hold the channel, as after a plain
    connect)."""
    for sock in list(_unsettled):
        with contextlib.suppress(Exception):
            sock._settle()


def _closed_meanwhile(ch: _Channel, error: ValueError) -> Exception:
    """What a call gets when another thread closed its socket under it: the channel's released
    memory views raise ``ValueError``, where every call on a closed socket raises EBADF."""
    return _ebadf() if ch.closed else error


def _take_turn(lock: threading.Lock, deadline: float | None) -> None:
    """Wait for a direction's turn (``ChannelBase.tx_lock``/``rx_lock``) as the call waits
    for its data: forever, until its deadline (``socket.timeout``), or not at all (EAGAIN)."""
    if lock.acquire(False):
        return
    if deadline is None:
        lock.acquire()
    elif deadline == 0.0:
        raise _eagain()
    elif not lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
        raise _timeout()


def _in_turn(
    lock: threading.Lock, deadline: float | None, call: Callable[..., _T], smc: _Smc, *args: Any
) -> _T:
    """``call(smc, *args)`` in this thread's turn of a direction (the long ways; the fast
    paths take the turn inline, where a call more would cost a ping-pong's microseconds)."""
    _take_turn(lock, deadline)
    try:
        return call(smc, *args)
    except ValueError as e:  # (released views: closed by another thread)
        raise _closed_meanwhile(smc.channel, e) from None
    finally:
        lock.release()


class DescriptorIO(_io.RawIOBase):
    """What ``FileIO`` is for a TCP socket's descriptor (read(2), write(2), close(2) on it),
    for an SMC connection's ``fileno()``: reads and writes of the connection with read(2)'s
    and write(2)'s waits (:meth:`SmcSocket.fd_read`), ``None`` where they would say
    ``EAGAIN``, and ``close()`` closing the connection unless ``closefd`` is false."""

    def __init__(
        self, sock: SmcSocket, reading: bool, writing: bool, closefd: bool, copy: int | None
    ) -> None:
        super().__init__()
        self._sock = sock
        self._reading, self._writing = reading, writing
        self.closefd = closefd
        self._copy = copy  # a copy of the number (os.dup): closing the file closes only it
        self.name = sock.fileno() if copy is None else copy
        self.mode = ("rb+" if writing else "rb") if reading else "wb"

    def _flags(self) -> int:
        return 0 if self._sock.gettimeout() is None else _MSG_DONTWAIT

    def readable(self) -> bool:
        self._checkClosed()
        return self._reading

    def writable(self) -> bool:
        self._checkClosed()
        return self._writing

    def fileno(self) -> int:
        self._checkClosed()
        return int(self.name)

    def readinto(self, buffer: Any) -> int | None:
        self._checkClosed()
        if not self._reading:
            raise _io.UnsupportedOperation("File not open for reading")
        try:
            return self._sock.recv_into(buffer, 0, self._flags())
        except BlockingIOError:
            return None

    def write(self, data: Any) -> int | None:
        self._checkClosed()
        if not self._writing:
            raise _io.UnsupportedOperation("File not open for writing")
        try:
            return self._sock.send(data, self._flags())
        except BlockingIOError:
            return None

    def close(self) -> None:
        if self.closed:
            return
        try:
            super().close()
        finally:
            if self.closefd and self._copy is not None:
                os.close(self._copy)  # (smc-run's os.close forgets the copy)
            elif self.closefd:
                self._sock.close()


# --- the socket -------------------------------------------------------------------------------


class SmcSocket(_BaseSocket):
    """A TCP socket upgraded to SMC when smcd takes it over (see the module docstring)."""

    _smc: _Smc | None
    _fallback: Fallback | None
    _pending: _Pending | None = None
    _premarked = False
    """The socket carries ``peer_option.HANDOFF_MARK`` (smc-run set it before ``connect()``)."""

    def __init__(
        self,
        family: int = -1,
        type: int = -1,
        proto: int = -1,
        fileno: int | None = None,
    ) -> None:
        twin_of: SmcSocket | None = None
        try:
            super().__init__(family, type, proto, fileno)
        except OSError as e:
            if fileno is None or e.errno != errno.ENOTSOCK or not is_eventfd(fileno):
                raise
            from smc_handoff.child_relay import connection_of  # (imports this module)

            twin_of = connection_of(fileno)  # the number, or a copy of it (its eventfd id)
            if twin_of is None:
                raise OSError(
                    errno.ENOTSOCK,
                    f"descriptor {fileno} is an eventfd, not a socket, and no SMC connection "
                    "of this process has it as its fileno()",
                ) from None
            tcp = os.dup(_BaseSocket.fileno(twin_of))
            try:
                super().__init__(family, type, proto, tcp)
            except BaseException:
                os.close(tcp)
                raise
        self._smc = None
        self._fallback = None
        self._gone = False  # really closed (``_closed`` is set while makefile()s keep it open)
        self._clc_guard = False  # a server half on TCP: its first read answers a late Proposal
        self._pending = None
        if twin_of is not None:
            # ``socket(fileno=sock.fileno())`` or ``socket.fromfd(sock.fileno(), ...)``: another
            # socket for that connection, as dup() makes. A copy of the eventfd given to us is
            # ours to close (the channel's own number is left alone).
            self._join(twin_of)
            assert self._smc is not None and fileno is not None
            if fileno != self._smc.fd:
                os.close(fileno)

    def _join(self, sock: SmcSocket) -> None:
        """Become another socket object for ``sock``'s SMC connection (this object holds its
        own copy of the TCP descriptor): the connection ends with the last of them to close."""
        smc = sock._smc
        assert smc is not None
        self._smc = smc
        smc.holders += 1
        _index(self, smc)
        self.settimeout(sock.gettimeout())

    # -- what it is ----------------------------------------------------------------------------

    @property
    def mode(self) -> str:
        """``"smcd"``, ``"smcr"`` or ``"tcp"``."""
        smc = self._smc if self._pending is None else self._settle()
        return _MODE_NAMES[smc.info.mode] if smc is not None else "tcp"

    @property
    def fallback(self) -> Fallback | None:
        """Why this socket stayed on TCP (code, name, explanation, peer_diagnosis); None on SMC
        or before any handoff was tried."""
        if self._pending is not None:
            self._settle()
        return self._fallback

    @property
    def channel(self) -> _Channel | None:
        """The shared-memory channel in SMC mode (for an event loop's transport), else None."""
        smc = self._smc if self._pending is None else self._settle()
        return smc.channel if smc is not None else None

    @property
    def conn_id(self) -> int | None:
        """The daemon's connection id (smcctl conns), None on TCP."""
        smc = self._smc if self._pending is None else self._settle()
        return smc.conn_id if smc is not None else None

    def __repr__(self) -> str:
        """A socket's repr with its mode, without waiting or side effects: the base repr asks
        ``fileno()``, which settles a deferred handoff and puts a channel in level mode (and
        starts the link watcher thread), so here the descriptor is named without it. A repr
        runs in log lines, and in the finalizer's ``ResourceWarning`` of a dropped socket."""
        smc, pending = self._smc, self._pending
        if smc is None and pending is None:
            return f"{super().__repr__()[:-1]}, mode={self.mode}>"
        fd = _BaseSocket.fileno(self)  # pending: the TCP socket's, until the answer
        if smc is not None:
            with contextlib.suppress(OSError):
                fd = smc.channel.event_fd()  # what fileno() returns
        text = (
            f"<{type(self).__module__}.{type(self).__qualname__} fd={fd}, family={self.family!s}, "
            f"type={self.type!s}, proto={self.proto}"
        )
        for name, call in (("laddr", self.getsockname), ("raddr", self.getpeername)):
            with contextlib.suppress(OSError):
                text += f", {name}={call()}"
        mode = "pending" if pending is not None else _MODE_NAMES[smc.info.mode] if smc else "tcp"
        return f"{text}, mode={mode}>"

    def fileno(self) -> int:
        smc = self._smc
        if smc is None and self._pending is not None:
            smc = self._settle()
        if smc is not None:
            if _tls_takeover.get() is self:
                # ssl's SSLSocket._create asks for the number only to make its socket object
                # (a twin of ours): nothing will poll it, so no level mode (which would keep a
                # TLS connection from taking its records in batches, smc_handoff.tls)
                return smc.fd
            return smc.channel.fileno()
        return super().fileno()

    def settimeout(self, value: float | None) -> None:
        super().settimeout(value)
        smc = self._smc
        if smc is not None:
            smc.fd_nonblock = False  # CPython set O_NONBLOCK for its own mode

    def setblocking(self, flag: bool) -> None:
        super().setblocking(flag)
        smc = self._smc
        if smc is not None:
            smc.fd_nonblock = False

    def fd_fcntl(self, cmd: int, arg: int) -> int | None:
        """``fcntl(fileno(), F_GETFL/F_SETFL)`` on an SMC connection, as on the TCP socket's
        descriptor: the status flags are the TCP socket's, whose ``O_NONBLOCK`` CPython sets for
        a timeout or non-blocking mode, and a program's own ``O_NONBLOCK`` makes the calls of a
        socket without a timeout return ``EAGAIN`` instead of waiting, as on TCP. (``fileno()``
        is an eventfd, always non-blocking: unpatched, a blocking socket looked non-blocking,
        and setting the flag changed nothing: a read waited where TCP's fails.) None: another
        command, or not on SMC (``fcntl`` answers for the descriptor itself)."""
        smc = self._live()
        if smc is None or cmd not in (_F_GETFL, _F_SETFL):
            return None
        tcp = _BaseSocket.fileno(self)
        if cmd == _F_GETFL:
            return _fcntl(tcp, cmd, 0)
        result = _fcntl(tcp, cmd, arg)
        smc.fd_nonblock = bool(arg & os.O_NONBLOCK)
        return result

    def fd_fstat(self) -> os.stat_result:
        """``os.fstat(fileno())``: the TCP socket's (``S_ISSOCK``), not the eventfd's."""
        return os.fstat(_BaseSocket.fileno(self))

    def fd_get_blocking(self) -> bool:
        """``os.get_blocking(fileno())``: the TCP socket's mode (see :meth:`fd_fcntl`)."""
        flags = self.fd_fcntl(_F_GETFL, 0)
        if flags is None:
            flags = _fcntl(_BaseSocket.fileno(self), _F_GETFL, 0)
        return not flags & os.O_NONBLOCK

    def fd_set_blocking(self, blocking: bool) -> None:
        """``os.set_blocking(fileno(), blocking)``: as ``F_SETFL`` (see :meth:`fd_fcntl`)."""
        tcp = _BaseSocket.fileno(self)
        old = _fcntl(tcp, _F_GETFL, 0)
        new = old & ~os.O_NONBLOCK if blocking else old | os.O_NONBLOCK
        if self.fd_fcntl(_F_SETFL, new) is None:
            _fcntl(tcp, _F_SETFL, new)

    def setsockopt(self, level: int, optname: int, value: Any, *optlen: int) -> None:
        """As on TCP (the option is the TCP socket's). A socket-level option may be
        ``SO_RCVTIMEO``/``SO_SNDTIMEO``, which bound blocking calls here too: read again."""
        super().setsockopt(level, optname, value, *optlen)
        smc = self._smc
        if smc is not None and level == _socket.SOL_SOCKET:
            smc.rcvtimeo = smc.sndtimeo = None

    # -- handoff -------------------------------------------------------------------------------

    def _handoff(
        self,
        server_side: bool,
        dmb_size: int = 0,
        timeout: float | _Keep | None = _KEEP,
        *,
        fail: bool = True,
        defer: Callable[[SmcSocket], None] | None = None,
    ) -> None:
        """Offer this connected TCP socket to the daemon; on CHANNEL switch to SMC. ``timeout``
        is the socket timeout to apply afterwards (default: keep the current one). When the
        stream cannot be given back as it was (:mod:`smc_handoff.handoff`) the connection is
        reset and the error raised, or with ``fail=False`` (what ``accept`` does, as the
        kernel's AF_SMC hands out a failed socket) kept: the application's first call fails.

        ``defer`` (``connect()`` and ``accept()`` under smc-run; called with the socket once the
        reply is read): send the request and return at once. The reply is read by the first call
        that needs it (data, ``fileno()``, ``mode``, ``close()``...) or before a ``fork()``.

        Why, for a client: the kernel runs the server's side of CLC before its application
        accepts, so a program that connects and then accepts in the same thread gets SMC at
        once. Here the server's half only starts when its application accepts, and a
        ``connect()`` that waited for the reply would wait for that ``accept()`` until the
        daemon gave up (``timeouts.clc_wait``). For a server: the kernel's handshakes run
        beside the accept loop, which takes completed connections at TCP's pace; an
        ``accept()`` that waited for the handshake took a millisecond each, so a burst of
        clients overflowed a small listen backlog (``socketserver``'s is 5) and the kernel
        dropped their SYNs: seconds of retransmission for connects TCP completes at once. The
        wait now falls in the thread or process that serves the connection."""
        if _family_of(self) not in _STREAM_FAMILIES or _type_of(self) != _SOCK_STREAM:
            raise ValueError("only connected AF_INET/AF_INET6 stream sockets can use SMC")
        if not dmb_size:
            dmb_size = _rcvbuf_hint(self)
        request = messages.Accept(dmb_size) if server_side else messages.Connect(dmb_size)
        keep = isinstance(timeout, _Keep)
        blocking = self.gettimeout() if isinstance(timeout, _Keep) else timeout
        marked = self._premarked
        if defer is not None:
            sent: Offer | Fallback | None = None
            try:
                sent = offer(self, request, _channel_refused, marked=marked)
            except OSError as e:
                if fail:
                    raise
                self._set_fallback(messages.daemon_error(str(e)))
                defer(self)
                return
            finally:
                # The daemon's copy shares O_NONBLOCK, which it may change at any time until it
                # answers: _settle applies the mode again then, so a request that left needs
                # it here only for a new timeout.
                if not (keep and isinstance(sent, Offer)):
                    self.settimeout(blocking)
            if isinstance(sent, Offer):  # (a fork reads the answer first: _load_channel)
                self._pending = _Pending(sent, defer, server_side, fail)
                _unsettled.add(self)
                if server_side:
                    _unsettled_accepts.add(self)
                if _channel_class is None:
                    _load_channel()
                return
            self._take(sent, server_side, fail)
            defer(self)
            return
        try:
            sent = offer(self, request, _channel_refused, marked=marked)
            if isinstance(sent, Offer) and _channel_class is None:
                _load_channel()  # while the daemon works on the request
            result = answer(self, sent) if isinstance(sent, Offer) else sent
        except OSError as e:
            if fail:
                raise
            self._set_fallback(messages.daemon_error(str(e)))
            return
        finally:
            self.settimeout(blocking)  # the daemon's copy shares O_NONBLOCK: re-apply ours
        self._take(result, server_side, fail)

    def _settle(self) -> _Smc | None:
        """Read the reply of a deferred handoff (see :meth:`_handoff`) and act on it; the SMC
        state after it. Threads that use the socket meanwhile wait for the one that reads."""
        pending = self._pending
        if pending is None:
            return self._smc
        with pending.lock:
            if self._pending is not pending:  # another thread settled it
                return self._smc
            try:
                try:
                    result = answer(self, pending.sent)
                except OSError as e:
                    if pending.fail:
                        raise
                    result = messages.daemon_error(str(e))  # (accept: on TCP, or reset)
                finally:
                    self.settimeout(self.gettimeout())  # the daemon's copy shared O_NONBLOCK
                # The state first: other threads look at it.
                self._take(result, pending.server_side, pending.fail)
            finally:
                self._pending = None
                _unsettled.discard(self)
                if pending.server_side:
                    _unsettled_accepts.discard(self)
        pending.done(self)
        return self._smc

    def answer_fd(self) -> int | None:
        """The descriptor smcd's answer to a deferred handoff comes on (readable once it is
        there, or once smcd hung up), None when no answer is awaited: an event loop waits for
        it itself (:mod:`smc_handoff.trio_loop`), then calls :meth:`settle`, which no longer
        waits."""
        pending = self._pending
        return None if pending is None else pending.sent.ctl.fileno()

    def settle(self) -> None:
        """Read the answer of a deferred handoff and act on it (the channel, or TCP with its
        reason): what the socket's first use does, waiting for the answer if it is not there."""
        self._settle()

    def _drop_unanswered(self, pending: _Pending) -> bool:
        """On ``close()``: give up a deferred handoff smcd has not answered yet, without
        waiting (True; False: the answer is there, settle it). A TCP ``close()`` never waits,
        and this one would have waited for the server application's ``accept()`` (a client
        that connects to check a port and closes waited seconds, up to ``timeouts.clc_wait``).
        The hang-up tells smcd: a client half that wrote no CLC byte yet falls back, so the
        server application reads TCP's EOF; one whose CLC was under way is reset. The socket
        says so (``CLOSED_UNANSWERED``), and so does ``smc-run -v``."""
        with pending.lock:
            if self._pending is not pending:  # another thread settled it meanwhile
                return False
            ctl = pending.sent.ctl
            # Anything there (the answer, or smcd's hang-up) is settled as usual.
            answered = _select.poll()
            answered.register(ctl, _select.POLLIN)
            if answered.poll(0):
                return False
            ctl.close()
            self._pending = None
            _unsettled.discard(self)
            if pending.server_side:
                _unsettled_accepts.discard(self)
            self._fallback = _CLOSED_UNANSWERED
        pending.done(self)
        return True

    def _take(self, result: Handed | Fallback, server_side: bool, fail: bool) -> None:
        """Act on the outcome of a handoff: TCP with its reason, or the channel."""
        if isinstance(result, Fallback):
            self._set_fallback(result)
            self._clc_guard = server_side and not result.after_decline
            return
        ctl, reply, fds = result
        try:
            make = _channel_class or _load_channel()
            rx_dmb, tx_dmb, rx_efd, tx_efd, link = fds
            channel = make(rx_dmb, tx_dmb, reply.rx_size, reply.tx_size, rx_efd, tx_efd, link)
        except Exception as e:  # unusable descriptors: the TCP stream already spoke CLC
            ctl.close()  # the channel closed the fds it was given
            reset(self)
            error = ConnectionResetError(
                errno.ECONNRESET, f"smcd handed over an unusable channel: {e}"
            )
            if fail:
                raise error from e
            self._set_fallback(messages.daemon_error(str(error)))
            return
        role = messages.Role.SERVER if server_side else messages.Role.CLIENT
        self._smc = smc = _Smc(
            channel, ctl, reply, role, reply.conn_id, next_check=time.monotonic() + _Smc.RECHECK_S
        )
        self._fallback = None
        _index(self, smc)
        if not _tls_installed:
            _install_tls()
        if log.isEnabledFor(DEBUG):
            what = "ACCEPT" if server_side else "CONNECT"  # (not self.mode: a settle holds
            mode = _MODE_NAMES[reply.mode]  # the lock that reading .mode would take again)
            log.debug("%s: SMC connection %d (%s)", what, reply.conn_id, mode)

    def _set_fallback(self, reason: Fallback) -> None:
        self._smc = None
        self._fallback = reason
        log.debug("staying on TCP: %s", reason)

    def _live(self) -> _Smc | None:
        """The SMC state, None in TCP mode; EBADF once really closed. A deferred handoff is
        settled first."""
        if self._gone:
            raise _ebadf()
        smc = self._smc
        if smc is None and self._pending is not None:
            smc = self._settle()
        return smc

    def _tcp_read(self, flags: int = 0) -> None:
        """Before a read in TCP mode: a server half's first read answers a late CLC Proposal
        (:func:`smc_handoff.handoff.answer_late_proposal`), so it never reaches the application."""
        if not self._clc_guard:
            return
        if not answer_late_proposal(self, _c_int(flags)):  # bad flags: TCP's error, first
            # nothing was there when it looked: the read must not go on to the socket, where
            # the head of a Proposal arriving meanwhile would reach the application
            raise _eagain()
        self._clc_guard = False

    def _deadline(self, flags: int) -> float | None:
        """Absolute deadline for one call: 0.0 = non-blocking, None = forever."""
        if flags & _MSG_DONTWAIT:
            return 0.0
        timeout = self.gettimeout()
        if timeout is None:
            smc = self._smc
            return 0.0 if smc is not None and smc.fd_nonblock else None
        return 0.0 if timeout == 0 else time.monotonic() + timeout

    @staticmethod
    def _remaining(deadline: float | None) -> float | None:
        if deadline is None:
            return None
        if deadline == 0.0:
            raise _eagain()
        left = deadline - time.monotonic()
        if left <= 0:
            raise _timeout()
        return left

    def _blocking_until(self, smc: _Smc, sending: bool) -> float | None:
        """When a blocking call that waits from now gives up: the socket's ``SO_RCVTIMEO``
        (``SO_SNDTIMEO`` when ``sending``) as the kernel keeps it, None when it is not set.
        The kernel's AF_SMC honours them as TCP does (``sock_rcvtimeo``/``sock_sndtimeo``):
        the call then fails with ``EAGAIN``, or returns what it moved. Only blocking calls: a
        socket timeout (``settimeout``) makes CPython poll a non-blocking descriptor, where
        the kernel's never applies. Each is read once per connection, when a call of its
        direction first waits (a connection whose reads wait but whose sends never do, the
        usual request and reply, asks the kernel once)."""
        t = smc.sndtimeo if sending else smc.rcvtimeo
        if t is None:
            opt = _socket.SO_SNDTIMEO if sending else _socket.SO_RCVTIMEO
            try:
                raw = _BaseSocket.getsockopt(self, _socket.SOL_SOCKET, opt, _TIMEVAL.size)
                sec, usec = _TIMEVAL.unpack(raw)
                t = sec + usec / 1e6
            except (OSError, struct.error):
                t = 0.0
            if sending:
                smc.sndtimeo = t
            else:
                smc.rcvtimeo = t
        return time.monotonic() + t if t > 0 else None

    @staticmethod
    def _wait_in(
        wait: Callable[[float | None], bool], deadline: float | None, until: float | None
    ) -> None:
        """One wait of a call for data or room: within the socket timeout's ``deadline``
        (``socket.timeout`` when it ends; EAGAIN at once when non-blocking), or, for a
        blocking call (``deadline`` None), until ``until`` (``SO_RCVTIMEO``/``SO_SNDTIMEO``:
        EAGAIN when it ends) or forever."""
        if deadline is not None:
            if not wait(SmcSocket._remaining(deadline)):
                SmcSocket._remaining(deadline)  # raises timeout when it has expired
            return
        if until is None:
            wait(None)
            return
        left = until - time.monotonic()
        if left <= 0 or (not wait(left) and time.monotonic() >= until):
            raise _eagain()

    @staticmethod
    def _check_flags(flags: Any, allowed: int = _RECV_FLAGS) -> int:
        """``flags`` as an int (refused as TCP refuses a non-integer). ``MSG_OOB`` (urgent
        data) and ``MSG_ERRQUEUE`` have no meaning on an SMC channel."""
        n = _c_int(flags)
        if n & ~allowed:
            raise OSError(errno.EOPNOTSUPP, "this flag is not supported on an SMC connection")
        return n

    # -- receiving -----------------------------------------------------------------------------

    def recv_into(self, buffer: Buffer, nbytes: int = 0, flags: int = 0) -> int:
        smc = self._smc  # None once closed: then _live() below raises EBADF
        if smc is None and self._pending is not None:
            smc = self._live()  # a deferred handoff's first use settles it: then the fast path
        if smc is not None and nbytes is _ZERO and flags is _ZERO and not smc.rd_shut:
            ch = smc.channel
            lock = ch.rx_lock
            if lock.acquire(False):  # (another thread reading: the long way waits its turn)
                try:
                    n = ch.recv_fast(buffer)  # the fast path: data there, one copy
                    # Blocking and nothing yet: spin for the peer's store before the long way
                    # (whose set-up would delay a ping-pong's reply by microseconds).
                    if (
                        not n
                        and self.gettimeout() is None
                        and not smc.fd_nonblock
                        and ch.spin_readable()
                    ):
                        n = ch.recv_fast(buffer)
                except ValueError as e:  # (released views: closed by another thread)
                    raise _closed_meanwhile(smc.channel, e) from None
                finally:
                    lock.release()
                if n:
                    return n
        smc = self._live()
        if smc is None:
            if self._clc_guard:
                self._tcp_read(flags)
            return super().recv_into(buffer, nbytes, flags)
        if flags is not _ZERO:
            flags = self._check_flags(flags)
        view = _recv_view(buffer, "recv_into")
        if nbytes is not _ZERO:
            nbytes = _size(nbytes, "negative buffersize in recv_into")
        if nbytes:
            if nbytes > view.nbytes:
                raise ValueError("buffer too small for requested bytes")
            view = view[:nbytes]
        if not view.nbytes:
            return 0
        if flags & _MSG_TRUNC and flags & (_MSG_PEEK | _MSG_WAITALL):
            # TCP's (and AF_SMC's): the bytes are read, not copied out (alone: consumed in the
            # ring without a copy, see _recv_turn)
            return self.recv_into(bytearray(view.nbytes), 0, flags & ~_MSG_TRUNC)
        deadline = self._deadline(flags)
        return _in_turn(smc.channel.rx_lock, deadline, self._recv_turn, smc, view, flags, deadline)

    def _recv_turn(self, smc: _Smc, view: memoryview, flags: int, deadline: float | None) -> int:
        """The rest of :meth:`recv_into`, this thread's turn to read (``rx_lock``)."""
        if smc.rd_shut:
            return self._recv_after_shut_rd(smc, view, flags)
        if flags & (_MSG_PEEK | _MSG_WAITALL):
            return self._recv_special(smc, view, flags)
        ch = smc.channel
        read = ch.discard if flags & _MSG_TRUNC else ch.recv_into
        n = read(view)  # raises ConnectionResetError after an abort
        if n:
            return n
        until: float | None = _UNSET
        while True:
            if ch.eof or smc.rd_shut:  # (SHUT_RD by another thread: what was there, then EOF)
                return 0
            if deadline != 0.0:
                smc.check_daemon(_BaseSocket.fileno(self))
            if until == _UNSET:
                until = self._blocking_until(smc, False) if deadline is None else None
            self._wait_in(ch.wait_readable, deadline, until)
            n = read(view)
            if n:
                return n

    def _recv_after_shut_rd(self, smc: _Smc, view: memoryview, flags: int) -> int:
        """After ``SHUT_RD`` a read still returns what was received, before and after the
        shutdown, as Linux TCP and the kernel's ``smc_rx_recvmsg`` do; once nothing is there it
        returns 0 at once (EOF), without waiting."""
        try:
            if flags & (_MSG_PEEK | _MSG_WAITALL):
                return self._recv_special(smc, view, (flags & ~_MSG_WAITALL) | _MSG_DONTWAIT)
            if flags & _MSG_TRUNC:
                return smc.channel.discard(view)
            return smc.channel.recv_into(view)
        except BlockingIOError:
            return 0

    def _recv_special(self, smc: _Smc, view: memoryview, flags: int) -> int:
        """``MSG_PEEK`` and ``MSG_WAITALL``, as the kernel's ``smc_rx_recvmsg`` has them: a
        peek copies without consuming; ``MSG_WAITALL`` waits for the whole buffer, or EOF, or an
        error (the bytes already read are returned first). As CPython on TCP, it waits only
        on a blocking socket: with a timeout CPython reads a non-blocking descriptor once it is
        readable, and Linux returns what is there."""
        ch = smc.channel
        fd = _BaseSocket.fileno(self)
        deadline = self._deadline(flags)
        want = view.nbytes
        waitall = bool(flags & _MSG_WAITALL) and deadline is None
        until = self._blocking_until(smc, False) if deadline is None else None
        if flags & _MSG_PEEK:
            while True:
                n, done = ch.peek_into(view)
                if n and (not waitall or n == want or done):
                    return n
                if not n and (ch.eof or smc.rd_shut):
                    return 0
                if deadline != 0.0:
                    smc.check_daemon(fd)
                if n:  # fewer than asked (MSG_WAITALL): what is there keeps it readable
                    if until is not None and time.monotonic() >= until:
                        return n  # SO_RCVTIMEO: what came, as the kernel's
                    time.sleep(_PEEK_NAP)
                else:
                    self._wait_in(ch.wait_readable, deadline, until)
        got = 0
        while True:
            try:
                n = ch.recv_into(view[got:])
            except OSError:
                if got:  # the error stays: the next call raises it
                    return got
                raise
            got += n
            if got == want or (got and not waitall) or ch.eof or smc.rd_shut:
                return got
            if not n:
                if deadline != 0.0:
                    smc.check_daemon(fd)
                try:
                    self._wait_in(ch.wait_readable, deadline, until)
                except BlockingIOError:
                    if got:  # SO_RCVTIMEO ended a MSG_WAITALL read: what came, as the kernel's
                        return got
                    raise

    def recv(self, bufsize: int, flags: int = 0) -> bytes:
        if self._live() is None:
            if self._clc_guard:
                self._tcp_read(flags)
            return super().recv(bufsize, flags)
        if type(bufsize) is not int or not 0 <= bufsize <= _SSIZE_MAX:
            bufsize = _size(bufsize, "negative buffersize in recv")
        smc = self._smc
        if smc is not None and flags is _ZERO and not smc.rd_shut:
            lock = smc.channel.rx_lock
            if lock.acquire(False):
                try:
                    data = smc.channel.recv_bytes(bufsize)  # the fast path: one copy out
                except ValueError as e:  # (released views: closed by another thread)
                    raise _closed_meanwhile(smc.channel, e) from None
                finally:
                    lock.release()
                if data:
                    return data
        size = min(bufsize, self._smc.info.rx_size) if self._smc is not None else bufsize
        buf = bytearray(size)  # one call never returns more than a ring holds
        n = self.recv_into(buf, size, flags)
        return bytes(buf[:n])

    # -- calls on the bare descriptor (smc-run routes them here: smc_handoff.run) ----------------

    def fd_read(self, n: int) -> bytes:
        """``os.read(fileno(), n)``: what read(2) gives on the TCP socket. It never waits when
        the socket has a timeout, since Python sets ``O_NONBLOCK`` then (the socket module's
        timeout is its own; read(2) knows none)."""
        return self.recv(n, 0 if self.gettimeout() is None else _MSG_DONTWAIT)

    def fd_write(self, data: Buffer) -> int:
        """``os.write(fileno(), data)``: what write(2) gives on the TCP socket (see
        :meth:`fd_read` for when it waits)."""
        return self.send(data, 0 if self.gettimeout() is None else _MSG_DONTWAIT)

    def fd_open(
        self,
        mode: str = "r",
        buffering: int = -1,
        encoding: str | None = None,
        errors: str | None = None,
        newline: str | None = None,
        closefd: bool = True,
        copy: int | None = None,
    ) -> Any:
        """``open(fileno(), ...)``, ``os.fdopen(fileno(), ...)``: the file ``io.open`` makes
        of the TCP socket's descriptor, over the connection (:class:`DescriptorIO` in
        ``FileIO``'s place, buffered and decoded as ``io.open`` does); closing it closes the
        connection unless ``closefd`` is false, as closing that descriptor would. ``copy``:
        the file is of that copy of the number (:data:`copies`), which its close closes."""
        if (
            not isinstance(mode, str)
            or set(mode) - set("rwxabt+")
            or len(set(mode)) != len(mode)
            or sum(c in mode for c in "rwxa") != 1
            or ("b" in mode and "t" in mode)
        ):
            raise ValueError(f"invalid mode: {mode!r}")
        binary = "b" in mode
        if binary and (encoding is not None or errors is not None or newline is not None):
            raise ValueError("binary mode doesn't take an encoding, errors or newline argument")
        if buffering == 0 and not binary:
            raise ValueError("can't have unbuffered text I/O")
        reading, writing = "r" in mode or "+" in mode, bool(set(mode) & set("wxa+"))
        raw = DescriptorIO(self, reading, writing, closefd, copy)
        if buffering == 0:
            return raw
        size = _io.DEFAULT_BUFFER_SIZE if buffering in (-1, 1) else buffering
        buffered: Any
        if raw.readable() and raw.writable():
            buffered = _io.BufferedRandom(raw, size)
        elif raw.readable():
            buffered = _io.BufferedReader(raw, size)
        else:
            buffered = _io.BufferedWriter(raw, size)
        if binary:
            return buffered
        text = _io.TextIOWrapper(buffered, encoding, errors, newline, buffering == 1)
        setattr(text, "mode", mode)  # noqa: B010 (what io.open sets; typeshed: read-only)
        return text

    def fd_readv(self, buffers: Any) -> int:
        """``os.readv(fileno(), buffers)``: what readv(2) gives on the TCP socket, the bytes of
        one read (see :meth:`fd_read`) spread over the buffers in order. (Unpatched, it read
        the eventfd's 8-byte counter as data.)"""
        views = []
        for buffer in buffers:
            view = memoryview(buffer).cast("B")
            if view.readonly:
                raise TypeError("readv() arg 2 must be a sequence of writable buffers")
            views.append(view)
        data = self.fd_read(sum(view.nbytes for view in views))
        at = 0
        for view in views:
            if at >= len(data):
                break
            k = min(view.nbytes, len(data) - at)
            view[:k] = data[at : at + k]
            at += k
        return len(data)

    def fd_writev(self, buffers: Any) -> int:
        """``os.writev(fileno(), buffers)``: what writev(2) gives on the TCP socket, the
        buffers' bytes in order as one write (see :meth:`fd_write`). (Unpatched, 8 bytes in all
        went into the eventfd's counter, any other count failed with EINVAL.)"""
        return self.fd_write(b"".join(bytes(memoryview(b).cast("B")) for b in buffers))

    def fd_sendfile(self, in_fd: int, offset: int | None, count: int) -> int:
        """``os.sendfile(fileno(), in_fd, offset, count)``: sendfile(2) into the TCP socket's
        descriptor copies from the file into the connection; an SMC connection's number is an
        eventfd, which sendfile(2) refuses (``EINVAL``, where the program worked on TCP). So:
        up to ``count`` bytes (at most 1 MiB a call: sendfile's callers loop) read at
        ``offset``, or at the file's position, which then moves by what was sent, and sent
        as :meth:`fd_write` sends (waiting as the socket's mode says). The count sent, 0 at
        the file's end. A source without a position (a pipe, a socket) gets the ``EINVAL``
        sendfile(2) gives for it toward a TCP socket."""
        pos = offset
        if pos is None:
            try:
                pos = os.lseek(in_fd, 0, os.SEEK_CUR)
            except OSError as e:
                if e.errno == errno.ESPIPE:
                    raise OSError(errno.EINVAL, os.strerror(errno.EINVAL)) from None
                raise
        n = min(count, _SENDFILE_MAX) if count > 0 else 0
        if n == 0:
            return 0
        data = os.pread(in_fd, n, pos)
        if not data:
            return 0
        sent = self.fd_write(data)
        if offset is None:
            os.lseek(in_fd, pos + sent, os.SEEK_SET)
        return sent

    def fd_ioctl(self, request: int) -> int | None:
        """``ioctl(fileno(), request)``'s answer on an SMC connection, as the kernel's AF_SMC
        gives it (``smc_ioctl``): ``SIOCINQ``/``FIONREAD`` the bytes received and not yet read;
        ``SIOCOUTQ`` and ``SIOCOUTQNSD`` the bytes sent and not yet in the peer's buffer, none
        here, since a send writes there. None: not one of these (TCP mode included)."""
        smc = self._live()
        if smc is None or request not in _IOCTLS:
            return None
        return smc.channel.unread() if request == _SIOCINQ else 0

    def poll_room(self) -> int | None:
        """Before a poll of ``fileno()`` for writing (smc-run's ``select``, ``poll`` and
        ``epoll``; the eventfd itself always polls writable): None when a send would not wait
        now (room in the peer's ring, or an error or a shutdown that the send raises), else a
        descriptor to poll for *reading* in its place, which the peer's reader makes readable
        once it has freed half of its ring, as it wakes a blocking send (and which hangs up
        when the peer is gone). Follow the poll with :meth:`poll_room_done`."""
        smc = self._smc
        if smc is None:
            return None
        ch = smc.channel
        try:
            if ch.claimed_elsewhere:  # not ours to wait on: the eventfd's answer, as before
                return None
            return ch.kick_fd() if ch.arm_space() else None
        except OSError:  # closed meanwhile: the send raises
            return None

    def poll_room_done(self) -> bool:
        """After that poll: the request withdrawn and its kick taken. True when a send would
        not wait now."""
        smc = self._smc
        if smc is None:
            return True
        ch = smc.channel
        ch.drain_kicks()
        ch.disarm_space()
        try:
            return ch.writable()
        except OSError:
            return True

    def poll_readable(self) -> bool:
        """For smc-run's ``select``, ``poll`` and ``epoll``, after the eventfd polled readable:
        does that hold (a read would not wait)? False for a stale report, which is then
        cleared (:meth:`Channel.readable_now`). A copy another process claimed answers as its
        eventfd."""
        smc = self._smc
        if smc is None:
            return True
        ch = smc.channel
        try:
            return ch.claimed_elsewhere or ch.readable_now()
        except (OSError, ValueError):  # closed meanwhile: the read raises at once
            return True

    def poll_nospace(self) -> bool:
        """For smc-run's edge-triggered ``epoll``: did a send find too little room for all of
        it since the last look (TCP's ``SOCK_NOSPACE``)? Then the room that comes back is an
        ``EPOLLOUT`` edge, even if it came back before the program polled again. Clears it."""
        smc = self._smc
        if smc is None or not smc.channel.tx_nospace:
            return False
        smc.channel.tx_nospace = False
        return True

    def poll_now(self) -> tuple[bool, bool]:
        """For smc-run's edge-triggered and one-shot ``epoll``: (would a read not wait, would a
        send not wait) now, with nothing armed. A copy another process claimed answers as its
        eventfd."""
        smc = self._smc
        if smc is None:
            return False, True
        ch = smc.channel
        try:
            if ch.claimed_elsewhere:
                return False, True
            return ch.rx_pending, ch.writable()
        except OSError:  # closed meanwhile: both raise
            return True, True

    def poll_rdhup(self) -> bool:
        """For smc-run's ``poll`` and ``epoll``: does TCP's ``POLLRDHUP`` hold (the peer shut
        writing, closed or reset, or this end shut reading)?"""
        smc = self._smc
        return smc is not None and smc.channel.rx_shut

    def recvfrom(self, bufsize: int, flags: int = 0) -> tuple[bytes, Any]:
        if self._live() is None:
            if self._clc_guard:
                self._tcp_read(flags)
            return super().recvfrom(bufsize, flags)
        return self.recv(_size(bufsize, "negative buffersize in recvfrom"), flags), None

    def recvfrom_into(self, buffer: Buffer, nbytes: int = 0, flags: int = 0) -> tuple[int, Any]:
        if self._live() is None:
            if self._clc_guard:
                self._tcp_read(flags)
            return super().recvfrom_into(buffer, nbytes, flags)
        view = _recv_view(buffer, "recvfrom_into")
        if nbytes is not _ZERO:
            nbytes = _size(nbytes, "negative buffersize in recvfrom_into")
        return self.recv_into(view, nbytes, flags), None

    # -- sending -------------------------------------------------------------------------------

    def _send_some(
        self, smc: _Smc, view: memoryview, flags: int, until: float | None = _UNSET
    ) -> int:
        """What fits of ``view``, once there is room. ``until``: the end of a blocking call's
        ``SO_SNDTIMEO`` (EAGAIN then), by default counted from the first wait here, so a
        ``sendall`` fails only when no room came for that long (CPython's ``sendall`` calls
        send(2) again after each partial send, with the whole timeout each time)."""
        ch = smc.channel
        n = ch.send_into(view)  # raises BrokenPipeError / ConnectionResetError as TCP would
        if n:
            return n
        deadline = smc.deadline if smc.deadline is not None else self._deadline(flags)
        while True:
            if deadline != 0.0:
                smc.check_daemon(_BaseSocket.fileno(self))
            if until == _UNSET:
                until = self._blocking_until(smc, True) if deadline is None else None
            self._wait_in(ch.wait_writable, deadline, until)
            n = ch.send_into(view)
            if n:
                return n

    def send(self, data: Buffer, flags: int = 0) -> int:
        smc = self._smc  # None once closed: then _live() below raises EBADF
        if smc is None and self._pending is not None:
            smc = self._live()  # a deferred handoff's first use settles it: then the fast path
        if smc is not None and flags is _ZERO:
            lock = smc.channel.tx_lock
            if lock.acquire(False):  # (another thread sending: the long way waits its turn)
                try:
                    n = smc.channel.send_fast(data)  # the fast path: all of it fits, one copy
                except ValueError as e:  # (released views: closed by another thread)
                    raise _closed_meanwhile(smc.channel, e) from None
                finally:
                    lock.release()
                if n:
                    return n
        smc = self._live()
        if smc is None:
            return super().send(data, flags)
        if flags is not _ZERO:
            flags = self._check_flags(flags, _SEND_FLAGS)
        view = _send_view(data)
        if not view.nbytes:
            return 0
        deadline = self._deadline(flags)
        return _in_turn(smc.channel.tx_lock, deadline, self._send_turn, smc, view, flags, deadline)

    def _send_turn(self, smc: _Smc, view: memoryview, flags: int, deadline: float | None) -> int:
        """The rest of :meth:`send`, this thread's turn to write (``tx_lock``)."""
        # Blocking: SO_SNDTIMEO bounds the whole call, as the kernel's send(2) (EAGAIN when
        # nothing went, else the count of what did).
        until = self._blocking_until(smc, True) if deadline is None else None
        n = self._send_some(smc, view, flags, until)
        if n < view.nbytes and deadline is None:
            # Blocking: all of it, as Linux TCP's (and the kernel AF_SMC's) send returns only
            # once everything is queued, so a program that drops the count loses nothing; an
            # error after some of it is the next call's, as there (the count says what went).
            try:
                while n < view.nbytes:
                    n += self._send_some(smc, view[n:], flags, until)
            except OSError:
                pass
        return n

    def sendall(self, data: Buffer, flags: int = 0) -> None:
        smc = self._smc  # None once closed: then _live() below raises EBADF
        if smc is None and self._pending is not None:
            smc = self._live()  # a deferred handoff's first use settles it: then the fast path
        if smc is not None and flags is _ZERO:
            lock = smc.channel.tx_lock
            if lock.acquire(False):  # (another thread sending: the long way waits its turn)
                try:
                    sent = smc.channel.send_fast(data)
                except ValueError as e:  # (released views: closed by another thread)
                    raise _closed_meanwhile(smc.channel, e) from None
                finally:
                    lock.release()
                if sent:
                    return None  # the fast path: all of it fitted, one copy
        smc = self._live()
        if smc is None:
            return super().sendall(data, flags)
        if flags is not _ZERO:
            flags = self._check_flags(flags, _SEND_FLAGS)
        view = _send_view(data)
        deadline = self._deadline(flags)  # as CPython: the timeout covers the whole call
        # The whole call is one turn: another thread's sendall never lands inside this one's
        # bytes (on TCP it may, between two of the kernel's waits for room).
        _in_turn(smc.channel.tx_lock, deadline, self._sendall_turn, smc, view, flags, deadline)
        return None

    def _sendall_turn(
        self, smc: _Smc, view: memoryview, flags: int, deadline: float | None
    ) -> None:
        """The rest of :meth:`sendall`, this thread's turn to write (``tx_lock``)."""
        if view.nbytes:  # what fits at once
            n = smc.channel.send_into(view)
            if n:
                if n == view.nbytes:
                    return None
                view = view[n:]
        smc.deadline = deadline
        try:
            while view.nbytes:
                n = self._send_some(smc, view, flags)
                view = view[n:]
        finally:
            smc.deadline = None
        return None

    def sendto(self, data: Buffer, *args: Any) -> int:
        """On SMC: :meth:`send` (``sendto(data, [flags,] address)``): a connected stream
        ignores the address, as Linux TCP's and the kernel AF_SMC's ``sendmsg`` do."""
        if self._live() is None:
            return super().sendto(data, *args)
        if not 1 <= len(args) <= 2:
            raise TypeError(f"sendto() takes 2 or 3 arguments ({len(args) + 1} given)")
        return self.send(data, args[0] if len(args) == 2 else 0)

    def sendfile(self, file: Any, offset: int = 0, count: int | None = None) -> int:
        if self._live() is None:
            return super().sendfile(file, offset, count)
        return self._sendfile_use_send(file, offset, count)  # type: ignore[attr-defined, no-any-return]

    def sendmsg(self, buffers: Any, ancdata: Any = (), flags: int = 0, address: Any = None) -> int:
        """On SMC: the buffers in order, as one :meth:`send` (a stream's scatter/gather);
        ancillary data cannot travel over SMC (``EOPNOTSUPP``), and a connected stream
        ignores an address (see :meth:`sendto`)."""
        if self._live() is None:
            if address is None:
                return super().sendmsg(buffers, ancdata, flags)
            return super().sendmsg(buffers, ancdata, flags, address)
        try:
            anc = list(ancdata)
        except TypeError:
            raise TypeError("sendmsg() argument 2 must be an iterable") from None
        if anc:
            raise OSError(errno.EOPNOTSUPP, "ancillary data cannot travel over an SMC connection")
        try:
            parts = list(buffers)
        except TypeError:
            raise TypeError("sendmsg() argument 1 must be an iterable") from None
        return self.send(b"".join([_send_view(b) for b in parts]), flags)

    def recvmsg(self, bufsize: int, ancbufsize: int = 0, flags: int = 0) -> Any:
        """On SMC: ``(data, [], 0, None)`` with ``data`` as :meth:`recv` returns it (no
        ancillary data ever arrives; a connected stream has no source address)."""
        if self._live() is None:
            if self._clc_guard:
                self._tcp_read(flags)
            return super().recvmsg(bufsize, ancbufsize, flags)
        bufsize = _size(bufsize, "negative buffer size in recvmsg()")
        _size(ancbufsize, "invalid ancillary data buffer length")
        return self.recv(bufsize, flags), [], 0, None

    def recvmsg_into(self, buffers: Any, ancbufsize: int = 0, flags: int = 0) -> Any:
        """On SMC: ``(nbytes, [], 0, None)``, the bytes one :meth:`recv_into` returns spread
        over ``buffers`` in order."""
        if self._live() is None:
            if self._clc_guard:
                self._tcp_read(flags)
            return super().recvmsg_into(buffers, ancbufsize, flags)
        _size(ancbufsize, "invalid ancillary data buffer length")
        try:
            parts = list(buffers)
        except TypeError:
            raise TypeError("recvmsg_into() argument 1 must be an iterable") from None
        try:
            views = [_recv_view(b, "recvmsg_into") for b in parts]
        except TypeError:
            raise TypeError(
                "recvmsg_into() argument 1 must be an iterable of single-segment read-write buffers"
            ) from None
        if len(views) == 1:
            return self.recv_into(views[0], 0, flags), [], 0, None
        scratch = bytearray(sum(v.nbytes for v in views))
        n = self.recv_into(scratch, 0, flags)
        off = 0
        for v in views:
            k = min(v.nbytes, n - off)
            v[:k] = scratch[off : off + k]
            off += k
        return n, [], 0, None

    # -- closing -------------------------------------------------------------------------------

    def shutdown(self, how: int) -> None:
        smc = self._live()
        if smc is None:
            return super().shutdown(how)
        how = how if type(how) is int else _integer(how)
        if how > _INT_MAX or how < -_INT_MAX - 1:
            raise OverflowError("Python int too large to convert to C int")
        if how not in (_socket.SHUT_RD, _socket.SHUT_WR, _socket.SHUT_RDWR):
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        if how in (_socket.SHUT_RD, _socket.SHUT_RDWR) and not smc.rd_shut:
            smc.rd_shut = True
            smc.channel.shutdown_read()
        if how in (_socket.SHUT_WR, _socket.SHUT_RDWR) and not smc.wr_shut:
            smc.wr_shut = True
            smc.channel.shutdown_write()
        smc.notify(messages.Shutdown(how))
        # The TCP connection follows, as the kernel's smc_shutdown shuts its clcsock down the
        # same way (smc_close_active does it for SHUT_RDWR): the peer's TCP sees our FIN and
        # `ss` shows the half-close, while the data's EOF travels in the channel. A TCP reset
        # under the channel (ENOTCONN) changes nothing for the connection.
        try:
            _csocket.socket.shutdown(self, how)
        except OSError as e:
            if e.errno != errno.ENOTCONN:
                raise
        return None

    def _real_close(self, _ss: Any = _csocket.socket) -> None:
        pending = self._pending
        if pending is not None and not self._drop_unanswered(pending):
            with contextlib.suppress(OSError):  # answered: its channel is closed as any other
                self._settle()
        smc, self._smc = self._smc, None
        self._gone = True
        if smc is not None:
            _unindex(smc.fd)
        if smc is not None and smc.holders > 1:  # a dup() holds the connection on
            smc.holders -= 1
        elif smc is not None:
            try:  # aborts instead when received data is unread (the peer sees a reset)
                smc.channel.close()
            finally:
                # The hang-up is the daemon's notice: it reads the last counters from the DMBs
                # and releases the record (a CLOSE message first would only make it do that
                # work twice, so none is sent; the protocol still accepts one).
                if smc.control is not None:
                    smc.control.close()
                if smc.relay_closer is not None:
                    smc.relay_closer()
        _ss.close(self)

    def abort(self) -> None:
        """Close at once, resetting the connection (the peer sees ECONNRESET), as SO_LINGER 0."""
        smc = self._smc
        if smc is None and self._pending is not None:
            with contextlib.suppress(OSError):
                smc = self._settle()
        if smc is not None:
            smc.channel.abort()
        else:
            with contextlib.suppress(OSError):
                self.setsockopt(_socket.SOL_SOCKET, _socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.close()

    def __del__(self) -> None:
        """Dropped without close(): close the channel as close() would, then the TCP socket (a
        deferred handoff is given up unanswered or settled without waiting, as ``close()``
        does; a finalizer must not wait)."""
        if getattr(self, "_smc", None) is not None or getattr(self, "_pending", None) is not None:
            with contextlib.suppress(Exception):
                self._real_close()
        super().__del__()  # type: ignore[misc]

    def leave_channel(self) -> None:
        """Continue on TCP: what ``detach()`` needs before the descriptor is used directly
        (``ssl`` when its ``SSLSocket`` does not derive from ours, see
        :mod:`smc_handoff.tls`; C code given the number). Before any byte
        moved over the channel at once (the TCP stream is clean after CLC; with TLS at both
        ends both leave before the handshake). After data moved (STARTTLS: a plaintext
        exchange, then TLS) only together with the peer, which leaves in its own
        ``wrap_socket`` within :data:`LEAVE_WAIT_S`, with nothing unread on either side
        (:meth:`Channel.leave_together`): the TCP stream then goes on from that point in both
        directions. Otherwise ``OSError(EOPNOTSUPP)``, the channel as it was. Nothing to do in
        TCP mode."""
        smc = self._smc
        if smc is None and self._pending is not None:
            smc = self._settle()
        if smc is None:
            return
        if self._gone:
            raise _ebadf()
        ch = smc.channel
        if smc.holders > 1:
            raise OSError(errno.EOPNOTSUPP, "a dup()ed SMC socket cannot leave its channel")
        moved = smc.sent or smc.received or (ch.readable() and not ch.eof)
        if moved and smc.info.mode != messages.Mode.SMCD:
            raise OSError(  # its peer is smcd's relay, which cannot go on over TCP
                errno.EOPNOTSUPP, "an SMC-R socket that carried data cannot leave its channel"
            )
        if moved and not self._leave_together(smc):
            raise OSError(
                errno.EOPNOTSUPP,
                "an SMC socket that carried data can leave its channel (for TLS, as STARTTLS "
                "does) only together with its peer, with nothing unread on either side: the "
                f"peer did not leave too within {LEAVE_WAIT_S:g} s",
            )
        self._smc = None
        _unindex(smc.fd)
        ch.close()
        smc.notify(messages.Close(False, smc.sent, smc.received))
        if smc.control is not None:
            smc.control.close()
        self._fallback = Fallback(
            messages.FALLBACK_DETACHED,
            "DETACHED",
            f"the application took the TCP socket over after {smc.sent} bytes sent and "
            f"{smc.received} received over SMC, together with its peer (e.g. STARTTLS)"
            if moved
            else "the application took the TCP socket over before any data moved (e.g. for TLS)",
        )

    def _leave_together(self, smc: _Smc) -> bool:
        """:meth:`Channel.leave_together` with this process's other threads kept off the
        channel."""
        ch = smc.channel
        deadline = time.monotonic() + LEAVE_WAIT_S
        if not ch.rx_lock.acquire(timeout=LEAVE_WAIT_S):
            return False
        try:
            if not ch.tx_lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
                return False
            try:
                return ch.leave_together(max(0.0, deadline - time.monotonic()))
            finally:
                ch.tx_lock.release()
        finally:
            ch.rx_lock.release()

    def detach(self) -> int:
        """Give up the TCP descriptor (after :meth:`leave_channel` on SMC). While ``ssl``
        takes this socket over to run TLS over its channel (:func:`handing_to_tls`), the
        ``SSLSocket`` it made holds the connection already (its own copy of the descriptor,
        as ``dup()`` makes): this object only lets go of its hold and its copy."""
        if _tls_takeover.get() is self:
            self._closed = True  # what socket.detach() does before giving the number away
            self._real_close()
            return -1
        self.leave_channel()
        return super().detach()

    def dup(self) -> Self:
        """On SMC: another socket object for the same connection (its own copy of the TCP
        descriptor), as ``dup(2)`` gives another descriptor for one socket: the connection
        ends with the last of them to close."""
        smc = self._live()
        if smc is None:
            return super().dup()
        fd = os.dup(_BaseSocket.fileno(self))
        try:
            twin = self.__class__(_family_of(self), _type_of(self), _proto_of(self), fileno=fd)
        except BaseException:
            os.close(fd)
            raise
        twin._join(self)
        return twin

    def accept(self) -> tuple[_socket.socket, Any]:
        """Plain accept, returning an :class:`SmcSocket` in TCP mode (see :class:`SmcServer`)."""
        fd, addr = self._accept()  # type: ignore[attr-defined]
        conn = SmcSocket(_family_of(self), _type_of(self), _proto_of(self), fileno=fd)
        if _socket.getdefaulttimeout() is None and self.gettimeout():
            conn.setblocking(True)
        return conn, addr


in_place: set[type[SmcSocket]] = {SmcSocket}
"""The classes of a fresh accepted connection that :func:`accepted` hands off in place, so
that the program keeps the object ``accept()`` made, of the class it made (smc-run adds its
``socket.socket``: trio, for one, takes only sockets whose type is exactly that)."""


# --- public constructors ----------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _untuned_rcvbuf() -> int:
    """SO_RCVBUF of a TCP socket nobody tuned: ``net.ipv4.tcp_rmem[1]`` (this namespace's)."""
    try:
        return int(Path("/proc/sys/net/ipv4/tcp_rmem").read_text().split()[1])
    except (OSError, ValueError, IndexError):
        return 131072  # the kernel's default


def _rcvbuf_hint(sock: _socket.socket) -> int:
    """The DMB size the program asked for with ``SO_RCVBUF``, taken as the kernel's AF_SMC
    takes it for its RMB (``__smc_buf_create``: ``sk_rcvbuf / 2``, i.e. the value given to
    ``setsockopt``, capped at ``rmem_max``; rounded up to 16 KiB << n as
    ``smc_compress_bufsize``, at most 1 MiB). 0 when the program did not set it: then the
    daemon's default applies (``buffers.default_dmb_size``, chosen by measurement, where the
    kernel has ``net.smc.rmem``). An accepted socket inherits its listener's setting. Asking
    for exactly half of ``tcp_rmem[1]`` looks like no setting. ``SO_SNDBUF`` sizes nothing:
    the channel writes straight into the peer's DMB, as loopback-ism's no-copy send buffer
    (``smcd_buf_attach``) does."""
    try:
        value = _BaseSocket.getsockopt(sock, _socket.SOL_SOCKET, _socket.SO_RCVBUF)
    except OSError:
        return 0
    if value == _untuned_rcvbuf():
        return 0
    want = value // 2
    return next((size for size in layout.DMB_SIZES if size >= want), layout.DMB_SIZES[-1])


def wrap(sock: _socket.socket, server_side: bool = False, *, dmb_size: int = 0) -> SmcSocket:
    """Hand a connected TCP socket to smcd; returns an :class:`SmcSocket` owning it.

    ``sock`` is detached (its descriptor now belongs to the result, as with ``ssl``).
    ``server_side`` says which half this is (True after ``accept``). ``dmb_size`` is a hint for
    the receive buffer (16 KiB << n, or 0 for the daemon's choice). Never raises because smcd is
    absent: the result is then in TCP mode with ``.fallback`` set. Raises
    :class:`ConnectionResetError` or :class:`TimeoutError` (``ETIMEDOUT``), the connection reset,
    when smcd failed after the TCP stream had carried CLC or stopped answering
    (:mod:`smc_handoff.handoff`): never TCP with protocol bytes in the data.
    """
    return _wrap(sock, server_side, dmb_size, fail=True)


def _wrap(sock: _socket.socket, server_side: bool, dmb_size: int, *, fail: bool) -> SmcSocket:
    if isinstance(sock, SmcSocket) and sock._settle() is not None:  # on a channel already
        return sock
    family, kind = _family_of(sock), _type_of(sock)
    if family not in _STREAM_FAMILIES or kind != _SOCK_STREAM:
        raise ValueError("only connected AF_INET/AF_INET6 stream sockets can use SMC")
    sock.getpeername()  # OSError(ENOTCONN) for a socket that is not connected
    timeout = sock.gettimeout()
    smc = SmcSocket(family, kind, _proto_of(sock), fileno=sock.detach())
    try:
        smc._handoff(server_side, dmb_size, timeout, fail=fail)  # applies ``timeout`` once
    except BaseException:
        smc.close()
        raise
    return smc


def connect(
    address: tuple[str, int],
    timeout: float | None = None,
    *,
    source_address: tuple[str, int] | None = None,
    dmb_size: int = 0,
) -> SmcSocket:
    """``socket.create_connection`` then :func:`wrap` (client side); the SYN asks for SMC's
    TCP option when smcd detects peers (:mod:`smc_handoff.peer_option`)."""
    sock = peer_option.create_connection(address, timeout, source_address)
    return wrap(sock, server_side=False, dmb_size=dmb_size)


def accepted(
    conn: _socket.socket,
    reg: Registration,
    dmb_size: int = 0,
    defer: Callable[[SmcSocket], None] | None = None,
) -> SmcSocket:
    """An accepted connection as an SmcSocket: handed off while the listener is registered
    (only then can a same-host client have proposed SMC), else plain TCP with the reason.
    A fresh TCP-mode SmcSocket (from :meth:`SmcServer.accept`) is handed off in place. A
    handoff that cannot give the stream back as it was returns the socket reset (its first
    call fails with ECONNRESET, as after a client's reset) rather than failing ``accept``.
    ``defer`` (smc-run's ``accept()``, for a fresh socket): the handshake's end is awaited by
    the connection's first use, not here (see :meth:`SmcSocket._handoff`)."""
    fresh = None
    if isinstance(conn, SmcSocket) and type(conn) in in_place and conn._smc is None:
        fresh = conn if conn._fallback is None and not conn._gone else None
    if reg.active:
        if fresh is None:
            sock = _wrap(conn, True, dmb_size, fail=False)
            if defer is not None:
                defer(sock)
            return sock
        try:
            fresh.getpeername()  # as wrap(): OSError(ENOTCONN) when the client is gone already
            fresh._handoff(True, dmb_size, fail=False, defer=defer)  # keeps its timeout
        except BaseException:
            fresh.close()
            raise
        return fresh
    if fresh is not None:
        plain = fresh
    else:
        timeout = conn.gettimeout()
        fd = conn.detach()
        plain = SmcSocket(_family_of(conn), _type_of(conn), _proto_of(conn), fileno=fd)
        plain.settimeout(timeout)
    plain._fallback = reg.fallback or messages.daemon_unavailable("listener not registered")
    if clc_at_head(plain):  # a client proposed SMC (e.g. before smcd went away): none will answer
        reset(plain)
        plain._fallback = messages.daemon_unavailable(
            "a CLC Proposal waits and no daemon answers it: connection reset"
        )
    else:
        plain._clc_guard = True  # a Proposal may still come (a configured peer's daemon)
    if defer is not None:
        defer(plain)
    return plain


class SmcServer:
    """A listening TCP socket registered with smcd (LISTEN) whose ``accept`` hands off.

    Registration lets same-host clients know this listener speaks SMC. While registered,
    ``accept`` offers each connection to the daemon (ACCEPT), which hands plain TCP clients back
    untouched; when the daemon is unavailable, accepted sockets are plain TCP with the reason
    (``.fallback`` of the server and of each accepted socket).
    """

    def __init__(self, sock: _socket.socket, *, dmb_size: int = 0) -> None:
        self.socket = sock
        self.dmb_size = dmb_size
        self._reg = Registration(sock)

    @property
    def registered(self) -> bool:
        return self._reg.active

    @property
    def registration(self) -> Registration:
        """The LISTEN registration (what :func:`accepted` needs, e.g. on an event loop)."""
        return self._reg

    @property
    def listener_id(self) -> int | None:
        return self._reg.listener_id

    @property
    def fallback(self) -> Fallback | None:
        """Why the listener is not registered (None while it is)."""
        return self._reg.fallback

    def accept(self) -> tuple[SmcSocket, Any]:
        listener = self.socket
        if type(listener).accept is not _BaseSocket.accept:
            conn, addr = listener.accept()  # a socket class of its own: let it accept
            return accepted(conn, self._reg, self.dmb_size), addr
        # socket.accept(), making the SmcSocket at once (not a socket to detach and re-make).
        fd, addr = listener._accept()  # type: ignore[attr-defined]
        smc = SmcSocket(_family_of(listener), _type_of(listener), _proto_of(listener), fileno=fd)
        if _socket.getdefaulttimeout() is None and listener.gettimeout():
            smc.setblocking(True)
        return accepted(smc, self._reg, self.dmb_size), addr

    def fileno(self) -> int:
        return self.socket.fileno()

    def getsockname(self) -> Any:
        return self.socket.getsockname()

    def settimeout(self, timeout: float | None) -> None:
        self.socket.settimeout(timeout)

    def gettimeout(self) -> float | None:
        return self.socket.gettimeout()

    def setblocking(self, flag: bool) -> None:
        self.socket.setblocking(flag)

    def close(self) -> None:
        self._reg.close()
        self.socket.close()

    def __enter__(self) -> SmcServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = f"listener {self.listener_id}" if self.listener_id else f"tcp ({self.fallback})"
        return f"<SmcServer {self.socket.getsockname()!r} {state}>"


def listen(
    address: tuple[str, int],
    backlog: int | None = None,
    *,
    family: int = _socket.AF_INET,
    reuse_port: bool = False,
    dmb_size: int = 0,
) -> SmcServer:
    """``socket.create_server`` then register it with smcd: an :class:`SmcServer`."""
    sock = _socket.create_server(address, family=family, backlog=backlog, reuse_port=reuse_port)
    return SmcServer(sock, dmb_size=dmb_size)
