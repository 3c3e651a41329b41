"""smc_handoff: the application side of smcd (standard library only).

``connect``/``wrap``/``listen`` give :class:`SmcSocket`\\ s, TCP sockets whose data moves over
shared memory once smcd took them over, and plain TCP with ``.fallback`` set otherwise (also
when no daemon runs). :mod:`smc_handoff.aio` has the asyncio streams, ``smc-run``
(:mod:`smc_handoff.run`) upgrades unmodified programs, :mod:`smc_handoff.messages` defines the
handoff protocol and :mod:`smc_handoff.channel` the shared-memory channel.
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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


def __getattr__(name: str) -> Any:
    """The names above, imported on first use. ``smc-run``'s launcher (:mod:`.launch`) is a
    module of this package that needs none of them, and every program started under smc-run
    pays for what it imports."""
    module = "smc_handoff.socket" if name in _FROM_SOCKET else "smc_handoff.messages"
    if name not in __all__:
        raise AttributeError(f"module 'smc_handoff' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


_FROM_SOCKET = frozenset({"SmcServer", "SmcSocket", "connect", "listen", "wrap"})
