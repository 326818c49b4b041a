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
     "errors": {"nvmlDeviceGetCount": "NVML_ERROR_UNKNOWN"},  # system calls that fail
     "gpus": [{"uuid": ..., "name": ..., "pci_bus_id": "00000000:1B:00.0",
               "memory": {"total": B, "used": B, "free": B}, "utilization": {"gpu": %, "memory": %},
               "temperature": C, "power_usage_mw": mW, "power_limit_mw": mW,
               "ecc": {"corrected": n, "uncorrected": n}, "mig_mode": [current, pending],
               "max_mig_devices": 7, "mig_devices": [{...same keys, "gpu_instance_id", ...} | null],
               "processes": [{"pid": n, "used_memory": B | null}],
               "nvlinks": ["<remote PCI bus id of an active link>" | null (link down), ...],
               "errors": {"nvmlDeviceGetPowerUsage": "NVML_ERROR_UNKNOWN"},  # this call fails
               "lost_at": "nvmlDeviceGetMemoryInfo"}]}  # falls off the bus here, for good
"""

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

_NOT_SUPPORTED: int = _real.NVML_ERROR_NOT_SUPPORTED
_INVALID_ARGUMENT: int = _real.NVML_ERROR_INVALID_ARGUMENT
_NOT_FOUND: int = _real.NVML_ERROR_NOT_FOUND
_GPU_IS_LOST: int = _real.NVML_ERROR_GPU_IS_LOST
_UNINITIALIZED: int = _real.NVML_ERROR_UNINITIALIZED

# How often each NVML function was called since the last use_scenario()/reset(): tests use it to pin
# the cost of a read (calls, never wall-clock time).
calls: Counter[str] = Counter()

_programmatic: dict[str, Any] | None = None
_active: dict[str, Any] = {}
_devices: list["_Device"] = []
_init_count = 0


class _Device:
    """A device handle: opaque to callers, like the real ``c_nvmlDevice_t``."""

    __slots__ = ("index", "lost", "parent", "spec")

    def __init__(self, spec: dict[str, Any], index: int, parent: "_Device | None" = None) -> None:
        self.spec = spec
        self.index = index
        self.parent = parent
        self.lost = False

    def __repr__(self) -> str:
        kind = "mig device" if self.parent is not None else "device"
        return f"<fake nvml {kind} {self.index}>"


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
            }
        )
    return {"driver_version": "550.54.15", "cuda_driver_version": 12040, "gpus": gpus}


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


def reset() -> None:
    """Forget call counts and any initialisation left over from an earlier test."""
    global _init_count
    calls.clear()
    _init_count = 0


def init_count() -> int:
    """How many nvmlInit calls are not yet matched by nvmlShutdown."""
    return _init_count


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


def _device(name: str, handle: Any) -> _Device:
    _system(name)
    if not isinstance(handle, _Device):
        raise NVMLError(_INVALID_ARGUMENT)
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
    global _active, _devices, _init_count
    calls["nvmlInitWithFlags"] += 1
    scenario = _current_scenario()
    if scenario.get("init_error"):
        raise _error(scenario["init_error"])
    _active = scenario
    _devices = [_Device(spec, index) for index, spec in enumerate(scenario.get("gpus", []))]
    _init_count += 1


def nvmlInit() -> None:
    nvmlInitWithFlags(0)


def nvmlShutdown() -> None:
    global _init_count
    _system("nvmlShutdown")
    _init_count -= 1


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
