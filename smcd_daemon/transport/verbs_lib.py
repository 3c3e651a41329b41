"""The pyverbs boundary of the verbs transport: loading pyverbs lazily, its errors as
:class:`VerbsError`, the QP attribute objects, GID text, and finding the event descriptors
pyverbs does not expose (see ``verbs.py``). pyverbs is untyped: its objects are ``Any`` here and
in ``verbs.py``/``verbs_mr.py``, and nowhere above them."""

from __future__ import annotations

import errno
import importlib
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from smcd_daemon.errors import SmcError
from smcd_daemon.transport.verbs_model import QpAttrSpec

__all__ = [
    "EVENT_FD_TARGET",
    "SYSFS_INFINIBAND",
    "SendSlotsExhausted",
    "VerbsError",
    "VerbsUnavailable",
    "build_qp_attr",
    "errno_of",
    "fd_targets",
    "gid_bytes",
    "gid_text",
    "list_devices",
    "load_pyverbs",
    "new_event_fd",
    "open_fds",
    "verbs_error",
]

SYSFS_INFINIBAND = Path("/sys/class/infiniband")
EVENT_FD_TARGET = "anon_inode:[infinibandevent]"


class VerbsUnavailable(SmcError):
    """No usable RDMA here: pyverbs missing, no devices, or the named device/port is absent."""


class VerbsError(SmcError):
    """A verbs call failed (the message names the call, the device and the errno)."""


class SendSlotsExhausted(VerbsError):
    """All send slots (or send queue entries) of the link are in flight: wait for SendDone."""


# --------------------------------------------------------------------------------------------
# pyverbs, lazily
# --------------------------------------------------------------------------------------------

_pv: SimpleNamespace | None = None
_PYVERBS_MODULES = ("device", "enums", "addr", "cq", "mr", "pd", "qp", "wr")


def load_pyverbs() -> SimpleNamespace:
    """The pyverbs modules we use, imported on first need; VerbsUnavailable if they are not
    installed (PyPI's pyverbs needs a newer libibverbs than Debian's: use python3-pyverbs in a
    ``--system-site-packages`` venv)."""
    global _pv
    if _pv is not None:
        return _pv
    # importlib rather than import statements: pyverbs ships no type information, and its
    # modules are used as ``Any`` through the namespace below
    try:
        mods = {name: importlib.import_module(f"pyverbs.{name}") for name in _PYVERBS_MODULES}
        error = importlib.import_module("pyverbs.pyverbs_error").PyverbsError
    except ImportError as exc:
        raise VerbsUnavailable(
            f"pyverbs cannot be imported ({exc}): install Debian's python3-pyverbs "
            "(rdma-core) and run from /usr/bin/python3 or a venv made with "
            "--system-site-packages"
        ) from exc
    _pv = SimpleNamespace(e=mods.pop("enums"), Error=error, **mods)
    return _pv


def errno_of(exc: BaseException) -> int | None:
    code = getattr(exc, "error_code", None)
    return code if isinstance(code, int) and code > 0 else None


def verbs_error(what: str, exc: BaseException) -> VerbsError:
    code = errno_of(exc)
    why = f"{errno.errorcode.get(code, code)}: {os.strerror(code)}" if code else str(exc)
    return VerbsError(f"{what} failed ({why})")


def list_devices() -> list[str]:
    """Names of the RDMA devices libibverbs sees; [] when there are none (libibverbs reports
    that as an error, which is not one here)."""
    pv = load_pyverbs()
    try:
        devs = pv.device.get_device_list()
    except pv.Error:
        return []
    return sorted(d.name.decode() if isinstance(d.name, bytes) else str(d.name) for d in devs)


def build_qp_attr(spec: QpAttrSpec) -> tuple[Any, int]:
    """A pyverbs ``QPAttr`` and the ``ibv_qp_attr_mask`` for one :class:`QpAttrSpec`."""
    pv = load_pyverbs()
    e = pv.e
    attr = pv.qp.QPAttr(qp_state=getattr(e, f"IBV_QPS_{spec.state}"))
    for name, value in spec.attrs.items():
        setattr(attr, name, value)
    if spec.port_num is not None:
        attr.port_num = spec.port_num
    if spec.grh is not None:
        g = spec.grh
        gr = pv.addr.GlobalRoute(
            dgid=pv.addr.GID(gid_text(g.dgid)),
            sgid_index=g.sgid_index,
            hop_limit=g.hop_limit,
            traffic_class=g.traffic_class,
            flow_label=g.flow_label,
        )
        attr.ah_attr = pv.addr.AHAttr(port_num=spec.av_port or 1, is_global=1, gr=gr)
    mask = 0
    for name in spec.mask_names():
        mask |= int(getattr(e, f"IBV_QP_{name}"))
    return attr, mask


def gid_text(gid: bytes) -> str:
    h = gid.hex()
    return ":".join(h[i : i + 4] for i in range(0, 32, 4))


def gid_bytes(text: str) -> bytes:
    return bytes.fromhex(text.replace(":", ""))


# --------------------------------------------------------------------------------------------
# event descriptors
# --------------------------------------------------------------------------------------------


def new_event_fd(before: set[int]) -> int | None:
    """The one ``[infinibandevent]`` descriptor not in ``before`` (None if not exactly one):
    the async fd of a context just opened, or the fd of a completion channel just created."""
    found = [
        fd for fd, target in fd_targets().items() if fd not in before and target == EVENT_FD_TARGET
    ]
    return found[0] if len(found) == 1 else None


def fd_targets() -> dict[int, str]:
    """Open descriptors and what they point to. The descriptor ``listdir`` itself used is closed
    by the time we ask, so it is left out (its number is the next one to be reused)."""
    out = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            out[int(name)] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
    return out


def open_fds() -> set[int]:
    return set(fd_targets())
