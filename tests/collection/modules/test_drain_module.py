"""meridian.node.drain run by ansible-playbook on the real Docker Engine, against stand-in engines.

Engines are started with meridian.node.engine_instance (the harness of test_engine_instance_module), then
drained in one playbook per scenario whose registered results the test reads back. Every container
carries the test's random prefix and is removed afterwards, pass or fail.
"""

from __future__ import annotations

import threading
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from ansible_collections.meridian.node.tests.support.engine_harness import (
    BIND,
    Host,
    engine_images,
    hold_requests,
    stuck_requests,
    watch_mark,
)
from ansible_collections.meridian.node.tests.support.standin_image import LocalImage

pytestmark = [pytest.mark.docker, pytest.mark.slow]

Step = tuple[str, str, Mapping[str, Any], bool]  # label, module, params, check_mode


@pytest.fixture(scope="module")
def images(docker_client: Any, standin_base_image: LocalImage) -> dict[str, LocalImage]:
    return engine_images(docker_client, standin_base_image, ("vllm", "ollama"))


def play(host: Host, steps: Sequence[Step]) -> dict[str, Any]:
    """Run the steps in one ansible-playbook; every step's registered result by label."""
    return host.play_steps(
        [(label, f"meridian.node.{module}", params, check) for label, module, params, check in steps]
    )[0]


def drain(host: Host, name: str, **options: Any) -> dict[str, Any]:
    return {"name": name, "state_dir": str(host.state_dir), **options}


def mark_of(host: Host, name: str) -> Path:
    return host.state_dir / "draining" / f"{name}.json"


def serves(port: int) -> bool:
    with urllib.request.urlopen(f"http://{BIND}:{port}/v1/models", timeout=5) as response:
        return bool(response.status == 200)


def test_drain_lets_eight_slow_requests_finish_marks_draining_first_then_stops(
    host: Host, images: dict[str, LocalImage], prefix: str
) -> None:
    name = f"{prefix}-eight"
    engine, _applied = host.started(images, name, "vllm", model={"name": "tiny"})
    # vLLM aborts requests in flight on SIGTERM: only waiting for the gauges keeps these 8 alive. They last
    # long enough for the check run and the start of the apply run to come first on a loaded 2-core machine.
    threads, outcomes = hold_requests(engine["port"], 8, seconds=12)
    stop = threading.Event()
    seen: list[float] = []
    watcher = threading.Thread(target=watch_mark, args=(mark_of(host, name), stop, seen))
    watcher.start()
    params = drain(host, name, timeout=60)
    try:
        results = play(
            host,
            [
                ("check", "drain", params, True),
                ("apply", "drain", params, False),
                ("idempotent", "drain", params, False),
                ("idem-check", "drain", params, True),
            ],
        )
    finally:
        stop.set()
        watcher.join()
        for thread in threads:
            thread.join(timeout=60)

    for label, result in results.items():
        assert not result.get("failed"), (label, result.get("msg"))
    assert results["check"]["changed"] is True
    assert results["check"]["actions"] == ["mark", "wait", "stop"]
    assert results["check"]["stopped"] is False
    applied = results["apply"]
    assert applied["changed"] is True
    assert applied["drained_by"] == "metrics"
    assert applied["in_flight"] == {"running": 0, "waiting": 0}
    assert applied["stopped"] is True
    assert applied["container"]["status"] == "exited"
    assert [status for status, _at in outcomes] == [200] * 8
    assert seen, "the engine was never marked draining"
    assert seen[0] < min(at for _status, at in outcomes), "marked draining only after a request finished"
    for label in ("idempotent", "idem-check"):
        assert results[label]["changed"] is False, results[label]
        assert results[label]["actions"] == []
    assert mark_of(host, name).exists()
    assert host.container(name).status == "exited"


def test_drain_timeout_without_force_fails_and_leaves_it_running_then_force_stops_it(
    host: Host, images: dict[str, LocalImage], prefix: str
) -> None:
    name = f"{prefix}-stuck"
    engine, applied = host.started(images, name, "vllm", model={"name": "tiny"})
    with stuck_requests(host, applied["container"]["id"], engine["port"], 2) as outcomes:
        timed_out = play(host, [("timeout", "drain", drain(host, name, timeout=2), False)])["timeout"]
        running = host.container(name).status
        forced = play(host, [("force", "drain", drain(host, name, timeout=1, force=True), False)])["force"]

    assert timed_out["failed"] is True
    assert "drain timed out after 2s (2 running, 0 waiting)" in timed_out["msg"]
    assert timed_out["in_flight"] == {"running": 2, "waiting": 0}
    assert timed_out["stopped"] is False
    assert running == "running"
    assert not forced.get("failed"), forced.get("msg")
    assert forced["stopped"] is True
    assert forced["in_flight"] == {"running": 2, "waiting": 0}
    assert forced["container"]["status"] == "exited"
    # vLLM drops what is in flight on SIGTERM: forcing is what loses these two, and the result said so.
    assert all(status != 200 for status, _at in outcomes)


def test_engine_without_metrics_waits_grace_absent_and_drained_are_unchanged_and_undrain_restores(
    host: Host, images: dict[str, LocalImage], prefix: str
) -> None:
    name = f"{prefix}-ollama"
    engine, _applied = host.started(images, name, "ollama", model={"name": "tiny"})
    keep_serving = drain(host, name, stop=False, grace=1)
    undrain = drain(host, name, state="undrained")
    results = play(
        host,
        [
            ("drain", "drain", keep_serving, False),
            ("drained again", "drain", keep_serving, False),
            ("absent", "drain", drain(host, f"{prefix}-nothing"), False),
            ("undrain check", "drain", undrain, True),
            ("undrain", "drain", undrain, False),
            ("undrain again", "drain", undrain, False),
        ],
    )

    for label, result in results.items():
        assert not result.get("failed"), (label, result.get("msg"))
    drained = results["drain"]
    assert drained["changed"] is True
    assert drained["drained_by"] == "grace"
    assert drained["waited_s"] >= 1
    assert drained["in_flight"] is None
    assert drained["stopped"] is False
    assert results["drained again"]["changed"] is False
    assert results["drained again"]["draining"] is True
    assert results["absent"]["changed"] is False
    assert results["absent"]["container"] is None
    assert results["undrain check"]["changed"] is True
    assert results["undrain check"]["actions"] == ["unmark"]
    assert results["undrain"]["changed"] is True
    assert results["undrain"]["draining"] is False
    assert results["undrain again"]["changed"] is False
    assert not mark_of(host, name).exists()
    assert host.container(name).status == "running"
    assert serves(engine["port"])


def test_foreign_container_with_the_name_is_not_drained(
    host: Host, images: dict[str, LocalImage], prefix: str, docker_client: Any
) -> None:
    name = f"{prefix}-foreign"
    foreign = docker_client.containers.create(images["ollama"].id, name=name)
    result = play(host, [("drain", "drain", drain(host, name), False)])["drain"]

    assert result["failed"] is True
    assert "not managed by meridian.node" in result["msg"]
    assert not mark_of(host, name).exists()
    foreign.reload()
    assert foreign.status == "created"
