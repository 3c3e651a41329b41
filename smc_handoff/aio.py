"""asyncio streams over SMC: ``open_connection`` and ``start_server`` as in :mod:`asyncio`.

The handoff itself (TCP connect/accept, then the exchange with smcd, bounded by
``SMCD_HANDOFF_TIMEOUT``) runs in the default executor so the event loop never blocks on it.
Then:

* in ``tcp`` mode (no daemon, or a fallback) the streams are asyncio's own, on the TCP socket;
* in SMC mode a small transport drives the :class:`~smc_handoff.socket.SmcSocket`: reading is
  ``loop.add_reader`` on ``fileno()`` (the channel's eventfd, readable while data, EOF or an
  abort is pending); writing goes straight into the peer's ring and, when the ring is full,
  retries on a short timer backoff (an eventfd cannot say "writable"; the peer's consumption
  is usually a few microseconds away).

:func:`smc_socket` gives the :class:`SmcSocket` behind a writer (``.mode``, ``.fallback``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import socket as _socket
import weakref
from collections.abc import Awaitable, Callable
from typing import Any

from smc_handoff.messages import Fallback
from smc_handoff.socket import SmcServer, SmcSocket, _accepted, connect, listen

__all__ = ["SmcStreamServer", "open_connection", "smc_socket", "start_server"]

_LIMIT = 2**16
_READ_SIZE = 256 * 1024
_RETRY_MIN_S = 0.0002
_RETRY_MAX_S = 0.01

_SOCKETS: weakref.WeakKeyDictionary[asyncio.BaseTransport, SmcSocket] = weakref.WeakKeyDictionary()

ClientConnected = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None] | None]


def smc_socket(writer: asyncio.StreamWriter) -> SmcSocket:
    """The :class:`SmcSocket` under a stream made by this module."""
    return _SOCKETS[writer.transport]


class _SmcTransport(asyncio.Transport):
    """A stream transport over an SmcSocket in SMC mode (non-blocking, one event loop)."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        sock: SmcSocket,
        protocol: asyncio.BaseProtocol,
        waiter: asyncio.Future[None],
    ) -> None:
        super().__init__(
            {
                "socket": sock,
                "smc_socket": sock,
                "peername": sock.getpeername(),
                "sockname": sock.getsockname(),
            }
        )
        self._loop = loop
        self._sock = sock
        self._protocol: Any = protocol
        self._fd = sock.fileno()
        self._buffer = bytearray()
        self._closing = False
        self._lost = False
        self._eof_pending = False
        self._eof_written = False
        self._reading = True
        self._at_eof = False
        self._retry: asyncio.TimerHandle | None = None
        self._backoff = _RETRY_MIN_S
        self._high, self._low = 64 * 1024, 16 * 1024
        self._protocol_paused = False
        sock.setblocking(False)
        loop.call_soon(self._start, waiter)

    def _start(self, waiter: asyncio.Future[None]) -> None:
        self._protocol.connection_made(self)
        if self._reading and not self._closing:
            self._loop.add_reader(self._fd, self._read_ready)
        if not waiter.done():
            waiter.set_result(None)

    # -- reading -----------------------------------------------------------------------------

    def _read_ready(self) -> None:
        try:
            data = self._sock.recv(_READ_SIZE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            self._force_close(e)
            return
        if data:
            self._protocol.data_received(data)
            return
        self._at_eof = True
        self._loop.remove_reader(self._fd)  # EOF stays readable: stop listening
        if not self._protocol.eof_received():
            self.close()

    def pause_reading(self) -> None:
        if self._reading and not self._closing:
            self._reading = False
            self._loop.remove_reader(self._fd)

    def resume_reading(self) -> None:
        if not self._reading and not self._closing:
            self._reading = True
            if not self._at_eof:
                self._loop.add_reader(self._fd, self._read_ready)

    def is_reading(self) -> bool:
        return self._reading and not self._closing

    # -- writing -----------------------------------------------------------------------------

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._eof_pending or self._eof_written:
            raise RuntimeError("cannot call write() after write_eof()")
        if self._lost or (self._closing and not self._buffer):
            return
        if not data:
            return
        if not self._buffer:
            try:
                n = self._sock.send(data)
            except (BlockingIOError, InterruptedError):
                n = 0
            except OSError as e:
                self._force_close(e)
                return
            data = memoryview(data)[n:]
            if not data:
                return
            self._schedule_retry()
        self._buffer += data
        self._maybe_pause_protocol()

    def _schedule_retry(self) -> None:
        if self._retry is None:
            self._retry = self._loop.call_later(self._backoff, self._write_ready)

    def _write_ready(self) -> None:
        self._retry = None
        if self._lost:
            return
        try:
            n = self._sock.send(self._buffer)
        except (BlockingIOError, InterruptedError):
            n = 0
        except OSError as e:
            self._force_close(e)
            return
        if n:
            del self._buffer[:n]
            self._backoff = _RETRY_MIN_S
        else:
            self._backoff = min(_RETRY_MAX_S, self._backoff * 2)
        self._maybe_resume_protocol()
        if self._buffer:
            self._schedule_retry()
        elif self._closing:
            self._loop.call_soon(self._connection_lost, None)
        elif self._eof_pending:
            self._shutdown_write()

    def _shutdown_write(self) -> None:
        self._eof_pending = False
        self._eof_written = True
        try:
            self._sock.shutdown(_socket.SHUT_WR)
        except OSError as e:
            self._force_close(e)

    def write_eof(self) -> None:
        if self._closing or self._eof_pending or self._eof_written:
            return
        if self._buffer:
            self._eof_pending = True
        else:
            self._shutdown_write()

    def can_write_eof(self) -> bool:
        return True

    def get_write_buffer_size(self) -> int:
        return len(self._buffer)

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self._low, self._high

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        if high is None:
            high = 64 * 1024 if low is None else 4 * low
        if low is None:
            low = high // 4
        if not high >= low >= 0:
            raise ValueError(f"high ({high!r}) must be >= low ({low!r}) must be >= 0")
        self._high, self._low = high, low
        self._maybe_pause_protocol()

    def _maybe_pause_protocol(self) -> None:
        if len(self._buffer) > self._high and not self._protocol_paused:
            self._protocol_paused = True
            self._protocol.pause_writing()

    def _maybe_resume_protocol(self) -> None:
        if self._protocol_paused and len(self._buffer) <= self._low:
            self._protocol_paused = False
            self._protocol.resume_writing()

    # -- closing -----------------------------------------------------------------------------

    def is_closing(self) -> bool:
        return self._closing

    def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        self._loop.remove_reader(self._fd)
        if not self._buffer:
            self._loop.call_soon(self._connection_lost, None)

    def abort(self) -> None:
        """Close now, dropping buffered output (as asyncio's transports: not a reset)."""
        self._force_close(None)

    def _force_close(self, exc: BaseException | None) -> None:
        if self._lost:
            return
        self._buffer.clear()
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
        if not self._closing:
            self._closing = True
            self._loop.remove_reader(self._fd)
        self._loop.call_soon(self._connection_lost, exc)

    def _connection_lost(self, exc: BaseException | None) -> None:
        if self._lost:
            return
        self._lost = True
        try:
            self._protocol.connection_lost(exc)
        finally:
            self._sock.close()

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._protocol = protocol

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._protocol  # type: ignore[no-any-return]

    def __del__(self) -> None:
        if not self._lost:
            with contextlib.suppress(Exception):
                self._sock.close()


async def _streams(
    sock: SmcSocket, limit: int
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Reader/writer over ``sock``: asyncio's own on TCP, :class:`_SmcTransport` on SMC."""
    loop = asyncio.get_running_loop()
    if sock.mode == "tcp":
        reader, writer = await asyncio.open_connection(sock=sock, limit=limit)
    else:
        reader = asyncio.StreamReader(limit=limit, loop=loop)
        protocol = asyncio.StreamReaderProtocol(reader, loop=loop)
        waiter: asyncio.Future[None] = loop.create_future()
        transport = _SmcTransport(loop, sock, protocol, waiter)
        await waiter
        writer = asyncio.StreamWriter(transport, protocol, reader, loop)
    _SOCKETS[writer.transport] = sock
    return reader, writer


async def open_connection(
    host: str,
    port: int,
    *,
    limit: int = _LIMIT,
    dmb_size: int = 0,
    timeout: float | None = None,
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Connect, hand off to smcd (or stay on TCP with the reason) and return streams."""
    loop = asyncio.get_running_loop()
    sock = await loop.run_in_executor(
        None, functools.partial(connect, (host, port), timeout, dmb_size=dmb_size)
    )
    try:
        return await _streams(sock, limit)
    except BaseException:
        sock.close()
        raise


class SmcStreamServer:
    """What :func:`start_server` returns: an :class:`SmcServer` served on the event loop
    (``close``, ``wait_closed``, ``serve_forever``, ``sockets``, async context manager)."""

    def __init__(
        self,
        server: SmcServer,
        callback: ClientConnected,
        limit: int,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self.server = server
        self._callback = callback
        self._limit = limit
        self._loop = loop
        self._tasks: set[asyncio.Task[Any]] = set()
        self._serving = True
        self._closed: asyncio.Future[None] = loop.create_future()
        server.setblocking(False)
        loop.add_reader(server.fileno(), self._accept_ready)

    @property
    def sockets(self) -> tuple[_socket.socket, ...]:
        return (self.server.socket,) if self._serving else ()

    @property
    def registered(self) -> bool:
        return self.server.registered

    @property
    def fallback(self) -> Fallback | None:
        return self.server.fallback

    def _accept_ready(self) -> None:
        for _ in range(64):  # bounded, like asyncio's own accept loop
            try:
                conn, _addr = self.server.socket.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return  # e.g. EMFILE or ECONNABORTED: try again on the next readiness
            conn.setblocking(True)
            task = self._loop.create_task(self._handle(conn))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _handle(self, conn: _socket.socket) -> None:
        handoff = functools.partial(_accepted, conn, self.server._reg, self.server.dmb_size)
        sock = await self._loop.run_in_executor(None, handoff)
        try:
            reader, writer = await _streams(sock, self._limit)
        except BaseException:
            sock.close()
            raise
        result = self._callback(reader, writer)
        if asyncio.iscoroutine(result):
            await result

    def is_serving(self) -> bool:
        return self._serving

    def get_loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def close(self) -> None:
        if not self._serving:
            return
        self._serving = False
        self._loop.remove_reader(self.server.fileno())
        self.server.close()
        if not self._closed.done():
            self._closed.set_result(None)

    async def wait_closed(self) -> None:
        await self._closed
        if self._tasks:
            await asyncio.wait(list(self._tasks))

    async def serve_forever(self) -> None:
        try:
            await self._closed
        finally:
            self.close()

    async def __aenter__(self) -> SmcStreamServer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()
        await self.wait_closed()


async def start_server(
    client_connected_cb: ClientConnected,
    host: str | None = None,
    port: int | None = None,
    *,
    limit: int = _LIMIT,
    backlog: int = 100,
    family: int = _socket.AF_INET,
    reuse_port: bool = False,
    dmb_size: int = 0,
) -> SmcStreamServer:
    """Listen (registered with smcd when it runs) and call ``client_connected_cb(reader,
    writer)`` for each connection, as :func:`asyncio.start_server` does."""
    loop = asyncio.get_running_loop()
    address = (host or ("::" if family == _socket.AF_INET6 else "0.0.0.0"), port or 0)
    server = await loop.run_in_executor(
        None,
        functools.partial(
            listen, address, backlog, family=family, reuse_port=reuse_port, dmb_size=dmb_size
        ),
    )
    return SmcStreamServer(server, client_connected_cb, limit, loop)
