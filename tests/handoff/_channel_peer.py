"""A channel end in its own process, driven by tests/handoff/test_channel_procs.py.

    python -m tests.handoff._channel_peer ROLE JSON

JSON holds the seven ``Channel`` constructor arguments (``fds``: the numbers the parent passed
with ``pass_fds``) and the role's parameters. Results go to stdout as one JSON line.
"""

from __future__ import annotations

import json
import random
import select
import sys
import time
import zlib
from typing import Any

from smc_handoff.channel import Channel

POOL_SIZE = 4 << 20


def make_pool(seed: int) -> bytes:
    return random.Random(seed).randbytes(POOL_SIZE)


def sendall(ch: Channel, mv: memoryview) -> None:
    while mv:
        n = ch.send_into(mv)
        if n:
            mv = mv[n:]
        elif not ch.wait_writable(10):
            raise TimeoutError("wait_writable timed out")


def recv_some(ch: Channel, buf: memoryview) -> int:
    while True:
        n = ch.recv_into(buf)
        if n or ch.eof:
            return n
        if not ch.wait_readable(10):
            raise TimeoutError("wait_readable timed out")


def source(ch: Channel, p: dict[str, Any]) -> dict[str, Any]:
    """Send ``total`` bytes in random sizes 1..max_write from a random pool; then SHUT_WR and
    wait for the peer's EOF (its own shutdown) before closing."""
    rng = random.Random(p["seed"])
    pool = memoryview(make_pool(p["seed"]))
    total, max_write = p["total"], p["max_write"]
    crc = sent = writes = 0
    t0 = time.perf_counter()
    while sent < total:
        size = min(rng.randint(1, max_write), total - sent)
        off = rng.randrange(0, POOL_SIZE - size)
        chunk = pool[off : off + size]
        sendall(ch, chunk)
        crc = zlib.crc32(chunk, crc)
        sent += size
        writes += 1
    ch.shutdown_write()
    elapsed = time.perf_counter() - t0
    buf = memoryview(bytearray(16))
    while recv_some(ch, buf):
        pass
    stats = ch.stats()
    ch.close()
    return {"crc": crc, "bytes": sent, "writes": writes, "seconds": elapsed, "stats": stats}


def sink(ch: Channel, p: dict[str, Any]) -> dict[str, Any]:
    """Read until EOF with reads of random sizes, checksum, then SHUT_WR and close."""
    rng = random.Random(p["seed"] + 1)
    buf = memoryview(bytearray(p.get("max_read", 1 << 20)))
    crc = got = reads = 0
    while True:
        want = rng.randint(1, len(buf))
        n = recv_some(ch, buf[:want])
        if not n:
            break
        crc = zlib.crc32(buf[:n], crc)
        got += n
        reads += 1
    ch.shutdown_write()
    stats = ch.stats()
    ch.close()
    return {"crc": crc, "bytes": got, "reads": reads, "stats": stats}


def echo(ch: Channel, p: dict[str, Any]) -> dict[str, Any]:
    """Echo everything until EOF, then close (using select on fileno() if asked)."""
    use_select = p.get("select", False)
    buf = memoryview(bytearray(1 << 16))
    total = 0
    fd = ch.fileno() if use_select else -1
    while True:
        if use_select:
            r, _, _ = select.select([fd], [], [], 10)
            if not r:
                raise TimeoutError("select timed out")
            n = ch.recv_into(buf)
            if not n and not ch.eof:
                continue  # a spurious wakeup is allowed; level state is re-synced
        else:
            n = recv_some(ch, buf)
        if not n:
            break
        sendall(ch, buf[:n])
        total += n
    ch.close()
    return {"bytes": total}


def hold(ch: Channel, p: dict[str, Any]) -> dict[str, Any]:
    """Announce readiness, then optionally stream data forever (until killed)."""
    print(json.dumps({"ready": True}), flush=True)
    if p.get("stream"):
        chunk = memoryview(bytes(p.get("chunk", 4096)))
        while True:
            sendall(ch, chunk)
    time.sleep(3600)
    return {}


def send_then(ch: Channel, p: dict[str, Any]) -> dict[str, Any]:
    """Send ``data`` then do ``then``: close, shutdown (and wait for EOF), or abort."""
    sendall(ch, memoryview(p["data"].encode()))
    then = p["then"]
    if then == "close":
        ch.close()
    elif then == "abort":
        ch.abort()
    elif then == "shutdown":
        ch.shutdown_write()
        buf = memoryview(bytearray(1024))
        got = bytearray()
        while n := recv_some(ch, buf):
            got += buf[:n]
        ch.close()
        return {"received": got.decode()}
    return {}


def recv_then_close(ch: Channel, p: dict[str, Any]) -> dict[str, Any]:
    """Wait for ``n`` bytes to be *available*, read ``read`` of them, then close."""
    deadline = time.monotonic() + 10
    while ch.stats()["rx_prod"] == (0, 0) and time.monotonic() < deadline:
        ch.wait_readable(1)
    time.sleep(0.05)
    buf = memoryview(bytearray(p["read"]))
    got = ch.recv_into(buf) if p["read"] else 0
    ch.close()
    return {"read": got}


ROLES = {
    "source": source,
    "sink": sink,
    "echo": echo,
    "hold": hold,
    "send_then": send_then,
    "recv_then_close": recv_then_close,
}


def main() -> int:
    role, arg = sys.argv[1], json.loads(sys.argv[2])
    fds = arg["fds"]
    ch = Channel(*fds)
    result = ROLES[role](ch, arg)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
