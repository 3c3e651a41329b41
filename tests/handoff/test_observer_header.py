"""The observer's one-header read (``DmbView.cursors``, a half's last counters) gives exactly
what the periodic refresh reads of the same header (``read_header`` of ``DmbView.words``)."""

from __future__ import annotations

import os

from smc_handoff import layout
from smcd_daemon.adapters.handoff.observer import DmbView, read_header


def test_cursors_match_read_header() -> None:
    fd = os.memfd_create("hdr")
    try:
        os.ftruncate(fd, os.sysconf("SC_PAGE_SIZE"))
        view = DmbView(fd)
        try:
            assert view.cursors() is None and read_header(view.words()) is None  # unwritten
            for prod, cons, csflags in (
                ((0, 0), (0, 0), 0),
                ((1, 7), (0, 65504), 0),
                ((0xFFFF, 0xFFFFFFFF), (0xFFFF, 0xFFFFFFFF), 0xFF),
                ((3, 12345), (2, 99), 0x40),
            ):
                os.pwrite(fd, layout.encode_header(prod, cons, 0x5A, csflags), 0)
                hdr = read_header(view.words())
                assert hdr is not None
                assert view.cursors() == (hdr[0], hdr[1]) == (prod, cons)
        finally:
            view.close()
    finally:
        os.close(fd)
