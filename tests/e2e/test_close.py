"""Every close path of a channel the daemon built (RFC 7609 §4 semantics, as a TCP socket shows
them): both orders, half-close, close with unread data (the peer sees ECONNRESET) and SIGKILL of
either side, seen within a second through the peer link: the close the kernel makes for an exiting
process (``smc_close_final``): EOF after the dead end's data when it had read everything, as TCP's
FIN, else ECONNRESET, as TCP's RST)."""

from __future__ import annotations

import time
from typing import Any

import pytest

from tests.e2e.conftest import Smcd, pair

pytestmark = pytest.mark.timeout(120)

TCP_FIN_WAIT1, TCP_FIN_WAIT2, TCP_CLOSE_WAIT = 4, 5, 8  # include/net/tcp_states.h


@pytest.mark.parametrize("first", ["client", "server"])
def test_close_in_either_order(smcd: Smcd, apps: Any, first: str) -> None:
    server, client, _ = pair(apps)
    ends = {"client": client, "server": server}
    closer, other = ends[first], ends["server" if first == "client" else "client"]
    other.send("recv_all")
    sent = closer.call("send", n=200_003, seed=11, chunk=3001)
    assert closer.call("close") == {"ok": True}
    got = other.reply()
    assert got["eof"] and (got["n"], got["sha"]) == (sent["sent"], sent["sha"]), got
    assert other.call("close") == {"ok": True}


def test_half_close(smcd: Smcd, apps: Any) -> None:
    """shutdown(SHUT_WR): the peer reads everything then EOF, and can still answer."""
    server, client, _ = pair(apps)
    server.send("recv_all")
    sent = client.call("send", n=150_001, seed=5, chunk=1021)
    assert client.call("shutdown") == {"ok": True}
    got = server.reply()
    assert got["eof"] and (got["n"], got["sha"]) == (sent["sent"], sent["sha"])
    # The TCP connection under the channel is half-closed too, as the kernel's smc_shutdown
    # shuts its clcsock down: our FIN went out, the peer's TCP waits for its application.
    assert client.call("tcp_state")["state"] in (TCP_FIN_WAIT1, TCP_FIN_WAIT2)
    assert server.call("tcp_state")["state"] == TCP_CLOSE_WAIT
    client.send("recv_all")
    answer = server.call("send", n=70_001, seed=6, chunk=997)
    assert server.call("close") == {"ok": True}
    got = client.reply()
    assert got["eof"] and (got["n"], got["sha"]) == (answer["sent"], answer["sha"])


@pytest.mark.parametrize("blocked", ["bg_recv", "bg_send"])
def test_close_while_another_thread_is_blocked_on_the_socket(
    smcd: Smcd, apps: Any, blocked: str
) -> None:
    """A program's shutdown path: one thread blocked in ``recv()`` (or in ``sendall()`` to a
    peer that does not read) while another closes the socket. The blocked call ends with
    ``OSError(EBADF)``, as a closed socket's calls do, not with a ``ValueError`` from the
    channel's released memory views that a thread catching ``OSError`` dies of."""
    server, client, _ = pair(apps)
    assert client.call(blocked, n=64 << 20) == {"ok": True}
    assert client.call("close") == {"ok": True}
    assert client.call("bg_result") == {"alive": False, "error": "OSError", "errno": 9}
    server.send("recv_all")  # the peer reads what the ring held, then the end
    got = server.reply()
    assert got.get("eof") or got.get("error") == "ConnectionResetError", got


@pytest.mark.parametrize("polled", [False, True], ids=["blocking", "polled"])
@pytest.mark.parametrize("how", ["SHUT_RD", "SHUT_RDWR"])
def test_shutdown_wakes_a_reader_blocked_in_another_thread(
    smcd: Smcd, apps: Any, how: str, polled: bool
) -> None:
    """The usual way to stop a reader thread: ``shutdown()`` from another one. TCP's wakes the
    blocked ``recv()``, which returns ``b""``. Here the reader woke only when its nap ended and
    then spun at full CPU: the socket's wait loop looked only for the peer's EOF, not for the
    shutdown, until the socket was closed. A reader that sleeps on the eventfd (``polled``: the
    program took ``fileno()``) is kicked at once; one on the peer link looks again within a
    second. Data the peer sends afterwards is still readable, as on Linux TCP."""
    server, client, _ = pair(apps)
    if polled:
        assert "fd" in client.call("fileno")
    assert client.call("bg_recv") == {"ok": True}
    assert client.call("shutdown", how=how) == {"ok": True}
    assert client.call("bg_result", timeout=3) == {"alive": False, "ok": True, "n": 0}
    if how == "SHUT_RD":
        assert server.call("sendbytes", data="after") == {"ok": True}
        assert client.call("recv", n=5) == {"data": "after"}


def test_close_with_unread_data_resets_the_peer(smcd: Smcd, apps: Any) -> None:
    server, client, _ = pair(apps)
    assert server.call("sendbytes", data="unread " * 100) == {"ok": True}
    assert client.call("close") == {"ok": True}  # data still unread: an abort
    got = server.call("recv_all")
    assert got.get("error") == "ConnectionResetError", got
    sent = server.call("sendbytes", data="more")
    assert sent.get("error") in ("ConnectionResetError", "BrokenPipeError"), sent


@pytest.mark.parametrize("unread", [False, True], ids=["all-read", "unread"])
@pytest.mark.parametrize("victim", ["client", "server"])
def test_sigkill_is_seen_within_a_second(smcd: Smcd, apps: Any, victim: str, unread: bool) -> None:
    """EOF after the killed end's data when it had read everything; a reset when it had not."""
    server, client, _ = pair(apps)
    ends = {"client": client, "server": server}
    killed, survivor = ends[victim], ends["server" if victim == "client" else "client"]
    if unread:
        assert survivor.call("sendbytes", data="never read") == {"ok": True}
    survivor.send("recv_all")
    sent = None if unread else killed.call("send", n=300_007, seed=3, chunk=4093)
    t_kill = time.monotonic()
    killed.kill()
    got = survivor.reply(timeout=5)
    assert time.monotonic() - t_kill < 1.0, got
    if sent is None:
        assert got.get("error") == "ConnectionResetError", got
    else:
        assert got.get("eof") and (got["n"], got["sha"]) == (sent["sent"], sent["sha"]), got
