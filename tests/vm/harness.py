"""Host side of the Soft-RoCE VM: boot Debian's kernel with virtme-ng, run the guest tests, read
their results back.

One boot runs every selected guest test (TCG boots take 30-90 s on the CI machine, so one per
session). The guest is emulated (``--disable-kvm``): the hosts' KVM here cannot run a stock
kernel, and TCG behaves the same everywhere. Anything that keeps the VM from running is a
:class:`VmError` whose message says what to install or where to look; the tests turn it into a
failure, never a skip.
"""

from __future__ import annotations

import functools
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.vm import topology
from tests.vm.guest_main import (
    DEFAULT_TEST_TIMEOUT,
    GUEST_TESTS,
    PYTEST_ENV,
    REPO,
    pytest_command,
)
from tests.vm.kernel import KernelTree

__all__ = [
    "GuestResult",
    "VmError",
    "VmRun",
    "boot_and_test",
    "collect_guest_tests",
    "collected_guest_tests",
    "preflight",
    "vm_timeout",
]

VENV_BIN = Path(sys.executable).parent
#: Whole VM run (boot + all guest tests + poweroff); SMCD_VM_TIMEOUT overrides.
DEFAULT_VM_TIMEOUT = 1800
VM_MEMORY = "2G"
VM_CPUS = "2"


def vm_timeout() -> int:
    return int(os.environ.get("SMCD_VM_TIMEOUT", DEFAULT_VM_TIMEOUT))


class VmError(RuntimeError):
    """The VM could not be booted or did not report back."""


@dataclass
class GuestResult:
    """A guest test's outcome over its setup/call/teardown phases (worst one wins)."""

    nodeid: str
    outcome: str = "passed"  # passed | failed | skipped | error
    text: str = ""
    duration: float = 0.0
    phases: set[str] = field(default_factory=set)

    def add(self, when: str, outcome: str, text: str, duration: float) -> None:
        self.duration += duration
        self.phases.add(when)
        if outcome == "passed":
            return
        if outcome == "failed" and when != "call":
            outcome = "error"  # fixture setup/teardown failed
        if self.outcome == "passed" or outcome in ("failed", "error"):
            self.outcome = outcome
        self.text += f"[{when}] {text}\n"


@dataclass
class VmRun:
    """What one VM boot produced; ``error`` is set when it did not get to run the tests."""

    kernel: KernelTree
    outdir: Path
    elapsed: float = 0.0
    returncode: int | None = None
    error: str | None = None
    guest: dict[str, Any] = field(default_factory=dict)
    collected: list[str] | None = None
    collect_errors: list[str] = field(default_factory=list)
    results: dict[str, GuestResult] = field(default_factory=dict)
    running: str | None = None  # a test that started and never reported its call phase
    exitstatus: int | None = None
    reboots: list[str] = field(default_factory=list)  # why a second boot ran the rest

    def tail(self, name: str, lines: int = 40) -> str:
        try:
            text = (self.outdir / name).read_text(errors="replace").splitlines()
        except OSError:
            return f"({name}: not written)"
        return "\n".join(text[-lines:])

    def context(self) -> str:
        """Everything a reader needs to see why the VM run went wrong."""
        return (
            f"VM output dir: {self.outdir}\n"
            f"--- console (last lines) ---\n{self.tail('console.log')}\n"
            f"--- guest pytest (last lines) ---\n{self.tail('guest-pytest.log')}\n"
            f"--- guest.json ---\n{json.dumps(self.guest, indent=1)[:3000]}"
        )


def preflight() -> tuple[Path, Path]:
    """The vng and qemu binaries, or a VmError saying how to install them."""
    vng = VENV_BIN / "vng"
    if not vng.exists():
        found = shutil.which("vng")
        if found is None:
            raise VmError(
                "virtme-ng is not installed in the test venv: "
                ".venv/bin/pip install -e '.[test]' (it pins virtme-ng)"
            )
        vng = Path(found)
    qemu = shutil.which("qemu-system-x86_64")
    if qemu is None:
        raise VmError(
            "qemu-system-x86_64 not found: run tests/host/vm-deps.sh "
            "(apt-get install qemu-system-x86)"
        )
    for tool in ("busybox", "depmod", "file"):
        if shutil.which(tool) is None:
            raise VmError(f"{tool} not found (virtme-ng needs it): run tests/host/vm-deps.sh")
    return vng, Path(qemu)


def collect_guest_tests() -> list[str]:
    """Node ids of the guest tests, collected on the host (imports only, nothing runs)."""
    cmd = [*pytest_command([], verbosity="-q"), "--collect-only"]
    env = dict(os.environ, **PYTEST_ENV)
    # the host may keep bytecode (the guest, on the read-only root, reuses it)
    env.pop("PYTHONDONTWRITEBYTECODE")
    env.pop("SMCD_VM_REPORT", None)
    done = subprocess.run(
        cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120, check=False
    )
    ids = [ln for ln in done.stdout.splitlines() if "::" in ln and not ln.startswith(" ")]
    if done.returncode != 0 or not ids:
        raise VmError(
            f"collecting the guest tests in {GUEST_TESTS} failed (exit {done.returncode}):\n"
            f"{done.stdout[-4000:]}{done.stderr[-2000:]}"
        )
    return ids


@functools.cache
def collected_guest_tests() -> tuple[tuple[str, ...], str | None]:
    """:func:`collect_guest_tests` once per process: (node ids, None) or ((), the error)."""
    try:
        return tuple(collect_guest_tests()), None
    except VmError as exc:
        return (), str(exc)


#: Host environment variables with this prefix reach the guest program (and so every guest
#: test); the guest's environment is otherwise its own (``make bench-rdma`` sets
#: SMCD_GUEST_BENCH_FULL).
GUEST_ENV_PREFIX = "SMCD_GUEST_"


def _guest_env_prefix() -> str:
    """``NAME=value `` assignments for the guest's shell command (vng runs it with sh)."""
    return "".join(
        f"{k}={shlex.quote(v)} "
        for k, v in sorted(os.environ.items())
        if k.startswith(GUEST_ENV_PREFIX) and k.isidentifier()
    )


def _vng_command(vng: Path, kernel: KernelTree, outdir: Path) -> list[str]:
    qemu_opts = " ".join(topology.qemu_args())
    return [
        str(vng),
        "--disable-kvm",
        # the kernel's console goes to console.log: an oops or a panic that ends the guest
        # mid-test is then in the failure's context instead of nowhere
        "--verbose",
        "--run",
        str(kernel.vmlinuz),
        "--memory",
        VM_MEMORY,
        "--cpus",
        VM_CPUS,
        "--rwdir",
        str(outdir),
        f"--qemu-opts={qemu_opts}",
        "--exec",
        f"{_guest_env_prefix()}{sys.executable} -m tests.vm.guest_main {outdir}",
    ]


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=10)
            return
        except subprocess.TimeoutExpired:
            continue


def _read_results(run: VmRun) -> None:
    path = run.outdir / "results.jsonl"
    if not path.exists():
        return
    started: list[str] = []
    for line in path.read_text().splitlines():
        try:
            ev = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a kill
        kind = ev.get("event")
        if kind == "collected":
            run.collected = ev["nodeids"]
        elif kind == "collect_error":
            run.collect_errors.append(f"{ev['nodeid']}: {ev['text']}")
        elif kind == "start":
            started.append(ev["nodeid"])
        elif kind == "report":
            res = run.results.setdefault(ev["nodeid"], GuestResult(ev["nodeid"]))
            res.add(ev["when"], ev["outcome"], ev["text"], ev["duration"])
        elif kind == "finish":
            run.exitstatus = ev["exitstatus"]
    # A test is over with its teardown report: one with only its setup (or call) report was
    # running when the guest ended, and must not pass on the host for its setup's "passed".
    for res in run.results.values():
        if "teardown" not in res.phases:
            res.outcome = "error"
            res.text += "[running] the guest ended during this test (the kernel's console is in "
            res.text += "the VM output dir's console.log)\n"
    finished = {n for n, r in run.results.items() if "teardown" in r.phases}
    unfinished = [n for n in started if n not in finished]
    if unfinished:
        run.running = unfinished[-1]


#: A second boot runs the tests a dead guest left only when at least this long is left.
REBOOT_MIN_LEFT = 300


def boot_and_test(
    kernel: KernelTree,
    outdir: Path,
    selection: list[str],
    *,
    timeout: int | None = None,
    test_timeout: int = DEFAULT_TEST_TIMEOUT,
    rxe_module: dict[str, Any] | None = None,
) -> VmRun:
    """Boot the VM, run ``selection`` (guest node ids; [] = all), return what came back.

    Never raises for a VM that misbehaves: that is recorded in ``VmRun.error`` so that each test
    can fail with the reason.

    A guest that ends in the middle of a test (the emulated kernel panicked, or qemu died: the
    guest program never got to report) is booted once more for the tests it did not finish,
    the one it died in first; a test that kills the guest every time then fails with the second
    boot's console. Why: under TCG the stock 6.1 kernel with Soft-RoCE is not ours to fix, and
    one crash of it must not hide what the other seventy tests say. The first boot's console
    is kept in ``VmRun.reboots`` (and ``reboot.txt``), which the session test prints.

    ``rxe_module``: the patched Soft-RoCE module (``tests.vm.kmod.RxeModule.to_json()``) the guest
    loads instead of the stock one, or ``{"error": ...}`` when it could not be built (the guest
    then uses the stock module and only the tests needing the patch fail, with that error).
    """
    timeout = timeout or vm_timeout()
    run = _boot_once(kernel, outdir, selection, timeout, test_timeout, rxe_module)
    left = timeout - run.elapsed
    if (
        run.error is not None
        or run.exitstatus is not None
        or run.running is None
        or not run.collected
        or left < REBOOT_MIN_LEFT
    ):
        return run
    done = {n for n, r in run.results.items() if "teardown" in r.phases}
    rest = [n for n in (selection or run.collected) if n not in done]
    why = (
        f"the guest ended during {run.running} after {run.elapsed:.0f} s (vng status "
        f"{run.returncode}); a second boot ran the {len(rest)} tests it had not finished.\n"
        f"--- first boot's console (last lines) ---\n{run.tail('console.log', 80)}\n"
    )
    (outdir / "reboot.txt").write_text(why)
    again = _boot_once(kernel, outdir / "reboot", rest, int(left), test_timeout, rxe_module)
    run.reboots.append(why)
    run.results.update(again.results)
    run.running, run.exitstatus = again.running, again.exitstatus
    run.collect_errors += again.collect_errors
    run.error = None if again.error is None else f"second boot: {again.error}"
    run.elapsed += again.elapsed
    run.outdir = again.outdir  # the failure context of what is left is the second boot's
    return run


def _boot_once(
    kernel: KernelTree,
    outdir: Path,
    selection: list[str],
    timeout: int,
    test_timeout: int,
    rxe_module: dict[str, Any] | None,
) -> VmRun:
    outdir.mkdir(parents=True, exist_ok=True)
    run = VmRun(kernel=kernel, outdir=outdir)
    try:
        vng, _qemu = preflight()
    except VmError as exc:
        run.error = str(exc)
        return run
    (outdir / "request.json").write_text(
        json.dumps(
            {
                "selection": selection,
                "test_timeout": test_timeout,
                # leave the guest time to save dmesg and power off before the host kills it
                "pytest_timeout": max(60, timeout - 150),
                # kernel-oracle: read by guest_main (insmod) and test_kernel_oracle
                "rxe_module": rxe_module,
            }
        )
    )
    cmd = _vng_command(vng, kernel, outdir)
    (outdir / "vng-command.txt").write_text(" ".join(cmd) + "\n")
    env = dict(os.environ)
    env["PATH"] = f"{VENV_BIN}:{env.get('PATH', '/usr/sbin:/usr/bin:/sbin:/bin')}"
    env.pop("SMCD_VM_REPORT", None)
    t0 = time.monotonic()
    with open(outdir / "console.log", "wb") as console:
        proc = subprocess.Popen(
            cmd,
            cwd=REPO,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=console,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # so a timeout can end vng and its qemu together
        )
        try:
            run.returncode = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            run.error = f"the VM did not finish within {timeout} s (SMCD_VM_TIMEOUT) and was killed"
        except BaseException:
            _kill_group(proc)
            raise
    run.elapsed = time.monotonic() - t0
    try:
        run.guest = json.loads((outdir / "guest.json").read_text())
    except (OSError, json.JSONDecodeError):
        run.guest = {}
    _read_results(run)
    if run.error is None:
        if not run.guest:
            run.error = (
                f"the VM exited (vng status {run.returncode}) without starting the guest "
                f"program: boot failure?"
            )
        elif "setup_error" in run.guest:
            run.error = f"guest network/Soft-RoCE setup failed: {run.guest['setup_error']}"
        elif "pytest_error" in run.guest:
            run.error = run.guest["pytest_error"]
        elif (outdir / "guest-crash.txt").exists():
            run.error = "the guest program crashed:\n" + (outdir / "guest-crash.txt").read_text()
    return run
