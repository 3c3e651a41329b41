"""The daemon's model of SMC state: link groups, links, connections and counters.

Everything an operator can ask about (``smcctl linkgroup``, ``smcctl conns``, ``smcctl stats``, the
D-Bus objects) is read from here, and everything that changes SMC state (the handoff server, the
CLC negotiator, the LLC link-group machine, the transports) writes here. Keeping it one pure model
with observers means the D-Bus adapter never has to be told separately: it subscribes and turns
each change into ``InterfacesAdded``/``PropertiesChanged``/``InterfacesRemoved``.

Records are frozen dataclasses; an update replaces a record with a new one, so an observer gets
both the old and the new snapshot and can compute exactly what changed. Names and value sets follow
the kernel's (``smc_core.h``, ``smc_diag.h``, the SMC_GEN_NETLINK attributes) and what smc-tools
prints, so an operator who knows ``smcr linkgroup show`` or ``smcss`` recognises every field.

Pure Python: no I/O, no asyncio. Observer exceptions are logged and swallowed, because one broken
observer must not leave the model half updated for the others.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum, StrEnum
from typing import Any, TypeVar

from smcd_daemon.errors import SmcError
from smcd_daemon.wire.cursor import Cursor

__all__ = [
    "LGR_ID_INCREMENT",
    "ChangeKind",
    "ConnMode",
    "ConnRole",
    "ConnState",
    "Connection",
    "FallbackCount",
    "LgrRole",
    "LgrType",
    "Link",
    "LinkGroup",
    "LinkState",
    "Record",
    "Registry",
    "RegistryError",
    "RegistryEvent",
    "SmcType",
    "Stats",
    "StatsSnapshot",
]

_log = logging.getLogger(__name__)

LGR_ID_INCREMENT = 256
"""The kernel numbers link groups in steps of 256 (``SMC_LGR_NUM_INCR``): the low byte of a link
group id is 0 so that ``lgr id | link id`` forms a link's UID prefix. We do the same so ids look
familiar next to the kernel's."""


class RegistryError(SmcError):
    """A registry request that contradicts the model: unknown id, duplicate id, bad field."""


class LgrRole(StrEnum):
    """Who created the link group (smc-tools "LG-Role")."""

    SERV = "SERV"
    CLNT = "CLNT"


class SmcType(StrEnum):
    """The SMC variant of a link group."""

    SMCD = "SMC-D"
    SMCR = "SMC-R"


class LgrType(StrEnum):
    """Redundancy of an SMC-R link group (``enum smc_lgr_type``; smc-tools "LG-Type").

    SMC-D link groups are always NONE: they have no links to fail over between.
    """

    NONE = "NONE"
    SINGLE = "SINGLE"  # one link, no alternative: a failure ends the link group
    SYM = "SYM"  # two links over two RoCE devices on both sides
    ASYMP = "ASYMP"  # asymmetric: the peer has a single device
    ASYML = "ASYML"  # asymmetric: we have a single device


class LinkState(StrEnum):
    """State of one SMC-R link (``enum smc_link_state``; smc-tools "Link-State")."""

    LINK_UNUSED = "LINK_UNUSED"
    INACTIVE = "INACTIVE"
    ACTIVATING = "ACTIVATING"
    ACTIVE = "ACTIVE"


class ConnMode(StrEnum):
    """How a connection moves data (``smc_diag`` modes as ``smcss`` prints them)."""

    SMCD = "SMCD"
    SMCR = "SMCR"
    TCP = "TCP"  # fell back (or never left) TCP; see Connection.fallback_reason


class ConnRole(StrEnum):
    """Which side of the CLC handshake we are; fallback counters are kept per role."""

    CLIENT = "CLIENT"
    SERVER = "SERVER"


class ConnState(StrEnum):
    """Socket state of an SMC connection (``enum smc_state`` in ``net/smc/smc.h``)."""

    INIT = "INIT"
    LISTEN = "LISTEN"
    ACTIVE = "ACTIVE"
    PEERCLOSEWAIT1 = "PEERCLOSEWAIT1"
    PEERCLOSEWAIT2 = "PEERCLOSEWAIT2"
    APPFINCLOSEWAIT = "APPFINCLOSEWAIT"
    APPCLOSEWAIT1 = "APPCLOSEWAIT1"
    APPCLOSEWAIT2 = "APPCLOSEWAIT2"
    PEERFINCLOSEWAIT = "PEERFINCLOSEWAIT"
    PEERABORTWAIT = "PEERABORTWAIT"
    PROCESSABORT = "PROCESSABORT"
    CLOSED = "CLOSED"


@dataclass(frozen=True)
class LinkGroup:
    """One link group: the peer-to-peer relationship that SMC connections share.

    For SMC-D the GIDs are the ISM GIDs (8 bytes, or 16 with the v2.1 extended GID) and ``chid``
    names the ISM channel (0xFFFF for loopback-ism); for SMC-R the per-link GIDs live on
    :class:`Link` and ``peer_system_id`` identifies the peer host. ``conns`` is maintained by the
    registry from the connections that name this link group; do not set it yourself.
    """

    lgr_id: int
    role: LgrRole
    smc_type: SmcType
    lgr_type: LgrType = LgrType.NONE
    local_gid: bytes = b""
    peer_gid: bytes = b""
    peer_system_id: bytes = b""
    chid: int = 0
    vlan_id: int = 0
    pnetid: str = ""
    pnetid_by_user: bool = False
    netdev: str = ""
    conns: int = 0
    max_conns: int = 255
    max_links: int = 2
    smc_version: int = 1
    smc_release: int = 0
    peer_os: int = 0
    peer_hostname: str = ""
    negotiated_eid: str = ""
    direct: bool = True
    sndbuf_alloc: int = 0
    rmb_alloc: int = 0


@dataclass(frozen=True)
class Link:
    """One SMC-R link (an RC QP pair between a local and a peer RoCE port) of a link group."""

    lgr_id: int
    link_id: int
    state: LinkState = LinkState.LINK_UNUSED
    link_uid: bytes = b""
    peer_link_uid: bytes = b""
    ibdev: str = ""
    ibport: int = 0
    netdev: str = ""
    gid: bytes = b""
    peer_gid: bytes = b""
    qpn: int = 0
    peer_qpn: int = 0
    mtu: int = 0  # path MTU in bytes (256..4096), as negotiated in CLC
    conns: int = 0


@dataclass(frozen=True)
class Connection:
    """One application connection the daemon handles (SMC, or TCP after a fallback).

    ``inode`` is the identity ``smcss`` shows: here the inode of the application's TCP socket as
    the handoff saw it. Cursors are those of the CDC (``smc_diag_conninfo``):
    ``rx_prod``/``rx_cons`` for our RMB/DMB, ``tx_prod``/``tx_cons`` for the peer's.
    ``fallback_reason`` and ``peer_diagnosis`` are CLC decline codes (0: none), as in
    ``smc_diag_fallback``.
    """

    conn_id: int
    role: ConnRole
    mode: ConnMode = ConnMode.TCP
    state: ConnState = ConnState.INIT
    local_addr: str = ""
    local_port: int = 0
    peer_addr: str = ""
    peer_port: int = 0
    netdev: str = ""
    uid: int = 0
    pid: int = 0
    inode: int = 0
    token: int = 0
    lgr_id: int | None = None
    link_id: int | None = None
    sndbuf_size: int = 0
    rmbe_size: int = 0
    peer_rmbe_size: int = 0
    rx_prod: Cursor = field(default_factory=Cursor)
    rx_cons: Cursor = field(default_factory=Cursor)
    tx_prod: Cursor = field(default_factory=Cursor)
    tx_cons: Cursor = field(default_factory=Cursor)
    bytes_sent: int = 0
    bytes_received: int = 0
    fallback_reason: int = 0
    peer_diagnosis: int = 0
    netns: str = ""
    """The network namespace of the process that handed the connection over, when it is not
    smcd's own: its inode and the name ``ip netns`` gives it (#15)."""


Record = LinkGroup | Link | Connection
_R = TypeVar("_R", LinkGroup, Link, Connection)


class ChangeKind(Enum):
    ADDED = "added"
    CHANGED = "changed"
    REMOVED = "removed"


@dataclass(frozen=True)
class RegistryEvent:
    """One change: ``old`` is None for ADDED, ``new`` is None for REMOVED."""

    kind: ChangeKind
    old: Record | None
    new: Record | None

    @property
    def record(self) -> Record:
        """The record the event is about (the new one, or the removed one)."""
        rec = self.new if self.new is not None else self.old
        assert rec is not None
        return rec

    def changed_fields(self) -> frozenset[str]:
        """Names of the fields that differ between ``old`` and ``new`` (CHANGED only)."""
        if self.old is None or self.new is None:
            return frozenset()
        return frozenset(
            f.name
            for f in dataclasses.fields(self.new)
            if getattr(self.old, f.name) != getattr(self.new, f.name)
        )


Observer = Callable[[RegistryEvent], None]


@dataclass(frozen=True)
class FallbackCount:
    """How often one reason made connections fall back, per role (``GET_FBACK_STATS``)."""

    server: int = 0
    client: int = 0


@dataclass(frozen=True)
class StatsSnapshot:
    """Counters at one moment. ``counters`` keys are stable, dotted names (see :class:`Stats`)."""

    counters: Mapping[str, int]
    fallbacks: Mapping[int, FallbackCount]
    generation: int


def _counter_names() -> tuple[str, ...]:
    names: list[str] = []
    for tech in ("smcd", "smcr"):
        for role in ("server", "client"):
            names += [f"{tech}.{role}.v1", f"{tech}.{role}.v2", f"{tech}.{role}.handshake_errors"]
        names += [f"{tech}.tx_bytes", f"{tech}.rx_bytes", f"{tech}.tx_calls", f"{tech}.rx_calls"]
    names += ["fallback.server", "fallback.client", "connections.total"]
    return tuple(names)


COUNTER_NAMES = _counter_names()

_TECHS: dict[str, str] = {
    SmcType.SMCD: "smcd", ConnMode.SMCD: "smcd", SmcType.SMCR: "smcr", ConnMode.SMCR: "smcr",
}  # fmt: skip
"""The counters' technology names (:meth:`Stats._tech` of the valid arguments)."""
_BYTE_KEYS = {
    kind: (f"{tech}.tx_bytes", f"{tech}.tx_calls", f"{tech}.rx_bytes", f"{tech}.rx_calls")
    for kind, tech in _TECHS.items()
}
_CONNECTION_KEYS = {
    (kind, role, version): f"{tech}.{role.value.lower()}.v{version}"
    for kind, tech in _TECHS.items()
    for role in ConnRole
    for version in (1, 2)
}
"""The counter each valid (technology, role, version) of :meth:`Stats.count_connection` bumps:
every connection's counters without building their names."""


class Stats:
    """Counters as ``smcd stats`` shows them: SMC connections per technology, role and version,
    handshake errors, bytes, and TCP fallbacks by reason code and role.

    Counter names: ``smcd|smcr`` . ``server|client`` . ``v1|v2|handshake_errors``;
    ``smcd|smcr`` . ``tx_bytes|rx_bytes|tx_calls|rx_calls``; ``fallback.server|client``;
    ``connections.total``. Every name exists from the start (value 0), so a client can rely on the
    key set. ``generation`` goes up on every reset, so a reader can tell "reset" from "quiet".
    Observers are told after every change (with no argument: counters change too often to diff).
    """

    def __init__(self) -> None:
        self._counters: dict[str, int] = dict.fromkeys(COUNTER_NAMES, 0)
        self._fallbacks: dict[int, FallbackCount] = {}
        self._generation = 0
        self._observers: list[Callable[[], None]] = []

    @staticmethod
    def _tech(smc_type: SmcType | ConnMode) -> str:
        if smc_type in (SmcType.SMCD, ConnMode.SMCD):
            return "smcd"
        if smc_type in (SmcType.SMCR, ConnMode.SMCR):
            return "smcr"
        raise RegistryError(f"stats: {smc_type!r} is not an SMC technology (SMC-D or SMC-R)")

    def count_connection(self, smc_type: SmcType | ConnMode, role: ConnRole, version: int) -> None:
        """An SMC connection was established with this technology and SMC version."""
        key = _CONNECTION_KEYS.get((smc_type, role, version))
        if key is None:
            if version not in (1, 2):
                raise RegistryError(f"stats: SMC version {version!r} is not 1 or 2")
            key = f"{self._tech(smc_type)}.{role.value.lower()}.v{version}"
        counters = self._counters
        counters[key] += 1
        counters["connections.total"] += 1
        self._notify()

    def count_handshake_error(self, smc_type: SmcType | ConnMode, role: ConnRole) -> None:
        """A CLC/LLC handshake failed after the technology was chosen."""
        self._bump({f"{self._tech(smc_type)}.{role.value.lower()}.handshake_errors": 1})

    def count_fallback(self, reason: int, role: ConnRole) -> None:
        """A connection stayed on (or went back to) TCP for ``reason``."""
        if not 0 <= reason <= 0xFFFFFFFF:
            raise RegistryError(f"stats: fallback reason {reason!r} is not a 32-bit code")
        old = self._fallbacks.get(reason, FallbackCount())
        if role is ConnRole.SERVER:
            self._fallbacks[reason] = FallbackCount(old.server + 1, old.client)
        else:
            self._fallbacks[reason] = FallbackCount(old.server, old.client + 1)
        self._bump({f"fallback.{role.value.lower()}": 1, "connections.total": 1})

    def add_bytes(self, smc_type: SmcType | ConnMode, *, tx: int = 0, rx: int = 0) -> None:
        """Payload moved over SMC (one call per send/receive request)."""
        if tx < 0 or rx < 0:
            raise RegistryError("stats: byte counts cannot be negative")
        keys = _BYTE_KEYS.get(smc_type)
        if keys is None:
            self._tech(smc_type)  # raises: not an SMC technology
            return
        if not tx and not rx:
            return
        counters = self._counters
        if tx:
            counters[keys[0]] += tx
            counters[keys[1]] += 1
        if rx:
            counters[keys[2]] += rx
            counters[keys[3]] += 1
        self._notify()

    def reset(self) -> None:
        """Zero everything (``smcd stats reset``)."""
        self._counters = dict.fromkeys(COUNTER_NAMES, 0)
        self._fallbacks = {}
        self._generation += 1
        self._notify()

    def snapshot(self) -> StatsSnapshot:
        return StatsSnapshot(dict(self._counters), dict(self._fallbacks), self._generation)

    def subscribe(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call ``callback()`` after every change; returns a function that unsubscribes."""
        self._observers.append(callback)
        return lambda: self._observers.remove(callback) if callback in self._observers else None

    def _bump(self, delta: Mapping[str, int]) -> None:
        for key, n in delta.items():
            self._counters[key] += n
        self._notify()

    def _notify(self) -> None:
        if not self._observers:
            return
        for cb in tuple(self._observers):
            try:
                cb()
            except Exception:
                _log.exception("stats observer %r failed", cb)


def _check_u32(what: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 0xFFFFFFFF:
        raise RegistryError(f"{what} {value!r} is not a 32-bit unsigned number")


class Registry:
    """The live link groups, links and connections, plus :class:`Stats`.

    Writers call ``add_*``/``update_*``/``remove_*``; each call notifies every observer
    synchronously with one :class:`RegistryEvent` per record that changed (removing a link group
    also removes its links first; adding or removing a connection updates its link group's and
    link's ``conns``). Readers use the query methods, which return immutable snapshots.
    """

    def __init__(self, stats: Stats | None = None) -> None:
        self.stats = stats if stats is not None else Stats()
        self._lgrs: dict[int, LinkGroup] = {}
        self._links: dict[tuple[int, int], Link] = {}
        self._conns: dict[int, Connection] = {}
        self._observers: list[Observer] = []
        self._next_lgr = LGR_ID_INCREMENT
        self._next_conn = 1

    # -- observers -------------------------------------------------------------------------------

    def subscribe(self, callback: Observer) -> Callable[[], None]:
        """Call ``callback(event)`` after every change; returns a function that unsubscribes."""
        self._observers.append(callback)
        return lambda: self._observers.remove(callback) if callback in self._observers else None

    def _emit(self, kind: ChangeKind, old: Record | None, new: Record | None) -> None:
        event = RegistryEvent(kind, old, new)
        for cb in tuple(self._observers):
            try:
                cb(event)
            except Exception:
                _log.exception("registry observer %r failed on %s", cb, kind.value)

    # -- ids -------------------------------------------------------------------------------------

    def allocate_lgr_id(self) -> int:
        """A fresh link group id (multiples of 256, as the kernel's)."""
        while self._next_lgr in self._lgrs:
            self._next_lgr += LGR_ID_INCREMENT
        lgr_id = self._next_lgr
        self._next_lgr = (self._next_lgr + LGR_ID_INCREMENT) & 0xFFFFFF00 or LGR_ID_INCREMENT
        return lgr_id

    def allocate_conn_id(self) -> int:
        """A fresh connection id (never reused while the daemon runs, so D-Bus paths stay
        unambiguous for clients that remember them)."""
        conn_id = self._next_conn
        self._next_conn += 1
        return conn_id

    # -- queries ---------------------------------------------------------------------------------

    def link_groups(self) -> tuple[LinkGroup, ...]:
        return tuple(self._lgrs.values())

    def link_group(self, lgr_id: int) -> LinkGroup | None:
        return self._lgrs.get(lgr_id)

    def links(self, lgr_id: int | None = None) -> tuple[Link, ...]:
        return tuple(lk for lk in self._links.values() if lgr_id is None or lk.lgr_id == lgr_id)

    def link(self, lgr_id: int, link_id: int) -> Link | None:
        return self._links.get((lgr_id, link_id))

    def connections(self) -> tuple[Connection, ...]:
        return tuple(self._conns.values())

    def connection(self, conn_id: int) -> Connection | None:
        return self._conns.get(conn_id)

    # -- link groups -----------------------------------------------------------------------------

    def add_link_group(self, lgr: LinkGroup) -> LinkGroup:
        _check_u32("link group id", lgr.lgr_id)
        if lgr.lgr_id in self._lgrs:
            raise RegistryError(f"link group {lgr.lgr_id:#010x} already exists")
        lgr = dataclasses.replace(lgr, conns=self._count_conns(lgr.lgr_id))
        self._lgrs[lgr.lgr_id] = lgr
        self._emit(ChangeKind.ADDED, None, lgr)
        return lgr

    def update_link_group(self, lgr_id: int, **changes: Any) -> LinkGroup:
        if "conns" in changes or "lgr_id" in changes:
            raise RegistryError("link group conns and lgr_id are maintained by the registry")
        old = self._get_lgr(lgr_id)
        return self._replace_lgr(old, _replace(old, changes))

    def remove_link_group(self, lgr_id: int) -> LinkGroup:
        """Remove a link group and its links. Connections keep their (now dangling) ``lgr_id``
        until they are removed themselves: the kernel, too, lets sockets outlive their lgr."""
        old = self._get_lgr(lgr_id)
        for link in self.links(lgr_id):
            self.remove_link(lgr_id, link.link_id)
        del self._lgrs[lgr_id]
        self._emit(ChangeKind.REMOVED, old, None)
        return old

    # -- links -----------------------------------------------------------------------------------

    def add_link(self, link: Link) -> Link:
        self._get_lgr(link.lgr_id)
        if not 0 <= link.link_id <= 0xFF:
            raise RegistryError(f"link id {link.link_id!r} is not a u8")
        key = (link.lgr_id, link.link_id)
        if key in self._links:
            raise RegistryError(f"link {link.link_id} of link group {link.lgr_id:#010x} exists")
        link = dataclasses.replace(link, conns=self._count_conns(link.lgr_id, link.link_id))
        self._links[key] = link
        self._emit(ChangeKind.ADDED, None, link)
        return link

    def update_link(self, lgr_id: int, link_id: int, **changes: Any) -> Link:
        if {"conns", "lgr_id", "link_id"} & changes.keys():
            raise RegistryError("link conns, lgr_id and link_id are maintained by the registry")
        old = self._get_link(lgr_id, link_id)
        new = _replace(old, changes)
        if new != old:
            self._links[(lgr_id, link_id)] = new
            self._emit(ChangeKind.CHANGED, old, new)
        return new

    def set_link_state(self, lgr_id: int, link_id: int, state: LinkState) -> Link:
        return self.update_link(lgr_id, link_id, state=LinkState(state))

    def remove_link(self, lgr_id: int, link_id: int) -> Link:
        old = self._get_link(lgr_id, link_id)
        del self._links[(lgr_id, link_id)]
        self._emit(ChangeKind.REMOVED, old, None)
        return old

    # -- connections -----------------------------------------------------------------------------

    def add_connection(self, conn: Connection) -> Connection:
        if conn.conn_id in self._conns:
            raise RegistryError(f"connection {conn.conn_id} already exists")
        if conn.conn_id <= 0:
            raise RegistryError(f"connection id {conn.conn_id!r} must be positive")
        self._check_conn_refs(conn)
        self._conns[conn.conn_id] = conn
        self._emit(ChangeKind.ADDED, None, conn)
        self._recount(None, conn)
        self._count_fallback(None, conn)
        return conn

    def update_connection(self, conn_id: int, **changes: Any) -> Connection:
        if "conn_id" in changes:
            raise RegistryError("a connection's id cannot change")
        old = self._get_conn(conn_id)
        new = _replace(old, changes)
        if new == old:
            return new
        self._check_conn_refs(new)
        self._conns[conn_id] = new
        self._emit(ChangeKind.CHANGED, old, new)
        self._recount(old, new)
        self._count_fallback(old, new)
        return new

    def fall_back(self, conn_id: int, reason: int, peer_diagnosis: int = 0) -> Connection:
        """Record that a connection uses TCP for ``reason`` (and the peer's diagnosis, if it
        declined); counts the fallback in :attr:`stats`. Mode becomes TCP, the link group
        reference is dropped (a fallen-back connection holds no SMC resources)."""
        _check_u32("fallback reason", reason)
        _check_u32("peer diagnosis", peer_diagnosis)
        return self.update_connection(
            conn_id,
            mode=ConnMode.TCP,
            fallback_reason=reason,
            peer_diagnosis=peer_diagnosis,
            lgr_id=None,
            link_id=None,
        )

    def remove_connection(self, conn_id: int) -> Connection:
        old = self._get_conn(conn_id)
        del self._conns[conn_id]
        self._emit(ChangeKind.REMOVED, old, None)
        self._recount(old, None)
        return old

    # -- internals -------------------------------------------------------------------------------

    def _get_lgr(self, lgr_id: int) -> LinkGroup:
        try:
            return self._lgrs[lgr_id]
        except KeyError:
            raise RegistryError(f"no link group {lgr_id!r}") from None

    def _get_link(self, lgr_id: int, link_id: int) -> Link:
        try:
            return self._links[(lgr_id, link_id)]
        except KeyError:
            raise RegistryError(f"no link {link_id!r} in link group {lgr_id!r}") from None

    def _get_conn(self, conn_id: int) -> Connection:
        try:
            return self._conns[conn_id]
        except KeyError:
            raise RegistryError(f"no connection {conn_id!r}") from None

    def _check_conn_refs(self, conn: Connection) -> None:
        if conn.lgr_id is not None:
            self._get_lgr(conn.lgr_id)
            if conn.link_id is not None:
                self._get_link(conn.lgr_id, conn.link_id)
        elif conn.link_id is not None:
            raise RegistryError(f"connection {conn.conn_id} names a link but no link group")

    def _count_conns(self, lgr_id: int, link_id: int | None = None) -> int:
        return sum(
            1
            for c in self._conns.values()
            if c.lgr_id == lgr_id and (link_id is None or c.link_id == link_id)
        )

    def _replace_lgr(self, old: LinkGroup, new: LinkGroup) -> LinkGroup:
        if new != old:
            self._lgrs[old.lgr_id] = new
            self._emit(ChangeKind.CHANGED, old, new)
        return new

    def _count_fallback(self, old: Connection | None, new: Connection) -> None:
        """Count a fallback once, when a connection first shows a (new) fallback reason."""
        if new.mode is not ConnMode.TCP or not new.fallback_reason:
            return
        if (
            old is not None
            and old.mode is ConnMode.TCP
            and old.fallback_reason == new.fallback_reason
        ):
            return
        self.stats.count_fallback(new.fallback_reason, new.role)

    def _recount(self, old: Connection | None, new: Connection | None) -> None:
        """Keep ``conns`` of the link groups and links a connection moved between up to date."""
        lgr_ids = {c.lgr_id for c in (old, new) if c is not None and c.lgr_id is not None}
        link_keys = {
            (c.lgr_id, c.link_id)
            for c in (old, new)
            if c is not None and c.lgr_id is not None and c.link_id is not None
        }
        for lgr_id in lgr_ids:
            lgr = self._lgrs.get(lgr_id)
            if lgr is not None:
                self._replace_lgr(lgr, dataclasses.replace(lgr, conns=self._count_conns(lgr_id)))
        for lgr_id, link_id in link_keys:
            link = self._links.get((lgr_id, link_id))
            if link is not None:
                new_link = dataclasses.replace(link, conns=self._count_conns(lgr_id, link_id))
                if new_link != link:
                    self._links[(lgr_id, link_id)] = new_link
                    self._emit(ChangeKind.CHANGED, link, new_link)


def _replace(record: _R, changes: Mapping[str, Any]) -> _R:
    names = {f.name for f in dataclasses.fields(record)}
    unknown = set(changes) - names
    if unknown:
        raise RegistryError(
            f"{type(record).__name__} has no field(s) {', '.join(sorted(unknown))}; "
            f"fields are {', '.join(sorted(names))}"
        )
    return dataclasses.replace(record, **changes)
