"""Two containers of one host, joined by a bridge: smcd (one daemon for every namespace, #15) vs
the same programs on TCP through the bridge.

    sudo .venv/bin/python bench/netns_bridge.py [--repeats N]

Namespaces: a router ``r`` holding a Linux bridge (198.51.100.1/24) and two "containers" ``a``
(198.51.100.2) and ``b`` (198.51.100.3) on veth ports of it. ``bench/user_app.py`` (stdlib only)
serves in ``b`` on the wildcard address and its client runs in ``a``, as they are (TCP through the
bridge) and under ``smc-run -v`` against a private smcd in the host's namespace (embedded
defaults; its handoff socket reached by path, as a bind mount gives a container). Each figure is
the median of ``--repeats`` fresh process pairs; each row says what its connections got.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, os.fspath(Path(__file__).resolve().parent))
sys.path.insert(1, os.fspath(Path(__file__).resolve().parents[1]))

from userview import APP, App, mode_text, smc_run

from smcd_daemon.demo import PrivateSmcd

PREFIX = f"smcdbench{os.getpid() % 1000}"
BULK = 256 << 20
WARM = 16 << 20


def sh(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, timeout=20)


def build() -> dict[str, str]:
    ns = {k: f"{PREFIX}{k}" for k in "rab"}
    for name in ns.values():
        sh("ip", "netns", "add", name)
        sh("ip", "-n", name, "link", "set", "lo", "up")
    r = ns["r"]
    sh("ip", "-n", r, "link", "add", "br0", "type", "bridge")
    sh("ip", "-n", r, "addr", "add", "198.51.100.1/24", "dev", "br0")
    sh("ip", "-n", r, "link", "set", "br0", "up")
    for k, addr in (("a", "198.51.100.2"), ("b", "198.51.100.3")):
        sh("ip", "link", "add", f"br{k}", "netns", r, "type", "veth", "peer", "name", "eth0",
           "netns", ns[k])  # fmt: skip
        sh("ip", "-n", r, "link", "set", f"br{k}", "master", "br0", "up")
        sh("ip", "-n", ns[k], "addr", "add", f"{addr}/24", "dev", "eth0")
        sh("ip", "-n", ns[k], "link", "set", "eth0", "up")
    return ns


def teardown(ns: dict[str, str]) -> None:
    for name in ns.values():
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


class NsApp(App):
    """A ``user_app.py`` run inside a namespace (``ip netns exec`` in front of the command)."""

    def __init__(self, ns: str, kind: str, env: dict[str, str], args: list[object]) -> None:
        run = [*smc_run(), "-v"] if kind == "smc" else [sys.executable]
        cmd = ["ip", "netns", "exec", ns, *run, os.fspath(APP), *map(str, args)]
        self.err = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (closed by the harness)
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err, env=env,
            text=True, start_new_session=True,
        )  # fmt: skip
        self.what = " ".join(cmd[-len(args) - 1 :])


def run_pair(ns: dict[str, str], kind: str, env: dict[str, str], server: list[object],
             client: list[object]) -> tuple[dict[str, float], Counter[str]]:  # fmt: skip
    srv = NsApp(ns["b"], kind, {**env, "USER_APP_BIND": "0.0.0.0"}, server)
    try:
        port = srv.port()
        cli = NsApp(ns["a"], kind, {**env, "USER_APP_PEER": "198.51.100.3"},
                    [*client[:1], port, *client[1:]])  # fmt: skip
        result = cli.result()
        modes = cli.modes() + srv.modes()
    finally:
        srv.kill()
    return result, modes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    ns = build()
    rows: list[tuple[str, str, str, str]] = []
    try:
        with PrivateSmcd(name="netns-bench") as smcd:
            base = {**os.environ, "PYTHONPATH": os.fspath(Path(__file__).resolve().parents[1])}
            envs = {"tcp": base, "smc": {**base, **smcd.env}}
            figures: dict[tuple[str, str], list[float]] = {}
            modes: dict[tuple[str, str], Counter[str]] = {}
            for _ in range(args.repeats):
                for kind in ("tcp", "smc"):
                    tests = [
                        ("bulk 64 KiB writes (MB/s)", ["sink", WARM, BULK, 1 << 20],
                         ["send", WARM, BULK, 64 << 10], "bytes_per_s", 1e-6),
                        ("round trip 1 B p50 (us)", ["echo", 1], ["rr", 1, 20000, 2000],
                         "p50_us", 1.0),
                        ("round trip 64 KiB p50 (us)", ["echo", 1], ["rr", 65536, 3000, 300],
                         "p50_us", 1.0),
                    ]  # fmt: skip
                    for name, server, client, key, scale in tests:
                        res, got = run_pair(ns, kind, envs[kind], server, client)
                        figures.setdefault((name, kind), []).append(res[key] * scale)
                        modes.setdefault((name, kind), Counter()).update(got)
            for name in dict.fromkeys(n for n, _ in figures):
                tcp = statistics.median(figures[(name, "tcp")])
                smc = statistics.median(figures[(name, "smc")])
                rows.append((name, f"{tcp:,.1f}", f"{smc:,.1f}", mode_text(modes[(name, "smc")])))
    finally:
        teardown(ns)
    print("| two namespaces on a bridge | TCP through the bridge | smcd | smcd's connections |")
    print("|---|---:|---:|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
