"""Host side of the systemd VM: boot Debian's kernel with systemd as PID 1, read the results.

The Soft-RoCE harness (tests/vm) runs its guest program through virtme's own init; this one boots
``vng --systemd`` instead, so systemd 252 (the host's, on the host root shared read-only) is PID 1
with the real system D-Bus, journal and unit manager.

The way in is a unit of the test's own. ``--exec`` does not run under ``--systemd`` (virtme's init,
which runs it, is not used), and kernel parameters for systemd (``systemd.run=``,
``systemd.unit=``) are ignored: the host root has ``/.dockerenv``, so systemd believes it runs in a
container and reads its "kernel command line" from its own argv, which virtme leaves empty. What
systemd does read is the unit directory virtme puts first on ``SYSTEMD_UNIT_PATH``: a fresh
per-run directory under ``~/.cache/virtme-ng/guest/`` on the host, visible in the guest through
the shared root. :func:`boot` waits for vng to create it (before qemu starts; systemd reads it
tens of seconds later) and writes there a ``default.target`` that pulls in only ``basic.target``
and ``smcd-vm-test.service``, which runs ``tests/systemd/guest/boot.sh`` and powers the VM off
when it ends. boot.sh mounts the ``--rwdir`` result directory itself (virtme's init would have),
makes /usr, /etc, /var and the checkout writable with tmpfs overlays, and runs the guest tests
(``tests/systemd/guest``) with the ``tests.vm.guest_report`` plugin writing ``results.jsonl``.

Two host prerequisites: an empty ``/lib/modules`` must exist (virtme's early shell under
``--systemd`` mounts a tmpfs there; without the directory PID 1 dies with "mkdir: cannot create
directory '/lib/modules': Read-only file system") — :func:`boot` creates it; and the wheelhouse
``make install`` installs from (built with ``make wheels`` on the host, which has PyPI; the guest
has no network).
"""

from __future__ import annotations

import ast
import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.vm.harness import VmError, preflight
from tests.vm.kernel import KernelTree

REPO = Path(__file__).resolve().parents[2]
GUEST_DIR = REPO / "tests" / "systemd" / "guest"
GUEST_TESTS = GUEST_DIR / "test_service.py"
BOOT_SCRIPT = GUEST_DIR / "boot.sh"
#: Whole run: boot, make install, every check, poweroff (SMCD_SYSTEMD_VM_TIMEOUT overrides).
DEFAULT_TIMEOUT = 1200


def guest_test_names() -> list[str]:
    """The guest tests in file order (read from the source: nothing is imported on the host)."""
    tree = ast.parse(GUEST_TESTS.read_text())
    return [
        node.name
        for node in tree.body
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")
    ]


@dataclass
class Outcome:
    outcome: str = "not run"
    text: str = ""


class GuestRebooted(UserWarning):
    """The systemd VM ended before its tests did, and a second boot ran them all again."""


@dataclass
class SystemdVmRun:
    outdir: Path
    error: str | None = None
    elapsed: float = 0.0
    results: dict[str, Outcome] = field(default_factory=dict)
    exited: bool = False
    """vng ended by itself (not killed by the harness for its timeout)."""
    reboots: list[str] = field(default_factory=list)
    """Why a second boot ran (the first boot's console tail), for a GuestRebooted warning."""

    def tail(self, name: str, lines: int = 60) -> str:
        try:
            text = (self.outdir / name).read_text(errors="replace").splitlines()
        except OSError:
            return f"({name}: not written)"
        return "\n".join(text[-lines:])

    def context(self) -> str:
        return (
            f"VM output dir: {self.outdir}\n--- console ---\n{self.tail('console.log', 30)}\n"
            f"--- boot.log ---\n{self.tail('boot.log')}\n"
            f"--- guest pytest ---\n{self.tail('guest-pytest.log')}"
        )


def _read_results(run: SystemdVmRun) -> None:
    path = run.outdir / "results.jsonl"
    if not path.exists():
        return
    for line in path.read_text().splitlines():
        try:
            ev = json.loads(line)
        except json.JSONDecodeError:
            continue
        if ev.get("event") == "start":
            name = ev["nodeid"].rsplit("::", 1)[-1]
            run.results[name] = Outcome("started (never finished: hang or VM killed)")
        elif ev.get("event") == "report":
            name = ev["nodeid"].rsplit("::", 1)[-1]
            res = run.results.setdefault(name, Outcome())
            if ev["outcome"] == "passed":
                # only the call passes a test: a setup report alone (the VM ended during the
                # call) leaves it "started"
                if ev["when"] == "call" and res.outcome != "failed":
                    res.outcome = "passed"
            else:
                res.outcome = "failed"
                res.text += f"[{ev['when']}] {ev['text']}\n"


#: virtme-ng's per-run unit directories (virtme_ng.utils.GUEST_CACHE_ROOT).
GUEST_CACHE_ROOT = Path.home() / ".cache" / "virtme-ng" / "guest"

DEFAULT_TARGET = """\
[Unit]
Description=smcd systemd VM test (tests/systemd)
Requires=basic.target
After=basic.target
Wants=smcd-vm-test.service
AllowIsolate=yes
"""

TEST_SERVICE = """\
[Unit]
Description=smcd systemd VM test run (tests/systemd/guest/boot.sh)
After=basic.target dbus.socket
[Service]
Type=oneshot
ExecStart={boot} {repo}
StandardOutput=journal+console
StandardError=journal+console
TimeoutStartSec=infinity
SuccessAction=poweroff-force
FailureAction=poweroff-force
"""

#: Units of the host's basic.target the test does not need and that take minutes under TCG on
#: the 9p root (tmpfiles walks every tmpfiles.d rule over 9p) or fail in this VM.
MASKED = ("systemd-tmpfiles-setup.service", "systemd-logind.service")


def _vng_command(vng: Path, kernel: KernelTree, outdir: Path) -> list[str]:
    return [
        str(vng), "--disable-kvm", "--systemd", "--run", str(kernel.vmlinuz),
        "--memory", "2G", "--cpus", "2", "--rwdir", str(outdir),
    ]  # fmt: skip


def _install_units(before: set[str], proc: subprocess.Popen[bytes], timeout: float = 120) -> Path:
    """Write our units into the unit directory vng creates for this run (see the module doc)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        fresh = [
            d
            for d in (GUEST_CACHE_ROOT.iterdir() if GUEST_CACHE_ROOT.exists() else ())
            if d.name not in before and (d / "serial-getty@.service.d").is_dir()
        ]
        if fresh:
            unit_dir = fresh[0]
            (unit_dir / "smcd-vm-test.service").write_text(
                TEST_SERVICE.format(boot=BOOT_SCRIPT, repo=REPO)
            )
            (unit_dir / "default.target").write_text(DEFAULT_TARGET)
            for unit in MASKED:
                (unit_dir / unit).symlink_to("/dev/null")
            return unit_dir
        time.sleep(0.05)
    raise VmError(f"vng created no unit directory under {GUEST_CACHE_ROOT} within {timeout} s")


def _unfinished(run: SystemdVmRun) -> list[str]:
    """Guest tests without a final outcome: never started, or started and never reported."""
    return [
        name
        for name in guest_test_names()
        if run.results.get(name, Outcome()).outcome not in ("passed", "failed")
    ]


def boot(kernel: KernelTree, outdir: Path, timeout: int | None = None) -> SystemdVmRun:
    """Boot the VM, run every guest test, return what came back (never raises for a VM that
    misbehaves: ``SystemdVmRun.error`` says why, and every test fails with it).

    A VM that ends by itself before its tests did (the emulated kernel panicked, qemu died, PID
    1 never reached the test unit) is booted once more, for all of them: they are one sequence
    on one installation (install first, uninstall last), so there is no "rest" to run alone.
    The first boot's console tail goes to ``reboot.txt`` and ``SystemdVmRun.reboots`` (a
    ``GuestRebooted`` warning in the summary). A run the harness killed for its timeout is not
    repeated: a hang would hang again, for as long once more."""
    timeout = timeout or int(os.environ.get("SMCD_SYSTEMD_VM_TIMEOUT", DEFAULT_TIMEOUT))
    run = _boot_once(kernel, outdir, timeout)
    left = _unfinished(run)
    if not run.exited or not left:
        return run
    why = (
        f"the systemd VM ended after {run.elapsed:.0f} s with {len(left)} guest tests unfinished "
        f"({', '.join(left[:3])}{', …' if len(left) > 3 else ''}; {run.error or 'no error'}); "
        "a second boot ran them all.\n"
        f"--- first boot's console (last lines) ---\n{run.tail('console.log', 80)}\n"
    )
    (outdir / "reboot.txt").write_text(why)
    again = _boot_once(kernel, outdir / "reboot", timeout)
    again.reboots.append(why)
    again.elapsed += run.elapsed
    return again


def _boot_once(kernel: KernelTree, outdir: Path, timeout: int) -> SystemdVmRun:
    outdir.mkdir(parents=True, exist_ok=True)
    os.chmod(outdir, 0o777)  # guest tests run parts as nobody and write logs here
    run = SystemdVmRun(outdir)
    try:
        vng, _qemu = preflight()
    except VmError as e:
        run.error = str(e)
        return run
    Path("/lib/modules").mkdir(exist_ok=True)
    GUEST_CACHE_ROOT.mkdir(parents=True, exist_ok=True)
    before = {d.name for d in GUEST_CACHE_ROOT.iterdir()}
    cmd = _vng_command(vng, kernel, outdir)
    (outdir / "vng-command.txt").write_text(" ".join(cmd) + "\n")
    env = dict(os.environ)
    env["PATH"] = f"{vng.parent}:{env.get('PATH', '/usr/sbin:/usr/bin:/sbin:/bin')}"
    t0 = time.monotonic()
    with open(outdir / "console.log", "wb") as console:
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=console,
            stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        try:
            _install_units(before, proc)
            proc.wait(timeout=timeout)
            run.exited = True
        except VmError as e:
            run.error = str(e)
        except subprocess.TimeoutExpired:
            run.error = f"the systemd VM did not finish within {timeout} s and was killed"
        finally:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                if proc.poll() is not None:
                    break
                try:
                    os.killpg(proc.pid, sig)
                    proc.wait(timeout=10)
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    pass
    run.elapsed = time.monotonic() - t0
    _read_results(run)
    if run.error is None and not (outdir / "guest.json").exists():
        run.error = "the guest never reached the test script (boot failure? see the console)"
    return run
