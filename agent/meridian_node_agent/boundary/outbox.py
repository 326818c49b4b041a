"""The air-gapped node's outbox: observations and journal summaries as files signed by the node.

Runs on: both sides of the air gap: the agent (``Outbox``, writing) and the control plane (``verify_outbox_record``,
reading in
``meridian-node-devserver import-outbox``). Format and rules: docs/AIR_GAP.md, "The outbox".

Each file is one DSSE envelope whose body is an ``OutboxRecord``, named ``<node>-<sequence>-<kind>.json``.
The sequence is advanced durably *before* the file is written, so a crash can skip a number but never use
one twice: the importer can then treat (node, sequence) as the identity of a record, and a copy that
arrives twice, late or out of order is recognised for what it is.

Signed with the node's EC P-256 key (``identity/node.key.pem``, the key enrollment uses): DSSE leaves the
algorithm to the signer, and the node has no Ed25519 key. The keyid is the hex sha256 of the DER
SubjectPublicKeyInfo.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any, Literal

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from pydantic import Field, ValidationError, model_validator

from ansible_collections.meridian.node.plugins.module_utils import contracts
from ansible_collections.meridian.node.plugins.module_utils._errors import MeridianError
from ansible_collections.meridian.node.plugins.module_utils._fileutil import atomic_write
from ansible_collections.meridian.node.plugins.module_utils.contracts import (
    NodeId,
    Observation,
    StrictModel,
    UtcTimestamp,
    describe_validation_error,
    format_rfc3339,
)
from ansible_collections.meridian.node.plugins.module_utils.trust import dsse

__all__ = [
    "MAX_RECORD_BYTES",
    "OUTBOX_PAYLOAD_TYPE",
    "JournalSummary",
    "Outbox",
    "OutboxRecord",
    "OutboxRefused",
    "keyid_of",
    "load_node_public_key",
    "record_name",
    "record_name_parts",
    "verify_outbox_record",
]

OUTBOX_PAYLOAD_TYPE = "application/vnd.meridian.outbox-record.v1+json"
# An observation of a host with many engines and artifacts is tens of kilobytes.
MAX_RECORD_BYTES = 4 * 1024 * 1024
_SEQUENCE_FILE = "outbox.sequence"
_NAME = re.compile(r"^(?P<node>[a-z0-9][a-z0-9.-]{0,252})-(?P<sequence>[0-9]{12})-(?P<kind>observation|journal)\.json$")
Kind = Literal["observation", "journal"]


class OutboxRefused(MeridianError):
    """An outbox file was refused; ``reason`` is a short code, the message names the file and the fix."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.message = message


class JournalSummary(StrictModel):
    ident: str
    generation: Annotated[int, Field(ge=0)]
    bundle_id: str | None = None
    status: Literal["successful", "failed", "canceled", "timeout"]
    changed: Annotated[int, Field(ge=0)]
    failed: Annotated[int, Field(ge=0)]
    failures: Annotated[list[str], Field(max_length=5)] = Field(default_factory=list)
    started_at: UtcTimestamp
    finished_at: UtcTimestamp


class OutboxRecord(StrictModel):
    apiVersion: Literal["meridian.node/v1"]
    kind: Literal["OutboxRecord"]
    node_id: NodeId
    sequence: Annotated[int, Field(ge=1, le=10**12 - 1)]
    record_kind: Kind
    lease_epoch: Annotated[int, Field(ge=0)]
    created_at: UtcTimestamp
    observation: Observation | None = None
    journal: JournalSummary | None = None

    @model_validator(mode="after")
    def _one_content(self) -> OutboxRecord:
        carried = [name for name in ("observation", "journal") if getattr(self, name) is not None]
        if carried != [self.record_kind]:
            raise ValueError(
                f"record_kind {self.record_kind!r} needs exactly the field {self.record_kind!r} beside it; this "
                f"record carries {carried}"
            )
        if self.observation is not None and self.observation.node_id != self.node_id:
            raise ValueError(f"the observation is about node {self.observation.node_id!r}, the record {self.node_id!r}")
        return self


def record_name(node_id: str, sequence: int, kind: str) -> str:
    return f"{node_id}-{sequence:012d}-{kind}.json"


def keyid_of(public_key: ec.EllipticCurvePublicKey) -> str:
    der = public_key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return hashlib.sha256(der).hexdigest()


def load_node_public_key(data: bytes, where: str) -> ec.EllipticCurvePublicKey:
    """A node's public key from PEM: the SubjectPublicKeyInfo, or the node's certificate."""
    try:
        if b"BEGIN CERTIFICATE" in data:
            from cryptography import x509

            key: Any = x509.load_pem_x509_certificate(data).public_key()
        else:
            key = serialization.load_pem_public_key(data)
    except ValueError as exc:
        raise ValueError(f"{where} is not a PEM public key or certificate: {exc}") from None
    if not isinstance(key, ec.EllipticCurvePublicKey) or not isinstance(key.curve, ec.SECP256R1):
        raise ValueError(f"{where} holds a {type(key).__name__}; a node key is EC P-256 (identity/node.key.pem)")
    return key


class Outbox:
    """Writes signed records into ``directory``; the sequence counter lives in ``state_dir``."""

    def __init__(self, directory: Path, state_dir: Path, node_id: str, key: ec.EllipticCurvePrivateKey) -> None:
        self.directory = Path(directory)
        self.counter = Path(state_dir) / _SEQUENCE_FILE
        self.node_id = node_id
        self.key = key
        self.keyid = keyid_of(key.public_key())

    def last_sequence(self) -> int | None:
        """The last sequence number used, or None before the first record (or when the counter is damaged:
        ``next_sequence`` says so when a record is written)."""
        try:
            text = self.counter.read_text()
        except FileNotFoundError:
            return None
        return int(text) if re.fullmatch(r"[0-9]{1,12}\n", text) else None

    def next_sequence(self) -> int:
        """Advance the durable counter and return the new number (fsync'd before any file uses it)."""
        try:
            text = self.counter.read_text()
        except FileNotFoundError:
            last = 0
        else:
            if not re.fullmatch(r"[0-9]{1,12}\n", text):
                # Never reset: a counter that starts over would reuse numbers the far side has seen.
                raise ValueError(
                    f"{self.counter} is damaged ({text[:40]!r}); set it to the highest sequence in the outbox "
                    "and the far side's imports, then restart"
                )
            last = int(text)
        sequence = last + 1
        self.counter.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        atomic_write(self.counter, f"{sequence}\n".encode(), mode=0o600)
        return sequence

    def write(
        self,
        kind: Kind,
        content: Observation | JournalSummary,
        *,
        epoch: int,
        now: datetime,
    ) -> Path:
        sequence = self.next_sequence()
        record = OutboxRecord.model_validate(
            {
                "apiVersion": "meridian.node/v1",
                "kind": "OutboxRecord",
                "node_id": self.node_id,
                "sequence": sequence,
                "record_kind": kind,
                "lease_epoch": epoch,
                "created_at": format_rfc3339(now),
                kind: content.model_dump(mode="json"),
            }
        )
        # Not exclude_none: some contract fields are required and nullable (an engine without a port).
        body = json.dumps(record.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
        data = body.encode("utf-8")
        signature = self.key.sign(dsse.pae(OUTBOX_PAYLOAD_TYPE, data), ec.ECDSA(hashes.SHA256()))
        envelope = {
            "payloadType": OUTBOX_PAYLOAD_TYPE,
            "payload": base64.b64encode(data).decode("ascii"),
            "signatures": [{"keyid": self.keyid, "sig": base64.b64encode(signature).decode("ascii")}],
        }
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o750)
        path = self.directory / record_name(self.node_id, sequence, kind)
        # atomic_write: temp name in the same directory, fsync, rename: a copier sees whole files only.
        atomic_write(path, json.dumps(envelope, separators=(",", ":")).encode() + b"\n", mode=0o640)
        return path


def record_name_parts(name: str) -> tuple[str, int, str]:
    """``(node, sequence, kind)`` as outbox file name ``name`` says them; ``OutboxRefused`` (``bad-name``)
    when it is not one. The first of ``verify_outbox_record``'s checks, and the only one that needs no bytes."""
    match = _NAME.match(name)
    if match is None:
        raise OutboxRefused(
            "bad-name", f"{name!r} is not <node>-<12-digit sequence>-<observation|journal>.json: not an outbox file"
        )
    return match["node"], int(match["sequence"]), match["kind"]


def verify_outbox_record(name: str, data: bytes, keys: Mapping[str, ec.EllipticCurvePublicKey]) -> OutboxRecord:
    """The record in file ``name`` holding ``data``, signed by its node's key in ``keys`` (node id -> key).

    Checks, in order: the name's shape, the size, the envelope, its payload type, a signature by that node's
    key (others are ignored), the strict body, and that the body says what the name says.
    """
    node, sequence, kind = record_name_parts(name)
    if len(data) > MAX_RECORD_BYTES:
        raise OutboxRefused("too-large", f"{name} is {len(data)} bytes, more than {MAX_RECORD_BYTES}")
    key = keys.get(node)
    if key is None:
        raise OutboxRefused(
            "unknown-node-key",
            f"{name} is from node {node!r}, whose key was not given: pass --node-key {node}=PUBLIC.pem "
            "(the output of 'meridian-node outbox-key' on that node)",
        )
    try:
        envelope = contracts.parse_document(contracts.Envelope, data)
    except (contracts.JsonError, ValidationError) as exc:
        raise OutboxRefused("malformed", f"{name} is not a DSSE envelope: {exc}") from None
    if envelope.payloadType != OUTBOX_PAYLOAD_TYPE:
        raise OutboxRefused(
            "wrong-payload-type", f"{name} has payload type {envelope.payloadType!r}, not {OUTBOX_PAYLOAD_TYPE!r}"
        )
    body = base64.b64decode(envelope.payload)
    keyid = keyid_of(key)
    message = dsse.pae(OUTBOX_PAYLOAD_TYPE, body)
    for signature in envelope.signatures:
        if signature.keyid != keyid:
            continue
        try:
            key.verify(base64.b64decode(signature.sig), message, ec.ECDSA(hashes.SHA256()))
        except InvalidSignature:
            continue
        break
    else:
        raise OutboxRefused(
            "bad-signature",
            f"{name} carries no valid signature by node {node!r}'s key {keyid[:16]}...: altered, or signed by "
            "another key (a re-created node key must be registered again)",
        )
    try:
        record = contracts.parse_document(OutboxRecord, body)
    except (contracts.JsonError, ValidationError) as exc:
        detail = describe_validation_error(exc) if isinstance(exc, ValidationError) else str(exc)
        raise OutboxRefused("schema", f"{name}: the signed record is invalid: {detail}") from None
    named = (node, sequence, kind)
    if (record.node_id, record.sequence, record.record_kind) != named:
        raise OutboxRefused(
            "name-mismatch",
            f"{name} names ({node}, {named[1]}, {named[2]}) but the signed record is ({record.node_id}, "
            f"{record.sequence}, {record.record_kind}): a renamed file is not imported",
        )
    return record


def body_sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def write_public_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    pem = key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    atomic_write(path, pem, mode=0o644)
