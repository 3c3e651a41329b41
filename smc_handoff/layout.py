"""The shared channel layout: one SMC-D DMB (or SMC-R RMB/send buffer) as smcd and the
application both map it, and the few memory-ordering tools the channel needs. The one definition
of this layout: the daemon's buffer pools and SMC-R relay import it, and so does the channel
(standard library only, so the client library stays free of the daemon).

A DMB is a memfd of ``size`` bytes (the SMC-D compressed sizes, 16 KiB << n, n = 0..6) followed
by a small control trailer that is not part of the DMB proper::

    0            32                                   size          size + CTRL_LEN
    | CDC header | ring (size - 32 bytes of data)      | ctrl trailer |

An SMC-R RMB (and send buffer) uses the same channel view with a ring of exactly the kernel's
RMBE size: the memfd holds ``32 + rmbe`` bytes plus the trailer, the header stays in front, and
only the ring (``32 .. 32 + rmbe``) is registered and advertised to the peer, because a kernel
peer writes at offsets 0 .. rmbe - 1 of the RMBE it was given. The channel's ``size`` for such a
buffer is ``rmbe + 32`` (:data:`SMCR_CHANNEL_SIZES`); the ring is always ``size - 32``::

    0            32                                   32 + rmbe     32 + rmbe + CTRL_LEN
    | CDC header | ring (rmbe bytes: the RMBE proper)  | ctrl trailer |

* **CDC header** (PROTOCOL.md §1.8, ``struct smcd_cdc_msg``, host byte order): written only by the
  *peer* (the sender into this ring), read by the owner (the receiver). Same bytes as
  ``smcd_daemon.wire.cdc.SmcdCdcHeader`` (a test checks it byte for byte).
* **ctrl trailer** (smcd's own, outside the 32-byte header so the header stays the kernel's):
  one "kick me" request per direction, written only by the owner: ``WAIT`` (u64 at +0) for data,
  EOF or abort in this ring, ``WAIT_SPACE`` (u64 at +8) for room in the peer's ring, each
  ``generation << 8 | want bits``; and, on their own cache line, the last generation the peer
  kicked for each, written only by the peer: ``KICK`` (u64 at +64) and ``KICK_SPACE`` (+72).
  Each word therefore has exactly one writer, and a reader thread and a writer thread of the
  same end never share a wakeup.

Why cursor reads cannot tear
----------------------------
The producer cursor (wrap u16 @8, count u32 @10, two unused flag bytes @14) fills exactly the
aligned 8-byte word at offset 8; the consumer cursor plus both flag bytes (@16..23) fill exactly
the aligned word at offset 16. smcd never writes these words piecewise: it computes the whole
64-bit value and stores it through a ``memoryview`` cast to ``'Q'`` (CPython's ``pack_single``
/``unpack_single`` copy a fixed ``sizeof(unsigned long long)`` with ``memcpy``, which compilers
emit as one 8-byte ``mov``). An aligned 8-byte load or store is single-copy atomic on x86-64
(Intel SDM vol. 3 §9.1.1), s390x and aarch64, so a reader sees either the old or the new word,
never a mix. ``struct.pack_into`` must *not* be used on a live header: CPython zero-fills the
target first (``s_pack_internal`` memsets it) and the ``=`` formats store byte by byte, so a
concurrent reader could see a zero or half-written cursor. tests/handoff/test_channel_atomic.py
hammers a word across processes with values whose halves differ to check this on the machine.

Why the data is complete when the cursor says so
------------------------------------------------
The sender copies the bytes into the ring, then stores the cursor word; the receiver loads the
cursor word, then copies the bytes out. x86-64 (and s390x) keep stores in program order and
loads in program order (TSO), so a receiver that sees the new cursor sees the bytes before it; a
sender that sees the receiver's new consumer cursor knows the receiver's loads of those bytes
are done (loads are not reordered after later stores). glibc's non-temporal ``memcpy`` path for
huge copies ends with ``sfence``. Weakly ordered CPUs (aarch64, ppc64le, riscv) would need
barriers that pure Python cannot issue cheaply, so :data:`ORDERING_OK` is False there and the
channel refuses to start (the caller falls back to TCP).

The wakeup race (Dekker) and why both sides fence
-------------------------------------------------
A sleeper does ``store WAIT; load cursor`` and a publisher ``store cursor; load WAIT``. TSO lets
each load pass the store before it (store buffer), so both could miss the other: the sleeper
sleeps on data the publisher never announced. Both sides close it with a full barrier between
their store and their load (:func:`fence`: a lock-prefixed atomic, a lock's acquire, ~0.1 us,
no system call): the sleeper after it publishes WAIT, the publisher after every
cursor or flags store that it follows with a look for a request. The window is not only
nanoseconds: the publisher's cursor word sits on a line the peer keeps reading, so its store
waits for the line (a cross-core miss, ~100 ns) while the interpreter runs on and loads WAIT
from a line it still holds. A blocking sleeper would catch such a loss at its first nap
(``SAFETY_NET_S``, 1 ms, counted as ``missed_wakeups`` in the channel's stats; it stays as a
net), but an event loop's transport sleeps in ``epoll`` with no timer: with a barrier-free
publisher it once waited 10 s for a request that was in its ring (until the peer hung up).
``membarrier(MEMBARRIER_CMD_GLOBAL_EXPEDITED)`` would spare the publisher its barrier, but it
IPIs the peer's CPU on every sleep, which is slow on an overcommitted VM and made latency worse,
so it is not used.
"""

from __future__ import annotations

import mmap
import os
import sys
from _thread import allocate_lock as _new_lock

__all__ = [
    "CDC_HEADER_LEN",
    "CDC_MSG_TYPE",
    "CHANNEL_SIZES",
    "COUNT_SHIFT",
    "CSFLAGS_SHIFT",
    "CTRL_LEN",
    "C_KICK",
    "C_KICK_SPACE",
    "C_LEAVE",
    "C_OWNER",
    "C_WAIT",
    "C_WAIT_SPACE",
    "DMB_SIZES",
    "ORDERING_OK",
    "PFLAGS_SHIFT",
    "SAFETY_NET_S",
    "SMCD_DMBE_SIZES",
    "SMCR_CHANNEL_SIZES",
    "SMC_BUF_MIN",
    "TYPE_WORD",
    "WRAP_SHIFT",
    "W_CONS",
    "W_PROD",
    "W_TYPE",
    "check_channel_size",
    "check_dmb_size",
    "cons_word",
    "create_dmb",
    "decode_header",
    "encode_header",
    "fence",
    "fence_end",
    "fence_try",
    "map_dmb",
    "prod_word",
    "smcr_channel_size",
    "split_word",
    "zero_dmb",
]

CDC_MSG_TYPE = 0xFE
CDC_HEADER_LEN = 32
#: Control trailer after the DMB: WAIT words at +0/+8, KICK words at +64/+72 (two cache lines).
CTRL_LEN = 128
#: Smallest buffer, size class 0 (the kernel's ``SMC_BUF_MIN``).
SMC_BUF_MIN = 16384
#: Largest SMC-D size class (the kernel's ``SMCD_DMBE_SIZES``): 16 KiB << 6 = 1 MiB.
SMCD_DMBE_SIZES = 6
#: The channel sizes, SMC-D's compressed DMB sizes (``smc_compress_bufsize``: 16 KiB << n).
DMB_SIZES = tuple(SMC_BUF_MIN << n for n in range(SMCD_DMBE_SIZES + 1))
#: Channel sizes of SMC-R buffers: the header in front of a ring of exactly an RMBE size.
SMCR_CHANNEL_SIZES = tuple(size + CDC_HEADER_LEN for size in DMB_SIZES)
#: Every size a channel maps (SMC-D DMBs and SMC-R buffers).
CHANNEL_SIZES = DMB_SIZES + SMCR_CHANNEL_SIZES

# Word indexes in the header viewed as 4 x u64, and in the trailer viewed as 16 x u64.
W_TYPE, W_PROD, W_CONS = 0, 1, 2
C_WAIT, C_WAIT_SPACE, C_KICK, C_KICK_SPACE = 0, 1, 8, 9
#: Trailer word of an end's own receive DMB, written only by the processes holding that end:
#: which of them may use it after a fork (``smc_handoff.channel_base``, "fork").
C_OWNER = 2
#: Trailer word of an end's own receive DMB, written by that end: where it is in leaving the
#: channel for TCP together with the peer after data moved (``Channel.leave_together``).
C_LEAVE = 3

# Bit positions of the fields inside the two cursor words, for this host's byte order. The
# count (bytes 2..5 of the word) lands on bits 16..47 in both byte orders.
if sys.byteorder == "little":
    WRAP_SHIFT, COUNT_SHIFT, PFLAGS_SHIFT, CSFLAGS_SHIFT = 0, 16, 48, 56
    TYPE_WORD = CDC_MSG_TYPE
else:  # big-endian (s390x): byte 0 is the most significant
    WRAP_SHIFT, COUNT_SHIFT, PFLAGS_SHIFT, CSFLAGS_SHIFT = 48, 16, 8, 0
    TYPE_WORD = CDC_MSG_TYPE << 56

_TSO_MACHINES = {"x86_64", "amd64", "i386", "i486", "i586", "i686", "s390x"}
#: True where plain stores/loads give the ordering the ring relies on (see module docstring).
ORDERING_OK = os.uname().machine.lower() in _TSO_MACHINES  # (platform.machine(), unimported)

#: The sleeper's first nap after publishing WAIT: a net under the Dekker race, which both sides
#: fence (see above); it counts what it catches (``missed_wakeups``).
SAFETY_NET_S = 0.001


_fence_lock = _new_lock()
fence_try = _fence_lock.acquire
"""``fence_try(False)`` then, when it returned True, ``fence_end()``: :func:`fence` inline, for
the data paths (a Python call is a third of a fence's cost); when it returned False, call
:func:`fence`."""
fence_end = _fence_lock.release


def fence() -> None:
    """Full barrier on this CPU: acquiring a lock is a lock-prefixed atomic read-modify-write
    (x86: ``lock cmpxchg`` in ``sem_trywait``), which orders earlier stores before later loads.

    Never a blocking acquire: the interpreter runs signal handlers right after a C call
    returns, so Ctrl-C (``KeyboardInterrupt``) lands between a lock's acquire and its release
    about half the time a fence is interrupted, and leaves it held. The shared lock is only
    tried (a success is the barrier); held (that, another thread's fence, a thread of the
    parent at a fork), a fresh lock is acquired instead, the same barrier at twice the cost.
    A blocking acquire of the held lock deadlocked the program's next fence (a ``close()`` in
    a ``finally``)."""
    if fence_try(False):
        fence_end()
    else:
        _new_lock().acquire()


def check_dmb_size(size: int) -> None:
    if size not in DMB_SIZES:
        raise ValueError(f"DMB size {size} is not an SMC-D size (16 KiB << n, n = 0..6)")


def check_channel_size(size: int) -> None:
    if size not in CHANNEL_SIZES:
        raise ValueError(
            f"channel size {size} is neither an SMC-D DMB size (16 KiB << n, n = 0..6) nor an "
            "SMC-R buffer's (that + 32)"
        )


def smcr_channel_size(rmbe_size: int) -> int:
    """The channel size of an SMC-R buffer whose ring (the advertised RMBE) is ``rmbe_size``."""
    check_dmb_size(rmbe_size)
    return rmbe_size + CDC_HEADER_LEN


def create_dmb(size: int, name: str = "smc-dmb") -> int:
    """Create a zeroed DMB memfd of ``size`` bytes plus the control trailer; returns the fd
    (close-on-exec; hand it on with SCM_RIGHTS or ``pass_fds``)."""
    check_dmb_size(size)
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size + CTRL_LEN)
    except BaseException:
        os.close(fd)
        raise
    return fd


def zero_dmb(fd: int, size: int) -> None:
    """Zero a DMB before it is handed to another user: truncating drops every page, so the
    next user reads zeros (and the memory is given back until it is touched again)."""
    check_dmb_size(size)
    os.ftruncate(fd, 0)
    os.ftruncate(fd, size + CTRL_LEN)


def map_dmb(fd: int, size: int) -> mmap.mmap:
    """Map a DMB (header, ring and trailer) shared and read-write.

    Pages are faulted in on first touch, not populated up front (``MAP_POPULATE``): the pool
    hands DMBs out as holes, so populating allocates and zeroes every page of the ring at
    connect time (and each connection maps four), while a short connection touches two or
    three pages. A transfer that fills the ring pays the same faults once, spread over its
    first pass, so it is no slower in all than populating. ``size`` is a channel size (an
    SMC-R buffer's is its RMBE size + 32)."""
    check_channel_size(size)
    return mmap.mmap(fd, size + CTRL_LEN, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)


def prod_word(wrap: int, count: int) -> int:
    return (wrap & 0xFFFF) << WRAP_SHIFT | count << COUNT_SHIFT


def cons_word(wrap: int, count: int, pflags: int, csflags: int) -> int:
    return (
        (wrap & 0xFFFF) << WRAP_SHIFT
        | count << COUNT_SHIFT
        | pflags << PFLAGS_SHIFT
        | csflags << CSFLAGS_SHIFT
    )


def split_word(word: int) -> tuple[int, int, int, int]:
    """(wrap, count, producer flags, connection state flags) of a cursor word."""
    return (
        word >> WRAP_SHIFT & 0xFFFF,
        word >> COUNT_SHIFT & 0xFFFFFFFF,
        word >> PFLAGS_SHIFT & 0xFF,
        word >> CSFLAGS_SHIFT & 0xFF,
    )


def encode_header(
    prod: tuple[int, int], cons: tuple[int, int], pflags: int = 0, csflags: int = 0
) -> bytes:
    """The 32 header bytes exactly as the channel writes them (for tests and tools)."""
    words = (TYPE_WORD, prod_word(*prod), cons_word(*cons, pflags, csflags), 0)
    return b"".join(w.to_bytes(8, sys.byteorder) for w in words)


def decode_header(buf: bytes | bytearray | memoryview | mmap.mmap) -> dict[str, int]:
    """Read the header fields out of 32 bytes (a snapshot; for tools, not the data path)."""
    words = memoryview(bytes(buf[:CDC_HEADER_LEN])).cast("Q")
    pw, pc, _, _ = split_word(words[W_PROD])
    cw, cc, pf, csf = split_word(words[W_CONS])
    return {
        "type": bytes(buf[:1])[0],
        "prod_wrap": pw,
        "prod_count": pc,
        "cons_wrap": cw,
        "cons_count": cc,
        "prod_flags": pf,
        "conn_state_flags": csf,
    }
