"""The PNET table per network namespace (#15), pure: a netdev entry carries its namespace, a
netdev is unique per namespace, :meth:`PnetTable.view` answers as one namespace sees the
table, RDMA/ISM entries are shared by all, and the stored form keeps the namespace."""

from __future__ import annotations

import pytest

from smcd_daemon.core.pnet import PnetError, PnetExistsError, PnetNotFoundError, PnetTable


def _table() -> PnetTable:
    t = PnetTable()
    t.add("NETH", netdev="eth1")
    t.add("NETX", netdev="eth1", netns="x")
    t.add("NETY", netdev="eth1", netns="4026532001")
    t.add("NETX", ibdev="rxe0", ibport=2)
    return t


def test_equal_ifnames_stay_apart() -> None:
    t = _table()
    assert t.pnetid_of_netdev("eth1") == "NETH"  # smcd's own only
    assert t.view({""}).pnetid_of_netdev("eth1") == "NETH"
    assert t.view({"x", "4026531999"}).pnetid_of_netdev("eth1") == "NETX"
    assert t.view({"4026532001"}).pnetid_of_netdev("eth1") == "NETY"
    assert t.view({"z"}).pnetid_of_netdev("eth1") is None
    for keys in ({""}, {"x"}, {"z"}):  # RDMA devices: every namespace sees them
        assert t.view(keys).pnetid_of_ibport("rxe0", 2) == "NETX"
    assert t.namespaces() == ("x", "4026532001")


def test_duplicates_and_bad_namespaces() -> None:
    t = _table()
    with pytest.raises(PnetExistsError, match="in network namespace 'x' already has PNETID NETX"):
        t.add("NETZ", netdev="eth1", netns="x")
    with pytest.raises(PnetExistsError, match="already has PNETID NETX"):
        t.add("NETX", netdev="eth1", netns="x")
    with pytest.raises(PnetError, match="but no network device"):
        t.add("NETZ", ibdev="rxe1", netns="x")
    for bad in ("a/b", ".", "..", "a b", "x" * 256, "0"):
        with pytest.raises(PnetError):
            t.add("NETZ", netdev="eth9", netns=bad)
    with pytest.raises(PnetError, match="is not a string"):
        t.add("NETZ", netdev="eth9", netns=5)  # type: ignore[arg-type]
    assert t.add("NETZ", netdev="eth1", netns="007")[0].netns == "7"  # inode digits canonical
    assert len(t) == 5


def test_remove_per_namespace() -> None:
    t = _table()
    with pytest.raises(PnetNotFoundError, match="of network namespace 'z'"):
        t.remove("NETX", "z")
    assert t.remove("NETX", "x") == 1  # X's netdev; the shared RDMA entry stays
    assert [e.pnetid for e in t] == ["NETH", "NETY", "NETX"]
    assert t.remove("NETX", "") == 1  # smcd's own namespace's table holds the RDMA entries
    t.add("NETY", netdev="eth2")
    assert t.remove("NETY") == 2  # no namespace: every namespace
    assert [e.pnetid for e in t] == ["NETH"]


def test_stored_form_keeps_the_namespace() -> None:
    t = _table()
    d = t.to_dict()
    assert d["entries"][0] == {"pnetid": "NETH", "netdev": "eth1", "ibdev": None, "ibport": None}
    assert d["entries"][1]["netns"] == "x"
    assert PnetTable.from_dict(d) == t
    bad = {"format": 1, "entries": [{"pnetid": "A", "ibdev": "rxe0", "ibport": 1, "netns": "x"}]}
    with pytest.raises(PnetError, match="but no network device"):
        PnetTable.from_dict(bad)
