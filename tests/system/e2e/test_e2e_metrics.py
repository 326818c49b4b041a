"""The engine series of the metrics endpoint against a real engine: applied, stopped behind the agent's back and
repaired. Real devserver, real Docker Engine (a stand-in engine image), real ansible-runner; the endpoint is
scraped over HTTP on 127.0.0.1 and read with prometheus_client's parser. Supervision's graces are shortened in
the config so that the test waits seconds."""

from __future__ import annotations

import time
from typing import Any

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from ansible_collections.meridian.node.tests.devserver.devserver_process import DevServer
from ansible_collections.meridian.node.tests.support.e2e_env import (
    QUICK_SUPERVISION,
    E2ENode,
    applied,
    container_named,
    engine_spec,
    free_engine_port,
    make_e2e_node,
)
from ansible_collections.meridian.node.tests.support.engine_harness import free_port
from ansible_collections.meridian.node.tests.support.node_env import publish
from ansible_collections.meridian.node.tests.support.standin_image import LocalImage
from meridian_node_agent.agent_side.cycle import Agent, CycleStatus
from meridian_node_agent.agent_side.metrics import Metrics

pytestmark = [pytest.mark.docker, pytest.mark.slow]

LIVENESS_CYCLES = 200  # about a minute of cycles: a bound on a hung test, not a timing assertion


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    body = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(body)
        for sample in family.samples
    }


def test_an_engine_is_shown_ready_then_stopped_then_repaired(
    server: DevServer, tmp_path: Any, node_id: str, image: LocalImage, prefix: str, docker_client: Any
) -> None:
    node: E2ENode = make_e2e_node(server, tmp_path / "node", node_id)
    node.node.configure(supervision=QUICK_SUPERVISION)
    name = f"{prefix}-chat"
    publish(server, node_id, document={"engines": [engine_spec(name, image, free_engine_port())]})
    port = free_port()
    agent: Agent = node.agent()
    agent.metrics = Metrics.serve(f"127.0.0.1:{port}")
    try:
        applied(agent)
        agent.write_status()
        samples = scrape(port)
        assert samples[("meridian_node_engine_ready", (("engine", name),))] == 1
        assert samples[("meridian_node_engine_state", (("engine", name), ("state", "running")))] == 1
        assert samples[("meridian_node_engine_state", (("engine", name), ("state", "exited")))] == 0
        assert ("meridian_node_engine_restarts_total", (("engine", name),)) in samples

        container = container_named(docker_client, name)
        assert container is not None
        container.stop(timeout=5)
        seen: list[CycleStatus] = []
        shown_down: list[tuple[float, float]] = []  # (ready, exited) as scraped between the stop and the repair
        for _cycle in range(LIVENESS_CYCLES):
            seen.append(agent.cycle().outcome)
            agent.write_status()
            if seen[-1] == CycleStatus.REPAIRED:
                break
            samples = scrape(port)
            shown_down.append(
                (
                    samples[("meridian_node_engine_ready", (("engine", name),))],
                    samples[("meridian_node_engine_state", (("engine", name), ("state", "exited")))],
                )
            )
            time.sleep(0.3)
        assert seen[-1] == CycleStatus.REPAIRED, seen
        assert (0, 1) in shown_down, shown_down  # the settle time passed with the engine shown exited, not ready

        samples = scrape(port)
        assert samples[("meridian_node_repairs_total", (("engine", name),))] == 1
        assert samples[("meridian_node_engine_repairs_since_healthy", (("engine", name),))] == 1
        assert samples[("meridian_node_engine_backoff_seconds", (("engine", name),))] == 2
        assert samples[("meridian_node_engine_ready", (("engine", name),))] == 1
        assert samples[("meridian_node_engine_state", (("engine", name), ("state", "running")))] == 1
    finally:
        agent.close()
