"""The DMBs applications map are the daemon's pool buffers: the same memfds the daemon holds
(sized DMB + the channel's 128-byte control trailer), reused for the next connection of the same
user, zeroed before that, and never given to another user."""

from __future__ import annotations

import os
import stat
from typing import Any

import pytest

from tests.e2e.conftest import Smcd, pair

pytestmark = pytest.mark.timeout(120)

NOBODY = 65534


def _dmbs(app: Any) -> dict[int, dict[str, int]]:
    return {d["inode"]: d for d in app.call("dmbs")["dmbs"]}


def _exchange(server: Any, client: Any, n: int = 200_003) -> None:
    """Fill both rings past their wrap (64 KiB DMBs), so every ring byte is written."""
    server.send("recv", n=n)
    assert client.call("send", n=n, seed=21, chunk=4093)["sent"] == n
    assert len(server.reply()["data"]) == n
    client.send("recv", n=n)
    assert server.call("send", n=n, seed=22, chunk=8191)["sent"] == n
    assert len(client.reply()["data"]) == n


def _close(smcd: Smcd, *apps: Any) -> None:
    mark = len(smcd.log())
    for app in apps:
        assert app.call("close") == {"ok": True}
    assert smcd.pool_report(mark)[:2] == (0, 0)  # both halves let go: nothing in use


def _open_for_others(smcd: Smcd) -> None:
    """Let uid 65534 reach the handoff socket (the test's work dir is private to root)."""
    for d in (smcd.work, smcd.handoff.parent):
        os.chmod(d, os.stat(d).st_mode | stat.S_IXOTH | stat.S_IROTH)


def test_mapped_dmbs_are_pool_buffers_reused_zeroed_and_never_shared(smcd: Smcd, apps: Any) -> None:
    # 1. Both applications map the same two memfds, and they are the daemon's own.
    server, client, _ = pair(apps)
    first = _dmbs(client)
    assert len(first) == 2 and _dmbs(server).keys() == first.keys()
    assert all(d["size"] == 1 << 20 and d["nonzero"] == 0 for d in first.values())
    assert first.keys() <= smcd.fds()["inodes"]
    _exchange(server, client)
    assert all(d["nonzero"] > 60_000 for d in _dmbs(client).values())  # data in both rings
    _close(smcd, server, client)
    cached = smcd.fds()["inodes"]
    assert first.keys() <= cached  # back in the pool, kept for this uid

    # 2. The next connection of the same user gets the same memfds, zeroed.
    server, client, _ = pair(apps)
    second = _dmbs(client)
    assert second.keys() == first.keys()
    assert all(d["nonzero"] == 0 for d in second.values())
    assert all(d["nonzero"] == 0 for d in _dmbs(server).values())
    _exchange(server, client)
    _close(smcd, server, client)

    # 3. A client of another uid: its receive DMB is a fresh memfd, zero as well.
    _open_for_others(smcd)
    server, client = apps("server"), apps("nobody-client", user=NOBODY)
    listening = server.call("listen")
    server.send("accept")
    c = client.call("connect", port=listening["port"])
    s = server.reply()
    assert c["mode"] == s["mode"] == "smcd", (c, s)
    third = _dmbs(client)
    assert third.keys() == _dmbs(server).keys() and len(third) == 2
    fresh = third.keys() - first.keys()
    assert len(fresh) == 1  # the client's own; the server's (root's) came from the pool
    assert all(d["nonzero"] == 0 for d in third.values())
    _exchange(server, client)
    _close(smcd, server, client)
    # Both were shared between two uids: neither may ever be handed out again.
    assert not third.keys() & smcd.fds()["inodes"]
