"""The ansible_pull role through playbooks/ansible_pull.yml: rendered into a temp dir by moving only its documented
install paths, checked with systemd-analyze, idempotent, inert in --check mode, and refusing bad variables.

PID 1 here is not systemd, so the timer cannot be started: ansible_pull_manage_service is false and the units
are verified as files.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from ansible_collections.meridian.node.tests.support.engine_harness import REPO
from ansible_collections.meridian.node.tests.system.pull.pull_env import (
    Installed,
    apply_role,
    install_paths,
    make_ssh_key,
    public_key,
    role_vars,
    unit_values,
)

DEFAULTS = yaml.safe_load((REPO / "roles" / "ansible_pull" / "defaults" / "main.yml").read_text())


def recap(output: str) -> dict[str, int]:
    found = re.search(r"localhost\s*:\s*ok=(\d+)\s+changed=(\d+)\s+unreachable=(\d+)\s+failed=(\d+)", output)
    assert found, output
    ok, changed, unreachable, failed = (int(value) for value in found.groups())
    return {"ok": ok, "changed": changed, "unreachable": unreachable, "failed": failed}


def snapshot(root: Path) -> dict[str, tuple[str, int]]:
    """Every file and directory under root → (content digest or 'dir', mode)."""
    return {
        str(path.relative_to(root)): (
            "dir" if path.is_dir() else hashlib.sha256(path.read_bytes()).hexdigest(),
            path.stat().st_mode,
        )
        for path in sorted(root.rglob("*"))
    }


@pytest.fixture
def signer(tmp_path: Path) -> list[dict[str, str]]:
    keys = tmp_path / "keys"
    keys.mkdir()
    return [{"principal": "release@meridian", "key": public_key(make_ssh_key(keys, "release"))}]


def test_rendered_units_pass_systemd_analyze_verify_without_a_word(
    tmp_path: Path, signer: list[dict[str, str]]
) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    paths = install_paths(tmp_path / "host")
    done = apply_role(paths, role_vars(paths, "https://git.example.test/fleet/playbooks.git", signer))
    assert done.returncode == 0, done.stdout + done.stderr

    verify = subprocess.run(
        [analyze, "verify", str(paths.service), str(paths.timer)], capture_output=True, text=True, check=False
    )

    assert (verify.returncode, verify.stdout + verify.stderr) == (0, "")
    assert unit_values(paths.service, "Type") == ["oneshot"]
    assert unit_values(paths.service, "ExecStart") == [
        f"{DEFAULTS['ansible_pull_python']} {paths.libexec_dir}/meridian-node-pull"
        f" --config {paths.config_dir}/pull.json"
    ]
    assert unit_values(paths.timer, "OnBootSec") == [DEFAULTS["ansible_pull_on_boot_sec"]]
    assert unit_values(paths.timer, "OnUnitActiveSec") == [DEFAULTS["ansible_pull_interval"]]
    assert unit_values(paths.timer, "RandomizedDelaySec") == [DEFAULTS["ansible_pull_randomized_delay"]]
    assert unit_values(paths.timer, "WantedBy") == ["timers.target"]
    signers = (paths.config_dir / "pull_allowed_signers").read_text().splitlines()
    assert f'release@meridian namespaces="git" {signer[0]["key"]}' in signers
    assert oct(paths.state_dir.stat().st_mode & 0o777) == "0o700"
    assert oct((paths.config_dir / "pull.json").stat().st_mode & 0o777) == "0o600"


def test_second_run_changes_nothing_and_check_mode_writes_nothing(tmp_path: Path, signer: list[dict[str, str]]) -> None:
    paths: Installed = install_paths(tmp_path / "host")
    variables = role_vars(paths, "https://git.example.test/fleet/playbooks.git", signer)
    first = apply_role(paths, variables)
    assert first.returncode == 0, first.stdout + first.stderr
    assert recap(first.stdout)["changed"] > 0
    installed = snapshot(paths.root / "etc") | snapshot(paths.root / "usr") | snapshot(paths.root / "var")

    second = apply_role(paths, variables)
    rotated = apply_role(
        paths,
        variables
        | {"ansible_pull_interval": "30min", "ansible_pull_signers": [*signer, signer[0] | {"principal": "b"}]},
        "--check",
    )

    assert recap(second.stdout) | {"ok": 0} == {"ok": 0, "changed": 0, "unreachable": 0, "failed": 0}
    assert rotated.returncode == 0, rotated.stdout + rotated.stderr
    assert recap(rotated.stdout)["changed"] == 2, "check mode should report the timer and the signers as changing"
    after = snapshot(paths.root / "etc") | snapshot(paths.root / "usr") | snapshot(paths.root / "var")
    assert after == installed


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ({"ansible_pull_signers": []}, "got principals []"),
        ({"ansible_pull_signers": [{"principal": "a b", "key": "ssh-ed25519 AAAA"}]}, 'got principals ["a b"]'),
        ({"ansible_pull_signers": [{"principal": "a", "key": "not a key"}]}, 'got principals ["a"]'),
        ({"ansible_pull_signers": [{"principal": "a"}]}, "missing required arguments: key"),
        ({"ansible_pull_repo_url": ""}, "ansible_pull_repo_url is empty"),
        ({"ansible_pull_playbook": "../elsewhere.yml"}, 'ansible_pull_playbook "../elsewhere.yml" must be'),
        ({"ansible_pull_repo_id": "fleet playbooks"}, 'ansible_pull_repo_id "fleet playbooks" and'),
        ({"ansible_pull_branch": "release 1"}, 'ansible_pull_branch "release 1" must not contain whitespace'),
    ],
)
def test_role_refuses_variables_that_would_trust_or_run_the_wrong_thing(
    tmp_path: Path, signer: list[dict[str, str]], override: dict[str, object], named: str
) -> None:
    paths = install_paths(tmp_path / "host")

    done = apply_role(paths, role_vars(paths, "https://git.example.test/p.git", signer) | override)

    assert done.returncode != 0
    assert named in done.stdout
    assert not paths.root.joinpath("etc").exists(), "the role installed something before refusing"


@pytest.mark.parametrize(
    ("override", "trailer"),
    [
        ({}, "Meridian-Pull-Target: git.example.test/fleet/playbooks main"),
        (
            {"ansible_pull_repo_id": "fleet/playbooks", "ansible_pull_branch": "stable"},
            "Meridian-Pull-Target: fleet/playbooks stable",
        ),
    ],
)
def test_installed_wrapper_shows_the_target_trailer_its_commits_must_carry(
    tmp_path: Path, signer: list[dict[str, str]], override: dict[str, object], trailer: str
) -> None:
    paths = install_paths(tmp_path / "host")
    done = apply_role(paths, role_vars(paths, "git@git.example.test:fleet/playbooks.git", signer) | override)
    assert done.returncode == 0, done.stdout + done.stderr
    (exec_start,) = unit_values(paths.service, "ExecStart")

    shown = subprocess.run(
        [*exec_start.split(), "--show-target"], capture_output=True, text=True, timeout=60, check=False
    )

    assert (shown.returncode, shown.stdout) == (0, f"{trailer}\n"), shown.stderr
