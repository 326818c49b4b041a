#!/usr/bin/python
# Copyright: (c) 2026, meridian.node developers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import annotations

DOCUMENTATION = r"""
module: verified_artifact
short_description: Make a model artifact present in the local store only if a trusted key signed its manifest
version_added: 0.1.0
author:
  - Meridian node maintainers (@meridian)
description:
  - Verifies an C(ArtifactManifest) DSSE envelope against the host policy's C(artifact) keys and
    threshold, then makes that artifact version present in the store under the policy's C(store.path).
  - Files are fetched over HTTP(S) (resuming partial downloads with Range requests) or copied from a
    local directory such as an air-gap inbox, hashed while streaming, checked against the manifest's
    size and sha256, fsync'd and renamed into a content-addressed store. The version directory
    C(artifacts/<name>/<version>) is assembled from hard links and C(artifacts/<name>/current) is
    switched atomically.
  - A re-run with the same manifest changes nothing and re-hashes nothing, unless O(verify=full).
  - Before fetching, least recently used versions are evicted to stay within the policy's
    C(store.max_bytes). Pinned versions, the current version of every name, and names listed in
    O(in_use) are never evicted. Partial downloads count against that budget too.
  - A partial download kept after a transfer failure is deleted by a later run once nothing has written
    to it for 7 days, unless that run resumes it.
  - HTTP redirects are followed (at most 10 hops); a redirect from https to plain http is refused.
  - Any failure leaves the previously current version in place and serving.
  - The store refuses to work, naming the path, when a directory on the way to it, one of its own
    directories, or its index is owned or writable by a user other than root. A blob another user owns
    or can write, or that has a hard link outside the store, is copied into a fresh file and verified
    again instead of being trusted.
  - A policy without C(store.path) means C(/var/lib/meridian-node-artifacts). A store still at the old
    default C(/var/lib/meridian-node/artifacts), inside the agent's directory, keeps being used, with a
    warning saying how to move it.
requirements:
  - pydantic, cryptography and PyYAML on the managed host.
options:
  manifest:
    description:
      - The signed manifest - a path to a file holding the DSSE envelope (JSON), or the envelope itself
        as a dictionary.
    type: raw
    required: true
  source:
    description:
      - Where to fetch files from - an http(s) base URL (files are at C(<source>/<path>)) or a local
        directory (files are at C(<source>/<path>)).
      - When omitted, the manifest's per-file C(url) or its C(base_url) is used. A local path there
        (a plain path or a C(file://) URL) is read only inside a directory listed under the policy's
        C(store.local_sources), compared after resolving symlinks; anything else is refused, naming the
        path. By default the list is empty and a manifest may name no local file.
      - A O(source) given here is the caller's own instruction and is not limited by C(store.local_sources).
    type: str
  state:
    description:
      - V(present) makes the version present (and current, see O(promote)).
      - V(absent) removes the version, its C(current) link if it is current, and every blob no other
        version uses.
    type: str
    choices: [present, absent]
    default: present
  pin:
    description:
      - Protect this version from eviction.
    type: bool
    default: false
  promote:
    description:
      - Make this version the name's C(current) version.
    type: bool
    default: true
  verify:
    description:
      - V(quick) trusts what the store recorded when it last hashed the files (sizes, inodes, mtimes).
      - V(full) re-hashes every file of the version; a file that no longer matches is fetched again.
    type: str
    choices: [quick, full]
    default: quick
  in_use:
    description:
      - Artifact names used by desired or running engines; no version of these is evicted or removed.
    type: list
    elements: str
    default: []
  timeout:
    description:
      - Seconds to wait for a connection or for the next bytes of a download.
    type: float
    default: 30
  attempts:
    description:
      - Tries per file on connection errors, timeouts and HTTP 5xx, with exponential backoff and jitter.
    type: int
    default: 5
  lock_timeout:
    description:
      - Seconds to wait for another run holding the store lock; unset waits as long as it takes.
    type: float
extends_documentation_fragment:
  - meridian.node.attributes
  - meridian.node.host.policy
attributes:
  check_mode:
    support: full
  diff_mode:
    support: full
  idempotent:
    support: full
notes:
  - A partial download kept after a transfer failure is resumed by the next run.
"""

EXAMPLES = r"""
- name: Install and promote a model from a mirror
  meridian.node.verified_artifact:
    manifest: /var/lib/meridian-node/inbox/llama-3-8b-1.2.0.manifest.json
    source: https://models.example.com/llama-3-8b/1.2.0

- name: Pre-stage the next version from an air-gap inbox without switching to it
  meridian.node.verified_artifact:
    manifest: "{{ lookup('file', 'manifest.json') | from_json }}"
    source: /var/lib/meridian-node/inbox/llama-3-8b
    promote: false
    pin: true

- name: Re-hash everything of a version
  meridian.node.verified_artifact:
    manifest: /var/lib/meridian-node/inbox/llama-3-8b-1.2.0.manifest.json
    verify: full
"""

RETURN = r"""
name:
  description: The artifact's name.
  returned: success
  type: str
  sample: llama-3-8b
version:
  description: The artifact's version.
  returned: success
  type: str
  sample: 1.2.0
path:
  description: The version directory.
  returned: success
  type: str
  sample: /var/lib/meridian-node-artifacts/artifacts/llama-3-8b/1.2.0
current:
  description: The name's current version after the run (in check mode, after the planned run).
  returned: success
  type: str
  sample: 1.2.0
signers:
  description: Key ids of the trusted keys that signed the manifest.
  returned: success
  type: list
  elements: str
plan:
  description:
    - What the run did (or, in check mode, would do) - files to fetch with their resume offsets, blobs
      to re-hash, whether the version is assembled and promoted, versions evicted, partial downloads
      dropped (C(drop_partials), each with C(sha256), C(size), C(modified) and C(reason) V(stale) or
      V(budget)), store bytes before and after (partial downloads included).
  returned: success
  type: dict
fetched:
  description: Files downloaded or copied, with the byte offset each resumed from.
  returned: success and not check mode
  type: list
  elements: dict
"""

import json
import os
import traceback
from collections.abc import Callable
from typing import Any

from ansible.module_utils.basic import AnsibleModule, missing_required_lib

from ansible_collections.meridian.node.plugins.module_utils._errors import MeridianError
from ansible_collections.meridian.node.plugins.module_utils._module import POLICY_ARGS
from ansible_collections.meridian.node.plugins.module_utils.artifacts.fetch import ArtifactError, FetchConfig
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


def main() -> None:
    module = AnsibleModule(
        argument_spec={
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
        },
        supports_check_mode=True,
    )
    for package, error in missing_libraries():
        module.fail_json(msg=missing_required_lib(package), exception=error)
    try:
        result = run(module.params, check_mode=module.check_mode, diff=module._diff, warn=module.warn)
    except (policy.PolicyError, Rejection, ArtifactError, ArtifactStoreError, ManifestInputError) as exc:
        module.fail_json(msg=f"Error making artifact {module.params['state']}: {exc}")
    except OSError as exc:
        module.fail_json(msg=f"Error making artifact {module.params['state']}: {exc}", exception=traceback.format_exc())
    module.exit_json(**result)


class ManifestInputError(MeridianError, ValueError):
    """The ``manifest`` option is neither a readable envelope file nor an envelope dictionary."""


def read_manifest(value: Any) -> bytes:
    """The envelope bytes from a path or an inline dictionary."""
    if isinstance(value, dict):
        return json.dumps(value).encode("utf-8")
    if isinstance(value, str):
        try:
            with open(value, "rb") as handle:
                data = handle.read(_MAX_MANIFEST_BYTES + 1)
        except OSError as exc:
            raise ManifestInputError(f"cannot read the manifest file {value}: {exc.strerror or exc}") from exc
        if len(data) > _MAX_MANIFEST_BYTES:
            raise ManifestInputError(f"the manifest file {value} is larger than {_MAX_MANIFEST_BYTES} bytes")
        return data
    # The name is taken outside the f-string: ansible-core 2.16's pylint reads type() there as a type check.
    got = type(value).__name__
    raise ManifestInputError(f"manifest must be a path to an envelope file or the envelope as a dictionary (got {got})")


def run(
    params: dict[str, Any], *, check_mode: bool, diff: bool, warn: Callable[[str], None] = lambda _message: None
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
            lock_timeout=params["lock_timeout"],
        )
    else:
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
            config=FetchConfig(timeout=params["timeout"], attempts=params["attempts"]),
            check_mode=check_mode,
            lock_timeout=params["lock_timeout"],
        )
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


if __name__ == "__main__":
    main()
