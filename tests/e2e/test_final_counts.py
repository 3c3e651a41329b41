"""A connection's last bytes are counted when it ends: the daemon reads each half's header
once more at its CLOSE or hang-up (``DmbObserver.last_counts``), so ``smcd stats`` adds up to
exactly what crossed, short connections (gone before any periodic refresh) included, and the
pool takes both DMBs back."""

from __future__ import annotations

import time
from typing import Any

import pytest

from tests.e2e.conftest import Smcd, pair

pytestmark = pytest.mark.timeout(120)


def _bytes(smcd: Smcd) -> tuple[int, int]:
    counters = smcd.smcctl_json("stats")["counters"]
    return counters["smcd.tx_bytes"], counters["smcd.rx_bytes"]


def test_a_short_connection_counts_every_byte_it_moved(smcd: Smcd, apps: Any) -> None:
    before = _bytes(smcd)
    server, client, _ = pair(apps)
    server.send("recv", n=1001)
    assert client.call("sendbytes", data="x" * 1001) == {"ok": True}
    assert len(server.reply()["data"]) == 1001
    client.send("recv", n=17)
    assert server.call("sendbytes", data="y" * 17) == {"ok": True}
    assert len(client.reply()["data"]) == 17
    assert client.call("close") == {"ok": True}
    assert server.call("close") == {"ok": True}
    want = (before[0] + 1018, before[1] + 1018)  # each byte sent once and received once
    deadline = time.monotonic() + 10
    while (got := _bytes(smcd)) != want and time.monotonic() < deadline:
        time.sleep(0.05)
    assert got == want
