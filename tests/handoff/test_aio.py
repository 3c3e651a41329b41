"""asyncio streams over SMC (a real channel handed over by MiniDaemon) and over TCP."""

from __future__ import annotations

import asyncio
import hashlib
import os
import socket
from pathlib import Path
from typing import Any

import pytest

from smc_handoff import aio, layout
from smc_handoff import messages as m
from smc_handoff.aio_transport import SmcTransport, run_handoff
from smc_handoff.socket import connect, listen
from tests.handoff.test_socket import MiniDaemon


@pytest.fixture(params=["smcd", "tcp"])
def setup(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> object:
    if request.param == "tcp":
        monkeypatch.setenv("SMCD_HANDOFF_SOCKET", str(tmp_path / "absent.sock"))
        yield "tcp"
        return
    d = MiniDaemon(tmp_path / "h.sock", dmb_size=16384)
    monkeypatch.setenv("SMCD_HANDOFF_SOCKET", str(d.path))
    yield "smcd"
    d.stop()


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(100_000):
        writer.write(data)
        await writer.drain()
    writer.close()
    await writer.wait_closed()


def test_echo_streams(setup: str) -> None:
    """3 MiB echoed through 16 KiB rings: backpressure both ways, EOF via write_eof."""

    async def main() -> None:
        async with await aio.start_server(_echo, "127.0.0.1", 0) as server:
            port = server.sockets[0].getsockname()[1]
            assert server.registered == (setup == "smcd")
            reader, writer = await aio.open_connection("127.0.0.1", port)
            sock = aio.smc_socket(writer)
            assert sock.mode == setup
            if setup == "tcp":
                assert sock.fallback is not None
                assert sock.fallback.code == m.FALLBACK_DAEMON_UNAVAILABLE
            else:
                assert sock.fallback is None
                assert writer.get_extra_info("peername") == ("127.0.0.1", port)
            data = os.urandom(3 << 20)

            async def send() -> None:
                for i in range(0, len(data), 50_001):
                    writer.write(data[i : i + 50_001])
                    await writer.drain()
                writer.write_eof()

            sender = asyncio.create_task(send())
            got = await reader.read(-1)  # until EOF: the server closed after our EOF
            await sender
            assert hashlib.sha256(got).digest() == hashlib.sha256(data).digest()
            writer.close()
            await writer.wait_closed()

    asyncio.run(asyncio.wait_for(main(), 30))


def test_loop_sendfile_sends_a_file_over_the_transport(setup: str, tmp_path: Path) -> None:
    """``loop.sendfile(transport, file)`` (a server sending a file, then reading on): the file
    arrives intact through a 16 KiB ring, and the protocol reads again afterwards. On an SMC
    transport it raised RuntimeError ("sendfile is not supported for transport"), which ended
    the handler and left the client waiting for good."""
    data = os.urandom(3 << 20)
    path = tmp_path / "file"
    path.write_bytes(data)

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with path.open("rb") as f:
            sent = await asyncio.get_running_loop().sendfile(writer.transport, f, 1000)
        writer.write(b"END%d" % sent)
        await writer.drain()
        assert await reader.readexactly(4) == b"done"  # reading works again after sendfile
        writer.close()
        await writer.wait_closed()

    async def main() -> None:
        async with await aio.start_server(serve, "127.0.0.1", 0) as server:
            port = server.sockets[0].getsockname()[1]
            reader, writer = await aio.open_connection("127.0.0.1", port)
            assert aio.smc_socket(writer).mode == setup
            got = await reader.readexactly(len(data) - 1000)
            assert got == data[1000:]
            assert await reader.readexactly(10) == b"END%d" % (len(data) - 1000)
            writer.write(b"done")
            assert await reader.read() == b""
            writer.close()
            await writer.wait_closed()

    asyncio.run(asyncio.wait_for(main(), 30))


def test_lines_and_transport_abort(setup: str) -> None:
    async def main() -> None:
        seen: asyncio.Future[str] = asyncio.get_running_loop().create_future()

        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            seen.set_result(aio.smc_socket(writer).mode)
            line = await reader.readline()
            writer.write(line.upper())
            await writer.drain()
            writer.transport.abort()  # close at once: the client reads what was sent, then EOF

        async with await aio.start_server(handler, "127.0.0.1", 0) as server:
            port = server.sockets[0].getsockname()[1]
            reader, writer = await aio.open_connection("127.0.0.1", port)
            writer.write(b"hello\nunread")
            assert await reader.readline() == b"HELLO\n"
            assert await seen == setup
            assert await asyncio.wait_for(reader.read(10), 5) == b""
            writer.close()

    asyncio.run(asyncio.wait_for(main(), 30))


# --- the SMC transport itself, with protocols of our own (a real channel from MiniDaemon) ------


@pytest.fixture
def daemon(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> object:
    d = MiniDaemon(tmp_path / "h.sock", dmb_size=16384)
    monkeypatch.setenv("SMCD_HANDOFF_SOCKET", str(d.path))
    yield d
    d.stop()


class Recorder(asyncio.Protocol):
    """Everything a transport tells its protocol, in order."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.data = bytearray()
        self.lost: asyncio.Future[BaseException | None] = asyncio.get_running_loop().create_future()
        self.eof = asyncio.Event()
        self.got = asyncio.Event()
        self.transport: Any = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.events.append("made")

    def data_received(self, data: bytes) -> None:
        self.data += data
        self.got.set()

    def eof_received(self) -> bool:
        self.events.append("eof")
        self.eof.set()
        return True  # keep the write half open

    def pause_writing(self) -> None:
        self.events.append("pause")

    def resume_writing(self) -> None:
        self.events.append("resume")

    def connection_lost(self, exc: BaseException | None) -> None:
        self.events.append("lost")
        self.lost.set_result(exc)


class Buffered(Recorder, asyncio.BufferedProtocol):
    """A BufferedProtocol: the transport copies into our buffer, never calls data_received."""

    def __init__(self) -> None:
        super().__init__()
        self.buf = bytearray(50_000)
        self.get_buffers = 0

    def get_buffer(self, sizehint: int) -> memoryview:
        self.get_buffers += 1
        return memoryview(self.buf)

    def buffer_updated(self, nbytes: int) -> None:
        self.data += self.buf[:nbytes]
        self.got.set()

    def data_received(self, data: bytes) -> None:  # pragma: no cover - must not happen
        raise AssertionError("data_received on a BufferedProtocol")


async def _pair(
    client_proto: Recorder, server_proto: Recorder
) -> tuple[SmcTransport, SmcTransport]:
    """Two SmcTransports over one handed-off connection (connect and accept in threads)."""
    loop = asyncio.get_running_loop()
    server = listen(("127.0.0.1", 0))
    try:
        port = server.getsockname()[1]
        client_sock = asyncio.ensure_future(run_handoff(connect, ("127.0.0.1", port)))
        conn, _ = await run_handoff(server.accept)
        sock = await client_sock
    finally:
        server.close()
    assert sock.mode == conn.mode == "smcd"
    transports = []
    for s, proto in ((sock, client_proto), (conn, server_proto)):
        waiter = loop.create_future()
        transports.append(SmcTransport(loop, s, proto, waiter))
        await waiter
    return transports[0], transports[1]


def test_buffered_protocol_extra_info_and_write_eof(daemon: MiniDaemon) -> None:
    """A BufferedProtocol gets its bytes through get_buffer/buffer_updated (3 MiB through a
    16 KiB ring, intact); get_extra_info as on TCP; write_eof gives the peer EOF while the
    other direction still carries data."""

    async def main() -> None:
        a, b = Recorder(), Buffered()
        ta, tb = await _pair(a, b)
        assert ta.get_extra_info("peername") == tb.get_extra_info("sockname")
        assert ta.get_extra_info("sockname") == tb.get_extra_info("peername")
        raw = ta.get_extra_info("socket")
        assert raw.getpeername() == ta.get_extra_info("peername")
        assert ta.get_extra_info("smc_socket").mode == "smcd"
        assert ta.can_write_eof()
        data = os.urandom(3 << 20)
        ta.write(data)
        ta.write_eof()
        with pytest.raises(RuntimeError):
            ta.write(b"x")
        await asyncio.wait_for(b.eof.wait(), 10)
        assert hashlib.sha256(b.data).digest() == hashlib.sha256(data).digest()
        assert b.get_buffers > 0
        tb.write(b"after eof")  # the other direction is still open
        while a.data != b"after eof":
            a.got.clear()
            await asyncio.wait_for(a.got.wait(), 5)
        ta.close()
        assert await asyncio.wait_for(a.lost, 5) is None
        tb.close()
        assert await asyncio.wait_for(b.lost, 5) is None

    asyncio.run(asyncio.wait_for(main(), 30))


def test_flow_control_both_ways_without_polling(daemon: MiniDaemon) -> None:
    """The reader pauses: the writer's ring and buffer fill, pause_writing comes, and nothing
    wakes the writer while the reader stays paused (no timer, no retries); resume_reading
    drains everything, resume_writing follows, every byte intact."""

    async def main() -> None:
        a, b = Recorder(), Recorder()
        ta, tb = await _pair(a, b)
        tb.pause_reading()
        assert not tb.is_reading()
        data = os.urandom(1 << 20)
        ta.write(data)
        assert "pause" in a.events and ta.get_write_buffer_size() > 0
        waits, wakeups = ta.space_waits, ta.wakeups
        await asyncio.sleep(0.3)
        assert not b.data  # paused: nothing delivered
        assert (ta.space_waits, ta.wakeups) == (waits, wakeups) == (1, 0)
        tb.resume_reading()
        while len(b.data) < len(data):
            b.got.clear()
            await asyncio.wait_for(b.got.wait(), 5)
        assert bytes(b.data) == data
        assert a.events.count("resume") == a.events.count("pause") >= 1
        assert ta.get_write_buffer_size() == 0
        ta.close()
        tb.close()

    asyncio.run(asyncio.wait_for(main(), 30))


@pytest.mark.parametrize("how", ["abort_unread", "transport_abort_clean"])
def test_peer_abort_and_close_reach_connection_lost(daemon: MiniDaemon, how: str) -> None:
    """As on TCP: closing with received data unread resets the connection, and the peer's
    connection_lost gets ConnectionResetError; abort() with nothing unread is a clean close,
    and the peer reads EOF."""

    async def main() -> None:
        a, b = Recorder(), Recorder()
        ta, tb = await _pair(a, b)
        if how == "abort_unread":
            tb.pause_reading()
            ta.write(b"never read")
            await asyncio.sleep(0.05)
            tb.abort()
            exc = await asyncio.wait_for(a.lost, 5)
            assert isinstance(exc, ConnectionResetError), exc
        else:
            tb.abort()
            await asyncio.wait_for(a.eof.wait(), 5)
            ta.close()
            assert await asyncio.wait_for(a.lost, 5) is None
        assert await asyncio.wait_for(b.lost, 5) is None

    asyncio.run(asyncio.wait_for(main(), 30))


def test_the_handoff_never_blocks_the_loop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A daemon that never answers: the handoff waits its full timeout (and then fails, the
    connection reset), while the event loop goes on running its other work all along."""
    d = MiniDaemon(tmp_path / "h.sock", behaviour="silent")
    monkeypatch.setenv("SMCD_HANDOFF_SOCKET", str(d.path))
    monkeypatch.setenv("SMCD_HANDOFF_TIMEOUT", "0.6")

    async def main() -> None:
        tcp = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = tcp.sockets[0].getsockname()[1]
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        task = asyncio.create_task(ticker())
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(TimeoutError):
            await aio.open_connection("127.0.0.1", port)
        took = loop.time() - t0
        task.cancel()
        tcp.close()
        assert took >= 0.5, took
        assert ticks >= 0.5 * took / 0.01, (ticks, took)  # the loop kept turning meanwhile

    try:
        asyncio.run(asyncio.wait_for(main(), 30))
    finally:
        d.stop()


def test_sock_sendall_refuses_what_tcp_refuses(daemon: MiniDaemon) -> None:
    """``loop.sock_sendall`` with text or a strided view: the error asyncio's own raises on a
    TCP socket (its first ``send`` refuses the buffer), and nothing reaches the peer."""
    from smc_handoff import aio_transport
    from tests.handoff.test_socket import tcp_pair, wrapped_pair

    bad = ["text", memoryview(bytearray(b"abcdefgh"))[::2]]

    async def outcomes(sendall: Any, sock: Any) -> list[tuple[str, str]]:
        got = []
        for data in bad:
            try:
                await sendall(sock, data)
                got.append(("returned", ""))
            except Exception as e:  # the kind and the words are compared
                got.append((type(e).__name__, str(e)))
        return got

    async def main() -> None:
        loop = asyncio.get_running_loop()
        oa, ob = tcp_pair()
        a, b = wrapped_pair()
        try:
            oa.setblocking(False)
            expected = await outcomes(loop.sock_sendall, oa)
            assert [kind for kind, _ in expected] == ["TypeError", "BufferError"]
            assert a.mode == "smcd"
            a.setblocking(False)
            smc = await outcomes(lambda s, d: aio_transport.sendall(loop, s, d), a)
            assert smc == expected
            await aio_transport.sendall(loop, a, b"ok")
            b.settimeout(5)
            assert b.recv(10) == b"ok"
        finally:
            for s in (oa, ob, a, b):
                s.close()

    asyncio.run(main())


def test_both_ends_have_tcp_nodelay_as_asyncio_sets_it(setup: str) -> None:
    """asyncio sets ``TCP_NODELAY`` on every TCP connection its transports carry; a program
    that reads it back through ``get_extra_info("socket")`` sees the same on SMC."""

    async def main() -> None:
        accepted: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            sock = writer.get_extra_info("socket")
            accepted.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            await reader.read()
            writer.close()

        async with await aio.start_server(handler, "127.0.0.1", 0) as server:
            port = server.sockets[0].getsockname()[1]
            _reader, writer = await aio.open_connection("127.0.0.1", port)
            assert aio.smc_socket(writer).mode == setup
            sock = writer.get_extra_info("socket")
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
            assert await accepted == 1
            writer.close()
            await writer.wait_closed()

    asyncio.run(asyncio.wait_for(main(), 30))


def test_a_kick_that_finds_nothing_asks_again(
    daemon: MiniDaemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The peer kicks each request once. A kick taken after its data was read another way (a
    scheduled read, the busy poll) found nothing, and the transport kept waiting on that spent
    request: the next data came without a kick, and the connection stalled for good (both
    ends asleep in epoll, one with 64 KiB unread: about once in 10^6 round trips of the
    asyncio bench). Made here by spending the request by hand, as the peer would."""
    monkeypatch.setenv("SMC_RUN_BUSY_POLL", "0")  # the transport arms its kick at once

    async def main() -> None:
        a, b = Recorder(), Recorder()
        ta, tb = await _pair(a, b)
        await asyncio.sleep(0.05)
        ch, peer = tb._channel, ta._channel
        assert tb._want_data  # waiting for data, its request armed
        gen = ch._wd.gen
        # the peer kicked this request (for data read meanwhile another way): spent
        peer._kicked_d = gen
        ch._rx_ctrl[layout.C_KICK] = gen
        os.eventfd_write(ch.event_fd(), 1)
        await asyncio.sleep(0.1)  # the kick is taken and finds nothing
        assert ch._wd.gen != gen  # asked again
        ta.write(b"after the spent kick")
        await asyncio.wait_for(b.got.wait(), 5)
        assert bytes(b.data) == b"after the spent kick"
        ta.close()
        tb.close()

    asyncio.run(asyncio.wait_for(main(), 30))
