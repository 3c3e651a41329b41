"""``smc_handoff.peer_option.request_option`` remembers "no detector" for a short time only.

Without a detector every request fails with ENOPROTOOPT; the library then skips the failing
setsockopt for ``NO_DETECTOR_TTL`` seconds. smcd may load its detector at any time (a restart):
a socket asked for within that window stays unmarked (as if connected before the load, which
the daemon handles as any undetected connection), and the first request after it is marked
again. Other refusals (EPERM: not an unconnected TCP socket) are not remembered. Real BPF
programs on the test's own cgroup, real sockets in a namespace pair.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from smc_handoff import peer_option
from smcd_daemon.adapters.bpf import Detector
from tests.bpf.conftest import Net
from tests.bpf.test_peer_detection import exchange, listener

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def late_detector(bpf_object: Path, cgroup: Path) -> Iterator[list[Detector]]:
    """Load the detector when the test says so (append to the list); closed at the end."""
    loaded: list[Detector] = []
    try:
        yield loaded
    finally:
        for d in loaded:
            d.close()


def test_no_detector_is_remembered_briefly(
    late_detector: list[Detector], bpf_object: Path, cgroup: Path, net: Net
) -> None:
    before = net.socket(net.ns_a)
    assert peer_option.request_option(before) is False  # ENOPROTOOPT: no detector yet
    det = Detector.load(cgroup, obj_path=bpf_object)
    late_detector.append(det)
    srv = listener(net)  # after the load: its SYN-ACKs can answer a marked SYN
    assert det.mark_listener(srv).armed
    t0 = time.monotonic()
    within = net.socket(net.ns_a)
    assert peer_option.request_option(within) is False  # still remembered: not asked
    assert time.monotonic() - t0 < peer_option.NO_DETECTOR_TTL
    conn_within = exchange(within, srv)
    assert det.peer_has_option(within) is None  # really unmarked: its SYN had no option
    assert det.peer_has_option(conn_within) is False
    time.sleep(peer_option.NO_DETECTOR_TTL + 0.05)
    after = net.socket(net.ns_a)
    assert peer_option.request_option(after) is True  # the loaded detector is seen again
    conn_after = exchange(after, srv)
    assert det.peer_has_option(after) is True and det.peer_has_option(conn_after) is True
    # EPERM (connected already) is no reason to skip the next socket
    assert peer_option.request_option(after) is False
    fresh = net.socket(net.ns_a)
    assert peer_option.request_option(fresh) is True
    for s in (before, within, conn_within, after, conn_after, fresh, srv):
        s.close()


def test_only_ip_stream_sockets_are_asked(late_detector: list[Detector], net: Net) -> None:
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        assert peer_option.request_option(udp) is False
        assert peer_option.request_option(unix) is False
    finally:
        udp.close()
        unix.close()
