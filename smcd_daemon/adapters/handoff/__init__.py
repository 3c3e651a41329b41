"""The handoff server: where applications hand their TCP sockets to smcd and get an SMC channel
(or their unchanged TCP socket and a reason) back.

The protocol itself — framing, messages, descriptor lists, rules for both ends — is defined once,
in :mod:`smc_handoff.messages`; this package is the daemon's end of it, in parts:

- :mod:`.server` — the socket server and dispatcher: accepting handoff connections,
  ``SO_PEERCRED``, reading requests and routing them, the hang-up;
- :mod:`.handshake` — CONNECT/ACCEPT: the CLC handshake over the borrowed descriptor, SMC-D or
  SMC-R, and the FALLBACK reply;
- :mod:`.channels` — CHANNEL: the descriptors of SMC-D pairs and halves, whose life cycle is the
  pure :mod:`smcd_daemon.core.handoff_pairs`;
- :mod:`.registrations` — LISTEN and RESUME;
- :mod:`.observer` — the DMB observer: cursors, states and byte counts from the CDC headers;
- :mod:`.publisher` — registry records published late and in batches, deferred bookkeeping,
  lingering fallbacks, idle link groups freed;
- per-user caps and fair shares, checked before any CLC byte: :mod:`.gate` over the pure
  :mod:`smcd_daemon.core.admission`.

Release
    A half lets go of its DMB (unregister) and of its reference on the peer's (detach) when its
    connection hangs up; the pool takes a buffer back (and zeroes it) only when both halves have
    let go. When the last SMC connection is gone the daemon logs the pool's state.
"""

from __future__ import annotations

from .common import (
    HandoffError,
    HandoffStats,
    PeerCred,
    bind_seqpacket,
    fallback_message,
    peer_cred,
)
from .handshake import SmcrProvider
from .publisher import FALLBACK_LINGER
from .server import MAX_CLIENTS, HandoffServer

__all__ = [
    "FALLBACK_LINGER",
    "MAX_CLIENTS",
    "HandoffError",
    "HandoffServer",
    "HandoffStats",
    "PeerCred",
    "SmcrProvider",
    "bind_seqpacket",
    "fallback_message",
    "peer_cred",
]
