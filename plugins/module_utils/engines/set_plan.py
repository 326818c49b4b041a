"""Plan a host's whole set of engines at once: what each new engine shares the host with, and in what order
the engines may be acted on.

Pure: no Docker, no NVML, no clock. ``engines.set`` observes the host once, prepares every engine with
``engines.converge.prepare.prepare_engine`` (one plan per engine), and asks this file three things before anything
changes:

- ``placement_inputs``: the reservations a new engine's placement must count. Beside the host's other owned
  engines, the set's other engines count as they will be (their spec's reservation); the VRAM of containers
  removed before the new one starts (its own old container, another engine's replaced one, a dropped engine
  pruned first) is credited to the free VRAM, and the set's other new engines are taken off it: two new
  engines on one GPU must fit together.
- ``port_handover``: who publishes a port a new engine asks for, and whether the run frees it first.
- ``waves``: the order. An engine that needs a port or a GPU another engine of the set still holds (with a
  container that engine's plan removes) waits until that one has retired its container. Engines that wait
  on nothing go together; engines that wait on each other (two engines swapping ports) retire together
  first, then build together.

Which dropped engines leave first is ``engines.prune.prune_order``'s answer, reused as it is.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ansible_collections.meridian.node.plugins.module_utils.engines.placement import Reservation
from ansible_collections.meridian.node.plugins.module_utils.engines.prune import gpus_may_overlap

__all__ = [
    "Held",
    "Member",
    "PlacementInputs",
    "PortHandover",
    "Wave",
    "duplicate_names",
    "needs",
    "placement_inputs",
    "port_clashes",
    "port_handover",
    "waves",
]


@dataclass(frozen=True)
class Held:
    """A container as it holds the host now: the port it publishes (only a running one does), and the GPUs
    and VRAM its labels reserve. ``owner`` is its ``meridian.node/owner`` label ('' when none)."""

    name: str
    port: int | None = None
    gpus: tuple[str, ...] = ()
    min_vram_mib: int = 0
    owned: bool = True
    owner: str = ""

    def as_engine(self) -> dict[str, Any]:
        """The shape ``engines.prune.prune_order`` reads (engine_info's)."""
        return {"name": self.name, "port": self.port, "gpus": list(self.gpus), "min_vram_mib": self.min_vram_mib}


@dataclass(frozen=True)
class Member:
    """One engine of the set: what it will be, and what its plan does to the host.

    ``creates``: the plan creates its container. ``retires``: the plan removes its current container
    (a replacement, or state absent). ``current`` is its container now, if any.
    """

    name: str
    state: str
    port: int | None = None
    gpus: tuple[str, ...] = ()
    min_vram_mib: int = 0
    creates: bool = False
    retires: bool = False
    current: Held | None = None

    def as_desired(self) -> dict[str, Any]:
        """The shape ``engines.prune.prune_order`` reads (a desired state's engine)."""
        return {
            "name": self.name,
            "state": self.state,
            "port": self.port,
            "gpus": list(self.gpus),
            "min_vram_mib": self.min_vram_mib,
        }


@dataclass(frozen=True)
class PlacementInputs:
    others: tuple[Reservation, ...]
    replaced: Reservation | None
    freed: tuple[Reservation, ...]
    arriving: tuple[Reservation, ...]


@dataclass(frozen=True)
class PortHandover:
    """Who publishes a port now. ``blocker`` keeps it through the run (a refusal); ``waits_for`` are set
    engines whose retirement frees it (an order); a dropped engine pruned first frees it before anything."""

    blocker: Held | None
    waits_for: tuple[str, ...] = ()


@dataclass(frozen=True)
class Wave:
    """Engines acted on together. With ``retire_first`` every one retires its old container before any builds."""

    names: tuple[str, ...]
    retire_first: bool = False


def duplicate_names(names: Iterable[str]) -> list[str]:
    """Names listed more than once, sorted."""
    seen: set[str] = set()
    twice: set[str] = set()
    for name in names:
        (twice if name in seen else seen).add(name)
    return sorted(twice)


def port_clashes(members: Sequence[Member]) -> list[tuple[int, list[str]]]:
    """Ports that two or more engines of the set ask for, with their names: one port serves one engine."""
    by_port: dict[int, list[str]] = {}
    for member in members:
        if member.state != "absent" and member.port is not None:
            by_port.setdefault(member.port, []).append(member.name)
    return sorted((port, sorted(names)) for port, names in by_port.items() if len(names) > 1)


def _reservation(name: str, gpus: Sequence[str], vram: int) -> Reservation | None:
    return Reservation(name, tuple(gpus), vram) if vram and gpus else None


def placement_inputs(
    member: Member,
    members: Sequence[Member],
    *,
    outside: Sequence[Held],
    pruned_first: Sequence[Held],
) -> PlacementInputs:
    """The reservations placing ``member`` (a new container) counts.

    ``outside``: owned containers that are neither the set's nor pruned first (other owners', and dropped
    engines pruned only after the set serves): they keep their reservation. ``pruned_first``: removed before
    anything is created, so what they hold is credited.
    """
    others: list[Reservation] = []
    freed: list[Reservation] = []
    arriving: list[Reservation] = []
    for held in outside:
        found = _reservation(held.name, held.gpus, held.min_vram_mib)
        if found is not None:
            others.append(found)
    for held in pruned_first:
        found = _reservation(held.name, held.gpus, held.min_vram_mib)
        if found is not None:
            freed.append(found)
    for other in members:
        if other.name == member.name:
            continue
        wanted = None if other.state == "absent" else _reservation(other.name, other.gpus, other.min_vram_mib)
        if wanted is not None:
            others.append(wanted)
            if other.creates:
                arriving.append(wanted)
        if other.retires and other.current is not None:
            old = _reservation(other.name, other.current.gpus, other.current.min_vram_mib)
            if old is not None:
                freed.append(old)
    replaced = None
    if member.retires and member.current is not None:
        replaced = _reservation(member.name, member.current.gpus, member.current.min_vram_mib)
    return PlacementInputs(tuple(others), replaced, tuple(freed), tuple(arriving))


def port_handover(
    member: Member,
    holders: Sequence[Held],
    members: Mapping[str, Member],
    pruned_first: Iterable[str],
) -> PortHandover:
    """Whether ``member``'s port is free for it by the time it starts, given the containers publishing it now.

    Free: held by its own old container (which it removes first), by a dropped engine pruned first, or by
    another engine of the set whose plan removes that container (``member`` then waits for it). Anything
    else - a running engine the set keeps, another owner's, a stranger's container - blocks it.
    """
    first = set(pruned_first)
    waits: list[str] = []
    for held in holders:
        if held.name == member.name and held.owned:
            continue
        if held.owned and held.name in first:
            continue
        other = members.get(held.name)
        if held.owned and other is not None and other.retires:
            waits.append(held.name)
            continue
        return PortHandover(blocker=held)
    return PortHandover(blocker=None, waits_for=tuple(sorted(waits)))


def needs(member: Member, other: Member) -> bool:
    """Whether ``member`` (creating) needs something ``other``'s current container holds until it retires."""
    if not member.creates or not other.retires or other.current is None or other.name == member.name:
        return False
    held = other.current
    if member.port is not None and held.port == member.port:
        return True
    return bool(member.min_vram_mib and held.min_vram_mib and gpus_may_overlap(member.gpus, held.gpus))


def waves(members: Sequence[Member], acting: Iterable[str]) -> list[Wave]:
    """The engines in ``acting`` (those whose plan has actions), grouped in the order they may run.

    Each wave holds the engines whose every dependency is in an earlier wave, sorted by name. Engines left
    over wait on each other in a cycle (or on such an engine): they form one last wave that retires first.
    """
    names = set(acting)
    by_name = {member.name: member for member in members if member.name in names}
    after: dict[str, set[str]] = {
        name: {other.name for other in by_name.values() if needs(by_name[name], other)} for name in by_name
    }
    ordered: list[Wave] = []
    placed: set[str] = set()
    while True:
        ready = sorted(name for name in by_name if name not in placed and after[name] <= placed)
        if not ready:
            break
        ordered.append(Wave(tuple(ready)))
        placed.update(ready)
    rest = sorted(name for name in by_name if name not in placed)
    if rest:
        ordered.append(Wave(tuple(rest), retire_first=True))
    return ordered
