"""``meridian-node check-config``: validate the agent's config and the policy it runs under."""

import argparse
import sys
from pathlib import Path

from ansible_collections.meridian.node.plugins.module_utils.trust.policy import ROLES, Policy, PolicyError, load_policy
from meridian_node_agent.boundary.spool import PUBLIC_DIR, REQUEST_FILE, RESULT_FILE, SPOOL_DIR
from meridian_node_agent.config import AgentConfig, ConfigError, load_config, metrics_unavailable, mode_unavailable


def add_parsers(subparsers: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    check = subparsers.add_parser(
        "check-config",
        help="validate the agent config and its policy",
        description="Validate the config (--config) and the policy it names, and check that the policy "
        "allows the config's mode. In mode kubernetes-integrated it also asks the kubelet's PodResources API "
        "once (a read; a kubelet that does not answer is a warning, not an error). Prints a summary; exit 0 "
        "when both are valid, 1 with every problem found otherwise.",
    )
    check.set_defaults(handler=cmd_check_config)


def cmd_check_config(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"config {args.config}: node {config.node_id}, mode {config.mode}, state in {config.state_dir}")
    print(describe_apply(config))
    try:
        policy = load_policy(config.policy)
    except PolicyError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(describe_policy(policy))
    refusal = policy.mode_allowed(config.mode) or mode_unavailable(config.mode, config.apply.via)
    if refusal:
        print(f"error: config {args.config}: mode: {refusal}", file=sys.stderr)
        return 1
    if config.mode == "air-gapped":
        from meridian_node_agent.agent_side.airgap_agent import check_airgap_config

        problems = check_airgap_config(config, policy)
        for problem in problems:
            print(f"error: config {args.config}: {problem}", file=sys.stderr)
        if problems:
            return 1
        assert config.air_gap is not None
        taker = (
            "taken by root's meridian-node-airgap.path/.service"
            if config.apply.via == "systemd"
            else f"re-scanned every {config.air_gap.poll_seconds:g} s"
        )
        print(
            f"air gap: bundles from {config.air_gap.inbox} ({taker}), "
            f"records to {config.air_gap.outbox}, scratch {policy.air_gap.scratch_dir}"
        )
    if config.mode == "kubernetes-integrated":
        for line in describe_kubernetes(config):
            print(line)
    missing = None if config.metrics is None else metrics_unavailable(config.metrics.listen)
    if missing:
        print(f"error: config {args.config}: {missing}", file=sys.stderr)
        return 1
    print("ok")
    return 0


def describe_apply(config: AgentConfig) -> str:
    if config.mode == "kubernetes-integrated":
        return (
            "apply: never (mode kubernetes-integrated is read-only: a published desired state is verified and "
            "refused, and apply.via is not used)"
        )
    if config.apply.via == "in-process":
        return "apply: in-process (ansible-runner runs inside the agent, with the agent's privileges)"
    request = Path(config.state_dir) / SPOOL_DIR / REQUEST_FILE
    answer = Path(config.apply.state_dir) / PUBLIC_DIR / RESULT_FILE
    return (
        f"apply: via systemd (the agent writes {request}; meridian-node-apply.path starts the root "
        f"meridian-node-apply.service, which keeps its record and journal in {config.apply.state_dir} and "
        f"answers in {answer}; the agent waits up to {config.apply.timeout_seconds:g} s)"
    )


def describe_kubernetes(config: AgentConfig) -> list[str]:
    """Where the kubelet is read, and what one read says now: lines to print, a warning when it does not answer."""
    from meridian_node_agent.agent_side.podresources.client import PodResourcesClient
    from meridian_node_agent.agent_side.podresources.reading import PodResourcesError

    settings = config.kubernetes
    lines = [
        f"kubernetes: the kubelet's PodResources API on {settings.pod_resources_socket} (each call within "
        f"{settings.timeout_seconds:g} s, re-read every {settings.refresh_seconds:g} s); Docker is not asked"
    ]
    with PodResourcesClient(settings.pod_resources_socket, timeout_s=settings.timeout_seconds) as client:
        try:
            reading = client.read()
        except PodResourcesError as exc:
            return [*lines, f"warning: kubernetes.pod_resources_socket: {exc} ({exc.reason})"]
    allocatable = (
        "GetAllocatableResources not served (a kubelet before 1.23 without its KubeletPodResourcesGetAllocatable gate)"
        if reading.allocatable is None
        else f"{sum(len(group.device_ids) for group in reading.allocatable)} allocatable GPU device(s)"
    )
    # What the kubelet listed, then what a read keeps of it (docs/KUBERNETES.md, "What is listed, what is counted").
    left_out = "".join(
        f"; {entry.containers} container(s) and {entry.devices} device(s) counted, not listed ({entry.reason})"
        for entry in reading.left_out
    )
    return [
        *lines,
        f"kubernetes: the kubelet answers: {reading.pods} pod(s), {reading.listed} container(s); "
        f"{len(reading.containers)} holding a GPU{left_out}; {allocatable}",
    ]


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
