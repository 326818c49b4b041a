"""A host's GPUs as ``gpu_facts`` returns them (``ansible_facts.meridian_gpus``) and observations carry them:
NVML's readings, GPU feature discovery's labels, and each GPU's health verdict with its reasons."""

from __future__ import annotations

from typing import Annotated, Literal, Optional, Union

from ansible_collections.meridian.node.plugins.module_utils.contract_models.base import Field, StrictModel, UtcTimestamp

__all__ = [
    "ComputeProcess",
    "Gpu",
    "GpuClocks",
    "GpuFacts",
    "GpuHealth",
    "GpuHealthReadings",
    "GpuMemory",
    "HealthReason",
    "HealthVerdict",
    "MigInstance",
    "NvLinkPeer",
    "PcieLink",
    "XidEvent",
]


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
