"""A test application for the systemd VM: runs under ``smc-run`` as an unprivileged user.

It knows nothing of smcd (plain ``socket`` calls; smc-run upgrades them) and is driven over
stdin/stdout, one JSON object per line each way, so the test can keep connections open across
daemon restarts:

- ``{"op": "listen"}`` -> ``{"port": P}``: a blocking listener (registered with smcd by smc-run)
  whose accepted connections echo everything back;
- ``{"op": "plain-listen"}`` -> ``{"port": P}``: a listener that was non-blocking at ``listen()``,
  so smc-run leaves it unregistered (a client toward it falls back with PEERNOSMC);
- ``{"op": "connect", "port": P}`` -> ``{"id": N, "mode": ..., "fallback": ...}``;
- ``{"op": "echo", "id": N, "size": S}`` -> ``{"ok": true}`` after S bytes went there and back;
- ``{"op": "server-modes"}`` -> ``{"modes": [...]}`` of the accepted connections;
- ``{"op": "fds"}`` -> ``{"pid": ..., "memfds": [fd numbers whose link starts "/memfd:"]}``;
- ``{"op": "close", "id": N}``, ``{"op": "quit"}``.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
from typing import Any

conns: dict[int, socket.socket] = {}
server_modes: list[str] = []
listeners: list[socket.socket] = []


def _echo(conn: socket.socket) -> None:
    server_modes.append(str(getattr(conn, "mode", "plain")))
    with conn:
        while True:
            data = conn.recv(65536)
            if not data:
                return
            conn.sendall(data)


def _serve(srv: socket.socket) -> None:
    while True:
        try:
            conn, _ = srv.accept()
        except OSError:
            return
        threading.Thread(target=_echo, args=(conn,), daemon=True).start()


def _listen(plain: bool) -> int:
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", 0))
    if plain:
        srv.setblocking(False)
    srv.listen(16)
    srv.setblocking(True)
    listeners.append(srv)
    threading.Thread(target=_serve, args=(srv,), daemon=True).start()
    return int(srv.getsockname()[1])


def _echo_round(sock: socket.socket, size: int) -> None:
    """Send ``size`` bytes and read them back, both at once: an SMC ring is far smaller than
    loopback TCP's buffers, so sending everything before reading would deadlock on the echo."""
    payload = bytes(i % 251 for i in range(size))
    sender = threading.Thread(target=sock.sendall, args=(payload,), daemon=True)
    sender.start()
    got = bytearray()
    while len(got) < size:
        chunk = sock.recv(size - len(got))
        if not chunk:
            raise ConnectionError(f"EOF after {len(got)} of {size} bytes")
        got += chunk
    sender.join(timeout=60)
    if bytes(got) != payload:
        raise AssertionError("echoed bytes differ")


def handle(req: dict[str, Any]) -> dict[str, Any]:
    op = req["op"]
    if op in ("listen", "plain-listen"):
        return {"port": _listen(op == "plain-listen")}
    if op == "connect":
        sock = socket.create_connection(("127.0.0.1", req["port"]), timeout=120)
        n = len(conns) + 1
        conns[n] = sock
        fb = getattr(sock, "fallback", None)
        return {
            "id": n,
            "mode": str(getattr(sock, "mode", "plain")),
            "fallback": getattr(fb, "name", None) if fb is not None else None,
        }
    if op == "echo":
        _echo_round(conns[req["id"]], int(req["size"]))
        return {"ok": True}
    if op == "server-modes":
        return {"modes": list(server_modes)}
    if op == "fds":
        memfds = []
        for fd in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                continue
            if target.startswith("/memfd:"):
                memfds.append(int(fd))
        return {"pid": os.getpid(), "uid": os.getuid(), "memfds": memfds}
    if op == "close":
        conns.pop(req["id"]).close()
        return {"ok": True}
    raise ValueError(f"unknown op {op!r}")


def main() -> int:
    print(json.dumps({"ready": True, "pid": os.getpid()}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        if req.get("op") == "quit":
            break
        try:
            reply = handle(req)
        except Exception as e:
            reply = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(reply), flush=True)
    for sock in conns.values():
        sock.close()
    for srv in listeners:
        srv.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
