"""The metrics endpoint of a real agent (``metrics.listen`` in its config, wired by ``build_agent``), scraped over
HTTP on 127.0.0.1 and read with prometheus_client's own text parser, as Prometheus would read it.

The fault under test is the one issue 25 found: the "last success" time kept moving while every apply failed.
Here a real reconcile run fails (the policy file the playbook reads is damaged after the agent started), and the
last successful apply time must stay where the last success put it while the failure is counted by reason.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from types import ModuleType

import pytest
import requests
import yaml
from prometheus_client.parser import text_string_to_metric_families

from ansible_collections.meridian.node.plugins.module_utils.trust.policy import load_policy
from ansible_collections.meridian.node.tests.devserver.devserver_process import DevServer
from ansible_collections.meridian.node.tests.support.engine_harness import free_port
from ansible_collections.meridian.node.tests.support.fake_nvml import load_fake_pynvml
from ansible_collections.meridian.node.tests.support.node_env import Node, make_node, publish
from meridian_node_agent.agent_side.cycle import Agent
from meridian_node_agent.agent_side.gpu_health import GpuHealthWatch
from meridian_node_agent.agent_side.metrics import GPU_VERDICTS, Metrics
from meridian_node_agent.agent_side.observe import Observer, no_engines
from meridian_node_agent.agent_side.status_file import read_status
from meridian_node_agent.cli.agent import serve_metrics
from meridian_node_agent.errors import UsageError

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(port: int) -> tuple[set[str], Samples]:
    """The family names (as the parser names them) and every sample, by name and sorted labels."""
    body = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    families, samples = set(), {}
    for family in text_string_to_metric_families(body):
        families.add(family.name)
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return families, samples


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


@pytest.fixture
def node(server: DevServer, tmp_path: Path, node_id: str) -> Node:
    made = make_node(server, tmp_path / "node", node_id)
    made.configure(metrics={"listen": f"127.0.0.1:{free_port()}"})
    return made


def _port(node: Node) -> int:
    assert node.config.metrics is not None
    return int(node.config.metrics.listen.rpartition(":")[2])


def test_a_failed_apply_never_moves_the_last_successful_apply_time_and_is_counted_by_reason(
    server: DevServer, node: Node
) -> None:
    port = _port(node)
    first = publish(server, node.node_id)
    agent: Agent = node.agent()
    try:
        assert agent.run(max_cycles=1) == 0
        families, samples = scrape(port)
        assert {
            "meridian_node_build_info",
            "meridian_node_agent_info",
            "meridian_node_lease_expiry_timestamp_seconds",
            "meridian_node_certificate_expiry_timestamp_seconds",
            "meridian_node_desired_generation",
            "meridian_node_applied_generation",
            "meridian_node_last_successful_apply_timestamp_seconds",
            "meridian_node_apply_failures",
            "meridian_node_engine_ready",
            "meridian_node_gpu_health",
        } <= families
        now = datetime.now(UTC).timestamp()
        succeeded_at = value(samples, "meridian_node_last_successful_apply_timestamp_seconds")
        assert succeeded_at is not None and now - 600 < succeeded_at <= now
        assert value(samples, "meridian_node_applied_generation") == first
        assert value(samples, "meridian_node_desired_generation") == first
        assert value(samples, "meridian_node_applies_total", status="successful") == 1
        assert value(samples, "meridian_node_agent_info", node_id=node.node_id, mode="managed-host") == 1
        assert (value(samples, "meridian_node_lease_expiry_timestamp_seconds") or 0) > now
        assert (value(samples, "meridian_node_certificate_expiry_timestamp_seconds") or 0) > now
        assert value(samples, "meridian_node_apply_retry_failures") == 0

        # The playbook reads the policy file itself: damaged now, the next real reconcile run fails a task.
        (node.root / "policy.yaml").write_text("trust: [not, a, policy\n")
        second = publish(server, node.node_id)
        assert agent.run(max_cycles=1) == 1
        assert agent.last_run is not None and agent.last_run.status == "failed"

        _, samples = scrape(port)
        assert value(samples, "meridian_node_last_successful_apply_timestamp_seconds") == succeeded_at
        assert value(samples, "meridian_node_apply_failures_total", reason="task-failed") == 1
        assert value(samples, "meridian_node_applies_total", status="failed") == 1
        assert value(samples, "meridian_node_desired_generation") == second
        assert value(samples, "meridian_node_applied_generation") == first
        assert value(samples, "meridian_node_apply_retry_failures") == 1
        assert (value(samples, "meridian_node_last_cycle_timestamp_seconds") or 0) >= succeeded_at
    finally:
        agent.close()


def test_a_metrics_port_already_taken_is_a_usage_error_naming_it() -> None:
    port = free_port()
    taken = Metrics.serve(f"127.0.0.1:{port}")
    try:
        with pytest.raises(UsageError, match=rf"metrics.listen is '127.0.0.1:{port}' but the agent cannot listen"):
            serve_metrics(f"127.0.0.1:{port}")
    finally:
        taken.close()


@pytest.fixture
def fake_nvml() -> Iterator[ModuleType]:
    """The fake pynvml (the one seam faked): two H100s, GPU 1 with two volatile double-bit errors."""
    module = load_fake_pynvml()
    module.use_scenario(json.loads((module.SCENARIO_DIR / "volatile-dbe.json").read_text()))
    yield module
    module.use_scenario(None)


def test_each_gpus_verdict_and_the_policys_cordon_are_exported(
    server: DevServer, node: Node, fake_nvml: ModuleType
) -> None:
    policy_path = Path(node.config.policy)
    policy = yaml.safe_load(policy_path.read_text())
    policy["cordon"] = {"gpus": ["0"], "reason": "kept for tests"}
    policy_path.write_text(yaml.safe_dump(policy, sort_keys=False))
    watch = GpuHealthWatch(node.config.record_dir, writes_holds=True, nvml=fake_nvml)
    observer = Observer(
        store_path=None,
        gpu_facts=watch,
        engines=no_engines,
        cordon_dir=str(node.config.record_dir),
        policy_cordon=load_policy(node.config.policy).cordon,
    )
    agent: Agent = node.agent(observer=observer)
    try:
        assert agent.run(max_cycles=1) == 0  # nothing published: a cycle that observes and reports
        _, samples = scrape(_port(node))
    finally:
        agent.close()

    status = read_status(node.state_dir)
    assert status is not None
    gpus = {gpu["index"]: gpu["uuid"] for gpu in status["gpus"]}
    assert sorted(gpus) == [0, 1]
    verdicts = {
        index: [
            v for v in GPU_VERDICTS if value(samples, "meridian_node_gpu_health", gpu=str(index), uuid=uuid, verdict=v)
        ]
        for index, uuid in gpus.items()
    }
    assert verdicts == {0: ["healthy"], 1: ["unhealthy"]}
    assert value(samples, "meridian_node_gpu_cordoned", gpu="0", uuid=gpus[0]) == 1
    assert value(samples, "meridian_node_gpu_cordoned", gpu="1", uuid=gpus[1]) == 0
    assert value(samples, "meridian_node_cordons", by="policy") == 1
    assert value(samples, "meridian_node_node_cordoned") == 0
