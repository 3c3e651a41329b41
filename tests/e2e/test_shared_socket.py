"""Threads sharing one SMC socket, as they share a TCP socket.

TCP lets several threads send on one socket (each ``send`` is atomic, so whole messages of a
``sendall`` each stay whole when they fit) and several threads receive from it (each byte goes
to one of them). The channel's ring has one producer and one consumer cursor per direction, so
the socket layer gives one thread at a time its turn per direction. Before, two senders raced
on the cursors: the peer saw a consumer cursor ahead of anything sent and aborted (and bytes in
flight could land on top of each other), and two sleepers on one poll object raised
``RuntimeError: concurrent poll() invocation``.

The program runs unmodified under ``smc-run -v`` against a private smcd with no configuration.
"""

from __future__ import annotations

import ast
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from smcd_daemon.demo import PrivateSmcd

pytestmark = pytest.mark.timeout(180)

REPO = Path(__file__).resolve().parents[2]
SMC_RUN = REPO / ".venv" / "bin" / "smc-run"
PYTHON = REPO / ".venv" / "bin" / "python"

SHARED = r"""
import collections, hashlib, socket, struct, sys, threading
REC, PER, THREADS = 1024, 6000, 4
lsock = socket.create_server(("127.0.0.1", 0))
c = socket.create_connection(lsock.getsockname())
s, _ = lsock.accept()
print("modes", c.mode, s.mode, flush=True)
errors = []

def guarded(fn):
    def run(*args):
        try:
            fn(*args)
        except Exception as e:  # a thread's exception is the test's failure
            errors.append(repr(e))
    return run

@guarded
def writer(tid):  # records: thread, sequence, filler, MD5 of the rest
    for i in range(PER):
        body = struct.pack("!II", tid, i) + bytes([tid]) * (REC - 24)
        c.sendall(body + hashlib.md5(body).digest())

# Direction 1: four threads send records on one socket, one thread reads them.
got = bytearray()
@guarded
def collector():
    while len(got) < REC * PER * THREADS:
        data = s.recv(1 << 20)
        if not data:
            break
        got.extend(data)
threads = [threading.Thread(target=writer, args=(t,)) for t in range(THREADS)]
threads.append(threading.Thread(target=collector))
for t in threads:
    t.start()
for t in threads:
    t.join(120)
bad = disorder = 0
last = collections.defaultdict(lambda: -1)
for off in range(0, len(got), REC):
    rec = bytes(got[off:off + REC])
    if hashlib.md5(rec[:-16]).digest() != rec[-16:]:
        bad += 1
        continue
    tid, i = struct.unpack("!II", rec[:8])
    disorder += last[tid] + 1 != i
    last[tid] = i
print("records", len(got) // REC, "bad", bad, "disorder", disorder, flush=True)

# Direction 2: one thread sends a counted stream, three threads read it (recv, recv_into,
# makefile): together they get every byte once.
TOTAL = 64 << 20
chunk = bytes(range(256)) * 256
counts = collections.Counter()
lock = threading.Lock()
@guarded
def reader(kind):
    n, hist = 0, collections.Counter()
    buf = bytearray(70000)
    stream = s.makefile("rb", buffering=0) if kind == "makefile" else None
    while True:
        if kind == "recv":
            data = s.recv(65536)
        elif kind == "recv_into":
            data = buf[:s.recv_into(buf)]
        else:
            data = stream.read(50000)
        if not data:
            break
        n += len(data)
        hist.update(data)
    with lock:
        counts.update(hist)
        counts["n"] += n
readers = [threading.Thread(target=reader, args=(k,)) for k in ("recv", "recv_into", "makefile")]
for t in readers:
    t.start()
for _ in range(TOTAL // len(chunk)):
    c.sendall(chunk)
c.shutdown(socket.SHUT_WR)
for t in readers:
    t.join(120)
even = all(counts[b] == TOTAL // 256 for b in range(256))
print("bytes", counts["n"], "each value", "even" if even else "uneven", flush=True)
print("errors", errors, flush=True)
"""


@pytest.fixture(scope="module")
def nocfg() -> Iterator[PrivateSmcd]:
    daemon = PrivateSmcd(config_text="", name="shared")
    try:
        daemon.start()
        yield daemon
    finally:
        daemon.cleanup()


def _run(daemon: PrivateSmcd, code: str, *options: str) -> subprocess.CompletedProcess[str]:
    """``code`` under ``smc-run OPTIONS`` against ``daemon``, unmodified."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SMCD_", "SMC_RUN"))}
    env = {**env, **daemon.env, "PYTHONPATH": os.fspath(REPO)}
    argv = [os.fspath(SMC_RUN), *options, os.fspath(PYTHON), "-c", code]
    return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=170)


def test_threads_sharing_a_socket_send_and_receive_every_byte_once(nocfg: PrivateSmcd) -> None:
    proc = _run(nocfg, SHARED, "-v")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == [
        "modes smcd smcd",
        "records 24000 bad 0 disorder 0",
        f"bytes {64 << 20} each value even",
        "errors []",
    ], proc.stderr[-3000:]


CLOSE_RACE = r"""
import collections, random, socket, threading, time
lsock = socket.create_server(("127.0.0.1", 0))
port = lsock.getsockname()[1]
ends = collections.Counter()
for rnd in range(120):
    sending = rnd % 2 == 0
    c = socket.create_connection(("127.0.0.1", port))
    s, _ = lsock.accept()
    assert c.mode == "smcd", c.fallback
    def peer():  # keeps the other side busy: draining c's sends, or feeding c's reads
        try:
            while (s.recv(1 << 16) if sending else s.send(b"y" * 1000)):
                pass
        except OSError:
            pass
    def hammer():
        try:
            while True:
                c.send(b"x" * 100) if sending else c.recv(100)
        except Exception as e:
            ends[type(e).__name__] += 1
    threads = [threading.Thread(target=peer), threading.Thread(target=hammer)]
    for t in threads:
        t.start()
    time.sleep(random.random() * 0.01)
    c.close()  # under the hammering thread
    threads[1].join(10)
    s.close()
    threads[0].join(10)
print(sorted(ends.items()), sum(ends.values()), flush=True)
"""


def test_a_socket_closed_under_a_busy_thread_ends_its_calls_with_oserror(
    nocfg: PrivateSmcd,
) -> None:
    """One thread sends (or receives) in a loop while another closes the socket: the loop's
    call ends with an ``OSError`` (EBADF, or the reset of an abort when data was unread), as on
    a closed TCP socket. Before, about half the rounds ended with a ``ValueError`` from the
    channel's released memory views, which a thread catching ``OSError`` dies of."""
    proc = _run(nocfg, CLOSE_RACE)
    assert proc.returncode == 0, proc.stderr[-3000:]
    kinds, total = proc.stdout.rsplit("]", 1)
    assert int(total) == 120, proc.stdout
    names = {name for name, _ in ast.literal_eval(kinds + "]")}
    assert names <= {"OSError", "ConnectionResetError", "BrokenPipeError"}, proc.stdout


SHUT_RD_WAKE = r"""
import socket, threading, time
lsock = socket.create_server(("127.0.0.1", 0))
c = socket.create_connection(lsock.getsockname())
s, _ = lsock.accept()
assert c.mode == "smcd", c.fallback
ends = {}
def writer():  # the peer never reads: this sleeper holds the peer link
    try:
        c.sendall(bytes(64 << 20))
    except OSError as e:
        ends["writer"] = type(e).__name__
def reader():  # the second sleeper: the eventfd
    t0 = time.monotonic()
    ends["reader"] = (c.recv(10), time.monotonic() - t0)
w = threading.Thread(target=writer)
w.start()
time.sleep(0.3)
r = threading.Thread(target=reader)
r.start()
time.sleep(0.3)
t0 = time.monotonic()
c.shutdown(socket.SHUT_RD)
r.join(5)
print("reader", ends["reader"][0], "fast" if time.monotonic() - t0 < 0.5 else "slow", flush=True)
c.close()
w.join(5)
print("writer", ends.get("writer"), flush=True)
"""


def test_shut_rd_wakes_a_reader_sleeping_beside_a_blocked_writer_at_once(
    nocfg: PrivateSmcd,
) -> None:
    """A writer blocked on a full ring sleeps on the peer link; a reader blocked beside it
    sleeps on the eventfd, which ``shutdown(SHUT_RD)`` kicks: the reader returns ``b""`` at
    once, not at its next look a second later."""
    proc = _run(nocfg, SHUT_RD_WAKE)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout == "reader b'' fast\nwriter OSError\n", proc.stderr[-3000:]
