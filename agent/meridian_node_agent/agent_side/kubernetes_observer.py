"""What runs on a Kubernetes node, in mode kubernetes-integrated: the kubelet's PodResources API joined to NVML.

Runs on: the agent side (``meridian-node run``, unprivileged); it only reads, through ``podresources.client``.

Each device the kubelet lists is joined to the GPU facts by uuid: a ``GPU-...`` id is a whole GPU, a
``MIG-...`` id a MIG instance, and a ``::N`` suffix (a time-slicing or MPS replica, as NVIDIA's device plugin
names them) is stripped first. A joined device carries its GPU's index and health verdict (a MIG instance
its parent GPU's). Anything else (another vendor's resource, or an NVIDIA id NVML does not know) is listed as
the kubelet gave it, with ``uuid`` None, except that an id under an ``nvidia.com/`` resource that looks like an
NVIDIA uuid keeps it.

Which containers are reported: those holding at least one device, and those that look like an inference
engine (``engine_driver``: ``ENGINE_WORDS`` in the container's name, or in the pod's for a container holding
devices). The rest of the node's pods are not this agent's business
and would only make every observation longer. Known engines are also reported in the observation's
``engines`` as unmanaged (never ready, no port: nothing is routed to what Kubernetes runs).

Everything is sorted: the kubelet lists pods from a map, in an order that changes between calls, and an
observation that reads the same must compare equal (the agent re-sends only what changed).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from ansible_collections.meridian.node.plugins.module_utils.contracts import (
    GpuFacts,
    HealthVerdict,
    KubernetesObservation,
    PodAllocation,
    PodDevice,
)
from ansible_collections.meridian.node.plugins.module_utils.engine_rules import DRIVERS
from meridian_node_agent.agent_side.podresources.reading import (
    KubeletContainer,
    KubeletDevices,
    KubeletReading,
    PodResourcesError,
)
from meridian_node_agent.logs import EventLogger

__all__ = [
    "ENGINE_STATE",
    "ENGINE_WORDS",
    "KubernetesObserver",
    "KubernetesView",
    "PodResourcesPort",
    "engine_driver",
    "join_device",
]

# How an engine shows in a pod's or container's name, as words (the name split at anything but letters and
# digits): each driver's own name, and the names its images and charts commonly use. "openai" (any
# OpenAI-compatible server) is not a word that says which engine runs, so it is left out.
ENGINE_WORDS: tuple[tuple[tuple[str, ...], str], ...] = (
    *(((driver,), driver) for driver in DRIVERS if driver != "openai"),
    (("text", "generation", "inference"), "tgi"),
    (("llama", "cpp"), "llamacpp"),
    (("llama", "server"), "llamacpp"),
)
# The kubelet lists the containers of the pods it admitted and has not terminated; it does not say whether
# the container's process runs, so an engine found there is "active", not "running".
ENGINE_STATE = "active"
_WORD = re.compile(r"[a-z0-9]+")
_REPLICA = re.compile(r"::[0-9]+$")
# The contract's bound on each name and id (PodDevice, PodAllocation); the kubelet's own names fit it.
_MAX_TEXT = 253


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
        self._skipped = 0

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
            self._log.info("kubernetes-pod-resources-available", socket=socket, containers=len(reading.containers))
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
        skipped = 0
        allocations: list[PodAllocation] = []
        engines: list[dict[str, Any]] = []
        for container in sorted(reading.containers, key=lambda c: (c.namespace, c.pod, c.container)):
            if not _fits(container.namespace, container.pod, container.container):
                skipped += 1
                continue
            devices, left_out = self._devices(container.devices, known)
            skipped += left_out
            driver = engine_driver(container.pod, container.container, holds_devices=bool(devices))
            if not devices and driver is None:
                continue
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
            allocatable, left_out = self._devices(reading.allocatable, known)
            skipped += left_out
        if skipped != self._skipped and skipped:
            self._log.warning(
                "kubernetes-entries-left-out",
                count=skipped,
                reason=f"a name or device id longer than {_MAX_TEXT} characters, which the observation cannot carry",
            )
        self._skipped = skipped
        observation = KubernetesObservation(
            socket=socket, available=True, allocations=allocations, allocatable=allocatable
        )
        return KubernetesView(observation, engines)

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


def _fits(*texts: str) -> bool:
    return all(len(text) <= _MAX_TEXT for text in texts)


def _unmanaged_engine(container: KubeletContainer, driver: str) -> dict[str, Any]:
    return {
        "name": f"k8s/{container.namespace}/{container.pod}/{container.container}",
        "managed": False,
        "driver": driver,
        "image": None,
        "state": ENGINE_STATE,
        "ready": False,
        "draining": False,
        "port": None,
    }
