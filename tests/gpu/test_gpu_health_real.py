"""GPU health against the real NVML: runs only where an NVIDIA GPU and driver are present.

    .venv/bin/pytest -q -m gpu -rA tests/gpu

Elsewhere every test is skipped with the NVML error that says why (usually NVML_ERROR_LIBRARY_NOT_FOUND:
no driver installed). On a healthy card every GPU gets a verdict and none is ``unknown``; the verdicts are
printed (``-rA`` shows them) for the note of whoever ran it.
"""

from datetime import UTC, datetime
from typing import Any

import pytest

from ansible_collections.meridian.node.plugins.module_utils.contracts import GpuFacts
from ansible_collections.meridian.node.plugins.module_utils.gpu.facts import collect_gpu_facts
from ansible_collections.meridian.node.plugins.module_utils.gpu.xid_events import XidWatch

pytestmark = pytest.mark.gpu

pynvml = pytest.importorskip("pynvml", reason="nvidia-ml-py is not installed")


@pytest.fixture(scope="module")
def facts(gpu_count: int) -> dict[str, Any]:
    read = collect_gpu_facts()
    for gpu in read["gpus"]:
        health = gpu["health"] or {}
        print(
            f"GPU {gpu['index']} {gpu['name']} {gpu['uuid']}: {health.get('verdict')} {health.get('reasons')} "
            f"readings={health.get('readings')}"
        )
    print(f"labels={read['labels']}")
    return read


def test_every_gpu_gets_a_verdict_and_none_is_unknown(facts: dict[str, Any], gpu_count: int) -> None:
    GpuFacts.model_validate(facts)
    assert len(facts["gpus"]) == gpu_count
    for gpu in facts["gpus"]:
        health = gpu["health"]
        assert health is not None, gpu
        assert health["verdict"] in ("healthy", "degraded", "unhealthy"), health
        # A healthy card answers every health read it supports: any other error would be a finding.
        assert health["readings"]["read_errors"] == [], health


def test_real_features_and_labels(facts: dict[str, Any], gpu_count: int) -> None:
    for gpu in facts["gpus"]:
        assert gpu["compute_capability"], gpu
        assert gpu["architecture"] not in (None, "undefined"), gpu
        assert gpu["mig_capable"] in (True, False), gpu
        assert gpu["pcie"]["max_generation"], gpu
    labels = facts["labels"]
    assert labels["nvidia.com/gpu.product"]
    assert labels["nvidia.com/gpu.machine"]
    assert facts["mig_strategy"] in ("none", "single", "mixed")


def test_xid_watch_opens_registers_and_closes_on_real_nvml(gpu_count: int) -> None:
    now = datetime.now(UTC)
    with XidWatch() as watch:
        first = collect_gpu_facts(processes=False, nvlink=False, xids=watch, now=now)
        assert watch.open
        second = collect_gpu_facts(processes=False, nvlink=False, xids=watch, now=now)
    for read in (first, second):
        for gpu in read["gpus"]:
            assert gpu["health"]["readings"]["read_errors"] == [], gpu["health"]
    # The watch gave back its own initialisation: nothing is left open.
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        pynvml.nvmlDeviceGetCount()
