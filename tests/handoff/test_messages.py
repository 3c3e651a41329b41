"""The handoff protocol codec and its SCM_RIGHTS helpers, over real SEQPACKET socketpairs."""

from __future__ import annotations

import array
import os
import random
import socket
import struct

import pytest

from smc_handoff import messages as m

ALL = [
    m.Connect(),
    m.Connect(1 << 20),
    m.Accept(16 * 1024),
    m.Listen(),
    m.Resume(2**64 - 1, m.Role.SERVER, m.Mode.SMCD, 16 * 1024, 16 * 1024 << 6, 5, 2**64 - 1),
    m.Shutdown(socket.SHUT_WR),
    m.Close(aborted=True, bytes_sent=2**64 - 1, bytes_received=7),
    m.Channel(42, m.Mode.SMCD, 65536, 1 << 20),
    m.Channel(1, m.Mode.SMCR, 16384, 16384),
    m.Fallback(0x03010000, "PEERNOSMC", "peer did not offer SMC"),
    m.Fallback(0x05000000, "PEER_DECLINE", "déclin ✓", peer_diagnosis=0x030D0000),
    m.Fallback(m.FALLBACK_DAEMON_UNAVAILABLE, "DAEMON_UNAVAILABLE", "x" * m.MAX_TEXT),
    m.Error(m.ErrorCode.MALFORMED, "bad"),
    m.Ok(),
    m.Ok(7),
]


@pytest.mark.parametrize("msg", ALL, ids=lambda x: type(x).__name__)
def test_round_trip(msg: m.Message) -> None:
    data = m.encode(msg)
    assert len(data) <= m.MAX_MESSAGE
    assert data[:4] == b"SMCH" and data[4] == m.VERSION and data[5] == msg.TYPE
    assert struct.unpack("!I", data[8:12])[0] == len(data) - 12
    assert m.decode(data) == msg
    if msg.TYPE.is_request:
        assert m.decode_request(data) == msg
        with pytest.raises(m.HandoffProtocolError, match="request, not a reply"):
            m.decode_reply(data)
    else:
        assert m.decode_reply(data) == msg
        with pytest.raises(m.HandoffProtocolError, match="reply, not a request"):
            m.decode_request(data)


def test_exact_layouts() -> None:
    """The byte layouts the module docstring specifies (the daemon's helper codes from them)."""
    assert m.encode(m.Connect(65536)) == b"SMCH\x01\x01\x00\x00\x00\x00\x00\x04\x00\x01\x00\x00"
    assert m.encode(m.Listen()) == b"SMCH\x01\x03" + bytes(6)
    ch = m.encode(m.Channel(0x0102030405060708, m.Mode.SMCD, 16384, 32768))
    assert ch[12:] == bytes.fromhex("0102030405060708010000400000008000")
    fb = m.encode(m.Fallback(0x03010000, "AB", "é", peer_diagnosis=5))
    assert fb[12:] == bytes.fromhex("0301000001000000050002") + b"AB" + b"\x00\x02\xc3\xa9"
    er = m.encode(m.Error(m.ErrorCode.OVERSIZED, "z"))
    assert er[12:] == b"\x00\x02\x00\x01z"
    assert m.FD_NAMES[m.MessageType.CHANNEL] == (
        "rx_dmb",
        "tx_dmb",
        "rx_eventfd",
        "tx_eventfd",
        "peer_link",
    )


def _with(data: bytes, offset: int, value: bytes) -> bytes:
    return data[:offset] + value + data[offset + len(value) :]


GOOD = m.encode(m.Channel(9, m.Mode.SMCD, 65536, 65536))


@pytest.mark.parametrize(
    ("data", "code", "match"),
    [
        (b"", m.ErrorCode.MALFORMED, "shorter than the header"),
        (GOOD[:11], m.ErrorCode.MALFORMED, "shorter than the header"),
        (_with(GOOD, 0, b"SMCX"), m.ErrorCode.MALFORMED, "bad magic"),
        (_with(GOOD, 5, b"\x07"), m.ErrorCode.UNSUPPORTED_TYPE, "unknown message type 0x07"),
        (_with(GOOD, 6, b"\x00\x01"), m.ErrorCode.MALFORMED, "reserved header flags"),
        (GOOD + b"\x00", m.ErrorCode.MALFORMED, "header says 17 body bytes, datagram has 18"),
        (GOOD[:-1], m.ErrorCode.MALFORMED, "header says 17 body bytes, datagram has 16"),
        (_with(GOOD, 12, bytes(8)), m.ErrorCode.MALFORMED, "conn_id must not be 0"),
        (_with(GOOD, 20, b"\x03"), m.ErrorCode.MALFORMED, "CHANNEL: 3 is not a valid Mode"),
        (_with(GOOD, 21, b"\x00\x00\x50\x00"), m.ErrorCode.MALFORMED, "rx_size must be 16 KiB"),
        (b"\x00" * (m.MAX_MESSAGE + 1), m.ErrorCode.OVERSIZED, "limit 4096"),
        (m.encode(m.Listen())[:11] + b"\x01" + b"\x00", m.ErrorCode.MALFORMED, "trailing"),
    ],
)
def test_rejects(data: bytes, code: m.ErrorCode, match: str) -> None:
    with pytest.raises(m.HandoffProtocolError, match=match) as info:
        m.decode(data)
    assert info.value.code == code


def test_rejects_bad_text_and_flags() -> None:
    def fallback_body(body: bytes) -> bytes:
        return m.HEADER.pack(m.MAGIC, 1, m.MessageType.FALLBACK, 0, len(body)) + body

    head = bytes.fromhex("030100000000000000")
    ok = fallback_body(head + b"\x00\x01A\x00\x01b")
    assert m.decode(ok) == m.Fallback(0x03010000, "A", "b")
    cases = {
        "not UTF-8": head + b"\x00\x01A\x00\x02\xc3\x28",
        "contains NUL": head + b"\x00\x01A\x00\x01\x00",
        "is not a reason name": head + b"\x00\x02A-\x00\x00",
        "limit 1024": head + b"\x00\x01A\x04\x01" + b"a" * 1025,
        "explanation truncated": head + b"\x00\x01A\x00\x09abc",
        "unknown flag bits": bytes.fromhex("030100000400000000") + b"\x00\x01A\x00\x00",
        "without its flag": bytes.fromhex("030100000000000001") + b"\x00\x01A\x00\x00",
    }
    for match, body in cases.items():
        with pytest.raises(m.HandoffProtocolError, match=match):
            m.decode(fallback_body(body))
    err = m.HEADER.pack(m.MAGIC, 1, m.MessageType.ERROR, 0, 4) + b"\x00\x63\x00\x00"
    with pytest.raises(m.HandoffProtocolError, match="unknown error code 99"):
        m.decode(err)
    close = m.HEADER.pack(m.MAGIC, 1, m.MessageType.CLOSE, 0, 17) + b"\x02" + bytes(16)
    with pytest.raises(m.HandoffProtocolError, match="aborted must be 0 or 1"):
        m.decode(close)


def test_version_error_names_both_versions() -> None:
    data = m.encode(m.Connect(), version=2)
    with pytest.raises(m.HandoffVersionError, match=r"version 2 .*speaks 1") as info:
        m.decode(data)
    assert info.value.code == m.ErrorCode.UNSUPPORTED_VERSION and info.value.version == 2


def test_constructors_validate() -> None:
    with pytest.raises(ValueError, match="dmb_size"):
        m.Connect(1000)
    with pytest.raises(ValueError, match="name"):
        m.Fallback(1, "has space", "x")
    with pytest.raises(ValueError, match="longer than 1024"):
        m.Error(m.ErrorCode.INTERNAL, "é" * 513)
    with pytest.raises(ValueError, match="how"):
        m.Shutdown(3)
    with pytest.raises(ValueError):
        m.Ok(-1)
    assert m.valid_dmb_size(16384 << 6) and not m.valid_dmb_size(16384 << 7)
    from smc_handoff import layout

    sizes = [16384 << n for n in range(12)] + [16384 * 3, 65536 + 32]
    assert [s for s in sizes if m.valid_dmb_size(s)] == list(layout.DMB_SIZES)
    assert not m.valid_dmb_size(0) and not m.valid_dmb_size(16384 * 3)
    long = m.daemon_unavailable("é" * 2000)
    assert long.code == m.FALLBACK_DAEMON_UNAVAILABLE and len(long.explanation.encode()) <= 1024
    assert "DAEMON_ERROR (0xff000002)" in str(m.daemon_error("boom"))


def test_fuzz_decoder_only_raises_protocol_errors() -> None:
    """≥ 10,000 hostile inputs: random bytes, mutated valid messages, random headers."""
    rng = random.Random(4)
    seeds = [m.encode(msg) for msg in ALL]
    decoded = 0
    for i in range(12_000):
        kind = i % 3
        if kind == 0:
            data = rng.randbytes(rng.randrange(0, 64))
        elif kind == 1:
            data = bytearray(rng.choice(seeds))
            for _ in range(rng.randrange(1, 4)):
                data[rng.randrange(len(data))] = rng.randrange(256)
            data = bytes(data)
        else:
            body = rng.randbytes(rng.randrange(0, 40))
            mtype = rng.choice(list(m.MessageType))
            length = len(body) if rng.random() < 0.8 else rng.randrange(2**32)
            data = m.HEADER.pack(m.MAGIC, 1, mtype, 0, length) + body
        try:
            msg = m.decode(data)
        except m.HandoffProtocolError:
            continue
        decoded += 1
        assert m.encode(msg) == data  # whatever decodes is canonical
    assert decoded > 100  # the fuzzer also reached the body decoders


# --- over real sockets -------------------------------------------------------------------------


def _pair() -> tuple[socket.socket, socket.socket]:
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)


def _fd_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def test_send_recv_with_fds() -> None:
    a, b = _pair()
    r, w = os.pipe()
    try:
        m.send_message(a, m.Connect(), [w])
        msg, fds = m.recv_message(b, requests=True)
        assert msg == m.Connect() and len(fds) == 1 and fds[0] != w
        assert os.get_inheritable(fds[0]) is False  # received close-on-exec
        os.write(fds[0], b"hi")  # the same pipe travelled
        assert os.read(r, 2) == b"hi"
        os.close(fds[0])
        m.send_message(b, m.Fallback(0x03010000, "PEERNOSMC", "no"))
        assert m.recv_message(a, requests=False) == (m.Fallback(0x03010000, "PEERNOSMC", "no"), [])
        with pytest.raises(ValueError, match="carries 1 descriptors, got 0"):
            m.send_message(a, m.Connect(), [])
        b.close()
        with pytest.raises(m.HandoffClosedError):
            m.recv_message(a, requests=False)
    finally:
        for s in (a, b):
            s.close()
        os.close(r)
        os.close(w)


class _MyShutdown(m.Shutdown):
    """An application's subclass of a message class: still sent as its type."""


def test_send_checks_each_types_fd_count() -> None:
    channel = m.Channel(1, m.Mode.SMCD, 16384, 16384)
    a, b = _pair()
    try:
        for msg, n in ((m.Connect(), 1), (m.Listen(), 1), (m.Ok(1), 0), (channel, 5)):
            with pytest.raises(ValueError, match=f"carries {n} descriptors, got {n + 1}"):
                m.send_message(a, msg, list(range(100, 101 + n)))
        with pytest.raises(ValueError, match="SHUTDOWN carries 0 descriptors, got 1"):
            m.send_message(a, _MyShutdown(1), [0])
        m.send_message(a, _MyShutdown(2), [])
        msg, fds = m.recv_message(b, requests=True)
        assert type(msg) is m.Shutdown and msg.how == 2 and fds == []
    finally:
        a.close()
        b.close()


def _raw_send(sock: socket.socket, data: bytes, fds: list[int]) -> None:
    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())] if fds else []
    sock.sendmsg([data], anc)


@pytest.mark.parametrize(
    ("data", "nfds", "code"),
    [
        (m.encode(m.Connect()), 2, m.ErrorCode.BAD_FDS),  # wrong count
        (m.encode(m.Listen()), 0, m.ErrorCode.BAD_FDS),
        (b"garbage with fds", 3, m.ErrorCode.MALFORMED),
        (m.encode(m.Ok()), 1, m.ErrorCode.MALFORMED),  # a reply sent to the daemon
        (b"\x00" * (m.MAX_MESSAGE + 100), 1, m.ErrorCode.OVERSIZED),
        (m.encode(m.Connect()), m.MAX_FDS + 3, m.ErrorCode.BAD_FDS),  # MSG_CTRUNC
    ],
)
def test_bad_messages_close_their_fds(data: bytes, nfds: int, code: m.ErrorCode) -> None:
    a, b = _pair()
    pipes = [os.pipe() for _ in range(nfds)]
    try:
        before = set(os.listdir("/proc/self/fd"))
        _raw_send(a, data, [w for _, w in pipes])
        with pytest.raises(m.HandoffProtocolError) as info:
            m.recv_message(b, requests=True)
        assert info.value.code == code
        # every received copy is closed: the write ends' only copies are ours, so closing
        # them must give EOF on the read ends, and no new descriptor remains in this process
        assert set(os.listdir("/proc/self/fd")) <= before | {str(fd) for p in pipes for fd in p}
        for _, w in pipes:
            os.close(w)
        for r, _ in pipes:
            assert os.read(r, 1) == b""
    finally:
        a.close()
        b.close()
        for r, _ in pipes:
            os.close(r)


def test_candidates() -> None:
    assert m.handoff_socket_candidates({"SMCD_HANDOFF_SOCKET": "/x/h.sock"}) == [
        m.Path("/x/h.sock")
    ]
    got = m.handoff_socket_candidates({"XDG_RUNTIME_DIR": "/run/user/1000"})
    assert got == [m.Path("/run/user/1000/smcd/handoff.sock"), m.SYSTEM_HANDOFF_SOCKET]
    got = m.handoff_socket_candidates({})
    assert got[0].name == "handoff.sock" and got[0].parent.name == f"smcd-{os.getuid()}"
    assert m.handoff_timeout({"SMCD_HANDOFF_TIMEOUT": "0.5"}) == 0.5
    assert m.handoff_timeout({"SMCD_HANDOFF_TIMEOUT": "nan"}) == m.HANDOFF_TIMEOUT
