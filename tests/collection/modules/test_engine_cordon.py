"""engine_set and engine_instance under a cordon, on the real Docker Engine with stand-in engines.

A draining cordon holds the engines it covers stopped (drained first), never creates them, and keeps them from
the owner's prune; lifting it starts them again and clears the cordon's marks. A cordon without drain refuses
new engines and leaves running ones serving.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from ansible_collections.meridian.node.plugins.module_utils.engines.cordon_file import HostCordon, write_cordon
from ansible_collections.meridian.node.plugins.module_utils.engines.drain_marks import read_mark
from ansible_collections.meridian.node.tests.support.engine_harness import Host, free_ports
from ansible_collections.meridian.node.tests.support.standin_image import LocalImage

pytestmark = [pytest.mark.docker, pytest.mark.slow]


def engine(image: LocalImage, name: str, port: int) -> dict[str, Any]:
    return {"name": name, "driver": "vllm", "image": image.pinned, "model": {"name": "tiny"}, "port": port}


def play_set(host: Host, steps: Sequence[tuple[str, Mapping[str, Any], bool]]) -> dict[str, Any]:
    with_paths = [
        (label, {"policy": str(host.policy), "state_dir": str(host.state_dir), "drain_grace": 1, **params}, check)
        for label, params, check in steps
    ]
    return host.play_module("meridian.node.engine_set", with_paths)[0]


def status(host: Host, name: str) -> str | None:
    container = host.container(name)
    return None if container is None else str(container.status)


def test_a_draining_node_cordon_in_the_set_holds_its_engines_and_lifting_it_brings_them_back(
    host: Host, vllm: LocalImage, prefix: str
) -> None:
    one, two = free_ports(2)
    running = engine(vllm, f"{prefix}-a", one)
    owner = {"owner": f"{prefix}-owner", "prune": True}
    started = play_set(host, [("start", {"engines": [running], **owner}, False)])["start"]
    assert not started.get("failed"), started.get("msg")

    newcomer = engine(vllm, f"{prefix}-b", two)
    cordoned = {"engines": [running, newcomer], "cordon": {"drain": True, "reason": "rack work"}, **owner}
    results = play_set(
        host,
        [("check", cordoned, True), ("hold", cordoned, False), ("again", cordoned, False), ("recheck", cordoned, True)],
    )
    for label, result in results.items():
        assert not result.get("failed"), (label, result.get("msg"))
    check, held = results["check"], results["hold"]
    assert check["changed"] is True
    assert check["engines"][running["name"]]["actions"] == ["mark", "wait", "stop"]
    assert held["changed"] is True
    assert held["engines"][running["name"]]["held"] == {"by": "desired-state", "reason": "rack work", "gpus": []}
    assert held["engines"][newcomer["name"]]["actions"] == [], "a new engine is not created on a cordoned node"
    assert held["pruned"] == [], "a held engine is still listed: never pruned"
    assert held["diff"]["after"][running["name"]]["state"] == "stopped"
    for label in ("again", "recheck"):
        assert results[label]["changed"] is False, results[label]
    assert status(host, running["name"]) == "exited"
    assert status(host, newcomer["name"]) is None
    mark = read_mark(str(host.state_dir), running["name"])
    assert mark is not None and mark.reason == "cordoned: rack work"

    lifted = {"engines": [running, newcomer], **owner}
    results = play_set(host, [("check", lifted, True), ("lift", lifted, False), ("again", lifted, False)])
    for label, result in results.items():
        assert not result.get("failed"), (label, result.get("msg"))
    assert results["check"]["changed"] is True
    assert "unmark" in results["check"]["engines"][running["name"]]["actions"]
    assert results["lift"]["engines"][running["name"]]["actions"] == ["start", "wait-ready", "unmark"]
    assert results["again"]["changed"] is False, results["again"]
    assert status(host, running["name"]) == "running"
    assert status(host, newcomer["name"]) == "running"
    assert read_mark(str(host.state_dir), running["name"]) is None


def test_a_host_cordon_without_drain_refuses_new_engines_and_leaves_running_ones_serving(
    host: Host, vllm: LocalImage, prefix: str
) -> None:
    one, two = free_ports(2)
    running = host.params(**engine(vllm, f"{prefix}-a", one))
    assert host.play([("start", running, False)])["start"].get("ready") is True
    write_cordon(str(host.state_dir), HostCordon(drain=False, reason="waiting for a fan"))

    newcomer = host.params(**engine(vllm, f"{prefix}-b", two))
    results = host.play([("same", running, False), ("check-new", newcomer, True), ("new", newcomer, False)])

    assert results["same"]["changed"] is False, results["same"]
    for label in ("check-new", "new"):
        assert results[label]["failed"] is True
        assert results[label]["check"] == "placement-cordoned"
        assert "cordoned node (the whole node, by policy: waiting for a fan)" in results[label]["msg"]
    assert status(host, running["name"]) == "running"
    assert status(host, newcomer["name"]) is None


def test_engine_instance_holds_an_engine_under_a_draining_host_cordon(
    host: Host, vllm: LocalImage, prefix: str
) -> None:
    (port,) = free_ports(1)
    params = host.params(**engine(vllm, f"{prefix}-a", port), drain_grace=1)
    assert host.play([("start", params, False)])["start"].get("ready") is True
    write_cordon(str(host.state_dir), HostCordon(drain=True, reason="driver update"))

    results = host.play([("hold", params, False), ("again", params, False)])

    assert results["hold"]["changed"] is True, results["hold"]
    assert results["hold"]["held"]["reason"] == "driver update"
    assert results["again"]["changed"] is False
    assert status(host, params["name"]) == "exited"


def test_a_gpu_cordon_by_index_refuses_an_engine_asking_for_that_gpu_by_uuid_even_with_force(
    host: Host, vllm: LocalImage, prefix: str
) -> None:
    (port,) = free_ports(1)
    # GPU 1 of the fake eight-gpus scenario; the policy cordons it by index.
    write_cordon(str(host.state_dir), HostCordon(gpus=("1",), reason="fan"))
    params = host.params(
        **engine(vllm, f"{prefix}-on-1", port), gpus=["GPU-5a9c0e41-3b7d-4e2a-9f18-6c2d8b1e4a02"], force=True
    )
    elsewhere = host.params(**engine(vllm, f"{prefix}-on-7", port), gpus=["7"])

    results = host.play(
        [("check", params, True), ("apply", params, False), ("other", elsewhere, True)], nvml="eight-gpus"
    )

    for label in ("check", "apply"):
        assert results[label]["failed"] is True
        assert results[label]["check"] == "placement-cordoned", results[label]["msg"]
    # GPU 7 is not cordoned: placement goes on to the next check (this machine has no NVIDIA runtime).
    assert results["other"]["check"] == "placement-runtime", results["other"]["msg"]
    assert status(host, params["name"]) is None
