"""The verifier: signed bytes in, a verified document or a typed ``Rejection`` out.

It does no I/O and never reads the clock: the caller passes the envelope bytes, the loaded policy, the
time and the host's applied state, so the same inputs always give the same answer and tests can replay
any attack exactly. Verification order matters and is fixed: envelope shape, payload type, signatures,
schema, then the semantic checks. Nothing in a payload is looked at before enough trusted keys signed it.

Misuse by the caller (a naive datetime, a threshold below 1) raises ``RuntimeError``, not a ``Rejection``:
that is a bug here, not bad data from outside.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum
from typing import TYPE_CHECKING, TypeVar

from ansible_collections.meridian.node.plugins.module_utils import contracts
from ansible_collections.meridian.node.plugins.module_utils.contracts import describe_validation_error
from ansible_collections.meridian.node.plugins.module_utils.dsse import PAYLOAD_TYPES, pae, require_cryptography
from ansible_collections.meridian.node.plugins.module_utils.policy import Role

try:
    from cryptography.exceptions import InvalidSignature
except ImportError:
    # dsse.require_cryptography() reports the missing package before anything here needs it.
    HAS_CRYPTOGRAPHY = False
else:
    HAS_CRYPTOGRAPHY = True

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    from ansible_collections.meridian.node.plugins.module_utils.policy import Policy

__all__ = [
    "MAX_CLOCK_SKEW",
    "AppliedState",
    "Rejection",
    "RejectionCode",
    "VerifiedBundle",
    "VerifiedEnvelope",
    "VerifiedManifest",
    "VerifiedState",
    "verify_artifact_manifest",
    "verify_bundle",
    "verify_desired_state",
    "verify_envelope",
]

# How far ahead of our clock a document's issue time may be before we call it not yet valid.
MAX_CLOCK_SKEW = timedelta(minutes=5)


class RejectionCode(StrEnum):
    MALFORMED = "malformed"
    WRONG_PAYLOAD_TYPE = "wrong-payload-type"
    THRESHOLD_NOT_MET = "threshold-not-met"
    SCHEMA = "schema"
    WRONG_NODE = "wrong-node"
    EXPIRED = "expired"
    NOT_YET_VALID = "not-yet-valid"
    REPLAYED = "replayed"
    STALE_EPOCH = "stale-epoch"


class Rejection(Exception):
    """A document was refused. ``code`` is for programs, ``message`` for people (with the values)."""

    def __init__(self, code: RejectionCode, message: str) -> None:
        super().__init__(f"{code.value}: {message}")
        self.code = code
        self.message = message


@dataclass(frozen=True)
class AppliedState:
    """What the host has durably recorded: highest generation applied, highest lease epoch seen."""

    generation: int = 0
    epoch: int = 0
    payload_sha256: str | None = None


@dataclass(frozen=True)
class VerifiedEnvelope:
    body: bytes
    signers: tuple[str, ...]


@dataclass(frozen=True)
class VerifiedState:
    state: contracts.DesiredState
    signers: tuple[str, ...]
    payload_sha256: str
    already_applied: bool


@dataclass(frozen=True)
class VerifiedManifest:
    manifest: contracts.ArtifactManifest
    signers: tuple[str, ...]
    payload_sha256: str


@dataclass(frozen=True)
class VerifiedBundle:
    bundle: contracts.Bundle
    signers: tuple[str, ...]
    payload_sha256: str
    desired: VerifiedState


def verify_envelope(
    data: bytes,
    *,
    payload_type: str,
    keys: Mapping[str, Ed25519PublicKey],
    threshold: int,
    role: str = "trusted",
) -> VerifiedEnvelope:
    """Check a DSSE envelope's shape, type and signatures; return the body it vouches for.

    A signature counts when its keyid names a key in ``keys`` and it verifies against that key over
    ``PAE(payloadType, body)``. Each trusted key counts once however often it signs. Signatures with
    unknown keyids are ignored, as is a signature that is not valid base64 (it cannot verify). ``role``
    only words the message.
    """
    require_cryptography()
    contracts.require_pydantic()
    if threshold < 1:
        raise RuntimeError(f"verify_envelope: threshold must be >= 1 (got {threshold}); 0 would accept anything")
    try:
        envelope = contracts.Envelope.model_validate_json(data)
    except contracts.ValidationError as exc:
        raise Rejection(RejectionCode.MALFORMED, f"not a DSSE envelope: {describe_validation_error(exc)}") from exc
    try:
        body = base64.b64decode(envelope.payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise Rejection(RejectionCode.MALFORMED, f"the envelope's payload is not valid base64: {exc}") from exc
    if envelope.payloadType != payload_type:
        raise Rejection(
            RejectionCode.WRONG_PAYLOAD_TYPE,
            f"payload type is {envelope.payloadType!r}, expected {payload_type!r}",
        )

    message = pae(envelope.payloadType, body)
    signers: list[str] = []
    unknown = invalid = 0
    for signature in envelope.signatures:
        key = keys.get(signature.keyid)
        if key is None:
            unknown += 1
            continue
        if signature.keyid in signers:
            continue
        try:
            key.verify(base64.b64decode(signature.sig, validate=True), message)
        except (InvalidSignature, binascii.Error, ValueError):
            invalid += 1
            continue
        signers.append(signature.keyid)
    if len(signers) < threshold:
        raise Rejection(
            RejectionCode.THRESHOLD_NOT_MET,
            f"{threshold} distinct {role} key(s) must sign this document, {len(signers)} did "
            f"({len(envelope.signatures)} signature(s): {unknown} by keys the policy does not trust for "
            f"this role, {invalid} not valid for the key they name)",
        )
    return VerifiedEnvelope(body=body, signers=tuple(signers))


def verify_desired_state(
    data: bytes, policy: Policy, *, node_id: str, now: datetime, applied: AppliedState
) -> VerifiedState:
    """Verify a desired-state envelope for this node against the host's applied state.

    Rejections after the signature check, in order: ``schema``, ``wrong-node``, ``expired``,
    ``not-yet-valid``, ``replayed`` (lower generation, or the applied generation with different
    content), ``stale-epoch``. Only a state passing all of them can be ``already_applied`` (same
    generation, same bytes): a re-delivery, which the caller turns into a no-op.
    """
    _require_aware(now)
    envelope = _verify_role(data, policy, "desired-state", "control")
    state = _parse(contracts.DesiredState, envelope.body, "desired state")
    digest = hashlib.sha256(envelope.body).hexdigest()

    if state.node_id != node_id:
        raise Rejection(
            RejectionCode.WRONG_NODE, f"desired state is for node {state.node_id!r}, this node is {node_id!r}"
        )
    if state.expires_at <= now:
        raise Rejection(
            RejectionCode.EXPIRED,
            f"desired state generation {state.generation} expired at "
            f"{contracts.format_rfc3339(state.expires_at)} (now {contracts.format_rfc3339(now)})",
        )
    _check_not_future(state.issued_at, now, f"desired state generation {state.generation}")
    if state.generation < applied.generation:
        raise Rejection(
            RejectionCode.REPLAYED,
            f"generation {state.generation} is lower than the applied generation {applied.generation}: "
            "a replayed or rolled-back state",
        )
    already_applied = state.generation == applied.generation
    if already_applied and digest != applied.payload_sha256:
        raise Rejection(
            RejectionCode.REPLAYED,
            f"generation {state.generation} was already applied with different content (sha256 "
            f"{applied.payload_sha256}, this one {digest}): a generation is never reused",
        )
    if state.lease_epoch < applied.epoch:
        raise Rejection(
            RejectionCode.STALE_EPOCH,
            f"lease epoch {state.lease_epoch} is lower than the highest epoch seen ({applied.epoch}): "
            "issued by a deposed control-plane leader",
        )
    return VerifiedState(state=state, signers=envelope.signers, payload_sha256=digest, already_applied=already_applied)


def verify_artifact_manifest(data: bytes, policy: Policy) -> VerifiedManifest:
    """Verify an artifact manifest signed by the policy's artifact keys."""
    envelope = _verify_role(data, policy, "artifact-manifest", "artifact")
    manifest = _parse(contracts.ArtifactManifest, envelope.body, "artifact manifest")
    return VerifiedManifest(
        manifest=manifest, signers=envelope.signers, payload_sha256=hashlib.sha256(envelope.body).hexdigest()
    )


def verify_bundle(data: bytes, policy: Policy, *, node_id: str, now: datetime, applied: AppliedState) -> VerifiedBundle:
    """Verify an air-gap bundle (air_gap_authority keys) and the desired state inside it (control keys).

    Both signatures are required: the authority vouches for the delivery, the control keys for the
    state, so a stolen authority key alone cannot invent a desired state.
    """
    _require_aware(now)
    envelope = _verify_role(data, policy, "bundle", "air_gap_authority")
    bundle = _parse(contracts.Bundle, envelope.body, "bundle")
    if bundle.node_id != node_id:
        raise Rejection(
            RejectionCode.WRONG_NODE,
            f"bundle {bundle.bundle_id!r} is for node {bundle.node_id!r}, this node is {node_id!r}",
        )
    _check_not_future(bundle.created_at, now, f"bundle {bundle.bundle_id!r}")
    desired = verify_desired_state(
        bundle.desired_state.model_dump_json().encode("utf-8"), policy, node_id=node_id, now=now, applied=applied
    )
    return VerifiedBundle(
        bundle=bundle,
        signers=envelope.signers,
        payload_sha256=hashlib.sha256(envelope.body).hexdigest(),
        desired=desired,
    )


def _verify_role(data: bytes, policy: Policy, kind: str, role: Role) -> VerifiedEnvelope:
    return verify_envelope(
        data,
        payload_type=PAYLOAD_TYPES[kind],
        keys=policy.trusted_keys(role),
        threshold=policy.threshold(role),
        role=role,
    )


_Document = TypeVar("_Document", contracts.DesiredState, contracts.ArtifactManifest, contracts.Bundle)


def _parse(model: type[_Document], body: bytes, what: str) -> _Document:
    contracts.require_pydantic()
    try:
        return model.model_validate_json(body)
    except contracts.ValidationError as exc:
        raise Rejection(
            RejectionCode.SCHEMA, f"signed {what} does not match the schema: {describe_validation_error(exc)}"
        ) from exc


def _check_not_future(issued: datetime, now: datetime, what: str) -> None:
    if issued > now + MAX_CLOCK_SKEW:
        raise Rejection(
            RejectionCode.NOT_YET_VALID,
            f"{what} was issued at {contracts.format_rfc3339(issued)}, more than "
            f"{int(MAX_CLOCK_SKEW.total_seconds() // 60)} minutes after now ({contracts.format_rfc3339(now)}): "
            "check this host's clock",
        )


def _require_aware(now: datetime) -> None:
    if now.tzinfo is None or now.utcoffset() is None:
        raise RuntimeError("the verifier needs an aware datetime for 'now' (e.g. datetime.now(timezone.utc))")
