"""The smcd D-Bus service on a real (private, session-like) dbus-daemon, seen by real clients:
dbus-fast, busctl and gdbus. Model changes (registry, device inventory) must reach subscribers
as InterfacesAdded / PropertiesChanged / InterfacesRemoved and Manager1 signals within a second.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any

from dbus_fast import MessageType, Variant

from smcd_daemon.adapters.dbus import (
    ERROR_ACCESS_DENIED,
    ERROR_INVALID,
    connection_path,
    device_path,
    link_group_path,
    link_path,
)
from smcd_daemon.adapters.dbus.objects import (
    ConnectionObject,
    DeviceObject,
    LinkGroupObject,
    LinkObject,
)
from smcd_daemon.cli.devices import device_detail
from smcd_daemon.core.registry import (
    Connection,
    ConnMode,
    ConnRole,
    ConnState,
    LgrRole,
    LgrType,
    Link,
    LinkGroup,
    LinkState,
    SmcType,
)
from smcd_daemon.wire.reasons import DeclineReason
from tests.control.dbusd import (
    SIGNAL_TIMEOUT,
    DbusDaemon,
    Harness,
    as_nobody,
    busctl,
    changed_values,
    gdbus_call,
    is_signal,
    props_changed,
    run,
    smcd_on_bus,
    veth_device,
)

MANAGER = "org.smcd.Manager1"
OM = "org.freedesktop.DBus.ObjectManager"
PROPS = "org.freedesktop.DBus.Properties"
LGR = link_group_path(0x100)
LINK = link_path(0x100, 1)
CONN = connection_path(1)
VETH = device_path("veth-a")


def scenario(bus: DbusDaemon, body: Callable[[Harness], Awaitable[None]]) -> None:
    async def main() -> None:
        async with smcd_on_bus(bus.address) as h:
            await asyncio.wait_for(body(h), 30)

    asyncio.run(main())


def add_smcr_objects(h: Harness) -> None:
    h.registry.add_link_group(
        LinkGroup(
            0x100,
            LgrRole.SERV,
            SmcType.SMCR,
            LgrType.SINGLE,
            peer_system_id=bytes.fromhex("0000c0ffee000001"),
            pnetid="NET1",
            netdev="veth-a",
            smc_version=2,
            smc_release=1,
        )
    )
    h.registry.add_link(
        Link(
            0x100,
            1,
            LinkState.ACTIVATING,
            link_uid=bytes.fromhex("00000101"),
            ibdev="rxe0",
            ibport=1,
            netdev="veth-a",
            gid=bytes(10) + b"\xff\xff" + bytes([192, 0, 2, 1]),
            peer_gid=bytes(10) + b"\xff\xff" + bytes([192, 0, 2, 2]),
            qpn=17,
            peer_qpn=18,
            mtu=1024,
        )
    )
    h.registry.add_connection(
        Connection(
            1,
            ConnRole.SERVER,
            ConnMode.SMCR,
            ConnState.ACTIVE,
            local_addr="192.0.2.1",
            local_port=5000,
            peer_addr="192.0.2.2",
            peer_port=40000,
            uid=1000,
            inode=4242,
            lgr_id=0x100,
            link_id=1,
            rmbe_size=65536,
        )
    )


def test_object_tree_and_properties(session_bus: DbusDaemon) -> None:
    async def body(h: Harness) -> None:
        add_smcr_objects(h)
        objects = await h.managed_objects()
        # Devices: the two netdevs and loopback-ism, each with every Device1 property.
        devices = {p: i["org.smcd.Device1"] for p, i in objects.items() if "/device/" in p}
        assert set(devices) == {
            device_path("lo"),
            VETH,
            device_path("loopback-ism"),
        }, objects.keys()
        for props in devices.values():
            assert set(props) == set(DeviceObject.PROPERTIES)
        veth = devices[VETH]
        assert (veth["Name"], veth["Kind"], veth["Ifindex"]) == ("veth-a", "netdev", 7)
        assert (veth["OperState"], veth["Up"], veth["Mtu"]) == ("UP", True, 1500)
        ism = devices[device_path("loopback-ism")]
        assert (ism["Kind"], ism["Chid"], ism["Enabled"]) == ("ism", 0xFFFF, True)
        assert ism["Gid"] == h.inventory.loopback_ism.gid.hex()

        lgr = objects[LGR]["org.smcd.LinkGroup1"]
        assert set(lgr) == set(LinkGroupObject.PROPERTIES)
        assert (lgr["Id"], lgr["Role"], lgr["Type"], lgr["LgrType"]) == (
            0x100,
            "SERV",
            "SMC-R",
            "SINGLE",
        )
        assert (lgr["Connections"], lgr["Links"], lgr["PeerSystemId"]) == (
            1,
            [LINK],
            "0000c0ffee000001",
        )
        link = objects[LINK]["org.smcd.Link1"]
        assert set(link) == set(LinkObject.PROPERTIES)
        assert (link["State"], link["Gid"], link["PeerGid"], link["LinkGroup"]) == (
            "ACTIVATING",
            "::ffff:192.0.2.1",
            "::ffff:192.0.2.2",
            LGR,
        )
        conn = objects[CONN]["org.smcd.Connection1"]
        assert set(conn) == set(ConnectionObject.PROPERTIES)
        assert (conn["Mode"], conn["State"], conn["Link"], list(conn["RxProducer"])) == (
            "SMCR",
            "ACTIVE",
            LINK,
            [0, 0],
        )

        (mgr,) = await h.ok("/org/smcd", PROPS, "GetAll", "s", [MANAGER])
        assert mgr["Version"].value and mgr["SmcProtocol"].value == "2.1"
        assert mgr["PnetEntries"].value == [] and mgr["Ueids"].value == []
        (info,) = await h.ok("/org/smcd", MANAGER, "GetInfo")
        assert {"Version", "Hostname", "Capabilities", "Seid", "Ueids"} <= set(info)

    scenario(session_bus, body)


def test_introspection_with_busctl_and_gdbus(session_bus: DbusDaemon) -> None:
    async def body(h: Harness) -> None:
        add_smcr_objects(h)
        a = h.address
        root = await run(busctl(a, "introspect", "org.smcd", "/org/smcd"))
        assert root.returncode == 0, root.stderr
        for needle in (
            "org.smcd.Manager1",
            "org.freedesktop.DBus.ObjectManager",
            ".PnetAdd",
            ".UeidFlush",
            ".StatsReset",
            ".GetInfo",
            ".LinkStateChanged",
            ".Fallback",
            ".PnetEntries",
        ):
            assert needle in root.stdout, (needle, root.stdout)
        tree = await run(busctl(a, "tree", "org.smcd"))
        assert tree.returncode == 0, tree.stderr
        for path in (LGR, LINK, CONN, VETH):
            assert path in tree.stdout, (path, tree.stdout)
        for path, iface in (
            (LGR, "org.smcd.LinkGroup1"),
            (LINK, "org.smcd.Link1"),
            (CONN, "org.smcd.Connection1"),
            (VETH, "org.smcd.Device1"),
        ):
            out = await run(busctl(a, "introspect", "org.smcd", path))
            assert out.returncode == 0 and iface in out.stdout, (path, out.stdout, out.stderr)
        g = await run(
            [
                "gdbus",
                "introspect",
                "--recurse",
                "--address",
                a,
                "--dest",
                "org.smcd",
                "--object-path",
                "/",
            ]
        )
        assert g.returncode == 0, g.stderr
        for needle in (
            "interface org.smcd.Manager1",
            "PnetAdd(in  s pnetid",
            "out a(sssy) added",
            "LinkStateChanged(o link",
            "interface org.smcd.Link1",
            "readonly s State = 'ACTIVATING'",
            "interface org.smcd.Connection1",
            "interface org.smcd.LinkGroup1",
            "interface org.smcd.Device1",
        ):
            assert needle in g.stdout, (needle, g.stdout[:4000])

    scenario(session_bus, body)


def test_registry_changes_reach_subscribers(session_bus: DbusDaemon) -> None:
    async def body(h: Harness) -> None:
        add_smcr_objects(h)
        # InterfacesAdded come from the object manager's path and carry all properties.
        for path, iface in ((LGR, "LinkGroup1"), (LINK, "Link1"), (CONN, "Connection1")):
            msg, _ = await h.wait_signal(is_signal("InterfacesAdded", "/org/smcd", path))
            assert msg.interface == OM
            assert set(msg.body[1]) == {f"org.smcd.{iface}"}
        msg, _ = await h.wait_signal(
            lambda m: props_changed(LGR, "org.smcd.LinkGroup1")(m) and "Connections" in m.body[1]
        )
        assert changed_values(msg) == {"Connections": 1}

        # A link state change: PropertiesChanged with just State, and LinkStateChanged.
        # (The link's own Connections change from add_smcr_objects may still be on its way:
        # it is a separate PropertiesChanged, so wait for the one that carries State.)
        h.signals.clear()
        h.registry.set_link_state(0x100, 1, LinkState.ACTIVE)
        msg, waited = await h.wait_signal(
            lambda m: props_changed(LINK, "org.smcd.Link1")(m) and "State" in m.body[1]
        )
        assert changed_values(msg) == {"State": "ACTIVE"} and waited < SIGNAL_TIMEOUT
        msg, _ = await h.wait_signal(is_signal("LinkStateChanged", "/org/smcd"))
        assert msg.interface == MANAGER and msg.body == [LINK, "ACTIVATING", "ACTIVE"]
        (state,) = await h.ok(LINK, PROPS, "Get", "ss", ["org.smcd.Link1", "State"])
        assert state.value == "ACTIVE"

        # A fallback: Fallback signal with the reason's name; counted in the stats.
        h.signals.clear()
        h.registry.fall_back(1, DeclineReason.PEERNOSMC, 0)
        msg, _ = await h.wait_signal(is_signal("Fallback", "/org/smcd"))
        assert msg.body == [CONN, 0x03010000, 0, "SMC_CLC_DECL_PEERNOSMC"]
        msg, _ = await h.wait_signal(props_changed(CONN, "org.smcd.Connection1"))
        assert changed_values(msg) == {
            "Mode": "TCP",
            "FallbackReason": 0x03010000,
            "FallbackName": "SMC_CLC_DECL_PEERNOSMC",
            "LinkGroup": "/",
            "Link": "/",
        }
        msg, _ = await h.wait_signal(props_changed(LGR, "org.smcd.LinkGroup1"))
        assert changed_values(msg) == {"Connections": 0}
        counters, fallbacks = await h.ok("/org/smcd", MANAGER, "StatsGet")
        assert counters["fallback.server"] == 1 and counters["connections.total"] == 1
        assert [tuple(f) for f in fallbacks] == [(0x03010000, 1, 0)]

        # Removal: the link goes before its link group, both announced from /org/smcd.
        h.signals.clear()
        h.registry.remove_link_group(0x100)
        h.registry.remove_connection(1)
        for path in (LINK, LGR, CONN):
            msg, _ = await h.wait_signal(is_signal("InterfacesRemoved", "/org/smcd", path))
        removed = [m.body[0] for m in h.signals if m.member == "InterfacesRemoved"]
        assert removed == [LINK, LGR, CONN]
        objects = await h.managed_objects()
        assert not {LGR, LINK, CONN} & set(objects)

    scenario(session_bus, body)


def test_device_changes_reach_subscribers(session_bus: DbusDaemon) -> None:
    async def body(h: Harness) -> None:
        h.inventory.apply_link(veth_device(up=False))
        msg, waited = await h.wait_signal(props_changed(VETH, "org.smcd.Device1"))
        assert changed_values(msg) == {
            "OperState": "DOWN",
            "Up": False,
            "AdminUp": False,
            "Carrier": False,
        }
        assert waited < SIGNAL_TIMEOUT
        h.inventory.remove_link(7)
        await h.wait_signal(is_signal("InterfacesRemoved", "/org/smcd", VETH))
        h.inventory.apply_link(veth_device(name="veth-b"))
        msg, _ = await h.wait_signal(
            is_signal("InterfacesAdded", "/org/smcd", device_path("veth-b"))
        )
        assert msg.body[1]["org.smcd.Device1"]["Name"].value == "veth-b"

    scenario(session_bus, body)


def test_a_vlan_netdev_shows_its_vlan_id(session_bus: DbusDaemon) -> None:
    """A VLAN netdev's id (rtnetlink's IFLA_VLAN_ID) on the bus and in ``smcctl device show``'s
    details; every other device says -1."""

    async def body(h: Harness) -> None:
        vlan = dataclasses.replace(veth_device(), ifindex=8, name="veth-a.10", kind="vlan")
        h.inventory.apply_link(dataclasses.replace(vlan, vlan_id=10, link=7))
        path = device_path("veth-a.10")
        await h.wait_signal(is_signal("InterfacesAdded", "/org/smcd", path))
        devices = {p: i["org.smcd.Device1"] for p, i in (await h.managed_objects()).items()}
        assert devices[path]["VlanId"] == 10 and devices[VETH]["VlanId"] == -1
        assert devices[device_path("loopback-ism")]["VlanId"] == -1
        assert "vlan id 10" in device_detail(devices[path])
        assert device_detail(devices[VETH]) == "mtu 1500, carrier on, veth"

    scenario(session_bus, body)


def test_pnet_round_trip(session_bus: DbusDaemon) -> None:
    async def body(h: Harness) -> None:
        reply = await h.manager("PnetAdd", "sssy", ["net1", "veth-a", "", 0])
        # Structs arrive as tuples in dbus-fast.
        assert reply.body == [[("NET1", "veth-a", "", 0)]]
        reply = await h.manager("PnetAdd", "sssy", ["Net2", "", "loopback-ism", 0])
        assert reply.body == [[("NET2", "", "loopback-ism", 1)]]
        assert (await h.manager("PnetList")).body == [
            [("NET1", "veth-a", "", 0), ("NET2", "", "loopback-ism", 1)]
        ]
        # The table itself, the Manager1 property and the devices' PNETIDs follow.
        assert [e.pnetid for e in h.pnet.entries()] == ["NET1", "NET2"]
        msg, _ = await h.wait_signal(
            lambda m: props_changed(VETH, "org.smcd.Device1")(m) and "PnetId" in m.body[1]
        )
        assert changed_values(msg) == {"PnetId": "NET1"}
        (ism_pnet,) = await h.ok(
            device_path("loopback-ism"), PROPS, "Get", "ss", ["org.smcd.Device1", "PnetId"]
        )
        assert ism_pnet.value == "NET2"
        msg, _ = await h.wait_signal(props_changed("/org/smcd", MANAGER))
        assert "PnetEntries" in msg.body[1]

        assert (await h.manager("PnetRemove", "s", ["net1"])).body == [1]
        assert (await h.manager("PnetFlush")).body == [1]
        assert (await h.manager("PnetList")).body == [[]]
        assert h.changes == ["pnet"] * 4

        # The same through busctl, the way an operator would do it.
        pnet_add = busctl(h.address, "call", "org.smcd", "/org/smcd", MANAGER, "PnetAdd", "sssy")
        out = await run([*pnet_add, "net3", "lo", "", "0"])
        assert out.returncode == 0 and '"NET3" "lo" "" 0' in out.stdout, out

    scenario(session_bus, body)


def test_invalid_requests_give_clear_errors(session_bus: DbusDaemon) -> None:
    async def body(h: Harness) -> None:
        async def invalid(member: str, signature: str, args: list[Any], *needles: str) -> None:
            reply = await h.manager(member, signature, args)
            assert reply.message_type is MessageType.ERROR, reply.body
            assert reply.error_name == ERROR_INVALID, (reply.error_name, reply.body)
            for needle in needles:
                assert needle in reply.body[0], (needle, reply.body)

        await invalid("PnetAdd", "sssy", ["net!", "veth-a", "", 0], "'net!'", "letters A-Z")
        await invalid("PnetAdd", "sssy", ["A" * 17, "veth-a", "", 0], "at most 16")
        await invalid("PnetAdd", "sssy", ["NET1", "", "", 0], "names no device")
        await invalid("PnetAdd", "sssy", ["NET1", "", "rxe0", 3], "port 3 is out of range")
        await h.manager("PnetAdd", "sssy", ["NET1", "veth-a", "", 0])
        await invalid("PnetAdd", "sssy", ["NET2", "veth-a", "", 0], "already has PNETID NET1")
        await invalid("PnetRemove", "s", ["NET9"], "NET9 is not in the PNET table")
        await invalid("UeidAdd", "s", ["-bad"], "first character")
        await invalid("UeidRemove", "s", ["NOPE"], "not defined")
        await invalid("SeidEnable", "", [], "not supported on this host")
        # Nothing invalid touched the table, and only the one good add was reported.
        assert [e.pnetid for e in h.pnet.entries()] == ["NET1"]
        assert h.changes == ["pnet"]
        # What busctl users see: the message itself.
        pnet_add = busctl(h.address, "call", "org.smcd", "/org/smcd", MANAGER, "PnetAdd", "sssy")
        out = await run([*pnet_add, "net!", "lo", "", "0"])
        assert out.returncode != 0 and "may only contain the letters A-Z" in out.stderr, out

    scenario(session_bus, body)


def test_ueid_and_stats_methods(session_bus: DbusDaemon) -> None:
    async def body(h: Harness) -> None:
        assert (await h.manager("UeidAdd", "s", ["smc-test.1"])).body == ["SMC-TEST.1"]
        msg, _ = await h.wait_signal(props_changed("/org/smcd", MANAGER))
        assert changed_values(msg) == {"Ueids": ["SMC-TEST.1"]}
        assert (await h.manager("UeidList")).body == [["SMC-TEST.1"]]
        (info,) = await h.ok("/org/smcd", MANAGER, "GetInfo")
        assert info["Ueids"] == Variant("as", ["SMC-TEST.1"])
        assert (await h.manager("UeidRemove", "s", ["smc-test.1"])).body == ["SMC-TEST.1"]
        assert (await h.manager("UeidFlush")).body == [0]

        h.registry.stats.count_connection(SmcType.SMCD, ConnRole.CLIENT, 2)
        h.registry.stats.add_bytes(SmcType.SMCD, tx=1000)
        counters, _ = await h.ok("/org/smcd", MANAGER, "StatsGet")
        assert (counters["smcd.client.v2"], counters["smcd.tx_bytes"]) == (1, 1000)
        await h.ok("/org/smcd", MANAGER, "StatsReset")
        counters, fallbacks = await h.ok("/org/smcd", MANAGER, "StatsGet")
        assert set(counters.values()) == {0} and fallbacks == []
        assert h.changes == ["ueid", "ueid", "ueid", "stats"]

    scenario(session_bus, body)


def test_method_rechecks_caller_without_bus_policy(session_bus: DbusDaemon) -> None:
    """A session or private bus has no policy file: smcd itself must refuse mutations from a
    uid that is neither root nor its own, and still serve reads to it."""

    async def body(h: Harness) -> None:
        denied = await run(
            as_nobody(gdbus_call(h.address, f"{MANAGER}.PnetAdd", "'NET1'", "'lo'", "''", "0"))
        )
        assert denied.returncode != 0
        assert ERROR_ACCESS_DENIED in denied.stderr, denied
        assert "allowed only to uid 0" in denied.stderr and "uid 65534" in denied.stderr
        for method in ("StatsReset", "UeidFlush", "PnetFlush"):
            out = await run(as_nobody(gdbus_call(h.address, f"{MANAGER}.{method}")))
            assert out.returncode != 0 and ERROR_ACCESS_DENIED in out.stderr, (method, out)
        read = await run(as_nobody(gdbus_call(h.address, f"{MANAGER}.PnetList")))
        assert read.returncode == 0, read
        assert h.pnet.entries() == () and h.changes == []
        # The same call as root goes through.
        ok = await run(gdbus_call(h.address, f"{MANAGER}.PnetAdd", "'NET1'", "'lo'", "''", "0"))
        assert ok.returncode == 0, ok
        assert [e.netdev for e in h.pnet.entries()] == ["lo"]

    scenario(session_bus, body)
