"""Fixtures every end-to-end module uses: one devserver and one tagged stand-in image per module, a
container name prefix and a node id per test (containers with the prefix are removed afterwards)."""

from __future__ import annotations

import itertools
import secrets
from collections.abc import Iterator
from typing import Any

import pytest

from ansible_collections.meridian.node.tests.devserver.devserver_process import DevServer, running
from ansible_collections.meridian.node.tests.support.e2e_env import remove_containers, standin_vllm
from ansible_collections.meridian.node.tests.support.standin_image import LocalImage

_names = itertools.count(1)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevServer]:
    with running(tmp_path_factory.mktemp("devserver") / "data") as started:
        yield started


@pytest.fixture(scope="module")
def image(docker_client: Any, standin_base_image: LocalImage) -> Iterator[LocalImage]:
    with standin_vllm(docker_client, standin_base_image) as tagged:
        yield tagged


@pytest.fixture
def prefix(docker_client: Any) -> Iterator[str]:
    name = f"mn-e2e-{secrets.token_hex(3)}"
    yield name
    remove_containers(docker_client, [name])


@pytest.fixture
def node_id() -> str:
    return f"e2e-node-{next(_names)}-{secrets.token_hex(2)}"
