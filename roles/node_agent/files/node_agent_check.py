"""Checks the node_agent role runs on the host, with the agent's own code from its virtualenv.

Run as ``/opt/meridian-node/bin/python node_agent_check.py VERB PATH``:

- ``key PATH``: PATH is an Ed25519 public key the policy can trust (a private key is refused);
- ``policy PATH``: PATH parses as the trust policy, keys included (``validate:`` of the policy template);
- ``identity CONFIG``: prints JSON saying whether the node named in CONFIG holds a certificate that is
  still valid and issued for that node id, so that the role enrolls only when it does not.

Exit status 0 when the check passes (``identity`` always exits 0 and says why in ``reason``), 1 with
``error: ...`` on standard error otherwise. The role's ``validate:`` shows that message when it fails.
"""

from __future__ import annotations

import importlib
import json
import sys
from datetime import UTC, datetime
from pathlib import Path

# Importing the agent's package puts the collection that shipped with it on sys.path
# (meridian_node_agent/__init__.py): the checks use the module_utils of the agent they check for.
importlib.import_module("meridian_node_agent")


def check_key(path: str) -> int:
    from ansible_collections.meridian.node.plugins.module_utils.trust.dsse import KeyLoadError, load_public_key_pem

    try:
        load_public_key_pem(Path(path).read_bytes())
    except (OSError, KeyLoadError) as exc:
        print(f"error: trusted key {path}: {exc}", file=sys.stderr)
        return 1
    return 0


def check_policy(path: str) -> int:
    from ansible_collections.meridian.node.plugins.module_utils.trust.policy import PolicyError, load_policy

    try:
        load_policy(path)
    except PolicyError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


def identity(config_path: str) -> int:
    from meridian_node_agent.agent_side.identity import IdentityError, NodeIdentity
    from meridian_node_agent.config import ConfigError, load_config

    try:
        config = load_config(config_path)
    except ConfigError as exc:
        print(json.dumps({"valid": False, "reason": str(exc)}))
        return 0
    node = NodeIdentity(config.identity_dir)
    result: dict[str, object] = {"valid": False, "node_id": config.node_id, "enrolled": node.enrolled}
    if not node.enrolled:
        result["reason"] = f"no key, certificate and CA bundle in {config.identity_dir}"
    else:
        try:
            info = node.certificate()
        except IdentityError as exc:
            result["reason"] = str(exc)
        else:
            result["not_after"] = info.not_after.isoformat()
            result["node_ids"] = list(info.node_ids)
            if config.node_id not in info.node_ids:
                result["reason"] = f"the certificate is for {', '.join(info.node_ids)}, not {config.node_id}"
            elif info.remaining(datetime.now(UTC)) <= 0:
                result["reason"] = f"the certificate expired at {info.not_after.isoformat()}"
            else:
                result["valid"] = True
                result["reason"] = f"a certificate for {config.node_id} valid until {info.not_after.isoformat()}"
    print(json.dumps(result, sort_keys=True))
    return 0


def main(argv: list[str]) -> int:
    verbs = {"key": check_key, "policy": check_policy, "identity": identity}
    if len(argv) != 2 or argv[0] not in verbs:
        print(f"usage: node_agent_check.py {{{'|'.join(verbs)}}} PATH", file=sys.stderr)
        return 2
    return verbs[argv[0]](argv[1])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
