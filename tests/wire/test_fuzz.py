"""Hostile bytes never crash a decoder: only ProtocolError (or a subclass) may escape.

Every decoder of floor 1 gets well over 100,000 inputs derived from the real samples of each
codec's tests (bit flips, byte changes, truncations, extensions, length-field and count-field
edits, splices of two samples) plus plain random bytes. A decode that succeeds must re-encode
without error, and decoding that encoding must give the same message again: a decoder that
accepts something its encoder cannot write would let a peer put us in a state we cannot express.

The seed is fixed, so a failure reproduces; it prints the decoder and the input hex.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from smcd_daemon.errors import ProtocolError
from smcd_daemon.wire import cdc, clc, detect, llc
from tests.wire import st_cdc, st_clc, st_llc

SEED = 0x5_3C_D0  # "SMCD", roughly
MESSAGES = 100_000


def _samples(module: Any) -> list[bytes]:
    out = []
    for attr in ("SAMPLES", "SMCD_SAMPLES"):
        samples = getattr(module, attr, [])
        values = samples.values() if isinstance(samples, dict) else samples
        out += [bytes(v[1] if isinstance(v, tuple) else v) for v in values]
    assert out, f"{module.__name__}.SAMPLES is empty"
    return out


CLC_SAMPLES = _samples(st_clc)
LLC_SAMPLES = _samples(st_llc)
CDC_SAMPLES = _samples(st_cdc)
ALL_SAMPLES = CLC_SAMPLES + LLC_SAMPLES + CDC_SAMPLES

Decoder = Callable[[bytes], Any]
DECODERS: list[tuple[str, Decoder]] = [
    ("clc.decode", clc.decode),
    ("clc.peek_header", clc.peek_header),
    ("llc.decode", llc.decode),
    ("cdc.decode", cdc.decode),
    ("cdc.SmcdCdcHeader.decode", cdc.SmcdCdcHeader.decode),
    ("detect.decode_any", detect.decode_any),
]


# ------------------------------------------------------------------------------------ mutations


def _flip_bits(rng: random.Random, b: bytearray) -> None:
    for _ in range(rng.randint(1, 3)):
        if b:
            i = rng.randrange(len(b))
            b[i] ^= 1 << rng.randrange(8)


def _set_byte(rng: random.Random, b: bytearray) -> None:
    if b:
        b[rng.randrange(len(b))] = rng.choice((0x00, 0xFF, 0x01, 0x7F, 0x80, rng.randrange(256)))


def _small_count(rng: random.Random, b: bytearray) -> None:
    # Counts (prefixes, EIDs, GID entries, rkeys) live in single bytes: try the edges.
    if b:
        b[rng.randrange(len(b))] = rng.choice((0, 1, 2, 7, 8, 9, 16, 0xFF))


def _truncate(rng: random.Random, b: bytearray) -> None:
    del b[rng.randrange(len(b) + 1) :]


def _extend(rng: random.Random, b: bytearray) -> None:
    b += rng.randbytes(rng.choice((1, 2, 4, rng.randint(1, 64))))


def _insert_or_delete(rng: random.Random, b: bytearray) -> None:
    i = rng.randrange(len(b) + 1)
    if rng.random() < 0.5 and i < len(b):
        del b[i : i + rng.randint(1, 8)]
    else:
        b[i:i] = rng.randbytes(rng.randint(1, 8))


def _length_field(rng: random.Random, b: bytearray) -> None:
    """Edit the length field of whatever kind the bytes look like."""
    n = len(b)
    choices = (0, 1, 4, 8, 28, 44, 48, 52, 68, 78, 108, n - 1, n, n + 1, rng.randrange(1 << 16))
    value = rng.choice(choices) & 0xFFFF
    if n >= 7 and b[0] == 0xE2:  # CLC: u16 at 5
        b[5:7] = value.to_bytes(2, "big")
    elif n >= 3 and b[0] & 0xF0 == 0x20:  # LLC v2: u16 at 1 (host order in Linux)
        b[1:3] = value.to_bytes(2, rng.choice(("big", "little")))
    elif n >= 2:  # LLC v1 / SMC-R CDC: u8 at 1
        b[1] = value & 0xFF


def _splice(rng: random.Random, b: bytearray) -> None:
    other = rng.choice(ALL_SAMPLES)
    cut = rng.randrange(len(b) + 1)
    b[cut:] = other[rng.randrange(len(other) + 1) :]


def _header_swap(rng: random.Random, b: bytearray) -> None:
    """Keep the body but give it another message's first 8 bytes (type/length mismatches)."""
    other = rng.choice(ALL_SAMPLES)
    b[:8] = other[:8]


MUTATIONS = (
    _flip_bits,
    _set_byte,
    _small_count,
    _truncate,
    _extend,
    _insert_or_delete,
    _length_field,
    _splice,
    _header_swap,
)


def _random_message(rng: random.Random) -> bytes:
    """Random bytes behind a plausible first byte (so the decoders get past the type check)."""
    prefix = rng.choice(
        (
            clc.SMCR_EYECATCHER + bytes([rng.randint(1, 4)]),
            clc.SMCD_EYECATCHER + bytes([rng.randint(0, 6)]),
            bytes([rng.randint(1, 9), 44]),
            bytes([rng.choice((0x21, 0x22, 0x24, 0x25, 0x26, 0x27, 0x29, 0x2F))]),
            bytes([0xFE, 44]),
            bytes([0xFE]),
            b"",
        )
    )
    size = rng.choice((0, 1, 8, 28, 32, 44, 48, 68, 78, 108, rng.randrange(700)))
    data = prefix + rng.randbytes(size)
    return data[:size] if rng.random() < 0.5 else data


def inputs(seed: int, count: int) -> Iterator[bytes]:
    rng = random.Random(seed)
    for i in range(count):
        if i % 10 == 0:
            yield _random_message(rng)
            continue
        b = bytearray(rng.choice(ALL_SAMPLES))
        for mutate in rng.sample(MUTATIONS, rng.choice((1, 1, 1, 2, 3))):
            mutate(rng, b)
        yield bytes(b)


# --------------------------------------------------------------------------------------- checks


def check_one(name: str, decode: Decoder, data: bytes) -> str | None:
    """None if the decoder behaved; otherwise a description of the failure."""
    try:
        msg = decode(data)
    except ProtocolError:
        return None
    except Exception as exc:  # anything else is a bug in the decoder
        return f"{name} raised {type(exc).__name__}: {exc} on {data.hex()}"
    encode = getattr(msg, "encode", None)
    if encode is None:  # peek_header returns a header, not a message
        return None
    try:
        again = encode()
    except Exception as exc:
        return f"{name} decoded {msg!r} but encode() raised {type(exc).__name__}: {exc}"
    try:
        back = decode(again)
    except Exception as exc:
        return f"{name}: re-decoding the re-encoding raised {exc!r}; in {data.hex()}"
    if back != msg:
        return f"{name}: decode(encode(m)) != m for m decoded from {data.hex()}"
    return None


def test_samples_themselves_decode_and_round_trip() -> None:
    for data in ALL_SAMPLES:
        msg = detect.decode_any(data)
        assert detect.decode_any(msg.encode()) == msg


def test_fuzz_every_decoder_with_mutated_and_random_messages() -> None:
    failures: list[str] = []
    total = 0
    for data in inputs(SEED, MESSAGES):
        total += 1
        for name, decode in DECODERS:
            problem = check_one(name, decode, data)
            if problem and len(failures) < 20:
                failures.append(problem)
    assert total >= 100_000
    assert not failures, "\n".join(failures)


def test_fuzz_reaches_success_and_failure_paths() -> None:
    """Guard against a fuzzer that only ever feeds garbage: some mutants must still decode."""
    ok = {name: 0 for name, _ in DECODERS}
    bad = dict(ok)
    for data in inputs(SEED + 1, 5_000):
        for name, decode in DECODERS:
            try:
                decode(data)
                ok[name] += 1
            except ProtocolError:
                bad[name] += 1
    for name, _ in DECODERS:
        assert ok[name] > 20, f"{name}: only {ok[name]} successful decodes"
        assert bad[name] > 20, f"{name}: only {bad[name]} rejected inputs"


# ------------------------------------------------------------------------------------ hypothesis

FUZZ = settings(
    max_examples=400, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck)
)


def _assert_clean(data: bytes) -> None:
    for name, decode in DECODERS:
        problem = check_one(name, decode, data)
        assert problem is None, problem


@FUZZ
@given(st.binary(max_size=700))
def test_hypothesis_random_bytes(data: bytes) -> None:
    _assert_clean(data)


@FUZZ
@given(
    st.sampled_from(ALL_SAMPLES),
    st.lists(st.tuples(st.integers(0, 700), st.integers(0, 255)), max_size=6),
    st.integers(0, 800),
    st.binary(max_size=32),
)
def test_hypothesis_mutated_samples(
    sample: bytes, edits: list[tuple[int, int]], cut: int, tail: bytes
) -> None:
    b = bytearray(sample)
    for pos, value in edits:
        if b:
            b[pos % len(b)] = value
    _assert_clean(bytes(b[:cut]) + tail)


_VALID = st.one_of(
    st_clc.clc_messages(),
    st_llc.llc_messages(),
    st_cdc.cdc_messages(),
    st_cdc.smcd_cdc_headers(),
)


@FUZZ
@given(
    _VALID,
    st.lists(st.tuples(st.integers(0, 8191), st.integers(0, 7)), max_size=4),
    st.one_of(st.none(), st.integers(0, 8192)),
    st.binary(max_size=16),
)
def test_hypothesis_generated_messages_mutated(
    msg: Any, flips: list[tuple[int, int]], cut: int | None, tail: bytes
) -> None:
    """Valid messages of every shape the strategies know, then bit flips, a cut and a tail."""
    data = msg.encode()
    assert detect.decode_any(data) == msg
    b = bytearray(data)
    for pos, bit in flips:
        b[pos % len(b)] ^= 1 << bit
    if cut is not None:
        del b[cut:]
    _assert_clean(bytes(b) + tail)


def test_checker_reports_what_it_must() -> None:
    """The oracle itself: a stray IndexError, or a message that cannot re-encode, is reported."""
    assert check_one("bad", lambda d: d[100], b"") is not None
    assert check_one("good", clc.decode, b"") is None  # TruncatedError is a ProtocolError

    class Unencodable:
        def encode(self) -> bytes:
            raise ValueError("cannot")

    assert check_one("enc", lambda d: Unencodable(), b"x") is not None
