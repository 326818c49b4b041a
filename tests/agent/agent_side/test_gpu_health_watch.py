"""The agent's stateful GPU health read (``agent_side.gpu_health.GpuHealthWatch``) on the fake pynvml: XIDs between
two reads, verdicts held across the XID window, root's hold file read (never written under the split) and written
in-process, an operator's clear, and the NVML event set given back when the agent stops."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from types import ModuleType
from typing import Any

from ansible_collections.meridian.node.plugins.module_utils.gpu.facts import collect_gpu_facts
from ansible_collections.meridian.node.plugins.module_utils.gpu.health_hold import HOLD_FILE, HealthHolds
from ansible_collections.meridian.node.tests.support.fake_nvml import two_healthy_gpus
from ansible_collections.meridian.node.tests.support.recorded_events import RecordedEvents, recording_logger
from ansible_collections.meridian.node.tests.support.wall_clock import WallClock
from meridian_node_agent.agent_side.gpu_health import GpuHealthWatch

START = datetime(2026, 12, 5, 8, 0, tzinfo=UTC)


def watch(
    fake: ModuleType, holds_dir: Path | None, clock: WallClock, *, writes: bool
) -> tuple[GpuHealthWatch, RecordedEvents]:
    log, events = recording_logger(f"gpu-health-{id(clock)}")
    return GpuHealthWatch(holds_dir, writes_holds=writes, nvml=fake, clock=clock, log=log), events


def health(facts: dict[str, Any], index: int) -> dict[str, Any]:
    found: dict[str, Any] = facts["gpus"][index]["health"]
    return found


def codes(facts: dict[str, Any], index: int) -> list[tuple[str, Any]]:
    return [(reason["code"], reason["value"]) for reason in health(facts, index)["reasons"]]


def uuid(facts: dict[str, Any], index: int) -> str:
    return str(facts["gpus"][index]["uuid"])


def test_an_xid_between_two_reads_is_seen_and_the_verdict_holds_after_it_leaves_the_window(
    fake: ModuleType, tmp_path: Path
) -> None:
    clock = WallClock(START)
    reader, events = watch(fake, tmp_path, clock, writes=True)

    first = reader()
    assert fake.raise_xid(1, 79) == 1  # the watch's set, registered at the first read, queues it
    clock.advance(seconds=30)
    second = reader()
    clock.advance(minutes=11)  # XID_WINDOW_S is 10 minutes
    third = reader()

    assert [health(first, i)["verdict"] for i in (0, 1)] == ["healthy", "healthy"]
    assert health(second, 1)["verdict"] == "unhealthy" and ("xid-critical", 79) in codes(second, 1)
    assert health(second, 0)["verdict"] == "healthy"
    assert health(third, 1)["readings"]["xid_events"] == []  # counted in a window, not kept as a last value
    assert health(third, 1)["verdict"] == "unhealthy" and health(third, 1)["held"] is True
    assert ("xid-critical", 79) in codes(third, 1)
    held = HealthHolds(tmp_path).held(uuid(third, 1))  # in-process: the agent holds it where placement reads
    assert held is not None and held["since"] == health(second, 1)["since"]
    assert [e["verdict"] for e in events.named("gpu-health-changed") if e["uuid"] == uuid(first, 1)] == [
        "unhealthy",  # seen
        "unhealthy",  # and now held
    ]
    assert fake.event_waits and set(fake.event_waits) == {0}  # no read waits for an XID


def test_a_verdict_root_holds_shows_at_once_and_the_agent_never_writes_roots_file(
    fake: ModuleType, tmp_path: Path
) -> None:
    fake.use_scenario(
        two_healthy_gpus(remapped_rows={"correctable": 0, "uncorrectable": 3, "pending": False, "failure": True})
    )
    faulty = collect_gpu_facts(fake, processes=False, nvlink=False, previous={}, now=START)
    assert health(faulty, 1)["verdict"] == "unhealthy"
    HealthHolds(tmp_path).hold(uuid(faulty, 1), health(faulty, 1), gpu=faulty["gpus"][1])
    path = tmp_path / HOLD_FILE
    before = (path.read_bytes(), path.stat().st_mtime_ns)
    fake.use_scenario(two_healthy_gpus())  # the rows look fine now: no reset was seen, the verdict holds
    clock = WallClock(START)
    reader, _ = watch(fake, tmp_path, clock, writes=False)

    first = reader()
    fake.raise_xid(0, 48)
    clock.advance(seconds=30)
    second = reader()

    assert health(first, 1)["verdict"] == "unhealthy" and health(first, 1)["held"] is True
    assert ("row-remap-failure", True) in codes(first, 1)
    assert health(second, 0)["verdict"] == "unhealthy"  # in the agent's observations ...
    assert (path.read_bytes(), path.stat().st_mtime_ns) == before  # ... never in root's file


def test_an_unreadable_hold_file_is_said_once_and_observation_goes_on(fake: ModuleType, tmp_path: Path) -> None:
    (tmp_path / HOLD_FILE).write_text("{not json")
    clock = WallClock(START)
    reader, events = watch(fake, tmp_path, clock, writes=False)

    reads = [reader(), reader()]

    assert all(facts["nvml_available"] for facts in reads)
    assert [health(reads[1], i)["verdict"] for i in (0, 1)] == ["healthy", "healthy"]
    [said] = events.named("gpu-health-holds-unreadable")
    assert HOLD_FILE in said["error"] and "not JSON" in said["error"]


def test_a_missing_hold_directory_is_no_problem(fake: ModuleType, tmp_path: Path) -> None:
    reader, events = watch(fake, tmp_path / "not-there", WallClock(START), writes=False)

    assert health(reader(), 1)["verdict"] == "healthy"
    assert events.events == []


def test_an_operator_clear_in_process_drops_a_hold_for_an_xid_still_in_the_window(
    fake: ModuleType, tmp_path: Path
) -> None:
    clock = WallClock(START)
    reader, _ = watch(fake, tmp_path, clock, writes=True)
    reader()
    fake.raise_xid(1, 79)
    held = reader()
    assert health(held, 1)["verdict"] == "unhealthy"

    [cleared] = HealthHolds(tmp_path).clear("1", gpu_facts=held)
    clock.advance(seconds=30)
    after = reader()

    assert cleared.uuid == uuid(held, 1)
    assert health(after, 1)["verdict"] == "healthy"  # only what NVML shows from now on counts
    assert HealthHolds(tmp_path).all() == {}


def test_under_the_split_roots_clear_drops_the_agents_copy_too(fake: ModuleType, tmp_path: Path) -> None:
    fake.use_scenario(
        two_healthy_gpus(remapped_rows={"correctable": 0, "uncorrectable": 3, "pending": False, "failure": True})
    )
    faulty = collect_gpu_facts(fake, processes=False, nvlink=False, previous={}, now=START)
    holds = HealthHolds(tmp_path)
    holds.hold(uuid(faulty, 1), health(faulty, 1), gpu=faulty["gpus"][1])
    fake.use_scenario(two_healthy_gpus())
    clock = WallClock(START)
    reader, _ = watch(fake, tmp_path, clock, writes=False)
    assert health(reader(), 1)["verdict"] == "unhealthy"

    holds.clear(uuid(faulty, 1))  # root, at the operator's word
    clock.advance(seconds=30)

    assert health(reader(), 1)["verdict"] == "healthy"


def test_under_the_split_an_xid_only_the_agent_saw_stays_held_by_the_agent(fake: ModuleType, tmp_path: Path) -> None:
    clock = WallClock(START)
    reader, _ = watch(fake, tmp_path, clock, writes=False)
    reader()
    fake.raise_xid(1, 79)
    reader()

    clock.advance(minutes=11)
    later = reader()

    assert health(later, 1)["verdict"] == "unhealthy" and health(later, 1)["held"] is True
    assert not (tmp_path / HOLD_FILE).exists()


def test_a_reset_nvml_shows_releases_the_hold_in_process(fake: ModuleType, tmp_path: Path) -> None:
    fake.use_scenario(two_healthy_gpus(ecc={"corrected": 0, "uncorrected": 2}))
    clock = WallClock(START)
    reader, _ = watch(fake, tmp_path, clock, writes=True)
    bad = reader()
    assert ("ecc-volatile-dbe", 2) in codes(bad, 1)
    assert HealthHolds(tmp_path).held(uuid(bad, 1)) is not None

    fake.change_scenario(two_healthy_gpus())  # the volatile count went back to 0: the GPU was reset
    clock.advance(seconds=30)
    reset = reader()

    assert health(reset, 1)["verdict"] == "healthy"
    assert HealthHolds(tmp_path).all() == {}


def test_close_gives_the_event_set_and_nvml_back(fake: ModuleType, tmp_path: Path) -> None:
    reader, _ = watch(fake, None, WallClock(START), writes=False)
    reader()
    reader()
    assert fake.open_event_sets() == 1  # one set for the agent's life, not one per read
    assert fake.init_count() == 1  # the watch's own initialisation, across reads

    reader.close()

    assert fake.open_event_sets() == 0
    assert fake.init_count() == 0
