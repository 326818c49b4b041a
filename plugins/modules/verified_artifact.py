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
  progress_file:
    description:
      - A file to keep the byte progress of this run's downloads in while they run (JSON, replaced at most once a
        second, mode 0640, group its directory's), for the pull agent to show in its observations and status.
      - Its directory must be a real directory owned by the user the module runs as and writable by no one else;
        otherwise no progress is written and the run warns. Downloads run the same either way.
    type: path
extends_documentation_fragment:
  - meridian.node.attributes
  - meridian.node.attributes.diff
  - meridian.node.host.policy
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

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.meridian.node.plugins.module_utils._module import run_module
from ansible_collections.meridian.node.plugins.module_utils.artifacts.verified_args import (
    ARGUMENT_SPEC,
    verified_artifact_outcome,
)


def main() -> None:
    module = AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True)
    # module._diff: whether the task runs with --diff; AnsibleModule has no public name for it.
    outcome = verified_artifact_outcome(module.params, check_mode=module.check_mode, diff=module._diff)
    run_module(module, outcome)


if __name__ == "__main__":
    main()
