"""LISTEN and RESUME: what a handoff connection registers without a handshake.

LISTEN
    A listening TCP socket whose clients speak SMC (what lets CONNECT try SMC toward it). The
    daemon keeps no copy of the socket; the listener lives exactly as long as the handoff
    connection that registered it.
RESUME
    After a daemon restart the library re-registers a live channel: the daemon records it again
    (addresses from the TCP socket, byte counts from the library; it holds no copy of the DMBs,
    so no cursors) in the link group of its loopback-ism device, so ``smcctl`` shows it until
    the hang-up; the channel itself never depended on the daemon. Only what the previous daemon
    recorded resumes (:mod:`smcd_daemon.core.channel_ledger`: the id once, the user, the very
    TCP socket, role and buffer sizes), and the half's receive DMB counts against its user's
    quota again; anything else is refused with ERROR DENIED and recorded nowhere.
"""

from __future__ import annotations

import os
import socket
from typing import TYPE_CHECKING

from smc_handoff import messages as m
from smc_handoff.messages import ErrorCode
from smcd_daemon.adapters.netns_view import netns_label
from smcd_daemon.adapters.tcp_identity import netns_of
from smcd_daemon.core.buffers import DmbLimitError
from smcd_daemon.core.channel_ledger import Forged, ResumeClaim
from smcd_daemon.core.handoff_pairs import Half, Listener
from smcd_daemon.core.registry import (
    Connection,
    ConnMode,
    ConnRole,
    ConnState,
    LgrRole,
    LinkGroup,
    SmcType,
)
from smcd_daemon.transport.loopback import PairingError, endpoint
from smcd_daemon.wire.clc import HOSTNAME_LEN

from .common import Client, Refused, clip
from .gate import warn
from .ledger_io import resume_evidence

if TYPE_CHECKING:
    from .server import HandoffServer

__all__ = ["Registrations"]


class Registrations:
    """LISTEN and RESUME requests (see the module docstring)."""

    def __init__(self, server: HandoffServer) -> None:
        self._srv = server

    # -- LISTEN -------------------------------------------------------------------------------

    def listen(self, client: Client, fd: int) -> bool:
        """Register the listening socket ``fd``; True if the connection now holds it."""
        srv = self._srv
        try:
            sock = socket.socket(fileno=fd)
        except OSError as e:
            os.close(fd)
            raise Refused(m.Error(ErrorCode.BAD_FDS, f"not a socket: {e.strerror or e}")) from None
        try:
            if sock.family not in (socket.AF_INET, socket.AF_INET6) or (
                sock.type != socket.SOCK_STREAM
            ):
                raise Refused(m.Error(ErrorCode.BAD_FDS, "not a TCP socket"))
            if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                raise Refused(m.Error(ErrorCode.BAD_FDS, "the socket is not listening"))
            ip, port, _ = endpoint(sock.getsockname())
            inode = os.fstat(sock.fileno()).st_ino
            mark = srv.detection.mark_listener(sock, f"{ip} port {port}")  # SYN-ACKs: option
        except (OSError, PairingError) as e:
            raise Refused(m.Error(ErrorCode.BAD_FDS, clip(f"bad listener: {e}"))) from None
        finally:
            sock.close()  # the daemon keeps no copy
        cred = client.cred
        pid = cred.pid if cred else 0
        ns = netns_of(pid) if pid else None  # the listener's namespace (#15)
        conn = srv.registry.add_connection(
            Connection(
                conn_id=srv.registry.allocate_conn_id(),
                role=ConnRole.SERVER,
                mode=ConnMode.SMCD,
                state=ConnState.LISTEN,
                local_addr="" if ip.is_unspecified else str(ip),
                local_port=port,
                uid=cred.uid if cred else 0,
                pid=pid,
                inode=inode,
                netns=netns_label(ns),  # shown as a handed-over connection's is
            )
        )
        lst = srv.listeners.add(
            ip, port, client.uid, conn.conn_id, pid=pid, netns=ns[0] if ns else 0
        )
        srv.detection.keep(lst.ident, mark)
        client.listener = lst
        srv.stats.listeners += 1
        # A line each (rate-limited: a server may open a listener per transfer, as FTP does)
        warn.info("listener-registered", "handoff: %s registered listener %d on %s port %d",
                  client.label, lst.ident, ip, port)  # fmt: skip
        return srv.send(client, m.Ok(lst.ident))

    def unlisten(self, lst: Listener) -> None:
        """The listener's connection hung up."""
        srv = self._srv
        srv.listeners.remove(lst)
        srv.detection.forget(lst.ident)
        srv.publisher.remove(lst.conn_id)
        warn.info("listener-unregistered", "handoff: listener %d on port %d unregistered",
                  lst.ident, lst.port)  # fmt: skip

    # -- RESUME -------------------------------------------------------------------------------

    def resume(self, client: Client, req: m.Resume, fds: list[int]) -> bool:
        """Record a live channel again after a restart. The daemon gets no copy of its DMBs, so
        it shows the byte counts the library reports, and no cursors; the two halves meet in
        one link group of this daemon's loopback-ism device.

        Only SMC-D channels survive a restart: an SMC-R channel's data moved through the old
        daemon's queue pairs, so it died with them (the library aborts it) and is refused here
        rather than recorded as something it is not."""
        srv = self._srv
        if req.mode is not m.Mode.SMCD:
            m.close_fds(fds)
            raise Refused(
                m.Error(
                    ErrorCode.BAD_STATE,
                    f"RESUME of a {req.mode.name} channel: only SMC-D channels outlive the daemon",
                )
            )
        try:
            sock = socket.socket(fileno=fds[0])
        except OSError as e:
            m.close_fds(fds)
            raise Refused(m.Error(ErrorCode.BAD_FDS, f"not a socket: {e.strerror or e}")) from None
        try:
            if sock.type != socket.SOCK_STREAM or sock.family not in (
                socket.AF_INET,
                socket.AF_INET6,
            ):
                raise OSError("not a TCP socket")
            local, peer = endpoint(sock.getsockname()), endpoint(sock.getpeername())
            seen = resume_evidence(sock, client.uid)
        except (OSError, PairingError) as e:
            raise Refused(m.Error(ErrorCode.BAD_FDS, clip(f"RESUME: {e}"))) from None
        finally:
            sock.close()  # the daemon keeps no copy
        role = ConnRole.CLIENT if req.role is m.Role.CLIENT else ConnRole.SERVER
        claim = ResumeClaim(req.conn_id, role.value.lower(), True, req.rx_size, req.tx_size)
        conn_id = srv.registry.allocate_conn_id()
        record = srv.ledger.verify(claim, seen, conn_id)
        if isinstance(record, Forged):
            warn.warning("resume-refused", "handoff: %s: RESUME of connection %d refused: %s",
                         client.label, req.conn_id, record.value)  # fmt: skip
            raise Refused(m.Error(ErrorCode.DENIED, f"RESUME refused: {record.value}"))
        try:
            srv.pool.charge(client.uid, req.rx_size)
        except DmbLimitError as e:
            raise Refused(m.Error(ErrorCode.DENIED, clip(f"RESUME refused: {e}"))) from None
        inode = seen.inode
        lgr_id = self._loopback_lgr()
        cred = client.cred
        srv.registry.add_connection(
            Connection(
                conn_id=conn_id,
                role=role,
                mode=ConnMode.SMCD,
                state=ConnState.ACTIVE,
                local_addr=str(local[0]),
                local_port=local[1],
                peer_addr=str(peer[0]),
                peer_port=peer[1],
                netdev="lo" if peer[0].is_loopback else "",
                uid=cred.uid if cred else 0,
                pid=cred.pid if cred else 0,
                inode=inode,
                netns=netns_label(netns_of(cred.pid)) if cred and cred.pid else "",
                token=conn_id & 0xFFFFFFFF,
                lgr_id=lgr_id,
                sndbuf_size=req.tx_size,
                rmbe_size=req.rx_size,
                peer_rmbe_size=req.tx_size,
                bytes_sent=req.bytes_sent,
                bytes_received=req.bytes_received,
            )
        )
        client.half = Half(conn_id, role, client.uid, None, None, req.rx_size, req.tx_size)
        srv.journal.append(srv.ledger.add(record, replaces=req.conn_id))
        srv.stats.resumes += 1
        # rate-limited: after a restart every live channel resumes within seconds
        warn.info("resumed", "handoff: %s resumed connection %d as %d", client.label,
                  req.conn_id, conn_id)  # fmt: skip
        return srv.send(client, m.Ok(conn_id))

    def _loopback_lgr(self) -> int:
        """The link group of this daemon's loopback-ism device (made if need be), kept."""
        srv = self._srv
        gid = srv.loopback.gid128
        lgr_id = srv.loopback.link_groups.find(gid)
        if lgr_id is None:
            lgr_id = srv.loopback.link_groups.create(gid)
        if srv.registry.link_group(lgr_id) is None:
            gid_bytes = gid.to_bytes(16, "big")
            srv.registry.add_link_group(
                LinkGroup(
                    lgr_id=lgr_id,
                    role=LgrRole.SERV,
                    smc_type=SmcType.SMCD,
                    local_gid=gid_bytes,
                    peer_gid=gid_bytes,
                    chid=srv.loopback.chid,
                    netdev="lo",
                    smc_version=2,
                    peer_os=3,
                    peer_hostname=srv.hostname[:HOSTNAME_LEN],
                )
            )
        srv.publisher.keep_lgr(lgr_id)
        return lgr_id
