"""``bench/timeline_connections.py``'s reading of ``perf script`` output: events of the three
processes only, cut into connections at the client's TCP ``socket()``, each step found where
the chain puts it (failed calls and a hang-up's empty read skipped), and a connection missing a
step left out of the medians. The recording itself needs ``perf`` and root and is not run here.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]


def _tool() -> ModuleType:
    sys.path.insert(0, str(REPO / "bench"))
    path = REPO / "bench" / "timeline_connections.py"
    spec = importlib.util.spec_from_file_location("timeline_connections", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


C, S, D, OTHER = 100, 200, 300, 999


def _call(tid: int, t_us: float, nr: int, args: str, result: str) -> list[str]:
    t = 1000.0 + t_us / 1e6
    return [
        f"{tid} {t:.6f}: raw_syscalls:sys_enter: NR {nr} ({args})",
        f"{tid} {t + 1e-6:.6f}:  raw_syscalls:sys_exit: NR {nr} = {result}",
    ]


def _connection(start: float, *, second_reply: bool = True) -> list[str]:
    ev = []
    ev += _call(C, start + 0, 41, "2, 80001, 6, 0, 0, 0", "4")  # the TCP socket
    ev += _call(C, start + 10, 42, "4, 7ffd, 10, 0, 0, 0", "0")
    ev += _call(S, start + 12, 288, "3, 0, 0, 80000, 0, 0", "-11")  # EAGAIN: skipped
    ev += _call(S, start + 14, 288, "3, 0, 0, 80000, 0, 0", "5")
    ev += _call(C, start + 20, 41, "1, 80805, 0, 0, 0, 0", "7")  # the handoff socket
    ev += _call(C, start + 30, 46, "7, 0, 0, 0, 0, 0", "16")
    ev += _call(S, start + 40, 46, "6, 0, 0, 0, 0, 0", "16")
    ev += _call(D, start + 50, 47, "10, 0, 0, 0, 0, 0", "0")  # a hang-up: skipped
    ev += _call(D, start + 60, 47, "9, 0, 0, 0, 0, 0", "16")
    ev += _call(D, start + 80, 47, "11, 0, 0, 0, 0, 0", "16")
    ev += _call(D, start + 100, 44, "10, 0, c0, 4040, 0, 0", "192")
    ev += _call(D, start + 200, 46, "11, 0, 0, 0, 0, 0", "29")
    if second_reply:
        ev += _call(D, start + 250, 46, "9, 0, 0, 0, 0, 0", "29")
    ev += _call(S, start + 220, 47, "6, 0, 0, 0, 0, 0", "29")
    ev += _call(C, start + 270, 47, "7, 0, 0, 0, 0, 0", "29")
    ev += _call(S, start + 300, 3, "8, 0, 0, 0, 0, 0", "0")
    ev += _call(C, start + 350, 3, "9, 0, 0, 0, 0, 0", "0")
    ev += _call(OTHER, start + 360, 3, "9, 0, 0, 0, 0, 0", "0")  # another process: ignored
    return ev


def test_steps_of_each_connection_and_their_medians() -> None:
    tool = _tool()
    text = "\n".join([*_connection(0), *_connection(1000, second_reply=False),
                      *_connection(2000), *_connection(3000), "garbage line"])  # fmt: skip
    events = tool.parse(text, {C: "C", S: "S", D: "D"})
    assert events and all(e[1] in "CSD" for e in events)
    assert [e[0] for e in events] == sorted(e[0] for e in events)
    segs = tool.connections(events)
    assert len(segs) == 3  # four starts: three whole connections
    one = tool.steps(segs[0])
    assert one is not None
    assert one["client: TCP connected"] == 11.0
    assert one["server: accept() returned"] == 15.0  # not the EAGAIN before it
    assert one["smcd: first request read"] == 61.0  # not the hang-up's empty read
    assert one["smcd: second request read"] == 81.0
    assert one["smcd: CLC Proposal sent"] == 100.0
    assert (one["smcd: first reply sent"], one["smcd: second reply sent"]) == (200.0, 250.0)
    assert one["client: close() began"] == 350.0
    assert one["next connection"] == 1000.0
    assert tool.steps(segs[1]) is None  # its second reply is missing
    n, rows = tool.medians(segs)
    assert n == 2
    assert [k for _t, k in rows][:2] == ["client: TCP connected", "server: accept() returned"]
    assert rows == sorted(rows)
