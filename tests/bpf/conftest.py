"""Harness for the peer-detection tests: real eBPF, real namespaces, real packets.

- ``bpf_object``: the object ``make bpf`` builds (built here if missing).
- ``cgroup``: a child of the host's cgroup v2 root made for the test, with this pytest process
  moved into it; the detector is attached there, so the test's sockets are covered and nothing
  else on the machine (other test runs) is.
- ``net``: two network namespaces joined by a veth pair, 198.51.100.1 (A) and 198.51.100.2 (B);
  :meth:`Net.socket` creates a socket inside one of them (setns of this thread, then back), and
  :meth:`Net.capture` records the veth in A with tcpdump for tshark to decode.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from smcd_daemon.adapters.bpf import cgroup as cg
from smcd_daemon.adapters.bpf import object_path

REPO = Path(__file__).resolve().parents[2]
ADDR_A, ADDR_B = "198.51.100.1", "198.51.100.2"
_CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


def _need(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        pytest.fail(f"{tool} is missing: run `bash tests/host/install-deps.sh` (or `make deps`)")
    return path


def sh(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, timeout=30)


@pytest.fixture(scope="session")
def bpf_object() -> Path:
    path = object_path()
    if not path.exists():
        _need("clang")
        subprocess.run(["make", "-C", os.fspath(REPO), "bpf"], check=True, timeout=300)
    assert path.exists(), f"make bpf did not produce {path}"
    return path


@pytest.fixture
def cgroup() -> Iterator[Path]:
    root, mounted = cg.resolve(None)
    child = root / f"smcd-bpf-test-{os.getpid()}"
    child.mkdir(exist_ok=True)
    (child / "cgroup.procs").write_text(str(os.getpid()))
    try:
        yield child
    finally:
        (root / "cgroup.procs").write_text(str(os.getpid()))
        child.rmdir()
        if mounted:
            cg.unmount(root)


@dataclass
class Capture:
    """One tcpdump on veth A; :meth:`packets` stops it and decodes with tshark."""

    proc: subprocess.Popen[bytes]
    pcap: Path

    def packets(self) -> list[dict[str, str]]:
        time.sleep(0.2)  # the last ACKs reach the capture
        self.proc.send_signal(signal.SIGINT)
        self.proc.wait(timeout=10)
        fields = ("tcp.srcport", "tcp.dstport", "tcp.flags.syn", "tcp.flags.ack",
                  "tcp.len", "tcp.option_kind", "tcp.options.experimental.exid",
                  "tcp.options.experimental.data")  # fmt: skip
        argv = [_need("tshark"), "-r", os.fspath(self.pcap), "-T", "fields", "-E", "separator=|"]
        for f in fields:
            argv += ["-e", f]
        out = subprocess.run(argv, check=True, capture_output=True, text=True, timeout=60).stdout
        rows = [dict(zip(fields, line.split("|"), strict=True)) for line in out.splitlines()]
        assert rows, "tcpdump captured nothing on the veth"
        return rows

    def dissection(self) -> str:
        """tshark's full text decode of the SYNs (call after :meth:`packets`)."""
        argv = [_need("tshark"), "-r", os.fspath(self.pcap), "-V", "-Y", "tcp.flags.syn == 1"]
        return subprocess.run(argv, check=True, capture_output=True, text=True, timeout=60).stdout


class Net:
    def __init__(self, tag: str, work: Path) -> None:
        self.ns_a, self.ns_b = f"{tag}a", f"{tag}b"
        self.work = work

    def socket(self, ns: str, family: int = socket.AF_INET) -> socket.socket:
        """A TCP socket created inside namespace ``ns``."""
        own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        target = os.open(f"/run/netns/{ns}", os.O_RDONLY)
        try:
            if _libc.setns(target, _CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), f"setns {ns}")
            try:
                return socket.socket(family, socket.SOCK_STREAM)
            finally:
                if _libc.setns(own, _CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), "setns back")
        finally:
            os.close(own)
            os.close(target)

    def capture(self) -> Capture:
        pcap = self.work / f"cap{time.monotonic_ns()}.pcap"
        # --immediate-mode: without it, SIGINT drops packets still in the capture ring
        tcpdump = [_need("tcpdump"), "-i", "veth0", "-U", "-n", "--immediate-mode"]
        argv = ["ip", "netns", "exec", self.ns_a, *tcpdump, "-w", os.fspath(pcap), "tcp"]
        proc = subprocess.Popen(argv, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL)
        assert proc.stderr is not None
        line = proc.stderr.readline().decode()  # "listening on veth0 ..." once it captures
        if "listening on" not in line:
            proc.kill()
            pytest.fail(f"tcpdump did not start: {line}{proc.stderr.read().decode()}")
        return Capture(proc, pcap)


@contextlib.contextmanager
def two_hosts(tag: str, work: Path) -> Iterator[Net]:
    """Namespaces A (ADDR_A on veth0) and B (ADDR_B on veth1) joined by a veth pair; ``work``
    is removed afterwards."""
    _need("ip")
    n = Net(tag, work)
    try:
        sh("ip", "netns", "add", n.ns_a)
        sh("ip", "netns", "add", n.ns_b)
        sh("ip", "-n", n.ns_a, "link", "add", "veth0", "type", "veth", "peer", "name", "veth1",
           "netns", n.ns_b)  # fmt: skip
        sh("ip", "-n", n.ns_a, "addr", "add", f"{ADDR_A}/24", "dev", "veth0")
        sh("ip", "-n", n.ns_b, "addr", "add", f"{ADDR_B}/24", "dev", "veth1")
        for ns, dev in ((n.ns_a, "veth0"), (n.ns_b, "veth1"), (n.ns_a, "lo"), (n.ns_b, "lo")):
            sh("ip", "-n", ns, "link", "set", dev, "up")
        yield n
    finally:
        for ns in (n.ns_a, n.ns_b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        shutil.rmtree(work, ignore_errors=True)


@pytest.fixture
def net() -> Iterator[Net]:
    work = Path(tempfile.mkdtemp(prefix="smcd-bpf-", dir="/tmp"))
    with two_hosts(f"smcbpf{os.getpid()}", work) as n:
        yield n
