"""Read what the NVIDIA driver knows about this host's GPUs, in the shape of ``contracts.GpuFacts``.

Plain dicts out, no pydantic needed: this runs on every agent cycle and inside the ``gpu_facts``
module on hosts that may have nothing but the standard library and nvidia-ml-py. The rules, so that
one bad GPU never hides the others:

- no NVML at all (package, library or driver missing) gives ``nvml_available: false`` and a reason;
- a field the GPU does not support (``NVML_ERROR_NOT_SUPPORTED``) is ``None`` (lists stay empty);
- any other NVML error is named in that GPU's ``error`` ("NVML_ERROR_GPU_IS_LOST while reading
  memory info"); after an error that means the device is gone, nothing more is asked of it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ansible_collections.meridian.node.plugins.module_utils.gpu.nvml import (
    NvmlSession,
    NvmlUnavailable,
    cuda_version_text,
    nvml_session,
)

__all__ = ["MIB", "collect_gpu_facts", "unavailable_facts"]

MIB = 1048576


def unavailable_facts(reason: str, driver_version: str | None = None) -> dict[str, Any]:
    """The facts of a host where NVML cannot be used."""
    return {
        "nvml_available": False,
        "reason": reason,
        "driver_version": driver_version,
        "cuda_driver_version": None,
        "count": 0,
        "gpus": [],
    }


def collect_gpu_facts(nvml: Any = None, *, processes: bool = True, nvlink: bool = True) -> dict[str, Any]:
    """Read every GPU once. ``nvml`` is a pynvml-compatible module; by default the real ``pynvml``.

    ``processes`` and ``nvlink`` switch off the two per-GPU reads that cost the most NVML calls.
    """
    try:
        with nvml_session(nvml) as session:
            return _read_host(session, processes=processes, nvlink=nvlink)
    except NvmlUnavailable as exc:
        return unavailable_facts(exc.reason)


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


def _read_host(session: NvmlSession, *, processes: bool, nvlink: bool) -> dict[str, Any]:
    lib = session.lib
    driver_version = _text(_system_value(session, lib.nvmlSystemGetDriverVersion))
    cuda = _system_value(session, lib.nvmlSystemGetCudaDriverVersion)
    try:
        count = int(lib.nvmlDeviceGetCount())
    except lib.NVMLError as exc:
        return unavailable_facts(
            f"NVML started but nvmlDeviceGetCount failed with {session.name(exc)}: the driver cannot "
            "enumerate GPUs (check dmesg for Xid errors)",
            driver_version,
        )
    return {
        "nvml_available": True,
        "reason": None,
        "driver_version": driver_version,
        "cuda_driver_version": cuda_version_text(cuda if isinstance(cuda, int) else None),
        "count": count,
        "gpus": [_read_gpu(session, index, processes=processes, nvlink=nvlink) for index in range(count)],
    }


class _Reader:
    """Calls NVML for one GPU, turning errors into ``None`` plus a note in the GPU's ``error``."""

    __slots__ = ("errors", "gone", "session")

    def __init__(self, session: NvmlSession) -> None:
        self.session = session
        self.errors: list[str] = []
        self.gone = False

    def get(self, what: str, read: Callable[..., Any], *args: Any) -> Any:
        if self.gone:
            return None
        try:
            return read(*args)
        except self.session.lib.NVMLError as exc:
            if exc.value != self.session.not_supported:
                self.record(exc, what)
            return None

    def record(self, exc: Any, what: str) -> None:
        self.errors.append(f"{self.session.name(exc)} while reading {what}")
        if exc.value in self.session.device_gone:
            self.gone = True

    def error(self) -> str | None:
        return "; ".join(self.errors) if self.errors else None


def _mib(value: Any) -> int | None:
    return value // MIB if isinstance(value, int) else None


def _watts(milliwatts: Any) -> float | None:
    return milliwatts / 1000.0 if isinstance(milliwatts, int) else None


def _read_gpu(session: NvmlSession, index: int, *, processes: bool, nvlink: bool) -> dict[str, Any]:
    lib = session.lib
    reader = _Reader(session)
    gpu: dict[str, Any] = {
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
    }
    handle = reader.get("the device handle", lib.nvmlDeviceGetHandleByIndex, index)
    if handle is None:
        gpu["error"] = reader.error() or "NVML returned no handle for this GPU"
        return gpu

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

    # With MIG on, the parent handle answers process queries only for privileged callers; the MIG
    # device handles answer everyone, per instance.
    process_handles = [handle]
    if gpu["mig_mode"]:
        gpu["mig_instances"], process_handles = _read_mig(reader, handle)
    if processes:
        gpu["processes"] = _read_processes(reader, process_handles)
    if nvlink:
        gpu["nvlink_peers"] = _read_nvlink(reader, handle)
    gpu["error"] = reader.error()
    return gpu


def _mig_profile(name: str | None) -> str | None:
    # NVML names a MIG device after its parent plus the profile: "NVIDIA H100 80GB HBM3 MIG 1g.10gb".
    if name is None:
        return None
    _parent, marker, profile = name.rpartition(" MIG ")
    return profile if marker else name


def _read_mig(reader: _Reader, handle: Any) -> tuple[list[dict[str, Any]], list[Any]]:
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
                reader.record(exc, f"MIG device {slot}")
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


def _read_nvlink(reader: _Reader, handle: Any) -> list[dict[str, Any]]:
    session = reader.session
    lib = session.lib
    peers: list[dict[str, Any]] = []
    for link in range(lib.NVML_NVLINK_MAX_LINKS):
        if reader.gone:
            break
        try:
            state = lib.nvmlDeviceGetNvLinkState(handle, link)
        except lib.NVMLError as exc:
            # INVALID_ARGUMENT: past this GPU's last link. NOT_SUPPORTED on link 0: no NVLink at all.
            # Stopping there keeps a PCIe GPU at one call instead of NVML_NVLINK_MAX_LINKS.
            if exc.value == session.invalid_argument or (exc.value == session.not_supported and link == 0):
                break
            if exc.value != session.not_supported:
                reader.record(exc, f"the state of NVLink {link}")
            continue
        if state != lib.NVML_FEATURE_ENABLED:
            continue
        remote = reader.get(f"the remote PCI info of NVLink {link}", lib.nvmlDeviceGetNvLinkRemotePciInfo, handle, link)
        peers.append({"link": link, "peer_pci_bus_id": _text(remote.busId) if remote is not None else None})
    return peers
