"""systemd integration without libsystemd: sd_notify, the watchdog, socket activation, logging.

The protocols are small and stable (sd_notify(3), sd_listen_fds(3), systemd.exec(5)
``$JOURNAL_STREAM``), so they are spoken directly here; only the journal handler comes from
python3-systemd, and only when we really run under systemd. Everything is a no-op outside systemd,
so the same daemon runs from a terminal, from tests and as a unit.

Wiring for the daemon (in this order)::

    setup_logging(cfg.log_level)                    # first: nothing is ever dropped
    socks = listen_fds()                            # before anything can spawn a child
    handoff = select_listener(socks, cfg.handoff_socket)   # None → bind it yourself
    ...                                             # bus name acquired, inventory loaded
    notify(READY=1, STATUS="serving on org.smcd")
    stop = asyncio.Event()
    wd = asyncio.create_task(run_watchdog(stop))    # returns at once if no watchdog is set
    ...                                             # on SIGHUP: notify(RELOADING=1) … READY=1
    notify(STOPPING=1, STATUS="shutting down"); stop.set(); await wd

An inherited handoff socket belongs to smcd.socket: do not unlink its path on exit (systemd
removes it with the socket unit); unlink only a socket the daemon bound itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import stat
import sys
import time
from collections.abc import Callable, Mapping, MutableMapping
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from smcd_daemon.core.registry import Registry, RegistryEvent

__all__ = [
    "SD_LISTEN_FDS_START",
    "listen_fds",
    "listen_fds_named",
    "log_fallbacks",
    "notify",
    "run_watchdog",
    "select_listener",
    "setup_logging",
    "under_journal",
    "watchdog_interval",
]

log = logging.getLogger(__name__)

SD_LISTEN_FDS_START = 3
"""The first inherited descriptor (sd_listen_fds(3))."""


# ---------------------------------------------------------------------------------------------
# sd_notify


def _notify_address(value: str) -> str | bytes | None:
    """``/path`` as is, ``@name`` as the abstract address ``\\0name``; else unsupported."""
    if value.startswith("/"):
        return value
    if value.startswith("@") and len(value) > 1:
        return b"\0" + value[1:].encode()
    return None


def _field_line(key: str, value: object) -> str:
    if value is True:
        value = 1
    elif value is False:
        value = 0
    # One datagram, one assignment a line: a newline inside a value would forge another field.
    text = str(value).replace("\n", " ")
    return f"{key.upper()}={text}"


def notify(*, env: Mapping[str, str] | None = None, **fields: object) -> bool:
    """Send a state change to the service manager (``sd_notify``); True if it was sent.

    ``notify(READY=1, STATUS="serving")``, ``notify(WATCHDOG=1)``, ``notify(STOPPING=1)``,
    ``notify(RELOADING=1, MONOTONIC_USEC=…)``. Keys are upper-cased, ``True`` becomes 1. Without
    ``$NOTIFY_SOCKET`` (not started by systemd as Type=notify) this does nothing and returns False;
    an error sending is logged at debug level and returns False — notifications are advisory, a
    daemon must not die because its supervisor went away.
    """
    env = os.environ if env is None else env
    target = env.get("NOTIFY_SOCKET", "")
    if not target or not fields:
        return False
    address = _notify_address(target)
    if address is None:
        log.debug("NOTIFY_SOCKET=%r: unsupported address family, not notifying", target)
        return False
    payload = "\n".join(_field_line(k, v) for k, v in fields.items()).encode()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.setblocking(False)
            s.sendto(payload, address)
    except OSError as e:
        log.debug("sd_notify to %r failed: %s", target, e)
        return False
    return True


def watchdog_interval(env: Mapping[str, str] | None = None) -> float | None:
    """Seconds between WATCHDOG=1 pings: half of ``$WATCHDOG_USEC``, as sd_watchdog_enabled(3)
    recommends; None when no watchdog is set or ``$WATCHDOG_PID`` names another process."""
    env = os.environ if env is None else env
    try:
        usec = int(env.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    if usec <= 0:
        return None
    pid = env.get("WATCHDOG_PID")
    if pid:
        try:
            if int(pid) != os.getpid():
                return None
        except ValueError:
            return None
    return usec / 2 / 1_000_000


async def run_watchdog(
    stop: asyncio.Event,
    *,
    healthy: Callable[[], bool] | None = None,
    env: Mapping[str, str] | None = None,
) -> None:
    """Ping ``WATCHDOG=1`` every :func:`watchdog_interval` seconds until ``stop`` is set.

    Runs on the daemon's event loop, so a ping proves the loop is turning; ``healthy`` (optional)
    may veto a ping, letting systemd restart a daemon that is alive but stuck. Returns at once
    when no watchdog is configured.
    """
    interval = watchdog_interval(env)
    if interval is None:
        return
    while not stop.is_set():
        if healthy is None or healthy():
            notify(env=env, WATCHDOG=1)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=interval)


# ---------------------------------------------------------------------------------------------
# Socket activation


def listen_fds_named(
    *, unset_environment: bool = True, env: MutableMapping[str, str] | None = None
) -> list[tuple[str, socket.socket]]:
    """Sockets passed by systemd (``$LISTEN_FDS`` from fd 3, for ``$LISTEN_PID`` == us), with
    their ``$LISTEN_FDNAMES`` names ("unknown" when unnamed).

    The variables are removed afterwards (``unset_environment``) so a child we spawn does not
    think the descriptors are meant for it; the descriptors are made close-on-exec for the same
    reason. A passed descriptor that is not a socket is reported and closed.
    """
    env = os.environ if env is None else env
    try:
        pid = int(env.get("LISTEN_PID", ""))
        count = int(env.get("LISTEN_FDS", ""))
    except ValueError:
        return []
    names = env.get("LISTEN_FDNAMES", "")
    if unset_environment:
        for var in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
            env.pop(var, None)
    if pid != os.getpid() or count <= 0:
        return []
    name_list = names.split(":") if names else []
    out: list[tuple[str, socket.socket]] = []
    for i in range(count):
        fd = SD_LISTEN_FDS_START + i
        name = name_list[i] if i < len(name_list) and name_list[i] else "unknown"
        try:
            os.set_inheritable(fd, False)
            mode = os.fstat(fd).st_mode
        except OSError as e:
            log.warning("LISTEN_FDS: fd %d (%s) is unusable: %s", fd, name, e)
            continue
        if not stat.S_ISSOCK(mode):
            log.warning("LISTEN_FDS: fd %d (%s) is not a socket; closing it", fd, name)
            os.close(fd)
            continue
        out.append((name, socket.socket(fileno=fd)))
    return out


def listen_fds(*, unset_environment: bool = True) -> list[socket.socket]:
    """The sockets systemd passed us (see :func:`listen_fds_named`); [] when not activated."""
    return [s for _, s in listen_fds_named(unset_environment=unset_environment)]


def select_listener(
    sockets: list[socket.socket],
    path: Path | str,
    *,
    family: int = socket.AF_UNIX,
    type: int = socket.SOCK_SEQPACKET,
) -> socket.socket | None:
    """The inherited socket bound to ``path`` with the given family and type, else None.

    A socket unit whose ListenSequentialPacket= disagrees with ``handoff_socket`` then shows up as
    "not inherited" (and the daemon binds its own) instead of serving the wrong path.
    """
    want = os.fsencode(path)
    for s in sockets:
        if s.family != family or s.type != type:
            continue
        name = s.getsockname()
        if (os.fsencode(name) if isinstance(name, str) else name) == want:
            return s
    return None


# ---------------------------------------------------------------------------------------------
# Logging


def under_journal(env: Mapping[str, str] | None = None, stream: int = 2) -> bool:
    """True when ``stream`` (stderr) is connected to the journal.

    systemd sets ``$JOURNAL_STREAM`` to ``<device>:<inode>`` of the stream it connected to the
    journal (systemd.exec(5)); comparing it with our actual stderr tells us that stderr was not
    redirected since (e.g. by a test harness), which ``$INVOCATION_ID`` alone would not.
    """
    env = os.environ if env is None else env
    value = env.get("JOURNAL_STREAM", "")
    dev, sep, ino = value.partition(":")
    if not sep:
        return False
    try:
        st = os.fstat(stream)
        return (int(dev), int(ino)) == (st.st_dev, st.st_ino)
    except (OSError, ValueError):
        return False


_STDERR_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_JOURNAL_FORMAT = "%(name)s: %(message)s"
_installed: list[logging.Handler] = []


def setup_logging(
    level: str = "info", *, env: Mapping[str, str] | None = None, identifier: str = "smcd"
) -> logging.Handler:
    """Route all logging (the root logger, so libraries too) to the journal or stderr.

    Under systemd (:func:`under_journal`) records go to the journal through python3-systemd's
    JournalHandler, with priority and code location as structured fields; otherwise to stderr with
    a timestamp. If the journal handler is unavailable, stderr is used and the reason logged —
    records are never silently dropped. Call again to change the level (SIGHUP); the previous
    handler installed here is replaced. Returns the handler in use.
    """
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"unknown log level {level!r}")
    root = logging.getLogger()
    for old in _installed:
        root.removeHandler(old)
        old.close()
    _installed.clear()

    handler: logging.Handler | None = None
    problem = None
    if under_journal(env):
        try:
            from systemd.journal import JournalHandler  # type: ignore[import-untyped]

            handler = JournalHandler(SYSLOG_IDENTIFIER=identifier)
            handler.setFormatter(logging.Formatter(_JOURNAL_FORMAT))
        except Exception as e:  # ImportError, or a journal socket that refuses us
            problem = f"journal logging unavailable ({e}); logging to stderr"
            handler = None
    if handler is None:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(_STDERR_FORMAT))
    root.addHandler(handler)
    root.setLevel(numeric)
    _installed.append(handler)
    if problem:
        logging.getLogger(__name__).warning("%s", problem)
    return handler


def monotonic_usec() -> int:
    """CLOCK_MONOTONIC in µs, for ``notify(RELOADING=1, MONOTONIC_USEC=monotonic_usec())``."""
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000


# ---------------------------------------------------------------------------------------------
# Fallbacks in the journal

fallback_log = logging.getLogger("smcd.fallback")


def fallback_fields(event: RegistryEvent) -> dict[str, str] | None:
    """The journal fields of a connection that has just fallen back to TCP, else None.

    ``SMC_REASON`` is the reason's name (``SMC_CLC_DECL_*``, what ``smcctl explain`` prints), so
    ``journalctl SMC_REASON=SMC_CLC_DECL_NOUEID`` finds every such fallback; the code, the peer's
    diagnosis, role, connection id and user come as fields of their own.
    """
    from smcd_daemon.core.registry import Connection, ConnMode
    from smcd_daemon.wire.reasons import explain

    conn, old = event.new, event.old
    if not isinstance(conn, Connection) or conn.mode is not ConnMode.TCP:
        return None
    if conn.fallback_reason == 0:
        return None
    if (
        isinstance(old, Connection)
        and old.mode is ConnMode.TCP
        and old.fallback_reason == conn.fallback_reason
    ):
        return None  # already reported
    code = conn.fallback_reason
    return {
        "SMC_REASON": explain(code).name or f"0x{code:08x}",
        "SMC_REASON_CODE": f"0x{code:08x}",
        "SMC_PEER_DIAGNOSIS": f"0x{conn.peer_diagnosis:08x}",
        "SMC_ROLE": conn.role.value,
        "SMC_CONN_ID": str(conn.conn_id),
        "SMC_UID": str(conn.uid),
        "SMC_PEER": f"{conn.peer_addr}:{conn.peer_port}",
    }


def log_fallbacks(registry: Registry) -> Callable[[], None]:
    """Log each fallback once (INFO, logger ``smcd.fallback``) with :func:`fallback_fields` as
    structured journal fields, at most :data:`FALLBACK_LOG_BURST` a minute per reason and
    role; returns the unsubscribe function."""
    from smcd_daemon.adapters.ratelimit import FALLBACK_LOG_BURST, RateLimitedLog

    lines = RateLimitedLog(fallback_log, burst=FALLBACK_LOG_BURST, period=60.0)

    def on_event(event: RegistryEvent) -> None:
        fields = fallback_fields(event)
        if fields is None:
            return
        lines.info(
            f"fallbacks {fields['SMC_REASON']} as {fields['SMC_ROLE'].lower()}",
            "connection %s (%s, uid %s, peer %s) fell back to TCP: %s (%s, peer diagnosis %s)",
            fields["SMC_CONN_ID"],
            fields["SMC_ROLE"].lower(),
            fields["SMC_UID"],
            fields["SMC_PEER"],
            fields["SMC_REASON"],
            fields["SMC_REASON_CODE"],
            fields["SMC_PEER_DIAGNOSIS"],
            extra=fields,
        )

    return registry.subscribe(on_event)  # its suppressed counts: ratelimit.flush_all
