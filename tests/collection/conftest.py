"""The fixtures the collection's tests with real engines share: a random container prefix (its containers
removed afterwards, pass or fail), the stand-in vLLM image, and a host (policy, store and state dir) in the
test's tmp_path."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ansible_collections.meridian.node.tests.support.e2e_fixtures import prefix  # noqa: F401
from ansible_collections.meridian.node.tests.support.engine_harness import SERVER, Host
from ansible_collections.meridian.node.tests.support.standin_image import LocalImage, ensure_engine_image


@pytest.fixture(scope="module")
def vllm(docker_client: Any, standin_base_image: LocalImage) -> LocalImage:
    return ensure_engine_image(docker_client, standin_base_image, SERVER, engine="vllm")


@pytest.fixture
def host(tmp_path: Path, docker_client: Any) -> Host:
    return Host(tmp_path, docker_client)
