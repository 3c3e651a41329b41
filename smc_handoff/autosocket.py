"""smc-run's socket class and its ``-v`` lines: what :mod:`smc_handoff.run` loads once the program
imports :mod:`socket`.

``socket.socket`` becomes :class:`AutoSocket`, a :class:`~smc_handoff.socket.SmcSocket` that
offers itself to smcd after a blocking ``connect()`` (client half) and registers
``listen()``-ing sockets (or, inherited by descriptor, at their first ``accept()``) so that
``accept()`` hands each connection off (server half); :func:`patch_ssl` keeps TLS on the channel.
:mod:`smc_handoff.run` has the rest of smc-run: the hooks installed before the program's first
line, which load this module (and with it the library) only when the program imports
:mod:`socket`, so that a program that never does starts as fast as under plain ``python``.
"""

from __future__ import annotations

import _socket as _csocket
import contextlib
import functools
import os
import socket as _socket
import sys
import weakref
from collections.abc import Callable
from typing import Any

from smc_handoff import peer_option
from smc_handoff.fdmap import is_eventfd
from smc_handoff.handoff import Registration
from smc_handoff.socket import (
    SmcSocket,
    accepted,
    handing_to_tls,
    in_place,
    may_defer_accept,
)

__all__ = [
    "AutoSocket",
    "load",
    "patch_ssl",
    "report",
    "report_tcp",
    "take_deferred",
]

_verbose = False


# Connections accepted by an event loop's listener, waiting for their handoff off the loop
# (smc_handoff.aio_loop): the listener's registration.
_deferred: weakref.WeakKeyDictionary[SmcSocket, Registration] = weakref.WeakKeyDictionary()


def _say(text: str) -> None:
    """One ``-v`` line, written whole (``print`` writes the newline apart, so lines of the
    handoff threads ran into each other)."""
    sys.stderr.write(f"smc-run[{os.getpid()}]: {text}\n")


def report(op: str, sock: SmcSocket, peer: Any) -> None:
    """``smc-run -v``: one line per connection, its mode and, on TCP, why."""
    if not _verbose:
        return
    reason = f" ({sock.fallback})" if sock.fallback is not None else ""
    conn = f" conn {sock.conn_id}" if sock.conn_id is not None else ""
    _say(f"{op} {peer}: {sock.mode}{conn}{reason}")


def _unreported(sock: SmcSocket) -> None:
    return None


def _reporter(peer: Any) -> Callable[[SmcSocket], None]:
    """What a deferred connect calls once settled: ``smc-run -v``'s line, or nothing."""
    if not _verbose:
        return _unreported
    return lambda sock: report("connect", sock, peer)


def _accept_reporter(peer: Any) -> Callable[[SmcSocket], None]:
    """What a deferred accept calls once settled: ``smc-run -v``'s line, or nothing."""
    if not _verbose:
        return _unreported
    return lambda sock: report("accept", sock, peer)


def report_tcp(op: str, peer: Any, reason: str) -> None:
    """``smc-run -v`` for a connection the upgrade cannot reach (e.g. uvloop's)."""
    if _verbose:
        _say(f"{op} {peer}: tcp ({reason})")


def take_deferred(conn: Any) -> Registration | None:
    """The registration of the listener that accepted ``conn`` for an event loop, which hands
    it off now (once): None when there is nothing to hand off."""
    try:
        return _deferred.pop(conn, None)
    except TypeError:  # not weak-referenceable: not ours
        return None


# The C socket's plain ints: ``socket.socket.family``/``.type`` convert to enum members, which
# costs microseconds for a check that runs twice per connect.
_family_of = _csocket.socket.family.__get__
_type_of = _csocket.socket.type.__get__
_IP_FAMILIES = (int(_socket.AF_INET), int(_socket.AF_INET6))
_SOCK_STREAM = int(_socket.SOCK_STREAM)
_AF_UNIX = int(_socket.AF_UNIX)


def _eligible(sock: _socket.socket) -> bool:
    return _family_of(sock) in _IP_FAMILIES and _type_of(sock) == _SOCK_STREAM


class AutoSocket(SmcSocket):
    """What ``socket.socket`` is under smc-run: a plain socket until a TCP connection exists."""

    __module__ = "smc_handoff.run"  # where it was defined before, and is found (run.__getattr__)
    _registration: Registration | None
    loop_connects = False
    """asyncio connects this socket (its ``sock_connect``), and hands it off itself."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._registration = None
        self._loop_accepts = False  # an event loop accepts: it hands connections off itself
        self._late_listener = True  # see accept(): cleared once registering was decided

    def _upgrade_client(self, address: Any) -> None:
        """Offer the connection to smcd; its reply is read when the socket is first used
        (see ``SmcSocket._handoff``'s ``defer``: a thread that connects and then accepts)."""
        if _eligible(self) and self.gettimeout() != 0 and self._smc is None:
            self._handoff(server_side=False, defer=_reporter(address))

    def connected_or_pending(self) -> bool:
        """On SMC, handed off, or a connected TCP socket (not one ``connect()`` is still to
        come for: what ``ssl`` wraps before connecting)."""
        if self._smc is not None or self._pending is not None:
            return True
        try:
            self.getpeername()
        except OSError:
            return False
        return True

    @property
    def can_upgrade(self) -> bool:
        """A TCP stream socket no handoff was tried on yet (what an event loop hands off)."""
        return _eligible(self) and self.mode == "tcp" and self.fallback is None

    def offer_client(self, address: Any) -> None:
        """Send this connected socket's CONNECT to smcd and return at once, whatever the
        socket's timeout: its answer is read by :meth:`settle` (an event loop calls it once
        :meth:`answer_fd` is readable) or by the socket's first use; ``-v``'s line then."""
        if self.can_upgrade:
            self._handoff(server_side=False, defer=_reporter(address))

    def hand_off_client(self, address: Any, dmb_size: int = 0) -> AutoSocket:
        """Hand this connected socket off now (blocking: an event loop calls it in the
        handoff threads). Raises, the connection reset, as :func:`smc_handoff.wrap` does."""
        self._handoff(server_side=False, dmb_size=dmb_size)
        report("connect", self, address)
        return self

    def serve_from_loop(self) -> None:
        """An event loop serves this listener: register it (once) and leave the handoff of
        accepted connections to the loop (see :func:`take_deferred`)."""
        if not _eligible(self):
            self._late_listener = False
            if self._registration is not None:
                self._registration.close()
                self._registration = None
            return
        self._loop_accepts = True
        if self._registration is None:
            self._register()

    def _register(self) -> None:
        self._registration = Registration(self)
        if _verbose:
            reg = self._registration
            state = (
                f"registered as listener {reg.listener_id}"
                if reg.listener_id is not None
                else f"tcp ({reg.fallback})"
            )
            _say(f"listen {self.getsockname()}: {state}")

    def mark_for_handoff(self) -> None:
        """Ask for SMC's TCP option on the SYN of a socket an event loop connects without
        blocking and will then hand off (:mod:`smc_handoff.aio_loop`)."""
        if self.can_upgrade:
            self._premarked = peer_option.request_or_mark(self)

    def _mark(self, address: Any) -> None:
        """Before ``connect()``: ask for SMC's TCP option on the SYN of a socket we will hand
        off. A non-blocking one is not (it stays on TCP): ``smc-run -v`` says so, unless asyncio
        connects it (the loop hands its sockets off itself and reports them)."""
        if not (_eligible(self) and self._smc is None):
            return
        if self.gettimeout() != 0:
            self._premarked = peer_option.request_or_mark(self)
        elif _verbose and not self.loop_connects:
            report_tcp("connect", address, "a non-blocking connect of the program's own "
                       "event loop: smc-run hands off blocking connects, asyncio's and "
                       "trio's")  # fmt: skip

    def connect(self, address: Any) -> None:
        self._mark(address)
        super().connect(address)
        self._upgrade_client(address)

    def connect_ex(self, address: Any) -> int:
        self._mark(address)
        rc = super().connect_ex(address)
        if rc == 0:
            self._upgrade_client(address)
        return rc

    def listen(self, *backlog: int) -> None:
        super().listen(*backlog)
        self._late_listener = False
        if _eligible(self) and self.gettimeout() != 0 and self._registration is None:
            self._register()

    def _register_late(self) -> None:
        """The first ``accept()`` on a listening socket this object never called ``listen()``
        on registers it: a listener inherited by descriptor (systemd's socket activation,
        ``socket.fromfd`` in a worker, a socket a parent passed on). Without it the worker's
        connections stayed on TCP, and where another process had registered the same listener
        (the parent that called ``listen()``) each client waited ``timeouts.clc_wait`` for a
        server half that never came, then fell back."""
        self._late_listener = False
        if not (_eligible(self) and self.gettimeout() != 0):
            return
        try:
            if not self.getsockopt(_socket.SOL_SOCKET, _socket.SO_ACCEPTCONN):
                return  # (accept() then fails as it fails)
        except OSError:
            return
        self._register()

    def accept(self) -> tuple[_socket.socket, Any]:
        if self._late_listener and self._registration is None:
            self._register_late()
        fd, addr = self._accept()  # type: ignore[attr-defined]
        # Of the class socket.socket is now, as the stdlib's accept() makes it: a program (or
        # trio, which refuses any other type) may check that its connection is a socket.socket.
        conn = AutoSocket(_family_of(self), _type_of(self), self.proto, fileno=fd)
        if _socket.getdefaulttimeout() is None and self.gettimeout():
            conn.setblocking(True)
        reg = self._registration
        if reg is None:
            if _verbose and _eligible(self):
                report_tcp("accept", addr, "a listener already non-blocking when it began "
                           "listening (an event loop of the program's own): smc-run hands off "
                           "the connections of blocking listeners, asyncio's and "
                           "trio's")  # fmt: skip
            return conn, addr
        if self._loop_accepts:
            _deferred[conn] = reg
            return conn, addr
        if may_defer_accept():
            # The handshake ends in whatever serves the connection (a handler thread, a forked
            # child), not in the accept loop: see SmcSocket._handoff's ``defer``.
            return accepted(conn, reg, defer=_accept_reporter(addr)), addr
        smc = accepted(conn, reg)
        report("accept", smc, addr)
        return smc, addr

    def sendmsg(self, buffers: Any, ancdata: Any = (), flags: int = 0, address: Any = None) -> int:
        """An SMC connection's ``fileno()`` sent with ``SCM_RIGHTS`` (an eventfd the receiver
        could not use as a socket) goes as a relay's socket instead
        (:func:`smc_handoff.child_relay.relay_rights`)."""
        if ancdata and _family_of(self) == _AF_UNIX:
            ancdata = list(ancdata)
            if any(_carries_eventfd(item) for item in ancdata):
                from smc_handoff import child_relay

                ancdata = child_relay.relay_rights(ancdata) or ancdata
        return super().sendmsg(buffers, ancdata, flags, address)

    def detach(self) -> int:
        """Whoever takes the descriptor (``ssl``) will not hand connections off: unregister."""
        self._late_listener = False
        if self._registration is not None:
            self._registration.close()
            self._registration = None
        return super().detach()

    def _real_close(self, *args: Any) -> None:
        reg = getattr(self, "_registration", None)
        if reg is not None:
            reg.close()
            self._registration = None
        super()._real_close(*args)


in_place.add(AutoSocket)


def _carries_eventfd(item: Any) -> bool:
    """Is ``item`` (``sendmsg`` ancillary data) an ``SCM_RIGHTS`` entry with an eventfd?"""
    try:
        level, kind, data = item
        if level != _csocket.SOL_SOCKET or kind != _csocket.SCM_RIGHTS:
            return False
        raw = memoryview(data).cast("B")
    except (TypeError, ValueError):
        return False  # the send itself says what is wrong with it
    whole = len(raw) - len(raw) % 4
    return any(is_eventfd(fd) for fd in raw[:whole].cast("i"))


def patch_ssl(ssl: Any) -> None:
    """Make ``ssl`` run TLS over the channel of a connection on SMC (:mod:`smc_handoff.tls`):
    the ``SSLSocket`` it makes is another socket object for the connection (a class deriving
    from the context's ``sslsocket_class`` and :class:`SmcSocket`, unless that one derives from
    ours already, as when ``ssl`` was imported after smc-run installed itself) and OpenSSL's
    records go through the channel. An ``SSLSocket`` of ours is upgraded as any socket: one
    wrapped before ``connect()`` is handed off by its ``connect()`` (then its handshake runs over
    the channel), a wrapped listener keeps its registration (:func:`_wrap_listener`)."""
    from smc_handoff.tls import ChannelTls, TlsAfterConnect

    if getattr(ssl.SSLContext, "_smc_tls", False):
        return  # (smc-run's install and a library's first SMC connection both ask)
    ssl.SSLContext._smc_tls = True
    wrap_socket = ssl.SSLContext.wrap_socket
    wrap_fd = ssl.SSLContext._wrap_socket
    combined: dict[type, type] = {}

    def over_channel(cls: type) -> Any:
        if issubclass(cls, SmcSocket):
            return cls
        if cls not in combined:
            combined[cls] = type(cls.__name__, (cls, SmcSocket), {"__module__": cls.__module__})
        return combined[cls]

    @functools.wraps(wrap_socket)
    def smc_wrap_socket(
        self: Any,
        sock: Any,
        server_side: bool = False,
        do_handshake_on_connect: bool = True,
        suppress_ragged_eofs: bool = True,
        server_hostname: Any = None,
        session: Any = None,
    ) -> Any:
        if isinstance(sock, SmcSocket):
            if isinstance(sock, AutoSocket) and sock._registration is not None:
                return _wrap_listener(sock, lambda: wrap_socket(
                    self, sock, server_side, do_handshake_on_connect, suppress_ragged_eofs,
                    server_hostname, session))  # fmt: skip
            if sock.mode != "tcp":  # (mode: a deferred handoff's answer)
                with handing_to_tls(sock):
                    tls = over_channel(self.sslsocket_class)._create(
                        sock=sock,
                        server_side=server_side,
                        do_handshake_on_connect=do_handshake_on_connect,
                        suppress_ragged_eofs=suppress_ragged_eofs,
                        server_hostname=server_hostname,
                        context=self,
                        session=session,
                    )
                if _verbose:
                    with contextlib.suppress(OSError):
                        report("ssl", tls, tls.getpeername())
                return tls
        return wrap_socket(self, sock, server_side, do_handshake_on_connect,
                           suppress_ragged_eofs, server_hostname, session)  # fmt: skip

    def smc_wrap_fd(
        self: Any,
        sock: Any,
        server_side: bool,
        server_hostname: Any = None,
        *,
        owner: Any = None,
        session: Any = None,
    ) -> Any:
        def make() -> Any:
            if isinstance(sock, SmcSocket) and sock.mode != "tcp":  # an SSLSocket on SMC
                incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
                obj = self._wrap_bio(incoming, outgoing, server_side, server_hostname,
                                     owner=owner, session=session)  # fmt: skip
                return ChannelTls(obj, incoming, outgoing, sock)
            return wrap_fd(self, sock, server_side, server_hostname, owner=owner, session=session)

        if isinstance(sock, AutoSocket) and not sock.connected_or_pending():
            return TlsAfterConnect(make)  # SSLSocket.connect(): the handoff comes after this
        return make()

    ssl.SSLContext.wrap_socket = smc_wrap_socket
    ssl.SSLContext._wrap_socket = smc_wrap_fd


def _wrap_listener(sock: AutoSocket, wrap: Callable[[], Any]) -> Any:
    """``ssl`` wrapping a registered listener (``httpd.socket = ctx.wrap_socket(httpd.socket,
    server_side=True)``): the ``SSLSocket`` takes the registration over, so that its
    ``accept()`` hands connections off and wraps them, TLS over their channels."""
    reg, sock._registration = sock._registration, None
    try:
        tls = wrap()
    except BaseException:
        if reg is not None:
            reg.close()
        raise
    if isinstance(tls, AutoSocket):
        tls._registration = reg
        tls._late_listener = False
        if reg is not None:
            reg.rebind(tls)
    elif reg is not None:
        reg.close()  # a class of the program's own that is not ours: it hands nothing off
    return tls


def load(*, verbose: bool) -> None:
    """Make ``socket.socket`` :class:`AutoSocket` (smc-run's :func:`~smc_handoff.run.install`,
    once :mod:`socket` is imported); ``verbose``: ``-v``'s lines."""
    global _verbose
    _verbose = verbose
    _socket.socket = AutoSocket  # type: ignore[misc]
