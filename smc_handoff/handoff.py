"""The library's end of a handoff: talking to smcd, and never letting a stream be corrupted.

A connection handed to smcd ends in exactly one of three ways: an SMC channel; TCP exactly as the
application left it; or an error (:class:`ConnectionResetError`, :class:`TimeoutError` with
``ETIMEDOUT``), as the kernel fails an AF_SMC socket with ``-EPROTO``/``-ETIMEDOUT`` once CLC has
begun. Never TCP with CLC bytes in the data. The library enforces its half of that rule itself,
because the daemon may die, freeze or lie:

- Before the TCP descriptor leaves, :meth:`StreamMark.take` reads from the kernel how many bytes
  the application has written (``tcpi_bytes_acked`` + ``SIOCOUTQ``) and consumed
  (``tcpi_bytes_received`` - ``SIOCINQ``, less the peer's FIN), until two readings agree (data
  may be arriving). After anything but a CHANNEL reply the mark is taken again: equal marks
  mean the daemon neither wrote nor read a byte (a ``MSG_PEEK`` reads none).
- FALLBACK is trusted when the stream is untouched, or when the daemon says the CLC exchange
  ended in a Decline both ends processed (``Fallback.after_decline``); a FALLBACK that touched
  the stream without saying so is an error. ERROR, an invalid reply or a hang-up fall back only
  when the stream is untouched; otherwise an error.
- A hang-up counts as "the daemon let go" when our request was never read (ECONNRESET: the
  descriptor never reached it) or when the listening process is gone (a pidfd: its copies of
  the descriptor died with it). A live daemon that hangs up without a reply may still hold a
  copy and write later, so that is an error too (also under socket activation, where the pid
  is systemd's and so never gone).
- A server half waits up to :data:`ACCEPT_BUSY_WAIT` on a full handoff queue: its client half
  may be queued at the same daemon and propose after the server half fell back. It waits in the
  kernel (a blocking connect bounded by ``SO_SNDTIMEO``, woken when the daemon accepts), so it
  gets a freed slot before a flood that polls for one. A client half, which has sent nothing,
  falls back at once.
- No reply within :func:`~smc_handoff.messages.handoff_timeout` (a frozen or overloaded daemon)
  is always an error (``ETIMEDOUT``), untouched or not: the daemon still holds a copy of the
  descriptor and would go on with the handshake when it wakes up. No cancel can be safe (a
  frozen daemon cannot acknowledge it), so the library resets instead.
- Whatever fallback is taken, CLC bytes waiting at the head of the receive queue (an eyecatcher
  or the start of one, peeked) make it an error: on the server half a client that proposed
  after the daemon's ``proposal_wait``; on either half after a Decline exchange, a late CLC
  message.

An error resets the TCP connection (:func:`reset`): ``connect(AF_UNSPEC)`` makes the kernel send
an RST and close the socket even while the daemon still holds a copy, so the peer sees
ECONNRESET instead of waiting or reading CLC, and a late write by a woken daemon fails.

The library's wait must outlast the daemon's handshake timers, which end every handshake with a
reply: :data:`~smc_handoff.messages.HANDOFF_TIMEOUT` is above the daemon's default chain
(``proposal_wait`` + ``clc_wait`` per CLC message + SMC-R's LLC waits); a daemon configured with
longer timers needs ``$SMCD_HANDOFF_TIMEOUT`` raised with them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import os
import select
import socket as _socket
import struct
import sys
import termios
import threading
import time
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from smc_handoff import messages, peer_option
from smc_handoff.fdmap import unpatched
from smc_handoff.lazylog import LazyLogger
from smc_handoff.messages import Fallback

if TYPE_CHECKING:
    from collections.abc import Callable

    from smc_handoff.channel import Channel as _Channel

# The real calls: smc-run wraps fcntl's and select's before this module is loaded (run.py)
_ioctl = unpatched(fcntl.ioctl)
_poll = unpatched(select.poll)

__all__ = [
    "CLC_EYECATCHERS",
    "ChannelState",
    "Handed",
    "NoDaemon",
    "Offer",
    "Registration",
    "StreamMark",
    "answer",
    "answer_late_proposal",
    "clc_at_head",
    "connect_daemon",
    "daemon_exited",
    "exchange",
    "hand_over",
    "offer",
    "raise_nofile_limit",
    "recv_reply",
    "reset",
    "unexpected",
]

log = LazyLogger("smc_handoff")  # (logging: imported when something is logged)

# The real socket class, captured before smc-run may replace ``socket.socket`` by a subclass.
_BaseSocket = _socket.socket
_PEERCRED = struct.Struct("3i")
_TIMEVAL = struct.Struct("ll")
CLC_EYECATCHERS = (b"\xe2\xd4\xc3\xd9", b"\xe2\xd4\xc3\xc4")
"""EBCDIC "SMCR" and "SMCD": every CLC message starts with one."""
_PEEK = int(_socket.MSG_PEEK) | int(_socket.MSG_DONTWAIT)
_TCP = _socket.IPPROTO_TCP
_TCP_INFO = struct.Struct("B119xQQ")  # tcpi_state .. tcpi_bytes_acked, tcpi_bytes_received
_TCP_INFO_OPT = _socket.TCP_INFO
_SIOCINQ = termios.FIONREAD
_SIOCOUTQ = termios.TIOCOUTQ
_INT = struct.Struct("i")
_INT0 = bytes(_INT.size)
_TCP_CLOSE = 7
_TCP_REPAIR = 19  # linux/tcp.h; reading it needs no privilege
_TCP_REPAIR_OFF_NO_WP = -1
_UNKNOWN = -1  # StreamMark.state when the kernel does not say
_FIN_RECEIVED = frozenset({6, 8, 9, 11})  # TIME_WAIT, CLOSE_WAIT, LAST_ACK, CLOSING
_BUSY_RETRY = 0.01
_UNIX = int(_socket.AF_UNIX)
_SEQPACKET_NONBLOCK = int(_socket.SOCK_SEQPACKET | _socket.SOCK_CLOEXEC | _socket.SOCK_NONBLOCK)
_POLLIN = select.POLLIN
ACCEPT_BUSY_WAIT = 1.0
"""Seconds a server half retries a daemon whose handoff queue is full before it stays on TCP:
the client half may be queued at the same daemon and propose later, which only the daemon
sees (a client that proposes after the server half fell back is the one race left)."""
_EXIT_WAIT = 0.25
"""Seconds a hang-up waits for the daemon's process to be gone (its exit closes the handoff
socket before the process is reaped)."""


class NoDaemon(Exception):
    """No usable daemon at any candidate path; the message says why (for the fallback)."""


def connect_daemon(busy_wait: float = 0.0) -> tuple[_socket.socket, int]:
    """A SEQPACKET connection to a trusted daemon and the pid of whoever listens (the daemon,
    or systemd for an inherited socket), or :class:`NoDaemon`. A full listen queue (EAGAIN) is
    retried for ``busy_wait`` seconds.

    The connection is non-blocking: its first request never waits (a fresh connection's peer
    has nothing queued), and a reply is waited for with :func:`recv_reply`. So the usual
    connect costs no timeouts set on the socket (CPython's ``settimeout`` is an ioctl, and a
    socket with a timeout polls before every send and receive): a ``SOCK_NONBLOCK`` socket
    connects at once or fails with EAGAIN on a full queue, and only then is the wait below
    set up."""
    problems = []
    for path in messages.handoff_socket_candidates():
        address = os.fspath(path)
        ctl = _BaseSocket(_UNIX, _SEQPACKET_NONBLOCK)
        try:
            ctl.connect(address)
        except BlockingIOError:  # a full listen queue: wait for a slot (below)
            ctl.close()
        except OSError as e:
            ctl.close()
            problems.append(_problem(path, e))
            continue
        else:
            try:
                return ctl, _peer_pid(ctl, path)
            except (OSError, NoDaemon) as e:
                problems.append(_problem(path, e))
                continue
        until = time.monotonic() + busy_wait
        while True:
            ctl = _BaseSocket(_socket.AF_UNIX, _socket.SOCK_SEQPACKET | _socket.SOCK_CLOEXEC)
            try:
                # blocking, so that a full listen queue is waited for (a timed socket would fail
                # with EAGAIN at once), at most busy_wait seconds
                wait = max(until - time.monotonic(), 0.001)
                tv = _TIMEVAL.pack(int(wait), int(wait % 1 * 1e6))
                ctl.setsockopt(_socket.SOL_SOCKET, _socket.SO_SNDTIMEO, tv)
                ctl.connect(address)
                ctl.setblocking(False)
                pid = _peer_pid(ctl, path)
            except (OSError, NoDaemon) as e:
                ctl.close()
                if isinstance(e, BlockingIOError) and time.monotonic() + _BUSY_RETRY < until:
                    continue  # woken, and a flood took the slot: wait again
                problems.append(_problem(path, e))
                break
            return ctl, pid
    raise NoDaemon("; ".join(problems) or "no handoff socket path")


def _peer_pid(ctl: _socket.socket, path: object) -> int:
    """The pid of the process listening at the other end of ``ctl``, once its uid is trusted
    (root or ours); else :class:`NoDaemon` (``ctl`` closed)."""
    try:
        cred = ctl.getsockopt(_socket.SOL_SOCKET, _socket.SO_PEERCRED, _PEERCRED.size)
        pid, uid, _gid = _PEERCRED.unpack(cred)
        if uid != 0 and uid != os.getuid():
            raise NoDaemon(f"{path} is served by uid {uid} (pid {pid}), not root or us")
    except BaseException:
        ctl.close()
        raise
    return int(pid)


def _problem(path: object, e: BaseException) -> str:
    reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e) or repr(e)
    return f"{path}: {reason}"


def recv_reply(ctl: _socket.socket, timeout: float) -> tuple[messages.Message, list[int]]:
    """:func:`messages.recv_message` of a reply on the non-blocking ``ctl`` (see
    :func:`connect_daemon`), waiting for it at most ``timeout`` seconds (then
    :class:`TimeoutError`, as a socket timeout says it)."""
    deadline = time.monotonic() + timeout
    poller = _poll()
    poller.register(ctl, _POLLIN)
    while timeout > 0 and poller.poll(timeout * 1000):
        try:
            return messages.recv_message(ctl, requests=False)
        except BlockingIOError:  # (nothing after all: wait again)
            timeout = deadline - time.monotonic()
    raise TimeoutError("timed out")


# --- what the kernel says about the stream ----------------------------------------------------


@dataclass(frozen=True)
class StreamMark:
    """Bytes the application's side of a TCP connection has written and consumed, as the kernel
    counts them (see the module docstring). Two marks are equal exactly when nobody wrote to or
    read from the stream in between."""

    written: int
    consumed: int
    state: int

    @classmethod
    def take(cls, sock: _socket.socket) -> StreamMark:
        """Read ``TCP_INFO``, the two queues, and ``TCP_INFO`` again, until both ``TCP_INFO``
        readings agree; the last reading after eight tries. Its two counters only grow (an ACK
        raises ``tcpi_bytes_acked`` as it shrinks ``SIOCOUTQ``; arriving data raises
        ``tcpi_bytes_received`` as it grows ``SIOCINQ``), so when neither moved around the
        queries, nothing landed between them and the queues belong to those counts: four
        system calls, where comparing two whole readings took six."""
        fd = _BaseSocket.fileno(sock)
        getsockopt, ioctl, unpack, size = sock.getsockopt, _ioctl, _INT.unpack, _TCP_INFO.size
        raw = getsockopt(_TCP, _TCP_INFO_OPT, size)
        if len(raw) < size:  # a kernel without the byte counts (before 4.2)
            return cls(0, 0, _UNKNOWN)
        info = _TCP_INFO.unpack_from(raw)
        for _tries in range(8):
            outq = unpack(ioctl(fd, _SIOCOUTQ, _INT0))[0]
            inq = unpack(ioctl(fd, _SIOCINQ, _INT0))[0]
            again = _TCP_INFO.unpack_from(getsockopt(_TCP, _TCP_INFO_OPT, size))
            if again == info:
                break
            info = again
        state, acked, received = info
        # bytes_received counts the peer's FIN once it arrived; SIOCINQ never does
        fin = 1 if state in _FIN_RECEIVED else 0
        return cls(acked + outq, received - inq - fin, state)

    def untouched_since(self, before: StreamMark) -> bool:
        """Nothing written or consumed since ``before``. False once the socket is closed (the
        kernel zeroes its counters on a disconnect) or without counts: nobody can tell then."""
        if _TCP_CLOSE in (self.state, before.state) or _UNKNOWN in (self.state, before.state):
            return False
        return self.written == before.written and self.consumed == before.consumed

    def describe_since(self, before: StreamMark) -> str:
        if _UNKNOWN in (self.state, before.state):
            return "this kernel does not count a TCP stream's bytes"
        if _TCP_CLOSE in (self.state, before.state):
            return "the TCP connection was closed"
        wrote, read = self.written - before.written, self.consumed - before.consumed
        return f"{wrote} bytes written and {read} read by someone else"


def in_repair(sock: _socket.socket) -> bool:
    """The socket is in TCP repair mode (the daemon reads a connection's identity in it)."""
    try:
        return bool(sock.getsockopt(_TCP, _TCP_REPAIR))
    except OSError:
        return False


def leave_repair(sock: _socket.socket) -> bool:
    """Take the socket out of repair mode without a window probe (needs CAP_NET_ADMIN, as the
    daemon that put it there had); False when we may not."""
    try:
        sock.setsockopt(_TCP, _TCP_REPAIR, _TCP_REPAIR_OFF_NO_WP)
    except OSError:
        return False
    return not in_repair(sock)


def clc_at_head(sock: _socket.socket) -> bool:
    """Does the receive queue start with a CLC eyecatcher (or the start of one)? Peeked, never
    consumed; the socket's blocking mode is kept."""
    timeout = sock.gettimeout()
    try:
        if timeout:  # CPython would wait for readability first, MSG_DONTWAIT or not
            _BaseSocket.settimeout(sock, 0.0)
        head = _BaseSocket.recv(sock, 4, _PEEK)
    except OSError:
        return False
    finally:
        if timeout:
            _BaseSocket.settimeout(sock, timeout)
    return bool(head) and any(eye.startswith(head) for eye in CLC_EYECATCHERS)


NOSMCDEV = 0x03030000
"""SMC_CLC_DECL_NOSMCDEV: what a server that cannot do SMC now answers a Proposal with."""
_LATE_CLC_WAIT = 5.0
"""Seconds to read the rest of a Proposal whose head arrived (its sender wrote it whole)."""


def answer_late_proposal(sock: _socket.socket, flags: int = 0) -> bool:
    """The first read of a server half that stayed on TCP without a Decline exchange: a client
    whose daemon proposed (a configured peer, a Proposal sent while this host's daemon was
    down or refused us) writes its Proposal first, before any of its application's bytes. Read
    it and answer with a Decline, as a kernel server without SMC does, so that the client's
    side falls back cleanly and both applications see only each other's bytes. True when
    decided (the stream does not start with CLC, or the Proposal was answered); False when no
    byte is there yet (a non-blocking socket: ask again at the next read). A Proposal that
    cannot be read whole or answered resets the connection (ConnectionResetError)."""
    peek = _socket.MSG_PEEK | (flags & _socket.MSG_DONTWAIT)  # the read's own waiting
    try:
        head = _BaseSocket.recv(sock, 8, peek)  # as the application's read would wait
    except (BlockingIOError, InterruptedError):
        return False
    if not head or not any(eye.startswith(head[:4]) for eye in CLC_EYECATCHERS):
        _late_clc_settled(sock)
        return True
    if flags & _socket.MSG_DONTWAIT or sock.gettimeout() == 0.0:
        _late_clc_nowait(sock, head)  # returns once all of it is queued: no wait below
    timeout = sock.gettimeout()
    _BaseSocket.settimeout(sock, _LATE_CLC_WAIT)
    try:
        until = time.monotonic() + _LATE_CLC_WAIT
        while len(head) < 8:  # a peek returns what is there: look again until the header is
            if time.monotonic() > until:
                raise OSError(errno.EPROTO, "a partial CLC header")
            time.sleep(0.001)
            head = _BaseSocket.recv(sock, 8, _socket.MSG_PEEK)
        if head[:4] not in CLC_EYECATCHERS:
            return True
        length = int.from_bytes(head[5:7], "big")
        msg = bytearray()
        while len(msg) < length:
            chunk = _BaseSocket.recv(sock, length - len(msg))
            if not chunk:
                break
            msg += chunk
        if len(msg) != length or bytes(msg[-4:]) not in CLC_EYECATCHERS:
            raise OSError(errno.EPROTO, "a partial CLC message")
        if head[4] == 1:  # a Proposal: decline it; a Decline needs no answer
            version = 2 if head[7] >> 4 >= 2 else 1
            _BaseSocket.sendall(sock, peer_option.clc_decline(NOSMCDEV, version))
    except OSError as e:
        text = f"smcd: a late CLC message on a TCP stream: {e}"
        raise _abort(sock, errno.ECONNRESET, text) from e
    finally:
        _BaseSocket.settimeout(sock, timeout)
        _late_clc_settled(sock)
    log.info("declined a late CLC Proposal on a connection that stayed on TCP")
    return True


_late_waits: weakref.WeakKeyDictionary[_socket.socket, float] = weakref.WeakKeyDictionary()
"""Non-blocking server halves with part of a late CLC message queued: the wait's deadline."""


def _late_clc_nowait(sock: _socket.socket, head: bytes) -> None:
    """:func:`answer_late_proposal` on a non-blocking read (an event loop's), CLC at the head:
    return once the whole message is queued (it is then read and answered without waiting);
    else raise BlockingIOError, with ``SO_RCVLOWAT`` raised to the bytes that decide, so that
    a selector reports the socket readable again only when they are there or the peer closed
    (no spinning, no polling). The wait is bounded: a message cut off by the peer's FIN, or
    still partial after :data:`_LATE_CLC_WAIT` (a timer on a running asyncio loop; else the
    next read), resets the connection as the blocking read does."""
    if len(head) < 4:
        want = len(head) + 1  # the next byte may show it is no eyecatcher
    elif len(head) < 8:
        want = 8
    else:
        want = max(int.from_bytes(head[5:7], "big"), 8)
    fd = _BaseSocket.fileno(sock)
    if _INT.unpack(_ioctl(fd, _SIOCINQ, _INT0))[0] >= want:
        return
    now = time.monotonic()
    deadline = _late_waits.get(sock)
    if deadline is None:
        deadline = _late_waits[sock] = now + _LATE_CLC_WAIT
        _late_clc_timer(sock, _LATE_CLC_WAIT)
    state = _BaseSocket.getsockopt(sock, _TCP, _socket.TCP_INFO, 1)[0]
    if now >= deadline or state in _FIN_RECEIVED:
        _late_waits.pop(sock, None)
        raise _abort(sock, errno.ECONNRESET, "smcd: a late CLC message on a TCP stream: cut off")
    _BaseSocket.setsockopt(sock, _socket.SOL_SOCKET, _socket.SO_RCVLOWAT, want)
    raise BlockingIOError(errno.EAGAIN, "the rest of a late CLC message is awaited")


def _late_clc_timer(sock: _socket.socket, delay: float) -> None:
    asyncio = sys.modules.get("asyncio")
    try:
        loop = asyncio.get_running_loop() if asyncio is not None else None
    except RuntimeError:
        loop = None
    if loop is not None:
        loop.call_later(delay, _late_clc_expired, weakref.ref(sock))


def _late_clc_expired(ref: weakref.ref[_socket.socket]) -> None:
    """The deadline of a partial late CLC message: reset (the selector then reports the socket
    and the event loop's read gets ECONNRESET)."""
    sock = ref()
    if sock is not None and _late_waits.pop(sock, None) is not None:
        with contextlib.suppress(OSError):
            _abort(sock, errno.ECONNRESET, "smcd: a late CLC message on a TCP stream: cut off")


def _late_clc_settled(sock: _socket.socket) -> None:
    """The late-CLC check decided: the socket's selector readiness is the usual one again."""
    if _late_waits.pop(sock, None) is not None:
        with contextlib.suppress(OSError):
            _BaseSocket.setsockopt(sock, _socket.SOL_SOCKET, _socket.SO_RCVLOWAT, 1)


_libc: Any = None


def reset(sock: _socket.socket) -> None:
    """Reset the TCP connection now, whoever else holds a copy of its descriptor: the peer sees
    ECONNRESET, queued bytes are dropped and later reads and writes through any copy fail."""
    global _libc
    fd = _BaseSocket.fileno(sock)
    with contextlib.suppress(OSError):  # and close() resets if the disconnect is refused
        sock.setsockopt(_socket.SOL_SOCKET, _socket.SO_LINGER, struct.pack("ii", 1, 0))
    try:
        import ctypes

        if _libc is None:
            _libc = ctypes.CDLL(None, use_errno=True)
        unspec = ctypes.create_string_buffer(16)  # a sockaddr of family AF_UNSPEC (0)
        if _libc.connect(fd, unspec, 16) == 0:  # the kernel's tcp_disconnect: RST, CLOSE
            return
    except (OSError, AttributeError):
        pass
    with contextlib.suppress(OSError):  # no libc to call: at least no one writes after this
        _BaseSocket.shutdown(sock, _socket.SHUT_RDWR)


_NR_OPEN = 1 << 20
"""The kernel's default ``fs.nr_open``: the most a process may raise its limit to."""


def raise_nofile_limit() -> str | None:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard limit; why not, when it could not be.

    Why: an SMC connection holds seven descriptors in its process where TCP holds one (the TCP
    socket, the control connection, two eventfds, the peer link and CPython's duplicates of the
    two mapped DMBs), and smcd holds two DMB memfds and a handoff connection per half. Under
    the usual soft limit of 1,024 (systemd's for services and sessions; their hard limit is
    524,288) a program ran out at ~145 SMC connections: ``accept()`` failed with EMFILE, and a
    reply's descriptors that did not fit reset a connection whose CLC was over. So a process
    raises it the first time it hands a connection off (:mod:`smc_handoff.socket`), as Go's
    runtime does for every program, and smcd at start-up; children inherit it."""
    import resource

    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = hard if hard != resource.RLIM_INFINITY else _NR_OPEN
        if soft != resource.RLIM_INFINITY and soft < want:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    except (OSError, ValueError) as e:
        return f"cannot raise the descriptor limit to the hard limit: {e}"
    return None


def daemon_exited(pid: int, wait: float = _EXIT_WAIT) -> bool:
    """Has process ``pid`` (the daemon, from SO_PEERCRED) exited, within ``wait`` seconds?
    A pid of another namespace (0) or no pidfd support: we cannot know, so no."""
    if pid <= 0:
        return False
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    except (OSError, AttributeError):
        return False
    try:
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)
        return bool(poller.poll(wait * 1000))
    finally:
        os.close(pidfd)


# --- one request, one reply -------------------------------------------------------------------


def unexpected(reply: messages.Reply, what: str) -> Fallback:
    if isinstance(reply, messages.Error):
        return messages.daemon_error(f"{what} refused: {reply.code.name}: {reply.message}")
    return messages.daemon_error(f"unexpected {reply.TYPE.name} reply to {what}")


def exchange(
    request: messages.Request,
    fd: int,
    what: str,
    precheck: Callable[[], Fallback | None] | None = None,
) -> tuple[_socket.socket, messages.Reply, list[int]] | Fallback:
    """Send ``request`` with ``fd``; the open control connection, reply and its fds — or the
    fallback to report when there is no usable answer (then nothing is left open). For what
    carries no stream (LISTEN); a connection's handoff goes through :func:`hand_over`.
    ``precheck`` runs once a daemon answered, before anything is sent."""
    timeout = messages.handoff_timeout()
    try:
        ctl, _pid = connect_daemon()
    except NoDaemon as e:
        return messages.daemon_unavailable(str(e))
    refusal = precheck() if precheck is not None else None
    if refusal is not None:
        ctl.close()
        return refusal
    try:
        messages.send_message(ctl, request, [fd])
        reply, fds = recv_reply(ctl, timeout)
    except TimeoutError:
        ctl.close()
        return messages.daemon_unavailable(f"no reply to {what} within {timeout:g} s")
    except messages.HandoffProtocolError as e:
        ctl.close()
        return messages.daemon_error(f"invalid reply to {what}: {e}")
    except (messages.HandoffClosedError, OSError) as e:
        ctl.close()
        return messages.daemon_unavailable(f"handoff connection failed during {what}: {e}")
    return ctl, reply, fds  # type: ignore[return-value]


def _abort(sock: _socket.socket, code: int, text: str) -> OSError:
    """Reset the connection and make the error to raise."""
    reset(sock)
    log.warning("%s: connection reset", text)
    if code == errno.ETIMEDOUT:
        return TimeoutError(code, f"{text}: connection reset")
    return ConnectionResetError(code, f"{text}: connection reset")


def _settle(
    sock: _socket.socket,
    before: StreamMark,
    server_side: bool,
    fallback: Fallback,
    what: str,
    *,
    trusted: bool = False,
    ours: bool = True,
) -> Fallback:
    """The fallback, when the stream allows it (see the module docstring); else the error.
    ``ours``: the library decided it (no FALLBACK from the daemon)."""
    after = StreamMark.take(sock)
    untouched = after.untouched_since(before)
    outcome = f"smcd: {what} ended in {fallback.name}"
    if not untouched and not trusted:
        raise _abort(sock, errno.ECONNRESET, f"{outcome} after {after.describe_since(before)}")
    if in_repair(sock) and not leave_repair(sock):
        # a daemon that died while it read the connection's sequence numbers left the socket in
        # repair mode, where nothing it sends leaves, and we may not take it out: an error
        raise _abort(sock, errno.ECONNRESET, f"{outcome} with the socket left in TCP repair mode")
    if (server_side or not untouched) and clc_at_head(sock):
        raise _abort(sock, errno.ECONNRESET, f"{outcome} with CLC bytes waiting to be read")
    if ours and untouched and not server_side:
        return _decline_first(sock, fallback)
    return fallback


def _decline_first(sock: _socket.socket, fallback: Fallback) -> Fallback:
    """A client half falls back with no daemon's word on an untouched stream: if the peer's
    SYN-ACK carried the SMC option it waits for CLC, so it gets a Decline first, as from the
    kernel's client (:mod:`smc_handoff.peer_option`); a Decline that cannot go out whole resets
    the connection."""
    if not peer_option.peer_waits_for_clc(sock):
        return fallback
    if not peer_option.send_decline(sock, fallback.code):
        raise _abort(sock, errno.ECONNRESET, f"smcd: {fallback.name}: the Decline to the SMC "
                     "peer (its SYN-ACK carried the option) did not go out")  # fmt: skip
    why = f"{fallback.explanation}; the peer showed the SMC TCP option: declined before TCP"
    return dataclasses.replace(fallback, explanation=why[:1024], after_decline=True)


def _unsent(sock: _socket.socket, server_side: bool, fallback: Fallback, what: str) -> Fallback:
    """The fallback when the socket never left: a server half still checks the head (a client
    whose daemon got through proposed, and no daemon will answer it here)."""
    if server_side and clc_at_head(sock):
        text = f"smcd: {what} ended in {fallback.name} with CLC bytes waiting to be read"
        raise _abort(sock, errno.ECONNRESET, text)
    return fallback if server_side else _decline_first(sock, fallback)


Handed = tuple[_socket.socket, messages.Channel, list[int]]
"""A CHANNEL reply: the open control connection, the reply and its descriptors."""


@dataclass
class Offer:
    """A handoff whose request is with the daemon and whose reply is not read yet
    (:func:`offer`); :func:`answer` reads it. It holds no reference to the socket (a socket
    that keeps one to itself would wait for the garbage collector to be closed)."""

    request: messages.Connect | messages.Accept
    ctl: _socket.socket
    pid: int
    before: StreamMark
    timeout: float


def hand_over(
    sock: _socket.socket,
    request: messages.Connect | messages.Accept,
    precheck: Callable[[], Fallback | None] | None = None,
) -> Handed | Fallback:
    """Offer the connected TCP ``sock`` to the daemon: the open control connection, CHANNEL reply
    and its fds; or the fallback, with the stream as the application left it; or, when that is
    not so, :class:`ConnectionResetError`/:class:`TimeoutError` after resetting the connection.
    ``precheck`` runs once a daemon answered, before anything is sent."""
    sent = offer(sock, request, precheck)
    return sent if isinstance(sent, Fallback) else answer(sock, sent)


def offer(
    sock: _socket.socket,
    request: messages.Connect | messages.Accept,
    precheck: Callable[[], Fallback | None] | None = None,
    *,
    marked: bool = False,
) -> Offer | Fallback:
    """The first half of :func:`hand_over`: send the request with the descriptor and return
    without waiting for the reply; or the fallback when the descriptor never left.
    ``marked``: the client socket carries :data:`~smc_handoff.peer_option.HANDOFF_MARK`
    already (smc-run set it before ``connect()``), so it is not set again."""
    server_side = isinstance(request, messages.Accept)
    what = "ACCEPT" if server_side else "CONNECT"
    timeout = messages.handoff_timeout()
    try:
        ctl, pid = connect_daemon(ACCEPT_BUSY_WAIT if server_side else 0.0)
    except NoDaemon as e:
        return _unsent(sock, server_side, messages.daemon_unavailable(str(e)), what)
    refusal = precheck() if precheck is not None else None
    if refusal is not None:
        ctl.close()
        return _unsent(sock, server_side, refusal, what)
    before = StreamMark.take(sock)
    if not (server_side or marked):
        try:  # noqa: SIM105 (every handoff: contextlib.suppress costs three calls more)
            _BaseSocket.setsockopt(sock, *peer_option.HANDOFF_MARK, 1)
        except OSError:
            pass
    try:
        messages.send_message(ctl, request, [_BaseSocket.fileno(sock)])
    except OSError as e:  # a SEQPACKET datagram is sent whole or not at all: nothing left
        ctl.close()
        text = f"handoff connection failed during {what}: {e}"
        return _unsent(sock, server_side, messages.daemon_unavailable(text), what)
    return Offer(request, ctl, pid, before, timeout)


def answer(sock: _socket.socket, sent: Offer) -> Handed | Fallback:
    """The second half of :func:`hand_over`: wait for the reply to ``sent`` (the offer of
    ``sock``) and act on it."""
    ctl, before, timeout = sent.ctl, sent.before, sent.timeout
    server_side = isinstance(sent.request, messages.Accept)
    what = "ACCEPT" if server_side else "CONNECT"
    try:
        msg, fds = recv_reply(ctl, timeout)
    except TimeoutError:
        ctl.close()
        text = f"smcd: no reply to {what} within {timeout:g} s (the daemon still holds the socket)"
        raise _abort(sock, errno.ETIMEDOUT, text) from None
    except messages.HandoffProtocolError as e:
        ctl.close()
        fallback = messages.daemon_error(f"invalid reply to {what}: {e}")
        return _settle(sock, before, server_side, fallback, what)
    except (messages.HandoffClosedError, OSError) as e:
        ctl.close()
        # ECONNRESET: the daemon closed with our request unread, so the descriptor never
        # reached it. A plain hang-up came after it took the request: only its death (its
        # copies die with it) says it let go.
        unread = isinstance(e, ConnectionResetError)
        if not unread and not daemon_exited(sent.pid):
            text = f"smcd hung up on {what} without a reply and still runs ({e})"
            raise _abort(sock, errno.ECONNRESET, text) from None
        fallback = messages.daemon_unavailable(f"handoff connection failed during {what}: {e}")
        return _settle(sock, before, server_side, fallback, what)
    reply: messages.Reply = msg  # type: ignore[assignment]  # (requests=False: only replies)
    if isinstance(reply, messages.Channel):
        return ctl, reply, fds
    ctl.close()
    messages.close_fds(fds)
    if isinstance(reply, Fallback):
        return _settle(sock, before, server_side, reply, what, trusted=reply.after_decline,
                       ours=False)  # fmt: skip
    return _settle(sock, before, server_side, unexpected(reply, what), what)


# --- after CHANNEL ----------------------------------------------------------------------------


@dataclass
class ChannelState:
    """What an SmcSocket holds while its data goes through a channel."""

    channel: _Channel
    control: _socket.socket | None
    info: messages.Channel
    role: messages.Role
    conn_id: int = 0
    rd_shut: bool = False
    wr_shut: bool = False
    next_check: float = 0.0  # monotonic time of the next check_daemon (see there)
    deadline: float | None = None  # of the sendall() in progress (None: per call)
    fd_nonblock: bool = False
    """The program set ``O_NONBLOCK`` on ``fileno()`` itself (``fcntl``, ``os.set_blocking``):
    calls of a socket without a timeout then do not wait, as on a TCP socket's descriptor,
    until ``settimeout``/``setblocking`` sets the mode again."""
    rcvtimeo: float | None = None
    """The TCP socket's ``SO_RCVTIMEO`` in seconds (0: none), which bounds a blocking read's
    wait (``SmcSocket._blocking_until``); None until a blocking read first waits, and again
    after any ``SOL_SOCKET`` option is set."""
    sndtimeo: float | None = None
    """``SO_SNDTIMEO`` likewise, for a blocking send."""
    resumable: bool = True  # False once a daemon refused our RESUME: asking again changes nothing
    holders: int = 1  # socket objects sharing this connection (dup()): the last close closes it
    relay: int | None = None
    """The relay socket that stands in for the connection in the processes it was given to
    (``child_relay.shared_relay``), kept open until the connection's last close here (or this
    state's collection: ``relay_closer``), as a TCP socket passed on stays open while the
    sender holds its own copy."""
    relay_closer: Callable[[], object] | None = None
    fd: int = -1
    """The channel's ``fileno()`` number while the sockets on it are indexed by it
    (``smc_handoff.socket.connection_at``)."""

    RECHECK_S = 1.0

    @property
    def sent(self) -> int:
        """Bytes sent over the channel (the channel counts them: the data path does not)."""
        return self.channel.bytes_sent

    @property
    def received(self) -> int:
        return self.channel.bytes_received

    def notify(self, msg: messages.Request) -> None:
        """Tell the daemon (best effort: the channel never depends on it)."""
        if self.control is None:
            return
        try:
            self.control.setblocking(False)
            messages.send_message(self.control, msg)
        except OSError:
            self.control.close()
            self.control = None

    def check_daemon(self, tcp_fd: int) -> None:
        """Called before a wait, at most once a second (the first time a second after the
        handoff: a short connection never pays for it): read the daemon's late replies (OK to
        RESUME), and when the daemon went away (hang-up) RESUME with the one that replaced
        it, without waiting for its answer. Never raises: the channel does not need this."""
        now = time.monotonic()
        if now < self.next_check or not self.resumable:
            return
        self.next_check = now + self.RECHECK_S
        ctl = self.control
        if ctl is not None:
            try:
                ctl.setblocking(False)
                while True:
                    msg, fds = messages.recv_message(ctl, requests=False)
                    messages.close_fds(fds)
                    if isinstance(msg, messages.Ok):
                        self.conn_id = msg.ident
                    elif isinstance(msg, messages.Error):
                        # the new daemon could not verify this channel (RESUME is checked against
                        # what the previous one recorded): the channel goes on unobserved
                        log.debug("connection %d: RESUME refused: %s", self.conn_id, msg.message)
                        self.resumable = False
                        ctl.close()
                        self.control = None
                        return
            except (BlockingIOError, InterruptedError):
                return  # the daemon is still there
            except (OSError, messages.HandoffError):
                ctl.close()
                self.control = None
        try:
            ctl, _pid = connect_daemon()
        except NoDaemon:
            return
        resume = messages.Resume(
            self.conn_id,
            self.role,
            self.info.mode,
            self.info.rx_size,
            self.info.tx_size,
            self.sent,
            self.received,
        )
        try:
            messages.send_message(ctl, resume, [tcp_fd])
        except OSError:
            ctl.close()
            return
        self.control = ctl
        log.debug("connection %d: RESUME sent to the new daemon", self.conn_id)


# --- listeners --------------------------------------------------------------------------------


class Registration:
    """A listening socket's LISTEN registration with smcd, renewed if the daemon comes back."""

    RETRY_S = 0.1
    """Seconds between tries while the daemon is away (tried at an ``accept()``). A try costs
    a ``connect()`` that fails at once; the longer the wait, the more connections fall back
    after the daemon came back (a second of them after each restart at 1 s)."""

    def __init__(self, listener: _socket.socket) -> None:
        self._listener = listener
        self._control: _socket.socket | None = None
        self._hangup = _poll()  # watches _control (used under _lock)
        self.listener_id: int | None = None
        self.fallback: Fallback | None = None
        self._next_try = 0.0
        self._lock = threading.Lock()  # accept loops may ask from several threads
        self._register()

    def _register(self) -> None:
        self._next_try = time.monotonic() + self.RETRY_S
        result = exchange(messages.Listen(), _BaseSocket.fileno(self._listener), "LISTEN")
        if isinstance(result, Fallback):
            self.fallback = result
            log.debug("listener not registered: %s", result)
            return
        ctl, reply, fds = result
        messages.close_fds(fds)
        if isinstance(reply, messages.Ok):
            self._control, self.listener_id, self.fallback = ctl, reply.ident, None
            self._hangup = _poll()
            self._hangup.register(ctl, select.POLLIN)
            log.debug("listener %d registered", reply.ident)
            return
        ctl.close()
        self.fallback = reply if isinstance(reply, Fallback) else unexpected(reply, "LISTEN")

    def rebind(self, listener: _socket.socket) -> None:
        """Another socket object has the listening descriptor now (``ssl`` wrapped it): the
        renewals after a daemon restart pass that one's."""
        self._listener = listener

    @property
    def active(self) -> bool:
        """True while the daemon holds the registration; one poll(0) per call, and a retry at
        most every :data:`RETRY_S` once the daemon dropped it (e.g. restarted)."""
        with self._lock:
            ctl = self._control
            # HUP (nothing is ever sent after OK): the daemon let go
            if ctl is not None and self._hangup.poll(0):
                ctl.close()
                self._control = self.listener_id = None
            if self._control is None and time.monotonic() >= self._next_try:
                self._register()
            return self._control is not None

    def close(self) -> None:
        with self._lock:
            if self._control is not None:
                self._control.close()
                self._control = None
            self._next_try = float("inf")  # closed for good: never register again
