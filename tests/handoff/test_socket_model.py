"""SmcSocket against a model of a TCP stream: random sequences of non-blocking calls.

The hand-written tests in ``test_socket.py`` check one behaviour each against a kernel TCP pair.
Here hypothesis drives long random sequences of the calls a program makes on a connected pair
(``send``/``sendmsg`` of any size, ``recv``/``recv_into``/``recvmsg_into`` with and without
``MSG_PEEK``, readiness through ``select``, ``shutdown(SHUT_WR)``) on both ends at once, and
checks each result against a model of the two byte streams: what one end sent and the other has
not yet read. The model holds for a kernel TCP pair (the ``tcp`` run proves the model) and
must hold for an SMC pair (``smcd``: a real channel from the handoff), where it is checked more
strictly: a send copies into the peer's receive buffer, so everything sent is readable at once,
and a read returns all of it up to its size (a kernel TCP pair may still hold bytes in the
sender's queue). At the end both streams are drained and compared byte for byte.
"""

from __future__ import annotations

import errno
import os
import random
import select
import socket
import time
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from smc_handoff import readiness
from smc_handoff.socket import SmcSocket

from .test_socket import MiniDaemon, tcp_pair, wrapped_pair
from .test_socket import daemon as daemon  # the fixture: a MiniDaemon for the test

SIDES = st.sampled_from([0, 1])
# Small reads and writes mostly, some larger than the 64 KiB ring to wrap and fill it.
SIZES = st.one_of(st.integers(1, 64), st.integers(65, 4096), st.integers(4097, 200_000))
DRAIN_TIMEOUT = 10.0


class Stream:
    """One direction: bytes sent, how many the receiver consumed, whether the writer shut."""

    def __init__(self) -> None:
        self.sent = bytearray()
        self.read = 0
        self.shut = False

    @property
    def pending(self) -> bytes:
        return bytes(self.sent[self.read :])


class StreamModel(RuleBasedStateMachine):
    """Both ends of one connected pair, ``socks[i]`` writing ``streams[i]``."""

    kind = "tcp"

    def __init__(self) -> None:
        super().__init__()
        a, b = tcp_pair() if self.kind == "tcp" else wrapped_pair()
        if self.kind == "smcd":
            assert isinstance(a, SmcSocket) and a.mode == b.mode == "smcd", (a, b)
        self.socks: list[Any] = [a, b]
        for s in self.socks:
            s.setblocking(False)
        self.streams = [Stream(), Stream()]
        self.rd_shut = [False, False]
        self.rng = random.Random(0)

    @property
    def strict(self) -> bool:
        return self.kind == "smcd"

    def _data(self, size: int) -> bytes:
        return self.rng.randbytes(size)

    # ---- writes ---------------------------------------------------------------------------

    @rule(side=SIDES, size=SIZES, gather=st.booleans())
    def send(self, side: int, size: int, gather: bool) -> None:
        stream, sock = self.streams[side], self.socks[side]
        data = self._data(size)
        try:
            if gather:
                cut = size // 3
                n = sock.sendmsg([data[:cut], memoryview(data)[cut:]])
            else:
                n = sock.send(data)
        except BlockingIOError:
            assert not stream.shut
            return
        except BrokenPipeError:
            assert stream.shut, "EPIPE on a stream that was not shut"
            return
        assert not stream.shut, "a send after SHUT_WR went through"
        assert 0 < n <= size, n
        stream.sent += data[:n]

    @rule(side=SIDES)
    def shutdown_wr(self, side: int) -> None:
        """Once both ends shut, TCP's socket has gone to TIME_WAIT or CLOSE and says ENOTCONN;
        the kernel's AF_SMC is in SMC_PEERCLOSEWAIT2 (the peer's close flag, not its
        done-writing flag, ends the connection) and takes it, and so do we."""
        if not self.strict and self.rd_shut[side]:
            return  # (see shutdown_rd)
        both = self.streams[side].shut and self.streams[1 - side].shut
        try:
            self.socks[side].shutdown(socket.SHUT_WR)
        except OSError as e:
            assert e.errno == errno.ENOTCONN and both and not self.strict, e
        self.streams[side].shut = True

    @rule(side=SIDES)
    def shutdown_rd(self, side: int) -> None:
        """Reads go on returning what was received (before and after), then EOF at once.

        Not on a TCP end that also shut for writing: Linux TCP resets a connection whose end in
        FIN_WAIT, shut for reading, gets data (RFC 1122); the kernel's AF_SMC does not."""
        if not self.strict and self.streams[side].shut:
            return
        both = self.streams[side].shut and self.streams[1 - side].shut
        try:
            self.socks[side].shutdown(socket.SHUT_RD)
        except OSError as e:  # TCP's closed connection (see shutdown_wr)
            assert e.errno == errno.ENOTCONN and both and not self.strict, e
            return
        self.rd_shut[side] = True

    # ---- reads ----------------------------------------------------------------------------

    def _check_read(self, side: int, got: bytes | None, size: int, *, peek: bool) -> None:
        """``got``: what a read on ``side`` returned (None: EAGAIN)."""
        stream = self.streams[1 - side]
        pending = stream.pending
        if got is None:
            assert not self.rd_shut[side], "EAGAIN after SHUT_RD"
            assert not (self.strict and (pending or stream.shut)), (
                f"EAGAIN with {len(pending)} bytes pending, shut={stream.shut}"
            )
            return
        if not got:
            if self.rd_shut[side]:  # (TCP may still hold the pending bytes in the sender)
                assert not (self.strict and pending), f"EOF with {len(pending)} bytes pending"
                return
            assert stream.shut and not pending, f"EOF with {len(pending)} bytes pending"
            return
        assert len(got) <= size and pending.startswith(got), (
            f"read {len(got)} bytes that are not the next of {len(pending)} pending"
        )
        if self.strict:
            assert len(got) == min(size, len(pending)), (
                f"read {len(got)} of {len(pending)} pending (asked {size})"
            )
        if not peek:
            stream.read += len(got)

    @rule(side=SIDES, size=SIZES, peek=st.booleans())
    def recv(self, side: int, size: int, peek: bool) -> None:
        try:
            got: bytes | None = self.socks[side].recv(size, socket.MSG_PEEK if peek else 0)
        except BlockingIOError:
            got = None
        self._check_read(side, got, size, peek=peek)

    @rule(side=SIDES, size=SIZES, peek=st.booleans())
    def recv_waitall(self, side: int, size: int, peek: bool) -> None:
        """``MSG_WAITALL`` on a non-blocking socket waits for nothing: what is there."""
        flags = socket.MSG_WAITALL | (socket.MSG_PEEK if peek else 0)
        try:
            got: bytes | None = self.socks[side].recv(size, flags)
        except BlockingIOError:
            got = None
        self._check_read(side, got, size, peek=peek)

    @rule(side=SIDES, size=SIZES)
    def recv_dontwait_on_a_blocking_socket(self, side: int, size: int) -> None:
        sock = self.socks[side]
        sock.setblocking(True)
        try:
            got: bytes | None = sock.recv(size, socket.MSG_DONTWAIT)
        except BlockingIOError:
            got = None
        finally:
            sock.setblocking(False)
        self._check_read(side, got, size, peek=False)

    @precondition(lambda self: any(s.pending or s.shut for s in self.streams) or any(self.rd_shut))
    @rule(side=SIDES, size=SIZES, timeout=st.sampled_from([None, 5.0]))
    def recv_waiting(self, side: int, size: int, timeout: float | None) -> None:
        """A read that may wait (blocking, or with a timeout), only when data or EOF is there
        to be had: it returns at once with what is there."""
        stream = self.streams[1 - side]
        if not (stream.pending or stream.shut or self.rd_shut[side]):
            return
        sock = self.socks[side]
        sock.settimeout(timeout)
        try:
            got = sock.recv(size)
        finally:
            sock.setblocking(False)
        self._check_read(side, got, size, peek=False)

    @rule(side=SIDES, size=SIZES, spare=st.integers(0, 100), peek=st.booleans())
    def recv_into(self, side: int, size: int, spare: int, peek: bool) -> None:
        buf = bytearray(size + spare)
        try:
            n = self.socks[side].recv_into(buf, size, socket.MSG_PEEK if peek else 0)
        except BlockingIOError:
            self._check_read(side, None, size, peek=peek)
            return
        assert buf[n:] == bytearray(len(buf) - n), "recv_into wrote past what it returned"
        self._check_read(side, bytes(buf[:n]), size, peek=peek)

    @rule(side=SIDES, first=st.integers(1, 5000), second=SIZES)
    def recvmsg_into(self, side: int, first: int, second: int) -> None:
        x, y = bytearray(first), bytearray(second)
        try:
            n, anc, _flags, _addr = self.socks[side].recvmsg_into([x, y])
        except BlockingIOError:
            self._check_read(side, None, first + second, peek=False)
            return
        assert anc == []
        self._check_read(side, bytes((x + y)[:n]), first + second, peek=False)

    # ---- readiness ------------------------------------------------------------------------

    @precondition(lambda self: self.strict)
    @rule(side=SIDES)
    def readable(self, side: int) -> None:
        stream = self.streams[1 - side]
        ready = select.select([self.socks[side]], [], [], 0)[0]
        assert bool(ready) == bool(stream.pending or stream.shut or self.rd_shut[side]), (
            f"select says {'readable' if ready else 'not readable'} with "
            f"{len(stream.pending)} bytes pending, shut={stream.shut}"
        )

    @precondition(lambda self: self.strict)
    @rule(side=SIDES)
    def writable(self, side: int) -> None:
        """smc-run's select (``smc_handoff.readiness``): writable exactly when a send takes a
        byte or raises (the ring has room, or the end is shut)."""
        stream, sock = self.streams[side], self.socks[side]
        ready = bool(readiness.smc_select([], [sock], [], 0)[1])
        try:
            n = sock.send(b"w")
        except BlockingIOError:
            assert not ready, "select said writable, the send found no room"
            return
        except BrokenPipeError:
            assert ready and stream.shut, "EPIPE where select said not writable"
            return
        assert ready, "select said not writable, the send took a byte"
        assert n == 1 and not stream.shut
        stream.sent += b"w"

    @invariant()
    def nothing_read_was_lost(self) -> None:
        for stream in self.streams:
            assert 0 <= stream.read <= len(stream.sent)

    # ---- the end --------------------------------------------------------------------------

    def teardown(self) -> None:
        try:
            for side in (0, 1):
                self._drain(side)
        finally:
            for s in self.socks:
                s.close()

    def _drain(self, side: int) -> None:
        """All of what ``side`` sent reaches the other end, in order (then its EOF, if shut)."""
        stream, reader = self.streams[side], self.socks[1 - side]
        shut_rd = self.rd_shut[1 - side]
        rest = bytearray()
        want = len(stream.sent) - stream.read
        deadline = time.monotonic() + DRAIN_TIMEOUT
        while len(rest) < want:
            if not select.select([reader], [], [], DRAIN_TIMEOUT)[0]:
                raise AssertionError(f"{want - len(rest)} of {want} bytes never arrived")
            try:
                chunk = reader.recv(1 << 20)
            except BlockingIOError:
                continue
            if not chunk and shut_rd and not self.strict and time.monotonic() < deadline:
                time.sleep(0.001)  # EOF at once after SHUT_RD: TCP's bytes still on the way
                continue
            assert chunk, f"EOF with {want - len(rest)} of {want} bytes missing"
            rest += chunk
        assert bytes(rest) == bytes(stream.sent[stream.read :]), "the stream's bytes differ"
        if stream.shut or shut_rd:
            assert select.select([reader], [], [], DRAIN_TIMEOUT)[0]
            assert reader.recv(1) == b""
        else:
            try:
                extra = reader.recv(1)
            except BlockingIOError:
                return
            raise AssertionError(f"read {extra!r} past everything sent")


RUNS = settings(
    max_examples=int(os.environ.get("SOCKET_MODEL_EXAMPLES", "60")),
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize="SOCKET_MODEL_EXAMPLES" not in os.environ,
    report_multiple_bugs=False,
)


@pytest.mark.parametrize("kind", ["tcp", "smcd"])
def test_random_calls_keep_to_the_stream_model(kind: str, daemon: MiniDaemon) -> None:
    """The model on a kernel TCP pair (the reference) and on an SMC pair (strictly)."""
    machine = type(f"StreamModel_{kind}", (StreamModel,), {"kind": kind})
    run = machine.TestCase
    run.settings = RUNS
    run().runTest()


def test_eagain_is_an_error_not_an_empty_read(daemon: MiniDaemon) -> None:
    """The model's EAGAIN (None) and EOF (b'') are told apart as a socket tells them."""
    a, b = wrapped_pair()
    try:
        b.setblocking(False)
        with pytest.raises(BlockingIOError) as e:
            b.recv(10)
        assert e.value.errno == errno.EAGAIN
        a.shutdown(socket.SHUT_WR)
        assert select.select([b], [], [], 5)[0]
        assert b.recv(10) == b""
    finally:
        a.close()
        b.close()
