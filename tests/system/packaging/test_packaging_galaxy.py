"""One distribution story: beside the agent's wheel, the Galaxy install of the built tarball is what Ansible
uses, and the agent keeps running the copy that shipped with it."""

from __future__ import annotations

import json
import re
import tarfile
from pathlib import Path

import pytest
import yaml

from ansible_collections.meridian.node.tests.system.packaging.packaging_env import CHECKOUT, AgentVenv, run

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def galaxy_install(agent_venv: AgentVenv, collection_tarball: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tarball installed with the agent venv's ansible-galaxy, as an operator would on that host."""
    collections = tmp_path_factory.mktemp("galaxy-collections")
    result = run(
        [agent_venv.bin("ansible-galaxy"), "collection", "install", "-p", collections, collection_tarball],
        env=agent_venv.env(ANSIBLE_COLLECTIONS_PATH=str(collections)),
    )
    # With the wheel's copy at site-packages/ansible_collections this said "Nothing to do" and installed nothing.
    assert "Nothing to do" not in result.stdout
    assert re.search(r"meridian\.node:\S+ was installed successfully", result.stdout), result.stdout
    return collections


def test_galaxy_copy_is_the_only_one_ansible_lists(agent_venv: AgentVenv, galaxy_install: Path) -> None:
    result = run(
        [agent_venv.bin("ansible-galaxy"), "collection", "list", "meridian.node", "--format", "json"],
        env=agent_venv.env(ANSIBLE_COLLECTIONS_PATH=str(galaxy_install)),
    )
    listed = json.loads(result.stdout)
    assert list(listed) == [str(galaxy_install / "ansible_collections")]


def test_ansible_doc_reads_the_galaxy_copy(agent_venv: AgentVenv, galaxy_install: Path) -> None:
    result = run(
        [agent_venv.bin("ansible-doc"), "--json", "-t", "module", "meridian.node.gpu_facts"],
        env=agent_venv.env(ANSIBLE_COLLECTIONS_PATH=str(galaxy_install)),
    )
    doc = json.loads(result.stdout)["meridian.node.gpu_facts"]["doc"]
    assert doc["filename"] == str(galaxy_install / "ansible_collections/meridian/node/plugins/modules/gpu_facts.py")


def test_ansible_playbook_runs_the_galaxy_copy(agent_venv: AgentVenv, galaxy_install: Path, tmp_path: Path) -> None:
    playbook = tmp_path / "facts.yml"
    playbook.write_text(
        yaml.safe_dump(
            [{"hosts": "localhost", "gather_facts": False, "tasks": [{"meridian.node.gpu_facts": {}}]}],
        )
    )
    result = run(
        [agent_venv.bin("ansible-playbook"), "-vvv", "-i", "localhost,", "-c", "local", playbook],
        env=agent_venv.env(
            ANSIBLE_COLLECTIONS_PATH=str(galaxy_install), ANSIBLE_PYTHON_INTERPRETER=str(agent_venv.python)
        ),
    )
    used = re.findall(r"^Using module file (\S+)$", result.stdout, re.MULTILINE)
    assert used == [str(galaxy_install / "ansible_collections/meridian/node/plugins/modules/gpu_facts.py")]


def test_agent_keeps_its_own_copy_beside_a_galaxy_install(agent_venv: AgentVenv, galaxy_install: Path) -> None:
    result = run(
        [agent_venv.python, "-c", "import meridian_node_agent.apply.applier as a; print(a.collection_paths()[0])"],
        env=agent_venv.env(ANSIBLE_COLLECTIONS_PATH=str(galaxy_install)),
    )
    assert result.stdout.strip().endswith("/meridian_node_agent/collection")


def test_tarball_ships_what_galaxy_yml_lists(collection_tarball: Path) -> None:
    with tarfile.open(collection_tarball) as archive:
        names = {member.name for member in archive.getmembers() if member.isfile()}
    assert {"MANIFEST.json", "FILES.json", "meta/runtime.yml", "tests/config.yml", "playbooks/reconcile.yml"} <= names
    # Only tests/config.yml of tests/ ships, whatever folders tests/ grows.
    assert sorted(name for name in names if name.startswith("tests/")) == ["tests/config.yml"]
    # One dotfile ships on purpose: ansible-lint's config (tests/system/packaging/test_packaging_lint.py).
    dotted = [name for name in names if "__pycache__" in name or "/." in name or name.startswith(".")]
    assert dotted == [".ansible-lint"]
    modules = {name.removeprefix("plugins/modules/") for name in names if name.startswith("plugins/modules/")}
    assert modules == {path.name for path in (CHECKOUT / "plugins" / "modules").glob("*.py")}
    for role in (CHECKOUT / "roles").iterdir():
        expected = {str(path.relative_to(CHECKOUT)) for path in role.rglob("*") if path.is_file()}
        assert expected <= names, f"{role.name}: {sorted(expected - names)} missing from the tarball"
