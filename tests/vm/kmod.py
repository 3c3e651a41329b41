"""A patched Soft-RoCE module (``rdma_rxe.ko``) for the VM's kernel, built once and cached.

Why: the kernel's own SMC-R is the independent judge of our wire format (guest test
``test_kernel_oracle``), and on Linux 6.1 it cannot run over the stock rxe: rxe's ``query_qp``
reports a stale ``cur_qp_state`` and a CQ armed with ``IB_CQ_SOLICITED_MASK`` never signals
(SMC's link setup then hangs in ``smc_wr_drain_cq``). ``rxe-smc-fixes.patch`` beside this file
fixes both in two lines (the project's softroce-vm recipe); a third fix keeps a packet that
outlives its QP (a NIC down with packets in its ring) from panicking the guest when the NIC
comes back up (the patch's header says how).

How, without installing anything on the host: ``apt-get download`` the ``linux-headers`` (arch +
common), ``linux-kbuild`` and ``linux-source`` packages of exactly the Debian version of the
headers for the kernel the harness boots, unpack them with ``dpkg-deb`` into a work dir under
``.cache/vm/``, extract only ``drivers/infiniband/sw/rxe`` from the source tarball, patch, and
``make M=...`` against the unpacked headers. The result lands in
``.cache/vm/rxe-smc/<kernel version>/`` (keyed by kernel version and the patch's hash); the work
dir (about 150 MB of packages) is deleted. The guest reads the module straight from there (the
host root is shared read-only) and ``insmod``s it before the network is set up.

Needs gcc-12, make, patch, xz-utils, binutils and libelf1 (``tests/host/vm-deps.sh``).
Run ``python -m tests.vm.kmod`` to build ahead of a test run.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from tests.vm.kernel import CACHE_DIR, KernelTree

__all__ = ["PATCH", "KmodError", "RxeModule", "ensure_rxe_module", "same_release"]

PATCH = Path(__file__).resolve().parent / "rxe-smc-fixes.patch"
RXE_DIR = "drivers/infiniband/sw/rxe"
_META = "module.json"
_CMD_TIMEOUT = 900


class KmodError(RuntimeError):
    """The patched module could not be fetched or built (the message says why and how to fix)."""


@dataclass(frozen=True)
class RxeModule:
    """The built module and what the guest needs to load it."""

    version: str  # kernel release it was built for (vermagic)
    path: Path
    depends: tuple[str, ...]  # modules to modprobe before insmod
    sha256: str  # of the .ko; in the guest, /sys/module/rdma_rxe/taint shows "O" (out of tree)
    patch_sha256: str

    def to_json(self) -> dict[str, object]:
        d = asdict(self)
        d["path"] = str(self.path)
        d["depends"] = list(self.depends)
        return d


def _cmd(*cmd: str, cwd: Path | None = None) -> str:
    try:
        done = subprocess.run(
            cmd, cwd=cwd, capture_output=True, text=True, timeout=_CMD_TIMEOUT, check=False
        )
    except FileNotFoundError as exc:
        raise KmodError(f"{cmd[0]} not found: run tests/host/vm-deps.sh") from exc
    except subprocess.TimeoutExpired as exc:
        raise KmodError(f"`{' '.join(cmd)}` took longer than {_CMD_TIMEOUT} s") from exc
    if done.returncode != 0:
        tail = (done.stderr.strip() or done.stdout.strip())[-3000:]
        raise KmodError(f"`{' '.join(cmd)}` exited {done.returncode}: {tail}")
    return done.stdout


def _download(work: Path, spec: str) -> Path:
    """``apt-get download`` one package (``name`` or ``name=version``) into ``work``."""
    name = spec.split("=", 1)[0]
    try:
        _cmd("apt-get", "download", "-q", spec, cwd=work)
    except KmodError as exc:
        raise KmodError(
            f"{exc}\nThe VM kernel's packages may have left the archive: delete .cache/vm/kernel "
            "to move the VM to Debian's current kernel."
        ) from None
    debs = list(work.glob(f"{name}_*.deb"))
    if len(debs) != 1:
        raise KmodError(f"apt-get download {spec} left {debs} in {work}")
    return debs[0]


def same_release(madison: str, debver: str) -> str | None:
    """The first version in ``apt-cache madison`` output (newest first) of the same upstream
    release as ``debver`` (``6.1.192-3`` for ``6.1.192-2``), or None."""
    upstream = debver.rsplit("-", 1)[0]
    for line in madison.splitlines():
        parts = [p.strip() for p in line.split("|")]
        if len(parts) >= 2 and parts[1].rsplit("-", 1)[0] == upstream:
            return parts[1]
    return None


def _download_kbuild(work: Path, kbuild: str, debver: str) -> Path:
    """``linux-kbuild`` (the host's build tools: modpost, fixdep) of exactly ``debver``, else
    of another Debian revision of the same upstream release. Why: the security archive keeps
    only the newest build of each binary package, and a revision that rebuilt only some of
    them leaves the current kernel's exact kbuild gone (6.1.192-3's kbuild beside the image
    and headers of 6.1.192-2, November 2026); the tools of one upstream release build its
    modules alike, and the vermagic check below still holds the result to the kernel."""
    try:
        return _download(work, f"{kbuild}={debver}")
    except KmodError as exact:
        other = same_release(_cmd("apt-cache", "madison", kbuild), debver)
        if other is None or other == debver:
            raise exact from None
        return _download(work, f"{kbuild}={other}")


def _unpack(deb: Path, root: Path) -> None:
    _cmd("dpkg-deb", "-x", str(deb), str(root))
    deb.unlink()


def _extract_rxe_source(deb: Path, src: Path) -> None:
    """Only ``drivers/infiniband/sw/rxe`` of the ~140 MB source tarball inside the .deb."""
    src.mkdir(parents=True)
    pipeline = (
        'dpkg-deb --fsys-tarfile "$1" | tar -xO ./usr/src/linux-source-6.1.tar.xz '
        '| tar -xJ -C "$2" --strip-components=1 --wildcards "linux-source-6.1/$3/*"'
    )
    _cmd("bash", "-o", "pipefail", "-c", pipeline, "extract", str(deb), str(src), RXE_DIR)
    deb.unlink()
    if not (src / RXE_DIR / "rxe_qp.c").is_file():
        raise KmodError(f"{deb.name} has no {RXE_DIR}/rxe_qp.c")


def _modinfo(ko: Path, field: str) -> str:
    return _cmd("modinfo", "-F", field, str(ko)).strip()


def _patch_hash() -> str:
    return hashlib.sha256(PATCH.read_bytes()).hexdigest()


def _cached(final: Path, version: str, patch_sha: str) -> RxeModule | None:
    try:
        meta = json.loads((final / _META).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    module = RxeModule(
        version=meta["version"],
        path=Path(meta["path"]),
        depends=tuple(meta["depends"]),
        sha256=meta["sha256"],
        patch_sha256=meta["patch_sha256"],
    )
    if module.version != version or module.patch_sha256 != patch_sha or not module.path.is_file():
        return None
    return module


def _build(kernel: KernelTree, cache: Path, patch_sha: str) -> RxeModule:
    version = kernel.version
    headers = f"linux-headers-{version}"
    base = cache / "rxe-smc"
    base.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="build-", dir=base))
    try:
        root = work / "root"
        deb = _download(work, headers)
        # The headers package pins the Debian version; everything else must be the same one.
        debver = _cmd("dpkg-deb", "-f", str(deb), "Version").strip()
        common = re.sub(r"-[a-z0-9]+$", "-common", headers)  # linux-headers-6.1.0-56-common
        kbuild = "linux-kbuild-" + ".".join(version.split(".")[:2])  # linux-kbuild-6.1
        source = "linux-source-" + ".".join(version.split(".")[:2])
        _unpack(deb, root)
        _unpack(_download(work, f"{common}={debver}"), root)
        _unpack(_download_kbuild(work, kbuild, debver), root)
        _extract_rxe_source(_download(work, f"{source}={debver}"), work / "src")

        hdir = root / "usr" / "src" / headers
        if not (hdir / ".config").is_file():
            raise KmodError(f"{headers} unpacked without usr/src/{headers}/.config")
        # The arch headers' Makefile includes the common one by absolute path (/usr/src/...):
        # point it at the unpacked copy. The scripts/tools symlinks are relative and fine.
        (hdir / "Makefile").write_text(
            f"# rewritten by tests/vm/kmod.py (was an absolute include)\n"
            f"include {root / 'usr' / 'src' / common / 'Makefile'}\n"
        )
        _cmd("patch", "-p1", "--forward", "--batch", "-i", str(PATCH), cwd=work / "src")
        mdir = work / "src" / RXE_DIR
        jobs = str(max(1, os.cpu_count() or 1))
        _cmd(
            "make", "-C", str(hdir), f"M={mdir}", "CONFIG_RDMA_RXE=m", "modules", f"-j{jobs}",
        )  # fmt: skip
        ko = mdir / "rdma_rxe.ko"
        if not ko.is_file():
            raise KmodError(f"make finished without {ko}")
        _cmd("strip", "--strip-debug", str(ko))
        vermagic = _modinfo(ko, "vermagic")
        if vermagic.split()[0] != version:
            raise KmodError(f"built rdma_rxe.ko has vermagic {vermagic!r}, not {version}")

        final = base / version
        if final.exists():
            shutil.rmtree(final)
        final.mkdir()
        shutil.copyfile(ko, final / "rdma_rxe.ko")
        module = RxeModule(
            version=version,
            path=final / "rdma_rxe.ko",
            depends=tuple(d for d in _modinfo(ko, "depends").split(",") if d),
            sha256=hashlib.sha256((final / "rdma_rxe.ko").read_bytes()).hexdigest(),
            patch_sha256=patch_sha,
        )
        (final / _META).write_text(json.dumps(module.to_json(), indent=1) + "\n")
        return module
    finally:
        shutil.rmtree(work, ignore_errors=True)


def ensure_rxe_module(kernel: KernelTree, cache: Path = CACHE_DIR) -> RxeModule:
    """The patched ``rdma_rxe.ko`` for ``kernel``, building it the first time (~1 min)."""
    if not PATCH.is_file():
        raise KmodError(f"{PATCH} is missing")
    patch_sha = _patch_hash()
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / "rxe-smc.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two pytest sessions must not build at once
        found = _cached(cache / "rxe-smc" / kernel.version, kernel.version, patch_sha)
        if found is not None:
            return found
        if os.geteuid() != 0:
            raise KmodError("building the patched rxe needs root (apt-get download)")
        return _build(kernel, cache, patch_sha)


def main() -> int:
    from tests.vm.kernel import KernelError, ensure_kernel

    try:
        module = ensure_rxe_module(ensure_kernel())
    except (KernelError, KmodError) as exc:
        print(f"patched rxe: {exc}", file=sys.stderr)
        return 1
    print(f"{module.version} {module.path} sha256 {module.sha256}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
