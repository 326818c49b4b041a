"""The kubelet's view joined to NVML: a real ``grpc.server`` serving the generated PodResources servicer on a
unix socket, and GPU facts read through the fake pynvml from its scenario files (the uuids come from the facts,
not from this file)."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from ansible_collections.meridian.node.plugins.module_utils.contracts import GpuFacts, KubernetesLeftOut, PodDevice
from ansible_collections.meridian.node.plugins.module_utils.gpu.facts import collect_gpu_facts
from ansible_collections.meridian.node.tests.support.fake_nvml import load_fake_pynvml
from ansible_collections.meridian.node.tests.support.podresources_cost import observe_once
from ansible_collections.meridian.node.tests.support.podresources_server import (
    KubeletStandIn,
    StandInContainer,
    serving,
)
from ansible_collections.meridian.node.tests.support.recorded_events import recording_logger
from meridian_node_agent.agent_side.kubernetes_observer import KubernetesObserver, engine_driver
from meridian_node_agent.agent_side.observe import Observer, no_engines
from meridian_node_agent.agent_side.podresources.client import PodResourcesClient

FPGA = {"example.com/fpga": ["fpga-0"]}
UNKNOWN_GPU = "GPU-ffffffff-ffff-4fff-8fff-ffffffffffff"  # an NVIDIA uuid this host's NVML does not list


@pytest.fixture(scope="module")
def fake() -> ModuleType:
    return load_fake_pynvml()


def facts(fake: ModuleType, scenario: str, health: dict[int, str] | None = None) -> GpuFacts:
    """The scenario's GPU facts as the agent reads them; ``health`` sets a verdict on GPUs by index."""
    fake.use_scenario(scenario)
    read: dict[str, Any] = collect_gpu_facts(fake, processes=False, nvlink=False)
    fake.use_scenario(None)
    for index, verdict in (health or {}).items():
        read["gpus"][index]["health"] = {"verdict": verdict}
    return GpuFacts.model_validate(read)


@pytest.fixture
def sock() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="k8s-obs-") as name:
        yield Path(name) / "kubelet.sock"


def observe(sock: Path, kubelet: KubeletStandIn, gpu: GpuFacts) -> Any:
    with serving(sock, kubelet), PodResourcesClient(str(sock)) as client:
        return KubernetesObserver(client)(gpu)


def test_whole_gpus_and_time_sliced_replicas_join_by_uuid_and_other_devices_are_counted_not_listed(
    fake: ModuleType, sock: Path
) -> None:
    gpu = facts(fake, "eight-gpus", health={2: "degraded"})
    uuids = [str(card.uuid) for card in gpu.gpus]
    assert all(card.uuid for card in gpu.gpus) and len(uuids) == 8
    kubelet = KubeletStandIn(
        [
            StandInContainer("llm", "vllm-llama-0", "vllm", {"nvidia.com/gpu": [uuids[1], uuids[0]]}),
            StandInContainer("llm", "vllm-llama-0", "metrics-sidecar"),  # no device, no engine: not listed
            StandInContainer("shared", "chat-5d4b", "server", {"nvidia.com/gpu.shared": [f"{uuids[2]}::0"]}),
            StandInContainer("shared", "chat-9e1f", "server", {"nvidia.com/gpu.shared": [f"{uuids[2]}::7"]}),
            StandInContainer("edge", "fpga-job", "worker", FPGA),  # not a GPU: counted
            StandInContainer("lost", "old-job", "main", {"nvidia.com/gpu": [UNKNOWN_GPU]}),
        ],
        {"nvidia.com/gpu": [uuids[3]], "nvidia.com/gpu.shared": [f"{uuids[2]}::{n}" for n in range(2)], **FPGA},
    )

    view = observe(sock, kubelet, gpu)

    def joined(resource: str, device_id: str, index: int) -> PodDevice:
        health = gpu.gpus[index].health
        return PodDevice(
            resource=resource,
            device_id=device_id,
            uuid=uuids[index],
            gpu_index=gpu.gpus[index].index,
            health=None if health is None else health.verdict,
        )

    k8s = view.observation
    assert (k8s.socket, k8s.available, k8s.reason) == (str(sock), True, None)
    listed = {(a.namespace, a.pod, a.container): (a.devices, a.engine_driver) for a in k8s.allocations}
    assert list(listed) == [  # sorted, whatever order the kubelet lists in
        ("llm", "vllm-llama-0", "vllm"),
        ("lost", "old-job", "main"),
        ("shared", "chat-5d4b", "server"),
        ("shared", "chat-9e1f", "server"),
    ]
    assert listed[("llm", "vllm-llama-0", "vllm")] == (
        sorted(
            [joined("nvidia.com/gpu", uuids[0], 0), joined("nvidia.com/gpu", uuids[1], 1)], key=lambda d: d.device_id
        ),
        "vllm",
    )
    replica = listed[("shared", "chat-9e1f", "server")][0]
    assert replica == [joined("nvidia.com/gpu.shared", f"{uuids[2]}::7", 2)]
    assert replica[0].health == "degraded"
    assert listed[("lost", "old-job", "main")][0] == [
        PodDevice(resource="nvidia.com/gpu", device_id=UNKNOWN_GPU, uuid=UNKNOWN_GPU)
    ]
    assert k8s.allocatable == [
        joined("nvidia.com/gpu", uuids[3], 3),
        joined("nvidia.com/gpu.shared", f"{uuids[2]}::0", 2),
        joined("nvidia.com/gpu.shared", f"{uuids[2]}::1", 2),
    ]
    # The sidecar and the FPGA job hold no GPU; the FPGA, held and allocatable, is not one.
    assert (k8s.pods, k8s.containers) == (5, 6)
    assert k8s.left_out == [KubernetesLeftOut(reason="not-a-gpu", containers=2, devices=2)]


def test_mig_devices_join_to_their_parent_gpu_and_its_verdict(fake: ModuleType, sock: Path) -> None:
    gpu = facts(fake, "h100-mig", health={0: "unhealthy"})
    card = gpu.gpus[0]
    instances = {instance.profile: instance.uuid for instance in card.mig_instances}
    small = [instance.uuid for instance in card.mig_instances if instance.profile == "1g.10gb"]
    assert card.mig_mode and len(small) == 3
    kubelet = KubeletStandIn(
        [
            StandInContainer("llm", "sglang-qwen-0", "sglang", {"nvidia.com/mig-3g.40gb": [instances["3g.40gb"]]}),
            StandInContainer("batch", "embed-1", "main", {"nvidia.com/mig-1g.10gb": [f"{small[1]}::2"]}),
        ],
        {"nvidia.com/mig-3g.40gb": [instances["3g.40gb"]], "nvidia.com/mig-1g.10gb": small},
    )

    view = observe(sock, kubelet, gpu)

    devices = [device for allocation in view.observation.allocations for device in allocation.devices]
    assert [(d.uuid, d.gpu_index, d.health) for d in devices] == [
        (small[1], card.index, "unhealthy"),
        (instances["3g.40gb"], card.index, "unhealthy"),
    ]
    assert view.observation.allocatable is not None
    assert {d.uuid for d in view.observation.allocatable} == {instances["3g.40gb"], *small}
    assert all(d.gpu_index == card.index for d in view.observation.allocatable)


def test_a_host_without_nvml_still_lists_nvidia_uuids_without_an_index(fake: ModuleType, sock: Path) -> None:
    gpu = facts(fake, "no-library")
    kubelet = KubeletStandIn([StandInContainer("llm", "p", "c", {"nvidia.com/gpu": [f"{UNKNOWN_GPU}::1"]})])

    view = observe(sock, kubelet, gpu)

    assert view.observation.allocations[0].devices == [
        PodDevice(resource="nvidia.com/gpu", device_id=f"{UNKNOWN_GPU}::1", uuid=UNKNOWN_GPU)
    ]


def test_a_kubelet_without_allocatable_gives_none(fake: ModuleType, sock: Path) -> None:
    gpu = facts(fake, "eight-gpus")
    holder = StandInContainer("llm", "p", "c", {"nvidia.com/gpu": [str(gpu.gpus[0].uuid)]})
    kubelet = KubeletStandIn([holder], allocatable_answer="unimplemented")

    view = observe(sock, kubelet, gpu)

    assert view.observation.available and view.observation.allocatable is None
    assert len(view.observation.allocations) == 1


ENGINE_ROWS = [
    # (pod, container, holds devices, driver): the container's name first, then the pod's for a container holding
    # devices; words, not substrings.
    ("vllm-llama3-6d8f9c7b5-x2k4p", "vllm", True, "vllm"),
    ("chat-7f9c", "vllm-openai", False, "vllm"),
    ("mistral-tgi-0", "server", True, "tgi"),
    ("mistral-tgi-0", "metrics", False, None),  # a sidecar of an engine pod is not an engine
    ("mistral-0", "text-generation-inference", True, "tgi"),
    ("qwen-0", "sglang", True, "sglang"),
    ("ollama-5c8d", "ollama", False, "ollama"),
    ("llm-0", "llama-cpp", True, "llamacpp"),
    ("llm-0", "llama.cpp", True, "llamacpp"),
    ("llm-0", "llama-server", False, "llamacpp"),
    ("llm-0", "llamacpp", True, "llamacpp"),
    ("intern-0", "lmdeploy", True, "lmdeploy"),
    ("tgi-0", "vllm", True, "vllm"),  # the container decides
    ("proxy-0", "openai-gateway", True, None),  # "openai" says nothing of the engine
    ("vllmx-0", "servllm", True, None),  # a word, not a substring
    ("llama-0", "trainer", True, None),
    ("notebook-7f9c", "lab", True, None),
]


@pytest.mark.parametrize(("pod", "container", "holds_devices", "driver"), ENGINE_ROWS)
def test_engine_pods_are_known_by_the_words_of_their_names(
    pod: str, container: str, holds_devices: bool, driver: str | None
) -> None:
    assert engine_driver(pod, container, holds_devices=holds_devices) == driver


def test_known_engines_holding_a_gpu_are_reported_unmanaged_and_never_ready(fake: ModuleType, sock: Path) -> None:
    gpu = facts(fake, "eight-gpus")
    kubelet = KubeletStandIn(
        [
            StandInContainer("llm", "vllm-llama-0", "vllm", {"nvidia.com/gpu": [str(gpu.gpus[0].uuid)]}),
            StandInContainer("llm", "mistral-tgi-0", "server", {"nvidia.com/gpu": [str(gpu.gpus[1].uuid)]}),
            StandInContainer("llm", "ollama-cpu-0", "ollama"),  # named like an engine, holding no GPU: counted
            StandInContainer("edge", "fpga-job", "worker", FPGA),
        ]
    )
    with serving(sock, kubelet), PodResourcesClient(str(sock)) as client:
        observer = Observer(
            store_path=None, gpu_facts=lambda: gpu.model_dump(mode="json"), kubernetes=KubernetesObserver(client)
        )
        observation = observe_once(observer)

    engines = {engine.name: engine for engine in observation.engines}
    assert sorted(engines) == ["k8s/llm/mistral-tgi-0/server", "k8s/llm/vllm-llama-0/vllm"]
    for name, driver in (("k8s/llm/mistral-tgi-0/server", "tgi"), ("k8s/llm/vllm-llama-0/vllm", "vllm")):
        engine = engines[name]
        assert (engine.managed, engine.driver, engine.ready, engine.port, engine.state) == (
            False,
            driver,
            False,
            None,
            "active",
        )
    assert observation.kubernetes is not None
    assert [a.engine_driver for a in observation.kubernetes.allocations] == ["tgi", "vllm"]
    assert observation.kubernetes.left_out == [KubernetesLeftOut(reason="not-a-gpu", containers=2, devices=1)]


def test_the_same_node_listed_in_another_order_reads_the_same(fake: ModuleType, sock: Path) -> None:
    gpu = facts(fake, "eight-gpus")
    uuids = [str(card.uuid) for card in gpu.gpus]
    containers = [
        StandInContainer("b", "pod", "c", {"nvidia.com/gpu": uuids[:3]}),
        StandInContainer("a", "vllm-0", "vllm", {"nvidia.com/gpu": uuids[3:5], **FPGA}),
        *(StandInContainer("t", f"vllm-{n}", "vllm", FPGA if n % 2 else {}) for n in range(20)),
    ]
    backwards = [
        StandInContainer(c.namespace, c.pod, c.container, dict(reversed(list(c.devices.items())))) for c in containers
    ]
    for container in backwards:
        container.devices = {name: list(reversed(ids)) for name, ids in container.devices.items()}

    one = observe(sock, KubeletStandIn(containers, {"nvidia.com/gpu": uuids}), gpu)
    other = observe(sock, KubeletStandIn(list(reversed(backwards)), {"nvidia.com/gpu": uuids[::-1]}), gpu)

    assert one.observation.model_dump_json() == other.observation.model_dump_json()
    assert one.engines == other.engines


def test_a_missing_kubelet_is_reported_with_its_reason_once_and_its_return_at_once(
    fake: ModuleType, sock: Path
) -> None:
    gpu = facts(fake, "eight-gpus")
    log, events = recording_logger("k8s-missing")
    client = PodResourcesClient(str(sock))
    observer = KubernetesObserver(client, refresh_s=3600, log=log)

    first, second = observer(gpu), observer(gpu)
    holder = StandInContainer("llm", "vllm-0", "vllm", {"nvidia.com/gpu": [str(gpu.gpus[0].uuid)]})
    with serving(sock, KubeletStandIn([holder, StandInContainer("edge", "fpga-job", "worker", FPGA)])):
        back = observer(gpu)  # not held back by refresh_s: a failed read is not cached
    client.close()

    for view in (first, second):
        assert (view.observation.available, view.observation.allocations) == (False, [])
        assert view.observation.reason is not None and str(sock) in view.observation.reason
    assert [fields["reason"] for fields in events.named("kubernetes-pod-resources-unavailable")] == ["no-socket"]
    assert back.observation.available and len(back.observation.allocations) == 1
    assert [fields["containers"] for fields in events.named("kubernetes-pod-resources-available")] == [2]


def test_the_kubelet_is_read_at_most_every_refresh_and_afresh_after_forget(fake: ModuleType, sock: Path) -> None:
    gpu = facts(fake, "eight-gpus")
    now = [100.0]
    kubelet = KubeletStandIn([StandInContainer("edge", "fpga-job", "worker", FPGA)])
    with serving(sock, kubelet), PodResourcesClient(str(sock)) as client:
        observer = KubernetesObserver(client, refresh_s=10, monotonic=lambda: now[0])
        observer(gpu)
        now[0] += 9.9
        observer(gpu)
        cached = kubelet.calls["List"]
        now[0] += 0.1
        observer(gpu)
        refreshed = kubelet.calls["List"]
        observer.forget()
        observer(gpu)

    assert (cached, refreshed, kubelet.calls["List"]) == (1, 2, 3)


def test_names_and_ids_the_observation_cannot_carry_are_left_out_and_said(fake: ModuleType, sock: Path) -> None:
    log, events = recording_logger("k8s-long")
    gpu = facts(fake, "eight-gpus")
    uuid = str(gpu.gpus[0].uuid)
    long_id = "x" * 254
    kubelet = KubeletStandIn(
        [
            StandInContainer("edge", "gpu-job", "worker", {"nvidia.com/gpu": [uuid], "nvidia.com/other": [long_id]}),
            StandInContainer("edge", "p" * 254, "worker", {"nvidia.com/gpu": [str(gpu.gpus[1].uuid)]}),
        ]
    )
    with serving(sock, kubelet), PodResourcesClient(str(sock)) as client:
        observer = KubernetesObserver(client, log=log, refresh_s=0)
        view = observer(gpu)
        observer(gpu)  # the same again: said once

    assert [(a.pod, [d.device_id for d in a.devices]) for a in view.observation.allocations] == [("gpu-job", [uuid])]
    assert view.observation.left_out == [KubernetesLeftOut(reason="name-too-long", containers=1, devices=2)]
    assert [(e["reason"], e["containers"], e["devices"]) for e in events.named("kubernetes-entries-left-out")] == [
        ("name-too-long", 1, 2)
    ]


def test_an_observer_without_kubernetes_reports_none(fake: ModuleType) -> None:
    gpu = facts(fake, "eight-gpus")
    observer = Observer(store_path=None, gpu_facts=lambda: gpu.model_dump(mode="json"), engines=no_engines)

    observation = observer.observe(
        node_id="plain-node-1", mode="managed-host", epoch=1, applied_generation=0, last_run=None, now=datetime.now(UTC)
    )

    assert observation.kubernetes is None and observation.engines == []
