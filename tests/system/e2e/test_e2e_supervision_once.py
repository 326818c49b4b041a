"""``meridian-node run --once`` from cron keeps what was approved running: an engine stopped, killed or removed
behind the agent's back is repaired by a later run, after its settle time, without a publish.

Every cycle is a real agent process (as cron starts it), against the real devserver, real Docker Engine and
real ansible-runner; the stand-in engine plays vLLM. What one run learned (when the problem was first seen, the
repairs and their backoff) reaches the next only through the agent's record (``supervision.json``). The graces
are shortened in the config, and cron's minute between runs with them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from ansible_collections.meridian.node.tests.devserver.devserver_process import DevServer
from ansible_collections.meridian.node.tests.support.e2e_env import (
    E2ENode,
    container_named,
    engine_serving,
    engine_spec,
    free_engine_port,
)
from ansible_collections.meridian.node.tests.support.node_env import publish
from ansible_collections.meridian.node.tests.support.standin_image import LocalImage
from meridian_node_agent.agent_side.supervision_record import RECORD_FILE
from meridian_node_agent.apply.oplog import OpLog

pytestmark = [pytest.mark.docker, pytest.mark.slow]

SUPERVISION = {"settle_seconds": 2, "startup_grace_seconds": 60, "backoff_initial_seconds": 1, "backoff_max_seconds": 4}
CRON_PAUSE_S = 1.0  # between one run's end and the next one's start: cron's minute, shortened with the graces
RUNS_LIMIT = 30  # a liveness bound per break, not a timing assertion


def _run_once(node: E2ENode) -> list[dict[str, Any]]:
    """One ``meridian-node run --once`` in its own process; its log events (it must exit 0)."""
    script = Path(sys.executable).parent / "meridian-node"
    command = [str(script)] if script.exists() else [sys.executable, "-m", "meridian_node_agent.cli"]
    result = subprocess.run(
        [*command, "--config", str(node.node.config_path), "run", "--once"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env=dict(os.environ),
    )
    assert result.returncode == 0, result.stderr
    return [json.loads(line) for line in result.stderr.splitlines() if line.startswith("{")]


def _named(events: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [event for event in events if event["event"] == name]


def test_run_once_from_cron_repairs_an_engine_stopped_killed_or_removed_after_its_settle_time(
    server: DevServer, node_id: str, node: E2ENode, image: LocalImage, prefix: str, docker_client: Any
) -> None:
    node.node.configure(supervision=SUPERVISION)
    name, port = f"{prefix}-chat", free_engine_port()
    generation = publish(server, node_id, document={"engines": [engine_spec(name, image, port)]})
    applied = _run_once(node)
    assert [(e["generation"], e["status"]) for e in _named(applied, "apply-finished")] == [(generation, "successful")]
    assert engine_serving(port)

    figures = []
    for repairs, (how, why) in enumerate(
        [("docker stop", "not running (exited)"), ("docker kill", "not running (exited)"), ("docker rm -f", "missing")],
        start=1,
    ):
        container = container_named(docker_client, name)
        assert container is not None and container.status == "running"
        if how == "docker stop":
            container.stop(timeout=5)
        elif how == "docker kill":
            container.kill()  # SIGKILL: Docker counts it as stopped by hand and leaves it down
        else:
            container.remove(force=True)
        broken_at = time.monotonic()

        runs: list[list[dict[str, Any]]] = []
        while not runs or not _named(runs[-1], "engines-drifted"):
            assert len(runs) < RUNS_LIMIT, f"{how}: no run repaired it in {RUNS_LIMIT} runs"
            if runs:
                time.sleep(CRON_PAUSE_S)
            runs.append(_run_once(node))
        repaired_s = time.monotonic() - broken_at

        # The run that first saw it only noted it: the settle time counts from then, across processes.
        assert not _named(runs[0], "apply-started"), (how, runs[0])
        assert len(runs) >= 2
        [drifted] = _named(runs[-1], "engines-drifted")
        assert (drifted["generation"], drifted["engines"]) == (generation, f"{name}: {why}")
        [finished] = _named(runs[-1], "apply-finished")
        assert finished["status"] == "successful", finished
        started = [e for e in OpLog(node.state_dir / "oplog.jsonl").read() if e.result == "started"]
        assert (started[-1].generation, started[-1].reason) == (generation, f"drift: {name}: {why}")
        after = container_named(docker_client, name)
        assert after is not None and after.status == "running"
        assert engine_serving(port)
        record = json.loads((node.state_dir / RECORD_FILE).read_text())
        assert record["supervised"]["generation"] == generation
        assert record["supervised"]["engines"][name]["repairs"] == repairs  # counted on, run after run
        figures.append(f"{how}: repaired {repaired_s:.1f} s after the break, by run {len(runs)}")
        # Cron's next run sees it healthy (until then it is, for supervision, the engine that broke: broken
        # again before any look saw it up, it would be repaired as soon as its backoff allows, settled or not).
        healthy = _run_once(node)
        assert not _named(healthy, "apply-started")
        assert json.loads((node.state_dir / RECORD_FILE).read_text())["supervised"]["engines"][name]["problem"] is None

    # Healthy and seen so: the runs that follow apply nothing and write nothing.
    written = (node.state_dir / RECORD_FILE).stat()
    for _ in range(2):
        assert not _named(_run_once(node), "apply-started")
    now = (node.state_dir / RECORD_FILE).stat()
    assert (now.st_ino, now.st_mtime_ns) == (written.st_ino, written.st_mtime_ns)
    print("; ".join(figures))  # the figures docs/SUPERVISION.md quotes (pytest -s)
