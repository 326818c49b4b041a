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
  - In check mode the bundle is verified completely (every member read and hashed) and nothing is written;
    the policy's C(air_gap.scratch_dir) is checked as the real run needs it (it can be made, it would be
    trusted, it has room), so check mode fails where the real run would.
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
  - meridian.node.attributes.no_diff
  - meridian.node.host
attributes:
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
images:
  description:
    - Each engine image the bundle carries (C(images/<name>.tar)), verified against the state's pin, with
      C(member), C(reference), C(image_id), C(bytes) and C(loaded) (loaded into Docker by this run, or in check
      mode, would be; false when Docker already had it by its pin).
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

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.meridian.node.plugins.module_utils._module import run_module
from ansible_collections.meridian.node.plugins.module_utils.airgap.bundle_args import (
    ARGUMENT_SPEC,
    REQUIRED_IF,
    airgap_bundle_outcome,
)


def main() -> None:
    module = AnsibleModule(argument_spec=ARGUMENT_SPEC, required_if=REQUIRED_IF, supports_check_mode=True)
    run_module(module, airgap_bundle_outcome(module.params, check_mode=module.check_mode))


if __name__ == "__main__":
    main()
