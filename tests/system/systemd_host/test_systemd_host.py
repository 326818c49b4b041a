"""The systemd test host itself: systemd is PID 1 and running, the agent is installed as a user installs it,
root inside drives the outer Docker Engine, the units can be scored, and path units fire on a rename."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ansible_collections.meridian.node.tests.support.systemd_host import CHECKOUT, SystemdHost, systemd_host

pytestmark = [pytest.mark.docker, pytest.mark.slow]

AGENT = "/opt/meridian-node/bin/meridian-node"


def test_systemd_is_pid_1_and_the_system_is_running(installed_host: SystemdHost) -> None:
    assert installed_host.read_file("/proc/1/comm") == b"systemd\n"
    assert installed_host.exec(["systemctl", "is-system-running"]).stdout.strip() == "running"
    assert installed_host.exec(["python3", "--version"]).stdout.startswith("Python 3.11.")


@pytest.mark.parametrize("user", ["root", "meridian"])
def test_the_agent_runs_as_root_and_as_its_own_user(installed_host: SystemdHost, user: str) -> None:
    result = installed_host.exec([AGENT, "--help"], user=user)
    assert "apply-spooled" in result.stdout
    assert installed_host.exec(["id", "-un"], user=user).stdout.strip() == user


def test_the_units_are_the_checkouts(installed_host: SystemdHost) -> None:
    units = sorted(path.name for path in (CHECKOUT / "systemd").iterdir() if path.suffix != ".md")
    assert {"meridian-node.service", "meridian-node-apply.path", "meridian-node-apply-observe.timer"} <= set(units)
    for unit in units:
        assert installed_host.read_file(f"/etc/systemd/system/{unit}") == (CHECKOUT / "systemd" / unit).read_bytes()
        load_state = installed_host.exec(["systemctl", "show", "--property=LoadState", "--value", unit])
        assert load_state.stdout.strip() == "loaded"


def test_root_inside_drives_the_outer_docker_engine(installed_host: SystemdHost, docker_client: Any) -> None:
    # The wheel's own Docker client, through the bind-mounted socket. The wheel keeps its copy of the
    # collection private (docs/INSTALL.md, "Distribution"): importing the agent package puts it on sys.path.
    script = (
        "import meridian_node_agent\n"
        "from ansible_collections.meridian.node.plugins.module_utils.docker.api import DockerApi\n"
        "print(DockerApi.from_env().info()['ID'])\n"
    )
    result = installed_host.exec(["/opt/meridian-node/bin/python", "-c", script])
    assert result.stdout.strip() == docker_client.info()["ID"]


def test_put_file_sets_mode_and_owner(installed_host: SystemdHost) -> None:
    installed_host.put_file("/etc/mn-test/put.txt", b"one\x00two", mode=0o640, owner="root:meridian")
    assert installed_host.read_file("/etc/mn-test/put.txt") == b"one\x00two"
    assert installed_host.exec(["stat", "-c", "%a %U:%G", "/etc/mn-test/put.txt"]).stdout.strip() == "640 root:meridian"


def test_the_project_units_get_a_security_score(installed_host: SystemdHost) -> None:
    scores = {
        unit: installed_host.unit_security_score(unit)
        for unit in ("meridian-node.service", "meridian-node-apply.service", "meridian-node-apply-observe.service")
    }
    print(f"systemd-analyze security exposure levels: {scores}")
    assert all(0.0 <= score <= 10.0 for score in scores.values())


SMOKE_PATH = """[Path]
PathChanged=/var/lib/mn-smoke/inbox/request.json
Unit=mn-smoke.service
"""
SMOKE_SERVICE = """[Service]
Type=oneshot
RemainAfterExit=yes
ExecStart=/bin/cp /var/lib/mn-smoke/inbox/request.json /var/lib/mn-smoke/seen.json
"""


def test_a_path_unit_fires_when_a_file_is_renamed_into_place(installed_host: SystemdHost) -> None:
    host = installed_host
    host.put_file("/etc/systemd/system/mn-smoke.path", SMOKE_PATH.encode(), mode=0o644)
    host.put_file("/etc/systemd/system/mn-smoke.service", SMOKE_SERVICE.encode(), mode=0o644)
    host.exec(["mkdir", "-p", "/var/lib/mn-smoke/inbox"])
    host.exec(["systemctl", "daemon-reload"])
    host.exec(["systemctl", "start", "mn-smoke.path"])
    with host.logs_on_failure("mn-smoke.path", "mn-smoke.service"):
        host.wait_unit("mn-smoke.path", "active", timeout=10)
        assert host.unit_state("mn-smoke.service") == "inactive"
        # put_file writes a temporary file next to the target and renames it into place.
        host.put_file("/var/lib/mn-smoke/inbox/request.json", b'{"n": 1}', mode=0o600)
        host.wait_unit("mn-smoke.service", "active", timeout=10)
        assert host.read_file("/var/lib/mn-smoke/seen.json") == b'{"n": 1}'


def test_same_path_mounts_are_shared_and_the_host_is_removed_afterwards(docker_client: Any, tmp_path: Path) -> None:
    (tmp_path / "artifact").write_bytes(b"model bytes")
    with systemd_host(same_path_mounts=[tmp_path], docker_socket=False) as host:
        assert host.read_file(str(tmp_path / "artifact")) == b"model bytes"
        host.put_file(str(tmp_path / "written-inside"), b"from inside", mode=0o644)
        name = host.name
    assert (tmp_path / "written-inside").read_bytes() == b"from inside"
    assert docker_client.containers.list(all=True, filters={"name": name}) == []
