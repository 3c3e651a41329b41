"""The SMC-R relay's cursor and CDC rules, pure: two relays joined by a fake wire that carries
their CDC messages (encoded and decoded, as on a QP) and models the RDMA WRITEs as offsets."""

from __future__ import annotations

import pytest

from smcd_daemon.transport.smcr_relay import (
    ConnRelay,
    RelayViolation,
    RingWrite,
    Transmit,
    cursor_at,
    rmbe_update_limit,
)
from smcd_daemon.wire.cdc import CdcMessage, ConnStateFlag, ProducerFlag, decode
from smcd_daemon.wire.cursor import Cursor

L = 16384 - 32  # ring of a 16 KiB buffer


def pair() -> tuple[ConnRelay, ConnRelay]:
    return (
        ConnRelay(peer_token=0xB, rx_len=L, tx_len=L),
        ConnRelay(peer_token=0xA, rx_len=L, tx_len=L),
    )


def wire(tx: Transmit) -> CdcMessage:
    data = tx.cdc.encode()
    assert len(data) == 44
    return decode(data)


def app_sends(r: ConnRelay, total: int, *, consumed: int = 0, pflags: int = 0, cs: int = 0) -> None:
    r.app_update(cursor_at(total, r.tx_len), cursor_at(consumed, r.rx_len), pflags, cs)


def test_data_cdc_maps_cursors_one_to_one_and_splits_nothing_itself() -> None:
    a, b = pair()
    app_sends(a, 1000)
    tx = a.next_send()
    assert tx is not None and tx.write == RingWrite(0, 1000) and tx.upto == 1000
    msg = wire(tx)
    assert msg.seqno == 1 and msg.token == 0xB and msg.prod == Cursor(0, 1000)
    assert a.next_send() is None  # nothing new
    view = b.cdc_received(msg)
    assert view is not None and view.prod == Cursor(0, 1000) and view.cons == Cursor()
    # across the wrap: offset 1000, L bytes at most in flight
    b_cons = 1000
    app_sends(b, 0, consumed=b_cons)
    # b only consumed 1000 < update limit and sender sees plenty free: no update yet
    assert b.next_send() is None
    a.cdc_received(CdcMessage(1, 0xA, Cursor(), Cursor(0, 1000)))
    app_sends(a, 1000 + L)
    tx = a.next_send()
    assert tx is not None and tx.write == RingWrite(1000, L) and tx.cdc.prod == Cursor(1, 1000)


def test_app_cannot_overrun_the_peer_window_or_consume_unreceived_data() -> None:
    a, b = pair()
    with pytest.raises(RelayViolation):
        app_sends(a, L + 1)
    assert a.aborted
    tx = a.next_send()
    assert tx is not None and tx.write is None
    assert tx.cdc.conn_state_flags & ConnStateFlag.PEER_CONN_ABORT
    assert a.app_view().conn_state_flags & ConnStateFlag.PEER_CONN_ABORT
    with pytest.raises(RelayViolation):
        app_sends(b, 0, consumed=1)


def test_peer_cursors_are_bounds_checked_and_old_ones_ignored() -> None:
    _, b = pair()
    with pytest.raises(RelayViolation):
        b.cdc_received(CdcMessage(1, 0xA, Cursor(0, L + 5), Cursor()))
    a2, _ = pair()
    with pytest.raises(RelayViolation):  # consumes what we never sent
        a2.cdc_received(CdcMessage(1, 0xB, Cursor(), Cursor(0, 10)))
    _, b3 = pair()
    assert b3.cdc_received(CdcMessage(5, 0xA, Cursor(0, 100), Cursor())) is not None
    assert b3.cdc_received(CdcMessage(4, 0xA, Cursor(0, 200), Cursor())) is None  # old seqno
    assert b3.peer_prod == 100
    b3.cdc_received(CdcMessage(6, 0xA, Cursor(0, 50), Cursor()))  # stale cursor: kept
    assert b3.peer_prod == 100


def test_consumer_updates_avoid_silly_window_syndrome() -> None:
    a, b = pair()
    limit = rmbe_update_limit(L)
    assert limit == min(L // 10, 2304)
    app_sends(a, L)  # a fills b's ring
    b.cdc_received(wire(a.next_send()))  # type: ignore[arg-type]
    app_sends(b, 0, consumed=limit)  # not more than the limit: no CDC
    assert b.next_send() is None
    app_sends(b, 0, consumed=limit + 1)  # past the limit and the sender sees 0 free
    tx = b.next_send()
    assert tx is not None and tx.write is None and tx.cdc.cons == Cursor(0, limit + 1)
    # a small read while the sender sees lots of room: nothing
    app_sends(b, 0, consumed=limit + 2)
    assert b.next_send() is None
    # ... unless the peer asked (cons_curs_upd_req)
    b.cdc_received(CdcMessage(2, 0xA, Cursor(1, 0), Cursor(), ProducerFlag.CONS_CURS_UPD_REQ))
    tx = b.next_send()
    assert tx is not None and tx.cdc.cons == Cursor(0, limit + 2)
    assert b.next_send() is None


def test_write_blocked_asks_for_the_consumer_cursor_once() -> None:
    a, _ = pair()
    app_sends(a, 100)
    a.next_send()
    app_sends(a, 100, pflags=ProducerFlag.WRITE_BLOCKED)
    tx = a.next_send()
    assert tx is not None
    assert tx.cdc.prod_flags == ProducerFlag.WRITE_BLOCKED | ProducerFlag.CONS_CURS_UPD_REQ
    assert a.next_send() is None  # asked once per blocked episode
    app_sends(a, 100)
    tx = a.next_send()
    assert tx is not None and tx.cdc.prod_flags == 0  # unblocked: flag cleared


def test_close_flags_follow_the_data_and_finish_both_sides() -> None:
    a, b = pair()
    app_sends(a, 10, cs=ConnStateFlag.PEER_DONE_WRITING | ConnStateFlag.PEER_CONN_CLOSED)
    tx = a.next_send()
    assert tx is not None and tx.write == RingWrite(0, 10)
    assert (
        tx.cdc.conn_state_flags == ConnStateFlag.PEER_DONE_WRITING | ConnStateFlag.PEER_CONN_CLOSED
    )
    assert a.next_send() is None  # nothing after the final CDC
    view = b.cdc_received(wire(tx))
    assert view is not None and view.conn_state_flags & ConnStateFlag.PEER_CONN_CLOSED
    a.app_died()  # the hang-up after a clean close is not an abort
    assert not a.aborted and not a.finished  # the final CDC has not completed, b not closed
    a.send_done(tx.cdc.seqno)
    assert not a.finished
    app_sends(b, 0, consumed=10, cs=ConnStateFlag.PEER_CONN_CLOSED)
    txb = b.next_send()
    assert txb is not None
    a.cdc_received(wire(txb))
    assert a.finished
    b.app_died()
    b.send_done(txb.cdc.seqno)
    assert b.finished


def test_application_death_with_data_unread_is_an_abort_for_the_peer() -> None:
    a, b = pair()
    app_sends(a, 10)
    b.cdc_received(wire(a.next_send()))  # type: ignore[arg-type]
    b.app_died()  # b's application never read those 10 bytes
    tx = b.next_send()
    assert tx is not None and tx.cdc.conn_state_flags & ConnStateFlag.PEER_CONN_ABORT
    assert b.abort_reason is not None and "unread" in b.abort_reason
    view = a.cdc_received(wire(tx))
    assert view is not None and view.conn_state_flags & ConnStateFlag.PEER_CONN_ABORT
    # An abort is answered with one, no data (smc_close_passive_abort_received: a kernel that
    # aborted on close waits for it before it frees its socket), and only once.
    app_sends(a, 20)
    answer = a.next_send()
    assert answer is not None and answer.write is None
    assert answer.cdc.conn_state_flags == ConnStateFlag.PEER_CONN_ABORT
    assert a.next_send() is None
    a.app_died()
    assert not a.finished  # until the answer went out
    a.send_done(answer.cdc.seqno)
    assert a.finished
    assert b.cdc_received(wire(answer)) is not None  # the aborted side takes it quietly
    b.send_done(tx.cdc.seqno)
    assert b.finished


def test_application_death_after_reading_everything_is_a_close_after_its_data() -> None:
    """As the kernel's ``smc_close_final`` for an exiting process: nothing unread → closed."""
    a, b = pair()
    app_sends(a, 10)
    b.cdc_received(wire(a.next_send()))  # type: ignore[arg-type]
    app_sends(b, 5, consumed=10)  # b read a's 10 bytes, wrote 5, published both
    b.app_died()
    tx = b.next_send()
    assert tx is not None and tx.write == RingWrite(0, 5), "its last data goes first"
    closed = ConnStateFlag.PEER_DONE_WRITING | ConnStateFlag.PEER_CONN_CLOSED
    assert tx.cdc.conn_state_flags == closed
    assert not b.aborted and not b.finished  # waits for a's close, as after a clean close
    view = a.cdc_received(wire(tx))
    assert view is not None and view.prod == Cursor(0, 5)
    assert view.conn_state_flags & ConnStateFlag.PEER_CONN_CLOSED
    assert not view.conn_state_flags & ConnStateFlag.PEER_CONN_ABORT
    b.send_done(tx.cdc.seqno)
    app_sends(a, 10, consumed=5, cs=ConnStateFlag.PEER_CONN_CLOSED)
    txa = a.next_send()
    assert txa is not None
    b.cdc_received(wire(txa))
    assert b.finished


def test_failover_resends_from_the_last_completed_position_with_validation() -> None:
    a, b = pair()
    app_sends(a, 100)
    t1 = a.next_send()
    app_sends(a, 300)
    t2 = a.next_send()
    assert t1 is not None and t2 is not None
    b.cdc_received(wire(t1))
    a.send_done(t1.cdc.seqno)  # t2 was lost with the link
    val = a.failover()
    assert val.prod_flags == ProducerFlag.FAILOVER_VALIDATION and val.seqno == t1.cdc.seqno
    assert b.cdc_received(decode(val.encode())) is None  # seen #1: in sync
    again = a.next_send()
    assert again is not None and again.write == RingWrite(100, 200) and again.upto == 300
    assert again.cdc.seqno == 3  # sequence numbers go on
    view = b.cdc_received(wire(again))
    assert view is not None and view.prod == Cursor(0, 300) and not b.aborted


def test_failover_validation_ahead_of_what_we_saw_aborts() -> None:
    _, b = pair()
    b.cdc_received(CdcMessage(1, 0xA, Cursor(0, 10), Cursor()))
    with pytest.raises(RelayViolation, match="out of sync"):
        b.cdc_received(CdcMessage(3, 0xA, Cursor(), Cursor(), ProducerFlag.FAILOVER_VALIDATION))
    assert b.aborted


def test_link_group_loss_aborts_without_sending() -> None:
    a, _ = pair()
    app_sends(a, 10)
    a.lost("no link left")
    assert a.next_send() is None
    assert a.app_view().conn_state_flags & ConnStateFlag.PEER_CONN_ABORT
    a.app_died()
    assert a.finished


def test_wrap_counter_rolls_over_u16() -> None:
    a, b = pair()
    pos = 0
    for _ in range(3):
        pos += L
        app_sends(a, pos)
        tx = a.next_send()
        assert tx is not None
        b.cdc_received(wire(tx))
        app_sends(b, 0, consumed=pos)
        txb = b.next_send()
        assert txb is not None
        a.cdc_received(wire(txb))
    assert b.peer_prod == b.app_cons == 3 * L
    assert cursor_at(0x10000 * L + 5, L) == Cursor(0, 5)
