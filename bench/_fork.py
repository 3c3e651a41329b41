"""One server child per measurement: fork, let the child set up its listener and say so through
a pipe, then run the parent's side. Shared by ``make bench`` (``_pairs``) and the SMC-R bench in
the VM (``smcr_vm``).

The child signals "ready" only once its listener exists (for smcd: is registered with its
daemon), so the parent's first connect can never race the registration and silently fall back
to TCP. A child that finds itself off SMC exits 3, which the parent turns into
:class:`NotOnSmc`; any other failure is a :class:`RuntimeError`.
"""

from __future__ import annotations

import os
import select
import signal
import sys
import time
import traceback
from collections.abc import Callable
from typing import TypeVar

S = TypeVar("S")
T = TypeVar("T")

_OFF_SMC = 3


class NotOnSmc(RuntimeError):
    """A connection stayed off SMC: its figures would be TCP's; the message says why."""


def fork_server(
    setup: Callable[[], S],
    server: Callable[[S], None],
    client: Callable[[], T],
    *,
    what: str,
    off_smc: str,
    timeout: float,
    grace: float = 1.0,
) -> T:
    """The child runs ``server(setup())``; the parent returns ``client()`` once the child is
    ready. ``what`` names the server in errors, ``off_smc`` says what exit 3 means, ``timeout``
    bounds the child's start and its exit after the client is done, ``grace`` how long a child
    gets to exit by itself after the client failed."""
    rd, wr = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report readiness (or why not) through the pipe
        os.close(rd)
        code = 0
        try:
            try:
                state = setup()
            except NotOnSmc as e:
                os.write(wr, b"N" + str(e).encode()[:4000])
                os._exit(_OFF_SMC)
            os.write(wr, b"R")
            os.close(wr)
            server(state)
        except NotOnSmc as e:
            print(f"bench server: {e}", file=sys.stderr)
            code = _OFF_SMC
        except BaseException:
            traceback.print_exc()
            code = 1
        os._exit(code)
    os.close(wr)
    try:
        ready, _, _ = select.select([rd], [], [], timeout)
        hello = os.read(rd, 4096) if ready else b""
    finally:
        os.close(rd)
    try:
        if hello.startswith(b"N"):
            raise NotOnSmc(hello[1:].decode(errors="replace"))
        if hello != b"R":
            raise RuntimeError(f"{what} server did not start")
        result = client()
    except BaseException as e:
        if _stop(pid, grace) == _OFF_SMC and not isinstance(e, NotOnSmc):
            raise NotOnSmc(f"{what} server: {off_smc}") from e
        raise
    code = _reap(pid, what, timeout)
    if code == _OFF_SMC:
        raise NotOnSmc(f"{what} server: {off_smc}")
    if code:
        raise RuntimeError(f"{what} server failed (exit {code})")
    return result


def _stop(pid: int, grace: float) -> int:
    """The child's exit code after a failure: it gets ``grace`` seconds to exit by itself (and
    say why on stderr), then SIGKILL (it may be waiting for connections that will never come)."""
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def _reap(pid: int, what: str, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise RuntimeError(f"{what} server hung; killed")
        time.sleep(0.005)
