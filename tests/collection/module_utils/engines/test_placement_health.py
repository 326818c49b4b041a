"""Placement by GPU health and cordon, as data: one test per verdict, MIG instances, force, and held verdicts.

The GPU facts carry verdicts made by the real rules (``gpu.health_rules.judge``) from readings, as the facts
reader hands them over; placement is the pure ``placement_problem`` / ``placement_warnings`` pair that
``engines.instance`` and ``engines.set`` call.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from ansible_collections.meridian.node.plugins.module_utils.contracts import EngineSpec
from ansible_collections.meridian.node.plugins.module_utils.engines.placement import (
    PlacementFactsError,
    placement_problem,
    placement_warnings,
    read_gpu_facts,
    resolve_devices,
    with_held_verdicts,
)
from ansible_collections.meridian.node.plugins.module_utils.engines.spec import FieldError, parse_engine_spec
from ansible_collections.meridian.node.plugins.module_utils.gpu import facts as gpu_facts_module
from ansible_collections.meridian.node.plugins.module_utils.gpu.health_hold import HealthHolds
from ansible_collections.meridian.node.plugins.module_utils.gpu.health_rules import judge
from ansible_collections.meridian.node.tests.support.gpu_ids import GPU_A as GPU
from ansible_collections.meridian.node.tests.support.gpu_ids import MIG_A, MIG_B, NOW

DIGEST = "sha256:" + "ab" * 32


def stamp(at: datetime) -> str:
    return at.isoformat().replace("+00:00", "Z")


def readings(**changes: Any) -> dict[str, Any]:
    return {
        "retired_pages_sbe": 0,
        "retired_pages_dbe": 0,
        "retirement_pending": False,
        "remap_pending": False,
        "remap_failure": False,
        "recovery_action": "none",
        "pcie_replay_count": 0,
        "xid_events": [],
        "read_errors": [],
        **changes,
    }


def h100(*, health: Any = "judge", mig: Sequence[str] = (), cordoned: bool = False, **changes: Any) -> dict[str, Any]:
    """GPU 0 of a host, 80 GB with 70 GB free; its health judged from ``readings`` unless given."""
    gpu: dict[str, Any] = {
        "index": 0,
        "uuid": GPU,
        "pci_bus_id": "00000000:18:00.0",
        "memory": {"total_mib": 81559, "used_mib": 11559, "free_mib": 70000},
        "ecc_errors_uncorrected": 0,
        "utilization_gpu_percent": 40,
        "pcie": {"generation": 5, "width": 16, "max_generation": 5, "max_width": 16},
        "mig_mode": bool(mig),
        "mig_instances": [{"uuid": uuid, "memory_mib": 9856} for uuid in mig],
        "error": None,
        "cordoned": cordoned,
    }
    taken = changes.pop("readings", readings())
    gpu.update(changes)
    if health == "judge":
        gpu["health"] = judge(taken, gpu=gpu, now=NOW)
    elif health != "absent":
        gpu["health"] = health
    return gpu


def host(gpu: Mapping[str, Any]) -> dict[str, Any]:
    return {"nvml_available": True, "reason": None, "count": 1, "gpus": [dict(gpu)]}


HEALTHY = host(h100())
DEGRADED = host(h100(readings=readings(retirement_pending=True)))
UNHEALTHY = host(h100(ecc_errors_uncorrected=2))
UNKNOWN = host(h100(health=None))  # asked for, not read
NOT_JUDGED = host(h100(health="absent"))  # facts from before health existed
CORDONED = host(h100(cordoned=True))


def place(facts: Mapping[str, Any], *, gpus: Sequence[str] = ("0",), force: bool = False, vram: int = 0) -> Any:
    return placement_problem(name="chat", gpus=gpus, min_vram_mib=vram, gpu_facts=facts, others=[], force=force)


def warn(facts: Mapping[str, Any], *, gpus: Sequence[str] = ("0",), force: bool = False) -> list[str]:
    return placement_warnings(name="chat", gpus=gpus, gpu_facts=facts, force=force)


# --- one test per verdict ----------------------------------------------------------------------------------


def test_healthy_gpu_is_placed_without_a_word() -> None:
    assert HEALTHY["gpus"][0]["health"]["verdict"] == "healthy"
    assert place(HEALTHY) is None
    assert warn(HEALTHY) == []


def test_degraded_gpu_is_placed_with_a_warning_naming_it_and_why() -> None:
    assert place(DEGRADED) is None

    [warning] = warn(DEGRADED)
    assert f"engine 'chat' goes on GPU '0' ({GPU})" in warning
    assert "degraded: retirement-pending True (nvmlDeviceGetRetiredPagesPendingStatus)" in warning


def test_unhealthy_gpu_is_refused_naming_it_the_verdict_and_the_reasons() -> None:
    check, message = place(UNHEALTHY)

    assert check == "placement-health"
    assert f"engine 'chat' asks for GPU '0' ({GPU}), whose health is unhealthy" in message
    assert "ecc-volatile-dbe 2 (nvmlDeviceGetTotalEccErrors(UNCORRECTED, VOLATILE))" in message
    assert "force: true" in message


def test_unknown_health_is_refused_fail_closed() -> None:
    check, message = place(UNKNOWN)

    assert check == "placement-health"
    assert "whose health is unknown: health was not read" in message


def test_unknown_verdict_from_the_rules_is_refused_too() -> None:
    facts = host(h100(readings={}))  # read, but nothing came back

    check, message = place(facts)

    assert check == "placement-health"
    assert "unknown: health-not-read" in message


def test_unhealthy_gpu_with_force_is_placed_with_a_warning_that_says_force() -> None:
    assert place(UNHEALTHY, force=True) is None

    [warning] = warn(UNHEALTHY, force=True)
    assert f"engine 'chat' goes on GPU '0' ({GPU}) only because it says force: true" in warning
    assert "unhealthy: ecc-volatile-dbe 2" in warning


def test_unknown_gpu_with_force_is_placed_with_a_warning() -> None:
    assert place(UNKNOWN, force=True) is None
    assert "only because it says force: true; its health is unknown" in warn(UNKNOWN, force=True)[0]


@pytest.mark.parametrize("force", [False, True], ids=["without force", "with force"])
def test_cordoned_gpu_is_refused_even_with_force(force: bool) -> None:
    check, message = place(CORDONED, force=force)

    assert check == "placement-cordoned"
    assert f"GPU '0' ({GPU}), which is cordoned" in message
    assert "force does not override a cordon" in message


def test_a_cordon_is_checked_before_health() -> None:
    facts = host(h100(ecc_errors_uncorrected=2, cordoned=True))
    assert place(facts)[0] == "placement-cordoned"


def test_facts_never_judged_place_as_before() -> None:
    assert "health" not in NOT_JUDGED["gpus"][0]
    assert place(NOT_JUDGED) is None
    assert warn(NOT_JUDGED) == []


def test_force_does_not_make_room() -> None:
    check, _message = place(UNHEALTHY, force=True, vram=75000)
    assert check == "placement-vram"


def test_the_gpu_can_be_named_by_uuid_too() -> None:
    assert place(UNHEALTHY, gpus=[GPU])[0] == "placement-health"


def test_engines_without_gpus_never_read_health() -> None:
    assert place(UNHEALTHY, gpus=()) is None
    assert warn(UNHEALTHY, gpus=()) == []


def test_a_held_verdict_says_since_when() -> None:
    first = judge(
        readings(xid_events=[{"xid": 79, "at": stamp(NOW), "mig_uuid": None}]), gpu=h100(), previous={}, now=NOW
    )
    later = judge(readings(), gpu=h100(), previous=first, now=NOW + timedelta(hours=1))
    facts = host(h100(health=later))

    check, message = place(facts)

    assert check == "placement-health"
    assert "unhealthy, held since 2026-12-03T12:00:00Z: xid-critical 79 (nvmlEventSetWait)" in message


def test_a_long_list_of_reasons_is_cut_short() -> None:
    errors = [f"NVML_ERROR_UNKNOWN from nvmlCall{n}" for n in range(7)]
    facts = host(h100(readings=readings(read_errors=errors)))

    _check, message = place(facts)

    assert "nvmlCall3" in message and "nvmlCall4" not in message
    assert "and 3 more" in message


# --- MIG instances -----------------------------------------------------------------------------------------


def mig_host(*, parent: Mapping[str, Any] | None = None, xids: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
    gpu = h100(mig=(MIG_A, MIG_B), **(parent or {}), readings=readings(xid_events=list(xids)))
    return host(gpu)


def test_a_mig_instance_has_its_parents_verdict() -> None:
    facts = mig_host(parent={"ecc_errors_uncorrected": 1})

    for instance in (MIG_A, MIG_B):
        check, message = place(facts, gpus=[instance])
        assert check == "placement-health"
        assert f"MIG instance {instance!r} (on GPU {GPU}), whose health is unhealthy" in message


def test_a_critical_xid_on_one_mig_device_refuses_that_device_only() -> None:
    facts = mig_host(xids=[{"xid": 48, "at": stamp(NOW), "mig_uuid": MIG_A}])
    assert facts["gpus"][0]["health"]["verdict"] == "degraded"

    check, message = place(facts, gpus=[MIG_A])
    assert check == "placement-health"
    assert f"unhealthy: xid-critical-mig 48 (nvmlEventSetWait {MIG_A})" in message

    assert place(facts, gpus=[MIG_B]) is None
    assert warn(facts, gpus=[MIG_B]) == []


def test_a_warning_xid_on_one_mig_device_warns_for_that_device_only() -> None:
    facts = mig_host(xids=[{"xid": 94, "at": stamp(NOW), "mig_uuid": MIG_A}])

    assert place(facts, gpus=[MIG_A]) is None
    assert "degraded: xid-warning-mig 94" in warn(facts, gpus=[MIG_A])[0]
    assert warn(facts, gpus=[MIG_B]) == []


def test_a_mig_xid_and_a_gpu_wide_reason_both_count() -> None:
    facts = mig_host(
        parent={"pcie": {"generation": 5, "width": 8, "max_generation": 5, "max_width": 16}},
        xids=[{"xid": 94, "at": stamp(NOW), "mig_uuid": MIG_A}],
    )

    [for_b] = warn(facts, gpus=[MIG_B])
    assert "pcie-width-below-max" in for_b and "xid-warning-mig" not in for_b
    [for_a] = warn(facts, gpus=[MIG_A])
    assert "pcie-width-below-max" in for_a and "xid-warning-mig 94" in for_a


def test_a_cordoned_gpu_cordons_its_mig_instances() -> None:
    facts = host(h100(mig=(MIG_A,), cordoned=True))
    assert place(facts, gpus=[MIG_A])[0] == "placement-cordoned"


def test_devices_carry_what_placement_read() -> None:
    [device], missing = resolve_devices([MIG_A], mig_host(xids=[{"xid": 48, "at": stamp(NOW), "mig_uuid": MIG_A}]))

    assert missing == []
    assert device.parent == GPU
    assert device.health is not None and device.health.verdict == "unhealthy"
    [plain], _ = resolve_devices(["0"], NOT_JUDGED)
    assert plain.health is None and plain.cordoned is False


# --- the verdicts held on the host --------------------------------------------------------------------------


def test_facts_asked_for_health_without_it_are_unknown() -> None:
    judged = with_held_verdicts(NOT_JUDGED, None)

    assert judged["gpus"][0]["health"] is None
    assert place(judged)[0] == "placement-health"
    assert "health" not in NOT_JUDGED["gpus"][0]  # the caller's facts are left as they were


def test_a_held_verdict_refuses_a_gpu_that_reads_fine_now(tmp_path: Path) -> None:
    holds = HealthHolds(tmp_path)
    seen = judge(
        readings(xid_events=[{"xid": 79, "at": stamp(NOW), "mig_uuid": None}]), gpu=h100(), previous={}, now=NOW
    )
    holds.sync(GPU, seen, gpu=h100())
    fresh = copy.deepcopy(HEALTHY)  # an hour later, a fresh read shows nothing

    judged = with_held_verdicts(fresh, holds, now=lambda: NOW + timedelta(hours=1))

    health = judged["gpus"][0]["health"]
    assert (health["verdict"], health["held"]) == ("unhealthy", True)
    check, message = place(judged)
    assert check == "placement-health" and "held since 2026-12-03T12:00:00Z" in message

    holds.clear("0", gpu_facts=fresh)
    assert place(with_held_verdicts(fresh, holds)) is None


def test_read_gpu_facts_asks_for_health_with_the_held_verdicts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[dict[str, Any]] = []

    def collect(**options: Any) -> dict[str, Any]:
        calls.append(options)
        return copy.deepcopy(NOT_JUDGED)

    monkeypatch.setattr(gpu_facts_module, "collect_gpu_facts", collect)
    seen = judge(
        readings(xid_events=[{"xid": 79, "at": stamp(NOW), "mig_uuid": None}]), gpu=h100(), previous={}, now=NOW
    )
    HealthHolds(tmp_path).sync(GPU, seen, gpu=h100())

    assert read_gpu_facts()["gpus"][0]["health"] is None  # asked for, not read: unknown
    assert read_gpu_facts(str(tmp_path))["gpus"][0]["health"] is None
    assert calls == [
        {"processes": False, "nvlink": False, "previous": {}},
        {"processes": False, "nvlink": False, "previous": {GPU: seen}},
    ]
    (tmp_path / "gpu-health-holds.json").write_text("{broken")
    with pytest.raises(PlacementFactsError, match=r"gpu-health-holds\.json"):
        read_gpu_facts(str(tmp_path))


# --- force in the spec -------------------------------------------------------------------------------------


def spec(**changes: Any) -> dict[str, Any]:
    return {
        "name": "chat",
        "driver": "vllm",
        "image": f"registry.example/vllm@{DIGEST}",
        "model": {"name": "m"},
        "port": 8000,
        **changes,
    }


@pytest.mark.parametrize("force", [True, False])
def test_force_parses_as_the_contract_does(force: bool) -> None:
    assert parse_engine_spec(spec(force=force)).force is force
    assert EngineSpec.model_validate(spec(force=force)).force is force
    assert parse_engine_spec(spec()).force is False


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_force_must_be_a_boolean(value: Any) -> None:
    with pytest.raises(FieldError, match="force"):
        parse_engine_spec(spec(force=value))
