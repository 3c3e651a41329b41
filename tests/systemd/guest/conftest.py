"""Guest-side guard: these tests install smcd system-wide with the README's commands (``make
install``, ``systemctl enable``) and uninstall it, so they run only inside the systemd VM
(``pytest tests/systemd`` boots it; ``boot.sh`` sets ``SMCD_SYSTEMD_VM_OUT``). Run by hand on a
development host they would install smcd there: the session stops before the first test."""

from __future__ import annotations

import os

import pytest


def pytest_sessionstart(session: pytest.Session) -> None:
    if session.config.option.collectonly:
        return  # listing the tests changes nothing
    if not os.environ.get("SMCD_SYSTEMD_VM_OUT") or not os.path.isdir("/run/systemd/system"):
        pytest.exit(
            "tests/systemd/guest run only inside the systemd VM (they install smcd system-wide): "
            "run `pytest tests/systemd` on the host",
            returncode=3,
        )
