"""A desired state that hands a dropped engine's port to a new engine must converge, end to end: the devserver
process (real mutual TLS, real signing), the agent's cycle, real ansible-runner runs of playbooks/reconcile.yml,
the real Docker Engine and the stand-in vLLM image.

Placement refuses a port that a running engine publishes, so the dropped engine must be drained and removed
before the new one is created; one that holds nothing the new engine needs must still serve until the new one
is ready. The whole reconcile is one engine_set call, so the order is fixed by the test instead of read from
the journal: a request held in flight on the dropped engine keeps its drain waiting, and when the engine is
marked draining the test looks at the new engine (not created yet / already ready) before letting the request
finish (SIGUSR1, the stand-in's "finish every request now"). The outcome comes from Docker, the run's
engine_set result, the oplog, the agent's status and the devserver.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from ansible_collections.meridian.node.plugins.module_utils.engines.probes import http_get
from ansible_collections.meridian.node.plugins.module_utils.trust.applied_state import StateStore
from ansible_collections.meridian.node.tests.devserver.devserver_process import DevServer
from ansible_collections.meridian.node.tests.support.e2e_env import (
    BIND,
    E2ENode,
    applied,
    container_named,
    engine_spec,
    free_engine_port,
    last_observation,
    serving,
)
from ansible_collections.meridian.node.tests.support.engine_harness import hold_requests
from ansible_collections.meridian.node.tests.support.node_env import publish
from ansible_collections.meridian.node.tests.support.standin_image import LocalImage
from meridian_node_agent.agent_side.cycle import Agent, CycleStatus
from meridian_node_agent.agent_side.status_file import read_status
from meridian_node_agent.apply.applier import ApplyResult
from meridian_node_agent.apply.oplog import OpLog

pytestmark = [pytest.mark.docker, pytest.mark.slow]

ENGINE_SET = "meridian.node.engine_set"


def _engine_set_result(journal: Path) -> dict[str, Any]:
    """The result of the run's one engine_set task, from its ansible-runner job events."""
    events = [json.loads(path.read_text()) for path in (journal / "job_events").glob("*.json")]
    found = [
        event["event_data"]["res"]
        for event in events
        if event.get("event") == "runner_on_ok" and event["event_data"].get("resolved_action") == ENGINE_SET
    ]
    assert len(found) == 1, [(e.get("event"), (e.get("event_data") or {}).get("task")) for e in events]
    result: dict[str, Any] = found[0]
    return result


@dataclass
class AtDrainStart:
    """What the test saw of the new engine when the dropped one was marked draining."""

    marked: bool = False
    new_container: bool = False
    new_health: int | None = None
    held: list[Any] = field(default_factory=list)  # the held request's (status, time)


def _watch_drain(node: E2ENode, client: Any, old: Any, new: str, new_port: int, seen: AtDrainStart) -> None:
    mark = node.state_dir / "draining" / f"{old.name}.json"
    deadline = time.monotonic() + 120  # a liveness limit: without a mark the test fails on 'marked'
    while not mark.exists():
        if time.monotonic() > deadline:
            return
        time.sleep(0.02)
    seen.marked = True
    seen.new_container = container_named(client, new) is not None
    seen.new_health = http_get(BIND, new_port, "/health", timeout_s=2.0).status
    old.kill(signal="SIGUSR1")


def _apply_holding_a_request(
    agent: Agent, node: E2ENode, client: Any, old: str, old_port: int, new: str, new_port: int
) -> tuple[ApplyResult, AtDrainStart]:
    """One ``run --once`` while a slow request is in flight on ``old``: its drain waits for it, and the new
    engine is looked at while it waits (``_watch_drain``)."""
    container = container_named(client, old)
    assert container is not None
    threads, outcomes = hold_requests(old_port, 1, seconds=300)
    seen = AtDrainStart(held=outcomes)
    watcher = threading.Thread(target=_watch_drain, args=(node, client, container, new, new_port, seen))
    watcher.start()
    try:
        run = _run_once(agent)
    finally:
        watcher.join(timeout=120)
        if not seen.marked:
            container.kill(signal="SIGUSR1")
        for thread in threads:
            thread.join(timeout=60)
    return run, seen


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
    server: DevServer, node_id: str, node: E2ENode, docker_client: Any, image: LocalImage, prefix: str
) -> None:
    old, new, port = f"{prefix}-a", f"{prefix}-b", free_engine_port()
    publish(server, node_id, document={"engines": [engine_spec(old, image, port)]})
    agent = node.agent()
    applied(agent)
    assert [(e["engine"], e["address"]) for e in serving(node, prefix)] == [(old, f"127.0.0.1:{port}")]

    generation = publish(server, node_id, document={"engines": [engine_spec(new, image, port)]})
    run, seen = _apply_holding_a_request(agent, node, docker_client, old, port, new, port)

    _assert_generationapplied(node, run, generation)
    assert container_named(docker_client, old) is None
    container = container_named(docker_client, new)
    assert container is not None and container.status == "running"
    assert [b["HostPort"] for bindings in container.ports.values() for b in bindings or []] == [str(port)]
    # The old engine was drained (its request finished) before the new one was even created on its port.
    assert (seen.marked, seen.new_container) == (True, False)
    assert [status for status, _at in seen.held] == [200]
    result = _engine_set_result(run.journal)
    assert result["pruned"] == [{"name": old, "reason": "first"}]
    assert result["engines"][new]["ready"] is True
    observed = last_observation(server, node_id)
    assert observed is not None and observed["applied_generation"] == generation
    ours = {e["name"]: e for e in observed["engines"] if e["name"].startswith(prefix)}
    assert set(ours) == {new}
    assert (ours[new]["port"], ours[new]["ready"], ours[new]["managed"]) == (port, True, True)
    assert [(e["engine"], e["address"]) for e in serving(node, prefix)] == [(new, f"127.0.0.1:{port}")]
    assert not (node.state_dir / "draining" / f"{old}.json").exists()
    # Nothing more to do: the agent runs nothing for the same generation.
    assert agent.cycle().outcome == CycleStatus.UNCHANGED


def test_dropped_engine_in_nobodys_way_serves_until_the_new_engine_is_ready(
    server: DevServer, node_id: str, node: E2ENode, docker_client: Any, image: LocalImage, prefix: str
) -> None:
    old, new = f"{prefix}-a", f"{prefix}-b"
    old_port = free_engine_port()
    publish(server, node_id, document={"engines": [engine_spec(old, image, old_port)]})
    agent = node.agent()
    applied(agent)
    new_port = free_engine_port()
    assert new_port != old_port  # the old engine publishes its port, so no free one can equal it

    generation = publish(server, node_id, document={"engines": [engine_spec(new, image, new_port)]})
    run, seen = _apply_holding_a_request(agent, node, docker_client, old, old_port, new, new_port)

    _assert_generationapplied(node, run, generation)
    assert container_named(docker_client, old) is None
    assert container_named(docker_client, new).status == "running"
    # The new engine already answered ready when the old one began to drain; the old one's request finished.
    assert (seen.marked, seen.new_container, seen.new_health) == (True, True, 200)
    assert [status for status, _at in seen.held] == [200]
    result = _engine_set_result(run.journal)
    assert result["pruned"] == [{"name": old, "reason": "later"}]
    assert result["engines"][new]["ready"] is True
    assert [e["engine"] for e in serving(node, prefix)] == [new]
