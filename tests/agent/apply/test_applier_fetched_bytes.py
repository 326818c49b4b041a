"""The bytes a reconcile run brought into the artifact store, as the apply's result says them (the agent's
meridian_node_artifact_fetched_bytes_total): real ansible-runner runs of playbooks/reconcile.yml with an artifact
from a local source, and the answer that carries them across the privilege split."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from ansible_collections.meridian.node.tests.support.trust_fixtures import (
    NODE_ID,
    current_state,
    encode,
    local_artifact,
    make_key,
    signed,
    write_policy,
)
from meridian_node_agent.apply.applier import Applier
from meridian_node_agent.boundary.spool import ApplyAnswer

CONTROL = make_key()
ARTIFACT = make_key()
WEIGHTS = b"tiny weights\n" * 700


@pytest.fixture
def policy(tmp_path: Path) -> Path:
    store = {"path": str(tmp_path / "store"), "max_bytes": "1G", "local_sources": [str(tmp_path / "models")]}
    return write_policy(tmp_path / "etc", control=[CONTROL], artifact=[ARTIFACT], extra={"store": store})


def test_an_apply_counts_the_artifact_bytes_it_fetched_once_and_a_rerun_none(tmp_path: Path, policy: Path) -> None:
    ref = local_artifact(tmp_path / "models" / "tiny-model", WEIGHTS, ARTIFACT)
    applier = Applier(state_dir=tmp_path / "state", node_id=NODE_ID, policy_path=str(policy))
    results = []
    for generation in (1, 2):  # the second state lists the same artifact, already in the store
        payload = current_state(generation, artifacts=[ref])
        envelope = signed("desired-state", payload, [CONTROL])
        digest = hashlib.sha256(encode(payload)).hexdigest()
        results.append(applier.apply(envelope, generation=generation, epoch=1, payload_sha256=digest))

    assert [result.status for result in results] == ["successful", "successful"], [r.failures for r in results]
    assert [result.fetched_bytes for result in results] == [len(WEIGHTS), 0]
    # Under the split the agent learns it from root's answer.
    answer = ApplyAnswer.from_result(results[0], "0" * 64, 1)
    assert answer.to_result().fetched_bytes == len(WEIGHTS)
