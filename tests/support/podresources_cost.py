"""What one refresh of the kubelet's view costs the agent: memory and CPU, measured in a process of its own.

``measure(socket, gpu)`` starts ``python -m ...podresources_cost`` (this file) against a kubelet served elsewhere
(``podresources_server.serving``, in the caller's process or another): the child imports what the agent imports
in mode kubernetes-integrated, takes its resident set as the baseline, resets the kernel's peak for it
(``/proc/self/clear_refs``, 5), then refreshes: a read of the kubelet, the join with the GPU facts, the
observation built as the agent builds it and made to fit (``ObservationSizeGuard``, where the code has one), and
its JSON as it is posted. It answers with the peak resident set (``VmHWM``) over the baseline, CPU seconds per
refresh, and what the observation said. ``agent_path`` runs another copy of the agent package (the code before a
change, for a benchmark's peer).

The tenant nodes used by tests/agent/agent_side/test_kubernetes_bounds.py, test_podresources_memory.py and
bench/podresources.py are built here too (``tenant_node``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

if (
    TYPE_CHECKING
):  # imported where used: the measuring process (this file, run) must not load the stand-in's gRPC server
    from ansible_collections.meridian.node.tests.support.podresources_server import StandInContainer

__all__ = ["Cost", "engine_named_tenants", "measure", "observe_once", "tenant_node"]

FPGA = "example.com/fpga"


def tenant_node(
    uuids: Sequence[str], *, pods: int, containers: int = 1, shared: int = 0, replicas: int = 8
) -> tuple[list[StandInContainer], dict[str, list[str]]]:
    """A GPU node with ``pods`` tenant pods beside its engines, and what it can allocate.

    One vLLM engine pod per GPU holds it whole (``nvidia.com/gpu``); ``shared`` more pods each hold a time-slicing
    replica (``nvidia.com/gpu.shared``, ``GPU-...::N``, ``replicas`` per GPU). The tenants hold no GPU: each of their
    ``containers`` is named like an engine (``vllm-worker-N``), and every tenth tenant's first container holds an
    FPGA, a device that is not a GPU."""
    from ansible_collections.meridian.node.tests.support.podresources_server import StandInContainer

    engines = [
        StandInContainer("llm", f"vllm-{n}-7d9f8c6b5-x2k4p", "vllm", {"nvidia.com/gpu": [u]})
        for n, u in enumerate(uuids)
    ]
    replica_ids = [f"{uuid}::{n}" for n in range(replicas) for uuid in uuids]
    sharing = [
        StandInContainer("shared", f"chat-{n}-5d4b8c", "server", {"nvidia.com/gpu.shared": [replica_ids[n]]})
        for n in range(shared)
    ]
    tenants = [
        StandInContainer(
            f"tenant-{p % 50:02d}",
            f"vllm-tenant-{p:05d}-6b8f9d7c5-q2w4e",
            f"vllm-worker-{c}",
            {FPGA: [f"fpga-{p}"]} if c == 0 and p % 10 == 0 else {},
        )
        for p in range(pods)
        for c in range(containers)
    ]
    allocatable = {"nvidia.com/gpu": list(uuids), "nvidia.com/gpu.shared": replica_ids, FPGA: ["fpga-0"]}
    return [*engines, *sharing, *tenants], allocatable


def engine_named_tenants(pods: int = 110, containers: int = 10) -> list[StandInContainer]:
    """Issue 38's node: ``pods`` tenant pods of ``containers`` containers, every name saying vLLM, no GPU held;
    names as long as Kubernetes allows a namespace and a container (63), the pods' 253."""
    from ansible_collections.meridian.node.tests.support.podresources_server import StandInContainer

    return [
        StandInContainer(
            f"tenant-{p:03d}-vllm-inference-sandbox-".ljust(63, "x"),
            f"vllm-tenant-{p:03d}-deployment-7d9f8c6b5-".ljust(253, "x"),
            f"vllm-worker-{c}-".ljust(63, "x"),
        )
        for p in range(pods)
        for c in range(containers)
    ]


@dataclass(frozen=True)
class Cost:
    baseline_kib: int  # resident set of the child with the agent imported, before the first read
    peak_kib: int  # the peak resident set over the refreshes
    cpu_s: float  # CPU seconds per refresh (the child's threads, gRPC's included)
    observation_bytes: int  # the observation's JSON, as posted
    available: bool
    reason: str | None
    allocations: int
    engines: int
    left_out: list[dict[str, Any]]

    @property
    def extra_kib(self) -> int:
        return self.peak_kib - self.baseline_kib


def measure(
    socket: Path, gpu: dict[str, Any], *, warm: Path, refreshes: int = 3, agent_path: Path | None = None
) -> Cost:
    """One child process, ``refreshes`` refreshes against ``socket`` after one against ``warm`` (a small node: what
    an agent that has run a while already holds, its gRPC threads and pollers, is in the baseline); ``gpu``: the
    GPU facts, as JSON."""
    env = dict(os.environ)
    if agent_path is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(agent_path), *filter(None, [env.get("PYTHONPATH")])])
    run = subprocess.run(
        [sys.executable, "-m", __name__, str(socket), str(warm), str(refreshes)],
        input=json.dumps(gpu),
        capture_output=True,
        text=True,
        env=env,
        check=False,
        timeout=300,
    )
    if run.returncode != 0:
        raise RuntimeError(f"the measuring process failed ({run.returncode}): {run.stderr[-4000:]}")
    return Cost(**json.loads(run.stdout.splitlines()[-1]))


def observe_once(observer: Any) -> Any:
    """One observation by ``observer`` (an ``observe.Observer``), as the agent of node ``k8s-node-1`` in mode
    kubernetes-integrated makes it before its first apply: epoch 1, generation 0, no run yet, now."""
    return observer.observe(
        node_id="k8s-node-1",
        mode="kubernetes-integrated",
        epoch=1,
        applied_generation=0,
        last_run=None,
        now=datetime.now(UTC),
    )


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _child(socket: str, warm: str, refreshes: int) -> dict[str, Any]:
    # What `meridian-node run` imports in this mode, whichever copy of the agent is first on the path.
    import meridian_node_agent.agent_side.cycle
    import meridian_node_agent.cli.agent  # noqa: F401
    from meridian_node_agent.agent_side import observe
    from meridian_node_agent.agent_side.kubernetes_observer import KubernetesObserver
    from meridian_node_agent.agent_side.podresources.client import PodResourcesClient
    from meridian_node_agent.logs import EventLogger

    gpu = json.loads(sys.stdin.read())
    # The size guard, where the code has one (the code before it posted the observation as it came).
    guard = observe.ObservationSizeGuard() if hasattr(observe, "ObservationSizeGuard") else None
    log = EventLogger()

    def refresh(observer: Any) -> Any:
        observed = observe_once(observer)
        observation = observed if guard is None else guard(observed, log)
        return observation, observation.model_dump_json().encode()

    # As an agent that has run a while: its models built (pydantic builds each at its first use), gRPC started.
    with PodResourcesClient(warm) as small:
        refresh(observe.Observer(store_path=None, gpu_facts=lambda: gpu, kubernetes=KubernetesObserver(small)))
    baseline = _status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # the peak starts again from here
    cpu = time.process_time()
    with PodResourcesClient(socket, timeout_s=30) as client:
        observer = observe.Observer(
            store_path=None, gpu_facts=lambda: gpu, kubernetes=KubernetesObserver(client, refresh_s=0)
        )
        for _ in range(refreshes):
            observation, body = refresh(observer)
    cpu_s = (time.process_time() - cpu) / refreshes
    k8s = observation.kubernetes
    assert k8s is not None
    return {
        "baseline_kib": baseline,
        "peak_kib": _status_kib("VmHWM"),
        "cpu_s": cpu_s,
        "observation_bytes": len(body),
        "available": k8s.available,
        "reason": k8s.reason,
        "allocations": len(k8s.allocations),
        "engines": len(observation.engines),
        "left_out": [entry.model_dump(mode="json") for entry in getattr(k8s, "left_out", [])],
    }


if __name__ == "__main__":
    print(json.dumps(_child(sys.argv[1], sys.argv[2], int(sys.argv[3]))))
