"""Debian's stock kernel for the test VM, fetched once and kept in the repo's ``.cache/vm/``.

Why Debian's ``linux-image-amd64``: it has ``CONFIG_RDMA_RXE=m`` (Soft-RoCE) and ``CONFIG_SMC=m``,
which the host kernels here lack. The package is only downloaded and unpacked (``apt-get download``
+ ``dpkg-deb -x``), never installed: nothing lands in the host's /boot or /lib/modules. virtme-ng
finds the modules beside the image (``<tree>/lib/modules/<version>``) and links them into the guest.

Run ``python -m tests.vm.kernel`` to fetch ahead of a test run (CI does it through the first test).
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CACHE_DIR", "KernelError", "KernelTree", "ensure_kernel"]

REPO = Path(__file__).resolve().parents[2]
CACHE_DIR = REPO / ".cache" / "vm"
META_PACKAGE = "linux-image-amd64"
_COMPLETE = ".complete"
#: Modules the harness cannot do without; checked after unpacking.
REQUIRED_MODULES = ("drivers/infiniband/sw/rxe/rdma_rxe.ko", "drivers/net/virtio_net.ko")


class KernelError(RuntimeError):
    """The kernel could not be found, fetched or unpacked (the message says how to fix it)."""


@dataclass(frozen=True)
class KernelTree:
    """An unpacked kernel package: ``root/boot/vmlinuz-<version>`` + ``root/lib/modules/<v>``."""

    version: str
    root: Path

    @property
    def vmlinuz(self) -> Path:
        return self.root / "boot" / f"vmlinuz-{self.version}"

    @property
    def moddir(self) -> Path:
        return self.root / "lib" / "modules" / self.version

    def config(self, key: str) -> str | None:
        """A ``CONFIG_*`` value from the package's ``boot/config-<version>``."""
        text = (self.root / "boot" / f"config-{self.version}").read_text()
        m = re.search(rf"^{re.escape(key)}=(.*)$", text, re.M)
        return m.group(1) if m else None


def _cmd(*cmd: str, cwd: Path | None = None) -> str:
    try:
        done = subprocess.run(
            cmd, cwd=cwd, capture_output=True, text=True, timeout=600, check=False
        )
    except FileNotFoundError as exc:
        raise KernelError(
            f"{cmd[0]} not found: the VM kernel is fetched with Debian's apt/dpkg tools"
        ) from exc
    except subprocess.TimeoutExpired as exc:
        raise KernelError(f"`{' '.join(cmd)}` took longer than 600 s") from exc
    if done.returncode != 0:
        raise KernelError(f"`{' '.join(cmd)}` exited {done.returncode}: {done.stderr.strip()}")
    return done.stdout


def _resolve_package() -> str:
    """The versioned image package the meta package points at (``linux-image-6.1.0-NN-amd64``)."""
    for attempt in range(2):
        try:
            out = _cmd("apt-cache", "depends", META_PACKAGE)
        except KernelError:
            out = ""
        m = re.search(r"Depends: (linux-image-\d\S*)", out)
        if m:
            return m.group(1)
        if attempt == 0:  # no package lists yet (fresh machine): fetch them once
            _cmd("apt-get", "update", "-qq")
    raise KernelError(
        f"apt-cache knows no {META_PACKAGE}: is this Debian with the main component enabled?"
    )


def _cached(cache: Path) -> KernelTree | None:
    trees = sorted(
        (d for d in (cache / "kernel").glob("*") if (d / _COMPLETE).is_file()),
        key=lambda d: d.stat().st_mtime,
    )
    if not trees:
        return None
    return KernelTree(version=(trees[-1] / _COMPLETE).read_text().strip(), root=trees[-1] / "root")


def _fetch(cache: Path) -> KernelTree:
    package = _resolve_package()
    version = package.removeprefix("linux-image-")
    (cache / "kernel").mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="fetch-", dir=cache / "kernel"))
    try:
        _cmd("apt-get", "download", "-q", package, cwd=work)
        debs = list(work.glob(f"{package}_*.deb"))
        if len(debs) != 1:
            raise KernelError(f"apt-get download {package} left {debs} in {work}")
        _cmd("dpkg-deb", "-x", str(debs[0]), str(work / "root"))
        debs[0].unlink()
        tree = KernelTree(version=version, root=work / "root")
        if not tree.vmlinuz.is_file():
            raise KernelError(f"{package} has no boot/vmlinuz-{version}")
        for rel in REQUIRED_MODULES:
            if not (tree.moddir / "kernel" / rel).is_file():
                raise KernelError(f"{package} lacks {rel}; the Soft-RoCE VM needs it")
        # The .deb ships no modules.dep (postinst makes it); the guest's modprobe needs it.
        _cmd("depmod", "-b", str(work / "root"), version)
        (work / _COMPLETE).write_text(version + "\n")
        final = cache / "kernel" / version
        if final.exists():
            shutil.rmtree(final)
        work.rename(final)
        return KernelTree(version=version, root=final / "root")
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise


def ensure_kernel(cache: Path = CACHE_DIR) -> KernelTree:
    """The cached kernel tree, fetching Debian's current one the first time.

    Once cached, the tree is reused without asking apt (runs stay reproducible);
    delete ``.cache/vm/kernel`` to move to a newer Debian kernel.
    """
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / "kernel.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two pytest sessions must not unpack at once
        tree = _cached(cache)
        if tree is None:
            if os.geteuid() != 0:
                raise KernelError("fetching the VM kernel needs root (apt-get download)")
            tree = _fetch(cache)
        return tree


def main() -> int:
    try:
        tree = ensure_kernel()
    except KernelError as exc:
        print(f"vm kernel: {exc}", file=sys.stderr)
        return 1
    print(f"{tree.version} {tree.vmlinuz}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
