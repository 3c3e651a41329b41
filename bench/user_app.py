"""The application of ``make bench``'s user view: an ordinary program on plain ``socket`` (stdlib
only, nothing of smcd), run as it is for the TCP figures and under ``smc-run`` for the SMC ones.

    python bench/user_app.py SERVER-OR-CLIENT ARGS...

Servers listen on 127.0.0.1 port 0 and print ``PORT n`` once ``listen()`` returned (under
smc-run: once the listener is registered with smcd), then serve; clients print one JSON line of
figures last. Nothing here knows about SMC: which transport a connection got is what ``smc-run
-v`` says on stderr, read by the harness (``bench/userview.py``).

Servers:
  sink WARMUP TOTAL RECV [STRIDE]  one connection: read WARMUP bytes, ack, read TOTAL, ack, EOF;
                                   with STRIDE > 0 it checks every STRIDE-th byte of each read
                                   against the sender's pattern (the light per-chunk work)
  echo PROCS                       PROCS processes accept and echo each connection until EOF
                                   (runs until killed)
  tlsecho                          echo over TLS (``ssl`` wrapping what it accepts; the
                                   certificate and key in $USER_APP_TLS_CERT/_KEY)
  tlssink WARMUP TOTAL RECV        sink over TLS (no check)
  hold N                           accept N connections, print ``HELD``, keep them open, exit
                                   at their EOF
Clients:
  send PORT WARMUP TOTAL WRITE     WRITE-byte sendall()s; bytes/s from the first timed write to
                                   the sink's ack
  rr PORT SIZE ROUNDS WARMUP       SIZE bytes out, SIZE bytes back; round-trip p50/p99 in us
  tlsrr PORT SIZE ROUNDS WARMUP    the same over TLS (``ssl`` wrapping the connection)
  tlssend PORT WARMUP TOTAL WRITE  send over TLS
  conns PORT N WARMUP PROCS        N connections (connect, 1-byte echo, close) from PROCS
                                   processes; connections/s, the setup p50 in us (connect
                                   and the first sendall()) and the client processes' CPU
                                   per connection in us
  open PORT N                      open N connections, print ``OPEN``, wait for stdin EOF
  bound TOTAL RECV STRIDE          the sink's loop reading from memory: its own bound in bytes/s
"""

from __future__ import annotations

import json
import os
import socket
import ssl
import sys
import time

PERIOD = 256
"""The stream's byte at position p is p % 256, so any 64 KiB write is the same bytes."""
INV = {65: 193, 257: 1}
"""Multiplicative inverses mod 256 of the supported strides (for the check's start index)."""


def pattern(n: int) -> bytes:
    return bytes(range(PERIOD)) * (n // PERIOD)


BIND = os.environ.get("USER_APP_BIND", "127.0.0.1")
PEER = os.environ.get("USER_APP_PEER", "127.0.0.1")
"""Where servers listen and clients connect (bench/netns_bridge.py: two network namespaces)."""


def listen() -> socket.socket:
    lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    lsock.bind((BIND, 0))
    lsock.listen(512)
    print(f"PORT {lsock.getsockname()[1]}", flush=True)
    return lsock


def connect(port: int) -> socket.socket:
    sock = socket.create_connection((PEER, port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def recv_exactly(sock: socket.socket, view: memoryview) -> None:
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:] if got else view)  # the whole message: no slice
        if not k:
            raise ConnectionError(f"early EOF after {got} of {n} bytes")
        got += k


class Reader:
    """The sink's loop, the same whether it reads a socket or memory: read into one buffer and,
    with a stride, compare every stride-th byte with the pattern (a slice and a compare)."""

    def __init__(self, recv_size: int, stride: int) -> None:
        self.buf = bytearray(recv_size)
        self.view = memoryview(self.buf)
        self.stride = stride
        self.pos = 0
        if stride:
            if stride not in INV:
                raise SystemExit(f"stride must be one of {sorted(INV)}")
            # expected sample j from a start value v: (v + stride*j) % 256
            k = recv_size // stride + 1
            self.table = bytes((stride * j) % PERIOD for j in range(k + PERIOD))
            self.inv = INV[stride]

    def take(self, recv_into: object, n: int) -> None:
        recv = recv_into  # a bound method: sock.recv_into or the memory reader
        view, buf, stride = self.view, self.buf, self.stride
        left = n
        while left:
            k = recv(view[: min(left, len(view))])  # type: ignore[operator]
            if not k:
                raise ConnectionError(f"early EOF with {left} of {n} bytes missing")
            if stride:
                sample = buf[0:k:stride]
                j0 = ((self.pos % PERIOD) * self.inv) % PERIOD
                if sample != self.table[j0 : j0 + len(sample)]:
                    raise ValueError(f"data differ from the pattern near stream byte {self.pos}")
            self.pos += k
            left -= k


def sink(warmup: int, total: int, recv_size: int, stride: int = 0, tls: bool = False) -> None:
    lsock = listen()
    conn, _ = lsock.accept()
    if tls:
        conn = _tls(server=True).wrap_socket(conn, server_side=True)
    reader = Reader(recv_size, stride)
    reader.take(conn.recv_into, warmup)
    conn.sendall(b"w")
    reader.take(conn.recv_into, total)
    conn.sendall(b"k")
    conn.recv(1)
    conn.close()


def send(port: int, warmup: int, total: int, write: int, tls: bool = False) -> None:
    sock = connect(port)
    if tls:
        sock = _tls(server=False).wrap_socket(sock)
    chunk = memoryview(pattern(write))
    ack = memoryview(bytearray(1))
    for _ in range(warmup // write):
        sock.sendall(chunk)
    recv_exactly(sock, ack)
    t0 = time.perf_counter()
    for _ in range(total // write):
        sock.sendall(chunk)
    recv_exactly(sock, ack)
    rate = total / (time.perf_counter() - t0)
    sock.close()
    print(json.dumps({"bytes_per_s": rate}))


def bound(total: int, recv_size: int, stride: int) -> None:
    """The sink reading ``total`` bytes from memory (a copy per read, as recv_into does)."""
    src = memoryview(pattern(recv_size + PERIOD))
    reader = Reader(recv_size, stride)

    def from_memory(view: memoryview) -> int:
        off = reader.pos % PERIOD
        n = len(view)
        view[:] = src[off : off + n]
        return n

    reader.take(from_memory, recv_size)  # warm-up: first touch of the buffers
    reader.pos = 0
    t0 = time.perf_counter()
    reader.take(from_memory, total)
    print(json.dumps({"bytes_per_s": total / (time.perf_counter() - t0)}))


def _serve(lsock: socket.socket) -> None:
    buf = bytearray(1 << 16)
    view = memoryview(buf)
    while True:
        conn, _ = lsock.accept()
        try:
            while n := conn.recv_into(view):
                conn.sendall(view[:n])
        except OSError as e:
            print(f"echo: {e}", file=sys.stderr)
        conn.close()


def echo(procs: int) -> None:
    lsock = listen()
    for _ in range(procs - 1):
        if os.fork() == 0:
            break
    _serve(lsock)


def _tls(server: bool) -> ssl.SSLContext:
    cert = os.environ["USER_APP_TLS_CERT"]
    if server:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(cert, os.environ["USER_APP_TLS_KEY"])
        return ctx
    ctx = ssl.create_default_context(cafile=cert)
    ctx.check_hostname = False
    return ctx


def tlsecho() -> None:
    lsock = listen()
    ctx = _tls(server=True)
    view = memoryview(bytearray(1 << 16))
    while True:
        conn, _ = lsock.accept()
        try:
            with ctx.wrap_socket(conn, server_side=True) as tls:
                while n := tls.recv_into(view):
                    tls.sendall(view[:n])
        except OSError as e:
            print(f"tlsecho: {e}", file=sys.stderr)


def hold(n: int) -> None:
    lsock = listen()
    conns = [lsock.accept()[0] for _ in range(n)]
    print("HELD", flush=True)
    for conn in conns:
        conn.recv(1)
        conn.close()


def _pct(values: list[int], p: int) -> float:
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, -(-p * len(ordered) // 100) - 1))
    return float(ordered[rank])


def tlsrr(port: int, size: int, rounds: int, warmup: int) -> None:
    rr(port, size, rounds, warmup, tls=True)


def tlssink(warmup: int, total: int, recv_size: int) -> None:
    sink(warmup, total, recv_size, tls=True)


def tlssend(port: int, warmup: int, total: int, write: int) -> None:
    send(port, warmup, total, write, tls=True)


def rr(port: int, size: int, rounds: int, warmup: int, tls: bool = False) -> None:
    sock = connect(port)
    if tls:
        sock = _tls(server=False).wrap_socket(sock)
    msg = memoryview(pattern(max(size, PERIOD))[:size])
    buf = memoryview(bytearray(size))
    clock = time.perf_counter_ns
    rtts = [0] * rounds
    for i in range(-warmup, rounds):
        t0 = clock()
        sock.sendall(msg)
        recv_exactly(sock, buf)
        if i >= 0:
            rtts[i] = clock() - t0
    if buf != msg:
        raise ValueError("the echo differs from the message")
    sock.close()
    print(json.dumps({"p50_us": _pct(rtts, 50) / 1e3, "p99_us": _pct(rtts, 99) / 1e3}))


def _one(port: int, times: list[int]) -> None:
    # Setup ends once the first byte is sent: smc-run's connect() returns before smcd's reply,
    # which the first send() waits for (a program that connects and accepts in one thread).
    t0 = time.perf_counter_ns()
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(b"x")
    times.append(time.perf_counter_ns() - t0)
    if sock.recv(1) != b"x":
        raise ConnectionError("no echo")
    sock.close()


def conns(port: int, n: int, warmup: int, procs: int) -> None:
    times: list[int] = []
    for _ in range(warmup):
        _one(port, times)
    per = n // procs
    rd, wr = os.pipe()
    out_r, out_w = os.pipe()
    pids = []
    for _ in range(procs):
        pid = os.fork()
        if pid == 0:
            os.close(wr)
            os.read(rd, 1)  # start together
            mine: list[int] = []
            cpu = time.process_time_ns()
            for _ in range(per):
                _one(port, mine)
            cpu = time.process_time_ns() - cpu  # this process's CPU for its connections
            os.write(out_w, json.dumps([cpu, mine]).encode() + b"\n")
            os._exit(0)
        pids.append(pid)
    os.close(rd)
    os.close(out_w)
    time.sleep(0.05)
    t0 = time.perf_counter()
    os.close(wr)
    failed = sum(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) != 0 for pid in pids)
    elapsed = time.perf_counter() - t0
    with os.fdopen(out_r) as f:
        reports = [json.loads(line) for line in f]
    if failed:
        raise SystemExit(f"{failed} of {procs} client processes failed")
    samples = [t for _, mine in reports for t in mine]
    cpu_us = sum(cpu for cpu, _ in reports) / (per * procs) / 1e3
    print(json.dumps({"rate": per * procs / elapsed, "connect_p50_us": _pct(samples, 50) / 1e3,
                      "cpu_us": cpu_us}))  # fmt: skip


def open_many(port: int, n: int) -> None:
    socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(n)]
    print("OPEN", flush=True)
    sys.stdin.read()
    for sock in socks:
        sock.close()
    print(json.dumps({"opened": len(socks)}))


COMMANDS = {
    "sink": sink,
    "send": send,
    "bound": bound,
    "echo": echo,
    "tlsecho": tlsecho,
    "hold": hold,
    "rr": rr,
    "tlsrr": tlsrr,
    "tlssink": tlssink,
    "tlssend": tlssend,
    "conns": conns,
    "open": open_many,
}

if __name__ == "__main__":
    cmd, *args = sys.argv[1:]
    COMMANDS[cmd](*map(int, args))
