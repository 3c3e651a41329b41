"""asyncio streams over SMC (a real channel handed over by MiniDaemon) and over TCP."""

from __future__ import annotations

import asyncio
import hashlib
import os
from pathlib import Path

import pytest

from smc_handoff import aio
from smc_handoff import messages as m
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
