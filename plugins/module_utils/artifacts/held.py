"""Whether the store holds a desired state's artifacts exactly as their signed manifests say.

``engine_set`` runs a signed state's engines only once every artifact the state lists is in the store, as
signed, intact and promoted: the reconcile playbook makes them present in an earlier step, and that step's
caller is not trusted to have run it. The answer is a list of problems, each naming the artifact and the
store; what to do with them (refuse, or warn in check mode) is the caller's.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from ansible_collections.meridian.node.plugins.module_utils.artifacts.layout import ArtifactStoreError
from ansible_collections.meridian.node.plugins.module_utils.artifacts.store import Store
from ansible_collections.meridian.node.plugins.module_utils.trust.policy import PolicyError, load_policy
from ansible_collections.meridian.node.plugins.module_utils.trust.verify import Rejection, verify_artifact_manifest

__all__ = ["held_problems"]


def held_problems(artifacts: Sequence[Mapping[str, Any]], *, policy_path: str, store_path: str | None) -> list[str]:
    """What is wrong with the store's copy of each listed artifact (its ``name``, ``version`` and signed
    ``manifest``); empty when the store holds them all. The store is ``store_path``, else the policy's."""
    problems: list[str] = []
    try:
        policy = load_policy(policy_path)
        store = Store(store_path) if store_path else Store.for_policy(policy.store)
        for artifact in artifacts:
            name, version = str(artifact["name"]), str(artifact["version"])
            what = f"artifact {name!r} version {version!r}"
            try:
                # The same bytes verified_artifact is handed (the manifest as a dict, serialised).
                manifest = verify_artifact_manifest(json.dumps(artifact["manifest"]).encode("utf-8"), policy).manifest
            except Rejection as exc:
                problems.append(f"{what}: its manifest is rejected ({exc.code.value}): {exc.message}")
                continue
            observed = store.observe(name, version)
            record = observed.versions.get((name, version))
            files = tuple((entry.path, entry.sha256, entry.size) for entry in manifest.files)
            if record is None:
                problems.append(f"{what} is not in the store {store.root}")
            elif record.files != files:
                problems.append(f"{what} is in the store {store.root} with other files than its signed manifest lists")
            elif not observed.intact:
                problems.append(
                    f"{what} in the store {store.root} no longer matches its record (files or blobs changed)"
                )
            elif observed.current.get(name) != version:
                current = observed.current.get(name)
                problems.append(f"{what} is not the promoted version in the store {store.root} (current: {current})")
    except (PolicyError, ArtifactStoreError, OSError) as exc:
        problems.append(f"the store could not be read: {exc}")
    return problems
