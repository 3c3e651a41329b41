"""Guest-side fixtures: these tests run only inside the Soft-RoCE VM (``pytest tests/vm`` boots
it). The network is already up when they start (``tests.vm.guest_main`` configured it); its
description comes from the JSON file named by ``SMCD_VM_TOPOLOGY``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.vm import topology
from tests.vm.topology import Port


def pytest_sessionstart(session: pytest.Session) -> None:
    """Outside the VM (no ``SMCD_VM_TOPOLOGY`` from ``tests.vm.guest_main``) the session stops
    before the first test: the guest tests load kernel modules and start daemons on the
    addresses of the VM's topology. Listing them (``--collect-only``, as the host does) is fine."""
    if not session.config.option.collectonly and not os.environ.get("SMCD_VM_TOPOLOGY"):
        pytest.exit(
            "tests/vm/guest run only inside the Soft-RoCE VM: run `pytest tests/vm` on the host",
            returncode=3,
        )


@pytest.fixture(scope="session")
def ports() -> tuple[Port, ...]:
    """All rxe ports of the VM (host A and B, wire 0 and 1); the session guard above made sure
    that ``SMCD_VM_TOPOLOGY`` names them."""
    return topology.load(Path(os.environ["SMCD_VM_TOPOLOGY"]))


@pytest.fixture(scope="session")
def out_dir() -> Path:
    """The host-shared read-write directory (the root filesystem is read-only)."""
    return Path(os.environ["SMCD_VM_OUT"])


@pytest.fixture
def scratch(out_dir: Path, request: pytest.FixtureRequest) -> Path:
    """A per-test writable directory in the shared output dir (kept for the host to inspect)."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in request.node.name)
    path = out_dir / "scratch" / safe
    path.mkdir(parents=True, exist_ok=True)
    return path
