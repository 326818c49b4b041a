"""A server's memory after a start and after a lost announcement: what it reads, counted.

- A server that starts on a database with enrolled nodes and published states reads every certificate record and
  desired state in two statements, so the fleet's first requests after a restart send none.
- The watcher's backstop reads only the nodes changed since it last looked (``nodes.change_seq``): one statement
  when nothing changed, whatever the number of nodes; a fence and a publish whose announcements were lost are found
  by it, without comparing every node.
- ``Database.nodes_changed_since`` lists changed nodes by the order their transactions committed.

Per backend, the server in the test's process with its periodic work off (``in_process_server.py``), the CLI in
processes of its own, the agent's own client over mutual TLS. No timing is asserted.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

from ansible_collections.meridian.node.tests.devserver.in_process_server import serving_in_process
from ansible_collections.meridian.node.tests.support.postgres import StoreBackend
from meridian_node_agent.agent_side.control_client import ControlClient, FetchStatus
from meridian_node_agent.agent_side.identity import NodeIdentity
from meridian_node_agent.devserver.store.change_feed import InProcessFeed

EMPTY: dict[str, list[object]] = {"engines": [], "artifacts": []}
_NOW = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)


def test_a_restarted_server_answers_the_first_requests_of_known_nodes_from_memory(
    tmp_path: Path, store_backend: StoreBackend
) -> None:
    data = tmp_path / "data"
    nodes = ["warm-a", "warm-b", "warm-c"]
    with serving_in_process(data, store_backend.location) as first:
        for node_id in nodes:
            first.enroll(tmp_path, node_id).close()
            first.control.publish(node_id, EMPTY)

    with serving_in_process(data, store_backend.location) as server:
        before = server.statements
        answers = []
        for node_id in nodes:
            identity = NodeIdentity(tmp_path / node_id)
            with ControlClient(
                server.base_url, identity.ca_path, identity.cert_path, identity.key_path, timeout_s=30
            ) as client:
                answers.append((client.heartbeat(node_id).epoch, client.fetch_desired_state(node_id).status))
        cost = server.statements - before

    assert answers == [(1, FetchStatus.NEW)] * len(nodes)
    assert cost == 0  # the certificate records and desired states were read at start, two statements for all


def test_the_backstop_reads_only_what_changed_and_finds_lost_announcements(
    tmp_path: Path, store_backend: StoreBackend
) -> None:
    data = tmp_path / "data"
    node_id = "deaf-node"
    # InProcessFeed: the server hears nothing the CLI announces, as when a NOTIFY is lost.
    with (
        serving_in_process(data, store_backend.location, feed=InProcessFeed()) as server,
        server.enroll(tmp_path, node_id) as client,
    ):
        for other in ("quiet-1", "quiet-2", "quiet-3"):
            server.enroll(tmp_path, other).close()
        epoch = client.heartbeat(node_id).epoch
        assert client.fetch_desired_state(node_id).status is FetchStatus.NONE_PUBLISHED
        server.hot.watcher.backstop()  # takes in the enrollments above
        refreshes = server.hot.watcher.full_refreshes

        before = server.statements
        server.hot.watcher.backstop()
        idle_cost = server.statements - before

        server.cli("fence", node_id)
        server.cli_publish(node_id, tmp_path)
        unheard = client.heartbeat(node_id).epoch
        server.hot.watcher.backstop()
        heard = client.heartbeat(node_id).epoch
        fetched = client.fetch_desired_state(node_id)
        full_refreshes = server.hot.watcher.full_refreshes - refreshes

    assert idle_cost == 1  # one indexed statement, whatever the number of nodes
    assert (unheard, heard) == (epoch, epoch + 1)
    assert (fetched.status, fetched.generation) == (FetchStatus.NEW, 1)
    assert full_refreshes == 0  # found by the changed nodes alone, not by comparing every node


def test_changed_nodes_are_listed_in_the_order_their_changes_committed(store_backend: StoreBackend) -> None:
    database = store_backend.open()
    for node_id in ("n-a", "n-b", "n-c"):
        database.publish(node_id, lambda generation, epoch: (b"{}", f'"{generation}-{epoch}"'), _NOW)
    database.fence("n-a")  # n-a changes again, after n-b and n-c
    changed = database.nodes_changed_since(0)
    by_seq = [node.node_id for node in sorted(changed, key=lambda node: node.change_seq)]
    after_c = database.nodes_changed_since(next(n.change_seq for n in changed if n.node_id == "n-c"))
    last = database.last_change_seq()

    assert by_seq == ["n-b", "n-c", "n-a"]
    assert [node.node_id for node in after_c] == ["n-a"]
    assert [node.epoch for node in after_c] == [2]
    assert last == max(node.change_seq for node in changed)
