"""The agent keeps what was approved running: engines stopped or removed behind its back come back without a
new publish, a drained engine stays drained, and an unchanged, healthy host runs no playbook.

Real devserver, real Docker Engine, real ansible-runner; the supervision graces are shortened in the config
(the defaults are minutes) so that a test waits seconds.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from ansible_collections.meridian.node.plugins.module_utils.engines.drain_marks import mark_draining
from ansible_collections.meridian.node.tests.devserver.devserver_process import DevServer
from ansible_collections.meridian.node.tests.support.e2e_env import (
    PORT_RANGE,
    QUICK_SUPERVISION,
    E2ENode,
    applied,
    container_named,
    engine_spec,
    free_engine_port,
    last_observation,
    make_e2e_node,
    serving,
)
from ansible_collections.meridian.node.tests.support.node_env import publish
from ansible_collections.meridian.node.tests.support.standin_image import LocalImage
from meridian_node_agent.agent_side.cycle import Agent, CycleOutcome, CycleStatus
from meridian_node_agent.apply.oplog import OpLog
from meridian_node_agent.cli import main as cli_main

pytestmark = [pytest.mark.docker, pytest.mark.slow]


def _supervised(server: DevServer, root: Any, node_id: str) -> E2ENode:
    node = make_e2e_node(server, root, node_id)
    node.node.configure(supervision=QUICK_SUPERVISION)
    return node


def _cycle_until(agent: Agent, wanted: CycleStatus, *, timeout: float = 60) -> tuple[CycleOutcome, list[CycleStatus]]:
    seen: list[CycleStatus] = []
    deadline = time.monotonic() + timeout  # a liveness bound, not a timing assertion
    while True:
        outcome = agent.cycle()
        seen.append(outcome.outcome)
        if outcome.outcome == wanted:
            return outcome, seen
        if time.monotonic() > deadline:
            raise AssertionError(f"no {wanted} in {timeout:g} s; cycles gave {seen}")
        time.sleep(0.3)


@pytest.fixture
def running_engine(
    server: DevServer, tmp_path: Any, node_id: str, image: LocalImage, prefix: str
) -> tuple[E2ENode, Agent, str, int]:
    node = _supervised(server, tmp_path / "node", node_id)
    name = f"{prefix}-chat"
    generation = publish(server, node_id, document={"engines": [engine_spec(name, image, free_engine_port())]})
    agent = node.agent()
    applied(agent)
    return node, agent, name, generation


@pytest.mark.parametrize("how", ["docker stop", "docker rm -f"])
def test_an_engine_stopped_or_removed_behind_the_agents_back_is_brought_back_without_a_publish(
    running_engine: tuple[E2ENode, Agent, str, int], docker_client: Any, how: str, capsys: pytest.CaptureFixture[str]
) -> None:
    node, agent, name, generation = running_engine
    before = container_named(docker_client, name)
    assert before is not None
    if how == "docker stop":
        before.stop(timeout=5)
    else:
        before.remove(force=True)

    outcome, seen = _cycle_until(agent, CycleStatus.REPAIRED)

    assert outcome.generation == generation and outcome.run is not None and outcome.run.ok
    assert set(seen[:-1]) <= {CycleStatus.UNCHANGED}  # the settle time passed in unchanged cycles, no publish
    after = container_named(docker_client, name)
    assert after is not None and after.status == "running"
    assert (after.id == before.id) is (how == "docker stop")  # started again, or created again
    why = "not running (exited)" if how == "docker stop" else "missing"
    started = [e for e in OpLog(node.state_dir / "oplog.jsonl").read() if e.result == "started"]
    assert started[-1].generation == generation and started[-1].reason == f"drift: {name}: {why}"
    observed = last_observation(node.server, node.node_id)
    assert observed is not None and observed["applied_generation"] == generation
    assert {e["name"]: e["ready"] for e in observed["engines"]}.get(name) is True
    # Healthy again: the next cycles run nothing.
    assert agent.cycle().outcome == CycleStatus.UNCHANGED
    assert agent.counters.repairs == 1
    # 'status --json' shows the repair and the backoff it left (forgotten after 10 min healthy).
    agent.write_status()
    assert cli_main(["--config", str(node.node.config_path), "status", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["applied"]["generation"] == generation
    assert shown["agent"]["counters"]["repairs"] == 1
    supervised = shown["agent"]["supervision"][name]
    assert (supervised["repairs"], supervised["problem"]) == (1, None)
    assert shown["last_operation"]["run_ident"] == outcome.run.ident


def test_a_drained_engine_stays_stopped_until_the_next_generation(
    running_engine: tuple[E2ENode, Agent, str, int], docker_client: Any
) -> None:
    node, agent, name, _generation = running_engine
    mark_draining(str(node.state_dir), name, reason="operator drain")
    container = container_named(docker_client, name)
    assert container is not None
    container.stop(timeout=5)

    deadline = time.monotonic() + 4 * QUICK_SUPERVISION["settle_seconds"] + 2
    outcomes = []
    while time.monotonic() < deadline:
        outcomes.append(agent.cycle().outcome)
        time.sleep(0.3)

    assert set(outcomes) == {CycleStatus.UNCHANGED}
    assert container_named(docker_client, name).status == "exited"
    assert agent.counters.repairs == 0


def test_another_agents_engine_on_the_same_docker_engine_is_not_observed_as_ours_or_served(
    server: DevServer, tmp_path: Any, image: LocalImage, prefix: str
) -> None:
    ours = _supervised(server, tmp_path / "ours", f"{prefix}-a")
    theirs = _supervised(server, tmp_path / "theirs", f"{prefix}-b")
    mine, other = f"{prefix}-mine", f"{prefix}-other"
    publish(server, ours.node_id, document={"engines": [engine_spec(mine, image, free_engine_port())]})
    publish(server, theirs.node_id, document={"engines": [engine_spec(other, image, free_engine_port())]})
    applied(theirs.agent())
    agent = ours.agent()

    applied(agent)

    observed = last_observation(server, ours.node_id)
    assert observed is not None
    engines = {e["name"]: e for e in observed["engines"]}
    assert (engines[mine]["managed"], engines[mine]["ready"]) == (True, True)
    assert (engines[other]["managed"], engines[other]["ready"]) == (False, False)  # listed, never ours
    assert [e["engine"] for e in serving(ours, prefix)] == [mine]
    # The capacity left is in the observation: free ports of the policy's range, none an engine holds.
    ports = observed["capacity"]["free_ports"]
    assert ports and all(PORT_RANGE[0] <= port <= PORT_RANGE[1] for port in ports)
    assert not {engines[mine]["port"], engines[other]["port"]} & set(ports)
    assert [e["engine"] for e in serving(theirs, prefix)] == [other]


def test_a_killed_engine_is_observed_with_how_it_ended_then_repaired(
    running_engine: tuple[E2ENode, Agent, str, int], docker_client: Any
) -> None:
    node, agent, name, generation = running_engine
    container = container_named(docker_client, name)
    assert container is not None
    container.kill()  # SIGKILL: Docker counts it as stopped by hand, so its restart policy does not apply

    agent.cycle()  # within the settle time: observed, not repaired yet

    observed = last_observation(node.server, node.node_id)
    assert observed is not None
    engine = {e["name"]: e for e in observed["engines"]}[name]
    assert (engine["state"], engine["ready"], engine["ready_since"]) == ("exited", False, None)
    assert (engine["exit_code"], engine["exit_reason"]) == (137, "killed by signal 9")
    outcome, _seen = _cycle_until(agent, CycleStatus.REPAIRED)
    assert outcome.generation == generation
    observed = last_observation(node.server, node.node_id)
    assert observed is not None
    engine = {e["name"]: e for e in observed["engines"]}[name]
    assert (engine["state"], engine["ready"]) == ("running", True) and engine["ready_since"] is not None


def test_an_engine_changed_by_hand_with_docker_update_is_repaired_naming_the_settings(
    running_engine: tuple[E2ENode, Agent, str, int], docker_client: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    node, agent, name, generation = running_engine
    before = container_named(docker_client, name)
    assert before is not None
    before.update(restart_policy={"Name": "no"}, cpu_quota=50_000, cpu_period=100_000)
    assert agent.cycle().outcome == CycleStatus.UNCHANGED  # seen, still settling
    agent.write_status()
    assert cli_main(["--config", str(node.node.config_path), "status", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)["agent"]
    assert {e["name"]: e["drifted"] for e in shown["engines"]}[name] == ["restart_policy", "cpus"]
    assert shown["supervision"][name]["problem"] == "changed by hand: restart_policy, cpus"

    outcome, seen = _cycle_until(agent, CycleStatus.REPAIRED)

    assert outcome.generation == generation and outcome.run is not None and outcome.run.ok
    assert set(seen[:-1]) <= {CycleStatus.UNCHANGED}  # no publish
    started = [e for e in OpLog(node.state_dir / "oplog.jsonl").read() if e.result == "started"]
    assert started[-1].reason == f"drift: {name}: changed by hand: restart_policy, cpus"
    after = container_named(docker_client, name)
    assert after is not None and after.id != before.id and after.status == "running"
    assert after.attrs["HostConfig"]["RestartPolicy"]["Name"] == "unless-stopped"
    assert (after.attrs["HostConfig"]["CpuQuota"], after.attrs["HostConfig"]["CpuPeriod"]) == (0, 0)
    assert agent.cycle().outcome == CycleStatus.UNCHANGED
    assert agent.counters.repairs == 1
