"""``make install`` / ``make uninstall`` into a DESTDIR: what lands where, and that it runs.

The real install (DESTDIR empty, systemd as PID 1) is proven in the systemd VM test
(tests/systemd); here the same Makefile targets stage into a temporary directory on the host, so
every path, symlink, rewritten shebang and the kept configuration file can be checked without
touching the machine. The wheelhouse (.cache/wheels) is built from PyPI on the first run.
"""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BINS = ("smcd", "smcctl", "smc-run")

pytestmark = pytest.mark.slow


def _make(*args: str) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(
        ["make", "--no-print-directory", "-C", str(REPO), *args],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, f"make {' '.join(args)} failed:\n{r.stdout}\n{r.stderr}"
    return r


def _run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def _files_under(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if not p.is_dir())


def test_install_uninstall_into_destdir(tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    out = _make("install", f"DESTDIR={dest}").stdout
    assert "installed smcd" in out

    lib = dest / "usr/lib/smcd"
    # smcd, smcctl, smc-run on PATH: links to the venv's scripts by their installed path.
    for b in BINS:
        link = dest / "usr/bin" / b
        assert link.is_symlink(), link
        assert os.readlink(link) == f"/usr/lib/smcd/bin/{b}"
        script = lib / "bin" / b
        first = script.read_text().splitlines()[0]
        assert first == "#!/usr/lib/smcd/bin/python", f"{script}: {first}"
    # Nothing in the venv's scripts or config still names the staging directory.
    for f in [*(lib / "bin").iterdir(), lib / "pyvenv.cfg"]:
        if f.is_file() and not f.is_symlink():
            assert str(dest) not in f.read_text(errors="replace"), f
    cfg = (lib / "pyvenv.cfg").read_text()
    assert "include-system-site-packages = true" in cfg  # pyverbs, systemd from Debian

    # Units in the systemd unit dir, ExecStart naming the installed smcd; no D-Bus file there.
    units = dest / "usr/lib/systemd/system"
    assert sorted(p.name for p in units.iterdir()) == ["smcd.service", "smcd.socket"]
    svc = (units / "smcd.service").read_text()
    assert "\nExecStart=/usr/bin/smcd --config /etc/smcd/smcd.toml\n" in svc
    assert (units / "smcd.socket").read_bytes() == (REPO / "units/smcd.socket").read_bytes()
    dbus = dest / "usr/share/dbus-1"
    assert (dbus / "system.d/org.smcd.conf").read_bytes() == (
        REPO / "config/dbus-1/system.d/org.smcd.conf"
    ).read_bytes()
    act = (dbus / "system-services/org.smcd.service").read_text()
    assert "SystemdService=dbus-org.smcd.service" in act
    conf = dest / "etc/smcd/smcd.toml"
    assert conf.read_bytes() == (REPO / "config/smcd.toml").read_bytes()

    # Readable by every user (applications import smc_handoff from here).
    site = next(lib.glob("lib/python3*/site-packages"))
    for p in [site / "smc_handoff", *(site / "smc_handoff").iterdir()]:
        mode = stat.S_IMODE(p.stat().st_mode)
        assert mode & 0o004, f"{p} is not world-readable ({mode:o})"

    # The venv runs: its smcd, smcctl and smc-run, importing the installed packages (not the
    # checkout: run from elsewhere with no PYTHONPATH).
    py = str(lib / "bin/python")
    r = _run([py, str(lib / "bin/smcd"), "--help"], tmp_path)
    assert r.returncode == 0 and "usage: smcd" in r.stdout, r.stderr
    r = _run([py, str(lib / "bin/smcctl"), "--help"], tmp_path)
    assert r.returncode == 0 and "monitor" in r.stdout, r.stderr
    r = _run([py, str(lib / "bin/smc-run"), "--help"], tmp_path)
    assert r.returncode == 0 and "usage: smc-run" in r.stdout, r.stderr
    r = _run(
        [py, "-c", "import smc_handoff, smcd_daemon, systemd.journal; "
         "print(smc_handoff.__file__); print(smcd_daemon.__file__)"],
        tmp_path,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    for line in r.stdout.split():
        assert line.startswith(str(site)), r.stdout

    # A second install keeps a configuration the administrator changed; PREFIX moves the venv
    # and the links, and ExecStart follows.
    conf.write_text(conf.read_text() + '\nlog_level = "debug"\n')
    changed = conf.read_text()
    out = _make("install", f"DESTDIR={dest}", "PREFIX=/usr/local").stdout
    assert "keeping" in out
    assert conf.read_text() == changed
    assert os.readlink(dest / "usr/local/bin/smcd") == "/usr/local/lib/smcd/bin/smcd"
    assert "\nExecStart=/usr/local/bin/smcd --config" in (units / "smcd.service").read_text()

    # Uninstall removes everything it installed; the changed configuration stays (said so),
    # the unchanged default goes.
    _make("uninstall", f"DESTDIR={dest}", "PREFIX=/usr/local")
    assert not (dest / "usr/local/lib/smcd").exists()
    out = _make("uninstall", f"DESTDIR={dest}").stdout
    assert "keeping" in out and conf.exists()
    assert _files_under(dest) == [conf]
    conf.write_bytes((REPO / "config/smcd.toml").read_bytes())
    _make("uninstall", f"DESTDIR={dest}")
    assert _files_under(dest) == []
