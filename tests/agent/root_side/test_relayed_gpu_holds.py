"""Root holds the GPUs the agent relays unhealthy by XID (``root_side.gpu_reports``), only ever adding.

The reports are the (possibly compromised) agent's word: these tests hold root to adding holds for GPUs of this
host only, never clearing or weakening one, staying bounded, and doing so only for a request whose envelope it
verified, before the playbook's placement reads the file. The fake pynvml plays the host; no Docker, no playbook:
``apply_unit.Applier`` is replaced by one that records what the hold file said when it was asked to apply.
"""

from __future__ import annotations

import base64
import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from ansible_collections.meridian.node.plugins.module_utils.engines.placement import with_held_verdicts
from ansible_collections.meridian.node.plugins.module_utils.gpu.facts import collect_gpu_facts
from ansible_collections.meridian.node.plugins.module_utils.gpu.health_hold import HOLD_FILE, HealthHolds
from ansible_collections.meridian.node.tests.support.fake_nvml import two_healthy_gpus
from ansible_collections.meridian.node.tests.support.instant_apply import instant_success
from ansible_collections.meridian.node.tests.support.path_unit import write_split_config
from ansible_collections.meridian.node.tests.support.trust_fixtures import (
    NODE_ID,
    current_state,
    make_key,
    signed,
    write_policy,
)
from meridian_node_agent.apply.applier import ApplyResult
from meridian_node_agent.boundary.spool import MAX_GPU_REPORTS, ApplyRequest, GpuReport
from meridian_node_agent.config import AgentConfig, load_config
from meridian_node_agent.root_side import apply_unit
from meridian_node_agent.root_side.gpu_reports import (
    MAX_HELD_REASONS,
    RELAY_SOURCE,
    record_gpu_reports,
    relay_gpu_reports,
)
from meridian_node_agent.root_side.observe_unit import sync_gpu_holds
from meridian_node_agent.root_side.root_dir import RootDir, prepare_root_dir

NOW = datetime(2026, 12, 5, 8, 0, tzinfo=UTC)
GPU0 = "GPU-a1b2c300-51d0-4e7a-9c3f-6b0e2d4f1a00"
GPU1 = "GPU-a1b2c301-51d0-4e7a-9c3f-6b0e2d4f1a01"
FORGED = "GPU-00000000-0000-4000-8000-000000000000"
FAILED_ROWS = {"remapped_rows": {"correctable": 0, "uncorrectable": 3, "pending": False, "failure": True}}
CONTROL = make_key()


def report(uuid: str = GPU1, *xids: int, seen_at: datetime = NOW - timedelta(minutes=2)) -> GpuReport:
    return GpuReport(uuid=uuid, xids=list(xids or (79,)), seen_at=seen_at)


def read(fake: ModuleType, holds: HealthHolds | None = None) -> dict[str, Any]:
    held = holds.all() if holds is not None else {}
    return collect_gpu_facts(
        fake, processes=False, nvlink=False, previous={u: v.health for u, v in held.items()}, now=NOW
    )


def reasons(holds: HealthHolds, uuid: str = GPU1) -> list[tuple[str, str, Any]]:
    held = holds.held(uuid)
    assert held is not None, f"{uuid} is not held"
    return [(r["code"], r["source"], r["value"]) for r in held["reasons"]]


def snapshot(path: Path) -> tuple[bytes, int]:
    return path.read_bytes(), path.stat().st_mtime_ns


# --- recording -------------------------------------------------------------------------------------------------


def test_a_reported_gpu_is_held_and_placement_refuses_it(fake: ModuleType, tmp_path: Path) -> None:
    holds = HealthHolds(tmp_path)

    done = record_gpu_reports(holds, [report(GPU1, 79)], gpu_facts=read(fake), now=NOW)

    assert done.problem is None and done.ignored == []
    assert done.held == [f"held GPU 1 {GPU1} for XID 79 the agent reported"]
    [held] = holds.all().values()
    assert (held.uuid, held.index, held.pci_bus_id) == (GPU1, 1, "00000000:43:00.0")
    assert held.health["since"] == "2026-12-05T07:58:00Z"  # when the agent saw it, not when root heard of it
    assert reasons(holds) == [("xid-critical", RELAY_SOURCE, 79)]
    # As the reconcile playbook's placement reads it, in a fresh process whose own read sees nothing wrong:
    placed = with_held_verdicts(read(fake), holds)
    assert [gpu["health"]["verdict"] for gpu in placed["gpus"]] == ["healthy", "unhealthy"]


def test_recording_the_same_report_again_changes_nothing(fake: ModuleType, tmp_path: Path) -> None:
    holds = HealthHolds(tmp_path)
    record_gpu_reports(holds, [report(GPU1, 79)], gpu_facts=read(fake), now=NOW)
    before = snapshot(tmp_path / HOLD_FILE)

    again = record_gpu_reports(
        holds, [report(GPU1, 79, seen_at=NOW)], gpu_facts=read(fake, holds), now=NOW + timedelta(minutes=1)
    )

    assert again.held == [] and again.problem is None
    assert snapshot(tmp_path / HOLD_FILE) == before


def test_a_report_never_clears_or_weakens_a_hold_root_already_keeps(fake: ModuleType, tmp_path: Path) -> None:
    fake.use_scenario(two_healthy_gpus(**FAILED_ROWS))
    holds = HealthHolds(tmp_path)
    faulty = read(fake)
    holds.hold(GPU1, faulty["gpus"][1]["health"], gpu=faulty["gpus"][1])
    first = holds.all()[GPU1]

    # An application XID and a warning XID only: nothing to add, and nothing taken away.
    ignored = record_gpu_reports(holds, [report(GPU1, 13, 63)], gpu_facts=read(fake, holds), now=NOW)
    assert ignored.held == [] and ignored.ignored == [f"{GPU1} (XID 13, 63: none is critical)"]
    assert holds.all()[GPU1] == first

    added = record_gpu_reports(holds, [report(GPU1, 79)], gpu_facts=read(fake, holds), now=NOW)

    after = holds.all()[GPU1]
    assert added.held and (after.held_at, after.health["since"]) == (first.held_at, first.health["since"])
    assert after.health["readings"] == first.health["readings"]  # the counters a reset is judged against stay
    assert reasons(holds) == [
        *[(r["code"], r["source"], r["value"]) for r in first.health["reasons"]],
        ("xid-critical", RELAY_SOURCE, 79),
    ]


def test_an_xid_root_holds_from_any_source_is_not_held_twice(fake: ModuleType, tmp_path: Path) -> None:
    holds = HealthHolds(tmp_path)
    health = {
        "verdict": "unhealthy",
        "reasons": [{"code": "xid-critical", "source": "nvmlEventSetWait", "value": 79}],
        "since": "2026-12-05T07:00:00Z",
        "held": True,
        "readings": {},
    }
    holds.hold(GPU1, health)
    before = snapshot(tmp_path / HOLD_FILE)

    assert record_gpu_reports(holds, [report(GPU1, 79)], gpu_facts=read(fake), now=NOW).held == []
    assert snapshot(tmp_path / HOLD_FILE) == before


def test_a_uuid_this_hosts_nvml_does_not_list_is_ignored(fake: ModuleType, tmp_path: Path) -> None:
    holds = HealthHolds(tmp_path)

    done = record_gpu_reports(holds, [report(FORGED, 79), report(GPU0, 79)], gpu_facts=read(fake), now=NOW)

    assert done.ignored == [f"{FORGED} (not a GPU of this host)"]
    assert set(holds.all()) == {GPU0}


def test_a_forged_uuid_alone_leaves_no_file_at_all(fake: ModuleType, tmp_path: Path) -> None:
    record_gpu_reports(HealthHolds(tmp_path), [report(FORGED, 79)], gpu_facts=read(fake), now=NOW)

    assert not (tmp_path / HOLD_FILE).exists()


def test_reports_of_one_gpu_are_merged_and_a_time_ahead_of_roots_counts_from_now(
    fake: ModuleType, tmp_path: Path
) -> None:
    holds = HealthHolds(tmp_path)
    ahead = NOW + timedelta(days=365)

    record_gpu_reports(
        holds, [report(GPU1, 79, seen_at=ahead), report(GPU1, 119, 79, seen_at=ahead)], gpu_facts=read(fake), now=NOW
    )

    assert [value for _code, _source, value in reasons(holds)] == [79, 119]
    assert holds.all()[GPU1].health["since"] == "2026-12-05T08:00:00Z"


def test_without_nvml_reports_are_held_but_the_file_stays_bounded(tmp_path: Path) -> None:
    holds = HealthHolds(tmp_path)
    many = [report(f"GPU-a1b2c3{n:02x}-51d0-4e7a-9c3f-6b0e2d4f1a01", 79) for n in range(MAX_GPU_REPORTS)]
    assert len(record_gpu_reports(holds, many, gpu_facts=None, now=NOW).held) == MAX_GPU_REPORTS

    more = record_gpu_reports(holds, [report(FORGED, 79), report(many[0].uuid, 119)], gpu_facts=None, now=NOW)

    assert FORGED not in holds.all() and len(holds.all()) == MAX_GPU_REPORTS
    assert more.held == [f"held GPU {many[0].uuid} for XID 119 the agent reported"]  # a held GPU still gains


def test_request_after_request_a_hold_gains_no_xid_past_its_cap(fake: ModuleType, tmp_path: Path) -> None:
    holds = HealthHolds(tmp_path)
    critical = [xid for xid in range(200, 400)][: MAX_HELD_REASONS + 16]

    for start in range(0, len(critical), 16):
        record_gpu_reports(holds, [report(GPU1, *critical[start : start + 16])], gpu_facts=read(fake, holds), now=NOW)

    assert [value for _code, _source, value in reasons(holds)] == critical[:MAX_HELD_REASONS]


def test_a_damaged_hold_file_is_a_problem_said_and_never_overwritten(fake: ModuleType, tmp_path: Path) -> None:
    (tmp_path / HOLD_FILE).write_text("{not json")

    done = relay_gpu_reports(tmp_path, [report(GPU1, 79)], now=NOW, nvml=fake)

    assert done.problem is not None and HOLD_FILE in done.problem and "not JSON" in done.problem
    assert (tmp_path / HOLD_FILE).read_text() == "{not json"


def test_no_report_reads_nothing(tmp_path: Path) -> None:
    class NoNvml:
        def __getattr__(self, name: str) -> Any:
            raise AssertionError(f"NVML was asked for {name} with nothing reported")

    assert relay_gpu_reports(tmp_path, [], now=NOW, nvml=NoNvml()).lines() == []


# --- what root's timer does with a relayed hold afterwards ------------------------------------------------------


def test_roots_timer_keeps_a_relayed_hold_and_releases_it_at_a_reset_it_reads(fake: ModuleType, tmp_path: Path) -> None:
    root = prepare_root_dir(tmp_path / "apply", agent_dir=_agent_dir(tmp_path))
    fake.use_scenario(two_healthy_gpus(pcie_replay_counter=40))
    relay_gpu_reports(root.path, [report(GPU1, 79)], now=NOW, nvml=fake)
    holds = HealthHolds(root.path)

    fake.use_scenario(two_healthy_gpus(pcie_replay_counter=41))  # a fresh read: nothing wrong, nothing reset
    kept, _ = sync_gpu_holds(root, clock=lambda: NOW + timedelta(seconds=30), nvml=fake)
    assert reasons(holds) == [("xid-critical", RELAY_SOURCE, 79)], kept

    fake.use_scenario(two_healthy_gpus(pcie_replay_counter=0))  # the driver zeroed it: the GPU was reset
    released, _ = sync_gpu_holds(root, clock=lambda: NOW + timedelta(seconds=60), nvml=fake)

    assert holds.all() == {} and f"released GPU 1 {GPU1}" in released


# --- the apply unit: after the envelope verified, before the playbook -------------------------------------------


class RecordingApplier:
    """Stands in for ``apply.applier.Applier``: what the hold file held when root was about to run the playbook."""

    seen: list[dict[str, Any]] = []

    def __init__(self, *, state_dir: Path, **_options: Any) -> None:
        self.state_dir = Path(state_dir)

    def apply(self, envelope: bytes, *, generation: int, ident: str, **_options: Any) -> ApplyResult:
        RecordingApplier.seen.append({u: v.health for u, v in HealthHolds(self.state_dir).all().items()})
        return instant_success(generation, ident=ident, journal=self.state_dir / "journal" / ident)


@pytest.fixture
def applier(monkeypatch: pytest.MonkeyPatch) -> type[RecordingApplier]:
    RecordingApplier.seen = []
    monkeypatch.setattr(apply_unit, "Applier", RecordingApplier)
    return RecordingApplier


def _agent_dir(tmp_path: Path) -> Path:
    agent = tmp_path / "agent"
    agent.mkdir(mode=0o750, exist_ok=True)
    return agent


def _split_node(tmp_path: Path, *, mode: str = "managed-host") -> tuple[AgentConfig, RootDir]:
    policy = write_policy(tmp_path / "etc", control=[CONTROL], extra={"store": {"path": str(tmp_path / "store")}})
    path = write_split_config(
        tmp_path / "config.yaml",
        node_id=NODE_ID,
        policy=policy,
        state_dir=_agent_dir(tmp_path),
        apply={"via": "systemd", "timeout_seconds": 60, "state_dir": str(tmp_path / "apply")},
    )
    if mode != "managed-host":
        path.write_text(path.read_text().replace("mode: managed-host", f"mode: {mode}"))
    config = load_config(path)
    return config, prepare_root_dir(Path(config.apply.state_dir), agent_dir=Path(config.state_dir))


def _request(envelope: bytes, reports: list[GpuReport], generation: int = 1) -> ApplyRequest:
    return ApplyRequest(
        request=f"gen-{generation}-20261205T080000.000000Z",
        envelope=base64.b64encode(envelope).decode("ascii"),
        gpu_reports=reports,
    )


def test_root_holds_the_reported_gpu_before_the_playbook_places_anything(
    fake: ModuleType, tmp_path: Path, applier: type[RecordingApplier], capsys: pytest.CaptureFixture[str]
) -> None:
    config, root = _split_node(tmp_path)
    envelope = signed("desired-state", current_state(1), [CONTROL])

    answer = apply_unit.answer_one(
        config, root, _request(envelope, [report(GPU1, 79)]), clock=lambda: datetime.now(UTC), nvml=fake
    )

    assert answer.status == "successful", answer.failures
    [seen] = applier.seen
    assert list(seen) == [GPU1] and seen[GPU1]["reasons"][0]["value"] == 79
    assert f"GPU health: held GPU 1 {GPU1} for XID 79 the agent reported" in capsys.readouterr().out


@pytest.mark.parametrize("refusal", ["tampered", "observe-only"])
def test_a_request_root_refuses_holds_nothing(
    fake: ModuleType, tmp_path: Path, applier: type[RecordingApplier], refusal: str
) -> None:
    config, root = _split_node(tmp_path, mode="observe-only" if refusal == "observe-only" else "managed-host")
    envelope = signed("desired-state", current_state(1), [CONTROL])
    if refusal == "tampered":  # one byte of the signed body changed: the generation 1 becomes 7
        document = json.loads(envelope)
        body = base64.b64decode(document["payload"]).replace(b'"generation": 1', b'"generation": 7', 1)
        envelope = json.dumps({**document, "payload": base64.b64encode(body).decode("ascii")}).encode("utf-8")

    answer = apply_unit.answer_one(
        config, root, _request(envelope, [report(GPU1, 79)]), clock=lambda: datetime.now(UTC), nvml=fake
    )

    assert answer.status == "failed" and "refused" in answer.failures[0]
    assert applier.seen == [] and not (root.path / HOLD_FILE).exists()


def test_a_request_without_reports_reads_no_gpu_and_applies_as_before(
    tmp_path: Path, applier: type[RecordingApplier]
) -> None:
    config, root = _split_node(tmp_path)
    envelope = signed("desired-state", current_state(1), [CONTROL])

    answer = apply_unit.answer_one(config, root, _request(envelope, []), clock=lambda: datetime.now(UTC))

    assert answer.status == "successful" and applier.seen == [{}]
    assert not (root.path / HOLD_FILE).exists()
