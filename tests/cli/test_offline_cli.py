"""smcctl explain / decode, run as the real installed console script, and the interim demo."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from smcd_daemon.cli.offline import HexInputError, parse_hex
from smcd_daemon.wire import detect
from tests.wire import st_cdc, st_clc, st_llc

ROOT = Path(__file__).resolve().parents[2]
SMCCTL = ROOT / ".venv" / "bin" / "smcctl"


def smcctl(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    if not SMCCTL.exists():
        pytest.fail(f"{SMCCTL} missing: run `make venv` (pip install -e '.[test]') first")
    return subprocess.run(
        [str(SMCCTL), *args],
        input=stdin if stdin is not None else "",
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


# ---------------------------------------------------------------------------------------- explain


def test_explain_known_code_prints_name_meaning_advice() -> None:
    r = smcctl("explain", "0x03030008")
    assert r.returncode == 0, r.stderr
    assert "SMC_CLC_DECL_NOUEID" in r.stdout
    assert "meaning" in r.stdout and "smcctl ueid add" in r.stdout
    assert r.stderr == ""


def test_explain_decimal_and_json() -> None:
    r = smcctl("explain", "--json", str(0x030E0000))
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["name"] == "SMC_CLC_DECL_NOROUTE"
    assert doc["code"] == 0x030E0000 and doc["code_hex"] == "0x030e0000"
    assert doc["class"]["value"] == 3 and doc["known"] is True
    assert "RoCE netdevs" in doc["advice"]


def test_explain_llc_delete_link_reason() -> None:
    r = smcctl("explain", "0x00010000")
    assert r.returncode == 0
    assert "SMC_LLC_DEL_LOST_PATH" in r.stdout


def test_explain_unknown_code_says_unknown_and_class_exit_0() -> None:
    r = smcctl("explain", "0x0303ffff")
    assert r.returncode == 0, r.stderr
    assert "unknown" in r.stdout
    assert "0x03" in r.stdout and "configuration" in r.stdout


@pytest.mark.parametrize("arg", ["bogus", "0x1ffffffff", "-3", "0x"])
def test_explain_malformed_argument_is_one_line_exit_2(arg: str) -> None:
    r = smcctl("explain", "--", arg) if arg.startswith("-") else smcctl("explain", arg)
    assert r.returncode == 2
    assert r.stdout == ""
    assert len(r.stderr.strip().splitlines()) == 1
    assert r.stderr.startswith("smcctl explain: ")


def test_help_texts_describe_the_commands() -> None:
    r = smcctl("explain", "--help")
    assert r.returncode == 0 and "CODE" in r.stdout and "class byte" in r.stdout
    r = smcctl("decode", "--help")
    assert r.returncode == 0
    for word in ("stdin", "--json", "xxd", "tshark", "exit status 2", "IPv6"):
        assert word in r.stdout, word
    r = smcctl("--help")
    assert "explain" in r.stdout and "decode" in r.stdout


# -------------------------------------------------------------------------------------- parse_hex

MSG = bytes.fromhex("e2d4c3d904001c10") + bytes(range(16)) + b"\xe2\xd4\xc3\xd9"


@pytest.mark.parametrize(
    "text",
    [
        MSG.hex(),
        MSG.hex(" "),
        MSG.hex(":"),
        " ".join(f"0x{b:02x}" for b in MSG),
        MSG.hex().upper(),
        "\n".join(MSG.hex()[i : i + 30] for i in range(0, len(MSG.hex()), 30)),
        "0x" + MSG.hex(),
    ],
)
def test_parse_hex_plain_spellings(text: str) -> None:
    assert parse_hex(text) == MSG


def _xxd(data: bytes) -> str:
    lines = []
    for off in range(0, len(data), 16):
        chunk = data[off : off + 16]
        groups = " ".join(chunk[i : i + 2].hex() for i in range(0, len(chunk), 2))
        ascii_col = "".join(chr(b) if 0x20 <= b < 0x7F else "." for b in chunk)
        lines.append(f"{off:08x}: {groups:<39}  {ascii_col}")
    return "\n".join(lines) + "\n"


def _tshark(data: bytes) -> str:
    lines = []
    for off in range(0, len(data), 16):
        chunk = data[off : off + 16]
        left = " ".join(f"{b:02x}" for b in chunk[:8])
        right = " ".join(f"{b:02x}" for b in chunk[8:])
        ascii_col = "".join(chr(b) if 0x20 <= b < 0x7F else "." for b in chunk)
        lines.append(f"{off:04x}  {left:<23}  {right:<23}   {ascii_col}")
    return "\n".join(lines) + "\n"


def test_parse_hex_dumps_including_hexlike_ascii_column() -> None:
    # The last line's ASCII column ("abcd") is itself valid hex: it must not become data.
    data = MSG + b"abcd"
    assert parse_hex(_xxd(data)) == data
    assert parse_hex(_tshark(data)) == data


def test_parse_hex_real_xxd_and_hexdump_if_present(tmp_path: Path) -> None:
    data = MSG + b"cafe 12"
    f = tmp_path / "m.bin"
    f.write_bytes(data)
    for tool in (["xxd"], ["hexdump", "-C"]):
        try:
            out = subprocess.run([*tool, str(f)], capture_output=True, text=True, check=True)
        except FileNotFoundError:
            continue  # the hand-built dumps above cover the format
        assert parse_hex(out.stdout) == data, tool


@pytest.mark.parametrize(("text", "word"), [("e2d4zz", "hex digit"), ("e2d", "odd"), ("", "no")])
def test_parse_hex_errors(text: str, word: str) -> None:
    with pytest.raises(HexInputError, match=word):
        parse_hex(text)


# ----------------------------------------------------------------------------------------- decode


def _all_samples() -> list[tuple[str, bytes]]:
    out = []
    for module in (st_clc, st_llc, st_cdc):
        for attr in ("SAMPLES", "SMCD_SAMPLES"):
            samples = getattr(module, attr, [])
            items = samples.items() if isinstance(samples, dict) else enumerate(samples)
            for name, data in items:
                label = f"{module.__name__.rsplit('.', 1)[1]}.{attr}[{name}]"
                out.append((label, bytes(data)))
    return out


SAMPLES = _all_samples()


def _one_per_kind(samples: list[tuple[str, bytes]]) -> list[tuple[str, bytes]]:
    """One sample per message class (and LLC version): each smcctl run costs a process start."""
    chosen: dict[tuple[str, str, int], tuple[str, bytes]] = {}
    for name, data in samples:
        key = (detect.kind_of(data), type(detect.decode_any(data)).__name__, data[0] >> 4)
        chosen.setdefault(key, (name, data))
    return list(chosen.values())


KIND_SAMPLES = _one_per_kind(SAMPLES)


def test_samples_cover_every_kind() -> None:
    kinds = {detect.kind_of(d) for _, d in KIND_SAMPLES}
    assert kinds == set(detect.KINDS)
    classes = {type(detect.decode_any(d)).__name__ for _, d in KIND_SAMPLES}
    assert {"Proposal", "Accept", "Confirm", "Decline"} <= classes


@pytest.mark.parametrize(("name", "data"), KIND_SAMPLES, ids=[n for n, _ in KIND_SAMPLES])
def test_decode_every_sample_kind_text_and_json(name: str, data: bytes) -> None:
    expected = detect.decode_any(data)
    r = smcctl("decode", data.hex())
    assert r.returncode == 0, r.stderr
    assert type(expected).__name__ in r.stdout.splitlines()[0]
    assert data.hex() in r.stdout
    r = smcctl("decode", "--json", data.hex())
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["kind"] == detect.kind_of(data)
    assert doc["message"] == type(expected).__name__
    assert doc["length"] == len(data) and doc["hex"] == data.hex()
    assert isinstance(doc["fields"], dict) and doc["fields"]


def test_decode_decline_shows_reason_name_and_meaning() -> None:
    declines = [(n, d) for n, d in SAMPLES if d[:4] == b"\xe2\xd4\xc3\xd9" and d[4] == 4]
    assert declines, "st_clc.SAMPLES should hold a Decline"
    for _name, data in declines:
        code = int.from_bytes(data[16:20], "big")
        r = smcctl("decode", data.hex())
        assert r.returncode == 0, r.stderr
        exp_name = detect_reason_name(code)
        assert exp_name in r.stdout
        doc = json.loads(smcctl("decode", "--json", data.hex()).stdout)
        names = [e["name"] for e in doc["explanations"].values()]
        assert exp_name in names


def detect_reason_name(code: int) -> str:
    from smcd_daemon.wire.reasons import explain

    return explain(code).name or "unknown"


def test_decode_reads_stdin_and_tolerates_dump_format() -> None:
    _name, data = SAMPLES[0]
    r = smcctl("decode", stdin=_xxd(data))
    assert r.returncode == 0, r.stderr
    assert data.hex() in r.stdout
    r = smcctl("decode", "-", "--json", stdin=data.hex(":"))
    assert json.loads(r.stdout)["hex"] == data.hex()


@pytest.mark.parametrize(("name", "data"), SAMPLES[:1] + SAMPLES[-1:])
def test_decode_corrupt_bytes_one_line_exit_2_field_named(name: str, data: bytes) -> None:
    truncated = data[: len(data) // 2 + 1]
    r = smcctl("decode", truncated.hex())
    assert r.returncode == 2, r.stdout
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("smcctl decode: ")
    assert "offset" in lines[0]


def test_decode_unknown_bytes_and_bad_hex() -> None:
    r = smcctl("decode", "77" * 44)
    assert r.returncode == 2
    assert len(r.stderr.strip().splitlines()) == 1 and "offset 0" in r.stderr
    r = smcctl("decode", "e2d4c3q9")
    assert r.returncode == 2 and "hex digit" in r.stderr
    r = smcctl("decode", stdin="   \n")
    assert r.returncode == 2 and "no bytes" in r.stderr


# ------------------------------------------------------------------------------------------- demo


def test_demo_runs_a_real_loopback_handshake() -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run(
        [sys.executable, "-m", "smcd_daemon.demo"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env=env,
        check=False,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    for word in ("Proposal", "Accept", "Confirm", "handoff"):
        assert word in out, word
    assert out.count("decoded equal to what was sent") == 3
    assert "e2 d4 c3 d9" in out  # the Proposal's eyecatcher, in the hex dump
    assert "ffff" in out and "SMCD-DEMO-UEID" in out  # loopback-ism CHID, the UEID


# ------------------------------------------------------------------------------------ rendering


def test_json_renders_macs_gids_enums_and_bytes_as_documented() -> None:
    from smcd_daemon.wire import clc

    accepts = [d for _, d in SAMPLES if d[:4] == b"\xe2\xd4\xc3\xd9" and d[4] == 2]
    smcr = [d for d in accepts if isinstance(clc.decode(d), clc.Accept) and d[7] & 0x03 == 0]
    assert smcr, "st_clc.SAMPLES should hold an SMC-R Accept"
    msg = clc.decode(smcr[0])
    assert isinstance(msg, clc.Accept) and isinstance(msg.info, clc.SmcrInfo)
    doc = json.loads(smcctl("decode", "--json", smcr[0].hex()).stdout)
    info = doc["fields"]["info"]
    assert info["mac"] == ":".join(f"{b:02x}" for b in msg.info.mac)
    gid = msg.info.gid
    assert ":" in info["gid"] and len(gid) == 16
    assert info["peer_id"] == msg.info.peer_id.hex()
    if gid[:12] == bytes(10) + b"\xff\xff":
        assert info["gid"] == "::ffff:" + ".".join(str(b) for b in gid[12:])
    if doc["fields"].get("fce"):
        assert set(doc["fields"]["fce"]["os_type"]) == {"value", "name"}


def test_render_rules_in_process() -> None:
    import dataclasses
    import enum

    from smcd_daemon.cli.render import render_text, to_jsonable

    class Color(enum.IntEnum):
        RED = 1

    class Bits(enum.IntFlag):
        A = 1
        B = 2

    @dataclasses.dataclass(frozen=True)
    class Inner:
        count: int

    @dataclasses.dataclass(frozen=True)
    class Msg:
        sender_mac: bytes
        roce_gid: bytes
        blob: bytes
        color: Color
        bits: Bits
        none_bits: Bits
        inner: Inner
        items: tuple[int, ...]
        big: int
        name: str = dataclasses.field(default="x", metadata={"render": "text"})

    gid = bytes(10) + b"\xff\xff" + bytes([192, 0, 2, 1])
    m = Msg(
        b"\x02\x00\x00\xaa\xbb\xcc",
        gid,
        b"\x01\x02",
        Color.RED,
        Bits.A | Bits.B,
        Bits(0),
        Inner(12),
        (1, 2),
        1 << 40,
    )
    j = to_jsonable(m)
    assert list(j) == [f.name for f in dataclasses.fields(Msg)]  # stable, declaration order
    assert j["sender_mac"] == "02:00:00:aa:bb:cc"
    assert j["roce_gid"] == "::ffff:192.0.2.1"
    assert j["blob"] == "0102"
    assert j["color"] == {"value": 1, "name": "RED"}
    assert j["bits"]["value"] == 3 and set(j["bits"]["name"].split("|")) == {"A", "B"}
    assert j["none_bits"] == {"value": 0, "name": None}
    assert j["inner"] == {"count": 12} and j["items"] == [1, 2]
    text = render_text(m)
    lines = text.splitlines()
    assert lines[0].startswith("sender_mac ") and " : 02:00:00:aa:bb:cc" in lines[0]
    assert len({ln.index(" : ") for ln in lines if not ln.startswith(" ") and " : " in ln}) == 1
    assert "RED (1)" in text and "none (0)" in text and "12 (0xc)" in text
    assert "0x10000000000" in text and "  count : 12 (0xc)" in text


def test_demo_exchange_is_only_ok_when_equal() -> None:
    from smcd_daemon import demo

    sent = demo.build_accept()
    wire = sent.encode()
    good = demo.Exchange("server", sent, wire, wire, sent)
    assert good.ok
    other = demo.build_confirm()
    assert not demo.Exchange("server", sent, wire, wire, other).ok
    assert not demo.Exchange("server", sent, wire, wire[:-1], sent).ok
    assert not demo.Exchange("server", sent, wire).ok
