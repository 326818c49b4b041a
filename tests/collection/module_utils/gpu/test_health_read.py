"""Health readings from the fake pynvml: each reading read, NOT_SUPPORTED as None, any other error named.

The rules (``gpu.health_rules``) have their own tests; here the readings are what is checked, plus the
verdict each new scenario was written to show, as the whole read path hands it to the rules.
"""

import copy
from datetime import UTC, datetime
from types import ModuleType
from typing import Any, NamedTuple

import pytest

from ansible_collections.meridian.node.plugins.module_utils.contracts import GpuFacts
from ansible_collections.meridian.node.plugins.module_utils.gpu import facts as gpu_facts
from ansible_collections.meridian.node.plugins.module_utils.gpu import health_read
from ansible_collections.meridian.node.plugins.module_utils.gpu.facts import collect_gpu_facts

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)


def read(fake: ModuleType, scenario: dict[str, Any] | str, **options: Any) -> dict[str, Any]:
    fake.use_scenario(scenario)
    facts: dict[str, Any] = collect_gpu_facts(fake, now=NOW, machine_type_path=None, **options)
    GpuFacts.model_validate(facts)
    assert fake.init_count() == 0
    assert fake.open_event_sets() == 0
    return facts


def one_gpu(fake: ModuleType, **keys: Any) -> dict[str, Any]:
    scenario: dict[str, Any] = fake.generate_scenario(1)
    scenario["gpus"][0].update(keys)
    return scenario


def readings_of(fake: ModuleType, scenario: dict[str, Any] | str, index: int = 0) -> dict[str, Any]:
    health = read(fake, scenario)["gpus"][index]["health"]
    assert health is not None
    readings: dict[str, Any] = health["readings"]
    return readings


# --- one row per reading: the scenario keys that set it, the value read, and the NVML call behind it -------

RETIRED = {"retired_pages": {"sbe": 3, "dbe": 1, "pending": True}}
ROWS = {"remapped_rows": {"correctable": 4, "uncorrectable": 2, "pending": True, "failure": True}}
NVLINK = {"nvlink_errors": {"crc_flit": 1, "crc_data": 2, "replay": 3, "recovery": 4}}
REASONS = {"clock_event_reasons": ["nvmlClocksEventReasonSwPowerCap", "nvmlClocksEventReasonHwThermalSlowdown"]}


class Reading(NamedTuple):
    """A health reading: the scenario keys that set it, the value read, the NVML call behind it, and the reading
    when that call answers NOT_SUPPORTED."""

    name: str
    keys: dict[str, Any]
    value: Any
    call: str
    unsupported: Any


READINGS = [
    Reading("retired_pages_sbe", RETIRED, 3, "nvmlDeviceGetRetiredPages", None),
    Reading("retired_pages_dbe", RETIRED, 1, "nvmlDeviceGetRetiredPages", None),
    Reading("retirement_pending", RETIRED, True, "nvmlDeviceGetRetiredPagesPendingStatus", None),
    Reading("remapped_rows_correctable", ROWS, 4, "nvmlDeviceGetRemappedRows", None),
    Reading("remapped_rows_uncorrectable", ROWS, 2, "nvmlDeviceGetRemappedRows", None),
    Reading("remap_pending", ROWS, True, "nvmlDeviceGetRemappedRows", None),
    Reading("remap_failure", ROWS, True, "nvmlDeviceGetRemappedRows", None),
    Reading("recovery_action", {"recovery_action": 4}, "drain-and-reset", "nvmlDeviceGetFieldValues", None),
    Reading("pcie_replay_count", {"pcie_replay_counter": 77}, 77, "nvmlDeviceGetPcieReplayCounter", None),
    Reading(
        "clock_event_reasons",
        REASONS,
        ["sw_power_cap", "hw_thermal_slowdown"],
        "nvmlDeviceGetCurrentClocksEventReasons",
        [],
    ),
    Reading(
        "power_violation_ns",
        {"violation_ns": {"power": 5_000_000_000, "thermal": 7}},
        5_000_000_000,
        "nvmlDeviceGetViolationStatus",
        None,
    ),
    Reading(
        "thermal_violation_ns", {"violation_ns": {"power": 0, "thermal": 7}}, 7, "nvmlDeviceGetViolationStatus", None
    ),
    # 18 trained links, each 1 + 2 + 3 + 4.
    Reading("nvlink_error_count", NVLINK, 18 * 10, "nvmlDeviceGetNvLinkErrorCounter", None),
]
# Each reading, the same three ways: read, NOT_SUPPORTED, failing.
EACH_READING = pytest.mark.parametrize("row", READINGS, ids=[row.name for row in READINGS])


@EACH_READING
def test_reading_is_read(fake: ModuleType, row: Reading) -> None:
    readings = readings_of(fake, one_gpu(fake, **row.keys))

    assert readings[row.name] == row.value
    assert readings["read_errors"] == []


@EACH_READING
def test_not_supported_reading_is_none_and_no_error(fake: ModuleType, row: Reading) -> None:
    readings = readings_of(fake, one_gpu(fake, **row.keys, errors={row.call: "NVML_ERROR_NOT_SUPPORTED"}))

    assert readings[row.name] == row.unsupported
    assert readings["read_errors"] == []


@EACH_READING
def test_failing_reading_is_none_and_named_in_read_errors(fake: ModuleType, row: Reading) -> None:
    facts = read(fake, one_gpu(fake, **row.keys, errors={row.call: "NVML_ERROR_UNKNOWN"}))

    gpu = facts["gpus"][0]
    readings = gpu["health"]["readings"]
    assert readings[row.name] == row.unsupported
    assert readings["read_errors"]
    assert all(error.startswith(f"NVML_ERROR_UNKNOWN from {row.call}") for error in readings["read_errors"])
    # A health read error is the verdict's business, not a hole in the GPU's facts.
    assert gpu["error"] is None


def test_an_unsupported_gpu_has_every_reading_none(fake: ModuleType) -> None:
    # The GeForce scenario: none of the health counters exist, and that is no error.
    readings = readings_of(fake, "not-supported")

    assert readings == {
        **health_read.empty_readings(),
        "pcie_replay_count": 0,
        "clock_event_reasons": ["gpu_idle"],
    }


@pytest.mark.parametrize(
    ("error", "named"),
    [
        ("NVML_ERROR_NOT_SUPPORTED", False),
        ("NVML_ERROR_FUNCTION_NOT_FOUND", True),
        ("NVML_ERROR_GPU_IS_LOST", True),
        ("NVML_ERROR_RESET_REQUIRED", True),
        ("NVML_ERROR_NO_PERMISSION", True),
        ("NVML_ERROR_TIMEOUT", True),
    ],
)
def test_every_nvml_error_but_not_supported_is_a_read_error(fake: ModuleType, error: str, named: bool) -> None:
    readings = readings_of(fake, one_gpu(fake, errors={"nvmlDeviceGetRemappedRows": error}))

    assert readings["remap_failure"] is None
    assert readings["read_errors"] == ([f"{error} from nvmlDeviceGetRemappedRows"] if named else [])


@pytest.mark.parametrize("error", ["NVML_ERROR_GPU_IS_LOST", "NVML_ERROR_RESET_REQUIRED"])
def test_gpu_gone_during_the_health_read_is_asked_nothing_more(fake: ModuleType, error: str) -> None:
    readings = readings_of(fake, one_gpu(fake, errors={"nvmlDeviceGetRemappedRows": error}))

    assert readings["read_errors"] == [f"{error} from nvmlDeviceGetRemappedRows"]
    # The reads after it, and the XID registration, are not made.
    assert readings["recovery_action"] is None
    assert fake.calls["nvmlDeviceGetFieldValues"] == 0
    assert fake.calls["nvmlDeviceGetNvLinkErrorCounter"] == 0
    assert fake.calls["nvmlDeviceRegisterEvents"] == 0


def test_function_not_found_on_the_new_clock_event_name_falls_back_to_the_throttle_name(fake: ModuleType) -> None:
    scenario = one_gpu(
        fake, **REASONS, errors={"nvmlDeviceGetCurrentClocksEventReasons": "NVML_ERROR_FUNCTION_NOT_FOUND"}
    )

    readings = readings_of(fake, scenario)

    # A driver older than R535 has only nvmlDeviceGetCurrentClocksThrottleReasons: the same reading.
    assert readings["clock_event_reasons"] == ["sw_power_cap", "hw_thermal_slowdown"]
    assert readings["read_errors"] == []
    assert fake.calls["nvmlDeviceGetCurrentClocksThrottleReasons"] == 1


def test_function_not_found_on_both_clock_event_names_is_a_read_error(fake: ModuleType) -> None:
    missing = "NVML_ERROR_FUNCTION_NOT_FOUND"
    scenario = one_gpu(
        fake,
        **REASONS,
        errors={
            "nvmlDeviceGetCurrentClocksEventReasons": missing,
            "nvmlDeviceGetCurrentClocksThrottleReasons": missing,
        },
    )

    readings = readings_of(fake, scenario)

    assert readings["clock_event_reasons"] == []
    assert readings["read_errors"] == [f"{missing} from nvmlDeviceGetCurrentClocksThrottleReasons"]


def test_clock_event_reason_unknown_to_this_nvidia_ml_py_is_named_by_its_bit(fake: ModuleType) -> None:
    readings = readings_of(fake, one_gpu(fake, clock_event_reasons=0x4 | 0x100000))

    assert readings["clock_event_reasons"] == ["sw_power_cap", "unknown_0x100000"]


@pytest.mark.parametrize(
    ("action", "name"),
    [(0, "none"), (1, "reset"), (2, "reboot"), (3, "drain-p2p"), (4, "drain-and-reset")],
)
def test_recovery_action_names(fake: ModuleType, action: int, name: str) -> None:
    assert readings_of(fake, one_gpu(fake, recovery_action=action))["recovery_action"] == name


def test_recovery_action_field_error_is_named_with_the_field(fake: ModuleType) -> None:
    # nvmlDeviceGetFieldValues succeeds; the field itself carries the error.
    scenario = one_gpu(fake, field_errors={"NVML_FI_DEV_GET_GPU_RECOVERY_ACTION": "NVML_ERROR_UNKNOWN"})

    readings = readings_of(fake, scenario)

    assert readings["recovery_action"] is None
    assert readings["read_errors"] == [
        "NVML_ERROR_UNKNOWN from nvmlDeviceGetFieldValues(NVML_FI_DEV_GET_GPU_RECOVERY_ACTION)"
    ]


def test_recovery_action_field_not_supported_is_none(fake: ModuleType) -> None:
    readings = readings_of(fake, one_gpu(fake, recovery_action=None))

    assert readings["recovery_action"] is None
    assert readings["read_errors"] == []


def test_recovery_action_unknown_to_meridian_is_a_read_error(fake: ModuleType) -> None:
    readings = readings_of(fake, one_gpu(fake, recovery_action=9))

    assert readings["recovery_action"] is None
    assert readings["read_errors"][0].startswith("recovery action 9 from nvmlDeviceGetFieldValues")


def test_nvlink_errors_sum_active_links_only(fake: ModuleType) -> None:
    scenario = one_gpu(fake)
    links = scenario["gpus"][0]["nvlinks"]
    links[3] = None  # trained down: its counters are not read
    per_link: list[dict[str, int] | None] = [{"crc_flit": 0, "crc_data": 0, "replay": 1, "recovery": 0}] * 18
    per_link[3] = {"crc_flit": 1000, "crc_data": 0, "replay": 0, "recovery": 0}
    scenario["gpus"][0]["nvlink_errors"] = per_link

    readings = readings_of(fake, scenario)

    assert readings["nvlink_error_count"] == 17
    assert fake.calls["nvmlDeviceGetNvLinkErrorCounter"] == 17 * 4


def test_nvlink_counter_not_supported_on_some_links_still_sums_the_others(fake: ModuleType) -> None:
    scenario = one_gpu(fake)
    per_link: list[dict[str, int] | None] = [{"crc_flit": 0, "crc_data": 0, "replay": 2, "recovery": 0}] * 18
    per_link[0] = None
    scenario["gpus"][0]["nvlink_errors"] = per_link

    readings = readings_of(fake, scenario)

    assert readings["nvlink_error_count"] == 34
    assert readings["read_errors"] == []


def test_gpu_without_nvlink_has_no_nvlink_error_count(fake: ModuleType) -> None:
    scenario = fake.generate_scenario(1, nvlink=False)

    assert readings_of(fake, scenario)["nvlink_error_count"] is None


def test_nvlink_state_error_on_the_health_scan_is_a_read_error(fake: ModuleType) -> None:
    scenario = one_gpu(fake, errors={"nvmlDeviceGetNvLinkState": "NVML_ERROR_UNKNOWN"})

    facts = read(fake, scenario, nvlink=False)

    readings = facts["gpus"][0]["health"]["readings"]
    assert readings["read_errors"][0] == "NVML_ERROR_UNKNOWN from nvmlDeviceGetNvLinkState(link 0)"
    assert readings["nvlink_error_count"] is None


def test_gpu_lost_while_reading_facts_has_that_error_as_its_health_read_error(fake: ModuleType) -> None:
    facts = read(fake, "gpu-lost")

    lost = facts["gpus"][2]["health"]
    assert lost["readings"]["read_errors"] == ["NVML_ERROR_GPU_IS_LOST from nvmlDeviceGetMemoryInfo"]
    assert lost["verdict"] == "unhealthy"
    # Nothing health-related is asked of it: the three others answer, it does not.
    assert fake.calls["nvmlDeviceGetRemappedRows"] == 3


def test_gpu_whose_handle_is_refused_gets_a_verdict_from_that_error(fake: ModuleType) -> None:
    scenario = fake.generate_scenario(2)
    scenario["gpus"][1]["errors"] = {"nvmlDeviceGetHandleByIndex": "NVML_ERROR_NO_PERMISSION"}

    facts = read(fake, scenario)

    health = facts["gpus"][1]["health"]
    assert health["readings"]["read_errors"] == ["NVML_ERROR_NO_PERMISSION from nvmlDeviceGetHandleByIndex"]
    assert health["verdict"] == "unhealthy"
    assert facts["gpus"][0]["health"]["verdict"] == "healthy"


def test_health_off_asks_no_health_call(fake: ModuleType) -> None:
    facts = read(fake, "eight-gpus", health=False)

    assert all(gpu["health"] is None for gpu in facts["gpus"])
    for call in (
        "nvmlDeviceGetRemappedRows",
        "nvmlDeviceGetFieldValues",
        "nvmlDeviceGetViolationStatus",
        "nvmlDeviceGetNvLinkErrorCounter",
        "nvmlEventSetCreate",
    ):
        assert fake.calls[call] == 0, call


# --- the scenarios written for the health rules, read end to end --------------------------------------------

SCENARIOS = [
    # (scenario, GPU index, readings expected there, verdict)
    ("h100-healthy", 0, {"recovery_action": "none", "remap_failure": False, "nvlink_error_count": 0}, "healthy"),
    ("volatile-dbe", 1, {"remap_pending": True, "remapped_rows_uncorrectable": 1}, "unhealthy"),
    ("row-remap-failure", 0, {"remap_failure": True, "remapped_rows_uncorrectable": 9}, "unhealthy"),
    ("row-remap-failure", 1, {"remap_pending": True, "remap_failure": False}, "degraded"),
    (
        "retirement-pending",
        0,
        {"retired_pages_sbe": 2, "retired_pages_dbe": 1, "retirement_pending": True, "remap_pending": None},
        "degraded",
    ),
    ("xid-79", 1, {"xid_events": [{"xid": 79, "at": "2026-12-01T12:00:00Z", "mig_uuid": None}]}, "unhealthy"),
    ("xid-79", 0, {"xid_events": []}, "healthy"),
    ("pcie-downgraded", 0, {"pcie_replay_count": 1200, "read_errors": []}, "degraded"),
    ("wedged-reset", 0, {"recovery_action": "reset", "read_errors": []}, "unhealthy"),
]


@pytest.mark.parametrize(
    ("scenario", "index", "expected", "verdict"),
    SCENARIOS,
    ids=[f"{row[0]}-gpu{row[1]}" for row in SCENARIOS],
)
def test_scenario_readings_and_verdict(
    fake: ModuleType, scenario: str, index: int, expected: dict[str, Any], verdict: str
) -> None:
    health = read(fake, scenario)["gpus"][index]["health"]

    assert {key: health["readings"][key] for key in expected} == expected
    assert health["verdict"] == verdict


def test_wedged_gpu_reads_clean_ecc_but_is_unhealthy(fake: ModuleType) -> None:
    gpu = read(fake, "wedged-reset")["gpus"][0]

    assert (gpu["ecc_errors_corrected"], gpu["ecc_errors_uncorrected"]) == (0, 0)
    assert gpu["health"]["verdict"] == "unhealthy"
    assert [reason["value"] for reason in gpu["health"]["reasons"]] == ["reset"]


def test_volatile_dbe_stays_in_the_gpu_field(fake: ModuleType) -> None:
    gpu = read(fake, "volatile-dbe")["gpus"][1]

    assert gpu["ecc_errors_uncorrected"] == 2
    assert "ecc-volatile-dbe" in {reason["code"] for reason in gpu["health"]["reasons"]}


# --- what reaches the rules ---------------------------------------------------------------------------------


def test_judge_gets_the_readings_the_gpu_and_the_previous_verdict_by_uuid(
    fake: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[dict[str, Any]] = []

    def recording_judge(readings: Any, *, gpu: Any, previous: Any = None, now: Any, previous_at: Any = None) -> Any:
        seen.append(
            {"readings": copy.deepcopy(readings), "gpu": gpu, "previous": previous, "now": now, "at": previous_at}
        )
        return {"verdict": "healthy", "reasons": [], "since": None, "held": False, "readings": readings}

    monkeypatch.setattr(gpu_facts, "judge", recording_judge)
    scenario = fake.generate_scenario(2)
    first_uuid = scenario["gpus"][0]["uuid"]
    earlier = {"verdict": "degraded", "reasons": [], "since": "2026-12-01T11:00:00Z", "held": False}
    before = datetime(2026, 12, 1, 11, 59, 30, tzinfo=UTC)

    read(fake, scenario, previous={first_uuid: earlier}, previous_at=before)

    assert [call["gpu"]["index"] for call in seen] == [0, 1]
    assert seen[0]["previous"] == earlier
    assert seen[0]["at"] == before
    # No earlier verdict for GPU 1: a stateful caller's first read of it ({}), without a time to compare with.
    assert (seen[1]["previous"], seen[1]["at"]) == ({}, None)
    assert all(call["now"] == NOW for call in seen)
    seen.clear()
    read(fake, scenario)
    assert [call["previous"] for call in seen] == [None, None], "a stateless read has no history at all"
    assert seen[0]["readings"]["pcie_replay_count"] == 0
