"""A CLC timeout on the server half (#14): the daemon has read the head of a client's Proposal
and the rest never comes. As the kernel (``smc_clc_wait_msg``: -ETIMEDOUT, the connection
aborted, no Decline sent), the daemon resets the connection after ``timeouts.clc_wait``
without a Decline; it never hands the application a TCP stream that still holds the rest
of the Proposal (which would reach the application as data if the client sent it later). The
client's side of the timeout, after a Proposal crossed, is ``tests/e2e/test_daemon_rules.py``.

Against the real smcd, a server application using ``smc_handoff`` (the e2e harness's App) and
a raw TCP client that speaks as a peer's daemon would, then stalls.
"""

from __future__ import annotations

import shutil
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from smcd_daemon.protocol.negotiate.outcome import DECL_CLC_TIMEOUT
from tests.control.daemon_proc import NotifySocket
from tests.control.dbusd import dbus_daemon
from tests.e2e.conftest import App, Smcd

pytestmark = pytest.mark.timeout(60)

CLC_WAIT = 1.0
PROPOSAL_HEAD = b"\xe2\xd4\xc3\xd9" + bytes([1]) + (120).to_bytes(2, "big") + bytes([0x20])
"""The 8-byte header of a 120-byte SMC-R v2 CLC Proposal."""


@pytest.fixture
def smcd() -> Iterator[Smcd]:
    if shutil.which("dbus-daemon") is None:
        pytest.fail("dbus-daemon is missing: install it with tests/host/install-deps.sh")
    work = Path(tempfile.mkdtemp(prefix="smcd-clc-timeout-", dir="/tmp"))
    notify = NotifySocket(work / "notify")
    try:
        with dbus_daemon("session") as bus:
            daemon = Smcd(work, bus, notify)
            daemon.write_config(f"clc_wait = {CLC_WAIT}\n")  # in [timeouts]
            daemon.start()
            try:
                yield daemon
            finally:
                daemon.stop()
    finally:
        notify.close()
        shutil.rmtree(work, ignore_errors=True)


@pytest.mark.parametrize("sent", [8, 8 + 40], ids=["header", "header-and-part"])
def test_server_half_clc_timeout_resets_the_connection(smcd: Smcd, sent: int) -> None:
    server = App(smcd.handoff, "server")
    raw: socket.socket | None = None
    try:
        listening = server.call("listen")
        assert listening["registered"], listening
        server.send("accept")
        raw = socket.create_connection(("127.0.0.1", listening["port"]))
        raw.sendall((PROPOSAL_HEAD + bytes(112))[:sent])
        t0 = time.monotonic()
        s = server.reply(timeout=CLC_WAIT + 15)
        # the accept path hands out a socket that was reset (an error on first use), never a
        # fallback whose stream still holds the Proposal's rest
        assert s["mode"] == "tcp", s
        assert "connection reset" in s["fallback"]["explanation"], s
        # the client: the reset and nothing before it (the kernel sends no Decline when
        # smc_clc_wait_msg times out: a negative code only fails the connection)
        raw.settimeout(10)
        got_raw = b""
        with pytest.raises(ConnectionResetError):
            while piece := raw.recv(100):
                got_raw += piece
        assert got_raw == b"", got_raw.hex()
        assert time.monotonic() - t0 >= CLC_WAIT - 0.2  # it waited for the CLC timer first
        got = server.call("recv_all")
        assert got.get("error") == "ConnectionResetError", got
        assert got["n"] == 0, got
        log = smcd.log()
        assert "Traceback" not in log, log[-3000:]
        assert f"0x{DECL_CLC_TIMEOUT:08x}" in log and "no Decline" in log, log[-3000:]
    finally:
        if raw is not None:
            raw.close()
        server.close()
