"""smcd is out of the data path: SIGKILL it in the middle of a transfer and restart it. The
established channels keep moving bytes without loss, a peer's death is still detected (the peer
link, not the daemon, carries liveness), and the restarted daemon serves new handoffs."""

from __future__ import annotations

import os
import re
import socket
import time
from typing import Any

import pytest

from smc_handoff import messages as m
from tests.e2e.conftest import Smcd, pair

pytestmark = pytest.mark.timeout(120)

TOTAL = 24 * 1024 * 1024 + 13


@pytest.mark.parametrize("how", ["sigkill", "sigterm"])
def test_daemon_stopped_and_restarted_mid_transfer(smcd: Smcd, apps: Any, how: str) -> None:
    """A SIGKILL, or the SIGTERM of ``systemctl restart``/``stop``: a daemon that stops in
    order used to release its channel halves as if their applications had hung up, and a
    released DMB is zeroed (a hole punched into the memfd) under the rings both applications
    still moved data through: the transfer read zeroed cursors and data ("peer claims
    68561779584 bytes in a 1048544-byte ring", or corrupt bytes), and the successor could not
    verify their RESUMEs."""
    server, client, _ = pair(apps)
    idle_server, idle_client, _ = pair(apps)  # established before the kill, idle throughout
    server.send("recv_all")
    client.send("send", n=TOTAL, seed=42, chunk=262_139, pace=0.01)  # ~1 s of paced writes
    time.sleep(0.3)
    pid = smcd.proc.proc.pid if smcd.proc else 0
    if how == "sigkill":
        smcd.kill()
    else:
        smcd.stop()
    assert not smcd.alive()
    smcd.start()  # a new process, a new loopback GID, an empty registry
    assert smcd.proc is not None and smcd.proc.proc.pid != pid
    sent = client.reply(timeout=60)
    assert sent.get("sent") == TOTAL, sent
    assert client.call("shutdown") == {"ok": True}
    got = server.reply(timeout=60)
    assert got["eof"] and (got["n"], got["sha"]) == (TOTAL, sent["sha"]), got  # no byte lost
    # the old daemon left its journal: the new one can verify the four halves' RESUMEs
    found = re.search(r"(\d+) channel halves of the previous daemon may resume", smcd.log())
    assert found is not None and int(found[1]) >= 4, smcd.log()[-3000:]
    # Death is still detected on a channel the new daemon knows nothing about: the killed
    # client had read everything, so its end closes in order (EOF), as its kernel would close it.
    idle_server.send("recv_all")
    idle_client.kill()
    ended = idle_server.reply(timeout=5)
    assert ended.get("eof") and ended["n"] == 0 and ended["elapsed"] < 1.0, ended
    # The restarted daemon serves new handoffs.
    server2, client2, _ = pair(apps)
    server2.send("recv_all")
    sent2 = client2.call("send", n=100_003, seed=9, chunk=1009)
    client2.call("close")
    got2 = server2.reply()
    assert (got2["n"], got2["sha"]) == (sent2["sent"], sent2["sha"])


def test_resume_of_a_channel_no_daemon_made_is_refused(smcd: Smcd) -> None:
    """RESUME is verified against what the previous daemon recorded (#14): a made-up id with a
    plain TCP socket is refused (DENIED) and recorded nowhere. A genuine channel resuming after
    a SIGKILL: tests/e2e/test_daemon_rules.py."""
    listener = socket.create_server(("127.0.0.1", 0))
    tcp = socket.create_connection(listener.getsockname())
    accepted, _ = listener.accept()
    port = tcp.getsockname()[1]
    resume = m.Resume(77, m.Role.CLIENT, m.Mode.SMCD, 16384, 32768, 1234, 5678)
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as ctl:
        ctl.settimeout(5)
        ctl.connect(os.fspath(smcd.handoff))
        m.send_message(ctl, resume, [tcp.fileno()])
        reply, _ = m.recv_message(ctl, requests=False)
        assert isinstance(reply, m.Error) and reply.code == m.ErrorCode.DENIED, reply
        rows = smcd.wait_conns(lambda rs: True)
        assert not any(r["LocalPort"] == port for r in rows), rows
    for s in (tcp, accepted, listener):
        s.close()


def test_resume_refuses_an_smcr_channel(smcd: Smcd) -> None:
    """An SMC-R channel dies with the daemon that relayed it: RESUME of one is refused (BAD_STATE)
    and nothing is recorded, instead of showing it as an SMC-D connection."""
    listener = socket.create_server(("127.0.0.1", 0))
    tcp = socket.create_connection(listener.getsockname())
    accepted, _ = listener.accept()
    port = tcp.getsockname()[1]
    resume = m.Resume(78, m.Role.CLIENT, m.Mode.SMCR, 16384, 16384)
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as ctl:
        ctl.settimeout(5)
        ctl.connect(os.fspath(smcd.handoff))
        m.send_message(ctl, resume, [tcp.fileno()])
        reply, fds = m.recv_message(ctl, requests=False)
        m.close_fds(fds)
        assert isinstance(reply, m.Error) and reply.code == m.ErrorCode.BAD_STATE, reply
        assert "SMCR" in reply.message, reply
        rows = smcd.wait_conns(lambda rs: True)
        assert not any(r["LocalPort"] == port for r in rows), rows
    tcp.send(b"x")  # the application's TCP socket is untouched
    assert accepted.recv(1) == b"x"
    for s in (tcp, accepted, listener):
        s.close()


def test_a_listener_registers_again_soon_after_the_daemon_is_back(smcd: Smcd, apps: Any) -> None:
    """A listener's registration dies with the daemon and is renewed at an ``accept()``. One
    tried while the daemon could not be reached fails, and the next try used to wait a whole
    second: every connection of that second fell back (~200 after a restart in a busy probe).
    Now tries come every 0.1 s (a try is a ``connect()`` that fails at once). Here the
    unreachable daemon is a restarted one whose socket is briefly out of sight, so that the
    failed try comes right before it is back."""
    server, client = apps("server"), apps("client")
    port = server.call("listen")["port"]

    def one() -> tuple[str, str]:
        server.send("accept")
        c = client.call("connect", port=port)
        s = server.reply()
        assert client.call("close") == {"ok": True} and server.call("close") == {"ok": True}
        return c["mode"], s["mode"]

    smcd.stop()
    smcd.start()  # the listener's registration went with the old daemon
    away = smcd.handoff.with_name("away.sock")
    os.rename(smcd.handoff, away)
    try:
        assert one() == ("tcp", "tcp")  # its accept() tried to register again, in vain
    finally:
        os.rename(away, smcd.handoff)
    time.sleep(0.3)
    # The first accept() registers the listener again (its own connection finds it or not,
    # as its client half or the registration reaches smcd first); the next connection is SMC.
    # With a second between tries, both accept()s came too early and both stayed on TCP.
    one()
    assert one() == ("smcd", "smcd")
