"""Converge a host's whole set of engines in one run: ``meridian.node.engine_set``'s engines, without Ansible
(``engines.set_run`` reads the module's parameters, a signed state included, and calls ``converge_set``).

Every engine is converged with the phases ``engines.instance`` orders for one engine (``engines.converge``:
``prepare_engine``, ``find_room``, ``check_placement``, ``bring_images``, ``apply_or_report``), so one engine
in a set ends exactly as ``engines.instance`` alone would leave it. What the set adds is the order, and the
safety argument is the same: nothing changes before everything was checked.

1. Read once: the policy, every container (one listing) and the cordons in force (the host's, the policy's
   and a signed state's). NVML is read only when a new engine asks for GPUs.
2. Prepare every engine side by side (the drift check inspects each container): spec, policy, volumes,
   driver settings, ownership, plan. Then, for every engine to be created, placement against the host *and*
   the set (``engines.set_plan``), and the dropped engines of ``owner`` split by ``engines.prune.prune_order``.
   Placement reads the GPUs' health and the verdicts held on the host (``engines.placement``): what it lets
   through but must say (a degraded GPU, ``force`` on a bad one) is in the run's ``warnings``.
   Every refusal is collected; any refusal fails the run before anything changed.
3. Every image an engine is to be created from and Docker lacks is pulled by digest, each once
   (``engines.converge.images.bring_images``), before anything is drained, held or stopped: a failed or stalled pull
   fails the run with every old engine still serving. Check mode asks the registry instead.
4. Check mode stops here and reports what would change.
5. Act: drain and remove the dropped engines in a listed engine's way; converge the engines wave by wave
   (``engines.set_plan.waves``), up to ``parallel`` at a time, each one's actions in ``engines.converge.act``'s
   order (drain before replacing, its own timeouts); then, if every engine converged, drain and remove the
   other dropped engines (``engines.set_run`` then records a signed state's generation as applied, when asked
   to). With ``prune``, the images this owner pulled (written down in step 3, ``engines.image_record``)
   and, for an envelope, those loaded from bundles, that nothing uses any more go after the policy's grace
   (``engines.image_prune``; check mode reports what would go).

An engine that fails does not stop the others under way; the engines that wait on it are not started.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ansible_collections.meridian.node.plugins.module_utils._errors import MeridianError, ResultError
from ansible_collections.meridian.node.plugins.module_utils.docker.engine import (
    ContainerInfo,
    DockerEngine,
    DockerEngineError,
    ImageNotFoundError,
    port_bind_problem,
)
from ansible_collections.meridian.node.plugins.module_utils.engines.converge.act import apply_or_report
from ansible_collections.meridian.node.plugins.module_utils.engines.converge.engine_run import (
    EngineRun,
    Options,
    RunOptions,
)
from ansible_collections.meridian.node.plugins.module_utils.engines.converge.gates import (
    check_placement,
    cordon_in_force,
    gpu_reader,
    held_by_cordon,
    hold,
    mark_unplaced_image,
    placed,
    release_hold,
)
from ansible_collections.meridian.node.plugins.module_utils.engines.converge.images import bring_images, record_pulls
from ansible_collections.meridian.node.plugins.module_utils.engines.converge.prepare import (
    creates,
    load_engine_policy,
    prepare_engine,
)
from ansible_collections.meridian.node.plugins.module_utils.engines.converge.room import (
    find_room,
    may_go_beside,
    published_on,
    replan_with_room,
)
from ansible_collections.meridian.node.plugins.module_utils.engines.cordon_file import HostCordon
from ansible_collections.meridian.node.plugins.module_utils.engines.drain import DrainError, DrainOptions, drain_engine
from ansible_collections.meridian.node.plugins.module_utils.engines.drain_marks import DrainStateError, clear_draining
from ansible_collections.meridian.node.plugins.module_utils.engines.image_prune import prune_images
from ansible_collections.meridian.node.plugins.module_utils.engines.labels import (
    LABEL_MIN_VRAM,
    LABEL_OWNER,
    label_spec,
)
from ansible_collections.meridian.node.plugins.module_utils.engines.placement import PlacementFactsError
from ansible_collections.meridian.node.plugins.module_utils.engines.plan import Action, Room
from ansible_collections.meridian.node.plugins.module_utils.engines.prune import PruneOrder, prune_order
from ansible_collections.meridian.node.plugins.module_utils.engines.set_plan import (
    Held,
    Member,
    duplicate_names,
    needs,
    placement_inputs,
    port_clashes,
    port_handover,
    waves,
)
from ansible_collections.meridian.node.plugins.module_utils.engines.spec import EngineInstanceError
from ansible_collections.meridian.node.plugins.module_utils.trust.policy import Policy

__all__ = ["EngineSetError", "SetOptions", "converge_set"]

_T = TypeVar("_T")


class EngineSetError(ResultError):
    """The set was refused or an engine failed; ``result`` carries what the module returns beside ``msg``."""

    def __init__(
        self,
        message: str,
        *,
        result: Mapping[str, Any] | None = None,
        missing_library: tuple[str, str] | None = None,
    ) -> None:
        super().__init__(message, result)
        self.missing_library = missing_library


@dataclass(frozen=True)
class SetOptions(RunOptions):
    """How to converge the set, beside the engines themselves (each engine's ``Options`` are made from these and
    its spec: ``_engine_options``)."""

    prune: bool = False
    parallel: int = 8
    prune_reason: str = "the engine set no longer lists it"
    # Images loaded from air-gap bundles are the agent's (only it loads them): only a signed state's run prunes them.
    prune_loaded: bool = False
    # The signed state's cordon (``contracts.Cordon`` as a dict), read with the host's and the policy's.
    cordon: Mapping[str, Any] | None = None


@dataclass
class _Outcome:
    """One engine's or one prune's end: its result, and the failure (message, check) if it failed."""

    result: dict[str, Any] = field(default_factory=dict)
    failure: tuple[str, str] | None = None


# --- the set -------------------------------------------------------------------------------------------


def _engine_options(spec: Mapping[str, Any], options: SetOptions, cordon: HostCordon | None = None) -> Options:
    def pick(key: str, default: float) -> float:
        # A module's engines list says ready_timeout; a desired state's engine, ready_timeout_seconds.
        value = spec.get(key)
        if value is None:
            value = spec.get(f"{key}_seconds")
        return default if value is None else float(value)

    return Options(
        state=spec.get("state") or "started",
        health_path=spec.get("health_path"),
        replace_strategy=spec.get("replace_strategy") or "drain-then-replace",
        wait_ready=options.wait_ready,
        ready_timeout_s=pick("ready_timeout", options.ready_timeout_s),
        drain_timeout_s=pick("drain_timeout", options.drain_timeout_s),
        drain_grace_s=pick("drain_grace", options.drain_grace_s),
        drain_settle_s=options.drain_settle_s,
        replace_beside=options.replace_beside,
        policy_path=options.policy_path,
        state_dir=options.state_dir,
        store_path=options.store_path,
        owner=options.owner,
        cordon=cordon,
    )


def _held(container: ContainerInfo) -> Held:
    spec = label_spec(container)
    try:
        vram = int(container.labels.get(LABEL_MIN_VRAM, "0"))
    except ValueError:
        vram = 0
    gpus = spec.get("gpus")
    ports = [p.host_port for p in container.ports if p.protocol == "tcp"]
    return Held(
        name=container.name,
        port=ports[0] if ports else None,
        gpus=tuple(str(gpu) for gpu in gpus) if isinstance(gpus, list) else (),
        min_vram_mib=vram,
        owned=container.owned,
        owner=container.labels.get(LABEL_OWNER, ""),
    )


def _member(run: EngineRun) -> Member:
    spec = run.spec
    actions = run.plan.actions
    return Member(
        name=run.name,
        state=run.options.state,
        port=None if spec is None else spec.port,
        gpus=() if spec is None else tuple(spec.gpus),
        min_vram_mib=0 if spec is None else spec.min_vram_mib,
        creates=creates(run.plan),
        # Set aside, the old container is stopped: its port and GPUs are free for the others, as if removed.
        retires=Action.REMOVE in actions or Action.SET_ASIDE in actions,
        current=None if run.current is None else _held(run.current),
    )


def _pool_map(function: Callable[[Any], _T], items: Sequence[Any], parallel: int) -> list[_T]:
    """``function`` over ``items``, up to ``parallel`` at a time, results in order; all finish before it returns."""
    if len(items) <= 1 or parallel <= 1:
        return [function(item) for item in items]
    with ThreadPoolExecutor(max_workers=min(parallel, len(items))) as pool:
        return list(pool.map(function, items))


def _failure_text(failures: Iterable[tuple[str, str, str]]) -> str:
    return "; ".join(f"engine {name!r} (check {check}): {message}" for name, message, check in failures)


def converge_set(
    specs: Sequence[Mapping[str, Any]],
    options: SetOptions,
    *,
    check_mode: bool,
    engine: DockerEngine,
    gpu_facts: Callable[[], Mapping[str, Any]] | None = None,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
    wall: Callable[[], float] = time.time,
) -> dict[str, Any]:
    """Plan the whole set, then (outside check mode) act; returns the module's result.

    Raises ``EngineSetError`` with ``check`` and the per-engine results for a refusal (nothing changed) or
    for engines that failed while converging.
    """
    names = [str(spec.get("name")) for spec in specs]
    twice = duplicate_names(names)
    if twice:
        raise EngineSetError(
            f"engines {twice} are listed more than once; list each engine once", result={"check": "spec"}
        )
    try:
        policy = load_engine_policy(options.policy_path)
        containers = engine.list_containers()
        cordon = cordon_in_force(options.state_dir, policy, options.cordon)
    except EngineInstanceError as exc:
        raise EngineSetError(str(exc), result={"check": exc.check}) from exc
    except DockerEngineError as exc:
        raise EngineSetError(str(exc), result={"check": "docker"}) from exc
    by_name = {container.name: container for container in containers}
    read_gpus = gpu_reader(gpu_facts, options.state_dir, cordon)
    held, specs = _split_held(specs, options, cordon, read_gpus)

    def prepare(spec: Mapping[str, Any]) -> EngineRun | tuple[str, str]:
        try:
            return prepare_engine(
                spec,
                _engine_options(spec, options, cordon),
                engine,
                check_mode=check_mode,
                policy=policy,
                containers=by_name,
            )
        except EngineInstanceError as exc:
            return str(exc), exc.check
        except DockerEngineError as exc:
            return str(exc), "docker"

    prepared = _pool_map(prepare, list(specs), options.parallel)
    refusals: list[tuple[str, str, str]] = []
    runs: dict[str, EngineRun] = {}
    for name, outcome in zip([str(spec.get("name")) for spec in specs], prepared):
        if isinstance(outcome, EngineRun):
            runs[name] = outcome
        else:
            refusals.append((name, outcome[0], outcome[1]))
    order = _prune_order(runs, containers, options, keep=held) if options.prune else PruneOrder([], [])
    if not refusals:
        refusals.extend(_place(runs, containers, order, read_gpus))
    if not refusals:
        refusals.extend(_mark_missing_images(runs))
    if refusals:
        engines = {name: {"failed": True, "msg": message, "check": check} for name, message, check in refusals}
        raise EngineSetError(
            f"nothing was changed: {_failure_text(refusals)}",
            result={"check": refusals[0][2] if len(refusals) == 1 else "engines", "engines": engines, "pruned": []},
        )
    _bring_images(runs, policy, options, check_mode=check_mode, clock=clock)
    if not check_mode and options.owner:
        try:  # root's record of the images pulled, for the owner's image prune (converge.images)
            record_pulls(list(runs.values()), engine, state_dir=options.state_dir, owner=str(options.owner))
        except MeridianError as exc:
            raise EngineSetError(
                f"no engine was changed: {exc}", result={"check": "image-record", "pruned": []}
            ) from exc
    pruned = [{"name": name, "reason": "first"} for name in order.first]
    pruned += [{"name": name, "reason": "later"} for name in order.later]
    held_results = _hold_all(held, cordon, options, engine, check_mode, sleep, clock)
    if check_mode:
        results = {name: apply_or_report(run, check_mode=True) for name, run in runs.items()}
        result = _set_result(results, runs, pruned, by_name, check_mode=True)
    else:
        try:
            result = _act(runs, order, by_name, options, engine, sleep, clock)
        except EngineSetError as exc:
            _with_held(exc.result, held_results)
            raise
    if options.prune and options.owner:
        _prune_images(result, runs, containers, options, policy, engine, check_mode=check_mode, now=wall())
    _release_cordon_marks(result, runs, check_mode=check_mode)
    return _with_held(result, held_results)


# --- images (engines.image_pulls) -----------------------------------------------------------------------


def _mark_missing_images(runs: Mapping[str, EngineRun]) -> list[tuple[str, str, str]]:
    """Mark the runs whose plan creates from an image Docker lacks that placement did not look at (``placed``);
    the refusals of those whose image could not be looked at."""
    refusals: list[tuple[str, str, str]] = []
    for run in runs.values():
        try:
            mark_unplaced_image(run)
        except DockerEngineError as exc:
            refusals.append((run.name, str(exc), "docker"))
    return refusals


def _bring_images(
    runs: Mapping[str, EngineRun],
    policy: Policy,
    options: SetOptions,
    *,
    check_mode: bool,
    clock: Callable[[], float],
) -> None:
    """Every missing image pulled (or forecast) before any engine is touched (``converge.images``); a failure
    fails the set with nothing changed, each engine that needed the image naming the check and how far the pull
    got."""
    try:
        bring_images(
            list(runs.values()),
            policy,
            check_mode=check_mode,
            clock=clock,
            progress_file=options.progress_file,
            pull=options.pull,
        )
    except EngineInstanceError as exc:
        engines = {
            name: {**run.result(), "failed": True, "msg": str(exc), "check": exc.check}
            for name, run in runs.items()
            if run.image_pull is not None and not run.image_pull.get("pulled") and not run.image_pull.get("would_pull")
        }
        raise EngineSetError(
            f"every engine serves as before: {exc}",
            result={"check": exc.check, "engines": engines, "pruned": []},
        ) from exc
    except DockerEngineError as exc:
        raise EngineSetError(f"nothing was changed: {exc}", result={"check": "docker", "pruned": []}) from exc


def _image_ids(engine: DockerEngine, references: Iterable[str]) -> set[str]:
    """The local image ids of ``references``; one Docker lacks (check mode, before its pull) has none."""
    found = set()
    for reference in references:
        try:
            found.add(engine.resolve_image(reference).id)
        except ImageNotFoundError:
            continue
    return found


def _prune_images(
    result: dict[str, Any],
    runs: Mapping[str, EngineRun],
    containers: Sequence[ContainerInfo],
    options: SetOptions,
    policy: Policy,
    engine: DockerEngine,
    *,
    check_mode: bool,
    now: float,
) -> None:
    """After every engine converged: the owner's brought images no engine uses, removed after the policy's
    grace (``engines.image_prune``); the result's ``images``. Check mode predicts from the plan: the owner's
    listed engines end on their specs' images and its dropped ones are gone, every other container stays."""
    wanted = [run.spec.image for run in runs.values() if run.spec is not None]
    try:
        in_use = _image_ids(engine, wanted)
        if check_mode:
            ours = set(runs) | {str(entry["name"]) for entry in result.get("pruned") or ()}
            mine = {c.id for c in containers if c.labels.get(LABEL_OWNER) == options.owner and c.name in ours}
            in_use |= {c.image_id for c in containers if c.id not in mine}
        else:
            in_use |= {c.image_id for c in engine.list_containers()}
        images = prune_images(
            engine,
            state_dir=options.state_dir,
            owner=str(options.owner),
            loaded_too=options.prune_loaded,
            in_use=in_use,
            now=now,
            grace_s=policy.images.prune_grace_seconds,
            check_mode=check_mode,
            allowed=policy.repository_allowed,
        )
    except MeridianError as exc:
        # Every engine converged and the dropped ones are gone: say so, and fail on the images alone.
        raise EngineSetError(
            f"the engines converged, but the image prune failed: {exc}", result={**result, "check": "image-prune"}
        ) from exc
    removed_any = bool(images.pop("changed"))
    result["changed"] = bool(result.get("changed")) or removed_any
    result["images"] = images


# --- cordons (engines.cordon) ---------------------------------------------------------------------------


def _split_held(
    specs: Sequence[Mapping[str, Any]],
    options: SetOptions,
    cordon: HostCordon | None,
    read_gpus: Callable[[], Mapping[str, Any]],
) -> tuple[list[str], list[Mapping[str, Any]]]:
    """The engines a draining cordon holds (by name), and the specs converged as usual."""
    if cordon is None or not cordon.drain:
        return [], list(specs)
    held: list[str] = []
    rest: list[Mapping[str, Any]] = []
    for spec in specs:
        engine_options = _engine_options(spec, options, cordon)
        try:
            covered = held_by_cordon(engine_options, spec.get("gpus") or (), read_gpus)
        except PlacementFactsError as exc:
            raise EngineSetError(str(exc), result={"check": "placement-health"}) from exc
        if covered:
            held.append(str(spec.get("name")))
        else:
            rest.append(spec)
    return held, rest


def _hold_all(
    held: Sequence[str],
    cordon: HostCordon | None,
    options: SetOptions,
    engine: DockerEngine,
    check_mode: bool,
    sleep: Callable[[float], None],
    clock: Callable[[], float],
) -> dict[str, dict[str, Any]]:
    """Drain and stop, one at a time and before anything else changes, the engines a cordon holds."""
    results: dict[str, dict[str, Any]] = {}
    if cordon is None:
        return results
    for name in held:
        try:
            results[name] = hold(name, cordon, options, engine, check_mode, sleep, clock)
        except EngineInstanceError as exc:
            results[name] = exc.failure()
            raise EngineSetError(
                f"engine {name!r} (check {exc.check}): {exc}",
                result={"check": exc.check, "engines": dict(results), "pruned": []},
            ) from exc
    return results


def _with_held(result: dict[str, Any], held: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    if not held:
        return result
    result.setdefault("engines", {}).update({name: dict(outcome) for name, outcome in held.items()})
    diff = result.setdefault("diff", {"before": {}, "after": {}})
    for name, outcome in held.items():
        diff["before"][name] = outcome["diff"]["before"]
        diff["after"][name] = outcome["diff"]["after"]
    result["changed"] = bool(result.get("changed")) or any(outcome.get("changed") for outcome in held.values())
    return result


def _release_cordon_marks(result: dict[str, Any], runs: Mapping[str, EngineRun], *, check_mode: bool) -> None:
    """Engines no cordon holds any more get their cordon's draining mark cleared: back in service."""
    for name, run in runs.items():
        try:
            released = release_hold(run, result["engines"][name], check_mode=check_mode)
        except DrainStateError as exc:
            raise EngineSetError(str(exc), result={**result, "check": "drain-state"}) from exc
        if released:
            result["changed"] = True


def _prune_order(
    runs: Mapping[str, EngineRun], containers: Sequence[ContainerInfo], options: SetOptions, *, keep: Sequence[str] = ()
) -> PruneOrder:
    """The owner's engines the set does not list, split into those in a listed engine's way and the others.
    ``keep``: listed engines a cordon holds (not converged with the rest, never pruned)."""
    mine = [
        _held(container)
        for container in containers
        if container.owned
        and container.instance == container.name
        and container.labels.get(LABEL_OWNER) == options.owner
        and container.name not in keep
    ]
    desired = [_member(run).as_desired() for run in runs.values()]
    return prune_order([held.as_engine() for held in mine], desired)


def _place(
    runs: Mapping[str, EngineRun],
    containers: Sequence[ContainerInfo],
    order: PruneOrder,
    gpu_facts: Callable[[], Mapping[str, Any]],
) -> list[tuple[str, str, str]]:
    """Placement of every engine to be created, against the host and the rest of the set; the refusals.
    What placement lets through but must say lands in each run's ``placement_warnings``."""
    members = {name: _member(run) for name, run in runs.items()}
    listed, pruned_first = set(runs), set(order.first)
    outside = [_held(c) for c in containers if c.owned and c.name not in listed and c.name not in pruned_first]
    first = [_held(c) for c in containers if c.owned and c.name in pruned_first]
    creating = [run for run in runs.values() if creates(run.plan) and run.spec is not None]
    facts: Mapping[str, Any] | None = None
    with_gpus = [run.name for run in creating if placed(run) and run.spec is not None and run.spec.gpus]
    if with_gpus:
        # NVML only when a new engine asks for GPUs: a no-op converge never loads it.
        try:
            facts = gpu_facts()
        except PlacementFactsError as exc:
            # Which GPUs are held unhealthy cannot be known: no engine asking for GPUs is placed.
            return [(name, str(exc), "placement-health") for name in with_gpus]
    refusals: list[tuple[str, str, str]] = []
    for port, clashing in port_clashes(list(members.values())):
        refusals.append(
            (
                clashing[0],
                f"engines {clashing} all ask for port {port}; give each engine its own port",
                "placement-port",
            )
        )
    if refusals:
        return refusals
    _rooms(creating, members, containers, facts, outside, first)
    for run in creating:
        spec = run.spec
        if not placed(run) or spec is None:
            continue  # check mode before the artifact is in the store: placement needs the settings
        member = members[run.name]
        inputs = placement_inputs(member, list(members.values()), outside=outside, pruned_first=first)

        def port_taken(port: int, run: EngineRun = run, member: Member = member) -> str | None:
            holders = [_held(c) for c in containers if port in published_on(c, run.bind)]
            if not holders:
                return port_bind_problem(run.bind, port)
            handover = port_handover(member, holders, members, order.first)
            if handover.blocker is None:
                return None
            holder = handover.blocker
            whose = "" if holder.owned else " (not a meridian.node engine)"
            return f"port {port} on {run.bind} is published by container {holder.name!r}{whose}, which this run keeps"

        try:
            check_placement(
                run,
                spec,
                gpu_facts=facts if spec.gpus else None,
                others=inputs.others,
                replaced=inputs.replaced,
                freed=inputs.freed,
                arriving=inputs.arriving,
                port_taken=port_taken,
            )
        except EngineInstanceError as exc:
            refusals.append((run.name, str(exc), exc.check))
        except DockerEngineError as exc:
            refusals.append((run.name, str(exc), "docker"))
    return refusals


def _rooms(
    creating: Sequence[EngineRun],
    members: dict[str, Member],
    containers: Sequence[ContainerInfo],
    facts: Mapping[str, Any] | None,
    outside: Sequence[Held],
    first: Sequence[Held],
) -> None:
    """Which running engines of the set can be replaced beside their old container (``engines.plan``).

    Not one whose old container another engine of the set waits for (its port or GPU, ``needs``): that one
    must retire first, as before. The free port must be one no other engine of the set asks for, and the
    new engine's GPUs must have room with every other engine as it will be and its own old one still held.
    """
    for run in creating:
        spec = run.spec
        if not may_go_beside(run) or spec is None:
            continue
        member = members[run.name]
        if any(needs(waiting, member) for waiting in members.values()):
            replan_with_room(run, Room(why_not="another engine of the set waits for its old container"))
            continue
        inputs = placement_inputs(member, list(members.values()), outside=outside, pruned_first=first)
        wanted = [other.port for other in members.values() if other.name != run.name and other.port is not None]
        room = find_room(run, spec, containers=containers, gpu_facts=facts, others=inputs.others, wanted=wanted)
        replan_with_room(run, room)
        members[run.name] = _member(run)


def _act(
    runs: Mapping[str, EngineRun],
    order: PruneOrder,
    by_name: Mapping[str, ContainerInfo],
    options: SetOptions,
    engine: DockerEngine,
    sleep: Callable[[float], None],
    clock: Callable[[], float],
) -> dict[str, Any]:
    pruned: list[dict[str, Any]] = []
    failures: list[tuple[str, str, str]] = []

    def prune(names: Sequence[str], reason: str) -> None:
        """The dropped engines ``names``, pruned side by side: into ``pruned``, or ``failures``."""
        ends = _pool_map(
            lambda name: _prune(by_name[name], reason, options, engine, sleep, clock), names, options.parallel
        )
        for name, outcome in zip(names, ends):
            if outcome.failure is None:
                pruned.append({"name": name, "reason": reason})
            else:
                failures.append((name, *outcome.failure))

    prune(order.first, "first")
    outcomes: dict[str, _Outcome] = {}
    if failures:
        for name in runs:
            outcomes[name] = _Outcome(
                {
                    "failed": True,
                    "msg": "not converged: a dropped engine in its way could not be pruned",
                    "check": "blocked",
                }
            )
    else:
        _converge_waves(runs, options, sleep, clock, outcomes)
        failures.extend(
            (name, outcome.failure[0], outcome.failure[1])
            for name, outcome in outcomes.items()
            if outcome.failure is not None
        )
    if not failures:
        prune(order.later, "later")
    results = {name: _with_failure(outcomes[name]) for name in runs}
    result = _set_result(results, runs, pruned, by_name, check_mode=False)
    if failures:
        result["check"] = failures[0][2] if len(failures) == 1 else "engines"
        raise EngineSetError(f"{len(failures)} engine(s) failed: {_failure_text(failures)}", result=result)
    return result


def _converge_waves(
    runs: Mapping[str, EngineRun],
    options: SetOptions,
    sleep: Callable[[float], None],
    clock: Callable[[], float],
    outcomes: dict[str, _Outcome],
) -> None:
    """Act on the engines wave by wave; engines with nothing to do are probed alongside the first wave."""
    acting = [name for name, run in runs.items() if run.plan.actions]
    idle = [name for name, run in runs.items() if not run.plan.actions]
    plan = waves([_member(run) for run in runs.values()], acting)
    members = {name: _member(run) for name, run in runs.items()}
    failed: set[str] = set()

    def act(name: str, retire_only: bool = False) -> _Outcome:
        run = runs[name]
        return _guard(lambda: apply_or_report(run, check_mode=False, sleep=sleep, clock=clock, retire_only=retire_only))

    def unblocked(names: Sequence[str]) -> list[str]:
        """``names`` less those that need what a failed engine still holds; those are failed as blocked."""
        free = []
        for name in names:
            blockers = ", ".join(sorted(other for other in failed if needs(members[name], members[other])))
            if not blockers:
                free.append(name)
                continue
            outcomes[name] = _Outcome(
                {**runs[name].result(), "failed": True},
                (f"not converged: it needs the port or GPU of {blockers}, which failed", "blocked"),
            )
            failed.add(name)
        return free

    for index, wave in enumerate(plan):
        names = unblocked(wave.names)
        if wave.retire_first:
            retired = _pool_map(lambda name: act(name, retire_only=True), names, options.parallel)
            for name, outcome in zip(names, retired):
                if outcome.failure is not None:
                    outcomes[name] = outcome
                    failed.add(name)
            names = unblocked([name for name in names if name not in failed])
        batch = names + (idle if index == 0 else [])
        for name, outcome in zip(batch, _pool_map(act, batch, options.parallel)):
            outcomes[name] = outcome
            if outcome.failure is not None:
                failed.add(name)
    if not plan:
        for name, outcome in zip(idle, _pool_map(act, idle, options.parallel)):
            outcomes[name] = outcome


def _with_failure(outcome: _Outcome) -> dict[str, Any]:
    if outcome.failure is None:
        return outcome.result
    return {**outcome.result, "failed": True, "msg": outcome.failure[0], "check": outcome.failure[1]}


def _guard(step: Callable[[], dict[str, Any]]) -> _Outcome:
    """One engine's step, its failure kept as its outcome instead of ending the others'."""
    try:
        return _Outcome(step())
    except EngineInstanceError as exc:
        return _Outcome({**exc.result, "failed": True}, (str(exc), exc.check))
    except DockerEngineError as exc:
        return _Outcome({"failed": True}, (str(exc), "docker"))
    except DrainStateError as exc:
        return _Outcome({"failed": True}, (str(exc), "drain-state"))


def _prune(
    container: ContainerInfo,
    reason: str,
    options: SetOptions,
    engine: DockerEngine,
    sleep: Callable[[float], None],
    clock: Callable[[], float],
) -> _Outcome:
    """Drain a dropped engine (its requests finish), stop it, remove it; as meridian.node.drain then
    engine_instance state absent would."""
    why = options.prune_reason + (", and a listed engine needs its port or GPU" if reason == "first" else "")
    drain = DrainOptions(
        state="drained",
        timeout_s=options.drain_timeout_s,
        grace_s=options.drain_grace_s,
        stop=True,
        state_dir=options.state_dir,
        reason=why,
    )
    try:
        drain_engine(container.name, drain, engine=engine, check_mode=False, sleep=sleep, clock=clock)
        current = engine.find_owned(container.name)
        if current is not None:
            if current.id != container.id:
                # Someone made a new container under that name meanwhile: it is not the one planned away.
                return _Outcome(
                    failure=(f"container {container.name!r} was replaced while it was pruned; left alone", "prune")
                )
            engine.remove(current, force=current.state in ("restarting", "paused"))
        clear_draining(options.state_dir, container.name)
    except DrainError as exc:
        return _Outcome(failure=(str(exc), "drain"))
    except DockerEngineError as exc:
        return _Outcome(failure=(str(exc), "docker"))
    except DrainStateError as exc:
        return _Outcome(failure=(str(exc), "drain-state"))
    return _Outcome()


def _set_result(
    results: Mapping[str, Mapping[str, Any]],
    runs: Mapping[str, EngineRun],
    pruned: Sequence[Mapping[str, Any]],
    by_name: Mapping[str, ContainerInfo],
    *,
    check_mode: bool,
) -> dict[str, Any]:
    before: dict[str, Any] = {}
    after: dict[str, Any] = {}
    for name, run in runs.items():
        diff = run.diff()
        before[name], after[name] = diff["before"], diff["after"]
    for entry in pruned:
        container = by_name.get(str(entry["name"]))
        if container is not None:
            before[str(entry["name"])] = {
                "state": "started" if container.running else "stopped",
                "config_hash": container.config_hash,
                "spec": label_spec(container),
            }
            after[str(entry["name"])] = {}
    changed = bool(pruned) or any(
        bool(result.get("done")) or (check_mode and bool(result.get("actions"))) for result in results.values()
    )
    warnings = [f"engine {name!r}: {result['pending']}" for name, result in results.items() if result.get("pending")]
    warnings += [str(warning) for result in results.values() for warning in result.get("placement_warnings") or []]
    return {
        "changed": changed,
        "engines": {name: dict(result) for name, result in results.items()},
        "pruned": list(pruned),
        "diff": {"before": before, "after": after},
        **({"warnings": warnings} if warnings else {}),
    }
