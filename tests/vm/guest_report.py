"""pytest plugin for the guest run: one JSON line per event, written as it happens.

Why not JUnit XML at the end: a guest that hangs or panics mid-session must still hand back the
results it had, and the name of the test it was in. Lines are flushed and fsynced to the shared
(9p) directory as they are written, so the host reads them even after killing qemu.

Loaded in the guest with ``-p tests.vm.guest_report``; the path comes from ``SMCD_VM_REPORT``.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import pytest

_ENV = "SMCD_VM_REPORT"


class _Writer:
    def __init__(self, path: str) -> None:
        self._f = open(path, "a", encoding="utf-8")  # noqa: SIM115 (lives as long as the session)

    def write(self, **event: Any) -> None:
        event["t"] = round(time.monotonic(), 3)
        self._f.write(json.dumps(event) + "\n")
        self._f.flush()
        os.fsync(self._f.fileno())

    def close(self) -> None:
        self._f.close()


_writer: _Writer | None = None


def pytest_configure(config: pytest.Config) -> None:
    global _writer
    path = os.environ.get(_ENV)
    if path and _writer is None:
        _writer = _Writer(path)


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if _writer is not None and report.failed:
        _writer.write(event="collect_error", nodeid=report.nodeid, text=report.longreprtext)


def pytest_collection_finish(session: pytest.Session) -> None:
    if _writer is not None:
        _writer.write(event="collected", nodeids=[item.nodeid for item in session.items])


def pytest_runtest_logstart(nodeid: str, location: tuple[str, int | None, str]) -> None:
    if _writer is not None:
        _writer.write(event="start", nodeid=nodeid)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if _writer is None:
        return
    text = report.longreprtext if report.outcome != "passed" else ""
    for title, content in report.sections:
        if report.outcome != "passed" and content.strip():
            text += f"\n----- {title} -----\n{content}"
    _writer.write(
        event="report",
        nodeid=report.nodeid,
        when=report.when,
        outcome=report.outcome,
        duration=round(report.duration, 3),
        text=text,
    )


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    global _writer
    if _writer is not None:
        _writer.write(event="finish", exitstatus=int(exitstatus))
        _writer.close()
        _writer = None
