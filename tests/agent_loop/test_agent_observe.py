"""Engine discovery for observations against the real Docker Engine: ours and unmanaged containers."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest

from ansible_collections.meridian.node.plugins.module_utils.docker_engine import (
    LABEL_DRIVER,
    LABEL_INSTANCE,
    LABEL_OWNED,
    DockerEngine,
)
from meridian_node_agent.observe import DockerEngines

pytestmark = pytest.mark.docker


def test_discovery_reports_owned_and_unmanaged_containers_with_draining_marks(
    docker_client: Any, standin_base_image: Any, tmp_path: Path
) -> None:
    suffix = uuid.uuid4().hex[:8]
    image = standin_base_image.tag
    created = []
    try:
        created.append(docker_client.containers.create(image, ["sleep", "300"], name=f"stranger-{suffix}"))
        labels = {LABEL_OWNED: "true", LABEL_INSTANCE: f"chat-{suffix}", LABEL_DRIVER: "vllm"}
        created.append(docker_client.containers.create(image, ["sleep", "300"], name=f"ours-{suffix}", labels=labels))
        (tmp_path / "draining").mkdir()
        (tmp_path / "draining" / f"chat-{suffix}.json").write_text(json.dumps({"name": f"chat-{suffix}"}))
        ticks = iter([0.0, 1.0, 10.0])
        source = DockerEngines(
            DockerEngine(docker_client), state_dir=tmp_path, refresh_seconds=5.0, monotonic=lambda: next(ticks)
        )

        engines = {engine["name"]: engine for engine in source()}
        cached = source()  # within refresh_seconds: the same list, no new listing

        ours = engines[f"chat-{suffix}"]
        stranger = engines[f"stranger-{suffix}"]
        assert (ours["managed"], ours["driver"], ours["draining"], ours["ready"]) == (True, "vllm", True, False)
        assert ours["state"] == "created"
        assert (stranger["managed"], stranger["driver"], stranger["draining"], stranger["ready"]) == (
            False,
            None,
            False,
            False,
        )
        assert cached is not None and len(cached) == len(engines)
        created[0].remove(force=True)
        created.pop(0)
        assert f"stranger-{suffix}" not in {engine["name"] for engine in source()}  # refreshed after 10 s
    finally:
        for container in created:
            container.remove(force=True)
