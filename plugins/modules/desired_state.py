#!/usr/bin/python
# Copyright: (c) 2026, meridian.node developers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import annotations

DOCUMENTATION = r"""
module: desired_state
short_description: Verify a signed desired state on the host and record it as applied
version_added: 0.1.0
author:
  - Meridian node maintainers (@meridian)
description:
  - Verifies a C(DesiredState) DSSE envelope against the host policy's C(control) keys and threshold and
    against the host's durable applied state (highest generation applied, highest lease epoch seen), the
    same checks the agent made, because the apply side does not trust the agent.
  - Fails with the rejection code and message when the state is for another node, expired, not yet
    valid, replayed (a lower generation, or the applied generation with different content), from a
    fenced (older) lease epoch, signed by too few trusted keys, or malformed.
  - Returns what a reconcile playbook needs (artifacts, engines without their C(secret_env) values, artifact
    names in use).
  - With O(record=true), records the generation as applied; recording the same generation again changes
    nothing.
requirements:
  - pydantic, cryptography and PyYAML on the managed host.
options:
  envelope:
    description:
      - Path to a file holding the desired-state DSSE envelope (JSON), byte for byte as it was signed.
    type: path
    required: true
  node_id:
    description:
      - This node's id; a state for any other node is refused.
    type: str
    required: true
  record:
    description:
      - Record the generation as applied (run this last, after everything else converged).
    type: bool
    default: false
  secrets:
    description:
      - Also return C(engine_secret_env), the engines' C(secret_env) values. Run such a task with C(no_log).
    type: bool
    default: false
extends_documentation_fragment:
  - meridian.node.attributes
  - meridian.node.attributes.diff
  - meridian.node.host
"""

EXAMPLES = r"""
- name: Verify the desired state before changing anything
  meridian.node.desired_state:
    envelope: /etc/meridian-node/desired-state.json
    node_id: gpu-node-1
  register: verified

- name: Record the generation once everything converged
  meridian.node.desired_state:
    envelope: /etc/meridian-node/desired-state.json
    node_id: gpu-node-1
    record: true
"""

RETURN = r"""
generation:
  description: The state's generation.
  returned: success
  type: int
  sample: 7
lease_epoch:
  description: The lease epoch the state was issued under.
  returned: success
  type: int
  sample: 2
payload_sha256:
  description: sha256 of the signed payload.
  returned: success
  type: str
already_applied:
  description: Whether this generation (with these bytes) was already recorded as applied.
  returned: success
  type: bool
recorded:
  description: Whether this run recorded the generation.
  returned: success
  type: bool
signers:
  description: Key ids of the trusted keys that signed the state.
  returned: success
  type: list
  elements: str
artifacts:
  description: The artifacts to make present (name, version, manifest envelope, pin, optional source).
  returned: success
  type: list
  elements: dict
engines:
  description: The engine specs, C(env) whole, with C(secret_env) replaced by C(secret_env_keys), the variable
    names only.
  returned: success
  type: list
  elements: dict
in_use:
  description: Artifact names the desired engines use (never evicted).
  returned: success
  type: list
  elements: str
cordon:
  description: The state's cordon (GPUs, drain, reason); V(null) when it has none. See M(meridian.node.cordon).
  returned: success
  type: dict
engine_secret_env:
  description: The C(secret_env) values per engine name.
  returned: when O(secrets=true)
  type: dict
rejection:
  description: The rejection code (for example V(expired), V(replayed), V(stale-epoch), V(wrong-node)).
  returned: failure by rejection
  type: str
"""


from ansible.module_utils.basic import AnsibleModule

from ansible_collections.meridian.node.plugins.module_utils._module import run_module
from ansible_collections.meridian.node.plugins.module_utils.trust.desired_state_args import (
    ARGUMENT_SPEC,
    desired_state_outcome,
)


def main() -> None:
    module = AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True)
    run_module(module, desired_state_outcome(module.params, check_mode=module.check_mode))


if __name__ == "__main__":
    main()
