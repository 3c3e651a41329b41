"""smcd's own RDMA discovery (``smcd_daemon.adapters.verbs.discover_rdma``) on real rxe devices."""

from __future__ import annotations

from smcd_daemon.adapters.verbs import discover_rdma
from smcd_daemon.core.devices import GidType, PortState
from tests.vm.topology import Port, ipv4_mapped_gid_text


def test_discover_rdma_lists_every_rxe_with_gids_and_netdevs(ports: tuple[Port, ...]) -> None:
    devices = {d.name: d for d in discover_rdma()}
    assert sorted(devices) == sorted(p.rxe for p in ports)
    for p in ports:
        (port,) = devices[p.rxe].ports
        assert port.num == 1
        assert port.state == PortState.ACTIVE
        assert port.link_layer == "Ethernet"
        assert port.active_mtu >= 1024
        v2 = [g for g in port.gids if g.type == GidType.ROCE_V2 and g.netdev == p.ifname]
        want = bytes.fromhex(ipv4_mapped_gid_text(p.address).replace(":", ""))
        assert want in [g.gid for g in v2], f"{p.rxe}: {port.gids}"
