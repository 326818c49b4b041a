"""``meridian-node check-config``: validate the agent's config and the policy it runs under."""

import argparse
import sys

from ansible_collections.meridian.node.plugins.module_utils.policy import ROLES, Policy, PolicyError, load_policy
from meridian_node_agent.config import ConfigError, load_config


def add_parsers(subparsers: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    check = subparsers.add_parser(
        "check-config",
        help="validate the agent config and its policy",
        description="Validate the config (--config) and the policy it names, and check that the policy "
        "allows the config's mode. Prints a summary; exit 0 when both are valid, 1 with every problem "
        "found otherwise.",
    )
    check.set_defaults(handler=cmd_check_config)


def cmd_check_config(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"config {args.config}: node {config.node_id}, mode {config.mode}, state in {config.state_dir}")
    try:
        policy = load_policy(config.policy)
    except PolicyError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(describe_policy(policy))
    refusal = policy.mode_allowed(config.mode)
    if refusal:
        print(f"error: config {args.config}: mode: {refusal}", file=sys.stderr)
        return 1
    print("ok")
    return 0


def describe_policy(policy: Policy) -> str:
    roles = []
    for role in ROLES:
        keys = policy.trusted_keys(role)
        roles.append(f"{role} {policy.threshold(role)}-of-{len(keys)}" if keys else f"{role} not configured")
    images = policy.images
    engines = policy.engines
    return (
        f"policy {policy.source}: trust {', '.join(roles)}; "
        f"images from {len(images.allowed_repositories)} repositories"
        f"{' (digest required)' if images.require_digest else ''}; "
        f"drivers {', '.join(engines.allowed_drivers) or 'none'}; "
        f"engines on {engines.bind_address} ports {engines.port_range[0]}-{engines.port_range[1]}; "
        f"store {policy.store.path} up to {policy.store.max_bytes} bytes; "
        f"modes {', '.join(policy.agent.allowed_modes)}"
    )
