"""smcctl commands that need no daemon: ``explain`` (reason codes) and ``decode`` (wire bytes).

Both are for the operator with a code from a log or bytes from a capture and no running smcd at
hand, so they work on their arguments alone and fail with one line and exit status 2 on bad input
(argparse's own convention for usage errors).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from typing import Any

from smcd_daemon.cli.render import render_text, to_jsonable
from smcd_daemon.errors import ProtocolError, SmcError
from smcd_daemon.wire import reasons

__all__ = ["HexInputError", "parse_hex", "register"]

EXIT_USAGE = 2

_EXPLAIN_EPILOG = """\
CODE is a CLC decline / fallback reason (peer_diagnosis, smcss's "TCP 0x...") or an LLC
DELETE LINK reason: hex with 0x (0x030f0000), 8 hex digits (030f0000) or decimal.
Unknown codes are still interpreted by their class byte (the top byte) and exit 0.

examples:
  smcctl explain 0x03030008
  smcctl explain --json 50528256
"""

_DECODE_EPILOG = """\
HEX is one SMC message: CLC (Proposal, Accept, Confirm, Decline; by its eyecatcher), LLC (44 bytes,
type 0x01-0x09 or v2 0x2X), SMC-R CDC (0xFE, 44 bytes) or the 32-byte SMC-D CDC header (0xFE, 32
bytes). Without HEX (or with -) the bytes are read from stdin. Whitespace, colons, dashes, commas
and 0x prefixes are ignored; xxd, hexdump -C and tshark -x style dumps (offset column first, ASCII
column last) are accepted when the first offset is 0.

--json prints {"kind", "message", "type", "type_hex", "length", "hex", "fields", "explanations"}:
type is the message's numeric type on the wire (CLC byte 4, LLC/CDC byte 0); fields keyed by
the protocol field names; bytes as lowercase hex, MACs as aa:bb:cc:dd:ee:ff, 16-byte GIDs as
IPv6 text; enums and flags as {"value": N, "name": "NAME"} (flags: "A|B", null for none).
explanations maps each reason-code field (a Decline's diagnosis, a DELETE LINK reason, an ADD
LINK reject reason) to {"code", "name", "meaning", "advice", ...} as smcctl explain --json.

Malformed bytes print one line naming the field and its byte offset, exit status 2.

examples:
  smcctl decode e2d4c3d9 04001c10 1234020000aabbcc 03030008 00000000 e2d4c3d9
  xxd -p message.bin | smcctl decode --json
"""


class HexInputError(SmcError):
    """Text given to ``smcctl decode`` that does not spell bytes."""


def register(sub: Any) -> None:
    """Add ``explain`` and ``decode`` to the smcctl sub-command parser."""
    p = sub.add_parser(
        "explain",
        help="explain an SMC decline/fallback or LLC reason code",
        description="Print the name, meaning and operator advice for an SMC reason code.",
        epilog=_EXPLAIN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("code", metavar="CODE", help="reason code, e.g. 0x03030008 or 50528264")
    p.add_argument(
        "--json",
        action="store_true",
        default=argparse.SUPPRESS,
        help="print the explanation as JSON",
    )
    p.set_defaults(func=cmd_explain)

    d = sub.add_parser(
        "decode",
        help="decode the hex bytes of a CLC, LLC or CDC message",
        description="Detect the kind of an SMC message from its bytes and print its fields.",
        epilog=_DECODE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    d.add_argument(
        "hex", nargs="*", metavar="HEX", help="message bytes as hex (default: read stdin)"
    )
    d.add_argument(
        "--json",
        action="store_true",
        default=argparse.SUPPRESS,
        help="print the decoded message as JSON",
    )
    d.set_defaults(func=cmd_decode)


def _fail(command: str, message: str) -> int:
    one_line = " ".join(message.split())
    print(f"smcctl {command}: {one_line}", file=sys.stderr)
    return EXIT_USAGE


# ---------------------------------------------------------------------------------------- explain


def _explanation_json(exp: reasons.Explanation) -> dict[str, Any]:
    return {
        "code": exp.code,
        "code_hex": exp.code_hex,
        "kind": exp.kind,
        "name": exp.name,
        "known": exp.known,
        "meaning": exp.meaning,
        "advice": exp.advice,
        "class": {"value": exp.class_byte, "description": exp.class_description},
    }


def _explanation_text(exp: reasons.Explanation, indent: str = "") -> list[str]:
    return [
        f"{indent}code    : {exp.code_hex} ({exp.code})",
        f"{indent}name    : {exp.name or 'unknown'}",
        f"{indent}kind    : {exp.kind}",
        f"{indent}class   : 0x{exp.class_byte:02x} - {exp.class_description}",
        f"{indent}meaning : {exp.meaning}",
        f"{indent}advice  : {exp.advice}",
    ]


def cmd_explain(args: argparse.Namespace) -> int:
    try:
        code = reasons.parse_code(args.code)
    except reasons.ReasonCodeError as exc:
        return _fail("explain", str(exc))
    exp = reasons.explain(code)
    if getattr(args, "json", False):
        print(json.dumps(_explanation_json(exp), indent=2))
    else:
        print("\n".join(_explanation_text(exp)))
    return 0


# ----------------------------------------------------------------------------------------- decode

_OFFSET = re.compile(r"^[0-9a-fA-F]{4,8}:?$")
_HEXTOKEN = re.compile(r"^(?:[0-9a-fA-F]{2})+$")
_SEPARATORS = re.compile(r"[\s:,\-]+")


def _ascii_column(data: bytes) -> str:
    return "".join(chr(b) if 0x20 <= b < 0x7F else "." for b in data)


def _dump_line(line: str) -> bytes:
    """Bytes of one ``offset  hex... ascii`` dump line (xxd, hexdump -C, tshark -x)."""
    parts = line.split(None, 1)
    rest = parts[1] if len(parts) > 1 else ""
    tokens = [(m.group(0), m.end()) for m in re.finditer(r"\S+", rest)]
    hex_count = 0
    for tok, _end in tokens:
        if not _HEXTOKEN.match(tok) or len(tok) > 8:
            break
        hex_count += 1
    # The ASCII column can itself look like hex ("ab", "cafe"): prefer the longest hex prefix
    # followed by exactly its ASCII rendering; only without one take all hex-looking tokens.
    for k in range(hex_count, 0, -1):
        data = bytes.fromhex("".join(t for t, _ in tokens[:k]))
        remainder = rest[tokens[k - 1][1] :].strip().strip("|").replace(" ", "")
        if remainder and remainder == _ascii_column(data).replace(" ", ""):
            return data
    return bytes.fromhex("".join(t for t, _ in tokens[:hex_count]))


def parse_hex(text: str) -> bytes:
    """Bytes from hex text as operators paste it (see ``smcctl decode --help``)."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if not lines:
        raise HexInputError("no bytes given (pass hex as an argument or on stdin)")
    first = lines[0].split()[0]
    if _OFFSET.match(first) and int(first.rstrip(":"), 16) == 0 and len(lines[0].split()) > 1:
        out = bytearray()
        for ln in lines:
            head = ln.split()[0]
            if not _OFFSET.match(head):
                continue  # a dump tool's caption line ("Frame (74 bytes):")
            out += _dump_line(ln)
        return bytes(out)
    compact = _SEPARATORS.sub(" ", text).split()
    digits = "".join(t[2:] if t[:2] in ("0x", "0X") else t for t in compact)
    for i, ch in enumerate(digits):
        if ch not in "0123456789abcdefABCDEF":
            raise HexInputError(f"input: {ch!r} at hex digit {i} is not a hex digit")
    if len(digits) % 2:
        raise HexInputError(f"input: odd number of hex digits ({len(digits)})")
    return bytes.fromhex(digits)


def _reason_fields(msg: Any) -> dict[str, reasons.Explanation]:
    """Reason-code fields of a decoded message, explained: a Decline's diagnosis (and any
    non-zero additional v2 diagnosis), a DELETE LINK reason, an ADD LINK reject reason."""
    found: dict[str, reasons.Explanation] = {}
    if not dataclasses.is_dataclass(msg):
        return found
    for f in dataclasses.fields(msg):
        value = getattr(msg, f.name)
        if f.name == "diagnosis" and isinstance(value, int):
            found[f.name] = reasons.explain(int(value))
        elif f.name == "diagnosis_v2" and isinstance(value, tuple):
            for i, code in enumerate(value):
                if isinstance(code, int) and code:
                    found[f"{f.name}[{i}]"] = reasons.explain(int(code))
        elif f.name == "reason" and type(msg).__name__ == "DeleteLink":
            found[f.name] = reasons.explain_delete_link(int(value))
        elif f.name == "reject_reason" and isinstance(value, int) and value:
            found[f.name] = reasons.explain_add_link_reject(int(value) & 0x0F)
    return found


def cmd_decode(args: argparse.Namespace) -> int:
    from smcd_daemon.wire import detect  # imported late: only decode needs every codec

    words = [w for w in args.hex if w != "-"]
    if not words and sys.stdin.isatty():
        print("smcctl decode: reading hex from stdin (end with Ctrl-D)", file=sys.stderr)
    text = " ".join(words) if words else sys.stdin.read()
    try:
        data = parse_hex(text)
    except HexInputError as exc:
        return _fail("decode", str(exc))
    if not data:
        return _fail("decode", "no bytes given (pass hex as an argument or on stdin)")
    try:
        kind = detect.kind_of(data)
        msg = detect.decode_any(data)
    except ProtocolError as exc:
        return _fail("decode", f"{len(data)}-byte input: {exc}")
    explained = _reason_fields(msg)
    # The message's numeric type as on the wire (CLC: after the 4-byte eyecatcher; LLC and CDC:
    # the first byte), also for messages whose fields do not carry it (LLC TEST LINK).
    msg_type = data[4] if kind == "clc" and len(data) > 4 else data[0]
    if getattr(args, "json", False):
        doc = {
            "kind": kind,
            "message": type(msg).__name__,
            "type": msg_type,
            "type_hex": f"0x{msg_type:02x}",
            "length": len(data),
            "hex": data.hex(),
            "fields": to_jsonable(msg),
            "explanations": {k: _explanation_json(v) for k, v in explained.items()},
        }
        print(json.dumps(doc, indent=2))
        return 0
    print(f"{detect.KIND_TITLES.get(kind, kind)}: {type(msg).__name__} ({len(data)} bytes)")
    print(f"  hex: {data.hex()}")
    print(render_text(msg, indent=2))
    for key, exp in explained.items():
        print(f"  {key} explained:")
        print("\n".join(_explanation_text(exp, indent="    ")))
    return 0
