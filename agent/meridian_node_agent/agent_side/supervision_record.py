"""What supervision must remember across the agent's own restarts: a small record in the agent's directory.

Runs on: the agent side. The file is the agent's own (``<state_dir>/supervision.json``, mode 0600, written by
the agent's user); root never reads it, and it decides nothing but the pace of the agent's own repairs.

Why it exists: ``meridian-node run --once`` from cron, a restarted agent and an agent that crash-loops each
start with an empty ``Supervisor``. With the counts in memory only, every run saw a killed engine for the
first time, so its settle grace never ended and it was never repaired; and every restart gave a crash-looping
engine (or a state whose apply keeps failing) a fresh first step of its backoff. The record keeps what the
decisions need: per engine of the supervised state, its ``supervise.EngineTrack`` (since when expected,
whether ever ready and since when, the problem and since when, the repairs and when the next is allowed); for
a failed apply, ``RememberedRetry`` (its count, its next attempt, and the ETag the agent fetches with
meanwhile). Each part names the state it is for (generation and payload sha256); the cycle does not use a part
written for another state.

Clock. Times are on the agent's monotonic clock (``time.monotonic``, Linux ``CLOCK_MONOTONIC``), the clock a
long-running agent paces itself by: every process of one boot reads the same clock, so a record written by
one run means the same to the next, and it does not jump with wall time (NTP, an operator's ``date``). Like a
long-running agent, it stands still while the host is suspended. It starts over at boot, so the record carries
the kernel's boot id (``/proc/sys/kernel/random/boot_id``). A record of another boot (or of an unknown one, or
one whose times lie ahead of this clock, which no record of this boot can hold) still gives its counts, and
its times are dropped: ``Remembered.same_clock`` is false, ``Supervisor.resume`` starts each grace over and
keeps the repair count, and the cycle makes a failed apply's next attempt due at once with its count kept.
Wall time appears once, a failed apply's ``failed_at``, for people (``status``), never for a decision.

Bad records. A missing one means nothing to remember (a first start). One that cannot be read (a symlink, not
a regular file, over ``MAX_RECORD_BYTES``), is not JSON, is not this format, is another version or does not
validate is ignored with one ``supervision-record-ignored`` line naming the reason, and replaced at the next
write. Never a crash: the worst a bad record does is start the counts over, as every restart did before.

Writes. ``save`` compares what there is to remember with what was last written or read, and writes only on a
change: a problem first seen or gone, a first readiness, a repair, a failed apply. An idle, healthy host writes
nothing per cycle. Each write is ``atomic_write`` (temp file, fsync, rename, fsync of the directory), so a
crash leaves the old record or the new one, never a torn one. A record too large to write (hundreds of
engines) is removed instead, so that no stale one outlives it.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError

from ansible_collections.meridian.node.plugins.module_utils._fileutil import (
    CappedFileMissingError,
    CappedReadError,
    atomic_write,
    read_capped,
)
from ansible_collections.meridian.node.plugins.module_utils.contracts import (
    INT64_MAX,
    FormatOne,
    JsonError,
    Sha256Hex,
    StrictModel,
    UtcTimestamp,
    describe_validation_error,
    format_rfc3339,
    read_json,
)
from meridian_node_agent.agent_side.supervise import EngineTrack
from meridian_node_agent.boundary.boot import read_boot_id
from meridian_node_agent.logs import EventLogger

__all__ = [
    "MAX_RECORD_BYTES",
    "RECORD_FILE",
    "RECORD_FORMAT",
    "RECORD_VERSION",
    "Remembered",
    "RememberedRetry",
    "RememberedState",
    "SupervisionRecord",
]

RECORD_FILE = "supervision.json"
RECORD_FORMAT = "meridian.node/supervision-record"
RECORD_VERSION = 1
# About 300 bytes per engine: room for hundreds of engines, and a bound on what a start-up reads.
MAX_RECORD_BYTES = 256 * 1024
_CLOCK = "monotonic"
_IGNORED_FIX = "nothing to do: supervision counts start over from this run; the record is rewritten at its next change"

# Seconds on the monotonic clock: never negative, never NaN or infinite.
_Stamp = Annotated[float, Field(ge=0, allow_inf_nan=False)]
_Generation = Annotated[int, Field(ge=1, le=INT64_MAX)]


class _TrackEntry(StrictModel):
    expected_since: _Stamp
    seen_ready: bool
    ready_since: _Stamp | None
    problem: Annotated[str, Field(max_length=2000)] | None
    bad_since: _Stamp | None
    repairs: Annotated[int, Field(ge=0, le=1_000_000)]
    retry_at: _Stamp


class _StateEntry(StrictModel):
    generation: _Generation
    payload_sha256: Sha256Hex
    engines: dict[Annotated[str, Field(min_length=1, max_length=253)], _TrackEntry]


class _RetryEntry(StrictModel):
    generation: _Generation
    payload_sha256: Sha256Hex
    failures: Annotated[int, Field(ge=1, le=1_000_000)]
    retry_at: _Stamp
    backoff_s: _Stamp
    failed_at: UtcTimestamp
    error: Annotated[str, Field(max_length=2000)]
    etag: Annotated[str, Field(pattern=r"^[\x20-\x7e]{1,512}$")] | None


class _RecordDocument(StrictModel):
    format: Literal["meridian.node/supervision-record"]
    version: FormatOne
    clock: Literal["monotonic"]
    boot_id: Annotated[str, Field(max_length=64)] | None
    supervised: _StateEntry | None
    apply_retry: _RetryEntry | None


@dataclass(frozen=True)
class RememberedState:
    """The supervised state (generation, payload sha256) and what supervision knew of each of its engines."""

    generation: int
    payload_sha256: str
    tracks: Mapping[str, EngineTrack]


@dataclass(frozen=True)
class RememberedRetry:
    """A state whose apply failed: how often, and when the next attempt is allowed (``apply_retry.ApplyRetry`` less
    the envelope, which the spool holds); and ``etag``, the control plane's ETag the agent held meanwhile, so
    that a restarted agent asks as the long-running one would have, and is answered as it would have been."""

    generation: int
    payload_sha256: str
    failures: int
    retry_at: float
    backoff_s: float
    failed_at: datetime
    error: str
    etag: str | None = None


@dataclass(frozen=True)
class Remembered:
    """What an earlier run left. ``same_clock``: its times are on this boot's clock; when false only the
    counts mean anything (the tracks' and the retry's times are still those written, for the caller to drop)."""

    supervised: RememberedState | None
    apply_retry: RememberedRetry | None
    same_clock: bool


class SupervisionRecord:
    """``<state_dir>/supervision.json``: ``load`` once at start-up, ``save`` after anything that may change it.

    ``boot_id`` is injected so that a test can play a reboot; ``writes`` counts the writes made (what an idle
    cycle must leave at zero).
    """

    def __init__(
        self,
        state_dir: Path,
        *,
        log: EventLogger | None = None,
        boot_id: Callable[[], str | None] = read_boot_id,
    ) -> None:
        self.path = Path(state_dir) / RECORD_FILE
        self.log = log or EventLogger()
        self._boot_id = boot_id
        self._boot: str | None = None
        self._boot_read = False
        # What the file holds now, as far as this process knows: None when unknown or bad (the next save writes).
        self._written: dict[str, Any] | None = None
        self._failed: str | None = None  # the kind of write error last logged: a full disk is said once, not per cycle
        self.writes = 0

    def boot(self) -> str | None:
        if not self._boot_read:
            self._boot, self._boot_read = self._boot_id(), True
        return self._boot

    def load(self, now: float) -> Remembered | None:
        """What an earlier run left, or None (none, or ignored with a log line); never raises.

        ``now`` is this clock's reading: a record whose times lie ahead of it was not written on it.
        """
        try:
            data = read_capped(self.path, MAX_RECORD_BYTES, what="supervision record")
        except CappedFileMissingError:
            self._written = self._document(None, None)
            return None
        except CappedReadError as exc:
            return self._ignored(exc.reason.value, str(exc))
        try:
            document = read_json(data)
        except JsonError as exc:
            return self._ignored("not-json", str(exc))
        if not isinstance(document, dict) or document.get("format") != RECORD_FORMAT:
            return self._ignored("foreign-format", f"it is not a {RECORD_FORMAT} document")
        if document.get("version") != RECORD_VERSION:
            version = json.dumps(document.get("version"))[:40]
            return self._ignored(
                "other-version", f"it is version {version}; this agent reads and writes version {RECORD_VERSION}"
            )
        try:
            parsed = _RecordDocument.model_validate(document)
        except ValidationError as exc:
            return self._ignored("malformed", describe_validation_error(exc))
        remembered = _remembered(parsed, same_clock=True)
        boot = self.boot()
        why_not = (
            "this boot's id cannot be read"
            if boot is None
            else "it was written in another boot"
            if parsed.boot_id != boot
            else "its times lie ahead of this clock"
            if _ahead(remembered, now)
            else None
        )
        if why_not is None:
            self._written = document
            return remembered
        self.log.info("supervision-record-rebased", path=str(self.path), reason=why_not, kept="repair and retry counts")
        self._written = None
        return _remembered(parsed, same_clock=False)

    def save(self, supervised: RememberedState | None, apply_retry: RememberedRetry | None) -> bool:
        """Write the record when it differs from what the file holds; whether it wrote. Never raises."""
        document = self._document(supervised, apply_retry)
        if document == self._written:
            return False
        data = (json.dumps(document, separators=(",", ":"), sort_keys=True) + "\n").encode()
        if len(data) > MAX_RECORD_BYTES:
            # Not a host this record is for; an outdated record must not be taken for this one after a restart.
            with contextlib.suppress(OSError):
                self.path.unlink()
            self.log.warning(
                "supervision-record-too-large",
                path=str(self.path),
                bytes=len(data),
                limit=MAX_RECORD_BYTES,
                consequence="removed; a restart of the agent starts the supervision counts over",
            )
            self._written = document
            return False
        try:
            atomic_write(self.path, data, mode=0o600)
        except OSError as exc:
            error = str(exc)
            # By kind, not by text: the text names a new temporary file each time.
            kind = f"{type(exc).__name__}:{exc.errno}"
            if kind != self._failed:
                self.log.error(
                    "supervision-record-not-written",
                    path=str(self.path),
                    error=error,
                    fix="check that the agent's state_dir is writable and has room; until then a restart of the "
                    "agent starts the supervision counts over",
                )
            self._failed = kind
            return False
        self._written, self._failed = document, None
        self.writes += 1
        return True

    def _ignored(self, reason: str, detail: str) -> Remembered | None:
        """Log why the record is not used, and make the next save replace it; None (nothing remembered)."""
        self.log.warning(
            "supervision-record-ignored", path=str(self.path), reason=reason, detail=detail, fix=_IGNORED_FIX
        )
        self._written = None
        return None

    def _document(self, supervised: RememberedState | None, apply_retry: RememberedRetry | None) -> dict[str, Any]:
        return {
            "format": RECORD_FORMAT,
            "version": RECORD_VERSION,
            "clock": _CLOCK,
            "boot_id": self.boot(),
            "supervised": None
            if supervised is None
            else {
                "generation": supervised.generation,
                "payload_sha256": supervised.payload_sha256,
                "engines": {name: _track_entry(track) for name, track in supervised.tracks.items()},
            },
            "apply_retry": None
            if apply_retry is None
            else {**asdict(apply_retry), "failed_at": format_rfc3339(apply_retry.failed_at)},
        }


def _track_entry(track: EngineTrack) -> dict[str, Any]:
    entry = asdict(track)
    del entry["name"]  # the key
    return entry


def _remembered(parsed: _RecordDocument, *, same_clock: bool) -> Remembered:
    state = parsed.supervised
    retry = parsed.apply_retry
    return Remembered(
        supervised=None
        if state is None
        else RememberedState(
            generation=state.generation,
            payload_sha256=state.payload_sha256,
            tracks={name: EngineTrack(name=name, **entry.model_dump()) for name, entry in state.engines.items()},
        ),
        # _RetryEntry is RememberedRetry's form on disk, field for field.
        apply_retry=None if retry is None else RememberedRetry(**retry.model_dump()),
        same_clock=same_clock,
    )


def _ahead(remembered: Remembered, now: float) -> bool:
    """Whether a time that was in the past when it was written lies ahead of ``now`` (a retry's ``retry_at`` is
    meant to; the caller bounds it by the backoff)."""
    if remembered.supervised is None:
        return False
    stamps = [
        stamp
        for track in remembered.supervised.tracks.values()
        for stamp in (track.expected_since, track.ready_since, track.bad_since)
        if stamp is not None
    ]
    return any(stamp > now for stamp in stamps)
