"""A replace never leaves the model down: meridian.node.engine_instance's two ways, on the real Docker Engine.

With ``replace_beside`` and room (a free port of the policy's range) the new engine starts beside the old one
and takes over once it is ready, on that port; without room the old one is stopped but kept, and started again
if the new one fails. Each case is played by ansible-playbook on the stand-in vLLM image; a gateway stand-in
routes requests the way the serving projection would (engines observed ready and not draining,
``engines.discovery``) while the replace runs.
"""

from __future__ import annotations

import secrets
import time
from pathlib import Path
from typing import Any

import pytest

from ansible_collections.meridian.node.plugins.module_utils.docker.engine import DockerEngine
from ansible_collections.meridian.node.plugins.module_utils.engines.discovery import discover_engines
from ansible_collections.meridian.node.tests.support.engine_harness import (
    BIND,
    Host,
    free_port,
    standin_policy,
)
from ansible_collections.meridian.node.tests.support.projection_gateway import ProjectionGateway
from ansible_collections.meridian.node.tests.support.standin_image import LocalImage

pytestmark = [pytest.mark.docker, pytest.mark.slow]

BESIDE = ["create-beside", "start", "wait-ready", "drain-old", "stop-old", "remove-old", "promote"]
IN_PLACE = ["drain", "stop", "set-aside", "create", "start", "wait-ready", "remove-old"]
# The stand-in refuses an engine it does not know and exits at once: a new engine that never gets ready.
BROKEN = {"STANDIN_ENGINE": "no-such-engine"}


def spec(host: Host, vllm: LocalImage, name: str, port: int, served: str, **extra: Any) -> dict[str, Any]:
    return host.params(
        name=name,
        driver="vllm",
        image=vllm.pinned,
        model={"name": "tiny"},
        served_model_name=served,
        port=port,
        **extra,
    )


def started_first(host: Host, vllm: LocalImage, name: str, port: int | None = None) -> tuple[int, dict[str, Any]]:
    """Engine ``name`` serving model "first" on ``port`` (a free port when None), applied and ready: the port and
    the applied result. The engine each test then replaces."""
    port = free_port() if port is None else port
    first: dict[str, Any] = host.play([("apply", spec(host, vllm, name, port, "first"), False)])["apply"]
    assert first["ready"] is True, first
    return port, first


def narrow_policy(host: Host, port: int) -> None:
    """A policy whose port range is the engine's one port: no room for a second container."""
    host.policy = standin_policy(
        host.root / f"policy-{secrets.token_hex(3)}",
        Host.DRIVERS,
        port_range=(port, port),
        store={"path": str(host.store)},
    )


def gateway(name: str, state_dir: Path, lag_s: float = 0.0) -> ProjectionGateway:
    """A gateway that routes to engine ``name`` where the host lists it ready and not draining (what the serving
    projection would list), looking only every ``lag_s``: as a gateway that follows the projection learns of a
    change only after the agent's observation and its own poll."""
    engine = DockerEngine.from_env()
    looked: list[tuple[float, str | None]] = []

    def route() -> str | None:
        if looked and time.monotonic() - looked[-1][0] < lag_s:
            return looked[-1][1]
        serving = [
            e
            for e in discover_engines(engine, state_dir=str(state_dir))
            if e["name"] == name and e["ready"] and not e["draining"]
        ]
        looked.append((time.monotonic(), f"{BIND}:{serving[0]['port']}" if serving else None))
        return looked[-1][1]

    return ProjectionGateway(route, "tiny")


def ids(host: Host, name: str) -> list[str]:
    return [c.id for c in host.client.containers.list(all=True, filters={"name": name})]


def test_with_room_the_new_engine_starts_beside_and_no_request_is_refused(
    host: Host, vllm: LocalImage, prefix: str
) -> None:
    name = f"{prefix}-side"
    port, first = started_first(host, vllm, name)

    # Off by default: something may route to the spec's port, which a replace beside would move the engine from.
    kept = host.play([("check", spec(host, vllm, name, port, "second"), True)])["check"]
    assert kept["actions"] == IN_PLACE and kept["diff"]["after"]["replace"]["way"] == "in-place"

    # The gateway learns of changes a second late; the old engine serves on for drain_settle after its mark.
    second = spec(host, vllm, name, port, "second", drain_settle=3, replace_beside=True)
    with gateway(name, host.state_dir, lag_s=1.0) as routed:
        time.sleep(0.5)
        results = host.play([("check", second, True), ("apply", second, False)])
        time.sleep(1.5)

    check, apply = results["check"], results["apply"]
    assert check["actions"] == BESIDE and check["diff"]["after"]["replace"]["way"] == "beside"
    assert not apply.get("failed"), apply.get("msg")
    assert apply["done"] == BESIDE
    assert apply["replace"]["outcome"] == "replaced"
    tally = routed.tally
    assert tally.refused == [], tally.describe()
    assert tally.answered > 10, tally.describe()
    # It took over on the free port it was started on, under the engine's name, and is the engine as asked.
    container = host.container(name)
    assert ids(host, name) == [container.id] != [first["container"]["id"]]
    assert len(tally.addresses) == 2 and tally.addresses[0] == f"{BIND}:{port}", tally.describe()
    again = host.play([("again", spec(host, vllm, name, port, "second"), False)])["again"]
    assert again["changed"] is False, again
    assert not (host.state_dir / "draining" / f"{name}.json").exists()
    # Stopped, it lists no ports; it is still the engine as asked on its free port: started again, not replaced.
    host.client.containers.get(container.id).stop(timeout=5)
    restarted = host.play([("start", spec(host, vllm, name, port, "second"), False)])["start"]
    assert (restarted["done"], restarted["container"]["id"]) == (["start", "wait-ready"], container.id), restarted


def test_with_room_a_new_engine_that_fails_is_removed_and_the_old_one_never_stopped(
    host: Host, vllm: LocalImage, prefix: str
) -> None:
    name = f"{prefix}-bad"
    port, first = started_first(host, vllm, name)

    with gateway(name, host.state_dir) as routed:
        broken = spec(host, vllm, name, port, "second", env=BROKEN, replace_beside=True)
        result = host.play([("apply", broken, False)])["apply"]

    assert result["failed"] is True and result["check"] == "readiness"
    assert "exited" in result["msg"] and "Rolled back" in result["msg"]
    assert result["replace"] == {
        "way": "beside",
        "why": result["replace"]["why"],
        "outcome": "rolled-back",
        "reason": result["replace"]["reason"],
    }
    assert "exited" in result["replace"]["reason"]
    assert result["done"] == ["create-beside", "start", "stop-new", "remove-new"]
    assert ids(host, name) == [first["container"]["id"]]
    assert routed.tally.refused == [] and routed.tally.answered, routed.tally.describe()


def test_without_room_the_old_engine_is_kept_and_started_again_when_the_new_one_fails(
    host: Host, vllm: LocalImage, prefix: str
) -> None:
    name = f"{prefix}-tight"
    port = free_port()
    narrow_policy(host, port)
    _port, first = started_first(host, vllm, name, port)

    results = host.play(
        [
            ("check", spec(host, vllm, name, port, "second", env=BROKEN, replace_beside=True), True),
            ("apply", spec(host, vllm, name, port, "second", env=BROKEN, replace_beside=True), False),
        ]
    )
    check, result = results["check"], results["apply"]
    assert check["actions"] == IN_PLACE
    assert f"no free port in the policy's range {port}-{port}" in check["diff"]["after"]["replace"]["why"]
    assert result["failed"] is True and result["check"] == "readiness"
    assert result["replace"]["way"] == "in-place" and result["replace"]["outcome"] == "rolled-back"
    assert result["done"] == [*IN_PLACE[:5], "stop-new", "remove-new", "restore-old", "start-old", "wait-ready-old"]
    # The engine that served before serves again, under its name, and nothing else is left.
    assert ids(host, name) == [first["container"]["id"]]
    assert host.container(name).status == "running"
    assert not (host.state_dir / "draining" / f"{name}.json").exists()
    again = host.play([("again", spec(host, vllm, name, port, "first"), False)])["again"]
    assert again["changed"] is False and again["ready"] is True, again

    # A good new engine takes the old one's place once ready, and the old one is gone.
    good = host.play([("apply", spec(host, vllm, name, port, "second"), False)])["apply"]
    assert not good.get("failed"), good.get("msg")
    assert good["done"] == IN_PLACE and good["replace"]["outcome"] == "replaced"
    assert ids(host, name) == [good["container"]["id"]]


def test_what_an_interrupted_replace_left_is_cleaned_up(host: Host, vllm: LocalImage, prefix: str) -> None:
    name = f"{prefix}-left"
    port, first = started_first(host, vllm, name)
    # As a replace interrupted after setting the old container aside leaves it: stopped, renamed <name>.OLD.
    old = host.client.containers.get(first["container"]["id"])
    old.stop(timeout=5)
    old.rename(f"{name}.OLD")

    results = host.play(
        [
            ("check", spec(host, vllm, name, port, "first"), True),
            ("apply", spec(host, vllm, name, port, "first"), False),
        ]
    )
    assert results["check"]["actions"] == ["clean-up", "create", "start", "wait-ready"]
    assert results["apply"]["done"] == ["clean-up", "create", "start", "wait-ready"]
    assert ids(host, name) == [host.container(name).id]
