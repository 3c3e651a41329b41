"""CONNECT and ACCEPT: one CLC handshake over a borrowed TCP descriptor, to its reply.

CONNECT (client half)
    SMC is tried only toward peers known to speak it: a listener registered here whose address
    is the TCP peer's (a wildcard listener matches any local address of this network namespace),
    or an address in the configuration's ``peers``. Otherwise FALLBACK PEERNOSMC before a byte
    is written. Then the client half is entered in the loopback device's pairing table under its
    TCP 4-tuple and the CLC handshake runs over the borrowed descriptor (:mod:`..clc_io`).
ACCEPT (server half)
    The client's first bytes are peeked, never consumed, for a CLC eyecatcher, for at most
    ``timeouts.proposal_wait``: other bytes, silence (a client that waits for the server to speak)
    or EOF hand the socket back untouched with FALLBACK PEERNOSMC. A Proposal runs the server
    negotiation, which accepts loopback-ism only when the pairing table holds this connection's
    client half (matched 4-tuple, claimed once): never by GID alone.
SMC-R
    Tried only when the daemon hands this server an SMC-R provider (it has one only with
    ``modes.smcr_v1``/``smcr_v2`` on and an ACTIVE RDMA port), with a peer in the
    configuration's ``peers`` that is not reached through loopback (not an address of this
    host, unless policy routing sends traffic to it out of a real netdev) — on both halves.
    The service (:mod:`..smcr_service`) runs the whole handshake and adds its own registry
    record; the application gets a channel of mode SMCR whose peer is the daemon itself. An
    error raised by the service is logged and answered with FALLBACK SMC_CLC_DECL_INTERR.
Admission
    Before anything is read or written, the handshake is admitted (:mod:`.gate`): a user at their
    cap of handshakes in flight, past their fair share of a full daemon, or any user while the
    event loop runs late, gets a FALLBACK (MAX_DMB or DAEMON_BUSY) with the stream untouched,
    except toward a peer that showed the SMC TCP option: it waits for CLC and is declined first
    (:mod:`.predecline`).
Same-host pairs
    Toward a listener registered here the client half proposes only once the server half is in
    the daemon (:mod:`.arrivals`); otherwise it falls back before any CLC byte. With both
    halves here, the client half runs the CLC of both (:func:`..clc_io.drive_pair`: every
    message through the TCP connection, no peek and no decoding of what smcd itself wrote),
    whichever half arrived first: a server half registers itself while it waits or looks for
    the Proposal, and the client half that comes takes it.
FALLBACK
    With the negotiator's reason (kernel codes; PEERDECL plus the peer's diagnosis when the peer
    declined). Past a quota: SMC_CLC_DECL_MAX_DMB, with the user's usage and the quota keys.
Abort
    Once CLC has begun, a handshake that ends where the kernel would fail the connection (a CLC
    timeout, a protocol violation, the peer's EOF: :attr:`FallbackOutcome.kernel_errno`) is not
    handed back: its TCP connection is reset before the FALLBACK (flagged not
    ``after_decline``), so the library reports an error and a late Accept or Decline of the peer
    can never be read as data. Only a fallback before any CLC byte, or after a Decline both
    ends processed, leaves the stream to the application.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ipaddress
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from smc_handoff import messages as m
from smc_handoff.handoff import reset as reset_tcp
from smc_handoff.messages import ErrorCode
from smcd_daemon.adapters.clc_io import (
    BorrowedTcp,
    BorrowedTcpError,
    PeekResult,
    drive,
    drive_pair,
    peek_proposal,
)
from smcd_daemon.adapters.netns_view import dnat_target, local_in
from smcd_daemon.adapters.ratelimit import FALLBACK_LOG_BURST, RateLimitedLog
from smcd_daemon.adapters.tcp_identity import (
    NetnsId,
    SocketNetns,
    connection_identity,
    netns_name,
)
from smcd_daemon.core.handoff_pairs import IpAddress, Listener, PairKey
from smcd_daemon.core.registry import Connection, ConnMode, ConnRole, ConnState
from smcd_daemon.errors import SmcError
from smcd_daemon.protocol.negotiate import (
    ClientNegotiation,
    FallbackOutcome,
    NegotiationFacts,
    ServerNegotiation,
    SmcdLoopbackOutcome,
    Step,
)
from smcd_daemon.transport.loopback import Endpoint, LoopbackSession, PairingError, endpoint
from smcd_daemon.wire.cursor import Cursor
from smcd_daemon.wire.reasons import DeclineReason

from .arrivals import Arrivals
from .channels import Draft
from .common import Client, Refused, clip, configured_peer, fallback_message, log, reason_name
from .gate import fallback_for, warn
from .predecline import refused

if TYPE_CHECKING:
    from smcd_daemon.adapters.smcr_service import SmcrChannel, SmcrService

    from .server import HandoffServer

__all__ = ["Handshakes", "SmcrProvider"]

SmcrProvider = Callable[[], "SmcrService | None"]
"""Gives the SMC-R service when SMC-R may be tried now (modes on, an ACTIVE RDMA port), else
None; the daemon builds the service on first use."""

fallback_lines = RateLimitedLog(log, burst=FALLBACK_LOG_BURST, period=60.0)
"""Each fallback's line with its reason in words, at most :data:`FALLBACK_LOG_BURST` a minute
per reason (see there)."""
_NO_RDMA_DECLINES = (int(DeclineReason.NOSMCRDEV), int(DeclineReason.NOSMCDEV))
"""What the SMC-D server negotiation declines a Proposal with when it offered SMC-R."""
_MAX_DMB = int(DeclineReason.MAX_DMB)
UNMARKED_GRACE = 0.02
"""Seconds a server half waits for a same-host client's Proposal (without peer detection)
before it asks whether the client's socket carries the handoff mark: an smcd client marks it
before its CONNECT, microseconds after ``connect()``; a plain one never does."""
_PLAIN_LOCAL_CLIENT = (
    f"no CLC Proposal within {UNMARKED_GRACE:g} s and the client's socket on this host carries "
    "no handoff mark: a plain TCP client (e.g. one that waits for the server to speak first)"
)
_ZERO = Cursor()
_OWN_NETNS = os.stat("/proc/self/ns/net").st_ino
_ZERO_CURSORS = {"rx_prod": _ZERO, "rx_cons": _ZERO, "tx_prod": _ZERO, "tx_cons": _ZERO}
"""Cursors of a new record (one shared frozen zero cursor instead of four new ones)."""


class PairedTcp(BorrowedTcp):
    """A borrowed socket whose other end may be a half this daemon serves on the same loop.

    Once ``paired`` is set (the other half is known to be ours and running its handshake), a
    read for the answer to what we just wrote first gives the loop one turn: the other half,
    queued on this turn, reads our message and writes its answer, which our read then finds
    at once instead of registering a wait, a timer and a wake-up (two loop turns each). When
    the answer is not there after that turn, the read waits as any other."""

    paired = False
    _answer_due = False
    ends: tuple[Endpoint, Endpoint]
    """``(local, peer)`` normalised once (:func:`endpoint`), for everything that compares them."""

    async def write_all(self, data: bytes, timeout: float) -> None:
        await super().write_all(data, timeout)
        self._answer_due = self.paired

    async def read_exactly(self, n: int, timeout: float) -> bytes:
        if self._answer_due:
            self._answer_due = False
            await asyncio.sleep(0)
        return await super().read_exactly(n, timeout)


def _routed_out(service: SmcrService, local: IpAddress, peer: IpAddress) -> bool:
    """Does traffic from ``local`` to ``peer`` (an address of this host) leave through a real
    netdev? Normally not (the local table sends it through ``lo``: loopback-ism territory); only
    policy routing that sends it out on a wire (two simulated hosts in one namespace) does."""
    if not (isinstance(local, ipaddress.IPv4Address) and isinstance(peer, ipaddress.IPv4Address)):
        return False
    route = service.routing.lookup_route(local, peer)
    if route is None or route.oif is None:
        return False
    dev = service.routing.netdev(route.oif)
    return dev is not None and dev.name != "lo"


def pair_key(sock: socket.socket, local: Any, peer: Any, *, client: bool) -> PairKey:
    """The key both halves of a same-host connection meet by (:mod:`.arrivals`, the loopback
    sessions): the kernel's identity of the connection (its two ISNs, .tcp_identity), which
    holds across namespaces and DNAT where addresses do not; else the (client, server)
    endpoints. ``local``/``peer`` are this half's ``getsockname()``/``getpeername()``."""
    ends = (endpoint(local), endpoint(peer))
    ident = connection_identity(sock, active=client)
    if ident is not None:
        return ident
    return ends if client else (ends[1], ends[0])


def _hung_up(sock: socket.socket) -> bool:
    """Has the application hung up its handoff connection? (It sends nothing after its
    request: whatever is readable now is the hang-up.)"""
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except (BlockingIOError, InterruptedError):
        return False
    except OSError:
        return True


HalfOutcome = SmcdLoopbackOutcome | FallbackOutcome


@dataclass(frozen=True)
class _Concluded:
    """A server half's handoff ended by its client half (:meth:`Handshakes._run_pair`): replied,
    and ``kept`` as :meth:`Handshakes.handoff` returns it."""

    kept: bool


@dataclass(eq=False)
class _ServerHalf:
    """A server half whose client half waits in this daemon: that client half runs the CLC of
    both (:func:`~smcd_daemon.adapters.clc_io.drive_pair`), replies to both and sets ``outcome``
    to :class:`_Concluded`; or to None when it does not (this half then runs its own, as any
    other)."""

    client: Client
    hint: int
    tcp: PairedTcp
    key: PairKey
    draft: Draft
    outcome: asyncio.Future[_Concluded | None]


class Handshakes:
    """CONNECT and ACCEPT, each to its reply (see the module docstring)."""

    def __init__(self, server: HandoffServer) -> None:
        self._srv = server
        self._facts_cache: dict[tuple[int, bool], NegotiationFacts] = {}
        self._ip_texts: dict[int, tuple[object, str, bool]] = {}
        self.arrivals = Arrivals()
        self._ns_names: dict[int, str] = {}
        self._sock_netns = SocketNetns()
        self._servers: dict[PairKey, _ServerHalf] = {}
        """Server halves whose client half runs both CLC sides (:class:`_ServerHalf`)."""
        server.loopback.policy = self._may_pair

    def _netns(self, client: Client, sock: socket.socket | None = None) -> NetnsId | None:
        """The network namespace of the process that handed a connection over (its inode and
        ``ip netns`` name, looked up once per inode), None if unknown (another pid namespace).
        Read once per handoff connection (the record and the pairing both ask), from the
        handed-over socket ``sock`` when given (:class:`..tcp_identity.SocketNetns`)."""
        if client.netns_read:
            return client.netns
        client.netns = self._read_netns(client, sock)
        client.netns_read = True
        return client.netns

    def _read_netns(self, client: Client, sock: socket.socket | None) -> NetnsId | None:
        cred = client.cred
        if cred is None or not cred.pid:
            return None
        inode = self._sock_netns.inode(sock) if sock is not None else None
        if inode is None:
            try:
                inode = os.stat(f"/proc/{cred.pid}/ns/net").st_ino
            except OSError:
                return None
        name = self._ns_names.get(inode)
        if name and name != "host" and not _named(name, inode):
            name = None  # namespaces die and their inodes come back: the name went with it
        if not name:
            if len(self._ns_names) >= 1024:
                self._ns_names.clear()
            name = self._ns_names[inode] = "host" if inode == _OWN_NETNS else netns_name(inode)
        return inode, name

    def _may_pair(self, client: LoopbackSession, server: LoopbackSession) -> str | None:
        """``namespaces.groups``: why the two proven halves may not pair (None: they may). A
        namespace reaches itself; with no groups configured every one reaches every other."""
        groups = self._srv.cfg.namespaces.groups
        a, b = client.owner, server.owner
        if not groups or (a is not None and b is not None and a[0] == b[0]):
            return None
        if a is None or b is None:
            return "the network namespace of a half is unknown and namespaces.groups is set"
        for group in groups:
            if {str(a[0]), a[1]} & set(group) and {str(b[0]), b[1]} & set(group):
                return None
        return (
            f"namespaces.groups puts the client's namespace {_ns_text(a)} and the server's "
            f"{_ns_text(b)} in no common group"
        )

    def reconfigure(self) -> None:
        """A reloaded configuration: what we offer is built anew."""
        self._facts_cache.clear()

    def _facts(self, dmb_hint: int, *, peer_speaks_smc: bool = True) -> NegotiationFacts:
        """What we offer for this handshake. Facts only change with the configuration (the EID
        table is shared by reference), so they are built once per (hint, peer) and reused."""
        key = (dmb_hint, peer_speaks_smc)
        facts = self._facts_cache.get(key)
        if facts is not None:
            return facts
        srv = self._srv
        cfg = srv.cfg
        facts = NegotiationFacts.from_config(
            cfg,
            srv.eids,
            srv.loopback.ism_device() if cfg.modes.smcd_loopback else None,
            hostname=srv.hostname,
            peer_speaks_smc=peer_speaks_smc,
        )
        if dmb_hint:
            size = min(max(dmb_hint, cfg.buffers.min_dmb_size), cfg.buffers.max_dmb_size)
            facts = dataclasses.replace(facts, dmb_size=size)
        if len(self._facts_cache) >= 64:
            self._facts_cache.clear()  # hints are the applications' choice: stay bounded
        self._facts_cache[key] = facts
        return facts

    def _peer_speaks_smc(self, peer: Endpoint) -> tuple[str | None, bool]:
        """Why we may try SMC toward ``peer`` (None: we may not), and whether that is a
        listener registered here (its server half is ours: :mod:`.arrivals`)."""
        srv = self._srv
        ip, port, _ = peer
        why = srv.listeners.why_smc(ip, port, srv.local_addresses.is_local, self._local_to)
        if why is not None:
            return why, True
        net = configured_peer(srv.cfg.peers, ip)
        return (f"configured peer network {net}", False) if net is not None else (None, False)

    def _local_to(self, lst: Listener, ip: IpAddress) -> bool:
        """Is ``ip`` an address of ``lst``'s network namespace (the daemon's, or another one
        of this host whose listener registered here: #15)?"""
        if not lst.netns or lst.netns == _OWN_NETNS or not lst.pid:
            return self._srv.local_addresses.is_local(ip)
        return local_in(lst.pid, ip)

    async def _published(self, client: Client, tcp: BorrowedTcp) -> tuple[str | None, bool]:
        """No listener at the peer's address: is it a published (DNAT'ed) port of a listener
        registered here from another namespace? Looked up in the connection tracking tables
        only while such listeners exist (:mod:`..netns_view`)."""
        if not self._srv.listeners.in_other_netns(_OWN_NETNS):
            return None, False
        cred = client.cred
        real = await dnat_target(tcp.local, tcp.peer, cred.pid if cred else 0)
        if real is None:
            return None, False
        why, ours = self._peer_speaks_smc(endpoint(real))
        if why is None:
            return None, False
        return f"{why} behind a DNAT of {tcp.peer[0]} port {tcp.peer[1]}", ours

    def _ip_text(self, ip: IpAddress) -> tuple[str, bool]:
        """``(str(ip), ip.is_loopback)``, remembered per address object (endpoints share them;
        hashing an address goes through its text)."""
        known = self._ip_texts.get(id(ip))
        if known is not None and known[0] is ip:
            return known[1], known[2]
        if len(self._ip_texts) >= 4096:
            self._ip_texts.clear()
        text, lo = str(ip), ip.is_loopback
        self._ip_texts[id(ip)] = (ip, text, lo)
        return text, lo

    def _new_connection(self, client: Client, role: ConnRole, tcp: PairedTcp) -> Draft:
        """The fields of a handoff's registry record known up front; the record itself is
        built once, when the outcome is known (one object, one event)."""
        local, peer = tcp.ends
        cred = client.cred
        peer_text, peer_lo = self._ip_text(peer[0])
        return {
            "conn_id": self._srv.registry.allocate_conn_id(),
            "role": role,
            "local_addr": self._ip_text(local[0])[0],
            "local_port": local[1],
            "peer_addr": peer_text,
            "peer_port": peer[1],
            "netdev": "lo" if peer_lo else "",
            "uid": cred.uid if cred else 0,
            "netns": _ns_text(ns)
            if (ns := self._netns(client, tcp.sock)) and ns[0] != _OWN_NETNS
            else "",
            "pid": cred.pid if cred else 0,
            "inode": tcp.inode,
            **_ZERO_CURSORS,
        }

    def server_refused(self, fd: int, why: str) -> tuple[bool, PairKey | None]:
        """An ACCEPT refused at the gate (its accepted TCP socket ``fd``, no loop work): tell a
        client half of ours parked for it, as a refused handshake does (:meth:`handoff`). True
        when one was: it falls back without a CLC byte, so no Proposal is coming. With the
        pair's key, for the wait of :func:`.predecline.refused` (None: none could be made)."""
        sock = socket.socket(fileno=fd)
        try:
            key = pair_key(sock, sock.getsockname(), sock.getpeername(), client=False)
        except (OSError, PairingError):
            return False, None
        finally:
            sock.detach()
        return self.arrivals.server_gone(key, fell_back=True, why=why), key

    async def handoff(self, client: Client, req: m.Connect | m.Accept, fd: int) -> bool:
        """Run one handoff to its reply; True if the connection now holds a channel half."""
        srv = self._srv
        role = ConnRole.CLIENT if isinstance(req, m.Connect) else ConnRole.SERVER
        try:
            tcp = PairedTcp(fd, srv.loop)
        except BorrowedTcpError as e:
            srv.stats.invalid += 1
            warn.warning("bad-tcp", "handoff: %s from %s: %s", req.TYPE.name, client.label, e)
            raise Refused(m.Error(ErrorCode.BAD_FDS, clip(str(e)))) from None
        try:
            tcp.ends = (endpoint(tcp.local), endpoint(tcp.peer))
            draft = self._new_connection(client, role, tcp)
        except PairingError as e:
            tcp.close()
            raise Refused(m.Error(ErrorCode.BAD_FDS, clip(str(e)))) from None
        key = pair_key(tcp.sock, *tcp.ends, client=role is ConnRole.CLIENT)
        assert srv.loop is not None
        denied = srv.admission.begin_handshake(client.uid, srv.loop.time())
        if denied is not None:  # before any CLC byte: the stream is the application's
            # Our own client half, parked for this server half, learns it fell back and sends
            # nothing: no Proposal is coming, so the refusal does not wait for one.
            ours = role is ConnRole.SERVER and self.arrivals.server_gone(
                key, fell_back=True, why=denied.detail
            )
            warn.info(f"busy-{denied.refusal.name.lower()}", "handoff: %s: %s refused: %s",
                      client.label, req.TYPE.name, denied.detail)  # fmt: skip
            fb = fallback_for(denied)  # a peer that showed the SMC option is declined (#11)
            try:
                out, reset = await refused(srv, tcp, server=role is ConnRole.SERVER,
                                           code=fb.code, detail=denied.detail,
                                           client_told=ours, key=key)  # fmt: skip
            finally:
                tcp.close()
            return self.reply_fallback(client, draft, out, aborted=reset)
        outcome: HalfOutcome | SmcrChannel | _Concluded
        try:
            if role is ConnRole.CLIENT:
                outcome = await self._run_client(client, req.dmb_size, tcp, key)
            else:
                proposing = self.arrivals.server_in(key)
                outcome = await self._run_server(client, req.dmb_size, tcp, key, draft, proposing)
        except BaseException:
            tcp.close()
            if role is ConnRole.SERVER:
                self.arrivals.server_gone(key, fell_back=False)
            raise
        finally:
            srv.admission.end_handshake(client.uid)
        if isinstance(outcome, _Concluded):
            return outcome.kept  # its client half replied to it (_run_pair)
        return self._conclude(client, draft, role, key, tcp, outcome)

    def _conclude(
        self,
        client: Client,
        draft: Draft,
        role: ConnRole,
        key: PairKey,
        tcp: PairedTcp,
        outcome: HalfOutcome | SmcrChannel,
    ) -> bool:
        """A handshake's end: the TCP connection reset where the kernel would fail it, the
        server half's arrival settled, our copy of the socket closed, the reply sent."""
        srv = self._srv
        aborted = False
        if isinstance(outcome, FallbackOutcome) and _must_abort(outcome):
            # CLC began and the kernel would fail the connection here: reset it, so neither
            # application can read what is left of CLC as data (see the module docstring).
            reset_tcp(tcp.sock)
            aborted = True
        if role is ConnRole.SERVER:
            clean = (
                isinstance(outcome, FallbackOutcome)
                and outcome.local
                and not (outcome.declined or aborted or outcome.peer_diagnosis is not None)
            )
            self.arrivals.server_gone(key, fell_back=clean, why=_why(outcome))
        tcp.close()  # every copy of the borrowed descriptor is gone before we reply
        # The one place where the negotiated outcome picks the transport of the reply.
        if not isinstance(outcome, FallbackOutcome | SmcdLoopbackOutcome):
            return self._reply_smcr(client, outcome)
        if isinstance(outcome, FallbackOutcome):
            srv.channels.drop(key, "the other half fell back")
            kept = self.reply_fallback(client, draft, outcome, aborted=aborted)
        else:  # SMC-D, loopback-ism
            done = srv.channels.reply(client, draft, role, key, outcome)
            kept = done if isinstance(done, bool) else self.reply_fallback(client, draft, done)
        srv.deferred.idle_soon()
        return kept

    def _smcr_toward(self, tcp: BorrowedTcp, *, detected: bool | None = None) -> SmcrService | None:
        """The SMC-R service if SMC-R is to be tried on ``tcp``: its peer showed the SMC TCP
        option (``detected``) or is in the configuration's ``peers``, and is not reached
        through loopback, while the provider has a service (modes, an ACTIVE RDMA port)."""
        srv = self._srv
        if srv.smcr is None or not (srv.cfg.peers or detected):
            return None
        local, peer = endpoint(tcp.local)[0], endpoint(tcp.peer)[0]
        if not detected and not any(
            peer.version == net.version and peer in net for net in srv.cfg.peers
        ):
            return None
        try:
            service = srv.smcr()
            if service is None or (
                srv.local_addresses.is_local(peer) and not _routed_out(service, local, peer)
            ):
                return None
            return service
        except Exception as e:
            srv.stats.errors += 1
            warn.error("smcr-unavailable", "handoff: the SMC-R service is unavailable; using "
                       "SMC-D/TCP: %s: %s", type(e).__name__, e)  # fmt: skip
            log.debug("handoff: the SMC-R service's error", exc_info=e)
            return None

    def _why_no_smcr(self, tcp: BorrowedTcp) -> str:
        """Why :meth:`_smcr_toward` did not offer ``tcp`` to SMC-R, in an operator's words (the
        SMC-D negotiation can only say "no device" to a Proposal that wanted SMC-R)."""
        srv = self._srv
        modes = srv.cfg.modes
        if not (modes.smcr_v1 or modes.smcr_v2):
            return "SMC-R is switched off here (modes.smcr_v1 and modes.smcr_v2 are false)"
        if srv.smcr is None:
            return "this daemon runs without SMC-R"
        peer = endpoint(tcp.peer)[0]
        if not any(peer.version == net.version and peer in net for net in srv.cfg.peers):
            return f"the peer {peer} is not in the configuration's peers"
        return "no RDMA port is ACTIVE (smcctl device), or the peer is reached through loopback"

    async def _run_smcr(
        self, client: Client, hint: int, tcp: BorrowedTcp, service: SmcrService, *, server: bool
    ) -> SmcrChannel | FallbackOutcome:
        """One SMC-R handshake through ``service`` (on a copy of the borrowed descriptor, which
        the service closes). Any error it raises is logged and becomes a fallback."""
        cred = client.cred
        uid, pid = client.uid, cred.pid if cred else 0
        fd = os.dup(tcp.fd)
        try:
            ns = self._netns(client)  # its netdev and PNET entries are that namespace's (#15)
            if server:
                return await service.accept(fd, rmb_size=hint, uid=uid, pid=pid, netns=ns)
            return await service.connect(fd, rmb_size=hint, uid=uid, pid=pid, netns=ns)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self._srv.stats.errors += 1
            what = "accept" if server else "connect"
            warn.error("smcr-failed", "handoff: SMC-R %s with %s failed: %s: %s", what, tcp.peer,
                       type(e).__name__, e)  # fmt: skip
            log.debug("handoff: the SMC-R handshake's error", exc_info=e)
            return FallbackOutcome(int(DeclineReason.INTERR), None, True, clip(f"daemon: {e}"))

    def _reply_smcr(self, client: Client, out: SmcrChannel) -> bool:
        """CHANNEL of mode SMCR: the service already recorded the connection. The handoff
        connection stays open (so the library does not take a hang-up for a daemon restart) but
        holds nothing: the daemon sees closes on the peer link it keeps."""
        reply = m.Channel(out.conn_id, m.Mode.SMCR, out.fds.rx_size, out.fds.tx_size)
        try:
            sent = self._srv.send(client, reply, out.fds.fds())
        finally:
            out.fds.close()  # the daemon keeps its own end of the peer link
        if not sent:
            return False  # the application's end of the peer link is gone: the service sees it
        client.smcr_conn = out.conn_id
        self._srv.stats.channels += 1
        log.debug("handoff: %s: SMC-R connection %d (lgr %#x, link %d)", client.label,
                  out.conn_id, out.lgr_id, out.link_id)  # fmt: skip
        return True

    async def _run_client(
        self, client: Client, hint: int, tcp: PairedTcp, key: PairKey
    ) -> SmcdLoopbackOutcome | FallbackOutcome | SmcrChannel:
        srv = self._srv
        peer = tcp.ends[1]
        why, ours = self._peer_speaks_smc(peer)
        if why is None:
            why, ours = await self._published(client, tcp)
        detected = srv.detection.peer(tcp.fd)
        if detected:
            why = why or "the peer's SYN-ACK carried the SMC TCP option"
        elif srv.detection.available and not srv.listeners.why_smc(
            peer[0], peer[1], srv.local_addresses.is_local
        ):
            # As the kernel's smc_connect: no option from the peer, no CLC byte. A socket our
            # SYN did not mark (None) is no better: a detecting peer takes it for plain TCP.
            detail = (
                "the peer's SYN-ACK carried no SMC TCP option (RFC 7609): it does not speak SMC"
                if detected is False
                else "this socket's SYN carried no SMC TCP option (it was connected before "
                "smc_handoff could mark it), so a detecting peer takes it for plain TCP"
            )
            return FallbackOutcome(int(DeclineReason.PEERNOSMC), None, True, detail)
        if why is not None:
            service = self._smcr_toward(tcp, detected=detected)
            if service is not None:
                log.debug("handoff: trying SMC-R toward %s: %s", tcp.peer, why)
                return await self._run_smcr(client, hint, tcp, service, server=False)
        server: _ServerHalf | None = None
        try:
            if ours:  # a same-host pair: propose only once the server half is here
                srv.admission.park_handshake(client.uid)  # waiting for an accept() is no CLC work
                try:
                    not_yet = await self.arrivals.wait_server(key, srv.cfg.timeouts.clc_wait)
                finally:
                    srv.admission.unpark_handshake(client.uid)
                    server = self._servers.pop(key, None)
                if not_yet is not None:
                    return FallbackOutcome(int(DeclineReason.PEERNOSMC), None, True, not_yet)
                if _hung_up(client.sock):
                    # Its application closed the connection while it waited (a port check, or a
                    # close() that gave the handoff up): no CLC for nobody, and with the last copy
                    # of the TCP socket closed the server half reads TCP's EOF at once.
                    self.arrivals.unpropose(key)
                    detail = "the application closed the connection before its server half came"
                    return FallbackOutcome(int(DeclineReason.PEERNOSMC), None, True, detail)
                tcp.paired = True  # its server half answers on the loop turn we write on
            session = srv.loopback.session(
                client.uid, *tcp.ends, server=False, key=key, owner=self._netns(client)
            )
            facts = self._facts(hint, peer_speaks_smc=why is not None)
            if why is not None:
                log.debug("handoff: trying SMC toward %s: %s", tcp.peer, why)
                try:
                    srv.loopback.pairing.register_client(*tcp.ends, key=key)
                except PairingError as e:
                    warn.warning("pairing", "handoff: %s; offering no device", e)
                    facts = dataclasses.replace(facts, loopback=None)
            negotiation = ClientNegotiation(facts, session)
            first = negotiation.start()
            if server is not None and first.outcome is None and not server.outcome.done():
                both, server = server, None
                return await self._run_pair(negotiation, tcp, first, both)
            if server is not None:  # it runs its own CLC: our Proposal is there when it looks
                _settle(server.outcome, None)
                server = None
            try:
                return await drive(negotiation, tcp, first)
            finally:
                with contextlib.suppress(PairingError):
                    srv.loopback.pairing.withdraw(*tcp.ends, key=key)
        finally:
            if server is not None:
                _settle(server.outcome, None)

    async def _run_pair(
        self, negotiation: ClientNegotiation, tcp: PairedTcp, first: Step, server: _ServerHalf
    ) -> HalfOutcome:
        """Both halves of a same-host pair on this client half's turn (:func:`drive_pair`):
        the server half gets its outcome through ``server.outcome``."""
        srv = self._srv
        s_tcp = server.tcp
        try:
            owner = self._netns(server.client)
            session = srv.loopback.session(server.client.uid, *s_tcp.ends, server=True,
                                           key=server.key, owner=owner)  # fmt: skip
            s_neg = ServerNegotiation(self._facts(server.hint), session)
            tcp.paired = s_tcp.paired = False  # no loop turn for an answer: we write it ourselves
            mine, theirs = await drive_pair(negotiation, tcp, s_neg, s_tcp, first)
        except BaseException:
            server.outcome.cancel()  # its handoff ends as ours does (the library sees no reply)
            raise
        finally:
            with contextlib.suppress(PairingError):
                srv.loopback.pairing.withdraw(*tcp.ends, key=server.key)
        if server.outcome.done():
            # Its handoff ended while the two waited on a socket (the daemon stops, or it
            # expired): nobody replies for it, and what it was granted goes back.
            if isinstance(theirs, SmcdLoopbackOutcome):
                with contextlib.suppress(SmcError):
                    session.detach_dmb(theirs.peer_token)
                with contextlib.suppress(SmcError):
                    session.unregister_dmb(theirs.local_token)
            return mine
        # Its reply first, ours right after, on this turn: the server application is the one
        # that waits for data first, and a loop turn between the two replies is a turn later
        # for the whole connection.
        theirs = self._no_smcr_said(s_tcp, theirs)
        try:
            kept = self._conclude(server.client, server.draft, ConnRole.SERVER, server.key,
                                  s_tcp, theirs)  # fmt: skip
        except Exception as e:  # its task reports it, as its own handshake's error
            server.outcome.set_exception(e)
        else:
            server.outcome.set_result(_Concluded(kept))
        return mine

    async def _run_server(
        self,
        client: Client,
        hint: int,
        tcp: PairedTcp,
        key: PairKey,
        draft: Draft,
        proposing: bool = False,
    ) -> SmcdLoopbackOutcome | FallbackOutcome | SmcrChannel | _Concluded:
        """``proposing``: our client half was waiting for this one and proposes on its next
        step; one loop turn lets it write first, so the peek finds the Proposal at once (no
        wait registered, no timer, no wake-up)."""
        srv = self._srv
        detected = srv.detection.peer_of_accepted(tcp.fd)
        if detected is False:  # the kernel's smc_listen_work without syn_smc: no wait
            detail = "the client's SYN carried no SMC TCP option (RFC 7609): a plain TCP client"
            return FallbackOutcome(int(DeclineReason.PEERNOSMC), None, True, detail)
        half: _ServerHalf | None = None
        if self._smcr_toward(tcp, detected=detected) is None:
            # Our client half, here or still to come, runs both halves' CLC (:meth:`_run_pair`);
            # when it cannot, it has written its Proposal by the time we look for it.
            assert srv.loop is not None
            half = _ServerHalf(client, hint, tcp, key, draft, srv.loop.create_future())
            self._servers[key] = half
        elif proposing:
            await asyncio.sleep(0)  # our client half proposes on its next step: let it
        if half is not None and proposing:  # it takes us on its next step, whatever it does
            both = await self._taken(half)
            if both is not None:
                return both
            half = None
        # a client whose SYN carried the option sends CLC (a Proposal, or a Decline when it
        # falls back): wait for it as the kernel does, up to the CLC timer (#11)
        timeouts = srv.cfg.timeouts
        wait = timeouts.clc_wait if detected else timeouts.proposal_wait
        local = detected is None and self._same_host(client, tcp) and not proposing
        if local and timeouts.local_client_wait < wait:
            wait = timeouts.local_client_wait
        if local and wait > UNMARKED_GRACE:
            first = await self._peek(tcp, UNMARKED_GRACE, half)
            if not isinstance(first, PeekResult):
                return first
            seen = first
            if seen.kind == "silent":
                if not self.arrivals.proposed(key) and self._plain_local_client(tcp):
                    return FallbackOutcome(
                        int(DeclineReason.PEERNOSMC), None, True, _PLAIN_LOCAL_CLIENT
                    )
                seen = await peek_proposal(tcp, wait - seen.waited)
        else:
            first = await self._peek(tcp, wait, half)
            if not isinstance(first, PeekResult):
                return first
            seen = first
        if seen.kind == "silent" and local:
            # A client half whose CONNECT the loop read in the turn our timer fired starts on
            # the next turn: let it, so that a stalled loop does not cost that pair its SMC.
            await asyncio.sleep(0)
        if seen.kind == "silent" and (self.arrivals.proposed(key) or srv.backlogged()):
            # our client half is proposing right now (it saw us here), or may still wait in
            # the daemon's listen queue (a busy daemon): wait for it, up to the CLC timer
            seen = await peek_proposal(tcp, srv.cfg.timeouts.clc_wait)
        if seen.kind != "smc":
            timer = (
                "timeouts.clc_wait: its SYN carried the option"
                if detected
                else "timeouts.local_client_wait: a client on this host"
                if wait == timeouts.local_client_wait and local
                else "timeouts.proposal_wait"
            )
            detail = {
                "not-smc": "the client's first bytes are not a CLC Proposal: a plain TCP client",
                "silent": f"no CLC Proposal within {wait:g} s ({timer}): a plain "
                "TCP client, or one that waits for the server to speak first",
                "eof": "the client closed the connection without proposing SMC",
            }[seen.kind]
            return FallbackOutcome(int(DeclineReason.PEERNOSMC), None, True, detail)
        service = self._smcr_toward(tcp, detected=detected)
        if service is not None:
            return await self._run_smcr(client, hint, tcp, service, server=True)
        session = srv.loopback.session(
            client.uid, *tcp.ends, server=True, key=key, owner=self._netns(client)
        )
        tcp.paired = self.arrivals.proposed(key)  # our client half: it answers on our turn
        out = await drive(ServerNegotiation(self._facts(hint), session), tcp)
        return self._no_smcr_said(tcp, out)

    async def _taken(self, half: _ServerHalf) -> _Concluded | None:
        """A server half waits for the client half that takes it (:meth:`_run_client`): its
        handoff ended by that one, or None when that one proposes by itself."""
        try:
            return await half.outcome
        finally:
            if self._servers.get(half.key) is half:
                del self._servers[half.key]

    async def _peek(
        self, tcp: PairedTcp, wait: float, half: _ServerHalf | None
    ) -> PeekResult | _Concluded:
        """:func:`peek_proposal` for a server half that our client half may take meanwhile
        (``half``, registered): then its handoff ended by that one, unless the client proposed
        by itself. Once the look ends otherwise, no client half takes it any more."""
        if half is None:
            return await peek_proposal(tcp, wait)
        try:
            seen = await peek_proposal(tcp, wait, half.outcome)
        except BaseException:
            if self._servers.get(half.key) is half:
                del self._servers[half.key]
            else:  # taken: the pair's driver gives back what it would have granted us
                half.outcome.cancel()
            raise
        if self._servers.get(half.key) is half:
            del self._servers[half.key]  # from here on no client half takes it
            return seen
        both = await half.outcome  # done, but for a pair still waiting on a socket
        if both is not None:
            return both
        return await peek_proposal(tcp, max(wait - seen.waited, 0.0))  # its Proposal is there

    def _no_smcr_said(self, tcp: BorrowedTcp, out: HalfOutcome) -> HalfOutcome:
        """A server half's outcome, with why SMC-R was not tried when the Proposal wanted it
        (only a Proposal with SMC-R is declined NOSMCRDEV/NOSMCDEV on this path)."""
        if isinstance(out, FallbackOutcome) and out.reason in _NO_RDMA_DECLINES and out.local:
            why = self._why_no_smcr(tcp)
            out = dataclasses.replace(out, detail=f"{why}, so SMC-R was not tried; {out.detail}")
        return out

    def _plain_local_client(self, tcp: BorrowedTcp) -> bool:
        """The client's socket is in this daemon's namespace and carries no handoff mark: its
        program is not handing it over (:mod:`smcd_daemon.adapters.handoff_mark`)."""
        marks, peer, local = self._srv.marks, tcp.peer[:2], tcp.local[:2]
        marked = marks.client_marked(tcp.sock, peer, local)
        if marked is None and peer[0].startswith("::ffff:") and local[0].startswith("::ffff:"):
            # a dual-stack listener's IPv4 client: its own socket is AF_INET
            marked = marks.client_marked(tcp.sock, (peer[0][7:], peer[1]), (local[0][7:], local[1]))
        return marked is False

    def _same_host(self, client: Client, tcp: BorrowedTcp) -> bool:
        """Is the client of this accepted connection on this host (a loopback address, or an
        address of this daemon's namespace while the server is in it too) and not a configured
        peer? A peer in ``peers`` may be another SMC stack on this host (simulated hosts in one
        namespace, the kernel's AF_SMC), whose Proposal comes when it comes."""
        ip = endpoint(tcp.peer)[0]
        if self._srv.cfg.peers and configured_peer(self._srv.cfg.peers, ip) is not None:
            return False
        if self._ip_text(ip)[1]:
            return True
        ns = self._netns(client)
        return ns is not None and ns[0] == _OWN_NETNS and self._srv.local_addresses.is_local(ip)

    def reply_fallback(
        self, client: Client, draft: Draft, outcome: FallbackOutcome, *, aborted: bool = False
    ) -> bool:
        """FALLBACK: the application keeps its TCP socket (``aborted``: the daemon reset it; the
        library sees the stream touched without a Decline and reports an error). The record
        stays visible for :data:`~.publisher.FALLBACK_LINGER` seconds (the daemon cannot see it
        closed)."""
        srv = self._srv
        srv.stats.fallbacks += 1
        code = outcome.reason
        # The reply first (the application waits for it), the bookkeeping after.
        crossed = outcome.declined or outcome.peer_diagnosis is not None  # a Decline ended CLC
        diag = outcome.peer_diagnosis
        detail = outcome.detail
        if _MAX_DMB in (code, diag) and "quota." not in detail:
            detail = f"{detail}; {self._quota_text(client.uid)}"
        if aborted:
            detail = f"{detail}; the connection was reset, as the kernel fails it once CLC began"
        reply = fallback_message(code, detail, diag, after_decline=crossed and not aborted)
        srv.send(client, reply)
        conn = Connection(
            **draft,
            mode=ConnMode.TCP,
            state=ConnState.ACTIVE,
            fallback_reason=outcome.reason,
            peer_diagnosis=outcome.peer_diagnosis or 0,
        )
        srv.publisher.add(conn)  # counts the fallback in the stats once published
        srv.publisher.linger(conn.conn_id)
        fallback_lines.info(
            f"stays-on-tcp {reason_name(code)}",
            "handoff: %s stays on TCP: %s (0x%08x%s): %s",
            client.label,
            reason_name(code),
            code,
            "" if outcome.peer_diagnosis is None else f", peer 0x{outcome.peer_diagnosis:08x}",
            detail,
        )
        return False

    def _quota_text(self, uid: int) -> str:
        """This user's DMB usage against its quota, for a MAX_DMB fallback's explanation (the
        decline itself only says MAX_DMB; a loopback peer's is our own pool's)."""
        srv = self._srv
        use = srv.pool.user_usage(uid)
        quota = srv.cfg.quota
        return (
            f"here uid {uid} holds {use.buffers} DMBs of {use.bytes >> 10} KiB "
            f"(quota.connections allows {quota.connections or 'any number'}, "
            f"quota.buffer_bytes {quota.buffer_bytes >> 10 if quota.buffer_bytes else 'any'} KiB)"
        )


def _settle(fut: asyncio.Future[_Concluded | None], value: _Concluded | None) -> None:
    if not fut.done():
        fut.set_result(value)


def _named(name: str, inode: int) -> bool:
    try:
        return os.stat(f"/run/netns/{name}").st_ino == inode
    except OSError:
        return False


def _ns_text(ns: NetnsId) -> str:
    return f"{ns[0]} {ns[1]}" if ns[1] else str(ns[0])


def _must_abort(outcome: FallbackOutcome) -> bool:
    """Did CLC begin and end where the kernel fails the connection (not in a Decline from the
    peer, whose stream both ends then processed)?"""
    return outcome.kernel_errno is not None and outcome.peer_diagnosis is None


def _why(outcome: object) -> str:
    return outcome.detail if isinstance(outcome, FallbackOutcome) else "it went SMC"
