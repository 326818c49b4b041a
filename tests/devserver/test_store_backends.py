"""The devserver's store, every method, on both backends: SQLite (a file) and a real PostgreSQL.

Each test gets an empty database of its own (``store_backend``, tests/support/postgres.py), migrated when the
first ``Database`` opens it; a test
that needs two server processes on one database opens a second ``Database`` on the same location. The statement
counts are what the store sends (``Database.statement_count``): a batch costs a bounded handful of statements,
whatever its size.
"""

from __future__ import annotations

import functools
from datetime import UTC, datetime, timedelta

import pytest

from ansible_collections.meridian.node.tests.support.at_once import at_once
from ansible_collections.meridian.node.tests.support.postgres import StoreBackend
from meridian_node_agent.devserver.store.database import (
    REVOKED_BY_OPERATOR,
    SUPERSEDED_BY_ENROLLMENT,
    Database,
    LeaseRecord,
    ObservationRecord,
    ObservationWrite,
    StoreConflict,
    UnknownNode,
)

NOW = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
LEASE = timedelta(seconds=30)
LONG_AGO = datetime(1970, 1, 1, tzinfo=UTC)


@pytest.fixture
def database(store_backend: StoreBackend) -> Database:
    return store_backend.open()


def _build(generation: int, epoch: int) -> tuple[bytes, str]:
    return f'{{"generation":{generation},"epoch":{epoch}}}'.encode(), f'"{generation}-{epoch}"'


def _enroll(database: Database, node_id: str, serial: str, *, now: datetime = NOW) -> int:
    """Enroll ``node_id`` with a token made for it; returns how many earlier certificates that superseded."""
    token = f"token-for-{serial}-{node_id}"
    database.put_token(f"t-{serial}-{node_id}", token, now, node_id)
    return database.enroll(
        token=token, node_id=node_id, serial=serial, not_after=now + timedelta(days=30), lease_for=LEASE, now=now
    ).superseded


def _observation(node_id: str, epoch: int, note: str) -> str:
    return f'{{"node_id":"{node_id}","lease_epoch":{epoch},"observed_at":"2026-03-01T11:59:00Z","note":"{note}"}}'


# Tokens


def test_bound_token_enrolls_only_its_node_and_stays_unused_when_refused(database: Database) -> None:
    database.put_token("rack-1", "bound-token-value", NOW, "gpu-a")

    with pytest.raises(StoreConflict) as wrong:
        database.enroll(
            token="bound-token-value", node_id="gpu-b", serial="b1", not_after=NOW, lease_for=LEASE, now=NOW
        )
    enrolled = database.enroll(
        token="bound-token-value", node_id="gpu-a", serial="a1", not_after=NOW, lease_for=LEASE, now=NOW
    )

    assert wrong.value.reason == "token-wrong-node"
    assert "gpu-a" not in wrong.value.detail and "gpu-a" in (wrong.value.server_note or "")
    assert enrolled.lease == LeaseRecord("gpu-a", 1, NOW + LEASE, NOW)
    assert [row.node_id for row in database.nodes()] == ["gpu-a"]


def test_unbound_token_enrolls_any_node_once(database: Database) -> None:
    database.put_token("open", "unbound-token-value", NOW)
    database.enroll(token="unbound-token-value", node_id="gpu-z", serial="z1", not_after=NOW, lease_for=LEASE, now=NOW)

    with pytest.raises(StoreConflict) as reused:
        database.enroll(
            token="unbound-token-value", node_id="gpu-y", serial="y1", not_after=NOW, lease_for=LEASE, now=NOW
        )
    with pytest.raises(StoreConflict) as unknown:
        database.enroll(token="never-made-value", node_id="gpu-y", serial="y1", not_after=NOW, lease_for=LEASE, now=NOW)

    assert reused.value.reason == "token-used" and "2026-03-01T12:00:00Z" in reused.value.detail
    assert unknown.value.reason == "token-unknown"
    assert database.certificate("y1") is None


def test_used_token_name_is_not_reused_and_an_unused_one_is_replaced(database: Database) -> None:
    database.put_token("t", "first-value-0001", NOW)
    database.put_token("t", "second-value-002", NOW)  # unused: replaced
    with pytest.raises(StoreConflict) as old_value:
        database.enroll(token="first-value-0001", node_id="gpu-a", serial="1", not_after=NOW, lease_for=LEASE, now=NOW)
    database.enroll(token="second-value-002", node_id="gpu-a", serial="1", not_after=NOW, lease_for=LEASE, now=NOW)

    with pytest.raises(StoreConflict) as used:
        database.put_token("t", "third-value-0003", NOW)
    with pytest.raises(StoreConflict) as same_value:
        database.put_token("other", "second-value-002", NOW)

    assert old_value.value.reason == "token-unknown"
    assert used.value.reason == "token-used" and "'gpu-a'" in used.value.detail
    assert same_value.value.reason == "token-exists"


# Enrollment, renewal, leases, fence, revoke


def test_enrolling_again_supersedes_the_earlier_certificates(database: Database) -> None:
    assert _enroll(database, "gpu-a", "s1") == 0
    database.add_renewed_certificate(node_id="gpu-a", presented_serial="s1", serial="s2", not_after=NOW, now=NOW)

    later = NOW + timedelta(minutes=5)
    superseded = _enroll(database, "gpu-a", "s3", now=later)

    first, renewed, current = (database.certificate(serial) for serial in ("s1", "s2", "s3"))
    assert superseded == 2
    assert first is not None and first.revoked_at == later and first.revoked_reason == SUPERSEDED_BY_ENROLLMENT
    assert renewed is not None and renewed.revoked_reason == SUPERSEDED_BY_ENROLLMENT
    assert current is not None and current.revoked_at is None and current.node_id == "gpu-a"
    assert database.nodes()[0].certificates == 1


def test_renewal_adds_a_certificate_unless_the_presented_one_is_revoked_or_foreign(database: Database) -> None:
    _enroll(database, "gpu-a", "a1")
    _enroll(database, "gpu-b", "b1")

    lease = database.add_renewed_certificate(
        node_id="gpu-a", presented_serial="a1", serial="a2", not_after=NOW + timedelta(days=60), now=NOW
    )
    with pytest.raises(StoreConflict) as foreign:
        database.add_renewed_certificate(node_id="gpu-a", presented_serial="b1", serial="a3", not_after=NOW, now=NOW)
    database.revoke("gpu-b", NOW)
    with pytest.raises(StoreConflict) as revoked:
        database.add_renewed_certificate(node_id="gpu-b", presented_serial="b1", serial="b2", not_after=NOW, now=NOW)

    renewed = database.certificate("a2")
    assert lease == LeaseRecord("gpu-a", 1, NOW + LEASE, NOW)
    assert renewed is not None and renewed.not_after == NOW + timedelta(days=60) and renewed.revoked_at is None
    presented = database.certificate("a1")
    assert presented is not None and presented.revoked_at is None  # valid until it expires
    assert foreign.value.reason == "certificate-unknown"
    assert revoked.value.reason == "certificate-revoked"
    assert database.certificate("a3") is None and database.certificate("b2") is None


def test_lease_renewal_moves_the_expiry_and_keeps_the_epoch(database: Database) -> None:
    _enroll(database, "gpu-a", "a1")
    database.fence("gpu-a")
    later = NOW + timedelta(seconds=20)

    renewed = database.renew_lease("gpu-a", LEASE, later)

    assert renewed == LeaseRecord("gpu-a", 2, later + LEASE, later)
    assert database.lease("gpu-a") == renewed
    with pytest.raises(UnknownNode):
        database.renew_lease("gpu-never", LEASE, later)
    with pytest.raises(UnknownNode):
        database.lease("gpu-never")


def test_node_known_only_from_a_publish_has_a_lease_that_lapsed_long_ago(database: Database) -> None:
    database.publish("gpu-new", _build, NOW)
    assert database.lease("gpu-new") == LeaseRecord("gpu-new", 1, LONG_AGO, LONG_AGO)


def test_fence_bumps_the_epoch_by_one(database: Database) -> None:
    _enroll(database, "gpu-a", "a1")
    assert [database.fence("gpu-a") for _ in range(3)] == [2, 3, 4]
    assert database.lease("gpu-a").epoch == 4
    with pytest.raises(UnknownNode):
        database.fence("gpu-never")


def test_revoke_counts_the_valid_certificates_and_marks_the_node(database: Database) -> None:
    _enroll(database, "gpu-a", "a1")
    database.add_renewed_certificate(node_id="gpu-a", presented_serial="a1", serial="a2", not_after=NOW, now=NOW)

    assert database.revoke("gpu-a", NOW) == 2
    assert database.revoke("gpu-a", NOW) == 0
    record = database.certificate("a2")
    assert record is not None and record.revoked_at == NOW and record.revoked_reason == REVOKED_BY_OPERATOR
    row = database.nodes()[0]
    assert (row.revoked_at, row.certificates) == (NOW, 0)
    with pytest.raises(UnknownNode):
        database.revoke("gpu-never", NOW)


# Desired state


def test_publish_assigns_generations_and_the_current_epoch(database: Database) -> None:
    first = database.publish("gpu-a", _build, NOW)
    database.fence("gpu-a")
    second = database.publish("gpu-a", _build, NOW)

    assert (first.generation, first.lease_epoch, second.generation, second.lease_epoch) == (1, 1, 2, 2)
    assert database.latest_desired("gpu-a") == second
    assert database.latest_desired("gpu-b") is None
    assert second.envelope == b'{"generation":2,"epoch":2}'


def test_failed_build_consumes_no_generation(database: Database) -> None:
    def explode(generation: int, epoch: int) -> tuple[bytes, str]:
        raise ValueError("signing failed")

    with pytest.raises(ValueError, match="signing failed"):
        database.publish("gpu-a", explode, NOW)
    assert database.publish("gpu-a", _build, NOW).generation == 1


def test_concurrent_publishes_from_two_processes_get_distinct_generations(store_backend: StoreBackend) -> None:
    """Two ``Database`` objects (two server processes, or serve and the CLI) on one database, two threads."""
    databases = [store_backend.open(), store_backend.open()]
    per_writer = 15

    def publish(database: Database) -> list[int]:
        return [database.publish("gpu-raced", _build, NOW).generation for _ in range(per_writer)]

    per_database = at_once([functools.partial(publish, database) for database in databases])

    generations = [generation for published in per_database for generation in published]
    assert sorted(generations) == list(range(1, per_writer * len(databases) + 1))
    latest = databases[0].latest_desired("gpu-raced")
    assert latest is not None and latest.generation == per_writer * len(databases)


# Observations


def test_observation_of_a_fenced_writer_is_refused(database: Database) -> None:
    _enroll(database, "gpu-a", "a1")
    database.record_observation("gpu-a", 1, NOW, "10.0.0.7", _observation("gpu-a", 1, "before"), NOW)
    database.fence("gpu-a")

    with pytest.raises(StoreConflict) as stale:
        database.record_observation("gpu-a", 1, NOW, "10.0.0.8", _observation("gpu-a", 1, "stale"), NOW)
    with pytest.raises(StoreConflict) as future:
        database.record_observation("gpu-a", 3, NOW, "10.0.0.8", _observation("gpu-a", 3, "future"), NOW)
    with pytest.raises(UnknownNode):
        database.record_observation("gpu-never", 1, NOW, "10.0.0.8", "{}", NOW)

    assert stale.value.reason == "stale-epoch" and "epoch 1" in stale.value.detail
    assert future.value.reason == "future-epoch"
    assert database.serving_observations() == [
        ObservationRecord("gpu-a", 1, "10.0.0.7", _observation("gpu-a", 1, "before"))
    ]
    database.record_observation("gpu-a", 2, NOW, "10.0.0.9", _observation("gpu-a", 2, "after"), NOW)
    assert database.serving_observations()[0].remote_host == "10.0.0.9"


def test_serving_observations_leave_out_revoked_nodes_and_come_in_node_order(database: Database) -> None:
    # '-' and '.' sort differently under some PostgreSQL collations: the order is the bytes'.
    for node_id in ("gpu.b", "gpu-c", "gpu-a", "gpu-r"):
        _enroll(database, node_id, f"s-{node_id}")
        database.record_observation(node_id, 1, NOW, "10.0.0.1", _observation(node_id, 1, "x"), NOW)
    database.revoke("gpu-r", NOW)

    assert [record.node_id for record in database.serving_observations()] == ["gpu-a", "gpu-c", "gpu.b"]


def test_nodes_lists_each_node_with_its_latest_generation_and_observation(database: Database) -> None:
    _enroll(database, "gpu-b", "b1")
    database.publish("gpu-b", _build, NOW)
    database.publish("gpu-b", _build, NOW)
    observed = NOW - timedelta(seconds=5)
    database.record_observation("gpu-b", 1, observed, "10.0.0.2", _observation("gpu-b", 1, "x"), NOW)
    database.publish("gpu-a", _build, NOW)  # known from a publish only

    rows = database.nodes()

    assert [row.node_id for row in rows] == ["gpu-a", "gpu-b"]
    only_published, enrolled = rows
    assert (only_published.epoch, only_published.enrolled_at, only_published.lease_expires_at) == (1, None, None)
    assert (only_published.certificates, only_published.generation, only_published.last_observed_at) == (0, 1, None)
    assert (enrolled.enrolled_at, enrolled.lease_expires_at, enrolled.revoked_at) == (NOW, NOW + LEASE, None)
    assert (enrolled.certificates, enrolled.generation, enrolled.last_observed_at) == (1, 2, observed)


def test_stamps_keep_their_microseconds(database: Database) -> None:
    precise = datetime(2026, 3, 1, 12, 0, 0, 123456, tzinfo=UTC)
    _enroll(database, "gpu-a", "a1", now=precise)
    assert database.lease("gpu-a") == LeaseRecord("gpu-a", 1, precise + LEASE, precise)


# Changed nodes: what a server's backstop reads


def test_changed_nodes_include_another_process_publish_and_fence(store_backend: StoreBackend) -> None:
    server, operator = store_backend.open(), store_backend.open()
    seen = server.last_change_seq()
    operator.nodes()
    assert server.nodes_changed_since(seen) == []  # a read is no change

    operator.publish("gpu-a", _build, NOW)
    after_publish = server.nodes_changed_since(seen)
    operator.fence("gpu-a")
    after_fence = server.nodes_changed_since(after_publish[0].change_seq)

    assert [(n.node_id, n.generation, n.epoch) for n in after_publish] == [("gpu-a", 1, 1)]
    assert [(n.node_id, n.generation, n.epoch) for n in after_fence] == [("gpu-a", 1, 2)]


def test_lease_and_observation_writes_change_no_node(database: Database) -> None:
    _enroll(database, "gpu-a", "s-gpu-a")
    seen = database.last_change_seq()
    database.renew_leases({"gpu-a": (NOW, NOW + LEASE)})
    database.record_observations([("gpu-a", 1, _observation("gpu-a", 1, "steady").encode(), NOW)])
    assert database.nodes_changed_since(seen) == []


def test_asking_for_changed_nodes_costs_one_statement(database: Database) -> None:
    database.publish("gpu-a", _build, NOW)
    seen = database.last_change_seq() - 1
    before = database.statement_count
    answers = [database.nodes_changed_since(seen) for _ in range(10)]
    assert database.statement_count - before == 10
    assert [[node.node_id for node in answer] for answer in answers] == [["gpu-a"]] * 10


# The batch writes the hot path flushes


def test_renew_leases_writes_every_known_node_and_ignores_unknown_ones(database: Database) -> None:
    for node_id in ("gpu-a", "gpu-b"):
        _enroll(database, node_id, f"s-{node_id}")
    database.fence("gpu-b")
    later = NOW + timedelta(seconds=9)

    database.renew_leases(
        {"gpu-a": (later, later + LEASE), "gpu-b": (later, later + 2 * LEASE), "gpu-x": (later, later)}
    )

    assert database.lease("gpu-a") == LeaseRecord("gpu-a", 1, later + LEASE, later)
    assert database.lease("gpu-b") == LeaseRecord("gpu-b", 2, later + 2 * LEASE, later)
    assert [row.node_id for row in database.nodes()] == ["gpu-a", "gpu-b"]


def test_a_flush_never_moves_a_lease_back_where_replicas_share_the_database(store_backend: StoreBackend) -> None:
    """A node that moved from one replica to the other was renewed by both; the slower flush carries the older
    renewal, and must not undo the newer one. (SQLite has one server, whose flushes only carry newer renewals.)"""
    if store_backend.name == "sqlite":
        pytest.skip("one server per SQLite file: no second writer of leases")
    one, other = store_backend.open(), store_backend.open()
    _enroll(one, "moved-node", "s-moved")
    newer, older = NOW + timedelta(seconds=20), NOW + timedelta(seconds=5)

    one.renew_leases({"moved-node": (newer, newer + LEASE)})
    other.renew_leases({"moved-node": (older, older + LEASE)})

    assert other.lease("moved-node") == LeaseRecord("moved-node", 1, newer + LEASE, newer)


def test_renew_leases_of_a_hundred_nodes_is_one_statement_in_one_transaction(database: Database) -> None:
    node_ids = [f"gpu-{index:03d}" for index in range(100)]
    for node_id in node_ids:
        database.publish(node_id, _build, NOW)
    statements, commits = database.statement_count, database.commit_count

    database.renew_leases({node_id: (NOW, NOW + LEASE) for node_id in node_ids})

    assert (database.statement_count - statements, database.commit_count - commits) == (1, 1)
    assert all(database.lease(node_id).expires_at == NOW + LEASE for node_id in node_ids)
    statements = database.statement_count
    database.renew_leases({})
    assert database.statement_count == statements


def test_record_observations_refuses_a_fenced_writers_rows_and_writes_the_others(database: Database) -> None:
    for node_id in ("gpu-a", "gpu-b", "gpu-c"):
        _enroll(database, node_id, f"s-{node_id}")
    database.record_observation("gpu-b", 1, NOW, "10.0.0.2", _observation("gpu-b", 1, "kept"), NOW)
    database.fence("gpu-b")
    received = NOW + timedelta(seconds=3)

    refused = database.record_observations(
        [
            ("gpu-a", 1, _observation("gpu-a", 1, "a").encode(), received),
            ("gpu-b", 1, _observation("gpu-b", 1, "stale").encode(), received),
            ("gpu-c", 1, _observation("gpu-c", 1, "c").encode(), received),
            ("gpu-x", 1, _observation("gpu-x", 1, "unknown").encode(), received),
            ("gpu-c", 5, _observation("gpu-c", 5, "future").encode(), received),
        ]
    )

    assert refused == ["gpu-b", "gpu-x", "gpu-c"]
    assert {record.node_id: record.body for record in database.serving_observations()} == {
        "gpu-a": _observation("gpu-a", 1, "a"),
        "gpu-b": _observation("gpu-b", 1, "kept"),
        "gpu-c": _observation("gpu-c", 1, "c"),
    }
    # The body's own observed_at; no address given: the node id stands in for a node never observed before.
    rows = {row.node_id: row for row in database.nodes()}
    assert rows["gpu-a"].last_observed_at == datetime(2026, 3, 1, 11, 59, tzinfo=UTC)
    assert [record.remote_host for record in database.serving_observations()] == ["gpu-a", "10.0.0.2", "gpu-c"]


def test_a_fence_by_one_process_refuses_the_old_epoch_in_another_processes_batch(
    store_backend: StoreBackend,
) -> None:
    first, second = store_backend.open(), store_backend.open()
    _enroll(first, "gpu-a", "a1")
    _enroll(first, "gpu-b", "b1")
    epoch = second.lease("gpu-a").epoch  # what the second process believes (its cache)

    assert first.fence("gpu-a") == epoch + 1
    refused = second.record_observations(
        [
            ("gpu-a", epoch, _observation("gpu-a", epoch, "fenced").encode(), NOW),
            ("gpu-b", 1, _observation("gpu-b", 1, "current").encode(), NOW),
        ]
    )

    assert refused == ["gpu-a"]
    assert [record.node_id for record in first.serving_observations()] == ["gpu-b"]


def test_record_observations_last_write_wins_per_node(database: Database) -> None:
    _enroll(database, "gpu-a", "a1")
    database.record_observation("gpu-a", 1, NOW, "10.0.0.1", _observation("gpu-a", 1, "online"), NOW)
    observed = NOW + timedelta(seconds=1)

    refused = database.record_observations(
        [
            ObservationWrite("gpu-a", 1, _observation("gpu-a", 1, "first").encode(), NOW, observed, "10.0.0.2"),
            ("gpu-a", 1, _observation("gpu-a", 1, "second").encode(), NOW),
            ("gpu-a", 0, _observation("gpu-a", 0, "older epoch, later in the batch").encode(), NOW),
        ]
    )

    assert refused == ["gpu-a"]
    # The last written row wins; with no address of its own it keeps the one stored.
    assert database.serving_observations() == [
        ObservationRecord("gpu-a", 1, "10.0.0.1", _observation("gpu-a", 1, "second"))
    ]


def test_record_observations_of_a_hundred_nodes_is_a_bounded_handful_of_statements(database: Database) -> None:
    node_ids = [f"gpu-{index:03d}" for index in range(100)]
    for node_id in node_ids:
        database.publish(node_id, _build, NOW)
    statements, commits = database.statement_count, database.commit_count

    refused = database.record_observations([(node_id, 1, b"{}", NOW) for node_id in node_ids])

    assert refused == []
    # One SELECT of the epochs (share-locked) and one executemany of the fenced upsert.
    assert (database.statement_count - statements, database.commit_count - commits) == (2, 1)
    assert len(database.serving_observations()) == 100
    statements = database.statement_count
    assert database.record_observations([]) == []
    assert database.statement_count == statements


def test_outbox_records_keep_their_digest_the_newest_imported_observation_and_refuse_a_reused_sequence(
    database: Database,
) -> None:
    assert database.outbox_record_digest("node-a", 1) is None
    assert database.newest_imported_observation("node-a") is None
    for sequence, kind, result in (
        (1, "observation", "imported"),
        (2, "journal", "imported"),
        (3, "observation", "superseded"),
    ):
        database.add_outbox_record(
            "node-a", sequence, kind=kind, sha256=f"{sequence:064x}", result=result, imported_at=NOW, body="{}"
        )
    assert database.outbox_record_digest("node-a", 2) == f"{2:064x}"
    # A superseded observation is recorded but is not the newest one imported.
    assert database.newest_imported_observation("node-a") == 1
    assert database.newest_imported_observation("node-b") is None
    with pytest.raises(StoreConflict) as refused:
        database.add_outbox_record(
            "node-a", 2, kind="journal", sha256="f" * 64, result="imported", imported_at=NOW, body="{}"
        )
    assert refused.value.reason == "sequence-reused"
    assert database.outbox_record_digest("node-a", 2) == f"{2:064x}"
