"""``<dir>/logs/<engine>.json``: the kept tail of one engine's log, scrubbed, for people without Docker access.

Runs on: both sides: root's observe unit (under the split, in ``<apply.state_dir>/public/logs``) and the
in-process agent (in ``<state_dir>/logs``) write it (``write_log_tail``, through ``collectors.engine_log_keeper``);
``meridian-node logs`` and the agent's observer read it (``read_log_tail``).

The file (format 1)::

    {"format": 1, "engine": "chat", "written_at": "<RFC 3339 UTC>",
     "current": {"container_id": "<12 hex>", "restarts": 3, "state": "restarting",
                 "exit_reason": "exit 3" | null, "read_at": "<RFC 3339 UTC>", "lines": ["...", ...]},
     "previous": {... the same ...} | null}

``current`` is the container Docker runs under that engine's name now: its last ``TAIL_LINES`` lines, stdout and
stderr as written. Docker keeps a container's log across its restarts, so a crash-looping container's earlier
runs are in ``current`` already; ``previous`` is the last container of that name that printed something, kept when
the engine is recreated (a repair, a replace, an operator's ``docker rm``), so that its last words survive a
new container that has printed nothing yet. Each line is at most ``MAX_LINE_CHARS`` characters (the rest is cut,
and the line says how much), the file at most ``MAX_LOG_FILE_BYTES`` (the oldest lines go first). Every line was
scrubbed of the container's environment before it was written (``docker.log_scrub``).

A line is kept as printed, escape sequences included (``meridian-node logs`` escapes them where it shows them),
and a byte that was not UTF-8 as the lone surrogate ``surrogateescape`` makes of it (JSON's ``\\udcff`` for 0xff),
so that ``logs --raw`` gives back the bytes Docker gave (its default ``json-file`` driver has already made such a
byte U+FFFD; its ``local`` driver keeps it). ``EngineLogTail.lines``, what observations carry, has U+FFFD there.

Written atomically (a temporary file in ``logs/``, renamed over the name: a symlink planted at the name is
replaced, never followed), mode 0640, group the agent's: the agent's group reads it, only the writer writes it.
The ``logs/`` directory (0750, same group) is checked before each write: a real directory, the writer's, writable
by no one else, and the path it resolves to is the path named; otherwise nothing is written there.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ansible_collections.meridian.node.plugins.module_utils._errors import MeridianError
from ansible_collections.meridian.node.plugins.module_utils._fileutil import (
    atomic_write,
    file_kind,
    read_if_present,
)
from ansible_collections.meridian.node.plugins.module_utils.contracts import OBSERVED_LOG_LINE_CHARS
from ansible_collections.meridian.node.plugins.module_utils.engine_rules import NAME_FORM, NAME_PATTERN
from meridian_node_agent.boundary.documents import json_object

__all__ = [
    "LOGS_DIR",
    "LOGS_DIR_MODE",
    "LOG_FILE_MODE",
    "MAX_LINE_CHARS",
    "MAX_LOG_FILE_BYTES",
    "TAIL_LINES",
    "EngineLogError",
    "EngineLogMissingError",
    "EngineLogTail",
    "KeptRun",
    "cap_line",
    "check_logs_dir",
    "log_path",
    "parse_log_tail",
    "read_log_tail",
    "write_log_tail",
]

LOGS_DIR = "logs"
LOGS_DIR_MODE = 0o750
LOG_FILE_MODE = 0o640
FORMAT = 1
# Constants, not config: an operator wanting more has `docker logs` as root; these are what an agent's group
# and an observation can carry without a host's disk or the control plane noticing.
TAIL_LINES = 100  # per container, as Docker's ``tail`` counts them
MAX_LINE_CHARS = 500  # a line cut here fits the observation's own bound with its note
MAX_LOG_FILE_BYTES = 128 * 1024  # 2 x 100 lines x 500 characters fits with room for JSON escapes, mostly
_CUT = " [... {} more characters]"
# What every refusal of a kept log ends with: root's observe unit replaces the file on its next run.
_REWRITTEN = "; the next observe run rewrites it"
_NAME = re.compile(NAME_PATTERN)
_CONTAINER_ID = re.compile(r"[0-9a-f]{12}")
_SURROGATE = re.compile("[\ud800-\udfff]")
_NOT_A_BYTE = re.compile("[\ud800-\udc7f\udd00-\udfff]")  # surrogateescape makes only U+DC80..U+DCFF


class EngineLogError(MeridianError, ValueError):
    """An engine's kept log is missing, unreadable or malformed, or cannot be written; the message says which,
    names the file and what to do."""


class EngineLogMissingError(EngineLogError):
    """No log is kept for that engine (yet): for a reader, "nothing to show", not a damaged file."""


@dataclass(frozen=True)
class KeptRun:
    """The kept tail of one container of an engine."""

    container_id: str
    restarts: int
    state: str
    exit_reason: str | None
    read_at: str
    lines: tuple[str, ...]

    def as_dict(self) -> dict[str, Any]:
        """Every field, in order, as JSON data."""
        return {**asdict(self), "lines": list(self.lines)}


@dataclass(frozen=True)
class EngineLogTail:
    engine: str
    written_at: str
    current: KeptRun
    previous: KeptRun | None = None

    def lines(self, count: int | None = None) -> list[str]:
        """The previous container's lines, then the current one's: the last ``count`` (all with None), as text
        for an observation or a log line: a byte the engine printed that was not UTF-8 is U+FFFD here."""
        return [_text(line) for line in self.raw_lines(count)]

    def raw_lines(self, count: int | None = None) -> list[str]:
        """``lines`` as kept: a byte that was not UTF-8 is the lone surrogate ``surrogateescape`` makes of it, so
        ``line.encode("utf-8", "surrogateescape")`` gives back what the engine printed (``meridian-node logs``)."""
        kept = [*(self.previous.lines if self.previous else ()), *self.current.lines]
        return kept if count is None else kept[max(0, len(kept) - count) :]

    def as_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "engine": self.engine,
            "written_at": self.written_at,
            "current": self.current.as_dict(),
            "previous": None if self.previous is None else self.previous.as_dict(),
        }


def _text(line: str) -> str:
    """``line`` with each lone surrogate (a byte that was not UTF-8, ``surrogateescape``) as U+FFFD: what the old
    ``errors="replace"`` reading gave, and what JSON text and the contract's strings can carry."""
    if line.isascii() or not _SURROGATE.search(line):
        return line
    # The bytes as Docker gave them, read as the keeper once read them; a surrogate no byte makes is U+FFFD at once.
    line = _NOT_A_BYTE.sub("\ufffd", line)
    return line.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def cap_line(line: str) -> str:
    """``line``, cut at ``MAX_LINE_CHARS`` with a note of how much was cut."""
    if len(line) <= MAX_LINE_CHARS:
        return line
    return line[:MAX_LINE_CHARS] + _CUT.format(len(line) - MAX_LINE_CHARS)


def log_path(directory: Path, engine: str) -> Path:
    """Where ``engine``'s tail is kept in ``directory``; ``EngineLogError`` for a name no engine can have (a
    container carrying our labels by hand may name itself ``../x``: it never becomes a path)."""
    if not isinstance(engine, str) or _NAME.fullmatch(engine) is None:
        raise EngineLogError(f"{engine!r:.80} is not an engine name ({NAME_FORM}); no log is kept for it")
    return Path(directory) / f"{engine}.json"


def check_logs_dir(directory: Path, *, group: int = -1) -> Path:
    """Create (0750) and check ``directory`` for writing, giving it ``group``; the checked path.

    It must resolve to itself (no symlink on the way), be a directory owned by this process's user, and be
    writable by no one else: the writer never puts a file where another user could swap it. ``EngineLogError``
    otherwise, naming what is wrong and the fix.
    """
    directory = Path(directory).absolute()
    with contextlib.suppress(FileExistsError):
        directory.mkdir(LOGS_DIR_MODE)
    try:
        info = directory.lstat()
    except OSError as exc:
        raise EngineLogError(f"cannot check {directory}: {exc.strerror or exc}; no engine log was kept") from exc
    if not stat.S_ISDIR(info.st_mode):
        raise EngineLogError(
            f"refusing {directory}: it is a {file_kind(info.st_mode)}, not a directory (symlinks are never "
            f"followed here); remove it, and the next run creates the directory"
        )
    real = Path(os.path.realpath(directory))
    if real != directory:
        raise EngineLogError(f"refusing {directory}: it resolves to {real}; remove what redirects it")
    if info.st_uid != os.geteuid():
        raise EngineLogError(
            f"refusing {directory}: it is owned by uid {info.st_uid}, not uid {os.geteuid()} who writes the engine "
            f"logs; remove it, and the next run creates it"
        )
    mode = stat.S_IMODE(info.st_mode)
    if mode & 0o022:
        raise EngineLogError(
            f"refusing {directory}: mode {mode:04o} lets others write in it, so they could replace the logs kept "
            f"there; chmod go-w {directory}"
        )
    # Changed only on what the lstat above showed to be a directory of ours, not through a symlink.
    if group != -1 and info.st_gid != group:
        os.chown(directory, -1, group, follow_symlinks=False)
    if mode != LOGS_DIR_MODE:
        directory.chmod(LOGS_DIR_MODE)
    return directory


def write_log_tail(directory: Path, tail: EngineLogTail, *, group: int = -1) -> Path:
    """Replace ``<directory>/<engine>.json`` atomically, mode 0640, ``group``; the oldest lines dropped until it
    fits ``MAX_LOG_FILE_BYTES``. ``directory`` is checked first (``check_logs_dir``)."""
    path = log_path(check_logs_dir(directory, group=group), tail.engine)
    atomic_write(path, _encode_within_cap(tail), mode=LOG_FILE_MODE, group=group)
    return path


def _encode_within_cap(tail: EngineLogTail) -> bytes:
    while True:
        data = json.dumps(tail.as_dict(), sort_keys=True, indent=1).encode("utf-8") + b"\n"
        if len(data) <= MAX_LOG_FILE_BYTES:
            return data
        previous, current = tail.previous, tail.current
        if previous is not None and previous.lines:
            previous = _drop_oldest(previous)
        else:
            current = _drop_oldest(current)
        tail = EngineLogTail(tail.engine, tail.written_at, current, previous)


def _drop_oldest(run: KeptRun) -> KeptRun:
    keep = run.lines[max(1, len(run.lines) // 8) :]  # an eighth at a time: a few passes, not one per line
    return KeptRun(run.container_id, run.restarts, run.state, run.exit_reason, run.read_at, keep)


def read_log_tail(directory: Path, engine: str) -> EngineLogTail:
    """The tail kept for ``engine`` in ``directory``; ``EngineLogError`` when there is none yet, or it is not a
    regular file (symlinks are refused, not followed), too large or malformed."""
    path = log_path(directory, engine)
    raw = read_if_present(path, MAX_LOG_FILE_BYTES, what="the kept engine log", error=EngineLogError)
    if raw is None:
        raise EngineLogMissingError(f"no log is kept for engine {engine!r} yet: {path} does not exist")
    return parse_log_tail(raw, path=path, engine=engine)


def parse_log_tail(raw: bytes, *, path: Path, engine: str) -> EngineLogTail:
    document = json_object(raw, path, error=EngineLogError, then=_REWRITTEN)
    where = str(path)
    known = {"format", "engine", "written_at", "current", "previous"}
    _require(set(document) == known, where, f"the fields must be {sorted(known)} (got {sorted(document)})")
    _require(document["format"] == FORMAT, where, f"format must be {FORMAT} (got {document['format']!r:.40})")
    _require(document["engine"] == engine, where, f"it was written for engine {document['engine']!r:.80}")
    _require(isinstance(document["written_at"], str), where, "written_at must be a string")
    current = _run(document["current"], f"{where}: current")
    previous = None if document["previous"] is None else _run(document["previous"], f"{where}: previous")
    return EngineLogTail(engine=engine, written_at=document["written_at"], current=current, previous=previous)


_RUN_FIELDS = {"container_id", "restarts", "state", "exit_reason", "read_at", "lines"}


def _run(entry: Any, where: str) -> KeptRun:
    _require(
        isinstance(entry, dict) and set(entry) == _RUN_FIELDS, where, f"must have the fields {sorted(_RUN_FIELDS)}"
    )
    _require(
        isinstance(entry["container_id"], str) and _CONTAINER_ID.fullmatch(entry["container_id"]) is not None,
        where,
        "container_id must be 12 lowercase hex digits",
    )
    restarts = entry["restarts"]
    _require(
        isinstance(restarts, int) and not isinstance(restarts, bool) and restarts >= 0, where, "restarts must be >= 0"
    )
    _require(isinstance(entry["state"], str) and 0 < len(entry["state"]) <= 40, where, "state must be a short string")
    reason = entry["exit_reason"]
    _require(reason is None or (isinstance(reason, str) and len(reason) <= 200), where, "exit_reason is too long")
    _require(isinstance(entry["read_at"], str), where, "read_at must be a string")
    lines: Sequence[Any] = entry["lines"]
    _require(isinstance(lines, list) and len(lines) <= TAIL_LINES, where, f"lines must be a list of <= {TAIL_LINES}")
    _require(
        all(isinstance(line, str) and len(line) <= OBSERVED_LOG_LINE_CHARS for line in lines),
        where,
        f"every line must be a string of at most {OBSERVED_LOG_LINE_CHARS} characters",
    )
    return KeptRun(
        container_id=entry["container_id"],
        restarts=restarts,
        state=entry["state"],
        exit_reason=reason,
        read_at=entry["read_at"],
        lines=tuple(lines),
    )


def _require(condition: bool, where: str, problem: str) -> None:
    if not condition:
        raise EngineLogError(f"{where}: {problem}{_REWRITTEN}")
