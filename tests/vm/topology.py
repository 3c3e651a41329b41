"""The Soft-RoCE network inside the test VM, described once for both sides of the harness.

The host turns this description into qemu arguments (virtio NICs on qemu hubs, with fixed MACs);
the guest finds those NICs by MAC, renames them, gives each a /32 address and an rxe device, and
adds the policy routing that makes traffic between two local addresses leave through the virtio
wire instead of the loopback shortcut (rxe and the kernel's routing live in init_net, so network
namespaces cannot separate the two "hosts").

Two hosts, A and B, stand for the two smcd instances. Each wire is a qemu hub joining one NIC of A
and one NIC of B; wire 0 is the primary RoCE link, wire 1 a second one for two-link link groups.

Stdlib only: the guest runs this with the host's venv python before anything else is known to work.
"""

from __future__ import annotations

import json
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = [
    "POLICY_TABLE",
    "PORTS",
    "RESERVED_PORTS",
    "Port",
    "TopologyError",
    "configure",
    "ipv4_mapped_gid_text",
    "load",
    "ports_of",
    "qemu_args",
]

#: Routing table holding the "leave through the wire" routes for locally generated packets.
POLICY_TABLE = 100
RESERVED_PORTS = "47300-47499"
"""Local ports no connection draws as its ephemeral port: the fixed listener ports of the guest
tests and ``bench/smcr_vm.py`` (47311-47401) are in this block."""
SYSFS_NET = Path("/sys/class/net")
SYSFS_IB = Path("/sys/class/infiniband")


class TopologyError(RuntimeError):
    """The guest network could not be set up as described (names the step and the reason)."""


@dataclass(frozen=True)
class Port:
    """One virtio NIC of one simulated host, with the rxe device on it."""

    host: str  # "a" or "b"
    wire: int  # index of the qemu hub
    mac: str
    ifname: str
    rxe: str
    address: str  # IPv4, configured as /32
    peer_address: str  # the other host's address on the same wire

    @property
    def hub_port_id(self) -> str:
        return f"smc{self.host}{self.wire}"

    def to_json(self) -> dict[str, object]:
        return asdict(self)


def _port(host: str, wire: int, subnet: str) -> Port:
    mine, peer = (1, 2) if host == "a" else (2, 1)
    return Port(
        host=host,
        wire=wire,
        # locally administered unicast MACs: 02:5c:00:00:<wire>:<host>
        mac=f"02:5c:00:00:{wire:02x}:{mine:02x}",
        ifname=f"smc{host}{wire}",
        rxe=f"rxe_{host}{wire}",
        address=f"{subnet}.{mine}",
        peer_address=f"{subnet}.{peer}",
    )


#: Wire 0: 192.0.2.1 (A) <-> 192.0.2.2 (B); wire 1: 198.51.100.1 (A) <-> 198.51.100.2 (B).
PORTS: tuple[Port, ...] = tuple(
    _port(host, wire, subnet)
    for wire, subnet in enumerate(("192.0.2", "198.51.100"))
    for host in ("a", "b")
)


def ports_of(host: str) -> tuple[Port, ...]:
    """The ports of host "a" or "b", wire 0 first."""
    return tuple(p for p in PORTS if p.host == host)


# --------------------------------------------------------------------------------------------
# host side
# --------------------------------------------------------------------------------------------


def qemu_args(ports: tuple[Port, ...] = PORTS) -> list[str]:
    """``-device virtio-net-pci`` + ``-netdev hubport`` pairs: one hub per wire, fixed MACs."""
    args: list[str] = []
    for p in ports:
        args += ["-device", f"virtio-net-pci,netdev={p.hub_port_id},mac={p.mac}"]
        args += ["-netdev", f"hubport,id={p.hub_port_id},hubid={p.wire}"]
    return args


# --------------------------------------------------------------------------------------------
# guest side
# --------------------------------------------------------------------------------------------


def _run(*cmd: str) -> str:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise TopologyError(f"`{' '.join(cmd)}` could not run: {exc}") from exc
    if done.returncode != 0:
        raise TopologyError(
            f"`{' '.join(cmd)}` exited {done.returncode}: {(done.stderr or done.stdout).strip()}"
        )
    return done.stdout


def _run_batch(tool: str, lines: list[str]) -> None:
    """``ip -b -`` / ``rdma -b -``: stops at the first failing line and names it."""
    try:
        done = subprocess.run(
            [tool, "-b", "-"], input="\n".join(lines) + "\n",
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise TopologyError(f"`{tool} -batch` could not run: {exc}") from exc
    if done.returncode != 0:
        raise TopologyError(
            f"`{tool} -batch` exited {done.returncode}: {(done.stderr or done.stdout).strip()}\n"
            f"batch was:\n" + "\n".join(lines)
        )


def _sysctl(key: str, value: str) -> None:
    Path("/proc/sys", *key.split(".")).write_text(value)


def _nics_by_mac() -> dict[str, str]:
    out = {}
    for dev in SYSFS_NET.iterdir():
        try:
            out[(dev / "address").read_text().strip().lower()] = dev.name
        except OSError:
            continue
    return out


def ipv4_mapped_gid_text(address: str) -> str:
    """The sysfs spelling of the RoCEv2 GID for an IPv4 address (::ffff:a.b.c.d)."""
    a, b, c, d = (int(o) for o in address.split("."))
    return f"0000:0000:0000:0000:0000:ffff:{a:02x}{b:02x}:{c:02x}{d:02x}"


def _ipv4_gid_ready(p: Port) -> bool:
    """True once the rxe port is ACTIVE and carries the IPv4-mapped GID of its address."""
    port_dir = SYSFS_IB / p.rxe / "ports" / "1"
    try:
        if "ACTIVE" not in (port_dir / "state").read_text():
            return False
        want = ipv4_mapped_gid_text(p.address)
        for gid in (port_dir / "gids").iterdir():
            try:
                if gid.read_text().strip() == want:
                    return True
            except OSError:
                continue
    except OSError:
        return False
    return False


def configure(ports: tuple[Port, ...] = PORTS, *, settle_timeout: float = 30.0) -> list[dict]:
    """Set up the guest network for ``ports``; return their JSON description.

    Raises TopologyError naming the failed step. Idempotence is not needed: it runs once per boot.
    """
    by_mac = _nics_by_mac()
    missing = [p.mac for p in ports if p.mac not in by_mac]
    if missing:
        raise TopologyError(
            f"virtio NICs with MAC {', '.join(missing)} not found in the guest "
            f"(present: {sorted(by_mac.items())}); did qemu get the -device/-netdev arguments?"
        )
    # Each process start costs seconds under TCG with the root on 9p: one `ip -batch` and one
    # `rdma -batch` instead of a command per step.
    _run("modprobe", "rdma_rxe")
    # The guest tests' listeners use fixed ports (47311-47401) inside the ephemeral range: an
    # earlier test's client socket that drew one as its local port made a later listener's
    # bind fail with EADDRINUSE (a CI run). No ephemeral port is taken from that block now.
    _sysctl("net.ipv4.ip_local_reserved_ports", RESERVED_PORTS)
    for key in ("all", "default"):
        _sysctl(f"net.ipv4.conf.{key}.rp_filter", "0")
        _sysctl(f"net.ipv4.conf.{key}.accept_local", "1")
    ip = ["link set dev lo up"]
    for p in ports:
        if by_mac[p.mac] != p.ifname:
            ip.append(f"link set dev {by_mac[p.mac]} name {p.ifname}")
    _run_batch("ip", ip)
    for p in ports:
        _sysctl(f"net.ipv4.conf.{p.ifname}.rp_filter", "0")
        _sysctl(f"net.ipv4.conf.{p.ifname}.accept_local", "1")
    ip = []
    for p in ports:
        ip.append(f"addr add {p.address}/32 dev {p.ifname}")
        ip.append(f"link set dev {p.ifname} up")
        # locally generated packets to the peer leave through this NIC, from this address
        ip.append(
            f"route add {p.peer_address}/32 dev {p.ifname} src {p.address} table {POLICY_TABLE}"
        )
    # Rule order: locally generated (iif lo) packets consult the wire routes first; everything
    # else, and packets arriving from the wire, still find the local table (moved behind).
    ip.append(f"rule add pref 10 iif lo lookup {POLICY_TABLE}")
    ip.append("rule add pref 100 lookup local")
    ip.append("rule del pref 0")
    _run_batch("ip", ip)
    _run_batch("rdma", [f"link add {p.rxe} type rxe netdev {p.ifname}" for p in ports])
    deadline = time.monotonic() + settle_timeout
    while not all(_ipv4_gid_ready(p) for p in ports):
        if time.monotonic() > deadline:
            late = [p.rxe for p in ports if not _ipv4_gid_ready(p)]
            raise TopologyError(
                f"rxe devices {late} not ACTIVE with their IPv4-mapped GID "
                f"after {settle_timeout:.0f} s:\n{_run('rdma', 'link', 'show')}"
            )
        time.sleep(0.2)
    return [p.to_json() for p in ports]


def load(path: Path) -> tuple[Port, ...]:
    """Ports from the JSON the guest runner wrote after :func:`configure`."""
    return tuple(Port(**d) for d in json.loads(path.read_text())["ports"])
