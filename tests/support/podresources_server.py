"""A stand-in kubelet: the generated PodResources servicer on a real ``grpc.server``, on a unix socket.

Tests and ``bench/podresources.py`` say what it lists (pods, containers, devices) and what it can allocate, and
how ``GetAllocatableResources`` answers: served, unimplemented (a kubelet before 1.21, whose service has no
such method: the server itself answers UNIMPLEMENTED) or switched off (1.21 and 1.22 with the feature gate
off: UNKNOWN, "Pod Resources API GetAllocatableResources disabled", as that kubelet says it). What it serves
can change between calls, ``calls`` counts what was asked, and ``hold`` (an Event, while it is not set) keeps
``List`` from answering, as a kubelet that hangs. It also serves one empty method,
``EMPTY_METHOD``, bytes in and out: the cheapest gRPC call on the same server, which the benchmark compares with.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from concurrent import futures
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import grpc

from meridian_node_agent.agent_side.podresources import api_pb2, api_pb2_grpc

__all__ = ["EMPTY_METHOD", "KubeletStandIn", "StandInContainer", "serving"]

EMPTY_METHOD = "/meridian.bench.Empty/Call"
AllocatableAnswer = Literal["served", "unimplemented", "disabled"]


@dataclass
class StandInContainer:
    namespace: str
    pod: str
    container: str
    devices: Mapping[str, Sequence[str]] = field(default_factory=dict)  # resource name -> device ids


class KubeletStandIn(api_pb2_grpc.PodResourcesListerServicer):
    def __init__(
        self,
        containers: Sequence[StandInContainer] = (),
        allocatable: Mapping[str, Sequence[str]] | None = None,
        *,
        allocatable_answer: AllocatableAnswer = "served",
    ) -> None:
        self.containers = list(containers)
        self.allocatable = dict(allocatable or {})
        self.allocatable_answer = allocatable_answer
        self.calls: Counter[str] = Counter()
        self.hold: threading.Event | None = None

    def List(
        self, request: api_pb2.ListPodResourcesRequest, context: grpc.ServicerContext
    ) -> api_pb2.ListPodResourcesResponse:
        self.calls["List"] += 1
        if self.hold is not None:
            self.hold.wait(timeout=60)
        pods: dict[tuple[str, str], api_pb2.PodResources] = {}
        for entry in self.containers:
            pod = pods.setdefault(
                (entry.namespace, entry.pod), api_pb2.PodResources(name=entry.pod, namespace=entry.namespace)
            )
            pod.containers.append(api_pb2.ContainerResources(name=entry.container, devices=_groups(entry.devices)))
        return api_pb2.ListPodResourcesResponse(pod_resources=list(pods.values()))

    def GetAllocatableResources(
        self, request: api_pb2.AllocatableResourcesRequest, context: grpc.ServicerContext
    ) -> api_pb2.AllocatableResourcesResponse:
        self.calls["GetAllocatableResources"] += 1
        if self.allocatable_answer == "disabled":
            # The kubelet returns a plain Go error there, which gRPC sends as UNKNOWN with its text.
            context.abort(grpc.StatusCode.UNKNOWN, "Pod Resources API GetAllocatableResources disabled")
        return api_pb2.AllocatableResourcesResponse(devices=_groups(self.allocatable))


def _groups(devices: Mapping[str, Sequence[str]]) -> list[api_pb2.ContainerDevices]:
    return [api_pb2.ContainerDevices(resource_name=name, device_ids=list(ids)) for name, ids in devices.items()]


def _empty(request: bytes, context: grpc.ServicerContext) -> bytes:
    return b""


@contextmanager
def serving(socket_path: Path, kubelet: KubeletStandIn, *, v1: bool = True) -> Iterator[grpc.Server]:
    """``kubelet`` served on ``socket_path`` until the block ends (then stopped at once, its socket removed).

    ``v1=False``: no ``v1.PodResourcesLister`` at all, as a kubelet before 1.20 (which served v1alpha1 only).
    """
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    if not v1:
        pass
    elif kubelet.allocatable_answer == "unimplemented":
        # An older kubelet's service has List only: GetAllocatableResources is a method the server does not know.
        handlers = {
            "List": grpc.unary_unary_rpc_method_handler(
                kubelet.List,
                request_deserializer=api_pb2.ListPodResourcesRequest.FromString,
                response_serializer=api_pb2.ListPodResourcesResponse.SerializeToString,
            )
        }
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("v1.PodResourcesLister", handlers),))
    else:
        api_pb2_grpc.add_PodResourcesListerServicer_to_server(kubelet, server)
    service, method = EMPTY_METHOD.strip("/").split("/")
    # No (de)serializers: the bytes go as they are.
    empty: dict[str, grpc.RpcMethodHandler[bytes, bytes]] = {method: grpc.unary_unary_rpc_method_handler(_empty)}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, empty),))
    if not server.add_insecure_port(f"unix:{socket_path}"):
        raise RuntimeError(f"the stand-in kubelet could not listen on unix:{socket_path}")
    server.start()
    try:
        yield server
    finally:
        server.stop(grace=None).wait()
