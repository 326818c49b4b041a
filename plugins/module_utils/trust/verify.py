"""The verifier: signed bytes in, a verified document or a typed ``Rejection`` out.

It does no I/O and never reads the clock: the caller passes the envelope bytes, the loaded policy, the
time and the host's applied state, so the same inputs always give the same answer and tests can replay
any attack exactly. Verification order matters and is fixed: envelope JSON, signature count, envelope
shape, payload type, signatures, schema, then the semantic checks. Nothing in a payload is looked at
before enough trusted keys signed it.

Each input has one reading: envelopes and bodies are read by ``contracts.read_json`` (duplicate keys
refused) into the strict models (no coercion, RFC 3339 times, canonical base64 only), so what the host
verified is what every other reader of the same bytes sees. The cost of refusing is bounded before any
cryptography: an envelope carries at most ``signature_limit`` signatures, and each trusted key is tried
once however often it is named.

Misuse by the caller (a naive datetime, a threshold below 1) raises ``RuntimeError``, not a ``Rejection``:
that is a bug here, not bad data from outside.
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, TypeVar

from ansible_collections.meridian.node.plugins.module_utils import contracts
from ansible_collections.meridian.node.plugins.module_utils._compat import StrEnum
from ansible_collections.meridian.node.plugins.module_utils._errors import MeridianError
from ansible_collections.meridian.node.plugins.module_utils._strict_yaml import YAML_IMPORT_ERROR
from ansible_collections.meridian.node.plugins.module_utils.contracts import describe_validation_error
from ansible_collections.meridian.node.plugins.module_utils.trust import dsse
from ansible_collections.meridian.node.plugins.module_utils.trust.dsse import PAYLOAD_TYPES, pae, require_cryptography
from ansible_collections.meridian.node.plugins.module_utils.trust.policy import Role, format_duration

try:
    from cryptography.exceptions import InvalidSignature
except ImportError:
    # dsse.require_cryptography() reports the missing package before anything here needs it.
    HAS_CRYPTOGRAPHY = False
else:
    HAS_CRYPTOGRAPHY = True

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    from ansible_collections.meridian.node.plugins.module_utils.trust.policy import Policy

__all__ = [
    "MAX_CLOCK_SKEW",
    "SIGNATURES_PER_KEY",
    "AcceptedState",
    "AppliedState",
    "Rejection",
    "RejectionCode",
    "VerifiedBundle",
    "VerifiedEnvelope",
    "VerifiedManifest",
    "VerifiedState",
    "missing_libraries",
    "signature_limit",
    "verify_artifact_manifest",
    "verify_bundle",
    "verify_desired_state",
    "verify_envelope",
]

# How far ahead of our clock a document's issue time may be before we call it not yet valid.
MAX_CLOCK_SKEW = timedelta(minutes=5)

# Signatures an envelope may carry per trusted key of the role (room for other hosts' keys beside ours),
# capped at ``contracts.MAX_SIGNATURES`` whatever the policy.
SIGNATURES_PER_KEY = 4


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


class Rejection(MeridianError):
    """A document was refused. ``code`` is for programs, ``message`` for people (with the values)."""

    def __init__(self, code: RejectionCode, message: str) -> None:
        super().__init__(f"{code.value}: {message}")
        self.code = code
        self.message = message


@dataclass(frozen=True)
class AcceptedState:
    """A generation the host decided to apply, recorded before its apply started: from then on it is the
    floor, whether that apply succeeded, failed, hung or was killed."""

    generation: int
    epoch: int
    payload_sha256: str


@dataclass(frozen=True)
class AppliedState:
    """What the host has durably recorded: highest generation applied, highest lease epoch seen, and the
    generation accepted beyond the applied one (``accepted``; None when the last one accepted is applied)."""

    generation: int = 0
    epoch: int = 0
    payload_sha256: str | None = None
    accepted: AcceptedState | None = None

    @property
    def accepted_generation(self) -> int:
        """The floor: nothing below it is applied again."""
        return self.generation if self.accepted is None else max(self.generation, self.accepted.generation)


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


def missing_libraries() -> list[tuple[str, str]]:
    """(package, import traceback) for each library that checking signed documents needs and that did not
    import on this host: a module reports them with ``missing_required_lib`` before it reads anything."""
    found = (
        ("pydantic", contracts.PYDANTIC_IMPORT_ERROR),
        ("cryptography", dsse.CRYPTOGRAPHY_IMPORT_ERROR),
        ("PyYAML", YAML_IMPORT_ERROR),
    )
    return [(package, error) for package, error in found if error is not None]


def signature_limit(trusted_keys: int, threshold: int) -> int:
    """How many signatures an envelope for a role with ``trusted_keys`` keys may carry before it is refused
    unread: ``SIGNATURES_PER_KEY`` per key (at least one key's worth), at most ``contracts.MAX_SIGNATURES``,
    and never fewer than ``threshold``."""
    return max(threshold, min(contracts.MAX_SIGNATURES, SIGNATURES_PER_KEY * max(trusted_keys, 1)))


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
    ``PAE(payloadType, body)``. Each trusted key is tried once: the first signature naming it is verified,
    later ones naming it again are ignored, valid or not. Signatures with unknown keyids are ignored. An
    envelope with more than ``signature_limit(len(keys), threshold)`` signatures is ``malformed`` before
    any is verified. ``role`` only words the messages.
    """
    require_cryptography()
    contracts.require_pydantic()
    if threshold < 1:
        raise RuntimeError(f"verify_envelope: threshold must be >= 1 (got {threshold}); 0 would accept anything")
    try:
        document = contracts.read_json(data)
    except contracts.JsonError as exc:
        raise Rejection(RejectionCode.MALFORMED, f"not a DSSE envelope: {exc}") from exc
    # Counted on the parsed JSON, before the model looks at each signature: a flood costs one parse.
    signatures = document.get("signatures") if isinstance(document, dict) else None
    limit = signature_limit(len(keys), threshold)
    if isinstance(signatures, list) and len(signatures) > limit:
        raise Rejection(
            RejectionCode.MALFORMED,
            f"the envelope carries {len(signatures)} signatures, more than the {limit} allowed for {role} "
            f"documents ({SIGNATURES_PER_KEY} per key the policy trusts for the role, {contracts.MAX_SIGNATURES} "
            "at most): refused before verifying any - sign with the role's keys only",
        )
    try:
        envelope = contracts.Envelope.model_validate(document)
    except contracts.ValidationError as exc:
        raise Rejection(RejectionCode.MALFORMED, f"not a DSSE envelope: {describe_validation_error(exc)}") from exc
    # The model checked the encoding is canonical, so this decoding cannot fail and is the only one.
    body = base64.b64decode(envelope.payload, validate=True)
    if envelope.payloadType != payload_type:
        raise Rejection(
            RejectionCode.WRONG_PAYLOAD_TYPE,
            f"payload type is {envelope.payloadType!r}, expected {payload_type!r}",
        )

    message = pae(envelope.payloadType, body)
    signers: list[str] = []
    tried: set[str] = set()
    unknown = invalid = repeated = 0
    for signature in envelope.signatures:
        key = keys.get(signature.keyid)
        if key is None:
            unknown += 1
            continue
        if signature.keyid in tried:
            repeated += 1
            continue
        tried.add(signature.keyid)
        try:
            key.verify(base64.b64decode(signature.sig, validate=True), message)
        except (InvalidSignature, ValueError):
            invalid += 1
            continue
        signers.append(signature.keyid)
    if len(signers) < threshold:
        raise Rejection(
            RejectionCode.THRESHOLD_NOT_MET,
            f"{threshold} distinct {role} key(s) must sign this document, {len(signers)} did "
            f"({len(envelope.signatures)} signature(s): {unknown} by keys the policy does not trust for "
            f"this role, {invalid} not valid for the key they name, {repeated} naming a key already tried)",
        )
    return VerifiedEnvelope(body=body, signers=tuple(signers))


def verify_desired_state(
    data: bytes, policy: Policy, *, node_id: str, now: datetime, applied: AppliedState
) -> VerifiedState:
    """Verify a desired-state envelope for this node against the host's applied state.

    Rejections after the signature check, in order: ``schema`` (including a lifetime, ``expires_at -
    issued_at``, beyond the policy's ``trust.control.max_lifetime``), ``wrong-node``, ``expired``,
    ``not-yet-valid``, ``replayed`` (a generation lower than the applied one or than the one accepted, or
    either of those with different content), ``stale-epoch``. Only a state passing all of them can be
    ``already_applied`` (the applied generation, same bytes): a re-delivery, which the caller turns into a
    no-op. The generation accepted and not recorded applied, with its own bytes, is not ``already_applied``:
    its apply failed or was cut short, and applying those bytes again is the retry and repair path.
    """
    _require_aware(now)
    envelope = _verify_role(data, policy, "desired-state", "control")
    state = _parse(contracts.DesiredState, envelope.body, "desired state")
    _check_lifetime(
        f"desired state generation {state.generation}",
        state.issued_at,
        state.expires_at,
        policy,
        "control",
        stamps=f" (issued_at {contracts.format_rfc3339(state.issued_at)}, "
        f"expires_at {contracts.format_rfc3339(state.expires_at)})",
        fix="the control plane must issue states that expire sooner (and re-sign them), or the policy allow longer",
    )
    digest = hashlib.sha256(envelope.body).hexdigest()

    if state.node_id != node_id:
        raise Rejection(
            RejectionCode.WRONG_NODE, f"desired state is for node {state.node_id!r}, this node is {node_id!r}"
        )
    _check_current(f"desired state generation {state.generation}", state.issued_at, state.expires_at, now)
    if state.generation < applied.generation:
        raise Rejection(
            RejectionCode.REPLAYED,
            f"generation {state.generation} is lower than the applied generation {applied.generation}: "
            "a replayed or rolled-back state",
        )
    accepted = applied.accepted
    if accepted is not None and accepted.generation > applied.generation:
        if state.generation < accepted.generation:
            raise Rejection(
                RejectionCode.REPLAYED,
                f"generation {state.generation} is lower than generation {accepted.generation}, which this host "
                f"accepted (its apply started; whether it succeeded or not, nothing older is applied after it, "
                f"the applied generation is {applied.generation}): a replayed or rolled-back state. To go back, "
                "publish a new generation with the old content",
            )
        if state.generation == accepted.generation and digest != accepted.payload_sha256:
            raise Rejection(
                RejectionCode.REPLAYED,
                f"generation {state.generation} was already accepted with different content (sha256 "
                f"{accepted.payload_sha256}, this one {digest}): a generation is never reused",
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


# --- air-gap bundles (docs/AIR_GAP.md) -------------------------------------------------------------------


def verify_bundle(data: bytes, policy: Policy, *, node_id: str, now: datetime, applied: AppliedState) -> VerifiedBundle:
    """Verify an air-gap bundle's ``bundle.json`` (air_gap_authority keys) and the desired state inside it
    (control keys). The members it lists are checked by ``airgap.bundle_reader`` as they are read.

    Both signatures are required: the authority vouches for the delivery, the control keys for the
    state, so a stolen authority key alone cannot invent a desired state, and a control key alone cannot
    deliver one to an air-gapped host. After the authority's signature, in order: ``schema`` (including
    a lifetime beyond ``trust.air_gap_authority.max_lifetime``),
    ``wrong-node``, ``expired`` (the bundle's own ``expires_at``), ``not-yet-valid``, then every check of
    ``verify_desired_state`` on the state inside (its rejections keep their codes, the message says it
    is the state inside), and ``schema`` when the bundle's ``generation`` is not the state's.
    """
    _require_aware(now)
    envelope = _verify_role(data, policy, "bundle", "air_gap_authority")
    bundle = _parse(contracts.Bundle, envelope.body, "bundle")
    what = f"bundle {bundle.bundle_id!r} (generation {bundle.generation})"
    _check_lifetime(
        what,
        bundle.created_at,
        bundle.expires_at,
        policy,
        "air_gap_authority",
        fix="make bundles that expire sooner (make-bundle --expires), or let the policy allow longer",
    )
    if bundle.node_id != node_id:
        raise Rejection(RejectionCode.WRONG_NODE, f"{what} is for node {bundle.node_id!r}, this node is {node_id!r}")
    _check_current(what, bundle.created_at, bundle.expires_at, now, fix=": ask the site's authority for a fresh bundle")
    try:
        desired = verify_desired_state(
            bundle.desired_state.model_dump_json().encode("utf-8"), policy, node_id=node_id, now=now, applied=applied
        )
    except Rejection as inner:
        raise Rejection(inner.code, f"the desired state inside {what}: {inner.message}") from inner
    if desired.state.generation != bundle.generation:
        raise Rejection(
            RejectionCode.SCHEMA,
            f"{what} carries desired state generation {desired.state.generation}: a bundle's generation is the "
            "generation of the state it delivers - rebuild it with make-bundle",
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
    try:
        return contracts.parse_document(model, body)
    except contracts.JsonError as exc:
        raise Rejection(RejectionCode.SCHEMA, f"signed {what} is not a JSON document: {exc}") from exc
    except contracts.ValidationError as exc:
        raise Rejection(
            RejectionCode.SCHEMA, f"signed {what} does not match the schema: {describe_validation_error(exc)}"
        ) from exc


def _check_lifetime(
    what: str, issued: datetime, expires: datetime, policy: Policy, role: Role, *, stamps: str = "", fix: str
) -> None:
    # A signer's documents may not be valid longer than the policy's trust.<role>.max_lifetime.
    limit = policy.max_lifetime(role)
    lifetime = expires - issued
    if limit is not None and lifetime > limit:
        raise Rejection(
            RejectionCode.SCHEMA,
            f"{what} is valid for {format_duration(lifetime)}{stamps}, longer than trust.{role}.max_lifetime "
            f"{format_duration(limit)} in policy {policy.source}: {fix}",
        )


def _check_current(what: str, issued: datetime, expires: datetime, now: datetime, *, fix: str = "") -> None:
    # Expired, then issued in the future beyond the clock skew allowed: in this order for every document.
    if expires <= now:
        raise Rejection(
            RejectionCode.EXPIRED,
            f"{what} expired at {contracts.format_rfc3339(expires)} (now {contracts.format_rfc3339(now)}){fix}",
        )
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
