"""What the daemon knows about the SMC-D channels it made, kept across its own restarts, so that
RESUME verifies what it is told instead of recording it.

Why: after a restart the library re-registers each live channel (RESUME: its old connection
id, role, buffer sizes, byte counts, and its TCP socket). The new daemon holds no copy of the
channel's DMBs, so without a record of its own it can only believe the claim, and anyone could
add connections with made-up ids, sizes and byte counts, outside the quota. The ledger is that
record: one line per channel half when its CHANNEL reply is sent and one when it hangs up,
appended to a journal in the runtime directory (tmpfs: it outlives the daemon, not the machine,
exactly like the channels). A restarted daemon reads the journal (:meth:`ChannelLedger.load`)
and accepts a RESUME only when it matches a half the previous daemon recorded
(:meth:`ChannelLedger.verify`):

- the same connection id, not yet resumed (once each);
- the same user (SO_PEERCRED), role and buffer sizes (the channel's receive and send DMB);
- the same TCP socket: the inode of the descriptor handed over (a socket's inode is the kernel's
  name for that very socket; a descriptor of it can only come from its holder) and its two
  addresses;
- a TCP connection that is still connected.

Everything else is refused (:class:`Forged`). The byte counts cannot be checked (they moved in
DMBs the new daemon never saw, and keep moving between the two halves' RESUMEs), so they are
shown as the application reports them: a user can only misstate its own connection's
counters, and nothing (quota, limits) depends on them. A resumed half is recorded again under
its new id, so a second restart verifies it the same way, and counts against its user's quota
like any channel half (the adapter charges its receive DMB). Records of the previous daemon that are
never claimed (the application exited while no daemon ran, or it never waits and so never
resumes) are forgotten after ``unclaimed_ttl`` seconds.

Pure: the adapter does the file I/O (``append`` the bytes returned, ``rewrite`` with
:meth:`ChannelLedger.compacted` when :attr:`ChannelLedger.needs_compaction`) and reads the
evidence from the descriptor.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

__all__ = [
    "TCP_CONNECTED_STATES",
    "ChannelLedger",
    "ChannelRecord",
    "Forged",
    "ResumeClaim",
    "ResumeEvidence",
    "parse_journal",
]

TCP_CONNECTED_STATES = frozenset({1, 4, 5, 6, 8, 9, 11})
"""``tcpi_state`` values of a socket that carried a connection and has not been closed by its
holder: ESTABLISHED, FIN_WAIT1/2, TIME_WAIT, CLOSE_WAIT, LAST_ACK, CLOSING (a channel outlives
the TCP connection's own closing handshake). Not SYN_*, CLOSE or LISTEN."""

_ROLES = ("client", "server")


@dataclass(frozen=True)
class ChannelRecord:
    """One channel half as the daemon that made it saw it."""

    conn_id: int
    uid: int
    role: str  # "client" | "server"
    rx_size: int
    tx_size: int
    inode: int  # of the TCP socket handed over
    local: str  # "address port" as the daemon read it from the socket
    peer: str

    def line(self) -> bytes:
        return (
            f"+ {self.conn_id} {self.uid} {self.role} {self.rx_size} {self.tx_size} "
            f"{self.inode} {self.local.replace(' ', '/')} {self.peer.replace(' ', '/')}\n"
        ).encode()


@dataclass(frozen=True)
class ResumeClaim:
    """What a RESUME says (from the message)."""

    conn_id: int
    role: str
    smcd: bool  # mode SMC-D (only SMC-D channels outlive the daemon)
    rx_size: int
    tx_size: int


@dataclass(frozen=True)
class ResumeEvidence:
    """What the daemon reads itself: SO_PEERCRED and the TCP descriptor that came with it."""

    uid: int
    inode: int
    tcp_state: int
    local: str
    peer: str


class Forged(enum.Enum):
    """Why a RESUME is refused (the value is the ERROR's text)."""

    NOT_SMCD = "only SMC-D channels outlive the daemon"
    UNKNOWN = "no channel with this id was made by the previous daemon"
    RESUMED = "this channel was already resumed"
    USER = "the channel belongs to another user"
    SOCKET = "the TCP socket is not the one this channel was made on"
    ROLE = "the role differs from the channel's"
    SIZES = "the buffer sizes differ from the channel's"
    NOT_CONNECTED = "the TCP socket is not connected"


def parse_journal(data: bytes) -> tuple[dict[int, ChannelRecord], int]:
    """The live records a journal leaves (adds minus drops), and how many lines were unreadable
    (a torn last line after a crash, or damage): those are skipped, never guessed at."""
    live: dict[int, ChannelRecord] = {}
    lines = data.split(b"\n")
    bad = 1 if lines.pop() else 0  # what follows the last newline is a torn line
    for raw in lines:
        if not raw:
            continue
        try:
            parts = raw.decode("ascii").split(" ")
            if parts[0] == "-" and len(parts) == 2:
                live.pop(int(parts[1]), None)
                continue
            if parts[0] != "+" or len(parts) != 9 or parts[3] not in _ROLES:
                raise ValueError(raw)
            conn_id, uid, rx, tx, inode = (int(parts[i]) for i in (1, 2, 4, 5, 6))
            live[conn_id] = ChannelRecord(
                conn_id, uid, parts[3], rx, tx, inode,
                parts[7].replace("/", " "), parts[8].replace("/", " "),
            )  # fmt: skip
        except (UnicodeDecodeError, ValueError, IndexError):
            bad += 1
    return live, bad


class ChannelLedger:
    """This daemon's channel halves (:meth:`add`/:meth:`drop`) and the previous daemon's that
    may still be resumed (:meth:`load`, :meth:`verify`). See the module docstring."""

    def __init__(self, *, unclaimed_ttl: float = 600.0) -> None:
        self.unclaimed_ttl = unclaimed_ttl
        self.live: dict[int, ChannelRecord] = {}
        self._inodes: dict[int, int] = {}  # TCP socket inode → conn_id, of the live records
        self._previous: dict[int, ChannelRecord] = {}
        self._loaded_at = 0.0
        self._claimed: set[int] = set()
        self._lines = 0  # journal lines since the last compaction

    # -- this daemon's records ------------------------------------------------------------

    def load(self, data: bytes, now: float) -> int:
        """The previous daemon's journal; returns the number of unreadable lines."""
        live, bad = parse_journal(data)
        self._previous = live
        self._loaded_at = now
        self._claimed.clear()
        return bad

    def add(self, record: ChannelRecord, *, replaces: int | None = None) -> bytes:
        """A channel half was handed out, or resumed (``replaces``: its id under the previous
        daemon, dropped in the same write so that no later restart sees it twice): the journal
        lines to append."""
        self.live[record.conn_id] = record
        self._inodes[record.inode] = record.conn_id
        self._lines += 1
        if replaces is None:
            return record.line()
        self._lines += 1
        return f"- {replaces}\n".encode() + record.line()

    def drop(self, conn_id: int) -> bytes | None:
        """A half hung up: the line to append, or None if it was not recorded."""
        rec = self.live.pop(conn_id, None)
        if rec is None:
            return None
        if self._inodes.get(rec.inode) == conn_id:
            del self._inodes[rec.inode]
        self._lines += 1
        return f"- {conn_id}\n".encode()

    @property
    def needs_compaction(self) -> bool:
        """Time to rewrite the journal: it holds many more lines than live records."""
        lines = self._lines  # below 4096 (the usual case, asked at every write): no counting
        return lines > 4096 and lines > 2 * (len(self.live) + len(self._previous)) + 4096

    def compacted(self, now: float) -> bytes:
        """The whole journal, rewritten: this daemon's live records and the previous daemon's
        still claimable ones (so that a second restart keeps them)."""
        self.expire(now)
        records = [*self.live.values(), *self._previous.values()]
        self._lines = len(records)
        return b"".join(r.line() for r in records)

    def expire(self, now: float) -> int:
        """Forget the previous daemon's records nobody claimed in time; returns how many."""
        if not self._previous or now - self._loaded_at < self.unclaimed_ttl:
            return 0
        n = len(self._previous)
        self._previous.clear()
        return n

    @property
    def claimable(self) -> int:
        return len(self._previous)

    # -- RESUME -----------------------------------------------------------------------------

    def verify(
        self, claim: ResumeClaim, seen: ResumeEvidence, new_id: int
    ) -> ChannelRecord | Forged:
        """Check a RESUME against the previous daemon's record. Accepted: the record under
        ``new_id`` (not yet added: :meth:`add` it once the reply is sent), and the claim is
        used up; refused: why. Nothing changes on a refusal."""
        if not claim.smcd:
            return Forged.NOT_SMCD
        if claim.conn_id in self._claimed or seen.inode in self._inodes:
            return Forged.RESUMED
        old = self._previous.get(claim.conn_id)
        if old is None:
            return Forged.UNKNOWN
        if old.uid != seen.uid:
            return Forged.USER
        if old.inode != seen.inode or (old.local, old.peer) != (seen.local, seen.peer):
            return Forged.SOCKET
        if old.role != claim.role:
            return Forged.ROLE
        if (old.rx_size, old.tx_size) != (claim.rx_size, claim.tx_size):
            return Forged.SIZES
        if seen.tcp_state not in TCP_CONNECTED_STATES:
            return Forged.NOT_CONNECTED
        del self._previous[claim.conn_id]
        self._claimed.add(claim.conn_id)
        return replace(old, conn_id=new_id)
