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
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from meridian_node_agent.root_side.apply_unit import open_root_side, refresh_inventory
from meridian_node_agent.root_side.read_only_docker import connect_read_only
from meridian_node_agent.root_side.root_dir import apply_lock

__all__ = ["VERB", "add_parsers", "cmd_observe_engines"]

VERB = "observe-engines"


def add_parsers(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    verb = subparsers.add_parser(
        VERB,
        help="(root) rewrite the engines file from what Docker shows; run by meridian-node-apply-observe.timer",
        description="Rewrite <apply.state_dir>/public/engines.json from what the Docker Engine shows of this "
        "node's engines now (state, restarts, last exit, settings changed by hand), so that an agent under "
        "apply.via: systemd sees drift without Docker access. Only reads Docker (any other call is refused), "
        "reads nothing of the agent's, and does nothing while an apply runs. Exit 0 when the file was written "
        "or an apply was running, 1 when it could not be written.",
    )
    verb.set_defaults(handler=cmd_observe_engines)


def cmd_observe_engines(
    args: argparse.Namespace,
    *,
    connect: Callable[[], Any] = connect_read_only,
    clock: Callable[[], datetime] = lambda: datetime.now(UTC),
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
    with apply_lock(root, wait=False) as held:
        if not held:
            print("an apply is running; it rewrites engines.json when it answers")
            return 0
        problem = refresh_inventory(config, root, clock=clock, connect=connect)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 1
    print(f"wrote {root.public / 'engines.json'}")
    return 0
