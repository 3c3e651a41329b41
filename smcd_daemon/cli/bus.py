"""smcctl commands that talk to a running smcd over D-Bus (``org.smcd``).

Modelled on smc-tools so an SMC operator feels at home (PROTOCOL.md §3): ``pnet`` takes
``smc_pnet``'s options (``-a/-d/-f/-s``, ``-I``, ``-D``, ``-P``) as well as the verb form, ``conns``
prints ``smcss``'s columns and flags, ``info``/``device``/``linkgroup``/``stats``/``ueid`` follow
``smcd``/``smcr``. People get aligned tables, scripts ``--json``.

Every failure is one line on stderr and exit status 1: a bus that cannot be reached or a name
nobody owns says "smcd is not running on the … bus", a policy or uid refusal says "permission
denied", and the daemon's own error messages (which already name the rule that was broken) are
printed as they are. Reading needs no privilege; changes need root (the bus policy and the daemon
both check).

``--bus`` (and ``$SMCD_BUS``): ``system``, ``session``, ``private`` (the bus a daemon
started with ``dbus.bus = "private"`` runs; its address is read from ``bus.address`` in the
runtime dir, ``$SMCD_RUNTIME_DIR`` or the default one) or a D-Bus address. Without either,
smcctl looks where smcd would be with the same defaults (:mod:`smcd_daemon.cli.discover`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Callable, Coroutine, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from dbus_fast import BusType, Message, MessageType, Variant
from dbus_fast.aio import MessageBus

from smcd_daemon.adapters.dbus.names import (
    BUS_NAME,
    CONNECTION_INTERFACE,
    DEVICE_INTERFACE,
    ERROR_ACCESS_DENIED,
    LINK_GROUP_INTERFACE,
    LINK_INTERFACE,
    MANAGER_INTERFACE,
    OBJECT_MANAGER_INTERFACE,
    ROOT_PATH,
)
from smcd_daemon.cli import devices as devices_view
from smcd_daemon.errors import SmcError

__all__ = ["COMMANDS", "CliError", "SmcdClient", "register", "render_table"]

COMMANDS = ("info", "device", "pnet", "ueid", "linkgroup", "conns", "stats")
ENV_BUS = "SMCD_BUS"
ENV_RUNTIME_DIR = "SMCD_RUNTIME_DIR"
CALL_TIMEOUT = 10.0
EXIT_FAILURE = 1

_NO_OWNER_ERRORS = frozenset(
    {
        "org.freedesktop.DBus.Error.ServiceUnknown",
        "org.freedesktop.DBus.Error.NameHasNoOwner",
        "org.freedesktop.DBus.Error.NoReply",
    }
)


class CliError(SmcError):
    """A failure shown to the operator as one line (``smcctl: <message>``), exit status 1."""


# -- the D-Bus client --------------------------------------------------------------------------


def _private_address() -> str:
    from smcd_daemon.paths import PRIVATE_BUS_ADDRESS_FILE, default_runtime_dir

    env_dir = os.environ.get(ENV_RUNTIME_DIR)
    runtime = Path(env_dir) if env_dir else default_runtime_dir()
    path = runtime / PRIVATE_BUS_ADDRESS_FILE
    try:
        return path.read_text().strip()
    except OSError:
        raise CliError(
            f"smcd is not running on its private bus (no address in {path}; set "
            f"{ENV_RUNTIME_DIR} to the daemon's runtime_dir)"
        ) from None


def _unwrap(value: Any) -> Any:
    if isinstance(value, Variant):
        return _unwrap(value.value)
    if isinstance(value, dict):
        return {k: _unwrap(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_unwrap(v) for v in value]
    return value


class SmcdClient:
    """One connection to the bus smcd serves on, with errors turned into :class:`CliError`."""

    def __init__(self, bus: str) -> None:
        self.spec = bus
        if bus == "auto":
            self.label = "any bus"
        elif bus in ("system", "session"):
            self.label = f"the {bus} bus"
        elif bus == "private":
            self.label = "its private bus"
        else:
            self.label = f"the bus {bus}"
        self._bus: MessageBus | None = None

    async def __aenter__(self) -> SmcdClient:
        if self.spec == "auto":
            from smcd_daemon.cli.discover import NotFound, find_daemon

            try:
                self._bus, self.label = await find_daemon()
            except NotFound as e:
                raise CliError(str(e)) from None
            return self
        try:
            if self.spec == "system":
                bus = MessageBus(bus_type=BusType.SYSTEM)
            elif self.spec == "session":
                bus = MessageBus(bus_type=BusType.SESSION)
            elif self.spec == "private":
                bus = MessageBus(bus_address=_private_address())
            else:
                bus = MessageBus(bus_address=self.spec)
            self._bus = await asyncio.wait_for(bus.connect(), CALL_TIMEOUT)
        except CliError:
            raise
        except Exception as e:
            raise CliError(
                f"smcd is not running on {self.label} (cannot connect to the bus: {e})"
            ) from None
        return self

    @property
    def connection(self) -> MessageBus:
        """The bus connection (for signal subscribers such as ``smcctl monitor``)."""
        assert self._bus is not None
        return self._bus

    async def __aexit__(self, *exc: object) -> None:
        if self._bus is not None:
            self._bus.disconnect()

    async def call(
        self,
        member: str,
        signature: str = "",
        body: Sequence[Any] = (),
        *,
        interface: str = MANAGER_INTERFACE,
        path: str = ROOT_PATH,
    ) -> list[Any]:
        assert self._bus is not None
        msg = Message(
            destination=BUS_NAME,
            path=path,
            interface=interface,
            member=member,
            signature=signature,
            body=list(body),
        )
        try:
            reply = await asyncio.wait_for(self._bus.call(msg), CALL_TIMEOUT)
        except TimeoutError:
            raise CliError(f"smcd did not answer {member} within {CALL_TIMEOUT:g} s") from None
        except Exception as e:
            raise CliError(f"{member} failed: {e}") from None
        if reply is None:
            raise CliError(f"{member}: no reply")
        if reply.message_type is MessageType.ERROR:
            raise self._error(member, reply.error_name or "", reply.body)
        return [_unwrap(v) for v in reply.body]

    def _error(self, member: str, name: str, body: Sequence[Any]) -> CliError:
        text = str(body[0]) if body else name
        if name in _NO_OWNER_ERRORS:
            return CliError(f"smcd is not running on {self.label} ({BUS_NAME} has no owner)")
        if name == ERROR_ACCESS_DENIED:
            if text.startswith("Rejected send message"):
                text = f"{member} changes smcd's state and the bus policy allows it only to root"
            return CliError(f"permission denied: {text}")
        if name.startswith("org.freedesktop.DBus.Error."):
            return CliError(f"{member}: {text} [{name.rsplit('.', 1)[-1]}]")
        return CliError(text)

    async def managed_objects(self) -> dict[str, dict[str, dict[str, Any]]]:
        (objects,) = await self.call("GetManagedObjects", interface=OBJECT_MANAGER_INTERFACE)
        return dict(objects)


def _objects_with(
    objects: Mapping[str, Mapping[str, Mapping[str, Any]]], interface: str
) -> list[dict[str, Any]]:
    out = []
    for path in sorted(objects):
        props = objects[path].get(interface)
        if props is not None:
            out.append({"Path": path, **props})
    return out


# -- output ------------------------------------------------------------------------------------


def render_table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """Columns padded to their widest cell, two spaces apart (the last one not padded)."""
    cells = [[str(c) for c in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in cells:
        for i, c in enumerate(row):
            widths[i] = max(widths[i], len(c))

    def line(row: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()

    return "\n".join([line(list(headers)), *(line(r) for r in cells)])


def _print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, sort_keys=False))


def _kv(pairs: Sequence[tuple[str, object]]) -> str:
    width = max(len(k) for k, _ in pairs)
    return "\n".join(f"{k.ljust(width)} : {v}" for k, v in pairs)


# -- plumbing ----------------------------------------------------------------------------------

Handler = Callable[[SmcdClient, argparse.Namespace], Coroutine[Any, Any, int]]


def _bus_of(args: argparse.Namespace) -> str:
    return getattr(args, "bus", None) or os.environ.get(ENV_BUS) or "auto"


def _json(args: argparse.Namespace) -> bool:
    return bool(getattr(args, "json", False))


def _runner(handler: Handler) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        async def go() -> int:
            async with SmcdClient(_bus_of(args)) as client:
                return await handler(client, args)

        try:
            return asyncio.run(go())
        except CliError as e:
            print(f"smcctl: {e}", file=sys.stderr)
            return EXIT_FAILURE

    return run


def _usage(message: str) -> CliError:
    """A command line that cannot be turned into a request (checked before any D-Bus call)."""
    return CliError(message)


def register(sub: Any) -> None:
    """Add the D-Bus commands to the smcctl sub-command parser."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--bus",
        default=argparse.SUPPRESS,
        metavar="BUS",
        help=f'"system", "session", "private" or a D-Bus address (default: ${ENV_BUS}, else '
        "wherever smcd runs)",
    )
    common.add_argument(
        "--json", action="store_true", default=argparse.SUPPRESS, help="machine-readable output"
    )
    fmt = argparse.RawDescriptionHelpFormatter

    p = sub.add_parser(
        "info",
        parents=[common],
        help="versions, capabilities, ACTIVE SMC-R ports, hostname, SEID and UEIDs",
    )
    p.set_defaults(func=_runner(_info))

    p = sub.add_parser(
        "device",
        parents=[common],
        help="network, RDMA and ISM devices smcd knows",
        description='Show devices per network namespace: smcd\'s own ("host": netdevs with '
        "state, MTU, addresses; RDMA devices with ports and GIDs; the loopback-ism SMC-D device; "
        "their PNETIDs), then the netdevs of every namespace ip netns names or whose processes "
        "hold connections at smcd.",
    )
    p.add_argument("action", nargs="?", choices=["show"], default="show")
    p.add_argument("name", nargs="?", help="only this device")
    p.add_argument(
        "-n", "--netns", metavar="NS", help='only this network namespace (inode, name, "host")'
    )
    p.set_defaults(func=_runner(_device))

    p = sub.add_parser(
        "pnet",
        parents=[common],
        formatter_class=fmt,
        help="show or change the PNET table (smc_pnet)",
        description="Show or change the software PNET table, as smc_pnet does.",
        epilog="examples:\n"
        "  smcctl pnet show\n"
        "  smcctl pnet add NET1 -I eth0           (smc_pnet -a NET1 -I eth0)\n"
        "  smcctl pnet add NET1 -D mlx5_0 -P 1    (smc_pnet -a NET1 -D mlx5_0 -P 1)\n"
        "  smcctl pnet del NET1                   (smc_pnet -d NET1)\n"
        "  smcctl pnet flush                      (smc_pnet -f)\n"
        "  smcctl pnet add NET2 -I eth1 --netns c1  (eth1 of namespace c1: its SMC-R)\n"
        "Changes need root. Without --netns an entry is smcd's own namespace's, and 'del'\n"
        "drops the PNETID in every namespace. RDMA/ISM devices are shared by all namespaces.",
    )
    p.add_argument("action", nargs="?", choices=["show", "add", "del", "flush"])
    p.add_argument("pnetid", nargs="?", metavar="PNETID")
    p.add_argument("-I", "--interface", metavar="ETH", help="network device of the entry")
    p.add_argument("-D", "--ibdevice", metavar="IBDEV", help="RDMA or ISM device of the entry")
    p.add_argument("-P", "--ibport", metavar="PORT", type=int, help="port of IBDEV (1 or 2)")
    p.add_argument(
        "--netns",
        metavar="NS",
        help="network namespace of ETH (`ip netns` name or inode; default: smcd's own); "
        "with del/show: only that namespace's entries",
    )
    g = p.add_mutually_exclusive_group()
    g.add_argument("-a", "--add", metavar="PNETID", help="smc_pnet spelling of add")
    g.add_argument("-d", "--delete", metavar="PNETID", help="smc_pnet spelling of del")
    g.add_argument("-f", "--flush", action="store_true", help="smc_pnet spelling of flush")
    g.add_argument("-s", "--show", metavar="PNETID", help="smc_pnet spelling of show PNETID")
    p.set_defaults(func=_runner(_pnet))

    p = sub.add_parser(
        "ueid",
        parents=[common],
        help="show or change the user EIDs (smcd ueid)",
        description="User EIDs for SMC v2: up to 8, each 1-32 characters A-Z 0-9 '.' '-'.",
    )
    p.add_argument("action", nargs="?", choices=["show", "add", "del", "flush"], default="show")
    p.add_argument("ueid", nargs="?", metavar="UEID")
    p.set_defaults(func=_runner(_ueid))

    p = sub.add_parser(
        "linkgroup", parents=[common], help="SMC link groups (smcr/smcd linkgroup show)"
    )
    p.add_argument("action", nargs="?", choices=["show"], default="show")
    p.add_argument("lgr_id", nargs="?", metavar="LG-ID", help="only this link group (hex)")
    p.add_argument("--links", action="store_true", help="also list the links of each group")
    p.set_defaults(func=_runner(_linkgroup))

    p = sub.add_parser(
        "conns",
        parents=[common],
        help="connections, as smcss shows them",
        description="Connections smcd handles, in smcss's columns. Mode is SMCD, SMCR or "
        "'TCP 0xREASON/0xPEERDIAG (NAME)' for a fallback (see smcctl explain REASON).",
    )
    p.add_argument("-a", "--all", action="store_true", help="listening ones too")
    p.add_argument("-l", "--listening", action="store_true", help="only listening ones")
    p.add_argument("-d", "--debug", action="store_true", help="token, buffers and cursors")
    p.add_argument("-D", "--smcd", action="store_true", help="only SMC-D connections")
    p.add_argument("-R", "--smcr", action="store_true", help="only SMC-R connections, with link")
    p.set_defaults(func=_runner(_conns))

    p = sub.add_parser("stats", parents=[common], help="counters (smcd stats show|reset)")
    p.add_argument("action", nargs="?", choices=["show", "reset"], default="show")
    p.add_argument(
        "--openmetrics",
        action="store_true",
        help="counters in the OpenMetrics text format (node-exporter textfile collector)",
    )
    p.set_defaults(func=_runner(_stats))

    from smcd_daemon.cli import monitor

    monitor.register(sub, common, _runner)


# -- commands ----------------------------------------------------------------------------------


async def _info(client: SmcdClient, args: argparse.Namespace) -> int:
    (info,) = await client.call("GetInfo")
    if _json(args):
        _print_json(info)
        return 0
    caps = info.get("Capabilities", [])
    smcr: list[tuple[str, object]] = []
    if any(str(c).startswith("SMC-R") for c in caps):
        # The capabilities are the configured modes, as the kernel's are the versions it
        # supports; whether SMC-R can be used now is the RDMA ports' state.
        devices = _objects_with(await client.managed_objects(), DEVICE_INTERFACE)
        smcr = [("SMC-R ports", devices_view.smcr_ports(devices))]
    print(
        _kv(
            [
                ("smcd version", info.get("Version", "")),
                ("SMC protocol", info.get("SmcProtocol", "")),
                ("Hostname", info.get("Hostname", "")),
                ("Capabilities", ", ".join(caps) or "none"),
                *smcr,
                ("SEID", info.get("Seid") or "-"),
                ("SEID status", info.get("SeidStatus", "")),
                ("UEIDs", ", ".join(info.get("Ueids", [])) or "none"),
                ("PID", info.get("Pid", "")),
            ]
        )
    )
    return 0


async def _device(client: SmcdClient, args: argparse.Namespace) -> int:
    try:
        (namespaces,) = await client.call("NamespaceDevices")
    except CliError as e:  # an older smcd, or a bus policy without the method: its own only
        print(f"smcctl: devices of other network namespaces not shown: {e}", file=sys.stderr)
        own = _objects_with(await client.managed_objects(), DEVICE_INTERFACE)
        namespaces = [(0, "host", True, own, "")]
    devices, problems = devices_view.by_namespace(namespaces)
    devices = devices_view.matching(devices, args.netns)
    if args.name:
        devices = [d for d in devices if d.get("Name") == args.name]
        if not devices:
            where = f" in network namespace {args.netns}" if args.netns else ""
            raise CliError(f"device show: smcd knows no device named {args.name!r}{where}")
    for line in problems:
        print(f"smcctl: {line}", file=sys.stderr)
    if _json(args):
        _print_json(devices)
        return 0
    print(render_table(devices_view.HEADERS, devices_view.table_rows(devices)))
    return 0


def _pnet_rows(entries: Iterable[Sequence[Any]]) -> list[dict[str, Any]]:
    """Rows of ``PnetListNs``/``PnetAddNs`` ``(pnetid, netdev, ibdev, port, netns)``; a row
    has "netns" only for a netdev of another namespace than smcd's (rows of smcd's own stay as
    they were before namespaces; RDMA/ISM devices are shared by every namespace)."""
    rows: list[dict[str, Any]] = []
    for p, nd, ib, port, ns in entries:
        row = {"pnetid": p, "netdev": nd or None, "ibdev": ib or None, "ibport": port or None}
        if ns:
            row["netns"] = ns
        rows.append(row)
    return rows


async def _pnet(client: SmcdClient, args: argparse.Namespace) -> int:
    action, pnetid = args.action, args.pnetid
    spelled = [
        (verb, value)
        for verb, value in (
            ("add", args.add),
            ("del", args.delete),
            ("show", args.show),
            ("flush", "" if args.flush else None),
        )
        if value is not None
    ]
    if spelled:  # smc_pnet's own spelling; argparse lets at most one of them through
        if action is not None or pnetid is not None:
            raise _usage("pnet: give either a verb (show/add/del/flush) or -a/-d/-f/-s, not both")
        action, pnetid = spelled[0][0], spelled[0][1] or None
    action = action or "show"
    if action != "add" and (args.interface or args.ibdevice or args.ibport is not None):
        raise _usage("pnet: -I, -D and -P belong to 'add'")
    if action == "flush" and args.netns is not None:
        raise _usage("pnet flush empties every namespace's entries: it takes no --netns")
    netns = "" if args.netns in (None, "host") else args.netns
    if action in ("add", "del") and not pnetid:
        raise _usage(f"pnet {action}: give the PNETID")
    if action == "flush" and pnetid:
        raise _usage("pnet flush takes no PNETID")

    if action == "show":
        (entries,) = await client.call("PnetListNs")
        rows = _pnet_rows(entries)
        if pnetid:
            want = pnetid.strip().upper()
            rows = [r for r in rows if r["pnetid"] == want]
        if args.netns is not None:  # that namespace's netdevs (smcd's own: and RDMA/ISM)
            rows = [r for r in rows if r.get("netns", "") == netns]
        if _json(args):
            _print_json(rows)
        elif rows:
            # the Netns column appears once an entry names another namespace than smcd's
            per_ns = any("netns" in r for r in rows)
            print(
                render_table(
                    ("PNETID", "Net-Dev", "IB-Dev", "IB-Port") + (("Netns",) if per_ns else ()),
                    [
                        (
                            r["pnetid"],
                            r["netdev"] or "n/a",
                            r["ibdev"] or "n/a",
                            r["ibport"] if r["ibport"] is not None else 255,
                        )
                        + (
                            (r.get("netns") or ("host" if r["netdev"] else "all"),)
                            if per_ns
                            else ()
                        )
                        for r in rows
                    ],
                )
            )
        return 0
    if action == "add":
        if args.interface is None and args.ibdevice is None:
            raise _usage(
                "pnet add: give a network device (-I ETH), an RDMA/ISM device (-D), or both"
            )
        if args.ibport is not None and args.ibdevice is None:
            raise _usage("pnet add: -P PORT needs -D IBDEV")
        port = args.ibport if args.ibport is not None else 0
        if not 0 <= port <= 255:
            raise _usage(f"pnet add: port {port} is out of range: the port is 1 or 2")
        if netns and args.interface is None:
            raise _usage("pnet add: --netns names the namespace of -I ETH; give -I")
        (added,) = await client.call(
            "PnetAddNs",
            "sssys",
            [pnetid, args.interface or "", args.ibdevice or "", port, netns],
        )
        if _json(args):
            _print_json(_pnet_rows(added))
        return 0
    if action == "del" and args.netns is not None:
        (n,) = await client.call("PnetRemoveNs", "ss", [pnetid, netns])
    elif action == "del":
        (n,) = await client.call("PnetRemove", "s", [pnetid])
    else:
        (n,) = await client.call("PnetFlush")
    if _json(args):
        _print_json({"removed": n})
    return 0


async def _ueid(client: SmcdClient, args: argparse.Namespace) -> int:
    action = args.action
    if action in ("add", "del") and not args.ueid:
        raise _usage(f"ueid {action}: give the UEID")
    if action in ("show", "flush") and args.ueid:
        raise _usage(f"ueid {action} takes no UEID")
    if action == "show":
        (ueids,) = await client.call("UeidList")
        if _json(args):
            _print_json(ueids)
        else:
            for u in ueids:
                print(u)
        return 0
    if action == "add":
        (result,) = await client.call("UeidAdd", "s", [args.ueid])
    elif action == "del":
        (result,) = await client.call("UeidRemove", "s", [args.ueid])
    else:
        (n,) = await client.call("UeidFlush")
        result = {"removed": n}
    if _json(args):
        _print_json(result)
    return 0


def _lgr_peer(lg: Mapping[str, Any]) -> str:
    return str(lg.get("PeerGid") or lg.get("PeerHostname") or "-")


async def _linkgroup(client: SmcdClient, args: argparse.Namespace) -> int:
    objects = await client.managed_objects()
    groups = _objects_with(objects, LINK_GROUP_INTERFACE)
    links = _objects_with(objects, LINK_INTERFACE)
    if args.lgr_id:
        try:
            want = int(args.lgr_id, 16)
        except ValueError:
            raise _usage(f"linkgroup show: LG-ID {args.lgr_id!r} is not hexadecimal") from None
        groups = [g for g in groups if g.get("Id") == want]
        if not groups:
            raise CliError(f"linkgroup show: no link group {want:08x}")
    by_group: dict[str, list[dict[str, Any]]] = {}
    for lk in links:
        by_group.setdefault(str(lk.get("LinkGroup")), []).append(lk)
    if _json(args):
        out = []
        for g in groups:
            item = dict(g)
            if args.links:
                item["LinkObjects"] = by_group.get(g["Path"], [])
            out.append(item)
        _print_json(out)
        return 0
    if not groups:
        print("no link groups")
        return 0
    rows = [
        (
            f"{g.get('Id', 0):08x}",
            g.get("Type", ""),
            g.get("Role", ""),
            g.get("LgrType", ""),
            g.get("VlanId", 0),
            g.get("Connections", 0),
            (g.get("PnetId") or "-") + ("*" if g.get("PnetIdByUser") else ""),
            g.get("NetDev") or "-",
            _lgr_peer(g),
        )
        for g in groups
    ]
    headers = ("LG-ID", "Type", "LG-Role", "LG-Type", "VLAN", "#Conns", "PNET-ID", "Net-Dev",
               "Peer")  # fmt: skip
    print(render_table(headers, rows))
    if args.links:
        link_rows = [
            (
                f"{g.get('Id', 0):08x}",
                lk.get("Id", 0),
                lk.get("State", ""),
                lk.get("LinkUid") or "-",
                lk.get("PeerLinkUid") or "-",
                lk.get("IbDev") or "-",
                lk.get("IbPort", 0),
                lk.get("Gid") or "-",
                lk.get("PeerGid") or "-",
            )
            for g in groups
            for lk in by_group.get(g["Path"], [])
        ]
        print()
        link_headers = ("LG-ID", "Link", "Link-State", "Link-UID", "Peer-UID", "IB-Dev", "IB-P",
                        "Local-GID", "Peer-GID")  # fmt: skip
        if link_rows:
            print(render_table(link_headers, link_rows))
        else:
            print("no links")
    return 0


def _addr(ip: str, port: int) -> str:
    if not ip:  # a wildcard listener keeps its port; no peer at all is "*"
        return f"*:{port}" if port else "*"
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def mode_text(conn: Mapping[str, Any]) -> str:
    """smcss's Mode column: SMCD, SMCR or ``TCP 0xREASON/0xPEERDIAG`` plus the reason's name."""
    mode = str(conn.get("Mode", ""))
    if mode != "TCP":
        return mode
    reason = int(conn.get("FallbackReason", 0))
    peer = int(conn.get("PeerDiagnosis", 0))
    text = f"TCP 0x{reason:08x}/0x{peer:08x}"
    name = conn.get("FallbackName") or ""
    if not name and reason:
        from smcd_daemon.wire.reasons import explain

        name = explain(reason).name or ""
    return f"{text} ({name})" if name else text


def _cursor(value: Sequence[int]) -> str:
    wrap, count = [*value, 0, 0][:2]
    return f"{wrap}:{count}"


async def _conns(client: SmcdClient, args: argparse.Namespace) -> int:
    objects = await client.managed_objects()
    conns = _objects_with(objects, CONNECTION_INTERFACE)
    links = {lk["Path"]: lk for lk in _objects_with(objects, LINK_INTERFACE)}
    if args.listening:
        conns = [c for c in conns if c.get("State") == "LISTEN"]
    elif not args.all:
        conns = [c for c in conns if c.get("State") != "LISTEN"]
    if args.smcd:
        conns = [c for c in conns if c.get("Mode") == "SMCD"]
    if args.smcr:
        conns = [c for c in conns if c.get("Mode") == "SMCR"]
    if _json(args):
        _print_json(conns)
        return 0
    headers = ["State", "UID", "Inode", "Local Address", "Peer Address", "Intf", "Mode"]
    netns = any(c.get("Netns") for c in conns)
    if netns:
        headers.append("Netns")
    rows: list[list[object]] = []
    for c in conns:
        row: list[object] = [
            c.get("State", ""),
            c.get("Uid", 0),
            c.get("Inode", 0),
            _addr(c.get("LocalAddress", ""), c.get("LocalPort", 0)),
            _addr(c.get("PeerAddress", ""), c.get("PeerPort", 0)),
            c.get("NetDev") or "-",
            mode_text(c),
        ]
        if netns:  # the handing process's network namespace when it is not smcd's (#15)
            row.append(c.get("Netns") or "-")
        if args.debug:
            row += [
                f"0x{int(c.get('Token', 0)):08x}",
                c.get("SndbufSize", 0),
                c.get("RmbeSize", 0),
                c.get("PeerRmbeSize", 0),
                _cursor(c.get("RxProducer", (0, 0))),
                _cursor(c.get("RxConsumer", (0, 0))),
                _cursor(c.get("TxProducer", (0, 0))),
                _cursor(c.get("TxConsumer", (0, 0))),
            ]
        if args.smcr:
            lk = links.get(str(c.get("Link")), {})
            row += [
                c.get("Role", ""),
                lk.get("IbDev") or "-",
                lk.get("IbPort", 0),
                lk.get("Id", 0),
                lk.get("Gid") or "-",
                lk.get("PeerGid") or "-",
            ]
        rows.append(row)
    if args.debug:
        headers += ["Token", "Sndbuf", "Rcvbuf", "Peerbuf", "rxprod-Cursor", "rxcons-Cursor",
                    "txprod-Cursor", "txcons-Cursor"]  # fmt: skip
    if args.smcr:
        headers += ["Role", "IB-Device", "Port", "Linkid", "GID", "Peer-GID"]
    print(render_table(headers, rows))
    return 0


_TECHS = (("smcd", "SMC-D"), ("smcr", "SMC-R"))


async def _stats(client: SmcdClient, args: argparse.Namespace) -> int:
    if args.action == "reset":
        await client.call("StatsReset")
        if _json(args):
            _print_json({"reset": True})
        return 0
    if args.openmetrics:
        from smcd_daemon.cli.metrics import openmetrics

        counters, fallbacks = await client.call("StatsGet")
        print(openmetrics(counters, fallbacks, await client.managed_objects()), end="")
        return 0
    counters, fallbacks = await client.call("StatsGet")
    from smcd_daemon.wire.reasons import explain

    fb = [
        {"reason": code, "name": explain(code).name or f"0x{code:08x}", "server": s, "client": c}
        for code, s, c in fallbacks
    ]
    if _json(args):
        _print_json({"counters": counters, "fallbacks": fb})
        return 0
    total = counters.get("connections.total", 0)
    print(f"Total connections handled  {total}")
    print(
        f"TCP fallbacks              {counters.get('fallback.server', 0)} as server, "
        f"{counters.get('fallback.client', 0)} as client"
    )
    print()
    rows = []
    for key, tech in _TECHS:
        for role in ("server", "client"):
            rows.append(
                (
                    tech,
                    role,
                    counters.get(f"{key}.{role}.v1", 0),
                    counters.get(f"{key}.{role}.v2", 0),
                    counters.get(f"{key}.{role}.handshake_errors", 0),
                )
            )
    print(render_table(("Tech", "Role", "SMC v1", "SMC v2", "Handshake errors"), rows))
    print()
    rows2 = [
        (
            tech,
            counters.get(f"{key}.tx_bytes", 0),
            counters.get(f"{key}.tx_calls", 0),
            counters.get(f"{key}.rx_bytes", 0),
            counters.get(f"{key}.rx_calls", 0),
        )
        for key, tech in _TECHS
    ]
    print(render_table(("Tech", "TX bytes", "TX requests", "RX bytes", "RX requests"), rows2))
    print()
    if fb:
        print(
            render_table(
                ("Fallback reason", "Name", "Server", "Client"),
                [(f"0x{f['reason']:08x}", f["name"], f["server"], f["client"]) for f in fb],
            )
        )
    else:
        print("no TCP fallbacks")
    return 0
