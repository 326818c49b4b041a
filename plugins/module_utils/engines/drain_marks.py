"""Durable draining marks: which engines must get no new work, kept on the host across restarts.

One small JSON file per engine, ``<state_dir>/draining/<name>.json``, written atomically
(``_fileutil.atomic_write``): a reader sees a whole mark or none. The mark is the first thing a drain or a
drain-then-replace does, so the agent's observations (and through them the serving projection) drop the
engine before any request could be cut off; it is cleared once a replacement is ready, or by undrain.

A mark may name one container of the engine, by the host port it publishes: a replace that starts the new
engine beside the old drains only the old container, while the new one, under the same engine name and on
another port, is already serving. The port is what every observer has (root's ``engines.json`` lists no
container ids), and two containers of one engine never publish the same port.

The files hold nothing secret (engine name, time, reason), so they are world-readable: the agent runs
unprivileged and must read marks written by root.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from ansible_collections.meridian.node.plugins.module_utils._compat import UTC
from ansible_collections.meridian.node.plugins.module_utils._errors import MeridianError
from ansible_collections.meridian.node.plugins.module_utils._fileutil import (
    atomic_write,
    fsync_directory,
    read_if_present,
)

__all__ = [
    "DRAINING_DIR",
    "DrainMark",
    "DrainStateError",
    "clear_draining",
    "list_draining",
    "mark_draining",
    "read_mark",
]

DRAINING_DIR = "draining"
# The contract's engine name: it becomes a file name, so nothing else may (no '/', no '..').
_NAME = re.compile(r"^[a-z0-9]([a-z0-9_.-]{0,61}[a-z0-9])?$")
_SUFFIX = ".json"
_MAX_MARK_BYTES = 64 * 1024


class DrainStateError(MeridianError, ValueError):
    """A draining mark could not be read or written; the message names the file and the reason."""


@dataclass(frozen=True)
class DrainMark:
    name: str
    since: str  # RFC 3339 UTC
    reason: str
    port: int | None = None  # the engine's one container published on this port drains; None: all of them

    def as_dict(self) -> dict[str, Any]:
        document: dict[str, Any] = {"name": self.name, "since": self.since, "reason": self.reason}
        if self.port is not None:
            document["port"] = self.port
        return document

    def applies_to(self, port: int | None) -> bool:
        """Whether the engine's container published on ``port`` (None: not published) is draining."""
        return self.port is None or self.port == port


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def _mark_path(state_dir: str, name: str) -> str:
    if not _NAME.match(name):
        raise DrainStateError(
            f"engine name {name!r} cannot name a draining mark: use 1-63 lowercase letters, digits, '.', '_' or '-'"
        )
    return os.path.join(state_dir, DRAINING_DIR, name + _SUFFIX)


def read_mark(state_dir: str, name: str) -> DrainMark | None:
    """The mark of engine ``name``, or None when it is not draining."""
    path = _mark_path(state_dir, name)
    # Marks are only ever written by atomic_write: a symlink or a FIFO in their place is not ours.
    data = read_if_present(path, _MAX_MARK_BYTES, what="draining mark", error=DrainStateError)
    return None if data is None else _parse(path, data, name)


def _parse(path: str, data: bytes, name: str) -> DrainMark:
    try:
        document: Any = json.loads(data)
    except ValueError as exc:
        raise DrainStateError(f"draining mark {path} is not JSON ({exc}); remove it or run undrain") from exc
    if (
        not isinstance(document, dict)
        or document.get("name") != name
        or not isinstance(document.get("since"), str)
        or not isinstance(document.get("reason"), str)
        or not _optional_port(document.get("port"))
    ):
        raise DrainStateError(
            f"draining mark {path} must be an object with name {name!r}, since and reason strings (and "
            "optionally a port, 1-65535); remove it or run undrain"
        )
    return DrainMark(name=name, since=document["since"], reason=document["reason"], port=document.get("port"))


def _optional_port(value: Any) -> bool:
    return value is None or (isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 65535)


def mark_draining(
    state_dir: str, name: str, *, reason: str, now: str | None = None, port: int | None = None
) -> tuple[DrainMark, bool]:
    """Mark ``name`` draining (only its container published on ``port``, when given), durably; returns the
    mark and whether it is new.

    An engine already marked keeps its first ``since``: the drain started then, and a retry must not
    reset how long it has been draining. A mark for the whole engine covers any one container of it.
    """
    existing = read_mark(state_dir, name)
    if existing is not None and (existing.port is None or existing.port == port):
        return existing, False
    mark = DrainMark(name=name, since=now or _now(), reason=reason, port=port)
    path = _mark_path(state_dir, name)
    directory = os.path.dirname(path)
    try:
        os.makedirs(directory, mode=0o755, exist_ok=True)
        atomic_write(path, json.dumps(mark.as_dict(), sort_keys=True).encode("utf-8") + b"\n", mode=0o644)
    except OSError as exc:
        raise DrainStateError(f"cannot write draining mark {path}: {exc.strerror or exc}") from exc
    return mark, True


def clear_draining(state_dir: str, name: str) -> bool:
    """Remove the mark of ``name``; returns whether there was one."""
    path = _mark_path(state_dir, name)
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise DrainStateError(f"cannot remove draining mark {path}: {exc.strerror or exc}") from exc
    fsync_directory(os.path.dirname(path))
    return True


def list_draining(state_dir: str) -> list[DrainMark]:
    """Every engine marked draining, by name. Temporary files of an interrupted write are not marks."""
    directory = os.path.join(state_dir, DRAINING_DIR)
    try:
        entries = sorted(os.listdir(directory))
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise DrainStateError(f"cannot list draining marks in {directory}: {exc.strerror or exc}") from exc
    marks = []
    for entry in entries:
        if entry.startswith(".") or not entry.endswith(_SUFFIX):
            continue
        name = entry[: -len(_SUFFIX)]
        if not _NAME.match(name):
            continue
        mark = read_mark(state_dir, name)
        if mark is not None:
            marks.append(mark)
    return marks
