"""RESUME verification against the channel ledger, in-process: a genuine resume after a restart
is accepted once; forged ones (unknown or reused ids, another user, another socket, other role
or sizes, a socket that is not connected, SMC-R) are refused; the journal survives a torn last
line, drops and a second restart; compaction keeps exactly the live and claimable records."""

from __future__ import annotations

import pytest

from smcd_daemon.core.channel_ledger import (
    ChannelLedger,
    ChannelRecord,
    Forged,
    ResumeClaim,
    ResumeEvidence,
    parse_journal,
)

ESTABLISHED, LISTEN, CLOSE = 1, 10, 7
UID = 1000
CLIENT = ChannelRecord(7, UID, "client", 65536, 32768, 4242, "192.0.2.1 40000", "192.0.2.2 80")
SERVER = ChannelRecord(8, UID, "server", 32768, 65536, 4343, "192.0.2.2 80", "192.0.2.1 40000")


def claim(rec: ChannelRecord = CLIENT, **kw: object) -> ResumeClaim:
    fields: dict[str, object] = {
        "conn_id": rec.conn_id,
        "role": rec.role,
        "smcd": True,
        "rx_size": rec.rx_size,
        "tx_size": rec.tx_size,
    }
    fields.update(kw)
    return ResumeClaim(**fields)  # type: ignore[arg-type]


def seen(rec: ChannelRecord = CLIENT, **kw: object) -> ResumeEvidence:
    fields: dict[str, object] = {
        "uid": rec.uid,
        "inode": rec.inode,
        "tcp_state": ESTABLISHED,
        "local": rec.local,
        "peer": rec.peer,
    }
    fields.update(kw)
    return ResumeEvidence(**fields)  # type: ignore[arg-type]


def restarted(*records: ChannelRecord, now: float = 0.0) -> ChannelLedger:
    """A daemon that made ``records``, was killed, and a new one that read its journal."""
    old = ChannelLedger()
    journal = b"".join(old.add(r) for r in records)
    new = ChannelLedger()
    assert new.load(journal, now) == 0
    return new


def test_a_genuine_resume_is_accepted_once_under_the_new_id() -> None:
    ledger = restarted(CLIENT, SERVER)
    got = ledger.verify(claim(), seen(), new_id=101)
    assert isinstance(got, ChannelRecord)
    assert got.conn_id == 101 and got.inode == CLIENT.inode and got.uid == UID
    line = ledger.add(got, replaces=CLIENT.conn_id)
    assert line.startswith(b"- 7\n+ 101 1000 client ")
    assert ledger.verify(claim(), seen(), new_id=102) is Forged.RESUMED
    # the same socket under its new id is not resumable twice either
    assert ledger.verify(claim(conn_id=101), seen(), new_id=103) is Forged.RESUMED
    other = ledger.verify(claim(SERVER), seen(SERVER), new_id=104)
    assert isinstance(other, ChannelRecord) and other.role == "server"
    assert ledger.claimable == 0


@pytest.mark.parametrize(
    ("claimed", "evidence", "why"),
    [
        (claim(conn_id=99), seen(), Forged.UNKNOWN),
        (claim(smcd=False), seen(), Forged.NOT_SMCD),
        (claim(), seen(uid=0), Forged.USER),
        (claim(), seen(uid=UID + 1), Forged.USER),
        (claim(), seen(inode=9999), Forged.SOCKET),
        (claim(), seen(peer="192.0.2.3 80"), Forged.SOCKET),
        (claim(role="server"), seen(), Forged.ROLE),
        (claim(rx_size=1 << 20), seen(), Forged.SIZES),
        (claim(tx_size=16384), seen(), Forged.SIZES),
        (claim(), seen(tcp_state=LISTEN), Forged.NOT_CONNECTED),
        (claim(), seen(tcp_state=CLOSE), Forged.NOT_CONNECTED),
    ],
)
def test_forged_resumes_are_refused_and_change_nothing(
    claimed: ResumeClaim, evidence: ResumeEvidence, why: Forged
) -> None:
    ledger = restarted(CLIENT)
    assert ledger.verify(claimed, evidence, new_id=50) is why
    assert ledger.claimable == 1 and not ledger.live
    assert isinstance(ledger.verify(claim(), seen(), new_id=51), ChannelRecord)


def test_nothing_is_resumable_without_a_journal() -> None:
    ledger = ChannelLedger()
    ledger.load(b"", 0.0)
    assert ledger.verify(claim(), seen(), new_id=1) is Forged.UNKNOWN


def test_journal_drops_and_a_torn_last_line() -> None:
    made = ChannelLedger()
    data = made.add(CLIENT) + made.add(SERVER)
    dropped = made.drop(CLIENT.conn_id)
    assert dropped == b"- 7\n" and made.drop(CLIENT.conn_id) is None
    data += dropped + b"+ 9 1000 cli"  # killed in the middle of a write
    live, bad = parse_journal(data)
    assert set(live) == {SERVER.conn_id} and bad == 1
    assert live[SERVER.conn_id] == SERVER  # addresses with their space survive the round trip
    live, bad = parse_journal(b"garbage line\n\xff\xfe\n+ 1 2 client x 5 6 a b\n" + SERVER.line())
    assert set(live) == {SERVER.conn_id} and bad == 3


def test_a_second_restart_verifies_resumed_halves_and_unclaimed_ones() -> None:
    first = restarted(CLIENT, SERVER)
    resumed = first.verify(claim(), seen(), new_id=101)
    assert isinstance(resumed, ChannelRecord)
    journal = first.compacted(1.0)  # resumed client under 101, the unclaimed server under 8
    journal += first.add(resumed, replaces=CLIENT.conn_id)
    second = ChannelLedger()
    second.load(journal, 2.0)
    assert second.verify(claim(), seen(), new_id=200) is Forged.UNKNOWN  # 7 was replaced
    again = second.verify(claim(conn_id=101), seen(), new_id=201)
    assert isinstance(again, ChannelRecord) and again.conn_id == 201
    assert isinstance(second.verify(claim(SERVER), seen(SERVER), new_id=202), ChannelRecord)


def test_unclaimed_records_expire_and_compaction_keeps_the_live_set() -> None:
    ledger = ChannelLedger(unclaimed_ttl=60.0)
    journal = ChannelLedger().add(CLIENT)
    ledger.load(journal, 100.0)
    assert ledger.expire(159.0) == 0 and ledger.claimable == 1
    assert ledger.expire(160.0) == 1 and ledger.claimable == 0
    assert ledger.verify(claim(), seen(), new_id=1) is Forged.UNKNOWN
    for i in range(5000):
        rec = ChannelRecord(1000 + i, UID, "client", 16384, 16384, 10**6 + i, "a 1", "b 2")
        ledger.add(rec)
        ledger.drop(rec.conn_id)
    assert ledger.needs_compaction
    ledger.add(SERVER)
    compact = ledger.compacted(200.0)
    assert compact == SERVER.line() and not ledger.needs_compaction
