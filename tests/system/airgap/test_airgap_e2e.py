"""A whole air-gapped cycle on the real Docker Engine (issue 15, "done when").

The control plane (a devserver data dir) publishes a desired state with a stand-in vLLM engine and a small
artifact and pins the site's own playbooks and collection; make-bundle's code wraps the state, the signed
artifact and that code into a bundle; the bundle is copied into the node's inbox; ``meridian-node run --once``
(its own process) takes it, stages the artifact, runs the bundle's playbook (which ends with a role from the
bundle's collection) and the engine serves. The outbox then holds a signed journal summary and observation, and
``meridian-node-devserver import-outbox`` makes the control plane's serving projection list the engine.
"""

from __future__ import annotations

import base64
import hashlib
import json
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

from ansible_collections.meridian.node.tests.devserver.devserver_process import cli as devserver
from ansible_collections.meridian.node.tests.support.airgap_env import galaxy_collection, make_airgap_node, state_bundle
from ansible_collections.meridian.node.tests.support.bundle_fixtures import ARTIFACT
from ansible_collections.meridian.node.tests.support.e2e_env import BIND, engine_spec, free_engine_port, standin_policy
from ansible_collections.meridian.node.tests.support.standin_image import LocalImage
from ansible_collections.meridian.node.tests.support.trust_fixtures import artifact_manifest, envelope
from meridian_node_agent.apply.applier import collection_paths
from meridian_node_agent.cli.bundle import shipped_code_pin
from meridian_node_agent.devserver.control.plane import open_control_plane

NODE = "airgap-e2e-node"
WEIGHTS = b"tiny weights\n" * 512


def _agent(*args: str) -> subprocess.CompletedProcess[str]:
    script = Path(sys.executable).parent / "meridian-node"
    command = [str(script)] if script.exists() else [sys.executable, "-m", "meridian_node_agent.cli"]
    return subprocess.run([*command, *args], capture_output=True, text=True, timeout=300, check=False)


def _site_collection(root: Path) -> Path:
    """A real collection tarball with one role the playbook ends with."""
    marker = (
        "- name: Leave a mark that the bundle's own playbook and collection ran\n"
        "  ansible.builtin.copy:\n"
        '    content: "{{ meridian_bundle_dir }}\\n"\n'
        '    dest: "{{ meridian_state_dir }}/site-marker"\n'
        "    mode: '0600'\n"
    )
    return galaxy_collection(root, "meridian_site", "extras", {"roles/marker/tasks/main.yml": marker})


def _site_playbooks(root: Path) -> Path:
    """The collection's own playbooks, with a play appended that uses the site collection's role."""
    playbooks = root / "site-playbooks"
    shutil.copytree(collection_paths()[1], playbooks)
    with (playbooks / "reconcile.yml").open("a") as handle:
        handle.write(
            "\n- name: Site additions from the bundle\n  hosts: all\n  gather_facts: false\n"
            "  roles:\n    - meridian_site.extras.marker\n"
        )
    return playbooks


def test_a_bundle_in_the_inbox_ends_with_the_engine_serving_on_the_control_plane(
    tmp_path: Path, image: LocalImage, prefix: str
) -> None:
    data = tmp_path / "control-plane"
    devserver(data, "info")  # creates the data dir, its CA and control key
    control = open_control_plane(data)
    control_key = control.paths.control_public_key
    control.close()
    node = make_airgap_node(
        tmp_path / "node",
        node_id=NODE,
        control_public_key=control_key,
        policy_extra=standin_policy(),
    )
    model = tmp_path / "model"
    model.mkdir()
    (model / "weights.bin").write_bytes(WEIGHTS)
    manifest = artifact_manifest(
        name="tiny-model",
        version="1.0.0",
        files=[{"path": "weights.bin", "size": len(WEIGHTS), "sha256": hashlib.sha256(WEIGHTS).hexdigest()}],
    )
    manifest_envelope = envelope("artifact-manifest", manifest, [ARTIFACT])
    (tmp_path / "manifest.json").write_text(json.dumps(manifest_envelope))
    port = free_engine_port()
    name = f"{prefix}-chat"
    # The site's code runs because control pins it in the state it signs (issue 22): runbook-pin's digests.
    playbooks, collection = _site_playbooks(tmp_path), _site_collection(tmp_path)
    desired = tmp_path / "desired.yaml"
    desired.write_text(
        json.dumps(
            {
                "artifacts": [{"name": "tiny-model", "version": "1.0.0", "manifest": manifest_envelope}],
                "engines": [engine_spec(name, image, port)],
                "runbook": shipped_code_pin(playbooks, collection),
            }
        )
    )
    devserver(data, "publish", NODE, str(desired))
    control = open_control_plane(data)
    published = control.desired_state(NODE)
    control.close()
    assert published is not None
    bundle = state_bundle(
        node,
        "site-g1.tar",
        generation=published.generation,
        desired_envelope=json.loads(published.envelope),
        artifacts=[(tmp_path / "manifest.json", model)],
        playbooks=playbooks,
        collection=collection,
    )
    shutil.copyfile(bundle, node.inbox / ".site-g1.tar.part")
    (node.inbox / ".site-g1.tar.part").rename(node.inbox / "site-g1.tar")

    check = _agent("--config", str(node.config_path), "check-config")
    assert check.returncode == 0, check.stderr
    run = _agent("--config", str(node.config_path), "run", "--once")
    assert run.returncode == 0, (run.stdout, run.stderr)

    reason = json.loads((node.inbox / "processed" / "site-g1.tar.reason.json").read_text())
    assert reason["result"] == "applied", reason
    assert (node.state_dir / "site-marker").read_text().strip().endswith("/tree")  # the bundle's own role ran
    store = tmp_path / "node" / "store" / "artifacts" / "tiny-model" / "1.0.0" / "weights.bin"
    assert store.read_bytes() == WEIGHTS
    with urllib.request.urlopen(f"http://{BIND}:{port}/v1/models", timeout=10) as response:
        assert response.status == 200
    records = sorted(p.name for p in node.outbox.iterdir())
    assert records == [f"{NODE}-000000000001-journal.json", f"{NODE}-000000000002-observation.json"], run.stderr

    key = tmp_path / "node.pub.pem"
    printed = _agent("--config", str(node.config_path), "outbox-key")
    key.write_text(printed.stdout)
    copied = tmp_path / "carried-off-site"
    shutil.copytree(node.outbox, copied)
    imported = devserver(data, "import-outbox", str(copied), "--node-key", f"{NODE}={key}")
    results = [json.loads(line) for line in imported.stdout.splitlines()]
    assert [r["result"] for r in results] == ["imported", "imported"], results

    control = open_control_plane(data)
    try:
        # The Docker Engine is shared: the node also observes (and so serves) other suites' engines.
        endpoints = [e for e in control.serving().endpoints if e.node_id == NODE and e.engine.startswith(prefix)]
    finally:
        control.close()
    observed = json.loads(base64.b64decode(json.loads((copied / records[1]).read_text())["payload"]))
    assert [(e.engine, e.address) for e in endpoints] == [(name, f"{NODE}:{port}")], observed["observation"]
