"""SIGTERM and SIGINT stop ``meridian-node run`` within a few seconds, whatever it is doing, and say so.

Each test runs the real ``meridian-node run`` as its own process against the module's real devserver, sends it a
signal at a chosen moment (after a real in-process apply, mid-apply, in a long-poll, in a backoff, while waiting on
root's answer under the split) and reads its JSON log back. The 30-second bound is a liveness limit (before the
fix an agent that had run one in-process apply ignored SIGTERM for good), never a speed target.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml

from ansible_collections.meridian.node.plugins.module_utils.trust.applied_state import StateStore
from ansible_collections.meridian.node.tests.devserver.devserver_process import DevServer
from ansible_collections.meridian.node.tests.support.airgap_env import AirGapNode, make_airgap_node, state_bundle
from ansible_collections.meridian.node.tests.support.node_env import Node, make_node, publish
from ansible_collections.meridian.node.tests.support.path_unit import PathUnit
from meridian_node_agent.apply.oplog import OpLog
from meridian_node_agent.boundary.spool import REQUEST_FILE, SPOOL_DIR

# How long a signalled agent may take to exit before the test calls it stuck: generous, a liveness bound.
EXIT_BOUND_S = 30.0
# How long the agent may take to reach the moment a test signals it in (a first apply, on a busy 2-core machine).
REACH_BOUND_S = 180.0
# An Ansible callback plugin that holds the real playbook at its start while a gate file exists, after saying it got
# there: the signal then lands mid-apply for certain, however fast the playbook would otherwise be.
GATE_CALLBACK = """
import os
import time

from ansible.plugins.callback import CallbackBase


class CallbackModule(CallbackBase):
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "aggregate"
    CALLBACK_NAME = "stop_gate"
    CALLBACK_NEEDS_ENABLED = True

    def v2_playbook_on_start(self, playbook):
        gate = os.environ["MERIDIAN_TEST_GATE"]
        open(gate + ".reached", "w").close()
        deadline = time.monotonic() + 300
        while os.path.exists(gate) and time.monotonic() < deadline:
            time.sleep(0.05)
"""


def _command() -> list[str]:
    script = Path(sys.executable).parent / "meridian-node"
    return [str(script)] if script.exists() else [sys.executable, "-m", "meridian_node_agent.cli"]


class RunningAgent:
    """``meridian-node run`` in its own session (so a signal reaches only the agent), its log in a file."""

    def __init__(self, config: Path, log: Path, *args: str, env: dict[str, str] | None = None) -> None:
        self.log = log
        self._stderr = log.open("w")
        self.process = subprocess.Popen(
            [*_command(), "--config", str(config), "run", *args],
            stdout=subprocess.DEVNULL,
            stderr=self._stderr,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )

    def events(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.log.read_text().splitlines() if line.startswith("{")]

    def wait_for(self, what: str, found: Callable[[], bool]) -> None:
        deadline = time.monotonic() + REACH_BOUND_S
        while not found():
            if self.process.poll() is not None:
                pytest.fail(f"the agent exited ({self.process.returncode}) before {what}: {self.log.read_text()}")
            if time.monotonic() > deadline:
                pytest.fail(f"the agent never reached {what}: {self.log.read_text()}")
            time.sleep(0.05)

    def wait_for_event(self, name: str) -> dict[str, Any]:
        self.wait_for(f"event {name}", lambda: any(e["event"] == name for e in self.events()))
        return next(e for e in self.events() if e["event"] == name)

    def signal_and_wait(self, number: signal.Signals) -> int:
        self.process.send_signal(number)
        try:
            return self.process.wait(timeout=EXIT_BOUND_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the agent did not exit within {EXIT_BOUND_S:g} s of {number.name}: {self.log.read_text()}")

    def close(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)
        self._stderr.close()


@contextmanager
def running_agent(config: Path, log: Path, *args: str, env: dict[str, str] | None = None) -> Iterator[RunningAgent]:
    agent = RunningAgent(config, log, *args, env=env)
    try:
        yield agent
    finally:
        agent.close()


def _stop_events(agent: RunningAgent) -> tuple[dict[str, Any], dict[str, Any]]:
    events = agent.events()
    stopping = [e for e in events if e["event"] == "agent-stopping"]
    stopped = [e for e in events if e["event"] == "agent-stopped"]
    assert len(stopping) == 1 and len(stopped) == 1, events
    return stopping[0], stopped[0]


def _run_once(config: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*_command(), "--config", str(config), "run", "--once"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def _gate(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A closed gate for the playbook (``GATE_CALLBACK``) and the agent environment that installs it."""
    plugins = tmp_path / "callbacks"
    plugins.mkdir()
    (plugins / "stop_gate.py").write_text(GATE_CALLBACK)
    gate = tmp_path / "gate"
    gate.touch()
    return gate, {
        "ANSIBLE_CALLBACK_PLUGINS": str(plugins),
        "ANSIBLE_CALLBACKS_ENABLED": "stop_gate",
        "MERIDIAN_TEST_GATE": str(gate),
    }


def _oplog_results(node: Node) -> list[str]:
    return [json.loads(line)["result"] for line in node.oplog_lines()]


@pytest.mark.parametrize(("number", "status"), [(signal.SIGTERM, 0), (signal.SIGINT, 130)])
def test_signal_after_an_in_process_apply_stops_the_agent(
    server: DevServer, tmp_path: Path, node_id: str, number: signal.Signals, status: int
) -> None:
    # ansible-runner's run installs SIGTERM/SIGINT handlers that only set its own cancel flag: before the agent kept
    # its own, every later signal was swallowed and the agent ran on until SIGKILL.
    node = make_node(server, tmp_path / "n", node_id)
    generation = publish(server, node.node_id)
    with running_agent(node.config_path, tmp_path / "agent.log") as agent:
        finished = agent.wait_for_event("apply-finished")
        assert (finished["generation"], finished["status"]) == (generation, "successful")
        assert agent.signal_and_wait(number) == status

    stopping, stopped = _stop_events(agent)
    assert stopping["signal"] == stopped["signal"] == number.name
    assert stopped["exit_status"] == status
    assert StateStore(node.state_dir).load().generation == generation
    assert _oplog_results(node) == ["started", "successful"]


def test_sigterm_mid_apply_abandons_it_and_the_next_start_resumes_it(
    server: DevServer, tmp_path: Path, node_id: str
) -> None:
    node = make_node(server, tmp_path / "n", node_id)
    generation = publish(server, node.node_id)
    gate, env = _gate(tmp_path)
    with running_agent(node.config_path, tmp_path / "agent.log", env=env) as agent:
        agent.wait_for("the playbook's start", Path(f"{gate}.reached").exists)
        assert _oplog_results(node) == ["started"]
        assert agent.signal_and_wait(signal.SIGTERM) == 0

    stopping, _ = _stop_events(agent)
    assert stopping["during"] == "apply"
    abandoned = [e for e in agent.events() if e["event"] == "apply-abandoned"]
    assert [e["generation"] for e in abandoned] == [generation]
    # Left as a crash leaves it: started and never finished, the generation accepted and not recorded applied.
    assert _oplog_results(node) == ["started"]
    assert StateStore(node.state_dir).load().generation != generation

    restarted = _run_once(node.config_path)
    assert restarted.returncode == 0, restarted.stderr
    assert '"resuming-interrupted-apply"' in restarted.stderr
    assert _oplog_results(node) == ["started", "interrupted", "started", "successful"]
    assert StateStore(node.state_dir).load().generation == generation


def test_sigterm_in_a_long_poll_stops_without_waiting_it_out(server: DevServer, tmp_path: Path, node_id: str) -> None:
    # observe-only: the first cycle verifies the state, the second long-polls with its ETag for 30 s.
    node = make_node(server, tmp_path / "n", node_id, mode="observe-only")
    node.configure(control_plane={"url": server.base_url, "long_poll_seconds": 30, "heartbeat_seconds": 30})
    publish(server, node.node_id)
    with running_agent(node.config_path, tmp_path / "agent.log") as agent:
        agent.wait_for_event("desired-state-verified-not-applied")
        agent.wait_for("its first status", (node.state_dir / "status.json").exists)
        time.sleep(1)  # into the next cycle's long-poll, which lasts 30 s
        assert agent.signal_and_wait(signal.SIGTERM) == 0

    stopping, stopped = _stop_events(agent)
    assert (stopping["signal"], stopping["during"]) == ("SIGTERM", "control-plane-call")
    assert stopped["exit_status"] == 0
    assert not [e for e in agent.events() if e["event"] == "control-plane-unavailable"]


def test_sigterm_in_a_backoff_stops_without_sleeping_it_out(server: DevServer, tmp_path: Path, node_id: str) -> None:
    node = make_node(server, tmp_path / "n", node_id)
    # Nothing listens on port 9 of this host: each cycle fails at once and backs off for a minute.
    node.configure(
        control_plane={"url": "https://127.0.0.1:9", "long_poll_seconds": 0, "heartbeat_seconds": 1},
        backoff={"initial_seconds": 120.0, "max_seconds": 240.0},
    )
    with running_agent(node.config_path, tmp_path / "agent.log") as agent:
        agent.wait_for_event("backing-off")
        assert agent.signal_and_wait(signal.SIGTERM) == 0

    stopping, _ = _stop_events(agent)
    assert (stopping["signal"], stopping["during"]) == ("SIGTERM", "backoff")


def test_sigterm_while_waiting_on_root_leaves_the_request_for_root(
    server: DevServer, tmp_path: Path, node_id: str
) -> None:
    # Under the split the agent waits on root's answer; no root unit runs yet, so the wait would last 300 s.
    node = make_node(server, tmp_path / "n", node_id)
    node.configure(apply={"via": "systemd", "timeout_seconds": 300, "state_dir": str(tmp_path / "node-apply")})
    generation = publish(server, node.node_id)
    request = node.state_dir / SPOOL_DIR / REQUEST_FILE
    with running_agent(node.config_path, tmp_path / "agent.log") as agent:
        agent.wait_for("its apply request", request.exists)
        assert agent.signal_and_wait(signal.SIGTERM) == 0

    stopping, _ = _stop_events(agent)
    assert stopping["during"] == "apply"
    assert [e["generation"] for e in agent.events() if e["event"] == "apply-abandoned"] == [generation]
    # The request stays for root's unit, and the agent's oplog keeps the operation open for the next start.
    assert request.exists()
    assert _oplog_results(node) == ["started"]

    with PathUnit(node.config_path, node.state_dir) as unit:
        restarted = _run_once(node.config_path)
    assert restarted.returncode == 0, (restarted.stderr, [r.stdout + r.stderr for r in unit.runs])
    assert '"resuming-interrupted-apply"' in restarted.stderr
    assert _oplog_results(node) == ["started", "interrupted", "started", "successful"]
    assert StateStore(node.state_dir).load().generation == generation


def _air_gapped(tmp_path: Path) -> AirGapNode:
    node = make_airgap_node(tmp_path / "node")
    document = yaml.safe_load(node.config_path.read_text())
    document["log"] = {"format": "json", "level": "info"}
    document["air_gap"]["poll_seconds"] = 60
    node.config_path.write_text(yaml.safe_dump(document))
    return node


def test_sigterm_while_an_air_gapped_agent_waits_on_its_inbox(tmp_path: Path) -> None:
    node = _air_gapped(tmp_path)
    with running_agent(node.config_path, tmp_path / "agent.log") as agent:
        agent.wait_for("its first status", (node.state_dir / "status.json").exists)
        assert agent.signal_and_wait(signal.SIGTERM) == 0

    stopping, stopped = _stop_events(agent)
    assert (stopping["signal"], stopped["exit_status"]) == ("SIGTERM", 0)


def test_sigint_mid_bundle_leaves_the_bundle_in_the_inbox_for_the_next_start(tmp_path: Path) -> None:
    node = _air_gapped(tmp_path)
    shutil.copyfile(state_bundle(node, "g1.tar", generation=1), node.inbox / "g1.tar")
    gate, env = _gate(tmp_path)
    with running_agent(node.config_path, tmp_path / "agent.log", env=env) as agent:
        agent.wait_for("the playbook's start", Path(f"{gate}.reached").exists)
        assert agent.signal_and_wait(signal.SIGINT) == 130

    stopping, _ = _stop_events(agent)
    assert (stopping["signal"], stopping["during"]) == ("SIGINT", "apply")
    # Not filed as failed: still in the inbox, its operation left started, as a crash leaves it.
    assert (node.inbox / "g1.tar").exists()
    assert node.filed("processed") == node.filed("rejected") == {}
    oplog = OpLog(node.state_dir / "oplog.jsonl")
    assert [entry.result for entry in oplog.read()] == ["started"]

    restarted = _run_once(node.config_path)

    assert restarted.returncode == 0, restarted.stderr
    assert '"interrupted-apply-closed"' in restarted.stderr
    assert node.filed("processed")["g1.tar"]["result"] == "applied"
    assert [entry.result for entry in oplog.read()] == ["started", "interrupted", "started", "successful"]
