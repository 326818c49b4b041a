"""After the reader: stage an unpacked bundle's artifacts into the store and hand over its desired state.

Runs on: the side that applies a bundle (the agent's inbox loop, or the ``airgap_bundle`` module under
``playbooks/airgap_apply.yml``), on the managed host's Python (3.9+).

Images the bundle carries are loaded into the local Docker Engine by ``load_bundle_images`` (``image_load``),
after the artifacts are staged, from the verified copies in scratch.

Staging is ``verified_artifact``'s own store code (``artifacts.store.ensure_artifact``) with the scratch copy
as the source: the store hashes every file again as it copies it in, so scratch is trusted for where the
bytes are, never for what they are. A work directory is removed only when it is a ``bundle-*`` directory
directly inside the policy's scratch directory, compared after resolving symlinks.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from ansible_collections.meridian.node.plugins.module_utils._fileutil import atomic_write
from ansible_collections.meridian.node.plugins.module_utils.airgap.image_load import (
    ImageLoadError,
    PlannedImage,
    load_images,
    plan_images,
)
from ansible_collections.meridian.node.plugins.module_utils.artifacts.store import Store, ensure_artifact
from ansible_collections.meridian.node.plugins.module_utils.docker.api import DockerApi, DockerApiError

if TYPE_CHECKING:
    from ansible_collections.meridian.node.plugins.module_utils.airgap.bundle_reader import UnpackedBundle
    from ansible_collections.meridian.node.plugins.module_utils.airgap.image_archive import VerifiedImage
    from ansible_collections.meridian.node.plugins.module_utils.trust.policy import Policy

__all__ = [
    "ENVELOPE_NAME",
    "discard_work_dir",
    "load_bundle_images",
    "plan_bundle_images",
    "stage_artifacts",
    "write_envelope",
]

# Where the desired-state envelope is written inside the work directory, beside (never inside) ``tree``.
ENVELOPE_NAME = "desired-state.json"


def stage_artifacts(
    unpacked: UnpackedBundle, policy: Policy, warn: Callable[[str], None] = lambda _message: None
) -> list[dict[str, Any]]:
    """Each artifact the bundle carries into the store; returns one ``{name, version, changed}`` per artifact."""
    if not unpacked.manifests:
        return []
    state = unpacked.verified.desired.state
    store = Store.for_policy(policy.store)
    for warning in store.check_trust():
        warn(warning)
    pins = {(ref.name, ref.version): ref.pin for ref in state.artifacts}
    in_use = sorted({engine.model.artifact for engine in state.engines if engine.model.artifact})
    tree = os.path.join(unpacked.directory, "tree")
    staged = []
    for verified in unpacked.manifests:
        manifest = verified.manifest
        outcome = ensure_artifact(
            store,
            manifest,
            manifest_sha256=verified.payload_sha256,
            source=os.path.join(tree, "artifacts", manifest.name, manifest.version, "files"),
            pin=pins.get((manifest.name, manifest.version), False),
            max_bytes=policy.store.max_bytes,
            in_use=in_use,
        )
        staged.append({"name": manifest.name, "version": manifest.version, "changed": outcome.changed})
    return staged


def plan_bundle_images(images: Mapping[str, VerifiedImage], api: DockerApi | None = None) -> list[PlannedImage]:
    """Which of a verified bundle's images the local Docker lacks (check mode reports this as it is)."""
    if not images:
        return []
    return plan_images(images, api or _docker())


def load_bundle_images(unpacked: UnpackedBundle, api: DockerApi | None = None) -> list[dict[str, Any]]:
    """Load the bundle's images that the local Docker lacks; one ``PlannedImage.report()`` per image."""
    if not unpacked.images:
        return []
    engine = api or _docker()
    return load_images(plan_bundle_images(unpacked.images, engine), unpacked.files, engine)


def _docker() -> DockerApi:
    try:
        return DockerApi.from_env()
    except DockerApiError as exc:
        raise ImageLoadError(f"the bundle carries images, but the Docker Engine cannot be reached: {exc}") from exc


def write_envelope(unpacked: UnpackedBundle) -> str:
    """The control-signed desired state as a file in the work directory (what ``reconcile.yml`` reads):
    the same payload and signatures as signed, which is all its ``trust.desired_state`` task verifies again."""
    envelope = unpacked.verified.bundle.desired_state.model_dump(mode="json")
    path = os.path.join(unpacked.directory, ENVELOPE_NAME)
    atomic_write(path, json.dumps(envelope, separators=(",", ":")).encode("utf-8"), mode=0o600)
    return path


def discard_work_dir(directory: str, scratch_dir: str) -> bool:
    """Remove ``directory`` when it is a reader's work directory in ``scratch_dir``; True when removed.

    Anything else raises ``ValueError``: the path comes from a playbook variable, and a typo must not
    become an ``rm -r`` elsewhere.
    """
    real, scratch = os.path.realpath(directory), os.path.realpath(scratch_dir)
    if os.path.dirname(real) != scratch or not os.path.basename(real).startswith("bundle-"):
        raise ValueError(
            f"{directory} is not a bundle work directory inside air_gap.scratch_dir {scratch_dir} (after resolving "
            f"symlinks it is {real}); only those are removed"
        )
    if not os.path.lexists(real):
        return False
    shutil.rmtree(real)
    return True
