"""Two real ``smcd`` processes speak SMC-R to each other over Soft-RoCE: host A's daemon serves
client applications on 192.0.2.1 (smca0/rxe_a0), host B's server applications on 192.0.2.2
(smcb0/rxe_b0). The applications are separate processes using ``smc_handoff`` with their own
daemon's handoff socket, so every byte takes the real path: application → shared-memory send
buffer → its daemon → RDMA WRITE + CDC over rxe → the other daemon's RMB → the other application.

The issue's done-when scale, through that path:

* one connection moves 64 MiB each way at the same time, in odd-sized writes that cross the
  rings' wrap over and over (512 KiB RMBs), both directions checksummed (SHA-256 of what was
  sent vs. received);
* 100 concurrent connections between one client process and one server process share ONE link
  group with ONE link (one QP): ``smcctl --json linkgroup show --links`` / ``conns`` on each
  daemon show one SMC-R link group holding all 100 connections, the QP numbers unchanged from the
  first connection to the last, and each daemon's QPN is the other's peer QPN; every
  connection's data is checksummed both ways.

And a non-blocking writer waiting in ``selectors`` for room (``smc_handoff.readiness``, as
smc-run installs it) to a slow reader: each wait ends with room, none spins.

The two daemons are shared by the module (starting a Python daemon under TCG costs tens of
seconds) and configured with a long link-group linger, so every connection of the module lands
in the link group the first one created, and limited to one link per link group (the second
wire is the failover tests' business). The 100 connections are opened one after the other (the
server application hands its accepted sockets to its daemon one at a time, in accept order);
concurrent handshakes in both directions are the cross-dial test's.

Every wait has a deadline; nothing asserts a duration (TCG makes everything slow); the rates
are printed (``-s``) and kept in ``scratch/<test>/figures.txt``. Host variables reach the guest
when prefixed ``SMCD_GUEST_``: ``SMCD_GUEST_DAEMONS_BULK`` / ``SMCD_GUEST_DAEMONS_BACK`` (bytes
each way, default 64 MiB) and ``SMCD_GUEST_PROFILE`` (seconds of py-spy on both daemons and
both applications during the bulk transfer; collapsed stacks next to the figures).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.vm.guest import daemons as dm
from tests.vm.guest.daemons import ROOT, Daemon

UEID = "SMCD-VM-DAEMONS"
BULK = int(os.environ.get("SMCD_GUEST_DAEMONS_BULK", str(64 << 20)))
#: seconds of py-spy sampling of both daemons and both applications during the bulk transfer
PROFILE = float(os.environ.get("SMCD_GUEST_PROFILE", "0"))
PYSPY = ROOT / ".venv" / "bin" / "py-spy"
#: bytes server → client, at the same time (checksummed as well)
BACK = int(os.environ.get("SMCD_GUEST_DAEMONS_BACK", str(64 << 20)))
#: the bulk connection's RMB size hint: a 64 KiB ring holds one window per round trip, which
#: under TCG (RTTs of tens of ms) is what bounds the rate
BULK_RMB = 512 << 10
CONNS = 100
BULK_PORT = 47311
MANY_PORT = 47312
CROSS_PORT_A = 47313  # a listener of host A's application (the other tests listen on B only)
CROSS_PORT_B = 47314
POLL_PORT = 47315
#: what the non-blocking writer sends to the slow reader
POLL_BYTES = 4 << 20

# ---------------------------------------------------------------------------- the applications

COMMON = r"""
import hashlib, json, os, resource, struct, sys, threading, time
import smc_handoff

soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
SERVER = "192.0.2.2"
CLIENT = "192.0.2.1"

from tests.vm.guest.streams import (
    ODD_SIZES, exchange_all, note, recv_exact, recv_hash, send_odd, serve_many,
)
"""

BULK_APP = (
    COMMON
    + r"""
role, port, n_out, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
dmb = int(sys.argv[5])
data = os.urandom(n_out)
if role == "server":
    srv = smc_handoff.listen((SERVER, port), dmb_size=dmb)
    print("LISTENING", flush=True)
    s, _ = srv.accept()
else:
    s = smc_handoff.connect((SERVER, port), 60, source_address=(CLIENT, 0), dmb_size=dmb)
print("CONNECTED " + s.mode, flush=True)
t0 = time.monotonic()
done = {}
def sender():
    try:
        send_odd(s, data, ODD_SIZES)
        done["send_s"] = time.monotonic() - t0
    except BaseException as e:
        done["send_error"] = repr(e)
th = threading.Thread(target=sender)
th.start()
recv_sha, got = recv_hash(s, n, progress=t0)
recv_s = time.monotonic() - t0
th.join(300)
print(json.dumps({"mode": s.mode, "sent_sha": hashlib.sha256(data).hexdigest(),
                  "recv_sha": recv_sha, "received": got, "recv_s": recv_s, **done}), flush=True)
sys.stdin.readline()  # keep the connection while the test looks at smcctl
s.close()
"""
)

MANY_SERVER = (
    COMMON
    + r"""
port, count = int(sys.argv[1]), int(sys.argv[2])
srv = smc_handoff.listen((SERVER, port), backlog=128)
print("LISTENING", flush=True)
print(json.dumps(serve_many(srv, count, lambda c: c.mode)), flush=True)
srv.close()
"""
)

MANY_CLIENT = (
    COMMON
    + r"""
port, count = int(sys.argv[1]), int(sys.argv[2])
T0 = time.monotonic()
def dial(i=0):
    s = smc_handoff.connect((SERVER, port), 60, source_address=(CLIENT, 0))
    if i % 10 == 9:
        note(f"{time.monotonic() - T0:.1f} s: connection {i + 2} ({s.mode})")
    return s
socks = [dial()]
print("FIRST " + socks[0].mode, flush=True)
sys.stdin.readline()
# one after the other, as the server's accept loop hands its connections to its daemon
socks += [dial(i) for i in range(count - 1)]
print("OPEN " + json.dumps(sorted({s.mode for s in socks})), flush=True)
sys.stdin.readline()
print(json.dumps(exchange_all(socks, lambda s: s.mode)), flush=True)
sys.stdin.readline()
for s in socks:
    s.close()
"""
)

CROSS = (
    COMMON
    + r"""
me, other, lport, dport = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
srv = smc_handoff.listen((me, lport), backlog=8)
got = {}
def accepted():
    try:
        c, _ = srv.accept()
        got["accepted"], got["accepted_fallback"] = c.mode, str(c.fallback)
        got["accepted_data"] = recv_exact(c, 6).decode()
        c.sendall(b"a-" + me.encode())
        c.recv(1)
        c.close()
    except BaseException as e:
        got["accepted_error"] = repr(e)
th = threading.Thread(target=accepted)
th.start()
print("LISTENING", flush=True)
sys.stdin.readline()  # both dial at once
try:
    s = smc_handoff.connect((other, dport), 60, source_address=(me, 0))
    got["dialed"], got["dialed_fallback"] = s.mode, str(s.fallback)
    s.sendall(b"dialed")
    got["dialed_data"] = recv_exact(s, 2 + len(other)).decode()
    s.close()
except BaseException as e:
    got["dialed_error"] = repr(e)
th.join(120)
print(json.dumps(got), flush=True)
sys.stdin.readline()
srv.close()
"""
)

SLOW_READER = (
    COMMON
    + r"""
port, pause = int(sys.argv[1]), float(sys.argv[2])
srv = smc_handoff.listen((SERVER, port))
print("LISTENING", flush=True)
c, _ = srv.accept()
print("CONNECTED " + c.mode, flush=True)
digest, total = hashlib.sha256(), 0
while data := c.recv(65536):
    digest.update(data)
    total += len(data)
    time.sleep(pause)  # a reader slower than its writer
print(json.dumps({"mode": c.mode, "received": total, "sha": digest.hexdigest()}), flush=True)
sys.stdin.readline()
c.close()
srv.close()
"""
)

SELECTORS_WRITER = (
    COMMON
    + r"""
import selectors
from smc_handoff import readiness
readiness.install()  # as smc-run does at start
port, n = int(sys.argv[1]), int(sys.argv[2])
s = smc_handoff.connect((SERVER, port), 60, source_address=(CLIENT, 0))
print("CONNECTED " + s.mode, flush=True)
data = os.urandom(n)
s.setblocking(False)
view, waits, idle = memoryview(data), 0, 0
for sel in (selectors.DefaultSelector(), selectors.SelectSelector()):
    sel.register(s, selectors.EVENT_WRITE)
    end = len(view) // 2 if waits == 0 else 0
    while len(view) > end:
        try:
            view = view[s.send(view[:65536]):]
        except BlockingIOError:
            assert sel.select(120), "no room within 120 s"
            waits += 1
            try:
                view = view[s.send(view[:65536]):]
            except BlockingIOError:
                idle += 1  # woken without room: a spin
    sel.close()
s.setblocking(True)
print(json.dumps({"mode": s.mode, "sha": hashlib.sha256(data).hexdigest(), "waits": waits,
                  "idle": idle}), flush=True)
sys.stdin.readline()
s.close()
"""
)

# ---------------------------------------------------------------------------- the daemons


@pytest.fixture(scope="module")
def daemons(out_dir: Path) -> Iterator[tuple[Daemon, Daemon]]:
    base = out_dir / "scratch" / "smcd_daemons_smcr"
    config = dm.config_text(
        peers=["192.0.2.0/24"],
        ueids=[UEID],
        # linger: the module's connections all land in the link group the first one created
        linger=900.0,
        # one link: the link group's single QP is what the 100-connection test follows
        max_links=1,
    )
    a, b = dm.start(base, "a", config), dm.start(base, "b", config)
    try:
        dm.wait_ready(a)
        dm.wait_ready(b)
        yield a, b
    finally:
        dm.stop((a, b))


# ---------------------------------------------------------------------------- helpers


class Apps:
    """The application processes of one test: started with their daemon's handoff socket,
    always reaped, their stderr and the daemons' logs shown when one goes silent."""

    def __init__(self, daemons: tuple[Daemon, Daemon]) -> None:
        self.daemons = daemons
        self.procs: dict[str, subprocess.Popen[str]] = {}

    def start(self, name: str, script: str, d: Daemon, *args: object) -> subprocess.Popen[str]:
        p = dm.app(script, d, *map(str, args))
        self.procs[name] = p
        return p

    def line(self, name: str) -> str:
        """The next line of an application (each has its own deadlines: connect 60 s, the
        daemon's handshake timers, the test's pytest timeout as the last resort)."""
        p = self.procs[name]
        assert p.stdout is not None
        line = p.stdout.readline()
        if not line:
            pytest.fail(f"{name} app printed nothing more:\n{self.context()}")
        return line.strip()

    def tell(self, name: str) -> None:
        p = self.procs[name]
        assert p.stdin is not None
        p.stdin.write("\n")
        p.stdin.flush()

    def context(self) -> str:
        text = []
        for name, p in self.procs.items():
            if p.poll() is None:
                p.kill()
            err = p.stderr.read() if p.stderr else ""
            text.append(f"--- {name} app (exit {p.wait()})\n{err[-3000:]}")
        return "\n".join(text + [d.tail(3000) for d in self.daemons])

    def finish(self) -> None:
        """Let every application go (a newline on stdin), then reap it; each must exit 0."""
        for name in self.procs:
            with contextlib.suppress(OSError, ValueError):
                self.tell(name)
        failed = []
        for name, p in self.procs.items():
            try:
                p.wait(90)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            if p.returncode != 0:
                err = p.stderr.read() if p.stderr else ""
                failed.append(f"{name} app exit {p.returncode}: {err[-3000:]}")
        assert not failed, "\n".join(failed)


Views = list[tuple[list[dict[str, Any]], list[dict[str, Any]]]]


def views(ds: list[Daemon], port: int, *, conns: bool = True) -> Views:
    """Per daemon: (its SMC-R link groups with their links, its SMC-R connections to or from
    ``port``, [] unless ``conns``) as ``smcctl --json`` shows them (in this process)."""
    res: Views = []
    for d in ds:
        lgs = [g for g in d.ctl_json("linkgroup", "show", "--links") if g.get("Type") == "SMC-R"]
        mine = [
            c
            for c in (d.ctl_json("conns", "-R") if conns else [])
            if c.get("Mode") == "SMCR" and port in (c.get("LocalPort"), c.get("PeerPort"))
        ]
        res.append((lgs, mine))
    return res


def one_link(lgs: list[dict[str, Any]], where: str) -> tuple[dict[str, Any], dict[str, Any]]:
    assert len(lgs) == 1, f"{where}: {len(lgs)} SMC-R link groups, want 1:\n{lgs}"
    links = lgs[0]["LinkObjects"]
    assert len(links) == 1, f"{where}: {len(links)} links in the link group, want 1:\n{links}"
    assert links[0]["State"] == "ACTIVE", f"{where}: {links[0]}"
    return lgs[0], links[0]


def report(scratch: Path, text: str) -> None:
    """A figure worth keeping: printed (``-s``) and saved next to the test's scratch files
    (the guest log keeps no output of passing tests)."""
    print(f"\n{text}")
    with (scratch / "figures.txt").open("a") as f:
        f.write(text + "\n")


def profile(apps: Apps, dest: Path) -> list[tuple[str, Path, subprocess.Popen[bytes]]]:
    """py-spy (sampling, no stop of the target) on both daemons and both applications for
    :data:`PROFILE` seconds: collapsed stacks in ``dest`` (SMCD_GUEST_PROFILE=seconds)."""
    a, b = apps.daemons
    pids = {"smcd-a": a.proc.pid, "smcd-b": b.proc.pid}
    pids.update({f"app-{n}": p.pid for n, p in apps.procs.items()})
    out = []
    for name, pid in pids.items():
        path = dest / f"pyspy-{name}.txt"
        cmd = [str(PYSPY), "record", "--pid", str(pid), "--duration", str(int(PROFILE)),
               "--rate", "50", "--nonblocking", "--threads", "--format", "raw",
               "--output", str(path)]  # fmt: skip
        spy = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        out.append((name, path, spy))
    return out


def top(path: Path, n: int = 12) -> str:
    """The ``n`` most sampled leaf frames (self time) of a collapsed-stack file."""
    counts: dict[str, int] = {}
    total = 0
    with contextlib.suppress(OSError):
        for line in path.read_text().splitlines():
            stack, _, k = line.rpartition(" ")
            leaf = stack.rsplit(";", 1)[-1]
            counts[leaf] = counts.get(leaf, 0) + int(k)
            total += int(k)
    best = sorted(counts.items(), key=lambda kv: -kv[1])[:n]
    return "\n".join(f"{100 * k / max(total, 1):5.1f}%  {f}" for f, k in best) or "(no samples)"


# ---------------------------------------------------------------------------- the tests


@pytest.mark.timeout(600)
def test_64mib_checksummed_through_the_daemons(
    daemons: tuple[Daemon, Daemon], scratch: Path
) -> None:
    a, b = daemons
    apps = Apps(daemons)
    try:
        apps.start("server", BULK_APP, b, "server", BULK_PORT, BACK, BULK, BULK_RMB)
        assert apps.line("server") == "LISTENING"
        t0 = time.monotonic()
        apps.start("client", BULK_APP, a, "client", BULK_PORT, BULK, BACK, BULK_RMB)
        assert apps.line("client") == "CONNECTED smcr", apps.context()
        assert apps.line("server") == "CONNECTED smcr", apps.context()
        spies = profile(apps, scratch) if PROFILE else []
        c = json.loads(apps.line("client"))
        s = json.loads(apps.line("server"))
        wall = time.monotonic() - t0
        assert (c["mode"], s["mode"]) == ("smcr", "smcr"), f"{c} {s}\n{apps.context()}"
        assert "send_error" not in c and "send_error" not in s, f"{c} {s}"
        assert (c["received"], s["received"]) == (BACK, BULK), f"{c} {s}"
        assert s["recv_sha"] == c["sent_sha"], "client → server data differs"
        assert c["recv_sha"] == s["sent_sha"], "server → client data differs"
        mib, back = BULK / (1 << 20), BACK / (1 << 20)
        report(
            scratch,
            f"{mib:g} MiB client → server and {back:g} MiB back at the same time, "
            f"{BULK_RMB >> 10} KiB RMBs: the server received in {s['recv_s']:.1f} s "
            f"({mib / s['recv_s']:.2f} MiB/s), the client in {c['recv_s']:.1f} s "
            f"({back / c['recv_s']:.2f} MiB/s); {wall:.1f} s from the client's start",
        )
        # the connection's own view is the 100-connection test's (smcctl is slow under TCG)
        [(lgs_a, _), (lgs_b, _)] = views([a, b], BULK_PORT, conns=False)
        for d, lgs, role, dev in ((a, lgs_a, "CLNT", "rxe_a0"), (b, lgs_b, "SERV", "rxe_b0")):
            lg, link = one_link(lgs, f"smcd {d.name}")
            assert lg["Role"] == role and link["IbDev"] == dev, f"smcd {d.name}: {lg}"
            assert lg["Connections"] >= 1 and link["Connections"] >= 1, f"smcd {d.name}: {lg}"
            info = d.ctl("info").splitlines()
            line = next((x for x in info if x.startswith("SMC-R ports")), "")
            assert f"{dev} port 1" in line and line.endswith(" ACTIVE"), f"smcd {d.name}: {info}"
        for name, path, spy in spies:
            spy.wait(PROFILE + 120)
            print(f"--- py-spy {name} ({path.name}): most sampled leaf frames\n{top(path)}")
    finally:
        apps.finish()


@pytest.mark.timeout(600)
def test_100_connections_one_link_group_one_qp(
    daemons: tuple[Daemon, Daemon], scratch: Path
) -> None:
    a, b = daemons
    apps = Apps(daemons)
    try:
        apps.start("server", MANY_SERVER, b, MANY_PORT, CONNS)
        assert apps.line("server") == "LISTENING"
        t0 = time.monotonic()
        apps.start("client", MANY_CLIENT, a, MANY_PORT, CONNS)
        assert apps.line("client") == "FIRST smcr", apps.context()
        [(lgs_a, _), (lgs_b, _)] = views([a, b], MANY_PORT, conns=False)
        _, link_a = one_link(lgs_a, "smcd a after the first connection")
        _, link_b = one_link(lgs_b, "smcd b after the first connection")
        qpn_a, qpn_b = link_a["Qpn"], link_b["Qpn"]
        assert (link_a["PeerQpn"], link_b["PeerQpn"]) == (qpn_b, qpn_a), (link_a, link_b)

        apps.tell("client")
        t1 = time.monotonic()
        assert apps.line("client") == 'OPEN ["smcr"]', apps.context()
        opened = time.monotonic() - t1
        client: list[dict[str, Any]] = []
        moved = 0.0
        for step in ("all open", "after the data"):
            # smcctl is slow under TCG: the connections once, the QPs twice
            after = step != "all open"
            [(lgs_a, conns_a), (lgs_b, conns_b)] = views([a, b], MANY_PORT, conns=not after)
            for d, lgs, conns, qpn, peer_qpn in (
                (a, lgs_a, conns_a, qpn_a, qpn_b),
                (b, lgs_b, conns_b, qpn_b, qpn_a),
            ):
                where = f"smcd {d.name}, {step}"
                lg, link = one_link(lgs, where)
                assert (link["Qpn"], link["PeerQpn"]) == (qpn, peer_qpn), f"{where}: {link}"
                assert lg["Connections"] == CONNS, f"{where}: {lg}"
                if after:
                    continue
                assert len(conns) == CONNS, f"{where}: {len(conns)} SMC-R connections"
                assert {c["LinkGroup"] for c in conns} == {lg["Path"]}, where
                assert {c["Link"] for c in conns} == {link["Path"]}, where
            if not after:
                apps.tell("client")
                t2 = time.monotonic()
                client = json.loads(apps.line("client"))
                moved = time.monotonic() - t2
        apps.tell("client")
        server = json.loads(apps.line("server"))
        assert len(client) == CONNS and len(server) == CONNS
        for r in client:
            assert "error" not in r and r["mode"] == "smcr", r
            s = server[str(r["port"])]
            assert "error" not in s and s["mode"] == "smcr" and s["eof"], s
            assert s["recv_sha"] == r["sent_sha"] == r["echo_sha"], (r, s)
            assert r["recv_sha"] == s["sent_sha"] and r["received"] == r["expected"], (r, s)
        total = sum(r["received"] + s["received"] for r in client for s in [server[str(r["port"])]])
        report(
            scratch,
            f"{CONNS} connections on one link group, QPN {qpn_a:#x} (a) / {qpn_b:#x} (b): "
            f"99 opened in {opened:.1f} s, {total / (1 << 20):.1f} MiB moved in {moved:.1f} s, "
            f"{time.monotonic() - t0:.1f} s in all",
        )
    finally:
        apps.finish()


@pytest.mark.timeout(600)
def test_a_non_blocking_writer_waits_for_room_over_smcr(
    daemons: tuple[Daemon, Daemon], scratch: Path
) -> None:
    """A writer that sends non-blocking and waits in ``selectors`` (epoll, then select) for
    ``EVENT_WRITE`` when its send buffer is full, to a reader slower than it, over SMC-R: with
    ``smc_handoff.readiness`` installed (as smc-run does), a wait ends only when there is room
    again, which here means the daemons moved the data over RDMA, the reader's consumer cursor
    came back in a CDC message and the writer's daemon kicked its link. Every byte arrives."""
    a, b = daemons
    apps = Apps(daemons)
    try:
        apps.start("reader", SLOW_READER, b, POLL_PORT, 0.002)
        assert apps.line("reader") == "LISTENING"
        apps.start("writer", SELECTORS_WRITER, a, POLL_PORT, POLL_BYTES)
        assert apps.line("writer") == "CONNECTED smcr", apps.context()
        assert apps.line("reader") == "CONNECTED smcr", apps.context()
        w = json.loads(apps.line("writer"))
        apps.tell("writer")  # the writer closes: the reader sees its EOF
        r = json.loads(apps.line("reader"))
        assert (w["mode"], r["mode"]) == ("smcr", "smcr"), (w, r)
        assert (r["received"], r["sha"]) == (POLL_BYTES, w["sha"]), (w, r)
        report(scratch, f"{POLL_BYTES >> 20} MiB non-blocking to a slow reader over SMC-R: "
                        f"{w['waits']} waits, {w['idle']} without room")  # fmt: skip
        assert w["waits"] >= 1, w  # the reader was the slower side: the writer waited
        assert w["idle"] <= 2 + w["waits"] // 50, w  # each wait ended with room
    finally:
        apps.finish()


@pytest.mark.timeout(600)
def test_two_hosts_dialing_each_other_at_once(daemons: tuple[Daemon, Daemon]) -> None:
    """A and B each dial the other's listener at the same moment: four handshakes in flight
    at once, a client and a server one in each daemon. All four connections end on SMC-R; with
    one handshake lock per daemon (instead of the kernel's one per role), each daemon's client
    half held it while waiting for an Accept that the other's server half could not send, and
    one side fell back when its CLC timer fired. (Last in the module: it adds a link group in
    the other direction to daemons the tests above expect to hold one.)"""
    a, b = daemons
    apps = Apps(daemons)
    try:
        apps.start("on a", CROSS, a, "192.0.2.1", "192.0.2.2", CROSS_PORT_A, CROSS_PORT_B)
        apps.start("on b", CROSS, b, "192.0.2.2", "192.0.2.1", CROSS_PORT_B, CROSS_PORT_A)
        assert apps.line("on a") == "LISTENING" and apps.line("on b") == "LISTENING"
        apps.tell("on a")
        apps.tell("on b")
        results = {name: json.loads(apps.line(name)) for name in ("on a", "on b")}
        for name, other in (("on a", "192.0.2.2"), ("on b", "192.0.2.1")):
            r = results[name]
            assert "dialed_error" not in r and "accepted_error" not in r, (name, r)
            assert (r["dialed"], r["accepted"]) == ("smcr", "smcr"), (name, r, apps.context())
            assert r["accepted_data"] == "dialed" and r["dialed_data"] == "a-" + other, (name, r)
    finally:
        apps.finish()
