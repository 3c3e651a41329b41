"""``smcctl decode --json`` names every message's numeric wire type, including messages whose
fields do not carry it (an LLC TEST LINK decodes to user data only: the type is 0x07)."""

from __future__ import annotations

import json

import pytest

from smcd_daemon.cli import main
from smcd_daemon.wire import detect
from smcd_daemon.wire.llc_link import TestLink
from tests.cli.test_offline_cli import KIND_SAMPLES


def _decode_json(data: bytes, capsys: pytest.CaptureFixture[str]) -> dict[str, object]:
    assert main(["decode", "--json", data.hex()]) == 0
    return dict(json.loads(capsys.readouterr().out))


def test_llc_test_link_has_type_0x07(capsys: pytest.CaptureFixture[str]) -> None:
    doc = _decode_json(TestLink(bytes(range(16))).encode(), capsys)
    assert doc["message"] == "TestLink"
    assert doc["type"] == 0x07 and doc["type_hex"] == "0x07"
    assert _decode_json(TestLink(bytes(16), v2=True).encode(), capsys)["type"] == 0x27


def test_every_kind_reports_its_wire_type(capsys: pytest.CaptureFixture[str]) -> None:
    for _name, data in KIND_SAMPLES:
        doc = _decode_json(data, capsys)
        wire_type = data[4] if detect.kind_of(data) == "clc" else data[0]
        assert doc["type"] == wire_type, (doc["message"], doc["type"], wire_type)
