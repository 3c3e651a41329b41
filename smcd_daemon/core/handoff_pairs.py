"""The life of a handed-off SMC-D connection as the daemon tracks it, without sockets or timers.

Both halves of one TCP connection hand their sockets to the daemon separately and meet in a
:class:`Pair`, keyed by the connection's 4-tuple (client local, client peer) and checked by the
two DMB tokens each half negotiated. The pair owns what the two halves share (eventfds and the
peer-link socketpair); the handoff adapter holds those descriptors in :attr:`Pair.res` and this
module only says *when* to close them, as :data:`Effect` values the adapter carries out:

- a half that was sent its descriptors no longer needs the daemon's copy of its peer-link end
  (:class:`CloseLink`); once both halves have theirs the daemon closes its copies of the shared
  descriptors (:class:`CloseShared`);
- a pair whose second half will not come (the other half fell back, or never arrived) is
  *dropped*: its shared descriptors close, so the first half sees its peer link hang up (an
  abort, never a hang);
- a half that hangs up lets go of its DMB (unregister) and its reference on the peer's (detach);
  while its pair may still be used, those releases wait in the pair, and the pool takes the
  buffers back (:class:`ReleaseDmbs`) only when nobody can use the pair any more: no half is
  still to come and every half that took its descriptors has let go. (A client may close before
  the server half has even attached its DMB.)

Listeners registered over the handoff socket (LISTEN) are kept here too: they decide whether SMC
is tried toward a peer at all.
"""

from __future__ import annotations

import enum
import ipaddress
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from smcd_daemon.core.registry import ConnRole
from smcd_daemon.errors import SmcError

__all__ = [
    "CloseLink",
    "CloseShared",
    "DmbOp",
    "DmbRelease",
    "Effect",
    "Half",
    "IpAddress",
    "Listener",
    "ListenerTable",
    "Pair",
    "PairKey",
    "PairMismatchError",
    "PairTable",
    "ReleaseDmbs",
    "other_role",
]

IpAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
Address = tuple[IpAddress, int, int]
"""(address, port, IPv6 scope id), as ``smcd_daemon.transport.loopback.endpoint`` normalises."""
PairKey = tuple[Address, Address] | tuple[int, int]
"""(client local, client peer): both halves spell their connection this way."""


def other_role(role: ConnRole) -> ConnRole:
    return ConnRole.SERVER if role is ConnRole.CLIENT else ConnRole.CLIENT


class PairMismatchError(SmcError):
    """A half that cannot join the pair waiting under its 4-tuple (other DMB tokens, or a second
    half of the same role)."""


class DmbOp(enum.Enum):
    UNREGISTER = "unregister"  # the half's own receive DMB
    DETACH = "detach"  # the half's reference on the peer's DMB


class DmbRelease(NamedTuple):
    """One reference to give back. The effects are named tuples: immutable like frozen
    dataclasses, built in one call instead of one per field (several per connection)."""

    op: DmbOp
    token: int


@dataclass(eq=False)
class Pair:
    """What the two halves of one SMC-D connection share (see the module docstring)."""

    key: PairKey
    tokens: tuple[int, int]  # (client DMB token, server DMB token)
    res: Any = None
    """The adapter's descriptors (eventfds, peer-link ends, DMB memfds); never looked at here
    (typed by the adapter, which reads it several times per connection without a check)."""
    taken: set[ConnRole] = field(default_factory=set)
    """Halves that were sent their descriptors."""
    released: set[ConnRole] = field(default_factory=set)
    """Halves that let go (hung up, or failed before their reply)."""
    pending: list[DmbRelease] = field(default_factory=list)
    """DMB releases of halves that let go while the pair could still be used."""
    complete: bool = False
    """Both halves were sent their descriptors (:meth:`PairTable.hand_out` keeps it; asked
    several times per connection, so kept rather than counted)."""


@dataclass(eq=False)
class Half:
    """One application's half of an SMC-D connection. ``local_token``/``peer_token`` are None once
    released, or for a resumed record (the daemon holds no DMB of it)."""

    conn_id: int
    role: ConnRole
    uid: int
    local_token: int | None
    peer_token: int | None
    rx_size: int
    tx_size: int
    pair: Pair | None = None
    # What the cursor refresh saw last (the DMB observer's state for this half).
    rx_cons: tuple[int, int] = (0, 0)  # (wrap, count)
    tx_prod: tuple[int, int] = (0, 0)
    seen: tuple[tuple[int, ...], tuple[int, ...]] | None = None  # header words last read
    closed: bool = False  # the application said CLOSE: its counters are final


class CloseLink(NamedTuple):
    """Close the daemon's copy of ``role``'s peer-link end: that half has its own now."""

    pair: Pair
    role: ConnRole


class CloseShared(NamedTuple):
    """Close the daemon's copies of the pair's eventfds and of every peer-link end it still
    holds, and stop waiting for a second half. Repeating it is harmless."""

    pair: Pair


class ReleaseDmbs(NamedTuple):
    """Give these DMB references back to the pool (in order)."""

    releases: tuple[DmbRelease, ...]


Effect = CloseLink | CloseShared | ReleaseDmbs


class PairTable:
    """Pairs still open to a second half, by 4-tuple, and the transitions of every pair.

    A pair leaves the table when it is complete and a new connection reuses its 4-tuple, when it
    is dropped, or when it is done; a complete pair that left the table lives on in its halves
    until both have let go.
    """

    def __init__(self) -> None:
        self._open: dict[PairKey, Pair] = {}

    def __len__(self) -> int:
        return len(self._open)

    def __iter__(self) -> Iterator[Pair]:
        return iter(list(self._open.values()))

    def get(self, key: PairKey) -> Pair | None:
        return self._open.get(key)

    def is_current(self, pair: Pair) -> bool:
        return self._open.get(pair.key) is pair

    def claim(self, key: PairKey, tokens: tuple[int, int], role: ConnRole) -> Pair | None:
        """The pair a half with these DMB tokens joins, or None when it is the first half (the
        caller then :meth:`open` s one). A complete pair under the key is an earlier connection
        on this 4-tuple, still draining: it leaves the table (its halves keep it)."""
        pair = self._open.get(key)
        if pair is not None and pair.complete:
            del self._open[key]
            return None
        if pair is not None and (pair.tokens != tokens or role in pair.taken):
            raise PairMismatchError(f"pairing {key} does not match the tokens of this half")
        return pair

    def open(self, key: PairKey, tokens: tuple[int, int], res: Any = None) -> Pair:
        """Enter the pair of a first half (the adapter made its shared descriptors ``res``)."""
        if key in self._open:
            raise PairMismatchError(f"pairing {key} is already open")
        pair = Pair(key, tokens, res)
        self._open[key] = pair
        return pair

    @staticmethod
    def join(half: Half, pair: Pair) -> None:
        """``half`` belongs to ``pair`` from now on (its release goes through the pair)."""
        half.pair = pair

    def hand_out(self, pair: Pair, role: ConnRole) -> list[Effect]:
        """``role`` was sent its descriptors (or lost them with its connection): the daemon's
        copy of its link end goes; with both halves served, the shared copies go too."""
        taken = pair.taken
        taken.add(role)
        if len(taken) == 2:
            pair.complete = True
            return [CloseLink(pair, role), CloseShared(pair)]
        return [CloseLink(pair, role)]

    def drop(self, key: PairKey) -> list[Effect] | None:
        """Forget the pair under ``key`` whose second half will not come; None if there is none
        to drop (no pair, or it is complete)."""
        pair = self._open.get(key)
        if pair is None or pair.complete:
            return None
        del self._open[key]
        return self._done(pair) or [CloseShared(pair)]

    def release(self, half: Half) -> list[Effect]:
        """``half`` lets go of its DMB and of its reference on the peer's; the pool gets them
        back once the pair is done (at once if the half never joined a pair)."""
        ops: list[DmbRelease] = []
        if half.local_token is not None:
            ops.append(DmbRelease(DmbOp.UNREGISTER, half.local_token))
        if half.peer_token is not None:
            ops.append(DmbRelease(DmbOp.DETACH, half.peer_token))
        half.local_token = half.peer_token = None
        pair = half.pair
        if pair is None:
            return [ReleaseDmbs(tuple(ops))] if ops else []
        half.pair = None
        pair.pending.extend(ops)
        pair.released.add(half.role)
        return self._done(pair)

    def _done(self, pair: Pair) -> list[Effect]:
        """Close a pair for good once nobody can use it any more: no half is still to come (both
        took theirs, or it was dropped) and every half that took one has let go."""
        current = self.is_current(pair)
        if not ((pair.complete or not current) and pair.released >= pair.taken):
            return []
        if current:
            del self._open[pair.key]
        effects: list[Effect] = [CloseShared(pair)]
        ops, pair.pending = pair.pending, []
        if ops:
            effects.append(ReleaseDmbs(tuple(ops)))
        return effects

    def clear(self) -> list[Pair]:
        """Forget every open pair (the server stops); the caller closes what they hold."""
        pairs = list(self._open.values())
        self._open.clear()
        return pairs


# -- listeners --------------------------------------------------------------------------------


@dataclass(eq=False)
class Listener:
    """A listening TCP socket an application registered (LISTEN): peers connecting to it speak
    SMC. It lives exactly as long as the handoff connection that registered it."""

    ident: int
    ip: IpAddress
    port: int
    uid: int
    conn_id: int
    pid: int = 0
    """The process that registered it (its ``/proc/<pid>/net`` shows the listener's namespace)."""
    netns: int = 0
    """Inode of the listener's network namespace (0: unknown, taken as the daemon's)."""


class ListenerTable:
    """The registered listeners, and whether a peer address is one of them."""

    def __init__(self) -> None:
        self._by_ident: dict[int, Listener] = {}
        self._by_port: dict[int, dict[int, Listener]] = {}
        """The same listeners by port, then ident (registration order): a handoff looks at the
        listeners of its peer's port only."""
        self._netns: dict[int, int] = {}  # listeners per namespace inode (0: unknown)
        self._next = 1

    def __len__(self) -> int:
        return len(self._by_ident)

    def __iter__(self) -> Iterator[Listener]:
        return iter(list(self._by_ident.values()))

    def add(
        self, ip: IpAddress, port: int, uid: int, conn_id: int, *, pid: int = 0, netns: int = 0
    ) -> Listener:
        lst = Listener(self._next, ip, port, uid, conn_id, pid, netns)
        self._next += 1
        self._by_ident[lst.ident] = lst
        self._by_port.setdefault(port, {})[lst.ident] = lst
        self._netns[netns] = self._netns.get(netns, 0) + 1
        return lst

    def remove(self, lst: Listener) -> bool:
        """Forget ``lst``; False if it was not registered (any more)."""
        if self._by_ident.pop(lst.ident, None) is None:
            return False
        same_port = self._by_port.get(lst.port)
        if same_port is not None:
            same_port.pop(lst.ident, None)
            if not same_port:
                del self._by_port[lst.port]
        left = self._netns.get(lst.netns, 0) - 1
        if left > 0:
            self._netns[lst.netns] = left
        else:
            self._netns.pop(lst.netns, None)
        return True

    def in_other_netns(self, own: int) -> bool:
        """Is a listener registered from a network namespace other than ``own`` (known ones
        only)? Asked by every handoff whose peer is no listener: counted, not searched."""
        return any(ns and ns != own for ns in self._netns)

    def why_smc(
        self,
        ip: IpAddress,
        port: int,
        is_local: Callable[[IpAddress], bool],
        local_to: Callable[[Listener, IpAddress], bool] | None = None,
    ) -> str | None:
        """Why a peer at ``ip``/``port`` speaks SMC (a listener registered on it), or None.
        A wildcard listener matches an address of this host (``is_local`` says which), or of
        the listener's own network namespace when ``local_to`` is given."""
        same_port = self._by_port.get(port)
        if same_port is None:
            return None
        for lst in same_port.values():
            if lst.ip == ip:
                return f"registered listener {lst.ident}"
            if lst.ip.is_unspecified and (
                local_to(lst, ip) if local_to is not None else is_local(ip)
            ):
                return f"registered listener {lst.ident} (wildcard)"
        return None
