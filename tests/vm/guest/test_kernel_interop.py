"""smcd and the Linux kernel's own SMC-R speak to each other (inside the Soft-RoCE VM).

Host A (192.0.2.1, smca0/rxe_a0) runs smcd with ``peer_detection = true`` and no ``peers``: its
applications use ``smc_handoff``. Host B (192.0.2.2, smcb0/rxe_b0) is the kernel: AF_SMC
sockets, a pnet entry smcb0 -> rxe_b0 and a UEID both sides share. The kernel tries SMC only
when the SYN (server) / SYN-ACK (client) carries the RFC 7609 option, so smcd's BPF detector
must work on this kernel for any of this to run on SMC-R.

Both directions, each checked on both sides (``smc_diag`` for the kernel, ``sock.mode`` and
``smcctl conns`` for ours): a 64 MiB checksummed transfer each way at once (crossing the rings'
wrap many times) that ends with shutdown(SHUT_WR) -> EOF each way; close of either side first;
kill -9 of one application seen on the other as the kernel's close of a dying process (EOF, or
ECONNRESET when it left data unread); 50 connections on one link group
with the QP numbers agreeing (``rdma res show qp`` for the kernel's QP); a decline (no UEID in
common) with the kernel's reason code and the data intact on TCP; the LLC the kernel initiates:
CONFIRM/DELETE RKEY, TEST LINK, DELETE LINK ALL (``rmmod smc`` terminates its link groups) and
ADD LINK for a second device (rxe_b1), ending in a symmetric link group that survives smcb0
going down.

Kernel applications are Python processes using AF_SMC (:mod:`tests.vm.guest.kernel_smc`); every
wait has a deadline. The kernel version is printed and written to ``scratch/kernel.txt``.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn

import pytest

from smcd_daemon.wire import llc
from tests.vm.guest import daemons as dm
from tests.vm.guest import kernel_smc as ks
from tests.vm.guest.daemons import PY, ROOT, Daemon
from tests.vm.topology import POLICY_TABLE, Port, ipv4_mapped_gid_text, ports_of

UEID = "SMCD-KERNEL-INTEROP"
OTHER_UEID = "SMCD-NOT-THE-KERNELS"
KERNEL = os.uname().release
BULK = int(os.environ.get("SMCD_GUEST_INTEROP_BULK", str(64 << 20)))
MANY = 50
WAIT = 120.0
FIRSTS = [("smcd", "s2k"), ("kernel", "s2k"), ("smcd", "k2s"), ("kernel", "k2s")]
VICTIMS = [("kernel", "s2k"), ("smcd", "k2s"), ("kernel", "k2s"), ("smcd", "s2k")]
_NEXT_PORT = [47400]


def fresh_port() -> int:
    """A port no earlier test of this module used (no TIME_WAIT, no lingering listener)."""
    _NEXT_PORT[0] += 1
    return _NEXT_PORT[0]


PEER = r"""
import hashlib, json, os, socket, struct, sys, threading, time
kind, action, role, port = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
args = sys.argv[5:]
SMCD_ADDR, KERNEL_ADDR = "192.0.2.1", "192.0.2.2"
if kind == "smcd":
    import smc_handoff
    def listen():
        return smc_handoff.listen((SMCD_ADDR, port), backlog=128)
    def dial():
        return smc_handoff.connect((KERNEL_ADDR, port), 60, source_address=(SMCD_ADDR, 0))
    def mode(s):
        return s.mode
    def why(s):
        return str(s.fallback) if s.fallback is not None else ""
else:
    from tests.vm.guest import kernel_smc as ks
    def listen():
        s = ks.smc_listen(KERNEL_ADDR, port, timeout=120)
        s.listen(128)
        return s
    def dial():
        rcvbuf = int(os.environ.get("KERNEL_RCVBUF", "0"))
        if not rcvbuf:
            return ks.smc_connect(SMCD_ADDR, port, timeout=60)
        import ctypes  # SO_RCVBUF before connect sizes the kernel's RMB (a new one)
        libc = ctypes.CDLL(None, use_errno=True)
        s = socket.socket(fileno=libc.socket(43, socket.SOCK_STREAM, 0))
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        raw = struct.pack("=H", socket.AF_INET) + struct.pack("!H", port)
        raw += socket.inet_aton(SMCD_ADDR) + bytes(8)
        if libc.connect(s.fileno(), ctypes.create_string_buffer(raw, 16), 16) != 0:
            raise OSError(ctypes.get_errno(), "connect AF_SMC")
        return s
    def mode(s):
        return "kernel"
    def why(s):
        return ""

def say(*a):
    print(*a, flush=True)

from tests.vm.guest.streams import exchange_all, recv_exact, recv_hash, send_odd, serve_many

def one():
    if role == "server":
        srv = listen()
        say("LISTENING")
        s, _ = srv.accept()
        s.settimeout(300)
        return srv, s
    s = dial()
    s.settimeout(300)
    return None, s

if action == "bulk":  # n_out each way at once, then SHUT_WR; both sides expect EOF
    n_out, n_in = int(args[0]), int(args[1])
    srv, s = one()
    say("CONNECTED", mode(s), s.getsockname()[1], s.getpeername()[1])
    data = os.urandom(n_out)
    res = {"mode": mode(s), "sent_sha": hashlib.sha256(data).hexdigest()}
    def sender():
        try:
            send_odd(s, data)
            s.shutdown(socket.SHUT_WR)
        except BaseException as e:
            res["send_error"] = repr(e)
    t = threading.Thread(target=sender)
    t0 = time.monotonic()
    t.start()
    res["recv_sha"], res["received"] = recv_hash(s, n_in)
    res["eof"] = s.recv(1) == b""
    t.join(300)
    res["seconds"] = round(time.monotonic() - t0, 2)
    say(json.dumps(res))
    sys.stdin.readline()
    s.close()
elif action == "close":  # scenario args[0]: "first" (send, close) | "last" (read to EOF, close)
    srv, s = one()
    say("CONNECTED", mode(s))
    if args[0] == "first":
        sys.stdin.readline()
        s.sendall(b"last words")
        s.close()
        say("CLOSED")
    elif args[0] == "last":
        got = b""
        while chunk := s.recv(100):
            got += chunk
        say("EOF", got.decode())
        s.close()
    elif args[0] == "hold":  # unread data waits; the test kills us
        say("HOLDING")
        sys.stdin.readline()
    elif args[0] in ("victim", "victim-unread"):  # blocked in recv when the peer dies
        if args[0] == "victim-unread":  # bytes the holder never reads: its death is an abort
            s.sendall(b"never read")
        s.settimeout(60)
        t0 = time.monotonic()
        try:
            got = s.recv(100)
            res = {"result": "eof" if not got else "data", "t": time.monotonic()}
        except OSError as e:
            res = {"result": type(e).__name__, "errno": e.errno, "t": time.monotonic()}
        if kind == "kernel":  # the kernel keeps a peer's abort in SO_ERROR
            res["so_error"] = s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        say(json.dumps(res))
elif action == "many":  # args[0] connections, each 70 KiB+ each way (crossing a 64 KiB ring)
    count = int(args[0])
    if role == "server":
        srv = listen()
        say("LISTENING")
        say(json.dumps(serve_many(srv, count, mode, timeout=240)))
    else:
        socks = [dial() for _ in range(count)]
        say("OPEN", json.dumps(sorted({mode(s) for s in socks})))
        sys.stdin.readline()
        say(json.dumps(exchange_all(socks, mode, timeout=240)))
        sys.stdin.readline()
        for s in socks:
            s.close()
elif action == "echoloop":  # the server echoes; the client sends args[0] bytes per stdin line
    srv, s = one()
    say("CONNECTED", mode(s))
    if role == "server":
        n = 0
        while b := s.recv(1 << 16):
            s.sendall(b)
            n += len(b)
        say(json.dumps({"echoed": n}))
        s.close()
    else:
        s.settimeout(60)
        while sys.stdin.readline().strip() == "round":
            data = os.urandom(int(args[0]))
            try:
                t = threading.Thread(target=s.sendall, args=(data,))
                t.start()
                got = recv_exact(s, len(data))
                t.join(60)
                say(json.dumps({"ok": got == data, "n": len(got)}))
            except BaseException as e:
                say(json.dumps({"ok": False, "error": repr(e)}))
        s.shutdown(socket.SHUT_WR)
        s.recv(1)
        s.close()
elif action == "echo":  # a few bytes each way, the mode and fallback reason
    srv, s = one()
    res = {"mode": mode(s), "fallback": why(s)}
    if role == "client":
        s.sendall(b"hello from the client")
        res["got"] = recv_exact(s, 21).decode()
    else:
        res["got"] = recv_exact(s, 21).decode()
        s.sendall(b"hello from the server")
    say(json.dumps(res))
    sys.stdin.readline()
    s.close()
"""


# ---------------------------------------------------------------------------- set-up


def _require_patched_rxe() -> None:
    taint = Path("/sys/module/rdma_rxe/taint")
    if not (taint.exists() and "O" in taint.read_text()):
        pytest.fail("the kernel's SMC-R needs the patched rdma_rxe (tests/vm/kmod.py): the stock "
                    "module is loaded", pytrace=False)  # fmt: skip


def config(ueid: str, *, max_links: int = 1) -> str:
    return (
        "peer_detection = true\n"
        f'[eid]\nueids = ["{ueid}"]\n'
        # no overload meter: under TCG the loop runs over 1 s late while 50 connections open
        # at once, and a DAEMON_BUSY refusal is not what these tests look at
        "[limits]\noverload_lag = 0\n"
        "[timeouts]\nclc_wait = 30.0\nproposal_wait = 10.0\nfirst_llc = 30.0\nlinger = 900.0\n"
        # our TEST LINK later than the kernel's (30 s): its probe is the one the LLC test sees
        "test_link = 120.0\n"
        f"[smcr]\nmax_links = {max_links}\n"
    )


@pytest.fixture(scope="module")
def smcd(out_dir: Path) -> Iterator[Daemon]:
    _require_patched_rxe()
    (out_dir / "scratch").mkdir(exist_ok=True)
    (out_dir / "scratch" / "kernel.txt").write_text(f"{KERNEL}\n")
    print(f"\nkernel interop against Linux {KERNEL}")
    b0 = ports_of("b")[0]
    ks.modprobe("smc", "smc_diag")
    ks.ueid_add(UEID)
    ks.pnet_add("INTEROPB0", b0.ifname, b0.rxe)
    d = dm.start(out_dir / "scratch" / "kernel_interop", "a", config(UEID))
    try:
        dm.wait_ready(d)
        yield d
    finally:
        dm.stop([d])
        for undo in (lambda: ks.pnet_del("INTEROPB0"), lambda: ks.ueid_del(UEID)):
            try:
                undo()
            except Exception as e:  # the next module must still get a clean table
                print(f"kernel interop teardown: {e}")


class Peers:
    """The two application processes of a test (one smcd, one kernel), always reaped."""

    def __init__(self, d: Daemon) -> None:
        self.d = d
        self.procs: dict[str, subprocess.Popen[str]] = {}

    def start(
        self, kind: str, action: str, role: str, port: int, *args: object, rcvbuf: int = 0
    ) -> None:
        name = f"{kind}-{role}"
        if kind == "smcd":
            p = dm.app(PEER, self.d, kind, action, role, str(port), *map(str, args))
        else:
            env = dict(os.environ, PYTHONPATH=str(ROOT), KERNEL_RCVBUF=str(rcvbuf))
            p = subprocess.Popen(
                [str(PY), "-c", PEER, kind, action, role, str(port), *map(str, args)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                text=True, env=env, cwd=str(ROOT),
            )  # fmt: skip
        self.procs[name] = p

    def line(self, name: str) -> str:
        p = self.procs[name]
        assert p.stdout is not None
        got = p.stdout.readline()
        if got:
            return got.strip()
        self.fail(f"{name} printed nothing")
        raise AssertionError  # unreachable

    def json(self, name: str) -> Any:
        return json.loads(self.line(name))

    def tell(self, name: str, what: str = "") -> None:
        p = self.procs[name]
        assert p.stdin is not None
        p.stdin.write(f"{what}\n")
        p.stdin.flush()

    def fail(self, what: str) -> NoReturn:
        text = []
        for name, p in self.procs.items():
            if p.poll() is None:
                p.kill()
            p.wait()
            text.append(f"--- {name} (exit {p.returncode})\n{p.stderr.read() if p.stderr else ''}")
        pytest.fail(f"{what}\n" + "\n".join(text) + f"\n{self.d.tail(6000)}\n"
                    f"--- dmesg\n{dmesg_tail()}")  # fmt: skip

    def finish(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                try:
                    assert p.stdin is not None
                    p.stdin.write("\n")
                    p.stdin.flush()
                except (OSError, ValueError):
                    pass
        for p in self.procs.values():
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            for f in (p.stdin, p.stdout, p.stderr):
                if f is not None:
                    with contextlib.suppress(OSError):  # a killed app: its stdin is a dead pipe
                        f.close()


@pytest.fixture
def peers(smcd: Daemon) -> Iterator[Peers]:
    p = Peers(smcd)
    try:
        yield p
    finally:
        p.finish()


def dmesg_tail(n: int = 40) -> str:
    return "\n".join(ks.dmesg_lines()[-n:])


def kernel_socket(port: int) -> ks.DiagSocket:
    """The kernel's connected AF_SMC socket on ``port`` (either end)."""
    found = [d for d in ks.smc_diag() if port in (d.sport, d.dport) and d.dst != "0.0.0.0"]
    assert len(found) == 1, f"smc_diag for port {port}: {ks.smc_diag()}"
    return found[0]


def our_conns(d: Daemon, port: int) -> list[dict[str, Any]]:
    return [c for c in d.ctl_json("conns", "-R") if port in (c.get("LocalPort"), c.get("PeerPort"))]


def rc_qps(dev: str) -> list[dict[str, Any]]:
    """The RC QPs on ``dev`` port 1 (``rdma res show qp``): the kernel's on rxe_b*, ours on
    rxe_a*."""
    out = subprocess.run(["rdma", "-j", "res", "show", "qp", "link", f"{dev}/1"],
                         capture_output=True, text=True, timeout=30).stdout  # fmt: skip
    rows = json.loads(out or "[]")
    return [r for r in rows if r.get("type") == "RC"]


# ---------------------------------------------------------------------------- tests


def test_detector_loads_on_this_kernel(smcd: Daemon) -> None:
    info = smcd.ctl("info")
    assert "peer detection: TCP option via BPF" in info, f"Linux {KERNEL}:\n{info}\n{smcd.tail()}"


@pytest.mark.parametrize("direction", ["s2k", "k2s"])
@pytest.mark.timeout(900)
def test_64mib_each_way_at_once_then_eof(peers: Peers, smcd: Daemon, direction: str) -> None:
    port = fresh_port()
    server, client = ("kernel", "smcd") if direction == "s2k" else ("smcd", "kernel")
    peers.start(server, "bulk", "server", port, BULK, BULK)
    assert peers.line(f"{server}-server") == "LISTENING"
    peers.start(client, "bulk", "client", port, BULK, BULK)
    ours = "smcd-client" if client == "smcd" else "smcd-server"
    connected = peers.line(ours).split()
    assert connected[:2] == ["CONNECTED", "smcr"], peers.fail(f"our end: {connected}")
    peers.line(f"kernel-{'client' if client == 'kernel' else 'server'}")
    diag = kernel_socket(port)
    assert diag.mode == "SMCR", f"Linux {KERNEL}: the kernel's end is {diag}"
    rows = [c for c in our_conns(smcd, port) if c.get("State") != "LISTEN"]
    assert rows and rows[0]["Mode"] == "SMCR", rows
    assert diag.token and diag.rmbe_size, diag
    res_c, res_s = peers.json(f"{client}-client"), peers.json(f"{server}-server")
    for me, other, name in ((res_c, res_s, "client"), (res_s, res_c, "server")):
        assert "send_error" not in me, (name, me)
        assert me["received"] == BULK and me["eof"], (name, me)
        assert me["recv_sha"] == other["sent_sha"], f"{name}: checksum differs"
    print(f"Linux {KERNEL}, {direction}: 64 MiB each way in {res_c['seconds']} s; kernel {diag}")


@pytest.mark.parametrize(("first", "direction"), FIRSTS)
def test_close_either_side_first(peers: Peers, first: str, direction: str) -> None:
    port = fresh_port()
    server, client = ("kernel", "smcd") if direction == "s2k" else ("smcd", "kernel")
    roles = {server: "server", client: "client"}
    last = "kernel" if first == "smcd" else "smcd"
    peers.start(server, "close", "server", port, "first" if server == first else "last")
    assert peers.line(f"{server}-server") == "LISTENING"
    peers.start(client, "close", "client", port, "first" if client == first else "last")
    for kind in (server, client):
        mode = peers.line(f"{kind}-{roles[kind]}").split()
        assert mode[0] == "CONNECTED" and mode[1] in ("smcr", "kernel"), peers.fail(str(mode))
    assert kernel_socket(port).mode == "SMCR"
    peers.tell(f"{first}-{roles[first]}")
    assert peers.line(f"{first}-{roles[first]}") == "CLOSED"
    assert peers.line(f"{last}-{roles[last]}") == "EOF last words"


@pytest.mark.parametrize("unread", [False, True], ids=["all-read", "unread"])
@pytest.mark.parametrize(("victim", "direction"), VICTIMS)
def test_kill_9_closes_as_the_kernel_does(
    peers: Peers, victim: str, direction: str, unread: bool
) -> None:
    """kill -9 of one application: the other end's blocked recv ends at once, with what the
    kernel sends for a dying process's socket (``smc_close_final``): ``peer_conn_closed`` when
    it had read everything (EOF, as TCP's FIN), ``peer_conn_abort`` when bytes it was sent were
    unread (a reset, as TCP's RST). The kernel's own dying application is the oracle for what
    smcd sends for one of its own. The kernel's AF_SMC records an abort as ECONNRESET in the
    socket's error (SO_ERROR) while its blocked recv returns 0 (6.1's ``smc_rx_recvmsg`` looks
    at RCV_SHUTDOWN before ``sk_err``)."""
    port = fresh_port()
    server, client = ("kernel", "smcd") if direction == "s2k" else ("smcd", "kernel")
    roles = {server: "server", client: "client"}
    dying = "smcd" if victim == "kernel" else "kernel"
    how = "victim-unread" if unread else "victim"
    peers.start(server, "close", "server", port, how if server == victim else "hold")
    assert peers.line(f"{server}-server") == "LISTENING"
    peers.start(client, "close", "client", port, how if client == victim else "hold")
    for kind in (server, client):
        assert peers.line(f"{kind}-{roles[kind]}").startswith("CONNECTED")
    assert peers.line(f"{dying}-{roles[dying]}") == "HOLDING"
    assert kernel_socket(port).mode == "SMCR"
    if unread:  # the bytes are in the holder's receive buffer before it dies
        time.sleep(0.5)
    killed = time.monotonic()
    peers.procs[f"{dying}-{roles[dying]}"].send_signal(signal.SIGKILL)
    res = peers.json(f"{victim}-{roles[victim]}")
    took = res["t"] - killed
    print(f"Linux {KERNEL}: kill -9 of the {dying} app ({'unread' if unread else 'all read'}): "
          f"{victim} saw {res} after {took:.3f} s")  # fmt: skip
    reset = res["result"] == "ConnectionResetError" or res.get("so_error") == errno.ECONNRESET
    if unread:
        assert reset, f"a death with data unread must reset the other end: {res}"
    else:
        assert res["result"] == "eof" and not res.get("so_error"), f"not an orderly close: {res}"
    assert took < 3.0, f"{took:.3f} s (TCG: the bound is loose; the figure is printed)"


@pytest.mark.parametrize("direction", ["s2k", "k2s"])
@pytest.mark.timeout(900)
def test_50_connections_one_link_group(peers: Peers, smcd: Daemon, direction: str) -> None:
    port = fresh_port()
    server, client = ("kernel", "smcd") if direction == "s2k" else ("smcd", "kernel")
    peers.start(server, "many", "server", port, MANY)
    assert peers.line(f"{server}-server") == "LISTENING"
    peers.start(client, "many", "client", port, MANY)
    opened = peers.line(f"{client}-client")
    assert opened in ('OPEN ["smcr"]', 'OPEN ["kernel"]'), peers.fail(opened)
    kernel_side = [d for d in ks.smc_diag() if port in (d.sport, d.dport) and d.dst != "0.0.0.0"]
    assert len(kernel_side) == MANY and {d.mode for d in kernel_side} == {"SMCR"}, kernel_side
    role = "CLNT" if client == "smcd" else "SERV"
    lgs = [
        g
        for g in smcd.ctl_json("linkgroup", "show", "--links")
        if g.get("Type") == "SMC-R" and g.get("Role") == role
    ]
    mine = [c for c in our_conns(smcd, port) if c.get("Mode") == "SMCR"]
    assert len(mine) == MANY, mine
    groups = {c["LinkGroup"] for c in mine}
    assert len(groups) == 1 and len(lgs) == 1, (groups, lgs)
    (lg,) = lgs
    (link,) = lg["LinkObjects"]
    assert link["State"] == "ACTIVE" and lg["Connections"] >= MANY, lg
    qps = rc_qps(ports_of("b")[0].rxe)
    match = [q for q in qps if q.get("lqpn") == link["PeerQpn"] and q.get("rqpn") == link["Qpn"]]
    assert match, f"our link {link}; the kernel's RC QPs on rxe_b0: {qps}"
    assert match[0].get("state") == "RTS", match
    peers.tell(f"{client}-client")
    out_c = peers.json(f"{client}-client")
    peers.tell(f"{client}-client")  # the client closes: each server thread sees EOF
    out_s = peers.json(f"{server}-server")
    assert len(out_c) == MANY and len(out_s) == MANY
    for r in out_c:
        assert "error" not in r, r
        srv = out_s[str(r["port"])]
        assert "error" not in srv, srv
        assert r["echo_sha"] == r["sent_sha"] == srv["recv_sha"]
        assert r["recv_sha"] == srv["sent_sha"] and r["received"] == r["expected"]
    print(f"Linux {KERNEL}, {direction}: {MANY} connections on link group {sorted(groups)}, our "
          f"QPN {link['Qpn']:#x}, the kernel's {link['PeerQpn']:#x}")  # fmt: skip


@pytest.mark.parametrize("direction", ["s2k", "k2s"])
def test_decline_no_common_ueid(peers: Peers, smcd: Daemon, direction: str) -> None:
    port = fresh_port()
    server, client = ("kernel", "smcd") if direction == "s2k" else ("smcd", "kernel")
    smcd.reload(config(OTHER_UEID))
    try:
        peers.start(server, "echo", "server", port)
        assert peers.line(f"{server}-server") == "LISTENING"
        peers.start(client, "echo", "client", port)
        res_c, res_s = peers.json(f"{client}-client"), peers.json(f"{server}-server")
        assert res_c["got"] == "hello from the server" and res_s["got"] == "hello from the client"
        diag = kernel_socket(port)
        ours = res_c if client == "smcd" else res_s
        assert ours["mode"] == "tcp", ours
        assert diag.mode == "TCP", diag
        print(f"Linux {KERNEL}, {direction}: kernel {diag}; ours {ours['fallback']}")
        if client == "smcd":  # the kernel declined: its reason is our peer diagnosis
            assert f"0x{diag.fallback_reason:08x}" in ours["fallback"], (diag, ours)
        else:  # we declined: the kernel's client records PEERDECL and our reason
            assert diag.fallback_reason == 0x05000000, diag  # SMC_CLC_DECL_PEERDECL
            assert diag.peer_diagnosis and f"0x{diag.peer_diagnosis:08x}" in smcd.log_text(), diag
    finally:
        smcd.reload(config(UEID))


def llc_sends(traffic: ks.PcapTraffic, src: str, dst: str) -> list[tuple[str, bool]]:
    """(LLC type name, is a response) of every LLC message ``src`` sent ``dst``."""
    out = []
    for send in traffic.sends:
        if send.src != src or send.dst != dst or not send.payload or send.payload[0] == 0xFE:
            continue  # 0xFE: a CDC message
        try:
            msg = llc.decode(send.payload)
        except Exception:
            continue
        out.append((msg.type.name, bool(msg.is_response)))
    return out


@pytest.mark.timeout(600)
def test_llc_the_kernel_initiates_is_answered(peers: Peers, smcd: Daemon, scratch: Path) -> None:
    """CONFIRM RKEY for a new kernel RMB (its client asks for a 1 MiB SO_RCVBUF, so its link
    group needs an RMB of a new size), TEST LINK after the link is idle (the kernel's
    smcr_testlink_time, 30 s by default; smcd's own probe is set later, else the kernel, which
    counts any received message as a sign of life, never probes) and DELETE RKEY when the
    kernel drops that RMB: each answered by smcd, as the RoCE capture shows."""
    a0 = ports_of("a")[0]
    port = fresh_port()
    with ks.capture(a0.ifname, ["udp port 4791"], scratch / "llc.pcap") as pcap:
        peers.start("smcd", "echo", "server", port)
        assert peers.line("smcd-server") == "LISTENING"
        peers.start("kernel", "echo", "client", port, rcvbuf=1 << 20)
        res_c, res_s = peers.json("kernel-client"), peers.json("smcd-server")
        assert res_s["mode"] == "smcr" and res_c["got"] == "hello from the server", res_s
        assert kernel_socket(port).mode == "SMCR"
        time.sleep(50.0)  # idle: the kernel's TEST LINK timer (30 s) fires, ours (120 s) not
        assert kernel_socket(port).mode == "SMCR"
        peers.finish()
        time.sleep(2.0)
    traffic = ks.PcapTraffic.from_pcap(pcap)
    kernel, ours = "192.0.2.2", "192.0.2.1"
    from_kernel, from_us = llc_sends(traffic, kernel, ours), llc_sends(traffic, ours, kernel)
    print(f"Linux {KERNEL}: LLC from the kernel {from_kernel}; from smcd {from_us}")
    for kind in ("CONFIRM_RKEY", "TEST_LINK", "DELETE_RKEY"):
        asked = [t for t, resp in from_kernel if t.startswith(kind) and not resp]
        answered = [t for t, resp in from_us if t.startswith(kind) and resp]
        if kind == "DELETE_RKEY" and not asked:
            continue  # the kernel keeps the RMB (seen dropped on 6.1: answered then)
        if kind == "CONFIRM_RKEY" and not asked:
            # no new RMB to confirm: a first contact (a fresh link group) carries the RMB's rkey
            # in CONFIRM LINK, and a free RMB of that size is reused without one
            continue
        assert asked, f"the kernel sent no {kind} request: {from_kernel}"
        assert len(answered) >= len(asked), f"smcd answered {answered} of {asked}: {from_us}"


# ---------------------------------------------------------------------------- link groups


def llc_messages(traffic: ks.PcapTraffic, src: str, dst: str) -> list[tuple[int, llc.LlcMessage]]:
    """(destination QP, message) of every LLC message ``src`` sent ``dst``, in order (a
    retransmission appears again)."""
    out = []
    for send in traffic.sends:
        if send.src != src or send.dst != dst or not send.payload or send.payload[0] == 0xFE:
            continue
        try:
            out.append((send.dest_qp, llc.decode(send.payload)))
        except Exception:
            continue
    return out


def wait_until(pred: Callable[[], bool], what: str, timeout: float = WAIT) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout:g} s")
        time.sleep(0.5)


def smcr_groups(d: Daemon) -> list[dict[str, Any]]:
    """smcd's SMC-R link groups (all of them with the kernel here), with their links."""
    return [g for g in d.ctl_json("linkgroup", "show", "--links") if g.get("Type") == "SMC-R"]


def restart_kernel_smc(d: Daemon) -> None:
    """``rmmod smc`` (the kernel terminates every link group, DELETE LINK ALL) and load it
    again with this module's UEID and pnet entry; returns once smcd has no link group left."""
    b0 = ports_of("b")[0]
    try:
        ks.rmmod("smc_diag", "smc")
        wait_until(lambda: not smcr_groups(d), "end of smcd's link groups with the kernel", 90)
    finally:
        ks.modprobe("smc", "smc_diag")
        ks.ueid_add(UEID)
        ks.pnet_add("INTEROPB0", b0.ifname, b0.rxe)


@pytest.mark.timeout(600)
def test_kernel_deleting_its_link_groups_is_answered(
    peers: Peers, smcd: Daemon, scratch: Path
) -> None:
    """DELETE LINK ALL from the kernel: it sends one for each link group it terminates
    (``smc_lgr_cleanup``), here all at once by ``rmmod smc`` (``smc_lgrs_shutdown``, reason
    OP_INIT_TERM) instead of its idle timer's 10 minutes. smcd as server echoes it (orderly,
    with the kernel's reason: ``smc_llc_process_srv_delete_link``), as client it terminates and
    sends its own DELETE LINK ALL (``smc_lgr_cleanup``); no DELETE LINK response is due in
    either role. Then smcd lists no link group and its QPs are gone.

    An earlier test's link group may span both of host A's devices (the ADD LINK test leaves one
    with its link on rxe_a1): each link is looked up on its own device and wire, and the
    kernel's DELETE LINK ALL is expected once per link group, on whichever link it chose
    (``smc_llc_send_link_delete_all``: the first usable one)."""
    ours_a = ports_of("a")
    by_dev = {p.rxe: p for p in ours_a}
    our_addrs = {p.address for p in ours_a}
    for direction in ("s2k", "k2s"):  # a link group in each role (or earlier tests' ones)
        port = fresh_port()
        server, client = ("kernel", "smcd") if direction == "s2k" else ("smcd", "kernel")
        peers.start(server, "echo", "server", port)
        assert peers.line(f"{server}-server") == "LISTENING"
        peers.start(client, "echo", "client", port)
        ours = peers.json("smcd-client" if client == "smcd" else "smcd-server")
        theirs = peers.json("kernel-client" if client == "kernel" else "kernel-server")
        assert ours["mode"] == "smcr" and theirs["got"].startswith("hello"), (ours, theirs)
        peers.finish()
        peers.procs.clear()

    def live_qps() -> set[tuple[str, int]]:
        """(device, QPN) of every RC QP on host A's devices (smcd's own)."""
        return {(dev, q["lqpn"]) for dev in by_dev for q in rc_qps(dev) if "lqpn" in q}

    snapshot: list[dict[str, Any]] = []

    def consistent() -> bool:
        """Each link smcd lists has its QP on its device (the two reads are not atomic: a link
        being torn down may still be listed, so they are read again)."""
        snapshot[:] = smcr_groups(smcd)
        live = live_qps()
        return all((lk["IbDev"], lk["Qpn"]) in live for g in snapshot for lk in g["LinkObjects"])

    try:
        wait_until(consistent, "agreement of smcd's link groups and host A's QPs", 60)
    except AssertionError as e:
        pytest.fail(f"{e}: {snapshot}\n{sorted(live_qps())}\n{smcd.tail(8000)}")
    groups = snapshot
    assert {g["Role"] for g in groups} == {"CLNT", "SERV"}, groups
    assert all(lk["IbDev"] in by_dev for g in groups for lk in g["LinkObjects"]), groups
    qps = {(lk["IbDev"], lk["Qpn"]) for g in groups for lk in g["LinkObjects"]}
    bpf = ["udp port 4791"]
    with contextlib.ExitStack() as stack:
        pcaps = {
            p.rxe: stack.enter_context(
                ks.capture(p.ifname, bpf, scratch / f"delete_link_{p.ifname}.pcap")
            )
            for p in ours_a
        }
        restart_kernel_smc(smcd)
        time.sleep(2.0)
    kernel_says: list[tuple[str, int, llc.LlcMessage]] = []  # (our device, dest QP, message)
    we_say: list[tuple[str, int, llc.LlcMessage]] = []
    for dev, pcap in pcaps.items():
        for send in ks.PcapTraffic.from_pcap(pcap).sends:
            if not send.payload or send.payload[0] == 0xFE:
                continue  # a CDC message
            with contextlib.suppress(Exception):
                msg = llc.decode(send.payload)
                (we_say if send.src in our_addrs else kernel_says).append((dev, send.dest_qp, msg))
    print(f"Linux {KERNEL}: rmmod smc; LLC from the kernel {kernel_says}; from smcd {we_say}")
    for g in groups:
        mine = {(lk["IbDev"], lk["Qpn"]) for lk in g["LinkObjects"]}
        theirs = {(lk["IbDev"], lk["PeerQpn"]) for lk in g["LinkObjects"]}
        asked = [m for dev, qp, m in kernel_says
                 if (dev, qp) in mine and isinstance(m, llc.DeleteLink)]  # fmt: skip
        assert asked, f"no DELETE LINK from the kernel for link group {g['Id']:#x}: {kernel_says}"
        req = asked[0]
        assert req.flags & llc.DeleteLinkFlag.ALL and not req.is_response, req
        answers = [m for dev, qp, m in we_say
                   if (dev, qp) in theirs and isinstance(m, llc.DeleteLink)]  # fmt: skip
        assert answers, f"smcd ({g['Role']}) sent no DELETE LINK back: {we_say}"
        ans = answers[0]
        assert ans.flags & llc.DeleteLinkFlag.ALL and not ans.is_response and ans.is_v2, ans
        if g["Role"] == "SERV":
            assert ans.flags & llc.DeleteLinkFlag.ORDERLY and ans.reason == req.reason, (req, ans)
        else:
            assert ans.reason == llc.DeleteLinkReason.PROGRAM_TERMINATION, ans
    assert not smcr_groups(smcd)
    # smcd destroys a QP shortly after its link (the last sends drain first)
    wait_until(lambda: not live_qps() & qps, f"end of smcd's QPs {sorted(qps)}", 30)


B1_EXTRA = "192.0.2.66"
"""An address on the kernel's second NIC in the subnet of its first (as /24): SMC-Rv2 takes an
alternate RoCE device only if its netdev has an address matching the link group's source
address under its own mask (``smc_ib_determine_gid``), which the topology's /32s never do."""


def _gid_ready(p: Port) -> bool:
    base = Path("/sys/class/infiniband") / p.rxe / "ports" / "1"
    try:
        state = (base / "state").read_text()
        return "ACTIVE" in state and (base / "gids" / "1").read_text().strip() == (
            ipv4_mapped_gid_text(p.address)
        )
    except OSError:
        return False


def nic_up(p: Port) -> None:
    """Up again with the policy route the kernel flushed when it went down; the rxe port
    ACTIVE with its GID."""
    dm.ip_batch([f"link set dev {p.ifname} up",
                 f"route replace {p.peer_address}/32 dev {p.ifname} src {p.address} "
                 f"table {POLICY_TABLE}"])  # fmt: skip
    wait_until(lambda: _gid_ready(p), f"{p.rxe} ACTIVE with its IPv4 GID", 60)


@pytest.mark.timeout(900)
def test_kernel_adds_a_second_link_and_fails_over(
    peers: Peers, smcd: Daemon, scratch: Path
) -> None:
    """ADD LINK from the kernel with a second device: the kernel (server, SMC-Rv2) offers a
    link on rxe_b1 right after the first contact (v2 ADD LINK with its rkeys in the extension);
    smcd (client, rxe_a1 under the same PNETID) answers with its own, CONFIRM LINK goes both
    ways on the new link and the link group is symmetric on both sides. Then the kernel's first
    NIC goes down: it moves the connection to the second link and deletes the first (DELETE
    LINK, answered), and the same connection keeps moving checksummed data."""
    a0, a1 = ports_of("a")
    b0, b1 = ports_of("b")
    if smcr_groups(smcd):  # the connection must be a first contact, not join an old group
        restart_kernel_smc(smcd)
    dm.ip_batch([f"addr add {B1_EXTRA}/24 dev {b1.ifname} noprefixroute",
                 f"route add {B1_EXTRA}/32 dev {a1.ifname} src {a1.address} "
                 f"table {POLICY_TABLE}"])  # fmt: skip
    port = fresh_port()
    sym_before = dmesg_tail(100_000).count("state changed: SYMMETRIC")
    reloaded = False
    try:
        ks.pnet_add("INTEROPB0", b1.ifname, b1.rxe)
        for p in (a0, a1):  # smcd's second device: rxe_a1 under the first one's PNETID
            smcd.ctl("pnet", "add", "INTEROPA", "-I", p.ifname, "-D", p.rxe)
        smcd.reload(config(UEID, max_links=2))
        reloaded = True
        bpf = ["udp port 4791"]
        with (
            ks.capture(a0.ifname, bpf, scratch / "add_link_wire0.pcap") as pcap0,
            ks.capture(a1.ifname, bpf, scratch / "add_link_wire1.pcap") as pcap1,
        ):
            peers.start("kernel", "echoloop", "server", port)
            assert peers.line("kernel-server") == "LISTENING"
            peers.start("smcd", "echoloop", "client", port, 300_007)
            got = peers.line("smcd-client").split()
            assert got[:2] == ["CONNECTED", "smcr"], peers.fail(f"our end: {got}")
            assert peers.line("kernel-server").startswith("CONNECTED")
            assert kernel_socket(port).mode == "SMCR"

            def links() -> dict[str, dict[str, Any]]:
                """Our link group's ACTIVE links by RDMA device."""
                groups = smcr_groups(smcd)
                return {lk["IbDev"]: lk for g in groups for lk in g["LinkObjects"]
                        if lk["State"] == "ACTIVE"}  # fmt: skip

            try:
                wait_until(lambda: set(links()) == {a0.rxe, a1.rxe}, "second link", 120)
            except AssertionError as e:
                peers.fail(f"{e}: {smcr_groups(smcd)}")
            (group,) = smcr_groups(smcd)
            second = links()[a1.rxe]
            pair = (second["PeerQpn"], second["Qpn"])
            kqp = [q for q in rc_qps(b1.rxe) if (q.get("lqpn"), q.get("rqpn")) == pair]
            assert kqp and kqp[0].get("state") == "RTS", (second, rc_qps(b1.rxe))
            assert second["PeerGid"] != links()[a0.rxe]["PeerGid"], group
            print(f"Linux {KERNEL}: two links, {group['LgrType']}: {group['LinkObjects']}")
            assert group["LgrType"] == "SYM", group
            wait_until(  # the kernel's own view (smcr_lgr_set_type logs it)
                lambda: dmesg_tail(100_000).count("state changed: SYMMETRIC") > sym_before,
                "SYMMETRIC link group in the kernel's log",
                30,
            )
            peers.tell("smcd-client", "round")
            res = peers.json("smcd-client")
            assert res["ok"], res
            dm.ip_batch([f"link set dev {b0.ifname} down"])
            try:
                wait_until(lambda: set(links()) == {a1.rxe}, "failover to the second link", 120)
                peers.tell("smcd-client", "round")
                res = peers.json("smcd-client")
                assert res["ok"], res
                assert kernel_socket(port).mode == "SMCR"
                time.sleep(2.0)
            finally:
                nic_up(b0)
        peers.finish()
        assert peers.procs["kernel-server"].returncode == 0
    finally:
        dm.ip_batch([f"addr del {B1_EXTRA}/24 dev {b1.ifname}",
                     f"route del {B1_EXTRA}/32 table {POLICY_TABLE}"], force=True)  # fmt: skip
        with contextlib.suppress(AssertionError):
            smcd.ctl("pnet", "del", "INTEROPA")
        if reloaded:
            smcd.reload(config(UEID))
    t0, t1 = ks.PcapTraffic.from_pcap(pcap0), ks.PcapTraffic.from_pcap(pcap1)
    k0, s0 = llc_messages(t0, b0.address, a0.address), llc_messages(t0, a0.address, b0.address)
    k1, s1 = llc_messages(t1, b1.address, a1.address), llc_messages(t1, a1.address, b1.address)
    print(f"Linux {KERNEL}: wire 0 kernel {k0}\nsmcd {s0}\nwire 1 kernel {k1}\nsmcd {s1}")
    offer = next(m for _, m in k0 if isinstance(m, llc.AddLink) and not m.is_response)
    first_gid = bytes(10) + b"\xff\xff" + socket.inet_aton(b0.address)
    assert offer.is_v2 and offer.ext is not None and offer.sender_gid != first_gid, offer
    answer = next(m for _, m in s0 if isinstance(m, llc.AddLink) and m.is_response)
    assert not answer.flags & llc.AddLinkFlag.REJECT and answer.ext is not None, answer
    assert answer.link_num == offer.link_num and len(answer.ext.rkeys) >= 1
    conf = [m for _, m in k1 if isinstance(m, llc.ConfirmLink)]
    conf_ours = [m for _, m in s1 if isinstance(m, llc.ConfirmLink)]
    assert conf and not conf[0].is_response and conf_ours and conf_ours[0].is_response
    # the first link goes: the kernel's DELETE LINK request for it, smcd's response
    dels = [m for _, m in k1 if isinstance(m, llc.DeleteLink) and not m.is_response]
    assert dels and dels[0].link_num != offer.link_num, k1
    gone = dels[0].link_num
    assert [m for _, m in s1 if isinstance(m, llc.DeleteLink) and m.is_response
            and m.link_num == gone], s1  # fmt: skip
