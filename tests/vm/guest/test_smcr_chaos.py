"""The chaos test of #14 over SMC-R: two real ``smcd`` daemons speak SMC-R over Soft-RoCE while
the server applications' daemon (host B's) is SIGKILLed and restarted during handshakes and
during transfers, and SIGSTOPped and continued; then the client applications' daemon (host
A's) is SIGSTOPped and continued, and at the end SIGKILLed the same way. Both daemons have the
other host in ``peers`` (no peer detection), so a client daemon proposes whether or not the
server's daemon is there: the case where a server half that stays on TCP could read a
Proposal as data.

A client application on host A (192.0.2.1, its daemon ``a``) runs threads in connect / echo /
close loops against an echo server application on host B (192.0.2.2, daemon ``b``); every
connection carries one message each way: a 4-byte length, that many random bytes and their
SHA-256. The server checks what it got and echoes it; the client checks the echo. The rule
(README, "The handoff protocol"): every connection ends as an SMC-R channel with byte-exact
data, as TCP with byte-exact data (never beginning with a CLC eyecatcher: the daemons'
protocol bytes read as data), or as an OSError. A connection still going after :data:`HANG_S`
is hung; every wait of the applications and of this test is bounded.

The timeline (one restart: a daemon's start-up under TCG is what the test's time goes to; the
README's chaos section has a run's figures):

1. ``warm`` — small messages until the first SMC-R connection is through;
2. ``kill`` — the even client threads move large messages, the odd ones mostly handshake;
   once an even one is 64 KiB into an SMC-R transfer, daemon b is SIGKILLed (what every
   thread was doing at that moment is printed); the load goes on for :data:`DOWN_S`
   (connections meet a server application without its daemon), then pauses while b restarts;
3. ``recover`` — until an SMC-R connection is through again (the new b, a new link group);
4. ``freeze`` — as 2; daemon b is SIGSTOPped for :data:`FREEZE_S` and continued;
5. ``post`` — until an SMC-R connection is through on the continued daemon;
6. ``freeze-a`` and ``post-a`` — as 4 and 5 with daemon a (the client halves') frozen;
7. ``kill-a`` — as 2, but daemon a (the client halves') is SIGKILLed, and not restarted: the
   load goes on for :data:`DOWN_S` as ``a-dead`` (clients without their daemon, TCP).

The outcomes are printed by phase, side, mode, fallback reason and result (``-s``) and kept in
``scratch/<test>/figures.txt``.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.vm.guest import daemons as dm
from tests.vm.guest.daemons import PY, ROOT, Daemon

UEID = "SMCD-VM-CHAOS"
PORT = 47331
CLIENT_THREADS = 4
HANG_S = 100.0
"""A connection still going after this long is hung: its legitimate worst case is the TCP
connect (:data:`IO_S`), the handoff (:data:`HANDOFF_S`) and two socket waits of :data:`IO_S`
with no progress."""
IO_S = 20.0
HANDOFF_S = 45.0
FREEZE_S = 4.0
DOWN_S = 4.0
"""How long the load goes on while daemon b is dead (then it pauses for b's start-up)."""
RECOVER_S = 90.0
"""How long a phase waits for an SMC-R connection after a restart (a new link group: first
contact under TCG)."""

# ---------------------------------------------------------------------------- the applications

COMMON = r"""
import errno, faulthandler, hashlib, json, os, random, signal, struct, sys, threading, time
import smc_handoff

faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test's view of a stuck app

SERVER, CLIENT = "192.0.2.2", "192.0.2.1"
EYES = (b"\xe2\xd4\xc3\xd9", b"\xe2\xd4\xc3\xc4")
IO_S, HANG_S = float(os.environ["CHAOS_IO_S"]), float(os.environ["CHAOS_HANG_S"])
state = {"phase": "warm", "size": "small", "arm": set(), "stop": False}
tally, examples, active, hung, stages = {}, [], {}, set(), {}
lock, out_lock = threading.Lock(), threading.Lock()

def say(text):
    with out_lock:
        print(text, flush=True)

def add(ph, mode, reason, outcome, note=""):
    key = f"{ph}|{mode}|{reason}|{outcome}"
    with lock:
        tally[key] = tally.get(key, 0) + 1
        if note and len(examples) < 8:
            examples.append(f"{key}: {note}")

def fire(kind, text):
    # the test armed this event: say it once (it kills or freezes a daemon on it)
    with lock:
        hit = kind in state["arm"]
        state["arm"].discard(kind)
    if hit:
        say(f"{kind.upper()} {text}")

def err(e):
    return errno.errorcode.get(e.errno or 0, type(e).__name__)

def describe(s):
    return s.mode, "-" if s.fallback is None else s.fallback.name

def clc(data):
    return data[:4] in EYES

def recv_upto(s, n):
    parts, got = [], 0
    while got < n:
        piece = s.recv(min(n - got, 262144))
        if not piece:
            break
        parts.append(piece)
        got += len(piece)
    return b"".join(parts)

def control():
    # PHASE name size / ARM kind / STOP, one a line on stdin
    for line in sys.stdin:
        words = line.split()
        if not words:
            continue
        if words[0] == "PHASE":
            state["phase"], state["size"] = words[1], words[2]
        elif words[0] == "ARM":
            with lock:
                state["arm"].add(words[1])
        elif words[0] == "STOP":
            break
    state["stop"] = True

def watchdog():
    while not state["stop"]:
        time.sleep(1.0)
        now = time.monotonic()
        for key, (t0, ph) in list(active.items()):
            if now - t0 > HANG_S and key not in hung:
                hung.add(key)
                add(ph, "?", "-", "hung")

def finish():
    # bounded: whatever is still going HANG_S after STOP is hung
    deadline = time.monotonic() + HANG_S
    while active and time.monotonic() < deadline:
        time.sleep(0.1)
    for key, (t0, ph) in list(active.items()):
        if key not in hung:
            add(ph, "?", "-", "hung (at the end)")
    say("REPORT " + json.dumps({"tally": tally, "examples": examples}))
    sys.stdout.flush()
    os._exit(0)
"""

CLIENT_APP = (
    COMMON
    + r"""
port, threads, seed = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
SMALL = (1, 100, 4096, 20000)
LARGE = (262144, 700001, 1 << 20)

def one(i, rng, ph, size):
    if size == "split":  # even threads move large messages, odd ones mostly handshake
        size = "large" if i % 2 == 0 else "small"
    n = rng.choice(SMALL if size == "small" else LARGE if size == "large" else SMALL + LARGE)
    payload = rng.randbytes(n)
    msg = struct.pack("!I", n) + payload + hashlib.sha256(payload).digest()
    stages[i] = "handshake"
    try:
        s = smc_handoff.connect((SERVER, port), IO_S, source_address=(CLIENT, 0))
    except OSError as e:
        add(ph, "none", "-", "error in handshake: " + err(e))
        time.sleep(0.1)
        return
    mode, reason = describe(s)
    got = b""
    stages[i] = "transfer"
    try:
        s.settimeout(IO_S)
        view = memoryview(msg)
        s.sendall(view[:65536])
        if len(msg) > 65536 and mode == "smcr":
            fire("xfer", " ".join(f"{k}:{v}" for k, v in sorted(stages.items())))
        s.sendall(view[65536:])
        got = recv_upto(s, len(msg))
        if clc(got):
            add(ph, mode, reason, "corrupt: CLC bytes as data", got[:64].hex())
        elif got == msg:
            add(ph, mode, reason, "ok")
            if mode == "smcr" and ph == state["phase"]:
                fire("smcr", mode)
        elif len(got) < len(msg) and msg.startswith(got):
            add(ph, mode, reason, "error in transfer: EOF before the whole echo")
        else:
            add(ph, mode, reason, "corrupt: echo differs", got[:64].hex())
    except OSError as e:
        if clc(got):
            add(ph, mode, reason, "corrupt: CLC bytes as data", got[:64].hex())
        else:
            add(ph, mode, reason, "error in transfer: " + err(e))
    finally:
        stages[i] = "-"
        try:
            s.close()
        except OSError:
            pass

def worker(i):
    rng = random.Random(seed * 100 + i)
    while not state["stop"]:
        ph, size = state["phase"], state["size"]
        if size == "idle":
            time.sleep(0.1)
            continue
        active[i] = (time.monotonic(), ph)
        try:
            one(i, rng, ph, size)
        finally:
            active.pop(i, None)

threading.Thread(target=control, daemon=True).start()
threading.Thread(target=watchdog, daemon=True).start()
for i in range(threads):
    threading.Thread(target=worker, args=(i,), daemon=True).start()
say("STARTED")
while not state["stop"]:
    time.sleep(0.2)
finish()
"""
)

SERVER_APP = (
    COMMON
    + r"""
port = int(sys.argv[1])
MAX = 2 << 20
srv = smc_handoff.listen((SERVER, port), backlog=128)
srv.settimeout(0.5)

def handle(c, ph):
    key = id(c)
    active[key] = (time.monotonic(), ph)
    mode, reason = "tcp", "-"
    try:
        mode, reason = describe(c)
        c.settimeout(IO_S)
        head = recv_upto(c, 4)
        if clc(head):
            add(ph, mode, reason, "corrupt: CLC bytes as data", head.hex())
            return
        if len(head) < 4:
            add(ph, mode, reason, "error in transfer: EOF before the message")
            return
        (n,) = struct.unpack("!I", head)
        if n > MAX:
            add(ph, mode, reason, "corrupt: bad length", head.hex())
            return
        body = recv_upto(c, n + 32)
        if len(body) < n + 32:
            add(ph, mode, reason, "error in transfer: EOF inside the message")
            return
        if hashlib.sha256(body[:n]).digest() != body[n:]:
            add(ph, mode, reason, "corrupt: checksum", body[:32].hex())
            return
        c.sendall(head + body)
        if c.recv(1):  # the client closes after reading the echo
            add(ph, mode, reason, "corrupt: bytes after the message")
            return
        add(ph, mode, reason, "ok")
    except OSError as e:
        add(ph, mode, reason, "error in transfer: " + err(e))
    finally:
        active.pop(key, None)
        try:
            c.close()
        except OSError:
            pass

def accept_loop():
    while not state["stop"]:
        ph = state["phase"]
        try:
            c, _ = srv.accept()
        except TimeoutError:
            continue
        except OSError as e:
            add(ph, "none", "-", "error in handshake: " + err(e))
            time.sleep(0.05)
            continue
        threading.Thread(target=handle, args=(c, ph), daemon=True).start()

threading.Thread(target=control, daemon=True).start()
threading.Thread(target=watchdog, daemon=True).start()
for _ in range(3):
    threading.Thread(target=accept_loop, daemon=True).start()
say("LISTENING")
while not state["stop"]:
    time.sleep(0.2)
finish()
"""
)


class App:
    """An application process: its stdout lines read by a thread into a queue, so every wait
    for a line has a deadline."""

    def __init__(self, name: str, script: str, d: Daemon, *args: object) -> None:
        env = dict(
            os.environ,
            SMCD_HANDOFF_SOCKET=str(d.smcd.handoff_socket),
            SMCD_HANDOFF_TIMEOUT=str(HANDOFF_S),
            CHAOS_IO_S=str(IO_S),
            CHAOS_HANG_S=str(HANG_S),
        )
        self.name = name
        self.proc = subprocess.Popen(
            [str(PY), "-c", script, *map(str, args)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=str(ROOT),
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.strip())
        self.lines.put(None)

    def tell(self, text: str) -> None:
        assert self.proc.stdin is not None
        with contextlib.suppress(OSError, ValueError):
            self.proc.stdin.write(text + "\n")
            self.proc.stdin.flush()

    def expect(self, prefix: str, timeout: float) -> str | None:
        """The next line starting with ``prefix`` within ``timeout`` (others are dropped), or
        None (the app ended or the deadline passed)."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                return None
            if line is None:
                self.lines.put(None)
                return None
            if line.startswith(prefix):
                return line

    def dump(self) -> None:
        """faulthandler's stacks of every thread into the app's stderr (SIGUSR1)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGUSR1)

    def stderr_tail(self) -> str:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        err = self.proc.stderr.read() if self.proc.stderr else ""
        return f"--- {self.name} app (exit {self.proc.returncode})\n{err[-6000:]}"


# ---------------------------------------------------------------------------- the daemons


@pytest.fixture(scope="module")
def daemons(out_dir: Path) -> Iterator[tuple[Daemon, Daemon]]:
    base = out_dir / "scratch" / "smcr_chaos"
    config = dm.config_text(
        peers=["192.0.2.0/24"], ueids=[UEID], clc_wait=15.0, first_llc=20.0, max_links=1
    )
    a, b = dm.start(base, "a", config), dm.start(base, "b", config)
    try:
        dm.wait_ready(a)
        dm.wait_ready(b)
        yield a, b
    finally:
        dm.stop((a, b))


# ---------------------------------------------------------------------------- the test


@pytest.mark.timeout(900)
def test_daemon_killed_and_frozen_under_load_never_corrupts_a_stream(
    daemons: tuple[Daemon, Daemon], scratch: Path
) -> None:
    a, b = daemons
    events: list[str] = []
    t0 = time.monotonic()

    def note(text: str) -> None:
        events.append(f"{time.monotonic() - t0:6.1f} s  {text}")

    server = App("server", SERVER_APP, b, PORT)
    client: App | None = None

    def context() -> str:
        apps = [x for x in (server, client) if x is not None]
        for x in apps:
            x.dump()
        time.sleep(2.0)
        tails = [x.stderr_tail() for x in apps]
        return "\n".join(["events:", *events, *tails, a.tail(3000), b.tail(3000)])

    def phase(name: str, size: str) -> None:
        note(f"phase {name} ({size})")
        for x in (server, client):
            if x is not None:
                x.tell(f"PHASE {name} {size}")

    def recover(name: str) -> bool:
        phase(name, "small")
        assert client is not None
        client.tell("ARM smcr")
        got = client.expect("SMCR", RECOVER_S)
        note(f"{name}: {'an SMC-R connection is through' if got else 'no SMC-R connection'}")
        return got is not None

    try:
        assert server.expect("LISTENING", dm.WAIT), f"server app not listening\n{context()}"
        client = App("client", CLIENT_APP, a, PORT, CLIENT_THREADS, 14)
        assert client.expect("STARTED", dm.WAIT), f"client app did not start\n{context()}"
        assert recover("warm"), f"no SMC-R connection to begin with\n{context()}"

        # One SIGKILL (a restart costs most of a minute under TCG): the even client threads
        # move large messages, the odd ones mostly handshake; b dies once an even one is
        # 64 KiB into an SMC-R transfer, whatever the others are doing at that moment.
        phase("kill", "split")
        client.tell("ARM xfer")
        fired = client.expect("XFER", 60.0)
        assert fired, f"no SMC-R transfer began\n{context()}"
        proc = b.smcd.proc
        assert proc is not None
        proc.kill()
        proc.wait(30)
        note(f"SIGKILL smcd b (pid {proc.pid}); client threads at that moment: {fired[5:]}")
        (scratch / "smcd-b-killed.log").write_text(b.log_text())
        time.sleep(DOWN_S)  # connections meet a server application without its daemon
        phase("restart", "idle")  # a start-up under load takes twice as long under TCG
        b.smcd.launch()
        assert b.smcd.proc is not None
        b.proc = b.smcd.proc
        dm.wait_ready(b)
        note(f"smcd b ready again (pid {b.proc.pid})")
        assert recover("recover"), f"no SMC-R connection after the restart\n{context()}"

        phase("freeze", "split")
        time.sleep(1.0)
        os.kill(b.proc.pid, signal.SIGSTOP)
        note(f"SIGSTOP smcd b for {FREEZE_S:g} s")
        time.sleep(FREEZE_S)
        os.kill(b.proc.pid, signal.SIGCONT)
        note("SIGCONT smcd b")
        assert recover("post"), f"no SMC-R connection after SIGCONT\n{context()}"

        # The client halves' daemon: frozen and continued, then killed the same way as b (not
        # restarted: the test ends with it).
        phase("freeze-a", "split")
        time.sleep(1.0)
        os.kill(a.proc.pid, signal.SIGSTOP)
        note(f"SIGSTOP smcd a for {FREEZE_S:g} s")
        time.sleep(FREEZE_S)
        os.kill(a.proc.pid, signal.SIGCONT)
        note("SIGCONT smcd a")
        assert recover("post-a"), f"no SMC-R connection after SIGCONT of a\n{context()}"

        phase("kill-a", "split")
        client.tell("ARM xfer")
        fired = client.expect("XFER", 60.0)
        assert fired, f"no SMC-R transfer began (kill-a)\n{context()}"
        proc_a = a.smcd.proc
        assert proc_a is not None
        proc_a.kill()
        proc_a.wait(30)
        note(f"SIGKILL smcd a (pid {proc_a.pid}); client threads at that moment: {fired[5:]}")
        (scratch / "smcd-a-killed.log").write_text(a.log_text())
        phase("a-dead", "small")
        time.sleep(DOWN_S)

        reports: dict[str, dict[str, Any]] = {}
        for x in (client, server):
            x.tell("STOP")
        for x in (client, server):
            line = x.expect("REPORT ", HANG_S + 60)
            assert line, f"{x.name} app gave no report (hung)\n{context()}"
            reports[x.name] = json.loads(line.removeprefix("REPORT "))
        note("both applications reported")
    except BaseException:
        for y in (server, client):
            if y is not None and y.proc.poll() is None:
                y.proc.kill()
        raise

    rows: Counter[tuple[str, ...]] = Counter()
    for side, rep in reports.items():
        for key, n in rep["tally"].items():
            rows[(side, *key.split("|"))] += n
    corrupted = sum(n for r, n in rows.items() if r[4].startswith("corrupt"))
    hung = sum(n for r, n in rows.items() if r[4].startswith("hung"))
    clients = sum(n for r, n in rows.items() if r[0] == "client")
    smcr_ok = sum(
        n for r, n in rows.items() if r[0] == "client" and r[2] == "smcr" and r[4] == "ok"
    )
    tracebacks = sum(t.count("Traceback") for t in (a.log_text(), b.log_text()))
    lines = [
        f"SMC-R chaos: {clients} client connections, {smcr_ok} of them SMC-R and byte-exact; "
        f"daemon b SIGKILLed once (transfers and handshakes in flight) and SIGSTOPped "
        f"{FREEZE_S:g} s once, then daemon a SIGSTOPped {FREEZE_S:g} s and SIGKILLed once",
        "outcomes by phase, side, mode, fallback reason and result:",
        *(
            f"  {ph:8} {side:6} {mode:5} {reason:28} {outcome:36} {n:>6}"
            for (side, ph, mode, reason, outcome), n in sorted(rows.items())
        ),
        f"corrupted streams: {corrupted}",
        *(f"  e.g. {ex[:160]}" for rep in reports.values() for ex in rep["examples"]),
        f"hung connections: {hung}",
        f"tracebacks in the daemons' logs: {tracebacks}",
        "events:",
        *(f"  {e}" for e in events),
    ]
    text = "\n".join(lines)
    print(f"\n{text}")
    (scratch / "figures.txt").write_text(text + "\n")

    assert corrupted == 0, f"corrupted streams:\n{text}"
    assert hung == 0, f"hung connections:\n{text}"
    odd = [r for r in rows if not r[4].startswith(("ok", "error "))]
    assert not odd, f"outcomes outside the rule: {odd}\n{text}"
    for ph in ("warm", "recover", "post", "post-a"):
        ok = sum(n for r, n in rows.items() if r[:3] == ("client", ph, "smcr") and r[4] == "ok")
        assert ok > 0, f"client: no byte-exact SMC-R connection in phase {ph}\n{text}"
    after = sum(n for r, n in rows.items() if r[:3] == ("client", "a-dead", "tcp") and r[4] == "ok")
    assert after > 0, f"client: no byte-exact TCP connection without daemon a\n{text}"
    served = sum(n for r, n in rows.items() if r[0] == "server" and r[2] == "smcr" and r[4] == "ok")
    assert served >= 3, f"server: {served} byte-exact SMC-R connections, want >= 3\n{text}"
