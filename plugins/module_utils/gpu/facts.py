"""Read what the NVIDIA driver knows about this host's GPUs, in the shape of ``contracts.GpuFacts``.

Plain dicts out, no pydantic needed: this runs on every agent cycle and inside the ``gpu_facts``
module on hosts that may have nothing but the standard library and nvidia-ml-py. The rules, so that
one bad GPU never hides the others:

- no NVML at all (package, library or driver missing) gives ``nvml_available: false`` and a reason;
- a field the GPU does not support (``NVML_ERROR_NOT_SUPPORTED``) is ``None`` (lists stay empty);
- any other NVML error is named in that GPU's ``error`` ("NVML_ERROR_GPU_IS_LOST while reading
  memory info"); after an error that means the device is gone, nothing more is asked of it.

Besides the inventory, each GPU carries GPU feature discovery's facts (compute capability, family, MIG
capability, serial, persistence mode, clocks, PCIe link) and, unless ``health=False``, its health: the
readings of ``gpu.health_read`` and ``gpu.xid_events``, judged by ``gpu.health_rules``. A health read
error goes to the readings' ``read_errors``, where the rules count it, not to ``error``. The host gets
the machine type, the MIG strategy and GFD's labels (``gpu.feature_labels``). docs/GPU_FACTS.md has it all.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any

from ansible_collections.meridian.node.plugins.module_utils._compat import UTC
from ansible_collections.meridian.node.plugins.module_utils.gpu.feature_labels import (
    DMI_PRODUCT_NAME,
    MIG_ATTRIBUTE_LABELS,
    architecture_family,
    gfd_labels,
    mig_strategy,
    read_machine_type,
)
from ansible_collections.meridian.node.plugins.module_utils.gpu.health_read import (
    HealthReader,
    empty_readings,
    read_health,
)
from ansible_collections.meridian.node.plugins.module_utils.gpu.health_rules import judge
from ansible_collections.meridian.node.plugins.module_utils.gpu.nvml import (
    NvmlSession,
    NvmlUnavailable,
    active_nvlinks,
    cuda_version_text,
    nvml_session,
)
from ansible_collections.meridian.node.plugins.module_utils.gpu.xid_events import XidTarget, XidWatch, read_xid_events

__all__ = ["MIB", "collect_gpu_facts", "unavailable_facts"]

MIB = 1048576

# (key in GpuClocks, NVML clock type, NVML call): current clocks, then the maximum each can reach.
_CLOCKS = (
    ("graphics_mhz", "NVML_CLOCK_GRAPHICS", "nvmlDeviceGetClockInfo"),
    ("sm_mhz", "NVML_CLOCK_SM", "nvmlDeviceGetClockInfo"),
    ("memory_mhz", "NVML_CLOCK_MEM", "nvmlDeviceGetClockInfo"),
    ("max_graphics_mhz", "NVML_CLOCK_GRAPHICS", "nvmlDeviceGetMaxClockInfo"),
    ("max_sm_mhz", "NVML_CLOCK_SM", "nvmlDeviceGetMaxClockInfo"),
    ("max_memory_mhz", "NVML_CLOCK_MEM", "nvmlDeviceGetMaxClockInfo"),
)
# The link as trained now, and the most this GPU in this slot can train to (GetMax*, not GetGpuMax*: a Gen5
# GPU in a Gen4 slot is not a degraded link).
_PCIE = (
    ("generation", "nvmlDeviceGetCurrPcieLinkGeneration", "the current PCIe link generation"),
    ("width", "nvmlDeviceGetCurrPcieLinkWidth", "the current PCIe link width"),
    ("max_generation", "nvmlDeviceGetMaxPcieLinkGeneration", "the maximum PCIe link generation"),
    ("max_width", "nvmlDeviceGetMaxPcieLinkWidth", "the maximum PCIe link width"),
)


def unavailable_facts(
    reason: str, driver_version: str | None = None, *, machine_type: str | None = None
) -> dict[str, Any]:
    """The facts of a host where NVML cannot be used."""
    return {
        "nvml_available": False,
        "reason": reason,
        "driver_version": driver_version,
        "cuda_driver_version": None,
        "count": 0,
        "gpus": [],
        "machine_type": machine_type,
        "mig_strategy": None,
        "labels": {},
    }


def collect_gpu_facts(
    nvml: Any = None,
    *,
    processes: bool = True,
    nvlink: bool = True,
    health: bool = True,
    previous: Mapping[str, Mapping[str, Any]] | None = None,
    previous_at: datetime | None = None,
    now: datetime | None = None,
    xids: XidWatch | None = None,
    machine_type_path: str | None = DMI_PRODUCT_NAME,
) -> dict[str, Any]:
    """Read every GPU once. ``nvml`` is a pynvml-compatible module; by default the real ``pynvml``.

    ``processes`` and ``nvlink`` switch off the two per-GPU reads that cost the most NVML calls; ``health``
    the health read and verdict (``health: None`` per GPU). A stateful caller (the agent) passes
    ``previous``, the last ``GpuHealth`` dict per GPU uuid, for the rules that compare reads, with
    ``previous_at``, when that read was taken (the PCIe replay rate needs it), ``now`` (read once, the
    verdicts' clock and the XIDs' time; by default the wall clock) and ``xids``, a :class:`XidWatch` kept open
    across reads, without which only the XIDs during this read can be seen (``gpu.xid_events``).
    ``machine_type_path`` is the DMI product name file (tests point it elsewhere).
    """
    machine_type = read_machine_type(machine_type_path)
    try:
        with nvml_session(nvml) as session:
            facts, mig_attributes = _read_host(
                session,
                processes=processes,
                nvlink=nvlink,
                health=health,
                previous=previous,
                previous_at=previous_at,
                now=now,
                xids=xids,
            )
    except NvmlUnavailable as exc:
        return unavailable_facts(exc.reason, machine_type=machine_type)
    facts["machine_type"] = machine_type
    if facts["nvml_available"]:
        facts["mig_strategy"] = mig_strategy(facts["gpus"])
        facts["labels"] = gfd_labels(facts, mig_attributes=mig_attributes)
    return facts


def _text(value: Any) -> str | None:
    # nvidia-ml-py returns str today; older releases returned bytes from the same calls.
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    return value if value is None else str(value)


def _system_value(session: NvmlSession, read: Callable[[], Any]) -> Any:
    try:
        return read()
    except session.lib.NVMLError:
        # Versions are informative only; a host whose GPUs can be read is still worth reporting.
        return None


class _Reader:
    """Calls NVML for one GPU, turning errors into ``None`` plus a note in the GPU's ``error``."""

    __slots__ = ("errors", "failure", "gone", "session", "unsupported")

    def __init__(self, session: NvmlSession) -> None:
        self.session = session
        self.errors: list[str] = []
        self.gone = False
        self.unsupported = False  # whether the last get() was answered NOT_SUPPORTED
        self.failure: str | None = None  # the last error as a health read error names it

    def get(self, what: str, read: Callable[..., Any], *args: Any) -> Any:
        self.unsupported = False
        if self.gone:
            return None
        try:
            return read(*args)
        except self.session.lib.NVMLError as exc:
            if exc.value == self.session.not_supported:
                self.unsupported = True
            else:
                self.record(exc, what, getattr(read, "__name__", "NVML"))
            return None

    def record(self, exc: Any, what: str, call: str) -> None:
        name = self.session.name(exc)
        self.errors.append(f"{name} while reading {what}")
        self.failure = f"{name} from {call}"
        if exc.value in self.session.device_gone:
            self.gone = True

    def error(self) -> str | None:
        return "; ".join(self.errors) if self.errors else None


class _GpuRead:
    """One GPU's facts plus what its health read and GFD's labels need from the same pass."""

    __slots__ = ("gpu", "handle", "links", "mig_attributes", "reader")

    def __init__(self, gpu: dict[str, Any], reader: _Reader) -> None:
        self.gpu = gpu
        self.reader = reader
        self.handle: Any = None
        self.links: list[int] | None = None  # the active NVLinks, where they were scanned
        self.mig_attributes: dict[str, dict[str, int]] = {}


def _read_host(
    session: NvmlSession,
    *,
    processes: bool,
    nvlink: bool,
    health: bool,
    previous: Mapping[str, Mapping[str, Any]] | None,
    previous_at: datetime | None,
    now: datetime | None,
    xids: XidWatch | None,
) -> tuple[dict[str, Any], dict[str, dict[str, int]]]:
    """The host's facts, and the attributes of its MIG devices by uuid (for GFD's labels only)."""
    lib = session.lib
    driver_version = _text(_system_value(session, lib.nvmlSystemGetDriverVersion))
    cuda = _system_value(session, lib.nvmlSystemGetCudaDriverVersion)
    try:
        count = int(lib.nvmlDeviceGetCount())
    except lib.NVMLError as exc:
        reason = (
            f"NVML started but nvmlDeviceGetCount failed with {session.name(exc)}: the driver cannot "
            "enumerate GPUs (check dmesg for Xid errors)"
        )
        return unavailable_facts(reason, driver_version), {}
    reads = [_read_gpu(session, index, processes=processes, nvlink=nvlink) for index in range(count)]
    if health:
        when = now or datetime.now(UTC)
        _judge_health(session, reads, previous=previous, previous_at=previous_at, now=when, xids=xids)
    mig_attributes: dict[str, dict[str, int]] = {}
    for read in reads:
        mig_attributes.update(read.mig_attributes)
    facts: dict[str, Any] = {
        "nvml_available": True,
        "reason": None,
        "driver_version": driver_version,
        "cuda_driver_version": cuda_version_text(cuda if isinstance(cuda, int) else None),
        "count": count,
        "gpus": [read.gpu for read in reads],
        "machine_type": None,
        "mig_strategy": None,
        "labels": {},
    }
    return facts, mig_attributes


def _mib(value: Any) -> int | None:
    return value // MIB if isinstance(value, int) else None


def _watts(milliwatts: Any) -> float | None:
    return milliwatts / 1000.0 if isinstance(milliwatts, int) else None


def _new_gpu(index: int) -> dict[str, Any]:
    return {
        "index": index,
        "uuid": None,
        "name": None,
        "pci_bus_id": None,
        "memory": {"total_mib": None, "used_mib": None, "free_mib": None},
        "utilization_gpu_percent": None,
        "utilization_memory_percent": None,
        "temperature_c": None,
        "power_draw_w": None,
        "power_limit_w": None,
        "ecc_errors_corrected": None,
        "ecc_errors_uncorrected": None,
        "mig_mode": None,
        "mig_instances": [],
        "processes": [],
        "nvlink_peers": [],
        "error": None,
        "compute_capability": None,
        "architecture": None,
        "mig_capable": None,
        "serial": None,
        "persistence_mode": None,
        "clocks": {key: None for key, _clock, _call in _CLOCKS},
        "pcie": {key: None for key, _call, _what in _PCIE},
        "health": None,
        "cordoned": False,
    }


def _read_gpu(session: NvmlSession, index: int, *, processes: bool, nvlink: bool) -> _GpuRead:
    lib = session.lib
    reader = _Reader(session)
    gpu = _new_gpu(index)
    read = _GpuRead(gpu, reader)
    handle = reader.get("the device handle", lib.nvmlDeviceGetHandleByIndex, index)
    if handle is None:
        gpu["error"] = reader.error() or "NVML returned no handle for this GPU"
        return read
    read.handle = handle

    gpu["uuid"] = _text(reader.get("the UUID", lib.nvmlDeviceGetUUID, handle))
    gpu["name"] = _text(reader.get("the name", lib.nvmlDeviceGetName, handle))
    pci = reader.get("PCI info", lib.nvmlDeviceGetPciInfo, handle)
    gpu["pci_bus_id"] = _text(pci.busId) if pci is not None else None
    memory = reader.get("memory info", lib.nvmlDeviceGetMemoryInfo, handle)
    if memory is not None:
        gpu["memory"] = {
            "total_mib": _mib(memory.total),
            "used_mib": _mib(memory.used),
            "free_mib": _mib(memory.free),
        }
    utilization = reader.get("utilization", lib.nvmlDeviceGetUtilizationRates, handle)
    if utilization is not None:
        gpu["utilization_gpu_percent"] = utilization.gpu
        gpu["utilization_memory_percent"] = utilization.memory
    gpu["temperature_c"] = reader.get("temperature", lib.nvmlDeviceGetTemperature, handle, lib.NVML_TEMPERATURE_GPU)
    gpu["power_draw_w"] = _watts(reader.get("power usage", lib.nvmlDeviceGetPowerUsage, handle))
    gpu["power_limit_w"] = _watts(reader.get("the enforced power limit", lib.nvmlDeviceGetEnforcedPowerLimit, handle))
    gpu["ecc_errors_corrected"] = reader.get(
        "corrected ECC errors",
        lib.nvmlDeviceGetTotalEccErrors,
        handle,
        lib.NVML_MEMORY_ERROR_TYPE_CORRECTED,
        lib.NVML_VOLATILE_ECC,
    )
    gpu["ecc_errors_uncorrected"] = reader.get(
        "uncorrected ECC errors",
        lib.nvmlDeviceGetTotalEccErrors,
        handle,
        lib.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
        lib.NVML_VOLATILE_ECC,
    )
    mig = reader.get("MIG mode", lib.nvmlDeviceGetMigMode, handle)
    gpu["mig_mode"] = None if mig is None else mig[0] == lib.NVML_DEVICE_MIG_ENABLE
    # GFD's test: a GPU is MIG-capable when NVML answers its MIG mode at all.
    gpu["mig_capable"] = True if mig is not None else (False if reader.unsupported else None)
    _read_features(reader, handle, gpu)

    # With MIG on, the parent handle answers process queries only for privileged callers; the MIG
    # device handles answer everyone, per instance.
    process_handles = [handle]
    if gpu["mig_mode"]:
        gpu["mig_instances"], process_handles = _read_mig(read, handle)
    if processes:
        gpu["processes"] = _read_processes(reader, process_handles)
    if nvlink:
        gpu["nvlink_peers"] = _read_nvlink(read, handle)
    gpu["error"] = reader.error()
    return read


def _read_features(reader: _Reader, handle: Any, gpu: dict[str, Any]) -> None:
    """GPU feature discovery's per-GPU facts: compute capability and family, serial, persistence, clocks, PCIe."""
    lib = reader.session.lib
    capability = reader.get("the CUDA compute capability", lib.nvmlDeviceGetCudaComputeCapability, handle)
    if capability is not None:
        major, minor = (int(part) for part in capability)
        gpu["compute_capability"] = f"{major}.{minor}"
        gpu["architecture"] = architecture_family(major, minor)
    gpu["serial"] = _text(reader.get("the serial number", lib.nvmlDeviceGetSerial, handle))
    persistence = reader.get("persistence mode", lib.nvmlDeviceGetPersistenceMode, handle)
    gpu["persistence_mode"] = None if persistence is None else persistence == lib.NVML_FEATURE_ENABLED
    for key, clock, call in _CLOCKS:
        what = f"the {'maximum ' if call == 'nvmlDeviceGetMaxClockInfo' else ''}{clock} clock"
        gpu["clocks"][key] = reader.get(what, getattr(lib, call), handle, getattr(lib, clock))
    for key, call, what in _PCIE:
        gpu["pcie"][key] = reader.get(what, getattr(lib, call), handle)


def _mig_profile(name: str | None) -> str | None:
    # NVML names a MIG device after its parent plus the profile: "NVIDIA H100 80GB HBM3 MIG 1g.10gb".
    if name is None:
        return None
    _parent, marker, profile = name.rpartition(" MIG ")
    return profile if marker else name


def _read_mig(read: _GpuRead, handle: Any) -> tuple[list[dict[str, Any]], list[Any]]:
    reader = read.reader
    session = reader.session
    lib = session.lib
    instances: list[dict[str, Any]] = []
    handles: list[Any] = []
    slots = reader.get("the MIG device count", lib.nvmlDeviceGetMaxMigDeviceCount, handle) or 0
    for slot in range(slots):
        if reader.gone:
            break
        try:
            mig_handle = lib.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
        except lib.NVMLError as exc:
            # Slots without a compute instance answer NOT_FOUND: that is the normal case.
            if exc.value not in (session.not_found, session.not_supported):
                reader.record(exc, f"MIG device {slot}", "nvmlDeviceGetMigDeviceHandleByIndex")
            continue
        where = f"of MIG device {slot}"
        uuid = _text(reader.get(f"the UUID {where}", lib.nvmlDeviceGetUUID, mig_handle))
        if uuid is None:
            # Engines address MIG instances by UUID; one without is of no use to place work on.
            continue
        memory = reader.get(f"memory info {where}", lib.nvmlDeviceGetMemoryInfo, mig_handle)
        instances.append(
            {
                "uuid": uuid,
                "profile": _mig_profile(_text(reader.get(f"the name {where}", lib.nvmlDeviceGetName, mig_handle))),
                "memory_mib": _mib(memory.total) if memory is not None else None,
                "gpu_instance_id": reader.get(
                    f"the GPU instance id {where}", lib.nvmlDeviceGetGpuInstanceId, mig_handle
                ),
                "compute_instance_id": reader.get(
                    f"the compute instance id {where}", lib.nvmlDeviceGetComputeInstanceId, mig_handle
                ),
            }
        )
        # GFD's MIG labels (slices, engines, memory) come from the device's attributes.
        attributes = reader.get(f"the attributes {where}", lib.nvmlDeviceGetAttributes, mig_handle)
        if attributes is not None:
            read.mig_attributes[uuid] = {
                field: int(getattr(attributes, field)) for field, _label in MIG_ATTRIBUTE_LABELS
            }
        handles.append(mig_handle)
    return instances, handles


def _read_processes(reader: _Reader, handles: list[Any]) -> list[dict[str, Any]]:
    lib = reader.session.lib
    by_pid: dict[int, dict[str, Any]] = {}
    for handle in handles:
        for process in reader.get("compute processes", lib.nvmlDeviceGetComputeRunningProcesses, handle) or ():
            used = _mib(process.usedGpuMemory)
            seen = by_pid.get(process.pid)
            if seen is None:
                by_pid[process.pid] = {"pid": process.pid, "used_memory_mib": used}
            elif used is not None:
                # One process on several MIG instances: its footprint on this GPU is the sum.
                seen["used_memory_mib"] = (seen["used_memory_mib"] or 0) + used
    return [by_pid[pid] for pid in sorted(by_pid)]


def _read_nvlink(read: _GpuRead, handle: Any) -> list[dict[str, Any]]:
    reader = read.reader
    lib = reader.session.lib
    if reader.gone:
        return []

    def link_failed(exc: Any, link: int) -> bool:
        reader.record(exc, f"the state of NVLink {link}", "nvmlDeviceGetNvLinkState")
        return reader.gone

    read.links = active_nvlinks(reader.session, handle, link_failed)
    peers: list[dict[str, Any]] = []
    for link in read.links:
        if reader.gone:
            break
        remote = reader.get(f"the remote PCI info of NVLink {link}", lib.nvmlDeviceGetNvLinkRemotePciInfo, handle, link)
        peers.append({"link": link, "peer_pci_bus_id": _text(remote.busId) if remote is not None else None})
    return peers


def _judge_health(
    session: NvmlSession,
    reads: list[_GpuRead],
    *,
    previous: Mapping[str, Mapping[str, Any]] | None,
    previous_at: datetime | None,
    now: datetime,
    xids: XidWatch | None,
) -> None:
    readings: list[dict[str, Any]] = []
    targets: list[XidTarget] = []
    for read in reads:
        reader, gpu = read.reader, read.gpu
        if read.handle is None or reader.gone:
            # Nothing could be asked: the error that stopped the facts read is this GPU's health read error.
            reading = empty_readings()
            reading["read_errors"].append(reader.failure or "NVML returned no handle for this GPU")
        else:
            health_reader = HealthReader(session)
            reading = read_health(health_reader, read.handle, active_links=read.links)
            if gpu["uuid"] is not None and not health_reader.gone:
                targets.append(XidTarget(gpu["uuid"], read.handle, gpu["mig_instances"]))
        readings.append(reading)
    if targets:
        seen = xids.read(session, targets, now=now) if xids is not None else read_xid_events(session, targets, now=now)
        for read, reading in zip(reads, readings):
            found = seen.get(read.gpu["uuid"] or "")
            if found is not None:
                reading["xid_events"].extend(found["xid_events"])
                reading["read_errors"].extend(found["read_errors"])
    for read, reading in zip(reads, readings):
        uuid = read.gpu["uuid"]
        # None: a stateless read (no history at all); {}: a stateful caller's first read of this GPU.
        before = None if previous is None else (previous.get(uuid) or {}) if uuid is not None else {}
        read.gpu["health"] = judge(
            reading, gpu=read.gpu, previous=before, now=now, previous_at=previous_at if before else None
        )
