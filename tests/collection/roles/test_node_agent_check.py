"""roles/node_agent/files/node_agent_check.py: the checks the node_agent role's ``validate:`` and enrollment
decision run on the host, here run as the role runs them (a subprocess of the agent's Python)."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from ansible_collections.meridian.node.plugins.module_utils.trust import dsse
from ansible_collections.meridian.node.tests.support.http_fixture import write_self_signed

CHECK = Path(__file__).resolve().parents[3] / "roles" / "node_agent" / "files" / "node_agent_check.py"


def run_check(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(CHECK), *args], capture_output=True, text=True, check=False, timeout=60)


@pytest.fixture
def public_key(tmp_path: Path) -> Path:
    private, _keyid = dsse.generate_private_key_pem()
    path = tmp_path / "control.pem"
    path.write_bytes(dsse.public_key_pem(dsse.load_private_key_pem(private)))
    return path


def test_an_ed25519_public_key_passes(public_key: Path) -> None:
    result = run_check("key", str(public_key))
    assert (result.returncode, result.stderr) == (0, "")


def test_a_private_key_is_refused_as_one(tmp_path: Path) -> None:
    path = tmp_path / "leaked.pem"
    path.write_bytes(dsse.generate_private_key_pem()[0])
    result = run_check("key", str(path))
    assert result.returncode == 1
    assert result.stderr.startswith(f"error: trusted key {path}: this is a PRIVATE key"), result.stderr


def test_a_key_of_another_algorithm_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "p256.pem"
    path.write_bytes(
        ec.generate_private_key(ec.SECP256R1())
        .public_key()
        .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    result = run_check("key", str(path))
    assert result.returncode == 1 and "Ed25519 keys only" in result.stderr, result.stderr


def test_a_policy_loads_with_its_keys(tmp_path: Path, public_key: Path) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(yaml.safe_dump({"trust": {"control": {"threshold": 1, "public_keys": [str(public_key)]}}}))
    result = run_check("policy", str(policy))
    assert (result.returncode, result.stderr) == (0, "")


def test_a_policy_with_an_impossible_threshold_is_refused_naming_the_field(tmp_path: Path, public_key: Path) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(yaml.safe_dump({"trust": {"control": {"threshold": 2, "public_keys": [str(public_key)]}}}))
    result = run_check("policy", str(policy))
    assert result.returncode == 1
    assert result.stderr.startswith(f"error: policy {policy}: trust.control"), result.stderr


def _config(tmp_path: Path, node_id: str) -> Path:
    path = tmp_path / "config.yaml"
    config = {
        "node_id": node_id,
        "state_dir": str(tmp_path / "state"),
        "control_plane": {"url": "https://127.0.0.1:1"},
    }
    path.write_text(yaml.safe_dump(config))
    return path


def _identity(tmp_path: Path, node_id: str, *, not_after: datetime) -> None:
    """Key, certificate (SAN = node_id) and CA in <state>/identity, as enrollment leaves them."""
    directory = tmp_path / "state" / "identity"
    directory.mkdir(parents=True)
    node_cert = directory / "node.pem"
    write_self_signed(
        node_cert, directory / "node.key.pem", node_id, not_before=not_after - timedelta(days=30), not_after=not_after
    )
    (directory / "ca.pem").write_bytes(node_cert.read_bytes())


def identity(tmp_path: Path) -> dict[str, Any]:
    result = run_check("identity", str(tmp_path / "config.yaml"))
    assert result.returncode == 0, result.stderr
    document: dict[str, Any] = json.loads(result.stdout)
    return document


def test_a_node_without_identity_files_must_enroll(tmp_path: Path) -> None:
    _config(tmp_path, "gpu-01")
    found = identity(tmp_path)
    assert (found["valid"], found["enrolled"]) == (False, False)
    assert found["reason"] == f"no key, certificate and CA bundle in {tmp_path / 'state' / 'identity'}"


def test_a_current_certificate_for_the_node_skips_enrollment(tmp_path: Path) -> None:
    _config(tmp_path, "gpu-01")
    _identity(tmp_path, "gpu-01", not_after=datetime.now(UTC) + timedelta(days=20))
    found = identity(tmp_path)
    assert found["valid"] is True and found["node_ids"] == ["gpu-01"]


def test_an_expired_certificate_must_enroll_again(tmp_path: Path) -> None:
    _config(tmp_path, "gpu-01")
    _identity(tmp_path, "gpu-01", not_after=datetime.now(UTC) - timedelta(days=1))
    found = identity(tmp_path)
    assert found["valid"] is False and found["reason"].startswith("the certificate expired at ")


def test_a_certificate_for_another_node_id_must_enroll_again(tmp_path: Path) -> None:
    _config(tmp_path, "gpu-02")
    _identity(tmp_path, "gpu-01", not_after=datetime.now(UTC) + timedelta(days=20))
    found = identity(tmp_path)
    assert found["valid"] is False and found["reason"] == "the certificate is for gpu-01, not gpu-02"


def test_an_unreadable_config_is_a_reason_not_a_crash(tmp_path: Path) -> None:
    found = identity(tmp_path)  # no config.yaml at all
    assert found["valid"] is False and "config.yaml" in found["reason"]
