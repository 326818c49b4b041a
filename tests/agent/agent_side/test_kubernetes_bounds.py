"""Tenants do not silence the node (issue 38, item 2): what mode kubernetes-integrated reports is bounded by the
node's GPUs, and the agent makes every observation fit the control plane's limit on a request before it posts it.

A real gRPC stand-in kubelet on a unix socket (tests/support/podresources_server.py), the fake pynvml's eight GPUs
behind the agent's NVML seam, and, for the whole agent, the real devserver, whose limit is the one that refused
the node before (413 ``too-large``, ``MAX_REQUEST_BYTES``).
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from ansible_collections.meridian.node.plugins.module_utils.contracts import (
    EngineObservation,
    GpuFacts,
    KubernetesLeftOut,
    KubernetesObservation,
    Observation,
    PodAllocation,
)
from ansible_collections.meridian.node.plugins.module_utils.gpu import nvml as nvml_seam
from ansible_collections.meridian.node.plugins.module_utils.gpu.facts import collect_gpu_facts
from ansible_collections.meridian.node.tests.devserver.devserver_process import DevServer
from ansible_collections.meridian.node.tests.support.e2e_env import last_observation
from ansible_collections.meridian.node.tests.support.fake_nvml import load_fake_pynvml
from ansible_collections.meridian.node.tests.support.node_env import RecordingClient, make_kubernetes_node, make_node
from ansible_collections.meridian.node.tests.support.podresources_cost import engine_named_tenants, tenant_node
from ansible_collections.meridian.node.tests.support.podresources_server import (
    KubeletStandIn,
    StandInContainer,
    serving,
)
from ansible_collections.meridian.node.tests.support.recorded_events import RecordedEvents, recording_logger
from meridian_node_agent.agent_side.control_client import ControlClient, ControlPlaneRejected
from meridian_node_agent.agent_side.kubernetes_observer import MAX_GPU_CONTAINERS, KubernetesObserver, lighter
from meridian_node_agent.agent_side.observe import OBSERVATION_MAX_BYTES, ObservationSizeGuard, Observer
from meridian_node_agent.agent_side.podresources.client import PodResourcesClient
from meridian_node_agent.agent_side.podresources.reading import is_gpu_device
from meridian_node_agent.devserver.serving.app import MAX_REQUEST_BYTES

MODE = "kubernetes-integrated"


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """The fake pynvml's eight GPUs, where the agent's NVML seam finds pynvml."""
    module = load_fake_pynvml()
    module.use_scenario("eight-gpus")
    monkeypatch.setattr(nvml_seam, "_pynvml", module)
    yield module
    module.use_scenario(None)


@pytest.fixture
def sock() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="k8s-bounds-") as name:
        yield Path(name) / "kubelet.sock"


def gpu_facts(fake: ModuleType) -> dict[str, Any]:
    facts: dict[str, Any] = collect_gpu_facts(fake, processes=False, nvlink=False)
    return facts


def uuids_of(facts: dict[str, Any]) -> list[str]:
    return [str(card["uuid"]) for card in facts["gpus"]]


def holders(containers: list[StandInContainer]) -> set[tuple[str, str, str]]:
    return {
        (c.namespace, c.pod, c.container)
        for c in containers
        if any(is_gpu_device(resource, device) for resource, ids in c.devices.items() for device in ids)
    }


def _engine_named_node(uuids: list[str]) -> tuple[list[StandInContainer], dict[str, list[str]]]:
    """Issue 38's node: 110 tenant pods of ten containers named like vLLM, holding no GPU, beside one engine per GPU."""
    engines, allocatable = tenant_node(uuids, pods=0)
    return [*engines, *engine_named_tenants()], allocatable


def _cycles(
    server: DevServer, tmp_path: Path, node_id: str, sock: Path, kubelet: KubeletStandIn, *, again: bool = False
) -> tuple[RecordingClient, RecordedEvents]:
    """One cycle of a kubernetes-integrated node's agent with ``kubelet`` serving on ``sock`` (``again``: a second,
    the same observation due again, which is posted and not said twice); what it posted, and its events."""
    node = make_kubernetes_node(server, tmp_path / "node", node_id, sock)
    log, events = recording_logger(node_id)
    with serving(sock, kubelet):
        agent = node.agent(log=log)
        agent.client = posted = RecordingClient(agent.client)
        agent.cycle()
        if again:
            agent.reporter.last_posted = None
            agent.cycle()
    return posted, events


NODES = {
    "5000-tenant-pods": lambda uuids: tenant_node(uuids, pods=5000, shared=64),
    "110x10-engine-named-tenants": _engine_named_node,
}


@pytest.mark.parametrize("shape", list(NODES))
def test_tenant_pods_are_counted_every_gpu_holder_listed_and_the_control_plane_takes_it(
    server: DevServer, tmp_path: Path, node_id: str, fake: ModuleType, sock: Path, shape: str
) -> None:
    facts = gpu_facts(fake)
    containers, allocatable = NODES[shape](uuids_of(facts))
    posted, events = _cycles(server, tmp_path, node_id, sock, KubeletStandIn(containers, allocatable))

    sent = posted.posted[-1]
    size = len(sent.model_dump_json().encode())
    assert size <= OBSERVATION_MAX_BYTES and events.named("observation-refused") == []
    k8s = sent.kubernetes
    assert k8s is not None and k8s.available
    gpu_holders = holders(containers)
    assert {(a.namespace, a.pod, a.container) for a in k8s.allocations} == gpu_holders
    assert (k8s.pods, k8s.containers) == (len({(c.namespace, c.pod) for c in containers}), len(containers))
    without = len(containers) - len(gpu_holders)
    fpgas = sum(len(c.devices.get("example.com/fpga", ())) for c in containers) + len(allocatable["example.com/fpga"])
    assert k8s.left_out == [KubernetesLeftOut(reason="not-a-gpu", containers=without, devices=fpgas)]
    # The engines reported are the ones holding a GPU: the tenants named like vLLM are counted, not engines.
    assert sorted(e.name for e in sent.engines) == sorted(f"k8s/llm/vllm-{n}-7d9f8c6b5-x2k4p/vllm" for n in range(8))
    kept = last_observation(server, node_id)
    assert kept is not None and kept["kubernetes"]["left_out"][0]["containers"] == without
    assert events.named("observation-degraded") == []  # it fitted whole


def test_what_the_agent_reported_of_engine_named_tenants_before_was_refused_as_too_large(
    server: DevServer, tmp_path: Path, node_id: str, fake: ModuleType
) -> None:
    """Before the bounds, every engine-named container was listed, and again as an unmanaged engine: 1.18 MB."""
    node = make_node(server, tmp_path / "node", node_id)
    tenants = engine_named_tenants()
    before = Observation(
        apiVersion="meridian.node/v1",
        kind="Observation",
        node_id=node_id,
        lease_epoch=0,
        observed_at=datetime.now(UTC),
        mode="kubernetes-integrated",
        applied_generation=0,
        gpu=GpuFacts.model_validate(gpu_facts(fake)),
        engines=[
            EngineObservation.model_validate(
                {
                    "name": f"k8s/{c.namespace}/{c.pod}/{c.container}",
                    "managed": False,
                    "driver": "vllm",
                    "image": None,
                    "state": "active",
                    "ready": False,
                    "draining": False,
                    "port": None,
                }
            )
            for c in tenants
        ],
        kubernetes=KubernetesObservation(
            socket="/var/lib/kubelet/pod-resources/kubelet.sock",
            available=True,
            allocations=[
                PodAllocation(namespace=c.namespace, pod=c.pod, container=c.container, engine_driver="vllm")
                for c in tenants
            ],
        ),
    )
    identity = node.config.identity_dir

    client = ControlClient(server.base_url, identity / "ca.pem", identity / "node.pem", identity / "node.key.pem")
    with client, pytest.raises(ControlPlaneRejected) as refused:
        client.post_observation(before)

    assert len(before.model_dump_json().encode()) > 1_150_000
    assert (refused.value.status, refused.value.reason) == (413, "too-large")


def _hoarding_node(uuids: list[str]) -> tuple[list[StandInContainer], dict[str, list[str]]]:
    """A device plugin with long names: MAX_GPU_CONTAINERS engine containers with long names, four GPU ids of 200
    characters each, and as many allocatable: within the bounds, and over 1 MiB together."""
    resource = "nvidia.com/" + "shared-gpu-".ljust(120, "x")

    def device(n: int) -> str:
        return f"GPU-{n:08d}".ljust(200, "f")

    containers = [
        StandInContainer(
            f"team-{n:03d}-".ljust(63, "x"),
            f"vllm-{n:03d}-".ljust(253, "x"),
            f"vllm-{n:03d}-".ljust(63, "x"),
            {resource: [device(4 * n + k) for k in range(4)]},
        )
        for n in range(MAX_GPU_CONTAINERS)
    ]
    return containers, {resource: [device(n) for n in range(4 * MAX_GPU_CONTAINERS)]}


def test_an_observation_over_the_limit_sheds_kubernetes_detail_first_says_so_and_is_taken(
    server: DevServer, tmp_path: Path, node_id: str, fake: ModuleType, sock: Path
) -> None:
    containers, allocatable = _hoarding_node(uuids_of(gpu_facts(fake)))
    posted, events = _cycles(server, tmp_path, node_id, sock, KubeletStandIn(containers, allocatable), again=True)

    assert len(posted.posted) == 2
    sent = posted.posted[-1]
    assert len(sent.model_dump_json().encode()) <= OBSERVATION_MAX_BYTES
    k8s = sent.kubernetes
    assert k8s is not None and k8s.available
    assert k8s.allocatable == []  # what is allocatable went first, and is counted
    [resource] = allocatable
    assert k8s.left_out == [KubernetesLeftOut(reason="too-large", containers=0, devices=len(allocatable[resource]))]
    assert len(k8s.allocations) == MAX_GPU_CONTAINERS and len(sent.engines) == MAX_GPU_CONTAINERS
    [said] = events.named("observation-degraded")
    assert said["bytes"] > OBSERVATION_MAX_BYTES >= said["sent_bytes"]
    assert said["dropped"] == [f"kubernetes.allocatable ({4 * MAX_GPU_CONTAINERS} devices)"]
    assert events.named("observation-refused") == []
    kept = last_observation(server, node_id)
    assert kept is not None and kept["kubernetes"]["left_out"][0]["reason"] == "too-large"


def _observation(fake: ModuleType, sock: Path, containers: list[StandInContainer], **kubelet: Any) -> Observation:
    facts = gpu_facts(fake)
    with serving(sock, KubeletStandIn(containers, **kubelet)), PodResourcesClient(str(sock)) as client:
        observer = Observer(store_path=None, gpu_facts=lambda: facts, kubernetes=KubernetesObserver(client))
        return observer.observe(
            node_id="k8s-node-1", mode=MODE, epoch=1, applied_generation=0, last_run=None, now=datetime.now(UTC)
        )


def _bytes(observation: Observation) -> int:
    return len(observation.model_dump_json().encode())


def test_allocations_are_halved_with_their_engines_until_it_fits_and_whole_again_is_said(
    fake: ModuleType, sock: Path
) -> None:
    containers, allocatable = tenant_node(uuids_of(gpu_facts(fake)), pods=0, shared=32)
    whole = _observation(fake, sock, containers, allocatable=allocatable)
    assert whole.kubernetes is not None and whole.kubernetes.allocatable
    listed, offered = whole.kubernetes.allocations, len(whole.kubernetes.allocatable)
    steps = [what for _, what in lighter(whole)]
    assert len(listed) == 40 and steps == [
        f"kubernetes.allocatable ({offered} devices)",
        "kubernetes.allocations after the first 20 (20 containers, 20 devices) and 0 engines of theirs",
        "kubernetes.allocations after the first 10 (30 containers, 30 devices) and 0 engines of theirs",
        "kubernetes.allocations after the first 5 (35 containers, 35 devices) and 3 engines of theirs",
        "kubernetes.allocations after the first 2 (38 containers, 38 devices) and 6 engines of theirs",
        "kubernetes.allocations after the first 1 (39 containers, 39 devices) and 7 engines of theirs",
        "kubernetes.allocations after the first 0 (40 containers, 40 devices) and 8 engines of theirs",
    ]
    five = [observation for observation, _ in lighter(whole)][3]
    guard = ObservationSizeGuard(max_bytes=_bytes(five))  # the first that fits keeps five allocations
    log, events = recording_logger("k8s-halved")

    sent = guard(whole, log)
    again = guard(whole, log)
    light = guard(whole.model_copy(update={"kubernetes": None, "engines": []}), log)

    assert sent == five and again == sent and light.kubernetes is None
    k8s = sent.kubernetes
    assert k8s is not None and k8s.allocatable == [] and k8s.allocations == listed[:5]
    assert k8s.left_out[-1] == KubernetesLeftOut(reason="too-large", containers=35, devices=35 + offered)
    # The engines of the allocations that went, went with them (the engines sort first: namespace llm).
    assert sorted(e.name for e in sent.engines) == [f"k8s/llm/vllm-{n}-7d9f8c6b5-x2k4p/vllm" for n in range(5)]
    [said] = events.named("observation-degraded")  # once per change
    assert said["dropped"] == steps[:4] and said["sent_bytes"] == _bytes(five)
    assert [e["bytes"] for e in events.named("observation-whole-again")] == [_bytes(light)]


def test_last_log_lines_go_after_kubernetes_and_what_cannot_fit_is_sent_and_said(fake: ModuleType) -> None:
    facts = GpuFacts.model_validate(gpu_facts(fake))
    engine = {
        "managed": True,
        "driver": "vllm",
        "image": "registry.example/vllm@sha256:" + "ab" * 32,
        "state": "restarting",
        "ready": False,
        "draining": False,
        "port": 9450,
        "last_lines": ["x" * 500] * 20,
    }
    observation = Observation(
        apiVersion="meridian.node/v1",
        kind="Observation",
        node_id="plain-node-1",
        lease_epoch=1,
        observed_at=datetime.now(UTC),
        mode="managed-host",
        applied_generation=1,
        gpu=facts,
        engines=[EngineObservation.model_validate({**engine, "name": f"chat-{n}"}) for n in range(4)],
    )
    log, events = recording_logger("k8s-lines")

    fitted = ObservationSizeGuard(max_bytes=_bytes(observation) - 1)(observation, log)
    stuck = ObservationSizeGuard(max_bytes=1000)(observation, log)

    assert all(e.last_lines is None for e in fitted.engines) and fitted.gpu == observation.gpu
    assert [e["dropped"] for e in events.named("observation-degraded")] == [["engines' last_lines"]]
    assert stuck.engines == fitted.engines  # everything that can go went; sent all the same, the answer decides
    [error] = events.named("observation-too-large")
    assert error["sent_bytes"] > error["limit"] == 1000


def test_the_agents_limit_is_the_control_planes() -> None:
    assert OBSERVATION_MAX_BYTES == MAX_REQUEST_BYTES
