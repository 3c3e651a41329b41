"""SMC-R end to end on Soft-RoCE: two smcd SMC-R services in one guest (host A's on rxe_a0 /
192.0.2.1, host B's on rxe_b0 / 192.0.2.2), real TCP connections between application threads
handed to them, the CLC handshake over that TCP connection, LLC CONFIRM LINK over a real RC QP,
and the application data moved by RDMA WRITE + CDC between the two daemons into the
applications' shared-memory channels.

Every wait has a deadline; nothing asserts a duration (TCG makes rxe 10-100x slower). The
transfer size is printed with its time (``-s`` shows it; the guest log keeps it).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from ipaddress import ip_address
from typing import Any

import pytest

from smc_handoff.channel import Channel
from smc_handoff.handoff import raise_nofile_limit
from smcd_daemon.adapters.netlink import NetlinkWatcher
from smcd_daemon.adapters.smcr_service import SmcrChannel, SmcrService
from smcd_daemon.adapters.verbs import discover_rdma
from smcd_daemon.core import registry as reg
from smcd_daemon.core.devices import DeviceInventory
from smcd_daemon.core.eid import EidTable
from smcd_daemon.protocol.smcr_route import SmcrChoice, choose_smcr_v2_client, find_route_v2
from smcd_daemon.transport.smcr import SmcrTransport
from smcd_daemon.transport.verbs_model import ipv4_mapped_gid
from tests.vm.topology import Port, ports_of

WAIT = 120.0
UEID = "SMCD-VM-SMCR"
TRANSFER = int(os.environ.get("SMCD_SMCR_TRANSFER", str(64 << 20)))


@dataclass
class Hosts:
    a: SmcrService
    b: SmcrService
    pa: Port
    pb: Port


@contextlib.asynccontextmanager
async def two_hosts(*, linger: float = 2.0) -> AsyncIterator[Hosts]:
    # Each SMC-R connection holds ~8 descriptors per side here (both daemons and both
    # applications live in this one process): the limit smcd and the library raise.
    raise_nofile_limit()
    inv = DeviceInventory()
    watcher = NetlinkWatcher(inv)
    await watcher.start()
    for dev in discover_rdma():
        inv.apply_rdma_device(dev)
    pa, pb = ports_of("a")[0], ports_of("b")[0]
    eids = EidTable([UEID])
    ta = SmcrTransport(devices={pa.rxe}, linger=linger)
    tb = SmcrTransport(devices={pb.rxe}, linger=linger)
    a = SmcrService(ta, inv, eids, rmb_size=1 << 20, hostname="host-a", clc_wait=WAIT / 4)
    b = SmcrService(tb, inv, eids, rmb_size=1 << 20, hostname="host-b", clc_wait=WAIT / 4)
    try:
        yield Hosts(a, b, pa, pb)
    finally:
        for svc in (a, b):
            svc.transport.close()
            svc.close()
        await watcher.stop()


def tcp_pair(pa: Port, pb: Port) -> tuple[socket.socket, socket.socket]:
    """A TCP connection 192.0.2.1 -> 192.0.2.2 (client, server), crossing the wire."""
    lst = socket.create_server((pb.address, 0))
    cli = socket.socket()
    cli.bind((pa.address, 0))
    cli.connect(lst.getsockname())
    srv, _ = lst.accept()
    lst.close()
    return cli, srv


async def handoff(
    h: Hosts, **kw: Any
) -> tuple[SmcrChannel, SmcrChannel, socket.socket, socket.socket]:
    cli, srv = tcp_pair(h.pa, h.pb)
    ra, rb = await asyncio.wait_for(
        asyncio.gather(
            h.a.connect(os.dup(cli.fileno()), **kw), h.b.accept(os.dup(srv.fileno()), **kw)
        ),
        WAIT,
    )
    assert isinstance(ra, SmcrChannel) and isinstance(rb, SmcrChannel), (ra, rb)
    return ra, rb, cli, srv


def sendall(ch: Channel, data: memoryview, deadline: float) -> None:
    while data:
        n = ch.send_into(data)
        data = data[n:]
        if not n and not ch.wait_writable(max(0.0, deadline - time.monotonic())):
            raise TimeoutError("send: no space before the deadline")


def recv_exactly(ch: Channel, n: int, deadline: float, sink: Callable[[memoryview], None]) -> int:
    buf = bytearray(1 << 20)
    mv = memoryview(buf)
    got = 0
    while got < n:
        k = ch.recv_into(mv, min(len(buf), n - got))
        if k:
            sink(mv[:k])
            got += k
            continue
        if ch.eof:
            break
        if not ch.wait_readable(max(0.0, deadline - time.monotonic())):
            raise TimeoutError(f"recv: {got} of {n} bytes before the deadline")
    return got


def run_async(coro_fn: Callable[[], Any]) -> None:
    asyncio.run(asyncio.wait_for(coro_fn(), 280))


# --------------------------------------------------------------------------------------------


def test_smcr_facts_find_each_hosts_rxe_port_and_route() -> None:
    """What each service offers: its own rxe port, a RoCEv2 GID whose /32 holds the source,
    and (server) a route with a resolved neighbour towards the client's GID."""

    async def body() -> None:
        async with two_hosts() as h:
            cli, srv = tcp_pair(h.pa, h.pb)  # traffic over the wire resolves ARP both ways
            try:
                for svc, port, peer in ((h.a, h.pa, h.pb), (h.b, h.pb, h.pa)):
                    local, remote = ip_address(port.address), ip_address(peer.address)
                    facts = svc.facts_for(local, remote)
                    assert [p.device for p in facts.ports] == [port.rxe], facts.ports
                    got = choose_smcr_v2_client(facts.ports, 0, local, facts.routing, ueid_count=1)
                    assert isinstance(got, SmcrChoice), got
                    assert got.gid.gid == ipv4_mapped_gid(port.address)
                    route = find_route_v2(local, remote, facts.routing)  # type: ignore[arg-type]
                    assert not isinstance(route, str), route
                    assert not route.uses_gateway
            finally:
                cli.close()
                srv.close()

    run_async(body)


@pytest.mark.timeout(300)
def test_smcr_checksummed_transfer_both_ways() -> None:
    """A checksummed bulk transfer A → B over SMC-R (RDMA WRITE + CDC), then a reply B → A;
    registry records show the link group with its real values."""

    async def body() -> None:
        async with two_hosts() as h:
            ra, rb, cli, srv = await handoff(h)
            assert ra.first_contact and rb.first_contact
            ca, cb = Channel.from_fds(ra.fds), Channel.from_fds(rb.fds)
            block = os.urandom(4 << 20)
            ring = memoryview(block + block)
            want = hashlib.sha256()
            got = hashlib.sha256()
            deadline = time.monotonic() + 240

            def send() -> None:
                left, i = TRANSFER, 0
                while left:
                    off = (i * 4099) % len(block)
                    piece = ring[off : off + min(1 << 20, left)]
                    want.update(piece)
                    sendall(ca, piece, deadline)
                    left -= len(piece)
                    i += 1
                ca.shutdown_write()

            start = time.monotonic()
            sender = asyncio.to_thread(send)
            receiver = asyncio.to_thread(recv_exactly, cb, TRANSFER + 1, deadline, got.update)
            _, n = await asyncio.gather(sender, receiver)
            took = time.monotonic() - start
            print(f"SMC-R transfer: {n} bytes in {took:.1f} s ({n / took / 1e6:.2f} MB/s)")
            assert n == TRANSFER and cb.eof
            assert got.hexdigest() == want.hexdigest()

            # the reply direction, and the records
            await asyncio.to_thread(sendall, cb, memoryview(b"pong" * 1000), deadline)
            reply = bytearray()
            await asyncio.to_thread(recv_exactly, ca, 4000, deadline, reply.extend)
            assert bytes(reply) == b"pong" * 1000
            for svc, port, peer, role in (
                (h.a, h.pa, h.pb, reg.LgrRole.CLNT),
                (h.b, h.pb, h.pa, reg.LgrRole.SERV),
            ):
                (lgr,) = svc.registry.link_groups()
                assert lgr.smc_type is reg.SmcType.SMCR and lgr.role is role
                assert lgr.lgr_type is reg.LgrType.SINGLE and lgr.conns == 1
                assert lgr.local_gid == ipv4_mapped_gid(port.address)
                assert lgr.peer_gid == ipv4_mapped_gid(peer.address)
                (link,) = svc.registry.links(lgr.lgr_id)
                assert link.state is reg.LinkState.ACTIVE and link.ibdev == port.rxe
                assert link.qpn and link.peer_qpn and link.mtu >= 1024
                assert link.gid == lgr.local_gid and link.peer_gid == lgr.peer_gid
                (conn,) = svc.registry.connections()
                assert conn.mode is reg.ConnMode.SMCR and conn.lgr_id == lgr.lgr_id
            (la,) = h.a.registry.links()
            (lb,) = h.b.registry.links()
            assert (la.qpn, la.peer_qpn) == (lb.peer_qpn, lb.qpn)
            ca.close()
            cb.close()
            await wait_for(released(h), "both connections released")
            cli.close()
            srv.close()

    run_async(body)


def released(h: Hosts) -> Callable[[], bool]:
    return lambda: not h.a.registry.connections() and not h.b.registry.connections()


async def wait_for(pred: Callable[[], bool], what: str, timeout: float = WAIT) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:.0f} s: {what}")
        await asyncio.sleep(0.05)


@pytest.mark.timeout(300)
def test_smcr_100_connections_share_one_link_group_and_qp() -> None:
    async def body() -> None:
        async with two_hosts() as h:
            pairs = []
            for i in range(100):
                ra, rb, cli, srv = await handoff(h, rmb_size=16 << 10)
                assert ra.first_contact == rb.first_contact == (i == 0)
                pairs.append((Channel.from_fds(ra.fds), Channel.from_fds(rb.fds), cli, srv))
            for svc in (h.a, h.b):
                (stats,) = svc.transport.lgr_stats()
                assert stats["conns"] == 100 and len(stats["links"]) == 1, stats
                assert len(svc.transport.verbs_ports()) == 1
                (lgr,) = svc.registry.link_groups()
                assert lgr.conns == 100
                (link,) = svc.registry.links()
                assert link.conns == 100
            deadline = time.monotonic() + 200

            def exchange() -> None:
                for i, (ca, _, _, _) in enumerate(pairs):
                    msg = f"hello {i:03d}".encode() * 10
                    sendall(ca, memoryview(msg), deadline)
                for i, (_, cb, _, _) in enumerate(pairs):
                    out = bytearray()
                    recv_exactly(cb, 90, deadline, out.extend)
                    assert bytes(out) == f"hello {i:03d}".encode() * 10

            await asyncio.to_thread(exchange)
            for ca, cb, cli, srv in pairs:
                ca.close()
                cb.close()
                cli.close()
                srv.close()
            await wait_for(released(h), "all 100 connections released")
            # idle link groups are freed after the linger time (2 s here)
            await wait_for(
                lambda: not h.a.registry.link_groups() and not h.b.registry.link_groups(),
                "idle link groups freed",
            )

    run_async(body)


_CHILD = r"""
import os, sys, time
from smc_handoff.channel import Channel, ChannelFds
fds = [int(x) for x in sys.argv[1:6]]
rx, tx = int(sys.argv[6]), int(sys.argv[7])
ch = Channel.from_fds(ChannelFds(fds[0], fds[1], rx, tx, fds[2], fds[3], fds[4]))
ch.send_into(b"alive")
print("ready", flush=True)
time.sleep(600)
"""


@pytest.mark.timeout(300)
def test_smcr_close_paths() -> None:
    """shutdown → EOF after the data; close → EOF for the peer; abort → reset; an
    application killed with SIGKILL → EOF for the peer, or ECONNRESET when it left data unread
    (the daemon holds its link and sends the close its exit would make in the kernel)."""

    async def body() -> None:
        async with two_hosts() as h:
            deadline = time.monotonic() + 200
            # 1. shutdown_write: EOF after the data; then both close cleanly
            ra, rb, *socks = await handoff(h, rmb_size=16 << 10)
            ca, cb = Channel.from_fds(ra.fds), Channel.from_fds(rb.fds)

            def send_then_shut() -> None:  # more than the 16 KiB ring: needs the reader
                sendall(ca, memoryview(b"x" * 50000), deadline)
                ca.shutdown_write()

            got = bytearray()
            _, n = await asyncio.gather(
                asyncio.to_thread(send_then_shut),
                asyncio.to_thread(recv_exactly, cb, 50001, deadline, got.extend),
            )
            assert n == 50000 and cb.eof and not cb.aborted
            cb.close()
            await wait_for(lambda: ca.peer_closed, "A sees B's close")
            assert ca.recv_into(bytearray(10)) == 0 and ca.eof  # B's close: EOF for A
            with pytest.raises(BrokenPipeError):  # A itself shut down writing
                ca.send_into(b"more")
            ca.close()

            # 2. abort: the peer's next operation raises ECONNRESET
            ra, rb, *socks2 = await handoff(h, rmb_size=16 << 10)
            assert not ra.first_contact  # the link group is reused
            ca, cb = Channel.from_fds(ra.fds), Channel.from_fds(rb.fds)
            ca.abort()
            await wait_for(lambda: cb.aborted, "B sees A's abort")
            with pytest.raises(ConnectionResetError):
                cb.recv_into(bytearray(10))
            cb.close()

            # 3. the application dies: SIGKILL of a process holding the channel. Its exit
            # closes as the kernel closes a dying process's socket: in order when it had read
            # everything (the peer reads its data, then EOF), an abort when it had not.
            socks3 = []
            for unread in (False, True):
                ra, rb, *more = await handoff(h, rmb_size=16 << 10)
                socks3 += more
                fds = ra.fds
                child = subprocess.Popen(
                    [sys.executable, "-c", _CHILD, *map(str, fds.fds()), str(fds.rx_size),
                     str(fds.tx_size)],
                    pass_fds=fds.fds(), stdout=subprocess.PIPE, text=True,
                )  # fmt: skip
                fds.close()
                cb = Channel.from_fds(rb.fds)
                try:
                    assert child.stdout is not None
                    line = await asyncio.wait_for(asyncio.to_thread(child.stdout.readline), WAIT)
                    assert line.strip() == "ready"
                    first = bytearray()
                    await asyncio.to_thread(recv_exactly, cb, 5, deadline, first.extend)
                    assert bytes(first) == b"alive"
                    if unread:
                        assert cb.send_into(b"never read") == 10
                        await asyncio.sleep(0.5)  # in the child's RMB before it dies
                    child.send_signal(signal.SIGKILL)
                    if unread:
                        await wait_for(lambda c=cb: c.aborted, "B sees the death as an abort")
                        with pytest.raises(ConnectionResetError):
                            cb.recv_into(bytearray(10))
                    else:
                        await wait_for(lambda c=cb: c.peer_closed, "B sees the death as a close")
                        assert cb.recv_into(bytearray(10)) == 0 and cb.eof and not cb.aborted
                finally:
                    with contextlib.suppress(ProcessLookupError):
                        child.kill()
                    child.wait()
                cb.close()
            await wait_for(released(h), "every connection released")
            for s in [*socks, *socks2, *socks3]:
                s.close()

    run_async(body)


def test_smcr_daemon_death_is_an_abort_for_the_application() -> None:
    """Unlike loopback, the daemon holds the SMC-R application's peer link: stopping the
    transport (the daemon going away) resets the application's channel."""

    async def body() -> None:
        async with two_hosts() as h:
            ra, rb, *socks = await handoff(h, rmb_size=16 << 10)
            ca, cb = Channel.from_fds(ra.fds), Channel.from_fds(rb.fds)
            h.a.transport.close()
            await wait_for(lambda: ca.aborted, "A's application sees its daemon go")
            with pytest.raises(ConnectionResetError):
                ca.send_into(b"x")
            ca.close()
            cb.close()
            for s in socks:
                s.close()

    run_async(body)


_ = threading  # (threads run via asyncio.to_thread)
