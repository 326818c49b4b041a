"""The agent's counters, and how a restarted agent takes them back from the status file it last wrote.

Runs on: the agent side. ``meridian-node status`` shows these counts (cycles, applies, apply failures, the
control plane unavailable or refusing, repairs, rejections by reason) and when an apply last succeeded.
Each process used to start them at zero, so a status read after a restart (a crash loop, an upgrade, a
``run --once`` from cron) said "0 apply failures" of a node that had failed all night.

Where from: ``<state_dir>/status.json``, which the cycle already rewrites whenever something in it changes
(and at least once a minute: ``status_file.STATUS_REFRESH_S``), so no second file is written per cycle. What a
restart can lose is what changed since that write: at most the cycles of the last minute (a cycle alone
does not rewrite the file) and what a crash cut off between a cycle and its write; never more.

A missing file is a first start. One that cannot be read (a symlink, not a regular file, larger than
``boundary.agent_files.STATUS_MAX_BYTES``), is not JSON, or whose counters are not counts (negative, not integers,
too large) is logged once (``counters-not-restored``, with the reason) and the counters start at zero: a count shown
wrong matters less than an agent that will not start. Keys this version does not know (a newer agent's,
after a downgrade) are left out, not a reason to start over.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ansible_collections.meridian.node.plugins.module_utils._fileutil import (
    CappedFileMissingError,
    CappedReadError,
    read_capped,
)
from ansible_collections.meridian.node.plugins.module_utils.contracts import (
    INT64_MAX,
    UtcTimestamp,
    describe_validation_error,
)
from meridian_node_agent.boundary.agent_files import STATUS_MAX_BYTES
from meridian_node_agent.logs import EventLogger

__all__ = ["CarriedOver", "Counters", "restore_counters"]

_NOT_RESTORED_FIX = "nothing to do: the counters start at zero in this run, and the next status write replaces the file"

_Count = Annotated[int, Field(ge=0, le=INT64_MAX)]


@dataclass
class Counters:
    cycles: int = 0
    applies: int = 0
    apply_failures: int = 0
    unavailable: int = 0
    refused: int = 0  # the control plane answered and said no (403 revoked, 404 unknown node...)
    repairs: int = 0  # reconciles of the applied generation because engines drifted from it
    states_refused: int = 0  # verified states this node's mode does not apply (kubernetes-integrated)
    rejections: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class CarriedOver:
    """What an earlier run of the agent left in its status file: its counters, and when an apply last
    succeeded (None when none ever did, or the file did not say)."""

    counters: Counters
    last_applied_at: datetime | None = None


class _StatusCounts(BaseModel):
    # Strict counts, and keys of another version ignored: see the module docstring.
    model_config = ConfigDict(extra="ignore", strict=True)

    cycles: _Count = 0
    applies: _Count = 0
    apply_failures: _Count = 0
    unavailable: _Count = 0
    refused: _Count = 0
    repairs: _Count = 0
    states_refused: _Count = 0
    rejections: dict[Annotated[str, Field(min_length=1, max_length=64)], _Count] = Field(default_factory=dict)


class _StatusCarried(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    counters: _StatusCounts = Field(default_factory=_StatusCounts)
    last_applied_at: UtcTimestamp | None = None


def restore_counters(status_path: Path, *, log: EventLogger) -> CarriedOver:
    """The counters ``status_path`` (the agent's ``status.json``) holds, or zeros: never raises for the file."""
    try:
        raw = read_capped(status_path, STATUS_MAX_BYTES, what="agent status file")
    except CappedFileMissingError:
        return CarriedOver(Counters())
    except CappedReadError as exc:
        return _not_restored(status_path, str(exc), log)
    try:
        carried = _StatusCarried.model_validate_json(raw)
    except ValidationError as exc:
        return _not_restored(status_path, describe_validation_error(exc), log)
    # _StatusCounts is Counters as status.json holds it, field for field (model_dump copies the rejections).
    return CarriedOver(Counters(**carried.counters.model_dump()), carried.last_applied_at)


def _not_restored(status_path: Path, reason: str, log: EventLogger) -> CarriedOver:
    log.warning("counters-not-restored", path=str(status_path), reason=reason, fix=_NOT_RESTORED_FIX)
    return CarriedOver(Counters())
