"""loopback-ism in userspace: the Emulated-ISM device that lets SMC-D run between two processes on
one host, with the daemon pairing both halves of the TCP connection.

What it mirrors from the kernel (``net/smc/smc_loopback.c``, 6.10-6.17; PROTOCOL.md §2):

* one device, CHID 0xFFFF (``SMC_LO_RESERVED_CHID``), a 128-bit GID drawn at random when the daemon
  starts: the first 8 bytes are ``gid``, the last 8 ``gid_ext`` (so it takes two GID/CHID entries
  in a Proposal and sends ``gid_ext`` in Accept/Confirm);
* ``register_dmb`` / ``unregister_dmb`` / ``attach_dmb`` / ``detach_dmb`` by 64-bit token, attach
  taking a reference on the peer's DMB (the "no-copy" merge: the sender writes straight into the
  receiver's DMB). The buffers are the memfds of :class:`~smcd_daemon.core.buffers.DmbPool`;
* ``query_remote_gid``: loopback only talks to itself, i.e. a remote GID is reachable only if it
  is our own.

What it adds: the **pairing table**. The kernel's loopback-ism is trustworthy because both ends
live in one kernel; a GID match proves it. A userspace daemon sees the GID in a Proposal that came
over TCP from anywhere, and a 64-bit (or even 128-bit) random value is not proof that the peer is
this daemon. So a server accepts the loopback path only when the Proposal's loopback GID is ours
*and* this daemon holds the client half of this very TCP connection: the client half registers its
connection key before it sends its Proposal, and the server half looks for the same key. The key
is the connection's identity (its two ISNs, :mod:`smcd_daemon.adapters.tcp_identity`) when the
caller has it, else the (local, peer) addresses, mirrored on the server. An entry pairs at most one
server half (it is claimed), it expires after ``ttl`` seconds, and the table is bounded. The client
half, in turn, checks that a server half of this daemon claimed it before it trusts an Accept
(:meth:`PairingTable.claimed`).

And the **proof**. Keys only make the halves meet; addresses repeat across network namespaces and
change under DNAT. Two halves belong together only when what the daemon wrote on one socket is
what it read on the other: the DMB token, 64 bits from the CSPRNG, fresh for every handshake,
which the server half writes in its Accept and the client half reads back, and the client half's
token in its Confirm, which the server half reads. :meth:`LoopbackIsm.prove` lets a client half
attach a DMB only if a server half of this daemon, still unclaimed (and of the same connection
key, where both have one), wrote that token, and a server half attach only the DMB of the client
half that read its own token. The token is the field the protocol already gives a device for an
opaque handle (a kernel peer attaches whatever token the Accept names), so nothing new is put on
the wire, and a peer that guesses or replays a token gets a Decline, never someone else's DMB.
"""

from __future__ import annotations

import functools
import ipaddress
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from smcd_daemon.core.buffers import Dmb, DmbAllocationError, DmbPool
from smcd_daemon.errors import SmcError
from smcd_daemon.wire.clc import LOOPBACK_ISM_CHID, IsmDevice

__all__ = [
    "LGR_ID_STEP",
    "LOOPBACK_ISM_CHID",
    "DmbGrant",
    "Endpoint",
    "LinkGroupTable",
    "LoopbackIsm",
    "LoopbackSession",
    "PairingError",
    "PairingKey",
    "PairingTable",
    "PairingTableFull",
    "endpoint",
]

LGR_ID_STEP = 256
"""Link group ids advance by 256 as the kernel's (``SMC_LGR_NUM_INCR``)."""

_U64 = (1 << 64) - 1
_MAX_WRITTEN = 16384


class PairingError(SmcError):
    """A pairing request the table cannot honour."""


class PairingTableFull(PairingError):
    """Every slot holds a live entry; the client half cannot be registered (offer no loopback)."""


Endpoint = tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int, int]
"""(address, port, IPv6 scope id) — the normalised form both halves compare."""


def endpoint(addr: Any) -> Endpoint:
    """Normalise a ``getsockname()``/``getpeername()`` result (AF_INET ``(host, port)`` or AF_INET6
    ``(host, port, flowinfo, scope_id)``) so that both halves spell one address the same way: an
    IPv4-mapped IPv6 address becomes IPv4 (a v6 client of a v4 listener), the flow label is
    dropped, a scope id is kept (link-local addresses are per interface).

    Results are cached: every handoff normalises the same few addresses several times, and
    parsing an address with :mod:`ipaddress` costs more than the rest of the lookup."""
    if type(addr) is tuple:  # the hot path: exact types, no isinstance chains
        n = len(addr)
        if n == 3 and type(addr[0]) in _IP_TYPES:
            return addr  # already normalised
        if (n == 2 or n == 4) and type(addr[0]) is str and type(addr[1]) is int:
            # A getsockname()/getpeername() result: every connection has a new port, but the
            # hosts are few, so the parsed host is what is cached.
            host = _HOSTS.get(addr[0])
            if host is None:
                host = _host(addr[0])
                if len(_HOSTS) >= 4096:
                    _HOSTS.clear()
                _HOSTS[addr[0]] = host
            ip, v6 = host
            port = addr[1]
            if not 0 <= port <= 0xFFFF:
                raise PairingError(f"not a port: {port!r}")
            scope = addr[3] if n == 4 and v6 else 0
            if type(scope) is not int:
                raise PairingError(f"not a scope id: {scope!r}")
            return (ip, port, scope)
    if (
        isinstance(addr, tuple)
        and len(addr) == 3
        and isinstance(addr[0], ipaddress.IPv4Address | ipaddress.IPv6Address)
    ):
        return addr  # already normalised (an address subclass)
    if not isinstance(addr, tuple) or len(addr) not in (2, 4):
        raise PairingError(f"not a socket address: {addr!r}")
    if not isinstance(addr[1], int):  # before the cache, where 80.0 would equal 80
        raise PairingError(f"not a port: {addr[1]!r}")
    try:
        return _normalise(addr)
    except TypeError:  # an unhashable part: not a socket address either way
        raise PairingError(f"not a socket address: {addr!r}") from None


class IPv4Address(ipaddress.IPv4Address):
    """An ``ipaddress.IPv4Address`` that computes its hash once. Endpoints are dictionary keys
    several times per handoff (pairing table, pairs, sessions), and ``ipaddress`` hashes by
    formatting the address as hex text every time. Same name, value, equality and hash as the
    base class; only :func:`endpoint` makes them."""

    __slots__ = ("_hash",)

    def __init__(self, address: int) -> None:
        super().__init__(address)
        self._hash = ipaddress.IPv4Address.__hash__(self)

    def __hash__(self) -> int:
        return self._hash


class IPv6Address(ipaddress.IPv6Address):
    """The IPv6 counterpart of :class:`IPv4Address` (the scope id stays in the endpoint)."""

    __slots__ = ("_hash",)

    def __init__(self, address: int) -> None:
        super().__init__(address)
        self._hash = ipaddress.IPv6Address.__hash__(self)

    def __hash__(self) -> int:
        return self._hash


_IP_TYPES = (IPv4Address, IPv6Address, ipaddress.IPv4Address, ipaddress.IPv6Address)
_HOSTS: dict[str, tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, bool]] = {}
"""Host text → (normalised address, keeps its scope id), as :func:`_normalise` decides."""


def _host(text: str) -> tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, bool]:
    ip, _, scope = _normalise((text, 0, 0, 1))
    return ip, scope == 1


@functools.lru_cache(maxsize=8192)
def _normalise(addr: tuple[Any, ...]) -> Endpoint:
    host, port = addr[0], addr[1]
    scope = addr[3] if len(addr) == 4 else 0
    if isinstance(host, str):
        host = host.split("%", 1)[0]
    try:
        ip = ipaddress.ip_address(host)
    except ValueError as exc:
        raise PairingError(f"not an IP address: {host!r}") from exc
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip, scope = ip.ipv4_mapped, 0
    if isinstance(ip, ipaddress.IPv4Address):
        scope = 0
    if not isinstance(port, int) or not 0 <= port <= 0xFFFF:
        raise PairingError(f"not a port: {port!r}")
    fast = IPv4Address(int(ip)) if ip.version == 4 else IPv6Address(int(ip))
    return (fast, port, int(scope))


@dataclass
class _Half:
    expires: float
    claimed: bool = False


PairingKey = Any
"""What the two halves of one connection both know: an identity (client ISN, server ISN) or the
client-first (local, peer) endpoints."""


def _client_key(local: Any, peer: Any, key: PairingKey | None) -> PairingKey:
    return key if key is not None else (endpoint(local), endpoint(peer))


class PairingTable:
    """Client halves of TCP connections held by this daemon, keyed by (local, peer)."""

    def __init__(
        self,
        *,
        max_entries: int = 4096,
        ttl: float = 12.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_entries < 1 or ttl <= 0:
            raise ValueError("max_entries must be >= 1 and ttl > 0")
        self.max_entries = max_entries
        self.ttl = ttl
        self._clock = clock
        self._halves: OrderedDict[tuple[Endpoint, Endpoint], _Half] = OrderedDict()

    def __len__(self) -> int:
        self._expire()
        return len(self._halves)

    def _expire(self) -> None:
        now = self._clock()
        while self._halves:
            key, half = next(iter(self._halves.items()))
            if half.expires > now:
                break
            del self._halves[key]

    def register_client(self, local: Any, peer: Any, *, key: PairingKey | None = None) -> None:
        """The client half (its local and peer address, or its connection ``key``) is about to
        send a Proposal."""
        key = _client_key(local, peer, key)
        self._expire()
        if key in self._halves:
            del self._halves[key]  # a reused 4-tuple: the old connection is gone
        elif len(self._halves) >= self.max_entries:
            raise PairingTableFull(
                f"{self.max_entries} client halves are waiting to be paired; try again later"
            )
        self._halves[key] = _Half(self._clock() + self.ttl)

    def withdraw(self, local: Any, peer: Any, *, key: PairingKey | None = None) -> bool:
        """The client half's handshake ended (either way): forget it. True if it was there."""
        return self._halves.pop(_client_key(local, peer, key), None) is not None

    def claim_server(self, local: Any, peer: Any, *, key: PairingKey | None = None) -> bool:
        """Server half with addresses (local, peer) (or connection ``key``): is the client half
        (peer, local) held here, live and not yet paired? If so it is marked claimed (one
        client half pairs with one server half) and True is returned."""
        self._expire()
        half = self._halves.get(_client_key(peer, local, key))
        if half is None or half.claimed:
            return False
        half.claimed = True
        return True

    def claimed(self, local: Any, peer: Any, *, key: PairingKey | None = None) -> bool:
        """Client half: has a server half of this daemon claimed us?"""
        self._expire()
        half = self._halves.get(_client_key(local, peer, key))
        return half is not None and half.claimed


class LinkGroupTable:
    """SMC-D link groups of the loopback device: one per peer GID (for loopback-ism that is our
    own GID, so client and server halves share one, as in the kernel). A minimal stand-in until
    the registry is wired in: it only hands out ids and remembers which peer GID has one."""

    def __init__(self, id_source: Callable[[], int] | None = None) -> None:
        self._next = 0
        self._id_source = id_source
        self._by_gid: dict[int, int] = {}

    def find(self, peer_gid: int) -> int | None:
        return self._by_gid.get(peer_gid)

    def create(self, peer_gid: int) -> int:
        if peer_gid in self._by_gid:
            raise SmcError(f"a link group for peer GID {peer_gid:#034x} exists already")
        if self._id_source is not None:
            lgr_id = self._id_source()
        else:
            self._next += LGR_ID_STEP
            lgr_id = self._next
        self._by_gid[peer_gid] = lgr_id
        return lgr_id

    def discard(self, lgr_id: int) -> None:
        for gid, known in list(self._by_gid.items()):
            if known == lgr_id:
                del self._by_gid[gid]


@dataclass(frozen=True)
class DmbGrant:
    """What the negotiator needs to know about a DMB it registered or attached."""

    token: int
    size: int
    size_comp: int


class LoopbackIsm:
    """The loopback-ism device of this daemon."""

    chid = LOOPBACK_ISM_CHID

    def __init__(
        self,
        pool: DmbPool,
        *,
        gid128: int | None = None,
        pairing: PairingTable | None = None,
        link_groups: LinkGroupTable | None = None,
    ) -> None:
        if gid128 is None:
            gid128 = 0
            while not gid128 >> 64 or not gid128 & _U64:
                gid128 = secrets.randbits(128)
        if not 0 <= gid128 < 1 << 128:
            raise ValueError("gid128 must be a 128-bit unsigned int")
        self.pool = pool
        self.reclaim: Callable[[], bool] | None = None
        """Called once when the pool refuses a DMB: it runs releases its owner deferred and
        says whether there were any (then the allocation is tried again)."""
        self.gid128 = gid128
        self.pairing = pairing if pairing is not None else PairingTable()
        self.link_groups = link_groups if link_groups is not None else LinkGroupTable()
        self._written: OrderedDict[int, LoopbackSession] = OrderedDict()
        """DMB token → the session that wrote it in its Accept/Confirm and whose peer has not
        yet proven that it read it (:meth:`prove`)."""
        self.policy: Callable[[LoopbackSession, LoopbackSession], str | None] | None = None
        """Who may pair with whom: the reason to refuse a proven pair, or None to allow."""

    @property
    def gid(self) -> int:
        """First 8 bytes of the UUID-like GID (sent as ``gid``)."""
        return self.gid128 >> 64

    @property
    def gid_ext(self) -> int:
        """Last 8 bytes (sent as ``gid_ext``)."""
        return self.gid128 & _U64

    def ism_device(self) -> IsmDevice:
        """The two GID/CHID entries a Proposal offers for this device."""
        return IsmDevice(self.chid, self.gid, self.gid_ext)

    def query_remote_gid(self, gid128: int) -> bool:
        """loopback-ism reaches only itself."""
        return gid128 == self.gid128

    def register_dmb(self, uid: int, size: int, *, min_size: int | None = None) -> Dmb:
        try:
            return self.pool.register(uid, size, min_size=min_size)
        except DmbAllocationError:
            if self.reclaim is None or not self.reclaim():
                raise
        return self.pool.register(uid, size, min_size=min_size)

    def unregister_dmb(self, token: int) -> None:
        self.pool.unregister(token)

    def attach_dmb(self, token: int, uid: int) -> Dmb:
        return self.pool.attach(token, uid)

    def detach_dmb(self, token: int) -> None:
        self.pool.detach(token)

    def session(
        self,
        uid: int,
        local: Any,
        peer: Any,
        *,
        server: bool,
        key: PairingKey | None = None,
        owner: Any = None,
    ) -> LoopbackSession:
        return LoopbackSession(self, uid, local, peer, server=server, key=key, owner=owner)

    # -- the proof ------------------------------------------------------------------------------

    def wrote(self, token: int, session: LoopbackSession) -> None:
        """``session`` registered DMB ``token``, which it is about to write to its peer."""
        self._written[token] = session
        while len(self._written) > _MAX_WRITTEN:
            self._written.popitem(last=False)  # the oldest handshakes are long over

    def forget(self, token: int) -> None:
        self._written.pop(token, None)

    def prove(self, session: LoopbackSession, token: int) -> None:
        """``session`` read ``token`` from its peer and wants to attach its DMB: is the writer
        of that token its other half? Raises :class:`PairingError` if not (nothing changes)."""
        writer = self._written.get(token)
        if writer is None or writer is session or writer.server == session.server:
            raise PairingError(
                f"DMB token {token:#x} was not written by a "
                f"{'client' if session.server else 'server'} half of this daemon in a handshake "
                "in progress: the peer is not the other half of this connection"
            )
        if session.server:  # the client half must have read *our* token first
            if writer.partner is not session:
                raise PairingError(
                    f"the client half that wrote DMB token {token:#x} did not read this server "
                    "half's token: the peer is not the other half of this connection"
                )
        else:
            if writer.partner is not None:
                raise PairingError(f"DMB token {token:#x}: its server half is paired already")
            if session.key is not None and writer.key is not None and session.key != writer.key:
                raise PairingError(
                    f"DMB token {token:#x} was written on another TCP connection than this one"
                )
            refused = self.policy(session, writer) if self.policy is not None else None
            if refused is not None:
                raise PairingError(f"pairing refused by policy: {refused}")
            writer.partner = session
            session.partner = writer
        del self._written[token]


class LoopbackSession:
    """The resources one CLC negotiation uses on the loopback device, bound to the connection's
    owner (uid from SO_PEERCRED) and its TCP addresses. Implements the negotiator's
    ``SmcdResources`` protocol."""

    def __init__(
        self,
        device: LoopbackIsm,
        uid: int,
        local: Any,
        peer: Any,
        *,
        server: bool,
        key: PairingKey | None = None,
        owner: Any = None,
    ) -> None:
        self.device = device
        self.uid = uid
        self.local = endpoint(local)
        self.peer = endpoint(peer)
        self.server = server
        self.key = key
        """The connection key both halves share (identity), or None (addresses)."""
        self.owner = owner
        """Who handed the connection over (credentials, namespace), for the policy."""
        self.partner: LoopbackSession | None = None
        """The other half, once the token exchange proved it (:meth:`LoopbackIsm.prove`)."""
        self._paired: bool | None = None

    def pairing_verified(self) -> bool:
        """Server: the client half of this connection is held here (claimed once, remembered)."""
        if self._paired is None:
            self._paired = self.device.pairing.claim_server(self.local, self.peer, key=self.key)
        return self._paired

    def pairing_confirmed(self) -> bool:
        """Client: a server half of this daemon claimed our half."""
        return self.device.pairing.claimed(self.local, self.peer, key=self.key)

    def find_link_group(self, peer_gid: int) -> int | None:
        return self.device.link_groups.find(peer_gid)

    def create_link_group(self, peer_gid: int) -> int:
        return self.device.link_groups.create(peer_gid)

    def discard_link_group(self, link_id: int) -> None:
        self.device.link_groups.discard(link_id)

    def register_dmb(self, size: int, min_size: int) -> DmbGrant:
        dmb = self.device.register_dmb(self.uid, size, min_size=min_size)
        self.device.wrote(dmb.token, self)
        return DmbGrant(dmb.token, dmb.size, dmb.size_comp)

    def unregister_dmb(self, token: int) -> None:
        self.device.forget(token)
        self.device.unregister_dmb(token)

    def attach_dmb(self, token: int) -> DmbGrant:
        self.device.prove(self, token)
        dmb = self.device.attach_dmb(token, self.uid)
        return DmbGrant(dmb.token, dmb.size, dmb.size_comp)

    def detach_dmb(self, token: int) -> None:
        self.device.detach_dmb(token)
