"""An SMC-D link group left without connections is freed once it has been idle for
``LGR_FREE_DELAY``, by the gate's tick (no timer per connection); one that a connection uses
again meanwhile is kept, and its idle time starts over when it is left again."""

from __future__ import annotations

import asyncio
from pathlib import Path

from smcd_daemon.adapters.handoff import HandoffServer
from smcd_daemon.adapters.handoff.publisher import LGR_FREE_DELAY
from smcd_daemon.core.registry import LgrRole, LinkGroup, SmcType

PEER_GID = 0x1234


def test_an_idle_link_group_is_freed_by_the_tick_and_a_reused_one_kept(tmp_path: Path) -> None:
    async def main() -> None:
        srv = HandoffServer.bind(tmp_path / "handoff.sock")
        srv.start()
        try:
            loop = asyncio.get_running_loop()
            lgr_id = srv.loopback.link_groups.create(PEER_GID)
            srv.registry.add_link_group(LinkGroup(lgr_id, LgrRole.SERV, SmcType.SMCD))
            pub = srv.publisher
            pub.maybe_free_lgr(lgr_id)  # its last connection went
            start = loop.time()
            pub.sweep_lgrs(start + LGR_FREE_DELAY - 1.0)
            assert srv.registry.link_group(lgr_id) is not None  # not idle long enough
            pub.keep_lgr(lgr_id)  # a new connection uses it
            pub.sweep_lgrs(start + LGR_FREE_DELAY + 1.0)
            assert srv.registry.link_group(lgr_id) is not None  # kept: it is in use
            assert srv.loopback.link_groups.find(PEER_GID) == lgr_id
            pub.maybe_free_lgr(lgr_id)  # left again: idle from now on
            again = loop.time()
            pub.sweep_lgrs(again + LGR_FREE_DELAY - 1.0)
            assert srv.registry.link_group(lgr_id) is not None
            pub.sweep_lgrs(again + LGR_FREE_DELAY + 0.01)
            assert srv.registry.link_group(lgr_id) is None  # freed
            assert srv.loopback.link_groups.find(PEER_GID) is None
            pub.sweep_lgrs(again + 2 * LGR_FREE_DELAY)  # nothing left to free: no error
        finally:
            await srv.stop()

    asyncio.run(main())
