#!/usr/bin/python
# Copyright: (c) 2026, meridian.node developers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import annotations

DOCUMENTATION = r"""
module: drain
short_description: Take an inference engine out of service without dropping its requests
version_added: 0.1.0
author:
  - Meridian node maintainers (@meridian)
description:
  - Marks an engine run by M(meridian.node.engine_instance) draining, durably on the host (under
    O(state_dir)), so the agent's observations and the serving projection drop it before anything else
    happens.
  - Then waits until the engine's own running and waiting request gauges reach zero, or O(timeout) passes.
    Engines without in-flight metrics (Ollama, generic OpenAI-compatible servers) are given O(grace) seconds.
  - Then, with O(stop=true), stops the container with its driver's stop signal and stop timeout.
  - On a timeout the module fails and leaves the engine running but still marked draining (a re-run keeps
    waiting); with O(force=true) it goes on and stops the engine anyway, reporting what was still in flight.
  - Draining an engine that is already drained (marked, and stopped when O(stop=true)) or that does not
    exist changes nothing. O(state=undrained) removes the mark, putting a running engine back in service.
  - Only containers with meridian.node's ownership labels are touched; any other container with the name
    makes the module fail, untouched.
requirements:
  - A Docker Engine (API 1.41 or newer) on the managed host, reached through its socket or E(DOCKER_HOST);
    no Python package is needed.
options:
  name:
    description:
      - The engine's name (its container's name).
    type: str
    required: true
  state:
    description:
      - V(drained) - marked draining, idle, and stopped when O(stop=true).
      - V(undrained) - not marked draining. A stopped engine is not started again; use
        M(meridian.node.engine_instance) with O(meridian.node.engine_instance#module:state=started) for that.
    type: str
    choices: [drained, undrained]
    default: drained
  timeout:
    description:
      - Seconds to wait for the requests in flight to finish.
    type: int
    default: 300
  grace:
    description:
      - Seconds to wait for an engine that publishes no in-flight metrics (never more than O(timeout)).
    type: int
    default: 10
  force:
    description:
      - After O(timeout), go on anyway (stop the engine when O(stop=true)) instead of failing. Requests still
        in flight are then lost on engines that abort them on their stop signal.
    type: bool
    default: false
  stop:
    description:
      - Stop the container once it is idle.
    type: bool
    default: true
  stop_timeout:
    description:
      - Seconds the engine gets to shut down after its stop signal before it is killed. Defaults to the
        driver's (long enough for that engine's own shutdown).
    type: int
  reason:
    description:
      - Why the engine is drained, recorded in its mark.
    type: str
    default: drained by meridian.node.drain
extends_documentation_fragment:
  - meridian.node.attributes
  - meridian.node.attributes.no_diff
  - meridian.node.host.state_dir
seealso:
  - module: meridian.node.engine_instance
"""

EXAMPLES = r"""
- name: Drain an engine and stop it, giving its requests up to ten minutes
  meridian.node.drain:
    name: llama-70b
    timeout: 600

- name: Take an engine out of service but keep it running
  meridian.node.drain:
    name: llama-70b
    stop: false

- name: Stop it even if requests are still running after two minutes
  meridian.node.drain:
    name: llama-70b
    timeout: 120
    force: true

- name: Put it back in service
  meridian.node.drain:
    name: llama-70b
    state: undrained
"""

RETURN = r"""
actions:
  description: What the run does or did, in order (C(mark), C(wait), C(stop), C(unmark)).
  returned: always
  type: list
  elements: str
  sample: [mark, wait, stop]
draining:
  description: Whether the engine is marked draining after the run (in check mode, would be).
  returned: always
  type: bool
waited_s:
  description: Seconds spent waiting for the requests in flight.
  returned: always
  type: float
  sample: 3.27
drained_by:
  description: How idleness was decided - V(metrics) (the gauges reached zero) or V(grace) (no metrics, waited
    O(grace)); V(null) when there was no wait.
  returned: always
  type: str
  sample: metrics
in_flight:
  description: The last reading of the engine's gauges; V(null) when it has none or they did not answer.
  returned: always
  type: dict
  contains:
    running:
      description: Requests being processed.
      type: int
    waiting:
      description: Requests queued.
      type: int
stopped:
  description: Whether this run stopped the container.
  returned: always
  type: bool
container:
  description: The engine's container after the run; V(null) when there is none.
  returned: always
  type: dict
  contains:
    id:
      description: Container id.
      type: str
    name:
      description: Container name.
      type: str
    status:
      description: Docker state, such as C(running) or C(exited).
      type: str
"""

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.meridian.node.plugins.module_utils._module import run_module
from ansible_collections.meridian.node.plugins.module_utils.engines.drain_args import ARGUMENT_SPEC, drain_outcome


def main() -> None:
    module = AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True)
    run_module(module, drain_outcome(module.params, check_mode=module.check_mode))


if __name__ == "__main__":
    main()
