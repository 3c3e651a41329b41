"""The VM harnesses' reading of the guest's results.jsonl: a guest that ends during a test
(a kernel panic, the OOM killer) must fail that test on the host, not pass it on its setup's
"passed" report, as the Soft-RoCE suite did in the CI run of stop 18."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.systemd import harness as systemd_harness
from tests.vm import harness
from tests.vm.harness import VmRun
from tests.vm.kernel import KernelTree

DONE = "tests/vm/guest/test_x.py::test_done"
CUT = "tests/vm/guest/test_x.py::test_cut"


def _events(path: Path) -> None:
    lines: list[dict[str, object]] = [{"event": "collected", "nodeids": [DONE, CUT]}]
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
    run = VmRun(kernel=KernelTree(version="?", root=tmp_path), outdir=tmp_path)
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


def test_a_guest_that_died_mid_test_is_booted_again_for_what_it_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The merge of two boots (the boots themselves are the real VM suite's): the first dies
    in CUT, the second runs CUT and nothing the first finished."""
    boots: list[list[str]] = []

    def boot(kernel: KernelTree, outdir: Path, selection: list[str], *_: object) -> VmRun:
        boots.append(selection)
        outdir.mkdir(parents=True, exist_ok=True)
        run = VmRun(kernel=kernel, outdir=outdir, elapsed=100.0)
        if len(boots) == 1:
            _events(outdir / "results.jsonl")
            harness._read_results(run)
        else:
            run.results[CUT] = harness.GuestResult(CUT, phases={"setup", "call", "teardown"})
            run.exitstatus = 0
        return run

    monkeypatch.setattr(harness, "_boot_once", boot)
    run = harness.boot_and_test(KernelTree(version="?", root=tmp_path), tmp_path, [], timeout=900)
    assert boots == [[], [CUT]]
    assert run.results[DONE].outcome == run.results[CUT].outcome == "passed"
    assert run.running is None and run.exitstatus == 0 and run.error is None
    assert len(run.reboots) == 1 and CUT in run.reboots[0]
    assert (tmp_path / "reboot.txt").read_text() == run.reboots[0]


def test_no_second_boot_without_time_for_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    boots: list[list[str]] = []

    def boot(kernel: KernelTree, outdir: Path, selection: list[str], *_: object) -> VmRun:
        boots.append(selection)
        run = VmRun(kernel=kernel, outdir=outdir, elapsed=800.0)
        _events(outdir / "results.jsonl")
        harness._read_results(run)
        return run

    monkeypatch.setattr(harness, "_boot_once", boot)
    run = harness.boot_and_test(KernelTree(version="?", root=tmp_path), tmp_path, [], timeout=900)
    assert boots == [[]]
    assert run.running == CUT and run.results[CUT].outcome == "error"
