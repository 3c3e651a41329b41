"""What a negotiation starts from: this host's facts, the ports through which it takes DMBs,
RMBs and link groups, and the :class:`Offer` both roles read (the kernel's ``smc_init_info``).

Two kinds of facts build an offer: :class:`NegotiationFacts` (SMC-Dv2 over loopback-ism alone,
what the handoff server offers) and :class:`SmcrFacts` (SMC-R v1/v2, optionally with an SMC-D
half). Resources come through ``Protocol`` ports, so this package imports nothing above it.
"""

from __future__ import annotations

import functools
import ipaddress
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from smc_handoff.layout import SMC_BUF_MIN
from smcd_daemon.protocol.linkgroup import Role
from smcd_daemon.protocol.negotiate.outcome import NegotiationError
from smcd_daemon.protocol.smcr_route import GidChoice, PortLike, RoutingFacts, match_ueid
from smcd_daemon.wire.clc import IpPrefixes, IsmDevice

__all__ = [
    "CLC_WAIT_TIME",
    "CLC_WAIT_TIME_SHORT",
    "IB_MTU_MAX",
    "IB_MTU_MIN",
    "SMC_CONN_PER_LGR_MAX",
    "SMC_CONN_PER_LGR_MIN",
    "SMC_FEATURE_MASK",
    "SMC_LINKS_ADD_LNK_MAX",
    "SMC_LINKS_ADD_LNK_MIN",
    "SMC_RELEASE",
    "SMC_SPF_EMULATED_ISM_DEV",
    "DmbGrant",
    "Eids",
    "FirstLink",
    "LinkGroupRequest",
    "LinkGroupView",
    "LinkView",
    "NegotiationFacts",
    "Offer",
    "RmbGrant",
    "SmcdHalf",
    "SmcdResources",
    "SmcrFacts",
    "SmcrResources",
    "common_ueid",
    "eid_field",
    "uncompress_bufsize",
    "wire_hostname",
]

CLC_WAIT_TIME = 6.0
"""Seconds to wait for each CLC message (``CLC_WAIT_TIME``, 2 * HZ * 3)."""
CLC_WAIT_TIME_SHORT = 1.0
"""Seconds to wait for a peer's Decline after the first link failed (``CLC_WAIT_TIME_SHORT``)."""
SMC_RELEASE = 1
"""Highest SMC v2 release we speak (``SMC_RELEASE_1``: v2.1)."""
SMC_SPF_EMULATED_ISM_DEV = 0x0001
SMC_FEATURE_MASK = SMC_SPF_EMULATED_ISM_DEV
"""Supplemental features we support (``SMC_FEATURE_MASK``)."""
SMC_CONN_PER_LGR_MIN = 16
SMC_CONN_PER_LGR_MAX = 255
SMC_LINKS_ADD_LNK_MIN = 1
SMC_LINKS_ADD_LNK_MAX = 2
IB_MTU_MIN = 1  # IB_MTU_256
IB_MTU_MAX = 5  # IB_MTU_4096

IPAddr = ipaddress.IPv4Address | ipaddress.IPv6Address

_NOT_PRINTABLE = re.compile(r"[^\x21-\x7e]")


def wire_hostname(name: str) -> str:
    """The FCE host name: printable ASCII, at most 32 bytes (the kernel copies the nodename)."""
    return _NOT_PRINTABLE.sub("", name)[:32]


def uncompress_bufsize(comp: int) -> int:
    """Bytes of a compressed DMB/RMB size class (``smc_uncompress_bufsize``): 16 KiB << n."""
    return 1 << (comp + 14)


def eid_field(eid: str) -> bytes:
    """An EID as its 32-byte blank-padded wire field (how ``smc_clc_match_eid`` compares)."""
    return eid.encode("latin-1")[:32].ljust(32, b" ")


@functools.lru_cache(maxsize=64)
def common_ueid(peer: tuple[str, ...], ours: tuple[str, ...]) -> str | None:
    """The first of the peer's UEIDs, in its order, that we have too (``smc_clc_match_eid``).
    Cached: every Proposal from one host carries the same list."""
    got = match_ueid([eid_field(u) for u in ours], [eid_field(e) for e in peer])
    return None if got is None else got.rstrip(b" \0").decode("ascii", "replace")


class Eids(Protocol):
    """The EID table as a negotiation reads it (``core.eid.EidTable``)."""

    @property
    def ueids(self) -> tuple[str, ...]: ...

    @property
    def seid(self) -> str | None: ...

    @property
    def seid_enabled(self) -> bool: ...

    def ueids_wire(self) -> tuple[bytes, ...]: ...


# ---------------------------------------------------------------------------- SMC-D
class DmbGrant(Protocol):
    """A DMB registered or attached: its token and size in bytes and compressed."""

    @property
    def token(self) -> int: ...

    @property
    def size(self) -> int: ...

    @property
    def size_comp(self) -> int: ...


class SmcdResources(Protocol):
    """What a negotiation needs from the loopback device for one connection. DMB failures
    raise :class:`~smcd_daemon.errors.SmcError`; a ``decline_reason`` attribute on it names the
    decline code (else MEM)."""

    def pairing_verified(self) -> bool:
        """Server: this daemon holds the client half of this TCP connection."""
        ...

    def pairing_confirmed(self) -> bool:
        """Client: a server half of this daemon claimed our half."""
        ...

    def find_link_group(self, peer_gid: int) -> int | None: ...

    def create_link_group(self, peer_gid: int) -> int: ...

    def discard_link_group(self, link_id: int) -> None: ...

    def register_dmb(self, size: int, min_size: int) -> DmbGrant: ...

    def unregister_dmb(self, token: int) -> None: ...

    def attach_dmb(self, token: int) -> DmbGrant: ...

    def detach_dmb(self, token: int) -> None: ...


@dataclass(frozen=True)
class NegotiationFacts:
    """What this host offers for SMC-D. ``loopback`` is our loopback-ism device (None when
    absent or disabled); ``dmb_size``/``min_dmb_size`` bound the DMB we register;
    ``prefix_match`` is the server's IP prefix check (``smc_clc_prfx_match``), which only
    matters for v1 paths."""

    eids: Eids
    loopback: IsmDevice | None
    smcd_enabled: bool = True
    hostname: str = ""
    dmb_size: int = 64 * 1024
    min_dmb_size: int = SMC_BUF_MIN
    clc_wait: float = CLC_WAIT_TIME
    peer_speaks_smc: bool = True
    prefix_match: bool = True

    @classmethod
    def from_config(
        cls,
        config: object,
        eids: Eids,
        loopback: IsmDevice | None,
        *,
        hostname: str = "",
        peer_speaks_smc: bool = True,
    ) -> NegotiationFacts:
        """From a :class:`smcd_daemon.config.Config` (``modes``, ``buffers``, ``timeouts``)."""
        buffers = config.buffers  # type: ignore[attr-defined]
        size = min(max(buffers.default_dmb_size, buffers.min_dmb_size), buffers.max_dmb_size)
        return cls(
            eids=eids,
            loopback=loopback,
            smcd_enabled=config.modes.smcd_loopback,  # type: ignore[attr-defined]
            hostname=hostname,
            dmb_size=size,
            min_dmb_size=buffers.min_dmb_size,
            clc_wait=config.timeouts.clc_wait,  # type: ignore[attr-defined]
            peer_speaks_smc=peer_speaks_smc,
        )

    @property
    def wire_hostname(self) -> str:
        return wire_hostname(self.hostname)

    @property
    def has_loopback(self) -> bool:
        return self.smcd_enabled and self.loopback is not None

    @functools.cached_property
    def offer(self) -> Offer:
        """SMC-Dv2 alone (built once per facts: the handoff server reuses its facts)."""
        return Offer(
            eids=self.eids,
            hostname=self.wire_hostname,
            clc_wait=self.clc_wait,
            peer_speaks_smc=self.peer_speaks_smc,
            prefix_match=self.prefix_match,
            ism=self,
        )


@dataclass(frozen=True)
class SmcdHalf:
    """The SMC-D (loopback-ism) half of a combined R+D offer: its device facts and resources."""

    facts: NegotiationFacts
    resources: SmcdResources


# ---------------------------------------------------------------------------- SMC-R
class RmbGrant(Protocol):
    """An RMB registered on the link the connection uses: its rkey and address there, size in
    bytes and compressed (16 KiB << n), and the connection's RMBE alert token (unique)."""

    @property
    def rkey(self) -> int: ...
    @property
    def vaddr(self) -> int: ...
    @property
    def size(self) -> int: ...
    @property
    def size_comp(self) -> int: ...
    @property
    def alert_token(self) -> int: ...


@dataclass(frozen=True)
class LinkView:
    """One link of an existing link group, as the link group layer sees it: our QP's facts
    (``qpn``, ``psn``, ``mtu`` = the link's path MTU enum, ``gid``/``mac`` of our port) and the
    peer's end (``peer_qpn``, ``peer_gid``, ``peer_mac``). ``active``: ``smc_link_active``."""

    link_id: int
    qpn: int
    psn: int
    mtu: int
    gid: bytes
    mac: bytes
    peer_qpn: int
    peer_gid: bytes
    peer_mac: bytes
    active: bool = True


@dataclass(frozen=True)
class LinkGroupView:
    """An existing SMC-R link group, for the reuse decision of ``smc_conn_create``.
    ``sync_err``: terminating after an out-of-sync Decline; ``rtokens_full``: no rtoken slot
    left (``SMC_RMBS_PER_LGR_MAX``)."""

    lgr_id: int
    role: Role
    version: int
    peer_system_id: bytes
    vlan_id: int
    conns: int
    max_conns: int
    links: tuple[LinkView, ...]
    sync_err: bool = False
    rtokens_full: bool = False


@dataclass(frozen=True)
class LinkGroupRequest:
    """Create a link group and its first link's RC QP (INIT state) on ``local`` - what
    ``smc_lgr_create``/``smcr_link_init`` get from ``smc_init_info``."""

    role: Role
    version: int
    peer_system_id: bytes
    peer_gid: bytes
    peer_mac: bytes
    vlan_id: int
    local: GidChoice
    local_mac: bytes
    max_conns: int
    max_links: int
    release: int
    uses_gateway: bool
    nexthop_mac: bytes | None


@dataclass(frozen=True)
class FirstLink:
    """The created link group: its id and the first link's id and QP facts (``mtu`` = the IB
    MTU enum of the port, 1=256 ... 5=4096)."""

    lgr_id: int
    link_id: int
    qpn: int
    psn: int
    mtu: int


class SmcrResources(Protocol):
    """What an SMC-R negotiation needs from the link group layer and the RMB pool. Failures
    raise :class:`~smcd_daemon.errors.SmcError`; a ``decline_reason`` attribute on it names the
    decline code (else MEM for RMBs, INTERR for link groups, NOACTLINK for ``pick_link``)."""

    def link_groups(self) -> Iterable[LinkGroupView]: ...

    def pick_link(self, lgr_id: int) -> int:
        """Server: the link a new connection of this link group uses (``LinkGroup.pick_link``)."""
        ...

    def create_link_group(self, request: LinkGroupRequest) -> FirstLink: ...

    def discard_link_group(self, lgr_id: int) -> None: ...

    def allocate_rmb(self, lgr_id: int, link_id: int, size: int) -> RmbGrant: ...

    def release_rmb(self, grant: RmbGrant) -> None:
        """Give back an RMB :meth:`allocate_rmb` granted (the grant itself, as it was returned:
        the resource layer may need more of it than the alert token)."""
        ...


@dataclass(frozen=True)
class SmcrFacts:
    """What this host offers for one SMC-R connection.

    ``ports`` are the active RoCE ports of the CLC socket's netdev (PNETID or netdev match,
    ``DeviceInventory.smcr_ports_for``); ``routing`` answers addresses, routes and neighbours;
    ``local_addr`` is the CLC socket's own address (the SMC-Rv2 ``saddr``), ``vlan_id`` its
    VLAN (0 = none), ``ip_prefixes`` its subnet for the v1 prefix area (None: unknown, so no v1
    path is offered). ``smcr_v1``/``smcr_v2`` are the configured modes; ``max_conns`` /
    ``max_links`` the v2.1 limits (sysctls ``smcr_max_conns_per_lgr`` 16..255 and
    ``smcr_max_links_per_lgr`` 1..2); ``system_id`` the 8-byte ``local_systemid``;
    ``rmb_size`` the RMB size wanted. ``prefix_match`` is the server's IP prefix check
    (``smc_clc_prfx_match``) for v1 paths. ``smcd`` adds SMC-Dv2 over loopback-ism."""

    eids: Eids
    system_id: bytes
    ports: tuple[PortLike, ...]
    routing: RoutingFacts
    local_addr: IPAddr
    vlan_id: int = 0
    ip_prefixes: IpPrefixes | None = None
    smcr_v1: bool = True
    smcr_v2: bool = True
    max_conns: int = SMC_CONN_PER_LGR_MAX
    max_links: int = SMC_LINKS_ADD_LNK_MAX
    hostname: str = ""
    rmb_size: int = 64 * 1024
    clc_wait: float = CLC_WAIT_TIME
    peer_speaks_smc: bool = True
    prefix_match: bool = True
    smcd: SmcdHalf | None = None

    def __post_init__(self) -> None:
        if not SMC_CONN_PER_LGR_MIN <= self.max_conns <= SMC_CONN_PER_LGR_MAX:
            raise NegotiationError(
                f"max_conns {self.max_conns} outside {SMC_CONN_PER_LGR_MIN}..{SMC_CONN_PER_LGR_MAX}"
            )
        if not SMC_LINKS_ADD_LNK_MIN <= self.max_links <= SMC_LINKS_ADD_LNK_MAX:
            raise NegotiationError(
                f"max_links {self.max_links} outside "
                f"{SMC_LINKS_ADD_LNK_MIN}..{SMC_LINKS_ADD_LNK_MAX}"
            )
        if not isinstance(self.system_id, bytes) or len(self.system_id) != 8:
            raise NegotiationError("system_id must be 8 bytes (2 random + a RoCE port's MAC)")

    @property
    def wire_hostname(self) -> str:
        return wire_hostname(self.hostname)

    @property
    def has_loopback(self) -> bool:
        return self.smcd is not None and self.smcd.facts.has_loopback

    @functools.cached_property
    def offer(self) -> Offer:
        """SMC-R, with SMC-Dv2 when an SMC-D half is given; the common facts are these."""
        return Offer(
            eids=self.eids,
            hostname=self.wire_hostname,
            clc_wait=self.clc_wait,
            peer_speaks_smc=self.peer_speaks_smc,
            prefix_match=self.prefix_match,
            system_id=self.system_id,
            ism=self.smcd.facts if self.smcd is not None else None,
            rdma=self,
        )


# ---------------------------------------------------------------------------- the offer
@dataclass(frozen=True)
class Offer:
    """One negotiation's starting point whatever its role and devices (``smc_init_info``):
    ``ism`` the SMC-D device facts (None: no SMC-D part), ``rdma`` the SMC-R facts (None: no
    RoCE here); ``system_id`` goes into every Decline (zeros without SMC-R, as before)."""

    eids: Eids
    hostname: str
    clc_wait: float
    peer_speaks_smc: bool
    prefix_match: bool
    system_id: bytes = bytes(8)
    ism: NegotiationFacts | None = None
    rdma: SmcrFacts | None = None

    @property
    def has_loopback(self) -> bool:
        """SMC-Dv2 over loopback-ism can be offered or accepted."""
        return self.ism is not None and self.ism.has_loopback

    @property
    def ism_v2_capable(self) -> bool:
        """``smc_ism_is_v2_capable``: a loopback-ism device is part of this negotiation (even
        when switched off), so a client's first Decline is v2."""
        return self.ism is not None
