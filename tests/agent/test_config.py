"""``meridian-node check-config`` and the config loader: every bad input named, with its field."""

import argparse
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ansible_collections.meridian.node.tests.support.agent_config import MANAGED_HOST_CONFIG, write_managed_host_policy
from ansible_collections.meridian.node.tests.support.trust_fixtures import make_key, write_policy
from meridian_node_agent import cli
from meridian_node_agent.config import ConfigError, load_config

GOOD = MANAGED_HOST_CONFIG  # each bad case below changes one field of it


def write_config(directory: Path, document: object, name: str = "config.yaml") -> Path:
    path = directory / name
    path.write_text(document if isinstance(document, str) else yaml.safe_dump(document))
    return path


@pytest.fixture
def policy_dir(tmp_path: Path) -> Path:
    write_managed_host_policy(tmp_path)
    return tmp_path


def check(capsys: pytest.CaptureFixture[str], config: Path) -> tuple[int, str, str]:
    status = cli.main(["--config", str(config), "check-config"])
    out, err = capsys.readouterr()
    return status, out, err


def test_valid_config_and_policy_pass_with_a_summary(policy_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = check(capsys, write_config(policy_dir, GOOD))
    assert (status, err) == (0, "")
    assert "node gpu-node-1, mode managed-host" in out
    assert "trust control 1-of-1, artifact not configured" in out
    assert out.rstrip().endswith("ok")


def test_relative_paths_resolve_against_the_config_file(policy_dir: Path) -> None:
    config = load_config(write_config(policy_dir, GOOD))
    assert config.policy == str(policy_dir.resolve() / "policy.yaml")
    assert config.identity_dir == policy_dir.resolve() / "state" / "identity"


@pytest.mark.parametrize(
    ("problem", "document", "expected"),
    [
        ("misspelt option", {**GOOD, "contol_plane": {}}, "contol_plane: unknown field"),
        ("plain http", {**GOOD, "control_plane": {"url": "http://meridian.example"}}, "must be https://"),
        ("no control plane", {k: v for k, v in GOOD.items() if k != "control_plane"}, "needs a 'control_plane'"),
        ("air-gapped without inbox", {**GOOD, "mode": "air-gapped"}, "needs an 'air_gap' section"),
        ("unknown mode", {**GOOD, "mode": "root-daemon"}, "mode"),
        ("bad node id", {**GOOD, "node_id": "GPU_01"}, "node_id"),
        ("string where a number goes", {**GOOD, "journal": {"keep_runs": "20"}}, "journal.keep_runs"),
        ("top level not a mapping", "- node_id: x\n", "top level must be a mapping"),
        ("broken YAML", "node_id: [unclosed\n", "line 2"),
        ("duplicate key", "node_id: a\nnode_id: b\n", "duplicate key 'node_id'"),
        (
            "backoff longest below first",
            {**GOOD, "backoff": {"initial_seconds": 5.0, "max_seconds": 1.0}},
            "max_seconds (1.0) is below initial_seconds (5.0)",
        ),
        (
            "renewal retry longest below first",
            {**GOOD, "certificate_renewal": {"retry_initial_seconds": 50.0, "retry_max_seconds": 10.0}},
            "retry_max_seconds (10.0) is below retry_initial_seconds (50.0)",
        ),
        (
            "supervision backoff longest below first",
            {**GOOD, "supervision": {"backoff_initial_seconds": 50.0, "backoff_max_seconds": 10.0}},
            "backoff_max_seconds (10.0) is below backoff_initial_seconds (50.0)",
        ),
    ],
)
def test_bad_config_exits_1_naming_the_field(
    policy_dir: Path, capsys: pytest.CaptureFixture[str], problem: str, document: object, expected: str
) -> None:
    status, out, err = check(capsys, write_config(policy_dir, document))
    assert status == 1, problem
    assert expected in err
    assert "ok" not in out.split()


def test_missing_config_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"absent\.yaml: cannot read the file"):
        load_config(tmp_path / "absent.yaml")


def test_mode_the_policy_does_not_allow_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_policy(tmp_path, control=[make_key()], extra={"agent": {"allowed_modes": ["observe-only"]}})
    status, _, err = check(capsys, write_config(tmp_path, GOOD))
    assert status == 1
    assert "agent mode 'managed-host' is not allowed by policy" in err


def test_broken_policy_is_reported_with_its_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "policy.yaml").write_text("trust:\n  control: {threshold: 1, public_keys: [missing.pem]}\n")
    status, _, err = check(capsys, write_config(tmp_path, GOOD))
    assert status == 1
    assert "trust.control.public_keys[0]" in err and "missing.pem" in err


def test_config_path_comes_from_the_environment(
    policy_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MERIDIAN_NODE_CONFIG", str(write_config(policy_dir, GOOD, "from-env.yaml")))
    assert cli.main(["check-config"]) == 0
    assert "from-env.yaml" in capsys.readouterr().out


def test_every_verb_is_defined_by_the_module_the_cli_loads_for_it() -> None:
    for verb, module in cli.VERB_MODULES.items():
        parser = cli.build_parser(verb)
        subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        assert verb in subparsers.choices, f"{verb!r} is not defined by meridian_node_agent.{module}"
    everything = cli.build_parser()
    subparsers = next(a for a in everything._actions if isinstance(a, argparse._SubParsersAction))
    assert sorted(subparsers.choices) == sorted(cli.VERB_MODULES)


@pytest.mark.parametrize(
    ("argv", "verb"),
    [
        (["run", "--once"], "run"),
        (["--config", "/etc/x.yaml", "status"], "status"),
        (["--config=/etc/x.yaml", "artifact", "list"], "artifact"),
        (["--help"], None),
        ([], None),
    ],
)
def test_the_verb_is_found_before_parsing(argv: list[str], verb: str | None) -> None:
    assert cli.verb_of(argv) == verb


def test_running_a_verb_loads_no_other_verbs_module() -> None:
    code = (
        "import sys; from meridian_node_agent import cli; cli.build_parser('run'); "
        "print(sorted(m for m in sys.modules if m.startswith('meridian_node_agent.cli.')))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "['meridian_node_agent.cli.agent']"
