"""The program virtme-ng runs inside the VM: set up Soft-RoCE, run the guest tests, power off.

usage (guest): python -m tests.vm.guest_main OUTDIR

OUTDIR is the host directory shared read-write into the guest (``vng --rwdir``). The host writes
``request.json`` there (which guest tests to run, time limits); this program writes back

- ``guest.json``: kernel version, uptime at each step, the network topology or the setup error,
  pytest's exit status;
- ``results.jsonl``: the per-test events of :mod:`tests.vm.guest_report`;
- ``guest-pytest.log`` (pytest's own output) and ``dmesg.txt``.

The root filesystem is the host's, read-only: pytest runs without its cache provider and Python
writes no bytecode. The guest must always power off, even when a test wedged the kernel's RDMA
state (a stuck link group can block an orderly shutdown): we end with sysrq 'o'.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from tests.vm import topology

REPO = Path(__file__).resolve().parents[2]
GUEST_TESTS = REPO / "tests" / "vm" / "guest"
REPORT_PLUGIN = "tests.vm.guest_report"
#: Per-test time limit inside the guest (pytest-timeout) unless a test sets its own.
DEFAULT_TEST_TIMEOUT = 300


#: Environment of every guest pytest run (also the host-side collection).
PYTEST_ENV = {"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "PYTHONDONTWRITEBYTECODE": "1"}


def pytest_command(
    selection: list[str], *, test_timeout: int = DEFAULT_TEST_TIMEOUT, verbosity: str = "-v"
) -> list[str]:
    """The pytest invocation for the guest tests, shared by the guest run and host collection.

    ``--confcutdir`` keeps the host-side ``tests/vm/conftest.py`` (which boots VMs) out of it.
    Run it with :data:`PYTEST_ENV`: plugins are named, not discovered (the entry-point scan
    reads every installed distribution's metadata over 9p, which takes long under TCG).
    """
    return [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "pytest_timeout",
        "-p",
        "no:cacheprovider",
        "-p",
        REPORT_PLUGIN,
        "--rootdir",
        str(REPO),
        "--confcutdir",
        str(GUEST_TESTS),
        f"--timeout={test_timeout}",
        verbosity,
        *(selection or [str(GUEST_TESTS)]),
    ]


def _uptime() -> float:
    return float(Path("/proc/uptime").read_text().split()[0])


class _Info:
    """guest.json, rewritten after each step so a hung guest still says how far it got."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.data: dict[str, Any] = {"kernel": os.uname().release, "steps": {}}

    def step(self, name: str, **extra: Any) -> None:
        self.data["steps"][name] = round(_uptime(), 2)
        self.data.update(extra)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1))
        tmp.replace(self.path)


def run(out: Path) -> int:
    request = json.loads((out / "request.json").read_text())
    info = _Info(out / "guest.json")
    info.step("started")
    _load_patched_rxe(request.get("rxe_module"), info)
    try:
        ports = topology.configure()
    except Exception as exc:
        info.step("setup_failed", setup_error=f"{type(exc).__name__}: {exc}")
        _save_dmesg(out)
        return 1
    (out / "topology.json").write_text(json.dumps({"ports": ports}, indent=1))
    info.step("network_ready", ports=ports)

    env = dict(os.environ)
    env.update(PYTEST_ENV)
    env.update(
        PYTHONUNBUFFERED="1",
        SMCD_VM_OUT=str(out),
        SMCD_VM_REPORT=str(out / "results.jsonl"),
        SMCD_VM_TOPOLOGY=str(out / "topology.json"),
    )
    cmd = pytest_command(request.get("selection", []), test_timeout=request["test_timeout"])
    with open(out / "guest-pytest.log", "w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        try:
            rc = subprocess.run(
                cmd,
                cwd=REPO,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                timeout=request["pytest_timeout"],
                check=False,
            ).returncode
        except subprocess.TimeoutExpired:
            limit = request["pytest_timeout"]
            info.step("pytest_timeout", pytest_error=f"guest pytest ran over {limit} s")
            _save_dmesg(out)
            return 1
    info.step("pytest_done", pytest_exitstatus=rc)
    _save_dmesg(out)
    return 0


def _load_patched_rxe(module: dict[str, Any] | None, info: _Info) -> None:
    """Load the host-built patched ``rdma_rxe.ko`` (``tests/vm/kmod.py``) before the network setup.

    topology.configure() then finds rdma_rxe loaded (its ``modprobe`` is a no-op). The patch fixes
    two rxe bugs that hang the kernel's SMC-R (test_kernel_oracle); the other tests run on it too.
    On any failure the stock module is used and the error is kept in guest.json (rxe_module).
    """
    if not module or "path" not in module:
        info.step("rxe_stock", rxe_module=f"stock ({(module or {}).get('error', 'none built')})")
        return
    try:
        for cmd in (["modprobe", "-a", *module["depends"]], ["insmod", module["path"]]):
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
            if done.returncode != 0:
                raise RuntimeError(f"`{' '.join(cmd)}` exited {done.returncode}: {done.stderr}")
    except (OSError, subprocess.TimeoutExpired, RuntimeError) as exc:
        info.step("rxe_stock", rxe_module=f"stock (loading the patched module failed: {exc})")
        return
    info.step("rxe_patched", rxe_module=f"patched {module['path']}")


def _poweroff_key() -> str:
    """sysrq 'o' (power off), but 'b' (reboot: qemu runs with -no-reboot, so it exits) once the
    kernel's SMC module is loaded: its reboot notifier waits for link groups to go away, which
    can block a power-off for minutes (test_kernel_oracle leaves a link group behind)."""
    return "b" if Path("/sys/module/smc").exists() else "o"


def _save_dmesg(out: Path) -> None:
    try:
        text = subprocess.run(
            ["dmesg"], capture_output=True, text=True, timeout=30, check=False
        ).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        text = f"dmesg failed: {exc}"
    (out / "dmesg.txt").write_text(text)


def main() -> int:
    out = Path(sys.argv[1])
    try:
        rc = run(out)
    except Exception:
        (out / "guest-crash.txt").write_text(traceback.format_exc())
        rc = 1
    print(f"smcd-vm: guest done, rc={rc}, uptime {_uptime():.1f}s", flush=True)
    os.sync()
    if os.environ.get("SMCD_VM_NO_POWEROFF") != "1":
        time.sleep(0.2)
        Path("/proc/sysrq-trigger").write_text(_poweroff_key())
        time.sleep(30)  # poweroff is asynchronous; never return into a half-shut system
    return rc


if __name__ == "__main__":
    sys.exit(main())
