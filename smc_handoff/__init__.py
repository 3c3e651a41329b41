"""smc_handoff: the application side of smcd (standard library only).

``connect``/``wrap``/``listen`` give :class:`SmcSocket`\\ s, TCP sockets whose data moves over
shared memory once smcd took them over, and plain TCP with ``.fallback`` set otherwise (also
when no daemon runs). :mod:`smc_handoff.aio` has the asyncio streams, ``smc-run``
(:mod:`smc_handoff.run`) upgrades unmodified programs, :mod:`smc_handoff.messages` defines the
handoff protocol and :mod:`smc_handoff.channel` the shared-memory channel.
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:  # (typing costs a clean interpreter ~2 ms: smc-run imports this package)
    from typing import Any

    from smc_handoff.messages import (
        FALLBACK_CHANNEL_UNSUPPORTED,
        FALLBACK_DAEMON_ERROR,
        FALLBACK_DAEMON_UNAVAILABLE,
        FALLBACK_DETACHED,
        Fallback,
        HandoffError,
        HandoffProtocolError,
    )
    from smc_handoff.socket import SmcServer, SmcSocket, connect, listen

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


_FROM_SOCKET = frozenset({"SmcServer", "SmcSocket", "connect", "listen"})


def wrap(sock: Any, server_side: bool = False, *, dmb_size: int = 0) -> SmcSocket:
    """:func:`smc_handoff.socket.wrap`: hand a connected TCP socket to smcd.

    A client's socket gets the handoff mark before the library is loaded (a first call loads
    it, ~15 ms): a same-host server half in smcd that has seen no Proposal 20 ms after the
    connection asks whether its client carries the mark, and takes one without it for a plain
    TCP client (:data:`smc_handoff.peer_option.HANDOFF_MARK`). Call it right after
    ``connect()``."""
    if not server_side:
        import contextlib

        from smc_handoff.peer_option import HANDOFF_MARK  # (~0.6 ms the first time)

        with contextlib.suppress(OSError, AttributeError, TypeError):  # (the real wrap says)
            sock.setsockopt(*HANDOFF_MARK, 1)
    from smc_handoff.socket import wrap as real

    return real(sock, server_side, dmb_size=dmb_size)
