#!/usr/bin/python
# Copyright: (c) 2026, meridian.node developers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import annotations

DOCUMENTATION = r"""
module: engine_info
short_description: List the inference engines on a host and the room left for more
version_added: 0.1.0
author:
  - Meridian node maintainers (@meridian)
description:
  - Lists every inference engine container on the host's Docker Engine.
  - Engines run by M(meridian.node.engine_instance) (meridian.node's ownership labels) are listed with
    C(managed=true), their Docker state, whether their readiness probe answers, and whether they are marked
    draining (by M(meridian.node.drain) or a drain-then-replace, under O(state_dir)).
  - Other containers that look like an inference engine (by image name or by a port only one engine uses)
    are listed with C(managed=false). They are only looked at, never changed.
  - Also returns the capacity a new engine could still get - free VRAM per GPU and MIG instance (read through
    NVML, after the VRAM reserved by managed engines) and free ports in the policy's port range on its bind
    address.
  - Never changes anything on the host.
requirements:
  - PyYAML on the managed host, when a policy file exists (to read it).
  - A Docker Engine (API 1.41 or newer), reached through its socket or E(DOCKER_HOST); the Docker SDK is not
    needed.
  - nvidia-ml-py on the managed host for VRAM capacity; without it (or without a GPU) no VRAM is reported.
options:
  managed_only:
    description:
      - List only the engines run by M(meridian.node.engine_instance), leaving out everybody else's.
    type: bool
    default: false
  owner:
    description:
      - List only engines run by M(meridian.node.engine_instance) with exactly this
        O(meridian.node.engine_instance#module:owner) - the engines one converger started. The reconcile playbook
        uses C(agent:<node id>) to find the engines it may remove.
      - Under a policy that allows no image no such engine can exist; the list is empty and the Docker Engine is
        not asked (unless O(capacity=true)), so hosts that run no engines need no Docker Engine.
    type: str
  probe:
    description:
      - Ask each running engine's readiness endpoint once (one HTTP GET, up to one second each).
      - With V(false), C(ready) is V(false) for every engine; use it when only names and states are needed.
    type: bool
    default: true
  capacity:
    description:
      - Compute the capacity left (reads every GPU through NVML once, and tries the policy's ports).
      - With V(false), the C(capacity) result is V(null).
    type: bool
    default: true
extends_documentation_fragment:
  - meridian.node.attributes
  - meridian.node.attributes.no_diff
  - meridian.node.host
notes:
  - Recognising someone else's engine is a heuristic that errs towards "not an engine" - a container whose
    image name and ports say nothing is left out of the list.
  - Listing needs no policy. Without a file at O(policy) the engines are listed all the same; only
    C(capacity.free_ports) needs one (the policy's C(engines.port_range) and C(engines.bind_address)) and is
    V(null), with a warning when O(capacity=true). A policy file that exists must be valid, or the task fails.
seealso:
  - module: meridian.node.engine_instance
  - module: meridian.node.drain
  - module: meridian.node.gpu_facts
"""

EXAMPLES = r"""
- name: List the engines on the GPU hosts and the room left
  meridian.node.engine_info:
  register: engines

- name: Show the engines that take traffic
  ansible.builtin.debug:
    msg: "{{ item.name }} ({{ item.driver }}) on port {{ item.port }}"
  loop: "{{ engines.engines | selectattr('ready') | rejectattr('draining') }}"
  loop_control:
    label: "{{ item.name }}"

- name: Names of the engines meridian.node runs here, quickly (no probes, no NVML)
  meridian.node.engine_info:
    managed_only: true
    probe: false
    capacity: false
  register: ours
"""

RETURN = r"""
engines:
  description: The engines on the host - meridian.node's first, then others, each group by name.
  returned: always
  type: list
  elements: dict
  contains:
    name:
      description: The engine's name (for managed engines, the name given to M(meridian.node.engine_instance)).
      type: str
      sample: llama-70b
    managed:
      description: Whether meridian.node runs it. Engines with V(false) are never touched by this collection.
      type: bool
      sample: true
    driver:
      description: The engine kind (V(vllm), V(tgi), V(sglang), V(ollama), V(llamacpp), V(lmdeploy),
        V(openai)); for other people's engines, the kind it looks like.
      type: str
      sample: vllm
    image:
      description: The image reference it runs.
      type: str
      sample: vllm/vllm-openai@sha256:0d5d9c1a6e1c3b1f7e4a3f0b6b9e2c8d7a1f5e4d3c2b1a0f9e8d7c6b5a4f3e2d
    state:
      description: Docker's state of the container, such as V(running), V(exited) or V(created).
      type: str
      sample: running
    ready:
      description: Whether its readiness probe answered just now; V(false) when not probed.
      type: bool
      sample: true
    draining:
      description: Whether it is marked draining (no new work should reach it).
      type: bool
      sample: false
    port:
      description: The host port it is published on; V(null) when it publishes none.
      type: int
      sample: 8001
    served_model_name:
      description: The model name clients ask for; V(null) when not known.
      type: str
      sample: llama-3.1-70b
    gpus:
      description:
        - For engines meridian.node runs, the GPUs its spec asked for, as the spec named them (GPU index, GPU
          uuid or MIG instance uuid). Empty for other people's engines and for engines on no GPU.
      type: list
      elements: str
      sample: ["GPU-2f1b7c2e-8d3a-4c51-b0e6-1a9e4f7d3c01"]
    min_vram_mib:
      description:
        - For engines meridian.node runs, the VRAM in MiB its spec reserves on each of its GPUs; V(0) for other
          people's engines and when not known.
      type: int
      sample: 40000
capacity:
  description: What a new engine could still get; V(null) when O(capacity=false).
  returned: always
  type: dict
  contains:
    vram_free_mib:
      description: Free VRAM in MiB per GPU uuid and MIG instance uuid, after the reservations of managed
        engines; empty without NVML.
      type: dict
      sample: {"GPU-2f1b7c2e-8d3a-4c51-b0e6-1a9e4f7d3c01": 40960}
    free_ports:
      description: The lowest (up to 100) ports of the policy's range that no container publishes and that
        can be bound on the policy's bind address; V(null) when the host has no policy file.
      type: list
      elements: int
      sample: [8002, 8003, 8004]
"""

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.meridian.node.plugins.module_utils._module import run_module
from ansible_collections.meridian.node.plugins.module_utils.engines.info_args import ARGUMENT_SPEC, engine_info_outcome


def main() -> None:
    module = AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True)
    run_module(module, engine_info_outcome(module.params, check_mode=module.check_mode))


if __name__ == "__main__":
    main()
