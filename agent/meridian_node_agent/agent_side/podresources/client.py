"""A client of the kubelet's PodResources API (v1 ``List`` and ``GetAllocatableResources``) on its unix socket.

Runs on: the agent side (``meridian-node run`` in mode kubernetes-integrated, unprivileged).

It only asks: the two calls it makes take empty requests and change nothing in the kubelet. Each read checks
the socket first (missing, not a socket, not writable by this user: a connect to a unix socket needs write
permission), so that what a person sees names the path and what to do, rather than gRPC's "failed to connect
to all addresses". Every call has a deadline (``timeout_s``).

One channel is kept between reads (a connect costs more than a call), and dropped on any failure: a channel
whose connect failed waits out gRPC's reconnect backoff (a second, growing to two minutes) before it tries
again, while a kubelet that restarts re-creates its socket at the same path within seconds. A read on a channel
that worked before gets one more try, on a fresh channel, when the kubelet is unavailable (it went away between
two reads, and the kept connection with it); a read that still fails leaves no channel behind, and the next
one connects afresh.

What a read keeps is bounded (``reading``: the containers holding a GPU device, with those devices, up to
``MAX_GPU_CONTAINERS`` and ``MAX_GPU_DEVICES``; the rest counted), and so is what it receives: an answer over
``MAX_MESSAGE_BYTES`` is refused by gRPC before it is parsed, and read as ``PodResourcesError`` ``too-large``.
``List``'s answer is taken as one byte string per pod (``_PodsAsBytes``: the answer's one field, declared
``bytes``, which the wire cannot tell from an embedded message) and each pod parsed on its own by protobuf, so
that the whole answer is never a tree of parsed messages at once (about three times its bytes more, for a node of
small pods). A container without devices costs a length read, no Python object is kept for it, and only the
GPU holders that will be reported are built (the first ones by namespace, pod and container name: a heap of
``MAX_GPU_CONTAINERS``). A read peaks at about three times the answer's bytes over the agent's resident set, most
of it gRPC's own receive buffers (docs/KUBERNETES.md, "What a read costs").

``GetAllocatableResources`` is missing from kubelets older than 1.21 (UNIMPLEMENTED) and switched off by
default in 1.21 and 1.22 (an error saying "GetAllocatableResources disabled"): both give ``allocatable`` None,
not an error, and the call is not asked again of the same kubelet until a read fails (a restart may bring a
newer one).
"""

from __future__ import annotations

import heapq
import os
import stat
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

# gRPC's core writes INFO lines of its own to stderr (one per GOAWAY when the kubelet restarts), between the
# agent's JSON log lines; its errors still show. Read once, when gRPC starts: an operator's own setting wins.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
# gRPC 1.81 and later (grpc/grpc#43055, open): once a channel has run, a child this process forks - ansible-runner's
# ansible-playbook, any subprocess - restarts gRPC's poller after the fork, finds its epoll descriptor closed before
# exec and dies there ("epoll_wait error: Bad file descriptor"); the run fails with no task failed. The agent never
# needs gRPC in a forked child, so its fork support stays off, as grpc's issue advises.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import DecodeError

from meridian_node_agent.agent_side.podresources import api_pb2, api_pb2_grpc
from meridian_node_agent.agent_side.podresources.reading import (
    MAX_GPU_CONTAINERS,
    MAX_GPU_DEVICES,
    KubeletContainer,
    KubeletDevices,
    KubeletReading,
    LeftOut,
    PodResourcesError,
    is_gpu_device,
)
from meridian_node_agent.config import DEFAULT_POD_RESOURCES_SOCKET

__all__ = ["MAX_MESSAGE_BYTES", "PodResourcesClient"]

# The largest answer the agent receives (``List`` or ``GetAllocatableResources``), a sixteenth of what the kubelet
# may send (podresources.DefaultMaxMsgSize, 16 MiB). A read peaks at about three times the answer's bytes over the
# agent's resident set (gRPC's receive buffers, the bytes handed to protobuf, the answer held as one byte string
# per pod): 3.4 MiB measured for an answer just under 1 MiB (tests/agent/agent_side/test_podresources_memory.py,
# bench/podresources.py), over an agent that idles at about 72 MiB in this mode (gRPC and protobuf are 14 of
# them): 75.6 MiB at the peak, 4.4 MiB under its 80 MiB guard (bench/agent.py); 2 MiB would leave none. A
# kubelet's answer is 30 to 100 bytes a container without devices: 1 MiB is 10,000 containers or more, where
# Kubernetes runs 110 pods a node by default.
MAX_MESSAGE_BYTES = 1024 * 1024
_ACCESS_HINT = (
    "the agent's user needs search (x) permission on every directory above it and write permission on the "
    "socket (docs/KUBERNETES.md, 'Access to the socket')"
)


def _pods_as_bytes() -> Any:
    """A message read from ``ListPodResourcesResponse``'s bytes: its field 1 (``pod_resources``) as ``bytes``, in a
    pool of its own (nothing is added to protobuf's process-wide one)."""
    proto = descriptor_pb2.FileDescriptorProto(
        name="meridian_node_agent/agent_side/podresources/pods_as_bytes.proto", package="meridian.podresources"
    )
    proto.syntax = "proto3"
    message = proto.message_type.add(name="PodsAsBytes")
    message.field.add(
        name="pod_resources",
        number=api_pb2.ListPodResourcesResponse.DESCRIPTOR.fields_by_name["pod_resources"].number,
        type=descriptor_pb2.FieldDescriptorProto.TYPE_BYTES,
        label=descriptor_pb2.FieldDescriptorProto.LABEL_REPEATED,
    )
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("meridian.podresources.PodsAsBytes"))


_PodsAsBytes = _pods_as_bytes()
_LIST = "/v1.PodResourcesLister/List"


class PodResourcesClient:
    def __init__(self, socket_path: str = DEFAULT_POD_RESOURCES_SOCKET, *, timeout_s: float = 2.0) -> None:
        self.socket_path = socket_path
        self.timeout_s = timeout_s
        self._channel: grpc.Channel | None = None
        self._stub: api_pb2_grpc.PodResourcesListerStub | None = None
        self._list: grpc.UnaryUnaryMultiCallable[api_pb2.ListPodResourcesRequest, Any] | None = None
        self._answered = False  # the kept channel has answered a call: worth one retry on a fresh one
        self._allocatable_served = True  # False once this kubelet said it does not serve GetAllocatableResources

    def read(self) -> KubeletReading:
        """List the pods' devices, then what is allocatable; raises ``PodResourcesError`` naming the cause."""
        self._check_socket()
        listed = self._call_list()
        allocatable = self._call_allocatable() if self._allocatable_served else None
        try:
            return bounded_reading(listed.pod_resources, allocatable)
        except DecodeError as exc:
            raise PodResourcesError(
                f"the kubelet's List answer on {self.socket_path} holds a pod that is not a v1.PodResources ({exc})",
                reason="error",
            ) from None

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
        self._channel = self._stub = self._list = None
        self._answered = False

    def __enter__(self) -> PodResourcesClient:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    # Steps

    def _check_socket(self) -> None:
        path = self.socket_path
        try:
            info = Path(path).stat()
        except (FileNotFoundError, NotADirectoryError):
            self.close()
            raise PodResourcesError(
                f"the kubelet's PodResources socket {path} does not exist: is the kubelet running on this node? "
                "If its root directory is not /var/lib/kubelet, set kubernetes.pod_resources_socket in the "
                "agent's config",
                reason="no-socket",
            ) from None
        except PermissionError as exc:
            self.close()
            raise PodResourcesError(
                f"the kubelet's PodResources socket {path} cannot be reached ({exc.strerror}): {_ACCESS_HINT}",
                reason="permission-denied",
            ) from None
        if not stat.S_ISSOCK(info.st_mode):
            self.close()
            raise PodResourcesError(
                f"{path} is not a unix socket: kubernetes.pod_resources_socket must name the kubelet's "
                f"PodResources socket (default {DEFAULT_POD_RESOURCES_SOCKET})",
                reason="not-a-socket",
            )
        if not os.access(path, os.W_OK):
            self.close()
            raise PodResourcesError(
                f"the kubelet's PodResources socket {path} is not writable by this user (uid {os.getuid()}): "
                f"{_ACCESS_HINT}",
                reason="permission-denied",
            )

    def _connect(self) -> api_pb2_grpc.PodResourcesListerStub:
        if self._stub is None:
            self._channel = grpc.insecure_channel(
                f"unix:{Path(self.socket_path).absolute()}",
                options=[
                    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                    # The one retry is ours (a fresh channel), and only where it can help.
                    ("grpc.enable_retries", 0),
                ],
            )
            self._stub = api_pb2_grpc.PodResourcesListerStub(self._channel)
            self._list = self._channel.unary_unary(
                _LIST,
                request_serializer=api_pb2.ListPodResourcesRequest.SerializeToString,
                response_deserializer=_PodsAsBytes.FromString,
            )
            self._answered = False
            self._allocatable_served = True
        return self._stub

    def _call_list(self) -> Any:
        for retry in (False, True):
            self._connect()
            assert self._list is not None
            try:
                response = self._list(api_pb2.ListPodResourcesRequest(), timeout=self.timeout_s)
            except grpc.RpcError as exc:
                code, details = _status(exc)
                worth_retry = code == grpc.StatusCode.UNAVAILABLE and self._answered and not retry
                self.close()
                if worth_retry:
                    continue  # the kubelet restarted since the last read: its new socket, on a fresh channel
                raise self._failure("List", code, details) from None
            self._answered = True
            return response
        raise AssertionError("unreachable: the second attempt returns or raises")

    def _call_allocatable(self) -> api_pb2.AllocatableResourcesResponse | None:
        stub = self._connect()
        try:
            return stub.GetAllocatableResources(api_pb2.AllocatableResourcesRequest(), timeout=self.timeout_s)
        except grpc.RpcError as exc:
            code, details = _status(exc)
            if code == grpc.StatusCode.UNIMPLEMENTED or (
                code == grpc.StatusCode.UNKNOWN and "GetAllocatableResources disabled" in details
            ):
                self._allocatable_served = False
                return None
            self.close()
            raise self._failure("GetAllocatableResources", code, details) from None

    def _failure(self, method: str, code: grpc.StatusCode | None, details: str) -> PodResourcesError:
        known = _FAILURES.get(code) if code is not None else None
        if known is None:
            name = "no status" if code is None else code.name
            return PodResourcesError(
                f"the kubelet answered {method} on {self.socket_path} with {name}: {details}", reason="error"
            )
        reason, message = known
        return PodResourcesError(
            message.format(
                method=method,
                path=self.socket_path,
                details=details,
                timeout_s=self.timeout_s,
                max_bytes=MAX_MESSAGE_BYTES,
                access_hint=_ACCESS_HINT,
            ),
            reason=reason,
        )


# A failed call's status -> its reason and message (str.format: method, path, details, timeout_s, max_bytes,
# access_hint); any other status is reason "error", naming it.
_FAILURES: dict[grpc.StatusCode, tuple[str, str]] = {
    grpc.StatusCode.UNAVAILABLE: (
        "unavailable",
        "the kubelet does not answer on {path} ({details}): it is restarting, or it stopped and left its socket "
        "behind; the next read connects afresh",
    ),
    grpc.StatusCode.DEADLINE_EXCEEDED: (
        "timeout",
        "the kubelet did not answer {method} on {path} within {timeout_s:g} s (kubernetes.timeout_seconds)",
    ),
    grpc.StatusCode.UNIMPLEMENTED: (
        "unimplemented",
        "the kubelet on {path} does not serve the PodResources v1 {method} ({details}): it is older than "
        "Kubernetes 1.20, which this agent cannot read",
    ),
    # gRPC's own words (the details) name both sizes: "Received message larger than max (5000000 vs. 4194304)".
    grpc.StatusCode.RESOURCE_EXHAUSTED: (
        "too-large",
        "the kubelet's {method} answer on {path} is over the {max_bytes} bytes the agent reads ({details}): this "
        "node lists more pods than the agent reads within its memory bound; run fewer pods on it (the kubelet's "
        "--max-pods) or see docs/KUBERNETES.md, 'What a read costs'",
    ),
    grpc.StatusCode.PERMISSION_DENIED: (
        "permission-denied",
        "the kubelet refused {method} on {path} ({details}): {access_hint}",
    ),
}


def _status(exc: grpc.RpcError) -> tuple[grpc.StatusCode | None, str]:
    # What gRPC raises for a failed call is also a grpc.Call, which carries the status.
    if isinstance(exc, grpc.Call):
        return exc.code(), exc.details() or ""
    return None, str(exc)


class _Tally:
    """Containers and device ids counted, not kept."""

    def __init__(self) -> None:
        self.containers = 0
        self.devices = 0


def bounded_reading(
    pods_listed: Iterable[bytes], allocatable: api_pb2.AllocatableResourcesResponse | None
) -> KubeletReading:
    """What one read keeps of the kubelet's answers (``List``'s as one serialized ``PodResources`` per pod): the GPU
    holders and GPU devices within the bounds, counts of the rest (``reading``). Nothing is built for a container
    that holds no GPU device; ``DecodeError`` for a pod protobuf cannot parse."""
    not_gpu, over, holders, pods, containers = _Tally(), _Tally(), _Tally(), 0, 0

    def gpu_holders() -> Iterator[tuple[KubeletContainer, int]]:
        nonlocal pods, containers
        for serialized in pods_listed:
            pod = api_pb2.PodResources.FromString(serialized)
            pods += 1
            for container in pod.containers:
                containers += 1
                if not len(container.devices):
                    not_gpu.containers += 1  # the common case: a length read, no string made
                    continue
                devices, kept, other, dropped = _gpu_devices(container.devices, MAX_GPU_DEVICES)
                not_gpu.devices += other
                if not kept:
                    not_gpu.containers += 1
                    continue
                over.devices += dropped
                holders.containers += 1
                holders.devices += kept
                yield KubeletContainer(pod.namespace, pod.name, container.name, devices), kept

    first = heapq.nsmallest(MAX_GPU_CONTAINERS, gpu_holders(), key=lambda held: _key(held[0]))
    over.containers = holders.containers - len(first)
    over.devices += holders.devices - sum(count for _, count in first)
    kept: list[KubeletContainer] = []
    budget = MAX_GPU_DEVICES
    for container, count in first:
        if count > budget:  # the device ids run out: this container and the ones after it are left out
            over.containers += 1
            over.devices += count
            budget = 0
            continue
        budget -= count
        kept.append(container)
    served: tuple[KubeletDevices, ...] | None = None
    if allocatable is not None:
        served, _, other, dropped = _gpu_devices(allocatable.devices, MAX_GPU_DEVICES)
        not_gpu.devices += other
        over.devices += dropped
    counted = (
        LeftOut("not-a-gpu", not_gpu.containers, not_gpu.devices),
        LeftOut("over-bound", over.containers, over.devices),
    )
    left_out = tuple(entry for entry in counted if entry.containers or entry.devices)
    return KubeletReading(tuple(kept), served, pods=pods, listed=containers, left_out=left_out)


def _key(container: KubeletContainer) -> tuple[str, str, str]:
    return container.namespace, container.pod, container.container


def _gpu_devices(
    groups: Iterable[api_pb2.ContainerDevices], limit: int
) -> tuple[tuple[KubeletDevices, ...], int, int, int]:
    """(the GPU devices by resource, sorted, at most ``limit`` ids: the first by resource and id; how many kept;
    how many ids were not GPUs; how many GPU ids were over ``limit``)."""
    other = found = 0

    def gpu_ids() -> Iterator[tuple[str, str]]:
        nonlocal other, found
        for group in groups:
            resource = group.resource_name
            for device_id in group.device_ids:
                if is_gpu_device(resource, device_id):
                    found += 1
                    yield resource, device_id
                else:
                    other += 1

    ids = heapq.nsmallest(limit, gpu_ids())
    by_resource: dict[str, list[str]] = {}
    for resource, device_id in ids:
        by_resource.setdefault(resource, []).append(device_id)
    devices = tuple(KubeletDevices(resource, tuple(names)) for resource, names in by_resource.items())
    return devices, len(ids), other, found - len(ids)
