"""The registry model: every change is one event, counts stay consistent, bad writes are refused."""

from __future__ import annotations

import pytest

from smcd_daemon.core.registry import (
    LGR_ID_INCREMENT,
    ChangeKind,
    Connection,
    ConnMode,
    ConnRole,
    LgrRole,
    Link,
    LinkGroup,
    LinkState,
    Registry,
    RegistryError,
    RegistryEvent,
    SmcType,
)
from smcd_daemon.wire.reasons import DeclineReason


@pytest.fixture
def reg() -> tuple[Registry, list[RegistryEvent]]:
    registry = Registry()
    events: list[RegistryEvent] = []
    registry.subscribe(events.append)
    return registry, events


def _lgr(registry: Registry) -> LinkGroup:
    return registry.add_link_group(
        LinkGroup(lgr_id=registry.allocate_lgr_id(), role=LgrRole.SERV, smc_type=SmcType.SMCR)
    )


def test_lgr_ids_step_like_the_kernel_and_skip_ids_in_use() -> None:
    registry = Registry()
    first = registry.allocate_lgr_id()
    assert first % LGR_ID_INCREMENT == 0 and first > 0
    registry.add_link_group(LinkGroup(first + LGR_ID_INCREMENT, LgrRole.CLNT, SmcType.SMCD))
    assert registry.allocate_lgr_id() == first + 2 * LGR_ID_INCREMENT


def test_connection_ids_are_never_reused() -> None:
    registry = Registry()
    ids = [registry.allocate_conn_id() for _ in range(5)]
    assert ids == sorted(set(ids)) and ids[0] >= 1


def test_each_change_is_one_event_with_old_and_new(
    reg: tuple[Registry, list[RegistryEvent]],
) -> None:
    registry, events = reg
    lgr = _lgr(registry)
    registry.add_link(Link(lgr.lgr_id, 1))
    events.clear()

    registry.set_link_state(lgr.lgr_id, 1, LinkState.ACTIVE)
    assert [e.kind for e in events] == [ChangeKind.CHANGED]
    assert events[0].changed_fields() == {"state"}
    assert isinstance(events[0].old, Link) and events[0].old.state is LinkState.LINK_UNUSED

    events.clear()
    registry.set_link_state(lgr.lgr_id, 1, LinkState.ACTIVE)  # no change, no event
    assert events == []


def test_conns_counts_follow_connections(reg: tuple[Registry, list[RegistryEvent]]) -> None:
    registry, _ = reg
    lgr = _lgr(registry)
    registry.add_link(Link(lgr.lgr_id, 1))
    registry.add_link(Link(lgr.lgr_id, 2))
    for _ in range(3):
        cid = registry.allocate_conn_id()
        registry.add_connection(
            Connection(cid, ConnRole.SERVER, ConnMode.SMCR, lgr_id=lgr.lgr_id, link_id=1)
        )
    assert registry.link_group(lgr.lgr_id).conns == 3  # type: ignore[union-attr]
    assert registry.link(lgr.lgr_id, 1).conns == 3  # type: ignore[union-attr]

    # failover: one connection moves to link 2
    moved = registry.connections()[0].conn_id
    registry.update_connection(moved, link_id=2)
    assert registry.link(lgr.lgr_id, 1).conns == 2  # type: ignore[union-attr]
    assert registry.link(lgr.lgr_id, 2).conns == 1  # type: ignore[union-attr]

    registry.remove_connection(moved)
    assert registry.link_group(lgr.lgr_id).conns == 2  # type: ignore[union-attr]
    assert registry.link(lgr.lgr_id, 2).conns == 0  # type: ignore[union-attr]


def test_removing_a_link_group_removes_its_links_first(
    reg: tuple[Registry, list[RegistryEvent]],
) -> None:
    registry, events = reg
    lgr = _lgr(registry)
    registry.add_link(Link(lgr.lgr_id, 1))
    events.clear()
    registry.remove_link_group(lgr.lgr_id)
    assert [(e.kind, type(e.record).__name__) for e in events] == [
        (ChangeKind.REMOVED, "Link"),
        (ChangeKind.REMOVED, "LinkGroup"),
    ]
    assert registry.links() == () and registry.link_groups() == ()


def test_fallback_counted_once_per_reason() -> None:
    registry = Registry()
    cid = registry.allocate_conn_id()
    registry.add_connection(Connection(cid, ConnRole.CLIENT, ConnMode.SMCD))
    registry.fall_back(cid, DeclineReason.PEERNOSMC)
    registry.fall_back(cid, DeclineReason.PEERNOSMC)  # same reason again: not a new fallback
    snap = registry.stats.snapshot()
    assert snap.fallbacks[DeclineReason.PEERNOSMC].client == 1
    assert snap.counters["fallback.client"] == 1
    conn = registry.connection(cid)
    assert conn is not None and conn.mode is ConnMode.TCP and conn.lgr_id is None


def test_stats_reset_bumps_generation_and_keeps_key_set() -> None:
    registry = Registry()
    registry.stats.count_connection(SmcType.SMCD, ConnRole.SERVER, 2)
    registry.stats.add_bytes(SmcType.SMCD, tx=100, rx=7)
    before = registry.stats.snapshot()
    assert before.counters["smcd.server.v2"] == 1 and before.counters["smcd.tx_bytes"] == 100
    registry.stats.reset()
    after = registry.stats.snapshot()
    assert after.generation == before.generation + 1
    assert set(after.counters) == set(before.counters)
    assert all(v == 0 for v in after.counters.values())


@pytest.mark.parametrize(
    "write",
    [
        lambda r, g: r.add_link_group(LinkGroup(g.lgr_id, LgrRole.SERV, SmcType.SMCR)),
        lambda r, g: r.add_link(Link(g.lgr_id, 256)),
        lambda r, g: r.add_link(Link(g.lgr_id + 1, 1)),
        lambda r, g: r.update_link_group(g.lgr_id, conns=5),
        lambda r, g: r.update_link_group(g.lgr_id, no_such_field=1),
        lambda r, g: r.add_connection(Connection(0, ConnRole.CLIENT)),
        lambda r, g: r.add_connection(Connection(9, ConnRole.CLIENT, link_id=1)),
        lambda r, g: r.fall_back(12345, 1),
        lambda r, g: r.stats.count_connection(SmcType.SMCD, ConnRole.CLIENT, 3),
        lambda r, g: r.stats.count_fallback(-1, ConnRole.CLIENT),
    ],
    ids=[
        "duplicate-lgr",
        "link-id-not-u8",
        "link-without-lgr",
        "conns-is-derived",
        "unknown-field",
        "conn-id-zero",
        "link-without-lgr-on-conn",
        "unknown-connection",
        "bad-version",
        "negative-reason",
    ],
)
def test_bad_writes_are_refused_and_change_nothing(write: object) -> None:
    registry = Registry()
    lgr = _lgr(registry)
    events: list[RegistryEvent] = []
    registry.subscribe(events.append)
    before = (registry.link_groups(), registry.links(), registry.connections())
    with pytest.raises(RegistryError):
        write(registry, lgr)  # type: ignore[operator]
    assert (registry.link_groups(), registry.links(), registry.connections()) == before
    assert events == []


def test_a_broken_observer_does_not_stop_the_others() -> None:
    registry = Registry()
    seen: list[RegistryEvent] = []

    def broken(_: RegistryEvent) -> None:
        raise RuntimeError("observer bug")

    registry.subscribe(broken)
    registry.subscribe(seen.append)
    _lgr(registry)
    assert len(seen) == 1
