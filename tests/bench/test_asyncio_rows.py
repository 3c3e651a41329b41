"""``bench/asyncio_rows.py --quick`` (the asyncio rows of ``make bench``): runs end to end with
uvicorn, aiohttp, asyncio streams and trio on TCP and under smc-run, and prints every row
complete.

Checks structure, never speed: each row has both figures, its ratio, a met mark where it has a
target, and the transport smc-run -v reported (``smcd``: the private daemon has a UEID); the bound
row (asyncio alone) has its one figure; the share of the HTTP time outside the transport is a
percentage for both kinds.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ROWS = REPO / "bench" / "asyncio_rows.py"
NUM = r"[\d,]+(?:\.\d+)?"
LABELS = {
    "asyncio streams bulk, 64 KiB writes": ">= 2x tcp",
    "asyncio round trip 1 KiB, p50": "<= 0.5x tcp",
    "  the same, both ends in one process": "-",
    "uvicorn+aiohttp keep-alive 64 KiB": ">= 1x tcp",
    "uvicorn+aiohttp keep-alive 64 KiB, p50": "<= 1x tcp",
    "asyncio round trip 100 B -> 64 KiB, p50": "-",
    "trio bulk, 64 KiB send_all": "-",
    "trio round trip 1 KiB, p50": "-",
}


def test_quick_asyncio_rows_are_complete() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SMCD_")}
    proc = subprocess.run(
        [sys.executable, os.fspath(ROWS), "--quick"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr[-2000:]
    for label, target in LABELS.items():
        row = re.search(
            rf"^{re.escape(label)}\s+\S+\s+({NUM})\s+({NUM})\s+(\d+\.\d\dx)\s+"
            rf"{re.escape(target)}\s+(yes|NO|-)\s+(.+)$",
            out, flags=re.M,
        )  # fmt: skip
        assert row, f"row {label!r} missing or incomplete:\n{out}"
        assert row.group(5).strip() == "smcd", row.group(0)
        assert (row.group(4) == "-") == (target == "-"), row.group(0)
    bound = re.search(
        rf"^  bound: asyncio alone, no I/O\s+us\s+-\s+({NUM})\s+-\s+-\s+-\s+-$", out, flags=re.M
    )
    assert bound and float(bound.group(1).replace(",", "")) > 0, out
    share = re.search(r"^HTTP p50 outside the transport\s+%\s+(\d+)\s+(\d+)", out, flags=re.M)
    assert share and all(0 <= int(s) <= 100 for s in share.groups()), out


def test_a_program_that_hangs_becomes_a_note_with_its_stacks() -> None:
    """A quick run's program gets far less time than the test gives the whole run, and a hang
    reports where each thread of the hung program stood (a timeout of the test said nothing)."""
    sys.path.insert(0, os.fspath(ROWS.parent))
    try:
        import asyncio_rows as rows
    finally:
        sys.path.remove(os.fspath(ROWS.parent))
    assert rows.ASYNCIO_QUICK.timeout < 300 / 4
    sleeper = "import time\ndef parked_here():\n    time.sleep(60)\nparked_here()\n"
    proc = rows._Proc("tcp", dict(os.environ), [sys.executable, "-c", sleeper], timeout=1.0)
    try:
        try:
            proc.result()
        except rows._Hung as e:
            hung = e
        else:
            raise AssertionError("a sleeping program gave a result")
        proc.dump()
    finally:
        err = proc.stop()
    assert "no result within 1 s" in str(hung)
    assert "parked_here" in err and "Fatal Python error: Aborted" in err, err
