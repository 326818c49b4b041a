"""The change marker row PostgreSQL's long-polls read, and an index for a node's certificates.

Revision 0002. ``change_marker`` holds one row (``id`` 1), bumped by the store in each transaction that
publishes, fences, enrolls or revokes (``store.Database.change_marker``); SQLite has ``PRAGMA data_version`` and
never bumps it, but the table is there too: one schema on both backends. ``ix_certificates_node_id``: enrolling
and revoking update a node's certificates by node id, which was a scan of every certificate.

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

COUNTER = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    marker = op.create_table(
        "change_marker",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=False),
        sa.Column("value", COUNTER, nullable=False),
        sa.CheckConstraint("id = 1", name="ck_change_marker_one_row"),
    )
    op.bulk_insert(marker, [{"id": 1, "value": 0}])
    op.create_index("ix_certificates_node_id", "certificates", ["node_id"])


def downgrade() -> None:
    op.drop_index("ix_certificates_node_id", table_name="certificates")
    op.drop_table("change_marker")
