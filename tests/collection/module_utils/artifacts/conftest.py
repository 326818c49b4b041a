"""What the artifact store's tests share: a real artifact server on 127.0.0.1, a clock, a store in tmp."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from ansible_collections.meridian.node.plugins.module_utils.artifacts.store import Store
from ansible_collections.meridian.node.tests.collection.module_utils.artifacts.test_artifact_store import Clock
from ansible_collections.meridian.node.tests.support.http_fixture import ArtifactServer, running_artifact_server


@pytest.fixture
def server() -> Iterator[ArtifactServer]:
    with running_artifact_server() as instance:
        yield instance


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def store(tmp_path: Path, clock: Clock) -> Store:
    return Store(str(tmp_path / "store"), clock=clock)
