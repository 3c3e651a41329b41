"""The asyncio transport of an SMC connection, and the handoff run off the event loop.

:class:`SmcTransport` drives an :class:`~smc_handoff.socket.SmcSocket` in SMC mode on one event
loop, as ``asyncio``'s own socket transport drives a TCP socket, with the same contract:

* waking: ``loop.add_reader`` on the channel's :meth:`~smc_handoff.channel.Channel.event_fd`
  (its eventfd). When the transport wants data (and has none) it first waits in its loop's busy
  poll (:mod:`smc_handoff.aio_poll`: a short spin on the peer's producer word when the loop
  would block, as a blocking reader spins), and only then asks the peer for a kick
  (:meth:`~smc_handoff.channel.Channel.arm_readable`); when the peer's ring is full, for a
  kick once its reader freed room (:meth:`~smc_handoff.channel.Channel.arm_space`): the peer
  kicks only when asked, so a busy stream makes no wakeup syscalls, and a wait is never a
  timer or a poll. The kick is an eventfd write, not a send on the peer link as for a
  blocking wait: a link send and its drain cost several times an eventfd's, twice per round
  trip (see the README's asyncio rows). The link is watched as well, for the peer's hang-up
  only (no kick is asked for there);
* reading: ``data_received`` with one copy out of the peer's ring, or for a
  :class:`asyncio.BufferedProtocol` ``get_buffer``/``buffer_updated`` with one copy straight
  into the protocol's buffer; ``pause_reading``/``resume_reading``; ``eof_received`` after the
  peer's ``shutdown(SHUT_WR)``/close;
* writing: straight into the peer's ring; what does not fit is buffered until the space kick;
  ``pause_writing``/``resume_writing`` at the high/low water marks (64 KiB / 16 KiB by default,
  as asyncio); ``write_eof``;
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
from asyncio import constants, transports, trsock
from collections.abc import Callable
from typing import Any, TypeVar

from smc_handoff import aio_poll
from smc_handoff.channel import Channel
from smc_handoff.socket import SmcSocket
from smc_handoff.wakeup import WANT_DATA, Waiter

__all__ = [
    "HANDOFF_THREADS",
    "LOOP_DMB_SIZE",
    "SmcTransport",
    "loop_dmb_size",
    "run_handoff",
    "sendall",
    "set_nodelay",
]

HANDOFF_THREADS = 32
"""Handoffs in progress at once per process and side (each waits for the daemon's CLC
exchange). Client and server halves have pools of their own: in a process that is both ends
(a proxy, a test, a service that calls itself) a client half waits for its server half and a
server half for its client's Proposal, so in one pool a burst of connections (100
``open_connection`` to a ``start_server`` of the same loop) filled every thread with halves
waiting for halves queued behind them, until the server halves gave up
(``timeouts.local_client_wait``) and most fell back. Threads are started as handoffs need
them."""

_MAX_SIZE = 64 * 1024
"""Bytes per read (asyncio's socket transport reads 256 KiB). Each read frees its part of the
peer's ring at once, so smaller reads let the writer refill behind the reader (the peer kicks
for space once half the ring is free) instead of both taking turns on a whole ring."""
_HIGH = 64 * 1024

LOOP_DMB_SIZE = 0
"""The receive buffer an event loop's connection asks smcd for: 0, the daemon's choice
(``buffers.default_dmb_size``, 1 MiB unless configured). An event loop needs rings well above its
messages: a ring-full costs it two wakeups (wait for room, then for the rest) where a blocking
reader spins. ``$SMC_RUN_DMB_SIZE`` asks for another size (bytes; the daemon clamps it to
``buffers.min_dmb_size``..``max_dmb_size``); :mod:`smc_handoff.aio` uses it too when its caller
gives no ``dmb_size``."""


def loop_dmb_size() -> int:
    """:data:`LOOP_DMB_SIZE`, or ``$SMC_RUN_DMB_SIZE`` when set to a number."""
    try:
        return int(os.environ.get("SMC_RUN_DMB_SIZE", LOOP_DMB_SIZE))
    except ValueError:
        return LOOP_DMB_SIZE


_T = TypeVar("_T")
_pools: dict[bool, concurrent.futures.ThreadPoolExecutor] = {}
_pool_pid = 0
_pool_lock = threading.Lock()


def _executor(server: bool) -> concurrent.futures.ThreadPoolExecutor:
    global _pool_pid
    with _pool_lock:
        if _pool_pid != os.getpid():  # a forked child has no threads
            _pools.clear()
            _pool_pid = os.getpid()
        pool = _pools.get(server)
        if pool is None:
            name = "smc-handoff-server" if server else "smc-handoff"
            pool = _pools[server] = concurrent.futures.ThreadPoolExecutor(
                HANDOFF_THREADS, thread_name_prefix=name
            )
        return pool


async def run_handoff(fn: Callable[..., _T], *args: Any, server: bool = False) -> _T:
    """``fn(*args)`` (a blocking handoff returning a socket) in the handoff threads of its
    side (``server``: an accepted connection's). When the caller is cancelled meanwhile, the
    socket it would have returned is closed."""
    loop = asyncio.get_running_loop()
    fut = loop.run_in_executor(_executor(server), fn, *args)
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:

        def drop(f: asyncio.Future[_T]) -> None:
            if not f.cancelled() and f.exception() is None:
                with contextlib.suppress(Exception):
                    f.result().close()  # type: ignore[attr-defined]

        fut.add_done_callback(drop)
        raise


def set_nodelay(sock: _socket.socket) -> None:
    """``TCP_NODELAY`` on a TCP connection, as asyncio's transports set it on every one they
    carry: on fallback it is the data's Nagle, on SMC what ``get_extra_info("socket")`` reads
    back. asyncio's own check wants the protocol number, which a socket of
    ``socket.create_server`` (an accepted one) does not carry (0)."""
    if sock.family in (_socket.AF_INET, _socket.AF_INET6) and sock.type == _socket.SOCK_STREAM:
        with contextlib.suppress(OSError):
            sock.setsockopt(_socket.IPPROTO_TCP, _socket.TCP_NODELAY, 1)


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


class SmcTransport(transports._FlowControlMixin):
    """A stream transport over an :class:`SmcSocket` in SMC mode (see the module docstring)."""

    _start_tls_compatible = True
    """``loop.start_tls()`` (STARTTLS: ``StreamWriter.start_tls``, a protocol's upgrade) layers
    asyncio's TLS protocol over this transport, as over its own socket transport: TLS then runs
    over the channel. Without it start_tls raised TypeError where TCP works."""

    _sendfile_compatible = constants._SendfileMode.FALLBACK
    """``loop.sendfile(transport, file)`` reads the file and writes it to this transport (as it
    does for a TLS transport): the data goes over the channel. Without it sendfile raised
    RuntimeError ("not supported for transport") where TCP sends the file; asyncio's fallback
    takes only a ``_FlowControlMixin`` (whose flow control this class has of its own: its
    methods are this class's)."""

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
        super().__init__(info, loop)
        self._loop = loop
        self._sock = sock
        sock.setblocking(False)
        set_nodelay(sock)
        channel = sock.channel
        if channel is None:
            raise ValueError("SmcTransport needs a socket in SMC mode")
        self._channel = channel
        self._fd = channel.event_fd()
        self._link_fd = channel.kick_fd()  # readable only when the peer hangs up
        self._watching = False  # add_reader(event_fd) is in place
        self._watching_link = False  # add_reader(kick_fd) is in place
        self._want_data = False  # a data kick is armed
        self._want_space = False  # a space kick is armed (the buffer waits for room)
        self._read_handle: asyncio.Handle | None = None  # a read scheduled without a kick
        self._poller = aio_poll.poller(loop)  # None: busy polling is off, always arm
        self._polling = False  # waiting in the poller (no kick armed)
        self.poll_waiter = Waiter(WANT_DATA, 0, 0)  # the busy poll's budget for this connection
        self.poll_missed = 0  # perf_counter_ns of the start of a spin that gave up, else 0
        self._protocol: Any = None
        self._buffered = False
        self.set_protocol(protocol)
        self._server = server
        self._buffer: collections.deque[memoryview] = collections.deque()
        self._buffer_size = 0
        self._closing = False
        self._lost = False  # connection_lost is scheduled: later writes are dropped
        self._finished = False  # connection_lost was called
        self._write_refused = False  # a write after the peer's close was dropped
        self._eof_pending = False
        self._eof_written = False
        self._paused = False  # reading, by pause_reading()
        self._at_eof = False
        self._high, self._low = _HIGH, _HIGH // 4
        self._protocol_paused = False
        self.space_waits = 0  # times the ring was full and a space kick was asked for
        self.space_wakeups = 0  # times the kick descriptor woke a transport waiting for room
        self.wakeups = 0  # times the kick descriptor woke us at all
        self.polls = 0  # times the ring was empty and the transport waited in the busy poll
        self.poll_hits = 0  # times the busy poll found our data (no kick, no wakeup)
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
        self._watching_link = True
        self._loop.add_reader(self._link_fd, self._link_readable)
        if not self._paused and not self._closing:
            self._want_read()
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- waking ------------------------------------------------------------------------------

    def _watch(self) -> None:
        if not self._watching:
            self._watching = True
            self._loop.add_reader(self._fd, self._kicked)

    def _unwatch(self) -> None:
        if self._watching:
            self._watching = False
            self._loop.remove_reader(self._fd)

    def _link_readable(self) -> None:
        """The peer link is readable: the peer hung up (or a kick queued there before us)."""
        ch = self._channel
        ch.drain_kicks()  # records a hang-up
        if ch.peer_closed:
            if self._watching_link:
                self._watching_link = False
                self._loop.remove_reader(self._link_fd)  # readable for good now
            self._look()

    def _kicked(self) -> None:
        """The eventfd is readable: a kick we asked for."""
        self.wakeups += 1
        self._channel.drain_kicks(link=False)  # first: a kick after this keeps it readable
        self._look(kicked=True)

    def _look(self, kicked: bool = False) -> None:
        ch = self._channel
        # Look only where the kick can be for: a request still armed stays armed (its kick has
        # not come: the peer publishes before it kicks) -- unless a kick was taken and found
        # nothing. The peer kicks each request once; a kick taken late, after its data was
        # read another way (a scheduled read, the busy poll), leaves that request spent, and
        # the next data came without a kick: the connection stalled for good (both ends
        # asleep in epoll, one with data unread; about once in 10^6 round trips). So a kick
        # that finds nothing asks again, with a new request.
        if self._want_space:
            if ch.tx_room:
                self._want_space = False
                self.space_wakeups += 1
                self._write_ready()  # asks for the next space kick when it fills the ring again
            elif kicked:
                self._want_space = False
                self._wait_space()
        if (self._want_data or self._polling) and ch.rx_pending:
            if self.poll_missed:  # the data a spin gave up on: would a longer one have caught it?
                aio_poll.learn(self.poll_waiter, self.poll_missed)
                self.poll_missed = 0
            self._want_data = self._polling = False  # (a hang-up while polling ends here too)
            self._read_ready()  # asks for the next data kick when it empties the ring
        elif kicked and self._want_data:
            self._want_data = False
            self._arm_read()  # a new request (or a read, when data came meanwhile)
        if not (self._want_data or self._want_space or self._polling):
            # Nothing asked for: no epoll wakeups meanwhile. A transport in the busy poll
            # stays watched: it arms again when the poll gives up, and two epoll_ctl calls
            # (and asyncio's handle and key) per message cost more than the kicks they save.
            self._unwatch()

    def _want_read(self) -> None:
        """Read now if something is there, else wait in the busy poll (or ask for a data kick
        at once when it is off)."""
        if (
            self._want_data
            or self._polling
            or self._lost
            or self._paused
            or self._at_eof
            or self._closing
        ):
            return
        poller = self._poller
        if poller is None or poller.bypass(self.poll_waiter):
            self._arm_read()
            return
        if self.poll_pending():
            self._schedule_read()
        else:
            self._polling = True
            self.polls += 1
            poller.wait(self)

    def _arm_read(self) -> bool:
        """Ask for a data kick (arm, look again); True when a read was scheduled instead."""
        try:
            armed = self._channel.arm_readable(link=False)
        except OSError as e:
            self._fatal_error(e)
            return True  # connection_lost is scheduled
        if armed:
            self._want_data = True
            self._watch()
            return False
        self._schedule_read()
        return True

    def _schedule_read(self) -> None:
        if self._read_handle is None:
            self._read_handle = self._loop.call_soon(self._scheduled_read)

    # The busy poller's side (smc_handoff.aio_poll.Pollable).

    def poll_channel(self) -> Channel | None:
        """The channel to spin on while this transport waits for data in the busy poll."""
        if self._polling and not (self._lost or self._paused or self._at_eof or self._closing):
            return self._channel
        self._polling = False
        return None

    def poll_pending(self) -> bool:
        """Data, EOF or an error waits (loads only)."""
        try:
            return self._channel.rx_pending
        except (OSError, ValueError):  # closed under us: the read says what happened
            return True

    def poll_look(self) -> int:
        """1: something is there, its read is scheduled; 0: nothing yet; -1: not waiting."""
        if not self._polling or self._lost or self._paused or self._at_eof or self._closing:
            self._polling = False
            return -1
        if not self.poll_pending():
            return 0
        self._polling = False
        self.poll_missed = 0
        self.poll_hits += 1
        self._schedule_read()
        return 1

    def poll_arm(self) -> bool:
        """The busy poll's budget is spent: back to the kick (True: a read was scheduled)."""
        if not self._polling:
            return False
        self._polling = False
        if self._want_data or self._lost or self._paused or self._at_eof or self._closing:
            return False
        return self._arm_read()

    def _scheduled_read(self) -> None:
        self._read_handle = None
        self._read_ready()

    # -- reading -----------------------------------------------------------------------------

    def _read_ready(self) -> None:
        if self._lost or self._paused or self._at_eof or self._closing:
            return
        if self._buffered:
            if not self._read_into_buffer():
                return
        else:
            try:
                # The channel's own call first (one copy out of the ring); nothing there, EOF
                # or an error: the socket's call decides, as for any reader.
                data = self._channel.recv_bytes(_MAX_SIZE) or self._sock.recv(_MAX_SIZE)
            except (BlockingIOError, InterruptedError):
                data = None  # nothing after all (a kick for data we had read already)
            except (SystemExit, KeyboardInterrupt):
                raise
            except BaseException as e:
                self._fatal_error(e)
                return
            if data:
                self._protocol.data_received(data)
            elif data is not None:
                self._read_eof()
                return
        self._want_read()

    def _read_into_buffer(self) -> bool:
        """One read into the protocol's buffer; False when reading is over (EOF, an error)."""
        try:
            buf = self._protocol.get_buffer(-1)
            if not len(buf):
                raise RuntimeError("get_buffer() returned an empty buffer")
        except (SystemExit, KeyboardInterrupt):
            raise
        except BaseException as e:
            self._fatal_error(e, "get_buffer() call failed")
            return False
        try:
            n = self._channel.recv_fast(buf) or self._sock.recv_into(buf)
        except (BlockingIOError, InterruptedError):
            return True
        except (SystemExit, KeyboardInterrupt):
            raise
        except BaseException as e:
            self._fatal_error(e)
            return False
        if not n:
            self._read_eof()
            return False
        try:
            self._protocol.buffer_updated(n)
        except (SystemExit, KeyboardInterrupt):
            raise
        except BaseException as e:
            self._fatal_error(e, "buffer_updated() call failed")
            return False
        return True

    def _read_eof(self) -> None:
        self._at_eof = True
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
        self._paused = True  # a data kick still armed wakes us once, for nothing

    def resume_reading(self) -> None:
        if self._closing or not self._paused:
            return
        self._paused = False
        self._want_read()

    def is_reading(self) -> bool:
        return not self._paused and not self._closing

    # -- writing -----------------------------------------------------------------------------

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"data argument must be a bytes-like object, not {type(data).__name__}")
        if self._eof_pending or self._eof_written:
            raise RuntimeError("Cannot call write() after write_eof()")
        if isinstance(data, memoryview) and (data.format != "B" or data.ndim != 1):
            data = data.cast("B")  # lengths and slices count bytes below
        if not data or self._lost:
            return
        if not self._buffer:
            try:
                n = self._channel.send_fast(data) or self._sock.send(data)  # fits: one call
            except (BlockingIOError, InterruptedError):
                n = 0
            except (SystemExit, KeyboardInterrupt):
                raise
            except BaseException as e:
                if not self._drop_after_peer_close(e):
                    self._fatal_error(e, "Fatal write error on SMC transport")
                return
            if n == len(data):
                return
            view = memoryview(data)[n:]
            self._buffer.append(view if isinstance(data, bytes) else memoryview(bytes(view)))
            self._buffer_size += len(view)
            self._wait_space()
        else:
            # bytes are immutable; a bytearray or memoryview the caller may reuse is copied
            self._buffer.append(memoryview(data if isinstance(data, bytes) else bytes(data)))
            self._buffer_size += len(data)
        self._maybe_pause_protocol()

    def _drop_after_peer_close(self, error: BaseException) -> bool:
        """TCP takes one more write after the peer's orderly close (the peer's RST answers
        it, and only a later write fails); the channel knows at once and raises
        ``ECONNRESET``, as the kernel's AF_SMC does for a socket. For a transport that
        difference surfaced as ``connection_lost(ConnectionResetError)`` where TCP's closes
        cleanly: a TLS close_notify written after the server closed made a client's
        ``wait_closed()`` raise. So the first write the peer's close refuses is dropped, as
        TCP's is, and the connection ends by the peer's EOF; a later one fails."""
        if self._write_refused or not isinstance(error, ConnectionResetError):
            return False
        ch = self._channel
        if not ch.peer_closed or ch.aborted:
            return False
        self._write_refused = True
        return True

    def writelines(self, list_of_data: Any) -> None:
        self.write(b"".join(list_of_data))

    def _wait_space(self) -> None:
        """The peer's ring is full: ask for a space kick (or write at once when room appeared
        meanwhile)."""
        if self._want_space or self._lost:
            return
        try:
            armed = self._channel.arm_space(link=False)
        except OSError as e:
            self._fatal_error(e)
            return
        if armed:
            self.space_waits += 1
            self._want_space = True
            self._watch()
        else:
            self._loop.call_soon(self._write_ready)

    def _stop_watching(self) -> None:
        self._want_data = self._want_space = self._polling = False
        self._unwatch()
        if self._watching_link:
            self._watching_link = False
            self._loop.remove_reader(self._link_fd)
        if self._read_handle is not None:
            self._read_handle.cancel()
            self._read_handle = None
        with contextlib.suppress(OSError):
            self._channel.disarm()

    def _write_ready(self) -> None:
        if self._lost or self._want_space:
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
        self._want_data = self._polling = False
        if not self._want_space:
            self._unwatch()
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
        self._stop_watching()
        self._closing = True
        self._lost = True  # later writes are dropped
        self._loop.call_soon(self._call_connection_lost, exc)

    def _call_connection_lost(self, exc: BaseException | None) -> None:
        if self._finished:
            return
        self._finished = self._lost = True
        self._stop_watching()
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
    kick on :meth:`~smc_handoff.channel.Channel.kick_fd` (``fileno()`` is an eventfd, always
    writable: asyncio's own would spin)."""
    try:
        view = memoryview(data).cast("B")
    except TypeError:  # not flat bytes (text, a strided view): TCP's send says what is wrong
        sock.send(data)
        raise
    while view.nbytes:
        try:
            n = sock.send(view)
        except (BlockingIOError, InterruptedError):
            n = 0
        view = view[n:]
        if n or not view.nbytes:
            continue
        channel = sock.channel
        if channel is None:  # not an SMC socket (any more): asyncio's own
            await loop.sock_sendall(sock, view)
            return
        if not channel.arm_space():
            continue  # room (or an error, which the next send raises) appeared meanwhile
        fd = channel.kick_fd()
        woken: asyncio.Future[None] = loop.create_future()
        loop.add_reader(fd, _wake, woken)
        try:
            await woken
        finally:
            loop.remove_reader(fd)
            with contextlib.suppress(OSError):
                channel.drain_kicks()
                channel.disarm()
