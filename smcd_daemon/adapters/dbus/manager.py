"""``org.smcd.Manager1`` at ``/org/smcd``: the daemon-wide methods, properties and signals.

Methods mirror the smc-tools commands an operator knows (``smc_pnet``, ``smcd ueid``/``seid``,
``smcd stats``, ``smcd info``). Reading is open to everybody; every method that changes state is
refused to anybody but root twice: by the bus policy
(``config/dbus-1/system.d/org.smcd.conf``) on the system bus, and here, by asking the bus for the
caller's uid, so a session or private bus (which has no such policy) is safe too.

Rule violations from the tables (:class:`PnetError`, :class:`EidError`) become
``org.smcd.Error.Invalid`` carrying the table's own message, which already says what was wrong and
what is allowed; the CLI prints it as is.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Awaitable, Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar

from dbus_fast import DBusError, Variant
from dbus_fast.aio import MessageBus
from dbus_fast.annotations import DBusSignature, DBusStr, DBusUInt32
from dbus_fast.service import dbus_method, dbus_signal

import smcd_daemon
from smcd_daemon.adapters.netns_view import pnet_netns
from smcd_daemon.core.eid import EidError, EidTable
from smcd_daemon.core.pnet import PnetEntry, PnetError, PnetTable
from smcd_daemon.core.registry import Stats
from smcd_daemon.errors import SmcError

from .bus import BusError, caller_unix_user, current_caller
from .names import ERROR_ACCESS_DENIED, ERROR_FAILED, ERROR_INVALID, MANAGER_INTERFACE
from .objects import DeviceObject, RecordInterface, with_properties

__all__ = ["Manager", "ServiceInfo", "pnet_entry_ns_struct", "pnet_entry_struct"]

PnetStructs = Annotated[list[tuple[str, str, str, int]], DBusSignature("a(sssy)")]
PnetNsStructs = Annotated[list[tuple[str, str, str, int, str]], DBusSignature("a(sssys)")]
StrList = Annotated[list[str], DBusSignature("as")]
StatsOut = Annotated[
    tuple[dict[str, int], list[tuple[int, int, int]]], DBusSignature("a{st}a(utt)")
]
InfoDict = Annotated[dict[str, Variant], DBusSignature("a{sv}")]
PortArg = Annotated[int, DBusSignature("y")]
LinkStateArgs = Annotated[tuple[str, str, str], DBusSignature("oss")]
FallbackArgs = Annotated[tuple[str, int, int, str], DBusSignature("ouus")]
NamespaceRow = tuple[int, str, bool, list[dict[str, Any]], str]
"""One network namespace: (inode, name, smcd's own?, its devices as Device1 values, problem)."""
NamespaceRows = Annotated[list[tuple[Any, ...]], DBusSignature("a(tsbaa{sv}s)")]

SMC_PROTOCOL = "2.1"
"""Highest SMC protocol version/release smcd speaks (SMC v2, release 1)."""


@dataclass(frozen=True)
class ServiceInfo:
    """What ``GetInfo`` reports besides the tables; the daemon fills it from its config."""

    version: str = smcd_daemon.__version__
    hostname: str = field(default_factory=socket.gethostname)
    capabilities: tuple[str, ...] = ()
    smc_protocol: str = SMC_PROTOCOL


def pnet_entry_struct(entry: PnetEntry) -> tuple[str, str, str, int]:
    """(PNETID, netdev, RDMA/ISM device, port) with "" and 0 for the absent half."""
    return (entry.pnetid, entry.netdev or "", entry.ibdev or "", entry.ibport or 0)


def pnet_entry_ns_struct(entry: PnetEntry) -> tuple[str, str, str, int, str]:
    """:func:`pnet_entry_struct` and the netdev's namespace ("" for smcd's own, else its
    ``ip netns`` name or inode)."""
    return (*pnet_entry_struct(entry), entry.netns)


@contextmanager
def _as_dbus_errors() -> Iterator[None]:
    try:
        yield
    except (PnetError, EidError) as e:
        raise DBusError(ERROR_INVALID, str(e)) from e
    except SmcError as e:
        raise DBusError(ERROR_FAILED, str(e)) from e


def _name_args(fn: Any, *names: str) -> None:
    """Give the out-arguments of a method or the arguments of a signal names in introspection
    (dbus-fast leaves them anonymous, which makes ``busctl introspect`` output hard to read)."""
    if "__DBUS_SIGNAL" in fn.__dict__:
        args = fn.__dict__["__DBUS_SIGNAL"].introspection.args
    else:
        args = fn.__dict__["__DBUS_METHOD"].introspection.out_args
    for arg, name in zip(args, names, strict=True):
        arg.name = name


def _variants(values: Mapping[str, Any], sigs: Mapping[str, str]) -> dict[str, Variant]:
    return {k: Variant(sigs[k], v) for k, v in values.items() if k in sigs}


@with_properties
class Manager(RecordInterface):
    """The Manager1 interface. ``changed(kind)`` is called after every successful mutation with
    "pnet", "ueid", "seid" or "stats", so the owner can persist and refresh dependants."""

    INTERFACE = MANAGER_INTERFACE
    PROPERTIES: ClassVar[Mapping[str, str]] = {
        "Version": "s",
        "SmcProtocol": "s",
        "Hostname": "s",
        "Capabilities": "as",
        "Seid": "s",
        "SeidEnabled": "b",
        "Ueids": "as",
        "PnetEntries": "a(sssy)",
    }

    def __init__(
        self,
        bus: MessageBus,
        pnet: PnetTable,
        eids: EidTable,
        stats: Stats,
        info: ServiceInfo,
        changed: Callable[[str], None],
        allowed_uids: frozenset[int],
        namespaces: Callable[[], Awaitable[list[NamespaceRow]]] | None = None,
    ) -> None:
        self._bus = bus
        self._namespaces = namespaces
        self._pnet = pnet
        self._eids = eids
        self._stats = stats
        self._info = info
        self._changed = changed
        self._allowed_uids = allowed_uids
        super().__init__(self.current_values())

    def set_info(self, info: ServiceInfo) -> None:
        self._info = info

    def current_values(self) -> dict[str, Any]:
        return {
            "Version": self._info.version,
            "SmcProtocol": self._info.smc_protocol,
            "Hostname": self._info.hostname,
            "Capabilities": list(self._info.capabilities),
            "Seid": self._eids.seid or "",
            "SeidEnabled": self._eids.seid_enabled,
            "Ueids": list(self._eids.ueids),
            "PnetEntries": [pnet_entry_struct(e) for e in self._pnet.entries() if not e.netns],
        }

    # -- authorization -----------------------------------------------------------------------

    async def _authorize(self, method: str) -> None:
        sender = current_caller()
        if sender is None:
            raise DBusError(
                ERROR_ACCESS_DENIED, f"{method} changes smcd's state: the caller is unknown"
            )
        try:
            uid = await caller_unix_user(self._bus, sender)
        except BusError as e:
            raise DBusError(ERROR_ACCESS_DENIED, f"{method} changes smcd's state: {e}") from e
        if uid not in self._allowed_uids:
            who = ", ".join(f"uid {u}" for u in sorted(self._allowed_uids))
            raise DBusError(
                ERROR_ACCESS_DENIED,
                f"{method} changes smcd's state and is allowed only to {who} "
                f"(the caller is uid {uid}); read methods are open to everybody",
            )

    def _done(self, kind: str) -> None:
        with _as_dbus_errors():
            self._changed(kind)

    # -- PNET table --------------------------------------------------------------------------

    @dbus_method(name="PnetAdd")
    async def pnet_add(
        self, pnetid: DBusStr, netdev: DBusStr, ibdev: DBusStr, ibport: PortArg
    ) -> PnetStructs:
        """Like ``smc_pnet -a PNETID [-I netdev] [-D ibdev [-P port]]``; "" leaves a half out,
        port 0 means the default (1). Returns the entries actually added."""
        added = await self._pnet_add("PnetAdd", pnetid, netdev, ibdev, ibport, None)
        return [pnet_entry_struct(e) for e in added]

    async def _pnet_add(
        self, method: str, pnetid: str, netdev: str, ibdev: str, ibport: int, netns: str | None
    ) -> tuple[PnetEntry, ...]:
        """Both add methods: "" leaves a half out, port 0 is the default (1); ``netns`` None is
        smcd's own namespace, otherwise the caller's spelling (checked here)."""
        await self._authorize(method)
        with _as_dbus_errors():
            added = self._pnet.add(
                pnetid,
                netdev=netdev or None,
                ibdev=ibdev or None,
                ibport=ibport or 1,
                netns="" if netns is None else pnet_netns(netns),
            )
        self._done("pnet")
        return added

    @dbus_method(name="PnetRemove")
    async def pnet_remove(self, pnetid: DBusStr) -> DBusUInt32:
        await self._authorize("PnetRemove")
        with _as_dbus_errors():
            n = self._pnet.remove(pnetid)
        self._done("pnet")
        return n

    @dbus_method(name="PnetFlush")
    async def pnet_flush(self) -> DBusUInt32:
        await self._authorize("PnetFlush")
        n = self._pnet.flush()
        self._done("pnet")
        return n

    @dbus_method(name="PnetList")
    def pnet_list(self) -> PnetStructs:
        """smcd's own namespace's entries (as the kernel lists the caller's); every namespace's
        with its namespace: ``PnetListNs``."""
        return [pnet_entry_struct(e) for e in self._pnet.entries() if not e.netns]

    # The same for every network namespace (#15): the netdev half of an entry belongs to the
    # namespace named by ``ip netns`` name or inode ("" for smcd's own); one that does not exist
    # is refused. RDMA/ISM devices are shared by all namespaces, so their half has none.

    @dbus_method(name="PnetAddNs")
    async def pnet_add_ns(
        self, pnetid: DBusStr, netdev: DBusStr, ibdev: DBusStr, ibport: PortArg, netns: DBusStr
    ) -> PnetNsStructs:
        """``PnetAdd`` with the netdev's network namespace."""
        added = await self._pnet_add("PnetAddNs", pnetid, netdev, ibdev, ibport, netns)
        return [pnet_entry_ns_struct(e) for e in added]

    @dbus_method(name="PnetRemoveNs")
    async def pnet_remove_ns(self, pnetid: DBusStr, netns: DBusStr) -> DBusUInt32:
        """Drop the PNETID's netdev entries of one namespace ("": smcd's own and the RDMA/ISM
        entries, as the kernel's table of the caller's namespace)."""
        await self._authorize("PnetRemoveNs")
        with _as_dbus_errors():
            n = self._pnet.remove(pnetid, pnet_netns(netns))
        self._done("pnet")
        return n

    @dbus_method(name="PnetListNs")
    def pnet_list_ns(self) -> PnetNsStructs:
        """Every entry of every namespace, with the namespace."""
        return [pnet_entry_ns_struct(e) for e in self._pnet.entries()]

    # -- UEID / SEID -------------------------------------------------------------------------

    @dbus_method(name="UeidAdd")
    async def ueid_add(self, ueid: DBusStr) -> DBusStr:
        await self._authorize("UeidAdd")
        with _as_dbus_errors():
            u = self._eids.add_ueid(ueid)
        self._done("ueid")
        return u

    @dbus_method(name="UeidRemove")
    async def ueid_remove(self, ueid: DBusStr) -> DBusStr:
        await self._authorize("UeidRemove")
        with _as_dbus_errors():
            u = self._eids.remove_ueid(ueid)
        self._done("ueid")
        return u

    @dbus_method(name="UeidFlush")
    async def ueid_flush(self) -> DBusUInt32:
        await self._authorize("UeidFlush")
        n = self._eids.flush_ueids()
        self._done("ueid")
        return n

    @dbus_method(name="UeidList")
    def ueid_list(self) -> StrList:
        return list(self._eids.ueids)

    @dbus_method(name="SeidEnable")
    async def seid_enable(self):  # type: ignore[no-untyped-def]  # no annotation: no reply body
        await self._authorize("SeidEnable")
        with _as_dbus_errors():
            self._eids.enable_seid()
        self._done("seid")

    @dbus_method(name="SeidDisable")
    async def seid_disable(self):  # type: ignore[no-untyped-def]  # no annotation: no reply body
        await self._authorize("SeidDisable")
        with _as_dbus_errors():
            self._eids.disable_seid()
        self._done("seid")

    # -- statistics and info -----------------------------------------------------------------

    @dbus_method(name="StatsGet")
    def stats_get(self) -> StatsOut:
        """Counters by name, and fallbacks as (reason code, as server, as client)."""
        snap = self._stats.snapshot()
        fallbacks = [(code, c.server, c.client) for code, c in sorted(snap.fallbacks.items())]
        return (dict(snap.counters), fallbacks)

    @dbus_method(name="StatsReset")
    async def stats_reset(self):  # type: ignore[no-untyped-def]  # no annotation: no reply body
        await self._authorize("StatsReset")
        self._stats.reset()
        self._done("stats")

    @dbus_method(name="GetInfo")
    def get_info(self) -> InfoDict:
        """Everything ``smcctl info`` prints, in one call."""
        return {
            "Version": Variant("s", self._info.version),
            "SmcProtocol": Variant("s", self._info.smc_protocol),
            "Hostname": Variant("s", self._info.hostname),
            "Capabilities": Variant("as", list(self._info.capabilities)),
            "Seid": Variant("s", self._eids.seid or ""),
            "SeidEnabled": Variant("b", self._eids.seid_enabled),
            "SeidStatus": Variant("s", self._eids.seid_status),
            "Ueids": Variant("as", list(self._eids.ueids)),
            "Pid": Variant("u", os.getpid()),
        }

    @dbus_method(name="NamespaceDevices")
    async def namespace_devices(self) -> NamespaceRows:
        """The devices of every network namespace smcd knows of (#15), for ``smcctl device
        show``: smcd's own first (its Device1 objects' values, name "host"), then each other one
        (those ``ip netns`` names and those of the processes whose connections smcd holds) with
        its netdevs in Device1's shape (PNETIDs empty: the PNET table is smcd's namespace's) and,
        if it could not be read, why."""
        if self._namespaces is None:
            raise DBusError(ERROR_FAILED, "this smcd does not list other network namespaces")
        sigs = DeviceObject.PROPERTIES
        return [
            (ino, name, own, [_variants(d, sigs) for d in devices], problem)
            for ino, name, own, devices, problem in await self._namespaces()
        ]

    # -- signals -----------------------------------------------------------------------------

    @dbus_signal(name="LinkStateChanged")
    def link_state_changed(self, link: str, old: str, new: str) -> LinkStateArgs:
        """A link moved between LINK_UNUSED/INACTIVE/ACTIVATING/ACTIVE."""
        return (link, old, new)

    @dbus_signal(name="Fallback")
    def fallback(
        self, connection: str, reason: int, peer_diagnosis: int, name: str
    ) -> FallbackArgs:
        """A connection fell back to TCP; ``name`` is the reason's SMC_CLC_DECL_* name."""
        return (connection, reason, peer_diagnosis, name)


_name_args(Manager.pnet_add, "added")
_name_args(Manager.pnet_remove, "removed")
_name_args(Manager.pnet_flush, "removed")
_name_args(Manager.pnet_list, "entries")
_name_args(Manager.pnet_add_ns, "added")
_name_args(Manager.pnet_remove_ns, "removed")
_name_args(Manager.pnet_list_ns, "entries")
_name_args(Manager.ueid_add, "ueid")
_name_args(Manager.ueid_remove, "ueid")
_name_args(Manager.ueid_flush, "removed")
_name_args(Manager.ueid_list, "ueids")
_name_args(Manager.stats_get, "counters", "fallbacks")
_name_args(Manager.get_info, "info")
_name_args(Manager.namespace_devices, "namespaces")
_name_args(Manager.link_state_changed, "link", "old_state", "new_state")
_name_args(Manager.fallback, "connection", "reason", "peer_diagnosis", "reason_name")
