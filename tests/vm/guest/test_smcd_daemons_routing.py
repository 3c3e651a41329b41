"""SMC-Rv2 routing declines and SMC-R fallbacks between two real ``smcd`` daemons over Soft-RoCE.

Host A's daemon serves the client applications, host B's the servers (both in this VM's one
network namespace, see ``tests/vm/README.md``). Each test changes the real routes, addresses or
the daemon configuration (SIGHUP), makes one connection through ``smc_handoff`` and checks that
it stayed on TCP (bytes still flow) for the kernel's reason, seen at *both* ends:

* each application's ``sock.fallback`` (code, name, explanation; the peer's diagnosis when the
  peer declined),
* each daemon's ``smcctl conns`` (the connection's ``TCP 0xREASON/0xPEERDIAG (NAME)``) and
  ``smcctl stats`` (the fallback counted under its reason and role),
* the declining daemon's log, which carries the operator's explanation.

The two routing cases of the SMC-Rv2 discussion (PROTOCOL.md §5):

* the RoCE netdev's address is a /32 that does not contain the connection's address (a VIPA-like
  address on a dummy netdev, routed out through the RoCE netdev): ``smc_ib_determine_gid``'s
  subnet rule finds no GID - on the client (no SMC-Rv2 to propose: NOSMCDEV before the
  Proposal) and on the server (NOSMCRDEV);
* asymmetric routes: the server reaches the client through a gateway (``v2_direct`` = 0 in the
  Accept) while the client's route back is direct: the client declines NOINDIRECT; and when the
  client has no route at all to the server's RoCEv2 GID address, NOROUTE.

SMC-R fallbacks: a peer outside the client's ``peers`` (PEERNOSMC before a CLC byte, at both
ends), a server daemon with SMC-R switched off (NOSMCRDEV), a UEID mismatch (NOSMCDEV). And with
nothing changed, the same daemons do move data on SMC-R between the same addresses (so the
declines came from the changes, not from a broken setup; it runs between the others, which
therefore also shows that their teardown restored everything).

Every route, address and neighbour a test adds is removed in its teardown, and configurations
are restored: other guest tests run after these in the same VM.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.vm.guest import daemons as dm
from tests.vm.guest.daemons import Daemon
from tests.vm.topology import POLICY_TABLE

UEID = "SMCD-VM-ROUTING"
PEERS_A = ("192.0.2.0/24", "203.0.113.0/24")  # not wire 1's 198.51.100.0/24: PEERNOSMC
PEERS_B = ("192.0.2.0/24", "198.51.100.0/24", "203.0.113.0/24")
CFG_A = dm.config_text(peers=PEERS_A, ueids=[UEID])
CFG_B = dm.config_text(peers=PEERS_B, ueids=[UEID])

DUMMY = "smcrt0"  # holds the VIPA-like 203.0.113.x addresses
VIPA_A = "203.0.113.1"
VIPA_B = "203.0.113.2"
GATEWAY = "203.0.113.254"  # a made-up router whose MAC is host A's: frames still arrive

PEERDECL = 0x05000000
PEERNOSMC = 0x03010000
NOSMCDEV = 0x03030000
NOSMCRDEV = 0x03030002
NOROUTE = 0x030E0000
NOINDIRECT = 0x030F0000

APP = r"""
# One application process per host, kept for the whole module (a Python start-up costs seconds
# under TCG): it reads one JSON command a line and answers each with one JSON line.
import json, sys, traceback
import smc_handoff

def report(sock, **more):
    fb = sock.fallback
    return dict(more, mode=sock.mode, local=list(sock.getsockname()[:2]),
                peer=list(sock.getpeername()[:2]),
                fallback=None if fb is None else {"code": fb.code, "name": fb.name,
                    "explanation": fb.explanation, "peer_diagnosis": fb.peer_diagnosis})

def exactly(sock, n):
    got = b""
    while len(got) < n:
        b = sock.recv(n - len(got))
        if not b:
            break
        got += b
    return got

def serve(cmd):
    srv = smc_handoff.listen((cmd["host"], cmd["port"]))
    srv.settimeout(120)
    try:
        print(json.dumps({"registered": srv.registered}), flush=True)
        conn, _ = srv.accept()
        conn.settimeout(120)
        msg = exactly(conn, 16)
        conn.sendall(msg.upper())
        out = report(conn, got=msg.decode())
        conn.close()
    finally:
        srv.close()
    return out

def connect(cmd):
    s = smc_handoff.connect((cmd["host"], cmd["port"]), 60, source_address=(cmd["src"], 0))
    s.sendall(b"ping-from-client")
    out = report(s, echo=exactly(s, 16).decode())
    s.close()
    return out

print(json.dumps({"ready": True}), flush=True)
for raw in sys.stdin:
    cmd = json.loads(raw)
    try:
        out = {"serve": serve, "connect": connect}[cmd["op"]](cmd)
    except Exception:
        out = {"error": traceback.format_exc()}
    print(json.dumps(out), flush=True)
"""


@dataclass
class Hosts:
    """The two daemons and the application process of each host (A: clients, B: servers)."""

    a: Daemon
    b: Daemon
    client: subprocess.Popen[str]
    server: subprocess.Popen[str]

    @property
    def daemons(self) -> tuple[Daemon, Daemon]:
        return self.a, self.b

    def ask(self, app: subprocess.Popen[str], **cmd: Any) -> None:
        assert app.stdin is not None
        app.stdin.write(json.dumps(cmd) + "\n")
        app.stdin.flush()

    def answer(self, app: subprocess.Popen[str], what: str) -> dict[str, Any]:
        other = self.server if app is self.client else self.client
        got = json.loads(dm.line(app, what, self.daemons, (other,)))
        if "error" in got:
            tails = "\n".join(d.tail(3000) for d in self.daemons)
            pytest.fail(f"{what} failed:\n{got['error']}\n{tails}")
        return dict(got)


# ------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def hosts(out_dir: Path) -> Iterator[Hosts]:
    """Host A's and host B's daemons and applications, shared by the tests of this module (a
    daemon start costs tens of seconds under TCG); tests that change something restore it."""
    base = out_dir / "scratch" / "smcd_daemons_routing"
    a = dm.start(base, "a", CFG_A)
    b = dm.start(base, "b", CFG_B)
    apps: list[subprocess.Popen[str]] = []
    try:
        apps = [dm.app(APP, a), dm.app(APP, b)]  # start while the daemons do
        dm.wait_ready(a)
        dm.wait_ready(b)
        h = Hosts(a, b, *apps)
        for app, what in ((h.client, "host A's app"), (h.server, "host B's app")):
            assert json.loads(dm.line(app, what, h.daemons)) == {"ready": True}
        yield h
    finally:
        for app in apps:
            assert app.stdin is not None
            with contextlib.suppress(OSError):
                app.stdin.close()  # EOF: the app ends
        for app in apps:
            dm.finish(app)
        dm.stop((a, b))


@contextlib.contextmanager
def network(setup: Sequence[str], teardown: Sequence[str]) -> Iterator[None]:
    """Apply ``ip`` batch lines; undo them (as far as possible) afterwards."""
    try:
        dm.ip_batch(setup)
        yield
    finally:
        dm.ip_batch(teardown, force=True)


@contextlib.contextmanager
def reconfigured(d: Daemon, config: str, restore: str) -> Iterator[None]:
    d.reload(config)
    try:
        yield
    finally:
        d.reload(restore)


def _dummy(*addresses: str) -> tuple[list[str], list[str]]:
    setup = [f"link add {DUMMY} type dummy", f"link set dev {DUMMY} up"]
    setup += [f"addr add {a}/32 dev {DUMMY}" for a in addresses]
    return setup, [f"link del {DUMMY}"]


def _load_dummy() -> None:
    r = subprocess.run(["modprobe", "dummy", "numdummies=0"], capture_output=True, text=True)
    assert r.returncode == 0, f"modprobe dummy: {r.stderr}"


# ------------------------------------------------------------------------------------ one run
def _stats(d: Daemon) -> tuple[str, dict[tuple[int, str], int]]:
    """``smcctl stats``: its text and the fallback table's counts by (reason, role)."""
    text = d.ctl("stats")
    counts: dict[tuple[int, str], int] = {}
    for ln in text.splitlines():
        cells = ln.split()
        if len(cells) == 4 and cells[0].startswith("0x"):
            counts[(int(cells[0], 16), "server")] = int(cells[2])
            counts[(int(cells[0], 16), "client")] = int(cells[3])
    return text, counts


def _connect(
    hosts: Hosts, *, listen: str, dst: str, src: str, port: int
) -> tuple[dict[str, Any], dict[str, Any]]:
    """One connection: B's app listens on ``listen``, A's app connects from ``src`` to
    ``dst``; both report mode, fallback and the 16 bytes they exchanged."""
    hosts.ask(hosts.server, op="serve", host=listen, port=port)
    reg = hosts.answer(hosts.server, "the server app's LISTEN")
    assert reg == {"registered": True}, f"the server app's LISTEN: {reg}"
    hosts.ask(hosts.client, op="connect", host=dst, port=port, src=src)
    c = hosts.answer(hosts.client, "the client app")
    s = hosts.answer(hosts.server, "the server app")
    # TCP (or SMC) carried the bytes both ways
    assert c["echo"] == "PING-FROM-CLIENT" and s["got"] == "ping-from-client", (c, s)
    assert c["local"][0] == src and s["local"][0] == listen, (c, s)
    return c, s


def _check_end(
    d: Daemon,
    app_out: dict[str, Any],
    stats_before: dict[tuple[int, str], int],
    *,
    role: str,
    code: int,
    name: str,
    peer_diagnosis: int | None,
    words: Sequence[str] = (),
) -> None:
    """One end of a fallen-back connection: the app's ``sock.fallback``, the connection's row
    in the daemon's ``smcctl conns`` and the fallback's count in ``smcctl stats``, and - for
    the end that decided - the explanation (``words``) in the app's fallback and in the
    daemon's log."""
    assert app_out["mode"] == "tcp", f"{role} app on smcd {d.name}: {app_out}"
    fb = app_out["fallback"]
    assert fb is not None, f"{role} app has no fallback: {app_out}"
    assert (fb["code"], fb["name"], fb["peer_diagnosis"]) == (code, name, peer_diagnosis), (
        f"{role} app on smcd {d.name}: {fb}\n{d.tail()}"
    )
    for w in words:
        assert w in fb["explanation"], f"{w!r} not in the {role}'s explanation: {fb}"
    # smcss-like row: local and peer address, mode "TCP 0xREASON/0xPEERDIAG (NAME)"
    local = "{}:{}".format(*app_out["local"])
    peer = "{}:{}".format(*app_out["peer"])
    want = f"TCP 0x{code:08x}/0x{peer_diagnosis or 0:08x} ({name})"
    deadline = time.monotonic() + 30  # fallbacks are published a moment after the reply
    table = ""
    while time.monotonic() < deadline:
        table = d.ctl("conns")
        rows = [ln for ln in table.splitlines() if f" {local} " in ln and f" {peer} " in ln]
        if rows:
            assert len(rows) == 1 and rows[0].endswith(want), (
                f"smcctl conns on smcd {d.name}: want {want!r}:\n{table}"
            )
            break
        time.sleep(0.5)
    else:
        pytest.fail(f"smcctl conns on smcd {d.name} never showed {local} -> {peer}:\n{table}")
    text, after = _stats(d)  # counted when the connection was published, i.e. by now
    key = (code, role)
    assert after.get(key, 0) == stats_before.get(key, 0) + 1, (
        f"smcctl stats on smcd {d.name}: {name} as {role} was {stats_before.get(key, 0)}:\n{text}"
    )
    assert any(ln.split()[:2] == [f"0x{code:08x}", name] for ln in text.splitlines()), text
    if words:
        logged = [ln for ln in d.log_text().splitlines() if "stays on TCP" in ln]
        assert any(all(w in ln for w in words) for ln in logged), (
            f"smcd {d.name} logged no fallback with {words}:\n" + "\n".join(logged[-5:])
        )


def _run_declined(
    hosts: Hosts,
    *,
    listen: str,
    dst: str,
    src: str,
    port: int,
    decider: str,
    code: int,
    name: str,
    words: Sequence[str],
) -> None:
    """A connection that one side (``decider``: "client" or "server") declines with ``code``:
    that side falls back with it and explains it, the other sees PEERDECL with ``code`` as the
    peer's diagnosis."""
    a, b = hosts.daemons
    before = {d.name: _stats(d)[1] for d in hosts.daemons}
    c, s = _connect(hosts, listen=listen, dst=dst, src=src, port=port)
    ends = ((a, c, "client"), (b, s, "server"))
    for d, out, role in ends:
        if role == decider:
            _check_end(d, out, before[d.name], role=role, code=code, name=name,
                       peer_diagnosis=None, words=words)  # fmt: skip
        else:
            short = name.removeprefix("SMC_CLC_DECL_")
            _check_end(d, out, before[d.name], role=role, code=PEERDECL,
                       name="SMC_CLC_DECL_PEERDECL", peer_diagnosis=code,
                       words=(f"the peer declined with {short} (0x{code:08x})",))  # fmt: skip


# ------------------------------------------------------------------------------------ routing
@pytest.mark.timeout(240)
def test_client_source_outside_roce_netdev_subnet(hosts: Hosts) -> None:
    """The client's source is a /32 on a dummy netdev, routed out of smca0 (192.0.2.1/32):
    rxe_a0's GID does not fit (``inet_ifa_match``), so there is no SMC-Rv2 to propose and the
    client declines NOSMCDEV before any Proposal; the server sees the peer's Decline."""
    _load_dummy()
    setup, teardown = _dummy(VIPA_A)
    # B's answers to the VIPA cross the wire too (else B would take it for a loopback peer)
    setup.append(f"route add {VIPA_A}/32 dev smcb0 src 192.0.2.2 table {POLICY_TABLE}")
    teardown.insert(0, f"route del {VIPA_A}/32 table {POLICY_TABLE}")
    with network(setup, teardown):
        _run_declined(
            hosts, listen="192.0.2.2", dst="192.0.2.2", src=VIPA_A, port=47321,
            decider="client", code=NOSMCDEV, name="SMC_CLC_DECL_NOSMCDEV",
            words=(f"interface smca0 (192.0.2.1/32) does not contain the connection's source "
                   f"{VIPA_A}; SMC-Rv2 needs the RoCE netdev's subnet to contain it",),
        )  # fmt: skip


@pytest.mark.timeout(240)
def test_server_address_outside_roce_netdev_subnet(hosts: Hosts) -> None:
    """The server listens on a /32 of a dummy netdev that the client reaches over wire 0: the
    client proposes SMC-Rv2 from 192.0.2.1, but smcb0 (192.0.2.2/32) does not contain the
    server's address, so rxe_b0 does not fit and the server declines NOSMCRDEV."""
    _load_dummy()
    setup, teardown = _dummy(VIPA_B)
    setup.append(f"route add {VIPA_B}/32 dev smca0 src 192.0.2.1 table {POLICY_TABLE}")
    teardown.insert(0, f"route del {VIPA_B}/32 table {POLICY_TABLE}")
    with network(setup, teardown):
        _run_declined(
            hosts, listen=VIPA_B, dst=VIPA_B, src="192.0.2.1", port=47322,
            decider="server", code=NOSMCRDEV, name="SMC_CLC_DECL_NOSMCRDEV",
            words=(f"interface smcb0 (192.0.2.2/32) does not contain the connection's source "
                   f"{VIPA_B}; SMC-Rv2 needs the RoCE netdev's subnet to contain it",),
        )  # fmt: skip


@pytest.mark.timeout(240)
def test_asymmetric_routes_decline_noindirect(hosts: Hosts) -> None:
    """B reaches A through a gateway (whose MAC is smca0's, so TCP still works), A reaches B
    directly: B's Accept says ``v2_direct`` = 0, A's own route says direct, A declines
    NOINDIRECT (``smc_connect_rdma_v2_prepare``)."""
    mac_a = dm.mac_of("smca0")
    setup = [
        f"neigh replace {GATEWAY} lladdr {mac_a} dev smcb0 nud permanent",
        f"route replace 192.0.2.1/32 via {GATEWAY} dev smcb0 onlink src 192.0.2.2 "
        f"table {POLICY_TABLE}",
    ]
    teardown = [
        f"route replace 192.0.2.1/32 dev smcb0 src 192.0.2.2 table {POLICY_TABLE}",
        f"neigh del {GATEWAY} dev smcb0",
    ]
    with network(setup, teardown):
        _run_declined(
            hosts, listen="192.0.2.2", dst="192.0.2.2", src="192.0.2.1", port=47323,
            decider="client", code=NOINDIRECT, name="SMC_CLC_DECL_NOINDIRECT",
            words=("the server says its path to us uses a gateway",
                   "our route from 192.0.2.1 to 192.0.2.2 is direct"),
        )  # fmt: skip


@pytest.mark.timeout(240)
def test_no_route_to_server_gid_declines_noroute(hosts: Hosts) -> None:
    """The server listens on 203.0.113.2/24, a second address of smcb0 (so rxe_b0 fits and
    its first IPv4 GID, 192.0.2.2's, goes in the Accept) and reaches the client through a
    gateway (``v2_direct`` = 0); the client has no route to 192.0.2.2 (unreachable in table
    100) while its TCP connection to 203.0.113.2 is fine: the client declines NOROUTE."""
    mac_a = dm.mac_of("smca0")
    t = POLICY_TABLE
    setup = [
        f"addr add {VIPA_B}/24 dev smcb0",
        f"route add {VIPA_B}/32 dev smca0 src 192.0.2.1 table {t}",
        f"neigh replace {GATEWAY} lladdr {mac_a} dev smcb0 nud permanent",
        f"route replace 192.0.2.1/32 via {GATEWAY} dev smcb0 onlink src 192.0.2.2 table {t}",
        f"route replace unreachable 192.0.2.2/32 table {t}",
    ]
    teardown = [
        f"route replace 192.0.2.2/32 dev smca0 src 192.0.2.1 table {t}",
        f"route replace 192.0.2.1/32 dev smcb0 src 192.0.2.2 table {t}",
        f"neigh del {GATEWAY} dev smcb0",
        f"route del {VIPA_B}/32 table {t}",
        f"addr del {VIPA_B}/24 dev smcb0",
    ]
    with network(setup, teardown):
        _run_declined(
            hosts, listen=VIPA_B, dst=VIPA_B, src="192.0.2.1", port=47328,
            decider="client", code=NOROUTE, name="SMC_CLC_DECL_NOROUTE",
            words=("the server says its path to us uses a gateway, but there is no route "
                   "from 192.0.2.1 to 192.0.2.2",),
        )  # fmt: skip


# ------------------------------------------------------------------------------------ fallbacks
@pytest.mark.timeout(240)
def test_peer_outside_peers_falls_back_peernosmc(hosts: Hosts) -> None:
    """198.51.100.2 is not in A's ``peers`` and has no listener registered with A: A's client
    stays on TCP without sending a CLC byte; B sees the application's bytes, not a Proposal."""
    a, b = hosts.daemons
    before = {d.name: _stats(d)[1] for d in hosts.daemons}
    c, s = _connect(hosts, listen="198.51.100.2", dst="198.51.100.2", src="198.51.100.1",
                    port=47324)  # fmt: skip
    _check_end(a, c, before["a"], role="client", code=PEERNOSMC,
               name="SMC_CLC_DECL_PEERNOSMC", peer_diagnosis=None,
               words=("not known to speak SMC",))  # fmt: skip
    _check_end(b, s, before["b"], role="server", code=PEERNOSMC,
               name="SMC_CLC_DECL_PEERNOSMC", peer_diagnosis=None,
               words=("not a CLC Proposal",))  # fmt: skip


@pytest.mark.timeout(240)
def test_server_without_smcr_declines_nosmcrdev(hosts: Hosts) -> None:
    """B runs with ``modes.smcr_v1``/``smcr_v2`` off (applied by SIGHUP): A proposes SMC-Rv2
    only, B has no RoCE device for it and declines NOSMCRDEV."""
    b = hosts.b
    off = dm.config_text(peers=PEERS_B, ueids=[UEID], smcr=False)
    with reconfigured(b, off, CFG_B):
        _run_declined(
            hosts, listen="192.0.2.2", dst="192.0.2.2", src="192.0.2.1", port=47325,
            decider="server", code=NOSMCRDEV, name="SMC_CLC_DECL_NOSMCRDEV",
            words=("SMC-R is switched off here (modes.smcr_v1 and modes.smcr_v2 are false), "
                   "so SMC-R was not tried",),
        )  # fmt: skip


@pytest.mark.timeout(240)
def test_ueid_mismatch_declines_nosmcdev(hosts: Hosts) -> None:
    """B's only UEID differs from A's: SMC-Rv2 is not chosen (the kernel stores no code for
    the mismatch), A offered no SMC-Rv1, so B declines NOSMCDEV and says why."""
    b = hosts.b
    other = dm.config_text(peers=PEERS_B, ueids=["SMCD-VM-OTHER"])
    with reconfigured(b, other, CFG_B):
        _run_declined(
            hosts, listen="192.0.2.2", dst="192.0.2.2", src="192.0.2.1", port=47326,
            decider="server", code=NOSMCDEV, name="SMC_CLC_DECL_NOSMCDEV",
            words=("the peer's UEIDs and ours have none in common",),
        )  # fmt: skip


@pytest.mark.timeout(280)
def test_restored_setup_uses_smcr(hosts: Hosts) -> None:
    """Without changes, the same daemons and addresses do SMC-R: the declines came from the
    changes made for them (and, run after some of them, their teardown restored everything)."""
    c, s = _connect(hosts, listen="192.0.2.2", dst="192.0.2.2", src="192.0.2.1", port=47327)
    assert (c["mode"], s["mode"]) == ("smcr", "smcr"), f"{c}\n{s}\n" + "\n".join(
        d.tail(3000) for d in hosts.daemons
    )
    assert c["fallback"] is None and s["fallback"] is None
