"""Room beside the old container: whether a running engine's replace can start the new one beside it, on a free
port of the policy's range, and with VRAM for both on its GPUs (``engines.plan``: the ``beside`` way).

The caller says what else the new engine shares the host with: ``engines.instance`` the host as it is,
``engines.set`` the host and the rest of the set as they will be.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ansible_collections.meridian.node.plugins.module_utils.docker.engine import (
    ContainerInfo,
    address_overlaps,
    port_bind_problem,
)
from ansible_collections.meridian.node.plugins.module_utils.engines.converge.engine_run import EngineRun
from ansible_collections.meridian.node.plugins.module_utils.engines.converge.gates import own_reservation
from ansible_collections.meridian.node.plugins.module_utils.engines.converge.prepare import plan_for
from ansible_collections.meridian.node.plugins.module_utils.engines.labels import shown_spec
from ansible_collections.meridian.node.plugins.module_utils.engines.plan import Room
from ansible_collections.meridian.node.plugins.module_utils.engines.spec import ParsedEngineSpec

if TYPE_CHECKING:
    from ansible_collections.meridian.node.plugins.module_utils.engines.placement import Reservation

__all__ = ["find_room", "may_go_beside", "published_on", "replan_with_room"]


def may_go_beside(run: EngineRun) -> bool:
    """Whether ``run`` replaces a running engine in place and may look for room beside it (``replace_beside``)."""
    return run.plan.way == "in-place" and run.spec is not None and run.options.replace_beside


def published_on(container: ContainerInfo, bind: str) -> list[int]:
    """The TCP host ports ``container`` publishes on ``bind`` (or on an address that overlaps it)."""
    return [p.host_port for p in container.ports if p.protocol == "tcp" and address_overlaps(p.host_ip, bind)]


def find_room(
    run: EngineRun,
    spec: ParsedEngineSpec,
    *,
    containers: Iterable[ContainerInfo],
    gpu_facts: Mapping[str, Any] | None,
    others: Sequence[Reservation],
    wanted: Iterable[int] = (),
) -> Room:
    """Whether ``spec``'s new engine fits beside the old one it replaces (``run.current``) until it is ready.

    A free port: the spec's own when nothing holds it (the old one runs on another, having taken over from a
    replace beside it), else the lowest of the policy's range that no container publishes (``containers``:
    every container on the host), nothing else wants (``wanted``: the ports of the other engines of a set) and
    the kernel lets us bind. And its GPUs: with ``min_vram_mib``, the same check placement makes
    (``placement_problem``), but with the old engine's reservation still held; without it, how much the new
    engine takes cannot be known, so there is no room on a GPU. Pure but for the bind check. The caller plans
    again with it (``replan_with_room``).
    """
    published = [port for container in containers for port in published_on(container, run.bind)]
    taken = {*published, *wanted}
    low, high = run.port_range
    candidates = [spec.port, *range(low, high + 1)]
    port = next((p for p in candidates if p not in taken and port_bind_problem(run.bind, p) is None), None)
    if port is None:
        return Room(why_not=f"no free port in the policy's range {low}-{high} on {run.bind}")
    if spec.gpus:
        if not spec.min_vram_mib:
            return Room(why_not="it asks for GPUs without min_vram_mib, so its VRAM beside the old one's is unknown")
        # Imported here: only an engine with GPUs needs placement's rule, and a module pays its imports on every task.
        from ansible_collections.meridian.node.plugins.module_utils.engines.placement import placement_problem

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
    run.plan = plan_for(run.name, run.options, run.config_hash, shown_spec(run.spec), run.observed, run.leftovers, room)
