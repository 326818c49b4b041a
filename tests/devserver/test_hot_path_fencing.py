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
from typing import NamedTuple

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
from meridian_node_agent.devserver.store.change_feed import ChangeFeed, InProcessFeed

NODE = "fencing-node"


class Enrolled(NamedTuple):
    """A server in this process with ``NODE`` enrolled on it, and that node's client."""

    server: InProcessServer
    client: ControlClient


@contextmanager
def _enrolled(tmp_path: Path, store_backend: StoreBackend, feed: ChangeFeed | None) -> Iterator[Enrolled]:
    with (
        serving_in_process(tmp_path / "data", store_backend.location, feed=feed) as server,
        server.enroll(tmp_path, NODE) as client,
    ):
        yield Enrolled(server, client)


@pytest.fixture
def listening(tmp_path: Path, store_backend: StoreBackend) -> Iterator[Enrolled]:
    """``NODE`` on a server that hears the CLI's announcements through the database's change feed."""
    with _enrolled(tmp_path, store_backend, None) as enrolled:
        yield enrolled


@pytest.fixture
def deaf(tmp_path: Path, store_backend: StoreBackend) -> Iterator[Enrolled]:
    """``NODE`` on a server that never hears the CLI's announcements (``InProcessFeed``), as when they are lost."""
    with _enrolled(tmp_path, store_backend, InProcessFeed()) as enrolled:
        yield enrolled


def _stored_generations(server: InProcessServer) -> list[int]:
    """Which of ``NODE``'s observations the store keeps (see ``observation``)."""
    return [generation_of(r.body) for r in server.control.store.serving_observations() if r.node_id == NODE]


def test_a_heard_fence_refuses_a_stale_observation_from_memory(listening: Enrolled) -> None:
    server, client = listening
    epoch = client.heartbeat(NODE).epoch
    client.post_observation(observation(NODE, epoch, 1))
    applied = server.hot.watcher.applied
    server.cli("fence", NODE)
    wait_for(lambda: server.hot.watcher.applied > applied, "the fence was heard")

    before = server.statements
    refused = rejection(lambda: client.post_observation(observation(NODE, epoch, 2)))
    cost = server.statements - before
    current = client.heartbeat(NODE).epoch
    stored = _stored_generations(server)

    assert (refused.status, refused.reason) == (409, "stale-epoch")
    assert f"epoch {epoch}" in refused.detail and f"epoch {epoch + 1}" in refused.detail
    assert cost == 0
    assert current == epoch + 1
    assert stored == [1]


def test_a_fence_the_server_has_not_heard_of_is_caught_by_the_upsert(deaf: Enrolled) -> None:
    server, client = deaf
    epoch = client.heartbeat(NODE).epoch
    client.post_observation(observation(NODE, epoch, 1))
    server.cli("fence", NODE)
    believed = server.hot.cache.epoch(NODE)

    refused = rejection(lambda: client.post_observation(observation(NODE, epoch, 2)))
    learnt = client.heartbeat(NODE).epoch
    client.post_observation(observation(NODE, learnt, 3))
    stored = _stored_generations(server)

    assert believed == epoch  # the server's memory still had the old epoch: only the upsert could refuse it
    assert (refused.status, refused.reason) == (409, "stale-epoch")
    assert f"epoch {epoch + 1}" in refused.detail
    assert learnt == epoch + 1  # the refusal read the epoch, and the heartbeat answers with it
    assert stored == [3]


def test_a_revocation_the_server_has_not_heard_of_is_found_by_the_backstop(deaf: Enrolled) -> None:
    server, client = deaf
    client.heartbeat(NODE)
    server.cli("revoke", NODE)
    # Deaf to announcements, the server answers from memory until its backstop compares every node (every
    # 2 s in a real server; stepped here).
    client.heartbeat(NODE)
    server.hot.watcher.backstop()
    refused = rejection(lambda: client.heartbeat(NODE))

    assert (refused.status, refused.reason) == (403, "certificate-revoked")


@pytest.mark.parametrize("verb", ["revoke", "fence", "publish"])
def test_a_cli_change_reaches_a_listening_server_without_its_backstop(
    listening: Enrolled, tmp_path: Path, verb: str
) -> None:
    server, client = listening
    epoch = client.heartbeat(NODE).epoch
    client.fetch_desired_state(NODE)
    refreshes = server.hot.watcher.full_refreshes
    applied = server.hot.watcher.applied
    if verb == "publish":
        server.cli_publish(NODE, tmp_path)
    else:
        server.cli(verb, NODE)
    wait_for(lambda: server.hot.watcher.applied > applied, f"the {verb} was heard")

    if verb == "revoke":
        outcome: object = rejection(lambda: client.heartbeat(NODE)).reason
    elif verb == "fence":
        outcome = client.heartbeat(NODE).epoch
    else:
        outcome = client.fetch_desired_state(NODE).generation
    full_refreshes = server.hot.watcher.full_refreshes - refreshes

    assert outcome == {"revoke": "certificate-revoked", "fence": epoch + 1, "publish": 1}[verb]
    assert full_refreshes == 0  # the announcement did it, not a comparison of every node
