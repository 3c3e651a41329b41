"""Checksummed streams for the guest tests' application programs.

The programs run as ``python -c`` in the guest, with the repository as their working directory,
and import this module; any socket-like object with ``sendall``/``recv``/``recv_into`` will do
(``smc_handoff`` sockets, kernel AF_SMC sockets, plain TCP). What is sent is random and hashed
on both sides (SHA-256), in odd-sized writes, so that every ring offset and every split at a
ring's wrap gets its turn.
"""

from __future__ import annotations

import hashlib
import os
import struct
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

ODD_SIZES = (65521, 1, 4093, 131071, 777, 65549, 32768, 100003, 3)
"""Write sizes of a bulk stream: around the 64 KiB ring, one byte, across two rings."""


def note(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def recv_exact(s: Any, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        b = s.recv(n - len(out))
        if not b:
            raise ConnectionError(f"EOF after {len(out)} of {n} bytes")
        out += b
    return bytes(out)


def send_odd(s: Any, data: bytes, sizes: Sequence[int] = ODD_SIZES) -> None:
    view, off, i = memoryview(data), 0, 0
    while off < len(view):
        k = sizes[i % len(sizes)]
        s.sendall(view[off : off + k])
        off += k
        i += 1


def recv_hash(
    s: Any, n: int, chunk: int = 1 << 17, progress: float | None = None
) -> tuple[str, int]:
    """Read up to ``n`` bytes (fewer at EOF): their SHA-256 and how many. ``progress``: a
    ``time.monotonic()`` start; every 8 MiB received is noted on stderr since then."""
    h, got, mark = hashlib.sha256(), 0, 8 << 20
    buf = bytearray(chunk)
    mv = memoryview(buf)
    while got < n:
        k = s.recv_into(mv, min(chunk, n - got))
        if not k:
            break
        h.update(mv[:k])
        got += k
        if progress is not None and got >= mark:
            note(f"{time.monotonic() - progress:.1f} s: {got >> 20} MiB received")
            mark += 8 << 20
    return h.hexdigest(), got


# -- many connections at once: each client sends, the server hashes and answers ---------------


def serve_many(
    srv: Any, count: int, mode: Callable[[Any], str], timeout: float | None = None
) -> dict[int, dict[str, Any]]:
    """Accept ``count`` connections, each served by a thread of its own: read a length and that
    many bytes, answer their hash and 1,001 bytes more than it read; results by peer port."""
    results: dict[int, dict[str, Any]] = {}

    def serve(c: Any, peer_port: int) -> None:
        r: dict[str, Any] = {"mode": mode(c)}
        try:
            if timeout is not None:
                c.settimeout(timeout)
            n = struct.unpack("!Q", recv_exact(c, 8))[0]
            r["recv_sha"], r["received"] = recv_hash(c, n)
            out = os.urandom(n + 1001)
            r["sent_sha"] = hashlib.sha256(out).hexdigest()
            c.sendall(bytes.fromhex(r["recv_sha"]) + struct.pack("!Q", len(out)))
            send_odd(c, out, (40009, 1, 65537, 777))
            r["eof"] = c.recv(1) == b""
        except BaseException as e:
            r["error"] = repr(e)
        finally:
            c.close()
        results[peer_port] = r

    threads = []
    for _ in range(count):
        c, addr = srv.accept()
        t = threading.Thread(target=serve, args=(c, addr[1]))
        t.start()
        threads.append(t)
    for t in threads:
        t.join(240)
    return results


def exchange_all(
    socks: Sequence[Any], mode: Callable[[Any], str], timeout: float | None = None
) -> list[dict[str, Any]]:
    """The clients of :func:`serve_many`, all at once: socket ``i`` sends 70,001 + 1,009 i
    bytes (all cross a 64 KiB ring's wrap), reads the hash and the answer."""

    def exchange(i: int) -> dict[str, Any]:
        s = socks[i]
        if timeout is not None:
            s.settimeout(timeout)
        r: dict[str, Any] = {"port": s.getsockname()[1], "mode": mode(s)}
        try:
            data = os.urandom(70001 + 1009 * i)
            r["sent_sha"] = hashlib.sha256(data).hexdigest()
            s.sendall(struct.pack("!Q", len(data)))
            send_odd(s, data, (30011, 7, 65536, 4099))
            r["echo_sha"] = recv_exact(s, 32).hex()
            n = struct.unpack("!Q", recv_exact(s, 8))[0]
            r["recv_sha"], r["received"] = recv_hash(s, n)
            r["expected"] = n
        except BaseException as e:
            r["error"] = repr(e)
        return r

    with ThreadPoolExecutor(len(socks)) as ex:
        return list(ex.map(exchange, range(len(socks))))
