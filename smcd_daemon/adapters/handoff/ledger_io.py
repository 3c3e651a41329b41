"""The channel ledger's journal file, and what RESUME's TCP descriptor shows (the evidence).

The journal (:mod:`smcd_daemon.core.channel_ledger`) lives next to the handoff socket
(``handoff.channels`` beside ``handoff.sock``: the runtime directory, tmpfs under systemd), mode
0600, opened without following symlinks. It is read once when the server starts (the previous
daemon's channel halves), rewritten at once with what may still be resumed, and then appended to
with one ``write`` per channel half handed out (tens of bytes: cheaper than anything else a
handshake does; a hang-up's line waits for the next write, :meth:`Journal.append_later`), and
rewritten whole when it holds many more lines than live
records. A journal that cannot be written costs only the verification of RESUMEs after the
next restart (they are then refused): logged once, never fatal.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import struct
import time
from pathlib import Path

from smcd_daemon.core.channel_ledger import ChannelLedger, ResumeEvidence
from smcd_daemon.transport.loopback import endpoint

__all__ = ["Journal", "journal_path", "resume_evidence"]

log = logging.getLogger(__package__ or __name__)

_TCP_STATE = struct.Struct("B")
_PENDING_MAX = 4096
"""Bytes of hang-up lines kept back at most before they are written anyway."""


def journal_path(handoff_socket: Path | None) -> Path | None:
    """Where the journal of the server on ``handoff_socket`` lives (None: nowhere)."""
    if handoff_socket is None:
        return None
    return handoff_socket.with_name(handoff_socket.stem + ".channels")


def address_text(addr: object) -> str:
    """``"address port"`` of a socket address, normalised as the pairing table does."""
    ip, port, _ = endpoint(addr)
    return f"{ip} {port}"


def resume_evidence(sock: socket.socket, uid: int) -> ResumeEvidence:
    """What the daemon reads from RESUME's descriptor itself (OSError if it cannot)."""
    raw = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_STATE.size)
    (state,) = _TCP_STATE.unpack_from(raw)
    return ResumeEvidence(
        uid=uid,
        inode=os.fstat(sock.fileno()).st_ino,
        tcp_state=state,
        local=address_text(sock.getsockname()),
        peer=address_text(sock.getpeername()),
    )


class Journal:
    """The ledger's file (see the module docstring)."""

    def __init__(self, path: Path | None, ledger: ChannelLedger) -> None:
        self.path = path
        self.ledger = ledger
        self._fd: int | None = None
        self._pending = b""  # hang-up lines not written yet (see append_later)
        if path is None:
            return
        now = time.monotonic()
        data = b""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                if os.fstat(fd).st_uid == os.geteuid():  # only our own journal is evidence
                    data = _read_all(fd)
            finally:
                os.close(fd)
        except FileNotFoundError:
            pass
        except OSError as e:
            log.warning("handoff: cannot read the channel journal %s: %s", path, e)
        bad = ledger.load(data, now)
        if bad:
            log.warning("handoff: channel journal %s: %d unreadable lines skipped", path, bad)
        if ledger.claimable:
            log.info("handoff: %d channel halves of the previous daemon may resume",
                     ledger.claimable)  # fmt: skip
        self._rewrite(ledger.compacted(now))

    def append(self, data: bytes | None) -> None:
        """Write ``data`` now (with any lines :meth:`append_later` kept back, in order)."""
        if self._pending:
            data, self._pending = self._pending + (data or b""), b""
        if not data or self._fd is None:
            return
        try:
            os.write(self._fd, data)
        except OSError as e:
            self._fail(e)
            return
        if self.ledger.needs_compaction:
            self._rewrite(self.ledger.compacted(time.monotonic()))

    def append_later(self, data: bytes | None) -> None:
        """Append ``data`` with the next write (:meth:`append`, :meth:`flush`): a hang-up's line.
        Only a half handed out must be on file before its reply; a drop that a crash loses
        leaves a record whose RESUME finds no matching socket, and it expires."""
        if data and self._fd is not None:
            self._pending += data
            if len(self._pending) >= _PENDING_MAX:
                self.flush()

    def flush(self) -> None:
        """Write what :meth:`append_later` kept back."""
        if self._pending:
            self.append(None)

    def compact(self) -> None:
        """Forget what expired and rewrite (e.g. from a periodic timer)."""
        if self._fd is not None and self.ledger.expire(time.monotonic()):
            self._rewrite(self.ledger.compacted(time.monotonic()))

    def _rewrite(self, data: bytes) -> None:
        assert self.path is not None
        self._pending = b""  # the rewrite is the ledger's whole state: kept-back lines included
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                         0o600)  # fmt: skip
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
            finally:
                os.close(fd)
            os.replace(tmp, self.path)
            new = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:
            self._fail(e)
            return
        old, self._fd = self._fd, new
        if old is not None:
            os.close(old)

    def _fail(self, e: OSError) -> None:
        log.warning("handoff: channel journal %s cannot be written (%s): channels made from now "
                    "on cannot be resumed after a restart", self.path, e)  # fmt: skip
        self.close()

    def close(self) -> None:
        if self._pending and self._fd is not None:
            with contextlib.suppress(OSError):
                os.write(self._fd, self._pending)
        self._pending = b""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)

    def remove(self) -> None:
        """A clean stop with no channel left: nothing to resume."""
        self.close()
        if self.path is not None and not self.ledger.live and not self.ledger.claimable:
            with contextlib.suppress(OSError):
                os.unlink(self.path)


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 1 << 20):
        chunks.append(chunk)
    return b"".join(chunks)
