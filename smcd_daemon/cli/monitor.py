"""``smcctl monitor``: a live view of smcd from its D-Bus signals, like ``ip monitor``.

One line per event, as it happens: connections appearing, changing state or mode and closing,
fallbacks with their reason names (``Manager1.Fallback``), link state changes
(``Manager1.LinkStateChanged``), link groups and devices coming and going or changing
(``InterfacesAdded``/``InterfacesRemoved``/``PropertiesChanged`` from the ObjectManager at
``/org/smcd``). ``--json`` prints one JSON object per line for scripts (``event``, ``time``,
``path`` and the event's fields). The match rules are in place before the first line on stderr
("monitoring ..."), so nothing that happens after it is missed. ``--count N`` stops after N
events; otherwise the monitor runs until interrupted or until smcd leaves the bus (exit 1).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Mapping
from typing import Any

from dbus_fast import Message, MessageType, Variant

from smcd_daemon.adapters.dbus.names import (
    BUS_NAME,
    CONNECTION_INTERFACE,
    DEVICE_INTERFACE,
    LINK_GROUP_INTERFACE,
    LINK_INTERFACE,
    MANAGER_INTERFACE,
    OBJECT_MANAGER_INTERFACE,
    PROPERTIES_INTERFACE,
    ROOT_PATH,
)
from smcd_daemon.cli.bus import CliError

__all__ = ["Monitor", "describe", "register"]

#: Object kinds by interface, as the events name them.
KINDS = {
    CONNECTION_INTERFACE: "connection",
    LINK_GROUP_INTERFACE: "linkgroup",
    LINK_INTERFACE: "link",
    DEVICE_INTERFACE: "device",
}
#: Properties a line shows for an object that appears (the rest are in --json).
_SUMMARY = {
    "connection": ("Role", "Mode", "State", "LocalAddress", "LocalPort", "PeerAddress",
                   "PeerPort", "Uid"),
    "linkgroup": ("Id", "Type", "Role", "PeerGid", "PeerHostname"),
    "link": ("Id", "State", "IbDev", "IbPort", "Gid", "PeerGid"),
    "device": ("Name", "Kind", "OperState", "PnetId"),
}  # fmt: skip
#: Properties whose changes are worth a line; others (cursors, byte counts) only in --json.
_NOTABLE = {
    "connection": {"State", "Mode", "FallbackReason", "FallbackName", "LinkGroup", "Link"},
    "linkgroup": {"LgrType", "Connections", "Links"},
    "link": {"State"},
    "device": {"OperState", "Up", "Carrier", "Enabled", "PnetId", "Ports", "Addresses"},
}


def _unwrap(value: Any) -> Any:
    if isinstance(value, Variant):
        return _unwrap(value.value)
    if isinstance(value, dict):
        return {k: _unwrap(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_unwrap(v) for v in value]
    return value


def _name(kind: str, path: str, props: Mapping[str, Any]) -> str:
    if kind == "connection":
        return f"conn {path.rsplit('/', 1)[-1]}"
    if kind == "device":
        return f"device {props.get('Name') or path.rsplit('/', 1)[-1]}"
    if kind == "linkgroup":
        return f"linkgroup {path.rsplit('/', 1)[-1]}"
    if kind == "link":
        parts = path.split("/")
        return f"link {parts[-3]}/{parts[-1]}" if len(parts) >= 3 else f"link {path}"
    return path


def _fmt(value: Any) -> str:
    if isinstance(value, list):
        return "[" + " ".join(_fmt(v) for v in value) + "]"
    return str(value)


def describe(event: Mapping[str, Any]) -> str:
    """The text line for an event (without the time stamp)."""
    kind = event["event"]
    if kind == "fallback":
        return (
            f"fallback conn {event['path'].rsplit('/', 1)[-1]}: {event['reason_name']} "
            f"(0x{event['reason']:08x}, peer diagnosis 0x{event['peer_diagnosis']:08x})"
        )
    if kind == "link-state":
        return f"{_name('link', event['link'], {})} state {event['old']} -> {event['new']}"
    obj, _, what = kind.partition("-")
    label = _name(obj, event["path"], event.get("properties", {}))
    if what == "added":
        props = event.get("properties", {})
        shown = " ".join(
            f"{k}={_fmt(props[k])}" for k in _SUMMARY.get(obj, ()) if props.get(k) not in (None, "")
        )
        return f"{label} added {shown}".rstrip()
    if what == "removed":
        return f"{label} removed"
    changes = event.get("changes", {})
    parts = [f"{k} {_fmt(old)} -> {_fmt(new)}" for k, (old, new) in changes.items()]
    return f"{label} changed: " + ", ".join(parts)


class Monitor:
    """Turns smcd's signals into events; keeps the last properties of every object so that a
    change shows old -> new and a removal still names what went."""

    def __init__(self, objects: Mapping[str, Mapping[str, Mapping[str, Any]]]) -> None:
        self.objects: dict[str, dict[str, Any]] = {}
        self.kinds: dict[str, str] = {}
        for path, ifaces in objects.items():
            for iface, props in ifaces.items():
                if iface in KINDS:
                    self.kinds[path] = KINDS[iface]
                    self.objects[path] = dict(props)

    def events(self, msg: Message) -> list[dict[str, Any]]:
        if msg.message_type is not MessageType.SIGNAL:
            return []
        body = [_unwrap(v) for v in msg.body]
        member, iface, path = msg.member, msg.interface, msg.path or ""
        out: list[dict[str, Any]] = []
        if iface == MANAGER_INTERFACE and member == "Fallback":
            conn, reason, peer, name = body
            out.append(
                {"event": "fallback", "path": conn, "reason": reason, "peer_diagnosis": peer,
                 "reason_name": name}
            )  # fmt: skip
        elif iface == MANAGER_INTERFACE and member == "LinkStateChanged":
            link, old, new = body
            out.append({"event": "link-state", "link": link, "old": old, "new": new})
        elif iface == OBJECT_MANAGER_INTERFACE and member == "InterfacesAdded":
            obj_path, ifaces = body
            for name, props in ifaces.items():
                if name in KINDS:
                    kind = KINDS[name]
                    self.kinds[obj_path] = kind
                    self.objects[obj_path] = dict(props)
                    out.append({"event": f"{kind}-added", "path": obj_path, "properties": props})
        elif iface == OBJECT_MANAGER_INTERFACE and member == "InterfacesRemoved":
            obj_path, names = body
            for name in names:
                if name in KINDS:
                    kind = KINDS[name]
                    props = self.objects.pop(obj_path, {})
                    self.kinds.pop(obj_path, None)
                    out.append({"event": f"{kind}-removed", "path": obj_path, "properties": props})
        elif iface == PROPERTIES_INTERFACE and member == "PropertiesChanged":
            name, changed, _invalidated = body
            changed_kind = KINDS.get(name)
            if changed_kind is not None:
                old = self.objects.setdefault(path, {})
                changes = {k: [old.get(k), v] for k, v in changed.items()}
                old.update(changed)
                out.append(
                    {"event": f"{changed_kind}-changed", "path": path, "changes": changes,
                     "properties": dict(old),
                     "notable": bool(_NOTABLE[changed_kind] & changed.keys())}
                )  # fmt: skip
        return out


def _stamp(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t)) + f".{int(t * 1000) % 1000:03d}"


async def run_monitor(client: Any, args: argparse.Namespace) -> int:
    bus = client.connection
    as_json = bool(getattr(args, "json", False))
    verbose = bool(args.all)
    queue: asyncio.Queue[Message | None] = asyncio.Queue()

    def handler(msg: Message) -> None:
        if msg.message_type is MessageType.SIGNAL:
            queue.put_nowait(msg)

    bus.add_message_handler(handler)
    for rule in (
        f"type='signal',sender='{BUS_NAME}',path='{ROOT_PATH}'",
        f"type='signal',sender='{BUS_NAME}',interface='{PROPERTIES_INTERFACE}'",
        f"type='signal',sender='org.freedesktop.DBus',member='NameOwnerChanged',arg0='{BUS_NAME}'",
    ):
        reply = await bus.call(
            Message(
                destination="org.freedesktop.DBus", path="/org/freedesktop/DBus",
                interface="org.freedesktop.DBus", member="AddMatch", signature="s", body=[rule],
            )
        )  # fmt: skip
        if reply is None or reply.message_type is MessageType.ERROR:
            raise CliError(
                f"monitor: the bus refused the match rule {rule}: {reply and reply.body}"
            )
    monitor = Monitor(await client.managed_objects())
    print(f"smcctl: monitoring smcd on {client.label} (Ctrl-C to stop)", file=sys.stderr)
    sys.stderr.flush()
    bus_gone = asyncio.ensure_future(bus.wait_for_disconnect())
    bus_gone.add_done_callback(lambda _f: queue.put_nowait(None))
    shown = 0
    while args.count is None or shown < args.count:
        msg = await queue.get()
        if msg is None:
            print("smcctl: the bus connection closed", file=sys.stderr)
            return 1
        if msg.member == "NameOwnerChanged":
            if msg.body[2] == "":
                print("smcctl: smcd left the bus", file=sys.stderr)
                return 1
            continue
        for ev in monitor.events(msg):
            if ev["event"].endswith("-changed") and not (ev.pop("notable") or verbose):
                continue
            ev.pop("notable", None)
            now = time.time()
            if as_json:
                ev = {"time": round(now, 6), **ev}
                print(json.dumps(ev, sort_keys=False), flush=True)
            else:
                print(f"[{_stamp(now)}] {describe(ev)}", flush=True)
            shown += 1
            if args.count is not None and shown >= args.count:
                break
    return 0


def register(sub: Any, common: argparse.ArgumentParser, runner: Any) -> None:
    p = sub.add_parser(
        "monitor",
        parents=[common],
        help="live events: connections, fallbacks, link states, devices (like ip monitor)",
        description="Print smcd's events as they happen, one line each: connections added, "
        "changing state or mode and removed, fallbacks with their reason names, link state "
        "changes, link groups and devices. --json: one JSON object per line.",
    )
    p.add_argument(
        "-a", "--all", action="store_true",
        help="also every other property change (cursors, byte counts)",
    )  # fmt: skip
    p.add_argument("-n", "--count", type=int, metavar="N", help="exit after N events")
    p.set_defaults(func=runner(run_monitor))
