"""The handoff protocol: how an application hands a TCP socket to smcd and gets a channel back.

This module is the protocol's definition. The client library (``smc_handoff.socket``) and the
daemon (``smcd_daemon.adapters.handoff``) both encode and decode with it, so there is one source
of truth; everything below is normative. The constants, errors, enumerations and message classes
are defined in :mod:`smc_handoff.message_defs` and imported from here; this module frames them,
sends and receives them, and finds the daemon.

Transport
=========
An ``AF_UNIX`` ``SOCK_SEQPACKET`` socket (so message boundaries and ``SCM_RIGHTS`` descriptors
arrive intact, and a process death is seen as a hang-up). Where the client looks
(:func:`handoff_socket_candidates`):

1. ``$SMCD_HANDOFF_SOCKET`` if set (then only that path);
2. otherwise the per-user default ``$XDG_RUNTIME_DIR/smcd/handoff.sock`` (``<tmp>/smcd-<uid>/
   handoff.sock`` without ``XDG_RUNTIME_DIR``, as ``smcd_daemon.config`` computes it), then the
   system-wide ``/run/smcd/handoff.sock``.

The first path that accepts a connection is used. The client checks ``SO_PEERCRED``: the daemon
must run as root or as the client's own uid, otherwise the connection is dropped (another user
squatting a predictable path must never receive our sockets). The daemon checks ``SO_PEERCRED``
on every request and applies the per-user limits; a connection past one of them (too many that
sent no request yet, or held) is answered with FALLBACK to its request (the daemon does no work
for it before) and closed, and one that sends no request within the daemon's
``limits.first_request_wait`` is closed.

Connections
===========
One SEQPACKET connection per SMC connection (plus one per registered listener). It stays open for
the life of what it registered: the daemon learns about closes and process deaths through it (a
hang-up means the process let go of everything registered on that connection), and rebuilds its
registry from it after a restart (RESUME). Exactly one request opens a connection: CONNECT,
ACCEPT, LISTEN or RESUME. After a CHANNEL reply the client may only send SHUTDOWN and CLOSE
notices on it; after OK to LISTEN nothing; after FALLBACK or ERROR the client closes it.

Framing
=======
Every datagram is one message: a 12-byte header, then the body. All integers are unsigned,
big-endian (network order). A datagram is at most :data:`MAX_MESSAGE` (4096) bytes::

    offset size field
    0      4    magic     b"SMCH"
    4      1    version   1 (:data:`VERSION`)
    5      1    type      MessageType
    6      2    flags     0 (reserved in version 1; non-zero is rejected)
    8      4    length    body length in bytes; must equal datagram length - 12

Strings (``str16``) are a u16 byte length followed by that many bytes of UTF-8 (strict; no NUL),
at most :data:`MAX_TEXT` (1024) bytes. Reason names (``name16``) are ``str16`` restricted to
``[A-Za-z0-9_]{1,64}``. Sizes (``dmb_size``, ``rx_size``, ``tx_size``) are the whole DMB in bytes
(32-byte CDC header included): ``16 KiB << n`` with ``n`` in 0..6 (16 KiB .. 1 MiB, the SMC-D
DMB sizes, Linux ``SMCD_DMBE_SIZES``); ``dmb_size`` 0 means "the daemon's choice". A DMB memfd is
``size + 128`` bytes long: smcd's control trailer (wakeup words, ``smc_handoff.layout``) follows
the DMB proper. Bodies have exactly the length their fields add up to; trailing bytes are an
error. Enumerations: ``Mode`` 1 = smcd (SMC-D, loopback-ism), 2 = smcr (SMC-R); ``Role``
1 = client, 2 = server; ``ErrorCode`` 1 MALFORMED, 2 OVERSIZED, 3 UNSUPPORTED_VERSION,
4 UNSUPPORTED_TYPE, 5 BAD_FDS, 6 BAD_STATE (valid but not allowed now, e.g. a second CONNECT),
7 DENIED (policy for this caller), 8 INTERNAL (the daemon failed; TCP untouched).

Messages
========
Requests (client → daemon; types below 0x80) and replies (daemon → client; 0x80 and above). The
descriptor column is the exact ``SCM_RIGHTS`` list, in order; any other count is an error.

``CONNECT`` 0x01 — the client half of a connected TCP socket. fds: ``[tcp]``.
    body: ``dmb_size u32`` (the receive buffer the client would like; a hint the daemon bounds
    by its config). The daemon tries SMC only toward peers known to speak it (a same-host
    listener registered with LISTEN, or a network of the config's ``peers``); otherwise it
    replies FALLBACK ``PEERNOSMC`` (0x03010000) before writing a byte. Loopback pairs a CONNECT
    with the ACCEPT whose TCP 4-tuple mirrors it (both halves held by this daemon), never by
    GID alone. Replies: CHANNEL, FALLBACK, ERROR.
``ACCEPT`` 0x02 — the server half of an accepted TCP socket. fds: ``[tcp]``.
    body: ``dmb_size u32``. The daemon ``MSG_PEEK``\\ s for a CLC Proposal eyecatcher with a
    bounded wait (config ``timeouts.proposal_wait``, ``local_client_wait`` for a client on the
    same host); a plain TCP client (including one that sends nothing first) is handed back
    untouched with FALLBACK. Replies: CHANNEL, FALLBACK, ERROR.
``LISTEN`` 0x03 — register an SMC-enabled listener for same-host clients. fds: ``[listener]``
    (the listening TCP socket itself, so the daemon reads its address with ``getsockname`` and
    checks ``SO_ACCEPTCONN`` instead of trusting a claimed address; it keeps no copy).
    body: empty. The registration lives as long as this SEQPACKET connection.
    Replies: OK (``ident`` = listener id), FALLBACK (not registered; the listener works on TCP),
    ERROR.
``RESUME`` 0x04 — after a daemon restart, re-register a live channel so the registry (smcctl
    conns, quotas) is rebuilt; best effort: the channel itself never depended on the daemon.
    fds: ``[tcp]``. body: ``conn_id u64`` (the id of the old CHANNEL reply), ``role u8``
    (Role: 1 client, 2 server), ``mode u8`` (Mode), ``reserved u16`` (0), ``rx_size u32``,
    ``tx_size u32``, ``bytes_sent u64``, ``bytes_received u64`` (36 bytes). The daemon pairs
    the two halves again by the TCP 4-tuple. The restarted daemon holds no copy of those DMBs:
    their memory is freed when both applications have unmapped them, and it only counts their
    sizes against the quota. The library sends RESUME without waiting: it
    notices the old daemon's hang-up on its control connection when it is about to wait for
    the channel (at most once a second) and reads the reply later. Replies: OK (``ident`` =
    the new connection id), ERROR (DENIED: the daemon verifies a RESUME against what the previous
    daemon recorded of that channel half — the id, once; the user; the TCP socket itself, by
    inode and addresses; role and buffer sizes — and counts the half's receive DMB against the
    user's quota; anything else is refused and recorded nowhere).
``SHUTDOWN`` 0x05 — notice: the application called ``shutdown(how)``. No fds, no reply.
    body: ``how u8`` (0 SHUT_RD, 1 SHUT_WR, 2 SHUT_RDWR).
``CLOSE`` 0x06 — notice: the application closed the channel (then closes this connection).
    Optional: the hang-up alone tells the daemon the same (it reads the final counters from the
    DMBs), so the library's ``close()`` just hangs up, saving a message per connection; it
    sends CLOSE only when a socket leaves its channel before any data (``detach``). No fds, no
    reply.
    body: ``aborted u8`` (0 clean close, 1 abort: unread data or reset),
    ``bytes_sent u64``, ``bytes_received u64`` (17 bytes), for the registry and stats.

``CHANNEL`` 0x81 — SMC is established. fds: ``[rx_dmb, tx_dmb, rx_eventfd, tx_eventfd,
    peer_link]`` (this end's receive DMB memfd, the peer's DMB this end writes into, the eventfd
    this end sleeps on, the eventfd that wakes the peer, this end of the peer-link
    ``SOCK_SEQPACKET`` socketpair). body: ``conn_id u64`` (non-zero), ``mode u8`` (Mode),
    ``rx_size u32``, ``tx_size u32`` (17 bytes). The daemon keeps no copy of the peer link.
``FALLBACK`` 0x82 — SMC is not used; the TCP socket is the application's again, unchanged (no
    byte was consumed or written on it that the application would see: none at all, or a CLC
    exchange that ended in a Decline both ends processed, flag bit 1). No fds. ``name`` is
    the kernel's symbolic name without ``SMC_CLC_DECL_`` (e.g. ``PEERNOSMC``).
    body: ``code u32`` (a CLC decline / fallback reason code, e.g. 0x03010000 PEERNOSMC,
    0x030D0000 MAX_DMB when past the per-user quota), ``flags u8`` (bit 0: a peer diagnosis is
    present; bit 1: ``after_decline``, CLC bytes crossed the stream before the Decline, which
    the library trusts only so; other bits 0), ``peer_diagnosis u32`` (the code of the peer's
    CLC Decline, 0 when absent), ``name name16``, ``explanation str16``.
``ERROR`` 0x83 — the request was refused; nothing was done with its descriptors (the daemon
    closed its copies) and the TCP connection is untouched. No fds. body: ``code u16``
    (ErrorCode), ``message str16``. The ERROR layout is frozen for all versions, so that any
    client can read the answer to a version it does not speak. After an ERROR reply to a
    malformed request the daemon closes the connection.
``OK`` 0x84 — success of LISTEN or RESUME. No fds. body: ``ident u64``.

Rules for both ends
===================
- Bounded: receivers read with a buffer of ``MAX_MESSAGE + 1`` bytes and room for
  :data:`MAX_FDS` descriptors; a truncated datagram (``MSG_TRUNC``) is OVERSIZED, truncated
  ancillary data (``MSG_CTRUNC``) is BAD_FDS. Descriptors are received close-on-exec.
- Strict: wrong magic, an unknown type, non-zero reserved bits, a length mismatch, a value out of
  range, invalid UTF-8 or a wrong descriptor count make the message invalid
  (:class:`HandoffProtocolError`, whose ``code`` is the ERROR code to answer with). Every
  descriptor that came with an invalid message is closed at once.
- A version the receiver does not speak is :class:`HandoffVersionError`; the daemon answers ERROR
  UNSUPPORTED_VERSION with its own version in the header.
- The daemon never lets an invalid request end the daemon or touch other connections: it answers
  ERROR, logs, closes that connection and carries on.
- Before replying to CONNECT/ACCEPT the daemon closes every copy of the TCP descriptor it
  borrowed (so the application's ``close()`` really closes the TCP connection) and leaves the
  descriptor's file status flags as it found them (``O_NONBLOCK`` is shared by all copies); the
  library re-applies its own blocking mode after every reply anyway.
- The daemon answers CONNECT/ACCEPT within its CLC timeouts; the client waits
  :data:`HANDOFF_TIMEOUT` seconds (``$SMCD_HANDOFF_TIMEOUT`` overrides), then resets the TCP
  connection and fails with ETIMEDOUT (the daemon still holds the socket). No daemon at the
  path, a refused connection, an untrusted daemon, an ERROR, an invalid reply or the daemon's
  death degrade to TCP when the stream is untouched, otherwise the library resets it and fails
  with ECONNRESET (``smc_handoff.handoff`` checks the kernel's byte counts). Such fallbacks
  have the local codes :data:`FALLBACK_DAEMON_UNAVAILABLE` (0xFF000001) /
  :data:`FALLBACK_DAEMON_ERROR` (0xFF000002) (class 0xFF, never used by the kernel), so an
  application never breaks because smcd is absent or broken. On a CPU that cannot run the
  channel the library does not even ask (:data:`FALLBACK_CHANNEL_UNSUPPORTED`, 0xFF000003); a
  socket the application detaches before any data moved (``ssl`` does) continues on TCP
  (:data:`FALLBACK_DETACHED`, 0xFF000004); one the application closes before the daemon
  answered its handoff is given up (:data:`FALLBACK_CLOSED_UNANSWERED`, 0xFF000006).
- A CHANNEL reply commits both ends: the TCP stream has carried CLC, so there is no way back
  to TCP; descriptors the library cannot use make the socket fail with ECONNRESET.
- The daemon hands a stream back (FALLBACK) only before the first CLC byte — every refusal for a
  limit is made there: MAX_DMB past a per-user quota, :data:`FALLBACK_DAEMON_BUSY`
  (0xFF000005) when the daemon is at its handshake capacity, past the user's fair share of it,
  or running late — or after a Decline both ends processed (``after_decline``). Once CLC has
  begun, a handshake that ends where the kernel fails the connection (a CLC timeout: ETIMEDOUT;
  a protocol violation: EPROTO; the peer's EOF: ECONNRESET) is aborted: the daemon resets the TCP
  connection and replies FALLBACK without ``after_decline``, which the library reports as an
  error. A same-host client half proposes only once the server half is in the daemon.
"""

from __future__ import annotations

import array
import contextlib
import functools
import os
import socket
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from smc_handoff.message_defs import (
    FALLBACK_CHANNEL_UNSUPPORTED,
    FALLBACK_CLOSED_UNANSWERED,
    FALLBACK_DAEMON_BUSY,
    FALLBACK_DAEMON_ERROR,
    FALLBACK_DAEMON_UNAVAILABLE,
    FALLBACK_DETACHED,
    FD_NAMES,
    HANDOFF_TIMEOUT,
    HEADER,
    MAGIC,
    MAX_FDS,
    MAX_MESSAGE,
    MAX_TEXT,
    MESSAGE_CLASSES,
    SYSTEM_HANDOFF_SOCKET,
    VERSION,
    Accept,
    BodyReader,
    Channel,
    Close,
    Connect,
    Error,
    ErrorCode,
    Fallback,
    HandoffClosedError,
    HandoffError,
    HandoffProtocolError,
    HandoffVersionError,
    Listen,
    Message,
    MessageType,
    Mode,
    Ok,
    Reply,
    Request,
    Resume,
    Role,
    Shutdown,
    daemon_error,
    daemon_unavailable,
    valid_dmb_size,
)

__all__ = [
    "FALLBACK_CHANNEL_UNSUPPORTED",
    "FALLBACK_CLOSED_UNANSWERED",
    "FALLBACK_DAEMON_BUSY",
    "FALLBACK_DAEMON_ERROR",
    "FALLBACK_DAEMON_UNAVAILABLE",
    "FALLBACK_DETACHED",
    "FD_NAMES",
    "HANDOFF_TIMEOUT",
    "HEADER",
    "MAGIC",
    "MAX_FDS",
    "MAX_MESSAGE",
    "MAX_TEXT",
    "SYSTEM_HANDOFF_SOCKET",
    "VERSION",
    "Accept",
    "Channel",
    "Close",
    "Connect",
    "Error",
    "ErrorCode",
    "Fallback",
    "HandoffClosedError",
    "HandoffError",
    "HandoffProtocolError",
    "HandoffVersionError",
    "Listen",
    "Message",
    "MessageType",
    "Mode",
    "Ok",
    "Reply",
    "Request",
    "Resume",
    "Role",
    "Shutdown",
    "close_fds",
    "daemon_error",
    "daemon_unavailable",
    "decode",
    "decode_reply",
    "decode_request",
    "encode",
    "handoff_socket_candidates",
    "handoff_timeout",
    "recv_message",
    "send_message",
    "valid_dmb_size",
]

# --- codec ------------------------------------------------------------------------------------

_CLASSES: dict[MessageType, type[Message]] = {cls.TYPE: cls for cls in MESSAGE_CLASSES}

_CLASSES_BY_VALUE: dict[int, type[Message]] = {int(t): c for t, c in _CLASSES.items()}
# Per class, what every message sent or received needs: its type's name (an enum ``.name`` is a
# Python-level descriptor) and its exact descriptor count.
_NAMES: dict[type[Message], str] = {c: t.name for t, c in _CLASSES.items()}
_FD_COUNTS: dict[type[Message], int] = {c: len(FD_NAMES[t]) for t, c in _CLASSES.items()}


def _field_error(what: str, e: ValueError) -> HandoffProtocolError:
    return HandoffProtocolError(f"{what}: {e}")


def encode(msg: Message, *, version: int = VERSION) -> bytes:
    """The datagram for ``msg`` (header + body)."""
    body = msg.body()
    data = HEADER.pack(MAGIC, version, msg.TYPE, 0, len(body)) + body
    if len(data) > MAX_MESSAGE:
        raise ValueError(f"{msg.TYPE.name} encodes to {len(data)} bytes (> {MAX_MESSAGE})")
    return data


def decode(data: bytes) -> Message:
    """Parse one datagram strictly; any defect raises :class:`HandoffProtocolError`."""
    if len(data) > MAX_MESSAGE:
        raise HandoffProtocolError(
            f"message of {len(data)} bytes (limit {MAX_MESSAGE})", ErrorCode.OVERSIZED
        )
    if len(data) < HEADER.size:
        raise HandoffProtocolError(f"message of {len(data)} bytes is shorter than the header")
    magic, version, mtype, flags, length = HEADER.unpack_from(data)
    if magic != MAGIC:
        raise HandoffProtocolError(f"bad magic {magic!r} (expected {MAGIC!r})")
    if version != VERSION:
        raise HandoffVersionError(version)
    cls = _CLASSES_BY_VALUE.get(mtype)
    if cls is None:
        raise HandoffProtocolError(
            f"unknown message type 0x{mtype:02x}", ErrorCode.UNSUPPORTED_TYPE
        )
    what = _NAMES[cls]
    if flags:
        raise HandoffProtocolError(f"{what}: reserved header flags 0x{flags:04x} must be 0")
    if length != len(data) - HEADER.size:
        raise HandoffProtocolError(
            f"{what}: header says {length} body bytes, datagram has {len(data) - HEADER.size}"
        )
    r = BodyReader(bytes(data[HEADER.size :]), what)
    try:
        msg = cls.parse(r)
    except ValueError as e:  # a field out of range, reported by the dataclass checks
        raise _field_error(what, e) from None
    r.end()
    return msg


def decode_request(data: bytes) -> Request:
    """:func:`decode`, refusing replies (what the daemon reads)."""
    msg = decode(data)
    if not msg.TYPE.is_request:
        raise HandoffProtocolError(f"{msg.TYPE.name} is a reply, not a request")
    return msg  # type: ignore[return-value]


def decode_reply(data: bytes) -> Reply:
    """:func:`decode`, refusing requests (what the client reads)."""
    msg = decode(data)
    if msg.TYPE.is_request:
        raise HandoffProtocolError(f"{msg.TYPE.name} is a request, not a reply")
    return msg  # type: ignore[return-value]


# --- socket helpers ---------------------------------------------------------------------------


def close_fds(fds: Iterable[int]) -> None:
    """Close every descriptor, ignoring ones already gone (used on every error path)."""
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def send_message(sock: socket.socket, msg: Message, fds: Sequence[int] = ()) -> None:
    """Send ``msg`` with exactly the descriptors its type carries (they stay the caller's)."""
    expected = _FD_COUNTS.get(type(msg))
    if expected is None:  # a subclass of a message class
        expected = len(FD_NAMES[msg.TYPE])
    if len(fds) != expected:
        raise ValueError(f"{msg.TYPE.name} carries {expected} descriptors, got {len(fds)}")
    data = encode(msg)
    ancillary = (
        [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())] if fds else []
    )
    sent = sock.sendmsg([data], ancillary)
    if sent != len(data):  # cannot happen on SEQPACKET; guard the invariant anyway
        raise HandoffProtocolError(f"short send of {msg.TYPE.name}: {sent}/{len(data)} bytes")


_INT_SIZE = array.array("i").itemsize
_ANCILLARY = socket.CMSG_SPACE(MAX_FDS * _INT_SIZE)
# Plain ints: the socket module's MSG_* are IntFlag members, and enum arithmetic on the flags
# of every received message would cost microseconds.
_MSG_CTRUNC = int(socket.MSG_CTRUNC)
_MSG_TRUNC = int(socket.MSG_TRUNC)
_MSG_CMSG_CLOEXEC = int(socket.MSG_CMSG_CLOEXEC)


def _fds_from(ancillary: list[tuple[int, int, bytes]]) -> tuple[list[int], bool]:
    """Every descriptor in the ancillary data, and whether something else/partial came too."""
    fds: list[int] = []
    odd = False
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            whole = len(payload) - len(payload) % _INT_SIZE
            fds.extend(array.array("i", payload[:whole]))
            odd = odd or whole != len(payload)
        else:
            odd = True
    return fds, odd


def recv_message(sock: socket.socket, *, requests: bool) -> tuple[Message, list[int]]:
    """Receive one message and its descriptors (now owned by the caller).

    ``requests`` chooses the direction accepted (True on the daemon). On any defect every
    received descriptor is closed before :class:`HandoffProtocolError` is raised; EOF raises
    :class:`HandoffClosedError`. Socket errors (timeouts included) propagate unchanged.
    """
    data, ancillary, flags, _ = sock.recvmsg(MAX_MESSAGE + 1, _ANCILLARY, _MSG_CMSG_CLOEXEC)
    fds, odd = _fds_from(ancillary)
    try:
        if not data and not ancillary:
            raise HandoffClosedError("the handoff connection was closed")
        if flags & _MSG_CTRUNC or odd:
            raise HandoffProtocolError(
                f"more than {MAX_FDS} descriptors or unexpected ancillary data", ErrorCode.BAD_FDS
            )
        if flags & _MSG_TRUNC or len(data) > MAX_MESSAGE:
            raise HandoffProtocolError(
                f"message longer than {MAX_MESSAGE} bytes", ErrorCode.OVERSIZED
            )
        msg = decode_request(data) if requests else decode_reply(data)
        expected = _FD_COUNTS[type(msg)]
        if len(fds) != expected:
            raise HandoffProtocolError(
                f"{msg.TYPE.name} carries {expected} descriptors, got {len(fds)}",
                ErrorCode.BAD_FDS,
            )
    except BaseException:
        close_fds(fds)
        raise
    return msg, fds


# --- where the daemon listens -----------------------------------------------------------------


def handoff_socket_candidates(env: Mapping[str, str] | None = None) -> list[Path]:
    """Paths to try, in order (see the module docstring). Every handoff asks, so the answer is
    remembered per (environment values, uid)."""
    env = os.environ if env is None else env
    override = env.get("SMCD_HANDOFF_SOCKET", "")
    if override:  # the rest is not looked up (a missing variable costs a KeyError inside get)
        return list(_candidates(override, "", 0))
    return list(_candidates("", env.get("XDG_RUNTIME_DIR", ""), os.getuid()))


@functools.lru_cache(maxsize=16)
def _candidates(override: str, xdg: str, uid: int) -> tuple[Path, ...]:
    if override:
        return (Path(override),)
    if xdg.startswith("/"):
        user = Path(xdg) / "smcd" / "handoff.sock"
    else:
        import tempfile  # (here: ~2 ms of every smc-run program's start-up otherwise)

        user = Path(tempfile.gettempdir()) / f"smcd-{uid}" / "handoff.sock"
    return (user,) if user == SYSTEM_HANDOFF_SOCKET else (user, SYSTEM_HANDOFF_SOCKET)


def handoff_timeout(env: Mapping[str, str] | None = None) -> float:
    """:data:`HANDOFF_TIMEOUT`, or ``$SMCD_HANDOFF_TIMEOUT`` when it is a positive number."""
    env = os.environ if env is None else env
    raw = env.get("SMCD_HANDOFF_TIMEOUT", "")
    if not raw:
        return HANDOFF_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        return HANDOFF_TIMEOUT
    return value if 0 < value < 3600 else HANDOFF_TIMEOUT
