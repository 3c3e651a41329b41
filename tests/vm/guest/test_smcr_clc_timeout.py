"""The SMC-R CLC timer through a real daemon and the real wire: a peer that takes the Proposal
and never answers.

Host A's ``smcd`` (``peers`` names B's network, so it proposes without peer detection) serves a
client application that connects to 192.0.2.2 over the virtio wire; the "server" there is this
test's own raw TCP socket, which reads the SMC-R Proposal and stays silent. After
``timeouts.clc_wait`` the client's daemon must fail the connection, as the kernel's
``smc_connect_clc`` does on its timer (``smc_clc_wait_msg`` → ``-ETIMEDOUT``, no fallback once CLC
began): the application gets an error, the peer a reset and no Decline (as the kernel), and
neither ever reads the other's bytes as CLC or data. No link group is left behind (a first
contact makes one only on the Accept). The SMC-D half of this rule is
``tests/e2e/test_daemon_rules.py``; the negotiation's own timer is unit-tested in
``tests/protocol``.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from smcd_daemon.wire.clc import Proposal, SmcType, decode
from tests.vm.guest import daemons as dm
from tests.vm.guest.daemons import Daemon

SERVER = "192.0.2.2"
CLIENT = "192.0.2.1"
PORT = 47341  # its own: test_smcr_chaos listens on 47331
CLC_WAIT = 4.0
"""Short for a test, long enough for TCG: the Proposal crosses in milliseconds."""
EYECATCHER_R = b"\xe2\xd4\xc3\xd9"

CLIENT_APP = r"""
import json, sys, time, smc_handoff
t0 = time.monotonic()
try:
    s = smc_handoff.connect((sys.argv[1], int(sys.argv[2])), 120, source_address=(sys.argv[3], 0))
except OSError as e:
    out = {"error": type(e).__name__, "text": str(e)}
else:
    out = {"error": None, "mode": s.mode, "fallback": str(s.fallback)}
    s.close()
out["seconds"] = time.monotonic() - t0
print(json.dumps(out), flush=True)
"""


@pytest.fixture(scope="module")
def daemon_a(out_dir: Path) -> Iterator[Daemon]:
    config = dm.config_text(peers=["192.0.2.0/24"], ueids=["SMCD-VM-CLC-TIMER"], clc_wait=CLC_WAIT)
    a = dm.start(out_dir / "scratch" / "smcr_clc_timeout", "a", config)
    try:
        dm.wait_ready(a)
        yield a
    finally:
        dm.stop((a,))


@pytest.mark.timeout(300)
def test_a_silent_peer_after_the_proposal_fails_the_connection(daemon_a: Daemon) -> None:
    raw = socket.create_server((SERVER, PORT))
    seen: dict[str, Any] = {}

    def serve() -> None:
        conn, _ = raw.accept()
        conn.settimeout(CLC_WAIT + 120)
        data = b""
        try:
            while piece := conn.recv(4096):
                data += piece
            seen["end"] = "eof"
        except ConnectionResetError:
            seen["end"] = "reset"
        except TimeoutError:
            seen["end"] = "timeout"
        seen["data"] = data
        seen["at"] = time.monotonic()
        conn.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    app = dm.app(CLIENT_APP, daemon_a, SERVER, str(PORT), CLIENT)
    try:
        out, err = app.communicate(timeout=CLC_WAIT + 150)
    except Exception:
        app.kill()
        out, err = app.communicate()
    t.join(CLC_WAIT + 150)
    raw.close()
    context = f"app: {out!r} {err[-2000:]!r}\nraw server: {seen}\n{daemon_a.tail()}"
    got = json.loads(out.strip().splitlines()[-1]) if out.strip() else {}

    # The application: an error, never a TCP fallback with the Proposal gone into its stream.
    assert got.get("error") in ("ConnectionResetError", "TimeoutError"), context
    assert got["seconds"] >= CLC_WAIT * 0.9, context  # the daemon waited out its timer
    # The peer: one SMC-R Proposal, then a reset: no Decline (the kernel sends none when
    # smc_clc_wait_msg times out), not a FIN a server could take for the end of a plain
    # stream, and no application byte.
    data = seen.get("data", b"")
    assert data[:4] == EYECATCHER_R, context
    first = int.from_bytes(data[5:7], "big")
    msg = decode(data[:first])
    assert isinstance(msg, Proposal), context
    assert {msg.typev1, msg.typev2} & {SmcType.R, SmcType.B}, msg
    rest = data[first:]
    assert rest == b"", context
    assert seen.get("end") == "reset", context
    # The daemon: the timer named, and no link group left from the first contact.
    log = daemon_a.log_text()
    assert f"no CLC ACCEPT within {CLC_WAIT:g} s" in log, context
    assert "SMC_CLC_DECL_TIMEOUT" in log and "the connection was reset" in log, context
    lgs = [g for g in daemon_a.ctl_json("linkgroup", "show") if g.get("Type") == "SMC-R"]
    assert lgs == [], lgs
