"""The agent's whole loop with an engine whose image is only in a registry (issue 26): the devserver publishes a
state pinning it by digest; the agent's reconcile (ansible-runner, engine_set) pulls it from a real registry on
127.0.0.1 (tests/support/registry.py), verified, and the engine is started, ready and observed; the next cycle
runs nothing and pulls nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from ansible_collections.meridian.node.tests.devserver.devserver_process import DevServer
from ansible_collections.meridian.node.tests.support.e2e_env import (
    E2ENode,
    applied,
    container_named,
    engine_serving,
    free_engine_port,
    last_observation,
)
from ansible_collections.meridian.node.tests.support.node_env import publish
from ansible_collections.meridian.node.tests.support.registry import pushed_image, running_registry
from ansible_collections.meridian.node.tests.support.standin_image import LocalImage
from meridian_node_agent.agent_side.cycle import CycleStatus

pytestmark = [pytest.mark.docker, pytest.mark.slow]


def test_the_agent_pulls_a_published_engine_only_in_the_registry_by_digest(
    server: DevServer,
    node_id: str,
    node: E2ENode,
    docker_client: Any,
    image: LocalImage,
    prefix: str,
    tmp_path: Path,
) -> None:
    with running_registry() as registry, pushed_image(docker_client, registry, image.id, prefix) as pushed:
        policy_path = tmp_path / "node" / "policy.yaml"  # the node fixture's (tests/support/e2e_fixtures.py)
        policy = yaml.safe_load(policy_path.read_text())
        policy["images"]["allowed_repositories"].append(pushed.repository)
        policy_path.write_text(yaml.safe_dump(policy, sort_keys=False))
        name, port = f"{prefix}-pulled", free_engine_port()
        spec = {
            "name": name,
            "driver": "vllm",
            "image": pushed.pinned,
            "model": {"name": "tiny"},
            "served_model_name": "tiny-chat",
            "port": port,
        }
        generation = publish(server, node_id, document={"engines": [spec]})
        agent = node.agent()

        outcome = applied(agent)

        assert outcome.generation == generation
        container = container_named(docker_client, name)
        assert container is not None and container.status == "running"
        assert container.image.id == pushed.id
        assert pushed.pinned in docker_client.images.get(pushed.id).attrs["RepoDigests"]
        assert engine_serving(port)
        observed = last_observation(server, node_id)
        assert observed is not None and observed["applied_generation"] == generation
        assert {e["name"]: e["ready"] for e in observed["engines"]}[name] is True
        # What the apply pulled is what the agent's meridian_node_image_fetched_bytes_total gets (Metrics.applied).
        assert agent.last_run is not None and agent.last_run.image_bytes > 0
        assert agent.cycle().outcome == CycleStatus.UNCHANGED
        assert container_named(docker_client, name).id == container.id
