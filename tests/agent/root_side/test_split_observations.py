"""Under the privilege split the agent has no Docker access, yet reports its engines: from engines.json.

Real parts: the root side is the real ``meridian-node apply-spooled`` verb in a subprocess (with Docker
access, as root has), running reconcile.yml through ansible-runner against the real Docker Engine with the
stand-in vLLM image. The agent side runs in this process with DOCKER_HOST pointing at a socket that does
not exist, and is built the way ``meridian-node run`` builds it (``build_agent``'s engine source). The
last test runs the whole loop against the real devserver and reads its serving projection.
"""

from __future__ import annotations

import json
import os
import secrets
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from ansible_collections.meridian.node.plugins.module_utils.docker.engine import DockerEngine, DockerEngineError
from ansible_collections.meridian.node.plugins.module_utils.engines.drain_marks import mark_draining
from ansible_collections.meridian.node.tests.devserver.devserver_process import running
from ansible_collections.meridian.node.tests.support.e2e_env import (
    BIND,
    engine_spec,
    free_engine_port,
    make_e2e_node,
    observed_engine,
    served_endpoint,
    serving,
    standin_policy,
)
from ansible_collections.meridian.node.tests.support.node_env import publish
from ansible_collections.meridian.node.tests.support.path_unit import PathUnit, apply_spooled, write_split_config
from ansible_collections.meridian.node.tests.support.standin_image import LocalImage
from ansible_collections.meridian.node.tests.support.trust_fixtures import current_state, make_key, signed, write_policy
from meridian_node_agent.agent_side.cycle import CycleStatus
from meridian_node_agent.agent_side.observe import InventoryEngines
from meridian_node_agent.agent_side.systemd_applier import write_request
from meridian_node_agent.apply.applier import run_ident
from meridian_node_agent.boundary.engines_file import INVENTORY_FILE
from meridian_node_agent.boundary.spool import PUBLIC_DIR, SPOOL_DIR, read_answer_file
from meridian_node_agent.cli.agent import _engine_source
from meridian_node_agent.config import AgentConfig, load_config
from meridian_node_agent.logs import EventLogger

pytestmark = [pytest.mark.docker, pytest.mark.slow]

CONTROL = make_key()


def _root_config(root: Path, node_id: str) -> tuple[Path, AgentConfig]:
    """The root-owned config (apply.via: systemd) and a policy that lets this node run the stand-in."""
    policy = write_policy(
        root / "etc",
        control=[CONTROL],
        extra={
            "store": {"path": str(root / "store"), "max_bytes": "1G"},
            **standin_policy(),
        },
    )
    apply = {"via": "systemd", "timeout_seconds": 300, "state_dir": str(root / "apply")}
    path = write_split_config(
        root / "config.yaml", node_id=node_id, policy=policy, state_dir=root / "state", apply=apply
    )
    return path, load_config(path)


def test_agent_without_docker_access_reports_the_engine_root_started_then_draining_then_stopped(
    tmp_path: Path, docker_client: Any, image: LocalImage, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    root_env = dict(os.environ)  # the root side reaches Docker
    node_id = f"split-node-{secrets.token_hex(2)}"
    config_path, config = _root_config(tmp_path, node_id)
    state_dir = Path(config.state_dir)
    name, port = f"{prefix}-chat", free_engine_port()
    payload = current_state(1, node_id=node_id, engines=[engine_spec(name, image, port)])
    now = datetime.now(UTC).replace(microsecond=0)
    write_request(state_dir / SPOOL_DIR, run_ident(1, now), signed("desired-state", payload, [CONTROL]))

    applied = apply_spooled(config_path, root_env)

    assert applied.returncode == 0, applied.stdout + applied.stderr
    root_dir = Path(config.apply.state_dir)
    answer = read_answer_file(root_dir / PUBLIC_DIR)
    assert answer is not None and answer.status == "successful"
    inventory_path = root_dir / PUBLIC_DIR / INVENTORY_FILE
    assert inventory_path.stat().st_mode & 0o777 == 0o644
    written = json.loads(inventory_path.read_text())
    assert (written["format"], written["node_id"]) == (1, node_id)
    assert [(e["name"], e["host"], e["port"], e["probe_driver"], e["gpus"]) for e in written["engines"]] == [
        (name, BIND, port, "vllm", [])
    ]

    # The agent's side: no way to reach Docker in this process.
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path / 'no-docker.sock'}")
    with pytest.raises(DockerEngineError):
        DockerEngine.from_env(timeout_s=2)
    source = _engine_source(config, EventLogger())
    assert isinstance(source, InventoryEngines)
    # As root inspected it: never restarted, never exited, nothing changed by hand.
    expected = observed_engine(name, image, port, drifted=[])

    assert source() == [expected]

    mark_draining(str(root_dir), name, reason="test")  # what a root-side drain does
    source.forget()  # what the cycle does after an apply; otherwise the list is re-read within 5 s
    assert source() == [{**expected, "draining": True}]

    docker_client.containers.get(name).stop(timeout=5)
    source.forget()
    assert source() == [{**expected, "draining": True, "ready": False}]  # the file still says running

    # The root side started with nothing to apply (the same request was answered) still rewrites the file.
    again = apply_spooled(config_path, root_env)
    assert again.returncode == 0 and "nothing to apply" in again.stdout, again.stdout + again.stderr
    assert again.stderr == ""  # no warning: the inventory was rewritten
    source.forget()
    # Docker lists no published port for a stopped container, so neither does discovery in-process.
    [stopped] = source()
    exit_code = stopped.pop("exit_code")
    assert isinstance(exit_code, int)  # root's new listing saw how it ended
    assert stopped == {
        **{key: value for key, value in expected.items() if key != "exit_code"},
        "draining": True,
        "ready": False,
        "state": "exited",
        "port": None,
        "exit_reason": None if exit_code == 0 else stopped["exit_reason"],
    }


def test_engines_of_a_split_node_reach_the_serving_projection_and_leave_it_when_draining(
    tmp_path: Path, docker_client: Any, image: LocalImage, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    root_env = dict(os.environ)
    with running(tmp_path / "data") as server:
        node = make_e2e_node(server, tmp_path / "node", f"split-node-{secrets.token_hex(2)}")
        node.node.configure(apply={"via": "systemd", "timeout_seconds": 300, "state_dir": str(tmp_path / "node-apply")})
        name, port = f"{prefix}-chat", free_engine_port()
        publish(server, node.node_id, document={"engines": [engine_spec(name, image, port)]})
        monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path / 'no-docker.sock'}")
        agent = node.node.agent()  # build_agent, as 'meridian-node run' builds it
        assert isinstance(getattr(agent.observer, "_engines", None), InventoryEngines)

        with PathUnit(node.node.config_path, node.state_dir, env=root_env) as unit:
            outcome = agent.cycle()
        assert outcome.outcome == CycleStatus.APPLIED, (outcome, [r.stdout + r.stderr for r in unit.runs])
        assert serving(node, prefix) == [served_endpoint(node.node_id, name, port)]

        mark_draining(str(tmp_path / "node-apply"), name, reason="test")
        agent.observer.forget()  # the engine list is otherwise re-read within 5 s
        agent.cycle()
        assert serving(node, prefix) == []
