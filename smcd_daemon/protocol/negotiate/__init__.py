"""Sans-IO CLC negotiation: one client and one server state machine that choose SMC-Dv2 over
loopback-ism, SMC-Rv2 or SMC-Rv1, or fall back to TCP with the reason code the Linux kernel
would use - split by role as the kernel splits them (``__smc_connect``, ``smc_listen_work``).

No sockets here. A driver (:func:`smcd_daemon.adapters.clc_io.drive`) feeds received bytes (never
more than :attr:`~base.Negotiation.bytes_needed`, so that bytes after the last CLC message stay
in the TCP socket for the application, as the kernel's ``smc_clc_wait_msg`` peeks the header and
then reads exactly ``length`` bytes), tells about timeouts and EOF, and sends what each
:class:`Step` says. A first-contact SMC-R outcome additionally needs LLC CONFIRM LINK; if that
fails the driver calls ``link_failed`` and the negotiation waits ``CLC_WAIT_TIME_SHORT`` for the
peer's Decline before declining itself (``SMC_CLC_DECL_TIMEOUT_CL``).

Where the rules live (kernel 6.12; v2.1 from 6.6, Emulated-ISM 6.8, loopback-ism 6.10):

* :mod:`.facts` - what a host offers (:class:`NegotiationFacts` for SMC-D alone,
  :class:`SmcrFacts` for SMC-R with an optional SMC-D half), the resource ports, and the
  :class:`Offer` both roles read (``smc_init_info``);
* :mod:`.client` - ``__smc_connect``: which devices to propose (none: Decline NOSMCDEV instead of a
  Proposal; peer not known to speak SMC: PEERNOSMC, nothing sent), ``smc_connect_check_aclc``
  (an Accept of a type not offered: MODEUNSUPP);
* :mod:`.server` - ``smc_listen_work``: ``smc_listen_v2_check`` (NOV2EXT, NOISM2SUPP, NOV2DEXT,
  NOUEID), ``smc_listen_find_device``'s order with "first stored code wins", DIFFPREFIX;
* :mod:`.ism`, :mod:`.rdma` - the device finders and each device's Accept/Confirm handling
  (loopback-ism pairing: NOSMCD2DEV; link group reuse: SYNCERR with the out-of-sync bit; DMB,
  RMB and link group failures: their resource's code, else MEM or INTERR; SMC-Rv2 path checks:
  NOROUTE/NOINDIRECT; QP MTU: ERR_RDYLNK);
* :mod:`.v2x` - the v2.1 First Contact Extension and its checks (VERSMISMAT, RELEASEERR,
  MAXCONNERR, MAXLINKERR);
* :mod:`.base` - the driver interface and the endings: a received Decline is PEERDECL (no
  Decline back, its out-of-sync bit reported); everything taken is given back on any fallback.

Where the kernel fails the connection instead of falling back (``smc_clc_wait_msg`` returns
-EPROTO for a malformed or unexpected message, -EAGAIN → -ETIMEDOUT for a timeout, -ECONNRESET
for EOF; a negative code sends no Decline), we send no Decline either: the outcome records the
errno the kernel fails with in :attr:`FallbackOutcome.kernel_errno`, and the adapter resets
the TCP connection (a peer never reads what is left of CLC as data). Its reason, for the
records:

* malformed or unexpected message → :data:`DECL_PROTOCOL_ERROR` (CNFERR, 0x03000000);
* timeout → :data:`DECL_CLC_TIMEOUT` (0x02000000, the generic "timeout" code of the first SMC
  release; current kernels have only the LLC-specific 0x0201/0x0202 codes);
* EOF → :data:`DECL_PROTOCOL_ERROR`.

Our Declines carry our system id (zeros without SMC-R), as ``smc_clc_send_decline`` does.
"""

from __future__ import annotations

from smcd_daemon.protocol.negotiate.base import Ledger, Negotiation
from smcd_daemon.protocol.negotiate.client import (
    Client,
    ClientNegotiation,
    ClientSmcrNegotiation,
)
from smcd_daemon.protocol.negotiate.facts import (
    CLC_WAIT_TIME,
    CLC_WAIT_TIME_SHORT,
    IB_MTU_MAX,
    IB_MTU_MIN,
    SMC_FEATURE_MASK,
    SMC_RELEASE,
    SMC_SPF_EMULATED_ISM_DEV,
    DmbGrant,
    Eids,
    FirstLink,
    LinkGroupRequest,
    LinkGroupView,
    LinkView,
    NegotiationFacts,
    Offer,
    RmbGrant,
    SmcdHalf,
    SmcdResources,
    SmcrFacts,
    SmcrResources,
)
from smcd_daemon.protocol.negotiate.framer import ClcFramer, classify_first_bytes
from smcd_daemon.protocol.negotiate.outcome import (
    DECL_CLC_TIMEOUT,
    DECL_PROTOCOL_ERROR,
    FallbackOutcome,
    NegotiationError,
    Outcome,
    SmcdLoopbackOutcome,
    SmcrNegotiationOutcome,
    SmcrOutcome,
    SmcrStep,
    Step,
    declined_detail,
    local_fallback,
    peer_decline_fallback,
)
from smcd_daemon.protocol.negotiate.rdma import find_link_group
from smcd_daemon.protocol.negotiate.server import (
    Server,
    ServerNegotiation,
    ServerSmcrNegotiation,
)

__all__ = [
    "CLC_WAIT_TIME",
    "CLC_WAIT_TIME_SHORT",
    "DECL_CLC_TIMEOUT",
    "DECL_PROTOCOL_ERROR",
    "IB_MTU_MAX",
    "IB_MTU_MIN",
    "SMC_FEATURE_MASK",
    "SMC_RELEASE",
    "SMC_SPF_EMULATED_ISM_DEV",
    "ClcFramer",
    "Client",
    "ClientNegotiation",
    "ClientSmcrNegotiation",
    "DmbGrant",
    "Eids",
    "FallbackOutcome",
    "FirstLink",
    "Ledger",
    "LinkGroupRequest",
    "LinkGroupView",
    "LinkView",
    "Negotiation",
    "NegotiationError",
    "NegotiationFacts",
    "Offer",
    "Outcome",
    "RmbGrant",
    "Server",
    "ServerNegotiation",
    "ServerSmcrNegotiation",
    "SmcdHalf",
    "SmcdLoopbackOutcome",
    "SmcdResources",
    "SmcrFacts",
    "SmcrNegotiationOutcome",
    "SmcrOutcome",
    "SmcrResources",
    "SmcrStep",
    "Step",
    "classify_first_bytes",
    "declined_detail",
    "find_link_group",
    "local_fallback",
    "peer_decline_fallback",
]
