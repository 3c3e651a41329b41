"""Floor 1: pure SMC wire codecs (CLC, LLC, CDC) and reason codes.

Bytes in, typed frozen dataclasses out, and back. No sockets, no asyncio, no logging: every
failure on hostile bytes is a :class:`smcd_daemon.errors.ProtocolError` naming field and offset.
"""
