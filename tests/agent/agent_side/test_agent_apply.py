"""The apply path on its own: real ansible-runner runs of playbooks/reconcile.yml, the host-side module,
the journal (rotation, scrubbing), the operation log and the artifact bytes a run fetched. No control plane
here: envelopes are signed with test keys, and the playbook's own verification is what is under test."""

from __future__ import annotations

import hashlib
import json
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from ansible_collections.meridian.node.plugins.module_utils.trust.applied_state import StateStore
from ansible_collections.meridian.node.plugins.module_utils.trust.desired_state import reconcile_desired_state
from ansible_collections.meridian.node.plugins.module_utils.trust.verify import Rejection, RejectionCode
from ansible_collections.meridian.node.tests.support.trust_fixtures import (
    NODE_ID,
    current_state,
    encode,
    local_artifact,
    make_key,
    signed,
    vllm_engine,
    write_policy,
)
from meridian_node_agent.apply.applier import SCRUBBED, Applier, scrub_journal
from meridian_node_agent.apply.oplog import OpLog
from meridian_node_agent.boundary.spool import ApplyAnswer

CONTROL = make_key()
STRANGER = make_key()
ARTIFACT = make_key()
WEIGHTS = b"tiny weights\n" * 64


def _sha(payload: dict[str, Any]) -> str:
    return hashlib.sha256(encode(payload)).hexdigest()


@pytest.fixture
def policy(tmp_path: Path) -> Path:
    store = {"path": str(tmp_path / "store"), "max_bytes": "1G", "local_sources": [str(tmp_path / "models")]}
    return write_policy(tmp_path / "etc", control=[CONTROL], artifact=[ARTIFACT], extra={"store": store})


def _with_artifact(tmp_path: Path, generation: int) -> dict[str, Any]:
    """A state listing one artifact (signed manifest, files in a local source directory) and no engines."""
    ref = local_artifact(tmp_path / "models" / "tiny-model", WEIGHTS, ARTIFACT)
    return current_state(generation, artifacts=[ref])


def _ran_and_skipped(journal: Path) -> tuple[list[str], list[str]]:
    """The collection's tasks that ran and those skipped, by module, in order."""
    events = sorted(
        (json.loads(path.read_text()) for path in (journal / "job_events").glob("*.json")),
        key=lambda event: int(event["counter"]),
    )
    ran, skipped = [], []
    for event in events:
        action = str((event.get("event_data") or {}).get("task_action", "")).removeprefix("meridian.node.")
        if event["event"] in ("runner_on_ok", "runner_on_failed"):
            ran.append(action)
        elif event["event"] == "runner_on_skipped":
            skipped.append(action)
    return ran, skipped


def _applier(tmp_path: Path, policy: Path, keep_runs: int = 20) -> Applier:
    return Applier(state_dir=tmp_path / "state", node_id=NODE_ID, policy_path=str(policy), keep_runs=keep_runs)


def _all_journal_bytes(journal: Path) -> bytes:
    return b"".join(path.read_bytes() for path in sorted(journal.rglob("*")) if path.is_file())


def test_reconcile_records_generation_keeps_a_scrubbed_journal_and_an_oplog(
    tmp_path: Path, policy: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MERIDIAN_NODE_TOKEN", "enroll-token-that-must-not-leak")
    applier = _applier(tmp_path, policy)
    payload = current_state(1)

    result = applier.apply(
        signed("desired-state", payload, [CONTROL]), generation=1, epoch=1, payload_sha256=_sha(payload)
    )

    assert result.status == "successful", result.failures
    assert (result.changed, result.failed) == (1, 0)
    assert result.ident.startswith("gen-1-")
    applied = StateStore(tmp_path / "state").load()
    assert (applied.generation, applied.epoch, applied.payload_sha256) == (1, 1, _sha(payload))
    assert (result.journal / "status").read_text() == "successful"
    assert (result.journal / "job_events").is_dir()
    command = json.loads((result.journal / "command").read_text())
    assert command["env"]["MERIDIAN_NODE_TOKEN"] == SCRUBBED
    assert b"enroll-token-that-must-not-leak" not in _all_journal_bytes(result.journal)
    # The run's private data dir held the envelope (engine env values inside); it is gone.
    assert list((tmp_path / "state" / "runs").iterdir()) == []
    entries = OpLog(tmp_path / "state" / "oplog.jsonl").read()
    assert [(e.run_ident, e.result, e.generation) for e in entries] == [
        (result.ident, "started", 1),
        (result.ident, "successful", 1),
    ]


def test_reapplying_the_applied_generation_changes_nothing_and_old_runs_rotate_out(
    tmp_path: Path, policy: Path
) -> None:
    applier = _applier(tmp_path, policy, keep_runs=2)
    first = current_state(1)
    envelope = signed("desired-state", first, [CONTROL])
    one = applier.apply(envelope, generation=1, epoch=1, payload_sha256=_sha(first))
    again = applier.apply(envelope, generation=1, epoch=1, payload_sha256=_sha(first))
    second = current_state(2)
    two = applier.apply(signed("desired-state", second, [CONTROL]), generation=2, epoch=1, payload_sha256=_sha(second))

    assert [r.status for r in (one, again, two)] == ["successful"] * 3
    assert (again.changed, two.changed) == (0, 1)
    assert StateStore(tmp_path / "state").load().generation == 2
    assert sorted(p.name for p in (tmp_path / "state" / "journal").iterdir()) == sorted([again.ident, two.ident])


def test_playbook_reverifies_and_refuses_an_expired_state_the_agent_let_through(tmp_path: Path, policy: Path) -> None:
    payload = current_state(3, valid_for=timedelta(seconds=-30))
    result = _applier(tmp_path, policy).apply(
        signed("desired-state", payload, [CONTROL]), generation=3, epoch=1, payload_sha256=_sha(payload)
    )

    assert result.status == "failed"
    assert result.failed == 1
    assert "expired" in result.failures[0]
    assert not (tmp_path / "state" / "applied.json").exists()
    assert [e.result for e in OpLog(tmp_path / "state" / "oplog.jsonl").read()] == ["started", "failed"]


def test_playbook_refuses_a_state_signed_by_an_untrusted_key(tmp_path: Path, policy: Path) -> None:
    payload = current_state(1)
    result = _applier(tmp_path, policy).apply(
        signed("desired-state", payload, [STRANGER]), generation=1, epoch=1, payload_sha256=_sha(payload)
    )

    assert result.status == "failed"
    assert "threshold-not-met" in result.failures[0]
    assert not (tmp_path / "state" / "applied.json").exists()


def test_an_agent_saying_no_artifacts_for_a_state_with_one_gets_a_failed_apply_that_changes_nothing(
    tmp_path: Path, policy: Path
) -> None:
    payload = _with_artifact(tmp_path, 1)
    envelope_bytes = signed("desired-state", payload, [CONTROL])
    applier = _applier(tmp_path, policy)

    lied = applier.apply(envelope_bytes, generation=1, epoch=1, payload_sha256=_sha(payload), lists_artifacts=False)

    assert lied.status == "failed"
    assert _ran_and_skipped(lied.journal) == (["engine_set"], ["desired_state", "verified_artifact"])
    [failure] = lied.failures
    assert "artifact 'tiny-model' version '1.0.0' is not in the store" in failure, failure
    assert "artifact step" in failure and "meridian_state_artifacts" in failure, failure
    assert not (tmp_path / "state" / "applied.json").exists()
    assert not (tmp_path / "store" / "artifacts").exists()

    # Told the truth, the same envelope runs the artifact step and applies.
    honest = applier.apply(envelope_bytes, generation=1, epoch=1, payload_sha256=_sha(payload))

    assert honest.status == "successful", honest.failures
    assert _ran_and_skipped(honest.journal) == (["desired_state", "verified_artifact", "engine_set"], [])
    assert (tmp_path / "store" / "artifacts" / "tiny-model" / "1.0.0" / "weights.bin").read_bytes() == WEIGHTS
    assert StateStore(tmp_path / "state").load().generation == 1


def test_an_apply_counts_the_artifact_bytes_it_fetched_once_and_a_rerun_none(tmp_path: Path, policy: Path) -> None:
    # The agent's meridian_node_artifact_fetched_bytes_total adds what the result says a run brought into the store.
    applier = _applier(tmp_path, policy)
    results = []
    for generation in (1, 2):  # the second state lists the same artifact, already in the store
        payload = _with_artifact(tmp_path, generation)
        envelope_bytes = signed("desired-state", payload, [CONTROL])
        results.append(applier.apply(envelope_bytes, generation=generation, epoch=1, payload_sha256=_sha(payload)))

    assert [result.status for result in results] == ["successful", "successful"], [r.failures for r in results]
    assert [result.fetched_bytes for result in results] == [len(WEIGHTS), 0]
    # Under the privilege split the agent learns it from root's answer.
    answer = ApplyAnswer.from_result(results[0], "0" * 64, 1)
    assert answer.to_result().fetched_bytes == len(WEIGHTS)


def test_a_state_without_artifacts_runs_only_the_engine_set_task(tmp_path: Path, policy: Path) -> None:
    payload = current_state(1)
    result = _applier(tmp_path, policy).apply(
        signed("desired-state", payload, [CONTROL]),
        generation=1,
        epoch=1,
        payload_sha256=_sha(payload),
        lists_artifacts=False,
    )

    assert result.status == "successful", result.failures
    assert _ran_and_skipped(result.journal) == (["engine_set"], ["desired_state", "verified_artifact"])
    assert StateStore(tmp_path / "state").load().generation == 1


# The module's core, without Ansible around it.


def test_record_is_idempotent_and_check_mode_records_nothing(tmp_path: Path, policy: Path) -> None:
    envelope = signed("desired-state", current_state(4), [CONTROL])
    common: dict[str, Any] = {"policy_path": str(policy), "node_id": NODE_ID, "state_dir": tmp_path / "s"}

    checked = reconcile_desired_state(envelope, record=True, check_mode=True, **common)
    assert checked.changed and not checked.result["recorded"]
    assert StateStore(tmp_path / "s").load().generation == 0

    recorded = reconcile_desired_state(envelope, record=True, check_mode=False, **common)
    assert recorded.changed and recorded.result["recorded"]
    repeated = reconcile_desired_state(envelope, record=True, check_mode=False, **common)
    assert not repeated.changed and repeated.result["already_applied"]
    assert StateStore(tmp_path / "s").load().generation == 4


def test_module_summary_shows_env_but_never_a_secret_env_value(tmp_path: Path, policy: Path) -> None:
    engine = vllm_engine(env={"VLLM_LOGGING_LEVEL": "1"}, secret_env={"HF_TOKEN": "hf-secret-value-123"})
    envelope = signed("desired-state", current_state(1, engines=[engine]), [CONTROL])
    common: dict[str, Any] = {"policy_path": str(policy), "node_id": NODE_ID, "state_dir": tmp_path / "s"}

    summary = reconcile_desired_state(envelope, record=False, check_mode=False, **common)
    with_secrets = reconcile_desired_state(envelope, record=False, check_mode=False, secrets=True, **common)

    assert "hf-secret-value-123" not in json.dumps(summary.result)
    assert summary.result["engines"][0]["env"] == {"VLLM_LOGGING_LEVEL": "1"}
    assert summary.result["engines"][0]["secret_env_keys"] == ["HF_TOKEN"]
    assert "engine_secret_env" not in summary.result
    assert with_secrets.result["engine_secret_env"] == {"chat": {"HF_TOKEN": "hf-secret-value-123"}}


def test_module_rejects_a_replayed_lower_generation(tmp_path: Path, policy: Path) -> None:
    common: dict[str, Any] = {"policy_path": str(policy), "node_id": NODE_ID, "state_dir": tmp_path / "s"}
    reconcile_desired_state(
        signed("desired-state", current_state(5), [CONTROL]), record=True, check_mode=False, **common
    )

    with pytest.raises(Rejection) as refused:
        reconcile_desired_state(
            signed("desired-state", current_state(4), [CONTROL]), record=True, check_mode=False, **common
        )
    assert refused.value.code == RejectionCode.REPLAYED
    assert StateStore(tmp_path / "s").load().generation == 5


# Journal scrubbing and the oplog.


def test_scrub_replaces_secret_environment_and_engine_values_in_every_artifact(tmp_path: Path) -> None:
    journal = tmp_path / "gen-1-x"
    (journal / "job_events").mkdir(parents=True)
    env = {"ANSIBLE_NOCOLOR": "1", "AWS_SECRET_ACCESS_KEY": "aws-secret", "ANSIBLE_VAULT_PASSWORD": "v", "HOME": "/h"}
    (journal / "command").write_text(json.dumps({"command": ["ansible-playbook"], "env": env}))
    (journal / "job_events" / "1-a.json").write_text('{"res": {"item": {"env": {"K": "engine-secret-1"}}}}')
    (journal / "stdout").write_text("line with engine-secret-1 and short 'abc'\n")

    scrub_journal(journal, ["engine-secret-1", "abc"])

    scrubbed_env = json.loads((journal / "command").read_text())["env"]
    assert scrubbed_env == {
        "ANSIBLE_NOCOLOR": "1",
        "AWS_SECRET_ACCESS_KEY": SCRUBBED,
        "ANSIBLE_VAULT_PASSWORD": SCRUBBED,
        "HOME": "/h",
    }
    everything = _all_journal_bytes(journal)
    assert b"engine-secret-1" not in everything
    assert b"aws-secret" not in everything
    assert b"'abc'" in everything  # too short to scrub by content without wrecking the journal


def test_oplog_finds_the_interrupted_operation_and_survives_a_torn_last_line(tmp_path: Path) -> None:
    oplog = OpLog(tmp_path / "oplog.jsonl")
    common: dict[str, Any] = {"op": "apply", "epoch": 1, "payload_sha256": "a" * 64}
    oplog.append(generation=1, run_ident="gen-1-a", result="started", **common)
    oplog.append(generation=1, run_ident="gen-1-a", result="successful", **common)
    assert oplog.pending() is None
    oplog.append(generation=2, run_ident="gen-2-b", result="started", **common)
    with (tmp_path / "oplog.jsonl").open("ab") as handle:
        handle.write(b'{"op":"apply","generation":2,"epo')  # the crash happened mid-write

    pending = oplog.pending()
    assert pending is not None
    assert (pending.run_ident, pending.generation) == ("gen-2-b", 2)
    assert len(oplog.read()) == 3
    oplog.append(generation=2, run_ident="gen-2-b", result="interrupted", **common)
    assert oplog.pending() is None
    assert [e.result for e in oplog.read()] == ["started", "successful", "started", "interrupted"]
