"""The host's durable memory for rollback protection: the generation accepted, the generation applied, the
highest lease epoch seen.

One small JSON file, ``<state_dir>/applied.json``, replaced atomically (format 2)::

    {"format": 2, "generation": 12, "epoch": 4, "payload_sha256": "<hex>",
     "accepted": {"generation": 13, "epoch": 4, "payload_sha256": "<hex>"}}

``accepted`` is the generation the applier decided to apply, recorded (``record_accepted``) before its apply
starts; null when the last one accepted is also recorded applied. It moves the floor at the decision: an
apply of N that fails, hangs or is killed leaves N accepted, so N-1 is refused from then on, while N's own
bytes may be applied again. Format 1 files (no ``accepted``) are read as "accepted = applied". Nothing here
ever moves backwards: a lower number on disk re-opens the door to replaying old desired state. A damaged file
is an error, never "start from zero", for the same reason.

Read-modify-write is serialised with an ``flock`` on ``applied.json.lock`` (``_lockfile``: 0600, the writer's
own, replaced if an older release left it open to others; taken within ``lock_wait_s`` or
``StateStoreError``). In-process, the agent (lease epochs) and its playbook (generations) both write it, as
one user. Under the privilege split each side has its own file in its own directory, and root's, 0600 in
root's directory, is the one that decides what root applies.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ansible_collections.meridian.node.plugins.module_utils._errors import MeridianError
from ansible_collections.meridian.node.plugins.module_utils._fileutil import atomic_write
from ansible_collections.meridian.node.plugins.module_utils._lockfile import LOCK_WAIT_S, LockTimeout, hold_lock
from ansible_collections.meridian.node.plugins.module_utils.trust.verify import AcceptedState, AppliedState

__all__ = ["STATE_FILE", "StateStore", "StateStoreError"]

STATE_FILE = "applied.json"
_FORMAT = 2
_READS = (1, 2)
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
# Nobody but the writer reads it: the agent learns root's record from root's public files (the apply answer,
# airgap-outcomes.json), never from root's directory.
_FILE_MODE = 0o600


class StateStoreError(MeridianError, RuntimeError):
    """The applied-state file is damaged, unreadable, or a caller tried to move it backwards."""


class StateStore:
    def __init__(self, state_dir: os.PathLike[str] | str, *, lock_wait_s: float = LOCK_WAIT_S) -> None:
        self.state_dir = Path(state_dir)
        self.path = self.state_dir / STATE_FILE
        self.lock_wait_s = lock_wait_s
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
        return self.decode(raw)

    def record_applied(self, generation: int, epoch: int, payload_sha256: str) -> AppliedState:
        """Record that ``generation`` (issued under lease ``epoch``, body hash ``payload_sha256``) was applied."""

        def applied(current: AppliedState) -> AppliedState:
            # ``epoch`` is the one the apply was decided under. A higher epoch seen since (a lease renewed while
            # the playbook ran) stays: the record must say this generation runs, and the epoch never goes down.
            accepted = current.accepted
            if accepted is not None and accepted.generation <= generation:
                accepted = None  # the one accepted is now the one applied
            return AppliedState(generation, max(epoch, current.epoch), payload_sha256, accepted)

        return self._record(generation, epoch, payload_sha256, "record", applied)

    def record_accepted(self, generation: int, epoch: int, payload_sha256: str) -> AppliedState:
        """Record, before its apply starts, that ``generation`` (``epoch``, ``payload_sha256``) is being applied.

        From then on nothing below it is accepted, whatever becomes of this apply; the same generation with the
        same bytes stays acceptable (a retry, a repair). A generation below the floor, or the floor with other
        bytes, raises ``StateStoreError``: the decision was overtaken, and the apply must not start.
        """

        def accepted(current: AppliedState) -> AppliedState:
            floor = current.accepted
            # The applied generation again (a repair), or the one already accepted (a retry): the floor is there
            # already; only a higher epoch is news.
            if generation > current.accepted_generation:
                floor = AcceptedState(generation, epoch, payload_sha256)
            return AppliedState(current.generation, max(epoch, current.epoch), current.payload_sha256, floor)

        return self._record(generation, epoch, payload_sha256, "accept", accepted)

    def _record(
        self,
        generation: int,
        epoch: int,
        payload_sha256: str,
        what: str,
        update: Callable[[AppliedState], AppliedState],
    ) -> AppliedState:
        # Both recordings: check the values, then under the lock refuse what would go below the record, and write
        # what ``update`` makes of it only when that differs.
        _check_generation(generation)
        _check_epoch(epoch)
        _check_sha256(payload_sha256)
        with self._locked():
            current = self._read()
            self._refuse_below(current, generation, payload_sha256, what)
            new = update(current)
            if new != current:
                self._write(new)
            return new

    def _refuse_below(self, current: AppliedState, generation: int, payload_sha256: str, what: str) -> None:
        # The generation applied, then the one accepted since: neither is undercut, nor reused with other content.
        # (generation, its sha256, what became of it, how it was written down, the rule a lower one breaks)
        marks = [
            (
                current.generation,
                current.payload_sha256,
                "is already applied",
                "recorded",
                "the applied generation never goes down",
            )
        ]
        accepted = current.accepted
        if accepted is not None:
            marks.append(
                (
                    accepted.generation,
                    accepted.payload_sha256,
                    "was accepted since",
                    "accepted",
                    "nothing below the generation accepted is applied again",
                )
            )
        for marked, marked_sha256, became, written, rule in marks:
            if generation < marked:
                raise StateStoreError(
                    f"refusing to {what} generation {generation}: generation {marked} {became} ({self.path}), "
                    f"and {rule}"
                )
            if generation == marked and payload_sha256 != marked_sha256:
                raise StateStoreError(
                    f"refusing to {what} generation {generation} with sha256 {payload_sha256}: it was {written} "
                    f"with sha256 {marked_sha256} ({self.path}); a generation is never reused"
                )

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
            new = AppliedState(current.generation, epoch, current.payload_sha256, current.accepted)
            self._write(new)
            return new

    def _write(self, state: AppliedState) -> None:
        accepted = state.accepted
        document = {
            "format": _FORMAT,
            "generation": state.generation,
            "epoch": state.epoch,
            "payload_sha256": state.payload_sha256,
            "accepted": None
            if accepted is None
            else {
                "generation": accepted.generation,
                "epoch": accepted.epoch,
                "payload_sha256": accepted.payload_sha256,
            },
        }
        atomic_write(self.path, (json.dumps(document, indent=2) + "\n").encode("utf-8"), mode=_FILE_MODE)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.state_dir.mkdir(mode=0o755, parents=True, exist_ok=True)
        try:
            with hold_lock(
                self.state_dir / f"{STATE_FILE}.lock",
                wait_s=self.lock_wait_s,
                what="the applied-state record's lock",
            ):
                yield
        except LockTimeout as exc:
            raise StateStoreError(f"cannot update the applied-state file {self.path}: {exc}") from exc
        except OSError as exc:
            raise StateStoreError(f"cannot lock the applied-state file {self.path}: {exc.strerror or exc}") from exc

    def decode(self, raw: bytes) -> AppliedState:
        """The record held in ``raw`` (what ``load`` read), for a reader that read the file its own way
        (``meridian-node status`` reads through ``boundary.agent_files``); ``StateStoreError`` if it is not one."""
        try:
            document: Any = json.loads(raw)
        except (UnicodeDecodeError, ValueError) as exc:
            raise self._corrupt(f"not JSON ({exc})") from exc
        if not isinstance(document, dict):
            raise self._corrupt(f"expected a JSON object, got {type(document).__name__}")
        version = document.get("format")
        if isinstance(version, bool) or version not in _READS:
            raise self._corrupt(f"unknown format {version!r} (this version reads formats {list(_READS)})")
        expected = {"format", "generation", "epoch", "payload_sha256"} | ({"accepted"} if version == 2 else set())
        if set(document) != expected:
            raise self._corrupt(f"expected exactly the fields {sorted(expected)}, got {sorted(document)}")
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
        accepted = self._decode_accepted(document.get("accepted"), document["generation"])
        return AppliedState(document["generation"], document["epoch"], digest, accepted)

    def _decode_accepted(self, value: Any, applied: int) -> AcceptedState | None:
        if value is None:
            return None
        fields = {"generation", "epoch", "payload_sha256"}
        if not isinstance(value, dict) or set(value) != fields:
            raise self._corrupt(f"accepted must be null or an object with exactly the fields {sorted(fields)}")
        for name, least in (("generation", 1), ("epoch", 0)):
            number = value[name]
            if isinstance(number, bool) or not isinstance(number, int) or number < least:
                raise self._corrupt(f"accepted.{name} must be an integer >= {least}, got {number!r}")
        if not isinstance(value["payload_sha256"], str) or not _SHA256.match(value["payload_sha256"]):
            raise self._corrupt(
                f"accepted.payload_sha256 must be 64 lowercase hex characters, got {value['payload_sha256']!r}"
            )
        if value["generation"] <= applied:
            raise self._corrupt(
                f"accepted.generation {value['generation']} is not above the applied generation {applied} "
                "(the record writes null once the generation accepted is applied)"
            )
        return AcceptedState(value["generation"], value["epoch"], value["payload_sha256"])

    def _corrupt(self, reason: str) -> StateStoreError:
        return StateStoreError(
            f"the applied-state file {self.path} is corrupt: {reason}. It protects this host against replayed "
            "and rolled-back desired state, so it is not reset automatically. Restore it from a backup, or "
            "re-create it with the generation and epoch this node last applied (the agent's operation log "
            "and the control plane both know them); deleting it lets older signed states be applied again."
        )


def _check_generation(generation: int) -> None:
    if isinstance(generation, bool) or not isinstance(generation, int) or generation < 1:
        raise ValueError(f"generation must be an integer >= 1 (got {generation!r})")


def _check_sha256(payload_sha256: str) -> None:
    if not isinstance(payload_sha256, str) or not _SHA256.match(payload_sha256):
        raise ValueError(f"payload_sha256 must be 64 lowercase hex characters (got {payload_sha256!r})")


def _check_epoch(epoch: int) -> None:
    if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
        raise ValueError(f"epoch must be an integer >= 0 (got {epoch!r})")
