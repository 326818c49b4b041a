"""An air-gapped node on disk for the inbox and outbox tests: policy, config, inbox, outbox, store, scratch.

Unlike ``bundle_fixtures`` (fixed ``NOW``, for the reader), these bundles are valid at the real clock: the
inbox hands them to a real ansible-runner run of ``reconcile.yml``, whose ``trust.desired_state`` module verifies
the envelope again with the host's own clock.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import yaml

from ansible_collections.meridian.node.plugins.module_utils.trust.policy import Policy, load_policy
from ansible_collections.meridian.node.tests.support.bundle_fixtures import ARTIFACT, AUTHORITY, CONTROL
from ansible_collections.meridian.node.tests.support.trust_fixtures import (
    NODE_ID,
    current_state,
    envelope,
    write_policy,
)
from meridian_node_agent.cli.bundle import BundleInputs, build_bundle
from meridian_node_agent.config import AgentConfig, load_config

__all__ = [
    "AGENT_UID",
    "AirGapNode",
    "InPlaceWriter",
    "galaxy_collection",
    "grow_while_read",
    "make_airgap_node",
    "state_bundle",
]

# The agent's user in split nodes made here (tests run as root): no such account is needed, only the number.
AGENT_UID = 4242


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
    split: bool = False,
) -> AirGapNode:
    """A node in mode air-gapped, apply.via in-process; ``control_public_key`` trusts a devserver's key.

    ``split``: apply.via systemd instead, root's directory ``root/apply`` (scratch inside it, as by default)
    and the inbox root's, 0700; the agent's directory ``root/agent`` exists, owned by ``AGENT_UID``."""
    etc = root / "etc"
    policy = write_policy(
        etc,
        control=[CONTROL],
        artifact=[ARTIFACT],
        air_gap_authority=[AUTHORITY],
        extra={
            "store": {"path": str(root / "store"), "max_bytes": "1G"},
            "air_gap": {"scratch_dir": str(root / "apply" / "bundle-scratch" if split else root / "scratch")},
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
    config_document: dict[str, Any] = {
        "node_id": node_id,
        "mode": "air-gapped",
        "policy": str(policy),
        "state_dir": str(root / "agent"),
        "air_gap": {"inbox": str(root / "inbox"), "outbox": str(root / "outbox"), "poll_seconds": 1},
        "log": {"format": "text", "level": "warning"},
    }
    if split:
        config_document["apply"] = {"via": "systemd", "state_dir": str(root / "apply")}
        (root / "inbox").chmod(0o700)
        (root / "agent").mkdir(mode=0o750)
        os.chown(root / "agent", AGENT_UID, AGENT_UID)
    config = root / "config.yaml"
    config.write_text(yaml.safe_dump(config_document))
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
    images: Sequence[str] = (),
) -> Path:
    """A bundle made by make-bundle's code, valid now, in ``node.bundles``: the state is ``desired`` (signed
    here by CONTROL) or ``desired_envelope`` (signed elsewhere, a devserver's publish); ``images`` are exported
    from the local Docker (``make-bundle --image``)."""
    now = datetime.now(UTC).replace(microsecond=0)
    if desired_envelope is None:
        state = current_state(generation, node_id=node.node_id, **(desired or {}))
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
            images=images,
        ),
    )
    return out


def galaxy_collection(root: Path, namespace: str, name: str, files: Mapping[str, str] | None = None) -> Path:
    """A real collection tarball (``ansible-galaxy collection build``) of ``files`` (path: text) in ``root``."""
    source = root / f"{namespace}-{name}-source"
    source.mkdir(parents=True)
    (source / "galaxy.yml").write_text(
        f"namespace: {namespace}\nname: {name}\nversion: 1.0.0\nreadme: README.md\nauthors: [site operators]\n"
    )
    (source / "README.md").write_text("Site additions shipped inside air-gap bundles.\n")
    for path, text in (files or {}).items():
        (source / path).parent.mkdir(parents=True, exist_ok=True)
        (source / path).write_text(text)
    galaxy = Path(sys.executable).parent / "ansible-galaxy"
    subprocess.run(
        [str(galaxy), "collection", "build", str(source), "--output-path", str(root)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    return root / f"{namespace}-{name}-1.0.0.tar.gz"


class InPlaceWriter:
    """A copy under the final name (the writer ignores the rename rule), one chunk per ``step``: the test
    decides when each chunk lands."""

    def __init__(self, target: Path, data: bytes, steps: int) -> None:
        self.target, self.data = target, data
        self.cuts = [len(data) * (n + 1) // steps for n in range(steps)]
        self.written = 0

    @property
    def done(self) -> bool:
        return self.written == len(self.data)

    def step(self) -> None:
        if self.done:
            return
        cut = next(c for c in self.cuts if c > self.written)
        with self.target.open("ab") as handle:
            handle.write(self.data[self.written : cut])
        self.written = cut


def grow_while_read(monkeypatch: Any, writer: InPlaceWriter) -> None:
    """Make the bundle reader's every read of a file let ``writer`` copy one more chunk: the file grows while
    the reader holds it open, driven by the reads themselves (no sleeps, no threads)."""
    import io
    import types

    from ansible_collections.meridian.node.plugins.module_utils.airgap import bundle_tar

    class GrowingFile(io.FileIO):
        def read(self, size: int = -1) -> bytes:  # type: ignore[override]
            chunk = super().read(size)
            writer.step()
            return chunk or b""

        def readinto(self, buffer: Any) -> int:
            count = super().readinto(buffer)
            writer.step()
            return count or 0

    proxy = types.ModuleType("io")
    proxy.__dict__.update(vars(io))
    proxy.FileIO = GrowingFile  # type: ignore[attr-defined]
    monkeypatch.setattr(bundle_tar, "io", proxy)  # where the bundle file is opened
