"""smcd entry point (placeholder until the control-plane issue lands)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    print("smcd: the daemon is not yet implemented", file=sys.stderr)
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
