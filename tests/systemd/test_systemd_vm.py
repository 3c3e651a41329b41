"""smcd installed with ``make install`` and run by systemd as PID 1, checked from inside a VM.

Each guest test of ``guest/test_service.py`` (install, socket activation, notify, peer detection
with exactly CAP_BPF and CAP_NET_ADMIN and without them, the netns drop-in, watchdog, reload,
journal, D-Bus activation and policy, unprivileged use, stop, security score, uninstall)
appears here as ``test_in_systemd_vm[<name>]`` and fails with the guest's failure text; a VM
that could not run fails every one of them with the reason (never a skip).
"""

from __future__ import annotations

import pytest

from tests.systemd.harness import DEFAULT_TIMEOUT, SystemdVmRun, guest_test_names

pytestmark = pytest.mark.timeout(2 * DEFAULT_TIMEOUT + 900)  # wheels, a boot, a second boot


@pytest.mark.parametrize("name", guest_test_names())
def test_in_systemd_vm(systemd_vm: SystemdVmRun, name: str) -> None:
    if systemd_vm.error is not None:
        pytest.fail(f"systemd VM: {systemd_vm.error}\n{systemd_vm.context()}", pytrace=False)
    res = systemd_vm.results.get(name)
    if res is None:
        pytest.fail(f"{name} did not run in the guest\n{systemd_vm.context()}", pytrace=False)
    if res.outcome != "passed":
        pytest.fail(f"{name} {res.outcome} in the guest:\n{res.text}", pytrace=False)
