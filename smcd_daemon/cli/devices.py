"""``smcctl device show``: the devices of every network namespace smcd knows of (#15).

One smcd serves all the host's namespaces, so the operator sees each device with the namespace
it lives in: smcd's own (its netdevs, RDMA devices and loopback-ism, with PNETIDs; shown as
``host``), then every other namespace ``ip netns`` names or whose processes hold connections
or listeners at smcd, with its netdevs (``Manager1.NamespaceDevices``). A namespace column reads
"inode name", as ``smcctl conns`` shows a connection's. Pure: the D-Bus call is in
:mod:`smcd_daemon.cli.bus`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

__all__ = [
    "HEADERS",
    "by_namespace",
    "device_detail",
    "device_state",
    "matching",
    "namespace_label",
    "table_rows",
]

HEADERS = ("Netns", "Name", "Kind", "State", "PNET-ID", "Details")
_KIND_ORDER = {"netdev": 0, "rdma": 1, "ism": 2}


def namespace_label(inode: int, name: str) -> str:
    """The label "inode name" (the inode alone when nobody named the namespace, the name alone
    when the inode is unknown)."""
    if not inode:
        return name
    return f"{inode} {name}" if name else str(inode)


def by_namespace(
    namespaces: Iterable[Sequence[Any]],
) -> tuple[list[dict[str, Any]], list[str]]:
    """``NamespaceDevices``'s answer as one list of device records (each with ``Netns``, its
    label, and ``NetnsInode``), smcd's namespace first, and one line per namespace that could
    not be read."""
    devices: list[dict[str, Any]] = []
    problems: list[str] = []
    rows = sorted(namespaces, key=lambda n: not n[2])  # smcd's own first, the rest as given
    for inode, name, _own, found, problem in rows:
        label = namespace_label(int(inode), str(name))
        if problem:
            problems.append(f"network namespace {label}: {problem}")
        ordered = sorted(
            found,
            key=lambda d: (_KIND_ORDER.get(d.get("Kind", ""), 3), d.get("Ifindex", 0), d["Name"]),
        )
        devices += [{**d, "Netns": label, "NetnsInode": int(inode)} for d in ordered]
    return devices, problems


def matching(devices: list[dict[str, Any]], netns: str | None) -> list[dict[str, Any]]:
    """The devices of the namespace ``netns`` (its inode, its name or "host"), or all."""
    if not netns:
        return devices
    return [d for d in devices if netns in (str(d["NetnsInode"]), d["Netns"].rsplit(" ", 1)[-1])]


def device_detail(d: Mapping[str, Any]) -> str:
    kind = d.get("Kind")
    if kind == "netdev":
        addrs = " ".join(f"{a}/{p}" for a, p in d.get("Addresses", []))
        parts = [f"mtu {d.get('Mtu', 0)}", f"carrier {'on' if d.get('Carrier') else 'off'}"]
        if d.get("LinkKind"):
            vlan = d.get("VlanId", -1)
            parts.append(str(d["LinkKind"]) + (f" id {vlan}" if vlan >= 0 else ""))
        if addrs:
            parts.append(addrs)
        return ", ".join(parts)
    if kind == "rdma":
        ports = "; ".join(
            f"port {num} {state} mtu {mtu}" + (f" netdev {nd}" if nd else "")
            for num, state, mtu, nd, _pnet in d.get("Ports", [])
        )
        return f"guid {d.get('NodeGuid', '')}; {ports}" if ports else f"guid {d.get('NodeGuid')}"
    return f"gid {d.get('Gid', '')}, chid 0x{int(d.get('Chid', 0)):04x}"


def smcr_ports(devices: Iterable[Mapping[str, Any]]) -> str:
    """``smcctl info``'s word on SMC-R: the ACTIVE ports of the RDMA devices (what SMC-R
    runs over), or why there is none."""
    ports = [
        (str(d.get("Name", "")), int(num), str(state))
        for d in devices
        if d.get("Kind") == "rdma"
        for num, state, *_ in d.get("Ports", [])
    ]
    active = [f"{name} port {num}" for name, num, state in ports if state == "ACTIVE"]
    if active:
        return ", ".join(active) + " ACTIVE"
    if ports:
        seen = ", ".join(f"{name} port {num} {state}" for name, num, state in ports)
        return f"none ACTIVE ({seen}): SMC-R cannot be used now"
    return "none: no RDMA device here, SMC-R cannot be used (smcctl device)"


def device_state(d: Mapping[str, Any]) -> str:
    if d.get("Kind") == "netdev":
        return str(d.get("OperState") or ("UP" if d.get("Up") else "DOWN"))
    if d.get("Kind") == "ism":
        return "ENABLED" if d.get("Enabled") else "DISABLED"
    return "ACTIVE" if d.get("Up") else "DOWN"


def table_rows(devices: Iterable[Mapping[str, Any]]) -> list[tuple[str, ...]]:
    return [
        (
            d.get("Netns", ""),
            d.get("Name", ""),
            d.get("Kind", ""),
            device_state(d),
            d.get("PnetId") or "n/a",
            device_detail(d),
        )
        for d in devices
    ]
