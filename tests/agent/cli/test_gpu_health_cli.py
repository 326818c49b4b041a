"""``meridian-node gpu-health show | clear GPU``: in-process through the CLI's ``main`` on the fake pynvml (put where
the NVML seam finds pynvml), and once as a separate process with the fake first on PYTHONPATH."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from ansible_collections.meridian.node.plugins.module_utils.gpu import nvml as nvml_seam
from ansible_collections.meridian.node.plugins.module_utils.gpu.facts import collect_gpu_facts
from ansible_collections.meridian.node.plugins.module_utils.gpu.health_hold import HealthHolds
from ansible_collections.meridian.node.tests.support.fake_nvml import FAKES, load_fake_pynvml, two_healthy_gpus
from ansible_collections.meridian.node.tests.support.path_unit import write_node_config
from meridian_node_agent.cli import main as cli_main

FAILED_ROWS = {"remapped_rows": {"correctable": 0, "uncorrectable": 3, "pending": False, "failure": True}}
UUID0, UUID1 = "GPU-a1b2c300-51d0-4e7a-9c3f-6b0e2d4f1a00", "GPU-a1b2c301-51d0-4e7a-9c3f-6b0e2d4f1a01"


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    module = load_fake_pynvml()
    module.use_scenario(two_healthy_gpus())
    monkeypatch.setattr(nvml_seam, "_pynvml", module)
    yield module
    module.use_scenario(None)


def _config(root: Path, *, via: str = "systemd") -> Path:
    return write_node_config(root, node_id="gpu-node-7", via=via)


def _hold_gpu1(fake: ModuleType, holds_dir: Path) -> dict[str, Any]:
    """Hold GPU 1 for a row-remap failure, as root's observe timer would have, then let the host read fine again."""
    fake.use_scenario(two_healthy_gpus(**FAILED_ROWS))
    facts = collect_gpu_facts(fake, processes=False, nvlink=False, previous={}, now=datetime.now(UTC))
    HealthHolds(holds_dir).hold(UUID1, facts["gpus"][1]["health"], gpu=facts["gpus"][1])
    fake.use_scenario(two_healthy_gpus())
    health: dict[str, Any] = facts["gpus"][1]["health"]
    return health


@pytest.fixture
def gpu1_held(tmp_path: Path, fake: ModuleType) -> Path:
    """The config of a node that applies through systemd, GPU 1 held in root's directory (``_hold_gpu1``)."""
    config = _config(tmp_path)
    _hold_gpu1(fake, tmp_path / "apply")
    return config


def test_show_reads_the_gpus_now_as_placement_judges_them(
    tmp_path: Path, fake: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    config = _config(tmp_path)
    held = _hold_gpu1(fake, tmp_path / "apply")
    HealthHolds(tmp_path / "apply").hold("GPU-gone", held, gpu={"index": 5, "pci_bus_id": "00000000:9D:00.0"})

    assert cli_main(["--config", str(config), "gpu-health", "show"]) == 0
    lines = capsys.readouterr().out.splitlines()

    assert (
        lines[0]
        == f"GPU health of node gpu-node-7, read now; held verdicts in {tmp_path / 'apply'}/gpu-health-holds.json"
    )
    assert lines[1] == f"GPU 0 {UUID0} 00000000:1B:00.0 NVIDIA H100 80GB HBM3: healthy"
    assert lines[2].startswith(
        f"GPU 1 {UUID1} 00000000:43:00.0 NVIDIA H100 80GB HBM3: unhealthy, held since {held['since']}"
    )
    assert "row-remap-failure True (nvmlDeviceGetRemappedRows)" in lines[2]
    assert lines[3].startswith("held, not on this host now: GPU 5 GPU-gone (held since ")


def test_show_json_is_one_document(tmp_path: Path, gpu1_held: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["--config", str(gpu1_held), "gpu-health", "show", "--json"]) == 0
    document = json.loads(capsys.readouterr().out)

    assert document["nvml_available"] is True and document["holds_error"] is None
    assert [(g["uuid"], g["health"]["verdict"], g["held_at"] is not None) for g in document["gpus"]] == [
        (UUID0, "healthy", False),
        (UUID1, "unhealthy", True),
    ]


@pytest.mark.parametrize("which", [UUID1, "1", "00000000:43:00.0"], ids=["uuid", "index", "pci-bus-id"])
def test_clear_by_uuid_index_or_pci_bus_id_says_what_it_cleared(
    tmp_path: Path, gpu1_held: Path, capsys: pytest.CaptureFixture[str], which: str
) -> None:
    assert cli_main(["--config", str(gpu1_held), "gpu-health", "clear", which]) == 0
    out = capsys.readouterr().out

    assert out.startswith(f"cleared GPU 1 {UUID1} (held since ")
    assert "row-remap-failure" in out and "placement may use it again" in out
    assert HealthHolds(tmp_path / "apply").all() == {}


def test_clear_in_process_works_on_the_agents_own_directory(
    tmp_path: Path, fake: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    config = _config(tmp_path, via="in-process")
    _hold_gpu1(fake, tmp_path / "state")  # in-process, placement reads the holds in the agent's state_dir

    assert cli_main(["--config", str(config), "gpu-health", "clear", "1"]) == 0

    assert f"from {tmp_path / 'state'}/gpu-health-holds.json" in capsys.readouterr().out
    assert HealthHolds(tmp_path / "state").all() == {}


def test_clearing_a_gpu_that_is_not_held_changes_nothing(
    tmp_path: Path, gpu1_held: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli_main(["--config", str(gpu1_held), "gpu-health", "clear", "0"]) == 0

    assert capsys.readouterr().out.startswith("GPU 0 is not held in ")
    assert list(HealthHolds(tmp_path / "apply").all()) == [UUID1]


def test_clearing_an_unknown_gpu_names_the_gpus_there_are(
    tmp_path: Path, gpu1_held: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli_main(["--config", str(gpu1_held), "gpu-health", "clear", "7"]) == 1

    err = capsys.readouterr().err
    assert "no GPU '7' on this host to clear: name one by uuid, index or PCI bus id" in err
    assert f"0={UUID0}, 1={UUID1}" in err
    assert list(HealthHolds(tmp_path / "apply").all()) == [UUID1]


def test_an_xid_only_the_agent_saw_is_shown_and_how_it_ends_is_said(
    tmp_path: Path, fake: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    config = _config(tmp_path)
    (tmp_path / "state").mkdir()
    agent_view = {"index": 1, "uuid": UUID1, "verdict": "unhealthy", "held": True, "since": "2026-12-05T08:00:00Z"}
    status = {"gpus": [{**agent_view, "reasons": ["xid-critical 79"], "cordoned": False}]}
    (tmp_path / "state" / "status.json").write_text(json.dumps(status))

    assert cli_main(["--config", str(config), "gpu-health", "show"]) == 0
    shown = capsys.readouterr().out
    assert cli_main(["--config", str(config), "gpu-health", "clear", "1"]) == 0
    cleared = capsys.readouterr().out

    assert f"GPU 1 {UUID1} 00000000:43:00.0 NVIDIA H100 80GB HBM3: healthy" in shown
    assert "the agent's last report: unhealthy, held since 2026-12-05T08:00:00Z (xid-critical 79)" in shown
    assert "held by the agent alone" in shown
    assert "GPU 1 is not held in " in cleared and "restarting the agent" in cleared


def test_the_verb_runs_as_its_own_process_on_the_fake_pynvml(tmp_path: Path) -> None:
    config = _config(tmp_path)
    scenario = tmp_path / "scenario.json"
    scenario.write_text(json.dumps(two_healthy_gpus(ecc={"corrected": 0, "uncorrected": 2})))
    script = Path(sys.executable).parent / "meridian-node"
    command = [str(script)] if script.exists() else [sys.executable, "-m", "meridian_node_agent.cli"]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(FAKES), os.environ.get("PYTHONPATH")])),
        "MERIDIAN_FAKE_NVML_SCENARIO": str(scenario),
    }

    shown = subprocess.run(
        [*command, "--config", str(config), "gpu-health", "show"], capture_output=True, text=True, env=env, check=False
    )
    helped = subprocess.run([*command, "gpu-health", "--help"], capture_output=True, text=True, env=env, check=False)

    assert shown.returncode == 0, shown.stderr
    assert f"GPU 1 {UUID1} 00000000:43:00.0 NVIDIA H100 80GB HBM3: unhealthy: ecc-volatile-dbe 2" in shown.stdout
    assert helped.returncode == 0 and "usage: meridian-node gpu-health" in helped.stdout
