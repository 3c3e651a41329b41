"""Hypothesis strategies and sample encodings for CDC messages (SMC-R and the SMC-D header).

Imported by the CDC tests, the fuzz tests and the tshark cross-check.
"""

from __future__ import annotations

from hypothesis import strategies as st

from smcd_daemon.wire.cdc import CdcMessage, ConnStateFlag, ProducerFlag, SmcdCdcHeader
from smcd_daemon.wire.cursor import Cursor

__all__ = ["SAMPLES", "SMCD_SAMPLES", "cdc_messages", "cursors", "smcd_cdc_headers"]


def cursors() -> st.SearchStrategy[Cursor]:
    return st.builds(
        Cursor,
        st.integers(0, 0xFFFF),
        st.one_of(st.integers(0, 1 << 20), st.integers(0, 0xFFFFFFFF)),
    )


def _prod_flags() -> st.SearchStrategy[ProducerFlag]:
    return st.integers(0, 0xFF).map(ProducerFlag)


def _conn_state_flags() -> st.SearchStrategy[ConnStateFlag]:
    return st.integers(0, 0xFF).map(ConnStateFlag)


def cdc_messages() -> st.SearchStrategy[CdcMessage]:
    """Any SMC-R CDC message (flag bytes include undefined bits: they must round-trip)."""
    return st.builds(
        CdcMessage,
        seqno=st.integers(0, 0xFFFF),
        token=st.integers(0, 0xFFFFFFFF),
        prod=cursors(),
        cons=cursors(),
        prod_flags=_prod_flags(),
        conn_state_flags=_conn_state_flags(),
    )


def smcd_cdc_headers() -> st.SearchStrategy[SmcdCdcHeader]:
    return st.builds(
        SmcdCdcHeader,
        prod=cursors(),
        cons=cursors(),
        prod_flags=_prod_flags(),
        conn_state_flags=_conn_state_flags(),
    )


SAMPLES: list[bytes] = [
    # The PROTOCOL.md Appendix B probe: seq 7, token 0x42, prod 1/0x1000, cons 0/0x800.
    CdcMessage(
        7,
        0x42,
        Cursor(1, 0x1000),
        Cursor(0, 0x800),
        ProducerFlag.WRITE_BLOCKED | ProducerFlag.CONS_CURS_UPD_REQ,
        ConnStateFlag.PEER_DONE_WRITING,
    ).encode(),
    CdcMessage(0, 0, Cursor(), Cursor()).encode(),
    CdcMessage(
        0xFFFF,
        0xFFFFFFFF,
        Cursor(0xFFFF, 0xFFFFFFFF),
        Cursor(0xFFFF, 0xFFFFFFFF),
        ProducerFlag(0xF8),
        ConnStateFlag(0xE0),
    ).encode(),
    CdcMessage(
        1,
        2,
        Cursor(3, 4),
        Cursor(5, 6),
        ProducerFlag.FAILOVER_VALIDATION,
        ConnStateFlag.PEER_CONN_ABORT,
    ).encode(),
]

SMCD_SAMPLES: list[bytes] = [
    SmcdCdcHeader(Cursor(1, 0x1000), Cursor(0, 0x800), ProducerFlag.WRITE_BLOCKED).encode(),
    SmcdCdcHeader(
        Cursor(0xFFFF, 0xFFFFFFFF),
        Cursor(0xFFFF, 0xFFFFFFFF),
        ProducerFlag(0xF8),
        ConnStateFlag(0xE0),
    ).encode(),
]
