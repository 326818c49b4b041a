"""The gate of the tests that need a real NVIDIA driver (marker ``gpu``): skip, saying why, where there is none.

``gpu_count`` is that gate as a module-scoped fixture (the conftest.py files of tests/gpu and
tests/collection/module_utils/gpu register it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

FAKES = Path(__file__).resolve().parent / "fakes"


def real_gpu_count(pynvml: Any) -> int:
    """How many GPUs the real NVML sees; skips the test where it is the fake, fails to start or sees none."""
    if Path(pynvml.__file__).resolve().parent == FAKES:
        pytest.skip("pynvml resolves to the fake (tests/support/fakes is on PYTHONPATH); these tests need the real one")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        pytest.skip(f"no usable NVIDIA driver: nvmlInit failed: {exc}")
    try:
        count = int(pynvml.nvmlDeviceGetCount())
    finally:
        pynvml.nvmlShutdown()
    if count == 0:
        pytest.skip("NVML works but sees no GPU")
    return count


@pytest.fixture(scope="module")
def gpu_count() -> int:
    """``real_gpu_count`` of the real pynvml, once per test module; skips where nvidia-ml-py is not installed."""
    pynvml = pytest.importorskip("pynvml", reason="nvidia-ml-py is not installed")
    return real_gpu_count(pynvml)
