"""meridian.node.cordon on the real Docker Engine: a node cordon drains and holds, a GPU cordon only its GPUs.

The node cordon runs through ansible-playbook against stand-in engines started by engine_instance. The GPU
cordon matches engines by the GPUs their spec label names; no container here can hold a GPU (no NVIDIA
runtime), so those engines are plain containers carrying our labels, and the GPU facts are given. A node cordon
covers every engine of ours on the Docker Engine: under pytest-xdist this file runs alone, after everything else
(group engine-wide, tests/support/parallel.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ansible_collections.meridian.node.plugins.module_utils.docker.engine import (
    LABEL_DRIVER,
    LABEL_INSTANCE,
    LABEL_OWNED,
    DockerEngine,
)
from ansible_collections.meridian.node.plugins.module_utils.engines.cordon import CordonOptions, cordon_host
from ansible_collections.meridian.node.plugins.module_utils.engines.cordon_file import read_cordon
from ansible_collections.meridian.node.plugins.module_utils.engines.drain_marks import read_mark
from ansible_collections.meridian.node.plugins.module_utils.engines.labels import LABEL_SPEC
from ansible_collections.meridian.node.tests.support.engine_harness import Host, engine_images, free_port
from ansible_collections.meridian.node.tests.support.standin_image import LocalImage

pytestmark = [pytest.mark.docker, pytest.mark.slow]


@pytest.fixture(scope="module")
def images(docker_client: Any, standin_base_image: LocalImage) -> dict[str, LocalImage]:
    return engine_images(docker_client, standin_base_image, ("vllm", "ollama"))


def start(host: Host, images: dict[str, LocalImage], name: str, driver: str) -> dict[str, Any]:
    params = host.params(
        name=name, driver=driver, image=images[driver].pinned, model={"name": "tiny"}, port=free_port()
    )
    applied = host.play([("start", params, False)])["start"]
    assert applied.get("ready") is True, applied.get("msg")
    return params


def test_node_cordon_drains_and_holds_every_engine_and_lifting_starts_exactly_those(
    host: Host, images: dict[str, LocalImage], prefix: str
) -> None:
    names = [f"{prefix}-vllm", f"{prefix}-ollama"]
    for name, driver in zip(names, ("vllm", "ollama"), strict=True):
        start(host, images, name, driver)
    cordon = {"state_dir": str(host.state_dir), "reason": "driver update", "grace": 1}
    lift = {"state_dir": str(host.state_dir), "state": "absent"}

    results, _out = host.play_module(
        "meridian.node.cordon",
        [("check", cordon, True), ("apply", cordon, False), ("again", cordon, False), ("again-check", cordon, True)],
    )
    for label, result in results.items():
        assert not result.get("failed"), (label, result.get("msg"))
    assert results["check"]["changed"] is True
    # A node cordon covers every engine of ours on this Docker Engine (other tests' too, when run side by side).
    assert set(names) <= set(results["check"]["drained"])
    assert results["apply"]["changed"] is True
    assert set(names) <= set(results["apply"]["drained"])
    assert set(names) <= set(results["apply"]["cordon"]["held"])
    assert results["apply"]["cordon"]["drain"] is True, "a node cordon drains by default"
    for label in ("again", "again-check"):
        assert results[label]["changed"] is False, results[label]
        assert results[label]["drained"] == []
    for name in names:
        assert host.container(name).status == "exited"
        mark = read_mark(str(host.state_dir), name)
        assert mark is not None and mark.reason == "cordoned: driver update"
    on_disk = read_cordon(str(host.state_dir))
    assert on_disk is not None and on_disk.node and set(names) <= set(on_disk.held)

    results, _out = host.play_module(
        "meridian.node.cordon", [("check", lift, True), ("lift", lift, False), ("again", lift, False)]
    )
    for label, result in results.items():
        assert not result.get("failed"), (label, result.get("msg"))
    assert results["check"]["changed"] is True and set(names) <= set(results["check"]["started"])
    assert results["lift"]["changed"] is True and set(names) <= set(results["lift"]["started"])
    assert results["again"]["changed"] is False and results["again"]["started"] == []
    assert read_cordon(str(host.state_dir)) is None
    for name in names:
        assert host.container(name).status == "running"
        assert read_mark(str(host.state_dir), name) is None


def test_check_mode_cordon_changes_nothing(host: Host, images: dict[str, LocalImage], prefix: str) -> None:
    name = f"{prefix}-checked"
    start(host, images, name, "ollama")
    cordon = {"state_dir": str(host.state_dir), "grace": 1}

    results, _out = host.play_module("meridian.node.cordon", [("check", cordon, True)])

    assert results["check"]["changed"] is True
    assert name in results["check"]["drained"]
    assert read_cordon(str(host.state_dir)) is None
    assert read_mark(str(host.state_dir), name) is None
    assert host.container(name).status == "running"


def _labelled(docker_client: Any, image: LocalImage, name: str, gpus: list[str]) -> Any:
    spec = {"name": name, "gpus": gpus}
    return docker_client.containers.run(
        image.tag,
        entrypoint=["sleep", "600"],
        name=name,
        detach=True,
        labels={
            LABEL_OWNED: "true",
            LABEL_INSTANCE: name,
            LABEL_DRIVER: "openai",
            LABEL_SPEC: json.dumps(spec),
        },
    )


FACTS: dict[str, Any] = {
    "nvml_available": True,
    "gpus": [
        {"index": 0, "uuid": "GPU-aaaa", "mig_instances": []},
        {"index": 1, "uuid": "GPU-bbbb", "mig_instances": [{"uuid": "MIG-b1"}]},
    ],
}


def test_gpu_cordon_with_drain_stops_only_engines_on_that_gpu_by_any_of_its_names(
    docker_client: Any, standin_base_image: LocalImage, prefix: str, tmp_path: Path
) -> None:
    on_bad = _labelled(docker_client, standin_base_image, f"{prefix}-on-mig", ["MIG-b1"])
    on_good = _labelled(docker_client, standin_base_image, f"{prefix}-on-0", ["0"])
    engine = DockerEngine.from_env()
    try:
        outcome = cordon_host(
            CordonOptions(gpus=("1",), drain=True, reason="xid 79", grace_s=0, state_dir=str(tmp_path)),
            engine=engine,
            gpu_facts=lambda: FACTS,
            check_mode=False,
        )
        without_drain = cordon_host(
            CordonOptions(gpus=("0",), drain=False, state_dir=str(tmp_path / "other")),
            engine=engine,
            gpu_facts=lambda: FACTS,
            check_mode=False,
        )
    finally:
        engine.close()

    assert outcome["drained"] == [on_bad.name]
    assert outcome["cordon"]["held"] == [on_bad.name]
    on_bad.reload()
    on_good.reload()
    assert on_bad.status == "exited"
    assert on_good.status == "running"
    assert without_drain["changed"] is True and without_drain["drained"] == []
    on_good.reload()
    assert on_good.status == "running", "a GPU cordon without drain leaves its engines serving"
