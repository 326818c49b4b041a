"""The agent relays what only its XID watch sees: ``GpuHealthWatch.xid_reports`` fills the apply request's
``gpu_reports`` (``SystemdApplier``), and root holds them (``root_side.gpu_reports``). On the fake pynvml, whose
``raise_xid`` queues an XID in every event set registered for the GPU, as NVML does."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import ModuleType

import pytest

from ansible_collections.meridian.node.plugins.module_utils.engines.placement import with_held_verdicts
from ansible_collections.meridian.node.plugins.module_utils.gpu.facts import collect_gpu_facts
from ansible_collections.meridian.node.plugins.module_utils.gpu.health_hold import HealthHolds
from ansible_collections.meridian.node.tests.devserver.devserver_process import DevServer
from ansible_collections.meridian.node.tests.support.fake_nvml import two_healthy_gpus
from ansible_collections.meridian.node.tests.support.node_env import make_node
from ansible_collections.meridian.node.tests.support.wall_clock import WallClock
from meridian_node_agent.agent_side.gpu_health import GpuHealthWatch
from meridian_node_agent.agent_side.systemd_applier import GpuRelay, SystemdApplier
from meridian_node_agent.boundary.spool import REQUEST_FILE, SPOOL_DIR, GpuReport
from meridian_node_agent.cli.agent import build_agent
from meridian_node_agent.root_side.gpu_reports import relay_gpu_reports
from meridian_node_agent.root_side.root_dir import read_request

START = datetime(2026, 12, 5, 8, 0, tzinfo=UTC)
GPU1 = "GPU-a1b2c301-51d0-4e7a-9c3f-6b0e2d4f1a01"


@pytest.fixture
def clock() -> WallClock:
    return WallClock(START)


@pytest.fixture
def root_dir(tmp_path: Path) -> Path:
    """Root's ``apply.state_dir``: the hold file is there, and the agent only reads it (``writes_holds`` off)."""
    path = tmp_path / "apply"
    path.mkdir()
    return path


def split_watch(fake: ModuleType, root_dir: Path, clock: WallClock) -> GpuHealthWatch:
    return GpuHealthWatch(root_dir, writes_holds=False, nvml=fake, clock=clock)


def xid_seen(fake: ModuleType, reader: GpuHealthWatch, clock: WallClock, *xids: int, gpu: int = 1) -> None:
    """A first read registers the event set; the XIDs happen; the next read, 30 s later, counts them."""
    reader()
    for xid in xids:
        fake.raise_xid(gpu, xid)
    clock.advance(seconds=30)
    reader()


def relayed_xid_79(fake: ModuleType, root_dir: Path, clock: WallClock) -> GpuHealthWatch:
    """A split watch that saw XID 79 on GPU 1 and whose report root has just taken up as a hold."""
    reader = split_watch(fake, root_dir, clock)
    xid_seen(fake, reader, clock, 79)
    relay_gpu_reports(root_dir, reader.xid_reports(), now=clock(), nvml=fake)
    return reader


def test_a_gpu_unhealthy_by_xid_79_is_reported_with_when_it_was_seen(
    fake: ModuleType, root_dir: Path, clock: WallClock
) -> None:
    reader = split_watch(fake, root_dir, clock)

    assert [reader(), reader.xid_reports()][1] == []  # nothing to report before the XID
    fake.raise_xid(1, 79)
    clock.advance(seconds=30)
    reader()

    assert reader.xid_reports() == [GpuReport(uuid=GPU1, xids=[79], seen_at=START + timedelta(seconds=30))]


def test_only_critical_xids_on_a_whole_gpu_are_reported(fake: ModuleType, root_dir: Path, clock: WallClock) -> None:
    reader = split_watch(fake, root_dir, clock)

    xid_seen(fake, reader, clock, 13, 63)  # an application XID, a warning XID: degraded at worst
    assert reader.xid_reports() == []

    fake.raise_xid(1, 74)
    fake.raise_xid(1, 13)
    clock.advance(seconds=30)
    reader()
    assert [(report.uuid, report.xids) for report in reader.xid_reports()] == [(GPU1, [74])]


def test_a_gpu_unhealthy_for_a_counter_alone_is_not_relayed(fake: ModuleType, root_dir: Path, clock: WallClock) -> None:
    # Root's own timer reads the counters; only XIDs need the agent's word.
    fake.use_scenario(two_healthy_gpus(ecc={"corrected": 0, "uncorrected": 2}))
    reader = split_watch(fake, root_dir, clock)

    facts = reader()

    assert facts["gpus"][1]["health"]["verdict"] == "unhealthy"
    assert reader.xid_reports() == []


def test_an_xid_past_its_window_is_still_reported_while_the_verdict_holds(
    fake: ModuleType, root_dir: Path, clock: WallClock
) -> None:
    reader = split_watch(fake, root_dir, clock)
    xid_seen(fake, reader, clock, 79)
    seen = reader.xid_reports()[0].seen_at

    clock.advance(minutes=11)  # XID_WINDOW_S is 10 minutes: the event left the window, the verdict holds
    later = reader()

    assert later["gpus"][1]["health"]["readings"]["xid_events"] == []
    assert reader.xid_reports() == [GpuReport(uuid=GPU1, xids=[79], seen_at=seen)]


def test_a_hold_an_operator_cleared_since_the_last_read_is_not_reported_again(
    fake: ModuleType, root_dir: Path, clock: WallClock
) -> None:
    reader = relayed_xid_79(fake, root_dir, clock)  # root holds it
    clock.advance(seconds=30)
    reader()  # and the agent has seen it held

    HealthHolds(root_dir).clear(GPU1)  # the operator, between two of the agent's reads

    assert reader.xid_reports() == []  # an apply now would not undo the clear
    clock.advance(seconds=30)
    after = reader()
    assert after["gpus"][1]["health"]["verdict"] == "healthy"  # the next read drops the agent's own copy
    assert reader.xid_reports() == []


def test_a_clear_right_after_the_answer_sticks_once_the_watch_noted_roots_holds(
    fake: ModuleType, root_dir: Path, clock: WallClock
) -> None:
    reader = relayed_xid_79(fake, root_dir, clock)

    reader.note_holds()  # what the applier does once root answered
    HealthHolds(root_dir).clear(GPU1)  # before the agent's next read

    assert reader.xid_reports() == []


def test_without_noting_roots_holds_such_a_clear_would_be_undone(
    fake: ModuleType, root_dir: Path, clock: WallClock
) -> None:
    # The case note_holds exists for: the watch never saw the hold, so it cannot tell a clear from no hold yet.
    reader = relayed_xid_79(fake, root_dir, clock)

    HealthHolds(root_dir).clear(GPU1)

    assert [report.uuid for report in reader.xid_reports()] == [GPU1]


# --- the apply request ------------------------------------------------------------------------------------------


class Ticks:
    """A monotonic clock past any deadline at its second reading: the applier gives up waiting at once."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> float:
        self.calls += 1
        return 0.0 if self.calls == 1 else 1e9


def applier(tmp_path: Path, root_dir: Path, relay: GpuRelay | None) -> SystemdApplier:
    return SystemdApplier(
        state_dir=tmp_path / "agent",
        apply_state_dir=root_dir,
        timeout_s=60,
        clock=lambda: START,
        monotonic=Ticks(),
        gpu_relay=relay,
    )


def test_the_request_relays_the_watchs_reports_and_root_holds_them_for_placement(
    fake: ModuleType, tmp_path: Path, root_dir: Path, clock: WallClock
) -> None:
    reader = split_watch(fake, root_dir, clock)
    xid_seen(fake, reader, clock, 79)

    result = applier(tmp_path, root_dir, reader).apply(b"{}", generation=3, epoch=1, payload_sha256="a" * 64)

    assert result.status == "timeout"  # no root unit listens here; the request is what matters
    request = read_request(tmp_path / "agent")
    assert request is not None
    assert request.gpu_reports == [GpuReport(uuid=GPU1, xids=[79], seen_at=START + timedelta(seconds=30))]
    # Root's side of it, as the apply unit does it after verifying the envelope:
    relay_gpu_reports(root_dir, request.gpu_reports, now=clock(), nvml=fake)
    fresh = collect_gpu_facts(fake, processes=False, nvlink=False, now=clock())  # a fresh process sees no XID
    assert fresh["gpus"][1]["health"]["verdict"] == "healthy"
    placed = with_held_verdicts(fresh, HealthHolds(root_dir))
    assert [gpu["health"]["verdict"] for gpu in placed["gpus"]] == ["healthy", "unhealthy"]


@pytest.mark.parametrize("relayed", [False, True])
def test_a_request_with_nothing_to_report_is_written_as_before_the_relay(
    fake: ModuleType, tmp_path: Path, root_dir: Path, clock: WallClock, relayed: bool
) -> None:
    reader = split_watch(fake, root_dir, clock)
    reader()  # all healthy

    applier(tmp_path, root_dir, reader if relayed else None).apply(
        b"{}", generation=3, epoch=1, payload_sha256="a" * 64
    )

    raw = json.loads((tmp_path / "agent" / SPOOL_DIR / REQUEST_FILE).read_bytes())
    assert sorted(raw) == ["envelope", "format", "request"]  # what a root side from before the relay reads


def test_run_under_the_split_relays_what_its_observers_watch_saw(
    server: DevServer, tmp_path: Path, node_id: str, fake: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ansible_collections.meridian.node.plugins.module_utils.gpu import nvml as nvml_seam

    monkeypatch.setattr(nvml_seam, "_pynvml", fake)  # build_agent's reader uses the seam's pynvml
    node = make_node(server, tmp_path / "node", node_id)
    node.configure(apply={"via": "systemd", "timeout_seconds": 60, "state_dir": str(tmp_path / "apply")})
    agent = build_agent(node.config)
    try:
        agent.observer.gpu()  # the watch's event set is registered at its first read
        fake.raise_xid(1, 79)
        agent.observer.forget()
        agent.observer.gpu()

        # The applier relays from the very watch the observer reads with: the only one that saw the XID.
        assert [(report.uuid, report.xids) for report in agent.applier.gpu_relay.xid_reports()] == [(GPU1, [79])]
    finally:
        agent.close()


class SpyRelay:
    """A relay that says what the applier asked of it, in order."""

    def __init__(self, reports: list[GpuReport]) -> None:
        self.reports = reports
        self.asked: list[str] = []

    def xid_reports(self) -> list[GpuReport]:
        self.asked.append("xid_reports")
        return self.reports

    def note_holds(self) -> None:
        self.asked.append("note_holds")


@pytest.mark.parametrize(("reports", "asked"), [([], ["xid_reports"]), (None, ["xid_reports", "note_holds"])])
def test_the_applier_reads_roots_holds_again_after_relaying_some(
    tmp_path: Path, root_dir: Path, reports: list[GpuReport] | None, asked: list[str]
) -> None:
    relay = SpyRelay([GpuReport(uuid=GPU1, xids=[79], seen_at=START)] if reports is None else reports)

    applier(tmp_path, root_dir, relay).apply(b"{}", generation=3, epoch=1, payload_sha256="a" * 64)

    assert relay.asked == asked
