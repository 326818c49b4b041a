"""Which dropped engines must leave before the desired ones converge, and which may wait until after.

The reconcile playbook converges the desired engines first and prunes the dropped ones (ours, no longer
listed by name) afterwards, so a switch keeps serving capacity. That order fails when a dropped engine holds
what a desired engine needs: placement refuses a port that a running engine publishes, or VRAM that an engine
of ours reserves on a GPU, and the agent would retry the same failing state for ever. ``prune_order`` splits
the dropped engines in two:

- ``first``: dropped engines that conflict with a desired engine that still needs placing - the same port,
  or a GPU both may be on. They are drained and removed before converging.
- ``later``: every other dropped engine, drained and removed after converging, as before.

A desired engine still needs placing unless it already runs under its own name on the same port, with the
same GPUs and at least the VRAM it asks for: converging it then asks placement for nothing a dropped engine
could hold.

Pure: the inputs are the ``engines`` of ``meridian.node.engine_info`` (name, port, gpus, min_vram_mib) and
the ``engines`` the ``meridian.node.desired_state`` module returns (name, port, gpus, min_vram_mib, state).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

__all__ = ["PruneOrder", "gpus_may_overlap", "prune_order"]


class PruneOrder(NamedTuple):
    """Names of the dropped engines, each list sorted."""

    first: list[str]
    later: list[str]


def _gpu_kind(gpu: str) -> str:
    if gpu.isdigit():
        return "index"
    if gpu.startswith("GPU-"):
        return "gpu-uuid"
    if gpu.startswith("MIG-"):
        return "mig-uuid"
    return "unknown"


def _may_be_same(left: str, right: str) -> bool:
    if left == right:
        return True
    kind = _gpu_kind(left)
    # Only two ids of the same known kind are known to name different devices. An index and a uuid, or a MIG
    # uuid and its parent GPU's uuid, can only be related through NVML, which this pure check does not read:
    # call them the same device. Pruning early costs a little capacity for a moment; pruning late fails the run
    # (placement refuses the desired engine) and the agent retries the same state for ever.
    return kind == "unknown" or kind != _gpu_kind(right)


def gpus_may_overlap(left: Iterable[Any], right: Iterable[Any]) -> bool:
    """Whether two engines' GPU lists may share a device (see ``_may_be_same`` for ids of different kinds)."""
    right_ids = [str(gpu) for gpu in right]
    return any(_may_be_same(str(gpu), other) for gpu in left for other in right_ids)


def _port(engine: Mapping[str, Any]) -> int | None:
    value = engine.get("port")
    if value is None or value == "":
        return None
    return int(value)


def _gpus(engine: Mapping[str, Any]) -> list[str]:
    return [str(gpu) for gpu in engine.get("gpus") or []]


def _vram(engine: Mapping[str, Any]) -> int:
    return int(engine.get("min_vram_mib") or 0)


def _in_place(wanted: Mapping[str, Any], current: Mapping[str, Any] | None) -> bool:
    # engine_info reports a port only for a running container (Docker lists no published ports otherwise).
    return (
        current is not None
        and _port(current) is not None
        and _port(current) == _port(wanted)
        and sorted(_gpus(current)) == sorted(_gpus(wanted))
        and _vram(current) >= _vram(wanted)
    )


def _conflicts(dropped: Mapping[str, Any], wanted: Mapping[str, Any]) -> bool:
    port = _port(dropped)
    if port is not None and port == _port(wanted):
        return True
    # A stopped engine publishes no port but still reserves its VRAM for placement: GPUs count whatever its state.
    return gpus_may_overlap(_gpus(dropped), _gpus(wanted))


def prune_order(running: Sequence[Mapping[str, Any]], desired: Sequence[Mapping[str, Any]]) -> PruneOrder:
    """Split the engines in ``running`` that ``desired`` does not list by name into ``first`` and ``later``.

    ``running`` is what we own on the host now (engine_info's dicts), ``desired`` the state's engines.
    """
    listed = {str(engine["name"]) for engine in desired}
    current = {str(engine["name"]): engine for engine in running}
    placing = [
        engine
        for engine in desired
        if engine.get("state", "started") != "absent" and not _in_place(engine, current.get(str(engine["name"])))
    ]
    first: list[str] = []
    later: list[str] = []
    for name, engine in current.items():
        if name in listed:
            continue
        (first if any(_conflicts(engine, wanted) for wanted in placing) else later).append(name)
    return PruneOrder(sorted(first), sorted(later))
