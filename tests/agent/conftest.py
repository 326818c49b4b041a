"""Fixtures the agent tests share: one devserver per module and a node id per test (see
tests/support/devserver_fixtures.py), and ``fake``: the fake pynvml playing two healthy GPUs."""

from collections.abc import Iterator
from types import ModuleType

import pytest

from ansible_collections.meridian.node.tests.support.devserver_fixtures import (  # noqa: F401
    node_id,
    server,
)
from ansible_collections.meridian.node.tests.support.fake_nvml import load_fake_pynvml, two_healthy_gpus


@pytest.fixture
def fake() -> Iterator[ModuleType]:
    """The fake pynvml (tests/support/fakes/pynvml.py) playing ``two_healthy_gpus()``, its scenario cleared after
    the test. A test file that wants another scenario, or the fake put where the NVML seam looks, defines its own."""
    module = load_fake_pynvml()
    module.use_scenario(two_healthy_gpus())
    yield module
    module.use_scenario(None)
