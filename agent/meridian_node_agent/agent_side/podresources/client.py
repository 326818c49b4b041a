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

``GetAllocatableResources`` is missing from kubelets older than 1.21 (UNIMPLEMENTED) and switched off by
default in 1.21 and 1.22 (an error saying "GetAllocatableResources disabled"): both give ``allocatable`` None,
not an error, and the call is not asked again of the same kubelet until a read fails (a restart may bring a
newer one).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from pathlib import Path

# gRPC's core writes INFO lines of its own to stderr (one per GOAWAY when the kubelet restarts), between the
# agent's JSON log lines; its errors still show. Read once, when gRPC starts: an operator's own setting wins.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

import grpc

from meridian_node_agent.agent_side.podresources import api_pb2, api_pb2_grpc
from meridian_node_agent.agent_side.podresources.reading import (
    KubeletContainer,
    KubeletDevices,
    KubeletReading,
    PodResourcesError,
)
from meridian_node_agent.config import DEFAULT_POD_RESOURCES_SOCKET

__all__ = ["MAX_MESSAGE_BYTES", "PodResourcesClient"]

# The kubelet's own limit on what its PodResources server sends (podresources.DefaultMaxMsgSize).
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
_ACCESS_HINT = (
    "the agent's user needs search (x) permission on every directory above it and write permission on the "
    "socket (docs/KUBERNETES.md, 'Access to the socket')"
)


class PodResourcesClient:
    def __init__(self, socket_path: str = DEFAULT_POD_RESOURCES_SOCKET, *, timeout_s: float = 2.0) -> None:
        self.socket_path = socket_path
        self.timeout_s = timeout_s
        self._channel: grpc.Channel | None = None
        self._stub: api_pb2_grpc.PodResourcesListerStub | None = None
        self._answered = False  # the kept channel has answered a call: worth one retry on a fresh one
        self._allocatable_served = True  # False once this kubelet said it does not serve GetAllocatableResources

    def read(self) -> KubeletReading:
        """List the pods' devices, then what is allocatable; raises ``PodResourcesError`` naming the cause."""
        self._check_socket()
        listed = self._call_list()
        allocatable = self._call_allocatable() if self._allocatable_served else None
        containers = tuple(
            KubeletContainer(
                namespace=pod.namespace,
                pod=pod.name,
                container=container.name,
                devices=_devices(container.devices),
            )
            for pod in listed.pod_resources
            for container in pod.containers
        )
        return KubeletReading(containers, None if allocatable is None else _devices(allocatable.devices))

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
        self._channel = self._stub = None
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
            self._answered = False
            self._allocatable_served = True
        return self._stub

    def _call_list(self) -> api_pb2.ListPodResourcesResponse:
        for retry in (False, True):
            stub = self._connect()
            try:
                response = stub.List(api_pb2.ListPodResourcesRequest(), timeout=self.timeout_s)
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
        path = self.socket_path
        if code == grpc.StatusCode.UNAVAILABLE:
            return PodResourcesError(
                f"the kubelet does not answer on {path} ({details}): it is restarting, or it stopped and left its "
                "socket behind; the next read connects afresh",
                reason="unavailable",
            )
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return PodResourcesError(
                f"the kubelet did not answer {method} on {path} within {self.timeout_s:g} s "
                "(kubernetes.timeout_seconds)",
                reason="timeout",
            )
        if code == grpc.StatusCode.UNIMPLEMENTED:
            return PodResourcesError(
                f"the kubelet on {path} does not serve the PodResources v1 {method} ({details}): it is older than "
                "Kubernetes 1.20, which this agent cannot read",
                reason="unimplemented",
            )
        if code == grpc.StatusCode.PERMISSION_DENIED:
            return PodResourcesError(
                f"the kubelet refused {method} on {path} ({details}): {_ACCESS_HINT}", reason="permission-denied"
            )
        name = "no status" if code is None else code.name
        return PodResourcesError(f"the kubelet answered {method} on {path} with {name}: {details}", reason="error")


def _status(exc: grpc.RpcError) -> tuple[grpc.StatusCode | None, str]:
    # What gRPC raises for a failed call is also a grpc.Call, which carries the status.
    if isinstance(exc, grpc.Call):
        return exc.code(), exc.details() or ""
    return None, str(exc)


def _devices(groups: Iterable[api_pb2.ContainerDevices]) -> tuple[KubeletDevices, ...]:
    return tuple(KubeletDevices(group.resource_name, tuple(group.device_ids)) for group in groups)
