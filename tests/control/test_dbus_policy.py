"""The shipped system-bus policy (config/dbus-1/org.smcd.conf) in a real dbus-daemon that has the
system bus's default-deny rules: root owns org.smcd and may change state; an unprivileged uid
(nobody, via setpriv) may read and introspect but is refused every mutation by the bus itself,
before smcd even sees the call."""

from __future__ import annotations

import asyncio
import logging
import xml.etree.ElementTree as ET
from collections.abc import Awaitable, Callable

import pytest

from smcd_daemon.adapters.dbus import ERROR_ACCESS_DENIED
from tests.control.dbusd import (
    POLICY_FILE,
    DbusDaemon,
    Harness,
    as_nobody,
    busctl,
    gdbus_call,
    run,
    smcd_on_bus,
)

MANAGER = "org.smcd.Manager1"
# dbus-daemon's own wording when a policy rule rejects a message; smcd's check says otherwise.
BUS_REJECTION = "Rejected send message"


def scenario(bus: DbusDaemon, body: Callable[[Harness], Awaitable[None]]) -> None:
    async def main() -> None:
        async with smcd_on_bus(bus.address) as h:
            await asyncio.wait_for(body(h), 40)

    asyncio.run(main())


def test_policy_file_is_deny_by_default() -> None:
    """Every allow for non-root users names a method or a read-only interface; nothing grants
    a blanket send to org.smcd except to root."""
    root = ET.parse(POLICY_FILE).getroot()
    policies = root.findall("policy")
    default = next(p for p in policies if p.get("context") == "default")
    rules = list(default)
    assert rules[0].tag == "deny" and rules[0].get("own") == "org.smcd"
    assert rules[1].tag == "deny" and rules[1].get("send_destination") == "org.smcd"
    allowed = {(r.get("send_interface"), r.get("send_member")) for r in rules if r.tag == "allow"}
    assert all(iface for iface, _ in allowed)
    mutators = {
        "PnetAdd",
        "PnetRemove",
        "PnetFlush",
        "UeidAdd",
        "UeidRemove",
        "UeidFlush",
        "SeidEnable",
        "SeidDisable",
        "StatsReset",
    }
    assert not {m for _, m in allowed} & (mutators | {"Set"})
    assert (MANAGER, None) not in allowed
    root_policy = next(p for p in policies if p.get("user") == "root")
    assert {r.get("own") for r in root_policy if r.tag == "allow"} >= {"org.smcd"}


def test_unprivileged_denied_by_policy_root_allowed(system_bus: DbusDaemon) -> None:
    async def body(h: Harness) -> None:
        a = h.address
        # Mutations as nobody: refused by the bus (policy), never reaching smcd.
        denied_calls = [
            (f"{MANAGER}.PnetAdd", "'NET1'", "'lo'", "''", "0"),
            (f"{MANAGER}.PnetRemove", "'NET1'"),
            (f"{MANAGER}.PnetFlush",),
            (f"{MANAGER}.UeidAdd", "'SMC1'"),
            (f"{MANAGER}.UeidFlush",),
            (f"{MANAGER}.StatsReset",),
            ("org.freedesktop.DBus.Properties.Set", f"'{MANAGER}'", "'Version'", "<'x'>"),
        ]
        for method, *args in denied_calls:
            out = await run(as_nobody(gdbus_call(a, method, *args)))
            assert out.returncode != 0, (method, out)
            assert ERROR_ACCESS_DENIED in out.stderr and BUS_REJECTION in out.stderr, (method, out)
        assert h.pnet.entries() == () and h.changes == []

        # Reads as nobody: allowed.
        for method in (f"{MANAGER}.PnetList", f"{MANAGER}.GetInfo", f"{MANAGER}.StatsGet"):
            out = await run(as_nobody(gdbus_call(a, method)))
            assert out.returncode == 0, (method, out)
        out = await run(
            as_nobody(gdbus_call(a, "org.freedesktop.DBus.ObjectManager.GetManagedObjects"))
        )
        assert out.returncode == 0 and "org.smcd.Device1" in out.stdout, out
        out = await run(
            as_nobody(gdbus_call(a, "org.freedesktop.DBus.Properties.GetAll", f"'{MANAGER}'"))
        )
        assert out.returncode == 0 and "PnetEntries" in out.stdout, out
        out = await run(as_nobody(busctl(a, "introspect", "org.smcd", "/org/smcd")))
        assert out.returncode == 0 and "org.smcd.Manager1" in out.stdout, out

        # nobody cannot take the name either.
        out = await run(
            as_nobody(
                [
                    "dbus-send",
                    f"--bus={a}",
                    "--print-reply",
                    "--dest=org.freedesktop.DBus",
                    "/org/freedesktop/DBus",
                    "org.freedesktop.DBus.RequestName",
                    "string:org.smcd",
                    "uint32:4",
                ]
            )
        )
        assert out.returncode != 0 and ERROR_ACCESS_DENIED in out.stderr, out

        # The same mutation as root succeeds, through the same bus and policy.
        out = await run(gdbus_call(a, f"{MANAGER}.PnetAdd", "'NET1'", "'lo'", "''", "0"))
        assert out.returncode == 0 and "NET1" in out.stdout, out
        out = await run(busctl(a, "call", "org.smcd", "/org/smcd", MANAGER, "UeidAdd", "s", "smc1"))
        assert out.returncode == 0 and '"SMC1"' in out.stdout, out
        assert [e.pnetid for e in h.pnet.entries()] == ["NET1"]
        assert h.eids.ueids == ("SMC1",)
        assert h.changes == ["pnet", "ueid"]

    scenario(system_bus, body)


def test_no_reply_mutation_from_another_uid_is_refused_without_traceback(
    session_bus: DbusDaemon, caplog: pytest.LogCaptureFixture
) -> None:
    """A mutating call flagged NO_REPLY_EXPECTED (``busctl --expect-reply=no``) from another uid
    on a bus without policy: smcd refuses it and logs one line per kind (at most ten a minute),
    never dbus-fast's ERROR traceback (#14)."""
    caplog.set_level(logging.DEBUG)
    flood = 40

    async def body(h: Harness) -> None:
        a = h.address
        sends = [
            as_nobody(
                busctl(a, "--expect-reply=no", "call", "org.smcd", "/org/smcd", MANAGER, *call)
            )
            for call in [
                ("PnetAdd", "sssy", "NET1", "lo", "", "0"),
                ("UeidAdd", "s", "SMC1"),
                ("StatsReset",),
                ("SeidDisable",),
                ("PnetFlush",),
            ]
        ]
        for i in range(flood):
            out = await run(sends[i % len(sends)])
            assert out.returncode == 0, out  # sent; no reply was asked for
        # A root call through the same bus, answered after every call before it was handled
        # (the bus answers smcd's uid queries in order), then a moment for the done callbacks.
        out = await run(gdbus_call(a, f"{MANAGER}.PnetAdd", "'NET2'", "'lo'", "''", "0"))
        assert out.returncode == 0, out
        await asyncio.sleep(0.3)
        assert [e.pnetid for e in h.pnet.entries()] == ["NET2"]
        assert h.eids.ueids == () and h.changes == ["pnet"]

    scenario(session_bus, body)
    tracebacks = [r for r in caplog.records if r.exc_info is not None or r.levelno >= logging.ERROR]
    assert tracebacks == [], [(r.name, r.getMessage()) for r in tracebacks]
    refusals = [r.getMessage() for r in caplog.records if "expected no reply" in r.getMessage()]
    assert refusals, "the refusals were not logged at all"
    assert len(refusals) <= 11, refusals  # one burst (10) plus at most one summary line
    # AccessDenied, also when the caller left before smcd could ask the bus for its uid
    assert all(ERROR_ACCESS_DENIED in r and "changes smcd's state" in r for r in refusals[:-1])
