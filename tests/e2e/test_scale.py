"""Scale and volume through the real daemon: 1,000 concurrent SMC-D channels between two
processes (every one carrying checksummed data, all closed cleanly, every DMB and descriptor
released by the daemon afterwards), and more than 1 GiB of odd-sized writes crossing the ring wrap
through one daemon-made channel with the largest DMB."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.control.daemon_proc import NotifySocket
from tests.control.dbusd import DbusDaemon
from tests.e2e.conftest import PYTHON, REPO, Smcd

pytestmark = pytest.mark.timeout(180)

CHANNELS = 1000
DMB = 16 << 10
"""The smallest DMB for the 1,000 channels: 2,000 DMBs are 32 MiB (+ trailers)."""
CONFIG = f"""
[quota]
connections = 0
buffer_bytes = 0
[buffers]
pool_max_buffers = {2 * CHANNELS + 64}
"""

# Shared by both roles: raise the descriptor limit (each channel holds its TCP socket, the
# handoff connection, two eventfds and the peer link: ~5 descriptors per channel and process).
_PRELUDE = r"""
import hashlib, json, os, resource, socket, sys, time
import smc_handoff

soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
want = max(hard, 16384) if hard != resource.RLIM_INFINITY else 16384
resource.setrlimit(resource.RLIMIT_NOFILE, (want, want))

def out(**kw):
    sys.stdout.write(json.dumps(kw) + "\n")
    sys.stdout.flush()

def wait_for(word):
    line = sys.stdin.readline().strip()
    assert line == word, line

def payload(i):
    # odd sizes, all fitting in one ring (so sending every channel first never blocks)
    n = 1 + (i * 7919) % (16 * 1024 - 64)
    return hashlib.shake_256(i.to_bytes(4, "big")).digest(n)

def recv_exactly(s, n):
    buf = bytearray()
    while len(buf) < n:
        piece = s.recv(n - len(buf))
        if not piece:
            raise EOFError(f"EOF after {len(buf)} of {n} bytes")
        buf += piece
    return bytes(buf)
"""

SERVER = (
    _PRELUDE
    + r"""
n, dmb = int(sys.argv[1]), int(sys.argv[2])
srv = smc_handoff.listen(("127.0.0.1", 0), backlog=1024, dmb_size=dmb)
out(port=srv.getsockname()[1], registered=srv.registered)
conns = []
modes = {}
for _ in range(n):
    c, _ = srv.accept()
    modes[c.mode] = modes.get(c.mode, 0) + 1
    conns.append(c)
out(accepted=len(conns), modes=modes)
# each client connection i sends a 4-byte index, a 4-byte length and the payload; answer SHA-256
checked = 0
for c in conns:
    i, size = int.from_bytes(recv_exactly(c, 4), "big"), int.from_bytes(recv_exactly(c, 4), "big")
    data = recv_exactly(c, size)
    assert data == payload(i), i
    c.sendall(hashlib.sha256(data).digest())
    checked += 1
out(checked=checked)
eof = resets = 0
for c in conns:
    try:
        if c.recv(1) == b"":
            eof += 1
    except ConnectionResetError:
        resets += 1
    c.close()
out(eof=eof, resets=resets)
"""
)

CLIENT = (
    _PRELUDE
    + r"""
n, dmb, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
conns = []
modes = {}
t0 = time.monotonic()
for _ in range(n):
    s = smc_handoff.connect(("127.0.0.1", port), timeout=30, dmb_size=dmb)
    modes[s.mode] = modes.get(s.mode, 0) + 1
    if s.mode != "smcd":
        out(fallback=str(s.fallback))
    conns.append(s)
out(connected=len(conns), modes=modes, seconds=time.monotonic() - t0)
wait_for("go")
for i, s in enumerate(conns):
    data = payload(i)
    s.sendall(i.to_bytes(4, "big") + len(data).to_bytes(4, "big") + data)
verified = 0
for i, s in enumerate(conns):
    if recv_exactly(s, 32) == hashlib.sha256(payload(i)).digest():
        verified += 1
out(verified=verified)
wait_for("close")
for s in conns:
    s.close()
out(closed=len(conns))
"""
)

BULK_TOTAL = (1 << 30) + 7_654_321
"""Bytes of the volume test: over 1 GiB, not a multiple of anything."""

BULK_SENDER = r"""
import hashlib, json, socket, sys, time
import smc_handoff

port, total = int(sys.argv[1]), int(sys.argv[2])
s = smc_handoff.connect(("127.0.0.1", port), timeout=30, dmb_size=1 << 20)
print(json.dumps({"mode": s.mode, "fallback": s.fallback and str(s.fallback)}), flush=True)
block = hashlib.shake_256(b"smcd bulk").digest(4 << 20)
sizes = (65521, 1048573, 7, 131071, 4099, 524287, 999983, 1, 262139, 2039)
view = memoryview(block)
h = hashlib.sha256()
sent = off = k = 0
t0 = time.monotonic()
while sent < total:
    n = min(sizes[k % len(sizes)], total - sent, len(block) - off)
    piece = view[off : off + n]
    s.sendall(piece)
    h.update(piece)
    sent += n
    off = (off + n) % (len(block) - 1_000_000)  # restart at shifting offsets
    k += 1
s.shutdown(socket.SHUT_WR)
print(json.dumps({"sent": sent, "sha": h.hexdigest(), "writes": k,
                  "seconds": time.monotonic() - t0}), flush=True)
s.close()
"""

BULK_RECEIVER = r"""
import hashlib, json, sys
import smc_handoff

srv = smc_handoff.listen(("127.0.0.1", 0), dmb_size=1 << 20)
print(json.dumps({"port": srv.getsockname()[1], "registered": srv.registered}), flush=True)
c, _ = srv.accept()
print(json.dumps({"mode": c.mode, "fallback": c.fallback and str(c.fallback)}), flush=True)
buf = bytearray(1 << 20)
view = memoryview(buf)
sizes = (1 << 20, 65536, 777, 300007, 4096, 1048575)
h = hashlib.sha256()
n = k = 0
while True:
    got = c.recv_into(view, sizes[k % len(sizes)])
    if not got:
        break
    h.update(view[:got])
    n += got
    k += 1
print(json.dumps({"n": n, "sha": h.hexdigest()}), flush=True)
c.close()
"""


class Proc:
    """A script of this module in its own process, answering JSON lines."""

    def __init__(self, smcd: Smcd, script: str, *args: object) -> None:
        env = {
            **os.environ,
            "PYTHONPATH": os.fspath(REPO),
            "SMCD_HANDOFF_SOCKET": os.fspath(smcd.handoff),
        }
        self.proc = subprocess.Popen(
            [os.fspath(PYTHON), "-c", script, *map(str, args)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            cwd=REPO,
            text=True,
        )

    def line(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        raw = self.proc.stdout.readline()
        if not raw:
            err = self.proc.stderr.read() if self.proc.stderr else ""
            raise AssertionError(f"process exited ({self.proc.wait()}): {err}")
        result: dict[str, Any] = json.loads(raw)
        return result

    def tell(self, word: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(word + "\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if f is not None:
                f.close()


@pytest.fixture(scope="module")
def smcd(work: Path, e2e_bus: DbusDaemon) -> Iterator[Smcd]:
    """This module's daemon: no per-user quota, room for 2,000 DMBs in the pool."""
    notify = NotifySocket(work / "notify")
    daemon = Smcd(work, e2e_bus, notify)
    daemon.write_config(CONFIG)
    daemon.start()
    try:
        yield daemon
    finally:
        daemon.stop()
        notify.close()


def test_a_thousand_concurrent_channels(smcd: Smcd) -> None:
    before = smcd.fds()
    log_mark = len(smcd.log())
    server = Proc(smcd, SERVER, CHANNELS, DMB)
    client: Proc | None = None
    try:
        ready = server.line()
        assert ready["registered"], ready
        client = Proc(smcd, CLIENT, CHANNELS, DMB, ready["port"])
        connected = client.line()
        assert connected["modes"] == {"smcd": CHANNELS}, connected
        assert server.line() == {"accepted": CHANNELS, "modes": {"smcd": CHANNELS}}

        # The daemon stays responsive with 2,000 live halves and shows every one of them.
        t0 = time.monotonic()
        rows = smcd.wait_conns(
            lambda rows: (
                sum(r["Mode"] == "SMCD" and r["State"] == "ACTIVE" for r in rows) == 2 * CHANNELS
            ),
            timeout=30,
        )
        listing = time.monotonic() - t0
        ours = [r for r in rows if r["Mode"] == "SMCD"]
        assert {r["Role"] for r in ours} == {"CLIENT", "SERVER"}
        assert all(r["RmbeSize"] == DMB for r in ours)
        held = smcd.fds()
        # the daemon keeps the DMB memfds and one handoff socket per half (and the listener's),
        # no eventfd and no peer-link end
        # (exactly one memfd per DMB: the pool's; a socket may come and go, e.g. sd_notify's)
        assert held["memfd"] - before["memfd"] == 2 * CHANNELS and held["eventfd"] == 0, held
        assert 2 * CHANNELS <= held["socket"] - before["socket"] <= 2 * CHANNELS + 2, (before, held)

        client.tell("go")
        assert client.line() == {"verified": CHANNELS}
        assert server.line() == {"checked": CHANNELS}
        client.tell("close")
        assert client.line() == {"closed": CHANNELS}
        assert server.line() == {"eof": CHANNELS, "resets": 0}  # all clean closes
        assert client.proc.wait(30) == 0 and server.proc.wait(30) == 0

        # Every DMB is back in the pool (zeroed, cached for this uid), every descriptor but the
        # cached memfds is gone.
        in_use, in_use_bytes, cached = smcd.pool_report(log_mark)
        assert (in_use, in_use_bytes) == (0, 0)
        assert cached >= 2 * CHANNELS
        after = smcd.fds()
        assert after["eventfd"] == 0 and after["socket"] <= before["socket"], (before, after)
        assert after["memfd"] == cached, after  # the pool's memfds, nothing else
        assert smcd.alive()
        smcd.wait_conns(lambda rows: not any(r["Mode"] == "SMCD" for r in rows), timeout=10)
        print(
            f"1000 channels: connected in {connected['seconds']:.1f} s, "
            f"smcctl listed 2000 halves after {listing:.1f} s"
        )
    finally:
        if client is not None:
            client.close()
        server.close()


def test_over_a_gibibyte_of_odd_writes_through_a_daemon_channel(smcd: Smcd) -> None:
    receiver = Proc(smcd, BULK_RECEIVER)
    sender: Proc | None = None
    try:
        ready = receiver.line()
        assert ready["registered"], ready
        sender = Proc(smcd, BULK_SENDER, ready["port"], BULK_TOTAL)
        # (a fallback says why: both ends' reasons, and the daemon's log)
        modes = [sender.line(), receiver.line()]
        assert [m["mode"] for m in modes] == ["smcd", "smcd"], (modes, smcd.log()[-4000:])
        assert smcd.alive(), smcd.log()[-4000:]
        # both halves use the largest DMB: the ring (1 MiB - 32 bytes) wraps about 1,000 times
        smcd.wait_conns(
            lambda rows: sum(r["Mode"] == "SMCD" and r["RmbeSize"] == 1 << 20 for r in rows) == 2
        )
        sent = sender.line()
        got = receiver.line()
        assert sent["sent"] == BULK_TOTAL and sent["writes"] > 3000
        assert got == {"n": BULK_TOTAL, "sha": sent["sha"]}
        print(f"1 GiB+: {sent['seconds']:.1f} s, {BULK_TOTAL / sent['seconds'] / 1e9:.2f} GB/s")
    finally:
        if sender is not None:
            sender.close()
        receiver.close()
