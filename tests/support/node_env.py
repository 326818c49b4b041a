"""A node for agent-loop tests: a policy trusting a devserver's control key, a config, an enrolled identity; and
``RecordingClient``, the node's real control client with what the agent posted kept.

The devserver is the real ``meridian-node-devserver serve`` process (tests/devserver/devserver_process.py);
operator verbs (publish, fence) run as separate processes against its data dir, as an operator would.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

from ansible_collections.meridian.node.plugins.module_utils.contracts import Lease, Observation
from ansible_collections.meridian.node.plugins.module_utils.trust.applied_state import StateStore
from ansible_collections.meridian.node.plugins.module_utils.trust.policy import load_policy
from ansible_collections.meridian.node.plugins.module_utils.trust.verify import VerifiedState, verify_desired_state
from ansible_collections.meridian.node.tests.devserver.devserver_process import DevServer, enroll_node
from meridian_node_agent.agent_side.control_client import ControlClient
from meridian_node_agent.agent_side.cycle import SPOOL_FILE, Agent
from meridian_node_agent.apply.oplog import OpLog
from meridian_node_agent.cli.agent import build_agent
from meridian_node_agent.config import AgentConfig, load_config
from meridian_node_agent.logs import EventLogger

__all__ = ["SERVING_ENGINE", "Node", "RecordingClient", "make_kubernetes_node", "make_node", "publish"]

_documents = itertools.count(1)

# One engine as the agent's observer lists it: ours, running and ready (copy it before changing it).
SERVING_ENGINE: dict[str, Any] = {
    "name": "chat",
    "managed": True,
    "driver": "vllm",
    "image": "meridian-node/standin:1",
    "state": "running",
    "ready": True,
    "draining": False,
    "port": 8123,
    "served_model_name": "chat",
}


@dataclass
class Node:
    node_id: str
    root: Path
    config_path: Path
    config: AgentConfig

    @property
    def state_dir(self) -> Path:
        return Path(self.config.state_dir)

    @property
    def journal(self) -> Path:
        return self.state_dir / "journal"

    def journal_runs(self) -> list[str]:
        return sorted(p.name for p in self.journal.iterdir()) if self.journal.exists() else []

    def applied_file(self) -> Path:
        return self.state_dir / "applied.json"

    def oplog_lines(self) -> list[str]:
        path = self.state_dir / "oplog.jsonl"
        return path.read_text().splitlines() if path.exists() else []

    def configure(self, **sections: Any) -> None:
        """Set top-level ``sections`` of the node's config file (each replaced whole) and reload ``config``
        from it, as the agent reads it when it starts."""
        document = yaml.safe_load(self.config_path.read_text())
        document.update(sections)
        self.config_path.write_text(yaml.safe_dump(document, sort_keys=False))
        self.config = load_config(self.config_path)

    def agent(self, **overrides: Any) -> Agent:
        agent: Agent = build_agent(self.config, log=EventLogger())
        for name, value in overrides.items():
            setattr(agent, name, value)
        return agent

    def fetch_envelope(self, server: DevServer) -> bytes:
        """The desired state ``server`` holds for this node, as the node fetches it with its identity."""
        identity = self.config.identity_dir
        with ControlClient(
            server.base_url, identity / "ca.pem", identity / "node.pem", identity / "node.key.pem"
        ) as client:
            fetched = client.fetch_desired_state(self.node_id)
        assert fetched.envelope is not None
        return fetched.envelope

    def verify(self, envelope: bytes) -> VerifiedState:
        """``envelope`` verified as the node's agent verifies it now, against its policy and applied state."""
        policy = load_policy(self.config.policy)
        applied = StateStore(self.state_dir).load()
        return verify_desired_state(envelope, policy, node_id=self.node_id, now=datetime.now(UTC), applied=applied)

    def leave_interrupted_apply(self, server: DevServer, run_ident: str) -> tuple[int, bytes]:
        """What an agent killed in the middle of an apply leaves: a state published to this node (its generation
        and envelope are returned) in the spool, and a 'started' line for it with no result, as ``run_ident``."""
        generation = publish(server, self.node_id)
        envelope = self.fetch_envelope(server)
        verified = self.verify(envelope)
        (self.state_dir / SPOOL_FILE).parent.mkdir(parents=True, exist_ok=True)
        (self.state_dir / SPOOL_FILE).write_bytes(envelope)
        OpLog(self.state_dir / "oplog.jsonl").append(
            op="apply",
            generation=generation,
            epoch=verified.state.lease_epoch,
            payload_sha256=verified.payload_sha256,
            run_ident=run_ident.format(generation=generation),
            result="started",
        )
        return generation, envelope


class RecordingClient:
    """The agent's real control client, every call passed through; its heartbeats counted and each observation it
    posts kept in ``posted`` (before it is sent: a report the control plane refuses is kept too)."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.heartbeats = 0
        self.posted: list[Observation] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    def heartbeat(self, node_id: str) -> Lease:
        self.heartbeats += 1
        lease: Lease = self.real.heartbeat(node_id)
        return lease

    def post_observation(self, observation: Observation) -> None:
        self.posted.append(observation)
        self.real.post_observation(observation)


def make_node(
    server: DevServer,
    root: Path,
    node_id: str,
    *,
    mode: str = "managed-host",
    trusted_control_key: Path | None = None,
    enroll: bool = True,
    keep_runs: int = 20,
) -> Node:
    """Write policy + config under ``root`` and (by default) enroll ``node_id`` with ``server``."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "keys").mkdir(exist_ok=True)
    key = root / "keys" / "control.pem"
    key.write_bytes((trusted_control_key or server.control_public_key).read_bytes())
    policy = {
        "trust": {"control": {"threshold": 1, "public_keys": ["keys/control.pem"]}},
        "store": {"path": str(root / "store"), "max_bytes": "1G"},
        "agent": {"allowed_modes": ["observe-only", "managed-host"]},
    }
    (root / "policy.yaml").write_text(yaml.safe_dump(policy, sort_keys=False))
    config = {
        "node_id": node_id,
        "mode": mode,
        "policy": "policy.yaml",
        "state_dir": "state",
        "control_plane": {"url": server.base_url, "long_poll_seconds": 0, "heartbeat_seconds": 1},
        "backoff": {"initial_seconds": 1.0, "max_seconds": 8.0},
        "journal": {"keep_runs": keep_runs},
        "log": {"format": "json", "level": "info"},
    }
    config_path = root / "config.yaml"
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    loaded = load_config(config_path)
    if enroll:
        enroll_node(server, loaded.identity_dir, node_id).close()
    return Node(node_id=node_id, root=root, config_path=config_path, config=loaded)


def make_kubernetes_node(server: DevServer, root: Path, node_id: str, pod_resources_socket: Path) -> Node:
    """A node in mode kubernetes-integrated (the policy allows it) reading the kubelet at ``pod_resources_socket``
    on every observation."""
    node = make_node(server, root, node_id, mode="kubernetes-integrated")
    policy = yaml.safe_load((root / "policy.yaml").read_text())
    policy["agent"]["allowed_modes"].append("kubernetes-integrated")
    (root / "policy.yaml").write_text(yaml.safe_dump(policy, sort_keys=False))
    node.configure(kubernetes={"pod_resources_socket": str(pod_resources_socket), "refresh_seconds": 0})
    return node


def publish(server: DevServer, node_id: str, *, ttl: int | None = None, document: dict[str, Any] | None = None) -> int:
    """Publish a desired state (no engines, no artifacts by default); return its generation."""
    path = server.data_dir.parent / f"desired-{node_id}-{next(_documents)}.yaml"
    path.write_text(yaml.safe_dump(document if document is not None else {"engines": [], "artifacts": []}))
    extra = ["--ttl", str(ttl)] if ttl is not None else []
    output = server.cli("publish", node_id, str(path), *extra).stdout
    return int(output.split("generation ")[1].split()[0])


def now() -> datetime:
    return datetime.now(UTC)
