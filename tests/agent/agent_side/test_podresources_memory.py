"""A small PodResources answer costs little (issue 38, item 5): what one refresh of the kubelet's view adds to the
agent's peak resident set, measured in a process of its own (tests/support/podresources_cost.py: the kernel's
peak, ``VmHWM``, reset once the agent is imported and has read a small node), against a real gRPC stand-in
kubelet on a unix socket.

The budget: the agent's guard is 80 MiB resident (bench/agent.py); in this mode it idles at about 72 MiB here
(gRPC and protobuf are 14 of them), so a refresh may add 8 MiB at most, and is held to 6 MiB, 2 MiB short of it.
The answer the agent takes is capped (``MAX_MESSAGE_BYTES``, 1 MiB) where that holds: an answer just under the cap
adds 3.4 MiB here; the code before the bounds added 269 MiB for the same answer. Memory, never time: the bounds
hold on a loaded machine too.
"""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ansible_collections.meridian.node.plugins.module_utils.gpu.facts import collect_gpu_facts
from ansible_collections.meridian.node.tests.support.fake_nvml import load_fake_pynvml
from ansible_collections.meridian.node.tests.support.podresources_cost import Cost, measure, tenant_node
from ansible_collections.meridian.node.tests.support.podresources_server import KubeletStandIn, serving
from meridian_node_agent.agent_side.observe import OBSERVATION_MAX_BYTES
from meridian_node_agent.agent_side.podresources import api_pb2
from meridian_node_agent.agent_side.podresources.client import MAX_MESSAGE_BYTES

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="reads the peak resident set from /proc/self (Linux)"
)

MIB = 1024
REFRESH_BUDGET_KIB = 6 * MIB  # 80 MiB guard - 72 MiB idle in this mode - 2 MiB margin


@pytest.fixture(scope="module")
def gpu() -> dict[str, Any]:
    fake = load_fake_pynvml()
    fake.use_scenario("eight-gpus")
    try:
        facts: dict[str, Any] = collect_gpu_facts(fake, processes=False, nvlink=False)
    finally:
        fake.use_scenario(None)
    return facts


@pytest.fixture
def directory() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="podres-mem-") as name:
        yield Path(name)


def _answer_bytes(kubelet: KubeletStandIn) -> int:
    return len(kubelet.List(api_pb2.ListPodResourcesRequest(), None).SerializeToString())  # type: ignore[arg-type]


def _cost(directory: Path, gpu: dict[str, Any], pods: int, containers: int) -> tuple[int, Cost]:
    uuids = [str(card["uuid"]) for card in gpu["gpus"]]
    kubelet = KubeletStandIn(*tenant_node(uuids, pods=pods, containers=containers, shared=32))
    small = KubeletStandIn(*tenant_node(uuids, pods=10))
    with serving(directory / "kubelet.sock", kubelet), serving(directory / "small.sock", small):
        cost = measure(directory / "kubelet.sock", gpu, warm=directory / "small.sock")
    return _answer_bytes(kubelet), cost


@pytest.mark.parametrize(("pods", "containers"), [(5000, 1), (7200, 5)], ids=["5000-pods", "just-under-the-cap"])
def test_a_refresh_adds_no_more_than_its_budget_to_the_agents_peak(
    directory: Path, gpu: dict[str, Any], pods: int, containers: int
) -> None:
    answer, cost = _cost(directory, gpu, pods, containers)

    assert answer <= MAX_MESSAGE_BYTES
    assert cost.extra_kib <= REFRESH_BUDGET_KIB, cost
    assert cost.available and cost.allocations == 8 + 32  # every GPU holder listed
    assert cost.left_out[0] == {"reason": "not-a-gpu", "containers": pods * containers, "devices": pods // 10 + 1}
    assert cost.observation_bytes < OBSERVATION_MAX_BYTES // 16


def test_an_answer_over_the_cap_is_refused_before_it_costs_and_the_observation_says_why(
    directory: Path, gpu: dict[str, Any]
) -> None:
    answer, cost = _cost(directory, gpu, 12000, 5)

    assert answer > MAX_MESSAGE_BYTES
    assert cost.extra_kib <= REFRESH_BUDGET_KIB, cost
    assert not cost.available and cost.reason is not None
    assert f"({answer} vs. {MAX_MESSAGE_BYTES})" in cost.reason and "--max-pods" in cost.reason
