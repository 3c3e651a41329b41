"""Two Python processes joined by one kind of stream: TCP loopback, a Unix stream socket, or an
SMC-D channel that a real smcd set up (``smc_handoff``).

The accepting side is a forked child, the connecting side is the parent, and the parent does
the measuring. Connections are made *in* the processes that use them, as applications make them:
for ``smcd`` the child registers an SMC listener (``SmcServer``) and the parent calls
``smc_handoff.connect``, so every figure includes what an application really pays. The child
signals through a pipe once its listener is ready (for ``smcd``: registered with the daemon),
so the first connect can never race the registration and silently fall back to TCP.
"""

from __future__ import annotations

import contextlib
import os
import socket
import tempfile
import time
from collections.abc import Callable
from typing import Any, TypeVar

from _fork import NotOnSmc, fork_server

import smc_handoff

__all__ = ["KINDS", "Dialer", "Listener", "NotOnSmc", "run_pair"]

KINDS = ("tcp", "unix", "smcd")
CHILD_TIMEOUT = 30.0

T = TypeVar("T")


class Dialer:
    """The connecting side (the parent)."""

    def __init__(self, kind: str, address: Any, dmb_size: int = 0) -> None:
        self.kind = kind
        self.address = address
        self.dmb_size = dmb_size

    def dial(self) -> socket.socket:
        return self.dial_timed()[0]

    def dial_timed(self) -> tuple[socket.socket, int, int]:
        """A connected socket, the nanoseconds of the transport connect, and (``smcd`` only)
        those of the handoff + CLC handshake that followed it (``smc_handoff.wrap``)."""
        clock = time.perf_counter_ns
        t0 = clock()
        if self.kind == "unix":
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(self.address)
            return sock, clock() - t0, 0
        sock = socket.create_connection(self.address)
        t1 = clock()
        if self.kind == "tcp":
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return sock, t1 - t0, 0
        smc = smc_handoff.wrap(sock, dmb_size=self.dmb_size)
        t2 = clock()
        if smc.mode != "smcd":
            smc.close()
            raise NotOnSmc(f"client stayed on {smc.mode}: {smc.fallback}")
        return smc, t1 - t0, t2 - t1


class Listener:
    """The accepting side (the child)."""

    def __init__(self, kind: str, lsock: socket.socket, dmb_size: int = 0) -> None:
        self.kind = kind
        self.server: smc_handoff.SmcServer | socket.socket = lsock
        if kind == "smcd":
            self.server = server = smc_handoff.SmcServer(lsock, dmb_size=dmb_size)
            if not server.registered:
                raise NotOnSmc(f"listener not registered with smcd: {server.fallback}")

    def accept(self) -> socket.socket:
        conn, _ = self.server.accept()
        if self.kind == "tcp":
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        elif isinstance(conn, smc_handoff.SmcSocket) and conn.mode != "smcd":
            raise NotOnSmc(f"server stayed on {conn.mode}: {conn.fallback}")
        return conn


def _listen(kind: str, tmpdir: str) -> tuple[socket.socket, Any]:
    if kind == "unix":
        path = os.path.join(tmpdir, "bench.sock")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        lsock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        lsock.bind(path)
        lsock.listen(128)
        return lsock, path
    lsock = socket.create_server(("127.0.0.1", 0), backlog=128)
    return lsock, lsock.getsockname()


def run_pair(
    kind: str,
    client: Callable[[Dialer], T],
    server: Callable[[Listener], None],
    dmb_size: int = 0,
) -> T:
    """Fork; the child runs ``server(listener)``, the parent returns ``client(dialer)``.
    ``dmb_size`` is both ends' receive-buffer hint for smcd (0: the daemon's default).

    Raises :class:`NotOnSmc` (from either side) when smcd did not give a channel, and
    :class:`RuntimeError` when the child failed or hung.
    """
    with tempfile.TemporaryDirectory(prefix="smcd-bench-") as tmpdir:
        lsock, address = _listen(kind, tmpdir)

        def client_side() -> T:
            lsock.close()  # the child's now
            return client(Dialer(kind, address, dmb_size))

        try:
            return fork_server(
                lambda: Listener(kind, lsock, dmb_size),
                server,
                client_side,
                what=kind,
                off_smc="a connection stayed on TCP",
                timeout=CHILD_TIMEOUT,
            )
        finally:
            lsock.close()
