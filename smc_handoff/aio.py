"""asyncio streams over SMC: ``open_connection`` and ``start_server`` as in :mod:`asyncio`,
for programs that ask for SMC themselves (under ``smc-run`` asyncio's own are upgraded:
:mod:`smc_handoff.aio_loop`).

The handoff itself (TCP connect/accept, then the exchange with smcd, bounded by
``SMCD_HANDOFF_TIMEOUT``) runs in the library's handoff threads
(:func:`~smc_handoff.aio_transport.run_handoff`) so the event loop never blocks on it. Then:

* in ``tcp`` mode (no daemon, or a fallback) the streams are asyncio's own, on the TCP socket;
* in SMC mode :class:`~smc_handoff.aio_transport.SmcTransport` drives the
  :class:`~smc_handoff.socket.SmcSocket` (reads on the channel's eventfd after a busy poll of
  the ring, :mod:`smc_handoff.aio_poll`; writes straight into the peer's ring, a space kick
  when it was full).

:func:`smc_socket` gives the :class:`SmcSocket` behind a writer (``.mode``, ``.fallback``).
"""

from __future__ import annotations

import asyncio
import functools
import socket as _socket
import weakref
from collections.abc import Awaitable, Callable
from typing import Any

from smc_handoff.aio_transport import SmcTransport, loop_dmb_size, run_handoff, set_nodelay
from smc_handoff.messages import Fallback
from smc_handoff.socket import SmcServer, SmcSocket, accepted, connect, listen

__all__ = ["SmcStreamServer", "open_connection", "smc_socket", "start_server"]

_LIMIT = 2**16

# The SmcSocket under a TCP-mode stream (asyncio's transport shows a TransportSocket).
_TCP_SOCKETS: weakref.WeakKeyDictionary[asyncio.BaseTransport, SmcSocket] = (
    weakref.WeakKeyDictionary()
)

ClientConnected = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None] | None]


def smc_socket(writer: asyncio.StreamWriter) -> SmcSocket:
    """The :class:`SmcSocket` under a stream made by this module (or by asyncio under
    ``smc-run``)."""
    sock = writer.get_extra_info("smc_socket") or _TCP_SOCKETS.get(writer.transport)
    if not isinstance(sock, SmcSocket):
        raise TypeError(f"no SmcSocket under {writer.transport!r}")
    return sock


async def _streams(
    sock: SmcSocket, limit: int
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Reader/writer over ``sock``: asyncio's own on TCP, :class:`_SmcTransport` on SMC."""
    loop = asyncio.get_running_loop()
    if sock.mode == "tcp":
        set_nodelay(sock)  # asyncio's transport would not (see set_nodelay)
        reader, writer = await asyncio.open_connection(sock=sock, limit=limit)
        _TCP_SOCKETS[writer.transport] = sock
    else:
        reader = asyncio.StreamReader(limit=limit, loop=loop)
        protocol = asyncio.StreamReaderProtocol(reader, loop=loop)
        waiter: asyncio.Future[None] = loop.create_future()
        transport = SmcTransport(loop, sock, protocol, waiter)
        await waiter
        writer = asyncio.StreamWriter(transport, protocol, reader, loop)
    return reader, writer


async def open_connection(
    host: str,
    port: int,
    *,
    limit: int = _LIMIT,
    dmb_size: int | None = None,
    timeout: float | None = None,
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Connect, hand off to smcd (or stay on TCP with the reason) and return streams."""
    size = loop_dmb_size() if dmb_size is None else dmb_size
    sock = await run_handoff(functools.partial(connect, (host, port), timeout, dmb_size=size))
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
        sock = await run_handoff(
            accepted, conn, self.server.registration, self.server.dmb_size, server=True
        )
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
    dmb_size: int | None = None,
) -> SmcStreamServer:
    """Listen (registered with smcd when it runs) and call ``client_connected_cb(reader,
    writer)`` for each connection, as :func:`asyncio.start_server` does."""
    loop = asyncio.get_running_loop()
    address = (host or ("::" if family == _socket.AF_INET6 else "0.0.0.0"), port or 0)
    server = await loop.run_in_executor(
        None,
        functools.partial(
            listen,
            address,
            backlog,
            family=family,
            reuse_port=reuse_port,
            dmb_size=loop_dmb_size() if dmb_size is None else dmb_size,
        ),
    )
    return SmcStreamServer(server, client_connected_cb, limit, loop)
