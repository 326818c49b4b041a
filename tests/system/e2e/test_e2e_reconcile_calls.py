"""What a reconcile run through the agent costs and what it leaves behind, end to end: the devserver process (real
mutual TLS, real signing), the agent's cycle, real ansible-runner runs of playbooks/reconcile.yml, the real Docker
Engine and the stand-in vLLM image.

- An engine's secret_env value (a token) reaches the engine's container and nothing the agent keeps:
  not the ansible-runner journal, not the oplog, the status file, the spool's neighbours, the agent's log or the
  observation it reports. The applier scrubs such values out of the journal after a run, a second line of
  defence; the test withholds them from that scrub, so what it checks is that the run never wrote them.
- A state without artifacts costs one module call (the whole engine set, which verifies the envelope itself),
  however many engines it lists or drops; one with an artifact three (verify, the artifact, the engine set); an
  unchanged, drift-free cycle runs no playbook at all.
"""

from __future__ import annotations

import json
import logging
import secrets
from pathlib import Path
from typing import Any

import pytest
import yaml

from ansible_collections.meridian.node.tests.devserver.devserver_process import DevServer
from ansible_collections.meridian.node.tests.support.e2e_env import (
    E2ENode,
    container_named,
    engine_spec,
    free_engine_port,
    last_observation,
)
from ansible_collections.meridian.node.tests.support.node_env import publish
from ansible_collections.meridian.node.tests.support.standin_image import LocalImage
from ansible_collections.meridian.node.tests.support.trust_fixtures import (
    local_artifact,
    make_key,
)
from meridian_node_agent.agent_side.cycle import Agent, CycleStatus
from meridian_node_agent.apply.applier import ApplyResult

pytestmark = [pytest.mark.docker, pytest.mark.slow]

COLLECTION = "meridian.node."


def _run_once(agent: Agent) -> ApplyResult:
    """One cycle the way ``meridian-node run --once`` runs it (it also writes the status file)."""
    assert agent.run(once=True) == 0, agent.last_run and agent.last_run.failures
    assert agent.last_run is not None and agent.last_run.ok, agent.last_run
    return agent.last_run


def _events(journal: Path) -> list[dict[str, Any]]:
    events = [json.loads(path.read_text()) for path in (journal / "job_events").glob("*.json")]
    return sorted(events, key=lambda event: int(event["counter"]))


def _module_calls(journal: Path) -> list[str]:
    """The collection's modules one run invoked, one entry per invocation (a loop task once per item), in order.

    Ansible's own control tasks (set_fact, import_tasks, ...) are not module calls on the host and not counted;
    a task whose loop had no items, or whose condition was false, invoked nothing.
    """
    calls = []
    for event in _events(journal):
        data = event.get("event_data") or {}
        action = str(data.get("resolved_action") or data.get("task_action") or "")
        if not action.startswith(COLLECTION):
            continue
        result = data.get("res") or {}
        looped = "results" in result
        if event["event"] in ("runner_item_on_ok", "runner_item_on_failed") or (
            event["event"] in ("runner_on_ok", "runner_on_failed") and not looped
        ):
            calls.append(action)
    return calls


def _skipped(journal: Path) -> list[str]:
    return [
        str(event["event_data"]["task_action"]) for event in _events(journal) if event["event"] == "runner_on_skipped"
    ]


def _files_holding(root: Path, needle: bytes) -> list[str]:
    return sorted(
        str(path.relative_to(root)) for path in root.rglob("*") if path.is_file() and needle in path.read_bytes()
    )


def test_engine_secret_reaches_the_container_and_never_the_journal_oplog_status_or_observation(
    server: DevServer,
    node_id: str,
    node: E2ENode,
    docker_client: Any,
    image: LocalImage,
    prefix: str,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    caplog.set_level(logging.DEBUG)
    token = f"hf_{secrets.token_urlsafe(24)}"
    name = f"{prefix}-chat"
    spec = engine_spec(name, image, free_engine_port(), env={"LOG_LEVEL": "info"}, secret_env={"HF_TOKEN": token})
    generation = publish(server, node_id, document={"engines": [spec]})
    agent = node.agent()
    apply = agent.applier.apply

    def apply_without_scrubbing_values(envelope: bytes, **options: Any) -> ApplyResult:
        assert token in options["secrets"]  # what the scrub would have been given
        return apply(envelope, **{**options, "secrets": ()})

    monkeypatch.setattr(agent.applier, "apply", apply_without_scrubbing_values)

    run = _run_once(agent)

    assert run.generation == generation
    container = container_named(docker_client, name)
    assert container is not None and container.status == "running"
    assert f"HF_TOKEN={token}" in container.attrs["Config"]["Env"]  # the value was used, not lost
    needle = token.encode()
    # Everything the agent keeps: the journal (events, stdout, command, status), oplog.jsonl, status.json, the
    # applied record and the engines' files. The spool holds the envelope itself, its payload base64-encoded.
    assert (node.state_dir / "journal" / run.ident / "job_events").is_dir()
    assert (node.state_dir / "status.json").is_file() and (node.state_dir / "oplog.jsonl").is_file()
    assert _files_holding(node.state_dir, needle) == []
    assert _files_holding(node.node.root, needle) == []  # policy, config, store, identity beside the state dir
    # The agent's events carry their fields beside the message.
    logged = [(record.getMessage(), repr(getattr(record, "fields", None))) for record in caplog.records]
    assert any(message == "apply-finished" for message, _fields in logged), logged
    assert [entry for entry in logged if token in repr(entry)] == []
    observed = last_observation(server, node_id)
    assert observed is not None and observed["applied_generation"] == generation
    assert token not in json.dumps(observed)
    # The variable's name may show (the diff lists secret_env by name); its value never does.
    assert token not in (run.journal / "stdout").read_text()


def test_engine_only_changes_run_one_module_call_and_an_unchanged_cycle_runs_no_playbook(
    server: DevServer, node_id: str, node: E2ENode, docker_client: Any, image: LocalImage, prefix: str
) -> None:
    a, b, c = f"{prefix}-a", f"{prefix}-b", f"{prefix}-c"
    port_a = free_engine_port()
    publish(server, node_id, document={"engines": [engine_spec(a, image, port_a)]})
    agent = node.agent()
    first = _run_once(agent)
    port_b = port_c = free_engine_port()  # not port_a: engine a publishes it
    while port_c == port_b:  # nothing binds port_b yet, so free_engine_port may offer it again
        port_c = free_engine_port()

    # A changes (replaced), b and c are new: three engines' worth of work.
    changed = [
        engine_spec(a, image, port_a, args=["--max-model-len", "8192"]),
        engine_spec(b, image, port_b),
        engine_spec(c, image, port_c),
    ]
    publish(server, node_id, document={"engines": changed})
    second = _run_once(agent)
    # B and c are dropped (pruned), a stays as it is.
    publish(server, node_id, document={"engines": [changed[0]]})
    third = _run_once(agent)

    expected = [f"{COLLECTION}engine_set"]
    assert [_module_calls(run.journal) for run in (first, second, third)] == [expected] * 3
    assert (second.changed, third.changed) == (1, 1)  # the one engine_set task, whatever it did
    assert {n: container_named(docker_client, n) is not None for n in (a, b, c)} == {a: True, b: False, c: False}
    # The state lists no artifacts: the verify and artifact tasks were skipped, not run.
    assert _skipped(third.journal) == [f"{COLLECTION}desired_state", f"{COLLECTION}verified_artifact"]

    runs, oplog = node.node.journal_runs(), node.node.oplog_lines()
    assert len(runs) == 3
    for _ in range(2):
        outcome = agent.cycle()
        assert (outcome.outcome, outcome.run) == (CycleStatus.UNCHANGED, None)
    assert (node.node.journal_runs(), node.node.oplog_lines()) == (runs, oplog)


def test_a_state_with_an_artifact_runs_verify_artifact_then_engine_set(
    server: DevServer, tmp_path: Path, node_id: str, node: E2ENode, docker_client: Any, image: LocalImage, prefix: str
) -> None:
    artifact_key = make_key()
    models = tmp_path / "models"
    policy_path = node.node.root / "policy.yaml"
    policy = yaml.safe_load(policy_path.read_text())
    (node.node.root / "keys" / "artifact.pem").write_bytes(artifact_key.public_pem)
    policy["trust"]["artifact"] = {"threshold": 1, "public_keys": ["keys/artifact.pem"]}
    policy["store"]["local_sources"] = [str(models)]
    policy_path.write_text(yaml.safe_dump(policy, sort_keys=False))
    weights = b"e2e weights\n" * 64
    artifact = local_artifact(models / "tiny-model", weights, artifact_key)
    name = f"{prefix}-with-model"
    publish(
        server, node_id, document={"artifacts": [artifact], "engines": [engine_spec(name, image, free_engine_port())]}
    )

    run = _run_once(node.agent())

    calls = ["desired_state", "verified_artifact", "engine_set"]
    assert _module_calls(run.journal) == [f"{COLLECTION}{call}" for call in calls]
    assert (node.node.root / "store" / "artifacts" / "tiny-model" / "1.0.0" / "weights.bin").read_bytes() == weights
    assert container_named(docker_client, name) is not None
