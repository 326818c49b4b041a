"""A meridian-node site on a systemd test host (``systemd_host.installed_host``): what the tests under
tests/system/systemd_host/ each set up the same way, as docs/SECURITY.md tells an operator to.

``install_site`` writes the trusted keys, the policy (root's, 0644), the agent's config (root:meridian,
0640), checks it with ``meridian-node check-config`` and makes the agent's directory as the unit's
``StateDirectory=`` would, so that enrolling (``enroll``) can write there before the agent first starts.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import yaml

from ansible_collections.meridian.node.tests.support.systemd_host import VENV, SystemdHost

__all__ = [
    "AGENT_DIR",
    "BIN",
    "CONFIG",
    "POLICY",
    "ROOT_DIR",
    "as_meridian",
    "enroll",
    "install_site",
]

BIN = f"{VENV}/bin/meridian-node"
CONFIG = "/etc/meridian-node/config.yaml"
POLICY = "/etc/meridian/policy.yaml"
AGENT_DIR, ROOT_DIR = "/var/lib/meridian-node", "/var/lib/meridian-node-apply"
_CA = "/etc/meridian-node/ca.pem"


def install_site(
    host: SystemdHost,
    *,
    policy: Mapping[str, Any],
    config: Mapping[str, Any],
    keys: Mapping[str, bytes],
    ca_bundle: bytes | None = None,
) -> None:
    """Install ``keys`` (a name under /etc/meridian/keys -> PEM; the policy names them as ``keys/NAME``), the
    policy, the control plane's CA (when the site has one) and the config; ``check-config`` must pass."""
    for name, pem in keys.items():
        host.put_file(f"/etc/meridian/keys/{name}", pem, mode=0o644)
    host.put_file(POLICY, yaml.safe_dump(dict(policy)).encode(), mode=0o644)
    if ca_bundle is not None:
        host.put_file(_CA, ca_bundle, mode=0o644)
    host.put_file(CONFIG, yaml.safe_dump(dict(config)).encode(), mode=0o640, owner="root:meridian")
    host.exec(["install", "-d", "-o", "meridian", "-g", "meridian", "-m", "0750", AGENT_DIR])
    host.exec([BIN, "check-config"])


def enroll(host: SystemdHost, token: str) -> None:
    """``meridian-node enroll`` as the agent's user, with the CA ``install_site`` wrote."""
    host.exec(["runuser", "-u", "meridian", "--", BIN, "enroll", "--token", token, "--ca-bundle", _CA])


def as_meridian(host: SystemdHost, script: str, *, check: bool = True, input: bytes | None = None) -> Any:
    """``sh -euc script`` as the agent's user (what an attacker holding that account can do)."""
    return host.exec(["runuser", "-u", "meridian", "--", "sh", "-euc", script], check=check, input=input)
