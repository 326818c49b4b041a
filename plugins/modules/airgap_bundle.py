#!/usr/bin/python
# Copyright: (c) 2026, meridian.node developers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import annotations

DOCUMENTATION = r"""
module: airgap_bundle
short_description: Verify an air-gap bundle, unpack it into scratch and stage its artifacts
version_added: 0.1.0
author:
  - Meridian node maintainers (@meridian)
description:
  - For hosts that do not run the agent (C(playbooks/airgap_apply.yml)). With O(state=unpacked), reads the
    bundle with the same verify-first reader as the agent's inbox (docs/AIR_GAP.md), against the host
    policy's C(air_gap_authority), C(control) and C(artifact) keys and the host's durable applied state, so
    the generation, epoch and expiry rules are the same as online apply. It then stages every artifact the
    bundle carries into the store with C(verified_artifact)'s code and writes the control-signed desired
    state to C(envelope) for C(reconcile.yml).
  - A refused bundle fails with its C(reason) (for example V(digest-mismatch), V(replayed), V(expired)), and
    nothing outside the policy's C(air_gap.scratch_dir) is written.
  - A bundle that ships its own C(playbooks/) is refused here (V(ships-playbooks)) - run those with the agent,
    or with C(ansible-playbook) from the unpacked tree yourself.
  - With O(state=absent), removes a work directory an earlier run returned (only a C(bundle-*) directory
    directly inside C(air_gap.scratch_dir), compared after resolving symlinks).
  - In check mode the bundle is verified completely (every member read and hashed) and nothing is written.
requirements:
  - pydantic, cryptography and PyYAML on the managed host.
options:
  bundle:
    description:
      - Path to the bundle (one plain tar file, as C(meridian-node make-bundle) writes it).
      - Required with O(state=unpacked).
    type: path
  node_id:
    description:
      - This node's id; a bundle for any other node is refused. Required with O(state=unpacked).
    type: str
  state:
    description:
      - V(unpacked) verifies, unpacks and stages; V(absent) removes O(directory).
    type: str
    choices: [unpacked, absent]
    default: unpacked
  directory:
    description:
      - The work directory to remove with O(state=absent) (the C(directory) an earlier run returned).
    type: path
extends_documentation_fragment:
  - meridian.node.attributes
  - meridian.node.host
attributes:
  check_mode:
    support: full
  diff_mode:
    support: none
  idempotent:
    support: none
    details: Each O(state=unpacked) run unpacks into a new work directory; staging artifacts is idempotent.
"""

EXAMPLES = r"""
- name: Verify and unpack the bundle
  meridian.node.airgap_bundle:
    bundle: /media/usb/gpu-node-01-g42.tar
    node_id: gpu-node-01
  register: unpacked

- name: Remove the work directory
  meridian.node.airgap_bundle:
    state: absent
    directory: "{{ unpacked.directory }}"
"""

RETURN = r"""
bundle_id:
  description: The bundle's id.
  returned: O(state=unpacked)
  type: str
generation:
  description: The generation of the desired state inside.
  returned: O(state=unpacked)
  type: int
already_applied:
  description: Whether this generation is the one already recorded as applied (applying it again is a no-op).
  returned: O(state=unpacked)
  type: bool
envelope:
  description: The control-signed desired-state envelope, written in the work directory, for C(reconcile.yml).
  returned: O(state=unpacked), not in check mode
  type: str
directory:
  description: The work directory in scratch; remove it with O(state=absent) when done.
  returned: O(state=unpacked), not in check mode
  type: str
artifacts:
  description: Each artifact staged into the store, with whether staging changed the store.
  returned: O(state=unpacked)
  type: list
  elements: dict
bytes:
  description: Bytes of members read and hashed.
  returned: O(state=unpacked)
  type: int
reason:
  description: Why the bundle was refused (a reader or verifier reason code).
  returned: failure by refusal
  type: str
member:
  description: The tar member at fault, when one is.
  returned: failure by refusal, when a member is at fault
  type: str
"""

from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Optional

from ansible.module_utils.basic import AnsibleModule, missing_required_lib

from ansible_collections.meridian.node.plugins.module_utils._compat import UTC
from ansible_collections.meridian.node.plugins.module_utils._module import HOST_ARGS
from ansible_collections.meridian.node.plugins.module_utils.airgap.bundle_reader import (
    BundleRefused,
    check_bundle,
    unpack_bundle,
)
from ansible_collections.meridian.node.plugins.module_utils.airgap.bundle_stage import (
    discard_work_dir,
    stage_artifacts,
    write_envelope,
)
from ansible_collections.meridian.node.plugins.module_utils.artifacts.fetch import ArtifactError
from ansible_collections.meridian.node.plugins.module_utils.artifacts.plan import ArtifactStoreError
from ansible_collections.meridian.node.plugins.module_utils.trust.applied_state import StateStore, StateStoreError
from ansible_collections.meridian.node.plugins.module_utils.trust.policy import PolicyError, load_policy
from ansible_collections.meridian.node.plugins.module_utils.trust.verify import missing_libraries


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "bundle": {"type": "path"},
            "node_id": {"type": "str"},
            **HOST_ARGS,
            "state": {"type": "str", "choices": ["unpacked", "absent"], "default": "unpacked"},
            "directory": {"type": "path"},
        },
        required_if=[("state", "unpacked", ("bundle", "node_id")), ("state", "absent", ("directory",))],
        supports_check_mode=True,
    )
    for package, error in missing_libraries():
        module.fail_json(msg=missing_required_lib(package), exception=error)
    params = module.params
    try:
        policy = load_policy(params["policy"])
    except PolicyError as exc:
        module.fail_json(msg=f"Error reading policy {params['policy']}: {exc}")
    if params["state"] == "absent":
        try:
            removed = False if module.check_mode else discard_work_dir(params["directory"], policy.air_gap.scratch_dir)
        except (ValueError, OSError) as exc:
            module.fail_json(msg=f"Error removing bundle work directory {params['directory']}: {exc}")
        module.exit_json(changed=removed)
    bundle = params["bundle"]
    try:
        applied = StateStore(params["state_dir"]).load()
        now = datetime.now(UTC)
        if module.check_mode:
            checked = check_bundle(bundle, policy, node_id=params["node_id"], now=now, applied=applied)
            _refuse_playbooks(module, bundle, [entry.path for entry in checked.verified.bundle.files])
            module.exit_json(
                changed=not checked.verified.desired.already_applied,
                bundle_id=checked.verified.bundle.bundle_id,
                generation=checked.verified.desired.state.generation,
                already_applied=checked.verified.desired.already_applied,
                artifacts=[{"name": m.manifest.name, "version": m.manifest.version} for m in checked.manifests],
                bytes=checked.bytes_read,
            )
        unpacked = unpack_bundle(bundle, policy, node_id=params["node_id"], now=now, applied=applied)
    except BundleRefused as exc:
        module.fail_json(msg=f"Error reading bundle {bundle}: {exc}", reason=exc.reason.value, member=exc.member)
    except StateStoreError as exc:
        module.fail_json(msg=f"Error reading the applied-state record in {params['state_dir']}: {exc}")
    _refuse_playbooks(module, bundle, list(unpacked.files), unpacked.discard)
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
            module.fail_json(msg=f"Error accepting bundle {bundle}, nothing was applied: {exc}", reason="not-accepted")
    try:
        staged = stage_artifacts(unpacked, policy, module.warn)
        envelope = write_envelope(unpacked)
    except (ArtifactError, ArtifactStoreError, OSError, ValueError) as exc:
        unpacked.discard()
        module.fail_json(msg=f"Error staging the artifacts of bundle {bundle}: {exc}", reason="staging-failed")
    module.exit_json(
        changed=not desired.already_applied or any(item["changed"] for item in staged),
        bundle_id=unpacked.verified.bundle.bundle_id,
        generation=desired.state.generation,
        already_applied=desired.already_applied,
        envelope=envelope,
        directory=unpacked.directory,
        artifacts=staged,
        bytes=unpacked.bytes_read,
    )


def _refuse_playbooks(
    module: AnsibleModule, bundle: str, paths: Sequence[str], cleanup: Optional[Callable[[], None]] = None
) -> None:
    if any(path.startswith("playbooks/") for path in paths):
        if cleanup is not None:
            cleanup()
        module.fail_json(
            msg=f"Error reading bundle {bundle}: it ships its own playbooks/, which this module does not run: "
            "apply it with the agent (mode air-gapped), or run its playbooks/reconcile.yml yourself",
            reason="ships-playbooks",
        )


if __name__ == "__main__":
    main()
