"""Each node's change sequence: which nodes changed since a server last looked, in one indexed statement.

Revision 0003. ``nodes.change_seq`` is the ``change_marker`` value of the last transaction that published to,
fenced, enrolled or revoked the node. Those transactions bump the marker row and then stamp the node with its new
value, on both backends, so they are serialized on the marker row and commit in the order of their values: a reader
that sees a value has seen every lower one. A server's backstop asks for the nodes whose ``change_seq`` is above the
highest it has seen (``store.Database.nodes_changed_since``) instead of comparing every node every 2 s
(``change_watcher.py``). Existing nodes start at 0, which every server's first full read covers.

Revision ID: 0003
Revises: 0002
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

COUNTER = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.add_column("nodes", sa.Column("change_seq", COUNTER, nullable=False, server_default="0"))
    op.create_index("ix_nodes_change_seq", "nodes", ["change_seq"])


def downgrade() -> None:
    op.drop_index("ix_nodes_change_seq", table_name="nodes")
    with op.batch_alter_table("nodes") as batch:
        batch.drop_column("change_seq")
