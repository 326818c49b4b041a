"""The schema as the devserver kept it before Alembic: created where missing, completed where old.

Revision 0001. A database from before Alembic has no ``alembic_version`` and so runs this revision too: each
table is created only if it is missing (the old code made them with ``CREATE TABLE IF NOT EXISTS``;
``outbox_records`` appears only after an ``import-outbox``), and the two columns the old code added when it
opened a database are added if missing: ``tokens.node_id`` (tokens made before binding stay unbound, NULL) and
``certificates.revoked_reason`` (revocations from before reasons keep none, NULL). On SQLite the types are the old
ones (times as RFC 3339 text); on PostgreSQL times are ``timestamptz`` and counters ``bigint``.

One difference an adopted SQLite file keeps: its TEXT PRIMARY KEY columns admit NULL (SQLite's legacy where NOT
NULL is not said), while tables made here say NOT NULL. The store never writes a NULL key, and saying it there
would mean rebuilding each table with all its rows (SQLite cannot alter a column).

Revision ID: 0001
Revises: (none)
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

STAMP = sa.Text().with_variant(postgresql.TIMESTAMP(timezone=True), "postgresql")
COUNTER = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    inspector = sa.inspect(op.get_bind())
    present = set(inspector.get_table_names())

    def columns(table: str) -> set[str]:
        return {column["name"] for column in inspector.get_columns(table)}

    if "tokens" not in present:
        op.create_table(
            "tokens",
            sa.Column("name", sa.Text(), primary_key=True),
            sa.Column("value_sha256", sa.Text(), nullable=False, unique=True),
            sa.Column("created_at", STAMP, nullable=False),
            sa.Column("used_at", STAMP),
            sa.Column("used_by", sa.Text()),
            sa.Column("node_id", sa.Text()),
        )
    elif "node_id" not in columns("tokens"):
        op.add_column("tokens", sa.Column("node_id", sa.Text()))
    if "nodes" not in present:
        op.create_table(
            "nodes",
            sa.Column("node_id", sa.Text(), primary_key=True),
            sa.Column("epoch", COUNTER, nullable=False),
            sa.Column("lease_expires_at", STAMP),
            sa.Column("renewed_at", STAMP),
            sa.Column("enrolled_at", STAMP),
            sa.Column("revoked_at", STAMP),
            sa.CheckConstraint("epoch >= 1", name="ck_nodes_epoch"),
        )
    if "certificates" not in present:
        op.create_table(
            "certificates",
            sa.Column("serial", sa.Text(), primary_key=True),
            sa.Column("node_id", sa.Text(), sa.ForeignKey("nodes.node_id"), nullable=False),
            sa.Column("issued_at", STAMP, nullable=False),
            sa.Column("not_after", STAMP, nullable=False),
            sa.Column("revoked_at", STAMP),
            sa.Column("revoked_reason", sa.Text()),
        )
    elif "revoked_reason" not in columns("certificates"):
        op.add_column("certificates", sa.Column("revoked_reason", sa.Text()))
    if "desired_states" not in present:
        op.create_table(
            "desired_states",
            sa.Column("node_id", sa.Text(), sa.ForeignKey("nodes.node_id"), nullable=False),
            sa.Column("generation", COUNTER, nullable=False),
            sa.Column("lease_epoch", COUNTER, nullable=False),
            sa.Column("envelope", sa.LargeBinary(), nullable=False),
            sa.Column("etag", sa.Text(), nullable=False),
            sa.Column("published_at", STAMP, nullable=False),
            sa.PrimaryKeyConstraint("node_id", "generation"),
            sa.CheckConstraint("generation >= 1", name="ck_desired_states_generation"),
        )
    if "observations" not in present:
        op.create_table(
            "observations",
            sa.Column("node_id", sa.Text(), sa.ForeignKey("nodes.node_id"), primary_key=True),
            sa.Column("lease_epoch", COUNTER, nullable=False),
            sa.Column("observed_at", STAMP, nullable=False),
            sa.Column("received_at", STAMP, nullable=False),
            sa.Column("remote_host", sa.Text(), nullable=False),
            sa.Column("body", sa.Text(), nullable=False),
        )
    if "outbox_records" not in present:
        op.create_table(
            "outbox_records",
            sa.Column("node_id", sa.Text(), nullable=False),
            sa.Column("sequence", COUNTER, nullable=False),
            sa.Column("kind", sa.Text(), nullable=False),
            sa.Column("sha256", sa.Text(), nullable=False),
            sa.Column("result", sa.Text(), nullable=False),
            sa.Column("imported_at", sa.Text(), nullable=False),
            sa.Column("body", sa.Text(), nullable=False),
            sa.PrimaryKeyConstraint("node_id", "sequence"),
        )


def downgrade() -> None:
    for table in ("outbox_records", "observations", "desired_states", "certificates", "nodes", "tokens"):
        op.drop_table(table)
