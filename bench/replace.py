"""Replaces as a gateway sees them, and publish-to-serving of the real llama.cpp engine.

    .venv/bin/python bench/replace.py [--repeat 3]

Everything runs against a real ``meridian-node-devserver`` process on 127.0.0.1 (real mutual TLS, real signing),
the agent's cycle in this process (its apply through ansible-runner and reconcile.yml, as ``meridian-node run``
applies in-process) and the local Docker Engine. Prints:

1. A replace of one running stand-in vLLM engine (one environment value changed), seen by a gateway stand-in
   that routes one completion every 50 ms to what the serving projection lists
   (``tests/support/projection_gateway.py``): requests refused out of those sent, and the longest time between
   two answered requests, per round and as medians, two ways:
   - *with room* (the policy's port range has free ports): the new engine starts beside the old one, the agent
     reports it mid-apply, the projection moves to it, then the old one drains and stops (target: 0 refused);
   - *without room* (the range is the engine's one port): the old engine is drained and stopped before the new
     one starts, as every replace was before, so the gap is what a replace used to cost. It is the peer.
   The ratio of the longest gaps (with room / without) follows. Rounds alternate the two ways.
2. Publish-to-serving of one engine, from the start of ``meridian-node-devserver publish`` until the gateway's
   first answered completion through the serving projection: the real llama.cpp engine (Debian's llama-server,
   the tiny random-weight GGUF fetched, verified and promoted through the artifact chain) against the stand-in
   vLLM engine (no artifact), medians of --repeat, as a ratio (llama.cpp / stand-in).

The llama.cpp image is built from the Debian mirror the first time (about 31 s; ``tests/support/llamacpp_image.py``)
and cached. Every container the bench makes carries one random prefix and is removed at the end.
"""

import argparse
import os
import secrets
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import docker
import yaml

from ansible_collections.meridian.node.tests.devserver.devserver_process import running
from ansible_collections.meridian.node.tests.support.e2e_env import (
    E2E_REPOSITORY,
    E2ENode,
    engine_spec,
    free_engine_port,
    make_e2e_node,
    remove_containers,
    tag_for_e2e,
)
from ansible_collections.meridian.node.tests.support.gguf_models import TINY, artifact_ref, write_model
from ansible_collections.meridian.node.tests.support.llamacpp_image import LLAMACPP_REPOSITORY, ensure_llamacpp_image
from ansible_collections.meridian.node.tests.support.node_env import publish
from ansible_collections.meridian.node.tests.support.projection_gateway import GatewayTally, ProjectionGateway
from ansible_collections.meridian.node.tests.support.standin_image import (
    LocalImage,
    ensure_base_image,
    ensure_engine_image,
)
from ansible_collections.meridian.node.tests.support.trust_fixtures import make_key
from meridian_node_agent.agent_side.cycle import Agent, CycleStatus

REPO = Path(__file__).resolve().parents[1]
SERVER = REPO / "tests" / "support" / "standin_server.py"
NODE_ID = f"bench-replace-{os.getpid()}"


def fail(message: str) -> None:
    raise SystemExit(f"bench: {message}")


def apply(agent: Agent) -> None:
    outcome = agent.cycle()
    if outcome.outcome != CycleStatus.APPLIED:
        fail(f"the agent did not apply: {outcome}; {outcome.run and outcome.run.failures}")


def set_port_range(node: E2ENode, low: int, high: int) -> None:
    path = node.node.root / "policy.yaml"
    policy = yaml.safe_load(path.read_text())
    policy["engines"]["port_range"] = [low, high]
    path.write_text(yaml.safe_dump(policy, sort_keys=False))


def replace_round(node: E2ENode, agent: Agent, image: LocalImage, name: str, port: int, note: str) -> GatewayTally:
    """One replace of the running engine ``name`` (its env changed to ``note``) under the gateway's eye."""
    changed = engine_spec(name, image, port, env={"BENCH_NOTE": note})
    with ProjectionGateway.from_projection(node.client().serving, name, "tiny-chat") as gateway:
        time.sleep(0.5)  # the gateway's first answers come from the old engine
        publish(node.server, node.node_id, document={"engines": [changed], "artifacts": []})
        apply(agent)
        time.sleep(0.5)
    return gateway.tally


def replaces(node: E2ENode, image: LocalImage, prefix: str, repeat: int) -> dict[str, list[GatewayTally]]:
    name = f"{prefix}-chat"
    port = free_engine_port()
    low, high = yaml.safe_load((node.node.root / "policy.yaml").read_text())["engines"]["port_range"]
    agent = node.agent()
    publish(node.server, node.node_id, document={"engines": [engine_spec(name, image, port)], "artifacts": []})
    apply(agent)
    tallies: dict[str, list[GatewayTally]] = {"with room": [], "without room": []}
    for index in range(repeat):
        for way in ("with room", "without room") if index % 2 == 0 else ("without room", "with room"):
            # The engine may have moved to a free port in the last replace with room: the narrow range is its port.
            current = _serving_port(node, name) or port
            set_port_range(node, current, current) if way == "without room" else set_port_range(node, low, high)
            tally = replace_round(node, agent, image, name, current, f"{way}-{index}")
            print(f"  round {index + 1}, {way:<13} {tally.describe()}", flush=True)
            tallies[way].append(tally)
    set_port_range(node, low, high)
    return tallies


def _serving_port(node: E2ENode, name: str) -> int | None:
    with node.client() as client:
        endpoints = [e for e in client.serving().endpoints if e.engine == name and e.node_id == node.node_id]
    return int(endpoints[0].address.rsplit(":", 1)[1]) if endpoints else None


def publish_to_serving(node: E2ENode, document: dict[str, Any], name: str, model: str) -> float:
    """Seconds from the publish until the first completion answered through the serving projection."""
    agent = node.agent()
    client = node.client()
    started = time.perf_counter()
    publish(node.server, node.node_id, document=document)
    apply(agent)
    gateway = ProjectionGateway.from_projection(client.serving, name, model)
    gateway.interval_s = 0.02
    with gateway:
        deadline = time.monotonic() + 120
        while gateway.tally.answered == 0:
            if time.monotonic() > deadline:
                fail(f"{name} never answered through the serving projection: {gateway.tally.describe()}")
            time.sleep(0.005)
        served = time.perf_counter()
    publish(node.server, node.node_id, document={"engines": [], "artifacts": []})
    apply(agent)  # back to no engine before the next sample
    return served - started


def allow_llamacpp(node: E2ENode, key_pem: bytes, source: Path) -> None:
    path = node.node.root / "policy.yaml"
    policy = yaml.safe_load(path.read_text())
    (node.node.root / "keys" / "artifact.pem").write_bytes(key_pem)
    policy["trust"]["artifact"] = {"threshold": 1, "public_keys": ["keys/artifact.pem"]}
    policy["store"]["local_sources"] = [str(source)]
    policy["images"]["allowed_repositories"] = [E2E_REPOSITORY, LLAMACPP_REPOSITORY]
    policy["engines"]["allowed_drivers"] = ["vllm", "llamacpp"]
    path.write_text(yaml.safe_dump(policy, sort_keys=False))


def median(values: list[float]) -> float:
    return statistics.median(values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    client = docker.from_env(timeout=60)
    base = ensure_base_image(client)
    image = tag_for_e2e(client, ensure_engine_image(client, base, SERVER, engine="vllm"))
    built = time.perf_counter()
    llama = ensure_llamacpp_image(client)
    llama_build_s = time.perf_counter() - built
    prefix = f"mn-bench-{secrets.token_hex(3)}"
    try:
        with tempfile.TemporaryDirectory(prefix="mn-bench-replace-") as tmp:
            root = Path(tmp)
            (root / "control-plane").mkdir()
            with running(root / "control-plane" / "data") as server:
                node = make_e2e_node(server, root / "node", NODE_ID)
                print(f"replace of one running stand-in engine, gateway every 50 ms, {args.repeat} rounds each way:")
                tallies = replaces(node, image, prefix, args.repeat)
                key = make_key()
                model = write_model(root / "models" / "tiny", TINY, seed=0)
                allow_llamacpp(node, key.public_pem, model.path.parent)
                ref = artifact_ref(model, key, name="tiny-llama")
                real: list[float] = []
                standin: list[float] = []
                for index in range(args.repeat):
                    port = free_engine_port()
                    llama_name = f"{prefix}-llama-{index}"
                    llama_engine = {
                        "name": llama_name,
                        "driver": "llamacpp",
                        "image": llama.image.pinned,
                        "model": {"artifact": "tiny-llama"},
                        "served_model_name": "tiny-llama",
                        "port": port,
                    }
                    document = {"artifacts": [ref], "engines": [llama_engine]}
                    real.append(publish_to_serving(node, document, llama_name, "tiny-llama"))
                    name = f"{prefix}-standin-{index}"
                    document = {"engines": [engine_spec(name, image, free_engine_port())], "artifacts": []}
                    standin.append(publish_to_serving(node, document, name, "tiny-chat"))
    finally:
        remove_containers(client, [prefix])
    room, peer = tallies["with room"], tallies["without room"]
    print("medians:")
    for way, rounds in (("with room (beside)", room), ("without room (peer)", peer)):
        refused = median([len(t.refused) for t in rounds])
        sent = median([t.sent for t in rounds])
        gap = median([t.longest_gap_s for t in rounds])
        print(f"  {way:<22} refused {refused:.0f} of {sent:.0f}, longest gap {gap:.2f} s")
    gap_room, gap_peer = median([t.longest_gap_s for t in room]), median([t.longest_gap_s for t in peer])
    print(f"  ratio of longest gaps, with room / without: {gap_room / gap_peer:.2f}   (target: 0 refused with room)")
    print(f"publish-to-serving through the projection, median of {args.repeat}:")
    print(f"  llama.cpp, tiny GGUF via the artifact chain  {median(real):6.2f} s   ({llama.server_version})")
    print(f"  stand-in vLLM, no artifact                   {median(standin):6.2f} s")
    print(f"  ratio llama.cpp / stand-in                   {median(real) / median(standin):6.2f}")
    print(f"llama.cpp image ready in {llama_build_s:.1f} s (cached under ~/.cache/meridian-node after the first build)")


if __name__ == "__main__":
    main()
