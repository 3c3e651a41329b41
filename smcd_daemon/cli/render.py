"""Rendering of typed values (dataclasses, enums, bytes) as aligned text or JSON-ready data.

One place decides how smcctl shows protocol values, so ``decode``, ``explain`` and the D-Bus
commands look alike and ``--json`` output stays stable for scripts:

* dataclass → object whose keys are the field names, in declaration order (stable keys);
* enum → ``{"value": 3, "name": "CONFIRM"}`` (flags: ``name`` is ``"A|B"``, or null if none);
* bytes → lowercase hex string, except: a 6-byte field whose name contains ``mac`` → ``aa:bb:..``,
  a 16-byte field whose name contains ``gid`` → IPv6 text (``::ffff:192.0.2.1`` for IPv4-mapped),
  ``ipaddress`` objects → their text; a field may force a style with dataclass metadata
  ``{"render": "mac" | "gid" | "hex" | "text"}``;
* int, bool, str, None → themselves; lists/tuples → lists.

Text output is the same tree printed as ``name : value`` lines, names padded to a common width per
level, nested values indented by two spaces; ints from 10 to 2**32 also show their hex, larger
ones (64-bit GIDs, tokens, addresses) only hex.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
from collections.abc import Iterable, Mapping
from enum import Enum, Flag
from typing import Any

__all__ = ["dumps_json", "render_text", "to_jsonable"]

_IP = (ipaddress.IPv4Address, ipaddress.IPv6Address, ipaddress.IPv4Network, ipaddress.IPv6Network)


def _bytes_style(name: str, value: bytes, forced: str | None) -> str:
    if forced:
        return forced
    lname = name.lower()
    if "mac" in lname and len(value) == 6:
        return "mac"
    if "gid" in lname and len(value) == 16:
        return "gid"
    return "hex"


def _render_bytes(name: str, value: bytes, forced: str | None = None) -> str:
    style = _bytes_style(name, value, forced)
    if style == "mac":
        return ":".join(f"{b:02x}" for b in value)
    if style == "gid" and len(value) == 16:
        addr = ipaddress.IPv6Address(value)
        # RoCEv2 GIDs of IPv4 ports are IPv4-mapped; show them as ::ffff:192.0.2.1 on every
        # Python version (3.11 would print ::ffff:c000:201).
        return f"::ffff:{addr.ipv4_mapped}" if addr.ipv4_mapped else str(addr)
    if style == "text":
        return value.decode("ascii", "replace").rstrip(" \x00")
    return value.hex()


def _enum_json(value: Enum) -> dict[str, Any]:
    name: str | None = value.name
    if isinstance(value, Flag) and name is None:
        members = [m.name for m in type(value) if m.value and (m.value & value.value) == m.value]
        name = "|".join(n for n in members if n) or None
    raw = value.value
    return {"value": raw if isinstance(raw, (int, str)) else str(raw), "name": name}


def to_jsonable(value: Any, name: str = "", forced: str | None = None) -> Any:
    """Turn a message value into plain JSON data (see the module docstring for the rules)."""
    if isinstance(value, Enum):
        return _enum_json(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out: dict[str, Any] = {}
        for f in dataclasses.fields(value):
            if f.name.startswith("_"):
                continue
            style = f.metadata.get("render") if f.metadata else None
            out[f.name] = to_jsonable(getattr(value, f.name), f.name, style)
        return out
    if isinstance(value, (bytes, bytearray, memoryview)):
        return _render_bytes(name, bytes(value), forced)
    if isinstance(value, _IP):
        return str(value)
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, Mapping):
        return {str(k): to_jsonable(v, str(k)) for k, v in value.items()}
    if isinstance(value, Iterable):
        return [to_jsonable(v, name, forced) for v in value]
    return str(value)


def dumps_json(value: Any) -> str:
    """JSON text of :func:`to_jsonable` (indented, keys in declaration order)."""
    return json.dumps(to_jsonable(value), indent=2)


def _int_text(value: int) -> str:
    """Small numbers as decimal; counters/tokens as decimal and hex; 64-bit ids as hex only."""
    if 0 <= value < 10:
        return str(value)
    if 0 <= value < 1 << 32:
        return f"{value} (0x{value:x})"
    return f"0x{value:x}" if value > 0 else str(value)


def _scalar_text(value: Any) -> str | None:
    """One-line text of a JSON-ready scalar, or None if it needs more lines."""
    if isinstance(value, dict) and set(value) == {"value", "name"}:
        raw = value["value"]
        if isinstance(raw, int) and not isinstance(raw, bool):
            shown = str(raw) if 0 <= raw < 10 else f"0x{raw:x}"
        else:
            shown = str(raw)
        name = value["name"] if value["name"] is not None else ("none" if raw == 0 else "?")
        return f"{name} ({shown})"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return _int_text(value)
    if value is None:
        return "-"
    if isinstance(value, str):
        return value if value != "" else "''"
    if isinstance(value, list) and not value:
        return "(none)"
    if isinstance(value, list) and all(_scalar_text(v) is not None for v in value):
        texts = [_scalar_text(v) or "" for v in value]
        if sum(len(t) + 2 for t in texts) <= 72:
            return ", ".join(texts)
    return None


def _lines(data: Any, indent: int) -> list[str]:
    pad = " " * indent
    if isinstance(data, dict) and set(data) != {"value", "name"}:
        if not data:
            return [pad + "(empty)"]
        width = max(len(k) for k in data)
        out: list[str] = []
        for key, val in data.items():
            text = _scalar_text(val)
            if text is not None:
                out.append(f"{pad}{key.ljust(width)} : {text}")
            else:
                out.append(f"{pad}{key}:")
                out.extend(_lines(val, indent + 2))
        return out
    if isinstance(data, list):
        out = []
        for i, item in enumerate(data):
            text = _scalar_text(item)
            if text is not None:
                out.append(f"{pad}[{i}] {text}")
            else:
                out.append(f"{pad}[{i}]")
                out.extend(_lines(item, indent + 2))
        return out
    return [pad + (_scalar_text(data) or str(data))]


def render_text(value: Any, indent: int = 0) -> str:
    """Aligned, indented text of a dataclass (or any value :func:`to_jsonable` accepts)."""
    return "\n".join(_lines(to_jsonable(value), indent))
