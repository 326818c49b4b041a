"""A replace as a gateway sees it: the serving projection polled every 50 ms while the agent replaces an engine.

The whole loop (the devserver process, the agent's cycle, ansible-runner running reconcile.yml, the real Docker
Engine, the stand-in vLLM image) and a gateway stand-in (``tests/support/projection_gateway.py``) that routes
one completion every 50 ms to whatever the projection lists. With room on the host the agent's replace starts
the new engine beside the old one, reports it mid-apply, and the projection moves to it before the old one
stops: no request is refused. Without room the old engine is stopped before the new one serves, and the
gateway sees the gap (the figures are bench/replace.py's to print; here only that it is seen and ends).
"""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from ansible_collections.meridian.node.tests.devserver.devserver_process import DevServer
from ansible_collections.meridian.node.tests.support.e2e_env import (
    E2ENode,
    applied,
    container_named,
    engine_spec,
    free_engine_port,
    serving,
)
from ansible_collections.meridian.node.tests.support.node_env import publish
from ansible_collections.meridian.node.tests.support.projection_gateway import ProjectionGateway
from ansible_collections.meridian.node.tests.support.standin_image import LocalImage

pytestmark = [pytest.mark.docker, pytest.mark.slow]


def _gateway(node: E2ENode, name: str) -> ProjectionGateway:
    return ProjectionGateway.from_projection(node.client().serving, name, "tiny-chat")


def _narrow_ports(node: E2ENode, port: int) -> None:
    """The node's policy with one port in its range, the engine's: no room for a second container."""
    path = node.node.root / "policy.yaml"
    policy = yaml.safe_load(path.read_text())
    policy["engines"]["port_range"] = [port, port]
    path.write_text(yaml.safe_dump(policy, sort_keys=False))


def _replace_way(node: E2ENode) -> str:
    """How the last apply replaced the engine, from the engine_set result in its ansible-runner journal."""
    journal = node.state_dir / "journal"
    text = "\n".join(p.read_text() for p in sorted(journal.rglob("job_events/*.json")))
    for way in ("beside", "in-place", "recreate"):
        if f'"way": "{way}"' in text:
            return way
    raise AssertionError(f"no replace in the journal under {journal}")


def test_with_room_the_agents_replace_refuses_no_request_through_the_serving_projection(
    server: DevServer, node_id: str, node: E2ENode, image: LocalImage, prefix: str, docker_client: Any
) -> None:
    name, port = f"{prefix}-chat", free_engine_port()
    publish(server, node_id, document={"engines": [engine_spec(name, image, port)], "artifacts": []})
    agent = node.agent()
    applied(agent)
    before = container_named(docker_client, name)
    assert [e["address"] for e in serving(node, prefix)] == [f"127.0.0.1:{port}"]

    changed = engine_spec(name, image, port, env={"STANDIN_NOTE": "second"})
    with _gateway(node, name) as gateway:
        publish(server, node_id, document={"engines": [changed], "artifacts": []})
        applied(agent)

    tally = gateway.tally
    assert tally.refused == [], tally.describe()
    assert tally.answered >= 20, tally.describe()
    # The projection moved to the new engine's free port while the old one still served.
    assert len(tally.addresses) == 2 and tally.addresses[0] == f"127.0.0.1:{port}", tally.describe()
    assert [e["address"] for e in serving(node, prefix)] == [tally.addresses[1]]
    assert _replace_way(node) == "beside"
    assert container_named(docker_client, name).id != before.id


def test_without_room_the_gap_is_seen_and_the_new_engine_serves_after_it(
    server: DevServer, node_id: str, node: E2ENode, image: LocalImage, prefix: str
) -> None:
    name, port = f"{prefix}-chat", free_engine_port()
    _narrow_ports(node, port)
    publish(server, node_id, document={"engines": [engine_spec(name, image, port)], "artifacts": []})
    agent = node.agent()
    applied(agent)

    changed = engine_spec(name, image, port, env={"STANDIN_NOTE": "second"})
    with _gateway(node, name) as gateway:
        publish(server, node_id, document={"engines": [changed], "artifacts": []})
        applied(agent)

    tally = gateway.tally
    assert _replace_way(node) == "in-place"
    # Stopped before the new one was ready: the gateway had nowhere to send some requests, then it had again.
    assert tally.refused, tally.describe()
    assert tally.addresses == [f"127.0.0.1:{port}"], tally.describe()
    assert [e["address"] for e in serving(node, prefix)] == [f"127.0.0.1:{port}"]
