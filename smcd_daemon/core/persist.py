"""Durable state of the daemon (PNET table, UEIDs) in one JSON file in the state dir.

Why the care: the file is configuration an operator typed in; after a crash or power loss it must
hold either the old table or the new one, never half of each, and a file that is damaged anyway
(disk error, a hand edit) must not silently turn into an empty table. So:

- :meth:`StateStore.save` writes a temp file in the same directory (same filesystem, so the
  rename is atomic), fsyncs it, renames it over the old file and fsyncs the directory so the
  rename itself survives a power cut. The file is mode 0600: it is root's configuration.
- :meth:`StateStore.load` treats anything it cannot parse (or that ``validate`` rejects) as
  corrupt: it renames the file to ``<name>.corrupt-<UTC timestamp>`` (kept for the operator),
  logs a warning, returns it in :class:`LoadResult` and starts from an empty state. Temp files
  left by a save that was killed are removed.

One daemon owns a state file; there is no cross-process locking.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from smcd_daemon.core.eid import EidTable
from smcd_daemon.core.pnet import PnetTable
from smcd_daemon.errors import SmcError

STATE_FILE_NAME = "state.json"
"""File name the daemon uses inside its state dir."""
STATE_FORMAT = 1

_log = logging.getLogger("smcd.persist")


class PersistError(SmcError):
    """The state file could not be read or written (permissions, disk full, not a file...)."""

    def __init__(self, message: str, *, path: Path) -> None:
        super().__init__(message)
        self.path = path


@dataclass(frozen=True)
class LoadResult:
    """What :meth:`StateStore.load_result` found: the data, and if the file was corrupt, why and
    where it was moved."""

    data: dict[str, Any]
    warning: str | None = None
    moved_to: Path | None = None


class StateStore:
    """One JSON object in one file, replaced atomically on every save."""

    def __init__(self, path: Path | str, *, mode: int = 0o600) -> None:
        self.path = Path(path)
        self.mode = mode
        self.last_warning: str | None = None

    # -- reading ---------------------------------------------------------------------------------

    def load(self, validate: Callable[[dict[str, Any]], object] | None = None) -> dict[str, Any]:
        """The stored object, or ``{}`` if there is no file or it was corrupt (then
        :attr:`last_warning` says so and the file was moved aside)."""
        return self.load_result(validate).data

    def load_result(self, validate: Callable[[dict[str, Any]], object] | None = None) -> LoadResult:
        """Read the file. ``validate`` may raise (SmcError, ValueError, TypeError, KeyError) to
        declare content that parses but makes no sense; it is then handled as corrupt."""
        self.last_warning = None
        self._remove_stale_temps()
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return LoadResult({})
        except OSError as exc:
            raise PersistError(
                f"State file {self.path} cannot be read: {exc.strerror or exc}.", path=self.path
            ) from exc

        problem: str | None = None
        data: Any = None
        try:
            data = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as exc:
            problem = f"it is not UTF-8 text ({exc.reason} at byte {exc.start})"
        except json.JSONDecodeError as exc:
            problem = f"it is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})"
        if problem is None and not isinstance(data, dict):
            problem = f"it holds a JSON {type(data).__name__}, not an object"
        if problem is None and validate is not None:
            try:
                validate(data)
            except (SmcError, ValueError, TypeError, KeyError) as exc:
                problem = f"its content is invalid ({exc})"
        if problem is None:
            return LoadResult(data)

        moved = self._move_aside()
        warning = (
            f"State file {self.path} is corrupt: {problem}; it was moved to {moved} and smcd "
            "starts with an empty state."
        )
        _log.warning("%s", warning)
        self.last_warning = warning
        return LoadResult({}, warning, moved)

    def _move_aside(self) -> Path:
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S.%fZ")
        target = self.path.with_name(f"{self.path.name}.corrupt-{stamp}")
        n = 0
        while target.exists():
            n += 1
            target = self.path.with_name(f"{self.path.name}.corrupt-{stamp}-{n}")
        try:
            os.rename(self.path, target)
            self._fsync_dir()
        except OSError as exc:
            raise PersistError(
                f"Corrupt state file {self.path} cannot be moved aside to {target}: "
                f"{exc.strerror or exc}.",
                path=self.path,
            ) from exc
        return target

    def _temp_prefix(self) -> str:
        return f".{self.path.name}."

    def _remove_stale_temps(self) -> None:
        """Temp files are only ever left by a save that died before its rename; the real file
        is intact (old content), so they carry nothing worth keeping."""
        parent = self.path.parent
        if not parent.is_dir():
            return
        for p in parent.glob(f"{self._temp_prefix()}*.tmp"):
            try:
                p.unlink()
                _log.info("removed %s, left by an interrupted save", p)
            except FileNotFoundError:
                pass
            except OSError as exc:
                _log.warning("cannot remove %s left by an interrupted save: %s", p, exc)

    # -- writing ---------------------------------------------------------------------------------

    def save(self, data: Mapping[str, Any]) -> None:
        """Replace the file's content with ``data`` atomically and durably."""
        # Serialise first: a value JSON cannot hold must fail before anything on disk changes.
        payload = (
            json.dumps(dict(data), indent=2, sort_keys=True, ensure_ascii=False, allow_nan=False)
            + "\n"
        ).encode("utf-8")
        parent = self.path.parent
        tmp: str | None = None
        try:
            parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=self._temp_prefix(), suffix=".tmp", dir=parent)
            try:
                os.fchmod(fd, self.mode)
                view = memoryview(payload)
                while view:
                    written = os.write(fd, view)
                    view = view[written:]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, self.path)
            tmp = None
            self._fsync_dir()
        except OSError as exc:
            raise PersistError(
                f"State file {self.path} cannot be written: {exc.strerror or exc}.",
                path=self.path,
            ) from exc
        finally:
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)

    def _fsync_dir(self) -> None:
        dfd = os.open(self.path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


# -- the daemon's control state -------------------------------------------------------------------


@dataclass
class ControlState:
    """The PNET and EID tables as restored at start-up, plus any corruption report."""

    pnet: PnetTable = field(default_factory=PnetTable)
    eids: EidTable = field(default_factory=EidTable)
    warning: str | None = None
    moved_to: Path | None = None


def control_state_dict(pnet: PnetTable, eids: EidTable) -> dict[str, Any]:
    """The object the daemon stores: ``{"format": 1, "pnet": ..., "eid": ...}``."""
    return {"format": STATE_FORMAT, "pnet": pnet.to_dict(), "eid": eids.to_dict()}


def _parse_control_state(data: Mapping[str, Any], seid: str | None) -> tuple[PnetTable, EidTable]:
    fmt = data.get("format", STATE_FORMAT)
    if fmt != STATE_FORMAT:
        raise ValueError(f"state format {fmt!r} is unknown, this smcd reads {STATE_FORMAT}")
    pnet = PnetTable.from_dict(data.get("pnet", {}))
    eids = EidTable.from_dict(data.get("eid", {}), seid=seid)
    return pnet, eids


def load_control_state(store: StateStore, *, seid: str | None = None) -> ControlState:
    """Restore both tables. A file that parses but breaks a table rule is corrupt like any
    other: moved aside, reported, and both tables start empty (never half a configuration)."""
    result = store.load_result(lambda d: _parse_control_state(d, seid))
    if not result.data:
        return ControlState(
            PnetTable(), EidTable(seid=seid), warning=result.warning, moved_to=result.moved_to
        )
    pnet, eids = _parse_control_state(result.data, seid)
    return ControlState(pnet, eids)


def save_control_state(store: StateStore, pnet: PnetTable, eids: EidTable) -> None:
    store.save(control_state_dict(pnet, eids))
