"""Peer detection as the daemon uses it: the loaded :class:`Detector`, or why there is none.

The handoff server asks :meth:`PeerDetection.peer` about each borrowed socket, as the kernel reads
``syn_smc`` / ``peer_has_smc``: False (the peer's SYN or SYN-ACK carried no SMC option) means
fall back at once with PEERNOSMC and no CLC byte; True means the peer speaks SMC (propose even
without ``peers``); None means detection has nothing to say (not loaded, socket not marked).
Listeners registered with LISTEN are marked here, so their SYN-ACKs answer a marked SYN.

Without a detector (not configured, capabilities missing, object not built, kernel refused)
everything answers None and :meth:`status` says why, for the log and ``smcctl info``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket

from smcd_daemon.adapters.bpf.detector import (
    DetectionUnavailable,
    Detector,
    ListenerMark,
    netns_cookie,
)
from smcd_daemon.errors import SmcError

__all__ = ["PURGE_INTERVAL", "PeerDetection"]

log = logging.getLogger(__name__)

PURGE_INTERVAL = 60.0
"""Seconds between sweeps of half-open SYN-ACK records (handshakes that never completed)."""


class PeerDetection:
    """The daemon's peer detection (see the module docstring). Use :meth:`start` or :meth:`off`."""

    def __init__(self, detector: Detector | None, reason: str) -> None:
        self.detector = detector
        self.reason = reason  # why there is no detector ("" when there is one)
        self._marks: dict[int, ListenerMark] = {}  # listener ident -> its mark
        self._ports: dict[tuple[int, int], int] = {}  # (netns, port) -> listeners holding it
        # (netns, port) -> unarmed listeners holding it: listeners created before the programs
        # were attached (e.g. the one whose LISTEN started a socket-activated smcd)
        self._unarmed: dict[tuple[int, int], int] = {}
        self.errors = 0

    @classmethod
    def off(cls, reason: str = "not started") -> PeerDetection:
        return cls(None, reason)

    @classmethod
    def start(cls, enabled: bool, cgroup: str | None = None) -> PeerDetection:
        """Load and attach the programs; never raises: a daemon without detection still runs
        (it uses ``peers``), and says so."""
        if not enabled:
            return cls.off("off (peer_detection = false in the configuration)")
        # $SMCD_BPF_CGROUP: attach below the root (tests: only their own processes)
        cgroup = cgroup or os.environ.get("SMCD_BPF_CGROUP") or None
        try:
            det = Detector.load(cgroup)
        except DetectionUnavailable as e:
            log.warning(
                "SMC peer detection unavailable: %s; SMC is tried only toward registered "
                "same-host listeners and the configuration's peers",
                e.reason,
            )
            return cls.off(e.reason)
        except Exception as e:  # a libbpf that cannot even be opened, and the like
            log.warning("SMC peer detection unavailable: %s", e)
            return cls.off(str(e))
        ids = ", ".join(str(i) for i in det.program_ids())
        log.info("SMC peer detection: BPF programs %s attached to %s", ids, det.cgroup)
        return cls(det, "")

    @property
    def available(self) -> bool:
        return self.detector is not None and not self.detector.closed

    def status(self) -> str:
        """One line for ``smcctl info`` (listed with the capabilities)."""
        if self.detector is None or self.detector.closed:
            return f"peer detection: unavailable: {self.reason}"
        ids = ", ".join(str(i) for i in self.detector.program_ids())
        return f"peer detection: TCP option via BPF (programs {ids} on {self.detector.cgroup})"

    # -- per socket ---------------------------------------------------------------------------

    def peer(self, fd: int) -> bool | None:
        """Did the peer's SYN-ACK (our client) / SYN (our server) carry the SMC option?"""
        det = self.detector
        if det is None or det.closed:
            return None
        try:
            return det.peer_has_option(fd)
        except (SmcError, OSError) as e:
            self.errors += 1
            log.warning("peer detection: reading socket %d: %s", fd, e)
            return None

    def peer_of_accepted(self, fd: int) -> bool | None:
        """:meth:`peer` for a socket accepted by a registered listener. The child of a listener
        that predates the programs records that its SYN-ACK carried no option, which says nothing
        of the client's SYN: detection knows nothing there (None), so decide as without it."""
        seen = self.peer(fd)
        if seen is not False or not self._unarmed:
            return seen
        sock = socket.socket(fileno=fd)
        try:
            key = (netns_cookie(sock), sock.getsockname()[1])
        except OSError:
            return seen
        finally:
            sock.detach()
        return None if key in self._unarmed else seen

    def mark_listener(self, sock: socket.socket, ident_hint: str = "") -> ListenerMark | None:
        """Register a listening socket (its SYN-ACKs then answer a marked SYN)."""
        det = self.detector
        if det is None or det.closed:
            return None
        try:
            mark = det.mark_listener(sock)
        except (SmcError, OSError) as e:
            self.errors += 1
            log.warning("peer detection: registering listener %s: %s", ident_hint, e)
            return None
        if not mark.armed:
            log.warning("peer detection: listener %s was created before the BPF program was "
                        "attached: its SYN-ACKs carry no SMC option, so kernel peers will not "
                        "try SMC with it (re-create the listening socket)", ident_hint)  # fmt: skip
        return mark

    def keep(self, ident: int, mark: ListenerMark | None) -> None:
        """Remember ``mark`` for the listener ``ident`` (:meth:`forget` unregisters it)."""
        if mark is None:
            return
        self._marks[ident] = mark
        key = (mark.netns, mark.port)
        self._ports[key] = self._ports.get(key, 0) + 1
        if not mark.armed:
            self._unarmed[key] = self._unarmed.get(key, 0) + 1

    def forget(self, ident: int) -> None:
        """The listener ``ident`` is gone: unregister its port once no listener holds it."""
        mark = self._marks.pop(ident, None)
        if mark is None:
            return
        key = (mark.netns, mark.port)
        if not mark.armed:
            if self._unarmed.get(key, 1) > 1:
                self._unarmed[key] -= 1
            else:
                self._unarmed.pop(key, None)
        left = self._ports.get(key, 1) - 1
        if left > 0:
            self._ports[key] = left
            return
        self._ports.pop(key, None)
        self._unmark(mark)

    def discard(self, mark: ListenerMark | None) -> None:
        """A mark that was never kept (the registration was refused)."""
        if mark is not None and (mark.netns, mark.port) not in self._ports:
            self._unmark(mark)

    def _unmark(self, mark: ListenerMark) -> None:
        det = self.detector
        if det is not None and not det.closed:
            try:
                det.unmark_listener(mark)
            except (SmcError, OSError) as e:
                self.errors += 1
                log.warning("peer detection: unregistering port %d: %s", mark.port, e)

    # -- life cycle ---------------------------------------------------------------------------

    async def housekeeping(self, interval: float = PURGE_INTERVAL) -> None:
        """Sweep records of SYN-ACKs whose handshakes never completed, forever."""
        while True:
            await asyncio.sleep(interval)
            det = self.detector
            if det is None or det.closed:
                return
            try:
                n = det.purge_half_open()
            except (SmcError, OSError) as e:
                log.warning("peer detection: purging half-open records: %s", e)
                continue
            if n:
                log.debug("peer detection: dropped %d half-open SYN-ACK records", n)

    def close(self) -> None:
        """Detach the programs (smcd stops)."""
        det = self.detector
        if det is not None and not det.closed:
            with contextlib.suppress(Exception):
                det.close()
            log.info("SMC peer detection: BPF programs detached")
        self._marks.clear()
        self._ports.clear()
        self._unarmed.clear()
