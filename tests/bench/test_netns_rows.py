"""``bench/run.py --sections netns --quick`` (the two-namespace rows of ``make bench``, #15): two
container namespaces on a real bridge, the stdlib program on TCP through the bridge, on TCP
loopback and under smc-run against one smcd in the host's namespace; every row complete, from
one run.

Checks structure, never speed: each row has all three figures, the ratios that follow, and
the transport smc-run -v reported for every connection (``smcd``: loopback-ism across the
namespaces); the namespaces are gone afterwards.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RUN = REPO / "bench" / "run.py"
NUM = r"[\d,]+(?:\.\d+)?"
LABELS = {
    "bulk, 64 KiB writes": ("GB/s", "higher"),
    "round trip 1 B, p50": ("us", "lower"),
    "round trip 64 KiB, p50": ("us", "lower"),
}


def _netns() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    return {line.split()[0] for line in out.stdout.splitlines() if line.strip()}


def test_quick_netns_rows_are_complete() -> None:
    assert os.geteuid() == 0, "the two-namespace rows make namespaces: run the suite as root"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SMCD_")}
    proc = subprocess.run(
        [sys.executable, os.fspath(RUN), "--sections", "netns", "--quick"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr[-2000:]
    assert "note:" not in out and "not measured" not in out, out
    head = next(line for line in out.splitlines() if line.startswith("metric "))
    assert head.split() == ["metric", "unit", "tcp-lo", "tcp-bridge", "smc-run", "smc/bridge",
                            "smc/lo", "better", "mode"]  # fmt: skip
    for label, (unit, better) in LABELS.items():
        row = re.search(
            rf"^{re.escape(label)}\s+{re.escape(unit)}\s+({NUM})\s+({NUM})\s+({NUM})\s+"
            rf"(\d+\.\d\d)x\s+(\d+\.\d\d)x\s+{better}\s+(.+)$",
            out, flags=re.M,
        )  # fmt: skip
        assert row, f"row {label!r} missing or incomplete:\n{out}"
        lo, tcp, smc = (float(v.replace(",", "")) for v in row.group(1, 2, 3))
        for shown, base in ((row.group(4), tcp), (row.group(5), lo)):
            assert abs(float(shown) - smc / base) <= 0.01 + 0.05 * smc / base, row.group(0)
        assert row.group(6).strip() == "smcd", row.group(0)
    assert not any(n.startswith("smcdbench") for n in _netns()), _netns()


def test_a_stopped_run_removes_its_namespaces() -> None:
    """SIGTERM in the middle of the rows (a CI job cancelled) still tears the namespaces and
    the private smcd down, as an error would: it used to leave both behind."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SMCD_")}
    before = _bench_smcds()
    proc = subprocess.Popen(
        [sys.executable, os.fspath(RUN), "--sections", "netns", "--quick"],
        cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    mine = f"smcdbench{proc.pid % 1000}"
    try:
        assert proc.stderr is not None
        for line in proc.stderr:  # progress lines: the first measurement runs in the namespaces
            if "netns " in line:
                break
        assert any(n.startswith(mine) for n in _netns()), _netns()
        proc.terminate()
        assert proc.wait(timeout=60) == 128 + 15
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not any(n.startswith(mine) for n in _netns()), _netns()
    assert _bench_smcds() <= before  # its smcd is gone too


def _bench_smcds() -> set[str]:
    """Pids of the private smcds the two-namespace rows start (their runtime dir's name)."""
    out = subprocess.run(["pgrep", "-f", "smcd-bench-netns-"], capture_output=True, text=True)
    return set(out.stdout.split())
