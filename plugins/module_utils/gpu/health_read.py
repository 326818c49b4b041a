"""One GPU's health counters from NVML, as ``contracts.GpuHealthReadings`` in a plain dict.

Reads, never judges: ``gpu.health_rules.judge`` turns these readings into a verdict. The counters are the
ones DCGM's health watches look at (retired pages, remapped rows, the driver's recovery action, PCIe
replays, clock-event reasons, power and thermal violation time, NVLink error counters); XID events come
from ``gpu.xid_events`` and the volatile uncorrected ECC count stays in the GPU's own
``ecc_errors_uncorrected``.

Errors, read literally as the issue's rule has it (gpustack/runtime PR #26: a wedged GPU was passed as
healthy because NVML errors were swallowed):

- ``NVML_ERROR_NOT_SUPPORTED`` is the GPU saying it has no such counter: the reading is ``None``;
- any other error, ``NVML_ERROR_FUNCTION_NOT_FOUND`` included (a driver too old for the call), is named
  with the call in ``read_errors`` ("NVML_ERROR_UNKNOWN from nvmlDeviceGetRemappedRows"), and the rules
  count it against the GPU. The one exception is the clock-event reasons call, whose older name
  (``...ThrottleReasons``, same ABI) is used when the driver lacks the new one: that is the same reading;
- after an error that means the device is gone (``NvmlSession.device_gone``) nothing more is asked of it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ansible_collections.meridian.node.plugins.module_utils.gpu.nvml import NvmlSession, active_nvlinks

__all__ = [
    "CLOCK_EVENT_REASONS",
    "NVLINK_ERROR_COUNTERS",
    "RECOVERY_ACTIONS",
    "HealthReader",
    "empty_readings",
    "read_health",
]

# nvmlClocksEventReason<suffix> (nvmlClocksThrottleReason<suffix> in older nvidia-ml-py) -> the name we report.
# The rules decide which of them matter; gpu_idle and applications_clocks_setting are normal states.
CLOCK_EVENT_REASONS = (
    ("GpuIdle", "gpu_idle"),
    ("ApplicationsClocksSetting", "applications_clocks_setting"),
    ("SwPowerCap", "sw_power_cap"),
    ("HwSlowdown", "hw_slowdown"),
    ("SyncBoost", "sync_boost"),
    ("SwThermalSlowdown", "sw_thermal_slowdown"),
    ("HwThermalSlowdown", "hw_thermal_slowdown"),
    ("HwPowerBrakeSlowdown", "hw_power_brake_slowdown"),
    ("DisplayClockSetting", "display_clock_setting"),
)

# NVML_GPU_RECOVERY_ACTION_* (the driver's own verdict, NVML_FI_DEV_GET_GPU_RECOVERY_ACTION) -> contract value.
RECOVERY_ACTIONS = (
    ("NVML_GPU_RECOVERY_ACTION_NONE", "none"),
    ("NVML_GPU_RECOVERY_ACTION_GPU_RESET", "reset"),
    ("NVML_GPU_RECOVERY_ACTION_NODE_REBOOT", "reboot"),
    ("NVML_GPU_RECOVERY_ACTION_DRAIN_P2P", "drain-p2p"),
    ("NVML_GPU_RECOVERY_ACTION_DRAIN_AND_RESET", "drain-and-reset"),
)

# The data-link counters DCGM's NVLink health watch sums; summed here over the active links.
NVLINK_ERROR_COUNTERS = (
    "NVML_NVLINK_ERROR_DL_CRC_FLIT",
    "NVML_NVLINK_ERROR_DL_CRC_DATA",
    "NVML_NVLINK_ERROR_DL_REPLAY",
    "NVML_NVLINK_ERROR_DL_RECOVERY",
)

_RECOVERY_FIELD = "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION"
_VIOLATIONS = (("power_violation_ns", "NVML_PERF_POLICY_POWER"), ("thermal_violation_ns", "NVML_PERF_POLICY_THERMAL"))
_RETIRED_PAGES = (
    ("retired_pages_sbe", "NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS"),
    ("retired_pages_dbe", "NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR"),
)
# nvmlValue_t's member per NVML_VALUE_TYPE_*.
_VALUE_MEMBERS = (
    ("NVML_VALUE_TYPE_DOUBLE", "dVal"),
    ("NVML_VALUE_TYPE_UNSIGNED_INT", "uiVal"),
    ("NVML_VALUE_TYPE_UNSIGNED_LONG", "ulVal"),
    ("NVML_VALUE_TYPE_UNSIGNED_LONG_LONG", "ullVal"),
    ("NVML_VALUE_TYPE_SIGNED_LONG_LONG", "sllVal"),
    ("NVML_VALUE_TYPE_SIGNED_INT", "siVal"),
    ("NVML_VALUE_TYPE_UNSIGNED_SHORT", "usVal"),
)


def empty_readings() -> dict[str, Any]:
    """Readings with nothing read: every counter ``None``, no events, no errors."""
    return {
        "retired_pages_sbe": None,
        "retired_pages_dbe": None,
        "retirement_pending": None,
        "remapped_rows_correctable": None,
        "remapped_rows_uncorrectable": None,
        "remap_pending": None,
        "remap_failure": None,
        "recovery_action": None,
        "pcie_replay_count": None,
        "clock_event_reasons": [],
        "power_violation_ns": None,
        "thermal_violation_ns": None,
        "nvlink_error_count": None,
        "xid_events": [],
        "read_errors": [],
    }


class HealthReader:
    """Calls NVML for one GPU's health: NOT_SUPPORTED gives ``None``, other errors land in ``errors``."""

    __slots__ = ("errors", "gone", "session")

    def __init__(self, session: NvmlSession) -> None:
        self.session = session
        self.errors: list[str] = []
        self.gone = False

    def get(self, call: str, read: Callable[..., Any], *args: Any, detail: str | None = None) -> Any:
        """``read(*args)``; ``call`` (plus ``detail``, the argument that matters) names it in an error."""
        if self.gone:
            return None
        try:
            return read(*args)
        except self.session.lib.NVMLError as exc:
            self.failed(exc.value, call, detail)
            return None

    def failed(self, code: int, call: str, detail: str | None = None) -> None:
        if code == self.session.not_supported:
            return
        where = f"{call}({detail})" if detail else call
        self.errors.append(f"{self.session.code_name(code)} from {where}")
        if code in self.session.device_gone:
            self.gone = True


def read_health(reader: HealthReader, handle: Any, *, active_links: Sequence[int] | None = None) -> dict[str, Any]:
    """The readings of the GPU behind ``handle``, XID events aside, read through ``reader`` (a fresh one per
    GPU; afterwards its ``gone`` says whether the device went away meanwhile).

    ``active_links`` are its trained NVLinks where the caller already scanned them (``gpu.facts`` does when it
    reads NVLink peers); otherwise they are scanned here, and an error on that scan is a health read error.
    """
    session = reader.session
    lib = session.lib
    readings = empty_readings()
    readings["read_errors"] = reader.errors
    if active_links is None:

        def link_failed(exc: Any, link: int) -> bool:
            reader.failed(exc.value, "nvmlDeviceGetNvLinkState", f"link {link}")
            return reader.gone

        active_links = active_nvlinks(session, handle, link_failed)

    for key, cause in _RETIRED_PAGES:
        pages = reader.get(
            "nvmlDeviceGetRetiredPages", lib.nvmlDeviceGetRetiredPages, handle, getattr(lib, cause), detail=cause
        )
        readings[key] = None if pages is None else len(pages)
    pending = reader.get("nvmlDeviceGetRetiredPagesPendingStatus", lib.nvmlDeviceGetRetiredPagesPendingStatus, handle)
    readings["retirement_pending"] = None if pending is None else pending == lib.NVML_FEATURE_ENABLED

    rows = reader.get("nvmlDeviceGetRemappedRows", lib.nvmlDeviceGetRemappedRows, handle)
    if rows is not None:
        correctable, uncorrectable, remap_pending, failure = rows
        readings["remapped_rows_correctable"] = int(correctable)
        readings["remapped_rows_uncorrectable"] = int(uncorrectable)
        readings["remap_pending"] = bool(remap_pending)
        readings["remap_failure"] = bool(failure)

    readings["recovery_action"] = _recovery_action(reader, handle)
    readings["pcie_replay_count"] = reader.get(
        "nvmlDeviceGetPcieReplayCounter", lib.nvmlDeviceGetPcieReplayCounter, handle
    )
    readings["clock_event_reasons"] = _clock_event_reasons(reader, handle)
    for key, policy in _VIOLATIONS:
        violation = reader.get(
            "nvmlDeviceGetViolationStatus",
            lib.nvmlDeviceGetViolationStatus,
            handle,
            getattr(lib, policy),
            detail=policy,
        )
        readings[key] = None if violation is None else int(violation.violationTime)
    readings["nvlink_error_count"] = _nvlink_errors(reader, handle, active_links)
    return readings


def _field_number(lib: Any, value: Any) -> Any:
    for type_name, member in _VALUE_MEMBERS:
        if value.valueType == getattr(lib, type_name, None):
            return getattr(value.value, member)
    return None


def _recovery_action(reader: HealthReader, handle: Any) -> str | None:
    session = reader.session
    lib = session.lib
    field_id = getattr(lib, _RECOVERY_FIELD, None)
    if field_id is None:
        # An nvidia-ml-py older than the field cannot ask for it: no NVML error, the reading is just missing,
        # as on a driver without it (docs/GPU_FACTS.md says to upgrade the package).
        return None
    values = reader.get(
        "nvmlDeviceGetFieldValues", lib.nvmlDeviceGetFieldValues, handle, [field_id], detail=_RECOVERY_FIELD
    )
    if values is None:
        return None
    value = values[0]
    # Each field carries its own return code; the call as a whole succeeds even when this one did not.
    if value.nvmlReturn != session.success:
        reader.failed(value.nvmlReturn, "nvmlDeviceGetFieldValues", _RECOVERY_FIELD)
        return None
    number = _field_number(lib, value)
    for constant, action in RECOVERY_ACTIONS:
        if number == getattr(lib, constant, None):
            return action
    reader.errors.append(
        f"recovery action {number!r} from nvmlDeviceGetFieldValues({_RECOVERY_FIELD}) is unknown to meridian.node: "
        "read it with nvidia-smi -q and treat the GPU as needing attention"
    )
    return None


def _clock_event_reasons(reader: HealthReader, handle: Any) -> list[str]:
    session = reader.session
    lib = session.lib
    call = "nvmlDeviceGetCurrentClocksEventReasons"
    read = getattr(lib, call, None)
    mask: Any = None
    if read is not None and not reader.gone:
        try:
            mask = read(handle)
        except lib.NVMLError as exc:
            if exc.value != session.function_not_found:
                reader.failed(exc.value, call)
                return []
            read = None  # a driver older than R535 has only the older name for the same reading
    if read is None:
        older = getattr(lib, "nvmlDeviceGetCurrentClocksThrottleReasons", None)
        if older is not None:
            mask = reader.get("nvmlDeviceGetCurrentClocksThrottleReasons", older, handle)
    if not isinstance(mask, int):
        return []
    names = []
    known = 0
    for suffix, name in CLOCK_EVENT_REASONS:
        bit = getattr(lib, f"nvmlClocksEventReason{suffix}", None)
        if not isinstance(bit, int):
            bit = getattr(lib, f"nvmlClocksThrottleReason{suffix}", 0)
        bit = bit if isinstance(bit, int) else 0
        known |= bit
        if bit and mask & bit:
            names.append(name)
    unknown = mask & ~known
    # A reason newer than this nvidia-ml-py is still a reason: named by its bit, not dropped.
    names.extend(f"unknown_{1 << bit:#x}" for bit in range(64) if unknown & (1 << bit))
    return names


def _nvlink_errors(reader: HealthReader, handle: Any, active_links: Sequence[int]) -> int | None:
    lib = reader.session.lib
    total: int | None = None
    for link in active_links:
        for counter in NVLINK_ERROR_COUNTERS:
            count = reader.get(
                "nvmlDeviceGetNvLinkErrorCounter",
                lib.nvmlDeviceGetNvLinkErrorCounter,
                handle,
                link,
                getattr(lib, counter),
                detail=f"link {link}, {counter}",
            )
            if count is not None:
                total = (total or 0) + int(count)
    return total
