"""The connection-rate bound of ``make bench``'s user view: the least a same-host SMC-D handoff
chain does, in Python, on this machine.

As the C ceiling bounds bulk, this bounds connection setup for a daemon written in Python: a
broker with a plain ``selectors`` loop that does only what the protocol and the handoff's
safety need per connection, and a client and a server that do only what a library must:

- the client connects over TCP, opens a handoff connection (Unix SEQPACKET) to the broker and
  passes its socket (SCM_RIGHTS); the server accepts and does the same;
- the broker checks each caller's credentials (SO_PEERCRED), pairs the halves by their
  4-tuple, runs a CLC exchange of real sizes over the TCP connection (Proposal, Accept,
  Confirm: the bytes go through the kernel, templates, no codec), takes two 1 MiB DMBs from
  its pool (memfds, made once), makes two eventfds and a peer link (a socketpair) and sends
  each half its five descriptors;
- each application maps the two DMBs, exchanges one byte through them with an eventfd kick
  each way, then unmaps and closes everything; the broker sees the hang-up, zeroes the touched
  page of the DMB (hole punch) and takes it back.

Left out, and so what smcd's own figure pays above this one: the event loop's generality
(asyncio), the pairing proof (the ISNs through ``TCP_REPAIR``), the stream marks that keep a
fallback safe, the CLC codec and negotiation, admission and quotas, timers, the records,
journal and D-Bus view, the real channel layout (cursors, flags).

    python bench/_conn_floor.py broker SOCK
    python bench/_conn_floor.py server SOCK       (prints "PORT n")
    python bench/_conn_floor.py client SOCK PORT N WARMUP   (prints a JSON line)
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import selectors
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

DMB = 1 << 20
EYE = bytes.fromhex("e2d4c3c4")  # the SMC-D eyecatcher, head and tail of every CLC message
PROPOSAL = EYE + bytes.fromhex("01005020") + bytes(72) + EYE  # v2 SMC-D sizes (80 bytes)
ACCEPT = EYE + bytes.fromhex("02004820") + bytes(64) + EYE  # 72 bytes
CONFIRM = EYE + bytes.fromhex("03004820") + bytes(64) + EYE
_PUNCH = 0x03  # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE
_CRED = struct.Struct("3i")


class FloorError(RuntimeError):
    """The bound could not be measured (a process failed or said nothing)."""


def broker(path: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    lst = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    lst.bind(path)
    lst.listen(128)
    lst.setblocking(False)
    sel = selectors.DefaultSelector()
    pool: list[int] = []
    waiting: dict[Any, tuple[socket.socket, socket.socket]] = {}
    held: dict[int, int] = {}  # handoff connection fd -> the DMB it receives into

    def pair(cconn: socket.socket, ctcp: socket.socket, sconn: socket.socket,
             stcp: socket.socket) -> None:  # fmt: skip
        ctcp.send(PROPOSAL)
        if stcp.recv(len(PROPOSAL)) != PROPOSAL:
            raise FloorError("the Proposal did not arrive whole")
        stcp.send(ACCEPT)
        if ctcp.recv(len(ACCEPT)) != ACCEPT:
            raise FloorError("the Accept did not arrive whole")
        ctcp.send(CONFIRM)
        if stcp.recv(len(CONFIRM)) != CONFIRM:
            raise FloorError("the Confirm did not arrive whole")
        dmbs = []
        for _ in range(2):
            if pool:
                dmbs.append(pool.pop())
            else:
                fd = os.memfd_create("dmb", os.MFD_CLOEXEC)
                os.ftruncate(fd, DMB)
                dmbs.append(fd)
        ev = [os.eventfd(0, os.EFD_CLOEXEC), os.eventfd(0, os.EFD_CLOEXEC)]
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        socket.send_fds(cconn, [b"CHANNEL"], [dmbs[0], dmbs[1], ev[0], ev[1], a.fileno()])
        socket.send_fds(sconn, [b"CHANNEL"], [dmbs[1], dmbs[0], ev[1], ev[0], b.fileno()])
        for fd in ev:
            os.close(fd)
        for s in (a, b, ctcp, stcp):
            s.close()
        for conn, dmb in ((cconn, dmbs[0]), (sconn, dmbs[1])):
            conn.setblocking(False)
            held[conn.fileno()] = dmb
            sel.register(conn, selectors.EVENT_READ, hang_up)

    def on_accept(_: Any) -> None:
        while True:
            try:
                conn, _addr = lst.accept()
            except BlockingIOError:
                return
            _pid, uid, _gid = _CRED.unpack(
                conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size)
            )
            role, fds, _flags, _addr = socket.recv_fds(conn, 64, 1)
            tcp = socket.socket(fileno=fds[0])
            local, peer = tcp.getsockname(), tcp.getpeername()
            key = (local, peer, uid) if role == b"C" else (peer, local, uid)
            other = waiting.pop(key, None)
            if other is None:
                waiting[key] = (conn, tcp)
            elif role == b"C":
                pair(conn, tcp, *other)
            else:
                pair(*other, conn, tcp)

    def hang_up(conn: socket.socket) -> None:
        try:
            if conn.recv(16):
                return
        except BlockingIOError:
            return
        sel.unregister(conn)
        dmb = held.pop(conn.fileno())
        conn.close()
        libc.fallocate(dmb, _PUNCH, ctypes.c_long(0), ctypes.c_long(4096))  # zero before reuse
        pool.append(dmb)

    sel.register(lst, selectors.EVENT_READ, on_accept)
    print("READY", flush=True)
    while True:
        for key, _events in sel.select():
            key.data(key.fileobj)


class _Channel:
    """One application's end: the handoff connection, both DMBs mapped, the kicks, the link."""

    def __init__(self, path: str, tcp: socket.socket, role: bytes) -> None:
        self.tcp = tcp
        self.handoff = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.handoff.connect(path)
        socket.send_fds(self.handoff, [role], [tcp.fileno()])
        _msg, fds, _flags, _addr = socket.recv_fds(self.handoff, 64, 5)
        self.rx, self.tx = mmap.mmap(fds[0], DMB), mmap.mmap(fds[1], DMB)
        os.close(fds[0])
        os.close(fds[1])
        self.kick_in, self.kick_out = fds[2], fds[3]
        self.link = socket.socket(fileno=fds[4])

    def close(self) -> None:
        self.rx.close()
        self.tx.close()
        os.close(self.kick_in)
        os.close(self.kick_out)
        for s in (self.link, self.handoff, self.tcp):
            s.close()


def server(path: str) -> None:
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(512)
    print("PORT", lsock.getsockname()[1], flush=True)
    while True:
        tcp, _ = lsock.accept()
        ch = _Channel(path, tcp, b"S")
        os.eventfd_read(ch.kick_in)
        ch.tx[0:1] = ch.rx[0:1]
        os.eventfd_write(ch.kick_out, 1)
        ch.link.recv(1)  # the client's close hangs its end of the link up
        ch.close()


def client(path: str, port: int, n: int, warmup: int) -> None:
    times = []
    for i in range(warmup + n):
        if i == warmup:
            start = time.perf_counter()
            cpu = time.process_time_ns()
        t0 = time.perf_counter_ns()
        ch = _Channel(path, socket.create_connection(("127.0.0.1", port)), b"C")
        if i >= warmup:
            times.append(time.perf_counter_ns() - t0)
        ch.tx[0:1] = b"x"
        os.eventfd_write(ch.kick_out, 1)
        os.eventfd_read(ch.kick_in)
        if ch.rx[0:1] != b"x":
            raise FloorError("the echo differs")
        ch.close()
    elapsed = time.perf_counter() - start
    cpu_us = (time.process_time_ns() - cpu) / n / 1e3
    print(json.dumps({"rate": n / elapsed, "connect_p50_us": statistics.median(times) / 1e3,
                      "cpu_us": cpu_us}))  # fmt: skip


def _cpu_ns(pid: int) -> int:
    return int(Path(f"/proc/{pid}/schedstat").read_text().split()[0])


def measure(n: int, warmup: int, repeats: int) -> dict[str, float]:
    """Medians of ``repeats`` runs of ``n`` connections one at a time (after ``warmup``):
    connections/s, connect p50 in us, the broker's CPU per connection in us, and the client's
    and the server's together."""
    me = [sys.executable, os.path.abspath(__file__)]
    runs: list[tuple[float, float, float, float]] = []
    with tempfile.TemporaryDirectory(prefix="smcd-floor-") as tmp:
        path = os.path.join(tmp, "h.sock")
        procs = [subprocess.Popen([*me, "broker", path], stdout=subprocess.PIPE, text=True)]
        try:
            assert procs[0].stdout is not None
            if procs[0].stdout.readline().strip() != "READY":
                raise FloorError("the broker did not start")
            srv = subprocess.Popen([*me, "server", path], stdout=subprocess.PIPE, text=True)
            procs.append(srv)
            assert srv.stdout is not None
            port = srv.stdout.readline().split()[1]
            for _ in range(repeats):
                before, served = _cpu_ns(procs[0].pid), _cpu_ns(srv.pid)
                out = subprocess.run([*me, "client", path, port, str(n), str(warmup)],
                                     capture_output=True, text=True, timeout=120)  # fmt: skip
                if out.returncode != 0:
                    raise FloorError(f"the client failed: {out.stderr.strip()[-300:]}")
                spent = (_cpu_ns(procs[0].pid) - before) / (n + warmup) / 1e3
                served = (_cpu_ns(srv.pid) - served) / (n + warmup) / 1e3
                r = json.loads(out.stdout.splitlines()[-1])
                runs.append((r["rate"], r["connect_p50_us"], spent, r["cpu_us"] + served))
        except (OSError, ValueError, IndexError, subprocess.TimeoutExpired) as e:
            raise FloorError(str(e)) from e
        finally:
            for p in procs:
                p.kill()
                p.wait()
    rate, p50, cpu, apps = (statistics.median(x) for x in zip(*runs, strict=True))
    return {"conns_floor": rate, "connect_floor": p50, "floor_cpu": cpu, "floor_apps_cpu": apps}


if __name__ == "__main__":
    what = sys.argv[1]
    if what == "broker":
        broker(sys.argv[2])
    elif what == "server":
        server(sys.argv[2])
    elif what == "client":
        client(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
    else:
        print(json.dumps(measure(1000, 50, 3)))
