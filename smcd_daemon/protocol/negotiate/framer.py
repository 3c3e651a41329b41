"""One CLC message at a time from the TCP byte stream, never a byte more than it needs."""

from __future__ import annotations

import functools
from typing import Literal

from smcd_daemon.errors import ProtocolError
from smcd_daemon.wire.clc import (
    CLC_HEADER_LEN,
    SMCD_EYECATCHER,
    SMCR_EYECATCHER,
    Accept,
    ClcHeader,
    ClcMessage,
    ClcType,
    Confirm,
    SmcdInfo,
    decode,
    peek_header,
)

__all__ = ["ClcFramer", "classify_first_bytes"]


def classify_first_bytes(peeked: bytes) -> Literal["smc", "not-smc", "need-more"]:
    """Server: do the first bytes the client sent (MSG_PEEK, nothing consumed) start a CLC message?

    A CLC message starts with the EBCDIC eyecatcher "SMCR" or "SMCD" (a Proposal or, from a client
    without devices, a Decline). Four bytes decide; fewer that still spell the start of an
    eyecatcher need more (bounded by the caller's wait: a client that waits for the server to speak
    first never completes them); anything else is plain TCP and stays untouched."""
    head = bytes(peeked[:4])
    for eye in (SMCR_EYECATCHER, SMCD_EYECATCHER):
        if eye.startswith(head):
            return "smc" if len(head) == 4 else "need-more"
    return "not-smc"


@functools.lru_cache(maxsize=64)
def _header(head: bytes) -> ClcHeader:
    """A valid header parsed once: type, length and version repeat (invalid ones raise and are
    not cached)."""
    return peek_header(head)


@functools.lru_cache(maxsize=16)
def _proposal(raw: bytes) -> ClcMessage:
    """A Proposal decoded once: the clients of one host send the same few byte for byte, and a
    decoded message is frozen, so sharing it is safe."""
    return decode(raw)


_TOKEN = slice(16, 24)
"""The DMB token in an SMC-D Accept/Confirm (header 8, GID 8)."""
_SMCD_ANSWERS = (ClcType.ACCEPT, ClcType.CONFIRM)
_ANSWERS: dict[bytes, Accept | Confirm] = {}


def _smcd_answer(raw: bytes) -> ClcMessage:
    """An SMC-D Accept/Confirm: a host's handshakes send the same bytes but for the DMB token,
    so a message decoded once (by the full decoder) is reused with the token read here."""
    key = raw[:16] + raw[24:]
    known = _ANSWERS.get(key)
    if known is None:
        msg = decode(raw)
        if isinstance(msg, Accept | Confirm) and isinstance(msg.info, SmcdInfo):
            if len(_ANSWERS) >= 256:
                _ANSWERS.clear()
            _ANSWERS[key] = msg
        return msg
    i = known.info
    assert isinstance(i, SmcdInfo)
    token = int.from_bytes(raw[_TOKEN], "big")
    info = SmcdInfo(i.gid, token, i.link_id, i.dmbe_idx, i.dmbe_size, i.chid, i.gid_ext)
    return type(known)(info, known.version, known.first_contact, known.eid, known.fce,
                       known.gid_list)  # fmt: skip


class ClcFramer:
    """Reads the 8-byte header first (what the kernel's ``smc_clc_wait_msg`` MSG_PEEKs), then the
    length it announces, so bytes after the handshake stay in the application's socket."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._length = 0

    @property
    def bytes_needed(self) -> int:
        if len(self._buf) < CLC_HEADER_LEN:
            return CLC_HEADER_LEN - len(self._buf)
        return self._length - len(self._buf)

    def feed(self, data: bytes, expect: ClcType) -> ClcMessage | str | None:
        """Take at most :attr:`bytes_needed` bytes. Returns the decoded message once it is
        complete, a protocol-violation text (bad header, unexpected type, malformed message),
        or None while more bytes are needed. Only ``expect`` or a Decline is acceptable."""
        self._buf += data
        if len(self._buf) < CLC_HEADER_LEN:
            return None
        if len(self._buf) == CLC_HEADER_LEN and not self._length:
            try:
                hdr = _header(bytes(self._buf))
            except ProtocolError as exc:
                return f"bad CLC header: {exc}"
            if hdr.type not in (expect, ClcType.DECLINE):
                return f"expected {expect.name} or DECLINE, got {hdr.type.name}"
            self._length = hdr.length
        if len(self._buf) < self._length:
            return None
        raw = bytes(self._buf)
        self._buf.clear()
        self._length = 0
        try:
            if expect is ClcType.PROPOSAL and raw[4] == ClcType.PROPOSAL:
                return _proposal(raw)
            if raw[4] in _SMCD_ANSWERS and raw[:4] == SMCD_EYECATCHER:
                return _smcd_answer(raw)
            return decode(raw)
        except ProtocolError as exc:
            return f"malformed {expect.name}: {exc}"
