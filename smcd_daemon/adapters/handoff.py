"""The handoff socket: where applications hand their TCP sockets to smcd (minimal until the
handoff issue).

What is already real, because the rest of the daemon (systemd socket activation, the unit's
``SocketMode=0666``, the tests of "the daemon survives garbage") depends on it:

- an ``AF_UNIX`` ``SOCK_SEQPACKET`` listener, inherited from systemd (``smcd.socket``) or bound by
  the daemon itself (mode 0666, since every local application may hand off; callers are told
  apart by ``SO_PEERCRED``, not by file permissions);
- one task per client connection reading whole datagrams with ``recvmsg`` (so message boundaries,
  truncation and ``SCM_RIGHTS`` descriptors are all seen), checking and logging the peer's
  credentials, and answering every datagram with exactly one reply;
- limits: a datagram longer than :data:`MAX_REQUEST` is refused as oversized, descriptors that
  arrive with a request we do not use are closed at once (never leaked), at most
  :data:`MAX_CLIENTS` connections are served at a time, and no input can end the server.

What is not there yet is the handoff protocol itself. Until it arrives, a request is a UTF-8 JSON
object with an integer ``"version"`` and a string ``"op"``; a well-formed one gets the error
``unsupported``, anything else the error ``malformed`` or ``oversized``. A reply is a JSON object
``{"version": 1, "ok": false, "error": <code>, "message": <text>}``. The handoff issue replaces the
request decoding, keeping the socket, the credential check and the limits.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import errno
import json
import logging
import os
import socket
import stat
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from smcd_daemon.errors import SmcError

__all__ = [
    "MAX_CLIENTS",
    "MAX_REQUEST",
    "PROTOCOL_VERSION",
    "HandoffError",
    "HandoffServer",
    "HandoffStats",
    "PeerCred",
    "bind_seqpacket",
    "decode_request",
    "error_reply",
]

log = logging.getLogger(__name__)

PROTOCOL_VERSION = 1
MAX_REQUEST = 64 * 1024
"""Largest request datagram; longer ones are answered ``oversized`` (and logged)."""
MAX_FDS = 16
"""Descriptors accepted with one request (the rest of SCM_RIGHTS is truncated by the kernel)."""
MAX_CLIENTS = 1024
"""Connections served at once; more are closed right after accept (and counted)."""

UNSUPPORTED_MESSAGE = "unsupported: handoff arrives with the handoff issue"


class HandoffError(SmcError):
    """The handoff socket cannot be set up (path in use, not a socket, permissions...)."""


@dataclass(frozen=True)
class PeerCred:
    """Who is on the other end of a connection, as the kernel vouches for it (SO_PEERCRED)."""

    pid: int
    uid: int
    gid: int

    def __str__(self) -> str:
        return f"pid {self.pid} uid {self.uid} gid {self.gid}"


@dataclass
class HandoffStats:
    """Counters of the handoff socket, for logs, STATUS= and tests."""

    connections: int = 0
    refused_connections: int = 0
    requests: int = 0
    unsupported: int = 0
    malformed: int = 0
    oversized: int = 0
    fds_closed: int = 0
    errors: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


class RequestError(SmcError):
    """A request we refuse; ``code`` is the reply's ``error`` field."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def error_reply(code: str, message: str) -> bytes:
    return json.dumps(
        {"version": PROTOCOL_VERSION, "ok": False, "error": code, "message": message},
        ensure_ascii=False,
    ).encode()


def decode_request(data: bytes) -> dict[str, Any]:
    """Check the interim request envelope; raise :class:`RequestError` ("malformed")."""
    if not data:
        raise RequestError("malformed", "malformed: empty request")
    try:
        obj = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise RequestError(
            "malformed", f"malformed: not UTF-8 ({e.reason} at byte {e.start})"
        ) from None
    except json.JSONDecodeError as e:
        raise RequestError(
            "malformed", f"malformed: not JSON ({e.msg} at column {e.colno})"
        ) from None
    except RecursionError:
        raise RequestError("malformed", "malformed: JSON nested too deeply") from None
    if not isinstance(obj, dict):
        raise RequestError("malformed", "malformed: a request is a JSON object")
    version = obj.get("version")
    if isinstance(version, bool) or not isinstance(version, int):
        raise RequestError("malformed", 'malformed: "version" must be an integer')
    if not isinstance(obj.get("op"), str):
        raise RequestError("malformed", 'malformed: "op" must be a string')
    return obj


def peer_cred(sock: socket.socket) -> PeerCred | None:
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except OSError:
        return None
    pid, uid, gid = struct.unpack("3i", raw)
    return PeerCred(pid, uid, gid)


def bind_seqpacket(path: Path, *, mode: int = 0o666, backlog: int = 128) -> socket.socket:
    """Bind and listen on ``path``. A stale socket file (nobody listening) is replaced; a live
    one, or a path that is not a socket, is an error rather than something to destroy."""
    path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    if st is not None:
        if not stat.S_ISSOCK(st.st_mode):
            raise HandoffError(
                f"handoff socket {path} exists and is not a socket; remove it or set "
                "handoff_socket to another path"
            )
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            probe.connect(os.fspath(path))
        except (ConnectionRefusedError, FileNotFoundError):
            os.unlink(path)  # stale: left by a daemon that died
        except OSError as e:
            raise HandoffError(f"handoff socket {path} cannot be checked: {e}") from e
        else:
            raise HandoffError(f"handoff socket {path} is in use: another smcd is serving it")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    try:
        sock.bind(os.fspath(path))
        os.chmod(path, mode)
        sock.listen(backlog)
    except OSError as e:
        sock.close()
        raise HandoffError(f"cannot listen on handoff socket {path}: {e.strerror or e}") from e
    return sock


def _close_fds(ancdata: list[tuple[int, int, bytes]]) -> int:
    """Close every descriptor that arrived with a message; return how many."""
    n = 0
    for level, kind, data in ancdata:
        if level != socket.SOL_SOCKET or kind != socket.SCM_RIGHTS:
            continue
        fds = array.array("i")
        fds.frombytes(data[: len(data) - (len(data) % fds.itemsize)])
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)
                n += 1
    return n


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


@dataclass(eq=False)
class _Client:
    sock: socket.socket
    cred: PeerCred | None
    task: asyncio.Task[None] | None = None
    label: str = field(default="")


class HandoffServer:
    """Serves the handoff socket on the running loop.

    ``sock`` is a listening SOCK_SEQPACKET socket; ``owns_path`` says whether we bound it (then
    :meth:`stop` removes the file) or inherited it from systemd (then the socket unit owns the
    file and it stays).
    """

    def __init__(self, sock: socket.socket, *, owns_path: bool) -> None:
        self._sock = sock
        self.owns_path = owns_path
        name = sock.getsockname()
        self.path = Path(os.fsdecode(name)) if name else None
        self.stats = HandoffStats()
        self._clients: set[_Client] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped = False

    @classmethod
    def bind(cls, path: Path) -> HandoffServer:
        return cls(bind_seqpacket(path), owns_path=True)

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._sock.setblocking(False)
        self._loop.add_reader(self._sock.fileno(), self._on_accept)

    async def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        if self._loop is not None:
            with contextlib.suppress(Exception):
                self._loop.remove_reader(self._sock.fileno())
        for client in list(self._clients):
            if client.task is not None:
                client.task.cancel()
        for client in list(self._clients):
            if client.task is not None:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await client.task
        if self.owns_path and self.path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        self._sock.close()

    # -- accepting -------------------------------------------------------------------------

    def _on_accept(self) -> None:
        for _ in range(64):  # drain a burst, then let the loop breathe
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                # EMFILE/ENFILE/ENOBUFS: keep listening; the client sees its connect fail.
                self.stats.errors += 1
                log.warning("handoff: accept failed: %s", e)
                return
            self._serve(conn)

    def _serve(self, conn: socket.socket) -> None:
        self.stats.connections += 1
        if len(self._clients) >= MAX_CLIENTS:
            self.stats.refused_connections += 1
            log.warning("handoff: %d clients already connected; refusing one more", MAX_CLIENTS)
            conn.close()
            return
        conn.setblocking(False)
        cred = peer_cred(conn)
        client = _Client(conn, cred, label=str(cred) if cred else "unknown peer")
        log.info("handoff: connection from %s", client.label)
        self._clients.add(client)
        assert self._loop is not None
        client.task = self._loop.create_task(self._client_loop(client), name="smcd-handoff")

    # -- one client ------------------------------------------------------------------------

    async def _recvmsg(self, sock: socket.socket) -> tuple[bytes, list[Any], int]:
        assert self._loop is not None
        ancsize = socket.CMSG_SPACE(MAX_FDS * array.array("i").itemsize)
        while True:
            try:
                return sock.recvmsg(MAX_REQUEST + 1, ancsize, socket.MSG_CMSG_CLOEXEC)[:3]
            except (BlockingIOError, InterruptedError):
                pass
            fut: asyncio.Future[None] = self._loop.create_future()
            self._loop.add_reader(sock.fileno(), _wake, fut)
            try:
                await fut
            finally:
                self._loop.remove_reader(sock.fileno())

    async def _client_loop(self, client: _Client) -> None:
        try:
            while True:
                try:
                    data, ancdata, flags = await self._recvmsg(client.sock)
                except OSError as e:
                    if e.errno not in (errno.ECONNRESET, errno.EPIPE):
                        self.stats.errors += 1
                        log.warning("handoff: receiving from %s failed: %s", client.label, e)
                    return
                if not data and not ancdata:
                    # End of file. An empty datagram reads the same (recvmsg returns 0 bytes on
                    # SOCK_SEQPACKET either way), so it, too, ends the connection.
                    return
                reply = self.handle(data, ancdata, flags, client.label)
                try:
                    client.sock.send(reply)
                except (BlockingIOError, InterruptedError):
                    self.stats.errors += 1
                    log.warning("handoff: %s does not read its replies; closing", client.label)
                    return
                except OSError as e:
                    log.info("handoff: %s went away before the reply: %s", client.label, e)
                    return
        except asyncio.CancelledError:
            raise
        except Exception:
            self.stats.errors += 1
            log.exception("handoff: unexpected error serving %s; connection closed", client.label)
        finally:
            self._clients.discard(client)
            client.sock.close()

    def handle(self, data: bytes, ancdata: list[Any], flags: int, who: str) -> bytes:
        """One request in, one reply out (pure apart from closing received descriptors)."""
        self.stats.requests += 1
        closed = _close_fds(ancdata)
        self.stats.fds_closed += closed
        if flags & socket.MSG_TRUNC or len(data) > MAX_REQUEST:
            self.stats.oversized += 1
            log.warning(
                "handoff: oversized request from %s (more than %d bytes); refused", who,
                MAX_REQUEST,
            )  # fmt: skip
            return error_reply("oversized", f"oversized: a request is at most {MAX_REQUEST} bytes")
        try:
            request = decode_request(data)
        except RequestError as e:
            self.stats.malformed += 1
            log.warning("handoff: %s from %s (%d bytes)", e, who, len(data))
            return error_reply(e.code, str(e))
        self.stats.unsupported += 1
        log.info(
            "handoff: request %r (version %d) from %s: not supported yet",
            request["op"][:64], request["version"], who,
        )  # fmt: skip
        return error_reply("unsupported", UNSUPPORTED_MESSAGE)
