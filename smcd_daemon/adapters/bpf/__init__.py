"""SMC peer detection with the RFC 7609 TCP option, written and read by eBPF (see detector)."""

from smcd_daemon.adapters.bpf.cgroup import CgroupError
from smcd_daemon.adapters.bpf.detector import (
    SMC_OPTION,
    SMCD_OPT_WANT,
    SOL_SMCD,
    DetectionUnavailable,
    Detector,
    Flag,
    ListenerMark,
    OptionState,
    object_path,
    request_option,
)
from smcd_daemon.adapters.bpf.libbpf import LibbpfError

__all__ = [
    "SMCD_OPT_WANT",
    "SMC_OPTION",
    "SOL_SMCD",
    "CgroupError",
    "DetectionUnavailable",
    "Detector",
    "Flag",
    "LibbpfError",
    "ListenerMark",
    "OptionState",
    "object_path",
    "request_option",
]
