"""A server killed mid-flush loses what the bound says and nothing more, and the agent's retry restores it.

Real ``meridian-node-devserver serve`` processes, per backend: on SQLite one server, restarted on the same data dir
after the kill; on PostgreSQL two replicas, the retry going to the one still alive. The test holds the database's
lock (SQLite's write lock; on PostgreSQL the node's row), so the server's lease flush and observation batch are
stuck inside their transactions, then kills the server with SIGKILL. What the design promises
(docs/PROTOCOL.md, "How the server answers a fleet"):

- an observation the server acknowledged (204) is in the database: a POST answers only once its batch committed;
- the observation being written when it died was never acknowledged: its POST fails as a transfer failure, the
  agent's retry posts it again, and the database then holds it;
- the lease renewals it lost are exactly those it answered since its last flush (at most one flush interval of
  heartbeats): the database shows the last flushed renewal, and the next heartbeat renews it again.
"""

from __future__ import annotations

import signal
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import psycopg
import pytest

from ansible_collections.meridian.node.tests.devserver.devserver_process import DevServer, enroll_node, running
from ansible_collections.meridian.node.tests.devserver.in_process_server import (
    database_url_args,
    generation_of,
    observation,
    wait_for,
)
from ansible_collections.meridian.node.tests.support.postgres import StoreBackend
from meridian_node_agent.agent_side.control_client import ControlClient, ControlPlaneUnavailable
from meridian_node_agent.agent_side.identity import NodeIdentity
from meridian_node_agent.devserver.cli.common import DATABASE_URL_ENV
from meridian_node_agent.devserver.store.change_feed import libpq_conninfo
from meridian_node_agent.devserver.store.database import Database, NodeRow

NODE = "crash-node"


@contextmanager
def _database_held(store_backend: StoreBackend) -> Iterator[None]:
    """The lock every flush of the server's needs, held: SQLite's write lock, or on PostgreSQL the node's row."""
    if store_backend.name == "sqlite":
        holder = sqlite3.connect(store_backend.location, isolation_level=None)
        try:
            holder.execute("BEGIN IMMEDIATE")
            yield
        finally:
            holder.close()  # rolls back: the write lock is free again
        return
    with psycopg.connect(libpq_conninfo(store_backend.location)) as row_holder:
        row_holder.execute("SELECT 1 FROM nodes WHERE node_id = %s FOR UPDATE", (NODE,))
        yield
        row_holder.rollback()


def _flushes_stuck(store_backend: StoreBackend) -> bool:
    """Whether the server's lease flush and observation batch both wait on the held lock. PostgreSQL can say;
    SQLite cannot be asked, and the test gives the server a moment instead."""
    if store_backend.name == "sqlite":
        return True
    with psycopg.connect(libpq_conninfo(store_backend.location), autocommit=True) as observer:
        waiting = observer.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'meridian-node-devserver' "
            "AND wait_event_type = 'Lock'"
        ).fetchone()
    return bool(waiting and waiting[0] >= 2)


def _row(database: Database) -> NodeRow:
    return next(row for row in database.nodes() if row.node_id == NODE)


def _stored_generation(database: Database) -> int:
    return generation_of(next(r.body for r in database.serving_observations() if r.node_id == NODE))


def _client(server: DevServer, identity: NodeIdentity) -> ControlClient:
    return ControlClient(server.base_url, identity.ca_path, identity.cert_path, identity.key_path, timeout_s=30)


@pytest.mark.slow
def test_a_server_killed_mid_flush_loses_only_what_it_never_acknowledged(
    tmp_path: Path, store_backend: StoreBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every process of the test (servers, CLI verbs) on the backend's database.
    monkeypatch.setenv(DATABASE_URL_ENV, database_url_args(store_backend.location)[1])
    data = tmp_path / "data"
    database = store_backend.open()
    replicas = 1 if store_backend.name == "sqlite" else 2
    outcome: list[BaseException | None] = []
    with ExitStack() as servers:
        doomed, *others = [servers.enter_context(running(data)) for _ in range(replicas)]
        enroll_node(doomed, tmp_path / NODE, NODE).close()
        identity = NodeIdentity(tmp_path / NODE)
        with _client(doomed, identity) as client:
            flushed = client.heartbeat(NODE)
            wait_for(lambda: _row(database).lease_expires_at == flushed.expires_at, "the first renewal flushed")
            client.post_observation(observation(NODE, flushed.epoch, 1))
            acknowledged = _stored_generation(database)  # read at once: a 204 means it is stored

            with _database_held(store_backend):
                lost = client.heartbeat(NODE)  # answered from memory while the database is held

                def post() -> None:
                    try:
                        client.post_observation(observation(NODE, flushed.epoch, 2))
                        outcome.append(None)
                    except BaseException as exc:
                        outcome.append(exc)

                poster = threading.Thread(target=post)
                poster.start()
                wait_for(lambda: _flushes_stuck(store_backend), "the server's flushes wait on the lock")
                poster.join(timeout=0.5)  # a moment for the POST to arrive; it cannot be answered
                answered_while_held = not poster.is_alive()
                assert doomed.process is not None
                doomed.process.send_signal(signal.SIGKILL)
                doomed.process.wait(timeout=30)
                poster.join(timeout=60)
        after_kill = (_row(database).lease_expires_at, _stored_generation(database))

        # The agent retries where a server answers: the other replica, or the one restarted on the same data dir.
        retry_server = others[0] if others else servers.enter_context(running(data))
        with _client(retry_server, identity) as retry:
            retry.post_observation(observation(NODE, flushed.epoch, 2))
            restored = _stored_generation(database)
            renewed = retry.heartbeat(NODE)
            wait_for(lambda: _row(database).lease_expires_at == renewed.expires_at, "the retried renewal flushed")

    assert acknowledged == 1
    assert not answered_while_held
    assert len(outcome) == 1 and isinstance(outcome[0], ControlPlaneUnavailable), outcome
    # Lost: the renewal answered since the last flush, and the observation never acknowledged. Kept: the rest.
    assert lost.expires_at > flushed.expires_at
    assert after_kill == (flushed.expires_at, 1)
    assert restored == 2
