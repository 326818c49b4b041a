"""``meridian-node observe-engines`` and its units: root's timer-driven, read-only refresh of engines.json.

No Docker Engine here: the policy allows no image (so the engine list needs none), or DOCKER_HOST names a
socket nobody listens on. tests/system/systemd_host/test_hand_changes_under_split.py runs the real units against
a real Docker Engine.
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ansible_collections.meridian.node.plugins.module_utils.docker.api import DockerApiError
from ansible_collections.meridian.node.plugins.module_utils.docker.engine import DockerUnavailableError
from ansible_collections.meridian.node.tests.support.path_unit import write_node_config
from ansible_collections.meridian.node.tests.support.systemd_units import UNITS
from ansible_collections.meridian.node.tests.support.systemd_units import read_unit as _unit
from meridian_node_agent.boundary.engines_file import INVENTORY_FILE, file_identity, read_inventory
from meridian_node_agent.cli import build_parser
from meridian_node_agent.config import DEFAULT_CONFIG_PATH, Apply
from meridian_node_agent.root_side.observe_unit import cmd_observe_engines
from meridian_node_agent.root_side.read_only_docker import ReadOnlyDockerApi, connect_read_only
from meridian_node_agent.root_side.root_dir import apply_lock, prepare_root_dir

NODE = "gpu-node-7"
TIMER, SERVICE = "meridian-node-apply-observe.timer", "meridian-node-apply-observe.service"


def _config(root: Path, *, images: list[str], via: str = "systemd") -> Path:
    extra = {"images": {"allowed_repositories": images, "require_digest": True}} if images else {}
    return write_node_config(root, node_id=NODE, via=via, policy_extra=extra)


def _args(config: Path) -> argparse.Namespace:
    return build_parser("observe-engines").parse_args(["--config", str(config), "observe-engines"])


def _written(root: Path) -> tuple[Path, Path]:
    """A node config under ``root`` whose policy allows no image, and the engines file the verb has just written
    for it."""
    config = _config(root, images=[])
    assert cmd_observe_engines(_args(config)) == 0
    return config, root / "apply" / "public" / INVENTORY_FILE


def test_the_verb_writes_the_engines_file_in_roots_public_dir(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _config_path, path = _written(tmp_path)

    assert read_inventory(path, node_id=NODE).engines == ()
    assert path.stat().st_mode & 0o777 == 0o644
    assert f"wrote {path}" in capsys.readouterr().out
    assert not (tmp_path / "state").exists()  # nothing of the agent's is touched, not even created


def test_while_an_apply_holds_the_lock_the_verb_leaves_the_file_as_the_apply_will_write_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A listing in the middle of a replace would show the agent the engine missing: the apply answers for it.
    config, path = _written(tmp_path)
    before = file_identity(path)
    root = prepare_root_dir(tmp_path / "apply", agent_dir=tmp_path / "state")

    with apply_lock(root, wait=True) as held:
        assert held
        assert cmd_observe_engines(_args(config)) == 0

    assert file_identity(path) == before
    assert "an apply is running" in capsys.readouterr().out
    assert cmd_observe_engines(_args(config)) == 0  # released: written again
    assert file_identity(path) != before


def test_docker_unreachable_keeps_the_previous_file_and_fails_the_unit_saying_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _config_path, path = _written(tmp_path)
    previous = path.read_bytes()
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path / 'no-docker.sock'}")
    config = _config(tmp_path, images=["meridian-node/standin"])  # now Docker must be asked

    assert cmd_observe_engines(_args(config)) == 1

    assert path.read_bytes() == previous
    error = capsys.readouterr().err
    assert f"could not write {path}" in error and "Docker Engine" in error


def test_an_in_process_config_is_refused_with_how_to_turn_the_timer_off(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = _config(tmp_path, images=[], via="in-process")

    assert cmd_observe_engines(_args(config)) == 1

    error = capsys.readouterr().err
    assert "apply.via: in-process" in error and "systemctl disable --now meridian-node-apply-observe.timer" in error
    assert not (tmp_path / "apply").exists()


@pytest.mark.parametrize(
    ("call", "method"),
    [
        (lambda api: api.create_container("x", {"Image": "busybox"}), "POST"),
        (lambda api: api.start("abc"), "POST"),
        (lambda api: api.stop("abc", 1), "POST"),
        (lambda api: api.remove("abc", force=True), "DELETE"),
    ],
    ids=["create", "start", "stop", "remove"],
)
def test_the_observe_units_docker_client_refuses_every_change_before_connecting(
    tmp_path: Path, call: object, method: str
) -> None:
    # A socket nobody listens on: a call that got as far as connecting would fail with a transport error.
    api = ReadOnlyDockerApi(f"unix://{tmp_path / 'no-docker.sock'}")

    with pytest.raises(DockerApiError, match=f"refused {method} /containers/.*only read the Docker Engine"):
        call(api)  # type: ignore[operator]
    with pytest.raises(DockerApiError) as caught:
        api.containers({"label": ["x"]})  # reading is let through, to the (missing) socket
    assert "refused" not in str(caught.value)


def test_an_unreachable_docker_engine_is_reported_as_roots_to_reach(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path / 'no-docker.sock'}")
    with pytest.raises(DockerUnavailableError, match=r"Error connecting to the Docker Engine: .*reachable by root\?"):
        connect_read_only(timeout_s=1)


def test_the_timer_starts_the_observe_service_which_runs_the_verb_with_the_default_config() -> None:
    timer = _unit(TIMER)
    assert timer["Timer"]["Unit"] == [SERVICE]
    assert timer["Install"]["WantedBy"] == ["timers.target"]
    service = _unit(SERVICE)
    assert "Install" not in service  # only the timer starts it
    argv = shlex.split(service["Service"]["ExecStart"][0])
    args = build_parser().parse_args(argv[1:])
    assert args.handler is cmd_observe_engines and args.config == DEFAULT_CONFIG_PATH


def test_the_observe_service_writes_only_roots_directory_with_chown_as_its_only_capability() -> None:
    service = _unit(SERVICE)["Service"]
    assert service["User"] == ["root"] and service["Type"] == ["oneshot"]
    assert [f"/var/lib/{name}" for name in service["StateDirectory"]] == [Apply.model_fields["state_dir"].default]
    assert service["StateDirectoryMode"] == _unit("meridian-node-apply.service")["Service"]["StateDirectoryMode"]
    assert "ReadWritePaths" not in service and service["ProtectSystem"] == ["strict"]
    assert service["CapabilityBoundingSet"] == ["CAP_CHOWN"]
    assert service["RestrictAddressFamilies"] == ["AF_UNIX"] and service["PrivateNetwork"] == ["yes"]


def test_the_observe_units_pass_systemd_analyze_verify_without_a_word(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    binary = Path(sys.executable).parent / "meridian-node"
    for name in (TIMER, SERVICE):
        text = (UNITS / name).read_text()
        (tmp_path / name).write_text(text.replace("/opt/meridian-node/bin/meridian-node", str(binary)))

    verify = subprocess.run(
        [analyze, "verify", *(str(tmp_path / name) for name in (TIMER, SERVICE))],
        capture_output=True,
        text=True,
        check=False,
    )

    assert (verify.returncode, verify.stdout + verify.stderr) == (0, "")
