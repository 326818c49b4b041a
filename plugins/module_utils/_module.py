"""What every module shell shares: the host options and their defaults, written once, and ``run_module``.

``HOST_ARGS`` is the argument spec of ``policy`` and ``state_dir`` (documented by the ``meridian.node.host``
doc fragment); ``POLICY_ARGS`` and ``STATE_DIR_ARGS`` each one of them. Module code that reads a parameter
dict without ``AnsibleModule`` (engine_set's action plugin, the agent) takes the defaults from here too.

The node's directories are named here too: root's (``DEFAULT_STATE_DIR``), the agent's (``AGENT_STATE_DIR``) and
the artifact store's (``DEFAULT_STORE_PATH``); the agent's config, the policy and the paths no engine may mount
import them.

``run_module`` is the end of every shell: it hands the dict an ``*_outcome`` function returned to Ansible.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ansible.module_utils.basic import AnsibleModule

__all__ = [
    "AGENT_STATE_DIR",
    "DEFAULT_POLICY",
    "DEFAULT_STATE_DIR",
    "DEFAULT_STORE_PATH",
    "HOST_ARGS",
    "POLICY_ARGS",
    "STATE_DIR_ARGS",
    "run_module",
]

DEFAULT_POLICY = "/etc/meridian/policy.yaml"
# The node's directories, each named once here (the systemd units' StateDirectory= and roles/node_agent say the same).
# Root's own directory (the apply unit's StateDirectory=): the record, the journal, the draining marks.
DEFAULT_STATE_DIR = "/var/lib/meridian-node-apply"
# The agent's own directory (meridian-node.service's StateDirectory=): identity, spool, status, oplog.
AGENT_STATE_DIR = "/var/lib/meridian-node"
# The artifact store: root's too, a directory of its own, so no other user can rename or replace it.
DEFAULT_STORE_PATH = "/var/lib/meridian-node-artifacts"

POLICY_ARGS: dict[str, Any] = {"policy": {"type": "path", "default": DEFAULT_POLICY}}
STATE_DIR_ARGS: dict[str, Any] = {"state_dir": {"type": "path", "default": DEFAULT_STATE_DIR}}
HOST_ARGS: dict[str, Any] = {**POLICY_ARGS, **STATE_DIR_ARGS}


def run_module(module: AnsibleModule, outcome: Mapping[str, Any]) -> None:
    """End the module with ``outcome``: each of its ``warnings`` through ``module.warn``, then ``fail_json``
    when ``failed`` is true (``msg`` and, for a missing library, ``exception`` are in it), else ``exit_json``
    with the rest of the keys as they are."""
    result = dict(outcome)
    for warning in result.pop("warnings", None) or []:
        module.warn(warning)
    if result.pop("failed", False):
        module.fail_json(**result)
    else:
        module.exit_json(**result)
