"""The whole loop with real engines: the devserver process on 127.0.0.1 (real mutual TLS, real signing), the
agent's cycle, real ansible-runner runs of playbooks/reconcile.yml, the real Docker Engine and the stand-in
vLLM image.

Every test owns a random name prefix; a fixture removes every container with it (by name or by our
instance label) afterwards, pass or fail. A foreign container (no ownership labels, but looking like an
engine) sits on the host through the engine tests and must come out of them untouched.
"""

from __future__ import annotations

import socket
import threading
import time
import urllib.request
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

from ansible_collections.meridian.node.plugins.module_utils.docker.engine import (
    LABEL_CONFIG_HASH,
    LABEL_DRIVER,
    LABEL_INSTANCE,
    LABEL_OWNED,
)
from ansible_collections.meridian.node.plugins.module_utils.trust.applied_state import StateStore
from ansible_collections.meridian.node.tests.devserver.devserver_process import DevServer, running
from ansible_collections.meridian.node.tests.support.e2e_env import (
    BIND,
    E2ENode,
    applied,
    container_named,
    engine_spec,
    free_engine_port,
    last_observation,
    make_e2e_node,
    observed_engine,
    served_endpoint,
    serving,
)
from ansible_collections.meridian.node.tests.support.engine_harness import hold_requests, run_foreign_engine
from ansible_collections.meridian.node.tests.support.node_env import publish
from ansible_collections.meridian.node.tests.support.standin_image import LocalImage
from meridian_node_agent.agent_side.control_client import ControlPlaneRejected, ControlPlaneUnavailable
from meridian_node_agent.agent_side.cycle import Agent, CycleOutcome, CycleStatus
from meridian_node_agent.agent_side.status_file import read_status
from meridian_node_agent.apply.applier import ApplyResult
from meridian_node_agent.apply.oplog import OpLog
from meridian_node_agent.config import load_config

pytestmark = [pytest.mark.docker, pytest.mark.slow]


@pytest.fixture
def foreign(docker_client: Any, standin_base_image: LocalImage, prefix: str) -> Any:
    """Someone else's container: no labels of ours, but its published port is Ollama's, so it is listed."""
    return run_foreign_engine(docker_client, standin_base_image.id, f"{prefix}-foreign", seconds=600)


def _assert_untouched(client: Any, before: Any) -> None:
    now = client.containers.get(before.id)
    assert (now.name, now.status, now.attrs["State"]["StartedAt"]) == (
        before.name,
        "running",
        before.attrs["State"]["StartedAt"],
    )


def _release_when_marked(mark: Path, container: Any, seen: list[float], limit_s: float = 120) -> None:
    deadline = time.monotonic() + limit_s  # a liveness limit: without a mark the test fails on 'seen'
    while not mark.exists():
        if time.monotonic() > deadline:
            return
        time.sleep(0.02)
    seen.append(time.monotonic())
    container.kill(signal="SIGUSR1")


def _apply_again(node: E2ENode, agent: Agent) -> ApplyResult:
    """Run reconcile.yml once more on the spooled (last applied) envelope, as an operator re-run would."""
    last = OpLog(node.state_dir / "oplog.jsonl").last()
    assert last is not None
    return agent.applier.apply(
        agent.spool.read_bytes(), generation=last.generation, epoch=last.epoch, payload_sha256=last.payload_sha256
    )


def _apply_while_held(
    agent: Agent, node: E2ENode, old: Any, port: int, count: int
) -> tuple[CycleOutcome, list[Any], list[float]]:
    """One applying cycle while ``count`` slow requests are in flight on ``old``'s engine.

    vLLM aborts what is in flight on SIGTERM: only a drain lets them finish. They would run for minutes;
    once the engine is marked draining, SIGUSR1 (the stand-in's "finish every request now") ends them, so
    the order is fixed by the test, not by how fast this machine is. Returns the cycle's outcome, each
    request's (status, time) and when the draining mark was seen.
    """
    threads, outcomes = hold_requests(port, count, seconds=300)
    seen: list[float] = []
    mark = node.state_dir / "draining" / f"{old.name}.json"
    releaser = threading.Thread(target=_release_when_marked, args=(mark, old, seen))
    releaser.start()
    try:
        outcome = applied(agent)
    finally:
        releaser.join(timeout=120)
        if not seen:
            old.kill(signal="SIGUSR1")
        for thread in threads:
            thread.join(timeout=60)
    return outcome, outcomes, seen


def test_published_engine_is_started_ready_observed_and_served(
    server: DevServer, node_id: str, node: E2ENode, docker_client: Any, image: LocalImage, prefix: str, foreign: Any
) -> None:
    name, port = f"{prefix}-chat", free_engine_port()
    generation = publish(server, node_id, document={"engines": [engine_spec(name, image, port)]})
    agent = node.agent()

    outcome = applied(agent)

    assert outcome.generation == generation
    container = container_named(docker_client, name)
    assert container is not None and container.status == "running"
    observed = last_observation(server, node_id)
    assert observed is not None
    assert observed["applied_generation"] == generation
    engines = {e["name"]: e for e in observed["engines"]}
    ready_since = engines[name].pop("ready_since")
    assert isinstance(ready_since, str) and ready_since <= observed["observed_at"]
    # The observation names every field: only a failing engine carries its log's last lines (docs/LOGS.md).
    assert engines[name] == observed_engine(name, image, port, last_lines=None)
    assert engines[foreign.name]["managed"] is False
    assert serving(node, prefix) == [served_endpoint(node_id, name, port)]
    # The same generation again: the agent runs nothing, and the playbook itself changes nothing.
    assert agent.cycle().outcome == CycleStatus.UNCHANGED
    again = _apply_again(node, agent)
    assert (again.status, again.changed, again.failed) == ("successful", 0, 0), again.failures
    assert container_named(docker_client, name).id == container.id
    _assert_untouched(docker_client, foreign)


def test_changed_spec_drains_the_old_engine_under_load_then_replaces_it(
    server: DevServer, node_id: str, node: E2ENode, docker_client: Any, image: LocalImage, prefix: str, foreign: Any
) -> None:
    name, port = f"{prefix}-chat", free_engine_port()
    first = engine_spec(name, image, port, args=["--max-model-len", "4096"])
    publish(server, node_id, document={"engines": [first]})
    agent = node.agent()
    applied(agent)
    old = container_named(docker_client, name)
    changed = {**first, "args": ["--max-model-len", "8192"], "replace_strategy": "drain-then-replace"}
    generation = publish(server, node_id, document={"engines": [changed]})
    outcome, outcomes, seen = _apply_while_held(agent, node, old, port, 4)

    assert outcome.generation == generation
    assert [status for status, _at in outcomes] == [200] * 4
    assert seen, "the old engine was never marked draining"
    assert all(at > seen[0] for _status, at in outcomes), "a request ended before the engine was marked draining"
    new = container_named(docker_client, name)
    assert new is not None and new.id != old.id and new.status == "running"
    assert new.labels[LABEL_CONFIG_HASH] != old.labels[LABEL_CONFIG_HASH]
    assert "8192" in new.attrs["Args"]
    assert [c.id for c in docker_client.containers.list(all=True, filters={"name": name})] == [new.id]
    assert not (node.state_dir / "draining" / f"{name}.json").exists()
    assert [e["engine"] for e in serving(node, prefix)] == [name]
    _assert_untouched(docker_client, foreign)


def test_state_that_drops_the_engine_drains_and_removes_it_and_leaves_the_others_alone(
    server: DevServer,
    node_id: str,
    node: E2ENode,
    docker_client: Any,
    image: LocalImage,
    standin_base_image: LocalImage,
    prefix: str,
    foreign: Any,
) -> None:
    # An engine meridian.node runs for an operator's playbook (our ownership labels, no agent owner): the
    # agent did not start it, so the agent's state says nothing about it and pruning must leave it running.
    operators = docker_client.containers.run(
        standin_base_image.id,
        ["sleep", "600"],
        name=f"{prefix}-operators",
        detach=True,
        init=True,
        labels={LABEL_OWNED: "true", LABEL_INSTANCE: f"{prefix}-operators", LABEL_DRIVER: "vllm"},
    )
    operators.reload()
    name, port = f"{prefix}-chat", free_engine_port()
    publish(server, node_id, document={"engines": [engine_spec(name, image, port)]})
    agent = node.agent()
    applied(agent)
    assert [e["engine"] for e in serving(node, prefix)] == [name]
    old = container_named(docker_client, name)
    generation = publish(server, node_id, document={"engines": []})
    outcome, outcomes, seen = _apply_while_held(agent, node, old, port, 2)

    assert outcome.generation == generation
    # One task changed: engine_set drained and removed the engine, then recorded the generation.
    assert outcome.run is not None and outcome.run.changed == 1
    assert [status for status, _at in outcomes] == [200, 200]  # drained, not cut off
    assert seen and all(at > seen[0] for _status, at in outcomes)
    assert container_named(docker_client, name) is None
    assert not (node.state_dir / "draining" / f"{name}.json").exists()
    assert serving(node, prefix) == []
    observed = last_observation(server, node_id)
    assert observed is not None
    # Still observed, but as not this agent's (managed false, never ready), and not pruned: the agent did
    # not start it.
    listed = {e["name"]: (e["managed"], e["ready"]) for e in observed["engines"] if e["name"].startswith(prefix)}
    assert listed[operators.name] == (False, False)
    assert [name for name, (managed, _ready) in listed.items() if managed] == []
    assert StateStore(node.state_dir).load().generation == generation
    again = _apply_again(node, agent)
    assert (again.status, again.changed, again.failed) == ("successful", 0, 0), again.failures
    _assert_untouched(docker_client, foreign)
    _assert_untouched(docker_client, operators)


def test_observe_only_creates_nothing_and_still_reports(
    server: DevServer, tmp_path: Path, node_id: str, docker_client: Any, image: LocalImage, prefix: str
) -> None:
    node = make_e2e_node(server, tmp_path / "node", node_id, mode="observe-only")
    name = f"{prefix}-chat"
    generation = publish(server, node_id, document={"engines": [engine_spec(name, image, free_engine_port())]})

    outcome = node.agent().cycle()

    assert (outcome.outcome, outcome.generation, outcome.run) == (CycleStatus.OBSERVED_ONLY, generation, None)
    assert container_named(docker_client, name) is None
    assert node.node.journal_runs() == [] and node.node.oplog_lines() == []
    assert StateStore(node.state_dir).load().generation == 0
    observed = last_observation(server, node_id)
    assert observed is not None
    assert (observed["mode"], observed["applied_generation"]) == ("observe-only", 0)
    assert serving(node, prefix) == []


def test_revoked_node_is_refused_not_treated_as_unreachable(server: DevServer, node_id: str, node: E2ENode) -> None:
    publish(server, node_id)
    agent = node.agent()
    assert agent.cycle().outcome == CycleStatus.APPLIED
    server.cli("revoke", node_id)

    with pytest.raises(ControlPlaneRejected) as refused:
        agent.cycle()

    assert not isinstance(refused.value, ControlPlaneUnavailable)
    assert (refused.value.status, refused.value.reason) == (403, "certificate-revoked")
    assert agent.run(once=True) == 1  # the CLI's 'run --once' exits 1
    # Counted and logged as a refusal, with what to do, not as an outage.
    assert (agent.counters.refused, agent.counters.unavailable) == (1, 0)
    assert read_status(node.state_dir)["counters"]["refused"] == 1  # type: ignore[index]


def test_agent_configured_as_another_node_is_refused_with_403(server: DevServer, tmp_path: Path, node_id: str) -> None:
    victim = make_e2e_node(server, tmp_path / "victim", f"{node_id}-b")
    publish(server, victim.node_id)
    # Node A's enrolled identity, configured to speak for node B.
    impostor = make_e2e_node(server, tmp_path / "impostor", node_id)
    config = impostor.node.config_path
    config.write_text(config.read_text().replace(f"node_id: {node_id}\n", f"node_id: {victim.node_id}\n"))
    impostor.node.config = load_config(config)
    assert impostor.node.config.node_id == victim.node_id
    agent = impostor.agent()

    with pytest.raises(ControlPlaneRejected) as refused:
        agent.cycle()

    assert refused.value.status == 403
    assert victim.node_id in refused.value.detail
    assert StateStore(impostor.state_dir).load().generation == 0
    assert impostor.node.journal_runs() == []


def _models_status(port: int) -> int | str:
    try:
        with urllib.request.urlopen(f"http://{BIND}:{port}/v1/models", timeout=5) as response:
            return int(response.status)
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"


def test_control_plane_outage_leaves_the_engine_serving_and_the_agent_resumes(
    tmp_path: Path, node_id: str, docker_client: Any, image: LocalImage, prefix: str
) -> None:
    data = tmp_path / "control-plane"
    with socket.socket() as probe:  # the restarted control plane must come back at the same address
        probe.bind(("127.0.0.1", 0))
        control_port = probe.getsockname()[1]
    with ExitStack() as stack:
        server = stack.enter_context(running(data, extra=["--port", str(control_port)]))
        node = make_e2e_node(server, tmp_path / "node", node_id)
        name, port = f"{prefix}-chat", free_engine_port()
        generation = publish(server, node_id, document={"engines": [engine_spec(name, image, port)]})
        agent = node.agent()
        applied(agent)
        before = container_named(docker_client, name)
        runs = sorted((node.state_dir / "journal").iterdir())
        stack.close()  # the control plane goes away

        answers: list[int | str] = []

        def sleep(seconds: float) -> None:
            answers.append(_models_status(port))  # while the agent backs off, the engine keeps serving
            if len(answers) == 3:
                stack.enter_context(running(data, extra=["--port", str(control_port)]))

        agent.sleep = sleep
        status = agent.run(max_cycles=4)

    assert status == 0
    assert answers == [200, 200, 200]
    assert agent.counters.unavailable == 3
    after = container_named(docker_client, name)
    assert (after.id, after.attrs["State"]["StartedAt"]) == (before.id, before.attrs["State"]["StartedAt"])
    # Back online with nothing new published: the same generation, and no playbook ran again.
    assert StateStore(node.state_dir).load().generation == generation
    assert sorted((node.state_dir / "journal").iterdir()) == runs
