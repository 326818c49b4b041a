"""The desired state a node is told to reach (``DesiredState``: its engines, artifacts, runbook and cordon) and
the artifact manifests it pins (``ArtifactManifest``), each signed on its own."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from ansible_collections.meridian.node.plugins.module_utils.contract_models.base import (
    INT64_MAX,
    AfterValidator,
    Driver,
    Field,
    FormatOne,
    Name,
    NodeId,
    RelativePath,
    Sha256Hex,
    StrictModel,
    UtcTimestamp,
    Version,
    model_validator,
    refuse_file_and_directory,
)
from ansible_collections.meridian.node.plugins.module_utils.contract_models.signed import Envelope
from ansible_collections.meridian.node.plugins.module_utils.engine_rules import (
    IMAGE_REFERENCE,
    MAX_LABELS,
    MAX_VOLUMES,
    READY_TIMEOUT_MAX_S,
    SHM_SIZE_MAX_MIB,
    ULIMIT_MAX,
    label_problem,
    paths_overlap,
    secret_env_problem,
    ulimit_problem,
    volume_problem,
)

__all__ = [
    "ArtifactManifest",
    "ArtifactRef",
    "Cordon",
    "DesiredState",
    "EngineSpec",
    "ImageReference",
    "ManifestFile",
    "ModelRef",
    "Runbook",
]


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
        refuse_file_and_directory(seen)
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
