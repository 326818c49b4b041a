"""gpu_facts against the real NVML: runs only where an NVIDIA GPU and driver are present.

Elsewhere every test is skipped with the NVML error that says why (usually
NVML_ERROR_LIBRARY_NOT_FOUND: no driver installed).
"""

import csv
import io
import shutil
import subprocess
from typing import Any

import pytest

from ansible_collections.meridian.node.plugins.module_utils.contracts import GpuFacts
from ansible_collections.meridian.node.plugins.module_utils.gpu.facts import collect_gpu_facts

pytestmark = pytest.mark.gpu

pynvml = pytest.importorskip("pynvml", reason="nvidia-ml-py is not installed")


@pytest.fixture(scope="module")
def facts(gpu_count: int) -> dict[str, Any]:
    return collect_gpu_facts()


def nvidia_smi(*fields: str) -> list[dict[str, str]]:
    if shutil.which("nvidia-smi") is None:
        pytest.skip("nvidia-smi is not on PATH")
    proc = subprocess.run(
        ["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return [
        dict(zip(fields, (value.strip() for value in row), strict=True))
        for row in csv.reader(io.StringIO(proc.stdout))
        if row
    ]


def test_real_facts_validate_and_are_complete(facts: dict[str, Any], gpu_count: int) -> None:
    GpuFacts.model_validate(facts)
    assert facts["nvml_available"] is True
    assert facts["count"] == gpu_count == len(facts["gpus"])
    assert facts["driver_version"]
    assert facts["cuda_driver_version"]
    for gpu in facts["gpus"]:
        assert gpu["error"] is None, gpu
        assert gpu["uuid"].startswith("GPU-")
        memory = gpu["memory"]
        assert memory["total_mib"] > 0
        # Newer drivers keep some memory reserved, so used + free can fall short of total.
        assert memory["used_mib"] + memory["free_mib"] <= memory["total_mib"]
        assert gpu["temperature_c"] is None or 0 < gpu["temperature_c"] < 120


def test_real_facts_match_nvidia_smi(facts: dict[str, Any]) -> None:
    smi = nvidia_smi("index", "uuid", "name", "pci.bus_id", "memory.total", "driver_version", "mig.mode.current")

    assert len(smi) == facts["count"]
    for row, gpu in zip(smi, facts["gpus"], strict=True):
        assert int(row["index"]) == gpu["index"]
        assert row["uuid"] == gpu["uuid"]
        assert row["name"] == gpu["name"]
        assert row["pci.bus_id"].upper() == gpu["pci_bus_id"].upper()
        assert int(row["memory.total"]) == gpu["memory"]["total_mib"]
        assert row["driver_version"] == facts["driver_version"]
        expected_mig = {"Enabled": True, "Disabled": False}.get(row["mig.mode.current"])
        assert gpu["mig_mode"] is expected_mig


def test_real_nvml_is_shut_down_after_a_read(facts: dict[str, Any]) -> None:
    # Only this test process uses NVML, so after the read no session may be left open.
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        pynvml.nvmlDeviceGetCount()
