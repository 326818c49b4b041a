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
"""

from __future__ import annotations

import base64
import json
import math
import re
import traceback
import unicodedata
from datetime import datetime, timedelta, timezone
from typing import Annotated, Any, Literal, Optional, TypeVar, Union

from ansible_collections.meridian.node.plugins.module_utils._compat import UTC
from ansible_collections.meridian.node.plugins.module_utils._errors import MeridianError
from ansible_collections.meridian.node.plugins.module_utils._plain_checks import short_repr
from ansible_collections.meridian.node.plugins.module_utils.engine_rules import (
    DRIVERS,
    IMAGE_REFERENCE,
    MAX_LABELS,
    MAX_VOLUMES,
    NAME_PATTERN,
    READY_TIMEOUT_MAX_S,
    SHM_SIZE_MAX_MIB,
    ULIMIT_MAX,
    label_problem,
    paths_overlap,
    secret_env_problem,
    ulimit_problem,
    volume_problem,
)

try:
    from pydantic import (
        AfterValidator,
        AwareDatetime,
        BaseModel,
        BeforeValidator,
        ConfigDict,
        Field,
        PlainSerializer,
        ValidationError,
        WithJsonSchema,
        model_validator,
    )
except ImportError:
    PYDANTIC_IMPORT_ERROR: str | None = traceback.format_exc()
    from ansible_collections.meridian.node.plugins.module_utils._pydantic_stub import (  # type: ignore[assignment,no-redef]
        AfterValidator,
        AwareDatetime,
        BaseModel,
        ConfigDict,
        Field,
        PlainSerializer,
        ValidationError,
        model_validator,
    )

    # Markers only, like the rest of the stub: nothing validates without pydantic.
    BeforeValidator = WithJsonSchema = AfterValidator  # type: ignore[misc,assignment]
else:
    PYDANTIC_IMPORT_ERROR = None

API_VERSION = "meridian.node/v1"

# DRIVERS is defined next to the engine modules' own spec check, which must agree with EngineSpec here.
Driver = Literal["vllm", "tgi", "sglang", "ollama", "llamacpp", "lmdeploy", "openai"]

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
    "ArtifactManifest",
    "ArtifactRef",
    "Bundle",
    "BundleFile",
    "CertificateRenewalRequest",
    "DesiredState",
    "EngineSpec",
    "EnrollmentRequest",
    "EnrollmentResponse",
    "Envelope",
    "FormatOne",
    "GpuFacts",
    "JsonError",
    "Lease",
    "ManifestFile",
    "Observation",
    "Runbook",
    "ServingProjection",
    "Signature",
    "StrictModel",
    "TransferObservation",
    "ValidationError",
    "bundle_path_key",
    "describe_validation_error",
    "format_rfc3339",
    "parse_document",
    "parse_rfc3339",
    "read_json",
    "require_pydantic",
]


def require_pydantic() -> None:
    """Raise a clear error where the contracts are used on a host without pydantic."""
    if PYDANTIC_IMPORT_ERROR is not None:
        raise RuntimeError(
            "meridian.node needs the Python package 'pydantic' (>= 2.6) on this host; install it "
            "(pip install 'pydantic>=2.6') or install the meridian-node package, which depends on it."
        )


def format_rfc3339(value: datetime) -> str:
    """UTC, second precision unless there are microseconds, with a ``Z``: the only form we emit."""
    utc = value.astimezone(UTC)
    text = utc.isoformat(timespec="microseconds" if utc.microsecond else "seconds")
    return text.replace("+00:00", "Z")


def _require_utc(value: datetime) -> datetime:
    if value.utcoffset() != timedelta(0):
        raise ValueError(f"timestamp must be in UTC (offset Z or +00:00), got offset {value.utcoffset()}")
    return value.astimezone(UTC)


# The one spelling of a time on the wire: RFC 3339 ``date-time`` with an upper-case ``T``, seconds, at
# most six fractional digits (Python's precision: a seventh digit would be dropped by us and kept by
# another reader) and an offset. pydantic's own parser also takes a space for ``T``, lower case, no
# seconds, a bare Unix number and a number inside a string; none of those is accepted here.
_RFC3339 = re.compile(
    r"([0-9]{4})-([0-9]{2})-([0-9]{2})T([0-9]{2}):([0-9]{2}):([0-9]{2})(?:\.([0-9]{1,6}))?"
    r"(Z|([+-])([0-9]{2}):([0-9]{2}))"
)
# The same in the JSON Schema, with the offset narrowed to UTC as the validator narrows it.
RFC3339_UTC_PATTERN = r"^[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}(\.[0-9]{1,6})?(Z|[+-]00:00)$"
_TIMESTAMP_FORM = "an RFC 3339 timestamp in UTC such as 2025-06-01T12:00:00Z"


def parse_rfc3339(value: str) -> datetime:
    """An aware datetime from the one timestamp form contracts accept; ``ValueError`` saying why not."""
    match = _RFC3339.fullmatch(value)
    if match is None:
        raise ValueError(
            f"must be {_TIMESTAMP_FORM} (upper-case T and Z, with seconds, at most 6 fractional digits) "
            f"(got {short_repr(value)})"
        )
    year, month, day, hour, minute, second = (int(part) for part in match.groups()[:6])
    fraction, zone, sign, offset_hours, offset_minutes = match.groups()[6:]
    tz = UTC
    if zone != "Z":
        if int(offset_hours) > 23 or int(offset_minutes) > 59:
            raise ValueError(f"must be {_TIMESTAMP_FORM}: offset {zone!r} is out of range (got {short_repr(value)})")
        offset = timedelta(hours=int(offset_hours), minutes=int(offset_minutes))
        tz = timezone(-offset if sign == "-" else offset)
    microsecond = int(fraction.ljust(6, "0")) if fraction else 0
    try:
        return datetime(year, month, day, hour, minute, second, microsecond, tzinfo=tz)
    except ValueError as exc:
        raise ValueError(f"must be {_TIMESTAMP_FORM}: {exc} (got {short_repr(value)})") from None


def _timestamp_input(value: Any) -> Any:
    # A datetime is what Python callers building a document pass (``model_validate`` of a dict); JSON
    # can only carry the string.
    if isinstance(value, datetime):
        return value
    if isinstance(value, str):
        return parse_rfc3339(value)
    raise ValueError(f"must be {_TIMESTAMP_FORM} (got {short_repr(value)}): a time is a string, never a number")


# An RFC 3339 timestamp in UTC. Offsets other than zero are refused rather than converted: a control
# plane that sends local times has a bug worth hearing about.
UtcTimestamp = Annotated[
    AwareDatetime,
    BeforeValidator(_timestamp_input),
    AfterValidator(_require_utc),
    PlainSerializer(format_rfc3339, return_type=str, when_used="json"),
    WithJsonSchema({"type": "string", "format": "date-time", "pattern": RFC3339_UTC_PATTERN}),
]

NodeId = Annotated[
    str,
    Field(
        pattern=r"^[a-z0-9]([a-z0-9.-]{0,251}[a-z0-9])?$",
        description="DNS-label-like node name: lowercase letters, digits, '.', '-'",
    ),
]
Name = Annotated[
    str,
    Field(pattern=NAME_PATTERN, description="lowercase name, 1-63 characters"),
]


def _not_reserved_version(value: str) -> str:
    if value == "current":
        raise ValueError("version 'current' is reserved: the artifact store uses it for the promoted version")
    return value


Version = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.+-]{0,127}$"), AfterValidator(_not_reserved_version)]
Sha256Hex = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$", description="lowercase hex sha256")]
KeyId = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$", description="hex sha256 of the raw public key")]


def describe_validation_error(exc: ValidationError, limit: int = 3) -> str:
    """pydantic's report as one line of ``field.path: what is wrong (got value)``; the first few errors."""
    errors = exc.errors(include_url=False)
    parts = [_describe_one(error) for error in errors[:limit]]
    if len(errors) > limit:
        parts.append(f"and {len(errors) - limit} more error(s)")
    return "; ".join(parts)


def _describe_one(error: Any) -> str:
    where = _location(error.get("loc", ()))
    kind = error.get("type", "")
    ctx = error.get("ctx") or {}
    got = error.get("input")
    if kind == "missing":
        return f"{where}: a required field is missing"
    if kind == "extra_forbidden":
        return f"{where}: unknown field (got {short_repr(got)})"
    bound = {
        "greater_than_equal": (">=", "ge"),
        "greater_than": (">", "gt"),
        "less_than_equal": ("<=", "le"),
        "less_than": ("<", "lt"),
    }.get(kind)
    if bound:
        message = f"must be {bound[0]} {ctx.get(bound[1])}"
    elif kind == "value_error":
        # Our validators already phrase the problem, value included.
        return f"{where}: {error.get('ctx', {}).get('error', error.get('msg'))}"
    else:
        message = str(error.get("msg", "invalid value"))
        message = message[0].lower() + message[1:] if message else "invalid value"
    return f"{where}: {message} (got {short_repr(got)})"


def _location(loc: Any) -> str:
    text = ""
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text += f".{part}" if text else str(part)
    return text or "(document)"


# --- reading signed bytes -------------------------------------------------------------------------------


class JsonError(MeridianError, ValueError):
    """Bytes that are not one JSON document with one meaning: not UTF-8, not RFC 8259 JSON (``NaN``,
    ``Infinity``, a number no 64-bit float holds, a lone UTF-16 surrogate), or an object naming a key twice."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    document: dict[str, Any] = {}
    for key, value in pairs:
        if key in document:
            raise JsonError(
                f"key {key!r} appears twice in one object (first {short_repr(document[key])}, then "
                f"{short_repr(value)}): readers disagree on which one counts, so a signed document names "
                "each key once - fix the program that wrote it"
            )
        document[key] = value
    return document


def _no_constant(name: str) -> Any:
    raise JsonError(f"{name} is not JSON (RFC 8259 has no NaN or Infinity)")


def _finite_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise JsonError(f"number {short_repr(text, 40)} is beyond what a 64-bit float holds")
    return value


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def read_json(data: bytes) -> Any:
    """The one JSON reader for signed bytes (envelopes and the bodies they carry): stdlib ``json`` with
    duplicate keys refused at every depth, plus what RFC 8259 leaves out refused; ``JsonError`` says what.

    Values are exactly ``json.loads``'s where it accepts; what it accepts and this refuses is listed in
    ``JsonError``. ``tests/collection/module_utils/test_wire_strictness.py`` holds it to that, and to pydantic's parser.
    """
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise JsonError(f"not UTF-8 text: {exc}") from None
    try:
        document = json.loads(
            text, object_pairs_hook=_unique_keys, parse_constant=_no_constant, parse_float=_finite_float
        )
    except JsonError:
        raise
    except RecursionError:
        raise JsonError("not JSON: nested too deeply") from None
    except ValueError as exc:  # json.JSONDecodeError, or an integer beyond int()'s digit limit
        raise JsonError(f"not JSON: {exc}") from None
    if _SURROGATE_ESCAPE.search(text):
        # A \ud800 escape without its pair decodes to a string no UTF-8 reader can hold: pydantic refuses
        # it, others replace it with U+FFFD. Pairs are fine (they are one character).
        try:
            json.dumps(document, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as exc:
            raise JsonError(f"not JSON text: an escaped UTF-16 surrogate without its pair ({exc.reason})") from None
    return document


_Model = TypeVar("_Model", bound=BaseModel)


def parse_document(model: type[_Model], data: bytes) -> _Model:
    """``model`` from JSON bytes read by ``read_json``: ``JsonError`` or pydantic's ``ValidationError``.

    What the verifier uses for every envelope and signed body, so the tree checked for duplicate keys
    is the tree validated (no second parser to disagree with the first).
    """
    require_pydantic()
    return model.model_validate(read_json(data))


# --- the models ------------------------------------------------------------------------------------------
# pydantic evaluates these annotations at run time, on the host's Python: 3.9 has no ``X | None`` there, so
# the models spell ``Optional``/``Union`` (ruff keeps them: pyproject.toml, ``keep-runtime-typing``).


class StrictModel(BaseModel):
    """The one base of every wire model, here and in the agent: unknown fields refused, frozen, no coercion."""

    # defer_build: a module that imports the contracts but validates one kind (or none) should not pay
    # for building every schema at import; each model builds on first use.
    # strict: no coercion, in JSON and in Python (see the module docstring).
    model_config = ConfigDict(extra="forbid", frozen=True, str_strip_whitespace=False, defer_build=True, strict=True)


# Base64 as ``base64.b64encode`` writes it (RFC 4648 section 4): the standard alphabet, '=' padding, no
# whitespace, and the unused low bits of the last character zero. Exactly one string encodes a byte
# string, so one body has one envelope payload.
# The validator checks by definition (decode, encode again, compare); the schema says it as a pattern.
CANONICAL_BASE64 = r"^(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/][AQgw]==|[A-Za-z0-9+/]{2}[AEIMQUYcgkosw048]=)?$"


def _canonical_base64(value: str) -> str:
    try:
        canonical = base64.b64encode(base64.b64decode(value, validate=True)).decode("ascii") == value
    except ValueError:  # binascii.Error, or a character outside ASCII
        canonical = False
    if not canonical:
        raise ValueError(
            "must be canonical base64, as base64.b64encode writes it: the standard alphabet, '=' padding, "
            f"no whitespace or line breaks, the unused trailing bits zero (got {short_repr(value)})"
        )
    return value


_BASE64_SCHEMA = {"type": "string", "contentEncoding": "base64", "pattern": CANONICAL_BASE64}
Base64 = Annotated[str, AfterValidator(_canonical_base64), WithJsonSchema(_BASE64_SCHEMA)]

# The most signatures an envelope may carry, whatever the policy; the verifier's own limit is smaller
# (four per trusted key of the role), and both are checked before any signature is verified.
MAX_SIGNATURES = 64


class Signature(StrictModel):
    keyid: KeyId
    sig: Annotated[
        str,
        Field(min_length=1, description="base64 Ed25519 signature over PAE(type, body)"),
        AfterValidator(_canonical_base64),
        WithJsonSchema({**_BASE64_SCHEMA, "minLength": 1}),
    ]


class Envelope(StrictModel):
    """A DSSE envelope (https://github.com/secure-systems-lab/dsse). The payload is base64 of the body."""

    payloadType: Annotated[str, Field(min_length=1)]
    payload: Annotated[Base64, Field(description="canonical base64 of the body")]
    signatures: Annotated[list[Signature], Field(min_length=1, max_length=MAX_SIGNATURES)]


def _relative_store_path(value: str) -> str:
    """A manifest path must stay inside the artifact's directory, whatever the filesystem does."""
    if not value or value.startswith("/") or "\\" in value or "\x00" in value:
        raise ValueError(f"path {value!r} must be relative, use '/' separators and contain no NUL")
    parts = value.split("/")
    if any(part in ("", ".", "..") for part in parts):
        raise ValueError(f"path {value!r} must not contain empty, '.' or '..' components")
    return value


RelativePath = Annotated[str, AfterValidator(_relative_store_path)]

# Counters and sizes in signed documents fit a signed 64-bit integer: every reader (SQLite, Go, Java, a
# JSON parser that maps to int64) sees the same number, and nothing downstream overflows on a huge one.
INT64_MAX = 2**63 - 1


class ManifestFile(StrictModel):
    path: RelativePath
    size: Annotated[int, Field(ge=0, le=INT64_MAX)]
    sha256: Sha256Hex
    url: Optional[str] = Field(default=None, description="where to fetch this file; default base_url + path")


class ArtifactManifest(StrictModel):
    apiVersion: Literal["meridian.node/v1"]
    kind: Literal["ArtifactManifest"]
    name: Name
    version: Version
    base_url: Optional[str] = None
    files: Annotated[list[ManifestFile], Field(min_length=1)]

    @model_validator(mode="after")
    def _paths_do_not_collide(self) -> ArtifactManifest:
        seen: dict[str, str] = {}
        for entry in self.files:
            # Case-folded, because two names that differ only in case collide on some filesystems.
            key = entry.path.casefold()
            if key in seen:
                raise ValueError(f"paths {seen[key]!r} and {entry.path!r} collide")
            seen[key] = entry.path
        prefixes = {key.rsplit("/", i)[0] for key in seen for i in range(1, key.count("/") + 1)}
        clash = sorted(prefixes & seen.keys())
        if clash:
            raise ValueError(f"path {seen[clash[0]]!r} is both a file and a directory")
        return self

    @property
    def total_bytes(self) -> int:
        return sum(entry.size for entry in self.files)


class ArtifactRef(StrictModel):
    """An artifact the host should hold: the signed manifest travels with the desired state."""

    name: Name
    version: Version
    manifest: Envelope
    source: Optional[str] = Field(default=None, description="http(s) base URL or local directory")
    pin: bool = False


class ModelRef(StrictModel):
    artifact: Optional[Name] = Field(default=None, description="a promoted artifact in the local store")
    name: Optional[str] = Field(default=None, description="a model name for engines that manage their own")

    @model_validator(mode="after")
    def _exactly_one(self) -> ModelRef:
        if (self.artifact is None) == (self.name is None):
            raise ValueError("model needs exactly one of 'artifact' or 'name'")
        return self


def _image_reference(value: str) -> str:
    if not IMAGE_REFERENCE.match(value):
        raise ValueError(f"image {value!r} is not a valid reference (repository[:tag][@sha256:<64 hex>])")
    return value


ImageReference = Annotated[str, AfterValidator(_image_reference)]


class EngineSpec(StrictModel):
    # The host-setting rules live in engine_spec, which the engine modules' pydantic-free check shares.

    class Volume(StrictModel):
        """A host path mounted read-only into the engine; there is no writable form."""

        source: str = Field(description="absolute host path; the host policy's allowed_volume_sources must cover it")
        target: str = Field(description="absolute path inside the container, outside /meridian, /proc, /sys, /dev")

        @model_validator(mode="after")
        def _safe(self) -> EngineSpec.Volume:
            problem = volume_problem(self.source, self.target)
            if problem is not None:
                raise ValueError(problem)
            return self

    class Ulimit(StrictModel):
        soft: Annotated[int, Field(ge=-1, le=ULIMIT_MAX, description="-1 is unlimited")]
        hard: Annotated[int, Field(ge=-1, le=ULIMIT_MAX, description="-1 is unlimited")]

    name: Name
    driver: Driver
    image: ImageReference
    model: ModelRef
    served_model_name: Optional[str] = None
    gpus: list[str] = Field(default_factory=list, description="GPU uuids, indexes or MIG instance uuids")
    min_vram_mib: Annotated[int, Field(ge=0, le=INT64_MAX)] = 0
    force: bool = Field(
        default=False,
        description="place on GPUs whose health verdict is unhealthy or unknown (the plan and journal say so)",
    )
    port: Annotated[int, Field(ge=1, le=65535)]
    args: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(
        default_factory=dict, description="environment variables, shown whole in diffs, results and the journal"
    )
    secret_env: dict[str, str] = Field(
        default_factory=dict,
        description="environment variables whose values only the container sees: diffs and results show the "
        "names, the config hash a digest of each value; a name may not also be in env",
    )
    state: Literal["started", "stopped", "absent"] = "started"
    replace_strategy: Literal["drain-then-replace", "stop-then-start"] = "drain-then-replace"
    restart_policy: Literal["no", "on-failure", "unless-stopped"] = Field(
        default="unless-stopped", description="Docker's restart policy; unless-stopped keeps a drain's stop"
    )
    shm_size_mib: Optional[Annotated[int, Field(ge=1, le=SHM_SIZE_MAX_MIB)]] = Field(
        default=None, description="size of /dev/shm; null is the driver's default"
    )
    ipc_mode: Literal["private", "host"] = Field(
        default="private", description="host runs only where the host policy sets engines.allow_host_ipc"
    )
    ulimits: dict[
        Literal["core", "memlock", "nofile", "nproc", "stack"],
        Union[Annotated[int, Field(ge=-1, le=ULIMIT_MAX)], EngineSpec.Ulimit],
    ] = Field(default_factory=dict, description="one number sets soft and hard; -1 is unlimited")
    volumes: Annotated[list[EngineSpec.Volume], Field(max_length=MAX_VOLUMES)] = Field(default_factory=list)
    labels: Annotated[dict[str, str], Field(max_length=MAX_LABELS)] = Field(
        default_factory=dict, description="the engine container's own labels; meridian.node's prefix is refused"
    )
    ready_timeout_seconds: Optional[Annotated[int, Field(ge=1, le=READY_TIMEOUT_MAX_S)]] = Field(
        default=None,
        description="how long a new container may take to become ready before the replace rolls back; null is "
        "the applying module's ready_timeout (600 s by default)",
    )

    @model_validator(mode="after")
    def _host_settings(self) -> EngineSpec:
        if self.ipc_mode == "host" and self.shm_size_mib is not None:
            raise ValueError(
                "shm_size_mib has no effect with ipc_mode host (the engine uses the host's /dev/shm); drop one of them"
            )
        for name, limit in self.ulimits.items():
            soft, hard = (limit, limit) if isinstance(limit, int) else (limit.soft, limit.hard)
            problem = ulimit_problem(name, soft, hard)
            if problem is not None:
                raise ValueError(problem)
        targets = [volume.target for volume in self.volumes]
        for index, target in enumerate(targets):
            for other in targets[index + 1 :]:
                if paths_overlap(target, other):
                    raise ValueError(f"volume targets {target!r} and {other!r} overlap: one mount would hide the other")
        for key, value in self.labels.items():
            problem = label_problem(key, value)
            if problem is not None:
                raise ValueError(problem)
        both = secret_env_problem(self.env, self.secret_env)
        if both is not None:
            raise ValueError(both)
        return self


def _exact_integer(value: Any) -> Any:
    # pydantic matches a Literal by equality, strict or not: 1.0 and True would pass as 1 (and the schema,
    # whose integers exclude booleans, would refuse True): the same signed bytes read two ways.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"must be an integer written without a fraction or exponent (got {short_repr(value)})")
    return value


# A document format number: exactly the integer 1 (not 1.0, not true), for every versioned file on either side.
FormatOne = Annotated[Literal[1], BeforeValidator(_exact_integer)]


class Runbook(StrictModel):
    """The code that applies this state when it travels in an air-gap bundle with ``playbooks/`` and
    ``collection/``: their digests, pinned by the control keys (``runbook.py`` defines them). Without it a
    bundle's shipped code never runs; online it is not consulted (nothing is shipped there)."""

    format: FormatOne
    playbooks_sha256: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$", description="the playbooks/ tree digest")]
    collection_sha256: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$", description="sha256 of the tarball")]


class Cordon(StrictModel):
    """No new engines on these GPUs (empty: the whole node). ``drain``: running engines there are drained and
    stopped too, and held stopped until the cordon is lifted; otherwise they are left serving."""

    gpus: list[Annotated[str, Field(min_length=1, max_length=128)]] = Field(default_factory=list)
    drain: bool = False
    reason: Optional[Annotated[str, Field(max_length=200)]] = None


class DesiredState(StrictModel):
    apiVersion: Literal["meridian.node/v1"]
    kind: Literal["DesiredState"]
    node_id: NodeId
    generation: Annotated[int, Field(ge=1, le=INT64_MAX)]
    lease_epoch: Annotated[int, Field(ge=0, le=INT64_MAX)]
    issued_at: UtcTimestamp
    expires_at: UtcTimestamp
    artifacts: list[ArtifactRef] = Field(default_factory=list)
    engines: list[EngineSpec] = Field(default_factory=list)
    runbook: Optional[Runbook] = None
    cordon: Optional[Cordon] = None

    @model_validator(mode="after")
    def _consistent(self) -> DesiredState:
        if self.expires_at <= self.issued_at:
            raise ValueError("expires_at must be later than issued_at")
        _unique("engine name", [engine.name for engine in self.engines])
        _unique("engine port", [engine.port for engine in self.engines])
        _unique("artifact name", [artifact.name for artifact in self.artifacts])
        known = {artifact.name for artifact in self.artifacts}
        for engine in self.engines:
            if engine.model.artifact is not None and engine.model.artifact not in known:
                raise ValueError(
                    f"engine {engine.name!r} uses artifact {engine.model.artifact!r}, which the state does "
                    "not list under 'artifacts'"
                )
        return self


def _unique(what: str, values: list[Any]) -> None:
    seen: set[Any] = set()
    for value in values:
        if value in seen:
            raise ValueError(f"{what} {value!r} appears more than once")
        seen.add(value)


# --- air-gap bundles (docs/AIR_GAP.md) -------------------------------------------------------------------
# The payload of a bundle's first member, bundle.json. It lists every other member of the tar, so a reader
# knows each path, size and digest before it reads a byte of any of them.

# The tar's first member; no listed member may take its name.
BUNDLE_ENVELOPE_NAME = "bundle.json"
# Top-level directories a bundle's members live in; each has one meaning (docs/AIR_GAP.md, "Layout").
BUNDLE_TOP_DIRECTORIES = ("artifacts", "playbooks", "collection", "images")


def _bundle_member_path(value: str) -> str:
    top = value.split("/", 1)[0]
    if "/" not in value or top not in BUNDLE_TOP_DIRECTORIES:
        raise ValueError(
            f"path {value!r} must be inside one of the bundle's directories "
            f"({', '.join(d + '/' for d in BUNDLE_TOP_DIRECTORIES)}); see docs/AIR_GAP.md"
        )
    if any(ord(char) < 0x20 or ord(char) == 0x7F for char in value):
        raise ValueError(f"path {value!r} contains a control character")
    return value


BundlePath = Annotated[RelativePath, AfterValidator(_bundle_member_path)]


class BundleFile(StrictModel):
    """One member of the bundle's tar besides bundle.json: its path there, its size and its sha256."""

    path: BundlePath
    size: Annotated[int, Field(ge=0, le=INT64_MAX)]
    sha256: Sha256Hex


def bundle_path_key(path: str) -> str:
    """The form two member paths share when some filesystem would store them as one file: Unicode NFC
    (macOS and some tools normalise), then case-folded (case-insensitive filesystems)."""
    return unicodedata.normalize("NFC", path).casefold()


class Bundle(StrictModel):
    """An air-gap delivery for one node: the control-signed desired state it applies (``generation`` is
    that state's generation) and every other member of the tar it travels in."""

    apiVersion: Literal["meridian.node/v1"]
    kind: Literal["Bundle"]
    bundle_id: Name
    node_id: NodeId
    generation: Annotated[int, Field(ge=1, le=INT64_MAX, description="the generation of the desired state inside")]
    created_at: UtcTimestamp
    expires_at: UtcTimestamp
    desired_state: Envelope
    files: list[BundleFile] = Field(default_factory=list)

    @model_validator(mode="after")
    def _consistent(self) -> Bundle:
        if self.expires_at <= self.created_at:
            raise ValueError("expires_at must be later than created_at")
        seen: dict[str, str] = {}
        for entry in self.files:
            key = bundle_path_key(entry.path)
            if key in seen:
                raise ValueError(
                    f"paths {seen[key]!r} and {entry.path!r} name the same file on some filesystems "
                    "(the same after Unicode NFC and case folding): list each member once"
                )
            seen[key] = entry.path
        prefixes = {key.rsplit("/", i)[0] for key in seen for i in range(1, key.count("/") + 1)}
        clash = sorted(prefixes & seen.keys())
        if clash:
            raise ValueError(f"path {seen[clash[0]]!r} is both a file and a directory")
        collections = [entry.path for entry in self.files if entry.path.startswith("collection/")]
        has_playbooks = any(entry.path.startswith("playbooks/") for entry in self.files)
        if has_playbooks != bool(collections):
            raise ValueError(
                "a bundle carries playbooks/ and collection/ together or neither: its playbooks run with the "
                "collection shipped beside them"
            )
        if len(collections) > 1 or any(path.count("/") != 1 or not path.endswith(".tar.gz") for path in collections):
            raise ValueError(
                f"collection/ holds exactly one collection tarball, collection/<name>.tar.gz (got {collections})"
            )
        # Engine images: one archive per image, directly under images/ (docs/AIR_GAP.md, "Images").
        images = [entry.path for entry in self.files if entry.path.startswith("images/")]
        odd = [path for path in images if path.count("/") != 1 or not path.endswith(".tar") or path == "images/.tar"]
        if odd:
            raise ValueError(f"images/ holds image archives named images/<name>.tar, nothing else (got {odd[0]!r})")
        return self

    @property
    def total_bytes(self) -> int:
        return sum(entry.size for entry in self.files)


class Lease(StrictModel):
    node_id: NodeId
    epoch: Annotated[int, Field(ge=0, le=INT64_MAX)]
    expires_at: UtcTimestamp
    renewed_at: UtcTimestamp


class EnrollmentRequest(StrictModel):
    node_id: NodeId
    token: Annotated[str, Field(min_length=1)]
    csr_pem: Annotated[str, Field(pattern=r"^-----BEGIN CERTIFICATE REQUEST-----")]


class CertificateRenewalRequest(StrictModel):
    """A CSR for a new key, sent over mutual TLS with the node's current certificate; answered with an
    ``EnrollmentResponse`` (the new certificate, the CA bundle and the node's current lease)."""

    node_id: NodeId
    csr_pem: Annotated[str, Field(pattern=r"^-----BEGIN CERTIFICATE REQUEST-----")]


class EnrollmentResponse(StrictModel):
    node_id: NodeId
    certificate_pem: Annotated[str, Field(pattern=r"^-----BEGIN CERTIFICATE-----")]
    ca_bundle_pem: Annotated[str, Field(pattern=r"^-----BEGIN CERTIFICATE-----")]
    lease: Lease


class GpuMemory(StrictModel):
    total_mib: Optional[int]
    used_mib: Optional[int]
    free_mib: Optional[int]


class MigInstance(StrictModel):
    uuid: str
    profile: Optional[str]
    memory_mib: Optional[int]
    gpu_instance_id: Optional[int]
    compute_instance_id: Optional[int]


class ComputeProcess(StrictModel):
    pid: int
    used_memory_mib: Optional[int]


class NvLinkPeer(StrictModel):
    link: int
    peer_pci_bus_id: Optional[str]


class GpuClocks(StrictModel):
    """Current and maximum clocks in MHz (NVML_CLOCK_GRAPHICS, _SM, _MEM)."""

    graphics_mhz: Optional[int] = None
    sm_mhz: Optional[int] = None
    memory_mhz: Optional[int] = None
    max_graphics_mhz: Optional[int] = None
    max_sm_mhz: Optional[int] = None
    max_memory_mhz: Optional[int] = None


class PcieLink(StrictModel):
    """The PCIe link as trained now and at most: a link below its maximum is a health sign (or power saving)."""

    generation: Optional[int] = None
    width: Optional[int] = None
    max_generation: Optional[int] = None
    max_width: Optional[int] = None


HealthVerdict = Literal["healthy", "degraded", "unhealthy", "unknown"]


class HealthReason(StrictModel):
    """Why a verdict is what it is: ``code`` is stable (docs/GPU_HEALTH.md lists them), ``source`` names the
    NVML call or field that showed it, ``value`` what it read."""

    code: Annotated[str, Field(max_length=64)]
    source: Annotated[str, Field(max_length=128)]
    value: Optional[Union[bool, int, float, str]] = None


class XidEvent(StrictModel):
    """One XID from NVML's event set, within the health window."""

    xid: Annotated[int, Field(ge=0)]
    at: UtcTimestamp
    mig_uuid: Optional[str] = Field(default=None, description="the MIG device it names; None: the whole GPU")


class GpuHealthReadings(StrictModel):
    """The raw health counters a verdict is computed from (None: not supported or not read)."""

    retired_pages_sbe: Optional[int] = None
    retired_pages_dbe: Optional[int] = None
    retirement_pending: Optional[bool] = None
    remapped_rows_correctable: Optional[int] = None
    remapped_rows_uncorrectable: Optional[int] = None
    remap_pending: Optional[bool] = None
    remap_failure: Optional[bool] = None
    recovery_action: Optional[Literal["none", "reset", "reboot", "drain-p2p", "drain-and-reset"]] = None
    pcie_replay_count: Optional[int] = None
    clock_event_reasons: list[str] = Field(default_factory=list)
    power_violation_ns: Optional[int] = None
    thermal_violation_ns: Optional[int] = None
    nvlink_error_count: Optional[int] = None
    xid_events: list[XidEvent] = Field(default_factory=list)
    read_errors: list[str] = Field(
        default_factory=list, description="NVML errors other than NOT_SUPPORTED on a health read, by call"
    )


class GpuHealth(StrictModel):
    verdict: HealthVerdict
    reasons: list[HealthReason] = Field(default_factory=list)
    since: Optional[UtcTimestamp] = Field(default=None, description="when this verdict began, as far as we saw")
    held: bool = Field(
        default=False, description="held from an earlier reading until NVML shows a reset or an operator clears it"
    )
    readings: GpuHealthReadings = Field(default_factory=GpuHealthReadings)


class Gpu(StrictModel):
    index: int
    uuid: Optional[str]
    name: Optional[str]
    pci_bus_id: Optional[str]
    memory: GpuMemory
    utilization_gpu_percent: Optional[int]
    utilization_memory_percent: Optional[int]
    temperature_c: Optional[int]
    power_draw_w: Optional[float]
    power_limit_w: Optional[float]
    ecc_errors_corrected: Optional[int]
    ecc_errors_uncorrected: Optional[int]
    mig_mode: Optional[bool]
    mig_instances: list[MigInstance]
    processes: list[ComputeProcess]
    nvlink_peers: list[NvLinkPeer]
    error: Optional[str] = Field(default=None, description="why this GPU could not be read completely")
    # GPU feature discovery's vocabulary (NVIDIA/k8s-device-plugin internal/lm): docs/GPU_FACTS.md.
    compute_capability: Optional[str] = Field(default=None, description='"9.0" for Hopper')
    architecture: Optional[str] = Field(default=None, description="the family: ampere, hopper, blackwell, ...")
    mig_capable: Optional[bool] = None
    serial: Optional[str] = None
    persistence_mode: Optional[bool] = None
    clocks: GpuClocks = Field(default_factory=GpuClocks)
    pcie: PcieLink = Field(default_factory=PcieLink)
    health: Optional[GpuHealth] = Field(default=None, description="None where health was not read")
    cordoned: bool = Field(default=False, description="no new engines here, by host policy or the signed state")


class GpuFacts(StrictModel):
    """What ``gpu_facts`` returns as ``ansible_facts.meridian_gpus`` and what observations carry."""

    nvml_available: bool
    reason: Optional[str] = None
    driver_version: Optional[str] = None
    cuda_driver_version: Optional[str] = None
    count: Annotated[int, Field(ge=0)] = 0
    gpus: list[Gpu] = Field(default_factory=list)
    machine_type: Optional[str] = Field(default=None, description="the DMI product name, as GFD's gpu.machine")
    mig_strategy: Optional[Literal["none", "single", "mixed"]] = None
    labels: dict[str, str] = Field(
        default_factory=dict, description="GPU feature discovery's nvidia.com/* labels for this host"
    )


# An observation carries at most this much of a failing engine's log (its tail is kept on the host: docs/LOGS.md).
OBSERVED_LOG_LINES = 20
OBSERVED_LOG_LINE_CHARS = 600


class EngineObservation(StrictModel):
    name: str
    managed: bool
    driver: Optional[str]
    image: Optional[str]
    state: str
    ready: bool
    draining: bool
    port: Optional[int]
    served_model_name: Optional[str] = None
    # How it has been doing, for ours: Docker's restart count, how it last ended ("OOMKilled", "exit 1",
    # "killed by signal 9"), and since when the agent has seen it ready (None while not ready).
    restarts: Optional[Annotated[int, Field(ge=0, le=INT64_MAX)]] = None
    exit_code: Optional[int] = None
    exit_reason: Optional[Annotated[str, Field(max_length=200)]] = None
    ready_since: Optional[UtcTimestamp] = None
    last_lines: Optional[list[Annotated[str, Field(max_length=OBSERVED_LOG_LINE_CHARS)]]] = Field(
        default=None,
        max_length=OBSERVED_LOG_LINES,
        description="for one of ours that is failing (not running, or not ready): the last lines of its log, "
        "scrubbed of its environment's values (docs/LOGS.md); None otherwise, or when no log is kept yet",
    )


class TransferObservation(StrictModel):
    """An image pull or artifact download of the apply in flight, as its module last said (docs/PROTOCOL.md)."""

    kind: Literal["image", "artifact"]
    name: Annotated[
        str, Field(min_length=1, max_length=512, description="the image reference, or 'artifact version: path'")
    ]
    bytes_done: Annotated[int, Field(ge=0, le=INT64_MAX)]
    bytes_total: Optional[Annotated[int, Field(ge=0, le=INT64_MAX)]] = Field(
        default=None, description="null until the whole size is known (an image's layers say theirs as each starts)"
    )
    started_at: UtcTimestamp
    updated_at: UtcTimestamp


class ArtifactObservation(StrictModel):
    name: str
    version: str
    size_bytes: int
    pinned: bool
    current: bool


class Capacity(StrictModel):
    vram_free_mib: dict[str, int] = Field(default_factory=dict, description="by GPU uuid")
    free_ports: list[int] = Field(default_factory=list)


class RunSummary(StrictModel):
    ident: str
    generation: int
    status: Literal["successful", "failed", "canceled", "timeout", "running"]
    changed: int
    failed: int
    finished_at: Optional[UtcTimestamp] = None


class PodDevice(StrictModel):
    """A device the kubelet lists, joined to NVML by uuid (a ``::N`` time-slicing suffix stripped)."""

    resource: Annotated[str, Field(max_length=253)]
    device_id: Annotated[str, Field(max_length=253)]
    uuid: Optional[str] = Field(default=None, description="GPU-/MIG- uuid NVML knows; None: not an NVIDIA GPU")
    gpu_index: Optional[int] = None
    health: Optional[HealthVerdict] = None


class PodAllocation(StrictModel):
    namespace: Annotated[str, Field(max_length=253)]
    pod: Annotated[str, Field(max_length=253)]
    container: Annotated[str, Field(max_length=253)]
    devices: list[PodDevice] = Field(default_factory=list)
    engine_driver: Optional[Driver] = Field(default=None, description="a known engine, reported as unmanaged")


class KubernetesLeftOut(StrictModel):
    """What the kubelet listed that the observation does not carry, for one reason (docs/KUBERNETES.md)."""

    reason: Literal["not-a-gpu", "over-bound", "name-too-long", "too-large"] = Field(
        description="not-a-gpu: a container holding no GPU device, or a device that is not a GPU (counted by design); "
        "over-bound: beyond the agent's bounds on containers and devices listed; name-too-long: a name or device id "
        "over 253 characters; too-large: dropped so that the observation fits the control plane's limit on a request"
    )
    containers: Annotated[int, Field(ge=0, le=INT64_MAX)] = Field(
        default=0, description="containers not in allocations for this reason"
    )
    devices: Annotated[int, Field(ge=0, le=INT64_MAX)] = Field(
        default=0,
        description="device ids not listed for this reason (in allocations or allocatable), those of the "
        "containers left out included",
    )


class KubernetesObservation(StrictModel):
    """What the kubelet's PodResources API says runs on this node (mode kubernetes-integrated, read-only).

    Bounded by what the control plane acts on: the containers holding one of the node's GPUs, with their GPU
    devices, and the GPU devices allocatable; the rest is counted in ``left_out``."""

    socket: str
    available: bool
    reason: Optional[str] = None
    allocations: list[PodAllocation] = Field(
        default_factory=list, description="the containers holding a GPU device (whole, MIG or replica), by name"
    )
    allocatable: Optional[list[PodDevice]] = Field(
        default=None, description="None where the kubelet does not implement GetAllocatableResources"
    )
    pods: Optional[Annotated[int, Field(ge=0, le=INT64_MAX)]] = Field(
        default=None, description="the pods the kubelet listed; None when it was not read"
    )
    containers: Optional[Annotated[int, Field(ge=0, le=INT64_MAX)]] = Field(
        default=None, description="the containers the kubelet listed, those in allocations and those left out"
    )
    left_out: list[KubernetesLeftOut] = Field(
        default_factory=list,
        max_length=4,
        description="what the kubelet listed that is not here, counted by reason (one entry per reason)",
    )


class NodeCordon(Cordon):
    """A cordon in force on this node, and who set it."""

    by: Literal["policy", "desired-state"]


class StateRefusal(StrictModel):
    """A verified desired state this node will not apply, and why (mode kubernetes-integrated refuses every
    state: ``read-only-mode``)."""

    generation: Annotated[int, Field(ge=1, le=INT64_MAX)]
    payload_sha256: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
    reason: Annotated[str, Field(max_length=64)]
    detail: Annotated[str, Field(max_length=1000)]
    refused_at: UtcTimestamp


class Observation(StrictModel):
    apiVersion: Literal["meridian.node/v1"]
    kind: Literal["Observation"]
    node_id: NodeId
    lease_epoch: Annotated[int, Field(ge=0, le=INT64_MAX)]
    observed_at: UtcTimestamp
    mode: Literal["observe-only", "managed-host", "kubernetes-integrated", "air-gapped"]
    applied_generation: Annotated[int, Field(ge=0, le=INT64_MAX)]
    gpu: GpuFacts
    engines: list[EngineObservation] = Field(default_factory=list)
    artifacts: list[ArtifactObservation] = Field(default_factory=list)
    capacity: Capacity = Field(default_factory=Capacity)
    last_run: Optional[RunSummary] = None
    kubernetes: Optional[KubernetesObservation] = None
    cordons: list[NodeCordon] = Field(default_factory=list)
    refused_state: Optional[StateRefusal] = None
    transfers: list[TransferObservation] = Field(
        default_factory=list,
        max_length=32,
        description="the image pulls and artifact downloads of the apply in flight, refreshed at most every 10 s",
    )


class ServingEndpoint(StrictModel):
    node_id: NodeId
    engine: str
    driver: Driver
    served_model_name: str
    address: Annotated[str, Field(description="host:port the gateway routes to")]


class ServingProjection(StrictModel):
    apiVersion: Literal["meridian.node/v1"]
    kind: Literal["ServingProjection"]
    generated_at: UtcTimestamp
    endpoints: list[ServingEndpoint] = Field(default_factory=list)


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
