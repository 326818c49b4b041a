"""Modes the contract names but this version does not build are refused, never run as another mode.

kubernetes-integrated was accepted and then converged like managed-host (it created containers); it must
never mutate. Each entry point that could act says so instead: check-config, run, and the root apply unit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from ansible_collections.meridian.node.tests.support.path_unit import apply_spooled
from ansible_collections.meridian.node.tests.support.trust_fixtures import (
    NODE_ID,
    current_state,
    make_key,
    signed,
    write_policy,
)
from meridian_node_agent.agent_side.systemd_applier import write_request
from meridian_node_agent.boundary.spool import PUBLIC_DIR, SPOOL_DIR, read_answer_file
from meridian_node_agent.cli import main as cli_main

CONTROL = make_key()


def _config(root: Path, mode: str, *, via: str = "in-process") -> Path:
    extra = {"agent": {"allowed_modes": ["observe-only", "managed-host", "kubernetes-integrated", "air-gapped"]}}
    policy = write_policy(root / "etc", control=[CONTROL], extra=extra)
    document = {
        "node_id": NODE_ID,
        "mode": mode,
        "policy": str(policy),
        "state_dir": str(root / "agent"),
        "control_plane": {"url": "https://127.0.0.1:9"},
        "apply": {"via": via, "state_dir": str(root / "apply")},
    }
    if mode == "air-gapped":
        document["air_gap"] = {"inbox": str(root / "inbox"), "outbox": str(root / "outbox")}
    path = root / "config.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


# air-gapped is built both ways now (root's inbox unit under the split: tests/agent/root_side/test_airgap_root.py).
@pytest.mark.parametrize(
    ("mode", "via"), [("kubernetes-integrated", "in-process"), ("kubernetes-integrated", "systemd")]
)
def test_check_config_and_run_refuse_a_mode_that_is_not_built(
    tmp_path: Path, mode: str, via: str, capsys: pytest.CaptureFixture[str]
) -> None:
    config = _config(tmp_path, mode, via=via)

    assert cli_main(["--config", str(config), "check-config"]) == 1
    assert f"mode {mode} is not available yet" in capsys.readouterr().err
    assert cli_main(["--config", str(config), "run", "--once"]) == 2
    assert f"mode {mode} is not available yet" in capsys.readouterr().err
    assert not (tmp_path / "agent").exists()  # nothing was started, spooled or recorded


def test_the_root_apply_unit_refuses_requests_under_kubernetes_integrated(tmp_path: Path) -> None:
    config = _config(tmp_path, "kubernetes-integrated", via="systemd")
    envelope = signed("desired-state", current_state(1), [CONTROL])
    write_request(tmp_path / "agent" / SPOOL_DIR, "gen-1-20261201T120000.000000Z", envelope)

    run = apply_spooled(config)

    assert run.returncode == 1
    answer = read_answer_file(tmp_path / "apply" / PUBLIC_DIR)
    assert answer is not None and "mode kubernetes-integrated is not available yet" in answer.failures[0]
    assert list((tmp_path / "apply" / "journal").iterdir()) == []  # no playbook ran
