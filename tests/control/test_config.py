"""The configuration model, the shipped smcd.toml and the operator-facing error messages."""

from __future__ import annotations

import io
import re
import tempfile
import tomllib
from ipaddress import ip_network
from pathlib import Path

import pydantic
import pytest

from smcd_daemon.config import (
    RELOADABLE,
    SYSTEM_PATHS,
    Config,
    ConfigError,
    check_config,
    diff_for_reload,
    load_config,
    parse_config,
)
from smcd_daemon.core.buffers import DmbLimitError, DmbPool
from smcd_daemon.errors import SmcError

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "config" / "smcd.toml"
NO_SESSION = {"XDG_RUNTIME_DIR": "/nonexistent-xdg"}


def _load_text(tmp_path: Path, text: str, env: dict[str, str] | None = None) -> Config:
    f = tmp_path / "smcd.toml"
    f.write_text(text)
    return load_config(f, env=NO_SESSION if env is None else env)


def _errors(tmp_path: Path, text: str) -> list[str]:
    with pytest.raises(ConfigError) as ei:
        _load_text(tmp_path, text)
    prefix = f"{tmp_path / 'smcd.toml'}: "
    out = []
    for e in ei.value.errors:
        assert str(e).startswith(prefix)
        out.append(str(e)[len(prefix) :])
    return out


# ----------------------------------------------------------------------------- defaults


def test_embedded_default_is_unprivileged_under_xdg_runtime_dir(tmp_path: Path) -> None:
    cfg = load_config(None, env={"XDG_RUNTIME_DIR": str(tmp_path)})
    assert cfg.runtime_dir == tmp_path / "smcd"
    assert cfg.handoff_socket == tmp_path / "smcd" / "handoff.sock"
    assert cfg.state_dir == tmp_path / "smcd" / "state"
    assert cfg.dbus.bus == "private"  # no session bus in this environment
    (tmp_path / "bus").touch()  # a user session bus socket appears
    assert load_config(None, env={"XDG_RUNTIME_DIR": str(tmp_path)}).dbus.bus == "session"
    env = {"XDG_RUNTIME_DIR": str(tmp_path), "DBUS_SESSION_BUS_ADDRESS": "unix:path=/x"}
    assert load_config(None, env=env).dbus.bus == "session"


def test_embedded_default_without_xdg_uses_a_per_user_temp_dir() -> None:
    import os

    cfg = load_config(None, env={})
    assert cfg.runtime_dir == Path(tempfile.gettempdir()) / f"smcd-{os.getuid()}"
    assert cfg.handoff_socket.parent == cfg.runtime_dir
    assert not str(cfg.runtime_dir).startswith("/run/smcd")


def test_shipped_file_equals_embedded_defaults_except_system_paths() -> None:
    shipped = load_config(SHIPPED, env=NO_SESSION).flat()
    embedded = load_config(None, env=NO_SESSION).flat()
    assert shipped.keys() == embedded.keys()
    differing = {k for k in shipped if shipped[k] != embedded[k]}
    assert differing == set(SYSTEM_PATHS)
    for key, value in SYSTEM_PATHS.items():
        assert shipped[key] == value
    # The system paths are the ones systemd creates for the unit.
    assert shipped["runtime_dir"] == Path("/run/smcd")
    assert shipped["state_dir"] == Path("/var/lib/smcd")
    assert shipped["dbus.bus"] == "system"


def test_shipped_file_documents_every_key() -> None:
    doc = tomllib.loads(SHIPPED.read_text())

    def flat(d: dict[str, object], prefix: str = "") -> set[str]:
        keys: set[str] = set()
        for k, v in d.items():
            keys |= flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {prefix + k}  # type: ignore[arg-type]
        return keys

    assert flat(doc) == set(load_config(None).flat())
    # every assignment is preceded by a comment line that explains it
    lines = SHIPPED.read_text().splitlines()
    for i, line in enumerate(lines):
        if re.match(r"^[a-z_]+\s*=", line):
            assert lines[i - 1].startswith("#"), f"line {i + 1} ({line!r}) has no comment"


def test_check_config_ok_on_shipped_file() -> None:
    out, err = io.StringIO(), io.StringIO()
    assert check_config(SHIPPED, out=out, err=err) == 0
    assert out.getvalue() == f"{SHIPPED}: OK\n"
    assert err.getvalue() == ""


def test_config_is_frozen() -> None:
    cfg = load_config(None)
    with pytest.raises(pydantic.ValidationError):
        cfg.log_level = "debug"  # type: ignore[misc]
    with pytest.raises(pydantic.ValidationError):
        cfg.quota.connections = 1  # type: ignore[misc]


# ----------------------------------------------------------------------------- values


def test_sizes_accept_integers_and_suffixes(tmp_path: Path) -> None:
    cfg = _load_text(
        tmp_path,
        """
        [buffers]
        min_dmb_size = 32768
        max_dmb_size = "1M"
        max_rmb_size = "512MiB"
        default_size = "64k"
        pool_max_bytes = "2G"
        [quota]
        buffer_bytes = 0
        """,
    )
    b = cfg.buffers
    assert (b.min_dmb_size, b.max_dmb_size, b.max_rmb_size) == (32768, 1 << 20, 512 << 20)
    assert (b.default_size, b.pool_max_bytes) == (65536, 2 << 30)
    assert cfg.quota.buffer_bytes == 0


def test_ueids_are_folded_to_upper_case(tmp_path: Path) -> None:
    cfg = _load_text(tmp_path, '[eid]\nueids = ["smc-lab.1", "B2"]\n')
    assert cfg.eid.ueids == ("SMC-LAB.1", "B2")


def test_peers_and_addresses(tmp_path: Path) -> None:
    cfg = _load_text(
        tmp_path,
        'peers = ["192.0.2.0/24", "198.51.100.7", "2001:db8::/32"]\n'
        '[dbus]\nbus = "unix:path=/run/x/bus;unix:abstract=smcd,guid=0123"\n',
    )
    assert cfg.peers == (
        ip_network("192.0.2.0/24"),
        ip_network("198.51.100.7/32"),
        ip_network("2001:db8::/32"),
    )
    assert cfg.dbus.bus == "unix:path=/run/x/bus;unix:abstract=smcd,guid=0123"
    assert cfg.model_dump(mode="json")["peers"] == [
        "192.0.2.0/24",
        "198.51.100.7/32",
        "2001:db8::/32",
    ]


def test_log_level_is_case_insensitive(tmp_path: Path) -> None:
    assert _load_text(tmp_path, 'log_level = "DEBUG"\n').log_level == "debug"


# ----------------------------------------------------------------------------- errors

SIZE = "(bytes; suffixes K/M/G allowed)"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "[quota]\nbuffer_bytes = -1\n",
            f"quota.buffer_bytes = -1: must be an integer ≥ 0 {SIZE}; 0 = no limit",
        ),
        (
            '[quota]\nbuffer_bytes = "lots"\n',
            f'quota.buffer_bytes = "lots": must be an integer ≥ 0 {SIZE}; 0 = no limit',
        ),
        (
            "[quota]\nconnections = true\n",
            "quota.connections = true: must be an integer ≥ 0; 0 = no limit",
        ),
        (
            "x = 1\n",
            "x = 1: unknown key 'x'; known keys: runtime_dir, handoff_socket, state_dir, "
            "log_level, peers, peer_detection, pnet, dbus, eid, buffers, quota, limits, timeouts, "
            "modes, smcr, namespaces",
        ),
        (
            "[timeouts]\nclc = 3\n",
            "timeouts.clc = 3: unknown key 'clc'; known keys: clc_wait, proposal_wait, "
            "local_client_wait, first_llc, llc, test_link, linger, stop_grace",
        ),
        (
            '[buffers]\nmax_dmb_size = "2M"\n',
            'buffers.max_dmb_size = "2M": must be 16K << n for n = 0…6 (16K, 32K, 64K, … 1M) '
            f"{SIZE}",
        ),
        (
            "[buffers]\nmin_rmb_size = 20000\n",
            "buffers.min_rmb_size = 20000: must be 16K << n for n = 0…15 "
            f"(16K, 32K, 64K, … 512M) {SIZE}",
        ),
        (
            '[buffers]\nmin_dmb_size = "64K"\nmax_dmb_size = "32K"\n',
            "buffers.max_dmb_size = 32768: must be ≥ buffers.min_dmb_size (64K)",
        ),
        (
            '[buffers]\ndefault_size = "1M"\n',
            "buffers.default_size = 1048576: must lie within the RMB size range (16K…512K)",
        ),
        (
            '[buffers]\ndefault_dmb_size = "1M"\nmax_dmb_size = "512K"\n',
            "buffers.default_dmb_size = 1048576: must lie within the DMB size range (16K…512K)",
        ),
        (
            '[buffers]\ndefault_dmb_size = "2M"\n',
            'buffers.default_dmb_size = "2M": must be 16K << n and lie within the DMB size '
            f"range {SIZE}",
        ),
        (
            "[timeouts]\nllc = 0\n",
            "timeouts.llc = 0.0: must be a number of seconds, 0 < seconds ≤ 3600",
        ),
        (
            '[timeouts]\nlinger = "2s"\n',
            'timeouts.linger = "2s": must be a number of seconds, 0 ≤ seconds ≤ 3600',
        ),
        ('[modes]\nsmcr_v2 = "yes"\n', 'modes.smcr_v2 = "yes": must be true or false'),
        (
            'log_level = "loud"\n',
            'log_level = "loud": must be one of "debug", "info", "warning", "error", "critical"',
        ),
        ('runtime_dir = "run/smcd"\n', 'runtime_dir = "run/smcd": must be an absolute path'),
        (
            f'handoff_socket = "/{"s" * 120}"\n',
            f'handoff_socket = "/{"s" * 120}": must be an absolute path of at most 107 bytes '
            "(AF_UNIX limit)",
        ),
        (
            '[dbus]\nbus = "systemd"\n',
            'dbus.bus = "systemd": must be "system", "session", "private" or a D-Bus address '
            'such as "unix:path=/run/dbus/system_bus_socket"',
        ),
        ('dbus = "system"\n', 'dbus = "system": must be a table ([section] or {…})'),
        (
            'peers = ["192.0.2.1/24"]\n',
            'peers[0] = "192.0.2.1/24": must be a list of IPv4/IPv6 networks such as '
            '"192.0.2.0/24" or "2001:db8::/32" (no host bits set) (192.0.2.1/24 has host bits set)',
        ),
    ],
)
def test_error_names_key_value_and_what_is_allowed(tmp_path: Path, text: str, message: str) -> None:
    assert _errors(tmp_path, text) == [message]


@pytest.mark.parametrize(
    ("ueids", "key", "value", "why"),
    [
        ('["", "A"]', "eid.ueids[0]", "", "empty"),
        ('["A", "b!"]', "eid.ueids[1]", "b!", "'!'"),
        ('[".A"]', "eid.ueids[0]", ".A", "first character"),
        ('["A..B"]', "eid.ueids[0]", "A..B", "'..'"),
        (f'["{"A" * 33}"]', "eid.ueids[0]", "A" * 33, "33 characters"),
        ('["a", "A"]', "eid.ueids", ["a", "A"], "duplicates"),
        (str([f"U{i}" for i in range(9)]).replace("'", '"'), "eid.ueids", None, "9 UEIDs"),
    ],
)
def test_ueid_syntax(tmp_path: Path, ueids: str, key: str, value: object, why: str) -> None:
    with pytest.raises(ConfigError) as ei:
        _load_text(tmp_path, f"[eid]\nueids = {ueids}\n")
    e = ei.value
    assert len(e.errors) == 1
    assert e.key == key
    if value is not None:
        assert e.value == value or list(e.value) == value
    assert e.allowed.startswith("must be a list of at most 8 distinct UEIDs, each 1 to 32")
    assert why in e.allowed


def test_all_errors_are_reported_with_attributes(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as ei:
        _load_text(tmp_path, "nope = 1\n[quota]\nconnections = -5\n[modes]\nsmcr_v1 = 1\n")
    e = ei.value
    assert isinstance(e, SmcError)
    got = {(x.key, x.value) for x in e.errors}
    assert got == {("nope", 1), ("quota.connections", -5), ("modes.smcr_v1", 1)}
    (conn,) = [x for x in e.errors if x.key == "quota.connections"]
    assert conn.allowed == "must be an integer ≥ 0; 0 = no limit"


def test_check_config_lists_every_error(tmp_path: Path) -> None:
    f = tmp_path / "bad.toml"
    f.write_text('log_level = "x"\n[quota]\nconnections = -1\n')
    out, err = io.StringIO(), io.StringIO()
    assert check_config(f, out=out, err=err) == 1
    assert out.getvalue() == ""
    assert err.getvalue().splitlines() == [
        f'{f}: log_level = "x": must be one of "debug", "info", "warning", "error", "critical"',
        f"{f}: quota.connections = -1: must be an integer ≥ 0; 0 = no limit",
    ]


def test_toml_syntax_error_and_missing_file(tmp_path: Path) -> None:
    f = tmp_path / "broken.toml"
    f.write_text("[quota\nconnections = 1\n")
    with pytest.raises(ConfigError) as ei:
        load_config(f)
    assert str(ei.value).startswith(f"{f}: (file): is not valid TOML: ")
    assert "line 1" in str(ei.value)
    missing = tmp_path / "missing.toml"
    err = io.StringIO()
    assert check_config(missing, out=io.StringIO(), err=err) == 1
    assert err.getvalue() == (
        f'{missing}: (file) = "{missing}": cannot be read: No such file or directory\n'
    )


def test_default_quota_fits_a_thousand_connections_of_one_user() -> None:
    """#14: 1,000 concurrent connections between processes of one user, at the default buffer
    size (two DMBs each, one per half), fit the default per-user quota in a real pool of
    memfds; the quota still stops that user below the whole pool."""
    cfg = load_config(None, env=NO_SESSION)
    pool = DmbPool.from_config(cfg)
    uid = 1000
    size = cfg.buffers.default_dmb_size
    try:
        dmbs = [pool.register(uid, size) for _ in range(2 * 1000)]
        assert {d.size for d in dmbs} == {size}
        with pytest.raises(DmbLimitError) as ei:
            while True:
                dmbs.append(pool.register(uid, size, min_size=size))
        assert ei.value.limit.startswith("user-"), ei.value
        assert len(dmbs) * size <= cfg.buffers.pool_max_bytes // 2
        other = pool.register(uid + 1, size)  # another user still gets a full-size buffer
        assert other.size == size
    finally:
        pool.close()


def test_empty_file_is_the_embedded_default(tmp_path: Path) -> None:
    assert _load_text(tmp_path, "") == load_config(None, env=NO_SESSION)


# ----------------------------------------------------------------------------- reload


def test_reload_plan_splits_runtime_and_restart_keys(tmp_path: Path) -> None:
    old = load_config(SHIPPED)
    new = _load_text(
        tmp_path,
        SHIPPED.read_text()
        .replace('log_level = "info"', 'log_level = "debug"')
        .replace("connections = 2048", "connections = 10")
        .replace('"/run/smcd/handoff.sock"', '"/run/smcd/other.sock"')
        .replace('max_rmb_size = "512K"', 'max_rmb_size = "1M"'),
    )
    plan = diff_for_reload(old, new)
    assert plan.applied == ["log_level", "quota.connections"]
    assert plan.needs_restart == ["buffers.max_rmb_size", "handoff_socket"]
    eff = plan.effective
    assert eff is not None
    assert eff.log_level == "debug" and eff.quota.connections == 10
    assert eff.handoff_socket == Path("/run/smcd/handoff.sock")
    assert eff.buffers.max_rmb_size == 512 << 10
    same = diff_for_reload(old, old)
    assert same.applied == [] and same.needs_restart == [] and same.effective == old


def test_reloadable_keys_exist() -> None:
    keys = set(load_config(None).flat())
    assert keys >= RELOADABLE
    assert "dbus.bus" not in RELOADABLE and "runtime_dir" not in RELOADABLE


def test_parse_config_directly() -> None:
    cfg = parse_config({"eid": {"ueids": ["x"]}}, env=NO_SESSION)
    assert cfg.eid.ueids == ("X",)
    assert cfg.dbus.bus == "private"


def test_smcr_limits_follow_the_kernel_sysctl_ranges(tmp_path: Path) -> None:
    """smcr.max_conns/max_links take the ranges of net.smc.smcr_max_{conns,links}_per_lgr."""
    for text, needle in (
        ("[smcr]\nmax_conns = 15\n", "smcr.max_conns = 15: must be an integer, 16 ≤ n ≤ 255"),
        ("[smcr]\nmax_links = 3\n", "smcr.max_links = 3: must be an integer, 1 ≤ n ≤ 2"),
    ):
        errors = _errors(tmp_path, text)
        assert len(errors) == 1 and needle in errors[0]
    f = tmp_path / "ok.toml"
    f.write_text("[smcr]\nmax_conns = 16\nmax_links = 1\n")
    cfg = load_config(f)
    assert (cfg.smcr.max_conns, cfg.smcr.max_links) == (16, 1)
