"""GPU feature discovery's vocabulary: per-GPU features, machine type, MIG strategy and the nvidia.com labels.

Each NVML scenario has a golden label file in ``golden_labels/``: what GFD (NVIDIA/k8s-device-plugin
``internal/lm``, default configuration) would write for that host. After a deliberate change, rewrite them
with::

    MERIDIAN_REGENERATE_GOLDEN_LABELS=1 .venv/bin/pytest -q tests/collection/module_utils/gpu/test_gpu_features.py

and read the diff before committing it.
"""

import json
import os
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from ansible_collections.meridian.node.plugins.module_utils.contracts import GpuFacts
from ansible_collections.meridian.node.plugins.module_utils.gpu import feature_labels
from ansible_collections.meridian.node.plugins.module_utils.gpu.facts import collect_gpu_facts
from ansible_collections.meridian.node.plugins.module_utils.gpu.feature_labels import (
    architecture_family,
    gfd_labels,
    mig_strategy,
    read_machine_type,
    sanitise,
)
from ansible_collections.meridian.node.tests.support.public_api import assert_all_is_the_public_api

GOLDEN = Path(__file__).resolve().parent / "golden_labels"
SCENARIOS = Path(__file__).resolve().parents[3] / "support" / "fakes" / "nvml_scenarios"
REGENERATE = os.environ.get("MERIDIAN_REGENERATE_GOLDEN_LABELS") == "1"


def read(fake: ModuleType, scenario: dict[str, Any] | str, dmi: Path | None = None, **options: Any) -> dict[str, Any]:
    fake.use_scenario(scenario)
    facts = collect_gpu_facts(fake, machine_type_path=str(dmi) if dmi else None, **options)
    GpuFacts.model_validate(facts)
    return facts


def test_h100_features(fake: ModuleType) -> None:
    gpu = read(fake, "eight-gpus")["gpus"][0]

    assert gpu["compute_capability"] == "9.0"
    assert gpu["architecture"] == "hopper"
    assert gpu["mig_capable"] is True
    assert gpu["serial"] == "1652823054401"
    assert gpu["persistence_mode"] is True
    assert gpu["clocks"] == {
        "graphics_mhz": 1980,
        "sm_mhz": 1980,
        "memory_mhz": 2619,
        "max_graphics_mhz": 1980,
        "max_sm_mhz": 1980,
        "max_memory_mhz": 2619,
    }
    assert gpu["pcie"] == {"generation": 5, "width": 16, "max_generation": 5, "max_width": 16}
    assert gpu["cordoned"] is False


def test_geforce_features_without_serial_or_mig(fake: ModuleType) -> None:
    gpu = read(fake, "not-supported")["gpus"][0]

    assert (gpu["compute_capability"], gpu["architecture"]) == ("8.9", "ada-lovelace")
    # NOT_SUPPORTED from nvmlDeviceGetMigMode is GFD's "not MIG-capable", not an unknown.
    assert gpu["mig_capable"] is False
    assert gpu["serial"] is None
    assert gpu["persistence_mode"] is False
    assert gpu["pcie"] == {"generation": 1, "width": 16, "max_generation": 4, "max_width": 16}
    assert gpu["error"] is None


def test_failing_feature_read_is_named_in_the_gpu_error(fake: ModuleType) -> None:
    scenario = fake.generate_scenario(1)
    scenario["gpus"][0]["errors"] = {
        "nvmlDeviceGetSerial": "NVML_ERROR_UNKNOWN",
        "nvmlDeviceGetMaxPcieLinkWidth": "NVML_ERROR_NO_PERMISSION",
    }

    gpu = read(fake, scenario)["gpus"][0]

    assert gpu["error"] == (
        "NVML_ERROR_UNKNOWN while reading the serial number; "
        "NVML_ERROR_NO_PERMISSION while reading the maximum PCIe link width"
    )
    assert gpu["serial"] is None
    assert gpu["pcie"]["max_width"] is None
    assert gpu["pcie"]["width"] == 16


def test_mig_capability_unknown_when_mig_mode_fails_otherwise(fake: ModuleType) -> None:
    scenario = fake.generate_scenario(1)
    scenario["gpus"][0]["errors"] = {"nvmlDeviceGetMigMode": "NVML_ERROR_UNKNOWN"}

    facts = read(fake, scenario)

    assert facts["gpus"][0]["mig_capable"] is None
    assert facts["labels"]["nvidia.com/mig.capable"] == "false"


@pytest.mark.parametrize(
    ("capability", "family"),
    [
        ((1, 3), "tesla"),
        ((2, 1), "fermi"),
        ((3, 7), "kepler"),
        ((5, 2), "maxwell"),
        ((6, 0), "pascal"),
        ((7, 0), "volta"),
        ((7, 2), "volta"),
        ((7, 5), "turing"),
        ((8, 0), "ampere"),
        ((8, 6), "ampere"),
        ((8, 9), "ada-lovelace"),
        ((9, 0), "hopper"),
        ((10, 0), "blackwell"),
        ((12, 0), "blackwell"),
        ((13, 0), "rubin"),
        ((4, 0), "undefined"),
        ((11, 0), "undefined"),
    ],
)
def test_architecture_family_as_gfd_maps_compute_capability(capability: tuple[int, int], family: str) -> None:
    assert architecture_family(*capability) == family


@pytest.mark.parametrize(
    ("raw", "clean"),
    [
        ("NVIDIA H100 80GB HBM3", "NVIDIA-H100-80GB-HBM3"),
        ("  DGX   H100 ", "DGX-H100"),
        ("ProLiant DL380 Gen11 (P52534-B21)", "ProLiant-DL380-Gen11-P52534-B21"),
        ("Tesla V100-SXM2-32GB", "Tesla-V100-SXM2-32GB"),
        ("a/b:c_d.e", "abc_d.e"),
        ("", ""),
    ],
)
def test_sanitise_as_gfd(raw: str, clean: str) -> None:
    assert sanitise(raw) == clean


def test_machine_type_is_the_sanitised_dmi_product_name(tmp_path: Path) -> None:
    dmi = tmp_path / "product_name"
    dmi.write_text("PowerEdge XE9680\n")

    assert read_machine_type(str(dmi)) == "PowerEdge-XE9680"


def test_machine_type_unreadable_is_none_and_labelled_unknown(fake: ModuleType, tmp_path: Path) -> None:
    facts = read(fake, "h100-healthy", tmp_path / "missing")

    assert facts["machine_type"] is None
    assert facts["labels"]["nvidia.com/gpu.machine"] == "unknown"


def test_machine_type_that_is_no_dmi_string_is_refused(tmp_path: Path) -> None:
    dmi = tmp_path / "product_name"
    dmi.write_bytes(b"x" * 5000)

    assert read_machine_type(str(dmi)) is None
    assert read_machine_type(None) is None


def test_machine_type_is_reported_without_nvml(fake: ModuleType, tmp_path: Path) -> None:
    dmi = tmp_path / "product_name"
    dmi.write_text("DGX H100\n")

    facts = read(fake, "no-library", dmi)

    assert (facts["machine_type"], facts["mig_strategy"], facts["labels"]) == ("DGX-H100", None, {})


def gpu(index: int, mig: bool | None, *profiles: str, name: str = "NVIDIA H100 80GB HBM3") -> dict[str, Any]:
    instances = [{"uuid": f"MIG-{index}-{slot}", "profile": profile} for slot, profile in enumerate(profiles)]
    return {"index": index, "name": name, "mig_mode": mig, "mig_instances": instances}


@pytest.mark.parametrize(
    ("gpus", "strategy"),
    [
        ([], "none"),
        ([gpu(0, False), gpu(1, None)], "none"),
        ([gpu(0, True, "1g.10gb", "1g.10gb"), gpu(1, True, "1g.10gb")], "single"),
        ([gpu(0, True, "1g.10gb", "2g.20gb")], "mixed"),
        ([gpu(0, True, "1g.10gb"), gpu(1, False)], "mixed"),
        # MIG on but no MIG device yet: GFD's single strategy would write MIG-INVALID.
        ([gpu(0, True, "1g.10gb"), gpu(1, True)], "mixed"),
    ],
    ids=["no-gpus", "no-mig", "one-profile", "two-profiles", "mig-and-full", "empty-mig-gpu"],
)
def test_mig_strategy_derived_from_what_nvml_shows(gpus: list[dict[str, Any]], strategy: str) -> None:
    assert mig_strategy(gpus) == strategy


def test_several_products_label_the_lowest_index_gpu_product(fake: ModuleType) -> None:
    scenario = fake.generate_scenario(3)
    scenario["gpus"][0]["name"] = "NVIDIA H200"
    scenario["gpus"][0]["memory"]["total"] = 150754820096

    labels = read(fake, scenario)["labels"]

    # GFD leaves the winner to Go's map order; we name GPU 0's product, with its count and memory.
    assert labels["nvidia.com/gpu.product"] == "NVIDIA-H200"
    assert labels["nvidia.com/gpu.count"] == "1"
    assert labels["nvidia.com/gpu.memory"] == "143771"


def test_driver_version_with_two_parts_has_an_empty_revision() -> None:
    facts = {"nvml_available": True, "driver_version": "535.86", "cuda_driver_version": "12.2", "gpus": [gpu(0, False)]}

    labels = gfd_labels(facts)

    assert labels["nvidia.com/cuda.driver.rev"] == ""
    assert labels["nvidia.com/cuda.driver-version.full"] == "535.86"
    assert labels["nvidia.com/cuda.runtime-version.full"] == "12.2"


def test_driver_version_gfd_would_refuse_gives_no_driver_labels() -> None:
    facts = {"nvml_available": True, "driver_version": "1.2.3.4", "cuda_driver_version": None, "gpus": [gpu(0, False)]}

    labels = gfd_labels(facts)

    assert not any(key.startswith("nvidia.com/cuda.") for key in labels)
    assert labels["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3"


def test_gpu_without_a_name_is_not_counted() -> None:
    unnamed = {**gpu(1, False), "name": None}
    facts = {"nvml_available": True, "driver_version": "550.54.15", "gpus": [gpu(0, False), unnamed]}

    assert gfd_labels(facts)["nvidia.com/gpu.count"] == "1"


def scenario_names() -> list[str]:
    return sorted(path.stem for path in SCENARIOS.glob("*.json"))


@pytest.mark.parametrize("scenario", scenario_names())
def test_labels_match_the_golden_file(fake: ModuleType, scenario: str, tmp_path: Path) -> None:
    spec = json.loads((SCENARIOS / f"{scenario}.json").read_text())
    dmi = tmp_path / "product_name"
    if "dmi_product_name" in spec:
        dmi.write_text(spec["dmi_product_name"] + "\n")

    labels = read(fake, scenario, dmi)["labels"]

    golden = GOLDEN / f"{scenario}.json"
    if REGENERATE:
        golden.write_text(json.dumps(labels, indent=2, sort_keys=True) + "\n")
    assert labels == json.loads(golden.read_text())


def test_every_golden_file_has_its_scenario() -> None:
    assert sorted(path.stem for path in GOLDEN.glob("*.json")) == scenario_names()


def test_all_is_the_public_api() -> None:
    assert_all_is_the_public_api(feature_labels)
