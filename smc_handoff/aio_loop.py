"""smc-run for the event loop: asyncio's own connections upgraded to SMC, in unmodified programs.

Under ``smc-run`` every ``socket.socket`` is an :class:`~smc_handoff.run.AutoSocket`, but asyncio
connects and accepts without blocking, which the socket cannot hand off by itself. So when the
program imports :mod:`asyncio`, :func:`install` extends the selector event loop (the default
loop on Linux) where a connection comes into being:

* client: ``sock_connect`` (which ``create_connection`` and ``open_connection`` use, and
  ``aiohappyeyeballs``/aiohttp call directly) hands the connected socket to smcd, in the handoff
  threads (:func:`~smc_handoff.aio_transport.run_handoff`: the loop goes on meanwhile);
* server: ``create_server``/``start_server`` listeners are registered with smcd when the loop
  starts serving them, their accepted connections are handed off off the loop, and
  ``sock_accept`` does the same for a program's own accept loop;
* ``_create_connection_transport`` and ``_accept_connection2`` then give any protocol
  (``asyncio.Protocol``, ``BufferedProtocol``, streams, uvicorn's, aiohttp's) an
  :class:`~smc_handoff.aio_transport.SmcTransport` on SMC, or asyncio's own transport on TCP;
* ``sock_recv``/``sock_recv_into`` work unchanged (``fileno()`` is the channel's eventfd);
  ``sock_sendall`` waits for the peer's space kick on SMC; ``sock_sendfile`` uses its copying
  fallback on SMC;
* a server half that stays on TCP without a Decline exchange (no daemon, a refusal) gets
  asyncio's own transport over its TCP-mode :class:`~smc_handoff.socket.SmcSocket`, whose first
  read answers a late CLC Proposal with a Decline
  (:func:`~smc_handoff.handoff.answer_late_proposal`), as for blocking sockets. On the loop
  that read never waits: while only part of a CLC message is there it reports "nothing yet"
  and the socket is readable again only when the rest (or the peer's FIN) is, bounded by a
  timer on the loop, so a late Proposal never reaches the protocol and never stalls the loop.

Each SMC transport busy-polls its channel before the loop sleeps (:mod:`smc_handoff.aio_poll`,
which wraps the loop's selector when the loop gets its first SMC transport, whenever the loop
was made; ``$SMC_RUN_BUSY_POLL=0`` turns it off).

TLS (``ssl=``, ``start_tls``) runs over the channel: asyncio's TLS protocol above an
:class:`~smc_handoff.aio_transport.SmcTransport`, as a blocking ``ssl`` socket's records go
over it (:mod:`smc_handoff.tls`), so either end may be either kind.

Not upgraded: event loops that are not asyncio's selector loop — uvloop's transports are
libuv's own, so a program that installs uvloop runs on TCP (``smc-run -v`` says so for each
connection).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from asyncio import base_events, exceptions, selector_events, sslproto
from typing import Any

from smc_handoff import autosocket as run  # (AutoSocket and the -v lines)
from smc_handoff.aio_transport import SmcTransport, loop_dmb_size, run_handoff, sendall
from smc_handoff.socket import SmcSocket, accepted

__all__ = ["install", "install_uvloop_report"]

log = logging.getLogger("smc_handoff.aio_loop")

_installed = False


async def _smc_transport(
    loop: asyncio.AbstractEventLoop,
    sock: SmcSocket,
    protocol_factory: Any,
    extra: dict[str, Any] | None = None,
    server: Any = None,
    *,
    ssl: Any = None,
    server_side: bool = False,
    server_hostname: Any = None,
    timeouts: dict[str, Any] | None = None,
) -> tuple[asyncio.BaseTransport, asyncio.BaseProtocol]:
    """An :class:`SmcTransport` for ``sock`` and the protocol, once connected. With ``ssl``,
    what ``_make_ssl_transport`` does over a socket transport, over the channel instead:
    asyncio's TLS protocol (as ``start_tls`` layers it) above the SMC transport, which moves
    its records; the caller gets the TLS transport once the handshake is done. ``timeouts``:
    ``ssl_handshake_timeout``/``ssl_shutdown_timeout`` as asyncio got them."""
    tls: sslproto.SSLProtocol | None = None
    try:
        protocol = protocol_factory()
        waiter = loop.create_future()
        if ssl:
            context: Any = None if isinstance(ssl, bool) else ssl
            tls = sslproto.SSLProtocol(
                loop, protocol, context, waiter, server_side, server_hostname, **(timeouts or {})
            )
            transport = SmcTransport(loop, sock, tls, None, extra, server)
        else:
            transport = SmcTransport(loop, sock, protocol, waiter, extra, server)
    except BaseException:
        sock.close()
        raise
    try:
        await waiter
    except BaseException:
        transport.close()
        raise
    return (tls._app_transport if tls is not None else transport), protocol


def _ssl_timeouts(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """``ssl_handshake_timeout``/``ssl_shutdown_timeout`` as asyncio passed them on."""
    names = ("ssl_handshake_timeout", "ssl_shutdown_timeout")
    found = dict(zip(names, args, strict=False))
    found.update((k, kwargs[k]) for k in names if k in kwargs)
    return found


async def _hand_off_client(sock: Any, address: Any) -> None:
    if isinstance(sock, run.AutoSocket) and sock.can_upgrade:
        await run_handoff(sock.hand_off_client, address, loop_dmb_size())


def install() -> None:
    """Extend asyncio's selector event loop as the module docstring says (idempotent)."""
    global _installed
    if _installed:
        return
    _installed = True
    base: Any = base_events.BaseEventLoop
    sel: Any = selector_events.BaseSelectorEventLoop

    create_transport = base._create_connection_transport

    @functools.wraps(create_transport)
    async def smc_create_connection_transport(
        self: Any,
        sock: Any,
        protocol_factory: Any,
        ssl: Any,
        server_hostname: Any,
        server_side: bool = False,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        if isinstance(sock, SmcSocket):
            if not server_side:
                try:
                    await _hand_off_client(sock, sock.getpeername())
                except BaseException:
                    sock.close()
                    raise
            if sock.mode != "tcp":
                timeouts = _ssl_timeouts(args, kwargs)
                return await _smc_transport(self, sock, protocol_factory, ssl=ssl,
                                            server_side=server_side,
                                            server_hostname=server_hostname,
                                            timeouts=timeouts)  # fmt: skip
        return await create_transport(
            self, sock, protocol_factory, ssl, server_hostname, server_side, *args, **kwargs
        )

    base._create_connection_transport = smc_create_connection_transport

    sock_connect = sel.sock_connect

    @functools.wraps(sock_connect)
    async def smc_sock_connect(self: Any, sock: Any, address: Any) -> None:
        if isinstance(sock, run.AutoSocket):
            sock.loop_connects = True  # its non-blocking connect is the loop's, not a program's
            sock.mark_for_handoff()  # the SYN asks for SMC (the daemon's peer detection)
        await sock_connect(self, sock, address)
        await _hand_off_client(sock, address)

    sel.sock_connect = smc_sock_connect

    start_serving = sel._start_serving

    @functools.wraps(start_serving)
    def smc_start_serving(
        self: Any, protocol_factory: Any, sock: Any, sslcontext: Any = None, *args: Any, **kw: Any
    ) -> None:
        if isinstance(sock, run.AutoSocket):
            sock.serve_from_loop()  # TLS too: it runs over the channel
        start_serving(self, protocol_factory, sock, sslcontext, *args, **kw)

    sel._start_serving = smc_start_serving

    accept2 = sel._accept_connection2

    @functools.wraps(accept2)
    async def smc_accept_connection2(
        self: Any,
        protocol_factory: Any,
        conn: Any,
        extra: Any,
        sslcontext: Any = None,
        server: Any = None,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        reg = run.take_deferred(conn)
        if reg is not None:
            peer = extra.get("peername") if extra else None
            try:
                conn = await run_handoff(accepted, conn, reg, loop_dmb_size(), server=True)
            except OSError as e:  # the connection was reset (see smc_handoff.handoff)
                conn.close()
                log.debug("accept %s: %s", peer, e)
                return
            run.report("accept", conn, peer)
            if conn.mode != "tcp":
                try:
                    timeouts = _ssl_timeouts(args, kwargs)
                    await _smc_transport(self, conn, protocol_factory, extra, server,
                                         ssl=sslcontext, server_side=True,
                                         timeouts=timeouts)  # fmt: skip
                except (SystemExit, KeyboardInterrupt):
                    raise
                except BaseException as exc:
                    self.call_exception_handler(
                        {"message": "Error on SMC transport creation for incoming connection",
                         "exception": exc}
                    )  # fmt: skip
                return
        await accept2(self, protocol_factory, conn, extra, sslcontext, server, *args, **kwargs)

    sel._accept_connection2 = smc_accept_connection2

    sock_accept = sel.sock_accept

    @functools.wraps(sock_accept)
    async def smc_sock_accept(self: Any, sock: Any) -> Any:
        if isinstance(sock, run.AutoSocket):
            sock.serve_from_loop()
        conn, address = await sock_accept(self, sock)
        reg = run.take_deferred(conn)
        if reg is not None:
            conn = await run_handoff(accepted, conn, reg, loop_dmb_size(), server=True)
            run.report("accept", conn, address)
        return conn, address

    sel.sock_accept = smc_sock_accept

    sock_sendall = sel.sock_sendall

    @functools.wraps(sock_sendall)
    async def smc_sock_sendall(self: Any, sock: Any, data: Any) -> None:
        if isinstance(sock, SmcSocket) and sock.mode != "tcp":
            await sendall(self, sock, data)
            return
        await sock_sendall(self, sock, data)

    sel.sock_sendall = smc_sock_sendall

    sendfile_native = sel._sock_sendfile_native

    @functools.wraps(sendfile_native)
    async def smc_sock_sendfile_native(self: Any, sock: Any, *args: Any) -> Any:
        if isinstance(sock, SmcSocket) and sock.mode != "tcp":
            raise exceptions.SendfileNotAvailableError("an SMC connection has no sendfile")
        return await sendfile_native(self, sock, *args)

    sel._sock_sendfile_native = smc_sock_sendfile_native


_UVLOOP = "uvloop: its transports are libuv's own, not upgraded"


def install_uvloop_report(uvloop: Any) -> None:
    """``smc-run -v`` under uvloop: one line per connection, saying it stays on TCP and why."""
    loop_class = uvloop.Loop
    create_connection = loop_class.create_connection
    create_server = loop_class.create_server

    async def uv_create_connection(self: Any, *args: Any, **kwargs: Any) -> Any:
        transport, protocol = await create_connection(self, *args, **kwargs)
        run.report_tcp("connect", transport.get_extra_info("peername"), _UVLOOP)
        return transport, protocol

    async def uv_create_server(self: Any, *args: Any, **kwargs: Any) -> Any:
        server = await create_server(self, *args, **kwargs)
        for sock in server.sockets:
            run.report_tcp("listen", sock.getsockname(), _UVLOOP)
        return server

    loop_class.create_connection = uv_create_connection
    loop_class.create_server = uv_create_server
