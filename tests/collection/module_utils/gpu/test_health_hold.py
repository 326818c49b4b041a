"""Held GPU health verdicts on disk: held, released by a reset, cleared by name, and a damaged file refused."""

from __future__ import annotations

import json
import os
import stat
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from ansible_collections.meridian.node.plugins.module_utils.gpu.health_hold import (
    HOLD_FILE,
    HealthHoldError,
    HealthHolds,
)
from ansible_collections.meridian.node.plugins.module_utils.gpu.health_rules import judge
from ansible_collections.meridian.node.tests.support.gpu_ids import GPU_A as A
from ansible_collections.meridian.node.tests.support.gpu_ids import GPU_B as B
from ansible_collections.meridian.node.tests.support.gpu_ids import MIG_A as MIG
from ansible_collections.meridian.node.tests.support.gpu_ids import NOW


def gpu(index: int, uuid: str, **changes: Any) -> dict[str, Any]:
    return {
        "index": index,
        "uuid": uuid,
        "pci_bus_id": f"00000000:{0x18 + index:02X}:00.0",
        "ecc_errors_uncorrected": 0,
        "utilization_gpu_percent": 50,
        "pcie": {"generation": 4, "width": 16, "max_generation": 4, "max_width": 16},
        "mig_instances": [],
        "error": None,
        **changes,
    }


FACTS = {"nvml_available": True, "gpus": [gpu(0, A), gpu(1, B, mig_instances=[{"uuid": MIG, "memory_mib": 9856}])]}


def readings(**changes: Any) -> dict[str, Any]:
    return {"recovery_action": "none", "pcie_replay_count": 0, "xid_events": [], "read_errors": [], **changes}


def xid(number: int, at: datetime) -> dict[str, Any]:
    return {"xid": number, "at": at.isoformat().replace("+00:00", "Z"), "mig_uuid": None}


def unhealthy(at: datetime = NOW, number: int = 79) -> dict[str, Any]:
    health = judge(readings(xid_events=[xid(number, at)]), gpu=gpu(0, A), previous={}, now=at)
    assert health["verdict"] == "unhealthy"
    return health


@pytest.fixture
def holds(tmp_path: Path) -> HealthHolds:
    return HealthHolds(tmp_path / "state")


def test_an_unhealthy_verdict_is_held_world_readable(holds: HealthHolds) -> None:
    health = unhealthy()

    assert holds.hold(A, health, gpu=gpu(0, A)) is True

    assert holds.held(A) == health
    assert holds.held(B) is None
    mode = stat.S_IMODE(os.stat(holds.path).st_mode)
    assert mode == 0o644
    entry = json.loads(Path(holds.path).read_text())["gpus"][A]
    assert (entry["index"], entry["pci_bus_id"]) == (0, "00000000:18:00.0")


def test_holding_the_same_verdict_again_does_not_rewrite_the_file(holds: HealthHolds) -> None:
    first = unhealthy()
    holds.hold(A, first, gpu=gpu(0, A))
    inode = os.stat(holds.path).st_ino
    # Counters moved, the verdict did not.
    again = {**first, "readings": {**first["readings"], "pcie_replay_count": 7}}

    assert holds.hold(A, again) is False
    assert os.stat(holds.path).st_ino == inode


def test_new_reasons_rewrite_the_hold_and_keep_when_it_was_first_held(holds: HealthHolds) -> None:
    holds.hold(A, unhealthy(), gpu=gpu(0, A))
    held_at = holds.all()[A].held_at
    worse = unhealthy(number=48)

    assert holds.hold(A, worse) is True

    found = holds.all()[A]
    assert found.health == worse
    assert (found.held_at, found.index) == (held_at, 0)


def test_only_unhealthy_verdicts_are_held(holds: HealthHolds) -> None:
    healthy = judge(readings(), gpu=gpu(0, A), now=NOW)
    with pytest.raises(RuntimeError, match="only an unhealthy verdict"):
        holds.hold(A, healthy)
    assert not os.path.exists(holds.path)


def test_sync_holds_unhealthy_and_releases_on_a_verdict_judge_released(holds: HealthHolds) -> None:
    healthy = judge(readings(), gpu=gpu(0, A), now=NOW)
    assert holds.sync(A, healthy) is False
    assert not os.path.exists(holds.path)  # nothing held, nothing written

    assert holds.sync(A, unhealthy(), gpu=gpu(0, A)) is True
    assert holds.sync(B, unhealthy(), gpu=gpu(1, B)) is True
    assert holds.sync(A, healthy) is True

    assert sorted(holds.all()) == [B]


@pytest.mark.parametrize(
    ("which", "facts"),
    [
        (A, FACTS),
        ("0", FACTS),
        (0, FACTS),
        ("00000000:18:00.0", FACTS),
        (A, None),  # no facts: the holds alone
        ("0", None),
    ],
    ids=["uuid", "index", "index as a number", "PCI bus id", "uuid, no facts", "index, no facts"],
)
def test_clear_by_name(holds: HealthHolds, which: str | int, facts: dict[str, Any] | None) -> None:
    holds.hold(A, unhealthy(), gpu=gpu(0, A))
    holds.hold(B, unhealthy(), gpu=gpu(1, B))

    cleared = holds.clear(which, gpu_facts=facts)

    assert [verdict.uuid for verdict in cleared] == [A]
    assert sorted(holds.all()) == [B]
    if facts is not None:
        assert holds.clear(which, gpu_facts=facts) == []  # known, no longer held
    else:
        # Without the host's GPUs only the holds name GPUs: one no longer held is not known to be there.
        with pytest.raises(HealthHoldError, match="GPUs: not read"):
            holds.clear(which)


def test_clear_follows_the_gpu_where_it_is_now(holds: HealthHolds) -> None:
    holds.hold(A, unhealthy(), gpu=gpu(0, A))
    # After a reboot A is GPU 1: "1" names it, "0" names the other GPU, which is not held.
    moved = {"nvml_available": True, "gpus": [gpu(0, B), gpu(1, A)]}

    assert holds.clear("0", gpu_facts=moved) == []
    assert [verdict.uuid for verdict in holds.clear("1", gpu_facts=moved)] == [A]


def test_clearing_an_unknown_gpu_says_which_gpus_there_are(holds: HealthHolds) -> None:
    holds.hold(A, unhealthy(), gpu=gpu(0, A))

    with pytest.raises(HealthHoldError) as caught:
        holds.clear("GPU-nope", gpu_facts=FACTS)

    message = str(caught.value)
    assert "no GPU 'GPU-nope'" in message
    assert f"0={A}" in message and f"1={B}" in message
    assert "uuid, index or PCI bus id" in message
    assert f"GPU 0 {A} (held since 2026-12-03T12:00:00Z: xid-critical)" in message
    assert A in holds.all()


def test_clearing_a_mig_device_names_its_gpu(holds: HealthHolds) -> None:
    with pytest.raises(HealthHoldError, match=f"MIG device; verdicts are held per GPU: clear its GPU, 1={B}"):
        holds.clear(MIG, gpu_facts=FACTS)


@pytest.mark.parametrize(
    ("content", "words"),
    [
        ("{not json", "is not JSON"),
        ('{"format": 2, "gpus": {}}', '"format": 1'),
        ('{"format": 1, "gpus": []}', '"gpus" must be an object'),
        (json.dumps({"format": 1, "gpus": {A: {"uuid": B}}}), f"whose uuid is {A!r}"),
        (
            json.dumps({"format": 1, "gpus": {A: {"uuid": A, "held_at": "x", "health": {"verdict": "healthy"}}}}),
            "must hold an unhealthy verdict",
        ),
        (
            json.dumps(
                {"format": 1, "gpus": {A: {"uuid": A, "health": {"verdict": "unhealthy", "reasons": []}}}},
            ),
            "held_at",
        ),
    ],
    ids=["not json", "other format", "gpus a list", "uuid mismatch", "healthy held", "no held_at"],
)
def test_a_damaged_file_is_an_error_naming_it_and_the_fix(holds: HealthHolds, content: str, words: str) -> None:
    os.makedirs(holds.state_dir)
    Path(holds.path).write_text(content)

    for read in (holds.all, lambda: holds.held(A), lambda: holds.clear(A), lambda: holds.sync(A, unhealthy())):
        with pytest.raises(HealthHoldError) as caught:
            read()
        assert holds.path in str(caught.value)
        assert words in str(caught.value)
        assert "remove it" in str(caught.value)
    assert Path(holds.path).read_text() == content  # never reset


def test_a_symlink_in_its_place_is_refused(holds: HealthHolds, tmp_path: Path) -> None:
    os.makedirs(holds.state_dir)
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text(json.dumps({"format": 1, "gpus": {}}))
    os.symlink(elsewhere, holds.path)

    with pytest.raises(HealthHoldError, match="symlink"):
        holds.held(A)


# --- what judge is handed ----------------------------------------------------------------------------------


def test_previous_for_each_case(holds: HealthHolds) -> None:
    held = unhealthy()
    fresher = unhealthy(NOW + timedelta(minutes=5))
    healthy = judge(readings(), gpu=gpu(0, A), now=NOW)
    holds.hold(A, held)

    assert holds.previous_for(A, None) == held  # a fresh process: the hold is the previous
    assert holds.previous_for(A, healthy) == held
    assert holds.previous_for(A, fresher) is fresher  # same hold, fresher readings
    assert holds.previous_for(B, None) is None
    assert holds.previous_for(B, healthy) is healthy
    cleared = holds.previous_for(B, {**held, "readings": {**held["readings"], "pcie_replay_count": 9}})
    assert cleared is not None
    assert (cleared["verdict"], cleared["reasons"], cleared["readings"]["xid_events"]) == ("healthy", [], [])
    assert cleared["readings"]["pcie_replay_count"] == 9


def test_a_hold_outlives_the_process_until_an_operator_clears_it(holds: HealthHolds) -> None:
    # The agent's read sees XID 79 and holds the verdict.
    first = unhealthy()
    holds.sync(A, first, gpu=gpu(0, A))

    # An hour later a fresh process (an engine module's placement) reads a GPU that looks fine.
    later = NOW + timedelta(hours=1)
    fresh = judge(readings(), gpu=gpu(0, A), previous=holds.previous_for(A, None), now=later)
    assert (fresh["verdict"], fresh["held"], fresh["since"]) == ("unhealthy", True, first["since"])
    holds.sync(A, fresh)

    # The operator clears GPU 0 by its index; the next read judges only what NVML shows now.
    assert [verdict.uuid for verdict in holds.clear("0", gpu_facts=FACTS)] == [A]
    after = judge(readings(), gpu=gpu(0, A), previous=holds.previous_for(A, fresh), now=later + timedelta(minutes=1))
    assert (after["verdict"], after["held"]) == ("healthy", False)
    assert holds.sync(A, after) is False
    assert holds.all() == {}


def test_the_file_is_named_for_its_job(holds: HealthHolds) -> None:
    assert os.path.basename(holds.path) == HOLD_FILE == "gpu-health-holds.json"


# --- add_reasons: holds only ever added to (root, for the XIDs the agent relays) --------------------------------

RELAYED = {"code": "xid-critical", "source": "nvmlEventSetWait, relayed by the agent", "value": 79}


def test_add_reasons_holds_a_gpu_not_held_with_the_counters_a_reset_is_judged_by(holds: HealthHolds) -> None:
    counters = readings(pcie_replay_count=40)

    assert holds.add_reasons(A, [RELAYED], since="2026-12-03T11:58:00Z", readings=counters, gpu=gpu(0, A)) is True

    held = holds.held(A)
    assert held is not None and (held["verdict"], held["held"], held["since"]) == (
        "unhealthy",
        True,
        "2026-12-03T11:58:00Z",
    )
    assert held["reasons"] == [RELAYED]
    # A fresh read whose replay counter went down: NVML shows a reset, which releases what was added.
    after = judge(readings(pcie_replay_count=0), gpu=gpu(0, A), previous=held, now=NOW)
    assert (after["verdict"], after["held"]) == ("healthy", False)


def test_add_reasons_keeps_everything_held_and_adds_only_what_is_new(holds: HealthHolds) -> None:
    first = unhealthy()  # XID 79 from the agent's own read: the same XID whatever the source
    holds.hold(A, first, gpu=gpu(0, A))
    before = holds.all()[A]

    assert holds.add_reasons(A, [RELAYED], since="2030-01-01T00:00:00Z") is False
    worse = {**RELAYED, "value": 48}
    assert holds.add_reasons(A, [worse], since="2030-01-01T00:00:00Z") is True

    after = holds.all()[A]
    assert after.health["reasons"] == [*first["reasons"], worse]
    assert (after.health["since"], after.health["readings"], after.held_at) == (
        first["since"],
        first["readings"],
        before.held_at,
    )


def test_add_reasons_stays_within_its_bounds(holds: HealthHolds) -> None:
    holds.add_reasons(A, [{**RELAYED, "value": 48}], since="2026-12-03T11:58:00Z")

    assert holds.add_reasons(B, [RELAYED], since="2026-12-03T11:58:00Z", max_held=1) is False  # a new GPU: full
    assert (
        holds.add_reasons(
            A, [RELAYED, {**RELAYED, "value": 74}], since="2026-12-03T11:58:00Z", max_held=1, max_reasons=2
        )
        is True
    )
    assert [r["value"] for r in holds.all()[A].health["reasons"]] == [48, 79]  # one more fitted, not two
    assert set(holds.all()) == {A}


@pytest.mark.parametrize("code", ["xid-warning", "xid-critical-mig", "clock-event", "no-such-code"])
def test_add_reasons_refuses_a_reason_that_would_not_make_a_gpu_unhealthy(holds: HealthHolds, code: str) -> None:
    with pytest.raises(RuntimeError, match=code):
        holds.add_reasons(A, [{**RELAYED, "code": code}], since="2026-12-03T11:58:00Z")
    assert holds.all() == {}
