"""What one read of the kubelet's PodResources API gives, and why a read failed.

Runs on: the agent side. Plain data without gRPC, so that what reads it (``agent_side.kubernetes_observer``) imports
in every mode; only ``podresources.client`` needs the ``kubernetes`` extra.
"""

from __future__ import annotations

from dataclasses import dataclass

from ansible_collections.meridian.node.plugins.module_utils._errors import MeridianError

__all__ = [
    "KubeletContainer",
    "KubeletDevices",
    "KubeletReading",
    "PodResourcesError",
]


class PodResourcesError(MeridianError):
    """The kubelet's PodResources API could not be read; ``reason`` is a stable code, the message says what to do.

    Codes: ``no-socket``, ``not-a-socket``, ``permission-denied``, ``unavailable``, ``timeout``,
    ``unimplemented`` (no v1 ``List``), ``error`` (any other gRPC status).
    """

    def __init__(self, message: str, *, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


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
class KubeletReading:
    """One read: every container of the pods the kubelet lists, and what it can allocate (None: not served)."""

    containers: tuple[KubeletContainer, ...]
    allocatable: tuple[KubeletDevices, ...] | None
