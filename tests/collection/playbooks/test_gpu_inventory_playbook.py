"""playbooks/gpu_inventory.yml run by ansible-playbook against local hosts that see different GPUs.

Each host gets its own interpreter wrapper that points the fake pynvml at that host's scenario, so
one run covers a healthy HGX host, a MIG host, a host with a lost GPU, a host without a driver and a
host whose module cannot run at all.
"""

import json
import os
import re
import stat
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from ansible_collections.meridian.node.plugins.module_utils.contracts import GpuFacts

REPO = Path(__file__).resolve().parents[3]
FAKES = REPO / "tests" / "support" / "fakes"
VENV_BIN = REPO / ".venv" / "bin"
PLAYBOOK = REPO / "playbooks" / "gpu_inventory.yml"
HOSTS = {"node-a": "eight-gpus", "node-b": "h100-mig", "node-c": "gpu-lost", "node-d": "no-library"}


@dataclass
class Run:
    returncode: int
    output: str
    report: Path


def make_inventory(directory: Path) -> Path:
    lines = ["[gpu_hosts]"]
    for host, scenario in HOSTS.items():
        wrapper = directory / f"python-{host}"
        wrapper.write_text(
            f'#!/bin/sh\nMERIDIAN_FAKE_NVML_SCENARIO={scenario} PYTHONPATH={FAKES} exec {VENV_BIN / "python"} "$@"\n'
        )
        wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
        lines.append(f"{host} ansible_connection=local ansible_python_interpreter={wrapper}")
    # A host whose Python is missing: its facts cannot be read, the report must still be written.
    lines.append(f"node-e ansible_connection=local ansible_python_interpreter={directory}/no-such-python")
    inventory = directory / "inventory.ini"
    inventory.write_text("\n".join(lines) + "\n")
    return inventory


def run_playbook(inventory: Path, report: Path, *extra: str) -> Run:
    env = {
        **os.environ,
        "ANSIBLE_COLLECTIONS_PATH": str(REPO / ".build" / "collections"),
        "ANSIBLE_NOCOLOR": "1",
        "ANSIBLE_DEPRECATION_WARNINGS": "0",
    }
    env.pop("ANSIBLE_PYTHON_INTERPRETER", None)
    proc = subprocess.run(
        [str(VENV_BIN / "ansible-playbook"), "-i", str(inventory), str(PLAYBOOK), "-e", f"report_dir={report}", *extra],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return Run(proc.returncode, proc.stdout + proc.stderr, report)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Run:
    directory = tmp_path_factory.mktemp("fleet")
    return run_playbook(make_inventory(directory), directory / "report")


def recap(output: str, host: str) -> dict[str, int]:
    match = re.search(rf"^{re.escape(host)}\s+:\s+(.*)$", output, re.MULTILINE)
    assert match, output
    return {key: int(value) for key, value in re.findall(r"(\w+)=(\d+)", match.group(1))}


def rows(report: Path, host: str) -> list[str]:
    return [line for line in (report / "fleet.txt").read_text().splitlines() if line.startswith(host + " ")]


def test_failed_host_does_not_stop_the_report(fleet: Run) -> None:
    # ansible-playbook exits 2 because node-e failed; everyone else was read and reported.
    assert fleet.returncode == 2, fleet.output
    assert recap(fleet.output, "node-e")["failed"] == 1
    assert recap(fleet.output, "node-a")["failed"] == 0
    (failed,) = rows(fleet.report, "node-e")
    assert failed.split() == ["node-e", *["-"] * 8, "unreachable", "or", "failed:", "no", "facts"]


def test_fleet_json_holds_every_reachable_hosts_facts(fleet: Run) -> None:
    fleet_json: dict[str, Any] = json.loads((fleet.report / "fleet.json").read_text())

    assert sorted(fleet_json) == ["node-a", "node-b", "node-c", "node-d"]
    for facts in fleet_json.values():
        GpuFacts.model_validate(facts)
    assert fleet_json["node-a"]["count"] == 8
    assert fleet_json["node-b"]["gpus"][0]["mig_mode"] is True
    assert fleet_json["node-c"]["gpus"][2]["error"] == "NVML_ERROR_GPU_IS_LOST while reading memory info"
    assert fleet_json["node-d"]["nvml_available"] is False
    assert oct((fleet.report / "fleet.json").stat().st_mode & 0o777) == "0o644"


def test_fleet_txt_has_one_row_per_gpu_with_readable_values(fleet: Run) -> None:
    text = (fleet.report / "fleet.txt").read_text()
    header = text.splitlines()[0].split()

    assert header == [
        "HOST", "GPU", "NAME", "MEMORY", "USED/TOTAL", "UTIL", "TEMP", "POWER", "MIG", "HEALTH", "ERROR/REASONS",
    ]  # fmt: skip
    node_a = rows(fleet.report, "node-a")
    assert len(node_a) == 8
    assert node_a[0].split() == [
        "node-a", "0", "NVIDIA", "H100", "80GB", "HBM3", "74722/81559", "MiB", "87%", "52C", "612/700W", "off",
        "healthy",
    ]  # fmt: skip
    assert node_a[7].split()[6:11] == ["0/81559", "MiB", "0%", "33C", "71/700W"]


def test_fleet_txt_shows_mig_profiles_lost_gpu_and_missing_driver(fleet: Run) -> None:
    (mig_row,) = rows(fleet.report, "node-b")
    assert "on: 3g.40gb,1g.10gb,1g.10gb,1g.10gb" in mig_row
    # Utilization is per MIG instance, so the GPU's column is empty.
    assert mig_row.split()[5:9] == ["38123/81559", "MiB", "-", "47C"]

    lost = rows(fleet.report, "node-c")
    assert len(lost) == 4
    assert "NVML_ERROR_GPU_IS_LOST while reading memory info" in lost[2]
    assert " unhealthy " in lost[2], "a GPU that fell off the bus is unhealthy"
    assert "NVML_ERROR" not in lost[1]

    (no_driver,) = rows(fleet.report, "node-d")
    assert "no NVML: nvmlInit failed with NVML_ERROR_LIBRARY_NOT_FOUND" in no_driver


def test_second_run_changes_nothing(fleet: Run) -> None:
    before = {name: (fleet.report / name).read_bytes() for name in ("fleet.json", "fleet.txt")}

    again = run_playbook(fleet.report.parent / "inventory.ini", fleet.report)

    assert recap(again.output, "node-a")["changed"] == 0, again.output
    assert {name: (fleet.report / name).read_bytes() for name in before} == before


def test_host_pattern_can_be_overridden(fleet: Run, tmp_path: Path) -> None:
    run = run_playbook(fleet.report.parent / "inventory.ini", tmp_path / "only-b", "-e", "gpu_inventory_hosts=node-b")

    assert run.returncode == 0, run.output
    assert list(json.loads((tmp_path / "only-b" / "fleet.json").read_text())) == ["node-b"]


def test_playbook_follows_lint_rules() -> None:
    plays = yaml.safe_load(PLAYBOOK.read_text())
    for play in plays:
        assert play.get("name"), "every play is named"
        for task in play["tasks"]:
            assert task.get("name"), f"unnamed task {task}"
            keywords = {"name", "run_once", "delegate_to", "vars", "when", "register", "tags"}
            (action,) = [key for key in task if key not in keywords]
            assert action.count(".") == 2, f"task {task['name']!r} uses {action!r}, not a FQCN"
            if action in ("ansible.builtin.file", "ansible.builtin.copy", "ansible.builtin.template"):
                assert "mode" in task[action], f"task {task['name']!r} sets no mode"
