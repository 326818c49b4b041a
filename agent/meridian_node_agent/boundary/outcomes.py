"""``<apply.state_dir>/public/airgap-outcomes.json``: the one file root's inbox unit hands the agent.

Runs on: both sides. Root's inbox unit writes it (``root_side.inbox_unit.publish_outcomes``); the air-gapped
agent reads it (``read_outcomes``), strictly: unknown fields, wrong types, another node or an oversize file
refuse the whole file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, ValidationError

from ansible_collections.meridian.node.plugins.module_utils._errors import MeridianError
from ansible_collections.meridian.node.plugins.module_utils._fileutil import read_if_present
from ansible_collections.meridian.node.plugins.module_utils.contracts import (
    FormatOne,
    NodeId,
    StrictModel,
    describe_validation_error,
)

__all__ = [
    "MAX_OUTCOMES",
    "MAX_OUTCOMES_BYTES",
    "OUTCOMES_FILE",
    "OUTCOMES_MODE",
    "OutcomesError",
    "RootAccepted",
    "RootApplied",
    "RootOutcome",
    "RootOutcomes",
    "RootRun",
    "parse_outcomes",
    "read_outcomes",
]

OUTCOMES_FILE = "airgap-outcomes.json"
OUTCOMES_MODE = 0o640
# The agent journals each outcome once it has read it; a file of the last hundred covers a long absence
# of the agent (it was stopped while many bundles arrived) and stays a few hundred kilobytes at most.
MAX_OUTCOMES = 100
MAX_OUTCOMES_BYTES = 1024 * 1024

_Text = Annotated[str, Field(max_length=4096)]


class OutcomesError(MeridianError, ValueError):
    """``airgap-outcomes.json`` is unusable; the message names the file, the field and what is wrong."""


class RootRun(StrictModel):
    ident: Annotated[str, Field(pattern=r"^gen-[0-9]{1,19}-[0-9]{8}T[0-9]{6}\.[0-9]{6}Z$")]
    generation: Annotated[int, Field(ge=0, le=2**63 - 1)]
    status: Literal["successful", "failed", "canceled", "timeout"]
    changed: Annotated[int, Field(ge=0)]
    failed: Annotated[int, Field(ge=0)]
    failures: Annotated[list[_Text], Field(max_length=5)]
    started_at: Annotated[str, Field(max_length=64)]
    finished_at: Annotated[str, Field(max_length=64)]


class RootOutcome(StrictModel):
    sequence: Annotated[int, Field(ge=1, le=2**63 - 1)]
    name: Annotated[str, Field(min_length=1, max_length=255)]
    result: Literal["applied", "already-applied", "apply-failed", "rejected"]
    reason: Annotated[str, Field(max_length=64)] | None
    message: _Text | None
    member: _Text | None
    bundle_id: Annotated[str, Field(max_length=255)] | None
    generation: Annotated[int, Field(ge=0, le=2**63 - 1)] | None
    at: Annotated[str, Field(max_length=64)]
    run: RootRun | None


class RootAccepted(StrictModel):
    """The generation root accepted (its apply started) and has not recorded applied: failed, cut short or
    still running. Nothing below it is applied any more."""

    generation: Annotated[int, Field(ge=1, le=2**63 - 1)]
    epoch: Annotated[int, Field(ge=0, le=2**63 - 1)]


class RootApplied(StrictModel):
    generation: Annotated[int, Field(ge=0, le=2**63 - 1)]
    epoch: Annotated[int, Field(ge=0, le=2**63 - 1)]
    # Absent in files written before root recorded its decisions.
    accepted: RootAccepted | None = None


class RootOutcomes(StrictModel):
    format: FormatOne
    node_id: NodeId
    written_at: Annotated[str, Field(max_length=64)]
    applied: RootApplied
    outcomes: Annotated[list[RootOutcome], Field(max_length=MAX_OUTCOMES)]


def parse_outcomes(raw: bytes, *, path: Path, node_id: str) -> RootOutcomes:
    """The document in ``raw`` (read from ``path``), for ``node_id``; ``OutcomesError`` naming what is wrong."""
    try:
        document = RootOutcomes.model_validate_json(raw)
    except ValidationError as exc:
        raise OutcomesError(f"{path}: {describe_validation_error(exc)}") from exc
    if document.node_id != node_id:
        raise OutcomesError(f"{path} was written for node {document.node_id!r}, not this node {node_id!r}")
    accepted = document.applied.accepted
    if accepted is not None and accepted.generation <= document.applied.generation:
        raise OutcomesError(
            f"{path}: applied.accepted.generation {accepted.generation} must be above applied.generation "
            f"{document.applied.generation} (root lists only a generation accepted and not yet applied)"
        )
    sequences = [outcome.sequence for outcome in document.outcomes]
    if sequences != sorted(set(sequences)):
        raise OutcomesError(f"{path}: the outcomes' sequence numbers must increase strictly, got {sequences}")
    return document


def read_outcomes(public: Path, *, node_id: str) -> RootOutcomes | None:
    """``public/airgap-outcomes.json`` (agent side, and root reading its own), or None when there is none yet."""
    path = Path(public) / OUTCOMES_FILE
    raw = read_if_present(path, MAX_OUTCOMES_BYTES, what="root's air-gap outcomes", error=OutcomesError)
    return None if raw is None else parse_outcomes(raw, path=path, node_id=node_id)
