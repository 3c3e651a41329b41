"""smc-run: run an unmodified Python program on SMC (placeholder until the handoff issue lands)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    print("smc-run: not yet implemented", file=sys.stderr)
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
