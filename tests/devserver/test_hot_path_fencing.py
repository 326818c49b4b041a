"""The epoch fence and revocation when the server answers from memory: each refusal still happens, and where it
comes from is what the design says.

Per backend, against a server in the test's process (``in_process_server.py``), while ``fence`` and ``revoke`` run
as the CLI in processes of their own:

- a fence the server has heard of refuses a stale observation from memory, sending no statement;
- a fence it has not heard of yet (its announcement lost: the server is deaf to the feed here) is caught by the
  fenced upsert, so the stale observation is still refused and never stored;
- a revocation it has not heard of is found by the watcher's backstop, and the next request is refused.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from ansible_collections.meridian.node.tests.devserver.devserver_process import rejection
from ansible_collections.meridian.node.tests.devserver.in_process_server import (
    InProcessServer,
    generation_of,
    observation,
    serving_in_process,
    wait_for,
)
from ansible_collections.meridian.node.tests.support.postgres import StoreBackend
from meridian_node_agent.agent_side.control_client import ControlClient
from meridian_node_agent.devserver.store.change_feed import InProcessFeed


@contextmanager
def _enrolled(
    tmp_path: Path, store_backend: StoreBackend, node_id: str, *, deaf: bool = False
) -> Iterator[tuple[InProcessServer, ControlClient]]:
    """A server in this process with ``node_id`` enrolled, and that node's client; a ``deaf`` one never hears the
    CLI's announcements (``InProcessFeed``), as when they are lost."""
    feed = InProcessFeed() if deaf else None
    with (
        serving_in_process(tmp_path / "data", store_backend.location, feed=feed) as server,
        server.enroll(tmp_path, node_id) as client,
    ):
        yield server, client


def _stored_generations(server: InProcessServer, node_id: str) -> list[int]:
    """Which of ``node_id``'s observations the store keeps (see ``observation``)."""
    return [generation_of(r.body) for r in server.control.store.serving_observations() if r.node_id == node_id]


def test_a_heard_fence_refuses_a_stale_observation_from_memory(tmp_path: Path, store_backend: StoreBackend) -> None:
    node_id = "fenced-node"
    with _enrolled(tmp_path, store_backend, node_id) as (server, c):
        epoch = c.heartbeat(node_id).epoch
        c.post_observation(observation(node_id, epoch, 1))
        applied = server.hot.watcher.applied
        server.cli("fence", node_id)
        wait_for(lambda: server.hot.watcher.applied > applied, "the fence was heard")

        before = server.statements
        refused = rejection(lambda: c.post_observation(observation(node_id, epoch, 2)))
        cost = server.statements - before
        current = c.heartbeat(node_id).epoch
        stored = _stored_generations(server, node_id)

    assert (refused.status, refused.reason) == (409, "stale-epoch")
    assert f"epoch {epoch}" in refused.detail and f"epoch {epoch + 1}" in refused.detail
    assert cost == 0
    assert current == epoch + 1
    assert stored == [1]


def test_a_fence_the_server_has_not_heard_of_is_caught_by_the_upsert(
    tmp_path: Path, store_backend: StoreBackend
) -> None:
    node_id = "raced-node"
    with _enrolled(tmp_path, store_backend, node_id, deaf=True) as (server, client):
        epoch = client.heartbeat(node_id).epoch
        client.post_observation(observation(node_id, epoch, 1))
        server.cli("fence", node_id)
        believed = server.hot.cache.epoch(node_id)

        refused = rejection(lambda: client.post_observation(observation(node_id, epoch, 2)))
        learnt = client.heartbeat(node_id).epoch
        client.post_observation(observation(node_id, learnt, 3))
        stored = _stored_generations(server, node_id)

    assert believed == epoch  # the server's memory still had the old epoch: only the upsert could refuse it
    assert (refused.status, refused.reason) == (409, "stale-epoch")
    assert f"epoch {epoch + 1}" in refused.detail
    assert learnt == epoch + 1  # the refusal read the epoch, and the heartbeat answers with it
    assert stored == [3]


def test_a_revocation_the_server_has_not_heard_of_is_found_by_the_backstop(
    tmp_path: Path, store_backend: StoreBackend
) -> None:
    node_id = "revoked-node"
    with _enrolled(tmp_path, store_backend, node_id, deaf=True) as (server, client):
        client.heartbeat(node_id)
        server.cli("revoke", node_id)
        # Deaf to announcements, the server answers from memory until its backstop compares every node (every
        # 2 s in a real server; stepped here).
        client.heartbeat(node_id)
        server.hot.watcher.backstop()
        refused = rejection(lambda: client.heartbeat(node_id))

    assert (refused.status, refused.reason) == (403, "certificate-revoked")


@pytest.mark.parametrize("verb", ["revoke", "fence", "publish"])
def test_a_cli_change_reaches_a_listening_server_without_its_backstop(
    tmp_path: Path, store_backend: StoreBackend, verb: str
) -> None:
    node_id = f"{verb}-heard-node"
    with _enrolled(tmp_path, store_backend, node_id) as (server, client):
        epoch = client.heartbeat(node_id).epoch
        client.fetch_desired_state(node_id)
        refreshes = server.hot.watcher.full_refreshes
        applied = server.hot.watcher.applied
        if verb == "publish":
            server.cli_publish(node_id, tmp_path)
        else:
            server.cli(verb, node_id)
        wait_for(lambda: server.hot.watcher.applied > applied, f"the {verb} was heard")

        if verb == "revoke":
            outcome: object = rejection(lambda: client.heartbeat(node_id)).reason
        elif verb == "fence":
            outcome = client.heartbeat(node_id).epoch
        else:
            outcome = client.fetch_desired_state(node_id).generation
        full_refreshes = server.hot.watcher.full_refreshes - refreshes

    assert outcome == {"revoke": "certificate-revoked", "fence": epoch + 1, "publish": 1}[verb]
    assert full_refreshes == 0  # the announcement did it, not a comparison of every node
