"""Real signed bundles, good and hostile, for the air-gap tests.

``good_bundle`` makes one through ``make-bundle``'s own code (``cli.bundle.build_bundle``): a desired state
signed by control, an artifact manifest signed by the artifact key with its two files, a playbook and a
collection tarball, signed by the authority. The hostile ones are tars written member by member with
``tarfile`` (``write_tar``), so each test says exactly which header or byte is wrong; ``bundle_json`` signs
the listing they carry with real keys.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import tarfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from ansible_collections.meridian.node.plugins.module_utils.airgap.runbook import listed_runbook
from ansible_collections.meridian.node.plugins.module_utils.contracts import read_json
from ansible_collections.meridian.node.plugins.module_utils.trust.policy import Policy, load_policy
from ansible_collections.meridian.node.tests.support.trust_fixtures import (
    NODE_ID,
    NOW,
    SigningKey,
    artifact_manifest,
    bundle,
    desired_state,
    envelope,
    make_key,
    signed,
    write_policy,
)
from meridian_node_agent.cli.bundle import BundleInputs, build_bundle, shipped_code_pin

__all__ = [
    "ARTIFACT",
    "AUTHORITY",
    "AUTHORITY_2",
    "CONTROL",
    "Site",
    "bundle_json",
    "good_bundle",
    "listed",
    "make_site",
    "rebuilt_bundle",
    "regular",
    "resigned",
    "snapshot",
    "write_tar",
]

CONTROL = make_key()
ARTIFACT = make_key()
AUTHORITY = make_key()
AUTHORITY_2 = make_key()

WEIGHTS = b"\x00\x01weights" * 4096
CONFIG = b'{"hidden_size": 8}\n'
Member = tuple[tarfile.TarInfo, "bytes | None"]


@dataclass(frozen=True)
class Site:
    """A host's view: its policy (scratch under ``scratch``) and the directory everything else lives in."""

    root: Path
    scratch: Path
    policy: Policy


def make_site(root: Path, *, authority_threshold: int = 1, air_gap: Mapping[str, Any] | None = None) -> Site:
    scratch = root / "scratch"
    policy_dir = root / "etc"
    policy_dir.mkdir(parents=True)
    path = write_policy(
        policy_dir,
        control=[CONTROL],
        artifact=[ARTIFACT],
        air_gap_authority=[AUTHORITY, AUTHORITY_2],
        air_gap_authority_threshold=authority_threshold,
        extra={"air_gap": {"scratch_dir": str(scratch), **(air_gap or {})}},
    )
    return Site(root=root, scratch=scratch, policy=load_policy(path))


def good_bundle(site: Site, *, generation: int = 2, name: str = "good.tar") -> Path:
    """A complete bundle for ``NODE_ID`` made by make-bundle's code, valid at ``NOW``."""
    source = site.root / "source"
    files = source / "model"
    files.mkdir(parents=True, exist_ok=True)
    (files / "weights.bin").write_bytes(WEIGHTS)
    (files / "config.json").write_bytes(CONFIG)
    manifest = artifact_manifest(
        name="tiny-model",
        version="1.0.0",
        files=[_manifest_entry("weights.bin", WEIGHTS), _manifest_entry("config.json", CONFIG)],
    )
    manifest_envelope = envelope("artifact-manifest", manifest, [ARTIFACT])
    (source / "manifest.json").write_text(json.dumps(manifest_envelope))
    playbooks = source / "playbooks"
    playbooks.mkdir(exist_ok=True)
    (playbooks / "site.yml").write_text("- hosts: localhost\n  tasks: []\n")
    collection = source / "meridian-node-1.0.0.tar.gz"
    collection.write_bytes(b"\x1f\x8b not really a collection, but bytes to ship")
    out = site.root / name
    build_bundle(
        out,
        BundleInputs(
            desired_envelope=envelope(
                "desired-state",
                desired_state(
                    generation=generation,
                    artifacts=[{"name": "tiny-model", "version": "1.0.0", "manifest": manifest_envelope}],
                    runbook=shipped_code_pin(playbooks, collection),
                ),
                [CONTROL],
            ),
            node_id=NODE_ID,
            authority_keys=[AUTHORITY.private],
            expires=timedelta(days=1),
            now=NOW - timedelta(minutes=10),
            artifacts=[(source / "manifest.json", files)],
            playbooks=playbooks,
            collection=collection,
        ),
    )
    return out


def _manifest_entry(path: str, data: bytes) -> dict[str, Any]:
    return {"path": path, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def listed(path: str, data: bytes) -> dict[str, Any]:
    """A bundle.json listing entry for ``data`` at ``path``."""
    return {"path": path, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def bundle_json(
    files: Sequence[Mapping[str, Any]],
    *,
    authority: Sequence[SigningKey] = (AUTHORITY,),
    state_keys: Sequence[SigningKey] = (CONTROL,),
    state: Mapping[str, Any] | None = None,
    **fields: Any,
) -> bytes:
    """A signed bundle.json listing ``files``, carrying a control-signed state of generation 2 that pins the
    code ``files`` lists (so a hostile tar is refused for what its test is about, not for unpinned code)."""
    pin = listed_runbook(files)
    default = desired_state(generation=2) if pin is None else desired_state(generation=2, runbook=pin)
    inner = envelope("desired-state", dict(state or default), list(state_keys))
    return signed("bundle", bundle(inner, files=list(files), **fields), list(authority))


def rebuilt_bundle(site: Site, edit: Callable[[dict[str, Any], list[Member]], None]) -> Path:
    """The good bundle with its payload and members changed by ``edit``, bundle.json signed again by the
    authority: what whoever holds only the air-gap authority key can make of a bundle control signed for."""
    return resigned(good_bundle(site), site.root / "rebuilt.tar", edit)


def resigned(source: Path, out: Path, edit: Callable[[dict[str, Any], list[Member]], None]) -> Path:
    """The bundle at ``source`` with its payload and members changed by ``edit``, bundle.json signed again
    by the authority alone, written to ``out``."""
    with tarfile.open(source) as tar:
        original: list[Member] = []
        for info in tar:
            handle = tar.extractfile(info)
            assert handle is not None
            original.append((info, handle.read()))
    payload = json.loads(base64.b64decode(read_json(original[0][1] or b"")["payload"]))
    body = original[1:]
    edit(payload, body)
    return write_tar(out, [regular("bundle.json", signed("bundle", payload, [AUTHORITY])), *body])


def regular(name: str, data: bytes) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = 0o644
    return info, data


def write_tar(
    path: Path,
    members: Iterable[tuple[tarfile.TarInfo, bytes | None]],
    *,
    tar_format: int = tarfile.PAX_FORMAT,
) -> Path:
    """A tar of ``members`` as given (header and data); ``None`` data for members without any."""
    with tarfile.open(path, "w:", format=tar_format) as tar:
        for info, data in members:
            tar.addfile(info, None if data is None else io.BytesIO(data))
    return path


def snapshot(root: Path, *, skip: Path) -> dict[str, tuple[int, int]]:
    """Every path under ``root`` except below ``skip``, with its size and mtime: what a refusal must not touch."""
    found: dict[str, tuple[int, int]] = {}
    for directory, dirs, files in os.walk(root):
        if Path(directory) == skip or skip in Path(directory).parents:
            dirs[:] = []
            continue
        for name in dirs + files:
            if Path(directory, name) == skip:
                continue
            status = os.lstat(os.path.join(directory, name))
            found[os.path.relpath(os.path.join(directory, name), root)] = (status.st_size, status.st_mtime_ns)
    return found
