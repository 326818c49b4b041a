"""What a node reports (``Observation``: its GPUs, engines, artifacts, capacity, last run, cordons, what the
kubelet runs, transfers in flight) and what the control plane projects from observations for a gateway
(``ServingProjection``)."""

from __future__ import annotations

from typing import Annotated, Literal, Optional

from ansible_collections.meridian.node.plugins.module_utils.contract_models.base import (
    INT64_MAX,
    Driver,
    Field,
    NodeId,
    StrictModel,
    UtcTimestamp,
)
from ansible_collections.meridian.node.plugins.module_utils.contract_models.gpu_facts import GpuFacts, HealthVerdict
from ansible_collections.meridian.node.plugins.module_utils.contract_models.state import Cordon

__all__ = [
    "OBSERVED_LOG_LINES",
    "OBSERVED_LOG_LINE_CHARS",
    "ArtifactObservation",
    "Capacity",
    "EngineObservation",
    "KubernetesLeftOut",
    "KubernetesObservation",
    "NodeCordon",
    "Observation",
    "PodAllocation",
    "PodDevice",
    "RunSummary",
    "ServingEndpoint",
    "ServingProjection",
    "StateRefusal",
    "TransferObservation",
]

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
