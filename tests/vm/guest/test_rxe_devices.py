"""The VM's Soft-RoCE devices: one rxe per virtio NIC, port ACTIVE, IPv4-mapped RoCEv2 GID."""

from __future__ import annotations

from pathlib import Path

import pytest
import pyverbs.device as pvd  # type: ignore[import-untyped]
import pyverbs.enums as e  # type: ignore[import-untyped]

from tests.vm.guest.verbs_pair import ipv4_gid_index
from tests.vm.topology import PORTS, Port, ipv4_mapped_gid_text

IB = Path("/sys/class/infiniband")


def test_every_port_has_an_rxe_device(ports: tuple[Port, ...]) -> None:
    listed = sorted(d.name.decode() for d in pvd.get_device_list())
    assert listed == sorted(p.rxe for p in ports)


@pytest.mark.parametrize("port", PORTS, ids=lambda p: p.rxe)
def test_port_active_with_ipv4_roce_v2_gid(port: Port) -> None:
    idx = ipv4_gid_index(port)
    port_dir = IB / port.rxe / "ports" / "1"
    assert (port_dir / "gid_attrs" / "types" / str(idx)).read_text().strip() == "RoCE v2"
    assert (port_dir / "gid_attrs" / "ndevs" / str(idx)).read_text().strip() == port.ifname
    with pvd.Context(name=port.rxe) as ctx:
        attr = ctx.query_port(1)
        assert attr.state == e.IBV_PORT_ACTIVE
        assert attr.link_layer == e.IBV_LINK_LAYER_ETHERNET
        assert str(ctx.query_gid(1, idx)) == ipv4_mapped_gid_text(port.address)


@pytest.mark.parametrize("port", PORTS, ids=lambda p: p.ifname)
def test_rxe_sits_on_its_virtio_nic(port: Port) -> None:
    netdev = Path("/sys/class/net") / port.ifname
    assert (netdev / "address").read_text().strip() == port.mac
    assert (netdev / "device" / "driver").resolve().name == "virtio_net"
    parent = (IB / port.rxe / "parent").read_text().strip()
    assert parent == port.ifname
