"""The processes of the soak (tests/soak/soak.py): echo servers, checking clients, the flooder.

Every connection carries one message each way: a 4-byte length, that many random bytes and
their SHA-256. The server checks what it got and echoes it; the client checks the echo against
what it sent. A stream is *corrupted* when the bytes differ or begin with a CLC eyecatcher (the
daemon's protocol bytes read as data). Every socket has a timeout, so no wait is unbounded here;
the soak's parent kills a client whose connection outlives the hang limit and counts it.

Workers send their tallies as ``{key: count}`` on a queue; a key is
``"role|phase|mode|reason|outcome"``.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
import struct
import threading
import time
from collections import Counter
from typing import Any

EYECATCHERS = (b"\xe2\xd4\xc3\xd9", b"\xe2\xd4\xc3\xc4")
"""CLC eyecatchers (EBCDIC "SMCR" / "SMCD"): a stream starting with one carries CLC bytes."""
IO_TIMEOUT = 10.0
"""Each socket operation of a worker; a connection is bounded by the handoff timeout plus a few
of these, far below the hang limit of the parent."""
HANG_S = 45.0
"""A connection still going after this long is hung: its legitimate worst case is the handoff
timeout (10 s) plus the three socket waits of :data:`IO_TIMEOUT` (connect, send, receive)."""
MAX_PAYLOAD = 300_000
PHASES = ("warmup", "chaos", "settle", "flood", "post")
FLUSH_S = 0.5


def _recv_exact(sock: Any, n: int) -> bytes:
    """Up to ``n`` bytes: fewer only at EOF."""
    parts = []
    got = 0
    while got < n:
        piece = sock.recv(min(n - got, 262144))
        if not piece:
            break
        parts.append(piece)
        got += len(piece)
    return b"".join(parts)


def _describe(sock: Any) -> tuple[str, str]:
    fallback = sock.fallback
    return sock.mode, "-" if fallback is None else fallback.name


def quiet(path: str) -> None:
    """Send this worker's stderr (the library's warnings) to ``path``: the soak counts them."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 2)
    os.close(fd)


def _clc(data: bytes) -> bool:
    return data[:4] in EYECATCHERS


class Tally:
    """Counts of one worker, flushed to the parent's queue at most every :data:`FLUSH_S`."""

    def __init__(self, queue: Any) -> None:
        self.queue = queue
        self.counts: Counter[str] = Counter()
        self.examples: list[str] = []
        self.lock = threading.Lock()
        self.last = time.monotonic()

    def add(
        self, role: str, phase: str, mode: str, reason: str, outcome: str, note: str = ""
    ) -> None:
        with self.lock:
            self.counts[f"{role}|{phase}|{mode}|{reason}|{outcome}"] += 1
            if note and len(self.examples) < 5:
                self.examples.append(note)
        if time.monotonic() - self.last > FLUSH_S:
            self.flush()

    def flush(self) -> None:
        with self.lock:
            if self.counts or self.examples:
                self.queue.put(("tally", dict(self.counts), list(self.examples)))
                self.counts.clear()
                self.examples.clear()
            self.last = time.monotonic()


# --------------------------------------------------------------------------------- server


def server_main(
    slot: int, ports: Any, phase: Any, stop: Any, queue: Any, stderr: str, accept_threads: int = 4
) -> None:
    """An echo server: a registered smc_handoff listener, accept threads and a thread per
    connection. Its port goes into ``ports[slot]``."""
    quiet(stderr)
    import smc_handoff

    srv = smc_handoff.listen(("127.0.0.1", 0), backlog=1024)
    srv.settimeout(0.5)
    ports[slot] = srv.getsockname()[1]
    tally = Tally(queue)
    active: dict[int, float] = {}
    active_lock = threading.Lock()
    hung_reported: set[int] = set()

    def handle(conn: Any, ph: str) -> None:
        key = id(conn)
        with active_lock:
            active[key] = time.monotonic()
        mode, reason = "tcp", "-"
        try:
            mode, reason = _describe(conn)
            conn.settimeout(IO_TIMEOUT)
            head = _recv_exact(conn, 4)
            if _clc(head):
                tally.add("server", ph, mode, reason, "corrupt: CLC bytes as data", head.hex())
                return
            if len(head) < 4:
                tally.add("server", ph, mode, reason, "error: EOF before the message")
                return
            (n,) = struct.unpack("!I", head)
            if n > MAX_PAYLOAD:
                tally.add("server", ph, mode, reason, "corrupt: bad length", head.hex())
                return
            body = _recv_exact(conn, n + 32)
            if len(body) < n + 32:
                tally.add("server", ph, mode, reason, "error: EOF inside the message")
                return
            if hashlib.sha256(body[:n]).digest() != body[n:]:
                tally.add("server", ph, mode, reason, "corrupt: checksum", body[:32].hex())
                return
            conn.sendall(head + body)
            rest = conn.recv(1)  # the client closes after reading the echo
            if rest:
                tally.add("server", ph, mode, reason, "corrupt: bytes after the message")
                return
            tally.add("server", ph, mode, reason, "ok")
        except OSError as e:
            tally.add("server", ph, mode, reason, f"error: {type(e).__name__}")
        finally:
            with active_lock:
                active.pop(key, None)
            with contextlib.suppress(OSError):
                conn.close()

    def accept_loop() -> None:
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except TimeoutError:
                continue
            except OSError as e:
                tally.add("server", PHASES[phase.value], "none", "-", f"accept {type(e).__name__}")
                time.sleep(0.05)
                continue
            threading.Thread(target=handle, args=(conn, PHASES[phase.value]), daemon=True).start()

    threads = [threading.Thread(target=accept_loop, daemon=True) for _ in range(accept_threads)]
    for t in threads:
        t.start()
    while not stop.is_set():
        time.sleep(0.5)
        now = time.monotonic()
        with active_lock:
            late = [k for k, t0 in active.items() if now - t0 > HANG_S and k not in hung_reported]
        for k in late:
            hung_reported.add(k)
            tally.add("server", PHASES[phase.value], "?", "-", "hung")
        tally.flush()
    for t in threads:
        t.join(2)
    deadline = time.monotonic() + 3 * IO_TIMEOUT
    while time.monotonic() < deadline:
        with active_lock:
            if not active:
                break
        time.sleep(0.1)
    with active_lock:
        for k in active:
            if k not in hung_reported:
                tally.add("server", PHASES[phase.value], "?", "-", "hung")
    tally.flush()
    srv.close()


# --------------------------------------------------------------------------------- client


def client_main(
    slot: int,
    seed: int,
    ports: Any,
    phase: Any,
    pause: Any,
    stop: Any,
    beats: Any,
    queue: Any,
    stderr: str,
) -> None:
    """Connect / send / check the echo / close, in a loop, to random servers. ``beats[slot]``
    holds the start time of the connection in progress (0 between connections)."""
    quiet(stderr)
    import smc_handoff

    rng = random.Random(seed)
    tally = Tally(queue)
    while not stop.is_set():
        beats[slot] = time.time()
        if pause.is_set():
            beats[slot] = 0.0
            time.sleep(0.05)
            continue
        ph = PHASES[phase.value]
        live = [p for p in ports if p]
        if not live:
            beats[slot] = 0.0
            time.sleep(0.1)
            continue
        one_connection(rng, rng.choice(live), ph, tally, smc_handoff)
        beats[slot] = 0.0
    tally.flush()


def one_connection(rng: random.Random, port: int, ph: str, tally: Tally, lib: Any) -> None:
    n = rng.choice((1, 100, 4096, 65536, rng.randrange(1, MAX_PAYLOAD)))
    payload = rng.randbytes(n)
    message = struct.pack("!I", n) + payload + hashlib.sha256(payload).digest()
    try:
        sock = lib.connect(("127.0.0.1", port), timeout=IO_TIMEOUT)
    except OSError as e:
        tally.add("client", ph, "none", "-", f"connect {type(e).__name__}")
        return
    mode, reason = "tcp", "-"
    got = b""
    try:
        mode, reason = _describe(sock)
        sock.sendall(message)
        got = _recv_exact(sock, len(message))
        if _clc(got):
            tally.add("client", ph, mode, reason, "corrupt: CLC bytes as data", got[:64].hex())
        elif got == message:
            tally.add("client", ph, mode, reason, "ok")
        elif len(got) < len(message) and message.startswith(got):
            tally.add("client", ph, mode, reason, "error: EOF before the whole echo")
        else:
            tally.add("client", ph, mode, reason, "corrupt: echo differs", got[:64].hex())
    except OSError as e:
        if _clc(got):
            tally.add("client", ph, mode, reason, "corrupt: CLC bytes as data", got[:64].hex())
        else:
            tally.add("client", ph, mode, reason, f"error: {type(e).__name__}")
    finally:
        with contextlib.suppress(OSError):
            sock.close()


# -------------------------------------------------------------------------------- flooder

FLOODER = r"""
import os, resource, select, socket, sys, time
path, target = sys.argv[1], int(sys.argv[2])
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
conns = {}
poll = select.poll()
poll.register(sys.stdin.fileno(), select.POLLIN | select.POLLHUP)
peak = refused = dropped = 0
last = 0.0
while True:
    while len(conns) < target:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.setblocking(False)
        try:
            s.connect(path)
        except BlockingIOError:
            s.close()
            break
        except OSError:
            s.close()
            refused += 1
            break
        conns[s.fileno()] = s
        poll.register(s, select.POLLIN | select.POLLHUP)
    peak = max(peak, len(conns))
    for fd, ev in poll.poll(20):
        if fd == sys.stdin.fileno():
            print(f"held {len(conns)} peak {peak} dropped {dropped} refused {refused}", flush=True)
            sys.exit(0)
        s = conns.pop(fd, None)
        if s is not None:
            poll.unregister(fd)
            s.close()
            dropped += 1
    now = time.monotonic()
    if now - last > 0.5:
        last = now
        print(f"held {len(conns)} peak {peak} dropped {dropped} refused {refused}", flush=True)
"""
"""Run as another uid (stdlib only, ``python3 -c``): holds up to ``target`` idle handoff
connections, replaces those the daemon drops, and exits when its stdin closes."""
