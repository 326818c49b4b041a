"""The wheel: galaxy.yml's version, the systemd units as shared data, the collection only where the agent
looks, and an install that brings no web framework."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest
import yaml

from ansible_collections.meridian.node.tests.support.agent_config import MANAGED_HOST_CONFIG, write_managed_host_policy
from ansible_collections.meridian.node.tests.system.packaging.packaging_env import CHECKOUT, AgentVenv, run

PRIVATE_COLLECTION = "meridian_node_agent/collection/ansible_collections/meridian/node"
# The devserver's web stack (the `devserver` extra) and the Prometheus client (the `metrics` extra). Not h11:
# uvicorn uses it, but so does the agent's control-plane link (control_http), so the agent depends on it.
EXTRAS_ONLY = {"fastapi", "starlette", "uvicorn", "anyio", "prometheus-client", "grpcio", "protobuf"}

pytestmark = pytest.mark.slow


def _galaxy_version() -> str:
    version = yaml.safe_load((CHECKOUT / "galaxy.yml").read_text())["version"]
    assert isinstance(version, str)
    return version


def _names(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as archive:
        return archive.namelist()


def test_wheel_version_is_the_galaxy_version(built_wheel: Path) -> None:
    version = _galaxy_version()
    assert built_wheel.name == f"meridian_node-{version}-py3-none-any.whl"
    with zipfile.ZipFile(built_wheel) as archive:
        metadata = archive.read(f"meridian_node-{version}.dist-info/METADATA").decode()
    assert f"\nVersion: {version}\n" in metadata


def test_wheel_carries_the_systemd_units_as_shared_data(built_wheel: Path) -> None:
    prefix = f"meridian_node-{_galaxy_version()}.data/data/share/meridian-node/systemd/"
    shipped = sorted(name.removeprefix(prefix) for name in _names(built_wheel) if name.startswith(prefix))
    assert shipped == sorted(path.name for path in (CHECKOUT / "systemd").iterdir())


def test_wheel_carries_the_collection_only_privately(built_wheel: Path) -> None:
    names = _names(built_wheel)
    # At site-packages/ansible_collections Ansible would pick the wheel's copy up as an installed collection.
    assert [name for name in names if name.startswith("ansible_collections/")] == []
    modules = {
        name.removeprefix(f"{PRIVATE_COLLECTION}/plugins/modules/")
        for name in names
        if name.startswith(f"{PRIVATE_COLLECTION}/plugins/modules/")
    }
    assert modules == {path.name for path in (CHECKOUT / "plugins" / "modules").glob("*.py")}
    assert f"{PRIVATE_COLLECTION}/galaxy.yml" in names
    assert f"{PRIVATE_COLLECTION}/playbooks/reconcile.yml" in names
    assert [name for name in names if "__pycache__" in name or "/." in name] == []


def test_agent_install_brings_no_web_framework(agent_venv: AgentVenv) -> None:
    listed = run([agent_venv.python, "-m", "pip", "list", "--format", "json"], env=agent_venv.env())
    installed = {entry["name"].lower(): entry["version"] for entry in json.loads(listed.stdout)}
    assert installed["meridian-node"] == _galaxy_version()
    assert {"ansible-core", "ansible-runner", "pydantic", "cryptography", "h11"} <= installed.keys()
    assert sorted(EXTRAS_ONLY & installed.keys()) == []


def test_agent_install_has_the_units_where_the_role_takes_them(agent_venv: AgentVenv) -> None:
    units = agent_venv.root / "share" / "meridian-node" / "systemd"
    for source in (CHECKOUT / "systemd").iterdir():
        assert (units / source.name).read_bytes() == source.read_bytes()


def test_agent_cli_runs_without_the_extras(agent_venv: AgentVenv) -> None:
    result = run([agent_venv.bin("meridian-node"), "--version"], env=agent_venv.env())
    assert result.stdout.split() == ["meridian-node", _galaxy_version()]
    run([agent_venv.bin("meridian-node"), "check-config", "--help"], env=agent_venv.env())


def test_devserver_serve_without_its_extra_names_the_extra(agent_venv: AgentVenv, tmp_path: Path) -> None:
    result = run(
        [agent_venv.bin("meridian-node-devserver"), "serve", "--data-dir", tmp_path / "data"],
        env=agent_venv.env(),
        expect=2,
    )
    assert "install meridian-node[devserver]" in result.stderr
    assert "'uvicorn' is not installed" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "data").exists()


def test_metrics_without_prometheus_client_names_the_extra(agent_venv: AgentVenv) -> None:
    script = (
        "from meridian_node_agent.cli.agent import serve_metrics\n"
        "from meridian_node_agent.errors import UsageError\n"
        "try:\n"
        "    serve_metrics('127.0.0.1:0')\n"
        "except UsageError as exc:\n"
        "    print(exc)\n"
        "else:\n"
        "    raise SystemExit('metrics were served without prometheus-client')\n"
    )
    result = run([agent_venv.python, "-c", script], env=agent_venv.env())
    assert "metrics.listen is '127.0.0.1:0'" in result.stdout
    assert "install meridian-node[metrics]" in result.stdout


def test_agent_imports_the_collection_that_shipped_with_it(agent_venv: AgentVenv) -> None:
    script = (
        "import meridian_node_agent.apply.applier as apply\n"
        "from ansible_collections.meridian.node.plugins.module_utils.trust import verify as trust\n"
        "print(apply.collection_paths()[0]); print(trust.__file__)\n"
    )
    result = run([agent_venv.python, "-c", script], env=agent_venv.env())
    collections_path, trust_file = result.stdout.split()
    assert Path(collections_path).parent.name == "meridian_node_agent"
    assert Path(collections_path).name == "collection"
    assert trust_file == f"{collections_path}/ansible_collections/meridian/node/plugins/module_utils/trust/verify.py"


def test_the_collection_is_not_importable_without_the_agent(agent_venv: AgentVenv) -> None:
    # Nothing in site-packages answers for ansible_collections.meridian: only the agent's own sys.path entry.
    result = run([agent_venv.python, "-c", "import ansible_collections.meridian.node"], env=agent_venv.env(), expect=1)
    assert "ModuleNotFoundError: No module named 'ansible_collections'" in result.stderr


def test_check_config_with_metrics_but_without_prometheus_client_names_the_extra(
    agent_venv: AgentVenv, tmp_path: Path
) -> None:
    write_managed_host_policy(tmp_path)
    (tmp_path / "without-metrics.yaml").write_text(yaml.safe_dump(MANAGED_HOST_CONFIG))
    metrics = {"listen": "127.0.0.1:9100"}
    (tmp_path / "with-metrics.yaml").write_text(yaml.safe_dump({**MANAGED_HOST_CONFIG, "metrics": metrics}))
    check: list[str | Path] = [agent_venv.bin("meridian-node"), "--config"]
    accepted = run([*check, tmp_path / "without-metrics.yaml", "check-config"], env=agent_venv.env())
    assert accepted.stdout.endswith("ok\n")
    refused = run([*check, tmp_path / "with-metrics.yaml", "check-config"], env=agent_venv.env(), expect=1)
    assert "metrics.listen is '127.0.0.1:9100'" in refused.stderr
    assert "install meridian-node[metrics]" in refused.stderr
