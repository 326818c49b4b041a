"""Several ``meridian-node-devserver serve`` processes on one PostgreSQL database and one data dir: any node served
by any replica, one CA, one control key, one-time tokens, and the epoch fence and revocations on every replica
(a revocation ends the long-polls parked on each).

Real processes on 127.0.0.1, each on its own port, started together on an empty data dir (so that they race to
make the CA and the control key); the CLI's verbs run as processes of their own on the same database
(``MERIDIAN_DEVSERVER_DATABASE_URL``). The agent's client talks to either replica as a node behind a load
balancer, or with two URLs, would. The burst test also runs on SQLite, with one server.

Skipped where PostgreSQL's server binaries are missing (failed instead under ``MERIDIAN_REQUIRE_DOCKER=1``).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, ExitStack, contextmanager
from pathlib import Path

import pytest
import yaml
from cryptography import x509

from ansible_collections.meridian.node.tests.devserver.devserver_process import (
    DevServer,
    cli,
    node_client,
    rejection,
    running,
)
from ansible_collections.meridian.node.tests.devserver.in_process_server import (
    LongPoll,
    database_url_args,
    generation_of,
    observation,
    wait_for,
)
from ansible_collections.meridian.node.tests.support.at_once import at_once
from ansible_collections.meridian.node.tests.support.postgres import StoreBackend
from meridian_node_agent.agent_side.control_client import (
    ControlClient,
    ControlPlaneRejected,
    DesiredStateFetch,
    FetchStatus,
)
from meridian_node_agent.agent_side.identity import NodeIdentity
from meridian_node_agent.devserver.cli.common import DATABASE_URL_ENV
from meridian_node_agent.devserver.control.plane import open_control_plane
from meridian_node_agent.devserver.serving.server import prepare_tls
from meridian_node_agent.devserver.store.database import Database

_tokens = itertools.count(1)


@contextmanager
def _replicas(data: Path, count: int) -> Iterator[list[DevServer]]:
    """``count`` servers on ``data``, started at the same moment."""
    contexts: list[AbstractContextManager[DevServer]] = [running(data, name=f"replica-{i}") for i in range(count)]
    entered: list[AbstractContextManager[DevServer]] = []
    try:
        with ThreadPoolExecutor(count) as pool:
            futures = [pool.submit(context.__enter__) for context in contexts]
        for context, future in zip(contexts, futures, strict=True):
            if future.exception() is None:
                entered.append(context)
        yield [future.result() for future in futures]
    finally:
        for context in entered:
            context.__exit__(None, None, None)


@pytest.fixture
def database_url(postgres_database: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """An empty PostgreSQL database that every process of the test uses."""
    monkeypatch.setenv(DATABASE_URL_ENV, postgres_database)
    return postgres_database


def _token(data: Path, node_id: str | None = None) -> str:
    extra = ["--node-id", node_id] if node_id else []
    return cli(data, "token", f"t-{next(_tokens)}", *extra).stdout.strip()


def _enroll(server: DevServer, directory: Path, node_id: str, token: str) -> NodeIdentity:
    identity = NodeIdentity(directory / node_id)
    with ControlClient(server.base_url, server.ca_bundle) as anonymous:
        identity.store(anonymous.enroll(node_id, token, identity.csr_pem(node_id)))
    return identity


def _publish(data: Path, node_id: str, directory: Path) -> int:
    document = directory / f"desired-{node_id}.yaml"
    document.write_text(yaml.safe_dump({"engines": [], "artifacts": []}))
    return int(cli(data, "publish", node_id, str(document)).stdout.split("generation ")[1].split()[0])


def test_replicas_started_together_issue_from_one_ca_and_serve_each_other_s_nodes(
    tmp_path: Path, database_url: str
) -> None:
    data = tmp_path / "data"
    with _replicas(data, 2) as (first, second):
        one = _enroll(first, tmp_path, "node-one", _token(data, "node-one"))
        two = _enroll(second, tmp_path, "node-two", _token(data, "node-two"))
        # Each node's client trusts the CA bundle its enrollment returned: the other replica's TLS certificate must
        # chain to it, and the other replica must know the node's certificate.
        with node_client(second.base_url, one) as one_on_second, node_client(first.base_url, two) as two_on_first:
            leases = (one_on_second.heartbeat("node-one"), two_on_first.heartbeat("node-two"))

    ca = (data / "ca" / "ca.pem").read_text()
    assert one.ca_path.read_text() == two.ca_path.read_text() == ca
    assert [lease.epoch for lease in leases] == [1, 1]
    leftovers = [p.name for d in ("ca", "control", "tls") for p in (data / d).iterdir() if p.name.endswith(".tmp")]
    assert leftovers == []
    assert sorted(p.name for p in (data / "control").iterdir()) == ["control.key.pem", "control.pub.pem"]


def test_a_server_name_is_in_the_tls_certificate_nodes_dial(tmp_path: Path) -> None:
    control = open_control_plane(tmp_path / "data", database=":memory:")
    try:
        tls = prepare_tls(control, "0.0.0.0", ["control.example"])
    finally:
        control.close()
    certificate = x509.load_pem_x509_certificate(tls.cert.read_bytes())
    names = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.DNSName) == ["control.example", "localhost"]
    assert [str(ip) for ip in names.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]


def test_an_enrollment_token_works_once_across_replicas(tmp_path: Path, database_url: str) -> None:
    data = tmp_path / "data"
    with _replicas(data, 2) as servers:
        token = _token(data)

        def enroll(server: DevServer, node_id: str) -> str:
            try:
                _enroll(server, tmp_path, node_id, token)
            except ControlPlaneRejected as exc:
                return exc.reason
            return "enrolled"

        outcomes = at_once(
            [functools.partial(enroll, servers[0], "racer-a"), functools.partial(enroll, servers[1], "racer-b")]
        )

    assert sorted(outcomes) == ["enrolled", "token-used"]


def test_a_node_is_served_by_either_replica_and_a_publish_wakes_its_long_poll_on_the_other(
    tmp_path: Path, database_url: str
) -> None:
    data = tmp_path / "data"
    node_id = "roaming-node"
    with _replicas(data, 2) as (first, second):
        identity = _enroll(first, tmp_path, node_id, _token(data, node_id))
        with node_client(first.base_url, identity) as on_first, node_client(second.base_url, identity) as on_second:
            epochs = [on_first.heartbeat(node_id).epoch, on_second.heartbeat(node_id).epoch]
            on_second.post_observation(observation(node_id, 1, 7))
            projection = on_first.serving()

            _publish(data, node_id, tmp_path)
            current = on_first.fetch_desired_state(node_id)
            poll = LongPoll(on_second, node_id, current.etag, wait_s=30)
            parked = not poll.answered_within(1.0)
            published = _publish(data, node_id, tmp_path)
            result = poll.outcome("the publish through the first replica answered the long-poll on the second", 40)

    assert epochs == [1, 1]
    assert projection.endpoints == []  # its observation (stored through the other replica) lists no engine
    assert parked
    assert isinstance(result, DesiredStateFetch) and result.status is FetchStatus.NEW, result
    assert result.generation == published == (current.generation or 0) + 1


@contextmanager
def _on_both_replicas(tmp_path: Path, node_id: str) -> Iterator[tuple[Path, list[ControlClient]]]:
    """Two replicas on ``tmp_path / "data"`` (yielded), ``node_id`` enrolled through the first, and a client of it
    on each that has heartbeated there (so each replica has read its epoch)."""
    data = tmp_path / "data"
    with _replicas(data, 2) as servers, ExitStack() as stack:
        identity = _enroll(servers[0], tmp_path, node_id, _token(data, node_id))
        clients = [stack.enter_context(node_client(server.base_url, identity)) for server in servers]
        for client in clients:
            client.heartbeat(node_id)
        yield data, clients


def test_a_fenced_epoch_is_refused_on_both_replicas(tmp_path: Path, database_url: str) -> None:
    node_id = "fenced-replica-node"
    with _on_both_replicas(tmp_path, node_id) as (data, clients):
        clients[0].post_observation(observation(node_id, 1, 1))
        cli(data, "fence", node_id)
        # Whether a replica has heard of the fence yet or not, the stale write is refused: from its memory if it
        # has, by the fenced upsert if it has not.
        stale = observation(node_id, 1, 2)
        refusals = [rejection(functools.partial(client.post_observation, stale)) for client in clients]
        epochs = [client.heartbeat(node_id).epoch for client in clients]
        database = Database(database_url)
        try:
            stored = [generation_of(r.body) for r in database.serving_observations() if r.node_id == node_id]
        finally:
            database.close()

    assert [(r.status, r.reason) for r in refusals] == [(409, "stale-epoch")] * 2
    assert epochs == [2, 2]
    assert stored == [1]


def test_a_cli_revocation_reaches_both_replicas(tmp_path: Path, database_url: str) -> None:
    node_id = "revoked-replica-node"
    with _on_both_replicas(tmp_path, node_id) as (data, clients):
        cli(data, "revoke", node_id)
        for client in clients:
            # NOTIFY reaches a replica about a round trip after the commit; the backstop bounds it at 2 s.
            wait_for(functools.partial(_refused, client, node_id), "the replica refuses the revoked certificate")


def test_a_revocation_ends_a_long_poll_parked_on_another_replica(tmp_path: Path, database_url: str) -> None:
    # The thief's long-poll is parked on one replica; the operator revokes the node through the CLI (its own process,
    # its own ControlPlane), which the other replicas hear of through the change feed. The parked request must end
    # with the refusal within the feed's bound (NOTIFY, else the 2 s backstop), not wait out its 60 s, and must not
    # be answered with the state published right after the revocation.
    data = tmp_path / "data"
    node_id = "parked-replica-node"
    with _replicas(data, 2) as (first, second):
        identity = _enroll(second, tmp_path, node_id, _token(data, node_id))
        _publish(data, node_id, tmp_path)
        with node_client(first.base_url, identity) as on_first:
            current = on_first.fetch_desired_state(node_id)
            poll = LongPoll(on_first, node_id, current.etag, wait_s=60)
            # The server is another process: give the request time to park, then check it has not been answered.
            parked = not poll.answered_within(1.0)
            cli(data, "revoke", node_id)
            _publish(data, node_id, tmp_path)
            ended = poll.outcome("the revocation ended the long-poll parked on the other replica")

    assert parked
    assert isinstance(ended, ControlPlaneRejected), f"the revoked certificate was answered: {ended}"
    assert (ended.status, ended.reason) == (403, "certificate-revoked")


def _refused(client: ControlClient, node_id: str) -> bool:
    try:
        client.heartbeat(node_id)
    except ControlPlaneRejected as exc:
        return exc.reason == "certificate-revoked"
    return False


@pytest.mark.slow
def test_no_observation_is_lost_in_a_burst(
    tmp_path: Path, store_backend: StoreBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 200 nodes post 4 observations each, one after the other, alternating between the replicas (one server on
    # SQLite), 32 at a time: whatever the batching, each node's last answered observation is what is stored.
    nodes, posts = 200, 4
    monkeypatch.setenv(DATABASE_URL_ENV, database_url_args(store_backend.location)[1])
    data = tmp_path / "data"
    with _replicas(data, 1 if store_backend.name == "sqlite" else 2) as servers:
        control = open_control_plane(data, database=database_url_args(store_backend.location)[1])
        try:
            node_ids = [f"burst-{i:03d}" for i in range(nodes)]
            tokens = {node_id: control.create_token(f"t-{node_id}", node_id=node_id) for node_id in node_ids}
        finally:
            control.close()
        identities = {node_id: _enroll(servers[0], tmp_path, node_id, token) for node_id, token in tokens.items()}

        def post_all(node_id: str) -> list[int]:
            clients = [node_client(server.base_url, identities[node_id]) for server in servers]
            try:
                for generation in range(1, posts + 1):
                    clients[generation % len(clients)].post_observation(observation(node_id, 1, generation))
            finally:
                for client in clients:
                    client.close()
            return list(range(1, posts + 1))

        with ThreadPoolExecutor(32) as pool:
            answered = dict(zip(identities, pool.map(post_all, identities), strict=True))
        database = store_backend.open()
        stored = {r.node_id: generation_of(r.body) for r in database.serving_observations() if r.node_id in identities}

    assert all(sent == list(range(1, posts + 1)) for sent in answered.values())
    assert stored == dict.fromkeys(identities, posts)
