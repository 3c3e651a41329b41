"""The handoff server's admission policy, in-process (no sockets, no loop): per-user caps on
pending and held handoff connections and on handshakes in flight, the fair share of a full pool
(one user's load never locks another out), the overload meter (a late event loop falls back
early), the operator's words of every refusal, and the limits read from the configuration."""

from __future__ import annotations

import pytest

from smcd_daemon.config import parse_config
from smcd_daemon.core.admission import (
    MAX_CONNECTIONS,
    Admission,
    FairPool,
    Limits,
    OverloadMeter,
    Refusal,
    session_limit,
)

ROOT, NOBODY, ALICE = 0, 65534, 1000


def test_pending_connections_are_capped_per_user_and_others_are_not_affected() -> None:
    adm = Admission(Limits(pending_per_user=3))
    assert all(adm.connect(NOBODY) is None for _ in range(3))
    denied = adm.connect(NOBODY)
    assert denied is not None and denied.refusal is Refusal.PENDING and denied.quota
    assert (denied.held, denied.limit) == (3, 3)
    assert "uid 65534 holds 3 handoff connections that sent no request yet" in denied.detail
    assert "limits.pending_per_user allows 3" in denied.detail
    assert adm.pending(NOBODY) == 3 and adm.held(NOBODY) == 3  # the refused one is not counted
    assert adm.connect(ROOT) is None  # another user is admitted
    # a request arrives: no longer pending, still held; the cap has room again
    adm.first_request(NOBODY)
    assert adm.pending(NOBODY) == 2 and adm.held(NOBODY) == 3
    assert adm.connect(NOBODY) is None
    assert adm.refused[Refusal.PENDING] == 1


def test_disconnect_releases_pending_and_held_exactly() -> None:
    adm = Admission(Limits(pending_per_user=2))
    adm.connect(ALICE)
    adm.connect(ALICE)
    adm.first_request(ALICE)
    adm.disconnect(ALICE, pending=True)
    adm.disconnect(ALICE, pending=False)
    assert adm.pending(ALICE) == 0 and adm.held(ALICE) == 0 and adm.connections == 0
    adm.disconnect(ALICE, pending=False)  # a stray release never makes a count negative
    assert adm.connections == 0 and adm.held(ALICE) == 0


def test_held_connections_are_capped_per_user() -> None:
    adm = Admission(Limits(pending_per_user=0, connections_per_user=5))
    for _ in range(5):
        assert adm.connect(ALICE) is None
        adm.first_request(ALICE)
    denied = adm.connect(ALICE)
    assert denied is not None and denied.refusal is Refusal.CONNECTIONS and denied.quota
    assert "uid 1000 holds 5 handoff connections; limits.connections_per_user allows 5" in (
        denied.detail
    )
    assert adm.connect(ROOT) is None


def test_connections_are_shared_fairly_when_the_daemon_is_full() -> None:
    """A flood of one user up to the daemon's capacity: other users still get in."""
    adm = Admission(Limits(pending_per_user=0, connections_per_user=0, connections=100))
    # capacity 50 (half of the total), ceiling 100
    n = 0
    while adm.connect(NOBODY) is None:
        n += 1
    assert n == 50  # alone, it gets the whole capacity, no more
    denied = adm.connect(NOBODY)
    assert denied is not None and denied.refusal is Refusal.FULL and not denied.quota
    assert f"({MAX_CONNECTIONS})" in denied.detail and "fair share among 1 users" in denied.detail
    # root has less than its share (50 // 2 users = 25): admitted, up to that share
    got = 0
    while adm.connect(ROOT) is None:
        got += 1
    assert got == 25
    assert adm.connections == 75 <= adm.conns.ceiling


def test_handshakes_in_flight_are_capped_per_user() -> None:
    adm = Admission(Limits(handshakes_per_user=2, handshakes=100))
    assert adm.begin_handshake(ALICE, 0.0) is None
    assert adm.begin_handshake(ALICE, 0.0) is None
    denied = adm.begin_handshake(ALICE, 0.0)
    assert denied is not None and denied.refusal is Refusal.HANDSHAKES and denied.quota
    assert "holds 2 handshakes in flight; limits.handshakes_per_user allows 2" in denied.detail
    assert adm.inflight == 2
    assert adm.begin_handshake(ROOT, 0.0) is None and adm.inflight == 3
    adm.end_handshake(ALICE)
    assert adm.begin_handshake(ALICE, 0.0) is None


def test_a_parked_client_half_is_not_a_handshake_in_flight() -> None:
    """A client half waiting for its server application's accept() frees its place while it
    waits, and takes it back, unchecked, when it goes on (its server half was admitted)."""
    adm = Admission(Limits(handshakes_per_user=2, handshakes=100))
    for _ in range(5):  # a pool of five connections, all waiting for their accept()
        assert adm.begin_handshake(ALICE, 0.0) is None
        adm.park_handshake(ALICE)
    assert adm.inflight == 0
    assert adm.begin_handshake(ALICE, 0.0) is None  # a server half: admitted
    adm.unpark_handshake(ALICE)  # its client half goes on: over the cap, as admitted pairs may
    assert adm.inflight == 2 and adm.begin_handshake(ALICE, 0.0) is not None
    adm.end_handshake(ALICE)
    adm.end_handshake(ALICE)
    assert adm.inflight == 0


def test_fair_share_of_the_handshake_capacity() -> None:
    """One user fills the capacity; a second user is admitted below its share, the first is
    refused with FAIR_SHARE until the pool drains; a third user still gets in."""
    adm = Admission(Limits(handshakes_per_user=0, handshakes=12))
    for _ in range(12):
        assert adm.begin_handshake(NOBODY, 0.0) is None
    hog = adm.begin_handshake(NOBODY, 0.0)
    assert hog is not None and hog.refusal is Refusal.FAIR_SHARE and not hog.quota
    assert (hog.held, hog.limit, hog.users) == (12, 12, 1)
    assert "limits.handshakes" in hog.detail and "fair share among 1 users is 12" in hog.detail
    for _ in range(6):  # share = 12 // 2
        assert adm.begin_handshake(ROOT, 0.0) is None
    late = adm.begin_handshake(ROOT, 0.0)
    assert late is not None and late.refusal is Refusal.FAIR_SHARE and late.limit == 6
    for _ in range(4):  # share = 12 // 3
        assert adm.begin_handshake(ALICE, 0.0) is None
    assert adm.begin_handshake(ALICE, 0.0) is not None
    assert adm.inflight == 22 <= adm.hands.ceiling
    # the hog's handshakes end: the pool is below capacity again, anyone may start
    for _ in range(12):
        adm.end_handshake(NOBODY)
    assert adm.begin_handshake(NOBODY, 0.0) is None


def test_a_full_pool_never_exceeds_its_ceiling() -> None:
    """Whatever the order of many users, the total stays within twice the capacity."""
    pool = FairPool(10)
    for uid in range(200):
        for _ in range(3):
            if pool.check(uid) is None:
                pool.add(uid)
    assert pool.total <= pool.ceiling == 20
    assert pool.total >= pool.capacity


def test_overload_meter_marks_a_window_after_a_late_tick() -> None:
    meter = OverloadMeter(threshold=1.0, window=1.0)
    meter.sample(10.0, 0.01)
    assert meter.lag(10.0) is None
    meter.sample(11.0, 12.0)  # e.g. the tick after a 12 s SIGSTOP
    assert meter.lag(11.5) == 12.0
    meter.sample(11.6, 0.02)
    assert meter.lag(11.9) == 12.0
    assert meter.lag(12.1) is None  # one window, no more
    assert meter.worst == 12.0
    off = OverloadMeter(threshold=0.0)
    off.sample(1.0, 99.0)
    assert off.lag(1.0) is None


def test_an_overloaded_daemon_starts_no_handshake() -> None:
    adm = Admission(Limits(overload_lag=0.5))
    adm.meter.sample(100.0, 0.8)
    denied = adm.begin_handshake(ROOT, 100.2)
    assert denied is not None and denied.refusal is Refusal.OVERLOADED and not denied.quota
    assert "800 ms late" in denied.detail and "no handshake was started" in denied.detail
    assert adm.inflight == 0
    assert adm.begin_handshake(ROOT, 101.5) is None


def test_first_request_wait() -> None:
    adm = Admission(Limits(first_request_wait=5.0))
    assert not adm.overdue(100.0, 104.9)
    assert adm.overdue(100.0, 105.0)


def test_reconfigure_applies_to_new_admissions() -> None:
    adm = Admission(Limits(pending_per_user=1))
    assert adm.connect(ALICE) is None
    assert adm.connect(ALICE) is not None
    adm.configure(Limits(pending_per_user=2, handshakes=4, handshakes_per_user=1))
    assert adm.connect(ALICE) is None
    assert adm.begin_handshake(ALICE, 0.0) is None
    assert adm.begin_handshake(ALICE, 0.0) is not None
    assert adm.snapshot()["refused_pending"] == 1 and adm.snapshot()["handshakes"] == 1


def test_limits_from_the_configuration() -> None:
    default = Limits.from_config(parse_config({}))
    assert default.pending_per_user == 64 and default.handshakes_per_user == 64
    assert default.handshakes == 256 and default.first_request_wait == 5.0
    assert default.overload_lag == 1.0
    # 0 follows the DMB quota: two halves per DMB and some room
    assert default.connections_per_user == session_limit(2048) == 4160
    cfg = parse_config(
        {"quota": {"connections": 100}, "limits": {"handshakes": 8, "pending_per_user": 0}}
    )
    lim = Limits.from_config(cfg)
    assert lim.connections_per_user == 264 and lim.handshakes == 8 and lim.pending_per_user == 0
    own = Limits.from_config(parse_config({"limits": {"connections_per_user": 10}}))
    assert own.connections_per_user == 10
    assert Limits.from_config(parse_config({"quota": {"connections": 0}})).connections_per_user == 0


@pytest.mark.parametrize(
    ("key", "value"),
    [("handshakes", 0), ("pending_per_user", -1), ("first_request_wait", 0), ("overload_lag", -1)],
)
def test_bad_limits_are_named(key: str, value: object) -> None:
    from smcd_daemon.config import ConfigError

    with pytest.raises(ConfigError) as e:
        parse_config({"limits": {key: value}})
    assert f"limits.{key}" in str(e.value.errors)


def test_a_connection_whose_request_already_waits_is_admitted_past_the_pending_cap() -> None:
    """The pending cap is for connections that sent nothing: one whose request waits unread (a
    burst queued while the daemon was busy) is held, never pending, and never refused for it."""
    adm = Admission(Limits(pending_per_user=2, connections_per_user=4))
    assert adm.connect(ALICE) is None and adm.connect(ALICE) is None
    assert adm.at_pending_cap(ALICE) and not adm.at_pending_cap(ROOT)
    assert adm.connect(ALICE, spoke=True) is None
    assert adm.pending(ALICE) == 2 and adm.held(ALICE) == 3
    assert adm.refused[Refusal.PENDING] == 0
    adm.disconnect(ALICE, pending=False)  # it left after its request: pending stays exact
    assert adm.pending(ALICE) == 2 and adm.held(ALICE) == 2
    assert adm.connect(ALICE, spoke=True) is None and adm.connect(ALICE, spoke=True) is None
    denied = adm.connect(ALICE, spoke=True)  # the held cap still holds
    assert denied is not None and denied.refusal is Refusal.CONNECTIONS
    assert Admission(Limits(pending_per_user=0)).at_pending_cap(ALICE) is False
