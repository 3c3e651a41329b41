"""``make bench-rdma``: smcd SMC-R vs plain TCP vs the Linux kernel's own SMC-R between two
applications over the same emulated link, in one table from one run. It runs *inside* the
Soft-RoCE VM (``tests/vm``; the guest test ``test_smcr_bench`` runs it), where host A is
192.0.2.1 (smca0/rxe_a0) and host B 192.0.2.2 (smcb0/rxe_b0), joined by one virtio wire:

    python bench/smcr_vm.py [--quick] [--out FILE] [--json FILE] [--logs DIR]

Two private smcd daemons are started for the run (one per simulated host: own runtime dir,
handoff socket and private D-Bus bus; they offer SMC-R toward 192.0.2.0/24) and stopped at the
end. Every figure comes from two processes, as applications would be: the accepting one is a
forked child that talks to B's daemon (``smc_handoff.listen``), the connecting one is the parent
and talks to A's (``smc_handoff.connect`` from 192.0.2.1), so an SMC-R figure includes the whole
path (application → shared-memory send buffer → daemon A → RDMA WRITE + CDC over rxe → daemon B's
RMB → application). TCP is the same two processes with plain sockets (``TCP_NODELAY``) on the
same addresses, so its packets cross the same virtio wire. An SMC-R figure is only reported when
both ends really are on SMC-R (``mode == "smcr"``), never a fallback measured as SMC-R.

The kernel is the anchor: the ``kernel`` column is the same two processes on AF_SMC sockets
(the kernel's SMC-R over the same rxe devices and wire, SMC-Rv2 as rxe has only RoCEv2 GIDs), set
up as ``tests/vm/guest/test_kernel_interop.py`` does: ``modprobe smc smc_diag``, a pnet entry per
"host" (smca0 -> rxe_a0, smcb0 -> rxe_b0: rxe has no netdev of its own for SMC to find, and one
pnetid per host keeps either side from picking the other's device in the shared kernel), a
UEID, and the patched rdma_rxe (``tests/vm/kmod.py``; the stock 6.1 module hangs the kernel's
link setup). Falling back is silent for an AF_SMC application, so every kernel connection is
looked up in ``smc_diag`` on both ends and counts only in mode SMCR. Its bulk transfers ask for
the same 512 KiB buffers as smcd's (``SO_RCVBUFFORCE``/``SO_SNDBUFFORCE`` before ``listen`` /
``connect``); the RMB sizes the kernel chose are printed under the table.

Every byte is checked: the throughput reader keeps a CRC-32 of everything it received and
returns it with its acknowledgement (the writer computed the expected one before the clock
started); every ping-pong echo is compared with what was sent (each round's message differs).

Nothing asserts a number: under qemu/TCG everything is 10-100x slower than on hardware and
the ratios are what there is to see. Exit status 0 when every figure was measured and verified,
1 otherwise (the table says ``n/a`` and a note says why).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import errno
import itertools
import json
import os
import socket
import statistics
import struct
import sys
import tempfile
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, os.fspath(HERE))
sys.path.insert(1, os.fspath(ROOT))

from _fork import NotOnSmc, fork_server  # noqa: E402
from _table import format_number as _num  # noqa: E402

import smc_handoff  # noqa: E402
from smcd_daemon.demo import DaemonStartError, PrivateSmcd, stop_all  # noqa: E402
from tests.vm.guest import kernel_smc as ks  # noqa: E402
from tests.vm.topology import ports_of  # noqa: E402

SERVER = "192.0.2.2"
CLIENT = "192.0.2.1"
PORT = 47390
"""The first measurement's port; each later one takes the next (see :meth:`Pair.run`)."""
_ports = itertools.count(PORT)
UEID = "SMCD-BENCH-RDMA"
KINDS = ("tcp", "smcr", "kernel")
RATIOS = (("smcr", "tcp"), ("kernel", "tcp"), ("smcr", "kernel"))
CHILD_TIMEOUT = 120.0
READY_TIMEOUT = 180.0
RECV_BUF = 1 << 20
BULK_RMB = 512 << 10
"""The RMBs a bulk transfer asks for (``dmb_size``, as an application raises ``SO_RCVBUF``): a
ring is one window per round trip, and round trips are long under TCG."""

T = TypeVar("T")


@dataclass(frozen=True)
class Plan:
    """Every size and count of a run (fixed: runs differ only in how long they take)."""

    write_size: int
    tput_bytes: int
    tput_warmup: int
    tput_repeats: int
    rtt_size: int
    rtt_rounds: int
    rtt_warmup: int
    setup_count: int


FULL = Plan(
    write_size=64 << 10,
    tput_bytes=32 << 20,
    tput_warmup=4 << 20,
    tput_repeats=3,
    rtt_size=64,
    rtt_rounds=1000,
    rtt_warmup=100,
    setup_count=20,
)
QUICK = Plan(
    write_size=64 << 10,
    tput_bytes=16 << 20,
    tput_warmup=2 << 20,
    tput_repeats=1,
    rtt_size=64,
    rtt_rounds=300,
    rtt_warmup=30,
    setup_count=5,
)


@dataclass(frozen=True)
class Row:
    label: str
    key: str
    unit: str
    scale: float
    better: str  # what a ratio x/y above 1 means for x


ROWS = (
    Row("throughput, 64 KiB writes", "tput", "MiB/s", 1 << 20, "faster"),
    Row("ping-pong RTT 64 B, p50", "rtt_p50", "us", 1.0, "slower"),
    Row("ping-pong RTT 64 B, p99", "rtt_p99", "us", 1.0, "slower"),
    Row("connect (+handoff), p50", "connect_p50", "ms", 1.0, "slower"),
)
HEADER = ("metric", "unit", *KINDS, *(f"{x}/{y}" for x, y in RATIOS), "x/y > 1: x is")
NA = "n/a"


class VerifyError(RuntimeError):
    """Bytes arrived different from what was sent."""


@dataclass
class Results:
    figures: dict[str, dict[str, float]] = field(default_factory=lambda: {k: {} for k in KINDS})
    verified: dict[str, dict[str, bool]] = field(default_factory=lambda: {k: {} for k in KINDS})
    notes: list[str] = field(default_factory=list)
    checked_bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    daemon_start_s: float = 0.0
    kernel: dict[str, Any] = field(default_factory=dict)
    """The kernel side: its version, the smc_diag modes seen and the RMB sizes it chose."""

    def complete(self) -> bool:
        return all(
            row.key in self.figures[k] and self.verified[k].get(row.key) is True
            for k in KINDS
            for row in ROWS
        )


# ---------------------------------------------------------------------------- the daemons


def _daemon(logs: Path, name: str) -> PrivateSmcd:
    """One simulated host's smcd (``smcd_daemon.demo.PrivateSmcd``): config, log and state in
    ``logs/name``, sockets in a fresh /tmp dir (``logs`` may be 9p, which holds no sockets)."""
    config = (
        f'peers = ["192.0.2.0/24"]\n[eid]\nueids = ["{UEID}"]\n'
        "[timeouts]\nclc_wait = 30.0\nproposal_wait = 10.0\nfirst_llc = 30.0\nlinger = 600.0\n"
        "[smcr]\nmax_links = 1\n"  # one link: the figures are those of one virtio wire
    )
    return PrivateSmcd(log_level="info", config_text=config, home=logs / name, name=f"bench-{name}")


@contextlib.contextmanager
def two_daemons(logs: Path) -> Iterator[tuple[PrivateSmcd, PrivateSmcd]]:
    """Daemons A and B, launched together and ready (``READY=1``) within
    :data:`READY_TIMEOUT`; stopped together at the end. A start-up failure is a RuntimeError
    that names the log."""
    a, b = _daemon(logs, "a"), _daemon(logs, "b")
    try:
        a.launch()
        b.launch()
        deadline = time.monotonic() + READY_TIMEOUT
        for name, d in (("a", a), ("b", b)):
            try:
                d.wait_ready(max(0.0, deadline - time.monotonic()))
            except DaemonStartError as e:
                why = str(e).splitlines()[0]
                raise RuntimeError(f"smcd {name}: {why}; log: {d.log_path}") from None
        yield a, b
    finally:
        stop_all((a, b), 30.0)
        a.cleanup()
        b.cleanup()


# ---------------------------------------------------------------------------- the kernel's SMC-R


KERNEL_PNET = (("BENCHA0", "a"), ("BENCHB0", "b"))
_SO_SNDBUFFORCE, _SO_RCVBUFFORCE = 32, 33
BIND_WAIT = 60.0
_libc = ctypes.CDLL(None, use_errno=True)


@contextlib.contextmanager
def kernel_smcr() -> Iterator[None]:
    """The kernel's SMC-R between the two hosts' wire-0 ports, for the block; what this added
    (pnet entries, the UEID) is removed after. A RuntimeError says why it cannot run."""
    taint = Path("/sys/module/rdma_rxe/taint")
    if not (taint.exists() and "O" in taint.read_text()):
        raise RuntimeError(
            "the stock rdma_rxe is loaded: the kernel's SMC-R needs the patched module "
            "(tests/vm/kmod.py)"
        )
    try:
        ks.modprobe("smc", "smc_diag")
    except ks.KernelSmcError as e:
        raise RuntimeError(str(e)) from e
    undo: list[Callable[[], None]] = []
    try:
        steps: list[tuple[Callable[[], None], Callable[[], None]]] = [
            (lambda: ks.ueid_add(UEID), lambda: ks.ueid_del(UEID))
        ]
        for pnetid, host in KERNEL_PNET:
            port = ports_of(host)[0]
            steps.append(
                (
                    lambda i=pnetid, p=port: ks.pnet_add(i, p.ifname, p.rxe),
                    lambda i=pnetid: ks.pnet_del(i),
                )
            )
        for do, undo_it in steps:
            try:
                do()
            except OSError as e:
                if e.errno != errno.EEXIST:  # left by an earlier test: it serves as well
                    raise RuntimeError(f"kernel SMC set-up: {e}") from e
            else:
                undo.append(undo_it)
        yield
    finally:
        for undo_it in reversed(undo):
            with contextlib.suppress(OSError, ks.KernelSmcError):
                undo_it()


def _af_smc(bufsize: int) -> socket.socket:
    """A new AF_SMC socket (made by libc, wrapped by descriptor: Python then sees the family of
    its TCP socket, AF_INET), with the buffers the kernel sizes its RMB and send buffer from."""
    fd = _libc.socket(ks.AF_SMC, socket.SOCK_STREAM, 0)
    if fd < 0:
        raise OSError(ctypes.get_errno(), "socket(AF_SMC)")
    sock = socket.socket(fileno=fd)
    if bufsize:  # the kernel halves sk_rcvbuf/sk_sndbuf for its buffers, as SO_RCVBUF doubles
        sock.setsockopt(socket.SOL_SOCKET, _SO_RCVBUFFORCE, bufsize)
        sock.setsockopt(socket.SOL_SOCKET, _SO_SNDBUFFORCE, bufsize)
    return sock


def _sockaddr(ip: str, port: int) -> ctypes.Array[ctypes.c_char]:
    raw = struct.pack("=H", socket.AF_INET) + struct.pack("!H", port) + socket.inet_aton(ip)
    return ctypes.create_string_buffer(raw + bytes(8), 16)


def _libc_call(rc: int, what: str) -> None:
    if rc < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def kernel_listen(bufsize: int, port: int) -> socket.socket:
    """An AF_SMC listener on ``port``. Each measurement has a port of its own, because an
    AF_SMC listener may hold its port long after its process exited (the kernel releases its
    TCP listener from a work item, slow under TCG: in one CI run over 60 s, which failed the
    next three rows on the shared port); EADDRINUSE is still retried for a bounded time."""
    sock = _af_smc(bufsize)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    deadline = time.monotonic() + BIND_WAIT
    while _libc.bind(sock.fileno(), _sockaddr(SERVER, port), 16) < 0:
        err = ctypes.get_errno()
        if err != errno.EADDRINUSE or time.monotonic() > deadline:
            sock.close()
            raise OSError(err, f"bind AF_SMC {SERVER}:{port}: {os.strerror(err)}")
        time.sleep(0.2)
    sock.listen(64)
    return sock


def kernel_dial(bufsize: int, port: int) -> socket.socket:
    """connect() of an AF_SMC socket: the TCP handshake and the whole CLC exchange."""
    sock = _af_smc(bufsize)
    try:
        _libc_call(_libc.bind(sock.fileno(), _sockaddr(CLIENT, 0), 16), "bind AF_SMC")
        _libc_call(_libc.connect(sock.fileno(), _sockaddr(SERVER, port), 16), "connect AF_SMC")
    except BaseException:
        sock.close()
        raise
    sock.settimeout(60)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def kernel_mode(sock: socket.socket, role: str) -> ks.DiagSocket:
    """This connection as ``smc_diag`` sees it; NotOnSmc unless it runs on SMC-R."""
    local, peer = sock.getsockname(), sock.getpeername()
    key = (local[0], local[1], peer[0], peer[1])
    found = [d for d in ks.smc_diag() if (d.src, d.sport, d.dst, d.dport) == key]
    if not found:
        raise NotOnSmc(f"kernel {role}: {key} not in smc_diag")
    d = found[0]
    if d.mode != "SMCR":
        reason = f"{d.fallback_reason:#x}" if d.fallback_reason is not None else "?"
        raise NotOnSmc(f"kernel {role} on {d.mode} (fallback reason {reason})")
    return d


# ---------------------------------------------------------------------------- the pairs


class Pair:
    """Dialing (parent, host A) and accepting (child, host B) for one kind of stream."""

    def __init__(
        self,
        kind: str,
        a: PrivateSmcd,
        b: PrivateSmcd,
        dmb_size: int = 0,
        res: Results | None = None,
    ) -> None:
        self.kind, self.a, self.b, self.dmb_size, self.res = kind, a, b, dmb_size, res
        self.port = PORT  # set anew by every run()

    def dial(self, check: bool = True) -> socket.socket:
        """A connected socket on this pair's transport; ``check=False`` leaves the kernel's
        smc_diag look-up to :meth:`check` (so a connect time does not include it)."""
        if self.kind == "kernel":
            sock = kernel_dial(self.dmb_size, self.port)
            if check:
                self.check(sock)
            return sock
        sock = socket.create_connection((SERVER, self.port), 60, source_address=(CLIENT, 0))
        if self.kind == "tcp":
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return sock
        smc = smc_handoff.wrap(sock, dmb_size=self.dmb_size)
        if smc.mode != "smcr":
            smc.close()
            raise NotOnSmc(f"client on {smc.mode}: {smc.fallback}")
        return smc

    def check(self, sock: socket.socket) -> None:
        """The client end of a kernel connection is on SMC-R (smc_diag); what it saw is kept."""
        if self.kind != "kernel":
            return
        try:
            d = kernel_mode(sock, "client")
        except BaseException:
            sock.close()
            raise
        if self.res is not None:
            seen = self.res.kernel.setdefault("client_modes", {})
            seen[d.mode] = seen.get(d.mode, 0) + 1
            if self.dmb_size:
                self.res.kernel["bulk_rmb_client"] = d.rmbe_size
                self.res.kernel["bulk_rmb_server"] = d.peer_rmbe_size

    def listen(self) -> Callable[[], socket.socket]:
        """In the child: the listener's accept function."""
        if self.kind == "kernel":
            ksock = kernel_listen(self.dmb_size, self.port)

            def accept_kernel() -> socket.socket:
                conn, _ = ksock.accept()
                conn.settimeout(60)
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                kernel_mode(conn, "server")  # NotOnSmc: the child exits 3
                return conn

            return accept_kernel
        lsock = socket.create_server((SERVER, self.port), backlog=64)
        if self.kind == "tcp":

            def accept_tcp() -> socket.socket:
                conn, _ = lsock.accept()
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                return conn

            return accept_tcp
        server = smc_handoff.SmcServer(lsock, dmb_size=self.dmb_size)
        if not server.registered:
            raise NotOnSmc(f"listener not registered with smcd B: {server.fallback}")

        def accept_smc() -> socket.socket:
            conn, _ = server.accept()
            if conn.mode != "smcr":
                raise NotOnSmc(f"server on {conn.mode}: {conn.fallback}")
            return conn

        return accept_smc

    def run(
        self, client: Callable[[Pair], T], server: Callable[[Callable[[], socket.socket]], None]
    ) -> T:
        """Fork; the child (B's daemon) runs ``server(accept)``, the parent (A's) returns
        ``client(self)``. Every run listens on a port of its own (what a previous run's
        listener left behind cannot stop it)."""
        self.port = next(_ports)

        def setup() -> Callable[[], socket.socket]:
            os.environ["SMCD_HANDOFF_SOCKET"] = str(self.b.handoff_socket)
            return self.listen()

        def client_side() -> T:
            os.environ["SMCD_HANDOFF_SOCKET"] = str(self.a.handoff_socket)
            return client(self)

        return fork_server(
            setup,
            server,
            client_side,
            what=self.kind,
            off_smc="a connection was not on SMC-R"
            + (" (smc_diag of the server end)" if self.kind == "kernel" else ""),
            timeout=CHILD_TIMEOUT,
            grace=2.0,
        )


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        b = sock.recv(n - len(out))
        if not b:
            raise ConnectionError(f"early EOF after {len(out)} of {n} bytes")
        out += b
    return bytes(out)


# ---------------------------------------------------------------------------- measurements


def _stream(write_size: int) -> tuple[memoryview, int]:
    """A random source the writer slides through in ``write_size`` windows; the period is odd so
    that successive windows land at ever different ring offsets with different bytes."""
    period = (1 << 20) + 4093
    return memoryview(os.urandom(period + write_size)), period


def throughput(pair: Pair, plan: Plan) -> tuple[float, int]:
    """Bytes per second parent → child (median of ``tput_repeats`` transfers on one connection
    after a warm-up), and the bytes whose CRC-32 matched. The clock stops at the reader's
    acknowledgement of the last byte, which carries the CRC-32 of everything it read."""
    w = plan.write_size
    total, warmup, repeats = plan.tput_bytes // w * w, plan.tput_warmup // w * w, plan.tput_repeats

    def client(p: Pair) -> tuple[float, int]:
        src, period = _stream(w)
        sizes = [warmup] + [total] * repeats
        expect = []
        off = 0
        for n in sizes:  # the expected CRC of each transfer, before any clock runs
            crc = 0
            for _ in range(n // w):
                crc = zlib.crc32(src[off : off + w], crc)
                off = (off + w) % period
            expect.append(crc)
        rates = []
        off = 0
        with p.dial() as sock:
            for i, n in enumerate(sizes):
                t0 = time.perf_counter()
                for _ in range(n // w):
                    sock.sendall(src[off : off + w])
                    off = (off + w) % period
                got = struct.unpack("!I", _recv_exactly(sock, 4))[0]
                elapsed = time.perf_counter() - t0
                if got != expect[i]:
                    raise VerifyError(f"{p.kind}: CRC-32 of transfer {i} differs")
                if i:
                    rates.append(n / elapsed)
        return statistics.median(rates), warmup + total * repeats

    def server(accept: Callable[[], socket.socket]) -> None:
        with accept() as conn:
            buf = memoryview(bytearray(RECV_BUF))
            for n in [warmup] + [total] * repeats:
                crc, left = 0, n
                while left:
                    k = conn.recv_into(buf, min(left, RECV_BUF))
                    if not k:
                        raise ConnectionError(f"early EOF with {left} of {n} bytes missing")
                    crc = zlib.crc32(buf[:k], crc)
                    left -= k
                conn.sendall(struct.pack("!I", crc))
            conn.recv(1)  # EOF

    return Pair(pair.kind, pair.a, pair.b, BULK_RMB, pair.res).run(client, server)


def pingpong(pair: Pair, plan: Plan) -> tuple[float, float, int]:
    """RTT p50 and p99 in microseconds (``rtt_size`` bytes out, the same echoed back; every
    echo compared with what went out), and the bytes checked."""
    size, rounds, warmup = plan.rtt_size, plan.rtt_rounds, plan.rtt_warmup

    def client(p: Pair) -> tuple[float, float, int]:
        clock = time.perf_counter_ns
        rtts = []
        with p.dial() as sock:
            buf = bytearray(size)
            view = memoryview(buf)
            for i in range(warmup + rounds):
                msg = struct.pack("!Q", i) * (size // 8)
                t0 = clock()
                sock.sendall(msg)
                got = 0
                while got < size:
                    k = sock.recv_into(view[got:])
                    if not k:
                        raise ConnectionError("early EOF in ping-pong")
                    got += k
                t1 = clock()
                if buf != msg:
                    raise VerifyError(f"{p.kind}: echo {i} differs from what was sent")
                if i >= warmup:
                    rtts.append(t1 - t0)
        rtts.sort()
        return _pct(rtts, 50) / 1e3, _pct(rtts, 99) / 1e3, 2 * size * (warmup + rounds)

    def server(accept: Callable[[], socket.socket]) -> None:
        with accept() as conn:
            buf = bytearray(size)
            view = memoryview(buf)
            for _ in range(warmup + rounds):
                got = 0
                while got < size:
                    k = conn.recv_into(view[got:])
                    if not k:
                        raise ConnectionError("early EOF in ping-pong")
                    got += k
                conn.sendall(buf)
            conn.recv(1)

    return pair.run(client, server)


def connect_setup(pair: Pair, plan: Plan) -> tuple[float, int]:
    """Median milliseconds from ``connect`` until the socket is usable (for smcr: TCP connect +
    handoff + CLC handshake over the link group the first connection made), each connection then
    echoing 1 byte; one untimed connection first."""
    count = plan.setup_count

    def one(p: Pair) -> float:
        t0 = time.perf_counter()
        sock = p.dial(check=False)
        elapsed = time.perf_counter() - t0
        p.check(sock)
        with sock:
            sock.sendall(b"x")
            if _recv_exactly(sock, 1) != b"x":
                raise VerifyError(f"{p.kind}: connect echo differs")
        return elapsed * 1e3

    def client(p: Pair) -> tuple[float, int]:
        one(p)
        return statistics.median(one(p) for _ in range(count)), 2 * (count + 1)

    def server(accept: Callable[[], socket.socket]) -> None:
        for _ in range(count + 1):
            with accept() as conn:
                conn.sendall(_recv_exactly(conn, 1))
                with contextlib.suppress(ConnectionResetError):
                    conn.recv(1)

    return pair.run(client, server)


def _pct(ordered: list[int], p: int) -> float:
    """Nearest-rank percentile of a sorted list."""
    rank = max(0, min(len(ordered) - 1, -(-p * len(ordered) // 100) - 1))
    return float(ordered[rank])


# ---------------------------------------------------------------------------- the run


def measure(plan: Plan, a: PrivateSmcd, b: PrivateSmcd, log: Callable[[str], None]) -> Results:
    res = Results()
    res.kernel["version"] = os.uname().release
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(kernel_smcr())
            kinds = KINDS
        except RuntimeError as e:
            res.notes.append(f"kernel: {e}")
            log(f"  kernel SMC-R not available: {e}")
            kinds = tuple(k for k in KINDS if k != "kernel")
        _measure(plan, a, b, log, res, kinds)
    return res


def _measure(
    plan: Plan,
    a: PrivateSmcd,
    b: PrivateSmcd,
    log: Callable[[str], None],
    res: Results,
    kinds: tuple[str, ...],
) -> None:
    metrics: list[tuple[str, Callable[[Pair, Plan], tuple[Any, ...]], tuple[str, ...]]] = [
        ("throughput", throughput, ("tput",)),
        ("ping-pong", pingpong, ("rtt_p50", "rtt_p99")),
        ("connect", connect_setup, ("connect_p50",)),
    ]
    for name, fn, keys in metrics:
        for kind in kinds:  # back to back, so drift of the machine hits all alike
            t0 = time.monotonic()
            try:
                *values, checked = fn(Pair(kind, a, b, res=res), plan)
            except (NotOnSmc, VerifyError, RuntimeError, OSError) as e:
                res.notes.append(f"{kind} {name}: {type(e).__name__}: {e}")
                log(f"  {kind:6} {name}: failed ({e})")
                continue
            for key, value in zip(keys, values, strict=True):
                res.figures[kind][key] = float(value)
                res.verified[kind][key] = True
            res.checked_bytes[kind] += checked
            log(f"  {kind:6} {name}: {values} ({time.monotonic() - t0:.1f} s)")


def cells(res: Results) -> list[tuple[str, ...]]:
    """The table as strings, header first (what the guest test checks)."""
    out: list[tuple[str, ...]] = [HEADER]
    for row in ROWS:
        got = {k: res.figures[k].get(row.key) for k in KINDS}
        values = tuple(_num(got[k], row.scale) for k in KINDS)
        ratios = tuple(_ratio(got[x], got[y]) for x, y in RATIOS)
        out.append((row.label, row.unit, *values, *ratios, row.better))
    return out


def _ratio(x: float | None, y: float | None) -> str:
    return NA if x is None or y is None or y == 0 else f"{x / y:.2f}x"


def render(res: Results, plan: Plan, quick: bool) -> str:
    rows = cells(res)
    widths = [max(len(r[i]) for r in rows) for i in range(len(HEADER))]
    lines = [
        "smcd SMC-R vs TCP vs the kernel's SMC-R over the same emulated link: 192.0.2.1 "
        "(smca0/rxe_a0) -> 192.0.2.2 (smcb0/rxe_b0), virtio + Soft-RoCE under qemu/TCG",
        f"{'quick' if quick else 'full'} run: throughput {plan.tput_bytes >> 20} MiB x "
        f"{plan.tput_repeats} (median) after {plan.tput_warmup >> 20} MiB warm-up; RTT "
        f"{plan.rtt_rounds} rounds after {plan.rtt_warmup}; connect {plan.setup_count} after 1; "
        "no targets under emulation",
        "",
    ]
    last = len(HEADER) - 1
    for n, r in enumerate(rows):
        parts = [r[0].ljust(widths[0]), r[1].ljust(widths[1])]
        parts += [c.rjust(w) for c, w in zip(r[2:last], widths[2:last], strict=True)]
        parts.append(r[last])
        lines.append("  ".join(parts).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    checked = ", ".join(f"{k} {res.checked_bytes[k] / (1 << 20):.1f} MiB" for k in KINDS)
    verdict = "yes" if res.complete() else "NO"
    lines += [
        "",
        f"data verified: {verdict} (CRC-32 of every throughput byte, every echo compared; "
        f"{checked})",
        _kernel_line(res),
    ]
    lines += [f"note: {n}" for n in res.notes]
    return "\n".join(lines)


def _kernel_line(res: Results) -> str:
    k = res.kernel
    modes = ", ".join(f"{m} {n}" for m, n in sorted(k.get("client_modes", {}).items())) or "none"
    rmbs = ""
    if k.get("bulk_rmb_client") is not None:
        rmbs = (
            f"; bulk RMBs the kernel chose: client {k['bulk_rmb_client'] >> 10} KiB, "
            f"server {k['bulk_rmb_server'] >> 10} KiB"
        )
    return (
        f"kernel: Linux {k.get('version', '?')}, AF_SMC on both ends; smc_diag modes of the "
        f"client ends: {modes} (server ends checked too){rmbs}"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--quick", action="store_true", help="smaller volumes (the guest test)")
    ap.add_argument("--out", type=Path, help="also write the table to this file")
    ap.add_argument("--json", type=Path, help="also write the raw figures to this file")
    ap.add_argument("--logs", type=Path, help="keep the daemons' logs and configs here")
    args = ap.parse_args(argv)
    plan = QUICK if args.quick else FULL
    # the first SMC-R connection builds the link group: seconds under TCG, more under load
    os.environ.setdefault("SMCD_HANDOFF_TIMEOUT", "120")

    def log(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    logs = args.logs or Path(tempfile.mkdtemp(prefix="smcd-bench-rdma-"))
    t0 = time.monotonic()
    try:
        with two_daemons(logs) as (a, b):
            started = time.monotonic() - t0
            log(f"two smcd daemons ready in {started:.1f} s (logs: {logs})")
            res = measure(plan, a, b, log)
            res.daemon_start_s = started
    except RuntimeError as e:
        res = Results(notes=[f"daemons: {e}"])
    table = render(res, plan, args.quick)
    print(table, flush=True)
    if args.out:
        args.out.write_text(table + "\n")
    if args.json:
        data = {
            "plan": asdict(plan),
            **asdict(res),
            "complete": res.complete(),
            "table": cells(res),
        }
        args.json.write_text(json.dumps(data, indent=1) + "\n")
    return 0 if res.complete() else 1


if __name__ == "__main__":
    sys.exit(main())
