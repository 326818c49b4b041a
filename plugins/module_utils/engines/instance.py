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
7. for plans that create a container: the image is local and safe, the requested GPUs / MIG instances
   exist, free VRAM covers ``min_vram_mib`` after the other owned engines' reservations, the port is free
   on the bind address, the NVIDIA runtime is there when GPUs are asked for;
8. check mode stops here, reporting the actions and the diff;
9. the actions run: drain (durable mark, then wait for the engine's in-flight gauges to reach 0), stop,
   remove, create, start, wait until ready (on timeout the new container is stopped, never left
   half-running).

Nothing is created, stopped or removed before step 9, so every refusal leaves the host as it was.

VRAM reservations: each container we create carries ``meridian.node/min-vram-mib`` and its GPUs (in the
``meridian.node/spec`` label). A device's room for a new engine is ``min(free, total - reserved)``, where
``reserved`` sums the reservations of the *other* engines we own on it (stopped ones too: starting them
again is not re-checked) and ``free`` is NVML's, plus the reservation of the container being replaced,
which is stopped before the new one starts. ``min_vram_mib`` is asked of every requested device.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ansible_collections.meridian.node.plugins.module_utils._errors import MeridianError
from ansible_collections.meridian.node.plugins.module_utils._module import DEFAULT_POLICY, DEFAULT_STATE_DIR
from ansible_collections.meridian.node.plugins.module_utils.docker.engine import (
    RESERVED_LABELS,
    ContainerInfo,
    ContainerSettings,
    DockerEngine,
    DockerEngineError,
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
from ansible_collections.meridian.node.plugins.module_utils.engines.plan import (
    Action,
    EnginePlan,
    NameTakenError,
    Observed,
    ReplaceStrategy,
    TargetState,
    plan_engine,
)
from ansible_collections.meridian.node.plugins.module_utils.engines.probes import (
    container_settings,
    probe_readiness,
)
from ansible_collections.meridian.node.plugins.module_utils.engines.spec import (
    FieldError,
    ParsedEngineSpec,
    parse_engine_spec,
)
from ansible_collections.meridian.node.plugins.module_utils.engines.volumes import VolumeRefusedError, resolve_volumes
from ansible_collections.meridian.node.plugins.module_utils.trust.policy import Policy, PolicyError, load_policy

__all__ = [
    "LABEL_MIN_VRAM",
    "LABEL_OWNER",
    "LABEL_SPEC",
    "RETIRING",
    "Device",
    "EngineInstanceError",
    "EngineRun",
    "Options",
    "Reservation",
    "apply_engine",
    "artifact_dir",
    "build_spec",
    "check_placement",
    "check_policy",
    "converge",
    "engine_settings",
    "label_spec",
    "load_engine_policy",
    "own_reservation",
    "placement_problem",
    "prepare_engine",
    "public_spec",
    "report_engine",
    "reservations_from",
    "resolve_devices",
]

LABEL_SPEC = "meridian.node/spec"
LABEL_MIN_VRAM = "meridian.node/min-vram-mib"
# Who converges the engine, e.g. "agent:<node id>" for the pull agent's reconcile: what it prunes is only
# what it started, never an operator's playbook engines or another agent's on a shared Docker Engine.
LABEL_OWNER = "meridian.node/owner"
_POLL_S = 0.25
# The first probes come sooner: a small or cached engine is up within a second of its start, and every poll
# interval rounds that up for whoever waits on the module (a rollout batch, the agent's record).
_FIRST_POLL_S = 0.05
_PROBE_TIMEOUT_S = 2.0
_LOG_LINES = 30
# The config hash planned in check mode when the artifact is not in the store yet: unlike every real hash
# (``sha256:...``) it matches no container, so the plan shows the create or replace the real run will do.
_PENDING = "pending-artifact"


class EngineInstanceError(MeridianError):
    """A check refused the engine or an action failed; ``check`` names which, ``result`` what was done."""

    def __init__(self, message: str, *, check: str, result: Mapping[str, Any] | None = None) -> None:
        super().__init__(message)
        self.check = check
        self.result = dict(result or {})


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
    policy_path: str = DEFAULT_POLICY
    state_dir: str = DEFAULT_STATE_DIR
    store_path: str | None = None
    owner: str | None = None


# --- the spec --------------------------------------------------------------------------------------------

_SPEC_KEYS = (
    "name",
    "driver",
    "image",
    "model",
    "served_model_name",
    "gpus",
    "min_vram_mib",
    "port",
    "args",
    "env",
    "restart_policy",
    "shm_size_mib",
    "ipc_mode",
    "ulimits",
    "volumes",
    "labels",
)


def build_spec(params: Mapping[str, Any], replace_strategy: ReplaceStrategy = "drain-then-replace") -> ParsedEngineSpec:
    """The engine spec from the module's parameters (None means 'not given')."""
    data = {key: params[key] for key in _SPEC_KEYS if params.get(key) is not None}
    if isinstance(data.get("model"), Mapping):
        data["model"] = {key: value for key, value in data["model"].items() if value is not None}
    data["replace_strategy"] = replace_strategy
    try:
        return parse_engine_spec(data)
    except FieldError as exc:
        raise EngineInstanceError(f"engine {params.get('name')!r}: invalid spec: {exc}", check="spec") from exc


def _read_gpus() -> Mapping[str, Any]:
    # Imported here: NVML (pynvml) is needed only when placement runs, never on a no-op converge.
    from ansible_collections.meridian.node.plugins.module_utils.gpu.facts import collect_gpu_facts

    return collect_gpu_facts(processes=False, nvlink=False)


def public_spec(spec: ParsedEngineSpec) -> dict[str, Any]:
    """The spec without secrets, for the label and the diff: env keys only, never their values.

    The generic driver's health path is left out: it changes how the engine is probed, not the
    container, so changing it must not replace a serving engine.
    """
    return {
        "name": spec.name,
        "driver": spec.driver,
        "image": spec.image,
        "model": spec.model.as_dict(),
        "served_model_name": spec.served_model_name,
        "gpus": list(spec.gpus),
        "min_vram_mib": spec.min_vram_mib,
        "port": spec.port,
        "args": list(spec.args),
        "env_keys": sorted(spec.env),
        "restart_policy": spec.restart_policy,
        "shm_size_mib": spec.shm_size_mib,
        "ipc_mode": spec.ipc_mode,
        # One form for one limit: `stack: 8` and `stack: {soft: 8, hard: 8}` are the same container.
        "ulimits": {
            name: {"soft": limit, "hard": limit} if isinstance(limit, int) else {"soft": limit.soft, "hard": limit.hard}
            for name, limit in sorted(spec.ulimits.items())
        },
        "volumes": [{"source": volume.source, "target": volume.target} for volume in spec.volumes],
        "labels": dict(spec.labels),
    }


def check_policy(policy: Policy, spec: ParsedEngineSpec) -> None:
    """Image, driver, port, IPC mode and volume paths against the host's policy; the first refusal raises,
    naming the check. Pure: the volumes' paths as the spec gives them (``engines.volumes`` resolves them)."""
    for check, problem in (
        ("policy-image", policy.image_allowed(spec.image)),
        ("policy-driver", policy.driver_allowed(spec.driver)),
        ("policy-port", policy.port_allowed(spec.port)),
        ("policy-ipc", policy.engines.host_ipc_problem(spec.ipc_mode)),
        *(("policy-volume", policy.engines.volume_source_problem(volume.source)) for volume in spec.volumes),
    ):
        if problem is not None:
            raise EngineInstanceError(f"engine {spec.name!r} refused by policy: {problem}", check=check)


def artifact_dir(store_path: str, artifact: str) -> str:
    """The promoted version's directory of ``artifact``: ``<store>/artifacts/<name>/current``, resolved.

    Resolved to the version directory so the container mounts one fixed version, and a newly promoted
    version changes the settings (and so replaces the engine) instead of changing under it.

    Checked after resolving: the result must be a version directory of this artifact inside the store,
    or a planted ``current`` (absolute, ``..``, a symlinked version) would mount any directory of the host
    into the engine. The store's ``Store.current_version`` applies the same rule; it is repeated here
    because this module must not import the store (its contracts import pydantic).
    """
    artifacts = os.path.join(store_path, "artifacts")
    link = os.path.join(artifacts, artifact, "current")
    if not os.path.isdir(link):
        raise EngineInstanceError(
            f"artifact {artifact!r} has no promoted version in the store: {link} does not exist; make it "
            "present first with meridian.node.verified_artifact (promote: true)",
            check="artifact",
        )
    resolved = os.path.realpath(link)
    versions = os.path.realpath(os.path.join(artifacts, artifact))
    version = os.path.basename(resolved)
    if (
        os.path.dirname(resolved) != versions
        or versions != os.path.join(os.path.realpath(artifacts), artifact)
        or version == "current"
        or version.startswith(".")
    ):
        target = os.readlink(link) if os.path.islink(link) else "(not a symlink)"
        raise EngineInstanceError(
            f"artifact {artifact!r}: {link} points at {target!r}, which resolves to {resolved}, not a version "
            f"directory of {artifact!r} in the store {store_path}; refusing to mount it. Remove the link and make "
            "a version current again with meridian.node.verified_artifact",
            check="artifact",
        )
    return resolved


def _model_files(directory: str) -> list[str]:
    files = []
    for root, _dirs, names in os.walk(directory):
        for name in names:
            files.append(os.path.relpath(os.path.join(root, name), directory))
    return sorted(files)


# --- placement -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Device:
    """A GPU or MIG instance a spec can ask for; ``key`` is its uuid, whatever id the spec used."""

    key: str
    requested_as: str
    total_mib: int
    free_mib: int
    mig_mode: bool = False
    mig_uuids: tuple[str, ...] = ()


@dataclass(frozen=True)
class Reservation:
    """VRAM an owned engine holds on its devices (ids as its spec gave them)."""

    name: str
    gpus: tuple[str, ...]
    min_vram_mib: int


def resolve_devices(requested: Sequence[str], gpu_facts: Mapping[str, Any]) -> tuple[list[Device], list[str]]:
    """The devices ``requested`` names (GPU uuid, GPU index or MIG uuid), and the ids that name none."""
    found: list[Device] = []
    missing: list[str] = []
    for wanted in requested:
        device = _find_device(wanted, gpu_facts.get("gpus") or [])
        if device is None:
            missing.append(wanted)
        else:
            found.append(device)
    return found, missing


def _find_device(wanted: str, gpus: Sequence[Mapping[str, Any]]) -> Device | None:
    for gpu in gpus:
        memory = gpu.get("memory") or {}
        total = memory.get("total_mib")
        if wanted in (gpu.get("uuid"), str(gpu.get("index"))) and total is not None:
            instances = gpu.get("mig_instances") or []
            free = memory.get("free_mib")
            return Device(
                key=str(gpu["uuid"]),
                requested_as=wanted,
                total_mib=int(total),
                free_mib=int(total if free is None else free),
                mig_mode=bool(gpu.get("mig_mode")),
                mig_uuids=tuple(str(m["uuid"]) for m in instances),
            )
        for instance in gpu.get("mig_instances") or []:
            if instance.get("uuid") == wanted and instance.get("memory_mib") is not None:
                # NVML's per-process memory is not split by MIG instance here: the instance's size is the room.
                size = int(instance["memory_mib"])
                return Device(key=wanted, requested_as=wanted, total_mib=size, free_mib=size)
    return None


def placement_problem(
    *,
    name: str,
    gpus: Sequence[str],
    min_vram_mib: int,
    gpu_facts: Mapping[str, Any] | None,
    others: Sequence[Reservation],
    replaced: Reservation | None = None,
    freed: Sequence[Reservation] = (),
    arriving: Sequence[Reservation] = (),
) -> tuple[str, str] | None:
    """None when the GPUs exist and have room, else ``(check, message with the numbers)``. Pure.

    ``others`` reserve room whatever their state. ``replaced`` and ``freed`` are containers removed before
    this engine starts: what NVML counts them as using is credited to the free VRAM. ``arriving`` are other
    engines created in the same run (``engines.set``): NVML does not count them yet, so they are taken off it.
    """
    if not gpus:
        if min_vram_mib:
            return "placement-vram", (
                f"engine {name!r} asks for min_vram_mib={min_vram_mib} but no gpus; name the GPUs or MIG "
                "instances it should run on"
            )
        return None
    if gpu_facts is None or not gpu_facts.get("nvml_available"):
        reason = (gpu_facts or {}).get("reason") or "no GPU facts"
        return "placement-gpus", f"engine {name!r} asks for GPUs {list(gpus)} but NVML cannot be read: {reason}"
    devices, missing = resolve_devices(gpus, gpu_facts)
    if missing:
        known = _known_ids(gpu_facts)
        return "placement-gpus", (
            f"engine {name!r} asks for GPU(s) {missing}, which this host does not have (GPUs by index, uuid "
            f"or MIG uuid: {', '.join(known) or 'none'})"
        )
    for device in devices:
        if device.mig_mode:
            return "placement-gpus", (
                f"engine {name!r} asks for whole GPU {device.requested_as!r}, which is in MIG mode; ask for one "
                f"of its MIG instances instead: {', '.join(device.mig_uuids) or 'none configured'}"
            )
    if not min_vram_mib:
        return None
    for device in devices:
        reserved = sum(
            other.min_vram_mib for other in others if device.key in {_device_key(g, gpu_facts) for g in other.gpus}
        )
        leaving = [*([replaced] if replaced is not None else []), *freed]
        credit = sum(
            gone.min_vram_mib for gone in leaving if device.key in {_device_key(g, gpu_facts) for g in gone.gpus}
        )
        coming = sum(
            new.min_vram_mib for new in arriving if device.key in {_device_key(g, gpu_facts) for g in new.gpus}
        )
        free = min(device.total_mib, device.free_mib + credit) - coming
        room = min(free, device.total_mib - reserved)
        if room < min_vram_mib:
            return "placement-vram", (
                f"engine {name!r} needs {min_vram_mib} MiB on GPU {device.requested_as!r} ({device.key}) "
                f"but only {max(room, 0)} MiB is available: {device.free_mib} MiB free of {device.total_mib} MiB"
                + (
                    f" (+{credit} MiB of the container it replaces)"
                    if credit and not freed
                    else f" (+{credit} MiB of the containers removed before it starts)"
                    if credit
                    else ""
                )
                + (f" (-{coming} MiB for the other engines created with it)" if coming else "")
                + f", {reserved} MiB reserved by other meridian.node engines"
            )
    return None


def _device_key(gpu: str, gpu_facts: Mapping[str, Any]) -> str:
    device = _find_device(gpu, gpu_facts.get("gpus") or [])
    return gpu if device is None else device.key


def _known_ids(gpu_facts: Mapping[str, Any]) -> list[str]:
    known = []
    for gpu in gpu_facts.get("gpus") or []:
        known.append(f"{gpu.get('index')}={gpu.get('uuid')}")
        known.extend(str(m.get("uuid")) for m in gpu.get("mig_instances") or [])
    return known


def reservations_from(containers: Sequence[ContainerInfo], exclude: str | None = None) -> list[Reservation]:
    """The VRAM reservations our containers' labels record; ``exclude`` is the engine being converged."""
    reservations = []
    for container in containers:
        if not container.owned or container.instance == exclude:
            continue
        spec = label_spec(container)
        try:
            vram = int(container.labels.get(LABEL_MIN_VRAM, "0"))
        except ValueError:
            vram = 0
        gpus = spec.get("gpus") if isinstance(spec, dict) else None
        if vram and isinstance(gpus, list):
            reservations.append(Reservation(str(container.instance), tuple(str(g) for g in gpus), vram))
    return reservations


def label_spec(container: ContainerInfo) -> dict[str, Any]:
    """The non-secret spec an owned container carries in its label; {} when absent or unreadable."""
    try:
        spec = json.loads(container.labels.get(LABEL_SPEC, "{}"))
    except ValueError:
        return {}
    return spec if isinstance(spec, dict) else {}


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

    def result(self, **extra: Any) -> dict[str, Any]:
        container = None
        if self.current is not None:
            container = {"id": self.current.id, "name": self.current.name, "status": self.current.state}
        return {
            "changed": bool(self.done) or bool(extra.pop("planned", False)),
            "actions": [str(action) for action in self.plan.actions],
            "done": list(self.done),
            "config_hash": self.config_hash or None,
            "container": container,
            "drifted": list(self.plan.drifted),
            "diff": self.plan.diff(),
            **extra,
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
    """
    read_gpus = gpu_facts or _read_gpus
    try:
        run = prepare_engine(params, options, engine, check_mode=check_mode)
        # A run pending its artifact (check mode) has no settings to place: it says so in its result instead.
        if Action.CREATE in run.plan.actions and run.spec is not None and run.settings is not None:
            _check_placement(run, run.spec, read_gpus)
        if check_mode or not run.plan.actions:
            return report_engine(run, check_mode)
        return apply_engine(run, sleep, clock)
    except DockerEngineError as exc:
        raise EngineInstanceError(str(exc), check="docker") from exc
    except DrainStateError as exc:
        raise EngineInstanceError(str(exc), check="drain-state") from exc


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
        observed, current = _observe(engine, name, containers)
        plan = _plan(name, options, "", {}, observed)
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
                model_dir = artifact_dir(store_path, spec.model.artifact)
            except EngineInstanceError as exc:
                if not check_mode:
                    raise
                return _pending_artifact_run(name, spec, options, engine, str(exc), containers)
            files = _model_files(model_dir)
        # The volumes as resolved on the host: what is mounted (and hashed) is what was checked.
        mounted = dataclasses.replace(spec, volumes=volumes)
        launch = driver.container_settings(mounted, model_dir=model_dir, model_files=files or ())
    except DriverError as exc:
        raise EngineInstanceError(str(exc), check="driver") from exc
    bind = policy.engines.bind_address
    settings = engine_settings(spec, launch, bind_address=bind, owner=options.owner)
    config_hash = settings.config_hash()

    observed, current = _observe(engine, name, containers)
    if observed is not None and current is not None and observed.owned and observed.config_hash == config_hash:
        # The hash label says what the container was created from, not what it is now: `docker update`
        # keeps every label, and a container recreated by hand can carry ours. What it runs is read back.
        observed = dataclasses.replace(observed, drifted=engine.settings_drift(current, settings))
    plan = _plan(name, options, config_hash, public_spec(spec), observed)
    return EngineRun(
        name, options, engine, plan, config_hash, current, driver, settings, loopback_for(bind), spec=spec, bind=bind
    )


def _pending_artifact_run(
    name: str,
    spec: ParsedEngineSpec,
    options: Options,
    engine: DockerEngine,
    why: str,
    containers: Mapping[str, ContainerInfo] | None,
) -> EngineRun:
    """Check mode before the artifact is in the store: the real run makes it present first (a
    ``verified_artifact`` task, which check mode did not run), so the settings cannot be known yet.

    A new engine would be created; an existing one would be replaced, since the promoted version is
    part of its settings. Placement is not checked: it needs the settings. The result says so.
    """
    observed, current = _observe(engine, name, containers)
    plan = _plan(name, options, _PENDING, public_spec(spec), observed)
    return EngineRun(name, options, engine, plan, "", current, pending=f"{why}; placement was not checked", spec=spec)


def engine_settings(
    spec: ParsedEngineSpec, launch: LaunchSettings, *, bind_address: str, owner: str | None = None
) -> ContainerSettings:
    """The container engine ``spec`` is created from, labels included: what the config hash covers. Pure."""
    base = container_settings(name=spec.name, driver=spec.driver, launch=launch, bind_address=bind_address)
    # The spec's own labels cannot collide with ours: engine_spec refuses meridian.node's prefix.
    labels = {
        **spec.labels,
        LABEL_SPEC: json.dumps(public_spec(spec), sort_keys=True, separators=(",", ":")),
        LABEL_MIN_VRAM: str(spec.min_vram_mib),
    }
    if owner:
        labels[LABEL_OWNER] = owner
    return dataclasses.replace(base, labels={**base.labels, **labels})


def _observe(
    engine: DockerEngine, name: str, containers: Mapping[str, ContainerInfo] | None = None
) -> tuple[Observed | None, ContainerInfo | None]:
    container = engine.find(name) if containers is None else containers.get(name)
    if container is None:
        return None, None
    return (
        Observed(
            owned=container.owned,
            status=container.state,
            config_hash=container.config_hash,
            spec=label_spec(container),
        ),
        container,
    )


def _plan(name: str, options: Options, config_hash: str, spec: dict[str, Any], observed: Observed | None) -> EnginePlan:
    try:
        return plan_engine(
            name=name,
            state=options.state,
            config_hash=config_hash,
            spec=spec,
            observed=observed,
            replace_strategy=options.replace_strategy,
            wait_ready=options.wait_ready,
        )
    except NameTakenError as exc:
        raise EngineInstanceError(str(exc), check="ownership") from exc


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
    """For a plan that creates the container: the image is safe, the GPUs exist and have room (see
    ``placement_problem``), the port is free (``port_taken`` says by whom it is not), the NVIDIA runtime is
    there when GPUs are asked for. The first refusal raises, naming the check; nothing is changed."""
    image = run.engine.resolve_image(spec.image)
    spoofing = sorted(set(image.labels) & set(RESERVED_LABELS))
    if spoofing:
        raise EngineInstanceError(
            f"engine {spec.name!r}: image {spec.image!r} carries labels {spoofing}, which would make its "
            "containers pass as meridian.node's; rebuild it without them",
            check="image",
        )
    problem = placement_problem(
        name=spec.name,
        gpus=spec.gpus,
        min_vram_mib=spec.min_vram_mib,
        gpu_facts=gpu_facts,
        others=others,
        replaced=replaced,
        freed=freed,
        arriving=arriving,
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


def report_engine(run: EngineRun, check_mode: bool) -> dict[str, Any]:
    """The result of a run that changes nothing (check mode, or nothing to do): probed when it runs."""
    ready: bool | None = None
    detail: str | None = None
    if not check_mode and run.current is not None and run.current.running and run.driver is not None:
        verdict = _probe(run)
        ready, detail = verdict.ready, verdict.detail
    pending = {"pending": run.pending} if run.pending else {}
    return run.result(planned=check_mode and bool(run.plan.actions), ready=ready, probe=detail, **pending)


def _probe(run: EngineRun) -> ProbeVerdict:
    if run.driver is None or run.settings is None or run.settings.port is None:
        raise RuntimeError(f"engine {run.name!r}: probing needs the driver and the published port")
    return probe_readiness(run.driver, run.probe_host, run.settings.port.host_port, timeout=_PROBE_TIMEOUT_S)


def _existing(run: EngineRun, action: str) -> ContainerInfo:
    # The planner only orders drain/stop/remove/start/wait-ready where a container exists.
    if run.current is None:
        raise RuntimeError(f"engine {run.name!r}: the plan asks to {action} but there is no container")
    return run.current


RETIRING = frozenset({Action.DRAIN, Action.STOP, Action.REMOVE})


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
    """
    verdict: ProbeVerdict | None = None
    for action in run.plan.actions[len(run.done) :]:
        if retire_only and action not in RETIRING:
            return run.result()
        if action is Action.DRAIN:
            _drain(run, sleep, clock)
        elif action is Action.STOP:
            current = _existing(run, "stop")
            run.engine.stop(current, timeout=driver_of(current).facts.stop_timeout_s)
            run.current = run.engine.container(current.id)
        elif action is Action.REMOVE:
            run.engine.remove(_existing(run, "remove"))
            run.current = None
        elif action is Action.CREATE:
            if run.settings is None:
                raise RuntimeError(f"engine {run.name!r}: the plan asks to create without settings")
            run.current = run.engine.create(run.settings)
        elif action is Action.START:
            current = _existing(run, "start")
            run.engine.start(current)
            run.current = run.engine.container(current.id)
        elif action is Action.WAIT_READY:
            verdict = _wait_ready(run, sleep, clock)
        run.done.append(str(action))
    if retire_only:
        return run.result()
    if run.options.state == "absent" or str(Action.DRAIN) in run.done:
        clear_draining(run.options.state_dir, run.name)
    if run.current is not None:
        run.current = run.engine.container(run.current.id)
    if verdict is None and run.current is not None and run.current.running and run.driver is not None:
        verdict = _probe(run)
    return run.result(
        ready=None if verdict is None else verdict.ready, probe=None if verdict is None else verdict.detail
    )


def _drain(run: EngineRun, sleep: Callable[[float], None], clock: Callable[[], float]) -> None:
    """Mark the old engine draining, then wait until nothing is in flight; on timeout restore and fail."""
    old = _existing(run, "drain")
    mark_draining(run.options.state_dir, run.name, reason=f"replacing with {run.config_hash}")
    driver = driver_of(old)
    outcome = wait_until_idle(
        driver,
        probe_address(old, driver),
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
    interval = _FIRST_POLL_S
    while True:
        yield interval
        interval = min(interval * 2, _POLL_S)


def _wait_ready(run: EngineRun, sleep: Callable[[float], None], clock: Callable[[], float]) -> ProbeVerdict:
    """Probe until ready; on timeout (or an exited container) stop it and fail with the verdict and logs."""
    container = _existing(run, "wait-ready")
    deadline = clock() + run.options.ready_timeout_s
    intervals = poll_intervals()
    while True:
        verdict = _probe(run)
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
        run.engine.stop(container, timeout=driver_of(container).facts.stop_timeout_s)
    # Read after stopping: the tail then also says how the engine took the stop.
    logs = run.engine.logs_tail(container, _LOG_LINES)
    run.current = run.engine.container(container.id)
    raise EngineInstanceError(
        f"engine {run.name!r} {why}; last probe: {verdict.detail}. The container is left "
        f"{run.current.state}, not serving. Last {_LOG_LINES} log lines:\n{logs}",
        check="readiness",
        result=run.result(ready=False, probe=verdict.detail),
    )
