"""The asyncio programs of ``make bench``'s asyncio rows: plain asyncio, aiohttp and an ASGI app
for uvicorn, nothing of smcd (``bench/asyncio_rows.py`` runs them on TCP and under ``smc-run``).

    asyncio_app.py bulk-server                  prints PORT n; per connection reads to EOF
    asyncio_app.py bulk-client PORT TOTAL WARMUP   64 KiB writes; prints JSON {"gbps": ...}
    asyncio_app.py rr-server REQ RESP            answers every REQ bytes with RESP bytes
    asyncio_app.py rr-client PORT ROUNDS WARMUP REQ RESP   prints JSON {"p50_us": ...}
    asyncio_app.py rr-self ROUNDS WARMUP REQ RESP  the same, both ends in this process
    asyncio_app.py rr-mem ROUNDS WARMUP REQ RESP   the same over a transport without I/O
    asyncio_app.py http-client PORT N WARMUP SIZE  aiohttp keep-alive GETs of SIZE bytes
    uvicorn asyncio_app:app                      GET /N answers SIZE bytes ($ASGI_SIZE)

``rr-self`` runs the server and the client of the round trip on one event loop: their work
without a wakeup across processes. ``rr-mem`` does so over :class:`MemoryTransport`, which hands
each write to the peer's protocol on the next turn of the loop: what asyncio itself costs a round
trip (streams, tasks, turns of the loop), the bound of any transport under these programs.

The bulk receiver ``read()``s (a StreamReader, as programs do) and counts; it answers the count
at EOF, so the sender's clock includes the last byte's arrival. Every figure is the program's
own clock, the user's view.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Coroutine
from typing import Any

WRITE = 64 << 10
SIZE = int(os.environ.get("ASGI_SIZE", str(64 << 10)))
_BODY = bytes(range(256)) * (SIZE // 256) + bytes(SIZE % 256)


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """The ASGI app uvicorn serves: SIZE bytes for every GET."""
    if scope["type"] != "http":
        return
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [
                (b"content-type", b"application/octet-stream"),
                (b"content-length", str(len(_BODY)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": _BODY})


async def _serve(handler: Any) -> None:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    print("PORT", server.sockets[0].getsockname()[1], flush=True)
    async with server:
        await server.serve_forever()


async def _bulk_handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    n = 0
    while data := await reader.read(1 << 20):
        n += len(data)
    writer.write(f"{n}\n".encode())
    await writer.drain()
    writer.close()


async def bulk_client(port: int, total: int, warmup: int) -> dict[str, float]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    chunk = os.urandom(WRITE)
    sent = 0
    t0 = time.perf_counter()
    while sent < warmup + total:
        if sent == warmup:
            await writer.drain()
            t0 = time.perf_counter()
        writer.write(chunk)
        sent += WRITE
        await writer.drain()
    writer.write_eof()
    got = int(await reader.readline())
    took = time.perf_counter() - t0
    writer.close()
    if got != sent:
        raise SystemExit(f"the receiver counted {got} bytes of {sent}")
    return {"gbps": total / took / 1e9}


def _rr_handler(req: int, resp: int) -> Any:
    answer = bytes(resp)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                await reader.readexactly(req)
                writer.write(answer)
                await writer.drain()
        except asyncio.IncompleteReadError:
            writer.close()

    return handle


async def rr_client(port: int, rounds: int, warmup: int, req: int, resp: int) -> dict[str, float]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    request = bytes(req)
    lat = []
    for i in range(warmup + rounds):
        t = time.perf_counter()
        writer.write(request)
        await reader.readexactly(resp)
        if i >= warmup:
            lat.append(time.perf_counter() - t)
    writer.close()
    return {"p50_us": statistics.median(lat) * 1e6}


async def rr_self(rounds: int, warmup: int, req: int, resp: int) -> dict[str, float]:
    server = await asyncio.start_server(_rr_handler(req, resp), "127.0.0.1", 0)
    try:
        return await rr_client(server.sockets[0].getsockname()[1], rounds, warmup, req, resp)
    finally:
        server.close()


class MemoryTransport(asyncio.Transport):
    """One end of an in-process stream: ``write`` hands a copy to the peer's protocol on the
    next turn of the loop, as a socket transport's read callback would (no I/O at all)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        self._loop = loop
        self.peer: MemoryTransport | None = None
        self.protocol: Any = None
        self._closing = False

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self.protocol = protocol

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self.protocol  # type: ignore[no-any-return]

    def write(self, data: Any) -> None:
        if self.peer is not None and not self._closing:
            self._loop.call_soon(self.peer.protocol.data_received, bytes(data))

    def get_write_buffer_size(self) -> int:
        return 0

    def is_closing(self) -> bool:
        return self._closing

    def close(self) -> None:
        if not self._closing:
            self._closing = True
            if self.peer is not None:
                self._loop.call_soon(self.peer.protocol.eof_received)


async def rr_mem(rounds: int, warmup: int, req: int, resp: int) -> dict[str, float]:
    loop = asyncio.get_running_loop()
    ends = []
    for _ in range(2):
        transport = MemoryTransport(loop)
        reader = asyncio.StreamReader()
        protocol = asyncio.StreamReaderProtocol(reader)
        transport.set_protocol(protocol)
        protocol.connection_made(transport)
        ends.append((reader, asyncio.StreamWriter(transport, protocol, reader, loop)))
    (c_reader, c_writer), (s_reader, s_writer) = ends
    c_writer.transport.peer = s_writer.transport  # type: ignore[attr-defined]
    s_writer.transport.peer = c_writer.transport  # type: ignore[attr-defined]
    server = asyncio.create_task(_rr_handler(req, resp)(s_reader, s_writer))
    request = bytes(req)
    lat = []
    for i in range(warmup + rounds):
        t = time.perf_counter()
        c_writer.write(request)
        await c_reader.readexactly(resp)
        if i >= warmup:
            lat.append(time.perf_counter() - t)
    c_writer.close()
    await server
    return {"p50_us": statistics.median(lat) * 1e6}


async def http_client(port: int, n: int, warmup: int, size: int) -> dict[str, float]:
    import aiohttp

    lat = []
    url = f"http://127.0.0.1:{port}/"
    connector = aiohttp.TCPConnector(limit=1)
    async with aiohttp.ClientSession(connector=connector) as session:
        t0 = time.perf_counter()
        for i in range(warmup + n):
            if i == warmup:
                t0 = time.perf_counter()
            t = time.perf_counter()
            async with session.get(url) as r:
                body = await r.read()
            if len(body) != size:
                raise SystemExit(f"a response of {len(body)} bytes, not {size}")
            if i >= warmup:
                lat.append(time.perf_counter() - t)
        took = time.perf_counter() - t0
    return {"rps": n / took, "p50_us": statistics.median(lat) * 1e6}


def main(argv: list[str]) -> None:
    role, args = argv[0], [int(a) for a in argv[1:]]
    if role == "bulk-server":
        asyncio.run(_serve(_bulk_handler))
    elif role == "rr-server":
        asyncio.run(_serve(_rr_handler(*args)))
    else:
        client: dict[str, Callable[..., Coroutine[Any, Any, dict[str, float]]]] = {
            "bulk-client": bulk_client,
            "rr-client": rr_client,
            "rr-self": rr_self,
            "rr-mem": rr_mem,
            "http-client": http_client,
        }
        print(json.dumps(asyncio.run(client[role](*args))), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
