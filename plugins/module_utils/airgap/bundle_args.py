"""``meridian.node.airgap_bundle``'s arguments and what a run of it returns (``plugins/modules/airgap_bundle.py``).

Runs on: the managed host, inside the module (Python 3.9+).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any, Optional

from ansible.module_utils.basic import missing_required_lib

from ansible_collections.meridian.node.plugins.module_utils._compat import UTC
from ansible_collections.meridian.node.plugins.module_utils._module import HOST_ARGS
from ansible_collections.meridian.node.plugins.module_utils.airgap.bundle_reader import (
    BundleRefused,
    check_bundle,
    check_scratch,
    unpack_bundle,
)
from ansible_collections.meridian.node.plugins.module_utils.airgap.bundle_stage import (
    discard_work_dir,
    load_bundle_images,
    plan_bundle_images,
    stage_artifacts,
    write_envelope,
)
from ansible_collections.meridian.node.plugins.module_utils.airgap.image_load import ImageLoadError
from ansible_collections.meridian.node.plugins.module_utils.artifacts.fetch import ArtifactError
from ansible_collections.meridian.node.plugins.module_utils.artifacts.layout import ArtifactStoreError
from ansible_collections.meridian.node.plugins.module_utils.trust.applied_state import StateStore, StateStoreError
from ansible_collections.meridian.node.plugins.module_utils.trust.policy import Policy, PolicyError, load_policy
from ansible_collections.meridian.node.plugins.module_utils.trust.verify import missing_libraries

ARGUMENT_SPEC: dict[str, Any] = {
    "bundle": {"type": "path"},
    "node_id": {"type": "str"},
    **HOST_ARGS,
    "state": {"type": "str", "choices": ["unpacked", "absent"], "default": "unpacked"},
    "directory": {"type": "path"},
}
REQUIRED_IF = [("state", "unpacked", ("bundle", "node_id")), ("state", "absent", ("directory",))]


def airgap_bundle_outcome(params: Mapping[str, Any], *, check_mode: bool) -> dict[str, Any]:
    """The bundle checked (check mode) or unpacked, its state accepted and its artifacts staged, or its work
    directory removed (``state=absent``); ``failed`` and ``msg`` (and ``reason`` where there is one,
    ``exception`` for a missing library) on failure, ``warnings`` when staging had any."""
    for package, error in missing_libraries():
        return {"failed": True, "msg": missing_required_lib(package), "exception": error}
    try:
        policy = load_policy(params["policy"])
    except PolicyError as exc:
        return {"failed": True, "msg": f"Error reading policy {params['policy']}: {exc}"}
    if params["state"] == "absent":
        try:
            removed = False if check_mode else discard_work_dir(params["directory"], policy.air_gap.scratch_dir)
        except (ValueError, OSError) as exc:
            return {"failed": True, "msg": f"Error removing bundle work directory {params['directory']}: {exc}"}
        return {"changed": removed}
    return _unpacked_outcome(params, policy, check_mode=check_mode)


def _unpacked_outcome(params: Mapping[str, Any], policy: Policy, *, check_mode: bool) -> dict[str, Any]:
    bundle = params["bundle"]
    try:
        applied = StateStore(params["state_dir"]).load()
        now = datetime.now(UTC)
        if check_mode:
            checked = check_bundle(bundle, policy, node_id=params["node_id"], now=now, applied=applied)
            refused = _refuse_playbooks(bundle, [entry.path for entry in checked.verified.bundle.files])
            if refused is not None:
                return refused
            # What the real run needs beyond a good bundle: without this, --check passed and the run then
            # failed on a scratch directory it could not make.
            check_scratch(policy.air_gap.scratch_dir, checked.verified.bundle.total_bytes)
            # What the run would load: the images Docker lacks by their pins (asked, nothing loaded).
            images = [item.report() for item in plan_bundle_images(checked.images)]
            return {
                "changed": not checked.verified.desired.already_applied or any(item["loaded"] for item in images),
                "images": images,
                "bundle_id": checked.verified.bundle.bundle_id,
                "generation": checked.verified.desired.state.generation,
                "already_applied": checked.verified.desired.already_applied,
                "artifacts": [{"name": m.manifest.name, "version": m.manifest.version} for m in checked.manifests],
                "bytes": checked.bytes_read,
            }
        unpacked = unpack_bundle(bundle, policy, node_id=params["node_id"], now=now, applied=applied)
    except BundleRefused as exc:
        return {
            "failed": True,
            "msg": f"Error reading bundle {bundle}: {exc}",
            "reason": exc.reason.value,
            "member": exc.member,
        }
    except StateStoreError as exc:
        return {"failed": True, "msg": f"Error reading the applied-state record in {params['state_dir']}: {exc}"}
    except ImageLoadError as exc:
        return {
            "failed": True,
            "msg": f"Error checking the images of bundle {bundle}: {exc}",
            "reason": "image-load-failed",
        }
    refused = _refuse_playbooks(bundle, list(unpacked.files), unpacked.discard)
    if refused is not None:
        return refused
    desired = unpacked.verified.desired
    if not desired.already_applied:
        try:
            # Accepted before its artifacts are staged and reconcile.yml runs: an apply that fails or is cut
            # short still moves the floor, so an older bundle is refused from now on; this one may run again.
            StateStore(params["state_dir"]).record_accepted(
                desired.state.generation, desired.state.lease_epoch, desired.payload_sha256
            )
        except StateStoreError as exc:
            unpacked.discard()
            return {
                "failed": True,
                "msg": f"Error accepting bundle {bundle}, nothing was applied: {exc}",
                "reason": "not-accepted",
            }
    warnings: list[str] = []
    try:
        staged = stage_artifacts(unpacked, policy, warnings.append)
        envelope = write_envelope(unpacked)
        images = load_bundle_images(unpacked)
    except (ImageLoadError, ArtifactError, ArtifactStoreError, OSError, ValueError) as exc:
        unpacked.discard()
        doing, reason = (
            ("loading the images", "image-load-failed")
            if isinstance(exc, ImageLoadError)
            else ("staging the artifacts", "staging-failed")
        )
        return {
            "failed": True,
            "msg": f"Error {doing} of bundle {bundle}: {exc}",
            "reason": reason,
            **_warnings(warnings),
        }
    return {
        "changed": not desired.already_applied
        or any(item["changed"] for item in staged)
        or any(item["loaded"] for item in images),
        "bundle_id": unpacked.verified.bundle.bundle_id,
        "generation": desired.state.generation,
        "already_applied": desired.already_applied,
        "envelope": envelope,
        "directory": unpacked.directory,
        "artifacts": staged,
        "images": images,
        "bytes": unpacked.bytes_read,
        **_warnings(warnings),
    }


def _refuse_playbooks(
    bundle: str, paths: Sequence[str], cleanup: Optional[Callable[[], None]] = None
) -> Optional[dict[str, Any]]:
    if any(path.startswith("playbooks/") for path in paths):
        if cleanup is not None:
            cleanup()
        return {
            "failed": True,
            "msg": f"Error reading bundle {bundle}: it ships its own playbooks/, which this module does not run: "
            "apply it with the agent (mode air-gapped), or run its playbooks/reconcile.yml yourself",
            "reason": "ships-playbooks",
        }
    return None


def _warnings(warnings: list[str]) -> dict[str, Any]:
    return {"warnings": warnings} if warnings else {}
