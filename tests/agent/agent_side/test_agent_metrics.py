"""The optional Prometheus endpoint: what a cycle records, and that it is served over HTTP."""

from __future__ import annotations

import socket
from datetime import UTC, datetime, timedelta
from pathlib import Path

import requests

from ansible_collections.meridian.node.tests.devserver.devserver_process import DevServer
from ansible_collections.meridian.node.tests.support.node_env import make_node, publish
from meridian_node_agent.agent_side.cycle import CycleStatus
from meridian_node_agent.agent_side.metrics import Metrics
from meridian_node_agent.boundary.spool import ApplyResult


def test_rejections_are_counted_by_reason_and_cycles_timed(server: DevServer, tmp_path: Path) -> None:
    node = make_node(server, tmp_path / "n", "metrics-node-1")
    publish(server, node.node_id, ttl=60)
    later = datetime.now(UTC) + timedelta(minutes=5)
    metrics = Metrics()
    agent = node.agent(clock=lambda: later, metrics=metrics)

    assert agent.cycle().outcome == CycleStatus.REJECTED
    assert agent.cycle().outcome == CycleStatus.UNCHANGED

    sample = metrics.registry.get_sample_value
    assert sample("meridian_node_rejections_total", {"reason": "expired"}) == 1
    assert sample("meridian_node_cycle_seconds_count") == 2
    assert (sample("meridian_node_last_cycle_timestamp_seconds") or 0) > 0
    assert sample("meridian_node_applies_total", {"status": "successful"}) is None
    # Two cycles and no apply: no successful apply to date, whatever the cycles did.
    agent.write_status()
    assert sample("meridian_node_last_successful_apply_timestamp_seconds") is None


def test_metrics_endpoint_serves_the_agent_registry() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    metrics = Metrics.serve(f"127.0.0.1:{port}")
    try:
        metrics.rejected("stale-epoch")
        body = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    finally:
        metrics.close()
    assert 'meridian_node_rejections_total{reason="stale-epoch"} 1.0' in body
    assert "python_gc_objects_collected_total" not in body  # a registry of its own


def _result(
    status: str, *, ident: str = "gen-1-20261205T070000.000000Z", failed: int = 0, fetched: int = 0, pulled: int = 0
) -> ApplyResult:
    at = datetime.now(UTC)
    return ApplyResult(ident, 1, status, 0, 0, failed, Path(), at, at, 0.0, fetched_bytes=fetched, image_bytes=pulled)


def test_failed_applies_are_counted_by_reason_and_fetched_bytes_add_up() -> None:
    metrics = Metrics()
    metrics.applied(_result("successful", fetched=1000))
    metrics.applied(_result("failed", failed=1))
    metrics.applied(_result("failed", ident=""))  # the playbook never ran
    metrics.applied(_result("timeout"))
    metrics.apply_not_spooled()

    sample = metrics.registry.get_sample_value
    reasons = ("task-failed", "not-run", "timeout", "not-spooled", "playbook-failed", "canceled")
    assert [sample("meridian_node_apply_failures_total", {"reason": r}) for r in reasons] == [1, 1, 1, 1, None, None]
    assert sample("meridian_node_applies_total", {"status": "failed"}) == 2
    assert sample("meridian_node_artifact_fetched_bytes_total") == 1000
    assert sample("meridian_node_image_fetched_bytes_total") == 0


def test_image_bytes_an_apply_pulled_add_up_failed_or_not() -> None:
    metrics = Metrics()
    metrics.applied(_result("successful", pulled=4096))
    metrics.applied(_result("failed", failed=1, pulled=100))  # pulled before a later engine failed
    metrics.applied(_result("successful"))
    assert metrics.registry.get_sample_value("meridian_node_image_fetched_bytes_total") == 4196
