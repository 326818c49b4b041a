"""An engine whose command exits at once: the apply fails at its readiness wait every time, and the agent
retries it on supervision's crash-loop backoff (growing, bounded), not once per cycle; ``meridian-node
status`` and ``status --json`` show the backoff and when the next attempt is.

Real devserver, real Docker Engine, real ansible-runner; the backoff is shortened in the config (2 s doubling
to 8 s) so that three attempts take seconds, not minutes.
"""

from __future__ import annotations

import json
import time
from datetime import datetime
from typing import Any

import pytest

from ansible_collections.meridian.node.plugins.module_utils.contracts import parse_rfc3339
from ansible_collections.meridian.node.tests.devserver.devserver_process import DevServer
from ansible_collections.meridian.node.tests.support.e2e_env import (
    QUICK_SUPERVISION,
    E2ENode,
    container_named,
    engine_spec,
    free_engine_port,
)
from ansible_collections.meridian.node.tests.support.node_env import publish
from ansible_collections.meridian.node.tests.support.standin_image import LocalImage
from meridian_node_agent.agent_side.cycle import CycleStatus
from meridian_node_agent.apply.oplog import OpLog
from meridian_node_agent.cli import main as cli_main

pytestmark = [pytest.mark.docker, pytest.mark.slow]

ATTEMPTS = 3  # enough to see the wait grow twice
LIVENESS_S = 180.0


def _allowed_attempts(window: float) -> int:
    """Attempts the backoff lets start within ``window`` seconds of the first, if applies took no time."""
    attempts, at, failures = 1, 0.0, 1
    while True:
        at += min(
            QUICK_SUPERVISION["backoff_max_seconds"], QUICK_SUPERVISION["backoff_initial_seconds"] * 2 ** (failures - 1)
        )
        if at > window:
            return attempts
        attempts, failures = attempts + 1, failures + 1


def test_an_engine_whose_command_exits_at_once_is_retried_on_a_growing_backoff_shown_in_status(
    server: DevServer,
    node_id: str,
    node: E2ENode,
    image: LocalImage,
    prefix: str,
    docker_client: Any,
    capsys: pytest.CaptureFixture[str],
) -> None:
    node.node.configure(supervision=QUICK_SUPERVISION)
    config_path = node.node.config_path
    name = f"{prefix}-crash"
    # The stand-in refuses to play an engine it does not know and exits 1 before it listens: a bad image or
    # a bad argument does the same to a real engine.
    spec = engine_spec(name, image, free_engine_port(), env={"STANDIN_ENGINE": "no-such-engine"})
    generation = publish(server, node.node_id, document={"engines": [spec]})
    agent = node.agent()

    first = agent.cycle()

    assert first.outcome == CycleStatus.APPLY_FAILED and first.generation == generation
    assert first.run is not None and first.run.failures
    seen: list[CycleStatus] = [first.outcome]
    started = time.monotonic()
    # Bounded by a count of cycles, not by the clock: the test asserts which outcomes came, not how fast.
    for _cycle in range(int(LIVENESS_S / 0.2)):
        if seen.count(CycleStatus.APPLY_FAILED) >= ATTEMPTS:
            break
        seen.append(agent.cycle().outcome)
        time.sleep(0.2)
    assert seen.count(CycleStatus.APPLY_FAILED) >= ATTEMPTS, seen
    # Then a while shorter than the backoff the third failure set (8 s): no attempt at all, only waiting.
    quiet_until = time.monotonic() + 6
    while time.monotonic() < quiet_until:
        seen.append(agent.cycle().outcome)
        assert seen[-1] == CycleStatus.APPLY_BACKING_OFF, seen
        time.sleep(0.2)
    window = time.monotonic() - started

    assert set(seen) <= {CycleStatus.APPLY_FAILED, CycleStatus.APPLY_BACKING_OFF}  # never a publish, never applied
    operations = [e for e in OpLog(node.state_dir / "oplog.jsonl").read() if e.generation == generation]
    attempts = [e for e in operations if e.result == "started"]
    ended = [e for e in operations if e.result != "started"]
    assert all(e.result == "failed" for e in ended) and len(ended) == len(attempts)
    # No more attempts than the backoff allows in the time it took, even had each apply taken no time.
    assert ATTEMPTS == len(attempts) <= _allowed_attempts(window), (window, [e.at for e in attempts])
    assert seen.count(CycleStatus.APPLY_FAILED) == len(attempts)
    # Each retry waited at least its backoff after the failure before it (2 s, 4 s, 8 s...): growing.
    waits = [
        (parse_rfc3339(start.at) - parse_rfc3339(end.at)).total_seconds()
        for end, start in zip(ended[:-1], attempts[1:], strict=True)
    ]
    for index, wait in enumerate(waits):
        assert wait >= min(8, 2 * 2**index) - 0.5, waits  # the agent's clock and the oplog's: half a second
    assert waits == sorted(waits)
    assert [e.reason for e in attempts[1:]] == [f"retry after {n} failed apply(s)" for n in range(1, len(attempts))]
    container = container_named(docker_client, name)
    assert container is not None and container.status != "running"
    # How the stand-in ends on every attempt: it refuses the engine and exits 1. The last attempt's stop can
    # land while Docker's restart policy has just started it again, which ends that run with SIGTERM (143).
    assert container.attrs["State"]["ExitCode"] in (1, 143), container.attrs["State"]
    assert "STANDIN_ENGINE must be one of" in container.logs().decode(errors="replace")

    agent.write_status()
    assert cli_main(["--config", str(config_path), "status", "--json"]) == 0
    retry = json.loads(capsys.readouterr().out)["agent"]["apply_retry"]
    assert (retry["generation"], retry["failures"]) == (generation, len(attempts))
    assert retry["state"] in ("backing-off", "retry-due")
    assert retry["backoff_seconds"] == min(8, 2 * 2 ** (len(attempts) - 1))
    assert retry["error"] == "; ".join(first.run.failures)[:500]  # the status keeps the first 500 characters
    next_at: datetime = parse_rfc3339(retry["next_attempt_at"])
    assert (next_at - parse_rfc3339(retry["last_failed_at"])).total_seconds() == retry["backoff_seconds"]
    assert cli_main(["--config", str(config_path), "status"]) == 0
    shown = capsys.readouterr().out
    row = next(line for line in shown.splitlines() if line.startswith("apply retry"))
    assert f"generation {generation} failed {len(attempts)} time(s)" in row
    assert f"backoff {retry['backoff_seconds']:g} s" in row and "next attempt at" in row
