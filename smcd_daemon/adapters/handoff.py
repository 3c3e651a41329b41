"""The handoff server: where applications hand their TCP sockets to smcd and get an SMC-D channel
(or their unchanged TCP socket and a reason) back.

The protocol itself — framing, messages, descriptor lists, rules for both ends — is defined once,
in :mod:`smc_handoff.messages`; this module is the daemon's end of it.

The socket
    ``AF_UNIX`` ``SOCK_SEQPACKET``, inherited from systemd (``smcd.socket``) or bound here with
    mode 0666: every local application may hand off; callers are told apart by ``SO_PEERCRED``
    (read on every connection; the uid decides the quotas and is recorded with each connection),
    not by file permissions. Datagrams are read whole with ``recvmsg`` into a bounded buffer
    (:data:`~smc_handoff.messages.MAX_MESSAGE` + 1 bytes, room for
    :data:`~smc_handoff.messages.MAX_FDS` descriptors, close-on-exec). An invalid datagram is
    answered with ERROR, logged, its descriptors closed, and that connection closed; nothing a
    client sends can end the server or disturb another connection.

One SEQPACKET connection per SMC connection
    It stays open as long as what it registered: the daemon learns about SHUTDOWN/CLOSE notices
    through it, and a hang-up (the application closed it, or died) releases that half's
    resources. Listeners (LISTEN) live exactly as long as their connection.

CONNECT (client half)
    SMC is tried only toward peers known to speak it: a listener registered here whose address
    is the TCP peer's (a wildcard listener matches any local address of this network namespace),
    or an address in the configuration's ``peers``. Otherwise FALLBACK PEERNOSMC before a byte
    is written. Then the client half is entered in the loopback device's pairing table under its
    TCP 4-tuple and the CLC handshake runs over the borrowed descriptor (:mod:`.clc_io`).
ACCEPT (server half)
    The client's first bytes are peeked, never consumed, for a CLC eyecatcher, for at most
    ``timeouts.proposal_wait``: other bytes, silence (a client that waits for the server to speak)
    or EOF hand the socket back untouched with FALLBACK PEERNOSMC. A Proposal runs the server
    negotiation, which accepts loopback-ism only when the pairing table holds this connection's
    client half (matched 4-tuple, claimed once): never by GID alone.
CHANNEL
    Both halves of one TCP connection meet in a *pair* keyed by the 4-tuple (and checked by the
    two DMB tokens each half negotiated). The pair owns the two eventfds and the peer-link
    socketpair; each half is sent its receive DMB, the peer's DMB, its eventfd, the peer's and its
    end of the peer link. The DMB memfds handed out are the pool's own (each sized DMB + the
    channel's 128-byte control trailer), so reuse, zeroing and quotas apply to exactly what the
    applications map. The daemon closes every copy of the borrowed TCP descriptor before
    replying, and its copies of the eventfds and peer-link ends once both halves have theirs: it
    keeps only the DMB memfds (in the pool) and one read-only view of each DMB's first page
    (mapped without a descriptor of its own) to show cursors and bytes.
FALLBACK
    With the negotiator's reason (kernel codes; PEERDECL plus the peer's diagnosis when the peer
    declined). Past a quota: SMC_CLC_DECL_MAX_DMB. Fallen-back connections stay visible in the
    registry for :data:`FALLBACK_LINGER` seconds (the daemon gave back its copy of the socket, so
    it cannot see when the application closes it).
Release
    A half lets go of its DMB (unregister) and of its reference on the peer's (detach) when its
    connection hangs up; the pool takes a buffer back (and zeroes it) only when both halves have
    let go. When the last SMC connection is gone the daemon logs the pool's state.
Hot path
    A handoff costs the daemon a few event-loop turns; what is not needed for the reply stays off
    it: registry records are published only for connections that live :data:`PUBLISH_DELAY`
    (short request/response connections are counted, never exported on D-Bus); the registry and
    link-group bookkeeping, notices and a hung-up half's release are deferred by
    :data:`DEFER_DELAY` (in order, in batches), so the next handshake goes first, and run as soon
    as no handshake is in flight (the gap while applications map their channels); DMBs are zeroed
    on release rather than on reuse and their header views are mapped on first read and kept
    for the memfd's life in the pool; a connection past its first request is watched by a
    reader callback (:mod:`.fdwatch`), not a task; negotiation
    facts, our Proposal (and its bytes), CLC headers and peers' Proposals are parsed or built
    once; addresses are normalised once (cached); per-user counts are kept rather than counted,
    and idle connections cost the cursor refresh only a comparison of header words.
SMC-R
    Tried only when the daemon hands this server an SMC-R provider (it has one only with
    ``modes.smcr_v1``/``smcr_v2`` on and an ACTIVE RDMA port), with a peer in the
    configuration's ``peers`` that is not reached through loopback (not an address of this
    host, unless policy routing sends traffic to it out of a real netdev) — on both halves.
    Everything else takes the SMC-D path unchanged. The service (:mod:`.smcr_service`) runs
    the whole handshake and adds its own registry record; the application gets a channel of
    mode SMCR whose peer is the daemon itself. The handoff connection stays open (so the
    library does not take a hang-up for a daemon restart) but holds nothing: SHUTDOWN/CLOSE
    notices are ignored, the daemon sees closes on the peer link it keeps. An error raised by
    the service is logged and answered with FALLBACK SMC_CLC_DECL_INTERR; it never ends the
    server.
RESUME
    After a daemon restart the library re-registers a live channel: the daemon records it again
    (addresses from the TCP socket, byte counts from the library; it holds no copy of the DMBs,
    so no cursors) in the link group of its loopback-ism device, so ``smcctl`` shows it until
    the hang-up; the channel itself never depended on the daemon.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import functools
import ipaddress
import logging
import mmap
import os
import socket
import stat
import struct
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from smc_handoff import messages as m
from smc_handoff.messages import ErrorCode
from smcd_daemon.adapters.clc_io import BorrowedTcp, BorrowedTcpError, drive, peek_proposal
from smcd_daemon.adapters.fdwatch import fd_watch
from smcd_daemon.core.buffers import DmbPool, UnknownTokenError
from smcd_daemon.core.eid import EidTable
from smcd_daemon.core.registry import (
    Connection,
    ConnMode,
    ConnRole,
    ConnState,
    LgrRole,
    LinkGroup,
    Registry,
    RegistryError,
    SmcType,
)
from smcd_daemon.errors import SmcError
from smcd_daemon.protocol.negotiate import (
    ClientNegotiation,
    FallbackOutcome,
    NegotiationFacts,
    ServerNegotiation,
    SmcdLoopbackOutcome,
)
from smcd_daemon.transport.loopback import (
    Endpoint,
    LinkGroupTable,
    LoopbackIsm,
    PairingError,
    endpoint,
)
from smcd_daemon.wire.cdc import ConnStateFlag, SmcdCdcHeader
from smcd_daemon.wire.cursor import Cursor
from smcd_daemon.wire.reasons import DeclineReason, explain

if TYPE_CHECKING:
    from smcd_daemon.adapters.smcr_service import SmcrChannel, SmcrService

__all__ = [
    "FALLBACK_LINGER",
    "MAX_CLIENTS",
    "HandoffError",
    "HandoffServer",
    "HandoffStats",
    "PeerCred",
    "SmcrProvider",
    "bind_seqpacket",
    "peer_cred",
]

log = logging.getLogger(__name__)

MAX_CLIENTS = 16384
"""Handoff connections served at once (each SMC connection holds one per half); more are closed
right after accept (and counted). The daemon raises its descriptor limit to match."""
FALLBACK_LINGER = 30.0
"""Seconds a fallen-back connection stays in the registry (see the module docstring)."""
FALLBACK_KEEP = 256
"""At most this many fallen-back connections are kept visible (the oldest go first)."""
REFRESH_INTERVAL = 0.5
"""Cursor/byte refresh period while SMC connections exist (no timer runs otherwise)."""
LGR_FREE_DELAY = 10.0
"""A link group without connections is freed after this delay (the kernel waits 10 minutes;
loopback link groups cost nothing to recreate)."""
PUBLISH_DELAY = 0.05
"""New connections reach the registry (and D-Bus) once they have lived this long, in batches:
exporting a D-Bus object costs more than the whole handshake, so it stays off that path, and a
connection that is gone again before then (a short request/response connection) is only
counted, never exported."""


PUBLISH_MAX = 128
"""Records published per timer run; more wait :data:`PUBLISH_PACE` (a steady flow of D-Bus
signals instead of bursts of thousands when many connections open at once)."""
PUBLISH_PACE = 0.005
DEFER_DELAY = 0.002
"""Bookkeeping that no reply waits for — a channel's registry record and counters, notices,
a hung-up half's release — runs this much later, in batches: the handshakes that arrive
meanwhile (the next connection of a client that just closed one) go first. A handshake short of
DMB quota runs the pending releases at once (``LoopbackIsm.reclaim``), so limits see released
buffers exactly as before."""
DEFER_MAX = 256
"""Deferred calls that are run at once, whatever the delay (bounded memory under load)."""


SmcrProvider = Callable[[], "SmcrService | None"]
"""Gives the SMC-R service when SMC-R may be tried now (modes on, an ACTIVE RDMA port), else
None; the daemon builds the service on first use."""


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
    """Counters of the handoff socket, for logs and tests."""

    connections: int = 0
    refused_connections: int = 0
    requests: int = 0
    invalid: int = 0
    channels: int = 0
    fallbacks: int = 0
    listeners: int = 0
    resumes: int = 0
    fds_closed: int = 0
    errors: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


_UCRED = struct.Struct("3i")


def peer_cred(sock: socket.socket) -> PeerCred | None:
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    except OSError:
        return None
    pid, uid, gid = _UCRED.unpack(raw)
    return PeerCred(pid, uid, gid)


def bind_seqpacket(path: Path, *, mode: int = 0o666, backlog: int = 512) -> socket.socket:
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


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def _reason_name(code: int) -> str:
    """The FALLBACK ``name``: ``SMC_CLC_DECL_...`` or our local names, else the hex code."""
    if code == m.FALLBACK_DAEMON_UNAVAILABLE:
        return "DAEMON_UNAVAILABLE"
    if code == m.FALLBACK_DAEMON_ERROR:
        return "DAEMON_ERROR"
    return explain(code).name or f"CODE_{code:08X}"


def _clip(text: str, limit: int = m.MAX_TEXT) -> str:
    raw = text.replace("\x00", "?").encode("utf-8", "replace")[:limit]
    return raw.decode("utf-8", "ignore")


def fallback_message(code: int, detail: str, peer_diagnosis: int | None = None) -> m.Fallback:
    return m.Fallback(code, _reason_name(code), _clip(detail), peer_diagnosis)


LOCAL_ADDRESS_TTL = 2.0
"""Seconds an answer of :func:`_is_local_address` is reused (addresses come and go rarely; a
wildcard listener's clients would otherwise cost a socket and a bind each)."""
_local_addresses: dict[ipaddress.IPv4Address | ipaddress.IPv6Address, tuple[bool, float]] = {}


def _is_local_address(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """Is ``ip`` an address of this network namespace? (Binding to it succeeds only then.)"""
    if ip.is_loopback:
        return True
    now = time.monotonic()
    known = _local_addresses.get(ip)
    if known is not None and known[1] > now:
        return known[0]
    fam = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    with socket.socket(fam, socket.SOCK_DGRAM) as s:
        try:
            s.bind((str(ip), 0))
            local = True
        except OSError:
            local = False
    if len(_local_addresses) >= 1024:
        _local_addresses.clear()
    _local_addresses[ip] = (local, now + LOCAL_ADDRESS_TTL)
    return local


_NO_RDMA_DECLINES = (int(DeclineReason.NOSMCRDEV), int(DeclineReason.NOSMCDEV))
"""What the SMC-D server negotiation declines a Proposal with when it offered SMC-R."""


def _routed_out(
    service: SmcrService,
    local: ipaddress.IPv4Address | ipaddress.IPv6Address,
    peer: ipaddress.IPv4Address | ipaddress.IPv6Address,
) -> bool:
    """Does traffic from ``local`` to ``peer`` (an address of this host) leave through a real
    netdev? Normally not (the local table sends it through ``lo``: loopback-ism territory); only
    policy routing that sends it out on a wire (two simulated hosts in one namespace) does."""
    if not (isinstance(local, ipaddress.IPv4Address) and isinstance(peer, ipaddress.IPv4Address)):
        return False
    route = service.routing.lookup_route(local, peer)
    if route is None or route.oif is None:
        return False
    dev = service.routing.netdev(route.oif)
    return dev is not None and dev.name != "lo"


_IP_TEXTS: dict[int, tuple[object, str, bool]] = {}


def _ip_text(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> tuple[str, bool]:
    """``(str(ip), ip.is_loopback)``, remembered per address object (endpoints share them)."""
    known = _IP_TEXTS.get(id(ip))
    if known is not None and known[0] is ip:
        return known[1], known[2]
    if len(_IP_TEXTS) >= 4096:
        _IP_TEXTS.clear()
    text, lo = str(ip), ip.is_loopback
    _IP_TEXTS[id(ip)] = (ip, text, lo)
    return text, lo


# -- DMB views --------------------------------------------------------------------------------


class _Libc:
    """``mmap(2)``/``munmap(2)`` through ctypes: Python's :class:`mmap.mmap` keeps a duplicate of
    the descriptor for as long as the mapping lives, which would double the daemon's descriptors
    (one more per DMB on top of the pool's memfd)."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self.mmap = libc.mmap
        self.mmap.argtypes = (
            ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
            ctypes.c_long,
        )  # fmt: skip
        self.mmap.restype = ctypes.c_void_p
        self.munmap = libc.munmap
        self.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
        self.munmap.restype = ctypes.c_int


_libc: _Libc | None = None
_MAP_FAILED = ctypes.c_void_p(-1).value


class _DmbView:
    """A read-only mapping of a DMB's first page, to read its CDC header without tearing: each
    cursor is one aligned 8-byte word, loaded with one 8-byte load (see ``smc_handoff._ring``;
    ctypes reads a ``c_uint64`` with one fixed-size ``memcpy`` as the memoryview does). The
    mapping holds no descriptor of its own."""

    def __init__(self, fd: int) -> None:
        global _libc
        if _libc is None:
            _libc = _Libc()
        addr = _libc.mmap(None, mmap.PAGESIZE, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr is None or addr == _MAP_FAILED:
            err = ctypes.get_errno()
            raise OSError(err, f"mapping a DMB header: {os.strerror(err)}")
        self._addr: int | None = addr
        self._words = (ctypes.c_uint64 * 4).from_address(addr)

    def words(self) -> tuple[int, ...]:
        """The header's four words, each loaded whole (cheap to compare with the last read)."""
        if self._addr is None:
            raise ValueError("the DMB view is closed")
        w = self._words
        return (w[0], w[1], w[2], w[3])

    @staticmethod
    def header(words: tuple[int, ...]) -> _Cdc | None:
        """The header's fields (``SmcdCdcHeader`` layout) as plain ints, None before the peer's
        first CDC write: one ``struct`` call, no objects (it runs on every close)."""
        raw = _WORDS.pack(*words)
        if raw[0] != 0xFE:
            return None  # nothing written yet
        return _Cdc(*_CDC.unpack(raw))

    def close(self) -> None:
        if self._addr is not None and _libc is not None:
            addr, self._addr = self._addr, None
            _libc.munmap(addr, mmap.PAGESIZE)


_WORDS = struct.Struct("=4Q")
_CDC = struct.Struct("=B7xHI2xHIBB8x")
"""``struct smcd_cdc_msg`` in host order (see :class:`SmcdCdcHeader`): type, prod wrap/count,
cons wrap/count, prod flags, conn state flags."""
assert _CDC.size == SmcdCdcHeader.SIZE
_ABORT = int(ConnStateFlag.PEER_CONN_ABORT)
_CLOSING = int(ConnStateFlag.PEER_CONN_CLOSED | ConnStateFlag.PEER_DONE_WRITING)


class _Cdc(NamedTuple):
    type: int
    prod_wrap: int
    prod_count: int
    cons_wrap: int
    cons_count: int
    prod_flags: int
    conn_state_flags: int


def _advance(ring: int, old: tuple[int, int], new_wrap: int, new_count: int) -> int:
    """Bytes from cursor ``old`` (wrap, count) to the new one in a ring of ``ring`` bytes, any
    number of wraps apart (the refresh runs often enough that the 16-bit wrap counter cannot
    lap)."""
    delta = ((new_wrap - old[0]) & 0xFFFF) * ring + new_count - old[1]
    return delta if 0 <= delta < 0x8000 * ring else 0


# -- connection state -------------------------------------------------------------------------


@dataclass(eq=False)
class _Pair:
    """What the two halves of one SMC-D connection share: the eventfds and the peer link."""

    key: tuple[Endpoint, Endpoint]  # (client local, client peer)
    tokens: tuple[int, int]  # (client DMB token, server DMB token)
    ev: dict[ConnRole, int]  # the eventfd each half sleeps on
    link: dict[ConnRole, int]  # each half's end of the peer link
    mem: dict[int, int]  # DMB token → the pool's memfd (DMB + control trailer) handed out
    taken: set[ConnRole] = field(default_factory=set)
    released: set[ConnRole] = field(default_factory=set)
    pending: list[tuple[str, int]] = field(default_factory=list)
    """DMB releases ("unregister"/"detach", token) of halves that let go before the pair was
    complete: a client may close before the server half has even attached its DMB."""
    timer: asyncio.TimerHandle | None = None

    def close_shared(self) -> None:
        """Close the daemon's copies of the eventfds and any peer-link end not handed out."""
        for fd in [*self.ev.values(), *self.link.values()]:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.ev.clear()
        self.link.clear()

    def close_all(self) -> None:
        """Close everything the pair owns (the memfds, and the views of their headers, belong
        to the pool and the server)."""
        self.close_shared()


@dataclass(eq=False)
class _Half:
    """One application's half of an SMC-D connection, as the daemon tracks it."""

    conn_id: int
    role: ConnRole
    uid: int
    local_token: int | None
    peer_token: int | None
    rx_size: int
    tx_size: int
    pair: _Pair | None = None
    rx_cons: tuple[int, int] = (0, 0)  # (wrap, count) last seen
    tx_prod: tuple[int, int] = (0, 0)
    seen: tuple[tuple[int, ...], tuple[int, ...]] | None = None  # header words last refreshed
    closed: bool = False


@dataclass(eq=False)
class _Listener:
    ident: int
    ip: ipaddress.IPv4Address | ipaddress.IPv6Address
    port: int
    uid: int
    conn_id: int


@dataclass(eq=False)
class _Client:
    sock: socket.socket
    cred: PeerCred | None
    uid: int = 65534
    task: asyncio.Task[None] | None = None
    half: _Half | None = None
    listener: _Listener | None = None
    smcr_conn: int | None = None  # an SMC-R connection's id (the service tracks the rest)
    watched_done: bool = False  # released and closed (see ``HandoffServer._end_client``)

    def __post_init__(self) -> None:
        if self.cred is not None:
            self.uid = self.cred.uid

    @property
    def label(self) -> str:
        """Who this is, for log messages (built only when a message is logged)."""
        return str(self.cred) if self.cred is not None else "unknown peer"


_Draft = dict[str, Any]
"""Keyword arguments of a :class:`Connection` known before the handshake's outcome."""
_ZERO = Cursor()
_ZERO_CURSORS = {"rx_prod": _ZERO, "rx_cons": _ZERO, "tx_prod": _ZERO, "tx_cons": _ZERO}
"""Cursors of a new record (one shared frozen zero cursor instead of four new ones)."""


class _Refused(Exception):
    """End this client's connection after replying ``reply``."""

    def __init__(self, reply: m.Error) -> None:
        super().__init__(reply.message)
        self.reply = reply


# -- the server -------------------------------------------------------------------------------


class HandoffServer:
    """Serves the handoff socket on the running loop (see the module docstring).

    ``sock`` is a listening SOCK_SEQPACKET socket; ``owns_path`` says whether we bound it (then
    :meth:`stop` removes the file) or inherited it from systemd (then the socket unit owns the
    file and it stays). ``config`` is a :class:`smcd_daemon.config.Config` (defaults when None);
    :meth:`configure` applies a reloaded one to new connections. ``loopback_gid`` is the 128-bit
    GID of the loopback-ism device the inventory shows (random when None). ``smcr`` provides
    the SMC-R service when SMC-R may be tried (None: never; see the module docstring).
    """

    def __init__(
        self,
        sock: socket.socket,
        *,
        owns_path: bool,
        config: Any = None,
        registry: Registry | None = None,
        eids: EidTable | None = None,
        loopback_gid: int | None = None,
        smcr: SmcrProvider | None = None,
    ) -> None:
        if config is None:
            from smcd_daemon.config import Config

            config = Config.model_validate({})
        self._sock = sock
        self.owns_path = owns_path
        name = sock.getsockname()
        self.path = Path(os.fsdecode(name)) if name else None
        self._inode = 0
        if owns_path and self.path is not None:
            with contextlib.suppress(OSError):
                self._inode = os.lstat(self.path).st_ino
        self.stats = HandoffStats()
        self.cfg = config
        self._facts_cache: dict[tuple[int, bool], NegotiationFacts] = {}
        self.registry = registry if registry is not None else Registry()
        self.eids = eids if eids is not None else EidTable()
        self.pool = DmbPool.from_config(config)
        # The daemon's read-only views of DMB headers, one per pool memfd for as long as the
        # pool keeps it: a memfd serves many connections, and mapping (and unmapping, with its
        # TLB shootdown) per connection was a measurable part of every handoff.
        self._views: dict[int, _DmbView] = {}
        self.pool.on_destroy = self._forget_view
        self.loopback = LoopbackIsm(
            self.pool,
            gid128=loopback_gid,
            link_groups=LinkGroupTable(id_source=self.registry.allocate_lgr_id),
        )
        self.hostname = socket.gethostname()
        self.smcr = smcr
        self._clients: set[_Client] = set()
        self._held: dict[int, int] = {}  # uid → handoff connections it holds (quota checks)
        self._pairs: dict[tuple[Endpoint, Endpoint], _Pair] = {}
        self._halves: dict[int, _Half] = {}
        self._listeners: dict[int, _Listener] = {}
        self._next_listener = 1
        self._fallbacks: OrderedDict[int, float] = OrderedDict()
        self._lgr_timers: dict[int, asyncio.TimerHandle] = {}
        self._inflight = 0
        self._unpublished: dict[int, Connection] = {}
        self._due: dict[int, float] = {}  # conn_id → when it is published (insertion = due order)
        self._publish_timer: asyncio.TimerHandle | None = None
        self._later: list[tuple[Callable[..., None], tuple[Any, ...]]] = []
        self._later_timer: asyncio.TimerHandle | None = None
        self.loopback.reclaim = self._run_later  # a DMB short of quota: run the releases first
        self._refresher: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped = False

    @classmethod
    def bind(cls, path: Path, **kw: Any) -> HandoffServer:
        return cls(bind_seqpacket(path), owns_path=True, **kw)

    def configure(self, config: Any) -> None:
        """A reloaded configuration: quotas, timeouts, modes and peers apply to new handshakes."""
        self.cfg = config
        self._facts_cache.clear()
        self.pool.user_max_bytes = config.quota.buffer_bytes
        self.pool.user_max_buffers = config.quota.connections
        self.pool.pool_max_bytes = config.buffers.pool_max_bytes
        self.pool.pool_max_buffers = config.buffers.pool_max_buffers

    # -- life cycle -----------------------------------------------------------------------------

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
        if self._refresher is not None:
            self._refresher.cancel()
        for client in list(self._clients):
            if client.task is not None:
                client.task.cancel()
        for client in list(self._clients):
            if client.task is not None:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await client.task
        for client in list(self._clients):  # those watched past their first request
            with contextlib.suppress(Exception):
                self._end_client(client)
        self._run_later()
        for pair in list(self._pairs.values()):
            pair.close_all()
        self._pairs.clear()
        for timer in self._lgr_timers.values():
            timer.cancel()
        if self._publish_timer is not None:
            self._publish_timer.cancel()
        self.pool.close()
        if self.owns_path and self.path is not None:
            # Only our own file: a daemon started meanwhile may have replaced a path it found
            # stale (e.g. after we were stopped and it started before we finished).
            with contextlib.suppress(OSError):
                if os.lstat(self.path).st_ino == self._inode:
                    os.unlink(self.path)
        self._sock.close()

    # -- accepting --------------------------------------------------------------------------------

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
        client = _Client(conn, cred)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("handoff: connection from %s", client.label)
        self._clients.add(client)
        self._held[client.uid] = self._held.get(client.uid, 0) + 1
        assert self._loop is not None
        client.task = self._loop.create_task(self._client_loop(client), name="smcd-handoff")

    # -- one client ---------------------------------------------------------------------------

    async def _readable(self, sock: socket.socket) -> None:
        assert self._loop is not None
        fut: asyncio.Future[None] = self._loop.create_future()
        watch = fd_watch(self._loop)
        watch.add(sock.fileno(), functools.partial(_wake, fut))
        try:
            await fut
        finally:
            watch.remove(sock.fileno())

    async def _receive(self, client: _Client) -> tuple[m.Request, list[int]] | None:
        """The next valid request and its descriptors; None at EOF. An invalid datagram raises
        :class:`_Refused` (its descriptors are already closed)."""
        while True:
            try:
                msg, fds = m.recv_message(client.sock, requests=True)
            except (BlockingIOError, InterruptedError):
                await self._readable(client.sock)
                continue
            except m.HandoffClosedError:
                return None
            except m.HandoffProtocolError as e:
                self.stats.invalid += 1
                log.warning("handoff: invalid request from %s: %s", client.label, e)
                raise _Refused(m.Error(e.code, _clip(str(e)))) from None
            except OSError as e:
                log.info("handoff: %s: connection failed: %s", client.label, e)
                return None
            self.stats.requests += 1
            return msg, fds  # type: ignore[return-value]

    def _send(self, client: _Client, reply: m.Reply, fds: list[int] | tuple[int, ...] = ()) -> bool:
        try:
            m.send_message(client.sock, reply, list(fds))
        except (BlockingIOError, InterruptedError):
            self.stats.errors += 1
            log.warning("handoff: %s does not read its replies; closing", client.label)
            return False
        except OSError as e:
            log.info("handoff: %s went away before the reply: %s", client.label, e)
            return False
        return True

    async def _client_loop(self, client: _Client) -> None:
        """The first request, to its reply. A connection that then holds something (a channel
        half, a listener, a resumed record) is watched by :meth:`_on_readable` from there on:
        notices and the hang-up need no task of their own."""
        watched = False
        try:
            first = await self._receive(client)
            if first is None:
                return
            msg, fds = first
            if isinstance(msg, m.Connect | m.Accept):
                keep = await self._handoff(client, msg, fds[0])
            elif isinstance(msg, m.Listen):
                keep = self._listen(client, fds[0])
            elif isinstance(msg, m.Resume):
                keep = self._resume(client, msg, fds)
            else:
                raise _Refused(
                    m.Error(ErrorCode.BAD_STATE, f"{msg.TYPE.name} cannot open a connection")
                )
            if keep:
                assert self._loop is not None
                client.task = None
                # Level-triggered: a notice already queued wakes it on the next loop turn.
                fd_watch(self._loop).add(
                    client.sock.fileno(), functools.partial(self._on_readable, client)
                )
                watched = True
        except _Refused as e:
            self._send(client, e.reply)
        except asyncio.CancelledError:
            raise
        except Exception:
            self.stats.errors += 1
            log.exception("handoff: unexpected error serving %s; connection closed", client.label)
        finally:
            if not watched:
                self._end_client(client)

    def _on_readable(self, client: _Client) -> None:
        """A connection past its first request: SHUTDOWN/CLOSE notices, then the hang-up."""
        if client.watched_done:
            return
        try:
            while True:
                try:
                    msg, fds = m.recv_message(client.sock, requests=True)
                except (BlockingIOError, InterruptedError):
                    return
                except m.HandoffClosedError:
                    break
                except m.HandoffProtocolError as e:
                    self.stats.invalid += 1
                    log.warning("handoff: invalid request from %s: %s", client.label, e)
                    self._send(client, m.Error(e.code, _clip(str(e))))
                    break
                except OSError as e:
                    log.info("handoff: %s: connection failed: %s", client.label, e)
                    break
                self.stats.requests += 1
                if fds:
                    m.close_fds(fds)
                if isinstance(msg, m.Shutdown | m.Close):
                    if client.half is not None:
                        self._defer(self._notice, client.half, msg)
                        continue
                    if client.smcr_conn is not None:
                        continue  # SMC-R: the daemon sees the close on the peer link it holds
                self._send(
                    client, m.Error(ErrorCode.BAD_STATE, f"{msg.TYPE.name} is not allowed now")
                )
                break
        except Exception:
            self.stats.errors += 1
            log.exception("handoff: unexpected error serving %s; connection closed", client.label)
        self._end_client(client)

    def _end_client(self, client: _Client) -> None:
        """The connection is over: release what it held and close it (exactly once)."""
        if client.watched_done:
            return
        client.watched_done = True
        if client.task is None and self._loop is not None:
            with contextlib.suppress(Exception):
                fd_watch(self._loop).remove(client.sock.fileno())
        self._clients.discard(client)
        left = self._held.get(client.uid, 1) - 1
        if left > 0:
            self._held[client.uid] = left
        else:
            self._held.pop(client.uid, None)
        try:
            self._hang_up(client)
        finally:
            client.sock.close()

    # -- CONNECT / ACCEPT ---------------------------------------------------------------------

    def _facts(self, dmb_hint: int, *, peer_speaks_smc: bool = True) -> NegotiationFacts:
        """What we offer for this handshake. Facts only change with the configuration (the EID
        table is shared by reference), so they are built once per (hint, peer) and reused."""
        key = (dmb_hint, peer_speaks_smc)
        facts = self._facts_cache.get(key)
        if facts is not None:
            return facts
        cfg = self.cfg
        facts = NegotiationFacts.from_config(
            cfg,
            self.eids,
            self.loopback.ism_device() if cfg.modes.smcd_loopback else None,
            hostname=self.hostname,
            peer_speaks_smc=peer_speaks_smc,
        )
        if dmb_hint:
            size = min(max(dmb_hint, cfg.buffers.min_dmb_size), cfg.buffers.max_dmb_size)
            facts = dataclasses.replace(facts, dmb_size=size)
        if len(self._facts_cache) >= 64:
            self._facts_cache.clear()  # hints are the applications' choice: stay bounded
        self._facts_cache[key] = facts
        return facts

    def _peer_speaks_smc(self, peer: Endpoint) -> str | None:
        """Why we may try SMC toward ``peer`` (None: we may not)."""
        ip, port, _ = peer
        for lst in self._listeners.values():
            if lst.port != port:
                continue
            if lst.ip == ip:
                return f"registered listener {lst.ident}"
            if lst.ip.is_unspecified and _is_local_address(ip):
                return f"registered listener {lst.ident} (wildcard)"
        for net in self.cfg.peers:
            if ip.version == net.version and ip in net:
                return f"configured peer network {net}"
        return None

    def _session_limit(self, uid: int) -> int:
        """Handoff connections a uid may hold (0 = no limit): two per allowed DMB (both halves of
        a same-user connection) plus a few listeners and handshakes in flight."""
        quota = self.cfg.quota.connections
        return 2 * quota + 64 if quota else 0

    def _new_connection(self, client: _Client, role: ConnRole, tcp: BorrowedTcp) -> _Draft:
        """The fields of a handoff's registry record known up front; the record itself is
        built once, when the outcome is known (one object, one event)."""
        local, peer = endpoint(tcp.local), endpoint(tcp.peer)
        cred = client.cred
        peer_text, peer_lo = _ip_text(peer[0])
        return {
            "conn_id": self.registry.allocate_conn_id(),
            "role": role,
            "local_addr": _ip_text(local[0])[0],
            "local_port": local[1],
            "peer_addr": peer_text,
            "peer_port": peer[1],
            "netdev": "lo" if peer_lo else "",
            "uid": cred.uid if cred else 0,
            "pid": cred.pid if cred else 0,
            "inode": tcp.inode,
            **_ZERO_CURSORS,
        }

    async def _handoff(self, client: _Client, req: m.Connect | m.Accept, fd: int) -> bool:
        """Run one handoff to its reply; True if the connection now holds a channel half."""
        role = ConnRole.CLIENT if isinstance(req, m.Connect) else ConnRole.SERVER
        try:
            tcp = BorrowedTcp(fd)
        except BorrowedTcpError as e:
            self.stats.invalid += 1
            log.warning("handoff: %s from %s: %s", req.TYPE.name, client.label, e)
            raise _Refused(m.Error(ErrorCode.BAD_FDS, _clip(str(e)))) from None
        try:
            draft = self._new_connection(client, role, tcp)
        except PairingError as e:
            tcp.close()
            raise _Refused(m.Error(ErrorCode.BAD_FDS, _clip(str(e)))) from None
        self._inflight += 1
        try:
            if role is ConnRole.CLIENT:
                outcome = await self._run_client(client, req.dmb_size, tcp)
            else:
                outcome = await self._run_server(client, req.dmb_size, tcp)
        except BaseException:
            tcp.close()
            raise
        finally:
            self._inflight -= 1
        key = (endpoint(tcp.local), endpoint(tcp.peer))
        if role is ConnRole.SERVER:
            key = (key[1], key[0])
        tcp.close()  # every copy of the borrowed descriptor is gone before we reply
        # The one place where the negotiated outcome picks the transport of the reply.
        if not isinstance(outcome, FallbackOutcome | SmcdLoopbackOutcome):
            return self._reply_smcr(client, outcome)
        if isinstance(outcome, FallbackOutcome):
            self._drop_pair(key, "the other half fell back")
            kept = self._reply_fallback(client, draft, outcome)
        else:
            kept = self._reply_channel(client, draft, role, key, outcome)  # SMC-D, loopback-ism
        self._idle_soon()
        return kept

    def _idle_soon(self) -> None:
        """The last handshake in flight has replied: the applications now map their channels
        and move their first bytes, and the next handoff is at least that far away. Deferred
        bookkeeping runs in that gap (on the next loop turn) instead of when its timer fires,
        which may be in the middle of the next handshake."""
        if not self._inflight and self._later and self._loop is not None:
            self._loop.call_soon(self._run_later_if_idle)

    def _run_later_if_idle(self) -> None:
        if not self._inflight:
            self._run_later()

    def _smcr_toward(self, tcp: BorrowedTcp) -> SmcrService | None:
        """The SMC-R service if SMC-R is to be tried on ``tcp``: its peer is in the
        configuration's ``peers`` and not reached through loopback, while the provider has a
        service (modes, an ACTIVE RDMA port)."""
        if self.smcr is None or not self.cfg.peers:
            return None
        local, peer = endpoint(tcp.local)[0], endpoint(tcp.peer)[0]
        if not any(peer.version == net.version and peer in net for net in self.cfg.peers):
            return None
        try:
            service = self.smcr()
            if service is None or (
                _is_local_address(peer) and not _routed_out(service, local, peer)
            ):
                return None
            return service
        except Exception:
            self.stats.errors += 1
            log.exception("handoff: the SMC-R service is unavailable; using SMC-D/TCP")
            return None

    def _why_no_smcr(self, tcp: BorrowedTcp) -> str:
        """Why :meth:`_smcr_toward` did not offer ``tcp`` to SMC-R, in an operator's words (the
        SMC-D negotiation can only say "no device" to a Proposal that wanted SMC-R)."""
        modes = self.cfg.modes
        if not (modes.smcr_v1 or modes.smcr_v2):
            return "SMC-R is switched off here (modes.smcr_v1 and modes.smcr_v2 are false)"
        if self.smcr is None:
            return "this daemon runs without SMC-R"
        peer = endpoint(tcp.peer)[0]
        if not any(peer.version == net.version and peer in net for net in self.cfg.peers):
            return f"the peer {peer} is not in the configuration's peers"
        return "no RDMA port is ACTIVE (smcctl device), or the peer is reached through loopback"

    async def _run_smcr(
        self, client: _Client, hint: int, tcp: BorrowedTcp, service: SmcrService, *, server: bool
    ) -> SmcrChannel | FallbackOutcome:
        """One SMC-R handshake through ``service`` (on a copy of the borrowed descriptor, which
        the service closes). Any error it raises is logged and becomes a fallback."""
        cred = client.cred
        kw = {"rmb_size": hint, "uid": client.uid, "pid": cred.pid if cred else 0}
        fd = os.dup(tcp.fd)
        try:
            if server:
                return await service.accept(fd, **kw)
            return await service.connect(fd, **kw)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self.stats.errors += 1
            log.exception("handoff: SMC-R %s with %s failed", "accept" if server else "connect",
                          tcp.peer)  # fmt: skip
            return FallbackOutcome(int(DeclineReason.INTERR), None, True, _clip(f"daemon: {e}"))

    def _reply_smcr(self, client: _Client, out: SmcrChannel) -> bool:
        """CHANNEL of mode SMCR: the service already recorded the connection."""
        reply = m.Channel(out.conn_id, m.Mode.SMCR, out.fds.rx_size, out.fds.tx_size)
        try:
            sent = self._send(client, reply, out.fds.fds())
        finally:
            out.fds.close()  # the daemon keeps its own end of the peer link
        if not sent:
            return False  # the application's end of the peer link is gone: the service sees it
        client.smcr_conn = out.conn_id
        self.stats.channels += 1
        log.debug("handoff: %s: SMC-R connection %d (lgr %#x, link %d)", client.label,
                  out.conn_id, out.lgr_id, out.link_id)  # fmt: skip
        return True

    async def _run_client(
        self, client: _Client, hint: int, tcp: BorrowedTcp
    ) -> SmcdLoopbackOutcome | FallbackOutcome | SmcrChannel:
        peer = endpoint(tcp.peer)
        why = self._peer_speaks_smc(peer)
        limit = self._session_limit(client.uid)
        held = self._held.get(client.uid, 0)
        if why is not None and limit and held > limit:
            return FallbackOutcome(
                int(DeclineReason.MAX_DMB),
                None,
                True,
                f"uid {client.uid} holds {held - 1} handoff connections; quota.connections "
                f"allows {limit}",
            )
        if why is not None:
            service = self._smcr_toward(tcp)
            if service is not None:
                log.debug("handoff: trying SMC-R toward %s: %s", tcp.peer, why)
                return await self._run_smcr(client, hint, tcp, service, server=False)
        session = self.loopback.session(client.uid, tcp.local, tcp.peer, server=False)
        facts = self._facts(hint, peer_speaks_smc=why is not None)
        if why is not None:
            log.debug("handoff: trying SMC toward %s: %s", tcp.peer, why)
            try:
                self.loopback.pairing.register_client(tcp.local, tcp.peer)
            except PairingError as e:
                log.warning("handoff: %s; offering no device", e)
                facts = dataclasses.replace(facts, loopback=None)
        negotiation = ClientNegotiation(facts, session)
        try:
            return await drive(negotiation, tcp, negotiation.start())
        finally:
            with contextlib.suppress(PairingError):
                self.loopback.pairing.withdraw(tcp.local, tcp.peer)

    async def _run_server(
        self, client: _Client, hint: int, tcp: BorrowedTcp
    ) -> SmcdLoopbackOutcome | FallbackOutcome | SmcrChannel:
        wait = self.cfg.timeouts.proposal_wait
        seen = await peek_proposal(tcp, wait)
        if seen.kind != "smc":
            detail = {
                "not-smc": "the client's first bytes are not a CLC Proposal: a plain TCP client",
                "silent": f"no CLC Proposal within {wait:g} s (timeouts.proposal_wait): a plain "
                "TCP client, or one that waits for the server to speak first",
                "eof": "the client closed the connection without proposing SMC",
            }[seen.kind]
            return FallbackOutcome(int(DeclineReason.PEERNOSMC), None, True, detail)
        service = self._smcr_toward(tcp)
        if service is not None:
            return await self._run_smcr(client, hint, tcp, service, server=True)
        session = self.loopback.session(client.uid, tcp.local, tcp.peer, server=True)
        out = await drive(ServerNegotiation(self._facts(hint), session), tcp)
        if isinstance(out, FallbackOutcome) and out.reason in _NO_RDMA_DECLINES and out.local:
            # only a Proposal with SMC-R ends so on this path: say why SMC-R was not tried
            why = self._why_no_smcr(tcp)
            out = dataclasses.replace(out, detail=f"{why}, so SMC-R was not tried; {out.detail}")
        return out

    def _reply_fallback(self, client: _Client, draft: _Draft, outcome: FallbackOutcome) -> bool:
        self.stats.fallbacks += 1
        code = outcome.reason
        # The reply first (the application waits for it), the bookkeeping after.
        self._send(client, fallback_message(code, outcome.detail, outcome.peer_diagnosis))
        conn = Connection(
            **draft,
            mode=ConnMode.TCP,
            state=ConnState.ACTIVE,
            fallback_reason=outcome.reason,
            peer_diagnosis=outcome.peer_diagnosis or 0,
        )
        self._add(conn)  # counts the fallback in the stats once published
        self._linger(conn.conn_id)
        log.info(
            "handoff: %s stays on TCP: %s (0x%08x%s): %s",
            client.label,
            _reason_name(code),
            code,
            "" if outcome.peer_diagnosis is None else f", peer 0x{outcome.peer_diagnosis:08x}",
            outcome.detail,
        )
        return False

    def _linger(self, conn_id: int) -> None:
        """Keep a fallen-back connection visible for a while, bounded in number."""
        self._fallbacks[conn_id] = time.monotonic() + FALLBACK_LINGER
        while len(self._fallbacks) > FALLBACK_KEEP:
            old, _ = self._fallbacks.popitem(last=False)
            self._remove(old)
        assert self._loop is not None
        self._loop.call_later(FALLBACK_LINGER, self._expire_fallbacks)

    def _expire_fallbacks(self) -> None:
        now = time.monotonic()
        while self._fallbacks:
            conn_id, until = next(iter(self._fallbacks.items()))
            if until > now:
                return
            del self._fallbacks[conn_id]
            self._remove(conn_id)

    # -- CHANNEL ------------------------------------------------------------------------------

    def _make_pair(self, key: tuple[Endpoint, Endpoint], tokens: tuple[int, int]) -> _Pair:
        """The shared part of a connection, made when its first half is ready: the pool's
        memfds of both DMBs (sized DMB + control trailer, exactly what the channel maps), two
        eventfds and the peer-link socketpair."""
        mem = {t: self.pool.get(t).fd for t in tokens}
        fds: list[int] = []
        try:
            flags = os.EFD_CLOEXEC | os.EFD_NONBLOCK
            ev_c = os.eventfd(0, flags)
            fds.append(ev_c)
            ev_s = os.eventfd(0, flags)
            fds.append(ev_s)
            a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
            link_c, link_s = a.detach(), b.detach()
        except BaseException:
            m.close_fds(fds)
            raise
        pair = _Pair(
            key=key,
            tokens=tokens,
            ev={ConnRole.CLIENT: ev_c, ConnRole.SERVER: ev_s},
            link={ConnRole.CLIENT: link_c, ConnRole.SERVER: link_s},
            mem=mem,
        )
        assert self._loop is not None
        wait = self.cfg.timeouts.clc_wait * 2 + 1.0
        pair.timer = self._loop.call_later(
            wait, self._drop_pair, key, "the other half never arrived"
        )
        self._pairs[key] = pair
        return pair

    def _drop_pair(self, key: tuple[Endpoint, Endpoint], why: str) -> None:
        """Forget a pair whose second half will not come: close what was not handed out (the
        first half then sees its peer link hang up: an abort, never a hang)."""
        pair = self._pairs.get(key)
        if pair is None or len(pair.taken) == 2:
            return
        log.info("handoff: pairing %s dropped: %s", key, why)
        del self._pairs[key]
        pair.close_shared()
        self._pair_done(pair)

    def _pair_done(self, pair: _Pair) -> None:
        """Close a pair for good once nobody can use it any more: no half is still to come
        (both took theirs, or it was dropped) and every half that took one has let go."""
        current = self._pairs.get(pair.key) is pair
        if (len(pair.taken) == 2 or not current) and pair.released >= pair.taken:
            if current:
                del self._pairs[pair.key]
            if pair.timer is not None:
                pair.timer.cancel()
            pair.close_all()
            ops, pair.pending = pair.pending, []
            self._release_dmbs(ops)

    def _reply_channel(
        self,
        client: _Client,
        draft: _Draft,
        role: ConnRole,
        key: tuple[Endpoint, Endpoint],
        out: SmcdLoopbackOutcome,
    ) -> bool:
        conn_id = draft["conn_id"]
        tokens = (
            (out.local_token, out.peer_token)
            if role is ConnRole.CLIENT
            else (out.peer_token, out.local_token)
        )
        half = _Half(
            conn_id, role, client.uid, out.local_token, out.peer_token,
            out.local_dmb_size, out.peer_dmb_size,
        )  # fmt: skip
        pair = self._pairs.get(key)
        if pair is not None and len(pair.taken) == 2:
            del self._pairs[key]  # an earlier connection on this 4-tuple, still draining
            pair = None
        try:
            if pair is not None and (pair.tokens != tokens or role in pair.taken):
                raise SmcError(f"pairing {key} does not match the tokens of this half")
            if pair is None:
                pair = self._make_pair(key, tokens)
            half.pair = pair
            rx_fd, tx_fd = pair.mem[out.local_token], pair.mem[out.peer_token]
            other = ConnRole.SERVER if role is ConnRole.CLIENT else ConnRole.CLIENT
            fds = [rx_fd, tx_fd, pair.ev[role], pair.ev[other], pair.link[role]]
        except (SmcError, OSError, KeyError) as e:
            self.stats.errors += 1
            log.error("handoff: %s: cannot build the channel: %s", client.label, e)
            self._release_half(half)
            self._drop_pair(key, str(e))
            outcome = FallbackOutcome(int(DeclineReason.INTERR), None, True, f"daemon: {e}")
            return self._reply_fallback(client, draft, outcome)
        client.half = half
        self._halves[conn_id] = half
        reply = m.Channel(conn_id, m.Mode.SMCD, half.rx_size, half.tx_size)
        sent = self._send(client, reply, fds)  # first: the application waits for it
        self._defer(self._count_channel, half, draft, out)
        # The half has its end of the peer link (or lost it): ours goes now.
        pair.taken.add(role)
        with contextlib.suppress(OSError):
            os.close(pair.link.pop(role))
        if len(pair.taken) == 2:
            if pair.timer is not None:
                pair.timer.cancel()
            pair.close_shared()
        self._start_refresh()
        if not sent:
            return False  # the finally of the client loop releases the half
        self.stats.channels += 1
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "handoff: %s: SMC-D connection %d (%s, lgr %#x, rx %d, tx %d)",
                client.label, conn_id, role.value.lower(), out.link_id, half.rx_size, half.tx_size,
            )  # fmt: skip
        return True

    def _count_channel(self, half: _Half, draft: _Draft, out: SmcdLoopbackOutcome) -> None:
        reg = self.registry
        lgr_id = out.link_id
        timer = self._lgr_timers.pop(lgr_id, None)
        if timer is not None:
            timer.cancel()
        gid = out.peer_gid.to_bytes(16, "big")
        if reg.link_group(lgr_id) is None:
            reg.add_link_group(
                LinkGroup(
                    lgr_id=lgr_id,
                    # the server half created it (first contact) unless the roles say otherwise
                    role=LgrRole.SERV
                    if (half.role is ConnRole.SERVER) == out.first_contact
                    else LgrRole.CLNT,
                    smc_type=SmcType.SMCD,
                    local_gid=self.loopback.gid128.to_bytes(16, "big"),
                    peer_gid=gid,
                    chid=out.chid,
                    netdev="lo",
                    smc_version=out.version,
                    smc_release=out.release,
                    peer_os=3,  # Linux
                    peer_hostname=self.hostname[:32],
                    negotiated_eid=out.negotiated_eid,
                )
            )
        conn = Connection(
            **draft,
            mode=ConnMode.SMCD,
            state=ConnState.ACTIVE,
            lgr_id=lgr_id,
            token=half.conn_id & 0xFFFFFFFF,
            sndbuf_size=out.peer_dmb_size,
            rmbe_size=out.local_dmb_size,
            peer_rmbe_size=out.peer_dmb_size,
        )
        self._add(conn)
        reg.stats.count_connection(SmcType.SMCD, half.role, out.version)

    # -- notices and release ------------------------------------------------------------------

    def _notice(self, half: _Half, msg: m.Shutdown | m.Close) -> None:
        conn = self._connection(half.conn_id)
        if conn is None:
            return
        if isinstance(msg, m.Shutdown):
            if msg.how in (socket.SHUT_WR, socket.SHUT_RDWR) and conn.state is ConnState.ACTIVE:
                self._update(half.conn_id, state=ConnState.PEERCLOSEWAIT1)
            return
        # CLOSE: the hang-up follows at once and removes the record; only the counters matter.
        self._refresh_half(half, publish=False)
        half.closed = True

    def _hang_up(self, client: _Client) -> None:
        """The client's connection is gone: release what it held."""
        if client.listener is not None:
            lst, client.listener = client.listener, None
            self._listeners.pop(lst.ident, None)
            self._remove(lst.conn_id)
            log.info("handoff: listener %d on port %d unregistered", lst.ident, lst.port)
        if client.half is not None:
            half, client.half = client.half, None
            self._halves.pop(half.conn_id, None)
            self._defer(self._release_record, half)

    def _release_record(self, half: _Half) -> None:
        """A hung-up half's bookkeeping (deferred): last counters, record, DMBs, link group."""
        if not half.closed:
            self._refresh_half(half, publish=False)
        conn = self._remove(half.conn_id)
        self._release_half(half)
        if conn is not None and conn.lgr_id is not None:
            self._maybe_free_lgr(conn.lgr_id)

    def _release_half(self, half: _Half) -> None:
        """Let go of this half's DMB and its reference on the peer's; the pool takes a buffer
        back once both halves have let go."""
        ops = []
        if half.local_token is not None:
            ops.append(("unregister", half.local_token))
        if half.peer_token is not None:
            ops.append(("detach", half.peer_token))
        half.local_token = half.peer_token = None
        pair = half.pair
        if pair is None:
            self._release_dmbs(ops)
            return
        half.pair = None
        pair.pending.extend(ops)
        pair.released.add(half.role)
        self._pair_done(pair)

    def _release_dmbs(self, ops: list[tuple[str, int]]) -> None:
        for op, token in ops:
            with contextlib.suppress(UnknownTokenError):
                if op == "unregister":
                    self.pool.unregister(token)
                else:
                    self.pool.detach(token)

    # -- deferred bookkeeping -------------------------------------------------------------------

    def _defer(self, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn(*args)`` soon, after what is waiting now (see :data:`DEFER_DELAY`); deferred
        calls run in the order they were deferred."""
        self._later.append((fn, args))
        if len(self._later) >= DEFER_MAX:
            self._run_later()
        elif self._later_timer is None and self._loop is not None:
            self._later_timer = self._loop.call_later(DEFER_DELAY, self._run_later)

    def _run_later(self) -> bool:
        """Run every deferred call now; True if there was one."""
        if self._later_timer is not None:
            self._later_timer.cancel()
            self._later_timer = None
        ran = False
        while self._later:
            work, self._later = self._later, []
            ran = True
            for fn, args in work:
                try:
                    fn(*args)
                except Exception:
                    self.stats.errors += 1
                    log.exception("handoff: deferred %s failed", getattr(fn, "__name__", fn))
        return ran

    def _view(self, fd: int) -> _DmbView:
        """The header view of the pool memfd ``fd``, mapped on first use (the refresh or the
        hang-up reads it; the handshake never does)."""
        view = self._views.get(fd)
        if view is None:
            view = self._views[fd] = _DmbView(fd)
        return view

    def _forget_view(self, fd: int) -> None:
        view = self._views.pop(fd, None)
        if view is not None:
            view.close()

    # -- registry, batched ----------------------------------------------------------------------

    def _add(self, conn: Connection) -> None:
        """Add ``conn`` to the registry once it has lived :data:`PUBLISH_DELAY` seconds."""
        self._unpublished[conn.conn_id] = conn
        self._due[conn.conn_id] = time.monotonic() + PUBLISH_DELAY
        if self._publish_timer is None and self._loop is not None:
            self._publish_timer = self._loop.call_later(PUBLISH_DELAY, self._publish_due)

    def _publish_due(self) -> None:
        """The timer: publish the connections that are due (at most :data:`PUBLISH_MAX` at a
        time: each is a D-Bus signal, and a burst of thousands overruns the bus socket), then
        wait for the next one."""
        self._publish_timer = None
        now = time.monotonic()
        due = []
        for conn_id, when in self._due.items():
            if when > now or len(due) >= PUBLISH_MAX:
                break
            due.append(conn_id)
        self._publish(due)
        if self._due and self._loop is not None:
            wait = max(next(iter(self._due.values())) - now, PUBLISH_PACE)
            self._publish_timer = self._loop.call_later(wait, self._publish_due)

    def publish(self) -> None:
        """Add every pending connection to the registry now."""
        if self._publish_timer is not None:
            self._publish_timer.cancel()
            self._publish_timer = None
        self._publish(list(self._due))

    def _publish(self, conn_ids: list[int]) -> None:
        for conn_id in conn_ids:
            del self._due[conn_id]
            conn = self._unpublished.pop(conn_id)
            if conn.lgr_id is not None and self.registry.link_group(conn.lgr_id) is None:
                conn = dataclasses.replace(conn, lgr_id=None)
            try:
                self.registry.add_connection(conn)
            except RegistryError as e:
                log.warning("handoff: registry: %s", e)

    def _connection(self, conn_id: int) -> Connection | None:
        conn = self._unpublished.get(conn_id)
        return conn if conn is not None else self.registry.connection(conn_id)

    def _update(self, conn_id: int, **changes: Any) -> None:
        conn = self._unpublished.get(conn_id)
        if conn is not None:
            self._unpublished[conn_id] = dataclasses.replace(conn, **changes)
            return
        with contextlib.suppress(RegistryError):
            self.registry.update_connection(conn_id, **changes)

    def _remove(self, conn_id: int) -> Connection | None:
        """Take a connection out (published or not); a fallback never published still counts."""
        conn = self._unpublished.pop(conn_id, None)
        if conn is not None:
            del self._due[conn_id]
            if conn.mode is ConnMode.TCP and conn.fallback_reason:
                self.registry.stats.count_fallback(conn.fallback_reason, conn.role)
            return conn
        try:
            return self.registry.remove_connection(conn_id)
        except RegistryError:
            return None

    def _maybe_free_lgr(self, lgr_id: int) -> None:
        lgr = self.registry.link_group(lgr_id)
        if lgr is None or lgr.conns or lgr_id in self._lgr_timers or self._loop is None:
            return
        self._lgr_timers[lgr_id] = self._loop.call_later(LGR_FREE_DELAY, self._free_lgr, lgr_id)

    def _free_lgr(self, lgr_id: int) -> None:
        self._lgr_timers.pop(lgr_id, None)
        self._run_later()  # a deferred record may still name this link group
        lgr = self.registry.link_group(lgr_id)
        waiting = any(c.lgr_id == lgr_id for c in self._unpublished.values())
        if lgr is None or lgr.conns or self._inflight or waiting:
            if lgr is not None and not lgr.conns:
                self._maybe_free_lgr(lgr_id)  # a handshake may be about to use it: later
            return
        self.loopback.link_groups.discard(lgr_id)
        self.registry.remove_link_group(lgr_id)
        log.info("handoff: link group %#x freed", lgr_id)

    # -- cursors and bytes --------------------------------------------------------------------

    def _start_refresh(self) -> None:
        if self._halves and (self._refresher is None or self._refresher.done()):
            assert self._loop is not None
            self._refresher = self._loop.create_task(self._refresh_loop(), name="smcd-cursors")

    async def _refresh_loop(self) -> None:
        """Read the CDC headers of live connections while there are any (no timer otherwise)."""
        while self._halves:
            await asyncio.sleep(REFRESH_INTERVAL)
            self.refresh()
        self._run_later()  # the last halves' releases, so the pool's state below is final
        st = self.pool.stats()
        log.info(
            "handoff: no SMC connection left; DMB pool: %d buffers in use (%d bytes), "
            "%d cached (%d bytes)",
            st.in_use_buffers, st.in_use_bytes,
            st.allocated_buffers - st.in_use_buffers, st.allocated_bytes - st.in_use_bytes,
        )  # fmt: skip

    def refresh(self) -> None:
        """Bring cursors and byte counts of every live SMC connection up to date."""
        for half in list(self._halves.values()):
            try:
                self._refresh_half(half)
            except Exception:
                log.exception("handoff: reading the cursors of connection %d failed", half.conn_id)

    def _refresh_half(self, half: _Half, *, publish: bool = True) -> None:
        """Read both CDC headers of ``half``: counters always, the record if ``publish``."""
        pair = half.pair
        if pair is None or half.local_token is None or half.peer_token is None:
            return  # released (or a resumed record: no DMBs of ours)
        try:
            rx, tx = pair.mem[half.local_token], pair.mem[half.peer_token]
            words = (self._view(rx).words(), self._view(tx).words())
        except (OSError, KeyError) as e:
            log.warning("handoff: connection %d: cannot read its DMB headers: %s", half.conn_id, e)
            return
        if words == half.seen:
            return  # nothing moved since the last refresh (an idle connection costs no more)
        conn = self._connection(half.conn_id)
        if conn is None:
            return
        half.seen = words
        rx_hdr = _DmbView.header(words[0])  # written by the peer: its producer/consumer cursor
        tx_hdr = _DmbView.header(words[1])  # written by this half into the peer's DMB
        changes: dict[str, Any] = {}
        if rx_hdr is not None and publish:
            changes["rx_prod"] = Cursor(rx_hdr.prod_wrap, rx_hdr.prod_count)
            changes["tx_cons"] = Cursor(rx_hdr.cons_wrap, rx_hdr.cons_count)
            flags = rx_hdr.conn_state_flags
            if flags & _ABORT and conn.state is not ConnState.PROCESSABORT:
                changes["state"] = ConnState.PEERABORTWAIT
            elif flags & _CLOSING and conn.state is ConnState.ACTIVE:
                changes["state"] = ConnState.APPCLOSEWAIT1
        sent = received = 0
        if tx_hdr is not None:
            prod = (tx_hdr.prod_wrap, tx_hdr.prod_count)
            cons = (tx_hdr.cons_wrap, tx_hdr.cons_count)
            if publish:
                changes["tx_prod"], changes["rx_cons"] = Cursor(*prod), Cursor(*cons)
            sent = _advance(half.tx_size - 32, half.tx_prod, *prod)
            received = _advance(half.rx_size - 32, half.rx_cons, *cons)
            half.tx_prod, half.rx_cons = prod, cons
        if sent:
            changes["bytes_sent"] = conn.bytes_sent + sent
        if received:
            changes["bytes_received"] = conn.bytes_received + received
        if sent or received:
            self.registry.stats.add_bytes(SmcType.SMCD, tx=sent, rx=received)
        if changes and publish:
            self._update(half.conn_id, **changes)

    # -- LISTEN -------------------------------------------------------------------------------

    def _listen(self, client: _Client, fd: int) -> bool:
        try:
            sock = socket.socket(fileno=fd)
        except OSError as e:
            os.close(fd)
            raise _Refused(m.Error(ErrorCode.BAD_FDS, f"not a socket: {e.strerror or e}")) from None
        try:
            if sock.family not in (socket.AF_INET, socket.AF_INET6) or (
                sock.type != socket.SOCK_STREAM
            ):
                raise _Refused(m.Error(ErrorCode.BAD_FDS, "not a TCP socket"))
            if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                raise _Refused(m.Error(ErrorCode.BAD_FDS, "the socket is not listening"))
            ip, port, _ = endpoint(sock.getsockname())
            inode = os.fstat(sock.fileno()).st_ino
        except (OSError, PairingError) as e:
            raise _Refused(m.Error(ErrorCode.BAD_FDS, _clip(f"bad listener: {e}"))) from None
        finally:
            sock.close()  # the daemon keeps no copy
        limit = self._session_limit(client.uid)
        held = self._held.get(client.uid, 0)
        if limit and held > limit:
            reply = fallback_message(
                int(DeclineReason.MAX_DMB),
                f"uid {client.uid} holds {held - 1} handoff connections (quota.connections)",
            )
            self._send(client, reply)
            return False
        cred = client.cred
        conn = self.registry.add_connection(
            Connection(
                conn_id=self.registry.allocate_conn_id(),
                role=ConnRole.SERVER,
                mode=ConnMode.SMCD,
                state=ConnState.LISTEN,
                local_addr="" if ip.is_unspecified else str(ip),
                local_port=port,
                uid=cred.uid if cred else 0,
                pid=cred.pid if cred else 0,
                inode=inode,
            )
        )
        lst = _Listener(self._next_listener, ip, port, client.uid, conn.conn_id)
        self._next_listener += 1
        self._listeners[lst.ident] = lst
        client.listener = lst
        self.stats.listeners += 1
        log.info("handoff: %s registered listener %d on %s port %d", client.label, lst.ident,
                 ip, port)  # fmt: skip
        return self._send(client, m.Ok(lst.ident))

    # -- RESUME -------------------------------------------------------------------------------

    def _resume(self, client: _Client, req: m.Resume, fds: list[int]) -> bool:
        """Record a live channel again after a restart. The daemon gets no copy of its DMBs, so
        it shows the byte counts the library reports, and no cursors; the two halves meet in
        one link group of this daemon's loopback-ism device.

        Only SMC-D channels survive a restart: an SMC-R channel's data moved through the old
        daemon's queue pairs, so it died with them (the library aborts it) and is refused here
        rather than recorded as something it is not."""
        if req.mode is not m.Mode.SMCD:
            m.close_fds(fds)
            raise _Refused(
                m.Error(
                    ErrorCode.BAD_STATE,
                    f"RESUME of a {req.mode.name} channel: only SMC-D channels outlive the daemon",
                )
            )
        try:
            sock = socket.socket(fileno=fds[0])
        except OSError as e:
            m.close_fds(fds)
            raise _Refused(m.Error(ErrorCode.BAD_FDS, f"not a socket: {e.strerror or e}")) from None
        try:
            if sock.type != socket.SOCK_STREAM:
                raise OSError("not a stream socket")
            local, peer = endpoint(sock.getsockname()), endpoint(sock.getpeername())
            inode = os.fstat(sock.fileno()).st_ino
        except (OSError, PairingError) as e:
            raise _Refused(m.Error(ErrorCode.BAD_FDS, _clip(f"RESUME: {e}"))) from None
        finally:
            sock.close()  # the daemon keeps no copy
        role = ConnRole.CLIENT if req.role is m.Role.CLIENT else ConnRole.SERVER
        gid = self.loopback.gid128
        lgr_id = self.loopback.link_groups.find(gid)
        if lgr_id is None:
            lgr_id = self.loopback.link_groups.create(gid)
        if self.registry.link_group(lgr_id) is None:
            gid_bytes = gid.to_bytes(16, "big")
            self.registry.add_link_group(
                LinkGroup(
                    lgr_id=lgr_id,
                    role=LgrRole.SERV,
                    smc_type=SmcType.SMCD,
                    local_gid=gid_bytes,
                    peer_gid=gid_bytes,
                    chid=self.loopback.chid,
                    netdev="lo",
                    smc_version=2,
                    peer_os=3,
                    peer_hostname=self.hostname[:32],
                )
            )
        timer = self._lgr_timers.pop(lgr_id, None)
        if timer is not None:
            timer.cancel()
        cred = client.cred
        conn_id = self.registry.allocate_conn_id()
        self.registry.add_connection(
            Connection(
                conn_id=conn_id,
                role=role,
                mode=ConnMode.SMCD,
                state=ConnState.ACTIVE,
                local_addr=str(local[0]),
                local_port=local[1],
                peer_addr=str(peer[0]),
                peer_port=peer[1],
                netdev="lo" if peer[0].is_loopback else "",
                uid=cred.uid if cred else 0,
                pid=cred.pid if cred else 0,
                inode=inode,
                token=conn_id & 0xFFFFFFFF,
                lgr_id=lgr_id,
                sndbuf_size=req.tx_size,
                rmbe_size=req.rx_size,
                peer_rmbe_size=req.tx_size,
                bytes_sent=req.bytes_sent,
                bytes_received=req.bytes_received,
            )
        )
        client.half = _Half(conn_id, role, client.uid, None, None, req.rx_size, req.tx_size)
        self.stats.resumes += 1
        log.info("handoff: %s resumed connection %d as %d", client.label, req.conn_id, conn_id)
        return self._send(client, m.Ok(conn_id))
