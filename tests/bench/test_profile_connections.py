"""``bench/profile_connections.py`` (issue 10's countable view of the connection rate): runs end
to end with a private smcd, and reports for smcd, the client and the server their CPU time and
Python calls per connection, and their top functions.

Checks structure, never speed: every figure is there and positive, the calls of each process
are in the range a connection takes (a profile that missed the connections counts almost none;
one that counted the start-up, tens of thousands), and smcd's list names its handoff code.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TOOL = REPO / "bench" / "profile_connections.py"
NUM = r"[\d,]+"


def test_the_profile_counts_each_process_per_connection() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SMCD_", "SMC_RUN"))}
    proc = subprocess.run(
        [sys.executable, os.fspath(TOOL), "--connections", "40", "--warmup", "5", "--top", "4"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr[-2000:]
    assert re.search(rf"^as it is: {NUM} connections/s, setup p50 {NUM} us$", out, re.M), out
    cpu = re.search(rf"^CPU, as it is \(us\)\s+({NUM})\s+({NUM})\s+({NUM})$", out, re.M)
    calls = re.search(rf"^Python calls, profiled\s+({NUM})\s+({NUM})\s+({NUM})$", out, re.M)
    assert cpu and calls, out
    assert all(int(v.replace(",", "")) > 0 for v in cpu.groups()), out
    smcd, client, server = (int(v.replace(",", "")) for v in calls.groups())
    assert 300 <= smcd <= 10_000, out
    assert 50 <= client <= 5_000 and 50 <= server <= 5_000, out
    for role in ("smcd", "client", "server"):
        for what in ("calls", "own CPU time"):
            assert f"{role}: top 4 by {what} per connection" in out, out
    assert "adapters/handoff/" in out.split("client: top")[0], out
