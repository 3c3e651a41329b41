"""Host-side fixtures of the Soft-RoCE VM suite: one VM boot per pytest session.

The guest tests under ``guest/`` run only inside the VM; the host collects them through a
subprocess (``collect_guest_tests``) and proxies each one as ``test_guest[<node id>]``.
"""

from __future__ import annotations

import pytest

from tests.vm.harness import VmRun, boot_and_test, collected_guest_tests
from tests.vm.kernel import KernelError, KernelTree, ensure_kernel
from tests.vm.kmod import KmodError, ensure_rxe_module

collect_ignore = ["guest"]

#: Name of the parameter carrying a guest test's node id on the host proxies.
GUEST_PARAM = "guest_test"


def _selected_guest_tests(session: pytest.Session) -> list[str]:
    selected: set[str] = set()
    for item in session.items:
        callspec = getattr(item, "callspec", None)
        if callspec is not None and GUEST_PARAM in callspec.params:
            selected.add(callspec.params[GUEST_PARAM])
    return sorted(selected)


@pytest.fixture(scope="session")
def vm_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> VmRun:
    """The one VM boot of this session, with every selected guest test run inside it.

    A VM that cannot run is recorded in ``VmRun.error`` (each test then fails with it).
    """
    outdir = tmp_path_factory.mktemp("vm-out")
    try:
        kernel = ensure_kernel()
    except KernelError as exc:
        run = VmRun(kernel=KernelTree(version="?", root=outdir), outdir=outdir)
        run.error = f"cannot get the VM kernel: {exc}"
        return run
    # The kernel's SMC-R (guest test_kernel_oracle) needs a patched rxe; built once, cached. A
    # build failure does not stop the VM: the guest keeps the stock rxe and only that test fails.
    try:
        rxe_module = ensure_rxe_module(kernel).to_json()
    except KmodError as exc:
        rxe_module = {"error": str(exc)}
    selected = _selected_guest_tests(request.session)
    everything = set(selected) >= set(collected_guest_tests()[0])
    return boot_and_test(kernel, outdir, [] if everything else selected, rxe_module=rxe_module)
