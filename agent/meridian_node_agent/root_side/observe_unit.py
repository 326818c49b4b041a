"""``meridian-node observe-engines``: root's own look at this node's engines, run by
``meridian-node-apply-observe.service`` on ``meridian-node-apply-observe.timer``.

Runs on: the root side only.

Why it exists: under the privilege split the agent has no Docker access, and observes its engines from
``<apply.state_dir>/public/engines.json`` (``boundary.engines_file``), which the apply unit writes only when it
applies. An engine changed by hand that keeps serving (``docker update --restart no --cpus 1``, or one
recreated by hand with our labels) would never show there. This verb rewrites the file from what Docker
shows now, each engine with its state, restarts, last exit and ``drifted`` settings, on root's schedule:
the agent neither starts it nor chooses when it runs, and nothing of the agent's is read (not even the
request). What the agent does with a drift is what it does in-process: it spools the same generation, and
the apply unit re-verifies and reconciles it.

Read-only by construction, not by care: the Docker client it uses (``read_only_docker``) refuses every
Docker API call other than ``GET`` before it connects, so neither this code nor the engine discovery under
it can create, start, stop or remove a container. While an apply runs (``root_side.root_dir.apply_lock``) it does
nothing: that apply rewrites the file itself, each second while it runs (``apply_unit.LiveInventory``) and
once more before it answers.

**GPU health holds.** Each run also reads this host's GPUs once (NVML, read-only: no setter is ever asked) and
syncs root's hold file, ``<apply.state_dir>/gpu-health-holds.json`` (``gpu.health_hold``), where the engine
modules' placement reads it: an ``unhealthy`` verdict is held, a held one whose GPU NVML shows reset is released.
Each run is a fresh process, so the read is judged against the held verdicts only (``previous``): a hold keeps
until a reset or ``meridian-node gpu-health clear``, but rising counters and XID events between runs are not seen
here (an event set lives only as long as the process that registered it). The agent keeps its own XID watch, shows
what it sees in its observations and relays the GPUs it holds unhealthy by XID in each apply request, which the
apply unit adds to this file (``root_side.gpu_reports``); the agent never writes it under the split. A hold added
that way is kept here like any other, until a reset this read shows or an operator's clear. While an apply runs
the holds are still synced: the file has its own lock, and the apply's placement reads it whole or not at all.

**Engine logs.** Each run also keeps the tail of each engine's log, scrubbed of the container's environment, in
``<apply.state_dir>/public/logs/<engine>.json`` (``collectors.engine_log_keeper``; mode 0640, the agent's group), where
``meridian-node logs`` and the agent's observations read it without Docker access; the previous container's last
lines are kept when an engine is recreated. Also while an apply runs (no apply writes there). docs/LOGS.md.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from ansible_collections.meridian.node.plugins.module_utils.contracts import format_rfc3339
from ansible_collections.meridian.node.plugins.module_utils.docker.engine import DockerEngineError
from ansible_collections.meridian.node.plugins.module_utils.gpu.facts import collect_gpu_facts
from ansible_collections.meridian.node.plugins.module_utils.gpu.health_hold import HealthHoldError, HealthHolds
from meridian_node_agent.boundary.engine_logs_file import LOGS_DIR, EngineLogError
from meridian_node_agent.boundary.engines_file import INVENTORY_FILE, InventoryError, read_inventory
from meridian_node_agent.collectors.engine_log_keeper import keep_engine_logs
from meridian_node_agent.root_side.apply_unit import open_root_side, refresh_inventory
from meridian_node_agent.root_side.read_only_docker import connect_read_only
from meridian_node_agent.root_side.root_dir import RootDir, apply_lock

__all__ = ["VERB", "add_parsers", "cmd_observe_engines", "keep_logs", "sync_gpu_holds"]

VERB = "observe-engines"


def add_parsers(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    verb = subparsers.add_parser(
        VERB,
        help="(root) rewrite the engines file from what Docker shows; run by meridian-node-apply-observe.timer",
        description="Rewrite <apply.state_dir>/public/engines.json from what the Docker Engine shows of this "
        "node's engines now (state, restarts, last exit, settings changed by hand), so that an agent under "
        "apply.via: systemd sees drift without Docker access, and sync <apply.state_dir>/gpu-health-holds.json "
        "from one read of the GPUs' health (unhealthy verdicts held until a reset or 'meridian-node gpu-health "
        "clear'; placement refuses held GPUs), and keep the tail of each engine's log, scrubbed of its "
        "environment, in <apply.state_dir>/public/logs/ for 'meridian-node logs'. Only reads Docker (any other "
        "call is refused) and NVML, reads nothing of the agent's, and leaves engines.json alone while an apply "
        "runs. Exit 0 when all three were written (or an apply was running), 1 when one could not be.",
    )
    verb.set_defaults(handler=cmd_observe_engines)


def cmd_observe_engines(
    args: argparse.Namespace,
    *,
    connect: Callable[[], Any] = connect_read_only,
    clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    nvml: Any = None,
) -> int:
    # In-process, the agent inspects Docker itself: the unit has nothing to do there.
    opened = open_root_side(
        args.config,
        unit="observe unit (disable it: systemctl disable --now meridian-node-apply-observe.timer)",
        nothing_done="engines.json was not rewritten",
    )
    if opened is None:
        return 1
    config, root = opened
    said, health_problem = sync_gpu_holds(root, clock=clock, nvml=nvml)
    print(said)
    if health_problem is not None:
        print(f"error: {health_problem}", file=sys.stderr)
    problem: str | None = None
    with apply_lock(root, wait=False) as held:
        if held:
            problem = refresh_inventory(config, root, clock=clock, connect=connect)
    if not held:
        print("an apply is running; it rewrites engines.json when it answers")
    elif problem is not None:
        print(f"error: {problem}", file=sys.stderr)
    else:
        print(f"wrote {root.public / 'engines.json'}")
    # Also while an apply runs: it only reads Docker and writes logs/, which no apply touches, and an engine that
    # fails its startup during a long apply is exactly the one whose log an operator wants.
    said, logs_problem = keep_logs(config.node_id, root, connect=connect, clock=clock)
    print(said)
    if logs_problem is not None:
        print(f"error: {logs_problem}", file=sys.stderr)
    failed = (held and problem is not None) or health_problem is not None or logs_problem is not None
    return 1 if failed else 0


def keep_logs(
    node_id: str, root: RootDir, *, connect: Callable[[], Any], clock: Callable[[], datetime]
) -> tuple[str, str | None]:
    """Keep the tail of each engine's log in ``<apply.state_dir>/public/logs`` (``collectors.engine_log_keeper``);
    what was done, in a line for the unit's journal, and what went wrong (None: nothing).

    Docker is asked only when engines.json lists an engine: a host with none (or a policy allowing no image)
    needs no Docker Engine for this unit, as it needs none for the listing.
    """
    directory = root.public / LOGS_DIR
    try:
        listed = read_inventory(root.public / INVENTORY_FILE, node_id=node_id).engines
    except InventoryError:
        listed = ()
    if not listed:
        return f"engine logs: no engine listed in {root.public / INVENTORY_FILE}; nothing kept", None
    try:
        engine = connect()
    except DockerEngineError as exc:
        return "engine logs: not kept", f"{exc}; the logs kept in {directory} stay as they are"
    try:
        kept = keep_engine_logs(
            engine, owner=f"agent:{node_id}", directory=directory, read_at=format_rfc3339(clock()), group=root.group
        )
    except (DockerEngineError, EngineLogError, OSError) as exc:
        return "engine logs: not kept", f"{exc}; the logs kept in {directory} stay as they are"
    finally:
        engine.close()
    said = f"engine logs: kept {len(kept.tails)} in {directory}"
    return said, "; ".join(kept.problems) or None


def sync_gpu_holds(
    root: RootDir, *, clock: Callable[[], datetime] = lambda: datetime.now(UTC), nvml: Any = None
) -> tuple[str, str | None]:
    """Read the GPUs' health once, judged against the verdicts root holds, and sync the hold file.

    Returns what was done, in a line for the unit's journal, and what went wrong (None: nothing). No NVML on
    this host is not a problem: there is nothing to hold, and the holds there are stay as they are.
    """
    holds = HealthHolds(root.path)
    try:
        held = holds.all()
    except HealthHoldError as exc:
        return "GPU health: not synced", str(exc)
    facts = collect_gpu_facts(
        nvml,
        processes=False,
        nvlink=False,
        # A fresh process: the held verdicts are all the history there is (every other GPU is judged on this read).
        previous={uuid: verdict.health for uuid, verdict in held.items()},
        now=clock(),
    )
    if not facts["nvml_available"]:
        return f"GPU health: not read ({facts['reason']}); {len(held)} hold(s) left as they are", None
    done: list[str] = []
    problems: list[str] = []
    for gpu in facts["gpus"]:
        uuid, health = gpu.get("uuid"), gpu.get("health")
        if not uuid or not health or (health.get("verdict") != "unhealthy" and uuid not in held):
            continue
        try:
            if holds.sync(uuid, health, gpu=gpu):
                codes = ", ".join(str(reason.get("code")) for reason in health.get("reasons") or [])
                done.append(
                    f"held GPU {gpu.get('index')} {uuid} ({codes})"
                    if health.get("verdict") == "unhealthy"
                    else f"released GPU {gpu.get('index')} {uuid} (NVML shows a reset)"
                )
        except HealthHoldError as exc:
            problems.append(str(exc))
    verdicts = ", ".join(f"{gpu.get('index')} {(gpu.get('health') or {}).get('verdict')}" for gpu in facts["gpus"])
    said = f"GPU health: {verdicts or 'no GPUs'}; " + ("; ".join(done) if done else f"holds unchanged in {holds.path}")
    return said, "; ".join(problems) or None
