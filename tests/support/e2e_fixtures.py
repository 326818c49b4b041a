"""Fixtures the tests that run stand-in engines on the real Docker Engine share (their conftest.py files
register them): the stand-in vLLM image tagged for the module, a container name prefix per test, and the
end-to-end tests' node.

``image`` is ``e2e_env.standin_vllm``: the stand-in vLLM engine image under ``E2E_REPOSITORY``, the tag removed
when the module's tests are done. ``prefix`` is a random name (``mn-test-...``) for the test's containers; every
container whose name or engine-instance label starts with it is removed afterwards, pass or fail. ``node`` is
the test's ``E2ENode`` (it needs the ``server`` and ``node_id`` fixtures of tests/support/devserver_fixtures.py).
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ansible_collections.meridian.node.tests.devserver.devserver_process import DevServer
from ansible_collections.meridian.node.tests.support.e2e_env import (
    E2ENode,
    make_e2e_node,
    remove_containers,
    standin_vllm,
)
from ansible_collections.meridian.node.tests.support.standin_image import LocalImage

__all__ = ["image", "node", "prefix"]


@pytest.fixture(scope="module")
def image(docker_client: Any, standin_base_image: LocalImage) -> Iterator[LocalImage]:
    """The stand-in vLLM image, tagged for this module under ``E2E_REPOSITORY`` (the tag removed afterwards)."""
    with standin_vllm(docker_client, standin_base_image) as tagged:
        yield tagged


@pytest.fixture
def prefix(docker_client: Any) -> Iterator[str]:
    """A random container name prefix for the test; what carries it is removed afterwards: a name or an
    instance label that starts with it, and a name that holds it anywhere (a test's look-alike such as
    ``x<prefix>-engine``: Docker's name filter matches substrings)."""
    name = f"mn-test-{secrets.token_hex(3)}"
    yield name
    remove_containers(docker_client, [name])
    for container in docker_client.containers.list(all=True, sparse=True, filters={"name": name}):
        container.remove(force=True)


@pytest.fixture
def node(server: DevServer, tmp_path: Path, node_id: str) -> E2ENode:
    """The test's node (``make_e2e_node`` under ``tmp_path/node``): enrolled with the module's devserver as
    ``node_id``, in mode managed-host, its policy letting it run the stand-in vLLM image."""
    return make_e2e_node(server, tmp_path / "node", node_id)
