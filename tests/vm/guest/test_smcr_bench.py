"""The SMC-R benchmark (``bench/smcr_vm.py``) runs inside the Soft-RoCE VM: two private smcd
daemons, two application processes, smcd SMC-R, plain TCP and the kernel's own SMC-R (AF_SMC on
both ends, the anchor) over the same virtio wire (192.0.2.1 → 192.0.2.2). The test checks the run
is complete (every figure measured for all three, every ratio present, SMC-R really used on both
ends: ``sock.mode`` for smcd, ``smc_diag`` mode SMCR for every kernel connection) and that the
data was verified; it asserts no speed. The table goes to ``$SMCD_VM_OUT/smcr-bench.txt``
(``make bench-rdma`` prints it) and to stdout (``-s``, the guest log).
``SMCD_GUEST_BENCH_FULL=1`` runs the full volumes instead of ``--quick``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
BENCH = ROOT / "bench" / "smcr_vm.py"
ROWS = (
    "throughput, 64 KiB writes",
    "ping-pong RTT 64 B, p50",
    "ping-pong RTT 64 B, p99",
    "connect (+handoff), p50",
)


@pytest.mark.timeout(1500)  # the full run (make bench-rdma); --quick takes minutes
def test_smcr_bench_table_complete_and_verified(out_dir: Path, scratch: Path) -> None:
    table_file = out_dir / "smcr-bench.txt"
    raw_file = scratch / "smcr-bench.json"
    full = os.environ.get("SMCD_GUEST_BENCH_FULL") == "1"
    cmd = [sys.executable, str(BENCH), "--out", str(table_file), "--json", str(raw_file),
           "--logs", str(scratch / "daemons"), *([] if full else ["--quick"])]  # fmt: skip
    done = subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, timeout=1400 if full else 800, check=False
    )
    print(f"\n{done.stdout}\n--- progress\n{done.stderr[-3000:]}")
    assert done.returncode == 0, f"bench exit {done.returncode}:\n{done.stdout}\n{done.stderr}"
    assert table_file.read_text().strip() == done.stdout.strip()
    raw = json.loads(raw_file.read_text())
    assert raw["complete"] is True and not raw["notes"], raw["notes"]
    header, *rows = raw["table"]
    assert header[:8] == [
        "metric", "unit", "tcp", "smcr", "kernel", "smcr/tcp", "kernel/tcp", "smcr/kernel"
    ]  # fmt: skip
    assert tuple(r[0] for r in rows) == ROWS
    for r in rows:
        assert "n/a" not in r, r
        for ratio in r[5:8]:
            assert ratio.endswith("x") and float(ratio[:-1]) > 0, r
    # Every kernel connection's client end was SMCR in smc_diag (its server end too, or the
    # child would have failed the figure): throughput, ping-pong, and 1 + setup_count connects.
    kernel = raw["kernel"]
    assert kernel["version"] == os.uname().release, kernel
    assert kernel["client_modes"] == {"SMCR": 3 + raw["plan"]["setup_count"]}, kernel
    assert kernel["bulk_rmb_client"] > 0 and kernel["bulk_rmb_server"] > 0, kernel
    assert f"kernel: Linux {os.uname().release}, AF_SMC on both ends" in done.stdout
    for kind in ("tcp", "smcr", "kernel"):
        figures, verified = raw["figures"][kind], raw["verified"][kind]
        assert set(figures) == set(verified) == {"tput", "rtt_p50", "rtt_p99", "connect_p50"}
        assert all(verified.values()) and all(v > 0 for v in figures.values()), (kind, raw)
        assert raw["checked_bytes"][kind] >= raw["plan"]["tput_bytes"], raw["checked_bytes"]
    assert "data verified: yes" in done.stdout
