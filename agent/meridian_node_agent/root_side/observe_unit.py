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

Read-only by construction, not by care: the Docker client it uses (``ReadOnlyDockerApi``) refuses every
Docker API call other than ``GET`` before it connects, so neither this code nor the engine discovery under
it can create, start, stop or remove a container. While an apply runs (``root_side.root_dir.apply_lock``) it does
nothing: that apply rewrites the file when it answers, and a listing taken in the middle of a replace would
show the agent a half-done state.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from ansible_collections.meridian.node.plugins.module_utils.docker.api import DockerApi, DockerApiError
from ansible_collections.meridian.node.plugins.module_utils.docker.engine import DockerEngine, DockerUnavailableError
from meridian_node_agent.root_side.apply_unit import open_root_side, refresh_inventory
from meridian_node_agent.root_side.root_dir import apply_lock

__all__ = ["VERB", "ReadOnlyDockerApi", "add_parsers", "cmd_observe_engines", "connect_read_only"]

VERB = "observe-engines"
# The only methods that read: everything else the Engine API has creates, changes or removes something.
_READING = frozenset({"GET", "HEAD"})


class ReadOnlyDockerApi(DockerApi):
    """A ``DockerApi`` that refuses every call but ``GET``/``HEAD``, before connecting: what the observe unit
    uses, so that a mistake anywhere under it cannot change an engine."""

    def _request(self, method: str, path: str, action: str, **kwargs: Any) -> Any:
        if method.upper() not in _READING:
            raise DockerApiError(
                f"refused {method} {path}: the observe unit only reads the Docker Engine; changes go through "
                "the apply unit (meridian-node apply-spooled)",
                action=action,
            )
        return super()._request(method, path, action, **kwargs)


def connect_read_only(timeout_s: int = 30) -> DockerEngine:
    """The local Docker Engine through ``ReadOnlyDockerApi`` (DOCKER_HOST, or the local socket)."""
    try:
        api = ReadOnlyDockerApi.from_env(timeout_s=timeout_s)
    except DockerApiError as exc:
        raise DockerUnavailableError(
            f"Error connecting to the Docker Engine: {exc.reason}; is dockerd running and is its socket "
            "(/var/run/docker.sock or DOCKER_HOST) reachable by root?"
        ) from exc
    return DockerEngine(api)


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
