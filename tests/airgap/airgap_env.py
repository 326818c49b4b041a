"""An air-gapped node on disk for the inbox and outbox tests: policy, config, inbox, outbox, store, scratch.

Unlike ``bundle_fixtures`` (fixed ``NOW``, for the reader), these bundles are valid at the real clock: the
inbox hands them to a real ansible-runner run of ``reconcile.yml``, whose ``desired_state`` module verifies
the envelope again with the host's own clock.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import yaml

from ansible_collections.meridian.node.plugins.module_utils.contracts import format_rfc3339
from ansible_collections.meridian.node.plugins.module_utils.policy import Policy, load_policy
from ansible_collections.meridian.node.tests.airgap.bundle_fixtures import ARTIFACT, AUTHORITY, CONTROL
from ansible_collections.meridian.node.tests.helpers.trust_fixtures import (
    NODE_ID,
    desired_state,
    envelope,
    write_policy,
)
from meridian_node_agent.bundle_cli import BundleInputs, build_bundle
from meridian_node_agent.config import AgentConfig, load_config

__all__ = ["AirGapNode", "make_airgap_node", "state_bundle"]


@dataclass(frozen=True)
class AirGapNode:
    root: Path
    config_path: Path
    node_id: str

    @property
    def config(self) -> AgentConfig:
        return load_config(self.config_path)

    @property
    def policy(self) -> Policy:
        return load_policy(self.config.policy)

    @property
    def inbox(self) -> Path:
        return self.root / "inbox"

    @property
    def outbox(self) -> Path:
        return self.root / "outbox"

    @property
    def state_dir(self) -> Path:
        return self.root / "agent"

    @property
    def bundles(self) -> Path:
        """Where tests make bundles before copying them in (never the inbox itself)."""
        return self.root / "made"

    def filed(self, folder: str) -> dict[str, dict[str, Any]]:
        """``processed/`` or ``rejected/``: each bundle's name with its reason file's content."""
        directory = self.inbox / folder
        if not directory.is_dir():
            return {}
        return {
            path.name[: -len(".reason.json")]: json.loads(path.read_text())
            for path in sorted(directory.glob("*.reason.json"))
        }


def make_airgap_node(
    root: Path,
    *,
    node_id: str = NODE_ID,
    control_public_key: Path | None = None,
    policy_extra: Mapping[str, Any] | None = None,
) -> AirGapNode:
    """A node in mode air-gapped, apply.via in-process; ``control_public_key`` trusts a devserver's key."""
    etc = root / "etc"
    policy = write_policy(
        etc,
        control=[CONTROL],
        artifact=[ARTIFACT],
        air_gap_authority=[AUTHORITY],
        extra={
            "store": {"path": str(root / "store"), "max_bytes": "1G"},
            "air_gap": {"scratch_dir": str(root / "scratch")},
            "agent": {"allowed_modes": ["observe-only", "managed-host", "air-gapped"]},
            **(policy_extra or {}),
        },
    )
    if control_public_key is not None:
        document = yaml.safe_load(policy.read_text())
        (etc / "keys" / "devserver-control.pem").write_bytes(control_public_key.read_bytes())
        document["trust"]["control"]["public_keys"] = ["keys/devserver-control.pem"]
        policy.write_text(yaml.safe_dump(document, sort_keys=False))
    for name in ("inbox", "made"):
        (root / name).mkdir(mode=0o750)
    config = root / "config.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "node_id": node_id,
                "mode": "air-gapped",
                "policy": str(policy),
                "state_dir": str(root / "agent"),
                "air_gap": {"inbox": str(root / "inbox"), "outbox": str(root / "outbox"), "poll_seconds": 1},
                "log": {"format": "text", "level": "warning"},
            }
        )
    )
    return AirGapNode(root=root, config_path=config, node_id=node_id)


def state_bundle(
    node: AirGapNode,
    name: str,
    *,
    generation: int,
    desired: Mapping[str, Any] | None = None,
    desired_envelope: Mapping[str, Any] | None = None,
    artifacts: Sequence[tuple[Path, Path]] = (),
    playbooks: Path | None = None,
    collection: Path | None = None,
) -> Path:
    """A bundle made by make-bundle's code, valid now, in ``node.bundles``: the state is ``desired`` (signed
    here by CONTROL) or ``desired_envelope`` (signed elsewhere, a devserver's publish)."""
    now = datetime.now(UTC).replace(microsecond=0)
    if desired_envelope is None:
        state = desired_state(
            node_id=node.node_id,
            generation=generation,
            issued_at=format_rfc3339(now - timedelta(minutes=1)),
            expires_at=format_rfc3339(now + timedelta(hours=1)),
            **(desired or {}),
        )
        desired_envelope = envelope("desired-state", state, [CONTROL])
    out = node.bundles / name
    build_bundle(
        out,
        BundleInputs(
            desired_envelope=dict(desired_envelope),
            node_id=node.node_id,
            authority_keys=[AUTHORITY.private],
            expires=timedelta(days=1),
            now=now - timedelta(minutes=1),
            artifacts=artifacts,
            playbooks=playbooks,
            collection=collection,
        ),
    )
    return out
