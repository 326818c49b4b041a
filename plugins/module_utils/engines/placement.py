"""Where an engine may run: the GPUs and MIG instances its spec names, and the VRAM they have room for.

Pure but for ``read_gpu_facts``: GPU facts (``gpu.facts``) and the reservations our containers' labels
record in, a refusal with the numbers out. A device's room for a new engine is ``min(free, total -
reserved)``, where ``reserved`` sums the reservations of the *other* engines we own on it (stopped ones
too: starting them again is not re-checked) and ``free`` is NVML's, plus what the containers removed before
it starts held. ``min_vram_mib`` is asked of every requested device.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ansible_collections.meridian.node.plugins.module_utils.docker.engine import ContainerInfo
from ansible_collections.meridian.node.plugins.module_utils.engines.labels import LABEL_MIN_VRAM, label_spec

__all__ = ["Device", "Reservation", "placement_problem", "read_gpu_facts", "reservations_from", "resolve_devices"]


def read_gpu_facts() -> Mapping[str, Any]:
    """This host's GPUs as placement reads them (no processes, no NVLink)."""
    # Imported here: NVML (pynvml) is needed only when placement runs, never on a no-op converge.
    from ansible_collections.meridian.node.plugins.module_utils.gpu.facts import collect_gpu_facts

    return collect_gpu_facts(processes=False, nvlink=False)


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
