"""Who holds how much of the handoff server: handoff connections per user and handshakes in
flight. The limits built on these counts are decided here, before any CLC byte is written, so a
user at a limit gets their TCP socket back exactly as they left it."""

from __future__ import annotations

__all__ = ["Admission", "session_limit"]


def session_limit(quota_connections: int) -> int:
    """Handoff connections a uid may hold (0 = no limit): two per allowed DMB (both halves of a
    same-user connection) plus a few listeners and handshakes in flight."""
    return 2 * quota_connections + 64 if quota_connections else 0


class Admission:
    """Per-user counts, kept rather than counted (a lookup per handshake, not a scan)."""

    def __init__(self) -> None:
        self._held: dict[int, int] = {}  # uid → handoff connections it holds
        self.inflight = 0
        """Handshakes between their request and their reply (deferred work waits for 0)."""

    def hold(self, uid: int) -> None:
        """A connection of ``uid`` was accepted."""
        self._held[uid] = self._held.get(uid, 0) + 1

    def let_go(self, uid: int) -> None:
        """A connection of ``uid`` ended."""
        left = self._held.get(uid, 1) - 1
        if left > 0:
            self._held[uid] = left
        else:
            self._held.pop(uid, None)

    def held(self, uid: int) -> int:
        return self._held.get(uid, 0)

    def over_limit(self, uid: int, quota_connections: int) -> tuple[int, int] | None:
        """``(others held, limit)`` if ``uid`` holds more connections than its limit (the one
        asking included), else None."""
        limit = session_limit(quota_connections)
        held = self._held.get(uid, 0)
        if limit and held > limit:
            return held - 1, limit
        return None
