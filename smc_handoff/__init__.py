"""smc_handoff: the application side of smcd (standard library only).

``connect``/``wrap``/``listen`` give :class:`SmcSocket`\\ s, TCP sockets whose data moves over
shared memory once smcd took them over, and plain TCP with ``.fallback`` set otherwise (also
when no daemon runs). :mod:`smc_handoff.aio` has the asyncio streams, ``smc-run``
(:mod:`smc_handoff.run`) upgrades unmodified programs, :mod:`smc_handoff.messages` defines the
handoff protocol and :mod:`smc_handoff.channel` the shared-memory channel.
"""

from smc_handoff.messages import (
    FALLBACK_CHANNEL_UNSUPPORTED,
    FALLBACK_DAEMON_ERROR,
    FALLBACK_DAEMON_UNAVAILABLE,
    FALLBACK_DETACHED,
    Fallback,
    HandoffError,
    HandoffProtocolError,
)
from smc_handoff.socket import SmcServer, SmcSocket, connect, listen, wrap

__all__ = [
    "FALLBACK_CHANNEL_UNSUPPORTED",
    "FALLBACK_DAEMON_ERROR",
    "FALLBACK_DAEMON_UNAVAILABLE",
    "FALLBACK_DETACHED",
    "Fallback",
    "HandoffError",
    "HandoffProtocolError",
    "SmcServer",
    "SmcSocket",
    "connect",
    "listen",
    "wrap",
]
