"""XID events through NVML's event set on the fake pynvml: a set per read, and the watch kept across reads."""

from datetime import UTC, datetime, timedelta
from types import ModuleType
from typing import Any

import pytest

from ansible_collections.meridian.node.plugins.module_utils.contracts import GpuFacts
from ansible_collections.meridian.node.plugins.module_utils.gpu import xid_events
from ansible_collections.meridian.node.plugins.module_utils.gpu.facts import collect_gpu_facts
from ansible_collections.meridian.node.plugins.module_utils.gpu.nvml import nvml_session
from ansible_collections.meridian.node.plugins.module_utils.gpu.xid_events import XidTarget, XidWatch, read_xid_events

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
STAMP = "2026-12-01T12:00:00Z"


def read(fake: ModuleType, **options: Any) -> dict[str, Any]:
    facts = collect_gpu_facts(fake, machine_type_path=None, processes=False, nvlink=False, **options)
    GpuFacts.model_validate(facts)
    return facts


def events(facts: dict[str, Any], index: int) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = facts["gpus"][index]["health"]["readings"]["xid_events"]
    return found


def errors(facts: dict[str, Any], index: int) -> list[str]:
    found: list[str] = facts["gpus"][index]["health"]["readings"]["read_errors"]
    return found


def test_xids_land_on_their_gpu_and_mig_device(fake: ModuleType) -> None:
    fake.use_scenario("xid-events")

    facts = read(fake, now=NOW)

    mig = facts["gpus"][0]["mig_instances"][0]["uuid"]
    # The rules keep the events in their window's order (by time, then XID).
    assert sorted(events(facts, 0), key=lambda event: event["xid"]) == [
        {"xid": 13, "at": STAMP, "mig_uuid": None},
        {"xid": 31, "at": STAMP, "mig_uuid": mig},
        {"xid": 48, "at": STAMP, "mig_uuid": None},
        {"xid": 79, "at": STAMP, "mig_uuid": None},
    ]
    assert events(facts, 1) == []
    assert errors(facts, 0) == errors(facts, 1) == []


def test_a_read_frees_its_set_and_never_blocks(fake: ModuleType) -> None:
    fake.use_scenario("xid-79")

    facts = read(fake, now=NOW)

    assert [event["xid"] for event in events(facts, 1)] == [79]
    assert fake.calls["nvmlEventSetCreate"] == fake.calls["nvmlEventSetFree"] == 1
    assert fake.open_event_sets() == 0
    # One event, then the wait that says none is left; neither may wait.
    assert fake.event_waits == [0, 0]


def test_the_set_registers_critical_xids_on_each_gpu_that_supports_them(fake: ModuleType) -> None:
    scenario = fake.generate_scenario(3)
    scenario["gpus"][1]["event_types"] = ["nvmlEventTypePState"]  # no XID events on this one
    scenario["gpus"][2]["event_types"] = None  # nvmlDeviceGetSupportedEventTypes: NOT_SUPPORTED
    scenario["gpus"][1]["events"] = [{"xid": 79}]
    fake.use_scenario(scenario)

    facts = read(fake)

    assert fake.calls["nvmlDeviceRegisterEvents"] == 1
    # An XID on a GPU that cannot report one is not seen; that is no error, only a blind spot.
    assert events(facts, 1) == []
    assert all(errors(facts, index) == [] for index in range(3))


def test_gpu_instance_split_into_compute_instances_charges_the_whole_gpu(fake: ModuleType) -> None:
    target = XidTarget(
        "GPU-x",
        None,
        [
            {"uuid": "MIG-a", "gpu_instance_id": 1, "compute_instance_id": 0},
            {"uuid": "MIG-b", "gpu_instance_id": 1, "compute_instance_id": 1},
            {"uuid": "MIG-c", "gpu_instance_id": 2, "compute_instance_id": 0},
        ],
    )
    any_instance = 0xFFFFFFFF

    mig_uuid = xid_events._mig_uuid
    assert mig_uuid(target, 1, 1) == "MIG-b"
    assert mig_uuid(target, 2, any_instance) == "MIG-c"
    assert mig_uuid(target, 1, any_instance) is None
    assert mig_uuid(target, any_instance, any_instance) is None
    assert mig_uuid(target, 5, 0) is None


@pytest.mark.parametrize(
    ("failing", "error"),
    [
        ("nvmlEventSetCreate", "NVML_ERROR_UNKNOWN"),
        ("nvmlEventSetWait_v2", "NVML_ERROR_GPU_IS_LOST"),
        ("nvmlEventSetWait_v2", "NVML_ERROR_NO_PERMISSION"),
    ],
)
def test_a_host_wide_event_error_is_charged_to_every_gpu(fake: ModuleType, failing: str, error: str) -> None:
    scenario = fake.generate_scenario(2)
    scenario["errors"] = {failing: error}
    fake.use_scenario(scenario)

    facts = read(fake)

    for index in (0, 1):
        assert errors(facts, index) == [f"{error} from {failing}"]
        assert facts["gpus"][index]["health"]["verdict"] == "unhealthy"
    assert fake.open_event_sets() == 0


def test_event_sets_unsupported_on_the_platform_are_quiet(fake: ModuleType) -> None:
    scenario = fake.generate_scenario(2)
    scenario["errors"] = {"nvmlEventSetCreate": "NVML_ERROR_NOT_SUPPORTED"}
    fake.use_scenario(scenario)

    facts = read(fake)

    assert errors(facts, 0) == errors(facts, 1) == []
    assert fake.calls["nvmlDeviceRegisterEvents"] == 0


def test_wait_timeout_in_the_errors_map_is_just_no_event(fake: ModuleType) -> None:
    scenario = fake.generate_scenario(1)
    scenario["errors"] = {"nvmlEventSetWait_v2": "NVML_ERROR_TIMEOUT"}
    fake.use_scenario(scenario)

    facts = read(fake)

    assert events(facts, 0) == []
    assert errors(facts, 0) == []


@pytest.mark.parametrize(
    "error", ["NVML_ERROR_FUNCTION_NOT_FOUND", "NVML_ERROR_NO_PERMISSION", "NVML_ERROR_RESET_REQUIRED"]
)
def test_registration_error_is_charged_to_that_gpu_only(fake: ModuleType, error: str) -> None:
    scenario = fake.generate_scenario(2)
    scenario["gpus"][0]["errors"] = {"nvmlDeviceRegisterEvents": error}
    scenario["gpus"][1]["events"] = [{"xid": 94}]
    fake.use_scenario(scenario)

    facts = read(fake)

    assert errors(facts, 0) == [f"{error} from nvmlDeviceRegisterEvents"]
    assert errors(facts, 1) == []
    assert [event["xid"] for event in events(facts, 1)] == [94]


def test_driver_without_wait_v2_uses_the_older_wait(fake: ModuleType) -> None:
    scenario = fake.generate_scenario(1)
    scenario["errors"] = {"nvmlEventSetWait_v2": "NVML_ERROR_FUNCTION_NOT_FOUND"}
    scenario["gpus"][0]["events"] = [{"xid": 79}]
    fake.use_scenario(scenario)

    facts = read(fake)

    assert [event["xid"] for event in events(facts, 0)] == [79]
    assert errors(facts, 0) == []
    assert fake.calls["nvmlEventSetWait"] == 2


def test_event_whose_gpu_cannot_be_named_is_charged_to_every_gpu(fake: ModuleType) -> None:
    scenario = fake.generate_scenario(2)
    scenario["gpus"][0]["events"] = [{"xid": 79}]
    fake.use_scenario(scenario)

    with nvml_session(fake) as session:
        handles = [fake.nvmlDeviceGetHandleByIndex(index) for index in range(2)]
        targets = [XidTarget(str(fake.nvmlDeviceGetUUID(handle)), handle) for handle in handles]
        # From here the event's device answers nothing: its UUID cannot be read.
        scenario["gpus"][0]["errors"] = {"nvmlDeviceGetUUID": "NVML_ERROR_UNKNOWN"}
        seen = read_xid_events(session, targets, now=NOW)

    expected = "NVML_ERROR_UNKNOWN from nvmlDeviceGetUUID (the GPU of XID 79)"
    assert [seen[target.uuid]["read_errors"] for target in targets] == [[expected], [expected]]
    assert all(seen[target.uuid]["xid_events"] == [] for target in targets)


def test_an_xid_storm_is_read_in_bounded_batches(fake: ModuleType) -> None:
    fake.use_scenario(fake.generate_scenario(1))

    with nvml_session(fake) as session, XidWatch() as watch:
        handle = fake.nvmlDeviceGetHandleByIndex(0)
        target = XidTarget(str(fake.nvmlDeviceGetUUID(handle)), handle)
        watch.read(session, [target], now=NOW)
        for _ in range(xid_events.MAX_EVENTS_PER_READ + 10):
            fake.raise_xid(0, 31)
        first = watch.read(session, [target], now=NOW)
        rest = watch.read(session, [target], now=NOW)

    # A storm does not hold a read: what is left stays queued for the next one.
    assert len(first[target.uuid]["xid_events"]) == xid_events.MAX_EVENTS_PER_READ
    assert len(rest[target.uuid]["xid_events"]) == 10


# --- why the agent needs the watch: a set per read misses what happens between reads ------------------------


def test_a_set_per_read_misses_the_xid_between_two_reads(fake: ModuleType) -> None:
    fake.use_scenario(fake.generate_scenario(2))
    read(fake)

    with nvml_session(fake):
        # The XID happens between the reads: no set is open, so NVML records it nowhere.
        assert fake.raise_xid(1, 79) == 0
    facts = read(fake)

    assert events(facts, 1) == []


def test_the_watch_sees_the_xid_between_two_reads_once(fake: ModuleType) -> None:
    fake.use_scenario(fake.generate_scenario(2))
    with XidWatch() as watch:
        first = read(fake, xids=watch, now=NOW)
        # The reads' own session is shut down; the watch still holds NVML and its set.
        assert fake.init_count() == 1
        assert fake.raise_xid(1, 79, gpu_instance_id=None) == 1
        later = NOW + timedelta(seconds=30)
        second = read(fake, xids=watch, now=later)
        third = read(fake, xids=watch, now=later + timedelta(seconds=30))

    assert events(first, 1) == []
    assert events(second, 1) == [{"xid": 79, "at": "2026-12-01T12:00:30Z", "mig_uuid": None}]
    # Delivered once: the next read does not see it again (the rules keep their own window).
    assert events(third, 1) == []
    assert events(second, 0) == []
    assert fake.calls["nvmlEventSetCreate"] == 1
    assert fake.calls["nvmlDeviceRegisterEvents"] == 2
    assert fake.init_count() == 0
    assert fake.open_event_sets() == 0


def test_the_watch_registers_a_gpu_that_appears_later(fake: ModuleType) -> None:
    scenario = fake.generate_scenario(2)
    fake.use_scenario({**scenario, "gpus": scenario["gpus"][:1]})
    with XidWatch() as watch:
        read(fake, xids=watch)
        fake.change_scenario(scenario)
        facts = read(fake, xids=watch)
        assert fake.raise_xid(1, 48) == 1
        later = read(fake, xids=watch)

    assert events(facts, 1) == []
    assert [event["xid"] for event in events(later, 1)] == [48]
    assert fake.calls["nvmlDeviceRegisterEvents"] == 2


def test_a_broken_watch_is_reopened_on_the_next_read(fake: ModuleType) -> None:
    scenario = fake.generate_scenario(1)
    fake.use_scenario(scenario)
    with XidWatch() as watch:
        read(fake, xids=watch)
        fake.change_scenario({**scenario, "errors": {"nvmlEventSetWait_v2": "NVML_ERROR_UNKNOWN"}})
        broken = read(fake, xids=watch)
        assert not watch.open
        assert fake.init_count() == 0
        fake.change_scenario(scenario)
        mended = read(fake, xids=watch)
        assert watch.open

    assert errors(broken, 0) == ["NVML_ERROR_UNKNOWN from nvmlEventSetWait_v2"]
    assert errors(mended, 0) == []
    assert fake.calls["nvmlEventSetCreate"] == 2
    assert fake.open_event_sets() == 0


def test_a_watch_on_a_platform_without_event_sets_does_not_ask_again(fake: ModuleType) -> None:
    scenario = fake.generate_scenario(1)
    scenario["errors"] = {"nvmlEventSetCreate": "NVML_ERROR_NOT_SUPPORTED"}
    fake.use_scenario(scenario)
    with XidWatch() as watch:
        read(fake, xids=watch)
        read(fake, xids=watch)

    assert fake.calls["nvmlEventSetCreate"] == 1
    assert fake.init_count() == 0


def test_scenario_events_arrive_once_per_scenario_load_in_a_watch(fake: ModuleType) -> None:
    fake.use_scenario("xid-79")
    with XidWatch() as watch:
        first = read(fake, xids=watch)
        second = read(fake, xids=watch)
        fake.change_scenario("xid-79")
        third = read(fake, xids=watch)

    assert [event["xid"] for event in events(first, 1)] == [79]
    assert events(second, 1) == []
    assert [event["xid"] for event in events(third, 1)] == [79]


def test_public_api_is_pinned() -> None:
    assert sorted(xid_events.__all__) == ["MAX_EVENTS_PER_READ", "WAIT_MS", "XidTarget", "XidWatch", "read_xid_events"]
    assert xid_events.WAIT_MS == 0
