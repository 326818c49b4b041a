"""``meridian-node gpu-health show | clear GPU``: this host's GPU verdicts, and an operator's clear of a held one.

Held verdicts live in ``<record_dir>/gpu-health-holds.json`` (``gpu.health_hold``): root's ``apply.state_dir``
under the privilege split, the agent's ``state_dir`` in-process, the directory the reconcile playbook's placement
reads them from either way. ``show`` reads the GPUs now, judged against those holds as placement judges them, and
adds what the agent last reported where it differs; ``clear`` drops one hold, by uuid, index or PCI bus id, and
must run as the owner of that directory (root under the split). docs/GPU_HEALTH.md says what a clear does.

The agent's status.json is read as root reads the agent's files (``boundary.agent_files``), and every line is
printed escaped (``terminal_text``): the agent wrote what it says.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ansible_collections.meridian.node.plugins.module_utils.gpu.facts import collect_gpu_facts
from ansible_collections.meridian.node.plugins.module_utils.gpu.health_hold import (
    HealthHoldError,
    HealthHolds,
    HeldVerdict,
)
from meridian_node_agent.boundary.agent_files import STATUS_MAX_BYTES, read_agent_document
from meridian_node_agent.boundary.directories import BoundaryError
from meridian_node_agent.config import AgentConfig, config_for_verb
from meridian_node_agent.terminal_text import escape_text

__all__ = ["add_parsers", "cmd_gpu_health_clear", "cmd_gpu_health_show"]

_SHOWN_REASONS = 6


def add_parsers(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    verb = subparsers.add_parser(
        "gpu-health",
        help="show this host's GPU health verdicts, or clear a held one",
        description="GPU health verdicts (healthy, degraded, unhealthy, unknown; docs/GPU_HEALTH.md). An unhealthy "
        "verdict is held in <record_dir>/gpu-health-holds.json (apply.state_dir under apply.via: systemd, "
        "state_dir in-process), where placement reads it, until NVML shows a reset or an operator clears it.",
    )
    actions = verb.add_subparsers(dest="action", required=True, metavar="ACTION")
    show = actions.add_parser(
        "show",
        help="read the GPUs now and show each one's verdict, reasons and how long it has been held",
        description="Read this host's GPUs (NVML, read-only), judge each against the verdicts held in the hold "
        "file as placement does, and print one line per GPU: verdict, held since when, reasons. Holds of GPUs "
        "that are not on the host now, and what the agent last reported where it differs, follow. Exit 0, or 1 "
        "when the hold file or the agent's status.json cannot be read (or is not a regular file: it is never "
        "followed through a symlink).",
    )
    show.add_argument("--json", action="store_true", help="print one JSON document instead of lines")
    show.set_defaults(handler=cmd_gpu_health_show)
    clear = actions.add_parser(
        "clear",
        help="drop the held verdict of one GPU (run as the owner of the hold file: root under the split)",
        description="Drop the held unhealthy verdict of the GPU named by its uuid, index or PCI bus id, so that "
        "placement may use it again. Only what NVML shows from then on counts: a GPU still faulty by its counters "
        "is held again at its next read. Prints what was cleared. Exit 0 when it was cleared or was not held, 1 "
        "for a GPU this host does not have (the message lists the GPUs) or a hold file that cannot be written.",
    )
    clear.add_argument("gpu", metavar="GPU", help="the GPU's uuid (GPU-...), index (0) or PCI bus id")
    clear.set_defaults(handler=cmd_gpu_health_clear)


def cmd_gpu_health_show(args: argparse.Namespace, *, nvml: Any = None) -> int:
    config = config_for_verb(args.config)
    holds = HealthHolds(config.record_dir)
    holds_problem = status_problem = None
    try:
        held = holds.all()
    except HealthHoldError as exc:
        holds_problem, held = str(exc), {}
    facts = collect_gpu_facts(
        nvml, processes=False, nvlink=False, previous={uuid: verdict.health for uuid, verdict in held.items()}
    )
    gpus = [gpu for gpu in facts.get("gpus") or [] if isinstance(gpu, Mapping)]
    here = {str(gpu.get("uuid")) for gpu in gpus}
    elsewhere = [verdict for uuid, verdict in sorted(held.items()) if uuid not in here]
    try:
        reported = _agent_verdicts(config)
    except BoundaryError as exc:
        status_problem, reported = str(exc), {}
    if args.json:
        document = {
            "node_id": config.node_id,
            "holds_file": holds.path,
            "holds_error": holds_problem,
            "nvml_available": facts["nvml_available"],
            "reason": facts.get("reason"),
            "gpus": [
                {
                    "index": gpu.get("index"),
                    "uuid": gpu.get("uuid"),
                    "pci_bus_id": gpu.get("pci_bus_id"),
                    "name": gpu.get("name"),
                    "health": gpu.get("health"),
                    "held_at": held[str(gpu["uuid"])].held_at if str(gpu.get("uuid")) in held else None,
                    "agent_reported": reported.get(str(gpu.get("uuid"))),
                }
                for gpu in gpus
            ],
            "held_not_present": [verdict.as_dict() for verdict in elsewhere],
        }
        # JSON escapes every control character itself (\u001b): printed as json.dumps makes it.
        print(json.dumps(document, sort_keys=True))
    else:
        for line in _show_lines(config, holds.path, facts, gpus, held, elsewhere, reported):
            print(escape_text(line, one_line=True))
    problems = [problem for problem in (holds_problem, status_problem) if problem is not None]
    for problem in problems:
        print(f"error: {escape_text(problem, one_line=True)}", file=sys.stderr)
    return 1 if problems else 0


def _show_lines(
    config: AgentConfig,
    path: str,
    facts: Mapping[str, Any],
    gpus: list[Mapping[str, Any]],
    held: Mapping[str, HeldVerdict],
    elsewhere: list[HeldVerdict],
    reported: Mapping[str, Mapping[str, Any]],
) -> list[str]:
    lines = [f"GPU health of node {config.node_id}, read now; held verdicts in {path}"]
    if not facts["nvml_available"]:
        lines.append(f"GPUs not read: {facts.get('reason')}")
    elif not gpus:
        lines.append("no GPUs on this host")
    for gpu in gpus:
        uuid = str(gpu.get("uuid"))
        health = gpu.get("health") or {}
        lines.append(
            f"GPU {gpu.get('index')} {uuid} {gpu.get('pci_bus_id') or '-'} {gpu.get('name') or ''}".rstrip()
            + f": {_verdict_text(health, held.get(uuid))}"
        )
        agent = reported.get(uuid)
        if agent is not None and (agent.get("verdict"), bool(agent.get("held"))) != (
            health.get("verdict"),
            bool(health.get("held")),
        ):
            lines.append(f"  the agent's last report: {_reported_text(agent)}{_agent_only(config, agent, held, uuid)}")
    for verdict in elsewhere:
        lines.append(f"held, not on this host now: {verdict.describe()}")
    return lines


def _verdict_text(health: Mapping[str, Any], held: HeldVerdict | None) -> str:
    if not health:
        return "not judged"
    text = str(health.get("verdict"))
    if health.get("held"):
        text += f", held since {health.get('since') or (held.held_at if held else '?')}"
    reasons = list(health.get("reasons") or [])
    if reasons:
        shown = [_reason_text(reason) for reason in reasons[:_SHOWN_REASONS]]
        if len(reasons) > _SHOWN_REASONS:
            shown.append(f"and {len(reasons) - _SHOWN_REASONS} more")
        text += ": " + "; ".join(shown)
    return text


def _reason_text(reason: Mapping[str, Any]) -> str:
    text = " ".join(str(part) for part in (reason.get("code"), reason.get("value")) if part is not None)
    return text + (f" ({reason['source']})" if reason.get("source") else "")


def _reported_text(agent: Mapping[str, Any]) -> str:
    text = str(agent.get("verdict"))
    if agent.get("held"):
        text += f", held since {agent.get('since')}"
    if agent.get("reasons"):
        text += f" ({', '.join(str(reason) for reason in agent['reasons'])})"
    return text


def _agent_only(config: AgentConfig, agent: Mapping[str, Any], held: Mapping[str, HeldVerdict], uuid: str) -> str:
    """Under the split an XID is seen by the agent's watch alone until its next apply request relays it to root:
    say so, and how such a hold ends."""
    if config.apply.via != "systemd" or agent.get("verdict") != "unhealthy" or uuid in held:
        return ""
    return (
        " (held by the agent alone so far: root's observe timer reads no XID events; the agent's next apply "
        "request relays it and root holds it before placing anything; restarting the agent first drops it)"
    )


def _agent_verdicts(config: AgentConfig) -> dict[str, dict[str, Any]]:
    """The verdicts in the agent's status.json by uuid ({} when it has none); ``BoundaryError`` for a file that is
    not what the agent writes there (a FIFO, a symlink, too large)."""
    from meridian_node_agent.boundary.agent_files import STATUS_FILE

    status = (
        read_agent_document(
            Path(config.state_dir), STATUS_FILE, max_bytes=STATUS_MAX_BYTES, what="the agent's status file"
        )
        or {}
    )
    return {str(gpu.get("uuid")): gpu for gpu in status.get("gpus") or [] if isinstance(gpu, dict)}


def cmd_gpu_health_clear(args: argparse.Namespace, *, nvml: Any = None) -> int:
    config = config_for_verb(args.config)
    holds = HealthHolds(config.record_dir)
    # The GPUs now, only to know them by index and PCI bus id (an index can move after a reboot); not judged.
    facts = collect_gpu_facts(nvml, processes=False, nvlink=False, health=False)
    try:
        dropped = holds.clear(args.gpu, gpu_facts=facts)
    except HealthHoldError as exc:
        print(f"error: {escape_text(str(exc), one_line=True)}", file=sys.stderr)
        return 1
    if not dropped:
        _say(f"GPU {args.gpu} is not held in {holds.path}: nothing to clear")
        try:
            agent = _agent_verdicts(config).get(_uuid_of(args.gpu, facts) or args.gpu)
        except BoundaryError as exc:
            print(f"error: {escape_text(str(exc), one_line=True)}", file=sys.stderr)
            return 1
        if agent is not None and agent.get("verdict") == "unhealthy" and config.apply.via == "systemd":
            _say(
                f"the agent last reported it {_reported_text(agent)}: an XID only the agent's own watch saw, which "
                "root does not hold yet (the agent's next apply request relays it, and root holds it then); "
                "restarting the agent (systemctl restart meridian-node) drops it"
            )
        return 0
    for verdict in dropped:
        _say(f"cleared {verdict.describe()} from {holds.path}")
    print(
        "placement may use it again; only what NVML shows from now on counts: a GPU still faulty by its counters is "
        "held again at its next read (root's observe timer under the split, the agent's next GPU refresh in-process)"
    )
    return 0


def _say(line: str) -> None:
    print(escape_text(line, one_line=True))


def _uuid_of(which: str, facts: Mapping[str, Any]) -> str | None:
    for gpu in facts.get("gpus") or []:
        if gpu.get("uuid") and which in (gpu.get("uuid"), str(gpu.get("index")), gpu.get("pci_bus_id")):
            return str(gpu["uuid"])
    return None
