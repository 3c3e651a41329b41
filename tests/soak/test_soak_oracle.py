"""The soak's oracle: a client half that reads CLC bytes or altered data reports a corrupted
stream, a clean echo is ok, and a peer that hangs up early is an error, not corruption. Real
sockets and smc_handoff with no daemon (TCP, DAEMON_UNAVAILABLE)."""

from __future__ import annotations

import random
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import smc_handoff
from tests.soak import workers


class Queue:
    def __init__(self) -> None:
        self.items: list[Any] = []

    def put(self, item: Any) -> None:
        self.items.append(item)


def _outcome(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reply: Callable[[bytes], bytes]
) -> str:
    monkeypatch.setenv("SMCD_HANDOFF_SOCKET", str(tmp_path / "absent.sock"))
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.settimeout(10)
            got = b""
            while len(got) < 4 or len(got) < 4 + int.from_bytes(got[:4], "big") + 32:
                piece = conn.recv(65536)
                if not piece:
                    break
                got += piece
            conn.sendall(reply(got))

    t = threading.Thread(target=serve)
    t.start()
    queue = Queue()
    tally = workers.Tally(queue)
    workers.one_connection(random.Random(1), port, "flood", tally, smc_handoff)
    tally.flush()
    t.join(10)
    listener.close()
    ((_, counts, _),) = queue.items
    (key,) = counts
    role, phase, mode, reason, outcome = key.split("|")
    assert (role, phase, mode, reason) == ("client", "flood", "tcp", "DAEMON_UNAVAILABLE")
    return outcome


def test_clean_echo_is_ok(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert _outcome(tmp_path, monkeypatch, lambda got: got) == "ok"


@pytest.mark.parametrize("eye", workers.EYECATCHERS)
def test_clc_bytes_in_the_stream_are_corruption(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, eye: bytes
) -> None:
    outcome = _outcome(tmp_path, monkeypatch, lambda got: eye + b"\x01\x00\x2c" + got)
    assert outcome == "corrupt: CLC bytes as data"


def test_altered_data_is_corruption(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def flip(got: bytes) -> bytes:
        return got[:10] + bytes([got[10] ^ 1]) + got[11:]

    assert _outcome(tmp_path, monkeypatch, flip) == "corrupt: echo differs"


def test_early_hang_up_is_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert (
        _outcome(tmp_path, monkeypatch, lambda got: got[:5]) == "error: EOF before the whole echo"
    )
