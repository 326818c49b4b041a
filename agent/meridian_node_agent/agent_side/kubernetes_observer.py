"""What runs on a Kubernetes node, in mode kubernetes-integrated: the kubelet's PodResources API joined to NVML.

Runs on: the agent side (``meridian-node run``, unprivileged); it only reads, through ``podresources.client``.

Each device the kubelet lists is joined to the GPU facts by uuid: a ``GPU-...`` id is a whole GPU, a
``MIG-...`` id a MIG instance, and a ``::N`` suffix (a time-slicing or MPS replica, as NVIDIA's device plugin
names them) is stripped first. A joined device carries its GPU's index and health verdict (a MIG instance its
parent GPU's). An id under an ``nvidia.com/`` resource that NVML does not know is listed as the kubelet gave it,
keeping its uuid when it looks like one.

What is reported is bounded by what the control plane acts on (docs/KUBERNETES.md, "What is listed, what is
counted"): the containers holding a GPU device (``reading.is_gpu_device``: under an ``nvidia.com/`` resource, or
named by an NVIDIA uuid), with their GPU devices, at most ``MAX_GPU_CONTAINERS`` of them, and the GPU devices
allocatable. The rest of the node's pods is counted by reason in ``left_out``, never listed: a tenant's
container named like an engine but holding no GPU is ``not-a-gpu``, however many there are. A GPU holder that
looks like an inference engine (``engine_driver``: ``ENGINE_WORDS`` in the container's name, or in its pod's) is
also reported in the observation's ``engines`` as unmanaged (never ready, no port: nothing is routed to what
Kubernetes runs).

Should the observation still be over the control plane's limit, ``lighter`` gives ever lighter copies of it
(allocatable first, then the allocations halved with their engines), each saying what went (``too-large``):
the agent's size guard (``observe.ObservationSizeGuard``) sends the first that fits.

Everything is sorted: the kubelet lists pods from a map, in an order that changes between calls, and an
observation that reads the same must compare equal (the agent re-sends only what changed).
"""

from __future__ import annotations

import re
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from ansible_collections.meridian.node.plugins.module_utils.contracts import (
    GpuFacts,
    HealthVerdict,
    KubernetesLeftOut,
    KubernetesObservation,
    Observation,
    PodAllocation,
    PodDevice,
)
from ansible_collections.meridian.node.plugins.module_utils.engines.drivers import DRIVERS
from meridian_node_agent.agent_side.podresources.reading import (
    MAX_GPU_CONTAINERS,
    MAX_GPU_DEVICES,
    KubeletContainer,
    KubeletDevices,
    KubeletReading,
    LeftOut,
    LeftOutReason,
    PodResourcesError,
)
from meridian_node_agent.logs import EventLogger

__all__ = [
    "ENGINE_STATE",
    "ENGINE_WORDS",
    "MAX_GPU_CONTAINERS",
    "MAX_GPU_DEVICES",
    "KubernetesObserver",
    "KubernetesView",
    "PodResourcesPort",
    "engine_driver",
    "join_device",
    "lighter",
]

# How an engine shows in a pod's or container's name, as words (the name split at anything but letters and
# digits), driver by driver: each driver's recognition hints (``Driver.recognized_by``: its own name, and the
# names its images and charts commonly use; none for the generic "openai", whose name says no engine).
ENGINE_WORDS: tuple[tuple[tuple[str, ...], str], ...] = tuple(
    (words, name) for name, driver in DRIVERS.items() for words in driver.recognized_by()
)
# The kubelet lists the containers of the pods it admitted and has not terminated; it does not say whether
# the container's process runs, so an engine found there is "active", not "running".
ENGINE_STATE = "active"
_WORD = re.compile(r"[a-z0-9]+")
_REPLICA = re.compile(r"::[0-9]+$")
# The contract's bound on each name and id (PodDevice, PodAllocation); the kubelet's own names fit it.
_MAX_TEXT = 253
# Left out by a bound, not by design: said in the log as well as in the observation.
_WARNED: tuple[LeftOutReason, ...] = ("over-bound", "name-too-long")


class PodResourcesPort(Protocol):
    socket_path: str

    def read(self) -> KubeletReading: ...


@dataclass(frozen=True)
class KubernetesView:
    """One look: the observation's ``kubernetes`` part, and the engines found, as ``EngineObservation`` dicts."""

    observation: KubernetesObservation
    engines: list[dict[str, Any]] = field(default_factory=list)


@dataclass(frozen=True)
class _Known:
    uuid: str
    gpu_index: int
    health: HealthVerdict | None


def engine_driver(pod: str, container: str, *, holds_devices: bool) -> str | None:
    """The driver whose words appear in the container's name, else (for a container holding devices) in the pod's.

    The container's name goes first: a pod ``chat-7f9c`` whose container is ``vllm`` runs vLLM, whatever the
    pod is called. The pod's name speaks only for a container that holds devices: in pod ``mistral-tgi-0`` the
    container ``server`` with the GPU is the engine, its ``metrics`` sidecar is not. Within one name, the words
    that come first win.
    """
    for name in (container, pod) if holds_devices else (container,):
        words = _WORD.findall(name.lower())
        for start in range(len(words)):
            for pattern, driver in ENGINE_WORDS:
                if tuple(words[start : start + len(pattern)]) == pattern:
                    return driver
    return None


def join_device(resource: str, device_id: str, known: Mapping[str, _Known]) -> PodDevice:
    """One device the kubelet lists, joined to NVML by uuid (its ``::N`` replica suffix stripped)."""
    uuid = _REPLICA.sub("", device_id)
    hit = known.get(uuid)
    if hit is not None:
        return PodDevice(
            resource=resource, device_id=device_id, uuid=hit.uuid, gpu_index=hit.gpu_index, health=hit.health
        )
    nvidia = resource.startswith("nvidia.com/") and uuid.startswith(("GPU-", "MIG-"))
    return PodDevice(resource=resource, device_id=device_id, uuid=uuid if nvidia else None)


def _known_devices(gpu: GpuFacts) -> dict[str, _Known]:
    known: dict[str, _Known] = {}
    for card in gpu.gpus:
        verdict = card.health.verdict if card.health is not None else None
        if card.uuid:
            known[card.uuid] = _Known(card.uuid, card.index, verdict)
        for instance in card.mig_instances:
            known[instance.uuid] = _Known(instance.uuid, card.index, verdict)
    return known


class KubernetesObserver:
    """The ``kubernetes`` source of the agent's ``Observer``: called with the GPU facts, gives a ``KubernetesView``.

    The kubelet is read at most every ``refresh_s`` (or after ``forget``); the join with the GPU facts is done on
    every call, so a GPU whose verdict changed shows in the next observation. A read that fails gives
    ``available: false`` with the reason, logged once per change of reason, and is retried on the next call,
    whatever ``refresh_s`` says: the kubelet coming back should show at once.
    """

    def __init__(
        self,
        client: PodResourcesPort,
        *,
        refresh_s: float = 10.0,
        monotonic: Callable[[], float] = time.monotonic,
        log: EventLogger | None = None,
    ) -> None:
        self.client = client
        self.refresh_s = refresh_s
        self._monotonic = monotonic
        self._log = log or EventLogger()
        self._cache: tuple[float, KubeletReading] | None = None
        self._failure: str | None = None  # the reason last logged, until a read works again
        self._warned: dict[LeftOutReason, LeftOut] = {}  # what a bound left out, as last logged

    def __call__(self, gpu: GpuFacts) -> KubernetesView:
        socket = self.client.socket_path
        try:
            reading = self._read()
        except PodResourcesError as exc:
            if self._failure != exc.reason:
                self._log.warning("kubernetes-pod-resources-unavailable", reason=exc.reason, detail=str(exc))
            self._failure = exc.reason
            return KubernetesView(KubernetesObservation(socket=socket, available=False, reason=str(exc)))
        if self._failure is not None:
            self._log.info("kubernetes-pod-resources-available", socket=socket, containers=reading.listed)
            self._failure = None
        return self._join(socket, reading, _known_devices(gpu))

    def forget(self) -> None:
        """Drop the cached read: the next call asks the kubelet."""
        self._cache = None

    def _read(self) -> KubeletReading:
        now = self._monotonic()
        if self._cache is not None and now - self._cache[0] < self.refresh_s:
            return self._cache[1]
        self._cache = None
        reading = self.client.read()
        self._cache = (now, reading)
        return reading

    def _join(self, socket: str, reading: KubeletReading, known: Mapping[str, _Known]) -> KubernetesView:
        too_long: Counter[str] = Counter()
        allocations: list[PodAllocation] = []
        engines: list[dict[str, Any]] = []
        for container in sorted(reading.containers, key=lambda c: (c.namespace, c.pod, c.container)):
            held = sum(len(group.device_ids) for group in container.devices)
            if not _fits(container.namespace, container.pod, container.container):
                too_long.update(containers=1, devices=held)
                continue
            devices, left = self._devices(container.devices, known)
            too_long.update(devices=left)
            if not devices:
                too_long.update(containers=1)
                continue
            driver = engine_driver(container.pod, container.container, holds_devices=True)
            allocations.append(
                PodAllocation.model_validate(
                    {
                        "namespace": container.namespace,
                        "pod": container.pod,
                        "container": container.container,
                        "devices": devices,
                        "engine_driver": driver,  # one of DRIVERS, which the contract's Driver names
                    }
                )
            )
            if driver is not None:
                engines.append(_unmanaged_engine(container, driver))
        allocatable = None
        if reading.allocatable is not None:
            allocatable, left = self._devices(reading.allocatable, known)
            too_long.update(devices=left)
        left_out = [*reading.left_out, LeftOut("name-too-long", too_long["containers"], too_long["devices"])]
        counted = [entry for entry in left_out if entry.containers or entry.devices]
        self._say_left_out(counted)
        observation = KubernetesObservation(
            socket=socket,
            available=True,
            allocations=allocations,
            allocatable=allocatable,
            pods=reading.pods,
            containers=reading.listed,
            left_out=[KubernetesLeftOut(reason=e.reason, containers=e.containers, devices=e.devices) for e in counted],
        )
        return KubernetesView(observation, engines)

    def _say_left_out(self, left_out: Iterable[LeftOut]) -> None:
        """Log what a bound left out (not what is left out by design: ``not-a-gpu``), once per change."""
        warned = {entry.reason: entry for entry in left_out if entry.reason in _WARNED}
        for reason, entry in warned.items():
            if self._warned.get(reason) != entry:
                self._log.warning(
                    "kubernetes-entries-left-out",
                    reason=reason,
                    containers=entry.containers,
                    devices=entry.devices,
                    detail=_LEFT_OUT_DETAIL[reason],
                )
        self._warned = warned

    @staticmethod
    def _devices(groups: Iterable[KubeletDevices], known: Mapping[str, _Known]) -> tuple[list[PodDevice], int]:
        devices, skipped = [], 0
        for group in groups:
            for device_id in group.device_ids:
                if _fits(group.resource, device_id):
                    devices.append(join_device(group.resource, device_id, known))
                else:
                    skipped += 1
        devices.sort(key=lambda device: (device.resource, device.device_id))
        return devices, skipped


_LEFT_OUT_DETAIL = {
    "over-bound": f"the agent lists at most {MAX_GPU_CONTAINERS} containers holding a GPU and {MAX_GPU_DEVICES} "
    "GPU device ids (the first by namespace, pod and container name); the rest is counted",
    "name-too-long": f"a name or device id longer than {_MAX_TEXT} characters, which the observation cannot carry",
}


def lighter(observation: Observation) -> Iterator[tuple[Observation, str]]:
    """Ever lighter copies of ``observation``, each with less of its ``kubernetes`` detail, and what went, in words:
    what is allocatable first, then the allocations halved down to none, each with its engine. What went is counted
    in ``left_out`` as ``too-large``. Nothing when there is no detail to drop."""
    k8s = observation.kubernetes
    if k8s is None or not k8s.available:
        return
    listed, engines = k8s.allocations, observation.engines
    allocatable_dropped = 0
    if k8s.allocatable:
        allocatable_dropped = len(k8s.allocatable)
        k8s = _too_large(k8s, allocations=listed, allocatable=[], containers=0, devices=allocatable_dropped)
        yield (
            observation.model_copy(update={"kubernetes": k8s}),
            f"kubernetes.allocatable ({allocatable_dropped} devices)",
        )
    keep = len(listed)
    while keep:
        keep //= 2
        dropped = listed[keep:]
        devices = sum(len(allocation.devices) for allocation in dropped)
        gone = {_engine_name(a.namespace, a.pod, a.container) for a in dropped if a.engine_driver is not None}
        lighter_k8s = _too_large(
            k8s, allocations=listed[:keep], containers=len(dropped), devices=devices + allocatable_dropped
        )
        update = {"kubernetes": lighter_k8s, "engines": [e for e in engines if e.managed or e.name not in gone]}
        yield (
            observation.model_copy(update=update),
            f"kubernetes.allocations after the first {keep} ({len(dropped)} containers, {devices} devices) "
            f"and {len(gone)} engines of theirs",
        )


def _too_large(
    k8s: KubernetesObservation,
    *,
    allocations: list[PodAllocation],
    allocatable: list[PodDevice] | None = None,
    containers: int,
    devices: int,
) -> KubernetesObservation:
    entry = KubernetesLeftOut(reason="too-large", containers=containers, devices=devices)
    left_out = [other for other in k8s.left_out if other.reason != "too-large"] + [entry]
    update: dict[str, Any] = {"allocations": allocations, "left_out": left_out}
    if allocatable is not None:
        update["allocatable"] = allocatable
    return k8s.model_copy(update=update)


def _fits(*texts: str) -> bool:
    return all(len(text) <= _MAX_TEXT for text in texts)


def _engine_name(namespace: str, pod: str, container: str) -> str:
    return f"k8s/{namespace}/{pod}/{container}"


def _unmanaged_engine(container: KubeletContainer, driver: str) -> dict[str, Any]:
    return {
        "name": _engine_name(container.namespace, container.pod, container.container),
        "managed": False,
        "driver": driver,
        "image": None,
        "state": ENGINE_STATE,
        "ready": False,
        "draining": False,
        "port": None,
    }
