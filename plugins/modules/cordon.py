#!/usr/bin/python
# Copyright: (c) 2026, meridian.node developers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import annotations

DOCUMENTATION = r"""
module: cordon
short_description: Take GPUs or a whole GPU host out of placement, draining their engines if asked
version_added: 0.1.0
author:
  - Meridian node maintainers (@meridian)
description:
  - Writes the host's cordon (C(cordon.json) under O(state_dir)) first, so from that moment
    M(meridian.node.engine_instance) and M(meridian.node.engine_set) place no new engine on the cordoned GPUs
    (check C(placement-cordoned); C(force) in an engine spec does not override a cordon).
  - With O(drain=true) it then drains and stops every engine of meridian.node on those GPUs, one at a time, as
    M(meridian.node.drain) does, and records each as held. Held engines stay stopped through reconciles and the
    agent's supervision until the cordon is lifted.
  - Without O(gpus) the whole node is cordoned; a node cordon drains every engine unless O(drain=false).
  - O(state=absent) lifts the cordon - starts exactly the engines it held, clears their draining marks and
    removes the file. Engines the cordon did not stop are left as they are.
  - The agent reports the cordon in its observations and C(meridian-node status). The signed desired state
    may carry a cordon too; the two are read together (the union of their GPUs).
requirements:
  - A Docker Engine (API 1.41 or newer) on the managed host, reached through its socket or E(DOCKER_HOST).
  - nvidia-ml-py on the host when O(gpus) is set and engines are to be matched against GPUs named differently
    (by index and by uuid).
options:
  state:
    description:
      - V(present) - the cordon is in force as given (a different cordon replaces the old one; engines the old
        one held stay held).
      - V(absent) - no cordon; the engines it held are started again.
    type: str
    choices: [present, absent]
    default: present
  gpus:
    description:
      - GPUs to cordon, by uuid, index or MIG instance uuid. Empty - the whole node.
    type: list
    elements: str
    default: []
  drain:
    description:
      - Drain and stop the engines on the cordoned GPUs, and hold them stopped until the cordon is lifted.
      - Defaults to V(true) for a node cordon and V(false) for a GPU cordon (running engines keep serving;
        only new placements are refused).
    type: bool
  reason:
    description:
      - Why, recorded in the cordon and in the held engines' draining marks, and shown in observations.
    type: str
  timeout:
    description:
      - Seconds to wait for the requests in flight of each engine drained.
    type: int
    default: 300
  grace:
    description:
      - Seconds to wait for an engine that publishes no in-flight metrics (never more than O(timeout)).
    type: int
    default: 10
  force:
    description:
      - After O(timeout), stop the engine anyway instead of failing (the cordon stays in force either way).
    type: bool
    default: false
extends_documentation_fragment:
  - meridian.node.attributes
  - meridian.node.attributes.no_diff
  - meridian.node.host.state_dir
seealso:
  - module: meridian.node.drain
  - module: meridian.node.engine_set
"""

EXAMPLES = r"""
- name: Take GPU 3 out of placement, leaving what runs on it serving
  meridian.node.cordon:
    gpus: ["3"]
    reason: XID 79 last night, waiting for the vendor

- name: Cordon the node for a driver update, draining every engine
  meridian.node.cordon:
    reason: driver 550 -> 570

- name: Put it back
  meridian.node.cordon:
    state: absent
"""

RETURN = r"""
cordon:
  description: The cordon after the run (in check mode, as it would be); V(null) when there is none.
  returned: always
  type: dict
  contains:
    gpus:
      description: The cordoned GPUs as given; empty for a node cordon.
      type: list
      elements: str
    drain:
      description: Whether engines on them are drained and held.
      type: bool
    reason:
      description: Why.
      type: str
    since:
      description: When the cordon was first put in force (RFC 3339 UTC).
      type: str
    held:
      description: The engines the cordon stopped and will start again when lifted.
      type: list
      elements: str
drained:
  description: Engines this run drained and stopped.
  returned: always
  type: list
  elements: str
started:
  description: Engines this run started again, lifting the cordon.
  returned: always
  type: list
  elements: str
"""

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.meridian.node.plugins.module_utils._module import run_module
from ansible_collections.meridian.node.plugins.module_utils.engines.cordon_args import ARGUMENT_SPEC, cordon_outcome


def main() -> None:
    module = AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True)
    run_module(module, cordon_outcome(module.params, check_mode=module.check_mode))


if __name__ == "__main__":
    main()
