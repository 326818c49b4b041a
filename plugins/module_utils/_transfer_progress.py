"""Byte progress of the transfers a module run makes (image pulls, artifact downloads), for the agent to show.

A pull or a download runs inside a module: a process the agent does not hold, and under the privilege split one
that root runs. So the module writes what is in flight to one small file, and the agent reads it while the apply
runs and puts it in its observations, its status and its log (docs/SECURITY.md "Pulling engine images"). Issue 26: "byte
progress of a pull (and of an artifact download) goes to the agent's observations, to ``meridian-node status``,
and to the log at a sane rate".

The file (format 1)::

    {"format": 1, "written_at": "<RFC 3339 UTC>",
     "transfers": [{"kind": "image" | "artifact", "name": "<image reference or artifact path>",
                    "bytes_done": 123, "bytes_total": 456 | null,
                    "started_at": "<RFC 3339 UTC>", "updated_at": "<RFC 3339 UTC>"}]}

A transfer is listed from its start to its end (done or failed); the file then stays with what is still in
flight, often nothing. It is replaced at most once each ``MIN_INTERVAL_S`` while bytes move, and at once when a
transfer starts or ends: a pull moving 1 GB/s costs the host one small rename a second, not one per chunk.
``bytes_total`` is null until the whole size is known (an image's layers announce their sizes as each starts).

Written atomically (a temporary file renamed over the name, so a symlink planted at the name is replaced, never
followed), mode 0640, group the directory's: under the split the directory is root's ``public/`` (0750, group the
agent's), in process the agent's own state directory. Before the first write the directory is checked: a real
directory (not a symlink) owned by the writer, writable by no one else. Otherwise nothing is written there and
``TransferReporter.problem`` says why; progress is a courtesy, never a reason to fail a pull.

The reader (``read_transfers``) opens the file without following a symlink, reads at most ``MAX_FILE_BYTES`` and
validates every field; a bad file raises ``TransferFileError`` naming the file and what is wrong.
"""

from __future__ import annotations

import json
import os
import stat
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from typing import Any, Callable, Optional

from ansible_collections.meridian.node.plugins.module_utils._errors import MeridianError
from ansible_collections.meridian.node.plugins.module_utils._fileutil import (
    CappedFileMissingError,
    CappedReadError,
    atomic_write,
    read_capped,
)

__all__ = [
    "KINDS",
    "MAX_FILE_BYTES",
    "MAX_NAME_CHARS",
    "MAX_TRANSFERS",
    "MIN_INTERVAL_S",
    "TRANSFERS_FILE",
    "Transfer",
    "TransferFileError",
    "TransferReporter",
    "read_transfers",
]

TRANSFERS_FILE = "transfers.json"
FORMAT = 1
KINDS = ("image", "artifact")
MIN_INTERVAL_S = 1.0
MAX_TRANSFERS = 32
MAX_NAME_CHARS = 512
# 32 entries of a 512-character name and their numbers fit in well under this.
MAX_FILE_BYTES = 64 * 1024
_MODE = 0o640


class TransferFileError(MeridianError):
    """The transfers file is not what ``TransferReporter`` writes: the message names the file and the problem."""


@dataclass(frozen=True)
class Transfer:
    kind: str
    name: str
    bytes_done: int
    bytes_total: Optional[int]
    started_at: str
    updated_at: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _stamp(value: datetime) -> str:
    return value.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class TransferReporter:
    """What one module run transfers, written to ``path`` for the agent (see the module docstring).

    ``path`` None reports nothing (a module run by hand, without ``progress_file``). ``clock`` paces the writes,
    ``wall`` stamps them; both are injected so tests need not wait.
    """

    def __init__(
        self,
        path: Optional[str],
        *,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], datetime] = lambda: datetime.now(timezone.utc),
    ) -> None:
        self._path = path
        self._clock = clock
        self._wall = wall
        self._live: dict[str, Transfer] = {}
        self._written_at: Optional[float] = None
        self._pending = False  # a change not yet written: the pace held it back
        self._group: Optional[int] = None
        self.problem: Optional[str] = None

    def __contains__(self, name: object) -> bool:
        return name in self._live

    def start(self, kind: str, name: str, total: Optional[int] = None) -> None:
        now = _stamp(self._wall())
        self._live[name] = Transfer(kind, name[:MAX_NAME_CHARS], 0, total, now, now)
        self._write(force=True)

    def advance(self, name: str, done: int, total: Optional[int] = None) -> None:
        """``done`` bytes of ``name`` so far (of ``total`` when known); written when the last write is old enough.

        Call it again with the same figures to have a change the pace held back written once its interval is up."""
        current = self._live.get(name)
        if current is None:
            return
        if current.bytes_done != done or current.bytes_total != total:
            self._live[name] = Transfer(
                current.kind, current.name, done, total, current.started_at, _stamp(self._wall())
            )
            self._pending = True
        if self._pending:
            self._write(force=False)

    def end(self, name: str) -> None:
        if self._live.pop(name, None) is not None:
            self._write(force=True)

    def end_all(self) -> None:
        """The run is over (a failed download included): nothing it started is in flight any more."""
        if self._live:
            self._live.clear()
            self._write(force=True)

    def _write(self, *, force: bool) -> None:
        if self._path is None or self.problem is not None:
            return
        now = self._clock()
        if not force and self._written_at is not None and now - self._written_at < MIN_INTERVAL_S:
            return
        if self._group is None:
            self.problem = _directory_problem(os.path.dirname(os.path.abspath(self._path)))
            if self.problem is not None:
                return
            self._group = os.stat(os.path.dirname(os.path.abspath(self._path))).st_gid
        document = {
            "format": FORMAT,
            "written_at": _stamp(self._wall()),
            "transfers": [transfer.as_dict() for transfer in list(self._live.values())[:MAX_TRANSFERS]],
        }
        try:
            atomic_write(self._path, json.dumps(document, separators=(",", ":")).encode(), _MODE, self._group)
        except OSError as exc:
            self.problem = f"could not write transfer progress to {self._path}: {exc.strerror or exc}"
            return
        self._written_at = now
        self._pending = False


def _directory_problem(directory: str) -> Optional[str]:
    """Why progress must not be written into ``directory`` (not ours, or others may write there), or None."""
    try:
        info = os.lstat(directory)
    except OSError as exc:
        return f"transfer progress not written: cannot use {directory}: {exc.strerror or exc}"
    if not stat.S_ISDIR(info.st_mode):
        return f"transfer progress not written: {directory} is not a directory (symlinks are not followed)"
    if info.st_uid != os.geteuid():
        return f"transfer progress not written: {directory} is owned by uid {info.st_uid}, not this process's"
    if stat.S_IMODE(info.st_mode) & 0o022:
        return (
            f"transfer progress not written: {directory} has mode {stat.S_IMODE(info.st_mode):04o}, so others "
            "could replace the file; chmod go-w it"
        )
    return None


def read_transfers(path: str) -> list[Transfer]:
    """The transfers in flight as ``path`` says; [] when there is no file. ``TransferFileError`` when it is bad."""
    try:
        raw = read_capped(path, MAX_FILE_BYTES, what="transfer progress file")
    except CappedFileMissingError:
        return []
    except CappedReadError as exc:
        raise TransferFileError(str(exc)) from exc
    try:
        document = json.loads(raw)
    except ValueError as exc:
        raise TransferFileError(f"{path} is not JSON ({exc}); it is rewritten at the next transfer") from exc
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        raise TransferFileError(f"{path} is not a format {FORMAT} transfer progress file")
    entries = document.get("transfers")
    if not isinstance(entries, list) or len(entries) > MAX_TRANSFERS:
        raise TransferFileError(f"{path}: 'transfers' must be a list of at most {MAX_TRANSFERS} entries")
    return [_transfer(entry, path, index) for index, entry in enumerate(entries)]


def _transfer(entry: Any, path: str, index: int) -> Transfer:
    where = f"{path}: transfers[{index}]"
    if not isinstance(entry, dict) or set(entry) != {
        "kind",
        "name",
        "bytes_done",
        "bytes_total",
        "started_at",
        "updated_at",
    }:
        raise TransferFileError(f"{where} must be an object with exactly the fields the writer sets")
    kind, name, done, total = entry["kind"], entry["name"], entry["bytes_done"], entry["bytes_total"]
    if kind not in KINDS:
        raise TransferFileError(f"{where}: kind {kind!r} is not one of {', '.join(KINDS)}")
    if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_CHARS:
        raise TransferFileError(f"{where}: name must be a string of 1 to {MAX_NAME_CHARS} characters")
    if not _count(done) or not (total is None or _count(total)):
        raise TransferFileError(f"{where}: bytes_done and bytes_total must be whole numbers from 0 (total may be null)")
    for field in ("started_at", "updated_at"):
        if not _is_stamp(entry[field]):
            raise TransferFileError(f"{where}: {field} must be an RFC 3339 UTC time such as 2026-12-05T10:00:00Z")
    return Transfer(kind, name, done, total, entry["started_at"], entry["updated_at"])


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**63


def _is_stamp(value: Any) -> bool:
    if not isinstance(value, str) or not value.endswith("Z"):
        return False
    try:
        datetime.strptime(value, "%Y-%m-%dT%H:%M:%SZ")
    except ValueError:
        return False
    return True
