"""The records of the SMC-R transport: its error, the RMB grant and alternate port it hands
out, and one link group's state (:class:`SmcrLgr`) as ``smcr.py`` and ``smcr_outputs.py`` use it.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from smcd_daemon.core.rmb import SmcrBuffer
from smcd_daemon.errors import SmcError
from smcd_daemon.protocol.linkgroup import LinkGroup, Role
from smcd_daemon.protocol.negotiate import LinkGroupRequest
from smcd_daemon.transport.smcr_conn import SmcrConnection
from smcd_daemon.transport.verbs import VerbsLink, VerbsPort
from smcd_daemon.wire.reasons import DeclineReason

__all__ = ["AltPort", "AltPortFinder", "SmcrGrant", "SmcrLgr", "SmcrTransportError", "port_name"]


class SmcrTransportError(SmcError):
    """A link group or RMB request failed; ``decline_reason`` names the CLC decline code."""

    def __init__(self, message: str, decline_reason: int = DeclineReason.INTERR) -> None:
        super().__init__(message)
        self.decline_reason = int(decline_reason)


@dataclass(frozen=True)
class SmcrGrant:
    """An RMB handed to a negotiation (``RmbGrant``): registered on link ``link_id``."""

    rkey: int
    vaddr: int
    size: int
    size_comp: int
    alert_token: int
    lgr_id: int
    rmb_id: int


@dataclass(frozen=True)
class AltPort:
    """A local RoCE port a link group may use for its second link (``smc_pnet_find_alt_roce``):
    the GID (and its table index) the link announces, and its netdev."""

    device: str
    port: int
    gid: bytes
    gid_index: int
    netdev: str


#: Finds the alternate ports for a new link group (the SMC-R service knows the inventory).
AltPortFinder = Callable[[LinkGroupRequest], Sequence[AltPort]]


@dataclass(eq=False)
class SmcrLgr:
    """One SMC-R link group as the transport runs it: its LLC machine, verbs links, RMBs,
    connections and send queues."""

    fsm: LinkGroup
    lgr_id: int
    version: int
    role: Role
    peer_system_id: bytes
    vlan_id: int
    uses_gateway: bool
    ports: dict[str, VerbsPort]
    gid_index: dict[str, int]
    netdevs: dict[str, str] = field(default_factory=dict)
    links: dict[int, VerbsLink] = field(default_factory=dict)
    peer_macs: dict[int, bytes] = field(default_factory=dict)
    rmbs: dict[int, SmcrBuffer] = field(default_factory=dict)
    free_rmbs: list[int] = field(default_factory=list)
    conns: dict[int, SmcrConnection] = field(default_factory=dict)
    llc_q: dict[int, deque[bytes]] = field(default_factory=dict)
    send_q: dict[int, deque[SmcrConnection]] = field(default_factory=dict)
    first: asyncio.Future[str | None] | None = None
    confirmed: bool = False
    timer: asyncio.TimerHandle | None = None
    free_timer: asyncio.TimerHandle | None = None
    next_rmb: int = 0
    gone: bool = False


def port_name(vl: VerbsLink) -> str:
    """The ``device:port`` name of a link's port (the key of MR registrations)."""
    return f"{vl.port.device}:{vl.port.port}"
