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


def _systemd_boots(
    monkeypatch: pytest.MonkeyPatch, first: systemd_harness.SystemdVmRun
) -> list[Path]:
    """Stand in for the systemd harness's single boot: ``first``, then a boot that runs all."""
    boots: list[Path] = []

    def boot(kernel: KernelTree, outdir: Path, timeout: int) -> systemd_harness.SystemdVmRun:
        boots.append(outdir)
        if len(boots) == 1:
            return first
        run = systemd_harness.SystemdVmRun(outdir=outdir, elapsed=50.0, exited=True)
        for name in systemd_harness.guest_test_names():
            run.results[name] = systemd_harness.Outcome("passed")
        return run

    monkeypatch.setattr(systemd_harness, "_boot_once", boot)
    return boots


def test_a_systemd_vm_that_ended_early_is_booted_once_more(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its tests are one sequence on one installation, so the second boot runs them all."""
    names = systemd_harness.guest_test_names()
    first = systemd_harness.SystemdVmRun(outdir=tmp_path, elapsed=300.0, exited=True)
    first.results[names[0]] = systemd_harness.Outcome("passed")
    first.results[names[1]] = systemd_harness.Outcome("started (never finished)")
    (tmp_path / "console.log").write_text("Kernel panic - not syncing\n")
    boots = _systemd_boots(monkeypatch, first)
    run = systemd_harness.boot(KernelTree(version="?", root=tmp_path), tmp_path, timeout=900)
    assert boots == [tmp_path, tmp_path / "reboot"]
    assert all(run.results[n].outcome == "passed" for n in names)
    assert run.elapsed == 350.0 and len(run.reboots) == 1
    assert names[1] in run.reboots[0] and "Kernel panic" in run.reboots[0]
    assert (tmp_path / "reboot.txt").read_text() == run.reboots[0]


@pytest.mark.parametrize("exited", [True, False])
def test_a_finished_or_killed_systemd_vm_is_not_booted_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exited: bool
) -> None:
    """A run whose tests all reported (failures included) stands; so does one the harness
    killed for its timeout, which a second boot would only repeat."""
    first = systemd_harness.SystemdVmRun(outdir=tmp_path, elapsed=300.0, exited=exited)
    for name in systemd_harness.guest_test_names():
        first.results[name] = systemd_harness.Outcome("failed" if exited else "not run")
    boots = _systemd_boots(monkeypatch, first)
    run = systemd_harness.boot(KernelTree(version="?", root=tmp_path), tmp_path, timeout=900)
    assert boots == [tmp_path] and run is first and not run.reboots
