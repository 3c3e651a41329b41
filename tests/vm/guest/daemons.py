"""Helpers for guest tests that run real ``smcd`` processes and applications against each other.

A :class:`Daemon` is one ``smcd`` with its own configuration file, private D-Bus, runtime dir
(handoff socket) and log (a :class:`smcd_daemon.demo.PrivateSmcd`, the launcher ``make demo`` and
``bench/smcr_vm.py`` use too); :func:`start` launches one, :func:`wait_ready` waits until ``smcctl``
gets an answer, :meth:`Daemon.reload` rewrites the configuration and applies it with SIGHUP (and
waits until the daemon says so), :func:`stop` ends it. ``smcctl`` runs in this process
(:meth:`Daemon.ctl`: the real command line code over the daemon's bus, without paying for a
Python start-up under TCG for each call). Applications are separate Python processes using
``smc_handoff`` with the daemon's handoff socket (:func:`app`, :func:`line`, :func:`finish`).

:func:`ip_batch` runs ``ip -batch`` for the route/address changes a test makes (one process per
change set) and :func:`mac_of` reads a NIC's MAC.

Every wait has a deadline; nothing here asserts a duration (TCG makes everything slow).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from smcd_daemon.demo import DaemonStartError, PrivateSmcd, stop_all

ROOT = Path(__file__).resolve().parents[3]
PY = ROOT / ".venv" / "bin" / "python"
WAIT = 150.0
"""Deadline for a daemon to come up or apply a reload, an app to answer (TCG is slow)."""

__all__ = [
    "PY",
    "ROOT",
    "WAIT",
    "Daemon",
    "app",
    "config_text",
    "finish",
    "ip_batch",
    "line",
    "mac_of",
    "start",
    "stop",
    "wait_ready",
]


def config_text(
    *,
    peers: Sequence[str],
    ueids: Sequence[str],
    smcr: bool = True,
    clc_wait: float = 30.0,
    proposal_wait: float = 10.0,
    first_llc: float = 30.0,
    linger: float | None = None,
    max_links: int | None = None,
) -> str:
    """An ``smcd.toml`` with the keys these tests vary (all of them reloadable by SIGHUP);
    ``linger`` (link groups' idle time) and ``max_links`` (links per link group) only when
    given."""
    quoted = ", ".join(json.dumps(p) for p in peers)
    ids = ", ".join(json.dumps(u) for u in ueids)
    flag = "true" if smcr else "false"
    return (
        f"peers = [{quoted}]\n"
        f"[eid]\nueids = [{ids}]\n"
        f"[modes]\nsmcr_v1 = {flag}\nsmcr_v2 = {flag}\n"
        f"[timeouts]\nclc_wait = {clc_wait}\nproposal_wait = {proposal_wait}\n"
        f"first_llc = {first_llc}\n"
        + (f"linger = {linger}\n" if linger is not None else "")
        + (f"[smcr]\nmax_links = {max_links}\n" if max_links is not None else "")
    )


@dataclass
class Daemon:
    """One running ``smcd`` (see the module docstring)."""

    name: str
    smcd: PrivateSmcd
    proc: subprocess.Popen[bytes]
    """Kept after :func:`stop` (which clears ``smcd.proc``) for its exit status."""

    @property
    def bus(self) -> str:
        return self.smcd.bus_address_path.read_text().strip()

    def ctl(self, *args: str) -> str:
        """``smcctl --bus <ours> ARGS`` (in this process); its stdout. Fails the test on a
        non-zero exit."""
        from smcd_daemon.cli import main

        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main(["--bus", self.bus, *args])
        assert rc == 0, f"smcctl {' '.join(args)} on smcd {self.name}: {err.getvalue()}"
        return out.getvalue()

    def ctl_json(self, *args: str) -> Any:
        return json.loads(self.ctl("--json", *args))

    def log_text(self) -> str:
        try:
            return self.smcd.log_path.read_text(errors="replace")
        except OSError as e:
            return f"(log unreadable: {e})"

    def tail(self, n: int = 4000) -> str:
        return f"--- smcd {self.name} log (tail)\n{self.log_text()[-n:]}"

    def reload(self, config: str) -> None:
        """Write ``config`` (which must change something) and SIGHUP the daemon; return once it
        logged that it applied the change."""
        start = len(self.log_text())
        self.smcd.config_path.write_text(config)
        self.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + WAIT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"smcd {self.name} exited {self.proc.returncode}\n{self.tail()}")
            new = self.log_text()[start:]
            if "previous configuration" in new:
                pytest.fail(f"smcd {self.name} rejected the configuration:\n{new}")
            if "reload: applied" in new:
                return
            time.sleep(0.2)
        pytest.fail(f"smcd {self.name} did not log a reload within {WAIT:g} s\n{self.tail()}")


def start(base: Path, name: str, config: str) -> Daemon:
    """Launch ``smcd`` with ``config``; files (config, log, state) under ``base/name``, its
    sockets in a fresh /tmp dir (``base`` may be 9p, which holds no sockets)."""
    smcd = PrivateSmcd(log_level="debug", config_text=config, home=base / name, name=name)
    smcd.launch()
    assert smcd.proc is not None
    return Daemon(name, smcd, smcd.proc)


def wait_ready(d: Daemon) -> None:
    """Until smcd says ``READY=1`` (its handoff socket and D-Bus service are up) and ``smcctl
    conns`` answers (or fail with the log)."""
    try:
        d.smcd.wait_ready(WAIT)
    except DaemonStartError as e:
        pytest.fail(f"smcd {d.name}: {str(e).splitlines()[0]}\n{d.tail()}")
    d.ctl("conns")


def stop(daemons: Iterable[Daemon]) -> None:
    """SIGTERM them all, wait for each, remove their runtime dirs (the files stay)."""
    ds = list(daemons)
    stop_all([d.smcd for d in ds], 30.0)
    for d in ds:
        d.smcd.cleanup()


def app(script: str, d: Daemon, *args: str) -> subprocess.Popen[str]:
    """An application process running ``script`` with ``d``'s handoff socket."""
    env = dict(
        os.environ, SMCD_HANDOFF_SOCKET=str(d.smcd.handoff_socket), SMCD_HANDOFF_TIMEOUT="60"
    )
    return subprocess.Popen(
        [str(PY), "-c", script, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=str(ROOT),
    )


def line(
    p: subprocess.Popen[str],
    what: str,
    daemons: Sequence[Daemon],
    others: Sequence[subprocess.Popen[str] | None] = (),
) -> str:
    """The next line ``p`` prints; on EOF fail with every app's stderr and the daemons' logs.
    (The apps have their own deadlines: connect 60 s, the daemon's CLC waits.)"""
    assert p.stdout is not None
    got = p.stdout.readline()
    if got:
        return got.strip()
    text = []
    for q, name in ((p, what), *((o, "other app") for o in others if o is not None)):
        if q.poll() is None:
            q.kill()
        text.append(f"--- {name} (exit {q.wait()})\n{q.stderr.read() if q.stderr else ''}")
    tails = "\n".join(d.tail(3000) for d in daemons)
    pytest.fail(f"{what} printed nothing:\n" + "\n".join(text) + f"\n{tails}")


def finish(p: subprocess.Popen[str] | None) -> tuple[int, str]:
    """Let an app that waits on stdin end; its exit status and stderr."""
    if p is None:
        return 0, ""
    with contextlib.suppress(Exception):
        assert p.stdin is not None
        p.stdin.write("\n")
        p.stdin.flush()
    try:
        p.wait(60)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
    err = p.stderr.read() if p.stderr else ""
    return p.returncode, err


def ip_batch(lines: Sequence[str], *, force: bool = False) -> None:
    """``ip [-force] -batch -``: the changes a test makes to routes, addresses, neighbours.
    ``force`` goes on past failing lines (for teardown: restore as much as possible)."""
    cmd = ["ip", *(["-force"] if force else []), "-batch", "-"]
    done = subprocess.run(
        cmd, input="\n".join(lines) + "\n", capture_output=True, text=True, timeout=60
    )
    if done.returncode != 0 and not force:
        pytest.fail(f"`ip -batch` failed: {done.stderr.strip()}\nbatch:\n" + "\n".join(lines))


def mac_of(ifname: str) -> str:
    return Path(f"/sys/class/net/{ifname}/address").read_text().strip()
