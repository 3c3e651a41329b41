"""The measurements, each over one kind of stream (see ``_pairs``); sizes are fixed by the
caller, so a run is deterministic in what it moves and differs only in how long it takes.

Every measurement warms up on the very connection (or, for connection setup, the very
listener) it then times: first-touch page faults of the buffers, the ring pages of a fresh DMB,
the daemon's first handoff of a kind, and CPython's own caches are paid before the clock starts.
"""

from __future__ import annotations

import os
import socket
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

from _pairs import Dialer, Listener, run_pair

RECV_BUF = 1 << 20
BULK_DMB = 1 << 20
"""The receive buffer a bulk transfer asks smcd for (as it would set a large SO_RCVBUF)."""


def _recv_exactly(sock: socket.socket, view: memoryview) -> None:
    # The whole message in one call is the common case: no slice (a new memoryview) for it,
    # so the harness adds as little as it can to a round trip of a few microseconds.
    got, n = sock.recv_into(view), len(view)
    while got < n:
        if not got:
            raise ConnectionError(f"early EOF after {got} of {n} bytes")
        k = sock.recv_into(view[got:])
        if not k:
            raise ConnectionError(f"early EOF after {got} of {n} bytes")
        got += k


def _drain(sock: socket.socket, n: int, buf: memoryview) -> None:
    left = n
    while left:
        k = sock.recv_into(buf[: min(left, len(buf))])
        if not k:
            raise ConnectionError(f"early EOF with {left} of {n} bytes missing")
        left -= k


def throughput(kind: str, write_size: int, total: int, warmup: int) -> float:
    """Bytes per second, parent → child, in ``write_size`` writes (``sendall``); the clock runs
    from the first timed write to the reader's 1-byte acknowledgement of the last byte. smcd
    gets 1 MiB DMBs (:data:`BULK_DMB`); TCP and Unix sockets keep the kernel's autotuning."""
    total -= total % write_size
    warmup -= warmup % write_size

    def client(d: Dialer) -> float:
        with d.dial() as sock:
            chunk = memoryview(os.urandom(write_size))
            ack = memoryview(bytearray(1))
            for _ in range(warmup // write_size):
                sock.sendall(chunk)
            _recv_exactly(sock, ack)
            t0 = time.perf_counter()
            for _ in range(total // write_size):
                sock.sendall(chunk)
            _recv_exactly(sock, ack)
            return total / (time.perf_counter() - t0)

    def server(lst: Listener) -> None:
        with lst.accept() as conn:
            buf = memoryview(bytearray(RECV_BUF))
            _drain(conn, warmup, buf)
            conn.sendall(b"w")
            _drain(conn, total, buf)
            conn.sendall(b"k")
            conn.recv(1)  # EOF

    return run_pair(kind, client, server, dmb_size=BULK_DMB)


def pingpong(kind: str, size: int, rounds: int, warmup: int) -> tuple[float, float]:
    """Round-trip time p50 and p99 in microseconds: ``size`` bytes out, the same echoed back."""

    def client(d: Dialer) -> tuple[float, float]:
        with d.dial() as sock:
            msg = memoryview(b"p" * size)
            buf = memoryview(bytearray(size))
            clock = time.perf_counter_ns
            rtts = [0] * rounds
            for i in range(-warmup, rounds):
                t0 = clock()
                sock.sendall(msg)
                _recv_exactly(sock, buf)
                if i >= 0:
                    rtts[i] = clock() - t0
            return _pct(rtts, 50) / 1e3, _pct(rtts, 99) / 1e3

    def server(lst: Listener) -> None:
        with lst.accept() as conn:
            buf = memoryview(bytearray(size))
            for _ in range(warmup + rounds):
                _recv_exactly(conn, buf)
                conn.sendall(buf)
            conn.recv(1)

    return run_pair(kind, client, server)


@dataclass
class Setup:
    """Connection setup as an application sees it, one connection at a time."""

    connect_p50_us: float
    connect_p99_us: float
    """Transport connect (+ for smcd: handoff and CLC handshake) until the socket is usable."""
    handoff_p50_us: float
    handoff_p99_us: float
    """smcd only: ``smc_handoff.wrap`` of the connected TCP socket (0 for the baselines)."""
    rate: float
    """Complete connections per second: connect (+ handoff), a 1-byte echo, close."""


def _one(d: Dialer) -> tuple[int, int]:
    """One complete connection; (setup ns, of which handoff ns)."""
    sock, t_connect, t_handoff = d.dial_timed()
    with sock:
        sock.sendall(b"x")
        if sock.recv(1) != b"x":
            raise ConnectionError("no echo")
    return t_connect + t_handoff, t_handoff


def _serve(lst: Listener, n: int) -> None:
    resets = 0
    for _ in range(n):
        with lst.accept() as conn:
            conn.sendall(conn.recv(1))
            try:
                conn.recv(1)  # EOF: the client closed first
            except ConnectionResetError:
                resets += 1  # not ours to judge here; said on stderr, the figures still count
    if resets:
        print(
            f"bench: {resets} of {n} {lst.kind} connections ended in ECONNRESET instead of EOF",
            file=sys.stderr,
        )


def setup(kind: str, count: int, warmup: int) -> Setup:
    """``count`` timed connections, one after the other, after ``warmup`` untimed ones."""

    def client(d: Dialer) -> Setup:
        for _ in range(warmup):
            _one(d)
        t0 = time.perf_counter()
        samples = [_one(d) for _ in range(count)]
        elapsed = time.perf_counter() - t0
        total = [s[0] for s in samples]
        handoff = [s[1] for s in samples]
        return Setup(
            _pct(total, 50) / 1e3,
            _pct(total, 99) / 1e3,
            _pct(handoff, 50) / 1e3,
            _pct(handoff, 99) / 1e3,
            count / elapsed,
        )

    return run_pair(kind, client, lambda lst: _serve(lst, warmup + count))


def _fork_all(n: int, fn: Callable[[int], None]) -> list[int]:
    pids = []
    for i in range(n):
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                fn(i)
            except BaseException:
                traceback.print_exc()
                code = 1
            os._exit(code)
        pids.append(pid)
    return pids


def _wait_all(pids: list[int], what: str) -> None:
    failed = 0
    for pid in pids:
        _, status = os.waitpid(pid, 0)
        failed += os.waitstatus_to_exitcode(status) != 0
    if failed:
        raise RuntimeError(f"{failed} of {len(pids)} {what} processes failed")


def setup_rate(kind: str, count: int, warmup: int, procs: int) -> float:
    """Connections per second with ``procs`` client processes connecting at once to as many
    server processes accepting on one listener (what a busy host asks of the daemon)."""
    per = count // procs
    count = per * procs

    def client(d: Dialer) -> float:
        for _ in range(warmup):
            _one(d)
        go_r, go_w = os.pipe()

        def worker(_i: int) -> None:
            os.close(go_w)
            os.read(go_r, 1)  # start together
            for _ in range(per):
                _one(d)

        pids = _fork_all(procs, worker)
        os.close(go_r)
        time.sleep(0.05)  # let them reach the gate
        t0 = time.perf_counter()
        os.close(go_w)  # EOF opens the gate for all
        _wait_all(pids, f"{kind} client")
        return count / (time.perf_counter() - t0)

    def server(lst: Listener) -> None:
        _serve(lst, warmup)
        _wait_all(_fork_all(procs, lambda _i: _serve(lst, per)), f"{kind} server")

    return run_pair(kind, client, server)


def _pct(values: list[int], p: int) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, -(-p * len(ordered) // 100) - 1))
    return float(ordered[rank])
