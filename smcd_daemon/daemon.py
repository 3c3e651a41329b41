"""``smcd``: the daemon's entry point and the wiring of its parts.

This module owns no protocol logic; it decides the order in which the parts start and stop and
what happens to their failures:

- Start-up errors an operator must fix (bad configuration, the bus name taken, the handoff socket
  in use, rtnetlink unavailable) end the process with exit status 1 and one clear line; systemd's
  ``Restart=on-failure`` and the journal take it from there.
- Bad *input* never ends it: every adapter (handoff socket, D-Bus methods, netlink, the state file
  at start, a configuration file that turned invalid before SIGHUP) logs and carries on.
- The PNET table and the UEIDs added at run time are saved (atomically) after every change made
  over D-Bus and restored at start; a corrupt state file is moved aside and reported.

SMC-R is built lazily: the first handoff toward a configured remote peer builds the SMC-R
transport and service, and only when ``modes.smcr_v1``/``smcr_v2`` allow SMC-R and the inventory
has an ACTIVE RDMA port; a machine without RDMA never loads any of it. A failure to build it is
logged once and SMC-R stays off until a reload changes the SMC-R modes.

Order of start-up: inherited sockets (before anything can spawn a child), state, devices
(netlink, RDMA), the handoff socket, then D-Bus last — owning ``org.smcd`` tells clients we are
complete — and finally ``READY=1``. Shutdown runs the same list backwards after ``STOPPING=1``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import os
import signal
import subprocess
import sys
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from smc_handoff.handoff import raise_nofile_limit
from smcd_daemon import __version__
from smcd_daemon.adapters import private_bus, systemd
from smcd_daemon.adapters.bpf.peers import PeerDetection
from smcd_daemon.adapters.dbus import BUS_NAME, BusError, DbusService, ServiceInfo, connect
from smcd_daemon.adapters.handoff import HandoffServer
from smcd_daemon.adapters.netlink import NetlinkWatcher
from smcd_daemon.adapters.netns_view import pnet_netns
from smcd_daemon.adapters.verbs import RdmaWatcher
from smcd_daemon.config import (
    Config,
    ConfigError,
    check_config,
    diff_for_reload,
    load_config,
    parse_config,
)
from smcd_daemon.core.devices import DeviceInventory
from smcd_daemon.core.eid import EidError, EidTable, host_local_seid
from smcd_daemon.core.persist import (
    STATE_FILE_NAME,
    PersistError,
    StateStore,
    control_state_dict,
    load_control_state,
)
from smcd_daemon.core.pnet import PnetError, PnetTable
from smcd_daemon.core.registry import Registry
from smcd_daemon.errors import SmcError
from smcd_daemon.paths import BUS_RECORD_FILE, PRIVATE_BUS_ADDRESS_FILE

if TYPE_CHECKING:
    from smcd_daemon.adapters.smcr_service import SmcrService
    from smcd_daemon.transport.smcr import SmcrTransport

__all__ = [
    "BUS_RECORD_FILE",
    "PRIVATE_BUS_ADDRESS_FILE",
    "Daemon",
    "StartupError",
    "build_parser",
    "load_effective_config",
    "main",
]

log = logging.getLogger("smcd")

_OVERRIDES = {
    "bus": "dbus.bus",
    "runtime_dir": "runtime_dir",
    "state_dir": "state_dir",
    "handoff_socket": "handoff_socket",
    "log_level": "log_level",
}


class StartupError(SmcError):
    """smcd cannot start; the message says what to fix."""


# -- command line and configuration -----------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="smcd",
        description=(
            "Userspace Shared Memory Communications daemon (SMC-D over loopback-ism, SMC-R). "
            "Serves the handoff socket for applications and the org.smcd D-Bus API for smcctl."
        ),
        epilog=(
            "Without --config smcd runs unprivileged with its embedded defaults: runtime and "
            "state under $XDG_RUNTIME_DIR/smcd (or /tmp/smcd-UID), on the session bus (or a "
            "private bus it starts itself), with no peer detection (config/smcd.toml turns it "
            "on). Signals: SIGHUP reloads the configuration "
            "(reloadable keys apply at once, the others are reported as needing a restart); "
            "SIGTERM/SIGINT stop cleanly: handshakes under way end first (up to 2 s), and "
            "established SMC-D connections go on without the daemon (a restarted one resumes "
            "watching them). Exit status: 0 after a clean stop, 1 on a "
            "configuration or start-up error."
        ),
    )
    p.add_argument("--version", action="version", version=f"smcd {__version__}")
    p.add_argument(
        "--config", metavar="FILE", help="configuration file (TOML, see config/smcd.toml)"
    )
    p.add_argument(
        "--check-config",
        metavar="FILE",
        help="validate FILE, print 'FILE: OK' or every error (key, value, what is allowed), "
        "and exit 0 or 1 without starting",
    )
    o = p.add_argument_group("overrides (take precedence over the configuration file)")
    o.add_argument(
        "--bus",
        metavar="BUS",
        help='D-Bus bus for org.smcd: "system", "session", "private" or an address such as '
        "unix:path=/run/dbus/system_bus_socket (dbus.bus)",
    )
    o.add_argument("--runtime-dir", metavar="DIR", help="runtime directory (runtime_dir)")
    o.add_argument("--state-dir", metavar="DIR", help="where the PNET table/UEIDs are kept")
    o.add_argument("--handoff-socket", metavar="PATH", help="handoff socket path (handoff_socket)")
    o.add_argument(
        "--log-level",
        metavar="LEVEL",
        help="debug, info, warning, error or critical (log_level)",
    )
    return p


def overrides_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """Command-line overrides as dotted configuration keys."""
    return {
        key: getattr(args, attr)
        for attr, key in _OVERRIDES.items()
        if getattr(args, attr, None) is not None
    }


def load_effective_config(path: Path | None, overrides: Mapping[str, Any]) -> Config:
    """The file (or the embedded defaults) with the command-line overrides applied, validated as
    one document so that derived defaults (handoff socket and state dir under ``runtime_dir``)
    follow an overridden runtime dir. Raises :class:`ConfigError`."""
    cfg = load_config(path)
    if not overrides:
        return cfg
    data: dict[str, Any] = tomllib.loads(path.read_text("utf-8")) if path is not None else {}
    for key, value in overrides.items():
        *sections, leaf = key.split(".")
        target = data
        for s in sections:
            target = target.setdefault(s, {})
        target[leaf] = value
    source = f"{path if path is not None else '<embedded defaults>'} with command-line options"
    return parse_config(data, source=source)


GC_THRESHOLDS = (20_000, 20, 20)
"""The collector's thresholds once smcd runs. Refcounting frees almost everything a handoff
allocates; with CPython's default (700) a young collection still ran every few connections,
walking and promoting the objects of the handshakes in flight, which the older generations'
collections then walked again. Cyclic garbage waits a little longer for its collection."""


def _settle_gc() -> None:
    """Start-up's objects (modules, configuration, the pools' views: tens of thousands) live as
    long as the process: :func:`gc.freeze` takes them out of every later collection, so a full
    collection no longer walks them all in the middle of a handshake."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.check_config is not None:
        return check_config(Path(args.check_config))
    path = Path(args.config) if args.config else None
    overrides = overrides_from_args(args)
    try:
        cfg = load_effective_config(path, overrides)
    except ConfigError as e:
        for problem in e.errors:
            print(f"smcd: configuration error: {problem}", file=sys.stderr)
        return 1
    setup_logging(cfg.log_level)
    daemon = Daemon(cfg, config_path=path, overrides=overrides)
    try:
        return asyncio.run(daemon.run())
    except KeyboardInterrupt:
        return 130


def setup_logging(level: str) -> None:
    """systemd's logging setup, with pyroute2 kept at INFO or above: at debug level it dumps
    every netlink message, which drowns smcd's own debug output."""
    systemd.setup_logging(level)
    numeric = logging.getLevelName(level.upper())
    logging.getLogger("pyroute2").setLevel(max(numeric, logging.INFO))


# -- the private bus ------------------------------------------------------------------------------

_PRIVATE_BUS_CONFIG = """<!DOCTYPE busconfig PUBLIC
 "-//freedesktop//DTD D-Bus Bus Configuration 1.0//EN"
 "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">
<busconfig>
  <type>session</type>
  <listen>unix:path={socket}</listen>
  <auth>EXTERNAL</auth>
  <policy context="default">
    <allow send_destination="*" eavesdrop="true"/>
    <allow eavesdrop="true"/>
    <allow own="*"/>
  </policy>
</busconfig>
"""


#: What systemd hands smcd itself; a child that saw it would speak for smcd (the private
#: dbus-daemon sent its own READY=1 on NOTIFY_SOCKET before smcd's service was on its bus).
_SERVICE_MANAGER_ENV = (
    "NOTIFY_SOCKET", "WATCHDOG_PID", "WATCHDOG_USEC", "LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES",
)  # fmt: skip


def _without_service_manager(env: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k not in _SERVICE_MANAGER_ENV}


class PrivateBus:
    """A dbus-daemon of smcd's own (``dbus.bus = "private"``): for demos and tests on machines
    without a session bus. Only the uid smcd runs as may connect (dbus-daemon's default)."""

    def __init__(self, runtime_dir: Path) -> None:
        self.runtime_dir = runtime_dir
        self.dir = private_bus.bus_dir(runtime_dir)
        self.address_file = runtime_dir / PRIVATE_BUS_ADDRESS_FILE
        self.address = ""
        self._proc: subprocess.Popen[bytes] | None = None

    async def start(self) -> str:
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        sock = self.dir / "bus.sock"
        conf = private_bus.bus_config(self.runtime_dir)
        await self._end_stale()
        with contextlib.suppress(FileNotFoundError):
            sock.unlink()
        conf.write_text(_PRIVATE_BUS_CONFIG.format(socket=sock))
        try:
            self._proc = subprocess.Popen(
                ["dbus-daemon", f"--config-file={conf}", "--print-address=1", "--nofork",
                 "--nosyslog"],
                stdout=subprocess.PIPE,
                stdin=subprocess.DEVNULL,
                env=_without_service_manager(os.environ),
            )  # fmt: skip
        except OSError as e:
            raise StartupError(
                f"cannot start a private dbus-daemon: {e.strerror or e} (install the dbus "
                'package, or set dbus.bus to "session", "system" or an address)'
            ) from e
        private_bus.pid_file(self.runtime_dir).write_text(f"{self._proc.pid}\n")
        assert self._proc.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(self._proc.stdout.readline), 10.0)
        self.address = line.decode().strip()
        if not self.address:
            raise StartupError("the private dbus-daemon exited without giving its address")
        tmp = self.address_file.with_suffix(".tmp")
        tmp.write_text(self.address + "\n")
        tmp.replace(self.address_file)
        log.info("private D-Bus bus at %s (address in %s)", self.address, self.address_file)
        return self.address

    async def _end_stale(self) -> None:
        """The bus of an smcd that was killed (SIGKILL, a crash outside systemd, whose cgroup
        would have ended it) outlives it: end it before starting ours, so a restarted smcd
        leaves one bus behind, not one per restart (:mod:`smcd_daemon.adapters.private_bus`)."""
        pid = private_bus.stale_bus_pid(self.runtime_dir)
        if pid is None:
            return  # the common start: no thread for nothing
        # it is not our child (no wait()): its exit is polled, off the loop
        if await asyncio.to_thread(private_bus.end_bus, pid):
            log.info("ended the private dbus-daemon (pid %d) of an smcd that was killed", pid)

    def stop(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.address_file.unlink()
        with contextlib.suppress(FileNotFoundError):
            private_bus.pid_file(self.runtime_dir).unlink()
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            if self._proc.stdout is not None:
                self._proc.stdout.close()
            self._proc = None


# -- the daemon -----------------------------------------------------------------------------------


def _capabilities(cfg: Config) -> tuple[str, ...]:
    caps = []
    if cfg.modes.smcd_loopback:
        caps.append("SMC-Dv2 loopback-ism")
    if cfg.modes.smcr_v1:
        caps.append("SMC-Rv1")
    if cfg.modes.smcr_v2:
        caps.append("SMC-Rv2")
    return tuple(caps)


class Daemon:
    """One running smcd. :meth:`run` returns the exit status."""

    def __init__(
        self,
        cfg: Config,
        *,
        config_path: Path | None = None,
        overrides: Mapping[str, Any] | None = None,
    ) -> None:
        self.cfg = cfg
        self.config_path = config_path
        self.overrides = dict(overrides or {})
        self.store = StateStore(cfg.state_dir / STATE_FILE_NAME)
        self.inventory = DeviceInventory(loopback_enabled=cfg.modes.smcd_loopback)
        self.registry = Registry()
        systemd.log_fallbacks(self.registry)  # journal lines with SMC_REASON=... (rate-limited)
        # Loaded in _start, where a state file that cannot be read is a start-up error.
        self.pnet: PnetTable | None = None
        self.eids: EidTable | None = None
        self.netlink: NetlinkWatcher | None = None
        self.rdma: RdmaWatcher | None = None
        self.handoff: HandoffServer | None = None
        self.detection = PeerDetection.off()
        self.smcr: SmcrService | None = None
        self.smcr_transport: SmcrTransport | None = None
        self._smcr_failed = False
        self.service: DbusService | None = None
        self.private_bus: PrivateBus | None = None
        self.bus_address = ""
        self._bus: Any = None
        self._config_ueids: tuple[str, ...] = ()
        self._config_pnet: list[dict[str, Any]] = []
        self._stop = asyncio.Event()
        self._exit = 0
        self._tasks: set[asyncio.Task[Any]] = set()
        self._reload_note = ""

    # -- life cycle ---------------------------------------------------------------------------

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop, sig.name)
        loop.add_signal_handler(signal.SIGHUP, self.request_reload)
        try:
            await self._start()
        except (SmcError, OSError) as e:
            log.error("cannot start: %s", e)
            systemd.notify(STATUS=f"failed to start: {e}")
            await self._shutdown()
            return 1
        _settle_gc()
        systemd.notify(READY=1, STATUS=self.status())
        log.info("smcd %s ready: %s", __version__, self.status())
        watchdog = asyncio.create_task(systemd.run_watchdog(self._stop), name="smcd-watchdog")
        await self._stop.wait()
        systemd.notify(STOPPING=1, STATUS="shutting down")
        log.info("shutting down")
        await self._shutdown()
        await watchdog
        log.info("stopped")
        return self._exit

    def request_stop(self, why: str = "request", status: int = 0) -> None:
        if not self._stop.is_set():
            log.info("stop requested (%s)", why)
        self._exit = self._exit or status
        self._stop.set()

    async def _start(self) -> None:
        cfg = self.cfg
        inherited = systemd.listen_fds()  # first: before any child process could inherit them

        # State (PNET table, UEIDs). A corrupt file is moved aside and logged by the store. The
        # host-local SEID makes same-host SMC-Dv2 work with no configuration (core.eid).
        try:
            state = load_control_state(self.store, seid=host_local_seid())
        except PersistError as e:
            raise StartupError(str(e)) from e
        self.pnet, self.eids = state.pnet, state.eids
        self._apply_config_ueids((), cfg.eid.ueids)
        self._apply_config_pnet(cfg)
        log.info(
            "state from %s: %d PNET entries, UEIDs %s",
            self.store.path,
            len(self.pnet),
            ", ".join(self.eids.ueids) or "none",
        )

        # Devices.
        self.netlink = NetlinkWatcher(self.inventory)
        try:
            await self.netlink.start()
        except Exception as e:
            raise StartupError(f"cannot follow network devices through rtnetlink: {e}") from e
        self.rdma = RdmaWatcher(self.inventory)
        try:
            await self.rdma.start()
        except Exception as e:  # RDMA is optional: SMC-D loopback works without it
            log.warning("RDMA discovery failed (%s); continuing without RDMA devices", e)
            self.rdma = None

        # Handoff socket: the one systemd passed us, else our own.
        listener = systemd.select_listener(inherited, cfg.handoff_socket)
        for extra in inherited:
            if extra is not listener:
                log.warning("ignoring inherited socket %s: not the handoff socket", extra)
                extra.close()
        why = raise_nofile_limit()  # per SMC connection: a handoff connection per half, DMBs
        if why is not None:
            log.warning("%s", why)
        # Peer detection (the BPF TCP option), before the handoff socket serves anyone.
        self.detection = PeerDetection.start(cfg.peer_detection)
        if self.detection.available:
            self._spawn(self.detection.housekeeping(), "smcd-peer-detection")
        parts: dict[str, Any] = {
            "detection": self.detection,
            "config": cfg,
            "registry": self.registry,
            "eids": self.eids,
            "loopback_gid": int.from_bytes(self.inventory.loopback_ism.gid, "big"),
            "smcr": self.smcr_service,
        }
        if listener is not None:
            self.handoff = HandoffServer(listener, owns_path=False, **parts)
            log.info("handoff socket %s inherited (socket activation)", cfg.handoff_socket)
        else:
            self.handoff = HandoffServer.bind(cfg.handoff_socket, **parts)
            log.info("handoff socket %s bound", cfg.handoff_socket)
        self.handoff.start()

        # D-Bus, last: owning the name announces a complete service.
        address = cfg.dbus.bus
        if address == "private":
            self.private_bus = PrivateBus(cfg.runtime_dir)
            address = await self.private_bus.start()
        self.bus_address = address
        self._bus = await connect(address)
        self.service = DbusService(
            self._bus,
            self.registry,
            self.inventory,
            self.pnet,
            self.eids,
            info=ServiceInfo(capabilities=(*_capabilities(cfg), self.detection.status())),
            on_change=self._tables_changed,
        )
        try:
            await self.service.start()
        except BusError as e:
            self.service = None
            raise StartupError(f"{e} (bus: {cfg.dbus.bus})") from e
        self._spawn(self._watch_bus(), "smcd-bus-watch")
        self._record_bus(address)

    def _record_bus(self, address: str) -> None:
        """Write :data:`BUS_RECORD_FILE` (best effort: smcctl can still be given --bus)."""
        resolved = address  # the well-known buses as the D-Bus spec (and dbus-fast) find them
        if address == "system":
            resolved = os.environ.get(
                "DBUS_SYSTEM_BUS_ADDRESS", "unix:path=/var/run/dbus/system_bus_socket"
            )
        elif address == "session":
            xdg = os.environ.get("XDG_RUNTIME_DIR", "")
            resolved = os.environ.get("DBUS_SESSION_BUS_ADDRESS") or f"unix:path={xdg}/bus"
        path = self.cfg.runtime_dir / BUS_RECORD_FILE
        try:
            tmp = path.with_name(BUS_RECORD_FILE + ".new")
            tmp.write_text(f"{self.cfg.dbus.bus}\n{resolved}\n")
            tmp.chmod(0o644)
            tmp.replace(path)
        except OSError as e:
            log.warning("cannot record the bus in %s: %s", path, e)

    async def _shutdown(self) -> None:
        with contextlib.suppress(OSError):
            (self.cfg.runtime_dir / BUS_RECORD_FILE).unlink()
        for task in list(self._tasks):
            task.cancel()
        if self.service is not None:
            with contextlib.suppress(Exception):
                await self.service.stop()
            self.service = None
        if self._bus is not None:
            with contextlib.suppress(Exception):
                self._bus.disconnect()
            self._bus = None
        if self.handoff is not None:
            await self.handoff.stop()
            self.handoff = None
        self.detection.close()  # the programs are detached when smcd stops
        self._close_smcr()
        if self.rdma is not None:
            await self.rdma.stop()
            self.rdma = None
        if self.netlink is not None:
            await self.netlink.stop()
            self.netlink = None
        if self.private_bus is not None:
            self.private_bus.stop()
            self.private_bus = None
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    def _spawn(self, coro: Any, name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _watch_bus(self) -> None:
        """Without its bus connection smcd cannot be managed: exit 1 so systemd restarts us."""
        assert self._bus is not None
        await self._bus.wait_for_disconnect()
        if not self._stop.is_set():
            log.error("lost the connection to the D-Bus bus %s; exiting", self.bus_address)
            self.request_stop("bus connection lost", status=1)

    # -- SMC-R ----------------------------------------------------------------------------------

    def smcr_service(self) -> SmcrService | None:
        """The SMC-R service if SMC-R may be tried now (the handoff server's provider): modes
        allow it and an RDMA port is ACTIVE. Built on first use; None if building it failed."""
        cfg = self.cfg
        if not (cfg.modes.smcr_v1 or cfg.modes.smcr_v2) or self.rdma is None:
            return None
        if not any(p.active for d in self.inventory.rdma_devices() for p in d.ports):
            return None
        if self.smcr is None and not self._smcr_failed:
            try:
                self._build_smcr()
            except Exception:
                self._smcr_failed = True
                self._close_smcr()
                log.exception("cannot set up SMC-R; continuing with SMC-D and TCP only")
        return self.smcr

    def _build_smcr(self) -> None:
        from smcd_daemon.adapters.smcr_service import SmcrService
        from smcd_daemon.core.rmb import RmbPool
        from smcd_daemon.transport.smcr import SmcrTransport

        cfg = self.cfg
        assert self.eids is not None
        self.smcr_transport = SmcrTransport(
            pool=RmbPool(max_bytes=cfg.buffers.pool_max_bytes),
            registry=self.registry,
            linger=cfg.timeouts.linger,
            testlink_time=cfg.timeouts.test_link,
        )
        self.smcr = SmcrService(
            self.smcr_transport,
            self.inventory,
            self.eids,
            pnet=self.pnet,
            rmb_size=cfg.buffers.default_size,
            max_conns=cfg.smcr.max_conns,
            max_links=cfg.smcr.max_links,
            smcr_v1=cfg.modes.smcr_v1,
            smcr_v2=cfg.modes.smcr_v2,
            clc_wait=cfg.timeouts.clc_wait,
            proposal_wait=cfg.timeouts.proposal_wait,
            confirm_link_wait=cfg.timeouts.first_llc,
        )
        log.info("SMC-R set up (%s)", ", ".join(_capabilities(cfg)))

    def _configure_smcr(self) -> None:
        """A reload: new handshakes use the new modes, timers and limits."""
        cfg = self.cfg
        if self.smcr is not None:
            svc = self.smcr
            svc.smcr_v1, svc.smcr_v2 = cfg.modes.smcr_v1, cfg.modes.smcr_v2
            svc.clc_wait, svc.proposal_wait = cfg.timeouts.clc_wait, cfg.timeouts.proposal_wait
            svc.confirm_link_wait = cfg.timeouts.first_llc
            svc.max_conns, svc.max_links = cfg.smcr.max_conns, cfg.smcr.max_links
        if self.smcr_transport is not None:
            self.smcr_transport.linger = cfg.timeouts.linger
            self.smcr_transport.testlink_time = cfg.timeouts.test_link
            self.smcr_transport.pool.max_bytes = cfg.buffers.pool_max_bytes

    def _close_smcr(self) -> None:
        """Stop: SMC-R connections abort (their peers see the link group end), QPs close."""
        for part in (self.smcr, self.smcr_transport):
            if part is not None:
                try:
                    part.close()
                except Exception:
                    log.exception("closing SMC-R failed")
        self.smcr = None
        self.smcr_transport = None

    def status(self) -> str:
        inv = self.inventory
        parts = [
            f"serving {BUS_NAME} on the {self.cfg.dbus.bus} bus",
            f"handoff {self.cfg.handoff_socket}",
            f"{len(inv.netdevs())} netdevs, {len(inv.rdma_devices())} RDMA devices",
        ]
        if self._reload_note:
            parts.append(self._reload_note)
        return "; ".join(parts)

    # -- state --------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """What is saved: the tables, minus the UEIDs that come from the configuration file
        (those belong to the file; removing one there must remove it here after a restart)."""
        assert self.pnet is not None and self.eids is not None
        data = control_state_dict(self.pnet, self.eids)
        data["eid"]["ueids"] = [u for u in data["eid"]["ueids"] if u not in self._config_ueids]
        kept = data["pnet"]["entries"]
        data["pnet"]["entries"] = [e for e in kept if e not in self._config_pnet]
        return data

    def save_state(self) -> None:
        self.store.save(self.state_dict())

    def _tables_changed(self, kind: str) -> None:
        if kind in ("pnet", "ueid", "seid"):
            try:
                self.save_state()
            except PersistError as e:
                log.error("%s changed but could not be saved: %s", kind, e)
                raise
            log.info("%s changed; state saved to %s", kind, self.store.path)

    def _apply_config_pnet(self, cfg: Config) -> None:
        """The configuration's PNET entries (#15), each netdev in its namespace; like its UEIDs
        they belong to the file and are not saved. One that cannot be added is logged."""
        assert self.pnet is not None
        for e in cfg.pnet:
            try:
                added = self.pnet.add(
                    e.pnetid,
                    netdev=e.netdev or None,
                    ibdev=e.ibdev or None,
                    ibport=e.ibport,
                    netns=pnet_netns(e.netns),
                )
            except PnetError as err:
                log.warning("PNET entry %s from the configuration not added: %s", e.pnetid, err)
                continue
            self._config_pnet.extend(a.to_dict() for a in added)

    def _apply_config_ueids(self, old: Sequence[str], new: Sequence[str]) -> None:
        assert self.eids is not None
        for u in old:
            if u not in new and self.eids.has_ueid(u):
                self.eids.remove_ueid(u)
        for u in new:
            if not self.eids.has_ueid(u):
                try:
                    self.eids.add_ueid(u)
                except EidError as e:
                    log.warning("UEID %s from the configuration not added: %s", u, e)
        self._config_ueids = tuple(new)

    # -- reload -------------------------------------------------------------------------------

    def request_reload(self) -> None:
        self._spawn(self.reload(), "smcd-reload")

    async def reload(self) -> None:
        """SIGHUP: apply what can change at run time, report what needs a restart. A file that
        no longer validates changes nothing: smcd keeps running on the configuration it has."""
        systemd.notify(RELOADING=1, MONOTONIC_USEC=systemd.monotonic_usec())
        source = self.config_path if self.config_path is not None else "<embedded defaults>"
        try:
            new = load_effective_config(self.config_path, self.overrides)
        except (ConfigError, OSError, tomllib.TOMLDecodeError) as e:
            problems = e.errors if isinstance(e, ConfigError) else (e,)
            for problem in problems:
                log.error("reload: %s", problem)
            self._reload_note = (
                f"reload of {source} failed ({len(problems)} error(s)); still running with "
                "the previous configuration"
            )
            log.error("%s", self._reload_note)
            systemd.notify(READY=1, STATUS=self.status())
            return
        old = self.cfg
        plan = diff_for_reload(old, new)
        assert plan.effective is not None
        self.cfg = plan.effective
        try:
            self._apply(old, plan.applied)
        except Exception:
            log.exception("reload: applying %s failed", ", ".join(plan.applied))
        notes = []
        if plan.applied:
            log.info("reload: applied %s", ", ".join(plan.applied))
            notes.append(f"applied {', '.join(plan.applied)}")
        if plan.needs_restart:
            log.warning(
                "reload: %s changed but take effect only after a restart; the old values stay "
                "in use until then",
                ", ".join(plan.needs_restart),
            )
            notes.append(f"needs restart for {', '.join(plan.needs_restart)}")
        if not notes:
            log.info("reload: %s unchanged", source)
            notes.append("no changes")
        self._reload_note = f"reloaded {source}: " + "; ".join(notes)
        systemd.notify(READY=1, STATUS=self.status())

    def _apply(self, old: Config, applied: Sequence[str]) -> None:
        cfg = self.cfg
        if "log_level" in applied:
            setup_logging(cfg.log_level)
        if "modes.smcd_loopback" in applied:
            self.inventory.set_loopback_enabled(cfg.modes.smcd_loopback)
        if self.handoff is not None:
            self.handoff.configure(cfg)  # quotas, timeouts, modes, peers: for new handshakes
        if any(k.startswith("modes.smcr") for k in applied):
            self._smcr_failed = False  # a changed mode may try again to set SMC-R up
        self._configure_smcr()
        if self.service is not None and any(k.startswith("modes.") for k in applied):
            caps = (*_capabilities(cfg), self.detection.status())
            self.service.set_info(ServiceInfo(capabilities=caps))
        if "eid.ueids" in applied:
            self._apply_config_ueids(old.eid.ueids, cfg.eid.ueids)
            try:
                self.save_state()
            except PersistError as e:
                log.error("reload: UEIDs changed but could not be saved: %s", e)
            if self.service is not None:
                self.service.refresh()
