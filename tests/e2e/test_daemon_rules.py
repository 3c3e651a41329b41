"""The daemon's half of "never corrupt a stream" (#14), against the real smcd:

- a CLC timeout after CLC bytes crossed aborts the connection as the kernel does (the peer sees
  a reset, the application an error), instead of declining and handing back a stream a late
  Accept could still land in;
- a quota fallback names the quota on both halves (not only "declined with MAX_DMB");
- RESUME is verified against what the previous daemon recorded: a genuine channel resumes
  after a SIGKILL and counts against its user's quota; made-up ids and other sockets are
  refused and recorded nowhere;
- a consumer cursor moved ahead of the producer is noticed by the DMB observer, which aborts
  the connection with a named reason (both applications see ECONNRESET).
"""

from __future__ import annotations

import mmap
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from smc_handoff import layout
from smc_handoff import messages as m
from tests.control.daemon_proc import NotifySocket
from tests.control.dbusd import DbusDaemon
from tests.e2e.conftest import Smcd, pair

pytestmark = pytest.mark.timeout(120)

CLC_WAIT = 1.0
EYE = b"\xe2\xd4\xc3\xd9"


class RulesSmcd(Smcd):
    """127.0.0.1 is a configured SMC peer (so a client half proposes to a raw TCP server too),
    CLC waits are short and one user may hold two DMBs: one same-user connection."""

    def write_config(self, extra: str = "") -> None:
        super().write_config(f"clc_wait = {CLC_WAIT}\n[quota]\nconnections = 2\n{extra}")
        self.config.write_text('peers = ["127.0.0.1/32"]\n' + self.config.read_text())


@pytest.fixture(scope="module")
def smcd(work: Path, e2e_bus: DbusDaemon) -> Iterator[Smcd]:
    notify = NotifySocket(work / "notify")
    daemon = RulesSmcd(work, e2e_bus, notify)
    daemon.start()
    try:
        yield daemon
    finally:
        daemon.stop()
        notify.close()


def _close(*apps: Any) -> None:
    for app in apps:
        assert app.call("close") == {"ok": True}


def test_clc_timeout_after_a_proposal_aborts_the_connection(smcd: Smcd, apps: Any) -> None:
    """A raw TCP server reads the Proposal and never answers: the client's daemon times out
    after CLC_WAIT and resets the connection; the application gets an error, not a TCP
    fallback whose data the server could mistake for CLC or vice versa."""
    raw = socket.create_server(("127.0.0.1", 0))
    seen: dict[str, Any] = {}

    def serve() -> None:
        conn, _ = raw.accept()
        conn.settimeout(10)
        data = b""
        try:
            while True:
                piece = conn.recv(4096)
                if not piece:
                    seen["end"] = "eof"
                    break
                data += piece
        except ConnectionResetError:
            seen["end"] = "reset"
        except TimeoutError:
            seen["end"] = "timeout"
        seen["data"] = data
        conn.close()

    t = threading.Thread(target=serve)
    t.start()
    client = apps("client")
    got = client.call("connect", port=raw.getsockname()[1])
    t.join(15)
    raw.close()
    assert got.get("error") in ("ConnectionResetError", "TimeoutError"), got
    assert seen["data"].startswith(EYE), seen  # the Proposal did cross
    # and nothing after it: no Decline before the reset (the kernel sends none on its timer)
    assert len(seen["data"]) == int.from_bytes(seen["data"][5:7], "big"), seen
    assert seen["end"] == "reset", seen
    log = smcd.wait_log("timed out", "reset")
    assert "timed out" in log or "reset" in log, log[-2000:]


def test_a_quota_fallback_names_the_quota_on_both_halves(smcd: Smcd, apps: Any) -> None:
    server, client, _ = pair(apps)  # uses the user's two DMBs
    server2, client2 = apps("server2"), apps("client2")
    listening = server2.call("listen")
    server2.send("accept")
    c = client2.call("connect", port=listening["port"])
    s = server2.reply()
    for half in (c, s):
        assert half["mode"] == "tcp", half
        text = half["fallback"]["explanation"]
        assert "quota.connections" in text or "quota.buffer_bytes" in text, half
    _close(server, client, server2, client2)


def test_forged_resumes_are_refused(smcd: Smcd) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    tcp = socket.create_connection(listener.getsockname())
    accepted, _ = listener.accept()
    port = tcp.getsockname()[1]
    resume = m.Resume(77, m.Role.CLIENT, m.Mode.SMCD, 16384, 32768, 1234, 5678)
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as ctl:
        ctl.settimeout(5)
        ctl.connect(os.fspath(smcd.handoff))
        m.send_message(ctl, resume, [tcp.fileno()])
        reply, fds = m.recv_message(ctl, requests=False)
        m.close_fds(fds)
    assert isinstance(reply, m.Error) and reply.code == m.ErrorCode.DENIED, reply
    assert "no channel with this id" in reply.message, reply
    rows = smcd.wait_conns(lambda rs: True)
    assert not any(r["LocalPort"] == port for r in rows), rows
    tcp.send(b"x")  # the TCP socket is untouched
    assert accepted.recv(1) == b"x"
    for s in (tcp, accepted, listener):
        s.close()


def _resume_both(smcd: Smcd, server: Any, client: Any, port: int) -> list[dict[str, Any]]:
    """Make both halves wait until both resumed (the library looks for a new daemon before a
    wait, at most once a second); their rows."""
    deadline = time.monotonic() + 30
    while True:
        for waiter, sender in ((server, client), (client, server)):
            waiter.send("recv", n=2)
            time.sleep(1.2)  # a wait long enough to see the hang-up and RESUME
            assert sender.call("sendbytes", data="ok") == {"ok": True}
            assert waiter.reply() == {"data": "ok"}
        rows = smcd.smcctl_json("conns")
        mine = [r for r in rows if port in (r["LocalPort"], r["PeerPort"])]
        if len(mine) == 2:
            return mine
        assert time.monotonic() < deadline, rows


def test_a_genuine_channel_resumes_once_and_counts_against_the_quota(smcd: Smcd, apps: Any) -> None:
    server, client, port = pair(apps)
    smcd.kill()
    smcd.start()
    mine = _resume_both(smcd, server, client, port)
    assert {r["Role"] for r in mine} == {"CLIENT", "SERVER"}
    assert all(r["Mode"] == "SMCD" for r in mine), mine
    # the resumed halves hold the user's two DMBs: a new connection is past the quota
    s2, c2 = apps("server2"), apps("client2")
    listening = s2.call("listen")
    s2.send("accept")
    assert c2.call("connect", port=listening["port"])["mode"] == "tcp"
    assert s2.reply()["mode"] == "tcp"
    _close(s2, c2)
    # a RESUME of the same channel from another socket is refused
    listener = socket.create_server(("127.0.0.1", 0))
    tcp = socket.create_connection(listener.getsockname())
    accepted, _ = listener.accept()
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as ctl:
        ctl.settimeout(5)
        ctl.connect(os.fspath(smcd.handoff))
        conn_id = mine[0]["Id"]
        forged = m.Resume(conn_id, m.Role.CLIENT, m.Mode.SMCD, 65536, 65536)
        m.send_message(ctl, forged, [tcp.fileno()])
        reply, fds = m.recv_message(ctl, requests=False)
        m.close_fds(fds)
    assert isinstance(reply, m.Error) and reply.code == m.ErrorCode.DENIED, reply
    for s in (tcp, accepted, listener):
        s.close()
    # closing the resumed channel gives the quota back
    _close(server, client)
    time.sleep(0.5)
    server3, client3, _ = pair(apps)
    _close(server3, client3)


def _daemon_memfds(smcd: Smcd) -> list[str]:
    assert smcd.proc is not None
    pid = smcd.proc.proc.pid
    out = []
    for name in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{name}").startswith("/memfd:smcd-dmb"):
                out.append(f"/proc/{pid}/fd/{name}")
        except FileNotFoundError:
            continue
    return out


def test_a_consumer_cursor_ahead_of_the_producer_aborts_the_connection(
    smcd: Smcd, apps: Any
) -> None:
    server, client, _ = pair(apps)
    inodes = {d["inode"] for d in client.call("dmbs")["dmbs"]}
    server.send("recv_all")
    client.send("recv_all")
    mark = len(smcd.log())
    # Another writer (a buggy or hostile application) moves the consumer cursors of both
    # headers 1000 bytes ahead of producers that never moved.
    for path in _daemon_memfds(smcd):
        if os.stat(path).st_ino not in inodes:
            continue
        fd = os.open(path, os.O_RDWR)
        try:
            with mmap.mmap(fd, mmap.PAGESIZE) as mm:
                words = memoryview(mm).cast("Q")
                words[layout.W_TYPE] = layout.TYPE_WORD
                words[layout.W_CONS] = layout.cons_word(0, 1000, 0, 0)
                words.release()
        finally:
            os.close(fd)
    for app in (server, client):
        got = app.reply(timeout=10)
        assert got.get("error") == "ConnectionResetError", got
    log = smcd.wait_log("the consumer cursor is ahead of the producer", since=mark)
    assert "the consumer cursor is ahead of the producer" in log, log[-2000:]
    _close(server, client)


def test_a_stopping_daemon_lets_a_handshake_under_way_end(smcd: Smcd, apps: Any) -> None:
    """SIGTERM (``systemctl restart``) while a client half waits for its peer's answer to its
    Proposal: the daemon stops accepting, lets the handshake end (here the peer declines) and
    only then exits, so the application gets its TCP connection after the Decline both ends
    processed. Cancelled mid-CLC as before, the handshake left the application a stream with
    someone else's Proposal in it: an error (connection reset)."""
    from smcd_daemon.wire.clc_decline import Decline
    from smcd_daemon.wire.reasons import DeclineReason

    raw = socket.create_server(("127.0.0.1", 0))
    client = apps("client")
    stopper = threading.Thread(target=smcd.stop)
    try:
        client.send("connect", port=raw.getsockname()[1])
        conn, _ = raw.accept()
        conn.settimeout(10)
        proposal = conn.recv(4096)
        while len(proposal) < 7 or len(proposal) < int.from_bytes(proposal[5:7], "big"):
            proposal += conn.recv(4096)
        assert proposal.startswith(EYE), proposal
        stopper.start()
        time.sleep(0.3)  # SIGTERM delivered: the daemon stops accepting, the handshake waits
        assert smcd.alive(), "the daemon exited with a handshake under way"
        conn.sendall(Decline(int(DeclineReason.NOSMCDEV)).encode() + b"after the decline")
        got = client.reply(timeout=10)
        stopper.join(10)
        assert not smcd.alive()
        assert got.get("mode") == "tcp", got
        assert got["fallback"]["peer_diagnosis"] == int(DeclineReason.NOSMCDEV), got
        assert client.call("recv", n=17) == {"data": "after the decline"}
        assert client.call("sendbytes", data="plain tcp") == {"ok": True}
        assert conn.recv(100) == b"plain tcp"
        conn.close()
    finally:
        stopper.join(10)
        raw.close()
        if not smcd.alive():
            smcd.start()


def test_a_stopping_daemon_waits_for_handshakes_only_its_stop_grace(smcd: Smcd, apps: Any) -> None:
    """``timeouts.stop_grace`` (reloadable) bounds that wait: with 0.3 s, a handshake whose peer
    never answers the Proposal is not waited for up to its CLC timer (``clc_wait``, 1 s here);
    the daemon says so and exits, and the connection, whose stream already holds the Proposal,
    is reset (an error, never a stream with CLC bytes in it)."""
    raw = socket.create_server(("127.0.0.1", 0))
    smcd.write_config()
    text = smcd.config.read_text().replace("[timeouts]\n", "[timeouts]\nstop_grace = 0.3\n")
    smcd.config.write_text(text)
    assert smcd.proc is not None
    smcd.notify.clear()
    smcd.proc.signal(signal.SIGHUP)
    status = smcd.notify.wait_for("READY", "1")["STATUS"]
    assert "timeouts.stop_grace" in status, status
    client = apps("client")
    try:
        client.send("connect", port=raw.getsockname()[1])
        conn, _ = raw.accept()
        conn.settimeout(10)
        proposal = conn.recv(4096)
        assert proposal.startswith(EYE), proposal  # CLC began; the peer stays silent
        t0 = time.monotonic()
        smcd.stop()
        took = time.monotonic() - t0
        assert not smcd.alive()
        assert took < CLC_WAIT, took  # not the CLC timer's end
        log = smcd.log()
        assert "1 handshakes did not end within 0.3 s of the stop" in log, log[-2000:]
        got = client.reply(timeout=10)
        assert got.get("error") == "ConnectionResetError", got
        conn.close()
    finally:
        raw.close()
        smcd.write_config()
        if not smcd.alive():
            smcd.start()
