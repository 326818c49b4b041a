"""meridian.node.verified_artifact through ansible-playbook: check, apply, idempotent, idempotent-check.

One playbook run against localhost covers the four steps, diff output, an untrusted manifest (refused,
nothing changes) and state=absent; the registered results are written to a JSON report the test reads.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from ansible_collections.meridian.node.tests.support.http_fixture import ArtifactServer
from ansible_collections.meridian.node.tests.support.trust_fixtures import (
    artifact_manifest,
    make_key,
    signed,
    write_policy,
)

REPO = Path(__file__).resolve().parents[3]
VENV_BIN = REPO / ".venv" / "bin"
ARTIFACT = make_key()
CONTROL = make_key()
STRANGER = make_key()


@pytest.fixture
def server() -> Iterator[ArtifactServer]:
    instance = ArtifactServer().start()
    try:
        yield instance
    finally:
        instance.stop()


def step(name: str, register: str, args: dict[str, Any], check: bool = False) -> dict[str, Any]:
    task: dict[str, Any] = {
        "name": name,
        "meridian.node.verified_artifact": args,
        "register": register,
        "diff": True,
    }
    if check:
        task["check_mode"] = True
    return task


def test_module_check_apply_idempotent_and_refuses_an_untrusted_manifest(
    server: ArtifactServer, tmp_path: Path
) -> None:
    data = os.urandom(300_000)
    server.files["m/1.0/weights/w.bin"] = data
    files = [{"path": "weights/w.bin", "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}]
    payload = artifact_manifest(name="m", version="1.0", files=files)
    manifest = tmp_path / "manifest.json"
    manifest.write_bytes(signed("artifact-manifest", payload, [ARTIFACT]))
    forged = json.loads(
        signed("artifact-manifest", artifact_manifest(name="m", version="2.0", files=files), [STRANGER])
    )
    store = tmp_path / "store"
    policy = write_policy(
        tmp_path / "etc",
        control=[CONTROL],
        artifact=[ARTIFACT],
        extra={"store": {"path": str(store), "max_bytes": "1G"}},
    )
    common = {"manifest": str(manifest), "source": f"{server.url}/m/1.0", "policy": str(policy)}
    report = tmp_path / "report.json"
    tasks = [
        step("check", "check_1", common, check=True),
        step("apply", "apply_1", common),
        step("apply again", "apply_2", common),
        step("check again", "check_2", common, check=True),
        {
            "name": "the assembled file",
            "ansible.builtin.stat": {"path": "{{ apply_1.path }}/weights/w.bin", "checksum_algorithm": "sha256"},
            "register": "installed",
        },
        {**step("untrusted", "untrusted", {"manifest": forged, "policy": str(policy)}), "ignore_errors": True},
        step("absent", "absent", {"state": "absent", "manifest": str(manifest), "policy": str(policy)}),
        {
            "name": "report",
            "ansible.builtin.copy": {
                "dest": str(report),
                "content": "{{ {'check_1': check_1, 'apply_1': apply_1, 'apply_2': apply_2, 'check_2': check_2,"
                " 'installed': installed, 'untrusted': untrusted, 'absent': absent} | to_json }}",
            },
        },
    ]
    playbook = tmp_path / "play.yml"
    playbook.write_text(yaml.safe_dump([{"hosts": "localhost", "gather_facts": False, "tasks": tasks}]))
    inventory = tmp_path / "inventory.ini"
    inventory.write_text(f"localhost ansible_connection=local ansible_python_interpreter={VENV_BIN / 'python'}\n")
    env = {
        **os.environ,
        "ANSIBLE_COLLECTIONS_PATH": str(REPO / ".build" / "collections"),
        "ANSIBLE_NOCOLOR": "1",
        "ANSIBLE_DEPRECATION_WARNINGS": "0",
    }
    proc = subprocess.run(
        [str(VENV_BIN / "ansible-playbook"), "-i", str(inventory), str(playbook)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = json.loads(report.read_text())

    check_1 = results["check_1"]
    assert check_1["changed"] and check_1["current"] == "1.0"
    assert [f["path"] for f in check_1["plan"]["fetch"]] == ["weights/w.bin"]
    assert "current: (none)" in check_1["diff"]["before"] and "current: 1.0" in check_1["diff"]["after"]

    apply_1 = results["apply_1"]
    assert apply_1["changed"] and apply_1["fetched"][0]["size"] == len(data)
    assert apply_1["signers"] == [ARTIFACT.keyid]
    installed = results["installed"]["stat"]
    assert installed["checksum"] == files[0]["sha256"] and installed["nlink"] == 2  # a hard link to its blob

    assert not results["apply_2"]["changed"] and results["apply_2"]["fetched"] == []
    assert not results["check_2"]["changed"]

    untrusted = results["untrusted"]
    assert untrusted["failed"] and "threshold-not-met" in untrusted["msg"]
    assert not (store / "artifacts" / "m" / "2.0").exists()

    assert results["absent"]["changed"]
    assert not (store / "artifacts" / "m").exists()
    assert os.listdir(store / "blobs" / "sha256") == []
    assert len([r for r in server.requests if r.status == 200]) == 1
