"""The fake pynvml (tests/support/fakes/pynvml.py), loaded once per module and reset after each test; and
``gpu_count``, the real NVML's (tests/support/real_nvml.py), for the tests that need a real GPU."""

from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType

import pytest

from ansible_collections.meridian.node.tests.support.fake_nvml import load_fake_pynvml
from ansible_collections.meridian.node.tests.support.real_nvml import gpu_count  # noqa: F401


@pytest.fixture(scope="module")
def fake_module() -> ModuleType:
    return load_fake_pynvml()


@pytest.fixture
def fake(fake_module: ModuleType) -> Iterator[ModuleType]:
    yield fake_module
    fake_module.use_scenario(None)
