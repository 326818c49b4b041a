"""``meridian-node enroll | run --once | status`` as an operator runs them: separate processes, a real
devserver, real ansible-runner. The structured log is read back as JSON lines."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from ansible_collections.meridian.node.plugins.module_utils.trust.applied_state import StateStore
from ansible_collections.meridian.node.tests.devserver.devserver_process import DevServer
from ansible_collections.meridian.node.tests.support.node_env import Node, make_node, publish


def agent_cli(node: Node, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    script = Path(sys.executable).parent / "meridian-node"
    command = [str(script)] if script.exists() else [sys.executable, "-m", "meridian_node_agent.cli"]
    return subprocess.run(
        [*command, "--config", str(node.config_path), *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, **(env or {})},
    )


def _events(stderr: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]


@pytest.mark.parametrize("verb", ["enroll", "run", "status"])
def test_each_verb_has_help(server: DevServer, tmp_path: Path, verb: str) -> None:
    node = make_node(server, tmp_path / "n", f"help-{verb}", enroll=False)
    result = agent_cli(node, verb, "--help")
    assert result.returncode == 0
    assert f"usage: meridian-node {verb}" in result.stdout


def test_enroll_then_run_once_applies_and_a_second_run_changes_nothing(server: DevServer, tmp_path: Path) -> None:
    node = make_node(server, tmp_path / "n", "verbs-node-1", enroll=False)
    token = server.new_token("verbs-node-1")

    enrolled = agent_cli(node, "enroll", "--ca-bundle", str(server.ca_bundle), env={"MERIDIAN_NODE_TOKEN": token})
    assert enrolled.returncode == 0, enrolled.stderr
    assert "enrolled node verbs-node-1" in enrolled.stdout
    assert (node.config.identity_dir / "node.pem").exists()

    generation = publish(server, node.node_id)
    first = agent_cli(node, "run", "--once")
    assert first.returncode == 0, first.stderr
    finished = [e for e in _events(first.stderr) if e["event"] == "apply-finished"]
    assert [(e["generation"], e["status"]) for e in finished] == [(generation, "successful")]
    runs = node.journal_runs()
    assert len(runs) == 1
    assert StateStore(node.state_dir).load().generation == generation

    second = agent_cli(node, "run", "--once")
    assert second.returncode == 0, second.stderr
    assert not [e for e in _events(second.stderr) if e["event"].startswith("apply-")]
    assert node.journal_runs() == runs

    status = agent_cli(node, "status")
    assert status.returncode == 0, status.stderr
    table = dict(line.split("  ", 1) for line in status.stdout.splitlines())
    table = {name.strip(): value.strip() for name, value in table.items()}
    assert table["node"] == "verbs-node-1"
    assert table["mode"] == "managed-host"
    assert table["applied generation"].startswith(f"{generation} ")
    assert table["last run"].startswith(f"{runs[0]} successful")
    assert table["lease epoch"] == "1"


def test_reused_token_is_refused_with_a_message_and_no_identity(server: DevServer, tmp_path: Path) -> None:
    token = server.new_token("verbs-reuse")
    first = make_node(server, tmp_path / "a", "verbs-reuse-a", enroll=False)
    second = make_node(server, tmp_path / "b", "verbs-reuse-b", enroll=False)
    assert agent_cli(first, "enroll", "--token", token, "--ca-bundle", str(server.ca_bundle)).returncode == 0

    refused = agent_cli(second, "enroll", "--token", token, "--ca-bundle", str(server.ca_bundle))

    assert refused.returncode == 1
    assert "enrollment of node verbs-reuse-b failed" in refused.stderr
    assert not (second.config.identity_dir / "node.pem").exists()


def test_run_refuses_a_mode_the_policy_does_not_allow(server: DevServer, tmp_path: Path) -> None:
    node = make_node(server, tmp_path / "n", "verbs-mode-1")
    policy = node.root / "policy.yaml"
    policy.write_text(policy.read_text().replace("- managed-host\n", ""))

    result = agent_cli(node, "run", "--once")

    assert result.returncode == 2
    assert "agent mode 'managed-host' is not allowed by policy" in result.stderr
    assert node.journal_runs() == []


def test_run_without_enrollment_says_how_to_enroll(server: DevServer, tmp_path: Path) -> None:
    node = make_node(server, tmp_path / "n", "verbs-unenrolled", enroll=False)
    result = agent_cli(node, "run", "--once")
    assert result.returncode == 2
    assert "meridian-node enroll" in result.stderr


def test_agent_sigkilled_mid_apply_reapplies_at_restart(server: DevServer, tmp_path: Path) -> None:
    node = make_node(server, tmp_path / "n", "verbs-killed-1")
    generation = publish(server, node.node_id)
    script = Path(sys.executable).parent / "meridian-node"
    command = [str(script)] if script.exists() else [sys.executable, "-m", "meridian_node_agent.cli"]
    oplog = node.state_dir / "oplog.jsonl"
    # Its own session, so the kill takes ansible-playbook down with the agent, as a power cut would.
    process = subprocess.Popen(
        [*command, "--config", str(node.config_path), "run", "--once"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not (oplog.exists() and '"started"' in oplog.read_text()):
            assert process.poll() is None, "the agent exited before it started applying"
            if time.monotonic() > deadline:  # a liveness limit, not a speed target
                pytest.fail("the agent never started applying")
            time.sleep(0.02)
        os.killpg(process.pid, signal.SIGKILL)
    finally:
        process.wait(timeout=30)
    assert [json.loads(line)["result"] for line in oplog.read_text().splitlines()] == ["started"]

    restarted = agent_cli(node, "run", "--once")

    assert restarted.returncode == 0, restarted.stderr
    assert any(e["event"] == "resuming-interrupted-apply" for e in _events(restarted.stderr))
    results = [json.loads(line)["result"] for line in oplog.read_text().splitlines()]
    assert results == ["started", "interrupted", "started", "successful"]
    assert StateStore(node.state_dir).load().generation == generation
