"""Where an engine may run: the GPUs and MIG instances its spec names, whether they may take work, and the
VRAM they have room for.

Pure but for ``read_gpu_facts``: GPU facts (``gpu.facts``) and the reservations our containers' labels
record in, a refusal with the numbers out. A device's room for a new engine is ``min(free, total -
reserved)``, where ``reserved`` sums the reservations of the *other* engines we own on it (stopped ones
too: starting them again is not re-checked) and ``free`` is NVML's, plus what the containers removed before
it starts held. ``min_vram_mib`` is asked of every requested device.

Before the VRAM, whether the device may take a new engine at all (docs/GPU_HEALTH.md):

- a cordoned GPU (``cordoned: true`` in its facts) is refused, check ``placement-cordoned``, whatever the
  spec says;
- a GPU whose health verdict is ``unhealthy`` or ``unknown`` is refused, check ``placement-health``: placement
  fails closed. ``force: true`` in the spec places it anyway, with a warning (``placement_warnings``) that the
  module's result, its diff and so the journal carry; a ``degraded`` GPU is placed with a warning too;
- a MIG instance has its parent GPU's verdict, except that an XID scoped to one MIG device makes that device
  unhealthy (critical XID) or degraded, not its siblings.

Facts with a ``health`` key were judged: ``None`` there means health was not read, which is ``unknown``. Facts
without the key (GPU fact dicts from before health existed, a caller's own) were never judged and place as
before. ``read_gpu_facts`` is the caller that asks for health: every GPU it returns has the key, judged with
the verdict held on the host (``gpu.health_hold``) as its previous one; ``with_held_verdicts`` does the same
for facts read elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from ansible_collections.meridian.node.plugins.module_utils._compat import UTC
from ansible_collections.meridian.node.plugins.module_utils._errors import MeridianError
from ansible_collections.meridian.node.plugins.module_utils.docker.engine import ContainerInfo
from ansible_collections.meridian.node.plugins.module_utils.engines.labels import LABEL_MIN_VRAM, label_spec

if TYPE_CHECKING:
    from ansible_collections.meridian.node.plugins.module_utils.gpu.health_hold import HealthHolds

# gpu.health_rules and gpu.health_hold are imported where placement reads GPUs: a converge that creates no
# engine on a GPU (the no-op most runs are) never loads them.

__all__ = [
    "Device",
    "DeviceHealth",
    "PlacementFactsError",
    "Reservation",
    "placement_problem",
    "placement_warnings",
    "read_gpu_facts",
    "reservations_from",
    "resolve_devices",
    "with_held_verdicts",
]

# Verdicts placement refuses unless the spec says force: fail closed on what is known bad or not known.
_REFUSED = ("unhealthy", "unknown")
_SHOWN_REASONS = 4


class PlacementFactsError(MeridianError):
    """The GPU facts placement needs could not be read whole (the held verdicts' file): it refuses, as for an
    unknown GPU; the message names the file and what to do."""


def read_gpu_facts(state_dir: str | None = None) -> Mapping[str, Any]:
    """This host's GPUs as placement reads them (no processes, no NVLink), with their health asked for: every
    GPU has a ``health`` key, and with ``state_dir`` the verdicts held there are each GPU's previous verdict,
    so they hold in this fresh process too. Raises ``PlacementFactsError`` for a hold file that cannot be
    read."""
    # Imported here: NVML (pynvml) is needed only when placement runs, never on a no-op converge.
    from ansible_collections.meridian.node.plugins.module_utils.gpu.facts import collect_gpu_facts
    from ansible_collections.meridian.node.plugins.module_utils.gpu.health_hold import HealthHoldError, HealthHolds

    try:
        held = HealthHolds(state_dir).all() if state_dir else {}
    except HealthHoldError as exc:
        raise PlacementFactsError(str(exc)) from exc
    facts = collect_gpu_facts(
        processes=False, nvlink=False, previous={uuid: verdict.health for uuid, verdict in held.items()}
    )
    return with_held_verdicts(facts, None)


def with_held_verdicts(
    gpu_facts: Mapping[str, Any],
    holds: HealthHolds | None,
    *,
    now: Callable[[], datetime] = lambda: datetime.now(UTC),
) -> dict[str, Any]:
    """``gpu_facts`` as judged for placement: a GPU without a ``health`` key gets ``None`` (asked for, not read:
    ``unknown``), and a GPU the host holds unhealthy (``holds``) is judged again with the held verdict as its
    previous one, so a fresh process sees what an earlier read found until NVML shows a reset or an operator
    clears it. Raises ``PlacementFactsError`` for a hold file that cannot be read."""
    from ansible_collections.meridian.node.plugins.module_utils.gpu.health_hold import HealthHoldError
    from ansible_collections.meridian.node.plugins.module_utils.gpu.health_rules import judge

    facts = dict(gpu_facts)
    gpus = []
    for gpu in gpu_facts.get("gpus") or []:
        gpu = dict(gpu)
        health = gpu.setdefault("health", None)
        try:
            held = holds.held(str(gpu["uuid"])) if holds is not None and gpu.get("uuid") else None
        except HealthHoldError as exc:
            raise PlacementFactsError(str(exc)) from exc
        if held is not None:
            readings = health.get("readings") if isinstance(health, Mapping) else None
            gpu["health"] = judge(readings, gpu=gpu, previous=held, now=now())
        gpus.append(gpu)
    facts["gpus"] = gpus
    return facts


@dataclass(frozen=True)
class DeviceHealth:
    """A device's verdict as placement reads it: for a MIG instance, its parent's with its own XIDs."""

    verdict: str
    reasons: tuple[Mapping[str, Any], ...] = ()
    held: bool = False
    since: str | None = None

    def describe(self) -> str:
        """``unhealthy, held since ...: xid-critical 79 (nvmlEventSetWait); ...`` for a message."""
        shown = [
            " ".join(str(part) for part in (r.get("code"), r.get("value")) if part is not None)
            + (f" ({r.get('source')})" if r.get("source") else "")
            for r in self.reasons[:_SHOWN_REASONS]
        ]
        if len(self.reasons) > _SHOWN_REASONS:
            shown.append(f"and {len(self.reasons) - _SHOWN_REASONS} more")
        held = f", held since {self.since}" if self.held and self.since else ""
        return f"{self.verdict}{held}: {'; '.join(shown) or 'health was not read'}"


@dataclass(frozen=True)
class Device:
    """A GPU or MIG instance a spec can ask for; ``key`` is its uuid, whatever id the spec used.

    ``health`` is None where the facts were never judged (no ``health`` key); ``parent`` is a MIG instance's
    GPU uuid."""

    key: str
    requested_as: str
    total_mib: int
    free_mib: int
    mig_mode: bool = False
    mig_uuids: tuple[str, ...] = ()
    health: DeviceHealth | None = None
    cordoned: bool = False
    parent: str | None = None

    def describe(self) -> str:
        if self.parent is not None:
            return f"MIG instance {self.requested_as!r} (on GPU {self.parent})"
        return f"GPU {self.requested_as!r} ({self.key})"


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
                health=_device_health(gpu),
                cordoned=gpu.get("cordoned") is True,
            )
        for instance in gpu.get("mig_instances") or []:
            if instance.get("uuid") == wanted and instance.get("memory_mib") is not None:
                # NVML's per-process memory is not split by MIG instance here: the instance's size is the room.
                size = int(instance["memory_mib"])
                return Device(
                    key=wanted,
                    requested_as=wanted,
                    total_mib=size,
                    free_mib=size,
                    health=_device_health(gpu, mig_uuid=wanted),
                    cordoned=gpu.get("cordoned") is True or instance.get("cordoned") is True,
                    parent=str(gpu.get("uuid")),
                )
    return None


def _device_health(gpu: Mapping[str, Any], mig_uuid: str | None = None) -> DeviceHealth | None:
    """The verdict placement reads for ``gpu`` (or its MIG device ``mig_uuid``); None where it was never judged."""
    if "health" not in gpu:
        return None
    from ansible_collections.meridian.node.plugins.module_utils.gpu.health_rules import (
        MIG_CODES,
        SEVERITY,
        mig_uuid_of,
        worst,
    )

    health = gpu["health"]
    if not isinstance(health, Mapping):
        return DeviceHealth("unknown")
    verdict = str(health.get("verdict"))
    reasons = [r for r in health.get("reasons") or [] if isinstance(r, Mapping)]
    held, since = health.get("held") is True, health.get("since")
    scoped = [r for r in reasons if r.get("code") in MIG_CODES]
    if not scoped:
        return DeviceHealth(worst([verdict]), tuple(reasons), held, since)
    # An XID on one MIG device is that device's: the GPU's other reasons apply to all its devices.
    general = [r for r in reasons if r.get("code") not in MIG_CODES]
    mine = [r for r in scoped if mig_uuid is not None and mig_uuid_of(r) == mig_uuid]
    verdicts = [SEVERITY.get(str(r.get("code")), verdict) for r in general]
    verdicts += [MIG_CODES[str(r.get("code"))] for r in mine]
    if not general and verdict in _REFUSED:
        verdicts.append(verdict)  # a verdict without its reasons (unknown, not read) still stands
    return DeviceHealth(worst(verdicts), tuple(general + mine), held, since)


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
    force: bool = False,
) -> tuple[str, str] | None:
    """None when the GPUs exist, may take the engine and have room, else ``(check, message with the numbers)``.
    Pure.

    ``others`` reserve room whatever their state. ``replaced`` and ``freed`` are containers removed before
    this engine starts: what NVML counts them as using is credited to the free VRAM. ``arriving`` are other
    engines created in the same run (``engines.set``): NVML does not count them yet, so they are taken off it.
    ``force`` (the spec's) places on unhealthy and unknown GPUs; never on cordoned ones.
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
    for device in devices:
        if device.cordoned:
            return "placement-cordoned", (
                f"engine {name!r} asks for {device.describe()}, which is cordoned: no new engines go there. "
                "Lift the cordon (meridian.node.cordon state: absent, or the policy's or desired state's cordon) "
                "or pick another GPU; force does not override a cordon"
            )
    for device in devices:
        if device.health is not None and device.health.verdict in _REFUSED and not force:
            return "placement-health", (
                f"engine {name!r} asks for {device.describe()}, whose health is {device.health.describe()}. "
                "Placement refuses unhealthy and unknown GPUs: pick another GPU, or repair this one (a held "
                "verdict lasts until NVML shows a reset or an operator clears it; docs/GPU_HEALTH.md), or set "
                "force: true on the engine to place it there anyway"
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


def placement_warnings(
    *, name: str, gpus: Sequence[str], gpu_facts: Mapping[str, Any] | None, force: bool = False
) -> list[str]:
    """What a placement that passed must say: a degraded device, and one only ``force`` let through. Pure."""
    if not gpus or gpu_facts is None or not gpu_facts.get("nvml_available"):
        return []
    devices, _missing = resolve_devices(gpus, gpu_facts)
    warnings = []
    for device in devices:
        health = device.health
        if health is None or health.verdict == "healthy":
            continue
        if health.verdict in _REFUSED:
            if force:
                warnings.append(
                    f"engine {name!r} goes on {device.describe()} only because it says force: true; its health is "
                    f"{health.describe()}"
                )
        else:
            warnings.append(f"engine {name!r} goes on {device.describe()}, whose health is {health.describe()}")
    return warnings


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
