"""Engine discovery for observations against the real Docker Engine: ours and unmanaged containers."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest

from ansible_collections.meridian.node.plugins.module_utils.docker.engine import (
    LABEL_DRIVER,
    LABEL_INSTANCE,
    LABEL_OWNED,
    DockerEngine,
)
from ansible_collections.meridian.node.plugins.module_utils.engines.drain_marks import mark_draining
from meridian_node_agent.agent_side.observe import DockerEngines, Observer

pytestmark = pytest.mark.docker


def test_discovery_reports_owned_and_unmanaged_containers_with_draining_marks(
    docker_client: Any, standin_base_image: Any, tmp_path: Path
) -> None:
    suffix = uuid.uuid4().hex[:8]
    image = standin_base_image.tag
    created = []
    try:
        # Someone else's engine: Ollama's port published, so discovery recognises it (and never touches it).
        stranger = docker_client.containers.create(
            image, ["sleep", "300"], name=f"stranger-{suffix}", ports={"11434/tcp": ("127.0.0.1", None)}
        )
        created.append(stranger)
        stranger.start()
        labels = {LABEL_OWNED: "true", LABEL_INSTANCE: f"chat-{suffix}", LABEL_DRIVER: "vllm"}
        created.append(docker_client.containers.create(image, ["sleep", "300"], name=f"ours-{suffix}", labels=labels))
        mark_draining(str(tmp_path), f"chat-{suffix}", reason="test")
        ticks = iter([0.0, 1.0, 10.0])
        source = DockerEngines(
            DockerEngine.from_env(), state_dir=tmp_path, refresh_s=5.0, monotonic=lambda: next(ticks)
        )

        listed = source()
        engines = {engine["name"]: engine for engine in listed}
        cached = source()  # within refresh_s: the same list, no new listing

        ours = engines[f"chat-{suffix}"]
        stranger = engines[f"stranger-{suffix}"]
        assert (ours["managed"], ours["driver"], ours["draining"], ours["ready"]) == (True, "vllm", True, False)
        assert ours["state"] == "created"
        assert (stranger["managed"], stranger["driver"], stranger["draining"], stranger["ready"]) == (
            False,
            "ollama",
            False,
            False,
        )
        # The whole list, not its length against the names: other tests' engines on the shared Docker Engine are in
        # it too, and one replaced beside its old container is listed twice under one name.
        assert cached == listed
        created[0].remove(force=True)
        created.pop(0)
        assert f"stranger-{suffix}" not in {engine["name"] for engine in source()}  # refreshed after 10 s
    finally:
        for container in created:
            container.remove(force=True)


def test_artifacts_are_reread_at_their_refresh_interval_or_after_forget(tmp_path: Path) -> None:
    clock = [100.0]
    observer = Observer(
        store_path=str(tmp_path / "store"), gpu_facts=lambda: {"nvml_available": False}, monotonic=lambda: clock[0]
    )
    assert observer._store is not None
    reads: list[int] = []
    listing = observer._store.list_versions

    def counted() -> list[dict[str, Any]]:
        reads.append(1)
        return listing()

    observer._store.list_versions = counted  # type: ignore[method-assign]
    for _ in range(3):
        observer.artifacts()
    assert len(reads) == 1  # one store walk per refresh interval, not per cycle
    clock[0] += 30
    observer.artifacts()
    assert len(reads) == 2
    observer.forget()  # what an apply does: the next observation must show what it changed
    observer.artifacts()
    assert len(reads) == 3
