"""StateStore: atomic, durable 0600 saves; corrupt files moved aside and reported, never dropped."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from smcd_daemon.core.eid import EidTable, system_eid
from smcd_daemon.core.persist import (
    STATE_FILE_NAME,
    ControlState,
    PersistError,
    StateStore,
    control_state_dict,
    load_control_state,
    save_control_state,
)
from smcd_daemon.core.pnet import PnetTable

REPO = Path(__file__).resolve().parents[2]


def temps(d: Path) -> list[Path]:
    return sorted(p for p in d.iterdir() if p.name.endswith(".tmp"))


def corrupt_files(d: Path, name: str = STATE_FILE_NAME) -> list[Path]:
    return sorted(d.glob(f"{name}.corrupt-*"))


# -- plain round trip, permissions -------------------------------------------------------------


def test_missing_file_is_empty_state(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "state.json")
    r = store.load_result()
    assert r.data == {} and r.warning is None and r.moved_to is None
    assert store.last_warning is None
    assert store.load() == {}
    assert list(tmp_path.iterdir()) == []  # loading creates nothing


def test_save_load_round_trip(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "state.json")
    data = {"pnet": {"entries": [{"pnetid": "N1"}]}, "eid": {"ueids": ["Ä-is-utf8"]}, "n": 3}
    store.save(data)
    assert StateStore(tmp_path / "state.json").load() == data
    text = (tmp_path / "state.json").read_text("utf-8")
    assert text.endswith("}\n")
    assert json.loads(text) == data
    store.save({"n": 4})
    assert store.load() == {"n": 4}
    assert temps(tmp_path) == []


def test_file_is_0600_and_new_dir_0700(tmp_path: Path) -> None:
    path = tmp_path / "state" / "sub" / "state.json"
    StateStore(path).save({"a": 1})
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert path.stat().st_uid == os.getuid()


def test_save_replaces_a_world_readable_file_with_0600(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    path.write_text("{}")
    path.chmod(0o644)
    old_umask = os.umask(0)  # even with a permissive umask
    try:
        StateStore(path).save({"a": 1})
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


# -- failed saves leave the old file alone ------------------------------------------------------


@pytest.mark.parametrize(
    ("bad", "exc"), [({"x": object()}, TypeError), ({"x": float("nan")}, ValueError)]
)
def test_unserialisable_state_changes_nothing(
    tmp_path: Path, bad: dict[str, Any], exc: type[Exception]
) -> None:
    store = StateStore(tmp_path / "state.json")
    store.save({"good": True})
    before = (tmp_path / "state.json").read_bytes()
    with pytest.raises(exc):
        store.save(bad)
    assert (tmp_path / "state.json").read_bytes() == before
    assert temps(tmp_path) == []


def test_unwritable_target_is_persist_error_and_leaves_no_temp(tmp_path: Path) -> None:
    target = tmp_path / "state.json"
    target.mkdir()  # rename(file, dir) fails: EISDIR
    with pytest.raises(PersistError) as ei:
        StateStore(target).save({"a": 1})
    assert str(target) in str(ei.value) and "cannot be written" in str(ei.value)
    assert ei.value.path == target
    assert temps(tmp_path) == []
    with pytest.raises(PersistError, match="cannot be read"):
        StateStore(target).load()


# -- corrupt files -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (b"", "not valid JSON"),
        (b'{"pnet": {"entries": [', "not valid JSON"),
        (b"\x00\x01garbage\xff", "not UTF-8"),
        (b"[1, 2, 3]\n", "JSON list, not an object"),
        (b'"just a string"', "JSON str, not an object"),
        (b"{} {}", "not valid JSON"),
    ],
)
def test_corrupt_file_moved_aside_and_reported(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, content: bytes, reason: str
) -> None:
    path = tmp_path / "state.json"
    path.write_bytes(content)
    store = StateStore(path)
    with caplog.at_level(logging.WARNING, logger="smcd.persist"):
        r = store.load_result()
    assert r.data == {}
    assert r.moved_to is not None
    assert re.fullmatch(r"state\.json\.corrupt-\d{8}T\d{6}\.\d{6}Z", r.moved_to.name)
    assert r.moved_to.parent == tmp_path
    assert r.moved_to.read_bytes() == content  # kept, byte for byte
    assert not path.exists()
    assert r.warning is not None and store.last_warning == r.warning
    assert str(path) in r.warning and str(r.moved_to) in r.warning and reason in r.warning
    assert [rec.getMessage() for rec in caplog.records] == [r.warning]
    # the next start sees no file (not the corrupt one again) and a new save works
    assert store.load() == {} and store.last_warning is None
    store.save({"fresh": 1})
    assert StateStore(path).load() == {"fresh": 1}
    assert corrupt_files(tmp_path) == [r.moved_to]


def test_two_corruptions_keep_both_files(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    moved = []
    for content in (b"one", b"two", b"three"):
        path.write_bytes(content)
        r = StateStore(path).load_result()
        assert r.moved_to is not None
        moved.append(r.moved_to)
    assert len(set(moved)) == 3
    assert sorted(p.read_bytes() for p in corrupt_files(tmp_path)) == [b"one", b"three", b"two"]


def test_validator_rejection_is_corruption(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    StateStore(path).save({"version": 99})

    def validate(d: dict[str, Any]) -> None:
        if d.get("version") != 1:
            raise ValueError(f"version {d.get('version')} unknown")

    r = StateStore(path).load_result(validate)
    assert r.data == {} and r.moved_to is not None
    assert "version 99 unknown" in (r.warning or "")
    assert json.loads(r.moved_to.read_text()) == {"version": 99}


def test_stale_temp_files_removed_on_load(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    StateStore(path).save({"a": 1})
    stale = tmp_path / ".state.json.abcd1234.tmp"
    stale.write_text('{"half": ')
    other = tmp_path / ".other.json.abcd.tmp"  # not ours: left alone
    other.write_text("x")
    assert StateStore(path).load() == {"a": 1}
    assert not stale.exists()
    assert other.exists()


# -- the daemon's control state ----------------------------------------------------------------


def sample_tables() -> tuple[PnetTable, EidTable]:
    pnet = PnetTable()
    pnet.add("NET1", netdev="veth-a", ibdev="mlx5_0", ibport=2)
    pnet.add("net2", netdev="veth-b")
    eids = EidTable(["SMC-LO.TEST", "second"])
    return pnet, eids


def test_restart_restores_tables(tmp_path: Path) -> None:
    pnet, eids = sample_tables()
    save_control_state(StateStore(tmp_path / STATE_FILE_NAME), pnet, eids)
    on_disk = json.loads((tmp_path / STATE_FILE_NAME).read_text())
    assert on_disk == control_state_dict(pnet, eids)
    assert set(on_disk) == {"format", "pnet", "eid"}
    # "restart": a new store object, new tables
    st = load_control_state(StateStore(tmp_path / STATE_FILE_NAME))
    assert st.pnet == pnet and st.eids == eids
    assert st.warning is None and st.moved_to is None


def test_restart_with_seid(tmp_path: Path) -> None:
    seid = system_eid(7, 0x3931)
    eids = EidTable(["A"], seid=seid)
    eids.disable_seid()
    store = StateStore(tmp_path / STATE_FILE_NAME)
    save_control_state(store, PnetTable(), eids)
    st = load_control_state(store, seid=seid)
    assert st.eids == eids and not st.eids.seid_enabled


def test_no_file_gives_empty_tables(tmp_path: Path) -> None:
    st = load_control_state(StateStore(tmp_path / STATE_FILE_NAME))
    assert st == ControlState(PnetTable(), EidTable())


@pytest.mark.parametrize(
    ("state", "reason"),
    [
        ({"format": 1, "pnet": {"entries": [{"pnetid": "BAD_ID", "netdev": "e"}]}}, "BAD_ID"),
        ({"format": 1, "eid": {"ueids": ["A", "A"]}}, "already defined"),
        ({"format": 7}, "format 7"),
        ({"format": 1, "pnet": [], "eid": {}}, "not an object"),
    ],
)
def test_semantically_corrupt_state_moved_aside(
    tmp_path: Path, state: dict[str, Any], reason: str
) -> None:
    path = tmp_path / STATE_FILE_NAME
    path.write_text(json.dumps(state))
    st = load_control_state(StateStore(path))
    assert st.pnet == PnetTable() and st.eids == EidTable()  # never half a configuration
    assert st.warning is not None and reason in st.warning and "moved to" in st.warning
    assert st.moved_to is not None and json.loads(st.moved_to.read_text()) == state
    assert not path.exists()
    # the operator re-enters the table; the next restart restores it
    pnet, eids = sample_tables()
    save_control_state(StateStore(path), pnet, eids)
    again = load_control_state(StateStore(path))
    assert again.pnet == pnet and again.eids == eids and again.warning is None


# -- crash safety --------------------------------------------------------------------------------


def payload(i: int) -> dict[str, Any]:
    blob = chr(ord("a") + i % 26) * ((i * 7919) % 150_000)
    return {"i": i, "blob": blob, "sha": hashlib.sha256(blob.encode()).hexdigest()}


def check_whole(raw: bytes) -> int:
    """The file parses and its blob matches its checksum: it is one complete save."""
    d = json.loads(raw)
    assert hashlib.sha256(d["blob"].encode()).hexdigest() == d["sha"]
    return int(d["i"])


def test_sigkill_mid_save_never_leaves_a_partial_file(tmp_path: Path) -> None:
    """Kill a process that saves in a loop with SIGKILL, many times, at random moments; the file
    is always one complete save (and readers during the saves only ever see complete ones)."""
    path = tmp_path / "state.json"
    StateStore(path).save(payload(0))
    rng = random.Random(1234)
    kills, temps_left, newest, reads = 60, 0, 0, 0
    for round_ in range(kills):
        pid = os.fork()
        if pid == 0:  # child: save forever until killed
            try:
                store = StateStore(path)
                i = round_ * 1_000_000
                while True:
                    i += 1
                    store.save(payload(i))
            finally:
                os._exit(1)
        deadline = time.monotonic() + rng.uniform(0.0, 0.03)
        while time.monotonic() < deadline:  # concurrent readers see whole files only
            check_whole(path.read_bytes())
            reads += 1
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
        newest = max(newest, check_whole(path.read_bytes()))
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        temps_left += len(temps(tmp_path))
        assert StateStore(path).load()["sha"]  # load() parses it and sweeps the temps
        assert temps(tmp_path) == []
        assert corrupt_files(tmp_path) == []
    # the test has teeth only if saves really ran and kills really interrupted some of them
    assert newest > 1_000_000
    assert temps_left > 0
    assert reads > 0


def test_save_syncs_file_then_renames_then_syncs_directory(tmp_path: Path) -> None:
    """Observed with strace on a real process: write+fsync(temp), rename(temp, file), then
    fsync(directory) — and the real file is never opened for writing."""
    strace = shutil.which("strace")
    assert strace, (
        "strace is needed to observe the syscalls: apt-get install strace "
        "(tests/host/install-deps.sh installs it)"
    )
    path = tmp_path / "d" / "state.json"
    trace = tmp_path / "trace.txt"
    script = (
        "from smcd_daemon.core.persist import StateStore\n"
        f"StateStore({str(path)!r}).save({{'pnet': {{}}, 'eid': {{}}}})\n"
    )
    subprocess.run(
        [
            strace,
            "-f",
            "-qq",
            "-o",
            str(trace),
            "-e",
            "trace=open,openat,write,fsync,fdatasync,rename,renameat,renameat2,close",
            sys.executable,
            "-c",
            script,
        ],
        cwd=REPO,
        check=True,
        timeout=30,
    )
    lines = [ln.split(" ", 1)[1].strip() for ln in trace.read_text().splitlines() if " " in ln]

    def index(pattern: str, start: int = 0) -> tuple[int, re.Match[str]]:
        for i in range(start, len(lines)):
            m = re.search(pattern, lines[i])
            if m:
                return i, m
        raise AssertionError(
            f"no syscall matching {pattern!r} after line {start}:\n" + "\n".join(lines[start:])
        )

    d = re.escape(str(path.parent))
    i_open, m = index(
        rf'openat\(AT_FDCWD, "({d}/\.state\.json\.[^"]+\.tmp)", [^)]*O_CREAT[^)]*\) = (\d+)'
    )
    tmp, fd = m.group(1), m.group(2)
    i_write, _ = index(rf"write\({fd}, ", i_open)
    i_fsync, _ = index(rf"f(data)?sync\({fd}\)\s+= 0", i_write)
    i_close, _ = index(rf"close\({fd}\)", i_fsync)
    i_rename, _ = index(rf'rename(at2?)?\(.*"{re.escape(tmp)}".*"{re.escape(str(path))}"', i_close)
    i_dir, m_dir = index(rf'openat\(AT_FDCWD, "{d}", [^)]*O_DIRECTORY[^)]*\) = (\d+)', i_rename)
    index(rf"fsync\({m_dir.group(1)}\)\s+= 0", i_dir)
    assert i_open < i_write < i_fsync < i_close < i_rename < i_dir
    assert not any(
        re.search(rf'open(at)?\(.*"{re.escape(str(path))}", [^)]*O_(WRONLY|RDWR)', ln)
        for ln in lines
    )
    assert json.loads(path.read_text()) == {"pnet": {}, "eid": {}}
