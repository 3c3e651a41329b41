"""smcctl's D-Bus commands against a real smcd on a private, session-like dbus-daemon.

The daemon is the real ``.venv/bin/smcd`` process (one for the module); smcctl runs in-process
through ``smcd_daemon.cli.main`` so each command costs a D-Bus round trip, not a Python start-up.
The table rendering of connections (none exist before the handoff issue) is checked on records
built by the real registry types and the real D-Bus value mapping.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from smcd_daemon.adapters.dbus.objects import connection_values
from smcd_daemon.adapters.dbus.service import reason_name
from smcd_daemon.cli import main as smcctl_main
from smcd_daemon.cli.bus import mode_text, render_table
from smcd_daemon.core.registry import Connection, ConnMode, ConnRole
from tests.control.daemon_proc import SMCD, NotifySocket, SmcdProcess
from tests.control.dbusd import dbus_daemon

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def bus_address() -> Iterator[str]:
    if shutil.which("dbus-daemon") is None:
        pytest.fail("dbus-daemon is missing: install it with tests/host/install-deps.sh")
    with dbus_daemon("session") as bus:
        yield f"unix:path={bus.socket_path}"


@pytest.fixture(scope="module")
def daemon(bus_address: str) -> Iterator[SmcdProcess]:
    work = Path(tempfile.mkdtemp(prefix="smcd-cli-"))
    notify = NotifySocket(work / "notify")
    argv = [os.fspath(SMCD), "--bus", bus_address, "--runtime-dir", os.fspath(work / "run")]
    proc = SmcdProcess(argv, work / "smcd.log", notify).start()
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()
        notify.close()
        shutil.rmtree(work, ignore_errors=True)


Run = tuple[int, str, str]


@pytest.fixture
def run(
    bus_address: str, daemon: SmcdProcess, capsys: pytest.CaptureFixture[str]
) -> Iterator[object]:
    def go(*args: str) -> Run:
        capsys.readouterr()
        rc = smcctl_main([*args, "--bus", bus_address])
        out, err = capsys.readouterr()
        return rc, out, err

    yield go


def test_info(run) -> None:  # type: ignore[no-untyped-def]
    rc, out, err = run("info")
    assert rc == 0, err
    assert "SMC protocol : 2.1" in out and "SMC-Dv2 loopback-ism" in out
    rc, out, _ = run("info", "--json")
    info = json.loads(out)
    assert info["SmcProtocol"] == "2.1" and info["Pid"] > 0


def test_device_show(run) -> None:  # type: ignore[no-untyped-def]
    rc, out, err = run("device", "show")
    assert rc == 0, err
    header, *rows = out.splitlines()
    assert header.split() == ["Netns", "Name", "Kind", "State", "PNET-ID", "Details"]
    names = {r.split()[2] for r in rows if r.split()[1] == "host"}  # smcd's namespace: "inode host"
    assert {"lo", "loopback-ism"} <= names
    # Aligned: every row starts its Kind column where the header does.
    col = header.index("Kind")
    assert all(r[col - 2 : col] == "  " for r in rows)
    rc, out, _ = run("device", "show", "loopback-ism", "--json")
    (ism,) = json.loads(out)
    assert ism["Kind"] == "ism" and ism["Chid"] == 0xFFFF and len(ism["Gid"]) == 32
    rc, _, err = run("device", "show", "nosuchdev")
    assert rc == 1 and err.count("\n") == 1 and "nosuchdev" in err


def test_pnet_verbs_and_smc_pnet_spelling(run) -> None:  # type: ignore[no-untyped-def]
    assert run("pnet", "flush")[0] == 0
    assert run("pnet", "add", "net1", "-I", "lo")[0] == 0
    assert run("pnet", "-a", "NET2", "-D", "mlx5_0", "-P", "2")[0] == 0
    rc, out, _ = run("pnet", "show")
    assert [line.split() for line in out.splitlines()] == [
        ["PNETID", "Net-Dev", "IB-Dev", "IB-Port"],
        ["NET1", "lo", "n/a", "255"],
        ["NET2", "n/a", "mlx5_0", "2"],
    ]
    rc, out, _ = run("pnet", "-s", "net2", "--json")
    assert json.loads(out) == [{"pnetid": "NET2", "netdev": None, "ibdev": "mlx5_0", "ibport": 2}]
    rc, out, err = run("pnet", "add", "NET1", "-I", "lo")
    assert rc == 1 and "already" in err and err.startswith("smcctl: ") and err.count("\n") == 1
    rc, out, _ = run("pnet", "-d", "NET2", "--json")
    assert json.loads(out) == {"removed": 1}
    rc, _, err = run("pnet", "del", "NET2")
    assert rc == 1 and "not in the PNET table" in err
    rc, out, _ = run("pnet", "-f", "--json")
    assert json.loads(out) == {"removed": 1}
    rc, out, _ = run("pnet")
    assert out == ""


def test_pnet_usage_errors_are_one_line(run) -> None:  # type: ignore[no-untyped-def]
    for args, text in [
        (("pnet", "add", "NET1"), "give a network device"),
        (("pnet", "add", "NET1", "-I", "lo", "-P", "2"), "-P PORT needs -D"),
        (("pnet", "del"), "give the PNETID"),
        (("pnet", "show", "-I", "lo"), "belong to 'add'"),
        (("pnet", "add", "NET1", "-a", "NET2"), "not both"),
        (("pnet", "add", "bad!", "-I", "lo"), "contains '!'"),
    ]:
        rc, _out, err = run(*args)
        assert rc == 1, args
        assert err.startswith("smcctl: ") and err.count("\n") == 1 and text in err, (args, err)


def test_ueid(run) -> None:  # type: ignore[no-untyped-def]
    assert run("ueid", "add", "smc.test-1")[0] == 0
    rc, out, _ = run("ueid", "show")
    assert out.split() == ["SMC.TEST-1"]
    rc, _, err = run("ueid", "add", "no spaces")
    assert rc == 1 and "UEID" in err
    assert run("ueid", "del", "SMC.TEST-1")[0] == 0
    rc, out, _ = run("ueid", "show", "--json")
    assert json.loads(out) == []
    rc, out, _ = run("ueid", "flush", "--json")
    assert json.loads(out) == {"removed": 0}


def test_linkgroup_conns_stats_empty(run) -> None:  # type: ignore[no-untyped-def]
    rc, out, _ = run("linkgroup", "show", "--links")
    assert rc == 0 and out.strip() == "no link groups"
    rc, out, _ = run("linkgroup", "show", "--json")
    assert json.loads(out) == []
    rc, out, _ = run("conns", "-a")
    assert out.split() == ["State", "UID", "Inode", "Local", "Address", "Peer", "Address",
                           "Intf", "Mode"]  # fmt: skip
    rc, out, _ = run("conns", "--json")
    assert json.loads(out) == []
    rc, out, _ = run("stats", "show", "--json")
    stats = json.loads(out)
    assert stats["counters"]["connections.total"] == 0 and stats["fallbacks"] == []
    rc, out, _ = run("stats")
    assert "Total connections handled  0" in out and "no TCP fallbacks" in out
    assert run("stats", "reset")[0] == 0


def test_no_daemon_gives_one_clear_line(
    daemon: SmcdProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    with dbus_daemon("session") as empty:
        address = f"unix:path={empty.socket_path}"
        assert smcctl_main(["info", "--bus", address]) == 1
        err = capsys.readouterr().err
        assert err == f"smcctl: smcd is not running on the bus {address} (org.smcd has no owner)\n"
    assert smcctl_main(["pnet", "show", "--bus", "unix:path=/nonexistent/bus"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("smcctl: smcd is not running on the bus unix:path=/nonexistent/bus")
    assert err.count("\n") == 1


def test_mode_column_as_smcss() -> None:
    fb = Connection(conn_id=1, role=ConnRole.CLIENT, mode=ConnMode.TCP, fallback_reason=0x03030000,
                    peer_diagnosis=0x03010000)  # fmt: skip
    values = connection_values(fb, reason_name)
    assert mode_text(values) == "TCP 0x03030000/0x03010000 (SMC_CLC_DECL_NOSMCDEV)"
    smc = connection_values(
        Connection(conn_id=2, role=ConnRole.SERVER, mode=ConnMode.SMCD), reason_name
    )
    assert mode_text(smc) == "SMCD"
    plain = connection_values(Connection(conn_id=3, role=ConnRole.SERVER), reason_name)
    assert mode_text(plain) == "TCP 0x00000000/0x00000000"


def test_render_table_aligns_columns() -> None:
    text = render_table(("A", "Long header"), [("xxxx", 1), ("y", 22)])
    assert text.splitlines() == ["A     Long header", "xxxx  1", "y     22"]


def test_smcr_ports_names_the_active_ones_or_why_there_are_none() -> None:
    """``smcctl info``'s SMC-R line from the device records as D-Bus gives them (``Ports``:
    port, state, active MTU, netdev, PNETID); the live daemons' answers are checked in
    tests/control (none) and the VM (rxe ports ACTIVE)."""
    from smcd_daemon.cli.devices import smcr_ports

    rxe = {"Kind": "rdma", "Name": "rxe0", "Ports": [(1, "ACTIVE", 1024, "eth0", "")]}
    down = {
        "Kind": "rdma",
        "Name": "mlx5_1",
        "Ports": [(1, "DOWN", 0, "", ""), (2, "INIT", 0, "", "")],
    }
    lo = {"Kind": "netdev", "Name": "lo"}
    assert smcr_ports([lo, rxe, down]) == "rxe0 port 1 ACTIVE"
    assert smcr_ports([lo, down]) == (
        "none ACTIVE (mlx5_1 port 1 DOWN, mlx5_1 port 2 INIT): SMC-R cannot be used now"
    )
    assert smcr_ports([lo]) == "none: no RDMA device here, SMC-R cannot be used (smcctl device)"
