"""PNET entries per network namespace in the control plane (#15): the configuration's
``pnet`` entries (checked as a whole, with the key and the reason), and the system-bus policy
that keeps the per-namespace mutations (``PnetAddNs``, ``PnetRemoveNs``) root-only in a real
dbus-daemon while ``PnetListNs`` stays open to everybody. The namespaces themselves, smcctl and
device selection are in tests/e2e/test_netns_pnet.py."""

from __future__ import annotations

import os
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from smcd_daemon.adapters.dbus import ERROR_ACCESS_DENIED
from smcd_daemon.config import ConfigError, load_config
from tests.control.dbusd import POLICY_FILE, DbusDaemon, Harness, as_nobody, gdbus_call, run
from tests.control.test_dbus_policy import BUS_REJECTION, scenario

MANAGER = "org.smcd.Manager1"
NO_SESSION = {"XDG_RUNTIME_DIR": "/nonexistent-xdg"}


def _load(tmp_path: Path, text: str) -> object:
    f = tmp_path / "smcd.toml"
    f.write_text(text)
    return load_config(f, env=NO_SESSION)


def test_config_entries_name_their_namespace(tmp_path: Path) -> None:
    cfg = _load(
        tmp_path,
        'pnet = [{pnetid = "net1", netdev = "eth1", netns = "c1"},\n'
        '        {pnetid = "NET2", netdev = "eth1", netns = "4026532000"},\n'
        '        {pnetid = "NET3", netdev = "eth1", ibdev = "mlx5_0", ibport = 2}]\n',
    )
    entries = cfg.pnet  # type: ignore[attr-defined]
    assert [(e.pnetid, e.netdev, e.netns) for e in entries] == [
        ("net1", "eth1", "c1"),
        ("NET2", "eth1", "4026532000"),
        ("NET3", "eth1", ""),
    ]


@pytest.mark.parametrize(
    ("text", "why"),
    [
        (
            'pnet = [{pnetid = "A", netdev = "eth1", netns = "c1"},'
            ' {pnetid = "B", netdev = "eth1", netns = "c1"}]',
            "entry 2: Network device 'eth1' in network namespace 'c1' already has PNETID A",
        ),
        (
            'pnet = [{pnetid = "A", netdev = "eth1"}, {pnetid = "A", netdev = "eth1"}]',
            "entry 2: Network device 'eth1' already has PNETID A",
        ),
        ('pnet = [{pnetid = "A", netdev = "eth1", netns = "a/b"}]', "is not an `ip netns` name"),
        ('pnet = [{pnetid = "A", ibdev = "mlx5_0", netns = "c1"}]', "but no network device"),
        ('pnet = [{pnetid = "A", netdev = "eth1", netns = 5}]', "pnet[0].netns"),
    ],
)
def test_config_bad_entries_say_why(tmp_path: Path, text: str, why: str) -> None:
    with pytest.raises(ConfigError) as ei:
        _load(tmp_path, text + "\n")
    assert why in str(ei.value), str(ei.value)


def test_policy_lists_the_namespace_methods() -> None:
    root = ET.parse(POLICY_FILE).getroot()
    default = next(p for p in root.findall("policy") if p.get("context") == "default")
    allowed = {r.get("send_member") for r in default if r.tag == "allow"}
    assert "PnetListNs" in allowed
    assert not allowed & {"PnetAddNs", "PnetRemoveNs"}


def test_namespace_mutations_refused_by_the_bus_for_nobody(system_bus: DbusDaemon) -> None:
    netns = str(os.stat("/proc/self/ns/net").st_ino)  # exists: smcd's own

    async def body(h: Harness) -> None:
        a = h.address
        for method, *args in (
            (f"{MANAGER}.PnetAddNs", "'NET1'", "'lo'", "''", "0", f"'{netns}'"),
            (f"{MANAGER}.PnetRemoveNs", "'NET1'", f"'{netns}'"),
        ):
            out = await run(as_nobody(gdbus_call(a, method, *args)))
            assert out.returncode != 0, (method, out)
            assert ERROR_ACCESS_DENIED in out.stderr and BUS_REJECTION in out.stderr, out
        assert h.pnet.entries() == () and h.changes == []
        out = await run(as_nobody(gdbus_call(a, f"{MANAGER}.PnetListNs")))
        assert out.returncode == 0, out
        # root: through; smcd's own namespace by inode is stored as "" (smcd's own)
        out = await run(gdbus_call(a, f"{MANAGER}.PnetAddNs", "'NET1'", "'lo'", "''", "0",
                                   f"'{netns}'"))  # fmt: skip
        assert out.returncode == 0, out
        assert [(e.netdev, e.netns) for e in h.pnet.entries()] == [("lo", "")]
        out = await run(gdbus_call(a, f"{MANAGER}.PnetAddNs", "'NET2'", "'lo'", "''", "0",
                                   "'no-such-ns-h11'"))  # fmt: skip
        assert out.returncode != 0 and "is unknown" in out.stderr, out
        assert h.changes == ["pnet"]

    scenario(system_bus, body)
