"""Where the time goes when the reader is the slower side, and in a 64 KiB request/response:
the channel between two processes (no daemon), against TCP loopback, per process.

    .venv/bin/python bench/profile_backpressure.py [--sizes 64K,256K,1M] [--mib 512] [--json F]
        [--sessions]

For each DMB size and case it prints the rate (or round trip), and per process: CPU time per
MiB (user + system), voluntary context switches per MiB (each one a sleep and a wake-up),
involuntary ones, and what the channel did: write calls that returned short, waits for space
(and how many of them slept rather than spun), read calls and bytes per read, kicks sent,
and each side's time spent waiting for the other and its waits for data (pipelined, only the
faster side waits; in lock-step both do). ``--sessions`` runs the reader in a session of its
own, as the user view starts its programs (``sched_autogroup`` then schedules them apart).
The ends are the blocking ``sendall``/``recv_into`` that ``SmcSocket`` builds on the channel
(``bench/channel_bench.ChannelEnd``, counting); the readers are ``bench/user_app.Reader`` (the
user view's receivers, with or without the sampled check). Findings: ``bench/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.dirname(HERE))

from channel_bench import ChannelEnd  # noqa: E402
from user_app import Reader, pattern  # noqa: E402

from smc_handoff.channel import Channel, make_pair  # noqa: E402

MIB = 1 << 20
SESSIONS = False
"""Run the child in a session of its own (``--sessions``), as the user view's programs are."""


class CountingEnd(ChannelEnd):
    """``ChannelEnd`` with counters on the slow paths (the fast paths stay uncounted), and the
    time each side spent waiting for the other (a pipelined pair: only the faster side waits;
    in lock-step both do)."""

    def __init__(self, ch: Channel) -> None:
        super().__init__(ch)
        self.short_writes = 0
        self.space_waits = 0
        self.reads = 0
        self.data_waits = 0
        self.wait_ns = 0

    def sendall(self, mv: memoryview) -> None:
        ch = self.ch
        if ch.send_fast(mv):
            return
        while mv:
            n = ch.send_into(mv)
            if n:
                if n < len(mv):
                    self.short_writes += 1
                mv = mv[n:]
            else:
                self.space_waits += 1
                t0 = time.perf_counter_ns()
                ch.wait_writable()
                self.wait_ns += time.perf_counter_ns() - t0

    def recv_into(self, buf: memoryview) -> int:
        self.reads += 1
        ch = self.ch
        n = ch.recv_fast(buf) or ch.recv_into(buf)
        if n:
            return n
        self.data_waits += 1
        t0 = time.perf_counter_ns()
        n = super().recv_into(buf)
        self.wait_ns += time.perf_counter_ns() - t0
        return n

    def counters(self) -> dict[str, float]:
        st = self.ch.stats()
        return {
            "short_writes": self.short_writes,
            "space_waits": self.space_waits,
            "reads": self.reads,
            "data_waits": self.data_waits,
            "wait_s": self.wait_ns / 1e9,
            "kicks": st["kicks_sent"],
            "sleeps": st["sleeps"],
            "spin_hits": st["spin_hits"],
            "missed": st["missed_wakeups"],
        }


class SockEnd:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.sendall = sock.sendall
        self.reads = 0

    def recv_into(self, buf: memoryview) -> int:
        self.reads += 1
        return self.sock.recv_into(buf)

    def counters(self) -> dict[str, float]:
        return {"reads": self.reads}

    def close(self) -> None:
        self.sock.close()


def ends(kind: str, size: int) -> tuple[Callable[[], Any], Callable[[], Any]]:
    if kind == "smcd":
        fa, fb = make_pair(size, size)

        def pa() -> CountingEnd:
            fb.close()
            return CountingEnd(Channel.from_fds(fa))

        def pb() -> CountingEnd:
            fa.close()
            return CountingEnd(Channel.from_fds(fb))

        return pa, pb
    lsock = socket.create_server(("127.0.0.1", 0))
    ca = socket.create_connection(lsock.getsockname())
    cb, _ = lsock.accept()
    lsock.close()
    for s in (ca, cb):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def ta() -> SockEnd:
        cb.close()
        return SockEnd(ca)

    def tb() -> SockEnd:
        ca.close()
        return SockEnd(cb)

    return ta, tb


def usage() -> tuple[float, float, int, int]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime, r.ru_stime, r.ru_nvcsw, r.ru_nivcsw


def delta(before: tuple[float, float, int, int], end: Any) -> dict[str, float]:
    u, s, v, i = usage()
    out = {"cpu_s": u - before[0] + s - before[1], "sys_s": s - before[1]}
    out |= {"vcsw": v - before[2], "ivcsw": i - before[3]}
    return out | {f"{k}": v for k, v in end.counters().items()}


def pair(
    kind: str, size: int, writer: Callable[[Any], dict[str, Any]], reader: Callable[[Any], Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The parent runs ``writer``, a forked child ``reader``; both return their figures."""
    pa, pb = ends(kind, size)
    rd, wr = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(rd)
        if SESSIONS:
            os.setsid()  # as the user view starts its programs: its own scheduling autogroup
        code = 0
        try:
            end = pb()
            out = reader(end)
            os.write(wr, json.dumps(out).encode())
        except BaseException:
            import traceback

            traceback.print_exc()
            code = 1
        os._exit(code)
    os.close(wr)
    end = pa()
    mine = writer(end)
    with os.fdopen(rd, "rb") as f:
        theirs = json.loads(f.read() or b"{}")
    _, status = os.waitpid(pid, 0)
    if status:
        raise RuntimeError(f"{kind} reader failed")
    end.close()
    return mine, theirs


def bulk(kind: str, size: int, total: int, stride: int, recv: int = MIB) -> dict[str, Any]:
    warm = 16 * MIB
    chunk = memoryview(pattern(64 << 10))

    def writer(end: Any) -> dict[str, Any]:
        ack = memoryview(bytearray(1))
        for _ in range(warm // len(chunk)):
            end.sendall(chunk)
        end.recv_into(ack)
        if isinstance(end, CountingEnd):
            end.short_writes = end.space_waits = end.data_waits = end.wait_ns = 0
        base = (usage(), end.counters() if isinstance(end, CountingEnd) else {})
        t0 = time.perf_counter()
        for _ in range(total // len(chunk)):
            end.sendall(chunk)
        end.recv_into(ack)
        rate = total / (time.perf_counter() - t0)
        d = delta(base[0], end)
        for k, v in base[1].items():
            if k in ("kicks", "sleeps", "spin_hits", "missed", "wait_s", "data_waits"):
                d[k] -= v
        return {"rate": rate, **d}

    def reader(end: Any) -> dict[str, Any]:
        r = Reader(recv, stride)
        r.take(end.recv_into, warm)
        end.sendall(memoryview(b"w"))
        end.reads = 0
        base = (usage(), end.counters() if isinstance(end, CountingEnd) else {})
        r.take(end.recv_into, total)
        d = delta(base[0], end)
        for k, v in base[1].items():
            if k in ("kicks", "sleeps", "spin_hits", "missed", "wait_s", "data_waits"):
                d[k] -= v
        end.sendall(memoryview(b"k"))
        return d

    w, r = pair(kind, size, writer, reader)
    return {"rate": w.pop("rate"), "writer": w, "reader": r}


def rr(kind: str, size: int, msg: int, rounds: int) -> dict[str, Any]:
    data = memoryview((pattern(max(msg, 256)) * 2)[:msg])

    def exactly(end: Any, view: memoryview) -> None:
        got = 0
        while got < len(view):
            k = end.recv_into(view[got:])
            if not k:
                raise ConnectionError("EOF")
            got += k

    def writer(end: Any) -> dict[str, Any]:
        buf = memoryview(bytearray(msg))
        for _ in range(200):
            end.sendall(data)
            exactly(end, buf)
        if isinstance(end, CountingEnd):
            end.short_writes = end.space_waits = end.data_waits = end.wait_ns = 0
        end.reads = 0
        base = (usage(), end.counters() if isinstance(end, CountingEnd) else {})
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter_ns()
            end.sendall(data)
            exactly(end, buf)
            times.append(time.perf_counter_ns() - t0)
        d = delta(base[0], end)
        for k, v in base[1].items():
            if k in ("kicks", "sleeps", "spin_hits", "missed", "wait_s", "data_waits"):
                d[k] -= v
        times.sort()
        return {"p50_us": times[len(times) // 2] / 1e3, **d}

    def reader(end: Any) -> dict[str, Any]:
        buf = memoryview(bytearray(msg))
        for _ in range(200):
            exactly(end, buf)
            end.sendall(buf)
        if isinstance(end, CountingEnd):
            end.short_writes = end.space_waits = end.data_waits = end.wait_ns = 0
        end.reads = 0
        base = (usage(), end.counters() if isinstance(end, CountingEnd) else {})
        for _ in range(rounds):
            exactly(end, buf)
            end.sendall(buf)
        d = delta(base[0], end)
        for k, v in base[1].items():
            if k in ("kicks", "sleeps", "spin_hits", "missed", "wait_s", "data_waits"):
                d[k] -= v
        return d

    w, r = pair(kind, size, writer, reader)
    return {"p50_us": w.pop("p50_us"), "writer": w, "reader": r}


def per(d: dict[str, Any], unit: float) -> str:
    """One process's figures per ``unit`` (MiB moved, or round trips)."""
    keys: tuple[str, ...] = ("cpu_s", "sys_s", "wait_s", "vcsw", "ivcsw", "short_writes")
    keys += ("space_waits", "reads", "data_waits", "kicks")
    parts = []
    for k in keys:
        if k in d:
            v = d[k] / unit
            parts.append(f"{k}={v * 1e6:.0f}us" if k.endswith("_s") else f"{k}={v:.2f}")
    for k in ("sleeps", "spin_hits", "missed"):
        if k in d:
            parts.append(f"{k}={d[k]}")
    return " ".join(parts)


def parse_size(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20}.get(s[-1], 1)
    return int(s.rstrip("KM")) * mult


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="64K,128K,256K,512K,1M")
    ap.add_argument("--mib", type=int, default=512, help="bulk volume per run")
    ap.add_argument("--rounds", type=int, default=3000)
    ap.add_argument("--cases", default="bulk,check,rr64k")
    ap.add_argument("--json", metavar="FILE")
    ap.add_argument("--no-tcp", action="store_true", help="skip the TCP baseline")
    ap.add_argument("--recv", default="1M", help="the reader's recv_into buffer")
    ap.add_argument(
        "--sessions", action="store_true", help="the reader in a session of its own (user view)"
    )
    args = ap.parse_args()
    global SESSIONS
    SESSIONS = args.sessions
    total = args.mib * MIB
    out: list[dict[str, Any]] = []
    cases = args.cases.split(",")
    runs: list[tuple[str, int]] = ([] if args.no_tcp else [("tcp", 0)]) + [
        ("smcd", parse_size(s)) for s in args.sizes.split(",")
    ]
    for kind, size in runs:
        label = kind if kind == "tcp" else f"smcd {size >> 10}K"
        for case in cases:
            if case in ("bulk", "check"):
                r = bulk(kind, size, total, 65 if case == "check" else 0, parse_size(args.recv))
                mib = total / MIB
                print(f"{label:10} {case:6} {r['rate'] / 1e9:6.2f} GB/s", flush=True)
                print(f"    writer per MiB: {per(r['writer'], mib)}")
                print(f"    reader per MiB: {per(r['reader'], mib)}", flush=True)
            else:
                r = rr(kind, size, 64 << 10, args.rounds)
                print(f"{label:10} {case:6} p50 {r['p50_us']:6.1f} us", flush=True)
                print(f"    client per round trip: {per(r['writer'], args.rounds)}")
                print(f"    server per round trip: {per(r['reader'], args.rounds)}", flush=True)
            out.append({"kind": kind, "size": size, "case": case, **r})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
