"""The one error hierarchy of smcd.

Every error smcd raises on purpose derives from :class:`SmcError`, so adapters can tell "the input
was bad" (report it, carry on) from "we have a bug" (any other exception).
"""

from __future__ import annotations


class SmcError(Exception):
    """Root of every deliberate smcd error."""


class ProtocolError(SmcError):
    """Bytes from a peer (or a user) that do not form a valid SMC message.

    ``field`` names the protocol field at fault and ``offset`` its byte offset from the start of the
    message, so an operator reading a log line can find the byte in a capture.
    """

    def __init__(self, message: str, *, field: str, offset: int | None = None) -> None:
        self.reason = message
        self.field = field
        self.offset = offset
        where = f"{field}" if offset is None else f"{field} at offset {offset}"
        super().__init__(f"{where}: {message}")


class TruncatedError(ProtocolError):
    """The message ends before the field it must contain."""


class UnknownMessageError(ProtocolError):
    """Type or eyecatcher bytes name no SMC message we know."""
