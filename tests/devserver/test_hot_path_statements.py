"""What a node's steady calls cost the database, counted: a heartbeat and a 304 send no statement, a parked long-poll
sends none while it waits, and a flush costs the same few statements whatever it carries.

The server runs in the test's process (``in_process_server.py``) with its periodic work off, on each backend
(``store_backend``: a SQLite file, then a PostgreSQL database), and is talked to over real mutual TLS by the agent's
own client. ``Database.statement_count`` counts every statement the server's store sends; a count taken around a
call is that call's cost. No timing is asserted: the counts hold however slow the machine is.
"""

from __future__ import annotations

import socket
import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path

from ansible_collections.meridian.node.plugins.module_utils.contracts import Observation
from ansible_collections.meridian.node.tests.devserver.in_process_server import (
    observation,
    serving_in_process,
    wait_for,
)
from ansible_collections.meridian.node.tests.support.postgres import StoreBackend
from meridian_node_agent.agent_side.control_client import DesiredStateFetch, FetchStatus
from meridian_node_agent.devserver.serving.lease_table import LeaseTable
from meridian_node_agent.devserver.serving.server import bind
from meridian_node_agent.devserver.store.database import Database, ObservationWrite

NOW = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)


def test_a_steady_heartbeat_sends_no_statement_and_its_flush_one(tmp_path: Path, store_backend: StoreBackend) -> None:
    with serving_in_process(tmp_path / "data", store_backend.location) as server:
        with server.enroll(tmp_path, "hb-node") as client:
            client.heartbeat("hb-node")  # the first: the node's certificate record and epoch are read once
            before = server.statements
            leases = [client.heartbeat("hb-node") for _ in range(50)]
            steady = server.statements - before

            before = server.statements
            flushed = server.hot.leases.flush()
            flush = server.statements - before
        [row] = [row for row in server.control.nodes() if row.node_id == "hb-node"]

    assert steady == 0
    assert (flushed, flush) == (1, 1)
    assert row.lease_expires_at == leases[-1].expires_at


def test_a_304_and_a_long_poll_that_times_out_send_no_statement(tmp_path: Path, store_backend: StoreBackend) -> None:
    with (
        serving_in_process(tmp_path / "data", store_backend.location) as server,
        server.enroll(tmp_path, "etag-node") as client,
    ):
        server.control.publish("etag-node", {"engines": [], "artifacts": []})
        first = client.fetch_desired_state("etag-node")
        before = server.statements
        again = [client.fetch_desired_state("etag-node", etag=first.etag) for _ in range(20)]
        waited = client.fetch_desired_state("etag-node", etag=first.etag, wait_s=0.3)
        cost = server.statements - before

    assert first.status is FetchStatus.NEW
    assert {fetch.status for fetch in [*again, waited]} == {FetchStatus.NOT_MODIFIED}
    assert cost == 0


def test_parked_long_polls_send_no_statement_and_a_cli_publish_wakes_only_its_node(
    tmp_path: Path, store_backend: StoreBackend
) -> None:
    nodes = [f"poll-node-{i}" for i in range(8)]
    results: dict[str, DesiredStateFetch | BaseException] = {}
    with serving_in_process(tmp_path / "data", store_backend.location) as server:
        clients = {node_id: server.enroll(tmp_path, node_id) for node_id in nodes}
        etags = {}
        for node_id, client in clients.items():
            server.control.publish(node_id, {"engines": [], "artifacts": []})
            etags[node_id] = client.fetch_desired_state(node_id).etag

        def poll(node_id: str) -> None:
            try:
                results[node_id] = clients[node_id].fetch_desired_state(node_id, etag=etags[node_id], wait_s=60)
            except BaseException as exc:
                results[node_id] = exc

        pollers = {node_id: threading.Thread(target=poll, args=(node_id,)) for node_id in nodes}
        for thread in pollers.values():
            thread.start()
        wait_for(lambda: server.hot.waiters.count == len(nodes), "every long-poll parked")
        before = server.statements
        # A polling design sends statements all the time; a parked request sends none however long it waits.
        pollers[nodes[0]].join(timeout=0.5)
        parked = server.statements - before

        # Another process publishes for one node: its announcement wakes that node's request and no other.
        server.cli_publish(nodes[3], tmp_path)
        pollers[nodes[3]].join(timeout=30)
        woken = server.statements - before
        still_parked = server.hot.waiters.count

        for node_id in nodes:  # release the others: an in-process publish wakes them without a read
            if node_id != nodes[3]:
                server.control.publish(node_id, {"engines": [], "artifacts": []})
        for thread in pollers.values():
            thread.join(timeout=30)
        for client in clients.values():
            client.close()

    assert parked == 0
    published = results[nodes[3]]
    assert isinstance(published, DesiredStateFetch) and published.status is FetchStatus.NEW, published
    assert published.generation == 2
    # The watcher re-read the published node's latest state once; the woken request answered from memory.
    assert woken == 1
    assert still_parked == len(nodes) - 1
    assert all(isinstance(r, DesiredStateFetch) and r.status is FetchStatus.NEW for r in results.values()), results


def _nodes_in(database: Database, count: int) -> list[str]:
    """``count`` enrolled nodes, made straight in the store."""
    node_ids = [f"batch-node-{i:04d}" for i in range(count)]
    for node_id in node_ids:
        token = f"token-value-for-{node_id}"
        database.put_token(f"t-{node_id}", token, NOW, node_id)
        database.enroll(
            token=token, node_id=node_id, serial=node_id, not_after=NOW + timedelta(days=1), lease_for=LEASE, now=NOW
        )
    return node_ids


LEASE = timedelta(seconds=30)


def test_a_flush_costs_the_same_statements_for_one_node_as_for_three_hundred(store_backend: StoreBackend) -> None:
    database = store_backend.open()
    node_ids = _nodes_in(database, 300)
    leases = LeaseTable(database)

    def lease_flush_cost(count: int) -> int:
        for node_id in node_ids[:count]:
            leases.renew(node_id, 1, NOW + timedelta(seconds=count), LEASE)
        before = database.statement_count
        assert leases.flush() == count
        return database.statement_count - before

    def observation_flush_cost(count: int) -> int:
        rows = [
            ObservationWrite(node_id, 1, observation(node_id, 1, count).model_dump_json().encode(), NOW)
            for node_id in node_ids[:count]
        ]
        before = database.statement_count
        assert database.record_observations(rows) == []
        return database.statement_count - before

    costs = {count: (lease_flush_cost(count), observation_flush_cost(count)) for count in (1, 300)}

    assert costs[1] == costs[300]
    assert costs[1][0] == 1
    rows = {row.node_id: row for row in database.nodes()}
    assert {rows[node_id].lease_expires_at for node_id in node_ids} == {NOW + timedelta(seconds=300) + LEASE}
    latest = {record.node_id: record.body for record in database.serving_observations()}
    assert {Observation.model_validate_json(latest[n]).applied_generation for n in node_ids} == {300}


def test_the_listening_socket_says_it_is_tcp_so_answers_are_not_held_back_by_nagle() -> None:
    # asyncio sets TCP_NODELAY on accepted connections only for a socket made with IPPROTO_TCP; without it each
    # answer with a body waited ~45 ms on the client's delayed ACK (uvicorn writes head and body apart).
    with bind("127.0.0.1", 0) as sock:
        assert sock.proto == socket.IPPROTO_TCP
