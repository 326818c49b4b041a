"""What one engine's converge is told (``Options``) and what it knows as it goes (``EngineRun``).

``RunOptions`` are the options of a run on this host, whether it converges one engine (``Options``, for
``engines.instance``) or a set (``engines.set.SetOptions``): one list of the timeouts, the drain, where the
policy and the state live and who owns what, written once.

This package, ``engines.converge``: the phases of one engine's converge, each written once.

``engines.instance`` puts them in order for one engine, ``engines.set`` for a set; this package imports
neither. In the order a converge meets them:

- ``engine_run``: what a converge is told (``Options``, ``RunOptions``) and knows as it goes (``EngineRun``);
- ``prepare``: the spec, policy, volumes, driver settings, Docker's view of the engine and its plan;
- ``gates``: a cordon that holds the engine, placement (GPUs, VRAM, port, runtime) and the image's labels;
- ``room``: room beside the old container for a replace that keeps the engine serving;
- ``images``: the images Docker lacks, pulled before anything is drained, and root's record of them;
- ``act``: the plan's actions in order, a failed replace rolled back;
- ``waits``: the drain, the readiness waits and their poll intervals.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ansible_collections.meridian.node.plugins.module_utils._module import DEFAULT_POLICY, DEFAULT_STATE_DIR
from ansible_collections.meridian.node.plugins.module_utils.docker.engine import (
    ContainerInfo,
    ContainerSettings,
    DockerEngine,
)
from ansible_collections.meridian.node.plugins.module_utils.engines.cordon_file import HostCordon
from ansible_collections.meridian.node.plugins.module_utils.engines.drivers import Driver
from ansible_collections.meridian.node.plugins.module_utils.engines.plan import (
    EnginePlan,
    Observed,
    ReplaceStrategy,
    Room,
    TargetState,
)
from ansible_collections.meridian.node.plugins.module_utils.engines.spec import ParsedEngineSpec

__all__ = ["EngineRun", "Options", "RunOptions"]


@dataclass(frozen=True)
class RunOptions:
    """How a run on this host converges, for one engine or a set: what both share."""

    wait_ready: bool = True
    ready_timeout_s: float = 600
    drain_timeout_s: float = 300
    drain_grace_s: float = 10
    # How long a drained engine keeps serving, after its mark, before its gauges are trusted: time for whoever
    # routes to it (the agent's observation, the serving projection, a gateway) to stop sending it work.
    drain_settle_s: float = 0
    # Whether a running engine may be replaced beside its old container, on a free port it then keeps: right
    # where routing follows the serving projection (the agent's reconcile), wrong for a static load balancer.
    replace_beside: bool = False
    policy_path: str = DEFAULT_POLICY
    state_dir: str = DEFAULT_STATE_DIR
    store_path: str | None = None
    owner: str | None = None
    # Where the byte progress of pulls goes for the agent (``_transfer_progress``); None: nowhere.
    progress_file: str | None = None
    # ``missing``: pull an image Docker lacks; ``never``: refuse it (``image-missing``), as on an air-gapped host.
    pull: str = "missing"


@dataclass(frozen=True)
class Options(RunOptions):
    """How to converge one engine, beside the spec itself."""

    state: TargetState = "started"
    health_path: str | None = None
    replace_strategy: ReplaceStrategy = "drain-then-replace"
    # The cordons in force, as one (``engines.cordon_file``): set by ``converge``/``converge_set`` from the host's
    # file, the policy and the signed state, never by a caller.
    cordon: HostCordon | None = None


@dataclass
class EngineRun:
    """What one engine's converge knows; ``result`` grows as actions are done, so a failure can report it.

    ``engines.instance`` makes one; ``engines.set`` makes one per engine and applies them side by side.
    """

    name: str
    options: Options
    engine: DockerEngine
    plan: EnginePlan
    config_hash: str
    current: ContainerInfo | None
    driver: Driver | None = None
    settings: ContainerSettings | None = None
    probe_host: str = "127.0.0.1"
    pending: str | None = None  # check mode only: why the settings (and placement) could not be computed
    done: list[str] = field(default_factory=list)
    spec: ParsedEngineSpec | None = None  # None for state absent
    bind: str = "127.0.0.1"  # the policy's bind address the engine is published on
    port_range: tuple[int, int] = (0, 0)  # the policy's: where a replace may find a free port
    previous: ContainerInfo | None = None  # a replace's old container once the new one exists or it is set aside
    room: Room | None = None  # what find_room found, for a replace of a running engine
    outcome: str | None = None  # a replace's: "replaced", "rolled-back" or "rollback-failed"
    reason: str | None = None  # why it rolled back
    observed: Observed | None = None  # what the plan was made from
    leftovers: tuple[str, ...] = ()
    # What placement let through but must be said: a degraded GPU, or one only the spec's force placed on.
    placement_warnings: list[str] = field(default_factory=list)
    # The plan creates from an image Docker lacks (placement found it missing): its label check comes after the pull.
    image_missing: bool = False
    # The pull of that image: done (bytes, seconds), would be done (check mode), or how far it got.
    image_pull: dict[str, Any] | None = None

    def result(self, **extra: Any) -> dict[str, Any]:
        container = None
        if self.current is not None:
            container = {"id": self.current.id, "name": self.current.name, "status": self.current.state}
        replace = None
        if self.plan.way is not None:
            replace = {"way": self.plan.way, "why": self.plan.why, "outcome": self.outcome, "reason": self.reason}
        warned: dict[str, Any] = (
            {"placement_warnings": list(self.placement_warnings)} if self.placement_warnings else {}
        )
        if self.image_pull is not None:
            warned["image_pull"] = dict(self.image_pull)
        return {
            "changed": bool(self.done) or bool(extra.pop("planned", False)),
            "actions": [str(action) for action in self.plan.actions],
            "done": list(self.done),
            "config_hash": self.config_hash or None,
            "container": container,
            "drifted": list(self.plan.drifted),
            "replace": replace,
            "diff": self.diff(),
            **warned,
            **extra,
        }

    def diff(self) -> dict[str, Any]:
        """The plan's diff, the placement's warnings beside what the engine will be."""
        diff = self.plan.diff()
        if not self.placement_warnings:
            return diff
        return {
            "before": diff["before"],
            "after": {**diff["after"], "placement_warnings": list(self.placement_warnings)},
        }
