"""smcd's verbs transport on real Soft-RoCE: two ports (host A's rxe on 192.0.2.1, host B's on
192.0.2.2), one RC QP each, connected with the parameters each side reports, exchanging LLC
messages, RDMA-writing into a memfd RMB across the ring wrap, and reporting errors as events.

Every wait has a deadline; nothing asserts a duration (TCG makes rxe 10-100x slower).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import mmap
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from smcd_daemon.transport.verbs import VerbsLink, VerbsPort
from smcd_daemon.transport.verbs_model import (
    SMC_WR_BUF_CNT,
    SMC_WR_TX_SIZE,
    CompletionFailed,
    LinkError,
    MessageReceived,
    PortStateChanged,
    RemoteRing,
    SendDone,
    VerbsEvent,
    WriteDone,
    WrKind,
    ipv4_mapped_gid,
    mtu_bytes,
)
from smcd_daemon.wire import llc
from smcd_daemon.wire.cdc import CdcMessage
from smcd_daemon.wire.cursor import Cursor
from tests.vm.topology import POLICY_TABLE, Port, ports_of

WAIT = 120.0  # seconds for any single event under TCG


@dataclass
class End:
    """One side: its port (device), its link, and the events the port delivered."""

    addr: Port
    port: VerbsPort
    link: VerbsLink
    events: list[VerbsEvent] = field(default_factory=list)
    _wake: asyncio.Event | None = None

    def start(self) -> None:
        self._wake = asyncio.Event()

        def sink(ev: VerbsEvent) -> None:
            self.events.append(ev)
            assert self._wake is not None
            self._wake.set()

        self.port.start(sink)

    async def next(self, pred: Callable[[VerbsEvent], bool], what: str) -> VerbsEvent:
        """The first delivered event matching ``pred`` (consumed), waiting up to WAIT."""
        assert self._wake is not None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + WAIT
        while True:
            for i, ev in enumerate(self.events):
                if pred(ev):
                    del self.events[i]
                    return ev
            self._wake.clear()
            left = deadline - loop.time()
            if left <= 0:
                raise AssertionError(
                    f"{self.addr.rxe}: no {what} within {WAIT:.0f} s; events: {self.events}"
                )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), left)


def _open(addr: Port, *, v2: bool = False, use_channel: bool = True) -> tuple[VerbsPort, VerbsLink]:
    port = VerbsPort(addr.rxe, 1, use_channel=use_channel)
    link = port.create_link(port.ipv4_gid_index(addr.address), v2=v2)
    return port, link


def _pair(*, v2: bool = False, use_channel: bool = True) -> tuple[End, End]:
    a_addr, b_addr = ports_of("a")[0], ports_of("b")[0]
    pa, la = _open(a_addr, v2=v2, use_channel=use_channel)
    pb, lb = _open(b_addr, v2=v2, use_channel=use_channel)
    # what each side would carry in CLC Accept/Confirm, handed to the other
    la.connect(lb.local)
    lb.connect(la.local)
    return End(a_addr, pa, la), End(b_addr, pb, lb)


@pytest.fixture
def pair(ports: tuple[Port, ...]) -> Iterator[tuple[End, End]]:
    a, b = _pair()
    yield a, b
    a.port.close()
    b.port.close()


def _run(coro_fn: Callable[[], object], a: End, b: End) -> None:
    async def main() -> None:
        a.start()
        b.start()
        try:
            await coro_fn()  # type: ignore[misc]
        finally:
            a.port.stop()
            b.port.stop()

    asyncio.run(main())


def _confirm_link(end: End, *, response: bool, v2: bool = False) -> llc.ConfirmLink:
    flags = llc.ConfirmLinkFlag.NO_RMBE_EYEC
    if response:
        flags |= llc.ConfirmLinkFlag.RESPONSE
    return llc.ConfirmLink(
        sender_mac=end.link.mac,
        sender_gid=end.link.gid,
        sender_qpn=end.link.qpn,
        link_num=1,
        link_uid=b"\x00\x00\x00\x07",
        max_links=2,
        max_conns=255,
        flags=flags,
        v2=v2,
    )


# --------------------------------------------------------------------------------------------


def test_qp_pair_connects_with_exchanged_parameters(pair: tuple[End, End]) -> None:
    a, b = pair
    assert a.link.state() == "RTS" and b.link.state() == "RTS"
    assert a.link.gid == ipv4_mapped_gid(a.addr.address)
    assert b.link.gid == ipv4_mapped_gid(b.addr.address)
    assert a.link.peer == b.link.local and b.link.peer == a.link.local
    assert a.link.path_mtu == min(a.link.mtu, b.link.mtu)
    assert mtu_bytes(a.link.path_mtu) >= 1024  # rxe over a 1500-byte virtio NIC
    mac_text = Path(f"/sys/class/net/{a.addr.ifname}/address").read_text().strip()
    assert a.link.local.mac == bytes.fromhex(mac_text.replace(":", ""))
    # the kernel's sizing: 16 send slots, inline sends of 44-byte messages on rxe
    assert a.link.free_send_slots == SMC_WR_BUF_CNT
    assert a.link.max_inline >= SMC_WR_TX_SIZE
    # completions wake the loop through the channel fd; port/QP events through the async fd
    assert a.port.event_driven and b.port.event_driven
    assert a.port.watches_async_events and b.port.watches_async_events


def test_confirm_link_both_ways(pair: tuple[End, End]) -> None:
    a, b = pair

    async def body() -> None:
        req = _confirm_link(a, response=False)
        wr_id = a.link.send(req.encode(), tag="confirm-req")
        done = await a.next(lambda e: isinstance(e, SendDone), "SendDone")
        assert done == SendDone(a.port.device, a.link.qpn, wr_id, "confirm-req")
        got = await b.next(lambda e: isinstance(e, MessageReceived), "CONFIRM LINK at B")
        assert isinstance(got, MessageReceived) and got.qpn == b.link.qpn
        assert len(got.data) == SMC_WR_TX_SIZE
        assert llc.decode(got.data) == req
        assert llc.ConfirmLink.decode(got.data).sender_qpn == a.link.qpn

        resp = _confirm_link(b, response=True)
        b.link.send(resp.encode())
        back = await a.next(lambda e: isinstance(e, MessageReceived), "CONFIRM LINK at A")
        decoded = llc.decode(back.data)  # type: ignore[union-attr]
        assert decoded == resp and decoded.is_response
        await b.next(lambda e: isinstance(e, SendDone), "SendDone at B")
        assert a.link.free_send_slots == b.link.free_send_slots == SMC_WR_BUF_CNT

    _run(body, a, b)


def test_many_sends_replenish_receive_buffers(pair: tuple[End, End]) -> None:
    """More messages than receive buffers (48) and send slots (16): buffers are reposted and
    slots come back."""
    a, b = pair
    count = 120

    async def body() -> None:
        sent = 0
        received: list[bytes] = []
        while len(received) < count:
            while sent < count and a.link.free_send_slots:
                a.link.send(sent.to_bytes(4, "big") + b"\xab" * 40)
                sent += 1
            ev = await b.next(lambda e: isinstance(e, MessageReceived), f"message {len(received)}")
            received.append(ev.data)  # type: ignore[union-attr]
            while any(isinstance(e, SendDone) for e in a.events):
                await a.next(lambda e: isinstance(e, SendDone), "SendDone")
            if sent < count and not a.link.free_send_slots:
                await a.next(lambda e: isinstance(e, SendDone), "SendDone (slots full)")
        assert [int.from_bytes(m[:4], "big") for m in received] == list(range(count))

    _run(body, a, b)
    assert not [e for e in a.events + b.events if isinstance(e, (LinkError, CompletionFailed))]


def _memfd(size: int, name: str) -> mmap.mmap:
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size)
        return mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


def test_rdma_write_1mib_across_ring_wrap_then_cdc(pair: tuple[End, End]) -> None:
    """A streams a checksummed 1 MiB pattern through its 256 KiB send ring into B's 256 KiB
    memfd RMB: chunks that cross both rings' wrap, each followed by a CDC message carrying the
    producer cursor. B reads each chunk when the CDC arrives (the data is there first: same RC
    QP, in order) and answers with its consumer cursor as a CDC message."""
    a, b = pair
    ring = 256 * 1024
    total = 1024 * 1024
    chunk = 96 * 1024 + 123  # odd size, so the wrap falls at changing offsets
    pattern = hashlib.shake_256(b"smcd verbs transport").digest(total)
    sndbuf, rmb = _memfd(ring, "smcd-sndbuf"), _memfd(ring, "smcd-rmb")
    src = a.port.mrs.register(sndbuf)
    dst = b.port.mrs.register(rmb)
    peer_rmb = RemoteRing(dst.addr, dst.rkey, ring)  # what B's CLC Accept/CONFIRM RKEY says

    async def body() -> None:
        got = bytearray()
        prod = Cursor(0, 0)
        seq = 0
        wraps_seen = 0
        pos = 0
        while pos < total:
            n = min(chunk, total - pos)
            off = pos % ring
            # the application writes into its send ring (may wrap)
            first = min(n, ring - off)
            sndbuf[off : off + first] = pattern[pos : pos + first]
            sndbuf[0 : n - first] = pattern[pos + first : pos + n]
            wraps_seen += first < n
            prod = prod.add(ring, n)
            seq += 1
            cdc = CdcMessage(seqno=seq, token=0x5EED, prod=prod, cons=Cursor(0, 0))
            ids = a.link.write_ring(
                src, n, src_offset=off, dst=peer_rmb, dst_offset=off, notify=cdc.encode(), tag=seq
            )
            assert len(ids) == (3 if first < n else 2)  # two writes across the wrap + the CDC
            ev = await b.next(lambda e: isinstance(e, MessageReceived), f"CDC {seq}")
            msg = CdcMessage.decode(ev.data)  # type: ignore[union-attr]
            assert (msg.seqno, msg.token, msg.prod) == (seq, 0x5EED, prod)
            end = msg.prod.count
            if end > off:
                got += rmb[off:end]
            else:
                got += rmb[off:ring] + rmb[0:end]
            done = await a.next(lambda e: isinstance(e, SendDone), f"SendDone {seq}")
            assert done.tag == seq  # type: ignore[union-attr]
            # B frees the space: consumer cursor update back to A
            b.link.send(CdcMessage(seqno=seq, token=0xA11CE, prod=Cursor(0, 0), cons=prod).encode())
            upd = await a.next(lambda e: isinstance(e, MessageReceived), f"cons update {seq}")
            assert CdcMessage.decode(upd.data).cons == prod  # type: ignore[union-attr]
            pos += n
        assert wraps_seen >= 3
        assert len(got) == total
        assert hashlib.sha256(got).hexdigest() == hashlib.sha256(pattern).hexdigest()

    try:
        _run(body, a, b)
        assert not [e for e in a.events + b.events if isinstance(e, (LinkError, CompletionFailed))]
    finally:
        a.port.mrs.release(src)
        b.port.mrs.release(dst)
        sndbuf.close()
        rmb.close()


def test_signaled_write_reports_write_done(pair: tuple[End, End]) -> None:
    a, b = pair
    size = 64 * 1024
    sbuf, rbuf = _memfd(size, "w-src"), _memfd(size, "w-dst")
    payload = os.urandom(size)
    sbuf[:] = payload
    src, dst = a.port.mrs.register(sbuf), b.port.mrs.register(rbuf)

    async def body() -> None:
        wr_id = a.link.rdma_write(src, [(size // 2, size // 2), (0, size // 2)], dst.addr, dst.rkey)
        ev = await a.next(lambda e: isinstance(e, WriteDone), "WriteDone")
        assert ev == WriteDone(a.port.device, a.link.qpn, wr_id, None, size)

    try:
        _run(body, a, b)
        assert rbuf[:] == payload[size // 2 :] + payload[: size // 2]  # gathered from two pieces
    finally:
        a.port.mrs.release(src)
        b.port.mrs.release(dst)
        sbuf.close()
        rbuf.close()


def test_mr_cache_registers_each_buffer_once(pair: tuple[End, End]) -> None:
    a, _b = pair
    cache = a.port.mrs
    buf1, buf2 = _memfd(64 * 1024, "rmb1"), _memfd(64 * 1024, "rmb2")
    before = cache.registrations
    r1 = cache.register(buf1)
    assert cache.register(buf1) is r1  # same buffer, same registration
    assert cache.lookup(buf1) is r1
    r2 = cache.register(buf2)
    assert r2 is not r1 and r2.rkey != r1.rkey
    assert cache.registrations - before == 2 and len(cache) >= 2
    assert (r1.length, r1.addr) == (64 * 1024, r1.addr)
    with pytest.raises(BufferError):
        buf1.close()  # a registered mapping cannot vanish under the device
    cache.release(r1)
    assert cache.lookup(buf1) is None
    r1b = cache.register(buf1)
    assert r1b is not r1 and cache.registrations - before == 3
    cache.release(r1b)
    cache.release(r2)
    buf1.close()
    buf2.close()


def test_write_with_bad_rkey_is_an_error_event_not_a_hang(pair: tuple[End, End]) -> None:
    a, b = pair
    sbuf, rbuf = _memfd(16384, "bad-src"), _memfd(16384, "bad-dst")
    src, dst = a.port.mrs.register(sbuf), b.port.mrs.register(rbuf)
    bad = RemoteRing(dst.addr, dst.rkey ^ 0x5A5A00, 16384)

    async def body() -> None:
        ids = a.link.write_ring(
            src, 4096, src_offset=0, dst=bad, dst_offset=0, notify=b"\xfe" * 44, tag="doomed"
        )
        failed = await a.next(lambda e: isinstance(e, CompletionFailed), "CompletionFailed")
        assert isinstance(failed, CompletionFailed)
        assert failed.wr_id == ids[0] and failed.kind is WrKind.WRITE and failed.tag == "doomed"
        assert failed.status_name == "REM_ACCESS_ERR"
        err = await a.next(lambda e: isinstance(e, LinkError), "LinkError")
        assert err == LinkError(a.port.device, a.link.qpn, "REM_ACCESS_ERR")
        # the CDC send behind it is flushed, with its tag, so the layer above can resend it
        flushed = await a.next(lambda e: isinstance(e, CompletionFailed), "flushed CDC")
        assert flushed.status_name == "WR_FLUSH_ERR" and flushed.wr_id == ids[-1]  # type: ignore[union-attr]

    try:
        _run(body, a, b)
        assert a.link.state() == "ERR"
        assert a.link.free_send_slots == SMC_WR_BUF_CNT  # the flushed send gave its slot back
        with pytest.raises(Exception, match="down"):
            a.link.send(b"x")
    finally:
        a.port.mrs.release(src)
        b.port.mrs.release(dst)
        sbuf.close()
        rbuf.close()


def test_polling_fallback_and_v2_long_llc(ports: tuple[Port, ...]) -> None:
    """Without the completion channel the port polls; an SMC-Rv2 link carries an LLC message
    longer than 44 bytes through its 8 KiB buffers."""
    a, b = _pair(v2=True, use_channel=False)
    try:
        assert not a.port.event_driven
        long_msg = bytes([0x22]) + (1000).to_bytes(2, "little") + bytes(range(256)) * 4
        long_msg = long_msg[:1000]

        async def body() -> None:
            a.link.send(long_msg, tag="v2")
            got = await b.next(lambda e: isinstance(e, MessageReceived), "v2 LLC")
            assert got.data == long_msg  # type: ignore[union-attr]
            await a.next(lambda e: isinstance(e, SendDone) and e.tag == "v2", "SendDone v2")
            b.link.send(_confirm_link(b, response=True, v2=True).encode())
            short = await a.next(lambda e: isinstance(e, MessageReceived), "CONFIRM LINK v2")
            assert llc.decode(short.data) == _confirm_link(b, response=True, v2=True)  # type: ignore[union-attr]

        _run(body, a, b)
    finally:
        a.port.close()
        b.port.close()


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, timeout=60, capture_output=True)


def test_port_down_and_up_arrive_as_port_events(ports: tuple[Port, ...]) -> None:
    """``ip link set down`` on host A's second NIC: its rxe port reports PORT_ERR (inactive),
    and PORT_ACTIVE after ``up``. The wire's routes are restored afterwards."""
    addr = ports_of("a")[1]
    port = VerbsPort(addr.rxe, 1)
    seen: list[VerbsEvent] = []

    async def body() -> None:
        wake = asyncio.Event()

        def sink(ev: VerbsEvent) -> None:
            seen.append(ev)
            wake.set()

        async def until(active: bool) -> PortStateChanged:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + WAIT
            while True:
                for ev in seen:
                    if isinstance(ev, PortStateChanged) and ev.active is active:
                        return ev
                wake.clear()
                if loop.time() > deadline:
                    raise AssertionError(f"no port event active={active}; events: {seen}")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(wake.wait(), 1.0)

        port.start(sink)
        try:
            assert port.active
            _ip("link", "set", "dev", addr.ifname, "down")
            down = await until(False)
            assert (down.device, down.port, down.event) == (addr.rxe, 1, "PORT_ERR")
            assert not port.active
            seen.clear()
            _ip("link", "set", "dev", addr.ifname, "up")
            up = await until(True)
            assert up.event == "PORT_ACTIVE" and port.active
        finally:
            port.stop()

    try:
        asyncio.run(body())
    finally:
        _ip("link", "set", "dev", addr.ifname, "up")
        _ip(
            "route", "replace", f"{addr.peer_address}/32", "dev", addr.ifname,
            "src", addr.address, "table", str(POLICY_TABLE),
        )  # fmt: skip
        deadline = time.monotonic() + WAIT
        while True:  # leave the port as found: ACTIVE with its IPv4 GID
            try:
                if port.active:
                    port.ipv4_gid_index(addr.address)
                    break
            except Exception:
                if time.monotonic() > deadline:
                    raise
            if time.monotonic() > deadline:
                raise AssertionError(f"{addr.rxe} not ACTIVE again after `ip link set up`")
            time.sleep(0.2)
        port.close()
