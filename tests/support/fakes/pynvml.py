"""A fake ``pynvml`` (nvidia-ml-py) driven by a JSON scenario: the hardware seam's stand-in in tests.

Put ``tests/support/fakes`` first on ``PYTHONPATH`` and ``import pynvml`` finds this module; name the scenario
in ``MERIDIAN_FAKE_NVML_SCENARIO`` (a name under ``nvml_scenarios/``, a path to a JSON file, or
``generated:N`` for N H100s), or call :func:`use_scenario` in-process. The scenario is read at each
``nvmlInit``, so one scenario describes one read of the host.

Constants, ``NVMLError`` and its per-code subclasses, and the result structures are the real
package's, loaded from nvidia-ml-py under a private name, so the fake cannot drift from the codes and
types real NVML returns. Only the functions are fake, with the real names and arguments.

Scenario format (every key optional; a device key that is absent or null makes the matching
function raise ``NVML_ERROR_NOT_SUPPORTED``, as NVML does for features a GPU lacks)::

    {"init_error": "NVML_ERROR_LIBRARY_NOT_FOUND",     # nvmlInit raises this
     "driver_version": "550.54.15", "cuda_driver_version": 12040,
     "dmi_product_name": "DGX H100",                   # not NVML: tests write it to the DMI file they inject
     "errors": {"nvmlDeviceGetCount": "NVML_ERROR_UNKNOWN"},  # system calls (and event sets) that fail
     "gpus": [{"uuid": ..., "name": ..., "pci_bus_id": "00000000:1B:00.0",
               "memory": {"total": B, "used": B, "free": B}, "utilization": {"gpu": %, "memory": %},
               "temperature": C, "power_usage_mw": mW, "power_limit_mw": mW,
               "ecc": {"corrected": n, "uncorrected": n}, "mig_mode": [current, pending],
               "max_mig_devices": 7, "mig_devices": [{...same keys, "gpu_instance_id", ...,
                   "attributes": {"memorySizeMB": n, "multiprocessorCount": n, ...}} | null],
               "processes": [{"pid": n, "used_memory": B | null}],
               "nvlinks": ["<remote PCI bus id of an active link>" | null (link down), ...],
               # GPU feature discovery's facts
               "compute_capability": [9, 0], "serial": "1652823054401", "persistence_mode": 1,
               "clocks": {"graphics": MHz, "sm": MHz, "memory": MHz}, "max_clocks": {...same keys},
               "pcie": {"generation": 5, "width": 16, "max_generation": 5, "max_width": 16},
               # health counters
               "retired_pages": {"sbe": n, "dbe": n, "pending": bool},
               "remapped_rows": {"correctable": n, "uncorrectable": n, "pending": bool, "failure": bool},
               "recovery_action": 0,                    # NVML_GPU_RECOVERY_ACTION_*, a field value
               "field_errors": {"NVML_FI_DEV_GET_GPU_RECOVERY_ACTION": "NVML_ERROR_UNKNOWN"},
               "pcie_replay_counter": n,
               "clock_event_reasons": ["nvmlClocksEventReasonSwPowerCap", ...] | bitmask,
               "violation_ns": {"power": ns, "thermal": ns},
               "nvlink_errors": {"crc_flit": n, "crc_data": n, "replay": n, "recovery": n}  # each link
                                | [{...} | null, ...],                                     # per link
               # XID events: what arrives in an event set registered for this GPU, once per scenario
               # load (nvmlInit after use_scenario/change_scenario); raise_xid() adds one at any time
               "event_types": ["nvmlEventTypeXidCriticalError", ...] | bitmask,  # default: the usual
               "events": [{"xid": 79}, {"xid": 31, "gpu_instance_id": 1, "compute_instance_id": 0}],
               "errors": {"nvmlDeviceGetPowerUsage": "NVML_ERROR_UNKNOWN"},  # this call fails
               "lost_at": "nvmlDeviceGetMemoryInfo"}]}  # falls off the bus here, for good

Any NVML_ERROR_* name works in the ``errors`` maps (NOT_SUPPORTED, FUNCTION_NOT_FOUND, GPU_IS_LOST,
RESET_REQUIRED, NO_PERMISSION, TIMEOUT, ...); a GPU_IS_LOST there fails that call only, ``lost_at`` loses the
device for every later call.
"""

import ctypes
import importlib.machinery
import importlib.util
import json
import os
import sys
from collections import Counter
from pathlib import Path
from types import ModuleType
from typing import Any

SCENARIO_ENV = "MERIDIAN_FAKE_NVML_SCENARIO"
SCENARIO_DIR = Path(__file__).resolve().parent / "nvml_scenarios"
_REAL_NAME = "_meridian_real_pynvml"


def _load_real_pynvml() -> ModuleType:
    loaded = sys.modules.get(_REAL_NAME)
    if loaded is not None:
        return loaded
    here = Path(__file__).resolve().parent
    search = [entry for entry in sys.path if Path(entry or ".").resolve() != here]
    found = importlib.machinery.PathFinder.find_spec("pynvml", search)
    if found is None or found.origin is None:
        raise ImportError(
            "the fake pynvml takes its constants and error classes from the real nvidia-ml-py, which is "
            "not installed for this interpreter: pip install nvidia-ml-py"
        )
    # Loaded under a private name: pynvml builds its NVMLError_* classes from sys.modules[__name__],
    # and under its own name that would be this (half-imported) fake.
    spec = importlib.util.spec_from_file_location(_REAL_NAME, found.origin)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[_REAL_NAME] = module
    spec.loader.exec_module(module)
    return module


_real = _load_real_pynvml()
globals().update({name: value for name, value in vars(_real).items() if name.startswith(("NVML_", "NVMLError_"))})
NVMLError: Any = _real.NVMLError
nvmlExceptionClass: Any = _real.nvmlExceptionClass
nvmlFriendlyObject: Any = _real.nvmlFriendlyObject
c_nvmlMemory_t: Any = _real.c_nvmlMemory_t
c_nvmlMemory_v2_t: Any = _real.c_nvmlMemory_v2_t
c_nvmlUtilization_t: Any = _real.c_nvmlUtilization_t
nvmlPciInfo_t: Any = _real.nvmlPciInfo_t
c_nvmlDevice_t: Any = _real.c_nvmlDevice_t
c_nvmlEventData_t: Any = _real.c_nvmlEventData_t
c_nvmlFieldValue_t: Any = _real.c_nvmlFieldValue_t
c_nvmlViolationTime_t: Any = _real.c_nvmlViolationTime_t
c_nvmlDeviceAttributes: Any = _real.c_nvmlDeviceAttributes
globals().update(
    {
        name: value
        for name, value in vars(_real).items()
        if name.startswith(("nvmlEventType", "nvmlClocksEventReason", "nvmlClocksThrottleReason"))
    }
)

_NOT_SUPPORTED: int = _real.NVML_ERROR_NOT_SUPPORTED
_INVALID_ARGUMENT: int = _real.NVML_ERROR_INVALID_ARGUMENT
_NOT_FOUND: int = _real.NVML_ERROR_NOT_FOUND
_GPU_IS_LOST: int = _real.NVML_ERROR_GPU_IS_LOST
_UNINITIALIZED: int = _real.NVML_ERROR_UNINITIALIZED
_TIMEOUT: int = _real.NVML_ERROR_TIMEOUT
_ANY_INSTANCE: int = _real.NVML_GPU_INSTANCE_ID_ANY
# What a data-centre GPU's nvmlDeviceGetSupportedEventTypes answers when the scenario does not say.
_USUAL_EVENT_TYPES: int = (
    _real.nvmlEventTypeSingleBitEccError
    | _real.nvmlEventTypeDoubleBitEccError
    | _real.nvmlEventTypePState
    | _real.nvmlEventTypeXidCriticalError
    | _real.nvmlEventTypeClock
)
_NVLINK_COUNTERS = {
    _real.NVML_NVLINK_ERROR_DL_REPLAY: "replay",
    _real.NVML_NVLINK_ERROR_DL_RECOVERY: "recovery",
    _real.NVML_NVLINK_ERROR_DL_CRC_FLIT: "crc_flit",
    _real.NVML_NVLINK_ERROR_DL_CRC_DATA: "crc_data",
}
_CLOCK_KEYS = {_real.NVML_CLOCK_GRAPHICS: "graphics", _real.NVML_CLOCK_SM: "sm", _real.NVML_CLOCK_MEM: "memory"}

# How often each NVML function was called since the last use_scenario()/reset(): tests use it to pin
# the cost of a read (calls, never wall-clock time).
calls: Counter[str] = Counter()

_programmatic: dict[str, Any] | None = None
_active: dict[str, Any] = {}
_devices: list["_Device"] = []
_init_count = 0
_reload = True  # the next nvmlInit loads the scenario afresh, even where NVML is initialised already
_generation = 0  # scenario loads so far: a scenario's events arrive once per load
_event_sets: list["_EventSet"] = []
# The address of each device's C struct -> the device: how an event's c_nvmlDevice_t finds its handle.
_by_address: dict[int, "_Device"] = {}
# Every nvmlEventSetWait(_v2) timeout asked for, in order: tests check that reads do not block.
event_waits: list[int] = []


class _Device:
    """A device handle: opaque to callers, like the real ``c_nvmlDevice_t``.

    Events point at a device through a real ``c_nvmlDevice_t``; :meth:`pointer` gives that pointer, and the
    fake's functions accept it wherever they accept the handle.
    """

    __slots__ = ("index", "lost", "parent", "spec", "struct")

    def __init__(self, spec: dict[str, Any], index: int, parent: "_Device | None" = None) -> None:
        self.spec = spec
        self.index = index
        self.parent = parent
        self.lost = False
        self.struct: Any = None

    def pointer(self) -> Any:
        if self.struct is None:
            self.struct = _real.struct_c_nvmlDevice_t()
            _by_address[ctypes.addressof(self.struct)] = self
        return ctypes.pointer(self.struct)

    def __repr__(self) -> str:
        kind = "mig device" if self.parent is not None else "device"
        return f"<fake nvml {kind} {self.index}>"


class _EventSet:
    """An event set handle: which GPUs (by uuid) it is registered for, and the events queued in it."""

    __slots__ = ("delivered", "freed", "queue", "registered")

    def __init__(self) -> None:
        self.registered: dict[str, int] = {}  # uuid -> event types mask
        self.queue: list[dict[str, Any]] = []
        self.delivered: dict[str, int] = {}  # uuid -> the scenario load whose events it already has
        self.freed = False

    def __repr__(self) -> str:
        return f"<fake nvml event set for {sorted(self.registered)}>"


def _error(name: str) -> Any:
    code = getattr(_real, name, None)
    if not isinstance(code, int):
        raise ValueError(f"scenario names {name!r}, which is not an NVML_ERROR_* constant of pynvml")
    return NVMLError(code)


def generate_scenario(count: int, *, nvlink: bool = True, processes_per_gpu: int = 1) -> dict[str, Any]:
    """``count`` H100 SXM GPUs in HGX boards of eight, each GPU wired to its board's four NVSwitches."""
    buses = (0x1B, 0x43, 0x52, 0x61, 0x9D, 0xC3, 0xD1, 0xDF)
    total = 81559 * 1048576
    gpus = []
    for index in range(count):
        board, slot = divmod(index, 8)
        switches = [f"{board:08X}:{0x05 + n:02X}:00.0" for n in range(4)]
        used = (index % 5) * 16000 * 1048576
        gpus.append(
            {
                "uuid": f"GPU-{index:08x}-6b1c-4f2e-9a51-{board:012x}",
                "name": "NVIDIA H100 80GB HBM3",
                "pci_bus_id": f"{board:08X}:{buses[slot]:02X}:00.0",
                "memory": {"total": total, "used": used, "free": total - used},
                "utilization": {"gpu": (index * 7) % 101, "memory": (index * 3) % 101},
                "temperature": 30 + index % 40,
                "power_usage_mw": 120000 + index * 1000,
                "power_limit_mw": 700000,
                "ecc": {"corrected": 0, "uncorrected": 0},
                "mig_mode": [0, 0],
                "processes": [
                    {"pid": 10000 + index * 10 + n, "used_memory": 1024 * 1048576} for n in range(processes_per_gpu)
                ],
                "nvlinks": [switches[link * 4 // 18] for link in range(18)] if nvlink else None,
                **healthy_h100(index),
            }
        )
    return {"driver_version": "550.54.15", "cuda_driver_version": 12040, "gpus": gpus}


def healthy_h100(index: int = 0) -> dict[str, Any]:
    """An H100 SXM's feature and health keys, all well: for generated and hand-written scenarios alike."""
    return {
        "compute_capability": [9, 0],
        "serial": f"{1652823054401 + index}",
        "persistence_mode": 1,
        "clocks": {"graphics": 1980, "sm": 1980, "memory": 2619},
        "max_clocks": {"graphics": 1980, "sm": 1980, "memory": 2619},
        "pcie": {"generation": 5, "width": 16, "max_generation": 5, "max_width": 16},
        # Hopper remaps rows instead of retiring pages: nvmlDeviceGetRetiredPages is NOT_SUPPORTED there.
        "remapped_rows": {"correctable": 0, "uncorrectable": 0, "pending": False, "failure": False},
        "recovery_action": 0,
        "pcie_replay_counter": 0,
        "clock_event_reasons": 0,
        "violation_ns": {"power": 0, "thermal": 0},
        "nvlink_errors": {"crc_flit": 0, "crc_data": 0, "replay": 0, "recovery": 0},
    }


def _resolve(spec: str) -> dict[str, Any]:
    if spec.startswith("generated:"):
        return generate_scenario(int(spec.partition(":")[2]))
    path = Path(spec)
    if path.suffix != ".json" and os.sep not in spec:
        path = SCENARIO_DIR / f"{spec}.json"
    try:
        loaded = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise RuntimeError(f"fake pynvml: cannot read scenario {spec!r} ({path}): {exc}") from exc
    if not isinstance(loaded, dict):
        raise RuntimeError(f"fake pynvml: scenario {path} must be a JSON object")
    return loaded


def use_scenario(scenario: dict[str, Any] | str | Path | None) -> None:
    """Drive the fake from this scenario (a dict, a name, a path) instead of the environment."""
    global _programmatic
    _programmatic = scenario if scenario is None or isinstance(scenario, dict) else _resolve(str(scenario))
    reset()


def change_scenario(scenario: dict[str, Any] | str | Path) -> None:
    """The host changes between two reads: the next nvmlInit loads this scenario, while what is open stays
    open (initialisations, event sets and their registrations, call counts), as a long-lived reader sees it."""
    global _programmatic, _reload
    _programmatic = scenario if isinstance(scenario, dict) else _resolve(str(scenario))
    _reload = True


def reset() -> None:
    """Forget call counts, event sets and any initialisation left over from an earlier test."""
    global _init_count, _reload
    calls.clear()
    event_waits.clear()
    _event_sets.clear()
    _by_address.clear()
    _init_count = 0
    _reload = True


def init_count() -> int:
    """How many nvmlInit calls are not yet matched by nvmlShutdown."""
    return _init_count


def open_event_sets() -> int:
    """How many event sets were created and not freed (all die with the last nvmlShutdown)."""
    return sum(1 for event_set in _event_sets if not event_set.freed)


def raise_xid(
    gpu_index: int, xid: int, *, gpu_instance_id: int | None = None, compute_instance_id: int | None = None
) -> int:
    """An XID happens now on GPU ``gpu_index``: queued in every open set registered for it, as NVML does
    (and in no set registered later). Returns how many sets got it."""
    uuid = _devices[gpu_index].spec.get("uuid")
    event = {"xid": xid, "gpu_instance_id": gpu_instance_id, "compute_instance_id": compute_instance_id}
    got = 0
    for event_set in _event_sets:
        if not event_set.freed and event_set.registered.get(str(uuid), 0) & _real.nvmlEventTypeXidCriticalError:
            event_set.queue.append({**event, "uuid": uuid})
            got += 1
    return got


def _current_scenario() -> dict[str, Any]:
    if _programmatic is not None:
        return _programmatic
    spec = os.environ.get(SCENARIO_ENV)
    if not spec:
        raise RuntimeError(
            f"fake pynvml: no scenario; set {SCENARIO_ENV} to a name under {SCENARIO_DIR}, a JSON path or "
            "generated:N, or call use_scenario()"
        )
    return _resolve(spec)


def _system(name: str) -> None:
    calls[name] += 1
    if _init_count <= 0:
        raise NVMLError(_UNINITIALIZED)
    failure = _active.get("errors", {}).get(name)
    if failure:
        raise _error(failure)


def _handle(handle: Any) -> _Device:
    if isinstance(handle, _Device):
        return handle
    if isinstance(handle, c_nvmlDevice_t) and handle:
        found = _by_address.get(ctypes.addressof(handle.contents))
        if found is not None:
            return found
    raise NVMLError(_INVALID_ARGUMENT)


def _device(name: str, found: Any) -> _Device:
    _system(name)
    handle = _handle(found)
    root = handle.parent or handle
    if root.lost:
        raise NVMLError(_GPU_IS_LOST)
    if root.spec.get("lost_at") == name:
        root.lost = True
        raise NVMLError(_GPU_IS_LOST)
    failure = handle.spec.get("errors", {}).get(name)
    if failure:
        raise _error(failure)
    return handle


def _value(device: _Device, key: str) -> Any:
    value = device.spec.get(key)
    if value is None:
        raise NVMLError(_NOT_SUPPORTED)
    return value


def nvmlInitWithFlags(flags: int) -> None:
    global _active, _devices, _init_count, _reload, _generation
    calls["nvmlInitWithFlags"] += 1
    if _init_count <= 0 or _reload:
        # A new read of the host: NVML's own reference count would keep the old state while initialised,
        # but a scenario describes one read, so a changed scenario is loaded at the next nvmlInit.
        scenario = _current_scenario()
        if scenario.get("init_error"):
            raise _error(scenario["init_error"])
        _active = scenario
        _devices = [_Device(spec, index) for index, spec in enumerate(scenario.get("gpus", []))]
        _generation += 1
        _reload = False
    _init_count += 1


def nvmlInit() -> None:
    nvmlInitWithFlags(0)


def nvmlShutdown() -> None:
    global _init_count, _reload
    _system("nvmlShutdown")
    _init_count -= 1
    if _init_count == 0:
        # The last shutdown frees what NVML held: event sets die, and the next nvmlInit reads afresh.
        for event_set in _event_sets:
            event_set.freed = True
        _reload = True


def nvmlErrorString(result: int) -> str:
    return str(_real.NVMLError._errcode_to_string.get(result, f"NVML Error with code {result}"))


def nvmlSystemGetDriverVersion() -> str:
    _system("nvmlSystemGetDriverVersion")
    return str(_active.get("driver_version", "550.54.15"))


def nvmlSystemGetCudaDriverVersion() -> int:
    _system("nvmlSystemGetCudaDriverVersion")
    return int(_active.get("cuda_driver_version", 12040))


def nvmlDeviceGetCount() -> int:
    _system("nvmlDeviceGetCount")
    return len(_devices)


def nvmlDeviceGetHandleByIndex(index: int) -> _Device:
    if not 0 <= index < len(_devices):
        _system("nvmlDeviceGetHandleByIndex")
        raise NVMLError(_INVALID_ARGUMENT)
    return _device("nvmlDeviceGetHandleByIndex", _devices[index])


def nvmlDeviceGetUUID(handle: Any) -> str:
    return str(_value(_device("nvmlDeviceGetUUID", handle), "uuid"))


def nvmlDeviceGetName(handle: Any) -> str:
    return str(_value(_device("nvmlDeviceGetName", handle), "name"))


def nvmlDeviceGetPciInfo(handle: Any) -> Any:
    bus_id = str(_value(_device("nvmlDeviceGetPciInfo", handle), "pci_bus_id"))
    return _pci_info(bus_id)


def _pci_info(bus_id: str) -> Any:
    domain, bus, rest = bus_id.split(":")
    info = nvmlPciInfo_t()
    info.busId = bus_id
    info.busIdLegacy = bus_id[4:]
    info.domain = int(domain, 16)
    info.bus = int(bus, 16)
    info.device = int(rest.split(".")[0], 16)
    return info


def nvmlDeviceGetMemoryInfo(handle: Any, version: int | None = None) -> Any:
    memory = _value(_device("nvmlDeviceGetMemoryInfo", handle), "memory")
    if version:
        return c_nvmlMemory_v2_t(
            version=version, total=memory["total"], reserved=0, free=memory["free"], used=memory["used"]
        )
    return c_nvmlMemory_t(total=memory["total"], free=memory["free"], used=memory["used"])


def nvmlDeviceGetUtilizationRates(handle: Any) -> Any:
    rates = _value(_device("nvmlDeviceGetUtilizationRates", handle), "utilization")
    return c_nvmlUtilization_t(gpu=rates["gpu"], memory=rates["memory"])


def nvmlDeviceGetTemperature(handle: Any, sensor: int) -> int:
    device = _device("nvmlDeviceGetTemperature", handle)
    if sensor != _real.NVML_TEMPERATURE_GPU:
        raise NVMLError(_INVALID_ARGUMENT)
    return int(_value(device, "temperature"))


def nvmlDeviceGetPowerUsage(handle: Any) -> int:
    return int(_value(_device("nvmlDeviceGetPowerUsage", handle), "power_usage_mw"))


def nvmlDeviceGetEnforcedPowerLimit(handle: Any) -> int:
    return int(_value(_device("nvmlDeviceGetEnforcedPowerLimit", handle), "power_limit_mw"))


def nvmlDeviceGetTotalEccErrors(handle: Any, errorType: int, counterType: int) -> int:
    ecc = _value(_device("nvmlDeviceGetTotalEccErrors", handle), "ecc")
    kinds = {
        _real.NVML_MEMORY_ERROR_TYPE_CORRECTED: "corrected",
        _real.NVML_MEMORY_ERROR_TYPE_UNCORRECTED: "uncorrected",
    }
    if errorType not in kinds or counterType not in (_real.NVML_VOLATILE_ECC, _real.NVML_AGGREGATE_ECC):
        raise NVMLError(_INVALID_ARGUMENT)
    return int(ecc[kinds[errorType]])


def nvmlDeviceGetMigMode(device: Any) -> list[int]:
    current, pending = _value(_device("nvmlDeviceGetMigMode", device), "mig_mode")
    return [int(current), int(pending)]


def nvmlDeviceGetMaxMigDeviceCount(device: Any) -> int:
    return int(_value(_device("nvmlDeviceGetMaxMigDeviceCount", device), "max_mig_devices"))


def nvmlDeviceGetMigDeviceHandleByIndex(device: Any, index: int) -> _Device:
    parent = _device("nvmlDeviceGetMigDeviceHandleByIndex", device)
    if not 0 <= index < int(_value(parent, "max_mig_devices")):
        raise NVMLError(_INVALID_ARGUMENT)
    slots = parent.spec.get("mig_devices") or []
    if index >= len(slots) or slots[index] is None:
        raise NVMLError(_NOT_FOUND)
    return _Device(slots[index], index, parent)


def _mig_only(name: str, device: Any, key: str) -> int:
    handle = _device(name, device)
    if handle.parent is None:
        raise NVMLError(_NOT_SUPPORTED)
    return int(_value(handle, key))


def nvmlDeviceGetGpuInstanceId(device: Any) -> int:
    return _mig_only("nvmlDeviceGetGpuInstanceId", device, "gpu_instance_id")


def nvmlDeviceGetComputeInstanceId(device: Any) -> int:
    return _mig_only("nvmlDeviceGetComputeInstanceId", device, "compute_instance_id")


def nvmlDeviceGetComputeRunningProcesses(handle: Any) -> list[Any]:
    device = _device("nvmlDeviceGetComputeRunningProcesses", handle)
    gpu_instance = device.spec.get("gpu_instance_id", 0xFFFFFFFF)
    compute_instance = device.spec.get("compute_instance_id", 0xFFFFFFFF)
    return [
        nvmlFriendlyObject(
            {
                "pid": process["pid"],
                # nvidia-ml-py turns NVML_VALUE_NOT_AVAILABLE into None; so does the scenario's null.
                "usedGpuMemory": process.get("used_memory"),
                "gpuInstanceId": gpu_instance,
                "computeInstanceId": compute_instance,
            }
        )
        for process in _value(device, "processes")
    ]


def _link(name: str, device: Any, link: int) -> str | None:
    links = _value(_device(name, device), "nvlinks")
    if not 0 <= link < len(links):
        raise NVMLError(_INVALID_ARGUMENT)
    remote: str | None = links[link]
    return remote


def nvmlDeviceGetNvLinkState(device: Any, link: int) -> int:
    remote = _link("nvmlDeviceGetNvLinkState", device, link)
    return int(_real.NVML_FEATURE_ENABLED if remote else _real.NVML_FEATURE_DISABLED)


def nvmlDeviceGetNvLinkRemotePciInfo(device: Any, link: int) -> Any:
    remote = _link("nvmlDeviceGetNvLinkRemotePciInfo", device, link)
    if remote is None:
        raise NVMLError(_NOT_SUPPORTED)
    return _pci_info(remote)


def nvmlDeviceGetAttributes(device: Any) -> Any:
    attributes = _value(_device("nvmlDeviceGetAttributes", device), "attributes")
    return c_nvmlDeviceAttributes(**attributes)


# --- GPU feature discovery's facts ------------------------------------------------------------------


def nvmlDeviceGetCudaComputeCapability(handle: Any) -> tuple[int, int]:
    major, minor = _value(_device("nvmlDeviceGetCudaComputeCapability", handle), "compute_capability")
    return (int(major), int(minor))


def nvmlDeviceGetSerial(handle: Any) -> str:
    return str(_value(_device("nvmlDeviceGetSerial", handle), "serial"))


def nvmlDeviceGetPersistenceMode(handle: Any) -> int:
    return int(_value(_device("nvmlDeviceGetPersistenceMode", handle), "persistence_mode"))


def _clock(name: str, handle: Any, key: str, clock_type: int) -> int:
    clocks = _value(_device(name, handle), key)
    if clock_type not in _CLOCK_KEYS:
        raise NVMLError(_INVALID_ARGUMENT)
    value = clocks.get(_CLOCK_KEYS[clock_type])
    if value is None:
        raise NVMLError(_NOT_SUPPORTED)
    return int(value)


def nvmlDeviceGetClockInfo(handle: Any, type: int) -> int:
    return _clock("nvmlDeviceGetClockInfo", handle, "clocks", type)


def nvmlDeviceGetMaxClockInfo(handle: Any, type: int) -> int:
    return _clock("nvmlDeviceGetMaxClockInfo", handle, "max_clocks", type)


def _pcie(name: str, handle: Any, key: str) -> int:
    value = _value(_device(name, handle), "pcie").get(key)
    if value is None:
        raise NVMLError(_NOT_SUPPORTED)
    return int(value)


def nvmlDeviceGetCurrPcieLinkGeneration(handle: Any) -> int:
    return _pcie("nvmlDeviceGetCurrPcieLinkGeneration", handle, "generation")


def nvmlDeviceGetCurrPcieLinkWidth(handle: Any) -> int:
    return _pcie("nvmlDeviceGetCurrPcieLinkWidth", handle, "width")


def nvmlDeviceGetMaxPcieLinkGeneration(handle: Any) -> int:
    return _pcie("nvmlDeviceGetMaxPcieLinkGeneration", handle, "max_generation")


def nvmlDeviceGetMaxPcieLinkWidth(handle: Any) -> int:
    return _pcie("nvmlDeviceGetMaxPcieLinkWidth", handle, "max_width")


# --- health counters ----------------------------------------------------------------------------------


def nvmlDeviceGetRetiredPages(device: Any, sourceFilter: int) -> list[int]:
    pages = _value(_device("nvmlDeviceGetRetiredPages", device), "retired_pages")
    causes = {
        _real.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS: ("sbe", 0x1000),
        _real.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR: ("dbe", 0x8000),
    }
    if sourceFilter not in causes:
        raise NVMLError(_INVALID_ARGUMENT)
    key, base = causes[sourceFilter]
    # Page addresses, as NVML lists them; callers count them.
    return [base + page * 0x10 for page in range(int(pages.get(key, 0)))]


def nvmlDeviceGetRetiredPagesPendingStatus(device: Any) -> int:
    pages = _value(_device("nvmlDeviceGetRetiredPagesPendingStatus", device), "retired_pages")
    return int(_real.NVML_FEATURE_ENABLED if pages.get("pending") else _real.NVML_FEATURE_DISABLED)


def nvmlDeviceGetRemappedRows(device: Any) -> tuple[int, int, int, int]:
    rows = _value(_device("nvmlDeviceGetRemappedRows", device), "remapped_rows")
    return (
        int(rows.get("correctable", 0)),
        int(rows.get("uncorrectable", 0)),
        int(bool(rows.get("pending"))),
        int(bool(rows.get("failure"))),
    )


def nvmlDeviceGetFieldValues(handle: Any, fieldIds: list[Any]) -> Any:
    device = _device("nvmlDeviceGetFieldValues", handle)
    values = (c_nvmlFieldValue_t * len(fieldIds))()
    field_names = {
        _real.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION: ("NVML_FI_DEV_GET_GPU_RECOVERY_ACTION", "recovery_action")
    }
    for slot, field_id in enumerate(fieldIds):
        value = values[slot]
        value.fieldId = field_id
        value.valueType = _real.NVML_VALUE_TYPE_UNSIGNED_INT
        name, key = field_names.get(field_id, ("", ""))
        failure = device.spec.get("field_errors", {}).get(name)
        if failure:
            value.nvmlReturn = _error(failure).value
        elif not key or device.spec.get(key) is None:
            # Per field, as NVML does: the call succeeds and this field says NOT_SUPPORTED.
            value.nvmlReturn = _NOT_SUPPORTED
        else:
            value.nvmlReturn = _real.NVML_SUCCESS
            value.value.uiVal = int(device.spec[key])
    return values


def nvmlDeviceGetPcieReplayCounter(handle: Any) -> int:
    return int(_value(_device("nvmlDeviceGetPcieReplayCounter", handle), "pcie_replay_counter"))


def _mask(value: Any) -> int:
    if isinstance(value, int):
        return value
    mask = 0
    for name in value:
        bit = getattr(_real, name, None)
        if not isinstance(bit, int):
            raise ValueError(f"scenario names {name!r}, which is not a pynvml constant")
        mask |= bit
    return mask


def nvmlDeviceGetCurrentClocksEventReasons(handle: Any) -> int:
    return _mask(_value(_device("nvmlDeviceGetCurrentClocksEventReasons", handle), "clock_event_reasons"))


def nvmlDeviceGetCurrentClocksThrottleReasons(handle: Any) -> int:
    return _mask(_value(_device("nvmlDeviceGetCurrentClocksThrottleReasons", handle), "clock_event_reasons"))


def nvmlDeviceGetViolationStatus(device: Any, perfPolicyType: int) -> Any:
    violations = _value(_device("nvmlDeviceGetViolationStatus", device), "violation_ns")
    policies = {_real.NVML_PERF_POLICY_POWER: "power", _real.NVML_PERF_POLICY_THERMAL: "thermal"}
    if perfPolicyType not in policies:
        raise NVMLError(_INVALID_ARGUMENT)
    nanoseconds = violations.get(policies[perfPolicyType])
    if nanoseconds is None:
        raise NVMLError(_NOT_SUPPORTED)
    return c_nvmlViolationTime_t(referenceTime=1_700_000_000_000_000_000, violationTime=int(nanoseconds))


def nvmlDeviceGetNvLinkErrorCounter(device: Any, link: int, counter: int) -> int:
    handle = _device("nvmlDeviceGetNvLinkErrorCounter", device)
    links = _value(handle, "nvlinks")
    if not 0 <= link < len(links) or counter not in _NVLINK_COUNTERS:
        raise NVMLError(_INVALID_ARGUMENT)
    errors = _value(handle, "nvlink_errors")
    per_link = errors[link] if isinstance(errors, list) else errors
    if per_link is None or per_link.get(_NVLINK_COUNTERS[counter]) is None:
        raise NVMLError(_NOT_SUPPORTED)
    return int(per_link[_NVLINK_COUNTERS[counter]])


# --- events ------------------------------------------------------------------------------------------


def nvmlDeviceGetSupportedEventTypes(handle: Any) -> int:
    device = _device("nvmlDeviceGetSupportedEventTypes", handle)
    if "event_types" not in device.spec:
        return _USUAL_EVENT_TYPES
    return _mask(_value(device, "event_types"))


def _event_set(eventSet: Any) -> _EventSet:
    if not isinstance(eventSet, _EventSet):
        raise NVMLError(_INVALID_ARGUMENT)
    if eventSet.freed:
        # A freed set, or one NVML dropped at its last shutdown: using it is the caller's bug.
        raise NVMLError(_UNINITIALIZED)
    return eventSet


def nvmlEventSetCreate() -> _EventSet:
    _system("nvmlEventSetCreate")
    event_set = _EventSet()
    _event_sets.append(event_set)
    return event_set


def nvmlDeviceRegisterEvents(handle: Any, eventTypes: int, eventSet: Any) -> None:
    device = _device("nvmlDeviceRegisterEvents", handle)
    event_set = _event_set(eventSet)
    if device.parent is not None:
        raise NVMLError(_NOT_SUPPORTED)  # NVML registers whole GPUs; MIG events come through the parent
    if eventTypes & ~nvmlDeviceGetSupportedEventTypes(device):
        raise NVMLError(_NOT_SUPPORTED)
    uuid = str(device.spec.get("uuid"))
    event_set.registered[uuid] = event_set.registered.get(uuid, 0) | eventTypes
    # Registered now: this scenario load's events arrive here (and nothing raised before registration).
    _scenario_events(event_set)


def _scenario_events(event_set: _EventSet) -> None:
    # A scenario loaded since the set was registered brings its events, once.
    for device in _devices:
        uuid = str(device.spec.get("uuid"))
        mask = event_set.registered.get(uuid, 0)
        if mask & _real.nvmlEventTypeXidCriticalError and event_set.delivered.get(uuid) != _generation:
            event_set.delivered[uuid] = _generation
            event_set.queue.extend({**event, "uuid": uuid} for event in device.spec.get("events") or ())


def _wait(name: str, eventSet: Any, timeoutms: int) -> Any:
    _system(name)
    event_set = _event_set(eventSet)
    event_waits.append(int(timeoutms))
    _scenario_events(event_set)
    if not event_set.queue:
        raise NVMLError(_TIMEOUT)  # without sleeping: tests pin calls, never time
    event = event_set.queue.pop(0)
    device = next((device for device in _devices if device.spec.get("uuid") == event["uuid"]), None)
    data = c_nvmlEventData_t()
    if device is not None:
        data.device = device.pointer()
    data.eventType = _real.nvmlEventTypeXidCriticalError
    data.eventData = int(event["xid"])
    gpu_instance = event.get("gpu_instance_id")
    compute_instance = event.get("compute_instance_id")
    data.gpuInstanceId = _ANY_INSTANCE if gpu_instance is None else int(gpu_instance)
    data.computeInstanceId = _ANY_INSTANCE if compute_instance is None else int(compute_instance)
    return data


def nvmlEventSetWait_v2(eventSet: Any, timeoutms: int) -> Any:
    return _wait("nvmlEventSetWait_v2", eventSet, timeoutms)


def nvmlEventSetWait(eventSet: Any, timeoutms: int) -> Any:
    return _wait("nvmlEventSetWait", eventSet, timeoutms)


def nvmlEventSetFree(eventSet: Any) -> None:
    _system("nvmlEventSetFree")
    _event_set(eventSet).freed = True
