"""One SMC-R connection in the daemon: the application's channel buffers, the relay
(:mod:`.smcr_relay`) and the wakeups between them.

The application holds an ordinary :class:`smc_handoff.channel.Channel` whose peer is this
object. What the channel expects of a peer, the daemon does:

* **Header.** The RMB's CDC header (``W_PROD``/``W_CONS`` words) is written only here, each word
  with one aligned 8-byte store, from the relay's :class:`~.smcr_relay.AppView`.
* **Kicks to the application.** After a header change, for each of the application's two
  waiters (``WAIT`` for data/EOF/abort, ``WAIT_SPACE`` for room; RMB trailer) that asks for a
  kick of a generation not yet kicked: a byte on the peer link when it asked for that
  (``WANT_LINK``), else a write to its RX eventfd; then its KICK word.
* **Kicks from the application.** The daemon keeps its own two WAIT words (send-buffer trailer)
  set with a fresh generation after every wakeup, so the application kicks it (eventfd)
  whenever it publishes data or flags (``WAIT``) and when it consumes (``WAIT_SPACE``). The
  store-then-load race of that handshake (see :mod:`smc_handoff.layout`) is closed the way the
  channel closes it: a fence after arming and a second look 1 ms later; a slow sweep of every
  connection backs that up. Toward the application we are the publisher: a fence between the
  header's stores and the look at its WAIT words, as the channel's own publisher does (an
  application's event loop sleeps on its kick with no timer).
* **Liveness.** The daemon keeps the other end of the application's peer link: the application's
  death is a hang-up here (for the remote end the close its exit makes in the kernel: closed,
  or an abort when it left received data unread; see ``ConnRelay.app_died``), and the daemon's
  death is one for the application (it sees ``ECONNRESET``), unlike loopback where applications
  hold both ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import socket
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from smc_handoff.channel import WANT_DATA, WANT_LINK, WANT_SPACE, ChannelFds
from smc_handoff.layout import (
    C_KICK,
    C_KICK_SPACE,
    C_WAIT,
    C_WAIT_SPACE,
    TYPE_WORD,
    W_CONS,
    W_PROD,
    W_TYPE,
    cons_word,
    fence,
    prod_word,
    split_word,
)
from smcd_daemon.core.rmb import SmcrBuffer
from smcd_daemon.transport.smcr_relay import AppView, ConnRelay, RelayViolation, Transmit
from smcd_daemon.transport.verbs_model import RemoteRing
from smcd_daemon.wire.cdc import CdcMessage
from smcd_daemon.wire.cursor import Cursor

if TYPE_CHECKING:
    from smcd_daemon.transport.verbs import VerbsLink

__all__ = ["RECHECK_DELAY", "SmcrConnection"]

log = logging.getLogger(__name__)

#: Second look after arming the WAIT word (bounds a lost kick, see the module docstring).
RECHECK_DELAY = 0.001


class SmcrConnection:
    """The daemon's end of one SMC-R connection. Built by the transport once the CLC handshake
    (and, for a first contact, LLC CONFIRM LINK) succeeded; :attr:`app_fds` go to the
    application (the caller closes its copies after sending them)."""

    def __init__(
        self,
        *,
        conn_id: int,
        lgr_id: int,
        link_id: int,
        token: int,
        peer_token: int,
        rmb: SmcrBuffer,
        rmb_id: int,
        sndbuf: SmcrBuffer,
        snd_region: Any,
        peer_ring: RemoteRing,
        want_send: Callable[[SmcrConnection], None],
        finished: Callable[[SmcrConnection], None],
    ) -> None:
        self.conn_id = conn_id
        self.lgr_id = lgr_id
        self.link_id = link_id
        self.token = token
        self.peer_token = peer_token
        self.rmb = rmb
        self.rmb_id = rmb_id
        self.sndbuf = sndbuf
        self.snd_region = snd_region
        self.peer_ring = peer_ring
        self.relay = ConnRelay(peer_token=peer_token, rx_len=rmb.ring_len, tx_len=sndbuf.ring_len)
        self._want_send = want_send
        self._finished_cb = finished
        self.queued = False  # in the link's send queue
        self.priority: deque[CdcMessage] = deque()  # failover validation, sent first
        self.done = False
        self._gen = 0
        self._kicked_d = 0
        self._kicked_s = 0
        self._recheck: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.posted = 0  # CDC messages posted (stats)
        flags = os.EFD_CLOEXEC | os.EFD_NONBLOCK
        self._kick_efd = os.eventfd(0, flags)  # the application kicks us here
        self._app_efd = os.eventfd(0, flags)  # we kick the application (level mode) here
        mine, theirs = socket.socketpair(
            socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC
        )
        mine.setblocking(False)
        self._link = mine
        self._app_fds: ChannelFds | None = ChannelFds(
            rmb.dup_fd(),
            sndbuf.dup_fd(),
            rmb.channel_size,
            sndbuf.channel_size,
            os.dup(self._app_efd),
            os.dup(self._kick_efd),
            theirs.detach(),
        )

    # ------------------------------------------------------------------ setup
    def take_app_fds(self) -> ChannelFds:
        """The application's descriptors (once): the caller sends them and closes them."""
        fds, self._app_fds = self._app_fds, None
        if fds is None:
            raise RuntimeError("the application's descriptors were taken already")
        return fds

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.rmb.header[W_TYPE] = TYPE_WORD  # we are the only writer of the RMB header
        loop.add_reader(self._kick_efd, self._on_kick)
        loop.add_reader(self._link.fileno(), self._on_link)
        self._arm()
        self.scan()

    # ------------------------------------------------------------------ the application's side
    def _arm(self) -> None:
        """A fresh "kick me" for both of the application's publications: data and flags
        (its WAIT word) and consumption (its WAIT_SPACE word), on our eventfd."""
        self._gen += 1
        ctrl = self.sndbuf.ctrl
        ctrl[C_WAIT] = self._gen << 8 | WANT_DATA
        ctrl[C_WAIT_SPACE] = self._gen << 8 | WANT_SPACE
        fence()

    def _on_kick(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.eventfd_read(self._kick_efd)
        self._arm()
        self.scan()
        if self._recheck is None and self._loop is not None and not self.done:
            self._recheck = self._loop.call_later(RECHECK_DELAY, self._second_look)

    def _second_look(self) -> None:
        self._recheck = None
        self.scan()

    def scan(self) -> None:
        """Read the application's TX header and send what became due."""
        if self.done:
            return
        hdr = self.sndbuf.header
        cons = hdr[W_CONS]  # flags first: data published before a close flag is then seen
        prod = hdr[W_PROD]
        pw, pc, _, _ = split_word(prod)
        cw, cc, pflags, csflags = split_word(cons)
        if pc >= 1 << 32 or cc >= 1 << 32:  # cannot happen (u32 fields); keeps Cursor valid
            return
        try:
            self.relay.app_update(Cursor(pw, pc), Cursor(cw, cc), pflags, csflags)
        except RelayViolation as e:
            log.warning("SMC-R connection %d: %s; aborting", self.conn_id, e)
            self.publish(self.relay.app_view())
        self._want_send(self)
        self._maybe_finish()

    def _on_link(self) -> None:
        try:
            data = self._link.recv(64)
            if data:
                return  # a stray kick byte: the application never sends on the link
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            pass
        self._drop_link_reader()
        self.scan()  # close flags published before the hang-up
        if not self.relay.app_gone:
            why = "" if self.relay.app_csflags else " without closing"
            log.debug("SMC-R connection %d: application hung up%s", self.conn_id, why)
            self.relay.app_died()
        self._want_send(self)
        self._maybe_finish()

    def _drop_link_reader(self) -> None:
        if self._loop is not None:
            with contextlib.suppress(Exception):
                self._loop.remove_reader(self._link.fileno())
            with contextlib.suppress(Exception):
                self._loop.remove_reader(self._kick_efd)

    def publish(self, view: AppView) -> None:
        """Write the application's RX header and kick it if it waits."""
        if self.done:
            return
        hdr = self.rmb.header
        hdr[W_PROD] = prod_word(view.prod.wrap, view.prod.count)
        hdr[W_CONS] = cons_word(
            view.cons.wrap, view.cons.count, view.prod_flags & 0xFF, view.conn_state_flags & 0xFF
        )
        fence()  # the header is visible before we look for a request (layout: the Dekker race)
        self._kick_app()

    def _kick_app(self) -> None:
        """Kick each of the application's waiters (data, space) that asked for a generation
        not kicked yet, on the descriptor it sleeps on."""
        ctrl = self.rmb.ctrl
        wait = ctrl[C_WAIT]
        if wait & WANT_DATA and wait >> 8 != self._kicked_d and self._kick(wait, C_KICK):
            self._kicked_d = wait >> 8
        wait = ctrl[C_WAIT_SPACE]
        if wait & WANT_SPACE and wait >> 8 != self._kicked_s and self._kick(wait, C_KICK_SPACE):
            self._kicked_s = wait >> 8

    def _kick(self, wait: int, kick_idx: int) -> bool:
        try:
            if wait & WANT_LINK:
                self._link.send(b"k", socket.MSG_DONTWAIT)
            else:
                os.eventfd_write(self._app_efd, 1)
        except BlockingIOError:
            pass
        except OSError:
            return False
        self.rmb.ctrl[kick_idx] = wait >> 8  # after the kick: the application drains what it saw
        return True

    # ------------------------------------------------------------------ the peer's side
    def on_cdc(self, msg: CdcMessage) -> None:
        if self.done:
            return
        try:
            view = self.relay.cdc_received(msg)
        except RelayViolation as e:
            log.warning("SMC-R connection %d: peer %s; aborting", self.conn_id, e)
            view = self.relay.app_view()
        if view is not None:
            self.publish(view)
        self._want_send(self)
        self._maybe_finish()

    def transmit(self, link: VerbsLink) -> bool:
        """Post the next due message on ``link`` (the caller checked it has a free slot).
        True when something was posted."""
        if self.priority:
            cdc = self.priority.popleft()
            link.send(cdc.encode(), tag=("cdc", self.conn_id, None))
            self.posted += 1
            return True
        tx: Transmit | None = self.relay.next_send()
        if tx is None:
            return False
        tag = ("cdc", self.conn_id, tx.cdc.seqno)
        if tx.write is not None:
            link.write_ring(
                self.snd_region,
                tx.write.length,
                src_offset=tx.write.offset,
                dst=self.peer_ring,
                dst_offset=tx.write.offset,
                notify=tx.cdc.encode(),
                tag=tag,
            )
        else:
            link.send(tx.cdc.encode(), tag=tag)
        self.posted += 1
        return True

    def send_done(self, seqno: int | None) -> None:
        if seqno is not None:
            self.relay.send_done(seqno)
        self._maybe_finish()

    # ------------------------------------------------------------------ link group events
    def move(
        self, to_link: int, peer_rkey: int | None, peer_vaddr: int | None, validate: bool
    ) -> None:
        """Failover to ``to_link`` (``MoveConnection``)."""
        self.link_id = to_link
        if peer_rkey is not None and peer_vaddr is not None:
            self.peer_ring = RemoteRing(peer_vaddr, peer_rkey, self.peer_ring.size)
        if validate:
            self.priority.clear()
            self.priority.append(self.relay.failover())
        else:
            self.relay.failover()
        self._want_send(self)

    def lost(self, why: str) -> None:
        """The link group ended: the application gets an abort (ECONNRESET)."""
        self.relay.lost(why)
        self.publish(self.relay.app_view())
        self._maybe_finish()

    def _maybe_finish(self) -> None:
        if not self.done and self.relay.finished:
            self.close()
            self._finished_cb(self)

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        """Stop watching and close the daemon's descriptors (buffers are the caller's)."""
        if self.done:
            return
        self.done = True
        if self._recheck is not None:
            self._recheck.cancel()
            self._recheck = None
        self._drop_link_reader()
        self._link.close()
        for fd in (self._kick_efd, self._app_efd):
            with contextlib.suppress(OSError):
                os.close(fd)
        if self._app_fds is not None:
            self._app_fds.close()
            self._app_fds = None

    def stats(self) -> dict[str, Any]:
        r = self.relay
        return {
            "bytes_sent": r.tx_sent,
            "bytes_received": r.app_cons,
            "rx_prod": r.peer_prod,
            "tx_cons": r.peer_cons,
            "posted": self.posted,
            "aborted": r.aborted,
            "abort_reason": r.abort_reason,
        }


def _errno_name(e: OSError) -> str:
    return errno.errorcode.get(e.errno or 0, str(e.errno))
