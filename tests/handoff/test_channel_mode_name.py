"""A channel's errors name its real mode: an SMC-R channel (RMBE + 32 bytes) that the peer
aborted says "SMC-R connection aborted by peer", not SMC-D's words."""

from __future__ import annotations

import os
import socket

import pytest

from smc_handoff import layout
from smc_handoff.channel import Channel, ChannelFds, make_pair

pytestmark = pytest.mark.timeout(60)


def memfd(size: int) -> int:
    """A channel buffer as the daemon maps it (an SMC-R buffer is no DMB: make_pair refuses)."""
    fd = os.memfd_create("smc-test", os.MFD_CLOEXEC)
    os.ftruncate(fd, size + layout.CTRL_LEN)
    return fd


def channels(size: int) -> tuple[Channel, Channel]:
    """Two connected ends over buffers of ``size`` bytes (an SMC-D DMB or an SMC-R RMBE + 32)."""
    if size in layout.DMB_SIZES:
        fa, fb = make_pair(size, size)
        return Channel.from_fds(fa), Channel.from_fds(fb)
    ra, rb = memfd(size), memfd(size)
    flags = os.EFD_CLOEXEC | os.EFD_NONBLOCK
    ea, eb = os.eventfd(0, flags), os.eventfd(0, flags)
    la, lb = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    end_a = ChannelFds(ra, rb, size, size, ea, eb, la.detach())
    end_b = ChannelFds(os.dup(rb), os.dup(ra), size, size, os.dup(eb), os.dup(ea), lb.detach())
    return Channel.from_fds(end_a), Channel.from_fds(end_b)


@pytest.mark.parametrize(
    ("size", "mode"),
    [(16 << 10, "SMC-D"), (layout.SMCR_CHANNEL_SIZES[0], "SMC-R"), (64 << 10, "SMC-D")],
)
def test_peer_abort_names_the_mode(size: int, mode: str) -> None:
    a, b = channels(size)
    assert a.mode_name == b.mode_name == mode
    a.abort()
    with pytest.raises(ConnectionResetError, match=f"{mode} connection aborted by peer$"):
        b.send_into(b"x")
    with pytest.raises(ConnectionResetError) as e:
        b.recv_into(bytearray(1))
    other = "SMC-D" if mode == "SMC-R" else "SMC-R"
    assert other not in str(e.value)
    b.close()


def test_closed_and_shut_name_the_mode() -> None:
    size = layout.SMCR_CHANNEL_SIZES[1]
    a, b = channels(size)
    a.shutdown_write()
    with pytest.raises(BrokenPipeError, match="SMC-R channel: shut down for writing"):
        a.send_into(b"x")
    b.close()
    a.close()
    with pytest.raises(OSError, match="SMC-R channel is closed"):
        a.recv_into(bytearray(1))
