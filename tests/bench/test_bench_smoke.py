"""``bench/run.py --quick``: the benchmark runs end to end and prints its two tables complete.

Checks structure, never speed: every row is there, every figure of every kind was measured (so
the smcd column really went through a private daemon and a shared-memory channel), every ratio
was computed, and every target carries a met/not-met mark. The raw figures (``--json``) must
agree with the table. The ceiling row (``bench/ceiling.c``, compiled and run in the same run)
must be a number with its ratios, and what the table derives from it (the 64 KiB target's
"> ceiling" remark, smcd's share of it) must follow from the raw figures. The user view (an
smcd with no configuration, ``bench/user_app.py`` on TCP and under ``smc-run``): every row has
both figures, the transport its connections got, and a met column that follows from the raw
figures and that transport (a fallback is never "met").
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RUN = REPO / "bench" / "run.py"

ROWS = [
    "throughput, 64 KiB writes",
    "ceiling: C shared-memory copy, 64 KiB",
    "throughput, 1 MiB writes",
    "ping-pong RTT 1 B, p50",
    "ping-pong RTT 1 B, p99",
    "ping-pong RTT 1 KiB, p50",
    "ping-pong RTT 1 KiB, p99",
    "connect (+handoff), p50",
    "connect (+handoff), p99",
    "handoff+handshake, p50",
    "handoff+handshake, p99",
    "handoffs/s, one connection at a time",
    "handoffs/s, 4 connections at a time",
    "connections/s, one at a time",
    "connections/s, 4 at a time",
]
TARGETS = {
    "throughput, 64 KiB writes": ">= 4x tcp, >= 1.5x unix",
    "ping-pong RTT 1 B, p50": "<= 0.3x tcp",
    "ping-pong RTT 1 KiB, p50": "<= 0.3x tcp",
    "handoff+handshake, p50": "<= 2000 us",
    "handoffs/s, one connection at a time": ">= 1000/s (each end's)",
    "connections/s, one at a time": ">= 1000/s (per connection)",
}
NUM = r"[\d,]+(?:\.\d+)?"
RATIO = r"\d+\.\d\dx"


def test_quick_bench_prints_a_complete_table(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SMCD_")}
    raw = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, os.fspath(RUN), "--quick", "--json", os.fspath(raw)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    out = proc.stdout
    assert proc.returncode == 0, f"bench failed ({proc.returncode}):\n{out}\n{proc.stderr}"
    assert "note:" not in out, out
    assert re.search(r"^machine: \d+ CPUs .*Python 3\.\d+", out, re.M), out

    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("metric "))
    assert lines[header].split() == [
        "metric", "unit", "tcp", "unix", "smcd", "smcd/tcp", "smcd/unix", "target", "met",
    ]  # fmt: skip
    assert set(lines[header + 1]) <= {"-", " "}
    body = lines[header + 2 : header + 2 + len(ROWS)]
    assert "smc-run" not in lines[header], "the classic table comes first"
    for label, line in zip(ROWS, body, strict=True):
        assert line.startswith(label + " "), (label, line)
        rest = line[len(label) :].split()
        unit = rest[0]
        assert unit in ("GB/s", "us", "1/s"), line
        if label.startswith(("handoff+handshake", "handoffs/s")):  # smcd only
            assert rest[1:3] == ["-", "-"] and rest[4:6] == ["-", "-"], line
            assert re.fullmatch(NUM, rest[3]), line
        elif label.startswith("ceiling"):  # its figure in the smcd column, ratios beside it
            assert rest[1:3] == ["-", "-"], line
            assert re.fullmatch(NUM, rest[3]), line
            assert all(re.fullmatch(RATIO, v) for v in rest[4:6]), line
        else:
            assert all(re.fullmatch(NUM, v) for v in rest[1:4]), line
            assert all(re.fullmatch(RATIO, v) for v in rest[4:6]), line
        tail = " ".join(rest[6:])
        if label == "throughput, 64 KiB writes":
            continue  # its met column depends on the ceiling: checked against the raw figures
        if label in TARGETS:
            assert tail in (TARGETS[label] + " met", TARGETS[label] + " NOT met"), line
        else:
            assert tail == "", line

    # the raw figures: every kind measured every figure that applies to it, and they match
    data = json.loads(raw.read_text())
    res = data["results"]
    ceiling = res.pop("ceiling")
    assert set(res) == {"tcp", "unix", "smcd"}
    for kind, values in res.items():
        for key, value in values.items():
            if key.startswith(("handoff_", "handoffs_")) and kind != "smcd":
                assert value is None
            else:
                assert isinstance(value, float) and value > 0, (kind, key, value)
    rate_row = body[ROWS.index("connections/s, one at a time")].split()
    smcd_rate = float(rate_row[rate_row.index("1/s") + 3].replace(",", ""))
    assert abs(smcd_rate - res["smcd"]["rate_1"]) <= max(1.0, res["smcd"]["rate_1"] * 0.01)
    # two handoffs per connection (the client's and the server's), both concurrency levels
    for rate, handoffs in (("rate_1", "handoffs_1"), ("rate_n", "handoffs_n")):
        assert res["smcd"][handoffs] == 2 * res["smcd"][rate], (rate, handoffs, res["smcd"])

    # the ceiling: measured, shown as measured, and what the table says about it follows
    c = ceiling["tput_64k"]
    assert set(ceiling) == {"tput_64k"} and isinstance(c, float) and c > 0, ceiling
    shown = body[ROWS.index("ceiling: C shared-memory copy, 64 KiB")].split()
    assert abs(float(shown[shown.index("GB/s") + 3]) - c / 1e9) <= 0.051, (shown, c)
    tcp, unix, smcd = (res[k]["tput_64k"] for k in ("tcp", "unix", "smcd"))
    met = smcd >= 4 * tcp and smcd >= 1.5 * unix
    above = [t for t, v in (("4x tcp", 4 * tcp), ("1.5x unix", 1.5 * unix)) if v > c]
    expected = TARGETS["throughput, 64 KiB writes"] + (" met" if met else " NOT met")
    if above:
        expected += f" ({', '.join(above)} > ceiling)"
    row64 = body[ROWS.index("throughput, 64 KiB writes")]
    assert " ".join(row64.split()[10:]) == expected, (row64, expected, ceiling)
    share = data["ceiling"]["smcd_share_64k"]
    assert abs(share - smcd / c) < 1e-9, (share, smcd, c)
    assert f"smcd reaches {share:.0%} of it" in out, out

    check_user_view(out, data, c)


USER_ROWS = [
    # label, unit, target (None: none), kind ("cmp": tcp vs smc-run, "bound": one figure)
    ("bulk, 64 KiB sendall, receiver only reads", "GB/s", ">= 2.0x tcp, >= 80% of ceiling", "cmp"),
    ("bound: ceiling (C, shared memory)", "GB/s", None, "bound"),
    ("bound: C through the default DMB's ring", "GB/s", None, "bound"),
    ("bulk, receiver checks every 65th byte", "GB/s", ">= 1.4x tcp", "cmp"),
    ("bound: that receiver reading memory", "GB/s", None, "bound"),
    ("round trip 1 B, p50", "us", "<= 0.3x tcp", "cmp"),
    ("bound: C shared-memory echo, p50", "us", None, "bound"),
    ("bound: Python shared-memory echo, two CPUs, p50", "us", None, "bound"),
    ("bound: Python shared-memory echo, one CPU, p50", "us", None, "bound"),
    ("round trip 1 B, p99", "us", None, "cmp"),
    ("round trip 1 KiB, p50", "us", "<= 0.3x tcp", "cmp"),
    ("bound: C shared-memory echo, p50", "us", None, "bound"),
    ("bound: Python shared-memory echo, two CPUs, p50", "us", None, "bound"),
    ("bound: Python shared-memory echo, one CPU, p50", "us", None, "bound"),
    ("round trip 1 KiB, p99", "us", None, "cmp"),
    ("round trip 64 KiB, p50", "us", "<= 0.5x tcp", "cmp"),
    ("bound: C shared-memory echo, p50", "us", None, "bound"),
    ("bound: Python shared-memory echo, two CPUs, p50", "us", None, "bound"),
    ("bound: Python shared-memory echo, one CPU, p50", "us", None, "bound"),
    ("round trip 64 KiB, p99", "us", None, "cmp"),
    ("TLS round trip 1 KiB (ssl), p50", "us", None, "cmp"),
    ("TLS round trip 1 KiB (ssl), p99", "us", None, "cmp"),
    ("TLS bulk, 64 KiB sendall (ssl)", "GB/s", None, "cmp"),
    ("connections/s, one at a time", "1/s", ">= 1500/s", "cmp"),
    ("setup p50 (connect + first send), one at a time", "us", "<= 500 us", "cmp"),
    ("client's CPU per connection", "us", None, "cmp"),
    ("echo server's CPU per connection", "us", None, "cmp"),
    ("bound: smcd CPU per connection", "us", None, "bound"),
    ("bound: CPU per connection, smcd + client + server", "us", None, "bound"),
    (
        f"bound: connections/s that CPU allows on {len(os.sched_getaffinity(0))} CPUs",
        "1/s",
        None,
        "bound",
    ),
    ("bound: minimal Python handoff chain", "1/s", None, "bound"),
    ("bound: minimal Python handoff chain, p50", "us", None, "bound"),
    ("bound: its broker's CPU per connection", "us", None, "bound"),
    ("bound: its client's + server's CPU per connection", "us", None, "bound"),
    ("connections/s, 4 at a time", "1/s", None, "cmp"),
    ("memory, 20 idle connections", "MiB", "<= 300 MiB, smcd + apps", "cmp"),
]
USER_KEYS = {
    "bulk, 64 KiB sendall, receiver only reads": "bulk",
    "bulk, receiver checks every 65th byte": "bulk_work",
    "round trip 1 B, p50": "rr_1b_p50",
    "round trip 1 KiB, p50": "rr_1k_p50",
    "round trip 64 KiB, p50": "rr_64k_p50",
    "connections/s, one at a time": "conns_1",
    "setup p50 (connect + first send), one at a time": "connect_p50",
    "memory, 20 idle connections": "memory",
}


def _expected_met(key: str, smc: dict, tcp: dict, bound: dict, mode: str) -> str:
    """The met column recomputed from the raw figures, independently of bench/_usertable."""
    s, t = smc[key], tcp[key]
    ok = {
        "bulk": s >= 2.0 * t and s >= 0.8 * bound["ceiling"],
        "bulk_work": s >= 1.4 * t,
        "rr_1b_p50": s <= 0.3 * t,
        "rr_1k_p50": s <= 0.3 * t,
        "rr_64k_p50": s <= 0.5 * t,
        "conns_1": s >= 1500,
        "connect_p50": s <= 500,
        "memory": s <= 300 * 2**20,
    }[key]
    why = [] if mode == "smcd" else ["not on smcd"]
    if key == "bulk" and 2.0 * t > bound["ceiling"]:
        why.append("2x tcp > ceiling")
    if key == "bulk_work" and 1.4 * t > bound["work"]:
        why.append("1.4x tcp > bound")
    cpu_limit = {"conns_1": 1e6 / 1500, "connect_p50": 500}.get(key)
    if cpu_limit is not None and bound["smcd_cpu"] > cpu_limit:
        why.append(f"smcd CPU > {cpu_limit:.0f} us")
    # what the three processes' CPU per connection allows on this machine's CPUs
    cpus = len(os.sched_getaffinity(0))
    chain = bound["smcd_cpu"] + smc["cpu_client"] + smc["cpu_server"]
    assert math.isclose(bound["chain_cpu"], chain)
    assert math.isclose(bound["cpu_rate"], cpus * 1e6 / chain)
    if key == "conns_1" and bound["cpu_rate"] < 1500:
        why.append(f"CPU allows {bound['cpu_rate']:.0f}/s")
    factor = {"rr_1b_p50": 0.3, "rr_1k_p50": 0.3, "rr_64k_p50": 0.5}.get(key)
    if factor is not None and factor * t < bound[key]:
        why.append(f"{factor:g}x tcp < bound")
    for suffix, where in (("py2", "two CPUs"), ("py1", "one CPU")):
        if factor is not None and factor * t < bound[f"{key}_{suffix}"]:
            why.append(f"{factor:g}x tcp < Python echo, {where}")
    text = "met" if ok and mode == "smcd" else "NOT met"
    return f"{text} ({'; '.join(why)})" if why else text


def check_user_view(out: str, data: dict, ceiling: float) -> None:
    """The user view (smcd with no configuration, stdlib programs under smc-run): every row
    measured on both transports, each row's mode reported, the met column follows the figures."""
    lines = out.splitlines()
    header = next(
        i for i, line in enumerate(lines) if line.startswith("metric ") and "smc-run" in line
    )
    assert lines[header].split() == [
        "metric", "unit", "tcp", "smc-run", "smc/tcp", "target", "met", "mode",
    ]  # fmt: skip
    assert re.search(r"smcd with NO configuration", out), out
    body = lines[header + 2 : header + 2 + len(USER_ROWS)]
    view = data["user_view"]
    res, modes = view["results"], view["modes"]
    for (label, unit, target, kind), line in zip(USER_ROWS, body, strict=True):
        assert line.strip().startswith(label + " "), (label, line)
        rest = line.strip()[len(label) :].split()
        assert rest[0] == unit, line
        if kind == "bound":
            assert rest[1] == "-" and rest[3] == "-" and re.fullmatch(NUM, rest[2]), line
            continue
        assert all(re.fullmatch(NUM, v) for v in rest[1:3]), line
        assert re.fullmatch(RATIO, rest[3]), line
        tail = " ".join(rest[4:])
        key = USER_KEYS.get(label)
        if target is None:
            mode = tail
        else:
            assert tail.startswith(target + " "), (line, target)
            expected = _expected_met(key, res["smc"], res["tcp"], res["bound"], modes[key])
            assert tail[len(target) + 1 :].startswith(expected + " "), (line, expected)
            mode = tail[len(target) + 1 + len(expected) + 1 :]
            assert view["met"][key] == expected, (view["met"], key, expected)
        # the transport every smc-run connection of the row got, as smc-run -v reported it
        assert re.fullmatch(r"smcd|tcp \(SMC_\w+(, SMC_\w+)*\)|mixed: .+", mode), line
    for kind in ("tcp", "smc"):
        assert all(isinstance(v, float) and v > 0 for v in res[kind].values()), res[kind]
    assert all(isinstance(v, float) and v > 0 for v in res["bound"].values()), res["bound"]
    assert res["bound"]["ceiling"] == ceiling  # the classic table's ceiling row, this run's
    assert re.search(r"^memory PSS/RSS MiB of the last run: .*smc smcd ", out, re.M), out
