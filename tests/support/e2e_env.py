"""A node that runs engines, for the end-to-end tests: the agent-loop node (tests/support/node_env.py)
with a policy that lets it run the stand-in vLLM engine, an agent whose engine observations are never
cached, and readers for what the devserver keeps (the node's last observation, the serving projection).

The stand-in image is tagged under a repository of its own (``E2E_REPOSITORY``) and the policy's port range
is one no other suite uses: the reconcile playbook prunes every engine of ours whose image and driver the
policy allows, so these two keep it from ever reaching another suite's engines on a shared Docker Engine.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import sqlite3
import urllib.request
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import docker.errors
import yaml

from ansible_collections.meridian.node.plugins.module_utils.contracts import ServingProjection
from ansible_collections.meridian.node.plugins.module_utils.docker.engine import (
    LABEL_INSTANCE,
    DockerEngine,
)
from ansible_collections.meridian.node.plugins.module_utils.trust.policy import load_policy
from ansible_collections.meridian.node.tests.devserver.devserver_process import DevServer
from ansible_collections.meridian.node.tests.support.engine_harness import SERVER
from ansible_collections.meridian.node.tests.support.node_env import Node, make_node
from ansible_collections.meridian.node.tests.support.ports import reserve_ports
from ansible_collections.meridian.node.tests.support.standin_image import LocalImage, ensure_engine_image
from meridian_node_agent.agent_side.control_client import ControlClient
from meridian_node_agent.agent_side.cycle import Agent, CycleOutcome, CycleStatus
from meridian_node_agent.agent_side.observe import DockerEngines, Observer

__all__ = [
    "BIND",
    "E2E_REPOSITORY",
    "PORT_RANGE",
    "QUICK_SUPERVISION",
    "E2ENode",
    "applied",
    "container_named",
    "engine_serving",
    "engine_spec",
    "free_engine_port",
    "last_observation",
    "make_e2e_node",
    "observed_engine",
    "remove_containers",
    "served_endpoint",
    "serving",
    "standin_policy",
    "standin_vllm",
    "tag_for_e2e",
]

BIND = "127.0.0.1"
E2E_REPOSITORY = "meridian-node/e2e-standin"
PORT_RANGE = (9400, 9499)
# Supervision shortened for tests that wait for repairs: settled after a second, a crash loop's backoff 2 s doubling
# to 8 s, so that three attempts take seconds, not minutes.
QUICK_SUPERVISION = {
    "settle_seconds": 1,
    "startup_grace_seconds": 60,
    "backoff_initial_seconds": 2,
    "backoff_max_seconds": 8,
}


def tag_for_e2e(client: Any, image: LocalImage) -> LocalImage:
    """The stand-in engine image under ``E2E_REPOSITORY`` (same image id), pinned the way policy checks it.

    The tag is unique to the caller, which removes it afterwards: two test sessions on one Docker Engine
    (a CI run beside a developer's) must not untag the image under each other's engines.
    """
    tag = f"{image.tag.rsplit(':', 1)[1]}-{secrets.token_hex(4)}"
    client.images.get(image.id).tag(E2E_REPOSITORY, tag=tag)
    return LocalImage(tag=f"{E2E_REPOSITORY}:{tag}", id=image.id)


@contextmanager
def standin_vllm(client: Any, base: LocalImage) -> Iterator[LocalImage]:
    """The stand-in vLLM image tagged for this use (``tag_for_e2e``); the tag is removed afterwards."""
    tagged = tag_for_e2e(client, ensure_engine_image(client, base, SERVER, engine="vllm"))
    try:
        yield tagged
    finally:
        client.images.remove(tagged.tag)  # only the tag: the image keeps its stand-in name


def standin_policy() -> dict[str, Any]:
    """The policy sections that let the stand-in vLLM engine run, and nothing else of ours: ``images`` (only
    ``E2E_REPOSITORY``, pinned by digest) and ``engines`` (only vllm, on ``BIND`` in ``PORT_RANGE``)."""
    return {
        "images": {"allowed_repositories": [E2E_REPOSITORY], "require_digest": True},
        "engines": {"allowed_drivers": ["vllm"], "bind_address": BIND, "port_range": list(PORT_RANGE)},
    }


def free_engine_port() -> int:
    """A port of PORT_RANGE that can be bound on BIND now and that no other test picked lately (``reserve_ports``)."""
    return reserve_ports(*PORT_RANGE)[0]


def engine_spec(name: str, image: LocalImage, port: int, **overrides: Any) -> dict[str, Any]:
    """One stand-in vLLM engine for a desired state (the model by name: no artifact to fetch)."""
    return {
        "name": name,
        "driver": "vllm",
        "image": image.pinned,
        "model": {"name": "tiny"},
        "served_model_name": "tiny-chat",
        "port": port,
        **overrides,
    }


def engine_serving(port: int) -> bool:
    """Whether the stand-in engine published on ``BIND:port`` answers ``/health`` with 200 now."""
    try:
        with urllib.request.urlopen(f"http://{BIND}:{port}/health", timeout=2) as answer:
            return bool(answer.status == 200)
    except OSError:
        return False


def observed_engine(name: str, image: LocalImage, port: int, **overrides: Any) -> dict[str, Any]:
    """What an observation lists for the engine ``engine_spec(name, image, port)`` started: managed, running and
    ready, not draining, never restarted or exited (``ready_since``, a time, is the caller's to check)."""
    return {
        "name": name,
        "managed": True,
        "driver": "vllm",
        "image": image.pinned,
        "state": "running",
        "ready": True,
        "draining": False,
        "port": port,
        "served_model_name": "tiny-chat",
        "restarts": 0,
        "exit_code": None,
        "exit_reason": None,
        **overrides,
    }


def served_endpoint(node_id: str, name: str, port: int) -> dict[str, Any]:
    """The serving projection's endpoint for the engine ``engine_spec(name, image, port)`` on ``node_id``."""
    return {
        "node_id": node_id,
        "engine": name,
        "driver": "vllm",
        "served_model_name": "tiny-chat",
        "address": f"{BIND}:{port}",
    }


class E2ENode:
    def __init__(self, node: Node, server: DevServer) -> None:
        self.node = node
        self.server = server

    @property
    def node_id(self) -> str:
        return self.node.node_id

    @property
    def state_dir(self) -> Path:
        return self.node.state_dir

    def agent(self) -> Agent:
        """The agent as ``meridian-node run`` builds it, but observing Docker afresh every cycle (the real
        source caches for 5 s, and these tests look right after an apply)."""
        engines = DockerEngines(
            DockerEngine.from_env(), state_dir=self.state_dir, refresh_s=0, owner=f"agent:{self.node_id}"
        )
        policy = load_policy(self.node.config.policy, keys=False)
        observer = Observer(
            store_path=str(self.node.root / "store"),
            engines=engines,
            placement=(policy.engines.port_range, policy.engines.bind_address),
        )
        return self.node.agent(observer=observer)

    def client(self) -> ControlClient:
        identity = self.node.config.identity_dir
        return ControlClient(
            self.server.base_url, identity / "ca.pem", identity / "node.pem", identity / "node.key.pem", timeout_s=10
        )


def make_e2e_node(server: DevServer, root: Path, node_id: str, *, mode: str = "managed-host") -> E2ENode:
    node = make_node(server, root, node_id, mode=mode)
    policy_path = root / "policy.yaml"
    policy = yaml.safe_load(policy_path.read_text())
    policy.update(standin_policy())
    policy_path.write_text(yaml.safe_dump(policy, sort_keys=False))
    return E2ENode(node, server)


def last_observation(server: DevServer, node_id: str) -> dict[str, Any] | None:
    """The observation the devserver keeps for ``node_id`` (its latest), read from its database."""
    database = server.data_dir / "devserver.sqlite3"
    with sqlite3.connect(f"file:{database}?mode=ro", uri=True) as conn:
        row = conn.execute("SELECT body FROM observations WHERE node_id = ?", (node_id,)).fetchone()
    if row is None:
        return None
    document: dict[str, Any] = json.loads(row[0])
    return document


def serving(node: E2ENode, prefix: str) -> list[dict[str, Any]]:
    """``GET /v1/serving`` over mutual TLS: this node's endpoints for engines named ``prefix...`` (the Docker
    Engine is shared: the node also observes, and so serves, other suites' engines running meanwhile)."""
    with node.client() as client:
        projection: ServingProjection = client.serving()
    endpoints: list[dict[str, Any]] = projection.model_dump(mode="json")["endpoints"]
    return [e for e in endpoints if e["node_id"] == node.node_id and e["engine"].startswith(prefix)]


def remove_containers(client: Any, prefixes: Iterable[str]) -> list[str]:
    """Force-remove every container whose name or engine-instance label starts with one of ``prefixes``.

    Read from one listing (no inspect of each container), and a container that is gone by the time it is removed
    is passed over: other sessions' tests add and remove theirs on the same Docker Engine meanwhile."""
    prefixes = tuple(prefixes)
    removed = []
    for container in client.containers.list(all=True, sparse=True):
        name = (container.attrs.get("Names") or ["/"])[0].lstrip("/")
        instance = (container.attrs.get("Labels") or {}).get(LABEL_INSTANCE, "")
        if any(name.startswith(p) or instance.startswith(p) for p in prefixes):
            with contextlib.suppress(docker.errors.NotFound):
                container.remove(force=True)
            removed.append(name)
    return removed


def container_named(client: Any, name: str) -> Any:
    """The container called exactly ``name`` (Docker's name filter matches substrings), or None."""
    found = [c for c in client.containers.list(all=True, filters={"name": name}) if c.name == name]
    return found[0] if found else None


def applied(agent: Agent) -> CycleOutcome:
    """One agent cycle that must apply; the run's failures are in the assertion message otherwise."""
    outcome = agent.cycle()
    assert outcome.outcome == CycleStatus.APPLIED, (outcome, outcome.run and outcome.run.failures)
    return outcome
