"""Real keys, real policies, real signed documents for tests.

Everything here signs with real Ed25519 keys through ``dsse.sign``, so a test that passes a document
through the verifier exercises the same bytes a host would see. Typical use::

    control = make_key()
    policy = load_policy(write_policy(tmp_path, control=[control]))
    data = signed("desired-state", desired_state(generation=3), [control])
    verify_desired_state(data, policy, node_id=NODE_ID, now=NOW, applied=AppliedState())

Times are fixed (``NOW``): tests pass ``now=NOW`` instead of reading the clock.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import yaml
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ansible_collections.meridian.node.plugins.module_utils.contracts import format_rfc3339
from ansible_collections.meridian.node.plugins.module_utils.trust import dsse

__all__ = [
    "NODE_ID",
    "NOW",
    "SigningKey",
    "artifact_manifest",
    "bundle",
    "current_state",
    "desired_state",
    "encode",
    "envelope",
    "make_key",
    "signed",
    "vllm_engine",
    "write_policy",
]

NOW = datetime(2025, 6, 1, 12, 0, 0, tzinfo=UTC)
# One node id per pytest-xdist worker ("gpu-node-1" in a serial run): the reconcile playbook prunes every engine
# whose owner label is agent:<node id>, so two test files applying states of one node id on the shared Docker
# Engine at once would remove each other's engines (tests/support/parallel.py).
NODE_ID = "gpu-node-1" + (f"-{os.environ['PYTEST_XDIST_WORKER']}" if os.environ.get("PYTEST_XDIST_WORKER") else "")


@dataclass(frozen=True)
class SigningKey:
    """An Ed25519 key pair with the forms tests need."""

    private: Ed25519PrivateKey
    keyid: str
    public_pem: bytes
    private_pem: bytes


def make_key() -> SigningKey:
    private = Ed25519PrivateKey.generate()
    return SigningKey(
        private=private,
        keyid=dsse.keyid_for(private.public_key()),
        public_pem=dsse.public_key_pem(private),
        private_pem=private.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        ),
    )


def write_policy(
    directory: Path,
    *,
    control: Sequence[SigningKey],
    control_threshold: int = 1,
    artifact: Sequence[SigningKey] = (),
    artifact_threshold: int = 1,
    air_gap_authority: Sequence[SigningKey] = (),
    air_gap_authority_threshold: int = 1,
    control_max_lifetime: str | None = None,
    extra: Mapping[str, Any] | None = None,
) -> Path:
    """Write ``policy.yaml`` plus one PEM file per key (listed by relative path) into ``directory``.

    Roles given no keys are left out of the policy. ``control_max_lifetime`` sets
    ``trust.control.max_lifetime`` (``"7d"``). ``extra`` adds or replaces top-level sections
    (``images``, ``engines``, ...). Returns the policy file's path.
    """
    keys_dir = directory / "keys"
    keys_dir.mkdir(parents=True, exist_ok=True)
    trust: dict[str, Any] = {}
    for role, keys, threshold in (
        ("control", control, control_threshold),
        ("artifact", artifact, artifact_threshold),
        ("air_gap_authority", air_gap_authority, air_gap_authority_threshold),
    ):
        if not keys:
            continue
        paths = []
        for index, key in enumerate(keys):
            name = f"{role}-{index}.pem"
            (keys_dir / name).write_bytes(key.public_pem)
            paths.append(f"keys/{name}")
        trust[role] = {"threshold": threshold, "public_keys": paths}
    if control_max_lifetime is not None:
        trust["control"]["max_lifetime"] = control_max_lifetime
    document: dict[str, Any] = {"trust": trust, **(extra or {})}
    path = directory / "policy.yaml"
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path


def desired_state(**overrides: Any) -> dict[str, Any]:
    """A valid DesiredState payload for ``NODE_ID``, issued a minute before ``NOW``, valid for an hour."""
    payload: dict[str, Any] = {
        "apiVersion": "meridian.node/v1",
        "kind": "DesiredState",
        "node_id": NODE_ID,
        "generation": 1,
        "lease_epoch": 1,
        "issued_at": format_rfc3339(NOW - timedelta(minutes=1)),
        "expires_at": format_rfc3339(NOW + timedelta(hours=1)),
        "artifacts": [],
        "engines": [],
    }
    payload.update(overrides)
    return payload


def current_state(generation: int, *, valid_for: timedelta = timedelta(hours=1), **overrides: Any) -> dict[str, Any]:
    """``desired_state`` for ``generation``, but valid at the real clock instead of at ``NOW``: issued a minute
    ago, expiring ``valid_for`` from now. For tests whose code under test reads the clock itself (the agent, the
    root verbs, ansible-runner runs of the modules)."""
    now = datetime.now(UTC).replace(microsecond=0)
    return desired_state(
        generation=generation,
        issued_at=format_rfc3339(now - timedelta(minutes=1)),
        expires_at=format_rfc3339(now + valid_for),
        **overrides,
    )


def vllm_engine(**overrides: Any) -> dict[str, Any]:
    """A valid EngineSpec, as a desired state lists it: vLLM engine ``chat`` serving the model ``tiny`` by name on
    port 8000, from an image pinned by digest (no artifact to fetch, nothing a test must pull)."""
    return {
        "name": "chat",
        "driver": "vllm",
        "image": "registry.local/vllm@sha256:" + "1" * 64,
        "model": {"name": "tiny"},
        "port": 8000,
        **overrides,
    }


def artifact_manifest(**overrides: Any) -> dict[str, Any]:
    """A valid ArtifactManifest payload with one file."""
    payload: dict[str, Any] = {
        "apiVersion": "meridian.node/v1",
        "kind": "ArtifactManifest",
        "name": "tiny-model",
        "version": "1.0.0",
        "files": [{"path": "weights.bin", "size": 3, "sha256": "ab" * 32}],
    }
    payload.update(overrides)
    return payload


def local_artifact(source: Path, weights: bytes, key: SigningKey) -> dict[str, Any]:
    """A desired state's ArtifactRef for ``tiny-model`` 1.0.0: ``weights`` written as ``source/weights.bin``
    (a directory the policy's ``store.local_sources`` must list) and a manifest of it signed by ``key``."""
    source.mkdir(parents=True, exist_ok=True)
    (source / "weights.bin").write_bytes(weights)
    manifest = artifact_manifest(
        files=[{"path": "weights.bin", "size": len(weights), "sha256": hashlib.sha256(weights).hexdigest()}]
    )
    return {
        "name": "tiny-model",
        "version": "1.0.0",
        "manifest": envelope("artifact-manifest", manifest, [key]),
        "source": str(source),
    }


def bundle(desired_state_envelope: Mapping[str, Any], **overrides: Any) -> dict[str, Any]:
    """A valid Bundle payload for ``NODE_ID`` carrying an already signed desired-state envelope; its
    ``generation`` is the state's (read from the envelope), and it expires a day after ``NOW``."""
    payload: dict[str, Any] = {
        "apiVersion": "meridian.node/v1",
        "kind": "Bundle",
        "bundle_id": "bundle-1",
        "node_id": NODE_ID,
        "generation": json.loads(base64.b64decode(desired_state_envelope["payload"])).get("generation", 1),
        "created_at": format_rfc3339(NOW - timedelta(minutes=10)),
        "expires_at": format_rfc3339(NOW + timedelta(days=1)),
        "desired_state": dict(desired_state_envelope),
        "files": [],
    }
    payload.update(overrides)
    return payload


def encode(payload: Mapping[str, Any] | bytes) -> bytes:
    """The body bytes that get signed: JSON for a mapping, the bytes themselves otherwise."""
    return payload if isinstance(payload, bytes) else json.dumps(payload).encode("utf-8")


def envelope(kind: str, payload: Mapping[str, Any] | bytes, keys: Sequence[SigningKey]) -> dict[str, Any]:
    """A DSSE envelope (as a dict) of ``payload`` as document ``kind`` (a key of ``dsse.PAYLOAD_TYPES``)."""
    return dsse.sign(dsse.PAYLOAD_TYPES[kind], encode(payload), [key.private for key in keys])


def signed(kind: str, payload: Mapping[str, Any] | bytes, keys: Sequence[SigningKey]) -> bytes:
    """The envelope as the JSON bytes a host receives."""
    return json.dumps(envelope(kind, payload, keys)).encode("utf-8")
