"""Session fixtures: one loopback capture + one tshark run for all CLC messages, one synthetic
RoCEv2 pcap + one tshark run for all LLC/CDC messages (tshark takes ~1 s to start)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.oracle.tshark import require_tool


@pytest.fixture(scope="session", autouse=True)
def wireshark_tools() -> Iterator[None]:
    """Fail (never skip) at the first oracle test when tshark or dumpcap is missing."""
    require_tool("tshark")
    require_tool("dumpcap")
    yield


@pytest.fixture(scope="session")
def oracle_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("oracle")
