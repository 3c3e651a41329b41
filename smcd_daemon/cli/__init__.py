"""smcctl: the operator's command line, modelled on smc-tools.

Offline commands (``explain``, ``decode``) work on their arguments alone; the rest talk to a
running smcd over D-Bus. Each group of commands lives in its own module with a ``register``
function that adds its sub-commands to the parser.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from smcd_daemon import __version__
from smcd_daemon.cli import bus, check, offline


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="smcctl",
        description="Inspect and configure smcd, the userspace SMC daemon.",
    )
    parser.add_argument("--version", action="version", version=f"smcctl {__version__}")
    # Also accepted after the command; given here they apply to every D-Bus command.
    parser.add_argument(
        "--bus",
        default=argparse.SUPPRESS,
        metavar="BUS",
        help='"system", "session", "private" or a D-Bus address (default: $SMCD_BUS, else '
        "wherever smcd runs: the system bus, the bus it recorded, the session bus)",
    )
    parser.add_argument(
        "--json", action="store_true", default=argparse.SUPPRESS, help="machine-readable output"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    offline.register(sub)
    bus.register(sub)
    check.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except BrokenPipeError:
        return 0
    except KeyboardInterrupt:
        print("smcctl: interrupted", file=sys.stderr)
        return 130
