"""The store's schema migrations (Alembic, agent/meridian_node_agent/devserver/store/migrations/): an empty database
and one left by the devserver before Alembic both arrive at the schema ``store/schema.py`` declares, on both backends.

"Agrees with the declared schema" is Alembic's own comparison (``compare_metadata``: tables, columns, types,
nullability, indexes, unique constraints) between the migrated database and ``schema.METADATA``.
"""

from __future__ import annotations

import sqlite3
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory

from ansible_collections.meridian.node.tests.support.at_once import at_once
from ansible_collections.meridian.node.tests.support.old_devserver_schema import BEFORE_TOKEN_BINDING, OLD_TOKENS_TABLE
from ansible_collections.meridian.node.tests.support.postgres import PostgresServer, StoreBackend
from meridian_node_agent.devserver.store import migrations
from meridian_node_agent.devserver.store.database import (
    SUPERSEDED_BY_ENROLLMENT,
    Database,
    DatabaseUnavailable,
    LeaseRecord,
    ObservationRecord,
    token_digest,
)
from meridian_node_agent.devserver.store.schema import METADATA

NOW = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)

# What the old code's _migrate had added by the time revocation reasons came: token binding only.
_BEFORE_REVOCATION_REASONS = BEFORE_TOKEN_BINDING + "ALTER TABLE tokens ADD COLUMN node_id TEXT;\n"
# What import-outbox (control/outbox_import.py) adds beside them.
_OUTBOX_RECORDS = """
CREATE TABLE IF NOT EXISTS outbox_records (
    node_id TEXT NOT NULL,
    sequence INTEGER NOT NULL,
    kind TEXT NOT NULL,
    sha256 TEXT NOT NULL,
    result TEXT NOT NULL,
    imported_at TEXT NOT NULL,
    body TEXT NOT NULL,
    PRIMARY KEY (node_id, sequence)
);
"""
# What the old code stored, as it stored it: RFC 3339 text.
_OLD_ROWS = [
    (
        "INSERT INTO tokens (name, value_sha256, created_at, used_at, used_by) VALUES (?, ?, ?, ?, ?)",
        ("rack-1", token_digest("used-token-value"), "2026-01-01T00:00:00Z", "2026-01-01T00:01:00Z", "gpu-old"),
    ),
    (
        "INSERT INTO tokens (name, value_sha256, created_at) VALUES (?, ?, ?)",
        ("spare", token_digest("spare-token-value"), "2026-01-01T00:00:00Z"),
    ),
    (
        "INSERT INTO nodes (node_id, epoch, lease_expires_at, renewed_at, enrolled_at) VALUES (?, ?, ?, ?, ?)",
        ("gpu-old", 3, "2026-01-01T00:01:30Z", "2026-01-01T00:01:00Z", "2026-01-01T00:01:00Z"),
    ),
    (
        "INSERT INTO certificates (serial, node_id, issued_at, not_after, revoked_at) VALUES (?, ?, ?, ?, ?)",
        ("c0", "gpu-old", "2025-12-01T00:00:00Z", "2026-01-31T00:00:00Z", "2026-01-01T00:01:00Z"),
    ),
    (
        "INSERT INTO certificates (serial, node_id, issued_at, not_after) VALUES (?, ?, ?, ?)",
        ("c1", "gpu-old", "2026-01-01T00:01:00Z", "2026-01-31T00:01:00.250000Z"),
    ),
    (
        "INSERT INTO desired_states VALUES (?, ?, ?, ?, ?, ?)",
        ("gpu-old", 7, 3, b'{"payload":"old"}', '"etag-7"', "2026-01-01T00:02:00Z"),
    ),
    (
        "INSERT INTO observations VALUES (?, ?, ?, ?, ?, ?)",
        ("gpu-old", 3, "2026-01-01T00:02:30Z", "2026-01-01T00:02:31Z", "10.1.2.3", '{"old":true}'),
    ),
]


def _differences(url: str) -> list[Any]:
    """What Alembic finds between the database at ``url`` and the declared schema (empty: they agree)."""
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            return list(compare_metadata(MigrationContext.configure(conn), METADATA))
    finally:
        engine.dispose()


def _differences_but_old_sqlite_keys(url: str) -> list[Any]:
    """``_differences``, less one that SQLite files from before Alembic keep: their TEXT PRIMARY KEY columns admit
    NULL (SQLite's legacy, unless NOT NULL is said), where the declared schema says NOT NULL. The store never
    writes a NULL key; saying NOT NULL there would mean rebuilding every table with all its rows."""
    primary_keys = {(table.name, column.name) for table in METADATA.tables.values() for column in table.primary_key}
    return [
        difference
        for difference in _differences(url)
        if not (
            isinstance(difference, list)
            and len(difference) == 1
            and difference[0][0] == "modify_nullable"
            and (difference[0][2], difference[0][3]) in primary_keys
        )
    ]


def _version(url: str) -> str | None:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()
    finally:
        engine.dispose()


def _sqlalchemy_url(backend: StoreBackend) -> str:
    return backend.location if backend.name == "postgresql" else f"sqlite:///{backend.location}"


def test_head_is_the_newest_revision_in_the_package() -> None:
    config = Config()
    config.set_main_option("script_location", str(Path(migrations.__file__).parent))
    assert ScriptDirectory.from_config(config).get_current_head() == migrations.HEAD


def test_an_empty_database_is_migrated_to_the_declared_schema(store_backend: StoreBackend) -> None:
    database = store_backend.open()
    url = _sqlalchemy_url(store_backend)

    assert _version(url) == migrations.HEAD
    assert _differences(url) == []
    assert database.nodes() == []


def test_an_empty_postgresql_is_upgraded_step_by_step_and_back(postgres_database: str) -> None:
    """Each revision on its own, as an operator's database meets them across releases; and down again."""
    config = Config()
    config.set_main_option("script_location", str(Path(migrations.__file__).parent))
    engine = sa.create_engine(postgres_database)
    try:
        with engine.begin() as conn:
            config.attributes["connection"] = conn
            command.upgrade(config, "0001")
            assert MigrationContext.configure(conn).get_current_revision() == "0001"
            assert "change_marker" not in sa.inspect(conn).get_table_names()
            command.upgrade(config, "head")
            command.downgrade(config, "base")
            assert set(sa.inspect(conn).get_table_names()) == {"alembic_version"}
    finally:
        engine.dispose()

    Database(postgres_database).close()
    assert _version(postgres_database) == migrations.HEAD
    assert _differences(postgres_database) == []


@pytest.mark.parametrize(
    "script",
    [
        pytest.param(BEFORE_TOKEN_BINDING, id="before-token-binding"),
        pytest.param(_BEFORE_REVOCATION_REASONS, id="before-revocation-reasons"),
        pytest.param(_BEFORE_REVOCATION_REASONS + _OUTBOX_RECORDS, id="with-outbox-records"),
    ],
)
def test_a_sqlite_file_from_before_alembic_is_adopted_with_its_data(tmp_path: Path, script: str) -> None:
    path = tmp_path / "devserver.sqlite3"
    with sqlite3.connect(path) as old:
        old.executescript(script)
        for statement, values in _OLD_ROWS:
            old.execute(statement, values)
    old.close()

    database = Database(str(path))

    assert _version(f"sqlite:///{path}") == migrations.HEAD
    assert _differences_but_old_sqlite_keys(f"sqlite:///{path}") == []
    # What was stored reads back as it was; the columns added are NULL (unbound tokens, no reasons).
    when = datetime(2026, 1, 1, 0, 1, tzinfo=UTC)
    assert database.lease("gpu-old") == LeaseRecord("gpu-old", 3, when + timedelta(seconds=30), when)
    revoked, current = database.certificate("c0"), database.certificate("c1")
    assert revoked is not None and revoked.revoked_at == when and revoked.revoked_reason is None
    assert current is not None and current.not_after == datetime(2026, 1, 31, 0, 1, 0, 250000, tzinfo=UTC)
    latest = database.latest_desired("gpu-old")
    assert latest is not None and (latest.generation, latest.envelope) == (7, b'{"payload":"old"}')
    assert database.serving_observations() == [ObservationRecord("gpu-old", 3, "10.1.2.3", '{"old":true}')]
    # And it goes on as any database: the old unbound token enrolls any node, the next generation follows on.
    database.enroll(
        token="spare-token-value", node_id="gpu-new", serial="c2", not_after=NOW, lease_for=timedelta(30), now=NOW
    )
    assert database.publish("gpu-old", lambda g, e: (b"{}", f'"{g}-{e}"'), NOW).generation == 8
    database.put_token("bound", "bound-token-value", NOW, "gpu-old")
    assert (
        database.enroll(
            token="bound-token-value", node_id="gpu-old", serial="c3", not_after=NOW, lease_for=timedelta(30), now=NOW
        ).superseded
        == 1
    )
    superseded = database.certificate("c1")
    assert superseded is not None and superseded.revoked_reason == SUPERSEDED_BY_ENROLLMENT
    database.close()


def test_a_sqlite_file_holding_only_old_tokens_gains_the_other_tables(tmp_path: Path) -> None:
    path = tmp_path / "devserver.sqlite3"
    with sqlite3.connect(path) as old:
        old.executescript(OLD_TOKENS_TABLE)
    old.close()

    Database(str(path)).close()

    assert _differences_but_old_sqlite_keys(f"sqlite:///{path}") == []


def test_a_database_at_the_head_opens_with_one_statement(store_backend: StoreBackend) -> None:
    store_backend.open()  # migrates
    again = store_backend.open()
    assert (again.statement_count, again.commit_count) == (1, 0)


def test_two_processes_opening_one_empty_database_at_once_migrate_it_once(store_backend: StoreBackend) -> None:
    at_once([store_backend.open, store_backend.open])  # an error either one raised fails the test here

    assert _version(_sqlalchemy_url(store_backend)) == migrations.HEAD
    assert _differences(_sqlalchemy_url(store_backend)) == []


# Opening errors, for people


def test_a_database_a_newer_devserver_migrated_is_refused_untouched(store_backend: StoreBackend) -> None:
    store_backend.open()
    engine = sa.create_engine(_sqlalchemy_url(store_backend))
    try:
        with engine.begin() as conn:
            conn.execute(sa.text("UPDATE alembic_version SET version_num = '9999'"))
    finally:
        engine.dispose()

    with pytest.raises(DatabaseUnavailable) as refused:
        store_backend.open()

    assert "at revision '9999', which this devserver does not know" in str(refused.value)
    assert _version(_sqlalchemy_url(store_backend)) == "9999"


@pytest.mark.parametrize(
    ("location", "says"),
    [
        pytest.param("mysql://admin:hunter2@db.example/meridian", "names 'mysql'", id="another-engine"),
        pytest.param("postgresql+psycopg2://u:hunter2@h/d", "names 'postgresql+psycopg2'", id="another-driver"),
        pytest.param("", "the database location is empty", id="empty"),
    ],
)
def test_a_location_the_devserver_cannot_use_is_refused_without_the_password(location: str, says: str) -> None:
    with pytest.raises(DatabaseUnavailable) as refused:
        Database(location)
    message = str(refused.value)
    assert says in message and "postgresql+psycopg://USER:PASSWORD@HOST:PORT/DATABASE" in message
    assert "hunter2" not in message


def test_a_postgresql_that_does_not_answer_is_named_with_the_fix(postgres_server: PostgresServer) -> None:
    with pytest.raises(DatabaseUnavailable) as refused:
        Database(f"postgresql+psycopg://meridian:hunter2@127.0.0.1:{postgres_server.port}/no_such_database")
    message = str(refused.value)
    assert "postgresql+psycopg://meridian:***@127.0.0.1" in message and "hunter2" not in message
    assert "no_such_database" in message and "the database must exist" in message


def test_a_sqlite_file_in_a_missing_directory_is_named_with_the_fix(tmp_path: Path) -> None:
    with pytest.raises(DatabaseUnavailable) as refused:
        Database(str(tmp_path / "missing" / "devserver.sqlite3"))
    assert "check that its directory exists" in str(refused.value)
