"""``make demo`` end to end: ``python -m smcd_daemon.demo`` starts a private smcd, connects two
real processes through it, verifies the data, shows smcctl's view and stops the daemon.

The demo checks its own results and exits 0 only if all of them hold; these tests also look for
the lines that prove each step happened (a demo that silently skipped a section would still
exit 0 otherwise). It runs once as the current user (root in CI) and once as ``nobody``, since
the demo promises to work unprivileged.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
NOBODY = 65534
DEMO_BUDGET_S = 20.0


def run_demo(prefix: list[str] | None = None) -> tuple[subprocess.CompletedProcess[str], float]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SMCD_", "DBUS_", "XDG_"))}
    env["TMPDIR"] = "/tmp"
    argv = [*(prefix or []), sys.executable, "-m", "smcd_daemon.demo"]
    t0 = time.monotonic()
    proc = subprocess.run(
        argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=120, check=False
    )
    return proc, time.monotonic() - t0


def check_output(proc: subprocess.CompletedProcess[str], took: float) -> None:
    out = proc.stdout
    assert proc.returncode == 0, f"demo failed ({proc.returncode}):\n{out}\n{proc.stderr}"
    assert "FAILED" not in out, out
    # 1. the CLC handshake, message by message
    for name in ("Proposal", "Accept", "Confirm"):
        assert f"OK: {name} decoded equal to what was sent" in out, out
    # 2./3. both applications on smcd, data verified
    assert re.search(r"^  client: mode smcd, connection \d+, fallback None$", out, re.M), out
    assert re.search(r"^  server: mode smcd, connection \d+, fallback None$", out, re.M), out
    assert "ok: both ends are on smcd" in out
    assert re.search(
        r"ok: [\d,]+ bytes in odd-sized writes arrived intact \(sha256 [0-9a-f]{16}", out
    )
    # 4. smcctl's view while the connection is open: a link group, the connection on SMCD
    lg = out.split("$ smcctl linkgroup show\n", 1)[1].split("$ smcctl conns\n", 1)
    assert lg[0].strip() and "no link groups" not in lg[0], out
    assert re.search(r"^State\s+UID\s+Inode\s+Local Address\s+Peer Address", lg[1], re.M), out
    assert re.search(r"127\.0\.0\.1:\d+\s+127\.0\.0\.1:\d+\s+lo\s+SMCD", lg[1]), out
    # 5. the one-line comparison with TCP
    assert re.search(
        r"^  smcd [\d.]+ GB/s vs TCP loopback [\d.]+ GB/s: [\d.]+x \(\d+ MiB each\)$", out, re.M
    ), out
    # 6. a clean stop
    assert "ok: smcd stopped on SIGTERM with status 0" in out
    assert re.search(r"^demo: all checks passed in [\d.]+ s$", out, re.M), out
    assert took < DEMO_BUDGET_S * 2, f"the demo took {took:.1f} s (budget {DEMO_BUDGET_S} s)"


def test_demo_as_current_user() -> None:
    proc, took = run_demo()
    check_output(proc, took)


def test_demo_unprivileged() -> None:
    """As ``nobody`` (no capabilities, no home, no session bus): still a complete demo."""
    if os.geteuid() != 0:
        proc, took = run_demo()  # we are unprivileged already
        check_output(proc, took)
        return
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.fail("setpriv is missing: install util-linux (tests/host/install-deps.sh)")
    prefix = [setpriv, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--"]
    proc, took = run_demo(prefix)
    check_output(proc, took)
    assert "(as uid 65534;" in proc.stdout
