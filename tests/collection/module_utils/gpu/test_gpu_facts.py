"""gpu_facts against the fake pynvml: every scenario in-process, and the real module run by Ansible.

The fake is the only stand-in (the hardware seam); collect_gpu_facts, the module, AnsiballZ and
Ansible are the real ones.
"""

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from ansible_collections.meridian.node.plugins.module_utils.contracts import GpuFacts
from ansible_collections.meridian.node.plugins.module_utils.gpu import nvml as seam
from ansible_collections.meridian.node.plugins.module_utils.gpu.facts import collect_gpu_facts
from ansible_collections.meridian.node.tests.support.public_api import assert_all_is_the_public_api

REPO = Path(__file__).resolve().parents[4]
FAKES = REPO / "tests" / "support" / "fakes"
VENV_BIN = REPO / ".venv" / "bin"
SWITCHES = {f"00000000:0{n}:00.0" for n in range(5, 9)}


def collect(fake: ModuleType, scenario: dict[str, Any] | str, **options: Any) -> dict[str, Any]:
    fake.use_scenario(scenario)
    facts = collect_gpu_facts(fake, machine_type_path=None, **options)
    GpuFacts.model_validate(facts)
    # Whatever happened in between, NVML was shut down again and no event set was left behind.
    assert fake.init_count() == 0
    assert fake.open_event_sets() == 0
    return facts


def test_eight_h100s_report_every_field(fake: ModuleType) -> None:
    facts = collect(fake, "eight-gpus")

    assert facts["nvml_available"] is True
    assert facts["reason"] is None
    assert facts["driver_version"] == "550.54.15"
    assert facts["cuda_driver_version"] == "12.4"
    assert facts["count"] == 8
    assert [gpu["index"] for gpu in facts["gpus"]] == list(range(8))
    first = facts["gpus"][0]
    assert first["uuid"] == "GPU-2f1b7c2e-8d3a-4c51-b0e6-1a9e4f7d3c01"
    assert first["name"] == "NVIDIA H100 80GB HBM3"
    assert first["pci_bus_id"] == "00000000:1B:00.0"
    assert first["memory"] == {"total_mib": 81559, "used_mib": 74722, "free_mib": 6837}
    assert (first["utilization_gpu_percent"], first["utilization_memory_percent"]) == (87, 41)
    assert first["temperature_c"] == 52
    assert first["power_draw_w"] == pytest.approx(612.345)
    assert first["power_limit_w"] == pytest.approx(700.0)
    assert (first["ecc_errors_corrected"], first["ecc_errors_uncorrected"]) == (0, 0)
    assert first["mig_mode"] is False
    assert first["mig_instances"] == []
    assert first["processes"] == [
        {"pid": 48110, "used_memory_mib": 74210},
        {"pid": 51877, "used_memory_mib": 512},
    ]
    assert [peer["link"] for peer in first["nvlink_peers"]] == list(range(18))
    assert {peer["peer_pci_bus_id"] for peer in first["nvlink_peers"]} == SWITCHES
    assert all(gpu["error"] is None for gpu in facts["gpus"])
    assert len({gpu["uuid"] for gpu in facts["gpus"]}) == 8


def test_nvlink_that_trained_down_is_not_a_peer(fake: ModuleType) -> None:
    gpu5 = collect(fake, "eight-gpus")["gpus"][5]

    links = [peer["link"] for peer in gpu5["nvlink_peers"]]
    assert len(links) == 17
    assert 7 not in links


def test_corrected_ecc_errors_and_idle_gpu_are_reported(fake: ModuleType) -> None:
    gpus = collect(fake, "eight-gpus")["gpus"]

    assert gpus[4]["ecc_errors_corrected"] == 3
    assert gpus[7]["processes"] == []
    assert gpus[7]["memory"]["used_mib"] == 0
    assert gpus[7]["utilization_gpu_percent"] == 0


def test_mig_instances_with_profiles_ids_memory_and_their_processes(fake: ModuleType) -> None:
    facts = collect(fake, "h100-mig")

    gpu = facts["gpus"][0]
    assert gpu["mig_mode"] is True
    assert gpu["mig_instances"] == [
        {
            "uuid": "MIG-4c7a1e92-0b3d-5f6e-8a21-9d0c3b7e5f41",
            "profile": "3g.40gb",
            "memory_mib": 40192,
            "gpu_instance_id": 2,
            "compute_instance_id": 0,
        },
        {
            "uuid": "MIG-8e2b5d03-7c1a-5e49-b6f0-2a8d4c1e9b52",
            "profile": "1g.10gb",
            "memory_mib": 9856,
            "gpu_instance_id": 9,
            "compute_instance_id": 0,
        },
        {
            "uuid": "MIG-1f9c3a64-2e8b-5d07-a3c5-6b0e9d2f4a63",
            "profile": "1g.10gb",
            "memory_mib": 9856,
            "gpu_instance_id": 10,
            "compute_instance_id": 0,
        },
        {
            "uuid": "MIG-a5d0e7b8-4f2c-5a13-9e6d-3c1b8f0a2d74",
            "profile": "1g.10gb",
            "memory_mib": 9856,
            "gpu_instance_id": 11,
            "compute_instance_id": 0,
        },
    ]
    # Processes come from the MIG devices; a footprint NVML cannot tell stays unknown, not zero.
    assert gpu["processes"] == [
        {"pid": 60211, "used_memory_mib": 30720},
        {"pid": 60342, "used_memory_mib": 7168},
        {"pid": 60417, "used_memory_mib": None},
    ]
    # Utilization is per instance in MIG mode: NOT_SUPPORTED on the parent, which is not an error.
    assert gpu["utilization_gpu_percent"] is None
    assert gpu["error"] is None
    # The parent handle is not asked for processes: unprivileged callers get NO_PERMISSION there.
    assert fake.calls["nvmlDeviceGetComputeRunningProcesses"] == 4
    # Slots 4-6 are empty (NOT_FOUND), and that is no error either.
    assert fake.calls["nvmlDeviceGetMigDeviceHandleByIndex"] == 7


def test_lost_gpu_is_listed_with_its_error_and_the_others_are_read(fake: ModuleType) -> None:
    facts = collect(fake, "gpu-lost")

    assert facts["count"] == 4
    lost = facts["gpus"][2]
    assert lost["error"] == "NVML_ERROR_GPU_IS_LOST while reading memory info"
    # What was read before it fell off the bus is kept.
    assert lost["uuid"] == "GPU-6e0a2c5d-93f1-4b27-a8e4-1d5c7b9f3e22"
    assert lost["pci_bus_id"] == "00000000:47:00.0"
    assert lost["memory"] == {"total_mib": None, "used_mib": None, "free_mib": None}
    assert lost["ecc_errors_uncorrected"] is None
    for index in (0, 1, 3):
        gpu = facts["gpus"][index]
        assert gpu["error"] is None
        assert gpu["memory"]["total_mib"] == 81920
        assert gpu["processes"] == [{"pid": 7001 + index, "used_memory_mib": 20480}]


def test_lost_gpu_is_not_asked_again(fake: ModuleType) -> None:
    collect(fake, "gpu-lost")

    # Three healthy GPUs read their temperature; the lost one is left alone after the loss.
    assert fake.calls["nvmlDeviceGetTemperature"] == 3
    assert fake.calls["nvmlDeviceGetComputeRunningProcesses"] == 3


def test_unsupported_features_are_null_not_errors(fake: ModuleType) -> None:
    gpu = collect(fake, "not-supported")["gpus"][0]

    assert gpu["name"] == "NVIDIA GeForce RTX 4090"
    assert gpu["memory"] == {"total_mib": 24564, "used_mib": 1123, "free_mib": 23441}
    assert gpu["power_draw_w"] == pytest.approx(24.567)
    assert gpu["power_limit_w"] is None
    assert gpu["ecc_errors_corrected"] is None
    assert gpu["ecc_errors_uncorrected"] is None
    assert gpu["mig_mode"] is None
    assert gpu["mig_instances"] == []
    assert gpu["nvlink_peers"] == []
    assert gpu["processes"] == [{"pid": 2231, "used_memory_mib": 998}]
    assert gpu["error"] is None


def test_gpu_without_nvlink_costs_one_nvlink_call(fake: ModuleType) -> None:
    collect(fake, "not-supported")

    assert fake.calls["nvmlDeviceGetNvLinkState"] == 1
    assert fake.calls["nvmlDeviceGetNvLinkRemotePciInfo"] == 0


def test_missing_driver_library_is_a_reason_not_a_crash(fake: ModuleType) -> None:
    facts = collect(fake, "no-library")

    assert facts["nvml_available"] is False
    assert "NVML_ERROR_LIBRARY_NOT_FOUND" in facts["reason"]
    assert "no NVIDIA driver is installed" in facts["reason"]
    assert (facts["count"], facts["gpus"]) == (0, [])
    # nvmlInit failed, so there is nothing to shut down.
    assert fake.calls["nvmlShutdown"] == 0


def test_unloaded_kernel_module_says_what_to_check(fake: ModuleType) -> None:
    facts = collect(fake, {"init_error": "NVML_ERROR_DRIVER_NOT_LOADED"})

    assert facts["nvml_available"] is False
    assert "NVML_ERROR_DRIVER_NOT_LOADED" in facts["reason"]
    assert "lsmod" in facts["reason"]


def test_zero_gpus_is_a_normal_answer(fake: ModuleType) -> None:
    facts = collect(fake, "zero-gpus")

    assert facts["nvml_available"] is True
    assert facts["driver_version"] == "550.54.15"
    assert (facts["count"], facts["gpus"]) == (0, [])
    assert fake.calls["nvmlShutdown"] == 1


def test_failing_enumeration_keeps_the_driver_version(fake: ModuleType) -> None:
    facts = collect(fake, {"driver_version": "535.161.08", "errors": {"nvmlDeviceGetCount": "NVML_ERROR_UNKNOWN"}})

    assert facts["nvml_available"] is False
    assert "nvmlDeviceGetCount failed with NVML_ERROR_UNKNOWN" in facts["reason"]
    assert facts["driver_version"] == "535.161.08"


def test_one_failing_field_is_named_and_the_rest_is_read(fake: ModuleType) -> None:
    scenario = fake.generate_scenario(2)
    scenario["gpus"][1]["errors"] = {"nvmlDeviceGetPowerUsage": "NVML_ERROR_UNKNOWN"}

    gpus = collect(fake, scenario)["gpus"]

    assert gpus[1]["error"] == "NVML_ERROR_UNKNOWN while reading power usage"
    assert gpus[1]["power_draw_w"] is None
    # Not a lost device: the reads after the failure still happen.
    assert gpus[1]["power_limit_w"] == pytest.approx(700.0)
    assert len(gpus[1]["nvlink_peers"]) == 18
    assert gpus[0]["error"] is None


def test_gpu_whose_handle_is_refused_is_still_listed(fake: ModuleType) -> None:
    scenario = fake.generate_scenario(3)
    scenario["gpus"][0]["errors"] = {"nvmlDeviceGetHandleByIndex": "NVML_ERROR_NO_PERMISSION"}

    gpus = collect(fake, scenario)["gpus"]

    assert [gpu["index"] for gpu in gpus] == [0, 1, 2]
    assert gpus[0]["error"] == "NVML_ERROR_NO_PERMISSION while reading the device handle"
    assert gpus[0]["uuid"] is None
    assert gpus[1]["uuid"] is not None


def test_mig_slot_error_other_than_empty_is_reported(fake: ModuleType) -> None:
    scenario = json.loads((FAKES / "nvml_scenarios" / "h100-mig.json").read_text())
    scenario["gpus"][0]["mig_devices"][1]["errors"] = {"nvmlDeviceGetUUID": "NVML_ERROR_UNKNOWN"}

    gpu = collect(fake, scenario)["gpus"][0]

    assert gpu["error"] == "NVML_ERROR_UNKNOWN while reading the UUID of MIG device 1"
    # An instance without a UUID cannot be addressed, so it is left out; the others stay.
    assert [instance["gpu_instance_id"] for instance in gpu["mig_instances"]] == [2, 10, 11]


def test_nvml_is_shut_down_when_a_read_crashes(fake: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(handle: Any) -> Any:
        raise RuntimeError("driver bug")

    monkeypatch.setattr(fake, "nvmlDeviceGetName", broken)
    fake.use_scenario("eight-gpus")

    with pytest.raises(RuntimeError, match="driver bug"):
        collect_gpu_facts(fake)
    assert fake.init_count() == 0


def test_processes_and_nvlink_can_be_skipped(fake: ModuleType) -> None:
    facts = collect(fake, "eight-gpus", processes=False, nvlink=False, health=False)

    assert all(gpu["processes"] == [] and gpu["nvlink_peers"] == [] for gpu in facts["gpus"])
    assert all(gpu["health"] is None for gpu in facts["gpus"])
    assert fake.calls["nvmlDeviceGetComputeRunningProcesses"] == 0
    assert fake.calls["nvmlDeviceGetNvLinkState"] == 0


def test_health_without_nvlink_peers_scans_the_link_states_only(fake: ModuleType) -> None:
    facts = collect(fake, "eight-gpus", processes=False, nvlink=False)

    assert all(gpu["nvlink_peers"] == [] for gpu in facts["gpus"])
    # The error counters need the trained links, so health scans their states (18 links, then the
    # INVALID_ARGUMENT past the last), but no peer is asked for.
    assert fake.calls["nvmlDeviceGetNvLinkState"] == 8 * 19
    assert fake.calls["nvmlDeviceGetNvLinkRemotePciInfo"] == 0
    assert facts["gpus"][0]["health"]["readings"]["nvlink_error_count"] == 0


def test_nvlink_peers_and_health_share_one_scan_of_the_link_states(fake: ModuleType) -> None:
    collect(fake, "eight-gpus")

    assert fake.calls["nvmlDeviceGetNvLinkState"] == 8 * 19
    # GPU 5's link 7 is down: its error counters are not read.
    assert fake.calls["nvmlDeviceGetNvLinkErrorCounter"] == (8 * 18 - 1) * 4


def test_sixty_four_generated_gpus_are_distinct_and_valid(fake: ModuleType) -> None:
    facts = collect(fake, fake.generate_scenario(64))

    assert facts["count"] == 64
    assert len({gpu["uuid"] for gpu in facts["gpus"]}) == 64
    assert len({gpu["pci_bus_id"] for gpu in facts["gpus"]}) == 64
    assert all(gpu["error"] is None for gpu in facts["gpus"])


def test_missing_pynvml_package_is_a_reason_not_a_crash() -> None:
    # A fresh interpreter where 'import pynvml' fails, as on a host without nvidia-ml-py.
    code = (
        "import json, sys\n"
        "sys.modules['pynvml'] = None\n"
        "from ansible_collections.meridian.node.plugins.module_utils.gpu import facts as gpu_inventory, nvml\n"
        "assert nvml.PYNVML_IMPORT_ERROR\n"
        "print(json.dumps(gpu_inventory.collect_gpu_facts()))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO / ".build" / "collections")}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr

    facts = json.loads(proc.stdout)
    assert facts["nvml_available"] is False
    assert "nvidia-ml-py" in facts["reason"]
    assert "pip install nvidia-ml-py" in facts["reason"]


@pytest.mark.parametrize(
    ("value", "text"), [(12040, "12.4"), (11080, "11.8"), (12020, "12.2"), (13000, "13.0"), (0, None)]
)
def test_cuda_version_text(value: int, text: str | None) -> None:
    assert seam.cuda_version_text(value) == text


def test_all_is_the_public_api() -> None:
    from ansible_collections.meridian.node.plugins.module_utils.gpu import facts as gpu_inventory

    assert_all_is_the_public_api(seam)
    assert_all_is_the_public_api(gpu_inventory)


def test_fake_shares_the_real_constants_and_error_classes(fake: ModuleType) -> None:
    import pynvml as real

    assert fake.NVML_ERROR_GPU_IS_LOST == real.NVML_ERROR_GPU_IS_LOST
    assert fake.NVML_NVLINK_MAX_LINKS == real.NVML_NVLINK_MAX_LINKS
    assert fake.NVMLError_GpuIsLost.__name__ == "NVMLError_GpuIsLost"
    lost = fake.NVMLError(fake.NVML_ERROR_GPU_IS_LOST)
    assert isinstance(lost, fake.NVMLError_GpuIsLost)
    assert seam.error_name(fake, lost) == "NVML_ERROR_GPU_IS_LOST"


def test_fake_functions_match_the_real_signatures(fake: ModuleType) -> None:
    import pynvml as real

    faked = [name for name, value in vars(fake).items() if name.startswith("nvml") and inspect.isfunction(value)]
    assert "nvmlDeviceGetNvLinkRemotePciInfo" in faked
    for name in faked:
        assert hasattr(real, name), f"{name} is not a pynvml function"
        assert list(inspect.signature(getattr(fake, name)).parameters) == list(
            inspect.signature(getattr(real, name)).parameters
        ), name


# --- the real module, run by Ansible ---------------------------------------------------------------


def ansible_env(scenario: str) -> dict[str, str]:
    return {
        **os.environ,
        "ANSIBLE_COLLECTIONS_PATH": str(REPO / ".build" / "collections"),
        "ANSIBLE_PYTHON_INTERPRETER": str(VENV_BIN / "python"),
        "ANSIBLE_NOCOLOR": "1",
        "ANSIBLE_DEPRECATION_WARNINGS": "0",
        "PYTHONPATH": str(FAKES),
        "MERIDIAN_FAKE_NVML_SCENARIO": scenario,
    }


def ansible_command(*extra: str) -> list[str]:
    ansible = str(VENV_BIN / "ansible")
    return [ansible, "localhost", "-c", "local", "-i", "localhost,", "-m", "meridian.node.gpu_facts", *extra]


def run_module(scenario: str, *extra: str) -> dict[str, Any]:
    proc = subprocess.run(
        ansible_command(*extra),
        env=ansible_env(scenario),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # The default ad-hoc output: "localhost | SUCCESS => {<the result as JSON>}".
    status, _, body = proc.stdout.partition(" => ")
    assert status.strip() == "localhost | SUCCESS", proc.stdout
    result: dict[str, Any] = json.loads(body)
    return result


def test_module_reports_eight_gpus_through_ansible() -> None:
    result = run_module("eight-gpus")

    assert result["changed"] is False
    facts = result["ansible_facts"]["meridian_gpus"]
    GpuFacts.model_validate(facts)
    assert facts["count"] == 8
    assert facts["gpus"][0]["memory"] == {"total_mib": 81559, "used_mib": 74722, "free_mib": 6837}
    assert len(facts["gpus"][0]["nvlink_peers"]) == 18


def without_read_times(facts: dict[str, Any]) -> dict[str, Any]:
    """The facts less what each read stamps with its own time (when a verdict began)."""
    gpus = [{**gpu, "health": {**gpu["health"], "since": None}} for gpu in facts["meridian_gpus"]["gpus"]]
    return {"meridian_gpus": {**facts["meridian_gpus"], "gpus": gpus}}


def test_module_in_check_mode_reports_the_same_facts() -> None:
    checked = run_module("eight-gpus", "--check")
    applied = run_module("eight-gpus")

    assert checked["changed"] is False
    assert without_read_times(checked["ansible_facts"]) == without_read_times(applied["ansible_facts"])


def test_module_reports_lost_gpu_through_ansible() -> None:
    facts = run_module("gpu-lost", "--check")["ansible_facts"]["meridian_gpus"]

    assert [gpu["error"] for gpu in facts["gpus"]] == [
        None,
        None,
        "NVML_ERROR_GPU_IS_LOST while reading memory info",
        None,
    ]


def test_module_without_driver_library_succeeds_with_reason() -> None:
    result = run_module("no-library")

    facts = result["ansible_facts"]["meridian_gpus"]
    assert result["changed"] is False
    assert facts["nvml_available"] is False
    assert "NVML_ERROR_LIBRARY_NOT_FOUND" in facts["reason"]


def test_module_reports_health_and_labels_through_ansible() -> None:
    facts = run_module("wedged-reset")["ansible_facts"]["meridian_gpus"]

    GpuFacts.model_validate(facts)
    readings = facts["gpus"][0]["health"]["readings"]
    assert readings["recovery_action"] == "reset"
    assert readings["read_errors"] == []
    assert facts["labels"]["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3"


def test_module_option_switches_off_health() -> None:
    facts = run_module("wedged-reset", "-a", "gather_health=false")["ansible_facts"]["meridian_gpus"]

    assert facts["gpus"][0]["health"] is None
    # The feature facts are not health: they stay.
    assert facts["gpus"][0]["compute_capability"] == "9.0"


def test_module_options_switch_off_processes_and_nvlink() -> None:
    facts = run_module("eight-gpus", "-a", "gather_processes=false gather_nvlink=false")["ansible_facts"][
        "meridian_gpus"
    ]

    assert facts["gpus"][0]["processes"] == []
    assert facts["gpus"][0]["nvlink_peers"] == []
    assert facts["gpus"][0]["uuid"] == "GPU-2f1b7c2e-8d3a-4c51-b0e6-1a9e4f7d3c01"


def test_module_rejects_unknown_option() -> None:
    proc = subprocess.run(
        ansible_command("-a", "gather_everything=true"),
        env=ansible_env("eight-gpus"),
        capture_output=True,
        text=True,
        timeout=180,
    )

    assert proc.returncode != 0
    assert "gather_everything" in proc.stdout


def test_ansible_doc_renders_the_module() -> None:
    proc = subprocess.run(
        [str(VENV_BIN / "ansible-doc"), "meridian.node.gpu_facts"],
        env=ansible_env("zero-gpus"),
        capture_output=True,
        text=True,
        timeout=120,
    )

    assert proc.returncode == 0, proc.stderr
    assert "gather_processes" in proc.stdout
    assert "gather_health" in proc.stdout
    assert "idempotent" in proc.stdout
    assert "[WARNING]" not in proc.stderr
