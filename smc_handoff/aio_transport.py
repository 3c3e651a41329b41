"""The asyncio transport of an SMC connection, and the handoff run off the event loop.

:class:`SmcTransport` drives an :class:`~smc_handoff.socket.SmcSocket` in SMC mode on one event
loop, as ``asyncio``'s own socket transport drives a TCP socket, with the same contract:

* reading: ``loop.add_reader`` on ``fileno()`` (the channel's receive eventfd, level-triggered:
  readable while data, EOF or an abort is pending); ``data_received`` with one copy out of the
  peer's ring, or for a :class:`asyncio.BufferedProtocol` ``get_buffer``/``buffer_updated`` with
  one copy straight into the protocol's buffer; ``pause_reading``/``resume_reading``;
  ``eof_received`` after the peer's ``shutdown(SHUT_WR)``/close;
* writing: straight into the peer's ring; what does not fit is buffered and written when the
  peer frees room, which it *signals*: the writer asks the channel for a space kick
  (:meth:`~smc_handoff.channel.Channel.arm_space`) and the loop waits for it on
  :meth:`~smc_handoff.channel.Channel.space_fd` — no timer, no polling; ``pause_writing`` /
  ``resume_writing`` at the high/low water marks (64 KiB / 16 KiB by default, as asyncio);
  ``write_eof``;
* closing: ``close`` flushes then closes (the peer reads EOF), ``abort`` closes at once; both
  reset the connection when received data is unread, as a TCP close does. The peer's abort
  (or death) ends in ``connection_lost(ConnectionResetError)``;
* ``get_extra_info``: ``peername``, ``sockname``, ``socket`` (asyncio's ``TransportSocket`` over
  the :class:`SmcSocket`, whose ``getpeername``/``setsockopt``... act on the TCP socket) and
  ``smc_socket`` (the :class:`SmcSocket` itself: ``.mode``, ``.conn_id``).

The handoff (the exchange with smcd, bounded by ``SMCD_HANDOFF_TIMEOUT``) runs in a small pool of
threads of its own (:func:`run_handoff`): it is the blocking code that guards a stream's integrity
(the kernel's byte counts before and after, the daemon's liveness, a reset when the stream cannot
be given back as it was), one implementation for sockets and the event loop alike, and it waits
only for the daemon. The pool is the library's own so that a stalled daemon never starves the
program's default executor (``getaddrinfo`` runs there).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import os
import socket as _socket
import threading
from asyncio import trsock
from collections.abc import Callable
from typing import Any, TypeVar

from smc_handoff.socket import SmcSocket

__all__ = ["HANDOFF_THREADS", "SmcTransport", "run_handoff", "sendall"]

HANDOFF_THREADS = 8
"""Handoffs in progress at once per process (each waits for the daemon's CLC exchange)."""

_MAX_SIZE = 256 * 1024  # bytes per read, as asyncio's selector transport
_HIGH = 64 * 1024

_T = TypeVar("_T")
_pool: concurrent.futures.ThreadPoolExecutor | None = None
_pool_pid = 0
_pool_lock = threading.Lock()


def _executor() -> concurrent.futures.ThreadPoolExecutor:
    global _pool, _pool_pid
    with _pool_lock:
        if _pool is None or _pool_pid != os.getpid():  # a forked child has no threads
            _pool = concurrent.futures.ThreadPoolExecutor(
                HANDOFF_THREADS, thread_name_prefix="smc-handoff"
            )
            _pool_pid = os.getpid()
        return _pool


async def run_handoff(fn: Callable[..., _T], *args: Any) -> _T:
    """``fn(*args)`` (a blocking handoff returning a socket) in the handoff threads. When the
    caller is cancelled meanwhile, the socket it would have returned is closed."""
    loop = asyncio.get_running_loop()
    fut = loop.run_in_executor(_executor(), fn, *args)
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:

        def drop(f: asyncio.Future[_T]) -> None:
            if not f.cancelled() and f.exception() is None:
                with contextlib.suppress(Exception):
                    f.result().close()  # type: ignore[attr-defined]

        fut.add_done_callback(drop)
        raise


def _server_call(server: Any, name: str, transport: asyncio.BaseTransport) -> None:
    """``Server._attach``/``_detach`` (so ``Server.wait_closed`` counts our connections too):
    without argument in Python 3.11/3.12, with the transport from 3.13 on."""
    method = getattr(server, name, None)
    if method is None:
        return
    try:
        method(transport)
    except TypeError:
        method()


class SmcTransport(asyncio.Transport):
    """A stream transport over an :class:`SmcSocket` in SMC mode (see the module docstring)."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        sock: SmcSocket,
        protocol: asyncio.BaseProtocol,
        waiter: asyncio.Future[None] | None = None,
        extra: dict[str, Any] | None = None,
        server: Any = None,
    ) -> None:
        info = {
            "socket": trsock.TransportSocket(sock),
            "smc_socket": sock,
            "sockname": sock.getsockname(),
        }
        with contextlib.suppress(OSError):
            info["peername"] = sock.getpeername()
        info.update(extra or {})
        super().__init__(info)
        self._loop = loop
        self._sock = sock
        sock.setblocking(False)
        self._fd = sock.fileno()  # the channel's eventfd; the channel is now in level mode
        self._channel: Any = getattr(sock, "channel", None)
        self._retry: asyncio.TimerHandle | None = None
        self._protocol: Any = None
        self._buffered = False
        self.set_protocol(protocol)
        self._server = server
        self._buffer: collections.deque[memoryview] = collections.deque()
        self._buffer_size = 0
        self._closing = False
        self._lost = False  # connection_lost is scheduled: later writes are dropped
        self._finished = False  # connection_lost was called
        self._eof_pending = False
        self._eof_written = False
        self._paused = False  # reading, by pause_reading()
        self._at_eof = False
        self._space_fd: int | None = None  # watched while waiting for the peer to free room
        self._high, self._low = _HIGH, _HIGH // 4
        self._protocol_paused = False
        self.space_waits = 0  # times the ring was full and we waited for a space kick
        self.space_wakeups = 0  # times a space kick (or the peer's hang-up) woke us
        if server is not None:
            _server_call(server, "_attach", self)
        loop.call_soon(self._start, waiter)

    def __repr__(self) -> str:
        state = "closing" if self._closing else "open"
        return f"<SmcTransport {self._sock.mode} fd={self._fd} {state}>"

    def _start(self, waiter: asyncio.Future[None] | None) -> None:
        try:
            self._protocol.connection_made(self)
        except BaseException as e:
            if waiter is not None and not waiter.done():
                waiter.set_exception(e)
            self._force_close(e if isinstance(e, Exception) else None)
            return
        if not self._paused and not self._closing:
            self._loop.add_reader(self._fd, self._read_ready)
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- reading -----------------------------------------------------------------------------

    def _read_ready(self) -> None:
        if self._lost:
            return
        if self._buffered:
            self._read_into_buffer()
            return
        try:
            data = self._sock.recv(_MAX_SIZE)
        except (BlockingIOError, InterruptedError):
            return  # a late, spurious readiness (see SmcSocket): the next kick re-arms
        except (SystemExit, KeyboardInterrupt):
            raise
        except BaseException as e:
            self._fatal_error(e)
            return
        if data:
            self._protocol.data_received(data)
        else:
            self._read_eof()

    def _read_into_buffer(self) -> None:
        try:
            buf = self._protocol.get_buffer(-1)
            if not len(buf):
                raise RuntimeError("get_buffer() returned an empty buffer")
        except (SystemExit, KeyboardInterrupt):
            raise
        except BaseException as e:
            self._fatal_error(e, "get_buffer() call failed")
            return
        try:
            n = self._sock.recv_into(buf)
        except (BlockingIOError, InterruptedError):
            return
        except (SystemExit, KeyboardInterrupt):
            raise
        except BaseException as e:
            self._fatal_error(e)
            return
        if not n:
            self._read_eof()
            return
        try:
            self._protocol.buffer_updated(n)
        except (SystemExit, KeyboardInterrupt):
            raise
        except BaseException as e:
            self._fatal_error(e, "buffer_updated() call failed")

    def _read_eof(self) -> None:
        self._at_eof = True
        self._loop.remove_reader(self._fd)  # EOF stays readable: stop listening
        try:
            keep_open = self._protocol.eof_received()
        except (SystemExit, KeyboardInterrupt):
            raise
        except BaseException as e:
            self._fatal_error(e, "eof_received() call failed")
            return
        if not keep_open:
            self.close()

    def pause_reading(self) -> None:
        if self._closing or self._paused:
            return
        self._paused = True
        self._loop.remove_reader(self._fd)

    def resume_reading(self) -> None:
        if self._closing or not self._paused:
            return
        self._paused = False
        if not self._at_eof:
            self._loop.add_reader(self._fd, self._read_ready)

    def is_reading(self) -> bool:
        return not self._paused and not self._closing

    # -- writing -----------------------------------------------------------------------------

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"data argument must be a bytes-like object, not {type(data).__name__}")
        if self._eof_pending or self._eof_written:
            raise RuntimeError("Cannot call write() after write_eof()")
        if not data or self._lost:
            return
        if not self._buffer:
            try:
                n = self._sock.send(data)
            except (BlockingIOError, InterruptedError):
                n = 0
            except (SystemExit, KeyboardInterrupt):
                raise
            except BaseException as e:
                self._fatal_error(e, "Fatal write error on SMC transport")
                return
            if n == len(data):
                return
            view = memoryview(data)[n:]
            self._buffer.append(view if isinstance(data, bytes) else memoryview(bytes(view)))
            self._buffer_size += len(view)
            self._wait_space()
        else:
            self._buffer.append(memoryview(bytes(data)))  # the caller may reuse its buffer
            self._buffer_size += len(data)
        self._maybe_pause_protocol()

    def writelines(self, list_of_data: Any) -> None:
        self.write(b"".join(list_of_data))

    def _wait_space(self) -> None:
        """The peer's ring is full: ask it for a space kick and watch for it (or write at once
        when room appeared meanwhile)."""
        if self._space_fd is not None or self._retry is not None or self._lost:
            return
        if self._channel is None or not hasattr(self._channel, "arm_space"):
            self.space_waits += 1
            self._retry = self._loop.call_later(0.0005, self._retry_write)
            return
        try:
            armed = self._channel.arm_space()
        except OSError as e:
            self._fatal_error(e)
            return
        self.space_waits += 1
        if not armed:  # room (or an error) already: no kick will come, go on now
            self._loop.call_soon(self._write_ready)
            return
        self._space_fd = self._channel.space_fd()
        self._loop.add_reader(self._space_fd, self._space_ready)

    def _stop_space_wait(self) -> None:
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
        if self._space_fd is not None:
            self._loop.remove_reader(self._space_fd)
            self._space_fd = None
            with contextlib.suppress(OSError):
                self._channel.disarm_space()

    def _retry_write(self) -> None:
        self._retry = None
        self._write_ready()

    def _space_ready(self) -> None:
        self.space_wakeups += 1
        self._stop_space_wait()
        self._write_ready()

    def _write_ready(self) -> None:
        if self._lost or self._space_fd is not None or self._retry is not None:
            return
        buf = self._buffer
        while buf:
            view = buf[0]
            try:
                n = self._sock.send(view)
            except (BlockingIOError, InterruptedError):
                n = 0
            except (SystemExit, KeyboardInterrupt):
                raise
            except BaseException as e:
                self._fatal_error(e, "Fatal write error on SMC transport")
                return
            self._buffer_size -= n
            if n < len(view):
                buf[0] = view[n:]
                break
            buf.popleft()
        self._maybe_resume_protocol()
        if buf:
            self._wait_space()
        elif self._closing:
            self._loop.call_soon(self._call_connection_lost, None)
        elif self._eof_pending:
            self._shutdown_write()

    def _shutdown_write(self) -> None:
        self._eof_pending = False
        self._eof_written = True
        try:
            self._sock.shutdown(_socket.SHUT_WR)
        except OSError as e:
            self._fatal_error(e)

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
        return self._buffer_size

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self._low, self._high

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        if high is None:
            high = _HIGH if low is None else 4 * low
        if low is None:
            low = high // 4
        if not high >= low >= 0:
            raise ValueError(f"high ({high!r}) must be >= low ({low!r}) must be >= 0")
        self._high, self._low = high, low
        self._maybe_pause_protocol()

    def _maybe_pause_protocol(self) -> None:
        if self._buffer_size <= self._high or self._protocol_paused:
            return
        self._protocol_paused = True
        try:
            self._protocol.pause_writing()
        except (SystemExit, KeyboardInterrupt):
            raise
        except BaseException as e:
            self._loop.call_exception_handler(
                {"message": "protocol.pause_writing() failed", "exception": e, "transport": self}
            )

    def _maybe_resume_protocol(self) -> None:
        if not self._protocol_paused or self._buffer_size > self._low:
            return
        self._protocol_paused = False
        try:
            self._protocol.resume_writing()
        except (SystemExit, KeyboardInterrupt):
            raise
        except BaseException as e:
            self._loop.call_exception_handler(
                {"message": "protocol.resume_writing() failed", "exception": e, "transport": self}
            )

    # -- closing -----------------------------------------------------------------------------

    def is_closing(self) -> bool:
        return self._closing

    def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        self._loop.remove_reader(self._fd)
        if not self._buffer:
            self._lost = True
            self._loop.call_soon(self._call_connection_lost, None)

    def abort(self) -> None:
        """Close at once, dropping buffered output (as asyncio's socket transport: the
        connection is reset only when received data is unread, as a TCP close resets)."""
        self._force_close(None)

    def _fatal_error(
        self, exc: BaseException, message: str = "Fatal error on SMC transport"
    ) -> None:
        if not isinstance(exc, OSError):  # resets, broken pipes: connection_lost says it
            self._loop.call_exception_handler(
                {
                    "message": message,
                    "exception": exc,
                    "transport": self,
                    "protocol": self._protocol,
                }
            )
        self._force_close(exc)

    def _force_close(self, exc: BaseException | None) -> None:
        if self._finished:
            return
        self._buffer.clear()
        self._buffer_size = 0
        self._stop_space_wait()
        if not self._closing:
            self._closing = True
            self._loop.remove_reader(self._fd)
        self._lost = True  # later writes are dropped
        self._loop.call_soon(self._call_connection_lost, exc)

    def _call_connection_lost(self, exc: BaseException | None) -> None:
        if self._finished:
            return
        self._finished = self._lost = True
        self._stop_space_wait()
        try:
            if self._protocol is not None:
                self._protocol.connection_lost(exc)
        finally:
            self._sock.close()
            self._protocol = None
            server, self._server = self._server, None
            if server is not None:
                _server_call(server, "_detach", self)

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._protocol = protocol
        self._buffered = isinstance(protocol, asyncio.BufferedProtocol)

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._protocol  # type: ignore[no-any-return]

    def __del__(self) -> None:
        if not getattr(self, "_finished", True):
            with contextlib.suppress(Exception):
                self._sock.close()


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


async def sendall(loop: asyncio.AbstractEventLoop, sock: SmcSocket, data: Any) -> None:
    """``loop.sock_sendall`` for an SMC socket: what does not fit waits for the peer's space
    kick on :meth:`~smc_handoff.channel.Channel.space_fd` (an eventfd is always writable, so
    asyncio's own would spin)."""
    view = memoryview(data).cast("B")
    channel: Any = getattr(sock, "channel", None)
    while view.nbytes:
        try:
            n = sock.send(view)
        except (BlockingIOError, InterruptedError):
            n = 0
        view = view[n:]
        if not view.nbytes:
            return
        if n:
            continue
        if channel is None or not hasattr(channel, "arm_space"):
            await asyncio.sleep(0.0005)
            continue
        if not channel.arm_space():
            continue  # room (or an error, which the next send raises) appeared meanwhile
        fd = channel.space_fd()
        woken: asyncio.Future[None] = loop.create_future()
        loop.add_reader(fd, _wake, woken)
        try:
            await woken
        finally:
            loop.remove_reader(fd)
            with contextlib.suppress(OSError):
                channel.disarm_space()
