"""The host's durable memory for rollback protection: highest generation applied, highest epoch seen.

One small JSON file, ``<state_dir>/applied.json``, replaced atomically. It only ever moves forward:
lowering either number is refused, because a lower number on disk re-opens the door to replaying old
desired state. A damaged file is an error, never "start from zero", for the same reason.

Read-modify-write is serialised with an ``flock`` on ``applied.json.lock``: in-process, the agent (lease
epochs) and its playbook (generations) both write it. Under the privilege split each side has its own
file in its own directory, and root's is the one that decides what root applies.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ansible_collections.meridian.node.plugins.module_utils.fileutil import atomic_write
from ansible_collections.meridian.node.plugins.module_utils.trust import AppliedState

__all__ = ["STATE_FILE", "StateStore", "StateStoreError"]

STATE_FILE = "applied.json"
_FORMAT = 1
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
# Not secret, and the unprivileged agent reads what the root apply unit wrote.
_FILE_MODE = 0o644


class StateStoreError(RuntimeError):
    """The applied-state file is damaged, unreadable, or a caller tried to move it backwards."""


class StateStore:
    def __init__(self, state_dir: os.PathLike[str] | str) -> None:
        self.state_dir = Path(state_dir)
        self.path = self.state_dir / STATE_FILE
        # The last file read, by identity: the agent reads this several times a cycle and it changes rarely.
        # Every write is a rename of a new file, so its inode and times change; read-modify-write under the
        # lock always reads the file itself.
        self._cached: tuple[tuple[int, int, int, int, int], AppliedState] | None = None

    def load(self) -> AppliedState:
        """The recorded state; zeros when nothing was ever recorded. A corrupt file raises."""
        try:
            info = os.stat(self.path)
        except FileNotFoundError:
            return AppliedState()
        except OSError as exc:
            raise StateStoreError(f"cannot read the applied-state file {self.path}: {exc.strerror or exc}") from exc
        key = (info.st_dev, info.st_ino, info.st_mtime_ns, info.st_ctime_ns, info.st_size)
        if self._cached is not None and self._cached[0] == key:
            return self._cached[1]
        state = self._read()
        self._cached = (key, state)
        return state

    def _read(self) -> AppliedState:
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return AppliedState()
        except OSError as exc:
            raise StateStoreError(f"cannot read the applied-state file {self.path}: {exc.strerror or exc}") from exc
        return self._decode(raw)

    def record_applied(self, generation: int, epoch: int, payload_sha256: str) -> AppliedState:
        """Record that ``generation`` (issued under lease ``epoch``, body hash ``payload_sha256``) was applied."""
        if isinstance(generation, bool) or not isinstance(generation, int) or generation < 1:
            raise ValueError(f"generation must be an integer >= 1 (got {generation!r})")
        _check_epoch(epoch)
        if not isinstance(payload_sha256, str) or not _SHA256.match(payload_sha256):
            raise ValueError(f"payload_sha256 must be 64 lowercase hex characters (got {payload_sha256!r})")
        with self._locked():
            current = self._read()
            if generation < current.generation:
                raise StateStoreError(
                    f"refusing to record generation {generation}: generation {current.generation} is already "
                    f"applied ({self.path}) and the applied generation never goes down"
                )
            if generation == current.generation and payload_sha256 != current.payload_sha256:
                raise StateStoreError(
                    f"refusing to record generation {generation} with sha256 {payload_sha256}: it was recorded "
                    f"with sha256 {current.payload_sha256} ({self.path}); a generation is never reused"
                )
            # ``epoch`` is the one the apply was decided under. A higher epoch seen since (a lease renewed while
            # the playbook ran) stays: the record must say this generation runs, and the epoch never goes down.
            new = AppliedState(generation=generation, epoch=max(epoch, current.epoch), payload_sha256=payload_sha256)
            if new != current:
                self._write(new)
            return new

    def observe_epoch(self, epoch: int) -> AppliedState:
        """Raise the highest epoch seen (a lease renewal saw it); lower than recorded is refused."""
        _check_epoch(epoch)
        # The common case, a renewal under the epoch already recorded, needs no lock and no write; the epoch
        # only ever grows, so an unlocked read can only be older than the truth, never ahead of it.
        seen = self.load()
        if epoch == seen.epoch:
            return seen
        with self._locked():
            current = self._read()
            if epoch < current.epoch:
                raise StateStoreError(
                    f"refusing to record epoch {epoch}: epoch {current.epoch} was already seen ({self.path}) "
                    "and the epoch never goes down"
                )
            if epoch == current.epoch:
                return current
            new = AppliedState(current.generation, epoch, current.payload_sha256)
            self._write(new)
            return new

    def _write(self, state: AppliedState) -> None:
        document = {
            "format": _FORMAT,
            "generation": state.generation,
            "epoch": state.epoch,
            "payload_sha256": state.payload_sha256,
        }
        atomic_write(self.path, (json.dumps(document, indent=2) + "\n").encode("utf-8"), mode=_FILE_MODE)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.state_dir.mkdir(mode=0o755, parents=True, exist_ok=True)
        # Read-only is enough for flock, and lets the unprivileged agent lock a file the root apply unit
        # created first (mode 0644): with O_RDWR it could not open it at all.
        fd = os.open(self.state_dir / f"{STATE_FILE}.lock", os.O_RDONLY | os.O_CREAT, _FILE_MODE)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing releases the lock

    def _decode(self, raw: bytes) -> AppliedState:
        try:
            document: Any = json.loads(raw)
        except (UnicodeDecodeError, ValueError) as exc:
            raise self._corrupt(f"not JSON ({exc})") from exc
        if not isinstance(document, dict):
            raise self._corrupt(f"expected a JSON object, got {type(document).__name__}")
        expected = {"format", "generation", "epoch", "payload_sha256"}
        if set(document) != expected:
            raise self._corrupt(f"expected exactly the fields {sorted(expected)}, got {sorted(document)}")
        if document["format"] != _FORMAT:
            raise self._corrupt(f"unknown format {document['format']!r} (this version reads format {_FORMAT})")
        for name in ("generation", "epoch"):
            value = document[name]
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise self._corrupt(f"{name} must be an integer >= 0, got {value!r}")
        digest = document["payload_sha256"]
        if digest is None:
            if document["generation"] != 0:
                raise self._corrupt(f"generation {document['generation']} is recorded without its payload_sha256")
        elif not isinstance(digest, str) or not _SHA256.match(digest):
            raise self._corrupt(f"payload_sha256 must be 64 lowercase hex characters or null, got {digest!r}")
        return AppliedState(document["generation"], document["epoch"], digest)

    def _corrupt(self, reason: str) -> StateStoreError:
        return StateStoreError(
            f"the applied-state file {self.path} is corrupt: {reason}. It protects this host against replayed "
            "and rolled-back desired state, so it is not reset automatically. Restore it from a backup, or "
            "re-create it with the generation and epoch this node last applied (the agent's operation log "
            "and the control plane both know them); deleting it lets older signed states be applied again."
        )


def _check_epoch(epoch: int) -> None:
    if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
        raise ValueError(f"epoch must be an integer >= 0 (got {epoch!r})")
