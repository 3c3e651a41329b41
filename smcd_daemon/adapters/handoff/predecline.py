"""A Decline before a fallback toward a peer that showed the SMC TCP option.

A peer whose SYN or SYN-ACK carried the RFC 7609 option (peer detection says True) now waits
for CLC: a kernel AF_SMC server reads its client's first bytes as a Proposal, a kernel client
sends one. Falling back without a word would hand it the application's data as CLC (it declines
into the stream or resets). The kernel's own client declines first (``__smc_connect`` →
``smc_connect_decline_fallback`` → ``smc_clc_send_decline`` whenever ``syn_smc`` was set), and
its server reads the Proposal before it declines (``smc_listen_work``). smcd does the same for
every fallback it decides before the Proposal (a refusal at the gate, admission, a quota):

- client half (:func:`decline_now`): send a Decline carrying the fallback's reason (v2, as we
  would have proposed v2; id_for_peer zero: no SMC-R link group is involved), then answer
  FALLBACK ``after_decline``: the peer consumes the Decline and falls back with PEERDECL, the
  stream is the application's again. A Decline that cannot be sent whole resets the connection,
  as any failure once CLC began.
- server half (:func:`decline_proposal`): wait for the client's Proposal, take it off the
  stream and answer it with the Decline; a client that declined first has its Decline taken off
  instead (PEERDECL). A client that sends no CLC at all within the wait leaves the stream
  untouched. A Proposal is due (:func:`proposal_due`) from a client whose SYN carried the option,
  whatever its address (a kernel AF_SMC client on this host, or in a VM sharing init_net, is
  declined as the kernel's ``smc_listen_work`` would: not answered by a reset), and from one
  whose address is in the configuration's ``peers``: its daemon proposes whether or not peer
  detection runs on either side. The wait: the CLC timer for a remote client that showed the
  option; ``proposal_wait`` (the handshake's own wait for a Proposal not known to be coming) for
  a configured peer and for a same-host client. A same-host client may be this daemon's own
  client half, which sends nothing when it learns that its server half fell back
  (:mod:`.arrivals`), or declines first when it is refused itself (:func:`refused_connect`: the
  wait ends on that Decline); when it is already parked for its server half, the refusal tells
  it and does not wait at all (``Arrivals.server_gone`` says so); when it arrives later, it
  reads the fall-back, sends nothing, and that ends the wait (``Arrivals.heard``); a kernel
  client proposes right after its TCP handshake. One that
  proposes after the wait is answered by the library's first read
  (``smc_handoff.handoff.answer_late_proposal``). Without this a refused server half (cap,
  admission, gate) would hand its application a stream whose first bytes are a Proposal (#14).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import socket
from typing import TYPE_CHECKING

from smc_handoff import messages as m
from smc_handoff.handoff import reset as reset_tcp
from smcd_daemon.adapters.clc_io import BorrowedTcp, peek_proposal
from smcd_daemon.core.handoff_pairs import IpAddress, PairKey
from smcd_daemon.protocol.negotiate import FallbackOutcome
from smcd_daemon.protocol.negotiate.outcome import decline_message
from smcd_daemon.transport.loopback import PairingError, endpoint
from smcd_daemon.wire.clc_base import ClcType
from smcd_daemon.wire.clc_decline import Decline
from smcd_daemon.wire.reasons import DeclineReason

from .common import configured_peer, fallback_message

if TYPE_CHECKING:
    from smcd_daemon.adapters.bpf.peers import PeerDetection

    from .server import HandoffServer

__all__ = [
    "MAX_CLC",
    "decline_bytes",
    "decline_now",
    "decline_proposal",
    "proposal_due",
    "refused",
    "refused_accept",
    "refused_connect",
]

MAX_CLC = 4096
"""No CLC message we answer is longer (a Proposal with its extensions is well below)."""
_SEND_FLAGS = socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL


def decline_bytes(code: int, version: int = 2) -> bytes:
    """Our Decline for a fallback decided before any CLC message (id_for_peer zero)."""
    return decline_message(code, version, bytes(8)).encode()


def decline_now(fd: int, code: int) -> str | None:
    """Client half: write the Decline on the connected TCP socket ``fd`` without blocking (a
    fresh connection's send buffer takes it whole). None when it was sent; else why not (the
    caller resets the connection: a part of a Decline in the stream would corrupt it)."""
    sock = socket.socket(fileno=fd)
    try:
        data = decline_bytes(code)
        sent = sock.send(data, _SEND_FLAGS)
    except OSError as e:
        return e.strerror or errno.errorcode.get(e.errno or 0, str(e))
    finally:
        sock.detach()
    if sent != len(data):
        return f"only {sent} of the Decline's {len(data)} bytes fit the send buffer"
    return None


async def decline_proposal(
    tcp: BorrowedTcp,
    code: int,
    detail: str,
    wait: float,
    heard: asyncio.Future[None] | None = None,
) -> FallbackOutcome | None:
    """Server half refused before its Proposal (see the module docstring): the outcome, or None
    when no CLC came within ``wait`` seconds (or other bytes, or EOF), or ``heard`` was done
    first (our own client half read the fall-back: no CLC is coming): the stream is untouched.
    Raises OSError/TimeoutError when the exchange broke off midway (the caller resets)."""
    if heard is None:
        seen = await peek_proposal(tcp, wait)
    else:  # the look only peeks: stopping it midway consumes nothing
        look = asyncio.ensure_future(peek_proposal(tcp, wait))
        try:
            await asyncio.wait((look, heard), return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not look.done():
                look.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await look
            if not heard.done():
                heard.cancel()
        if look.cancelled():
            return None
        seen = look.result()
    if seen.kind != "smc":
        return None
    head = await tcp.read_exactly(8, wait)
    length = int.from_bytes(head[5:7], "big")
    if not 8 <= length <= MAX_CLC:
        raise OSError(errno.EPROTO, f"a CLC header announcing {length} bytes")
    body = await tcp.read_exactly(length - 8, wait) if length > 8 else b""
    if head[4] == ClcType.DECLINE:
        try:
            diag: int | None = Decline.decode(head + body).diagnosis
        except Exception:
            diag = None
        why = f"the client declined before we could ({detail})"
        return FallbackOutcome(int(DeclineReason.PEERDECL), diag, False, why, declined=False)
    version = 1 if head[7] >> 4 == 1 else 2  # as the Proposal spoke (smc_listen_decline)
    await tcp.write_all(decline_bytes(code, version), wait)
    return FallbackOutcome(code, None, True, f"declined the Proposal: {detail}", declined=True)


def proposal_due(srv: HandoffServer, fd: int, peer: str) -> float | None:
    """A refused server half on ``fd`` (its client at ``peer``): how long to wait for the
    client's CLC, or None when none is due (see the module docstring). A client whose SYN
    carried the option sends CLC wherever it is; one on this host without it is this daemon's
    own client half (or no SMC client at all), which falls back without a byte when its server
    half did (:mod:`.arrivals`)."""
    detected = srv.detection.peer(fd) is True
    try:
        ip: IpAddress | None = endpoint((peer, 0))[0]  # a v6 IPv4 client becomes IPv4
    except PairingError:
        ip = None
    local = ip is None or srv.local_addresses.is_local(ip)
    if detected:  # as the kernel's smc_listen_work: syn_smc means CLC follows
        return srv.cfg.timeouts.proposal_wait if local else srv.cfg.timeouts.clc_wait
    if ip is None or local or configured_peer(srv.cfg.peers, ip) is None:
        return None
    return srv.cfg.timeouts.proposal_wait


async def refused(
    srv: HandoffServer,
    tcp: BorrowedTcp,
    *,
    server: bool,
    code: int,
    detail: str,
    client_told: bool,
    key: PairKey | None,
) -> tuple[FallbackOutcome, bool]:
    """A handshake refused before any CLC byte (admission, a quota): its outcome, and whether
    the connection was reset (see the module docstring). A client half declines only toward a
    peer that showed the option (a configured peer that did not may run no SMC at all: a Decline
    would be data to it); a server half declines every Proposal that is due, unless its client
    half is our own and was told it fell back (``client_told``), or reads that it did when it
    arrives (the pair ``key``'s :meth:`~.arrivals.Arrivals.heard`): that one sends no CLC."""
    plain = FallbackOutcome(code, None, True, detail)
    if server:
        if client_told:
            return plain, False
        wait = proposal_due(srv, tcp.fd, tcp.peer[0])
        if wait is None:
            return plain, False
        heard = srv.handshakes.arrivals.heard(key) if key is not None else None
        try:
            out = await decline_proposal(tcp, code, detail, wait, heard)
        except Exception as e:  # a broken exchange of any kind: reset
            reset_tcp(tcp.sock)
            return FallbackOutcome(code, None, True, f"{detail}; CLC broke off: {e!r}"), True
        return (out or plain), False
    if srv.detection.peer(tcp.fd) is not True:
        return plain, False
    why = decline_now(tcp.fd, code)
    if why is None:
        sent = f"{detail}; the peer showed the SMC TCP option, so it was sent a Decline"
        return FallbackOutcome(code, None, True, sent, declined=True), False
    reset_tcp(tcp.sock)
    return FallbackOutcome(code, None, True, f"{detail}; the Decline failed: {why}"), True


def refused_connect(detection: PeerDetection, fd: int, code: int) -> bool | None:
    """A CONNECT answered at the gate (its TCP descriptor ``fd`` in hand, no event loop work):
    True when a Decline was sent (answer ``after_decline``), False when none was due, None when
    it failed and the connection was reset."""
    if detection.peer(fd) is not True:
        return False
    if decline_now(fd, code) is None:
        return True
    sock = socket.socket(fileno=fd)
    try:
        reset_tcp(sock)
    finally:
        sock.detach()
    return None


_LATER: set[asyncio.Task[None]] = set()
"""Refused server halves declining their client's Proposal (kept from the garbage collector)."""


def refused_accept(
    srv: HandoffServer,
    conn: socket.socket,
    fd: int,
    reply: m.Fallback,
    key: PairKey | None,
) -> bool:
    """An ACCEPT answered at the gate whose client is sending a Proposal (:func:`proposal_due`):
    True when a task now owns ``conn`` and ``fd``, reads and declines the Proposal, then answers
    ``reply`` (``after_decline`` if CLC crossed) and closes both; ``key`` (the pair's, from
    ``Handshakes.server_refused``) ends that wait when our own client half reads the fall-back.
    False: answer at once (no Proposal due, no running loop)."""
    if srv.loop is None or not srv.loop.is_running():
        return False
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        return False
    try:
        peer = sock.getpeername()[0]
    except (OSError, IndexError):
        return False
    finally:
        sock.detach()
    if proposal_due(srv, fd, peer) is None:
        return False
    task = srv.loop.create_task(_accept_later(srv, conn, fd, reply, key))
    _LATER.add(task)
    task.add_done_callback(_LATER.discard)
    return True


async def _accept_later(
    srv: HandoffServer, conn: socket.socket, fd: int, reply: m.Fallback, key: PairKey | None
) -> None:
    try:
        tcp = BorrowedTcp(fd)  # owns fd from here
    except Exception:
        conn.close()
        return
    try:
        out, _reset = await refused(
            srv, tcp, server=True, code=reply.code, detail=reply.explanation,
            client_told=False, key=key,
        )  # fmt: skip
        tcp.close()
        crossed = out.declined or out.peer_diagnosis is not None
        answer = fallback_message(out.reason, out.detail, out.peer_diagnosis, after_decline=crossed)
        with contextlib.suppress(OSError, m.HandoffClosedError):
            m.send_message(conn, answer)
    finally:
        tcp.close()
        conn.close()
