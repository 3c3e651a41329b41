"""The daemon's SMC-R connection relay with real applications' channels above it and a fake
link beneath: two :class:`SmcrConnection` objects on real memfd buffers from the RMB pool, each
application a real :class:`smc_handoff.channel.Channel` in a thread, and a fake ``VerbsLink``
that performs the RDMA WRITE as a copy into the peer's RMB ring (split at the wrap, as the verbs
planner does) and delivers the CDC message through its 44-byte encoding, asynchronously.

What runs for real: the pool, the header words and wakeups the channel expects of its peer,
the relay's cursor/CDC rules, close and abort. Only the wire is fake (real verbs: the VM tests).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import pytest

from smc_handoff import layout
from smc_handoff.channel import Channel
from smcd_daemon.core.rmb import BufferKind, RmbPool
from smcd_daemon.transport.smcr_conn import SmcrConnection
from smcd_daemon.transport.verbs_model import RemoteRing, plan_ring_write
from smcd_daemon.wire.cdc import decode

WAIT = 30.0


@dataclass
class FakeRegion:
    """A 'registration' of a buffer's ring: the address is only a name for the buffer."""

    buf: Any
    addr: int
    length: int
    lkey: int = 1
    rkey: int = 2


class FakeRegistrar:
    def __init__(self) -> None:
        self.count = 0
        self.regions: dict[int, FakeRegion] = {}

    def register(self, ring: memoryview, *, remote_write: bool = True) -> FakeRegion:
        self.count += 1
        addr = 0x10000000 * self.count
        region = FakeRegion(ring, addr, len(ring), rkey=0x100 + self.count)
        self.regions[addr] = region
        return region

    def release(self, region: FakeRegion) -> None:
        self.regions.pop(region.addr, None)


class FakeLink:
    """One direction of the wire: writes land in the peer's RMB ring, CDCs reach the peer's
    connection on the next loop iteration, completions come back after that."""

    def __init__(self, loop: asyncio.AbstractEventLoop, registrar: FakeRegistrar) -> None:
        self.loop = loop
        self.registrar = registrar
        self.peer: SmcrConnection | None = None
        self.me: SmcrConnection | None = None
        self.free_send_slots = 16
        self.cdcs = 0

    def write_ring(self, src: FakeRegion, length: int, *, src_offset: int, dst: RemoteRing,
                   dst_offset: int, notify: bytes, tag: Hashable) -> list[int]:  # fmt: skip
        target = self.registrar.regions[dst.addr].buf
        assert dst.size == len(target) == src.length
        for piece in plan_ring_write(length, src_offset=src_offset, src_size=src.length,
                                     dst_offset=dst_offset, dst_size=dst.size):  # fmt: skip
            at = piece.remote_offset
            for sge in piece.sges:
                target[at : at + sge.length] = src.buf[sge.offset : sge.offset + sge.length]
                at += sge.length
        return [self.send(notify, tag=tag)]

    def send(self, msg: bytes, *, tag: Hashable) -> int:
        self.free_send_slots -= 1
        self.cdcs += 1
        self.loop.call_soon(self._deliver, bytes(msg), tag)
        return self.cdcs

    def _deliver(self, msg: bytes, tag: Any) -> None:
        assert self.peer is not None and self.me is not None
        self.peer.on_cdc(decode(msg))
        self.free_send_slots += 1
        self.me.send_done(tag[2])
        self.pump(self.me)

    def pump(self, conn: SmcrConnection) -> None:
        while self.free_send_slots and conn.transmit(self):  # type: ignore[arg-type]
            pass


def make_pair(loop: asyncio.AbstractEventLoop, size: int) -> tuple[Any, ...]:
    pool = RmbPool()
    reg = FakeRegistrar()
    links = [FakeLink(loop, reg), FakeLink(loop, reg)]
    finished: list[SmcrConnection] = []
    bufs = {}
    for side in "ab":
        bufs[side] = (pool.acquire(BufferKind.RMB, size), pool.acquire(BufferKind.SNDBUF, size))
    regions = {
        side: (pool.register(r, "fake", reg), pool.register(s, "fake", reg))
        for side, (r, s) in bufs.items()
    }
    conns: dict[str, SmcrConnection] = {}
    for i, (side, other) in enumerate((("a", "b"), ("b", "a"))):
        rmb, snd = bufs[side]
        peer_rmb_region = regions[other][0]
        link = links[i]

        def want(conn: SmcrConnection, link: FakeLink = link) -> None:
            link.pump(conn)

        conns[side] = SmcrConnection(
            conn_id=i + 1, lgr_id=0x100, link_id=1, token=0xA + i, peer_token=0xB - i,
            rmb=rmb, rmb_id=1, sndbuf=snd, snd_region=regions[side][1],
            peer_ring=RemoteRing(peer_rmb_region.addr, peer_rmb_region.rkey, rmb.ring_len),
            want_send=want, finished=finished.append,
        )  # fmt: skip
    links[0].me, links[0].peer = conns["a"], conns["b"]
    links[1].me, links[1].peer = conns["b"], conns["a"]
    return pool, reg, links, conns, finished


async def until(pred: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not pred():
        assert time.monotonic() < deadline, f"timed out: {what}"
        await asyncio.sleep(0.005)


def send_all(ch: Channel, data: memoryview) -> None:
    while data:
        n = ch.send_into(data)
        data = data[n:]
        if not n:
            assert ch.wait_writable(WAIT), "no space"


def recv_all(ch: Channel, h: Any) -> int:
    buf = bytearray(1 << 16)
    total = 0
    while True:
        n = ch.recv_into(buf)
        if n:
            h.update(memoryview(buf)[:n])
            total += n
        elif ch.eof:
            return total
        else:
            assert ch.wait_readable(WAIT), "no data"


@pytest.mark.parametrize("size", [16384, 65536])
def test_checksummed_stream_through_relay_with_real_channels(size: int) -> None:
    async def body() -> None:
        loop = asyncio.get_running_loop()
        pool, reg, links, conns, finished = make_pair(loop, size)
        fds = {k: c.take_app_fds() for k, c in conns.items()}
        for c in conns.values():
            c.start(loop)
        ca, cb = Channel.from_fds(fds["a"]), Channel.from_fds(fds["b"])
        data = os.urandom(3 << 20)
        want = hashlib.sha256(data).hexdigest()
        got = hashlib.sha256()

        def sender() -> None:
            mv = memoryview(data)
            for i in range(0, len(data), 10007):  # odd pieces: every wrap position
                send_all(ca, mv[i : i + 10007])
            ca.shutdown_write()

        _, n = await asyncio.gather(asyncio.to_thread(sender), asyncio.to_thread(recv_all, cb, got))
        assert n == len(data) and got.hexdigest() == want
        # cursors 1:1: what A's daemon announced is what B's application consumed
        assert conns["a"].relay.tx_sent == conns["b"].relay.app_cons == len(data)
        # consumer updates were batched (silly window avoidance): never more than the data CDCs
        # (equal when the writer is blocked on a full ring and each update lets one more write
        # go), and each confirmed more than the update limit on average
        assert links[1].cdcs <= links[0].cdcs
        assert len(data) / links[1].cdcs > conns["b"].relay.update_limit
        cb.close()
        await until(lambda: ca.peer_closed, "A sees B's close")
        ca.close()
        await until(lambda: len(finished) == 2, "both relays finish")
        assert pool.busy == 4  # the transport gives buffers back, not the connection
        assert reg.count == 4

    asyncio.run(body())


@pytest.mark.parametrize("unread", [False, True], ids=["all-read", "unread"])
def test_application_death_reaches_the_peer_as_its_kernel_close(unread: bool) -> None:
    """A's application "dies" (its descriptors close without a close flag): B sees the close
    A's exit would make in the kernel, EOF after A's data; or a reset when A left B's bytes
    unread."""

    async def body() -> None:
        loop = asyncio.get_running_loop()
        _, _, _, conns, finished = make_pair(loop, 16384)
        fds = {k: c.take_app_fds() for k, c in conns.items()}
        for c in conns.values():
            c.start(loop)
        ca = Channel.from_fds(fds["a"])
        cb = Channel.from_fds(fds["b"])
        assert ca.send_into(b"last words") == 10
        if unread:
            assert cb.send_into(b"never read") == 10
            await until(lambda: conns["a"].relay.peer_prod == 10, "B's bytes reach A's RMB")
        ca._release()  # the process's exit: its mappings and descriptors go, no flag is set
        if unread:
            await until(lambda: cb.aborted, "B sees an abort")
            with pytest.raises(ConnectionResetError):
                cb.recv_into(bytearray(16))
            assert conns["a"].relay.abort_reason is not None
            assert "unread" in conns["a"].relay.abort_reason
        else:
            await until(lambda: cb.peer_closed, "B sees A's close")
            buf = bytearray(16)
            n = cb.recv_into(buf)
            assert bytes(buf[:n]) == b"last words"
            assert cb.recv_into(buf) == 0 and cb.eof and not cb.aborted
            assert not conns["a"].relay.aborted
        cb.close()
        await until(lambda: len(finished) == 2, "both relays finish")

    asyncio.run(body())


def test_pool_reuses_registered_buffers_zeroed() -> None:
    pool = RmbPool(max_idle=1)
    reg = FakeRegistrar()
    buf = pool.acquire(BufferKind.RMB, 16384)
    region = pool.register(buf, "p", reg)
    buf.ring[:5] = b"dirty"
    pool.release(buf)
    again = pool.acquire(BufferKind.RMB, 16384)
    assert again is buf and bytes(again.ring[:5]) == bytes(5)
    assert pool.register(again, "p", reg) is region and reg.count == 1  # no new registration
    other = pool.acquire(BufferKind.RMB, 16384)
    pool.release(again)
    pool.release(other)  # beyond max_idle: destroyed and deregistered
    assert pool.idle == 1 and pool.created == 2 and pool.reused == 1
    with pytest.raises(ValueError):
        pool.acquire(BufferKind.RMB, 1000)
    pool.close()
    assert pool.bytes == 0


@pytest.mark.parametrize("size", [16384, 1 << 20])
def test_rmb_advertised_region_is_exactly_the_kernel_rmbe(size: int) -> None:
    """A kernel peer writes at offsets 0 .. size - 1 of the RMBE it was given: the registered
    (advertised) region is the whole ring, and the channel's header and wakeup words lie
    outside it, where a remote write cannot reach them."""
    pool = RmbPool()
    reg = FakeRegistrar()
    buf = pool.acquire(BufferKind.RMB, size)
    region = pool.register(buf, "p", reg)
    assert region.length == size == buf.ring_len
    # a peer's write of the whole RMBE (offset 0 .. size - 1) lands in the ring only
    region.buf[:] = b"\xa5" * size
    assert bytes(buf.header.cast("B")) == bytes(32)
    assert all(w == 0 for w in buf.ctrl)
    # the application's channel sees exactly this ring (channel size = RMBE + 32)
    fds_end = os.dup(buf.fd)
    try:
        mm = layout.map_dmb(fds_end, buf.channel_size)
        assert buf.channel_size == size + layout.CDC_HEADER_LEN
        assert mm[layout.CDC_HEADER_LEN : layout.CDC_HEADER_LEN + size] == b"\xa5" * size
        assert mm[: layout.CDC_HEADER_LEN] == bytes(32)
        mm.close()
    finally:
        os.close(fds_end)
    pool.release(buf)
    pool.close()
    assert pool.bytes == 0


def test_the_daemon_looks_for_the_applications_request_after_a_barrier(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Toward the application the daemon is the publisher (the Dekker race of
    ``smc_handoff.layout``): the application's "kick me" may land after the daemon's header
    stores and before its load of it, while the application's own look misses the stores. The
    request is stored here at the daemon's barrier in ``publish``, exactly where the race puts
    it: the application's eventfd must be kicked (an event loop sleeps on it with no timer)."""
    import select
    import sys

    from smcd_daemon.transport import smcr_conn

    async def body() -> None:
        loop = asyncio.get_running_loop()
        _pool, _reg, _links, conns, _finished = make_pair(loop, 16384)
        fds = {k: c.take_app_fds() for k, c in conns.items()}
        for c in conns.values():
            c.start(loop)
        ca, cb = Channel.from_fds(fds["a"]), Channel.from_fds(fds["b"])
        landed: list[int] = []
        real = layout.fence

        def racing_fence() -> None:
            real()
            if not landed and sys._getframe(1).f_code.co_name == "publish":
                landed.append(1)
                cb._arm(cb._wd, False, fresh=True)  # the application's store, not its look

        monkeypatch.setattr(smcr_conn, "fence", racing_fence)
        assert ca.send_into(b"x") == 1
        await until(lambda: cb.rx_pending, "the byte reaches B's ring")
        assert landed, "the daemon looked for the application's request without a barrier"
        assert select.select([cb.event_fd()], [], [], 0)[0], "the request got no kick"
        assert cb.recv_bytes(10) == b"x"
        for ch in (ca, cb):
            ch.close()

    asyncio.run(body())
