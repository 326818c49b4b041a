"""playbooks/maintenance.yml on the real Docker Engine: cordon, work while held, lift; failed work stays cordoned.

A node cordon holds every meridian.node engine on the Docker Engine it talks to: assertions are about this
test's engine, and a test that leaves the cordon in force lifts it afterwards, giving back any other. Under
pytest-xdist it runs alone, after everything else (group engine-wide, tests/support/parallel.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ansible_collections.meridian.node.plugins.module_utils.docker.engine import DockerEngine
from ansible_collections.meridian.node.plugins.module_utils.engines.cordon import CordonOptions, cordon_host
from ansible_collections.meridian.node.plugins.module_utils.engines.cordon_file import read_cordon
from ansible_collections.meridian.node.tests.support.engine_harness import (
    REPO,
    SERVER,
    Host,
    free_port,
    run_playbook,
)
from ansible_collections.meridian.node.tests.support.standin_image import LocalImage, ensure_engine_image

pytestmark = [pytest.mark.docker, pytest.mark.slow]


@pytest.fixture
def engine(tmp_path: Path, docker_client: Any, standin_base_image: LocalImage, prefix: str) -> tuple[Host, str]:
    host = Host(tmp_path, docker_client)
    image = ensure_engine_image(docker_client, standin_base_image, SERVER, engine="ollama")
    name = f"{prefix}-llm"
    params = host.params(name=name, driver="ollama", image=image.pinned, model={"name": "tiny"}, port=free_port())
    assert host.play([("start", params, False)])["start"].get("ready") is True
    return host, name


def maintain(host: Host, work: str, **extra: Any) -> tuple[int, str]:
    tasks = host.root / "work.yml"
    tasks.write_text(work)
    inventory = host.root / "inventory.ini"
    inventory.write_text(f"[gpu_hosts]\nnode-a state_dir={host.state_dir}\n")
    variables = {"maintenance_tasks": str(tasks), "drain_timeout": 30, **extra}
    proc = run_playbook(
        REPO / "playbooks" / "maintenance.yml",
        temp_dir=host.root / "ansible-tmp",
        extra_args=["-i", str(inventory), "-e", json.dumps(variables)],
    )
    return proc.returncode, proc.stdout + proc.stderr


def test_work_runs_while_the_engine_is_held_and_the_lift_starts_it_again(engine: tuple[Host, str]) -> None:
    host, name = engine
    seen = host.root / "seen-during-work.json"
    work = f"""
- name: Look at the host while it is cordoned
  ansible.builtin.command: docker inspect {name}
  register: inspected
  changed_when: false
- name: Keep what was seen
  ansible.builtin.copy:
    content: "{{{{ {{'status': status, 'cordon': cordon}} | to_json }}}}"
    dest: {seen}
    mode: "0644"
  vars:
    status: "{{{{ (inspected.stdout | from_json | first).State.Status }}}}"
    cordon: "{{{{ lookup('file', '{host.state_dir}/cordon.json') | from_json }}}}"
"""
    rc, out = maintain(host, work, maintenance_reason="driver update")

    assert rc == 0, out[-4000:]
    during = json.loads(seen.read_text())
    assert during["status"] == "exited", "the work ran while the engine was still serving"
    assert name in during["cordon"]["held"]
    assert during["cordon"]["reason"] == "driver update"
    assert read_cordon(str(host.state_dir)) is None
    assert host.container(name).status == "running"
    assert f"started {name}" in out


def test_failed_work_leaves_the_host_cordoned_and_its_engine_held(engine: tuple[Host, str]) -> None:
    host, name = engine
    work = "- name: The work fails\n  ansible.builtin.fail:\n    msg: firmware flash failed\n"

    try:
        rc, out = maintain(host, work)
        cordon = read_cordon(str(host.state_dir))
        status = host.container(name).status
    finally:
        # A node cordon holds every engine of ours on this Docker Engine, other tests' too: give them back.
        lift(host)

    assert rc != 0
    assert "firmware flash failed" in out
    assert cordon is not None and name in cordon.held
    assert status == "exited"


def lift(host: Host) -> None:
    engine = DockerEngine.from_env()
    try:
        cordon_host(
            CordonOptions(state="absent", state_dir=str(host.state_dir)),
            engine=engine,
            gpu_facts=dict,
            check_mode=False,
        )
    finally:
        engine.close()
