"""``meridian.node.verified_artifact``'s arguments and what a run of it returns
(``plugins/modules/verified_artifact.py``): the manifest read (``read_manifest``), verified against the host
policy, and the artifact made present (fetched, verified, promoted) or absent in the store.
"""

from __future__ import annotations

import json
import os
import traceback
from collections.abc import Callable, Mapping
from typing import Any

from ansible.module_utils.basic import missing_required_lib

from ansible_collections.meridian.node.plugins.module_utils._errors import MeridianError
from ansible_collections.meridian.node.plugins.module_utils._fileutil import CappedReadError, read_capped
from ansible_collections.meridian.node.plugins.module_utils._module import POLICY_ARGS
from ansible_collections.meridian.node.plugins.module_utils._transfer_progress import TransferReporter
from ansible_collections.meridian.node.plugins.module_utils.artifacts.fetch import (
    ArtifactError,
    FetchConfig,
    FetchProgress,
)
from ansible_collections.meridian.node.plugins.module_utils.artifacts.store import (
    ArtifactStoreError,
    Store,
    ensure_artifact,
    remove_artifact,
)
from ansible_collections.meridian.node.plugins.module_utils.trust import policy
from ansible_collections.meridian.node.plugins.module_utils.trust.verify import (
    Rejection,
    missing_libraries,
    verify_artifact_manifest,
)

_MAX_MANIFEST_BYTES = 16 * 1024 * 1024

ARGUMENT_SPEC: dict[str, Any] = {
    "manifest": {"type": "raw", "required": True},
    "source": {"type": "str"},
    "state": {"type": "str", "choices": ["present", "absent"], "default": "present"},
    "pin": {"type": "bool", "default": False},
    "promote": {"type": "bool", "default": True},
    "verify": {"type": "str", "choices": ["quick", "full"], "default": "quick"},
    "in_use": {"type": "list", "elements": "str", "default": []},
    **POLICY_ARGS,
    "timeout": {"type": "float", "default": 30},
    "attempts": {"type": "int", "default": 5},
    "lock_timeout": {"type": "float"},
    "progress_file": {"type": "path"},
}


def verified_artifact_outcome(params: Mapping[str, Any], *, check_mode: bool, diff: bool = False) -> dict[str, Any]:
    """``run``'s result (with ``diff`` in diff mode); ``failed`` and ``msg`` (``exception`` for a missing
    library or an OS error) on failure; ``warnings`` when the store's trust check had any."""
    for package, error in missing_libraries():
        return {"failed": True, "msg": missing_required_lib(package), "exception": error}
    warnings: list[str] = []
    try:
        result = run(params, check_mode=check_mode, diff=diff, warn=warnings.append)
    except (policy.PolicyError, Rejection, ArtifactError, ArtifactStoreError, ManifestInputError) as exc:
        result = {"failed": True, "msg": f"Error making artifact {params['state']}: {exc}"}
    except OSError as exc:
        result = {
            "failed": True,
            "msg": f"Error making artifact {params['state']}: {exc}",
            "exception": traceback.format_exc(),
        }
    if warnings:
        result["warnings"] = warnings
    return result


class ManifestInputError(MeridianError, ValueError):
    """The ``manifest`` option is neither a readable envelope file nor an envelope dictionary."""


def read_manifest(value: Any) -> bytes:
    """The envelope bytes from a path or an inline dictionary."""
    if isinstance(value, dict):
        return json.dumps(value).encode("utf-8")
    if isinstance(value, str):
        try:
            # A path the playbook names: followed if it is a symlink, like any file an operator gives.
            return read_capped(value, _MAX_MANIFEST_BYTES, what="the manifest file", nofollow=False)
        except CappedReadError as exc:
            raise ManifestInputError(str(exc)) from exc
    # The name is taken outside the f-string: ansible-core 2.16's pylint reads type() there as a type check.
    got = type(value).__name__
    raise ManifestInputError(f"manifest must be a path to an envelope file or the envelope as a dictionary (got {got})")


def run(
    params: Mapping[str, Any], *, check_mode: bool, diff: bool, warn: Callable[[str], None] = lambda _message: None
) -> dict[str, Any]:
    host_policy = policy.load_policy(params["policy"])
    verified = verify_artifact_manifest(read_manifest(params["manifest"]), host_policy)
    manifest = verified.manifest
    store = Store.for_policy(host_policy.store)
    for warning in store.check_trust():
        warn(warning)
    if params["state"] == "absent":
        outcome = remove_artifact(
            store,
            manifest.name,
            manifest.version,
            in_use=params["in_use"],
            check_mode=check_mode,
            lock_timeout_s=params["lock_timeout"],
        )
    else:
        reporter = TransferReporter(params.get("progress_file"))
        try:
            outcome = ensure_artifact(
                store,
                manifest,
                manifest_sha256=verified.payload_sha256,
                source=params["source"],
                pin=params["pin"],
                promote=params["promote"],
                verify=params["verify"],
                max_bytes=host_policy.store.max_bytes,
                in_use=params["in_use"],
                config=FetchConfig(
                    timeout_s=params["timeout"],
                    attempts=params["attempts"],
                    progress=_progress_to(reporter, f"{manifest.name} {manifest.version}"),
                ),
                check_mode=check_mode,
                lock_timeout_s=params["lock_timeout"],
            )
        finally:
            reporter.end_all()
        if reporter.problem is not None:
            warn(reporter.problem)
    plan = outcome.plan
    if plan.remove and plan.previous_current == plan.version:
        after_current = None
    elif plan.promote:
        after_current = plan.version
    else:
        after_current = plan.previous_current
    result: dict[str, Any] = {
        "changed": outcome.changed,
        "name": manifest.name,
        "version": manifest.version,
        "path": os.path.join(store.artifacts_dir, manifest.name, manifest.version),
        "current": after_current,
        "signers": list(verified.signers),
        "plan": plan.summary(),
    }
    if outcome.result is not None:
        result["fetched"] = [
            {"sha256": f.sha256, "size": f.size, "resumed_from": f.resumed_from, "attempts": f.attempts}
            for f in outcome.result.fetched
        ]
    if diff:
        result["diff"] = plan.diff()
    return result


def _progress_to(reporter: TransferReporter, artifact: str) -> Callable[[FetchProgress], None]:
    """Each file's download, told to ``reporter`` as ``<artifact> <version>: <path>`` from its first bytes to its
    last (``_transfer_progress``: the agent shows it)."""

    def report(event: FetchProgress) -> None:
        name = f"{artifact}: {event.path}"
        if name not in reporter:
            reporter.start("artifact", name, event.size)
        reporter.advance(name, event.done, event.size)
        if event.done >= event.size:
            reporter.end(name)

    return report
