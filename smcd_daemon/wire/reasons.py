"""Decline and LLC reason codes, with what each means and what an operator should do about it.

SMC falls back to TCP silently from the application's point of view; the only trace is a 32-bit
reason code (our own, and the peer's ``peer_diagnosis`` from its CLC Decline). A code alone helps
nobody at 3 a.m., so every code here carries a one-line meaning and a sentence of advice: what to
check or change. Values are the Linux kernel's (``net/smc/smc_clc.h``, ``net/smc/smc_llc.h``), which
is what real peers send; codes from older kernels that were since renumbered are kept apart in
:class:`LegacyDeclineReason` so that a capture from an old peer still explains itself.

The top byte of a decline code is its *class* (0x01 resources, 0x02 timeout, 0x03 configuration,
...). An unknown code is still half-explained by its class, which :func:`explain` reports.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

from smcd_daemon.errors import SmcError
from smcd_daemon.wire.llc import AddLinkRejectReason, DeleteLinkReason

__all__ = [
    "CLASS_DESCRIPTIONS",
    "DELETE_LINK_KERNEL_NAMES",
    "AddLinkRejectReason",
    "DeclineReason",
    "DeleteLinkReason",
    "Explanation",
    "LegacyDeclineReason",
    "LocalReason",
    "ReasonCodeError",
    "class_of",
    "explain",
    "explain_add_link_reject",
    "explain_delete_link",
    "parse_code",
]


class ReasonCodeError(SmcError, ValueError):
    """A reason code that is not a 32-bit unsigned number (or text that does not spell one)."""


class DeclineReason(IntEnum):
    """CLC decline / fallback reason codes (``SMC_CLC_DECL_*``) as current Linux sends them."""

    MEM = 0x01010000
    TIMEOUT_CL = 0x02010000
    TIMEOUT_AL = 0x02020000
    CNFERR = 0x03000000
    PEERNOSMC = 0x03010000
    IPSEC = 0x03020000
    NOSMCDEV = 0x03030000
    NOSMCDDEV = 0x03030001
    NOSMCRDEV = 0x03030002
    NOISM2SUPP = 0x03030003
    NOV2EXT = 0x03030004
    NOV2DEXT = 0x03030005
    NOSEID = 0x03030006
    NOSMCD2DEV = 0x03030007
    NOUEID = 0x03030008
    RELEASEERR = 0x03030009
    MAXCONNERR = 0x0303000A
    MAXLINKERR = 0x0303000B
    MODEUNSUPP = 0x03040000
    RMBE_EC = 0x03050000
    OPTUNSUPP = 0x03060000
    DIFFPREFIX = 0x03070000
    GETVLANERR = 0x03080000
    ISMVLANERR = 0x03090000
    NOACTLINK = 0x030A0000
    NOSRVLINK = 0x030B0000
    VERSMISMAT = 0x030C0000
    MAX_DMB = 0x030D0000
    NOROUTE = 0x030E0000
    NOINDIRECT = 0x030F0000
    SYNCERR = 0x04000000
    PEERDECL = 0x05000000
    INTERR = 0x09990000
    ERR_RTOK = 0x09990001
    ERR_RDYLNK = 0x09990002
    ERR_REGBUF = 0x09990003


class LocalReason(IntEnum):
    """smcd's own fallback codes (class 0xFF, which the kernel never uses).

    They describe why a connection stayed on TCP before any SMC peer was involved, so they never
    travel in a CLC Decline. The values are defined by the client library (``smc_handoff.messages``
    ``FALLBACK_*``); a test keeps the two in step.
    """

    DAEMON_UNAVAILABLE = 0xFF000001
    DAEMON_ERROR = 0xFF000002
    CHANNEL_UNSUPPORTED = 0xFF000003
    DETACHED = 0xFF000004
    DAEMON_BUSY = 0xFF000005
    CLOSED_UNANSWERED = 0xFF000006


class LegacyDeclineReason(IntEnum):
    """Codes only older Linux peers send (the 2017 v1 header and the 0x9999 internal range).

    The 2017 header also used 0x03030000 for IPsec; that value now means NOSMCDEV and is explained
    there. Names carry the kernel's old spelling.
    """

    TIMEOUT = 0x02000000
    TCL = 0x02040000
    REPLY = 0x06000000
    SEND = 0x07000000
    INTERR_OLD = 0x99990000
    ERR_RTOK_OLD = 0x99990001
    ERR_RDYLNK_OLD = 0x99990002
    ERR_REGRMB_OLD = 0x99990003


# DELETE LINK reasons and the ADD LINK reject reason are defined once, in the LLC codec that
# decodes them; these are the kernel's names for them (``SMC_LLC_DEL_*``), which is what an
# operator greps kernel sources and mailing lists for.
DELETE_LINK_KERNEL_NAMES: dict[DeleteLinkReason, str] = {
    DeleteLinkReason.LOST_PATH: "SMC_LLC_DEL_LOST_PATH",
    DeleteLinkReason.OPERATOR_TERMINATION: "SMC_LLC_DEL_OP_INIT_TERM",
    DeleteLinkReason.PROGRAM_TERMINATION: "SMC_LLC_DEL_PROG_INIT_TERM",
    DeleteLinkReason.PROTOCOL_VIOLATION: "SMC_LLC_DEL_PROT_VIOL",
    DeleteLinkReason.NO_ASYMMETRIC_NEEDED: "SMC_LLC_DEL_NO_ASYM_NEEDED",
    DeleteLinkReason.UNKNOWN_LINK: "SMC_LLC_DEL_NOLNK",
    DeleteLinkReason.UNKNOWN_LINK_GROUP: "SMC_LLC_DEL_NOLGR",
}


@dataclass(frozen=True, slots=True)
class Explanation:
    """What a reason code means, for people: the CLI prints it, D-Bus and logs carry it."""

    code: int
    kind: str
    name: str | None
    meaning: str
    advice: str
    class_byte: int
    class_description: str

    @property
    def known(self) -> bool:
        return self.name is not None

    @property
    def code_hex(self) -> str:
        return f"0x{self.code:08x}"


# Top byte of a CLC decline code → what that class of failure is. Derived from the kernel table:
# every code of a class shares one cause family; 0x06/0x07/0x99 are from the 2017 header.
CLASS_DESCRIPTIONS: dict[int, str] = {
    0x00: "no decline class: not a CLC decline code (LLC DELETE LINK reasons use it)",
    0x01: "resources: the declining side ran out of memory or buffers",
    0x02: "timeout: an expected message did not arrive in time (RDMA path or LLC exchange)",
    0x03: "configuration: the two ends' SMC setup (devices, pnet, EIDs, versions) do not match",
    0x04: "synchronisation: the peers' link group state diverged; the link group is torn down",
    0x05: "peer decline: the peer sent a CLC Decline; its own diagnosis says why",
    0x06: "reply (Linux before 4.16): an answer to a received Decline",
    0x07: "send (Linux before 4.16): a CLC message could not be sent",
    0x09: "internal: a local failure of the SMC stack (RDMA setup, registration)",
    0x99: "internal (older Linux numbering): a local failure of the SMC stack",
    0xFF: "smcd local: the connection stayed on TCP before any SMC peer was asked",
}

_LOCAL: dict[int, tuple[str, str]] = {
    LocalReason.DAEMON_UNAVAILABLE: (
        "no smcd daemon answered the handoff (socket missing, refused, timed out or not trusted)",
        "Start smcd (systemctl start smcd.socket smcd.service) or point SMCD_HANDOFF_SOCKET at "
        "its handoff socket; the application keeps working on TCP meanwhile.",
    ),
    LocalReason.DAEMON_ERROR: (
        "smcd answered the handoff with an error or a reply the library could not understand",
        "Look at smcd's log (journalctl -u smcd) for the refused request; check that the "
        "application's smc_handoff and the daemon are the same version.",
    ),
    LocalReason.CHANNEL_UNSUPPORTED: (
        "this machine cannot run the shared-memory channel (the library did not ask the daemon)",
        "The shared-memory ring needs Linux memfd/eventfd on a supported CPU; nothing to tune.",
    ),
    LocalReason.DETACHED: (
        "the application detached the TCP socket before any data moved (ssl does this)",
        "Expected for TLS: the TLS session runs over TCP. Nothing to do.",
    ),
    LocalReason.DAEMON_BUSY: (
        "smcd was too busy to start a handshake (its handshake capacity, this user's fair share "
        "of it, or its event loop running late) and handed the socket back before any CLC byte",
        "Transient under load; if it persists, raise [limits] handshakes or overload_lag in "
        "smcd.toml, or find what keeps smcd busy (smcctl stats).",
    ),
    LocalReason.CLOSED_UNANSWERED: (
        "the application closed the socket before smcd answered its handoff (e.g. a port check "
        "that connects and closes), so the library gave the handoff up",
        "Expected for connections closed at once; no data moved and the peer read TCP's EOF.",
    ),
}

_DECLINE: dict[int, tuple[str, str]] = {
    DeclineReason.MEM: (
        "insufficient memory resources (RMB/DMB, send buffer or link group allocation failed)",
        "Check free memory and buffer limits on the declining side: smcd's per-user pool quotas, "
        "the net.smc.wmem/rmem buffer sizes, and for SMC-R the memlock limit (ulimit -l).",
    ),
    DeclineReason.TIMEOUT_CL: (
        "timeout waiting for the LLC CONFIRM LINK over the new RDMA link",
        "RDMA traffic does not flow between the RoCE ports: check both ports are up (rdma link), "
        "share the L2 network/VLAN (SMC-Rv1) or are routable (SMC-Rv2), the MTUs match and "
        "nothing drops RoCEv2 (UDP port 4791).",
    ),
    DeclineReason.TIMEOUT_AL: (
        "timeout waiting for the LLC ADD LINK exchange of a new link group",
        "The second RoCE path did not answer: check the alternate RoCE port, its PNET ID and "
        "cabling; with a single port set net.smc.smcr_max_links_per_lgr to 1 on both ends.",
    ),
    DeclineReason.CNFERR: (
        "configuration error (generic)",
        "Compare the SMC setup of both ends: devices (smcctl device), pnet table (smcctl pnet), "
        "UEIDs (smcctl ueid) and the SMC modes each side enables.",
    ),
    DeclineReason.PEERNOSMC: (
        "peer did not indicate SMC: its SYN/SYN-ACK lacked the SMC TCP option (kind 254, E2D4C3D9)",
        "Is SMC enabled on the peer, and is the peer's listener SMC-enabled (AF_SMC/IPPROTO_SMC, "
        "smc_run, or registered with smcd)? Middleboxes that strip TCP options also cause this.",
    ),
    DeclineReason.IPSEC: (
        "the TCP connection uses IPsec, which SMC would bypass",
        "Exempt this traffic from the IPsec (xfrm) policy if shared memory/RDMA is trusted, or "
        "accept TCP for it.",
    ),
    DeclineReason.NOSMCDEV: (
        "no SMC device (neither SMC-R nor SMC-D) usable for this connection",
        "Check smcctl device: the netdev carrying the TCP connection must share a PNET ID with a "
        "RoCE or ISM device (smcctl pnet), or loopback-ism must be enabled on both ends (same "
        "host). Linux before 4.16 sent this value for IPsec usage.",
    ),
    DeclineReason.NOSMCDDEV: (
        "no SMC-D device found",
        "For same-host peers enable loopback-ism on both ends; on s390 check the ISM device is "
        "online and its PNET ID matches the netdev's (smcctl pnet).",
    ),
    DeclineReason.NOSMCRDEV: (
        "no SMC-R (RoCE) device found",
        "Check the RoCE device is up (rdma link), that its port's PNET ID matches the TCP "
        "connection's netdev (smcctl pnet), and for SMC-Rv1 that both peers are in one IP subnet.",
    ),
    DeclineReason.NOISM2SUPP: (
        "the ISM hardware/firmware has no ISMv2 support (SMC-Dv2 impossible)",
        "Upgrade the ISM firmware, or use SMC-Dv1 (peers in the same IP subnet) or SMC-R instead.",
    ),
    DeclineReason.NOV2EXT: (
        "peer sent no CLC v2 extension (it offers SMC v1 only)",
        "The path this side needs is v2-only (SMC-Dv2/loopback-ism, SMC-Rv2): upgrade the peer's "
        "SMC stack or enable v2 devices there.",
    ),
    DeclineReason.NOV2DEXT: (
        "peer sent no SMC-Dv2 extension (it offers no SMC-Dv2 device)",
        "Enable loopback-ism or an ISMv2 device on the peer, or rely on SMC-R.",
    ),
    DeclineReason.NOSEID: (
        "peer sent no system EID (SEID)",
        "Linux disables the SEID except on s390, so SMC-Dv2 (loopback-ism included) needs a "
        "common UEID: set one on both ends with smcctl ueid add (kernel peer: smcd ueid add).",
    ),
    DeclineReason.NOSMCD2DEV: (
        "no SMC-Dv2 device matches one the peer offered (or no common EID)",
        "Set a common UEID on both ends with smcctl ueid add, and check that loopback-ism/ISMv2 "
        "is enabled on both (smcctl device).",
    ),
    DeclineReason.NOUEID: (
        "peer sent no user EID (UEID) and the system EIDs do not match",
        "Set a common UEID on both ends with smcctl ueid add (kernel SMC peer: smcd ueid add).",
    ),
    DeclineReason.RELEASEERR: (
        "SMC v2.x release negotiation failed (Confirm did not echo the accepted release)",
        "Run consistent SMC releases on both ends; if both are current this is a peer bug worth "
        "reporting with a capture (smcctl decode shows the release fields).",
    ),
    DeclineReason.MAXCONNERR: (
        "max connections per link group negotiated below the minimum of 16",
        "Raise net.smc.smcr_max_conns_per_lgr (16..255) on the side that offers the low value.",
    ),
    DeclineReason.MAXLINKERR: (
        "max links per link group negotiation failed (not within 1..2)",
        "Set net.smc.smcr_max_links_per_lgr to 1 or 2 on both ends.",
    ),
    DeclineReason.MODEUNSUPP: (
        "the SMC modes do not match (one side offers only SMC-R, the other only SMC-D)",
        "Give both ends a common mode: matching RoCE devices and PNET IDs, or SMC-D "
        "(loopback-ism/ISM) on both.",
    ),
    DeclineReason.RMBE_EC: (
        "peer requires eyecatchers in the RMB elements, which this side does not support",
        "Configure the peer (typically z/OS) not to use RMBE eyecatchers.",
    ),
    DeclineReason.OPTUNSUPP: (
        "a socket option SMC cannot honour is set (e.g. TCP Fast Open)",
        "Do not set TCP_FASTOPEN (or similar TCP-only options) on sockets that should use SMC.",
    ),
    DeclineReason.DIFFPREFIX: (
        "IP prefix/subnet mismatch: the peer's proposed prefixes do not match this interface",
        "SMC-Rv1 and SMC-Dv1 need both peers in one IP subnet: put them in the same subnet, or "
        "use v2 (SMC-Rv2 with routing, SMC-Dv2 with a common UEID).",
    ),
    DeclineReason.GETVLANERR: (
        "could not determine the VLAN id of the interface carrying the TCP connection",
        "Check the netdev stacking (VLAN over bond/bridge) of the connection's interface.",
    ),
    DeclineReason.ISMVLANERR: (
        "registering the VLAN id with the ISM device failed",
        "The ISM device's VLAN table is full or refuses the id: reduce the VLANs in use or move "
        "to ISMv2.",
    ),
    DeclineReason.NOACTLINK: (
        "no active SMC-R link in the link group",
        "Links are down or failing over: check the RoCE ports' state (rdma link, smcctl "
        "linkgroup); new connections retry once a link is back.",
    ),
    DeclineReason.NOSRVLINK: (
        "the SMC-R link named by the server was not found in the client's link group",
        "The client's link group is stale (server restarted, link replaced): it is rebuilt; if "
        "this persists, check both ends see the same RoCE devices.",
    ),
    DeclineReason.VERSMISMAT: (
        "SMC version mismatch (e.g. Accept carries a version or release the client did not offer)",
        "Upgrade the older end; check that both run a consistent SMC v1/v2 level.",
    ),
    DeclineReason.MAX_DMB: (
        "SMC-D DMB limit exceeded (too many concurrent SMC-D connections)",
        "Reduce concurrent SMC-D connections or raise the DMB limit (smcd: DMB pool quota).",
    ),
    DeclineReason.NOROUTE: (
        "SMC-Rv2: no route from the local RoCE netdev to the peer's RoCE address",
        "Check routing between the RoCE netdevs: ip route get <peer RoCE IP> from <local RoCE "
        "IP> must succeed, and the RoCE netdevs must have their IP addresses.",
    ),
    DeclineReason.NOINDIRECT: (
        "SMC-Rv2: the peer says its path is indirect (via a gateway) but this side finds it direct",
        "Make routing between the RoCE netdevs symmetric: both ends attached to one subnet, or "
        "both reaching the other through a gateway.",
    ),
    DeclineReason.SYNCERR: (
        "synchronisation error: the link group state of the peers diverged",
        "The receiving side terminates the link group; usually transient after a failure. If it "
        "repeats, collect smcd logs from both ends.",
    ),
    DeclineReason.PEERDECL: (
        "the peer declined during the handshake (local code recorded when a Decline arrives)",
        "Look at the peer's diagnosis code (smcctl conns shows it) and explain that one.",
    ),
    DeclineReason.INTERR: (
        "internal error in the SMC stack",
        "Check the daemon's (or kernel's) log at the time of the decline.",
    ),
    DeclineReason.ERR_RTOK: (
        "rtoken handling failed (the peer's RMB key could not be set up)",
        "Check the RDMA device's health and logs; report a bug with both ends' logs.",
    ),
    DeclineReason.ERR_RDYLNK: (
        "bringing the RDMA link's queue pair to ready failed",
        "Check the RoCE device state, its GID table (rdma link, ibv_devinfo -v) and the MTU.",
    ),
    DeclineReason.ERR_REGBUF: (
        "registering the RMB/send buffer with the RDMA device failed",
        "Check memlock limits (ulimit -l), the device's memory-region limits and its health.",
    ),
}

_LEGACY: dict[int, tuple[str, str]] = {
    LegacyDeclineReason.TIMEOUT: (
        "timeout (Linux before 4.16)",
        "The RDMA path did not answer: check the RoCE ports and the network between them; "
        "upgrade the peer for precise codes.",
    ),
    LegacyDeclineReason.TCL: (
        "timeout waiting for QP confirm (Linux before 4.16; now 0x02010000)",
        "RDMA traffic does not flow between the RoCE ports: check ports, VLAN and MTU.",
    ),
    LegacyDeclineReason.REPLY: (
        "reply to a received decline (Linux before 4.16)",
        "Look at the Decline that came first: its code is the real reason.",
    ),
    LegacyDeclineReason.SEND: (
        "sending a CLC message failed (Linux before 4.16)",
        "The TCP connection broke during the handshake: check the network and the peer.",
    ),
    LegacyDeclineReason.INTERR_OLD: (
        "internal error (older Linux numbering; now 0x09990000)",
        "Check the peer's kernel log at the time of the decline.",
    ),
    LegacyDeclineReason.ERR_RTOK_OLD: (
        "rtoken handling failed (older Linux numbering; now 0x09990001)",
        "Check the RDMA device's health on the peer.",
    ),
    LegacyDeclineReason.ERR_RDYLNK_OLD: (
        "ib ready link failed (older Linux numbering; now 0x09990002)",
        "Check the RoCE device state, GID table and MTU on the peer.",
    ),
    LegacyDeclineReason.ERR_REGRMB_OLD: (
        "registering the RMB failed (older Linux numbering; now 0x09990003)",
        "Check memlock limits and the RDMA device on the peer.",
    ),
}

_DELETE_LINK: dict[int, tuple[str, str]] = {
    DeleteLinkReason.LOST_PATH: (
        "lost path: the RDMA link failed (port down, QP error, TEST LINK unanswered)",
        "Check the RoCE port and cabling (rdma link); connections fail over to the other link.",
    ),
    DeleteLinkReason.OPERATOR_TERMINATION: (
        "operator-initiated termination (device removed, link group terminated by an admin)",
        "Nothing to fix if intended; otherwise find who removed the device or link group.",
    ),
    DeleteLinkReason.PROGRAM_TERMINATION: (
        "program-initiated termination (the SMC stack ended the link, e.g. on shutdown)",
        "Normal during daemon/module shutdown or link group cleanup.",
    ),
    DeleteLinkReason.PROTOCOL_VIOLATION: (
        "protocol violation: the peer sent an LLC message out of order or malformed",
        "Collect smcd logs and an LLC capture from both ends; this is a bug on one side.",
    ),
    DeleteLinkReason.NO_ASYMMETRIC_NEEDED: (
        "asymmetric link no longer needed (a symmetric link pair is now possible)",
        "Normal: the link group replaced an asymmetric link with a better one.",
    ),
    DeleteLinkReason.UNKNOWN_LINK: (
        "response: unknown link id",
        "The peer asked to delete a link this side does not know; usually a race, harmless.",
    ),
    DeleteLinkReason.UNKNOWN_LINK_GROUP: (
        "response: unknown link group",
        "The peer's link group is gone on this side; the peer will tear its part down.",
    ),
}

_ADD_LINK_REJECT: dict[int, tuple[str, str]] = {
    AddLinkRejectReason.NO_ALT_PATH: (
        "no alternate path: the peer has no second RoCE port/device for a redundant link",
        "Add a second RoCE port with the same PNET ID on the peer for redundancy, or accept a "
        "single link (net.smc.smcr_max_links_per_lgr = 1).",
    ),
}


def class_of(code: int) -> tuple[int, str]:
    """The class byte (top byte) of a decline code and what that class means."""
    top = (code >> 24) & 0xFF
    return top, CLASS_DESCRIPTIONS.get(top, f"unassigned class 0x{top:02x}")


def _check_u32(code: int) -> int:
    if isinstance(code, bool) or not isinstance(code, int) or not 0 <= code <= 0xFFFFFFFF:
        raise ReasonCodeError(f"reason code {code!r} is not a 32-bit unsigned number")
    return int(code)


def explain(code: int) -> Explanation:
    """Explain a 32-bit reason code: CLC decline (current or legacy), else LLC DELETE LINK.

    DELETE LINK reasons have class byte 0x00, which no decline code uses, so one number space
    serves both and ``smcctl explain`` needs no flag to tell them apart.
    """
    code = _check_u32(code)
    top, cls = class_of(code)
    if code in _DECLINE:
        meaning, advice = _DECLINE[code]
        name = f"SMC_CLC_DECL_{DeclineReason(code).name}"
        return Explanation(code, "CLC decline", name, meaning, advice, top, cls)
    if code in _LEGACY:
        meaning, advice = _LEGACY[code]
        name = f"SMC_CLC_DECL_{LegacyDeclineReason(code).name.removesuffix('_OLD')}"
        return Explanation(code, "CLC decline (older Linux)", name, meaning, advice, top, cls)
    if code in _DELETE_LINK:
        return explain_delete_link(code)
    if code in _LOCAL:
        meaning, advice = _LOCAL[code]
        name = f"SMCD_FALLBACK_{LocalReason(code).name}"
        return Explanation(code, "smcd local fallback", name, meaning, advice, top, cls)
    if code == 0:
        return Explanation(
            code,
            "none",
            None,
            "no reason: 0 means no decline (success) or an unused diagnosis slot",
            "Nothing to do.",
            top,
            cls,
        )
    return Explanation(
        code,
        "unknown",
        None,
        f"unknown reason code in class 0x{top:02x} ({cls.split(':')[0]})",
        _class_advice(top),
        top,
        cls,
    )


def _class_advice(top: int) -> str:
    if top == 0x01:
        return "Check memory and buffer limits on the declining side."
    if top == 0x02:
        return "Check the RDMA/ISM path between the peers (ports up, routing, MTU)."
    if top == 0x03:
        return (
            "Compare both ends' SMC configuration (smcctl device, pnet, ueid); the peer may run "
            "a newer SMC release with codes this smcd does not know yet."
        )
    if top in (0x09, 0x99):
        return "Check the declining side's logs for the internal failure."
    return "Possibly a vendor-specific or newer code: consult the declining side's documentation."


def explain_delete_link(code: int) -> Explanation:
    """Explain an LLC DELETE LINK reason (``SMC_LLC_DEL_*``)."""
    code = _check_u32(code)
    top, cls = class_of(code)
    if code in _DELETE_LINK:
        meaning, advice = _DELETE_LINK[code]
        name = DELETE_LINK_KERNEL_NAMES[DeleteLinkReason(code)]
        return Explanation(code, "LLC DELETE LINK", name, meaning, advice, top, cls)
    if code == DeleteLinkReason.NONE:
        return Explanation(
            code,
            "LLC DELETE LINK",
            None,
            "no reason: a successful DELETE LINK response carries 0",
            "Nothing to do.",
            top,
            cls,
        )
    return Explanation(
        code,
        "LLC DELETE LINK",
        None,
        "unknown DELETE LINK reason",
        "Collect logs from both ends; the peer may be newer than this smcd.",
        top,
        cls,
    )


def explain_add_link_reject(reason: int) -> Explanation:
    """Explain the 4-bit reject reason of an LLC ADD LINK response."""
    if isinstance(reason, bool) or not isinstance(reason, int) or not 0 <= reason <= 0x0F:
        raise ReasonCodeError(f"ADD LINK reject reason {reason!r} is not a 4-bit number")
    if reason == AddLinkRejectReason.NONE:
        return Explanation(
            reason, "LLC ADD LINK reject", None, "not rejected (reason 0)", "Nothing to do.", 0, ""
        )
    if reason in _ADD_LINK_REJECT:
        meaning, advice = _ADD_LINK_REJECT[reason]
        name = f"SMC_LLC_REJ_RSN_{AddLinkRejectReason(reason).name}"
        return Explanation(reason, "LLC ADD LINK reject", name, meaning, advice, 0, "")
    return Explanation(
        reason,
        "LLC ADD LINK reject",
        None,
        "unknown ADD LINK reject reason",
        "The peer may be newer than this smcd.",
        0,
        "",
    )


def parse_code(text: str) -> int:
    """Parse an operator-typed code: ``0x030f0000``, ``030f0000``-style hex with 0x, or decimal.

    Digits are decimal; hex needs the ``0x`` prefix, except that exactly 8 hex digits with a
    letter or a leading zero (a code copied without its prefix: ``030f0000``) are taken as hex,
    since nobody writes a decimal number with a leading zero.
    """
    s = text.strip().replace("_", "")
    try:
        if s.lower().startswith("0x"):
            value = int(s[2:], 16)
        elif (
            len(s) == 8
            and all(c in "0123456789abcdefABCDEF" for c in s)
            and not (s.isdigit() and s[0] != "0")
        ):
            value = int(s, 16)
        elif s.isdigit():
            value = int(s, 10)
        else:
            raise ValueError(s)
    except ValueError:
        raise ReasonCodeError(
            f"{text!r} is not a reason code (use hex like 0x030f0000 or decimal)"
        ) from None
    return _check_u32(value)
