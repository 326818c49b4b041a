"""What one read of the kubelet's PodResources API gives, and why a read failed.

Runs on: the agent side. Plain data without gRPC, so that what reads it (``agent_side.kubernetes_observer``) imports
in every mode; only ``podresources.client`` needs the ``kubernetes`` extra.

A read is bounded by what the agent reports (docs/KUBERNETES.md, "What is listed, what is counted"): the containers
that hold a GPU device (``is_gpu_device``), with those devices only, at most ``MAX_GPU_CONTAINERS`` of them and
``MAX_GPU_DEVICES`` device ids in all; what is allocatable, GPU devices only, at most ``MAX_GPU_DEVICES``. Everything
else the kubelet lists is counted, never kept: a node where tenants run thousands of containers costs the agent a
count, not a copy of each.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from ansible_collections.meridian.node.plugins.module_utils._errors import MeridianError

__all__ = [
    "MAX_GPU_CONTAINERS",
    "MAX_GPU_DEVICES",
    "KubeletContainer",
    "KubeletDevices",
    "KubeletReading",
    "LeftOut",
    "LeftOutReason",
    "PodResourcesError",
    "is_gpu_device",
]

# The containers holding a GPU that one read keeps (the first by namespace, pod and container name): a node's GPUs
# shared by time-slicing (NVIDIA's device plugin, ``replicas``) or cut into MIG instances, 8 GPUs x 32 replicas.
MAX_GPU_CONTAINERS = 256
# The GPU device ids one read keeps in the containers it keeps, and again in what is allocatable (where every
# time-slicing replica is an id of its own): 8 GPUs x 128 replicas.
MAX_GPU_DEVICES = 1024

_REPLICA = re.compile(r"::[0-9]+$")

# Why something the kubelet listed is not in the observation (contracts.KubernetesLeftOut):
# not-a-gpu      a container holding no GPU device, or a device that is not a GPU (counted by design);
# over-bound     beyond MAX_GPU_CONTAINERS or MAX_GPU_DEVICES;
# name-too-long  a name or device id longer than the contract carries (253 characters);
# too-large      dropped so that the observation fits the control plane's limit on a request.
LeftOutReason = Literal["not-a-gpu", "over-bound", "name-too-long", "too-large"]


class PodResourcesError(MeridianError):
    """The kubelet's PodResources API could not be read; ``reason`` is a stable code, the message says what to do.

    Codes: ``no-socket``, ``not-a-socket``, ``permission-denied``, ``unavailable``, ``timeout``,
    ``unimplemented`` (no v1 ``List``), ``too-large`` (an answer over the agent's cap), ``error`` (any other gRPC
    status).
    """

    def __init__(self, message: str, *, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


def is_gpu_device(resource: str, device_id: str) -> bool:
    """A device the agent reports: under an ``nvidia.com/`` resource, or named by an NVIDIA uuid (``GPU-...``,
    ``MIG-...``, a ``::N`` replica suffix allowed), which is the only kind of id that can join NVML."""
    return resource.startswith("nvidia.com/") or _REPLICA.sub("", device_id).startswith(("GPU-", "MIG-"))


@dataclass(frozen=True)
class KubeletDevices:
    """The devices of one resource, by the ids its device plugin chose (``GPU-...::3`` for a replica)."""

    resource: str
    device_ids: tuple[str, ...]


@dataclass(frozen=True)
class KubeletContainer:
    namespace: str
    pod: str
    container: str
    devices: tuple[KubeletDevices, ...]


@dataclass(frozen=True)
class LeftOut:
    """What one read did not keep, for one reason: containers, and device ids (those of the containers included)."""

    reason: LeftOutReason
    containers: int = 0
    devices: int = 0


@dataclass(frozen=True)
class KubeletReading:
    """One read, bounded: the containers holding a GPU device and those devices (sorted), what is allocatable
    (GPU devices only; None: not served), how many pods and containers the kubelet listed, and what was left out."""

    containers: tuple[KubeletContainer, ...]
    allocatable: tuple[KubeletDevices, ...] | None
    pods: int
    listed: int
    left_out: tuple[LeftOut, ...] = ()
