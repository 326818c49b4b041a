"""``playbooks/airgap_apply.yml`` on a host without the agent: real ansible-runner runs of the playbook, with
the ``airgap_bundle`` module reading real bundles, staging a real artifact and reconcile.yml recording it."""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from ansible_collections.meridian.node.plugins.module_utils.trust.applied_state import StateStore
from ansible_collections.meridian.node.tests.support.airgap_env import AirGapNode, make_airgap_node, state_bundle
from ansible_collections.meridian.node.tests.support.bundle_fixtures import ARTIFACT
from ansible_collections.meridian.node.tests.support.trust_fixtures import artifact_manifest, envelope
from meridian_node_agent.apply.applier import collection_paths

WEIGHTS = b"air-gapped weights\n" * 256


def _play(
    node: AirGapNode, bundle: Path, *, check: bool = False, changed: list[str] | None = None
) -> tuple[str, list[dict[str, Any]]]:
    """Run airgap_apply.yml once; (status, the failed task results). ``changed`` gets the changed tasks' names."""
    import ansible_runner

    collections, playbooks = collection_paths()
    failures: list[dict[str, Any]] = []

    def handler(event: dict[str, Any]) -> bool:
        if event.get("event") == "runner_on_failed":
            failures.append(event["event_data"]["res"])
        if changed is not None and event.get("event") == "runner_on_ok" and event["event_data"]["res"].get("changed"):
            changed.append(event["event_data"]["task"])
        return True

    runner = ansible_runner.run(
        # A new private_data_dir per run: ansible-runner reuses env/extravars written by an earlier one.
        private_data_dir=tempfile.mkdtemp(prefix="runner-", dir=node.root),
        project_dir=str(playbooks),
        playbook="airgap_apply.yml",
        inventory={
            "all": {
                "hosts": {"localhost": {"ansible_connection": "local", "ansible_python_interpreter": sys.executable}}
            }
        },
        extravars={
            "meridian_bundle": str(bundle),
            "meridian_node_id": node.node_id,
            "meridian_policy": node.config.policy,
            "meridian_state_dir": str(node.state_dir),
        },
        envvars={
            "ANSIBLE_COLLECTIONS_PATH": str(collections),
            "ANSIBLE_NOCOLOR": "1",
            "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", os.defpath)]),
        },
        cmdline="--check" if check else None,
        event_handler=handler,
        quiet=True,
        suppress_env_files=True,
    )
    if runner.status != "successful" and not failures:
        # No task failed, yet the run did (CI saw it once, under load): what ansible-playbook printed says why.
        raise AssertionError(
            f"the run {runner.status} (rc {runner.rc}) with no task failed:\n{runner.stdout.read()[-4000:]}"
        )
    return str(runner.status), failures


def _artifact_bundle(node: AirGapNode, name: str, generation: int) -> Path:
    model = node.root / "model"
    model.mkdir(exist_ok=True)
    (model / "weights.bin").write_bytes(WEIGHTS)
    manifest = artifact_manifest(
        files=[{"path": "weights.bin", "size": len(WEIGHTS), "sha256": hashlib.sha256(WEIGHTS).hexdigest()}]
    )
    manifest_envelope = envelope("artifact-manifest", manifest, [ARTIFACT])
    (node.root / "manifest.json").write_text(json.dumps(manifest_envelope))
    return state_bundle(
        node,
        name,
        generation=generation,
        desired={"artifacts": [{"name": "tiny-model", "version": "1.0.0", "manifest": manifest_envelope}]},
        artifacts=[(node.root / "manifest.json", model)],
    )


def test_airgap_apply_stages_the_artifact_records_the_generation_and_cleans_scratch(tmp_path: Path) -> None:
    node = make_airgap_node(tmp_path)
    node.state_dir.mkdir()
    bundle = _artifact_bundle(node, "g1.tar", 1)

    status, failures = _play(node, bundle, check=True)
    assert (status, failures) == ("successful", [])
    assert StateStore(node.state_dir).load().generation == 0  # check mode: verified, nothing written
    assert not (tmp_path / "store").exists()

    status, failures = _play(node, bundle)
    assert (status, failures) == ("successful", [])
    assert StateStore(node.state_dir).load().generation == 1
    assert (tmp_path / "store" / "artifacts" / "tiny-model" / "1.0.0" / "weights.bin").read_bytes() == WEIGHTS
    assert os.listdir(tmp_path / "scratch") == []

    status, failures = _play(node, bundle)  # the same generation again: a no-op
    assert (status, failures) == ("successful", [])
    assert StateStore(node.state_dir).load().generation == 1


def test_airgap_apply_refuses_an_older_generation_and_a_tampered_bundle(tmp_path: Path) -> None:
    node = make_airgap_node(tmp_path)
    node.state_dir.mkdir()
    older, newer = _artifact_bundle(node, "g1.tar", 1), _artifact_bundle(node, "g2.tar", 2)
    assert _play(node, newer)[0] == "successful"

    status, [failure] = _play(node, older)
    assert (status, failure["reason"]) == ("failed", "replayed")
    data = bytearray(newer.read_bytes())
    offset = bytes(data).index(b"air-gapped weights")
    data[offset] ^= 0x01
    tampered = node.bundles / "tampered.tar"
    tampered.write_bytes(bytes(data))
    status, failures = _play(node, tampered)

    assert len(failures) == 1, f"the tampered bundle: the run {status}, failures {failures}"
    failure = failures[0]
    assert (status, failure["reason"]) == ("failed", "digest-mismatch")
    assert "weights.bin" in failure["msg"]
    assert StateStore(node.state_dir).load().generation == 2
    assert os.listdir(tmp_path / "scratch") == []


def test_airgap_apply_check_mode_fails_as_the_run_would_on_a_scratch_dir_it_cannot_make(tmp_path: Path) -> None:
    # issue 25: --check passed, then the real run failed making air_gap.scratch_dir (its parent is missing).
    scratch = tmp_path / "missing-parent" / "scratch"
    node = make_airgap_node(tmp_path, policy_extra={"air_gap": {"scratch_dir": str(scratch)}})
    node.state_dir.mkdir()
    bundle = _artifact_bundle(node, "g1.tar", 1)

    checked, [check_failure] = _play(node, bundle, check=True)
    ran, [run_failure] = _play(node, bundle)

    assert (checked, ran) == ("failed", "failed")
    assert check_failure["reason"] == run_failure["reason"] == "scratch-unusable"
    for failure in (check_failure, run_failure):
        assert f"air_gap.scratch_dir {scratch}: creating it failed" in failure["msg"]
        assert f"({scratch.parent}) must exist" in failure["msg"]
    assert StateStore(node.state_dir).load().generation == 0
    assert not scratch.parent.exists()

    scratch.parent.mkdir()  # the fix the message names: check mode and the run now agree it works
    assert _play(node, bundle, check=True) == ("successful", [])
    assert _play(node, bundle) == ("successful", [])
    assert StateStore(node.state_dir).load().generation == 1


def test_airgap_apply_rerun_of_the_applied_bundle_changes_nothing(tmp_path: Path) -> None:
    node = make_airgap_node(tmp_path)
    node.state_dir.mkdir()
    bundle = _artifact_bundle(node, "g1.tar", 1)
    first: list[str] = []
    assert _play(node, bundle, changed=first) == ("successful", [])
    assert first  # the first run did apply

    again: list[str] = []
    assert _play(node, bundle, changed=again) == ("successful", [])
    checked: list[str] = []
    assert _play(node, bundle, check=True, changed=checked) == ("successful", [])

    # The rerun unpacks into scratch to verify and removes that again: nothing on the host changed.
    assert (again, checked) == ([], [])
    assert os.listdir(tmp_path / "scratch") == []
