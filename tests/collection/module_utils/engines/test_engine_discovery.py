"""Engine discovery: the heuristic and the VRAM arithmetic as tables, then a real host with our engines,
a draining one, a foreign engine and a container that is no engine at all.

The Docker host is shared, so the Docker test only asserts about containers carrying its random prefix.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ansible_collections.meridian.node.plugins.module_utils import contracts
from ansible_collections.meridian.node.plugins.module_utils.docker.engine import (
    LABEL_DRIVER,
    LABEL_INSTANCE,
    LABEL_OWNED,
    ContainerInfo,
    DockerEngine,
    PublishedPort,
)
from ansible_collections.meridian.node.plugins.module_utils.engines.discovery import (
    capacity,
    discover_engines,
    engine_info,
    guess_driver,
    observe_engines,
    vram_left,
)
from ansible_collections.meridian.node.plugins.module_utils.engines.drain_marks import mark_draining
from ansible_collections.meridian.node.plugins.module_utils.engines.labels import LABEL_OWNER, LABEL_SPEC
from ansible_collections.meridian.node.plugins.module_utils.engines.placement import Reservation
from ansible_collections.meridian.node.tests.support.engine_harness import (
    BIND,
    SERVER,
    Host,
    free_port,
    run_foreign_engine,
)
from ansible_collections.meridian.node.tests.support.standin_image import LocalImage, ensure_engine_image

GPU_A = "GPU-aaaaaaaa-0000-0000-0000-000000000000"
GPU_B = "GPU-bbbbbbbb-0000-0000-0000-000000000000"
MIG_1 = "MIG-11111111-0000-0000-0000-000000000000"
GPU_FACTS: dict[str, Any] = {
    "nvml_available": True,
    "gpus": [
        {"index": 0, "uuid": GPU_A, "memory": {"total_mib": 81920, "free_mib": 80000}, "mig_mode": False},
        {
            "index": 1,
            "uuid": GPU_B,
            "memory": {"total_mib": 81920, "free_mib": 81000},
            "mig_mode": True,
            "mig_instances": [{"uuid": MIG_1, "memory_mib": 19968}],
        },
    ],
}


def foreign(image: str, *container_ports: int) -> ContainerInfo:
    ports = tuple(PublishedPort("127.0.0.1", 20000 + p % 1000, p) for p in container_ports)
    return ContainerInfo("id", "x", image, "sha256:x", "running", "Up", {}, ports, owned=False)


@pytest.mark.parametrize(
    ("image", "ports", "driver"),
    [
        ("vllm/vllm-openai:v0.6.3", (), "vllm"),
        ("ghcr.io/huggingface/text-generation-inference:2.4@sha256:abc", (), "tgi"),
        ("registry.local/team/tgi:latest", (), "tgi"),
        ("lmsysorg/sglang:latest", (), "sglang"),
        ("ollama/ollama", (), "ollama"),
        ("ghcr.io/ggerganov/llama.cpp:server", (), "llamacpp"),
        ("openmmlab/lmdeploy:latest", (), "lmdeploy"),
        ("my/anything", (11434,), "ollama"),
        ("my/anything", (30000,), "sglang"),
        ("my/anything", (23333,), "lmdeploy"),
        # Ports every web server uses say nothing alone; "tgi" inside a word is not TGI.
        ("nginx:1.27", (80, 8080), None),
        ("my/api", (8000,), None),
        ("corp/stgi-tools", (), None),
        ("sha256:0123456789abcdef", (), None),
    ],
)
def test_unmanaged_engines_are_recognised_by_image_name_then_distinctive_port(
    image: str, ports: tuple[int, ...], driver: str | None
) -> None:
    assert guess_driver(foreign(image, *ports)) == driver


def test_vram_left_subtracts_our_reservations_and_offers_mig_gpus_only_by_instance() -> None:
    left = vram_left(
        GPU_FACTS,
        [
            Reservation("a", ("0",), 30000),
            Reservation("b", (GPU_A,), 20000),
            Reservation("c", (MIG_1,), 19000),
            Reservation("gone", ("GPU-not-here",), 5000),
        ],
    )

    # GPU A: min(80000 free, 81920 - 50000 reserved); GPU B is in MIG mode: only its instance is offered.
    assert left == {GPU_A: 31920, MIG_1: 968}


def test_vram_left_never_goes_below_zero() -> None:
    assert vram_left(GPU_FACTS, [Reservation("big", ("0",), 90000)])[GPU_A] == 0


# --- a real host -----------------------------------------------------------------------------------------


@pytest.fixture
def engine() -> Iterator[DockerEngine]:
    adapter = DockerEngine.from_env()
    yield adapter
    adapter.close()


@pytest.mark.docker
@pytest.mark.slow
def test_discovery_lists_ours_with_readiness_and_draining_foreign_ones_unmanaged_and_capacity(
    tmp_path: Path, docker_client: Any, standin_base_image: LocalImage, prefix: str, engine: DockerEngine
) -> None:
    images = {d: ensure_engine_image(docker_client, standin_base_image, SERVER, engine=d) for d in ("vllm", "ollama")}
    host = Host(tmp_path, docker_client)
    ports = {"serving": free_port(), "draining": free_port(), "stopped": free_port()}
    steps = [
        (
            kind,
            host.params(
                name=f"{prefix}-{kind}",
                driver="vllm",
                image=images["vllm"].pinned,
                model={"name": "tiny"},
                served_model_name=f"{kind}-chat",
                port=port,
                state="stopped" if kind == "stopped" else "started",
            ),
            False,
        )
        for kind, port in ports.items()
    ]
    applied = host.play(steps)
    assert all(not result.get("failed") for result in applied.values()), applied
    mark_draining(str(host.state_dir), f"{prefix}-draining", reason="test")
    foreign_port = free_port()
    docker_client.containers.run(
        images["ollama"].id,
        name=f"{prefix}-theirs",
        detach=True,
        init=True,
        ports={"11434/tcp": (BIND, foreign_port)},
    )
    docker_client.containers.create(standin_base_image.id, command=["sleep", "60"], name=f"{prefix}-not-engine")

    observed = {e["name"]: e for e in discover_engines(engine, state_dir=str(host.state_dir))}
    mine = {name: entry for name, entry in observed.items() if name.startswith(prefix)}

    assert set(mine) == {f"{prefix}-serving", f"{prefix}-draining", f"{prefix}-stopped", f"{prefix}-theirs"}
    for entry in mine.values():
        contracts.EngineObservation.model_validate(entry)
    serving = mine[f"{prefix}-serving"]
    assert serving == {
        "name": f"{prefix}-serving",
        "managed": True,
        "driver": "vllm",
        "image": images["vllm"].pinned,
        "state": "running",
        "ready": True,
        "draining": False,
        "port": ports["serving"],
        "served_model_name": "serving-chat",
    }
    assert mine[f"{prefix}-draining"]["draining"] is True
    assert mine[f"{prefix}-draining"]["ready"] is True
    assert mine[f"{prefix}-stopped"]["state"] == "created"
    assert mine[f"{prefix}-stopped"]["ready"] is False
    theirs = mine[f"{prefix}-theirs"]
    assert theirs["managed"] is False
    assert theirs["driver"] == "ollama"
    assert theirs["port"] == foreign_port
    assert docker_client.containers.get(f"{prefix}-theirs").status == "running"

    low = min(ports.values())
    with socket.socket() as held:
        held.bind((BIND, 0))
        held.listen()
        held_port = held.getsockname()[1]
        span = capacity(engine, gpu_facts=GPU_FACTS, port_range=(low, low + 40), bind_address=BIND)
        beside = capacity(engine, gpu_facts=None, port_range=(held_port, held_port), bind_address=BIND)

    contracts.Capacity.model_validate(span)
    assert span["vram_free_mib"][MIG_1] <= 19968
    assert GPU_B not in span["vram_free_mib"]
    assert ports["serving"] not in span["free_ports"] and ports["draining"] not in span["free_ports"]
    assert all(low <= port <= low + 40 for port in span["free_ports"])
    # Held by a plain socket, not a container: still not free.
    assert beside == {"vram_free_mib": {}, "free_ports": []}

    whole = observe_engines(
        engine, state_dir=str(host.state_dir), gpu_facts=None, port_range=(low, low), bind_address=BIND, probe=False
    )
    assert {e["name"] for e in whole["engines"]} >= set(mine)
    assert all(e["ready"] is False for e in whole["engines"])


@pytest.mark.docker
def test_engine_info_reports_what_our_engines_reserve_and_nothing_for_foreign_or_unreadable_labels(
    tmp_path: Path, docker_client: Any, standin_base_image: LocalImage, prefix: str
) -> None:
    host = Host(tmp_path, docker_client)
    spec = {"name": f"{prefix}-on-gpu", "driver": "vllm", "gpus": ["0", GPU_A], "min_vram_mib": 40000, "port": 9001}
    for name, spec_label in ((f"{prefix}-on-gpu", json.dumps(spec)), (f"{prefix}-garbled", "{not json")):
        labels = {
            LABEL_OWNED: "true",
            LABEL_INSTANCE: name,
            LABEL_DRIVER: "vllm",
            LABEL_OWNER: "agent:prune",
            LABEL_SPEC: spec_label,
        }
        docker_client.containers.create(standin_base_image.id, ["sleep", "60"], name=name, labels=labels)
    run_foreign_engine(docker_client, standin_base_image.id, f"{prefix}-theirs", seconds=60)
    policy, state_dir = str(host.policy), str(host.state_dir)

    everything = engine_info(DockerEngine.from_env, policy_path=policy, state_dir=state_dir, probe=False)
    owned = engine_info(
        DockerEngine.from_env, policy_path=policy, state_dir=state_dir, probe=False, owner="agent:prune"
    )

    held = {e["name"]: (e["managed"], e["gpus"], e["min_vram_mib"]) for e in everything["engines"]}
    assert held[f"{prefix}-on-gpu"] == (True, ["0", GPU_A], 40000)
    assert held[f"{prefix}-garbled"] == (True, [], 0)
    assert held[f"{prefix}-theirs"] == (False, [], 0)
    assert [(e["name"], e["gpus"]) for e in owned["engines"]] == [
        (f"{prefix}-garbled", []),
        (f"{prefix}-on-gpu", ["0", GPU_A]),
    ]
