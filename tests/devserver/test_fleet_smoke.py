"""A 500-node fleet against a real devserver, through bench/fleet.py: every call answered, every node heard.

The load generator's own code runs one short step (its ramp, then ``WINDOW_S`` of steady state) of 500 nodes,
each enrolled through ``POST /v1/enroll`` with a key and certificate of its own, each on one kept-alive
mutual-TLS connection, cycling on the agent's timers (heartbeat, long-poll with ``If-None-Match``, an 8-GPU
observation on change or refresh) while new desired states are published to random nodes. What the test
asserts is what went through, never how fast (house rule: no timing thresholds in tests):

- no call failed, timed out or was refused, and every state published during the step reached its node;
- the server's own state shows every node: its lease renewed after the step began and its observation
  recorded (the database rows), and an engine of each node in ``GET /v1/serving`` (over HTTP, with one of
  the fleet's certificates), which only an observation that was received, stored and read back puts there.

Per backend (``store_backend``, tests/support/postgres.py): SQLite as the devserver embeds it, and PostgreSQL
through ``serve --database-url`` on a database of its own (skipped where PostgreSQL is not installed, failed
instead under ``MERIDIAN_REQUIRE_DOCKER=1``).
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from pathlib import Path

import pytest

from ansible_collections.meridian.node.bench.fleet import Fleet, StepOptions, StepResult, prepare_fleet, run_step
from ansible_collections.meridian.node.bench.fleet_node import AgentTimers
from ansible_collections.meridian.node.bench.fleet_observation import ObservationBodies
from ansible_collections.meridian.node.bench.fleet_server import Replicas, ServerProcess, open_control, serving
from ansible_collections.meridian.node.tests.support.postgres import StoreBackend
from meridian_node_agent.agent_side.control_client import ControlClient
from meridian_node_agent.devserver.control.plane import Settings
from meridian_node_agent.devserver.store.database import NodeRow

NODES = 500
# Two cycles of every node inside the window: enough that each one's steady calls (a heartbeat and a 304 per
# cycle) are exercised after the ramp, short enough for CI.
WINDOW_S = 30.0


def _run_fleet(server: ServerProcess, data_dir: Path, nodes_dir: Path) -> tuple[Fleet, StepResult, dict[str, NodeRow]]:
    control = open_control(data_dir, server.database_url)
    try:
        fleet = asyncio.run(prepare_fleet(server, control, NODES, nodes_dir))
        options = StepOptions(nodes=NODES, window_s=WINDOW_S)
        result = asyncio.run(
            run_step(Replicas([server]), control, fleet, options, AgentTimers.of_agent(), ObservationBodies.build())
        )
        rows = {row.node_id: row for row in control.nodes()}
    finally:
        control.close()
    return fleet, result, rows


@pytest.mark.slow
def test_a_500_node_fleet_is_answered_without_an_error_and_every_node_is_heard(
    tmp_path: Path, store_backend: StoreBackend
) -> None:
    # SQLite as the devserver embeds it by default (its file in the data dir); PostgreSQL through --database-url.
    database_url = None if store_backend.name == "sqlite" else store_backend.location
    data_dir = tmp_path / "data"
    with serving(data_dir, database_url=database_url) as server:
        fleet, result, rows = _run_fleet(server, data_dir, tmp_path / "nodes")
        first = fleet.nodes[0]
        ca_bundle = tmp_path / "ca.pem"
        ca_bundle.write_text(server.ca_pem)
        base_url = f"https://{server.host}:{server.port}"
        with ControlClient(base_url, ca_bundle, first.credentials, first.credentials) as client:
            projection = client.serving()

    assert (result.errors, result.timeouts) == (0, 0), result.failures
    assert result.undelivered == 0, f"{result.undelivered} of {result.published} published states never arrived"
    assert result.cycles >= NODES
    enrolled = {node.node_id for node in fleet.nodes}
    assert set(rows) == enrolled
    lease = timedelta(seconds=Settings().lease_s)
    not_renewed = sorted(
        n for n, row in rows.items() if not row.lease_expires_at or row.lease_expires_at < result.started_at + lease
    )
    assert not_renewed == [], f"{len(not_renewed)} nodes' leases were not renewed during the step: {not_renewed[:5]}"
    unobserved = sorted(
        n for n, row in rows.items() if not row.last_observed_at or row.last_observed_at < result.started_at
    )
    assert unobserved == [], f"{len(unobserved)} nodes' observations were not recorded: {unobserved[:5]}"
    serving_nodes = {endpoint.node_id for endpoint in projection.endpoints}
    assert serving_nodes == enrolled, f"missing from /v1/serving: {sorted(enrolled - serving_nodes)[:5]}"
