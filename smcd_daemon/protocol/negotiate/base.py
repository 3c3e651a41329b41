"""The driver interface both roles share, the endings (Decline, fallback, success) and the
:class:`Ledger` of what a negotiation took, so that every fallback gives all of it back."""

from __future__ import annotations

import contextlib
import errno
from enum import Enum

from smcd_daemon.errors import SmcError
from smcd_daemon.protocol.negotiate.facts import (
    CLC_WAIT_TIME_SHORT,
    DmbGrant,
    FirstLink,
    LinkGroupRequest,
    Offer,
    RmbGrant,
    SmcdResources,
    SmcrResources,
    uncompress_bufsize,
)
from smcd_daemon.protocol.negotiate.framer import ClcFramer
from smcd_daemon.protocol.negotiate.outcome import (
    DECL_CLC_TIMEOUT,
    DECL_PROTOCOL_ERROR,
    NegotiationError,
    Outcome,
    Refusal,
    SmcrOutcome,
    Step,
    decline_message,
    declined_detail,
    local_fallback,
    peer_decline_fallback,
    violation,
)
from smcd_daemon.wire.clc import CLC_HEADER_LEN, ClcMessage, ClcType, Decline, Proposal
from smcd_daemon.wire.reasons import DeclineReason

__all__ = ["Ledger", "Negotiation", "State", "reason_of"]


class State(Enum):
    INIT = "init"
    WAIT = "wait"
    DONE = "done"


def reason_of(exc: SmcError, default: int) -> int:
    """The decline code a resource failure names (``decline_reason``), else ``default``."""
    code = getattr(exc, "decline_reason", None)
    return int(code) if isinstance(code, int) else int(default)


class Ledger:
    """What one negotiation holds until it ends: on loopback-ism our DMB, the peer's DMB we
    attached and a link group we created; on RoCE our RMB and a link group we created. A
    fallback gives all of it back; success keeps it (SMC-R keeps the record until the first
    link is up, since a failed CONFIRM LINK still falls back)."""

    def __init__(self, ism: SmcdResources | None = None, rdma: SmcrResources | None = None):
        self.ism = ism
        self.rdma = rdma
        self._local_token: int | None = None
        self._peer_token: int | None = None
        self._new_link: int | None = None
        self._rmb: RmbGrant | None = None
        self._new_lgr: int | None = None
        self._reused_lgr: int | None = None

    # ---- loopback-ism ----------------------------------------------------------------------

    def _smcd(self) -> SmcdResources:
        assert self.ism is not None, "no SMC-D resources for an SMC-D step"
        return self.ism

    def _smcr(self) -> SmcrResources:
        assert self.rdma is not None, "no SMC-R resources for an SMC-R step"
        return self.rdma

    def ism_link_group(self, peer_gid: int) -> tuple[int, bool]:
        """(link id, first contact here): one link group per peer GID."""
        res = self._smcd()
        found = res.find_link_group(peer_gid)
        if found is not None:
            return found, False
        self._new_link = res.create_link_group(peer_gid)
        return self._new_link, True

    def register_dmb(self, size: int, min_size: int) -> DmbGrant:
        try:
            grant = self._smcd().register_dmb(size, min_size)
        except SmcError as exc:
            raise Refusal(reason_of(exc, DeclineReason.MEM), f"no DMB: {exc}") from exc
        self._local_token = grant.token
        return grant

    def attach_dmb(self, token: int, advertised_comp: int) -> None:
        """Attach the peer's DMB; MEM if it does not exist or is not what the peer advertised
        (mainline: "try to fallback")."""
        try:
            grant = self._smcd().attach_dmb(token)
        except SmcError as exc:
            raise Refusal(
                DeclineReason.MEM, f"attaching the peer DMB {token:#x} failed: {exc}"
            ) from exc
        self._peer_token = grant.token
        if grant.size != uncompress_bufsize(advertised_comp):
            raise Refusal(
                DeclineReason.MEM,
                f"the peer DMB has {grant.size} bytes but the peer advertised "
                f"{uncompress_bufsize(advertised_comp)}",
            )

    # ---- RoCE ------------------------------------------------------------------------------

    def create_link_group(self, request: LinkGroupRequest) -> FirstLink:
        try:
            first = self._smcr().create_link_group(request)
        except SmcError as exc:
            code = reason_of(exc, DeclineReason.INTERR)
            raise Refusal(code, f"creating the link group failed: {exc}") from exc
        self._new_lgr = first.lgr_id
        return first

    def reuse_link_group(self, lgr_id: int) -> None:
        """This connection joins an existing link group (no first contact)."""
        self._reused_lgr = lgr_id

    def peer_out_of_sync(self) -> None:
        """The peer's Decline said it has no such link group (the out-of-sync bit): a link group
        we offered for reuse is dead on its side, so it goes here too, as the kernel's
        ``smc_lgr_terminate_sched`` (else every later connection is offered it again)."""
        if self._reused_lgr is not None:
            with contextlib.suppress(SmcError):
                self._smcr().discard_link_group(self._reused_lgr)
            self._reused_lgr = None

    def allocate_rmb(self, lgr_id: int, link_id: int, size: int) -> RmbGrant:
        try:
            grant = self._smcr().allocate_rmb(lgr_id, link_id, size)
        except SmcError as exc:
            raise Refusal(reason_of(exc, DeclineReason.MEM), f"no RMB: {exc}") from exc
        self._rmb = grant
        return grant

    # ---- endings ---------------------------------------------------------------------------

    def release(self) -> None:
        """Give back everything recorded (each step at most once)."""
        if self._peer_token is not None:
            with contextlib.suppress(SmcError):
                self._smcd().detach_dmb(self._peer_token)
            self._peer_token = None
        if self._local_token is not None:
            with contextlib.suppress(SmcError):
                self._smcd().unregister_dmb(self._local_token)
            self._local_token = None
        if self._new_link is not None:
            with contextlib.suppress(SmcError):
                self._smcd().discard_link_group(self._new_link)
            self._new_link = None
        if self._rmb is not None:
            with contextlib.suppress(SmcError):
                self._smcr().release_rmb(self._rmb)
            self._rmb = None
        if self._new_lgr is not None:
            with contextlib.suppress(SmcError):
                self._smcr().discard_link_group(self._new_lgr)
            self._new_lgr = None

    def settle(self) -> None:
        """The connection owns what was taken now: nothing to give back any more."""
        self._local_token = self._peer_token = self._new_link = None
        self._rmb = None
        self._new_lgr = None
        self._reused_lgr = None


class Negotiation:
    """The driver interface of both roles (sans-IO): feed received bytes, never more than
    :attr:`bytes_needed`; report a timeout of :attr:`timeout` seconds or EOF; send what each
    :class:`Step` says; stop at its outcome."""

    def __init__(self, offer: Offer, ledger: Ledger, *, expect: ClcType, state: State) -> None:
        self.offer = offer
        self.ledger = ledger
        self.proposal: Proposal | None = None
        self.why_not: list[str] = []
        """Why each path was not taken, for the decline's detail (the kernel says nothing)."""
        self._expect = expect
        self._state = state
        self._outcome: Outcome | None = None
        self._framer = ClcFramer()
        self._decline_version = 2
        self._link_failure: tuple[int, str] | None = None

    # ---- driver interface ------------------------------------------------------------------

    @property
    def outcome(self) -> Outcome | None:
        """The end result (None while negotiating)."""
        return self._outcome

    @property
    def done(self) -> bool:
        return self._state is State.DONE

    @property
    def clc_wait(self) -> float:
        """Seconds each CLC message may take, to arrive or to be sent."""
        return self.offer.clc_wait

    @property
    def bytes_needed(self) -> int:
        """How many bytes to read from the TCP socket next (never read more); 0 when not waiting."""
        if self._state is not State.WAIT:
            return 0
        return self._framer.bytes_needed

    @property
    def timeout(self) -> float | None:
        """Seconds the current wait may last (restart the timer after each message)."""
        if self._state is not State.WAIT:
            return None
        return CLC_WAIT_TIME_SHORT if self._link_failure else self.offer.clc_wait

    def receive_data(self, data: bytes) -> Step:
        if self._state is not State.WAIT:
            raise NegotiationError(f"not waiting for data (state {self._state.value})")
        if len(data) > self.bytes_needed:
            raise NegotiationError(f"fed {len(data)} bytes, asked for {self.bytes_needed}")
        got = self._framer.feed(data, self._expect)
        if got is None:
            return Step()
        return self._receive(got)

    def receive_message(self, msg: ClcMessage | str) -> Step:
        """As :meth:`receive_data` with a whole message already decoded, or a text that says
        why the bytes read are no message (a protocol violation, as a malformed message).

        For a driver that holds both ends of a same-host connection: it writes one end's
        message, reads the same number of bytes at the other end and, when they are those very
        bytes, gives this negotiator the message the other one built instead of decoding it
        again (:func:`~smcd_daemon.adapters.clc_io.drive_pair`)."""
        if self._state is not State.WAIT:
            raise NegotiationError(f"not waiting for data (state {self._state.value})")
        if self._framer.bytes_needed != CLC_HEADER_LEN:
            raise NegotiationError("a message is half read")
        if not isinstance(msg, str) and msg.TYPE not in (self._expect, ClcType.DECLINE):
            msg = f"expected {self._expect.name} or DECLINE, got {msg.TYPE.name}"
        return self._receive(msg)

    def _receive(self, got: ClcMessage | str) -> Step:
        try:
            if isinstance(got, str):
                raise violation(got)
            if isinstance(got, Decline):
                return self._peer_declined(got)
            return self._handle(got)
        except Refusal as r:
            if r.kernel_errno is not None:
                return self._fail(r.code, r.detail, r.kernel_errno)
            return self._decline_and_fall_back(r.code, r.detail)

    def on_timeout(self) -> Step:
        """The wait of :attr:`timeout` seconds expired."""
        if self._state is not State.WAIT:
            raise NegotiationError(f"not waiting (state {self._state.value})")
        if self._link_failure is not None:
            code, detail = self._link_failure
            return self._decline_and_fall_back(code, detail)
        detail = f"no CLC {self._expect.name} within {self.offer.clc_wait:g} s"
        return self._fail(DECL_CLC_TIMEOUT, detail, errno.ETIMEDOUT)

    def on_eof(self) -> Step:
        """The peer closed its sending side during the handshake."""
        if self._state is not State.WAIT:
            raise NegotiationError(f"not waiting (state {self._state.value})")
        if self._link_failure is not None:
            code, detail = self._link_failure
            return self._fall_back(
                code, f"{detail}; the peer closed the TCP connection", declined=False
            )
        detail = f"the peer closed the TCP connection while we waited for {self._expect.name}"
        return self._fall_back(
            DECL_PROTOCOL_ERROR, detail, declined=False, kernel_errno=errno.ECONNRESET
        )

    def abort(self, detail: str = "aborted by the daemon") -> Step:
        """Give up (e.g. the application went away): release everything, decline if waiting."""
        if self._state is State.DONE:
            raise NegotiationError("already done")
        if self._state is State.WAIT:
            return self._decline_and_fall_back(DeclineReason.INTERR, detail)
        return self._fall_back(DeclineReason.INTERR, detail, declined=False)

    def link_failed(self, explanation: str, reason: int = DeclineReason.TIMEOUT_CL) -> Step:
        """The first link of our new SMC-R link group did not come up (LLC CONFIRM LINK
        failed). Wait briefly for the peer's Decline (:attr:`timeout` is
        ``CLC_WAIT_TIME_SHORT``), then decline with ``reason``, as ``smcr_serv_conf_first_link``
        and ``smcr_clnt_conf_first_link`` do."""
        out = self._outcome
        if not (isinstance(out, SmcrOutcome) and out.first_contact) or self._link_failure:
            raise NegotiationError("link_failed needs a first-contact SMC-R outcome, once")
        self._link_failure = (int(reason), f"the first link did not come up: {explanation}")
        self._outcome = None
        self._wait(ClcType.DECLINE)
        return Step()

    # ---- for the roles ---------------------------------------------------------------------

    def _handle(self, msg: ClcMessage) -> Step:
        raise NotImplementedError

    def _begin(self) -> None:
        if self._state is not State.INIT:
            raise NegotiationError("already started")

    def _wait(self, expect: ClcType) -> None:
        self._state = State.WAIT
        self._expect = expect

    def _decline_as(self, *, v2: bool) -> None:
        """Our Declines from now on are v2 or v1 (as the peer last spoke)."""
        self._decline_version = 2 if v2 else 1

    def _finish(self, step: Step) -> Step:
        assert step.outcome is not None
        self._state = State.DONE
        self._outcome = step.outcome
        return step

    def _succeed(
        self, outcome: Outcome, send: tuple[ClcMessage, ...] = (), raw: bytes | None = None
    ) -> Step:
        if not isinstance(outcome, SmcrOutcome):
            self.ledger.settle()  # an SMC-R first link may still fail: it keeps the record
        return self._finish(Step(send, outcome, raw))

    def _fall_back(
        self, code: int, detail: str, *, declined: bool, kernel_errno: int | None = None
    ) -> Step:
        self.ledger.release()
        outcome = local_fallback(code, detail, declined=declined, kernel_errno=kernel_errno)
        send: tuple[ClcMessage, ...] = ()
        if declined:
            send = (decline_message(code, self._decline_version, self.offer.system_id),)
        return self._finish(Step(send, outcome))

    def _decline_and_fall_back(self, code: int, detail: str) -> Step:
        return self._fall_back(code, declined_detail(code, detail), declined=True)

    def _fail(self, code: int, detail: str, kernel_errno: int) -> Step:
        """Where the kernel fails the connection (``smc_clc_wait_msg`` returned an errno:
        ``smc_connect_decline_fallback`` and ``smc_listen_decline`` send no Decline for a
        negative code): no Decline either; the adapter resets the connection."""
        return self._fall_back(
            code, f"{detail}; no Decline (as the kernel)",
            declined=False, kernel_errno=kernel_errno,
        )  # fmt: skip

    def _peer_declined(self, msg: Decline) -> Step:
        self.ledger.release()
        if msg.out_of_sync:
            self.ledger.peer_out_of_sync()
        why = f"; {self._link_failure[1]}" if self._link_failure else ""
        return self._finish(Step((), peer_decline_fallback(msg, why)))
