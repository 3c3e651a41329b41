"""Two applications hand their TCP connection to the real smcd: the SMC-D handshake, the data
channel, every fallback path with its reason at both ends and in ``smcctl``, and what
``smcctl linkgroup show``/``conns`` show of a live connection."""

from __future__ import annotations

import socket
import time
from typing import Any

import pytest

from smc_handoff.messages import FALLBACK_DAEMON_UNAVAILABLE
from smcd_daemon.wire.reasons import DeclineReason
from tests.e2e.conftest import LOCAL_CLIENT_WAIT, PROPOSAL_WAIT, Smcd, pair

pytestmark = pytest.mark.timeout(120)

PEERNOSMC = int(DeclineReason.PEERNOSMC)
PEERDECL = int(DeclineReason.PEERDECL)
MAX_DMB = int(DeclineReason.MAX_DMB)


def _fallbacks(smcd: Smcd) -> dict[int, dict[str, Any]]:
    stats = smcd.smcctl_json("stats")
    return {int(f["reason"]): f for f in stats["fallbacks"]} if "fallbacks" in stats else {}


def test_handshake_and_data_both_ways(smcd: Smcd, apps: Any) -> None:
    server, client, _ = pair(apps)
    # Odd-sized writes crossing the ring wrap many times (64 KiB DMBs), both directions at once.
    client.send("send", n=5_000_011, seed=7, chunk=7919)
    server.send("recv_all")
    sent = client.reply()
    assert client.call("shutdown") == {"ok": True}
    got = server.reply()
    assert got == {"n": sent["sent"], "sha": sent["sha"], "eof": True, "elapsed": got["elapsed"]}
    server.send("send", n=1_000_003, seed=8, chunk=65521)
    client.send("recv_all")
    back = server.reply()
    assert server.call("close") == {"ok": True}
    got = client.reply()
    assert (got["n"], got["sha"]) == (back["sent"], back["sha"])
    assert client.call("close") == {"ok": True}


def test_linkgroup_and_conns_show_the_connection(smcd: Smcd, apps: Any) -> None:
    server, client, port = pair(apps)
    server.send("recv", n=300_001)
    assert client.call("send", n=300_001, seed=3, chunk=4099)["sent"] == 300_001
    assert len(server.reply()["data"]) == 300_001

    def both_counted(rows: list[dict[str, Any]]) -> bool:
        ours = [r for r in rows if port in (r["LocalPort"], r["PeerPort"]) and r["Mode"] == "SMCD"]
        return len(ours) == 2 and all(r["BytesSent"] + r["BytesReceived"] >= 300_001 for r in ours)

    rows = smcd.wait_conns(both_counted)
    ours = {r["Role"]: r for r in rows if port in (r["LocalPort"], r["PeerPort"])}
    cl, sv = ours["CLIENT"], ours["SERVER"]
    assert cl["BytesSent"] == 300_001 and sv["BytesReceived"] == 300_001
    assert (cl["PeerPort"], sv["LocalPort"]) == (port, port)
    assert cl["State"] == sv["State"] == "ACTIVE"
    assert cl["RmbeSize"] == sv["PeerRmbeSize"] and sv["RmbeSize"] == cl["PeerRmbeSize"]
    ring = sv["RmbeSize"] - 32
    wraps, count = divmod(300_001, ring)
    assert tuple(cl["TxProducer"]) == (wraps, count) == tuple(sv["RxConsumer"])
    assert tuple(sv["RxProducer"]) == (wraps, count)
    assert cl["LinkGroup"] == sv["LinkGroup"] != "/"
    groups = smcd.smcctl_json("linkgroup", "show")
    (lg,) = [g for g in groups if g["Path"] == cl["LinkGroup"]]
    assert lg["Type"] == "SMC-D" and lg["Chid"] == 0xFFFF and lg["Connections"] >= 2
    assert lg["PeerGid"] == lg["LocalGid"] and len(lg["PeerGid"]) == 32  # loopback-ism: itself
    # both ends offer the host-local SEID and the UEID: smc_clc_match_eid takes the SEID first
    assert lg["SmcVersion"] == 2 and lg["NegotiatedEid"].startswith("SMCD-LOCAL-")
    table = smcd.smcctl("linkgroup", "show")
    assert f"{lg['Id']:08x}" in table.stdout and "SMC-D" in table.stdout
    debug = smcd.smcctl("conns", "-d")
    line = next(ln for ln in debug.stdout.splitlines() if f"127.0.0.1:{port}" in ln)
    assert "SMCD" in line and f"{wraps}:{count}" in line
    stats = smcd.smcctl_json("stats")
    assert stats["counters"]["smcd.client.v2"] >= 1 and stats["counters"]["smcd.server.v2"] >= 1
    server.call("close")
    client.call("close")
    smcd.wait_conns(
        lambda rows: (
            not any(
                port in (r["LocalPort"], r["PeerPort"])
                for r in rows
                if r["Mode"] == "SMCD" and r["State"] != "LISTEN"
            )
        )
    )


def test_fallback_no_daemon(smcd: Smcd, apps: Any, tmp_path: Any) -> None:
    nowhere = tmp_path / "no-daemon.sock"
    server, client = apps("server", handoff=nowhere), apps("client", handoff=nowhere)
    listening = server.call("listen")
    assert not listening["registered"] and listening["fallback"] == FALLBACK_DAEMON_UNAVAILABLE
    server.send("accept")
    c = client.call("connect", port=listening["port"])
    s = server.reply()
    for end in (c, s):
        assert end["mode"] == "tcp", end
        assert end["fallback"]["code"] == FALLBACK_DAEMON_UNAVAILABLE
        assert "daemon unavailable" in end["fallback"]["explanation"]
    client.call("sendbytes", data="over plain TCP")
    assert server.call("recv", n=14)["data"] == "over plain TCP"


def test_fallback_peer_not_smc(smcd: Smcd, apps: Any) -> None:
    """A client toward a plain TCP server (no registered listener): PEERNOSMC before a byte."""
    plain = socket.create_server(("127.0.0.1", 0))
    port = plain.getsockname()[1]
    client = apps("client")
    before = _fallbacks(smcd).get(PEERNOSMC, {"client": 0})["client"]
    c = client.call("connect", port=port)
    conn, _ = plain.accept()
    with conn:
        assert c["mode"] == "tcp" and c["fallback"]["code"] == PEERNOSMC, c
        assert c["fallback"]["name"] == "SMC_CLC_DECL_PEERNOSMC"
        conn.settimeout(0.5)
        with pytest.raises(TimeoutError):
            conn.recv(1)  # not a byte was written toward the plain server
        client.call("sendbytes", data="hello")
        assert conn.recv(5) == b"hello"
    plain.close()
    rows = smcd.wait_conns(lambda rs: any(r["PeerPort"] == port for r in rs))
    (row,) = [r for r in rows if r["PeerPort"] == port]
    assert row["Mode"] == "TCP" and row["FallbackReason"] == PEERNOSMC
    assert row["FallbackName"] == "SMC_CLC_DECL_PEERNOSMC" and row["Role"] == "CLIENT"
    table = smcd.smcctl("conns").stdout
    assert "TCP 0x03010000/0x00000000" in table
    assert _fallbacks(smcd)[PEERNOSMC]["client"] == before + 1


@pytest.mark.parametrize("speaks_first", [True, False], ids=["client-speaks", "client-waits"])
def test_fallback_plain_client_to_smc_server(smcd: Smcd, apps: Any, speaks_first: bool) -> None:
    server = apps("server")
    listening = server.call("listen")
    assert listening["registered"]
    server.send("accept")
    plain = socket.create_connection(("127.0.0.1", listening["port"]))
    with plain:
        if speaks_first:
            plain.sendall(b"GET / HTTP/1.0\r\n\r\n")
        s = server.reply()
        assert s["mode"] == "tcp" and s["fallback"]["code"] == PEERNOSMC, s
        if speaks_first:
            assert s["elapsed"] < PROPOSAL_WAIT + 0.5
            # handed back untouched: the application reads the client's bytes itself
            assert server.call("recv", n=18)["data"] == "GET / HTTP/1.0\r\n\r\n"
        else:  # a client on this host whose socket carries no handoff mark: told at once
            assert s["elapsed"] < LOCAL_CLIENT_WAIT + 1.0
            assert "carries no handoff mark" in s["fallback"]["explanation"], s
        server.call("sendbytes", data="220 welcome\r\n")
        plain.settimeout(5)
        assert plain.recv(100) == b"220 welcome\r\n"
    port = listening["port"]
    rows = smcd.wait_conns(
        lambda rs: any(r["LocalPort"] == port and r["Mode"] == "TCP" for r in rs)
    )
    assert any(
        r["Role"] == "SERVER" and r["FallbackReason"] == PEERNOSMC
        for r in rows
        if r["LocalPort"] == port
    )


def test_quota_sees_a_closed_connection_released_at_once(
    smcd: Smcd, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The daemon defers a hung-up half's bookkeeping (DMB release included) off the handshake
    path; a handshake that needs those DMBs still gets them: with a quota of one connection,
    closing it and connecting again at once (microseconds later, one process) is SMC-D every
    time."""
    import threading

    import smc_handoff

    smcd.reload("[quota]\nconnections = 2\n")
    monkeypatch.setenv("SMCD_HANDOFF_SOCKET", str(smcd.handoff))
    lst = smc_handoff.listen(("127.0.0.1", 0))
    try:
        assert lst.registered, lst.fallback
        port = lst.getsockname()[1]
        for i in range(20):
            accepted: list[Any] = []
            t = threading.Thread(target=lambda got=accepted: got.append(lst.accept()[0]))
            t.start()
            c = smc_handoff.connect(("127.0.0.1", port), timeout=10)
            t.join(10)
            s = accepted[0]
            assert (c.mode, s.mode) == ("smcd", "smcd"), (i, c.fallback, s.fallback)
            c.sendall(b"x")
            assert s.recv(1) == b"x"
            c.close()
            s.close()
    finally:
        lst.close()
        smcd.reload()


def test_fallback_quota_exceeded(smcd: Smcd, apps: Any) -> None:
    """Past the per-user quota (two DMBs: one connection) the next handshake falls back with
    MAX_DMB at the server and PEERDECL (peer diagnosis MAX_DMB) at the client."""
    smcd.reload("[quota]\nconnections = 2\n")
    try:
        server, client, port = pair(apps)  # uses the two DMBs
        client2 = apps("client2")
        server.send("accept")
        c = client2.call("connect", port=port)
        s = server.reply()
        assert s["mode"] == "tcp" and s["fallback"]["code"] == MAX_DMB, s
        assert s["fallback"]["name"] == "SMC_CLC_DECL_MAX_DMB"
        assert c["mode"] == "tcp" and c["fallback"]["code"] == PEERDECL, c
        assert c["fallback"]["peer_diagnosis"] == MAX_DMB
        client2.call("sendbytes", data="still TCP")
        assert server.call("recv", n=9)["data"] == "still TCP"
        rows = smcd.wait_conns(
            lambda rs: sum(r["FallbackReason"] in (MAX_DMB, PEERDECL) for r in rs) >= 2
        )
        diag = {(r["Role"], r["FallbackReason"], r["PeerDiagnosis"]) for r in rows}
        assert ("SERVER", MAX_DMB, 0) in diag and ("CLIENT", PEERDECL, MAX_DMB) in diag
        assert "TCP 0x05000000/0x030d0000" in smcd.smcctl("conns").stdout
        fb = _fallbacks(smcd)
        assert fb[MAX_DMB]["server"] >= 1 and fb[PEERDECL]["client"] >= 1
        # The first connection is unaffected; once it is gone, SMC works again.
        server.call("close")
        client.call("close")
        time.sleep(0.2)
        server3, client3, _ = pair(apps)
        server3.call("close")
        client3.call("close")
    finally:
        smcd.reload()


def test_server_handing_over_after_the_clients_clc_timer_leaves_both_streams_clean(
    smcd: Smcd, apps: Any
) -> None:
    """The server application hands its accepted socket to smcd only after the client half's
    CLC timer fired. A same-host client half proposes only once its server half is in the
    daemon (#14), so it fell back without writing a byte (PEERNOSMC, naming the wait) and went
    on over TCP; the server half then finds the client's data, not a Proposal, and hands the
    socket back: neither application ever reads a CLC byte as data, and both see the fallback."""
    smcd.reload("clc_wait = 0.5\n")  # inside [timeouts]: the client gives up quickly
    try:
        server, client = apps("server"), apps("client")
        listening = server.call("listen")
        assert listening["registered"], listening
        c = client.call("connect", port=listening["port"])  # nobody hands the server half over
        assert c["mode"] == "tcp", c
        assert c["fallback"]["code"] == PEERNOSMC, c
        assert "did not hand its connection to smcd within 0.5 s" in c["fallback"]["explanation"]
        client.call("sendbytes", data="request")  # the client application goes on over TCP
        s = server.call("accept")  # the server application, late: the TCP connection waited
        assert s["mode"] == "tcp", s
        assert s["fallback"]["code"] == PEERNOSMC, s  # the client's data, not a Proposal
        assert server.call("recv", n=7)["data"] == "request"  # no CLC bytes before the data
        server.call("sendbytes", data="reply")
        assert client.call("recv", n=5)["data"] == "reply"  # none toward the client either
    finally:
        smcd.reload()
