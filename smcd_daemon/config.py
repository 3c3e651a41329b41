"""smcd's configuration: one pydantic model, one TOML file, errors an operator can act on.

Why this shape:

- The model (:class:`Config`) is the single source of truth for keys, types, limits and defaults.
  ``config/smcd.toml`` documents every key and a test proves it loads to exactly these defaults
  except the system paths, so the file can never drift from the code.
- Every validation problem becomes a :class:`ConfigError` naming the dotted key, the bad value and
  what is allowed (``quota.buffer_bytes = -1: must be an integer ≥ 0 …``): pydantic's own messages
  talk about Python types, an operator needs TOML keys.
- With no file at all (``load_config(None)``) smcd runs unprivileged: runtime and state under
  ``$XDG_RUNTIME_DIR/smcd`` (or ``<tmp>/smcd-<uid>``), on the session bus if there is one, else on a
  private bus. That is what ``make demo`` and the tests use; a packaged install passes
  ``--config /etc/smcd/smcd.toml`` which names ``/run/smcd``, ``/var/lib/smcd`` and the system bus.
- SIGHUP reloads: :func:`diff_for_reload` splits the changed keys into those applied at run time
  (:data:`RELOADABLE`) and those that need a restart, and returns the configuration to run with.

Wiring for the daemon::

    if args.check_config:                       # smcd --check-config FILE
        return check_config(Path(args.check_config))
    try:
        cfg = load_config(Path(args.config) if args.config else None)
    except ConfigError as e:
        for err in e.errors: print(err, file=sys.stderr)
        return 1
    ...
    # on SIGHUP:
    plan = diff_for_reload(cfg, load_config(path))   # ConfigError: log it, keep running
    cfg = plan.effective; log plan.applied / plan.needs_restart
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import sys
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from ipaddress import IPv4Network, IPv6Network
from pathlib import Path
from typing import IO, Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    PlainValidator,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic_core import PydanticCustomError

from smcd_daemon.core.eid import SMC_CLC_MAX_UEID, EidError, normalize_ueid
from smcd_daemon.core.pnet import PnetError, PnetTable
from smcd_daemon.errors import SmcError
from smcd_daemon.paths import default_runtime_dir

__all__ = [
    "RELOADABLE",
    "SYSTEM_PATHS",
    "Config",
    "ConfigError",
    "ReloadPlan",
    "check_config",
    "default_runtime_dir",
    "diff_for_reload",
    "load_config",
    "parse_config",
]

SMC_BUF_MIN = 16 * 1024
"""Smallest RMB/DMB: the compressed size 0 means 16 KiB (``smc_compress_bufsize``)."""
SMC_DMB_MAX_EXP = 6
"""SMC-D DMBs go up to 16 KiB << 6 = 1 MiB."""
SMC_RMB_MAX_EXP = 15
"""SMC-R RMBs go up to 16 KiB << 15 = 512 MiB (the 4-bit compressed field allows it)."""
AF_UNIX_PATH_MAX = 107
"""``sun_path`` holds 108 bytes including the terminating NUL."""
MAX_TIMEOUT = 3600.0

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")

SYSTEM_PATHS: Mapping[str, Any] = {
    "runtime_dir": Path("/run/smcd"),
    "handoff_socket": Path("/run/smcd/handoff.sock"),
    "state_dir": Path("/var/lib/smcd"),
    "dbus.bus": "system",
    "peer_detection": True,
}
"""What the shipped ``config/smcd.toml`` sets differently from the embedded (unprivileged) default:
the directories systemd creates (RuntimeDirectory=/StateDirectory=smcd), the handoff socket that
``smcd.socket`` listens on, the system bus, and peer detection (the service, granted CAP_BPF and
CAP_NET_ADMIN, attaches at the host's cgroup v2 root as the kernel marks every AF_SMC SYN; an ad-hoc
daemon must not take over the host's SYNs, and one without the capabilities could not)."""


# ---------------------------------------------------------------------------------------------
# Errors


class _Unset:
    def __repr__(self) -> str:
        return "<unset>"


UNSET: Any = _Unset()


def _show(value: Any) -> str:
    """Render a value the way the operator wrote it in TOML, not as Python would."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, Path):
        return json.dumps(str(value), ensure_ascii=False)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_show(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_show(v)}" for k, v in value.items()) + "}"
    return str(value)


class ConfigError(SmcError):
    """A configuration an operator must fix: which key, which value, what would be accepted.

    ``errors`` holds every problem found in the same file (this one first) so ``--check-config``
    can list them all at once instead of one per run.
    """

    def __init__(
        self,
        key: str,
        value: Any,
        allowed: str,
        *,
        source: Path | str | None = None,
        errors: Iterable[ConfigError] = (),
    ) -> None:
        self.key = key
        self.value = value
        self.allowed = allowed
        self.source = source
        self.errors: tuple[ConfigError, ...] = (self, *errors)
        where = f"{source}: " if source is not None else ""
        if value is UNSET:
            text = f"{where}{key}: {allowed}"
        else:
            text = f"{where}{key} = {_show(value)}: {allowed}"
        super().__init__(text)


def _fail(detail: str | None = None) -> PydanticCustomError:
    """A bad value; ConfigError shows the key's ``allowed`` text plus ``detail`` if given."""
    return PydanticCustomError("smcd", "{detail}", {"detail": detail or ""})


def _cross(key: str, value: Any, allowed: str) -> PydanticCustomError:
    """An error about one key found while checking several (reported under that key)."""
    return PydanticCustomError(
        "smcd_cross", "{key}: {allowed}", {"key": key, "value": value, "allowed": allowed}
    )


def _doc(allowed: str, **kw: Any) -> Any:
    """A Field whose ``allowed`` text is what ConfigError prints for this key."""
    extra = kw.pop("json_schema_extra", {})
    return Field(json_schema_extra={"allowed": allowed, **extra}, **kw)


# ---------------------------------------------------------------------------------------------
# Value types (strict: TOML has real integers, booleans and strings; "yes" is not a boolean)

_SIZE_RE = re.compile(r"^\s*(\d+)\s*(?:([KMG])(?:i?B)?)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {None: 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(value: Any) -> int:
    """``65536``, ``"64K"``, ``"64KiB"``, ``"1M"``, ``"1G"`` → bytes (binary multiples)."""
    if isinstance(value, bool):
        raise _fail()
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        m = _SIZE_RE.match(value)
        if m:
            unit = m.group(2).upper() if m.group(2) else None
            return int(m.group(1)) * _SIZE_UNITS[unit]
    raise _fail()


def _strict_int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail()
    return value


def _seconds(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _fail()
    return float(value)


def _abs_path(value: Any) -> Path:
    if isinstance(value, Path):
        value = str(value)
    if not isinstance(value, str) or not value or "\0" in value or not value.startswith("/"):
        raise _fail()
    return Path(os.path.normpath(value))


def _network(value: Any) -> IPv4Network | IPv6Network:
    if isinstance(value, IPv4Network | IPv6Network):
        return value
    if not isinstance(value, str):
        raise _fail()
    try:
        return ipaddress.ip_network(value.strip(), strict=True)
    except ValueError as e:
        raise _fail(str(e)) from None


def _ueid(value: Any) -> str:
    try:
        return normalize_ueid(value)
    except EidError as e:
        raise _fail(str(e)) from None


def _log_level(value: Any) -> str:
    return value.strip().lower() if isinstance(value, str) else value


_DBUS_ADDR_RE = re.compile(
    r"^[a-z][a-z0-9-]*:(?:[A-Za-z0-9_-]+=[^,;=]*(?:,[A-Za-z0-9_-]+=[^,;=]*)*)?"
    r"(?:;[a-z][a-z0-9-]*:(?:[A-Za-z0-9_-]+=[^,;=]*(?:,[A-Za-z0-9_-]+=[^,;=]*)*)?)*;?$"
)


def _dbus_bus(value: Any) -> str:
    if not isinstance(value, str):
        raise _fail()
    v = value.strip()
    if v in ("system", "session", "private"):
        return v
    if ":" in v and _DBUS_ADDR_RE.match(v):
        return v
    raise _fail()


Size = Annotated[int, BeforeValidator(parse_size)]
Count = Annotated[int, BeforeValidator(_strict_int)]
Seconds = Annotated[float, BeforeValidator(_seconds)]
AbsPath = Annotated[Path, BeforeValidator(_abs_path)]
Ueid = Annotated[str, BeforeValidator(_ueid)]
Network = Annotated[
    IPv4Network | IPv6Network,
    PlainValidator(_network),
    PlainSerializer(str, return_type=str, when_used="json"),
]

_SIZE_HINT = "(bytes; suffixes K/M/G allowed)"
_SECONDS_LE = f"0 < seconds ≤ {MAX_TIMEOUT:g}"


def _bufsize_doc(max_exp: int) -> str:
    top = _human(SMC_BUF_MIN << max_exp)
    return f"must be 16K << n for n = 0…{max_exp} (16K, 32K, 64K, … {top}) {_SIZE_HINT}"


def _human(n: int) -> str:
    for unit, mult in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= mult and n % mult == 0:
            return f"{n // mult}{unit}"
    return str(n)


def _is_bufsize(n: int, max_exp: int) -> bool:
    return any(n == SMC_BUF_MIN << e for e in range(max_exp + 1))


# ---------------------------------------------------------------------------------------------
# The model


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=False)


class DbusConfig(_Section):
    """Where smcd offers its D-Bus API (org.smcd)."""

    bus: str = _doc(
        'must be "system", "session", "private" or a D-Bus address such as '
        '"unix:path=/run/dbus/system_bus_socket"',
        default="session",
    )

    @field_validator("bus", mode="before")
    @classmethod
    def _check_bus(cls, v: Any) -> str:
        return _dbus_bus(v)


class EidConfig(_Section):
    """User EIDs offered in SMC v2 Proposals (``smcd ueid``); more may be added over D-Bus."""

    ueids: tuple[Ueid, ...] = _doc(
        f"must be a list of at most {SMC_CLC_MAX_UEID} distinct UEIDs, each 1 to 32 characters of "
        "A-Z 0-9 '.' '-' starting with a letter or digit (folded to upper case)",
        default=(),
    )

    @field_validator("ueids", mode="after")
    @classmethod
    def _distinct(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if len(v) > SMC_CLC_MAX_UEID or len(set(v)) != len(v):
            raise _fail(
                f"{len(v)} UEIDs" if len(v) > SMC_CLC_MAX_UEID else "duplicates after folding"
            )
        return v


class BuffersConfig(_Section):
    """Sizes of the shared-memory buffers (DMB for SMC-D, RMB for SMC-R) and pool limits."""

    min_dmb_size: Size = _doc(_bufsize_doc(SMC_DMB_MAX_EXP), default=16 << 10)
    max_dmb_size: Size = _doc(_bufsize_doc(SMC_DMB_MAX_EXP), default=1 << 20)
    min_rmb_size: Size = _doc(_bufsize_doc(SMC_RMB_MAX_EXP), default=16 << 10)
    max_rmb_size: Size = _doc(_bufsize_doc(SMC_RMB_MAX_EXP), default=512 << 10)
    default_dmb_size: Size = _doc(
        f"must be 16K << n and lie within the DMB size range {_SIZE_HINT}", default=1 << 20
    )
    """SMC-D (loopback-ism) DMB of a connection whose application set no SO_RCVBUF. 1 MiB by
    measurement (bench/RESULTS.md): the smallest ring at which a stdlib program's 64 KiB writes
    reach 80 % of this machine's shared-memory ceiling. Its pages are memfd holes until data
    passes, and a same-host ring is not pinned, unlike an RMB. Left unset, it is clamped into
    ``min_dmb_size``…``max_dmb_size``."""
    default_size: Size = _doc(
        f"must be 16K << n and lie within the RMB size range {_SIZE_HINT}",
        default=256 << 10,
    )
    """SMC-R RMB of a connection whose application set no SO_RCVBUF: registered (pinned) RDMA
    memory for the connection's life, so it stays at 256 KiB, inside the kernel's 512 KiB."""
    pool_max_bytes: Size = _doc(
        f"must be an integer ≥ 1M {_SIZE_HINT}", default=4 << 30, ge=1 << 20
    )
    pool_max_buffers: Count = _doc("must be an integer between 1 and 65535", default=5000)

    @field_validator("pool_max_buffers", mode="after")
    @classmethod
    def _buffers_range(cls, v: int) -> int:
        if not 1 <= v <= 65535:
            raise _fail()
        return v

    @field_validator("min_dmb_size", "max_dmb_size", "default_dmb_size", mode="after")
    @classmethod
    def _dmb(cls, v: int) -> int:
        if not _is_bufsize(v, SMC_DMB_MAX_EXP):
            raise _fail()
        return v

    @field_validator("min_rmb_size", "max_rmb_size", "default_size", mode="after")
    @classmethod
    def _rmb(cls, v: int) -> int:
        if not _is_bufsize(v, SMC_RMB_MAX_EXP):
            raise _fail()
        return v

    @model_validator(mode="after")
    def _ranges(self) -> BuffersConfig:
        if self.min_dmb_size > self.max_dmb_size:
            raise _cross(
                "max_dmb_size",
                self.max_dmb_size,
                f"must be ≥ buffers.min_dmb_size ({_human(self.min_dmb_size)})",
            )
        if self.min_rmb_size > self.max_rmb_size:
            raise _cross(
                "max_rmb_size",
                self.max_rmb_size,
                f"must be ≥ buffers.min_rmb_size ({_human(self.min_rmb_size)})",
            )
        # Unset, the default follows the range (max_dmb_size = "256K" alone stays valid).
        explicit = "default_dmb_size" in self.model_fields_set
        if explicit and not self.min_dmb_size <= self.default_dmb_size <= self.max_dmb_size:
            raise _cross(
                "default_dmb_size",
                self.default_dmb_size,
                "must lie within the DMB size range "
                f"({_human(self.min_dmb_size)}…{_human(self.max_dmb_size)})",
            )
        if not self.min_rmb_size <= self.default_size <= self.max_rmb_size:
            raise _cross(
                "default_size",
                self.default_size,
                "must lie within the RMB size range "
                f"({_human(self.min_rmb_size)}…{_human(self.max_rmb_size)})",
            )
        if self.pool_max_bytes < max(self.max_dmb_size, self.max_rmb_size):
            raise _cross(
                "pool_max_bytes",
                self.pool_max_bytes,
                "must hold at least one buffer of the largest size "
                f"({_human(max(self.max_dmb_size, self.max_rmb_size))})",
            )
        return self


class QuotaConfig(_Section):
    """Per-user limits (the uid comes from SO_PEERCRED on the handoff socket); 0 = no limit.

    The defaults fit 1,024 connections of one user between its own processes at the default
    DMB size: each connection holds two DMBs (one per half) of 1 MiB, so 2,048 DMBs and 2 GiB;
    that is half of ``buffers.pool_max_bytes``, so no single user can take the pool. The bytes
    are nominal: a DMB's pages are resident only once data has passed through them, and a
    released DMB is truncated before reuse."""

    buffer_bytes: Size = _doc(
        f"must be an integer ≥ 0 {_SIZE_HINT}; 0 = no limit", default=2 << 30, ge=0
    )
    connections: Count = _doc("must be an integer ≥ 0; 0 = no limit", default=2048, ge=0)


class LimitsConfig(_Section):
    """What one user may take of the handoff server, and when smcd stops starting handshakes
    (smcd_daemon.core.admission). A request past a limit falls back to TCP before any CLC byte:
    the application keeps its socket as it left it; other users are not affected."""

    pending_per_user: Count = _doc("must be an integer ≥ 0; 0 = no limit", default=64, ge=0)
    connections_per_user: Count = _doc(
        "must be an integer ≥ 0; 0 = two per quota.connections plus 64", default=0, ge=0
    )
    handshakes_per_user: Count = _doc("must be an integer ≥ 0; 0 = no limit", default=64, ge=0)
    handshakes: Count = _doc("must be an integer ≥ 1", default=256, ge=1)
    first_request_wait: Seconds = _doc(
        f"must be a number of seconds, {_SECONDS_LE}", default=5.0, gt=0, le=MAX_TIMEOUT
    )
    overload_lag: Seconds = _doc(
        f"must be a number of seconds, 0 (off) ≤ seconds ≤ {MAX_TIMEOUT:g}",
        default=1.0,
        ge=0,
        le=MAX_TIMEOUT,
    )


class TimeoutsConfig(_Section):
    """Protocol timers in seconds; defaults are the Linux kernel's."""

    clc_wait: Seconds = _doc(
        f"must be a number of seconds, {_SECONDS_LE}", default=6.0, gt=0, le=MAX_TIMEOUT
    )
    proposal_wait: Seconds = _doc(
        f"must be a number of seconds, {_SECONDS_LE}", default=1.0, gt=0, le=MAX_TIMEOUT
    )
    local_client_wait: Seconds = _doc(
        f"must be a number of seconds, {_SECONDS_LE}", default=0.2, gt=0, le=MAX_TIMEOUT
    )
    """``proposal_wait`` for a client on this host that is not in ``peers``, while peer
    detection is off: a client that hands its connection to smcd does so right after
    ``connect()``, so a plain TCP client (one that waits for the server to speak first) is told
    apart sooner (the smaller of the two). One in the daemon's namespace whose socket lacks the
    library's handoff mark is told apart after 20 ms already
    (:mod:`smcd_daemon.adapters.handoff_mark`)."""
    first_llc: Seconds = _doc(
        f"must be a number of seconds, {_SECONDS_LE}", default=5.0, gt=0, le=MAX_TIMEOUT
    )
    llc: Seconds = _doc(
        f"must be a number of seconds, {_SECONDS_LE}", default=2.0, gt=0, le=MAX_TIMEOUT
    )
    test_link: Seconds = _doc(
        f"must be a number of seconds, 0 (off) ≤ seconds ≤ {MAX_TIMEOUT:g}",
        default=30.0,
        ge=0,
        le=MAX_TIMEOUT,
    )
    linger: Seconds = _doc(
        f"must be a number of seconds, 0 ≤ seconds ≤ {MAX_TIMEOUT:g}",
        default=2.0,
        ge=0,
        le=MAX_TIMEOUT,
    )
    stop_grace: Seconds = _doc(
        f"must be a number of seconds, 0 ≤ seconds ≤ {MAX_TIMEOUT:g}",
        default=2.0,
        ge=0,
        le=MAX_TIMEOUT,
    )
    """How long a stopping daemon (SIGTERM) lets the handshakes under way end before it resets
    their connections (they take milliseconds, but a client half may wait up to ``clc_wait``
    for its peer's answer); keep it below the service's ``TimeoutStopSec`` (15 s)."""


class ModesConfig(_Section):
    """Which SMC variants this host offers and accepts; the rest falls back to TCP."""

    smcd_loopback: StrictBool = _doc("must be true or false", default=True)
    smcr_v1: StrictBool = _doc("must be true or false", default=True)
    smcr_v2: StrictBool = _doc("must be true or false", default=True)


class SmcrConfig(_Section):
    """SMC-R link-group limits offered in CLC v2.1 (the kernel's sysctls
    ``net.smc.smcr_max_conns_per_lgr`` and ``net.smc.smcr_max_links_per_lgr``, same ranges)."""

    max_conns: Count = _doc(
        "must be an integer, 16 ≤ n ≤ 255 (connections per link group)", default=255, ge=16, le=255
    )
    max_links: Count = _doc(
        "must be an integer, 1 ≤ n ≤ 2 (links per link group)", default=2, ge=1, le=2
    )


class NamespacesConfig(_Section):
    """Which network namespaces of this host may be accelerated with each other (#15)."""

    groups: tuple[tuple[str, ...], ...] = _doc(
        'must be a list of lists of namespace names (as `ip netns` names them, "host" for '
        "smcd's own, or an inode number); empty: every namespace of the host with every other",
        default=(),
    )


class PnetEntryConfig(_Section):
    """One PNET entry (``smc_pnet -a PNETID -I netdev -D ibdev -P port``) and the network
    namespace of its netdev (#15); checked as a whole by :meth:`Config._pnet_table`."""

    pnetid: StrictStr
    netdev: StrictStr = ""
    ibdev: StrictStr = ""
    ibport: StrictInt = 1
    netns: StrictStr = ""


class Config(_Section):
    """The whole configuration (frozen: a reload builds a new one)."""

    runtime_dir: AbsPath = _doc(
        "must be an absolute path", default_factory=lambda: default_runtime_dir()
    )
    handoff_socket: AbsPath = _doc(
        f"must be an absolute path of at most {AF_UNIX_PATH_MAX} bytes (AF_UNIX limit)",
        default_factory=lambda: default_runtime_dir() / "handoff.sock",
    )
    state_dir: AbsPath = _doc(
        "must be an absolute path", default_factory=lambda: default_runtime_dir() / "state"
    )
    log_level: Annotated[
        Literal["debug", "info", "warning", "error", "critical"], BeforeValidator(_log_level)
    ] = _doc('must be one of "' + '", "'.join(LOG_LEVELS) + '"', default="info")
    peers: tuple[Network, ...] = _doc(
        'must be a list of IPv4/IPv6 networks such as "192.0.2.0/24" or "2001:db8::/32" '
        "(no host bits set)",
        default=(),
    )
    # Off in the embedded default, on in the shipped file (SYSTEM_PATHS says why).
    peer_detection: StrictBool = _doc("must be true or false", default=False)
    pnet: tuple[PnetEntryConfig, ...] = _doc(
        "must be a list of PNET entries {pnetid, netdev and/or ibdev, ibport 1 or 2, netns (the "
        "netdev's `ip netns` name or inode; default smcd's own)} by smc_pnet's rules, each device "
        "once per namespace",
        default=(),
    )
    dbus: DbusConfig = _doc("must be a table", default_factory=DbusConfig)
    eid: EidConfig = _doc("must be a table", default_factory=EidConfig)
    buffers: BuffersConfig = _doc("must be a table", default_factory=BuffersConfig)
    quota: QuotaConfig = _doc("must be a table", default_factory=QuotaConfig)
    limits: LimitsConfig = _doc("must be a table", default_factory=LimitsConfig)
    timeouts: TimeoutsConfig = _doc("must be a table", default_factory=TimeoutsConfig)
    modes: ModesConfig = _doc("must be a table", default_factory=ModesConfig)
    smcr: SmcrConfig = _doc("must be a table", default_factory=SmcrConfig)
    namespaces: NamespacesConfig = _doc("must be a table", default_factory=NamespacesConfig)

    @model_validator(mode="before")
    @classmethod
    def _derive_paths(cls, data: Any, info: ValidationInfo) -> Any:
        """Fill env-dependent defaults: handoff socket and state dir follow runtime_dir."""
        if not isinstance(data, Mapping):
            return data
        env = (info.context or {}).get("env", os.environ)
        data = dict(data)
        if "runtime_dir" not in data:
            data["runtime_dir"] = str(default_runtime_dir(env))
        rd = data["runtime_dir"]
        if isinstance(rd, str | Path) and str(rd).startswith("/"):
            data.setdefault("handoff_socket", str(Path(rd) / "handoff.sock"))
            data.setdefault("state_dir", str(Path(rd) / "state"))
        if "dbus" not in data:
            data["dbus"] = {"bus": default_bus(env)}
        elif isinstance(data["dbus"], Mapping) and "bus" not in data["dbus"]:
            data["dbus"] = {**data["dbus"], "bus": default_bus(env)}
        return data

    @field_validator("pnet", mode="after")
    @classmethod
    def _pnet_table(cls, v: tuple[PnetEntryConfig, ...]) -> tuple[PnetEntryConfig, ...]:
        """The entries must make a valid table (a device named twice in one namespace is an
        error, as ``smc_pnet -a`` answers it); whether a namespace exists is asked at start."""
        table = PnetTable()
        for i, e in enumerate(v):
            try:
                table.add(
                    e.pnetid,
                    netdev=e.netdev or None,
                    ibdev=e.ibdev or None,
                    ibport=e.ibport,
                    netns=e.netns,
                )
            except PnetError as err:
                raise _fail(f"entry {i + 1}: {err}") from None
        return v

    @field_validator("handoff_socket", mode="after")
    @classmethod
    def _sun_path(cls, v: Path) -> Path:
        if len(os.fsencode(v)) > AF_UNIX_PATH_MAX:
            raise _fail()
        return v

    def flat(self) -> dict[str, Any]:
        """Leaf keys as dotted paths (``"quota.buffer_bytes"``) → values."""
        out: dict[str, Any] = {}

        def walk(model: BaseModel, prefix: str) -> None:
            for name in type(model).model_fields:
                value = getattr(model, name)
                if isinstance(value, BaseModel):
                    walk(value, f"{prefix}{name}.")
                else:
                    out[prefix + name] = value

        walk(self, "")
        return out


def default_bus(env: Mapping[str, str] | None = None) -> str:
    """The session bus when this user has one, else a private bus smcd starts itself."""
    env = os.environ if env is None else env
    if env.get("DBUS_SESSION_BUS_ADDRESS"):
        return "session"
    xdg = env.get("XDG_RUNTIME_DIR", "")
    if xdg.startswith("/") and (Path(xdg) / "bus").exists():
        return "session"
    return "private"


# ---------------------------------------------------------------------------------------------
# Loading


def _locate(loc: tuple[int | str, ...]) -> tuple[str, type[BaseModel] | None, FieldInfo | None]:
    """Dotted key for a pydantic error location, the model holding it and its field."""
    parts: list[str] = []
    model: type[BaseModel] | None = Config
    parent: type[BaseModel] | None = None
    info: FieldInfo | None = None
    for item in loc:
        if isinstance(item, int):
            if parts:
                parts[-1] += f"[{item}]"
            continue
        parts.append(item)
        parent = model
        info = model.model_fields.get(item) if model is not None else None
        ann = info.annotation if info is not None else None
        model = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None
    return ".".join(parts), parent, info


def _allowed_of(info: FieldInfo | None) -> str | None:
    extra = info.json_schema_extra if info is not None else None
    if isinstance(extra, dict):
        allowed = extra.get("allowed")
        if isinstance(allowed, str):
            return allowed
    return None


def _convert(exc: ValidationError, source: Path | str | None) -> ConfigError:
    found: list[ConfigError] = []
    for err in exc.errors(include_url=False):
        loc = tuple(err["loc"])
        ctx = err.get("ctx") or {}
        if err["type"] == "smcd_cross":
            loc = (*loc, ctx["key"])
        key, parent, info = _locate(loc)
        value = err.get("input", UNSET)
        if err["type"] == "extra_forbidden":
            name = str(loc[-1])
            known = ", ".join(parent.model_fields) if parent is not None else ""
            allowed = f"unknown key {name!r}; known keys: {known}"
        elif err["type"] == "smcd_cross":
            value = ctx["value"]
            allowed = str(ctx["allowed"])
        elif err["type"] in ("model_type", "dict_type") and info is not None:
            allowed = "must be a table ([section] or {…})"
        else:
            allowed = _allowed_of(info) or str(err["msg"])
            if err["type"] == "smcd" and ctx.get("detail"):
                allowed = f"{allowed} ({ctx['detail']})"
        if not key:
            key = "(top level)"
        found.append(ConfigError(key, value, allowed, source=source))
    first, *rest = found
    return ConfigError(first.key, first.value, first.allowed, source=source, errors=rest)


def parse_config(
    data: Mapping[str, Any],
    *,
    source: Path | str | None = None,
    env: Mapping[str, str] | None = None,
) -> Config:
    """Validate an already-parsed TOML document (a dict); raise :class:`ConfigError`."""
    try:
        return Config.model_validate(
            dict(data), context={"env": os.environ if env is None else env}
        )
    except ValidationError as e:
        raise _convert(e, source) from None


def load_config(path: Path | None = None, *, env: Mapping[str, str] | None = None) -> Config:
    """Read and validate ``path`` (TOML); ``None`` gives the embedded, unprivileged default.

    ``env`` (default ``os.environ``) supplies XDG_RUNTIME_DIR / DBUS_SESSION_BUS_ADDRESS for the
    defaults of keys the file leaves out. Raises :class:`ConfigError` for an unreadable file, bad
    TOML or any invalid key (``.errors`` lists them all).
    """
    if path is None:
        return parse_config({}, source="<embedded defaults>", env=env)
    try:
        raw = Path(path).read_bytes()
    except OSError as e:
        raise ConfigError(
            "(file)", str(path), f"cannot be read: {e.strerror or e}", source=path
        ) from None
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ConfigError("(file)", UNSET, f"is not UTF-8 text: {e}", source=path) from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError("(file)", UNSET, f"is not valid TOML: {e}", source=path) from None
    return parse_config(data, source=path, env=env)


def check_config(
    path: Path | str, *, out: IO[str] | None = None, err: IO[str] | None = None
) -> int:
    """``smcd --check-config FILE``: print ``FILE: OK`` (0) or every error, one a line (1)."""
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    try:
        load_config(Path(path))
    except ConfigError as e:
        for problem in e.errors:
            print(problem, file=err)
        return 1
    print(f"{path}: OK", file=out)
    return 0


# ---------------------------------------------------------------------------------------------
# Reload

RELOADABLE: frozenset[str] = frozenset(
    {
        "log_level",
        "peers",
        "eid.ueids",
        "buffers.pool_max_bytes",
        "buffers.pool_max_buffers",
        "quota.buffer_bytes",
        "quota.connections",
        "limits.pending_per_user",
        "limits.connections_per_user",
        "limits.handshakes_per_user",
        "limits.handshakes",
        "limits.first_request_wait",
        "limits.overload_lag",
        "timeouts.clc_wait",
        "timeouts.proposal_wait",
        "timeouts.local_client_wait",
        "timeouts.first_llc",
        "timeouts.llc",
        "timeouts.test_link",
        "timeouts.linger",
        "timeouts.stop_grace",
        "modes.smcd_loopback",
        "modes.smcr_v1",
        "modes.smcr_v2",
        "smcr.max_conns",
        "smcr.max_links",
        "namespaces.groups",
    }
)
"""Keys a SIGHUP applies at run time (to new connections; existing ones keep what they
negotiated). Everything else — paths, the bus, buffer size classes — needs a restart: the sockets
and bus name are already bound and the pools are organised by size class."""


@dataclass(frozen=True)
class ReloadPlan:
    """What a reload changes: ``applied`` keys take effect now, ``needs_restart`` keys do not.

    ``effective`` is the configuration to run with from now on: the new file's values for the
    applied keys and the old values for the keys that wait for a restart.
    """

    applied: list[str] = field(default_factory=list)
    needs_restart: list[str] = field(default_factory=list)
    effective: Config | None = None


def diff_for_reload(old: Config, new: Config) -> ReloadPlan:
    """Split the keys that differ between ``old`` and ``new`` (sorted, dotted names)."""
    a, b = old.flat(), new.flat()
    changed = sorted(k for k in b if a.get(k) != b[k])
    applied = [k for k in changed if k in RELOADABLE]
    restart = [k for k in changed if k not in RELOADABLE]
    effective = old
    if applied:
        dump = old.model_dump()
        for key in applied:
            *sections, leaf = key.split(".")
            target = dump
            for s in sections:
                target = target[s]
            target[leaf] = b[key]
        effective = Config.model_validate(dump)
    return ReloadPlan(applied=applied, needs_restart=restart, effective=effective)
