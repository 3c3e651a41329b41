"""TLS over an SMC channel: ``ssl`` wrapping a socket that is on SMC keeps it there.

CPython's ``ssl.SSLSocket`` hands the TCP descriptor to OpenSSL, which reads and writes it
itself, past the channel. So until now a connection that ``ssl`` took over left its channel
first and TLS ran on TCP (and after a plaintext exchange, STARTTLS, both ends had to leave
together). The kernel's AF_SMC has no such limit: TLS is bytes over the socket like any other.

Here the ``SSLSocket`` that ``wrap_socket`` makes from a socket on SMC (under smc-run the class
derives from :class:`~smc_handoff.socket.SmcSocket`, so it is another socket object for the
same connection, as ``dup()`` makes) gets, as its ``_sslobj``, a :class:`ChannelTls`: OpenSSL
through two memory BIOs, whose records this object moves over the channel with the socket's own
channel methods, in the socket's blocking mode and timeout. Everything of ``SSLSocket`` then
works unchanged above it (``recv``, ``sendall``, ``makefile``, ``getpeercert``, ``version``,
``unwrap``, ``pending``...), and a peer whose TLS runs over the same channel (blocking, or
asyncio's ``start_tls`` over an :class:`~smc_handoff.aio_transport.SmcTransport`) sees the
same TLS stream it would see over TCP.

A non-blocking socket behaves as ``ssl``'s: ``SSLWantReadError`` when the peer's records are
not there yet, ``SSLWantWriteError`` when the channel has no room for a record (the write is
then retried with the same data, as OpenSSL requires, and counts once).
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from smc_handoff.socket import SmcSocket

__all__ = ["ChannelTls", "TlsAfterConnect"]

_T = TypeVar("_T")
_HEADER = 5
"""A TLS record's header: type, version, length (big-endian, 16 bits)."""
_DONTWAIT = socket.MSG_DONTWAIT
_SLICE = 256 << 10
"""Plaintext bytes encrypted at once by :meth:`ChannelTls.write` (16 records)."""
_BATCH = 256 << 10
"""The most :meth:`ChannelTls._fill` peeks at once."""
_SMALL = 1024
"""Records up to this length end a batch: a close_notify is one (24 to 100 bytes with the usual
ciphers; OpenSSL pads records only when configured to, e.g. ``RecordPadding``)."""
_PEEK = socket.MSG_PEEK
_TRUNC = socket.MSG_TRUNC


class ChannelTls:
    """The ``_sslobj`` of an ``SSLSocket`` whose connection runs over an SMC channel."""

    def __init__(
        self, sslobj: Any, incoming: ssl.MemoryBIO, outgoing: ssl.MemoryBIO, owner: SmcSocket
    ) -> None:
        self._obj = sslobj  # ``_ssl._SSLSocket`` made by ``SSLContext._wrap_bio``
        self._in = incoming
        self._out = outgoing
        self._owner = owner
        self._recv_into: Callable[..., int] = SmcSocket.recv_into  # the channel's, not SSL's
        self._send: Callable[[Any, Any], int] = SmcSocket.send
        self._unsent = b""  # records a non-blocking send left behind
        self._tx_lock = threading.Lock()
        self._written = 0  # a non-blocking write() that OpenSSL took but could not flush
        self._view = memoryview(bytearray(_BATCH))  # peeked records
        self._pos = self._end = 0  # those of them still in the ring: view[pos:end]
        self._hdr = bytearray(_HEADER)  # the current record's header, as far as taken
        self._hlen = 0  # bytes of it taken
        self._left = 0  # bytes of its body not yet taken
        self._rlen = 0  # its length
        self._budget = 0  # the bytes the read in progress takes (0: one record at a time)

    # -- moving records ------------------------------------------------------------------------

    def _flush(self) -> None:
        """Send what OpenSSL wrote, in order: a reading thread that flushes (a handshake
        message, a KeyUpdate's answer) and a writing thread must not interleave records."""
        with self._tx_lock:
            if self._out.pending:
                data = self._unsent + self._out.read()
            elif self._unsent:
                data = self._unsent
            else:
                return
            self._unsent = b""
            view = memoryview(data)
            try:
                while view:
                    view = view[self._send(self._owner, view) :]
            except BlockingIOError:
                self._unsent = bytes(view)
                raise ssl.SSLWantWriteError(ssl.SSL_ERROR_WANT_WRITE, "The operation did not "
                                            "complete (write)") from None  # fmt: skip

    def _fill(self) -> None:
        """Move the peer's next records that are there into OpenSSL, no more than may go.

        The records are peeked, up to :data:`_BATCH` bytes, and only those given to OpenSSL
        are consumed (``MSG_TRUNC``: without a second copy). What may go is what OpenSSL
        would read from a descriptor: the next record, or, for a read of ``size`` bytes
        (:attr:`_budget`), the records whose bytes fit in ``size`` (at least one), which
        :meth:`read` then decrypts in the same call. So a stream of full records costs one
        read out of the ring per batch instead of two (header, body) per record, and no
        record stays in OpenSSL's memory buffer past the call, where ``select``/``poll``/
        ``epoll`` could not see it. A batch ends after a short record (:data:`_SMALL`): a
        close_notify is one, and the bytes after it are the plaintext of an ``unwrap()``ed
        connection, which must stay in the channel.

        A blocking socket waits for the first bytes; a non-blocking one takes what is there."""
        view, owner = self._view, self._owner
        pos, end = self._pos, self._end
        if pos == end:
            try:
                end = self._recv_into(owner, view, 0, _PEEK)
            except BlockingIOError:
                raise ssl.SSLWantReadError(ssl.SSL_ERROR_WANT_READ, "The operation did not "
                                           "complete (read)") from None  # fmt: skip
            if not end:
                self._in.write_eof()
                return
            pos = 0
        cut = self._record_end(view, pos, end)
        room = self._budget - (cut - pos)
        while cut + _HEADER <= end and self._rlen > _SMALL and not self._left:
            room -= _HEADER + int.from_bytes(view[cut + 3 : cut + 5], "big")
            if room < 0:
                break  # the next record would not fit in the read: it stays in the ring
            cut = self._record_end(view, cut, end)
        self._in.write(view[pos:cut])
        self._pos, self._end = (cut, end) if cut < end else (0, 0)
        while pos < cut:  # the bytes just given to OpenSSL leave the ring, without a copy
            pos += self._recv_into(owner, view[pos:cut], 0, _TRUNC)

    def _record_end(self, view: memoryview, pos: int, end: int) -> int:
        """Where the record at ``pos`` ends in the peeked bytes up to ``end`` (``end`` when
        it goes on past them); the framing state follows what is taken (a record's header may
        span two batches)."""
        left = self._left
        if left:  # the rest of a body
            if left <= end - pos:
                self._left = 0
                return pos + left
            self._left = left - (end - pos)
            return end
        hdr, have = self._hdr, self._hlen
        take = _HEADER - have
        if take > end - pos:
            take = end - pos
        hdr[have : have + take] = view[pos : pos + take]
        pos += take
        if have + take < _HEADER:
            self._hlen = have + take
            return end
        self._hlen = 0
        self._left = self._rlen = int.from_bytes(hdr[3:5], "big")
        return self._record_end(view, pos, end) if self._left else pos

    def _run(self, op: Callable[..., _T], *args: Any) -> _T:
        """Run an OpenSSL call to its end: its records out, the peer's in, as it asks."""
        while True:
            try:
                result = op(*args)
            except ssl.SSLWantReadError:
                self._flush()  # what it wrote first (a handshake flight) goes out before we wait
                self._fill()
                continue
            except ssl.SSLError:
                with contextlib.suppress(OSError):
                    self._flush()  # the alert it wrote (a refused certificate): the peer's reason
                    self._discard_unread()
                raise
            self._flush()
            return result

    def _discard_unread(self) -> None:
        """After a fatal error: drop the peer's records that arrived (the rest of its
        handshake flight), so that the close which follows is a close, not an abort that
        would discard the alert just sent before the peer reads it (TCP delivers it first)."""
        buf = self._view
        self._pos = self._end = 0
        while self._recv_into(self._owner, buf, 0, _DONTWAIT):
            pass

    # -- what SSLSocket calls ------------------------------------------------------------------

    def do_handshake(self) -> None:
        self._run(self._obj.do_handshake)

    def read(self, size: int = 1024, buffer: Any = None) -> Any:
        """Up to ``size`` bytes: the first record's as OpenSSL reads it, then those of the
        other records :meth:`_fill` took for this read (OpenSSL returns one record's at a
        time), so that none stays behind in its memory buffer. (``SSLSocket`` passes both
        positionally, as ``len`` and ``buffer``.)"""
        if self._unsent:
            self._flush()
        self._budget = size
        try:
            if buffer is None:
                data: bytes = self._run(self._obj.read, size)
                if not (data and self._in.pending):
                    return data
                parts = [data]

                def more(k: int, _: int) -> int:
                    parts.append(self._obj.read(k))
                    return len(parts[-1])

                self._drain(size - len(data), more)
                return b"".join(parts)
            n: int = self._run(self._obj.read, size, buffer)
            if n and self._in.pending and n < size:
                view = memoryview(buffer).cast("B")[n:size]
                n += self._drain(len(view), lambda k, at: self._obj.read(k, view[at:]))
            return n
        finally:
            self._budget = 0

    def _drain(self, room: int, take: Callable[[int, int], int]) -> int:
        """OpenSSL's reads of the records :meth:`_fill` took for this read, up to ``room``
        bytes (``take(k, at)`` reads up to k bytes, the ``at``-th on): what they gave."""
        got = 0
        while got < room and self._in.pending:
            try:
                k = take(room - got, got)
            except ssl.SSLError:  # (a partial record: the rest is still in the ring)
                break  # an error stays for the next call, which has no data to return first
            if not k:
                break
            got += k
        self._flush()  # (a post-handshake message read on the way may have an answer)
        return got

    def write(self, data: Any) -> int:
        """Encrypt and send ``data``, :data:`_SLICE` bytes at a time (OpenSSL writing into a
        memory buffer would take all of a 1 GB ``sendall`` before a byte went out); a
        non-blocking socket does one slice per call and says how much it took."""
        if self._written:  # the retry of a write whose records did not all go out
            self._flush()
            done, self._written = self._written, 0
            return done
        if self._unsent:
            self._flush()
        view = memoryview(data)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        total, size = 0, len(view)
        blocking = self._owner.gettimeout() != 0
        while True:
            n: int = self._obj.write(view[total : total + _SLICE])
            total += n
            try:
                self._flush()
            except ssl.SSLWantWriteError:
                self._written = total
                raise
            if total >= size or not blocking:
                return total

    def pending(self) -> int:
        return int(self._obj.pending())

    def shutdown(self) -> SmcSocket:
        """``unwrap()``: close_notify both ways; the socket goes on in plaintext."""
        self._run(self._obj.shutdown)
        if self._in.pending:
            # Bytes after the peer's close_notify went into OpenSSL with it: a padded one,
            # longer than _SMALL. They cannot go back into the stream, so the connection
            # ends as an error rather than going on without them.
            self._owner.abort()
            raise ssl.SSLError(ssl.SSL_ERROR_SSL, "the peer's close_notify was padded past "
                               f"{_SMALL} bytes and the plaintext after it was read with it; "
                               "the connection was reset")  # fmt: skip
        return self._owner

    @property
    def context(self) -> ssl.SSLContext:
        return self._obj.context  # type: ignore[no-any-return]

    @context.setter
    def context(self, ctx: ssl.SSLContext) -> None:
        self._obj.context = ctx

    @property
    def session(self) -> ssl.SSLSession | None:
        return self._obj.session  # type: ignore[no-any-return]

    @session.setter
    def session(self, session: ssl.SSLSession | None) -> None:
        self._obj.session = session

    def __getattr__(self, name: str) -> Any:
        """Everything that is no I/O: ``getpeercert``, ``cipher``, ``version``,
        ``selected_alpn_protocol``, ``get_channel_binding``, ``session_reused``..."""
        return getattr(self._obj, name)


class TlsAfterConnect:
    """The ``_sslobj`` of an ``SSLSocket`` wrapped before ``connect()`` (``ssl`` makes it then):
    whether its records go over a channel or TCP is known once the connection's handoff has
    its answer, so the real object (:class:`ChannelTls`, or OpenSSL on the descriptor) is made
    at its first use, the handshake."""

    def __init__(self, make: Callable[[], Any]) -> None:
        object.__setattr__(self, "_make", make)
        object.__setattr__(self, "_obj", None)

    def _resolve(self) -> Any:
        obj = self._obj
        if obj is None:
            obj = self._make()
            object.__setattr__(self, "_obj", obj)
        return obj

    def __getattr__(self, name: str) -> Any:
        return getattr(self._resolve(), name)

    def __setattr__(self, name: str, value: Any) -> None:  # ``context``, ``session``
        setattr(self._resolve(), name, value)
