"""While an apply runs the agent reports what changed, so a replace's switch reaches the serving projection
mid-apply; an apply that changes nothing visible posts it once; a failing look never touches the apply."""

from __future__ import annotations

import json
import logging
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from ansible_collections.meridian.node.plugins.module_utils._transfer_progress import TransferReporter
from ansible_collections.meridian.node.plugins.module_utils.contracts import Observation
from ansible_collections.meridian.node.tests.devserver.devserver_process import DevServer
from ansible_collections.meridian.node.tests.support.node_env import SERVING_ENGINE, make_node, publish
from meridian_node_agent.agent_side.cycle import Agent, CycleStatus
from meridian_node_agent.agent_side.observe import Observer
from meridian_node_agent.agent_side.reporter import APPLY_REPORT_S
from meridian_node_agent.agent_side.transfer_watch import transfers_path
from meridian_node_agent.boundary.agent_files import STATUS_FILE
from meridian_node_agent.boundary.spool import ApplyResult
from meridian_node_agent.cli.agent import _transfers_text


class _Posts:
    def __init__(self, real: Any) -> None:
        self.real = real
        self.posted: list[tuple[float, Observation]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    def post_observation(self, observation: Observation) -> None:
        self.real.post_observation(observation)
        self.posted.append((time.monotonic(), observation))


class _SlowApply:
    """An apply that takes ``seconds`` and, half-way, makes ``change`` (a replace's new engine showing up)."""

    def __init__(self, seconds: float, change: Any = None) -> None:
        self.seconds, self.change = seconds, change
        self.window: tuple[float, float] = (0.0, 0.0)

    def apply(self, envelope: bytes, *, generation: int, **_: Any) -> ApplyResult:
        started = time.monotonic()
        time.sleep(self.seconds / 2)
        if self.change is not None:
            self.change()
        time.sleep(self.seconds / 2)
        self.window = (started, time.monotonic())
        now = datetime.now(UTC)
        return ApplyResult("run-1", generation, "successful", 0, 1, 0, Path(), now, now, self.seconds)


def _agent(server: DevServer, tmp_path: Path, node_id: str, engines: list[Any]) -> tuple[Agent, _Posts]:
    node = make_node(server, tmp_path / "node", node_id)
    agent = node.agent()
    agent.observer = Observer(store_path=None, gpu_facts=lambda: {"nvml_available": False}, engines=lambda: engines)
    posts = _Posts(agent.client)
    agent.client = posts
    return agent, posts


def test_a_change_during_the_apply_is_posted_during_it(server: DevServer, tmp_path: Path, node_id: str) -> None:
    engines: list[Any] = []
    agent, posts = _agent(server, tmp_path, node_id, engines)
    slow = _SlowApply(4 * APPLY_REPORT_S, change=lambda: engines.append(dict(SERVING_ENGINE)))
    agent.applier = slow
    publish(server, node_id)

    assert agent.cycle().outcome == CycleStatus.APPLIED

    start, end = slow.window
    during = [observation for at, observation in posts.posted if start < at < end]
    assert any([e.name for e in o.engines] == ["chat"] for o in during), [o.engines for _at, o in posts.posted]


def test_an_apply_that_changes_nothing_visible_posts_once_while_it_runs(
    server: DevServer, tmp_path: Path, node_id: str
) -> None:
    agent, posts = _agent(server, tmp_path, node_id, [dict(SERVING_ENGINE)])
    slow = _SlowApply(4 * APPLY_REPORT_S)
    agent.applier = slow
    publish(server, node_id)

    assert agent.cycle().outcome == CycleStatus.APPLIED

    start, end = slow.window
    # The first look is new to the control plane; the next ones are the same and are not re-sent.
    assert len([at for at, _o in posts.posted if start < at < end]) == 1


def test_a_failing_look_during_the_apply_never_touches_the_apply(
    server: DevServer, tmp_path: Path, node_id: str
) -> None:
    agent, _posts = _agent(server, tmp_path, node_id, [])
    looks = threading.Event()

    def broken() -> list[Any]:
        if slow.window == (0.0, 0.0):  # only while the apply runs: the cycle's own report must work
            looks.set()
            raise OSError("docker.sock: connection refused")
        return []

    agent.observer = Observer(store_path=None, gpu_facts=lambda: {"nvml_available": False}, engines=broken)
    slow = _SlowApply(3 * APPLY_REPORT_S)
    agent.applier = slow
    publish(server, node_id)

    assert agent.cycle().outcome == CycleStatus.APPLIED
    assert looks.is_set()


class _PullingApply:
    """An apply whose playbook is pulling an image: it writes the transfers file as the engine modules do, and
    reads ``status.json`` while the pull is in flight, as ``meridian-node status`` would."""

    def __init__(self, agent: Agent, image: str) -> None:
        self.agent, self.image = agent, image
        self.status_mid_pull: dict[str, Any] = {}
        self.window: tuple[float, float] = (0.0, 0.0)

    def apply(self, envelope: bytes, *, generation: int, **_: Any) -> ApplyResult:
        started = time.monotonic()
        writer = TransferReporter(str(transfers_path(self.agent.config)))
        writer.start("image", self.image)
        writer.advance(self.image, 0, 64 * 1024 * 1024)
        time.sleep(1.2)
        writer.advance(self.image, 16 * 1024 * 1024, 64 * 1024 * 1024)
        time.sleep(3 * APPLY_REPORT_S)
        self.status_mid_pull = json.loads((self.agent.state_dir / STATUS_FILE).read_text())
        writer.end(self.image)
        time.sleep(2 * APPLY_REPORT_S)
        self.window = (started, time.monotonic())
        now = datetime.now(UTC)
        return ApplyResult("run-1", generation, "successful", 0, 1, 0, Path(), now, now, 5.0)


def test_a_pull_in_flight_shows_in_the_observation_the_status_and_the_log(
    server: DevServer, tmp_path: Path, node_id: str, caplog: pytest.LogCaptureFixture
) -> None:
    agent, posts = _agent(server, tmp_path, node_id, [dict(SERVING_ENGINE)])
    image = "127.0.0.1:5000/team/vllm@sha256:" + "c" * 64
    pulling = _PullingApply(agent, image)
    agent.applier = pulling
    publish(server, node_id)

    with caplog.at_level(logging.INFO, logger="meridian_node_agent"):
        assert agent.cycle().outcome == CycleStatus.APPLIED

    start, end = pulling.window
    shown = [o.transfers for at, o in posts.posted if start < at < end and o.transfers]
    assert shown and shown[-1][0].name == image and shown[-1][0].kind == "image", posts.posted
    # Shown as the pull started (then at most every 10 s, longer than this pull): what the module wrote by then.
    assert (shown[-1][0].bytes_done, shown[-1][0].bytes_total) in ((0, None), (0, 64 * 1024 * 1024))
    # Posted again once the pull ended, without it: the control plane does not keep showing a finished pull.
    assert any(not o.transfers for at, o in posts.posted if at > start), posts.posted
    mid = pulling.status_mid_pull["transfers"]
    assert [(t["kind"], t["name"]) for t in mid] == [("image", image)]
    assert "image 127.0.0.1:5000/team/vllm@sha256:" in _transfers_text(mid)
    assert json.loads((agent.state_dir / STATUS_FILE).read_text())["transfers"] == []
    logged = [record.getMessage() for record in caplog.records]
    assert logged.count("transfer-started") == 1 and logged.count("transfer-ended") == 1, logged
