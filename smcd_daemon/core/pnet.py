"""The software PNET table: which network devices and RDMA/ISM ports share a physical network.

SMC must pick an RDMA port or ISM device that reaches the same physical network as the TCP
connection's netdev. On IBM Z the firmware tells the kernel each device's PNETID; elsewhere the
operator declares it with ``smc_pnet``. This module keeps that declaration with the semantics of
the kernel's ``net/smc/smc_pnet.c`` (see PROTOCOL.md §3 "PNET table semantics"), so an operator who
knows ``smc_pnet`` gets the same answers from ``smcctl pnet``:

- a PNETID is 1 to 16 alphanumerics; surrounding blanks are dropped and letters folded to upper
  case (``smc_pnetid_valid``);
- an entry names either one netdev (a valid Linux interface name, at most IFNAMSIZ-1 = 15 bytes)
  or one RDMA/ISM device (at most IB_DEVICE_NAME_MAX-1 = 63 bytes) and port 1..2 (default 1);
- a device carries only one PNETID: adding an entry for a device that already has one fails
  (the kernel answers -EEXIST whether the PNETID is the same or not);
- ``add`` with both a netdev and an RDMA/ISM device adds both, like ``smc_pnet -a P -I eth -D ib``;
- ``remove`` by PNETID drops every entry with that PNETID and fails if there is none (-ENOENT);
  ``flush`` drops everything.
- the kernel keeps one table per network namespace and matches a netdev in its own namespace;
  here a netdev entry carries ``netns`` (an ``ip netns`` name or an inode in decimal, "" for
  smcd's own), a netdev is unique per namespace (equal ifnames in two namespaces stay apart), and
  :meth:`PnetTable.view` answers for one namespace. RDMA/ISM entries have no namespace: smcd opens
  RDMA devices in shared mode, where every namespace sees them. Whether a named namespace exists
  is the adapters' question (the table is pure); they store one spelling per namespace.

Deliberate differences from the kernel, each to give the operator a clear answer instead of a
silent partial result:

- RDMA entries are keyed by (device, port), as the kernel keys the PNETIDs of live RDMA devices
  (``smc_ib_device.pnetid[port]``); the kernel's table itself refuses a second port of a name.
- An ``add`` that names a device already carrying a *different* PNETID fails as a whole, even if
  the other device in the same request is new (the kernel adds the new half and reports success).
  When one half is a repeat with the same PNETID and the other half is new, the new half is added
  and returned, as in the kernel.

The table is pure data: no netlink, no I/O. Persistence goes through
:mod:`smcd_daemon.core.persist`.
"""

from __future__ import annotations

import errno
from collections.abc import Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from smcd_daemon.errors import SmcError

SMC_MAX_PNETID_LEN = 16
"""Longest PNETID (``include/net/smc.h``)."""
IFNAMSIZ = 16
"""Kernel buffer for interface names, NUL included: names are at most 15 bytes."""
IB_DEVICE_NAME_MAX = 64
"""Kernel buffer for RDMA device names, NUL included: names are at most 63 bytes."""
SMC_MAX_PORTS = 2
"""Ports per RDMA device SMC uses (``SMC_MAX_PORTS``)."""
NO_PORT = 0xFF
"""What the kernel's dump reports as IBPORT for a netdev entry (smc_pnet shows it as 255)."""

# The kernel's isspace() for the C locale: what smc_pnetid_valid and dev_valid_name treat as blanks.
_C_SPACE = " \t\n\v\f\r"
_ALNUM = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789")

_TABLE_FORMAT = 1


class PnetError(SmcError):
    """A PNET table request the kernel's rules refuse.

    ``errno`` is what the kernel would answer (EINVAL, EEXIST, ENOENT) so the D-Bus and CLI layers
    can map it to an error name and exit status; ``value`` is the offending input.
    """

    def __init__(self, message: str, *, value: object = None, errno_: int = errno.EINVAL) -> None:
        super().__init__(message)
        self.value = value
        self.errno = errno_


class PnetExistsError(PnetError):
    """The device already carries a PNETID (the kernel's -EEXIST)."""

    def __init__(self, message: str, *, value: object = None) -> None:
        super().__init__(message, value=value, errno_=errno.EEXIST)


class PnetNotFoundError(PnetError):
    """No entry has the PNETID to remove (the kernel's -ENOENT)."""

    def __init__(self, message: str, *, value: object = None) -> None:
        super().__init__(message, value=value, errno_=errno.ENOENT)


def normalize_pnetid(s: object) -> str:
    """Return the canonical form of a PNETID, or raise :class:`PnetError`.

    Mirrors ``smc_pnetid_valid``: blanks around it are dropped, the rest must be 1 to 16 ASCII
    letters or digits, and lower case is folded to upper case.
    """
    if not isinstance(s, str):
        raise PnetError(
            f"PNETID {s!r} is not a string: a PNETID is 1 to 16 letters or digits.", value=s
        )
    core = s.strip(_C_SPACE)
    if not core:
        raise PnetError(f"PNETID {s!r} is empty: a PNETID is 1 to 16 letters or digits.", value=s)
    if len(core) > SMC_MAX_PNETID_LEN:
        raise PnetError(
            f"PNETID {s!r} has {len(core)} characters: a PNETID is at most "
            f"{SMC_MAX_PNETID_LEN} letters or digits.",
            value=s,
        )
    bad = next((c for c in core if c not in _ALNUM), None)
    if bad is not None:
        raise PnetError(
            f"PNETID {s!r} contains {bad!r}: a PNETID may only contain the letters A-Z "
            "and digits 0-9 (no interior blanks).",
            value=s,
        )
    return core.upper()


def validate_netdev_name(name: object) -> str:
    """Return ``name`` if the kernel would accept it as an interface name, else raise.

    The rules are ``dev_valid_name`` plus the attribute limit of ``smc_pnet_policy``: non-empty,
    at most 15 bytes, not "." or "..", and no '/', ':', NUL or blank. The name is not otherwise
    altered (the kernel compares it byte for byte).
    """
    if not isinstance(name, str):
        raise PnetError(
            f"Network device name {name!r} is not a string: give an interface name such as eth0.",
            value=name,
        )
    if not name:
        raise PnetError(
            "Network device name '' is empty: an interface name has 1 to 15 bytes.", value=name
        )
    size = len(name.encode("utf-8", "surrogatepass"))
    if size > IFNAMSIZ - 1:
        raise PnetError(
            f"Network device name {name!r} has {size} bytes: an interface name has at most "
            f"{IFNAMSIZ - 1} bytes (IFNAMSIZ-1).",
            value=name,
        )
    if name in (".", ".."):
        raise PnetError(
            f"Network device name {name!r} is reserved: '.' and '..' are not interface names.",
            value=name,
        )
    bad = next((c for c in name if c in "/:\0" or c in _C_SPACE), None)
    if bad is not None:
        raise PnetError(
            f"Network device name {name!r} contains {bad!r}: an interface name may not contain "
            "'/', ':', NUL or blanks.",
            value=name,
        )
    return name


def validate_ibdev_name(name: object) -> str:
    """Return the RDMA/ISM device name with surrounding blanks dropped (the kernel's strim()).

    At most 63 bytes (IB_DEVICE_NAME_MAX-1). ISM device names are PCI addresses such as
    ``0000:00:00.0``, so ':' is allowed; '/' (impossible in a sysfs name), NUL and interior blanks
    are not.
    """
    if not isinstance(name, str):
        raise PnetError(
            f"RDMA/ISM device name {name!r} is not a string: give a name such as mlx5_0.",
            value=name,
        )
    core = name.strip(_C_SPACE)
    if not core:
        raise PnetError(
            f"RDMA/ISM device name {name!r} is empty: a device name has 1 to "
            f"{IB_DEVICE_NAME_MAX - 1} bytes.",
            value=name,
        )
    size = len(core.encode("utf-8", "surrogatepass"))
    if size > IB_DEVICE_NAME_MAX - 1:
        raise PnetError(
            f"RDMA/ISM device name {name!r} has {size} bytes: a device name has at most "
            f"{IB_DEVICE_NAME_MAX - 1} bytes (IB_DEVICE_NAME_MAX-1).",
            value=name,
        )
    bad = next((c for c in core if c in "/\0" or c in _C_SPACE or not c.isprintable()), None)
    if bad is not None:
        raise PnetError(
            f"RDMA/ISM device name {name!r} contains {bad!r}: a device name may not contain "
            "'/', NUL, blanks or control characters.",
            value=name,
        )
    return core


def validate_ibport(port: object) -> int:
    """Return the port if it is 1..SMC_MAX_PORTS, else raise (the kernel's -EINVAL)."""
    if isinstance(port, bool) or not isinstance(port, int):
        raise PnetError(
            f"RDMA port {port!r} is not an integer: the port is 1 or {SMC_MAX_PORTS}.", value=port
        )
    if not 1 <= port <= SMC_MAX_PORTS:
        raise PnetError(
            f"RDMA port {port} is out of range: the port is 1 or {SMC_MAX_PORTS}.", value=port
        )
    return port


NETNS_NAME_MAX = 255
"""Longest ``ip netns`` name (a file name in /run/netns)."""


def validate_netns(ns: object) -> str:
    """Return the namespace key of a netdev entry: "" (smcd's own), an ``ip netns`` name, or an
    inode number in decimal; raise :class:`PnetError` for anything else."""
    if not isinstance(ns, str):
        raise PnetError(
            f"Network namespace {ns!r} is not a string: give an `ip netns` name or an inode.",
            value=ns,
        )
    if ns == "":
        return ns
    if ns.isdigit():
        if int(ns) == 0:
            raise PnetError("Network namespace inode 0 is not a namespace.", value=ns)
        return str(int(ns))
    size = len(ns.encode("utf-8", "surrogatepass"))
    bad = next((c for c in ns if c in "/\0" or c in _C_SPACE or not c.isprintable()), None)
    if ns in (".", "..") or size > NETNS_NAME_MAX or bad is not None:
        raise PnetError(
            f"Network namespace {ns!r} is not an `ip netns` name: a name has 1 to "
            f"{NETNS_NAME_MAX} bytes, is not '.' or '..', and has no '/', NUL or blanks.",
            value=ns,
        )
    return ns


@dataclass(frozen=True)
class PnetEntry:
    """One line of the table: a netdev (``ibdev``/``ibport`` None) or an RDMA/ISM device port
    (``netdev`` None). Always built through :class:`PnetTable`, so fields are canonical."""

    pnetid: str
    netdev: str | None
    ibdev: str | None
    ibport: int | None
    netns: str = ""
    """The netdev's namespace: an ``ip netns`` name or inode, "" for smcd's own."""

    @property
    def is_netdev(self) -> bool:
        return self.netdev is not None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "pnetid": self.pnetid,
            "netdev": self.netdev,
            "ibdev": self.ibdev,
            "ibport": self.ibport,
        }
        if self.netns:
            d["netns"] = self.netns
        return d

    def describe(self) -> str:
        """The device part in words, for messages and logs."""
        if self.netdev is not None:
            where = f" in network namespace {self.netns!r}" if self.netns else ""
            return f"network device {self.netdev!r}{where}"
        return f"RDMA/ISM device {self.ibdev!r} port {self.ibport}"


class PnetView:
    """The table as one network namespace sees it (``PnetLookup`` of core.devices): its own
    netdev entries and every RDMA/ISM entry (shared-mode devices are seen by all namespaces)."""

    def __init__(self, table: PnetTable, keys: Collection[str]) -> None:
        self._table = table
        self._keys = frozenset(keys)

    def pnetid_of_netdev(self, name: str) -> str | None:
        for e in self._table.entries():
            if e.netdev == name and e.netns in self._keys:
                return e.pnetid
        return None

    def pnetid_of_ibport(self, dev: str, port: int) -> str | None:
        return self._table.pnetid_of_ibport(dev, port)

    def pnetid_of_device(self, dev: str) -> str | None:
        return self._table.pnetid_of_device(dev)


class PnetTable:
    """The ordered PNET table (the kernel's per-netns lists, entries appended at the tail)."""

    def __init__(self, entries: Iterable[PnetEntry] = ()) -> None:
        self._entries: list[PnetEntry] = []
        for e in entries:
            if e.netdev is not None:
                self.add(e.pnetid, netdev=e.netdev, netns=e.netns)
            else:
                self.add(e.pnetid, ibdev=e.ibdev, ibport=e.ibport if e.ibport is not None else 1)

    # -- queries ---------------------------------------------------------------------------------

    def entries(self) -> tuple[PnetEntry, ...]:
        return tuple(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[PnetEntry]:
        return iter(tuple(self._entries))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PnetTable) and self._entries == other._entries

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"PnetTable({self._entries!r})"

    def pnetids(self) -> tuple[str, ...]:
        """Distinct PNETIDs in table order."""
        return tuple(dict.fromkeys(e.pnetid for e in self._entries))

    def entries_for(self, pnetid: str) -> tuple[PnetEntry, ...]:
        p = normalize_pnetid(pnetid)
        return tuple(e for e in self._entries if e.pnetid == p)

    def pnetid_of_netdev(self, name: str) -> str | None:
        """The user-defined PNETID of a netdev of smcd's own namespace
        (``smc_pnet_find_ndev_pnetid_by_table``); another namespace's: :meth:`view`."""
        for e in self._entries:
            if e.netdev == name and not e.netns:
                return e.pnetid
        return None

    def view(self, keys: Collection[str]) -> PnetView:
        """The lookups of one namespace, known by any of ``keys`` (its ``ip netns`` name and its
        inode in decimal; {""} is smcd's own)."""
        return PnetView(self, keys)

    def namespaces(self) -> tuple[str, ...]:
        """The namespaces other than smcd's own that entries name, in table order."""
        return tuple(dict.fromkeys(e.netns for e in self._entries if e.netns))

    def pnetid_of_ibport(self, dev: str, port: int) -> str | None:
        """The user-defined PNETID of one RDMA device port (``smc_pnetid_by_table_ib``)."""
        dev = dev.strip(_C_SPACE)
        for e in self._entries:
            if e.ibdev == dev and e.ibport == port:
                return e.pnetid
        return None

    def pnetid_of_device(self, dev: str) -> str | None:
        """The PNETID of an ISM device, which has no ports (``smc_pnetid_by_table_smcd``
        matches the name only): the first entry naming ``dev`` wins."""
        dev = dev.strip(_C_SPACE)
        for e in self._entries:
            if e.ibdev == dev:
                return e.pnetid
        return None

    # -- mutations -------------------------------------------------------------------------------

    def add(
        self,
        pnetid: str,
        *,
        netdev: str | None = None,
        ibdev: str | None = None,
        ibport: int = 1,
        netns: str = "",
    ) -> tuple[PnetEntry, ...]:
        """Add a netdev entry, an RDMA/ISM entry, or both; return the entries actually added.
        ``netns`` is the netdev's namespace (the RDMA/ISM half has none).

        Everything is validated before the table changes, so a refused request leaves it as it
        was. Raises :class:`PnetError` (invalid input), :class:`PnetExistsError` (a named device
        already has a different PNETID, or every named device already has this one).
        """
        pid = normalize_pnetid(pnetid)
        if netdev is None and ibdev is None:
            raise PnetError(
                f"PNET entry for {pid} names no device: give a network device, an RDMA/ISM "
                "device, or both.",
                value=pnetid,
            )
        if ibdev is None and ibport != 1:
            raise PnetError(
                f"RDMA port {ibport!r} was given without an RDMA/ISM device: a port belongs to "
                "the RDMA/ISM device it is given with.",
                value=ibport,
            )
        ns = validate_netns(netns)
        if ns and netdev is None:
            raise PnetError(
                f"PNET entry for {pid} gives network namespace {ns!r} but no network device: a "
                "namespace belongs to a network device; RDMA/ISM devices are shared by every "
                "namespace.",
                value=netns,
            )
        wanted: list[PnetEntry] = []
        if netdev is not None:
            wanted.append(PnetEntry(pid, validate_netdev_name(netdev), None, None, ns))
        if ibdev is not None:
            wanted.append(PnetEntry(pid, None, validate_ibdev_name(ibdev), validate_ibport(ibport)))

        new: list[PnetEntry] = []
        repeats: list[PnetEntry] = []
        for entry in wanted:
            current = self._find_same_device(entry)
            if current is None:
                new.append(entry)
            elif current.pnetid != pid:
                raise PnetExistsError(
                    f"{current.describe().capitalize()} already has PNETID {current.pnetid}: a "
                    f"device carries only one PNETID, so remove {current.pnetid} first to give it "
                    f"PNETID {pid}.",
                    value=entry.netdev if entry.netdev is not None else entry.ibdev,
                )
            else:
                repeats.append(entry)
        if not new:
            what = " and ".join(e.describe() for e in repeats)
            raise PnetExistsError(
                f"{what[0].upper()}{what[1:]} already {'has' if len(repeats) == 1 else 'have'} "
                f"PNETID {pid}: each device appears in the table only once.",
                value=pnetid,
            )
        self._entries.extend(new)
        return tuple(new)

    def remove(self, pnetid: str, netns: str | None = None) -> int:
        """Remove the entries with this PNETID; return how many. Raises if there was none.

        ``netns`` None: in every namespace; "": smcd's own netdevs and the RDMA/ISM devices (the
        kernel's table of the caller's namespace); a name or inode: that namespace's netdevs."""
        pid = normalize_pnetid(pnetid)
        ns = None if netns is None else validate_netns(netns)

        def hit(e: PnetEntry) -> bool:
            return e.pnetid == pid and (ns is None or e.netns == ns)

        kept = [e for e in self._entries if not hit(e)]
        removed = len(self._entries) - len(kept)
        if not removed:
            where = f" of network namespace {ns!r}" if ns else ""
            raise PnetNotFoundError(
                f"PNETID {pid} is not in the PNET table{where}: only a PNETID that has entries "
                "can be removed.",
                value=pnetid,
            )
        self._entries = kept
        return removed

    def flush(self) -> int:
        """Empty the table; return how many entries were dropped (0 is not an error)."""
        n = len(self._entries)
        self._entries = []
        return n

    def _find_same_device(self, entry: PnetEntry) -> PnetEntry | None:
        for e in self._entries:
            if entry.netdev is not None and e.netdev == entry.netdev and e.netns == entry.netns:
                return e
            if entry.ibdev is not None and e.ibdev == entry.ibdev and e.ibport == entry.ibport:
                return e
        return None

    # -- persistence -----------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready snapshot; :meth:`from_dict` restores an equal table."""
        return {"format": _TABLE_FORMAT, "entries": [e.to_dict() for e in self._entries]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PnetTable:
        """Rebuild a table, re-checking every rule: a stored file is input like any other."""
        if not isinstance(data, Mapping):
            raise PnetError(
                f"Stored PNET table {data!r} is not an object: it must be "
                '{"format": 1, "entries": [...]}.',
                value=data,
            )
        fmt = data.get("format", _TABLE_FORMAT)
        if fmt != _TABLE_FORMAT:
            raise PnetError(
                f"Stored PNET table format {fmt!r} is unknown: this smcd reads format "
                f"{_TABLE_FORMAT}.",
                value=fmt,
            )
        raw = data.get("entries", [])
        if not isinstance(raw, list):
            raise PnetError(
                f"Stored PNET entries {raw!r} are not a list: entries must be a JSON array.",
                value=raw,
            )
        table = cls()
        for item in raw:
            if not isinstance(item, Mapping):
                raise PnetError(
                    f"Stored PNET entry {item!r} is not an object: each entry has pnetid, "
                    "netdev, ibdev and ibport.",
                    value=item,
                )
            unknown = set(item) - {"pnetid", "netdev", "ibdev", "ibport", "netns"}
            if unknown:
                raise PnetError(
                    f"Stored PNET entry {dict(item)!r} has unknown keys {sorted(unknown)}: only "
                    "pnetid, netdev, ibdev, ibport and netns are allowed.",
                    value=item,
                )
            netdev, ibdev = item.get("netdev"), item.get("ibdev")
            if (netdev is None) == (ibdev is None):
                raise PnetError(
                    f"Stored PNET entry {dict(item)!r} names {'no' if netdev is None else 'two'} "
                    "devices: each entry names exactly one netdev or one RDMA/ISM device.",
                    value=item,
                )
            if netdev is not None:
                if item.get("ibport") is not None:
                    raise PnetError(
                        f"Stored PNET entry {dict(item)!r} gives a port to a network device: "
                        "only RDMA/ISM entries have a port.",
                        value=item,
                    )
                table.add(
                    item.get("pnetid"),  # type: ignore[arg-type]
                    netdev=netdev,
                    netns=item.get("netns", ""),
                )
            else:
                port = item.get("ibport", 1)
                table.add(
                    item.get("pnetid"),  # type: ignore[arg-type]
                    ibdev=ibdev,
                    ibport=port,
                    netns=item.get("netns", ""),
                )
        return table
