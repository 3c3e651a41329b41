"""Unmodified asyncio programs for the smc-run tests and the bench: they know nothing of SMC.

Each is a script run as ``smc-run [-v] python -c PROGRAM ARGS`` (or without smc-run, on TCP).
They report on stdout, one line per event, so the harness can check every byte end to end.
"""

from __future__ import annotations

STREAMS = r'''
"""asyncio streams: 'server' counts and hashes what it reads (or aborts, or stalls), 'client'
sends N bytes in 64 KiB writes, waiting for a line on stdin after the first write."""
import asyncio, hashlib, random, socket, sys

role, mode = sys.argv[1], sys.argv[2]

async def handle(reader, writer):
    if mode == "abort":  # read one line, stop reading, abort with data unread: a reset on TCP
        await reader.readline()
        writer.transport.pause_reading()
        writer.write(b"partial\n")
        await writer.drain()
        await asyncio.sleep(0.5)  # the client's next bytes arrive, unread
        writer.transport.abort()
        return
    if mode == "close":
        await reader.readline()
        writer.write(b"bye\n")
        await writer.drain()
        writer.close()
        await writer.wait_closed()
        return
    h, n = hashlib.sha256(), 0
    if mode == "stall":  # after the first byte, read nothing for 1.5 s: the client's ring
        h.update(await reader.readexactly(1))  # and buffer fill up
        n = 1
        await asyncio.sleep(2)
    while data := await reader.read(1 << 16):
        h.update(data)
        n += len(data)
    writer.write(f"{n} {h.hexdigest()}\n".encode())
    await writer.drain()
    writer.close()
    await writer.wait_closed()

async def server():
    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    print("port", srv.sockets[0].getsockname()[1], flush=True)
    async with srv:
        await srv.serve_forever()

class Counting(asyncio.Protocol):
    """A protocol of the program's own: counts flow control and keeps what arrives."""
    def __init__(self):
        self.paused = self.resumed = 0
        self.data = bytearray()
        self.lost = asyncio.get_running_loop().create_future()
        self.can_write = asyncio.Event()
        self.can_write.set()
    def pause_writing(self):
        self.paused += 1
        self.can_write.clear()
    def resume_writing(self):
        self.resumed += 1
        self.can_write.set()
    def data_received(self, data):
        self.data += data
    def eof_received(self):
        return False
    def connection_lost(self, exc):
        self.lost.set_result(exc)

def space(transport):
    return getattr(transport, "space_waits", -1), getattr(transport, "space_wakeups", -1)

async def watch(transport):
    """While the server reads nothing, the transport must wait for the peer's signal, not
    retry on a timer: its count of waits and wake-ups stays still (the writer keeps the
    buffer above the high-water mark meanwhile)."""
    await asyncio.sleep(0.3)  # the server's reader fills its own buffer, then stops
    before = space(transport)
    await asyncio.sleep(0.5)
    return [before, space(transport), transport.get_write_buffer_size()]

async def client(port, n):
    loop = asyncio.get_running_loop()
    if mode in ("abort", "close"):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"line\n")
        print("connected", flush=True)
        print("got", (await reader.readline()).decode().strip(), flush=True)
        if mode == "abort":
            writer.write(b"x" * 1000)
        try:
            rest = await reader.read()
            print("eof", len(rest), flush=True)
        except OSError as e:
            print("error", type(e).__name__, flush=True)
        return
    transport, proto = await loop.create_connection(Counting, "127.0.0.1", port)
    rng = random.Random(7)
    h = hashlib.sha256()
    sent = 0
    stall = []
    while sent < n:
        chunk = rng.randbytes(min(65536, n - sent))
        await proto.can_write.wait()
        transport.write(chunk)
        h.update(chunk)
        sent += len(chunk)
        if sent == len(chunk):
            tcp = transport.get_extra_info("socket")  # asyncio sets TCP_NODELAY on it
            nodelay = tcp.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
            print("connected", type(transport).__name__, "nodelay", nodelay, flush=True)
            await loop.run_in_executor(None, sys.stdin.readline)
        if mode == "stall" and not stall and proto.paused:
            stall.append(asyncio.create_task(watch(transport)))
    transport.write_eof()
    await proto.lost
    print("stall", *(await stall[0] if stall else []), flush=True)
    print("sent", sent, h.hexdigest(), "paused", proto.paused, "resumed", proto.resumed,
          "wakeups", getattr(transport, "space_wakeups", -1), flush=True)
    print("reply", proto.data.decode().strip(), flush=True)

if role == "server":
    asyncio.run(server())
else:
    asyncio.run(client(int(sys.argv[3]), int(sys.argv[4])))
'''

ASGI_APP = r'''
"""An ASGI app for uvicorn: GET /N answers SIZE pseudo-random bytes seeded by N."""
import os, random

SIZE = int(os.environ.get("ASGI_SIZE", "65536"))

async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    seed = int(scope["path"].strip("/") or "0")
    body = random.Random(seed).randbytes(SIZE)
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/octet-stream"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
'''

AIOHTTP_CLIENT = r'''
"""aiohttp keep-alive client: N GETs on one connection, each body checked; waits for a line on
stdin after the first. Prints the p50 latency and requests/s."""
import asyncio, hashlib, random, statistics, sys, time
import aiohttp

port, n, size = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
wait = len(sys.argv) > 4 and sys.argv[4] == "wait"

async def main():
    conn = aiohttp.TCPConnector(limit=1, force_close=False)
    bad = 0
    lat = []
    async with aiohttp.ClientSession(connector=conn) as session:
        t0 = time.perf_counter()
        for i in range(n):
            t = time.perf_counter()
            async with session.get(f"http://127.0.0.1:{port}/{i}") as resp:
                body = await resp.read()
            lat.append(time.perf_counter() - t)
            if body != random.Random(i).randbytes(size):
                bad += 1
            if i == 0:
                print("started", resp.status, flush=True)
                if wait:
                    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
                t0 = time.perf_counter()
                lat.clear()
        total = time.perf_counter() - t0
    print("done", n, "bad", bad, "p50_us", round(statistics.median(lat) * 1e6, 1),
          "rps", round((n - 1) / total, 1), flush=True)

asyncio.run(main())
'''

SOCK_METHODS = r'''
"""asyncio's low-level socket methods on a program's own sockets: sock_accept/sock_connect,
sock_sendall (8 MiB, more than a ring), sock_recv/sock_recv_into until EOF, hashed."""
import asyncio, hashlib, random, socket, sys

async def server():
    loop = asyncio.get_running_loop()
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen()
    lsock.setblocking(False)
    print("port", lsock.getsockname()[1], flush=True)
    conn, _ = await loop.sock_accept(lsock)
    conn.setblocking(False)
    h, n, buf = hashlib.sha256(), 0, bytearray(100_000)
    while k := await loop.sock_recv_into(conn, buf):
        h.update(buf[:k])
        n += k
    await loop.sock_sendall(conn, f"{n} {h.hexdigest()}\n".encode())
    conn.close()

async def client(port, n):
    loop = asyncio.get_running_loop()
    s = socket.socket()
    s.setblocking(False)
    await loop.sock_connect(s, ("127.0.0.1", port))
    data = random.Random(3).randbytes(n)
    await loop.sock_sendall(s, data)
    s.shutdown(socket.SHUT_WR)
    reply = b""
    while chunk := await loop.sock_recv(s, 1000):
        reply += chunk
    print("sent", n, hashlib.sha256(data).hexdigest(), flush=True)
    print("reply", reply.decode().strip(), flush=True)

if sys.argv[1] == "server":
    asyncio.run(server())
else:
    asyncio.run(client(int(sys.argv[2]), int(sys.argv[3])))
'''

TLS_PAIR = r'''
"""An asyncio TLS echo (ssl= on both sides) and, beside it, a plain one: under smc-run both
are upgraded (TLS runs over the channel) and carry their bytes; each echo line says the mode
of the connection beneath the client's transport and the TLS version."""
import asyncio, ssl, sys

cert, key = sys.argv[1], sys.argv[2]

async def echo(reader, writer):
    writer.write(await reader.readline())
    await writer.drain()
    writer.close()

async def main():
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(cert, key)
    client_ctx = ssl.create_default_context(cafile=cert)
    tls = await asyncio.start_server(echo, "127.0.0.1", 0, ssl=server_ctx)
    plain = await asyncio.start_server(echo, "127.0.0.1", 0)
    tls_port = tls.sockets[0].getsockname()[1]
    plain_port = plain.sockets[0].getsockname()[1]
    print("ports", tls_port, plain_port, flush=True)
    for port, ctx in ((tls_port, client_ctx), (plain_port, None)):
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", port, ssl=ctx, server_hostname="localhost" if ctx else None)
        writer.write(b"over %d\n" % port)
        line = (await reader.readline()).decode().strip()
        smc = writer.get_extra_info("smc_socket")
        obj = writer.get_extra_info("ssl_object")
        print("echo", line, smc.mode if smc is not None else "tcp",
              obj.version() if obj is not None else "plain", flush=True)
        writer.close()
    tls.close()
    plain.close()

asyncio.run(main())
'''

STARTTLS = r'''
"""asyncio STARTTLS (as aiosmtpd or an IMAP server does it): a plaintext exchange, then
StreamWriter.start_tls() at both ends, three times; each line says what the client read, the
TLS version and the mode of the connection beneath the TLS transport."""
import asyncio, ssl, sys

cert, key = sys.argv[1], sys.argv[2]

async def serve(reader, writer):
    writer.write(b"220 ready\r\n")
    await writer.drain()
    assert await reader.readline() == b"STARTTLS\r\n"
    writer.write(b"220 go ahead\r\n")
    await writer.drain()
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert, key)
    await writer.start_tls(ctx)
    data = await reader.readline()
    writer.write(b"got %d\n" % len(data))
    await writer.drain()
    writer.close()

async def main():
    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    ctx = ssl.create_default_context(cafile=cert)
    for _ in range(3):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        assert await reader.readline() == b"220 ready\r\n"
        writer.write(b"STARTTLS\r\n")
        await writer.drain()
        assert await reader.readline() == b"220 go ahead\r\n"
        await writer.start_tls(ctx, server_hostname="localhost")
        writer.write(b"t" * 30000 + b"\n")
        await writer.drain()
        got = (await reader.readline()).decode().strip()
        beneath = writer.get_extra_info("smc_socket")
        print(got, writer.get_extra_info("ssl_object").version(),
              beneath.mode if beneath is not None else "tcp", flush=True)
        writer.close()
    server.close()

asyncio.run(main())
'''

UVLOOP = r'''
"""A streams echo on uvloop's event loop (its transports are libuv's own): under smc-run it
runs on TCP, and -v says why for the listener and the connection."""
import asyncio
import uvloop

async def echo(reader, writer):
    writer.write(await reader.readline())
    await writer.drain()
    writer.close()

async def main():
    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"over %d\n" % port)
    line = (await reader.readline()).decode().strip()
    print("echo", line, type(asyncio.get_running_loop()).__module__, flush=True)
    writer.close()
    server.close()

uvloop.run(main())
'''

TRIO = r'''
"""trio (its own epoll loop over non-blocking stdlib sockets) under smc-run: an echo server,
trio clients, or both in one process. Each client sends its own pattern while it reads the
echo back, then half-closes; "intact N of M" counts the echoes that came back whole.

    both N          a server and N clients in this process
    server          a server: prints "port P", serves until killed
    client P N      N clients of the server at port P
    cancel N        a server, and N connects cancelled at 0.2-2.1 ms (move_on_after), some
                    during the TCP connect, some during the handoff; then one echo more
    burst N         a server and N clients connecting at once, 1 KiB each"""
import functools, sys
import trio

async def echo(stream):
    try:
        async for data in stream:
            await stream.send_all(data)
    except trio.BrokenResourceError:
        pass

async def client(port, i, size, results):
    data = bytes((j * 7 + i) % 251 for j in range(size))
    got = bytearray()
    async with await trio.open_tcp_stream("127.0.0.1", port) as stream:
        async def send():
            for k in range(0, size, 65536):
                await stream.send_all(data[k:k + 65536])
            await stream.send_eof()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(send)
            while chunk := await stream.receive_some(65536):
                got += chunk
    results.append(bytes(got) == data)

async def clients(port, n, size=None):
    results = []
    async with trio.open_nursery() as nursery:
        for i in range(n):
            nursery.start_soon(client, port, i, size or 100_000 + i * 300_000, results)
    print("port", port, "intact", sum(results), "of", len(results), flush=True)

async def cancelled_connects(port, n):
    cancelled = 0
    for i in range(n):
        with trio.move_on_after(0.0002 + (i % 20) * 0.0001) as scope:
            async with await trio.open_tcp_stream("127.0.0.1", port) as stream:
                await stream.send_all(b"x")
                assert await stream.receive_some(1) == b"x"
        cancelled += scope.cancelled_caught
    async with await trio.open_tcp_stream("127.0.0.1", port) as stream:
        await stream.send_all(b"ok")
        print("cancelled", cancelled, "of", n, "then", (await stream.receive_some(2)).decode(),
              flush=True)

async def main(role, *args):
    async with trio.open_nursery() as nursery:
        serve = functools.partial(trio.serve_tcp, host="127.0.0.1")
        if role == "client":
            await clients(int(args[0]), int(args[1]))
            return
        listeners = await nursery.start(serve, echo, 0)
        port = listeners[0].socket.getsockname()[1]
        if role == "server":
            print("port", port, flush=True)
            return
        if role == "cancel":
            await cancelled_connects(port, int(args[0]))
        else:
            await clients(port, int(args[0]), 1024 if role == "burst" else None)
        nursery.cancel_scope.cancel()

trio.run(main, *sys.argv[1:])
'''
