"""A steady agent against the real devserver: what an unchanged cycle sends, and the kept-alive connection.

An unchanged cycle is cheap because the agent renews its lease once per interval (not on every early
long-poll return), re-sends an unchanged observation only at its refresh interval, and keeps one TLS
connection open. These tests hold the faults that saving could let in: a changed observation held back,
a lease left to lapse, a connection the server closed while idle, an unread answer left on the
connection, a re-enrolled certificate ignored by a running agent.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from ansible_collections.meridian.node.tests.devserver.devserver_process import DevServer, enroll_node
from ansible_collections.meridian.node.tests.support.node_env import SERVING_ENGINE, RecordingClient, make_node, publish
from ansible_collections.meridian.node.tests.support.wall_clock import MonotonicClock
from meridian_node_agent.agent_side.control_client import (
    ControlClient,
    ControlPlaneRejected,
    ControlPlaneUnavailable,
)
from meridian_node_agent.agent_side.cycle import Agent, CycleStatus
from meridian_node_agent.agent_side.identity import NodeIdentity
from meridian_node_agent.agent_side.observe import Observer
from meridian_node_agent.agent_side.reporter import REPORT_REFRESH_S
from meridian_node_agent.agent_side.status_file import STATUS_REFRESH_S
from meridian_node_agent.config import TIMER_JITTER

# uvicorn closes a kept-alive connection after 5 s without a request.
_SERVER_KEEP_ALIVE_SECONDS = 5


def _steady_agent(
    server: DevServer, tmp_path: Path, node_id: str
) -> tuple[Agent, MonotonicClock, RecordingClient, list[Any]]:
    """An agent that applied a published state, on a test clock, with an engine list the test controls."""
    node = make_node(server, tmp_path / "node", node_id)
    publish(server, node_id)
    agent = node.agent()
    clock = MonotonicClock()
    engines: list[Any] = []
    agent.monotonic = clock
    agent.observer = Observer(
        store_path=None, gpu_facts=lambda: {"nvml_available": False}, engines=lambda: list(engines), monotonic=clock
    )
    counting = RecordingClient(agent.client)
    agent.client = counting
    assert agent.cycle().outcome == CycleStatus.APPLIED
    # An apply longer than APPLY_REPORT_S also reports while it runs (test_agent_apply_reports.py): keep only the
    # cycle's own post, the one these tests count from.
    del counting.posted[:-1]
    return agent, clock, counting, engines


def test_unchanged_observation_is_resent_at_the_refresh_interval_not_every_cycle(
    server: DevServer, tmp_path: Path, node_id: str
) -> None:
    agent, clock, counting, _ = _steady_agent(server, tmp_path, node_id)
    assert len(counting.posted) == 1

    for _ in range(5):
        clock.now += 1
        assert agent.cycle().outcome == CycleStatus.UNCHANGED
    held_back = len(counting.posted)
    clock.now += REPORT_REFRESH_S * (1 + TIMER_JITTER)  # the refresh is jittered: past its latest
    agent.cycle()

    assert held_back == 1
    assert len(counting.posted) == 2
    # The re-sent observation is a fresh one, not the first one replayed.
    assert counting.posted[1].observed_at > counting.posted[0].observed_at


def test_changed_observation_is_sent_in_the_cycle_that_sees_the_change(
    server: DevServer, tmp_path: Path, node_id: str
) -> None:
    agent, clock, counting, engines = _steady_agent(server, tmp_path, node_id)
    clock.now += 1
    agent.cycle()
    assert len(counting.posted) == 1

    engines.append(dict(SERVING_ENGINE))
    clock.now += 1
    agent.cycle()

    assert len(counting.posted) == 2
    assert [e.name for e in counting.posted[1].engines] == ["chat"]


def test_lease_is_renewed_once_per_interval_and_before_it_can_lapse(
    server: DevServer, tmp_path: Path, node_id: str
) -> None:
    agent, clock, counting, _ = _steady_agent(server, tmp_path, node_id)
    renewals = counting.heartbeats

    for _ in range(3):  # long-polls that returned early, within one heartbeat interval
        agent.cycle()
    early = counting.heartbeats - renewals
    clock.now += agent.lease_keeper.pause_s * (1 + TIMER_JITTER)  # the renewal is jittered: past its latest
    agent.cycle()

    assert early == 0
    assert counting.heartbeats - renewals == 1
    assert agent.lease is not None


def test_connection_the_server_closed_while_idle_is_reopened_not_failed(
    server: DevServer, tmp_path: Path, node_id: str
) -> None:
    with enroll_node(server, tmp_path / node_id, node_id) as client:
        client.heartbeat(node_id)
        time.sleep(_SERVER_KEEP_ALIVE_SECONDS + 1.5)  # let the server drop the kept-alive connection

        lease = client.heartbeat(node_id)

    assert lease.node_id == node_id


def test_answer_over_the_size_cap_is_not_left_on_the_connection_for_the_next_call(
    server: DevServer, tmp_path: Path, node_id: str
) -> None:
    enroll_node(server, tmp_path / node_id, node_id).close()
    publish(server, node_id)
    identity = NodeIdentity(tmp_path / node_id)
    # Big enough for a lease, too small for a signed envelope.
    with ControlClient(
        server.base_url, identity.ca_path, identity.cert_path, identity.key_path, max_response_bytes=400
    ) as client:
        client.heartbeat(node_id)
        with pytest.raises(ControlPlaneUnavailable, match="400-byte limit"):
            client.fetch_desired_state(node_id)

        lease = client.heartbeat(node_id)

    assert lease.node_id == node_id


def test_running_client_uses_the_certificate_of_a_re_enrollment(
    server: DevServer, tmp_path: Path, node_id: str
) -> None:
    directory = tmp_path / node_id
    with enroll_node(server, directory, node_id) as client:
        client.heartbeat(node_id)
        server.cli("revoke", node_id)
        with pytest.raises(ControlPlaneRejected) as refused:
            client.heartbeat(node_id)
        assert refused.value.reason == "certificate-revoked"

        # Re-enrolled by another process (``meridian-node enroll``): new certificate files on disk.
        enroll_node(server, directory, node_id, server.new_token(f"again-{node_id}")).close()

        lease = client.heartbeat(node_id)

    assert lease.node_id == node_id


def test_unreadable_tls_files_are_a_transfer_failure_naming_them(server: DevServer, tmp_path: Path) -> None:
    missing = tmp_path / "nowhere" / "ca.pem"
    with ControlClient(server.base_url, missing) as client, pytest.raises(ControlPlaneUnavailable) as failed:
        client.heartbeat("any-node")

    assert str(missing) in str(failed.value)


def test_status_file_is_rewritten_on_a_change_or_at_its_refresh_interval(
    server: DevServer, tmp_path: Path, node_id: str
) -> None:
    agent, clock, _, _ = _steady_agent(server, tmp_path, node_id)
    status = agent.state_dir / "status.json"
    agent.write_status()
    first = status.stat().st_ino

    agent.cycle()
    agent.write_status()  # only the cycle count moved: nothing worth a write
    assert status.stat().st_ino == first

    agent.counters.unavailable += 1  # something a reader wants to see
    agent.write_status()
    changed = status.stat().st_ino
    assert changed != first
    assert json.loads(status.read_text())["counters"]["unavailable"] == 1

    clock.now += STATUS_REFRESH_S
    agent.write_status()  # nothing changed, but 'updated_at' must keep showing a live agent
    assert status.stat().st_ino != changed
