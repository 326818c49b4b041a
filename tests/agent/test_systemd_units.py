"""The checked-in systemd units: valid for systemd, and in agreement with the CLI and the config defaults.

``systemd-analyze verify`` insists that ExecStart's binary exists, so it checks a copy whose ExecStart
points at this environment's ``meridian-node``; every other line is verified as shipped. It exits 0 on
many mistakes, so any output at all is a failure.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ansible_collections.meridian.node.tests.support.systemd_units import UNITS
from ansible_collections.meridian.node.tests.support.systemd_units import read_unit as _unit
from meridian_node_agent.boundary.spool import REQUEST_FILE, SPOOL_DIR
from meridian_node_agent.cli import build_parser
from meridian_node_agent.cli.agent import cmd_run
from meridian_node_agent.config import DEFAULT_CONFIG_PATH, AgentConfig, Apply
from meridian_node_agent.root_side.apply_unit import cmd_apply_spooled

AGENT, PATH, APPLY = "meridian-node.service", "meridian-node-apply.path", "meridian-node-apply.service"
DEFAULT_STATE_DIR = AgentConfig.model_fields["state_dir"].default
DEFAULT_APPLY_STATE_DIR = Apply.model_fields["state_dir"].default


def _one(name: str, section: str, key: str) -> str:
    values = _unit(name)[section][key]
    assert len(values) == 1, f"{name} [{section}] {key}= is set {len(values)} times"
    return values[0]


def test_units_pass_systemd_analyze_verify_without_a_word(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    binary = Path(sys.executable).parent / "meridian-node"
    assert binary.exists(), f"the console script {binary} is missing; install the package into this venv"
    for name in (AGENT, PATH, APPLY):
        text = (UNITS / name).read_text()
        (tmp_path / name).write_text(text.replace("/opt/meridian-node/bin/meridian-node", str(binary)))

    verify = subprocess.run(
        [analyze, "verify", *(str(tmp_path / name) for name in (AGENT, PATH, APPLY))],
        capture_output=True,
        text=True,
        check=False,
    )

    assert (verify.returncode, verify.stdout + verify.stderr) == (0, "")


@pytest.mark.parametrize(("unit", "handler"), [(AGENT, cmd_run), (APPLY, cmd_apply_spooled)])
def test_execstart_runs_a_real_verb_with_the_default_config(unit: str, handler: object) -> None:
    argv = shlex.split(_one(unit, "Service", "ExecStart"))
    assert Path(argv[0]).name == "meridian-node"

    args = build_parser().parse_args(argv[1:])

    assert args.handler is handler
    assert args.config == DEFAULT_CONFIG_PATH


def test_path_unit_watches_the_request_file_the_agent_writes_under_the_default_state_dir() -> None:
    watched = _one(PATH, "Path", "PathChanged")
    assert watched == str(Path(DEFAULT_STATE_DIR) / SPOOL_DIR / REQUEST_FILE)
    assert _one(PATH, "Path", "Unit") == APPLY
    assert (UNITS / APPLY).is_file()


def test_agent_runs_unprivileged_and_confined_to_its_state_dir() -> None:
    service = _unit(AGENT)["Service"]
    assert service["User"] != ["root"] and service["User"]
    assert service["NoNewPrivileges"] == ["yes"]
    assert service["ProtectSystem"] == ["strict"]
    assert service["PrivateTmp"] == ["yes"]
    assert service["CapabilityBoundingSet"] == [""]
    assert "ReadWritePaths" not in service  # StateDirectory= is its only writable place
    assert f"/var/lib/{service['StateDirectory'][0]}" == DEFAULT_STATE_DIR


def test_apply_unit_is_a_root_oneshot_only_the_path_unit_starts() -> None:
    unit = _unit(APPLY)
    service = unit["Service"]
    assert service["Type"] == ["oneshot"] and service["User"] == ["root"]
    assert "Install" not in unit  # never enabled on its own: the path unit is the only trigger
    assert service["ProtectSystem"] == ["strict"]
    # It writes only its own directories; nothing under the agent's directory is writable to it.
    assert "ReadWritePaths" not in service
    directories = [f"/var/lib/{name}" for name in service["StateDirectory"][0].split()]
    assert directories == [DEFAULT_APPLY_STATE_DIR, load_policy_defaults_store_path()]
    assert not any(d.startswith(DEFAULT_STATE_DIR + "/") for d in directories)
    assert service["StateDirectoryMode"] == ["0711"]
    assert service["Environment"] == [f"HOME={DEFAULT_APPLY_STATE_DIR}"]
    # The root run stops where the agent stops waiting for it.
    assert float(_one(APPLY, "Service", "TimeoutStartSec")) == Apply.model_fields["timeout_seconds"].default


def load_policy_defaults_store_path() -> str:
    """The artifact store's default path, as the policy loader has it (a policy that names no store)."""
    from ansible_collections.meridian.node.plugins.module_utils.trust.policy import parse_policy

    text = "trust:\n  control: {threshold: 1, public_keys: [control.pem]}\n"
    return parse_policy(text, Path("/nonexistent"), keys=False).store.path
