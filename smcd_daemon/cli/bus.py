"""smcctl commands that talk to a running smcd over D-Bus."""

from __future__ import annotations

import argparse
import sys
from typing import Any

COMMANDS = ("info", "device", "pnet", "ueid", "linkgroup", "conns", "stats")


def register(sub: Any) -> None:
    for name in COMMANDS:
        p = sub.add_parser(name, help=f"{name} (not yet implemented)")
        p.set_defaults(func=_todo)


def _todo(args: argparse.Namespace) -> int:
    print(f"smcctl {args.command}: not yet implemented", file=sys.stderr)
    return 1
