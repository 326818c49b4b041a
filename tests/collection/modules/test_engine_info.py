"""meridian.node.engine_info run by ansible-playbook on the real Docker Engine.

One engine of ours (the stand-in vLLM through meridian.node.engine_instance, marked draining for the test),
one container with our labels but another owner, and one foreign container that looks
like an Ollama engine (its port published) share the host; the module must list them, tell them apart, and
change none of them, in check mode too. Containers carry the test's random
prefix and are removed afterwards, pass or fail.
"""

from __future__ import annotations

import json
import secrets
from pathlib import Path
from typing import Any

import pytest

from ansible_collections.meridian.node.plugins.module_utils.docker.engine import (
    LABEL_DRIVER,
    LABEL_INSTANCE,
    LABEL_OWNED,
)
from ansible_collections.meridian.node.plugins.module_utils.engines.drain_marks import mark_draining
from ansible_collections.meridian.node.plugins.module_utils.engines.labels import LABEL_OWNER
from ansible_collections.meridian.node.tests.support.engine_harness import (
    BIND,
    PORTS,
    SERVER,
    Host,
    free_port,
    run_playbook,
)
from ansible_collections.meridian.node.tests.support.standin_image import LocalImage, ensure_engine_image
from ansible_collections.meridian.node.tests.support.trust_fixtures import make_key, write_policy

pytestmark = [pytest.mark.docker, pytest.mark.slow]


def _snapshot(client: Any, prefix: str) -> dict[str, tuple[str, str]]:
    """(id, status) of every container with the prefix: what 'nothing changed' is checked against."""
    return {c.name: (c.id, c.status) for c in client.containers.list(all=True, filters={"name": prefix})}


def _engine_info(host: Host, tasks: list[dict[str, Any]]) -> dict[str, Any]:
    out = host.root / f"info-{secrets.token_hex(4)}.json"
    names = [task["register"] for task in tasks]
    collected = ", ".join(f"{json.dumps(name)}: {name}" for name in names)
    playbook = host.root / "info.yml"
    save = {"ansible.builtin.copy": {"content": "{{ {" + collected + "} | to_json }}", "dest": str(out)}}
    playbook.write_text(
        json.dumps([{"hosts": "localhost", "gather_facts": False, "tasks": [*tasks, {**save, "check_mode": False}]}])
    )
    proc = run_playbook(playbook, temp_dir=host.root / "ansible-tmp")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    results: dict[str, Any] = json.loads(out.read_text())
    return results


def test_engine_info_lists_our_engine_and_a_foreign_one_and_changes_neither(
    tmp_path: Path, docker_client: Any, standin_base_image: LocalImage, prefix: str
) -> None:
    host = Host(tmp_path, docker_client)
    image = ensure_engine_image(docker_client, standin_base_image, SERVER, engine="vllm")
    ours, port = f"{prefix}-chat", free_port()
    applied = host.play(
        [
            (
                "apply",
                host.params(
                    name=ours,
                    driver="vllm",
                    image=image.pinned,
                    model={"name": "tiny"},
                    served_model_name="tiny-chat",
                    port=port,
                    owner="agent:node-1",
                ),
                False,
            )
        ]
    )["apply"]
    assert applied["ready"] is True, applied
    mark_draining(str(host.state_dir), ours, reason="test")
    # Not ours (no labels), but its published port is the one only Ollama uses by default.
    foreign = f"{prefix}-theirs"
    docker_client.containers.run(
        standin_base_image.id,
        ["sleep", "300"],
        name=foreign,
        detach=True,
        init=True,
        ports={"11434/tcp": (BIND, None)},
    )
    # Ours by its labels, but converged by another owner (another agent sharing this Docker Engine).
    elsewhere = f"{prefix}-elsewhere"
    labels = {LABEL_OWNED: "true", LABEL_INSTANCE: elsewhere, LABEL_DRIVER: "vllm", LABEL_OWNER: "agent:node-2"}
    docker_client.containers.create(standin_base_image.id, ["sleep", "300"], name=elsewhere, labels=labels)
    before = _snapshot(docker_client, prefix)
    common = {"policy": str(host.policy), "state_dir": str(host.state_dir)}

    results = _engine_info(
        host,
        [
            {"name": "all", "meridian.node.engine_info": common, "register": "everything"},
            {
                "name": "ours in check mode",
                "meridian.node.engine_info": {**common, "managed_only": True, "probe": False, "capacity": False},
                "check_mode": True,
                "register": "ours_only",
            },
            {
                "name": "node-1's agent's engines",
                "meridian.node.engine_info": {**common, "owner": "agent:node-1", "capacity": False},
                "register": "owned",
            },
        ],
    )

    everything, ours_only = results["everything"], results["ours_only"]
    assert (everything["changed"], ours_only["changed"]) == (False, False)
    listed = {e["name"]: e for e in everything["engines"] if e["name"].startswith(prefix)}
    assert listed[ours] == {
        "name": ours,
        "managed": True,
        "driver": "vllm",
        "image": image.pinned,
        "state": "running",
        "ready": True,
        "draining": True,
        "port": port,
        "served_model_name": "tiny-chat",
        "gpus": [],
        "min_vram_mib": 0,
    }
    theirs = listed[foreign]
    assert (theirs["managed"], theirs["driver"], theirs["state"]) == (False, "ollama", "running")
    assert theirs["ready"] is False  # nothing answers behind its port
    assert theirs["draining"] is False
    # Ours first, then foreign ones: the order a reader (and the reconcile playbook) relies on.
    names = [e["name"] for e in everything["engines"]]
    assert names.index(ours) < names.index(foreign)
    room = everything["capacity"]
    assert room["vram_free_mib"] == {}  # no NVML on this host
    assert port not in room["free_ports"]
    assert room["free_ports"] and all(PORTS[0] <= p <= PORTS[1] for p in room["free_ports"])

    assert listed[elsewhere]["managed"] is True and listed[elsewhere]["state"] == "created"

    mine = [e for e in ours_only["engines"] if e["name"].startswith(prefix)]
    assert [(e["name"], e["managed"], e["ready"]) for e in mine] == [(ours, True, False), (elsewhere, True, False)]
    assert all(e["managed"] for e in ours_only["engines"])
    assert ours_only["capacity"] is None
    owned = [e["name"] for e in results["owned"]["engines"] if e["name"].startswith(prefix)]
    assert owned == [ours]
    assert _snapshot(docker_client, prefix) == before


def test_engine_info_lists_without_a_policy_file_and_fails_on_a_broken_one(
    tmp_path: Path, docker_client: Any, standin_base_image: LocalImage, prefix: str
) -> None:
    # A host looked at before any policy is installed: the listing needs none (issue 25).
    host = Host(tmp_path, docker_client)
    foreign = f"{prefix}-theirs"
    docker_client.containers.run(
        standin_base_image.id, ["sleep", "300"], name=foreign, detach=True, init=True, ports={"11434/tcp": (BIND, None)}
    )
    missing = tmp_path / "nowhere" / "policy.yaml"
    common = {"policy": str(missing), "state_dir": str(host.state_dir), "probe": False}

    results = _engine_info(
        host,
        [
            {"name": "plain listing", "meridian.node.engine_info": common, "register": "plain"},
            {
                "name": "owner, no capacity",
                "meridian.node.engine_info": {**common, "owner": "agent:node-1", "capacity": False},
                "register": "scoped",
            },
        ],
    )

    plain = results["plain"]
    listed = {e["name"]: e for e in plain["engines"]}
    assert (listed[foreign]["managed"], listed[foreign]["driver"]) == (False, "ollama")
    assert plain["capacity"] == {"vram_free_mib": {}, "free_ports": None}
    (warning,) = plain["warnings"]
    assert f"no policy at {missing}" in warning and "engines.port_range" in warning and "policy=" in warning
    assert (results["scoped"]["engines"], results["scoped"]["capacity"]) == ([], None)
    assert not results["scoped"].get("warnings")

    broken = tmp_path / "broken.yaml"
    broken.write_text("trust: [not, a, mapping\n")
    playbook = tmp_path / "bad.yml"
    task = {"meridian.node.engine_info": {**common, "policy": str(broken)}}
    playbook.write_text(json.dumps([{"hosts": "localhost", "gather_facts": False, "tasks": [task]}]))
    proc = run_playbook(playbook, temp_dir=tmp_path / "ansible-tmp")
    assert proc.returncode != 0
    assert "Error reading the policy" in proc.stdout
    assert str(broken) in proc.stdout


def test_host_without_docker_lists_no_engines_under_a_policy_that_allows_none_and_fails_otherwise(
    tmp_path: Path,
) -> None:
    # An artifacts-only host: its policy allows no image, and no Docker Engine answers at DOCKER_HOST.
    policy = write_policy(tmp_path / "etc", control=[make_key()])
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    out = tmp_path / "out.json"
    common = {"policy": str(policy), "state_dir": str(state_dir), "capacity": False}
    tasks = [
        {"meridian.node.engine_info": {**common, "owner": "agent:node-1"}, "register": "scoped"},
        {"ansible.builtin.copy": {"content": "{{ scoped | to_json }}", "dest": str(out)}},
        {"meridian.node.engine_info": {**common, "managed_only": True}},
    ]
    playbook = tmp_path / "no-docker.yml"
    playbook.write_text(json.dumps([{"hosts": "localhost", "gather_facts": False, "tasks": tasks}]))

    proc = run_playbook(
        playbook,
        temp_dir=tmp_path / "ansible-tmp",
        extra_env={"DOCKER_HOST": f"unix://{tmp_path / 'no-docker.sock'}"},
    )

    scoped = json.loads(out.read_text())
    assert (scoped["changed"], scoped["engines"], scoped["capacity"]) == (False, [], None)
    # Asked for every engine of ours, it must say Docker is missing rather than answer "none".
    assert proc.returncode != 0
    assert "Error connecting to the Docker Engine" in proc.stdout
