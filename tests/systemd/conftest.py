"""Host-side fixture of the systemd VM suite: one ``vng --systemd`` boot per pytest session.

The guest tests under ``guest/`` run only inside the VM (tests/systemd/harness.py explains how);
the host shows each as ``test_in_systemd_vm[<name>]``.
"""

from __future__ import annotations

import subprocess
import warnings

import pytest

from tests.systemd.harness import REPO, GuestRebooted, SystemdVmRun, boot
from tests.vm.kernel import KernelError, ensure_kernel

collect_ignore = ["guest"]


@pytest.fixture(scope="session")
def systemd_vm(tmp_path_factory: pytest.TempPathFactory) -> SystemdVmRun:
    outdir = tmp_path_factory.mktemp("systemd-vm")
    run = SystemdVmRun(outdir)
    # The guest installs from the wheelhouse (it has no network): build it here, from PyPI; and
    # the peer-detection object `make install` puts next to the module.
    done = subprocess.run(
        ["make", "--no-print-directory", "-C", str(REPO), "wheels", "bpf"],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    if done.returncode != 0:
        run.error = f"make wheels failed:\n{done.stdout}\n{done.stderr}"
        return run
    try:
        kernel = ensure_kernel()
    except KernelError as e:
        run.error = f"cannot get the VM kernel: {e}"
        return run
    run = boot(kernel, outdir)
    for why in run.reboots:  # in the summary of every run that needed a second boot
        warnings.warn(GuestRebooted(why), stacklevel=1)
    return run
