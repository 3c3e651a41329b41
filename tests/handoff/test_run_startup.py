"""smc-run's start-up: the hooks are in place before the program's first line, the library is
loaded only when the program imports ``socket``, and what is loaded then upgrades as before."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import smc_handoff

REPO = Path(__file__).resolve().parents[2]
SMC_RUN = [sys.executable, "-m", "smc_handoff.run"]
LAUNCH_PY = Path(smc_handoff.__file__).resolve().parent / "launch.py"

# What the bootstrap may load before the program's first line: the hooks' modules, no more.
BOOT_MODULES = {
    "smc_handoff",
    "smc_handoff.fdmap",
    "smc_handoff.import_hook",
    "smc_handoff.launch",
    "smc_handoff.readiness",
    "smc_handoff.run",
    "fcntl",
    "select",
}
# The library proper, and what it costs: loaded by `import socket`, not before.
LIBRARY = [
    "smc_handoff.socket",
    "smc_handoff.autosocket",
    "smc_handoff.handoff",
    "smc_handoff.messages",
    "smc_handoff.message_defs",
    "smc_handoff.channel_base",
    "smc_handoff.wakeup",
    "socket",
    "dataclasses",
]

MODULES = "import json, sys; print(json.dumps(sorted(sys.modules)), flush=True)\n"


def _env(tmp_path: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["SMCD_HANDOFF_SOCKET"] = str(tmp_path / "absent.sock")
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("PYTHONPATH", None)
    return env


def _run(cmd: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        cmd, env=_env(tmp_path), cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    return proc


def _modules(cmd: list[str], tmp_path: Path) -> set[str]:
    first = _run(cmd, tmp_path).stdout.splitlines()[0]
    return set(json.loads(first))


def test_the_bootstrap_loads_only_the_hooks(tmp_path: Path) -> None:
    """A program that imports nothing starts with the hooks' few modules more than under plain
    python: not the library (``smc_handoff.socket``, the messages, ``dataclasses``, ``logging``:
    ~45 ms that every program under smc-run paid before its first line)."""
    plain = _modules([sys.executable, "-c", MODULES], tmp_path)
    under = _modules([*SMC_RUN, "-c", MODULES], tmp_path)
    extra = under - plain
    assert extra <= BOOT_MODULES, sorted(extra - BOOT_MODULES)
    assert "smc_handoff.run" in extra
    for name in LIBRARY:
        assert name not in under or name in plain, name
    if "logging" not in plain:
        assert "logging" not in under


HOOKS = """
import os, select, sys
print("socket" in sys.modules, "smc_handoff.socket" in sys.modules)
print(type(select.select).__name__, select.poll.__name__, select.epoll.__name__)
print(getattr(os.read, "_smc_fd", False), getattr(os.execv, "_smc_relay", False))
print(sorted(f.name for f in sys.meta_path if type(f).__name__ == "PatchOnImport"))
import subprocess
print(getattr(subprocess.Popen._get_handles, "_smc_relay", False))
import socket
print(socket.socket.__module__, socket.socket.__name__, "smc_handoff.socket" in sys.modules)
print(getattr(subprocess.Popen._get_handles, "_smc_relay", False))
s = socket.socket()
print(type(s).__name__)
s.bind(("127.0.0.1", 0))
s.listen()
s.close()
import ssl
from smc_handoff import autosocket, channel_base, handoff, readiness, wakeup
print(issubclass(ssl.SSLSocket, autosocket.AutoSocket), getattr(ssl.SSLContext, "_smc_tls", False))
print(handoff._poll is readiness._real_poll, channel_base._poll is readiness._real_poll,
      wakeup._epoll is readiness._real_epoll, select.poll is readiness.SmcPoll)
import fcntl
print(handoff._ioctl is fcntl.ioctl.__wrapped__,
      channel_base._set_blocking is os.set_blocking.__wrapped__)
"""


def test_hooks_before_the_first_line_and_the_library_at_import_socket(tmp_path: Path) -> None:
    """The hooks on descriptors, ``select`` and imports are there at the first line; ``import
    socket`` loads the library and ``socket.socket`` is smc-run's class (ssl's derives from
    it); ``subprocess``, imported before, is patched then; the library's own modules keep the
    real calls (they were loaded before the hooks before)."""
    proc = _run([*SMC_RUN, "-v", "-c", HOOKS], tmp_path)
    lines = proc.stdout.splitlines()
    assert lines[0] == "False False"
    assert lines[1] == "_Select SmcPoll SmcEpoll"
    assert lines[2] == "True True"
    waited = ["asyncio", "multiprocessing.reduction", "socket", "ssl", "subprocess", "trio._socket"]
    assert lines[3] == str(sorted([*waited, "uvloop"]))  # (uvloop: -v's report)
    assert lines[4] == "False"  # (no socket yet: nothing of the library)
    assert lines[5] == "smc_handoff.run AutoSocket True"
    assert lines[6] == "True"
    assert lines[7] == "AutoSocket"
    assert lines[8] == "True True"
    assert lines[9] == "True True True True"
    assert lines[10] == "True True"
    assert re.search(r"listen \('127.0.0.1', \d+\): tcp \(DAEMON_UNAVAILABLE", proc.stderr)


def test_a_failing_library_leaves_the_program_on_tcp(tmp_path: Path) -> None:
    """The library fails to load at ``import socket`` (here: ``smc_handoff.autosocket`` is not
    importable): smc-run says so, as it did at start-up, and the program runs on plain TCP."""
    code = (
        "import sys; sys.modules['smc_handoff.autosocket'] = None\n"
        "import socket; print(socket.socket.__module__)\n"
    )
    proc = _run([*SMC_RUN, "-c", code], tmp_path)
    assert proc.stdout == "socket\n"
    assert proc.stderr.startswith("smc-run: not upgrading sockets: ModuleNotFoundError(")


def test_the_launcher_runs_as_a_script_without_site(tmp_path: Path) -> None:
    """``python -I -S .../smc_handoff/launch.py`` (~8 ms, where the console script's interpreter
    runs site: ~30 ms) execs the program as ``smc-run`` does."""
    code = "import os, sys; print(os.environ['SMC_RUN'], 'smc_handoff.run' in sys.modules)"
    proc = _run([sys.executable, "-I", "-S", str(LAUNCH_PY), "-c", code], tmp_path)
    assert proc.stdout == "1 True\n"
    missing = subprocess.run(
        [sys.executable, "-I", "-S", str(LAUNCH_PY), "no-such-program-smc"],
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert missing.returncode == 2
    assert missing.stderr.startswith("smc-run: no-such-program-smc: command not found\n")
    debug = _run([sys.executable, "-I", "-S", str(LAUNCH_PY), "-d", "-c", "pass"], tmp_path)
    assert debug.stderr.startswith("smc-run: exec ")
