"""The two files that cross the privilege boundary, and where each side keeps its own.

Runs on: both sides. The agent side (``agent_side.systemd_applier``) writes the request and reads the answer; the
root side
(``root_side.root_dir``, ``root_side.apply_unit``) reads the request and writes the answer. Nothing else crosses.

    <state_dir>/spool/apply-request.json        agent -> root (the agent's directory, mode 0600): the run
                                                ident the agent chose, the envelope, byte for byte, and the
                                                GPUs the agent's XID watch holds unhealthy (``gpu_reports``)
    <apply.state_dir>/public/apply-result.json  root -> agent (root's directory, ``public/`` is 0750 root,
                                                group of the agent): the answer to one request
    <apply.state_dir>/public/engines.json       root -> agent: the engines root manages (``boundary.engines_file``),
                                                written by the apply unit when it answers and by the
                                                read-only observe unit on root's timer (``root_side.observe_unit``)

Both files are written to a temporary name, fsync'd and renamed into place, so the other side never reads
half a file. Root reads the request once, from a file it checks is a regular file the agent owns
(``root_side.root_dir.read_request``); the agent parses the answer as strictly as root parses the request.

``gpu_reports`` relays what only the agent can see: NVML delivers an XID only to an event set registered before it
happened, and root's units are fresh processes, so under the split an XID (79, 74, 119, ...) reaches the agent's
watch alone. Root records each report as a held verdict only after it verified the envelope, only ever adding to
its holds (``root_side.gpu_reports``); the list is bounded (``MAX_GPU_REPORTS`` GPUs, ``MAX_REPORTED_XIDS`` XIDs
each), and optional, so a request written before it existed still parses.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Annotated, Literal, TypeVar

from pydantic import Field, ValidationError

from ansible_collections.meridian.node.plugins.module_utils._errors import MeridianError
from ansible_collections.meridian.node.plugins.module_utils._fileutil import read_if_present
from ansible_collections.meridian.node.plugins.module_utils.contracts import (
    FormatOne,
    StrictModel,
    UtcTimestamp,
    describe_validation_error,
    format_rfc3339,
)

__all__ = [
    "ANSWER_MODE",
    "GPU_UUID_PATTERN",
    "MAX_GPU_REPORTS",
    "MAX_REPORTED_XIDS",
    "MAX_REQUEST_BYTES",
    "PUBLIC_DIR",
    "REQUEST_FILE",
    "REQUEST_MODE",
    "RESULT_FILE",
    "SPOOL_DIR",
    "ApplyAnswer",
    "ApplyRequest",
    "GpuReport",
    "SpoolError",
    "parse_answer",
    "parse_request",
    "read_answer_file",
]

SPOOL_DIR = "spool"
REQUEST_FILE = "apply-request.json"
PUBLIC_DIR = "public"
RESULT_FILE = "apply-result.json"
# A desired state is kilobytes; anything near this is not one, and root does not read unbounded input.
MAX_REQUEST_BYTES = 8 * 1024 * 1024
# Requests are private to the agent (and root); answers carry only counts and messages the agent shows.
REQUEST_MODE = 0o600
ANSWER_MODE = 0o640


# The run ident the agent chooses and root's journal directory is named by: ``gen-<N>-<UTC time>``.
RUN_IDENT_PATTERN = r"^gen-[0-9]{1,19}-[0-9]{8}T[0-9]{6}\.[0-9]{6}Z$"
# A whole GPU as NVML names it (nvmlDeviceGetUUID). Not a MIG device: root holds verdicts per GPU, and an XID
# scoped to one MIG device degrades its GPU without making it unhealthy (gpu.health_rules), so none is relayed.
GPU_UUID_PATTERN = r"^GPU-[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$"
# More GPUs than any host has, and XIDs per GPU than one fault raises: what a report may carry at most.
MAX_GPU_REPORTS = 64
MAX_REPORTED_XIDS = 16


@dataclass
class ApplyResult:
    ident: str
    generation: int
    status: str  # ansible-runner's: successful, failed, canceled, timeout
    rc: int | None
    changed: int
    failed: int
    journal: Path
    started_at: datetime
    finished_at: datetime
    wall_s: float  # the answer's ``wall_seconds``
    failures: list[str] = field(default_factory=list)
    fetched_bytes: int = 0  # what verified_artifact brought into the store (the agent's metrics)
    image_bytes: int = 0  # what the engine modules pulled of engine images (the agent's metrics)

    @property
    def ok(self) -> bool:
        return self.status == "successful"

    @classmethod
    def not_run(cls, generation: int, started_at: datetime, finished_at: datetime, why: str) -> ApplyResult:
        """A failed apply whose playbook never ran: no journal, nothing changed, ``why`` as its one failure."""
        return cls(
            ident="",
            generation=generation,
            status="failed",
            rc=None,
            changed=0,
            failed=0,
            journal=Path(),
            started_at=started_at,
            finished_at=finished_at,
            wall_s=0.0,
            failures=[why],
        )


class SpoolError(MeridianError, ValueError):
    """A request or answer file is unreadable or malformed; the message names the file and the field."""


class GpuReport(StrictModel):
    """A GPU the agent's XID watch holds unhealthy by critical XIDs: its uuid, those XIDs, and when the agent
    first saw the verdict (the earliest of those XIDs still in its window, else the verdict's ``since``)."""

    uuid: Annotated[str, Field(pattern=GPU_UUID_PATTERN)]
    xids: Annotated[list[Annotated[int, Field(ge=0, le=2**31 - 1)]], Field(min_length=1, max_length=MAX_REPORTED_XIDS)]
    seen_at: UtcTimestamp


class ApplyRequest(StrictModel):
    format: FormatOne = 1
    request: Annotated[str, Field(pattern=RUN_IDENT_PATTERN)]
    envelope: str  # base64 of the envelope bytes: the signature covers exact bytes, JSON re-encoding would not
    # The agent's word, never the signed state's: root may only add holds from it (root_side.gpu_reports).
    gpu_reports: Annotated[list[GpuReport], Field(max_length=MAX_GPU_REPORTS)] = Field(default_factory=list)

    def envelope_bytes(self) -> bytes:
        try:
            return base64.b64decode(self.envelope, validate=True)
        except ValueError as exc:
            raise SpoolError(f"request {self.request}: envelope is not valid base64: {exc}") from exc


Status = Literal["successful", "failed", "canceled", "timeout"]


class ApplyAnswer(StrictModel):
    format: FormatOne = 1
    request: Annotated[str, Field(pattern=RUN_IDENT_PATTERN)]
    payload_sha256: Annotated[str, Field(pattern=r"^([0-9a-f]{64})?$")]  # empty when the envelope was refused
    generation: Annotated[int, Field(ge=0, le=2**63 - 1)]
    # The lease epoch root decided the apply under (the state's own): the agent records it with the generation.
    epoch: Annotated[int, Field(ge=0, le=2**63 - 1)] = 0
    status: Status
    rc: int | None
    changed: Annotated[int, Field(ge=0)]
    failed: Annotated[int, Field(ge=0)]
    failures: list[str]
    journal: str
    started_at: str
    finished_at: str
    wall_seconds: Annotated[float, Field(ge=0)]
    # A default, so that an answer of the release before (an apply in flight across an upgrade) still reads.
    fetched_bytes: Annotated[int, Field(ge=0, le=2**63 - 1)] = 0
    image_bytes: Annotated[int, Field(ge=0, le=2**63 - 1)] = 0

    def to_result(self) -> ApplyResult:
        return ApplyResult(
            ident=self.request,
            generation=self.generation,
            status=self.status,
            rc=self.rc,
            changed=self.changed,
            failed=self.failed,
            journal=Path(self.journal),
            started_at=datetime.fromisoformat(self.started_at),
            finished_at=datetime.fromisoformat(self.finished_at),
            wall_s=self.wall_seconds,
            failures=list(self.failures),
            fetched_bytes=self.fetched_bytes,
            image_bytes=self.image_bytes,
        )

    @classmethod
    def from_result(cls, result: ApplyResult, payload_sha256: str, epoch: int) -> ApplyAnswer:
        return cls(
            request=result.ident,
            payload_sha256=payload_sha256,
            generation=result.generation,
            epoch=epoch,
            status=_STATUSES.get(result.status, "failed"),
            rc=result.rc,
            changed=result.changed,
            failed=result.failed,
            failures=list(result.failures),
            journal=str(result.journal),
            started_at=format_rfc3339(result.started_at),
            finished_at=format_rfc3339(result.finished_at),
            wall_seconds=result.wall_s,
            fetched_bytes=result.fetched_bytes,
            image_bytes=result.image_bytes,
        )


_STATUSES: dict[str, Status] = {"successful": "successful", "canceled": "canceled", "timeout": "timeout"}

_Model = TypeVar("_Model", ApplyRequest, ApplyAnswer)


def parse_request(raw: bytes, where: Path) -> ApplyRequest:
    return _parse(ApplyRequest, raw, where)


def parse_answer(raw: bytes, where: Path) -> ApplyAnswer:
    return _parse(ApplyAnswer, raw, where)


def read_answer_file(public: Path) -> ApplyAnswer | None:
    """The answer in root's ``public/`` directory, or None when there is none yet (agent side)."""
    path = public / RESULT_FILE
    raw = read_if_present(path, MAX_REQUEST_BYTES, what="root's apply answer", error=SpoolError)
    return None if raw is None else parse_answer(raw, path)


def _parse(model: type[_Model], raw: bytes, path: Path) -> _Model:
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise SpoolError(f"{path}: {describe_validation_error(exc)}") from exc
