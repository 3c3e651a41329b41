"""smc-run for trio: its connections upgraded to SMC, in unmodified programs.

trio runs its own epoll loop over non-blocking stdlib sockets: ``trio.socket`` wraps a
``socket.socket``, under smc-run an :class:`~smc_handoff.run.AutoSocket`. A non-blocking socket
cannot hand itself off (the handoff waits for smcd, and that wait must not stall the program's
loop), so on their own trio's connections stayed on TCP. When the program imports trio,
:func:`install` extends its socket wrapper where a connection comes into being, as
:mod:`smc_handoff.aio_loop` does for asyncio:

* ``listen()``: the listener is registered with smcd
  (:meth:`~smc_handoff.run.AutoSocket.serve_from_loop`), so its ``accept()`` leaves the handoff
  of each connection to the task that accepted it;
* ``accept()``: the connection's ACCEPT goes to smcd, and the task waits in trio's loop for the
  answer on the handoff's control connection (``trio.lowlevel.wait_readable``), then takes it
  (:meth:`~smc_handoff.socket.SmcSocket.settle`, which no longer waits);
* ``connect()``: the SYN asks for SMC's TCP option (smcd's peer detection), and once connected
  the socket's CONNECT goes to smcd and the task waits for the answer the same way.

No thread waits for smcd: a client half waits in smcd for its server half, which may be in the
same process, and the first version, which waited in trio's worker threads, took every thread
with client halves when a program connected to itself 100 times at once (trio's limit is 40),
so that the server halves could not start and most connections fell back after
``timeouts.clc_wait``.

Data then moves through trio's own code: its ``send``/``recv`` call the socket's, which on SMC
are the channel's non-blocking calls, and it waits on ``fileno()``, the channel's eventfd, with
its epoll, which smc-run's ``select.epoll`` makes report writable only with room in the peer's
ring (:mod:`smc_handoff.readiness`; trio's registrations are one-shot). A handoff that falls back
leaves the socket on TCP as it was, and ``smc-run -v`` gives each connection's mode.

trio's socket wrapper is private API (``trio._socket._SocketType``): if a trio release changes
it, :func:`install` leaves trio alone and its programs run on TCP as before.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from smc_handoff import autosocket as run  # (AutoSocket and the -v lines)
from smc_handoff.socket import accepted

__all__ = ["install"]

log = logging.getLogger("smc_handoff.trio_loop")

_PATCHED = ("listen", "accept", "connect")


async def _settled(sock: run.AutoSocket) -> None:
    """Wait in trio's loop for smcd's answer to the socket's handoff, then take it. Cancelled
    meanwhile, the socket is closed (the handoff given up: see ``SmcSocket.close``)."""
    from trio.lowlevel import wait_readable  # trio is imported by now (see install)

    try:
        while (fd := sock.answer_fd()) is not None:
            await wait_readable(fd)
            sock.settle()
    except BaseException:
        sock.close()
        raise


def install(trio_socket: Any) -> None:
    """Extend ``trio._socket._SocketType`` as the module docstring says (idempotent)."""
    cls = getattr(trio_socket, "_SocketType", None)
    if cls is None or not all(callable(getattr(cls, name, None)) for name in _PATCHED):
        log.debug("trio's socket wrapper is not as expected: its connections stay on TCP")
        return
    if getattr(cls.accept, "_smc_run", False):
        return
    listen, accept, connect = cls.listen, cls.accept, cls.connect

    @functools.wraps(listen)
    def smc_listen(self: Any, *args: Any, **kwargs: Any) -> None:
        listen(self, *args, **kwargs)
        sock = self._sock
        if isinstance(sock, run.AutoSocket):
            sock.serve_from_loop()

    @functools.wraps(accept)
    async def smc_accept(self: Any) -> Any:
        wrapped, addr = await accept(self)
        sock = wrapped._sock
        reg = run.take_deferred(sock)
        if reg is None:
            return wrapped, addr
        # The ACCEPT goes to smcd at once; its answer is awaited in the loop. accepted() hands
        # the socket off in place (the wrapper keeps it) and never raises for a reset: the
        # socket's first call does.
        try:
            accepted(sock, reg, defer=lambda s: run.report("accept", s, addr))
        except BaseException:
            sock.close()
            raise
        await _settled(sock)
        return wrapped, addr

    @functools.wraps(connect)
    async def smc_connect(self: Any, address: Any) -> None:
        sock = self._sock
        ours = isinstance(sock, run.AutoSocket)
        if ours:
            sock.loop_connects = True  # its non-blocking connect is the loop's: no -v line
            sock.mark_for_handoff()
        await connect(self, address)
        if ours and sock.can_upgrade:
            # Raises, the connection reset, where the stream cannot be given back as it was;
            # cancelled, the socket is closed, as trio's connect() closes it.
            try:
                sock.offer_client(sock.getpeername())
            except BaseException:
                sock.close()
                raise
            await _settled(sock)

    patched: tuple[Any, ...] = (smc_listen, smc_accept, smc_connect)
    for fn in patched:
        fn._smc_run = True
    cls.listen, cls.accept, cls.connect = patched
