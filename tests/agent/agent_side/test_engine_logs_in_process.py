"""Engine logs in-process (``apply.via: in-process``): the agent keeps each engine's tail itself, a failing engine's
observation carries its last lines, and the agent's log line for a repair says what the engine last printed.

Real parts: a real Docker Engine running a crash-looping engine container (the stand-in vLLM image with its
command replaced by a shell that prints its environment and dies); the real devserver on 127.0.0.1 for the cycle,
whose engines and applies are scripted (what is under test is what the repair's log line carries).
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from ansible_collections.meridian.node.plugins.module_utils.docker.engine import (
    LABEL_INSTANCE,
    LABEL_OWNED,
    DockerEngine,
)
from ansible_collections.meridian.node.plugins.module_utils.docker.log_scrub import REDACTED
from ansible_collections.meridian.node.plugins.module_utils.engines.labels import LABEL_OWNER
from ansible_collections.meridian.node.tests.devserver.devserver_process import DevServer
from ansible_collections.meridian.node.tests.support.e2e_env import E2E_REPOSITORY, engine_spec, make_e2e_node
from ansible_collections.meridian.node.tests.support.instant_apply import instant_success
from ansible_collections.meridian.node.tests.support.node_env import publish
from ansible_collections.meridian.node.tests.support.recorded_events import recording_logger
from ansible_collections.meridian.node.tests.support.standin_image import LocalImage
from meridian_node_agent.agent_side.observe import DockerEngines, Observer
from meridian_node_agent.agent_side.supervise import Supervisor
from meridian_node_agent.apply.applier import ApplyResult
from meridian_node_agent.boundary.engine_logs_file import read_log_tail

NODE = "gpu-node-in-process"
SECRET = "hf_InProcess-Secret-91ab"
CRASHING = 'env; echo "loading model tiny"; echo "fatal: CUDA error: out of memory" >&2; exit 3'
CRASH_LINE = "fatal: CUDA error: out of memory"


@pytest.mark.docker
def test_in_process_the_agent_keeps_the_tail_and_a_failing_engine_carries_its_last_lines(
    tmp_path: Path, docker_client: Any, image: LocalImage, prefix: str
) -> None:
    name = f"{prefix}-chat"
    container = docker_client.containers.run(
        image.id,
        [CRASHING],
        entrypoint=["sh", "-c"],
        name=name,
        labels={LABEL_OWNED: "true", LABEL_INSTANCE: name, LABEL_OWNER: f"agent:{NODE}"},
        environment={"HF_TOKEN": SECRET},
        restart_policy={"Name": "on-failure", "MaximumRetryCount": 0},
        detach=True,
    )
    deadline = time.monotonic() + 90
    while container.logs().count(CRASH_LINE.encode()) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    engines = DockerEngines(DockerEngine.from_env(timeout_s=10), state_dir=tmp_path, owner=f"agent:{NODE}")

    observation = Observer(store_path=None, gpu_facts=lambda: {"nvml_available": False}, engines=engines).observe(
        node_id=NODE, mode="managed-host", epoch=1, applied_generation=1, last_run=None, now=datetime.now(UTC)
    )

    (observed,) = [engine for engine in observation.engines if engine.name == name]
    assert observed.last_lines is not None
    assert any(CRASH_LINE in line for line in observed.last_lines)
    assert SECRET not in observation.model_dump_json()
    kept = read_log_tail(tmp_path / "logs", name)
    assert (
        f"HF_TOKEN={REDACTED}" in kept.lines()
        and SECRET.encode() not in (tmp_path / "logs" / f"{name}.json").read_bytes()
    )


def test_a_repair_is_logged_with_the_last_lines_of_the_engines_it_repairs() -> None:
    clock = [100.0]
    supervisor = Supervisor(settle_s=10, clock=lambda: clock[0])
    supervisor.expect(3, ["chat", "embed"])
    crashed = {"name": "chat", "state": "restarting", "ready": False, "last_lines": ["loading", CRASH_LINE]}
    observed = [crashed, {"name": "embed", "state": "running", "ready": True}]

    assert supervisor.assess(observed) is None
    clock[0] += 10
    drift = supervisor.assess(observed)

    assert drift is not None and drift.engine_lines() == {"chat": ["loading", CRASH_LINE]}


IMAGE = LocalImage(tag=f"{E2E_REPOSITORY}:logs", id="sha256:" + "5e" * 32)


class Applies:
    """The applier seam: every apply succeeds at once (what is under test is the log line before it)."""

    def apply(self, envelope: bytes, *, generation: int, **_: Any) -> ApplyResult:
        return instant_success(generation)


def test_the_agents_engines_drifted_line_carries_what_the_failing_engine_last_printed(
    server: DevServer, tmp_path: Path, node_id: str
) -> None:
    node = make_e2e_node(server, tmp_path / "node", node_id).node
    node.configure(supervision={"settle_seconds": 10, "startup_grace_seconds": 60})
    publish(server, node_id, document={"engines": [engine_spec("chat", IMAGE, 9450)]})
    shown: list[dict[str, Any]] = [{"name": "chat", "state": "running", "ready": True}]
    clock = [5000.0]
    observer = Observer(
        store_path=None,
        gpu_facts=lambda: {"nvml_available": False},
        engines=lambda: [
            {
                "managed": True,
                "driver": "vllm",
                "image": IMAGE.pinned,
                "draining": False,
                "port": 9450,
                **engine,
            }
            for engine in shown
        ],
        monotonic=lambda: clock[0],
    )
    log, events = recording_logger("engine-logs-cycle")
    agent = node.agent(observer=observer, applier=Applies(), monotonic=lambda: clock[0])
    agent.log = agent.record.log = log
    agent.cycle()  # applied, seen ready
    shown[0] = {"name": "chat", "state": "restarting", "ready": False, "last_lines": ["loading", CRASH_LINE]}

    for _ in range(3):
        clock[0] += 6
        agent.cycle()

    [drifted] = events.named("engines-drifted")
    assert drifted["last_lines"] == {"chat": ["loading", CRASH_LINE]}
