"""What one read of the kubelet's PodResources API costs the agent, beside the cheapest gRPC call on the same server.

    .venv/bin/python bench/podresources.py [--repeat N] [--pods N]

The stand-in kubelet (tests/support/podresources_server.py: the generated servicer on a real grpc.server) runs in
a process of its own, as the kubelet does, on a unix socket; it lists an 8-GPU node: one engine pod per GPU and
--pods more pods without devices (their containers are listed too, as the kubelet lists every pod). Printed,
each the median of --repeat runs, with the agent process's CPU time per run beside it:

1. an empty unary call (bytes in and out, no protobuf) on a kept channel: the floor of any gRPC round trip here;
2. ``PodResourcesClient.read()`` on a kept channel: the socket check, ``List``, ``GetAllocatableResources`` and
   their conversion, as every read after the first costs;
3. the same read on a fresh client each time (channel set-up and connect included): the first read, and a read
   after the kubelet restarted;
4. the join of one cached read with the GPU facts (``KubernetesObserver``), as each report does between reads.
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from timing import median_seconds

from ansible_collections.meridian.node.plugins.module_utils.contracts import GpuFacts
from ansible_collections.meridian.node.plugins.module_utils.gpu.facts import collect_gpu_facts
from ansible_collections.meridian.node.tests.support.fake_nvml import load_fake_pynvml

GPUS = 8


def node(gpu: GpuFacts, pods: int) -> tuple[list[Any], dict[str, list[str]]]:
    from ansible_collections.meridian.node.tests.support.podresources_server import StandInContainer

    uuids = [str(card.uuid) for card in gpu.gpus]
    engines = [
        StandInContainer("llm", f"vllm-{n}-7d9f8c6b5-x2k4p", "vllm", {"nvidia.com/gpu": [u]})
        for n, u in enumerate(uuids)
    ]
    others = [StandInContainer("apps", f"web-{n}-5c8d7b6a9-q7w2e", "web") for n in range(pods)]
    return [*engines, *others], {"nvidia.com/gpu": uuids}


def eight_gpus() -> GpuFacts:
    fake = load_fake_pynvml()
    fake.use_scenario("eight-gpus")
    return GpuFacts.model_validate(collect_gpu_facts(fake, processes=False, nvlink=False))


def serve(socket_path: str, pods: int) -> None:
    """The stand-in kubelet's process: serve until killed."""
    from ansible_collections.meridian.node.tests.support.podresources_server import KubeletStandIn, serving

    containers, allocatable = node(eight_gpus(), pods)
    with serving(Path(socket_path), KubeletStandIn(containers, allocatable)):
        print("serving", flush=True)
        while True:
            time.sleep(3600)


def timed(run: Callable[[], Any], repeat: int) -> tuple[float, float]:
    """(median wall seconds, mean CPU seconds of this process) per run."""
    cpu = time.process_time()
    wall = median_seconds(run, repeat)
    return wall, (time.process_time() - cpu) / repeat


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=500)
    parser.add_argument("--pods", type=int, default=40, help="pods without devices beside the 8 engine pods")
    parser.add_argument("--serve", metavar="SOCKET", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.pods)
        return

    import grpc

    from ansible_collections.meridian.node.tests.support.podresources_server import EMPTY_METHOD
    from meridian_node_agent.agent_side.kubernetes_observer import KubernetesObserver
    from meridian_node_agent.agent_side.podresources.client import PodResourcesClient

    with tempfile.TemporaryDirectory(prefix="podres-bench-") as directory:
        sock = os.path.join(directory, "kubelet.sock")
        server = subprocess.Popen(
            [sys.executable, __file__, "--serve", sock, "--pods", str(args.pods)], stdout=subprocess.PIPE, text=True
        )
        try:
            assert server.stdout is not None and server.stdout.readline().strip() == "serving"
            with grpc.insecure_channel(f"unix:{sock}") as channel:
                empty: grpc.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(EMPTY_METHOD)
                empty(b"", timeout=5)  # connected before timing
                empty_s = timed(lambda: empty(b"", timeout=5), args.repeat)
            kept = PodResourcesClient(sock, timeout_s=5)
            reading = kept.read()
            read_s = timed(kept.read, args.repeat)
            kept.close()

            def fresh() -> None:
                with PodResourcesClient(sock, timeout_s=5) as client:
                    client.read()

            fresh_s = timed(fresh, max(20, args.repeat // 10))
            gpu = eight_gpus()
            with PodResourcesClient(sock, timeout_s=5) as client:
                observer = KubernetesObserver(client, refresh_s=3600)
                view = observer(gpu)
                join_s = timed(lambda: observer(gpu), args.repeat)
        finally:
            server.terminate()
            server.wait()

    holders = sum(1 for container in reading.containers if container.devices)
    print(
        f"stand-in kubelet in its own process: {len(reading.containers)} containers listed ({holders} holding "
        f"a GPU), {sum(len(g.device_ids) for g in reading.allocatable or ())} allocatable; "
        f"{len(view.observation.allocations)} allocations and {len(view.engines)} engines reported"
    )
    rows = [
        ("empty unary call, kept channel (the peer)", empty_s),
        ("PodResources read (List + GetAllocatableResources), kept channel", read_s),
        ("PodResources read on a fresh client (connect included)", fresh_s),
        ("join of a cached read with 8 GPUs' facts", join_s),
    ]
    for name, (wall, cpu) in rows:
        print(f"{name:<68} {wall * 1e3:8.3f} ms wall  {cpu * 1e3:8.3f} ms CPU")
    print(f"read / empty call: {read_s[0] / empty_s[0]:.2f}x wall, {read_s[1] / max(empty_s[1], 1e-9):.2f}x CPU")


if __name__ == "__main__":
    main()
