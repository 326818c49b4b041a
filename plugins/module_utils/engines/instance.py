"""Converge one inference engine container: every check first, then the planned actions, one by one.

``converge`` is everything ``meridian.node.engine_instance`` does except talking to Ansible. Its order is
the safety argument, so it is spelt out here:

1. the spec is validated as the ``ParsedEngineSpec`` contract;
2. policy: the image's repository is allowed and the image is digest-pinned, the driver is allowed, the
   port is inside the policy's range, host IPC is allowed if asked for, every volume's host path is under
   one of the policy's allowed volume sources;
3. the volumes are resolved on the host and checked again (``engines.volumes``: symlinks, this host's own
   directories, sockets);
4. the driver turns the spec into launch settings (a promoted artifact is resolved in the store here);
5. Docker is observed: the container with the engine's name, if any (a foreign one fails, untouched),
   and, when its config hash is the one asked for, its live settings against those it would be created
   with now (``docker.drift``: changed by hand is replaced, and the result names the settings);
6. ``engines.plan.plan_engine`` decides the actions;
7. for plans that create a container: the image is local and safe (or missing, and then pulled in step 8), the
   requested GPUs / MIG instances
   exist, are not cordoned and are not unhealthy or of unknown health (unless the spec says ``force``: then,
   as for a degraded GPU, the result's ``warnings`` and diff say so), free VRAM covers ``min_vram_mib``
   after the other owned engines' reservations, the port is free on the bind address, the NVIDIA runtime is
   there when GPUs are asked for;
8. an image the plan creates from and Docker lacks is pulled by its digest (``engines.image_pulls``,
   ``docker.image_pull``: the policy's repositories, stall bound and disk floor; verified, then checked as in
   step 7), before anything is drained or stopped: a failed or stalled pull leaves the old engine serving.
   Check mode asks the registry instead and reports the pull it would make (``image_pull``);
9. check mode stops here, reporting the actions and the diff;
10. the actions run: drain (durable mark, then wait for the engine's in-flight gauges to reach 0), stop,
   remove, create, start, wait until ready (on timeout the new container is stopped, never left
   half-running).

Nothing is created, stopped or removed before step 10, so every refusal leaves the host as it was (a pulled
image stays: the next run needs it too).

A replace of a running engine never leaves the model down (``engines.plan``): with ``replace_beside`` and room
(``find_room``: a free port in the policy's range, and the new engine's GPUs and VRAM besides the old one's)
the new engine starts beside the old and takes over once ready, on the free port; otherwise the old one is
stopped but kept until the new one is ready, and the engine keeps its port. If the new one fails,
``apply_engine`` rolls back (``plan.rollback_actions``) so that the old one serves again, and the result's
``replace`` says ``rolled-back`` with the reason.

The spec and the host policy are ``engines.spec``'s; the labels each container carries, ``engines.labels``;
where it may run and with how much VRAM, ``engines.placement``; which model directory it mounts,
``artifacts.layout`` (the store's own rule).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ansible_collections.meridian.node.plugins.module_utils._errors import MeridianError
from ansible_collections.meridian.node.plugins.module_utils._module import DEFAULT_POLICY, DEFAULT_STATE_DIR
from ansible_collections.meridian.node.plugins.module_utils._transfer_progress import TransferReporter
from ansible_collections.meridian.node.plugins.module_utils.artifacts.layout import (
    ArtifactNotPromotedError,
    ArtifactStoreError,
    promoted_dir,
)
from ansible_collections.meridian.node.plugins.module_utils.docker.engine import (
    LABEL_HOST_PORT,
    RESERVED_LABELS,
    ContainerInfo,
    ContainerSettings,
    DockerEngine,
    DockerEngineError,
    ImageNotFoundError,
    address_overlaps,
    port_bind_problem,
)
from ansible_collections.meridian.node.plugins.module_utils.docker.image_pull import ImagePullError
from ansible_collections.meridian.node.plugins.module_utils.docker.log_scrub import EnvScrubber
from ansible_collections.meridian.node.plugins.module_utils.engines.cordon import (
    CordonError,
    cordon_refusal,
    engine_covered,
    hold_engine,
    release_cordon_mark,
)
from ansible_collections.meridian.node.plugins.module_utils.engines.cordon_file import (
    CordonStateError,
    HostCordon,
    cordons_in_force,
    mark_cordoned,
    merge_cordons,
)
from ansible_collections.meridian.node.plugins.module_utils.engines.drain import (
    driver_of,
    loopback_for,
    probe_address,
    wait_until_idle,
)
from ansible_collections.meridian.node.plugins.module_utils.engines.drain_marks import (
    DrainStateError,
    clear_draining,
    mark_draining,
)
from ansible_collections.meridian.node.plugins.module_utils.engines.drivers import (
    Driver,
    DriverError,
    LaunchSettings,
    ProbeVerdict,
    get_driver,
)
from ansible_collections.meridian.node.plugins.module_utils.engines.image_prune import record_pulled
from ansible_collections.meridian.node.plugins.module_utils.engines.image_pulls import (
    bring_image,
    image_missing,
    puller_for,
)
from ansible_collections.meridian.node.plugins.module_utils.engines.labels import (
    engine_labels,
    label_spec,
    shown_spec,
)
from ansible_collections.meridian.node.plugins.module_utils.engines.placement import (
    PlacementFactsError,
    Reservation,
    placement_problem,
    placement_warnings,
    read_gpu_facts,
    reservations_from,
)
from ansible_collections.meridian.node.plugins.module_utils.engines.plan import (
    ASIDE_SUFFIXES,
    Action,
    EnginePlan,
    NameTakenError,
    Observed,
    ReplaceStrategy,
    Room,
    TargetState,
    aside_name,
    plan_engine,
    rollback_actions,
)
from ansible_collections.meridian.node.plugins.module_utils.engines.probes import (
    container_settings,
    probe_readiness,
)
from ansible_collections.meridian.node.plugins.module_utils.engines.spec import (
    EngineInstanceError,
    ParsedEngineSpec,
    build_spec,
    check_policy,
)
from ansible_collections.meridian.node.plugins.module_utils.engines.volumes import VolumeRefusedError, resolve_volumes
from ansible_collections.meridian.node.plugins.module_utils.trust.policy import Policy, PolicyError, load_policy

__all__ = [
    "RETIRING",
    "EngineRun",
    "Options",
    "apply_engine",
    "bring_images",
    "check_image",
    "check_placement",
    "converge",
    "cordon_in_force",
    "engine_settings",
    "find_room",
    "held_by_cordon",
    "hold",
    "load_engine_policy",
    "mounted_artifact",
    "own_reservation",
    "prepare_engine",
    "report_engine",
]

_POLL_S = 0.25
# The first probes come sooner: a small or cached engine is up within a second of its start, and every poll
# interval rounds that up for whoever waits on the module (a rollout batch, the agent's record).
_FIRST_POLL_S = 0.05
_PROBE_TIMEOUT_S = 2.0
_LOG_LINES = 30
# The config hash planned in check mode when the artifact is not in the store yet: unlike every real hash
# (``sha256:...``) it matches no container, so the plan shows the create or replace the real run will do.
_PENDING = "pending-artifact"


@dataclass(frozen=True)
class Options:
    """How to converge, beside the spec itself."""

    state: TargetState = "started"
    health_path: str | None = None
    replace_strategy: ReplaceStrategy = "drain-then-replace"
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
    # The cordons in force, as one (``engines.cordon_file``): set by ``converge``/``converge_set`` from the host's
    # file, the policy and the signed state, never by a caller.
    cordon: HostCordon | None = None


# --- the model ---------------------------------------------------------------------------------------------


def mounted_artifact(store_path: str, artifact: str) -> str:
    """The promoted version's directory of ``artifact``, resolved, as the engine mounts it
    (``artifacts.layout.promoted_dir``: the store lists by the same rule)."""
    try:
        return promoted_dir(store_path, artifact)
    except ArtifactNotPromotedError as exc:
        raise EngineInstanceError(
            f"{exc}; make it present first with meridian.node.verified_artifact (promote: true)", check="artifact"
        ) from exc
    except ArtifactStoreError as exc:
        raise EngineInstanceError(f"artifact {artifact!r}: refusing to mount it: {exc}", check="artifact") from exc


def _model_files(directory: str) -> list[str]:
    files = []
    for root, _dirs, names in os.walk(directory):
        for name in names:
            files.append(os.path.relpath(os.path.join(root, name), directory))
    return sorted(files)


# --- converging ------------------------------------------------------------------------------------------


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


def converge(
    params: Mapping[str, Any],
    options: Options,
    *,
    check_mode: bool,
    engine: DockerEngine,
    gpu_facts: Callable[[], Mapping[str, Any]] | None = None,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> dict[str, Any]:
    """Take engine ``params['name']`` to ``options.state``; returns the module's result.

    Raises ``EngineInstanceError`` (with ``check`` and the partial result) for every refusal and failure.
    What placement let through but must say (``placement_warnings``) is also in the result's ``warnings``.
    """
    read_facts = gpu_facts or functools.partial(read_gpu_facts, options.state_dir)
    try:
        policy = load_engine_policy(options.policy_path) if options.state != "absent" else None
        cordon = cordon_in_force(options.state_dir, policy)
        options = dataclasses.replace(options, cordon=cordon)

        def read_gpus() -> Mapping[str, Any]:
            return mark_cordoned(read_facts(), cordon)

        if cordon is not None and held_by_cordon(options, params.get("gpus") or (), read_gpus):
            return hold(str(params["name"]), cordon, options, engine, check_mode, sleep, clock)
        run = prepare_engine(params, options, engine, check_mode=check_mode, policy=policy)
        if run.plan.way == "in-place" and run.spec is not None and options.replace_beside:
            _look_for_room(run, run.spec, read_gpus)
        # A run pending its artifact (check mode) has no settings to place: it says so in its result instead.
        if creates(run.plan) and run.spec is not None and run.settings is not None:
            _check_placement(run, run.spec, read_gpus)
        elif creates(run.plan) and run.spec is not None:
            run.image_missing = image_missing(engine, run.spec.image)
        if run.image_missing and policy is not None:
            reporter = TransferReporter(options.progress_file)
            bring_images([run], policy, check_mode=check_mode, clock=clock, reporter=reporter, pull=options.pull)
            if not check_mode and options.owner and run.spec is not None:
                _record_pull(run, run.spec.image, options, engine)
        if check_mode or not run.plan.actions:
            result = report_engine(run, check_mode)
        else:
            result = apply_engine(run, sleep, clock)
        if options.state == "started" and release_cordon_mark(options.state_dir, run.name, check_mode=check_mode):
            # No cordon holds it any more: back in service.
            result.update(changed=True, actions=[*result["actions"], "unmark"])
    except DockerEngineError as exc:
        raise EngineInstanceError(str(exc), check="docker") from exc
    except DrainStateError as exc:
        raise EngineInstanceError(str(exc), check="drain-state") from exc
    except PlacementFactsError as exc:
        # The held verdicts cannot be read: placement cannot know which GPUs are held unhealthy, so it refuses.
        raise EngineInstanceError(str(exc), check="placement-health") from exc
    if run.placement_warnings:
        result["warnings"] = [*result.get("warnings", []), *run.placement_warnings]
    return result


def cordon_in_force(state_dir: str, policy: Policy | None, state: Mapping[str, Any] | None = None) -> HostCordon | None:
    """The cordons on this host as one: the host's file, the policy's and the signed state's (``state``)."""
    try:
        return merge_cordons(cordons_in_force(state_dir, None if policy is None else policy.cordon, state))
    except CordonStateError as exc:
        raise EngineInstanceError(str(exc), check="cordon") from exc


def held_by_cordon(options: Options, gpus: Sequence[str], read_gpus: Callable[[], Mapping[str, Any]]) -> bool:
    """Whether an engine to be started on ``gpus`` is held stopped by a draining cordon (``engines.cordon``)."""
    cordon = options.cordon
    return (
        options.state == "started"
        and cordon is not None
        and cordon.drain
        and engine_covered(cordon, [str(gpu) for gpu in gpus], read_gpus)
    )


def hold(
    name: str,
    cordon: HostCordon,
    options: Options,
    engine: DockerEngine,
    check_mode: bool,
    sleep: Callable[[float], None],
    clock: Callable[[], float],
) -> dict[str, Any]:
    """An engine held by a draining cordon, as a module result; ``EngineInstanceError`` (check ``drain``) when
    its drain fails."""
    try:
        return hold_engine(
            name,
            cordon,
            engine=engine,
            state_dir=options.state_dir,
            timeout_s=options.drain_timeout_s,
            grace_s=options.drain_grace_s,
            check_mode=check_mode,
            sleep=sleep,
            clock=clock,
        )
    except CordonError as exc:
        raise EngineInstanceError(str(exc), check="drain", result=exc.result) from exc


def load_engine_policy(path: str) -> Policy:
    """The host policy without its keys (engines need no trust material); a bad one fails with check policy."""
    try:
        return load_policy(path, keys=False)
    except PolicyError as exc:
        raise EngineInstanceError(str(exc), check="policy") from exc


def prepare_engine(
    params: Mapping[str, Any],
    options: Options,
    engine: DockerEngine,
    *,
    check_mode: bool = False,
    policy: Policy | None = None,
    containers: Mapping[str, ContainerInfo] | None = None,
) -> EngineRun:
    """Every read-only step before placement: spec, policy, volumes, driver settings, Docker's view, the plan.

    ``policy`` and ``containers`` (every container by name, from one listing) let ``engines.set`` read them
    once for all its engines; without them they are read here. Placement is the caller's next step, for a
    plan that creates (``Action.CREATE``), because what else a new engine must share the host with is the
    caller's knowledge. Raises ``EngineInstanceError`` naming the check.
    """
    name = str(params["name"])
    if options.state == "absent":
        observed, current, leftovers = _observe(engine, name, containers)
        plan = _plan(name, options, "", {}, observed, leftovers)
        return EngineRun(name, options, engine, plan, "", current)

    spec = build_spec(params, options.replace_strategy)
    if policy is None:
        policy = load_engine_policy(options.policy_path)
    check_policy(policy, spec)
    store_path = options.store_path or policy.store.path
    try:
        volumes = resolve_volumes(spec.volumes, policy.engines, host_dirs=(store_path, options.state_dir))
    except VolumeRefusedError as exc:
        raise EngineInstanceError(f"engine {spec.name!r}: {exc}", check=exc.check) from exc
    try:
        driver = get_driver(spec.driver, health_path=options.health_path)
        model_dir = files = None
        if spec.model.artifact is not None:
            try:
                model_dir = mounted_artifact(store_path, spec.model.artifact)
            except EngineInstanceError as exc:
                if not check_mode:
                    raise
                return _pending_artifact_run(name, spec, options, engine, str(exc), containers, policy)
            files = _model_files(model_dir)
        # The volumes as resolved on the host: what is mounted (and hashed) is what was checked.
        mounted = dataclasses.replace(spec, volumes=volumes)
        launch = driver.container_settings(mounted, model_dir=model_dir, model_files=files or ())
    except DriverError as exc:
        raise EngineInstanceError(str(exc), check="driver") from exc
    bind = policy.engines.bind_address
    settings = engine_settings(spec, launch, bind_address=bind, owner=options.owner)
    config_hash = settings.config_hash()

    observed, current, leftovers = _observe(engine, name, containers)
    port_range = _port_range(policy)
    if observed is not None and current is not None and observed.owned and observed.config_hash == config_hash:
        # The hash label says what the container was created from, not what it is now: `docker update`
        # keeps every label, and a container recreated by hand can carry ours. What it runs is read back,
        # on the port it runs on: one that took over from a replace beside it keeps its free port.
        observed = dataclasses.replace(
            observed, drifted=engine.settings_drift(current, _as_placed(settings, current, port_range))
        )
    plan = _plan(name, options, config_hash, shown_spec(spec), observed, leftovers)
    return EngineRun(
        name,
        options,
        engine,
        plan,
        config_hash,
        current,
        driver,
        settings,
        loopback_for(bind),
        spec=spec,
        bind=bind,
        port_range=port_range,
        observed=observed,
        leftovers=leftovers,
    )


def _as_placed(settings: ContainerSettings, container: ContainerInfo, port_range: tuple[int, int]) -> ContainerSettings:
    """``settings`` as ``container`` was created from them: on the host port its ``LABEL_HOST_PORT`` names, when
    it took over from a replace beside it (running or stopped: Docker lists a stopped container's ports as none)
    and that port is still in the policy's range. Published anywhere else, it has drifted."""
    try:
        placed = int(container.labels.get(LABEL_HOST_PORT, ""))
    except ValueError:
        return settings
    if settings.port is None or not port_range[0] <= placed <= port_range[1]:
        return settings
    return settings.placed_at(container.name, placed)


def _pending_artifact_run(
    name: str,
    spec: ParsedEngineSpec,
    options: Options,
    engine: DockerEngine,
    why: str,
    containers: Mapping[str, ContainerInfo] | None,
    policy: Policy,
) -> EngineRun:
    """Check mode before the artifact is in the store: the real run makes it present first (a
    ``verified_artifact`` task, which check mode did not run), so the settings cannot be known yet.

    A new engine would be created; an existing one would be replaced, since the promoted version is
    part of its settings. Placement is not checked: it needs the settings. The result says so.
    """
    observed, current, leftovers = _observe(engine, name, containers)
    plan = _plan(name, options, _PENDING, shown_spec(spec), observed, leftovers)
    return EngineRun(
        name,
        options,
        engine,
        plan,
        "",
        current,
        pending=f"{why}; placement was not checked",
        spec=spec,
        bind=policy.engines.bind_address,
        port_range=_port_range(policy),
        observed=observed,
        leftovers=leftovers,
    )


def _port_range(policy: Policy) -> tuple[int, int]:
    return int(policy.engines.port_range[0]), int(policy.engines.port_range[1])


def engine_settings(
    spec: ParsedEngineSpec, launch: LaunchSettings, *, bind_address: str, owner: str | None = None
) -> ContainerSettings:
    """The container engine ``spec`` is created from, labels included: what the config hash covers. Pure."""
    base = container_settings(name=spec.name, driver=spec.driver, launch=launch, bind_address=bind_address)
    # The spec's own labels cannot collide with ours: engine_spec refuses meridian.node's prefix.
    labels = {**spec.labels, **engine_labels(spec, owner)}
    return dataclasses.replace(base, labels={**base.labels, **labels})


def _observe(
    engine: DockerEngine, name: str, containers: Mapping[str, ContainerInfo] | None = None
) -> tuple[Observed | None, ContainerInfo | None, tuple[str, ...]]:
    if containers is None:
        containers = engine.find_names([name, *(name + suffix for suffix in ASIDE_SUFFIXES)])
    container = containers.get(name)
    # What an interrupted replace left under the engine's aside names: the plan cleans it up.
    leftovers = tuple(
        aside
        for aside in (name + suffix for suffix in ASIDE_SUFFIXES)
        if aside in containers and containers[aside].owned and containers[aside].instance == name
    )
    if container is None:
        return None, None, leftovers
    observed = Observed(
        owned=container.owned, status=container.state, config_hash=container.config_hash, spec=label_spec(container)
    )
    return observed, container, leftovers


def _plan(
    name: str,
    options: Options,
    config_hash: str,
    spec: dict[str, Any],
    observed: Observed | None,
    leftovers: Sequence[str] = (),
    room: Room | None = None,
) -> EnginePlan:
    try:
        return plan_engine(
            name=name,
            state=options.state,
            config_hash=config_hash,
            spec=spec,
            observed=observed,
            replace_strategy=options.replace_strategy,
            wait_ready=options.wait_ready,
            room=room,
            leftovers=leftovers,
        )
    except NameTakenError as exc:
        raise EngineInstanceError(str(exc), check="ownership") from exc


def creates(plan: EnginePlan) -> bool:
    """Whether ``plan`` creates a container (in the engine's place or beside the old one)."""
    return Action.CREATE in plan.actions or Action.CREATE_BESIDE in plan.actions


def find_room(
    run: EngineRun,
    spec: ParsedEngineSpec,
    *,
    published: Iterable[int],
    gpu_facts: Mapping[str, Any] | None,
    others: Sequence[Reservation],
    wanted: Iterable[int] = (),
) -> Room:
    """Whether ``spec``'s new engine fits beside the old one it replaces (``run.current``) until it is ready.

    A free port: the spec's own when nothing holds it (the old one runs on another, having taken over from a
    replace beside it), else the lowest of the policy's range that no container publishes (``published``),
    nothing else wants (``wanted``: the ports of the other engines of a set) and the kernel lets us bind. And
    its GPUs: with ``min_vram_mib``, the same check placement makes (``placement_problem``), but with the old
    engine's reservation still held; without it, how much the new engine takes cannot be known, so there is no
    room on a GPU. Pure but for the bind check.
    """
    taken = {*published, *wanted}
    low, high = run.port_range
    candidates = [spec.port, *range(low, high + 1)]
    port = next((p for p in candidates if p not in taken and port_bind_problem(run.bind, p) is None), None)
    if port is None:
        return Room(why_not=f"no free port in the policy's range {low}-{high} on {run.bind}")
    if spec.gpus:
        if not spec.min_vram_mib:
            return Room(why_not="it asks for GPUs without min_vram_mib, so its VRAM beside the old one's is unknown")
        old = own_reservation(run)
        problem = placement_problem(
            name=spec.name,
            gpus=spec.gpus,
            min_vram_mib=spec.min_vram_mib,
            gpu_facts=gpu_facts,
            others=[*others, *([old] if old is not None else [])],
            force=spec.force,
        )
        if problem is not None:
            return Room(why_not=problem[1])
    return Room(port=port)


def replan_with_room(run: EngineRun, room: Room) -> None:
    """Plan ``run`` again knowing ``room``: ``beside`` when it fits, else it stays ``in-place``."""
    if run.spec is None:
        return
    run.room = room
    run.plan = _plan(run.name, run.options, run.config_hash, shown_spec(run.spec), run.observed, run.leftovers, room)


def _look_for_room(run: EngineRun, spec: ParsedEngineSpec, read_gpus: Callable[[], Mapping[str, Any]]) -> None:
    """engine_instance's room: the engine alone against what the host has now."""
    published = [
        p.host_port
        for container in run.engine.list_containers()
        for p in container.ports
        if p.protocol == "tcp" and address_overlaps(p.host_ip, run.bind)
    ]
    room = find_room(
        run,
        spec,
        published=published,
        gpu_facts=read_gpus() if spec.gpus and spec.min_vram_mib else None,
        others=reservations_from(run.engine.list_owned(), exclude=spec.name),
    )
    replan_with_room(run, room)


def _check_placement(run: EngineRun, spec: ParsedEngineSpec, read_gpus: Callable[[], Mapping[str, Any]]) -> None:
    """engine_instance's placement: the engine alone against what the host has now."""

    def port_taken(port: int) -> str | None:
        # The port of the container being replaced is ours: it is freed before the new one starts.
        if run.current is not None and any(p.host_port == port for p in run.current.ports):
            return None
        return run.engine.port_in_use(run.bind, port)

    check_placement(
        run,
        spec,
        gpu_facts=read_gpus() if spec.gpus else None,
        others=reservations_from(run.engine.list_owned(), exclude=spec.name),
        replaced=own_reservation(run),
        port_taken=port_taken,
    )


def own_reservation(run: EngineRun) -> Reservation | None:
    """The VRAM reservation of the container ``run`` replaces, if it has one."""
    if run.current is None:
        return None
    found = reservations_from([run.current])
    return found[0] if found else None


def check_placement(
    run: EngineRun,
    spec: ParsedEngineSpec,
    *,
    gpu_facts: Mapping[str, Any] | None,
    others: Sequence[Reservation],
    replaced: Reservation | None = None,
    freed: Sequence[Reservation] = (),
    arriving: Sequence[Reservation] = (),
    port_taken: Callable[[int], str | None],
) -> None:
    """For a plan that creates the container: the image is safe, the GPUs exist, may take it and have room (see
    ``placement_problem``), the port is free (``port_taken`` says by whom it is not), the NVIDIA runtime is
    there when GPUs are asked for. The first refusal raises, naming the check; nothing is changed. Once all
    pass, ``run.placement_warnings`` says what the GPUs' health leaves to say (``placement_warnings``)."""
    refusal = cordon_refusal(run.options.cordon, spec.name)
    if refusal is not None:
        raise EngineInstanceError(refusal, check="placement-cordoned")
    try:
        check_image(run, spec)
    except ImageNotFoundError:
        run.image_missing = True  # pulled once every check passed, and checked then (bring_images)
    problem = placement_problem(
        name=spec.name,
        gpus=spec.gpus,
        min_vram_mib=spec.min_vram_mib,
        gpu_facts=gpu_facts,
        others=others,
        replaced=replaced,
        freed=freed,
        arriving=arriving,
        force=spec.force,
    )
    if problem is not None:
        raise EngineInstanceError(problem[1], check=problem[0])
    taken = port_taken(spec.port)
    if taken is not None:
        raise EngineInstanceError(f"engine {spec.name!r}: {taken}", check="placement-port")
    if spec.gpus and not run.engine.has_nvidia_runtime():
        raise EngineInstanceError(
            f"engine {spec.name!r} asks for GPUs {list(spec.gpus)} but this host's Docker Engine has no NVIDIA "
            "runtime; install the NVIDIA Container Toolkit, run 'nvidia-ctk runtime configure --runtime=docker' "
            "and restart dockerd",
            check="placement-runtime",
        )
    run.placement_warnings = placement_warnings(name=spec.name, gpus=spec.gpus, gpu_facts=gpu_facts, force=spec.force)


def check_image(run: EngineRun, spec: ParsedEngineSpec) -> None:
    """The local image ``spec`` names does not carry our ownership labels (which Docker would copy into its
    containers, making them pass as meridian.node's); ``EngineInstanceError`` check ``image`` if it does."""
    image = run.engine.resolve_image(spec.image)
    spoofing = sorted(set(image.labels) & set(RESERVED_LABELS))
    if spoofing:
        raise EngineInstanceError(
            f"engine {spec.name!r}: image {spec.image!r} carries labels {spoofing}, which would make its "
            "containers pass as meridian.node's; rebuild it without them",
            check="image",
        )


def _record_pull(run: EngineRun, image: str, options: Options, engine: DockerEngine) -> None:
    """Root's record of the image this run pulled, so that ``engine_set``'s image prune for the same owner may
    remove it once nothing uses it (``engines.image_record``); an operator's run without ``owner`` records none."""
    if not (run.image_pull or {}).get("pulled"):
        return
    try:
        record_pulled(engine, options.state_dir, str(options.owner), [image])
    except MeridianError as exc:
        raise EngineInstanceError(
            f"engine {run.name!r}: no engine was changed: {exc}", check="image-record", result=run.result()
        ) from exc


def bring_images(
    runs: Sequence[EngineRun],
    policy: Policy,
    *,
    check_mode: bool,
    clock: Callable[[], float] = time.monotonic,
    reporter: TransferReporter | None = None,
    pull: str = "missing",
) -> None:
    """Pull the images ``runs`` create from and Docker lacks, each once (check mode: forecast the pulls), each
    run's ``image_pull`` set; a pulled image is then checked as placement checks a local one (``check_image``).
    ``reporter`` is told each pull's bytes as they move (``_transfer_progress``). ``pull`` ``never`` (an
    air-gapped host, whose images come in its bundles) refuses a missing image instead (``image-missing``), in
    check mode too, before any registry is asked.

    Raises ``EngineInstanceError`` naming the check (``image-pull``, ``image-pull-stalled``, ``disk-low``,
    ``registry-auth``, ``image-digest-mismatch``, ``policy-image``...) with the result of the first run that
    needed the failed image; every run that needed it has its ``image_pull`` saying how far it got. Nothing
    of any engine has been touched yet.
    """
    wanted = [(run, run.spec) for run in runs if run.image_missing and run.spec is not None]
    if not wanted:
        return
    if pull == "never":
        run, spec = wanted[0]
        raise EngineInstanceError(
            f"engine {run.name!r}: image {spec.image!r} is not in the local Docker Engine and this run may not pull "
            f"(pull: never); bring it with the bundle (meridian-node make-bundle --image {spec.image}) or load it "
            "first; nothing was changed",
            check="image-missing",
            result=run.result(),
        )
    puller = puller_for(policy, wanted[0][0].engine, clock)
    for reference in dict.fromkeys(spec.image for _run, spec in wanted):
        users = [run for run, spec in wanted if spec.image == reference]
        try:
            pulled = bring_image(puller, reference, check_mode=check_mode, reporter=reporter)
        except ImagePullError as exc:
            for run in users:
                run.image_pull = exc.summary
            raise EngineInstanceError(
                f"engine {users[0].name!r}: {exc}; nothing was changed", check=exc.check, result=users[0].result()
            ) from exc
        if reporter is not None and reporter.problem is not None:
            pulled = {**pulled, "progress_problem": reporter.problem}
        for run in users:
            run.image_pull = dict(pulled)
            if not check_mode:
                run.image_missing = False
    if not check_mode:
        for run, spec in wanted:
            check_image(run, spec)


def report_engine(run: EngineRun, check_mode: bool) -> dict[str, Any]:
    """The result of a run that changes nothing (check mode, or nothing to do): probed when it runs."""
    ready: bool | None = None
    detail: str | None = None
    if not check_mode and run.current is not None and run.current.running and run.driver is not None:
        verdict = _probe(run, run.current)
        ready, detail = verdict.ready, verdict.detail
    pending = {"pending": run.pending} if run.pending else {}
    if check_mode and run.plan.way is not None:
        run.outcome = "planned"
    return run.result(planned=check_mode and bool(run.plan.actions), ready=ready, probe=detail, **pending)


def _probe(run: EngineRun, container: ContainerInfo, driver: Driver | None = None) -> ProbeVerdict:
    """One readiness probe of ``container`` on the port it publishes (an engine that took over from a replace
    beside it runs on its free port, not the spec's), the run's driver's way unless ``driver`` is given."""
    driver = driver or run.driver
    address = None if driver is None else probe_address(container, driver)
    if driver is None or address is None:
        raise RuntimeError(f"engine {run.name!r}: probing needs the driver and the published port")
    return probe_readiness(driver, run.probe_host, address[1], timeout_s=_PROBE_TIMEOUT_S)


def _existing(container: ContainerInfo | None, run: EngineRun, action: str) -> ContainerInfo:
    # The planner only orders an action on a container that the steps before it leave there.
    if container is None:
        raise RuntimeError(f"engine {run.name!r}: the plan asks to {action} but there is no container")
    return container


# What an engines.set run may do before the engines it hands a port or GPU to are built.
RETIRING = frozenset({Action.CLEAN_UP, Action.DRAIN, Action.STOP, Action.REMOVE, Action.SET_ASIDE})


def apply_engine(
    run: EngineRun,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
    *,
    retire_only: bool = False,
) -> dict[str, Any]:
    """Do the plan's actions not done yet, in order; returns the result. Raises ``EngineInstanceError``.

    With ``retire_only`` it stops before the first action that builds (create, start, wait-ready) and returns
    the partial result; a later call carries on from there. ``engines.set`` retires engines that hand their
    port or GPU to each other first, then builds them.

    A replace that fails once its new container exists is rolled back (``plan.rollback_actions``): the old
    engine serves again, and the error's result says ``rolled-back`` and why.
    """
    verdict: ProbeVerdict | None = None
    for action in run.plan.actions[len(run.done) :]:
        if retire_only and action not in RETIRING:
            return run.result()
        try:
            verdict = _act(run, action, sleep, clock) or verdict
        except (EngineInstanceError, DockerEngineError, DrainStateError) as exc:
            undo = rollback_actions(run.plan.way, run.done, str(action))
            if not undo:
                raise
            _roll_back(run, undo, exc, sleep, clock)
        run.done.append(str(action))
    if retire_only:
        return run.result()
    if run.options.state == "absent" or {str(Action.DRAIN), str(Action.DRAIN_OLD)} & set(run.done):
        clear_draining(run.options.state_dir, run.name)
    if run.current is not None:
        run.current = run.engine.container(run.current.id)
    if run.plan.way is not None:
        run.outcome = "replaced"
    if verdict is None and run.current is not None and run.current.running and run.driver is not None:
        verdict = _probe(run, run.current)
    return run.result(
        ready=None if verdict is None else verdict.ready, probe=None if verdict is None else verdict.detail
    )


def _act(
    run: EngineRun, action: Action, sleep: Callable[[float], None], clock: Callable[[], float]
) -> ProbeVerdict | None:
    """One action of the plan. ``run.current`` is the engine's container (the new one, once created);
    ``run.previous`` the old one a replace keeps until the new one is ready."""
    engine = run.engine
    if action is Action.CLEAN_UP:
        _clean_up(run)
    elif action is Action.DRAIN:
        _drain(run, _existing(run.current, run, "drain"), sleep, clock)
    elif action is Action.DRAIN_OLD:
        _drain(run, _existing(run.previous, run, "drain the old container"), sleep, clock, only=True)
    elif action is Action.STOP:
        run.current = _stopped(engine, _existing(run.current, run, "stop"))
    elif action is Action.STOP_OLD:
        run.previous = _stopped(engine, _existing(run.previous, run, "stop the old container"))
    elif action is Action.REMOVE:
        engine.remove(_existing(run.current, run, "remove"))
        run.current = None
    elif action is Action.REMOVE_OLD:
        engine.remove(_existing(run.previous, run, "remove the old container"))
        run.previous = None
    elif action is Action.SET_ASIDE:
        run.previous = engine.rename(_existing(run.current, run, "set aside"), aside_name(run.name, "old"))
        run.current = None
    elif action in (Action.CREATE, Action.CREATE_BESIDE):
        if run.settings is None:
            raise RuntimeError(f"engine {run.name!r}: the plan asks to create without settings")
        settings = run.settings
        if action is Action.CREATE_BESIDE:
            if run.room is None or run.room.port is None:
                raise RuntimeError(f"engine {run.name!r}: the plan asks to create beside without a free port")
            settings = settings.placed_at(aside_name(run.name, "new"), run.room.port)
        created = engine.create(settings)
        if action is Action.CREATE_BESIDE:
            run.previous = run.current
        run.current = created
    elif action is Action.START:
        current = _existing(run.current, run, "start")
        engine.start(current)
        run.current = engine.container(current.id)
    elif action is Action.WAIT_READY:
        verdict = _wait_ready(run, sleep, clock)
        # Ready: it takes work from now on, whatever is left to do with the old one (in-place: remove it).
        if str(Action.DRAIN) in run.done:
            clear_draining(run.options.state_dir, run.name)
        return verdict
    elif action is Action.PROMOTE:
        run.current = engine.rename(_existing(run.current, run, "take the engine's name"), run.name)
    return None


def _stopped(engine: DockerEngine, container: ContainerInfo) -> ContainerInfo:
    engine.stop(container, timeout_s=driver_of(container).facts.stop_timeout_s)
    return engine.container(container.id)


def _clean_up(run: EngineRun) -> None:
    """Remove what an interrupted replace left under the engine's aside names (stopped first, the driver's way)."""
    found = run.engine.find_names([run.name + suffix for suffix in ASIDE_SUFFIXES])
    for container in found.values():
        if not container.owned or container.instance != run.name:
            continue
        if container.running or container.state in ("restarting", "paused"):
            container = _stopped(run.engine, container)
        run.engine.remove(container)


def _roll_back(
    run: EngineRun,
    undo: Sequence[str],
    cause: EngineInstanceError | DockerEngineError | DrainStateError,
    sleep: Callable[[float], None],
    clock: Callable[[], float],
) -> None:
    """Undo a failed replace so that the engine that served before serves again; always raises.

    The error keeps the cause's check (``readiness``, ``docker``...) and says what was undone; the result's
    ``replace.outcome`` is ``rolled-back`` (the old engine is ready again) or ``rollback-failed`` (it is not:
    the message says what is left where).
    """
    check = getattr(cause, "check", "docker")
    reason = str(cause).split(". Last ", 1)[0]
    run.reason = reason
    engine = run.engine
    try:
        for step in undo:
            if step == "stop-new" and run.current is not None:
                current = engine.container(run.current.id)
                if current.running or current.state in ("restarting", "paused"):
                    _stopped(engine, current)
            elif step == "remove-new" and run.current is not None:
                engine.remove(run.current, force=True)
                run.current = None
            elif step == "undrain-old":
                clear_draining(run.options.state_dir, run.name)
            elif step == "restore-old":
                run.current = engine.rename(_existing(run.previous, run, "restore the old container"), run.name)
                run.previous = None
            elif step == "start-old":
                current = _existing(run.current, run, "start the old container")
                engine.start(current)
                run.current = engine.container(current.id)
            elif step == "wait-ready-old":
                old = _existing(run.current, run, "wait for the old container")
                verdict = _wait_old_ready(run, old, sleep, clock)
                if not verdict.ready:
                    raise EngineInstanceError(
                        f"the old engine did not become ready again: {verdict.detail}", check="readiness"
                    )
            run.done.append(step)
    except (EngineInstanceError, DockerEngineError, DrainStateError, RuntimeError) as exc:
        run.outcome = "rollback-failed"
        raise EngineInstanceError(
            f"engine {run.name!r}: the replace failed ({reason}) and rolling back failed too: {exc}. Done: "
            f"{', '.join(run.done)}; look at 'docker ps -a --filter name={run.name}' and publish again",
            check=check,
            result=run.result(ready=False),
        ) from cause
    run.outcome = "rolled-back"
    if str(Action.DRAIN) in run.done or str(Action.DRAIN_OLD) in run.done:
        clear_draining(run.options.state_dir, run.name)
    raise EngineInstanceError(
        f"{cause}\nRolled back: the engine that served before serves again ({', '.join(undo)}).",
        check=check,
        result=run.result(ready=run.current is not None),
    ) from cause


def _wait_old_ready(
    run: EngineRun, container: ContainerInfo, sleep: Callable[[float], None], clock: Callable[[], float]
) -> ProbeVerdict:
    """Probe the restored old container (its own driver: a replace may change it) until ready or timed out."""
    driver = driver_of(container)
    deadline = clock() + run.options.ready_timeout_s
    intervals = poll_intervals()
    while True:
        verdict = _probe(run, container, driver)
        if verdict.ready or clock() >= deadline or run.engine.container(container.id).state != "running":
            return verdict
        sleep(next(intervals))


def _drain(
    run: EngineRun,
    old: ContainerInfo,
    sleep: Callable[[float], None],
    clock: Callable[[], float],
    *,
    only: bool = False,
) -> None:
    """Mark the old engine draining (``only`` it, by its port, when the new one already serves beside it), let
    the mark reach those who route to it (``drain_settle_s``), then wait until nothing is in flight; on timeout
    restore and fail."""
    driver = driver_of(old)
    address = probe_address(old, driver)
    port = address[1] if only and address is not None else None
    mark_draining(run.options.state_dir, run.name, reason=f"replacing with {run.config_hash}", port=port)
    if run.options.drain_settle_s > 0:
        sleep(run.options.drain_settle_s)
    outcome = wait_until_idle(
        driver,
        address,
        timeout_s=run.options.drain_timeout_s,
        grace_s=run.options.drain_grace_s,
        sleep=sleep,
        clock=clock,
    )
    if outcome.idle:
        return
    # Nothing was stopped: the old engine keeps serving, so it must not stay out of the serving set.
    clear_draining(run.options.state_dir, run.name)
    raise EngineInstanceError(
        f"engine {run.name!r}: drain timed out after {run.options.drain_timeout_s:g}s ({outcome.describe()}); the "
        "old container is left running and serving. Raise drain_timeout, or use replace_strategy: stop-then-start",
        check="drain",
        result=run.result(),
    )


def poll_intervals() -> Iterator[float]:
    """The pauses between readiness probes: doubling from ``_FIRST_POLL_S`` up to ``_POLL_S``, then steady."""
    interval_s = _FIRST_POLL_S
    while True:
        yield interval_s
        interval_s = min(interval_s * 2, _POLL_S)


def _wait_ready(run: EngineRun, sleep: Callable[[float], None], clock: Callable[[], float]) -> ProbeVerdict:
    """Probe until ready; on timeout (or an exited container) stop it and fail with the verdict and logs."""
    container = _existing(run.current, run, "wait-ready")
    deadline = clock() + run.options.ready_timeout_s
    intervals = poll_intervals()
    while True:
        verdict = _probe(run, container)
        if verdict.ready:
            return verdict
        state = run.engine.container(container.id).state
        if state != "running" or clock() >= deadline:
            break
        sleep(next(intervals))
    if state == "running":
        why = f"did not become ready within {run.options.ready_timeout_s:g}s"
    else:
        why = f"exited ({state}) before it became ready"
    # A restart policy brings a crashed engine back ("restarting"): stopped, it stays down, as a drain's does.
    if state in ("running", "restarting", "paused"):
        run.engine.stop(container, timeout_s=driver_of(container).facts.stop_timeout_s)
    # Read after stopping: the tail then also says how the engine took the stop.
    logs = run.engine.logs_tail(container, _LOG_LINES)
    if run.spec is not None:
        # The tail goes into the failure message, so the task's output and the journal: what the engine printed
        # of a secret goes first. Ansible masks only task arguments, and a signed state's secrets are none.
        secrets = (f"{name}={value}" for name, value in run.spec.secret_env.items())
        logs = EnvScrubber.from_env(secrets).scrub(logs)
    run.current = run.engine.container(container.id)
    raise EngineInstanceError(
        f"engine {run.name!r} {why}; last probe: {verdict.detail}. The container is left "
        f"{run.current.state}, not serving. Last {_LOG_LINES} log lines:\n{logs}",
        check="readiness",
        result=run.result(ready=False, probe=verdict.detail),
    )
