"""Thin ctypes binding of the few libbpf 1.x calls the detector needs.

libbpf (Debian's ``libbpf1``, already a dependency of iproute2) parses the clang-built object,
loads its BTF (sk_storage maps require it), creates the maps, relocates the programs and attaches
them to a cgroup as BPF links. Writing that over raw bpf(2) would mean an ELF/BTF loader of our
own; this binding is a page. Every call returns ``-errno`` (or NULL and errno) in libbpf 1.x;
:class:`LibbpfError` carries the errno and whatever libbpf printed while it failed (the verifier
log included).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from smcd_daemon.errors import SmcError

_PRINT_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)


class LibbpfError(SmcError):
    """A libbpf call failed: ``errno`` and libbpf's own messages (``log``)."""

    def __init__(self, call: str, err: int, log: list[str]) -> None:
        self.call = call
        self.errno = err
        self.log = log
        tail = "".join(log[-20:]).strip()
        msg = f"{call}: {os.strerror(err)} (errno {err})"
        super().__init__(f"{msg}\n{tail}" if tail else msg)


class _Lib:
    """The loaded shared objects and their prototypes (one per process)."""

    def __init__(self) -> None:
        name = ctypes.util.find_library("bpf") or "libbpf.so.1"
        try:
            self.bpf = ctypes.CDLL(name, use_errno=True)
        except OSError as exc:
            raise LibbpfError(f"dlopen({name})", errno.ENOENT, [str(exc)]) from exc
        self.libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        b = self.bpf
        vp, ip, cp = ctypes.c_void_p, ctypes.c_int, ctypes.c_char_p
        self._proto("bpf_object__open_file", vp, [cp, vp])
        self._proto("bpf_object__load", ip, [vp])
        self._proto("bpf_object__close", None, [vp])
        self._proto("bpf_object__find_program_by_name", vp, [vp, cp])
        self._proto("bpf_object__find_map_fd_by_name", ip, [vp, cp])
        self._proto("bpf_program__fd", ip, [vp])
        self._proto("bpf_program__attach_cgroup", vp, [vp, ip])
        self._proto("bpf_link__destroy", ip, [vp])
        self._proto("bpf_map_lookup_elem", ip, [ip, vp, vp])
        self._proto("bpf_map_update_elem", ip, [ip, vp, vp, ctypes.c_uint64])
        self._proto("bpf_map_delete_elem", ip, [ip, vp])
        self._proto("bpf_map_get_next_key", ip, [ip, vp, vp])
        self._proto("bpf_obj_get_info_by_fd", ip, [ip, vp, ctypes.POINTER(ctypes.c_uint32)])
        self._proto("libbpf_set_print", vp, [_PRINT_FN])
        self.libc.vsnprintf.restype = ctypes.c_int
        self.libc.vsnprintf.argtypes = [ctypes.c_char_p, ctypes.c_size_t, cp, vp]
        self.log: list[str] | None = None
        self.lock = threading.Lock()
        try:  # a libffi closure; should W^X rules refuse it, libbpf logs to stderr instead
            self._printer = _PRINT_FN(self._print)  # kept alive: libbpf holds the pointer
        except MemoryError:
            return
        b.libbpf_set_print(self._printer)

    def _proto(self, name: str, res: object, args: list[object]) -> None:
        fn = getattr(self.bpf, name)
        fn.restype = res
        fn.argtypes = args

    def _print(self, level: int, fmt: bytes | None, args: int | None) -> int:
        # Called by libbpf for every message: collected while a call runs, else dropped (the
        # default printer writes to stderr, which is the daemon's log only by accident).
        if self.log is not None and fmt is not None:
            buf = ctypes.create_string_buffer(1024)
            self.libc.vsnprintf(buf, len(buf), fmt, args)
            self.log.append(buf.value.decode(errors="replace"))
        return 0

    @contextmanager
    def capture(self) -> Iterator[list[str]]:
        """Collect libbpf's messages for the calls made inside the block."""
        with self.lock:
            self.log = []
            try:
                yield self.log
            finally:
                self.log = None


_lib: _Lib | None = None


def lib() -> _Lib:
    """The process's libbpf binding, loaded on first use (LibbpfError if libbpf is absent)."""
    global _lib
    if _lib is None:
        _lib = _Lib()
    return _lib


def check(call: str, rc: int, log: list[str] | None = None) -> int:
    """Raise LibbpfError for a negative libbpf return code, else return it."""
    if rc < 0:
        raise LibbpfError(call, -rc, log or [])
    return rc


def prog_id(fd: int) -> int:
    """The kernel's id of the program behind ``fd`` (what ``bpftool prog show`` lists)."""
    info = (ctypes.c_uint8 * 256)()  # struct bpf_prog_info: __u32 type, __u32 id, ...
    size = ctypes.c_uint32(len(info))
    check("bpf_obj_get_info_by_fd", lib().bpf.bpf_obj_get_info_by_fd(fd, info, ctypes.byref(size)))
    return ctypes.c_uint32.from_buffer(info, 4).value
