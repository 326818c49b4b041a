"""A desired state that hands a dropped engine's port to a new engine must converge, end to end: the devserver
process (real mutual TLS, real signing), the agent's cycle, real ansible-runner runs of playbooks/reconcile.yml,
the real Docker Engine and the stand-in vLLM image.

Placement refuses a port that a running engine publishes, so the dropped engine must be drained and removed
before the new one is created; one that holds nothing the new engine needs must still serve until the new one
is ready. The order is read from the run's own journal (ansible-runner's job events, numbered in the order the
playbook produced them), the outcome from Docker, the oplog, the agent's status and the devserver.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ansible_collections.meridian.node.plugins.module_utils.state_store import StateStore
from ansible_collections.meridian.node.tests.agent_loop.node_env import publish
from ansible_collections.meridian.node.tests.devserver.devserver_process import DevServer
from ansible_collections.meridian.node.tests.e2e.e2e_env import (
    E2ENode,
    applied,
    container_named,
    engine_spec,
    free_engine_port,
    last_observation,
    make_e2e_node,
    serving,
)
from ansible_collections.meridian.node.tests.helpers.standin_image import LocalImage
from meridian_node_agent.apply import ApplyResult
from meridian_node_agent.cycle import Agent, Outcome, read_status
from meridian_node_agent.oplog import OpLog

pytestmark = [pytest.mark.docker, pytest.mark.slow]

CONVERGE = "Converge the engines"
DRAIN = "Drain the engines the desired state no longer lists"
REMOVE = "Remove the engines the desired state no longer lists"


def _item_results(journal: Path) -> list[tuple[str, str, dict[str, Any]]]:
    """(task, item label, result) of every loop item that succeeded in one run, in the order the playbook ran
    them (ansible-runner numbers its events with ``counter``)."""
    events = [json.loads(path.read_text()) for path in (journal / "job_events").glob("*.json")]
    found = []
    for event in sorted(events, key=lambda e: int(e["counter"])):
        if event.get("event") != "runner_item_on_ok":
            continue
        data = event["event_data"]
        result = data.get("res") or {}
        label = result.get("_ansible_item_label", result.get("item"))
        found.append((str(data.get("task")), str(label), result))
    return found


def _position(items: list[tuple[str, str, dict[str, Any]]], task: str, label: str) -> int:
    matches = [i for i, (name, item, _result) in enumerate(items) if (name, item) == (task, label)]
    assert len(matches) == 1, (task, label, [(name, item) for name, item, _result in items])
    return matches[0]


def _run_once(agent: Agent) -> ApplyResult:
    """One cycle the way ``meridian-node run --once`` runs it (it also writes the status file)."""
    assert agent.run(once=True) == 0, agent.last_run and agent.last_run.failures
    assert agent.last_run is not None
    return agent.last_run


def _assert_generationapplied(node: E2ENode, run: ApplyResult, generation: int) -> None:
    assert (run.generation, run.status, run.failed) == (generation, "successful", 0), run.failures
    last = OpLog(node.state_dir / "oplog.jsonl").last()
    assert last is not None and (last.generation, last.run_ident, last.result) == (generation, run.ident, "successful")
    assert StateStore(node.state_dir).load().generation == generation
    status = read_status(node.state_dir)
    assert status is not None and status["applied_generation"] == generation
    assert (status["last_run"]["generation"], status["last_run"]["status"]) == (generation, "successful")


def test_new_engine_on_a_dropped_engines_port_converges_after_the_old_one_is_pruned_first(
    server: DevServer, tmp_path: Path, node_id: str, docker_client: Any, image: LocalImage, prefix: str
) -> None:
    node = make_e2e_node(server, tmp_path / "node", node_id)
    old, new, port = f"{prefix}-a", f"{prefix}-b", free_engine_port()
    publish(server, node_id, document={"engines": [engine_spec(old, image, port)]})
    agent = node.agent()
    applied(agent)
    assert [(e["engine"], e["address"]) for e in serving(node, prefix)] == [(old, f"127.0.0.1:{port}")]

    generation = publish(server, node_id, document={"engines": [engine_spec(new, image, port)]})
    run = _run_once(agent)

    _assert_generationapplied(node, run, generation)
    assert container_named(docker_client, old) is None
    container = container_named(docker_client, new)
    assert container is not None and container.status == "running"
    assert [b["HostPort"] for bindings in container.ports.values() for b in bindings or []] == [str(port)]
    # The old engine was drained and removed before the new one was placed on its port.
    items = _item_results(run.journal)
    assert _position(items, DRAIN, old) < _position(items, REMOVE, old) < _position(items, CONVERGE, new)
    assert items[_position(items, CONVERGE, new)][2]["ready"] is True
    observed = last_observation(server, node_id)
    assert observed is not None and observed["applied_generation"] == generation
    ours = {e["name"]: e for e in observed["engines"] if e["name"].startswith(prefix)}
    assert set(ours) == {new}
    assert (ours[new]["port"], ours[new]["ready"], ours[new]["managed"]) == (port, True, True)
    assert [(e["engine"], e["address"]) for e in serving(node, prefix)] == [(new, f"127.0.0.1:{port}")]
    assert not (node.state_dir / "draining" / f"{old}.json").exists()
    # Nothing more to do: the agent runs nothing for the same generation.
    assert agent.cycle().outcome == Outcome.UNCHANGED


def test_dropped_engine_in_nobodys_way_serves_until_the_new_engine_is_ready(
    server: DevServer, tmp_path: Path, node_id: str, docker_client: Any, image: LocalImage, prefix: str
) -> None:
    node = make_e2e_node(server, tmp_path / "node", node_id)
    old, new = f"{prefix}-a", f"{prefix}-b"
    old_port = free_engine_port()
    publish(server, node_id, document={"engines": [engine_spec(old, image, old_port)]})
    agent = node.agent()
    applied(agent)
    new_port = free_engine_port()
    assert new_port != old_port  # the old engine publishes its port, so no free one can equal it

    generation = publish(server, node_id, document={"engines": [engine_spec(new, image, new_port)]})
    run = _run_once(agent)

    _assert_generationapplied(node, run, generation)
    assert container_named(docker_client, old) is None
    assert container_named(docker_client, new).status == "running"
    items = _item_results(run.journal)
    converged = _position(items, CONVERGE, new)
    assert items[converged][2]["ready"] is True
    assert converged < _position(items, DRAIN, old) < _position(items, REMOVE, old)
    assert [e["engine"] for e in serving(node, prefix)] == [new]
