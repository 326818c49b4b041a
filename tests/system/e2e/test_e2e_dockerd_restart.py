"""The Docker daemon itself restarts (an upgrade, a crash, a reboot): the engines come back ready under their
restart policy, the agent notices the outage and the return, and nothing is duplicated or published.

The daemon is a second ``dockerd`` this test starts and owns (tests/support/own_dockerd.py: its own data root,
sockets and bridge, no iptables), so stopping it disturbs nobody; the agent, its reconcile runs and the
module all reach it through ``DOCKER_HOST``. Real devserver, real ansible-runner.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import pytest

from ansible_collections.meridian.node.plugins.module_utils.contracts import parse_rfc3339
from ansible_collections.meridian.node.plugins.module_utils.docker.engine import LABEL_INSTANCE
from ansible_collections.meridian.node.tests.devserver.devserver_process import DevServer
from ansible_collections.meridian.node.tests.support.e2e_env import (
    E2ENode,
    applied,
    engine_spec,
    free_engine_port,
    last_observation,
)
from ansible_collections.meridian.node.tests.support.node_env import publish
from ansible_collections.meridian.node.tests.support.own_dockerd import OwnDockerd, unavailable
from ansible_collections.meridian.node.tests.support.standin_image import LocalImage
from meridian_node_agent.agent_side.cycle import Agent, CycleStatus
from meridian_node_agent.apply.oplog import OpLog

pytestmark = [pytest.mark.docker, pytest.mark.slow]

# Long enough that the daemon's downtime is never taken for drift: Docker's restart policy is what must
# bring the engine back here, and a repair towards a daemon that is down could only fail.
SUPERVISION = {"settle_seconds": 60, "startup_grace_seconds": 120}


@pytest.fixture
def own_dockerd(docker_client: Any, image: LocalImage, monkeypatch: pytest.MonkeyPatch) -> Iterator[OwnDockerd]:
    why = unavailable()
    if why is not None:
        pytest.skip(f"cannot start a second Docker daemon: {why}")
    with OwnDockerd() as daemon:
        daemon.load(docker_client, image.tag)
        monkeypatch.setenv("DOCKER_HOST", daemon.host)  # the agent, ansible-runner and the module all read it
        yield daemon


def _engine(agent: Agent, name: str) -> dict[str, Any]:
    found = {e["name"]: e for e in agent.reporter.engines}
    assert name in found, agent.reporter.engines
    return found[name]


def _ours(daemon: OwnDockerd, name: str) -> list[Any]:
    with contextlib.closing(daemon.client()) as client:
        return [c for c in client.containers.list(all=True) if c.name == name or c.labels.get(LABEL_INSTANCE) == name]


def test_engines_come_back_ready_after_their_docker_daemon_restarts_and_the_agent_notices(
    server: DevServer, node_id: str, node: E2ENode, image: LocalImage, prefix: str, own_dockerd: OwnDockerd
) -> None:
    node.node.configure(supervision=SUPERVISION)
    name = f"{prefix}-chat"
    generation = publish(server, node_id, document={"engines": [engine_spec(name, image, free_engine_port())]})
    agent = node.agent()
    applied(agent)
    before = _ours(own_dockerd, name)
    assert [c.status for c in before] == ["running"]
    assert _engine(agent, name)["ready"] is True
    ready_since = parse_rfc3339(_engine(agent, name)["ready_since"])

    own_dockerd.stop()

    down = agent.cycle()
    assert down.outcome == CycleStatus.UNCHANGED
    # Noticed: listed as it was last seen, state unknown, not ready, so not served.
    assert (_engine(agent, name)["state"], _engine(agent, name)["ready"]) == ("unknown", False)
    observed = last_observation(server, node_id)
    assert observed is not None
    assert {e["name"]: (e["state"], e["ready"]) for e in observed["engines"]}[name] == ("unknown", False)

    own_dockerd.start()
    # Bounded by a count of cycles (about a minute), not by the clock.
    outcomes: list[CycleStatus] = []
    for _cycle in range(200):
        if _engine(agent, name)["ready"]:
            break
        time.sleep(0.3)
        outcomes.append(agent.cycle().outcome)
    assert _engine(agent, name)["ready"], (outcomes, agent.reporter.engines)

    assert set(outcomes) <= {CycleStatus.UNCHANGED}  # no publish, no repair: the restart policy brought it back
    assert agent.counters.repairs == 0 and agent.counters.applies == 1
    after = _ours(own_dockerd, name)
    assert [(c.id, c.status) for c in after] == [(before[0].id, "running")]  # the same container, once
    engine = _engine(agent, name)
    assert engine["state"] == "running" and parse_rfc3339(engine["ready_since"]) > ready_since
    observed = last_observation(server, node_id)
    assert observed is not None and observed["applied_generation"] == generation
    assert {e["name"]: (e["state"], e["ready"]) for e in observed["engines"]}[name] == ("running", True)
    assert [e.result for e in OpLog(node.state_dir / "oplog.jsonl").read()] == ["started", "successful"]
