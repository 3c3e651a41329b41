"""Cursor words cannot tear: a second process hammers one 8-byte word of a shared memfd with
values whose bytes are all equal (0x0101.., 0x0202.., ...) the way the channel stores its cursor
words (a memoryview cast to 'Q'); we read it back the way the channel does and never see a mix.

The negative control stores with ``struct.pack_into(">Q")`` — which CPython implements as a
memset of the target followed by byte-wise stores — and must be caught tearing; that proves the
test can see a torn word at all on this machine.
"""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.timeout(60)

WRITER = r"""
import mmap, os, struct, sys, time
fd, how = int(sys.argv[1]), sys.argv[2]
mm = mmap.mmap(fd, 4096)
words = memoryview(mm).cast("Q")
pack = struct.Struct(">Q").pack_into  # byte-swapped: stored byte by byte
values = [0x0101010101010101 * (i % 255 + 1) for i in range(255)]
end = time.monotonic() + float(sys.argv[3])
while time.monotonic() < end:
    if how == "word":
        for v in values:
            words[1] = v
    else:
        for v in values:
            pack(mm, 8, v)
"""


def hammer(how: str, min_reads: int, seconds: float = 30.0) -> tuple[int, int]:
    """(reads, torn reads): reads of word 1 while another process stores into it, until
    ``min_reads`` reads were made (a count, not a duration: a loaded machine only makes the
    test slower), or the writer's ``seconds`` ran out."""
    fd = os.memfd_create("atomic-test")
    os.ftruncate(fd, 4096)
    mm = mmap.mmap(fd, 4096)
    words = memoryview(mm).cast("Q")
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(fd), how, str(seconds)], pass_fds=[fd]
    )
    reads = torn = 0
    try:
        deadline = time.monotonic() + 10
        while words[1] == 0 and time.monotonic() < deadline:
            pass
        while reads < min_reads and proc.poll() is None:
            for _ in range(10_000):
                v = words[1]
                if v % 0x0101010101010101 or not v:  # not eight equal non-zero bytes
                    torn += 1
            reads += 10_000
    finally:
        proc.kill()
        proc.wait()
        words.release()
        mm.close()
        os.close(fd)
    return reads, torn


def test_cursor_words_never_tear_across_processes() -> None:
    reads, torn = hammer("word", 2_000_000)
    assert reads >= 2_000_000
    assert torn == 0


def test_struct_pack_into_would_tear() -> None:
    """The control: piecewise stores are seen half-done by a concurrent reader."""
    reads, torn = hammer("struct", 2_000_000)
    assert reads >= 2_000_000
    assert torn > 0, "the stress test could not see a torn word at all"
