"""Enterprise IDs: the user EIDs (UEIDs) and the system EID (SEID) of SMC v2.

An SMC v2 Proposal carries up to eight UEIDs and, for SMC-D, the SEID; the server accepts v2 only
if the peers share one (``smc_clc_match_eid``). On IBM Z the kernel derives the SEID from the
machine, so two LPARs on one box match without configuration; everywhere else there is no SEID
(``smc_clc_init`` leaves ``seid_enabled`` at 0 unless CONFIG_S390) and the operator must configure
a common UEID on both ends (``smcd ueid add``) before SMC-Dv2 or SMC-Rv2 can be negotiated.
smcd has a host-local SEID instead (:func:`host_local_seid`): same-host SMC-Dv2 works with no
configuration, cross-host SMC still needs a common UEID.

Rules, after the kernel (``smc_clc_ueid_add``/``_remove``, ``smc_nl_enable_seid``/``_disable_seid``
in ``net/smc/smc_clc.c``) and smc-tools (``ueid.c``):

- a UEID is 1 to 32 characters of A-Z, 0-9, '.' and '-', the first alphanumeric, with no ".."
  (smc-tools refuses consecutive dots). We drop surrounding blanks and fold lower case to upper
  case, which the kernel leaves to the tool; on the wire it is blank-padded to 32 bytes
  (:func:`ueid_to_wire`), in this table it is stored trimmed;
- at most 8 UEIDs (SMC_CLC_MAX_UEID; the kernel answers -ERANGE), no duplicates (-EEXIST);
  removing an unknown UEID fails (-ENOENT); flush empties the list;
- SEID: on s390 it is enabled by default, may be disabled only while a UEID exists (-ENOENT
  otherwise) and is enabled again when the last UEID goes. Elsewhere enable/disable are not
  supported (-EOPNOTSUPP) and the SEID is reported disabled. smcd passes its host-local SEID
  in and so follows the s390 rules; without a machine id it behaves as "elsewhere".
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from smcd_daemon.errors import SmcError

SMC_MAX_EID_LEN = 32
"""Bytes of one EID on the wire (``SMC_MAX_EID_LEN``)."""
SMC_CLC_MAX_UEID = 8
"""Most UEIDs a table (and a Proposal) may hold."""
SEID_PREFIX = "IBM-SYSZ-ISMSEID"
"""How every IBM Z system EID starts (``smc_ism_create_system_eid``)."""
SMC_ISM_IDENT_MASK = 0xFFFF

SEID_UNAVAILABLE_REASON = (
    "smcd derives its host-local system EID from /etc/machine-id, which this host lacks (the "
    "kernel has a system EID only on IBM Z), so SMC-Dv2 and SMC-Rv2 need a common UEID on both "
    "hosts (smcctl ueid add)"
)
LOCAL_SEID_PREFIX = "SMCD-LOCAL-"
"""How smcd's host-local system EID starts (never ``IBM-SYSZ-ISMSEID``, the IBM Z one)."""

_C_SPACE = " \t\n\v\f\r"
_UEID_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.-")
_ALNUM = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789")
_TABLE_FORMAT = 1


class EidError(SmcError):
    """A UEID/SEID request the kernel's rules refuse; ``errno`` is the kernel's answer."""

    def __init__(self, message: str, *, value: object = None, errno_: int = errno.EINVAL) -> None:
        super().__init__(message)
        self.value = value
        self.errno = errno_


def normalize_ueid(s: object) -> str:
    """Return the canonical (trimmed, upper-case) UEID, or raise :class:`EidError`."""
    if not isinstance(s, str):
        raise EidError(
            f"UEID {s!r} is not a string: a UEID is 1 to 32 characters of A-Z, 0-9, '.' and '-'.",
            value=s,
        )
    core = s.strip(_C_SPACE)
    if not core:
        raise EidError(
            f"UEID {s!r} is empty: a UEID is 1 to 32 characters of A-Z, 0-9, '.' and '-'.",
            value=s,
        )
    if len(core) > SMC_MAX_EID_LEN:
        raise EidError(
            f"UEID {s!r} has {len(core)} characters: a UEID is at most {SMC_MAX_EID_LEN} "
            "characters.",
            value=s,
        )
    # Check before folding: str.upper() maps some non-ASCII letters onto ASCII
    # (dotless i becomes 'I').
    bad = next((c for c in core if c.upper() not in _UEID_CHARS or not c.isascii()), None)
    if bad is not None:
        raise EidError(
            f"UEID {s!r} contains {bad!r}: a UEID may only contain A-Z, 0-9, '.' and '-'.",
            value=s,
        )
    folded = core.upper()
    if folded[0] not in _ALNUM:
        raise EidError(
            f"UEID {s!r} starts with {folded[0]!r}: the first character of a UEID must be a "
            "letter or digit.",
            value=s,
        )
    if ".." in folded:
        raise EidError(
            f"UEID {s!r} contains '..': consecutive dots are not allowed in a UEID.", value=s
        )
    return folded


def ueid_to_wire(ueid: str) -> bytes:
    """The 32-byte, blank-padded form a UEID takes in CLC messages and the kernel's table."""
    return normalize_ueid(ueid).encode("ascii").ljust(SMC_MAX_EID_LEN, b" ")


def eid_from_wire(raw: bytes) -> str:
    """An EID field from the wire as text: trailing blanks and NULs dropped, nothing validated
    (a peer's EID is only ever compared, byte for byte)."""
    return raw[:SMC_MAX_EID_LEN].rstrip(b" \0").decode("ascii", "replace")


def host_local_seid(
    machine_id_path: str = "/etc/machine-id", netns_path: str = "/proc/self/ns/net"
) -> str | None:
    """smcd's system EID: ``SMCD-LOCAL-`` and 21 upper-case hex digits of HMAC-SHA256 keyed
    with the machine id over "smcd-seid" and this network namespace's identity (32 bytes, as
    every EID); None without a machine id (then there is no SEID, as off IBM Z).

    The SEID stands for "systems that can use SMC-D between each other". For smcd that is one
    daemon, i.e. one network namespace of one machine: its loopback-ism pairs only connections
    whose two halves it holds. Enabled by default, it lets same-host SMC-Dv2 negotiate with no
    UEID, while another host (or namespace) offers a different SEID, so cross-host SMC still
    needs a common UEID, and SMC-Rv2 never looks at SEIDs (``smc_clc_match_eid``). A Linux
    peer ignores a SEID off s390 and finds it unequal to its own on s390. Keyed as systemd's
    ``sd_id128_get_machine_app_specific``, so the machine id cannot be read back from it."""
    try:
        key = Path(machine_id_path).read_text().strip().encode()
        st = os.stat(netns_path)
    except OSError:
        return None
    if not key:
        return None
    msg = f"smcd-seid:{st.st_dev}:{st.st_ino}".encode()
    digest = hmac.new(key, msg, hashlib.sha256).hexdigest().upper()
    return (LOCAL_SEID_PREFIX + digest)[:SMC_MAX_EID_LEN]


def system_eid(cpu_ident: int, machine_type: int) -> str:
    """The SEID the kernel builds on IBM Z: ``IBM-SYSZ-ISMSEID00000000`` followed by the low 16
    bits of the CPU identification and the machine type, each as four upper-case hex digits."""
    if not 0 <= machine_type <= 0xFFFF:
        raise EidError(
            f"Machine type {machine_type!r} is out of range: it is a 16-bit number.",
            value=machine_type,
        )
    return f"{SEID_PREFIX}00000000{cpu_ident & SMC_ISM_IDENT_MASK:04X}{machine_type:04X}"


class EidTable:
    """The UEID list plus the SEID and whether it is offered."""

    def __init__(self, ueids: Iterable[str] = (), *, seid: str | None = None) -> None:
        if seid is not None and (not isinstance(seid, str) or len(seid) != SMC_MAX_EID_LEN):
            raise EidError(
                f"SEID {seid!r} is malformed: a system EID is exactly {SMC_MAX_EID_LEN} "
                "characters.",
                value=seid,
            )
        self._seid = seid
        self._seid_enabled = seid is not None
        self._ueids: list[str] = []
        for u in ueids:
            self.add_ueid(u)

    # -- UEIDs -----------------------------------------------------------------------------------

    @property
    def ueids(self) -> tuple[str, ...]:
        """UEIDs in the order they were added (the order the Proposal lists them)."""
        return tuple(self._ueids)

    def add_ueid(self, ueid: str) -> str:
        """Add a UEID; return its canonical form."""
        u = normalize_ueid(ueid)
        if u in self._ueids:
            raise EidError(
                f"UEID {u} is already defined: each UEID appears in the table once.",
                value=ueid,
                errno_=errno.EEXIST,
            )
        if len(self._ueids) >= SMC_CLC_MAX_UEID:
            raise EidError(
                f"UEID {u} cannot be added: the table already holds the maximum of "
                f"{SMC_CLC_MAX_UEID} UEIDs.",
                value=ueid,
                errno_=errno.ERANGE,
            )
        self._ueids.append(u)
        return u

    def remove_ueid(self, ueid: str) -> str:
        """Remove a UEID; return its canonical form. On IBM Z removing the last UEID enables
        the SEID again (the kernel's -EAGAIN "info" case); check :attr:`seid_enabled`."""
        u = normalize_ueid(ueid)
        if u not in self._ueids:
            raise EidError(
                f"UEID {u} is not defined: only a UEID in the table can be removed.",
                value=ueid,
                errno_=errno.ENOENT,
            )
        self._ueids.remove(u)
        self._after_removal()
        return u

    def flush_ueids(self) -> int:
        """Remove every UEID; return how many there were (0 is not an error)."""
        n = len(self._ueids)
        self._ueids.clear()
        self._after_removal()
        return n

    def has_ueid(self, ueid: str) -> bool:
        try:
            return normalize_ueid(ueid) in self._ueids
        except EidError:
            return False

    def ueids_wire(self) -> tuple[bytes, ...]:
        """Our UEIDs as the 32-byte fields of a Proposal's v2 extension."""
        return tuple(ueid_to_wire(u) for u in self._ueids)

    def match_ueid(self, peer_ueids: Iterable[bytes]) -> str | None:
        """The first of the peer's UEIDs (in the peer's order) that we also have, compared byte
        for byte on the padded wire form as ``smc_clc_match_eid`` does; None if none."""
        ours = set(self.ueids_wire())
        for raw in peer_ueids:
            field = bytes(raw[:SMC_MAX_EID_LEN])
            if field in ours:
                return eid_from_wire(field)
        return None

    def _after_removal(self) -> None:
        if self._seid is not None and not self._ueids:
            self._seid_enabled = True

    # -- SEID ------------------------------------------------------------------------------------

    @property
    def seid(self) -> str | None:
        """The system EID, or None when there is none (every non-IBM-Z host)."""
        return self._seid

    @property
    def seid_available(self) -> bool:
        return self._seid is not None

    @property
    def seid_enabled(self) -> bool:
        """Whether the SEID is offered in Proposals (always False without a SEID)."""
        return self._seid_enabled

    @property
    def seid_status(self) -> str:
        """One line for ``smcctl info``/``seid show``: what the SEID state is and why."""
        if self._seid is None:
            return f"disabled ({SEID_UNAVAILABLE_REASON})"
        if self._seid_enabled:
            return "enabled"
        return "disabled (by the operator; removing the last UEID enables it again)"

    def enable_seid(self) -> None:
        if self._seid is None:
            raise EidError(
                f"Enabling the SEID is not supported on this host: {SEID_UNAVAILABLE_REASON}.",
                errno_=errno.EOPNOTSUPP,
            )
        self._seid_enabled = True

    def disable_seid(self) -> None:
        if self._seid is None:
            raise EidError(
                f"Disabling the SEID is not supported on this host: {SEID_UNAVAILABLE_REASON}.",
                errno_=errno.EOPNOTSUPP,
            )
        if not self._ueids:
            raise EidError(
                "The SEID cannot be disabled while no UEID is defined: add a UEID first, or "
                "SMC v2 would have no EID to negotiate.",
                errno_=errno.ENOENT,
            )
        self._seid_enabled = False

    # -- persistence -----------------------------------------------------------------------------

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, EidTable)
            and self._ueids == other._ueids
            and self._seid == other._seid
            and self._seid_enabled == other._seid_enabled
        )

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"EidTable(ueids={self._ueids!r}, seid={self._seid!r}, enabled={self._seid_enabled})"

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready snapshot. The SEID itself is not stored: it comes from the machine."""
        return {
            "format": _TABLE_FORMAT,
            "ueids": list(self._ueids),
            "seid_enabled": self._seid_enabled,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, seid: str | None = None) -> EidTable:
        """Rebuild a table, re-checking every rule; ``seid`` is this machine's SEID, if any.

        A stored "SEID disabled" is honoured only if this host has a SEID and UEIDs exist.
        """
        if not isinstance(data, Mapping):
            raise EidError(
                f"Stored EID table {data!r} is not an object: it must be "
                '{"format": 1, "ueids": [...]}.',
                value=data,
            )
        fmt = data.get("format", _TABLE_FORMAT)
        if fmt != _TABLE_FORMAT:
            raise EidError(
                f"Stored EID table format {fmt!r} is unknown: this smcd reads format "
                f"{_TABLE_FORMAT}.",
                value=fmt,
            )
        raw = data.get("ueids", [])
        if not isinstance(raw, list):
            raise EidError(
                f"Stored UEIDs {raw!r} are not a list: ueids must be a JSON array of strings.",
                value=raw,
            )
        enabled = data.get("seid_enabled", True)
        if not isinstance(enabled, bool):
            raise EidError(
                f"Stored seid_enabled {enabled!r} is not a boolean: it must be true or false.",
                value=enabled,
            )
        table = cls(raw, seid=seid)
        if seid is not None and not enabled and table._ueids:
            table._seid_enabled = False
        return table
