"""The devserver's tables as SQLAlchemy Core sees them: what ``database.Database`` queries, on SQLite and PostgreSQL.

This is the schema the newest migration leaves (``migrations/versions/``); the migrations carry their own frozen
copies of the DDL, and ``tests/devserver/test_store_backends.py`` checks on both backends that an upgraded
database and these tables agree.

One schema for both backends, with two types that differ underneath:

* ``Stamp``, a point in time: RFC 3339 text on SQLite (``2026-01-01T00:00:00Z``, what the devserver always
  stored there, so files made before SQLAlchemy, and the tests that read them with ``sqlite3``, keep working)
  and ``timestamptz`` on PostgreSQL. Python sees an aware UTC ``datetime`` either way. The SQLite text has as
  many fractional digits as there are microseconds, so it sorts correctly only between values of the same
  precision: compare stamps in Python, not in SQL, on SQLite.
* ``COUNTER``, a generation or an epoch: ``bigint`` on PostgreSQL (``integer`` there is 32 bits), SQLite's
  ``INTEGER`` (64 bits) on SQLite.

``change_marker`` holds one row whose ``value`` the store bumps at the end of each publish, fence, enrollment and
revocation, stamping the node's ``nodes.change_seq`` with the new value: the row's lock orders those transactions,
so the stamps commit in order (``store.Database.nodes_changed_since``).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    CheckConstraint,
    Column,
    Dialect,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    PrimaryKeyConstraint,
    Table,
    Text,
    TypeDecorator,
)
from sqlalchemy.dialects import postgresql
from sqlalchemy.types import TypeEngine

from ansible_collections.meridian.node.plugins.module_utils.contracts import format_rfc3339

__all__ = [
    "CHANGE_MARKER_ROW",
    "COUNTER",
    "METADATA",
    "Stamp",
    "certificates",
    "change_marker",
    "desired_states",
    "nodes",
    "observations",
    "outbox_records",
    "tokens",
]

COUNTER = BigInteger().with_variant(Integer(), "sqlite")
# The one row of ``change_marker``.
CHANGE_MARKER_ROW = 1


class Stamp(TypeDecorator[datetime]):
    """An aware point in time: RFC 3339 text on SQLite, ``timestamptz`` on PostgreSQL (see the module doc)."""

    impl = Text
    cache_ok = True

    def load_dialect_impl(self, dialect: Dialect) -> TypeEngine[Any]:
        if dialect.name == "postgresql":
            return dialect.type_descriptor(postgresql.TIMESTAMP(timezone=True))
        return dialect.type_descriptor(Text())

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> Any:
        if value is None:
            return None
        if value.utcoffset() is None:
            # A naive time would be read back as the server's or the file's idea of local time.
            raise ValueError(f"a stored time must carry its offset (UTC), got the naive {value.isoformat()}")
        return value.astimezone(UTC) if dialect.name == "postgresql" else format_rfc3339(value)

    def process_result_value(self, value: Any, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        parsed = value if isinstance(value, datetime) else datetime.fromisoformat(str(value))
        return parsed.astimezone(UTC)


METADATA = MetaData()

tokens = Table(
    "tokens",
    METADATA,
    Column("name", Text, primary_key=True),
    Column("value_sha256", Text, nullable=False, unique=True),
    Column("created_at", Stamp, nullable=False),
    Column("used_at", Stamp),
    Column("used_by", Text),
    # The one node id the token can enroll; NULL: any.
    Column("node_id", Text),
)

nodes = Table(
    "nodes",
    METADATA,
    Column("node_id", Text, primary_key=True),
    Column("epoch", COUNTER, nullable=False),
    Column("lease_expires_at", Stamp),
    Column("renewed_at", Stamp),
    Column("enrolled_at", Stamp),
    Column("revoked_at", Stamp),
    # The change_marker value of the node's last publish, fence, enrollment or revocation (migration r0003).
    Column("change_seq", COUNTER, nullable=False, server_default="0"),
    CheckConstraint("epoch >= 1", name="ck_nodes_epoch"),
    Index("ix_nodes_change_seq", "change_seq"),
)

certificates = Table(
    "certificates",
    METADATA,
    Column("serial", Text, primary_key=True),
    Column("node_id", Text, ForeignKey("nodes.node_id"), nullable=False),
    Column("issued_at", Stamp, nullable=False),
    Column("not_after", Stamp, nullable=False),
    Column("revoked_at", Stamp),
    # store.REVOKED_BY_OPERATOR or store.SUPERSEDED_BY_ENROLLMENT; NULL for revocations from before reasons.
    Column("revoked_reason", Text),
    Index("ix_certificates_node_id", "node_id"),
)

desired_states = Table(
    "desired_states",
    METADATA,
    Column("node_id", Text, ForeignKey("nodes.node_id"), nullable=False),
    Column("generation", COUNTER, nullable=False),
    Column("lease_epoch", COUNTER, nullable=False),
    Column("envelope", LargeBinary, nullable=False),
    Column("etag", Text, nullable=False),
    Column("published_at", Stamp, nullable=False),
    PrimaryKeyConstraint("node_id", "generation"),
    CheckConstraint("generation >= 1", name="ck_desired_states_generation"),
)

observations = Table(
    "observations",
    METADATA,
    Column("node_id", Text, ForeignKey("nodes.node_id"), primary_key=True),
    Column("lease_epoch", COUNTER, nullable=False),
    Column("observed_at", Stamp, nullable=False),
    Column("received_at", Stamp, nullable=False),
    Column("remote_host", Text, nullable=False),
    Column("body", Text, nullable=False),
)

# Written by ``outbox_import`` (an air-gapped node's records, by (node, sequence)); its stamps stay text.
outbox_records = Table(
    "outbox_records",
    METADATA,
    Column("node_id", Text, nullable=False),
    Column("sequence", COUNTER, nullable=False),
    Column("kind", Text, nullable=False),
    Column("sha256", Text, nullable=False),
    Column("result", Text, nullable=False),
    Column("imported_at", Text, nullable=False),
    Column("body", Text, nullable=False),
    PrimaryKeyConstraint("node_id", "sequence"),
)

change_marker = Table(
    "change_marker",
    METADATA,
    Column("id", Integer, primary_key=True, autoincrement=False),
    Column("value", COUNTER, nullable=False),
    CheckConstraint(f"id = {CHANGE_MARKER_ROW}", name="ck_change_marker_one_row"),
)
