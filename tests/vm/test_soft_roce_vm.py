"""The Soft-RoCE VM as seen from the host: it boots Debian's kernel, sets up the rxe network, and
every guest test reports back a real pass or failure (with its failure text).

Each guest test under ``tests/vm/guest/`` appears here as ``test_guest[<its node id>]``.
"""

from __future__ import annotations

import warnings

import pytest

from tests.vm import topology
from tests.vm.conftest import GUEST_PARAM
from tests.vm.harness import VmRun, collected_guest_tests, vm_timeout

# The first test waits for the kernel fetch and the whole VM run: give it that long.
pytestmark = pytest.mark.timeout(vm_timeout() + 900)

_COLLECT_FAILED = "<guest collection failed>"


def require_vm(run: VmRun, *, details: bool = False) -> None:
    """Fail (never skip) with the reason when the VM did not get to run the guest tests; the
    console and guest logs are shown once, by the first test."""
    if run.error is not None:
        more = run.context() if details else "(logs: see test_vm_boots_debian_kernel)"
        pytest.fail(f"Soft-RoCE VM: {run.error}\n{more}", pytrace=False)


def test_vm_boots_debian_kernel(vm_run: VmRun) -> None:
    require_vm(vm_run, details=True)
    assert vm_run.guest["kernel"] == vm_run.kernel.version
    assert vm_run.kernel.config("CONFIG_RDMA_RXE") == "m"
    assert vm_run.kernel.config("CONFIG_SMC") == "m"


def test_guest_network_matches_topology(vm_run: VmRun) -> None:
    require_vm(vm_run)
    assert [topology.Port(**p) for p in vm_run.guest["ports"]] == list(topology.PORTS)


class GuestRebooted(UserWarning):
    """The guest died during a test and a second boot ran what it had not finished."""


def test_guest_session_complete(vm_run: VmRun) -> None:
    """The guest ran what the host selected, collected cleanly, and finished without hanging."""
    require_vm(vm_run)
    problems = []
    if vm_run.collect_errors:
        problems.append("guest collection errors:\n" + "\n".join(vm_run.collect_errors))
    if vm_run.running is not None:
        problems.append(f"guest test {vm_run.running} started and never reported")
    if vm_run.exitstatus not in (0, 1):  # 1: some test failed, reported by its own proxy
        problems.append(f"guest pytest exit status {vm_run.exitstatus}")
    missing = sorted(set(vm_run.collected or []) - set(vm_run.results))
    if missing:
        problems.append(f"guest tests without a result: {missing}")
    if problems:
        pytest.fail("\n".join(problems) + "\n" + vm_run.context(), pytrace=False)
    for why in vm_run.reboots:  # said in the summary of every run that needed a second boot
        warnings.warn(GuestRebooted(why), stacklevel=1)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if GUEST_PARAM in metafunc.fixturenames:
        ids, _error = collected_guest_tests()
        short = [i.removeprefix("tests/vm/guest/") for i in ids]
        metafunc.parametrize(GUEST_PARAM, list(ids) or [_COLLECT_FAILED], ids=short or ["collect"])


def test_guest(vm_run: VmRun, guest_test: str) -> None:
    """One guest test's own outcome: pass, or fail with the text the guest reported."""
    if guest_test == _COLLECT_FAILED:
        pytest.fail(collected_guest_tests()[1] or "no guest tests found", pytrace=False)
    require_vm(vm_run)
    res = vm_run.results.get(guest_test)
    if res is None or vm_run.running == guest_test:
        if vm_run.running == guest_test:
            why = "started in the guest and never finished (hang or guest crash)"
        elif vm_run.collected is not None and guest_test not in vm_run.collected:
            why = "was not collected inside the VM"
        else:
            why = "did not run: the guest session ended before it"
        pytest.fail(f"{guest_test} {why}\n{vm_run.context()}", pytrace=False)
    if res.outcome != "passed":
        pytest.fail(
            f"guest test {res.outcome} ({res.duration:.1f} s in the VM):\n{res.text}",
            pytrace=False,
        )
