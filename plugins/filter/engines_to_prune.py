# Copyright: (c) 2026, meridian.node developers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ansible.errors import AnsibleFilterError

from ansible_collections.meridian.node.plugins.module_utils.engine_prune import prune_order

DOCUMENTATION = r"""
name: engines_to_prune
short_description: Split the engines a desired state drops into those to remove before and after converging
version_added: 0.1.0
author:
  - Meridian node maintainers (@meridian)
positional: _input, desired
description:
  - Takes the engines a converger owns on a host (the C(engines) of M(meridian.node.engine_info) with
    O(meridian.node.engine_info#module:owner)) and the engines the desired state lists (the C(engines) of
    M(meridian.node.desired_state)), and names the owned engines the state no longer lists.
  - Those that conflict with a desired engine still to be placed - the same port, or a GPU both may be on -
    come in RV(_value.first); placement would refuse the desired engine while they hold the port or the VRAM,
    so they must be drained and removed before converging. The others come in RV(_value.later), to be removed
    after the desired engines serve.
  - A desired engine is still to be placed unless it already runs under its own name on the same port, with
    the same GPUs and at least the VRAM it asks for.
  - GPUs named the same way (both by index, both by GPU uuid, both by MIG uuid) overlap only when equal. A GPU
    named by index on one side and by uuid on the other, or a MIG instance and a GPU uuid, cannot be told apart
    without NVML, so they count as overlapping.
options:
  _input:
    description: The owned engines on the host; each a dict with C(name), C(port), C(gpus) and C(min_vram_mib).
    type: list
    elements: dict
    required: true
  desired:
    description: The desired state's engines; each a dict with C(name), C(port), C(gpus), C(min_vram_mib) and
      C(state).
    type: list
    elements: dict
    required: true
seealso:
  - module: meridian.node.engine_info
  - module: meridian.node.desired_state
"""

EXAMPLES = r"""
- name: Order the pruning of the engines the state dropped
  ansible.builtin.set_fact:
    prune: "{{ owned.engines | meridian.node.engines_to_prune(verified.engines) }}"

- name: Drain the dropped engines that hold a port or GPU a desired engine needs
  meridian.node.drain:
    name: "{{ item }}"
    state: drained
    stop: true
  loop: "{{ prune.first }}"
"""

RETURN = r"""
_value:
  description: The names of the dropped engines, in two lists.
  type: dict
  contains:
    first:
      description: Dropped engines to remove before converging (they hold what a desired engine needs), by name.
      type: list
      elements: str
      sample: [chat-old]
    later:
      description: The other dropped engines, to remove after converging, by name.
      type: list
      elements: str
      sample: [embed-old]
"""


def engines_to_prune(
    running: Sequence[Mapping[str, Any]], desired: Sequence[Mapping[str, Any]]
) -> dict[str, list[str]]:
    """``{"first": [...], "later": [...]}``: see DOCUMENTATION."""
    try:
        order = prune_order(running, desired)
    except (KeyError, TypeError, ValueError) as exc:
        raise AnsibleFilterError(
            f"engines_to_prune: cannot read the engines ({type(exc).__name__}: {exc}); pass engine_info's "
            "'engines' and desired_state's 'engines', lists of dicts with a name, port and gpus"
        ) from exc
    return {"first": order.first, "later": order.later}


class FilterModule:
    """meridian.node's filters."""

    def filters(self) -> dict[str, Callable[..., Any]]:
        return {"engines_to_prune": engines_to_prune}
