"""trio programs for ``make bench``'s event-loop rows: nothing of smcd in them (smc-run upgrades
them as they are, ``smc_handoff/trio_loop.py``).

    python bench/trio_app.py bulk-server          prints "PORT n", counts what each client sends
    python bench/trio_app.py bulk-client PORT TOTAL WARMUP
    python bench/trio_app.py rr-server REQ RESP   prints "PORT n", answers REQ bytes with RESP
    python bench/trio_app.py rr-client PORT ROUNDS WARMUP REQ RESP

Clients print one JSON line: ``gbps`` (bulk, 64 KiB ``send_all``s, after WARMUP bytes) or
``p50_us`` (round trips, after WARMUP rounds), as ``bench/asyncio_app.py``'s do.
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import sys
import time
from typing import Any

import trio

WRITE = 64 << 10


async def _serve(handler: Any) -> None:
    async with trio.open_nursery() as nursery:
        serve = functools.partial(trio.serve_tcp, host="127.0.0.1")
        listeners = await nursery.start(serve, handler, 0)
        print("PORT", listeners[0].socket.getsockname()[1], flush=True)


async def _bulk_handler(stream: trio.SocketStream) -> None:
    n = 0
    while data := await stream.receive_some(1 << 20):
        n += len(data)
    await stream.send_all(f"{n}\n".encode())
    await stream.aclose()


async def _exactly(stream: trio.SocketStream, n: int) -> bytes:
    got = bytearray()
    while len(got) < n:
        data = await stream.receive_some(n - len(got))
        if not data:
            raise EOFError(f"EOF after {len(got)} of {n} bytes")
        got += data
    return bytes(got)


async def bulk_client(port: int, total: int, warmup: int) -> dict[str, float]:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    chunk = os.urandom(WRITE)
    sent = 0
    t0 = time.perf_counter()
    while sent < warmup + total:
        if sent == warmup:
            t0 = time.perf_counter()
        await stream.send_all(chunk)
        sent += WRITE
    await stream.send_eof()
    got = int((await _exactly_line(stream)).decode())
    took = time.perf_counter() - t0
    await stream.aclose()
    if got != sent:
        raise SystemExit(f"the receiver counted {got} bytes of {sent}")
    return {"gbps": total / took / 1e9}


async def _exactly_line(stream: trio.SocketStream) -> bytes:
    line = bytearray()
    while not line.endswith(b"\n"):
        data = await stream.receive_some(64)
        if not data:
            break
        line += data
    return bytes(line)


def _rr_handler(req: int, resp: int) -> Any:
    answer = bytes(resp)

    async def handle(stream: trio.SocketStream) -> None:
        try:
            while True:
                await _exactly(stream, req)
                await stream.send_all(answer)
        except (EOFError, trio.BrokenResourceError):
            await stream.aclose()

    return handle


async def rr_client(port: int, rounds: int, warmup: int, req: int, resp: int) -> dict[str, float]:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    request = bytes(req)
    lat = []
    for i in range(warmup + rounds):
        t = time.perf_counter()
        await stream.send_all(request)
        await _exactly(stream, resp)
        if i >= warmup:
            lat.append(time.perf_counter() - t)
    await stream.aclose()
    return {"p50_us": statistics.median(lat) * 1e6}


def main(argv: list[str]) -> None:
    role, args = argv[0], [int(a) for a in argv[1:]]
    if role == "bulk-server":
        trio.run(_serve, _bulk_handler)
    elif role == "rr-server":
        trio.run(_serve, _rr_handler(*args))
    else:
        client = {"bulk-client": bulk_client, "rr-client": rr_client}[role]
        print(json.dumps(trio.run(client, *args)), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
