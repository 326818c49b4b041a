"""The operation log: an append-only, fsync'd JSON-lines file tying generation → run ident → result.

Each apply writes a ``started`` line before the playbook runs and a line with its result after. A
``started`` line without a later line for the same run ident is an operation that was interrupted (the
agent or the host died mid-apply); the agent applies it again at start-up. A torn last line (a crash in
the middle of a write) is skipped when reading, never fatal: the line before it is still complete.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ansible_collections.meridian.node.plugins.module_utils.contracts import format_rfc3339

__all__ = ["ABANDONED", "STARTED", "OpLog", "Operation", "decode_operation"]

STARTED = "started"
# An interrupted operation that start-up could not resume; its entry carries the reason.
ABANDONED = "abandoned"
# What names an operation: its started line and the line that ends it carry the same.
_OPERATION = ("op", "generation", "epoch", "payload_sha256", "run_ident")
_FIELDS = (*_OPERATION, "result", "at")
_OPTIONAL = ("reason",)


@dataclass(frozen=True)
class Operation:
    op: str
    generation: int
    epoch: int
    payload_sha256: str
    run_ident: str
    result: str
    at: str
    reason: str | None = None


class OpLog:
    def __init__(self, path: os.PathLike[str] | str) -> None:
        self.path = Path(path)

    def append(
        self,
        *,
        op: str,
        generation: int,
        epoch: int,
        payload_sha256: str,
        run_ident: str,
        result: str,
        at: datetime | None = None,
        reason: str | None = None,
    ) -> Operation:
        entry = Operation(
            op=op,
            generation=generation,
            epoch=epoch,
            payload_sha256=payload_sha256,
            run_ident=run_ident,
            result=result,
            at=format_rfc3339(at or datetime.now(UTC)),
            reason=reason,
        )
        document = {name: value for name, value in asdict(entry).items() if name in _FIELDS or value is not None}
        line = (json.dumps(document, separators=(",", ":")) + "\n").encode("utf-8")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            size = os.fstat(fd).st_size
            if size and os.pread(fd, 1, size - 1) != b"\n":
                # A torn line from a crash mid-write: end it, so this entry is not glued onto it.
                line = b"\n" + line
            # One write() of a short line on an O_APPEND file: no interleaving with another appender.
            os.write(fd, line)
            os.fsync(fd)
        finally:
            os.close(fd)
        return entry

    def finish(
        self, pending: Operation, result: str, *, at: datetime | None = None, reason: str | None = None
    ) -> Operation:
        """Append the line that ends ``pending`` (a ``started`` entry) with ``result``: the same operation,
        generation, epoch, digest and run ident, so that ``pending()`` no longer returns it."""
        same = {name: getattr(pending, name) for name in _OPERATION}
        return self.append(**same, result=result, at=at, reason=reason)

    def read(self) -> list[Operation]:
        """Every complete entry, oldest first."""
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return []
        entries = []
        for text in raw.split(b"\n"):
            entry = decode_operation(text)
            if entry is not None:
                entries.append(entry)
        return entries

    def last(self) -> Operation | None:
        entries = self.read()
        return entries[-1] if entries else None

    def pending(self) -> Operation | None:
        """The latest operation that was started and never finished, if any."""
        finished: set[str] = set()
        for entry in reversed(self.read()):
            if entry.result != STARTED:
                finished.add(entry.run_ident)
            elif entry.run_ident not in finished:
                return entry
        return None


def decode_operation(text: bytes) -> Operation | None:
    """One line of the log as an ``Operation``; None for a blank, torn or foreign line (they are skipped, not fatal)."""
    if not text.strip():
        return None
    try:
        document: Any = json.loads(text)
    except ValueError:
        return None  # a torn line from a crash mid-write
    if not isinstance(document, dict) or not set(_FIELDS) <= set(document) <= {*_FIELDS, *_OPTIONAL}:
        return None
    try:
        return Operation(**{name: document[name] for name in (*_FIELDS, *_OPTIONAL) if name in document})
    except TypeError:
        return None
