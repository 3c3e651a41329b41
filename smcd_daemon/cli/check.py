"""``smcctl check``: does SMC work toward a peer? (in the spirit of smc-tools' ``smc_chk``).

``smcctl check HOST PORT`` connects through smcd as an application would (``smc_handoff``) and
says what happened: whether our SYN asked for SMC's TCP option (peer detection loaded), the
transport the connection got (SMC-R, SMC-D or TCP), and for a fallback its reason code with
the explanation and the peer's diagnosis. When the peer is ``smcctl check --serve``, that server
tells its own view in a greeting line and echoes a checksummed 64 KiB payload, so both ends and
the data path are checked. Any other service is only connected to and closed (nothing sent).

``smcctl check --serve PORT`` is that server: it registers its listener with smcd, greets each
client with ``SMCCHK1 <json>`` (its mode, its fallback reason) and echoes until EOF.

Exit status of the client: 0 the connection runs on SMC, 2 it fell back to TCP, 1 it failed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import sys
import threading
import time
from typing import Any

__all__ = ["GREETING", "cmd_check", "register"]

GREETING = b"SMCCHK1 "
"""First bytes of what ``--serve`` sends each client, then a JSON object and a newline."""
PAYLOAD = 65536
MODES = {"smcr": "SMC-R", "smcd": "SMC-D", "tcp": "TCP"}


def register(sub: Any) -> None:
    p = sub.add_parser(
        "check",
        help="check SMC toward HOST PORT through smcd (or serve checks: --serve PORT)",
        description=__doc__.split("\n\n", 1)[1] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("host", nargs="?", metavar="HOST", help="server to check")
    p.add_argument("port", nargs="?", type=int, metavar="PORT", help="its TCP port")
    p.add_argument("--serve", type=int, metavar="PORT", help="run the check server on PORT")
    p.add_argument("--bind", default="0.0.0.0", metavar="ADDR", help="--serve: address")
    p.add_argument("--source", metavar="ADDR", help="client: local address to connect from")
    p.add_argument("--once", action="store_true", help="--serve: end after one client")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds per step (default 30)")
    p.add_argument("--json", action="store_true", default=argparse.SUPPRESS,
                   help="machine-readable output")  # fmt: skip
    p.set_defaults(func=cmd_check)


def cmd_check(args: argparse.Namespace) -> int:
    if args.serve is not None:
        return serve(args.bind, args.serve, once=args.once, timeout=args.timeout)
    if not args.host or args.port is None:
        print("smcctl check: give HOST PORT, or --serve PORT", file=sys.stderr)
        return 1
    result = check(args.host, args.port, source=args.source, timeout=args.timeout)
    if getattr(args, "json", False):
        print(json.dumps(result, indent=1))
    else:
        print(render(result))
    if "error" in result:
        return 1
    return 0 if result["mode"] in ("smcr", "smcd") else 2


def _fallback(sock: Any) -> dict[str, Any] | None:
    fb = sock.fallback
    if fb is None:
        return None
    out: dict[str, Any] = {"code": f"0x{fb.code:08x}", "name": fb.name, "detail": fb.explanation}
    if fb.peer_diagnosis is not None:
        out["peer_diagnosis"] = f"0x{fb.peer_diagnosis:08x}"
    try:
        from smcd_daemon.wire.reasons import explain

        ex = explain(fb.code)
        out["meaning"], out["advice"] = ex.meaning, ex.advice
        if fb.peer_diagnosis is not None:
            peer = explain(fb.peer_diagnosis)
            out["peer_name"], out["peer_meaning"] = peer.name, peer.meaning
    except Exception:  # an unknown code: the daemon's own words are enough
        pass
    return out


def check(
    host: str, port: int, *, source: str | None = None, timeout: float = 30.0
) -> dict[str, Any]:
    """Connect through smcd and describe the outcome (see the module docstring)."""
    import smc_handoff
    from smc_handoff import peer_option

    result: dict[str, Any] = {"host": host, "port": port}
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM)[0]
        raw = socket.socket(family, kind, proto)
        raw.settimeout(timeout)
        if source:
            raw.bind((source, 0))
        result["option_requested"] = peer_option.request_option(raw)
        t0 = time.monotonic()
        raw.connect(addr)
        result["tcp_ms"] = round((time.monotonic() - t0) * 1000, 1)
        local = raw.getsockname()
        result["local"] = f"{local[0]}:{local[1]}"
        t1 = time.monotonic()
        sock = smc_handoff.wrap(raw)
        result["handoff_ms"] = round((time.monotonic() - t1) * 1000, 1)
    except OSError as e:
        result["error"] = f"connect: {e}"
        return result
    with sock:
        result["mode"] = sock.mode
        fb = _fallback(sock)
        if fb is not None:
            result["fallback"] = fb
        try:
            _talk_to_server(sock, result, timeout)
        except (OSError, ValueError) as e:
            result["error"] = f"after connecting: {e}"
    return result


def _talk_to_server(sock: Any, result: dict[str, Any], timeout: float) -> None:
    """If the peer greets as ``--serve`` does, read its view and run the echo."""
    sock.settimeout(min(timeout, 1.0))  # the channel's data is not on the TCP descriptor:
    try:  # a timed recv, not select, waits for the greeting
        line = sock.recv(1)
    except TimeoutError:
        result["peer"] = "not an smcctl check server (no greeting within 1 s): connection only"
        return
    sock.settimeout(timeout)
    while line and not line.endswith(b"\n") and len(line) < 4096:
        chunk = sock.recv(1)
        if not chunk:
            break
        line += chunk
    if not line.startswith(GREETING):
        result["peer"] = "not an smcctl check server (it spoke first, something else)"
        return
    result["server"] = json.loads(line[len(GREETING) :])
    data = os.urandom(PAYLOAD)
    sock.sendall(data)
    got = bytearray()
    while len(got) < PAYLOAD:
        chunk = sock.recv(PAYLOAD - len(got))
        if not chunk:
            break
        got += chunk
    ok = hashlib.sha256(got).digest() == hashlib.sha256(data).digest()
    result["echo"] = f"{len(got)} bytes {'intact' if ok else 'DIFFER'}"
    if not ok:
        result["error"] = "the echo differs from what was sent"


def render(r: dict[str, Any]) -> str:
    lines = [f"check {r['host']} port {r['port']} through smcd"]
    if "local" in r:
        lines.append(f"  connected:   from {r['local']} (TCP {r.get('tcp_ms')} ms, "
                     f"handoff {r.get('handoff_ms')} ms)")  # fmt: skip
    if "option_requested" in r:
        lines.append(
            "  TCP option:  asked for on our SYN (peer detection is loaded)"
            if r["option_requested"]
            else "  TCP option:  not asked for (no peer detection: smcd uses its `peers`)"
        )
    if "mode" in r:
        lines.append(f"  transport:   {MODES.get(r['mode'], r['mode'])}")
    fb = r.get("fallback")
    if fb:
        lines.append(f"  fallback:    {fb['name']} ({fb['code']}): {fb['detail']}")
        if "meaning" in fb:
            lines.append(f"  meaning:     {fb['meaning']}")
            lines.append(f"  advice:      {fb['advice']}")
        if "peer_diagnosis" in fb:
            lines.append(f"  peer said:   {fb.get('peer_name') or ''} ({fb['peer_diagnosis']}) "
                         f"{fb.get('peer_meaning', '')}")  # fmt: skip
    if "server" in r:
        s = r["server"]
        view = MODES.get(s.get("mode", ""), s.get("mode"))
        lines.append(f"  server view: {view}" + (f", {s['fallback']}" if s.get("fallback") else ""))
    if "echo" in r:
        lines.append(f"  echo:        {r['echo']}")
    if "peer" in r:
        lines.append(f"  peer:        {r['peer']}")
    if "error" in r:
        lines.append(f"  error:       {r['error']}")
    return "\n".join(lines)


def serve(bind: str, port: int, *, once: bool = False, timeout: float = 30.0) -> int:
    """The check server (see the module docstring); runs until interrupted (or one client)."""
    import smc_handoff

    srv = smc_handoff.listen((bind, port), backlog=64)
    state = "registered with smcd" if srv.registered else f"NOT registered: {srv.fallback}"
    print(f"smcctl check server on {bind} port {port} ({state})", flush=True)
    try:
        while True:
            conn, addr = srv.accept()
            t = threading.Thread(target=_serve_one, args=(conn, addr, timeout), daemon=True)
            t.start()
            if once:
                t.join(timeout * 4)
                return 0
    finally:
        srv.close()


def _serve_one(conn: Any, addr: Any, timeout: float) -> None:
    with conn:
        fb = _fallback(conn)
        view = {"mode": conn.mode, "fallback": f"{fb['name']} ({fb['code']})" if fb else ""}
        print(f"{addr[0]} port {addr[1]}: {MODES.get(conn.mode, conn.mode)}"
              + (f" ({view['fallback']}: {fb['detail']})" if fb else ""), flush=True)  # fmt: skip
        conn.settimeout(timeout)
        try:
            conn.sendall(GREETING + json.dumps(view).encode() + b"\n")
            while chunk := conn.recv(1 << 16):
                conn.sendall(chunk)
        except OSError as e:
            print(f"{addr[0]} port {addr[1]}: {e}", flush=True)
