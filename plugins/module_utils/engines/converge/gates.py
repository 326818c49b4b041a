"""The gates one engine passes before anything of it changes: a cordon that holds it, placement (GPUs, VRAM,
port, runtime) and its image's labels.

A refusal raises ``EngineInstanceError`` naming the check, with nothing changed. Where it may run and with how
much VRAM is ``engines.placement``'s rule; what a cordon covers and how it holds an engine, ``engines.cordon``'s.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ansible_collections.meridian.node.plugins.module_utils.docker.engine import (
    RESERVED_LABELS,
    DockerEngine,
    ImageNotFoundError,
)
from ansible_collections.meridian.node.plugins.module_utils.engines.converge.engine_run import (
    EngineRun,
    Options,
    RunOptions,
)
from ansible_collections.meridian.node.plugins.module_utils.engines.converge.prepare import creates
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
from ansible_collections.meridian.node.plugins.module_utils.engines.spec import EngineInstanceError, ParsedEngineSpec
from ansible_collections.meridian.node.plugins.module_utils.trust.policy import Policy

if TYPE_CHECKING:
    from ansible_collections.meridian.node.plugins.module_utils.engines.placement import Reservation

# engines.placement and engines.image_pulls (with docker.image_pull under it) are imported where they are used:
# an engine that is already as asked (a no-op) is never placed and pulls nothing, and an Ansible module pays its
# imports on every task (bench/engines.py).

__all__ = [
    "check_image",
    "check_placement",
    "cordon_in_force",
    "gpu_reader",
    "held_by_cordon",
    "hold",
    "mark_unplaced_image",
    "own_reservation",
    "placed",
    "release_hold",
]


# --- cordons (engines.cordon) ---------------------------------------------------------------------------


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
    options: RunOptions,
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


def gpu_reader(
    gpu_facts: Callable[[], Mapping[str, Any]] | None, state_dir: str, cordon: HostCordon | None
) -> Callable[[], Mapping[str, Any]]:
    """The GPU facts placement reads (``gpu_facts``, else NVML's with the verdicts held in ``state_dir``),
    cordoned GPUs marked, read at most once per run and only when first asked for."""
    cache: list[Mapping[str, Any]] = []

    def read_marked() -> Mapping[str, Any]:
        if not cache:
            if gpu_facts is not None:
                facts = gpu_facts()
            else:
                from ansible_collections.meridian.node.plugins.module_utils.engines.placement import read_gpu_facts

                facts = read_gpu_facts(state_dir)
            cache.append(mark_cordoned(facts, cordon))
        return cache[0]

    return read_marked


def release_hold(run: EngineRun, result: dict[str, Any], *, check_mode: bool) -> bool:
    """The hold's other end: an engine to be started that no cordon holds any more gets its cordon's draining
    mark cleared (back in service), and ``unmark`` in its ``result``'s actions; whether it had one.
    Raises ``DrainStateError``."""
    if run.options.state != "started":
        return False
    if not release_cordon_mark(run.options.state_dir, run.name, check_mode=check_mode):
        return False
    result["actions"] = [*result.get("actions", []), "unmark"]
    return True


# --- placement (engines.placement) and the image ----------------------------------------------------------


def placed(run: EngineRun) -> bool:
    """Whether ``run`` is placed: its plan creates a container and its settings are known (a run pending its
    artifact, in check mode, has none to place: its result says so instead)."""
    return creates(run.plan) and run.spec is not None and run.settings is not None


def mark_unplaced_image(run: EngineRun) -> None:
    """For a run that creates but is not placed (``placed``), whether Docker lacks its image; placement looks
    for the others' (``check_placement``)."""
    if creates(run.plan) and run.spec is not None and run.settings is None:
        from ansible_collections.meridian.node.plugins.module_utils.engines.image_pulls import image_missing

        run.image_missing = image_missing(run.engine, run.spec.image)


def own_reservation(run: EngineRun) -> Reservation | None:
    """The VRAM reservation of the container ``run`` replaces, if it has one."""
    if run.current is None:
        return None
    from ansible_collections.meridian.node.plugins.module_utils.engines.placement import reservations_from

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
    from ansible_collections.meridian.node.plugins.module_utils.engines.placement import (
        placement_problem,
        placement_warnings,
    )

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
