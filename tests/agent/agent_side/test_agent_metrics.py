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
    assert (sample("meridian_node_last_success_timestamp_seconds") or 0) > 0
    assert sample("meridian_node_applies_total", {"status": "successful"}) is None


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
