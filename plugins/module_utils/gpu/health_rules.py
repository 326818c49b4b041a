"""The verdict on one GPU's health from its readings: pure, so every rule has its test.

``judge`` is the contract between the NVML reader (``gpu.facts``) and the rules: readings
(``contracts.GpuHealthReadings``) and the GPU's other facts in, ``contracts.GpuHealth`` out as a plain dict
(no pydantic: this runs in every ``gpu_facts`` task and agent cycle). docs/GPU_HEALTH.md lists every reason
code with its rule and the DCGM health watch (NVIDIA/DCGM ``modules/health``) or project it follows.

The shape of the decision:

- each rule that fires adds a reason ``{code, source, value}``; the verdict is the worst reason's
  (``healthy < degraded < unknown < unhealthy``), ``healthy`` when none fires;
- XIDs count inside a window (``xid_window_s``): the events of this read merged with those ``previous``
  kept, older ones dropped, so an XID is never a sticky last value;
- rules about counters that rise (PCIe replays, violation time, NVLink errors) compare with ``previous``;
  without it they cannot fire, and the PCIe replay *rate* also needs the time of the previous read;
- an ``unhealthy`` verdict holds: its unhealthy reasons are carried into the next verdicts (``held: true``,
  ``since`` kept) until NVML shows the GPU was reset (``reset_signs``) or an operator clears the hold
  (``gpu.health_hold``), after which only what NVML shows now counts.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from datetime import datetime, timedelta, timezone
from typing import Any

__all__ = [
    "APPLICATION_XIDS",
    "MIG_CODES",
    "RETIRED_PAGES_LIMIT",
    "ROW_REMAP_UNCORRECTABLE_LIMIT",
    "SEVERITY",
    "VERDICTS",
    "WARNING_XIDS",
    "XID_WINDOW_S",
    "expected_pcie_replays_per_minute",
    "judge",
    "mig_uuid_of",
    "reset_signs",
    "worst",
]

# Ordered from best to worst: the verdict is the worst of its reasons.
VERDICTS = ("healthy", "degraded", "unknown", "unhealthy")
_RANK = {verdict: rank for rank, verdict in enumerate(VERDICTS)}

# XIDs an application causes (a bad kernel, a page fault in user code): the GPU itself is fine. The list
# NVIDIA's k8s-device-plugin skips (internal/rm/health.go), 109 (context switch timeout) included.
APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68, 109})
# XIDs DCGM's health watches report as a warning, not a failure (DcgmHealthWatch::BuildXidMappings): PBDMA,
# PCIe bus/fabric/replay, power and clock changes, thermal slowdown, pending page retirement, NVLink, a
# corrupt InfoROM, and the contained ECC error (94) the driver already isolated. Every other XID outside
# APPLICATION_XIDS is critical, as the device plugin treats it (48 DBE, 64 remap failure, 74 NVLink, 79 off
# the bus, 95 uncontained ECC, 119/120 GSP, 140 unrecovered ECC, and any XID this table does not know).
WARNING_XIDS = frozenset({32, 38, 39, 42, 54, 56, 57, 58, 60, 61, 62, 63, 67, 73, 78, 93, 94, 121, 137})
# Ten minutes: long enough that an agent cycling every minute or two sees an XID in several verdicts (and
# the control plane in several observations), short enough that a warning XID does not outlive its cause.
XID_WINDOW_S = 600.0
# DCGM_LIMIT_MAX_RETIRED_PAGES (common/DcgmGPUHardwareLimits.h): SBE + DBE retired pages at or above it fail.
RETIRED_PAGES_LIMIT = 63
# DCGM_LIMIT_MAX_ROW_REMAP_UNCORRECTABLE: this many rows remapped for uncorrectable errors is a warning.
ROW_REMAP_UNCORRECTABLE_LIMIT = 512
# Replays per minute and lane DCGM expects at a bit error rate of 1e-12 (GetExpectedPcieReplayRate).
_REPLAYS_PER_LANE_MINUTE = {1: 0.15, 2: 0.3, 3: 0.48, 4: 0.96, 5: 1.92, 6: 3.84}
# DCGM compares the replays of the last minute with the per-minute rate: a shorter interval counts as one.
_MIN_RATE_WINDOW_MIN = 1.0

# Clock-event reasons that mean the GPU is held back by something wrong (NVML's nvmlClocksEventReason*),
# in docs/GPU_HEALTH.md's spelling. Idle, application clocks, display clocks, SW power cap (a GPU at its
# power limit under load) and sync boost are settings or normal work, not trouble.
_TROUBLE_CLOCK_EVENTS = ("hw_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown", "sw_thermal_slowdown")
_IDLE_CLOCK_EVENT = "gpu_idle"
_CLOCK_EVENT_PREFIX = re.compile(r"^(nvml)?clocks(event|throttle)reason")
_RFC3339 = re.compile(
    r"([0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2})(?:\.([0-9]{1,6}))?(Z|z|[+-][0-9]{2}:[0-9]{2})"
)

_PENDING_ACTIONS = ("reset", "reboot", "drain-p2p", "drain-and-reset")
# Counters the driver zeroes when the GPU is reset or the driver reloaded, and that otherwise only grow: one
# that went down is NVML showing a reset. (NVLink counters are left out: `nvidia-smi nvlink -r` zeroes them
# without any reset.)
_RESET_COUNTERS = ("pcie_replay_count", "power_violation_ns", "thermal_violation_ns")
# Every reading that can say something about the GPU's health; a GPU for which all are unsupported is unknown.
_SIGNALS = (
    "retired_pages_sbe",
    "retired_pages_dbe",
    "retirement_pending",
    "remapped_rows_correctable",
    "remapped_rows_uncorrectable",
    "remap_pending",
    "remap_failure",
    "recovery_action",
    "pcie_replay_count",
    "power_violation_ns",
    "thermal_violation_ns",
    "nvlink_error_count",
)

# The stable reason codes and the verdict each one gives (docs/GPU_HEALTH.md).
SEVERITY: dict[str, str] = {
    "gpu-error": "unhealthy",
    "nvml-read-error": "unhealthy",
    "ecc-volatile-dbe": "unhealthy",
    "row-remap-failure": "unhealthy",
    "retired-pages-limit": "unhealthy",
    "recovery-action": "unhealthy",
    "xid-critical": "unhealthy",
    "no-uuid": "unknown",
    "health-not-read": "unknown",
    "health-unsupported": "unknown",
    "retirement-pending": "degraded",
    "remap-pending": "degraded",
    "row-remap-uncorrectable-limit": "degraded",
    "pcie-replay-rate": "degraded",
    "pcie-generation-below-max": "degraded",
    "pcie-width-below-max": "degraded",
    "power-violation-rising": "degraded",
    "thermal-violation-rising": "degraded",
    "clock-event": "degraded",
    "nvlink-errors-rising": "degraded",
    "xid-warning": "degraded",
    # An XID scoped to one MIG device degrades the GPU; placement refuses that device alone (critical) or
    # warns about it (warning): engines.placement.
    "xid-critical-mig": "degraded",
    "xid-warning-mig": "degraded",
}
# The codes whose source names a MIG device (``nvmlEventSetWait MIG-...``), and the verdict for that device.
MIG_CODES = {"xid-critical-mig": "unhealthy", "xid-warning-mig": "degraded"}
_XID_SOURCE = "nvmlEventSetWait"
_XID_CODES = frozenset({"xid-critical", "xid-warning", *MIG_CODES})


def worst(verdicts: Iterable[str]) -> str:
    """The worst of ``verdicts`` (``healthy`` for none); a verdict this module does not know is ``unknown``."""
    found = "healthy"
    for verdict in verdicts:
        verdict = verdict if verdict in _RANK else "unknown"
        if _RANK[verdict] > _RANK[found]:
            found = verdict
    return found


def mig_uuid_of(reason: Mapping[str, Any]) -> str | None:
    """The MIG device a MIG-scoped reason names; None for a reason about the whole GPU."""
    if reason.get("code") not in MIG_CODES:
        return None
    _call, _space, uuid = str(reason.get("source") or "").partition(" ")
    return uuid or None


def expected_pcie_replays_per_minute(generation: int, width: int) -> int:
    """DCGM's expected PCIe replays per minute for a link: the per-lane rate of its generation (capped at the
    newest it knows) times its width, rounded up."""
    per_lane = _REPLAYS_PER_LANE_MINUTE[min(max(generation, 1), max(_REPLAYS_PER_LANE_MINUTE))]
    return math.ceil(per_lane * width)


def judge(
    readings: Mapping[str, Any] | None,
    *,
    gpu: Mapping[str, Any],
    previous: Mapping[str, Any] | None = None,
    now: datetime,
    previous_at: datetime | None = None,
    xid_window_s: float = XID_WINDOW_S,
    ignored_xids: Collection[int] = APPLICATION_XIDS,
) -> dict[str, Any]:
    """``contracts.GpuHealth`` as a plain dict for one GPU.

    ``readings`` is this read's ``GpuHealthReadings`` (None or empty: health was not read); ``gpu`` the rest
    of that GPU's facts (uuid, ECC, PCIe link, utilization, ``error``); ``previous`` the ``GpuHealth`` of the
    last read of the same GPU (by uuid), which rising-counter rules, the XID window and held verdicts need;
    ``previous_at`` when that read was taken, which the PCIe replay rate needs. Stateless callers (the ad-hoc
    ``gpu_facts``) pass neither. ``ignored_xids`` are XIDs that say nothing about the GPU (application errors).
    Timestamps come back as RFC 3339 strings in UTC.
    """
    if now.tzinfo is None:
        raise RuntimeError("judge needs an aware 'now' (a datetime with its timezone), got a naive one")
    taken = dict(readings or {})
    before = dict(previous or {})
    before_readings: Mapping[str, Any] = before.get("readings") or {}
    reset = reset_signs(taken, gpu=gpu, previous=before)
    # XIDs seen before a reset belong to the GPU as it was: only this read's events count after one.
    kept = [] if reset else before_readings.get("xid_events") or []
    window = _xid_window([*kept, *(taken.get("xid_events") or [])], now=now, window_s=xid_window_s)
    elapsed = _minutes(previous_at, now)
    fresh = _fresh_reasons(taken, gpu, before_readings, reset=bool(reset), elapsed=elapsed)
    fresh += _xid_reasons(window, ignored=frozenset(ignored_xids))
    carried = [] if reset or before.get("verdict") != "unhealthy" else _carried(before.get("reasons") or [], fresh)
    reasons = fresh + carried
    verdict = worst(SEVERITY.get(str(reason["code"]), "unknown") for reason in reasons)
    # A read with no history cannot say when its verdict began; a stateless read (the ad-hoc gpu_facts, a
    # fleet report) must also read the same twice, so it says nothing rather than "now".
    since = _stamp(now) if previous is not None else None
    if before.get("verdict") == verdict and before.get("since") and not (reset and verdict == "unhealthy"):
        since = _stamp(_time(before["since"]) or now)
    taken["xid_events"] = window
    return {"verdict": verdict, "reasons": reasons, "since": since, "held": bool(carried), "readings": taken}


def reset_signs(readings: Mapping[str, Any], *, gpu: Mapping[str, Any], previous: Mapping[str, Any]) -> list[str]:
    """What shows, between ``previous`` and this read, that the GPU was reset (or its driver reloaded); [] when
    nothing does. Only while no recovery action is pending now:

    - the recovery action NVML asked for is ``none`` again (the reset or reboot it asked for happened);
    - a counter the driver zeroes on a reset went down (PCIe replays, power or thermal violation time);
    - the volatile double-bit ECC count is below what the held ``ecc-volatile-dbe`` reason counted.
    """
    if not previous or readings.get("recovery_action") not in (None, "none"):
        return []
    before: Mapping[str, Any] = previous.get("readings") or {}
    signs = []
    asked = before.get("recovery_action")
    if asked in _PENDING_ACTIONS and readings.get("recovery_action") == "none":
        signs.append(f"recovery action {asked} is none again")
    for key in _RESET_COUNTERS:
        was, now = _count(before.get(key)), _count(readings.get(key))
        if was is not None and now is not None and now < was:
            signs.append(f"{key} went down from {was} to {now}")
    held_dbe = [_count(r.get("value")) for r in previous.get("reasons") or [] if r.get("code") == "ecc-volatile-dbe"]
    counted = max((value for value in held_dbe if value is not None), default=None)
    dbe = _count(gpu.get("ecc_errors_uncorrected"))
    if counted is not None and dbe is not None and dbe < counted:
        signs.append(f"volatile double-bit ECC errors went down from {counted} to {dbe}")
    return signs


# --- the rules ---------------------------------------------------------------------------------------------


def _reason(code: str, source: str, value: bool | int | float | str | None = None) -> dict[str, Any]:
    return {"code": code, "source": source, "value": value}


def _fresh_reasons(
    readings: Mapping[str, Any],
    gpu: Mapping[str, Any],
    before: Mapping[str, Any],
    *,
    reset: bool,
    elapsed: float | None,
) -> list[dict[str, Any]]:
    """Every reason this read gives, XIDs apart, in a fixed order (unhealthy, unknown, degraded)."""
    reasons = _unhealthy(readings, gpu) + _unknown(readings, gpu)
    reasons += _memory_warnings(readings) + _pcie_link(gpu, readings)
    if before and not reset:
        reasons += _rising(readings, before, gpu, elapsed)
    reasons += _clock_events(readings)
    return reasons


def _unhealthy(readings: Mapping[str, Any], gpu: Mapping[str, Any]) -> list[dict[str, Any]]:
    reasons = []
    if gpu.get("error"):
        reasons.append(_reason("gpu-error", "gpu facts", str(gpu["error"])))
    reasons += [_read_error(str(error)) for error in readings.get("read_errors") or []]
    dbe = _count(gpu.get("ecc_errors_uncorrected"))
    if dbe is not None and dbe > 0:
        reasons.append(_reason("ecc-volatile-dbe", "nvmlDeviceGetTotalEccErrors(UNCORRECTED, VOLATILE)", dbe))
    if readings.get("remap_failure") is True:
        reasons.append(_reason("row-remap-failure", "nvmlDeviceGetRemappedRows", True))
    sbe, dbe_pages = _count(readings.get("retired_pages_sbe")), _count(readings.get("retired_pages_dbe"))
    if sbe is not None or dbe_pages is not None:
        retired = (sbe or 0) + (dbe_pages or 0)
        if retired >= RETIRED_PAGES_LIMIT:
            reasons.append(_reason("retired-pages-limit", "nvmlDeviceGetRetiredPages", retired))
    action = readings.get("recovery_action")
    if action not in (None, "none"):
        reasons.append(_reason("recovery-action", "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION", str(action)))
    return reasons


def _read_error(text: str) -> dict[str, Any]:
    # gpu.health_read names each error with its call: "NVML_ERROR_GPU_IS_LOST from nvmlDeviceGetRemappedRows".
    error, marker, call = text.partition(" from ")
    if marker and call:
        return _reason("nvml-read-error", call[:128], error)
    return _reason("nvml-read-error", "health read", text)


def _unknown(readings: Mapping[str, Any], gpu: Mapping[str, Any]) -> list[dict[str, Any]]:
    reasons = []
    if not gpu.get("uuid"):
        reasons.append(_reason("no-uuid", "nvmlDeviceGetUUID", None))
    if not readings:
        reasons.append(_reason("health-not-read", "health read", None))
    elif (
        all(readings.get(key) is None for key in _SIGNALS)
        and gpu.get("ecc_errors_uncorrected") is None
        and not readings.get("read_errors")
    ):
        reasons.append(_reason("health-unsupported", "health read", "no health counter is supported"))
    return reasons


def _memory_warnings(readings: Mapping[str, Any]) -> list[dict[str, Any]]:
    reasons = []
    if readings.get("retirement_pending") is True:
        reasons.append(_reason("retirement-pending", "nvmlDeviceGetRetiredPagesPendingStatus", True))
    if readings.get("remap_pending") is True:
        reasons.append(_reason("remap-pending", "nvmlDeviceGetRemappedRows", True))
    rows = _count(readings.get("remapped_rows_uncorrectable"))
    if rows is not None and rows >= ROW_REMAP_UNCORRECTABLE_LIMIT:
        reasons.append(_reason("row-remap-uncorrectable-limit", "nvmlDeviceGetRemappedRows", rows))
    return reasons


def _pcie_link(gpu: Mapping[str, Any], readings: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A link trained below its maximum. The generation is left alone while the GPU idles: GPUs drop their
    link speed to save power when idle, and train up again under load; the width does not change that way."""
    link: Mapping[str, Any] = gpu.get("pcie") or {}
    reasons = []
    generation, top = _count(link.get("generation")), _count(link.get("max_generation"))
    if generation is not None and top is not None and generation < top and not _idle(gpu, readings):
        reasons.append(
            _reason("pcie-generation-below-max", "nvmlDeviceGetCurrPcieLinkGeneration", f"{generation}/{top}")
        )
    width, widest = _count(link.get("width")), _count(link.get("max_width"))
    if width is not None and widest is not None and width < widest:
        reasons.append(_reason("pcie-width-below-max", "nvmlDeviceGetCurrPcieLinkWidth", f"x{width}/x{widest}"))
    return reasons


def _idle(gpu: Mapping[str, Any], readings: Mapping[str, Any]) -> bool:
    events = {_clock_event(str(event)) for event in readings.get("clock_event_reasons") or []}
    return _IDLE_CLOCK_EVENT in events or gpu.get("utilization_gpu_percent") == 0


def _rising(
    readings: Mapping[str, Any], before: Mapping[str, Any], gpu: Mapping[str, Any], elapsed: float | None
) -> list[dict[str, Any]]:
    """Counters that grew since the previous read (a counter that went down was reset: nothing to compare)."""
    reasons = []
    replays = _growth(before.get("pcie_replay_count"), readings.get("pcie_replay_count"))
    link: Mapping[str, Any] = gpu.get("pcie") or {}
    generation, width = _count(link.get("generation")), _count(link.get("width"))
    if replays and elapsed is not None and elapsed > 0 and generation and width:
        rate = replays / max(elapsed, _MIN_RATE_WINDOW_MIN)
        if rate > expected_pcie_replays_per_minute(generation, width):
            reasons.append(_reason("pcie-replay-rate", "nvmlDeviceGetPcieReplayCounter", round(rate, 2)))
    for key, code, source in (
        ("power_violation_ns", "power-violation-rising", "nvmlDeviceGetViolationStatus(POWER)"),
        ("thermal_violation_ns", "thermal-violation-rising", "nvmlDeviceGetViolationStatus(THERMAL)"),
        ("nvlink_error_count", "nvlink-errors-rising", "nvmlDeviceGetNvLinkErrorCounter"),
    ):
        grown = _growth(before.get(key), readings.get(key))
        if grown:
            reasons.append(_reason(code, source, grown))
    return reasons


def _clock_events(readings: Mapping[str, Any]) -> list[dict[str, Any]]:
    reasons = []
    for event in readings.get("clock_event_reasons") or []:
        if _clock_event(str(event)) in _TROUBLE_CLOCK_EVENTS:
            reasons.append(_reason("clock-event", "nvmlDeviceGetCurrentClocksEventReasons", str(event)))
    return reasons


def _clock_event(name: str) -> str:
    """``hw_slowdown`` from ``hw_slowdown``, ``HwSlowdown`` or ``nvmlClocksEventReasonHwSlowdown``: whichever
    spelling the reader used, compared on its letters."""
    letters = _CLOCK_EVENT_PREFIX.sub("", re.sub(r"[^a-z0-9]", "", name.lower()))
    for known in (*_TROUBLE_CLOCK_EVENTS, _IDLE_CLOCK_EVENT):
        if letters == known.replace("_", ""):
            return known
    return letters


# --- XIDs --------------------------------------------------------------------------------------------------


def _xid_window(events: Sequence[Any], *, now: datetime, window_s: float) -> list[dict[str, Any]]:
    """The events no older than the window, each once, oldest first, as plain dicts with string times."""
    start = now - timedelta(seconds=window_s)
    seen: dict[tuple[int, str, str | None], dict[str, Any]] = {}
    for event in events:
        if not isinstance(event, Mapping):
            continue
        xid = _count(event.get("xid"))
        if xid is None:
            continue
        # An event whose time cannot be read counts from now: dropping it could drop a GPU that fell off the bus.
        at = _time(event.get("at")) or now
        if at < start:
            continue
        mig = event.get("mig_uuid")
        stamp = _stamp(at)
        seen[(xid, stamp, mig)] = {"xid": xid, "at": stamp, "mig_uuid": mig}
    return sorted(seen.values(), key=lambda event: (event["at"], event["xid"], event["mig_uuid"] or ""))


def _xid_reasons(window: Sequence[Mapping[str, Any]], *, ignored: frozenset[int]) -> list[dict[str, Any]]:
    """One reason per XID and scope in the window, critical ones first."""
    found: dict[tuple[str, str, int], dict[str, Any]] = {}
    for event in window:
        xid = int(event["xid"])
        if xid in ignored:
            continue
        mig = event.get("mig_uuid")
        kind = "xid-warning" if xid in WARNING_XIDS else "xid-critical"
        code, source = (f"{kind}-mig", f"{_XID_SOURCE} {mig}") if mig else (kind, _XID_SOURCE)
        found.setdefault((code, source, xid), _reason(code, source, xid))
    order = {"xid-critical": 0, "xid-critical-mig": 1, "xid-warning": 2, "xid-warning-mig": 3}
    return [found[key] for key in sorted(found, key=lambda key: (order[key[0]], key[1], key[2]))]


# --- held verdicts -----------------------------------------------------------------------------------------


def _identity(reason: Mapping[str, Any]) -> tuple[Any, ...]:
    # An XID reason is one per XID; any other reason is one per code and source, whatever value it read.
    code = reason.get("code")
    return (code, reason.get("source"), reason.get("value") if code in _XID_CODES else None)


def _carried(before: Sequence[Mapping[str, Any]], fresh: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The previous verdict's unhealthy reasons this read does not give again: what the verdict holds."""
    seen = {_identity(reason) for reason in fresh}
    carried = []
    for reason in before:
        if SEVERITY.get(str(reason.get("code"))) != "unhealthy" or _identity(reason) in seen:
            continue
        seen.add(_identity(reason))
        carried.append(_reason(str(reason["code"]), str(reason.get("source") or ""), reason.get("value")))
    return carried


# --- small helpers -----------------------------------------------------------------------------------------


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _growth(was: Any, now: Any) -> int:
    before, after = _count(was), _count(now)
    return after - before if before is not None and after is not None and after > before else 0


def _minutes(before: datetime | None, now: datetime) -> float | None:
    return None if before is None else (now - before).total_seconds() / 60.0


def _time(value: Any) -> datetime | None:
    """An aware datetime from a datetime or an RFC 3339 string; None for anything else."""
    if isinstance(value, datetime):
        return value if value.tzinfo is not None else None
    match = _RFC3339.fullmatch(value) if isinstance(value, str) else None
    if match is None:
        return None
    # Python 3.9's fromisoformat takes 3 or 6 fractional digits and no "Z": RFC 3339 allows any and "Z".
    seconds, fraction, zone = match.groups()
    zone = "+00:00" if zone in ("Z", "z") else zone
    try:
        return datetime.fromisoformat(f"{seconds}.{(fraction or '').ljust(6, '0')}{zone}")
    except ValueError:
        return None


def _stamp(value: datetime) -> str:
    """The contracts' one spelling of a time (``contracts.format_rfc3339``), without importing pydantic."""
    utc = value.astimezone(timezone.utc)
    return utc.isoformat(timespec="microseconds" if utc.microsecond else "seconds").replace("+00:00", "Z")
