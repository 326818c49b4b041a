"""What one read of the kubelet's PodResources API costs the agent, beside the cheapest gRPC call on the same server,
and what one refresh costs it in memory and CPU as the node grows, beside the code before the bounds (issue 38).

    .venv/bin/python bench/podresources.py [--repeat N] [--pods N] [--sizes 100,1000,5000] [--peer REF] [--costs-only]

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
5. per refresh, for nodes of --sizes tenant pods (``tests/support/podresources_cost.tenant_node``: one vLLM pod per
   GPU, 32 pods on time-slicing replicas, and the tenants, one container each named like vLLM, every tenth holding
   an FPGA) and for issue 38's node (110 pods of ten engine-named containers, long names): the agent in a process
   of its own (``podresources_cost.measure``: the agent's run path imported, one read of a small node made, then
   the kernel's peak reset) refreshes five times (read, join, observation built and made to fit, its JSON); printed
   are its peak resident set (VmHWM), what the refreshes added to it, CPU seconds per refresh and the
   observation's bytes; beside them the same for the agent package of --peer (default: the commit before the
   bounds), extracted with ``git archive`` and put first on the path. The stand-in kubelet runs in a process of
   its own for each node.
"""

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from timing import median_seconds

from ansible_collections.meridian.node.plugins.module_utils.contracts import GpuFacts
from ansible_collections.meridian.node.plugins.module_utils.gpu.facts import collect_gpu_facts
from ansible_collections.meridian.node.tests.support.fake_nvml import load_fake_pynvml

GPUS = 8
REPO = Path(__file__).resolve().parents[1]
# The agent before the bounds on what mode kubernetes-integrated reads and reports (issue 38, items 2 and 5).
PEER = "46a15b958b06684b951fd963dbe428a56222d703"
ENGINE_NAMED = "110x10-engine-named"


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


def serve(socket_path: str, pods: int, shape: str, containers_per_pod: int = 1) -> None:
    """The stand-in kubelet's process: serve until killed (for ``costs``, a small node beside, on ``.warm``)."""
    from contextlib import ExitStack

    from ansible_collections.meridian.node.tests.support.podresources_cost import engine_named_tenants, tenant_node
    from ansible_collections.meridian.node.tests.support.podresources_server import KubeletStandIn, serving
    from meridian_node_agent.agent_side.podresources import api_pb2

    gpu = eight_gpus()
    uuids = [str(card.uuid) for card in gpu.gpus]
    if shape == "engines":
        containers, allocatable = node(gpu, pods)
    elif shape == ENGINE_NAMED:
        engines, allocatable = tenant_node(uuids, pods=0)
        containers = [*engines, *engine_named_tenants()]
    else:
        containers, allocatable = tenant_node(uuids, pods=pods, containers=containers_per_pod, shared=32)
    kubelet = KubeletStandIn(containers, allocatable)
    answer = kubelet.List(api_pb2.ListPodResourcesRequest(), None)  # type: ignore[arg-type]  # no context read
    with ExitStack() as stack:
        stack.enter_context(serving(Path(socket_path), kubelet))
        if shape != "engines":
            stack.enter_context(serving(Path(f"{socket_path}.warm"), KubeletStandIn(*tenant_node(uuids, pods=10))))
        print(f"serving {answer.ByteSize()}", flush=True)
        while True:
            time.sleep(3600)


@contextmanager
def stand_in(sock: str, pods: int, shape: str, containers: int = 1) -> Iterator[int]:
    """The stand-in kubelet in a process of its own while the block runs; yields the bytes of its List answer."""
    server = subprocess.Popen(
        [
            sys.executable,
            __file__,
            "--serve",
            sock,
            "--pods",
            str(pods),
            "--shape",
            shape,
            "--containers",
            str(containers),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None
        said, answer = server.stdout.readline().split()
        assert said == "serving"
        yield int(answer)
    finally:
        server.terminate()
        server.wait()


def timed(run: Callable[[], Any], repeat: int) -> tuple[float, float]:
    """(median wall seconds, mean CPU seconds of this process) per run."""
    cpu = time.process_time()
    wall = median_seconds(run, repeat)
    return wall, (time.process_time() - cpu) / repeat


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=500)
    parser.add_argument("--pods", type=int, default=40, help="pods without devices beside the 8 engine pods")
    parser.add_argument(
        "--sizes",
        default="100,1000,5000,5000x10",
        help="the nodes of 5., comma-separated: tenant pods, or PODSxCONTAINERS (containers per tenant pod)",
    )
    parser.add_argument("--peer", default=PEER, help="git revision whose agent package is 5.'s peer ('' for none)")
    parser.add_argument("--costs-only", action="store_true", help="5. only")
    parser.add_argument("--serve", metavar="SOCKET", help=argparse.SUPPRESS)
    parser.add_argument("--shape", default="engines", help=argparse.SUPPRESS)
    parser.add_argument("--containers", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.pods, args.shape, args.containers)
        return
    print(
        f"machine: {platform.machine()} {platform.processor() or ''}, {os.cpu_count()} CPUs, "
        f"{platform.system()} {platform.release()}; Python {sys.version.split()[0]}"
    )
    if not args.costs_only:
        timings(args.repeat, args.pods)
    costs([tuple(int(n) for n in f"{size}x1".split("x")[:2]) for size in args.sizes.split(",")], args.peer)


def timings(repeat: int, pods: int) -> None:
    import grpc

    from ansible_collections.meridian.node.tests.support.podresources_server import EMPTY_METHOD
    from meridian_node_agent.agent_side.kubernetes_observer import KubernetesObserver
    from meridian_node_agent.agent_side.podresources.client import PodResourcesClient

    with tempfile.TemporaryDirectory(prefix="podres-bench-") as directory:
        sock = os.path.join(directory, "kubelet.sock")
        with stand_in(sock, pods, "engines"):
            with grpc.insecure_channel(f"unix:{sock}") as channel:
                empty: grpc.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(EMPTY_METHOD)
                empty(b"", timeout=5)  # connected before timing
                empty_s = timed(lambda: empty(b"", timeout=5), repeat)
            kept = PodResourcesClient(sock, timeout_s=5)
            reading = kept.read()
            read_s = timed(kept.read, repeat)
            kept.close()

            def fresh() -> None:
                with PodResourcesClient(sock, timeout_s=5) as client:
                    client.read()

            fresh_s = timed(fresh, max(20, repeat // 10))
            gpu = eight_gpus()
            with PodResourcesClient(sock, timeout_s=5) as client:
                observer = KubernetesObserver(client, refresh_s=3600)
                view = observer(gpu)
                join_s = timed(lambda: observer(gpu), repeat)

    print(
        f"stand-in kubelet in its own process: {reading.listed} containers listed ({len(reading.containers)} holding "
        f"a GPU), {sum(len(g.device_ids) for g in reading.allocatable or ())} GPUs allocatable; "
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


def costs(sizes: list[tuple[int, ...]], peer: str) -> None:
    from ansible_collections.meridian.node.plugins.module_utils.gpu.facts import collect_gpu_facts
    from ansible_collections.meridian.node.tests.support.fake_nvml import load_fake_pynvml
    from ansible_collections.meridian.node.tests.support.podresources_cost import Cost, measure
    from meridian_node_agent.agent_side.podresources.client import MAX_MESSAGE_BYTES

    fake = load_fake_pynvml()
    fake.use_scenario("eight-gpus")
    gpu = collect_gpu_facts(fake, processes=False, nvlink=False)
    with tempfile.TemporaryDirectory(prefix="podres-costs-") as directory:
        peer_path, why = _peer_agent(peer, Path(directory) / "peer")
        print(
            f"per refresh (5 refreshes, the agent in a process of its own; cap on an answer {MAX_MESSAGE_BYTES} "
            f"bytes); peer: {why}"
        )
        print(f"{'':<22} {'':>10} {'':>8}  {'this code':<48}  {'peer':<48}")
        columns = f"{'peak RSS':>14} {'added':>9} {'CPU/refresh':>11} {'observation':>11}"
        print(f"{'node':<22} {'containers':>10} {'answer':>8}  {columns}  {columns}")

        def row(cost: Cost | None) -> str:
            if cost is None:
                return f"{'-':>14} {'-':>9} {'-':>11} {'-':>11}"
            said = f"{cost.observation_bytes:>11,}" if cost.available else f"{'refused':>11}"
            return (
                f"{cost.peak_kib / 1024:>10.1f} MiB {cost.extra_kib / 1024:>5.1f} MiB {cost.cpu_s * 1e3:>8.1f} ms "
                + said
            )

        nodes = [
            (f"{pods} x {per} tenant pods" if per > 1 else f"{pods} tenant pods", pods, per, "tenants")
            for pods, per in sizes
        ]
        for name, pods, per, shape in [*nodes, (ENGINE_NAMED, 0, 1, ENGINE_NAMED)]:
            sock = Path(directory) / "kubelet.sock"
            with stand_in(str(sock), pods, shape, per) as answer:
                warm = Path(f"{sock}.warm")
                ours = measure(sock, gpu, warm=warm, refreshes=5)
                theirs = None if peer_path is None else measure(sock, gpu, warm=warm, refreshes=5, agent_path=peer_path)
            listed = 8 + 32 + pods * per if shape == "tenants" else 8 + 1100
            print(f"{name:<22} {listed:>10,} {answer / 1024:>5.0f} KiB  {row(ours)}  {row(theirs)}")


def _peer_agent(revision: str, into: Path) -> tuple[Path | None, str]:
    """The agent package of ``revision``, extracted under ``into``; None (and why) where it cannot be."""
    if not revision:
        return None, "none asked"
    into.mkdir(parents=True)
    try:
        archive = subprocess.run(
            ["git", "-C", str(REPO), "archive", revision, "agent/meridian_node_agent"],
            capture_output=True,
            check=True,
        )
        subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        return None, f"not available ({exc})"
    return into / "agent", f"the agent package of {revision[:12]} (before the bounds)"


if __name__ == "__main__":
    main()
