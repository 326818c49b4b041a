"""One engine prepared: every read-only step before placement (spec, policy, volumes, driver settings, Docker's
view of it), and its plan (``engines.plan.plan_engine``).

Nothing here changes the host. The spec and the host policy are ``engines.spec``'s; the labels each container
carries, ``engines.labels``; which model directory it mounts, ``artifacts.layout`` (the store's own rule).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any

from ansible_collections.meridian.node.plugins.module_utils.artifacts.layout import (
    ArtifactNotPromotedError,
    ArtifactStoreError,
    promoted_dir,
)
from ansible_collections.meridian.node.plugins.module_utils.docker.engine import (
    LABEL_HOST_PORT,
    ContainerInfo,
    ContainerSettings,
    DockerEngine,
)
from ansible_collections.meridian.node.plugins.module_utils.engines.converge.engine_run import EngineRun, Options
from ansible_collections.meridian.node.plugins.module_utils.engines.drain import loopback_for
from ansible_collections.meridian.node.plugins.module_utils.engines.drivers import (
    Driver,
    DriverError,
    LaunchSettings,
    get_driver,
)
from ansible_collections.meridian.node.plugins.module_utils.engines.labels import (
    engine_labels,
    label_spec,
    shown_spec,
)
from ansible_collections.meridian.node.plugins.module_utils.engines.plan import (
    ASIDE_SUFFIXES,
    Action,
    EnginePlan,
    NameTakenError,
    Observed,
    Room,
    plan_engine,
)
from ansible_collections.meridian.node.plugins.module_utils.engines.probes import container_settings
from ansible_collections.meridian.node.plugins.module_utils.engines.spec import (
    EngineInstanceError,
    ParsedEngineSpec,
    build_spec,
    check_policy,
)
from ansible_collections.meridian.node.plugins.module_utils.engines.volumes import VolumeRefusedError, resolve_volumes
from ansible_collections.meridian.node.plugins.module_utils.trust.policy import Policy, PolicyError, load_policy

__all__ = [
    "creates",
    "engine_settings",
    "load_engine_policy",
    "mounted_artifact",
    "plan_for",
    "prepare_engine",
]

# The config hash planned in check mode when the artifact is not in the store yet: unlike every real hash
# (``sha256:...``) it matches no container, so the plan shows the create or replace the real run will do.
_PENDING = "pending-artifact"


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
        plan = plan_for(name, options, "", {}, observed, leftovers)
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
                # The real run makes the artifact present first (a verified_artifact task, which check mode did
                # not run), so the settings cannot be known yet: planned without them (``_observed_run``).
                pending = f"{exc}; placement was not checked"
                return _observed_run(name, spec, options, engine, policy, containers, pending=pending)
            files = _model_files(model_dir)
        # The volumes as resolved on the host: what is mounted (and hashed) is what was checked.
        mounted = dataclasses.replace(spec, volumes=volumes)
        launch = driver.container_settings(mounted, model_dir=model_dir, model_files=files or ())
    except DriverError as exc:
        raise EngineInstanceError(str(exc), check="driver") from exc
    settings = engine_settings(spec, launch, bind_address=policy.engines.bind_address, owner=options.owner)
    return _observed_run(name, spec, options, engine, policy, containers, driver=driver, settings=settings)


def _observed_run(
    name: str,
    spec: ParsedEngineSpec,
    options: Options,
    engine: DockerEngine,
    policy: Policy,
    containers: Mapping[str, ContainerInfo] | None,
    *,
    driver: Driver | None = None,
    settings: ContainerSettings | None = None,
    pending: str | None = None,
) -> EngineRun:
    """Docker's view of engine ``name`` and its plan, as a run, for the container ``settings`` describe.

    Without ``settings`` (check mode before the artifact is in the store, ``pending`` saying so) it is planned
    against a hash no container has (``_PENDING``): a new engine would be created, an existing one replaced,
    since the promoted version is part of its settings. Placement is not checked: it needs the settings.
    """
    bind = policy.engines.bind_address
    config_hash = "" if settings is None else settings.config_hash()
    observed, current, leftovers = _observe(engine, name, containers)
    port_range = _port_range(policy)
    if (
        settings is not None
        and observed is not None
        and current is not None
        and observed.owned
        and observed.config_hash == config_hash
    ):
        # The hash label says what the container was created from, not what it is now: `docker update`
        # keeps every label, and a container recreated by hand can carry ours. What it runs is read back,
        # on the port it runs on: one that took over from a replace beside it keeps its free port.
        observed = dataclasses.replace(
            observed, drifted=engine.settings_drift(current, _as_placed(settings, current, port_range))
        )
    plan = plan_for(name, options, config_hash or _PENDING, shown_spec(spec), observed, leftovers)
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
        pending=pending,
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


def plan_for(
    name: str,
    options: Options,
    config_hash: str,
    spec: dict[str, Any],
    observed: Observed | None,
    leftovers: Sequence[str] = (),
    room: Room | None = None,
) -> EnginePlan:
    """``engines.plan.plan_engine`` for engine ``name`` as ``options`` ask (``room``: what ``find_room`` found
    beside it); a name a foreign container holds fails with check ``ownership``."""
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
