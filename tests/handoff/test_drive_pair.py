"""Both halves of a same-host connection driven at once (``clc_io.drive_pair``): the CLC bytes go
through the real TCP connection, the reading half is given the message the writing half built,
and every ending (success, a Decline either way, bytes the daemon did not write, a cancel)
leaves the same outcomes, resources and stream as two separate drivers would."""

from __future__ import annotations

import asyncio
import errno
import os
import socket

from smcd_daemon.adapters.clc_io import MISREAD, BorrowedTcp, drive_pair
from smcd_daemon.protocol.negotiate import FallbackOutcome, SmcdLoopbackOutcome
from smcd_daemon.wire.reasons import DeclineReason as R
from tests.protocol.test_negotiate import KIB, World


def connected() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as lsock:
        a = socket.create_connection(lsock.getsockname())
        b, _ = lsock.accept()
    return a, b


async def run(
    w: World, *, before: bytes = b"", crossed: bool = False
) -> tuple[object, object, socket.socket, socket.socket]:
    """drive_pair over a fresh loopback connection (the applications' sockets are returned
    open); ``before``: bytes the client application wrote first; ``crossed``: the two halves
    are ends of two different connections (nothing written ever arrives)."""
    a, b = connected()
    if crossed:
        b.close()
        _, b = connected()
    if before:
        a.sendall(before)
    ctcp, stcp = BorrowedTcp(os.dup(a.fileno())), BorrowedTcp(os.dup(b.fileno()))
    c, s = w.client(), w.server()
    try:
        cout, sout = await drive_pair(c, ctcp, s, stcp, c.start())
    finally:
        ctcp.close()
        stcp.close()
    return cout, sout, a, b


def test_both_halves_reach_smc_and_the_stream_is_clean_after() -> None:
    w = World()
    cout, sout, a, b = asyncio.run(run(w))
    try:
        assert isinstance(cout, SmcdLoopbackOutcome) and isinstance(sout, SmcdLoopbackOutcome)
        assert (cout.peer_token, sout.peer_token) == (sout.local_token, cout.local_token)
        assert cout.first_contact is False and sout.first_contact is True
        assert w.pool.in_use_buffers == 2
        a.sendall(b"after")  # nothing of CLC is left in either direction
        b.sendall(b"back")
        assert b.recv(64) == b"after" and a.recv(64) == b"back"
    finally:
        a.close()
        b.close()


def test_a_client_decline_after_the_accept_ends_both_and_gives_the_dmb_back() -> None:
    w = World(user_max_bytes=64 * KIB)
    hog = w.pool.register(1000, 64 * KIB)  # the client's user has no bytes left
    cout, sout, a, b = asyncio.run(run(w))
    try:
        assert isinstance(cout, FallbackOutcome) and cout.reason == R.MAX_DMB and cout.declined
        assert isinstance(sout, FallbackOutcome) and sout.reason == R.PEERDECL
        assert sout.peer_diagnosis == R.MAX_DMB and sout.kernel_errno is None
        assert w.pool.in_use_buffers == 1  # only the hog
        a.sendall(b"tcp now")  # the Decline was read whole: the stream is the applications'
        assert b.recv(64) == b"tcp now"
    finally:
        w.pool.unregister(hog.token)
        a.close()
        b.close()


def test_a_server_decline_reaches_the_client() -> None:
    w = World(user_max_buffers=1)
    hog = w.pool.register(1001, 16 * KIB)  # the server's user already owns its one DMB
    cout, sout, a, b = asyncio.run(run(w))
    try:
        assert isinstance(sout, FallbackOutcome) and sout.reason == R.MAX_DMB
        assert isinstance(cout, FallbackOutcome) and cout.reason == R.PEERDECL
        assert cout.peer_diagnosis == R.MAX_DMB
        assert w.pool.in_use_buffers == 1
        b.sendall(b"tcp now")
        assert a.recv(64) == b"tcp now"
    finally:
        w.pool.unregister(hog.token)
        a.close()
        b.close()


def test_bytes_the_daemon_did_not_write_fail_both_halves() -> None:
    w = World()
    cout, sout, a, b = asyncio.run(run(w, before=b"GET / HTTP/1.0\r\n"))
    try:
        assert isinstance(sout, FallbackOutcome) and sout.kernel_errno == errno.EPROTO
        assert MISREAD in sout.detail
        # the client's Proposal got no answer: for it the peer reset the connection (the
        # daemon does reset it for both: neither application reads what is left of CLC)
        assert isinstance(cout, FallbackOutcome) and cout.kernel_errno == errno.ECONNRESET
        assert w.pool.in_use_buffers == 0
    finally:
        a.close()
        b.close()


def test_a_cancel_while_a_half_waits_aborts_both() -> None:
    w = World()

    async def main() -> None:
        task = asyncio.create_task(run(w, crossed=True))
        await asyncio.sleep(0.05)  # the server half waits for a Proposal that cannot come
        assert not task.done()
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            return
        raise AssertionError("not cancelled")

    asyncio.run(main())
    assert w.pool.in_use_buffers == 0
    assert len(w.dev.pairing) == 1  # the client's registration is the caller's to withdraw
