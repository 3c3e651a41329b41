"""Raw data-path benchmark: the SMC-D shared-memory channel vs TCP loopback vs Unix stream
sockets, between two Python processes (no daemon, no handoff: just the bytes).

    .venv/bin/python bench/channel_bench.py [--quick] [--busy] [--json]

Prints throughput at 64 KiB and 1 MiB writes and ping-pong RTT p50/p99 at 1 B and 1 KiB, each
with its ratio to TCP loopback. ``--busy`` adds a CPU-burning third process (``while True:
pass``), to see that the spin/sleep policy keeps working when the cores are contended.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from smc_handoff.channel import Channel, make_pair

DMB_SIZE = 1 << 20
RECV_BUF = 1 << 20


class ChannelEnd:
    """Blocking sendall/recv_into over a Channel, as ``SmcSocket`` wraps it (fast paths first:
    ``send_fast``/``recv_fast``, a spin, then the general calls and waits)."""

    def __init__(self, ch: Channel) -> None:
        self.ch = ch

    def sendall(self, mv: memoryview) -> None:
        ch = self.ch
        if ch.send_fast(mv):
            return
        while mv:
            n = ch.send_into(mv)
            if n:
                mv = mv[n:]
            else:
                ch.wait_writable()

    def recv_into(self, buf: memoryview) -> int:
        ch = self.ch
        n = ch.recv_fast(buf)
        if n:
            return n
        if ch.spin_readable():
            n = ch.recv_fast(buf)
            if n:
                return n
        while True:
            n = ch.recv_into(buf)
            if n or ch.eof:
                return n
            ch.wait_readable()

    def close(self) -> None:
        self.ch.close()


class SockEnd:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.sendall = sock.sendall
        self.recv_into = sock.recv_into

    def close(self) -> None:
        self.sock.close()


def make_ends(kind: str) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """Return factories (parent_end, child_end); each called in its own process after fork."""
    if kind == "smcd":
        fa, fb = make_pair(DMB_SIZE, DMB_SIZE)

        def parent() -> ChannelEnd:
            fb.close()
            return ChannelEnd(Channel.from_fds(fa))

        def child() -> ChannelEnd:
            fa.close()
            return ChannelEnd(Channel.from_fds(fb))

        return parent, child
    if kind == "unix":
        sa, sb = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)

        def uparent() -> SockEnd:
            sb.close()
            return SockEnd(sa)

        def uchild() -> SockEnd:
            sa.close()
            return SockEnd(sb)

        return uparent, uchild
    if kind == "tcp":
        lsock = socket.create_server(("127.0.0.1", 0))
        port = lsock.getsockname()[1]
        ca = socket.create_connection(("127.0.0.1", port))
        cb, _ = lsock.accept()
        lsock.close()
        for s in (ca, cb):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def tparent() -> SockEnd:
            cb.close()
            return SockEnd(ca)

        def tchild() -> SockEnd:
            ca.close()
            return SockEnd(cb)

        return tparent, tchild
    raise ValueError(kind)


def run_pair(kind: str, parent_fn: Callable[[Any], Any], child_fn: Callable[[Any], None]) -> Any:
    parent_end, child_end = make_ends(kind)
    pid = os.fork()
    if pid == 0:  # child
        code = 0
        try:
            end = child_end()
            child_fn(end)
            end.close()
        except BaseException:
            import traceback

            traceback.print_exc()
            code = 1
        os._exit(code)
    end = parent_end()
    try:
        return parent_fn(end)
    finally:
        end.close()
        _, status = os.waitpid(pid, 0)
        if status:
            raise RuntimeError(f"{kind} child failed ({status})")


def throughput(kind: str, write_size: int, total: int) -> float:
    """Bytes/s from parent (writer) to child (reader); timed until the reader's 1-byte ack."""

    def writer(end: Any) -> float:
        chunk = memoryview(os.urandom(write_size))
        ack = memoryview(bytearray(1))
        end.recv_into(ack)  # child ready
        t0 = time.perf_counter()
        sent = 0
        while sent < total:
            end.sendall(chunk)
            sent += write_size
        end.recv_into(ack)
        return sent / (time.perf_counter() - t0)

    def reader(end: Any) -> None:
        buf = memoryview(bytearray(RECV_BUF))
        end.sendall(memoryview(b"r"))
        got = 0
        want = (total + write_size - 1) // write_size * write_size
        while got < want:
            n = end.recv_into(buf)
            if not n:
                raise RuntimeError("early EOF")
            got += n
        end.sendall(memoryview(b"k"))

    return run_pair(kind, writer, reader)


def pingpong(kind: str, size: int, rounds: int) -> tuple[float, float]:
    """RTT p50/p99 in microseconds for ``size``-byte messages echoed by the child."""

    def ping(end: Any) -> tuple[float, float]:
        msg = memoryview(b"p" * size)
        buf = memoryview(bytearray(size))
        rtts = []
        clock = time.perf_counter_ns
        for i in range(rounds + rounds // 10):
            t0 = clock()
            end.sendall(msg)
            got = 0
            while got < size:
                got += end.recv_into(buf[got:])
            if i >= rounds // 10:  # warm-up discarded
                rtts.append(clock() - t0)
        rtts.sort()
        return rtts[len(rtts) // 2] / 1000, rtts[int(len(rtts) * 0.99)] / 1000

    def pong(end: Any) -> None:
        buf = memoryview(bytearray(size))
        while True:
            got = 0
            while got < size:
                n = end.recv_into(buf[got:])
                if not n:
                    return
                got += n
            end.sendall(buf)

    return run_pair(kind, ping, pong)


def measure(quick: bool) -> dict[str, dict[str, float]]:
    kinds = ["tcp", "unix", "smcd"]
    total = (256 if quick else 1024) << 20
    rounds = 5000 if quick else 20000
    res: dict[str, dict[str, float]] = {k: {} for k in kinds}
    for k in kinds:
        # best of 3 for throughput: short runs on a shared machine are noisy
        res[k]["tput_64k"] = max(throughput(k, 64 << 10, total) for _ in range(3))
        res[k]["tput_1m"] = max(throughput(k, 1 << 20, total) for _ in range(3))
        for size, name in ((1, "1b"), (1024, "1k")):
            p50, p99 = pingpong(k, size, rounds)
            res[k][f"rtt_{name}_p50"] = p50
            res[k][f"rtt_{name}_p99"] = p99
    return res


ROWS = [
    ("throughput 64 KiB writes", "tput_64k", "GB/s", True),
    ("throughput 1 MiB writes", "tput_1m", "GB/s", True),
    ("ping-pong 1 B RTT p50", "rtt_1b_p50", "us", False),
    ("ping-pong 1 B RTT p99", "rtt_1b_p99", "us", False),
    ("ping-pong 1 KiB RTT p50", "rtt_1k_p50", "us", False),
    ("ping-pong 1 KiB RTT p99", "rtt_1k_p99", "us", False),
]


def table(res: dict[str, dict[str, float]]) -> str:
    lines = [
        f"{'metric':<26} {'tcp':>9} {'unix':>9} {'smcd':>9}   {'unix/tcp':>8} {'smcd/tcp':>8}"
        f" {'smcd/unix':>9}"
    ]
    for label, key, unit, is_rate in ROWS:
        vals = [res[k][key] for k in ("tcp", "unix", "smcd")]
        shown = [v / 1e9 if is_rate else v for v in vals]
        t, u, s = vals
        lines.append(
            f"{label + ' (' + unit + ')':<26} {shown[0]:9.2f} {shown[1]:9.2f} {shown[2]:9.2f}"
            f"   {u / t:7.2f}x {s / t:7.2f}x {s / u:8.2f}x"
        )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller volumes (CI smoke run)")
    ap.add_argument("--busy", action="store_true", help="run a CPU-burning third process")
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = ap.parse_args()
    hog = None
    if args.busy:
        hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        res = measure(args.quick)
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        print(f"two Python processes, {os.cpu_count()} CPUs" + (", + busy process" if hog else ""))
        print(table(res))
        ok_t = res["smcd"]["tput_64k"] >= 4 * res["tcp"]["tput_64k"]
        ok_u = res["smcd"]["tput_64k"] >= 1.5 * res["unix"]["tput_64k"]
        ok_r = res["smcd"]["rtt_1b_p50"] <= 0.3 * res["tcp"]["rtt_1b_p50"]
        print(
            "targets: 64K tput >= 4x tcp: {}, >= 1.5x unix: {}, RTT p50 <= 0.3x tcp: {}".format(
                *tuple("yes" if ok else "NO" for ok in (ok_t, ok_u, ok_r))
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
