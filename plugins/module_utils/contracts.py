"""contracts/v1: the documents meridian.node exchanges with the control plane, as strict models.

These models are the one source of the wire formats: the JSON Schemas under ``contracts/v1`` are generated
from them (``make schemas``) and a test fails when the checked-in schemas drift. Every model forbids
unknown fields, because a signed payload with a field we do not understand must be rejected, not
silently half-applied.

Every model is strict (``strict=True``): a JSON value must already have the field's type. ``"3"``, ``3.0``,
``true`` and ``" 3 "`` are not the integer 3, ``"8000"`` is not a port, and a time is an RFC 3339 string
(``UtcTimestamp``), never a number. A signed document is read by the host, by reviewers, audit tools and
the control plane; a coercion one of them makes and another does not would let two honest readers
disagree about what was approved. ``read_json`` is the one JSON reader for signed bytes: it refuses an
object with the same key twice (readers differ on which one wins). Host-side YAML (policy, agent
config) is read elsewhere and keeps its documented friendly forms.

The models live by document family, each file importing ``base`` and what it embeds:

- ``base``: ``StrictModel``, pydantic (or its stub), the one timestamp form, the shared field types
- ``signed``: ``read_json`` and ``parse_document`` for signed bytes; the DSSE ``Envelope``
- ``state``: ``DesiredState`` (engines, artifacts, runbook, cordon) and ``ArtifactManifest``
- ``bundle``: an air-gap ``Bundle``'s signed listing
- ``enrollment``: ``EnrollmentRequest``/``Response``, ``CertificateRenewalRequest``, ``Lease``
- ``gpu_facts``: ``GpuFacts``, each GPU's readings and health
- ``observation``: ``Observation`` and ``ServingProjection``

This package is their one face: import from ``contracts``, not from its files.
"""

from __future__ import annotations

from ansible_collections.meridian.node.plugins.module_utils.contract_models.base import (
    API_VERSION,
    INT64_MAX,
    PYDANTIC_IMPORT_ERROR,
    RFC3339_UTC_PATTERN,
    BaseModel,
    FormatOne,
    NodeId,
    Sha256Hex,
    StrictModel,
    UtcTimestamp,
    ValidationError,
    describe_validation_error,
    format_rfc3339,
    parse_rfc3339,
    require_pydantic,
)
from ansible_collections.meridian.node.plugins.module_utils.contract_models.bundle import (
    BUNDLE_ENVELOPE_NAME,
    BUNDLE_TOP_DIRECTORIES,
    Bundle,
    BundleFile,
    bundle_path_key,
)
from ansible_collections.meridian.node.plugins.module_utils.contract_models.enrollment import (
    CertificateRenewalRequest,
    EnrollmentRequest,
    EnrollmentResponse,
    Lease,
)
from ansible_collections.meridian.node.plugins.module_utils.contract_models.gpu_facts import (
    GpuFacts,
    GpuHealth,
    HealthVerdict,
)
from ansible_collections.meridian.node.plugins.module_utils.contract_models.observation import (
    OBSERVED_LOG_LINE_CHARS,
    OBSERVED_LOG_LINES,
    Capacity,
    EngineObservation,
    KubernetesLeftOut,
    KubernetesObservation,
    Observation,
    PodAllocation,
    PodDevice,
    ServingProjection,
    TransferObservation,
)
from ansible_collections.meridian.node.plugins.module_utils.contract_models.signed import (
    CANONICAL_BASE64,
    MAX_SIGNATURES,
    Envelope,
    JsonError,
    Signature,
    parse_document,
    read_json,
)
from ansible_collections.meridian.node.plugins.module_utils.contract_models.state import (
    ArtifactManifest,
    ArtifactRef,
    DesiredState,
    EngineSpec,
    ManifestFile,
    Runbook,
)
from ansible_collections.meridian.node.plugins.module_utils.engine_rules import DRIVERS

__all__ = [
    "API_VERSION",
    "BUNDLE_ENVELOPE_NAME",
    "BUNDLE_TOP_DIRECTORIES",
    "CANONICAL_BASE64",
    "DRIVERS",
    "INT64_MAX",
    "MAX_SIGNATURES",
    "OBSERVED_LOG_LINES",
    "OBSERVED_LOG_LINE_CHARS",
    "PYDANTIC_IMPORT_ERROR",
    "RFC3339_UTC_PATTERN",
    "SCHEMAS",
    "ArtifactManifest",
    "ArtifactRef",
    "Bundle",
    "BundleFile",
    "Capacity",
    "CertificateRenewalRequest",
    "DesiredState",
    "EngineObservation",
    "EngineSpec",
    "EnrollmentRequest",
    "EnrollmentResponse",
    "Envelope",
    "FormatOne",
    "GpuFacts",
    "GpuHealth",
    "HealthVerdict",
    "JsonError",
    "KubernetesLeftOut",
    "KubernetesObservation",
    "Lease",
    "ManifestFile",
    "NodeId",
    "Observation",
    "PodAllocation",
    "PodDevice",
    "Runbook",
    "ServingProjection",
    "Sha256Hex",
    "Signature",
    "StrictModel",
    "TransferObservation",
    "UtcTimestamp",
    "ValidationError",
    "bundle_path_key",
    "describe_validation_error",
    "format_rfc3339",
    "parse_document",
    "parse_rfc3339",
    "read_json",
    "require_pydantic",
]

# The collection's document kinds under contracts/v1, by the file stem its schema is written to (the
# agent adds its own, the air-gap outbox record: meridian_node_agent.dev.schemas.SCHEMAS).
SCHEMAS: dict[str, type[BaseModel]] = {
    "desired-state": DesiredState,
    "artifact-manifest": ArtifactManifest,
    "bundle": Bundle,
    "observation": Observation,
    "lease": Lease,
    "enrollment-request": EnrollmentRequest,
    "enrollment-response": EnrollmentResponse,
    "certificate-renewal-request": CertificateRenewalRequest,
    "serving-projection": ServingProjection,
    "envelope": Envelope,
    "gpu-facts": GpuFacts,
}
