"""The sans-IO core of one SMC-R connection in the daemon: the application's shared-memory channel
on one side, CDC messages and RDMA WRITEs on the other.

The application sees the same :class:`smc_handoff.channel.Channel` as for SMC-D loopback; its
"peer" is now the daemon:

* its **RX buffer** is the connection's RMB: the remote daemon RDMA-WRITEs the remote
  application's bytes into its ring, and this daemon writes the header a loopback peer would
  write - the remote *producer* cursor (data for the application), the remote *consumer* cursor
  (how far the remote application has read what this one sent) and the remote flags - taken
  from the CDC messages it receives (:meth:`ConnRelay.cdc_received` → :class:`AppView`);
* its **TX buffer** is the connection's send buffer, sized like the remote RMB, so cursors map
  1:1: a byte at producer position *p* sits at ring offset *p mod L* in both. The application
  writes there and publishes its producer cursor, its consumer cursor (of its RX ring) and its
  flags as it does for loopback (:meth:`ConnRelay.app_update`); the daemon RDMA-WRITEs the new
  bytes to the same offsets of the remote RMB and sends the CDC (:meth:`ConnRelay.next_send` →
  :class:`Transmit`). Since the application may reuse send-buffer space only once the remote
  consumer cursor has passed it, nothing not yet written can be overwritten.

Ring length: the RMBE announced in CLC is exactly the ring the peer writes at offsets 0 .. size-1,
as a kernel peer expects; the application channel's 32-byte header sits in front of it, outside
the registered region (``layout.SMCR_CHANNEL_SIZES``).

Rules taken from Linux (``smc_cdc.c``, ``smc_tx.c``, ``smc_rx.c``):

* sequence numbers: every CDC gets the next u16; a received one older than the last is dropped
  (``smc_cdc_before``); cursors older than the ones held are ignored (``smc_cdc_cursor_to_host``);
* consumer-cursor updates avoid silly window syndrome (``smc_tx_consumer_update``): sent when the
  peer asked (``cons_curs_upd_req``), or when more than ``rmbe_update_limit`` (a tenth of the
  ring, at most ``SOCK_MIN_SNDBUF / 2``) was consumed *and* the peer is write-blocked or sees at
  most half the ring free. Every CDC carries the current consumer cursor anyway;
* ``write_blocked`` is sent while the application's send ring is full, the first such CDC with
  ``cons_curs_upd_req``; close and abort travel as ``peer_done_writing`` / ``peer_conn_closed``
  / ``peer_conn_abort``, after all data;
* failover (``smc_switch_cursor`` / ``smcr_cdc_msg_send_validation`` /
  ``smc_cdc_msg_validate``): the connection's producer position is rewound to the last one whose
  CDC completed (or the remote consumer cursor, if further), a CDC with
  ``failover_validation`` and the last completed sequence number goes first on the new link, then
  the data is written again. The receiver aborts when that sequence number is ahead of the last
  one it saw (it lost a message the sender believes delivered).

Positions are kept as absolute byte counts (Python ints) and turned into (wrap, count) cursors
only at the edges, where every value from the application or the peer is bounds-checked: a
cursor outside what is possible is a protocol violation that aborts the connection, never an
out-of-range write.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from smcd_daemon.errors import SmcError
from smcd_daemon.wire.cdc import CdcMessage, ConnStateFlag, ProducerFlag, seqno_before
from smcd_daemon.wire.cursor import Cursor, is_stale

__all__ = [
    "SOCK_MIN_SNDBUF",
    "AppView",
    "ConnRelay",
    "RelayViolation",
    "RingWrite",
    "Transmit",
    "cursor_at",
    "rmbe_update_limit",
]

#: ``SOCK_MIN_SNDBUF`` on x86-64 (2 * (2048 + sizeof(struct sk_buff) rounded)), as the kernel's
#: consumer-update limit uses it.
SOCK_MIN_SNDBUF = 4608
_CLOSING = ConnStateFlag.PEER_CONN_CLOSED | ConnStateFlag.PEER_CONN_ABORT


def rmbe_update_limit(ring_len: int) -> int:
    """``smc_rmb_wnd_update_limit``: consumed bytes worth a consumer-cursor update."""
    return min(ring_len // 10, SOCK_MIN_SNDBUF // 2)


def cursor_at(position: int, ring_len: int) -> Cursor:
    """The (wrap, count) cursor of an absolute byte position in a ring."""
    wrap, count = divmod(position, ring_len)
    return Cursor(wrap & 0xFFFF, count)


def _advance(ring_len: int, old: Cursor, new: Cursor) -> int:
    """Bytes from ``old`` to ``new`` taking the u16 wrap counter modulo 2**16; negative when
    ``new`` is behind within the same wrap."""
    return ((new.wrap - old.wrap) & 0xFFFF) * ring_len + new.count - old.count


class RelayViolation(SmcError):
    """The application or the peer published a cursor that cannot be (the connection aborts)."""


@dataclass(frozen=True, slots=True)
class RingWrite:
    """Write ``length`` bytes from ring offset ``offset`` of the send buffer to the same offset
    of the peer's RMB ring (the transport splits it where the ring wraps)."""

    offset: int
    length: int


@dataclass(frozen=True, slots=True)
class Transmit:
    """One CDC message to send, after ``write`` if any; ``upto`` is the producer position it
    announces (confirmed by :meth:`ConnRelay.send_done` with ``cdc.seqno``)."""

    cdc: CdcMessage
    write: RingWrite | None
    upto: int


@dataclass(frozen=True, slots=True)
class AppView:
    """What the application's RX header must say: the peer's producer cursor in our RMB ring,
    the peer's consumer cursor in its RMB ring (= our send ring) and the peer's flags."""

    prod: Cursor
    cons: Cursor
    prod_flags: int
    conn_state_flags: int


class ConnRelay:
    """Cursor and flag bookkeeping of one connection (see the module docstring).

    ``peer_token`` is the peer's RMBE alert token (it goes into every CDC we send), ``rx_len``
    our RMB ring, ``tx_len`` our send ring = the peer's RMB ring.
    """

    def __init__(self, *, peer_token: int, rx_len: int, tx_len: int) -> None:
        if rx_len <= 0 or tx_len <= 0:
            raise ValueError("ring lengths must be positive")
        self.peer_token = peer_token
        self.rx_len = rx_len
        self.tx_len = tx_len
        self.update_limit = rmbe_update_limit(rx_len)
        # the application (our end)
        self.app_prod = 0  # bytes the application put into the send ring
        self.app_cons = 0  # bytes it consumed from the RMB ring
        self._app_prod_cur = Cursor()
        self._app_cons_cur = Cursor()
        self.app_pflags = 0
        self.app_csflags = 0
        self.app_gone = False
        # what we sent
        self.tx_sent = 0  # producer position announced (data written before it)
        self.tx_high = 0  # highest position ever announced (bounds the peer's consumer cursor)
        self.tx_fin = 0  # producer position of the last completed CDC
        self.cons_sent = 0
        self.seq = 0  # last sequence number used
        self.seq_fin = 0  # last completed one
        self._flags_sent: tuple[int, int] = (0, 0)
        self._flags_fin: tuple[int, int] = (0, 0)
        self._pending: deque[tuple[int, int, tuple[int, int]]] = deque()
        self._req_sent = False  # cons_curs_upd_req sent in this write-blocked episode
        self.final_sent = False  # a CDC with peer_conn_closed/abort went out
        self.final_done = False  # ... and completed
        # the peer
        self.peer_prod = 0  # bytes the peer wrote into our RMB ring
        self.peer_cons = 0  # bytes the peer consumed of what we wrote
        self._peer_prod_cur = Cursor()
        self._peer_cons_cur = Cursor()
        self.peer_pflags = 0
        self.peer_csflags = 0
        self.rx_seq = 0
        self._upd_req = False  # the peer asked for our consumer cursor
        # local abort (violation, out of sync, the application died, the link group ended)
        self.aborted = False
        self.abort_reason: str | None = None
        self.link_lost = False  # nothing can be sent any more

    # ------------------------------------------------------------------ the application
    def app_update(
        self, prod: Cursor, cons: Cursor, prod_flags: int, conn_state_flags: int
    ) -> None:
        """The application's TX header: its producer cursor (send ring), its consumer cursor
        (RMB ring) and its flags. Read the flags word *before* the producer word, so that data
        published before a close flag is never missed. Raises :class:`RelayViolation` (after
        aborting) for an impossible cursor."""
        if self.aborted:
            return
        if prod.count >= self.tx_len or cons.count >= self.rx_len:
            self._violate(f"cursor count beyond the ring (prod {prod}, cons {cons})")
        d = _advance(self.tx_len, self._app_prod_cur, prod)
        if d < 0 or self.app_prod + d > self.peer_cons + self.tx_len:
            self._violate(
                f"the application's producer cursor {prod} overruns the peer's window "
                f"(sent {self.app_prod}, peer consumed {self.peer_cons}, ring {self.tx_len})"
            )
        c = _advance(self.rx_len, self._app_cons_cur, cons)
        if c < 0 or self.app_cons + c > self.peer_prod:
            self._violate(
                f"the application's consumer cursor {cons} passes the data received "
                f"({self.peer_prod} bytes)"
            )
        self.app_prod += d
        self._app_prod_cur = prod
        self.app_cons += c
        self._app_cons_cur = cons
        self.app_pflags = prod_flags & ProducerFlag.WRITE_BLOCKED
        self.app_csflags |= conn_state_flags & (
            ConnStateFlag.PEER_DONE_WRITING | ConnStateFlag.PEER_CONN_CLOSED
        )
        if conn_state_flags & ConnStateFlag.PEER_CONN_ABORT:
            self.abort("the application aborted the connection")

    def app_died(self) -> None:
        """The application's end of the peer link hung up without a close flag first: its
        process ended (``os._exit``, a signal). The kernel closes an exiting process's sockets,
        and ``smc_close_final`` sends ``peer_conn_closed``, or ``peer_conn_abort`` when received
        data is unread (TCP's FIN or RST); the peer gets what the application's ``close()``
        would have sent. Its consumer cursor was published with every read, so ``app_cons``
        is exact."""
        self.app_gone = True
        if self.app_csflags & ConnStateFlag.PEER_CONN_CLOSED or self.aborted:
            return
        if self.app_cons == self.peer_prod:
            self.app_csflags |= ConnStateFlag.PEER_DONE_WRITING | ConnStateFlag.PEER_CONN_CLOSED
        else:
            self.abort("the application went away without closing, with received data unread")

    def abort(self, why: str) -> None:
        """Abort locally: the peer is told (``peer_conn_abort``) and the application sees a
        reset in its header (:meth:`app_view`)."""
        if not self.aborted:
            self.aborted = True
            self.abort_reason = why

    def _violate(self, why: str) -> None:
        self.abort(f"protocol violation: {why}")
        raise RelayViolation(why)

    # ------------------------------------------------------------------ sending
    def _cons_update_due(self) -> bool:
        to_confirm = self.app_cons - self.cons_sent
        if to_confirm <= 0:
            return False
        if self._upd_req:
            return True
        sender_free = self.rx_len - (self.peer_prod - self.cons_sent)
        return to_confirm > self.update_limit and (
            sender_free <= self.rx_len // 2 or bool(self.peer_pflags & ProducerFlag.WRITE_BLOCKED)
        )

    def next_send(self) -> Transmit | None:
        """The next CDC to send (with the RDMA WRITE before it), or None when nothing is due.
        Commits: call it only when the link can take the work requests."""
        if self.final_sent or self.link_lost:
            return None
        if self.peer_csflags & ConnStateFlag.PEER_CONN_ABORT:
            return self._answer_abort()
        write = None
        upto = self.tx_sent
        if not self.aborted and self.app_prod > self.tx_sent:
            write = RingWrite(self.tx_sent % self.tx_len, self.app_prod - self.tx_sent)
            upto = self.app_prod
        csflags = self.app_csflags
        if self.aborted:
            csflags |= ConnStateFlag.PEER_CONN_ABORT
        pflags = self.app_pflags if not self.aborted else 0
        blocked = bool(pflags & ProducerFlag.WRITE_BLOCKED)
        ask = blocked and not self._req_sent
        flags = (pflags, csflags)
        if write is None and not ask and flags == self._flags_sent and not self._cons_update_due():
            return None
        if ask:
            pflags |= ProducerFlag.CONS_CURS_UPD_REQ
        self.seq = (self.seq + 1) & 0xFFFF
        cdc = CdcMessage(
            self.seq,
            self.peer_token,
            cursor_at(upto, self.tx_len),
            cursor_at(self.app_cons, self.rx_len),
            ProducerFlag(pflags),
            ConnStateFlag(csflags),
        )
        self.tx_sent = upto
        self.tx_high = max(self.tx_high, upto)
        self.cons_sent = self.app_cons
        self._flags_sent = flags
        self._req_sent = blocked
        self._upd_req = False
        self._pending.append((self.seq, upto, flags))
        if csflags & _CLOSING:
            self.final_sent = True
        return Transmit(cdc, write, upto)

    def _answer_abort(self) -> Transmit:
        """The peer aborted and we sent no final CDC yet: answer with an abort, no data, as
        the kernel's ``smc_close_passive_abort_received`` does (``smc_close_abort``). A kernel
        that aborted on close (data unread) waits in PEERCLOSEWAIT1 for that answer before it
        frees the socket; without it the socket, and the smc module, stay held."""
        self.seq = (self.seq + 1) & 0xFFFF
        flags = (0, int(ConnStateFlag.PEER_CONN_ABORT))
        cdc = CdcMessage(
            self.seq,
            self.peer_token,
            cursor_at(self.tx_sent, self.tx_len),
            cursor_at(self.app_cons, self.rx_len),
            ProducerFlag(0),
            ConnStateFlag.PEER_CONN_ABORT,
        )
        self._flags_sent = flags
        self._pending.append((self.seq, self.tx_sent, flags))
        self.final_sent = True
        return Transmit(cdc, None, self.tx_sent)

    def send_done(self, seqno: int) -> None:
        """The CDC with ``seqno`` completed (and every one before it: RC keeps order)."""
        while self._pending:
            seq, upto, flags = self._pending.popleft()
            self.seq_fin, self.tx_fin, self._flags_fin = seq, upto, flags
            if flags[1] & _CLOSING:
                self.final_done = True
            if seq == seqno:
                return

    def failover(self) -> CdcMessage:
        """The connection moved to another link: the validation CDC to send there first; the
        data after the last confirmed position goes out again on the next :meth:`next_send`."""
        self._pending.clear()
        self.tx_sent = max(self.tx_fin, min(self.peer_cons, self.tx_high))
        self._flags_sent = self._flags_fin
        self.final_sent = self.final_done
        self._req_sent = False
        self.link_lost = False
        return CdcMessage(
            self.seq_fin,
            self.peer_token,
            Cursor(),
            Cursor(),
            ProducerFlag.FAILOVER_VALIDATION,
        )

    def lost(self, why: str) -> None:
        """No link left (the link group ended): abort without telling the peer."""
        self.abort(why)
        self.link_lost = True

    # ------------------------------------------------------------------ receiving
    def cdc_received(self, msg: CdcMessage) -> AppView | None:
        """A CDC for this connection. Returns the application's new header view, or None when
        the message changes nothing (old sequence number, failover validation that passed).
        Raises :class:`RelayViolation` (after aborting) for impossible cursors or a failed
        validation."""
        if msg.prod_flags & ProducerFlag.FAILOVER_VALIDATION:
            diff = (self.rx_seq - msg.seqno) & 0xFFFF
            if diff >= 0x8000:  # s16 diff < 0: the sender completed a CDC we never saw
                self._violate(
                    f"failover validation: the peer's last completed CDC is #{msg.seqno}, "
                    f"we saw #{self.rx_seq} last (out of sync)"
                )
            return None
        if seqno_before(msg.seqno, self.rx_seq):
            return None
        self.rx_seq = msg.seqno
        if not is_stale(self._peer_prod_cur, msg.prod):
            if msg.prod.count >= self.rx_len:
                self._violate(f"producer cursor {msg.prod} beyond our {self.rx_len}-byte ring")
            d = _advance(self.rx_len, self._peer_prod_cur, msg.prod)
            if d < 0 or self.peer_prod + d > self.app_cons + self.rx_len:
                self._violate(
                    f"producer cursor {msg.prod} overruns our ring (received {self.peer_prod}, "
                    f"consumed {self.app_cons}, ring {self.rx_len})"
                )
            self.peer_prod += d
            self._peer_prod_cur = msg.prod
        if not is_stale(self._peer_cons_cur, msg.cons):
            if msg.cons.count >= self.tx_len:
                self._violate(f"consumer cursor {msg.cons} beyond the {self.tx_len}-byte ring")
            d = _advance(self.tx_len, self._peer_cons_cur, msg.cons)
            if d < 0 or self.peer_cons + d > self.tx_high:
                self._violate(
                    f"consumer cursor {msg.cons} passes what we sent ({self.tx_high} bytes)"
                )
            self.peer_cons += d
            self._peer_cons_cur = msg.cons
        self.peer_pflags = int(msg.prod_flags) & ~ProducerFlag.CONS_CURS_UPD_REQ
        if msg.prod_flags & ProducerFlag.CONS_CURS_UPD_REQ:
            self._upd_req = True
        self.peer_csflags |= int(msg.conn_state_flags)
        return self.app_view()

    def app_view(self) -> AppView:
        csflags = self.peer_csflags
        if self.aborted:
            csflags |= ConnStateFlag.PEER_CONN_ABORT
        return AppView(
            cursor_at(self.peer_prod, self.rx_len),
            cursor_at(self.peer_cons, self.tx_len),
            self.peer_pflags,
            csflags,
        )

    # ------------------------------------------------------------------ life cycle
    @property
    def peer_closed(self) -> bool:
        return bool(self.peer_csflags & _CLOSING)

    @property
    def finished(self) -> bool:
        """Nothing more will happen: the application is gone and both directions are closed
        (or aborted, or no link is left)."""
        if not self.app_gone:
            return False
        if self.link_lost:
            return True
        if self.aborted or self.peer_csflags & ConnStateFlag.PEER_CONN_ABORT:
            return self.final_done  # our abort (or the answer to the peer's) went out
        return self.final_done and self.peer_closed

    @property
    def unsent(self) -> int:
        return self.app_prod - self.tx_sent
