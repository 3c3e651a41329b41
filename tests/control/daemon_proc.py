"""Run the real ``smcd`` (``.venv/bin/smcd``) as a process for tests, and listen to it.

- :class:`NotifySocket` is a real ``NOTIFY_SOCKET`` (AF_UNIX datagram) the test owns: smcd's
  ``READY=1``/``STATUS=``/``STOPPING=1`` arrive here exactly as systemd would receive them, and
  waiting for ``READY=1`` is how a test knows the daemon is up.
- :class:`SmcdProcess` starts smcd (optionally inside a network namespace via ``ip netns exec``, or
  under ``systemd-socket-activate``) with its stderr in a log file, and stops it.
- :func:`smcctl` runs the real CLI (optionally as ``nobody``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SMCD = REPO / ".venv" / "bin" / "smcd"
SMCCTL = REPO / ".venv" / "bin" / "smcctl"


class NotifySocket:
    """A datagram socket bound at ``path`` collecting sd_notify messages."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(os.fspath(path))
        os.chmod(path, 0o777)
        self.messages: list[dict[str, str]] = []

    def _drain(self, timeout: float) -> None:
        self.sock.settimeout(timeout)
        try:
            data = self.sock.recv(65536)
        except (TimeoutError, BlockingIOError):
            return
        fields = dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line)
        self.messages.append(fields)

    def wait_for(self, key: str, value: str | None = None, timeout: float = 15.0) -> dict[str, str]:
        """The first message (old or new) with ``key`` (= ``value``); consumes nothing."""
        deadline = time.monotonic() + timeout
        seen = 0
        while True:
            for msg in self.messages[seen:]:
                if key in msg and (value is None or msg[key] == value):
                    return msg
            seen = len(self.messages)
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(
                    f"no sd_notify message with {key}={value or '*'} within {timeout} s; "
                    f"got {self.messages}"
                )
            self._drain(min(left, 0.2))

    def clear(self) -> None:
        self.messages.clear()

    def close(self) -> None:
        self.sock.close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


@dataclass
class SmcdProcess:
    argv: list[str]
    log_path: Path
    notify: NotifySocket
    proc: subprocess.Popen[bytes] = field(init=False)

    def start(self, *, env_extra: dict[str, str] | None = None) -> SmcdProcess:
        env = dict(os.environ)
        env.pop("LISTEN_FDS", None)
        env.pop("LISTEN_PID", None)
        env["NOTIFY_SOCKET"] = os.fspath(self.notify.path)
        env.update(env_extra or {})
        self.notify.clear()
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            self.argv, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=env,
        )  # fmt: skip
        return self

    def wait_ready(self, timeout: float = 20.0) -> dict[str, str]:
        try:
            return self.notify.wait_for("READY", "1", timeout)
        except AssertionError as e:
            raise AssertionError(f"{e}\n--- smcd log ---\n{self.log()}") from None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def stop(self, timeout: float = 10.0) -> int:
        """SIGTERM and wait; returns the exit status (kills after ``timeout``)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError(f"smcd did not stop on SIGTERM\n{self.log()}") from None
        self._log.close()
        return self.proc.returncode

    def wait_log(self, text: str, timeout: float = 5.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            log = self.log()
            if text in log:
                return log
            time.sleep(0.05)
        raise AssertionError(f"{text!r} not in the smcd log within {timeout} s:\n{self.log()}")


def smcd_argv(
    config: Path, *, netns: str | None = None, activate_socket: Path | None = None
) -> list[str]:
    """``smcd --config FILE``, inside ``netns`` and/or under systemd-socket-activate (which
    listens on ``activate_socket`` and execs smcd, keeping its pid, on the first connection)."""
    argv = [os.fspath(SMCD), "--config", os.fspath(config)]
    if activate_socket is not None:
        argv = [
            "systemd-socket-activate", "--seqpacket", "-l", os.fspath(activate_socket),
            "-E", "NOTIFY_SOCKET", *argv,
        ]  # fmt: skip
    if netns is not None:
        argv = ["ip", "netns", "exec", netns, *argv]
    return argv


def smcctl(
    args: Sequence[str], *, bus: str, as_nobody: bool = False, timeout: float = 20.0
) -> subprocess.CompletedProcess[str]:
    argv = [os.fspath(SMCCTL), *args, "--bus", bus]
    if as_nobody:
        from tests.control.dbusd import as_nobody as wrap

        argv = wrap(argv)
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)


def sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, check=check)
