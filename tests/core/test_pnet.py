"""The PNET table follows the kernel's smc_pnet rules (PROTOCOL.md §3, net/smc/smc_pnet.c)."""

from __future__ import annotations

import errno
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from smcd_daemon.core.pnet import (
    PnetEntry,
    PnetError,
    PnetExistsError,
    PnetNotFoundError,
    PnetTable,
    normalize_pnetid,
)
from smcd_daemon.errors import SmcError


def assert_one_sentence(exc: BaseException, *needles: str) -> None:
    """Errors are one clear sentence naming the value and the rule."""
    msg = str(exc)
    assert "\n" not in msg
    assert msg.endswith(".")
    assert msg[0].isupper()
    for n in needles:
        assert n in msg, (n, msg)


# -- PNETID -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "canonical"),
    [
        ("NET1", "NET1"),
        ("net1", "NET1"),
        ("  NeT1  ", "NET1"),
        ("\tabc\n", "ABC"),
        ("A", "A"),
        ("0123456789ABCDEF", "0123456789ABCDEF"),
        ("  0123456789abcdef ", "0123456789ABCDEF"),  # 16 after stripping blanks
    ],
)
def test_pnetid_normalised_like_smc_pnetid_valid(raw: str, canonical: str) -> None:
    assert normalize_pnetid(raw) == canonical


@pytest.mark.parametrize(
    ("raw", "rule"),
    [
        ("", "empty"),
        ("   ", "empty"),
        ("0123456789ABCDEFG", "at most 16"),
        ("NET 1", "no interior blanks"),
        ("NET_1", "letters A-Z"),
        ("NET-1", "letters A-Z"),
        ("NÉT1", "letters A-Z"),  # isalnum() in the C locale: ASCII only
        ("NET1\0", "letters A-Z"),
    ],
)
def test_pnetid_rejected(raw: str, rule: str) -> None:
    with pytest.raises(PnetError) as ei:
        normalize_pnetid(raw)
    assert ei.value.errno == errno.EINVAL
    assert ei.value.value == raw
    assert_one_sentence(ei.value, repr(raw), rule)


def test_pnetid_not_a_string() -> None:
    with pytest.raises(PnetError) as ei:
        normalize_pnetid(42)
    assert_one_sentence(ei.value, "42", "1 to 16")


@given(
    st.text(
        alphabet="abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789",
        min_size=1,
        max_size=16,
    )
)
def test_pnetid_valid_alphabet_round_trips(s: str) -> None:
    n = normalize_pnetid(s)
    assert n == s.upper()
    assert normalize_pnetid(n) == n


@given(st.text(max_size=24))
def test_pnetid_any_text_is_canonical_or_refused(s: str) -> None:
    try:
        n = normalize_pnetid(s)
    except PnetError as exc:
        assert isinstance(exc, SmcError)
        return
    assert 1 <= len(n) <= 16
    assert n.isascii() and n.isalnum() and n == n.upper()


# -- device names and ports -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "rule"),
    [
        ("", "1 to 15 bytes"),
        ("a" * 16, "at most 15 bytes"),
        ("ééééééééé", "at most 15 bytes"),  # 9 characters but 18 bytes
        (".", "reserved"),
        ("..", "reserved"),
        ("eth/0", "'/'"),
        ("eth:0", "':'"),
        ("eth 0", "blanks"),
        (" eth0", "blanks"),  # netdev names are not stripped by the kernel
        ("eth\t0", "blanks"),
        ("eth\x000", "NUL"),
    ],
)
def test_netdev_name_rules(name: str, rule: str) -> None:
    t = PnetTable()
    with pytest.raises(PnetError) as ei:
        t.add("NET1", netdev=name)
    assert ei.value.errno == errno.EINVAL
    assert_one_sentence(ei.value, repr(name), rule)
    assert t.entries() == ()


@pytest.mark.parametrize("name", ["a" * 15, "eth0", "veth-a.100", "ens1f0np0", "lo", "br_0@x"])
def test_netdev_name_accepted(name: str) -> None:
    t = PnetTable()
    (e,) = t.add("net1", netdev=name)
    assert e == PnetEntry("NET1", name, None, None)


@pytest.mark.parametrize(
    ("name", "rule"),
    [
        ("", "empty"),
        ("  ", "empty"),
        ("m" * 64, "at most 63 bytes"),
        ("mlx5/0", "'/'"),
        ("mlx5 0", "blanks"),
        ("mlx5\x01", "control"),
    ],
)
def test_ibdev_name_rules(name: str, rule: str) -> None:
    t = PnetTable()
    with pytest.raises(PnetError) as ei:
        t.add("NET1", ibdev=name)
    assert_one_sentence(ei.value, repr(name), rule)
    assert len(t) == 0


def test_ibdev_name_stripped_and_pci_names_allowed() -> None:
    t = PnetTable()
    (e,) = t.add("NET1", ibdev="  mlx5_0 ", ibport=2)
    assert e == PnetEntry("NET1", None, "mlx5_0", 2)
    (ism,) = t.add("NET1", ibdev="0000:00:00.0")  # ISM devices are named by PCI address
    assert ism.ibport == 1
    (big,) = t.add("NET2", ibdev="m" * 63)
    assert big.ibdev == "m" * 63


@pytest.mark.parametrize("port", [0, 3, -1, 255])
def test_ibport_out_of_range(port: int) -> None:
    with pytest.raises(PnetError) as ei:
        PnetTable().add("NET1", ibdev="mlx5_0", ibport=port)
    assert_one_sentence(ei.value, f"port {port}", "1 or 2")


@pytest.mark.parametrize("port", [True, "1", 1.0, None])
def test_ibport_not_an_integer(port: object) -> None:
    with pytest.raises(PnetError) as ei:
        PnetTable().add("NET1", ibdev="mlx5_0", ibport=port)  # type: ignore[arg-type]
    assert_one_sentence(ei.value, repr(port), "not an integer")


def test_port_without_ibdev_refused() -> None:
    with pytest.raises(PnetError) as ei:
        PnetTable().add("NET1", netdev="eth0", ibport=2)
    assert_one_sentence(ei.value, "port 2", "without an RDMA/ISM device")


def test_entry_needs_a_device() -> None:
    with pytest.raises(PnetError) as ei:
        PnetTable().add("net1")
    assert_one_sentence(ei.value, "NET1", "names no device")


def test_invalid_pnetid_checked_before_devices() -> None:
    t = PnetTable()
    with pytest.raises(PnetError, match="PNETID 'bad id'"):
        t.add("bad id", netdev="eth0")
    assert len(t) == 0


# -- one PNETID per device, duplicates ---------------------------------------------------------


def test_same_device_other_pnetid_refused() -> None:
    t = PnetTable()
    t.add("NET1", netdev="eth0")
    with pytest.raises(PnetExistsError) as ei:
        t.add("NET2", netdev="eth0")
    assert ei.value.errno == errno.EEXIST
    assert_one_sentence(ei.value, "'eth0'", "NET1", "only one PNETID")
    assert t.entries() == (PnetEntry("NET1", "eth0", None, None),)


def test_same_device_same_pnetid_is_eexist_like_the_kernel() -> None:
    # smc_pnet_add_eth/add_ib answer -EEXIST whenever the device is already in the table.
    t = PnetTable()
    t.add("NET1", netdev="eth0")
    with pytest.raises(PnetExistsError) as ei:
        t.add("net1", netdev="eth0")
    assert_one_sentence(ei.value, "'eth0'", "already has PNETID NET1", "only once")
    t.add("NET1", ibdev="mlx5_0")
    with pytest.raises(PnetExistsError):
        t.add("NET1", ibdev=" mlx5_0")
    assert len(t) == 2


def test_rdma_ports_are_separate_devices() -> None:
    t = PnetTable()
    t.add("NET1", ibdev="mlx5_0", ibport=1)
    t.add("NET2", ibdev="mlx5_0", ibport=2)
    with pytest.raises(PnetExistsError, match="'mlx5_0' port 2 already has PNETID NET2"):
        t.add("NET1", ibdev="mlx5_0", ibport=2)
    assert t.pnetid_of_ibport("mlx5_0", 1) == "NET1"
    assert t.pnetid_of_ibport("mlx5_0", 2) == "NET2"


def test_netdev_and_ibdev_names_do_not_collide() -> None:
    # "eth0" as a netdev and as an RDMA device name are different table keys (type differs).
    t = PnetTable()
    t.add("NET1", netdev="eth0")
    (e,) = t.add("NET2", ibdev="eth0")
    assert e.ibdev == "eth0"


def test_add_both_like_smc_pnet_a_I_D() -> None:
    t = PnetTable()
    added = t.add("net1", netdev="eth0", ibdev="mlx5_0", ibport=2)
    assert added == (
        PnetEntry("NET1", "eth0", None, None),
        PnetEntry("NET1", None, "mlx5_0", 2),
    )
    assert t.entries() == added


def test_add_both_with_one_repeat_adds_the_new_half() -> None:
    t = PnetTable()
    t.add("NET1", netdev="eth0")
    added = t.add("NET1", netdev="eth0", ibdev="mlx5_0")
    assert added == (PnetEntry("NET1", None, "mlx5_0", 1),)
    assert len(t) == 2


def test_add_both_with_both_repeats_refused() -> None:
    t = PnetTable()
    t.add("NET1", netdev="eth0", ibdev="mlx5_0")
    with pytest.raises(PnetExistsError) as ei:
        t.add("NET1", netdev="eth0", ibdev="mlx5_0")
    assert_one_sentence(ei.value, "'eth0'", "'mlx5_0'", "have PNETID NET1")


def test_add_both_with_conflict_changes_nothing() -> None:
    t = PnetTable()
    t.add("NET1", ibdev="mlx5_0")
    with pytest.raises(PnetExistsError, match="mlx5_0"):
        t.add("NET2", netdev="eth0", ibdev="mlx5_0")
    assert t.pnetid_of_netdev("eth0") is None
    assert len(t) == 1


def test_invalid_second_half_changes_nothing() -> None:
    t = PnetTable()
    with pytest.raises(PnetError):
        t.add("NET1", netdev="eth0", ibdev="mlx5_0", ibport=3)
    assert len(t) == 0


# -- lookups, remove, flush --------------------------------------------------------------------


def test_lookups() -> None:
    t = PnetTable()
    t.add("NET1", netdev="eth0", ibdev="mlx5_0")
    t.add("NET2", netdev="eth1")
    t.add("NET2", ibdev="ism0")
    assert t.pnetid_of_netdev("eth0") == "NET1"
    assert t.pnetid_of_netdev("eth1") == "NET2"
    assert t.pnetid_of_netdev("eth2") is None
    assert t.pnetid_of_netdev("mlx5_0") is None  # an RDMA entry is not a netdev entry
    assert t.pnetid_of_ibport("mlx5_0", 1) == "NET1"
    assert t.pnetid_of_ibport("mlx5_0", 2) is None
    assert t.pnetid_of_ibport("eth0", 1) is None
    assert t.pnetid_of_device("ism0") == "NET2"
    assert t.pnetids() == ("NET1", "NET2")
    assert [e.describe() for e in t.entries_for("net2")] == [
        "network device 'eth1'",
        "RDMA/ISM device 'ism0' port 1",
    ]


def test_entries_keep_insertion_order() -> None:
    t = PnetTable()
    for i, name in enumerate(["c", "a", "b"]):
        t.add(f"N{i}", netdev=name)
    assert [e.netdev for e in t.entries()] == ["c", "a", "b"]
    assert list(t) == list(t.entries())


def test_remove_by_pnetid_removes_all_its_entries() -> None:
    t = PnetTable()
    t.add("NET1", netdev="eth0", ibdev="mlx5_0")
    t.add("NET2", netdev="eth1")
    t.add("NET1", ibdev="mlx5_1", ibport=2)
    assert t.remove(" net1 ") == 3
    assert t.entries() == (PnetEntry("NET2", "eth1", None, None),)
    # the device is free again, for any PNETID
    t.add("NET3", netdev="eth0")
    assert t.pnetid_of_netdev("eth0") == "NET3"


def test_remove_unknown_pnetid_is_enoent() -> None:
    t = PnetTable()
    t.add("NET1", netdev="eth0")
    with pytest.raises(PnetNotFoundError) as ei:
        t.remove("net9")
    assert ei.value.errno == errno.ENOENT
    assert_one_sentence(ei.value, "NET9", "not in the PNET table")
    assert len(t) == 1


def test_remove_invalid_pnetid_is_einval() -> None:
    with pytest.raises(PnetError) as ei:
        PnetTable().remove("NET_1")
    assert ei.value.errno == errno.EINVAL


def test_flush() -> None:
    t = PnetTable()
    assert t.flush() == 0
    t.add("NET1", netdev="eth0", ibdev="mlx5_0")
    t.add("NET2", netdev="eth1")
    assert t.flush() == 3
    assert t.entries() == ()
    t.add("NET2", netdev="eth0")  # nothing left behind
    assert len(t) == 1


def test_entries_are_frozen() -> None:
    (e,) = PnetTable().add("NET1", netdev="eth0")
    with pytest.raises(AttributeError):
        e.pnetid = "NET2"  # type: ignore[misc]


# -- persistence -------------------------------------------------------------------------------


def sample_table() -> PnetTable:
    t = PnetTable()
    t.add("net1", netdev="eth0", ibdev="mlx5_0", ibport=2)
    t.add("NET2", netdev="veth-b")
    t.add("NET2", ibdev="0000:00:00.0")
    return t


def test_round_trip_through_json() -> None:
    t = sample_table()
    d = json.loads(json.dumps(t.to_dict()))
    back = PnetTable.from_dict(d)
    assert back == t
    assert back.entries() == t.entries()
    assert d["entries"][1] == {"pnetid": "NET1", "netdev": None, "ibdev": "mlx5_0", "ibport": 2}


def test_round_trip_empty() -> None:
    assert PnetTable.from_dict(PnetTable().to_dict()) == PnetTable()
    assert PnetTable.from_dict({}) == PnetTable()


def test_constructor_from_entries() -> None:
    t = sample_table()
    assert PnetTable(t.entries()) == t


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        ([], "not an object"),
        ({"format": 2, "entries": []}, "format 2"),
        ({"entries": {}}, "not a list"),
        ({"entries": ["eth0"]}, "not an object"),
        ({"entries": [{"pnetid": "N", "netdev": "e", "extra": 1}]}, "unknown keys"),
        ({"entries": [{"pnetid": "N"}]}, "names no devices"),
        ({"entries": [{"pnetid": "N", "netdev": "e", "ibdev": "m"}]}, "names two devices"),
        ({"entries": [{"pnetid": "N", "netdev": "e", "ibport": 1}]}, "gives a port"),
        ({"entries": [{"pnetid": "N_1", "netdev": "e"}]}, "'N_1'"),
        ({"entries": [{"pnetid": "N", "ibdev": "m", "ibport": 7}]}, "port 7"),
        (
            {"entries": [{"pnetid": "A", "netdev": "e"}, {"pnetid": "B", "netdev": "e"}]},
            "only one PNETID",
        ),
    ],
)
def test_from_dict_rechecks_every_rule(data: object, needle: str) -> None:
    with pytest.raises(PnetError) as ei:
        PnetTable.from_dict(data)  # type: ignore[arg-type]
    assert_one_sentence(ei.value, needle)


@given(st.text(max_size=70), st.text(max_size=70), st.integers(-3, 300))
def test_any_input_is_added_or_refused_with_pnet_error(netdev: str, ibdev: str, port: int) -> None:
    t = PnetTable()
    try:
        added = t.add("NET1", netdev=netdev, ibdev=ibdev, ibport=port)
    except PnetError:
        assert len(t) == 0
        return
    assert added == t.entries() and len(added) == 2
    assert PnetTable.from_dict(json.loads(json.dumps(t.to_dict()))) == t
