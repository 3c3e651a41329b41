"""CHANNEL: the two halves of an SMC-D (loopback-ism) connection meet, get their descriptors, and
let go. The transitions are :mod:`smcd_daemon.core.handoff_pairs`'; this module holds the
descriptors they talk about.

Both halves of one TCP connection meet in a *pair* keyed by the 4-tuple (and checked by the two
DMB tokens each half negotiated). The pair owns the two eventfds and the peer-link socketpair;
each half is sent its receive DMB, the peer's DMB, its eventfd, the peer's and its end of the
peer link. The DMB memfds handed out are the pool's own (each sized DMB + the channel's control
trailer), so reuse, zeroing and quotas apply to exactly what the applications map. The daemon
closes its copies of the eventfds and peer-link ends once both halves have theirs: it keeps only
the DMB memfds (in the pool) and the observer's views of their headers.
"""

from __future__ import annotations

import _socket as _csocket
import logging
import os
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from smc_handoff import messages as m
from smcd_daemon.core.buffers import UnknownTokenError
from smcd_daemon.core.channel_ledger import ChannelRecord
from smcd_daemon.core.handoff_pairs import (
    CloseLink,
    CloseShared,
    DmbOp,
    DmbRelease,
    Effect,
    Half,
    Pair,
    PairKey,
    PairTable,
    ReleaseDmbs,
    other_role,
)
from smcd_daemon.core.registry import (
    Connection,
    ConnMode,
    ConnRole,
    ConnState,
    LgrRole,
    LinkGroup,
    SmcType,
)
from smcd_daemon.errors import SmcError
from smcd_daemon.protocol.negotiate import FallbackOutcome, SmcdLoopbackOutcome
from smcd_daemon.wire.clc import HOSTNAME_LEN
from smcd_daemon.wire.reasons import DeclineReason

from .common import Client, log
from .gate import warn

if TYPE_CHECKING:
    from .server import HandoffServer

__all__ = ["Channels", "Draft", "PairFds"]

_ROLE_NAMES = {ConnRole.CLIENT: "client", ConnRole.SERVER: "server"}
"""The ledger's role names (``role.value.lower()`` without an enum property call per half)."""

Draft = dict[str, Any]
"""Keyword arguments of a :class:`Connection` known before the handshake's outcome."""


@dataclass(eq=False)
class PairFds:
    """The descriptors of one pair: each half's eventfd and peer-link end (the daemon's copies
    until the halves have theirs), and the pool's memfd of each DMB token."""

    ev: dict[ConnRole, int]
    link: dict[ConnRole, int]
    mem: dict[int, int]

    def close_link(self, role: ConnRole) -> None:
        fd = self.link.pop(role, None)
        if fd is not None:
            try:  # noqa: SIM105 (every connection's path: suppress() costs a context manager)
                os.close(fd)
            except OSError:
                pass

    def close_shared(self) -> None:
        """Close the daemon's copies of the eventfds and any peer-link end not handed out (the
        memfds belong to the pool). Again (a pair's end repeats it): nothing to do."""
        if not self.ev and not self.link:
            return
        for fd in [*self.ev.values(), *self.link.values()]:
            try:  # noqa: SIM105 (every connection's path: suppress() costs a context manager)
                os.close(fd)
            except OSError:
                pass
        self.ev.clear()
        self.link.clear()


class Channels:
    """SMC-D channels: their pairs (open to a second half) and their live halves."""

    def __init__(self, server: HandoffServer) -> None:
        self._srv = server
        self.pairs = PairTable()
        self.halves: dict[int, Half] = {}
        """Live halves with DMBs of ours, by connection id (what the observer refreshes)."""
        self._waiting: dict[PairKey, tuple[float, Pair]] = {}
        """Pairs opened by a first half, with the loop time by which the second is due (oldest
        first; :meth:`expire` drops the late ones: no timer per connection)."""

    @staticmethod
    def memfds(pair: Pair) -> dict[int, int]:
        """DMB token → the pool's memfd, for both DMBs of ``pair``."""
        fds: PairFds = pair.res
        return fds.mem

    def reply(
        self,
        client: Client,
        draft: Draft,
        role: ConnRole,
        key: PairKey,
        out: SmcdLoopbackOutcome,
    ) -> bool | FallbackOutcome:
        """Send ``client`` its CHANNEL; True if its connection now holds the half. When the
        channel cannot be built, the fallback to reply instead."""
        srv = self._srv
        conn_id = draft["conn_id"]
        tokens = (
            (out.local_token, out.peer_token)
            if role is ConnRole.CLIENT
            else (out.peer_token, out.local_token)
        )
        half = Half(
            conn_id, role, client.uid, out.local_token, out.peer_token,
            out.local_dmb_size, out.peer_dmb_size,
        )  # fmt: skip
        try:
            pair = self.pairs.claim(key, tokens, role)
            if pair is None:
                pair = self._make_pair(key, tokens)
            self.pairs.join(half, pair)
            fds: PairFds = pair.res
            send_fds = [
                fds.mem[out.local_token], fds.mem[out.peer_token],
                fds.ev[role], fds.ev[other_role(role)], fds.link[role],
            ]  # fmt: skip
        except (SmcError, OSError, KeyError) as e:
            srv.stats.errors += 1
            warn.error("no-channel", "handoff: %s: cannot build the channel: %s",
                                client.label, e)  # fmt: skip
            self.release(half)
            self.drop(key, str(e))
            return FallbackOutcome(int(DeclineReason.INTERR), None, True, f"daemon: {e}")
        client.half = half
        self.halves[conn_id] = half
        # What a restarted daemon verifies this half's RESUME against (.ledger_io), written
        # before the reply: a daemon killed right after it must still know the channel.
        record = ChannelRecord(
            conn_id, client.uid, _ROLE_NAMES[role], half.rx_size, half.tx_size, draft["inode"],
            f"{draft['local_addr']} {draft['local_port']}",
            f"{draft['peer_addr']} {draft['peer_port']}",
        )  # fmt: skip
        srv.journal.append(srv.ledger.add(record))
        reply = m.Channel(conn_id, m.Mode.SMCD, half.rx_size, half.tx_size)
        sent = srv.send(client, reply, send_fds)  # then the reply: the application waits for it
        srv.deferred.defer(self._count_channel, half, draft, out)
        # The half has its end of the peer link (or lost it): ours goes now.
        self._apply(self.pairs.hand_out(pair, role))
        if pair.complete:
            self._forget_waiting(key, pair)
        srv.observer.start()
        if not sent:
            srv.journal.append(srv.ledger.drop(conn_id))
            return False  # the end of the client's connection releases the half
        srv.stats.channels += 1
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "handoff: %s: SMC-D connection %d (%s, lgr %#x, rx %d, tx %d)",
                client.label, conn_id, role.value.lower(), out.link_id, half.rx_size, half.tx_size,
            )  # fmt: skip
        return True

    def _make_pair(self, key: PairKey, tokens: tuple[int, int]) -> Pair:
        """The shared part of a connection, made when its first half is ready: the pool's
        memfds of both DMBs (sized DMB + control trailer, exactly what the channel maps), two
        eventfds and the peer-link socketpair."""
        srv = self._srv
        mem = {t: srv.pool.get(t).fd for t in tokens}
        fds: list[int] = []
        try:
            flags = os.EFD_CLOEXEC | os.EFD_NONBLOCK
            ev_c = os.eventfd(0, flags)
            fds.append(ev_c)
            ev_s = os.eventfd(0, flags)
            fds.append(ev_s)
            # The C sockets: only their descriptors are kept (socket.socketpair wraps each in a
            # socket.socket, a Python object per end, to be detached again at once).
            a, b = _csocket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
            link_c, link_s = a.detach(), b.detach()
        except BaseException:
            m.close_fds(fds)
            raise
        res = PairFds(
            ev={ConnRole.CLIENT: ev_c, ConnRole.SERVER: ev_s},
            link={ConnRole.CLIENT: link_c, ConnRole.SERVER: link_s},
            mem=mem,
        )
        pair = self.pairs.open(key, tokens, res)
        assert srv.loop is not None
        self._waiting.pop(key, None)  # a reused key goes to the end: the order stays by time
        self._waiting[key] = (srv.loop.time() + srv.cfg.timeouts.clc_wait * 2 + 1.0, pair)
        return pair

    def _forget_waiting(self, key: PairKey, pair: Pair) -> None:
        entry = self._waiting.get(key)
        if entry is not None and entry[1] is pair:
            del self._waiting[key]

    def expire(self, now: float) -> None:
        """Drop the pairs whose second half did not arrive in time (the gate's tick calls this:
        a quarter second late at most, instead of a timer per connection)."""
        waiting = self._waiting
        while waiting:
            key, (due, pair) = next(iter(waiting.items()))
            if due > now:
                return
            del waiting[key]
            if self.pairs.get(key) is pair and not pair.complete:
                self.drop(key, "the other half never arrived")

    def drop(self, key: PairKey, why: str) -> None:
        """Forget a pair whose second half will not come: close what was not handed out (the
        first half then sees its peer link hang up: an abort, never a hang)."""
        pair = self.pairs.get(key)
        if pair is not None:
            self._forget_waiting(key, pair)
        effects = self.pairs.drop(key)
        if effects is None:
            return
        log.info("handoff: pairing %s dropped: %s", key, why)
        self._apply(effects)

    def _apply(self, effects: list[Effect]) -> None:
        for eff in effects:
            match eff:  # class patterns check the type without a call to isinstance each
                case CloseLink(pair, role):
                    fds: PairFds = pair.res
                    fds.close_link(role)
                case CloseShared(pair):
                    fds = pair.res
                    fds.close_shared()
                case ReleaseDmbs(releases):
                    self._release_dmbs(releases)

    def _release_dmbs(self, releases: tuple[DmbRelease, ...]) -> None:
        pool = self._srv.pool
        for op, token in releases:
            try:
                if op is DmbOp.UNREGISTER:
                    pool.unregister(token)
                else:
                    pool.detach(token)
            except UnknownTokenError:
                pass

    def _count_channel(self, half: Half, draft: Draft, out: SmcdLoopbackOutcome) -> None:
        """A channel's record and link group (deferred: the reply did not wait for them)."""
        srv = self._srv
        reg = srv.registry
        lgr_id = out.link_id
        srv.publisher.keep_lgr(lgr_id)
        if reg.link_group(lgr_id) is None:
            reg.add_link_group(
                LinkGroup(
                    lgr_id=lgr_id,
                    # the server half created it (first contact) unless the roles say otherwise
                    role=LgrRole.SERV
                    if (half.role is ConnRole.SERVER) == out.first_contact
                    else LgrRole.CLNT,
                    smc_type=SmcType.SMCD,
                    local_gid=srv.loopback.gid128.to_bytes(16, "big"),
                    peer_gid=out.peer_gid.to_bytes(16, "big"),
                    chid=out.chid,
                    netdev="lo",
                    smc_version=out.version,
                    smc_release=out.release,
                    peer_os=3,  # Linux
                    peer_hostname=srv.hostname[:HOSTNAME_LEN],
                    negotiated_eid=out.negotiated_eid,
                )
            )
        conn = Connection(
            **draft,
            mode=ConnMode.SMCD,
            state=ConnState.ACTIVE,
            lgr_id=lgr_id,
            token=half.conn_id & 0xFFFFFFFF,
            sndbuf_size=out.peer_dmb_size,
            rmbe_size=out.local_dmb_size,
            peer_rmbe_size=out.peer_dmb_size,
        )
        srv.publisher.add(conn)
        reg.stats.count_connection(SmcType.SMCD, half.role, out.version)

    # -- notices and release ------------------------------------------------------------------

    def notice(self, half: Half, msg: m.Shutdown | m.Close) -> None:
        """A SHUTDOWN or CLOSE the application sent (deferred)."""
        srv = self._srv
        conn = srv.publisher.connection(half.conn_id)
        if conn is None:
            return
        if isinstance(msg, m.Shutdown):
            if msg.how in (socket.SHUT_WR, socket.SHUT_RDWR) and conn.state is ConnState.ACTIVE:
                srv.publisher.update(half.conn_id, state=ConnState.PEERCLOSEWAIT1)
            return
        # CLOSE: the hang-up follows at once and removes the record; only the counters matter.
        srv.observer.last_counts(half)
        half.closed = True

    def hang_up(self, half: Half) -> None:
        """The half's handoff connection is gone: release it (deferred)."""
        self.halves.pop(half.conn_id, None)
        self._srv.deferred.defer(self._release_record, half)

    def _release_record(self, half: Half) -> None:
        """A hung-up half's bookkeeping: last counters, record, DMBs, link group."""
        srv = self._srv
        conn = srv.publisher.remove(half.conn_id)
        if conn is not None:
            if not half.closed:
                srv.observer.last_counts(half)
            if conn.lgr_id is not None:
                srv.publisher.maybe_free_lgr(conn.lgr_id)
        self.release(half)

    def release(self, half: Half) -> None:
        """Let go of this half's DMB and its reference on the peer's; the pool takes a buffer
        back once both halves have let go."""
        self._apply(self.pairs.release(half))

    def close(self) -> None:
        """The server stops: close what the open pairs hold."""
        self._waiting.clear()
        for pair in self.pairs.clear():
            fds: PairFds = pair.res
            fds.close_shared()
