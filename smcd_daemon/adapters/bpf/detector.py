"""SMC peer detection: the RFC 7609 TCP option (kind 254, magic 0xE2D4C3D9) via eBPF.

The kernel's SMC marks the SYN and SYN-ACK of every AF_SMC connection with that option and
trusts it: a kernel server proposes nothing unless the client's SYN carried it, a kernel client
falls back with PEERNOSMC unless the SYN-ACK did. This module loads ``smc_option.bpf.c`` (built
by ``make bpf``) so that smcd's connections are marked the same way, and only those:

- a client socket is marked by its application before ``connect()``: :func:`request_option`
  issues a private ``setsockopt(SOL_SMCD, SMCD_OPT_WANT)`` that the cgroup/setsockopt program
  turns into a flag in the socket's BPF local storage (no daemon round trip, no race with the
  SYN, no privilege: any process under the cgroup may ask for its own socket). Without the
  program loaded the kernel answers ENOPROTOOPT, so the library knows detection is off.
  The daemon can mark a socket it holds with :meth:`Detector.mark_client` instead.
- a listener is registered by smcd (:meth:`Detector.mark_listener`, keyed by network namespace
  cookie and port): its SYN-ACK carries the option only when the client's SYN did.
- afterwards, :meth:`Detector.peer_has_option` reads the socket's storage by descriptor
  (the SK_STORAGE map's lookup-by-fd) and says whether the peer's SYN-ACK (client) or SYN
  (server) carried the option; ``None`` when nothing was recorded for that socket.

Loading needs CAP_BPF and CAP_NET_ADMIN (CAP_SYS_ADMIN too when no cgroup v2 hierarchy is
mounted and smcd mounts one, which smcd.service does not grant: systemd's mount serves); without
them :meth:`Detector.load` raises :class:`DetectionUnavailable`, which the daemon reports. The
programs are attached as BPF links: they go away with :meth:`Detector.close` or with the daemon's
process, whatever the way it ends.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import socket
import sys
import time
from dataclasses import dataclass
from enum import IntFlag
from pathlib import Path
from typing import Protocol

from smcd_daemon.adapters.bpf import cgroup as cg
from smcd_daemon.adapters.bpf.libbpf import LibbpfError, check, lib, prog_id
from smcd_daemon.errors import SmcError

SOL_SMCD = 0x534D43  # private setsockopt level ("SMC"); mirrored in smc_option.bpf.c
SMCD_OPT_WANT = 1
SO_NETNS_COOKIE = 71
SMC_OPTION = bytes((254, 6, 0xE2, 0xD4, 0xC3, 0xD9))  # kind, length, magic

_CAP_NET_ADMIN, _CAP_SYS_ADMIN, _CAP_BPF = 12, 21, 39
_OBJECT = "smc_option.bpf.o"
_PROGRAMS = ("smc_sockops", "smc_setsockopt", "smc_getsockopt")


class Flag(IntFlag):
    """Per-socket record kept by the BPF program (struct smc_sk.flags)."""

    WANT = 0x01  # the application asked for SMC: our SYN carries the option
    SENT = 0x02  # our SYN / SYN-ACK carried the option
    PEER = 0x04  # the peer's SYN-ACK / SYN carried it
    DONE = 0x08  # the handshake is complete: PEER is final
    ARMED = 0x10  # a listener created while the program was attached


class DetectionUnavailable(SmcError):
    """Peer detection cannot run here; ``reason`` says why and what would fix it."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(f"SMC peer detection unavailable: {reason}")


class _HasFileno(Protocol):
    def fileno(self) -> int: ...


@dataclass(frozen=True)
class OptionState:
    """What the program recorded for one socket."""

    flags: Flag

    @property
    def done(self) -> bool:
        return bool(self.flags & Flag.DONE)

    @property
    def sent(self) -> bool:
        return bool(self.flags & Flag.SENT)

    @property
    def peer(self) -> bool:
        return bool(self.flags & Flag.PEER)


@dataclass(frozen=True)
class ListenerMark:
    """A registered listener: keep it to unregister (the listener may be closed by then)."""

    netns: int
    port: int
    armed: bool  # False: the listener predates the program and its SYN-ACKs get no option


class _ListenerKey(ctypes.Structure):
    _fields_ = (("netns", ctypes.c_uint64), ("port", ctypes.c_uint32), ("pad", ctypes.c_uint32))


class _ConnKey(ctypes.Structure):
    _fields_ = (
        ("netns", ctypes.c_uint64),
        ("family", ctypes.c_uint32),
        ("local_port", ctypes.c_uint32),
        ("remote_port", ctypes.c_uint32),
        ("local_ip", ctypes.c_uint32 * 4),
        ("remote_ip", ctypes.c_uint32 * 4),
        ("pad", ctypes.c_uint32),
    )


def request_option(sock: socket.socket) -> bool:
    """Ask for the SMC option on this TCP socket's SYN (call before ``connect()``).

    What ``smc_handoff`` does (it has its own copy of the two constants). False when no
    detector is loaded (the kernel does not know the level: ENOPROTOOPT); other errors (EPERM:
    not an unconnected TCP socket) raise.
    """
    try:
        sock.setsockopt(SOL_SMCD, SMCD_OPT_WANT, 1)
    except OSError as exc:
        if exc.errno == errno.ENOPROTOOPT:
            return False
        raise
    return True


def netns_cookie(sock: socket.socket) -> int:
    """The cookie of the network namespace the socket lives in (SO_NETNS_COOKIE, Linux 5.14)."""
    return int.from_bytes(sock.getsockopt(socket.SOL_SOCKET, SO_NETNS_COOKIE, 8), sys.byteorder)


def object_path() -> Path:
    """Where the built object is: $SMCD_BPF_OBJECT, next to this module, or the tree's build/."""
    env = os.environ.get("SMCD_BPF_OBJECT")
    if env:
        return Path(env)
    here = Path(__file__).resolve().parent
    for candidate in (here / _OBJECT, here.parents[2] / "build" / "bpf" / _OBJECT):
        if candidate.exists():
            return candidate
    return here.parents[2] / "build" / "bpf" / _OBJECT


def missing_capabilities(*, need_mount: bool) -> list[str]:
    """The capabilities loading needs that this process lacks (from /proc/self/status)."""
    eff = 0
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                eff = int(line.split()[1], 16)
    need = {"CAP_BPF": _CAP_BPF, "CAP_NET_ADMIN": _CAP_NET_ADMIN}
    if need_mount:
        need["CAP_SYS_ADMIN"] = _CAP_SYS_ADMIN
    return [name for name, bit in need.items() if not eff >> bit & 1]


def _fd(sock: _HasFileno | int) -> int:
    return sock if isinstance(sock, int) else sock.fileno()


class Detector:
    """The loaded and attached programs and their maps. Use :meth:`load`."""

    def __init__(
        self, obj: int, links: list[int], fds: dict[str, int], cgroup: Path, mounted: bool
    ) -> None:
        self._obj: int | None = obj
        self._links = links
        self._fds = fds
        self.cgroup = cgroup
        self.mounted = mounted  # True: smcd mounted this cgroup2 hierarchy and unmounts it

    @classmethod
    def load(
        cls, cgroup: str | os.PathLike[str] | None = None, *, obj_path: Path | None = None
    ) -> Detector:
        """Load the programs and attach them to ``cgroup`` (None: the host's cgroup v2 root).

        Raises DetectionUnavailable naming what is missing: capabilities, the built object,
        libbpf, a cgroup v2 hierarchy, or what the kernel refused (with libbpf's log).
        """
        need_mount = cgroup is None and cg.find_cgroup2() is None
        missing = missing_capabilities(need_mount=False)
        if missing:
            raise DetectionUnavailable(
                f"smcd lacks {', '.join(missing)} (the systemd unit grants them through "
                "AmbientCapabilities=; run as root to try by hand)"
            )
        if need_mount and missing_capabilities(need_mount=True):
            # smcd.service does not grant CAP_SYS_ADMIN: the hierarchy must come from systemd.
            raise DetectionUnavailable(
                "no cgroup v2 hierarchy is mounted and smcd lacks CAP_SYS_ADMIN to mount one: "
                "boot with systemd's unified or hybrid cgroup layout (cgroup2 on /sys/fs/cgroup "
                "or /sys/fs/cgroup/unified), or mount cgroup2 before smcd starts"
            )
        path = obj_path or object_path()
        if not path.exists():
            raise DetectionUnavailable(f"{path} is not built: run `make bpf` (clang, libbpf-dev)")
        try:
            where, mounted = cg.resolve(cgroup)
        except cg.CgroupError as exc:
            raise DetectionUnavailable(str(exc)) from exc
        try:
            return cls._attach(path, where, mounted)
        except LibbpfError as exc:
            if mounted:
                cg.unmount(where)
            hint = ""
            if exc.errno == errno.EPERM:  # capabilities are there: seccomp or a LSM said no
                hint = " (under systemd: SystemCallFilter= must allow bpf)"
            raise DetectionUnavailable(f"{exc}{hint}") from exc

    @classmethod
    def _attach(cls, path: Path, where: Path, mounted: bool) -> Detector:
        bpf = lib().bpf
        links: list[int] = []
        with lib().capture() as log:
            obj = bpf.bpf_object__open_file(os.fsencode(path), None)
            if not obj:
                raise LibbpfError(f"bpf_object__open_file({path})", ctypes.get_errno(), log)
            try:
                check("bpf_object__load", bpf.bpf_object__load(obj), log)
                cgfd = os.open(where, os.O_RDONLY | os.O_DIRECTORY)
                try:
                    for name in _PROGRAMS:
                        prog = bpf.bpf_object__find_program_by_name(obj, name.encode())
                        if not prog:
                            raise LibbpfError(f"program {name} in {path}", errno.ENOENT, log)
                        link = bpf.bpf_program__attach_cgroup(prog, cgfd)
                        if not link:
                            raise LibbpfError(f"attach {name} to {where}", ctypes.get_errno(), log)
                        links.append(link)
                finally:
                    os.close(cgfd)
                fds = {}
                for name in ("smc_sk_state", "smc_listeners", "smc_synack_sent"):
                    fds[name] = check(name, bpf.bpf_object__find_map_fd_by_name(obj, name.encode()))
                for name in _PROGRAMS:
                    prog = bpf.bpf_object__find_program_by_name(obj, name.encode())
                    fds[name] = check(name, bpf.bpf_program__fd(prog))
            except BaseException:
                for link in links:
                    bpf.bpf_link__destroy(link)
                bpf.bpf_object__close(obj)
                raise
        return cls(obj, links, fds, where, mounted)

    # -- marking ---------------------------------------------------------------------------

    def mark_client(self, sock: _HasFileno | int) -> None:
        """Put the option on this unconnected socket's SYN (the daemon-side request_option)."""
        st = self.state(sock)
        value = ctypes.c_uint32((st.flags if st else 0) | Flag.WANT)
        self._update("smc_sk_state", ctypes.c_int(_fd(sock)), value)

    def mark_listener(self, sock: socket.socket) -> ListenerMark:
        """Register a listener: SYN-ACKs answering a SYN with the option carry it too."""
        key = _ListenerKey(netns_cookie(sock), sock.getsockname()[1], 0)
        self._update("smc_listeners", key, ctypes.c_uint8(1))
        st = self.state(sock)
        return ListenerMark(key.netns, key.port, armed=bool(st and st.flags & Flag.ARMED))

    def unmark_listener(self, mark: ListenerMark) -> None:
        """Unregister a listener (no error if it was not registered)."""
        key = _ListenerKey(mark.netns, mark.port, 0)
        rc = lib().bpf.bpf_map_delete_elem(self._fds["smc_listeners"], ctypes.byref(key))
        if rc < 0 and -rc != errno.ENOENT:
            check("bpf_map_delete_elem(smc_listeners)", rc)

    # -- reading ---------------------------------------------------------------------------

    def state(self, sock: _HasFileno | int) -> OptionState | None:
        """The socket's record, or None if the program recorded nothing for it."""
        key = ctypes.c_int(_fd(sock))
        value = ctypes.c_uint32()
        rc = lib().bpf.bpf_map_lookup_elem(
            self._fds["smc_sk_state"], ctypes.byref(key), ctypes.byref(value)
        )
        if rc < 0 and -rc == errno.ENOENT:
            return None
        check("bpf_map_lookup_elem(smc_sk_state)", rc)
        return OptionState(Flag(value.value))

    def peer_has_option(self, sock: _HasFileno | int) -> bool | None:
        """Did the peer's SYN-ACK (client) / SYN (server) carry the SMC option?

        None: nothing recorded (a client that did not ask, an unregistered listener's child, a
        handshake not complete): decide as without detection.
        """
        st = self.state(sock)
        if st is None or not st.done:
            return None
        return st.peer

    # -- housekeeping ----------------------------------------------------------------------

    def purge_half_open(self, older_than: float = 120.0) -> int:
        """Drop records of SYN-ACKs whose handshake never completed; returns how many."""
        bpf = lib().bpf
        fd = self._fds["smc_synack_sent"]
        limit = time.monotonic_ns() - int(older_than * 1e9)  # bpf_ktime_get_ns: CLOCK_MONOTONIC
        stale: list[_ConnKey] = []
        key, nxt, when = _ConnKey(), _ConnKey(), ctypes.c_uint64()
        prev = None
        while bpf.bpf_map_get_next_key(fd, prev, ctypes.byref(nxt)) == 0:
            found = bpf.bpf_map_lookup_elem(fd, ctypes.byref(nxt), ctypes.byref(when)) == 0
            if found and when.value < limit:
                stale.append(_ConnKey.from_buffer_copy(nxt))
            ctypes.memmove(ctypes.byref(key), ctypes.byref(nxt), ctypes.sizeof(key))
            prev = ctypes.byref(key)
        for k in stale:
            bpf.bpf_map_delete_elem(fd, ctypes.byref(k))
        return len(stale)

    def program_ids(self) -> list[int]:
        """Kernel ids of the attached programs (as ``bpftool prog``/``cgroup show`` list them)."""
        return [prog_id(self._fds[name]) for name in _PROGRAMS]

    @property
    def closed(self) -> bool:
        return self._obj is None

    def close(self) -> None:
        """Detach both programs, free the maps, unmount the hierarchy if we mounted it."""
        if self._obj is None:
            return
        bpf = lib().bpf
        for link in self._links:
            bpf.bpf_link__destroy(link)
        self._links = []
        bpf.bpf_object__close(self._obj)
        self._obj = None
        if self.mounted:
            cg.unmount(self.cgroup)

    def __enter__(self) -> Detector:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _update(self, name: str, key: ctypes._CData, value: ctypes._CData) -> None:
        if self._obj is None:
            raise SmcError("detector is closed")
        rc = lib().bpf.bpf_map_update_elem(
            self._fds[name], ctypes.byref(key), ctypes.byref(value), 0
        )
        check(f"bpf_map_update_elem({name})", rc)
