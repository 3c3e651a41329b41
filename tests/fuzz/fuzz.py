"""``make fuzz``: a million hostile inputs through every decoder and a live daemon's handoff socket.

``make test`` keeps its 100,000 (tests/wire/test_fuzz.py, tests/handoff/test_messages.py,
tests/e2e/test_fuzz_handoff.py); this runs the same generators at ``--count`` inputs per part
(default 1,000,000), spread over the CPUs:

- **wire**: every decoder of :data:`tests.wire.test_fuzz.DECODERS` (CLC, LLC, CDC, the SMC-D CDC
  header, the detecting decoder) on each input, with the round-trip check of ``check_one``;
- **handoff messages**: ``decode``/``decode_request``/``decode_reply`` of
  :mod:`smc_handoff.messages` on random bytes, mutated valid messages and forged headers; what
  decodes must be canonical (its encoding is the input);
- **handoff socket**: a private smcd (``PrivateSmcd``) gets each input as a datagram on a fresh
  connection, with wrong descriptors on a third of them, and abrupt hang-ups; it must answer
  ERROR/OK or hang up, within 10 s, and at the end be alive, hold no more descriptors than
  before, have logged no traceback and still hand off a real connection.

Only ``ProtocolError``/``HandoffProtocolError`` are allowed outcomes for bad input: anything else
is printed with the input's hex and makes the exit status 1. The seeds are fixed per chunk, so a
failure reproduces with the same ``--count``/``--seed``.

    python -m tests.fuzz.fuzz --count 1000000 [--socket-count N] [--jobs 2] [--seed S]
"""

from __future__ import annotations

import argparse
import array
import io
import multiprocessing
import os
import random
import socket
import sys
import threading
import time
from collections import Counter
from typing import Any

from smc_handoff import messages as m
from smcd_daemon.errors import ProtocolError

CHUNK = 20_000
"""Inputs per work unit (one seed each)."""
MAX_FAILURES = 20
UEID_CONFIG = '[eid]\nueids = ["SMCD-FUZZ"]\n'
"""SMC-Dv2 needs a UEID in common: without one, loopback connections decline with NOUEID."""


# ------------------------------------------------------------------------------------- wire


def wire_chunk(seed: int, count: int) -> tuple[int, dict[str, list[int]], list[str]]:
    """``count`` inputs of the wire fuzzer through every decoder: (inputs, {decoder: [accepted,
    rejected]}, failures)."""
    from tests.wire.test_fuzz import DECODERS, check_one, inputs

    stats = {name: [0, 0] for name, _ in DECODERS}
    failures: list[str] = []
    n = 0
    for data in inputs(seed, count):
        n += 1
        for name, decode in DECODERS:
            try:
                decode(data)
            except ProtocolError:
                stats[name][1] += 1
                continue
            except Exception as exc:
                if len(failures) < MAX_FAILURES:
                    failures.append(f"{name} raised {type(exc).__name__}: {exc} on {data.hex()}")
                continue
            stats[name][0] += 1
            problem = check_one(name, decode, data)  # decoded: it must round-trip
            if problem is not None and len(failures) < MAX_FAILURES:
                failures.append(problem)
    return n, stats, failures


# --------------------------------------------------------------------------- handoff messages


def handoff_inputs(rng: random.Random, count: int) -> list[bytes]:
    """The generators of tests/handoff/test_messages.py and tests/e2e/test_fuzz_handoff.py."""
    from tests.e2e.test_fuzz_handoff import _datagram
    from tests.handoff.test_messages import ALL

    seeds = [m.encode(msg) for msg in ALL]
    out = []
    for i in range(count):
        kind = i % 4
        if kind == 0:
            data = rng.randbytes(rng.randrange(0, 64))
        elif kind == 1:
            b = bytearray(rng.choice(seeds))
            for _ in range(rng.randrange(1, 4)):
                b[rng.randrange(len(b))] = rng.randrange(256)
            if rng.random() < 0.2:
                del b[rng.randrange(len(b) + 1) :]
            data = bytes(b)
        elif kind == 2:
            body = rng.randbytes(rng.randrange(0, 40))
            mtype = rng.choice(list(m.MessageType))
            length = len(body) if rng.random() < 0.8 else rng.randrange(2**32)
            data = m.HEADER.pack(m.MAGIC, m.VERSION, mtype, 0, length) + body
        else:
            data = _datagram(rng)
        out.append(data)
    return out


HANDOFF_DECODERS = (
    ("messages.decode", m.decode),
    ("messages.decode_request", m.decode_request),
    ("messages.decode_reply", m.decode_reply),
)


def handoff_chunk(seed: int, count: int) -> tuple[int, dict[str, list[int]], list[str]]:
    stats = {name: [0, 0] for name, _ in HANDOFF_DECODERS}
    failures: list[str] = []
    data_list = handoff_inputs(random.Random(seed), count)
    for data in data_list:
        for name, decode in HANDOFF_DECODERS:
            try:
                msg = decode(data)
            except m.HandoffProtocolError:
                stats[name][1] += 1
                continue
            except Exception as exc:
                if len(failures) < MAX_FAILURES:
                    failures.append(f"{name} raised {type(exc).__name__}: {exc} on {data.hex()}")
                continue
            stats[name][0] += 1
            if m.encode(msg) != data and len(failures) < MAX_FAILURES:
                failures.append(f"{name}: {msg!r} decoded from non-canonical {data.hex()}")
    return len(data_list), stats, failures


# ---------------------------------------------------------------------------- handoff socket


def _wrong_fds() -> tuple[list[int], list[Any]]:
    """Descriptors of every wrong kind (and the objects that keep them open)."""
    r, w = os.pipe()
    devnull = os.open(os.devnull, os.O_RDONLY)
    efd = os.eventfd(0)
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    listening = socket.create_server(("127.0.0.1", 0))
    unconnected = socket.socket()
    keep = [udp, listening, unconnected]
    return [r, w, devnull, efd, udp.fileno(), listening.fileno(), unconnected.fileno()], keep


def socket_chunk(path: str, seed: int, count: int) -> tuple[int, Counter[str], list[str]]:
    """``count`` datagrams, each on a fresh handoff connection: outcomes by kind, failures."""
    rng = random.Random(seed)
    wrong, keep = _wrong_fds()
    outcomes: Counter[str] = Counter()
    failures: list[str] = []
    data_list = handoff_inputs(rng, count)
    try:
        for i, data in enumerate(data_list):
            fds = rng.sample(wrong, rng.choice([0, 0, 1, 1, 2, 3])) if i % 3 else []
            hang = rng.random()
            try:
                with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
                    s.settimeout(10)
                    for _ in range(1000):
                        try:
                            s.connect(path)
                            break
                        except BlockingIOError:  # the listen queue is full: wait, count it
                            outcomes["listen queue full (retried)"] += 1
                            time.sleep(0.01)
                    if hang < 0.03:  # connect and hang up
                        outcomes["hung up before sending"] += 1
                        continue
                    if len(data) > m.MAX_MESSAGE + 200:
                        data = data[: m.MAX_MESSAGE + 200]
                    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())]
                    s.sendmsg([data], anc if fds else [])
                    if hang < 0.06:  # send and hang up without reading
                        outcomes["hung up after sending"] += 1
                        continue
                    reply = s.recv(m.MAX_MESSAGE + 1)
            except TimeoutError:
                failures.append(f"no answer within 10 s to {data.hex()}")
                continue
            except (ConnectionResetError, BrokenPipeError):
                outcomes["daemon hung up"] += 1
                continue
            if not reply:
                outcomes["daemon hung up"] += 1
                continue
            try:
                answer = m.decode_reply(reply)
            except m.HandoffProtocolError as exc:
                failures.append(f"the daemon's reply {reply.hex()} does not decode: {exc}")
                continue
            if isinstance(answer, m.Error):
                outcomes[f"ERROR {answer.code.name}"] += 1
            elif isinstance(answer, m.Ok):
                outcomes["OK (a LISTEN on a listening socket)"] += 1
            else:
                failures.append(f"unexpected reply {answer!r} to {data.hex()}")
    finally:
        for fd in wrong[:4]:
            os.close(fd)
        for obj in keep:
            obj.close()
    return len(data_list), outcomes, failures[:MAX_FAILURES]


def _daemon_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def real_handoff_works(env: dict[str, str]) -> str | None:
    """One real connection handed off on both halves, data checked; None if all was well."""
    os.environ.update(env)
    import smc_handoff

    payload = random.Random(7).randbytes(100_003)
    got: dict[str, Any] = {}
    with smc_handoff.listen(("127.0.0.1", 0)) as server:
        if not server.registered:
            return f"the listener could not register: {server.fallback}"

        def serve() -> None:
            conn, _ = server.accept()
            got["mode"] = conn.mode
            got["fallback"] = conn.fallback
            buf = b""
            while len(buf) < len(payload):
                piece = conn.recv(65536)
                if not piece:
                    break
                buf += piece
            got["data"] = buf
            conn.close()

        t = threading.Thread(target=serve, daemon=True)
        t.start()
        client = smc_handoff.connect(server.getsockname(), timeout=10)
        client_mode, client_fallback = client.mode, client.fallback
        client.sendall(payload)
        client.close()
        t.join(20)
    if client_mode != "smcd" or got.get("mode") != "smcd":
        return (
            f"not SMC-D after the fuzz: client {client_mode} ({client_fallback}), "
            f"server {got.get('mode')} ({got.get('fallback')})"
        )
    if got.get("data") != payload:
        return "the data of the real handoff after the fuzz was not byte-exact"
    return None


# ------------------------------------------------------------------------------------- main


def _chunks(total: int, seed: int) -> list[tuple[int, int]]:
    return [(seed + i, min(CHUNK, total - off)) for i, off in enumerate(range(0, total, CHUNK))]


def _merge(results: list[tuple[int, dict[str, list[int]], list[str]]]) -> tuple[int, Any, Any]:
    total = 0
    stats: dict[str, list[int]] = {}
    failures: list[str] = []
    for n, st, fl in results:
        total += n
        for k, (a, b) in st.items():
            s = stats.setdefault(k, [0, 0])
            s[0] += a
            s[1] += b
        failures += fl
    return total, stats, failures


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--count", type=int, default=1_000_000, help="inputs per decoder part")
    ap.add_argument(
        "--socket-count", type=int, default=None, help="datagrams to the live daemon (--count)"
    )
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--seed", type=int, default=0x5_3C_D0)
    args = ap.parse_args(argv)
    if isinstance(sys.stdout, io.TextIOWrapper):
        sys.stdout.reconfigure(line_buffering=True)  # progress shows in a log file too
    socket_count = args.count if args.socket_count is None else args.socket_count
    ok = True
    started = time.monotonic()
    ctx = multiprocessing.get_context("fork")

    with ctx.Pool(args.jobs) as pool:
        for part, fn, seed in (
            ("wire decoders (CLC, LLC, CDC)", wire_chunk, args.seed),
            ("handoff message decoders", handoff_chunk, args.seed + 1_000_000),
        ):
            t0 = time.monotonic()
            total, stats, failures = _merge(pool.starmap(fn, _chunks(args.count, seed)))
            print(f"{part}: {total:,} inputs in {time.monotonic() - t0:.0f} s")
            for name, (acc, rej) in stats.items():
                print(
                    f"  {name:28} {acc + rej:>10,} decoded: {acc:>9,} accepted, {rej:>9,} refused"
                )
            for f in failures[:MAX_FAILURES]:
                print(f"  FAIL {f}")
            ok &= not failures and total >= args.count

    from smcd_daemon.demo import PrivateSmcd

    # log level error: tracebacks are logged at ERROR, the per-datagram warnings are not wanted
    daemon = PrivateSmcd(name="fuzz", log_level="error", config_text=UEID_CONFIG)
    daemon.start()
    try:
        assert daemon.proc is not None
        pid = daemon.proc.pid
        path = os.fspath(daemon.handoff_socket)
        fds_before = _daemon_fds(pid)
        t0 = time.monotonic()
        outcomes: Counter[str] = Counter()
        failures = []
        with ctx.Pool(args.jobs) as pool:
            chunks = [(path, s, n) for s, n in _chunks(socket_count, args.seed + 2_000_000)]
            for _n, oc, fl in pool.starmap(socket_chunk, chunks):
                outcomes.update(oc)
                failures += fl
        sent = sum(outcomes.values()) + len(failures)
        print(f"handoff socket of a live smcd: {sent:,} datagrams in {time.monotonic() - t0:.0f} s")
        for what, n in sorted(outcomes.items(), key=lambda kv: -kv[1]):
            print(f"  {what:40} {n:>10,}")
        time.sleep(0.5)  # the last hang-ups are processed
        alive = daemon.proc.poll() is None
        fds_after = _daemon_fds(pid) if alive else -1
        log = daemon.log()
        tracebacks = log.count("Traceback")
        problem = real_handoff_works(daemon.env) if alive else "the daemon died"
        print(
            f"  daemon alive: {alive}; descriptors {fds_before} before, {fds_after} after; "
            f"tracebacks in its log: {tracebacks}; real handoff afterwards: {problem or 'OK'}"
        )
        for f in failures[:MAX_FAILURES]:
            print(f"  FAIL {f}")
        if tracebacks:
            i = log.index("Traceback")
            print("  first traceback:\n" + log[max(0, i - 200) : i + 2000])
        ok &= (
            not failures
            and alive
            and fds_after <= fds_before + 2
            and not tracebacks
            and problem is None
            and sent >= socket_count
        )
    finally:
        daemon.cleanup()
    print(f"fuzz: {'PASS' if ok else 'FAIL'} in {time.monotonic() - started:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
