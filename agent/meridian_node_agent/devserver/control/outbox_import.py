"""``meridian-node-devserver import-outbox``: an air-gapped node's outbox, ingested as if it came online.

Each file is verified (``boundary.outbox.verify_outbox_record``: the node's registered key, the strict body,
the name agreeing with the body) and then goes through the same door as its online twin: an observation
through ``ControlPlane.observe`` (its epoch check refuses a fenced writer as ``stale-epoch``), a journal
summary into ``outbox_records`` beside it.

(node, sequence) is a record's identity (the node advances its counter before writing, so a number is never
used twice). The same bytes again are a ``duplicate`` and change nothing; other bytes under a used number
are refused (``sequence-reused``). An observation older than the newest one imported for its node is
recorded (``superseded``) but does not replace it. Hence an outbox copied in any order, twice or in part
loses nothing and duplicates nothing. Refusals are not recorded: the same file is refused again, the same
way, until its cause is fixed.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric import ec

from ansible_collections.meridian.node.plugins.module_utils._fileutil import (
    CappedReadError,
    CappedReadReason,
    read_capped,
)
from meridian_node_agent.boundary.outbox import (
    MAX_RECORD_BYTES,
    OutboxRecord,
    OutboxRefused,
    record_name_parts,
    verify_outbox_record,
)
from meridian_node_agent.devserver.control.plane import ControlPlane, ProtocolError
from meridian_node_agent.devserver.store.database import StoreConflict

__all__ = ["ImportResult", "import_outbox"]


@dataclass(frozen=True)
class ImportResult:
    file: str
    result: str  # imported, duplicate, superseded, refused
    node_id: str | None = None
    sequence: int | None = None
    kind: str | None = None
    reason: str | None = None
    message: str | None = None

    def as_json(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v is not None}


def import_outbox(
    control: ControlPlane, directory: Path, keys: Mapping[str, ec.EllipticCurvePublicKey]
) -> list[ImportResult]:
    """Import every ``*.json`` file in ``directory``, oldest record first within each node."""
    loaded: list[tuple[str, bytes | None, ImportResult | None]] = []
    for name in sorted(entry.name for entry in Path(directory).iterdir()):
        if name.startswith(".") or not name.endswith(".json"):
            continue  # a copy still under its temporary name, or not an outbox file at all
        data, refusal = _read(directory / name, name)
        loaded.append((name, data, refusal))
    verified: list[tuple[str, bytes, OutboxRecord]] = []
    results: list[ImportResult] = []
    for name, data, refusal in loaded:
        if refusal is not None or data is None:
            results.append(refusal or ImportResult(name, "refused"))
            continue
        try:
            verified.append((name, data, verify_outbox_record(name, data, keys)))
        except OutboxRefused as exc:
            results.append(ImportResult(name, "refused", reason=exc.reason, message=exc.message))
    verified.sort(key=lambda item: (item[2].node_id, item[2].sequence))
    results.extend(_ingest(control, name, data, record) for name, data, record in verified)
    return results


def _read(path: Path, name: str) -> tuple[bytes | None, ImportResult | None]:
    try:
        # A symlink is refused, a FIFO cannot hang the import.
        return read_capped(path, MAX_RECORD_BYTES, what="outbox record"), None
    except CappedReadError as exc:
        if exc.reason is CappedReadReason.TOO_LARGE:
            try:
                record_name_parts(name)  # the name is checked before the size, as verify_outbox_record does
            except OutboxRefused as refused:
                return None, ImportResult(name, "refused", reason=refused.reason, message=refused.message)
            reason = "too-large"
        else:
            reason = "not-a-file" if exc.reason is CappedReadReason.NOT_REGULAR else "unreadable"
        return None, ImportResult(name, "refused", reason=reason, message=str(exc))


def _ingest(control: ControlPlane, name: str, data: bytes, record: OutboxRecord) -> ImportResult:
    digest = hashlib.sha256(data).hexdigest()

    def answer(result: str, reason: str | None = None, message: str | None = None) -> ImportResult:
        return ImportResult(name, result, record.node_id, record.sequence, record.record_kind, reason, message)

    store = control.store
    known = store.outbox_record_digest(record.node_id, record.sequence)
    if known is not None:
        if known == digest:
            return answer("duplicate")
        return answer(
            "refused",
            "sequence-reused",
            f"node {record.node_id!r} record {record.sequence} was already imported with other bytes "
            f"(sha256 {known[:16]}...): a node whose counter was reset must be told the highest sequence seen",
        )
    result = "imported"
    if record.observation is not None:
        newest = store.newest_imported_observation(record.node_id)
        if newest is not None and newest > record.sequence:
            result = "superseded"
        else:
            try:
                # The node id stands in for the address the observation would have come from: an air-gapped
                # node reaches no one, and its own name is what the site's gateway resolves.
                control.observe(record.node_id, record.observation, remote_host=record.node_id)
            except ProtocolError as exc:
                if exc.reason == "stale-epoch":
                    # The online advice (heartbeat) means nothing to a node that reaches no one.
                    return answer("refused", exc.reason, _stale_outbox_record(record.node_id, record.lease_epoch))
                return answer("refused", exc.reason, exc.detail)
    try:
        store.add_outbox_record(
            record.node_id,
            record.sequence,
            kind=record.record_kind,
            sha256=digest,
            result=result,
            imported_at=datetime.now(UTC),
            body=record.model_dump_json(),
        )
    except StoreConflict as exc:
        return answer("refused", exc.reason, exc.detail)
    return answer(result)


def _stale_outbox_record(node_id: str, epoch: int) -> str:
    """Why an older epoch's observation from an outbox is not ingested, and that nothing is lost by it."""
    when = (
        "before the node applied any bundle (it knew no lease epoch yet)"
        if epoch == 0
        else "before the node applied a state of the current epoch, or by a writer fenced since"
    )
    return (
        f"the observation was written under lease epoch {epoch}, {when}, and node {node_id!r} is at a later "
        "epoch now: it is not ingested; the node's observations after its next bundle carry the current epoch"
    )
