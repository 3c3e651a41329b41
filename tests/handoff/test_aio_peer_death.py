"""A peer that dies (SIGKILL, no close) reaches an asyncio transport waiting on it, as on TCP:
EOF when it had read everything, a reset when our bytes filled its ring unread.

The transport is kicked through the channel's eventfd, which says nothing of a death; the
peer link, watched for its hang-up only, must wake the loop both while it waits for data and
while it waits for room in the dead peer's ring.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from smc_handoff import aio
from tests.handoff.test_socket import MiniDaemon

_CLIENT = textwrap.dedent(
    """
    import asyncio, sys
    from smc_handoff import aio

    async def main() -> None:
        reader, writer = await aio.open_connection("127.0.0.1", int(sys.argv[1]))
        writer.write(b"hi")
        await writer.drain()
        print(aio.smc_socket(writer).mode, flush=True)
        await asyncio.sleep(60)  # reads nothing: the server's writes fill our ring

    asyncio.run(main())
    """
)


@pytest.mark.parametrize("waiting_for", ["data", "space"])
def test_peer_killed_while_the_transport_waits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, waiting_for: str
) -> None:
    d = MiniDaemon(tmp_path / "h.sock", dmb_size=16384)
    monkeypatch.setenv("SMCD_HANDOFF_SOCKET", str(d.path))
    root = Path(__file__).resolve().parents[2]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
    }

    async def main() -> BaseException | bytes:
        lost: asyncio.Future[BaseException | bytes] = asyncio.get_running_loop().create_future()

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                assert await reader.readexactly(2) == b"hi"
                assert aio.smc_socket(writer).mode == "smcd"
                if waiting_for == "data":
                    lost.set_result(await reader.read(100))  # b"": EOF
                    return
                else:
                    while True:  # until the peer's 16 KiB ring is full and drain waits
                        writer.write(bytes(8192))
                        await writer.drain()
                raise AssertionError("the dead peer's connection ended without an error")
            except BaseException as e:  # the error is the result
                lost.set_result(e)
            finally:
                writer.close()

        server = await aio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", _CLIENT, str(port), env=env, stdout=subprocess.PIPE
        )
        try:
            assert proc.stdout is not None
            line = await asyncio.wait_for(proc.stdout.readline(), 20)
            assert line.strip() == b"smcd", line
            await asyncio.sleep(0.2)  # the server now waits for data, or for room
            assert not lost.done()
            proc.send_signal(signal.SIGKILL)
            return await asyncio.wait_for(lost, 5)
        finally:
            if proc.returncode is None:
                proc.kill()
            await proc.wait()
            server.close()

    try:
        exc = asyncio.run(asyncio.wait_for(main(), 40))
    finally:
        d.stop()
    if waiting_for == "data":  # the peer had read our nothing: its exit closed, as TCP's FIN
        assert exc == b"", repr(exc)
    else:  # our bytes were unread in its ring: an abort, as TCP's RST
        assert isinstance(exc, ConnectionResetError), repr(exc)
