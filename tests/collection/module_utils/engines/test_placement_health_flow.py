"""Placement by GPU health through engine_instance's and engine_set's own converge, on the real Docker Engine.

This host has no GPU and no NVIDIA runtime, so the GPU facts are given (verdicts made by the real rules) and
the Docker Engine is the real one said to have the runtime: every check runs for real up to the plan, in
check mode, which is where a refusal must stop a run and where the warnings must already show (the real run
reports the same result, with ``done`` filled in).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from datetime import datetime
from typing import Any

import pytest

from ansible_collections.meridian.node.plugins.module_utils._compat import UTC
from ansible_collections.meridian.node.plugins.module_utils.docker.engine import DockerEngine
from ansible_collections.meridian.node.plugins.module_utils.engines.converge.engine_run import Options
from ansible_collections.meridian.node.plugins.module_utils.engines.instance import converge
from ansible_collections.meridian.node.plugins.module_utils.engines.set import EngineSetError, SetOptions, converge_set
from ansible_collections.meridian.node.plugins.module_utils.engines.spec import EngineInstanceError
from ansible_collections.meridian.node.plugins.module_utils.gpu.health_rules import judge
from ansible_collections.meridian.node.tests.support.engine_harness import Host, free_ports
from ansible_collections.meridian.node.tests.support.standin_image import LocalImage

pytestmark = [pytest.mark.docker]

NOW = datetime(2026, 12, 3, 12, 0, 0, tzinfo=UTC)
CLEAN = {"recovery_action": "none", "retirement_pending": False, "xid_events": [], "read_errors": []}


class RuntimeDocker(DockerEngine):
    """The real engine, said to have the NVIDIA runtime so that placement gets past its last check."""

    def has_nvidia_runtime(self) -> bool:
        return True


def gpu(index: int, *, cordoned: bool = False, dbe: int = 0, **changes: Any) -> dict[str, Any]:
    facts: dict[str, Any] = {
        "index": index,
        "uuid": f"GPU-{index:08d}-0000-4000-8000-000000000000",
        "memory": {"total_mib": 81559, "used_mib": 0, "free_mib": 81559},
        "ecc_errors_uncorrected": dbe,
        "utilization_gpu_percent": 10,
        "pcie": {"generation": 5, "width": 16, "max_generation": 5, "max_width": 16},
        "mig_mode": False,
        "mig_instances": [],
        "error": None,
        "cordoned": cordoned,
    }
    facts["health"] = judge({**CLEAN, **changes}, gpu=facts, now=NOW)
    return facts


# GPU 0 healthy, 1 degraded (a page retirement pending), 2 unhealthy (a double-bit ECC error), 3 cordoned.
FACTS = {
    "nvml_available": True,
    "reason": None,
    "count": 4,
    "gpus": [gpu(0), gpu(1, retirement_pending=True), gpu(2, dbe=1), gpu(3, cordoned=True)],
}


@pytest.fixture
def engine() -> Iterator[DockerEngine]:
    docker = RuntimeDocker.from_env()
    yield docker
    docker.close()


def instance(host: Host, vllm: LocalImage, engine: DockerEngine, params: Mapping[str, Any]) -> dict[str, Any]:
    options = Options(policy_path=str(host.policy), state_dir=str(host.state_dir), store_path=str(host.store))
    return converge(params, options, check_mode=True, engine=engine, gpu_facts=lambda: FACTS)


def spec(vllm: LocalImage, name: str, port: int, gpus: list[str], **extra: Any) -> dict[str, Any]:
    return {
        "name": name,
        "driver": "vllm",
        "image": vllm.pinned,
        "model": {"name": "tiny"},
        "port": port,
        "gpus": gpus,
        **extra,
    }


def test_engine_instance_on_a_degraded_gpu_plans_with_a_warning(
    host: Host, vllm: LocalImage, engine: DockerEngine, prefix: str
) -> None:
    result = instance(host, vllm, engine, host.params(**spec(vllm, f"{prefix}-deg", free_ports(1)[0], ["1"])))

    assert result["actions"] == ["create", "start", "wait-ready"]
    [warning] = result["warnings"]
    assert "goes on GPU '1'" in warning and "degraded: retirement-pending" in warning
    assert result["placement_warnings"] == [warning]
    assert result["diff"]["after"]["placement_warnings"] == [warning]
    assert host.container(f"{prefix}-deg") is None


def test_engine_instance_on_an_unhealthy_gpu_is_refused_and_forced_with_a_warning(
    host: Host, vllm: LocalImage, engine: DockerEngine, prefix: str
) -> None:
    params = host.params(**spec(vllm, f"{prefix}-bad", free_ports(1)[0], ["2"]))

    with pytest.raises(EngineInstanceError) as caught:
        instance(host, vllm, engine, params)
    assert caught.value.check == "placement-health"
    assert "GPU '2'" in str(caught.value) and "ecc-volatile-dbe 1" in str(caught.value)

    forced = instance(host, vllm, engine, {**params, "force": True})
    assert forced["actions"] == ["create", "start", "wait-ready"]
    assert "only because it says force: true" in forced["warnings"][0]
    # force is how to place, not what the container is: the spec it plans (and the hash) do not carry it.
    assert "force" not in forced["diff"]["after"]["spec"]
    on_healthy = {**params, "gpus": ["0"]}
    assert (
        instance(host, vllm, engine, {**on_healthy, "force": True})["config_hash"]
        == instance(host, vllm, engine, on_healthy)["config_hash"]
    )


def test_engine_instance_on_a_cordoned_gpu_is_refused_even_with_force(
    host: Host, vllm: LocalImage, engine: DockerEngine, prefix: str
) -> None:
    params = host.params(**spec(vllm, f"{prefix}-cor", free_ports(1)[0], ["3"], force=True))

    with pytest.raises(EngineInstanceError) as caught:
        instance(host, vllm, engine, params)

    assert caught.value.check == "placement-cordoned"


def test_engine_set_says_every_placement_warning_and_refuses_before_any_change(
    host: Host, vllm: LocalImage, engine: DockerEngine, prefix: str
) -> None:
    ports = free_ports(3)
    options = SetOptions(policy_path=str(host.policy), state_dir=str(host.state_dir), store_path=str(host.store))
    good = [
        spec(vllm, f"{prefix}-a", ports[0], ["0"]),
        spec(vllm, f"{prefix}-b", ports[1], ["1"]),
        spec(vllm, f"{prefix}-c", ports[2], ["2"], force=True),
    ]

    result = converge_set(good, options, check_mode=True, engine=engine, gpu_facts=lambda: FACTS)

    assert result["changed"] is True
    warnings = result["warnings"]
    assert len(warnings) == 2
    assert f"engine '{prefix}-b' goes on GPU '1'" in warnings[0]
    assert f"engine '{prefix}-c' goes on GPU '2'" in warnings[1] and "force: true" in warnings[1]
    assert result["engines"][f"{prefix}-a"].get("placement_warnings") is None
    assert result["diff"]["after"][f"{prefix}-c"]["placement_warnings"] == [warnings[1]]

    unforced = [*good[:2], {**good[2], "force": False}]
    with pytest.raises(EngineSetError) as caught:
        converge_set(unforced, options, check_mode=False, engine=engine, gpu_facts=lambda: FACTS)
    assert caught.value.result["engines"][f"{prefix}-c"]["check"] == "placement-health"
    assert str(caught.value).startswith("nothing was changed")
    assert [host.container(s["name"]) for s in good] == [None, None, None]
