"""The agent's cycle against the real devserver on 127.0.0.1 (real TLS, real signing), applying through
real ansible-runner runs. Desired states carry no engines: engine convergence is engine_instance's test.

Every rejection test checks the same thing afterwards: nothing on the host changed (no applied state,
no journal run, no oplog entry, nothing spooled).
"""

from __future__ import annotations

import json
import random
import socket
from contextlib import ExitStack
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from ansible_collections.meridian.node.plugins.module_utils.contracts import Lease, Observation
from ansible_collections.meridian.node.plugins.module_utils.trust.applied_state import StateStore
from ansible_collections.meridian.node.tests.devserver.devserver_process import DevServer, cli, running
from ansible_collections.meridian.node.tests.support.node_env import Node, make_node, publish
from meridian_node_agent.agent_side.control_client import DesiredStateFetch, FetchStatus
from meridian_node_agent.agent_side.cycle import SPOOL_FILE, CycleStatus
from meridian_node_agent.apply.oplog import OpLog


@pytest.fixture
def node(server: DevServer, tmp_path: Path, node_id: str) -> Node:
    """The test's node, in mode managed-host, enrolled with the module's devserver as ``node_id``."""
    return make_node(server, tmp_path / "node", node_id)


def _applied_generation(node: Node) -> int:
    return StateStore(node.state_dir).load().generation


def _assert_host_untouched(node: Node) -> None:
    assert not node.applied_file().exists() or _applied_generation(node) == 0
    assert node.journal_runs() == []
    assert node.oplog_lines() == []
    assert not (node.state_dir / SPOOL_FILE).exists()


class _Delivering:
    """A control plane in the middle: the real one for heartbeats and reports, chosen bytes as the state."""

    def __init__(self, real: Any, envelope: bytes) -> None:
        self.real = real
        self.envelope = envelope

    def heartbeat(self, node_id: str) -> Lease:
        lease: Lease = self.real.heartbeat(node_id)
        return lease

    def fetch_desired_state(self, node_id: str, etag: str | None = None, wait_s: float = 0) -> DesiredStateFetch:
        return DesiredStateFetch(FetchStatus.NEW, envelope=self.envelope, etag="forged")

    def post_observation(self, observation: Observation) -> None:
        self.real.post_observation(observation)


def test_published_state_is_applied_once_and_unchanged_cycles_run_no_playbook(server: DevServer, node: Node) -> None:
    generation = publish(server, node.node_id)
    agent = node.agent()

    first = agent.cycle()

    assert first.outcome == CycleStatus.APPLIED, first
    assert first.run is not None and first.run.status == "successful"
    assert _applied_generation(node) == generation
    runs = node.journal_runs()
    assert runs == [first.run.ident] and runs[0].startswith(f"gen-{generation}-")
    oplog = [json.loads(line) for line in node.oplog_lines()]
    assert [(e["run_ident"], e["result"], e["generation"]) for e in oplog] == [
        (first.run.ident, "started", generation),
        (first.run.ident, "successful", generation),
    ]

    again = agent.cycle()
    # A restarted agent has no ETag: it fetches the full state, sees it applied, and still runs nothing.
    restarted = node.agent().cycle()

    assert again.outcome == CycleStatus.UNCHANGED
    assert restarted.outcome == CycleStatus.UNCHANGED
    assert node.journal_runs() == runs
    assert len(node.oplog_lines()) == 2


def test_state_for_another_node_is_rejected_and_nothing_changes(
    server: DevServer, tmp_path: Path, node_id: str
) -> None:
    node = make_node(server, tmp_path / "a", node_id)
    other = make_node(server, tmp_path / "b", f"{node_id}-other")
    publish(server, other.node_id)
    agent = node.agent()
    agent.client = _Delivering(agent.client, other.fetch_envelope(server))

    outcome = agent.cycle()

    assert (outcome.outcome, outcome.rejection) == (CycleStatus.REJECTED, "wrong-node")
    assert agent.counters.rejections == {"wrong-node": 1}
    _assert_host_untouched(node)


def test_expired_state_is_rejected_and_nothing_changes(server: DevServer, node: Node) -> None:
    publish(server, node.node_id, ttl=60)
    later = datetime.now(UTC) + timedelta(minutes=5)
    agent = node.agent(clock=lambda: later)

    outcome = agent.cycle()

    assert (outcome.outcome, outcome.rejection) == (CycleStatus.REJECTED, "expired")
    _assert_host_untouched(node)


def test_state_from_a_fenced_epoch_is_rejected_and_nothing_changes(server: DevServer, node: Node) -> None:
    publish(server, node.node_id)
    server.cli("fence", node.node_id)  # a failover: the published state's epoch is now a deposed leader's
    agent = node.agent()

    outcome = agent.cycle()

    assert (outcome.outcome, outcome.rejection) == (CycleStatus.REJECTED, "stale-epoch")
    assert agent.lease is not None
    assert StateStore(node.state_dir).load().epoch == agent.lease.epoch  # the new epoch is durable
    _assert_host_untouched(node)


def test_state_signed_by_an_unknown_control_key_is_rejected_and_nothing_changes(
    server: DevServer, tmp_path: Path, node_id: str
) -> None:
    # The policy trusts another control plane's key (a second devserver data dir), not this server's.
    other_data = tmp_path / "other-control-plane"
    info = cli(other_data, "info").stdout
    other_key = Path(
        next(line for line in info.splitlines() if line.startswith("control public key: "))
        .removeprefix("control public key: ")
        .split(" (keyid ")[0]
    )
    node = make_node(server, tmp_path / "node", node_id, trusted_control_key=other_key)
    publish(server, node_id)
    agent = node.agent()

    outcome = agent.cycle()
    repeat = agent.cycle()  # the same rejected bytes are not fetched and verified again

    assert (outcome.outcome, outcome.rejection) == (CycleStatus.REJECTED, "threshold-not-met")
    assert repeat.outcome == CycleStatus.UNCHANGED
    assert agent.counters.rejections == {"threshold-not-met": 1}
    _assert_host_untouched(node)


def test_replayed_older_envelope_is_rejected_after_a_newer_one_was_applied(server: DevServer, node: Node) -> None:
    publish(server, node.node_id)
    agent = node.agent()
    assert agent.cycle().outcome == CycleStatus.APPLIED
    old = (node.state_dir / SPOOL_FILE).read_bytes()
    newer = publish(server, node.node_id)
    assert agent.cycle().outcome == CycleStatus.APPLIED
    runs = node.journal_runs()
    agent.client = _Delivering(agent.client, old)

    outcome = agent.cycle()

    assert (outcome.outcome, outcome.rejection) == (CycleStatus.REJECTED, "replayed")
    assert _applied_generation(node) == newer
    assert node.journal_runs() == runs
    assert (node.state_dir / SPOOL_FILE).read_bytes() != old


class _KilledApply:
    """An apply that never finished: the playbook's process was killed before it recorded success."""

    def apply(self, envelope: bytes, **kwargs: Any) -> Any:
        raise RuntimeError("the apply's process was killed (SIGKILL)")


def test_an_older_state_after_a_newer_one_was_cut_short_is_refused_and_the_newer_applies_again(
    server: DevServer, node: Node
) -> None:
    first = publish(server, node.node_id)
    agent = node.agent()
    assert agent.cycle().outcome == CycleStatus.APPLIED
    old = (node.state_dir / SPOOL_FILE).read_bytes()
    newer = publish(server, node.node_id)
    applier, client = agent.applier, agent.client
    agent.applier = _KilledApply()
    assert agent.cycle().outcome == CycleStatus.APPLY_FAILED
    agent.client = _Delivering(client, old)

    outcome = agent.cycle()

    assert (outcome.outcome, outcome.rejection) == (CycleStatus.REJECTED, "replayed")
    record = StateStore(node.state_dir).load()
    assert (record.generation, record.accepted_generation) == (first, newer)
    agent.applier, agent.client, agent.etag = applier, client, None
    assert agent.cycle().outcome == CycleStatus.APPLIED  # the newer one's own bytes: the retry path
    after = StateStore(node.state_dir).load()
    assert (after.generation, after.accepted) == (newer, None)


def test_observe_only_verifies_and_reports_but_never_applies(server: DevServer, tmp_path: Path, node_id: str) -> None:
    node = make_node(server, tmp_path / "node", node_id, mode="observe-only")
    generation = publish(server, node_id)
    agent = node.agent()

    outcome = agent.cycle()

    assert (outcome.outcome, outcome.generation) == (CycleStatus.OBSERVED_ONLY, generation)
    assert _applied_generation(node) == 0
    assert node.journal_runs() == [] and node.oplog_lines() == []
    nodes = server.cli("nodes").stdout
    assert node_id in nodes


def test_lapsed_lease_holds_new_applies(server: DevServer, node: Node) -> None:
    publish(server, node.node_id, ttl=7200)
    # This host's clock says the 30 s lease just renewed is long gone: the agent must not apply.
    later = datetime.now(UTC) + timedelta(minutes=10)
    agent = node.agent(clock=lambda: later)

    outcome = agent.cycle()

    assert outcome.outcome == CycleStatus.LEASE_LAPSED
    assert node.journal_runs() == [] and _applied_generation(node) == 0


def test_interrupted_apply_is_applied_again_at_start_up(server: DevServer, node: Node) -> None:
    # What a crash mid-apply leaves: the spooled envelope and a 'started' line with no result.
    generation, _envelope = node.leave_interrupted_apply(server, "gen-{generation}-crashed")

    status = node.agent().run(once=True)

    assert status == 0
    entries = [(e.run_ident, e.result) for e in OpLog(node.state_dir / "oplog.jsonl").read()]
    assert entries[:2] == [(f"gen-{generation}-crashed", "started"), (f"gen-{generation}-crashed", "interrupted")]
    assert [outcome for _ident, outcome in entries[2:]] == ["started", "successful"]
    assert _applied_generation(node) == generation
    assert len(node.journal_runs()) == 1  # the re-apply; the cycle after it found nothing new
    assert OpLog(node.state_dir / "oplog.jsonl").pending() is None


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def test_unreachable_control_plane_backs_off_with_jitter_and_recovers(tmp_path: Path, node_id: str) -> None:
    port = _free_port()
    data = tmp_path / "control-plane"
    with ExitStack() as stack:
        server = stack.enter_context(running(data, extra=["--port", str(port)]))
        node = make_node(server, tmp_path / "node", node_id)
        generation = publish(server, node_id)
        stack.close()  # the control plane goes away before the agent's first cycle

        delays: list[float] = []

        def sleep(seconds: float) -> None:
            delays.append(seconds)
            if len(delays) == 4:
                stack.enter_context(running(data, extra=["--port", str(port)]))

        agent = node.agent(sleep=sleep)
        agent.backoff.rng = random.Random(5)
        status = agent.run(max_cycles=5)

    assert status == 0
    assert len(delays) == 4
    for attempt, delay in enumerate(delays, start=1):
        base = min(8.0, 1.0 * 2 ** (attempt - 1))
        assert base / 2 <= delay <= base, (attempt, delay)
    assert delays == sorted(delays)  # the bounds [0.5,1], [1,2], [2,4], [4,8] only grow
    assert agent.counters.unavailable == 4
    assert _applied_generation(node) == generation
