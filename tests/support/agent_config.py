"""The smallest managed-host config ``meridian-node check-config`` accepts, and the policy it names: the base the
config loader's tests change one field at a time (tests/agent/test_config.py), and what the packaging tests check
an installed agent with (tests/system/packaging/test_packaging_wheel.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ansible_collections.meridian.node.tests.support.trust_fixtures import make_key, write_policy

__all__ = ["MANAGED_HOST_CONFIG", "write_managed_host_policy"]

# Its paths are relative to the config file's directory: write_managed_host_policy writes policy.yaml there.
MANAGED_HOST_CONFIG: dict[str, Any] = {
    "node_id": "gpu-node-1",
    "mode": "managed-host",
    "policy": "policy.yaml",
    "state_dir": "state",
    "control_plane": {"url": "https://meridian.example:8443"},
}


def write_managed_host_policy(directory: Path) -> Path:
    """``directory/policy.yaml`` trusting a fresh control key and allowing the agent's two host modes."""
    return write_policy(
        directory, control=[make_key()], extra={"agent": {"allowed_modes": ["observe-only", "managed-host"]}}
    )
