"""The asyncio drivers of the sans-IO CLC negotiation over borrowed TCP sockets: one half of
either role, SMC-D and SMC-R (:func:`drive`), or both halves of a same-host connection
(:func:`drive_pair`).

The handoff server receives, with SCM_RIGHTS, its own copy of the application's connected TCP
socket. That copy shares the *open file description* with the application's descriptor, so two
rules follow:

- **File status flags are shared.** Setting ``O_NONBLOCK`` on our copy would change the
  application's socket under its feet. We never touch them: every ``recv``/``send`` carries
  ``MSG_DONTWAIT`` (and ``MSG_NOSIGNAL``), and readiness comes from the event loop
  (a reader on :mod:`.fdwatch`, a writer with ``add_writer``, removed before it is closed).
- **Bytes are shared.** Anything we read is gone for the application. So we read exactly what
  the negotiator asks for (:attr:`~smcd_daemon.protocol.negotiate.Negotiation.bytes_needed`:
  the 8-byte header, then the rest of that one message), and a server half first *peeks*
  (``MSG_PEEK``) at the client's first bytes: a plain TCP client's bytes — or its silence, for a
  client that waits for the server to speak first — are left exactly as they were. The pair
  driver, which wrote the message itself, reads its length at once; bytes that are not that
  message fail both halves, and the connection is reset, so nothing read too far ever reaches
  an application.

Every wait is bounded: the proposal peek by ``timeouts.proposal_wait``, each CLC message by the
negotiator's :attr:`timeout` (``timeouts.clc_wait``), each write by the same.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol, overload

from smcd_daemon.adapters.fdwatch import fd_watch
from smcd_daemon.errors import SmcError
from smcd_daemon.protocol.negotiate import (
    ClientNegotiation,
    FallbackOutcome,
    Negotiation,
    Outcome,
    Server,
    ServerNegotiation,
    SmcdLoopbackOutcome,
    SmcrOutcome,
    Step,
    classify_first_bytes,
    peer_decline_fallback,
)
from smcd_daemon.wire.clc import decode as decode_clc
from smcd_daemon.wire.clc_base import EYECATCHERS, ClcType
from smcd_daemon.wire.clc_decline import Decline
from smcd_daemon.wire.reasons import explain

__all__ = [
    "BorrowedTcp",
    "BorrowedTcpError",
    "FirstLinkLayer",
    "PeekResult",
    "answer_too_late",
    "client_gave_up",
    "drive",
    "drive_pair",
    "peek_proposal",
]

log = logging.getLogger(__name__)

_DONTWAIT = socket.MSG_DONTWAIT
_PEEK = socket.MSG_PEEK | socket.MSG_DONTWAIT
_SEND_FLAGS = socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL
_EOF_ERRNOS = (errno.ECONNRESET, errno.EPIPE, errno.ENOTCONN, errno.ETIMEDOUT)


class BorrowedTcpError(SmcError):
    """The descriptor handed over is not a connected TCP socket (answered with ERROR BAD_FDS)."""


class _Eof(Exception):
    """The peer closed (or reset) the TCP connection."""


def _wake(fut: asyncio.Future[bool], ready: bool) -> None:
    if not fut.done():
        fut.set_result(ready)


def _stopped(fut: asyncio.Future[bool], _stop: asyncio.Future[Any]) -> None:
    if not fut.done():
        fut.set_result(False)


class BorrowedTcp:
    """Our copy of an application's connected TCP socket, for the duration of one handshake.

    Owns ``fd`` (closed by :meth:`close`). Never changes the descriptor's file status flags.
    """

    def __init__(self, fd: int, loop: asyncio.AbstractEventLoop | None = None) -> None:
        # proto given: CPython skips its SO_PROTOCOL query (family and type are checked below).
        try:
            sock = socket.socket(fileno=fd, proto=0)
        except OSError as e:
            os.close(fd)
            raise BorrowedTcpError(f"the descriptor is not a socket ({e.strerror or e})") from e
        self.sock = sock
        try:
            if sock.family not in (socket.AF_INET, socket.AF_INET6):
                raise BorrowedTcpError(f"not an IP socket (family {sock.family!r})")
            if sock.type != socket.SOCK_STREAM:
                raise BorrowedTcpError(f"not a stream socket (type {sock.type!r})")
            self.local = sock.getsockname()
            try:
                self.peer = sock.getpeername()  # ENOTCONN for a listening socket too
            except OSError:
                if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                    raise BorrowedTcpError("a listening socket, not a connected one") from None
                raise
            self.inode = os.fstat(fd).st_ino
        except OSError as e:
            sock.close()
            raise BorrowedTcpError(f"not a connected TCP socket ({e.strerror or e})") from e
        except BorrowedTcpError:
            sock.close()
            raise
        self.fd = fd
        self._loop = loop = asyncio.get_running_loop() if loop is None else loop
        self._watch = fd_watch(loop)
        self._reading = False  # our reader is registered (with the watch)
        self._reader: asyncio.Future[bool] | None = None

    def close(self) -> None:
        """Give our copy back (the application's descriptor stays open)."""
        if self._reading:
            self._reading = False
            self._watch.remove(self.fd)
        self.sock.close()

    # -- readiness --------------------------------------------------------------------------

    async def _wait(
        self, *, write: bool, timeout: float, stop: asyncio.Future[Any] | None = None
    ) -> bool:
        """Wait until the socket is readable/writable; False on timeout. (One future and one
        timer handle: cheaper than ``asyncio.timeout``, and this runs on every handshake.)

        The reader stays registered from the first read wait to :meth:`close` (a handshake waits
        for reading two or three times; registering costs two ``epoll_ctl`` calls each time):
        readiness that nobody waits for unregisters it again (:meth:`_readable`), so bytes left
        in the socket never make the loop spin."""
        loop = self._loop
        fut: asyncio.Future[bool] = loop.create_future()
        if write:
            loop.add_writer(self.fd, _wake, fut, True)
        else:
            if not self._reading:
                self._watch.add(self.fd, self._readable)
                self._reading = True
            self._reader = fut
        timer = loop.call_later(max(timeout, 0.0), _wake, fut, False)
        if stop is not None:
            stop.add_done_callback(fut_waker := functools.partial(_stopped, fut))
        try:
            return await fut
        finally:
            timer.cancel()
            if stop is not None:
                stop.remove_done_callback(fut_waker)
            if write:
                loop.remove_writer(self.fd)
            else:
                self._reader = None

    def _readable(self) -> None:
        fut, self._reader = self._reader, None
        if fut is None:
            self._watch.remove(self.fd)  # nobody waits: no more wake-ups until one does
            self._reading = False
        elif not fut.done():
            fut.set_result(True)

    # -- I/O ----------------------------------------------------------------------------------

    async def peek(
        self, n: int, timeout: float, stop: asyncio.Future[Any] | None = None
    ) -> bytes | None:
        """Up to ``n`` bytes without consuming them, as soon as at least one arrived (b"" at
        EOF); None when nothing arrived within ``timeout``, or once ``stop`` is done."""
        deadline = time.monotonic() + timeout
        while True:
            if stop is not None and stop.done():
                return None
            try:
                return self.sock.recv(n, _PEEK)
            except (BlockingIOError, InterruptedError):
                pass
            except OSError as e:
                if e.errno in _EOF_ERRNOS:
                    return b""
                raise
            if not await self._wait(write=False, timeout=deadline - time.monotonic(), stop=stop):
                return None

    async def read_exactly(self, n: int, timeout: float) -> bytes:
        """Exactly ``n`` bytes (never more); :class:`TimeoutError` or :class:`_Eof`."""
        try:  # the common case: the whole message is there already
            chunk = self.sock.recv(n, _DONTWAIT)
        except (BlockingIOError, InterruptedError):
            chunk = None
        except OSError as e:
            if e.errno in _EOF_ERRNOS:
                raise _Eof from e
            raise
        if chunk is not None:
            if not chunk:
                raise _Eof
            if len(chunk) == n:
                return chunk
        deadline = time.monotonic() + timeout
        buf = bytearray(chunk or b"")
        # Nothing there yet: wait before asking again (a second recv would only see EAGAIN).
        if chunk is None and not await self._wait(write=False, timeout=timeout):
            raise TimeoutError from None
        while len(buf) < n:
            try:
                chunk = self.sock.recv(n - len(buf), _DONTWAIT)
            except (BlockingIOError, InterruptedError):
                if not await self._wait(write=False, timeout=deadline - time.monotonic()):
                    raise TimeoutError from None
                continue
            except OSError as e:
                if e.errno in _EOF_ERRNOS:
                    raise _Eof from e
                raise
            if not chunk:
                raise _Eof
            buf += chunk
        return bytes(buf)

    async def write_all(self, data: bytes, timeout: float) -> None:
        try:  # the common case: a handshake message fits the send buffer at once
            sent = self.sock.send(data, _SEND_FLAGS)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError as e:
            if e.errno in _EOF_ERRNOS:
                raise _Eof from e
            raise
        if sent == len(data):
            return
        deadline = time.monotonic() + timeout
        view = memoryview(data)[sent:]
        while view:
            try:
                sent = self.sock.send(view, _SEND_FLAGS)
            except (BlockingIOError, InterruptedError):
                if not await self._wait(write=True, timeout=deadline - time.monotonic()):
                    raise TimeoutError from None
                continue
            except OSError as e:
                if e.errno in _EOF_ERRNOS:
                    raise _Eof from e
                raise
            view = view[sent:]


@dataclass(frozen=True)
class PeekResult:
    """What the client sent first: ``"smc"`` (a CLC eyecatcher: go on with the handshake),
    ``"not-smc"`` (other bytes), ``"silent"`` (nothing within the wait) or ``"eof"``."""

    kind: Literal["smc", "not-smc", "silent", "eof"]
    waited: float


async def peek_proposal(
    tcp: BorrowedTcp, wait: float, stop: asyncio.Future[Any] | None = None
) -> PeekResult:
    """Server half: look for a CLC eyecatcher in the client's first bytes without consuming any,
    waiting at most ``wait`` seconds in all (a partial eyecatcher keeps waiting for the rest),
    and no longer once ``stop`` is done ("silent": the caller knows why it stopped)."""
    start = time.monotonic()
    deadline = start + wait
    while True:
        left = deadline - time.monotonic()
        head = await tcp.peek(4, max(left, 0.0), stop)
        waited = time.monotonic() - start
        if head is None:
            return PeekResult("silent", waited)
        if not head:
            return PeekResult("eof", waited)
        verdict = classify_first_bytes(head)
        if verdict != "need-more":
            return PeekResult(verdict, waited)
        if left <= 0:
            return PeekResult("silent", waited)
        # A partial eyecatcher: the rest is in flight. The fd stays readable while bytes sit in
        # the receive queue, so sleep a little instead of spinning on readiness.
        await asyncio.sleep(min(0.005, max(left, 0.0)))


_MAX_DECLINE = 1024
"""Larger than any CLC Decline (28 bytes in v1, 44 in v2): a "Decline" header announcing more
is not one, and is left to the negotiator."""


async def client_gave_up(tcp: BorrowedTcp, timeout: float) -> bytes | None:
    """Server half, about to answer a client's Proposal: has the client given up already?

    A client that waited longer than its CLC timer for our answer (a server application that
    handed its socket over late, an overloaded daemon) has sent a Decline after its Proposal and
    fallen back: its application now owns the stream, and an Accept or Decline from us would
    reach it as data. So we look (``MSG_PEEK``) for a Decline behind the Proposal; when one is
    there we take it out of the stream (the server application must not read it either) and
    return its bytes; else None, and nothing is consumed."""
    try:
        head = tcp.sock.recv(8, _PEEK)
    except OSError:  # nothing there (EAGAIN) or a broken socket: the answer's send decides
        return None
    if len(head) < 8 or head[:4] not in EYECATCHERS or head[4] != ClcType.DECLINE:
        return None
    length = int.from_bytes(head[5:7], "big")
    if not 8 < length <= _MAX_DECLINE:
        return None
    try:
        return await tcp.read_exactly(length, timeout)
    except (TimeoutError, _Eof, OSError):
        return None


def answer_too_late(negotiation: Negotiation, step: Step, decline: bytes) -> Step:
    """What a server half does instead of sending ``step`` when the client had already given
    up (:func:`client_gave_up`): an Accept is treated as sent and the Decline as the client's
    answer to it (the negotiator releases what the Accept held); our own Decline is not sent."""
    out = step.outcome
    if out is None:
        return negotiation.receive_data(decline)
    try:
        msg = decode_clc(decline)
    except SmcError:
        msg = None
    if isinstance(out, FallbackOutcome) and isinstance(msg, Decline):
        # The client declined first: that is the outcome, as if it had declined our Proposal
        # answer (what we would have declined with stays in the explanation).
        ours = explain(out.reason).name if out.reason else "no code"
        return Step(
            outcome=peer_decline_fallback(
                msg, f"; it had given up waiting for our answer (we would have declined: {ours})"
            )
        )
    return Step(outcome=out)


async def _send(tcp: BorrowedTcp, step: Step, timeout: float) -> str | None:
    """Send the step's messages; why not, if the peer is gone or does not read."""
    data = step.data
    if not data:
        return None
    try:
        await tcp.write_all(data, timeout)
    except (TimeoutError, _Eof, OSError) as e:
        why = str(e) or type(e).__name__
        log.info("CLC: sending %d bytes to %s failed: %s", len(data), tcp.peer, why)
        return why
    return None


class FirstLinkLayer(Protocol):
    """What :func:`drive` needs of the SMC-R link layer for a first contact."""

    def begin_first_link(self, outcome: SmcrOutcome) -> None:
        """The peer's QP is known: ours goes to RTR (client, before its Confirm leaves) or
        RTS with LLC CONFIRM LINK sent (server). Raises SmcError when it cannot."""
        ...

    async def wait_first_link(self, outcome: SmcrOutcome, timeout: float) -> str | None:
        """None once LLC CONFIRM LINK completed, else why not."""
        ...


@overload
async def drive(
    negotiation: ClientNegotiation | ServerNegotiation,
    tcp: BorrowedTcp,
    first: Step | None = None,
) -> SmcdLoopbackOutcome | FallbackOutcome: ...


@overload
async def drive(
    negotiation: Negotiation,
    tcp: BorrowedTcp,
    first: Step | None = None,
    *,
    link: FirstLinkLayer | None = None,
    link_wait: float = 15.0,
    gate: Callable[[], Awaitable[None]] | None = None,
) -> Outcome: ...


async def drive(
    negotiation: Negotiation,
    tcp: BorrowedTcp,
    first: Step | None = None,
    *,
    link: FirstLinkLayer | None = None,
    link_wait: float = 15.0,
    gate: Callable[[], Awaitable[None]] | None = None,
) -> Outcome:
    """Run ``negotiation`` (either role, any devices) over ``tcp`` to its outcome.

    ``first`` is the step a client got from ``start()`` (a server starts by waiting). Reads
    exactly what the negotiator asks for; a timeout, EOF or a failed write is reported to it and
    ends in its fallback outcome (with a Decline sent where it says so, on a best-effort basis).
    Cancelling the task aborts the negotiation (its resources are released).

    SMC-R adds two things. ``link`` readies a first contact's link: before the client's Confirm
    leaves, and LLC CONFIRM LINK (``link_wait`` seconds) after it; when the link does not come
    up the negotiation is told (``link_failed``) and the loop goes on to its fallback. ``gate``
    is awaited before each received message is acted on (the link-group lock of the role,
    ``smc_client_lgr_pending``/``smc_server_lgr_pending``), and held by the caller after.
    """
    step = first if first is not None else Step()
    answering = isinstance(negotiation, Server)  # our answer to the Proposal is due
    link_checked = False
    try:
        while True:
            out = step.outcome
            confirm_link: SmcrOutcome | None = None
            if link is not None and isinstance(out, SmcrOutcome) and not link_checked:
                confirm_link = out if out.confirm_link else None
            if confirm_link is not None:
                assert link is not None
                try:
                    link.begin_first_link(confirm_link)
                except SmcError as e:
                    link_checked = True
                    step = negotiation.link_failed(str(e))
                    continue
            if step.send:
                timeout = negotiation.clc_wait
                if answering:
                    answering = False
                    late = await client_gave_up(tcp, timeout)
                    if late is not None:
                        step = answer_too_late(negotiation, step, late)
                        continue
                failed = await _send(tcp, step, timeout)
                if failed is not None and confirm_link is not None:
                    link_checked = True
                    step = negotiation.link_failed(f"sending the CLC message failed: {failed}")
                    continue
                if failed is not None and step.outcome is None:
                    step = negotiation.on_eof()
                    continue
            if confirm_link is not None:
                assert link is not None
                link_checked = True
                why = await link.wait_first_link(confirm_link, link_wait)
                if why is not None:
                    log.info("SMC-R first link to %s failed: %s", tcp.peer, why)
                    step = negotiation.link_failed(why)
                    continue
            if step.outcome is not None:
                return step.outcome
            need = negotiation.bytes_needed
            if need <= 0:  # cannot happen with a correct negotiator; never loop forever
                step = negotiation.abort("negotiator waits for nothing")
                continue
            try:
                data = await tcp.read_exactly(need, negotiation.timeout or 0.0)
            except TimeoutError:
                step = negotiation.on_timeout()
                continue
            except _Eof:
                step = negotiation.on_eof()
                continue
            except OSError as e:
                log.info("CLC: reading from %s failed: %s", tcp.peer, e)
                step = negotiation.on_eof()
                continue
            if gate is not None:
                await gate()
            step = negotiation.receive_data(data)
    except asyncio.CancelledError:
        if not negotiation.done:
            with contextlib.suppress(Exception):
                negotiation.abort("the handoff was cancelled")
        raise


MISREAD = (
    "the bytes read at one end of a same-host connection are not the CLC message its other "
    "end wrote"
)
"""Why a half of :func:`drive_pair` fails when the stream does not carry what the daemon itself
wrote into it (something else writes into the connection)."""


async def _hand_over(step: Step, reader: Negotiation, tcp: BorrowedTcp) -> Step:
    """The other end of the connection reads what ``step`` sent: exactly as many bytes (one
    ``recv`` on loopback, where they are there once the ``send`` returned); when they are the
    bytes sent, ``reader`` gets the message built for them, else a protocol violation. (A step
    sends one message: every SMC-D step does.)"""
    raw = step.data
    try:
        got = await tcp.read_exactly(len(raw), reader.timeout or 0.0)
    except TimeoutError:
        return reader.on_timeout()
    except _Eof:
        return reader.on_eof()
    except OSError as e:
        log.info("CLC: reading from %s failed: %s", tcp.peer, e)
        return reader.on_eof()
    if got == raw and len(step.send) == 1:
        return reader.receive_message(step.send[0])
    return reader.receive_message(MISREAD)


async def drive_pair(
    client: ClientNegotiation,
    ctcp: BorrowedTcp,
    server: ServerNegotiation,
    stcp: BorrowedTcp,
    first: Step,
) -> tuple[SmcdLoopbackOutcome | FallbackOutcome, SmcdLoopbackOutcome | FallbackOutcome]:
    """Both halves of one same-host connection, to both outcomes (the client's, the server's).

    Each message goes through the TCP connection as with :func:`drive` (written at one end,
    read back whole at the other), but the reading negotiator is given the message the writing
    one built (:meth:`~smcd_daemon.protocol.negotiate.Negotiation.receive_message`) once the
    bytes read are the bytes written: no framing, decoding, peeking or waiting for the loop
    between the two halves. ``first`` is the client's ``start()``, a Proposal to send. A half
    that ends without sending while the other still waits is, for the other, a peer that reset
    the connection (the daemon resets it for such an ending, see ``handshake``); the server
    half never sees a late Decline (:func:`client_gave_up`): its client is ours and here.
    Cancelling aborts both negotiations."""
    halves: tuple[tuple[Negotiation, BorrowedTcp], ...] = ((client, ctcp), (server, stcp))
    step, side = first, 0
    try:
        while True:
            neg, tcp = halves[side]
            other = halves[1 - side][0]  # done once it has its outcome
            if step.send:
                failed = await _send(tcp, step, neg.clc_wait)
                if failed is not None and step.outcome is None:
                    step = neg.on_eof()
                    continue
                if failed is None and not other.done:
                    side = 1 - side
                    step = await _hand_over(step, *halves[side])
                    continue
            if step.outcome is None:  # cannot happen with a correct negotiator
                step = neg.abort("negotiator waits for nothing")
                continue
            if not other.done:
                side, step = 1 - side, other.on_eof()
                continue
            break
    except asyncio.CancelledError:
        for neg, _ in halves:
            if not neg.done:
                with contextlib.suppress(Exception):
                    neg.abort("the handoff was cancelled")
        raise
    cout, sout = client.outcome, server.outcome
    assert isinstance(cout, SmcdLoopbackOutcome | FallbackOutcome)
    assert isinstance(sout, SmcdLoopbackOutcome | FallbackOutcome)
    return cout, sout
