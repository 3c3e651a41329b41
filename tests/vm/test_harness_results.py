"""The VM harnesses' reading of the guest's results.jsonl: a guest that ends during a test
(a kernel panic, the OOM killer) must fail that test on the host, not pass it on its setup's
"passed" report, as the Soft-RoCE suite did in the CI run of stop 18."""

from __future__ import annotations

import json
from pathlib import Path

from tests.systemd import harness as systemd_harness
from tests.vm import harness
from tests.vm.kernel import KernelTree

DONE = "tests/vm/guest/test_x.py::test_done"
CUT = "tests/vm/guest/test_x.py::test_cut"


def _events(path: Path) -> None:
    lines = [{"event": "collected", "nodeids": [DONE, CUT]}]
    for nodeid, phases in ((DONE, ("setup", "call", "teardown")), (CUT, ("setup",))):
        lines.append({"event": "start", "nodeid": nodeid})
        for when in phases:
            lines.append(
                {
                    "event": "report",
                    "nodeid": nodeid,
                    "when": when,
                    "outcome": "passed",
                    "duration": 0.1,
                    "text": "",
                }
            )
    path.write_text("".join(json.dumps(e) + "\n" for e in lines))


def test_soft_roce_harness_fails_a_test_the_guest_ended_during(tmp_path: Path) -> None:
    _events(tmp_path / "results.jsonl")
    run = harness.VmRun(kernel=KernelTree(version="?", root=tmp_path), outdir=tmp_path)
    harness._read_results(run)
    assert run.results[DONE].outcome == "passed"
    assert run.results[CUT].outcome == "error"
    assert "guest ended during this test" in run.results[CUT].text
    assert run.running == CUT
    assert run.exitstatus is None


def test_systemd_harness_fails_a_test_the_vm_ended_during(tmp_path: Path) -> None:
    _events(tmp_path / "results.jsonl")
    run = systemd_harness.SystemdVmRun(outdir=tmp_path)
    systemd_harness._read_results(run)
    assert run.results["test_done"].outcome == "passed"
    assert run.results["test_cut"].outcome.startswith("started")
