"""Converge one inference engine container: every check first, then the planned actions, one by one.

``converge`` is everything ``meridian.node.engine_instance`` does except talking to Ansible. It only puts the
phases of ``engines.converge`` in order for one engine (``engines.set`` does for a set); the order is the safety
argument, so it is spelt out here:

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
(``converge.room.find_room``: a free port in the policy's range, and the new engine's GPUs and VRAM besides the
old one's) the new engine starts beside the old and takes over once ready, on the free port; otherwise the old
one is stopped but kept until the new one is ready, and the engine keeps its port. If the new one fails,
``converge.act.apply_engine`` rolls back (``plan.rollback_actions``) so that the old one serves again, and the
result's ``replace`` says ``rolled-back`` with the reason.

The spec and the host policy are ``engines.spec``'s; the labels each container carries, ``engines.labels``;
where it may run and with how much VRAM, ``engines.placement``; which model directory it mounts,
``artifacts.layout`` (the store's own rule).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping
from typing import Any

from ansible_collections.meridian.node.plugins.module_utils._errors import MeridianError
from ansible_collections.meridian.node.plugins.module_utils.docker.engine import DockerEngine, DockerEngineError
from ansible_collections.meridian.node.plugins.module_utils.engines.converge.act import apply_or_report
from ansible_collections.meridian.node.plugins.module_utils.engines.converge.engine_run import EngineRun, Options
from ansible_collections.meridian.node.plugins.module_utils.engines.converge.gates import (
    check_placement,
    cordon_in_force,
    gpu_reader,
    held_by_cordon,
    hold,
    mark_unplaced_image,
    own_reservation,
    placed,
    release_hold,
)
from ansible_collections.meridian.node.plugins.module_utils.engines.converge.prepare import (
    load_engine_policy,
    prepare_engine,
)
from ansible_collections.meridian.node.plugins.module_utils.engines.converge.room import (
    find_room,
    may_go_beside,
    replan_with_room,
)
from ansible_collections.meridian.node.plugins.module_utils.engines.drain_marks import DrainStateError
from ansible_collections.meridian.node.plugins.module_utils.engines.spec import EngineInstanceError, ParsedEngineSpec

__all__ = ["converge"]

# engines.placement and converge.images (the image pull, with its progress and prune under it) are imported where
# they are used: an engine already as asked (a no-op) is neither placed nor pulled, and an Ansible module pays its
# imports on every task (bench/engines.py).


def _placement_facts_error() -> type[Exception]:
    """``engines.placement.PlacementFactsError``, imported only when an exception is being matched against it."""
    from ansible_collections.meridian.node.plugins.module_utils.engines.placement import PlacementFactsError

    return PlacementFactsError


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
    try:
        policy = load_engine_policy(options.policy_path) if options.state != "absent" else None
        cordon = cordon_in_force(options.state_dir, policy)
        options = dataclasses.replace(options, cordon=cordon)
        read_gpus = gpu_reader(gpu_facts, options.state_dir, cordon)
        if cordon is not None and held_by_cordon(options, params.get("gpus") or (), read_gpus):
            return hold(str(params["name"]), cordon, options, engine, check_mode, sleep, clock)
        run = prepare_engine(params, options, engine, check_mode=check_mode, policy=policy)
        if may_go_beside(run) and run.spec is not None:
            _look_for_room(run, run.spec, read_gpus)
        if placed(run) and run.spec is not None:
            _check_placement(run, run.spec, read_gpus)
        else:
            mark_unplaced_image(run)
        if run.image_missing and policy is not None:
            from ansible_collections.meridian.node.plugins.module_utils.engines.converge.images import bring_images

            bring_images(
                [run],
                policy,
                check_mode=check_mode,
                clock=clock,
                progress_file=options.progress_file,
                pull=options.pull,
            )
            if not check_mode and options.owner:
                _record_pull(run, options.state_dir, options.owner)
        result = apply_or_report(run, check_mode=check_mode, sleep=sleep, clock=clock)
        if release_hold(run, result, check_mode=check_mode):
            result["changed"] = True  # no cordon holds it any more: back in service
    except DockerEngineError as exc:
        raise EngineInstanceError(str(exc), check="docker") from exc
    except DrainStateError as exc:
        raise EngineInstanceError(str(exc), check="drain-state") from exc
    except _placement_facts_error() as exc:
        # The held verdicts cannot be read: placement cannot know which GPUs are held unhealthy, so it refuses.
        raise EngineInstanceError(str(exc), check="placement-health") from exc
    if run.placement_warnings:
        result["warnings"] = [*result.get("warnings", []), *run.placement_warnings]
    return result


def _look_for_room(run: EngineRun, spec: ParsedEngineSpec, read_gpus: Callable[[], Mapping[str, Any]]) -> None:
    """Room beside the old container for the engine alone, against what the host has now."""
    from ansible_collections.meridian.node.plugins.module_utils.engines.placement import reservations_from

    room = find_room(
        run,
        spec,
        containers=run.engine.list_containers(),
        gpu_facts=read_gpus() if spec.gpus and spec.min_vram_mib else None,
        others=reservations_from(run.engine.list_owned(), exclude=spec.name),
    )
    replan_with_room(run, room)


def _check_placement(run: EngineRun, spec: ParsedEngineSpec, read_gpus: Callable[[], Mapping[str, Any]]) -> None:
    """Placement of the engine alone, against what the host has now."""
    from ansible_collections.meridian.node.plugins.module_utils.engines.placement import reservations_from

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


def _record_pull(run: EngineRun, state_dir: str, owner: str) -> None:
    """Root's record of the image this run pulled (``converge.images.record_pulls``); an operator's run without
    ``owner`` records none."""
    from ansible_collections.meridian.node.plugins.module_utils.engines.converge.images import record_pulls

    try:
        record_pulls([run], run.engine, state_dir=state_dir, owner=owner)
    except MeridianError as exc:
        raise EngineInstanceError(
            f"engine {run.name!r}: no engine was changed: {exc}", check="image-record", result=run.result()
        ) from exc
