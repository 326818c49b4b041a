"""Root's observe timer keeps the GPU health holds: ``meridian-node observe-engines`` reads the GPUs once (the fake
pynvml), judges them against what root holds, and syncs ``<apply.state_dir>/gpu-health-holds.json``, where the
engine modules' placement reads it. No Docker Engine here: the policy allows no image, so the engine list needs
none (tests/agent/root_side/test_apply_observe.py)."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from ansible_collections.meridian.node.plugins.module_utils.gpu.health_hold import HOLD_FILE, HealthHolds
from ansible_collections.meridian.node.tests.support.fake_nvml import load_fake_pynvml, two_healthy_gpus
from ansible_collections.meridian.node.tests.support.path_unit import write_node_config
from meridian_node_agent.boundary.engines_file import INVENTORY_FILE
from meridian_node_agent.cli import build_parser
from meridian_node_agent.root_side.observe_unit import cmd_observe_engines
from meridian_node_agent.root_side.root_dir import apply_lock, prepare_root_dir

NODE = "gpu-node-7"
FAILED_ROWS = {"remapped_rows": {"correctable": 0, "uncorrectable": 3, "pending": False, "failure": True}}


@pytest.fixture
def fake() -> Iterator[ModuleType]:
    module = load_fake_pynvml()
    yield module
    module.use_scenario(None)


def _config(root: Path) -> Path:
    return write_node_config(root, node_id=NODE)


def _args(config: Path) -> argparse.Namespace:
    return build_parser("observe-engines").parse_args(["--config", str(config), "observe-engines"])


def _observe(config: Path, fake: ModuleType, scenario: dict[str, Any]) -> int:
    fake.use_scenario(scenario)  # each run of the unit is a fresh process: a fresh read of the host
    return cmd_observe_engines(_args(config), nvml=fake)


def test_an_unhealthy_gpu_is_held_until_an_operator_clears_it(
    tmp_path: Path, fake: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    config = _config(tmp_path)
    holds = HealthHolds(tmp_path / "apply")

    assert _observe(config, fake, two_healthy_gpus(**FAILED_ROWS)) == 0
    first = capsys.readouterr().out
    [held] = holds.all().values()
    assert _observe(config, fake, two_healthy_gpus()) == 0  # the rows read fine now, but nothing shows a reset
    second = capsys.readouterr().out
    still = holds.all()
    holds.clear(held.uuid)  # what 'meridian-node gpu-health clear' does, as root
    assert _observe(config, fake, two_healthy_gpus()) == 0

    assert held.index == 1 and held.health["verdict"] == "unhealthy"
    assert "row-remap-failure" in [reason["code"] for reason in held.health["reasons"]]
    assert f"held GPU 1 {held.uuid} (row-remap-failure)" in first
    assert (tmp_path / "apply" / HOLD_FILE).stat().st_mode & 0o777 == 0o644  # the agent reads it
    assert list(still) == [held.uuid]
    assert "GPU health: 0 healthy, 1 unhealthy; holds unchanged" in second  # judged against the hold: still held
    assert holds.all() == {}  # a clear forgets history: only a fault NVML still shows is held again
    assert (tmp_path / "apply" / "public" / INVENTORY_FILE).exists()  # engines.json as before
    assert not (tmp_path / "state").exists()  # nothing of the agent's is touched


def test_a_reset_nvml_shows_releases_the_hold(
    tmp_path: Path, fake: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    config = _config(tmp_path)
    assert _observe(config, fake, two_healthy_gpus(ecc={"corrected": 0, "uncorrected": 2})) == 0
    [held] = HealthHolds(tmp_path / "apply").all().values()
    capsys.readouterr()

    assert _observe(config, fake, two_healthy_gpus()) == 0  # the volatile count is back to 0: the GPU was reset

    assert HealthHolds(tmp_path / "apply").all() == {}
    assert f"released GPU 1 {held.uuid} (NVML shows a reset)" in capsys.readouterr().out


def test_without_nvml_the_holds_are_left_as_they_are(
    tmp_path: Path, fake: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    config = _config(tmp_path)
    assert _observe(config, fake, two_healthy_gpus(**FAILED_ROWS)) == 0
    before = (tmp_path / "apply" / HOLD_FILE).read_bytes()

    assert _observe(config, fake, {"init_error": "NVML_ERROR_DRIVER_NOT_LOADED"}) == 0

    assert (tmp_path / "apply" / HOLD_FILE).read_bytes() == before
    assert "GPU health: not read (nvmlInit failed with NVML_ERROR_DRIVER_NOT_LOADED" in capsys.readouterr().out


def test_a_damaged_hold_file_fails_the_run_and_engines_json_is_still_written(
    tmp_path: Path, fake: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    config = _config(tmp_path)
    (tmp_path / "apply").mkdir(mode=0o711)
    (tmp_path / "apply" / HOLD_FILE).write_text("[]")

    assert _observe(config, fake, two_healthy_gpus(**FAILED_ROWS)) == 1

    err = capsys.readouterr().err
    assert f"the GPU health hold file {tmp_path / 'apply' / HOLD_FILE} is not a hold file" in err
    assert "restore it from a backup, or remove it" in err
    assert (tmp_path / "apply" / HOLD_FILE).read_text() == "[]"  # never silently reset
    assert (tmp_path / "apply" / "public" / INVENTORY_FILE).exists()


def test_holds_are_synced_while_an_apply_runs(tmp_path: Path, fake: ModuleType) -> None:
    config = _config(tmp_path)
    root = prepare_root_dir(tmp_path / "apply", agent_dir=tmp_path / "state")

    with apply_lock(root, wait=True) as held:
        assert held
        assert _observe(config, fake, two_healthy_gpus(**FAILED_ROWS)) == 0

    assert len(HealthHolds(root.path).all()) == 1  # placement in the next task of that apply refuses the GPU
    assert not (root.public / INVENTORY_FILE).exists()  # engines.json is the apply's while it runs
