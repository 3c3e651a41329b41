"""A same-host pair runs its CLC as one (``clc_io.drive_pair``) whichever half reaches the daemon
first: the client half parked for its server half, or the server half already looking for the
Proposal when its client half comes. Both end on SMC with their stream intact; a server half
whose client never comes falls back and leaves nothing registered for a later one to take."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

import smc_handoff
from smc_handoff.handoff import Registration
from smcd_daemon.adapters import clc_io
from smcd_daemon.adapters.handoff import HandoffServer, handshake
from smcd_daemon.core.eid import EidTable


async def wrap(sock: socket.socket, *args: Any) -> Any:
    return await asyncio.to_thread(smc_handoff.wrap, sock, *args)


async def _until(cond: Callable[[], bool], what: str) -> None:
    for _ in range(500):
        if cond():
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"{what} did not happen")


@contextlib.asynccontextmanager
async def connection(
    path: Path,
) -> AsyncIterator[tuple[HandoffServer, socket.socket, socket.socket]]:
    """An in-process handoff server at ``path``, a listener registered with it, and one
    connection to that listener (its client and accepted sockets, not handed over yet)."""
    srv = HandoffServer.bind(path, eids=EidTable(("SMCD-PAIR-ORDER",)))
    srv.start()
    listener = socket.create_server(("127.0.0.1", 0))
    try:
        reg = await asyncio.to_thread(Registration, listener)
        assert reg.listener_id is not None
        ctcp = socket.create_connection(listener.getsockname())
        stcp, _ = listener.accept()
        yield srv, ctcp, stcp
        reg.close()
    finally:
        listener.close()
        await srv.stop()


def _run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *, server_first: bool) -> int:
    """One connection handed over in the given order; how many pair drives ran."""
    path = tmp_path / "handoff.sock"
    monkeypatch.setenv("SMCD_HANDOFF_SOCKET", os.fspath(path))
    pairs: list[int] = []
    real = clc_io.drive_pair

    async def counted(*args: Any) -> Any:
        pairs.append(1)
        return await real(*args)

    monkeypatch.setattr(handshake, "drive_pair", counted)

    async def main() -> None:
        async with connection(path) as (srv, ctcp, stcp):
            hs = srv.handshakes
            if server_first:
                server = asyncio.create_task(wrap(stcp, True))
                await _until(lambda: bool(hs._servers), "the server half's arrival")
                client = asyncio.create_task(wrap(ctcp))
            else:
                client = asyncio.create_task(wrap(ctcp))
                await _until(lambda: len(hs.arrivals) > 0, "the client half's arrival")
                server = asyncio.create_task(wrap(stcp, True))
            c, s = await client, await server
            assert (c.mode, s.mode) == ("smcd", "smcd"), (c.fallback, s.fallback)
            await asyncio.to_thread(c.sendall, b"ping")
            assert await asyncio.to_thread(s.recv, 16) == b"ping"
            await asyncio.to_thread(s.sendall, b"pong")
            assert await asyncio.to_thread(c.recv, 16) == b"pong"
            assert not hs._servers  # nothing left behind
            c.close()
            s.close()

    asyncio.run(main())
    return len(pairs)


@pytest.mark.parametrize("server_first", [False, True], ids=["client-first", "server-first"])
def test_either_arrival_order_runs_the_pair_as_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, server_first: bool
) -> None:
    assert _run(tmp_path, monkeypatch, server_first=server_first) == 1


def test_a_server_half_whose_client_never_comes_leaves_no_registration(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "handoff.sock"
    monkeypatch.setenv("SMCD_HANDOFF_SOCKET", os.fspath(path))

    async def main() -> None:
        async with connection(path) as (srv, ctcp, stcp):  # ctcp: a plain client
            server = asyncio.create_task(wrap(stcp, True))
            await _until(lambda: bool(srv.handshakes._servers), "the server half's arrival")
            s = await server
            assert s.mode == "tcp"  # its look ended without a client half of ours...
            assert not srv.handshakes._servers  # ...and no later one can take it
            ctcp.sendall(b"plain")
            assert await asyncio.to_thread(s.recv, 16) == b"plain"
            s.close()
            ctcp.close()

    asyncio.run(main())
