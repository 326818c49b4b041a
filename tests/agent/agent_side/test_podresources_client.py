"""The PodResources client against a real ``grpc.server`` serving the generated servicer on a unix socket
(tests/support/podresources_server.py): what a kubelet lists, and every way a read can fail, each named."""

from __future__ import annotations

import os
import socket
import tempfile
import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from ansible_collections.meridian.node.tests.support.podresources_server import (
    KubeletStandIn,
    StandInContainer,
    serving,
)
from ansible_collections.meridian.node.tests.support.shared_tmp import reachable_tmp_dir, run_as_nobody
from meridian_node_agent.agent_side.podresources import api_pb2
from meridian_node_agent.agent_side.podresources.client import MAX_MESSAGE_BYTES, PodResourcesClient
from meridian_node_agent.agent_side.podresources.reading import (
    MAX_GPU_CONTAINERS,
    MAX_GPU_DEVICES,
    KubeletContainer,
    KubeletDevices,
    LeftOut,
    PodResourcesError,
)

GPU_0 = "GPU-0a1b2c3d-0000-4000-8000-000000000000"
GPU_1 = "GPU-0a1b2c3d-0000-4000-8000-000000000001"
MIG_A = "MIG-4c7a1e92-0b3d-5f6e-8a21-9d0c3b7e5f41"

NODE = [
    StandInContainer("llm", "vllm-llama-0", "vllm", {"nvidia.com/gpu": [GPU_0, GPU_1]}),
    StandInContainer("llm", "vllm-llama-0", "metrics-sidecar"),
    StandInContainer("batch", "notebook-7f9c", "lab", {"nvidia.com/mig-1g.10gb": [MIG_A]}),
    StandInContainer("shared", "chat-5d4b", "server", {"nvidia.com/gpu.shared": [f"{GPU_1}::3"]}),
    StandInContainer("edge", "fpga-job", "worker", {"example.com/fpga": ["fpga-0", "fpga-1"]}),
]
ALLOCATABLE = {
    "nvidia.com/gpu": [GPU_0, GPU_1],
    "nvidia.com/mig-1g.10gb": [MIG_A],
    "example.com/fpga": ["fpga-0", "fpga-1"],
}


@pytest.fixture
def socket_dir() -> Iterator[Path]:
    """A short directory for the socket: a unix socket's path must fit in 108 bytes, pytest's tmp_path may not."""
    with tempfile.TemporaryDirectory(prefix="podres-") as name:
        yield Path(name)


def _reason(call: PodResourcesClient) -> tuple[str, str]:
    with pytest.raises(PodResourcesError) as failed:
        call.read()
    return failed.value.reason, str(failed.value)


def test_a_read_keeps_the_gpu_holders_with_their_gpus_and_counts_the_rest(socket_dir: Path) -> None:
    sock = socket_dir / "kubelet.sock"
    kubelet = KubeletStandIn(NODE, ALLOCATABLE)

    with serving(sock, kubelet), PodResourcesClient(str(sock)) as client:
        reading = client.read()

    assert reading.containers == (  # sorted by namespace, pod and container
        KubeletContainer("batch", "notebook-7f9c", "lab", (KubeletDevices("nvidia.com/mig-1g.10gb", (MIG_A,)),)),
        KubeletContainer("llm", "vllm-llama-0", "vllm", (KubeletDevices("nvidia.com/gpu", (GPU_0, GPU_1)),)),
        KubeletContainer("shared", "chat-5d4b", "server", (KubeletDevices("nvidia.com/gpu.shared", (f"{GPU_1}::3",)),)),
    )
    assert reading.allocatable == (
        KubeletDevices("nvidia.com/gpu", (GPU_0, GPU_1)),
        KubeletDevices("nvidia.com/mig-1g.10gb", (MIG_A,)),
    )
    # The sidecar and the FPGA job hold no GPU; their two FPGAs and the two allocatable ones are not GPUs.
    assert (reading.pods, reading.listed) == (4, 5)
    assert reading.left_out == (LeftOut("not-a-gpu", containers=2, devices=4),)
    assert kubelet.calls == {"List": 1, "GetAllocatableResources": 1}


def test_a_gpu_is_an_nvidia_resource_or_an_nvidia_uuid_under_any_resource(socket_dir: Path) -> None:
    sock = socket_dir / "kubelet.sock"
    node = [
        StandInContainer("a", "renamed", "c", {"example.com/gpu": [f"{GPU_0}::2"]}),  # an NVIDIA uuid: kept
        StandInContainer("a", "index-ids", "c", {"nvidia.com/gpu": ["0"]}),  # an NVIDIA resource: kept
        StandInContainer("a", "fuse", "c", {"smarter-devices/fuse": ["fuse-17"]}),  # neither
    ]

    with serving(sock, KubeletStandIn(node)), PodResourcesClient(str(sock)) as client:
        reading = client.read()

    assert [c.pod for c in reading.containers] == ["index-ids", "renamed"]
    assert reading.left_out == (LeftOut("not-a-gpu", containers=1, devices=1),)


def test_gpu_holders_past_the_bounds_are_counted_and_the_first_by_name_kept_whatever_the_order(
    socket_dir: Path,
) -> None:
    sock = socket_dir / "kubelet.sock"
    extra = 10
    holders = [
        StandInContainer(f"ns-{n:04d}", "pod", "c", {"nvidia.com/gpu.shared": [f"{GPU_0}::{n}"]})
        for n in range(MAX_GPU_CONTAINERS + extra)
    ]
    # One container holding more GPU ids than the bound on ids, sorted last.
    hoarder = StandInContainer("zz", "pod", "c", {"nvidia.com/gpu.shared": [f"{GPU_1}::{n}" for n in range(2000)]})
    allocatable = {"nvidia.com/gpu.shared": [f"{GPU_0}::{n}" for n in range(MAX_GPU_DEVICES + 5)]}

    kubelet = KubeletStandIn([hoarder, *reversed(holders)], allocatable)
    with serving(sock, kubelet), PodResourcesClient(str(sock)) as client:
        reading = client.read()

    assert [c.namespace for c in reading.containers] == [f"ns-{n:04d}" for n in range(MAX_GPU_CONTAINERS)]
    assert reading.allocatable is not None
    assert sum(len(group.device_ids) for group in reading.allocatable) == MAX_GPU_DEVICES
    assert reading.left_out == (LeftOut("over-bound", containers=extra + 1, devices=extra + 2000 + 5),)


def test_no_socket_names_the_path_and_the_setting(socket_dir: Path) -> None:
    sock = socket_dir / "kubelet.sock"

    reason, message = _reason(PodResourcesClient(str(sock)))

    assert reason == "no-socket"
    assert str(sock) in message and "kubernetes.pod_resources_socket" in message


def test_a_path_that_is_not_a_socket_is_named(socket_dir: Path) -> None:
    path = socket_dir / "kubelet.sock"
    path.write_text("not a socket\n")

    reason, message = _reason(PodResourcesClient(str(path)))

    assert reason == "not-a-socket" and str(path) in message


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to serve the socket and drop to another user to read it")
def test_a_user_who_may_not_reach_or_write_the_socket_is_told_what_to_grant() -> None:
    with reachable_tmp_dir("podres-") as root:
        open_dir, closed_dir = root / "open", root / "closed"
        open_dir.mkdir(mode=0o755)
        closed_dir.mkdir(mode=0o700)  # as the kubelet's own /var/lib/kubelet/pod-resources is
        kubelet = KubeletStandIn(NODE, ALLOCATABLE)
        with serving(open_dir / "kubelet.sock", kubelet), serving(closed_dir / "kubelet.sock", kubelet):
            (open_dir / "kubelet.sock").chmod(0o755)  # others may not write it: no connect
            seen = {name: run_as_nobody(_read_as(root / name / "kubelet.sock")) for name in ("open", "closed")}

    assert seen["open"].startswith("RuntimeError: permission-denied|"), seen
    assert "not writable by this user (uid 65534)" in seen["open"]
    assert seen["closed"].startswith("RuntimeError: permission-denied|"), seen
    assert "cannot be reached (Permission denied)" in seen["closed"]
    for report in seen.values():
        assert "docs/KUBERNETES.md" in report
    assert kubelet.calls == {}  # refused before any call


def _read_as(path: Path) -> Callable[[], None]:
    def read() -> None:
        try:
            PodResourcesClient(str(path)).read()
        except PodResourcesError as exc:
            raise RuntimeError(f"{exc.reason}|{exc}") from exc

    return read


def test_a_kubelet_without_get_allocatable_resources_gives_none_not_an_error(socket_dir: Path) -> None:
    sock = socket_dir / "kubelet.sock"
    older = KubeletStandIn(NODE, ALLOCATABLE, allocatable_answer="unimplemented")

    with serving(sock, older), PodResourcesClient(str(sock)) as client:
        reading = client.read()

    assert reading.allocatable is None
    assert len(reading.containers) == 3 and reading.listed == len(NODE)


def test_a_kubelet_with_get_allocatable_resources_switched_off_is_asked_once(socket_dir: Path) -> None:
    sock = socket_dir / "kubelet.sock"
    gated = KubeletStandIn(NODE, ALLOCATABLE, allocatable_answer="disabled")

    with serving(sock, gated), PodResourcesClient(str(sock)) as client:
        first, second = client.read(), client.read()

    assert first.allocatable is None and second.allocatable is None
    assert gated.calls == {"List": 2, "GetAllocatableResources": 1}


def test_a_kubelet_without_the_v1_list_is_named(socket_dir: Path) -> None:
    sock = socket_dir / "kubelet.sock"

    with serving(sock, KubeletStandIn(), v1=False):
        reason, message = _reason(PodResourcesClient(str(sock)))

    assert reason == "unimplemented" and "older than Kubernetes 1.20" in message


def test_a_kubelet_that_crashed_and_left_its_socket_then_came_back_at_the_same_path(socket_dir: Path) -> None:
    sock = socket_dir / "kubelet.sock"
    kubelet = KubeletStandIn(NODE[:1], ALLOCATABLE)
    client = PodResourcesClient(str(sock), timeout_s=2)
    with serving(sock, kubelet):
        assert [c.pod for c in client.read().containers] == ["vllm-llama-0"]
    # A crash leaves the socket file behind with nobody listening on it.
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(sock))
    stale.close()

    reason, message = _reason(client)
    kubelet.containers = NODE[2:3]
    with serving(sock, kubelet):  # the new kubelet replaces the stale socket
        after = client.read()
    client.close()

    assert reason == "unavailable" and str(sock) in message and "the next read connects afresh" in message
    assert [c.pod for c in after.containers] == ["notebook-7f9c"]


def test_a_kubelet_restarted_between_two_reads_is_read_at_once(socket_dir: Path) -> None:
    sock = socket_dir / "kubelet.sock"
    kubelet = KubeletStandIn(NODE[:1], ALLOCATABLE)
    client = PodResourcesClient(str(sock), timeout_s=2)
    with serving(sock, kubelet):
        client.read()
    kubelet.containers = NODE[3:4]

    with serving(sock, kubelet):
        after = client.read()  # at once: no wait on gRPC's reconnect backoff, no failed read first
    client.close()

    assert [c.pod for c in after.containers] == ["chat-5d4b"]


def test_a_kubelet_that_does_not_answer_times_out_and_the_next_read_connects_afresh(socket_dir: Path) -> None:
    sock = socket_dir / "kubelet.sock"
    kubelet = KubeletStandIn(NODE[:1], ALLOCATABLE)
    kubelet.hold = threading.Event()
    client = PodResourcesClient(str(sock), timeout_s=0.2)
    with serving(sock, kubelet):
        try:
            reason, message = _reason(client)
        finally:
            kubelet.hold.set()
        kubelet.hold = None
        after = client.read()
    client.close()

    assert reason == "timeout" and "within 0.2 s (kubernetes.timeout_seconds)" in message
    assert [c.pod for c in after.containers] == ["vllm-llama-0"]


def test_an_answer_over_the_cap_is_refused_naming_both_sizes_and_what_to_do(socket_dir: Path) -> None:
    sock = socket_dir / "kubelet.sock"
    # Pods without devices, as many as it takes to pass the cap: names of 200 characters.
    crowd = [StandInContainer("tenants", f"{n:06d}".ljust(200, "x"), "c") for n in range(MAX_MESSAGE_BYTES // 200)]
    kubelet = KubeletStandIn(crowd, ALLOCATABLE)
    answer = len(kubelet.List(api_pb2.ListPodResourcesRequest(), None).SerializeToString())  # type: ignore[arg-type]

    with serving(sock, kubelet), PodResourcesClient(str(sock)) as client:
        reason, message = _reason(client)
        kubelet.containers = crowd[:100]
        after = client.read()  # the channel still works

    assert answer > MAX_MESSAGE_BYTES
    assert reason == "too-large"
    assert f"({answer} vs. {MAX_MESSAGE_BYTES})" in message and "--max-pods" in message
    assert "docs/KUBERNETES.md" in message
    assert after.listed == 100


def test_a_pod_protobuf_cannot_parse_is_an_error_naming_the_answer(socket_dir: Path) -> None:
    sock = socket_dir / "kubelet.sock"
    # A List answer whose one pod (field 1, two bytes) is no PodResources: a field tag cut short.
    answers = {"List": b"\x0a\x02\xff\xff", "GetAllocatableResources": b""}

    def answering(answer: bytes) -> grpc.RpcMethodHandler[bytes, bytes]:
        return grpc.unary_unary_rpc_method_handler(lambda request, context: answer)  # no (de)serializers: bytes

    handlers = {method: answering(answer) for method, answer in answers.items()}
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("v1.PodResourcesLister", handlers),))
    server.add_insecure_port(f"unix:{sock}")
    server.start()
    try:
        with PodResourcesClient(str(sock)) as client:
            reason, message = _reason(client)
    finally:
        server.stop(grace=None).wait()

    assert reason == "error" and "holds a pod that is not a v1.PodResources" in message
