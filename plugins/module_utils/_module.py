"""What every module shell shares: the host options and their defaults, written once.

``HOST_ARGS`` is the argument spec of ``policy`` and ``state_dir`` (documented by the ``meridian.node.host``
doc fragment); ``POLICY_ARGS`` and ``STATE_DIR_ARGS`` each one of them. Module code that reads a parameter
dict without ``AnsibleModule`` (engine_set's action plugin, the agent) takes the defaults from here too.
"""

from __future__ import annotations

from typing import Any

__all__ = ["DEFAULT_POLICY", "DEFAULT_STATE_DIR", "HOST_ARGS", "POLICY_ARGS", "STATE_DIR_ARGS"]

DEFAULT_POLICY = "/etc/meridian/policy.yaml"
# Root's own directory (the apply unit's StateDirectory=): the record, the journal, the draining marks.
DEFAULT_STATE_DIR = "/var/lib/meridian-node-apply"

POLICY_ARGS: dict[str, Any] = {"policy": {"type": "path", "default": DEFAULT_POLICY}}
STATE_DIR_ARGS: dict[str, Any] = {"state_dir": {"type": "path", "default": DEFAULT_STATE_DIR}}
HOST_ARGS: dict[str, Any] = {**POLICY_ARGS, **STATE_DIR_ARGS}
