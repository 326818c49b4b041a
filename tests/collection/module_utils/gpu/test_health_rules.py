"""The verdict on a GPU's health, rule by rule, each threshold from both sides; the XID window; held verdicts.

Built from readings dicts (``contracts.GpuHealthReadings``) and GPU fact dicts, as ``gpu.facts`` hands them to
``judge``; every verdict is checked against the ``contracts.GpuHealth`` model it must fit.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import Any

import pytest

from ansible_collections.meridian.node.plugins.module_utils.contracts import GpuHealth
from ansible_collections.meridian.node.plugins.module_utils.gpu.health_rules import (
    APPLICATION_XIDS,
    RETIRED_PAGES_LIMIT,
    ROW_REMAP_UNCORRECTABLE_LIMIT,
    SEVERITY,
    expected_pcie_replays_per_minute,
    judge,
    mig_uuid_of,
    reset_signs,
    worst,
)
from ansible_collections.meridian.node.tests.support.gpu_ids import GPU_A, MIG_A, NOW


def facts(**changes: Any) -> dict[str, Any]:
    """A busy H100 on a full Gen4 x16 link with no volatile ECC errors."""
    gpu: dict[str, Any] = {
        "index": 0,
        "uuid": GPU_A,
        "ecc_errors_corrected": 0,
        "ecc_errors_uncorrected": 0,
        "utilization_gpu_percent": 60,
        "pcie": {"generation": 4, "width": 16, "max_generation": 4, "max_width": 16},
        "error": None,
    }
    gpu.update(changes)
    return gpu


def readings(**changes: Any) -> dict[str, Any]:
    """Every counter read and clean."""
    taken: dict[str, Any] = {
        "retired_pages_sbe": 0,
        "retired_pages_dbe": 0,
        "retirement_pending": False,
        "remapped_rows_correctable": 0,
        "remapped_rows_uncorrectable": 0,
        "remap_pending": False,
        "remap_failure": False,
        "recovery_action": "none",
        "pcie_replay_count": 0,
        "clock_event_reasons": [],
        "power_violation_ns": 0,
        "thermal_violation_ns": 0,
        "nvlink_error_count": 0,
        "xid_events": [],
        "read_errors": [],
    }
    taken.update(changes)
    return taken


def check(health: Mapping[str, Any]) -> dict[str, Any]:
    """``health`` as the contract reads it (it must fit), returned as it came."""
    GpuHealth.model_validate(dict(health))
    return dict(health)


def verdict_of(taken: Mapping[str, Any] | None, gpu: Mapping[str, Any] | None = None, **kwargs: Any) -> dict[str, Any]:
    # A stateful caller's first read ({}): the verdict's since is this read's time.
    kwargs.setdefault("previous", {})
    return check(judge(taken, gpu=facts() if gpu is None else gpu, now=NOW, **kwargs))


def codes(health: Mapping[str, Any]) -> list[str]:
    return [reason["code"] for reason in health["reasons"]]


def xid(number: int, seconds_ago: float, mig: str | None = None) -> dict[str, Any]:
    at = (NOW - timedelta(seconds=seconds_ago)).isoformat().replace("+00:00", "Z")
    return {"xid": number, "at": at, "mig_uuid": mig}


# --- one reading, rule by rule ------------------------------------------------------------------------------

# (id, readings changes, GPU fact changes, verdict, reason codes)
ROWS: list[tuple[str, dict[str, Any], dict[str, Any], str, list[str]]] = [
    ("all clean", {}, {}, "healthy", []),
    ("volatile DBE 0", {}, {"ecc_errors_uncorrected": 0}, "healthy", []),
    ("volatile DBE 1", {}, {"ecc_errors_uncorrected": 1}, "unhealthy", ["ecc-volatile-dbe"]),
    ("corrected ECC only", {}, {"ecc_errors_corrected": 5000}, "healthy", []),
    ("row remap did not fail", {"remap_failure": False}, {}, "healthy", []),
    ("row remap failed", {"remap_failure": True}, {}, "unhealthy", ["row-remap-failure"]),
    ("retired pages one below the limit", {"retired_pages_sbe": 40, "retired_pages_dbe": 22}, {}, "healthy", []),
    (
        "retired pages at the limit",
        {"retired_pages_sbe": 40, "retired_pages_dbe": 23},
        {},
        "unhealthy",
        ["retired-pages-limit"],
    ),
    (
        "retired pages at the limit, DBE unsupported",
        {"retired_pages_sbe": 63, "retired_pages_dbe": None},
        {},
        "unhealthy",
        ["retired-pages-limit"],
    ),
    ("no recovery action", {"recovery_action": "none"}, {}, "healthy", []),
    ("recovery action reset", {"recovery_action": "reset"}, {}, "unhealthy", ["recovery-action"]),
    ("recovery action reboot", {"recovery_action": "reboot"}, {}, "unhealthy", ["recovery-action"]),
    ("recovery action drain-p2p", {"recovery_action": "drain-p2p"}, {}, "unhealthy", ["recovery-action"]),
    ("recovery action drain-and-reset", {"recovery_action": "drain-and-reset"}, {}, "unhealthy", ["recovery-action"]),
    ("no NVML error", {"read_errors": []}, {}, "healthy", []),
    (
        "an NVML error on a health read",
        {"read_errors": ["NVML_ERROR_GPU_IS_LOST from nvmlDeviceGetRemappedRows"]},
        {},
        "unhealthy",
        ["nvml-read-error"],
    ),
    (
        "two NVML errors, two reasons",
        {"read_errors": ["NVML_ERROR_TIMEOUT from nvmlDeviceGetRetiredPages", "NVML_ERROR_NO_PERMISSION"]},
        {},
        "unhealthy",
        ["nvml-read-error", "nvml-read-error"],
    ),
    (
        "facts carry an error",
        {},
        {"error": "NVML_ERROR_GPU_IS_LOST while reading memory info"},
        "unhealthy",
        ["gpu-error"],
    ),
    ("no retirement pending", {"retirement_pending": False}, {}, "healthy", []),
    ("retirement pending", {"retirement_pending": True}, {}, "degraded", ["retirement-pending"]),
    ("no remap pending", {"remap_pending": False}, {}, "healthy", []),
    ("remap pending", {"remap_pending": True}, {}, "degraded", ["remap-pending"]),
    (
        "uncorrectable remapped rows below the limit",
        {"remapped_rows_uncorrectable": ROW_REMAP_UNCORRECTABLE_LIMIT - 1},
        {},
        "healthy",
        [],
    ),
    (
        "uncorrectable remapped rows at the limit",
        {"remapped_rows_uncorrectable": ROW_REMAP_UNCORRECTABLE_LIMIT},
        {},
        "degraded",
        ["row-remap-uncorrectable-limit"],
    ),
    (
        "link generation below max under load",
        {},
        {"pcie": {"generation": 3, "width": 16, "max_generation": 4, "max_width": 16}},
        "degraded",
        ["pcie-generation-below-max"],
    ),
    (
        "link generation below max while idle (clock event)",
        {"clock_event_reasons": ["gpu_idle"]},
        {"pcie": {"generation": 1, "width": 16, "max_generation": 4, "max_width": 16}},
        "healthy",
        [],
    ),
    (
        "link generation below max while idle (no utilization)",
        {},
        {"utilization_gpu_percent": 0, "pcie": {"generation": 1, "width": 16, "max_generation": 4, "max_width": 16}},
        "healthy",
        [],
    ),
    (
        "link width below max, even idle",
        {"clock_event_reasons": ["gpu_idle"]},
        {"pcie": {"generation": 4, "width": 8, "max_generation": 4, "max_width": 16}},
        "degraded",
        ["pcie-width-below-max"],
    ),
    (
        "link not read",
        {},
        {"pcie": {"generation": None, "width": None, "max_generation": 4, "max_width": 16}},
        "healthy",
        [],
    ),
    ("HW slowdown", {"clock_event_reasons": ["hw_slowdown"]}, {}, "degraded", ["clock-event"]),
    (
        "HW thermal slowdown, NVML's name",
        {"clock_event_reasons": ["HwThermalSlowdown"]},
        {},
        "degraded",
        ["clock-event"],
    ),
    (
        "HW power brake, the constant's name",
        {"clock_event_reasons": ["nvmlClocksThrottleReasonHwPowerBrakeSlowdown"]},
        {},
        "degraded",
        ["clock-event"],
    ),
    ("SW thermal slowdown", {"clock_event_reasons": ["sw_thermal_slowdown"]}, {}, "degraded", ["clock-event"]),
    (
        "settings and normal work are no trouble",
        {"clock_event_reasons": ["gpu_idle", "applications_clocks_setting", "sw_power_cap", "sync_boost"]},
        {},
        "healthy",
        [],
    ),
    ("no uuid", {}, {"uuid": None}, "unknown", ["no-uuid"]),
    (
        "nothing supported, no ECC either",
        {key: None for key in readings() if key not in ("clock_event_reasons", "xid_events", "read_errors")},
        {"ecc_errors_uncorrected": None},
        "unknown",
        ["health-unsupported"],
    ),
    (
        "nothing supported but ECC (judged on ECC)",
        {key: None for key in readings() if key not in ("clock_event_reasons", "xid_events", "read_errors")},
        {},
        "healthy",
        [],
    ),
    (
        "the worst reason decides: degraded and unhealthy",
        {"retirement_pending": True, "remap_failure": True},
        {},
        "unhealthy",
        ["row-remap-failure", "retirement-pending"],
    ),
    (
        "the worst reason decides: degraded and unknown",
        {"remap_pending": True},
        {"uuid": None},
        "unknown",
        ["no-uuid", "remap-pending"],
    ),
]


@pytest.mark.parametrize(
    ("changes", "gpu_changes", "verdict", "found"), [r[1:] for r in ROWS], ids=[r[0] for r in ROWS]
)
def test_one_reading(changes: dict[str, Any], gpu_changes: dict[str, Any], verdict: str, found: list[str]) -> None:
    health = verdict_of(readings(**changes), facts(**gpu_changes))

    assert health["verdict"] == verdict
    assert codes(health) == found
    assert health["since"] == "2026-12-03T12:00:00Z"
    assert health["held"] is False


def test_every_reason_names_what_it_read() -> None:
    health = verdict_of(
        readings(
            retired_pages_sbe=50,
            retired_pages_dbe=20,
            recovery_action="drain-and-reset",
            read_errors=["NVML_ERROR_TIMEOUT from nvmlDeviceGetRetiredPages", "NVML_ERROR_NO_PERMISSION"],
        ),
        facts(ecc_errors_uncorrected=3),
    )

    by_code = {reason["code"]: reason for reason in health["reasons"]}
    assert by_code["ecc-volatile-dbe"]["value"] == 3
    assert "VOLATILE" in by_code["ecc-volatile-dbe"]["source"]
    assert by_code["retired-pages-limit"]["value"] == 70
    assert by_code["recovery-action"]["value"] == "drain-and-reset"
    errors = [(r["source"], r["value"]) for r in health["reasons"] if r["code"] == "nvml-read-error"]
    assert errors == [
        ("nvmlDeviceGetRetiredPages", "NVML_ERROR_TIMEOUT"),
        ("health read", "NVML_ERROR_NO_PERMISSION"),
    ]


@pytest.mark.parametrize("taken", [None, {}], ids=["none", "empty"])
def test_health_not_read_is_unknown(taken: dict[str, Any] | None) -> None:
    health = verdict_of(taken)

    assert health["verdict"] == "unknown"
    assert codes(health) == ["health-not-read"]


def test_health_not_read_on_a_gpu_with_volatile_dbe_is_still_unhealthy() -> None:
    assert verdict_of(None, facts(ecc_errors_uncorrected=2))["verdict"] == "unhealthy"


def test_the_limits_are_dcgms() -> None:
    # common/DcgmGPUHardwareLimits.h: DCGM_LIMIT_MAX_RETIRED_PAGES 63, DCGM_LIMIT_MAX_ROW_REMAP_UNCORRECTABLE 512.
    assert (RETIRED_PAGES_LIMIT, ROW_REMAP_UNCORRECTABLE_LIMIT) == (63, 512)
    assert set(APPLICATION_XIDS) == {13, 31, 43, 45, 68, 109}


def test_every_code_has_a_verdict_and_worst_orders_them() -> None:
    assert set(SEVERITY.values()) <= {"degraded", "unknown", "unhealthy"}
    assert worst([]) == "healthy"
    assert worst(["degraded", "healthy"]) == "degraded"
    assert worst(["degraded", "unknown"]) == "unknown"
    assert worst(["unknown", "unhealthy", "degraded"]) == "unhealthy"
    assert worst(["something new"]) == "unknown"


def test_a_naive_now_is_refused() -> None:
    with pytest.raises(RuntimeError, match="aware"):
        judge(readings(), gpu=facts(), now=datetime(2026, 12, 3, 12, 0))


# --- PCIe replays: a rate against DCGM's expected one -------------------------------------------------------


@pytest.mark.parametrize(
    ("generation", "width", "expected"),
    [(1, 1, 1), (1, 16, 3), (3, 16, 8), (4, 16, 16), (5, 16, 31), (6, 16, 62), (7, 16, 62), (4, 8, 8)],
)
def test_expected_replays_per_minute(generation: int, width: int, expected: int) -> None:
    assert expected_pcie_replays_per_minute(generation, width) == expected


@pytest.mark.parametrize(
    ("replays", "seconds", "verdict"),
    [
        (16, 60, "healthy"),  # 16/min on Gen4 x16: at the expected rate
        (17, 60, "degraded"),
        (16, 30, "healthy"),  # half a minute counts as one, as DCGM's one-minute window does
        (17, 30, "degraded"),
        (160, 600, "healthy"),  # ten minutes: the average
        (170, 600, "degraded"),
    ],
)
def test_pcie_replay_rate(replays: int, seconds: int, verdict: str) -> None:
    previous = verdict_of(readings(pcie_replay_count=1000))
    health = verdict_of(
        readings(pcie_replay_count=1000 + replays),
        previous=previous,
        previous_at=NOW - timedelta(seconds=seconds),
    )

    assert health["verdict"] == verdict
    assert codes(health) == ([] if verdict == "healthy" else ["pcie-replay-rate"])


def test_pcie_replays_cannot_be_judged_without_the_previous_read_or_its_time() -> None:
    # An absolute count says nothing: a GPU up for a year has replays a new one has not.
    assert verdict_of(readings(pcie_replay_count=10**6))["verdict"] == "healthy"
    previous = verdict_of(readings(pcie_replay_count=0))
    assert verdict_of(readings(pcie_replay_count=10**6), previous=previous)["verdict"] == "healthy"


# --- rising counters --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "code"),
    [
        ("power_violation_ns", "power-violation-rising"),
        ("thermal_violation_ns", "thermal-violation-rising"),
        ("nvlink_error_count", "nvlink-errors-rising"),
    ],
)
def test_a_counter_that_rises_degrades_one_that_stays_does_not(key: str, code: str) -> None:
    previous = verdict_of(readings(**{key: 5000}))

    same = verdict_of(readings(**{key: 5000}), previous=previous)
    rose = verdict_of(readings(**{key: 5001}), previous=previous)

    assert same["verdict"] == "healthy"
    assert rose["verdict"] == "degraded"
    assert rose["reasons"] == [{"code": code, "source": rose["reasons"][0]["source"], "value": 1}]


def test_rising_needs_a_previous_read() -> None:
    assert verdict_of(readings(power_violation_ns=10**12, nvlink_error_count=10**6))["verdict"] == "healthy"


# --- XIDs in a window ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("number", "verdict", "found"),
    [
        (13, "healthy", []),  # an application's error
        (31, "healthy", []),
        (109, "healthy", []),
        (79, "unhealthy", ["xid-critical"]),  # fallen off the bus
        (48, "unhealthy", ["xid-critical"]),  # double-bit ECC
        (94, "degraded", ["xid-warning"]),  # contained ECC error
        (63, "degraded", ["xid-warning"]),  # page retirement pending
        (999, "unhealthy", ["xid-critical"]),  # one nobody listed: fail closed
    ],
)
def test_xid_kinds(number: int, verdict: str, found: list[str]) -> None:
    health = verdict_of(readings(xid_events=[xid(number, 5)]))

    assert health["verdict"] == verdict
    assert codes(health) == found
    assert [event["xid"] for event in health["readings"]["xid_events"]] == [number]


def test_ignored_xids_are_a_parameter() -> None:
    assert verdict_of(readings(xid_events=[xid(79, 5)]), ignored_xids={79})["verdict"] == "healthy"


def test_a_mig_scoped_xid_degrades_the_gpu_and_names_its_device() -> None:
    health = verdict_of(readings(xid_events=[xid(48, 5, MIG_A)]))

    assert health["verdict"] == "degraded"
    assert codes(health) == ["xid-critical-mig"]
    assert mig_uuid_of(health["reasons"][0]) == MIG_A
    assert mig_uuid_of({"code": "xid-critical", "source": "nvmlEventSetWait", "value": 48}) is None


@pytest.mark.parametrize(("seconds_ago", "verdict"), [(599, "degraded"), (601, "healthy")])
def test_an_xid_counts_for_the_window_then_is_dropped(seconds_ago: float, verdict: str) -> None:
    # Seen by the previous read; this read has no new event.
    previous: dict[str, Any] = {"verdict": "degraded", "reasons": [], "since": None, "held": False}
    previous["readings"] = readings(xid_events=[xid(94, seconds_ago)])

    health = verdict_of(readings(), previous=previous)

    assert health["verdict"] == verdict
    assert len(health["readings"]["xid_events"]) == (1 if verdict == "degraded" else 0)


@pytest.mark.parametrize(
    "at",
    ["2026-12-03T11:59:00Z", "2026-12-03T11:59:00.5Z", "2026-12-03T11:59:00.123456Z", "2026-12-03T11:59:00+00:00"],
)
def test_event_times_in_any_rfc3339_form_count(at: str) -> None:
    health = verdict_of(readings(xid_events=[{"xid": 79, "at": at, "mig_uuid": None}]))
    assert codes(health) == ["xid-critical"]


@pytest.mark.parametrize("at", ["yesterday", "2026-12-03 11:59:00", 1764763140, None])
def test_an_event_whose_time_cannot_be_read_counts_from_now(at: Any) -> None:
    health = verdict_of(readings(xid_events=[{"xid": 79, "at": at, "mig_uuid": None}]))

    assert health["verdict"] == "unhealthy"
    assert health["readings"]["xid_events"] == [{"xid": 79, "at": "2026-12-03T12:00:00Z", "mig_uuid": None}]


def test_the_window_is_a_parameter() -> None:
    assert verdict_of(readings(xid_events=[xid(94, 61)]), xid_window_s=60)["verdict"] == "healthy"
    assert verdict_of(readings(xid_events=[xid(94, 59)]), xid_window_s=60)["verdict"] == "degraded"


def test_the_window_merges_previous_and_new_events_once_each() -> None:
    old, again, new = xid(94, 120), xid(94, 120), xid(94, 10)
    previous = verdict_of(readings(xid_events=[old]))

    health = verdict_of(readings(xid_events=[again, new]), previous=previous)

    assert [event["at"] for event in health["readings"]["xid_events"]] == [old["at"], new["at"]]
    assert codes(health) == ["xid-warning"]


# --- held verdicts ---------------------------------------------------------------------------------------


def test_an_unhealthy_verdict_holds_after_its_xid_leaves_the_window() -> None:
    first = verdict_of(readings(xid_events=[xid(79, 5)]))
    later = NOW + timedelta(minutes=30)

    second = check(judge(readings(), gpu=facts(), previous=first, now=later))
    third = check(judge(readings(), gpu=facts(), previous=second, now=later + timedelta(hours=5)))

    for health in (second, third):
        assert health["verdict"] == "unhealthy"
        assert health["held"] is True
        assert health["since"] == first["since"]
        assert health["reasons"] == first["reasons"]
        assert health["readings"]["xid_events"] == []


def test_a_verdict_that_the_reading_gives_again_is_not_held_but_keeps_its_since() -> None:
    first = verdict_of(readings(), facts(ecc_errors_uncorrected=2))
    second = check(judge(readings(), gpu=facts(ecc_errors_uncorrected=2), previous=first, now=NOW + timedelta(hours=1)))

    assert second["verdict"] == "unhealthy"
    assert second["held"] is False
    assert second["since"] == first["since"]


def test_degraded_does_not_hold() -> None:
    first = verdict_of(readings(retirement_pending=True))
    second = check(judge(readings(), gpu=facts(), previous=first, now=NOW + timedelta(minutes=1)))

    assert second["verdict"] == "healthy"
    assert second["since"] == "2026-12-03T12:01:00Z"


def test_a_new_critical_reason_joins_the_held_ones() -> None:
    first = verdict_of(readings(xid_events=[xid(79, 5)]))
    second = check(judge(readings(remap_failure=True), gpu=facts(), previous=first, now=NOW + timedelta(minutes=20)))

    assert codes(second) == ["row-remap-failure", "xid-critical"]
    assert second["held"] is True


@pytest.mark.parametrize(
    ("before", "after", "gpu_before", "gpu_after"),
    [
        ({"recovery_action": "reset"}, {"recovery_action": "none"}, {}, {}),
        ({"recovery_action": "reboot"}, {"recovery_action": "none"}, {}, {}),
        ({"pcie_replay_count": 120}, {"pcie_replay_count": 0}, {}, {}),
        ({"power_violation_ns": 10**9}, {"power_violation_ns": 0}, {}, {}),
        ({}, {}, {"ecc_errors_uncorrected": 4}, {"ecc_errors_uncorrected": 0}),
    ],
    ids=["reset done", "reboot done", "replays zeroed", "violation time zeroed", "volatile DBE back to 0"],
)
def test_a_reset_releases_the_held_verdict(
    before: dict[str, Any], after: dict[str, Any], gpu_before: dict[str, Any], gpu_after: dict[str, Any]
) -> None:
    first = verdict_of(readings(xid_events=[xid(79, 5)], **before), facts(**gpu_before))
    assert first["verdict"] == "unhealthy"
    later = NOW + timedelta(minutes=1)

    health = check(judge(readings(**after), gpu=facts(**gpu_after), previous=first, now=later))

    assert health["verdict"] == "healthy", health["reasons"]
    assert health["held"] is False
    assert health["since"] == "2026-12-03T12:01:00Z"
    # The XID was seen before the reset: it no longer counts, even inside the window.
    assert health["readings"]["xid_events"] == []
    assert reset_signs(readings(**after), gpu=facts(**gpu_after), previous=first)


@pytest.mark.parametrize(
    ("after", "gpu_after"),
    [
        ({}, {}),  # nothing moved
        ({"pcie_replay_count": 121}, {}),  # counters grew: no reset
        ({"recovery_action": "reset", "pcie_replay_count": 0}, {}),  # zeroed, but a reset is still asked for
        ({}, {"ecc_errors_uncorrected": 4}),  # the same DBE count
        ({}, {"ecc_errors_uncorrected": None}),  # ECC could not be read: no sign either way
    ],
    ids=["nothing moved", "counters grew", "recovery still pending", "same DBE", "ECC unread"],
)
def test_without_a_sign_of_reset_the_verdict_holds(after: dict[str, Any], gpu_after: dict[str, Any]) -> None:
    first = verdict_of(readings(xid_events=[xid(79, 5)], pcie_replay_count=120), facts(ecc_errors_uncorrected=4))
    later = NOW + timedelta(minutes=20)

    health = check(
        judge(
            readings(**{"pcie_replay_count": 120, **after}),
            gpu=facts(**{"ecc_errors_uncorrected": 4, **gpu_after}),
            previous=first,
            now=later,
        )
    )

    assert health["verdict"] == "unhealthy"
    assert "xid-critical" in codes(health)
    assert health["since"] == first["since"]


def test_after_a_reset_what_nvml_shows_now_still_counts() -> None:
    first = verdict_of(readings(recovery_action="reset"))
    later = NOW + timedelta(minutes=2)

    health = check(judge(readings(xid_events=[xid(79, 1)]), gpu=facts(), previous=first, now=later))

    assert health["verdict"] == "unhealthy"
    assert codes(health) == ["xid-critical"]
    assert health["since"] == "2026-12-03T12:02:00Z"  # a new episode, not the old one held


def test_a_stateless_read_says_no_since_so_two_reads_of_the_same_gpu_are_equal() -> None:
    first = check(judge(readings(remap_failure=True), gpu=facts(), now=NOW))
    second = check(judge(readings(remap_failure=True), gpu=facts(), now=NOW + timedelta(minutes=5)))

    assert first["verdict"] == "unhealthy"
    assert first["since"] is None
    assert first == second
