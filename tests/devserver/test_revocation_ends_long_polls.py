"""A long-poll parked before its node's certificate was revoked must not outlive the revocation (issue 38, item 1).

The attack: a node's key leaks; the operator revokes the node. A desired-state long-poll the thief parked before the
revocation used to stay parked, and was answered with the next state published to the node, ``secret_env``
included, while every new request with that certificate got a 403. Now a revocation, a re-enrollment of the node and
a fence end every parked request of that node at once, and every answer is checked against the certificate as it
is when the answer is sent: a revoked certificate gets the refusal a new request gets, a fenced node its current
answer (a 304), so that it heartbeats and learns its new epoch without waiting out its ``wait``.

Per backend and per route (``SteadyCallLane``, what ``serve`` runs, and FastAPI's route alone), against a server in
the test's process (``in_process_server.py``) talked to over real mutual TLS by the agent's client, while
``revoke``, ``fence`` and ``publish`` run as the CLI in processes of their own (the server hears them through its
change feed, on its watcher's thread). Each long-poll asks to wait 60 s (the server's limit) and must end within the
30 s liveness guard, so a request that merely timed out fails. The same across two replicas is in
``test_replicas.py``. ``DesiredStateWaiters`` alone, and what ``NodeStateCache`` tells it, are at the end.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from functools import partial
from pathlib import Path

import pytest

from ansible_collections.meridian.node.tests.devserver.devserver_process import rejection
from ansible_collections.meridian.node.tests.devserver.in_process_server import (
    InProcessServer,
    LongPoll,
    serving_in_process,
    wait_for,
)
from ansible_collections.meridian.node.tests.support.postgres import StoreBackend
from meridian_node_agent.agent_side.control_client import (
    ControlClient,
    ControlPlaneRejected,
    DesiredStateFetch,
    FetchStatus,
)
from meridian_node_agent.devserver.serving.long_poll import DesiredStateWaiters
from meridian_node_agent.devserver.serving.state_cache import NodeStateCache
from meridian_node_agent.devserver.store.change_feed import ChangeKind, StateChange
from meridian_node_agent.devserver.store.database import Database

NODE = "parked-node"
WAIT_S = 60.0  # the server's longest wait: a request that ends within the 30 s guard was ended, not timed out


def _park(server: InProcessServer, client: ControlClient) -> tuple[LongPoll, str]:
    """A long-poll of ``NODE`` on its current state, parked on the server; the state's ETag."""
    etag = server.control.publish(NODE, {"engines": [], "artifacts": []}).etag
    poll = LongPoll(client, NODE, etag, WAIT_S)
    wait_for(lambda: server.hot.waiters.count == 1, "the long-poll parked")
    return poll, etag


@dataclass
class Parked:
    """A server in this process, ``NODE`` enrolled on it, and that node's long-poll parked there."""

    server: InProcessServer
    client: ControlClient
    poll: LongPoll
    etag: str


@pytest.fixture(params=[True, False], ids=["lane", "fastapi-route"])
def parked(request: pytest.FixtureRequest, tmp_path: Path, store_backend: StoreBackend) -> Iterator[Parked]:
    """``NODE``'s long-poll parked on a server on each backend, served by each route (see the module doc)."""
    with (
        serving_in_process(tmp_path / "data", store_backend.location, lane=request.param) as server,
        server.enroll(tmp_path, NODE) as client,
    ):
        yield Parked(server, client, *_park(server, client))


def test_a_revocation_ends_a_parked_long_poll_with_the_refusal_a_new_request_gets(parked: Parked) -> None:
    parked.server.cli("revoke", NODE)
    ended = parked.poll.outcome("the revocation ended the parked long-poll")
    fresh = rejection(lambda: parked.client.fetch_desired_state(NODE))

    assert isinstance(ended, ControlPlaneRejected), ended
    assert (ended.status, ended.reason, ended.detail) == (fresh.status, fresh.reason, fresh.detail)
    assert (fresh.status, fresh.reason) == (403, "certificate-revoked")


def test_a_state_published_after_a_revocation_never_reaches_the_parked_long_poll(
    parked: Parked, tmp_path: Path
) -> None:
    parked.server.cli("revoke", NODE)
    parked.server.cli_publish(NODE, tmp_path)  # its secrets are what the thief's parked request waited for
    ended = parked.poll.outcome("the parked long-poll ended")
    published = parked.server.control.store.latest_desired(NODE)

    assert published is not None and published.generation == 2
    assert isinstance(ended, ControlPlaneRejected), f"the revoked certificate was answered: {ended}"
    assert (ended.status, ended.reason) == (403, "certificate-revoked")


def test_a_re_enrollment_ends_the_old_certificate_s_parked_long_poll(parked: Parked, tmp_path: Path) -> None:
    stolen = parked  # the long-poll is the thief's, parked with a copy of the node's key
    # The operator rebuilds the node: a new key, a new token, a new certificate; the copy's request must end.
    with stolen.server.enroll(tmp_path / "rebuilt", NODE, token_name="rebuilt") as rebuilt:
        ended = stolen.poll.outcome("the re-enrollment ended the old certificate's long-poll")
        current = rebuilt.fetch_desired_state(NODE)

    assert isinstance(ended, ControlPlaneRejected), f"the superseded certificate was answered: {ended}"
    assert (ended.status, ended.reason) == (403, "certificate-revoked")
    assert "enrolled again" in ended.detail
    assert current.status is FetchStatus.NEW


def test_a_fence_ends_a_parked_long_poll_with_the_current_answer(parked: Parked) -> None:
    # No heartbeat yet: the server has not read the node's epoch, and must end its long-poll all the same.
    parked.server.cli("fence", NODE)
    ended = parked.poll.outcome("the fence ended the parked long-poll")
    epoch = parked.client.heartbeat(NODE).epoch

    assert isinstance(ended, DesiredStateFetch), ended
    assert (ended.status, ended.etag) == (FetchStatus.NOT_MODIFIED, parked.etag)
    assert epoch == 2


def test_a_revocation_by_the_server_s_own_control_plane_ends_the_parked_long_poll(parked: Parked) -> None:
    # What a verb run in the server's process does (``ControlPlane.local``): no announcement comes back for it.
    parked.server.control.revoke(NODE)
    parked.server.control.publish(NODE, {"engines": [], "artifacts": []})
    ended = parked.poll.outcome("the revocation ended the parked long-poll")

    assert isinstance(ended, ControlPlaneRejected), f"the revoked certificate was answered: {ended}"
    assert (ended.status, ended.reason) == (403, "certificate-revoked")


# DesiredStateWaiters alone: what ``end`` promises the loop in ``HotPath.desired_state``.


async def _never() -> None:
    await asyncio.Event().wait()


def _from_another_thread(call: Callable[[], object]) -> None:
    thread = threading.Thread(target=call)
    thread.start()
    thread.join()


def test_end_from_another_thread_ends_only_that_node_s_parked_requests() -> None:
    async def scenario() -> tuple[bool, bool, bool, bool]:
        waiters = DesiredStateWaiters()
        ended, other = waiters.park("node-a"), waiters.park("node-b")
        _from_another_thread(lambda: waiters.end("node-a"))
        stayed = await ended.sleep(30, _never())
        other_woken = other.woken
        waiters.unpark(ended)
        waiters.unpark(other)
        return stayed, ended.ended, other.ended, other_woken

    stayed, ended, other_ended, other_woken = asyncio.run(scenario())

    assert stayed  # the client is still there: the sleep ended because the request was ended
    assert ended
    assert (other_ended, other_woken) == (False, False)


def test_a_new_state_wakes_a_parked_request_without_ending_it() -> None:
    async def scenario() -> tuple[bool, bool]:
        waiters = DesiredStateWaiters()
        parked = waiters.park("node-a")
        _from_another_thread(lambda: waiters.wake("node-a"))
        await parked.sleep(30, _never())
        woken = parked.woken
        waiters.unpark(parked)
        return woken, parked.ended

    assert asyncio.run(scenario()) == (True, False)


def test_an_end_that_comes_between_two_sleeps_is_kept_for_the_next() -> None:
    # The request was woken (a new state), and is between its two waits (re-checking) when the end comes: the end
    # must not be lost with the wake-up it was not there to receive.
    async def scenario() -> tuple[bool, bool, int]:
        waiters = DesiredStateWaiters()
        parked = waiters.park("node-a")
        waiters.wake("node-a")
        await parked.sleep(30, _never())
        waiters.end("node-a")
        await asyncio.sleep(0)  # the loop runs what ``end`` scheduled
        parked.rearm()
        ended = parked.ended
        waiters.unpark(parked)
        return ended, parked.woken, waiters.count

    assert asyncio.run(scenario()) == (True, False, 0)


def test_the_cache_tells_of_a_moved_epoch_and_of_dropped_records_never_of_a_first_read(tmp_path: Path) -> None:
    # What ``HotPath`` wires to the node's parked requests: ``on_fenced`` ends them, ``on_certificates`` wakes them
    # to check their certificates again.
    now = datetime(2026, 3, 1, tzinfo=UTC)
    database = Database(str(tmp_path / "devserver.sqlite3"))
    for node_id in ("node-a", "node-b"):
        database.put_token(f"t-{node_id}", f"token-for-{node_id}", now, node_id)
        database.enroll(
            token=f"token-for-{node_id}",
            node_id=node_id,
            serial=node_id,
            not_after=now + timedelta(days=1),
            lease_for=timedelta(seconds=30),
            now=now,
        )
    told: list[tuple[str, str]] = []
    cache = NodeStateCache(
        database,
        on_certificates=lambda node_id: told.append(("certificates", node_id)),
        on_fenced=lambda node_id: told.append(("fenced", node_id)),
    )
    steps: list[tuple[str, tuple[Callable[[], object], ...]]] = [
        ("first read", (partial(cache.epoch, "node-a"),)),
        ("read again, unchanged", (partial(cache.current_epoch, "node-a"),)),
        ("fenced elsewhere, then read", (partial(database.fence, "node-a"), partial(cache.current_epoch, "node-a"))),
        ("fenced by this process", (lambda: cache.note_epoch("node-a", database.fence("node-a")),)),
        (
            "announced fence of an epoch never read",
            (partial(database.fence, "node-b"), partial(cache.apply, StateChange(ChangeKind.FENCED, "node-b"))),
        ),
        ("announced re-enrollment", (partial(cache.apply, StateChange(ChangeKind.ENROLLED, "node-b")),)),
        ("first full refresh", (cache.refresh_all,)),
        ("fenced elsewhere, found by a refresh", (partial(database.fence, "node-a"), cache.refresh_all)),
        ("revoked elsewhere, found by a refresh", (partial(database.revoke, "node-a", now), cache.refresh_all)),
    ]
    seen = {}
    try:
        for name, calls in steps:
            for call in calls:
                call()
            seen[name], told[:] = list(told), []
    finally:
        database.close()

    assert seen == {
        "first read": [],
        "read again, unchanged": [],
        "fenced elsewhere, then read": [("fenced", "node-a")],
        "fenced by this process": [("fenced", "node-a")],
        "announced fence of an epoch never read": [("fenced", "node-b")],
        "announced re-enrollment": [("certificates", "node-b")],
        "first full refresh": [],
        "fenced elsewhere, found by a refresh": [("fenced", "node-a")],
        "revoked elsewhere, found by a refresh": [("certificates", "node-a")],
    }
