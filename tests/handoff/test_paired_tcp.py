"""A borrowed socket whose other end is a half on the same loop: the read for the answer to what
it just wrote gives that half one loop turn first and then finds the answer without registering
a wait; unpaired, or when the answer does not come on that turn, it waits as before."""

from __future__ import annotations

import asyncio
import os
import socket

from smcd_daemon.adapters.fdwatch import fd_watch
from smcd_daemon.adapters.handoff.handshake import PairedTcp


def connected() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as lsock:
        a = socket.create_connection(lsock.getsockname())
        b, _ = lsock.accept()
    return a, b


async def exchange(paired: bool, answer_now: bool) -> tuple[bytes, bool]:
    """Write a ping through a PairedTcp, read the pong; was a wait registered meanwhile?"""
    a, b = connected()
    tcp = PairedTcp(os.dup(a.fileno()))
    tcp.paired = paired
    watch = fd_watch()
    registered = False

    async def other_half() -> None:  # its step is queued right behind our read's first step
        if not answer_now:
            await asyncio.sleep(0.05)
        assert b.recv(4) == b"ping"
        b.sendall(b"pong")

    try:
        await tcp.write_all(b"ping", 1.0)
        read = asyncio.create_task(tcp.read_exactly(4, 1.0))
        peer = asyncio.create_task(other_half())
        while not read.done():
            registered = registered or tcp.fd in watch
            await asyncio.sleep(0)
        await peer
        return read.result(), registered
    finally:
        tcp.close()
        a.close()
        b.close()


def test_paired_reads_the_answer_of_the_same_turn_without_a_wait() -> None:
    assert asyncio.run(exchange(paired=True, answer_now=True)) == (b"pong", False)


def test_unpaired_or_late_answers_wait_as_before() -> None:
    assert asyncio.run(exchange(paired=False, answer_now=True)) == (b"pong", True)
    assert asyncio.run(exchange(paired=True, answer_now=False)) == (b"pong", True)
