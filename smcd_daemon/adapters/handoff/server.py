"""The handoff socket server: accepts handoff connections, reads their requests and routes them
to the parts of the server that answer them (see the package docstring).

The socket
    ``AF_UNIX`` ``SOCK_SEQPACKET``, inherited from systemd (``smcd.socket``) or bound here with
    mode 0666: every local application may hand off; callers are told apart by ``SO_PEERCRED``
    (read on every connection; the uid decides the quotas and is recorded with each connection),
    not by file permissions. Datagrams are read whole with ``recvmsg`` into a bounded buffer
    (:data:`~smc_handoff.messages.MAX_MESSAGE` + 1 bytes, room for
    :data:`~smc_handoff.messages.MAX_FDS` descriptors, close-on-exec). An invalid datagram is
    answered with ERROR, logged, its descriptors closed, and that connection closed; nothing a
    client sends can end the server or disturb another connection.
One SEQPACKET connection per SMC connection
    It stays open as long as what it registered: the daemon learns about SHUTDOWN/CLOSE notices
    through it, and a hang-up (the application closed it, or died) releases that half's
    resources. A connection past its first request is watched by a reader callback
    (:mod:`..fdwatch`), not a task.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import select
import socket
from pathlib import Path
from typing import Any

from smc_handoff import messages as m
from smc_handoff.messages import ErrorCode
from smcd_daemon.adapters.bpf.peers import PeerDetection
from smcd_daemon.adapters.fdwatch import FdWatch, fd_watch
from smcd_daemon.adapters.handoff_mark import HandoffMarks
from smcd_daemon.config import Config
from smcd_daemon.core.admission import MAX_CONNECTIONS
from smcd_daemon.core.buffers import DmbPool
from smcd_daemon.core.channel_ledger import ChannelLedger
from smcd_daemon.core.eid import EidTable
from smcd_daemon.core.handoff_pairs import ListenerTable
from smcd_daemon.core.registry import Registry
from smcd_daemon.transport.loopback import LinkGroupTable, LoopbackIsm

from .channels import Channels
from .common import (
    Client,
    HandoffStats,
    LocalAddresses,
    Refused,
    bind_seqpacket,
    clip,
    log,
    peer_cred,
)
from .gate import Gate, warn
from .handshake import Handshakes, SmcrProvider
from .ledger_io import Journal, journal_path
from .observer import DmbObserver
from .publisher import Deferred, Publisher
from .registrations import Registrations

__all__ = ["MAX_CLIENTS", "HandoffServer"]

MAX_CLIENTS = MAX_CONNECTIONS
"""Handoff connections served at once, all users together (each SMC connection holds one per
half); past half of it they are shared fairly between users (:mod:`.gate`). The daemon raises
its descriptor limit to match."""
ACCEPT_BURST = 64
"""Connections served per turn of the loop before it attends to other work."""
ACCEPT_DRAIN = 4096
"""Connections accepted per turn at most, refused ones included: a refusal costs little, and
every connection of a flood left in the listen queue is one another user's connect waits
behind (a full queue fails a timed connect at once)."""
ACCEPT_PAUSE = 0.1
"""Seconds accepting pauses when the daemon is out of descriptors (the listening socket stays
readable: without a pause the loop would spin on it)."""


_HANDOFFS = (m.Connect, m.Accept)
_NOTICES = (m.Shutdown, m.Close)


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class HandoffServer:
    """Serves the handoff socket on the running loop (see the package docstring).

    ``sock`` is a listening SOCK_SEQPACKET socket; ``owns_path`` says whether we bound it (then
    :meth:`stop` removes the file) or inherited it from systemd (then the socket unit owns the
    file and it stays). ``config`` defaults to the built-in configuration; :meth:`configure`
    applies a reloaded one to new connections. ``loopback_gid`` is the 128-bit GID of the
    loopback-ism device the inventory shows (random when None). ``smcr`` provides the SMC-R
    service when SMC-R may be tried (None: never).

    The parts, each with its own module: :attr:`handshakes` (CONNECT/ACCEPT), :attr:`channels`
    (SMC-D pairs and halves), :attr:`registrations` (LISTEN/RESUME), :attr:`observer` (DMB
    headers), :attr:`publisher` and :attr:`deferred` (registry and bookkeeping off the hot path),
    :attr:`gate` (per-user limits, fair shares, overload; its :attr:`admission` holds the
    counts), :attr:`ledger` and :attr:`journal` (the channel halves a restarted daemon verifies
    RESUME against).
    """

    def __init__(
        self,
        sock: socket.socket,
        *,
        owns_path: bool,
        config: Config | None = None,
        registry: Registry | None = None,
        eids: EidTable | None = None,
        loopback_gid: int | None = None,
        smcr: SmcrProvider | None = None,
        detection: PeerDetection | None = None,
    ) -> None:
        if config is None:
            config = Config.model_validate({})
        self._sock = sock
        self.owns_path = owns_path
        name = sock.getsockname()
        self.path = Path(os.fsdecode(name)) if name else None
        self._inode = 0
        if owns_path and self.path is not None:
            with contextlib.suppress(OSError):
                self._inode = os.lstat(self.path).st_ino
        self.stats = HandoffStats()
        self.cfg = config
        self.registry = registry if registry is not None else Registry()
        self.eids = eids if eids is not None else EidTable()
        self.pool = DmbPool.from_config(config)
        self.loopback = LoopbackIsm(
            self.pool,
            gid128=loopback_gid,
            link_groups=LinkGroupTable(id_source=self.registry.allocate_lgr_id),
        )
        self.hostname = socket.gethostname()
        self.smcr = smcr
        #: peer detection (the SMC TCP option via BPF); answers None without a detector
        self.detection = detection if detection is not None else PeerDetection.off()
        #: without detection: does a silent same-host client hand its socket over (sock_diag)?
        self.marks = HandoffMarks()
        self.loop: asyncio.AbstractEventLoop | None = None
        self._watch: FdWatch | None = None  # the loop's (fdwatch), once started
        self.gate = Gate(self)
        self.admission = self.gate.admission
        self.ledger = ChannelLedger()
        self.journal = Journal(journal_path(self.path), self.ledger)
        self.listeners = ListenerTable()
        self.local_addresses = LocalAddresses()
        self.deferred = Deferred(self)
        self.publisher = Publisher(self)
        self.observer = DmbObserver(self)
        self.channels = Channels(self)
        self.handshakes = Handshakes(self)
        self.registrations = Registrations(self)
        self.pool.on_destroy = self.observer.forget_view
        self.loopback.reclaim = self.deferred.run  # a DMB short of quota: run the releases first
        self._clients: set[Client] = set()
        self._stopped = False
        self._queue_poll = select.poll()
        self._queue_poll.register(sock.fileno(), select.POLLIN)

    @classmethod
    def bind(cls, path: Path, **kw: Any) -> HandoffServer:
        return cls(bind_seqpacket(path), owns_path=True, **kw)

    def configure(self, config: Config) -> None:
        """A reloaded configuration: quotas, timeouts, modes and peers apply to new handshakes."""
        self.cfg = config
        self.handshakes.reconfigure()
        self.gate.configure()
        self.pool.user_max_bytes = config.quota.buffer_bytes
        self.pool.user_max_buffers = config.quota.connections
        self.pool.pool_max_bytes = config.buffers.pool_max_bytes
        self.pool.pool_max_buffers = config.buffers.pool_max_buffers

    def backlogged(self) -> bool:
        """Do connections wait in the listen queue (not accepted yet)? A handoff may be among
        them, e.g. the client half a server half waits for. Never once stopping: they will
        not be served by this daemon."""
        return not self._stopped and bool(self._queue_poll.poll(0))

    def publish(self) -> None:
        """Add every pending connection to the registry now."""
        self.publisher.publish()

    def refresh(self) -> None:
        """Bring cursors and byte counts of every live SMC connection up to date."""
        self.observer.refresh()

    # -- life cycle -----------------------------------------------------------------------------

    def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._watch = fd_watch(self.loop)
        self._sock.setblocking(False)
        self.loop.add_reader(self._sock.fileno(), self._on_accept)
        self.gate.start(self.loop)

    async def stop(self, grace: float | None = None) -> None:
        """Stop serving. Handshakes under way get up to ``grace`` seconds (by default
        ``timeouts.stop_grace`` of the configuration in force) to end (cancelled
        mid-CLC, one would leave its TCP connection reset: an error for its application);
        connections that sent no request yet, and client halves still waiting for their server
        half, give up at once (their streams are untouched: TCP). Live channels go on."""
        if self._stopped:
            return
        self._stopped = True
        if self.loop is not None:
            with contextlib.suppress(Exception):
                self.loop.remove_reader(self._sock.fileno())
        await self._drain(self.cfg.timeouts.stop_grace if grace is None else grace)
        self.observer.stop()
        self.gate.stop()
        for client in list(self._clients):
            if client.task is not None:
                client.task.cancel()
        for client in list(self._clients):
            if client.task is not None:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await client.task
        for client in list(self._clients):  # those watched past their first request
            with contextlib.suppress(Exception):
                self.end_client(client, daemon_stops=True)
        self.deferred.run()
        self.channels.close()
        self.publisher.close()
        self.pool.close()
        self.marks.close()
        self.journal.remove()  # only when no channel half is left to resume
        if self.owns_path and self.path is not None:
            # Only our own file: a daemon started meanwhile may have replaced a path it found
            # stale (e.g. after we were stopped and it started before we finished).
            with contextlib.suppress(OSError):
                if os.lstat(self.path).st_ino == self._inode:
                    os.unlink(self.path)
        self._sock.close()

    async def _drain(self, grace: float) -> None:
        """The first part of :meth:`stop` (accepting has stopped)."""
        for client in list(self.gate.pending):  # nothing read: their requests stay unread
            if client.task is not None:
                client.task.cancel()
        self.handshakes.arrivals.stopping("smcd is stopping")
        busy = [c.task for c in self._clients if c.task is not None and not c.task.done()]
        if busy and grace > 0:
            _done, late = await asyncio.wait(busy, timeout=grace)
            if late:
                log.warning("handoff: %d handshakes did not end within %g s of the stop; "
                            "their connections are reset", len(late), grace)  # fmt: skip

    # -- accepting --------------------------------------------------------------------------------

    def _on_accept(self) -> None:
        served = 0
        for _ in range(ACCEPT_DRAIN):
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                # EMFILE/ENFILE/ENOBUFS: the connection waits in the backlog; pause accepting
                # (the socket stays readable: the loop would spin) and try again shortly.
                self.stats.errors += 1
                warn.warning("accept-failed", "handoff: accept failed: %s; pausing %g s", e,
                             ACCEPT_PAUSE)  # fmt: skip
                self._pause_accepting()
                return
            if self._serve(conn):
                served += 1
                if served >= ACCEPT_BURST:
                    return  # let the loop breathe; the rest on its next turn

    def _pause_accepting(self) -> None:
        loop = self.loop
        if loop is None or self._stopped:
            return
        with contextlib.suppress(Exception):
            loop.remove_reader(self._sock.fileno())

        def resume() -> None:
            if not self._stopped:
                loop.add_reader(self._sock.fileno(), self._on_accept)

        loop.call_later(ACCEPT_PAUSE, resume)

    def _serve(self, conn: socket.socket) -> bool:
        """Serve an accepted connection; False if it was refused (answered and closed)."""
        self.stats.connections += 1
        cred = peer_cred(conn)
        admitted = self.gate.admit(conn, cred)
        if admitted is False:
            return False  # answered with a FALLBACK and closed: at a limit (see .gate)
        conn.setblocking(False)
        client = Client(conn, cred)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("handoff: connection from %s", client.label)
        self._clients.add(client)
        assert self.loop is not None
        if admitted:  # None: its request is already in it, so it is not pending
            self.gate.served(client, self.loop.time())
        client.task = self.loop.create_task(self._client_loop(client), name="smcd-handoff")
        return True

    def expire(self, client: Client) -> None:
        """``client`` sent no request in time (:mod:`.gate`): end its connection."""
        if client.task is not None and not client.task.done():
            client.task.cancel()  # its finally ends the connection
        else:
            self.end_client(client)

    # -- one client ---------------------------------------------------------------------------

    async def _readable(self, sock: socket.socket) -> None:
        assert self.loop is not None
        fut: asyncio.Future[None] = self.loop.create_future()
        watch = self._watch
        assert watch is not None
        watch.add(sock.fileno(), functools.partial(_wake, fut))
        try:
            await fut
        finally:
            watch.remove(sock.fileno())

    def _invalid(self, client: Client, e: m.HandoffProtocolError) -> m.Error:
        """An invalid datagram (its descriptors are already closed): counted, logged, and the
        ERROR to answer it with."""
        self.stats.invalid += 1
        warn.warning("invalid-request", "handoff: invalid request from %s: %s", client.label, e)
        return m.Error(e.code, clip(str(e)))

    async def _receive(self, client: Client) -> tuple[m.Request, list[int]] | None:
        """The next valid request and its descriptors; None at EOF. An invalid datagram raises
        :class:`Refused`."""
        while True:
            try:
                msg, fds = m.recv_message(client.sock, requests=True)
            except (BlockingIOError, InterruptedError):
                await self._readable(client.sock)
                continue
            except m.HandoffClosedError:
                return None
            except m.HandoffProtocolError as e:
                raise Refused(self._invalid(client, e)) from None
            except OSError as e:
                warn.info("conn-failed", "handoff: %s: connection failed: %s", client.label, e)
                return None
            self.stats.requests += 1
            return msg, fds  # type: ignore[return-value]

    def send(self, client: Client, reply: m.Reply, fds: list[int] | tuple[int, ...] = ()) -> bool:
        """Send ``reply``; False if the client is gone or does not read its replies."""
        try:
            m.send_message(client.sock, reply, list(fds))
        except (BlockingIOError, InterruptedError):
            self.stats.errors += 1
            warn.warning("no-reader", "handoff: %s does not read its replies; closing",
                         client.label)  # fmt: skip
            return False
        except OSError as e:
            warn.info("gone", "handoff: %s went away before the reply: %s", client.label, e)
            return False
        return True

    async def _client_loop(self, client: Client) -> None:
        """The first request, to its reply. A connection that then holds something (a channel
        half, a listener, a resumed record) is watched by :meth:`_on_readable` from there on:
        notices and the hang-up need no task of their own."""
        watched = False
        try:
            first = await self._receive(client)
            if first is None:
                return
            self.gate.first_request(client)
            msg, fds = first
            if isinstance(msg, _HANDOFFS):
                keep = await self.handshakes.handoff(client, msg, fds[0])
            elif isinstance(msg, m.Listen):
                keep = self.registrations.listen(client, fds[0])
            elif isinstance(msg, m.Resume):
                keep = self.registrations.resume(client, msg, fds)
            else:
                raise Refused(
                    m.Error(ErrorCode.BAD_STATE, f"{msg.TYPE.name} cannot open a connection")
                )
            if keep:
                assert self.loop is not None
                client.task = None
                # Level-triggered: a notice already queued wakes it on the next loop turn.
                assert self._watch is not None
                self._watch.add(client.sock.fileno(), functools.partial(self._on_readable, client))
                watched = True
        except Refused as e:
            self.send(client, e.reply)
        except asyncio.CancelledError:
            if self._stopped:
                raise
            # expired (.gate): the task ends here, the connection below
        except Exception as e:
            self._unexpected(client, e)
        finally:
            if not watched:
                self.end_client(client)

    def _on_readable(self, client: Client) -> None:
        """A connection past its first request: SHUTDOWN/CLOSE notices, then the hang-up."""
        if client.watched_done:
            return
        try:
            while True:
                try:
                    msg, fds = m.recv_message(client.sock, requests=True)
                except (BlockingIOError, InterruptedError):
                    return
                except m.HandoffClosedError:
                    break
                except m.HandoffProtocolError as e:
                    self.send(client, self._invalid(client, e))
                    break
                except OSError as e:
                    warn.info("conn-failed", "handoff: %s: connection failed: %s", client.label, e)
                    break
                self.stats.requests += 1
                if fds:
                    m.close_fds(fds)
                if isinstance(msg, _NOTICES):
                    if client.half is not None:
                        self.deferred.defer(self.channels.notice, client.half, msg)
                        continue
                    if client.smcr_conn is not None:
                        continue  # SMC-R: the daemon sees the close on the peer link it holds
                self.send(
                    client, m.Error(ErrorCode.BAD_STATE, f"{msg.TYPE.name} is not allowed now")
                )
                break
        except Exception as e:
            self._unexpected(client, e)
        self.end_client(client)

    def _unexpected(self, client: Client, e: Exception) -> None:
        """A bug met by some input: one rate-limited line (no traceback a client could fill the
        journal with); the traceback at debug level."""
        self.stats.errors += 1
        warn.error("unexpected", "handoff: unexpected error serving %s; connection closed: %s: %s",
                   client.label, type(e).__name__, e)  # fmt: skip
        log.debug("handoff: the unexpected error", exc_info=e)

    def end_client(self, client: Client, *, daemon_stops: bool = False) -> None:
        """The connection is over: release what it held and close it (exactly once).

        ``daemon_stops``: the daemon, not the application, ends it. A channel half then goes on
        without us, exactly as after a SIGKILL: its ledger entry stays in the journal for the
        next daemon to verify its RESUME by, and its DMBs are not released, because the pool
        zeroes a released buffer (a hole punched into the memfd): that would wipe the rings
        under two applications still moving data through them."""
        if client.watched_done:
            return
        client.watched_done = True
        if client.task is None and self._watch is not None:
            with contextlib.suppress(Exception):
                self._watch.remove(client.sock.fileno())
        self._clients.discard(client)
        self.gate.release(client)
        try:
            if client.listener is not None:
                lst, client.listener = client.listener, None
                self.registrations.unlisten(lst)
            if client.half is not None and daemon_stops:
                client.half = None
            elif client.half is not None:
                half, client.half = client.half, None
                self.journal.append_later(self.ledger.drop(half.conn_id))
                if half.local_token is None:  # a resumed half: its DMB was charged, not held
                    self.pool.discharge(half.uid, half.rx_size)
                self.channels.hang_up(half)
        finally:
            client.sock.close()
