"""Where the detector's cgroup v2 comes from.

Socket programs attach to a cgroup v2 directory and cover every socket created by a process at
or below it. smcd wants the whole host, so it attaches at the root of the cgroup v2 hierarchy:

1. an existing cgroup2 mount (``/sys/fs/cgroup`` on unified systems, ``/sys/fs/cgroup/unified``
   on hybrid ones), found in ``/proc/self/mountinfo``;
2. else (a pure v1 layout, as on this project's test machine) smcd mounts the hierarchy itself
   at ``/run/smcd/cgroup2`` (``mount -t cgroup2 none``, CAP_SYS_ADMIN) and unmounts it on close.
   Every process is in the root of the v2 hierarchy unless something moved it, so the root
   covers everything.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from pathlib import Path

from smcd_daemon.errors import SmcError

CGROUP2_SUPER_MAGIC = 0x63677270
DEFAULT_MOUNT = Path("/run/smcd/cgroup2")
_MNT_DETACH = 2


class CgroupError(SmcError):
    """No cgroup v2 hierarchy could be found or mounted."""


def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \ooo
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and i + 3 < len(field) and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def find_cgroup2(mountinfo: str = "/proc/self/mountinfo") -> Path | None:
    """The mount point of the cgroup v2 hierarchy's root, if it is mounted anywhere."""
    try:
        text = Path(mountinfo).read_text()
    except OSError:
        return None
    for line in text.splitlines():
        pre, sep, post = line.partition(" - ")
        if not sep or not post.startswith("cgroup2 "):
            continue
        fields = pre.split()
        if len(fields) >= 5 and fields[3] == "/":  # the hierarchy's root, not a bind of a child
            return Path(_unescape(fields[4]))
    return None


def is_cgroup2(path: Path) -> bool:
    """True if ``path`` is a directory of a cgroup v2 hierarchy."""
    buf = (ctypes.c_uint8 * 128)()  # struct statfs; f_type is the first word
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    if libc.statfs(os.fsencode(path), buf) != 0:
        return False
    return ctypes.c_long.from_buffer(buf, 0).value == CGROUP2_SUPER_MAGIC


def mount_cgroup2(target: Path = DEFAULT_MOUNT) -> Path:
    """Mount the cgroup v2 hierarchy at ``target`` (CgroupError if that is not allowed)."""
    target.mkdir(parents=True, exist_ok=True)
    if is_cgroup2(target):
        return target
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    if libc.mount(b"none", os.fsencode(target), b"cgroup2", 0, None) != 0:
        err = ctypes.get_errno()
        raise CgroupError(
            f"mount -t cgroup2 none {target}: {os.strerror(err)} "
            "(needs CAP_SYS_ADMIN; or mount a cgroup2 hierarchy before starting smcd)"
        )
    return target


def unmount(target: Path) -> None:
    """Lazily unmount a hierarchy we mounted (attached programs are already detached)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.umount2(os.fsencode(target), _MNT_DETACH)


def resolve(cgroup: str | os.PathLike[str] | None) -> tuple[Path, bool]:
    """The cgroup v2 directory to attach to and whether we mounted it for that.

    ``None`` means the root of the host's hierarchy (found, else mounted at DEFAULT_MOUNT).
    """
    if cgroup is not None:
        path = Path(cgroup)
        if not is_cgroup2(path):
            raise CgroupError(f"{path} is not a cgroup v2 directory")
        return path, False
    found = find_cgroup2()
    if found is not None and is_cgroup2(found):
        return found, False
    return mount_cgroup2(), True
