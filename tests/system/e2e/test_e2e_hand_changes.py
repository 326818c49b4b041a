"""An engine changed by hand is converged back by meridian.node.engine_instance (real ansible-playbook, real
Docker Engine): ``docker update`` keeps every label, and a container recreated by hand can carry ours, so
the config hash alone would call both converged. Each is checked in the four steps, check mode first on
its own so that what it left behind can be looked at.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from ansible_collections.meridian.node.plugins.module_utils.docker.engine import LABEL_CONFIG_HASH, LABEL_SETTINGS
from ansible_collections.meridian.node.tests.support.engine_harness import SERVER, Host, free_port
from ansible_collections.meridian.node.tests.support.standin_image import LocalImage, ensure_engine_image

pytestmark = [pytest.mark.docker, pytest.mark.slow]

REPLACE = ["drain", "stop", "set-aside", "create", "start", "wait-ready", "remove-old"]
MIB = 1024 * 1024


@pytest.fixture
def host(tmp_path: Path, docker_client: Any) -> Host:
    return Host(tmp_path, docker_client)


@pytest.fixture(scope="module")
def vllm(docker_client: Any, standin_base_image: LocalImage) -> LocalImage:
    return ensure_engine_image(docker_client, standin_base_image, SERVER, engine="vllm")


@dataclass(frozen=True)
class Started:
    name: str
    params: dict[str, Any]  # engine_instance's, to converge it back with
    container: Any  # as engine_instance created it, before the hand change


@pytest.fixture
def started(host: Host, vllm: LocalImage, prefix: str) -> Started:
    """An engine that engine_instance created, started and saw ready: what each test then changes by hand."""
    name = f"{prefix}-engine"
    params = host.params(
        name=name,
        driver="vllm",
        image=vllm.pinned,
        model={"artifact": "tiny"},
        port=free_port(),
        secret_env={"API_TOKEN": "tok-a1b2c3-hand-changes"},
    )
    result = host.play([("apply", params, False)])["apply"]
    assert not result.get("failed") and result["done"] == ["create", "start", "wait-ready"], result
    return Started(name, params, host.container(name))


def _converged_back(host: Host, params: Mapping[str, Any], drifted: list[str]) -> dict[str, Any]:
    """apply, idempotent, idempotent-check after a check already ran: the replace, then nothing."""
    results = host.play([("apply", params, False), ("idempotent", params, False), ("idem-check", params, True)])
    for label, result in results.items():
        assert not result.get("failed"), (label, result.get("msg"))
    assert (results["apply"]["done"], results["apply"]["drifted"]) == (REPLACE, drifted)
    assert results["apply"]["ready"] is True
    for label in ("idempotent", "idem-check"):
        assert (results[label]["changed"], results[label]["actions"], results[label]["drifted"]) == (False, [], [])
    return results


def test_docker_update_of_restart_policy_and_memory_is_reported_in_check_mode_then_put_back(
    host: Host, started: Started
) -> None:
    name, params, container = started.name, started.params, started.container
    container.update(restart_policy={"Name": "no"}, mem_limit=300 * MIB, memswap_limit=600 * MIB)

    check = host.play([("check", params, True)])["check"]

    assert not check.get("failed"), check.get("msg")
    assert (check["changed"], check["actions"], check["done"]) == (True, REPLACE, [])
    assert check["drifted"] == ["restart_policy", "memory"]
    assert check["diff"]["before"]["settings"] == {"restart_policy": ["no", 0], "memory": [300 * MIB, 0, 600 * MIB, 0]}
    assert check["diff"]["after"]["settings"] == {"restart_policy": ["unless-stopped", 0], "memory": [0, 0, 0, 0]}
    container.reload()  # check mode changed nothing
    assert host.container(name).id == container.id and container.attrs["HostConfig"]["Memory"] == 300 * MIB

    results = _converged_back(host, params, ["restart_policy", "memory"])

    replaced = host.container(name)
    assert replaced.id != container.id and replaced.id == results["idempotent"]["container"]["id"]
    config = replaced.attrs["HostConfig"]
    assert (config["RestartPolicy"]["Name"], config["Memory"], config["MemorySwap"]) == ("unless-stopped", 0, 0)


def test_a_container_recreated_by_hand_with_our_labels_copied_is_replaced(
    host: Host, started: Started, docker_client: Any
) -> None:
    name, params, original = started.name, started.params, started.container
    labels = dict(original.labels)
    ports = original.attrs["HostConfig"]["PortBindings"]
    original.remove(force=True)
    # Same name, image and labels (the config hash and the settings digests included), other settings.
    forged = docker_client.containers.create(
        original.attrs["Image"],
        name=name,
        labels=labels,
        command=original.attrs["Config"]["Cmd"],
        volumes=[f"{m['Source']}:{m['Destination']}:ro" for m in original.attrs["Mounts"]],
        environment=["API_TOKEN=tok-a1b2c3-hand-changes", "STANDIN_EXTRA=1"],
        ports={"8000/tcp": (ports["8000/tcp"][0]["HostIp"], int(ports["8000/tcp"][0]["HostPort"]))},
        init=True,
        cap_add=["NET_ADMIN"],
    )
    forged.start()
    assert forged.labels[LABEL_CONFIG_HASH] == labels[LABEL_CONFIG_HASH] and LABEL_SETTINGS in forged.labels

    check = host.play([("check", params, True)])["check"]

    # What `docker create` did not copy (the driver's /dev/shm, stop timeout and restart policy, the mount
    # as a Mount) is a change too, beside what was changed on purpose.
    expected = ["env", "mounts", "restart_policy", "shm_size", "stop", "capabilities"]
    assert (check["changed"], check["actions"], check["drifted"]) == (True, REPLACE, expected), check
    # The env difference is named, its value never shown.
    assert check["diff"]["before"]["settings"]["env"] == ["STANDIN_EXTRA"]
    assert "tok-a1b2c3" not in repr(check["diff"])
    assert host.container(name).id == forged.id

    _converged_back(host, params, expected)

    replaced = host.container(name)
    assert replaced.id != forged.id and replaced.attrs["HostConfig"]["CapAdd"] is None
